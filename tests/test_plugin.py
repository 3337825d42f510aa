"""The pytest plugin: ``pytest --pyargs mlaspec.conformance --mla-backend NAME`` runs the curated cases of
``mlaspec check`` and generated ones; failures carry the reproducer; it stays inert in other pytest runs."""

import json
import re
import shlex
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from plugin_args import PLUGIN, SUITE

from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import Case, curated_cases
from mlaspec.conformance.cli import main
from mlaspec.conformance.generated import GENERATED_OPS, case_strategy
from mlaspec.conformance.plugin import worker_device
from mlaspec.conformance.report import environment, load_results
from mlaspec.conformance.runner import run_case

pytest_plugins = ["pytester"]

# pytester's in-process runs drop the modules they imported afterwards; triton's extension cannot be imported twice
# in one process, so import what the suite imports (the report's environment, the heat maps) once, here
environment()
import mlaspec.conformance.viz.errors  # noqa: E402, F401

MUTANTS = """
import math

from mlaspec.conformance.backends.torch_eager import TorchBackend


class Log2Lse(TorchBackend):
    def attention(self, q, k, v, *, scale, causal=False, mask=None):
        out, lse = super().attention(q, k, v, scale=scale, causal=causal)
        return out, lse / math.log(2)


class DecodeOnly(TorchBackend):
    ops = frozenset({"mla_decode"})
    dtypes = frozenset({"bfloat16"})

    def unsupported(self, case):
        return "needs 64 query heads" if case.params["H_q"] < 64 else None
"""


@pytest.fixture
def suite(pytester, monkeypatch):
    """Run the conformance suite in-process from a scratch directory holding ``mutants.py``."""
    monkeypatch.delenv("MLASPEC_BACKEND", raising=False)
    pytester.makepyfile(mutants=MUTANTS)
    pytester.syspathinsert()
    return lambda *args: pytester.runpytest_inprocess(*SUITE, *args)


def test_spec_backend_passes_the_same_cases_as_the_cli(suite, monkeypatch):
    monkeypatch.setenv("MLASPEC_BACKEND", "spec")  # the environment variable names the backend too
    ops = ("mla_decode", "merge_attn_states")
    result = suite("-m", " or ".join(ops), "--mla-dtypes", "bfloat16", "--mla-examples", "3", "-v")
    curated = curated_cases(dtypes=("bfloat16",), ops=ops)
    result.assert_outcomes(passed=len(curated) + len(ops))
    # a user's run: the package outside the rootdir, its node ids `test_conformance.py::...`; a green run exits 0
    assert result.ret == 0 and not any("NOTHING CHECKED" in line for line in result.outlines)
    assert any(line.startswith("mlaspec: backend spec (float64 reference), scale tiny") for line in result.outlines)
    ran = [line.split("::")[1].split(" ")[0] for line in result.outlines if "::test_curated[" in line]
    assert ran == [f"test_curated[{c.id}]" for c in curated]  # the CLI's list, in its order, ids = case ids


def test_mutant_fails_with_reproducers_junit_and_report(suite, pytester):
    result = suite(
        "--mla-backend",
        "mutants:Log2Lse",
        "-m",
        "attention",
        "--mla-dtypes",
        "bfloat16",
        "--mla-examples",
        "4",
        "--mla-report",
        "rep",
        "--junitxml",
        "rep/junit.xml",
    )
    n = len(curated_cases(dtypes=("bfloat16",), ops=("attention",)))
    outcomes = result.parseoutcomes()
    failed = outcomes["failed"]
    assert 1 < failed <= n + 1 and "errors" not in outcomes  # (an empty-context case has no finite LSE to get wrong)
    out = result.stdout.str()
    assert "rerun: mlaspec check --backend mutants:Log2Lse --case 'attention[mha-causal-bfloat16]'" in out
    assert "minimal case: Case(op='attention', name='hyp-" in out
    # the generated case's command reruns exactly that case, and it fails again for the same reason
    command = next(line for line in result.outlines if "rerun: mlaspec check" in line and "--params" in line)
    argv = shlex.split(command.split("rerun: ", 1)[1])[1:] + ["--report", str(pytester.path / "again")]
    assert main(argv) == 1
    [again] = load_results(pytester.path / "again")
    reason = next(line for line in result.outlines if "generated attention case FAIL" in line)
    assert again.reason in reason
    # junit: each failure's message with its reproducer
    cases = list(ET.parse(pytester.path / "rep" / "junit.xml").getroot().iter("testcase"))
    failures = [c.find("failure") for c in cases if c.find("failure") is not None]
    assert len(cases) == n + 1 and len(failures) == failed
    assert all("rerun: mlaspec check" in f.get("message") for f in failures)
    # the report: every verdict streamed, the failures' sections with reproducers and heat maps
    results = load_results(pytester.path / "rep")
    assert len(results) == n + 1 and sum(r.verdict == "fail" for r in results) == failed
    page = (pytester.path / "rep" / "report.html").read_text()
    assert page.count('class="repro"') == failed and "data:image/png;base64," in page
    assert "mlaspec report: rep/report.html" in out


