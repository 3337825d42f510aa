"""Harness-facing methods for the mixed-batch layer, its chunked prefill and the fp8-cache decode (a mixin of
``TritonBackend``).

* ``mla_mixed_batch``: :func:`mlaspec.impl.layer.mla_mixed_batch_layer` with the paged cache and the batch metadata
  as a serving layer gets them (the cache is written in place at ``slot_mapping`` -- the harness hands over a
  copy -- then decodes run the absorbed split-KV kernel, prefills the chunked context through the gather, varlen
  and merge kernels).
* ``chunked_prefill_attention``: each prefill's context (handed over dense, per request, or through a ``gather``
  callable) is scattered into ``block_size``-slot pages in shuffled order, NaN in every unused slot and page, then
  :func:`mlaspec.impl.layer.chunked_prefill` runs the plan's chunks (chunk width ``plan.max_context_chunk``) through
  the gather, varlen and merge kernels, and the new tokens causally last, as the mixed-batch layer's prefills do.
* ``mla_decode_fp8``: the per-request records ``kv_cache [B, S_kv, token_bytes]`` are scattered into 64-slot pages
  in shuffled order, ``0xFF`` (e4m3 NaN) in every unused slot and page, a spare ``-1`` block-table column; then
  ``fp8_e4m3_per_tensor`` (576 B) runs :func:`mlaspec.impl.decode.mla_decode_paged` (fp8 bytes, per-tensor scale)
  and ``fp8_ds_mla_v32`` (FlashMLA's 656 B token) :func:`mlaspec.impl.sparse.paged_decode` (the sparse kernel
  with every token named through the block table, dequantized in the kernel).

* ``dcp_decode_fp8``: ``mla_decode_fp8`` on each rank's share of the records
  (:class:`mlaspec.conformance.backends.common.DCPFP8ByRanks`) and the Triton combine, as ``dcp_decode``.

All of them multiply matrices in the case dtype, so their bf16 cases are skipped in the interpreter (wrong ``tl.dot``).
"""

from __future__ import annotations

import torch

from mlaspec.conformance.ops import implemented_ops
from mlaspec.impl.decode import mla_decode_paged, page_cache
from mlaspec.impl.layer import chunked_prefill, mla_mixed_batch_layer
from mlaspec.impl.sparse import fp8_keys, paged_decode
from mlaspec.spec.chunked_context import ChunkPlan

from ..common import DCPFP8ByRanks
from .dense import interpreted
from .dense import pow2_at_least_16 as _pow2_at_least_16

__all__ = ["LAYER_OPS", "TritonLayer"]


def _bf16_in_interpreter(case) -> str | None:
    if interpreted() and case.dtype == "bfloat16":
        return "the Triton interpreter's tl.dot is wrong for bfloat16 (triton 3.9): run bf16 on a GPU"
    return None


