"""The cache writers of the conformance cases: vLLM's worked example, what a case hands a backend, and the
bf16-scale reading the ``scales_in_bf16`` departure takes as its reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaspec.conformance.ops.writers import WRITERS, read_as, written
from mlaspec.spec import cache_layouts as cl

FLT_MIN = torch.finfo(torch.float32).tiny


def _vllm_example() -> torch.Tensor:
    """vLLM's ``test_sparse_flashmla_decode_matches_cache_writer_scales`` (``tests/kernels/attention/
    test_flashmla_sparse.py``): ``kv_c`` all 336 but the last 128-group 0, ``k_pe`` 0, one token."""
    x = torch.zeros(1, 576, dtype=torch.float64)
    x[0, :384] = 336.0
    return x


def _scales(raw: torch.Tensor) -> list[float]:
    return raw[0, 512:528].contiguous().view(torch.float32).tolist()


def test_vllm_example_power_of_two_writer():
    raw = WRITERS["vllm-pow2"](_vllm_example())
    assert _scales(raw) == [1.0, 1.0, 1.0, 2.0**-13]  # vLLM's expected_scales
    nope = raw[0, :384].view(torch.float8_e4m3fn).double()
    assert bool((nope == 320.0).all())  # 336 is a tie between e4m3 320 and 352: to even
    assert torch.equal(raw, WRITERS["flashmla"](_vllm_example()))  # one contract, FlashMLA's


def test_vllm_example_raw_writer():
    raw = WRITERS["vllm-0.33"](_vllm_example())
    assert _scales(raw) == [0.75, 0.75, 0.75, FLT_MIN]  # 336 / 448, and FLT_MIN for the zero group
    assert torch.equal(cl.dequantize(raw, cl.FP8_DS_MLA_V32).entries, _vllm_example())  # 448 * 0.75 = 336


def test_written_keeps_the_case_dtype_only_where_it_is_exact():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 16, 576, generator=g).to(torch.bfloat16)
    assert written(cache, "flashmla").dtype == torch.bfloat16
    raw = written(cache, "vllm-0.33")
    assert raw.dtype == torch.float64 and raw.shape == cache.shape
    assert not torch.equal(raw.to(torch.bfloat16).double(), raw)  # bf16 cannot hold e4m3 * amax / 448
    with pytest.raises(ValueError, match="writer"):
        written(cache, "vllm-per-tensor")


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), magnitude=st.sampled_from([1e-3, 1.0, 300.0]))
def test_a_bf16_scale_read_is_exact_on_power_of_two_scales_and_a_bf16_product_on_raw(seed, magnitude):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 576, generator=g, dtype=torch.float64) * magnitude
    pow2 = written(x, "vllm-pow2")
    assert torch.equal(read_as(pow2, "bf16", "bf16"), pow2)
    raw = written(x, "vllm-0.33")
    got = read_as(raw, "bf16", "bf16")
    records = WRITERS["vllm-0.33"](x)
    e4m3 = records[:, :512].contiguous().view(torch.float8_e4m3fn).double().reshape(8, 4, 128)
    s = cl.round_to_format(records[:, 512:528].contiguous().view(torch.float32).double(), cl.BF16)
    assert torch.equal(got[:, :512], cl.round_to_format(e4m3 * s[..., None], cl.BF16).reshape(8, 512))
    assert torch.equal(got[:, 512:], raw[:, 512:])  # the bf16 RoPE as stored
    keys_only = read_as(raw, "bf16")  # the scale as stored, the key rounded: one rounding of each value
    assert torch.equal(keys_only, cl.round_to_format(raw, cl.BF16))


def test_a_bf16_scale_read_leaves_hostile_rows_and_non_fp8_caches_alone():
    x = written(torch.randn(4, 576, dtype=torch.float64), "vllm-0.33")
    x[1] = float("nan")
    got = read_as(x, "bf16", "bf16")
    assert torch.isnan(got[1]).all() and not torch.equal(got[0], x[0])
    plain = torch.randn(4, 576, dtype=torch.float64)  # no fp8 record holds it: no fp8 reader runs on it
    assert torch.equal(read_as(plain, "bf16", "bf16"), plain)
