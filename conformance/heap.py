"""Freed memory kept for reuse by the run's processes (glibc's allocator).

glibc's ``malloc`` gives a block of 128 KiB or more (a threshold that adapts up to 32 MiB) a mapping of its own
(``mmap``) and returns it to the kernel when it is freed (``munmap``), and it trims the heap's free top past 128 KiB.
The harness's float64 work on the CPU allocates and frees tensors of megabytes to gigabytes: each case's inputs
(drawn, quantized into a cache), the references and budgets where they are computed on the CPU, the judge's
comparisons. Each such tensor is then fresh memory, every page of it faulted in on first touch, and the kernel pays
for that again for the next one: in a virtual machine or a sandbox (Firecracker, gVisor: the hosts this project
measures on) often more than the arithmetic. Measured on a 2-core host (2026-11-29): the inputs of 40 full-scale
decode cases, 12.6 -> 4.5 s; ``round_to_format`` over 4 M values, 0.26 -> 0.06 s.

:func:`keep_freed_memory` turns both off in the process that calls it (``mallopt``: no block of the main thread's
heap gets a mapping of its own, and the heap's free top is kept up to :data:`TRIM_THRESHOLD`), so a freed tensor's
pages serve the next one. (Another thread's heap holds at most 64 MiB: a larger block it asks for is still mapped on
its own. The harness allocates its large tensors on the main thread.) The cost: a process's resident memory stays
near its peak, and more where freed blocks sit below live ones, until it ends (every full-scale bf16 case's inputs
built in one process: a peak of 861 MB held to the end, against 674 MB falling to 244 MB; 9 s against 17 s).

The processes of ``mlaspec check`` call it first: the command itself, the judged worker, each warm-up process and
each rank of a DCP group. The pytest plugin's own process (a user's test session) is left as it is; its worker and
ranks call it. Where :func:`applies` is false nothing changes: not glibc (macOS, musl), or a user who set glibc's
malloc parameters (:data:`USER_SETTINGS`) keeps them.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["TRIM_THRESHOLD", "USER_SETTINGS", "applies", "keep_freed_memory"]

TRIM_THRESHOLD = 1 << 30
"""Bytes of free memory at the heap's top a process keeps before it gives any back to the kernel."""

USER_SETTINGS = {
    "MALLOC_MMAP_MAX_": "glibc.malloc.mmap_max",
    "MALLOC_MMAP_THRESHOLD_": "glibc.malloc.mmap_threshold",
    "MALLOC_TRIM_THRESHOLD_": "glibc.malloc.trim_threshold",
    "MALLOC_TOP_PAD_": "glibc.malloc.top_pad",
}
"""The parameters :func:`keep_freed_memory` would set or that decide the same thing: glibc's environment variable
for each -> its tunable (``GLIBC_TUNABLES=name=value:...``). Where a user set one, the allocator stays as configured."""

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's <malloc.h>


def applies() -> bool:
    """Whether :func:`keep_freed_memory` changes this process: glibc's allocator, none of :data:`USER_SETTINGS` set."""
    if platform.libc_ver()[0] != "glibc":
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return not any(os.environ.get(var) or f"{tunable}=" in tunables for var, tunable in USER_SETTINGS.items())


def keep_freed_memory() -> bool:
    """Keep this process's freed memory for reuse (module docstring), where :func:`applies`; whether it did."""
    if not applies():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
