"""Paged MLA decode over vLLM's per-tensor fp8 cache (``--kv-cache-dtype fp8``): 576 e4m3 bytes per token.

Implements :func:`mlaspec.spec.forms.mqa_latent_attention` over the *dequantized* cache, the op FlashMLA's dense
fp8 decode computes for vLLM (``vllm/model_executor/layers/attention/mla_attention.py`` with the
``fp8_e4m3_per_tensor`` layout of :mod:`mlaspec.spec.cache_layouts`): each cache entry is ``e4m3(x / k_scale)``,
576 bytes, ``[kv_c (512) | k_pe (64)]``, and its value is ``e4m3 * k_scale``. Conventions as
:mod:`mlaspec.impl.decode` (natural-log LSE ``[B, H_q, S_q]``, ``causal`` aligned to the end of the context, a row
with no key gives output 0 and LSE ``-inf``).

The descale is taken out of the inner loop, as FlashMLA does: the cache bytes are converted exactly (``e4m3`` has
4 significant bits and fits bf16/fp16/fp32) and multiplied against ``q`` as they are, and ``k_scale`` is folded
into the logit scale (``s = (q . e) * scale * k_scale``) and into the output (``out = k_scale * Σ p e / Σ p``), so
no rounding is added to what the bf16 kernel does. Traffic: ``N * 576`` bytes of cache per sequence (half the bf16
cache), ``q`` and ``out``.

Structure: the split-KV scheme of :mod:`mlaspec.impl.decode` (same grid, tiles and split heuristic); only the key
tile load differs (``uint8`` bytes -> ``tl.float8e4nv`` bitcast -> q's dtype). The splits are merged by
:mod:`mlaspec.impl.decode`'s combine kernel, which this module launches as is.

The 656-byte ``fp8_ds_mla`` token (per-128 scales, bf16 RoPE) is read by the sparse kernels
(:mod:`mlaspec.impl.sparse`), not here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import LOG2E, DecodeConfig, DecodeOutput, _mla_decode_combine_kernel, _num_sms, decode_config
from .decode import num_splits_heuristic

__all__ = ["mla_decode_fp8_paged"]


@triton.jit
def _mla_decode_fp8_split_kernel(
    Q, KV, BLOCK_TABLE, SEQ_LENS,  # q [B, S_q, H_q, D_V + D_ROPE], cache [num_pages, PAGE, D_V + D_ROPE] uint8
    O_PART, LSE_PART,  # [B, splits, R, D_V] fp32, [B, splits, R] fp32 (base 2): used unless SINGLE
    OUT, LSE,  # [B, S_q, H_q, D_V] q.dtype, [B, H_q, S_q] fp32 (natural log): used when SINGLE
    stride_qb, stride_qs, stride_qh,
    stride_kp, stride_ks,
    stride_btb,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    qk_scale,  # softmax scale * k_scale * log2(e): the logits of the raw e4m3 values
    k_scale,  # the value descale, applied to the output
    S_Q, H_Q, blocks_per_split, num_splits,
    CAUSAL: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    R = S_Q * H_Q

    # -- query rows (s, h) flattened as q stores them ------------------------------------------------------------
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < R
    s = rows // H_Q
    h = rows % H_Q
    offs_v = tl.arange(0, D_V)
    offs_r = tl.arange(0, D_ROPE)

    # -- keys each row may see -----------------------------------------------------------------------------------
    seq_len = tl.load(SEQ_LENS + b)
    if CAUSAL:
        n_keys = seq_len - S_Q + 1 + s
    else:
        n_keys = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len

    # -- this split's key blocks ---------------------------------------------------------------------------------
    SUB: tl.constexpr = PAGE // BLOCK_N
    n_blocks = tl.cdiv(seq_len, BLOCK_N)
    blk_lo = split * blocks_per_split
    blk_hi = tl.minimum(blk_lo + blocks_per_split, n_blocks)

    # -- the query block, once: read BLOCK_M * 576 in q's dtype -----------------------------------------------------
    q_base = Q + b.to(tl.int64) * stride_qb + s * stride_qs + h * stride_qh
    q_nope = tl.load(q_base[:, None] + offs_v[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_base[:, None] + D_V + offs_r[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    for blk in range(blk_lo, blk_hi):
        page = tl.load(BLOCK_TABLE + b * stride_btb + blk // SUB).to(tl.int64)
        slots = (blk % SUB) * BLOCK_N + offs_n
        keys = blk * BLOCK_N + offs_n
        key_ok = keys < seq_len  # slots past the end hold anything (0xFF = e4m3 NaN): masked to 0
        kv_ptr = KV + page * stride_kp + slots[:, None] * stride_ks
        # -- read BLOCK_N * 576 bytes; e4m3 -> q's dtype is exact (4 significant bits, exponents in range) --------
        raw_nope = tl.load(kv_ptr + offs_v[None, :], mask=key_ok[:, None], other=0)  # [BLOCK_N, D_V] uint8
        raw_rope = tl.load(kv_ptr + D_V + offs_r[None, :], mask=key_ok[:, None], other=0)  # [BLOCK_N, D_ROPE]
        kv_nope = raw_nope.to(tl.float8e4nv, bitcast=True).to(Q.dtype.element_ty)
        kv_rope = raw_rope.to(tl.float8e4nv, bitcast=True).to(Q.dtype.element_ty)

        # -- logits in base 2 of the raw values; k_scale sits in qk_scale --------------------------------------------
        qk = tl.dot(q_nope, tl.trans(kv_nope), input_precision=PRECISION)
        qk = tl.dot(q_rope, tl.trans(kv_rope), qk, input_precision=PRECISION)
        qk = qk * qk_scale
        allowed = key_ok[None, :] & (keys[None, :] < n_keys[:, None])
        qk = tl.where(allowed, qk, float("-inf"))

        # -- online softmax (base 2), empty rows keep m = -inf --------------------------------------------------------
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- P (rounded to q's dtype) @ the raw values, fp32 accumulation ---------------------------------------------
        acc = tl.dot(p.to(kv_nope.dtype), kv_nope, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    # -- epilogue: normalise and descale the values once ----------------------------------------------------------
    has_keys = l_i > 0.0
    l_use = tl.where(has_keys, l_i, 1.0)
    lse2 = tl.where(has_keys, m_i + tl.log2(l_use), float("-inf"))
    out = acc * (k_scale / l_use)[:, None]
    if SINGLE:
        o_ptr = OUT + b.to(tl.int64) * stride_ob + s * stride_os + h * stride_oh
        tl.store(o_ptr[:, None] + offs_v[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + b * stride_lb + h * stride_lh + s * stride_ls, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        part = (b * num_splits + split).to(tl.int64) * R + rows
        tl.store(O_PART + part[:, None] * D_V + offs_v[None, :], out, mask=row_ok[:, None])
        tl.store(LSE_PART + part, lse2, mask=row_ok)


# -- host side ----------------------------------------------------------------------------------------------------
def mla_decode_fp8_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    k_scale: float,
    d_v: int = 512,
    scale: float,
    causal: bool = True,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    config: DecodeConfig | None = None,
) -> DecodeOutput:
    """Absorbed MLA decode over a paged per-tensor e4m3 cache.

    Args:
        q: ``[B, S_q, H_q, D_qk]`` bf16/fp16/fp32, the absorbed queries (``D_qk = 576``), last dim contiguous.
        kv_cache: ``[num_pages, P, D_qk]`` uint8 (or ``torch.float8_e4m3fn``): ``e4m3(entry / k_scale)``; slots
            past a sequence's end are never used.
        block_table: ``[B, max_pages]`` int32. seq_lens: ``[B]`` int32 (0 allowed: output 0, LSE -inf).
        k_scale: the per-tensor cache scale (vLLM's ``layer._k_scale``), a float.
        d_v: value width (512); ``d_v`` and ``D_qk - d_v`` powers of two >= 16.
        scale: softmax scale. causal: MTP alignment (query ``s`` sees keys ``j <= s + seq_len - S_q``).
        num_splits, max_seq_len, config: as :func:`mlaspec.impl.decode.mla_decode_paged`.

    Returns:
        ``out [B, S_q, H_q, d_v]`` in q's dtype and ``lse [B, H_q, S_q]`` fp32 (natural log).
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S_q, H_q, D_qk], got shape {list(q.shape)}")
    B, S_q, H_q, D_qk = q.shape
    if kv_cache.dtype == torch.float8_e4m3fn:
        kv_cache = kv_cache.view(torch.uint8)
    if kv_cache.dim() != 3 or kv_cache.shape[2] != D_qk or kv_cache.dtype != torch.uint8:
        raise ValueError(f"kv_cache must be [num_pages, P, D_qk={D_qk}] uint8 e4m3 bytes, got "
                         f"{list(kv_cache.shape)} {kv_cache.dtype}")  # fmt: skip
    page_size = kv_cache.shape[1]
    d_rope = D_qk - d_v
    for name, width in (("d_v", d_v), ("D_qk - d_v", d_rope), ("kv_cache page size P", page_size)):
        if width < 16 or width & (width - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {width}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q must be bf16/fp16/fp32, got {q.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be [B={B}, max_pages] int32, got {list(block_table.shape)} "
                         f"{block_table.dtype}")  # fmt: skip
    if seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be [B={B}] int32, got {list(seq_lens.shape)} {seq_lens.dtype}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache must be contiguous in their last dimension")
    k_scale = float(k_scale)
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()

    rows = S_q * H_q
    cfg = config or decode_config(rows, page_size, q.dtype)
    if page_size % cfg.block_n:
        raise ValueError(f"config.block_n={cfg.block_n} must divide the page size {page_size}")
    row_blocks = triton.cdiv(rows, cfg.block_m)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if B else 0
    key_blocks = max(1, triton.cdiv(max_seq_len, cfg.block_n))
    if num_splits is None:
        num_splits = num_splits_heuristic(B, row_blocks, max_seq_len, _num_sms(q.device), block_n=cfg.block_n)
    num_splits = max(1, min(int(num_splits), key_blocks))
    blocks_per_split = triton.cdiv(key_blocks, num_splits)
    num_splits = triton.cdiv(key_blocks, blocks_per_split)

    out = torch.empty(B, S_q, H_q, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H_q, S_q, dtype=torch.float32, device=q.device)
    if B == 0 or rows == 0:
        return DecodeOutput(out, lse)
    if num_splits > 1:
        o_part = torch.empty(B, num_splits, rows, d_v, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, num_splits, rows, dtype=torch.float32, device=q.device)
    else:
        o_part, lse_part = out, lse
    precision = "ieee" if q.dtype == torch.float32 else "tf32"

    def launch(stages: int) -> None:
        _mla_decode_fp8_split_kernel[(row_blocks, num_splits, B)](
            q, kv_cache, block_table, seq_lens, o_part, lse_part, out, lse,
            q.stride(0), q.stride(1), q.stride(2),
            kv_cache.stride(0), kv_cache.stride(1),
            block_table.stride(0),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            scale * k_scale * LOG2E, k_scale, S_q, H_q, blocks_per_split, num_splits,
            CAUSAL=bool(causal), D_V=d_v, D_ROPE=d_rope, PAGE=page_size,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SINGLE=num_splits == 1, PRECISION=precision,
            num_warps=cfg.num_warps, num_stages=stages,
        )  # fmt: skip

    try:
        launch(cfg.num_stages)
    except triton.runtime.errors.OutOfResources:  # the byte tiles plus their converted copies: one stage less
        if cfg.num_stages <= 1:
            raise
        launch(1)
    if num_splits > 1:
        _mla_decode_combine_kernel[(rows, B)](
            o_part, lse_part, out, lse,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            S_q, H_q, num_splits,
            D_V=d_v, SPLITS_P2=triton.next_power_of_2(num_splits), num_warps=4,
        )  # fmt: skip
    return DecodeOutput(out, lse)
