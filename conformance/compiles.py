"""One compile per kernel variant across a run's processes.

A cold run's warm-up processes and its judged worker compile the same Triton kernels, and Triton takes no lock across
processes: two that need one variant at the same moment both compile it and both write the same cache entry
(``triton.compiler.compiler.compile``: a look in the cache, the compile, then ``put_group`` of the metadata). A model
of a cold full-scale run on the H200 (``benchmarks/compile_census.py``'s variants and compile seconds, the round-robin
deal of 15 warm-ups; the speed log, 2026-11-29 day) put a quarter of its compile-seconds there.

:class:`VariantLockingCacheManager` is Triton's file cache with a lock a variant: a process that finds no entry takes
an exclusive ``flock`` on a file in that variant's own cache folder (keyed by Triton's hash of the source, options
and target, so by nothing of ours), looks again, and either finds what the process that held the lock wrote or
compiles it while holding the lock, which ``put_group`` releases. A process that dies or raises while compiling
releases it with its file descriptor (a compile that raised, once its exception is let go of; a process that keeps
the exception, as a test report does, keeps the lock). A lock held past :data:`LOCK_WAIT` seconds (a compiler that
hangs, a kept exception) is given up on: that process then compiles for itself, as without the lock, and does not wait
for that variant again. :func:`share_compiles` installs it;
:func:`~mlaspec.conformance.backend.load_backend` calls it in every process that loads a backend which imported
Triton (the judged worker, each warm-up, each DCP rank, a pytest worker), unless ``TRITON_CACHE_MANAGER`` names
another cache manager.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import ClassVar

__all__ = ["LOCK_WAIT", "VariantLockingCacheManager", "share_compiles"]

LOCK_WAIT = 60.0
"""Seconds a process waits for another's compile of the same variant before compiling it itself (a Hopper decode
variant takes 2-10 s to compile on a busy host)."""
_POLL = 0.02  # seconds between tries of a held lock

try:  # without Triton there is nothing to compile
    from triton.runtime.cache import FileCacheManager
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    FileCacheManager = object


class VariantLockingCacheManager(FileCacheManager):
    """Triton's ``FileCacheManager`` whose miss on a compile's metadata (the ``.json`` group ``compile`` looks up
    first) waits for the process compiling that variant, then holds the variant's lock until its ``put_group``.
    ``wait``: seconds to wait for a held lock (:data:`LOCK_WAIT`)."""

    wait = LOCK_WAIT
    given_up: ClassVar[set[str]] = set()  # the variants (Triton's keys) whose lock this process waited for in vain

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._held: int | None = None  # the lock file's descriptor while this process compiles the variant

    def get_group(self, filename: str):
        found = super().get_group(filename)
        if found is not None or self._held is not None or not filename.endswith(".json") or not self.cache_dir:
            return found
        if self.key in self.given_up:
            return None
        fd = os.open(os.path.join(self.cache_dir, "compile.lock"), os.O_CREAT | os.O_RDWR, 0o644)
        if not _lock(fd, self.wait):
            os.close(fd)
            self.given_up.add(self.key)
            return None  # its holder hangs: compile it here, as without the lock
        found = super().get_group(filename)  # written by the holder we waited for?
        if found is not None:
            os.close(fd)
            return found
        self._held = fd
        return None

    def put_group(self, filename: str, group):
        try:
            return super().put_group(filename, group)
        finally:
            self.release()

    def release(self) -> None:
        """Let the next process that needs this variant look again (closing the descriptor drops the ``flock``)."""
        fd, self._held = self._held, None
        if fd is not None:
            os.close(fd)

    def __del__(self):  # a compile that raised: its manager goes with its frame
        with contextlib.suppress(Exception):
            self.release()


def _lock(fd: int, wait: float) -> bool:
    """Take ``fd``'s exclusive ``flock`` within ``wait`` seconds; whether it was taken."""
    import fcntl

    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL)


def share_compiles() -> bool:
    """Make this process's Triton compiles wait for another process compiling the same variant (see the module);
    whether it did: not without Triton's ``knobs`` (triton < 3.4), nor where ``TRITON_CACHE_MANAGER`` names another
    cache manager (a remote cache, say), nor off POSIX."""
    if os.environ.get("TRITON_CACHE_MANAGER") or os.name != "posix" or FileCacheManager is object:
        return False
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - triton < 3.4
        return False
    knobs.cache.manager_class = VariantLockingCacheManager
    return True
