"""e4m3 bytes to bf16 without the slow conversion: exact, NaN kept, through fp32.

Every e4m3 value is a bf16 value (3 mantissa bits of bf16's 7, exponents 2^-9 .. 2^8 inside bf16's range), so the
conversion is exact and only its cost is in question. Triton (3.6-3.9) converts e4m3 to bf16 on Hopper as
``cvt.rn.f16x2.e4m3x2`` (a pair) and then ``cvt.bf16.f16`` once a value, which compiles to ``F2F``, the conversion
unit's instruction, at a fraction of the arithmetic rate: the fp8 decodes, which dequantize every key tile on
chip, spent their time there. Here the fp16 pair is widened to fp32 (``cvt.f32.f16``: ``HADD2.F32``, exact) and
packed to bf16 (``cvt.rn.bf16x2.f32``: one ``F2FP`` a pair, exact since the value is a bf16), four values in 8
instructions, none of them ``F2F``. NaN and the subnormals are the hardware's conversions', as before.

Measured on an H200 (2026-11-29, evening; CUDA-graph replays, ``benchmarks/decode_tune.py --fp8``; the kernels
otherwise unchanged): the 128-head decode over vLLM's per-tensor fp8 cache B1 64K 77.3 -> 60.5 us, B64 8K 493 ->
372 us; 16 heads B64 4K 134.7 -> 103.0 us. Moving the bytes into bf16's fields with integer instructions instead
(``prmt``/shifts, a ``mul.rn.bf16x2`` by 2^120, NaN by a carry trick) measured between the two (70.3 / 448 / 121
us): it traded ``F2F`` for three times as many integer instructions.

:func:`e4m3_to` takes ``uint8`` bytes (or ``float8e4nv``) and returns their values in q's dtype; to fp16, or under the
interpreter (``TRITON_INTERPRET=1``, CPU tensors, no PTX), by Triton's own conversion (to fp16 one instruction a
pair already). ``tests/test_impl_fp8.py`` checks all 256 bytes against torch's ``float8_e4m3fn`` on a GPU. The Gluon
kernels take the same instructions (:data:`E4M3_TO_BF16`, :data:`CONSTRAINTS`, :data:`PACK`, :data:`USE_ASM`).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["CONSTRAINTS", "E4M3_TO_BF16", "PACK", "USE_ASM", "e4m3_round", "e4m3_to"]

USE_ASM = tl.constexpr(not triton.knobs.runtime.interpret)  # the interpreter runs no PTX
PACK = tl.constexpr(4)  # bytes a call, fixed by the asm: one register in ($2), two bf16 pairs out ($0: bytes 0-1)
CONSTRAINTS = tl.constexpr("=r,=r,r")
E4M3_TO_BF16 = tl.constexpr(
    """{
    .reg .b16 lo, hi, x0, x1, x2, x3;
    .reg .b32 h0, h1;
    .reg .f32 f0, f1, f2, f3;
    mov.b32 {lo, hi}, $2;
    cvt.rn.f16x2.e4m3x2 h0, lo;
    cvt.rn.f16x2.e4m3x2 h1, hi;
    mov.b32 {x0, x1}, h0;
    mov.b32 {x2, x3}, h1;
    cvt.f32.f16 f0, x0;
    cvt.f32.f16 f1, x1;
    cvt.f32.f16 f2, x2;
    cvt.f32.f16 f3, x3;
    cvt.rn.bf16x2.f32 $0, f1, f0;
    cvt.rn.bf16x2.f32 $1, f3, f2;
    }"""
)  # bytes 0-1 and 2-3 to two fp16 pairs, each value to fp32, each pair to bf16 (the first value in the low half)


@triton.jit
def e4m3_to(x, dtype: tl.constexpr):
    """The e4m3 values whose bytes ``x`` holds (``uint8``/``int8``/``float8e4nv``, any shape) in ``dtype``: to bf16 by
    :data:`E4M3_TO_BF16`, otherwise (and under the interpreter) by Triton's conversion. Exact either way."""
    if USE_ASM and dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(
            E4M3_TO_BF16, CONSTRAINTS, [x.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=PACK
        )
    else:
        return x.to(tl.float8e4nv, bitcast=True).to(dtype)


@triton.jit
def e4m3_round(p):
    """fp32 ``p`` in ``[0, 448]`` rounded to the nearest e4m3 value (ties to even), as fp32: what
    ``cvt.rn.satfinite.e4m3x2.f32`` makes of it, so that converting the result to ``float8e4nv`` loses nothing.

    Written out because Triton's interpreter (3.9) rounds fp32 to e4m3 wrongly where a value rounds up to the next
    power of two (0.4867 -> 0.25; ``tests/test_impl_fp8.py``). Normal values (``>= 2^-6``) keep 3 mantissa bits: the
    fp32 bits rounded at bit 20, the carry running into the exponent; below, e4m3's subnormals are multiples of
    ``2^-9``: ``p * 2^9`` rounded to an integer by adding and taking away ``2^23`` (exact in fp32 below ``2^23``)."""
    bits = p.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # round to nearest even at bit 20, clear bits 0-19
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = ((p * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    return tl.where(p < 0.015625, subnormal, normal)
