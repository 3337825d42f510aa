"""Paged MLA decode in the absorbed form: split-KV flash decoding over a 576-wide latent cache.

Implements :func:`mlaspec.spec.forms.mqa_latent_attention` (the op FlashMLA's dense decode computes) on a paged
cache: one KV head, ``H_q`` query heads, each cache entry ``[kv_c (512) | k_pe (64)]`` is the key and its first
``D_v = 512`` values are the value. Conventions as the spec (:mod:`mlaspec.spec.attention`): natural-log LSE laid
out ``[B, H_q, S_q]`` as FlashMLA's ``softmax_lse``; ``causal`` aligns the ``S_q`` queries (MTP) to the end of the
context; a row with no key gives output 0 and LSE ``-inf``.

Two caches, one kernel (``FP8`` is a compile-time flag): a cache in q's dtype, or vLLM's per-tensor fp8 cache
(``--kv-cache-dtype fp8``, the ``fp8_e4m3_per_tensor`` layout of :mod:`mlaspec.spec.cache_layouts`: 576 e4m3 bytes
per token, ``e4m3(x / k_scale)``), the op FlashMLA's dense fp8 decode computes for vLLM
(``vllm/model_executor/layers/attention/mla_attention.py``). The descale stays out of the inner loop, as FlashMLA
does: the bytes convert exactly to q's dtype (``e4m3`` has 4 significant bits), ``k_scale`` is folded into the
logit scale (``s = (q . e) * scale * k_scale``) and into the output (``out = k_scale * sum p e / sum p``), so no
rounding is added to what the 16-bit path does, and the traffic is half the bf16 cache. The 656-byte
``fp8_ds_mla`` token (per-128 scales, bf16 RoPE) is read by the sparse kernel, whose
:func:`mlaspec.impl.sparse.paged_decode` names every token through the block table (a dense decode over it).

**The e4m3 path** (``q`` in e4m3 with its ``q_scale``, over the per-tensor fp8 cache): FlashMLA's dense fp8 arithmetic,
as vLLM serves it (``vllm/v1/attention/ops/flashmla.py``, ``flash_mla_with_kvcache_fp8``): both products multiplied in
e4m3 and the softmax weights ``P`` rounded to e4m3 (:func:`mlaspec.impl.fp8.e4m3_round`); the fp8 MMAs' ~14-bit
accumulation promoted to fp32 every 64 logit columns (the harness's bias check: every 128 leaned) and, in 16-row
programs, every tile's ``P V``. On Hopper :func:`mlaspec.impl.decode_sm90.split_kernel_e4m3_keys`, 16 or 64 query rows
a program. Judged as the backend ``triton-e4m3`` under the numerics FlashMLA declares.

The naive computation, per sequence, and its memory traffic (``N = seq_len``, ``R = S_q * H_q`` query rows)::

    kv  = gather(cache, block_table[b])        # read N * 576 (each page once)    -> the bytes that matter
    s   = scale * q @ kv.T                     # read R * 576, write R * N        (logits to memory)
    p   = softmax(s)                           # read R * N, write R * N
    out = p @ kv[:, :512]                      # read R * N + N * 512 (again), write R * 512

The kernel keeps ``s`` and ``p`` on chip and reads each page once per block of query rows, so the traffic is the
cache (``N * 576`` elements) plus ``q`` and ``out``. With ``R <= 64`` rows per program the work is ~``2 * 64 *
1088 = 139k`` FLOP per 1152-byte entry: about 120 FLOP/byte, below Hopper's ~200 FLOP/byte ridge, so the decode is
bound by memory bandwidth, and all that matters is streaming the cache at full speed on every SM.

Structure (FlashDecoding; FlashMLA ``csrc/sm90/decode`` and vLLM ``vllm/v1/attention/ops/triton_decode_attention.py``
split the keys the same way):

1. ``_mla_decode_split_kernel``: grid ``(row blocks, splits, B)``. Each program takes ``BLOCK_M`` query rows (rows
   are ``(s, h)`` flattened in ``q``'s own order, so any ``H_q`` and ``S_q`` work) against the pages of its split,
   ``BLOCK_N`` keys at a time, with an online softmax in base 2 (``log2 e`` folded into the scale), the next key
   tile in flight during this one's dots (:func:`decode_config`: Triton's pipeliner needs 5 stages for that here).
   It writes a partial output and partial LSE (base 2) per split -- or, with one split, the final result directly.
2. ``_mla_decode_combine_kernel``: grid ``(R, B, D_V / BLOCK_D)``. Merges the splits by their LSE (the same math as
   :func:`mlaspec.spec.merge.merge_attn_states_n`) and converts the LSE to the natural log. With few rows each
   program takes 32 or 64 columns of one row and loads every split's partials at once (with many, a whole row): a loop
   over the splits one at a time, one program per row, took ~20 us at 16 heads, batch 1, 132 splits (more than the
   64K-key cache's own streaming; H200), and grew with the split count; 32 splits a load, 6 us. The first load's
   partials are issued before the LSEs' maximum, which they do not need: one L2 round trip fewer on the path, the
   combine alone 0.2-0.4 us shorter on an H200 at every shape timed (16 heads B1 1K 1.79 -> 1.41 us, B1 128K 2.75 ->
   2.50; 128 heads B1 64K 4.54 -> 4.32), the same outputs. After ``decode_sm90.split_kernel_keys`` it launches as
   that kernel's programmatic dependent (:data:`PDL_AFTER_KEYS`): its programs start beside the split kernel's and
   wait in ``griddepcontrol.wait`` for the partials. There, at 16 heads, its work after that wait takes about 0.7 us
   and 0.3 us a MB of partials (1.8-2.3 us at 128-132 splits, 4.2 MB) and the wait 0.3-0.6 (H200, the speed log's
   stop 62).

The number of splits comes from :func:`num_splits_heuristic` (fill the SMs once).

On Hopper, 64 rows a program over a 16-bit cache run the same math as :mod:`mlaspec.impl.decode_sm90` (Gluon):
there, the next key tile streams in during this one's dots, which Triton's pipeliner cannot fit beside a 64-row
``q`` in 227 KB, and each logit is computed once (:func:`use_sm90`); where the rows are two or more 64-row blocks
(128 heads) its ``split_kernel_lead``, whose leader warpgroup computes whole tiles' logits
(:func:`mlaspec.impl.decode_sm90.lead_applies`). Over the fp8 cache its ``split_kernel_fp8``
converts each tile in a producer warpgroup beside the MMAs (at two or more 64-row blocks that producer feeds
``split_kernel_lead``), and at 32 rows or fewer its ``split_kernel_fp8_keys``
multiplies with the keys as the MMAs' rows, no rows padded; so does its ``split_kernel_keys`` over a 16-bit cache at 16
rows or fewer (16 heads without MTP).
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaspec.spec.paged_cache import page_entries

from . import decode_sm90
from .fp8 import e4m3_round, e4m3_to

__all__ = [
    "GLUON_TILE",
    "KERNELS",
    "DecodeConfig",
    "DecodeOutput",
    "aligned16",
    "combine_config",
    "compiled_capability",
    "decode_config",
    "gluon_runs",
    "hopper_why_not",
    "kernel_named",
    "mla_decode_paged",
    "num_splits_heuristic",
    "page_cache",
    "sm90_why_not",
    "use_sm90",
]

KERNELS = ("auto", "triton", "sm90")  # which kernel: see gluon_runs (decode, indexer and sparse share them)

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): ln(x) = log2(x) * LN2


@triton.jit
def _mla_decode_split_kernel(
    Q,
    KV,
    BLOCK_TABLE,
    SEQ_LENS,  # q [B, S_q, H_q, D_V + D_ROPE], cache [num_pages, PAGE, D_V + D_ROPE] (FP8: bytes)
    O_PART,
    LSE_PART,  # [B, splits, R, D_V] fp32, [B, splits, R] fp32 (base 2): used unless SINGLE
    OUT,
    LSE,  # [B, S_q, H_q, D_V] q.dtype, [B, H_q, S_q] fp32 (natural log): used when SINGLE (one split)
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_btb,
    stride_ob,
    stride_os,
    stride_oh,
    stride_lb,
    stride_lh,
    stride_ls,
    qk_scale,  # softmax scale * k_scale * log2(e)
    k_scale,  # the value descale (1.0 unless FP8), applied once to the output
    S_Q,
    H_Q,
    blocks_per_split,
    num_splits,
    CAUSAL: tl.constexpr,
    D_V: tl.constexpr,
    D_ROPE: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    E4M3: tl.constexpr = False,  # q in e4m3 too: both products in e4m3, P rounded to e4m3 (the e4m3 path)
):
    pid_m, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    R = S_Q * H_Q

    # -- which query rows: (s, h) flattened as q stores them, row = s * H_q + h ----------------------------------
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < R
    s = rows // H_Q
    h = rows % H_Q
    offs_v = tl.arange(0, D_V)
    offs_r = tl.arange(0, D_ROPE)

    # -- which keys each row may see: all seq_len, or (causal) up to its own position at the end of the context --
    seq_len = tl.load(SEQ_LENS + b)
    if CAUSAL:
        n_keys = seq_len - S_Q + 1 + s  # [BLOCK_M]: query s sees keys j <= s + seq_len - S_q
    else:
        n_keys = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len

    # -- this split's key blocks (BLOCK_N keys each; PAGE // BLOCK_N blocks per page) ------------------------------
    SUB: tl.constexpr = PAGE // BLOCK_N
    n_blocks = tl.cdiv(seq_len, BLOCK_N)
    blk_lo = split * blocks_per_split
    blk_hi = tl.minimum(blk_lo + blocks_per_split, n_blocks)

    # -- load the query block once: read BLOCK_M * 576 (the 576 split as 512 nope + 64 rope for tl.dot) ------------
    q_base = Q + b.to(tl.int64) * stride_qb + s * stride_qs + h * stride_qh
    q_nope = tl.load(q_base[:, None] + offs_v[None, :], mask=row_ok[:, None], other=0)  # [BLOCK_M, D_V]
    q_rope = tl.load(q_base[:, None] + D_V + offs_r[None, :], mask=row_ok[:, None], other=0)  # [BLOCK_M, D_ROPE]
    if E4M3:  # e4m3 bytes: multiplied as they are (their descale q_scale sits in qk_scale)
        q_nope = q_nope.to(tl.float8e4nv, bitcast=True)
        q_rope = q_rope.to(tl.float8e4nv, bitcast=True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the base-2 logits
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)  # running sum of exp2(logit - m_i) * v
    offs_n = tl.arange(0, BLOCK_N)

    for blk in range(blk_lo, blk_hi):
        # -- the physical page holding these keys, and the keys' slots in it --------------------------------------
        page = tl.load(BLOCK_TABLE + b * stride_btb + blk // SUB).to(tl.int64)
        slots = (blk % SUB) * BLOCK_N + offs_n
        keys = blk * BLOCK_N + offs_n
        key_ok = keys < seq_len  # slots past the end may hold anything (NaN): never let them in
        kv_ptr = KV + page * stride_kp + slots[:, None] * stride_ks
        # read BLOCK_N * 576: the entries; their first D_V columns are also the values
        kv_nope = tl.load(kv_ptr + offs_v[None, :], mask=key_ok[:, None], other=0)  # [BLOCK_N, D_V]
        kv_rope = tl.load(kv_ptr + D_V + offs_r[None, :], mask=key_ok[:, None], other=0)  # [BLOCK_N, D_ROPE]
        if E4M3:  # the bytes as they are, for e4m3 products
            kv_nope = kv_nope.to(tl.float8e4nv, bitcast=True)
            kv_rope = kv_rope.to(tl.float8e4nv, bitcast=True)
        elif FP8:  # e4m3 bytes -> q's dtype, exact; k_scale sits in qk_scale and in the epilogue
            kv_nope = e4m3_to(kv_nope, Q.dtype.element_ty)
            kv_rope = e4m3_to(kv_rope, Q.dtype.element_ty)

        # -- logits in base 2: (q . k) * scale * log2(e), fp32 accumulation -----------------------------------------
        if E4M3:  # each 64 products added in fp32 (Hopper's fp8 MMA accumulates in ~14 bits; every 128 leaned)
            qk = tl.dot(q_nope, tl.trans(kv_nope), max_num_imprecise_acc=64)
            qk = tl.dot(q_rope, tl.trans(kv_rope), qk, max_num_imprecise_acc=64)
        else:
            qk = tl.dot(q_nope, tl.trans(kv_nope), input_precision=PRECISION)
            qk = tl.dot(q_rope, tl.trans(kv_rope), qk, input_precision=PRECISION)
        qk = qk * qk_scale
        allowed = key_ok[None, :] & (keys[None, :] < n_keys[:, None])
        qk = tl.where(allowed, qk, float("-inf"))

        # -- online softmax: rescale what we had by exp2(m_old - m_new); a row with nothing yet keeps m = -inf -------
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # avoids -inf - -inf = NaN for empty rows
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])  # masked keys: exp2(-inf) = 0
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- P @ V with P rounded to the cache dtype (as the MMA takes it), accumulated in fp32 ---------------------
        if E4M3:  # P exact in e4m3 (the conversion loses nothing); each 32-key step added to acc in fp32 (Hopper's
            # fp8 MMA accumulates in ~14 bits, and acc runs across every tile)
            acc = tl.dot(e4m3_round(p).to(kv_nope.dtype), kv_nope, acc * alpha[:, None], max_num_imprecise_acc=32)
        else:
            acc = tl.dot(p.to(kv_nope.dtype), kv_nope, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    # -- epilogue: normalise, or hand the unnormalised split to the combine kernel ---------------------------------
    has_keys = l_i > 0.0
    l_use = tl.where(has_keys, l_i, 1.0)
    lse2 = tl.where(has_keys, m_i + tl.log2(l_use), float("-inf"))  # base-2 LSE of the split (or -inf: empty)
    out = acc * (k_scale / l_use)[:, None]  # empty rows: acc = 0, so out = 0
    if SINGLE:
        # write R * 512 in q's dtype, and the natural-log LSE in FlashMLA's [B, H_q, S_q] layout
        o_ptr = OUT + b.to(tl.int64) * stride_ob + s * stride_os + h * stride_oh
        tl.store(o_ptr[:, None] + offs_v[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + b * stride_lb + h * stride_lh + s * stride_ls, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        part = (b * num_splits + split).to(tl.int64) * R + rows
        tl.store(O_PART + part[:, None] * D_V + offs_v[None, :], out, mask=row_ok[:, None])
        tl.store(LSE_PART + part, lse2, mask=row_ok)


@triton.jit
def _combine_chunk(o_base, lse_base, split, offs_d, num_splits, R, D_V: tl.constexpr):
    """Splits ``split [CHUNK]``' partials ``[CHUNK, BLOCK_D]`` (columns ``offs_d``) and LSEs ``[CHUNK]`` of one row;
    splits past ``num_splits`` give zeros and ``-inf``."""
    ok = split < num_splits
    part = tl.load(o_base + split[:, None] * R * D_V + offs_d[None, :], mask=ok[:, None], other=0.0)
    return part, tl.load(lse_base + split * R, mask=ok, other=float("-inf"))


@triton.jit
def _mla_decode_combine_kernel(
    O_PART,
    LSE_PART,  # [B, splits, R, D_V] fp32 (each split normalised), [B, splits, R] fp32 base 2
    OUT,
    LSE,  # [B, S_q, H_q, D_V], [B, H_q, S_q] fp32 natural log
    stride_ob,
    stride_os,
    stride_oh,
    stride_lb,
    stride_lh,
    stride_ls,
    S_Q,
    H_Q,
    num_splits,
    D_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent of the split kernel: wait for its partials
):
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    row, b, pid_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    R = S_Q * H_Q
    s = row // H_Q
    h = row % H_Q
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_sp = tl.arange(0, SPLITS_P2)
    offs_c = tl.arange(0, CHUNK)
    lse_base = LSE_PART + b.to(tl.int64) * num_splits * R + row
    o_base = O_PART + (b.to(tl.int64) * num_splits * R + row) * D_V

    # -- the first CHUNK splits' partials and LSEs, issued before the LSEs' maximum, which they do not need --------
    part, lse_c = _combine_chunk(o_base, lse_base, offs_c, offs_d, num_splits, R, D_V)

    # -- the splits' LSEs: total = log2(sum 2^lse_i); empty splits (-inf) weigh 0 ----------------------------------
    lses = tl.load(lse_base + offs_sp * R, mask=offs_sp < num_splits, other=float("-inf"))
    m = tl.max(lses, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lses - m_use), 0)

    # -- out = sum_i 2^(lse_i - total) out_i over BLOCK_D columns: CHUNK splits' partials per load, all in flight ---
    acc = tl.sum(tl.exp2(lse_c - m_use)[:, None] * part, 0)
    for first in range(CHUNK, num_splits, CHUNK):
        part, lse_c = _combine_chunk(o_base, lse_base, first + offs_c, offs_d, num_splits, R, D_V)
        acc += tl.sum(tl.exp2(lse_c - m_use)[:, None] * part, 0)
    has_keys = total > 0.0
    total_use = tl.where(has_keys, total, 1.0)
    out = acc / total_use
    tl.store(OUT + b.to(tl.int64) * stride_ob + s * stride_os + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))
    if pid_d == 0:
        lse = tl.where(has_keys, (m_use + tl.log2(total_use)) * 0.6931471805599453, float("-inf"))
        tl.store(LSE + b * stride_lb + h * stride_lh + s * stride_ls, lse)


# -- host side ----------------------------------------------------------------------------------------------------
class DecodeOutput(NamedTuple):
    """``out [B, S_q, H_q, D_v]`` in q's dtype and ``lse [B, H_q, S_q]`` fp32 natural log (-inf: no key)."""

    out: torch.Tensor
    lse: torch.Tensor


