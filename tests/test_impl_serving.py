"""The cache kernels of ``mlaspec.impl.cache`` through Triton's interpreter, against the spec, byte for byte.

Harness cases (curated tiny, every dtype: no kernel multiplies matrices) go through the composed backend
``TritonWithServing``; kernel-level checks: the written bytes equal, exactly, the spec's for every deterministic
byte (scales, bf16, ``"auto"``) and, for fp8 values, those of an fp32 emulation (``fp8(clamp(fp32(x / s)))``, the
eager torch backend's ``_encode``: the spec rounds ``x / s`` once in float64, a kernel divides in fp32 first, and
the two can differ by one fp8 step at a tie, which the harness budgets); slot ``-1`` and unused slots untouched
(NaN fill), amax 336 / 448 / 0 / tiny
groups, saturation past the per-tensor range, e5m2, gathers with unaligned ``seq_starts`` from shuffled pages with
NaN pages, empty requests, the round trip quantize -> dequantize, and split-row page reads with ``-1`` slots.

The e8m0 layouts (V4's 584-byte split-row token, V4.1's 528-byte MXFP8 one) have no fp32 division: their bytes
must equal the spec's exactly -- every group's scale byte at and around the ``448 * 2^k`` boundaries, NaN / inf
groups, and random entries drawn by hypothesis (records, pages and the reads back). Bad arguments raise
``TypeError`` / ``ValueError`` naming the argument.
"""

import dataclasses
import math
import os
import sys

import pytest

if "mlaspec.impl.decode" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "mlaspec.impl was imported compiled (without TRITON_INTERPRET=1) in this process", allow_module_level=True
    )
os.environ["TRITON_INTERPRET"] = "1"

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaspec.conformance.backends.torch_serving import TorchServing
from mlaspec.conformance.backends.triton import TritonBackend as TritonWithServing
from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.runner import run_case
from mlaspec.impl import cache as kc
from mlaspec.spec import cache_layouts as cl
from mlaspec.spec import paged_cache as spec

pytestmark = pytest.mark.interpreter
_LAYOUT = {
    "fp8": "fp8_e4m3_per_tensor",
    "fp8_e4m3": "fp8_e4m3_per_tensor",
    "fp8_e5m2": "fp8_e5m2_per_tensor",
    "fp8_ds_mla": "fp8_ds_mla_v32",
}
OPS = ("concat_and_cache_mla", "gather_cache", "quantize", "dequantize", "write_pages", "read_tokens")


def _u8(t):
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("case", curated_cases(ops=OPS, dtypes=("bfloat16", "float16", "float32")), ids=str)
def test_harness_cases(case):
    r = run_case(TritonWithServing(), case, backend_name="triton")
    assert r.verdict == "pass", f"{case.id}: {r.verdict}: {r.reason}"


SATURATING = 6e4
"""Past every per-tensor range of :data:`CONCAT_KINDS` (e4m3's 448 and e5m2's 57344 at a scale <= 0.5), and finite
in fp16 (65504): 1e6 was an fp16 ``inf``, which checks ``inf`` handling, not saturation."""


def _entries(seed, t, dtype):
    """``[t, 576]`` in ``dtype``: per-token magnitudes ``2^k``, and groups planted at amax 336, 0, ``~1e-4`` (fp8
    subnormals), 448 and :data:`SATURATING`; every value finite in ``dtype``."""
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
        x[3, 0] = SATURATING  # past any per-tensor range: saturation
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_entries_are_finite_and_saturate_every_per_tensor_format(dtype):
    x = _entries(11, 11, dtype)
    assert torch.isfinite(x).all()
    scales = [scale for _, scale, _ in CONCAT_KINDS if scale is not None]
    fp8_max = max(torch.finfo(f).max for f in (torch.float8_e4m3fn, torch.float8_e5m2))  # e5m2: 57344
    assert all(float(x[3, 0]) / s > fp8_max for s in scales)


