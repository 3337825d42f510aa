"""Serving ops: the spec and torch backends pass every curated case, and each deliberately wrong backend fails one.

Every mutant is a :class:`TorchBackend` with one method overridden to carry one bug class seen in real kernels;
the test names the curated case that must catch it, so a weakened input or budget shows up here.
"""

import dataclasses
import math

import pytest
import torch

from mlaspec.conformance.backends.reference import SpecBackend
from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import case_by_id, curated_cases
from mlaspec.conformance.ops.serving import OPS
from mlaspec.conformance.runner import run_case
from mlaspec.spec.cache_layouts import LAYOUTS, MXFP8_DS_MLA_V41

SERVING = tuple(op.name for op in OPS)


@pytest.mark.parametrize("backend", [SpecBackend(), TorchBackend()], ids=["spec", "torch"])
def test_builtin_backends_pass_every_serving_case(backend):
    cases = curated_cases(ops=SERVING)
    assert {c.op for c in cases} == set(SERVING)  # every serving op has a curated case
    for case in cases:
        r = run_case(backend, case, backend_name=backend.name)
        assert r.verdict == "pass", (case.id, r.reason)


def test_torch_backend_lists_every_serving_op():
    assert set(SERVING) <= TorchBackend().ops


class WrongGroupScale(TorchBackend):
    """fp8 group scale applied to the wrong group: values of group g divided by group g-1's scale (an index shifted
    by one group of 128), while the stored scales are right."""

    source = "https://github.com/sgl-project/sglang/pull/31218"
    shapes = ""

    def _scale_for_group(self, scales):
        return torch.roll(scales, 1, dims=-1)


class PowerOfTwoScale(TorchBackend):
    """Scale format mixed up: FlashMLA's test quantizer (scale rounded up to a power of two) used as vLLM's 656-byte
    writer, which stores the raw fp32 amax / 448 (the amax-336 group tells them apart: 0.75 vs 1)."""

    source = "https://github.com/flashinfer-ai/flashinfer/issues/2426"
    shapes = ""

    def _fp32_scale(self, amax, max_q):
        return torch.exp2(torch.ceil(torch.log2((amax / max_q).clamp_min(1e-4))))


class WriterIgnoresScaleRule(TorchBackend):
    """fp8_ds_mla writer of the wrong vLLM version: raw fp32 ``amax / 448`` group scales (vLLM 0.33's
    ``concat_and_cache_ds_mla_kernel``) where the case asks for vLLM's power-of-two scales after PR #49435
    (``pow2_scales=True``), so the amax-336 group stores 0.75 instead of 1.0."""

    source = "https://github.com/vllm-project/vllm/pull/49435"
    shapes = "a 128-group whose amax/448 is not a power of two"

    def concat_and_cache_mla(self, kv_c, k_pe, kv_cache, slot_mapping, *, pow2_scales=False, **kw):
        return super().concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, pow2_scales=False, **kw)


class V41ReadInterleaved(TorchBackend):
    """V4.1's 528-byte records read token-interleaved (record ``off`` at ``off * 528``), while vLLM's writer splits
    them like V4: all data rows, then all scale rows (``_rope_quant_insert_mxfp8_kernel``)."""

    source = "https://github.com/sgl-project/sglang/pull/31218"
    shapes = ""

    def read_tokens(self, pages, layout, block_size, slots):
        lay = LAYOUTS[layout] if isinstance(layout, str) else layout
        if lay.name == MXFP8_DS_MLA_V41.name:
            lay = dataclasses.replace(lay, split_at=None)  # same page size (page_alignment kept)
        return super().read_tokens(pages, lay, block_size, slots)


class RopeBeforeLatent(TorchBackend):
    """Entry order swapped: k_pe stored at [0, 64) and the latent after it, instead of latent [0, 512) then rope."""

    source = "https://github.com/flashinfer-ai/flashinfer/issues/1043"
    shapes = ""

    def _entries(self, kv_c, k_pe):
        return torch.cat([k_pe, kv_c], dim=-1)


