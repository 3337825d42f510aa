"""Regenerate the sharding figure of docs/dcp.md.

Run from the repository root: ``python docs/img/make_dcp.py``.
"""

from pathlib import Path

from mlaspec.conformance.viz.dcp import draw_dcp_sharding

OUT = Path(__file__).parent

if __name__ == "__main__":
    draw_dcp_sharding(40, 4, [1, 2, 8]).savefig(OUT / "dcp_sharding.png", dpi=110)
    print("wrote", OUT / "dcp_sharding.png")
