"""Where the warm-up processes were when the judged worker compiled: a cold run's timeline, drawn from its trace.

``mlaspec check --warm`` (:mod:`mlaspec.conformance.warmup`) runs the cases ahead of the judged worker so that a JIT
backend's kernels compile in parallel; the cold run is fast when they stay ahead. This script runs one cold
``mlaspec check`` (fresh reference and Triton caches) with :data:`~mlaspec.conformance.trace.TRACE` set, then
draws each warm-up's cases (a bar from its ``begin`` to its ``end``, one colour a process), the judged worker's
position (the case it takes, against time), the cases whose judged call took :data:`SLOW` seconds or more (it
compiled them itself, or waited for a kernel) and the keepers' kills, and prints the same in numbers, with the
judged worker's pace while the warm-ups ran and after, and each judged case's parts (:data:`PARTS`) summed over
both. From an existing trace (``--trace``, with the run's ``results.jsonl`` and its start), it only draws. With
``--against`` (a second tree, as ``benchmarks/harness.py --against`` takes it) and ``--runs``, it runs both trees in
turn, the one that goes first alternating, and sets their runs side by side: what a change to the warm-ups does to
each part of the judged worker's cases, which the harness's wall seconds alone do not say.

    python benchmarks/warm_timeline.py --out-dir /tmp/tl                  # triton, full, on a GPU
    python benchmarks/warm_timeline.py --trace trace.txt --results results.jsonl --t0 1795929629.97 --out-dir /tmp/tl
    python benchmarks/warm_timeline.py --against /tmp/d797df3 --runs 2 --out-dir /tmp/tl  # two trees, in turn

Writes ``warm_timeline.png`` and ``warm_timeline.md`` under ``--out-dir``. Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass

from common import _pyplot, _save

from mlaspec.conformance.trace import CASE_EVENTS, PARTS, part_seconds

SLOW = 0.5
"""Seconds of a judged call drawn and listed as slow: it compiled, or waited on a kernel another process was compiling
(a compiled full-scale call takes milliseconds; a small kernel compiles in under a second, so this is below
:data:`mlaspec.conformance.warmup.COMPILING`, the 1 s that starts lazy warm-ups)."""


@dataclass
class Timeline:
    """A traced run, in seconds from its start: the judged worker's case starts, each warm-up's case spans, the
    keepers' spawns and kills, the halts (every process stopped), when each process was up, and the judged calls'
    seconds by case."""

    reached: dict[int, float]  # case -> when the judged worker took it
    spans: dict[int, list[tuple[int, float, float]]]  # process -> (case, begin, end: nan where left unfinished)
    cut: dict[tuple[int, int, float], float]  # (process, case, begin) of an unfinished case -> when it was cut off
    spawns: list[tuple[float, int]]  # (when, process)
    kills: list[tuple[float, int]]
    halts: list[float]
    ups: list[tuple[float, int]]
    seconds: list[float]  # the judged call's seconds, by case
    ids: list[str]
    parts: dict[str, dict[int, float]]  # a part of each judged case (PARTS) -> case -> seconds

    def slow(self) -> list[int]:
        """The cases whose judged call took :data:`SLOW` seconds or more."""
        return [i for i, s in enumerate(self.seconds) if s >= SLOW]

    def beside(self, case: int) -> list[tuple[int, float, float]]:
        """The warm-up processes that ran ``case``: ``(process, begin, end)`` (``end`` nan: it never ended)."""
        return [(k, b, e) for k, spans in self.spans.items() for c, b, e in spans if c == case]


def read(trace: str, results: list[dict], t0: float) -> Timeline:
    """The :class:`Timeline` of a run that started at ``t0`` (unix seconds) from its trace file and its results'
    records (``results.jsonl`` after its header, in case order)."""
    reached, spawns, kills, halts, ups = {}, [], [], [], []
    begun: dict[int, tuple[int, float]] = {}  # process -> the case it is on, since when
    spans: dict[int, list] = defaultdict(list)
    cut: dict[tuple[int, int, float], float] = {}
    t = 0.0

    def unended(k: int) -> None:  # process k left its case unfinished at t (killed, halted, started again, run over)
        if k in begun:
            case, b = begun.pop(k)
            spans[k].append((case, b, float("nan")))
            cut[k, case, b] = t

    index = {r["case_id"]: i for i, r in enumerate(results)}
    parts = {p: {index[c]: t for c, t in by_id.items() if c in index} for p, by_id in part_seconds(trace).items()}
    with open(trace) as f:
        for line in f:
            t, event, *fields = line.split()
            if event in CASE_EVENTS:  # by a case's id: a judged case's part (part_seconds's), or work done ahead
                continue
            t, fields = float(t) - t0, [int(x) for x in fields]
            if event == "reached":
                reached.setdefault(fields[0], t)
            elif event == "spawn":
                unended(fields[0])
                spawns.append((t, fields[0]))
            elif event == "kill":
                unended(fields[0])
                kills.append((t, fields[0]))
            elif event == "halt":
                for k in list(begun):
                    unended(k)
                halts.append(t)
            elif event == "up":
                ups.append((t, fields[0]))
            elif event == "begin":
                unended(fields[0])
                begun[fields[0]] = (fields[1], t)
            elif event == "end" and begun.get(fields[0], (None,))[0] == fields[1]:
                spans[fields[0]].append((fields[1], begun.pop(fields[0])[1], t))
    for k in list(begun):
        unended(k)
    seconds = [r.get("seconds", 0.0) for r in results]
    ids = [r["case_id"] for r in results]
    return Timeline(reached, dict(spans), cut, spawns, kills, halts, ups, seconds, ids, parts)


@dataclass
class Pace:
    """The judged worker's cases (their count, the seconds from each one's start to the next's, and its backend
    calls' seconds) over one stretch of a :class:`Timeline`, with each part of them (:data:`PARTS`) summed."""

    cases: int
    seconds: float
    calls: float
    parts: dict[str, float]