CONCAT_KINDS = [
    ("auto", None, False),
    ("fp8", 0.09375, False),
    ("fp8_e4m3", 0.3, False),
    ("fp8_e5m2", 0.5, False),
    ("fp8_ds_mla", None, False),
    ("fp8_ds_mla", None, True),  # vLLM's power-of-two scales after PR #49435
]


@pytest.mark.parametrize("kind,scale,pow2", CONCAT_KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_concat_and_cache_bytes_equal_the_spec(kind, scale, pow2, dtype):
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
    kw = dict(kv_cache_dtype=kind, scale=scale, pow2_scales=pow2)
    got = kc.concat_and_cache_mla(x[:, :512], x[:, 512:], cache, slots, **kw)
    ref = spec.concat_and_cache_mla(x[:, :512], x[:, 512:], cache, slots, **kw)
    assert torch.equal(_u8(cache), _u8(before)), "the input cache was written"
    if kind != "auto":  # fp8 values: the fp32-division emulation, byte for byte
        keep = slots >= 0
        lay = cl.LAYOUTS[_LAYOUT[kind]]
        if kind == "fp8_ds_mla" and dtype == torch.float16:  # an fp16 model's RoPE is fp16 (the spec, vLLM)
            lay = cl.FP8_DS_MLA_V32_FP16
        records = TorchServing()._encode(x[keep], lay, scale, pow2)
        ref.view(nb * p, width)[slots[keep]] = records
        spec_raw = spec.concat_and_cache_mla(x[:, :512], x[:, 512:], cache, slots, **kw)
        exact = torch.ones(width, dtype=torch.bool)
        for f in lay.value_fields:
            if f.dtype in ("e4m3", "e5m2"):
                exact[f.offset : f.end] = False
        assert torch.equal(got[..., exact], spec_raw[..., exact]), "deterministic bytes differ from the spec"
    assert torch.equal(_u8(got), _u8(ref)), f"{kind}: {int((_u8(got) != _u8(ref)).sum())} bytes differ"


def test_concat_and_cache_rejects_bad_kind_and_missing_scale():
    x = torch.zeros(2, 576)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kc.concat_and_cache_mla(x[:, :512], x[:, 512:], torch.zeros(1, 4, 576), torch.zeros(2), kv_cache_dtype="x")
    with pytest.raises(ValueError, match="scale"):
        kc.concat_and_cache_mla(
            x[:, :512], x[:, 512:], torch.zeros(1, 4, 576, dtype=torch.uint8), torch.arange(2), kv_cache_dtype="fp8"
        )
    with pytest.raises(ValueError, match="pow2_scales"):  # only the 656-byte record has group scales
        kc.concat_and_cache_mla(
            x[:, :512], x[:, 512:], torch.zeros(1, 4, 576), torch.arange(2), kv_cache_dtype="auto", pow2_scales=True
        )


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


E8M0 = ("fp8_ds_mla_v4", "mxfp8_ds_mla_v41")


@st.composite
def _e8m0_problem(draw):
    """A tiny V4 / V4.1 problem: entries of per-token magnitude ``2^k`` with planted groups, in a case dtype."""
    lay = cl.LAYOUTS[draw(st.sampled_from(E8M0))]
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    t = draw(st.integers(1, 5))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(t, lay.entry_dim, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-8, 9, (t, 1), generator=g).double())
    group = lay.value_fields[0].group
    k_max = 7 if dtype == torch.float16 else 10  # 448 * 2^k must be finite in the case dtype (fp16: <= 65504)
    for row, kind, k in draw(
        st.lists(
            st.tuples(st.integers(0, t - 1), st.sampled_from(["zero", "tiny", "boundary"]), st.integers(-12, k_max)),
            max_size=3,
        )
    ):
        cols = slice(k % 7 * group, (k % 7 + 1) * group)
        if kind == "zero":
            x[row, cols] = 0.0
        elif kind == "tiny":  # below the e8m0 amax floor 1e-4: fp8 subnormals
            x[row, cols] *= 1e-6
        else:  # amax exactly 448 * 2^k: the scale 2^k with no rounding up
            x[row, cols] = x[row, cols].clamp(-400 * 2.0**k, 400 * 2.0**k)
            x[row, cols.start] = -448 * 2.0**k
    return lay, x.to(dtype)


