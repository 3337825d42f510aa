"""The Triton DCP combine (impl/dcp.py) through Triton's interpreter, against the float64 spec combine, and the
``dcp_decode`` / ``dcp_decode_fp8`` ops run by the ``triton`` adapter (paged decode per rank, over the cache entries
or the fp8 records, + this combine). fp16 / fp32 only (the
interpreter's bf16 ``tl.dot`` is wrong, and the op's decode multiplies matrices)."""

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

from mlaspec.conformance.backends.triton import TritonBackend
from mlaspec.conformance.cases import Case
from mlaspec.conformance.ops import unit_roundoff
from mlaspec.conformance.ops.dcp import FP8_CACHE
from mlaspec.conformance.runner import run_case
from mlaspec.impl.dcp import dcp_combine
from mlaspec.spec import dcp as spec_dcp

pytestmark = pytest.mark.interpreter


def _spec(outs, lses, base=math.e):
    """The spec combine on the kernel's layouts ``[N, B, H, D]`` / ``[N, B, H]`` (as S_q = 1)."""
    got = spec_dcp.dcp_combine(outs[:, :, None], lses[..., None], lse_base=base)
    return got.out[:, 0], got.lse[..., 0]


@settings(max_examples=15, deadline=None)
@given(
    n=st.sampled_from([1, 2, 3, 4, 8]),
    b=st.integers(1, 3),
    h=st.integers(1, 4),
    d=st.sampled_from([1, 7, 16, 512]),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    base_e=st.booleans(),
    seed=st.integers(0, 99),
)
def test_combine_matches_spec(n, b, h, d, dtype, base_e, seed):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, b, h, d, generator=g).to(dtype)
    lses = torch.randn(n, b, h, generator=g) * 5
    empty = torch.rand(n, b, h, generator=g) < 0.3  # empty shares, written -inf, +inf or NaN
    lses = torch.where(
        empty, torch.tensor([-math.inf, math.inf, math.nan])[torch.randint(3, (n, b, h), generator=g)], lses
    )
    outs = torch.where(empty[..., None] & (torch.rand(n, b, h, 1, generator=g) < 0.5), math.nan, outs.float()).to(dtype)
    got = dcp_combine(outs, lses, is_lse_base_on_e=base_e)
    ref_out, ref_lse = _spec(outs, lses, math.e if base_e else 2)
    u = unit_roundoff(dtype)
    # fp32 weights (N-term sums, relative N eps32 each) and one rounding of the output to the case dtype
    mag = spec_dcp.dcp_combine(
        outs.abs()[:, :, None].nan_to_num(0.0), lses[..., None], lse_base=math.e if base_e else 2
    )
    bound = u * ref_out.abs() + 4 * (n + 2) * 2.0**-24 * mag.out[:, 0]
    assert torch.equal(torch.isneginf(got.lse), torch.isneginf(ref_lse))
    assert bool(((got.out.double() - ref_out).abs() <= bound).all())
    fin = torch.isfinite(ref_lse)
    assert bool(((got.lse.double() - ref_lse)[fin].abs() <= 4 * (n + 2) * 2.0**-24 * (1 + ref_lse[fin].abs())).all())


def test_all_empty_is_zero_and_neg_inf():
    outs = torch.full((2, 1, 1, 4), math.nan)
    got = dcp_combine(outs, torch.tensor([[[math.inf]], [[-math.inf]]]))
    assert bool((got.out == 0).all()) and bool(torch.isneginf(got.lse).all())


def test_base_two_differs_from_natural():
    """Reading log2 LSEs as natural logs weighs the ranks wrongly: the base matters."""
    outs = torch.tensor([1.0, 0.0]).reshape(2, 1, 1, 1)
    lses = torch.tensor([3.0, 0.0]).reshape(2, 1, 1)
    e, two = dcp_combine(outs, lses).out.item(), dcp_combine(outs, lses, is_lse_base_on_e=False).out.item()
    assert math.isclose(e, math.e**3 / (math.e**3 + 1), rel_tol=1e-6) and math.isclose(two, 8 / 9, rel_tol=1e-6)


@pytest.mark.parametrize(
    "name, params",
    [
        ("ragged-dcp4-i16", dict(B=3, S_q=1, S_kv=40, seq_lens=[40, 1, 17], H_q=16, world_size=4, interleave=16)),
        ("mtp2-dcp2-i1", dict(B=2, S_q=2, S_kv=37, H_q=16, world_size=2, interleave=1)),
    ],
)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_dcp_decode_op_triton(name, params, dtype):
    case = Case("dcp_decode", name, dtype, dict(params, D_qk=576, D_v=512, causal=True))
    result = run_case(TritonBackend(), case, backend_name="triton")
    assert result.verdict == "pass", result.reason


@pytest.mark.parametrize(
    "name, params",
    [
        ("ragged-dcp4-i16", dict(B=3, S_q=1, S_kv=40, seq_lens=[40, 0, 17], H_q=16, world_size=4, interleave=16)),
        ("mtp2-dcp2-i1", dict(B=2, S_q=2, S_kv=37, H_q=16, world_size=2, interleave=1)),
    ],
)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_dcp_decode_fp8_op_triton(name, params, dtype):
    """Each rank's share of vLLM's per-tensor fp8 records through the fp8 paged decode, then the Triton combine."""
    case = Case("dcp_decode_fp8", name, dtype, dict(params, D_qk=576, D_v=512, causal=True, **FP8_CACHE))
    result = run_case(TritonBackend(), case, backend_name="triton")
    assert result.verdict == "pass", result.reason
