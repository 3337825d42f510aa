"""Tests for mlaspec.spec.topk: top-k selection and the tie-aware agreement checker."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.spec.indexer import indexer_logits, kv_spans_from_batches
from mlaspec.spec.topk import topk_agreement, topk_indices, topk_valid_mask

NEG_INF = -math.inf


@st.composite
def logit_rows(draw, max_m=4, max_n=9):
    """Small logits with many ties (few distinct values) and some -inf holes."""
    m = draw(st.integers(1, max_m))
    n = draw(st.integers(1, max_n))
    vals = draw(st.lists(st.sampled_from([NEG_INF, -1.0, 0.0, 0.5, 2.0, 3.0]), min_size=m * n, max_size=m * n))
    return torch.tensor(vals, dtype=torch.float64).reshape(m, n)


def test_worked_example_ties_lowest_index_first_and_padding():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, NEG_INF], [NEG_INF, 5.0, NEG_INF, NEG_INF, NEG_INF, NEG_INF]])
    out = topk_indices(logits, 2)
    assert out.indices.tolist() == [[1, 2], [1, -1]]
    assert out.values[1, 1].item() == NEG_INF and out.num_valid.tolist() == [5, 1]
    assert out.indices.dtype == torch.int32


def test_prefill_relative_indices_match_kernel_convention():
    # top_k_per_row_prefill writes idx - rowStart: a position within the request's keys.
    logits = torch.tensor([[9.0, 9.0, 1.0, 4.0, 2.0, 9.0]])
    out = topk_indices(logits, 4, row_starts=torch.tensor([2]), row_ends=torch.tensor([5]), relative=True)
    assert out.indices.tolist() == [[1, 2, 0, -1]]


@given(logit_rows(), st.integers(1, 6))
def test_topk_is_valid_and_maximal(logits, k):
    out = topk_indices(logits, k)
    verdict = topk_agreement(out.indices, logits, k)
    assert verdict.ok, verdict.reason
    valid = topk_valid_mask(logits)
    for m in range(logits.shape[0]):
        chosen = [i for i in out.indices[m].tolist() if i >= 0]
        assert all(bool(valid[m, i]) for i in chosen)
        rest = valid[m].clone()
        rest[chosen] = False
        if chosen and rest.any():
            assert logits[m, chosen].min() >= logits[m][rest].max()


@given(logit_rows(), st.integers(1, 12))
def test_padding_count_is_k_minus_valid(logits, k):
    out = topk_indices(logits, k)
    n_valid = torch.isfinite(logits).sum(dim=1)
    pads = (out.indices == -1).sum(dim=1)
    assert torch.equal(pads, (k - n_valid).clamp_min(0))
    for row in out.indices.tolist():  # -1 only trails
        assert row == [i for i in row if i != -1] + [-1] * row.count(-1)


@given(logit_rows(), st.integers(1, 6), st.randoms(use_true_random=False))
def test_key_permutation_changes_only_indices(logits, k, rnd):
    n = logits.shape[1]
    perm = list(range(n))
    rnd.shuffle(perm)
    perm_t = torch.tensor(perm)
    base = topk_indices(logits, k)
    moved = topk_indices(logits[:, perm_t], k)
    # the chosen values are the same multiset; mapped back, the selection is still a valid top-k
    assert torch.equal(base.values, moved.values)
    back = torch.where(moved.indices >= 0, perm_t[moved.indices.long().clamp_min(0)], -1)
    assert topk_agreement(back, logits, k).ok
    distinct = all(len(set(r)) == len(r) for r in logits.tolist())
    if distinct:
        assert [sorted(r) for r in back.tolist()] == [sorted(r) for r in base.indices.tolist()]


def test_checker_accepts_every_tie_choice_and_rejects_a_wrong_one():
    row = torch.tensor([[5.0, 2.0, 4.0, 2.0, 1.0, 2.0, NEG_INF]])
    k = 3  # 5 and 4 are in; one of the three 2.0s (columns 1, 3, 5) fills the last slot
    for tie in (1, 3, 5):
        for order in itertools.permutations([0, 2, tie]):  # order is free
            assert topk_agreement(torch.tensor([order]), row, k).ok
    wrong = topk_agreement(torch.tensor([[0, 2, 4]]), row, k)  # 1.0 chosen while a 2.0 is left out
    assert not wrong.ok and wrong.worst_row == 0 and "not maximal" in wrong.reason
    missing_top = topk_agreement(torch.tensor([[1, 3, 5]]), row, k)
    assert not missing_top.ok


@given(logit_rows(), st.integers(1, 6))
def test_checker_accepts_all_tie_choices_generally(logits, k):
    """Every selection drawn by breaking ties the other way (highest index first) also passes."""
    rev = topk_indices(logits.flip(1), k)
    n = logits.shape[1]
    flipped_back = torch.where(rev.indices >= 0, n - 1 - rev.indices, -1)
    assert topk_agreement(flipped_back, logits, k).ok


@pytest.mark.parametrize(
    ("candidate", "needle"),
    [
        ([[0, 0, -1]], "duplicate"),
        ([[0, 9, -1]], "out of range"),
        ([[-1, 0, 2]], "trailing"),
        ([[0, 3, -1]], "not valid"),
        ([[0, -1, -1]], "expected 3 real indices"),
        ([[0, -2, -1]], "out of range"),
    ],
)
def test_checker_rejects_structural_errors(candidate, needle):
    logits = torch.tensor([[1.0, 0.5, 2.0, NEG_INF]])
    verdict = topk_agreement(torch.tensor(candidate), logits, 3)
    assert not verdict.ok and needle in verdict.reason and verdict.bad_rows == (0,)


def test_checker_reports_worst_row():
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    cand = torch.tensor([[0, 1], [0, 2], [2, 1]])  # row 1 deficit 1.0, row 2 deficit 2.0
    verdict = topk_agreement(cand, logits, 2)
    assert verdict.bad_rows == (1, 2) and verdict.worst_row == 2 and verdict.reason.startswith("row 2")


def test_row_range_and_relative_checker_round_trip():
    q = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    k = torch.randn(9, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ks, ke = kv_spans_from_batches(torch.tensor([0, 2, 5]), torch.tensor([4, 5]))
    logits = indexer_logits(q, k, w, ks, ke)
    absolute = topk_indices(logits, 3)
    rel = topk_indices(logits, 3, row_starts=ks, row_ends=ke, relative=True)
    shifted = torch.where(rel.indices >= 0, rel.indices + ks[:, None].int(), -1)
    assert torch.equal(shifted, absolute.indices)
    assert topk_agreement(rel.indices, logits, 3, row_starts=ks, row_ends=ke, relative=True).ok
    assert not topk_agreement(absolute.indices, logits, 3, row_starts=ks, row_ends=ke, relative=True).ok


def test_bad_inputs_name_the_argument():
    logits = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="k must be >= 1"):
        topk_indices(logits, 0)
    with pytest.raises(ValueError, match="logits must not contain NaN"):
        topk_indices(torch.tensor([[float("nan")]]), 1)
    with pytest.raises(ValueError, match="row_starts must have shape"):
        topk_indices(logits, 1, row_starts=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="row_starts must be given"):
        topk_indices(logits, 1, relative=True)
    with pytest.raises(ValueError, match="candidate must have shape"):
        topk_agreement(torch.zeros(2, 4, dtype=torch.int32), logits, 3)
    with pytest.raises(TypeError, match="candidate must have dtype"):
        topk_agreement(torch.zeros(2, 3), logits, 3)
