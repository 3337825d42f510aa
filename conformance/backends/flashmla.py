"""Backend ``flashmla``: DeepSeek's FlashMLA kernels, as vLLM 0.33 ships them.

Imports ``flash_mla`` (upstream FlashMLA), else ``vllm.third_party.flashmla.flash_mla_interface`` (the copy the
vLLM 0.33.0 wheel ships: ``pip install vllm==0.33.0``). Ops:

* ``mla_decode`` -> ``flash_mla_with_kvcache`` (dense). The gathered ``kv [B, S_kv, 576]`` is paged into a
  ``[NB, 64, 1, 576]`` cache with *shuffled* physical blocks and NaN in every slot past a request's
  length (:func:`~mlaspec.conformance.backends.common.page_kv`); ``block_table`` and ``cache_seqlens`` int32.
  FlashMLA aligns causal queries to the end of the context (``csrc/api/dense_decode.h``: ``s_q == 1`` turns
  causal off; the splitkv kernel masks query ``i`` to ``S_kv - S_q + i + 1`` keys), the spec's bottom-right rule.
  LSE ``[B, H_q, S_q]`` natural log; an empty row comes back ``+inf``, which the harness reads as the spec's
  ``-inf`` (vLLM's merge treats both as empty).
* ``sparse_decode`` -> ``flash_mla_with_kvcache(..., indices=..., is_fp8_kvcache=True)``. The op hands a paged,
  already-dequantized cache; the adapter writes it in the 656-byte ``fp8_ds_mla`` layout (V3.2, ``D_qk = 576``)
  or the 584-byte V4 layout (``D_qk = 512``) with :mod:`mlaspec.spec.cache_layouts` -- the layout bytes are the
  spec's -- and refuses a cache the layout cannot hold exactly (so quantization error never poses as a kernel
  error). The case's ``writer`` (:mod:`mlaspec.conformance.ops.writers`) decides the scales: power-of-two
  (FlashMLA's quantizer, vLLM's ``vllm-pow2``) or vLLM 0.33's raw ``amax / 448`` (the cache then comes as float64,
  which holds ``e4m3 * s`` exactly). The kernel reads those scales as bf16 (declared: ``scales_in_bf16``). The
  cache is re-blocked into 64-token pages; global slot indices are unchanged by that.
* ``sparse_prefill`` -> ``flash_mla_sparse_fwd`` (bf16 ``kv``, returns ``out, max_logits, lse``).
* ``mla_decode_fp8`` -> ``torch.ops._flashmla_extension_C.fwd_kvcache_mla_fp8``, the kernel vLLM 0.33's FLASHMLA
  backend calls for ``--kv-cache-dtype fp8`` / ``fp8_e4m3`` (``vllm/v1/attention/ops/flashmla.py``
  ``flash_mla_with_kvcache_fp8``, from ``vllm/v1/attention/backends/mla/flashmla.py`` ``forward_mqa``). Not
  ``flash_mla_with_kvcache``: its dense path never passes ``is_fp8_kvcache`` to ``dense_decode_fwd`` (the flag only
  reaches the scheduler config and the sparse kernel). The cache is vLLM's per-tensor e4m3 cache (576 B per token,
  paged 64 per block, NaN bytes ``0xFF`` in unused slots), viewed as ``float8_e4m3fn``; ``q`` is quantized to e4m3
  with ``q_scale`` as vLLM's ``_DecodeConcatQuantFP8`` does (exact for the op's inputs); ``descale_q`` /
  ``descale_k`` are ``[1]`` fp32; ``seq_lens`` (optional) is the kernel's ``cache_seqlens``; metadata from
  ``get_mla_decoding_metadata_dense_fp8(seqlens, S_q * H_q, 1)``.
  SM90 only ("Dense FP8 MLA is only supported on SM90"), bf16 output only (the library instantiates
  ``run_mha_fwd_splitkv_mla<float_e4m3_t, bfloat16_t, 576>``), the 656-byte ``fp8_ds_mla`` layout is not read
  by it (vLLM maps fp8 caches to ``fp8_ds_mla`` only for ``FLASHMLA_SPARSE``).
* ``dcp_decode`` / ``dcp_decode_fp8``: each rank's share through ``mla_decode`` / ``mla_decode_fp8`` with its local
  ``cache_seqlens``, combined by the spec's combine (:class:`~mlaspec.conformance.backends.common.DCPByRanks`,
  :class:`~mlaspec.conformance.backends.common.DCPFP8ByRanks`); the fp8 one declares what ``mla_decode_fp8`` does.

Translations that change nothing (each is what vLLM's ``flashmla_sparse.py`` does too, or exact by the spec):
query heads are zero-padded to a count the kernel has (sparse decode 64/128; sparse prefill 8/16/32/64/128 on
SM90 in 0.33, 64/128 on SM100) and sliced back; top-k is padded with ``-1`` to the kernel's block (64 for
decode, 128 for SM90 prefill: ``csrc/sm90/prefill/sparse/phase1.cuh`` asserts ``topk % (2 * B_TOPK) == 0``).

Skipped, with the constraint as the reason: ``D_qk`` other than 576/512 or ``d_v`` other than 512
(``csrc/api/*.h``), ``H_kv > 1``, fp16 for the sparse kernels (bf16 only), ``topk_length`` or an extra cache on
the V3.2 sparse decode ("V3.2 does not support dynamic topk length" / "... extra KV cache",
``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh``), more than 128 query heads for the sparse kernels.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from mlaspec.spec import cache_layouts as cl
from mlaspec.spec.sliding_window import v4_attention_indices

from .common import (
    DCPByRanks,
    DCPFP8ByRanks,
    case_param,
    cuda_capability,
    import_first,
    pad_heads,
    pad_last,
    page_kv,
    require_cuda,
)

__all__ = ["FlashMLABackend", "quantize_sparse_cache"]

PAGE = 64  # FlashMLA's page_block_size (dense: TORCH_CHECK(page_block_size == 64))
DENSE_HEAD_DIMS = (576, 512)
SPARSE_LAYOUTS = {576: cl.FP8_DS_MLA_V32, 512: cl.FP8_DS_MLA_V4}


def quantize_sparse_cache(entries: torch.Tensor, page: int = PAGE) -> torch.Tensor:
    """Write a dequantized cache ``[T, D]`` (``T`` flat slots) as FlashMLA's fp8 sparse cache pages.

    ``D = 576`` uses :data:`~mlaspec.spec.cache_layouts.FP8_DS_MLA_V32` (656 B per token), ``D = 512`` the V4
    layout (584 B). The bytes are the spec's :func:`~mlaspec.spec.cache_layouts.exact_pages`: scales by whichever
    rule (power-of-two as FlashMLA's ``tests/quant.py``, or vLLM's raw ``amax / 448``) reproduces ``entries``
    exactly, ``ValueError`` if none does; rows with NaN and the padding up to a multiple of ``page`` are ``0xFF``
    bytes (fp8 NaN): a kernel that reads an unused slot poisons its output.

    Returns:
        ``uint8 [NB, page, 1, token_bytes]``, a strided view of the page blocks (``stride(0)`` is the
        layout's page size, which for V4 is rounded up to 576-byte alignment).
    """
    d = entries.shape[-1]
    if d not in SPARSE_LAYOUTS:
        raise ValueError(f"kv_cache must have D_qk 576 (V3.2) or 512 (V4) for FlashMLA's fp8 cache, got {d}")
    layout = SPARSE_LAYOUTS[d]
    try:
        pages = cl.exact_pages(entries.reshape(-1, d).cpu(), layout, page)  # [NB, page_bytes]
    except ValueError as exc:
        raise ValueError(
            f"kv_cache is not exactly representable in the {layout.token_bytes}-byte {layout.name} layout; "
            "FlashMLA's sparse decode reads only fp8 caches, so give it entries from dequantize(quantize(...))"
        ) from exc
    nb, page_bytes = pages.shape
    return pages.as_strided((nb, page, 1, layout.token_bytes), (page_bytes, layout.token_bytes, layout.token_bytes, 1))


def _next_count(h: int, counts: tuple[int, ...]) -> int | None:
    return next((c for c in counts if c >= h), None)


class FlashMLABackend(DCPByRanks, DCPFP8ByRanks):
    """FlashMLA's dense decode, sparse decode (fp8 cache) and sparse prefill (see the module docstring)."""

    name = "flashmla"
    ops = frozenset(
        {
            "mla_decode",
            "dcp_decode",
            "mla_decode_fp8",
            "dcp_decode_fp8",
            "sparse_decode",
            "sparse_prefill",
            "v4_attention",
        }
    )
    dtypes = frozenset({"bfloat16", "float16"})
    # the dense fp8 kernel multiplies e4m3 q and cache bytes with Hopper's fp8 MMA (run_mha_fwd_splitkv_mla<
    # float_e4m3_t, bfloat16_t, 576>): ~14 accumulator bits, and rounds its softmax weights P to e4m3 for P V
    # (vllm-project/FlashMLA csrc/extension/sm90/dense_fp8/flash_fwd_mla_kernel.h:384-385); the SM90 sparse decode
    # reads each 128-group's fp32 scale as bf16 and dequantizes as a bf16 product (csrc/sm90/decode/sparse_fp8/
    # splitkv_mla.cuh:550, components/dequant.h:25), exact only on power-of-two scales (mlaspec.conformance.numerics,
    # docs/backends.md); dcp_decode_fp8 runs the same fp8 kernel on every rank's share, so the same departures
    numerics = MappingProxyType(
        {
            **dict.fromkeys(("mla_decode_fp8", "dcp_decode_fp8"), ("fp8_mma_accumulation", "p_in_e4m3")),
            "sparse_decode": ("scales_in_bf16",),
        }
    )

    def __init__(self, device: str | None = None):
        self.fm = import_first("flash_mla", "vllm.third_party.flashmla.flash_mla_interface", what="flash_mla")
        self.device = torch.device(device) if device else require_cuda("flashmla")
        self.capability = cuda_capability(self.device)
        if self.capability[0] not in (9, 10):
            raise RuntimeError(f"flashmla needs SM90 (Hopper) or SM100 (Blackwell DC); this GPU is SM{self.capability}")
        self.sm90 = self.capability[0] == 9
        self.version = f"flash_mla ({getattr(self.fm, '__file__', '?')})"

    # -- capabilities --------------------------------------------------------------------------------------------
    def unsupported(self, case) -> str | None:
        d = case_param(case, "D_qk")
        d_v = case_param(case, "D_v", default=512)
        if d is not None and d not in DENSE_HEAD_DIMS:
            return f"FlashMLA needs D_qk 576 or 512 (csrc/api: 'Only head_size_k == 576 or 512'), case has {d}"
        if d_v != 512:
            return f"FlashMLA needs d_v 512 ('Only head_size_v == 512'), case has {d_v}"
        if case.op in ("mla_decode_fp8", "dcp_decode_fp8"):
            return self._fp8_unsupported(case)
        if case.op in ("mla_decode", "dcp_decode"):
            if not self.sm90:
                return "FlashMLA dense decode is SM90a only ('Dense decode MLA is only supported on SM90a')"
            if case_param(case, "B", default=1) < 1:
                return "FlashMLA dense decode needs batch size > 0"
            return None
        if case.op == "sparse_decode" and not case.params.get("fp8_cache"):
            return (
                "FlashMLA sparse decode reads only fp8 caches (656 B V3.2 / 584 B V4); this case's cache is not "
                "declared fp8-representable (case param fp8_cache=True: entries from dequantize(quantize(...)))"
            )
        # sparse kernels
        if case.dtype != "bfloat16":
            return f"FlashMLA sparse kernels take bf16 q only, case dtype is {case.dtype}"
        if case_param(case, "H_kv", default=1) != 1:
            return "FlashMLA sparse kernels need H_kv == 1 ('Currently only MQA (i.e. h_kv == 1) is supported')"
        h = case_param(case, "H_q", default=64)
        if h > 128:
            return f"FlashMLA sparse kernels take at most 128 query heads (padded to 64/128), case has {h}"
        if case.op == "sparse_decode" and (d in (None, 576)):
            if case_param(case, "topk_length"):
                return "FlashMLA V3.2 sparse decode rejects topk_length ('V3.2 does not support dynamic topk length')"
            if case_param(case, "layer") is not None:  # a V4 layer: its compressed cache is the extra cache
                return "FlashMLA V3.2 sparse decode rejects an extra cache ('V3.2 does not support extra KV cache')"
        return None

    # -- dense decode --------------------------------------------------------------------------------------------
    def mla_decode(self, q, kv, *, d_v, scale, causal=False, seq_lens=None):
        dev = self.device
        b, s_q, h, d = q.shape
        paged = page_kv(kv.to(dev), PAGE, seqlens=seq_lens, seed=b * 7919 + kv.shape[1])  # -> cache_seqlens
        q = q.to(dev).contiguous()
        cache = paged.cache.unsqueeze(2)  # [NB, 64, 1, D]
        fm = self.fm
        if hasattr(fm, "FlashMLASchedMeta"):  # FlashMLA >= 2026: metadata built on the first call
            meta, _ = fm.get_mla_metadata()
            out, lse = fm.flash_mla_with_kvcache(
                q, cache, paged.block_table, paged.seqlens, d_v, meta, None, softmax_scale=scale, causal=causal
            )
        else:  # the 2025 interface: explicit tile-scheduler metadata
            meta, splits = fm.get_mla_metadata(paged.seqlens, s_q * h, 1)
            out, lse = fm.flash_mla_with_kvcache(
                q, cache, paged.block_table, paged.seqlens, d_v, meta, splits, softmax_scale=scale, causal=causal
            )
        return out, lse  # [B, S_q, H, D_v], [B, H, S_q] natural log

    # -- dense decode over vLLM's per-tensor fp8 cache -----------------------------------------------------------
    def _fp8_ext(self):
        """``torch.ops._flashmla_extension_C`` (imports ``vllm._flashmla_extension_C``), or ``ImportError``."""
        import_first("vllm._flashmla_extension_C", what="vllm._flashmla_extension_C (FlashMLA dense fp8)")
        return torch.ops._flashmla_extension_C

    def _fp8_unsupported(self, case) -> str | None:
        if not self.sm90:
            return "FlashMLA dense fp8 decode is SM90 only ('Dense FP8 MLA is only supported on SM90')"
        if case.params.get("layout") != "fp8_e4m3_per_tensor":
            return (
                f"FlashMLA's dense fp8 kernel reads vLLM's per-tensor e4m3 cache (576 B/token), not "
                f"{case.params.get('layout')} (the 656-byte fp8_ds_mla cache goes to the sparse kernels only)"
            )
        if case.dtype != "bfloat16":
            return (
                f"FlashMLA's dense fp8 kernel writes bf16 only (run_mha_fwd_splitkv_mla<float_e4m3_t, bfloat16_t, "
                f"576>), case dtype is {case.dtype}"
            )
        try:
            self._fp8_ext()
        except ImportError as exc:
            return str(exc)
        return None

    def mla_decode_fp8(self, q, kv_cache, *, layout, k_scale, q_scale, d_v, scale, causal=False, seq_lens=None):
        if layout != "fp8_e4m3_per_tensor":
            raise ValueError(f"layout must be fp8_e4m3_per_tensor for FlashMLA's dense fp8 kernel, got {layout!r}")
        ext, dev = self._fp8_ext(), self.device
        b, s_q, h, d = q.shape
        seed = b * 7919 + kv_cache.shape[1]
        paged = page_kv(kv_cache.to(dev), PAGE, seqlens=seq_lens, seed=seed, fill=0xFF)  # 0xFF: e4m3 NaN; cache_seqlens
        cache = paged.cache.view(torch.float8_e4m3fn).unsqueeze(2)  # [NB, 64, 1, 576]
        q8 = (q.to(dev, torch.float32) / q_scale).to(torch.float8_e4m3fn).contiguous()  # exact for the op's q
        descale_q = torch.tensor([q_scale], dtype=torch.float32, device=dev)
        descale_k = torch.tensor([k_scale], dtype=torch.float32, device=dev)
        meta, splits = ext.get_mla_decoding_metadata_dense_fp8(paged.seqlens, s_q * h, 1)
        out, lse = ext.fwd_kvcache_mla_fp8(
            q8, cache, d_v, paged.seqlens, paged.block_table, scale, causal, meta, splits, descale_q, descale_k
        )[:2]
        return out, lse  # [B, S_q, H, D_v] bf16, [B, H, S_q] natural log

    # -- sparse decode -------------------------------------------------------------------------------------------
    def sparse_decode(
        self,
        q,
        kv_cache,
        indices,
        *,
        scale=None,
        d_v=512,
        topk_length=None,
        attn_sink=None,
        extra_kv_cache=None,
        extra_indices=None,
        extra_topk_length=None,
    ):
        dev = self.device
        b, s_q, h, d = q.shape
        if d == 576 and topk_length is not None and bool((topk_length == indices.shape[-1]).all()):
            topk_length = None  # every request uses all K slots: the same as no topk_length
        if d == 576 and (topk_length is not None or extra_kv_cache is not None):
            raise ValueError("FlashMLA V3.2 sparse decode supports neither topk_length nor an extra cache")
        h_pad = _next_count(h, (64, 128))
        if h_pad is None:
            raise ValueError(f"FlashMLA sparse decode takes 64 or 128 query heads (padded), got {h}")
        qp = pad_heads(q.to(dev, torch.bfloat16), h_pad, 2).contiguous()
        cache = quantize_sparse_cache(kv_cache.reshape(-1, d)).to(dev)
        idx = pad_last(indices.to(torch.int32), PAGE, -1).to(dev).contiguous()
        kw = dict(softmax_scale=scale, is_fp8_kvcache=True, indices=idx)  # FlashMLA's name for the scale
        if topk_length is not None:
            kw["topk_length"] = topk_length.to(dev, torch.int32).contiguous()
        if attn_sink is not None:
            kw["attn_sink"] = pad_heads(attn_sink.to(dev, torch.float32), h_pad, 0).contiguous()
        if extra_kv_cache is not None:
            kw["extra_k_cache"] = quantize_sparse_cache(extra_kv_cache.reshape(-1, d)).to(dev)
            kw["extra_indices_in_kvcache"] = pad_last(extra_indices.to(torch.int32), PAGE, -1).to(dev).contiguous()
            if extra_topk_length is not None:
                kw["extra_topk_length"] = extra_topk_length.to(dev, torch.int32).contiguous()
        meta, splits = self.fm.get_mla_metadata() if hasattr(self.fm, "FlashMLASchedMeta") else (None, None)
        if meta is None:
            raise RuntimeError("this flash_mla predates sparse decode (no FlashMLASchedMeta)")
        out, lse = self.fm.flash_mla_with_kvcache(qp, cache, None, None, d_v, meta, None, **kw)
        return out[:, :, :h], lse[:, :h, :]

    # -- sparse prefill ------------------------------------------------------------------------------------------
    def sparse_prefill(self, q, kv, indices, scale, d_v=512, attn_sink=None, topk_length=None):
        dev = self.device
        s_q, h, d = q.shape
        counts = (8, 16, 32, 64, 128) if self.sm90 else (64, 128)
        h_pad = _next_count(h, counts)
        if h_pad is None:
            raise ValueError(f"FlashMLA sparse prefill takes at most 128 query heads (padded), got {h}")
        qp = pad_heads(q.to(dev, torch.bfloat16), h_pad, 1).contiguous()
        idx = pad_last(indices.to(torch.int32), 128, -1).to(dev).contiguous()
        sink = None if attn_sink is None else pad_heads(attn_sink.to(dev, torch.float32), h_pad, 0).contiguous()
        lengths = None if topk_length is None else topk_length.to(dev, torch.int32).contiguous()
        out, max_logits, lse = self.fm.flash_mla_sparse_fwd(
            qp, kv.to(dev, torch.bfloat16).contiguous(), idx, scale, d_v, sink, lengths
        )[:3]
        return out[:, :h], max_logits[:, :h], lse[:, :h]

    # -- one V4 layer through the sparse prefill kernel ----------------------------------------------------------
    def v4_attention(
        self,
        q,
        raw_kv,
        *,
        window,
        scale,
        compressed_kv=None,
        compress_ratio=1,
        topk_indices=None,
        attn_sink=None,
        d_v=512,
    ):
        num_c = 0 if compressed_kv is None or compress_ratio == 1 else compressed_kv.shape[0]
        rows = raw_kv if num_c == 0 else torch.cat([compressed_kv, raw_kv])
        # how vLLM's V4 path feeds FlashMLA (vllm/models/deepseek_v4/attention/impl/flashmla.py): the compressed
        # top-k and the window as index rows into cat(compressed_kv, raw_kv), the spec's rule
        idx = v4_attention_indices(
            q.shape[0],
            raw_kv.shape[0],
            window=window,
            compress_ratio=compress_ratio,
            topk_indices=topk_indices if num_c else None,
            num_compressed=num_c,
        )
        out, _, lse = self.sparse_prefill(q, rows[:, None], idx[:, None].to(torch.int32), scale, d_v, attn_sink)
        return out, lse
