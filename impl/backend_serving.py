"""Harness-facing methods for the cache kernels of :mod:`mlaspec.impl.cache` (a mixin of ``TritonBackend``).

* ``concat_and_cache_mla``: ``"auto"`` (a cast), ``"fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"`` (per-tensor scale) and
  ``"fp8_ds_mla"`` (the 656-byte token) into a copy of the cache, ``slot -1`` skipped;
* ``gather_cache``: ``cp_gather_cache`` with ``seq_starts`` (and ``gather_and_maybe_dequant_cache``'s block-aligned
  form), bit for bit, any cache dtype;
* ``quantize`` / ``dequantize``: the 656-byte and per-tensor fp8 layouts (the writer's kernel on ``T`` one-slot
  pages; the reader dequantizes to fp32). FlashMLA's power-of-two scales (``pow2_scales=True``) and the V4 / V4.1
  e8m0 layouts are named limits;
* ``write_pages``: token-interleaved layouts whose page is exactly ``P`` records (the 656-byte and per-tensor ones);
* ``read_tokens``: any layout (split rows included), ``-1`` slots read as zeros.

No op multiplies matrices, so bf16 cases run in the interpreter too.
"""

from __future__ import annotations

from mlaspec.spec import cache_layouts as cl

from .cache import concat_and_cache_mla, dequantize_records, gather_cache, quantize_records, read_tokens

__all__ = ["SERVING_OPS", "TritonServing"]

SERVING_OPS = frozenset({"concat_and_cache_mla", "gather_cache", "quantize", "dequantize", "write_pages",
                         "read_tokens"})  # fmt: skip
_RECORD_LAYOUTS = (cl.FP8_DS_MLA_V32.name, cl.FP8_PER_TENSOR.name, cl.FP8_E5M2_PER_TENSOR.name)


def _layout_limit(op: str, layout: str) -> str | None:
    if layout not in _RECORD_LAYOUTS:
        return f"{op}: the triton cache kernels handle layouts {', '.join(_RECORD_LAYOUTS)}, not {layout}"
    return None


class TritonServing:
    """The cache ops; expects ``self.device`` (set by ``TritonBackend.__init__``)."""

    # -- limits, named -------------------------------------------------------------------------------------------
    def _unsupported_concat_and_cache_mla(self, case) -> str | None:
        kind = case.params["kv_cache_dtype"]
        if kind not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla"):
            return f"concat_and_cache_mla: kv_cache_dtype {kind!r} is not implemented"
        return None

    def _unsupported_gather_cache(self, case) -> str | None:
        return None

    def _unsupported_quantize(self, case) -> str | None:
        return _layout_limit("quantize", case.params["layout"])

    def _unsupported_dequantize(self, case) -> str | None:
        return _layout_limit("dequantize", case.params["layout"])

    def _unsupported_write_pages(self, case) -> str | None:
        return _layout_limit("write_pages", case.params["layout"])

    def _unsupported_read_tokens(self, case) -> str | None:
        return None

    # -- ops -----------------------------------------------------------------------------------------------------
    def concat_and_cache_mla(self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_cache_dtype="auto", scale=None):
        dev = self.device
        return concat_and_cache_mla(kv_c.to(dev), k_pe.to(dev), kv_cache.to(dev), slot_mapping.to(dev),
                                    kv_cache_dtype=kv_cache_dtype, scale=scale)  # fmt: skip

    def gather_cache(self, kv_cache, block_table, cu_seq_lens, batch_size=None, seq_starts=None, *,
                     kernel="cp_gather_cache"):  # fmt: skip
        dev = self.device
        return gather_cache(kv_cache.to(dev), block_table.to(dev), cu_seq_lens.to(dev), batch_size,
                            None if seq_starts is None else seq_starts.to(dev), kernel=kernel)  # fmt: skip

    def quantize(self, entries, layout, *, scale=None, pow2_scales=False):
        if pow2_scales:
            raise NotImplementedError("pow2_scales (FlashMLA's test quantizer) is not implemented")
        return (quantize_records(entries.to(self.device), layout, scale=scale),)

    def dequantize(self, raw, layout, *, scale=None):
        return (dequantize_records(raw.to(self.device), layout, scale=scale),)

    def write_pages(self, pages, entries, slot_mapping, layout, block_size, *, scale=None, pow2_scales=False):
        if pow2_scales:
            raise NotImplementedError("pow2_scales (FlashMLA's test quantizer) is not implemented")
        lay = cl.LAYOUTS[layout] if isinstance(layout, str) else layout
        if lay.name not in _RECORD_LAYOUTS or cl.page_bytes(lay, block_size) != block_size * lay.token_bytes:
            raise ValueError(f"write_pages: layout {lay.name} is not one of {', '.join(_RECORD_LAYOUTS)}")
        kind = {cl.FP8_DS_MLA_V32.name: "fp8_ds_mla", cl.FP8_PER_TENSOR.name: "fp8",
                cl.FP8_E5M2_PER_TENSOR.name: "fp8_e5m2"}[lay.name]  # fmt: skip
        dev = self.device
        x = entries.to(dev)
        cache = pages.to(dev).reshape(pages.shape[0], block_size, lay.token_bytes)
        new = concat_and_cache_mla(x[:, :512], x[:, 512:], cache, slot_mapping.to(dev), kv_cache_dtype=kind,
                                   scale=scale)  # fmt: skip
        return (new.reshape(pages.shape),)

    def read_tokens(self, pages, layout, block_size, slots):
        return read_tokens(pages.to(self.device), layout, block_size, slots.to(self.device))

