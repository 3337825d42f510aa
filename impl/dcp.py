"""``dcp_combine``: the decode-context-parallel combine of ``N`` ranks' partial attention results by their LSEs.

Implements :func:`mlaspec.spec.dcp.dcp_combine` on vLLM's layouts (``vllm/v1/attention/ops/common.py``,
``_correct_attn_cp_out_kernel``: the all-gathered LSEs ``[N, B, H]``, the partial outputs ``[N, B, H, D]``) with
its rules: an LSE of ``+inf`` or NaN is read as ``-inf`` (an empty share), an empty share weighs 0 and its output is
never read into the sum (NaN there stays out), and when every share is empty the result is 0 with LSE ``-inf``.
vLLM's kernel corrects one rank's output (``c_r o_r``) and leaves the sum to a reduce-scatter; on one device the
sum is done here, in the same program::

    m   = max_r lse_r                  c_r = exp(lse_r - m) / Σ_s exp(lse_s - m)
    out = Σ_r c_r o_r                  lse = m + log Σ_s exp(lse_s - m)

One program per ``(b, h)`` row: read ``N (D + 1)`` values, write ``D + 1``; fp32 arithmetic. ``IS_BASE_E = False``
takes base-2 LSEs (``exp2`` / ``log2``, vLLM's ``is_lse_base_on_e=False``, FlashInfer's convention).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["DCPCombineOutput", "dcp_combine"]


@triton.jit
def _dcp_combine_kernel(
    OUT,  # [B, H, D] the outputs' dtype
    OUT_LSE,  # [B, H] fp32
    OUTS,  # [N, B, H, D]
    LSES,  # [N, B, H]
    stride_ob,
    stride_oh,
    stride_lb,
    stride_xn,
    stride_xb,
    stride_xh,
    stride_yn,
    stride_yb,
    stride_yh,
    N,
    D,
    N_ROUNDED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_BASE_E: tl.constexpr,
):
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    ranks = tl.arange(0, N_ROUNDED)
    r_ok = ranks < N
    offs = tl.arange(0, BLOCK_D)
    d_ok = offs < D

    # -- the N LSEs; +inf (FA2 / FlashMLA empty row) and NaN mean an empty share ----------------------------------
    lse = tl.load(LSES + ranks * stride_yn + b * stride_yb + h * stride_yh, mask=r_ok, other=float("-inf"))
    lse = lse.to(tl.float32)
    lse = tl.where((lse != lse) | (lse == float("inf")), float("-inf"), lse)
    m = tl.max(lse, axis=0)
    empty = m == float("-inf")
    m_use = tl.where(empty, 0.0, m)
    if IS_BASE_E:
        w = tl.exp(lse - m_use)
    else:
        w = tl.exp2(lse - m_use)
    total = tl.sum(w, axis=0)
    total = tl.where(empty, 1.0, total)  # every share empty: each w is 0, and log(1) keeps the log finite
    c = w / total  # [N_ROUNDED], 0 for an empty share (and for every share when all are)

    # -- out = Σ_r c_r o_r, an empty share's output never read -----------------------------------------------------
    ptrs = OUTS + ranks[:, None] * stride_xn + b * stride_xb + h * stride_xh + offs[None, :]
    o = tl.load(ptrs, mask=r_ok[:, None] & d_ok[None, :] & (c[:, None] > 0), other=0.0).to(tl.float32)
    out = tl.sum(c[:, None] * o, axis=0)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs, out.to(OUT.dtype.element_ty), mask=d_ok)
    if IS_BASE_E:
        total_lse = tl.log(total) + m_use
    else:
        total_lse = tl.log2(total) + m_use
    tl.store(OUT_LSE + b * stride_lb + h, tl.where(empty, float("-inf"), total_lse))


class DCPCombineOutput(NamedTuple):
    """``out [B, H, D]`` in the outputs' dtype and ``lse [B, H]`` fp32 (in the input LSEs' base)."""

    out: torch.Tensor
    lse: torch.Tensor


def dcp_combine(outs: torch.Tensor, lses: torch.Tensor, *, is_lse_base_on_e: bool = True) -> DCPCombineOutput:
    """Combine ``N`` ranks' partial outputs by their LSEs.

    Args:
        outs: ``[N, B, H, D]`` bf16/fp16/fp32, the partial outputs (last dimension contiguous).
        lses: ``[N, B, H]`` float, their LSEs (natural log, or base 2 with ``is_lse_base_on_e=False``); ``±inf`` /
            NaN mark an empty share.
        is_lse_base_on_e: the LSEs' base, as vLLM's ``cp_lse_ag_out_rs``.

    Returns:
        ``out [B, H, D]`` in ``outs``' dtype and ``lse [B, H]`` fp32.
    """
    if outs.dim() != 4:
        raise ValueError(f"outs must be [N, B, H, D], got {list(outs.shape)}")
    n, b, h, d = outs.shape
    if lses.shape != (n, b, h):
        raise ValueError(f"lses must be [N={n}, B={b}, H={h}], got {list(lses.shape)}")
    if not isinstance(is_lse_base_on_e, bool):
        raise TypeError(f"is_lse_base_on_e must be a bool, got {type(is_lse_base_on_e).__name__}")
    outs = outs if outs.stride(-1) == 1 else outs.contiguous()
    out = torch.empty(b, h, d, dtype=outs.dtype, device=outs.device)
    lse = torch.empty(b, h, dtype=torch.float32, device=outs.device)
    if n == 0 or b == 0 or h == 0:
        return DCPCombineOutput(out.zero_(), lse.fill_(float("-inf")))
    block_d = triton.next_power_of_2(max(d, 1))
    _dcp_combine_kernel[(b, h)](
        out,
        lse,
        outs,
        lses,
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        outs.stride(0),
        outs.stride(1),
        outs.stride(2),
        lses.stride(0),
        lses.stride(1),
        lses.stride(2),
        n,
        d,
        N_ROUNDED=triton.next_power_of_2(n),
        BLOCK_D=block_d,
        IS_BASE_E=is_lse_base_on_e,
        num_warps=4 if block_d * n >= 2048 else 1,
    )
    return DCPCombineOutput(out, lse)
