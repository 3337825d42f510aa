"""Tests for mlaspec.spec.cache_layouts: the byte layouts as data, quantize / dequantize, pages, detection."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaspec.spec import cache_layouts as cl

F64 = torch.float64
GROUPED = [cl.FP8_DS_MLA_V32, cl.FP8_DS_MLA_V4, cl.MXFP8_DS_MLA_V41]
E8M0 = [cl.FP8_DS_MLA_V4, cl.MXFP8_DS_MLA_V41]
PER_TENSOR = [cl.FP8_PER_TENSOR, cl.FP8_E5M2_PER_TENSOR]
PER_TENSOR_RULE = cl.ScaleRule("per_tensor")


# ------------------------------------------------------------------------------------------ layouts as data


def test_flashmla_656_byte_token_fields():
    # FlashMLA README: 512 e4m3, then 4 fp32 scales (one per 128), then 64 bf16 RoPE = 656 bytes.
    lay = cl.FP8_DS_MLA_V32
    assert lay.token_bytes == 656 == 512 + 16 + 128
    assert [(f.name, f.offset, f.nbytes, f.dtype, f.count) for f in lay.fields] == [
        ("nope", 0, 512, "e4m3", 512),
        ("scales", 512, 16, "fp32", 4),
        ("rope", 528, 128, "bf16", 64),
    ]


def test_v4_and_v41_record_widths_and_pages():
    # vLLM flashmla_sparse.py: V4 = 448 e4m3 + 64 bf16 + 7 ue8m0 + 1 pad = 584; V4.1 = 512 e4m3 + 16 ue8m0 = 528.
    assert cl.FP8_DS_MLA_V4.token_bytes == 448 + 128 + 7 + 1 == 584
    assert cl.MXFP8_DS_MLA_V41.token_bytes == 512 + 16 == 528
    # a V4 page of 64 tokens is 64 * 584 = 37376 bytes rounded up to the 576-byte TMA stride: 65 * 576
    assert cl.page_bytes(cl.FP8_DS_MLA_V4, 64) == 37440
    # flashmla_sparse.py @008a0c31: V4.1 pages are rounded up to 512 bytes (64 * 528 = 66 * 512 already is)
    assert cl.page_bytes(cl.MXFP8_DS_MLA_V41, 64) == 64 * 528 == 66 * 512
    assert cl.page_bytes(cl.MXFP8_DS_MLA_V41, 4) == 2560 == 5 * 512  # 4 * 528 = 2112, rounded up
    assert cl.page_bytes(cl.FP8_DS_MLA_V32, 64) == 64 * 656


def test_malformed_layout_is_rejected():
    with pytest.raises(ValueError, match="token_bytes"):
        cl.CacheLayout("bad", "x", 4, 5, (cl.Field("v", 0, 4, "e4m3", 4, "values", (0, 4)),), PER_TENSOR_RULE)
    with pytest.raises(ValueError, match="starts at"):
        cl.CacheLayout("bad", "x", 4, 4, (cl.Field("v", 1, 3, "e4m3", 3, "values", (0, 3)),), PER_TENSOR_RULE)


@pytest.mark.parametrize(
    ("layout", "data", "tail"), [(cl.FP8_DS_MLA_V4, 576, 8), (cl.MXFP8_DS_MLA_V41, 512, 16)], ids=["v4", "v41"]
)
def test_v4_and_v41_pages_put_scale_rows_after_all_data_rows(layout, data, tail):
    # vLLM fused_compress_quant_cache.py @1bd28daa: V4 values at page + off * 576, scales at page + P * 576 + off * 8
    # (_rope_quant_insert_kernel); V4.1 values at page + off * 512, scales at page + P * 512 + off * 16
    # (_rope_quant_insert_mxfp8_kernel).
    p = 4
    x = torch.randn(p, 512, dtype=F64)
    q = cl.quantize(x, layout)
    page = cl.to_pages(q.raw, layout, p)[0]
    assert layout.split_at == data and layout.token_bytes == data + tail
    for t in range(p):
        assert torch.equal(page[t * data : (t + 1) * data], q.raw[t, :data])
        assert torch.equal(page[p * data + t * tail : p * data + (t + 1) * tail], q.raw[t, data:])
    assert page[p * layout.token_bytes :].sum() == 0  # the alignment tail is zero
    assert page.numel() % layout.page_alignment == 0
    if layout is cl.FP8_DS_MLA_V4:
        assert page[p * 576 + 7] == 0  # the pad byte


# ------------------------------------------------------------------------------------------ scale rules


def test_scale_formats_are_told_apart_by_336():
    # amax 336 = 0.75 * 448: vLLM's fp8_ds_mla scale is the raw fp32 0.75, FlashMLA's test quantizer and the
    # e8m0 layouts round it up to 1.0.
    x576 = torch.zeros(1, 576, dtype=F64)
    x576[0, 0] = 336.0
    assert cl.quantize(x576, cl.FP8_DS_MLA_V32).scales[0, 0] == 0.75
    raw = cl.quantize(x576, cl.FP8_DS_MLA_V32).raw
    assert raw[0, 512:516].view(torch.float32).item() == 0.75
    assert cl.quantize(x576, cl.FP8_DS_MLA_V32, pow2_scales=True).scales[0, 0] == 1.0
    x512 = torch.zeros(1, 512, dtype=F64)
    x512[0, 0] = 336.0
    q = cl.quantize(x512, cl.FP8_DS_MLA_V4)
    assert q.scales[0, 0] == 1.0 and q.raw[0, 576] == 127  # e8m0 byte = exponent + 127
    assert q.raw[0, 577] == 105  # all-zero group: amax floored at 1e-4 -> 2^ceil(log2(1e-4 / 448)) = 2^-22


def test_nan_propagates_into_e8m0_scale_byte_255():
    x = torch.zeros(1, 512, dtype=F64)
    x[0, 40] = math.nan
    q = cl.quantize(x, cl.MXFP8_DS_MLA_V41)
    assert q.raw[0, 512 + 1] == 255
    assert torch.isnan(cl.dequantize(q.raw, cl.MXFP8_DS_MLA_V41).entries[0, 32:64]).all()


def test_e8m0_rules_differ_just_above_a_boundary():
    """amax = 14 + 2^-20, the fp32 value just above 448 * 2^-5 = 14.

    Exact rule: 14.00000095 / 448 > 2^-5, so e = -4 (byte 123); the group is stored as x * 16: 14.00000095 -> 224
    (e4m3 0x76), -3 -> -48 (0xE4). vLLM's fp32 rule (fused_compress_quant_cache.py @1bd28daa, ``exponent =
    tl.ceil(tl.log2(amax * (1.0 / 448.0)))``): fp32(amax * fp32(1/448)) = 2^-5 (1 + 2^-23), whose log2
    -5 + 1.7e-7 rounds to -5.0 in fp32 (half an ulp there is 2.4e-7), so e = -5 (byte 122); the group is stored as
    x * 32: 448.00003 saturates at 448 (0x7E), -3 -> -96 (0xEC). Both read back as 14 and -3.
    """
    a = 14.0 + 2.0**-20
    assert float(torch.tensor(a, dtype=torch.float32)) == a  # an fp32 value: the kernel sees it as is
    x = torch.zeros(1, 512, dtype=F64)
    x[0, 0], x[0, 1] = a, -3.0
    for layout in E8M0:
        s_off = layout.field("scales").offset
        exact = cl.quantize(x, layout)
        vllm = cl.quantize(x, layout, e8m0_rule="vllm_fp32")
        assert torch.equal(exact.raw, cl.quantize(x, layout, e8m0_rule="exact").raw)  # the default
        assert (exact.raw[0, s_off].item(), exact.raw[0, 0].item(), exact.raw[0, 1].item()) == (123, 0x76, 0xE4)
        assert (vllm.raw[0, s_off].item(), vllm.raw[0, 0].item(), vllm.raw[0, 1].item()) == (122, 0x7E, 0xEC)
        assert exact.scales[0, 0] == 2.0**-4 and vllm.scales[0, 0] == 2.0**-5
        assert (exact.raw != vllm.raw).nonzero()[:, 1].tolist() == [0, 1, s_off]  # nothing else differs
        for q in (exact, vllm):
            assert cl.dequantize(q.raw, layout).entries[0, :2].tolist() == [14.0, -3.0]
    # exactly on the boundary both rules pick 2^-5 (no rounding up); one fp32 ulp below, both pick 2^-5 too
    for amax in (14.0, 14.0 - 2.0**-20):
        x[0, 0] = amax
        for layout in E8M0:
            assert torch.equal(cl.quantize(x, layout).raw, cl.quantize(x, layout, e8m0_rule="vllm_fp32").raw)


def _boundary_distance(amax: torch.Tensor) -> torch.Tensor:
    """Relative distance of ``max(amax, 1e-4) / 448`` above the power of two below it: in ``[0, 1)``."""
    m, _ = torch.frexp(torch.clamp(amax, min=1e-4) / 448.0)  # y = m 2^e, m in [0.5, 1)
    return 2.0 * m - 1.0


@st.composite
def near_boundary_entries(draw, layout):
    """Random entries at magnitude ``2^log_mag`` with some groups planted ``n`` fp32 ulps above ``448 * 2^k``."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    t = draw(st.integers(1, 3))
    x = torch.randn(t, 512, generator=g, dtype=F64) * 2.0 ** draw(st.floats(-12, 6))
    group = layout.value_fields[0].group
    for row, grp, k, n in draw(
        st.lists(
            st.tuples(st.integers(0, t - 1), st.integers(0, 6), st.integers(-20, 12), st.integers(0, 12)), max_size=4
        )
    ):
        edge = torch.tensor(448.0 * 2.0**k, dtype=torch.float32)
        a = edge
        for _ in range(n):
            a = torch.nextafter(a, edge * 2)
        cols = slice(grp * group, (grp + 1) * group)
        x[row, cols] = x[row, cols].clamp(-400 * 2.0**k, 400 * 2.0**k)
        x[row, cols.start + 1] = -float(a)
    return x


