"""Tests of mlaspec.spec.cost: the counts against what spec/forms.py actually computes, and the model's properties."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from mlaspec.spec import forms
from mlaspec.spec.attention import causal_mask
from mlaspec.spec.config import MLAConfig
from mlaspec.spec.cost import (
    FORMS,
    H200_BANDWIDTH,
    H200_PEAK_FLOPS,
    attention_pairs,
    crossover,
    mla_cost,
    time_estimate,
)

V3 = MLAConfig.deepseek_v3()
F64 = 8  # bytes per float64 element: the spec computes in float64


class EinsumRecorder(TorchFunctionMode):
    """Records the FLOPs of every ``torch.einsum`` the spec calls, in call order, from the equation and shapes.

    An einsum does one multiply-add per assignment of its indices: ``2 * prod(size of every distinct letter)``.
    Counted at the torch-function level, so how torch lowers it (bmm, or mul + sum for size-1 dims) is irrelevant.
    """

    def __init__(self):
        super().__init__()
        self.flops: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.einsum:
            equation, *operands = args
            sizes = {}
            for term, x in zip(equation.replace(" ", "").split("->")[0].split(","), operands):
                if "..." in term:  # the leading dims get names of their own ("0", "1", ...)
                    lead = x.dim() - (len(term) - 3)
                    term = term.replace("...", "".join(str(i) for i in range(lead)))
                sizes.update(zip(term, x.shape))
            self.flops.append(2 * math.prod(sizes.values()))
        return func(*args, **(kwargs or {}))


@st.composite
def problems(draw):
    """A tiny MLA problem with all widths distinct-ish, so a formula that swaps D_nope for D_v (say) is caught."""
    config = MLAConfig.tiny(
        num_heads=draw(st.integers(1, 3)),
        kv_lora_rank=draw(st.integers(2, 12)),
        qk_nope_head_dim=draw(st.integers(1, 6)),
        qk_rope_head_dim=draw(st.sampled_from([2, 4, 6])),
        v_head_dim=draw(st.integers(1, 6)),
    )
    b = draw(st.integers(1, 2))
    s_kv = draw(st.integers(1, 6))
    s_q = draw(st.integers(1, s_kv))
    c = config
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    tensors = dict(
        q_nope=r(b, s_q, c.num_heads, c.qk_nope_head_dim),
        q_pe=r(b, s_q, c.num_heads, c.qk_rope_head_dim),
        kv_c=r(b, s_kv, c.kv_lora_rank),
        k_pe=r(b, s_kv, c.qk_rope_head_dim),
        W_UK=r(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim),
        W_UV=r(c.kv_lora_rank, c.num_heads, c.v_head_dim),
    )
    return config, b, s_q, s_kv, tensors


def _run(form, t):
    fn = forms.mla_mha if form == "mha" else forms.mla_absorbed
    return fn(t["q_nope"], t["q_pe"], t["kv_c"], t["k_pe"], t["W_UK"], t["W_UV"], scale=0.3)


@pytest.mark.parametrize("form", FORMS)
@given(problem=problems())
def test_mla_cost_flops_equal_the_matmuls_forms_performs(form, problem):
    config, b, s_q, s_kv, t = problem
    cost = mla_cost(form, b, s_q, s_kv, dtype=torch.float64, config=config)
    with EinsumRecorder() as rec:
        _run(form, t)
    assert len(rec.flops) == 4, rec.flops
    if form == "mha":  # kv_c @ W_UK, kv_c @ W_UV, q @ k^T, p @ v
        up_k, up_v, qk, pv = rec.flops
        assert (cost.up_projection_flops, cost.absorption_flops) == (up_k + up_v, 0)
    else:  # q_nope @ W_UK^T, q @ kv^T, p @ kv_c, o_lat @ W_UV
        absorb, qk, pv, unabsorb = rec.flops
        assert (cost.up_projection_flops, cost.absorption_flops) == (0, absorb + unabsorb)
    assert (cost.qk_flops, cost.pv_flops) == (qk, pv)
    assert cost.flops == sum(rec.flops)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("b, s_q, s_kv", [(1, 1, 7), (2, 3, 5), (3, 4, 4)])
def test_mla_cost_flops_equal_torch_flop_counter(form, b, s_q, s_kv):
    """Independent of our own counting: torch's FlopCounterMode over the aten matmuls the forms run."""
    c = MLAConfig.tiny()
    g = torch.Generator().manual_seed(0)
    shapes = dict(
        q_nope=(b, s_q, c.num_heads, c.qk_nope_head_dim),
        q_pe=(b, s_q, c.num_heads, c.qk_rope_head_dim),
        kv_c=(b, s_kv, c.kv_lora_rank),
        k_pe=(b, s_kv, c.qk_rope_head_dim),
        W_UK=(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim),
        W_UV=(c.kv_lora_rank, c.num_heads, c.v_head_dim),
    )
    t = {k: torch.randn(*v, generator=g, dtype=torch.float64) for k, v in shapes.items()}
    with FlopCounterMode(display=False) as counter:
        _run(form, t)
    assert mla_cost(form, b, s_q, s_kv, config=c).flops == counter.get_total_flops()