class PaddingSlotWritten(TorchBackend):
    """Padding slot -1 not skipped: it wraps around to the cache's last slot, overwriting it."""

    source = "https://github.com/HabanaAI/vllm-fork/pull/162"
    shapes = "a padding token (slot -1)"

    def concat_and_cache_mla(self, kv_c, k_pe, kv_cache, slot_mapping, **kw):
        total = kv_cache.shape[0] * kv_cache.shape[1]
        return super().concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping % total, **kw)


class ChunkBoundaryOffByOne(TorchBackend):
    """Context chunk boundary off by one: a full chunk ends at start + W - 1, so its last context token is dropped."""

    source = "https://github.com/vllm-project/vllm/issues/26042"
    shapes = "a context longer than one workspace chunk"

    def chunked_prefill_attention(self, q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, context, plan, W_UK, W_UV, *, scale):
        full = plan.seq_lens == plan.max_context_chunk
        plan = dataclasses.replace(plan, seq_lens=plan.seq_lens - full.long())
        return super().chunked_prefill_attention(
            q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, context, plan, W_UK, W_UV, scale=scale
        )


class ChunkMergeWithoutInfGuard(TorchBackend):
    """LSE merge without the -inf guard: two empty parts (a prefill with no context, chunk after chunk) give
    exp(-inf - -inf) = NaN, which then poisons the new tokens' part."""

    source = "https://github.com/vllm-project/vllm/pull/39148"
    shapes = "a prefill with no context"

    def merge_attn_states(self, prefix_output, prefix_lse, suffix_output, suffix_lse):
        m = torch.maximum(prefix_lse, suffix_lse).float()
        p_w, s_w = torch.exp(prefix_lse - m), torch.exp(suffix_lse - m)
        out = (
            prefix_output.float() * (p_w / (p_w + s_w)).T[..., None]
            + suffix_output.float() * (s_w / (p_w + s_w)).T[..., None]
        )
        return out.to(prefix_output.dtype), torch.log(p_w + s_w) + m


class ReorderStopsOneSwapEarly(TorchBackend):
    """Reorder loop ends one pair early: the last misplaced decode stays behind a prefill."""

    source = "https://github.com/vllm-project/vllm/pull/24045"
    shapes = "regions = 2 with a decode behind a prefill"

    def reorder_batch_to_split_decodes_and_prefills(self, requests, decode_threshold=1, *, regions=4):
        r = super().reorder_batch_to_split_decodes_and_prefills(requests, decode_threshold, regions=regions)
        if regions != 2 or not r.swaps:
            return r
        i, j = r.swaps[-1]
        order = list(r.order)
        order[i], order[j] = order[j], order[i]
        regs = list(r.regions)
        regs[i], regs[j] = regs[j], regs[i]
        return r._replace(order=tuple(order), regions=tuple(regs), swaps=r.swaps[:-1])


class SlotFromWrongRequest(TorchBackend):
    """Slot mapping reads block_table of the wrong request: the first token of each request is attributed to the
    previous one (searchsorted with right=False), so block_table[b - 1, pos // P] is used."""

    source = "https://github.com/vllm-project/vllm/pull/51065"
    shapes = "B >= 2"

    def _token_requests(self, query_start_loc, num_tokens):
        return torch.searchsorted(query_start_loc[1:].long(), torch.arange(num_tokens), right=False)


class GatherIgnoresSeqStarts(TorchBackend):
    """Context gather ignores seq_starts: every chunk is read from the start of the request's context."""

    source = "https://github.com/local-inference-lab/vllm/pull/15"
    shapes = "seq_starts != 0"

    def gather_cache(
        self, kv_cache, block_table, cu_seq_lens, batch_size=None, seq_starts=None, *, kernel="cp_gather_cache"
    ):
        return super().gather_cache(kv_cache, block_table, cu_seq_lens, batch_size, None, kernel=kernel)


class PerTensorScaleMultiplied(TorchBackend):
    """Per-tensor fp8 scale multiplied instead of divided when writing the cache: e4m3(x * k_scale)."""

    source = "https://github.com/vllm-project/vllm/pull/42580"
    shapes = "kv_cache_dtype fp8 (per-tensor)"

    def concat_and_cache_mla(self, kv_c, k_pe, kv_cache, slot_mapping, *, scale=None, **kw):
        if scale is not None:
            scale = 1.0 / float(scale)
        return super().concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, scale=scale, **kw)


