"""The CPUs a run may use (:func:`mlaspec.conformance.cpus.usable_cpus`): its affinity, capped by a cgroup v2 quota."""

import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.conformance.cpus import usable_cpus

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
