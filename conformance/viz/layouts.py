"""Pictures of cache layouts: byte diagrams drawn from the layout data, and page maps of block tables."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg", force=False)

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from mlaspec.spec.cache_layouts import CacheLayout, page_bytes

__all__ = ["SLOT_STATUS", "draw_block_table", "draw_byte_differences", "draw_byte_layout"]

_DTYPE_COLORS = {
    "e4m3": "#4C72B0",
    "e5m2": "#64B5CD",
    "bf16": "#55A868",
    "fp16": "#8C9E3B",
    "fp32": "#DD8452",
    "e8m0": "#C44E52",
    "pad": "#BBBBBB",
}


def _field_label(f) -> str:
    return f"{f.name}\n{f.count}x{f.dtype}\n[{f.offset}, {f.end})"


def _draw_record(ax, layout: CacheLayout) -> None:
    """One token record of ``layout`` on ``ax``: fields to scale, coloured by dtype, labelled."""
    small = 0
    for f in layout.fields:
        ax.add_patch(Rectangle((f.offset, 0), f.nbytes, 1, facecolor=_DTYPE_COLORS[f.dtype], edgecolor="black"))
        if f.nbytes >= 0.06 * layout.token_bytes:
            ax.text(f.offset + f.nbytes / 2, 0.5, _field_label(f), ha="center", va="center", fontsize=8, color="white")
        else:
            ax.annotate(
                _field_label(f).replace("\n", " "),
                (f.offset + f.nbytes / 2, 1.0),
                xytext=(f.offset + f.nbytes / 2 - 0.04 * layout.token_bytes, 1.25 + 0.35 * small),
                ha="right" if f.offset > layout.token_bytes / 2 else "left",
                fontsize=7,
                arrowprops={"arrowstyle": "-", "lw": 0.6},
            )
            small += 1
    ax.set_xlim(0, layout.token_bytes)
    ax.set_ylim(0, 1.6 + 0.35 * small)
    ax.set_yticks([])
    ax.set_xlabel("byte offset in the token record")
    ax.set_title(f"{layout.name}: {layout.token_bytes} bytes per token (entry D={layout.entry_dim})", fontsize=10)
    for spine in ("top", "right", "left"):
        ax.spines[spine].set_visible(False)


def draw_byte_layout(layout: CacheLayout, *, block_size: int = 4) -> Figure:
    """Byte diagram of one token record of ``layout`` (fields to scale, coloured by dtype).

    For layouts that split a record between data rows and scale rows inside a page block (DeepSeek V4), a second
    panel shows a page of ``block_size`` tokens: the data rows of every token first, then the scale rows, then the
    alignment padding.
    """
    split = layout.split_at is not None
    fig, axes = plt.subplots(2 if split else 1, 1, figsize=(11, 3.6 if split else 1.9), squeeze=False)
    _draw_record(axes[0, 0], layout)

    if split:
        ax = axes[1, 0]
        p = block_size
        data, tail = layout.split_at, layout.token_bytes - layout.split_at
        total = page_bytes(layout, p)
        for t in range(p):
            for f in layout.fields:
                if f.end <= data:  # data row field
                    x0 = t * data + f.offset
                else:
                    x0 = p * data + t * tail + (f.offset - data)
                ax.add_patch(Rectangle((x0, 0), f.nbytes, 1, facecolor=_DTYPE_COLORS[f.dtype], edgecolor="none"))
            ax.text(
                t * data + data / 2, 0.5, f"token {t}\ndata row", ha="center", va="center", fontsize=8, color="white"
            )
            ax.axvline(t * data, color="black", lw=0.6)
        ax.axvline(p * data, color="black", lw=1.2)
        ax.text(p * data + p * tail / 2, 1.15, f"{p} scale rows x {tail} B", ha="center", fontsize=8)
        if total > p * layout.token_bytes:
            ax.add_patch(
                Rectangle(
                    (p * layout.token_bytes, 0),
                    total - p * layout.token_bytes,
                    1,
                    facecolor="white",
                    hatch="//",
                    edgecolor="#888888",
                )
            )
            ax.text(total, 1.15, f"pad to {layout.page_alignment}", ha="right", fontsize=8)
        ax.set_xlim(0, total)
        ax.set_ylim(0, 1.5)
        ax.set_yticks([])
        ax.set_xlabel(f"byte offset in a page block of P={p} tokens ({total} bytes)")
        for spine in ("top", "right", "left"):
            ax.spines[spine].set_visible(False)
    handles = [
        Rectangle((0, 0), 1, 1, facecolor=_DTYPE_COLORS[d])
        for d in _DTYPE_COLORS
        if any(f.dtype == d for f in layout.fields)
    ]
    labels = [d for d in _DTYPE_COLORS if any(f.dtype == d for f in layout.fields)]
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=len(labels), frameon=False)
    fig.tight_layout()
    return fig


def draw_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> Figure:
    """Page map: each request's logical blocks (top) and where they live among the physical pages (bottom).

    Args:
        block_table: ``[B, max_blocks]`` int, physical page of each logical block.
        seq_lens: ``[B]`` int, tokens per request; blocks past ``ceil(seq_lens[b] / P)`` are not drawn.
        block_size: ``P``.
    """
    bt = torch.as_tensor(block_table).to(torch.int64)
    lens = torch.as_tensor(seq_lens).to(torch.int64).tolist()
    b, max_blocks = bt.shape
    used = [(-(-n // block_size)) for n in lens]
    num_pages = int(max([int(bt[i, :u].max()) + 1 for i, u in enumerate(used) if u] + [1]))
    colors = plt.get_cmap("tab10")
    fig, (top, bottom) = plt.subplots(
        2,
        1,
        figsize=(max(6, 0.7 * max(max_blocks, num_pages) + 2), 1.2 + 0.6 * b + 1.4),
        gridspec_kw={"height_ratios": [b, 1.2]},
    )
    owner = {}
    for i in range(b):
        for j in range(used[i]):
            fill = min(block_size, lens[i] - j * block_size) / block_size
            page = int(bt[i, j])
            top.add_patch(Rectangle((j, b - 1 - i), 0.95, 0.9, facecolor="white", edgecolor=colors(i % 10)))
            top.add_patch(Rectangle((j, b - 1 - i), 0.95 * fill, 0.9, facecolor=colors(i % 10), alpha=0.6))
            top.text(j + 0.47, b - 1 - i + 0.45, f"-> {page}", ha="center", va="center", fontsize=8)
            owner.setdefault(page, []).append((i, j, fill))
    top.set_xlim(0, max(max_blocks, 1))
    top.set_ylim(0, b)
    top.set_yticks([b - 1 - i + 0.45 for i in range(b)], [f"req {i} ({lens[i]} tok)" for i in range(b)])
    top.set_xticks([j + 0.47 for j in range(max_blocks)], [str(j) for j in range(max_blocks)])
    top.set_xlabel(f"logical block (P = {block_size} tokens); label: physical page")
    for page in range(num_pages):
        who = owner.get(page, [])
        if not who:
            bottom.add_patch(Rectangle((page, 0), 0.95, 0.9, facecolor="#EEEEEE", edgecolor="#AAAAAA"))
            continue
        for k, (i, j, _fill) in enumerate(who):  # several owners = shared page (prefix caching)
            h = 0.9 / len(who)
            bottom.add_patch(Rectangle((page, k * h), 0.95, h, facecolor=colors(i % 10), alpha=0.6, edgecolor="black"))
            bottom.text(page + 0.47, k * h + h / 2, f"r{i}.b{j}", ha="center", va="center", fontsize=7)
    bottom.set_xlim(0, num_pages)
    bottom.set_ylim(0, 1)
    bottom.set_yticks([])
    bottom.set_xticks([p + 0.47 for p in range(num_pages)], [str(p) for p in range(num_pages)])
    bottom.set_xlabel("physical page (grey: free)")
    fig.tight_layout()
    return fig


SLOT_STATUS = ("untouched", "written, as the spec", "written, bytes differ", "should be untouched, changed")
_SLOT_COLORS = ("#eeeeee", "#8fc98f", "#f0a040", "#d62728")


def draw_byte_differences(
    byte_diffs: torch.Tensor,
    slot_status: torch.Tensor,
    *,
    layout: CacheLayout | None = None,
    entry_label: str = "",
    block_size: int | None = None,
    title: str = "",
) -> Figure:
    """Where a written cache differs from the spec's: per byte of the record, and per slot.

    Top: the token record (:func:`draw_byte_layout`'s diagram of ``layout``, or one block labelled ``entry_label``
    for a plain cache). Middle: for each byte offset, how many written records differ there from the spec's record
    (fp8 value bytes may differ by one step at a tie and still pass; scale, RoPE and pad bytes may not). Bottom:
    every slot of the cache, one row per page block of ``block_size`` slots, coloured by :data:`SLOT_STATUS`.

    Args:
        byte_diffs: ``[token_bytes]`` int, the count of written records whose byte differs.
        slot_status: ``[num_slots]`` int in ``0..3``, an index into :data:`SLOT_STATUS`.
        layout: the record layout, or None for a plain (``kv_cache_dtype="auto"``) cache.
        entry_label: the plain cache's record label (``"entry: 576 x bf16"``).
        block_size: slots per page block (rows of the bottom panel); None draws one row.
        title: the figure's title (the case id).
    """
    diffs = torch.as_tensor(byte_diffs).to(torch.int64).cpu()
    status = torch.as_tensor(slot_status).to(torch.int64).cpu()
    token_bytes = diffs.numel()
    if layout is not None and layout.token_bytes != token_bytes:
        raise ValueError(f"byte_diffs must have {layout.token_bytes} entries ({layout.name}), got {token_bytes}")
    if status.dim() != 1 or bool(((status < 0) | (status > 3)).any()):
        raise ValueError("slot_status must be a 1-D tensor of codes 0..3 (SLOT_STATUS)")
    per_row = block_size or max(status.numel(), 1)
    rows = -(-status.numel() // per_row)
    grid = torch.full((rows * per_row,), -1, dtype=torch.int64)
    grid[: status.numel()] = status
    fig, (rec, bars, slots) = plt.subplots(
        3,
        1,
        figsize=(11, 4.6 + min(4.0, 0.18 * rows)),
        gridspec_kw={"height_ratios": [1.3, 1.2, max(1.0, min(4.0, rows / 4))]},
    )
    if layout is not None:
        _draw_record(rec, layout)
    else:
        rec.add_patch(Rectangle((0, 0), token_bytes, 1, facecolor=_DTYPE_COLORS["bf16"], edgecolor="black"))
        rec.text(token_bytes / 2, 0.5, entry_label, ha="center", va="center", fontsize=8, color="white")
        rec.set_xlim(0, token_bytes)
        rec.set_ylim(0, 1.6)
        rec.set_yticks([])
        rec.set_title(f"plain cache: {token_bytes} bytes per token", fontsize=10)
    rec.set_xlabel("")
    bars.bar(torch.arange(token_bytes).numpy() + 0.5, diffs.numpy(), width=1.0, color="#d62728")
    bars.set_xlim(0, token_bytes)
    bars.set_ylabel("records", fontsize=8)
    bars.set_xlabel("byte offset in the token record", fontsize=8)
    bars.set_title(
        f"written records that differ from the spec's, per byte ({int((diffs > 0).sum())} of {token_bytes} offsets)",
        fontsize=9,
    )
    cmap = ListedColormap(["white", *_SLOT_COLORS])
    slots.imshow(
        grid.reshape(rows, per_row).numpy() + 1, cmap=cmap, vmin=0, vmax=4, aspect="auto", interpolation="nearest"
    )
    slots.set_xlabel("slot within its page block" if block_size else "slot", fontsize=8)
    slots.set_ylabel("page block" if block_size else "", fontsize=8)
    if not block_size:
        slots.set_yticks([])
    counts = [int((status == i).sum()) for i in range(4)]
    slots.legend(
        [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black") for c in _SLOT_COLORS],
        [f"{s} ({n})" for s, n in zip(SLOT_STATUS, counts)],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.6),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
