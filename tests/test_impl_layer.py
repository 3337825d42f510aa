"""The mixed-batch layer (:mod:`mlaspec.impl.layer`) and the fp8 dense decodes (:mod:`mlaspec.impl.decode` over
per-tensor fp8 bytes, :func:`mlaspec.impl.sparse.paged_decode` over FlashMLA's 656-byte token) through Triton's
interpreter, against the spec.

Harness cases: the curated tiny ``mla_mixed_batch`` and ``mla_decode_fp8`` cases in fp16 and fp32 (the
interpreter's bf16 ``tl.dot`` is wrong) through ``TritonBackend``. Kernel-level:
the fp8 decode over shuffled pages filled with ``0xFF`` (e4m3 NaN) with empty and uneven sequences, MTP and forced
splits; the layer with CUDA-graph padding rows, a prefill whose context is longer than the workspace, the cache
written in place at ``slot_mapping``, the chunk plan against the spec's, and an unordered batch refused.
"""

import math
import os
import sys

import pytest

if "mlaspec.impl.decode" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "mlaspec.impl was imported compiled (without TRITON_INTERPRET=1) in this process", allow_module_level=True
    )
os.environ["TRITON_INTERPRET"] = "1"

import torch

from mlaspec.conformance.backends.triton import TritonBackend
from mlaspec.conformance.backends.triton.layer import LAYER_OPS
from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.runner import run_case
from mlaspec.impl.decode import mla_decode_paged, page_cache
from mlaspec.impl.layer import context_chunks, mla_mixed_batch_layer, split_decodes
from mlaspec.impl.sparse import BlockTable, float_keys, fp8_keys, paged_decode, sparse_mla
from mlaspec.spec import cache_layouts as cl
from mlaspec.spec.batch import Request, build_metadata, split_decodes_and_prefills
from mlaspec.spec.chunked_context import mla_mixed_batch, plan_context_chunks
from mlaspec.spec.forms import mqa_latent_attention
from tests.interpreter_cases import interpreter_cases

pytestmark = pytest.mark.interpreter


_B = TritonBackend


# float32 here; the same cases in float16 run in test_impl_interpreter.py (every op's curated cases)
@pytest.mark.parametrize("case", interpreter_cases(curated_cases(ops=tuple(LAYER_OPS), dtypes=("float32",))), ids=str)
def test_harness_cases(case):
    declared = getattr(_B(), f"_unsupported_{case.op}", lambda c: None)(case)  # a named limit (1-token pages)
    r = run_case(_B(), case, backend_name="triton", timeout=None)
    assert r.verdict == ("skip" if declared else "pass"), f"{case.id}: {r.verdict}: {r.reason}"


def test_bf16_is_skipped_in_the_interpreter_with_a_reason():
    case = curated_cases(ops=("mla_mixed_batch",), dtypes=("bfloat16",))[0]
    assert "bfloat16" in _B().unsupported(case)