@given(_e8m0_problem())
def test_e8m0_problems_are_finite_in_their_dtype(problem):
    """The strategy plants amaxes of ``448 * 2^k`` only where the case dtype holds them (fp16's -inf made a NaN
    scale: issue 21)."""
    _, x = problem
    assert torch.isfinite(x).all(), x.dtype


@given(_e8m0_problem())
def test_e8m0_records_equal_the_spec_byte_for_byte(problem):
    lay, x = problem
    raw = kc.quantize_records(x, lay)
    ref = cl.quantize(x, lay).raw
    assert torch.equal(raw, ref), f"{lay.name}: {int((raw != ref).sum())} bytes differ"
    back = kc.dequantize_records(raw, lay)
    assert torch.equal(back.double(), cl.dequantize(ref, lay).entries)  # power-of-two scales: exact in fp32


@given(_e8m0_problem(), st.integers(1, 4), st.integers(0, 2**16))
def test_e8m0_pages_equal_the_spec_byte_for_byte(problem, p, seed):
    lay, x = problem
    t = x.shape[0]
    g = torch.Generator().manual_seed(seed)
    nb = -(-(t + 1) // p)
    pages = torch.randint(0, 256, (nb, cl.page_bytes(lay, p)), generator=g, dtype=torch.uint8)  # no slot is clean
    slots = torch.randperm(nb * p, generator=g)[:t]
    slots[torch.rand(t, generator=g) < 0.3] = -1  # padding tokens
    before = pages.clone()
    got = kc.write_pages(pages, x, slots, lay, p)
    assert torch.equal(pages, before), "the input pages were written"
    assert torch.equal(got, cl.write_pages(pages, x, slots, lay, p))  # untouched slots and the alignment tail too
    raw, valid = kc.read_tokens(got, lay, p, slots)
    keep = slots >= 0
    assert torch.equal(valid, keep)
    assert torch.equal(raw[keep], cl.quantize(x[keep], lay).raw) and not raw[~keep].any()


@pytest.mark.parametrize("layout", E8M0)
def test_e8m0_scale_bytes_at_every_power_of_two_boundary(layout):
    """Each group's amax is ``448 * 2^k`` or its fp32 neighbour above / below, k from -30 to 30: the exponent read
    off the bits is the spec's exact ``ceil(log2(max(amax, 1e-4) / 448))``."""
    lay = cl.LAYOUTS[layout]
    f = lay.value_fields[0]
    edge = torch.tensor([448.0 * 2.0**k for k in range(-30, 31)], dtype=torch.float32)
    probes = torch.cat(
        [
            edge,
            torch.nextafter(edge, edge * 2),
            torch.nextafter(edge, edge * 0),
            torch.tensor([0.0, 1e-4, 1.0001e-4, 9.999e-5, 2.0**-126, 3e38]),
        ]
    )
    per_row = (f.elements[1] - f.elements[0]) // f.group
    t = -(-probes.numel() // per_row)
    x = torch.zeros(t, lay.entry_dim)
    for i, a in enumerate(probes.tolist()):
        row, grp = divmod(i, per_row)
        x[row, grp * f.group : (grp + 1) * f.group] = torch.linspace(-a, a / 3, f.group)
    assert torch.equal(kc.quantize_records(x, lay), cl.quantize(x, lay).raw)


@pytest.mark.parametrize("layout", E8M0)
def test_e8m0_nan_inf_and_signed_zero_groups_match_the_spec(layout):
    lay = cl.LAYOUTS[layout]
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(3))
    x[0, 3], x[0, 5] = math.nan, -math.nan  # a NaN group: scale byte 255, NaN values, a NaN keeps its sign
    x[1, 40], x[3, 100] = math.inf, -math.inf
    x[2] = -0.0
    x[3, 0], x[3, 70:80] = 3e38, 1e-40  # near fp32's top; fp32 subnormals
    raw = kc.quantize_records(x, lay)
    assert torch.equal(raw, cl.quantize(x, lay).raw)
    back, ref = kc.dequantize_records(raw, lay), cl.dequantize(raw, lay).entries.float()
    assert torch.equal(back.isnan(), ref.isnan()) and torch.equal(back.nan_to_num(), ref.nan_to_num())


def test_v41_pages_are_split_as_vllm_writes_them():
    """vLLM's V4.1 writer (``_rope_quant_insert_mxfp8_kernel``, ``fused_compress_quant_cache.py`` @1bd28daa) stores
    a token's 512 value bytes at ``page + off * 512`` and its 16 scale bytes at ``page + P * 512 + off * 16``; the
    kernels follow the spec's record (``split_at=512``, pages rounded up to 512 bytes), and an interleaved variant of
    the same record (``split_at=None``) needs no kernel change either: the placement is layout data."""
    lay, p = cl.MXFP8_DS_MLA_V41, 4
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    pages = torch.full((2, cl.page_bytes(lay, p)), 0xFF, dtype=torch.uint8)
    assert pages.shape[1] == 2560  # 4 * 528 = 2112 rounded up to 512
    slots = torch.tensor([6, -1, 0, 3, 5])
    got = kc.write_pages(pages, x, slots, lay, p)
    assert torch.equal(got, cl.write_pages(pages, x, slots, lay, p))
    rec = cl.quantize(x, lay).raw
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, p)
        assert torch.equal(got[blk, off * 512 : (off + 1) * 512], rec[i, :512])
        assert torch.equal(got[blk, p * 512 + off * 16 : p * 512 + (off + 1) * 16], rec[i, 512:])
    assert torch.equal(kc.read_tokens(got, lay, p, slots)[0], cl.read_tokens(got, lay, p, slots).raw)
    flat = dataclasses.replace(lay, name="mxfp8_v41_interleaved", split_at=None, page_alignment=1)
    pages = torch.full((2, cl.page_bytes(flat, p)), 0xFF, dtype=torch.uint8)
    got = kc.write_pages(pages, x, slots, flat, p)
    assert torch.equal(got, cl.write_pages(pages, x, slots, flat, p))
    assert torch.equal(kc.read_tokens(got, flat, p, slots)[0], cl.read_tokens(got, flat, p, slots).raw)


