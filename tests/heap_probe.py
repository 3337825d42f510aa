"""Whether this process keeps the memory it frees (:mod:`mlaspec.conformance.heap`), seen from outside the allocator:
64 MiB allocated, touched and freed leave the resident set (Linux's ``/proc/self/statm``) as large as they made it.
Without torch, so that a process that asks starts at once (``tests/test_heap.py``); ``tests/misbehaving.py``'s
backends ask it in the run's processes."""

import os


def heap_kept() -> bool:
    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    block = b"\1" * (64 << 20)
    peak = resident()
    del block
    return peak - resident() < 32 << 20