class DecodeConfig(NamedTuple):
    """Tile sizes and launch parameters of the split kernel."""

    block_m: int  # query rows (s, h) per program
    block_n: int  # keys per step; divides the page size
    num_warps: int
    num_stages: int


GLUON_TILE = DecodeConfig(decode_sm90.BLOCK_M, decode_sm90.BLOCK_N, decode_sm90.NUM_WARPS, 1)  # its one tile
# After split_kernel_keys (16 rows over a 16-bit cache, Hopper) the combine launches as its programmatic dependent
# (``launch_pdl``; the split kernel lets it launch at its start, and it waits for the partials): 0.2-0.5 us less a
# 16-head decode on an H200 (speed log, stop 61). After the other kernels it was 1-7% slower (stop 59): plain launches.
PDL_AFTER_KEYS = True


def decode_config(
    rows: int, page_size: int, dtype: torch.dtype, fp8: bool = False, *, gluon: bool = False
) -> DecodeConfig:
    """The tile for ``rows = S_q * H_q`` query rows (``fp8``: over the per-tensor fp8 cache; ``gluon``: on Hopper's
    Gluon kernels at any row count over that cache, and over a 16-bit one at 16 rows or fewer, whose key tiles are 64:
    :data:`GLUON_TILE`; 64 rows a program in :func:`mlaspec.impl.decode_sm90.split_kernel_fp8`, 16 or 32 in
    ``split_kernel_fp8_keys`` and 16 in ``split_kernel_keys``, :func:`mlaspec.impl.decode_sm90.keys_rows`).

    bf16/fp16: up to 64 rows (a Hopper warpgroup MMA is 64 tall) x 64 keys; 8 warps for 64 rows, so the ``[64, 512]``
    fp32 accumulator is 128 registers a thread. fp32 inputs (exact ``ieee`` dots, not tf32) take half-size tiles.

    Pipeline depth: Triton's software pipeliner gives the page-table read its own stages (it is a load that feeds
    the key tile's address), so ``num_stages = 2`` or ``3`` leaves *one* key-tile buffer, and the next tile is loaded
    only after this one is used: streaming and compute never overlap. ``num_stages = 5`` gives two buffers (the
    next tile in flight during this one's dots; checked on the compiled kernel by ``tests/test_impl_pipelining.py``):
    168 KB of shared memory at 16 rows, 188 KB at 32, one program per SM. Measured on an H200 (16 heads, bf16, one
    wave): B = 1, 64K keys 40.2 -> 31.8 us, 128K 65.2 -> 49.0 us; B = 64, 4K 86.7 -> 79.4 us. 64 rows keep
    2 stages (two 64-key buffers beside q do not fit in 227 KB; 32-key tiles, 5 stages, ran 97.7 us against
    85.6 at 128 heads, B = 1, 64K); on Hopper, over a 16-bit cache, they run :mod:`mlaspec.impl.decode_sm90`, and
    so do 16 rows or fewer (``split_kernel_keys``, 1.02-1.14x these tiles on an H200, 2026-11-29, night).
    fp8 with <= 16 rows: 32-key tiles, whose byte-to-bf16 conversion fits the registers (64-key tiles spill ~500
    bytes a thread, triton 3.6): measured on an H200 at 16 heads, B = 1, 1K keys 35.7 -> 18.5 us, B = 64, 4K 185
    -> 158 us (64 rows keep 64 keys: 32-row or 32-key tiles ran 1.4-2.9x slower). The fp8 figures predate
    :mod:`mlaspec.impl.fp8` (2026-11-29, evening).
    """
    if gluon:
        return GLUON_TILE
    big = dtype == torch.float32
    block_m = min(32 if big else 64, max(16, triton.next_power_of_2(rows)))
    block_n = min(16 if big else 32 if fp8 and block_m <= 16 else 64, page_size)
    num_warps = 8 if block_m >= 64 else 4
    num_stages = 1 if big else 5 if block_m <= 32 and not fp8 else 2
    return DecodeConfig(block_m, block_n, num_warps, num_stages)