@given(problem=problems())
def test_mla_cost_bytes_of_mha_equal_the_tensors_it_builds(problem):
    config, b, s_q, s_kv, t = problem
    seen = {}

    def spy(q, k, v, **kw):
        seen.update(q=q, k=k, v=v)
        return forms_attention(q, k, v, **kw)

    forms_attention = forms.attention
    with pytest.MonkeyPatch.context() as mp:  # per example: hypothesis refuses function-scoped fixtures
        mp.setattr(forms, "attention", spy)
        out, _ = _run("mha", t)
    cost = mla_cost("mha", b, s_q, s_kv, dtype=torch.float64, config=config)
    assert cost.cache_bytes == (t["kv_c"].numel() + t["k_pe"].numel()) * F64
    assert cost.weight_bytes == (t["W_UK"].numel() + t["W_UV"].numel()) * F64
    assert cost.io_bytes == (t["q_nope"].numel() + t["q_pe"].numel() + out.numel()) * F64
    assert cost.materialized_bytes == 2 * (seen["k"].numel() + seen["v"].numel()) * F64  # written, read back


@given(problem=problems())
def test_mla_cost_bytes_of_absorbed_equal_the_tensors_it_builds(problem):
    config, b, s_q, s_kv, t = problem
    seen = {}

    def spy(q, kv, **kw):
        result = forms_mqa(q, kv, **kw)
        seen.update(q=q, kv=kv, o_lat=result.out)
        return result

    forms_mqa = forms.mqa_latent_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forms, "mqa_latent_attention", spy)
        out, _ = _run("absorbed", t)
    cost = mla_cost("absorbed", b, s_q, s_kv, dtype=torch.float64, config=config)
    assert cost.cache_bytes == seen["kv"].numel() * F64  # the [B, S_kv, Lkv + D_rope] entries
    assert cost.weight_bytes == (t["W_UK"].numel() + t["W_UV"].numel()) * F64
    assert cost.io_bytes == (t["q_nope"].numel() + t["q_pe"].numel() + out.numel()) * F64
    assert cost.materialized_bytes == 2 * (seen["q"].numel() + seen["o_lat"].numel()) * F64


def test_mla_cost_worked_example_decode_reads_576_wide_entries():
    cost = mla_cost("absorbed", 1, 1, 4096)  # DeepSeek-V3, bf16
    assert cost.cache_bytes == 4096 * 576 * 2 == 4_718_592
    assert cost.weight_bytes == 512 * 128 * (128 + 128) * 2
    assert cost.qk_flops == 2 * 128 * 4096 * 576
    assert time_estimate(cost).bound == "memory"


