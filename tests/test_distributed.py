"""DCP across real processes (``mlaspec check --dcp 2``, :mod:`mlaspec.conformance.distributed`): two ranks in a gloo
group on the CPU give the verdicts of the simulated ranks, through both of vLLM's combines; a rank that raises or
dies fails its case, named, and the run goes on."""

import os
import re
from pathlib import Path

import pytest

from mlaspec.conformance.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from mlaspec.conformance.heap import applies
from mlaspec.conformance.report import read_jsonl

TESTS = Path(__file__).resolve().parent
DCP2 = [f"dcp_decode[{name}-bfloat16]" for name in ("length-1-dcp2", "short-dcp2-i64-idle-rank", "mtp4-dcp2-i16")]
FP8 = [f"dcp_decode_fp8[{name}-bfloat16]" for name in ("length-1-dcp2", "short-dcp2-i64-idle-rank")]  # idle ranks
BAD = DCP2[0]  # misbehaving.BAD_DCP


@pytest.fixture
def misbehaving(monkeypatch):
    """``tests/misbehaving.py`` importable by the ranks (PYTHONPATH) and here."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(TESTS))


def _check(out: Path, backend: str, *extra: str, cases=DCP2) -> tuple[int, dict[str, dict]]:
    argv = ["check", "--backend", backend, "--report", str(out), "--timeout", "60"]
    status = main([*argv, *(a for c in cases for a in ("--case", c)), *extra])
    _, records = read_jsonl(out / "results.jsonl")
    return status, {r["case_id"]: r for r in records}


@pytest.mark.parametrize("backend", ["torch", "misbehaving:WithCombine"])  # all-gather + reduce-scatter; all-to-all
def test_two_processes_give_the_simulated_ranks_verdicts(tmp_path, misbehaving, backend):
    """Both ops: ``dcp_decode`` through the backend's ``mla_decode``, ``dcp_decode_fp8`` through its
    ``mla_decode_fp8`` on each rank's share of the fp8 records (idle ranks included)."""
    status, real = _check(tmp_path / "dcp", backend, "--dcp", "2", cases=DCP2 + FP8)
    _, simulated = _check(tmp_path / "sim", backend, cases=DCP2 + FP8)
    assert status == EXIT_OK and list(real) == DCP2 + FP8
    assert {c: r["verdict"] for c, r in real.items()} == {c: r["verdict"] for c, r in simulated.items()}
    assert {r["verdict"] for r in real.values()} == {"pass"}
    assert all(r["repro"].endswith(" --dcp 2") for r in real.values())
    assert "2 ranks over gloo" in (tmp_path / "dcp" / "environment.json").read_text()


def test_the_ranks_and_the_judged_worker_run_on_their_share_of_the_cpus(tmp_path, misbehaving):
    """Each rank takes its share of the CPUs (:func:`~mlaspec.conformance.cpus.worker_threads` of the group), as the
    judged worker does of a run without ``--dcp``: the backend's decode refuses any other thread count."""
    status, by_case = _check(tmp_path / "dcp", "misbehaving:ThreadsAsShared", "--dcp", "2", cases=DCP2[:1])
    assert status == EXIT_OK and by_case[DCP2[0]]["verdict"] == "pass", by_case
    status, by_case = _check(tmp_path / "one", "misbehaving:ThreadsAsShared", cases=DCP2[:1])
    assert status == EXIT_OK and by_case[DCP2[0]]["verdict"] == "pass", by_case


@pytest.mark.skipif(not applies(), reason="glibc's malloc with its parameters unset: else nothing changes")
def test_the_ranks_and_the_judged_worker_keep_freed_memory(tmp_path, misbehaving):
    """Each rank keeps the memory it frees (:mod:`mlaspec.conformance.heap`), as the judged worker of a run without
    ``--dcp`` does: the backend's decode refuses a process that gives freed memory back."""
    status, by_case = _check(tmp_path / "dcp", "misbehaving:HeapKept", "--dcp", "2", cases=DCP2[:1])
    assert status == EXIT_OK and by_case[DCP2[0]]["verdict"] == "pass", by_case
    status, by_case = _check(tmp_path / "one", "misbehaving:HeapKept", cases=DCP2[:1])
    assert status == EXIT_OK and by_case[DCP2[0]]["verdict"] == "pass", by_case