def test_mla_dcp_runs_both_dcp_ops_on_two_processes(suite):
    """``--mla-dcp 2``: the ``N_cp = 2`` cases of ``dcp_decode`` and ``dcp_decode_fp8`` on a group of two ranks
    (gloo on the CPU), idle ranks included."""
    names = "length-1-dcp2 or short-dcp2-i64-idle-rank"
    result = suite("--mla-backend", "torch", "--mla-dcp", "2", "--mla-dtypes", "bfloat16", "-v", "-k", names)
    result.assert_outcomes(passed=4)
    assert result.ret == 0
    ran = sorted(m[1] for line in result.outlines if (m := re.search(r"::test_curated\[(.+)\] PASSED", line)))
    assert ran == sorted(f"{op}[{n}-bfloat16]" for op in ("dcp_decode", "dcp_decode_fp8") for n in names.split(" or "))
    assert any("2 ranks over gloo" in line for line in result.outlines)


def test_unsupported_cases_skip_with_the_backends_reason(suite):
    result = suite("--mla-backend", "mutants:DecodeOnly", "-m", "mla_decode or attention", "-rs", "--mla-examples", "3")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0
    out = result.stdout.str()
    assert "needs 64 query heads" in out  # its own unsupported()
    assert "does not implement attention" in out and "does not support dtype float16" in out


def test_missing_backend_is_one_usage_error(suite):
    result = suite("-m", "mla_decode")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.str().count("no backend to check") == 1
    assert "--mla-backend NAME or the environment variable MLASPEC_BACKEND=NAME" in result.stderr.str()


def test_the_worker_starts_at_configure_and_is_the_one_the_cases_use(suite, spawned):
    """The plugin starts its worker in ``pytest_configure`` (conformance.spawn), before the ops' import, and the
    cases run in that one (a second start would show as a second spawn); a session that never needs it stops it."""
    case = curated_cases(ops=("attention",), dtypes=("float32",))[0]
    suite("--mla-backend", "torch", "--mla-dtypes", "float32", "-k", case.id).assert_outcomes(passed=1)
    assert len(spawned) == 1 and spawned[0].proc.poll() is not None
    spawned.clear()
    from mlaspec.conformance.plugin import _State  # an xdist worker's state, whose tests never ask for the backend

    state = _State("torch", "tiny", ("float32",), None, 60.0, 0, 0, "gw0")
    state.start()
    state.close()
    assert len(spawned) == 1 and spawned[0].proc.poll() is not None


@pytest.mark.parametrize("xdist_workers, dcp", [(None, None), ("4", None), (None, 2)])
def test_the_plugins_parent_takes_its_share_of_the_cpus_and_gives_it_back(spawned, monkeypatch, xdist_workers, dcp):
    """Beside its worker or its DCP group the plugin's process takes :func:`~mlaspec.conformance.cpus.parent_threads`
    (divided among pytest-xdist's workers, each such a parent) and has its threads back when the session ends."""
    import torch

    from mlaspec.conformance.cpus import USER_THREADS, parent_threads
    from mlaspec.conformance.plugin import _State

    for name in USER_THREADS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    if xdist_workers:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", xdist_workers)
    share = parent_threads(runs=int(xdist_workers or 1))
    before = torch.get_num_threads()
    torch.set_num_threads(share + 1)
    try:
        state = _State("torch", "tiny", ("float32",), None, 60.0, 0, 0, None, dcp=dcp)
        state.start()
        if dcp:
            state.backend()  # the group starts when a test first asks for the backend
        during = torch.get_num_threads()
        state.close()
        assert (during, torch.get_num_threads()) == (share, share + 1)
    finally:
        torch.set_num_threads(before)


