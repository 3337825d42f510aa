"""Cache writers: how the bytes of an fp8 KV cache were written, each named after the code (and version) it follows.

A quantized-cache case says which writer made its bytes (case parameter ``writer``, also in the case name, e.g.
``sparse_decode[v32-writer-vllm033-bfloat16]``), because a reader's arithmetic can be exact on one writer's bytes and
lossy on another's: FlashMLA's sparse decode reads each 128-group's fp32 scale as bf16
(:data:`~mlaspec.conformance.numerics.DEPARTURES` ``scales_in_bf16``), which loses nothing on a power-of-two scale
and up to ``2^-9`` relative on vLLM 0.33's raw ``amax / 448``. vLLM's test
``test_sparse_flashmla_decode_matches_cache_writer_scales`` (``tests/kernels/attention/test_flashmla_sparse.py``)
picks ``336 / 448 = 0.75`` for that reason: a scale that is not a power of two separates the two writers.

Each writer takes float64 entries ``[T, D]`` (``D = 576`` V3/V3.2, ``512`` V4) and returns the records ``[T,
token_bytes]`` uint8 of :mod:`mlaspec.spec.cache_layouts`; :func:`written` gives back what a case hands a backend,
``dequantize(writer(entries))``. The bytes are the spec's (:func:`~mlaspec.spec.cache_layouts.quantize`, exact
float64 rounding); the writers differ only in the scale rule they pick.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mlaspec.spec import cache_layouts as cl

__all__ = ["WRITERS", "flashmla", "read_as", "vllm_033", "vllm_per_tensor", "vllm_pow2", "written"]

_SPARSE = {576: cl.FP8_DS_MLA_V32, 512: cl.FP8_DS_MLA_V4}


def _v32(entries: torch.Tensor, writer: str) -> None:
    if entries.shape[-1] != 576:
        d = entries.shape[-1]
        raise ValueError(f"writer {writer!r} writes the 656-byte fp8_ds_mla record (D = 576), got D = {d}")


def flashmla(entries: torch.Tensor, k_scale: float | None = None) -> torch.Tensor:
    """FlashMLA's own quantizer, ``tests/quant.py`` ``quantize_k_cache`` (deepseek-ai/FlashMLA at ``9241ae3``):
    656 B with power-of-two per-128 scales ``2^ceil(log2(max(amax / 448, 1e-4)))`` (D = 576), or the 584-byte V4
    record with e8m0 scales (D = 512). The curated sparse cases' default (``fp8_cache=True``)."""
    layout = _SPARSE[entries.shape[-1]]
    return cl.quantize(entries, layout, pow2_scales=layout is cl.FP8_DS_MLA_V32).raw


def vllm_033(entries: torch.Tensor, k_scale: float | None = None) -> torch.Tensor:
    """vLLM 0.33.0's ``concat_and_cache_mla(..., "fp8_ds_mla", scale)``: ``concat_and_cache_ds_mla_kernel`` in
    ``csrc/libtorch_stable/cache_kernels.cu`` stores each 128-group's *raw* fp32 scale ``tile_scale =
    fmaxf(max_abs / kFp8ScaleDivisor, FLT_MIN)`` (448 on CUDA) and ``e4m3(x / tile_scale)``; the ``scale`` argument
    is ignored (vllm-project/vllm at ``00eb0c87``; the 0.33.0 wheel carries no ``.cu``). Before vLLM PR #49435.
    (0.33.0's fused DeepSeek-V3.2 Triton writer, ``vllm/models/deepseek_v32/common/kernels.py``, already rounds its
    scales up to powers of two: this writer is the CUDA kernel's.)"""
    _v32(entries, "vllm-0.33")
    return cl.quantize(entries, cl.FP8_DS_MLA_V32).raw


def vllm_pow2(entries: torch.Tensor, k_scale: float | None = None) -> torch.Tensor:
    """vLLM after PR #49435 ("[Bugfix] Fix SM100 fp8_ds_mla cache scales", https://github.com/vllm-project/vllm/pull/
    49435): every ``fp8_ds_mla`` writer (CUDA, fused V3.2 Triton, Kimi K3) stores ``2 ** ceil(log2(max(amax / 448,
    1e-4)))``, FlashMLA's rule, "exactly representable by both reader paths: SM90 converts it to BF16 and SM100
    converts it to E8M0". Its test ``test_sparse_flashmla_decode_matches_cache_writer_scales``
    (``tests/kernels/attention/test_flashmla_sparse.py``) writes ``336`` (stored scale ``1.0``, not ``0.75``) and an
    all-zero group (``2^-13``) and asserts FlashMLA's sparse decode returns ``(e4m3 * scale).to(bf16)`` exactly."""
    _v32(entries, "vllm-pow2")
    return cl.quantize(entries, cl.FP8_DS_MLA_V32, pow2_scales=True).raw


