"""MLA's projections: hidden states to the per-head queries and the shared latent key/value, and back.

Following vLLM (``vllm/model_executor/layers/mla.py``, ``MultiHeadLatentAttentionWrapper.forward``)::

    q_c     = RMSNorm(h_t @ W_DQ)                  [T, Lq]
    q_nope  = q_c @ W_UQ                           [T, H_q, D_nope]
    q_pe    = RoPE(q_c @ W_QR)                     [T, H_q, D_rope]
    kv_c    = RMSNorm(h_t @ W_DKV)                 [T, Lkv]   "kv_c_normed": what the cache stores
    k_pe    = RoPE(h_t @ W_KR)                     [T, D_rope]   one rope key shared by all heads, cached rotated

and at the end ``out = o.reshape(T, H_q * D_v) @ W_O`` ``[T, D_hidden]``. Inside each head vLLM's fused
``q_b_proj`` output is ``[q_nope (D_nope), q_pe (D_rope)]``, nope first; ``kv_a_proj_with_mqa`` gives ``[kv_c (Lkv),
k_pe (D_rope)]``, latent first, which is also the order of the 576-wide cache entry.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .checks import FLOAT, INT, Dims, finite_float
from .config import MLAConfig, MLAWeights
from .rope import apply_rope

__all__ = ["Projections", "output_projection", "project", "rms_norm"]


class Projections(NamedTuple):
    """The four tensors attention needs, float64: ``q_nope [T, H_q, D_nope]``, ``q_pe [T, H_q, D_rope]`` (rotated),
    ``kv_c [T, Lkv]`` (normed) and ``k_pe [T, D_rope]`` (rotated)."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` in float64; ``x [..., D]``, ``weight [D]`` float, ``eps >= 0``."""
    dims = Dims()
    lead = (None,) * (x.dim() - 1) if isinstance(x, torch.Tensor) and x.dim() else ()
    dims.tensor("x", x, lead + ("D",), FLOAT)
    dims.tensor("weight", weight, ("D",), FLOAT)
    if finite_float("eps", eps) < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    x = x.to(torch.float64)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float64)


def _check_weights(weights: object, config: object) -> None:
    if not isinstance(config, MLAConfig):
        raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
    if not isinstance(weights, MLAWeights):
        raise TypeError(f"weights must be an MLAWeights, got {type(weights).__name__}")
    c = config
    dims = Dims(
        D_hidden=c.hidden_size,
        Lq=c.q_lora_rank,
        Lkv=c.kv_lora_rank,
        H_q=c.num_heads,
        D_nope=c.qk_nope_head_dim,
        D_rope=c.qk_rope_head_dim,
        D_v=c.v_head_dim,
        **{"H_q*D_v": c.num_heads * c.v_head_dim},  # W_O's rows: the heads' outputs side by side
    )
    for name, shape in [
        ("W_DQ", ("D_hidden", "Lq")),
        ("q_a_norm", ("Lq",)),
        ("W_UQ", ("Lq", "H_q", "D_nope")),
        ("W_QR", ("Lq", "H_q", "D_rope")),
        ("W_DKV", ("D_hidden", "Lkv")),
        ("kv_a_norm", ("Lkv",)),
        ("W_KR", ("D_hidden", "D_rope")),
        ("W_UK", ("Lkv", "H_q", "D_nope")),
        ("W_UV", ("Lkv", "H_q", "D_v")),
        ("W_O", ("H_q*D_v", "D_hidden")),
    ]:
        dims.tensor(f"weights.{name}", getattr(weights, name), shape, FLOAT)


def project(hidden: torch.Tensor, positions: torch.Tensor, weights: MLAWeights, config: MLAConfig) -> Projections:
    """Project hidden states ``[T, D_hidden]`` float at ``positions [T]`` int to :class:`Projections` (float64)."""
    _check_weights(weights, config)
    dims = Dims(D_hidden=config.hidden_size)
    dims.tensor("hidden", hidden, ("T", "D_hidden"), FLOAT)
    dims.tensor("positions", positions, ("T",), INT)
    w = weights.to(torch.float64)
    h = hidden.to(torch.float64)
    q_c = rms_norm(h @ w.W_DQ, w.q_a_norm, config.rms_norm_eps)
    q_nope = torch.einsum("tl,lnp->tnp", q_c, w.W_UQ)
    q_pe = apply_rope(torch.einsum("tl,lnr->tnr", q_c, w.W_QR), positions, config)
    kv_c = rms_norm(h @ w.W_DKV, w.kv_a_norm, config.rms_norm_eps)
    k_pe = apply_rope(h @ w.W_KR, positions, config)
    return Projections(q_nope, q_pe, kv_c, k_pe)


def output_projection(o: torch.Tensor, weights: MLAWeights) -> torch.Tensor:
    """``o [T, H_q, D_v]`` float -> ``o.reshape(T, H_q * D_v) @ W_O`` ``[T, D_hidden]`` float64."""
    if not isinstance(weights, MLAWeights):
        raise TypeError(f"weights must be an MLAWeights, got {type(weights).__name__}")
    n_v, h = weights.W_O.shape
    dims = Dims()
    dims.tensor("o", o, ("T", "H_q", "D_v"), FLOAT)
    if dims["H_q"] * dims["D_v"] != n_v:
        raise ValueError(f"o must have H_q * D_v = {n_v} (rows of weights.W_O), got shape {list(o.shape)}")
    return o.to(torch.float64).reshape(o.shape[0], n_v) @ weights.W_O.to(torch.float64)
