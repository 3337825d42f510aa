"""Tests for mlaspec.spec.indexer: logits, fp8 quantization, paged cache, ragged/paged metadata, chunking."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaspec.spec.indexer import (
    IndexerCacheLayout,
    IndexerPrefillChunk,
    absolute_to_compressed,
    compressed_to_absolute,
    decode_context_lens_flattened,
    decode_context_lens_native,
    fold_indexer_weights,
    fp8_e4m3_error_bound,
    gather_indexer_k_cache,
    hadamard_rotate,
    indexer_logits,
    kv_spans_from_batches,
    paged_indexer_logits,
    prefill_chunk_metadata,
    quantize_indexer_k,
    quantize_indexer_q,
    read_indexer_k_cache,
    split_indexer_prefill_chunks,
    write_indexer_k_cache,
)

NEG_INF = -math.inf


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _loop_logits(q, k, w, ks, ke, k_scale=None):
    """Definition, one element at a time."""
    m_, h_, _ = q.shape
    n_ = k.shape[0]
    out = torch.full((m_, n_), NEG_INF, dtype=torch.float64)
    for m in range(m_):
        for n in range(int(ks[m]), int(ke[m])):
            acc = 0.0
            for h in range(h_):
                acc += float(w[m, h]) * max(float(q[m, h].double() @ k[n].double()), 0.0)
            out[m, n] = acc * (1.0 if k_scale is None else float(k_scale[n]))
    return out


def _assert_same_inf_then_close(actual, expected, rtol=1e-12, atol=1e-12):
    __tracebackhide__ = True
    inf_a, inf_e = torch.isneginf(actual), torch.isneginf(expected)
    assert torch.equal(inf_a, inf_e), f"-inf masks differ at {torch.nonzero(inf_a != inf_e)[:4].tolist()}"
    torch.testing.assert_close(actual[~inf_a], expected[~inf_e], rtol=rtol, atol=atol)


@st.composite
def ragged_problems(draw):
    """A small prefill batch: per request a length L_b and a query count c_b <= L_b."""
    b = draw(st.integers(1, 3))
    lens = [draw(st.integers(0, 6)) for _ in range(b)]
    counts = [draw(st.integers(0, length)) for length in lens]
    h = draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([4, 8]))
    seed = draw(st.integers(0, 2**16))
    return lens, counts, h, d, seed


# ------------------------------------------------------------------ logits


@given(ragged_problems(), st.booleans())
def test_indexer_logits_matches_definition(problem, with_scale):
    lens, counts, h, d, seed = problem
    g = _gen(seed)
    qsl = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    ks, ke = kv_spans_from_batches(qsl, torch.tensor(lens))
    m, n = int(qsl[-1]), sum(lens)
    q = torch.randn(m, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(m, h, generator=g, dtype=torch.float64)
    scale = torch.rand(n, generator=g, dtype=torch.float64) + 0.1 if with_scale else None
    _assert_same_inf_then_close(indexer_logits(q, k, w, ks, ke, scale), _loop_logits(q, k, w, ks, ke, scale))


def test_indexer_logits_scale_outside_relu_equals_vllm_fallback_form():
    # DeepGEMM: scale * sum_h w relu(q.k); vLLM torch fallback: sum_h w relu(scale * q.k). Equal for scale > 0.
    g = _gen(0)
    q, k, w = torch.randn(3, 4, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(3, 4, generator=g)
    scale = torch.tensor([0.5, 2.0, 0.125, 1.0, 3.0])
    ks, ke = torch.zeros(3, dtype=torch.int32), torch.full((3,), 5, dtype=torch.int32)
    score = torch.einsum("mhd,nd->mhn", q.double(), k.double()) * scale.double()  # scale inside the ReLU
    fallback = torch.einsum("mhn,mh->mn", score.relu(), w.double())
    torch.testing.assert_close(indexer_logits(q, k, w, ks, ke, scale), fallback, rtol=1e-12, atol=1e-12)


def test_indexer_logits_empty_span_row_is_all_neg_inf():
    q, k, w = torch.ones(2, 1, 4), torch.ones(3, 4), torch.ones(2, 1)
    out = indexer_logits(q, k, w, torch.tensor([1, 0]), torch.tensor([1, 3]))
    assert torch.isneginf(out[0]).all()
    assert torch.equal(out[1], torch.full((3,), 4.0, dtype=torch.float64))


def test_fold_indexer_weights_factors():
    w = torch.full((1, 64), 2.0)
    s = torch.full((1, 64), 0.5)
    want = torch.full((1, 64), 2.0 * 0.5 * 128**-0.5 / 8, dtype=torch.float64)  # 64 heads: 64**-0.5 = 1/8
    torch.testing.assert_close(fold_indexer_weights(w, s), want)


# ------------------------------------------------------------------ Hadamard rotation


@given(st.sampled_from([1, 2, 4, 16, 128]), st.integers(0, 2**16))
def test_hadamard_is_orthogonal_involution(d, seed):
    x = torch.randn(3, d, generator=_gen(seed), dtype=torch.float64)
    torch.testing.assert_close(hadamard_rotate(hadamard_rotate(x)), x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hadamard_rotate(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)


def test_hadamard_matches_sylvester_matrix():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    h8 = torch.kron(torch.kron(h2, h2), h2) / math.sqrt(8)
    x = torch.randn(5, 8, generator=_gen(1), dtype=torch.float64)
    torch.testing.assert_close(hadamard_rotate(x), x @ h8, rtol=1e-12, atol=1e-12)


@given(ragged_problems())
def test_rotation_leaves_exact_logits_unchanged(problem):
    lens, counts, h, d, seed = problem
    g = _gen(seed)
    qsl = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    ks, ke = kv_spans_from_batches(qsl, torch.tensor(lens))
    q = torch.randn(int(qsl[-1]), h, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens), d, generator=g, dtype=torch.float64)
    w = torch.randn(int(qsl[-1]), h, generator=g, dtype=torch.float64)
    _assert_same_inf_then_close(
        indexer_logits(hadamard_rotate(q), hadamard_rotate(k), w, ks, ke), indexer_logits(q, k, w, ks, ke), 1e-10, 1e-10
    )


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="x must have a last dimension"):
        hadamard_rotate(torch.zeros(2, 6))


# ------------------------------------------------------------------ fp8 quantization


def test_quantize_scales_tell_ue8m0_from_fp32():
    # amax 336: 336 / 448 = 0.75 exactly; ue8m0 rounds it up to 1.0.
    q = torch.zeros(1, 1, 128)
    q[0, 0, 3] = 336.0
    assert quantize_indexer_q(q, torch.ones(1, 1), scale_fmt="ue8m0").q_scale.item() == 1.0
    assert quantize_indexer_q(q, torch.ones(1, 1), scale_fmt=None).q_scale.item() == 0.75
    k = torch.zeros(2, 128)
    k[0, 7] = -336.0
    qk = quantize_indexer_k(k)
    assert qk.k_scale.tolist() == [1.0, 2.0**-22]  # the zero row: max(0, 1e-4) / 448 -> 2**-22
    assert qk.k_fp8[0, 7].float().item() == -320.0  # 336 is halfway between 320 and 352: ties to even
    assert qk.k_fp8[1].float().abs().sum().item() == 0.0


@given(st.integers(0, 2**16), st.sampled_from(["ue8m0", None]), st.floats(1e-3, 1e3))
def test_quantize_round_trip_within_bound(seed, fmt, magnitude):
    g = _gen(seed)
    q = torch.randn(3, 2, 128, generator=g) * magnitude
    k = torch.randn(4, 128, generator=g) * magnitude
    qq = quantize_indexer_q(q, torch.ones(3, 2), scale_fmt=fmt)
    qk = quantize_indexer_k(k, scale_fmt=fmt)
    if fmt == "ue8m0":
        for s in (qq.q_scale, qk.k_scale):
            assert torch.equal(torch.exp2(torch.log2(s).round()), s), "ue8m0 scales must be powers of two"
    for x, fp8, s in ((q, qq.q_fp8, qq.q_scale[..., None]), (k, qk.k_fp8, qk.k_scale[:, None])):
        err = (fp8.double() * s.double() - x.double()).abs()
        bound = fp8_e4m3_error_bound(x, s)
        assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"
        assert fp8.float().abs().max() <= 448.0


@given(ragged_problems())
@settings(max_examples=15)
def test_fp8_logits_within_propagated_bound(problem):
    """quantized logits vs exact: |dlogit| <= k_scale-free sum_h |w| sum_d (|eq||k| + |q||ek| + |eq||ek|)."""
    lens, counts, h, _, seed = problem
    d = 128
    g = _gen(seed)
    qsl = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    ks, ke = kv_spans_from_batches(qsl, torch.tensor(lens))
    m, n = int(qsl[-1]), sum(lens)
    q = torch.randn(m, h, d, generator=g)
    k = torch.randn(n, d, generator=g)
    w = torch.randn(m, h, generator=g)
    qq, qk = quantize_indexer_q(q, w), quantize_indexer_k(k)
    approx = indexer_logits(qq.q_fp8, qk.k_fp8, qq.weights, ks, ke, qk.k_scale)
    exact = indexer_logits(q, k, fold_indexer_weights(w), ks, ke)
    eq = fp8_e4m3_error_bound(q, qq.q_scale[..., None])  # [M, H, D]
    ek = fp8_e4m3_error_bound(k, qk.k_scale[:, None])  # [N, D]
    qa, ka = q.double().abs(), k.double().abs()
    per_head = sum(torch.einsum("mhd,nd->mhn", a, b) for a, b in ((eq, ka), (qa, ek), (eq, ek)))
    bound = torch.einsum("mhn,mh->mn", per_head, fold_indexer_weights(w).abs())
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(approx))
    assert bool(((approx - exact).abs()[finite] <= bound[finite] * (1 + 1e-9) + 1e-12).all())


def test_quantize_folded_weights_reproduce_dequantized_logits():
    g = _gen(3)
    q, k, w = torch.randn(4, 3, 128, generator=g), torch.randn(6, 128, generator=g), torch.randn(4, 3, generator=g)
    qq = quantize_indexer_q(q, w)
    ks, ke = torch.zeros(4, dtype=torch.int64), torch.full((4,), 6)
    deq = qq.q_fp8.double() * qq.q_scale.double()[..., None]
    torch.testing.assert_close(
        indexer_logits(qq.q_fp8, k, qq.weights, ks, ke),
        indexer_logits(deq, k, fold_indexer_weights(w), ks, ke),
        rtol=1e-12,
        atol=1e-12,
    )


# ------------------------------------------------------------------ paged cache


def test_cache_layout_byte_offsets():
    lay = IndexerCacheLayout(64)
    assert (lay.token_bytes, lay.block_bytes, lay.scale_offset) == (132, 64 * 132, 8192)
    assert lay.value_offset(3) == 384 and lay.scale_byte_offset(3) == 8192 + 12


def test_cache_write_places_values_then_scales():
    lay = IndexerCacheLayout(4, head_dim=8)
    k = torch.zeros(1, 8)
    k[0, 0] = 320.0  # ue8m0 scale 1.0, fp8 value 320
    cache = write_indexer_k_cache(lay.empty(2), k, torch.tensor([6]), scale_fmt="ue8m0")  # block 1, offset 2
    block = cache[1].reshape(-1)
    assert block[16:24].view(torch.float8_e4m3fn)[0].float().item() == 320.0
    assert block[32 + 8 : 32 + 12].view(torch.float32).item() == 1.0
    untouched = torch.ones(lay.block_bytes, dtype=torch.bool)
    untouched[16:24] = False
    untouched[40:44] = False
    assert bool((block[untouched] == 0xFF).all()) and bool((cache[0] == 0xFF).all())


@given(st.integers(0, 2**16), st.sampled_from([1, 2, 4]))
def test_cache_round_trip_and_padding_slot(seed, p):
    g = _gen(seed)
    lay = IndexerCacheLayout(p, head_dim=16)
    nb = 8
    k = torch.randn(6, 16, generator=g)
    slots = torch.randperm(nb * p, generator=g)[:6]
    slots[2] = -1
    cache = lay.empty(nb)
    new = write_indexer_k_cache(cache, k, slots)
    assert bool((cache == 0xFF).all()), "the input cache must not be modified"
    keep = slots >= 0
    got = read_indexer_k_cache(new, slots[keep])
    want = quantize_indexer_k(k[keep])
    assert torch.equal(got.k_fp8.view(torch.uint8), want.k_fp8.view(torch.uint8))
    assert torch.equal(got.k_scale, want.k_scale)


def _paged_problem(seed, lens, p=4, d=16, h=2, next_n=1):
    """Scatter each request's keys into randomly permuted pages of a NaN-filled cache."""
    g = _gen(seed)
    lay = IndexerCacheLayout(p, head_dim=d)
    blocks_per = [(length + p - 1) // p for length in lens]
    nb = max(1, sum(blocks_per) + 2)
    pool = torch.randperm(nb, generator=g)
    table = torch.full((len(lens), max(1, max(blocks_per))), -1, dtype=torch.int32)
    cache, ks, off = lay.empty(nb), [], 0
    for b, length in enumerate(lens):
        table[b, : blocks_per[b]] = pool[off : off + blocks_per[b]].to(torch.int32)
        off += blocks_per[b]
        kb = torch.randn(length, d, generator=g)
        pos = torch.arange(length)
        slots = table[b, pos // p].long() * p + pos % p
        cache = write_indexer_k_cache(cache, kb, slots)
        ks.append(kb)
    q = torch.randn(len(lens), next_n, h, d, generator=g)
    w = torch.randn(len(lens) * next_n, h, generator=g)
    return cache, table, ks, q, w


def test_gather_matches_quantized_keys():
    cache, table, ks, _, _ = _paged_problem(0, [5, 0, 9])
    got = gather_indexer_k_cache(cache, table, torch.tensor([5, 0, 9]))
    want = quantize_indexer_k(torch.cat(ks))
    assert got.cu_seq_lens.tolist() == [0, 5, 5, 14]
    assert torch.equal(got.k_fp8.view(torch.uint8), want.k_fp8.view(torch.uint8))
    assert torch.equal(got.k_scale, want.k_scale)


@given(st.lists(st.integers(0, 10), min_size=1, max_size=3), st.sampled_from([1, 2, 3]), st.integers(0, 2**16))
@settings(max_examples=20)
def test_paged_logits_equal_ragged_logits(lens, next_n, seed):
    lens = [max(length, next_n) for length in lens]
    cache, table, _, q, w = _paged_problem(seed, lens, next_n=next_n)
    native = decode_context_lens_native(torch.tensor(lens), next_n)
    one_d = paged_indexer_logits(q, cache, table, torch.tensor(lens), w)
    two_d = paged_indexer_logits(q, cache, table, native.to(torch.int32), w)
    assert torch.equal(torch.isneginf(one_d), torch.isneginf(two_d))
    torch.testing.assert_close(one_d, two_d, rtol=0, atol=0)
    # DeepGEMM's own view of the same bytes, [NB, P, 1, D + 4], reads the same logits
    torch.testing.assert_close(paged_indexer_logits(q, cache.unsqueeze(2), table, torch.tensor(lens), w), one_d)
    assert not torch.isnan(one_d).any(), "NaN pages must never be read"
    # the same rows through the ragged path: gathered keys, spans [ks_b, ks_b + len)
    g = gather_indexer_k_cache(cache, table, torch.tensor(lens))
    ks = g.cu_seq_lens[:-1].repeat_interleave(next_n)
    ke = ks + native.reshape(-1)
    ragged = indexer_logits(q.reshape(-1, *q.shape[2:]), g.k_fp8, w, ks, ke, g.k_scale)
    _assert_same_inf_then_close(absolute_to_compressed(ragged, ks, ke, one_d.shape[1]), one_d)


def test_paged_logits_read_deepgemm_4d_cache_view():
    """DeepGEMM's ``tests/test_attention.py`` hands ``fp8_paged_mqa_logits`` the cache as ``[NB, P, 1, D + 4]``
    (vLLM: ``kv_cache.unsqueeze(-2)``); the spec reads that view and the 3-D allocation alike, and refuses a 4-D
    cache whose third dimension is not 1 or a negative context length."""
    cache, table, ks, q, w = _paged_problem(3, [3, 6])
    want = paged_indexer_logits(q, cache, table, torch.tensor([3, 6]), w)
    got = paged_indexer_logits(q, cache.view(cache.shape[0], cache.shape[1], 1, -1), table, torch.tensor([3, 6]), w)
    assert torch.equal(got, want)
    # row 0 by hand: key n of request 0 is ks[0][n], quantized
    k = quantize_indexer_k(ks[0])
    ref = indexer_logits(q[0], k.k_fp8, w[:1], torch.tensor([0]), torch.tensor([3]), k.k_scale)
    torch.testing.assert_close(got[0, :3], ref[0, :3], rtol=0, atol=0)
    with pytest.raises(ValueError, match="cache must have shape"):
        paged_indexer_logits(q, cache.view(cache.shape[0], cache.shape[1] // 2, 2, -1), table, torch.tensor([3, 6]), w)
    with pytest.raises(ValueError, match="context_lens must lie in"):
        paged_indexer_logits(q, cache, table, torch.tensor([3, -1]), w)


def test_paged_logits_pad_to_max_context_len():
    cache, table, _, q, w = _paged_problem(1, [3, 6])
    out = paged_indexer_logits(q, cache, table, torch.tensor([3, 6]), w, max_context_len=10)
    assert out.shape == (2, 10)
    assert torch.isneginf(out[0, 3:]).all() and torch.isfinite(out[0, :3]).all() and torch.isneginf(out[1, 6:]).all()


# ------------------------------------------------------------------ column forms


@given(ragged_problems())
def test_compressed_absolute_round_trip(problem):
    lens, counts, h, d, seed = problem
    qsl = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    ks, ke = kv_spans_from_batches(qsl, torch.tensor(lens))
    g = _gen(seed)
    n = sum(lens)
    logits = indexer_logits(
        torch.randn(int(qsl[-1]), h, d, generator=g),
        torch.randn(n, d, generator=g),
        torch.randn(int(qsl[-1]), h, generator=g),
        ks,
        ke,
    )
    comp = absolute_to_compressed(logits, ks, ke)
    for m in range(ks.numel()):
        span = int(ke[m] - ks[m])
        assert torch.isfinite(comp[m, :span]).all() and torch.isneginf(comp[m, span:]).all()
    garbage = torch.where(torch.isneginf(comp), 12345.0, comp)  # DeepGEMM leaves the tail uninitialised
    _assert_same_inf_then_close(compressed_to_absolute(garbage, ks, ke, n), logits, 0, 0)


# ------------------------------------------------------------------ ragged and paged metadata


def test_kv_spans_from_batches_docstring_example():
    ks, ke = kv_spans_from_batches(torch.tensor([0, 2, 4, 7]), torch.tensor([5, 9, 4]))
    assert ks.tolist() == [0, 0, 5, 5, 14, 14, 14]
    assert ke.tolist() == [4, 5, 13, 14, 16, 17, 18]


def test_decode_flattened_seed_example():
    # vLLM indexer.py _prepare_decode_tensors comment: seq_lens [10, 7, 12, 0], decode_lens [3, 1, 4, 0].
    flat = decode_context_lens_flattened(torch.tensor([10, 7, 12, 0]), torch.tensor([3, 1, 4, 0]))
    assert flat.context_lens.tolist() == [8, 9, 10, 7, 9, 10, 11, 12]
    assert flat.request.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]


@given(st.lists(st.integers(0, 20), min_size=1, max_size=5), st.integers(1, 4))
def test_native_equals_flattened_for_uniform_decode(lens, next_n):
    lens_t = torch.tensor([max(length, next_n) for length in lens])
    flat = decode_context_lens_flattened(lens_t, torch.full_like(lens_t, next_n))
    assert torch.equal(decode_context_lens_native(lens_t, next_n).reshape(-1), flat.context_lens)


def test_native_clamps_padding_requests_at_zero():
    assert decode_context_lens_native(torch.tensor([0, 5]), 2).tolist() == [[0, 0], [4, 5]]


def test_split_chunks_worked_example():
    # budget 40 logits, workspace 12 keys: req 0 alone (req 0+1 is 8 x 10 = 80), req 1 alone (N would be 16),
    # req 2 over budget by itself (10 x 10) -> cut into 40 // 10 = 4-query sub-chunks
    chunks = split_indexer_prefill_chunks(
        torch.tensor([4, 6, 10]), torch.tensor([2, 6, 10]), 12, 4 * 40, request_offset=3
    )
    assert chunks == [
        (slice(3, 4), slice(0, 2)),
        (slice(4, 5), slice(0, 6)),
        (slice(5, 6), slice(0, 4)),
        (slice(5, 6), slice(4, 8)),
        (slice(5, 6), slice(8, 10)),
    ]
    assert all(isinstance(c, IndexerPrefillChunk) for c in chunks)


@st.composite
def prefill_batches(draw):
    b = draw(st.integers(1, 5))
    lens = [draw(st.integers(1, 12)) for _ in range(b)]
    qlens = [draw(st.integers(1, length)) for length in lens]
    return lens, qlens, draw(st.integers(1, 40)), draw(st.integers(4, 4 * 200))


@given(prefill_batches())
def test_split_chunks_cover_each_query_once_within_bounds(batch):
    lens, qlens, workspace, max_bytes = batch
    chunks = split_indexer_prefill_chunks(torch.tensor(lens), torch.tensor(qlens), workspace, max_bytes)
    budget = max_bytes // 4
    seen, next_req = [], 0
    for req, qs in chunks:
        assert req.start <= next_req <= req.stop
        next_req = req.stop
        m = sum(qlens[req])
        n = sum(lens[req])
        assert 0 <= qs.start < qs.stop <= m
        seen += [(req.start, i) for i in range(qs.start, qs.stop)]
        if req.stop - req.start > 1:  # a chunk of several requests keeps both limits
            assert n <= workspace and m * n <= budget
        if n <= budget:  # query sub-chunks keep the logits limit whenever one query can
            assert (qs.stop - qs.start) * n <= budget
    reqs = [slice(*r) for r in dict.fromkeys((req.start, req.stop) for req, _ in chunks)]  # distinct, in order
    assert [r.start for r in reqs] == [0] + [r.stop for r in reqs[:-1]], "request slices must tile the batch"
    want = [(r.start, i) for r in reqs for i in range(sum(qlens[r]))]
    assert seen == want
    assert next_req == len(lens)


@given(prefill_batches(), ragged_problems())
@settings(max_examples=20)
def test_chunked_indexer_equals_unchunked(batch, problem):
    lens, qlens, workspace, max_bytes = batch
    _, _, h, d, seed = problem
    g = _gen(seed)
    n_dec = 1  # one decode request in front, as vLLM orders the batch
    all_lens = torch.tensor([3, *lens])
    qsl = torch.tensor([0, 1, *(1 + torch.tensor(qlens).cumsum(0)).tolist()])
    t = int(qsl[-1])
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    w = torch.randn(t, h, generator=g, dtype=torch.float64)
    k_req = [torch.randn(int(length), d, generator=g, dtype=torch.float64) for length in all_lens]

    # unchunked: every prefill request at once
    ks, ke = kv_spans_from_batches(qsl[n_dec:] - qsl[n_dec], all_lens[n_dec:])
    full = indexer_logits(q[int(qsl[n_dec]) :], torch.cat(k_req[n_dec:]), w[int(qsl[n_dec]) :], ks, ke)
    full_rel = absolute_to_compressed(full, ks, ke, max(lens))

    rows = torch.full((t - int(qsl[n_dec]), max(lens)), float("nan"), dtype=torch.float64)
    for chunk in split_indexer_prefill_chunks(all_lens[n_dec:], torch.tensor(qlens), workspace, max_bytes, n_dec):
        meta = prefill_chunk_metadata(qsl, all_lens, chunk)
        k_chunk = torch.cat(k_req[chunk.req_slice])
        assert k_chunk.shape[0] == int(meta.cu_seq_lens[-1])
        rows_q = slice(meta.token_start, meta.token_end)
        part = indexer_logits(q[rows_q], k_chunk, w[rows_q], meta.ks, meta.ke)
        rows[meta.token_start - int(qsl[n_dec]) : meta.token_end - int(qsl[n_dec])] = absolute_to_compressed(
            part, meta.ks, meta.ke, max(lens)
        )
    assert not torch.isnan(rows).any(), "every prefill token must be scored by exactly one chunk"
    _assert_same_inf_then_close(rows, full_rel, 1e-12, 1e-12)


# ------------------------------------------------------------------ bad input


def test_bad_inputs_name_the_argument():
    q, k, w = torch.zeros(2, 1, 4), torch.zeros(3, 4), torch.zeros(2, 1)
    ks, ke = torch.zeros(2, dtype=torch.int64), torch.full((2,), 3)
    with pytest.raises(ValueError, match="ke must be <= N"):
        indexer_logits(q, k, w, ks, ke + 1)
    with pytest.raises(ValueError, match="ke must be >= ks"):
        indexer_logits(q, k, w, ks + 2, ke - 2)
    with pytest.raises(TypeError, match="q must have dtype"):
        indexer_logits(q.long(), k, w, ks, ke)
    with pytest.raises(ValueError, match="weights must have shape"):
        indexer_logits(q, k, torch.zeros(2, 2), ks, ke)
    with pytest.raises(ValueError, match="k must have shape"):
        indexer_logits(q, torch.zeros(3, 5), w, ks, ke)
    with pytest.raises(ValueError, match="scale_fmt"):
        quantize_indexer_k(k, scale_fmt="e8m0")
    with pytest.raises(ValueError, match="k must be finite"):
        quantize_indexer_k(torch.full((1, 4), float("inf")))
    lay = IndexerCacheLayout(2, head_dim=4)
    with pytest.raises(ValueError, match="slot_mapping must be -1 or in"):
        write_indexer_k_cache(lay.empty(1), k[:1], torch.tensor([2]))
    with pytest.raises(ValueError, match="slot_mapping must not repeat"):
        write_indexer_k_cache(lay.empty(2), k[:2], torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="cache must have dtype uint8"):
        read_indexer_k_cache(torch.zeros(1, 2, 8), torch.tensor([0]))
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        IndexerCacheLayout(0)
    with pytest.raises(ValueError, match="seq_len_per_batch must be >="):
        kv_spans_from_batches(torch.tensor([0, 3]), torch.tensor([2]))
    with pytest.raises(ValueError, match="start_seq_loc must start at 0"):
        kv_spans_from_batches(torch.tensor([1, 3]), torch.tensor([2]))
    with pytest.raises(ValueError, match="decode_lens must satisfy"):
        decode_context_lens_flattened(torch.tensor([2]), torch.tensor([3]))
    with pytest.raises(ValueError, match="workspace_size must be >= 1"):
        split_indexer_prefill_chunks(torch.tensor([2]), torch.tensor([1]), 0, 64)
    with pytest.raises(ValueError, match="query_lens must have shape"):
        split_indexer_prefill_chunks(torch.tensor([2]), torch.tensor([1, 1]), 8, 64)
    cache, table, _, qp, wp = _paged_problem(0, [5])
    with pytest.raises(ValueError, match="block_table must have at least"):
        paged_indexer_logits(qp, cache, table, torch.tensor([50]), wp)
    with pytest.raises(ValueError, match="weights must have shape"):
        paged_indexer_logits(qp, cache, table, torch.tensor([5]), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="max_context_len must be >="):
        paged_indexer_logits(qp, cache, table, torch.tensor([5]), wp, max_context_len=2)
    with pytest.raises(ValueError, match="width must be >="):
        absolute_to_compressed(torch.zeros(1, 4), torch.tensor([0]), torch.tensor([3]), 2)
    with pytest.raises(ValueError, match="chunk.query_slice"):
        prefill_chunk_metadata(torch.tensor([0, 2]), torch.tensor([4]), IndexerPrefillChunk(slice(0, 1), slice(0, 5)))
