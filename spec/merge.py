"""Merging partial attention results by their log-sum-exp (``merge_attn_states``).

Attention over keys ``K = K_1 ∪ K_2 ∪ ...`` (a disjoint split) can be computed piecewise: each part gives
``(out_i, lse_i)`` and the whole is::

    lse = log(sum_i exp(lse_i))
    out = sum_i exp(lse_i - lse) * out_i

This is how vLLM combines chunked-prefill context chunks with the new tokens, and how split-KV decode kernels
combine their splits. Conventions follow vLLM's kernels (``csrc/attention/merge_attn_states.cu`` and
``vllm/attention/ops/triton_merge_attn_states.py``):

* ``+inf`` in an LSE is read as ``-inf`` (an empty part): FlashAttention-2 and FlashMLA's sparse kernels report
  an empty row as ``+inf``, FlashAttention-3 as ``-inf``.
* A part with LSE ``-inf`` gets weight 0.
* When *every* part is empty the result is the first part's output and LSE ``-inf`` (the CUDA kernel's
  guard, vLLM PR #28181). vLLM 0.33's Triton kernel writes zeros there instead, and older Triton versions
  produced NaN; since an empty part's output is itself 0 (every attention kernel writes it so), the CUDA and
  0.33 Triton conventions agree on real inputs. vLLM's dispatcher takes the CUDA kernel for fp32/fp16/bf16 with
  head sizes that are multiples of 4 (fp32) or 8 (16-bit), the Triton one otherwise.
* Layouts: outputs ``[T, H, D]``, LSEs ``[H, T]``.

Computed in float64, returned float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .checks import FLOAT, Dims

__all__ = ["MergeOutput", "merge_attn_states", "merge_attn_states_n"]


class MergeOutput(NamedTuple):
    """``out [T, H, D]`` and ``lse [H, T]``, float64."""

    out: torch.Tensor
    lse: torch.Tensor


def merge_attn_states_n(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> MergeOutput:
    """Merge any number ``n >= 1`` of partial attention states.

    Args:
        outputs: ``n`` tensors ``[T, H, D]`` float, the partial outputs (each normalised over its own keys).
        lses: ``n`` tensors ``[H, T]`` float, their natural-log LSEs; ``±inf`` marks an empty part.

    Returns:
        ``out [T, H, D]`` and ``lse [H, T]``, float64. Order does not matter (commutative and associative).
    """
    if not isinstance(outputs, Sequence) or not isinstance(lses, Sequence):
        raise TypeError("outputs and lses must be sequences of tensors")
    if len(outputs) == 0 or len(outputs) != len(lses):
        raise ValueError(f"outputs and lses must be non-empty and of equal length, got {len(outputs)} and {len(lses)}")
    n = len(outputs)
    return _merge(outputs, lses, [f"outputs[{i}]" for i in range(n)], [f"lses[{i}]" for i in range(n)])


def _merge(outputs, lses, output_names, lse_names) -> MergeOutput:
    dims = Dims()
    for o, l, o_name, l_name in zip(outputs, lses, output_names, lse_names):
        dims.tensor(o_name, o, ("T", "H", "D"), FLOAT)
        dims.tensor(l_name, l, ("H", "T"), FLOAT)
    lse = torch.stack([l.to(torch.float64) for l in lses])  # [n, H, T]
    lse = lse.masked_fill(lse == math.inf, -math.inf)  # +inf (FA2 / sparse empty row) means empty
    total = torch.logsumexp(lse, dim=0)  # [H, T], -inf where every part is empty
    empty = torch.isneginf(total)
    weight = torch.where(empty, 0.0, torch.exp(lse - total))  # [n, H, T]
    out = torch.einsum("nht,nthd->thd", weight, torch.stack([o.to(torch.float64) for o in outputs]))
    out = torch.where(empty.T[..., None], outputs[0].to(torch.float64), out)  # vLLM's all-empty guard
    return MergeOutput(out, total)


def merge_attn_states(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> MergeOutput:
    """Two-way merge with vLLM's argument order (``vllm/attention/ops/merge_attn_states.py``).

    Args:
        prefix_output: ``[T, H, D]`` float, attention over the first part of the keys.
        prefix_lse: ``[H, T]`` float.
        suffix_output: ``[T, H, D]`` float, attention over the rest.
        suffix_lse: ``[H, T]`` float.

    Returns:
        ``out [T, H, D]`` and ``lse [H, T]``, float64.

    Example: one token, one head; the prefix saw keys with total weight ``e^1``, the suffix ``e^0``::

        merge_attn_states(tensor([[[2.]]]), tensor([[1.]]), tensor([[[5.]]]), tensor([[0.]]))
        # out = (e * 2 + 1 * 5) / (e + 1) = 2.807..., lse = log(e + 1) = 1.313...
    """
    return _merge(
        [prefix_output, suffix_output],
        [prefix_lse, suffix_lse],
        ["prefix_output", "suffix_output"],
        ["prefix_lse", "suffix_lse"],
    )