# -- the fp8 decode -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [cl.FP8_PER_TENSOR, cl.FP8_DS_MLA_V32], ids=lambda x: x.name)
@pytest.mark.parametrize(
    "lens, s_q, splits, causal, dtype",
    [
        ([37, 0, 70], 1, None, True, torch.float32),
        ([65, 16], 3, 3, True, torch.float16),
        ([5, 40], 2, 1, False, torch.float32),
        ([2, 33], 3, 2, True, torch.float32),
    ],
)
def test_fp8_decode_matches_spec_over_dequantized_pages(layout, lens, s_q, splits, causal, dtype):
    """The per-tensor cache through the dense split-KV kernel, FlashMLA's 656-byte token through the sparse kernel
    with every token named by the block table (impl.sparse.paged_decode)."""
    g = torch.Generator().manual_seed(sum(lens) + s_q)
    h, page = 4, 16
    k_scale = 0.046875 if layout.scale_rule.kind == "per_tensor" else None
    s_max, width = max(lens), layout.token_bytes
    x = torch.randn(len(lens) * s_max, 576, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-2, 3, (x.shape[0], 1), generator=g).double())
    pow2 = {} if k_scale else {"pow2_scales": True}  # 656 B: e4m3 * 2^k, exact in q's dtype (ops.fp8_decode)
    raw = cl.quantize(x, layout, scale=k_scale, **pow2).raw.reshape(len(lens), s_max, width)
    cache, table, _ = page_cache(raw, page_size=page, generator=g, fill=0xFF)  # NaN bytes in every unused slot
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = (torch.randn(len(lens), s_q, h, 576, generator=g, dtype=torch.float64) * 3).to(dtype)
    if k_scale is None:
        keys = fp8_keys(cache.reshape(-1, width), "fp8_v32", page_size=page)
        out, lse = paged_decode(q, keys, table, seq_lens, scale=192**-0.5, causal=causal, num_splits=splits)
    else:
        out, lse = mla_decode_paged(
            q, cache, table, seq_lens, k_scale=k_scale, scale=192**-0.5, causal=causal, num_splits=splits
        )
    deq = cl.dequantize(raw.reshape(-1, width), layout, scale=k_scale).entries.reshape(len(lens), s_max, 576)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    for b, n in enumerate(lens):
        ref = mqa_latent_attention(q[b : b + 1].double(), deq[b : b + 1, :n], d_v=512, scale=192**-0.5, causal=causal)
        assert torch.equal(torch.isneginf(lse[b]), torch.isneginf(ref.lse[0].float())), b  # empty rows: -inf
        torch.testing.assert_close(out[b].double(), ref.out[0], atol=tol * 4, rtol=tol)
        fin = torch.isfinite(ref.lse[0])
        torch.testing.assert_close(lse[b][fin].double(), ref.lse[0][fin], atol=1e-4, rtol=1e-5)
        if n == 0:
            assert not out[b].any()


def test_paged_decode_needs_lengths_and_a_table_that_covers_the_rows():
    keys = fp8_keys(torch.zeros(64, 656, dtype=torch.uint8), "fp8_v32", page_size=16)
    q, table = torch.zeros(2, 2, 16, 576), torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_length"):
        sparse_mla(q.reshape(4, 16, 576), keys, BlockTable(table, 2), scale=1.0)
    with pytest.raises(ValueError, match="requests"):
        sparse_mla(q.reshape(4, 16, 576), keys, BlockTable(table, 1), scale=1.0, topk_length=torch.ones(4))
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode(q, keys, table, torch.ones(3, dtype=torch.int32), scale=1.0)
    with pytest.raises(ValueError, match="float keys"):
        paged_decode(q, float_keys(torch.zeros(64, 576)), table, torch.ones(2, dtype=torch.int32), scale=1.0)


def test_decode_takes_k_scale_with_an_fp8_cache_only():
    q, table, lens = torch.zeros(1, 1, 2, 576), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale"):
        mla_decode_paged(q, torch.zeros(2, 16, 576), table, lens, k_scale=1.0, scale=1.0)
    with pytest.raises(ValueError, match="k_scale"):
        mla_decode_paged(q, torch.zeros(2, 16, 576, dtype=torch.uint8), table, lens, scale=1.0)
    with pytest.raises(TypeError, match="kv_cache"):
        mla_decode_paged(q, torch.zeros(2, 16, 576, dtype=torch.float16), table, lens, scale=1.0)


# -- the layer ------------------------------------------------------------------------------------------------------
def test_split_and_chunk_plan_agree_with_the_spec():
    reqs = [Request(9, 2), Request(4, 1), Request(0, 0), Request(30, 5), Request(0, 3), Request(17, 4)]
    meta = build_metadata(reqs, block_size=4)
    q_lens = meta.query_lens.tolist()
    assert split_decodes(q_lens, 2) == split_decodes_and_prefills(meta, 2).num_decodes == 3
    for ws in (8, 12, 40, 64):
        ctx = [30, 0, 17]
        plan = plan_context_chunks(ctx, ws, 4)
        assert context_chunks(ctx, ws, 4) == (plan.max_context_chunk, plan.num_chunks)
    assert context_chunks([0, 0], 8, 4) == (0, 0)
    with pytest.raises(ValueError, match="workspace_size"):
        context_chunks([5, 5, 5], 8, 4)


