"""What each of MLA's two forms costs: FLOPs, bytes moved, and a roofline time estimate.

MLA's two forms (:mod:`mlaspec.spec.forms`) compute the same attention but trade work for traffic. This module
counts both for the attention part of one MLA layer: from ``q_nope, q_pe`` (per head) and the cached
``kv_c, k_pe`` (per token) to the per-head output ``o [B, S_q, H_q, D_v]``. The projections before (``W_DQ``,
``W_UQ``, ``W_QR``, ``W_DKV``, ``W_KR``) and after (``W_O``) are the same in both forms and are left out.

Names (:mod:`mlaspec.spec.config`, ``docs/glossary.md``): ``Lkv = 512`` latent, ``D_nope = 128`` nope, ``D_rope =
64`` rope, ``D_v = 128`` value width, ``H_q`` heads, ``E`` bytes per element; ``pairs`` is the number of (query,
key) pairs one head scores in one sequence: ``S_q * S_kv`` without a mask, ``S_q * S_kv - S_q * (S_q - 1) / 2``
with the bottom-right causal mask. A multiply-add is 2 FLOPs. Softmax, rope and norms (``O(pairs)`` and
``O(tokens)`` element-wise work) are not counted.

**Compute-friendly form** (``"mha"``; vLLM's prefill path)::

    k_nope = kv_c @ W_UK      up_projection   2 * B*S_kv * Lkv * H_q*D_nope       # reads Lkv, writes H_q*D_nope
    v      = kv_c @ W_UV      up_projection   2 * B*S_kv * Lkv * H_q*D_v          # reads Lkv, writes H_q*D_v
    s      = q @ k^T          qk              2 * B*H_q * pairs * (D_nope + D_rope)  # D_qk = 192
    o      = softmax(s) @ v   pv              2 * B*H_q * pairs * D_v             # D_v = 128

    cache         B*S_kv * (Lkv + D_rope) * E                    # reads each 576-wide entry once
    weights       Lkv * H_q * (D_nope + D_v) * E                 # reads W_UK and W_UV once
    io            B*S_q*H_q * (D_nope + D_rope + D_v) * E        # reads q_nope, q_pe; writes o
    materialized  2 * B*S_kv*H_q * (D_nope + D_rope + D_v) * E   # writes k (rope part copied to every head) and v,
                                                                 # reads them back

**Absorbed form** (``"absorbed"``; vLLM's decode path, FlashMLA)::

    ql_nope = q_nope @ W_UK^T    absorption   2 * B*S_q*H_q * D_nope * Lkv        # per query token and head
    s       = q @ kv^T           qk           2 * B*H_q * pairs * (Lkv + D_rope)  # D_qk = 576
    o_lat   = softmax(s) @ kv_c  pv           2 * B*H_q * pairs * Lkv             # D_v = 512
    o       = o_lat @ W_UV       absorption   2 * B*S_q*H_q * Lkv * D_v

    cache         B*S_kv * (Lkv + D_rope) * E                # reads each entry once for all H_q heads (MQA): no H_q
    weights       Lkv * H_q * (D_nope + D_v) * E             # reads W_UK and W_UV once
    io            B*S_q*H_q * (D_nope + D_rope + D_v) * E    # reads q_nope, q_pe; writes o
    materialized  2 * B*S_q*H_q * (2*Lkv + D_rope) * E       # writes absorbed q [.., 576], o_lat [.., 512]; reads back

The traffic is the compulsory traffic of an ideal kernel: every tensor is read once. Real kernels read more
(flash-attention reads k and v once per query tile; FlashMLA reads the cache once per group of 64 heads), so the
estimate is a lower bound on time, and the crossover it predicts is a first guess for where to switch forms, not
a measurement. What makes the forms differ:

* per (query, key, head) the absorbed form does ``2 * (576 + 512) = 2176`` FLOPs against ``2 * (192 + 128) = 640``;
* per context token the compute-friendly form pays the up-projection (``2 * 512 * H_q * 256`` FLOPs) and moves its
  materialized k and v (``2 * H_q * 320 * E`` bytes) against the absorbed form's ``576 * E`` bytes.

So at ``S_q = 1`` (decode) the absorbed form wins by orders of magnitude; once ``S_q`` is large enough that the
``S_q``-proportional attention work dominates the ``S_q``-independent up-projection, the compute-friendly form
wins (:func:`crossover`). vLLM picks the form per request by query length (its decode threshold), not by this
model; the model says where that threshold should lie.

Source: the two forms as written in vLLM's MLA notes (``vllm/model_executor/layers/attention/mla_attention.py``,
module docstring, "Compute Friendly Approach" / "Data-Movement Friendly Approach").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch

from .checks import boolean, choice, positive_int
from .config import MLAConfig

__all__ = [
    "FORMS",
    "H200_BANDWIDTH",
    "H200_PEAK_FLOPS",
    "Crossover",
    "FormCost",
    "TimeEstimate",
    "attention_pairs",
    "crossover",
    "mla_cost",
    "time_estimate",
]

H200_PEAK_FLOPS = 790e12
"""Dense bf16 tensor-core throughput of one H200, FLOP/s, as *measured* (project DEVELOPERS brief); the
datasheet's figure is 989e12."""

