"""Tests for mlaspec.spec.sliding_window: DeepSeek V4 windows, compressed entries and their metadata."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaspec.spec.attention import attention, causal_mask
from mlaspec.spec.sliding_window import (
    PrefillChunk,
    c128a_topk_indices,
    combine_topk_swa_indices,
    compressed_mask,
    compressed_span,
    layer_kind,
    num_visible_compressed,
    prefill_chunk_plan,
    prefill_gather_lens,
    prefill_workspace,
    swa_indices_and_lens,
    v4_attention,
    v4_attention_indices,
    window_mask,
)
from mlaspec.spec.sparse import global_slot_indices, indices_to_mask, sparse_attention, sparse_decode, sparse_prefill

# ---------------------------------------------------------------- window semantics


def test_window_mask_example():
    assert window_mask(4, 4, 2).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


@given(st.integers(0, 6), st.integers(0, 6), st.integers(1, 8))
def test_window_mask_is_causal_and_holds_w_keys_including_itself(s_q, extra, w):
    s_kv = s_q + extra
    m = window_mask(s_q, s_kv, w)
    assert not bool((m & ~causal_mask(s_q, s_kv)).any())
    p = torch.arange(s_q) + extra
    assert m.sum(1).tolist() == torch.minimum(p + 1, torch.tensor(w)).tolist()
    if s_q:
        assert bool(m[torch.arange(s_q), p].all())  # the query sees itself
    if w >= s_kv:
        assert torch.equal(m, causal_mask(s_q, s_kv))


@given(st.integers(1, 4), st.integers(0, 5), st.integers(1, 6), st.integers(0, 2**16))
def test_windowed_sparse_attention_equals_dense_with_window_mask(s_q, extra, w, seed):
    """SWA indices (as vLLM builds them, one request, identity block table) == dense attention under window_mask."""
    g = torch.Generator().manual_seed(seed)
    s_kv = s_q + extra
    q = torch.randn(s_q, 2, 6, generator=g, dtype=torch.float64)
    kv = torch.randn(s_kv, 1, 6, generator=g, dtype=torch.float64)
    sw = swa_indices_and_lens(
        torch.tensor([0, s_q]), torch.tensor([s_kv]), torch.arange(s_kv)[None], window=w, block_size=1
    )
    sp = sparse_attention(q, kv, sw.indices, scale=0.4, d_v=4, topk_length=sw.lens)
    d = attention(q[None], kv[None], kv[None, ..., :4], scale=0.4, mask=window_mask(s_q, s_kv, w)[None])
    torch.testing.assert_close(sp.out, d.out[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sp.lse, d.lse[0].T, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- decode metadata


def test_swa_indices_worked_example_with_mtp():
    """Request 0 decodes 1 token at pos 5; request 1 is an MTP decode of 2 tokens at pos 2, 3. W = 3, P = 2."""
    block_table = torch.tensor([[4, 0, 2, 9], [1, 3, 7, 9]], dtype=torch.int32)
    r = swa_indices_and_lens(torch.tensor([0, 1, 3]), torch.tensor([6, 4]), block_table, window=3, block_size=2)
    assert r.positions.tolist() == [5, 2, 3]
    assert r.lens.tolist() == [3, 3, 3]
    # pos 5 sees 3, 4, 5 -> (block 1 -> 0, off 1) = 1, (block 2 -> 2) = 4, 5
    # pos 2 sees 0, 1, 2 -> 2, 3, (block 1 -> 3) = 6;  pos 3 sees 1, 2, 3 -> 3, 6, 7
    assert r.indices[:, 0].tolist() == [[1, 4, 5], [2, 3, 6], [3, 6, 7]]


@given(
    st.lists(st.tuples(st.integers(1, 3), st.integers(0, 9)), min_size=1, max_size=3),
    st.integers(1, 6),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 2**16),
)
def test_decode_indices_are_exactly_the_window_positions(reqs, w, p_sz, seed):
    g = torch.Generator().manual_seed(seed)
    q_lens = torch.tensor([q for q, _ in reqs])
    seq_lens = torch.tensor([q + c for q, c in reqs])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    max_blocks = -(-int(seq_lens.max()) // p_sz)
    bt = torch.randperm(len(reqs) * max_blocks, generator=g).reshape(len(reqs), max_blocks).to(torch.int32)
    valid = torch.rand(int(qsl[-1]), generator=g) > 0.2
    r = swa_indices_and_lens(qsl, seq_lens, bt, window=w, block_size=p_sz, is_valid_token=valid)
    t = 0
    for b, (q, c) in enumerate(reqs):
        for i in range(q):
            pos = c + i
            assert int(r.positions[t]) == pos
            want = list(range(max(pos - w + 1, 0), pos + 1)) if bool(valid[t]) else []
            slots = [int(bt[b, x // p_sz]) * p_sz + x % p_sz for x in want]
            assert int(r.lens[t]) == len(want)
            assert r.indices[t, 0].tolist() == slots + [-1] * (w - len(slots))
            t += 1


def test_swa_indices_rejects_bad_input():
    bt = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="window"):
        swa_indices_and_lens(torch.tensor([0, 1]), torch.tensor([3]), bt, window=0, block_size=2)
    with pytest.raises(ValueError, match="seq_lens"):
        swa_indices_and_lens(torch.tensor([0, 3]), torch.tensor([2]), bt, window=2, block_size=2)
    with pytest.raises(ValueError, match="block_table"):
        swa_indices_and_lens(torch.tensor([0, 1]), torch.tensor([9]), bt, window=2, block_size=2)
    with pytest.raises(ValueError, match="query_start_loc"):
        swa_indices_and_lens(torch.tensor([1, 2]), torch.tensor([3]), bt, window=2, block_size=2)
    with pytest.raises(ValueError, match="is_valid_token"):
        swa_indices_and_lens(
            torch.tensor([0, 1]),
            torch.tensor([3]),
            bt,
            window=2,
            block_size=2,
            is_valid_token=torch.ones(2, dtype=torch.bool),
        )


# ---------------------------------------------------------------- prefill metadata


def test_prefill_gather_lens_example():
    assert prefill_gather_lens(torch.tensor([10, 3, 100]), torch.tensor([3, 3, 1]), 4).tolist() == [6, 3, 4]


@given(st.integers(0, 20), st.integers(1, 20), st.integers(1, 10))
def test_gather_len_covers_exactly_the_earliest_window(prefix, q_len, w):
    gl = int(prefill_gather_lens(torch.tensor([prefix + q_len]), torch.tensor([q_len]), w)[0])
    first_needed = max(prefix - (w - 1), 0)  # window start of the first new token (at position prefix)
    assert gl == prefix + q_len - first_needed


def test_prefill_gather_lens_rejects_bad_input():
    with pytest.raises(ValueError, match="query_lens"):
        prefill_gather_lens(torch.tensor([2]), torch.tensor([3]), 4)
    with pytest.raises(ValueError, match="window"):
        prefill_gather_lens(torch.tensor([2]), torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="query_lens"):
        prefill_gather_lens(torch.tensor([2]), torch.tensor([1, 1]), 4)


# ---------------------------------------------------------------- layer kinds and compressed entries


def test_layer_kinds():
    assert [layer_kind(r) for r in (0, 1, 4, 128)] == ["swaonly", "swaonly", "c4a", "c128a"]
    with pytest.raises(ValueError, match="compress_ratio"):
        layer_kind(8)
    with pytest.raises(TypeError, match="compress_ratio"):
        layer_kind(4.0)


def test_compressed_spans_c4a_overlaps_c128a_does_not():
    assert [compressed_span(c, 4) for c in range(3)] == [(0, 3), (0, 7), (4, 11)]
    assert [compressed_span(c, 128) for c in range(2)] == [(0, 127), (128, 255)]
    with pytest.raises(ValueError, match="compress_ratio"):
        compressed_span(0, 1)
    with pytest.raises(ValueError, match="index"):
        compressed_span(-1, 4)


@given(st.integers(0, 600), st.sampled_from([4, 128]))
def test_visible_compressed_entries_are_complete_and_causal(p, r):
    n = int(num_visible_compressed(torch.tensor([p]), r)[0])
    if n:
        assert compressed_span(n - 1, r)[1] <= p  # the last visible entry only summarises the past
    assert compressed_span(n, r)[1] > p  # the next one is not complete yet


def test_compressed_mask_example():
    # seq_len 9, last 3 queries at positions 6, 7, 8; r = 4 -> 2 entries; entry 1 completes at position 7
    assert compressed_mask(3, 9, 4).int().tolist() == [[1, 0], [1, 1], [1, 1]]
    assert compressed_mask(3, 9, 1).shape == (3, 0)


def test_c128a_topk_indices_example():
    got = c128a_topk_indices(torch.tensor([0, 126, 127, 300, 1000]), 128, 4)
    assert got.tolist() == [[-1] * 4, [-1] * 4, [0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, 3]]
    with pytest.raises(ValueError, match="positions"):
        c128a_topk_indices(torch.tensor([-1]), 128, 4)


def test_c128a_topk_indices_mark_a_token_without_slot():
    """vLLM's ``_build_c128a_topk_metadata_kernel`` gives a decode token whose slot is -1 (CUDA-graph padding)
    length 0: ``tl.where(is_valid_token, count, 0)`` with ``is_valid_token = slot_mapping >= 0``. The spec writes
    that row all -1 (length 0), like the SWA indices of such a token."""
    slot_mapping = torch.tensor([7, -1, 12])
    got = c128a_topk_indices(torch.tensor([300, 1000, 127]), 128, 4, is_valid_token=slot_mapping >= 0)
    assert got.tolist() == [[0, 1, -1, -1], [-1] * 4, [0, -1, -1, -1]]
    with pytest.raises(ValueError, match="is_valid_token"):
        c128a_topk_indices(torch.tensor([300, 1000]), 128, 4, is_valid_token=torch.tensor([True]))


@given(
    st.lists(st.tuples(st.integers(0, 2000), st.booleans()), min_size=1, max_size=8),
    st.sampled_from([4, 128]),
    st.integers(0, 20),
)
def test_c128a_invalid_tokens_are_empty_rows_and_valid_ones_unchanged(tokens, r, width):
    positions = torch.tensor([p for p, _ in tokens])
    valid = torch.tensor([v for _, v in tokens])
    plain = c128a_topk_indices(positions, r, width)
    marked = c128a_topk_indices(positions, r, width, is_valid_token=valid)
    assert torch.equal(marked[valid], plain[valid])
    assert (marked[~valid] == -1).all()
    lengths = (marked >= 0).sum(dim=1)
    assert torch.equal(lengths, torch.where(valid, (plain >= 0).sum(dim=1), 0))


def test_layer_kind_takes_v4s_zero_and_refuses_negative_ratios():
    """DeepSeek V4's config marks SWA-only layers with compress_ratio 0 (``compress_ratios = [0, 0, 4, 128, ...]``)
    and vLLM's ``_layer_type_for`` maps every ratio <= 1 to swaonly; a negative ratio is garbage."""
    assert [layer_kind(r) for r in (0, 1, 4, 128)] == ["swaonly", "swaonly", "c4a", "c128a"]
    assert num_visible_compressed(torch.tensor([5, 9]), 0).tolist() == [0, 0]
    for bad in (-1, -4):
        with pytest.raises(ValueError, match="compress_ratio"):
            num_visible_compressed(torch.tensor([5]), bad)
        with pytest.raises(ValueError, match="compress_ratio"):
            compressed_mask(1, 9, bad)