def _batch(requests, *, lkv=32, r=16, n=4, p=16, v=16, blk=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)
    reqs = [Request(*q) for q in requests]
    pages = [-(-q.seq_len // blk) for q in reqs]
    nb = sum(pages) + 2
    perm = torch.randperm(nb - 1, generator=g)
    table = torch.full((len(reqs), max(max(pages), 1) + 1), nb - 1, dtype=torch.int32)  # spare column -> NaN page
    at = 0
    for b, k in enumerate(pages):
        table[b, :k] = perm[at : at + k].to(torch.int32)
        at += k
    meta = build_metadata(reqs, block_size=blk, block_table=table, num_blocks=nb)
    cache = torch.full((nb, blk, lkv + r), math.nan, dtype=dtype)
    for b, q in enumerate(reqs):
        pos = torch.arange(q.context_len)
        cache[table[b, pos // blk].long(), pos % blk] = rn(q.context_len, lkv + r)
    t = meta.num_actual_tokens
    w_uk, w_uv = rn(lkv, n, p, scale=lkv**-0.5), rn(lkv, n, v, scale=lkv**-0.5)
    return dict(
        q_nope=rn(t, n, p, scale=2.0),
        q_pe=rn(t, n, r, scale=2.0),
        kv_c=rn(t, lkv),
        k_pe=rn(t, r),
        metadata=meta,
        kv_cache=cache,
        W_UK=w_uk,
        W_UV=w_uv,
        scale=(p + r) ** -0.5,
    )


@pytest.mark.parametrize(
    "requests, workspace, threshold",
    [
        ([[21, 2], [0, 1], [3, 0], [50, 7], [0, 5], [16, 3]], 32, 2),  # padding row, MTP, 4 chunks
        ([[0, 0], [0, 0]], 16, 1),  # nothing but CUDA-graph padding
        ([[0, 6], [33, 4]], 16, 1),
    ],  # prefills only, one with context of 3 chunks
)
def test_layer_matches_spec_and_writes_the_cache(requests, workspace, threshold):
    kw = _batch(requests, seed=len(requests) + workspace)
    meta, cache = kw["metadata"], kw["kv_cache"]
    blk, lkv = cache.shape[1], kw["kv_c"].shape[1]

    def gather(b, start, length):
        pos = torch.arange(start, start + length)
        e = cache[meta.block_table[b, pos // blk].long(), pos % blk]
        return e[:, :lkv], e[:, lkv:]

    ref = mla_mixed_batch(
        kw["q_nope"],
        kw["q_pe"],
        kw["kv_c"],
        kw["k_pe"],
        meta,
        gather,
        kw["W_UK"],
        kw["W_UV"],
        scale=kw["scale"],
        workspace_size=workspace,
        decode_threshold=threshold,
    )
    written = cache.clone()
    out, lse = mla_mixed_batch_layer(
        kw["q_nope"],
        kw["q_pe"],
        kw["kv_c"],
        kw["k_pe"],
        written,
        query_start_loc=meta.query_start_loc,
        context_lens=meta.num_computed_tokens,
        block_table=meta.block_table,
        slot_mapping=meta.slot_mapping,
        W_UK=kw["W_UK"],
        W_UV=kw["W_UV"],
        scale=kw["scale"],
        workspace_size=workspace,
        decode_threshold=threshold,
    )
    torch.testing.assert_close(out.double(), ref.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref.lse, atol=1e-5, rtol=1e-6)
    # the new tokens landed at their slots, nothing else changed (NaN stays NaN)
    flat, old = written.view(-1, written.shape[-1]), cache.view(-1, cache.shape[-1])
    slots = meta.slot_mapping.long()
    assert torch.equal(flat[slots], torch.cat([kw["kv_c"], kw["k_pe"]], -1))
    other = torch.ones(flat.shape[0], dtype=torch.bool)
    other[slots] = False
    assert torch.equal(flat[other].view(torch.int32), old[other].view(torch.int32))


def test_layer_refuses_a_batch_not_reordered():
    kw = _batch([[0, 5], [9, 1]])
    meta = kw["metadata"]
    with pytest.raises(ValueError, match="reorder"):
        mla_mixed_batch_layer(
            kw["q_nope"],
            kw["q_pe"],
            kw["kv_c"],
            kw["k_pe"],
            kw["kv_cache"],
            query_start_loc=meta.query_start_loc,
            context_lens=meta.num_computed_tokens,
            block_table=meta.block_table,
            slot_mapping=meta.slot_mapping,
            W_UK=kw["W_UK"],
            W_UV=kw["W_UV"],
            scale=kw["scale"],
            workspace_size=16,
        )
