"""A run that survives its backend: real misbehaving adapters (``tests/misbehaving.py``) under ``mlaspec check`` and
under the pytest plugin, each misbehaving on one attention case. Every case gets one verdict, the cases after the
bad one still run, and the exit status says what happened."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from plugin_args import SUITE

from mlaspec.conformance.cases import Case, curated_cases
from mlaspec.conformance.cli import EXIT_EMPTY, EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from mlaspec.conformance.heap import applies
from mlaspec.conformance.ops import OPS
from mlaspec.conformance.report import load_run, read_jsonl
from mlaspec.conformance.worker import InputsAhead

TESTS = Path(__file__).resolve().parent
BAD = "attention[gqa-noncausal-float32]"
CASES = [c.id for c in curated_cases(ops=("attention",), dtypes=("float32",))]


@pytest.fixture
def misbehaving(monkeypatch, tmp_path):
    """The adapters importable by the worker (PYTHONPATH), and the spinning C function built for ``Spin``."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(TESTS))
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:
        import misbehaving as m

        (tmp_path / "spin.c").write_text(m.SPIN_C)
        lib = tmp_path / "libspin.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", str(lib), str(tmp_path / "spin.c")], check=True)
        monkeypatch.setenv("MLASPEC_TEST_SPIN_LIB", str(lib))
    return tmp_path


@pytest.mark.parametrize("adapter, verdict", [("Segfault", "crash"), ("OsExit", "crash")])
def test_the_matrix_survives_its_backend(misbehaving, adapter, verdict):
    """``mlaspec matrix`` runs each backend in a worker, as ``check`` does: a backend that dies on one case gets that
    case's verdict, every case after it is still judged, and the next backend runs."""
    from mlaspec.conformance.matrix import run_matrix

    backends = [f"misbehaving:{adapter}", "torch"]
    data = run_matrix(backends, out_dir=misbehaving / "m", ops=("attention",), dtypes=("float32",), timeout=20)
    got = {r["case_id"]: r["verdict"] for r in data["backends"][backends[0]]["results"]}
    assert list(got) == CASES and got[BAD] == verdict
    assert {got[c] for c in CASES if c != BAD} == {"pass"}
    assert {r["verdict"] for r in data["backends"]["torch"]["results"]} == {"pass"}


def _check(adapter: str, out: Path, *extra: str) -> tuple[int, dict[str, dict]]:
    argv = ["check", "--backend", f"misbehaving:{adapter}", "--ops", "attention", "--dtypes", "float32"]
    status = main([*argv, "--report", str(out), "--timeout", "20", *extra])
    header, records = read_jsonl(out / "results.jsonl")
    assert header["planned"] == (CASES if "--case" not in extra else list(extra[1::2]))
    assert header["backend"] == f"misbehaving:{adapter}"
    return status, {r["case_id"]: r for r in records}


@pytest.mark.parametrize(
    "adapter, verdict, reason",
    [
        ("SysExit", "crash", "exited with status 0"),
        ("OsExit", "crash", "exited with status 0"),
        ("Segfault", "crash", "killed by signal SIGSEGV"),
        ("Spin", "timeout", "timed out after"),
        ("MetaOutput", "error", "'meta' device"),
        ("NotATensor", "error", "lse: expected a tensor, got NoneType"),
        ("SparseOutput", "error", "sparse_coo"),
        ("WritesInput", "fail", "wrote into its input 'k'"),
        ("AliasesInput", "fail", "output 0 shares memory with the input 'q'"),
        ("HugeAllocation", "error", "RuntimeError"),
    ],
)
def test_a_misbehaving_backend_fails_only_its_case(misbehaving, adapter, verdict, reason):
    if adapter == "Spin" and "MLASPEC_TEST_SPIN_LIB" not in os.environ:
        pytest.skip("no C compiler to build the spinning function")
    extra = ("--timeout", "3") if adapter == "Spin" else ()
    status, by_case = _check(adapter, misbehaving / "report", *extra)
    assert status == EXIT_FAILED
    assert list(by_case) == CASES  # every planned case has exactly one verdict, the ones after the bad one too
    assert by_case[BAD]["verdict"] == verdict and reason in by_case[BAD]["reason"], by_case[BAD]
    assert {by_case[c]["verdict"] for c in CASES if c != BAD} == {"pass"}