class ContextFirstChunkOnly(TorchBackend):
    """Mixed batch: prefills see only the first workspace chunk of their context (the chunk loop stops after one
    pass), so a context longer than the workspace share loses its tail."""

    source = "https://github.com/local-inference-lab/vllm/pull/17"
    shapes = "a context longer than its workspace share"

    def _context_plan(self, context_lens, workspace_size, block_size):
        plan = super()._context_plan(context_lens, workspace_size, block_size)
        n = min(plan.num_chunks, 1)
        return dataclasses.replace(
            plan,
            starts=plan.starts[:n],
            seq_lens=plan.seq_lens[:n],
            cu_seq_lens=plan.cu_seq_lens[:n],
            seq_tot=plan.seq_tot[:n],
            max_seq_lens=plan.max_seq_lens[:n],
        )


class DecodesComputeFormWrongScale(TorchBackend):
    """Mixed batch: decodes routed through the compute-friendly form with the absorbed width's scale
    1/sqrt(Lkv + D_rope) (1/sqrt(576)) instead of the model's 1/sqrt(D_nope + D_rope) * mscale^2."""

    source = "https://github.com/AI-Hypercomputer/maxtext/issues/1370"
    shapes = "a decode in the batch"

    def mla_absorbed(self, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, *, scale, causal=False):
        wrong = (kv_c.shape[-1] + k_pe.shape[-1]) ** -0.5
        return self.mla_prefill(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, scale=wrong, causal=causal)


# -- bug classes that live on one shape: a second 64-head tile, a request after the first, page sizes != 16 / 64 ------
TILE = 64  # query heads per CTA tile


class ChunkedSecondHeadTileWUV(TorchBackend):
    """Chunked prefill with W_UV of heads 64..127 read from heads 0..63: a head block's rows written from the
    wrong block (the head-block offset of a tiled store)."""

    source = "https://github.com/tile-ai/tilelang-mlir-ascend/pull/96"
    shapes = "H_q > 64"

    def chunked_prefill_attention(self, q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, context, plan, W_UK, W_UV, *, scale):
        h = W_UV.shape[1]
        if h > TILE:
            W_UV = W_UV.clone()
            W_UV[:, TILE:] = W_UV[:, : h - TILE]
        return super().chunked_prefill_attention(
            q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, context, plan, W_UK, W_UV, scale=scale
        )


class MixedDecodesReadFirstRequest(TorchBackend):
    """Mixed batch: every decode attends over the first decode's cache rows (one block-table / seq_lens row for
    all the decode query rows)."""

    source = "https://github.com/vllm-project/vllm/pull/51065"
    shapes = "2+ decodes with different contexts"

    def mla_mixed_batch(self, *args, **kwargs):
        self._first = None
        try:
            return super().mla_mixed_batch(*args, **kwargs)
        finally:
            del self._first

    def mla_absorbed(self, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, *, scale, causal=False):
        if hasattr(self, "_first"):  # a decode inside mla_mixed_batch
            if self._first is None:
                self._first = (kv_c, k_pe)
            kv_c, k_pe = self._first
        return super().mla_absorbed(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, scale=scale, causal=causal)


class SlotMappingBlockAtLeast16(TorchBackend):
    """Slot mapping with the block size rounded up to the kernel's 16-wide tile: ``slot = block * 16 + pos % 16``
    for 1-token pages (a slot computed with another block size than the cache's)."""

    source = "https://github.com/vllm-project/vllm/pull/41657"
    shapes = "P < 16"

    def slot_mapping_from_block_table(
        self, block_table, block_size, query_start_loc, positions, *, num_blocks=None, pad_to=None
    ):
        return super().slot_mapping_from_block_table(
            block_table, max(block_size, 16), query_start_loc, positions, num_blocks=num_blocks, pad_to=pad_to
        )


