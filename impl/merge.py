"""``merge_attn_states``: combine two partial attention results by their log-sum-exp.

Implements :func:`mlaspec.spec.merge.merge_attn_states` with vLLM's rules (``csrc/attention/merge_attn_states.cu``,
``vllm/attention/ops/triton_merge_attn_states.py``): an LSE of ``+inf`` is read as ``-inf`` (an empty part), an
empty part weighs 0, and when both parts are empty the result is the prefix output with LSE ``-inf``. Layouts:
outputs ``[T, H, D]``, LSEs ``[H, T]``.

The naive computation and its traffic (``T * H`` rows of ``D``)::

    lse  = logaddexp(lse_p, lse_s)                    # read 2 T H, write T H
    w_p  = exp(lse_p - lse); w_s = exp(lse_s - lse)   # read 3 T H, write 2 T H
    out  = w_p * out_p + w_s * out_s                  # read 2 T H D + 2 T H, write T H D

One program per ``(t, h)`` row does it in a single pass: read ``2 D + 2`` values, write ``D + 1``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["MergeOutput", "merge_attn_states"]


@triton.jit
def _merge_attn_states_kernel(
    OUT,
    OUT_LSE,  # [T, H, D] prefix dtype, [H, T] fp32
    P_OUT,
    P_LSE,
    S_OUT,
    S_LSE,  # prefix / suffix: [T, H, D], [H, T]
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_st,
    stride_sh,
    stride_lo,
    stride_lp,
    stride_ls,  # LSE head strides (the token stride is 1)
    D,
    BLOCK_D: tl.constexpr,
):
    t, h = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    d_ok = offs < D

    # -- the two LSEs; +inf (FA2 / FlashMLA sparse empty row) means empty, like -inf --------------------------------
    p_lse = tl.load(P_LSE + h * stride_lp + t).to(tl.float32)
    s_lse = tl.load(S_LSE + h * stride_ls + t).to(tl.float32)
    p_lse = tl.where(p_lse == float("inf"), float("-inf"), p_lse)
    s_lse = tl.where(s_lse == float("inf"), float("-inf"), s_lse)

    # -- weights exp(lse_i - max): an empty part weighs 0; both empty -> keep the prefix ---------------------------
    m = tl.maximum(p_lse, s_lse)
    empty = m == float("-inf")
    m_use = tl.where(empty, 0.0, m)
    p_w = tl.exp(p_lse - m_use)
    s_w = tl.exp(s_lse - m_use)
    total = tl.where(empty, 1.0, p_w + s_w)

    # -- read 2 D, write D ------------------------------------------------------------------------------------------
    p_out = tl.load(P_OUT + t.to(tl.int64) * stride_pt + h * stride_ph + offs, mask=d_ok, other=0.0).to(tl.float32)
    s_out = tl.load(S_OUT + t.to(tl.int64) * stride_st + h * stride_sh + offs, mask=d_ok, other=0.0).to(tl.float32)
    out = p_out * (p_w / total) + s_out * (s_w / total)
    out = tl.where(empty, p_out, out)
    tl.store(OUT + t.to(tl.int64) * stride_ot + h * stride_oh + offs, out.to(OUT.dtype.element_ty), mask=d_ok)
    tl.store(OUT_LSE + h * stride_lo + t, tl.where(empty, float("-inf"), tl.log(total) + m_use))


class MergeOutput(NamedTuple):
    """``out [T, H, D]`` in the prefix dtype and ``lse [H, T]`` fp32 (natural log)."""

    out: torch.Tensor
    lse: torch.Tensor


def merge_attn_states(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> MergeOutput:
    """Two-way LSE merge with vLLM's argument order and rules.

    Args:
        prefix_output: ``[T, H, D]`` bf16/fp16/fp32, last dimension contiguous.
        prefix_lse: ``[H, T]`` float, natural log; ``±inf`` marks an empty part.
        suffix_output: ``[T, H, D]`` same dtype.
        suffix_lse: ``[H, T]`` float.

    Returns:
        ``out [T, H, D]`` in the prefix dtype and ``lse [H, T]`` fp32.
    """
    if prefix_output.dim() != 3 or suffix_output.shape != prefix_output.shape:
        raise ValueError(
            f"prefix_output and suffix_output must both be [T, H, D], got {list(prefix_output.shape)} "
            f"and {list(suffix_output.shape)}"
        )
    T, H, D = prefix_output.shape
    for name, l in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        if l.shape != (H, T):
            raise ValueError(f"{name} must be [H={H}, T={T}], got {list(l.shape)}")
    if prefix_output.dtype != suffix_output.dtype:
        raise TypeError(f"prefix_output and suffix_output dtypes differ: {prefix_output.dtype}, {suffix_output.dtype}")
    prefix_output, suffix_output = (o if o.stride(-1) == 1 else o.contiguous() for o in (prefix_output, suffix_output))
    prefix_lse, suffix_lse = (l.contiguous() for l in (prefix_lse, suffix_lse))

    out = torch.empty_like(prefix_output, memory_format=torch.contiguous_format)
    lse = torch.empty(H, T, dtype=torch.float32, device=prefix_output.device)
    if T == 0 or H == 0:
        return MergeOutput(out, lse)
    block_d = triton.next_power_of_2(max(D, 1))
    _merge_attn_states_kernel[(T, H)](
        out,
        lse,
        prefix_output,
        prefix_lse,
        suffix_output,
        suffix_lse,
        out.stride(0),
        out.stride(1),
        prefix_output.stride(0),
        prefix_output.stride(1),
        suffix_output.stride(0),
        suffix_output.stride(1),
        lse.stride(0),
        prefix_lse.stride(0),
        suffix_lse.stride(0),
        D,
        BLOCK_D=block_d,
        num_warps=4 if block_d >= 512 else 1,
    )
    return MergeOutput(out, lse)
