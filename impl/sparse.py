"""Sparse MLA (DeepSeek V3.2 DSA, DeepSeek V4): attention over a per-query list of key indices, in Triton.

Implements :func:`mlaspec.spec.sparse.sparse_attention` and its two views, :func:`mlaspec.spec.sparse.sparse_prefill`
(FlashMLA's ``flash_mla_sparse_fwd``) and :func:`mlaspec.spec.sparse.sparse_decode` (``flash_mla_with_kvcache`` with
``indices``, V4 ``extra`` cache included), with the spec's conventions:

* a slot is used when ``t < topk_length[row]`` and ``0 <= index < N`` (``N`` the number of key rows; FlashMLA's
  ``-1``, ``S_kv``, ``INT_MIN``, ``INT_MAX`` are all skipped); an unused slot is never dereferenced (masked loads),
  so NaN in unused cache rows cannot leak;
* an empty row (no used slot, in either cache) gives output 0, LSE ``+inf`` and ``max_logits`` ``-inf``;
* ``attn_sink [H_q]`` scales the output by ``sigmoid(lse - sink)`` (``+inf`` gives zeros, ``-inf`` nothing); the
  LSE and ``max_logits`` are unchanged; LSE in natural log;
* V is the first ``D_v`` columns of the key row (``D_qk = 576 = 512 + 64`` for V3.2, ``D_qk = D_v = 512`` for V4).

The naive computation, per query row ``i`` (``K`` slots, ``H`` query heads sharing one KV head) and its traffic::

    keys = kv[indices[i]]                       # gather: read K * D_qk (the bytes that matter), write K * D_qk
    s    = scale * q[i] @ keys.T                # read H * D_qk + K * D_qk, write H * K
    p    = softmax(s)                           # read H * K, write H * K
    out  = p @ keys[:, :D_v]                    # read H * K + K * D_v (again), write H * D_v

The kernel gathers each key tile once per block of query heads straight into on-chip memory and keeps ``s`` and
``p`` there, so the traffic is the named keys (``K * D_qk`` elements, or ``K * 656`` bytes for the fp8 cache) plus
``q`` and ``out``. With 64 heads per program that is ``2 * 64 * 1088`` FLOP per 1152-byte bf16 key (~120 FLOP/byte)
or per 656-byte fp8 key (~210 FLOP/byte): near Hopper's ridge, so the key stream must run at full bandwidth.

Key sources (the ``FMT`` of a :class:`KeyCache`):

* ``float`` — rows ``[N, H_kv, D_qk]`` in q's dtype: the prefill ``kv`` or a decode cache ``[NB, P, D_qk]``
  flattened to its global slots ``block * P + offset``;
* ``fp8_v32`` — FlashMLA's 656-byte token (:data:`mlaspec.spec.cache_layouts.FP8_DS_MLA_V32`): 512 e4m3, 4 fp32
  scales (one per 128 values), 64 bf16 RoPE values; record ``index`` at byte ``656 * index``;
* ``fp8_v4`` — the 584-byte V4 token (:data:`~mlaspec.spec.cache_layouts.FP8_DS_MLA_V4`): per page block the
  576-byte data rows (448 e4m3 + 64 bf16) of all ``P`` tokens, then their 8-byte scale rows (7 e8m0 + pad).

The fp8 sources are dequantized inside the kernel (``e4m3 * scale`` rounded to q's dtype, as FlashMLA's sparse decode
feeds its bf16 MMA; ``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh``).

Structure:

1. ``_sparse_mla_kernel``: grid ``(rows, H_kv * head blocks, splits)``. A program takes ``BLOCK_H`` query heads of
   one query row and one KV head, walks its slots ``BLOCK_N`` at a time -- the main indices, then the extra
   indices in the same online softmax (base 2, ``log2 e`` folded into the scale, fp32) -- and writes the result or,
   with several splits (decode, few rows), an unnormalised partial per split.
2. ``_sparse_mla_combine_kernel``: merges the splits by their LSE, applies the sink, writes out / LSE / max_logits.

On Hopper the 656-byte cache takes :mod:`mlaspec.impl.sparse_sm90` (Gluon) in place of step 1, at every head count:
the same math and roundings, its bytes streamed two tiles ahead (``kernel=`` / ``MLASPEC_SPARSE_KERNEL`` choose); or,
for the splits :func:`sparse_producer_runs` names, :mod:`mlaspec.impl.sparse_sm90_producer`, the same again with a
producer warpgroup that dequantizes beside the MMAs. Keys already in q's dtype (one KV head) take its
``sparse_kernel_float`` where :func:`float_keys_sm90` says it is the faster (more than 32 heads, or rows that fill
an eighth of the SMs to one wave).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaspec.spec import cache_layouts as cl

from . import sparse_sm90, sparse_sm90_producer
from .decode import _num_sms, aligned16, compiled_capability, gluon_runs, hopper_why_not, kernel_named

__all__ = [
    "BlockTable",
    "KeyCache",
    "SparseConfig",
    "SparseOutput",
    "combine_config",
    "decode_splits",
    "float_keys",
    "float_keys_sm90",
    "fp8_keys",
    "paged_decode",
    "quantize_keys",
    "sparse_config",
    "sparse_mla",
    "sparse_mla_decode",
    "sparse_producer_runs",
    "sparse_sm90_why_not",
]

LOG2E = 1.4426950408889634
FMT_FLOAT, FMT_FP8_V32, FMT_FP8_V4 = 0, 1, 2


# -- kernels --------------------------------------------------------------------------------------------------------
@triton.jit
def _load_keys(
    KV,
    KVF,
    KVB,
    slots,
    ok,
    stride_kn,
    page_bytes,
    FMT: tl.constexpr,
    D_V: tl.constexpr,
    D_ROPE: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The key tile ``[BLOCK_N, D_V]`` (and ``[BLOCK_N, D_ROPE]``) at ``slots``, zero where not ``ok``."""
    offs_v = tl.arange(0, D_V)
    s64 = tl.where(ok, slots, 0).to(tl.int64)  # an unused slot addresses row 0 but is never loaded
    if FMT == 0:
        # bf16/fp16/fp32 rows: read BLOCK_N * D_qk elements
        base = KV + s64 * stride_kn
        k_nope = tl.load(base[:, None] + offs_v[None, :], mask=ok[:, None], other=0.0)
        if D_ROPE > 0:
            offs_r = tl.arange(0, D_ROPE)
            k_rope = tl.load(base[:, None] + D_V + offs_r[None, :], mask=ok[:, None], other=0.0)
        else:
            k_rope = k_nope
    elif FMT == 1:
        # 656-byte V3.2 token: bytes [0, 512) e4m3, [512, 528) 4 fp32 scales, [528, 656) 64 bf16 RoPE
        e4m3 = tl.load(KV + s64[:, None] * 656 + offs_v[None, :], mask=ok[:, None], other=0)  # read BLOCK_N * 512 B
        scale = tl.load(KVF + s64[:, None] * 164 + 128 + tl.arange(0, 4)[None, :], mask=ok[:, None], other=0.0)
        vals = tl.reshape(e4m3.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BLOCK_N, 4, D_V // 4])
        k_nope = tl.reshape(vals * scale[:, :, None], [BLOCK_N, D_V])  # one scale per 128 values
        offs_r = tl.arange(0, D_ROPE)
        k_rope = tl.load(KVB + s64[:, None] * 328 + 264 + offs_r[None, :], mask=ok[:, None], other=0.0)
    else:
        # 584-byte V4 token, split per page block: data row (448 e4m3 + 64 bf16) at block * page_bytes + off * 576,
        # scale row (7 e8m0 + pad) at block * page_bytes + P * 576 + off * 8
        block = s64 // PAGE
        off = s64 % PAGE
        data = block * page_bytes + off * 576
        srow = block * page_bytes + PAGE * 576 + off * 8
        is8 = offs_v < 448
        e4m3 = tl.load(KV + data[:, None] + offs_v[None, :], mask=ok[:, None] & is8[None, :], other=0)
        e8m0 = tl.load(KV + srow[:, None] + tl.arange(0, 8)[None, :], mask=ok[:, None], other=127)  # 7 + pad
        scale = (e8m0.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127)
        vals = tl.reshape(e4m3.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BLOCK_N, 8, D_V // 8])
        fp8 = tl.reshape(vals * scale[:, :, None], [BLOCK_N, D_V])  # one scale per 64 values; group 8 is RoPE
        rope = tl.load(
            KVB + (data // 2 + 224)[:, None] + (offs_v - 448)[None, :], mask=ok[:, None] & ~is8[None, :], other=0.0
        )
        k_nope = tl.where(is8[None, :], fp8, rope.to(tl.float32))
        k_rope = k_nope
    return k_nope, k_rope


@triton.jit
def _attend_tile(
    q_nope, q_rope, k_nope, k_rope, ok, m_i, l_i, acc, qk_scale, D_ROPE: tl.constexpr, PRECISION: tl.constexpr
):
    """One online-softmax step over a key tile (``ok`` marks the used slots); returns the new ``m, l, acc``."""
    # -- logits in base 2: (q . k) * scale * log2(e), fp32 accumulation ------------------------------------------------
    qk = tl.dot(q_nope, tl.trans(k_nope), input_precision=PRECISION)
    if D_ROPE > 0:
        qk = tl.dot(q_rope, tl.trans(k_rope), qk, input_precision=PRECISION)
    qk = tl.where(ok[None, :], qk * qk_scale, float("-inf"))
    # -- rescale what we had by exp2(m_old - m_new); a row with nothing yet keeps m = -inf ---------------------------
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])  # unused slots: exp2(-inf) = 0
    l_i = l_i * alpha + tl.sum(p, 1)
    # -- P @ V with P rounded to the key dtype (as the MMA takes it); V is the first D_V columns of the key --------
    acc = tl.dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _finish(m_i, l_i, acc, SINK, heads, head_ok, HAS_SINK: tl.constexpr):
    """Normalise: ``out``, natural LSE (``+inf`` if empty), max_logits (``-inf`` if empty), sink applied."""
    has_keys = l_i > 0.0
    l_use = tl.where(has_keys, l_i, 1.0)
    lse2 = m_i + tl.log2(l_use)
    out = acc / l_use[:, None]  # empty rows: acc = 0
    if HAS_SINK:
        # sink: sigmoid(lse - sink) = 1 / (1 + 2^(sink log2 e - lse2)); +inf sink -> 0, -inf -> exactly 1
        sink = tl.load(SINK + heads, mask=head_ok, other=float("-inf"))
        f = 1.0 / (1.0 + tl.exp2(sink * 1.4426950408889634 - tl.where(has_keys, lse2, 0.0)))
        out = out * f[:, None]
    lse = tl.where(has_keys, lse2 * 0.6931471805599453, float("inf"))
    max_logits = m_i * 0.6931471805599453  # -inf on empty rows
    return out, lse, max_logits


@triton.jit
def _sparse_mla_kernel(
    Q,
    stride_qr,
    stride_qh,  # q [R, H_q, D_qk]
    KV,
    KVF,
    KVB,
    stride_kn,
    stride_kh,
    page_bytes,
    n_rows,  # main keys (see _load_keys), N key rows
    IDX,
    stride_ir,
    stride_ih,
    LENS,
    K,  # indices [R, H_kv, K] int32, lengths [R] int32 (read when HAS_LENS)
    rows_per_req,  # PAGED: IDX is a block table [B, max_blocks], row r belongs to request r // rows_per_req
    EKV,
    EKVF,
    EKVB,
    stride_ekn,
    e_page_bytes,
    e_n_rows,  # extra keys (H_kv = 1)
    EIDX,
    stride_eir,
    ELENS,
    K_E,  # extra indices [R, K_E] int32, extra lengths [R]
    SINK,  # [H_q] fp32 (read when HAS_SINK)
    OUT,
    LSE,
    MAXL,
    stride_or,
    stride_oh,
    stride_lr,  # out [R, H_q, D_V], lse / max_logits [R, H_q] fp32
    O_PART,
    ML_PART,  # [R, H_q, splits, D_V] fp32 unnormalised, [R, H_q, splits, 2] fp32 (m, l) base 2
    H_Q,
    G,
    tiles_per_split,
    num_splits,
    qk_scale,
    PAGED: tl.constexpr,
    HAS_LENS: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    FMT: tl.constexpr,
    EFMT: tl.constexpr,
    PAGE: tl.constexpr,
    EPAGE: tl.constexpr,
    D_V: tl.constexpr,
    D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # head blocks vary fastest: the programs that gather the same keys run together and share them in L2
    pid_h, r, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hblocks = tl.cdiv(G, BLOCK_H)
    kvh = pid_h // hblocks
    r64 = r.to(tl.int64)

    # -- this program's query heads: BLOCK_H of the G heads reading KV head kvh -------------------------------------
    local = (pid_h % hblocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = local < G
    heads = kvh * G + local
    offs_v = tl.arange(0, D_V)
    q_base = Q + r64 * stride_qr + heads * stride_qh
    q_nope = tl.load(q_base[:, None] + offs_v[None, :], mask=head_ok[:, None], other=0.0)  # read BLOCK_H * D_V
    if D_ROPE > 0:
        offs_r = tl.arange(0, D_ROPE)
        q_rope = tl.load(q_base[:, None] + D_V + offs_r[None, :], mask=head_ok[:, None], other=0.0)
    else:
        q_rope = q_nope

    # -- how many slots each list uses: K, or topk_length[r] ----------------------------------------------------------
    n_main = K
    if HAS_LENS:
        n_main = tl.minimum(tl.load(LENS + r), K)
    n_extra = 0
    if HAS_EXTRA:
        n_extra = K_E
        if HAS_LENS:
            n_extra = tl.minimum(tl.load(ELENS + r), K_E)
    tiles_main = tl.cdiv(n_main, BLOCK_N)
    tiles_extra = tl.cdiv(n_extra, BLOCK_N)
    lo = split * tiles_per_split
    hi = tl.minimum(lo + tiles_per_split, tiles_main + tiles_extra)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # -- main indices: gather BLOCK_N keys by index (masked: -1, out of range, past topk_length never read) ---------
    if PAGED:  # a dense decode: slot t of row r is token t of its request, through the block table
        idx_base = IDX + (r // rows_per_req).to(tl.int64) * stride_ir
    else:
        idx_base = IDX + r64 * stride_ir + kvh * stride_ih
    kv_base = KV + kvh * stride_kh
    for tile in range(lo, tl.minimum(hi, tiles_main)):
        t = tile * BLOCK_N + offs_n
        if PAGED:
            page = tl.load(idx_base + t // PAGE, mask=t < n_main, other=-1)  # read BLOCK_N / PAGE int32
            slots = page * PAGE + t % PAGE  # a -1 page gives a negative slot: not used
        else:
            slots = tl.load(idx_base + t, mask=t < n_main, other=-1)  # read BLOCK_N int32
        ok = (t < n_main) & (slots >= 0) & (slots < n_rows)
        k_nope, k_rope = _load_keys(
            kv_base, KVF, KVB, slots, ok, stride_kn, page_bytes, FMT, D_V, D_ROPE, PAGE, BLOCK_N
        )
        m_i, l_i, acc = _attend_tile(
            q_nope,
            q_rope,
            k_nope.to(q_nope.dtype),
            k_rope.to(q_nope.dtype),
            ok,
            m_i,
            l_i,
            acc,
            qk_scale,
            D_ROPE,
            PRECISION,
        )

    # -- extra indices (V4's compressed cache): more terms of the same softmax --------------------------------------
    if HAS_EXTRA:
        eidx_base = EIDX + r64 * stride_eir
        for tile in range(tl.maximum(lo, tiles_main), hi):
            t = (tile - tiles_main) * BLOCK_N + offs_n
            slots = tl.load(eidx_base + t, mask=t < n_extra, other=-1)
            ok = (t < n_extra) & (slots >= 0) & (slots < e_n_rows)
            k_nope, k_rope = _load_keys(
                EKV, EKVF, EKVB, slots, ok, stride_ekn, e_page_bytes, EFMT, D_V, D_ROPE, EPAGE, BLOCK_N
            )
            m_i, l_i, acc = _attend_tile(
                q_nope,
                q_rope,
                k_nope.to(q_nope.dtype),
                k_rope.to(q_nope.dtype),
                ok,
                m_i,
                l_i,
                acc,
                qk_scale,
                D_ROPE,
                PRECISION,
            )

    if SINGLE:
        # -- epilogue: write BLOCK_H * D_V in q's dtype, LSE and max_logits -------------------------------------------
        out, lse, max_logits = _finish(m_i, l_i, acc, SINK, heads, head_ok, HAS_SINK)
        o_ptr = OUT + r64 * stride_or + heads * stride_oh
        tl.store(o_ptr[:, None] + offs_v[None, :], out.to(OUT.dtype.element_ty), mask=head_ok[:, None])
        tl.store(LSE + r64 * stride_lr + heads, lse, mask=head_ok)
        tl.store(MAXL + r64 * stride_lr + heads, max_logits, mask=head_ok)
    else:
        # -- a partial: unnormalised acc and (m, l) in base 2, merged by the combine kernel ---------------------------
        part = (r64 * H_Q + heads) * num_splits + split
        tl.store(O_PART + part[:, None] * D_V + offs_v[None, :], acc, mask=head_ok[:, None])
        tl.store(ML_PART + part * 2, m_i, mask=head_ok)
        tl.store(ML_PART + part * 2 + 1, l_i, mask=head_ok)


@triton.jit
def _sparse_mla_combine_kernel(
    O_PART,
    ML_PART,
    SINK,
    OUT,
    LSE,
    MAXL,
    stride_or,
    stride_oh,
    stride_lr,
    H_Q,
    num_splits,
    HAS_SINK: tl.constexpr,
    D_V: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r, hb, pid_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r64 = r.to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H_Q
    offs_sp = tl.arange(0, SPLITS_P2)
    offs_v = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    # -- the splits' running maxima and sums: m = max m_i, l = sum l_i 2^(m_i - m) ----------------------------------
    part = (r64 * H_Q + heads)[:, None] * num_splits + offs_sp[None, :]  # [BLOCK_H, SPLITS_P2]
    pm = head_ok[:, None] & (offs_sp[None, :] < num_splits)
    ms = tl.load(ML_PART + part * 2, mask=pm, other=float("-inf"))
    ls = tl.load(ML_PART + part * 2 + 1, mask=pm, other=0.0)
    m = tl.max(ms, 1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(ms - m_use[:, None])  # empty splits: 0
    l_i = tl.sum(ls * w, 1)
    # -- acc = sum_i 2^(m_i - m) acc_i: read splits * BLOCK_D fp32 per head ------------------------------------------
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    base = (r64 * H_Q + heads) * num_splits
    for i in range(num_splits):
        wi = tl.exp2(tl.load(ML_PART + (base + i) * 2, mask=head_ok, other=float("-inf")) - m_use)
        acc += wi[:, None] * tl.load(
            O_PART + (base + i)[:, None] * D_V + offs_v[None, :], mask=head_ok[:, None], other=0.0
        )
    out, lse, max_logits = _finish(m, l_i, acc, SINK, heads, head_ok, HAS_SINK)
    tl.store(
        OUT + r64 * stride_or + heads[:, None] * stride_oh + offs_v[None, :],
        out.to(OUT.dtype.element_ty),
        mask=head_ok[:, None],
    )
    if pid_d == 0:
        tl.store(LSE + r64 * stride_lr + heads, lse, mask=head_ok)
        tl.store(MAXL + r64 * stride_lr + heads, max_logits, mask=head_ok)


# -- host side ------------------------------------------------------------------------------------------------------
class KeyCache(NamedTuple):
    """Where the keys live, as the kernel reads them (build with :func:`float_keys` or :func:`fp8_keys`).

    ``fmt`` is ``"float"`` (``data [N, H_kv, D_qk]`` in q's dtype), ``"fp8_v32"`` (``data [N, 656]`` uint8, one
    record per slot) or ``"fp8_v4"`` (``data [NB, page_bytes]`` uint8 page blocks of ``page_size`` tokens).
    ``num_rows`` is the number of key rows / slots ``N``: indices outside ``[0, N)`` are skipped.
    """

    fmt: str
    data: torch.Tensor
    page_size: int
    num_rows: int
    d_qk: int


def float_keys(kv: torch.Tensor) -> KeyCache:
    """Key rows in q's dtype: ``[N, H_kv, D]``, ``[N, D]``, or a paged ``[NB, P, D]`` / ``[NB, P,
    1, D]`` cache whose global slot ``block * P + offset`` is the row (pass the 4-D or the 3-D view ``.flatten(0,
    1)[:, None]``)."""
    if kv.dim() == 2:
        kv = kv[:, None]
    elif kv.dim() == 4:
        kv = kv.flatten(0, 1)
    if kv.dim() != 3 or kv.stride(-1) != 1:
        raise ValueError(f"kv must be [N, H_kv, D] (last dim contiguous), got shape {list(kv.shape)}")
    return KeyCache("float", kv, 1, kv.shape[0], kv.shape[-1])


def fp8_keys(raw: torch.Tensor, layout: str, page_size: int = 64) -> KeyCache:
    """FlashMLA's fp8 sparse cache: ``layout`` ``"fp8_v32"`` (``raw [N, 656]`` or pages ``[NB, P * 656]``,
    token-interleaved, D_qk 576) or ``"fp8_v4"`` (``raw [NB, page_bytes]``, split layout, D_qk 512)."""
    if raw.dtype != torch.uint8 or not raw.is_contiguous():
        raise TypeError(f"raw must be a contiguous uint8 tensor, got {raw.dtype}")
    if layout == "fp8_v32":
        data = raw.reshape(-1, 656)
        return KeyCache(layout, data, page_size, data.shape[0], 576)
    if layout == "fp8_v4":
        pb = cl.page_bytes(cl.FP8_DS_MLA_V4, page_size)
        data = raw.reshape(-1, pb)
        return KeyCache(layout, data, page_size, data.shape[0] * page_size, 512)
    raise ValueError(f"layout must be 'fp8_v32' or 'fp8_v4', got {layout!r}")


def quantize_keys(entries: torch.Tensor, page_size: int = 64) -> KeyCache | None:
    """Write dequantized entries ``[N, D]`` (``N`` global slots; D 576 or 512) as FlashMLA's fp8 sparse cache with
    the spec's exact writer (:func:`mlaspec.spec.cache_layouts.exact_pages`), or None if the layout cannot hold them
    exactly.

    Rows with a non-finite value (the harness's never-named slots) are written as ``0xFF`` bytes (fp8 NaN); scales
    are FlashMLA's power-of-two rule or vLLM's raw ``amax / 448``, whichever reproduces the entries exactly (V3.2), or
    e8m0 (V4). ``N`` must be a multiple of ``page_size`` for V4.
    """
    d = entries.shape[-1]
    layout = {576: cl.FP8_DS_MLA_V32, 512: cl.FP8_DS_MLA_V4}.get(d)
    if layout is None:
        return None
    x = entries.reshape(-1, d)
    n = x.shape[0]
    if d == 512 and n % page_size:
        return None
    try:
        pages = cl.exact_pages(x.cpu(), layout, page_size)
    except ValueError:  # not exactly representable
        return None
    if d == 576:  # token-interleaved: the records themselves, without the padding of the last page
        return fp8_keys(pages.reshape(-1, layout.token_bytes)[:n].to(entries.device), "fp8_v32", page_size)
    return fp8_keys(pages.to(entries.device), "fp8_v4", page_size)


class BlockTable(NamedTuple):
    """Slots of a dense paged decode, passed as ``indices``: row ``r`` reads slot ``table[r // rows_per_request, t //
    P] * P + t % P`` for ``t < topk_length[r]`` (``P`` the cache's page size; a ``-1`` page is skipped). ``table``:
    ``[B, max_blocks]`` int32."""

    table: torch.Tensor
    rows_per_request: int = 1


class SparseOutput(NamedTuple):
    """``out [R, H_q, D_v]`` (q's dtype), ``lse [R, H_q]`` fp32 natural log (``+inf``: empty), ``max_logits``."""

    out: torch.Tensor
    lse: torch.Tensor
    max_logits: torch.Tensor


class SparseConfig(NamedTuple):
    block_h: int  # query heads per program
    block_n: int  # slots per step
    num_warps: int
    num_stages: int
    per_sm: int = 1  # programs an SM: the decode views' default splits fill this many a SM (decode_splits)


def sparse_config(group: int, dtype: torch.dtype, fp8: bool = False, rows: int = 0) -> SparseConfig:
    """Tiles for ``group`` query heads per KV head (and ``rows`` query rows, for the fp8 caches' few-head tiles): up
    to 64 heads (one Hopper warpgroup MMA tall) x 64 slots for 16-bit inputs and the fp8 caches (a 72 KB bf16 key
    tile; q is 72 KB), 8 warps so the ``[64, 512]`` fp32 accumulator is 128 registers a thread; half tiles for fp32.
    Measured on an H200 (fp8 656 B cache, B = 64, H_q = 128, K = 2048): 64 slots 247 us, 32 slots 321 us, 16 slots
    (4 warps) 923 us.

    The fp8 caches at up to 16 heads (V3.2's 128 heads over 8 GPUs) gather more than they multiply. From 32 rows:
    32 slots, 3 stages and two programs an SM (:func:`decode_splits`); below, where the splits are what keep the card
    busy: 64 slots, 8 warps, one stage. Timed on an H200 (K = 2048, CUDA-graph replays) against the 64-slot,
    4-warp, 2-stage tiles these replace: B = 1 / 8 / 16 24.0 / 24.6 / 34.2 -> 21.7 / 21.4 / 29.4 us, B = 32 / 64 /
    128 67.3 / 122.5 / 224.5 -> 54.4 / 96.0 / 178.9 us (FlashMLA, 64 padded heads: 18.3 / 21.6 / 29.8, 48.1 / 76.3 /
    114.0 us). At 64 and 128 heads no tiles of a 48-configuration sweep were more than 2% faster.

    These are the readable kernel's tiles. On Hopper the 656-byte cache takes :mod:`mlaspec.impl.sparse_sm90`'s own
    64 x 64 tiles at every head count (:func:`sparse_mla`'s ``kernel``)."""
    big = dtype == torch.float32
    block_h = min(32 if big else 64, max(16, triton.next_power_of_2(group)))
    if fp8 and block_h == 16 and not big:
        return SparseConfig(16, 32, 4, 3, per_sm=2) if rows >= 32 else SparseConfig(16, 64, 8, 1)
    block_n = 32 if big else 64
    return SparseConfig(block_h, block_n, 8 if block_h >= 64 else 4, 1 if big else 2)


def combine_config(rows: int, heads: int, d_v: int) -> tuple[int, int, int]:
    """``(block_h, block_d, num_warps)`` of the combine for ``rows`` rows of ``heads`` query heads: heads and value
    columns a program, warps.

    One warp over 128 columns of one head, four heads from 513 ``(row, head)`` pairs on: each program reads its
    splits one after another, so what sets the combine's time is how many programs read at once. Measured on an H200
    (fp8 656-byte cache, top-k 2048, CUDA-graph replays of the whole decode; before: 16 heads and all 512 columns a
    program, four warps): B1 16 / 64 / 128 heads 19.7 / 22.9 / 23.1 -> 14.4 / 17.4 / 17.8 us (the combine alone was
    8.2-8.6 us of them, the split kernel 11.0-12.9), B8 16 / 64 / 128 heads 22.2 / 27.3 / 31.3 -> 16.4 / 22.9 / 30.7,
    B16 26.6 / 33.5 / 48.2 -> 23.9 / 32.1 / 46.6, B32 within 1-2% of the best of ten configurations.
    """
    return (1 if rows * heads <= 512 else 4), min(d_v, 128), 1


def decode_splits(programs: int, num_sms: int, per_sm: int = 1) -> int:
    """Splits per row for ``programs`` (rows x head blocks) decode programs: the most that still fit one whole wave
    of ``per_sm`` programs an SM, ``floor(per_sm * num_sms / programs)``, at least 1. A partial wave costs a whole
    one: measured on an H200 (fp8 656-byte cache, top-k 2048), B = 64, H_q = 64: 2 splits 124 us, 5 splits 157 us;
    B = 16, H_q = 128: 4 splits 119 us, 9 splits 189 us; B = 128, H_q = 128: 1 split 403 us, 2 splits 456 us."""
    return max(1, per_sm * num_sms // max(1, programs))


def _source_args(src: KeyCache, dtype: torch.dtype):
    """(KV, KVF, KVB, stride_n, stride_h, page_bytes, FMT): the tensors and strides the kernel reads."""
    if src.fmt == "float":
        if src.data.dtype != dtype:
            raise TypeError(f"float keys must have q's dtype {dtype}, got {src.data.dtype}")
        return src.data, src.data, src.data, src.data.stride(0), src.data.stride(1), 0, FMT_FLOAT
    if src.fmt == "fp8_v32":
        d = src.data
        return d, d.view(torch.float32), d.view(torch.bfloat16), 656, 0, 0, FMT_FP8_V32
    d = src.data
    return d, d, d.view(torch.bfloat16), 0, 0, d.shape[1], FMT_FP8_V4


def sparse_producer_runs(tiles_per_split: int) -> bool:
    """Whether the Gluon sparse decode takes :mod:`mlaspec.impl.sparse_sm90_producer` (a producer warpgroup
    dequantizes beside the MMAs) over :mod:`mlaspec.impl.sparse_sm90` (all 8 warps dequantize, then multiply) for
    splits of ``tiles_per_split`` 64-slot tiles. Same outputs either way; the choice is by speed, measured on an H100
    (2026-11-27, top-k 2048, B1-128, 16-128 heads): the producer is faster walking a whole row's 32 tiles (128 heads
    B64: 133.7 -> 127.8 us) or at most 4 (B1-16: 6-11%), slower over splits of 8-16 tiles (16 heads B64: 68.1 ->
    74.8 us), where its one-warpgroup dequantization of a split's first tile is not hidden."""
    return not 4 < tiles_per_split < 32


def float_keys_sm90(heads: int, programs: int, num_sms: int) -> bool:
    """Whether keys already in q's dtype take :func:`mlaspec.impl.sparse_sm90.sparse_kernel_float` under
    ``kernel="auto"`` (where it applies) for ``heads`` query heads a KV head and ``programs`` whole-row programs of
    64 heads: more than 32 heads (its 64-row tile at least half full), or programs that fit one wave on ``num_sms``
    SMs but not so few that the readable kernel's more, shorter splits win (at least ``num_sms // 8``; the gathers
    then set the pace, and its next tile in flight is what counts). Measured on an H200 (2026-11-29,
    top-k 2048, ``do_bench``; Gluon against the readable kernel's 16-row tiles): prefill S_q = 4096, 64 / 128 heads
    3225-3372 / 6338-6449 us against 4669-5228 / 9241-10211 (FlashMLA 2135-2492 / 4138-4692), 32 heads 3143-3148
    against 3107-3551, 16 heads 3098-3105 against 2117-2482; the decode over a bf16 cache (CUDA-graph replays, 8K
    keys a request), 16 heads B = 16 / 64 / 128 19.9 / 58.0 / 104.3 us against 21.4 / 74.4 / 142.4, 64-128 heads
    1.1-1.7x faster at every batch; B = 1, 16 heads 12.7 against 11.0 (the readable kernel's 32 one-tile splits
    against 16 of two), 32 heads 13.4 both."""
    return heads > 32 or num_sms // 8 <= programs <= num_sms


def sparse_sm90_why_not(
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    fmt: str,
    *,
    d_v: int,
    d_rope: int,
    paged: bool = False,
    extra: bool = False,
    kv_heads: int = 1,
    aligned: bool = True,
    tile: tuple[int, int] | None = None,
) -> str | None:
    """Why :mod:`mlaspec.impl.sparse_sm90` cannot take this call, or ``None`` where it can.

    It needs Gluon in this Triton, a Hopper GPU (``capability``: the CUDA device's compute capability, ``None`` off
    CUDA or under the interpreter), q in bf16/fp16 over FlashMLA's 656-byte fp8 cache (``fmt`` ``"fp8_v32"``) or
    keys in q's dtype (``"float"``: ``sparse_kernel_float``), ``512 + 64`` entries of one KV head (``kv_heads``) by
    indices (not a ``BlockTable``, no ``extra`` cache), (``aligned``) q and the cache 16-byte aligned, q's strides
    multiples of 16 elements, float key rows too (its ``cp.async`` copies 16 bytes only where Triton knows the
    stride divisible by 16: a row stride of 584 does not compile), and its ``64 x 64`` tiles (``tile``:
    a config override's ``(block_h, block_n)``). Any head count: fewer than 64 heads fill a tile with zero rows, as
    FlashMLA pads them to 64 (its program's time is set by its gathers, not its rows).
    """
    if why := hopper_why_not("sparse_sm90", sparse_sm90.AVAILABLE, capability):
        return why
    if fmt not in ("fp8_v32", "float") or dtype not in (torch.bfloat16, torch.float16):
        return f"sparse_sm90 takes bf16/fp16 q over the 656-byte fp8 cache or q-dtype keys, got {dtype} over {fmt!r}"
    if paged or extra or kv_heads != 1:
        return "sparse_sm90 takes one cache of one KV head by indices (no BlockTable, no extra cache)"
    if tile is not None and tile != (sparse_sm90.BLOCK_H, sparse_sm90.BLOCK_N):
        return f"sparse_sm90 takes tiles of 64 heads x 64 slots, got {tile[0]} x {tile[1]}"
    if (d_v, d_rope) != (512, 64):
        return f"sparse_sm90 takes entries of 512 + 64, got {d_v} + {d_rope}"
    if not aligned:
        return "sparse_sm90 takes q and the cache 16-byte aligned, q's strides (and key rows') multiples of 16 elements"
    return None


def sparse_mla(
    q: torch.Tensor,
    keys: KeyCache,
    indices: torch.Tensor,
    *,
    scale: float,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra: KeyCache | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    num_splits: int | None = 1,
    config: SparseConfig | None = None,
    kernel: str | None = None,
) -> SparseOutput:
    """Sparse attention of ``q [R, H_q, D_qk]`` over the keys ``indices [R, H_kv, K]`` names (see the module docstring).

    Args:
        q: ``[R, H_q, D_qk]`` bf16/fp16/fp32, last dim contiguous; ``D_qk - d_v`` is 0 or a power of two >= 16.
        keys: the key rows (:func:`float_keys`, :func:`fp8_keys`); fp8 sources need ``H_kv = 1``.
        indices: ``[R, H_kv, K]`` (or ``[R, K]``) int32; used where ``0 <= index < keys.num_rows``. Or a
            :class:`BlockTable` (a dense paged decode: ``topk_length`` is then required, ``H_kv = 1``).
        scale: softmax scale.
        d_v: value width, a power of two >= 16 (the leading columns of each key).
        topk_length: optional ``[R]`` int32, slots used per row.
        attn_sink: optional ``[H_q]`` float32 (``±inf`` allowed).
        extra, extra_indices, extra_topk_length: a second key source ``[R, K_E]`` int32 in the same softmax (V4).
        num_splits: pieces each row's slot tiles are cut into (more programs for few rows); merged by LSE.
            ``None``: the decode views' default, :func:`decode_splits` of the programs; the Gluon kernel keeps at
            least two slot tiles a split, so the second tile's bytes stream in during the first's work (on an H200,
            top-k 2048: B = 1, 64 heads 24.0 -> 21.8 us; B = 2, 128 heads 28.5 -> 23.3 us).
        config: tile override (default :func:`sparse_config`); it runs the readable kernel unless ``kernel="sm90"``.
        kernel: ``"auto"`` (default; or the ``MLASPEC_SPARSE_KERNEL`` environment variable): on Hopper, over the
            656-byte fp8 cache, :mod:`mlaspec.impl.sparse_sm90` (Gluon; its own tiles; or its producer-warpgroup
            twin where :func:`sparse_producer_runs`), over keys in q's dtype its ``sparse_kernel_float`` where
            :func:`float_keys_sm90`, else the readable kernel;
            ``"triton"``: the readable kernel; ``"sm90"``: the Gluon kernel, a ``ValueError`` saying why where it
            cannot run (:func:`sparse_sm90_why_not`).

    Returns:
        ``out [R, H_q, d_v]`` in q's dtype, ``lse [R, H_q]`` and ``max_logits [R, H_q]`` fp32.
    """
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [R, H_q, D_qk] with a contiguous last dim, got shape {list(q.shape)}")
    R, H_q, D_qk = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q must be bf16/fp16/fp32, got {q.dtype}")
    if keys.d_qk != D_qk:
        raise ValueError(f"keys have D_qk={keys.d_qk}, q has {D_qk}")
    d_rope = D_qk - d_v
    if d_v < 16 or d_v & (d_v - 1) or (d_rope and (d_rope < 16 or d_rope & (d_rope - 1))):
        raise ValueError(f"d_v and D_qk - d_v must be powers of two >= 16 (or D_qk == d_v), got {d_v}, {D_qk}")
    if keys.fmt == "fp8_v4" and d_rope:
        raise ValueError("the fp8 V4 cache needs d_v == D_qk == 512")
    paged = isinstance(indices, BlockTable)
    if paged:
        rows_per_req = int(indices.rows_per_request)
        indices = indices.table
        if indices.dim() != 2 or indices.dtype != torch.int32 or rows_per_req < 1:
            raise ValueError(
                f"a BlockTable needs table [B, max_blocks] int32 and rows_per_request >= 1, got "
                f"{list(indices.shape)} {indices.dtype}, {rows_per_req}"
            )
        if indices.shape[0] * rows_per_req != R:
            raise ValueError(f"the block table's {indices.shape[0]} requests x {rows_per_req} rows must be R={R}")
        if topk_length is None:
            raise ValueError("topk_length (the tokens each row sees) must be given with a BlockTable")
        if keys.fmt == "float":  # float_keys flattens the pages: the page size a table needs is gone
            raise ValueError("a BlockTable needs a paged fp8 KeyCache (fp8_keys carries its page size), got float keys")
        indices = indices[:, None]
    elif indices.dim() == 2:
        indices = indices[:, None]
    h_kv = indices.shape[1]
    if not paged and (indices.shape[0] != R or indices.dtype != torch.int32):
        raise ValueError(f"indices must be [R={R}, H_kv, K] int32, got {list(indices.shape)} {indices.dtype}")
    if keys.fmt == "float" and keys.data.shape[1] != h_kv:
        raise ValueError(f"indices name H_kv={h_kv} heads, keys have {keys.data.shape[1]}")
    if keys.fmt != "float" and h_kv != 1:
        raise ValueError(f"the fp8 caches hold one KV head, indices name {h_kv}")
    if H_q % h_kv:
        raise ValueError(f"H_kv={h_kv} must divide H_q={H_q}")
    G = H_q // h_kv
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    K = indices.shape[-1] * (keys.page_size if paged else 1)
    dev = q.device

    def lengths(name, t):
        if t is None:
            return None
        if t.shape != (R,):
            raise ValueError(f"{name} must be [R={R}], got {list(t.shape)}")
        return t.to(dev, torch.int32).contiguous()

    topk_length = lengths("topk_length", topk_length)
    if extra is not None:
        if extra_indices is None:
            raise ValueError("extra_indices must be given with extra")
        extra_indices = extra_indices.reshape(R, -1).to(torch.int32).contiguous()
        if extra.d_qk != D_qk:
            raise ValueError(f"extra keys have D_qk={extra.d_qk}, q has {D_qk}")
        if h_kv != 1:
            raise ValueError("an extra cache needs H_kv = 1")
        extra_topk_length = lengths("extra_topk_length", extra_topk_length)
    if attn_sink is not None:
        if attn_sink.shape != (H_q,):
            raise ValueError(f"attn_sink must be [H_q={H_q}], got {list(attn_sink.shape)}")
        attn_sink = attn_sink.to(dev, torch.float32).contiguous()
    # the lengths are read for both lists or for neither: a list without them uses its full width
    has_lens = topk_length is not None or extra_topk_length is not None
    if has_lens and topk_length is None:
        topk_length = torch.full((R,), K, dtype=torch.int32, device=dev)
    if has_lens and extra is not None and extra_topk_length is None:
        extra_topk_length = torch.full((R,), extra_indices.shape[1], dtype=torch.int32, device=dev)

    fp8 = keys.fmt != "float" or (extra is not None and extra.fmt != "float")
    cfg = config or sparse_config(G, q.dtype, fp8, R)
    kernel = kernel_named(kernel, "MLASPEC_SPARSE_KERNEL")
    row_strides = (keys.data.stride(0),) if keys.fmt == "float" else ()  # the gathered rows, 16-byte copies
    why = sparse_sm90_why_not(
        compiled_capability(dev), q.dtype, keys.fmt, d_v=d_v, d_rope=d_rope, paged=paged, extra=extra is not None,
        kv_heads=h_kv, aligned=aligned16(q, keys.data, strides=(*q.stride()[:2], *row_strides)),
        tile=None if config is None else (config.block_h, config.block_n),
    )  # fmt: skip
    programs = R * h_kv * triton.cdiv(G, sparse_sm90.BLOCK_H)  # the Gluon kernel's, whole rows
    readable_faster = keys.fmt == "float" and not float_keys_sm90(G, programs, _num_sms(dev))
    gluon = gluon_runs(kernel, why, tuned=config is not None or readable_faster)
    if gluon:
        cfg = SparseConfig(sparse_sm90.BLOCK_H, sparse_sm90.BLOCK_N, sparse_sm90.NUM_WARPS, 1)
    K_E = 0 if extra is None else extra_indices.shape[1]
    tiles = triton.cdiv(K, cfg.block_n) + triton.cdiv(K_E, cfg.block_n)
    if num_splits is None:
        num_splits = decode_splits(R * h_kv * triton.cdiv(G, cfg.block_h), _num_sms(dev), cfg.per_sm)
        if gluon:
            num_splits = min(num_splits, max(1, tiles // 2))
    num_splits = max(1, min(int(num_splits), max(tiles, 1)))
    tiles_per_split = max(1, triton.cdiv(tiles, num_splits))
    num_splits = max(1, triton.cdiv(tiles, tiles_per_split))

    out = torch.empty(R, H_q, d_v, dtype=q.dtype, device=dev)
    lse = torch.empty(R, H_q, dtype=torch.float32, device=dev)
    max_logits = torch.empty(R, H_q, dtype=torch.float32, device=dev)
    if R == 0 or H_q == 0:
        return SparseOutput(out, lse, max_logits)
    if num_splits > 1:
        o_part = torch.empty(R, H_q, num_splits, d_v, dtype=torch.float32, device=dev)
        ml_part = torch.empty(R, H_q, num_splits, 2, dtype=torch.float32, device=dev)
    else:
        o_part, ml_part = out, lse  # unused
    kv, kvf, kvb, s_n, s_h, pb, fmt = _source_args(keys, q.dtype)
    if extra is not None:
        ekv, ekvf, ekvb, es_n, _, epb, efmt = _source_args(extra, q.dtype)
        eidx, e_rows, epage = extra_indices, extra.num_rows, extra.page_size
    else:
        ekv, ekvf, ekvb, es_n, epb, efmt, eidx, e_rows, epage = kv, kvf, kvb, 0, 0, fmt, indices, 0, 1
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (h_kv * triton.cdiv(G, cfg.block_h), R, num_splits)
    unused = out  # stands in for the pointers a constexpr flag leaves unread
    lens, sink = topk_length if has_lens else unused, attn_sink if attn_sink is not None else unused
    results = (out, lse, max_logits, out.stride(0), out.stride(1), lse.stride(0), o_part, ml_part, H_q)
    flags = dict(HAS_LENS=has_lens, HAS_SINK=attn_sink is not None, D_V=d_v, D_ROPE=d_rope, SINGLE=num_splits == 1)
    flags.update(BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n)
    if gluon and keys.fmt == "float":
        sparse_sm90.sparse_kernel_float[grid](
            q, q.stride(0), q.stride(1), kv, s_n, keys.num_rows, indices, indices.stride(0), lens, K, sink,
            *results, tiles_per_split, num_splits, scale * LOG2E, **flags, num_warps=sparse_sm90.NUM_WARPS,
        )  # fmt: skip
    elif gluon:
        g = sparse_sm90_producer if sparse_producer_runs(tiles_per_split) else sparse_sm90
        g.sparse_kernel[grid](
            q, q.stride(0), q.stride(1), kv, kvf, kvb, keys.num_rows, indices, indices.stride(0), lens, K, sink,
            *results, tiles_per_split, num_splits, scale * LOG2E, **flags, num_warps=g.NUM_WARPS,
        )  # fmt: skip
    else:
        e_lens = extra_topk_length if has_lens and extra is not None else unused
        _sparse_mla_kernel[grid](
            q, q.stride(0), q.stride(1), kv, kvf, kvb, s_n, s_h, pb, keys.num_rows,
            indices, indices.stride(0), indices.stride(1), lens, K, rows_per_req if paged else 1,
            ekv, ekvf, ekvb, es_n, epb, e_rows, eidx, eidx.stride(0), e_lens, K_E, sink,
            *results, G, tiles_per_split, num_splits, scale * LOG2E,
            PAGED=paged, HAS_EXTRA=extra is not None, FMT=fmt, EFMT=efmt, PAGE=keys.page_size, EPAGE=epage,
            PRECISION=precision, **flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    if num_splits > 1:
        bh, bd, warps = combine_config(R, H_q, d_v)
        _sparse_mla_combine_kernel[(R, triton.cdiv(H_q, bh), d_v // bd)](
            o_part,
            ml_part,
            attn_sink if attn_sink is not None else unused,
            out,
            lse,
            max_logits,
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            H_q,
            num_splits,
            HAS_SINK=attn_sink is not None,
            D_V=d_v,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            BLOCK_H=bh,
            BLOCK_D=bd,
            num_warps=warps,
        )
    return SparseOutput(out, lse, max_logits)


def sparse_mla_decode(
    q: torch.Tensor,
    keys: KeyCache,
    indices: torch.Tensor,
    *,
    scale: float,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra: KeyCache | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: SparseConfig | None = None,
    kernel: str | None = None,
):
    """The decode view (``flash_mla_with_kvcache`` with ``indices``): ``q [B, S_q, H_q, D_qk]``, ``indices [B, S_q,
    K]`` global slots ``block * P + offset`` into ``keys`` (``-1`` invalid), ``topk_length [B]`` per request (shared by
    its ``S_q`` queries), likewise the extra cache; ``kernel`` as :func:`sparse_mla`. Returns ``out [B, S_q, H_q,
    d_v]`` and ``lse [B, H_q, S_q]`` (``+inf`` on empty rows). ``num_splits`` defaults as :func:`sparse_mla`'s
    ``None``."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S_q, H_q, D_qk], got shape {list(q.shape)}")
    B, S_q, H_q, D = q.shape
    R = B * S_q

    def per_row(t):
        return None if t is None else t.to(q.device, torch.int32).repeat_interleave(S_q)

    res = sparse_mla(
        q.reshape(R, H_q, D),
        keys,
        indices.reshape(R, 1, -1).to(torch.int32),
        scale=scale,
        d_v=d_v,
        topk_length=per_row(topk_length),
        attn_sink=attn_sink,
        extra=extra,
        extra_indices=None if extra_indices is None else extra_indices.reshape(R, -1),
        extra_topk_length=per_row(extra_topk_length),
        num_splits=num_splits,
        config=config,
        kernel=kernel,
    )
    return res.out.view(B, S_q, H_q, d_v), res.lse.view(B, S_q, H_q).transpose(1, 2)


def paged_decode(
    q: torch.Tensor,
    keys: KeyCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    d_v: int = 512,
    causal: bool = True,
    num_splits: int | None = None,
    config: SparseConfig | None = None,
):
    """Dense paged MLA decode over FlashMLA's fp8 caches (``keys`` from :func:`fp8_keys`: the 656-byte
    ``fp8_ds_mla`` token, or V4's pages): the sparse kernel with every token of each request named through the
    block table (:class:`BlockTable`).

    ``q [B, S_q, H_q, D_qk]``, ``block_table [B, max_blocks]`` int32 (pages of ``keys.page_size`` slots),
    ``seq_lens [B]`` int. With ``causal`` query ``j`` of request ``b`` sees the first ``seq_lens[b] - S_q + 1 + j``
    tokens (queries aligned to the end of the context, as FlashMLA's dense decode), else all ``seq_lens[b]``.
    Returns ``out [B, S_q, H_q, d_v]`` and ``lse [B, H_q, S_q]`` fp32 (natural log; a row that sees nothing has
    output 0 and LSE ``-inf``, the dense convention, where the sparse views return ``+inf``)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S_q, H_q, D_qk], got shape {list(q.shape)}")
    B, S_q, H_q, D = q.shape
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be [B={B}], got {list(seq_lens.shape)}")
    lens = seq_lens.to(q.device, torch.int32)[:, None]
    if causal:
        lens = lens - S_q + 1 + torch.arange(S_q, dtype=torch.int32, device=q.device)
    lens = lens.expand(B, S_q).clamp_min(0).reshape(-1).contiguous()
    table = BlockTable(block_table.to(q.device, torch.int32).contiguous(), S_q)
    res = sparse_mla(
        q.reshape(B * S_q, H_q, D),
        keys,
        table,
        scale=scale,
        d_v=d_v,
        topk_length=lens,
        num_splits=num_splits,
        config=config,
    )
    lse = res.lse.masked_fill((lens == 0)[:, None], -math.inf)
    return res.out.view(B, S_q, H_q, d_v), lse.view(B, S_q, H_q).transpose(1, 2)
