"""The cache kernels of ``mlaspec.impl.cache`` through Triton's interpreter, against the spec, byte for byte.

Harness cases (curated tiny, every dtype: no kernel multiplies matrices) go through the composed backend
``TritonWithServing``; kernel-level checks: the written bytes equal, exactly, the spec's for every deterministic
byte (scales, bf16, ``"auto"``) and, for fp8 values, those of an fp32 emulation (``fp8(clamp(fp32(x / s)))``, the
eager torch backend's ``_encode``: the spec rounds ``x / s`` once in float64, a kernel divides in fp32 first, and
the two can differ by one fp8 step at a tie, which the harness budgets); slot ``-1`` and unused slots untouched
(NaN fill), amax 336 / 448 / 0 / tiny
groups, saturation past the per-tensor range, e5m2, gathers with unaligned ``seq_starts`` from shuffled pages with
NaN pages, empty requests, the round trip quantize -> dequantize, and split-row page reads with ``-1`` slots.
"""

import math
import os
import sys

import pytest

if "mlaspec.impl.decode" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("mlaspec.impl was imported compiled (without TRITON_INTERPRET=1) in this process",
                allow_module_level=True)  # fmt: skip
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mlaspec.conformance.backends.torch_serving import TorchServing  # noqa: E402
from mlaspec.conformance.cases import curated_cases  # noqa: E402
from mlaspec.conformance.runner import run_case  # noqa: E402
from mlaspec.impl import cache as kc  # noqa: E402
from mlaspec.impl.backend import TritonBackend as TritonWithServing  # noqa: E402
from mlaspec.spec import cache_layouts as cl  # noqa: E402
from mlaspec.spec import paged_cache as spec  # noqa: E402

pytestmark = pytest.mark.interpreter
_LAYOUT = {"fp8": "fp8_e4m3_per_tensor", "fp8_e4m3": "fp8_e4m3_per_tensor", "fp8_e5m2": "fp8_e5m2_per_tensor",
           "fp8_ds_mla": "fp8_ds_mla_v32"}  # fmt: skip
OPS = ("concat_and_cache_mla", "gather_cache", "quantize", "dequantize", "write_pages", "read_tokens")


def _u8(t):
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("case", curated_cases(ops=OPS, dtypes=("bfloat16", "float16", "float32")), ids=str)
def test_harness_cases(case):
    r = run_case(TritonWithServing(), case, backend_name="triton")
    assert r.verdict in ("pass", "skip"), f"{case.id}: {r.verdict}: {r.reason}"
    if r.verdict == "skip":  # only the named layout limits (V4 / V4.1 e8m0 writers) may skip
        assert "fp8_ds_mla_v4" in r.reason or "mxfp8_ds_mla_v41" in r.reason, r.reason


def _entries(seed, t, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 576, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-6, 7, (t, 1), generator=g).double())
    x[0, 3] = 336.0
    x[0, 4:128] = x[0, 4:128].clamp(-300, 300)
    if t > 1:
        x[1, 128:256] = 0.0  # amax 0: the FLT_MIN scale
    if t > 2:
        x[2, :128] *= 1e-4  # subnormal fp8
    if t > 3:
        x[3, 200] = -448.0
        x[3, 0] = 1e6  # past any per-tensor range: saturation
    return x.to(dtype)