@pytest.mark.parametrize("layout", E8M0, ids=lambda l: l.name)
@given(data=st.data())
def test_vllm_fp32_rule_equals_the_exact_rule_away_from_boundaries(layout, data):
    x = data.draw(near_boundary_entries(layout))
    exact = cl.quantize(x, layout)
    vllm = cl.quantize(x, layout, e8m0_rule="vllm_fp32")
    f, sf = layout.value_fields[0], layout.field("scales")
    t, n = x.shape[0], sf.count
    amax = x[:, f.elements[0] : f.elements[1]].abs().reshape(t, n, f.group).amax(-1)
    drop = exact.raw[:, sf.offset : sf.offset + n].long() - vllm.raw[:, sf.offset : sf.offset + n].long()
    near = (_boundary_distance(amax) > 0) & (_boundary_distance(amax) < 2.0**-16)  # a few hundred fp32 ulps
    assert set(drop.unique().tolist()) <= {0, 1}  # vLLM's exponent is the exact one or one less ...
    assert not drop[~near].any()  # ... and one less only just above a boundary
    same = ~near.repeat_interleave(f.group, dim=1)  # groups away from a boundary: the same value bytes too
    assert torch.equal(exact.raw[:, f.offset : f.end][same], vllm.raw[:, f.offset : f.end][same])


