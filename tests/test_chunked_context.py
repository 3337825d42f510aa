"""Chunked-prefill context: workspace size, the chunk plan, chunked == full attention, and the mixed batch."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaspec.spec.batch import Request, build_metadata, reorder_batch_to_split_decodes_and_prefills
from mlaspec.spec.chunked_context import (
    chunked_prefill_attention,
    chunked_prefill_workspace_size,
    mla_mixed_batch,
    plan_context_chunks,
)
from mlaspec.spec.forms import mla_mha

H_Q, D_NOPE, D_ROPE, LKV, D_V, D_HIDDEN = 2, 3, 2, 4, 3, 5  # tiny MLA: heads, nope, rope, latent, value, hidden
SCALE = 0.7


def randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def make_problem(seed, contexts, new_tokens):
    """Random MLA tensors: packed new tokens [T, ...], per-request contexts, weights."""
    g = torch.Generator().manual_seed(seed)
    t = sum(new_tokens)
    new = dict(
        q_nope=randn(g, t, H_Q, D_NOPE), q_pe=randn(g, t, H_Q, D_ROPE), kv_c=randn(g, t, LKV), k_pe=randn(g, t, D_ROPE)
    )
    ctx = [(randn(g, c, LKV), randn(g, c, D_ROPE)) for c in contexts]
    w = dict(W_UK=randn(g, LKV, H_Q, D_NOPE), W_UV=randn(g, LKV, H_Q, D_V))
    return new, ctx, w


def full_attention(new, ctx, w, new_tokens):
    """Reference: each request alone, causal over context + new tokens, compute-friendly form: [T, H_q, D_v],
    [H_q, T]."""
    outs, lses, s = [], [], 0
    for (ckv, cpe), q in zip(ctx, new_tokens):
        e = s + q
        kv = torch.cat([ckv, new["kv_c"][s:e]])[None]
        pe = torch.cat([cpe, new["k_pe"][s:e]])[None]
        o, l = mla_mha(
            new["q_nope"][None, s:e], new["q_pe"][None, s:e], kv, pe, w["W_UK"], w["W_UV"], scale=SCALE, causal=True
        )
        outs.append(o[0])
        lses.append(l[0])
        s = e
    return torch.cat(outs), torch.cat(lses, dim=1)


def cu(lens):
    return torch.tensor([0, *itertools.accumulate(lens)])


# -- workspace size -------------------------------------------------------------------------------------------------


def test_workspace_size_deepseek_v3():
    # DeepSeek-V3: max_model_len 163840, 256 sequences, FlashMLA pages of 64
    assert chunked_prefill_workspace_size(163840, 256, 64) == 64 * 1024  # 0.33 caps at 64K
    assert chunked_prefill_workspace_size(163840, 256, 64, version="seed") == 128 * 1024


def test_workspace_size_small_model_and_floor():
    assert chunked_prefill_workspace_size(2048, 16, 16) == 8 * 2048  # 8 full-length requests
    assert chunked_prefill_workspace_size(256, 64, 16) == 4 * 64 * 16  # 4 pages per request
    # 0.33 raises the size to one page per request; the seed asserted instead
    assert chunked_prefill_workspace_size(4096, 2048, 64) == 2048 * 64
    assert chunked_prefill_workspace_size(4096, 2048, 64, version="seed") == 128 * 1024
    with pytest.raises(ValueError, match="max_num_seqs"):
        chunked_prefill_workspace_size(4096, 4096, 64, version="seed")


def test_workspace_size_bad_input():
    with pytest.raises(ValueError, match="version"):
        chunked_prefill_workspace_size(4096, 16, 64, version="0.10")
    with pytest.raises(ValueError, match="block_size"):
        chunked_prefill_workspace_size(4096, 16, 0)
    with pytest.raises(TypeError, match="max_model_len"):
        chunked_prefill_workspace_size(4096.0, 16, 64)


# -- plan -----------------------------------------------------------------------------------------------------------


def test_plan_docstring_example():
    plan = plan_context_chunks([700, 0, 300, 1000], workspace_size=1024, block_size=64)
    assert plan.max_context_chunk == 320
    assert plan.num_chunks == 4
    assert plan.seq_lens.tolist() == [[320, 0, 300, 320], [320, 0, 0, 320], [60, 0, 0, 320], [0, 0, 0, 40]]
    assert plan.starts[:, 0].tolist() == [0, 320, 640, 960]
    assert plan.cu_seq_lens[0].tolist() == [0, 320, 320, 620, 940]
    assert plan.seq_tot == (940, 640, 380, 40)
    assert plan.max_seq_lens == (320, 320, 320, 40)


def test_plan_seed_comment_example():
    # vLLM's comment: max_context_chunk 256, 3 chunks, 4 prefills with context -> starts [[0]*4, [256]*4, [512]*4]
    plan = plan_context_chunks([600, 512, 700, 100], workspace_size=1024, block_size=16)
    assert plan.max_context_chunk == 256
    assert plan.starts.tolist() == [[0] * 4, [256] * 4, [512] * 4]


def test_plan_no_context_and_unaligned():
    assert plan_context_chunks([0, 0], 64, 16).num_chunks == 0
    # without page alignment (vLLM off CUDA) the chunk is the plain share
    assert plan_context_chunks([50, 50, 50], 100, 16, align_to_block=False).max_context_chunk == 33
    assert plan_context_chunks([50, 50, 50], 100, 16).max_context_chunk == 32


def test_plan_bad_input():
    with pytest.raises(ValueError, match="workspace_size"):
        plan_context_chunks([100, 100, 100], 40, 16)  # 40 // 3 = 13 rounds down to 0 pages
    with pytest.raises(ValueError, match="context_lens"):
        plan_context_chunks(torch.tensor([3, -1]), 64, 16)
    with pytest.raises(ValueError, match=r"context_lens\[1\]"):
        plan_context_chunks([3, -1], 64, 16)
    with pytest.raises(TypeError, match="context_lens"):
        plan_context_chunks(torch.tensor([3.0]), 64, 16)


@given(st.lists(st.integers(0, 300), max_size=6), st.integers(1, 512), st.sampled_from([1, 4, 16]), st.booleans())
def test_plan_covers_each_context_once_within_the_workspace(ctx, workspace, block_size, align):
    with_context = sum(c > 0 for c in ctx)
    share = workspace // max(with_context, 1)
    if with_context and (share // block_size * block_size if align else share) == 0:
        with pytest.raises(ValueError, match="workspace_size"):
            plan_context_chunks(ctx, workspace, block_size, align_to_block=align)
        return
    plan = plan_context_chunks(ctx, workspace, block_size, align_to_block=align)
    assert all(tot <= workspace for tot in plan.seq_tot)  # no chunk exceeds the workspace
    for b, c in enumerate(ctx):
        covered = []
        for i in range(plan.num_chunks):
            s, n = int(plan.starts[i, b]), int(plan.seq_lens[i, b])
            covered += range(s, s + n)
        assert covered == list(range(c))  # every context token exactly once, in order
    if align and plan.num_chunks:
        assert bool((plan.starts % block_size == 0).all())
    assert plan.cu_seq_lens[:, 1:].diff(dim=1, prepend=plan.cu_seq_lens[:, :1]).tolist() == plan.seq_lens.tolist()


# -- chunked == full ------------------------------------------------------------------------------------------------


@st.composite
def prefill_problem(draw):
    contexts = draw(st.lists(st.integers(0, 12), min_size=1, max_size=4))
    new_tokens = [draw(st.integers(1, 4)) for _ in contexts]
    block_size = draw(st.sampled_from([1, 2, 4]))
    with_context = max(sum(c > 0 for c in contexts), 1)
    workspace = draw(st.integers(with_context * block_size, 40))
    return contexts, new_tokens, block_size, workspace, draw(st.integers(0, 2**16))


@given(prefill_problem())
def test_chunked_equals_full_attention(problem):
    contexts, new_tokens, block_size, workspace, seed = problem
    new, ctx, w = make_problem(seed, contexts, new_tokens)
    plan = plan_context_chunks(contexts, workspace, block_size)
    out, lse = chunked_prefill_attention(**new, cu_seqlens_q=cu(new_tokens), context=ctx, plan=plan, **w, scale=SCALE)
    ref_out, ref_lse = full_attention(new, ctx, w, new_tokens)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_requests_without_context_in_a_chunk():
    # request 0 has no context at all (every chunk is empty for it: LSE -inf, merge guard keeps 0), request 1's
    # context ends in chunk 0 while request 2's runs to chunk 2
    contexts, new_tokens = [0, 3, 11], [2, 1, 3]
    new, ctx, w = make_problem(7, contexts, new_tokens)
    plan = plan_context_chunks(contexts, workspace_size=8, block_size=2)
    assert plan.seq_lens.tolist() == [[0, 3, 4], [0, 0, 4], [0, 0, 3]]
    out, lse = chunked_prefill_attention(**new, cu_seqlens_q=cu(new_tokens), context=ctx, plan=plan, **w, scale=SCALE)
    ref_out, ref_lse = full_attention(new, ctx, w, new_tokens)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    assert bool(torch.isfinite(lse).all())


def test_gather_callable_equals_tensor_list():
    contexts, new_tokens = [5, 9], [2, 3]
    new, ctx, w = make_problem(3, contexts, new_tokens)
    plan = plan_context_chunks(contexts, workspace_size=6, block_size=1)
    calls = []

    def gather(b, start, length):
        calls.append((b, start, length))
        return ctx[b][0][start : start + length], ctx[b][1][start : start + length]

    a = chunked_prefill_attention(**new, cu_seqlens_q=cu(new_tokens), context=ctx, plan=plan, **w, scale=SCALE)
    b = chunked_prefill_attention(**new, cu_seqlens_q=cu(new_tokens), context=gather, plan=plan, **w, scale=SCALE)
    torch.testing.assert_close(a.out, b.out, rtol=0, atol=0)
    assert (1, 3, 3) in calls  # request 1, chunk 1 starts at 3 with 3 rows


def test_chunked_bad_input():
    contexts, new_tokens = [4, 2], [2, 1]
    new, ctx, w = make_problem(0, contexts, new_tokens)
    plan = plan_context_chunks(contexts, 8, 2)
    args = dict(**new, cu_seqlens_q=cu(new_tokens), context=ctx, plan=plan, **w, scale=SCALE)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        chunked_prefill_attention(**{**args, "cu_seqlens_q": torch.tensor([0, 3])})
    with pytest.raises(ValueError, match="cu_seqlens_q must end"):
        chunked_prefill_attention(**{**args, "cu_seqlens_q": torch.tensor([0, 1, 2])})
    with pytest.raises(ValueError, match=r"context\[1\] kv_c"):
        chunked_prefill_attention(**{**args, "context": [ctx[0], (ctx[1][0][:1], ctx[1][1][:1])]})
    with pytest.raises(ValueError, match="context must be"):
        chunked_prefill_attention(**{**args, "context": ctx[:1]})
    with pytest.raises(ValueError, match="kv_c"):
        chunked_prefill_attention(**{**args, "kv_c": new["kv_c"][:, :2]})
    with pytest.raises(TypeError, match="plan"):
        chunked_prefill_attention(**{**args, "plan": None})


# -- mixed batch ----------------------------------------------------------------------------------------------------


@st.composite
def mixed_problem(draw):
    threshold = draw(st.integers(1, 3))
    reqs = draw(st.lists(st.builds(Request, st.integers(0, 10), st.integers(1, 5)), min_size=1, max_size=5))
    regions = draw(st.sampled_from([2, 4]))
    reqs = list(reorder_batch_to_split_decodes_and_prefills(reqs, threshold, regions=regions).requests)
    block_size = draw(st.sampled_from([1, 2, 4]))
    workspace = draw(st.integers(len(reqs) * block_size, 32))
    return reqs, threshold, block_size, workspace, draw(st.integers(0, 2**16))


@given(mixed_problem())
def test_mixed_batch_equals_each_request_alone(problem):
    reqs, threshold, block_size, workspace, seed = problem
    contexts, new_tokens = [r.context_len for r in reqs], [r.new_tokens for r in reqs]
    new, ctx, w = make_problem(seed, contexts, new_tokens)
    m = build_metadata(reqs, block_size=block_size)
    res = mla_mixed_batch(
        **new, metadata=m, context=ctx, **w, scale=SCALE, workspace_size=workspace, decode_threshold=threshold
    )
    ref_out, ref_lse = full_attention(new, ctx, w, new_tokens)
    torch.testing.assert_close(res.out, ref_out, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(res.lse, ref_lse, rtol=1e-11, atol=1e-11)
    assert res.split.num_decodes + res.split.num_prefills == len(reqs)
    assert all(tot <= workspace for tot in res.plan.seq_tot)


def test_mixed_batch_with_output_projection_and_paged_gather():
    # decodes (one with 2 MTP tokens), then prefills with and without context; context read through pages
    reqs = [Request(6, 1), Request(3, 2), Request(9, 4), Request(0, 3)]
    contexts, new_tokens = [r.context_len for r in reqs], [r.new_tokens for r in reqs]
    new, ctx, w = make_problem(11, contexts, new_tokens)
    block_size = 2
    table = torch.randperm(28, generator=torch.Generator().manual_seed(5)).reshape(4, 7)  # scattered pages
    m = build_metadata(reqs, block_size=block_size, block_table=table, num_blocks=28)
    cache = torch.full((28 * block_size, LKV + D_ROPE), math.nan, dtype=torch.float64)  # NaN in every unused slot
    for b, (ckv, cpe) in enumerate(ctx):
        for pos in range(contexts[b]):
            slot = int(m.block_table[b, pos // block_size]) * block_size + pos % block_size
            cache[slot] = torch.cat([ckv[pos], cpe[pos]])

    def gather(b, start, length):
        pos = torch.arange(start, start + length)
        slots = m.block_table[b].long()[pos // block_size] * block_size + pos % block_size
        return cache[slots, :LKV], cache[slots, LKV:]

    g = torch.Generator().manual_seed(1)
    W_O = randn(g, H_Q * D_V, D_HIDDEN)
    res = mla_mixed_batch(
        **new, metadata=m, context=gather, **w, scale=SCALE, workspace_size=4, decode_threshold=2, W_O=W_O
    )
    assert res.split == (2, 2, 3, 7)
    assert res.plan.max_context_chunk == 4 and res.plan.num_chunks == 3
    ref_out, _ = full_attention(new, ctx, w, new_tokens)
    torch.testing.assert_close(res.out, ref_out.reshape(-1, H_Q * D_V) @ W_O, rtol=1e-11, atol=1e-11)


def test_mixed_batch_bad_input():
    reqs = [Request(5, 1), Request(0, 3), Request(4, 1)]  # a decode after a prefill: not reordered
    new, ctx, w = make_problem(0, [5, 0, 4], [1, 3, 1])
    m = build_metadata(reqs, block_size=2)
    with pytest.raises(ValueError, match="metadata must be reordered"):
        mla_mixed_batch(**new, metadata=m, context=ctx, **w, scale=SCALE, workspace_size=8)
    reqs = [Request(4, 1), Request(0, 3)]
    good = build_metadata(reqs, block_size=2)
    new, ctx, w = make_problem(0, [4, 0], [1, 3])
    with pytest.raises(ValueError, match="W_O"):
        mla_mixed_batch(**new, metadata=good, context=ctx, **w, scale=SCALE, workspace_size=8, W_O=torch.zeros(5, 2))
    with pytest.raises(ValueError, match="q_nope"):
        mla_mixed_batch(
            **{**new, "q_nope": new["q_nope"][:2]}, metadata=good, context=ctx, **w, scale=SCALE, workspace_size=8
        )
    with pytest.raises(TypeError, match="metadata"):
        mla_mixed_batch(**new, metadata=None, context=ctx, **w, scale=SCALE, workspace_size=8)


# -- chunked context through an fp8 cache -------------------------------------------------------------------------


@settings(max_examples=6)  # 576-wide entries: each example quantizes a real cache
@given(st.lists(st.integers(0, 9), min_size=1, max_size=3), st.integers(0, 2**16))
def test_chunked_through_fp8_cache_is_within_the_quantization_bound(contexts, seed):
    # contexts written to FlashMLA's 656-byte fp8 cache, read back chunk by chunk through gather_cache +
    # dequantize: (1) equals full attention over the dequantized context exactly; (2) differs from attention
    # over the unquantized context by at most the cache's error bound carried through the logits and values.
    from mlaspec.spec.cache_layouts import FP8_DS_MLA_V32, dequantize, error_bound
    from mlaspec.spec.paged_cache import concat_and_cache_mla, gather_cache

    lkv, r, page = 512, 64, 4
    g = torch.Generator().manual_seed(seed)
    new_tokens = [2] * len(contexts)
    t = sum(new_tokens)
    new = dict(q_nope=randn(g, t, H_Q, D_NOPE), q_pe=randn(g, t, H_Q, r), kv_c=randn(g, t, lkv), k_pe=randn(g, t, r))
    w = dict(W_UK=randn(g, lkv, H_Q, D_NOPE) / 20, W_UV=randn(g, lkv, H_Q, D_V) / 20)
    ctx = [(randn(g, c, lkv), randn(g, c, r)) for c in contexts]
    # pages: request b owns pages b*3 .. b*3+2 (shuffled), unused bytes are 0xFF (NaN scales / values)
    n_pages = 3 * len(contexts)
    perm = torch.randperm(n_pages, generator=g)
    block_table = perm.reshape(len(contexts), 3)
    cache = torch.full((n_pages, page, FP8_DS_MLA_V32.token_bytes), 255, dtype=torch.uint8)
    for b, (kv, pe) in enumerate(ctx):
        pos = torch.arange(kv.shape[0])
        slots = block_table[b, pos // page] * page + pos % page
        cache = concat_and_cache_mla(kv, pe, cache, slots, kv_cache_dtype="fp8_ds_mla")

    def gather(b, start, length):
        rows = gather_cache(cache, block_table[b : b + 1], torch.tensor([0, length]), seq_starts=torch.tensor([start]))
        e = dequantize(rows.entries, FP8_DS_MLA_V32).entries
        return e[:, :lkv], e[:, lkv:]

    plan = plan_context_chunks(contexts, 4 * len(contexts), page)
    out, lse = chunked_prefill_attention(
        **new, cu_seqlens_q=cu(new_tokens), context=gather, plan=plan, **w, scale=SCALE
    )
    deq = [gather(b, 0, c) for b, c in enumerate(contexts)]
    ref_deq, _ = full_attention(new, deq, w, new_tokens)
    torch.testing.assert_close(out, ref_deq, rtol=1e-12, atol=1e-12)

    exact, _ = full_attention(new, ctx, w, new_tokens)
    s = 0
    for (kv, pe), q in zip(ctx, new_tokens):
        e = s + q
        if kv.shape[0]:
            d = error_bound(torch.cat([kv, pe], 1), FP8_DS_MLA_V32)  # [C, 576]
            dk_nope = torch.einsum("cl,lnp->cnp", d[:, :lkv], w["W_UK"].abs())
            dv = torch.einsum("cl,lnv->cnv", d[:, :lkv], w["W_UV"].abs())
            ds = SCALE * (
                torch.einsum("tnp,cnp->tnc", new["q_nope"][s:e].abs(), dk_nope)
                + torch.einsum("tnr,cr->tnc", new["q_pe"][s:e].abs(), d[:, lkv:])
            )
            delta = ds.amax(-1)  # [q, H_q]: the largest logit perturbation per row
            v_all = torch.cat(
                [
                    torch.einsum("cl,lnv->cnv", kv, w["W_UV"]).abs() + dv,
                    torch.einsum("tl,lnv->tnv", new["kv_c"][s:e], w["W_UV"]).abs(),
                ]
            )
            bound = torch.expm1(2 * delta)[..., None] * v_all.amax(0) + dv.amax(0)  # [q, H_q, D_v]
            assert ((out[s:e] - exact[s:e]).abs() <= bound).all()
        else:
            torch.testing.assert_close(out[s:e], exact[s:e], rtol=1e-12, atol=1e-12)
        s = e
