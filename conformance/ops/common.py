"""What every op module shares: the Op record, dtypes, unit roundoff, seeded inputs, and the attention budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlaspec.spec.attention import attention

from ..cases import Case

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
EPS32 = 2.0**-24


def unit_roundoff(dtype: torch.dtype) -> float:
    """``2^-(mantissa bits + 1)``: the largest relative error of rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


@dataclass(frozen=True)
class Op:
    """A checkable op.

    ``make_inputs(case) -> kwargs`` (tensors in the case dtype); ``reference(**kwargs) -> tuple`` of float64
    outputs named ``outputs``; ``bounds(kwargs, ref, u) -> tuple`` of per-element absolute error bounds, one per
    output, broadcastable to it (``None`` for ops judged by ``compare`` alone).

    ``compare(kwargs, got, ref) -> (verdict, reason, metrics, worst, ratios)`` replaces the default per-element
    judgement (:func:`mlaspec.conformance.verdict.judge`) where equality is not the right question: exact
    equality for integer metadata (:func:`~mlaspec.conformance.verdict.judge_exact`), tie-aware agreement for
    top-k indices.
    """

    name: str
    make_inputs: Callable[[Case], dict]
    reference: Callable[..., tuple]
    bounds: Callable[[dict, tuple, float], tuple] | None
    outputs: tuple[str, ...] = ("out", "lse")
    doc: str = ""
    compare: Callable[[dict, object, tuple], tuple] | None = None


def randn(case: Case) -> Callable[..., torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    return lambda *shape, scale=1.0: (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def logit_error(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``D ε32 scale max_j Σ_d |q_d k_jd|`` per (b, h, i): the fp32 accumulation error bound of the logits."""
    g = q.shape[2] // k.shape[2]
    qk = torch.einsum("bqhd,bkhd->bhqk", q.abs().double(), k.abs().double().repeat_interleave(g, 2))
    worst = qk.amax(-1) if qk.shape[-1] else qk.sum(-1)  # no keys: 0
    return q.shape[-1] * EPS32 * scale * worst  # [B, H, S_q]


def attention_bounds(q, k, v, *, scale, causal, mask=None, ref, u, extra_logit_err=0.0):
    ds = logit_error(q, k, scale) + extra_logit_err  # [B, H, S_q]
    m = attention(q, k, v.abs(), scale=scale, causal=causal, mask=mask).out  # [B, S_q, H, D_v]
    out_bound = 2 * (u * ref[0].abs() + (u + 2 * ds.transpose(1, 2)[..., None]) * m)
    lse_bound = 2 * (ds + EPS32 * ref[1].abs().nan_to_num(0.0, posinf=0.0, neginf=0.0))
    return out_bound, lse_bound


