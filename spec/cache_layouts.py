"""Byte layouts of the quantized MLA KV caches, described once as data, with generic quantize / dequantize.

A cache *entry* is one token's latent: ``[D]`` values (``D = D_qk = 576`` for DeepSeek V3/V3.2: 512 normed latent
then 64 RoPE; ``D = 512`` for DeepSeek V4/V4.1, whose last 64 dims carry the RoPE). A layout says how an entry becomes
``token_bytes`` bytes: a tuple of :class:`Field` records (name, byte offset, byte length, dtype, element count, the
entry elements it holds, what it holds). Everything below -- quantize, dequantize, the error bound, page packing,
the plausibility check and the byte diagrams in the docs -- is driven by those records.

Layouts (and the source each comes from):

* :data:`FP8_PER_TENSOR` (``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"``) and :data:`FP8_E5M2_PER_TENSOR`: every one of
  the 576 values stored as one fp8 byte, ``e4m3(x / scale)`` with one fp32 ``scale`` for the whole tensor (the
  layer's ``k_scale``), saturating at ±448; read back as ``e4m3 * scale``. vLLM ``csrc/cache_kernels.cu``
  ``concat_and_cache_mla_kernel`` (latent at ``[0, 512)``, RoPE at ``[512, 576)``, both through
  ``fp8::scaled_convert``) and ``csrc/quantization/fp8/nvidia/quant_utils.cuh`` (``__nv_cvt_float_to_fp8(a / scale,
  __NV_SATFINITE, ...)``).
* :data:`FP8_DS_MLA_V32` (``kv_cache_dtype="fp8_ds_mla"``, 656 B, DeepSeek V3/V3.2 sparse decode): 512 e4m3, 4 fp32
  scales (one per 128 values), 64 bf16 RoPE values stored verbatim. vLLM's writer (``concat_and_cache_ds_mla_kernel``
  in ``csrc/cache_kernels.cu``) uses the raw fp32 scale ``max(amax / 448, FLT_MIN)``; FlashMLA's test quantizer
  (``tests/quant.py``, ``quantize_k_cache``) instead rounds the scale *up to a power of two* with a floor
  ``2^ceil(log2(max(amax / 448, 1e-4)))``. Pass ``pow2_scales=True`` to :func:`quantize` for the latter (the scale
  rule ``"pow2"``; the default is ``"raw"``). The raw rule is vLLM 0.33.0's CUDA kernel (``tile_scale =
  fmaxf(max_abs / kFp8ScaleDivisor, FLT_MIN)``, ``csrc/libtorch_stable/cache_kernels.cu``); vLLM PR #49435 moved
  every ``fp8_ds_mla`` writer to the power-of-two rule, which FlashMLA's SM90 reader (scales read as bf16) and SM100
  reader (scales read as e8m0) both hold exactly (``tests/kernels/attention/test_flashmla_sparse.py``
  ``test_sparse_flashmla_decode_matches_cache_writer_scales``: ``336`` is stored with scale ``1.0``, not ``0.75``). The
  format itself: FlashMLA ``README.md`` and ``flash_mla/flash_mla_interface.py``. The RoPE part is stored in the
  *input* dtype: vLLM's kernel copies ``k_pe`` as its ``scalar_t`` (it requires ``kv_c.itemsize() == 2``: bf16 or
  fp16) and FlashMLA's quantizer views the RoPE bytes as ``input_k_cache.dtype``. So a bf16 model writes
  :data:`FP8_DS_MLA_V32` (the default, and what FlashMLA's kernels read) and an fp16 model writes
  :data:`FP8_DS_MLA_V32_FP16`, the same 656 bytes with fp16 RoPE values; nothing in the bytes tells them apart
  (:func:`detect_layout` reports both), the reader must know the model's dtype.
  :func:`mlaspec.spec.paged_cache.concat_and_cache_mla` picks the one that matches ``k_pe``'s dtype.
* :data:`FP8_DS_MLA_V4` (584 B, DeepSeek V4, FlashMLA's ``MODEL1_FP8Sparse``): 448 e4m3 NoPE values, 64 bf16 RoPE
  values, then 7 e8m0 scales (one per 64 values) and 1 zero pad byte. *Not* token-interleaved: within a page block
  the 576-byte data rows of all ``P`` tokens come first, then the 8-byte scale rows, and the page is rounded up to a
  multiple of 576 bytes. vLLM ``vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py``
  (``_rope_quant_insert_kernel``), ``vllm/v1/attention/backends/mla/flashmla_sparse.py`` (layout note) and FlashMLA
  ``tests/quant.py``.
* :data:`MXFP8_DS_MLA_V41` (528 B, DeepSeek V4.1): all 512 dims (RoPE included, rotated before quantization) as
  e4m3, then 16 e8m0 scales (one per 32 values, i.e. MXFP8). Split like V4, *not* token-interleaved: a page block
  holds the 512-byte data rows of all ``P`` tokens, then the 16-byte scale rows, rounded up to a multiple of 512
  bytes. vLLM ``vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py`` at commit ``1bd28daa``
  (``_rope_quant_insert_mxfp8_kernel``: ``values = page + off * 512``, ``scales = page + P * 512 + off * 16``) and
  the layout note of ``vllm/v1/attention/backends/mla/flashmla_sparse.py`` at commit ``008a0c31`` ("a page holds all
  its data rows first and all its scale rows after ... rounded up to the decode kernel's TMA stride (576 B for V4,
  512 B for V4.1)"). (So V4 and V4.1 do *not* share a record width: 584 vs 528 bytes; FlashMLA's snapshot of April
  2026 knows only the 584-byte ``MODEL1`` layout.)

e8m0 scales (V4 / V4.1). Two exponent rules, chosen with ``quantize(..., e8m0_rule=...)``:

* ``"exact"`` (the default): ``e = ceil(log2(max(amax, 1e-4) / 448))`` taken exactly (float64, exact at powers of
  two), so ``2^e >= amax / 448`` always. The default because no value of a group ever saturates (the scale is the
  smallest power of two that holds the group, the format's intent) and because the bytes do not depend on how a
  device rounds ``log2``; ``impl.cache`` writes it too.
* ``"vllm_fp32"``: vLLM's writers as written, ``amax = maximum(amax, 1e-4)``, ``exponent = ceil(log2(amax * (1.0 /
  448.0)))``, every step in fp32 (``_rope_quant_insert_kernel`` and ``_rope_quant_insert_mxfp8_kernel`` of
  ``fused_compress_quant_cache.py`` at ``1bd28daa``). fp32 rounding of ``amax``, of ``1 / 448`` (rounded up by
  ``0.375`` ulp) and of the product, then of ``log2``, can land ``log2`` exactly on the integer ``k`` when ``amax``
  is a few fp32 ulps above ``448 * 2^k``: vLLM then picks the scale ``2^k`` and the group's largest value saturates
  at ``448`` (an error of those few ulps), where the exact rule picks ``2^(k+1)``. Elsewhere the two agree: the
  vLLM exponent is always the exact one or one less. The spec takes the fp32 ``log2`` correctly rounded (float64
  ``log2`` rounded to fp32); a GPU's fp32 ``log2`` need not be, so on a device the values that flip can differ
  (still only values near a boundary ``448 * 2^k``).

Both: byte ``clamp(e + 127, 0, 255)`` (a NaN or inf group: 255, read back as NaN), scale ``2^(byte - 127)``, values
``e4m3(clamp(x * 2^-e, -448, 448))``.

Error bound (:func:`error_bound`): for a value ``x`` stored in a float format with ``m`` mantissa bits under scale
``s`` (``s = 1`` when unscaled), round-to-nearest-even gives::

    |x_hat - x| <= max(2^-(m+1) * |x|, 2^(e_min - m - 1) * s)  +  max(0, |x| - max_finite * s)
                   ^ normal range       ^ subnormal range         ^ saturation (per-tensor scales; see below)

e4m3: ``m = 3, e_min = -6, max_finite = 448`` (half-ulp ``2^-4`` relative, ``2^-10 s`` absolute); e5m2: ``m = 2,
e_min = -14, max_finite = 57344``; bf16: ``m = 7`` (``2^-8`` relative). Group scales hardly saturate: exact e8m0
(``>= amax/448``) never, fp32 ``amax/448`` at most by the fp32 rounding of the scale, vLLM's fp32 e8m0 rule by a
few fp32 ulps of ``amax``; so the error of every value in a group is at most ``2^-4`` of the group's amax.

The spec rounds in float64, exactly, once (round half to even); kernels divide in fp32 first, which can differ
from the spec by one fp8 step when ``x / s`` falls within an fp32 rounding of a tie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .checks import FLOAT, Dims, boolean, choice, finite_float, positive_int, positive_scale

__all__ = [
    "BF16",
    "E4M3",
    "E5M2",
    "E8M0_RULES",
    "FP8_DS_MLA_V4",
    "FP8_DS_MLA_V32",
    "FP8_DS_MLA_V32_FP16",
    "FP8_E5M2_PER_TENSOR",
    "FP8_PER_TENSOR",
    "FP16",
    "FP32",
    "LAYOUTS",
    "MXFP8_DS_MLA_V41",
    "POW2_SCALE_FLOOR",
    "CacheLayout",
    "Dequantized",
    "Field",
    "FloatFormat",
    "LayoutCheck",
    "Quantized",
    "ScaleRule",
    "TokenRows",
    "decode_e8m0",
    "dequantize",
    "detect_layout",
    "error_bound",
    "exact_pages",
    "from_pages",
    "page_bytes",
    "quantize",
    "read_tokens",
    "round_to_format",
    "to_pages",
    "validate_layout",
    "write_pages",
]


# ----------------------------------------------------------------------------------------------- number formats


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point storage format: ``mantissa_bits`` explicit bits, smallest normal exponent ``e_min``."""

    name: str
    nbytes: int
    mantissa_bits: int
    e_min: int
    max_finite: float
    torch_dtype: torch.dtype
    saturates: bool  # True: finite overflow clamps to ±max_finite (SATFINITE); False: becomes ±inf

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """``[..., n * nbytes]`` uint8 (little-endian) -> ``[..., n]`` float64."""
        return raw.contiguous().view(self.torch_dtype).to(torch.float64)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` float64 values already representable in this format -> ``[..., n * nbytes]`` uint8."""
        # float64 -> float32 -> format is exact for representable values (and keeps NaN / inf).
        return x.to(torch.float32).to(self.torch_dtype).contiguous().view(torch.uint8)


E4M3 = FloatFormat("e4m3", 1, 3, -6, 448.0, torch.float8_e4m3fn, True)
E5M2 = FloatFormat("e5m2", 1, 2, -14, 57344.0, torch.float8_e5m2, True)
BF16 = FloatFormat("bf16", 2, 7, -126, float(torch.finfo(torch.bfloat16).max), torch.bfloat16, False)
FP16 = FloatFormat("fp16", 2, 10, -14, float(torch.finfo(torch.float16).max), torch.float16, False)
FP32 = FloatFormat("fp32", 4, 23, -126, float(torch.finfo(torch.float32).max), torch.float32, False)
_FORMATS = {f.name: f for f in (E4M3, E5M2, BF16, FP16, FP32)}
_FLT_MIN = float(torch.finfo(torch.float32).tiny)


def round_to_format(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round float64 ``x`` to the nearest value of ``fmt`` (ties to even), exactly, in float64.

    ``quantum = 2^(max(floor(log2|x|), e_min) - mantissa_bits)``; ``x_hat = round_half_even(x / quantum) * quantum``.
    Overflow saturates to ``±max_finite`` for fp8 (``__NV_SATFINITE``) and becomes ``±inf`` for bf16 / fp16 / fp32.
    NaN stays NaN. ``x``: a float tensor of any shape.
    """
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        what = str(x.dtype).removeprefix("torch.") if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a floating-point tensor, got {what}")
    if not isinstance(fmt, FloatFormat):
        raise TypeError(f"fmt must be a FloatFormat (E4M3, E5M2, BF16, FP16, FP32), got {type(fmt).__name__}")
    x = x.to(torch.float64)
    _, e = torch.frexp(x)  # |x| = m * 2^e, m in [0.5, 1): the leading bit is 2^(e - 1)
    quantum = torch.exp2((torch.clamp(e, min=fmt.e_min + 1) - 1 - fmt.mantissa_bits).to(torch.float64))
    y = torch.round(x / quantum) * quantum  # torch.round rounds half to even; the division is exact
    if fmt.saturates:
        return torch.clamp(y, -fmt.max_finite, fmt.max_finite)  # ±inf too; NaN stays NaN
    return torch.where(y.abs() > fmt.max_finite, y * math.inf, y)


def decode_e8m0(raw: torch.Tensor) -> torch.Tensor:
    """e8m0 scale bytes ``raw`` (uint8, any shape) -> float64 ``2^(byte - 127)``; byte 255 is NaN (OCP MX)."""
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        what = str(raw.dtype).removeprefix("torch.") if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise TypeError(f"raw must be a uint8 tensor of e8m0 bytes, got {what}")
    code = raw.to(torch.float64)
    return torch.where(raw == 255, math.nan, torch.exp2(code - 127.0))


# --------------------------------------------------------------------------------------------------- layout data


@dataclass(frozen=True)
class Field:
    """One field of a token record.

    Attributes:
        name: short name (``"nope"``, ``"scales"``, ``"rope"``, ``"pad"``).
        offset: byte offset inside the token record.
        nbytes: byte length.
        dtype: ``"e4m3" | "e5m2" | "bf16" | "fp32" | "e8m0" | "pad"``.
        count: number of elements of ``dtype`` (``nbytes = count * itemsize``).
        holds: what it holds, in words.
        elements: ``(start, stop)``: the entry elements a value field stores; None for scales and padding.
        group: values per scale for a quantized value field (None: unscaled or per-tensor).
        scale_field: name of the field holding this field's group scales.
    """

    name: str
    offset: int
    nbytes: int
    dtype: str
    count: int
    holds: str
    elements: tuple[int, int] | None = None
    group: int | None = None
    scale_field: str | None = None

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class ScaleRule:
    """How a group scale is chosen from the group's ``amax`` and how it is stored.

    ``kind="per_tensor"``: one scale given by the caller, not stored in the bytes.
    ``kind="fp32"``: ``s = max(fp32(amax / max_q), FLT_MIN)`` stored as fp32 (vLLM ``fp8_ds_mla``).
    ``kind="e8m0"``: ``s = 2^ceil(log2(max(amax, amax_floor) / max_q))`` stored as the byte ``exponent + 127``
    (exactly by default; :func:`quantize`'s ``e8m0_rule="vllm_fp32"`` takes vLLM's fp32 evaluation instead).
    """

    kind: str
    max_q: float = 448.0
    amax_floor: float = 0.0


@dataclass(frozen=True)
class CacheLayout:
    """A cache layout: per-token record fields plus how records are placed in a page block.

    Attributes:
        name: our name for it.
        kv_cache_dtype: vLLM's ``kv_cache_dtype`` string (or the model family) that selects it.
        entry_dim: ``D``, the entry width (576 or 512).
        token_bytes: bytes per token record.
        fields: the record's fields, in byte order, covering ``[0, token_bytes)`` exactly.
        scale_rule: see :class:`ScaleRule`.
        split_at: None for token-interleaved pages (token ``t`` at ``t * token_bytes``). Otherwise bytes
            ``[0, split_at)`` of each record are data rows at ``t * split_at`` and bytes ``[split_at, token_bytes)``
            are scale rows at ``P * split_at + t * (token_bytes - split_at)`` (DeepSeek V4: 576 + 8, V4.1: 512 + 16).
        page_alignment: a page block's bytes are ``round_up(P * token_bytes, page_alignment)``.
        source: where the layout is defined.
    """

    name: str
    kv_cache_dtype: str
    entry_dim: int
    token_bytes: int
    fields: tuple[Field, ...]
    scale_rule: ScaleRule
    split_at: int | None = None
    page_alignment: int = 1
    source: str = ""

    def __post_init__(self) -> None:  # the data must describe every byte exactly once
        pos = 0
        for f in self.fields:
            if f.offset != pos:
                raise ValueError(f"layout {self.name}: field {f.name} starts at {f.offset}, expected {pos}")
            item = 1 if f.dtype in ("pad", "e8m0") else _FORMATS[f.dtype].nbytes
            if f.nbytes != f.count * item:
                raise ValueError(f"layout {self.name}: field {f.name} has {f.nbytes} bytes for {f.count} x {f.dtype}")
            pos = f.end
        if pos != self.token_bytes:
            raise ValueError(f"layout {self.name}: fields cover {pos} bytes, token_bytes is {self.token_bytes}")

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def value_fields(self) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.elements is not None)

    @property
    def scale_fields(self) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.dtype in ("e8m0",) or (f.dtype == "fp32" and f.elements is None))

    @property
    def num_groups(self) -> int:
        """Scales per token (0 for per-tensor layouts)."""
        return sum(f.count for f in self.scale_fields)


FP8_PER_TENSOR = CacheLayout(
    name="fp8_e4m3_per_tensor",
    kv_cache_dtype="fp8",
    entry_dim=576,
    token_bytes=576,
    fields=(
        Field("latent", 0, 512, "e4m3", 512, "normed latent kv_c, e4m3(x / k_scale)", (0, 512)),
        Field("rope", 512, 64, "e4m3", 64, "k_pe after RoPE, e4m3(x / k_scale)", (512, 576)),
    ),
    scale_rule=ScaleRule("per_tensor"),
    source="vllm csrc/cache_kernels.cu concat_and_cache_mla_kernel; csrc/quantization/fp8/nvidia/quant_utils.cuh",
)

FP8_E5M2_PER_TENSOR = CacheLayout(
    name="fp8_e5m2_per_tensor",
    kv_cache_dtype="fp8_e5m2",
    entry_dim=576,
    token_bytes=576,
    fields=(
        Field("latent", 0, 512, "e5m2", 512, "normed latent kv_c, e5m2(x / k_scale)", (0, 512)),
        Field("rope", 512, 64, "e5m2", 64, "k_pe after RoPE, e5m2(x / k_scale)", (512, 576)),
    ),
    scale_rule=ScaleRule("per_tensor", max_q=57344.0),
    source="vllm csrc/cache_kernels.cu concat_and_cache_mla_kernel (kv_cache_dtype='fp8_e5m2')",
)

FP8_DS_MLA_V32 = CacheLayout(
    name="fp8_ds_mla_v32",
    kv_cache_dtype="fp8_ds_mla",
    entry_dim=576,
    token_bytes=656,
    fields=(
        Field("nope", 0, 512, "e4m3", 512, "normed latent, e4m3(x / s_g), 4 groups of 128", (0, 512), 128, "scales"),
        Field("scales", 512, 16, "fp32", 4, "s_g = max(amax_g / 448, FLT_MIN), one per 128 values"),
        Field("rope", 528, 128, "bf16", 64, "k_pe after RoPE, bf16, not quantized", (512, 576)),
    ),
    scale_rule=ScaleRule("fp32"),
    source="FlashMLA README.md / flash_mla_interface.py (656-byte token); vllm csrc/cache_kernels.cu "
    "concat_and_cache_ds_mla_kernel",
)

FP8_DS_MLA_V32_FP16 = CacheLayout(
    name="fp8_ds_mla_v32_fp16",
    kv_cache_dtype="fp8_ds_mla (fp16 model)",
    entry_dim=576,
    token_bytes=656,
    fields=(
        FP8_DS_MLA_V32.fields[0],
        FP8_DS_MLA_V32.fields[1],
        Field("rope", 528, 128, "fp16", 64, "k_pe after RoPE, fp16 (the model's dtype), not quantized", (512, 576)),
    ),
    scale_rule=ScaleRule("fp32"),
    source="vllm csrc/cache_kernels.cu concat_and_cache_ds_mla_kernel (RoPE copied as scalar_t, the input dtype; "
    "kv_c.itemsize() == 2); FlashMLA tests/quant.py quantize_k_cache (rope viewed as input_k_cache.dtype)",
)

FP8_DS_MLA_V4 = CacheLayout(
    name="fp8_ds_mla_v4",
    kv_cache_dtype="fp8_ds_mla (DeepSeek V4)",
    entry_dim=512,
    token_bytes=584,
    fields=(
        Field("nope", 0, 448, "e4m3", 448, "NoPE dims, e4m3(x * 2^-e_g), 7 groups of 64", (0, 448), 64, "scales"),
        Field("rope", 448, 128, "bf16", 64, "RoPE dims 448..511, bf16, not quantized", (448, 512)),
        Field("scales", 576, 7, "e8m0", 7, "e_g + 127, one per 64 NoPE values (scale row)"),
        Field("pad", 583, 1, "pad", 1, "zero padding byte (scale row)"),
    ),
    scale_rule=ScaleRule("e8m0", amax_floor=1e-4),
    split_at=576,
    page_alignment=576,
    source="vllm vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py _rope_quant_insert_kernel; "
    "vllm/v1/attention/backends/mla/flashmla_sparse.py; FlashMLA tests/quant.py (MODEL1_FP8Sparse)",
)

MXFP8_DS_MLA_V41 = CacheLayout(
    name="mxfp8_ds_mla_v41",
    kv_cache_dtype="fp8_ds_mla (DeepSeek V4.1)",
    entry_dim=512,
    token_bytes=528,
    fields=(
        Field(
            "values",
            0,
            512,
            "e4m3",
            512,
            "all 512 dims (RoPE rotated first), 16 groups of 32 (data row)",
            (0, 512),
            32,
            "scales",
        ),
        Field("scales", 512, 16, "e8m0", 16, "e_g + 127, one per 32 values, MXFP8 (scale row)"),
    ),
    scale_rule=ScaleRule("e8m0", amax_floor=1e-4),
    split_at=512,
    page_alignment=512,
    source="vllm vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py @1bd28daa "
    "_rope_quant_insert_mxfp8_kernel (values at page + off * 512, scales at page + P * 512 + off * 16); "
    "vllm/v1/attention/backends/mla/flashmla_sparse.py @008a0c31 (layout note: data rows then scale rows, "
    "pages rounded up to 512 B)",
)

LAYOUTS: dict[str, CacheLayout] = {
    l.name: l
    for l in (
        FP8_PER_TENSOR,
        FP8_E5M2_PER_TENSOR,
        FP8_DS_MLA_V32,
        FP8_DS_MLA_V32_FP16,
        FP8_DS_MLA_V4,
        MXFP8_DS_MLA_V41,
    )
}


# ---------------------------------------------------------------------------------------------- quantize / back


class Quantized(NamedTuple):
    """``raw [T, token_bytes]`` uint8 records and the ``scales [T, G]`` float64 used (``G = 0`` per-tensor)."""

    raw: torch.Tensor
    scales: torch.Tensor


class Dequantized(NamedTuple):
    """``entries [T, D]`` float64 and the decoded ``scales [T, G]`` float64."""

    entries: torch.Tensor
    scales: torch.Tensor


def _layout(layout: object) -> CacheLayout:
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
        return LAYOUTS[layout]
    if not isinstance(layout, CacheLayout):
        raise TypeError(f"layout must be a CacheLayout or a name, got {type(layout).__name__}")
    return layout


def _tensor_scale(layout: CacheLayout, scale: object) -> float | None:
    if layout.scale_rule.kind == "per_tensor":
        if scale is None:
            raise ValueError(f"scale is required for the per-tensor layout {layout.name}")
        s = positive_scale("scale", scale)
        return float(round_to_format(torch.tensor(s, dtype=torch.float64), FP32))  # vLLM keeps k_scale in fp32
    if scale is not None:
        raise ValueError(f"scale must be None for {layout.name}: its scales are per group and stored in the bytes")
    return None


POW2_SCALE_FLOOR = 1e-4
"""The floor of ``amax / 448`` under the power-of-two fp32 scale rule (``pow2_scales=True``): FlashMLA
``tests/quant.py`` and vLLM after PR #49435 both take ``max(amax / 448, 1e-4)``, so the smallest scale is ``2^-13``."""

E8M0_RULES = ("exact", "vllm_fp32")
"""The e8m0 exponent rules :func:`quantize` offers (module docstring): ``"exact"`` (default), ``"vllm_fp32"``."""


def _ceil_log2(y: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(y))`` exactly for float64 ``y > 0`` (``frexp``: exact at powers of two), as float64."""
    _, e = torch.frexp(y)  # y = m 2^e, m in [0.5, 1): ceil(log2 y) = e - 1 if y is a power of two else e
    exact_pow2 = torch.ldexp(torch.ones_like(y), e - 1) == y
    return torch.where(exact_pow2, e - 1, e).to(torch.float64)


def _e8m0_exponent(amax: torch.Tensor, rule: ScaleRule, e8m0_rule: str) -> torch.Tensor:
    """The e8m0 exponent (float64, before the byte clamp) of each group's ``amax`` under ``e8m0_rule``."""
    if e8m0_rule == "exact":
        return _ceil_log2(torch.clamp(amax, min=rule.amax_floor) / rule.max_q)

    # vLLM (fused_compress_quant_cache.py @ 1bd28daa): amax = tl.maximum(amax, 1e-4);
    # exponent = tl.ceil(tl.log2(amax * (1.0 / 448.0))), all fp32. Each fp32 step is one rounding of an exact float64
    # value: fp32(amax), the product of two fp32 values (exact in float64), log2 (float64, then rounded to fp32).
    def f32(v: torch.Tensor) -> torch.Tensor:
        return round_to_format(v, FP32)

    one = torch.ones_like(amax)
    a = torch.maximum(f32(amax), f32(one * rule.amax_floor))  # NaN stays NaN (the caller maps it to byte 255)
    y = f32(a * f32(one / rule.max_q))
    return torch.ceil(f32(torch.log2(y)))


def _group_scales(
    amax: torch.Tensor, rule: ScaleRule, pow2: bool, e8m0_rule: str = "exact"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group scales float64 and, for e8m0, their bytes (else an empty tensor)."""
    if rule.kind == "e8m0":
        expo = _e8m0_exponent(amax, rule, e8m0_rule)
        code = torch.clamp(expo + 127.0, 0.0, 255.0)
        code = torch.where(torch.isnan(amax) | torch.isinf(amax), 255.0, code)
        return decode_e8m0(code.to(torch.uint8)), code.to(torch.uint8)
    s = round_to_format(amax / rule.max_q, FP32)  # the kernel divides in fp32 and stores fp32
    if pow2:  # FlashMLA tests/quant.py: 2^ceil(log2(max(amax / 448, 1e-4))); inf / NaN amax stay inf / NaN (log2)
        p2 = torch.exp2(_ceil_log2(torch.clamp(amax / rule.max_q, min=POW2_SCALE_FLOOR)))
        s = torch.where(torch.isfinite(amax), p2, s)
    else:
        s = torch.clamp(s, min=_FLT_MIN)
    return s, torch.empty(0, dtype=torch.uint8)


def _check_rules(layout: CacheLayout, pow2_scales: object, e8m0_rule: object) -> None:
    boolean("pow2_scales", pow2_scales)
    if pow2_scales and layout.scale_rule.kind != "fp32":
        raise ValueError(f"pow2_scales applies only to fp32-scale layouts, not {layout.name}")
    choice("e8m0_rule", e8m0_rule, E8M0_RULES)
    if e8m0_rule != "exact" and layout.scale_rule.kind != "e8m0":
        raise ValueError(f"e8m0_rule={e8m0_rule!r} applies only to e8m0-scale layouts, not {layout.name}")


def quantize(
    entries: torch.Tensor,
    layout: CacheLayout | str,
    *,
    scale: float | torch.Tensor | None = None,
    pow2_scales: bool = False,
    e8m0_rule: str = "exact",
) -> Quantized:
    """Quantize cache entries into token records of ``layout``.

    Pseudocode, for each value field ``f`` over entry elements ``[a, b)``::

        x = entries[:, a:b]                              # float64
        if f is unscaled (bf16 / fp32): q = round_to_format(x, f.dtype)
        elif per-tensor:                 q = round_to_format(x / scale, fp8)              # saturating
        else, per group g of f.group values:
            s_g = rule(amax_g)                           # fp32 amax/448, or e8m0 2^ceil(log2(max(amax,1e-4)/448))
                                                         #   (e8m0_rule: exactly, or as vLLM's fp32 code does)
            q   = round_to_format(x / s_g, e4m3)         # saturating at ±448
        raw[:, f.offset:f.end] = bytes(q);  raw[:, scales] = bytes(s);  raw[:, pad] = 0

    Args:
        entries: ``[T, D]`` float (``D = layout.entry_dim``): for V3/V3.2 the normed latent (512) then the RoPE'd
            ``k_pe`` (64); for V4/V4.1 the 512-dim latent with RoPE already applied to dims 448..511.
        layout: a :class:`CacheLayout` or its name in :data:`LAYOUTS`.
        scale: the per-tensor fp32 scale (``k_scale``); required for per-tensor layouts, None otherwise.
        pow2_scales: for the fp32-scale layout (656 B): round scales up to powers of two with FlashMLA's
            ``tests/quant.py`` floor ``1e-4`` instead of vLLM's raw ``amax / 448``.
        e8m0_rule: for the e8m0-scale layouts (V4 584 B, V4.1 528 B): ``"exact"`` (default) takes
            ``ceil(log2(max(amax, 1e-4) / 448))`` exactly, so no value saturates; ``"vllm_fp32"`` evaluates vLLM's
            ``tl.ceil(tl.log2(tl.maximum(amax, 1e-4) * (1.0 / 448.0)))`` in fp32 (``fused_compress_quant_cache.py``
            at commit ``1bd28daa``), which picks ``2^k`` instead of ``2^(k+1)`` for ``amax`` a few fp32 ulps above
            ``448 * 2^k`` (module docstring).

    Returns:
        ``raw [T, token_bytes]`` uint8 and ``scales [T, G]`` float64 (the group scales, in field order).
    """
    layout = _layout(layout)
    Dims().tensor("entries", entries, ("T", layout.entry_dim), FLOAT)
    _check_rules(layout, pow2_scales, e8m0_rule)
    s_tensor = _tensor_scale(layout, scale)
    x = entries.to(torch.float64)
    t = x.shape[0]
    raw = torch.zeros(t, layout.token_bytes, dtype=torch.uint8, device=x.device)
    all_scales = []
    for f in layout.value_fields:
        a, b = f.elements
        fmt = _FORMATS[f.dtype]
        v = x[:, a:b]
        if f.group is None and s_tensor is None:  # stored verbatim (bf16 RoPE)
            q = round_to_format(v, fmt)
        elif f.group is None:  # per-tensor scale
            q = round_to_format(v / s_tensor, fmt)
        else:
            g = v.reshape(t, (b - a) // f.group, f.group)  # [T, groups, group]
            amax = g.abs().amax(dim=-1)  # NaN propagates into amax
            s, code = _group_scales(amax, layout.scale_rule, pow2_scales, e8m0_rule)
            q = round_to_format(g / s[..., None], fmt).reshape(t, b - a)
            sf = layout.field(f.scale_field)
            raw[:, sf.offset : sf.end] = code if sf.dtype == "e8m0" else FP32.encode(s)
            all_scales.append(s)
        raw[:, f.offset : f.end] = fmt.encode(q)
    scales = torch.cat(all_scales, dim=1) if all_scales else torch.zeros(t, 0, dtype=torch.float64, device=x.device)
    return Quantized(raw, scales)


def dequantize(
    raw: torch.Tensor,
    layout: CacheLayout | str,
    *,
    scale: float | torch.Tensor | None = None,
) -> Dequantized:
    """Read token records back: ``x_hat = decode(q) * s`` (``s`` the group or per-tensor scale; 1 if unscaled).

    Args:
        raw: ``[T, token_bytes]`` uint8 records (see :func:`from_pages` to get them out of page blocks).
        layout: the layout the records were written in.
        scale: the per-tensor scale for per-tensor layouts; None otherwise.

    Returns:
        ``entries [T, D]`` float64 and ``scales [T, G]`` float64. Pad bytes are ignored here; see
        :func:`validate_layout` to check them.
    """
    layout = _layout(layout)
    Dims().tensor("raw", raw, ("T", layout.token_bytes), (torch.uint8,))
    s_tensor = _tensor_scale(layout, scale)
    t = raw.shape[0]
    out = torch.empty(t, layout.entry_dim, dtype=torch.float64, device=raw.device)
    all_scales = []
    for f in layout.value_fields:
        a, b = f.elements
        q = _FORMATS[f.dtype].decode(raw[:, f.offset : f.end])
        if f.group is None:
            out[:, a:b] = q if s_tensor is None else q * s_tensor
            continue
        sf = layout.field(f.scale_field)
        sb = raw[:, sf.offset : sf.end]
        s = decode_e8m0(sb) if sf.dtype == "e8m0" else FP32.decode(sb)
        out[:, a:b] = (q.reshape(t, (b - a) // f.group, f.group) * s[..., None]).reshape(t, b - a)
        all_scales.append(s)
    scales = torch.cat(all_scales, dim=1) if all_scales else torch.zeros(t, 0, dtype=torch.float64, device=raw.device)
    return Dequantized(out, scales)


def error_bound(
    entries: torch.Tensor,
    layout: CacheLayout | str,
    *,
    scale: float | torch.Tensor | None = None,
    pow2_scales: bool = False,
    e8m0_rule: str = "exact",
) -> torch.Tensor:
    """Per-element bound on ``|dequantize(quantize(x)) - x|``, ``[T, D]`` float64 (see the module docstring)::

        bound = max(2^-(m+1) |x|, 2^(e_min-m-1) s) + max(0, |x| - max_finite s)

    with ``s`` the element's scale (group, per-tensor, or 1). Same arguments as :func:`quantize`.
    """
    layout = _layout(layout)
    Dims().tensor("entries", entries, ("T", layout.entry_dim), FLOAT)
    s_tensor = _tensor_scale(layout, scale)
    q = quantize(entries, layout, scale=scale, pow2_scales=pow2_scales, e8m0_rule=e8m0_rule)
    x = entries.to(torch.float64).abs()
    t = x.shape[0]
    bound = torch.empty_like(x)
    col = 0
    for f in layout.value_fields:
        a, b = f.elements
        fmt = _FORMATS[f.dtype]
        if f.group is None:
            s = torch.full((t, b - a), 1.0 if s_tensor is None else s_tensor, dtype=torch.float64, device=x.device)
        else:
            n = (b - a) // f.group
            s = q.scales[:, col : col + n].repeat_interleave(f.group, dim=1)
            col += n
        v = x[:, a:b]
        rel = 2.0 ** -(fmt.mantissa_bits + 1)
        sub = 2.0 ** (fmt.e_min - fmt.mantissa_bits - 1)
        bound[:, a:b] = torch.maximum(rel * v, sub * s) + torch.clamp(v - fmt.max_finite * s, min=0.0)
    return bound


# ---------------------------------------------------------------------------------------------------- pages


def page_bytes(layout: CacheLayout | str, block_size: int) -> int:
    """Bytes of one page block: ``round_up(P * token_bytes, page_alignment)``."""
    layout = _layout(layout)
    p = positive_int("block_size", block_size)
    n = p * layout.token_bytes
    return -(-n // layout.page_alignment) * layout.page_alignment


def _record_byte_index(layout: CacheLayout, block_size: int) -> torch.Tensor:
    """``[P, token_bytes]`` int64: where byte ``j`` of token ``t``'s record lives inside the page block."""
    p, tb = block_size, layout.token_bytes
    t = torch.arange(p)[:, None]
    j = torch.arange(tb)[None, :]
    if layout.split_at is None:
        return t * tb + j
    data = layout.split_at
    return torch.where(j < data, t * data + j, p * data + t * (tb - data) + (j - data))


def to_pages(raw: torch.Tensor, layout: CacheLayout | str, block_size: int) -> torch.Tensor:
    """Place token records into page blocks.

    Token ``t = block * P + offset`` goes to page ``block``. Token-interleaved layouts put record ``offset`` at byte
    ``offset * token_bytes``; split layouts (V4, V4.1) put its data row at ``offset * split_at`` and its scale row at
    ``P * split_at + offset * (token_bytes - split_at)``. Bytes past ``P * token_bytes`` (alignment padding) are 0.

    Args:
        raw: ``[NB * P, token_bytes]`` uint8.
        block_size: ``P``.

    Returns:
        ``pages [NB, page_bytes]`` uint8. For token-interleaved layouts ``pages.view(NB, P,
        token_bytes)`` is vLLM's ``[NB, P, token_bytes]`` cache tensor.
    """
    layout = _layout(layout)
    p = positive_int("block_size", block_size)
    Dims().tensor("raw", raw, ("T", layout.token_bytes), (torch.uint8,))
    if raw.shape[0] % p:
        raise ValueError(f"raw must hold a whole number of blocks of block_size={p} tokens, got {raw.shape[0]} rows")
    nb = raw.shape[0] // p
    pages = torch.zeros(nb, page_bytes(layout, p), dtype=torch.uint8, device=raw.device)
    idx = _record_byte_index(layout, p).to(raw.device).reshape(-1)
    pages[:, idx] = raw.reshape(nb, -1)
    return pages


def from_pages(pages: torch.Tensor, layout: CacheLayout | str, block_size: int) -> torch.Tensor:
    """Inverse of :func:`to_pages`: ``pages [NB, page_bytes]`` -> records ``[NB * P, token_bytes]``."""
    layout = _layout(layout)
    p = positive_int("block_size", block_size)
    Dims().tensor("pages", pages, ("NB", page_bytes(layout, p)), (torch.uint8,))
    idx = _record_byte_index(layout, p).to(pages.device).reshape(-1)
    return pages[:, idx].reshape(-1, layout.token_bytes)


class TokenRows(NamedTuple):
    """``raw [T, token_bytes]`` uint8 (zeros where invalid) and ``valid [T]`` bool."""

    raw: torch.Tensor
    valid: torch.Tensor


def read_tokens(pages: torch.Tensor, layout: CacheLayout | str, block_size: int, slots: torch.Tensor) -> TokenRows:
    """Read the records at ``slots`` the way FlashMLA's sparse decode does.

    FlashMLA takes ``indices_in_kvcache = block * P + offset`` (``flash_mla/flash_mla_interface.py``); ``-1`` (or any
    negative index) is invalid and contributes nothing. For the 656-byte layout the kernel reads
    ``k_cache.view(-1, 656)[index]`` and requires each page block to be contiguous (``stride(1) == 656``); for V4 it
    reads the data row at ``block * stride + offset * 576`` and the scale row at ``block * stride + P * 576 +
    offset * 8`` (``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh``); V4.1's rows are at ``offset * 512`` and
    ``P * 512 + offset * 16``, where vLLM's writer puts them (``_rope_quant_insert_mxfp8_kernel``).

    Args:
        pages: ``[NB, page_bytes]`` uint8.
        slots: ``[T]`` int; ``-1`` marks an invalid index; others must be in ``[0, NB * P)``.
    """
    layout = _layout(layout)
    p = positive_int("block_size", block_size)
    dims = Dims()
    dims.tensor("pages", pages, ("NB", page_bytes(layout, p)), (torch.uint8,))
    dims.tensor("slots", slots, ("T",), (torch.int64, torch.int32, torch.int16))
    total = dims["NB"] * p
    s = slots.to(torch.int64)
    if bool(((s >= total) | (s < -1)).any()):
        raise ValueError(f"slots must be -1 or in [0, NB * P = {total}), got {s.tolist()}")
    valid = s >= 0
    records = from_pages(pages, layout, p)
    raw = torch.where(valid[:, None], records[s.clamp(min=0)], 0)
    return TokenRows(raw.to(torch.uint8), valid)


def write_pages(
    pages: torch.Tensor,
    entries: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: CacheLayout | str,
    block_size: int,
    *,
    scale: float | torch.Tensor | None = None,
    pow2_scales: bool = False,
    e8m0_rule: str = "exact",
) -> torch.Tensor:
    """Quantize ``entries`` and write them at ``slot_mapping`` into a *copy* of ``pages`` (slot ``-1``: skipped).

    The quantized analogue of vLLM's cache writers (``concat_and_cache_mla`` for V3/V3.2, ``rope_quant_insert`` for
    V4/V4.1). Args as :func:`quantize` and :func:`read_tokens`; ``slot_mapping [T]`` int, entries ``[T, D]``.

    Returns:
        the new ``pages [NB, page_bytes]`` uint8.
    """
    layout = _layout(layout)
    p = positive_int("block_size", block_size)
    dims = Dims()
    dims.tensor("pages", pages, ("NB", page_bytes(layout, p)), (torch.uint8,))
    dims.tensor("entries", entries, ("T", layout.entry_dim), FLOAT)
    dims.tensor("slot_mapping", slot_mapping, ("T",), (torch.int64, torch.int32))
    s = slot_mapping.to(torch.int64)
    total = dims["NB"] * p
    if bool(((s >= total) | (s < -1)).any()):
        raise ValueError(f"slot_mapping must be -1 or in [0, NB * P = {total}), got {s.tolist()}")
    keep = s >= 0
    if keep.sum() != torch.unique(s[keep]).numel():
        raise ValueError(f"slot_mapping must not repeat a slot (the kernels would race), got {s.tolist()}")
    records = from_pages(pages, layout, p).clone()
    q = quantize(entries[keep], layout, scale=scale, pow2_scales=pow2_scales, e8m0_rule=e8m0_rule)
    records[s[keep]] = q.raw
    out = to_pages(records, layout, p)
    tail = p * layout.token_bytes  # alignment padding keeps whatever the old pages had there
    out[:, tail:] = pages[:, tail:]
    return out


def exact_pages(entries: torch.Tensor, layout: CacheLayout | str, block_size: int) -> torch.Tensor:
    """Page blocks of a group-scaled layout that hold ``entries`` *exactly*, or ``ValueError``.

    For handing a kernel that reads only an fp8 cache (FlashMLA's sparse decode) the very entries a case gives in
    float: no quantization error may pose as a kernel error. Entries must come from ``dequantize(quantize(...))``
    under one of the layout's scale rules; rows holding a NaN or inf (a harness's never-read, hostile slots) are
    written as ``0xFF`` bytes, the e4m3 NaN, so a kernel that reads one poisons its output. Pseudocode::

        finite = rows of entries without NaN / inf
        rules  = (pow2_scales=True, pow2_scales=False) for fp32 scales (656 B: FlashMLA's tests/quant.py, then
                 vLLM's raw amax / 448); the exact e8m0 rule for V4 / V4.1
        raw    = quantize(entries[finite], layout, rule) for the first rule with
                 dequantize(raw) == entries[finite] bit for bit              (none: ValueError)
        records[t] = raw[t] if finite[t] else 0xFF * token_bytes
        records padded with 0xFF rows to ceil(T / P) * P rows, then to_pages(records, layout, P)

    Example (656 B, ``P = 2``): three entries whose groups are e4m3 values times powers of two, the middle one
    NaN, give 2 pages: page 0 holds entry 0 (scales powers of two) and ``0xFF`` * 656, page 1 entry 2 and ``0xFF``
    * 656; ``dequantize(from_pages(pages)[[0, 2]])`` is entries 0 and 2 again.

    Args:
        entries: ``[T, D]`` float (``D = layout.entry_dim``), flat slots ``t = block * P + offset``.
        layout: a group-scaled :class:`CacheLayout` (``fp8_ds_mla_v32``, ``fp8_ds_mla_v4``, ``mxfp8_ds_mla_v41``)
            or its name.
        block_size: ``P``, tokens per page.

    Returns:
        ``pages [ceil(T / P), page_bytes]`` uint8 on ``entries``' device.
    """
    layout = _layout(layout)
    if layout.num_groups == 0:
        raise ValueError(f"layout must have group scales stored in the bytes, not the per-tensor {layout.name}")
    p = positive_int("block_size", block_size)
    Dims().tensor("entries", entries, ("T", layout.entry_dim), FLOAT)
    x = entries.to(torch.float64)
    finite = torch.isfinite(x).all(dim=1)
    xf = x[finite]
    rules = (True, False) if layout.scale_rule.kind == "fp32" else (False,)
    for pow2 in rules:
        raw = quantize(xf, layout, pow2_scales=pow2).raw
        if torch.equal(dequantize(raw, layout).entries, xf):
            break
    else:
        raise ValueError(
            f"entries must be exactly representable in the {layout.token_bytes}-byte {layout.name} layout (values "
            "from dequantize(quantize(...))); they are not under any of its scale rules"
        )
    t = x.shape[0]
    records = torch.full((-(-t // p) * p, layout.token_bytes), 0xFF, dtype=torch.uint8, device=x.device)
    records[:t][finite] = raw
    return to_pages(records, layout, p)


# ------------------------------------------------------------------------------------------------ detection


class LayoutCheck(NamedTuple):
    """``ok``; ``plausible``: fraction of tokens whose scale / pad bytes look right; ``problems``: what did not."""

    ok: bool
    plausible: float
    problems: tuple[str, ...]


def validate_layout(
    raw: torch.Tensor,
    layout: CacheLayout | str,
    *,
    e8m0_range: tuple[int, int] = (127 - 40, 127 + 20),
    fp32_range: tuple[float, float] = (_FLT_MIN, 2.0**20),
    min_plausible: float = 1.0,
) -> LayoutCheck:
    """Check that bytes written as ``layout`` look like ``layout``, using only scale and pad bytes.

    Per token: e8m0 scale bytes in ``e8m0_range`` (written scales are ``>= 2^(log2(1e-4 / 448))``, i.e. byte
    ``>= 105``, and an RMS-normed latent never needs more than ``2^20``); fp32 scales finite and in ``fp32_range``;
    pad bytes zero; fp8 value bytes not NaN (``0x7F`` / ``0xFF`` for e4m3). A token passes when all its checks pass;
    the layout passes when at least ``min_plausible`` of the tokens do. Per-tensor layouts carry no scale bytes, so
    only the NaN check applies to them.

    Args:
        raw: ``[T, token_bytes]`` uint8 records, or ``[NB, page_bytes]`` pages (read through
            :func:`from_pages`, so pass ``block_size``) -- a width that is neither is itself a failed check.
    """
    layout = _layout(layout)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 2:
        raise TypeError("raw must be a 2-D uint8 tensor")
    for name, pair, kind in (("e8m0_range", e8m0_range, int), ("fp32_range", fp32_range, (int, float))):
        if (
            not isinstance(pair, tuple)
            or len(pair) != 2
            or not all(isinstance(v, kind) and not isinstance(v, bool) for v in pair)
        ):
            raise TypeError(f"{name} must be a (low, high) tuple of numbers, got {pair!r}")
        if not pair[0] <= pair[1]:
            raise ValueError(f"{name} must have low <= high, got {pair!r}")
    min_plausible = finite_float("min_plausible", min_plausible)
    if not 0.0 <= min_plausible <= 1.0:
        raise ValueError(f"min_plausible must lie in [0, 1], got {min_plausible}")
    if raw.shape[1] != layout.token_bytes:
        return LayoutCheck(False, 0.0, (f"record width {raw.shape[1]} != {layout.token_bytes} bytes",))
    t = raw.shape[0]
    good = torch.ones(t, dtype=torch.bool, device=raw.device)
    problems = []
    for f in layout.fields:
        b = raw[:, f.offset : f.end]
        if f.dtype == "pad":
            bad = (b != 0).any(dim=1)
            what = "non-zero pad byte"
        elif f.dtype == "e8m0":
            lo, hi = e8m0_range
            bad = ((b < lo) | (b > hi)).any(dim=1)
            what = f"e8m0 scale byte outside [{lo}, {hi}]"
        elif f.dtype == "fp32" and f.elements is None:
            s = FP32.decode(b)
            bad = (~torch.isfinite(s) | (s < fp32_range[0]) | (s > fp32_range[1])).any(dim=1)
            what = f"fp32 scale not finite in [{fp32_range[0]:.3g}, {fp32_range[1]:.3g}]"
        elif f.dtype in ("e4m3", "e5m2"):
            bad = torch.isnan(_FORMATS[f.dtype].decode(b)).any(dim=1)
            what = f"NaN {f.dtype} value"
        else:
            continue
        if bool(bad.any()):
            problems.append(f"{f.name}: {what} in {int(bad.sum())} of {t} tokens")
        good &= ~bad
    frac = float(good.to(torch.float64).mean()) if t else 1.0
    return LayoutCheck(frac >= min_plausible, frac, tuple(problems))


def detect_layout(raw_pages: torch.Tensor, block_size: int) -> tuple[str, ...]:
    """Names of the layouts (with group scales) under which ``raw_pages [NB, page_bytes]`` uint8 look valid.

    Only layouts whose page size matches ``page_bytes`` are tried, then :func:`validate_layout` on their records.
    """
    p = positive_int("block_size", block_size)
    if not isinstance(raw_pages, torch.Tensor) or raw_pages.dtype != torch.uint8 or raw_pages.dim() != 2:
        raise TypeError("raw_pages must be a 2-D uint8 tensor [NB, page_bytes]")
    found = []
    for name, layout in LAYOUTS.items():
        if layout.num_groups == 0 or raw_pages.shape[1] != page_bytes(layout, p):
            continue
        if validate_layout(from_pages(raw_pages, layout, p), layout).ok:
            found.append(name)
    return tuple(found)