H200_BANDWIDTH = 4.3e12
"""HBM3e bandwidth of one H200, bytes/s, as *measured* (project DEVELOPERS brief); the datasheet's is 4.8e12."""

FORMS = ("mha", "absorbed")
"""The two forms: ``"mha"`` (compute-friendly) and ``"absorbed"`` (data-movement-friendly)."""


@dataclass(frozen=True)
class FormCost:
    """FLOPs and bytes of one form of MLA attention (formulas in the module docstring).

    ``flops``, ``bytes`` and ``arithmetic_intensity`` are the totals; the other numeric fields are the terms
    (a term the form does not have is 0). All counts are exact ints.
    """

    form: Literal["mha", "absorbed"]
    batch: int
    s_q: int
    s_kv: int
    num_heads: int
    dtype_bytes: int
    causal: bool
    up_projection_flops: int  # mha: kv_c @ W_UK and kv_c @ W_UV for every context token
    absorption_flops: int  # absorbed: q_nope @ W_UK^T and o_lat @ W_UV for every query token
    qk_flops: int  # q @ k^T
    pv_flops: int  # softmax(s) @ v
    cache_bytes: int  # the 576-wide entries, read once
    weight_bytes: int  # W_UK and W_UV, read once
    io_bytes: int  # q_nope, q_pe read; o written
    materialized_bytes: int  # mha: k and v written + read; absorbed: absorbed q and o_lat written + read

    @property
    def flops(self) -> int:
        """Total FLOPs (a multiply-add counts 2)."""
        return self.up_projection_flops + self.absorption_flops + self.qk_flops + self.pv_flops

    @property
    def bytes(self) -> int:
        """Total bytes moved to and from memory."""
        return self.cache_bytes + self.weight_bytes + self.io_bytes + self.materialized_bytes

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes


class TimeEstimate(NamedTuple):
    """Roofline time in seconds: ``seconds = max(compute_seconds, memory_seconds)``."""

    seconds: float
    compute_seconds: float
    memory_seconds: float

    @property
    def bound(self) -> Literal["compute", "memory"]:
        """Which roof the estimate sits on."""
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"


class Crossover(NamedTuple):
    """Result of :func:`crossover`.

    ``s_q``: the smallest query length in ``[1, S_kv]`` at which the compute-friendly form is estimated strictly
    faster than the absorbed one, or ``None`` when the absorbed form is never slower in that range.
    ``mha_seconds`` / ``absorbed_seconds``: the two estimates at ``s_q`` (at ``S_kv`` when ``s_q`` is None).
    """

    s_q: int | None
    mha_seconds: float
    absorbed_seconds: float


def _dtype_bytes(dtype: object) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    if isinstance(dtype, bool) or not isinstance(dtype, int):
        raise TypeError(f"dtype must be a torch.dtype or a number of bytes (int), got {type(dtype).__name__}")
    return positive_int("dtype", dtype)


def _positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return float(value)


def _config(config: object) -> MLAConfig:
    if config is None:
        return MLAConfig()
    if not isinstance(config, MLAConfig):
        raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
    return config


def attention_pairs(s_q: int, s_kv: int, *, causal: bool = False) -> int:
    """How many (query, key) pairs one head of one sequence scores.

    Without a mask every query sees every key: ``S_q * S_kv``. With the bottom-right causal mask
    (:func:`mlaspec.spec.attention.causal_mask`; requires ``S_q <= S_kv``) query ``i`` sees ``S_kv - S_q + 1 + i``
    keys, so the sum is ``S_q * S_kv - S_q * (S_q - 1) / 2``.

    Args:
        s_q: query length ``S_q >= 1``.
        s_kv: key length ``S_kv >= S_q`` (the context plus the new tokens).
        causal: count under the bottom-right causal mask.
    """
    s_q, s_kv = positive_int("s_q", s_q), positive_int("s_kv", s_kv)
    if s_q > s_kv:
        raise ValueError(f"s_q must be <= s_kv={s_kv} (the keys include the new tokens), got {s_q}")
    boolean("causal", causal)
    return s_q * s_kv - s_q * (s_q - 1) // 2 if causal else s_q * s_kv


