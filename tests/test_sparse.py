"""Tests for mlaspec.spec.sparse: sparse MLA as FlashMLA's kernels define it (tests/ref.py)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.spec.attention import attention
from mlaspec.spec.merge import merge_attn_states
from mlaspec.spec.sparse import (
    global_slot_indices,
    indices_to_mask,
    sparse_attention,
    sparse_decode,
    sparse_prefill,
    valid_slots,
)


@st.composite
def problems(draw, h_kv=None):
    """A small sparse problem: q, kv, indices (with hostile invalid values), optional topk_length."""
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    h_kv = draw(st.sampled_from([1, 2])) if h_kv is None else h_kv
    h_q = h_kv * draw(st.integers(1, 3))
    s_q, s_kv = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    k = draw(st.integers(1, 6))
    d_qk = draw(st.integers(2, 6))
    d_v = draw(st.integers(1, d_qk))
    q = torch.randn(s_q, h_q, d_qk, generator=g, dtype=torch.float64)
    kv = torch.randn(s_kv, h_kv, d_qk, generator=g, dtype=torch.float64)
    # unique valid indices per row, padded with a mix of FlashMLA's invalid sentinels
    rows = [torch.randperm(s_kv, generator=g)[:k] for _ in range(s_q * h_kv)]
    bad = torch.tensor([-1, s_kv, -(2**31), 2**31 - 1, -7, s_kv + 3])
    idx = torch.stack([torch.cat([r, bad[torch.randint(0, 6, (k - r.numel(),), generator=g)]]) for r in rows])
    idx = idx.reshape(s_q, h_kv, k).to(torch.int32)
    tl = None
    if draw(st.booleans()):
        tl = torch.randint(0, k + 1, (s_q,), generator=g, dtype=torch.int32)
    return dict(q=q, kv=kv, indices=idx, topk_length=tl, d_v=d_v, scale=draw(st.sampled_from([0.5, 0.3, 1.0])))


def _dense(p):
    """Masked dense attention over the mask the indices stand for (valid when the indices are unique)."""
    q, kv, d_v = p["q"], p["kv"], p["d_v"]
    g = q.shape[1] // kv.shape[1]
    mask = indices_to_mask(p["indices"], kv.shape[0], p["topk_length"]).repeat_interleave(g, dim=1)  # [S_q, H_q, S_kv]
    return attention(q[None], kv[None], kv[None, ..., :d_v], scale=p["scale"], mask=mask.transpose(0, 1)[None])


@given(problems())
def test_sparse_attention_equals_masked_dense(p):
    out, lse, max_logits = sparse_attention(**p)
    d = _dense(p)
    empty = torch.isneginf(d.lse[0].T)
    torch.testing.assert_close(out, d.out[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isposinf(lse), empty), "empty rows must (only) have lse +inf"
    torch.testing.assert_close(lse[~empty], d.lse[0].T[~empty], rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isneginf(max_logits), empty)


@given(st.integers(1, 4), st.integers(1, 8), st.integers(0, 2**16))
def test_sparse_attention_with_all_indices_equals_dense(s_q, s_kv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, 4, 8, generator=g, dtype=torch.float64)
    kv = torch.randn(s_kv, 1, 8, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(s_kv, generator=g) for _ in range(s_q)])[:, None].to(torch.int32)
    out, lse, _ = sparse_attention(q, kv, idx, scale=0.25, d_v=5)
    d = attention(q[None], kv[None], kv[None, ..., :5], scale=0.25)  # no mask at all
    torch.testing.assert_close(out, d.out[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, d.lse[0].T, rtol=1e-12, atol=1e-12)


@given(problems())
def test_minus_one_padding_equals_shorter_topk_length(p):
    """Cutting rows with topk_length equals overwriting the cut slots with -1."""
    tl = p["topk_length"]
    if tl is None:
        tl = torch.full((p["q"].shape[0],), p["indices"].shape[-1], dtype=torch.int32)
    padded = p["indices"].clone()
    padded[torch.arange(padded.shape[-1])[None, None, :].expand_as(padded) >= tl[:, None, None]] = -1
    a = sparse_attention(**{**p, "topk_length": tl})
    b = sparse_attention(**{**p, "indices": padded, "topk_length": None})
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


@given(problems(), st.integers(0, 2**16))
def test_permuting_indices_changes_nothing(p, seed):
    p = {**p, "topk_length": None}
    perm = torch.randperm(p["indices"].shape[-1], generator=torch.Generator().manual_seed(seed))
    a = sparse_attention(**p)
    b = sparse_attention(**{**p, "indices": p["indices"][..., perm]})
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_duplicate_index_is_attended_twice():
    """FlashMLA's ref gathers per slot: a duplicated index doubles that key's weight (so ≠ the mask form)."""
    q = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
    kv = torch.tensor([[[1.0, 10.0]], [[0.0, 20.0]]], dtype=torch.float64)
    out, lse, _ = sparse_attention(q, kv, torch.tensor([[[0, 0, 1]]]), scale=1.0, d_v=2)
    w = torch.tensor([2 * math.e, 1.0]) / (2 * math.e + 1)  # key 0 counted twice: exp(1) + exp(1), key 1: exp(0)
    torch.testing.assert_close(out[0, 0], (w[:, None].double() * kv[:, 0]).sum(0))
    torch.testing.assert_close(lse[0, 0], torch.tensor(math.log(2 * math.e + 1), dtype=torch.float64))
    once, _, _ = sparse_attention(q, kv, torch.tensor([[[0, 1, -1]]]), scale=1.0, d_v=2)
    assert not torch.allclose(out, once)


@given(problems())
def test_sink_plus_inf_gives_zeros_and_keeps_lse(p):
    h_q = p["q"].shape[1]
    base = sparse_attention(**p)
    r = sparse_attention(**p, attn_sink=torch.full((h_q,), math.inf))
    assert torch.equal(r.out, torch.zeros_like(r.out))
    assert torch.equal(r.lse, base.lse) and torch.equal(r.max_logits, base.max_logits)
    r = sparse_attention(**p, attn_sink=torch.full((h_q,), -math.inf))
    assert torch.equal(r.out, base.out)


@given(problems(), st.floats(-3, 3))
def test_sink_scale_is_exp_lse_over_exp_lse_plus_exp_sink(p, sink):
    """The sink behaves like one extra key with logit `sink` and a zero value vector (merge form)."""
    h_q = p["q"].shape[1]
    base = sparse_attention(**p, empty_lse="-inf")
    r = sparse_attention(**p, attn_sink=torch.full((h_q,), sink, dtype=torch.float64), empty_lse="-inf")
    sink_out = torch.zeros_like(base.out)
    sink_lse = torch.full_like(base.lse.T, sink)
    merged = merge_attn_states(base.out, base.lse.T, sink_out, sink_lse)
    torch.testing.assert_close(r.out, merged.out, rtol=1e-12, atol=1e-12)
    assert torch.equal(r.lse, base.lse)


def test_row_with_no_valid_index_gives_zero_and_plus_inf():
    q = torch.randn(2, 2, 4, dtype=torch.float64)
    kv = torch.full((3, 1, 4), math.nan, dtype=torch.float64)  # hostile: NaN everywhere, never read
    kv[1] = 1.0
    idx = torch.tensor([[[-1, 3, 2**31 - 1]], [[1, -1, -1]]], dtype=torch.int32)
    out, lse, ml = sparse_attention(q, kv, idx, scale=0.5, d_v=4)
    assert torch.equal(out[0], torch.zeros(2, 4, dtype=torch.float64))
    assert torch.isposinf(lse[0]).all() and torch.isneginf(ml[0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()
    _, lse, _ = sparse_attention(q, kv, idx, scale=0.5, d_v=4, empty_lse="-inf")
    assert torch.isneginf(lse[0]).all()
    # topk_length = 0 empties a row even with valid indices
    out, lse, _ = sparse_attention(q, kv, idx, scale=0.5, d_v=4, topk_length=torch.tensor([3, 0]))
    assert torch.equal(out[1], torch.zeros(2, 4, dtype=torch.float64)) and torch.isposinf(lse[1]).all()


def test_worked_example_one_query_two_keys():
    """q·k = (2, 0) with scale 1: weights (e², 1)/(e² + 1), lse = log(e² + 1), max_logits = 2."""
    q = torch.tensor([[[1.0, 1.0]]])
    kv = torch.tensor([[[2.0, 0.0]], [[0.0, 0.0]], [[5.0, 5.0]]])
    out, lse, ml = sparse_attention(q, kv, torch.tensor([[[1, 0, 5]]], dtype=torch.int32), scale=1.0, d_v=1)
    e2 = math.exp(2)
    assert out.item() == pytest.approx(2 * e2 / (e2 + 1), rel=1e-14)
    assert lse.item() == pytest.approx(math.log(e2 + 1), rel=1e-14)
    assert ml.item() == 2.0


@given(problems(h_kv=1), st.integers(0, 2**16))
def test_extra_kv_equals_one_concatenated_cache(p, seed):
    """V4's extra cache is the same softmax as one cache holding both (indices shifted by S_kv)."""
    g = torch.Generator().manual_seed(seed)
    s_q, s_kv = p["q"].shape[0], p["kv"].shape[0]
    extra = torch.randn(5, 1, p["kv"].shape[-1], generator=g, dtype=torch.float64)
    e_idx = torch.randint(-1, 5, (s_q, 1, 3), generator=g, dtype=torch.int32)
    e_tl = torch.randint(0, 4, (s_q,), generator=g, dtype=torch.int32)
    a = sparse_attention(**p, extra_kv=extra, extra_indices=e_idx, extra_topk_length=e_tl)
    tl = p["topk_length"]
    main = p["indices"].clone()
    main[(main < 0) | (main >= s_kv)] = -1
    if tl is not None:
        main[torch.arange(main.shape[-1])[None, None, :].expand_as(main) >= tl[:, None, None]] = -1
    shifted = torch.where(e_idx >= 0, e_idx + s_kv, -1)
    shifted[torch.arange(3)[None, None, :].expand_as(shifted) >= e_tl[:, None, None]] = -1
    b = sparse_attention(
        **{**p, "topk_length": None, "kv": torch.cat([p["kv"], extra]), "indices": torch.cat([main, shifted], dim=-1)}
    )
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_prefill_view_matches_definition_and_result_order():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 8, generator=g)
    kv = torch.randn(6, 1, 8, generator=g)
    idx = torch.tensor([[[0, 5, -1]], [[2, 6, 1]], [[3, 3, 3]]], dtype=torch.int32)
    sink = torch.tensor([0.0, 1.0, -math.inf, math.inf])
    r = sparse_prefill(q, kv, idx, 0.5, d_v=4, attn_sink=sink, topk_length=torch.tensor([3, 2, 1]))
    s = sparse_attention(q, kv, idx, scale=0.5, d_v=4, attn_sink=sink, topk_length=torch.tensor([3, 2, 1]))
    assert r._fields == ("out", "max_logits", "lse")
    assert torch.equal(r.out, s.out) and torch.equal(r.lse, s.lse) and torch.equal(r.max_logits, s.max_logits)


