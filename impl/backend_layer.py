"""Harness-facing methods for the mixed-batch layer and the fp8-cache decode (a mixin of ``TritonBackend``).

* ``mla_mixed_batch``: :func:`mlaspec.impl.layer.mla_mixed_batch_layer` with the paged cache and the batch metadata
  as a serving layer gets them (the cache is written in place at ``slot_mapping`` -- the harness hands over a
  copy -- then decodes run the absorbed split-KV kernel, prefills the chunked context through the gather, varlen
  and merge kernels).
* ``mla_decode_fp8``: the per-request records ``kv_cache [B, S_kv, 576]`` (``fp8_e4m3_per_tensor``) are scattered
  into 64-slot pages in shuffled order, ``0xFF`` (e4m3 NaN) in every unused slot and page, a spare ``-1``
  block-table column, then :func:`mlaspec.impl.decode.mla_decode_paged` (fp8 bytes) runs. The 656-byte ``fp8_ds_mla``
  layout is a named limit (the sparse kernels read it).

Both multiply matrices in the case dtype, so their bf16 cases are skipped in the interpreter (wrong ``tl.dot``).
"""

from __future__ import annotations

import torch

from . import decode as _decode
from .decode import page_cache
from .decode import mla_decode_paged
from .layer import mla_mixed_batch_layer

__all__ = ["LAYER_OPS", "TritonLayer"]

LAYER_OPS = frozenset({"mla_mixed_batch", "mla_decode_fp8"})


def _interpreted() -> bool:
    return type(_decode._mla_decode_split_kernel).__name__ == "InterpretedFunction"


def _pow2_at_least_16(x: int) -> bool:
    return x >= 16 and not x & (x - 1)


def _bf16_in_interpreter(case) -> str | None:
    if _interpreted() and case.dtype == "bfloat16":
        return "the Triton interpreter's tl.dot is wrong for bfloat16 (triton 3.9): run bf16 on a GPU"
    return None


class TritonLayer:
    """The mixed-batch layer and the fp8 decode; expects ``self.device`` (set by ``TritonBackend.__init__``)."""

    # -- limits, named -------------------------------------------------------------------------------------------
    def _unsupported_mla_mixed_batch(self, case) -> str | None:
        p = case.params
        if not (_pow2_at_least_16(p["Lkv"]) and _pow2_at_least_16(p["R"])):
            return f"mla_mixed_batch: the decode kernel needs Lkv and R powers of two >= 16, got {p['Lkv']}, {p['R']}"
        if p["P"] + p["R"] > 256 or p["V"] > 256:
            return f"mla_mixed_batch: prefill head dims must be <= 256, got qk {p['P']} + {p['R']}, v {p['V']}"
        if not _pow2_at_least_16(p["block_size"]):
            return f"mla_mixed_batch: the page size must be a power of two >= 16, got {p['block_size']}"
        return _bf16_in_interpreter(case)

    def _unsupported_mla_decode_fp8(self, case) -> str | None:
        p = case.params
        if p["layout"] != "fp8_e4m3_per_tensor":
            return (f"mla_decode_fp8: the dense triton fp8 decode reads the per-tensor 576-byte cache; {p['layout']} "
                    f"is read by the sparse kernels")  # fmt: skip
        if not (_pow2_at_least_16(p["D_v"]) and _pow2_at_least_16(p["D_qk"] - p["D_v"])):
            return f"mla_decode_fp8 needs D_v and D_qk - D_v powers of two >= 16, got {p['D_v']}, {p['D_qk']}"
        return _bf16_in_interpreter(case)

    # -- ops -----------------------------------------------------------------------------------------------------
    def mla_mixed_batch(self, q_nope, q_pe, kv_c, k_pe, metadata, kv_cache, W_UK, W_UV, *, scale, workspace_size,
                        decode_threshold=1):  # fmt: skip
        dev = self.device
        q_nope, q_pe, kv_c, k_pe, kv_cache, W_UK, W_UV = (t.to(dev) for t in (q_nope, q_pe, kv_c, k_pe, kv_cache,
                                                                                W_UK, W_UV))  # fmt: skip
        return tuple(mla_mixed_batch_layer(
            q_nope, q_pe, kv_c, k_pe, kv_cache, query_start_loc=metadata.query_start_loc,
            context_lens=metadata.num_computed_tokens, block_table=metadata.block_table.to(dev),
            slot_mapping=metadata.slot_mapping.to(dev), W_UK=W_UK, W_UV=W_UV, scale=scale,
            workspace_size=workspace_size, decode_threshold=decode_threshold,
        ))  # fmt: skip

    def mla_decode_fp8(self, q, kv_cache, *, layout, k_scale, q_scale, d_v, scale, causal=False):
        if layout != "fp8_e4m3_per_tensor":
            raise ValueError(f"layout must be 'fp8_e4m3_per_tensor' (576 e4m3 bytes per token), got {layout!r}")
        S_kv = kv_cache.shape[1]
        q, kv_cache = q.to(self.device), kv_cache.to(self.device)
        g = torch.Generator().manual_seed(S_kv)  # the page shuffle: fixed per shape
        cache, block_table, seq_lens = page_cache(kv_cache.view(torch.uint8), page_size=64, generator=g, fill=0xFF)
        return tuple(mla_decode_paged(q, cache, block_table, seq_lens, k_scale=k_scale, d_v=d_v, scale=scale,
                                          causal=causal, max_seq_len=S_kv))  # fmt: skip