def _terms(form: str, b, s_q, s_kv, n, d, pairs, c: MLAConfig) -> dict:
    """The per-term counts. ``s_q`` and ``pairs`` may be ints (exact) or float arrays (for scans)."""
    lkv, p, r, v = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    terms = dict(
        cache_bytes=b * s_kv * (lkv + r) * d,  # reads every 576-wide entry once
        weight_bytes=lkv * n * (p + v) * d,  # reads W_UK [Lkv, H_q, D_nope] and W_UV [Lkv, H_q, D_v] once
        io_bytes=b * s_q * n * (p + r) * d + b * s_q * n * v * d,  # reads q_nope, q_pe; writes o [.., H_q, D_v]
    )
    if form == "mha":
        terms.update(
            up_projection_flops=2 * b * s_kv * lkv * n * (p + v),  # kv_c @ W_UK, kv_c @ W_UV per context token
            absorption_flops=0 * s_q,
            qk_flops=2 * b * n * pairs * (p + r),  # D_qk = D_nope + D_rope
            pv_flops=2 * b * n * pairs * v,  # the value width D_v
            materialized_bytes=2 * b * s_kv * n * (p + r + v) * d + 0 * s_q,  # writes k, v; attention reads them
        )
    else:
        terms.update(
            up_projection_flops=0 * s_q,
            absorption_flops=2 * b * s_q * n * p * lkv + 2 * b * s_q * n * lkv * v,  # q_nope @ W_UK^T, o_lat @ W_UV
            qk_flops=2 * b * n * pairs * (lkv + r),  # D_qk = Lkv + D_rope, one KV head
            pv_flops=2 * b * n * pairs * lkv,  # D_v = Lkv
            materialized_bytes=2 * b * s_q * n * (lkv + r) * d + 2 * b * s_q * n * lkv * d,  # absorbed q, o_lat
        )
    return terms


def mla_cost(
    form: Literal["mha", "absorbed"],
    batch: int,
    s_q: int,
    s_kv: int,
    *,
    num_heads: int | None = None,
    dtype: torch.dtype | int = torch.bfloat16,
    config: MLAConfig | None = None,
    causal: bool = False,
) -> FormCost:
    """FLOPs and bytes of the attention part of one MLA layer in ``form`` (formulas in the module docstring).

    Args:
        form: ``"mha"`` (compute-friendly: up-project k and v, MHA with ``D_qk = 192``) or ``"absorbed"``
            (MQA over the 576-wide cache entries with ``W_UK``, ``W_UV`` absorbed).
        batch: ``B``, sequences in the batch (all of the same lengths).
        s_q: ``S_q``, query (new) tokens per sequence, ``1 <= S_q <= S_kv``.
        s_kv: ``S_kv``, keys per sequence: the context plus the new tokens.
        num_heads: ``H_q``, query heads on this GPU; default ``config.num_heads`` (128 for DeepSeek-V3 at TP1,
            16 at TP8).
        dtype: element type of activations, cache and weights: a ``torch.dtype`` or its size in bytes
            (default bf16 = 2).
        config: the layer's dimensions; default :class:`~mlaspec.spec.config.MLAConfig` (DeepSeek-V3).
        causal: count only the (query, key) pairs the bottom-right causal mask keeps (:func:`attention_pairs`).

    Returns:
        :class:`FormCost` with exact integer counts.

    Example (DeepSeek-V3, one decode token against 4096 keys, bf16)::

        mla_cost("absorbed", 1, 1, 4096).cache_bytes   # 4096 * 576 * 2 = 4_718_592
    """
    choice("form", form, FORMS)
    c = _config(config)
    b = positive_int("batch", batch)
    pairs = attention_pairs(s_q, s_kv, causal=causal)  # validates s_q, s_kv, causal
    n = c.num_heads if num_heads is None else positive_int("num_heads", num_heads)
    d = _dtype_bytes(dtype)
    terms = _terms(form, b, s_q, s_kv, n, d, pairs, c)
    return FormCost(form=form, batch=b, s_q=s_q, s_kv=s_kv, num_heads=n, dtype_bytes=d, causal=causal, **terms)