@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**16), st.booleans())
def test_decode_view_over_paged_cache_equals_contiguous(b, s_q, seed, with_lengths):
    """Global slots block * P + offset into a shuffled paged cache give the same result as contiguous kv."""
    g = torch.Generator().manual_seed(seed)
    p_sz, n_blocks, d, h_q, k = 4, 6, 6, 2, 5
    seq = 9
    kv = torch.randn(b, seq, d, generator=g, dtype=torch.float64)
    cache = torch.full((n_blocks * b, p_sz, d), math.nan, dtype=torch.float64)
    block_table = torch.randperm(n_blocks * b, generator=g)[: b * 3].reshape(b, 3).to(torch.int32)
    for r in range(b):
        for pos in range(seq):
            cache[block_table[r, pos // p_sz], pos % p_sz] = kv[r, pos]
    local = torch.stack([torch.randperm(seq, generator=g)[:k] for _ in range(b * s_q)]).to(torch.int32)
    local[:, -1] = -1
    req = torch.arange(b).repeat_interleave(s_q)
    slots = global_slot_indices(local, req, block_table, p_sz).reshape(b, s_q, k)
    q = torch.randn(b, s_q, h_q, d, generator=g, dtype=torch.float64)
    tl = torch.randint(0, k + 1, (b,), generator=g, dtype=torch.int32) if with_lengths else None
    res = sparse_decode(q, cache, slots, scale=0.4, d_v=4, topk_length=tl)
    assert res.out.shape == (b, s_q, h_q, 4) and res.lse.shape == (b, h_q, s_q)
    for r in range(b):
        ref = sparse_attention(
            q[r],
            kv[r][:, None],
            local.reshape(b, s_q, 1, k)[r],
            scale=0.4,
            d_v=4,
            topk_length=None if tl is None else tl[r].repeat(s_q),
        )
        torch.testing.assert_close(res.out[r], ref.out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res.lse[r], ref.lse.T, rtol=1e-12, atol=1e-12)


def test_decode_accepts_flashmla_4d_cache_and_default_scale():
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 4, 1, 8, generator=g)
    q = torch.randn(1, 1, 2, 8, generator=g)
    idx = torch.tensor([[[7, 0, -1]]], dtype=torch.int32)
    a = sparse_decode(q, cache, idx, d_v=8)
    b = sparse_decode(q, cache[:, :, 0], idx, scale=8**-0.5, d_v=8)
    assert torch.equal(a.out, b.out)


def test_global_slot_indices_example():
    # request 0 owns blocks [3, 1], request 1 owns [0, 2]; P = 4
    bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    local = torch.tensor([[0, 5, -1], [7, 2, -1]], dtype=torch.int32)
    got = global_slot_indices(local, torch.tensor([0, 1]), bt, 4)
    assert got.tolist() == [[12, 5, -1], [11, 2, -1]]


def test_indices_to_mask_and_valid_slots():
    idx = torch.tensor([[[1, 3, -1, 9, 1]]], dtype=torch.int32)
    assert indices_to_mask(idx, 5).tolist() == [[[False, True, False, True, False]]]
    assert indices_to_mask(idx, 5, torch.tensor([1])).tolist() == [[[False, True, False, False, False]]]
    assert valid_slots(idx, 5).tolist() == [[[True, True, False, False, True]]]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=torch.randn(2, 3, 4)), "kv"),  # D_qk=4 from q, kv has 8
        (dict(indices=torch.zeros(2, 1, 3)), "indices"),
        (dict(indices=torch.zeros(3, 1, 3, dtype=torch.int32)), "indices"),
        (dict(topk_length=torch.tensor([1, 4])), "topk_length"),
        (dict(topk_length=torch.tensor([1, -1])), "topk_length"),
        (dict(d_v=9), "d_v"),
        (dict(scale=math.inf), "scale"),
        (dict(empty_lse="nan"), "empty_lse"),
        (dict(attn_sink=torch.tensor([0.0, math.nan])), "attn_sink"),
        (dict(attn_sink=torch.zeros(3)), "attn_sink"),
        (dict(extra_indices=torch.zeros(2, 1, 1, dtype=torch.int32)), "extra_kv"),
        (dict(extra_kv=torch.randn(4, 1, 8)), "extra_indices"),
        (dict(extra_kv=torch.randn(4, 1, 7), extra_indices=torch.zeros(2, 1, 1, dtype=torch.int32)), "extra_kv"),
    ],
)
def test_sparse_attention_rejects_bad_input(change, match):
    args = dict(
        q=torch.randn(2, 2, 8),
        kv=torch.randn(5, 1, 8),
        indices=torch.zeros(2, 1, 3, dtype=torch.int32),
        scale=0.5,
        d_v=8,
    )
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        sparse_attention(**args)


