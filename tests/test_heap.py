"""Freed memory kept for reuse (:mod:`mlaspec.conformance.heap`): in a process that calls
:func:`~mlaspec.conformance.heap.keep_freed_memory`, a freed block's pages stay for the next one; a user's own malloc
settings win; and every process of a run calls it (the command's own here; the judged worker's and a DCP group's
ranks in ``tests/test_distributed.py``, the warm-up processes' in ``tests/test_isolation.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlaspec.conformance.heap import USER_SETTINGS, applies

TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(not applies(), reason="glibc's malloc with its parameters unset: else nothing changes")

_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from heap_probe import heap_kept
from mlaspec.conformance.heap import keep_freed_memory
applied = keep_freed_memory() if sys.argv[2] == "keep" else None
print(applied, heap_kept())
"""


def _probe(keep: bool, **env: str) -> tuple[str, str]:
    """In a fresh process (``env`` added to this one's, less glibc's malloc variables): whether ``keep_freed_memory``
    applied (``None``: not called) and whether the process then keeps 64 MiB it freed."""
    base = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS and k != "GLIBC_TUNABLES"}
    argv = [sys.executable, "-c", _PROBE, str(TESTS), "keep" if keep else "leave"]
    out = subprocess.run(argv, env=base | env, capture_output=True, text=True, check=True).stdout.split()
    return out[-2], out[-1]


def test_a_process_that_keeps_freed_memory_reuses_it():
    assert _probe(keep=False) == ("None", "False")  # glibc's default: a freed 64 MiB block goes back to the kernel
    assert _probe(keep=True) == ("True", "True")


@pytest.mark.parametrize(
    "name, value",
    [
        ("MALLOC_MMAP_MAX_", "65536"),
        ("MALLOC_TRIM_THRESHOLD_", "131072"),
        ("GLIBC_TUNABLES", "glibc.malloc.mmap_max=65536"),
        ("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=512:glibc.malloc.top_pad=0"),
    ],
)
def test_a_users_malloc_settings_are_left_as_they_are(name, value):
    assert _probe(keep=True, **{name: value}) == ("False", "False")


def test_other_tunables_leave_it_to_the_harness():
    assert _probe(keep=True, GLIBC_TUNABLES="glibc.malloc.arena_max=2") == ("True", "True")


def test_the_command_keeps_freed_memory_in_its_own_process(tmp_path):
    """``mlaspec check --isolation none``: the backend's decode runs in the command's process and refuses a process
    that gives freed memory back (``misbehaving:HeapKept``)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env["MLASPEC_CACHE_DIR"] = str(tmp_path / "cache")
    argv = [sys.executable, "-m", "mlaspec.conformance.cli", "check", "--backend", "misbehaving:HeapKept"]
    argv += ["--case", "mla_decode[v3-tp8-float32]", "--isolation", "none", "--report", str(tmp_path / "report")]
    run = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "1 passed" in run.stdout, (run.stdout, run.stderr)
