"""``mlaspec check --warm N`` (:mod:`mlaspec.conformance.warmup`): warm-up processes run the cases ahead of the judged
worker so that a JIT backend compiles in parallel; the verdicts are those of a run without them, whatever they
do. ``tests/misbehaving.py``'s ``FakeJit`` stands for the JIT: its first call of a shape in any process sleeps and
leaves a file naming the process that built it."""

import os
from pathlib import Path

import pytest

from mlaspec.conformance.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from mlaspec.conformance.report import read_jsonl

TESTS = Path(__file__).resolve().parent
BAD = "attention[gqa-noncausal-float32]"  # misbehaving.FakeJit misbehaves on it


@pytest.fixture
def jit(monkeypatch, tmp_path):
    """The fake JIT's cache folder (shared by every process, as Triton's is), the adapters importable."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(TESTS))
    cache = tmp_path / "jit"
    cache.mkdir()
    monkeypatch.setenv("MLASPEC_TEST_JIT_CACHE", str(cache))
    return cache


def _check(out: Path, adapter: str, *extra: str) -> tuple[int, dict[str, str]]:
    argv = ["check", "--backend", f"misbehaving:{adapter}", "--ops", "attention", "--dtypes", "float32"]
    status = main([*argv, "--report", str(out), "--timeout", "60", *extra])
    _, records = read_jsonl(out / "results.jsonl")
    return status, {r["case_id"]: r["verdict"] for r in records}


def _builders(cache: Path) -> set[str]:
    return {p.read_text().split()[0] for p in cache.iterdir() if p.name != "out-of-memory"}


def test_warm_up_processes_compile_and_leave_the_verdicts_alone(jit, tmp_path):
    status, warmed = _check(tmp_path / "warm", "FakeJit", "--warm", "2")
    assert status == EXIT_OK and set(warmed.values()) == {"pass"} and len(warmed) == 6
    assert len(_builders(jit)) >= 2  # the judged worker did not build every kernel itself
    for kernel in jit.iterdir():
        kernel.unlink()
    status, alone = _check(tmp_path / "alone", "FakeJit")
    assert status == EXIT_OK and alone == warmed
    assert len(_builders(jit)) == 1  # without them, one process built all six


def test_the_judged_case_still_crashes_beside_dying_warm_up_processes(jit, tmp_path):
    status, warmed = _check(tmp_path / "warm", "FakeJitDies", "--warm", "2")
    assert status == EXIT_FAILED
    assert warmed[BAD] == "crash" and {v for c, v in warmed.items() if c != BAD} == {"pass"}
    _, alone = _check(tmp_path / "alone", "FakeJitDies")
    assert alone == warmed


def test_out_of_memory_beside_the_warm_up_processes_stops_them_and_runs_the_case_again(jit, tmp_path, capsys):
    status, warmed = _check(tmp_path / "warm", "FakeJitOutOfMemory", "--warm", "2")
    assert status == EXIT_OK and warmed[BAD] == "pass"
    assert f"stopped early: {BAD} ran out of device memory beside them" in capsys.readouterr().out
    (jit / "out-of-memory").unlink()
    status, alone = _check(tmp_path / "alone", "FakeJitOutOfMemory")  # on its own, running out is its verdict
    assert status == EXIT_FAILED and alone[BAD] == "error"


def test_a_warm_up_process_that_dies_goes_on_after_the_case(jit):
    import time

    from mlaspec.conformance.cases import curated_cases
    from mlaspec.conformance.warmup import WarmUp

    cases = curated_cases(ops=("attention",), dtypes=("float32",))  # the judged worker never comes: it warms all
    with WarmUp("misbehaving:FakeJitDies", cases, 1) as warm:
        deadline = time.monotonic() + 120
        while not warm.done and time.monotonic() < deadline:
            time.sleep(0.1)
        assert warm.done and warm.restarts == 1 and warm.stopped_because is None
    assert len(_builders(jit)) == 2  # the process that died on the bad case, and the one after it
    assert len(list(jit.iterdir())) == len(cases)  # every kernel built, the bad case's before it died


@pytest.mark.parametrize("extra", [("--warm", "-1"), ("--warm", "2", "--isolation", "none")])
def test_warm_usage_errors(jit, tmp_path, extra):
    assert main(["check", "--backend", "misbehaving:FakeJit", "--report", str(tmp_path), *extra]) == EXIT_USAGE