def test_inert_in_other_test_runs(pytester, monkeypatch):
    """Loaded into a run that does not collect the suite, the plugin imports nothing heavy and changes nothing."""
    monkeypatch.delenv("MLASPEC_BACKEND", raising=False)
    pytester.makepyfile(test_other="import sys\n\ndef test_x():\n    assert 'torch' not in sys.modules\n")
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider", "--mla-report", "rep")
    result.assert_outcomes(passed=1)
    # no header line of its own (the plugin list may name the installed package), no report written
    out = result.stdout.str()
    assert "mlaspec: backend" not in out and "mlaspec environment" not in out and not (pytester.path / "rep").exists()


@pytest.mark.slow
def test_sharded_run_merges_worker_results(pytester, monkeypatch):
    """``-n 2``: each worker streams its own ``results-gwN.jsonl``; the report merges them in the curated order."""
    pytest.importorskip("xdist")
    monkeypatch.delenv("MLASPEC_BACKEND", raising=False)
    ops = ("attention", "merge_attn_states")
    result = pytester.runpytest_subprocess(
        *SUITE,
        "-n",
        "2",
        "--mla-backend",
        "spec",
        "-m",
        " or ".join(ops),
        "--mla-dtypes",
        "bfloat16",
        "--mla-examples",
        "2",
        "--mla-report",
        "rep",
    )
    curated = curated_cases(dtypes=("bfloat16",), ops=ops)
    result.assert_outcomes(passed=len(curated) + len(ops))
    rep = pytester.path / "rep"
    assert len(list(rep.glob("results-gw*.jsonl"))) == 2 and not (rep / "results.jsonl").exists()
    ids = [r.case_id for r in load_results(rep)]
    assert ids[: len(curated)] == [c.id for c in curated]  # merged in the curated order, generated ones after
    assert sorted(ids[len(curated) :]) == ["attention[generated]", "merge_attn_states[generated]"]
    assert f"{len(curated) + 2} passed, 0 failed" in (rep / "report.html").read_text()


@pytest.mark.slow
def test_a_sharded_worker_builds_the_next_tests_inputs_ahead(pytester, monkeypatch):
    """``-n 2``: xdist's order is its own, but each worker knows its next test (``nextitem``), and its judged worker
    builds that case's inputs while the backend runs the one before: the trace's ``prebuilt`` events, one a case so
    taken."""
    pytest.importorskip("xdist")
    monkeypatch.delenv("MLASPEC_BACKEND", raising=False)
    monkeypatch.setenv("MLASPEC_WARM_TRACE", str(pytester.path / "trace"))
    curated = curated_cases(dtypes=("float16",), ops=("attention",))
    args = (*SUITE, "-n", "2", "--mla-backend", "torch", "-m", "attention", "-k", "test_curated")
    pytester.runpytest_subprocess(*args, "--mla-dtypes", "float16").assert_outcomes(passed=len(curated))
    events = [line.split()[1:] for line in (pytester.path / "trace").read_text().splitlines()]
    prebuilt = [e[1] for e in events if e[0] == "prebuilt"]
    assert prebuilt and set(prebuilt) <= {c.id for c in curated}, events  # without the plan (before 2026-11-30) none


