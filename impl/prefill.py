"""Varlen flash-attention forward with LSE: the compute-friendly (prefill) form of MLA.

Implements :func:`mlaspec.spec.attention.attention_varlen` (flash-attn's ``flash_attn_varlen_func`` with
``return_softmax_lse``, as vLLM's MLA prefill calls it): sequence ``b`` owns queries
``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; ``causal`` is aligned
bottom-right within each sequence (query ``i`` sees key ``j`` iff ``j <= i + len_k - len_q``); query head ``h``
reads KV head ``h // (H_q / H_kv)`` (GQA / MQA); a row with no key gives output 0 and LSE ``-inf``; the LSE is the
natural log laid out ``[H_q, T_q]``.

MLA prefill runs it with ``D_qk = 192`` (128 nope + 64 rope) and ``D_v = 128``. The head dimension is split into
two power-of-two parts for ``tl.dot`` (``192 = 128 + 64``, any ``D <= 256`` otherwise padded), so no FLOP is spent
on padding for DeepSeek's widths.

The naive computation per sequence and head (``M = len_q``, ``N = len_k``)::

    s   = scale * q @ k.T          # read M D_qk + N D_qk, write M N
    p   = softmax(s)               # read M N, write M N
    out = p @ v                    # read M N + N D_v, write M D_v

The kernel tiles ``M`` into ``BLOCK_M`` rows per program and streams ``k``/``v`` in ``BLOCK_N`` blocks with an
online softmax (FlashAttention-2), so ``s`` and ``p`` never leave the chip: traffic is ``q``, ``out`` and
``ceil(M / BLOCK_M)`` passes over ``k`` and ``v``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["PrefillConfig", "PrefillOutput", "flash_attn_varlen", "prefill_config", "split_head_dim"]

LOG2E = 1.4426950408889634


@triton.jit
def _flash_fwd_varlen_kernel(
    Q,
    K,
    V,
    CU_Q,
    CU_K,  # q [T_q, H_q, D_qk], k [T_kv, H_kv, D_qk], v [T_kv, H_kv, D_v], cu_seqlens [B + 1]
    OUT,
    LSE,  # [T_q, H_q, D_v] q.dtype, [H_q, T_q] fp32 natural log
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lh,
    qk_scale,  # softmax scale * log2(e)
    group,
    D_QK,
    D_V,  # H_q // H_kv, and the true widths (the blocks below are padded)
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)

    # -- this sequence's queries and keys --------------------------------------------------------------------------
    q_start = tl.load(CU_Q + b)
    len_q = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    len_k = tl.load(CU_K + b + 1) - k_start
    if pid_m * BLOCK_M >= len_q:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    kvh = h // group  # GQA / MQA: the KV head this query head reads

    # -- the query block, head dim as two power-of-two parts [0, DA) and [DA, DA + DB): read BLOCK_M * D_qk ---------
    offs_da = tl.arange(0, BLOCK_DA)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + (q_start + rows).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    qa = tl.load(q_ptr + offs_da[None, :], mask=row_ok[:, None] & (offs_da[None, :] < D_QK), other=0.0)
    if BLOCK_DB > 0:  # a compile-time branch: DeepSeek's 192 = 128 + 64
        offs_db = BLOCK_DA + tl.arange(0, BLOCK_DB)
        qb = tl.load(q_ptr + offs_db[None, :], mask=row_ok[:, None] & (offs_db[None, :] < D_QK), other=0.0)

    # -- keys this block needs: all, or (causal) up to the last row's diagonal ------------------------------------
    hi = len_k
    if CAUSAL:
        hi = tl.minimum(len_k, tl.maximum(0, (pid_m + 1) * BLOCK_M + len_k - len_q))

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    k_base = K + k_start.to(tl.int64) * stride_kt + kvh * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + kvh * stride_vh

    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + offs_n
        key_ok = keys < len_k
        # -- logits in base 2: read BLOCK_N * D_qk -----------------------------------------------------------------
        k_ptr = k_base + keys.to(tl.int64)[:, None] * stride_kt
        ka = tl.load(k_ptr + offs_da[None, :], mask=key_ok[:, None] & (offs_da[None, :] < D_QK), other=0.0)
        qk = tl.dot(qa, tl.trans(ka), input_precision=PRECISION)
        if BLOCK_DB > 0:
            kb = tl.load(k_ptr + offs_db[None, :], mask=key_ok[:, None] & (offs_db[None, :] < D_QK), other=0.0)
            qk = tl.dot(qb, tl.trans(kb), qk, input_precision=PRECISION)
        qk = qk * qk_scale
        allowed = key_ok[None, :]
        if CAUSAL:
            allowed = allowed & (keys[None, :] <= rows[:, None] + len_k - len_q)
        qk = tl.where(allowed, qk, float("-inf"))

        # -- online softmax (rows with nothing allowed yet keep m = -inf and weigh nothing) ---------------------------
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        # -- P @ V: read BLOCK_N * D_v, P rounded to v's dtype, fp32 accumulation ------------------------------------
        v = tl.load(
            v_base + keys.to(tl.int64)[:, None] * stride_vt + offs_dv[None, :],
            mask=key_ok[:, None] & (offs_dv[None, :] < D_V),
            other=0.0,
        )
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    # -- epilogue: write BLOCK_M * D_v and the natural-log LSE ----------------------------------------------------
    has_keys = l_i > 0.0
    l_use = tl.where(has_keys, l_i, 1.0)
    out = acc / l_use[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_use)) * 0.6931471805599453, float("-inf"))
    o_ptr = OUT + (q_start + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < D_V))
    tl.store(LSE + h * stride_lh + q_start + rows, lse, mask=row_ok)


class PrefillOutput(NamedTuple):
    """``out [T_q, H_q, D_v]`` in q's dtype and ``lse [H_q, T_q]`` fp32 (natural log; -inf for rows with no key)."""

    out: torch.Tensor
    lse: torch.Tensor


