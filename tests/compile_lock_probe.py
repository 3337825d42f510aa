"""Compiles ``census_probe.copy`` ahead of time for sm_90 into the Triton cache named by ``TRITON_CACHE_DIR`` once the
file ``DIR/go`` exists, and prints ``miss`` if this process compiled it, ``hit`` if it found it compiled (no GPU
needed). ``test_compiles.py`` starts ``N`` at once, with (``shared``) and without (``plain``)
:func:`mlaspec.conformance.compiles.share_compiles`, in processes of their own without ``TRITON_INTERPRET``.

So that they overlap however the host schedules them, no process writes the compiled kernel into the cache before
all ``N`` have looked it up: each marks its look (``DIR/looked-PID``) and waits for ``N`` marks before its
``put_group``. Without the lock all ``N`` then miss; with it the holder's wait ends once the others wait for its
lock, and they find what it wrote.

    TRITON_CACHE_DIR=/tmp/tc python tests/compile_lock_probe.py shared /tmp/probe 3
"""

import os
import sys
import time
from pathlib import Path

import triton
from census_probe import SIGNATURE, copy
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.cache import FileCacheManager

from mlaspec.conformance.compiles import VariantLockingCacheManager, share_compiles


def overlapping(base, folder: Path, n: int):
    """``base`` (a cache manager class) whose compiles wait for ``n`` processes' looks before they write."""

    class Overlapping(base):
        def get_group(self, filename):
            if filename.endswith(".json"):
                (folder / f"looked-{os.getpid()}").touch()
            return super().get_group(filename)

        def put_group(self, filename, group):
            deadline = time.monotonic() + 60
            while len(list(folder.glob("looked-*"))) < n and time.monotonic() < deadline:
                time.sleep(0.005)
            return super().put_group(filename, group)

    return Overlapping


if __name__ == "__main__":
    mode, folder, n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if mode == "shared":
        assert share_compiles() and knobs.cache.manager_class is VariantLockingCacheManager
    knobs.cache.manager_class = overlapping(knobs.cache.manager_class or FileCacheManager, folder, n)
    seen = []
    knobs.compilation.listener = lambda **kw: seen.append("hit" if kw["cache_hit"] else "miss")
    print("ready", flush=True)
    while not (folder / "go").exists():
        time.sleep(0.002)
    triton.compile(ASTSource(copy, SIGNATURE, {(4,): 64}, {}), target=GPUTarget("cuda", 90, 32))
    print(*seen, flush=True)