@pytest.mark.parametrize("layout", E8M0, ids=lambda l: l.name)
@pytest.mark.parametrize("rule", cl.E8M0_RULES)
@given(data=st.data())
def test_both_e8m0_rules_dequantize_within_the_bound(layout, rule, data):
    x = data.draw(near_boundary_entries(layout))
    q = cl.quantize(x, layout, e8m0_rule=rule)
    err = (cl.dequantize(q.raw, layout).entries - x).abs()
    assert torch.all(err <= cl.error_bound(x, layout, e8m0_rule=rule))
    f = layout.value_fields[0]  # the e4m3 field; V4's bf16 RoPE dims are covered by the bound above
    a, b = f.elements
    v = x[:, a:b].abs()
    amax = v.reshape(x.shape[0], -1, f.group).amax(-1).repeat_interleave(f.group, 1)
    s = q.scales.repeat_interleave(f.group, 1)
    assert torch.all(err[:, a:b] <= 2.0**-4 * amax + 2.0**-10 * s)  # within 2^-4 of the group's amax
    if rule == "exact":  # 2^e >= amax / 448: nothing saturates
        assert torch.all(v <= 448.0 * s)


# ------------------------------------------------------------------------------------------ round trips

E4M3_BYTES = st.integers(0, 255).filter(lambda b: b not in (0x7F, 0xFF))