@given(s_kv=st.integers(1, 40), data=st.data())
def test_attention_pairs_counts_the_causal_mask(s_kv, data):
    s_q = data.draw(st.integers(1, s_kv))
    assert attention_pairs(s_q, s_kv, causal=True) == int(causal_mask(s_q, s_kv).sum())
    assert attention_pairs(s_q, s_kv) == s_q * s_kv


configs = st.sampled_from([V3, V3.tensor_parallel(8), MLAConfig.tiny()])


@pytest.mark.parametrize("form", FORMS)
@given(config=configs, b=st.integers(1, 64), s_kv=st.integers(1, 10**5), data=st.data(), causal=st.booleans())
def test_mla_cost_grows_with_s_kv_and_s_q(form, config, b, s_kv, data, causal):
    s_q = data.draw(st.integers(1, s_kv))
    cost = mla_cost(form, b, s_q, s_kv, config=config, causal=causal)
    longer = mla_cost(form, b, s_q, s_kv + 1, config=config, causal=causal)
    assert longer.flops > cost.flops and longer.bytes > cost.bytes
    if s_q < s_kv:
        more = mla_cost(form, b, s_q + 1, s_kv, config=config, causal=causal)
        assert more.flops > cost.flops and more.bytes > cost.bytes


@pytest.mark.parametrize("form", FORMS)
@given(b=st.integers(1, 16), s_kv=st.integers(1, 10**4), data=st.data())
def test_mla_cost_flops_are_linear_in_batch(form, b, s_kv, data):
    s_q = data.draw(st.integers(1, s_kv))
    assert mla_cost(form, 2 * b, s_q, s_kv).flops == 2 * mla_cost(form, b, s_q, s_kv).flops


@given(b=st.integers(1, 64), s_kv=st.integers(1, 10**5), n=st.integers(1, 128), data=st.data())
def test_mla_cost_absorbed_cache_read_does_not_depend_on_heads(b, s_kv, n, data):
    s_q = data.draw(st.integers(1, s_kv))
    one, many = (mla_cost("absorbed", b, s_q, s_kv, num_heads=h) for h in (1, n))
    assert one.cache_bytes == many.cache_bytes == b * s_kv * 576 * 2
    mha_one, mha_many = (mla_cost("mha", b, s_q, s_kv, num_heads=h) for h in (1, n))
    assert mha_many.materialized_bytes == n * mha_one.materialized_bytes  # k and v grow with every head


def _t(form, b, s_q, s_kv, **kw):
    return time_estimate(mla_cost(form, b, s_q, s_kv, **kw)).seconds


@given(b=st.integers(1, 64), s_kv=st.integers(1024, 2**17), n=st.sampled_from([16, 32, 64, 128]), causal=st.booleans())
def test_crossover_absorbed_wins_decode_at_long_context(b, s_kv, n, causal):
    assert _t("absorbed", b, 1, s_kv, num_heads=n, causal=causal) < _t("mha", b, 1, s_kv, num_heads=n, causal=causal)
    assert crossover(s_kv, batch=b, num_heads=n, causal=causal).s_q > 1


@given(b=st.integers(1, 64), s_kv=st.integers(4096, 2**17), n=st.sampled_from([16, 32, 64, 128]), causal=st.booleans())
def test_crossover_mha_wins_long_prefill(b, s_kv, n, causal):
    kw = dict(num_heads=n, causal=causal)
    assert _t("mha", b, s_kv, s_kv, **kw) < _t("absorbed", b, s_kv, s_kv, **kw)
    assert crossover(s_kv, batch=b, num_heads=n, causal=causal).s_q < s_kv


@settings(max_examples=15)
@given(config=configs, b=st.integers(1, 8), s_kv=st.integers(1, 300), causal=st.booleans())
def test_crossover_is_the_first_query_length_where_mha_is_faster(config, b, s_kv, causal):
    kw = dict(config=config, causal=causal)
    result = crossover(s_kv, batch=b, **kw)
    end = s_kv if result.s_q is None else result.s_q - 1
    for s_q in range(1, end + 1):  # brute force, through the exact integer path
        assert _t("mha", b, s_q, s_kv, **kw) >= _t("absorbed", b, s_q, s_kv, **kw), s_q
    if result.s_q is not None:
        assert _t("mha", b, result.s_q, s_kv, **kw) < _t("absorbed", b, result.s_q, s_kv, **kw)
        assert math.isclose(result.mha_seconds, _t("mha", b, result.s_q, s_kv, **kw))


