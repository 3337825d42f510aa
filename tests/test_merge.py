"""merge_attn_states: the worked example, merging over any split equals attention over all keys, vLLM's inf rules."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.spec.attention import attention_varlen
from mlaspec.spec.merge import merge_attn_states, merge_attn_states_n


def partial(q, k, v, lo, hi):
    """Attention of every query over keys [lo, hi) (one sequence): out [T, H, D], lse [H, T]."""
    t = torch.tensor
    return attention_varlen(q, k[lo:hi], v[lo:hi], t([0, q.shape[0]]), t([0, hi - lo]))


@st.composite
def split_problem(draw):
    s_q, s_kv, h = draw(st.integers(1, 4)), draw(st.integers(1, 8)), draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(0, s_kv), min_size=1, max_size=4)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(s_q, h, 3, generator=g, dtype=torch.float64) * 2
    k = torch.randn(s_kv, 1, 3, generator=g, dtype=torch.float64)
    v = torch.randn(s_kv, 1, 2, generator=g, dtype=torch.float64)
    bounds = [0, *cuts, s_kv]
    return q, k, v, list(zip(bounds[:-1], bounds[1:]))


def test_worked_example():
    t = lambda x: torch.tensor(x, dtype=torch.float64)
    out, lse = merge_attn_states(t([[[2.0]]]), t([[1.0]]), t([[[5.0]]]), t([[0.0]]))
    e = math.e
    assert out.item() == pytest.approx((e * 2 + 5) / (e + 1))
    assert lse.item() == pytest.approx(math.log(e + 1))


@given(split_problem())
def test_merge_over_any_split_equals_full(p):
    q, k, v, parts = p
    full = partial(q, k, v, 0, k.shape[0])
    pieces = [partial(q, k, v, lo, hi) for lo, hi in parts]  # some pieces may be empty (lse -inf)
    merged = merge_attn_states_n([o for o, _ in pieces], [l for _, l in pieces])
    torch.testing.assert_close(merged.out, full.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged.lse, full.lse, rtol=1e-12, atol=1e-12)
    folded = pieces[0]  # pairwise fold, as vLLM's chunk loop does
    for o, l in pieces[1:]:
        folded = merge_attn_states(folded[0], folded[1], o, l)
    torch.testing.assert_close(folded.out, full.out, rtol=1e-12, atol=1e-12)


@given(split_problem())
def test_commutative(p):
    q, k, v, parts = p
    pieces = [partial(q, k, v, lo, hi) for lo, hi in parts]
    a = merge_attn_states_n([o for o, _ in pieces], [l for _, l in pieces])
    b = merge_attn_states_n([o for o, _ in pieces[::-1]], [l for _, l in pieces[::-1]])
    torch.testing.assert_close(a.out, b.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.lse, b.lse, rtol=1e-12, atol=1e-12)


def test_associative():
    g = torch.Generator().manual_seed(3)
    outs = [torch.randn(2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    lses = [torch.randn(3, 2, generator=g, dtype=torch.float64) for _ in range(3)]
    left = merge_attn_states(*merge_attn_states(outs[0], lses[0], outs[1], lses[1]), outs[2], lses[2])
    right = merge_attn_states(outs[0], lses[0], *merge_attn_states(outs[1], lses[1], outs[2], lses[2]))
    torch.testing.assert_close(left.out, right.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(left.lse, right.lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("empty_lse", [math.inf, -math.inf])
def test_empty_part_gets_zero_weight(empty_lse):
    # FA2 and FlashMLA sparse report an empty row as +inf, FA3 as -inf: vLLM treats both as empty
    o_empty, o = torch.full((1, 1, 2), 7.0), torch.tensor([[[1.0, 2.0]]])
    out, lse = merge_attn_states(o_empty, torch.tensor([[empty_lse]]), o, torch.tensor([[0.5]]))
    torch.testing.assert_close(out, o.double())
    assert lse.item() == 0.5


def test_both_empty_copies_prefix_and_gives_neg_inf():
    # vLLM csrc/attention/merge_attn_states.cu: "we simply emit prefix_output ... and prefix_lse (-inf)"
    p, s = torch.tensor([[[0.0, 0.0]]]), torch.tensor([[[3.0, 4.0]]])
    out, lse = merge_attn_states(p, torch.tensor([[math.inf]]), s, torch.tensor([[-math.inf]]))
    assert torch.equal(out, p.double()) and torch.isneginf(lse).all()


def test_bad_input():
    o, l = torch.randn(2, 3, 4), torch.randn(3, 2)
    with pytest.raises(ValueError, match="suffix_lse must have shape"):
        merge_attn_states(o, l, o, torch.randn(2, 3))
    with pytest.raises(ValueError, match="prefix_output must have rank 3"):
        merge_attn_states(o[0], l, o, l)
    with pytest.raises(TypeError, match="suffix_output must have dtype"):
        merge_attn_states(o, l, o.int(), l)
    with pytest.raises(ValueError, match="equal length"):
        merge_attn_states_n([o, o], [l])
    with pytest.raises(ValueError, match="non-empty"):
        merge_attn_states_n([], [])
    with pytest.raises(TypeError, match="sequences"):
        merge_attn_states_n(o, l)
