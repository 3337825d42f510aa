"""References ahead (mlaspec.conformance.ahead): a fork that computes a run's references backwards into the cache."""

import os
import time

import pytest
import torch

from mlaspec.conformance import ahead, cpus
from mlaspec.conformance.ahead import Ahead, missing, wanted
from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.cli import main
from mlaspec.conformance.ops import DTYPES, OPS, unit_roundoff
from mlaspec.conformance.references import ReferenceCache, cache_key, compute

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or not hasattr(os, "sched_setscheduler"), reason="a fork under SCHED_IDLE: Linux"
)
CPU = torch.device("cpu")


def _items(op: str = "merge_attn_states") -> list:
    return [(c, ()) for c in curated_cases(scale="tiny", ops=(op,))]


def _key(case, numerics=()):
    return cache_key(case, scale="tiny", numerics=numerics, device=CPU, op=OPS[case.op])


def _finished(a: Ahead) -> int:
    """Wait for the fork to end by itself; its exit status."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pid, status = os.waitpid(a.pid, os.WNOHANG)
        if pid:
            a.pid = 0
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    raise AssertionError("the fork did not end")


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    return x == y


def test_computes_backwards_down_to_where_the_run_is(tmp_path):
    items = _items()
    cache = ReferenceCache(tmp_path)
    with Ahead(items, scale="tiny", cache=cache, reached=2) as a:
        assert _finished(a) == 0
        assert a.computed == len(items) - 3
    for i, (case, numerics) in enumerate(items):
        hit = cache.load(_key(case))
        assert (hit is not None) == (i > 2), case.id  # none at or before the case the run is at
        if hit is not None:  # the run's own function, so the run's own numbers
            op = OPS[case.op]
            assert _equal(hit, compute(op, op.make_inputs(case), unit_roundoff(DTYPES[case.dtype]), numerics, CPU))
    assert not list(tmp_path.glob("*/.tmp-*"))


def test_skips_what_the_cache_holds_and_cases_without_numerics(tmp_path):
    items = _items()
    cache = ReferenceCache(tmp_path)
    held = items[-1][0]
    cache.store(_key(held), (torch.zeros(1),), None)  # a file the fork must not overwrite
    items[-2] = (items[-2][0], None)  # a case the backend skips
    with Ahead(items, scale="tiny", cache=cache) as a:
        assert _finished(a) == 0
        assert a.computed == len(items) - 3  # not case 0 (the run's), nor the two above
    assert _equal(cache.load(_key(held)), ((torch.zeros(1),), None))
    assert cache.load(_key(items[-2][0])) is None
    assert cache.load(_key(items[-3][0])) is not None


def test_stores_under_the_declared_numerics(tmp_path):
    items = [(c, ("lse_in_query_dtype",)) for c, _ in _items("attention")][:3]
    cache = ReferenceCache(tmp_path)
    with Ahead(items, scale="tiny", cache=cache) as a:
        assert _finished(a) == 0
    assert cache.load(_key(items[2][0], ("lse_in_query_dtype",))) is not None
    assert cache.load(_key(items[2][0])) is None


def test_stop_ends_it_and_leaves_no_half_file(tmp_path):
    items = _items("dcp_decode")
    a = Ahead(items, scale="tiny", cache=ReferenceCache(tmp_path))
    time.sleep(0.3)
    a.stop()
    assert a.pid == 0
    assert a.computed < len(items)
    assert not list(tmp_path.glob("*/.tmp-*"))
    a.stop()  # again: nothing


def test_wanted_only_where_it_helps(tmp_path, monkeypatch):
    items = _items()
    cache = ReferenceCache(tmp_path)
    monkeypatch.setattr(ahead, "MIN_MISSING", len(items))
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 2)
    assert missing(items, scale="tiny", cache=cache) == len(items)
    assert wanted(items, scale="tiny", cache=cache, device=CPU)
    assert not wanted(items, scale="tiny", cache=None, device=CPU)  # --no-cache
    assert not wanted(items, scale="tiny", cache=cache, device=torch.device("cuda"))  # references on the GPU
    items[0] = (items[0][0], None)
    assert missing(items, scale="tiny", cache=cache) == len(items) - 1
    assert not wanted(items, scale="tiny", cache=cache, device=CPU)  # fewer missing than MIN_MISSING
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 1)
    monkeypatch.setattr(ahead, "MIN_MISSING", 1)
    assert not wanted(items, scale="tiny", cache=cache, device=CPU)  # no CPU to spare


def test_a_run_with_it_reads_what_it_stored(tmp_path, monkeypatch):
    """The fork's files are the ones the run asks for: one file a case, none under another key."""
    monkeypatch.setenv("MLASPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ahead, "MIN_MISSING", 1)
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 2)
    started = []
    monkeypatch.setattr(ahead.Ahead, "__init__", _recording(ahead.Ahead.__init__, started))
    assert main(["check", "--ops", "dcp_decode", "--dtypes", "bfloat16", "--report", str(tmp_path / "r")]) == 0
    n = len(curated_cases(scale="tiny", ops=("dcp_decode",), dtypes=("bfloat16",)))
    assert started and len(started[0]) == n
    assert len(list((tmp_path / "cache" / "references").glob("*/*.pt"))) == n


def _recording(init, started):
    def record(self, items, **kw):
        started.append(items)
        init(self, items, **kw)

    return record
