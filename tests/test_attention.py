"""attention / attention_varlen / causal_mask against independent computations, and their invariants."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.spec.attention import attention, attention_varlen, causal_mask


def naive(q, k, v, scale, allowed):
    """Loop-per-row reference with torch.softmax: q [S_q, H_q, D], k/v [S_kv, H_kv, *], allowed [S_q, S_kv]."""
    s_q, h_q, _ = q.shape
    g = h_q // k.shape[1]
    out = torch.zeros(s_q, h_q, v.shape[-1], dtype=torch.float64)
    lse = torch.full((h_q, s_q), -math.inf, dtype=torch.float64)
    for h in range(h_q):
        for i in range(s_q):
            keys = allowed[i].nonzero().flatten()
            if len(keys) == 0:
                continue
            s = (k[keys, h // g].double() @ q[i, h].double()) * scale
            out[i, h] = torch.softmax(s, 0) @ v[keys, h // g].double()
            lse[h, i] = torch.log(torch.exp(s).sum())
    return out, lse


@st.composite
def problems(draw, max_len=6):
    b = draw(st.integers(1, 2))
    s_q = draw(st.integers(1, max_len))
    s_kv = draw(st.integers(0, max_len))
    h_kv = draw(st.sampled_from([1, 2]))
    h_q = h_kv * draw(st.sampled_from([1, 2, 3]))
    d, dv = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    return mk(b, s_q, h_q, d), mk(b, s_kv, h_kv, d), mk(b, s_kv, h_kv, dv)


def test_causal_mask_is_flashmla_tril():
    # FlashMLA tests/test_flash_mla_dense_decoding.py: mask = ones(s_q, s_k).tril(diagonal=s_k - s_q)
    for s_q, s_kv in [(2, 4), (1, 5), (4, 4), (5, 3), (3, 0)]:
        expected = torch.ones(s_q, s_kv).tril(diagonal=s_kv - s_q).bool()
        assert torch.equal(causal_mask(s_q, s_kv), expected)


def test_worked_example_two_keys():
    # one query, keys with logits 0 and log(3): weights 1/4 and 3/4, lse = log(4)
    q = torch.tensor([[[[1.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[0.0]], [[math.log(3)]]]], dtype=torch.float64)
    v = torch.tensor([[[[4.0]], [[8.0]]]], dtype=torch.float64)
    out, lse = attention(q, k, v, scale=1.0)
    assert out.item() == pytest.approx(0.25 * 4 + 0.75 * 8)
    assert lse.item() == pytest.approx(math.log(4))


@given(problems(), st.booleans())
def test_matches_naive(p, causal):
    q, k, v = p
    out, lse = attention(q, k, v, causal=causal)
    assert out.dtype == lse.dtype == torch.float64
    scale = 1 / math.sqrt(q.shape[-1])
    for b in range(q.shape[0]):
        allowed = (
            causal_mask(q.shape[1], k.shape[1]) if causal else torch.ones(q.shape[1], k.shape[1], dtype=torch.bool)
        )
        o_ref, l_ref = naive(q[b], k[b], v[b], scale, allowed)
        torch.testing.assert_close(out[b], o_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[b], l_ref, rtol=1e-12, atol=1e-12)


@given(problems())
def test_key_permutation_invariance(p):
    q, k, v = p
    perm = torch.randperm(k.shape[1], generator=torch.Generator().manual_seed(0))
    a, b = attention(q, k, v), attention(q, k[:, perm], v[:, perm])
    torch.testing.assert_close(a.out, b.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.lse, b.lse, rtol=1e-12, atol=1e-12)


@given(problems())
def test_gqa_equals_mha_with_repeated_heads(p):
    q, k, v = p
    g = q.shape[2] // k.shape[2]
    a = attention(q, k, v)
    b = attention(q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2))
    torch.testing.assert_close(a.out, b.out, rtol=1e-12, atol=1e-12)


def test_empty_rows_give_zero_and_neg_inf():
    q, k, v = torch.randn(1, 4, 2, 3), torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 5)
    out, lse = attention(q, k, v, causal=True)  # S_q > S_kv: the first two queries see nothing
    assert torch.equal(out[0, :2], torch.zeros(2, 2, 5, dtype=torch.float64))
    assert torch.isneginf(lse[0, :, :2]).all() and torch.isfinite(lse[0, :, 2:]).all()
    out, lse = attention(q, k[:, :0], v[:, :0])
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_mask_and_causal_combine():
    q, k, v = torch.randn(1, 3, 1, 2), torch.randn(1, 3, 1, 2), torch.randn(1, 3, 1, 2)
    mask = torch.tensor([[[True, False, True]] * 3])
    a = attention(q, k, v, causal=True, mask=mask)
    b = attention(q, k, v, mask=mask & causal_mask(3, 3))
    torch.testing.assert_close(a.out, b.out)
    per_head = attention(q, k, v, mask=mask[:, None])
    torch.testing.assert_close(per_head.out, attention(q, k, v, mask=mask).out)


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=3), st.booleans())
def test_varlen_equals_each_sequence_alone(lens, causal):
    lens = [(s_q, s_q + c) for s_q, c in lens]  # keys = context + the queries themselves
    cq = torch.tensor([0] + [s for s, _ in lens]).cumsum(0)
    ck = torch.tensor([0] + [s for _, s in lens]).cumsum(0)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(int(cq[-1]), 2, 3, generator=g, dtype=torch.float64)
    k = torch.randn(int(ck[-1]), 1, 3, generator=g, dtype=torch.float64)
    v = torch.randn(int(ck[-1]), 1, 4, generator=g, dtype=torch.float64)
    out, lse = attention_varlen(q, k, v, cq, ck, causal=causal)
    assert lse.shape == (2, q.shape[0])
    for b in range(len(lens)):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        o, l = attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal=causal)
        torch.testing.assert_close(out[qs:qe], o[0])
        torch.testing.assert_close(lse[:, qs:qe], l[0])


@pytest.mark.parametrize(
    "args, kwargs, err, match",
    [
        (
            (torch.randn(2, 3, 4), torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)),
            {},
            ValueError,
            "q must have rank 4",
        ),
        (
            (torch.randn(2, 3, 4, 8), torch.randn(3, 3, 1, 8), torch.randn(3, 3, 1, 8)),
            {},
            ValueError,
            "k must have shape",
        ),
        ((torch.randn(1, 3, 4, 8), torch.randn(1, 3, 1, 7), torch.randn(1, 3, 1, 8)), {}, ValueError, "D_qk=8"),
        ((torch.randn(1, 3, 4, 8), torch.randn(1, 3, 3, 8), torch.randn(1, 3, 3, 8)), {}, ValueError, "divides H_q"),
        ((torch.randn(1, 3, 4, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 2, 1, 8)), {}, ValueError, "v must have"),
        (
            (torch.ones(1, 3, 4, 8, dtype=torch.int64), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)),
            {},
            TypeError,
            "q must have dtype",
        ),
        (([1.0], torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)), {}, TypeError, "q must be a torch.Tensor"),
        (
            (torch.randn(1, 3, 4, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)),
            {"mask": torch.ones(1, 2, 3).bool()},
            ValueError,
            "mask",
        ),
        (
            (torch.randn(1, 3, 4, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)),
            {"mask": torch.ones(1, 3, 3)},
            TypeError,
            "mask must have dtype bool",
        ),
        (
            (torch.randn(1, 3, 4, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)),
            {"scale": math.nan},
            ValueError,
            "scale",
        ),
        (
            (torch.randn(1, 3, 4, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)),
            {"causal": 1},
            TypeError,
            "causal",
        ),
    ],
)
def test_bad_input(args, kwargs, err, match):
    with pytest.raises(err, match=match):
        attention(*args, **kwargs)


def test_varlen_bad_cu_seqlens():
    q, k, v = torch.randn(4, 1, 2), torch.randn(4, 1, 2), torch.randn(4, 1, 2)
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        attention_varlen(q, k, v, torch.tensor([0, 3, 2, 4]), torch.tensor([0, 1, 2, 4]))
    with pytest.raises(ValueError, match="cu_seqlens_k must end at T_kv=4"):
        attention_varlen(q, k, v, torch.tensor([0, 4]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="cu_seqlens_k must have shape"):
        attention_varlen(q, k, v, torch.tensor([0, 4]), torch.tensor([0, 1, 4]))


def test_keys_no_query_may_read_never_leak():
    # NaN in keys/values outside every query's mask (unused cache slots) must not reach the output
    q, k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 5, 1, 4), torch.randn(1, 5, 1, 3)
    k[:, 4], v[:, 4] = math.nan, math.nan  # the last key: masked for both queries below
    mask = torch.tensor([[[True, True, False, True, False], [True, False, True, True, False]]])
    out, lse = attention(q, k, v, mask=mask)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref = attention(q, k[:, :4], v[:, :4], mask=mask[..., :4])
    torch.testing.assert_close(out, ref.out)
    k[:, 1], v[:, 1] = math.nan, math.nan  # a key one query may read: garbage in, garbage out for that query
    assert torch.isnan(attention(q, k, v, mask=mask).out[0, 0]).all()
