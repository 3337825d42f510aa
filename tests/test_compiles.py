"""One compile per kernel variant across processes (:mod:`mlaspec.conformance.compiles`): the lock's protocol with
threads standing in for processes (a ``flock`` is held by an open file, so two managers of one process contend as
two processes do), then real compiles for sm_90 in processes started at once (no GPU needed)."""

import os
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("triton")

from mlaspec.conformance import compiles
from mlaspec.conformance.compiles import VariantLockingCacheManager

KEY = "ab" * 32  # Triton's sha256 of a variant, in hex
META = "kernel.json"  # the group compile() looks up first


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(VariantLockingCacheManager, "given_up", set())
    return tmp_path


def _in_thread(fn):
    """Start ``fn`` in a thread; a dict that gets its ``result`` and ``seconds``."""
    out = {}

    def run():
        start = time.monotonic()
        out["result"] = fn()
        out["seconds"] = time.monotonic() - start

    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


def _compile_done(manager):
    """What compile() does after a miss: the variant's files, then its metadata group."""
    path = manager.put(b"cubin", "kernel.cubin")
    manager.put_group(META, {"kernel.cubin": path})
    return path


def test_a_second_process_waits_for_the_first_compile_and_gets_its_result(cache):
    first, second = VariantLockingCacheManager(KEY), VariantLockingCacheManager(KEY)
    assert first.get_group(META) is None  # a miss: first compiles, holding the variant's lock
    waiting = _in_thread(lambda: second.get_group(META))
    time.sleep(0.3)
    assert waiting["thread"].is_alive(), "the second looked past a compile in progress"
    path = _compile_done(first)
    waiting["thread"].join(5)
    assert waiting["result"] == {"kernel.cubin": path}  # found, not compiled again
    assert second._held is None and first._held is None


def test_a_miss_with_nobody_compiling_compiles_at_once(cache):
    manager = VariantLockingCacheManager(KEY)
    start = time.monotonic()
    assert manager.get_group(META) is None
    assert time.monotonic() - start < 1.0 and manager._held is not None
    _compile_done(manager)
    assert VariantLockingCacheManager(KEY).get_group(META) is not None  # a hit takes no lock


def test_a_holder_that_hangs_is_given_up_on_after_the_wait(cache):
    holder, other = VariantLockingCacheManager(KEY), VariantLockingCacheManager(KEY)
    other.wait = 0.3
    assert holder.get_group(META) is None
    waiting = _in_thread(lambda: other.get_group(META))
    waiting["thread"].join(5)
    assert waiting["result"] is None and waiting["seconds"] >= 0.3  # compiles for itself, as without the lock
    assert other._held is None
    again = VariantLockingCacheManager(KEY)  # its next compile of that variant: no second wait
    start = time.monotonic()
    assert again.get_group(META) is None and time.monotonic() - start < 0.2 and again._held is None
    holder.release()


def test_a_compile_that_raises_releases_the_lock_with_its_manager(cache):
    holder = VariantLockingCacheManager(KEY)
    assert holder.get_group(META) is None
    del holder  # compile() raised: its frame, and the manager, are gone
    other = VariantLockingCacheManager(KEY)
    other.wait = 0.5
    assert other.get_group(META) is None and other._held is not None  # the lock was free: it compiles
    other.release()


def test_only_a_compiles_metadata_lookup_takes_the_lock(cache):
    holder = VariantLockingCacheManager(KEY)
    assert holder.get_group(META) is None
    other = VariantLockingCacheManager(KEY)
    other.wait = 5.0
    start = time.monotonic()
    assert other.get_group("__triton_launcher.so") is None  # not a compile's first look: no wait
    assert time.monotonic() - start < 1.0 and other._held is None
    holder.release()


def test_share_compiles_installs_the_manager_unless_another_is_named(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.cache, "manager_class", None)
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "somewhere:Remote")
    assert compiles.share_compiles() is False and knobs.cache.manager_class is None
    monkeypatch.delenv("TRITON_CACHE_MANAGER")
    assert compiles.share_compiles() is True and knobs.cache.manager_class is VariantLockingCacheManager


def _compile_at_once(tmp_path, mode: str, processes: int = 3) -> list[str]:
    """``processes`` probes (``tests/compile_lock_probe.py``) that compile one kernel into one fresh cache, released
    together and made to overlap (none writes the kernel before all have looked for it); each one's ``hit`` or
    ``miss``."""
    folder = tmp_path / mode
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(folder / "cache")
    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_lock_probe.py")
    procs = [
        subprocess.Popen(
            [sys.executable, probe, mode, str(folder), str(processes)], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(processes)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    (folder / "go").touch()
    seen = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), seen
    return seen


def test_processes_that_overlap_compile_a_variant_once(tmp_path):
    """Without the lock, processes that need one variant at once all miss and compile it (what a cold run's warm-ups
    and judged worker did); with it one compiles and the others find its result."""
    assert sorted(_compile_at_once(tmp_path, "shared")) == ["hit", "hit", "miss"]
    assert _compile_at_once(tmp_path, "plain") == ["miss"] * 3  # the probe sees what the lock removes


def test_loading_a_backend_that_imported_triton_shares_its_compiles(monkeypatch):
    """:func:`~mlaspec.conformance.backend.load_backend` installs the manager where the backend imported Triton; the
    torch backend's process does not import Triton for it (a fresh process: this one has)."""
    from triton import knobs

    from mlaspec.conformance.backend import load_backend

    monkeypatch.setattr(knobs.cache, "manager_class", None)
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    load_backend("triton")
    assert knobs.cache.manager_class is VariantLockingCacheManager
    code = "import sys; from mlaspec.conformance.backend import load_backend; load_backend('torch'); "
    code += "print('triton' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