def test_sparse_attention_rejects_heads_not_dividing():
    with pytest.raises(ValueError, match="H_kv"):
        sparse_attention(torch.randn(2, 3, 8), torch.randn(5, 2, 8), torch.zeros(2, 2, 1, dtype=torch.int32), scale=1.0)


def test_sparse_decode_rejects_out_of_range_slot_but_not_past_topk_length():
    cache = torch.randn(2, 4, 8)
    q = torch.randn(1, 1, 2, 8)
    with pytest.raises(ValueError, match="indices"):
        sparse_decode(q, cache, torch.tensor([[[0, 8]]], dtype=torch.int32))
    with pytest.raises(ValueError, match="indices"):
        sparse_decode(q, cache, torch.tensor([[[0, -2]]], dtype=torch.int32))
    # garbage past topk_length is allowed (never read), as FlashMLA's MODEL1 path guarantees
    sparse_decode(q, cache, torch.tensor([[[0, 2**31 - 1]]], dtype=torch.int32), topk_length=torch.tensor([1]), d_v=8)
    with pytest.raises(ValueError, match="extra_indices"):
        sparse_decode(q, cache, torch.tensor([[[0]]]), d_v=8, extra_kv_cache=cache, extra_indices=torch.tensor([[[9]]]))
    with pytest.raises(ValueError, match="kv_cache"):
        sparse_decode(q, torch.randn(2, 4, 2, 8), torch.tensor([[[0]]]))


