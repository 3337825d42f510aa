"""Where the warm-up processes were when the judged worker compiled: a cold run's timeline, drawn from its trace.

``mlaspec check --warm`` (:mod:`mlaspec.conformance.warmup`) runs the cases ahead of the judged worker so that a JIT
backend's kernels compile in parallel; the cold run is fast when they stay ahead. This script runs one cold
``mlaspec check`` (fresh reference and Triton caches) with :data:`~mlaspec.conformance.trace.TRACE` set, then
draws each warm-up's cases (a bar from its ``begin`` to its ``end``, one colour a process), the judged worker's
position (the case it takes, against time), the cases whose judged call took :data:`SLOW` seconds or more (it
compiled them itself, or waited for a kernel) and the keepers' kills, and prints the same in numbers, with the
judged worker's pace while the warm-ups ran and after, and each judged case's parts (:data:`PHASES`) summed over
both. From an existing trace (``--trace``, with the run's ``results.jsonl`` and its start), it only draws.

    python benchmarks/warm_timeline.py --out-dir /tmp/tl                  # triton, full, on a GPU
    python benchmarks/warm_timeline.py --trace trace.txt --results results.jsonl --t0 1795929629.97 --out-dir /tmp/tl

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

PHASES = ("inputs", "call", "reply", "reference", "wait", "judge")
"""The parts of a judged case the trace times (:mod:`mlaspec.conformance.trace`): in the judged worker its inputs,
the backend's call and the reply; in the run's process the reference, then waiting for the worker, then the judge."""
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
    phases: dict[str, dict[int, float]]  # a part of each judged case (PHASES) -> case -> seconds

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
    phases: dict[str, dict[int, float]] = {p: {} for p in PHASES}
    with open(trace) as f:
        for line in f:
            t, event, *fields = line.split()
            if event in PHASES:  # a judged case's part: its id and seconds
                if fields[0] in index:
                    phases[event][index[fields[0]]] = float(fields[1])
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
    return Timeline(reached, dict(spans), cut, spawns, kills, halts, ups, seconds, ids, phases)


def summary(tl: Timeline) -> list[str]:
    """The timeline in lines of text: when the judged worker started and ended, when the warm-ups were up and done,
    the kills, the judged worker's pace while they ran and after (cases, the seconds from each case's start to the
    next's, and its backend calls' share of them), and every slow case (:data:`SLOW`) with what the warm-ups did on
    it."""
    nan = float("nan")
    last = max((e for spans in tl.spans.values() for _, _, e in spans if e == e), default=nan)
    ups = [t for t, _ in tl.ups]
    lines = [
        f"judged worker: first case at {min(tl.reached.values(), default=nan):.1f} s, last at "
        f"{max(tl.reached.values(), default=nan):.1f} s; its calls {sum(tl.seconds):.1f} s in all",
        f"warm-ups: {len({k for _, k in tl.spawns})} processes, {len(tl.spawns)} starts, {len(tl.kills)} kills; up "
        f"{min(ups, default=nan):.1f}-{max(ups, default=nan):.1f} s; their last case ended at {last:.1f} s",
    ]
    steps = sorted((t, i) for i, t in tl.reached.items())
    for name, during in (("while the warm-ups ran", True), ("after", False)):
        cases = [(t1 - t0, i) for (t0, i), (t1, _) in zip(steps, steps[1:]) if (t0 < last) == during]
        lines.append(
            f"judged worker {name}: {len(cases)} cases in {sum(w for w, _ in cases):.1f} s, its calls "
            f"{sum(tl.seconds[i] for _, i in cases):.1f} s of it"
        )
        parts = [(p, [tl.phases[p][i] for _, i in cases if i in tl.phases[p]]) for p in PHASES]
        if any(times for _, times in parts):
            lines.append("  " + ", ".join(f"{p} {sum(times):.1f} s" for p, times in parts))
    slow = tl.slow()
    lines.append(f"cases whose judged call took >= {SLOW} s: {len(slow)}, {sum(tl.seconds[i] for i in slow):.1f} s")
    for i in slow:
        beside = ", ".join(f"warm-up {k} {b:.1f}-{e:.1f} s" for k, b, e in tl.beside(i)) or "no warm-up"
        lines.append(f"  case {i} {tl.ids[i]}: {tl.seconds[i]:.2f} s at {tl.reached.get(i, nan):.1f} s; {beside}")
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


def run_traced(check_args: list[str], folder: str, warm: int | str = "auto") -> tuple[str, str, float, float]:
    """One cold ``mlaspec check check_args --warm warm`` with fresh caches under ``folder`` and the trace on, timed
    as the harness times its runs (:func:`harness.time_check`, which prints the run's output where it fails):
    ``(trace path, results path, start, wall seconds)``."""
    from harness import cold_caches, time_check

    from mlaspec.conformance.trace import TRACE

    trace, report = os.path.join(folder, "trace.txt"), os.path.join(folder, "report")
    t0 = time.time()
    run = time_check(check_args, report, os.environ | cold_caches(folder) | {TRACE: trace}, "cold", warm)
    results = os.path.join(report, "results.jsonl")
    if run.status not in (0, 1) or not os.path.exists(results):  # 1: a case failed, still a timeline
        raise RuntimeError(f"mlaspec check {' '.join(check_args)} exited with {run.status} and left no results")
    return trace, results, t0, run.wall


def main(argv: list[str] | None = None) -> int:
    from mlaspec.conformance.report import read_jsonl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--scale", default="full", choices=["tiny", "full"])
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--warm", default="auto", help="mlaspec check --warm")
    ap.add_argument("--trace", help="draw this trace (one run's: a fresh file) instead of running one")
    ap.add_argument("--results", help="with --trace: that run's results.jsonl")
    ap.add_argument("--t0", type=float, help="with --trace: that run's start, unix seconds")
    ap.add_argument("--out-dir", default="bench")
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlaspec-timeline-") as tmp:
        if args.trace:
            if args.results is None or args.t0 is None:
                ap.error("--trace needs --results and --t0")
            trace, results, t0, wall = args.trace, args.results, args.t0, float("nan")
        else:
            check = ["--backend", args.backend, "--scale", args.scale, "--dtypes", args.dtypes]
            trace, results, t0, wall = run_traced(check, tmp, args.warm)
        tl = read(trace, read_jsonl(results)[1], t0)
    lines = summary(tl)
    title = f"a cold mlaspec check --backend {args.backend} --scale {args.scale}: warm-ups and the judged worker"
    plot(tl, os.path.join(args.out_dir, "warm_timeline.png"), title)
    text = [f"# {title}", "", f"`{' '.join(['python', *sys.argv])}`" + (f"; {wall:.1f} s wall" if wall == wall else "")]
    text += ["", "![timeline](warm_timeline.png)", "", "```", *lines, "```", ""]
    with open(os.path.join(args.out_dir, "warm_timeline.md"), "w") as f:
        f.write("\n".join(text))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