def _e4m3(byte_list):
    return torch.tensor(byte_list, dtype=torch.uint8).view(torch.float8_e4m3fn).to(F64)


@st.composite
def representable_entries(draw, layout):
    """Entries that every rule maps to scale 2^k exactly: each group holds ±448 * 2^k; unscaled parts are bf16."""
    t = draw(st.integers(1, 3))
    x = torch.empty(t, layout.entry_dim, dtype=F64)
    for f in layout.value_fields:
        a, b = f.elements
        n = b - a
        if f.dtype == "bf16":
            bits = draw(st.lists(st.integers(0, 2**16 - 1), min_size=t * n, max_size=t * n))
            v = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(F64)
            v = torch.where(torch.isfinite(v), v, 1.0)
            x[:, a:b] = v.reshape(t, n)
            continue
        q = _e4m3(draw(st.lists(E4M3_BYTES, min_size=t * n, max_size=t * n))).reshape(t, -1, f.group)
        q[:, :, 0] = torch.where(q[:, :, 0] < 0, -448.0, 448.0)  # the group's amax (sign(-0.5 + 0.5) would be 0)
        k = draw(st.lists(st.integers(-20, 12), min_size=t * q.shape[1], max_size=t * q.shape[1]))
        x[:, a:b] = (q * torch.exp2(torch.tensor(k, dtype=F64).reshape(t, -1, 1))).reshape(t, n)
    return x


@pytest.mark.parametrize("layout", GROUPED, ids=lambda l: l.name)
@given(data=st.data())
def test_representable_inputs_round_trip_exactly(layout, data):
    x = data.draw(representable_entries(layout))
    q = cl.quantize(x, layout)
    assert torch.equal(cl.dequantize(q.raw, layout).entries, x)
    assert cl.validate_layout(q.raw, layout).ok


@pytest.mark.parametrize("layout", PER_TENSOR, ids=lambda l: l.name)
@given(st.lists(st.integers(0, 255), min_size=576, max_size=576), st.integers(-8, 8))
def test_per_tensor_representable_inputs_round_trip_exactly(layout, codes, k):
    fmt = cl.E4M3 if layout is cl.FP8_PER_TENSOR else cl.E5M2
    v = torch.tensor(codes, dtype=torch.uint8).view(fmt.torch_dtype).to(F64)
    v = torch.where(torch.isfinite(v), v, 0.0)[None]
    scale = 2.0**k
    q = cl.quantize(v * scale, layout, scale=scale)
    assert torch.equal(cl.dequantize(q.raw, layout, scale=scale).entries, v * scale)


