"""Decode context parallelism as a picture: which rank stores each token of a request
(:func:`mlaspec.spec.dcp.dcp_owner`), one row per interleave size; and the combined error against the world size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure

from mlaspec.spec.dcp import dcp_local_seq_lens, dcp_owner

__all__ = ["draw_dcp_error", "draw_dcp_sharding"]


def draw_dcp_sharding(seq_len: int, world_size: int, interleaves: Sequence[int]) -> Figure:
    """One row per interleave size ``I``: token ``t`` of a ``seq_len``-token request coloured by the rank
    ``(t // I) % world_size`` that stores it, each row labelled with the ranks' local lengths (vLLM's
    ``get_dcp_local_seq_lens``)."""
    if not interleaves:
        raise ValueError("interleaves must name at least one interleave size")
    t = torch.arange(seq_len)
    owners = np.stack([dcp_owner(t, world_size=world_size, interleave=i).numpy() for i in interleaves])
    cmap = plt.get_cmap("tab10", world_size)
    fig, ax = plt.subplots(figsize=(min(14, 2 + seq_len * 0.22), 0.7 + 0.55 * len(interleaves)), layout="constrained")
    ax.imshow(owners, cmap=cmap, vmin=-0.5, vmax=world_size - 0.5, aspect="auto", interpolation="nearest")
    labels = []
    for row, i in enumerate(interleaves):
        local = dcp_local_seq_lens(torch.tensor([seq_len]), world_size=world_size, interleave=i)[0].tolist()
        labels.append(f"I = {i}   local lens {local}")
        for col in range(seq_len):
            ax.text(col, row, str(owners[row, col]), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(interleaves)), labels)
    ax.set_xticks(range(0, seq_len, max(1, seq_len // 16)))
    ax.set_xlabel("global token position t (the number: the rank that stores it)")
    ax.set_title(f"DCP sharding of a {seq_len}-token request over N_cp = {world_size} ranks")
    return fig


def draw_dcp_error(errors: Mapping[str, Mapping[int, float]], *, ylabel: str = "max |out - ref| / max |ref|") -> Figure:
    """The combined output's error against the world size ``N_cp``, one line per series (a backend and dtype):
    ``errors[label][N_cp] = error``."""
    if not errors:
        raise ValueError("errors must hold at least one series")
    fig, ax = plt.subplots(figsize=(6, 3.6), layout="constrained")
    for label, series in errors.items():
        n = sorted(series)
        ax.plot(n, [series[k] for k in n], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(
        sorted({k for s in errors.values() for k in s}),
        [str(k) for k in sorted({k for s in errors.values() for k in s})],
    )
    ax.set_xlabel("N_cp (ranks)")
    ax.set_ylabel(ylabel)
    ax.set_title("DCP decode: combined error against the world size")
    ax.legend(fontsize=8)
    return fig