class ConcatPageStrideAtLeast16(TorchBackend):
    """Cache write with a page stride of at least 16 tokens: slot ``s`` lands at ``(s // P) * max(P, 16) + s % P``
    (dropped past the cache), so 1-token pages are written to the wrong records."""

    source = "https://github.com/sgl-project/sglang/pull/31218"
    shapes = "P < 16"

    def concat_and_cache_mla(self, kv_c, k_pe, kv_cache, slot_mapping, **kw):
        p, total = kv_cache.shape[1], kv_cache.shape[0] * kv_cache.shape[1]
        s = slot_mapping.long()
        wrong = torch.where(s >= 0, s // p * max(p, 16) + s % p, -1)
        wrong = torch.where(wrong < total, wrong, -1)
        return super().concat_and_cache_mla(kv_c, k_pe, kv_cache, wrong, **kw)


class GatherAssumesPage64(TorchBackend):
    """Context gather with FlashMLA's 64-token page assumed in the offset: token ``t`` of a page read at
    ``t % 64`` (a 6-bit offset mask), right for pages of at most 64 tokens only."""

    source = "https://github.com/NVIDIA/TensorRT-LLM/pull/4651"
    shapes = "P > 64"

    def gather_cache(
        self, kv_cache, block_table, cu_seq_lens, batch_size=None, seq_starts=None, *, kernel="cp_gather_cache"
    ):
        p = kv_cache.shape[1]
        if p > 64:  # offsets 64.. read offsets 0.. of the same page
            kv_cache = kv_cache.clone()
            kv_cache[:, 64:] = kv_cache[:, : p - 64].clone()
        return super().gather_cache(kv_cache, block_table, cu_seq_lens, batch_size, seq_starts, kernel=kernel)


def _params(pairs):
    """``(mutant, case_id)`` pairs, xfail (not strict) where the mutant ``needs = "statistics"``: a systematic
    error only the bias check (issue 16) can see."""
    needs = pytest.mark.xfail(strict=False, reason="needs the statistical checks")
    return [pytest.param(m, c, marks=needs if getattr(m, "needs", "") == "statistics" else ()) for m, c in pairs]


MUTANT_CASES = _params(
    [
        (WrongGroupScale, "concat_and_cache_mla[v32-fp8-ds-mla-656-bfloat16]"),
        (WrongGroupScale, "write_pages[v4-584-paged-bfloat16]"),
        (PowerOfTwoScale, "quantize[v32-656-bfloat16]"),
        (PowerOfTwoScale, "concat_and_cache_mla[v32-fp8-ds-mla-656-bfloat16]"),
        (WriterIgnoresScaleRule, "concat_and_cache_mla[v32-fp8-ds-mla-656-writer-vllm-pow2-bfloat16]"),
        (V41ReadInterleaved, "read_tokens[v41-528-paged-bfloat16]"),
        (RopeBeforeLatent, "concat_and_cache_mla[v3-bf16-page64-padding-bfloat16]"),
        (PaddingSlotWritten, "concat_and_cache_mla[v3-bf16-page64-padding-bfloat16]"),
        (PaddingSlotWritten, "concat_and_cache_mla[v32-fp8-ds-mla-656-bfloat16]"),
        (ChunkBoundaryOffByOne, "chunked_prefill_attention[v3-workspace-chunks-no-context-bfloat16]"),
        (ChunkMergeWithoutInfGuard, "chunked_prefill_attention[v3-workspace-chunks-no-context-bfloat16]"),
        (ReorderStopsOneSwapEarly, "reorder_batch_to_split_decodes_and_prefills[mtp4-mixed-2-regions-bfloat16]"),
        (SlotFromWrongRequest, "slot_mapping_from_block_table[mixed-batch-cudagraph-pad-bfloat16]"),
        (SlotFromWrongRequest, "build_metadata[v3-mixed-default-pages-bfloat16]"),
        (GatherIgnoresSeqStarts, "gather_cache[v3-context-chunk-seq-starts-bfloat16]"),
        (PerTensorScaleMultiplied, "concat_and_cache_mla[v3-fp8-per-tensor-bfloat16]"),
        (ContextFirstChunkOnly, "mla_mixed_batch[v3-tp8-mixed-mtp2-chunked-bfloat16]"),
        (ContextFirstChunkOnly, "mla_mixed_batch[prefills-only-long-context-bfloat16]"),
        (DecodesComputeFormWrongScale, "mla_mixed_batch[v3-tp8-mixed-mtp2-chunked-bfloat16]"),
        (DecodesComputeFormWrongScale, "mla_mixed_batch[v3-tp1-decodes-only-mtp2-bfloat16]"),
        (ChunkedSecondHeadTileWUV, "chunked_prefill_attention[yarn-128-heads-page128-bfloat16]"),
        (MixedDecodesReadFirstRequest, "mla_mixed_batch[yarn-128-heads-page128-bfloat16]"),
        (MixedDecodesReadFirstRequest, "mla_mixed_batch[v3-tp1-decodes-only-mtp2-float16]"),
        (SlotMappingBlockAtLeast16, "slot_mapping_from_block_table[page1-bfloat16]"),
        (ConcatPageStrideAtLeast16, "concat_and_cache_mla[page1-fp8-per-tensor-float16]"),
        (GatherAssumesPage64, "gather_cache[page128-dequant-gather-bfloat16]"),
    ]
)
MUTANTS = sorted({p.values[0] for p in MUTANT_CASES}, key=lambda m: m.__name__)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
def test_every_mutant_names_its_source_and_shapes(mutant):
    assert mutant.__doc__ and mutant.source.startswith("https://github.com/"), mutant.__name__
    assert isinstance(mutant.shapes, str)


@pytest.mark.parametrize("mutant, case_id", MUTANT_CASES)
def test_mutant_fails_its_case(mutant, case_id):
    assert mutant.__doc__, "each mutant names its bug class"
    r = run_case(mutant(), case_by_id(case_id), backend_name="mutant")
    assert r.verdict == "fail", (r.verdict, r.reason)
    assert r.reason and r.repro.endswith(f"--case '{case_id}'")


def test_mutants_pass_the_cases_their_bug_does_not_touch():
    # the bugs are specific: a per-tensor scale bug leaves the bf16 cache alone, a 2-region reorder bug the
    # 4-region reorder, an -inf guard bug a batch where no request lacks context
    assert (
        run_case(
            PerTensorScaleMultiplied(),
            case_by_id("concat_and_cache_mla[v3-bf16-page64-padding-bfloat16]"),
            backend_name="m",
        ).verdict
        == "pass"
    )
    four = case_by_id("reorder_batch_to_split_decodes_and_prefills[mtp4-mixed-4-regions-bfloat16]")
    assert run_case(ReorderStopsOneSwapEarly(), four, backend_name="m").verdict == "pass"
    assert (
        run_case(
            ChunkMergeWithoutInfGuard(),
            case_by_id("chunked_prefill_attention[first-chunks-only-bfloat16]"),
            backend_name="m",
        ).verdict
        == "pass"
    )
    # a writer of vLLM 0.33's raw scales passes the case that asks for them
    assert (
        run_case(
            WriterIgnoresScaleRule(), case_by_id("concat_and_cache_mla[v32-fp8-ds-mla-656-bfloat16]"), backend_name="m"
        ).verdict
        == "pass"
    )
    # a decode-path bug leaves a batch of prefills alone, a chunk-loop bug a batch of decodes
    assert (
        run_case(
            DecodesComputeFormWrongScale(),
            case_by_id("mla_mixed_batch[prefills-only-long-context-bfloat16]"),
            backend_name="m",
        ).verdict
        == "pass"
    )
    assert (
        run_case(
            ContextFirstChunkOnly(), case_by_id("mla_mixed_batch[v3-tp1-decodes-only-mtp2-bfloat16]"), backend_name="m"
        ).verdict
        == "pass"
    )


def test_nan_in_a_written_slot_is_caught():
    class WritesNaN(TorchBackend):
        def concat_and_cache_mla(self, kv_c, k_pe, kv_cache, slot_mapping, **kw):
            (new,) = super().concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, **kw)
            new.view(-1, new.shape[-1])[int(slot_mapping[0]), 0] = math.nan
            return (new,)

    r = run_case(WritesNaN(), case_by_id("concat_and_cache_mla[v3-bf16-page64-padding-bfloat16]"), backend_name="n")
    assert r.verdict == "fail" and "deterministic bytes" in r.reason
