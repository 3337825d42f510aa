"""The CPUs this process may use, which on a shared or containerised machine is fewer than ``os.cpu_count()``.

``os.cpu_count()`` counts the host's CPUs. A process pinned to some of them (``taskset``, a cpuset cgroup) or
throttled by a CPU quota (cgroup v2 ``cpu.max``: a container's ``--cpus``, a Kubernetes CPU limit, as CI runners
often are) gets fewer, and thread pools and warm-up processes sized from the host's count oversubscribe them. (GNU
``nproc`` is no guide here: it also honours ``OMP_NUM_THREADS``.)
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["usable_cpus"]


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
