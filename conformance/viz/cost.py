"""Pictures of the cost model (:mod:`mlaspec.spec.cost`): when each of MLA's two forms is the faster one.

Both functions build a :class:`matplotlib.figure.Figure` directly (no pyplot state, no ``show``), so they work under
the Agg backend, in notebooks and in scripts alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from mlaspec.spec.config import MLAConfig
from mlaspec.spec.cost import H200_BANDWIDTH, H200_PEAK_FLOPS, crossover, mla_cost, time_estimate

__all__ = ["draw_cost_crossover", "draw_cost_winner_map"]


def _seconds(form, b, s_q, s_kv, kw, peak_flops, bandwidth) -> float:
    return time_estimate(mla_cost(form, b, s_q, s_kv, **kw), peak_flops, bandwidth).seconds


def _setting(batch: int, num_heads: int | None, config: MLAConfig | None, causal: bool) -> str:
    """``B=.., N=..`` (``, causal``) for a title; ``N`` defaults to the config's head count, as in ``mla_cost``."""
    heads = (config or MLAConfig()).num_heads if num_heads is None else num_heads
    return f"B={batch}, N={heads}" + (", causal" if causal else "")


def _log_points(lo: int, hi: int, points: int) -> np.ndarray:
    return np.unique(np.round(np.geomspace(lo, hi, points)).astype(int))


def draw_cost_crossover(
    s_kv_values: Sequence[int] = (1024, 8192, 65536),
    *,
    batch: int = 1,
    num_heads: int | None = None,
    dtype: torch.dtype | int = torch.bfloat16,
    config: MLAConfig | None = None,
    causal: bool = False,
    peak_flops: float = H200_PEAK_FLOPS,
    bandwidth: float = H200_BANDWIDTH,
    points: int = 64,
) -> Figure:
    """Estimated time of each form against the query length ``S_q``, one colour per context length ``S_kv``.

    Log-log axes; solid lines are the compute-friendly form (``mha``), dashed the absorbed form; a dot marks the
    crossover (:func:`mlaspec.spec.cost.crossover`) on each pair of curves. Each curve runs ``S_q = 1 .. S_kv``.

    Args:
        s_kv_values: the context lengths to draw.
        batch: ``B``, as :func:`mlaspec.spec.cost.mla_cost`.
        num_heads: ``N`` (default ``config.num_heads``).
        dtype: element type or its size in bytes.
        config: the layer's dimensions (default DeepSeek-V3).
        causal: count only the pairs the bottom-right causal mask keeps.
        peak_flops: FLOP/s of the roofline (default: one H200, measured).
        bandwidth: bytes/s of the roofline (default: one H200, measured).
        points: samples per curve (log-spaced).
    """
    kw = dict(num_heads=num_heads, dtype=dtype, config=config, causal=causal)
    fig = Figure(figsize=(7.5, 5), layout="constrained")
    ax = fig.add_subplot()
    colors = [f"C{i}" for i in range(len(s_kv_values))]
    for s_kv, color in zip(s_kv_values, colors):
        s_q = _log_points(1, s_kv, points)
        for form, style in (("mha", "-"), ("absorbed", "--")):
            t = [_seconds(form, batch, int(s), s_kv, kw, peak_flops, bandwidth) for s in s_q]
            ax.plot(s_q, np.array(t) * 1e6, style, color=color, label=f"{form}, $S_{{kv}}$={s_kv:,}")
        x = crossover(s_kv, batch=batch, peak_flops=peak_flops, bandwidth=bandwidth, **kw)
        if x.s_q is not None:
            ax.plot([x.s_q], [x.mha_seconds * 1e6], "o", color=color, markersize=7, markeredgecolor="black")
            ax.annotate(
                f"$S_q^*$={x.s_q}",
                (x.s_q, x.mha_seconds * 1e6),
                textcoords="offset points",
                xytext=(8, -12),
                color=color,
                fontsize=9,
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("query length $S_q$ (new tokens per sequence)")
    ax.set_ylabel("roofline time estimate (µs)")
    ax.set_title(f"MLA attention, one layer: {_setting(batch, num_heads, config, causal)}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, ncols=2, loc="upper left")
    return fig


def draw_cost_winner_map(
    *,
    s_kv_max: int = 2**17,
    batch: int = 1,
    num_heads: int | None = None,
    dtype: torch.dtype | int = torch.bfloat16,
    config: MLAConfig | None = None,
    causal: bool = False,
    peak_flops: float = H200_PEAK_FLOPS,
    bandwidth: float = H200_BANDWIDTH,
    points: int = 48,
) -> Figure:
    """Heat map over ``(S_kv, S_q)`` of ``log2(t_mha / t_absorbed)``: red where the absorbed form wins, blue where
    the compute-friendly form does; the black contour is the crossover. Cells with ``S_q > S_kv`` are blank.

    Args:
        s_kv_max: the largest context length (both axes run from 1 to it, log-spaced).
        batch: ``B``, as :func:`mlaspec.spec.cost.mla_cost`.
        num_heads: ``N`` (default ``config.num_heads``).
        dtype: element type or its size in bytes.
        config: the layer's dimensions (default DeepSeek-V3).
        causal: count only the pairs the bottom-right causal mask keeps.
        peak_flops: FLOP/s of the roofline (default: one H200, measured).
        bandwidth: bytes/s of the roofline (default: one H200, measured).
        points: samples per axis.
    """
    kw = dict(num_heads=num_heads, dtype=dtype, config=config, causal=causal)
    axis = _log_points(1, s_kv_max, points)
    ratio = np.full((axis.size, axis.size), np.nan)  # [S_q, S_kv]
    for j, s_kv in enumerate(axis):
        for i, s_q in enumerate(axis[axis <= s_kv]):
            t_mha = _seconds("mha", batch, int(s_q), int(s_kv), kw, peak_flops, bandwidth)
            t_abs = _seconds("absorbed", batch, int(s_q), int(s_kv), kw, peak_flops, bandwidth)
            ratio[i, j] = np.log2(t_mha / t_abs)
    fig = Figure(figsize=(7, 5.5), layout="constrained")
    ax = fig.add_subplot()
    lo, hi = min(float(np.nanmin(ratio)), -1e-3), max(float(np.nanmax(ratio)), 1e-3)  # each side saturates
    mesh = ax.pcolormesh(axis, axis, ratio, cmap="RdBu_r", norm=TwoSlopeNorm(0.0, lo, hi), shading="nearest")
    ax.contour(axis, axis, ratio, levels=[0.0], colors="black", linewidths=1.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context length $S_{kv}$")
    ax.set_ylabel("query length $S_q$")
    ax.set_title(f"Which form is faster (roofline): {_setting(batch, num_heads, config, causal)}")
    bar = fig.colorbar(mesh, ax=ax)
    bar.set_label("$\\log_2(t_{mha} / t_{absorbed})$:  > 0 absorbed wins,  < 0 mha wins")
    return fig
