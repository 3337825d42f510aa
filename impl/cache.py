"""Paged MLA cache ops: ``concat_and_cache_mla`` (bf16/fp16, per-tensor fp8, the 656-byte ``fp8_ds_mla`` token),
``write_pages`` (any layout of :mod:`mlaspec.spec.cache_layouts`, V4's split page rows included), ``gather_cache``
(``cp_gather_cache`` with ``seq_starts``), the records' (de)quantization and a page-record read.

Implements :func:`mlaspec.spec.paged_cache.concat_and_cache_mla`, :func:`mlaspec.spec.paged_cache.gather_cache`,
:func:`mlaspec.spec.cache_layouts.quantize` / :func:`~mlaspec.spec.cache_layouts.dequantize` /
:func:`~mlaspec.spec.cache_layouts.write_pages` / :func:`~mlaspec.spec.cache_layouts.read_tokens` for every layout
in :data:`mlaspec.spec.cache_layouts.LAYOUTS`. One writer kernel and one reader kernel serve all of them: the host
turns the layout's :class:`~mlaspec.spec.cache_layouts.Field` records into a handful of constants (:func:`plan`):

* ``A``: the leading fp8 field, entry elements ``[0, D_A)`` at byte ``A_OFF`` -- e4m3/e5m2 under a per-tensor scale
  (``SCALES=0``), under an fp32 scale per ``GROUP`` values (``SCALES=1``) or an e8m0 scale per ``GROUP`` values
  (``SCALES=2``), the ``G`` scales at byte ``S_OFF``;
* ``B``: the rest of the entry, ``[D_A, D_A + D_B)`` at byte ``B_OFF``: fp8 under the same per-tensor scale
  (``B_KIND=1``), bf16 stored verbatim (``B_KIND=2``), fp16 stored verbatim (``B_KIND=3``: the 656-byte record
  of an fp16 model, :data:`mlaspec.spec.cache_layouts.FP8_DS_MLA_V32_FP16`) or absent (``B_KIND=0``);
* a zero pad field (``PAD`` bytes at ``PAD_OFF``), and where a record lives in its page: token-interleaved
  (``SPLIT=0``, record ``off`` at ``off * TOKEN_BYTES``) or split (bytes ``[0, SPLIT)`` of the record at
  ``off * SPLIT``, the rest at ``P * SPLIT + off * (TOKEN_BYTES - SPLIT)``).

The layouts, as the spec states them (:mod:`mlaspec.spec.cache_layouts` cites each source):

* ``fp8_e4m3_per_tensor`` / ``fp8_e5m2_per_tensor``: 576 fp8 bytes, ``fp8(clamp(x / scale))`` with vLLM's fp32
  ``k_scale`` (``csrc/cache_kernels.cu`` ``concat_and_cache_mla_kernel``, ``__NV_SATFINITE``);
* ``fp8_ds_mla_v32`` (656 bytes, FlashMLA ``README.md``): 512 e4m3 in 4 groups of 128 under
  ``s_g = max(amax_g / 448, FLT_MIN)`` (fp32, not a power of two: vLLM 0.33's ``concat_and_cache_ds_mla_kernel``),
  or with ``pow2_scales=True`` ``s_g = 2^ceil(log2(max(amax_g / 448, 1e-4)))`` (vLLM after PR #49435, FlashMLA's
  ``tests/quant.py``; the exponent read off the bits of ``amax`` as for e8m0 below), the 4 fp32 scales, the 64 RoPE
  values as bf16;
* ``fp8_ds_mla_v4`` (584 bytes, FlashMLA's ``MODEL1_FP8Sparse``): 448 e4m3 in 7 groups of 64 and 64 bf16 RoPE values
  (the 576-byte data row), 7 e8m0 scales and a zero pad byte (the 8-byte scale row); a page holds all ``P`` data rows,
  then the ``P`` scale rows, rounded up to 576 bytes (vLLM
  ``vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py`` ``_rope_quant_insert_kernel``);
* ``mxfp8_ds_mla_v41`` (528 bytes): all 512 dims e4m3 in 16 groups of 32 (MXFP8), then the 16 e8m0 scales
  (``_rope_quant_insert_mxfp8_kernel`` of the same file), split in the page like V4 (the ``P`` 512-byte data rows,
  then the 16-byte scale rows, rounded up to 512 bytes), as the spec's record says (``split_at``): the kernels take
  the placement from the layout data, not from the layout's name.

e8m0 scales: ``e = ceil(log2(max(amax, 1e-4) / 448))``, byte ``clamp(e + 127, 0, 255)``, values
``e4m3(x * 2^-e)``; a group holding NaN or inf gets byte 255 (NaN) and NaN values, as the spec's. vLLM's writers
compute ``ceil(log2(amax * (1 / 448)))`` with fp32 ``log2`` and a rounded ``1 / 448``; here the exponent is read off
the bits of ``amax`` (``amax = m 2^E``: ``e = E - 8 + (m > 1.75)``, 448 being ``1.75 * 2^8``), which is the exact
ceiling the spec takes in float64. The two differ only for ``amax`` a few fp32 ulps above ``448 * 2^k``: there
vLLM's rounded product lands on ``2^k``, it picks the scale ``2^k`` (and saturates the largest value at 448) where the
spec and this kernel pick ``2^(k+1)``.

Conventions of ``concat_and_cache_mla`` (vLLM ``csrc/cache_kernels.cu``): an entry is ``[kv_c (512) | k_pe (64)]``;
a slot ``-1`` (padding token) writes nothing; ``"auto"`` is a cast to the cache dtype. ``gather_cache``: request
``b``'s token ``seq_starts[b] + i`` goes to row ``cu_seq_lens[b] + i``, copied bit for bit;
``gather_and_maybe_dequant_cache`` offsets the block table by whole blocks (``seq_starts[b] // P``).

Rounding is done with integer arithmetic on the fp32 bits, not with Triton's casts, so that the bytes are the
same on a GPU and in the interpreter (whose fp32 -> bf16 cast truncates): divisions are ``div_rn`` (correctly
rounded, so ``amax / 448`` is the spec's fp32 scale byte for byte), an e8m0 scale is applied as an exact
multiplication by ``2^-e``, fp8 values are rounded to nearest even on a power-of-two quantum, then saturated and
packed into their bit fields; bf16 is rounded to nearest even on the bits. Every field is stored and loaded as
little-endian bytes, so no field needs an aligned address.

Traffic: every kernel is a copy with arithmetic on the way, one program per token: the writer reads ``D`` input
values and writes one record; ``gather_cache`` reads and writes ``T`` records.
"""