def vllm_per_tensor(entries: torch.Tensor, k_scale: float | None = None) -> torch.Tensor:
    """vLLM 0.33.0's ``concat_and_cache_mla`` with ``kv_cache_dtype="fp8"``: ``concat_and_cache_mla_kernel``
    (``csrc/libtorch_stable/cache_kernels.cu``) writes all 576 values as ``fp8::scaled_convert(x, *scale)``,
    ``e4m3(x / k_scale)`` saturating, with the layer's static fp32 ``k_scale`` (1.0 without a calibrated one)."""
    if k_scale is None:
        raise ValueError("writer 'vllm-per-tensor' needs the layer's static k_scale")
    return cl.quantize(entries, cl.FP8_PER_TENSOR, scale=k_scale).raw


WRITERS: dict[str, Callable[..., torch.Tensor]] = {
    "flashmla": flashmla,
    "vllm-0.33": vllm_033,
    "vllm-pow2": vllm_pow2,
    "vllm-per-tensor": vllm_per_tensor,
}
"""Writer name (the case parameter ``writer``) -> writer."""


def written(cache: torch.Tensor, writer: str) -> torch.Tensor:
    """``dequantize(WRITERS[writer](cache))``, shaped like ``cache [..., D]``: in ``cache``'s dtype where that holds
    it exactly (power-of-two scales: ``e4m3 * 2^k``), else float64 (raw fp32 scales: ``e4m3 * s`` needs up to 28
    significant bits), so a backend is handed exactly the values the bytes hold."""
    if writer not in WRITERS or writer == "vllm-per-tensor":
        raise ValueError(f"writer must be one of flashmla, vllm-0.33, vllm-pow2 for a sparse cache, got {writer!r}")
    d = cache.shape[-1]
    x = cl.dequantize(WRITERS[writer](cache.reshape(-1, d).to(torch.float64)), _SPARSE[d]).entries
    narrow = x.to(cache.dtype)
    return (narrow if torch.equal(narrow.to(torch.float64), x) else x).reshape(cache.shape)


def read_as(entries: torch.Tensor, key_format: str, scale_format: str | None = None) -> torch.Tensor:
    """What a reader sees that takes each group scale in ``scale_format`` (None: the stored fp32 scale itself) and
    rounds the dequantized key ``e4m3 * scale`` to ``key_format`` (``"bf16"``, ``"fp16"``, ``"fp32"``), for the cache
    ``entries [..., D]`` (the dequantized values a case hands a backend)::

        records = the fp8 sparse records that hold entries exactly (power-of-two, else raw fp32 scales)
        x[g]    = key_format(e4m3[g] * scale_format(s_g))  per quantized group g;  unscaled fields (RoPE) as stored

    Rows with a non-finite value (never-read, hostile slots) are kept as given; a cache no fp8 sparse record holds
    exactly (not an fp8 case) is returned unchanged: no fp8 reader runs on it. float64, shaped like ``entries``.
    FlashMLA's SM90 sparse decode is ``key_format = scale_format = "bf16"``: ``csrc/sm90/decode/sparse_fp8/
    splitkv_mla.cuh`` line 550 ``scales[i] = (bf16)scales_float[i]`` and ``components/dequant.h`` line 25
    ``__float22bfloat162_rn(fp8) * scale_bf162`` (a bf16 product); our Triton sparse kernel (:mod:`mlaspec.impl.
    sparse`) is ``key_format`` = the query's dtype, ``scale_format = None``.
    """
    formats = {"bf16": cl.BF16, "fp16": cl.FP16, "fp32": cl.FP32}
    key_fmt = formats[key_format]
    scale_fmt = None if scale_format is None else formats[scale_format]
    d = entries.shape[-1]
    layout = _SPARSE.get(d)
    x = entries.reshape(-1, d).to(torch.float64)
    out = x.clone()
    finite = torch.isfinite(x).all(dim=1)
    if layout is None or not bool(finite.any()):
        return out.reshape(entries.shape)
    xf = x[finite]
    rules = (True, False) if layout is cl.FP8_DS_MLA_V32 else (False,)
    for pow2 in rules:
        q = cl.quantize(xf, layout, pow2_scales=pow2)
        if torch.equal(cl.dequantize(q.raw, layout).entries, xf):
            break
    else:
        return out.reshape(entries.shape)
    col = 0
    for f in layout.value_fields:
        if f.group is None:
            continue
        a, b = f.elements
        n = (b - a) // f.group
        s = q.scales[:, col : col + n].repeat_interleave(f.group, dim=1)
        col += n
        values = xf[:, a:b] / s  # the e4m3 values, exactly (xf = e4m3 * s in float64)
        read_scale = s if scale_fmt is None else cl.round_to_format(s, scale_fmt)
        xf[:, a:b] = cl.round_to_format(values * read_scale, key_fmt)
    out[finite] = xf
    return out.reshape(entries.shape)
