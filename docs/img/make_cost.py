"""Regenerate the cost-model figures of docs/two_forms.md: ``python docs/img/make_cost.py``."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from mlaspec.conformance.viz.cost import draw_cost_crossover, draw_cost_winner_map

HERE = Path(__file__).parent


def main() -> None:
    draw_cost_crossover((1024, 8192, 65536)).savefig(HERE / "cost_crossover.png", dpi=110)
    draw_cost_winner_map().savefig(HERE / "cost_winner_map.png", dpi=110)


if __name__ == "__main__":
    main()