def test_global_slot_indices_rejects_bad_input():
    bt = torch.tensor([[3, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="local_indices"):
        global_slot_indices(torch.tensor([[8]]), torch.tensor([0]), bt, 4)
    with pytest.raises(ValueError, match="token_to_req"):
        global_slot_indices(torch.tensor([[1]]), torch.tensor([1]), bt, 4)
    with pytest.raises(ValueError, match="block_size"):
        global_slot_indices(torch.tensor([[1]]), torch.tensor([0]), bt, 0)


# ------------------------------------------------------------------ an empty key set


def test_empty_key_set_gives_zero_and_lse_plus_inf():
    """``S_kv = 0`` with every index -1: FlashMLA's ``tests/ref.py`` marks each row ``lonely_q_mask`` (LSE ``-inf``
    before the fix-up), sets its LSE to ``+inf`` and its output to 0 (``max_logits`` stays ``-inf``). The spec gives
    the same for the definition, the prefill view and the decode view (a cache of 0 pages), not an IndexError."""
    q = torch.randn(2, 2, 6, dtype=torch.float64)
    idx = torch.full((2, 1, 3), -1, dtype=torch.int32)
    out, lse, max_logits = sparse_attention(q, torch.zeros(0, 1, 6, dtype=torch.float64), idx, scale=0.5, d_v=4)
    assert torch.equal(out, torch.zeros(2, 2, 4, dtype=torch.float64))
    assert torch.isposinf(lse).all() and torch.isneginf(max_logits).all()
    p = sparse_prefill(q, torch.zeros(0, 1, 6, dtype=torch.float64), idx, 0.5, d_v=4)
    assert torch.equal(p.out, out) and torch.isposinf(p.lse).all() and torch.isneginf(p.max_logits).all()
    d = sparse_decode(q[None], torch.zeros(0, 64, 6, dtype=torch.float64), idx.reshape(1, 2, 3), scale=0.5, d_v=4)
    assert torch.equal(d.out, out[None]) and d.lse.shape == (1, 2, 2) and torch.isposinf(d.lse).all()
    dense = sparse_attention(q, torch.zeros(0, 1, 6), idx, scale=0.5, d_v=4, empty_lse="-inf")
    assert torch.isneginf(dense.lse).all()
    with pytest.raises(ValueError, match="indices"):  # a real slot into an empty decode cache is out of range
        sparse_decode(q[None], torch.zeros(0, 64, 6), torch.zeros(1, 2, 3, dtype=torch.int32), scale=0.5, d_v=4)


@given(problems(), st.integers(0, 5))
def test_empty_key_set_equals_all_invalid_indices_over_any_cache(p, k):
    """No valid key is no valid key: an empty cache and a full one that no index names give the same rows."""
    idx = torch.full((p["q"].shape[0], p["kv"].shape[1], k), -1, dtype=torch.int32)
    empty = p["kv"][:0]
    a = sparse_attention(p["q"], empty, idx, scale=p["scale"], d_v=p["d_v"])
    b = sparse_attention(p["q"], p["kv"], idx, scale=p["scale"], d_v=p["d_v"])
    assert torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse) and torch.equal(a.max_logits, b.max_logits)
    assert not a.out.any() and torch.isposinf(a.lse).all()
    # merged with a non-empty part, the empty part weighs nothing (its +inf LSE reads as "no keys")
    full = sparse_attention(**p)
    m = merge_attn_states(full.out, full.lse.T, a.out, a.lse.T)
    live = torch.isfinite(full.lse.T)
    torch.testing.assert_close(m.out[live.T], full.out[live.T], rtol=1e-12, atol=1e-12)
