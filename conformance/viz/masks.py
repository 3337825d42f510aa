"""Attention masks as pictures: one query per row, one key per column, filled where the query may attend.

Used for dense causal masks, the sparse masks that top-k indices stand for
(:func:`mlaspec.spec.sparse.indices_to_mask`) and DeepSeek V4's window and compressed masks
(:mod:`mlaspec.spec.sliding_window`).
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = ["draw_mask", "draw_mask_failures", "draw_masks"]

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


def draw_mask(
    mask: torch.Tensor | np.ndarray, title: str = "", *, xlabel: str = "key j", ylabel: str = "query i"
) -> Figure:
    """One mask ``[S_q, S_kv]`` bool (True = may attend) as a grid; returns the Figure."""
    m = _as_bool_2d("mask", mask)
    fig, ax = plt.subplots(figsize=(max(2.5, 0.18 * m.shape[1] + 1.2), max(2.2, 0.18 * m.shape[0] + 1.2)))
    _draw(ax, m, title, xlabel, ylabel)
    fig.tight_layout()
    return fig


def draw_masks(
    masks: Mapping[str, torch.Tensor | np.ndarray],
    *,
    ncols: int | None = None,
    xlabel: str = "key j",
    ylabel: str = "query i",
) -> Figure:
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
    for ax in axes.flat[len(items) :]:
        ax.axis("off")
    for ax, (title, m) in zip(axes.flat, items):
        _draw(ax, m, title, xlabel, ylabel)
    fig.tight_layout()
    return fig


def _row_errors(name: str, row_errors: object, s_q: int) -> np.ndarray:
    e = row_errors.detach().cpu().double().numpy() if isinstance(row_errors, torch.Tensor) else np.asarray(row_errors)
    if e.shape != (s_q,):
        raise ValueError(f"{name} must have shape [S_q] = [{s_q}], got {list(e.shape)}")
    return e.astype(np.float64)


def draw_mask_failures(
    masks: Mapping[str, torch.Tensor | np.ndarray],
    row_errors: torch.Tensor | np.ndarray,
    *,
    unexplained: Mapping[str, torch.Tensor | np.ndarray] | None = None,
    title: str = "",
    xlabel: str = "key j",
    ylabel: str = "query i",
) -> Figure:
    """A failing case's masks side by side, its failing rows outlined red, and the worst ``|error| / bound`` per row.

    Args:
        masks: title -> ``[S_q, S_kv_m]`` bool (True = may attend); every mask has the same ``S_q`` rows (the widths
            may differ: a window over raw keys next to compressed entries). Typically the spec's mask next to what
            the backend did (a mask inferred from its output, or the dense causal mask next to a sparse pattern).
        row_errors: ``[S_q]`` float, the worst ``|error| / bound`` of each query row over heads and batches
            (``inf`` where the NaN / ±inf pattern differs); rows above 1 fail and are outlined.
        unexplained: title -> ``[S_q]`` bool: rows of that (inferred) mask that nothing explains, hatched.
        title: the figure's title (the case id).
        xlabel: the key axis label.
        ylabel: the query axis label.
    """
    if not isinstance(masks, Mapping) or not masks:
        raise ValueError("masks must be a non-empty mapping of title -> mask")
    items = [(str(k), _as_bool_2d(f"masks[{k!r}]", v)) for k, v in masks.items()]
    s_q = items[0][1].shape[0]
    if any(m.shape[0] != s_q for _, m in items):
        raise ValueError(f"masks must all have S_q = {s_q} rows, got {[list(m.shape) for _, m in items]}")
    err = _row_errors("row_errors", row_errors, s_q)
    failing = ~(err <= 1.0)  # NaN and inf fail too
    widths = [max(m.shape[1], 1) for _, m in items]
    ratios = [min(max(w / 4, 1.5), 6.0) for w in widths] + [1.8]
    size = (sum(ratios) * 1.15 + 1.0, max(2.6, min(9.0, 0.22 * s_q + 1.8)))
    fig, axes = plt.subplots(1, len(items) + 1, figsize=size, sharey=True, gridspec_kw={"width_ratios": ratios})
    hatch_rows = {
        str(k): np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v, dtype=bool)
        for k, v in (unexplained or {}).items()
    }
    for ax, (name, m) in zip(axes, items):
        s_kv = m.shape[1]
        ax.imshow(
            m if s_kv else np.zeros((s_q, 1), dtype=bool),
            cmap=_CMAP,
            vmin=0,
            vmax=1,
            interpolation="nearest",
            aspect="auto",
        )
        if max(s_q, s_kv) <= 48:
            ax.set_xticks(np.arange(-0.5, s_kv, 1), minor=True)
            ax.set_yticks(np.arange(-0.5, s_q, 1), minor=True)
            ax.grid(which="minor", color="white", linewidth=0.6)
            ax.tick_params(which="minor", length=0)
        for i in np.flatnonzero(hatch_rows.get(name, np.zeros(s_q, dtype=bool))):
            ax.add_patch(
                plt.Rectangle(
                    (-0.5, i - 0.5), max(s_kv, 1), 1, facecolor="#f2f2f2", hatch="xx", edgecolor="#999999", linewidth=0
                )
            )
        for i in np.flatnonzero(failing):
            ax.add_patch(
                plt.Rectangle((-0.5, i - 0.45), max(s_kv, 1), 0.9, fill=False, edgecolor="#d62728", linewidth=1.6)
            )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{name}\n({int(m.sum())} of {m.size} allowed)", fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
    axes[0].set_ylabel(ylabel, fontsize=8)
    bar = axes[-1]
    finite = np.isfinite(err)
    top = max(10.0, float(err[finite].max()) * 2 if finite.any() else 10.0)
    shown = np.where(finite, np.clip(err, 1e-3, None), top)
    bar.barh(np.arange(s_q), shown, height=0.8, left=0, color=np.where(failing, "#d62728", "#9e9e9e"))
    for i in np.flatnonzero(~finite):
        bar.text(top, i, " NaN/inf", va="center", ha="right", fontsize=7, color="white")
    bar.axvline(1.0, color="black", linestyle="--", linewidth=1)
    bar.set_xscale("log")
    bar.set_xlim(1e-3, top * 1.5)
    bar.set_xlabel("worst |error| / bound", fontsize=8)
    bar.set_title(f"{int(failing.sum())} of {s_q} rows fail\n(red; dashed: the budget)", fontsize=9)
    bar.set_ylim(s_q - 0.5, -0.5)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
