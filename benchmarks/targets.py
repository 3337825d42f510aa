"""Issue 18's speed targets judged from one run's rows: which are met, at which shapes, and what a plain read allows.

``benchmarks/suite.py`` appends this section to every ``bench.md`` it writes, from the same rows; for a page
written before, from its ``bench.json``::

    python benchmarks/targets.py docs/bench/bench.json          # prints the section

Each target names its rows (kernel, provider, shapes) and a bound on one of their figures: the speed against the
run's own reference (``ratio``, FlashMLA or DeepGEMM measured in the same process) or the bandwidth against the copy
rate the run measured first. Where the target is a time the decode must beat, the ``read`` row beside it (a plain
streaming read of the same cache, ``benchmarks/stream.py``) says whether any kernel that reads the cache once could:
such a shape is marked ``read misses too``. A target none of whose rows the run has is left out.

Importing this module runs nothing.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from common import REFERENCE, Row, add_ratios, shape_str

LONG = (65536, 131072)  # the small-batch targets' contexts


@dataclass(frozen=True)
class Target:
    """``name``: rows of ``kernel`` by ``provider`` whose shape passes ``where``, each meeting ``figure >= bound``
    (``figure``: ``"ratio"``, ``"tbps"`` or ``"copy"``, the fraction of the measured copy rate)."""

    name: str
    kernel: str
    provider: str
    where: dict  # shape key -> the values it may take
    figure: str
    bound: float


TARGETS = (
    Target("16 heads >= 2x FlashMLA, B <= 2, 64K-128K", "decode", "triton", {"H": [16], "B": [1, 2], "S_kv": LONG},
           "ratio", 2.0),
    Target("the same at >= 2.5 TB/s", "decode", "triton", {"H": [16], "B": [1, 2], "S_kv": LONG}, "tbps", 2.5),
    Target("128 heads >= 1.2x FlashMLA, B <= 2, 64K-128K", "decode", "triton", {"H": [128], "B": [1, 2], "S_kv": LONG},
           "ratio", 1.2),
    Target("the same under a lasting load", "decode_sustained", "triton", {"H": [128], "B": [1, 2], "S_kv": LONG},
           "ratio", 1.2),
    Target(">= 85% of the copy rate at every memory-bound decode shape (16 heads)", "decode", "triton", {"H": [16]},
           "copy", 0.85),
    Target("stretch: 128 heads, B64-128, >= 0.8x FlashMLA", "decode", "triton", {"H": [128], "B": [64, 128]}, "ratio",
           0.8),
    Target("stretch: sparse decode >= 0.8x FlashMLA (fp8 cache)", "sparse_decode", "triton-fp8", {}, "ratio", 0.8),
    Target("stretch: indexer logits >= 0.9x DeepGEMM (graph replays)", "indexer_graph", "triton", {}, "ratio", 0.9),
)  # fmt: skip


def _figure(row: Row, figure: str, copy_bw: float) -> float:
    if figure == "ratio":
        return row.ratio
    return row.gbps / 1e3 if figure == "tbps" else row.gbps * 1e9 / copy_bw


def _read_misses(row: Row, target: Target, rows: dict, copy_bw: float) -> bool:
    """Whether the plain read of ``row``'s cache, timed beside it, misses ``target`` too (a time to beat: a ratio
    against the reference's time, or a fraction of the copy rate)."""
    read = rows.get(("read", shape_str(row.shape)))
    if read is None or target.figure == "tbps":
        return False
    if target.figure == "copy":
        return _figure(read, "copy", copy_bw) < target.bound
    reference = rows.get((REFERENCE[target.kernel], shape_str(row.shape)))
    return reference is not None and read.seconds > reference.seconds / target.bound


def judge(target: Target, rows: list[Row], copy_bw: float) -> tuple[str, str]:
    """``(measured, verdict)`` of ``target`` over ``rows`` (ratios set): the lowest and highest figure over its shapes,
    and the shapes that miss it, in the run's order of shapes."""
    mine = [
        r
        for r in rows
        if r.kernel == target.kernel
        and r.provider == target.provider
        and all(r.shape.get(k) in v for k, v in target.where.items())
        and (target.figure != "ratio" or r.ratio is not None)
    ]
    if not mine:
        return "-", "not measured"
    by = {(r.provider, shape_str(r.shape)): r for r in rows if r.kernel == target.kernel}
    mine.sort(key=lambda r: _figure(r, target.figure, copy_bw))

    def show(r: Row) -> str:
        v = _figure(r, target.figure, copy_bw)
        return f"{v:.0%}" if target.figure == "copy" else f"{v:.2f} TB/s" if target.figure == "tbps" else f"{v:.2f}x"

    measured = show(mine[0]) if len(mine) == 1 else f"{show(mine[0])} - {show(mine[-1])} over {len(mine)} shapes"
    missed = [r for r in mine if _figure(r, target.figure, copy_bw) < target.bound]
    if not missed:
        return measured, f"met at all {len(mine)}" if len(mine) > 1 else "met"
    misses = ", ".join(
        f"{shape_str(r.shape)} {show(r)}" + (" (read misses too)" if _read_misses(r, target, by, copy_bw) else "")
        for r in sorted(missed, key=lambda r: list(r.shape.values()))
    )
    return measured, f"missed at {len(missed)} of {len(mine)}: {misses}"


def section(rows: list[Row], copy_bw: float) -> str:
    """The markdown section: a line per target the run has rows for, judged over ``rows`` with the run's measured
    ``copy_bw`` (B/s); empty where it has none (a page of other kernels)."""
    rows = add_ratios(rows)
    judged = [(t, *judge(t, rows, copy_bw)) for t in TARGETS]
    judged = [(t, measured, verdict) for t, measured, verdict in judged if verdict != "not measured"]
    if not judged:
        return ""
    lines = [
        "## Issue 18's targets in this run",
        "",
        f"Judged by `benchmarks/targets.py` from the rows above, against this run's copy rate ({copy_bw / 1e9:.0f}"
        " GB/s); `read misses too`: the plain read of that cache, timed beside it, misses the target as well.",
        "",
        "| target | measured | verdict |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {target.name} | {measured} | {verdict} |" for target, measured, verdict in judged]
    return "\n".join(lines) + "\n"


def load(path: str) -> tuple[list[Row], float]:
    """A ``bench.json``'s rows and its measured copy rate (B/s)."""
    with open(path) as f:
        data = json.load(f)
    fields = ("kernel", "provider", "shape", "seconds", "bytes", "flops", "timer")
    rows = [Row(**{k: r[k] for k in fields if k in r}) for r in data["rows"]]
    return rows, data["environment"]["roofline"]["copy_bw"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python benchmarks/targets.py BENCH_JSON", file=sys.stderr)
        return 2
    print(section(*load(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