def last_warm_up(tl: Timeline) -> float:
    """When the warm-ups' last finished case ended (nan where none did)."""
    return max((e for spans in tl.spans.values() for _, _, e in spans if e == e), default=float("nan"))


def pace(tl: Timeline, during: bool) -> Pace:
    """The judged worker's :class:`Pace` while the warm-ups ran (its cases that began before :func:`last_warm_up`), or
    after (``during=False``); a case's time runs to the next case's start, so the last case is in neither."""
    last, steps = last_warm_up(tl), sorted((t, i) for i, t in tl.reached.items())
    cases = [(t1 - t0, i) for (t0, i), (t1, _) in zip(steps, steps[1:]) if (t0 < last) == during]
    parts = {p: sum(tl.parts[p].get(i, 0.0) for _, i in cases) for p in PARTS}
    return Pace(len(cases), sum(w for w, _ in cases), sum(tl.seconds[i] for _, i in cases), parts)


def summary(tl: Timeline) -> list[str]:
    """The timeline in lines of text: when the judged worker started and ended, when the warm-ups were up and done,
    the kills, the judged worker's :func:`pace` while they ran and after, and every slow case (:data:`SLOW`) with
    what the warm-ups did on it."""
    nan = float("nan")
    ups = [t for t, _ in tl.ups]
    lines = [
        f"judged worker: first case at {min(tl.reached.values(), default=nan):.1f} s, last at "
        f"{max(tl.reached.values(), default=nan):.1f} s; its calls {sum(tl.seconds):.1f} s in all",
        f"warm-ups: {len({k for _, k in tl.spawns})} processes, {len(tl.spawns)} starts, {len(tl.kills)} kills; up "
        f"{min(ups, default=nan):.1f}-{max(ups, default=nan):.1f} s; their last case ended at {last_warm_up(tl):.1f} s",
    ]
    for name, during in (("while the warm-ups ran", True), ("after", False)):
        pc = pace(tl, during)
        lines.append(f"judged worker {name}: {pc.cases} cases in {pc.seconds:.1f} s, its calls {pc.calls:.1f} s of it")
        if any(tl.parts[p] for p in PARTS):
            lines.append("  " + ", ".join(f"{p} {t:.1f} s" for p, t in pc.parts.items()))
    slow = tl.slow()
    lines.append(f"cases whose judged call took >= {SLOW} s: {len(slow)}, {sum(tl.seconds[i] for i in slow):.1f} s")
    for i in slow:
        beside = ", ".join(f"warm-up {k} {b:.1f}-{e:.1f} s" for k, b, e in tl.beside(i)) or "no warm-up"
        lines.append(f"  case {i} {tl.ids[i]}: {tl.seconds[i]:.2f} s at {tl.reached.get(i, nan):.1f} s; {beside}")
    return lines


