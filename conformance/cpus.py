"""The CPUs this process may use, which on a shared or containerised machine is fewer than ``os.cpu_count()``.

``os.cpu_count()`` counts the host's CPUs. A process pinned to some of them (``taskset``, a cpuset cgroup) or
throttled by a CPU quota (cgroup v2 ``cpu.max``: a container's ``--cpus``, a Kubernetes CPU limit, as CI runners
often are) gets fewer, and thread pools and warm-up processes sized from the host's count oversubscribe them. (GNU
``nproc`` is no guide here: it also honours ``OMP_NUM_THREADS``.)

The processes of one ``mlaspec check`` divide those CPUs between them rather than each taking all: torch's pool of
intra-op threads defaults to every CPU in every process, and OpenMP threads that outnumber the cores spin at each
parallel region's barrier on cores another process needs. The parent (references, budgets, the judge) takes
:func:`parent_threads`, the judged worker (or a DCP group's ranks together) :func:`worker_threads`, each warm-up
process :data:`WARM_UP_THREADS` (:mod:`~mlaspec.conformance.warmup`; by default all the CPUs but one, at most 15,
while kernels compile: a cold run oversubscribes the CPUs, measured faster than half of them,
:func:`mlaspec.conformance.cli.warm_count`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["USER_THREADS", "WARM_UP_THREADS", "parent_share", "parent_threads", "usable_cpus", "worker_threads"]


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The CPUs this process may run on (its affinity where the OS has one, else ``os.cpu_count()``), capped by
    the cgroup v2 quota in ``cgroup`` (``"<quota> <period>"`` microseconds, or ``"max <period>"``: none); at least 1."""
    if hasattr(os, "sched_getaffinity"):
        cpus = len(os.sched_getaffinity(0))
    else:  # pragma: no cover - macOS, Windows
        cpus = os.cpu_count() or 1
    try:
        quota, period = cgroup.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):  # no cgroup v2 here, or a line we do not know
        pass
    return max(1, cpus)


def parent_threads(cpus: int | None = None, runs: int = 1) -> int:
    """The torch threads of the run's own process while a judged worker or a DCP group's ranks run beside it: half
    of ``cpus`` (default :func:`usable_cpus`) over the ``runs`` that share them (pytest-xdist's workers), at least 1.
    Measured against torch's default of every CPU in ``docs/conformance.md`` (the run's processes)."""
    n = usable_cpus() if cpus is None else cpus
    return max(1, n // (2 * runs))


def worker_threads(cpus: int | None = None, workers: int = 1) -> int:
    """The torch threads of each of ``workers`` processes that run the backend (the judged worker, or a DCP group's
    ranks): together a quarter of ``cpus`` (default :func:`usable_cpus`), each 1 to 4. They build the inputs and
    check the input contract, while the float64 references are the parent's."""
    n = usable_cpus() if cpus is None else cpus
    return max(1, min(4, n // (4 * workers)))


#: a warm-up process's torch threads: it only compiles ahead, the parent's references and the judged worker come first
WARM_UP_THREADS = 1

#: what a user sets to choose the threads; where either is set, the parent keeps torch's threads as they are
USER_THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@contextmanager
def parent_share(runs: int = 1) -> Iterator[int]:
    """This process's torch threads set to :func:`parent_threads` (``runs``: its argument) for the ``with`` block,
    then back to what they were; kept as they are where the user set :data:`USER_THREADS`. Yields the threads."""
    import torch

    before = torch.get_num_threads()
    if not any(os.environ.get(v) for v in USER_THREADS):
        torch.set_num_threads(parent_threads(runs=runs))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
