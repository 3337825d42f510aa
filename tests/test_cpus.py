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

from mlaspec.conformance.cpus import parent_threads, usable_cpus, worker_threads

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


_THREADS_AFTER_A_RUN = """
import sys, torch
from mlaspec.conformance.cli import main
status = main(["check", "--case", "merge_attn_states[tp8-float16]", "--report", sys.argv[1], *sys.argv[2:]])
print(status, torch.get_num_threads())
"""


def _threads_after_a_run(tmp_path, *extra: str, omp: str | None = None) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | ({"OMP_NUM_THREADS": omp} if omp else {})
    env["MLASPEC_CACHE_DIR"] = str(tmp_path / "cache")
    argv = [sys.executable, "-c", _THREADS_AFTER_A_RUN, str(tmp_path / "report"), *extra]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.split()
    return int(out[-2]), int(out[-1])


def test_a_run_with_a_worker_leaves_it_the_cpus_the_parent_does_not_take(tmp_path):
    """torch's default gives every process every CPU: the parent of an isolated run takes its share instead, a run
    without a worker keeps the default, and a user's ``OMP_NUM_THREADS`` is kept."""
    default = int(
        subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
            env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    if default == parent_threads():
        pytest.skip(f"torch's default here ({default} threads) is already the parent's share")
    assert _threads_after_a_run(tmp_path / "isolated") == (0, parent_threads())
    assert _threads_after_a_run(tmp_path / "alone", "--isolation", "none") == (0, default)
    user = 1 if parent_threads() > 1 else 2  # not the share, and no more than the CPUs (torch caps it there)
    assert _threads_after_a_run(tmp_path / "user", omp=str(user)) == (0, user)
