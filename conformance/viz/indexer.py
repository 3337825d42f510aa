"""Pictures of the lightning indexer: logits heat maps with the top-k marked, and prefill chunk schedules."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg", force=False)

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

__all__ = ["draw_indexer_comparison", "draw_indexer_logits", "draw_prefill_chunks"]


def draw_indexer_logits(
    logits: torch.Tensor,
    indices: torch.Tensor | None = None,
    *,
    row_starts: torch.Tensor | None = None,
    title: str | None = None,
    ax: plt.Axes | None = None,
) -> Figure:
    """Heat map of indexer logits ``[M, N]`` (rows: queries, columns: keys) with the chosen top-k circled.

    ``-inf`` cells (keys a query may not see) are drawn grey. ``indices [M, K]`` are absolute columns, or
    relative to ``row_starts`` when that is given (the prefill kernel's convention); ``-1`` entries are skipped.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a [M, N] tensor, got {getattr(logits, 'shape', type(logits).__name__)}")
    data = logits.detach().to(torch.float64).cpu().numpy()
    masked = np.ma.masked_where(~np.isfinite(data), data)
    if ax is None:
        m, n = data.shape
        fig, ax = plt.subplots(figsize=(min(12.0, 1.5 + 0.35 * n), min(9.0, 1.2 + 0.35 * m)), dpi=110)
    else:
        fig = ax.figure
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("#d9d9d9")
    image = ax.imshow(masked, cmap=cmap, aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02, label="logit")
    if indices is not None:
        idx = indices.detach().to(torch.int64).cpu()
        if row_starts is not None:
            idx = torch.where(idx >= 0, idx + row_starts.detach().to(torch.int64).cpu()[:, None], -1)
        rows, cols = [], []
        for m, row in enumerate(idx.tolist()):
            for c in row:
                if c >= 0:
                    rows.append(m)
                    cols.append(c)
        ax.scatter(cols, rows, s=40, facecolors="none", edgecolors="#e8463a", linewidths=1.4, label="top-k")
        if rows:
            ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
    ax.set_xlabel("key n")
    ax.set_ylabel("query m")
    ax.set_title(title or "indexer logits (grey: -inf) and chosen top-k")
    fig.tight_layout()
    return fig


def draw_prefill_chunks(
    chunks: Sequence[tuple[slice, slice]],
    seq_lens: Sequence[int] | torch.Tensor,
    query_lens: Sequence[int] | torch.Tensor,
    *,
    request_offset: int = 0,
    title: str | None = None,
) -> Figure:
    """The schedule of :func:`mlaspec.spec.indexer.split_indexer_prefill_chunks` as ``M x N`` logits tiles.

    Each chunk is drawn as a rectangle whose width is the keys it gathers (``N = sum(seq_lens)`` of its
    requests) and whose height is the queries of that sub-chunk; the area is the fp32 logits it allocates.
    """
    s = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    fig, ax = plt.subplots(figsize=(8.0, 3.6), dpi=110)
    colors = plt.get_cmap("tab10")
    y = 0
    max_n = 1
    for req, qs in chunks:
        r0, r1 = req.start - request_offset, req.stop - request_offset
        n = sum(s[r0:r1])
        max_n = max(max_n, n)
        h = qs.stop - qs.start
        ax.add_patch(Rectangle((0, y), max(n, 0.1), h, facecolor=colors(r0 % 10), edgecolor="black", alpha=0.75))
        label = f"req {req.start}:{req.stop}  q {qs.start}:{qs.stop}"
        ax.text(n / 2, y + h / 2, label, ha="center", va="center", fontsize=7)
        y += h
    ax.set_xlim(0, max_n * 1.05)
    ax.set_ylim(y if y else 1, 0)
    ax.set_xlabel("keys gathered (N)")
    ax.set_ylabel("query tokens (M)")
    ax.set_title(title or f"indexer prefill chunks ({len(chunks)}; area = M x N fp32 logits)")
    fig.tight_layout()
    return fig


def draw_indexer_comparison(
    spec_logits: torch.Tensor,
    got_logits: torch.Tensor,
    spec_indices: torch.Tensor | None = None,
    got_indices: torch.Tensor | None = None,
    *,
    row_starts: torch.Tensor | None = None,
    failing_rows: Sequence[int] = (),
    titles: tuple[str, str] = ("spec", "backend"),
    title: str | None = None,
) -> Figure:
    """Two :func:`draw_indexer_logits` panels side by side: the spec's logits with its top-k circled, and the
    backend's (logits, or the same logits with the backend's top-k); ``failing_rows`` are outlined red on both
    panels.

    Args:
        spec_logits: ``[M, N]`` float, ``-inf`` where a query may not see a key.
        got_logits: ``[M, N]`` float (the backend's, or ``spec_logits`` again when only the indices differ).
        spec_indices: ``[M, K]`` int, ``-1`` padded, or None.
        got_indices: ``[M, K]`` int, ``-1`` padded, or None.
        row_starts: ``[M]`` int when the indices are relative to each row's start (prefill top-k).
        failing_rows: rows the verdict failed, outlined red.
        titles: the two panels' titles.
        title: the figure's title.
    """
    m, n = spec_logits.shape
    fig, axes = plt.subplots(
        1, 2, figsize=(min(18.0, 2 * (2.0 + 0.3 * n)), min(9.0, 1.6 + 0.3 * m)), dpi=100, squeeze=False
    )
    for ax, logits, idx, name in zip(axes[0], (spec_logits, got_logits), (spec_indices, got_indices), titles):
        draw_indexer_logits(logits, idx, row_starts=row_starts, title=name, ax=ax)
        for row in failing_rows:
            ax.add_patch(Rectangle((-0.5, row - 0.5), n, 1, fill=False, edgecolor="#d62728", linewidth=1.5))
        if m <= 40:  # every row labelled, failing ones in red
            ax.set_yticks(range(m))
            for row, label in enumerate(ax.get_yticklabels()):
                if row in failing_rows:
                    label.set_color("#d62728")
                    label.set_fontweight("bold")
    if title:
        fig.suptitle(title + (f"  (red: {len(failing_rows)} failing rows)" if len(failing_rows) else ""), fontsize=10)
    fig.tight_layout()
    return fig
