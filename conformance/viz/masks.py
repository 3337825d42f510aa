"""Attention masks as pictures: one query per row, one key per column, filled where the query may attend.

Used for dense causal masks, the sparse masks that top-k indices stand for
(:func:`mlaspec.spec.sparse.indices_to_mask`) and DeepSeek V4's window and compressed masks
(:mod:`mlaspec.spec.sliding_window`).
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

__all__ = ["draw_mask", "draw_masks"]

_CMAP = ListedColormap(["#f4f4f4", "#2f6db5"])


def _as_bool_2d(name: str, mask: object) -> np.ndarray:
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().cpu().numpy()
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(mask).__name__}")
    if mask.ndim != 2:
        raise ValueError(f"{name} must have shape [S_q, S_kv], got {list(mask.shape)}")
    if mask.dtype != np.bool_:
        raise TypeError(f"{name} must be bool, got {mask.dtype}")
    return mask


def _draw(ax, mask: np.ndarray, title: str, xlabel: str, ylabel: str) -> None:
    s_q, s_kv = mask.shape
    ax.imshow(mask, cmap=_CMAP, vmin=0, vmax=1, interpolation="nearest", aspect="equal")
    ax.set_xticks(np.arange(-0.5, s_kv, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, s_q, 1), minor=True)
    if max(s_q, s_kv) <= 48:  # grid lines only where cells are large enough to see
        ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{title}\n({int(mask.sum())} of {mask.size} allowed)", fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)


def draw_mask(mask: torch.Tensor | np.ndarray, title: str = "", *, xlabel: str = "key j",
              ylabel: str = "query i") -> Figure:
    """One mask ``[S_q, S_kv]`` bool (True = may attend) as a grid; returns the Figure."""
    m = _as_bool_2d("mask", mask)
    fig, ax = plt.subplots(figsize=(max(2.5, 0.18 * m.shape[1] + 1.2), max(2.2, 0.18 * m.shape[0] + 1.2)))
    _draw(ax, m, title, xlabel, ylabel)
    fig.tight_layout()
    return fig


def draw_masks(masks: Mapping[str, torch.Tensor | np.ndarray], *, ncols: int | None = None,
               xlabel: str = "key j", ylabel: str = "query i") -> Figure:
    """Several masks side by side, titled by their keys (e.g. sparse next to dense causal, one per V4 layer kind)."""
    if not isinstance(masks, Mapping) or not masks:
        raise ValueError("masks must be a non-empty mapping of title -> mask")
    items = [(str(k), _as_bool_2d(f"masks[{k!r}]", v)) for k, v in masks.items()]
    ncols = len(items) if ncols is None else ncols
    if isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 1:
        raise ValueError(f"ncols must be a positive int, got {ncols!r}")
    nrows = -(-len(items) // ncols)
    width = max(m.shape[1] for _, m in items)
    height = max(m.shape[0] for _, m in items)
    cell_w, cell_h = max(2.5, 0.18 * width + 1.2), max(2.2, 0.18 * height + 1.4)
    fig, axes = plt.subplots(nrows, ncols, figsize=(cell_w * ncols, cell_h * nrows), squeeze=False)
    for ax in axes.flat[len(items):]:
        ax.axis("off")
    for ax, (title, m) in zip(axes.flat, items):
        _draw(ax, m, title, xlabel, ylabel)
    fig.tight_layout()
    return fig