class TritonLayer(DCPFP8ByRanks):
    """The mixed-batch layer, its chunked prefill, the fp8 decode and its DCP (``dcp_decode_fp8``: each rank's share
    through ``mla_decode_fp8``, combined by ``dcp_combine``, the Triton combine of :mod:`.dense`).

    Expects ``self.device`` (set by ``TritonBackend.__init__``)."""

    e4m3 = False  # the fp8 decode's e4m3 path (q and P in e4m3): the backend triton-e4m3

    # -- limits, named -------------------------------------------------------------------------------------------
    def _unsupported_mla_mixed_batch(self, case) -> str | None:
        p = case.params
        if not (_pow2_at_least_16(p["Lkv"]) and _pow2_at_least_16(p["D_rope"])):
            return (
                f"mla_mixed_batch: the decode kernel needs Lkv and D_rope powers of two >= 16, got Lkv={p['Lkv']}, "
                f"D_rope={p['D_rope']}"
            )
        if p["D_nope"] + p["D_rope"] > 256 or p["D_v"] > 256:
            return (
                f"mla_mixed_batch: prefill head dims must be <= 256, got D_qk = D_nope + D_rope = {p['D_nope']} + "
                f"{p['D_rope']}, D_v = {p['D_v']}"
            )
        if not _pow2_at_least_16(p["block_size"]):
            return f"mla_mixed_batch: the page size must be a power of two >= 16, got {p['block_size']}"
        return _bf16_in_interpreter(case)

    def _unsupported_chunked_prefill_attention(self, case) -> str | None:
        p = case.params
        if p["D_nope"] + p["D_rope"] > 256 or p["D_v"] > 256:
            return (
                f"chunked_prefill_attention: the varlen kernel's head dims must be <= 256, got D_qk = D_nope + "
                f"D_rope = {p['D_nope']} + {p['D_rope']}, D_v = {p['D_v']}"
            )
        return _bf16_in_interpreter(case)

    def _unsupported_mla_decode_fp8(self, case) -> str | None:
        p = case.params
        if p["layout"] not in ("fp8_e4m3_per_tensor", "fp8_ds_mla_v32"):
            return f"mla_decode_fp8: triton reads the fp8_e4m3_per_tensor and fp8_ds_mla_v32 caches, not {p['layout']}"
        if p["layout"] == "fp8_ds_mla_v32" and (p["D_qk"], p["D_v"]) != (576, 512):
            return f"mla_decode_fp8: the 656-byte token holds D_qk 576 = 512 + 64, got {p['D_qk']}, {p['D_v']}"
        if not (_pow2_at_least_16(p["D_v"]) and _pow2_at_least_16(p["D_qk"] - p["D_v"])):
            return f"mla_decode_fp8 needs D_v and D_qk - D_v powers of two >= 16, got {p['D_v']}, {p['D_qk']}"
        return _bf16_in_interpreter(case)

    def _unsupported_dcp_decode_fp8(self, case) -> str | None:  # the same kernel on every rank's share
        return self._unsupported_mla_decode_fp8(case)

    # -- ops -----------------------------------------------------------------------------------------------------
    def mla_mixed_batch(
        self, q_nope, q_pe, kv_c, k_pe, metadata, kv_cache, W_UK, W_UV, *, scale, workspace_size, decode_threshold=1
    ):
        dev = self.device
        q_nope, q_pe, kv_c, k_pe, kv_cache, W_UK, W_UV = (
            t.to(dev) for t in (q_nope, q_pe, kv_c, k_pe, kv_cache, W_UK, W_UV)
        )
        return tuple(
            mla_mixed_batch_layer(
                q_nope,
                q_pe,
                kv_c,
                k_pe,
                kv_cache,
                query_start_loc=metadata.query_start_loc,
                context_lens=metadata.num_computed_tokens,
                block_table=metadata.block_table.to(dev),
                slot_mapping=metadata.slot_mapping.to(dev),
                W_UK=W_UK,
                W_UV=W_UV,
                scale=scale,
                workspace_size=workspace_size,
                decode_threshold=decode_threshold,
            )
        )

    def mla_decode_fp8(self, q, kv_cache, *, layout, k_scale, q_scale, d_v, scale, causal=False, seq_lens=None):
        if layout not in ("fp8_e4m3_per_tensor", "fp8_ds_mla_v32"):
            raise ValueError(
                f"layout must be 'fp8_e4m3_per_tensor' (576 B) or 'fp8_ds_mla_v32' (656 B), got {layout!r}"
            )
        S_kv = kv_cache.shape[1]
        q, kv_cache = q.to(self.device), kv_cache.to(self.device)
        g = torch.Generator().manual_seed(S_kv)  # the page shuffle: fixed per shape
        cache, block_table, seq_lens = page_cache(
            kv_cache.view(torch.uint8), page_size=64, generator=g, fill=0xFF, seq_lens=seq_lens
        )
        if layout == "fp8_ds_mla_v32":
            keys = fp8_keys(cache.reshape(-1, cache.shape[-1]), "fp8_v32", page_size=64)
            return tuple(paged_decode(q, keys, block_table, seq_lens, scale=scale, d_v=d_v, causal=causal))
        kw = dict(k_scale=k_scale, d_v=d_v, scale=scale, causal=causal, max_seq_len=S_kv)
        if self.e4m3:  # q as vLLM hands FlashMLA's fp8 decode: e4m3(q / q_scale), exact for the op's queries
            q, kw = (q.double() / q_scale).to(torch.float8_e4m3fn), {**kw, "q_scale": q_scale, "out_dtype": q.dtype}
        return tuple(mla_decode_paged(q, cache, block_table, seq_lens, **kw))

    def chunked_prefill_attention(self, q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, context, plan, W_UK, W_UV, *, scale):
        """``out [T_p, H_q, D_v]`` (q_nope's dtype) and ``lse [H_q, T_p]`` fp32; the spec's arguments
        (:func:`mlaspec.spec.chunked_context.chunked_prefill_attention`)."""
        if not isinstance(plan, ChunkPlan):
            raise TypeError(f"plan must be a ChunkPlan, got {type(plan).__name__}")
        dev, dtype = self.device, q_nope.dtype
        ctx = [int(c) for c in plan.context_lens.tolist()]
        q_lens = torch.diff(torch.as_tensor(cu_seqlens_q).long()).tolist()
        if len(q_lens) != len(ctx):
            raise ValueError(
                f"cu_seqlens_q must have B_p + 1 = {len(ctx) + 1} entries (B_p from plan), got {len(q_lens) + 1}"
            )
        if any(t > plan.workspace_size for t in plan.seq_tot):
            raise ValueError(
                f"plan: a chunk needs {max(plan.seq_tot)} workspace rows, more than workspace_size="
                f"{plan.workspace_size}"
            )
        # the context as a serving layer holds it: in shuffled pages, NaN wherever no request's token is
        if not callable(context) and len(context) != len(ctx):
            raise ValueError(
                f"context must hold B_p = {len(ctx)} (kv_c, k_pe) pairs (B_p from plan), got {len(context)}"
            )
        lkv, r = kv_c.shape[-1], k_pe.shape[-1]
        dense = torch.full((len(ctx), max(ctx, default=0), lkv + r), torch.nan, dtype=dtype, device=dev)
        for b, c in enumerate(ctx):
            ckv, cpe = context(b, 0, c) if callable(context) else context[b]
            if ckv.shape != (c, lkv) or cpe.shape != (c, r):
                raise ValueError(
                    f"context[{b}] must be (kv_c [{c}, {lkv}], k_pe [{c}, {r}]) (C from plan), got "
                    f"{list(ckv.shape)}, {list(cpe.shape)}"
                )
            dense[b, :c] = torch.cat([ckv, cpe], -1).to(dev, dtype)
        g = torch.Generator().manual_seed(sum(ctx) + 1)  # the page shuffle: fixed per case
        cache, table, _ = page_cache(dense, page_size=plan.block_size, generator=g)
        args = (t.to(dev) for t in (q_nope, q_pe, kv_c, k_pe))
        return tuple(
            chunked_prefill(
                *args,
                cache,
                table,
                q_lens,
                ctx,
                W_UK.to(dev),
                W_UV.to(dev),
                scale=scale,
                chunk_width=plan.max_context_chunk,
            )
        )


LAYER_OPS = implemented_ops(TritonLayer)
"""The ops this mixin has a method for."""