def test_a_worker_started_after_a_crash_is_told_the_plan_again(misbehaving, monkeypatch):
    monkeypatch.setenv("MLASPEC_WARM_TRACE", str(misbehaving / "trace"))
    status, by_case = _check("Segfault", misbehaving / "report")
    assert status == EXIT_FAILED and {r["verdict"] for c, r in by_case.items() if c != BAD} == {"pass"}
    plans = [line.split()[2] for line in (misbehaving / "trace").read_text().splitlines() if line.split()[1] == "plan"]
    assert plans == [str(len(CASES))] * 2  # the first worker's, and the one after the crash


class _Runs:
    """A backend's description: it runs ``attention`` in float32."""

    ops, dtypes = frozenset({"attention"}), frozenset({"float32"})


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return x == y


def test_inputs_built_ahead_are_the_inputs_built_in_turn():
    plan = curated_cases(ops=("attention", "merge_attn_states"), dtypes=("float32", "bfloat16"))
    runs = [c for c in plan if c.op == "attention" and c.dtype == "float32"]
    ahead = InputsAhead(_Runs())
    ahead.plan = plan
    for c, after in zip(runs, [*runs[1:], None]):
        assert _same(ahead.inputs(c), OPS[c.op].make_inputs(c))
        assert ahead.building == (after and after.id)  # the next case the backend runs, skipping the others
    outside = Case("attention", "not-planned", "float32", runs[0].params)
    assert _same(ahead.inputs(outside), OPS["attention"].make_inputs(outside)) and ahead.building is None


def test_after_a_skipped_case_the_next_is_built_in_turn_then_ahead_again():
    a, b, c, d, e = curated_cases(ops=("attention",), dtypes=("float32",))[:5]
    ahead = InputsAhead(_Runs())
    ahead.plan = [a, b, c, d, e]
    ahead.inputs(a)
    assert ahead.building == b.id
    assert _same(ahead.inputs(c), OPS[c.op].make_inputs(c))  # the parent skipped b: c built now
    assert ahead.building is None  # skips may go on: nothing built for nothing
    ahead.inputs(d)  # in turn again
    assert ahead.building == e.id


def test_inputs_that_cannot_be_built_ahead_raise_when_taken():
    good = curated_cases(ops=("attention",), dtypes=("float32",))[0]
    bad = Case("attention", "no-sizes", "float32", {})
    ahead = InputsAhead(_Runs())
    ahead.plan = [good, bad]
    ahead.inputs(good)
    assert ahead.building == bad.id
    with pytest.raises(KeyError):  # as make_inputs raises in turn: the case's error
        ahead.inputs(bad)


def test_the_honest_adapter_passes_with_exit_0(misbehaving):
    status, by_case = _check("_Misbehaving", misbehaving / "report", "--case", CASES[0], "--case", CASES[1])
    assert status == EXIT_OK


def test_a_crash_keeps_the_worker_output(misbehaving):
    _, by_case = _check("Segfault", misbehaving / "report")
    assert 'misbehaving.py", line' in by_case[BAD]["reason"]  # faulthandler's stack, from the worker's log