def test_plan_reads_the_layouts():
    v4, v41, v32 = kc.plan("fp8_ds_mla_v4"), kc.plan(cl.MXFP8_DS_MLA_V41), kc.plan("fp8_ds_mla_v32")
    assert (v4["D_A"], v4["D_B"], v4["GROUP"], v4["G"], v4["S_OFF"], v4["B_OFF"], v4["PAD_OFF"]) == (
        448,
        64,
        64,
        7,
        576,
        448,
        583,
    )
    assert (v41["D_A"], v41["D_B"], v41["GROUP"], v41["G"], v41["S_OFF"], v41["PAD"]) == (512, 0, 32, 16, 512, 0)
    assert (v4["E_FLOOR"], v4["MQ_EXP"], v4["MQ_MANT"]) == (-22, 8, 0x600000)  # 1e-4 / 448 -> 2^-22; 448 = 1.75 2^8
    assert (v32["SCALES"], v32["B_KIND"], kc.plan("fp8_e5m2_per_tensor")["B_KIND"]) == (1, 2, 1)
    odd = cl.CacheLayout(
        "bf16-only", "x", 64, 128, (cl.Field("v", 0, 128, "bf16", 64, "", (0, 64)),), cl.ScaleRule("per_tensor")
    )
    with pytest.raises(ValueError, match="bf16-only"):
        kc.plan(odd)


_X = torch.zeros(2, 512)