@pytest.mark.parametrize("layout", GROUPED + PER_TENSOR, ids=lambda l: l.name)
@given(seed=st.integers(0, 2**16), log_mag=st.floats(-12, 6), pow2=st.booleans())
def test_error_within_documented_bound(layout, seed, log_mag, pow2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, layout.entry_dim, generator=g, dtype=F64) * 2.0**log_mag
    x[:, 5] *= 2.0**10  # an outlier: other groups differ, and the per-tensor layouts saturate
    kw = {"scale": 2.0**log_mag / 64} if layout.scale_rule.kind == "per_tensor" else {}
    if layout.scale_rule.kind == "fp32":
        kw["pow2_scales"] = pow2
    err = (cl.dequantize(cl.quantize(x, layout, **kw).raw, layout, scale=kw.get("scale")).entries - x).abs()
    bound = cl.error_bound(x, layout, **kw)
    assert torch.all(err <= bound), f"worst excess {float((err - bound).max())}"
    for f in layout.value_fields:  # grouped e4m3: within 2^-4 of the group amax
        if f.group is None:
            continue
        a, b = f.elements
        amax = x[:, a:b].abs().reshape(3, -1, f.group).amax(-1).repeat_interleave(f.group, 1)
        floor = 2.0**-10 * 2.0 ** math.ceil(math.log2(1e-4 / 448))  # amax floor of the e8m0 rule
        assert torch.all(err[:, a:b] <= 2.0**-4 * amax + floor)


def test_round_to_format_ties_to_even_and_saturates():
    x = torch.tensor([1.0625, 1.1875, 464.0, 10000.0, -10000.0, 2.0**-10, 3 * 2.0**-11], dtype=F64)
    # e4m3 step at 1 is 1/8: 1.0625 ties to 1.0 (even), 1.1875 ties to 1.25; 2^-9 is the subnormal step
    y = cl.round_to_format(x, cl.E4M3)
    assert y.tolist() == [1.0, 1.25, 448.0, 448.0, -448.0, 0.0, 2.0**-9]
    assert cl.round_to_format(torch.tensor([1e39], dtype=F64), cl.BF16).item() == math.inf


