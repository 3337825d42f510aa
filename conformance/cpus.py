"""The CPUs this process may use, which on a shared or containerised machine is fewer than ``os.cpu_count()``.

``os.cpu_count()`` counts the host's CPUs. A process pinned to some of them (``taskset``, a cpuset cgroup) or
throttled by a CPU quota (cgroup v2 ``cpu.max``: a container's ``--cpus``, a Kubernetes CPU limit, as CI runners
often are) gets fewer, and thread pools and warm-up processes sized from the host's count oversubscribe them. (GNU
``nproc`` is no guide here: it also honours ``OMP_NUM_THREADS``.)

The processes of one ``mlaspec check`` divide those CPUs between them rather than each taking all: torch's pool of
intra-op threads defaults to every CPU in every process, and OpenMP threads that outnumber the cores spin at each
parallel region's barrier on cores another process needs. The parent (references, budgets, the judge) takes
:func:`parent_threads`, the judged worker :func:`worker_threads`, each warm-up process one
(:mod:`~mlaspec.conformance.warmup`; at most half the CPUs, while kernels compile).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["parent_threads", "take_parent_share", "usable_cpus", "worker_threads"]


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


def parent_threads(cpus: int | None = None) -> int:
    """The torch threads of the run's own process while a judged worker runs beside it: half of ``cpus`` (default
    :func:`usable_cpus`), at least 1. Against torch's default (every CPU), alternated on one host
    (``benchmarks/harness.py --against``): the default CPU run on 2 cores 14.7-15.6 s cold and 11.2-13.0 s warm,
    against 18.7-18.8 and 13.9-14.2; the full-scale triton run on an H100 host of 16 CPUs (8 warm-ups) 102.5 s cold
    and 42.8 s warm against 135.2 and 69.6, 963 and 208 CPU seconds against 1661 and 752 (``docs/backends.md``)."""
    n = usable_cpus() if cpus is None else cpus
    return max(1, n // 2)


def worker_threads(cpus: int | None = None) -> int:
    """The judged worker's torch threads: it builds the inputs and checks the call's input contract, the float64
    references are the parent's: a quarter of ``cpus`` (default :func:`usable_cpus`), 1 to 4."""
    n = usable_cpus() if cpus is None else cpus
    return max(1, min(4, n // 4))


def take_parent_share() -> int:
    """Set this process's torch threads to :func:`parent_threads`, unless ``OMP_NUM_THREADS`` chose them (a user's
    setting is kept); the threads it has now."""
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(parent_threads())
    return torch.get_num_threads()
