"""Pictures of a batch's life: the batch's regions and lengths, and the chunked-context schedule over the workspace."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg", force=False)

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from mlaspec.spec.batch import CommonAttentionMetadata, split_decodes_and_prefills
from mlaspec.spec.chunked_context import ChunkPlan

__all__ = ["draw_batch", "draw_chunk_schedule", "draw_chunk_schedule_failures", "draw_merge_weights"]

CONTEXT = "#c9c9c9"
DECODE = "#3a7dc9"
PREFILL = "#e8863a"


def draw_batch(metadata: CommonAttentionMetadata, *, decode_threshold: int = 1, title: str | None = None) -> Figure:
    """The batch per request (context then new tokens, decodes blue, prefills orange) and its packed token axis.

    Top: one row per request, ``num_computed_tokens`` grey then ``query_len`` coloured by the side of
    :func:`~mlaspec.spec.batch.split_decodes_and_prefills` it lands on. Bottom: the ``T`` new tokens as the
    kernels see them, cut at ``query_start_loc``, with the decode / prefill boundary marked. A batch that is not
    reordered is drawn by query length alone and says so in the title.
    """
    if not isinstance(metadata, CommonAttentionMetadata):
        raise TypeError(f"metadata must be a CommonAttentionMetadata, got {type(metadata).__name__}")
    b, t = metadata.num_reqs, metadata.num_actual_tokens
    ctx = metadata.num_computed_tokens.tolist()
    q = metadata.query_lens.tolist()
    qsl = metadata.query_start_loc.tolist()
    note = ""
    short = [x <= decode_threshold for x in q]
    try:
        num_decodes = split_decodes_and_prefills(metadata, decode_threshold).num_decodes
    except ValueError:
        num_decodes = None
    if num_decodes is not None and any(short[i] and ctx[i] > 0 for i in range(num_decodes, b)):
        num_decodes = None  # vLLM's early exit (first query long) on a batch that still has decodes behind
    if num_decodes is None:
        is_decode, note = short, " (not reordered)"
    else:
        is_decode = [i < num_decodes for i in range(b)]
    width = max([c + n for c, n in zip(ctx, q)] + [1])
    fig, (top, bottom) = plt.subplots(
        2,
        1,
        figsize=(min(14.0, 3.0 + 0.25 * max(width, t)), 1.8 + 0.45 * b + 1.2),
        gridspec_kw={"height_ratios": [max(b, 1), 1.0]},
        dpi=110,
    )
    for i in range(b):
        y = b - 1 - i
        color = DECODE if is_decode[i] else PREFILL
        top.add_patch(Rectangle((0, y + 0.1), ctx[i], 0.8, facecolor=CONTEXT, edgecolor="none"))
        top.add_patch(Rectangle((ctx[i], y + 0.1), q[i], 0.8, facecolor=color, edgecolor="black", linewidth=0.6))
        top.text(ctx[i] + q[i] + 0.2, y + 0.5, f"ctx {ctx[i]} + q {q[i]}", va="center", fontsize=8)
    if num_decodes is not None and 0 < num_decodes < b:
        top.axhline(b - num_decodes, color="black", linestyle="--", linewidth=1)
    top.set_xlim(0, width * 1.25 + 2)
    top.set_ylim(0, max(b, 1))
    top.set_yticks([b - 1 - i + 0.5 for i in range(b)], [f"req {i}" for i in range(b)])
    top.set_xlabel("position in the sequence (grey: context in the cache; colour: new tokens this step)")
    top.legend(
        handles=[
            Patch(color=CONTEXT, label="context"),
            Patch(color=DECODE, label="decode"),
            Patch(color=PREFILL, label="prefill"),
        ],
        loc="lower right",
        fontsize=8,
        framealpha=0.85,
    )
    top.set_title(title or f"batch: {b} requests, {t} new tokens, decode_threshold = {decode_threshold}{note}")

    for i in range(b):
        color = DECODE if is_decode[i] else PREFILL
        bottom.add_patch(Rectangle((qsl[i], 0), q[i], 1, facecolor=color, edgecolor="black", linewidth=0.8))
        if q[i]:
            bottom.text(qsl[i] + q[i] / 2, 0.5, f"r{i}", ha="center", va="center", fontsize=8)
    if num_decodes is not None and 0 < num_decodes < b:
        bottom.axvline(qsl[num_decodes], color="black", linestyle="--", linewidth=1.5)
        bottom.text(qsl[num_decodes], 1.05, f" num_decode_tokens = {qsl[num_decodes]}", fontsize=8, va="bottom")
    bottom.set_xlim(0, max(t, 1))
    bottom.set_ylim(0, 1.4)
    bottom.set_yticks([])
    bottom.set_xticks(qsl)
    bottom.set_xlabel("token axis T (ticks: query_start_loc)")
    fig.tight_layout()
    return fig


def draw_chunk_schedule(plan: ChunkPlan, *, title: str | None = None) -> Figure:
    """The chunk plan: each prefill's context cut into chunks (top), and each chunk's fill of the workspace (bottom).

    Top: one row per prefill, its context ``[0, context_len)`` coloured by the chunk that processes it; dashed
    lines at multiples of ``max_context_chunk``. Bottom: one row per chunk, the workspace rows
    ``cu_seq_lens[i, b] : cu_seq_lens[i, b + 1]`` coloured by request, against ``workspace_size`` (red line).
    """
    if not isinstance(plan, ChunkPlan):
        raise TypeError(f"plan must be a ChunkPlan, got {type(plan).__name__}")
    b, n = plan.num_prefills, plan.num_chunks
    ctx = plan.context_lens.tolist()
    chunk_colors = plt.get_cmap("tab10")
    req_colors = plt.get_cmap("Set2")
    fig, (top, bottom) = plt.subplots(
        2,
        1,
        figsize=(10.0, 1.6 + 0.45 * max(b, 1) + 0.45 * max(n, 1) + 0.8),
        gridspec_kw={"height_ratios": [max(b, 1), max(n, 1)]},
        dpi=110,
    )
    longest = max(ctx + [1])
    for r in range(b):
        y = b - 1 - r
        top.add_patch(Rectangle((0, y + 0.1), max(ctx[r], 0), 0.8, facecolor="none", edgecolor="black", linewidth=0.6))
        for i in range(n):
            s, length = int(plan.starts[i, r]), int(plan.seq_lens[i, r])
            if length:
                top.add_patch(Rectangle((s, y + 0.1), length, 0.8, facecolor=chunk_colors(i % 10), alpha=0.75))
                top.text(s + length / 2, y + 0.5, f"c{i}", ha="center", va="center", fontsize=8)
        top.text(longest * 1.01, y + 0.5, f"{ctx[r]}", va="center", fontsize=8)
    for i in range(1, n + 1):
        top.axvline(i * plan.max_context_chunk, color="grey", linestyle="--", linewidth=0.8)
    top.set_xlim(0, longest * 1.08)
    top.set_ylim(0, max(b, 1))
    top.set_yticks([b - 1 - r + 0.5 for r in range(b)], [f"prefill {r}" for r in range(b)])
    top.set_xlabel(f"context position (chunk width max_context_chunk = {plan.max_context_chunk})")
    top.set_title(title or f"{n} context chunks, workspace {plan.workspace_size} rows, block_size {plan.block_size}")

    for i in range(n):
        y = n - 1 - i
        for r in range(b):
            lo, hi = int(plan.cu_seq_lens[i, r]), int(plan.cu_seq_lens[i, r + 1])
            if hi > lo:
                bottom.add_patch(
                    Rectangle(
                        (lo, y + 0.1), hi - lo, 0.8, facecolor=req_colors(r % 8), edgecolor="black", linewidth=0.5
                    )
                )
                bottom.text((lo + hi) / 2, y + 0.5, f"p{r}", ha="center", va="center", fontsize=8)
        bottom.text(plan.workspace_size * 1.01, y + 0.5, f"seq_tot {plan.seq_tot[i]}", va="center", fontsize=8)
    bottom.axvline(plan.workspace_size, color="#d62728", linewidth=1.5)
    bottom.set_xlim(0, plan.workspace_size * 1.2)
    bottom.set_ylim(0, max(n, 1))
    bottom.set_yticks([n - 1 - i + 0.5 for i in range(n)], [f"chunk {i}" for i in range(n)])
    bottom.set_xlabel("workspace row (red: workspace_size)")
    fig.tight_layout()
    return fig


def draw_merge_weights(lses: dict[str, float], *, title: str | None = None) -> Figure:
    """How ``merge_attn_states`` weighs the parts of one query's attention: ``exp(lse_i - logsumexp(lse))``.

    ``lses`` maps a part's name (``"chunk 0"``, ..., ``"new tokens"``) to its natural-log LSE for one query and
    head; ``-inf`` (an empty part) gets weight 0 and is drawn hatched. The weights sum to 1.
    """
    if not isinstance(lses, dict) or not lses:
        raise ValueError("lses must be a non-empty dict of part name -> LSE")
    names = list(lses)
    lse = torch.tensor([float(lses[k]) for k in names], dtype=torch.float64)
    total = torch.logsumexp(lse, 0)
    weights = torch.where(torch.isneginf(lse), 0.0, torch.exp(lse - total)).tolist()
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(names), 3.2), dpi=110)
    colors = plt.get_cmap("tab10")
    for i, w in enumerate(weights):
        empty = bool(torch.isneginf(lse[i]))
        ax.bar(
            i,
            max(w, 0.004) if empty else w,
            color="white" if empty else colors(i % 10),
            edgecolor="black",
            hatch="//" if empty else None,
        )
        label = "empty\nlse -inf" if empty else f"{w:.2f}\nlse {float(lse[i]):.2f}"
        ax.text(i, w + 0.02, label, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("weight in the merged output")
    ax.set_title(title or f"merge weights (total lse = {float(total):.2f})", fontsize=10)
    fig.tight_layout()
    return fig


def draw_chunk_schedule_failures(plan: ChunkPlan, request_errors, *, title: str | None = None) -> Figure:
    """:func:`draw_chunk_schedule` of a failing case, each request's worst ``|error| / bound`` written at the end
    of its row and the failing requests (above 1, NaN or inf) outlined red, in both panels.

    Args:
        plan: the case's chunk plan (one row per prefill, in batch order).
        request_errors: ``[B_p]`` float, the worst ``|error| / bound`` over each request's new tokens and heads.
        title: the figure's title.
    """
    errors = [
        float(e) for e in (request_errors.tolist() if isinstance(request_errors, torch.Tensor) else request_errors)
    ]
    if len(errors) != plan.num_prefills:
        raise ValueError(f"request_errors must have one entry per prefill ({plan.num_prefills}), got {len(errors)}")
    failing = [r for r, e in enumerate(errors) if not e <= 1.0]
    fig = draw_chunk_schedule(plan, title=title)
    top, bottom = fig.axes[0], fig.axes[1]
    b, n = plan.num_prefills, plan.num_chunks
    x_max = top.get_xlim()[1]
    for r, e in enumerate(errors):
        y = b - 1 - r
        bad = r in failing
        top.text(
            x_max * 0.995,
            y + 0.5,
            f"{e:.3g}" if e == e and abs(e) != float("inf") else "NaN/inf",
            ha="right",
            va="center",
            fontsize=8,
            color="#d62728" if bad else "#555555",
            fontweight="bold" if bad else "normal",
        )
        if bad:
            top.add_patch(Rectangle((0, y + 0.02), x_max, 0.96, fill=False, edgecolor="#d62728", linewidth=1.8))
            for i in range(n):
                lo, hi = int(plan.cu_seq_lens[i, r]), int(plan.cu_seq_lens[i, r + 1])
                if hi > lo:
                    bottom.add_patch(
                        Rectangle((lo, n - 1 - i + 0.1), hi - lo, 0.8, fill=False, edgecolor="#d62728", linewidth=1.8)
                    )
    for r in failing:
        top.get_yticklabels()[r].set_color("#d62728")
    top.set_title(
        f"{title or 'chunk schedule'}\nred: {len(failing)} of {b} requests fail (worst |error| / bound at the right)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig
