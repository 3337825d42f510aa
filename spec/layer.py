"""A whole MLA layer for one sequence: projections, rope, attention in either form, output projection.

    h_t [T, D_hidden] --project--> q_nope, q_pe, kv_c, k_pe --attention (causal, either form)--> o [T, H_q, D_v]
        --W_O--> [T, D_hidden]

The two forms give the same result to float64 rounding (:mod:`mlaspec.spec.forms` says why); vLLM runs the
compute-friendly one for prefills and the absorbed one for decodes.
"""

from __future__ import annotations

from typing import Literal

import torch

from .checks import choice
from .config import MLAConfig, MLAWeights
from .forms import mla_absorbed, mla_mha
from .projections import output_projection, project

__all__ = ["mla_layer"]


def mla_layer(
    hidden: torch.Tensor,
    positions: torch.Tensor,
    weights: MLAWeights,
    config: MLAConfig,
    *,
    form: Literal["mha", "absorbed"] = "mha",
) -> torch.Tensor:
    """Causal self-attention of one sequence through an MLA layer.

    Args:
        hidden: ``[T, D_hidden]`` float, the layer's input hidden states.
        positions: ``[T]`` int, their absolute positions (rope).
        weights, config: the layer.
        form: ``"mha"`` (compute-friendly) or ``"absorbed"`` (data-movement-friendly).

    Returns:
        ``[T, D_hidden]`` float64, the layer's output (before the residual add).
    """
    forms = {"mha": mla_mha, "absorbed": mla_absorbed}
    choice("form", form, tuple(forms))
    p = project(hidden, positions, weights, config)
    out, _ = forms[form](
        p.q_nope[None],
        p.q_pe[None],
        p.kv_c[None],
        p.k_pe[None],
        weights.W_UK,
        weights.W_UV,
        scale=config.softmax_scale,
        causal=True,
    )
    return output_projection(out[0], weights)
