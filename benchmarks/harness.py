"""The harness's own speed: ``mlaspec check`` timed end to end, cold and warm, on one backend and scale.

*Cold* starts from an empty reference cache (``MLASPEC_CACHE_DIR``, :mod:`mlaspec.conformance.references`) and an
empty Triton compile cache (``TRITON_CACHE_DIR``): every reference, budget and kernel is computed or compiled. *Warm*
runs the same command again over both caches, as a kernel author's second run in CI does. Each run is a fresh
``python -m mlaspec.conformance.cli check`` process (the backend in its worker, as by default); the table gives its
wall seconds, the CPU seconds (user + system) of it and its children (the worker), the judged worker's backend
seconds, each part of the judged cases summed from the run's trace (:data:`mlaspec.conformance.trace.PARTS`), and the
verdicts, which must be the same cold and warm.

Goals (issue 18): the full-scale Triton run on an H200 in <= 90 s cold and <= 60 s warm; the default CPU run
(``mlaspec check``: the ``torch`` backend, tiny) in <= 15 s on 2 cores. On a shared machine the wall time depends on
the neighbours: the CPU seconds are the steadier figure.

    python benchmarks/harness.py --out-dir docs/bench                 # triton, full on a GPU; else torch, tiny
    python benchmarks/harness.py --backend torch --scale tiny --out-dir /tmp/bench
    python benchmarks/harness.py --warm 0,auto --out-dir docs/bench  # also without warm-ups (default: auto)
    python benchmarks/harness.py --against /tmp/0f559be --runs 2 --out-dir /tmp/bench  # and another commit's tree

``--against PATH``: a second tree of the package (``mkdir -p PATH && git archive REV spec impl conformance | tar -x
-C PATH``; its folder's name labels its runs), timed in the same runs, each from fresh caches of its own, the two
trees' runs of a phase back to back in an order that alternates (this tree first in run 0's cold phase, second in
its warm phase, and so on), so that with ``--runs 2`` each goes first as often: what separates a host from a change
in the code, which two leases cannot (the harness page's times moved 10-25% between leases a day apart).

Writes ``harness.md`` (environment, command, table) and ``harness.png`` (wall and CPU seconds, cold and warm) under
``--out-dir``. Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from common import _pyplot, _save

from mlaspec.conformance.cli import WARM_AUTO
from mlaspec.conformance.cpus import usable_cpus
from mlaspec.conformance.report import read_jsonl
from mlaspec.conformance.trace import PARTS, TRACE, part_seconds

#: (backend, scale) -> (cold, warm) wall-second goals of issue 18
GOALS = {("triton", "full"): (90.0, 60.0), ("torch", "tiny"): (15.0, 15.0)}


@dataclass
class Run:
    """One timed ``mlaspec check``: ``phase`` (cold / warm), wall and CPU seconds, exit status, the counts line."""

    phase: str
    workers: int | str  # mlaspec check --warm: warm-up workers beside the judged one, or "auto"
    wall: float
    cpu: float
    status: int
    counts: str
    backend: float  # seconds of the judged worker's backend calls, summed over cases (cold: what it compiled)
    code: str = ""  # which tree ran (--against): "" where only this one is timed
    parts: dict[str, float] = field(default_factory=dict)  # each part of the judged cases (trace.PARTS), summed


def time_check(
    check_args: list[str], report: str, env: dict, phase: str, workers: int | str = 0, code: str = ""
) -> Run:
    """Run ``mlaspec check check_args --report report`` in a fresh process under ``env``; its wall and CPU (user +
    system, with its children) seconds, its cases' backend seconds from ``report/results.jsonl``, and each part of
    its judged cases summed from its trace (``report.trace``, :mod:`mlaspec.conformance.trace`; where ``env`` names
    no trace of its own). ``code``: the label of the tree ``env`` imports (:func:`measure`)."""
    shutil.rmtree(report, ignore_errors=True)  # a run that writes no results must not report another's
    trace = env.get(TRACE) or f"{report}.trace"
    if TRACE not in env and os.path.exists(trace):
        os.remove(trace)  # the last run's, under the same report folder
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlaspec.conformance.cli",
            "check",
            *check_args,
            "--report",
            report,
            "--warm",
            str(workers),
        ],
        env=env | {TRACE: trace},
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    counts = re.findall(r"^\d+ passed.*$", proc.stdout, re.MULTILINE)
    if proc.returncode not in (0, 1):
        print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
    try:
        backend = sum(r.get("seconds", 0.0) for r in read_jsonl(os.path.join(report, "results.jsonl"))[1])
    except OSError:
        backend = float("nan")
    try:
        parts = {p: sum(by_case.values()) for p, by_case in part_seconds(trace).items()}
    except OSError:  # nothing traced: the run ended before its first case
        parts = {}
    summary = counts[-1] if counts else "(no summary)"
    return Run(phase, workers, wall, cpu, proc.returncode, summary, backend, code, parts)


SUBPACKAGES = ("spec", "impl", "conformance")  # mlaspec.<name> = <tree>/<name>


def package_path(tree: str, folder: str) -> str:
    """A folder to put first on ``PYTHONPATH`` so that ``import mlaspec`` imports ``tree`` (a checkout, or its
    :data:`SUBPACKAGES` unpacked): ``folder/mlaspec/<name>`` links to ``tree/<name>``, as the package's
    ``package-dir`` maps them (a path entry comes before an editable install's finder)."""
    missing = [name for name in SUBPACKAGES if not os.path.isdir(os.path.join(tree, name))]
    if missing:
        raise ValueError(f"--against {tree!r} is not a tree of mlaspec: it has no {', '.join(missing)}")
    os.makedirs(os.path.join(folder, "mlaspec"), exist_ok=True)
    for name in SUBPACKAGES:
        os.symlink(os.path.abspath(os.path.join(tree, name)), os.path.join(folder, "mlaspec", name))
    return folder


def trees(against: str | None, folder: str) -> list[tuple[str, dict]]:
    """The trees to time, each with its label and the environment that imports it: this checkout alone (label
    ``""``), or, with ``against``, ``this tree`` and the tree ``against`` (labelled with its folder's name, its
    :func:`package_path` made under ``folder``, first on a ``PYTHONPATH`` that keeps what was there)."""
    if not against:
        return [("", dict(os.environ))]
    path = package_path(against, os.path.join(folder, "against"))
    other = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))}
    return [("this tree", dict(os.environ)), (os.path.basename(os.path.abspath(against)), other)]