# ---------------------------------------------------------------- end to end: three paths, one definition


@st.composite
def v4_batches(draw):
    seed = draw(st.integers(0, 2**16))
    r = draw(st.sampled_from([1, 4, 128]))
    w = draw(st.integers(1, 6))
    n_req = draw(st.integers(1, 3))
    if r == 128:
        reqs = [(draw(st.integers(1, 3)), draw(st.integers(120, 300))) for _ in range(n_req)]
    else:
        reqs = [(draw(st.integers(1, 4)), draw(st.integers(0, 12))) for _ in range(n_req)]
    topk = {1: 0, 4: draw(st.integers(1, 3)), 128: 3}[r]
    return seed, r, w, reqs, topk


def _build(seed, r, w, reqs, topk, d=8, h=2):
    g = torch.Generator().manual_seed(seed)
    q_lens = torch.tensor([q for q, _ in reqs], dtype=torch.int32)
    seq_lens = torch.tensor([q + c for q, c in reqs], dtype=torch.int32)
    raw = [torch.randn(int(s), d, generator=g, dtype=torch.float64) for s in seq_lens]
    comp = None if r == 1 else [torch.randn(int(s) // r, d, generator=g, dtype=torch.float64) for s in seq_lens]
    q = torch.randn(int(q_lens.sum()), h, d, generator=g, dtype=torch.float64)
    positions = torch.cat([torch.arange(int(s) - int(ql), int(s)) for s, ql in zip(seq_lens, q_lens)])
    if r == 4:  # the indexer's choice: distinct visible entries, -1 padded
        tk = torch.full((len(positions), topk), -1, dtype=torch.int32)
        for t, p in enumerate(positions.tolist()):
            vis = (p + 1) // r
            n = min(vis, topk)
            tk[t, :n] = torch.randperm(vis, generator=g)[:n].to(torch.int32)
    elif r == 128:
        tk = c128a_topk_indices(positions, r, topk)
    else:
        tk = torch.full((len(positions), 1), -1, dtype=torch.int32)
    return g, q_lens, seq_lens, raw, comp, q, positions, tk


@settings(max_examples=15)
@given(v4_batches())
def test_v4_prefill_path_equals_definition(case):
    """Workspace gather + combined indices + flash_mla_sparse_fwd == window ∪ compressed top-k attention."""
    seed, r, w, reqs, topk = case
    g, q_lens, seq_lens, raw, comp, q, positions, tk = _build(*case)
    sink = torch.randn(q.shape[1], generator=g, dtype=torch.float64)
    gl = prefill_gather_lens(seq_lens, q_lens, w)
    n_c = 0 if r == 1 else max(int(s) // r for s in seq_lens) + 1
    m = n_c + w + int(q_lens.sum())
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)])
    ci = combine_topk_swa_indices(tk, qsl, seq_lens, gl, window=w, compress_ratio=r, topk=topk, M=m, N=n_c)
    assert ci.indices.shape[1] % 128 == 0
    ws = prefill_workspace(raw, comp, gl, M=m, N=n_c)  # NaN in every unused slot
    res = sparse_prefill(
        q, ws.reshape(-1, 1, ws.shape[-1]), ci.indices[:, None], 0.3, d_v=6, attn_sink=sink, topk_length=ci.lens
    )
    for b in range(len(reqs)):
        s, e = int(qsl[b]), int(qsl[b + 1])
        out, lse = v4_attention(
            q[s:e],
            raw[b],
            window=w,
            scale=0.3,
            compressed_kv=None if r == 1 else comp[b],
            compress_ratio=r,
            topk_indices=None if r == 1 else tk[s:e],
            attn_sink=sink,
            d_v=6,
        )
        torch.testing.assert_close(res.out[s:e], out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res.lse[s:e], lse, rtol=1e-12, atol=1e-12)