def test_cli_report_ignores_a_sharded_runs_stale_files(tmp_path):
    stale = Case("attention", "stale", "bfloat16", {})
    record = {"case_id": stale.id, "op": "attention", "dtype": "bfloat16", "verdict": "fail"}
    (tmp_path / "results-gw0.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["check", "--backend", "spec", "--ops", "merge_attn_states", "--report", str(tmp_path)]) == 0
    assert stale.id not in [r.case_id for r in load_results(tmp_path)]


def test_worker_device():
    assert worker_device("cuda", "gw5", 4) == "cuda:1"
    assert worker_device("cuda", "gw1", 1) == "cuda"  # one GPU: every worker shares it
    assert worker_device("cuda", None, 8) == "cuda"  # no xdist
    assert worker_device("cuda:3", "gw0", 8) == "cuda:3"  # an explicit device is kept
    assert worker_device("cpu", "gw2", 8) == "cpu"


@settings(max_examples=10)
@given(
    case=case_strategy("attention")
    | case_strategy("mla_prefill")
    | case_strategy("merge_attn_states")
    | case_strategy("mla_decode")
)
def test_generated_cases_pass_on_the_torch_backend(case):
    """The strategies draw only cases the spec accepts, and whose derived budgets a correct backend meets."""
    r = run_case(TorchBackend(), case, backend_name="torch")
    assert r.verdict == "pass", (case, r.reason)


@settings(max_examples=5)
@given(case=case_strategy("merge_attn_states", ("float16",)))
def test_generated_reproducer_names_the_same_case(tmp_path_factory, case):
    out = tmp_path_factory.mktemp("repro")
    argv = shlex.split(case.repro("spec"))[1:] + ["--report", str(out)]
    assert main(argv) == 0
    [r] = load_results(out)
    assert r.case_id == case.id and r.repro == case.repro("spec")


def test_case_strategy_rejects_bad_arguments():
    with pytest.raises(ValueError, match="op"):
        case_strategy("nope")
    with pytest.raises(ValueError, match="dtypes"):
        case_strategy("attention", ())
    assert set(GENERATED_OPS) <= {c.op for c in curated_cases()}


def test_the_reference_cache_and_its_off_switches(suite, pytester, monkeypatch):
    """The plugin keeps references in the cache; ``--mla-no-cache`` and the ini option ``mla_cache = false`` write
    nothing."""
    cache = pytester.path / "cache"
    monkeypatch.setenv("MLASPEC_CACHE_DIR", str(cache))
    args = ("--mla-backend", "torch", "-m", "merge_attn_states", "-k", "test_curated", "--mla-dtypes", "bfloat16")
    curated = curated_cases(dtypes=("bfloat16",), ops=("merge_attn_states",))
    suite(*args, "--mla-no-cache").assert_outcomes(passed=len(curated))
    assert not cache.exists()
    pytester.makeini("[pytest]\nmla_cache = false\n")
    suite(*args).assert_outcomes(passed=len(curated))
    assert not cache.exists()
    pytester.makeini("[pytest]\n")
    suite(*args).assert_outcomes(passed=len(curated))
    assert len(list(cache.rglob("*.pt"))) == len(curated)


def test_the_plugin_plans_the_worker_and_computes_references_ahead(suite, pytester, monkeypatch):
    """Without xdist the plugin does what ``mlaspec check`` does: the worker is told the cases in their order
    (``plan``), and a fork computes references from the last backwards (``ahead``) into the files the run reads."""
    from mlaspec.conformance import ahead, cpus

    monkeypatch.setenv("MLASPEC_CACHE_DIR", str(pytester.path / "cache"))
    monkeypatch.setenv("MLASPEC_WARM_TRACE", str(pytester.path / "trace"))
    monkeypatch.setattr(ahead, "MIN_MISSING", 1)
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 2)
    forked, init = [], ahead.Ahead.__init__
    record = lambda self, items, **kw: forked.append(items) or init(self, items, **kw)
    monkeypatch.setattr(ahead.Ahead, "__init__", record)
    curated = curated_cases(dtypes=("bfloat16",), ops=("dcp_decode",))
    args = ("--mla-backend", "torch", "-m", "dcp_decode", "-k", "test_curated", "--mla-dtypes", "bfloat16")
    suite(*args).assert_outcomes(passed=len(curated))
    events = [line.split()[1:] for line in (pytester.path / "trace").read_text().splitlines()]
    assert ["plan", str(len(curated))] in events
    assert [[c.id for c, _ in items] for items in forked] == [[c.id for c in curated]]  # in the order they ran
    assert len(list((pytester.path / "cache").rglob("*.pt"))) == len(curated)  # the fork's files are the run's