from __future__ import annotations

import functools
import math
import struct

import torch
import triton
import triton.language as tl

from mlaspec.spec import cache_layouts as cl
from mlaspec.spec.checks import Dims, boolean, finite_float, positive_int, positive_scale

__all__ = [
    "CACHE_DTYPES",
    "FORMATS",
    "concat_and_cache_mla",
    "dequantize_records",
    "gather_cache",
    "plan",
    "quantize_records",
    "read_tokens",
    "write_pages",
]

FLT_MIN = float(torch.finfo(torch.float32).tiny)
# name -> (mantissa bits, smallest normal exponent, exponent bias, largest finite)
FORMATS = {"e4m3": (3, -6, 7, 448.0), "e5m2": (2, -14, 15, 57344.0)}
# vLLM's kv_cache_dtype -> the layout concat_and_cache_mla writes ("auto": a cast, no layout)
CACHE_DTYPES = {
    "fp8": cl.FP8_PER_TENSOR,
    "fp8_e4m3": cl.FP8_PER_TENSOR,
    "fp8_e5m2": cl.FP8_E5M2_PER_TENSOR,
    "fp8_ds_mla": cl.FP8_DS_MLA_V32,
}
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int64, torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_code(x, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, MAXQ: tl.constexpr):
    """fp32 ``x`` -> the fp8 byte (int32) of ``round_to_nearest_even(x)``, saturated at ``±MAXQ``; NaN -> 0x7F."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80  # the sign bit, also for -0 and for values that round to 0
    ax = tl.minimum(tl.abs(x), MAXQ)  # saturate first: MAXQ is representable, rounding stays <= MAXQ
    # -- quantum = 2^(max(floor(log2 |x|), EMIN) - MBITS): the spacing of the format at |x| --------------------------
    e = tl.maximum(((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    inv_q = ((127 - (e - MBITS)) << 23).to(tl.float32, bitcast=True)
    quant = ((127 + (e - MBITS)) << 23).to(tl.float32, bitcast=True)
    # -- round |x| / quantum to an integer, ties to even (the fp32 add of 2^23 rounds to nearest even) -----------------
    n = ax * inv_q  # exact: a power-of-two scaling
    n = (n + 8388608.0) - 8388608.0
    y = n * quant  # the rounded magnitude, exactly representable in the fp8 format
    # -- pack: normal (exponent field, top MBITS of the mantissa) or subnormal (y / 2^(EMIN - MBITS)) ----------------
    yb = y.to(tl.int32, bitcast=True)
    ey = ((yb >> 23) & 0xFF) - 127
    normal = ((ey + BIAS) << MBITS) | ((yb >> (23 - MBITS)) & ((1 << MBITS) - 1))
    sub = (tl.minimum(y, 2.0**EMIN) * (2.0 ** (MBITS - EMIN))).to(tl.int32)  # clamped: only used below 2^EMIN
    code = tl.where(ey >= EMIN, normal, sub)
    code = tl.where(x != x, 0x7F, code)  # NaN stays NaN (0x7F is NaN in e4m3 and in e5m2)
    return code | sign


@triton.jit
def _fp8_value(code, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr):
    """fp8 byte (int32) -> its exact fp32 value (e4m3: 0x7F/0xFF NaN; e5m2: all-ones exponent inf/NaN)."""
    ebits: tl.constexpr = 7 - MBITS
    e = (code >> MBITS) & ((1 << ebits) - 1)
    mant = code & ((1 << MBITS) - 1)
    normal = (((e - BIAS + 127) << 23) | (mant << (23 - MBITS))).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * (2.0 ** (EMIN - MBITS))
    v = tl.where(e == 0, sub, normal)
    if MBITS == 3:  # e4m3 (fn): only S.1111.111 is NaN, no inf
        v = tl.where((e == 15) & (mant == 7), float("nan"), v)
    else:
        v = tl.where(e == 31, tl.where(mant == 0, float("inf"), float("nan")), v)
    return tl.where((code & 0x80) != 0, -v, v)


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bits (int32 in [0, 2^16)), rounded to nearest even; NaN -> 0x7FC0 with its sign."""
    b = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    r = tl.where(x != x, 0x7FC0 | ((b >> 16) & 0x8000), r)
    return r.to(tl.int32)


