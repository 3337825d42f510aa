"""Error heat maps: where, over heads and positions, a backend's output leaves its budget."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from matplotlib.colors import LogNorm
from matplotlib.ticker import MaxNLocator

__all__ = ["draw_error_heatmaps"]


def _integer_ticks(axis, n: int) -> None:
    """Ticks on whole rows / positions only: every one where there are few (MaxNLocator alone puts fractional ticks
    on an axis of a single position), else a handful of integers."""
    if n <= 12:
        axis.set_ticks(range(n))
    else:
        axis.set_major_locator(MaxNLocator(integer=True))


def draw_error_heatmaps(maps: dict[str, torch.Tensor], *, title: str = "") -> plt.Figure:
    """One panel per output: ``|error| / bound`` over ``[heads, positions]`` on a log scale; above 1 fails."""
    fig, axes = plt.subplots(1, len(maps), figsize=(4.5 * len(maps), 3.2), squeeze=False)
    for ax, (name, m) in zip(axes[0], maps.items()):
        data = m.detach().double().clamp(1e-3, 1e12).numpy()  # a zero bound gives a huge ratio: cap it to draw
        im = ax.imshow(data, aspect="auto", cmap="magma", norm=LogNorm(vmin=1e-3, vmax=max(10.0, data.max())))
        ax.set_title(f"{name}: |error| / bound")
        ax.set_xlabel("position")
        _integer_ticks(ax.xaxis, data.shape[1])
        _integer_ticks(ax.yaxis, data.shape[0])
        ax.set_ylabel("head")
        cb = fig.colorbar(im, ax=ax)
        cb.ax.axhline(1.0, color="cyan", lw=2)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
