"""DeepSeek's rotary position embedding on the 64-wide rope part (YaRN-scaled, GPT-J pair rotation).

MLA splits every query head and the shared key into a *nope* part (no position, absorbable into the latent) and
a *rope* part of width ``D_rope = 64`` that carries the position. Only the rope part is rotated, and it is rotated
before it is cached, so the cache holds ``k_pe`` already rotated.

Rotation style. vLLM builds DeepSeek's MLA rope with ``is_neox_style=False``
(``vllm/model_executor/models/deepseek_v2.py``): the *interleaved* (GPT-J) style, which rotates adjacent pairs
``(x[2i], x[2i+1])`` by angle ``pos * inv_freq[i]``::

    out[2i]   = x[2i] * cos - x[2i+1] * sin
    out[2i+1] = x[2i+1] * cos + x[2i] * sin

(``rotate_gptj`` in ``vllm/model_executor/layers/rotary_embedding/common.py``.) The NeoX style rotates
``(x[i], x[i + D_rope/2])`` instead; DeepSeek V3.2's *indexer* uses NeoX by default (``indexer_rope_interleave``).
Both are offered here.

Frequencies (``DeepseekScalingRotaryEmbedding``, ``rotary_embedding/deepseek_scaling_rope.py``)::

    pos_freq[i]  = theta ** (2i / D_rope)                  i = 0 .. D_rope/2 - 1
    extrap[i]    = 1 / pos_freq[i];   interp[i] = 1 / (factor * pos_freq[i])
    low, high    = yarn_find_correction_range(beta_fast, beta_slow, D_rope, theta, original_max_position)
    keep[i]      = (1 - clamp((i - low) / (high - low), 0, 1)) * extrapolation_factor
    inv_freq[i]  = interp[i] * (1 - keep[i]) + extrap[i] * keep[i]
    cos, sin     = cos(pos * inv_freq) * m, sin(pos * inv_freq) * m
    m            = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) * attn_factor

For DeepSeek-V3 ``m = 1`` (mscale = mscale_all_dim = 1); the YaRN magnitude correction goes into the softmax
scale instead (:attr:`mlaspec.spec.config.MLAConfig.softmax_scale`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from .checks import FLOAT, INT, Dims, choice
from .config import MLAConfig, yarn_get_mscale

__all__ = ["apply_rope", "inv_freq", "rope_cos_sin"]


def _correction_dim(num_rotations: float, dim: int, base: float, max_position: int) -> float:
    return (dim * math.log(max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _config(config: object) -> MLAConfig:
    if not isinstance(config, MLAConfig):
        raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
    return config


def inv_freq(config: MLAConfig) -> torch.Tensor:
    """Inverse frequencies ``[D_rope / 2]`` float64 of the rope part, YaRN-blended when ``config.rope_scaling`` is
    set."""
    _config(config)
    r, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    extrap = 1.0 / pos_freqs
    ys = config.rope_scaling
    if ys is None:
        return extrap
    interp = 1.0 / (ys.factor * pos_freqs)
    low = max(math.floor(_correction_dim(ys.beta_fast, r, base, ys.original_max_position)), 0)
    high = min(math.ceil(_correction_dim(ys.beta_slow, r, base, ys.original_max_position)), r - 1)
    if low == high:
        high += 0.001  # as vLLM: avoid a zero-width ramp
    ramp = ((torch.arange(r // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp) * ys.extrapolation_factor
    return interp * (1 - keep) + extrap * keep


def rope_cos_sin(config: MLAConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[T, D_rope / 2]`` float64 at integer ``positions [T]`` (magnitude ``m`` included)."""
    _config(config)
    Dims().tensor("positions", positions, ("T",), INT)
    if bool((positions < 0).any()):
        raise ValueError(f"positions must be >= 0, got min {int(positions.min())}")
    angle = positions.to(torch.float64)[:, None] * inv_freq(config).to(positions.device)[None, :]
    ys = config.rope_scaling
    m = (
        1.0
        if ys is None
        else (yarn_get_mscale(ys.factor, ys.mscale) / yarn_get_mscale(ys.factor, ys.mscale_all_dim) * ys.attn_factor)
    )
    return torch.cos(angle) * m, torch.sin(angle) * m


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    config: MLAConfig,
    *,
    style: Literal["gptj", "neox"] = "gptj",
) -> torch.Tensor:
    """Rotate the rope part ``x [T, ..., D_rope]`` of token ``t`` by its position ``positions[t]``.

    Args:
        x: ``[T, D_rope]`` (a key's ``k_pe``) or ``[T, H_q, D_rope]`` (each head's ``q_pe``), float.
        positions: ``[T]`` int, absolute positions (>= 0).
        config: gives ``D_rope``, theta and the YaRN scaling.
        style: ``"gptj"`` (interleaved pairs; DeepSeek MLA in vLLM) or ``"neox"`` (halves; V3.2 indexer).

    Returns:
        Rotated ``x`` of the same shape, float64.
    """
    if isinstance(x, torch.Tensor) and x.dim() < 2:
        raise ValueError(f"x must have shape [T, ..., D_rope], got {list(x.shape)}")
    dims = Dims(D_rope=_config(config).qk_rope_head_dim)
    lead = (None,) * (x.dim() - 2) if isinstance(x, torch.Tensor) and x.dim() >= 2 else ()
    dims.tensor("x", x, ("T",) + lead + ("D_rope",), FLOAT)
    dims.tensor("positions", positions, ("T",), INT)
    choice("style", style, ("gptj", "neox"))
    cos, sin = rope_cos_sin(config, positions)  # [T, D_rope/2]
    cos = cos.reshape(cos.shape[:1] + (1,) * (x.dim() - 2) + cos.shape[1:])
    sin = sin.reshape(cos.shape)
    x = x.to(torch.float64)
    if style == "gptj":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