def time_estimate(
    cost: FormCost,
    peak_flops: float = H200_PEAK_FLOPS,
    bandwidth: float = H200_BANDWIDTH,
) -> TimeEstimate:
    """Roofline estimate ``max(flops / peak_flops, bytes / bandwidth)`` in seconds.

    Args:
        cost: a :class:`FormCost` from :func:`mla_cost`.
        peak_flops: FLOP/s; default one H200's measured dense bf16 rate (:data:`H200_PEAK_FLOPS`).
        bandwidth: bytes/s; default one H200's measured HBM bandwidth (:data:`H200_BANDWIDTH`).
    """
    if not isinstance(cost, FormCost):
        raise TypeError(f"cost must be a FormCost, got {type(cost).__name__}")
    compute = cost.flops / _positive_float("peak_flops", peak_flops)
    memory = cost.bytes / _positive_float("bandwidth", bandwidth)
    return TimeEstimate(max(compute, memory), compute, memory)


def crossover(
    s_kv: int,
    *,
    batch: int = 1,
    num_heads: int | None = None,
    dtype: torch.dtype | int = torch.bfloat16,
    config: MLAConfig | None = None,
    causal: bool = False,
    peak_flops: float = H200_PEAK_FLOPS,
    bandwidth: float = H200_BANDWIDTH,
) -> Crossover:
    """The query length from which the compute-friendly form beats the absorbed one, under a roofline.

    Scans every ``S_q`` in ``[1, S_kv]`` (vectorised) and returns the first where
    ``time_estimate(mla_cost("mha", ...)) < time_estimate(mla_cost("absorbed", ...))``::

        t_form(S_q) = max(flops_form(S_q) / peak_flops, bytes_form(S_q) / bandwidth)
        s_q*        = min { S_q in [1, S_kv] : t_mha(S_q) < t_absorbed(S_q) }      (None if empty)

    For DeepSeek-V3 both forms are compute-bound near the crossover, so (without a mask) it sits where the
    absorbed form's extra work per query overtakes the compute-friendly form's up-projection::

        S_q * (S_kv * 2 * (2*Lkv + D_rope - (D_nope + D_rope + D_v)) + 2 * Lkv * (D_nope + D_v))
            =  S_kv * 2 * Lkv * (D_nope + D_v)
        S_q* ~= Lkv * (D_nope + D_v) / (2*Lkv - D_nope - D_v + Lkv * (D_nope + D_v) / S_kv)
                                                                  # 512 * 256 / 768 = 171 as S_kv -> inf

    about 147 tokens at ``S_kv = 1024`` and 171 at long context, independent of ``B`` and ``H_q`` (both scale every
    term alike).

    Args:
        s_kv: ``S_kv``, keys per sequence; the scan covers ``S_q = 1 .. S_kv``.
        batch: ``B``, as :func:`mla_cost`.
        num_heads: ``H_q``, as :func:`mla_cost` (default ``config.num_heads``).
        dtype: element type or its size in bytes, as :func:`mla_cost`.
        config: the layer's dimensions (default DeepSeek-V3).
        causal: count only the pairs the bottom-right causal mask keeps.
        peak_flops: FLOP/s of the roofline (default: H200, measured).
        bandwidth: bytes/s of the roofline (default: H200, measured).

    Returns:
        :class:`Crossover` ``(s_q, mha_seconds, absorbed_seconds)``.
    """
    c = _config(config)
    s_kv = positive_int("s_kv", s_kv)
    mla_cost("mha", batch, 1, s_kv, num_heads=num_heads, dtype=dtype, config=c, causal=causal)  # validates
    n = c.num_heads if num_heads is None else num_heads
    d = _dtype_bytes(dtype)
    peak, bw = _positive_float("peak_flops", peak_flops), _positive_float("bandwidth", bandwidth)

    s_q = np.arange(1, s_kv + 1, dtype=np.float64)
    pairs = s_q * s_kv - s_q * (s_q - 1) / 2 if causal else s_q * s_kv
    t = {}
    for form in FORMS:
        terms = _terms(form, float(batch), s_q, float(s_kv), float(n), float(d), pairs, c)
        flops = terms["up_projection_flops"] + terms["absorption_flops"] + terms["qk_flops"] + terms["pv_flops"]
        nbytes = terms["cache_bytes"] + terms["weight_bytes"] + terms["io_bytes"] + terms["materialized_bytes"]
        t[form] = np.maximum(flops / peak, nbytes / bw)
    wins = np.nonzero(t["mha"] < t["absorbed"])[0]
    i = int(wins[0]) if wins.size else s_kv - 1
    return Crossover(i + 1 if wins.size else None, float(t["mha"][i]), float(t["absorbed"][i]))