def in_turn(items: list, i: int) -> list:
    """``items`` in order in round ``i`` when it is even, reversed when odd: who goes first alternates, so that over
    two rounds each goes first as often."""
    return items if i % 2 == 0 else items[::-1]


def cold_caches(folder: str) -> dict:
    """The environment of a run whose reference and Triton caches live (fresh: cold) under ``folder`` (also
    ``warm_timeline.py``'s)."""
    return {"MLASPEC_CACHE_DIR": os.path.join(folder, "mlaspec"), "TRITON_CACHE_DIR": os.path.join(folder, "triton")}


def measure(
    backend: str,
    scale: str,
    dtypes: str,
    runs: int,
    warm: tuple[int | str, ...] = (0,),
    against: str | None = None,
):
    """``runs`` cold and ``runs`` warm runs of ``mlaspec check --backend backend --scale scale``, for each number
    of warm-up workers in ``warm``, each pair from fresh caches; yields each :class:`Run` as it ends. ``against``:
    a second tree of the package (:func:`package_path`), its runs labelled with its folder's name, each right after
    this tree's of the same phase or right before them, alternately (this tree's labelled ``this tree``), from
    caches of its own."""
    with tempfile.TemporaryDirectory(prefix="mlaspec-harness-") as tmp:
        args, report = ["--backend", backend, "--scale", scale, "--dtypes", dtypes], os.path.join(tmp, "report")
        labelled = trees(against, tmp)
        for i in range(runs):
            for workers in warm:
                envs = []  # each tree's environment over fresh caches: its cold run is cold
                for t, (code, base) in enumerate(labelled):
                    envs.append((code, base | cold_caches(os.path.join(tmp, f"caches-{i}-{workers}-{t}"))))
                for p, phase in enumerate(("cold", "warm")):
                    for code, env in in_turn(envs, i + p):
                        run = time_check(args, report, env, phase, workers, code)
                        print(f"{phase}: {run}", flush=True)
                        yield run