def test_round_to_format_keeps_nan_signed_zeros_and_the_sign_of_what_overflows():
    x = torch.tensor([math.nan, -0.0, 0.0, -5e-324, math.inf, -math.inf, -1e39], dtype=F64)
    for fmt, top in ((cl.E4M3, 448.0), (cl.E5M2, 57344.0), (cl.BF16, math.inf), (cl.FP16, math.inf)):
        y = cl.round_to_format(x, fmt)
        assert math.isnan(y[0]), fmt.name
        assert y[1:].tolist() == [0.0, 0.0, 0.0, top, -top, -top], fmt.name
        assert torch.signbit(y[1:4]).tolist() == [True, False, True], fmt.name  # -0.0 and an underflow stay negative


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_round_to_format_is_torchs_own_cast_where_that_rounds_once(seed):
    """float32 values cast by torch to bf16 / fp16 (round to nearest even, once) are the spec's rounding, and so is
    e4m3 within its range (torch saturates nothing there); every float32 bit pattern can be drawn."""
    bits = torch.randint(-(2**31), 2**31, (4096,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = x[torch.isfinite(x)]
    for fmt, dtype in ((cl.BF16, torch.bfloat16), (cl.FP16, torch.float16)):
        assert torch.equal(cl.round_to_format(x.double(), fmt), x.to(dtype).double()), fmt.name
    small = x[x.abs() <= 448]
    assert torch.equal(cl.round_to_format(small.double(), cl.E4M3), small.to(torch.float8_e4m3fn).double())


# ------------------------------------------------------------------------------------------ pages


@pytest.mark.parametrize("layout", GROUPED + PER_TENSOR, ids=lambda l: l.name)
@given(p=st.integers(1, 5), nb=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_pages_round_trip(layout, p, nb, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nb * p, layout.token_bytes), generator=g, dtype=torch.uint8)
    assert torch.equal(cl.from_pages(cl.to_pages(raw, layout, p), layout, p), raw)


@given(p=st.integers(1, 4), seed=st.integers(0, 2**16), n_pad=st.integers(1, 3))
def test_write_pages_padding_and_read_tokens(p, seed, n_pad):
    lay = cl.FP8_DS_MLA_V4
    g = torch.Generator().manual_seed(seed)
    pages = torch.randint(0, 256, (3, cl.page_bytes(lay, p)), generator=g, dtype=torch.uint8)
    x = torch.randn(n_pad + 1, 512, generator=g, dtype=F64)
    slots = torch.tensor([-1] * n_pad + [p + 1 if p > 1 else 1])
    new = cl.write_pages(pages, x, slots, lay, p)
    rows = cl.read_tokens(new, lay, p, torch.tensor([-1, int(slots[-1])]))
    assert rows.valid.tolist() == [False, True] and torch.count_nonzero(rows.raw[0]) == 0
    assert torch.equal(rows.raw[1], cl.quantize(x[-1:], lay).raw[0])
    untouched = cl.from_pages(pages, lay, p)
    mask = torch.ones(3 * p, dtype=torch.bool)
    mask[int(slots[-1])] = False
    assert torch.equal(cl.from_pages(new, lay, p)[mask], untouched[mask])
    assert torch.equal(cl.write_pages(pages, x[:n_pad], slots[:n_pad], lay, p), pages)


# ------------------------------------------------------------------------------------------ detection


@settings(max_examples=10)  # 128 tokens of both layouts per example
@given(seed=st.integers(0, 2**16), log_mag=st.floats(-6, 4))
def test_v41_bytes_read_as_v4_and_back_are_detected(seed, log_mag):
    g = torch.Generator().manual_seed(seed)
    p = 64
    x = torch.randn(p * 2, 512, generator=g, dtype=F64) * 2.0**log_mag
    v4 = cl.to_pages(cl.quantize(x, cl.FP8_DS_MLA_V4).raw, cl.FP8_DS_MLA_V4, p)
    v41 = cl.to_pages(cl.quantize(x, cl.MXFP8_DS_MLA_V41).raw, cl.MXFP8_DS_MLA_V41, p)
    assert cl.detect_layout(v4, p) == ("fp8_ds_mla_v4",)
    assert cl.detect_layout(v41, p) == ("mxfp8_ds_mla_v41",)
    # the same bytes under the other geometry: V4.1 bytes cut into 584-byte records, V4 bytes into 528-byte ones
    as_v4 = v41.reshape(-1)[: (v41.numel() // 584) * 584].reshape(-1, 584)
    as_v41 = v4.reshape(-1)[: (v4.numel() // 528) * 528].reshape(-1, 528)
    assert not cl.validate_layout(as_v4, cl.FP8_DS_MLA_V4).ok
    assert not cl.validate_layout(as_v41, cl.MXFP8_DS_MLA_V41).ok
    # pages of one layout never match the other's page size either (for block size 64)
    assert v4.shape[1] != v41.shape[1]


def test_656_bytes_read_as_v41_are_detected():
    x = torch.randn(8, 576, dtype=F64)
    raw = cl.quantize(x, cl.FP8_DS_MLA_V32).raw
    check = cl.validate_layout(raw, cl.MXFP8_DS_MLA_V41)
    assert not check.ok and "528" in check.problems[0]
    reread = raw.reshape(-1)[: (raw.numel() // 528) * 528].reshape(-1, 528)
    assert not cl.validate_layout(reread, cl.MXFP8_DS_MLA_V41).ok


def test_bad_scale_bytes_are_reported():
    raw = cl.quantize(torch.randn(4, 576, dtype=F64), cl.FP8_DS_MLA_V32).raw.clone()
    raw[2, 512:516] = torch.tensor([0.0], dtype=torch.float32).view(torch.uint8)  # zero scale
    check = cl.validate_layout(raw, cl.FP8_DS_MLA_V32)
    assert not check.ok and check.plausible == 0.75 and "scales" in check.problems[0]


# ------------------------------------------------------------------------------------------ bad input


def test_exact_pages_worked_example_656_bytes():
    # P = 2, three entries, the middle one NaN (a hostile unused slot). Entry 0's groups are e4m3 values times 2^-2,
    # so FlashMLA's power-of-two rule holds them; entry 2's group amax is 1, whose scale 1/448 only vLLM's raw rule
    # reproduces.
    x = torch.zeros(3, 576, dtype=F64)
    x[0, :512] = torch.tensor([448.0, 1.0, -0.5, 0.0] * 128, dtype=F64) * 2.0**-2
    x[0, 512:] = 0.75  # bf16 RoPE, stored verbatim
    x[1, 7] = math.nan
    raw2 = cl.quantize(torch.linspace(-1.0, 1.0, 576, dtype=F64)[None], cl.FP8_DS_MLA_V32).raw
    x[2] = cl.dequantize(raw2, cl.FP8_DS_MLA_V32).entries[0]
    pages = cl.exact_pages(x[:2], cl.FP8_DS_MLA_V32, 2)  # entries 0 and 1: power-of-two scales
    assert pages.shape == (1, 2 * 656) and pages.dtype == torch.uint8
    rec = cl.from_pages(pages, cl.FP8_DS_MLA_V32, 2)
    assert cl.FP32.decode(rec[0, 512:528]).tolist() == [0.25] * 4
    assert torch.equal(cl.dequantize(rec[:1], cl.FP8_DS_MLA_V32).entries, x[:1])
    assert (rec[1] == 0xFF).all()
    pages = cl.exact_pages(x, cl.FP8_DS_MLA_V32, 2)  # entry 2 needs vLLM's raw amax / 448 scales: all take them
    rec = cl.from_pages(pages, cl.FP8_DS_MLA_V32, 2)
    assert pages.shape == (2, 2 * 656)
    assert cl.FP32.decode(rec[2, 512:516]).item() == cl.round_to_format(torch.tensor(1 / 448, dtype=F64), cl.FP32)
    assert torch.equal(cl.dequantize(rec[[0, 2]], cl.FP8_DS_MLA_V32).entries, x[[0, 2]])
    assert (rec[1] == 0xFF).all() and (rec[3] == 0xFF).all()  # the NaN entry and the padding of the last page


@pytest.mark.parametrize("layout", GROUPED, ids=lambda l: l.name)
@given(data=st.data())
def test_exact_pages_hold_the_entries_and_nothing_else(layout, data):
    x = data.draw(representable_entries(layout))
    t = x.shape[0]
    hostile = torch.tensor(data.draw(st.lists(st.booleans(), min_size=t, max_size=t)))
    p = data.draw(st.integers(1, 4))
    x[hostile, 3] = math.nan
    pages = cl.exact_pages(x, layout, p)
    assert pages.shape == (-(-t // p), cl.page_bytes(layout, p))
    rec = cl.from_pages(pages, layout, p)
    assert torch.equal(cl.dequantize(rec[:t][~hostile], layout).entries, x[~hostile])
    assert (rec[:t][hostile] == 0xFF).all() and (rec[t:] == 0xFF).all()
    if bool((~hostile).any()):  # one float64 ulp off a finite value: no scale rule holds it, so it is refused
        row = int(torch.nonzero(~hostile)[0])
        x[row, 1] = torch.nextafter(x[row, 1], torch.tensor(math.inf, dtype=F64))
        with pytest.raises(ValueError, match="entries"):
            cl.exact_pages(x, layout, p)


def test_bad_input_raises_naming_the_argument():
    x = torch.zeros(2, 576, dtype=F64)
    with pytest.raises(ValueError, match="entries"):
        cl.quantize(torch.zeros(2, 512, dtype=F64), cl.FP8_DS_MLA_V32)
    with pytest.raises(TypeError, match="entries"):
        cl.quantize(x.to(torch.int32), cl.FP8_DS_MLA_V32)
    with pytest.raises(ValueError, match="scale"):
        cl.quantize(x, cl.FP8_PER_TENSOR)
    with pytest.raises(ValueError, match="scale"):
        cl.quantize(x, cl.FP8_PER_TENSOR, scale=-1.0)
    with pytest.raises(ValueError, match="scale"):
        cl.quantize(x, cl.FP8_DS_MLA_V32, scale=1.0)
    with pytest.raises(ValueError, match="pow2_scales"):
        cl.quantize(torch.zeros(1, 512, dtype=F64), cl.FP8_DS_MLA_V4, pow2_scales=True)
    with pytest.raises(ValueError, match="e8m0_rule"):
        cl.quantize(x, cl.FP8_DS_MLA_V32, e8m0_rule="vllm_fp32")
    with pytest.raises(ValueError, match="e8m0_rule"):
        cl.quantize(torch.zeros(1, 512, dtype=F64), cl.FP8_DS_MLA_V4, e8m0_rule="fp32")
    with pytest.raises(ValueError, match="layout"):
        cl.quantize(x, "fp9")
    with pytest.raises(TypeError, match="raw"):
        cl.dequantize(torch.zeros(2, 656, dtype=F64), cl.FP8_DS_MLA_V32)
    with pytest.raises(ValueError, match="raw"):
        cl.to_pages(torch.zeros(3, 656, dtype=torch.uint8), cl.FP8_DS_MLA_V32, 2)
    with pytest.raises(ValueError, match="pages"):
        cl.from_pages(torch.zeros(1, 100, dtype=torch.uint8), cl.FP8_DS_MLA_V32, 2)
    pages = torch.zeros(2, cl.page_bytes(cl.FP8_DS_MLA_V32, 2), dtype=torch.uint8)
    with pytest.raises(ValueError, match="slots"):
        cl.read_tokens(pages, cl.FP8_DS_MLA_V32, 2, torch.tensor([4]))
    with pytest.raises(ValueError, match="slot_mapping"):
        cl.write_pages(pages, x[:2], torch.tensor([1, 1]), cl.FP8_DS_MLA_V32, 2)
    with pytest.raises(ValueError, match="block_size"):
        cl.page_bytes(cl.FP8_DS_MLA_V32, 0)
    with pytest.raises(ValueError, match="layout"):
        cl.exact_pages(x, cl.FP8_PER_TENSOR, 2)
    with pytest.raises(TypeError, match="entries"):
        cl.exact_pages(x.to(torch.int32), cl.FP8_DS_MLA_V32, 2)
    with pytest.raises(ValueError, match="entries"):
        cl.exact_pages(torch.zeros(2, 512, dtype=F64), cl.FP8_DS_MLA_V32, 2)
    with pytest.raises(ValueError, match="block_size"):
        cl.exact_pages(x, cl.FP8_DS_MLA_V32, 0)
    with pytest.raises(ValueError, match="entries must be exactly representable"):
        cl.exact_pages(torch.full((1, 576), 0.3, dtype=F64), cl.FP8_DS_MLA_V32, 2)


# ------------------------------------------------------------------------------------------ viz


def test_byte_diagram_is_drawn_from_the_layout_data():
    from mlaspec.conformance.viz.layouts import draw_block_table, draw_byte_layout

    fig = draw_byte_layout(cl.FP8_DS_MLA_V32)
    assert len(fig.axes[0].patches) == len(cl.FP8_DS_MLA_V32.fields)
    assert len(draw_byte_layout(cl.FP8_DS_MLA_V4, block_size=2).axes) == 2  # record + page panel
    assert len(draw_byte_layout(cl.MXFP8_DS_MLA_V41, block_size=2).axes) == 2  # V4.1 pages are split too
    fig = draw_block_table(torch.tensor([[3, 1], [0, 0]]), torch.tensor([5, 2]), 4)
    assert len(fig.axes) == 2
