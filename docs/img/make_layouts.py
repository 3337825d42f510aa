"""Regenerate the byte diagrams and the page map of docs/paged_cache.md: ``python docs/img/make_layouts.py``."""

from pathlib import Path

import torch

from mlaspec.conformance.viz.layouts import draw_block_table, draw_byte_layout
from mlaspec.spec import cache_layouts

HERE = Path(__file__).parent


def main() -> None:
    for layout in cache_layouts.LAYOUTS.values():
        fig = draw_byte_layout(layout, block_size=4)
        fig.savefig(HERE / f"layout_{layout.name}.png", dpi=110)
    block_table = torch.tensor([[7, 2, 4, 0], [5, 0, 0, 0], [1, 6, 3, 8]])
    fig = draw_block_table(block_table, torch.tensor([11, 3, 14]), 4)
    fig.savefig(HERE / "page_map.png", dpi=110)


if __name__ == "__main__":
    main()