@triton.jit
def _fp16_bits(x):
    """fp32 -> fp16 bits (int32 in [0, 2^16)), rounded to nearest even (the cast's rounding)."""
    return x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _exp2i(k):
    """int32 ``k`` in ``[-149, 127]`` -> fp32 ``2^k`` exactly (a subnormal below ``2^-126``)."""
    normal = ((tl.maximum(k, -126) + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(k + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(k >= -126, normal, sub)


@triton.jit
def _ceil_log2_over(amax, MQ_EXP: tl.constexpr, MQ_MANT: tl.constexpr):
    """``ceil(log2(amax / max_q))`` (int32) for a normal fp32 ``amax > 0``, ``max_q = M 2^MQ_EXP`` (``M`` in
    ``[1, 2)``, mantissa field ``MQ_MANT``): ``amax = m 2^E`` gives ``E - MQ_EXP``, one more when ``m > M``. Zero
    and subnormal ``amax`` give a very negative exponent (below any floor)."""
    bits = amax.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 - MQ_EXP + ((bits & 0x7FFFFF) > MQ_MANT).to(tl.int32)


@triton.jit
def _e8m0_code(amax, bad, E_FLOOR: tl.constexpr, MQ_EXP: tl.constexpr, MQ_MANT: tl.constexpr):
    """Group ``amax`` (fp32, >= 0) -> the e8m0 byte (int32) ``clamp(ceil(log2(max(amax, floor) / max_q)) + 127)``.

    ``amax = m 2^E`` and ``max_q = M 2^MQ_EXP`` (``m, M`` in ``[1, 2)``): ``ceil(log2(amax / max_q))`` is
    ``E - MQ_EXP`` when ``m <= M`` and one more when ``m > M`` -- a comparison of the 23-bit mantissa fields. The
    floor's exponent ``E_FLOOR`` comes from the host (the spec's float64 rule); ``bad`` groups (NaN, inf) get 255.
    """
    e = _ceil_log2_over(amax, MQ_EXP, MQ_MANT)
    code = tl.minimum(tl.maximum(tl.maximum(e, E_FLOOR) + 127, 0), 255)
    return tl.where(bad, 255, code)


@triton.jit
def _e8m0_value(code):
    """e8m0 byte (int32) -> fp32 ``2^(code - 127)``; 255 is NaN."""
    return tl.where(code == 255, float("nan"), _exp2i(code - 127))


@triton.jit
def _le_bytes(bits, N: tl.constexpr, NB: tl.constexpr):
    """``[N]`` int32 words -> their ``[N * NB]`` little-endian bytes (uint8)."""
    shift = 8 * tl.arange(0, NB)
    return tl.reshape((bits[:, None] >> shift[None, :]) & 0xFF, (N * NB,)).to(tl.uint8)


@triton.jit
def _le_load(ptr, N: tl.constexpr, NB: tl.constexpr, mask):
    """``N`` little-endian ``NB``-byte words at ``ptr`` -> ``[N]`` int32 (0 where not ``mask``)."""
    at = ptr + tl.arange(0, N) * NB
    w = tl.zeros((N,), dtype=tl.int32)
    for k in tl.static_range(NB):
        w = w | (tl.load(at + k, mask=mask, other=0).to(tl.int32) << (8 * k))
    return w


@triton.jit
def _record_at(slot, j, page_bytes, P: tl.constexpr, TOKEN_BYTES: tl.constexpr, SPLIT: tl.constexpr):
    """Byte offset, in the page array, of byte ``j`` of the record at ``slot = block * P + off``."""
    blk, off = slot // P, slot % P
    if SPLIT > 0:  # data row at off * SPLIT, the rest of the record in the scale rows after all P data rows
        at = tl.where(j < SPLIT, off * SPLIT + j, P * SPLIT + off * (TOKEN_BYTES - SPLIT) + (j - SPLIT))
    else:
        at = off * TOKEN_BYTES + j
    return blk * page_bytes + at


@triton.jit
def _write_records_kernel(
    X_A,
    X_B,
    SLOTS,
    CACHE,
    scale,
    page_bytes,
    stride_a,
    stride_b,  # entries [T, D_A] and [T, D_B]; CACHE pages
    MODE: tl.constexpr,
    P: tl.constexpr,
    SPLIT: tl.constexpr,  # MODE 0: "auto" cast; 1: quantize into bytes
    POW2: tl.constexpr,  # fp32 group scales rounded up to powers of two (the spec's pow2_scales)
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    TOKEN_BYTES: tl.constexpr,
    A_OFF: tl.constexpr,
    B_OFF: tl.constexpr,
    B_KIND: tl.constexpr,
    SCALES: tl.constexpr,
    GROUP: tl.constexpr,
    G: tl.constexpr,
    S_OFF: tl.constexpr,
    SMAX: tl.constexpr,
    E_FLOOR: tl.constexpr,
    MQ_EXP: tl.constexpr,
    MQ_MANT: tl.constexpr,
    PAD_OFF: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    BIAS: tl.constexpr,
    MAXQ: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:  # -1: a padding token writes nothing
        a = tl.arange(0, BLOCK_A)
        a_ok = a < D_A
        x = tl.load(X_A + t * stride_a + a, mask=a_ok, other=0.0)  # [BLOCK_A], the input dtype
        b = tl.arange(0, BLOCK_B)
        b_ok = b < D_B
        if MODE == 0:  # "auto": a cast to the cache dtype (none when the dtypes agree), kv_c then k_pe
            row = CACHE + slot * (D_A + D_B)
            tl.store(row + a, x.to(CACHE.dtype.element_ty), mask=a_ok)
            xb = tl.load(X_B + t * stride_b + b, mask=b_ok, other=0.0)
            tl.store(row + D_A + b, xb.to(CACHE.dtype.element_ty), mask=b_ok)
        else:
            x = x.to(tl.float32)
            # -- the A field: x / scale (per tensor, or per group of GROUP values), rounded to fp8 --------------------
            if SCALES == 0:  # per-tensor: every value divided by the one fp32 scale, saturated
                y = tl.math.div_rn(x, scale)
            else:
                NG: tl.constexpr = BLOCK_A // GROUP  # groups past G (masked input) are zeros and are not stored
                SB: tl.constexpr = 4 if SCALES == 1 else 1  # bytes a scale
                xg = tl.reshape(x, (NG, GROUP))
                amax = tl.max(tl.abs(xg), axis=1)  # [NG], exact
                if SCALES == 1 and POW2:  # fp32 scale 2^max(ceil(log2(amax / SMAX)), E_FLOOR): an exact division
                    s = _exp2i(tl.maximum(_ceil_log2_over(amax, MQ_EXP, MQ_MANT), E_FLOOR))
                    s = tl.where(amax < float("inf"), s, amax)  # inf / NaN amax: the scale too, as the spec's
                    yg = tl.math.div_rn(xg, s[:, None])
                    s_bytes = _le_bytes(s.to(tl.int32, bitcast=True), NG, 4)
                elif SCALES == 1:  # fp32 scale amax / SMAX (correctly rounded), FLT_MIN floor
                    s = tl.maximum(tl.math.div_rn(amax, SMAX), 1.1754943508222875e-38)
                    yg = tl.math.div_rn(xg, s[:, None])
                    s_bytes = _le_bytes(s.to(tl.int32, bitcast=True), NG, 4)
                else:  # e8m0 scale 2^e: x * 2^-e is exact; NaN / inf in a group makes the group NaN
                    bad = tl.max(((xg != xg) | (tl.abs(xg) == float("inf"))).to(tl.int32), axis=1) > 0
                    code = _e8m0_code(amax, bad, E_FLOOR, MQ_EXP, MQ_MANT)
                    yg = tl.where(bad[:, None], float("nan"), xg * _exp2i(127 - code)[:, None])
                    yg = tl.where(xg != xg, xg, yg)  # a NaN value keeps its sign, as the spec's x / NaN does
                    s_bytes = code.to(tl.uint8)
                y = tl.reshape(yg, (BLOCK_A,))
                k = tl.arange(0, NG * SB)
                tl.store(
                    CACHE + _record_at(slot, S_OFF + k, page_bytes, P, TOKEN_BYTES, SPLIT), s_bytes, mask=k < G * SB
                )
            q = _fp8_code(y, MBITS, EMIN, BIAS, MAXQ).to(tl.uint8)
            tl.store(CACHE + _record_at(slot, A_OFF + a, page_bytes, P, TOKEN_BYTES, SPLIT), q, mask=a_ok)
            # -- the B field: fp8 under the per-tensor scale, or bf16 / fp16 verbatim ---------------------------------
            if B_KIND == 1:
                xb = tl.load(X_B + t * stride_b + b, mask=b_ok, other=0.0).to(tl.float32)
                qb = _fp8_code(tl.math.div_rn(xb, scale), MBITS, EMIN, BIAS, MAXQ).to(tl.uint8)
                tl.store(CACHE + _record_at(slot, B_OFF + b, page_bytes, P, TOKEN_BYTES, SPLIT), qb, mask=b_ok)
            elif B_KIND >= 2:
                xb = tl.load(X_B + t * stride_b + b, mask=b_ok, other=0.0).to(tl.float32)
                bits = _bf16_bits(xb) if B_KIND == 2 else _fp16_bits(xb)
                k = tl.arange(0, 2 * BLOCK_B)
                tl.store(
                    CACHE + _record_at(slot, B_OFF + k, page_bytes, P, TOKEN_BYTES, SPLIT),
                    _le_bytes(bits, BLOCK_B, 2),
                    mask=k < 2 * D_B,
                )
            if PAD > 0:  # zero padding bytes
                k = tl.arange(0, BLOCK_PAD)
                tl.store(
                    CACHE + _record_at(slot, PAD_OFF + k, page_bytes, P, TOKEN_BYTES, SPLIT),
                    tl.zeros((BLOCK_PAD,), dtype=tl.uint8),
                    mask=k < PAD,
                )


@triton.jit
def _dequantize_kernel(
    RAW,
    OUT,
    scale,  # records [T, TOKEN_BYTES] uint8, whole (not in pages); out [T, D_A + D_B] fp32
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    TOKEN_BYTES: tl.constexpr,
    A_OFF: tl.constexpr,
    B_OFF: tl.constexpr,
    B_KIND: tl.constexpr,
    SCALES: tl.constexpr,
    GROUP: tl.constexpr,
    G: tl.constexpr,
    S_OFF: tl.constexpr,
    SMAX: tl.constexpr,
    E_FLOOR: tl.constexpr,
    MQ_EXP: tl.constexpr,
    MQ_MANT: tl.constexpr,
    PAD_OFF: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    BIAS: tl.constexpr,
    MAXQ: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    rec = RAW + t * TOKEN_BYTES
    out = OUT + t * (D_A + D_B)
    a = tl.arange(0, BLOCK_A)
    a_ok = a < D_A
    v = _fp8_value(tl.load(rec + A_OFF + a, mask=a_ok, other=0).to(tl.int32), MBITS, EMIN, BIAS)
    if SCALES == 0:  # per-tensor: fp8 value x scale, one fp32 rounding
        v = v * scale
    else:  # group g of GROUP values x its scale (fp32 bytes, or e8m0 2^(byte - 127): exact)
        NG: tl.constexpr = BLOCK_A // GROUP
        g = tl.arange(0, NG)
        if SCALES == 1:
            s = _le_load(rec + S_OFF, NG, 4, g < G).to(tl.float32, bitcast=True)
        else:
            s = _e8m0_value(tl.load(rec + S_OFF + g, mask=g < G, other=127).to(tl.int32))
        v = tl.reshape(tl.reshape(v, (NG, GROUP)) * s[:, None], (BLOCK_A,))
    tl.store(out + a, v, mask=a_ok)
    b = tl.arange(0, BLOCK_B)
    b_ok = b < D_B
    if B_KIND == 1:
        vb = _fp8_value(tl.load(rec + B_OFF + b, mask=b_ok, other=0).to(tl.int32), MBITS, EMIN, BIAS) * scale
        tl.store(out + D_A + b, vb, mask=b_ok)
    elif B_KIND == 2:  # bf16 widened exactly
        tl.store(out + D_A + b, (_le_load(rec + B_OFF, BLOCK_B, 2, b_ok) << 16).to(tl.float32, bitcast=True), mask=b_ok)
    elif B_KIND == 3:  # fp16 widened exactly
        vb = _le_load(rec + B_OFF, BLOCK_B, 2, b_ok).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        tl.store(out + D_A + b, vb, mask=b_ok)


@triton.jit
def _gather_cache_kernel(
    CACHE,
    TABLE,
    CU,
    STARTS,
    OUT,  # cache [NB * P, W] words, table [B, max_blocks], cu [B + 1], starts [B]
    W,
    stride_tb,
    P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    ALIGN_STARTS: tl.constexpr,
):
    b, pid = tl.program_id(0), tl.program_id(1)
    first = tl.load(CU + b)
    n = tl.load(CU + b + 1) - first
    start = 0
    if HAS_STARTS:
        start = tl.load(STARTS + b)
    if ALIGN_STARTS:  # gather_and_maybe_dequant_cache: the block table offset by whole blocks
        start = start // P * P
    i = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = i < n
    pos = start + i  # logical position within the request
    page = tl.load(TABLE + b.to(tl.int64) * stride_tb + pos // P, mask=ok, other=0).to(tl.int64)
    src = (page * P + pos % P) * W
    dst = (first + i).to(tl.int64) * W
    for w0 in range(0, W, BLOCK_W):  # bit-for-bit copy of each record
        w = w0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (w < W)[None, :]
        x = tl.load(CACHE + src[:, None] + w[None, :], mask=m)
        tl.store(OUT + dst[:, None] + w[None, :], x, mask=m)


@triton.jit
def _read_tokens_kernel(
    PAGES,
    SLOTS,
    OUT,
    VALID,
    page_bytes,  # pages [NB, page_bytes] uint8, slots [T], out [T, TOKEN_BYTES]
    P: tl.constexpr,
    TOKEN_BYTES: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    j = tl.arange(0, BLOCK)
    j_ok = j < TOKEN_BYTES
    keep = j_ok & ((j * 0 + slot) >= 0)  # the slot's validity as a vector (the interpreter wants one)
    at = _record_at(tl.maximum(slot, 0), j, page_bytes, P, TOKEN_BYTES, SPLIT)
    x = tl.load(PAGES + at, mask=keep, other=0)
    tl.store(OUT + t * TOKEN_BYTES + j, x, mask=j_ok)
    tl.store(VALID + t, (slot >= 0).to(tl.int8))


# ---------------------------------------------------------------------------------------------------------------
# Host: a layout's plan, argument checks, launchers
# ---------------------------------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _layout(layout: object) -> cl.CacheLayout:
    if isinstance(layout, str):
        if layout not in cl.LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(cl.LAYOUTS)}, got {layout!r}")
        return cl.LAYOUTS[layout]
    if not isinstance(layout, cl.CacheLayout):
        raise TypeError(f"layout must be a CacheLayout or a layout name, got {type(layout).__name__}")
    return layout


def _float32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def plan(layout: cl.CacheLayout | str) -> dict:
    """The constants the writer and reader kernels take for ``layout``, read off its fields (module docstring).

    Raises:
        ValueError: a layout these kernels cannot express (more than two value fields, a first value field that is
            not fp8 from element 0, scales other than per-tensor / fp32 / e8m0, a field across the split, ...).
    """
    return dict(_plan(_layout(layout)))


@functools.cache
def _plan(lay: cl.CacheLayout) -> dict:
    name = lay.name

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"layout {name}: {what}; the triton cache kernels cannot write it")

    values = lay.value_fields
    need(1 <= len(values) <= 2, f"{len(values)} value fields (1 or 2 supported)")
    fa = values[0]
    need(fa.dtype in FORMATS and fa.elements[0] == 0, "the first value field must be fp8 from entry element 0")
    d_a = fa.elements[1]
    kinds = {"per_tensor": 0, "fp32": 1, "e8m0": 2}
    need(lay.scale_rule.kind in kinds, f"scale rule {lay.scale_rule.kind!r}")
    scales = kinds[lay.scale_rule.kind]
    consts = dict(
        D_A=d_a,
        D_B=0,
        BLOCK_A=_pow2(d_a),
        BLOCK_B=1,
        TOKEN_BYTES=lay.token_bytes,
        A_OFF=fa.offset,
        B_OFF=0,
        B_KIND=0,
        SCALES=scales,
        GROUP=_pow2(d_a),
        G=0,
        S_OFF=0,
        SMAX=1.0,
        E_FLOOR=0,
        MQ_EXP=0,
        MQ_MANT=0,
        PAD_OFF=0,
        PAD=0,
        BLOCK_PAD=1,
    )
    used = {fa.name}
    if scales:
        need(fa.group is not None and fa.scale_field is not None, f"field {fa.name} has no group scales")
        sf = lay.field(fa.scale_field)
        need(sf.dtype == ("fp32" if scales == 1 else "e8m0"), f"scale field {sf.name} is {sf.dtype}")
        need(
            fa.group & (fa.group - 1) == 0 and sf.count * fa.group == d_a,
            f"{sf.count} scales of {fa.group} values (a power of two) must cover {d_a}",
        )
        consts.update(GROUP=fa.group, G=sf.count, S_OFF=sf.offset, SMAX=float(lay.scale_rule.max_q))
        used.add(sf.name)
        mq = lay.scale_rule.max_q
        need(float(torch.tensor(mq, dtype=torch.float32)) == mq and mq > 0, "max_q must be an fp32 value")
        if scales == 2:
            need(lay.scale_rule.amax_floor >= FLT_MIN, "the e8m0 amax floor must be a normal fp32 value")
        # the exponent floor, the spec's float64 ceiling: e8m0's ceil(log2(floor / max_q)); for fp32 scales, the
        # power-of-two rule's (the writer's POW2, the spec's pow2_scales) ceil(log2(POW2_SCALE_FLOOR)) = -13
        m, e = math.frexp(lay.scale_rule.amax_floor / mq if scales == 2 else cl.POW2_SCALE_FLOOR)
        mq_bits = _float32_bits(mq)
        consts.update(
            E_FLOOR=e - 1 if m == 0.5 else e, MQ_EXP=((mq_bits >> 23) & 0xFF) - 127, MQ_MANT=mq_bits & 0x7FFFFF
        )
    else:
        need(fa.group is None, f"field {fa.name} has groups under a per-tensor rule")
    if len(values) == 2:
        fb = values[1]
        need(fb.elements[0] == d_a, f"field {fb.name} must follow {fa.name} in the entry")
        if fb.dtype == fa.dtype and fb.group is None and scales == 0:
            b_kind = 1
        else:
            need(fb.dtype in ("bf16", "fp16") and fb.group is None, f"field {fb.name} must be bf16, fp16 or fp8")
            b_kind = 2 if fb.dtype == "bf16" else 3
        d_b = fb.elements[1] - fb.elements[0]
        consts.update(D_B=d_b, BLOCK_B=_pow2(d_b), B_OFF=fb.offset, B_KIND=b_kind)
        used.add(fb.name)
    need(lay.entry_dim == d_a + consts["D_B"], f"value fields cover {d_a + consts['D_B']} of {lay.entry_dim}")
    pads = [f for f in lay.fields if f.dtype == "pad"]
    need(len(pads) <= 1, "more than one pad field")
    if pads:
        consts.update(PAD_OFF=pads[0].offset, PAD=pads[0].nbytes, BLOCK_PAD=_pow2(pads[0].nbytes))
        used.add(pads[0].name)
    need(used == {f.name for f in lay.fields}, f"fields {sorted({f.name for f in lay.fields} - used)} not understood")
    if lay.split_at is not None:
        need(0 < lay.split_at < lay.token_bytes, f"split_at {lay.split_at}")
        crossing = [f.name for f in lay.fields if f.offset < lay.split_at < f.end]
        need(not crossing, f"fields {crossing} straddle split_at={lay.split_at}")
    fmt = FORMATS[fa.dtype]
    consts.update(MBITS=fmt[0], EMIN=fmt[1], BIAS=fmt[2], MAXQ=fmt[3])
    return consts


def _scale(layout: cl.CacheLayout, scale: object) -> float:
    """The per-tensor scale as vLLM keeps it (fp32), 1.0 for layouts with their own scales."""
    if layout.scale_rule.kind != "per_tensor":
        if scale is not None:
            raise ValueError(f"scale must be None for {layout.name}: its scales are per group and stored in the bytes")
        return 1.0
    if scale is None:
        raise ValueError(f"scale is required for the per-tensor layout {layout.name}")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must hold one value, got shape {list(scale.shape)}")
    else:
        finite_float("scale", scale)
    s = float(torch.as_tensor(scale, dtype=torch.float32).reshape(()))  # vLLM keeps k_scale in fp32
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"scale must be positive and finite, got {s}")
    return s


def _slots(dims: Dims, name: str, slots: object, total: int, *, distinct: bool, dtypes=_INDEX_DTYPES) -> None:
    """``slots [T]``: -1 or in ``[0, total)``, each at most once when ``distinct`` (checked on the host)."""
    dims.tensor(name, slots, ("T",), dtypes)
    s = slots.detach().to("cpu", torch.int64)
    if bool(((s < -1) | (s >= total)).any()):
        raise ValueError(f"{name} must be -1 or in [0, NB * P = {total}), got {s.tolist()}")
    keep = s[s >= 0]
    if distinct and keep.numel() != torch.unique(keep).numel():
        raise ValueError(f"{name} must not repeat a slot (the writes would race), got {s.tolist()}")


def _write(
    x_a: torch.Tensor,
    x_b: torch.Tensor,
    slots: torch.Tensor,
    cache: torch.Tensor,
    consts: dict,
    *,
    scale: float,
    mode: int,
    p: int,
    page_bytes: int,
    split: int,
    pow2: bool = False,
) -> None:
    """Launch the writer: entry ``t``'s ``[x_a[t] | x_b[t]]`` into the record at ``slots[t]`` of ``cache``
    (``pow2``: power-of-two fp32 group scales)."""
    t = x_a.shape[0]
    if t == 0:
        return
    dev = cache.device
    x_a, x_b = (x.to(dev) if x.stride(-1) == 1 else x.to(dev).contiguous() for x in (x_a, x_b))
    _write_records_kernel[(t,)](
        x_a,
        x_b,
        slots.to(device=dev, dtype=torch.int64).contiguous(),
        cache,
        scale,
        page_bytes,
        x_a.stride(0),
        x_b.stride(0),
        MODE=mode,
        P=p,
        SPLIT=split,
        POW2=int(pow2),
        **consts,
        num_warps=4,
    )


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    scale: float | torch.Tensor | None = None,
    pow2_scales: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write ``[kv_c | k_pe]`` into the slots of a paged cache (see the module docstring).

    Args:
        kv_c: ``[T, D_v]`` float (512); ``k_pe``: ``[T, D_rope]`` float (64).
        kv_cache: ``[NB, P, Lkv + D_rope]`` float (``"auto"``) or uint8 ``[NB, P, token_bytes]``.
        slot_mapping: ``[T]`` int, ``-1`` skipped (not range-checked: vLLM's hot path).
        kv_cache_dtype: ``"auto"`` or a key of :data:`CACHE_DTYPES` (``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``,
            ``"fp8_ds_mla"``).
        scale: the per-tensor scale (fp8 per-tensor only).
        pow2_scales: ``"fp8_ds_mla"`` only: power-of-two group scales ``2^ceil(log2(max(amax / 448, 1e-4)))``
            (vLLM after PR #49435) instead of vLLM 0.33's raw ``amax / 448``.
        out: write into this contiguous tensor (vLLM's in-place form); default a copy of ``kv_cache``.

    Returns:
        the written cache.
    """
    if kv_cache_dtype != "auto" and kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if boolean("pow2_scales", pow2_scales) and kv_cache_dtype != "fp8_ds_mla":
        raise ValueError(f"pow2_scales applies only to kv_cache_dtype='fp8_ds_mla', not {kv_cache_dtype!r}")
    T, d_v = kv_c.shape
    d_r = k_pe.shape[1]
    if k_pe.shape[0] != T or slot_mapping.shape != (T,):
        raise ValueError(
            f"kv_c [T, Lkv], k_pe [T, D_rope] and slot_mapping [T] disagree: {list(kv_c.shape)}, "
            f"{list(k_pe.shape)}, {list(slot_mapping.shape)}"
        )
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [NB, P, width], got {list(kv_cache.shape)}")
    nb, p = kv_cache.shape[:2]
    if kv_cache_dtype == "auto":
        if kv_cache.shape[2] != d_v + d_r:
            raise ValueError(f"kv_cache must be [NB, P, {d_v + d_r}] for 'auto', got {list(kv_cache.shape)}")
        if scale is not None:
            raise ValueError("scale must be None for kv_cache_dtype='auto'")
        # a cast: only the widths matter (the rest of the constants is any layout's, unused)
        consts, s, mode = (
            {**plan(cl.FP8_PER_TENSOR), "D_A": d_v, "D_B": d_r, "BLOCK_A": _pow2(d_v), "BLOCK_B": _pow2(d_r)},
            1.0,
            0,
        )
    else:
        layout = CACHE_DTYPES[kv_cache_dtype]
        if kv_cache_dtype == "fp8_ds_mla":  # as the spec: the RoPE in the input dtype, vLLM's k_scale not read
            if k_pe.dtype == torch.float16:
                layout = cl.FP8_DS_MLA_V32_FP16
            if scale is not None:
                positive_scale("scale", scale)
                scale = None
        consts, s, mode = plan(layout), _scale(layout, scale), 1
        if (d_v, d_r) != (consts["D_A"], consts["D_B"]):
            raise ValueError(
                f"{kv_cache_dtype} writes {consts['D_A']} + {consts['D_B']} wide entries, got kv_c {d_v} and k_pe {d_r}"
            )
        if kv_cache.dtype != torch.uint8 or kv_cache.shape[2] != layout.token_bytes:
            raise ValueError(
                f"kv_cache must be uint8 [NB, P, {layout.token_bytes}] for {kv_cache_dtype}, "
                f"got {kv_cache.dtype} {list(kv_cache.shape)}"
            )
    if out is not None and (out.shape != kv_cache.shape or out.dtype != kv_cache.dtype or not out.is_contiguous()):
        raise ValueError(
            f"out must be a contiguous {kv_cache.dtype} {list(kv_cache.shape)}, got {out.dtype} {list(out.shape)}"
        )
    new = kv_cache.clone(memory_format=torch.contiguous_format) if out is None else out
    page_bytes = p * kv_cache.shape[2]
    _write(
        kv_c, k_pe, slot_mapping, new, consts, scale=s, mode=mode, p=p, page_bytes=page_bytes, split=0, pow2=pow2_scales
    )
    return new


def write_pages(
    pages: torch.Tensor,
    entries: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: cl.CacheLayout | str,
    block_size: int,
    *,
    scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize ``entries [T, D]`` into the records at ``slot_mapping [T]`` (``-1`` skipped) of page blocks
    ``pages [NB, page_bytes(layout, block_size)]`` uint8: :func:`mlaspec.spec.cache_layouts.write_pages`.

    Split layouts (V4) get their data and scale rows where the page puts them; alignment padding past
    ``P * token_bytes`` is left alone. ``out``: write into this contiguous tensor (default: a copy of ``pages``).

    Raises:
        TypeError / ValueError: naming the argument -- wrong dtype or shape, a slot out of range or repeated, a
            per-tensor ``scale`` missing (or given for a layout with its own scales).
    """
    lay = _layout(layout)
    p = positive_int("block_size", block_size)
    consts = plan(lay)
    s = _scale(lay, scale)
    pb = cl.page_bytes(lay, p)
    dims = Dims()
    dims.tensor("pages", pages, ("NB", pb), (torch.uint8,))
    dims.tensor("entries", entries, ("T", lay.entry_dim), _INPUT_DTYPES)
    _slots(dims, "slot_mapping", slot_mapping, dims["NB"] * p, distinct=True)
    if out is not None and (out.shape != pages.shape or out.dtype != torch.uint8 or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous uint8 {list(pages.shape)}, got {out.dtype} {list(out.shape)}")
    new = pages.clone(memory_format=torch.contiguous_format) if out is None else out
    d_a = consts["D_A"]
    _write(
        entries[:, :d_a],
        entries[:, d_a:] if consts["D_B"] else entries,
        slot_mapping,
        new,
        consts,
        scale=s,
        mode=1,
        p=p,
        page_bytes=pb,
        split=lay.split_at or 0,
    )
    return new


def quantize_records(entries: torch.Tensor, layout: cl.CacheLayout | str, *, scale=None) -> torch.Tensor:
    """``[T, D]`` entries (fp16/bf16/fp32) -> ``[T, token_bytes]`` uint8 records of ``layout``, each record whole
    (the spec's :func:`~mlaspec.spec.cache_layouts.quantize`; page placement is :func:`write_pages`'s)."""
    lay = _layout(layout)
    consts = plan(lay)
    s = _scale(lay, scale)
    Dims().tensor("entries", entries, ("T", lay.entry_dim), _INPUT_DTYPES)
    t = entries.shape[0]
    records = torch.zeros(t, lay.token_bytes, dtype=torch.uint8, device=entries.device)
    d_a = consts["D_A"]
    _write(
        entries[:, :d_a],
        entries[:, d_a:] if consts["D_B"] else entries,
        torch.arange(t, device=entries.device),
        records,
        consts,
        scale=s,
        mode=1,
        p=1,
        page_bytes=lay.token_bytes,
        split=0,
    )
    return records


def dequantize_records(raw: torch.Tensor, layout: cl.CacheLayout | str, *, scale=None) -> torch.Tensor:
    """``[T, token_bytes]`` uint8 records of ``layout`` -> ``[T, D]`` float32 (``decode(q) * s``, one rounding; exact
    for e8m0 scales). Pad bytes are not read."""
    lay = _layout(layout)
    consts = plan(lay)
    s = _scale(lay, scale)
    Dims().tensor("raw", raw, ("T", lay.token_bytes), (torch.uint8,))
    raw = raw.contiguous()
    t = raw.shape[0]
    out = torch.empty(t, lay.entry_dim, dtype=torch.float32, device=raw.device)
    if t:
        _dequantize_kernel[(t,)](raw, out, s, **consts, num_warps=4)  # takes the whole plan, uses what it needs
    return out


def gather_cache(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    batch_size: int | None = None,
    seq_starts: torch.Tensor | None = None,
    *,
    kernel: str = "cp_gather_cache",
    block_t: int = 16,
) -> torch.Tensor:
    """Gather each request's entries into packed rows, bit for bit (see the module docstring).

    Args:
        kv_cache: ``[NB, P, *entry]`` any dtype (token-interleaved records: a split V4 page is not one).
        block_table: ``[B, max_blocks]`` int.
        cu_seq_lens: ``[B + 1]`` int.
        batch_size: ``B`` (must equal ``block_table.shape[0]`` when given).
        seq_starts: optional ``[B]`` int, the first logical position read per request.
        kernel: ``"cp_gather_cache"`` or ``"gather_and_maybe_dequant_cache"`` (block-aligned starts).

    Returns:
        ``entries [T, *entry]``, the cache's dtype.
    """
    if kernel not in ("cp_gather_cache", "gather_and_maybe_dequant_cache"):
        raise ValueError(f"kernel must be 'cp_gather_cache' or 'gather_and_maybe_dequant_cache', got {kernel!r}")
    B = block_table.shape[0]
    if batch_size is not None and batch_size != B:
        raise ValueError(f"batch_size must equal block_table.shape[0]={B}, got {batch_size}")
    P = kv_cache.shape[1]
    dev = kv_cache.device
    cu = cu_seq_lens.to(device=dev, dtype=torch.int32).contiguous()
    starts = None if seq_starts is None else seq_starts.to(device=dev, dtype=torch.int32).contiguous()
    if kernel == "gather_and_maybe_dequant_cache" and starts is not None and bool((starts % P != 0).any()):
        raise ValueError(
            f"seq_starts must be multiples of block_size P={P} for gather_and_maybe_dequant_cache, "
            f"got {starts.tolist()}"
        )
    lens = cu[1:] - cu[:-1]
    total = int(cu[-1]) if cu.numel() else 0
    out = torch.empty(total, *kv_cache.shape[2:], dtype=kv_cache.dtype, device=dev)
    if total == 0 or B == 0:
        return out
    cache = kv_cache.contiguous()
    row_bytes = cache[0, 0].numel() * cache.element_size()
    word = torch.int32 if row_bytes % 4 == 0 else (torch.int16 if row_bytes % 2 == 0 else torch.uint8)
    src, dst = cache.view(-1).view(word), out.view(-1).view(word)
    w = row_bytes // src.element_size()
    table = block_table.to(device=dev, dtype=torch.int32).contiguous()
    grid = (B, triton.cdiv(int(lens.max()), block_t))
    _gather_cache_kernel[grid](
        src,
        table,
        cu,
        starts if starts is not None else cu,
        dst,
        w,
        table.stride(0),
        P=P,
        BLOCK_T=block_t,
        BLOCK_W=min(1024, triton.next_power_of_2(w)),
        HAS_STARTS=starts is not None,
        ALIGN_STARTS=kernel == "gather_and_maybe_dequant_cache",
        num_warps=4,
    )
    return out


def read_tokens(
    pages: torch.Tensor, layout: cl.CacheLayout | str, block_size: int, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Records ``[T, token_bytes]`` uint8 at ``slots`` out of page blocks ``[NB, page_bytes]``, ``-1`` -> zeros
    (any layout, split rows included).

    Returns ``(raw, valid)``: ``valid [N]`` bool marks ``slots >= 0``.
    """
    lay = _layout(layout)
    p = positive_int("block_size", block_size)
    pb = cl.page_bytes(lay, p)
    dims = Dims()
    dims.tensor("pages", pages, ("NB", pb), (torch.uint8,))
    _slots(dims, "slots", slots, dims["NB"] * p, distinct=False, dtypes=(*_INDEX_DTYPES, torch.int16))
    n = slots.shape[0]
    pages = pages.contiguous()
    raw = torch.empty(n, lay.token_bytes, dtype=torch.uint8, device=pages.device)
    valid = torch.empty(n, dtype=torch.int8, device=pages.device)
    if n:
        _read_tokens_kernel[(n,)](
            pages,
            slots.to(device=pages.device, dtype=torch.int64).contiguous(),
            raw,
            valid,
            pb,
            P=p,
            TOKEN_BYTES=lay.token_bytes,
            SPLIT=lay.split_at or 0,
            BLOCK=_pow2(lay.token_bytes),
            num_warps=4,
        )
    return raw, valid.bool()