def num_splits_heuristic(
    batch: int,
    row_blocks: int,
    max_seq_len: int,
    num_sms: int,
    *,
    block_n: int = 64,
    programs_per_sm: int = 1,
    max_splits: int = 256,
) -> int:
    """How many pieces to cut each sequence's keys into: one whole wave of ``programs_per_sm`` programs per SM.

    ``batch * row_blocks`` programs exist without splitting. A split count whose programs spill past what the SMs
    hold at once pays for a whole second wave, so this takes ``floor(programs_per_sm * num_sms / (batch *
    row_blocks))`` splits, at most one per key block and at most ``max_splits`` (the combine kernel loads every
    split's LSE at once). ``programs_per_sm``: 1 for the 16-bit tiles (150-220 KB of shared memory each), 2 for
    the fp8 cache's byte tiles of up to 32 rows (~55 KB at 16; two programs per SM hide each other's byte-to-bf16
    conversion; at 64 rows q alone is 72 KB, and two waves cost 128 heads B = 4 4K keys 45.6 -> 62.6 us).

    Measured on an H200 (bf16, page 64, the two-tile pipeline of :func:`decode_config`): 16 heads, B = 2, 64K
    keys: 66 splits 47.1 us, 132 (two waves) 59.0; B = 1, 128K: 132 splits 49.0 us, 264 splits 62.9; B = 1, 8K:
    128 splits of one key block 13.0 us, 32 of four 15.2. 128 heads, B = 4, 64K: 16 splits (128 programs) 271 us,
    17 splits (136 programs, a second wave of 4) 449 us. fp8 cache, 16 heads, B = 2, 64K: 132 splits 86 us, 66
    splits 123 us. Equal splits over every SM (B1 128K: 132 splits of 15-16 key blocks, where ``mla_decode_paged``'s
    rounding leaves 128 of 16), or splits skewed so that some finish early: the same time or slower (H200, the speed
    log's stop 62): the longest split sets the time.
    """
    key_blocks = max(1, triton.cdiv(max_seq_len, block_n))
    per_wave = programs_per_sm * num_sms // max(1, batch * row_blocks)
    return max(1, min(per_wave, key_blocks, max_splits))