def test_nothing_checked_is_its_own_exit_status(misbehaving, capsys):
    argv = ["check", "--backend", "torch", "--ops", "attention", "--dtypes", "float32", "--report"]
    assert main([*argv, str(misbehaving / "r"), "--case", "attention[mha-causal-float32]"]) == EXIT_OK
    # an adapter whose every case is skipped checks nothing: exit 3 unless --allow-empty
    empty = ["check", "--backend", "mlaspec.conformance.backends.reference:SpecBackend", "--ops", "attention"]
    assert main([*empty, "--dtypes", "float32", "--report", str(misbehaving / "e")]) == EXIT_OK
    skipping = ["check", "--backend", "misbehaving:Unavailable", "--ops", "attention", "--dtypes", "float32"]
    assert main([*skipping, "--report", str(misbehaving / "s")]) == EXIT_EMPTY
    assert "NOTHING CHECKED" in capsys.readouterr().out
    assert main([*skipping, "--report", str(misbehaving / "s"), "--allow-empty"]) == EXIT_OK


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backend", "nosuchmod:Foo"], "must be importable: the current directory is on the path"),
        (["--backend", "misbehaving:NoSuchClass"], "could not be loaded"),
        (["--backend", "misbehaving:FailsToImport"], "the adapter's kernels are not built"),
        (["--backend", "nosuchname"], "neither a registered name"),
        (["--case", "attention[nosuch-float32]"], "names no curated case"),
        (["--op", "mla_decode", "--params", '{"B": 1}'], "--params lacks 'S_q' for op mla_decode"),
        (["--ops", "nosuchop"], "unknown op 'nosuchop'"),
        (["--dtypes", "bogus"], "unknown dtype 'bogus'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(misbehaving, capsys, argv, message):
    assert main(["check", *argv, "--report", str(misbehaving / "r")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_the_judged_worker_starts_first_and_never_outlives_the_run(misbehaving, spawned):
    """``mlaspec check`` starts its worker before its own imports (conformance.spawn) and the run takes that one: a
    second start would show here as a second spawn. A usage error found after the start stops it."""
    from mlaspec.conformance import spawn as spawning
    from mlaspec.conformance import worker

    assert main(["check", "--ops", "nosuchop", "--report", str(misbehaving / "u")]) == EXIT_USAGE
    assert len(spawned) == 1 and spawned[0].proc.poll() is not None
    spawned.clear()
    argv = ["check", "--case", CASES[0], "--report", str(misbehaving / "r")]
    assert main(argv) == EXIT_OK
    assert len(spawned) == 1 and spawned[0].proc.poll() is not None
    with pytest.raises(ValueError, match="started: a worker of 'torch', not of 'spec'"):
        worker.WorkerBackend("spec", started=spawning.Spawned("torch", None, None, None))


def test_report_of_a_killed_run_names_what_never_ran(misbehaving, capsys):
    _check("_Misbehaving", misbehaving / "report")
    path = misbehaving / "report" / "results.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])  # killed: two verdicts and a torn third line
    with pytest.warns(UserWarning, match="not complete JSON"):
        status = main(["report", str(misbehaving / "report")])
    out = capsys.readouterr().out
    assert status == EXIT_FAILED
    n = len(CASES)
    assert "backend misbehaving:_Misbehaving" in out and f"2 verdicts of {n} planned cases" in out
    assert f"NOT RUN: {n - 2} of {n} planned cases have no verdict" in out and CASES[2] in out
    assert main(["report", str(misbehaving / "nonexistent")]) == EXIT_USAGE


def _pytest(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", *SUITE, *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "adapter, verdict, shards", [("OsExit", "CRASH", ()), ("Spin", "TIMEOUT", ()), ("Segfault", "CRASH", ("-n", "2"))]
)
def test_the_pytest_front_end_survives_its_backend(misbehaving, adapter, verdict, shards):
    if adapter == "Spin" and "MLASPEC_TEST_SPIN_LIB" not in os.environ:
        pytest.skip("no C compiler to build the spinning function")
    args = ["--mla-backend", f"misbehaving:{adapter}", "--mla-dtypes", "float32", "-m", "attention", "-k", "curated"]
    run = _pytest(*args, *shards, "--mla-timeout", "3", "--mla-report", str(misbehaving / "r"), cwd=misbehaving)
    assert run.returncode == 1, run.stdout[-2000:]
    assert f"{len(CASES) - 1} passed" in run.stdout and "1 failed" in run.stdout, run.stdout[-2000:]
    assert f"{verdict} {BAD}" in run.stdout
    headers, results = load_run(misbehaving / "r")  # one results file per xdist worker, each with its header
    assert sorted(r.case_id for r in results) == sorted(CASES)
    assert all(sorted(h["planned"]) == sorted(CASES) for h in headers)


def test_pytest_with_a_backend_that_cannot_load_is_one_usage_error(misbehaving):
    run = _pytest("--mla-backend", "misbehaving:FailsToImport", cwd=misbehaving)
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]
    assert (run.stdout + run.stderr).count("the adapter's kernels are not built") == 1


def test_backends_says_usable_only_where_a_case_can_run():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "mlaspec.conformance.cli", "backends"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = {line.split()[0]: line for line in run.stdout.splitlines() if line.strip()}
    assert "usable (torch" in lines["torch"]
    import torch

    if not torch.cuda.is_available():
        assert "not usable here: needs CUDA (or TRITON_INTERPRET=1" in lines["triton"]
    interpreted = subprocess.run(
        [sys.executable, "-m", "mlaspec.conformance.cli", "backends"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "TRITON_INTERPRET": "1"},
    )
    assert "triton" in interpreted.stdout and " usable (triton" in interpreted.stdout


def test_pytest_that_checks_nothing_exits_5(misbehaving):
    args = ["--mla-backend", "misbehaving:Unavailable", "--mla-dtypes", "float32", "-m", "attention", "-k", "curated"]
    assert _pytest(*args, cwd=misbehaving).returncode == 5
    assert _pytest(*args, "--mla-allow-empty", cwd=misbehaving).returncode == 0


def test_a_lost_cuda_context_costs_only_its_case(misbehaving, monkeypatch):
    """On a GPU: a device-side assert breaks the worker's CUDA context; that case errors, the worker exits, and the
    next case runs in a new worker with a new context."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("MLASPEC_DEVICE", "cuda")
    status, by_case = _check("CudaIllegalAccess", misbehaving / "report")
    assert status == EXIT_FAILED
    assert by_case[BAD]["verdict"] == "error" and "CUDA error" in by_case[BAD]["reason"]
    assert {by_case[c]["verdict"] for c in CASES if c != BAD} == {"pass"}


def test_a_case_the_harness_cannot_build_is_its_error_and_the_next_case_reads_its_own_answer():
    from mlaspec.conformance.cases import Case, curated_cases
    from mlaspec.conformance.runner import run_cases
    from mlaspec.conformance.worker import WorkerBackend

    broken = Case("attention", "no-sizes", "float32", {"B": 1})
    good = curated_cases(ops=("attention",), dtypes=("float32",))[:2]
    with WorkerBackend("torch", timeout=60) as backend:
        results = run_cases(backend, [good[0], broken, good[1]], backend_name="torch")
    assert [r.verdict for r in results] == ["pass", "error", "pass"]
    assert "the harness could not build this case: KeyError" in results[1].reason


# -- mlaspec check --warm N (conformance.warmup): warm-up processes run the cases ahead of the judged worker so that a
# JIT backend compiles in parallel; the verdicts are those of a run without them, whatever they do. misbehaving.FakeJit
# stands for the JIT: its first call of a shape in any process sleeps and leaves a file naming the process that built it
@pytest.fixture
def jit(misbehaving, monkeypatch):
    """The fake JIT's cache folder, shared by every process as Triton's is; temporary folders (the warm-up logs
    kept after trouble) under the test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(misbehaving))
    monkeypatch.setenv("TMPDIR", str(misbehaving))
    cache = misbehaving / "jit"
    cache.mkdir()
    monkeypatch.setenv("MLASPEC_TEST_JIT_CACHE", str(cache))
    return cache


def _verdicts(adapter: str, out: Path, *extra: str) -> tuple[int, dict[str, str]]:
    status, by_case = _check(adapter, out, *extra)
    return status, {c: r["verdict"] for c, r in by_case.items()}


WARM = ("--warm", "2", "--timeout", "120")  # a warm-up process's start (a cold `import torch`) may take long under load


def _builders(cache: Path) -> set[str]:
    """The processes that built the fake JIT's kernels (a pid and the script, one per process)."""
    return {p.read_text() for p in cache.glob("kernel-*")}


def _wait_until(test, seconds: float = 120.0) -> bool:
    deadline = time.monotonic() + seconds
    while not test() and time.monotonic() < deadline:
        time.sleep(0.1)
    return test()


def test_warm_up_processes_compile_and_leave_the_verdicts_alone(jit, tmp_path, monkeypatch):
    monkeypatch.setenv("MLASPEC_TEST_JIT_WAIT", "1")  # the judged worker's first call waits for a warm-up's kernel
    status, warmed = _verdicts("FakeJit", tmp_path / "warm", *WARM)
    assert status == EXIT_OK and set(warmed.values()) == {"pass"} and len(warmed) == 6
    scripts = {b.split()[1] for b in _builders(jit)}  # the judged worker built case 0's, a warm-up process the rest
    assert any(b.endswith("worker.py") for b in scripts) and any(not b.endswith("worker.py") for b in scripts)
    for kernel in jit.glob("kernel-*"):
        kernel.unlink()
    monkeypatch.delenv("MLASPEC_TEST_JIT_WAIT")
    status, alone = _verdicts("FakeJit", tmp_path / "alone")
    assert status == EXIT_OK and alone == warmed
    assert len(_builders(jit)) == 1  # without them, one process built all six


@pytest.mark.skipif(not applies(), reason="glibc's malloc with its parameters unset: else nothing changes")
def test_warm_up_processes_keep_freed_memory(jit, tmp_path, monkeypatch):
    """Each warm-up process keeps the memory it frees, as the judged worker does (:mod:`mlaspec.conformance.heap`):
    each process the fake JIT runs a case in records whether it does."""
    monkeypatch.setenv("MLASPEC_TEST_JIT_WAIT", "1")  # a warm-up process runs a case before the judged worker ends
    status, warmed = _verdicts("FakeJitHeapKept", tmp_path / "warm", *WARM)
    assert status == EXIT_OK and set(warmed.values()) == {"pass"}
    records = [p.read_text().split("\n", 1) for p in jit.glob("heap-*")]
    assert {script == "-c" for _, script in records} == {True, False}, records  # warm-up processes and the worker
    assert {kept for kept, _ in records} == {"True"}, records


def test_the_judged_case_still_crashes_beside_dying_warm_up_processes(jit, tmp_path):
    status, warmed = _verdicts("FakeJitDies", tmp_path / "warm", *WARM)
    assert status == EXIT_FAILED
    assert warmed[BAD] == "crash" and {v for c, v in warmed.items() if c != BAD} == {"pass"}
    _, alone = _verdicts("FakeJitDies", tmp_path / "alone")
    assert alone == warmed


def test_a_case_that_errs_beside_warm_up_processes_runs_again_alone_and_says_so(jit, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLASPEC_TEST_JIT_WAIT", "1")  # the judged worker reaches BAD while a warm-up process is on it
    status, by_case = _check("FakeJitOutOfMemory", tmp_path / "warm", *WARM)
    assert status == EXIT_OK and by_case[BAD]["verdict"] == "pass"
    assert by_case[BAD]["retried"].startswith("error: OutOfMemoryError: CUDA out of memory")
    assert all(not r["retried"] for c, r in by_case.items() if c != BAD)
    out = capsys.readouterr().out
    assert "warm-up workers (2): paused 1 times for a case to run again alone" in out
    assert f"RAN AGAIN {BAD}: beside the warm-up workers it gave error: OutOfMemoryError" in out
    assert "ran again alone: beside the warm-up workers" in (tmp_path / "warm" / "report.html").read_text()
    (jit / "out-of-memory").unlink()
    monkeypatch.delenv("MLASPEC_TEST_JIT_WAIT")
    status, alone = _check("FakeJitOutOfMemory", tmp_path / "alone")  # on its own, running out is its verdict
    assert status == EXIT_FAILED and alone[BAD]["verdict"] == "error" and not alone[BAD]["retried"]


def test_a_traced_run_records_what_the_warm_ups_and_the_judged_worker_did(jit, tmp_path, monkeypatch):
    """With :data:`~mlaspec.conformance.trace.TRACE` set, the run and its warm-up processes append their events
    to one file, which ``benchmarks/warm_timeline.py`` reads back: every case the judged worker took, each warm-up's
    start, load and cases, and the case it compiled itself (case 0: the warm-ups start after it). The trace's folder
    does not exist yet: the first event makes it (it once ended the run with ``FileNotFoundError``)."""
    from mlaspec.conformance.trace import TRACE

    trace = tmp_path / "traces" / "trace.txt"
    monkeypatch.setenv(TRACE, str(trace))
    monkeypatch.setenv("MLASPEC_TEST_JIT_WAIT", "1")  # the judged worker's first call waits for a warm-up's kernel
    t0 = time.time()
    status, by_case = _check("FakeJit", tmp_path / "warm", *WARM)
    assert status == EXIT_OK
    monkeypatch.syspath_prepend(str(TESTS.parent / "benchmarks"))
    import warm_timeline

    records = [by_case[c] for c in CASES]
    tl = warm_timeline.read(str(trace), records, t0)
    assert sorted(tl.reached) == list(range(len(CASES)))
    assert sorted(k for _, k in tl.spawns) == sorted(k for _, k in tl.ups) == [0, 1] and not tl.kills
    built = {p.name for p in jit.glob("kernel-*") if p.read_text().split()[1] == "-c"}  # by a warm-up process
    ran = {c for spans in tl.spans.values() for c, _, e in spans if e == e}
    assert built and len(ran) >= len(built)  # each kernel a warm-up built, in a case it ran to its end
    assert all((c - 1) % 2 == k for k, spans in tl.spans.items() for c, _, _ in spans)  # process k's share
    assert 0 in tl.slow()  # case 0: the judged worker's own compile (1.5 s)
    # each judged case's parts: in the worker (its call's seconds are the result's), and in the run's process
    everyone = set(range(len(CASES)))
    assert all(set(tl.parts[part]) == everyone for part in warm_timeline.PARTS), tl.parts
    assert all(tl.parts["call"][i] == pytest.approx(r["seconds"], abs=1e-4) for i, r in enumerate(records))


def _warm_up(backend: str, jit: Path):
    from mlaspec.conformance.warmup import WarmUp

    # no judged worker: one warm-up process takes every case but the first
    return WarmUp(f"misbehaving:{backend}", curated_cases(ops=("attention",), dtypes=("float32",)), 1)


def test_a_warm_up_process_that_dies_goes_on_after_the_case(jit):
    with _warm_up("FakeJitDies", jit) as warm:
        assert _wait_until(lambda: warm.done)
        assert warm.restarts == 1 and warm.paused == 0 and warm.unstarted == 0
        folder = warm.dir
    assert len(_builders(jit)) == 2  # the process that died on the bad case, and the one after it
    assert len(list(jit.glob("kernel-*"))) == len(CASES) - 1  # every kernel but case 0's, the bad case's before it died
    assert folder.exists()  # its logs are kept: something went wrong there


def test_warm_up_processes_stop_for_a_case_that_failed_beside_them_and_resume_if_it_fails_alone(jit):
    case = curated_cases(ops=("attention",), dtypes=("float32",))[0]
    with _warm_up("FakeJitHangs", jit) as warm:
        assert _wait_until(lambda: (jit / "warm-up-hangs").exists())  # alive, on BAD for an hour
        assert warm.contended(case, time.monotonic() - 1) and warm.done and warm.paused == 1
        (jit / "warm-up-hangs").unlink()
        warm.resume()  # the case failed alone too: they start again, from where the judged worker is
        assert _wait_until(lambda: (jit / "warm-up-hangs").exists())
        warm.grace = 0.0
        warm.reached(len(CASES))  # the judged worker is past every case: the one on BAD is killed, none is left
        assert _wait_until(lambda: warm.done)
        ended = time.monotonic()
        assert not warm.contended(case, ended) and warm.paused == 1  # nothing ran beside a case started after


def test_a_warm_up_process_the_judged_worker_overtook_goes_on_after_the_case(jit):
    with _warm_up("FakeJitHangs", jit) as warm:
        assert _wait_until(lambda: (jit / "warm-up-hangs").exists())  # on BAD (case 2), for an hour
        first = warm._procs[0]
        warm.reached(CASES.index(BAD) + 1)  # the judged worker is past it
        time.sleep(1.0)  # five of the keeper's looks: within the grace it is left to finish its case
        assert warm._procs[0] is first and first.poll() is None
        warm.grace = 0.5  # stuck there: killed, and started again after it
        assert _wait_until(lambda: warm.done)
        assert warm.restarts == 0
        procs, folder = list(warm._procs.values()), warm.dir
    assert len(list(jit.glob("kernel-*"))) == len(CASES) - 2  # neither case 0 nor case 3, which the judged worker took
    assert all(p.poll() is not None for p in procs) and not folder.exists()  # nothing left behind


def test_warm_up_processes_die_with_the_run(jit, tmp_path):
    script = (
        "import sys, time\n"
        "from mlaspec.conformance.cases import curated_cases\n"
        "from mlaspec.conformance.warmup import WarmUp\n"
        "w = WarmUp('misbehaving:FakeJitHangs', curated_cases(ops=('attention',), dtypes=('float32',)), 1)\n"
        "while not w._procs: time.sleep(0.05)\n"
        "print(w._procs[0].pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = int(run.stdout.readline())
    try:
        assert _wait_until(lambda: (jit / "warm-up-hangs").exists())
        run.kill()  # SIGKILL: no finally, no stop()
        run.wait()
        assert _wait_until(lambda: _dead(pid), 30)
    finally:
        run.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"  # gone, or a zombie nobody reaps
    except (OSError, IndexError):
        return True


@pytest.mark.parametrize("extra", [("--warm", "-1"), ("--warm", "2", "--isolation", "none")])
def test_warm_usage_errors(jit, extra):
    assert main(["check", "--backend", "misbehaving:FakeJit", "--report", str(jit), *extra]) == EXIT_USAGE
    with pytest.raises(SystemExit, match=str(EXIT_USAGE)):  # argparse's own usage exit
        main(["check", "--backend", "misbehaving:FakeJit", "--report", str(jit), "--warm", "many"])


@pytest.mark.parametrize(
    "device, jit, cpus, isolated, dcp, expected",
    [
        ("cuda:0", True, 16, True, None, 15),  # a JIT backend on a GPU host: 15 warm-ups
        ("cuda:0", True, 64, True, None, 15),  # at most 15
        ("cuda", True, 6, True, None, 5),  # at most all the CPUs but one
        ("cuda:0", True, 1, True, None, 0),  # one CPU: none
        ("cuda:0", False, 16, True, None, 0),  # a prebuilt backend: nothing to compile, they would only contend
        ("cpu", True, 16, True, None, 0),  # nothing to compile on the CPU
        (None, True, 16, True, None, 0),  # a backend that does not say where it runs
        ("cuda:0", True, 16, False, None, 0),  # --isolation none: nothing beside it
        ("cuda:0", True, 16, True, 2, 0),  # --dcp: the ranks hold the GPUs
    ],
)
def test_warm_auto_starts_warm_ups_only_beside_a_jit_backend_on_cuda(
    monkeypatch, device, jit, cpus, isolated, dcp, expected
):
    from mlaspec.conformance import cli

    monkeypatch.setattr(cli, "usable_cpus", lambda: cpus)
    assert cli.warm_count("auto", device, jit=jit, isolated=isolated, dcp=dcp) == expected
    assert cli.warm_count(3, device, jit=jit, isolated=isolated, dcp=dcp) == 3  # a count is taken as given


def test_the_jit_backends_say_so():
    """``--warm auto`` reads the protocol's ``jit``: the adapters whose kernels compile on first use declare it,
    through the worker too."""
    from mlaspec.conformance.backends.flashinfer import FlashInferBackend
    from mlaspec.conformance.backends.flashmla import FlashMLABackend
    from mlaspec.conformance.backends.torch_eager import TorchBackend
    from mlaspec.conformance.backends.triton import TritonBackend
    from mlaspec.conformance.backends.vllm import VLLMBackend
    from mlaspec.conformance.worker import WorkerBackend

    assert TritonBackend.jit and FlashInferBackend.jit and VLLMBackend.jit
    assert not getattr(FlashMLABackend, "jit", False) and not getattr(TorchBackend, "jit", False)
    with WorkerBackend("torch", timeout=60) as worker:
        assert worker.jit is False


def test_warm_auto_is_the_default_and_no_usage_error_without_a_worker(jit, monkeypatch):
    """The default (``auto``) with ``--isolation none`` is no usage error; beside the CPU backend it starts no
    warm-up process (``WarmUp`` is never built)."""
    from mlaspec.conformance import warmup

    def refuse(*args, **kwargs):
        raise AssertionError("a warm-up process was started beside a CPU backend")

    monkeypatch.setattr(warmup, "WarmUp", refuse)
    argv = ["check", "--backend", "misbehaving:FakeJit", "--case", CASES[0], "--report", str(jit / "report")]
    assert main([*argv, "--isolation", "none"]) == 0
    assert main(argv) == 0


def test_a_lazy_warm_up_starts_at_the_first_judged_call_that_compiled(jit):
    from mlaspec.conformance.warmup import COMPILING, WarmUp

    case = curated_cases(ops=("attention",), dtypes=("float32",))[0]
    with WarmUp("misbehaving:FakeJit", curated_cases(ops=("attention",), dtypes=("float32",)), 1, lazy=True) as warm:
        assert not warm.started and warm.done and not warm._procs
        assert not warm.contended(case, time.monotonic())  # nothing ran: nothing to stop, nothing to rerun
        warm.judged(COMPILING / 2)  # a compiled call: still none
        time.sleep(1)
        assert not warm.started and not warm._procs and not list(jit.glob("kernel-*"))
        warm.judged(COMPILING)  # a call that compiled: they start and take the cases after the first
        assert warm.started and _wait_until(lambda: warm.done)
    assert len(list(jit.glob("kernel-*"))) == len(CASES) - 1 and len(_builders(jit)) == 1


def test_warm_auto_starts_its_processes_only_once_a_judged_call_compiles(jit, tmp_path, monkeypatch):
    from mlaspec.conformance import cli, warmup

    monkeypatch.setattr(cli, "warm_count", lambda warm, *a, **kw: 2 if warm == "auto" else int(warm))
    (tmp_path / "triton" / "some-kernel").mkdir(parents=True)  # a Triton cache that holds something: lazy
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    started, start = [], warmup.WarmUp._start_keepers
    monkeypatch.setattr(warmup.WarmUp, "_start_keepers", lambda self: (started.append(self.total), start(self)))
    status, cold = _verdicts("FakeJit", tmp_path / "cold", "--timeout", "120")  # auto: case 0 compiles, they start
    assert status == EXIT_OK and set(cold.values()) == {"pass"} and len(cold) == 6 and started == [6]
    status, warm = _verdicts("FakeJit", tmp_path / "warm", "--timeout", "120")  # every kernel built: none starts
    assert status == EXIT_OK and warm == cold and started == [6]


def test_warm_auto_starts_its_processes_at_once_over_an_empty_triton_cache(jit, tmp_path, monkeypatch):
    from mlaspec.conformance import cli, warmup

    monkeypatch.setattr(cli, "warm_count", lambda warm, *a, **kw: 2 if warm == "auto" else int(warm))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "no-triton-cache"))
    lazy = []
    monkeypatch.setattr(warmup.WarmUp, "judged", lambda self, seconds: lazy.append(self.started))
    status, verdicts = _verdicts("FakeJit", tmp_path / "cold", "--timeout", "120")
    assert status == EXIT_OK and set(verdicts.values()) == {"pass"} and lazy == [True] * 6  # started before case 0


def test_compile_cache_empty_reads_tritons_cache_folder(tmp_path, monkeypatch):
    from mlaspec.conformance.warmup import compile_cache_empty

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    assert compile_cache_empty()  # no folder
    (tmp_path / "cache").mkdir()
    assert compile_cache_empty()  # an empty one
    (tmp_path / "cache" / "ABCDEF").mkdir()
    assert not compile_cache_empty()
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compile_cache_empty()  # ~/.triton/cache, absent here
    (tmp_path / ".triton" / "cache" / "k").mkdir(parents=True)
    assert not compile_cache_empty()