@pytest.mark.parametrize(
    "call,error,name",
    [
        (lambda: kc.quantize_records(_X.double(), "fp8_ds_mla_v4"), TypeError, "entries"),
        (lambda: kc.quantize_records(_X[:, :500], "fp8_ds_mla_v4"), ValueError, "entries"),
        (lambda: kc.quantize_records(_X[0], "mxfp8_ds_mla_v41"), ValueError, "entries"),
        (lambda: kc.quantize_records(_X, "fp8_ds_mla_v5"), ValueError, "layout"),
        (lambda: kc.quantize_records(_X, 584), TypeError, "layout"),
        (lambda: kc.quantize_records(_X, "fp8_ds_mla_v4", scale=0.5), ValueError, "scale"),
        (lambda: kc.quantize_records(torch.zeros(2, 576), "fp8_e4m3_per_tensor"), ValueError, "scale"),
        (lambda: kc.quantize_records(torch.zeros(2, 576), "fp8_e4m3_per_tensor", scale=-1.0), ValueError, "scale"),
        (lambda: kc.quantize_records(torch.zeros(2, 576), "fp8_e4m3_per_tensor", scale="1"), TypeError, "scale"),
        (lambda: kc.dequantize_records(torch.zeros(2, 584, dtype=torch.int8), "fp8_ds_mla_v4"), TypeError, "raw"),
        (lambda: kc.dequantize_records(torch.zeros(2, 528, dtype=torch.uint8), "fp8_ds_mla_v4"), ValueError, "raw"),
        (
            lambda: kc.write_pages(torch.zeros(2, 584 * 4, dtype=torch.uint8), _X, torch.arange(2), "fp8_ds_mla_v4", 4),
            ValueError,
            "pages",
        ),
        (
            lambda: kc.write_pages(
                torch.zeros(2, 2560, dtype=torch.uint8),
                _X,
                torch.tensor([0, 8]),  # 4 * 528 -> 2560
                "mxfp8_ds_mla_v41",
                4,
            ),
            ValueError,
            "slot_mapping",
        ),
        (
            lambda: kc.write_pages(
                torch.zeros(2, 2560, dtype=torch.uint8), _X, torch.tensor([3, 3]), "mxfp8_ds_mla_v41", 4
            ),
            ValueError,
            "slot_mapping",
        ),
        (
            lambda: kc.write_pages(
                torch.zeros(2, 2560, dtype=torch.uint8), _X, torch.tensor([0.0, 1.0]), "mxfp8_ds_mla_v41", 4
            ),
            TypeError,
            "slot_mapping",
        ),
        (
            lambda: kc.write_pages(torch.zeros(2, 2560, dtype=torch.uint8), _X, torch.arange(3), "mxfp8_ds_mla_v41", 4),
            ValueError,
            "slot_mapping",
        ),
        (
            lambda: kc.write_pages(torch.zeros(2, 528, dtype=torch.uint8), _X, torch.arange(2), "mxfp8_ds_mla_v41", 0),
            ValueError,
            "block_size",
        ),
        (
            lambda: kc.write_pages(
                torch.zeros(2, 528, dtype=torch.uint8), _X, torch.arange(2), "mxfp8_ds_mla_v41", 1.0
            ),
            TypeError,
            "block_size",
        ),
        (
            lambda: kc.read_tokens(torch.zeros(1, 1152, dtype=torch.uint8), "fp8_ds_mla_v4", 1, torch.tensor([1])),
            ValueError,
            "slots",
        ),
        (
            lambda: kc.read_tokens(torch.zeros(1, 584, dtype=torch.uint8), "fp8_ds_mla_v4", 1, torch.tensor([0])),
            ValueError,
            "pages",
        ),
    ],
)
def test_bad_arguments_are_named(call, error, name):
    with pytest.raises(error, match=name):
        call()


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


@pytest.mark.parametrize(
    "p,lens,starts", [(16, [5, 0, 21, 9], [3, 7, 16, 40]), (4, [1], [0]), (8, [0, 0], [5, 1]), (16, [40, 3], [15, 31])]
)
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
    assert torch.equal(
        _u8(got), _u8(spec.gather_cache(cache, table, cu, 3, st_, kernel="gather_and_maybe_dequant_cache").entries)
    )
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
