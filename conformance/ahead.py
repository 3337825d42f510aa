"""References ahead: a second process computes the run's float64 references backwards from its last case, into the
disk cache, while the run computes them forwards from its first.

On the CPU the references and the budgets are the run's own work, on the run's share of the cores
(:func:`~mlaspec.conformance.cpus.parent_threads`: one of 2). Cold, that share is the run's path: the default run's
process spent 9.0 of its 10.6 s of cases computing the 336 references, while the judged worker, beside it on the
other core, built its inputs and called the backend in 6.1 s and waited for the rest (traced on a 2-core host,
2026-11-30). :class:`Ahead` forks the run's process (torch and the ops already imported: it computes at once), and
the fork takes only what the run's process and the worker leave of the CPUs (Linux's ``SCHED_IDLE``: any other task
that wakes takes its core at once; ``nice 19`` kept them 10-25% slower, and a new interpreter spent the first 2.5 s
of its share importing torch). From the last case backwards it computes each reference that the cache does not hold
(:func:`~mlaspec.conformance.references.compute`, the run's own function, under the numerics the backend declares),
stores it (:class:`~mlaspec.conformance.references.ReferenceCache`, where the run's process finds it) and stops
where the run's process has come (:meth:`Ahead.reached`). They meet in the middle; a case both begin is computed
twice, stored twice, and the same. The default run, cold, on a 2-core host: 12.7 s against 14.4 s without it (the
mean of five runs each, alternated, 2026-11-30).

A verdict never depends on it: the run's process reads a reference from the cache exactly as it reads one a run
before stored (the key checked, a file that cannot be read recomputed), and computes any the fork did not reach; the
fork only adds files to the cache (a temporary file renamed into place), and one that dies takes nothing with it. It
is started only where it helps (:func:`wanted`): references on the CPU, a cache to put them in, two or more CPUs,
``fork`` and ``SCHED_IDLE`` (Linux), and at least :data:`MIN_MISSING` references the cache lacks.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import signal
import struct
import time

from .cases import Case
from .references import ReferenceCache, cache_key
from .trace import trace

__all__ = ["MIN_MISSING", "Ahead", "missing", "start_ahead", "wanted"]

MIN_MISSING = 64
"""The fewest references the cache must lack for :class:`Ahead` to start (a fork of a run's ~0.5 GB process, and
the cache's files looked up; a tiny case's reference takes ~27 ms on a 2-core host, a full-scale one seconds)."""


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

Items = list[tuple[Case, "tuple[str, ...] | None"]]
"""The run's cases in its order, each with the numerics it is judged under (None: a case that needs no reference, one
the backend skips)."""


def missing(items: Items, *, scale: str, cache: ReferenceCache) -> int:
    """How many of ``items`` have no reference in ``cache`` computed on the CPU (an op the harness does not ship
    counts as held: this process cannot compute it)."""
    import torch

    from .ops import OPS

    cpu = torch.device("cpu")
    return sum(
        n is not None
        and c.op in OPS
        and not cache.path(cache_key(c, scale=scale, numerics=n, device=cpu, op=OPS[c.op])).exists()
        for c, n in items
    )


def wanted(items: Items, *, scale: str, cache: ReferenceCache | None, device) -> bool:
    """Whether :class:`Ahead` would help a run of ``items`` whose references are computed on ``device``: a CPU
    reference device, a ``cache``, two or more usable CPUs, ``fork`` and ``SCHED_IDLE``, and at least
    :data:`MIN_MISSING` references missing."""
    from .cpus import usable_cpus

    if cache is None or device.type != "cpu" or usable_cpus() < 2:
        return False
    if not hasattr(os, "fork") or not hasattr(os, "sched_setscheduler"):
        return False
    return missing(items, scale=scale, cache=cache) >= MIN_MISSING


def start_ahead(
    backend: object,
    cases: list[Case],
    *,
    scale: str,
    strict_numerics: bool,
    cache: ReferenceCache | None,
    reference_device: str = "auto",
) -> Ahead | None:
    """The fork computing the references of ``cases`` (a run's, in its order) on ``backend``, started where it helps
    (:func:`wanted`; the cases the backend runs, with the numerics it declares, or none under ``strict_numerics``;
    ``reference_device``: :func:`~mlaspec.conformance.references.reference_device`'s option), else None."""
    from .numerics import declared
    from .references import reference_device as resolve

    def numerics(c: Case) -> tuple[str, ...] | None:  # None: a case the backend skips or errs on, no reference
        if c.op not in getattr(backend, "ops", ()) or c.dtype not in getattr(backend, "dtypes", ()):
            return None
        try:
            return () if strict_numerics else declared(backend, c.op)
        except ValueError:  # unknown numerics
            return None

    items = [(c, numerics(c)) for c in cases]
    device = resolve(reference_device, backend)
    if getattr(backend, "unavailable", None) or not wanted(items, scale=scale, cache=cache, device=device):
        return None
    return Ahead(items, scale=scale, cache=cache)


class Ahead:
    """The process computing the references of ``items`` (:data:`Items`) at ``scale`` into ``cache``, from the last
    backwards: a fork of this process (so it starts at once, with torch and the ops imported; Linux and the like,
    :func:`wanted`); ``reached``: the index of the case the run is at. Call :meth:`reached` with each case's index as
    the run takes it, :meth:`stop` at the end (or use it as a context manager)."""

    def __init__(self, items: Items, *, scale: str, cache: ReferenceCache, reached: int = 0):
        self.cache = cache
        self._shared = mmap.mmap(-1, 16)  # [reached, computed], int64, shared with the fork
        self.reached(reached)
        run = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the fork: tested through the parent (tests/test_ahead.py)
            code = 0
            try:
                _compute(items, scale, cache, self._shared, run)
            except BaseException:
                code = 1
            os._exit(code)  # none of the run's own exit handlers, flushes or sockets

    def reached(self, i: int) -> None:
        """The run's process takes case ``i``: the fork computes none at or before it."""
        self._shared[:8] = struct.pack("q", i)

    @property
    def computed(self) -> int:
        """How many references the fork has stored."""
        return struct.unpack("q", self._shared[8:])[0]

    def stop(self) -> None:
        """End the fork, and remove the temporary file of a reference it was storing (none is half-stored: a file
        is renamed into place whole)."""
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            for tmp in self.cache.root.glob(f"*/.tmp-{self.pid}-*"):
                tmp.unlink(missing_ok=True)
            self.pid = 0

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _compute(items: Items, scale: str, cache: ReferenceCache, shared: mmap.mmap, run: int) -> None:
    """The fork's work: the references of ``items`` from the last backwards, skipping those ``cache`` holds, until
    the run (pid ``run``) has reached the next one (``shared[0]``) or is gone."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # what the run and its worker leave of the CPUs
    with contextlib.suppress(Exception):  # Linux: killed with the run (else it ends at its next case, below)
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    import torch

    from .ops import DTYPES, OPS, unit_roundoff
    from .references import compute

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    for i in reversed(range(len(items))):
        if os.getppid() != run or i <= struct.unpack("q", shared[:8])[0]:
            return  # the run is gone, or there already
        case, numerics = items[i]
        op = OPS.get(case.op)
        if op is None or numerics is None:
            continue  # a case the backend skips, or an op a backend's module registers (the run computes it)
        key = cache_key(case, scale=scale, numerics=numerics, device=cpu, op=op)
        if cache.path(key).exists():
            continue
        start = time.perf_counter()
        try:
            ref, bounds = compute(op, op.make_inputs(case), unit_roundoff(DTYPES[case.dtype]), numerics, cpu)
        except Exception:  # the run's process computes it and gives the case its verdict
            continue
        cache.store(key, ref, bounds)
        shared[8:] = struct.pack("q", struct.unpack("q", shared[8:])[0] + 1)
        trace("ahead", case.id, f"{time.perf_counter() - start:.4f}")