@pytest.mark.parametrize(
    "adapter, verdict, reason, timeout",
    [
        ("RankRaises", "error", "rank 1: RuntimeError: rank one's kernel refused the shard", 8),
        # its broken device fails its collectives too, so rank 0 waits in one (past the 10 s grace: a 30 s timeout);
        # the error is rank 1's, and a new group takes the next case
        (
            "RankLosesItsDevice",
            "error",
            r"rank 1: RuntimeError: CUDA error: an illegal memory access was encountered; rank 0 gave no answer "
            r"within 10 s of it \(left waiting in a collective\); the group was restarted",
            30,
        ),
        ("RankDies", "crash", "rank 1 exited with status 3 during the call", 8),
        # rank 0 may be waiting for rank 1 in a collective when the case times out: then it gave no answer either
        ("RankHangs", "timeout", r"timed out after 8 s: rank (0, )?1 gave no answer", 8),
    ],
)
def test_a_misbehaving_rank_fails_only_its_case(tmp_path, misbehaving, adapter, verdict, reason, timeout):
    status, by_case = _check(tmp_path, f"misbehaving:{adapter}", "--dcp", "2", "--timeout", str(timeout))
    assert status == EXIT_FAILED
    assert list(by_case) == DCP2  # the cases after the bad one ran, on a new group after a death
    assert by_case[BAD]["verdict"] == verdict and re.search(reason, by_case[BAD]["reason"]), by_case[BAD]
    if verdict == "error":  # the rank that stopped only because rank 1 failed is not blamed
        assert by_case[BAD]["reason"].startswith("rank 1: ") and "rank 0:" not in by_case[BAD]["reason"]
    assert {by_case[c]["verdict"] for c in DCP2[1:]} == {"pass"}


@pytest.mark.parametrize(
    "extra",
    [
        ("--dcp", "1"),
        ("--dcp", "2", "--ops", "attention"),
        ("--dcp", "2", "--ops", "dcp_decode_fp8,mla_decode"),
        ("--dcp", "2", "--isolation", "none"),
    ],
)
def test_dcp_usage_errors(tmp_path, extra):
    assert main(["check", "--report", str(tmp_path), *extra]) == EXIT_USAGE


def test_dcp_runs_both_ops_or_those_named():
    import argparse

    from mlaspec.conformance.cli import _dcp_ops

    args = argparse.Namespace(dcp=2, isolation="process")
    assert _dcp_ops(args, None) == ("dcp_decode", "dcp_decode_fp8")
    assert _dcp_ops(args, ("dcp_decode_fp8",)) == ("dcp_decode_fp8",)


class _ExitingRank:
    """A rank whose pipe closed before the kernel reaped it (a loaded machine widens that window)."""

    exitcode = None

    def is_alive(self):
        return self.exitcode is None

    def join(self, timeout=None):
        self.exitcode = 3


class _ClosedPipe:
    def poll(self, timeout=0):
        return True

    def recv(self):
        raise EOFError


def test_a_rank_whose_pipe_closed_is_a_crash_even_before_it_is_reaped(tmp_path):
    from mlaspec.conformance.distributed import RankGroup

    group = object.__new__(RankGroup)  # no processes: the two fakes above stand for one rank
    group.world_size, group.timeout, group._dir = 1, 8.0, tmp_path
    group._procs, group._conns = [_ExitingRank()], [_ClosedPipe()]
    assert group._gather(group.timeout) == {0: None}
    outcome = group._silent_outcome([0], 0.1)
    assert outcome.kind == "crash" and "rank 0 exited with status 3" in outcome.reason, outcome.reason