@pytest.mark.parametrize("kind,scale", [("auto", None), ("fp8", 0.09375), ("fp8_e4m3", 0.3), ("fp8_e5m2", 0.5),
                                        ("fp8_ds_mla", None)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_concat_and_cache_bytes_equal_the_spec(kind, scale, dtype):
    t, p, nb = 11, 8, 3
    x = _entries(t, t, dtype)
    slots = torch.randperm(nb * p - 1, generator=torch.Generator().manual_seed(1))[:t]
    slots[[2, 7]] = -1  # padding tokens
    width = {"auto": 576, "fp8_ds_mla": 656}.get(kind, 576)
    if kind == "auto":
        cache = torch.full((nb, p, width), math.nan, dtype=dtype)
    else:
        cache = torch.full((nb, p, width), 0xFF, dtype=torch.uint8)
    before = cache.clone()
    got = kc.concat_and_cache_mla(x[:, :512], x[:, 512:], cache, slots, kv_cache_dtype=kind, scale=scale)
    ref = spec.concat_and_cache_mla(x[:, :512], x[:, 512:], cache, slots, kv_cache_dtype=kind, scale=scale)
    assert torch.equal(_u8(cache), _u8(before)), "the input cache was written"
    if kind != "auto":  # fp8 values: the fp32-division emulation, byte for byte
        keep = slots >= 0
        records = TorchServing()._encode(x[keep], cl.LAYOUTS[_LAYOUT[kind]], scale)
        ref.view(nb * p, width)[slots[keep]] = records
        spec_raw = spec.concat_and_cache_mla(x[:, :512], x[:, 512:], cache, slots, kv_cache_dtype=kind, scale=scale)
        exact = torch.ones(width, dtype=torch.bool)
        for f in cl.LAYOUTS[_LAYOUT[kind]].value_fields:
            if f.dtype in ("e4m3", "e5m2"):
                exact[f.offset : f.end] = False
        assert torch.equal(got[..., exact], spec_raw[..., exact]), "deterministic bytes differ from the spec"
    assert torch.equal(_u8(got), _u8(ref)), f"{kind}: {int((_u8(got) != _u8(ref)).sum())} bytes differ"


def test_concat_and_cache_rejects_bad_kind_and_missing_scale():
    x = torch.zeros(2, 576)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kc.concat_and_cache_mla(x[:, :512], x[:, 512:], torch.zeros(1, 4, 576), torch.zeros(2), kv_cache_dtype="x")
    with pytest.raises(ValueError, match="scale"):
        kc.concat_and_cache_mla(x[:, :512], x[:, 512:], torch.zeros(1, 4, 576, dtype=torch.uint8),
                                torch.arange(2), kv_cache_dtype="fp8")  # fmt: skip


@settings(max_examples=6)
@given(st.integers(1, 9), st.integers(0, 2**16))
def test_ds_mla_round_trip(t, seed):
    x = _entries(seed, t, torch.float32)
    raw = kc.quantize_records(x, cl.FP8_DS_MLA_V32)
    assert torch.equal(raw, TorchServing()._encode(x, cl.FP8_DS_MLA_V32, None))
    back = kc.dequantize_records(raw, cl.FP8_DS_MLA_V32)
    ref = cl.dequantize(raw, cl.FP8_DS_MLA_V32).entries
    assert torch.equal(back.double(), ref.float().double())  # one fp32 product: the spec's value rounded once


def test_dequantize_nan_records_stay_nan():
    raw = torch.full((2, 656), 0xFF, dtype=torch.uint8)
    assert torch.isnan(kc.dequantize_records(raw, "fp8_ds_mla_v32")).all()
    per = torch.full((2, 576), 0xFF, dtype=torch.uint8)
    assert torch.isnan(kc.dequantize_records(per, "fp8_e4m3_per_tensor", scale=0.5)).all()


def test_quantize_rejects_e8m0_layouts():
    with pytest.raises(ValueError, match="layout"):
        kc.quantize_records(torch.zeros(2, 512), cl.FP8_DS_MLA_V4)


def _gather_problem(seed, p, lens, starts, dtype, entry=None):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-(s + n) // p) for s, n in zip(starts, lens)]
    nb = sum(pages) + 2
    perm = torch.randperm(nb - 1, generator=g)
    table = torch.full((len(lens), max(pages + [1])), nb - 1, dtype=torch.int32)  # unused: the NaN page
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[at : at + n].int()
        at += n
    if entry == "656":
        cache = torch.randint(0, 255, (nb, p, 656), generator=g, dtype=torch.uint8)
        cache[nb - 1] = 0xFF
    else:
        cache = torch.randn(nb, p, 576, generator=g).to(dtype)
        cache[nb - 1] = math.nan
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return cache, table, cu, torch.tensor(starts, dtype=torch.int32)


@pytest.mark.parametrize("p,lens,starts", [(16, [5, 0, 21, 9], [3, 7, 16, 40]), (4, [1], [0]),
                                           (8, [0, 0], [5, 1]), (16, [40, 3], [15, 31])])  # fmt: skip
@pytest.mark.parametrize("entry", [torch.float16, torch.bfloat16, "656"])
def test_gather_cache_bit_for_bit(p, lens, starts, entry):
    cache, table, cu, st_ = _gather_problem(len(lens) * p, p, lens, starts, entry, entry if entry == "656" else None)
    got = kc.gather_cache(cache, table, cu, len(lens), st_, block_t=4)
    ref = spec.gather_cache(cache, table, cu, len(lens), st_).entries
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(_u8(got), _u8(ref))


def test_gather_cache_aligned_kernel_and_no_starts():
    cache, table, cu, st_ = _gather_problem(5, 8, [7, 16, 3], [0, 8, 16], torch.float16)
    got = kc.gather_cache(cache, table, cu, 3, st_, kernel="gather_and_maybe_dequant_cache")
    assert torch.equal(_u8(got), _u8(spec.gather_cache(cache, table, cu, 3, st_,
                                                       kernel="gather_and_maybe_dequant_cache").entries))  # fmt: skip
    got = kc.gather_cache(cache, table, cu)
    assert torch.equal(_u8(got), _u8(spec.gather_cache(cache, table, cu).entries))
    with pytest.raises(ValueError, match="seq_starts"):
        kc.gather_cache(cache, table, cu, 3, st_ + 1, kernel="gather_and_maybe_dequant_cache")


@pytest.mark.parametrize("layout", ["fp8_ds_mla_v4", "mxfp8_ds_mla_v41", "fp8_ds_mla_v32"])
def test_read_tokens_split_and_interleaved(layout):
    lay = cl.LAYOUTS[layout]
    p, nb = 8, 3
    g = torch.Generator().manual_seed(7)
    pages = torch.randint(0, 256, (nb, cl.page_bytes(lay, p)), generator=g, dtype=torch.uint8)
    slots = torch.tensor([0, -1, 5, nb * p - 1, 9, -1, 12])
    raw, valid = kc.read_tokens(pages, lay, p, slots)
    ref = cl.read_tokens(pages, lay, p, slots)
    assert torch.equal(raw, ref[0]) and torch.equal(valid, ref[1])
