"""The CPUs a run may use (:func:`mlaspec.conformance.cpus.usable_cpus`): its affinity, capped by a cgroup v2 quota;
and how the run's processes divide them (:func:`~mlaspec.conformance.cpus.parent_threads`,
:func:`~mlaspec.conformance.cpus.worker_threads`)."""

import math
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.conformance.cpus import USER_THREADS, parent_threads, usable_cpus, worker_threads

AFFINITY = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cgroup(tmp_path, text):
    path = tmp_path / "cpu.max"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, expected",
    [
        ("max 100000\n", AFFINITY),  # no quota
        ("100000 100000\n", 1),  # --cpus 1
        ("150000 100000\n", min(AFFINITY, 2)),  # 1.5 CPUs of time: two may run
        ("800000 100000\n", min(AFFINITY, 8)),
        ("garbage\n", AFFINITY),  # a line we do not know: the affinity
    ],
)
def test_a_quota_caps_the_affinity(tmp_path, text, expected):
    assert usable_cpus(_cgroup(tmp_path, text)) == expected


def test_no_cgroup_file_is_the_affinity(tmp_path):
    assert usable_cpus(tmp_path / "absent") == AFFINITY


def test_a_pinned_process_counts_its_cpus_not_the_hosts(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert usable_cpus(tmp_path / "absent") == 3


@given(quota=st.integers(1, 10**8), period=st.integers(1000, 10**6))
def test_never_more_than_the_quota_nor_the_affinity_nor_below_one(tmp_path_factory, quota, period):
    path = _cgroup(tmp_path_factory.mktemp("cg"), f"{quota} {period}\n")
    got = usable_cpus(path)
    assert got == max(1, min(AFFINITY, math.ceil(quota / period)))


@pytest.mark.parametrize("cpus, parent, worker", [(1, 1, 1), (2, 1, 1), (3, 1, 1), (8, 4, 2), (16, 8, 4), (64, 32, 4)])
def test_the_parent_takes_half_the_cpus_and_the_worker_a_quarter_up_to_four(cpus, parent, worker):
    assert (parent_threads(cpus), worker_threads(cpus)) == (parent, worker)


@pytest.mark.parametrize("cpus, ranks, each", [(2, 2, 1), (16, 2, 2), (16, 8, 1), (64, 2, 4), (64, 4, 4), (64, 8, 2)])
def test_a_dcp_groups_ranks_share_a_quarter_of_the_cpus(cpus, ranks, each):
    assert worker_threads(cpus, workers=ranks) == each


_THREADS_IN_A_RUN = """
import sys, torch
from mlaspec.conformance import cli, runner
start, report, case, *extra = sys.argv[1:]
if int(start):
    torch.set_num_threads(int(start))
seen, run_cases = [], runner.run_cases
runner.run_cases = lambda *a, **k: seen.append(torch.get_num_threads()) or run_cases(*a, **k)
status = cli.main(["check", "--case", case, "--report", report, *extra])
print(status, seen[0], torch.get_num_threads())
"""


def _threads_in_a_run(
    tmp_path, start: int, *extra: str, user: dict | None = None, case: str = "merge_attn_states[tp8-float16]"
) -> tuple[int, int, int]:
    """``mlaspec check`` of ``case`` in a fresh process whose torch threads were ``start`` (0: torch's default) and
    whose environment adds ``user``: its exit status, its threads while the cases ran, and after."""
    env = {k: v for k, v in os.environ.items() if k not in USER_THREADS} | (user or {})
    env["MLASPEC_CACHE_DIR"] = str(tmp_path / "cache")
    argv = [sys.executable, "-c", _THREADS_IN_A_RUN, str(start), str(tmp_path / "report"), case, *extra]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.split()
    return int(out[-3]), int(out[-2]), int(out[-1])


def test_a_run_with_a_worker_leaves_it_the_cpus_the_parent_does_not_take(tmp_path):
    """torch's default gives every process every CPU: the parent of an isolated run or of a DCP group takes its share
    while the cases run and gives it back after; a run without a worker keeps what it had, and so does a user's
    ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS``."""
    start = parent_threads() + 1
    assert _threads_in_a_run(tmp_path / "isolated", start) == (0, parent_threads(), start)
    dcp = "dcp_decode[length-1-dcp2-bfloat16]"
    assert _threads_in_a_run(tmp_path / "dcp", start, "--dcp", "2", case=dcp) == (0, parent_threads(), start)
    assert _threads_in_a_run(tmp_path / "alone", start, "--isolation", "none") == (0, start, start)
    user = 1 if parent_threads() > 1 else 2  # not the share, and no more than the CPUs (torch caps it there)
    for name in USER_THREADS:
        got = _threads_in_a_run(tmp_path / name, 0, user={name: str(user)})
        assert got[:2] == (0, user), name


def test_parallel_runs_divide_the_parents_share():
    assert [parent_threads(16, runs=r) for r in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