@pytest.mark.parametrize("s_kv", [1024, 8192, 2**17])
def test_crossover_matches_the_compute_bound_closed_form(s_kv):
    lkv, p, v = 512, 128, 128
    approx = lkv * (p + v) / (2 * lkv - p - v + lkv * (p + v) / s_kv)  # cost.crossover docstring
    assert abs(crossover(s_kv).s_q - math.ceil(approx)) <= 1


def test_crossover_does_not_depend_on_batch_or_heads_when_compute_bound():
    base = crossover(32768).s_q
    assert crossover(32768, batch=32).s_q == crossover(32768, num_heads=16).s_q == base


def test_time_estimate_is_the_roofline_max():
    cost = mla_cost("mha", 2, 512, 4096)
    est = time_estimate(cost, peak_flops=1e12, bandwidth=1e9)
    assert est.compute_seconds == cost.flops / 1e12 and est.memory_seconds == cost.bytes / 1e9
    assert est.seconds == max(est.compute_seconds, est.memory_seconds)
    assert est.bound == ("compute" if est.compute_seconds >= est.memory_seconds else "memory")
    assert time_estimate(cost) == time_estimate(cost, H200_PEAK_FLOPS, H200_BANDWIDTH)


def test_form_cost_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        mla_cost("mha", 1, 1, 1).qk_flops = 0


def test_mla_cost_accepts_dtype_or_bytes():
    assert mla_cost("mha", 1, 3, 7, dtype=torch.float8_e4m3fn) == mla_cost("mha", 1, 3, 7, dtype=1)
    assert mla_cost("absorbed", 1, 3, 7, dtype=torch.float32).dtype_bytes == 4


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(form="flash"), ValueError, "form"),
        (dict(batch=0), ValueError, "batch"),
        (dict(batch=True), TypeError, "batch"),
        (dict(s_q=0), ValueError, "s_q"),
        (dict(s_q=9), ValueError, "s_q"),  # more queries than keys
        (dict(s_kv=0), ValueError, "s_kv"),
        (dict(s_q=2.0), TypeError, "s_q"),
        (dict(num_heads=0), ValueError, "num_heads"),
        (dict(dtype="bf16"), TypeError, "dtype"),
        (dict(dtype=0), ValueError, "dtype"),
        (dict(config={"num_heads": 8}), TypeError, "config"),
        (dict(causal=1), TypeError, "causal"),
    ],
)
def test_mla_cost_bad_input_names_the_argument(kwargs, error, name):
    args = dict(form="mha", batch=1, s_q=2, s_kv=8) | kwargs
    with pytest.raises(error, match=name):
        mla_cost(args.pop("form"), args.pop("batch"), args.pop("s_q"), args.pop("s_kv"), **args)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(peak_flops=0), ValueError, "peak_flops"),
        (dict(bandwidth=float("nan")), ValueError, "bandwidth"),
        (dict(bandwidth="fast"), TypeError, "bandwidth"),
    ],
)
def test_time_estimate_and_crossover_bad_input_names_the_argument(kwargs, error, name):
    with pytest.raises(error, match=name):
        time_estimate(mla_cost("mha", 1, 1, 8), **kwargs)
    with pytest.raises(error, match=name):
        crossover(8, **kwargs)


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda: time_estimate({"flops": 1}), TypeError, "cost"),
        (lambda: crossover(0), ValueError, "s_kv"),
        (lambda: crossover(8, num_heads=-1), ValueError, "num_heads"),
        (lambda: crossover(8, dtype=None), TypeError, "dtype"),
        (lambda: attention_pairs(3, 2), ValueError, "s_q"),
    ],
)
def test_other_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()