def table(runs: list[tuple[str, float, Timeline]]) -> list[str]:
    """Runs of two trees side by side (``(label, wall seconds, timeline)``): wall, when the warm-ups were done, the
    judged worker's :func:`pace` while they ran and after, with the parts of its cases while they ran."""
    cols = ["code", "wall s", "warm-ups done s", "while they ran: cases, s, calls s", *PARTS]
    cols += ["after: cases, s, calls s", "slow calls"]
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for code, wall, tl in runs:
        during, after, slow = pace(tl, True), pace(tl, False), tl.slow()
        row = [
            code,
            f"{wall:.1f}",
            f"{last_warm_up(tl):.1f}",
            f"{during.cases}, {during.seconds:.1f}, {during.calls:.1f}",
        ]
        row += [f"{t:.1f}" for t in during.parts.values()]
        row += [
            f"{after.cases}, {after.seconds:.1f}, {after.calls:.1f}",
            f"{len(slow)}, {sum(tl.seconds[i] for i in slow):.1f} s",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def plot(tl: Timeline, path: str, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    cmap = plt.get_cmap("tab20")
    for k, spans in sorted(tl.spans.items()):
        for case, b, e in spans:
            if e == e:
                ax.plot([b, e], [case, case], color=cmap(k % 20), lw=3, solid_capstyle="butt")
            else:  # left unfinished: dashed to where it was cut off
                ax.plot([b, tl.cut[k, case, b]], [case, case], color=cmap(k % 20), lw=1.5, ls="--")
    steps = sorted((t, i) for i, t in tl.reached.items())
    ax.step([t for t, _ in steps], [i for _, i in steps], where="post", color="black", lw=1, label="judged worker")
    slow = [i for i in tl.slow() if i in tl.reached]
    ax.scatter(
        [tl.reached[i] for i in slow],
        slow,
        marker="o",
        facecolors="none",
        edgecolors="red",
        label=f"judged call >= {SLOW} s",
        zorder=3,
    )
    for t, k in tl.kills:
        ax.axvline(t, color=cmap(k % 20), ls=":", lw=1)
    ax.plot([], [], color=cmap(0), lw=3, label="a warm-up's case (colour: process)")
    ax.set_xlabel("seconds from the run's start")
    ax.set_ylabel("case")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path, plt)


def run_traced(
    check_args: list[str], folder: str, warm: int | str = "auto", env: dict | None = None
) -> tuple[str, str, float, float]:
    """One cold ``mlaspec check check_args --warm warm`` under ``env`` (default: this process's) with fresh caches
    under ``folder`` and the trace on, timed as the harness times its runs (:func:`harness.time_check`, which prints
    the run's output where it fails): ``(trace path, results path, start, wall seconds)``."""
    from harness import cold_caches, time_check

    from mlaspec.conformance.trace import TRACE

    os.makedirs(folder, exist_ok=True)  # an older tree's trace does not make its folder
    trace, report = os.path.join(folder, "trace.txt"), os.path.join(folder, "report")
    t0 = time.time()
    run = time_check(check_args, report, (env or os.environ) | cold_caches(folder) | {TRACE: trace}, "cold", warm)
    results = os.path.join(report, "results.jsonl")
    if run.status not in (0, 1) or not os.path.exists(results):  # 1: a case failed, still a timeline
        raise RuntimeError(f"mlaspec check {' '.join(check_args)} exited with {run.status} and left no results")
    return trace, results, t0, run.wall


def main(argv: list[str] | None = None) -> int:
    from harness import in_turn, trees

    from mlaspec.conformance.report import read_jsonl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--scale", default="full", choices=["tiny", "full"])
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--warm", default="auto", help="mlaspec check --warm")
    ap.add_argument("--runs", type=int, default=1, help="cold runs of each tree")
    ap.add_argument("--against", help="a second tree of the package (benchmarks/harness.py --against), run in turn")
    ap.add_argument("--trace", help="draw this trace (one run's: a fresh file) instead of running one")
    ap.add_argument("--results", help="with --trace: that run's results.jsonl")
    ap.add_argument("--t0", type=float, help="with --trace: that run's start, unix seconds")
    ap.add_argument("--out-dir", default="bench")
    args = ap.parse_args(argv)
    if args.trace and (args.results is None or args.t0 is None):
        ap.error("--trace needs --results and --t0")
    os.makedirs(args.out_dir, exist_ok=True)
    runs: list[tuple[str, float, Timeline]] = []  # (the tree's label, wall seconds, timeline), in the order run
    with tempfile.TemporaryDirectory(prefix="mlaspec-timeline-") as tmp:
        if args.trace:
            runs.append(("", float("nan"), read(args.trace, read_jsonl(args.results)[1], args.t0)))
        else:
            check = ["--backend", args.backend, "--scale", args.scale, "--dtypes", args.dtypes]
            labelled = trees(args.against, tmp)
            for i in range(args.runs):
                for code, env in in_turn(labelled, i):
                    trace, results, t0, wall = run_traced(check, os.path.join(tmp, str(len(runs))), args.warm, env)
                    runs.append((code, wall, read(trace, read_jsonl(results)[1], t0)))
                    print(f"{code or 'run'} {i}: {wall:.1f} s", flush=True)
    title = f"a cold mlaspec check --backend {args.backend} --scale {args.scale}: warm-ups and the judged worker"
    plot(runs[0][2], os.path.join(args.out_dir, "warm_timeline.png"), title)  # the first run's
    command = " ".join(["python", *sys.argv]) if argv is None else f"main({argv})"
    text = [f"# {title}", "", f"`{command}`" + (f"; {runs[0][1]:.1f} s wall" if len(runs) == 1 else ""), ""]
    text += ["![timeline](warm_timeline.png)", ""]
    if len(runs) > 1:  # the runs side by side, then each one's summary; the figure is the first's
        text += ["The figure is the first run's. Seconds of the judged worker's cases, summed:", "", *table(runs), ""]
    for n, (code, wall, tl) in enumerate(runs):
        if len(runs) > 1:
            text += [f"## {n}: {code or 'run'}, {wall:.1f} s", ""]
        text += ["```", *summary(tl), "```", ""]
    with open(os.path.join(args.out_dir, "warm_timeline.md"), "w") as f:
        f.write("\n".join(text))
    print("\n".join(table(runs) if len(runs) > 1 else summary(runs[0][2])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