@settings(max_examples=15)
@given(v4_batches())
def test_v4_decode_path_equals_definition(case):
    """Paged SWA indices (main cache) + global compressed indices (extra cache) == the definition."""
    seed, r, w, reqs, topk = case
    g, q_lens, seq_lens, raw, comp, q, positions, tk = _build(*case)
    p_sz, d = 4, q.shape[-1]
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)])
    req = torch.arange(len(reqs)).repeat_interleave(q_lens.long())
    nb = -(-int(seq_lens.max()) // p_sz)
    bt = torch.randperm(len(reqs) * nb, generator=g).reshape(len(reqs), nb).to(torch.int32)
    swa_cache = torch.full((len(reqs) * nb, p_sz, d), math.nan, dtype=torch.float64)
    for b, x in enumerate(raw):
        for pos in range(x.shape[0]):
            swa_cache[bt[b, pos // p_sz], pos % p_sz] = x[pos]
    sw = swa_indices_and_lens(qsl, seq_lens, bt, window=w, block_size=p_sz)
    extra = {}
    if r > 1:
        pc = 2
        ncb = max(1, -(-max(c.shape[0] for c in comp) // pc))
        cbt = torch.randperm(len(reqs) * ncb, generator=g).reshape(len(reqs), ncb).to(torch.int32)
        ccache = torch.full((len(reqs) * ncb, pc, d), math.nan, dtype=torch.float64)
        for b, c in enumerate(comp):
            for i in range(c.shape[0]):
                ccache[cbt[b, i // pc], i % pc] = c[i]
        gi = global_slot_indices(tk, req, cbt, pc)
        extra = dict(
            extra_kv_cache=ccache, extra_indices=gi[:, None], extra_topk_length=(gi >= 0).sum(1).to(torch.int32)
        )
    res = sparse_decode(q[:, None], swa_cache, sw.indices, scale=0.3, d_v=6, topk_length=sw.lens, **extra)
    for b in range(len(reqs)):
        s, e = int(qsl[b]), int(qsl[b + 1])
        out, lse = v4_attention(
            q[s:e],
            raw[b],
            window=w,
            scale=0.3,
            compressed_kv=None if r == 1 else comp[b],
            compress_ratio=r,
            topk_indices=None if r == 1 else tk[s:e],
            d_v=6,
        )
        torch.testing.assert_close(res.out[s:e, 0], out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res.lse[s:e, :, 0], lse, rtol=1e-12, atol=1e-12)


def test_combine_worked_example():
    """One request, seq_len 10, 3 new tokens (pos 7, 8, 9), W = 3, r = 4, top-k 2, N = 3, M = 10."""
    gl = prefill_gather_lens(torch.tensor([10]), torch.tensor([3]), 3)
    assert gl.tolist() == [5]  # raw positions 5..9 live at workspace slots N + 0 .. N + 4
    tk = torch.tensor([[1, 0], [1, 0], [0, 1]], dtype=torch.int32)
    ci = combine_topk_swa_indices(
        tk, torch.tensor([0, 3]), torch.tensor([10]), gl, window=3, compress_ratio=4, topk=2, M=10, N=3
    )
    # pos 7: 2 visible entries -> [1, 0]; window 5, 6, 7 -> 3 + (0, 1, 2)
    assert ci.lens.tolist() == [5, 5, 5]
    assert ci.indices[:, :5].tolist() == [[1, 0, 3, 4, 5], [1, 0, 4, 5, 6], [0, 1, 5, 6, 7]]
    assert ci.indices.shape == (3, 128) and bool((ci.indices[:, 5:] == -1).all())


def test_combine_rejects_bad_input():
    args = dict(
        topk_indices=torch.zeros(1, 2, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1]),
        seq_lens=torch.tensor([8]),
        gather_lens=torch.tensor([3]),
        window=3,
        compress_ratio=4,
        topk=2,
        M=10,
        N=3,
    )
    combine_topk_swa_indices(**args)
    for change, match in [
        (dict(M=5), "M"),
        (dict(gather_lens=torch.tensor([1])), "gather_lens"),
        (dict(topk_indices=torch.tensor([[0, 5]], dtype=torch.int32)), "topk_indices"),
        (dict(topk_indices=torch.tensor([[0, -1]], dtype=torch.int32)), "topk_indices"),
        (dict(compress_ratio=1), "topk"),
        (dict(topk=3), "topk"),
        (dict(window=0), "window"),
        (dict(compress_ratio=16), "compress_ratio"),
    ]:
        with pytest.raises(ValueError, match=match):
            combine_topk_swa_indices(**{**args, **change})


def test_v4_attention_rejects_future_or_repeated_compressed_entries():
    q, raw, comp = torch.randn(2, 1, 4), torch.randn(8, 4), torch.randn(2, 4)
    with pytest.raises(ValueError, match="topk_indices"):  # pos 6 sees only entry 0 ((6 + 1) // 4 = 1)
        v4_attention(
            q,
            raw,
            window=2,
            scale=1.0,
            compressed_kv=comp,
            compress_ratio=4,
            topk_indices=torch.tensor([[1], [0]]),
            d_v=4,
        )
    with pytest.raises(ValueError, match="repeat"):
        v4_attention(
            q[1:],
            raw,
            window=2,
            scale=1.0,
            compressed_kv=comp,
            compress_ratio=4,
            topk_indices=torch.tensor([[0, 0]]),
            d_v=4,
        )
    with pytest.raises(ValueError, match="compressed_kv"):
        v4_attention(q, raw, window=2, scale=1.0, compress_ratio=128, d_v=4)
    with pytest.raises(ValueError, match="window"):
        v4_attention(q, raw, window=0, scale=1.0, d_v=4)


# ---------------------------------------------------------------- one layer as index rows


def test_v4_attention_indices_worked_example():
    # positions 7 and 8, W = 3, r = 4: each sees (p + 1) // 4 = 2 compressed entries; C = 2 shifts the raw rows
    topk = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32)
    got = v4_attention_indices(2, 9, window=3, compress_ratio=4, topk_indices=topk, num_compressed=2)
    assert got.dtype == torch.int64
    assert got.tolist() == [[1, 0, 7, 8, 9], [0, 1, 8, 9, 10]]
    # swaonly, a prompt shorter than the window: left-aligned, -1 padded
    assert v4_attention_indices(3, 3, window=4).tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1]]
    # c4a at position 4 sees one entry: the second top-k slot is unused even though it holds a valid index
    got = v4_attention_indices(1, 5, window=2, compress_ratio=4, topk_indices=torch.tensor([[0, 1]]), num_compressed=2)
    assert got.tolist() == [[0, -1, 5, 6]]


@given(st.integers(0, 2**16), st.sampled_from([1, 4, 128]), st.integers(1, 5), st.integers(1, 6), st.integers(0, 4))
def test_v4_attention_indices_are_the_definition_mask(seed, r, s_q, w, extra):
    """The index rows name exactly the keys of ``v4_attention``'s mask (compressed selection, then the window), and
    sparse attention over them is ``v4_attention``."""
    g = torch.Generator().manual_seed(seed)
    s_kv = s_q + extra + (250 if r == 128 else 0)
    pos = torch.arange(s_q) + (s_kv - s_q)
    topk, num_c, comp = None, 0, None
    if r > 1:
        k = 3
        num_c = s_kv // r + 1  # one more than written: never visible
        topk = c128a_topk_indices(pos, r, k) if r == 128 else torch.full((s_q, k), -1, dtype=torch.int32)
        if r == 4:
            for i, p in enumerate(pos.tolist()):
                n = min((p + 1) // r, k)
                topk[i, :n] = torch.randperm((p + 1) // r, generator=g)[:n].to(torch.int32)
        comp = torch.randn(num_c, 4, generator=g, dtype=torch.float64)
    idx = v4_attention_indices(s_q, s_kv, window=w, compress_ratio=r, topk_indices=topk, num_compressed=num_c)
    assert idx.shape == (s_q, (0 if topk is None else topk.shape[1]) + w)
    got = indices_to_mask(idx[:, None], num_c + s_kv)[:, 0]
    want = window_mask(s_q, s_kv, w)
    if r > 1:
        n = torch.clamp((pos + 1) // r, max=topk.shape[1])
        sel = torch.zeros(s_q, num_c, dtype=torch.bool)
        for i in range(s_q):
            sel[i, topk[i, : int(n[i])].long()] = True
        want = torch.cat([sel, want], dim=1)
    assert torch.equal(got, want)
    assert int((idx >= 0).sum()) == int(want.sum())  # no key twice
    q = torch.randn(s_q, 2, 4, generator=g, dtype=torch.float64)
    raw = torch.randn(s_kv, 4, generator=g, dtype=torch.float64)
    keys = raw if comp is None else torch.cat([comp, raw])
    sparse = sparse_prefill(q, keys[:, None], idx[:, None].to(torch.int32), 0.5, d_v=4)
    ref = v4_attention(q, raw, window=w, scale=0.5, compressed_kv=comp, compress_ratio=r, topk_indices=topk, d_v=4)
    assert torch.allclose(sparse.out, ref[0], rtol=1e-12, atol=1e-12)
    assert torch.allclose(sparse.lse, ref[1], rtol=1e-12, atol=1e-12)


def test_v4_attention_indices_rejects_bad_input():
    topk = torch.tensor([[0, 1]])
    args = dict(window=2, compress_ratio=4, topk_indices=topk, num_compressed=2)
    for change, match in [
        (dict(window=0), "window"),
        (dict(compress_ratio=16), "compress_ratio"),
        (dict(topk_indices=None), "topk_indices"),
        (dict(topk_indices=torch.tensor([[0, 2]])), "topk_indices"),  # position 8 sees entries 0 and 1 only
        (dict(topk_indices=torch.tensor([[0, -1]])), "topk_indices"),
        (dict(topk_indices=torch.tensor([[0, 1], [1, 0]])), "topk_indices"),
        (dict(num_compressed=1), "num_compressed"),
        (dict(num_compressed=-1), "num_compressed"),
        (dict(compress_ratio=1), "topk_indices"),
    ]:
        with pytest.raises(ValueError, match=match):
            v4_attention_indices(1, 9, **{**args, **change})
    with pytest.raises(ValueError, match="s_q"):
        v4_attention_indices(3, 2, window=2)
    with pytest.raises(TypeError, match="topk_indices"):
        v4_attention_indices(1, 9, **{**args, "topk_indices": torch.tensor([[0.0, 1.0]])})
    with pytest.raises(TypeError, match="window"):
        v4_attention_indices(1, 9, window=2.0)


# ---------------------------------------------------------------- chunk plan


def test_chunk_plan_fixed_and_area():
    seq, ql = torch.tensor([10, 3, 40, 5, 6]), torch.tensor([3, 3, 40, 5, 6])
    fixed = prefill_chunk_plan(seq, ql, window=4, compress_ratio=4, chunk_size=2)
    assert [(c.start, c.end) for c in fixed] == [(0, 2), (2, 4), (4, 5)]
    assert fixed[0] == PrefillChunk(0, 2, 2, 2 + 6)  # compressed 10 // 4 = 2; gather max(6, 3)
    # budget = 1 * (ceil(64/4) + 4 + 40) = 60: request 2 is (10 + 40) wide, so it gets a chunk of its own
    area = prefill_chunk_plan(
        seq, ql, window=4, compress_ratio=4, chunk_size=1, max_model_len=64, max_num_batched_tokens=40
    )
    assert [(c.start, c.end) for c in area] == [(0, 2), (2, 3), (3, 5)]
    for c in area:
        assert (c.end - c.start) * c.width <= 60 or c.end - c.start == 1


@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(0, 30)), min_size=1, max_size=8),
    st.sampled_from([1, 4, 128]),
    st.integers(1, 4),
)
def test_chunk_plan_covers_requests_in_order_within_budget(reqs, r, chunk):
    ql = torch.tensor([q for q, _ in reqs])
    seq = ql + torch.tensor([c for _, c in reqs])
    plan = prefill_chunk_plan(
        seq, ql, window=5, compress_ratio=r, chunk_size=chunk, max_model_len=64, max_num_batched_tokens=30
    )
    assert plan[0].start == 0 and plan[-1].end == len(reqs)
    assert all(a.end == b.start for a, b in zip(plan, plan[1:]))
    budget = chunk * ((0 if r == 1 else -(-64 // r)) + 5 + 30)
    assert all((c.end - c.start) * c.width <= budget or c.end - c.start == 1 for c in plan)


def test_chunk_plan_rejects_half_bounds():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        prefill_chunk_plan(torch.tensor([3]), torch.tensor([3]), window=2, compress_ratio=1, max_model_len=8)
    with pytest.raises(ValueError, match="chunk_size"):
        prefill_chunk_plan(torch.tensor([3]), torch.tensor([3]), window=2, compress_ratio=1, chunk_size=0)


def test_window_mask_rejects_bad_input():
    with pytest.raises(ValueError, match="window"):
        window_mask(2, 3, 0)
    with pytest.raises(ValueError, match="s_q"):
        window_mask(4, 3, 2)
    with pytest.raises(TypeError, match="window"):
        window_mask(2, 3, 1.5)


def test_prefill_workspace_rejects_bad_input():
    raw = [torch.randn(5, 4)]
    with pytest.raises(ValueError, match="gather_lens"):
        prefill_workspace(raw, None, torch.tensor([6]), M=10, N=0)
    with pytest.raises(ValueError, match="compressed_kv"):
        prefill_workspace(raw, [torch.randn(3, 4)], torch.tensor([2]), M=10, N=2)
    with pytest.raises(ValueError, match="raw_kv"):
        prefill_workspace([torch.randn(5, 4), torch.randn(5, 3)], None, torch.tensor([1, 1]), M=10, N=0)
