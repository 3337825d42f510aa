"""``mlaspec.impl.fp8.e4m3_to``: every byte's e4m3 value, exactly, in bf16 and fp16, NaN bytes to NaN; and
``e4m3_round``, fp32 to the nearest e4m3 value as the hardware's ``cvt.rn.satfinite`` rounds. On a GPU
the bf16 path is the inline PTX (through fp16 and fp32, :mod:`mlaspec.impl.fp8`); under the interpreter Triton's
conversion, so there only the sm_90 compile tests (``tests/test_impl_pipelining.py``) guard the PTX."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaspec.impl.fp8 import e4m3_round, e4m3_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _convert(X, OUT, ROWS: tl.constexpr, COLS: tl.constexpr, BF16: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(X + offs)
    if BF16:
        tl.store(OUT + offs, e4m3_to(x, tl.bfloat16))
    else:
        tl.store(OUT + offs, e4m3_to(x, tl.float16))


def converted(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(raw.shape, dtype=dtype, device=raw.device)
    _convert[(1,)](raw, out, raw.shape[0], raw.shape[1], dtype == torch.bfloat16)
    return out


def expected(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return raw.view(torch.float8_e4m3fn).to(torch.float32).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (signed zeros included) and NaN in the same places. Triton's interpreter reads the NaN bytes as
    +-480 (triton 3.9): there, only the other bytes are compared; on a GPU every byte."""
    nan = b.isnan()
    bits = lambda t: t.view(torch.int16)
    nans_kept = DEVICE == "cpu" or torch.equal(a.isnan(), nan)
    return bool(nans_kept and torch.equal(bits(a)[~nan], bits(b)[~nan]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16, 16), (64, 64)])
def test_every_byte_converts_exactly(dtype, shape):
    """All 256 bytes (subnormals, both zeros, +-448, the two NaNs), each at every offset in its group of four: at
    64 x 64 a thread holds 16 bytes, so each value meets every position of a packed register; at 16 x 16 two, the
    other two positions padding."""
    raw = torch.arange(shape[0] * shape[1], dtype=torch.int64).remainder(256).to(torch.uint8)
    for shift in range(4):  # each byte value at each offset within its group of four
        r = raw.roll(shift).reshape(shape).contiguous().to(DEVICE)
        assert same(converted(r, dtype), expected(r, dtype)), (dtype, shift)


def test_worked_example():
    """0x38 is 1.0 (exponent 7 = bias), 0x01 the smallest subnormal 2^-9, 0xfe -448, 0x7f NaN."""
    raw = torch.tensor([0x38, 0x01, 0xFE, 0x7F] * 64, dtype=torch.uint8).reshape(16, 16).to(DEVICE)
    out = converted(raw, torch.bfloat16).float().cpu().flatten()[:4]
    assert out[:3].tolist() == [1.0, 2.0**-9, -448.0]
    assert out[3].isnan() or DEVICE == "cpu"


@pytest.mark.parametrize("seed", range(3))
def test_random_bytes(seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (64, 64), dtype=torch.uint8, generator=g).to(DEVICE)
    assert same(converted(raw, torch.bfloat16), expected(raw, torch.bfloat16))


@triton.jit
def _round(X, OUT, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(OUT + offs, e4m3_round(tl.load(X + offs)))


def rounded(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _round[(1,)](x, out, x.numel())
    return out


def test_e4m3_round_worked_example():
    """0.4867 -> 0.5 (3 mantissa bits: 0.46875 and 0.5 the neighbours; Triton's interpreter made it 0.25); the
    midpoint 0.09765625 of 0.09375 (mantissa 100) and 0.1015625 (101) ties to the even 0.09375; 0.0026 below the
    normals rounds to a multiple of 2^-9, 0.001953125; 1.0 and 0.0 stay."""
    x = torch.tensor([0.4867, 0.09765625, 0.0026, 1.0, 0.0, 0.0, 0.0, 0.0], device=DEVICE)
    want = torch.tensor([0.5, 0.09375, 0.001953125, 1.0, 0.0, 0.0, 0.0, 0.0], device=DEVICE)
    assert torch.equal(rounded(x), want)


def test_e4m3_round_every_value_midpoint_and_neighbour():
    """Every non-negative e4m3 value up to 448, every midpoint between two (the ties), and the fp32 values just
    either side of each midpoint, against torch's round-to-nearest-even conversion."""
    v = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (v[:-1] + v[1:]) / 2
    x = torch.cat([v, mid, mid.nextafter(torch.zeros(1)), mid.nextafter(torch.full((1,), 1e4))])
    x = torch.cat([x, torch.zeros(512 - x.numel())]).to(DEVICE)
    assert torch.equal(rounded(x), x.to(torch.float8_e4m3fn).float())


@settings(max_examples=20, deadline=None)
@given(st.lists(st.floats(0.0, 448.0, width=32), min_size=64, max_size=64))
def test_e4m3_round_is_torchs_rounding(values):
    """Any fp32 in ``[0, 448]`` (the softmax weights are in ``[0, 1]``): the nearest e4m3 value, ties to even."""
    x = torch.tensor(values, dtype=torch.float32, device=DEVICE)
    assert torch.equal(rounded(x), x.to(torch.float8_e4m3fn).float())