def environment() -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": usable_cpus(),  # what the run may use, not the host's count
        "cpu": platform.processor() or platform.machine(),
    }
    if os.environ.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def markdown(runs: list[Run], backend: str, scale: str, env: dict, command: str) -> str:
    cold, warm = GOALS.get((backend, scale), (None, None))
    goal = {"cold": cold, "warm": warm}
    lines = [
        f"# The harness's own speed: `mlaspec check --backend {backend} --scale {scale}`",
        "",
        ", ".join(f"{k} {v}" for k, v in env.items()) + f"; `{command}`",
        "",
        "Cold: empty reference and Triton caches; warm: the same command again over both. CPU seconds are user + "
        "system of the run and its worker processes; `--warm` is the number of warm-up workers "
        "(`mlaspec check --warm N`: processes that run the cases ahead of the judged one, so that kernels compile "
        f"in parallel; `auto`, the default: on a GPU all the CPUs but one, at most {WARM_AUTO}, started at once over "
        "an empty Triton cache, else at the first judged call that compiles). Backend s: the judged worker's calls "
        "of the backend, summed over the cases "
        "(their first calls compile, where no warm-up process got there first). Parts: the judged cases' "
        f"{', '.join(PARTS)}, each summed over the cases (`mlaspec.conformance.trace`; the worker builds a case's "
        "inputs and calls the backend while the run's process gets its reference, then waits, then judges).",
        "",
        "![wall and CPU seconds](harness.png)",
        "",
    ]
    coded = any(r.code for r in runs)  # --against: a column for the tree each run imported
    lines.append(
        "| " + "code | " * coded + "phase | --warm | wall s | CPU s | backend s | parts s: " + " / ".join(PARTS) + " | "
        "goal (wall s) | verdicts | exit |"
    )
    lines.append("|" + "---|" * coded + "---|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in runs:
        target = goal[r.phase]
        mark = "" if target is None else (f"<= {target:g} " + ("met" if r.wall <= target else "missed"))
        parts = " / ".join(f"{r.parts[p]:.1f}" for p in PARTS) if r.parts else "-"
        row = f"| {r.phase} | {r.workers} | {r.wall:.1f} | {r.cpu:.1f} | {r.backend:.1f} | {parts} | {mark} "
        row += f"| {r.counts} | {r.status} |"
        lines.append(f"| {r.code} " * coded + row)
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], path: str, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(runs)), 3.8))
    names = ["\n".join(filter(None, [r.code, r.phase, f"--warm {r.workers}" if r.workers else ""])) for r in runs]
    labels = [f"{n} {names[: i + 1].count(n)}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [r.wall for r in runs], 0.4, label="wall s")
    ax.bar([i + 0.2 for i in x], [r.cpu for r in runs], 0.4, label="CPU s (user + system)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("seconds, lower is better")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    _save(fig, path, plt)


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="triton" if gpu else "torch")
    ap.add_argument("--scale", default="full" if gpu else "tiny", choices=["tiny", "full"])
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--runs", type=int, default=1, help="cold + warm pairs, each pair from fresh caches")
    ap.add_argument(
        "--warm",
        default="auto",
        help="comma-separated warm-up worker counts or auto, each timed (default: auto, as mlaspec check runs)",
    )
    ap.add_argument("--against", help="a second tree of the package (spec/, impl/, conformance/), timed alongside")
    ap.add_argument("--out-dir", default="bench")
    args = ap.parse_args(argv)
    command = " ".join(["python", *sys.argv]) if argv is None else f"main({argv})"
    env = environment()
    title = f"mlaspec check --backend {args.backend} --scale {args.scale} on {env.get('gpu', env['cpu'])}"
    os.makedirs(args.out_dir, exist_ok=True)
    runs: list[Run] = []
    for run in measure(
        args.backend,
        args.scale,
        args.dtypes,
        args.runs,
        tuple(n if n == "auto" else int(n) for n in args.warm.split(",")),
        args.against,
    ):
        runs.append(run)  # the page and the plot after every run: a run cut short still leaves what it measured
        text = markdown(runs, args.backend, args.scale, env, command)
        with open(os.path.join(args.out_dir, "harness.md"), "w") as f:
            f.write(text)
        plot(runs, os.path.join(args.out_dir, "harness.png"), title)
    print(markdown(runs, args.backend, args.scale, env, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
