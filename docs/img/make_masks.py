"""Regenerate the mask figures of docs/sparse.md and docs/sliding_window.md.

Run from the repository root: ``python docs/img/make_masks.py``.
"""

from pathlib import Path

import torch

from mlaspec.conformance.viz.masks import draw_masks
from mlaspec.spec.attention import causal_mask
from mlaspec.spec.sliding_window import compressed_mask, window_mask
from mlaspec.spec.sparse import indices_to_mask

OUT = Path(__file__).parent


def sparse_figure():
    s = 12
    g = torch.Generator().manual_seed(0)
    k = 4
    rows = []
    for i in range(s):  # each query picks up to 4 of the keys it may see (causal top-k), -1 padded
        pick = torch.randperm(i + 1, generator=g)[:k]
        rows.append(torch.cat([pick, torch.full((k - pick.numel(),), -1)]))
    idx = torch.stack(rows)[:, None].to(torch.int32)  # [S_q, H_kv=1, K]
    lengths = torch.tensor([min(i + 1, 2) for i in range(s)], dtype=torch.int32)
    return draw_masks(
        {
            "dense causal": causal_mask(s, s),
            "sparse top-4 (-1 padded)": indices_to_mask(idx, s)[:, 0],
            "same, topk_length = 2": indices_to_mask(idx, s, lengths)[:, 0],
        }
    )


def window_figure():
    return draw_masks(
        {
            "causal (S = 12)": causal_mask(12, 12),
            "window W = 4, prefill": window_mask(12, 12, 4),
            "W = 4, MTP decode (3 queries)": window_mask(3, 12, 4),
        }
    )


def layer_kinds_figure():
    s, w = 16, 4
    c4 = torch.cat([compressed_mask(s, s, 4), window_mask(s, s, w)], dim=1)
    # c128a: the last 8 queries of a 1030-token request; 8 compressed entries, then the last 16 raw keys
    c128 = torch.cat([compressed_mask(8, 1030, 128), window_mask(8, 1030, w)[:, -16:]], dim=1)
    return draw_masks(
        {
            "swaonly (r = 1): window only": window_mask(s, s, w),
            "c4a (r = 4): 4 compressed | 16 raw\n(indexer picks top-k of the left part)": c4,
            "c128a (r = 128): 8 compressed | last 16 raw\n(queries at 1022..1029)": c128,
        },
        xlabel="compressed entries | raw keys",
    )


if __name__ == "__main__":
    for name, make in [
        ("sparse_masks", sparse_figure),
        ("window_masks", window_figure),
        ("v4_layer_kinds", layer_kinds_figure),
    ]:
        fig = make()
        fig.savefig(OUT / f"{name}.png", dpi=110)
        print("wrote", OUT / f"{name}.png")