def combine_config(rows: int, num_splits: int, d_v: int, num_sms: int) -> tuple[int, int, int]:
    """``(block_d, chunk, num_warps)`` of the combine for ``rows = B * S_q * H_q`` rows of ``num_splits`` partials:
    ``block_d`` value columns a program, ``chunk`` splits' partials a load, ``num_warps``.

    One warp a program, at most 4096 partials (128 registers a thread) a load: the combine is a few microseconds of
    loads, and more, smaller programs keep more of them in flight. Columns a program: 32 up to 32 rows (16 heads,
    B <= 2), 64 up to 64, 128 below four rows an SM, else a whole row (its LSEs read once). The exception: up to 16
    rows with more than ``4096 / 32`` splits (16 heads, B = 1, 129-132 splits) load them all at once over 4 warps.
    Measured on an H200 (CUDA-graph replays of the combine alone, partials of 512 columns; before -> after):
    128 heads B = 1, 66 splits 5.92 -> 4.72 us, B = 2, 33 splits 7.85 -> 4.66, B = 4, 16 splits 9.93 -> 3.90; 16
    heads B = 1, 64 splits 2.93 -> 2.21, B = 2, 66 splits 2.91 -> 2.59, B = 4, 33 splits 3.36 -> 2.50, B = 64, 2
    splits 2.44 -> 2.39, B = 1, 132 splits 2.90 as before (one warp, two loads: 3.15); where it lost: B = 1, 16
    splits 1.89 -> 1.95. (Before: 4 warps, 8192 partials a load, 64 columns from 33 rows.) A sweep of 16-128 columns,
    8-256 partials a load, 1 or 4 warps, the loop unrolled or not (H200, 2026-11-30): the best beat these by 0.1-0.25
    us a shape (128 heads B = 1 4.44 against 4.67 us), within the decode's run-to-run spread.
    """
    p2 = triton.next_power_of_2(num_splits)
    block_d = min(d_v, 32 if rows <= 32 else 64 if rows <= 64 else 128 if rows < 4 * num_sms else d_v)
    if rows <= 16 and p2 * block_d > 4096:
        return block_d, min(p2, 8192 // block_d), 4
    return block_d, max(1, min(p2, 4096 // block_d)), 1


def sm90_why_not(
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    cfg: DecodeConfig,
    *,
    d_v: int,
    d_rope: int,
    aligned: bool = True,
) -> str | None:
    """Why :mod:`mlaspec.impl.decode_sm90` cannot take this split, or ``None`` where it can.

    It needs Gluon in this Triton, a Hopper GPU (``capability``: the CUDA device's compute capability, ``None`` off
    CUDA or under the interpreter), a bf16 / fp16 query over a cache in its dtype or vLLM's per-tensor fp8 cache
    (its ``split_kernel_fp8``) or an e4m3 one over that cache (the e4m3 path, ``split_kernel_e4m3_keys``), the ``64
    x 64`` tile (:data:`GLUON_TILE`: pages of at least 64 slots; a 16-bit cache takes it at more than 32 query rows,
    or at 16 or fewer, where its keys kernels take 16 or 32 rows a program), ``512 + 64`` entries, and (``aligned``)
    16-byte-aligned tensors whose strides are multiples of 16 elements (what its ``cp.async`` copies are compiled
    for).
    """
    if why := hopper_why_not("decode_sm90", decode_sm90.AVAILABLE, capability):
        return why
    if dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        return f"decode_sm90 takes a bf16 / fp16 query (or an e4m3 one over the fp8 cache), got {dtype}"
    if (cfg.block_m, cfg.block_n) != (decode_sm90.BLOCK_M, decode_sm90.BLOCK_N):
        return (
            f"decode_sm90 takes 64-row tiles of 64 keys (a 16-bit cache: more than 32 or at most 16 query rows; pages"
            f" of at least 64 slots), got {cfg.block_m} x {cfg.block_n}"
        )
    if (d_v, d_rope) != (512, 64):
        return f"decode_sm90 takes entries of 512 + 64, got {d_v} + {d_rope}"
    if not aligned:
        return "decode_sm90 takes q and kv_cache 16-byte aligned with strides of multiples of 16 elements"
    return None


def hopper_why_not(name: str, available: bool, capability: tuple[int, int] | None) -> str | None:
    """Why the Gluon kernel module ``name`` cannot run at all, or ``None``: it needs Gluon in this Triton
    (``available``, the module's ``AVAILABLE``) and a Hopper GPU (``capability``, :func:`compiled_capability`)."""
    if not available:
        return f"{name} needs triton's Gluon (triton >= 3.5)"
    if capability is None or capability[0] != 9:
        return f"{name} runs on a Hopper GPU (sm_90) with compiled kernels, got compute capability {capability}"
    return None


def kernel_named(kernel: str | None, env: str) -> str:
    """The kernel a call asks for: ``kernel``, else the environment variable ``env``, else ``"auto"``; a
    ``ValueError`` naming both where it is not one of :data:`KERNELS`."""
    kernel = kernel or os.environ.get(env, "auto")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r} ({env} or kernel=)")
    return kernel


def gluon_runs(kernel: str, why: str | None, tuned: bool = False) -> bool:
    """Whether a Gluon kernel runs rather than its readable twin: ``why`` is why it cannot (``None``: it can).

    ``"triton"``: never. ``"auto"``: where it can and no option tunes the readable kernel (``tuned``). ``"sm90"``:
    where it can, else a ``ValueError`` with ``why`` (benchmarks, tests)."""
    if kernel == "sm90" and why:
        raise ValueError(why)
    return why is None and (kernel == "sm90" or (kernel == "auto" and not tuned))


def aligned16(*tensors: torch.Tensor, strides: tuple[int, ...] = ()) -> bool:
    """Whether ``tensors`` start 16-byte aligned and ``strides`` are multiples of 16 elements: what the Gluon kernels'
    16-byte ``cp.async`` copies are compiled for."""
    return all(t.data_ptr() % 16 == 0 for t in tensors) and all(x % 16 == 0 for x in strides)


def use_sm90(kernel: str, q: torch.Tensor, kv_cache: torch.Tensor, cfg: DecodeConfig, **shape) -> bool:
    """Whether the split runs :mod:`mlaspec.impl.decode_sm90` (Gluon) rather than the readable kernel.

    ``kernel="triton"``: never. ``"auto"``: where :func:`sm90_why_not` finds no reason against it. ``"sm90"``: the
    same, but a ``ValueError`` with that reason where it does not apply (benchmarks, tests). ``shape``: ``d_v,
    d_rope``.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    aligned = aligned16(q, kv_cache, strides=(*q.stride()[:3], *kv_cache.stride()[:2]))
    return gluon_runs(kernel, sm90_why_not(compiled_capability(q.device), q.dtype, cfg, **shape, aligned=aligned))


def _interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (fixed when they were defined; Gluon has no interpreter)."""
    return type(_mla_decode_split_kernel).__name__ == "InterpretedFunction"


@functools.cache
def _properties(device: torch.device):
    """The CUDA device's properties, once a process: torch's query costs ~8 us a call, as much as a small kernel."""
    return torch.cuda.get_device_properties(device)


def compiled_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of the CUDA GPU that compiled kernels run on for tensors on ``device``; ``None`` off
    CUDA or under Triton's interpreter (where no Gluon kernel runs)."""
    if device.type != "cuda" or _interpreted():
        return None
    props = _properties(device)
    return props.major, props.minor


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so the combine kernel runs in tests too


def mla_decode_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    d_v: int = 512,
    scale: float,
    causal: bool = True,
    k_scale: float | None = None,
    q_scale: float | None = None,
    out_dtype: torch.dtype | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    config: DecodeConfig | None = None,
    kernel: str | None = None,
) -> DecodeOutput:
    """Absorbed MLA decode over a paged cache, in q's dtype or per-tensor fp8.

    Args:
        q: ``[B, S_q, H_q, D_qk]`` bf16/fp16/fp32, the absorbed queries (``D_qk = 576``); last dim contiguous. Or
            ``torch.float8_e4m3fn`` over the fp8 cache, ``e4m3(q / q_scale)`` as vLLM hands FlashMLA's fp8 decode
            (``_DecodeConcatQuantFP8``): **the e4m3 path**, both products multiplied in e4m3 and the softmax
            weights ``P`` rounded to e4m3 for ``P V`` (FlashMLA's dense fp8 arithmetic; the conformance harness
            judges it as the backend ``triton-e4m3``, under the declared ``fp8_mma_accumulation`` and
            ``p_in_e4m3``).
        kv_cache: ``[num_pages, P, D_qk]``, entries ``[kv_c | k_pe]``, either in q's dtype or, for vLLM's
            per-tensor fp8 cache, ``uint8`` / ``torch.float8_e4m3fn`` bytes ``e4m3(entry / k_scale)``. Slots past a
            sequence's end may hold anything (NaN included): they are never used.
        block_table: ``[B, max_pages]`` int32, logical page ``i`` of sequence ``b`` is physical page
            ``block_table[b, i]``; entries past ``ceil(seq_lens[b] / P)`` are never read.
        seq_lens: ``[B]`` int32, keys per sequence (0 allowed: output 0, LSE -inf).
        d_v: value width, the leading part of each entry (``512``); ``D_qk - d_v`` is the rope width (``64``).
            Both must be powers of two >= 16.
        scale: softmax scale (MLA: ``1/sqrt(192)`` times the YaRN mscale², not ``1/sqrt(576)``).
        causal: query ``s`` of ``S_q`` sees keys ``j <= s + seq_len - S_q`` (MTP); rows that see no key are empty.
        k_scale: the fp8 cache's per-tensor scale (vLLM's ``layer._k_scale``); required for an fp8 cache, ``None``
            otherwise.
        q_scale: the e4m3 query's per-tensor scale (vLLM's ``layer._q_scale``); required for an e4m3 ``q`` and only
            for one.
        out_dtype: the output's dtype on the e4m3 path (bf16 by default, or fp16); otherwise q's.
        num_splits: pieces per sequence's keys; default :func:`num_splits_heuristic`.
        max_seq_len: ``max(seq_lens)`` if known (saves a device-to-host sync when choosing the splits).
        config: tile override (default :func:`decode_config`); it runs the readable kernel unless ``kernel="sm90"``.
        kernel: ``"auto"`` (default; or the ``MLASPEC_DECODE_KERNEL`` environment variable), ``"triton"`` (the
            readable kernel only) or ``"sm90"`` (the Gluon kernel, an error where it does not apply): :func:`use_sm90`.

    Returns:
        ``out [B, S_q, H_q, d_v]`` in q's dtype (the e4m3 path: ``out_dtype``) and ``lse [B, H_q, S_q]`` fp32
        (natural log).
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S_q, H_q, D_qk], got shape {list(q.shape)}")
    B, S_q, H_q, D_qk = q.shape
    e4m3 = q.dtype == torch.float8_e4m3fn
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) and not e4m3:
        raise TypeError(f"q must be bf16/fp16/fp32 or float8_e4m3fn, got {q.dtype}")
    if e4m3 != (q_scale is not None):
        raise ValueError(f"q_scale is required for an e4m3 q and only for one, got q_scale={q_scale} with {q.dtype}")
    if out_dtype is not None and (not e4m3 or out_dtype not in (torch.bfloat16, torch.float16)):
        raise TypeError(f"out_dtype is bf16 or fp16, for an e4m3 q only; got {out_dtype} with q {q.dtype}")
    if kv_cache.dtype == torch.float8_e4m3fn:
        kv_cache = kv_cache.view(torch.uint8)
    fp8 = kv_cache.dtype == torch.uint8
    if e4m3 and not fp8:
        raise TypeError(f"an e4m3 q needs the fp8 cache (uint8 or float8_e4m3fn bytes), got {kv_cache.dtype}")
    out_dtype = (out_dtype or torch.bfloat16) if e4m3 else q.dtype
    if e4m3:
        q = q.view(torch.uint8)
    if not fp8 and kv_cache.dtype != q.dtype:
        raise TypeError(f"kv_cache must be in q's dtype {q.dtype} or fp8 e4m3 bytes, got {kv_cache.dtype}")
    if fp8 != (k_scale is not None):
        raise ValueError(
            "k_scale is required for an fp8 kv_cache and only for one, got "
            f"k_scale={k_scale} with a {kv_cache.dtype} cache"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[2] != D_qk:
        raise ValueError(f"kv_cache must be [num_pages, P, D_qk={D_qk}], got shape {list(kv_cache.shape)}")
    page_size = kv_cache.shape[1]
    d_rope = D_qk - d_v
    for name, width in (("d_v", d_v), ("D_qk - d_v", d_rope), ("kv_cache page size P", page_size)):
        if width < 16 or width & (width - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (the kernel splits D_qk = 512 + 64), got {width}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32:
        raise ValueError(
            f"block_table must be [B={B}, max_pages] int32, got {list(block_table.shape)} {block_table.dtype}"
        )
    if seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be [B={B}] int32, got {list(seq_lens.shape)} {seq_lens.dtype}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache must be contiguous in their last dimension")
    k_scale = 1.0 if k_scale is None else float(k_scale)
    qk_scale = scale * k_scale * (1.0 if q_scale is None else float(q_scale)) * LOG2E
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()
    if block_table.shape[1] == 0:  # every sequence empty: a row of one page to read and not use
        block_table = block_table.new_zeros(B, 1)

    kernel = kernel_named(kernel, "MLASPEC_DECODE_KERNEL")
    rows = S_q * H_q
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if B else 0
    # no sequence is longer than its block-table row holds: the splits follow the table where max_seq_len overstates
    # it, so each split's first page is in the table (the Gluon kernels read it beside the sequence's length,
    # decode_sm90._split_start)
    max_seq_len = min(max_seq_len, block_table.shape[1] * page_size)
    # vLLM's fp8 cache on Hopper: the Gluon kernels, 64-key tiles at any row count (not where the readable kernel is
    # asked for by name or by a tile override); at 32 rows or fewer split_kernel_fp8_keys, 1.04-2.2x the readable
    # kernel's 32-key tiles on an H200 from B1 1K up (2026-11-29, night: benchmarks/decode_tune.py --as-called)
    # and a 16-bit cache at 16 rows or fewer: split_kernel_keys, 1.02-1.14x the readable kernel on an H200 (16 heads,
    # B1 8K-128K, B2 64K, B64 1K-4K; 2026-11-29, night)
    narrow = (fp8 or rows <= 16) and config is None and kernel != "triton" and page_size % GLUON_TILE.block_n == 0
    e4m3_descs = None  # split_kernel_e4m3_keys's tensor-memory-copy descriptors, where it runs
    if e4m3:  # the e4m3 path: split_kernel_e4m3_keys in 16- or 64-row blocks where it applies, else the readable kernel
        if narrow and use_sm90("auto", q.view(torch.float8_e4m3fn), kv_cache, GLUON_TILE, d_v=d_v, d_rope=d_rope):
            e4m3_descs = decode_sm90.cache_descriptors(kv_cache.view(torch.float8_e4m3fn), page_size)
        narrow = e4m3_descs is not None
        if kernel == "sm90" and not narrow:
            raise ValueError(
                "the e4m3 path's Gluon kernel takes 512 + 64 entries in pages of 64k slots one stride apart (its"
                f" tensor-memory copies) and 16-byte aligned tensors, on a Hopper GPU: got {d_v} + {d_rope}, page"
                f" {page_size}"
            )
    else:
        narrow = narrow and use_sm90("auto", q, kv_cache, GLUON_TILE, d_v=d_v, d_rope=d_rope)
    cfg = config or decode_config(rows, page_size, q.dtype, fp8, gluon=narrow)
    keys = decode_sm90.keys_rows(rows) if narrow else None  # rows a program of a keys kernel (a tile override: none)
    sms = _num_sms(q.device)
    if narrow and e4m3:  # decode_sm90.split_kernel_e4m3_keys: 16 rows a program (one consumer) or 64 (leader, helper)
        keys = decode_sm90.e4m3_rows(B, rows, triton.cdiv(max_seq_len, GLUON_TILE.block_n), sms)
        cfg = DecodeConfig(keys, GLUON_TILE.block_n, decode_sm90.KEYS_WARPS, 1)
    if page_size % cfg.block_n:
        raise ValueError(f"config.block_n={cfg.block_n} must divide the page size {page_size}")
    row_blocks = triton.cdiv(rows, cfg.block_m)
    key_blocks = max(1, triton.cdiv(max_seq_len, cfg.block_n))
    if num_splits is None:
        # byte tiles small enough for two programs an SM (64 rows: q is 72 KB; the e4m3 kernel's tiles: 182 KB)
        small_fp8 = fp8 and not (narrow and e4m3) and cfg.block_m <= 32
        per_sm = 2 if small_fp8 else 1
        num_splits = num_splits_heuristic(B, row_blocks, max_seq_len, sms, block_n=cfg.block_n, programs_per_sm=per_sm)
    num_splits = max(1, min(int(num_splits), key_blocks))
    blocks_per_split = triton.cdiv(key_blocks, num_splits)
    num_splits = triton.cdiv(key_blocks, blocks_per_split)  # no split left with nothing at all to do

    out = torch.empty(B, S_q, H_q, d_v, dtype=out_dtype, device=q.device)
    lse = torch.empty(B, H_q, S_q, dtype=torch.float32, device=q.device)
    if B == 0 or rows == 0:
        return DecodeOutput(out, lse)
    if num_splits > 1:
        o_part = torch.empty(B, num_splits, rows, d_v, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, num_splits, rows, dtype=torch.float32, device=q.device)
    else:  # unused by the kernel
        o_part, lse_part = out, lse
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    # a tile override keeps the readable kernel unless the Gluon one is asked for by name (narrow: already checked)
    sm90 = narrow or (
        not e4m3 and (config is None or kernel == "sm90") and use_sm90(kernel, q, kv_cache, cfg, d_v=d_v, d_rope=d_rope)
    )

    def launch(gluon: bool, stages: int) -> bool:
        """Launch the split kernel (``gluon``: Hopper's, else the readable one with ``stages``); whether its combine
        may launch as its programmatic dependent."""
        args = (
            q,
            kv_cache,
            block_table,
            seq_lens,
            o_part,
            lse_part,
            out,
            lse,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            kv_cache.stride(0),
            kv_cache.stride(1),
            block_table.stride(0),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            lse.stride(0),
            lse.stride(1),
            lse.stride(2),
            qk_scale,
            k_scale,
            S_q,
            H_q,
            blocks_per_split,
            num_splits,
        )
        tile = dict(CAUSAL=bool(causal), D_V=d_v, D_ROPE=d_rope, PAGE=page_size, BLOCK_M=cfg.block_m)
        tile.update(BLOCK_N=cfg.block_n, SINGLE=num_splits == 1)
        grid = (row_blocks, num_splits, B)
        if gluon and e4m3:  # e4m3 MMAs; the bytes as e4m3 for the MMAs' shared operands
            q8, kv8 = q.view(torch.float8_e4m3fn), kv_cache.view(torch.float8_e4m3fn)
            tile.update(BLOCK_M=keys)
            decode_sm90.split_kernel_e4m3_keys[grid](q8, kv8, *args[2:], *e4m3_descs, **tile,
                                                     num_warps=decode_sm90.KEYS_WARPS)  # fmt: skip
            return False
        if gluon and fp8 and keys:  # no padded rows: the keys are the MMAs' rows
            tile.update(BLOCK_M=keys)
            decode_sm90.split_kernel_fp8_keys[grid](*args, **tile, num_warps=decode_sm90.KEYS_WARPS)
            return False
        if gluon and decode_sm90.lead_applies(row_blocks):
            # each tile read by several programs: the leader warpgroup's kernel (over the fp8 cache a producer
            # converts its tiles: no copy descriptors, and the launch's registers are the three partitions')
            halves = (None, None) if fp8 else decode_sm90.cache_descriptors(kv_cache, page_size, 256)
            if halves is not None:
                regs = {} if fp8 else {"maxnreg": decode_sm90.LEAD_REGS.value}
                o_desc = decode_sm90.partial_descriptor(o_part) if num_splits > 1 else None
                decode_sm90.split_kernel_lead[grid](*args, *halves, o_desc, **tile, num_warps=decode_sm90.LEAD_WARPS,
                                                    **regs)  # fmt: skip
                return False
        if gluon and fp8:
            decode_sm90.split_kernel_fp8[grid](*args, **tile, num_warps=decode_sm90.NUM_WARPS)
            return False
        if gluon:  # 16 rows or fewer (keys): the keys as the MMAs' rows, the same arguments
            descs = decode_sm90.cache_descriptors(kv_cache, page_size)
            tile.update(TMA=descs is not None, BLOCK_M=keys or cfg.block_m)
            split, warps = (decode_sm90.split_kernel_keys, decode_sm90.KEYS_WARPS) if keys else (
                decode_sm90.split_kernel, decode_sm90.NUM_WARPS)  # fmt: skip
            split[grid](*args, *(descs or (None, None)), **tile, num_warps=warps)
            return bool(keys) and PDL_AFTER_KEYS  # after split_kernel_keys the combine may launch as its dependent
        _mla_decode_split_kernel[grid](
            *args, **tile, PRECISION=precision, FP8=fp8, E4M3=e4m3, num_warps=cfg.num_warps, num_stages=stages
        )
        return False

    # what to launch, in order, until one fits: the Gluon kernel where it applies, then (unless asked for by name) the
    # readable one; a GPU with less shared memory than Hopper's 227 KB a block (A100: 163 KB, sm_86/89: 99 KB) cannot
    # hold its two tiles in flight, and fp8's byte tiles with their converted copies may not fit either: fewer
    # stages, then one
    early_combine = False  # the combine as a programmatic dependent of the split kernel launched
    attempts = [(True, 1)] if sm90 else []
    if kernel != "sm90":
        attempts += [(False, stages) for stages in dict.fromkeys((cfg.num_stages, min(cfg.num_stages, 2), 1))]
    for i, attempt in enumerate(attempts):
        try:
            early_combine = launch(*attempt)
            break
        except triton.runtime.errors.OutOfResources:
            if i == len(attempts) - 1:
                raise
    if num_splits > 1:
        _combine(o_part, lse_part, out, lse, sms, pdl=early_combine)
    return DecodeOutput(out, lse)


def _combine(
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sms: int,
    *,
    config: tuple[int, int, int] | None = None,
    pdl: bool = False,
) -> None:
    """Merge the splits' partials ``o_part [B, splits, S_q H_q, D_v]`` fp32 (normalised) and ``lse_part [B, splits,
    S_q H_q]`` (base 2) by their LSEs into ``out [B, S_q, H_q, D_v]`` and ``lse [B, H_q, S_q]`` (natural log).

    ``config``: ``(block_d, chunk, num_warps)``, default :func:`combine_config`'s on a GPU; the interpreter takes
    whole rows (its cost is per program and step, not per column: 32 columns a program made the fp8 DCP cases' tests
    take a minute each), and ``tests/test_impl_interpreter.py`` runs the column blocks by passing a config."""
    B, num_splits, rows, d_v = o_part.shape
    if config is None and _interpreted():
        config = d_v, max(1, min(triton.next_power_of_2(num_splits), 4096 // d_v)), 1
    block_d, chunk, warps = config or combine_config(B * rows, num_splits, d_v, sms)
    _mla_decode_combine_kernel[(rows, B, d_v // block_d)](
        o_part,
        lse_part,
        out,
        lse,
        *out.stride()[:3],
        *lse.stride(),
        out.shape[1],
        out.shape[2],
        num_splits,
        D_V=d_v,
        BLOCK_D=block_d,
        SPLITS_P2=triton.next_power_of_2(num_splits),
        CHUNK=chunk,
        num_warps=warps,
        num_stages=1,  # no software pipelining: each load is issued whole, ahead of its use
        **(dict(PDL=True, launch_pdl=True) if pdl else {}),
    )


def page_cache(
    kv: torch.Tensor,
    *,
    page_size: int = 64,
    generator: torch.Generator | None = None,
    extra_pages: int = 1,
    fill: float = math.nan,
    seq_lens: torch.Tensor | None = None,
):
    """Scatter dense entries ``kv [B, S_kv, D]`` into a paged cache with shuffled physical pages
    (:func:`mlaspec.spec.paged_cache.page_entries`, which fixes the draws); ``seq_lens [B]`` (default ``S_kv`` for
    every request): request ``b`` keeps its first ``seq_lens[b]`` entries.

    Returns ``(kv_cache [num_pages, P, D], block_table [B, pages + 1] int32, seq_lens [B] int32)``: unused slots
    and spare pages hold ``fill`` (NaN by default, so a read past a sequence's end shows), and the block table has
    one spare column of ``-1`` that no kernel may follow.
    """
    return tuple(
        page_entries(
            kv, page_size, seq_lens=seq_lens, generator=generator, spare_pages=extra_pages, fill=fill, spare_column=True
        )
    )