class PrefillConfig(NamedTuple):
    """Tile sizes and launch parameters of the varlen kernel."""

    block_m: int  # query rows per program (a power of two >= 16)
    block_n: int  # keys per step (a power of two >= 16)
    num_warps: int
    num_stages: int


def prefill_config(d_qk: int, d_v: int, dtype: torch.dtype, device: torch.device | str = "cuda") -> PrefillConfig:
    """The tile for head widths ``d_qk`` / ``d_v``.

    16-bit inputs with padded widths up to 128: 128 x 64 tiles, 8 warps, 3 stages; wider heads (MLA's 192 / 128)
    or fp32 inputs (exact ``ieee`` dots): 64 x 32, 2 stages. The interpreter (any device but CUDA) takes 16 x 16
    tiles, so tiny tests cross block edges.
    """
    if torch.device(device).type != "cuda":
        return PrefillConfig(16, 16, 4, 1)
    da, db = split_head_dim(d_qk)
    big = dtype == torch.float32 or max(da + db, max(16, triton.next_power_of_2(d_v))) > 128
    return PrefillConfig(64, 32, 8, 2) if big else PrefillConfig(128, 64, 8, 3)


def split_head_dim(d: int) -> tuple[int, int]:
    """``d`` as two power-of-two blocks ``(DA, DB)`` for ``tl.dot`` (each >= 16, ``DB = 0`` when ``DA`` suffices).

    ``192 -> (128, 64)``, ``576 -> (512, 64)``, ``128 -> (128, 0)``, ``24 -> (32, 0)``, ``200 -> (256, 0)``.
    """
    da = max(16, 1 << (max(d, 1).bit_length() - 1))
    rest = d - da
    if rest <= 0:
        return da, 0
    db = max(16, triton.next_power_of_2(rest))
    if db >= da:  # the tail is as wide as the head: one padded block is no worse
        return triton.next_power_of_2(d), 0
    return da, db


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    scale: float | None = None,
    causal: bool = False,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,
) -> PrefillOutput:
    """Varlen attention forward with LSE.

    Args:
        q: ``[T_q, H_q, D_qk]`` bf16/fp16/fp32, last dim contiguous; ``D_qk <= 256``.
        k: ``[T_kv, H_kv, D_qk]`` same dtype, ``H_q % H_kv == 0``.
        v: ``[T_kv, H_kv, D_v]`` same dtype, ``D_v <= 256``.
        cu_seqlens_q: ``[B + 1]`` int32, from 0 to ``T_q``, non-decreasing.
        cu_seqlens_k: ``[B + 1]`` int32, from 0 to ``T_kv``.
        max_seqlen_q: longest query run, if known (saves a device-to-host sync).
        scale: softmax scale, default ``1/sqrt(D_qk)``.
        causal: bottom-right aligned within each sequence.
        config: tile override (default :func:`prefill_config`).
        out: ``[T_q, H_q, D_v]`` q's dtype, contiguous, to write the output into (vLLM's ``out=``); every element
            is written, so it may hold anything (NaN included) before the call.

    Returns:
        ``out [T_q, H_q, D_v]`` in q's dtype and ``lse [H_q, T_q]`` fp32 natural log.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    T_q, H_q, D_qk = q.shape
    T_kv, H_kv, _ = k.shape
    D_v = v.shape[2]
    if k.shape[2] != D_qk or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"k must be [T_kv, H_kv, D_qk={D_qk}] and v [T_kv, H_kv, D_v], got {list(k.shape)}, {list(v.shape)}"
        )
    if H_kv == 0 or H_q % H_kv:
        raise ValueError(f"k's head count H_kv={H_kv} must divide H_q={H_q}")
    if not 0 < D_qk <= 256 or not 0 < D_v <= 256:
        raise ValueError(
            f"head dims must be in [1, 256] (the kernel keeps a row in registers), got D_qk={D_qk}, D_v={D_v}"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q, k, v must share a dtype among bf16/fp16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both be [B + 1], got {list(cu_seqlens_q.shape)}, "
            f"{list(cu_seqlens_k.shape)}"
        )
    cfg = config or prefill_config(D_qk, D_v, q.dtype, q.device)
    for name, width in (("config.block_m", cfg.block_m), ("config.block_n", cfg.block_n)):
        if width < 16 or width & (width - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (a tl.dot operand), got {width}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cu_q, cu_k = (c.to(torch.int32).contiguous() for c in (cu_seqlens_q, cu_seqlens_k))
    B = cu_q.numel() - 1
    scale = D_qk**-0.5 if scale is None else float(scale)

    if out is None:
        out = torch.empty(T_q, H_q, D_v, dtype=q.dtype, device=q.device)
    elif out.shape != (T_q, H_q, D_v) or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous [T_q={T_q}, H_q={H_q}, D_v={D_v}] {q.dtype} tensor, got "
            f"{list(out.shape)} {out.dtype}"
        )
    lse = torch.full((H_q, T_q), float("-inf"), dtype=torch.float32, device=q.device)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_q[1:] - cu_q[:-1]).max()) if B > 0 else 0
    if T_q == 0 or B == 0 or max_seqlen_q == 0:
        return PrefillOutput(out, lse)

    da, db = split_head_dim(D_qk)
    dv = max(16, triton.next_power_of_2(D_v))
    # Widths that are not exactly the blocks are zero-padded here, so every row the kernel reads is whole blocks.
    # Triton 3.6's Hopper code for rows whose width is not the block width (e.g. D_qk 35 or D_v 10 in fp16) made
    # illegal accesses and wrong values on the H200 (found by the harness's generated cases; the interpreter and
    # every block-aligned width, MLA's 192 / 128 included, are fine). Zero columns change no dot product.
    out_ = out
    if D_qk != da + db or D_v != dv:
        q, k = (torch.nn.functional.pad(t, (0, da + db - D_qk)) for t in (q, k))
        v = torch.nn.functional.pad(v, (0, dv - D_v))
        out_ = torch.empty(T_q, H_q, dv, dtype=q.dtype, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(max_seqlen_q, cfg.block_m), H_q, B)
    _flash_fwd_varlen_kernel[grid](
        q,
        k,
        v,
        cu_q,
        cu_k,
        out_,
        lse,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out_.stride(0),
        out_.stride(1),
        lse.stride(0),
        scale * LOG2E,
        H_q // H_kv,
        da + db,
        dv,
        CAUSAL=bool(causal),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_DA=da,
        BLOCK_DB=db,
        BLOCK_DV=dv,
        PRECISION=precision,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if out_ is not out:
        out.copy_(out_[..., :D_v])
    return PrefillOutput(out, lse)
