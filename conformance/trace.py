"""A run's trace: what the run, its judged worker and its warm-up processes do, with the time, in one file.

Set :data:`TRACE` (``MLASPEC_WARM_TRACE``) to a file's path and every process of ``mlaspec check`` appends to it a
line an event, ``<unix seconds> <event> <fields>``; ``benchmarks/warm_timeline.py`` reads and draws it. Unset, nothing
is written. The events:

* the warm-up processes (:mod:`~mlaspec.conformance.warmup`): ``start`` (the set is made: the judged worker has
  loaded the backend), ``spawn K START`` and ``kill K`` (a keeper starts process ``K`` from case ``START``, kills it),
  ``halt`` (all are stopped: a case runs again alone, or the run ends), ``reached I`` (the judged worker takes case
  ``I``), ``up K`` (process ``K`` has loaded the backend), ``begin K I`` and ``end K I`` (it runs case ``I``);
* the judged worker: ``plan N`` (it has the run's ``N`` cases, :class:`~mlaspec.conformance.worker.InputsAhead`;
  again in a worker started after a crash; under pytest-xdist two a test) and ``prebuilt ID`` (it takes the inputs
  of case ``ID`` built ahead on its thread);
* each judged case, by its id, and seconds: in the judged worker ``inputs ID S`` (building the inputs, or waiting
  for those built ahead on its thread), ``call ID S``
  (the backend's call, as the result's ``seconds``) and ``reply ID S`` (the outputs to the CPU and packed); in the
  run's process (:func:`~mlaspec.conformance.runner.run_case`) ``reference ID S`` (the reference and budgets, or
  reading them from the cache), ``wait ID S`` (then waiting for the worker's answer) and ``judge ID S``;
* in the fork that computes references ahead of the run (:mod:`~mlaspec.conformance.ahead`): ``ahead ID S``, a
  reference it stored.
"""

from __future__ import annotations

import os
import time

__all__ = ["CASE_EVENTS", "PARTS", "TRACE", "part_seconds", "timed", "trace"]

TRACE = "MLASPEC_WARM_TRACE"
"""The environment variable naming the trace's file; the processes a run starts inherit it."""
PARTS = ("inputs", "call", "reply", "reference", "wait", "judge")
"""The parts of a judged case the trace times (the module's docstring), in the order they come."""
CASE_EVENTS = (*PARTS, "ahead", "prebuilt")
"""The events whose first field is a case's id (the others' fields are integers)."""


def trace(event: str, *fields: object) -> None:
    """Append ``event`` and its ``fields`` (no whitespace in them) to the file :data:`TRACE` names, if it names one
    (one ``write`` of one line, appended: the processes' lines do not mix), making its folder where there is none."""
    path = os.environ.get(TRACE)
    if path:
        line = " ".join([f"{time.time():.3f}", event, *map(str, fields)]) + "\n"
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:  # a run must not die of its trace's folder
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            fd = os.open(path, flags, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def timed(event: str, key: object, since: float) -> float:
    """:func:`trace` ``event`` of ``key`` (a case's id) with the seconds since ``since`` (``time.perf_counter``);
    returns now, the start of what comes next."""
    now = time.perf_counter()
    trace(event, key, f"{now - since:.4f}")
    return now


def part_seconds(path: str | os.PathLike) -> dict[str, dict[str, float]]:
    """Each of :data:`PARTS` -> case id -> its seconds, read back from the trace at ``path`` (a case timed twice, run
    again alone after its first attempt: the sum)."""
    seconds: dict[str, dict[str, float]] = {p: {} for p in PARTS}
    with open(path) as f:
        for line in f:
            _, event, *fields = line.split()
            if event in seconds:
                seconds[event][fields[0]] = seconds[event].get(fields[0], 0.0) + float(fields[1])
    return seconds
