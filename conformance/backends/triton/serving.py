"""Harness-facing methods for the cache kernels of :mod:`mlaspec.impl.cache` (a mixin of ``TritonBackend``).

* ``concat_and_cache_mla``: ``"auto"`` (a cast), ``"fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"`` (per-tensor scale) and
  ``"fp8_ds_mla"`` (the 656-byte token, with vLLM 0.33's raw or, for the case ``writer="vllm-pow2"``, vLLM's
  power-of-two group scales) into a copy of the cache, ``slot -1`` skipped;
* ``gather_cache``: ``cp_gather_cache`` with ``seq_starts`` (and ``gather_and_maybe_dequant_cache``'s block-aligned
  form), bit for bit, any cache dtype;
* ``quantize`` / ``dequantize`` / ``write_pages``: every layout the writer's plan expresses
  (:func:`mlaspec.impl.cache.plan`: the per-tensor fp8 ones, the 656-byte V3.2 token, V4's 584-byte split-row token
  and V4.1's 528-byte MXFP8 one); the reader dequantizes to fp32. FlashMLA's power-of-two scales
  (``pow2_scales=True``) are a named limit;
* ``read_tokens``: any layout (split rows included), ``-1`` slots read as zeros.

No op multiplies matrices, so bf16 cases run in the interpreter too.
"""

from __future__ import annotations

from mlaspec.conformance.ops import implemented_ops
from mlaspec.impl.cache import (
    CACHE_DTYPES,
    concat_and_cache_mla,
    dequantize_records,
    gather_cache,
    plan,
    quantize_records,
    read_tokens,
    write_pages,
)

__all__ = ["SERVING_OPS", "TritonServing"]


def _layout_limit(op: str, case) -> str | None:
    """The reason the writer's plan gives for a layout it cannot express (none for the spec's layouts)."""
    if case.params.get("pow2_scales"):
        return f"{op}: pow2_scales (FlashMLA's test quantizer) is not implemented"
    try:
        plan(case.params["layout"])
    except ValueError as e:
        return f"{op}: {e}"
    return None


class TritonServing:
    """The cache ops; expects ``self.device`` (set by ``TritonBackend.__init__``)."""

    # -- limits, named -------------------------------------------------------------------------------------------
    def _unsupported_concat_and_cache_mla(self, case) -> str | None:
        kind = case.params["kv_cache_dtype"]
        if kind != "auto" and kind not in CACHE_DTYPES:
            return f"concat_and_cache_mla: kv_cache_dtype {kind!r} is not implemented"
        return None

    def _unsupported_gather_cache(self, case) -> str | None:
        return None

    def _unsupported_quantize(self, case) -> str | None:
        return _layout_limit("quantize", case)

    def _unsupported_dequantize(self, case) -> str | None:
        return _layout_limit("dequantize", case)

    def _unsupported_write_pages(self, case) -> str | None:
        return _layout_limit("write_pages", case)

    def _unsupported_read_tokens(self, case) -> str | None:
        return None

    # -- ops -----------------------------------------------------------------------------------------------------
    def concat_and_cache_mla(
        self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_cache_dtype="auto", scale=None, pow2_scales=False
    ):
        dev = self.device
        return concat_and_cache_mla(
            kv_c.to(dev),
            k_pe.to(dev),
            kv_cache.to(dev),
            slot_mapping.to(dev),
            kv_cache_dtype=kv_cache_dtype,
            scale=scale,
            pow2_scales=pow2_scales,
        )

    def gather_cache(
        self, kv_cache, block_table, cu_seq_lens, batch_size=None, seq_starts=None, *, kernel="cp_gather_cache"
    ):
        dev = self.device
        return gather_cache(
            kv_cache.to(dev),
            block_table.to(dev),
            cu_seq_lens.to(dev),
            batch_size,
            None if seq_starts is None else seq_starts.to(dev),
            kernel=kernel,
        )

    def quantize(self, entries, layout, *, scale=None, pow2_scales=False):
        if pow2_scales:
            raise NotImplementedError("pow2_scales (FlashMLA's test quantizer) is not implemented")
        return (quantize_records(entries.to(self.device), layout, scale=scale),)

    def dequantize(self, raw, layout, *, scale=None):
        return (dequantize_records(raw.to(self.device), layout, scale=scale),)

    def write_pages(self, pages, entries, slot_mapping, layout, block_size, *, scale=None, pow2_scales=False):
        if pow2_scales:
            raise NotImplementedError("pow2_scales (FlashMLA's test quantizer) is not implemented")
        dev = self.device
        return (write_pages(pages.to(dev), entries.to(dev), slot_mapping.to(dev), layout, block_size, scale=scale),)

    def read_tokens(self, pages, layout, block_size, slots):
        return read_tokens(pages.to(self.device), layout, block_size, slots.to(self.device))


SERVING_OPS = implemented_ops(TritonServing)
"""The ops this mixin has a method for."""
