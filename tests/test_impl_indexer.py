"""The indexer kernels of ``mlaspec.impl.indexer`` through Triton's interpreter, against the float64 spec.

Harness cases (the curated tiny ones, every dtype: the kernels take fp8 / fp32 inputs, so bf16 runs here too) go
through the composed backend ``TritonWithIndexer``; kernel-level checks use awkward shapes: ragged spans with an
empty row and spans starting past 0, NaN keys outside every span, a shuffled paged cache with NaN in unused blocks,
1-D and 2-D context lengths for next_n 1..4, and top-k rows with ties at the K-th value, -inf inside the range,
+inf garbage outside it and fewer than K valid keys.
"""

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

from mlaspec.conformance.backends.triton import TritonBackend as TritonWithIndexer
from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.ops.indexer import logits_bound
from mlaspec.conformance.runner import run_case
from mlaspec.impl.indexer import indexer_logits, paged_indexer_logits, topk_indices
from mlaspec.spec import indexer as spec
from mlaspec.spec.topk import topk_agreement
from tests.kernel_checks import assert_logits, indexer_case

pytestmark = pytest.mark.interpreter
OPS = ("indexer_logits", "paged_indexer_logits", "topk_indices")


@pytest.mark.parametrize("case", curated_cases(ops=OPS, dtypes=("bfloat16", "float16", "float32")), ids=str)
def test_harness_cases(case):
    r = run_case(TritonWithIndexer(), case, backend_name="triton")
    assert r.verdict == "pass", f"{case.id}: {r.verdict}: {r.reason}"


def test_composed_backend_declares_the_ops():
    b = TritonWithIndexer()
    assert set(OPS) <= b.ops and {"attention", "mla_decode"} <= b.ops


# -- ragged logits ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,h", [(1, 17, 16), (7, 203, 8), (5, 131, 4), (3, 300, 64)])
def test_indexer_logits_awkward_shapes(m, n, h):
    q, k, w, ks, ke, k_scale = indexer_case(m * n + h, m, n, h, 32)
    got = indexer_logits(q, k, w, ks, ke, k_scale, block_n=32, tiles=2)
    ref = spec.indexer_logits(q, k, w, ks, ke, k_scale)
    assert_logits(got, ref, logits_bound(q, k, w, k_scale))


def test_indexer_logits_without_scale_and_all_columns_minus_inf_outside():
    q, k, w, ks, ke, _ = indexer_case(3, 6, 90, 8, 16)
    k = k.view(torch.uint8).masked_fill(k.view(torch.uint8) == 0x7F, 0x38).view(torch.float8_e4m3fn)  # finite keys
    got = indexer_logits(q, k, w, ks, ke)
    assert_logits(got, spec.indexer_logits(q, k, w, ks, ke), logits_bound(q, k, w, None))


@settings(max_examples=8)
@given(st.integers(1, 9), st.integers(1, 80), st.sampled_from([2, 4, 8]), st.integers(0, 2**16))
def test_indexer_logits_property(m, n, h, seed):
    q, k, w, ks, ke, k_scale = indexer_case(seed, m, n, h, 16, starts_past_zero=n > 1)
    got = indexer_logits(q, k, w, ks, ke, k_scale, block_n=16, tiles=1)
    assert_logits(got, spec.indexer_logits(q, k, w, ks, ke, k_scale), logits_bound(q, k, w, k_scale))


def test_indexer_logits_rejects_float_q():
    with pytest.raises(TypeError, match="q"):
        indexer_logits(
            torch.zeros(2, 4, 16),
            torch.zeros(3, 16).to(torch.float8_e4m3fn),
            torch.zeros(2, 4),
            torch.zeros(2, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32),
        )


def test_indexer_logits_rejects_non_power_of_two_heads():
    with pytest.raises(ValueError, match="H"):
        f8 = torch.zeros(2, 3, 16).to(torch.float8_e4m3fn)
        indexer_logits(
            f8,
            torch.zeros(3, 16).to(torch.float8_e4m3fn),
            torch.zeros(2, 3),
            torch.zeros(2, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32),
        )


# -- paged logits ----------------------------------------------------------------------------------------------------
def _paged(seed, b, next_n, p, h, d, seq_lens, *, lens_2d):
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // p) for s in seq_lens]
    nb = sum(need) + 2
    pool = 1 + torch.randperm(nb - 2, generator=g)  # blocks 0 and nb - 1 stay NaN
    table = torch.zeros(b, max(need) + 1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = pool[at : at + n].int()
        at += n
    slots = torch.cat([table[i, torch.arange(s) // p].long() * p + torch.arange(s) % p for i, s in enumerate(seq_lens)])
    keys = torch.randn(slots.numel(), d, generator=g, dtype=torch.float64)
    cache = spec.write_indexer_k_cache(spec.IndexerCacheLayout(p, d).empty(nb), keys, slots)
    qq = spec.quantize_indexer_q(
        torch.randn(b * next_n, h, d, generator=g, dtype=torch.float64) * 2,
        torch.randn(b * next_n, h, generator=g, dtype=torch.float64),
    )
    lens = torch.tensor(seq_lens)
    ctx = spec.decode_context_lens_native(lens, next_n) if lens_2d else lens
    return qq.q_fp8.reshape(b, next_n, h, d), cache, table, ctx.int(), qq.weights.float()


@pytest.mark.parametrize("next_n,lens_2d", [(1, False), (2, True), (3, True), (4, False)])
def test_paged_indexer_logits_mtp(next_n, lens_2d):
    seq_lens = [37, next_n, 0, 70][:4]
    q, cache, table, ctx, w = _paged(next_n, 4, next_n, 16, 8, 32, seq_lens, lens_2d=lens_2d)
    width = max(seq_lens) + 5
    got = paged_indexer_logits(q, cache, table, ctx, w, max_context_len=width, block_n=16, tiles=2)
    ref = spec.paged_indexer_logits(q, cache, table, ctx, w, max_context_len=width)
    # bound: the same keys read back through the spec's reader
    bound = torch.zeros_like(ref)
    for b, s in enumerate(seq_lens):
        if s == 0:
            continue
        x = torch.arange(s)
        k_fp8, k_scale = spec.read_indexer_k_cache(cache, table[b, x // 16].long() * 16 + x % 16)
        rows = slice(b * next_n, (b + 1) * next_n)
        bound[rows, :s] = logits_bound(q[b], k_fp8, w[rows], k_scale)
    assert_logits(got, ref, bound)


def test_paged_indexer_logits_default_width():
    q, cache, table, ctx, w = _paged(9, 2, 1, 16, 16, 16, [5, 33], lens_2d=False)
    got = paged_indexer_logits(q, cache, table, ctx, w)
    assert got.shape == (2, 33)
    assert torch.equal(torch.isinf(got), torch.isinf(spec.paged_indexer_logits(q, cache, table, ctx, w)))


def test_paged_indexer_logits_rejects_wrong_cache_width():
    q = torch.zeros(1, 1, 8, 16).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="cache"):
        paged_indexer_logits(
            q,
            torch.zeros(2, 16, 16, dtype=torch.uint8),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            torch.zeros(1, 8),
        )


# -- top-k -----------------------------------------------------------------------------------------------------------
def _topk_logits(seed, m, n):
    g = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(m, n, generator=g, dtype=torch.float64) * 2) / 2  # a coarse grid: ties
    x = x.masked_fill(torch.rand(m, n, generator=g) < 0.1, -math.inf)
    starts = torch.randint(0, max(n // 3, 1), (m,), generator=g)
    ends = torch.minimum(starts + torch.randint(0, n + 5, (m,), generator=g), torch.tensor(n + 3))  # past N too
    cols = torch.arange(n)[None, :]
    inside = (cols >= starts[:, None]) & (cols < ends[:, None])
    x = torch.where(inside, x, torch.where(torch.rand(m, n, generator=g) < 0.5, math.inf, 1e30))  # garbage
    return x.float(), starts.int(), ends.int()


@pytest.mark.parametrize("m,n,k", [(5, 1, 1), (9, 70, 16), (4, 1500, 37), (3, 40, 64), (6, 257, 256)])
@pytest.mark.parametrize("relative", [False, True])
def test_topk_awkward_shapes(m, n, k, relative):
    x, starts, ends = _topk_logits(m * n + k, m, n)
    got = topk_indices(x, k, row_starts=starts, row_ends=ends, relative=relative, block=64)
    a = topk_agreement(got, x.double(), k, row_starts=starts, row_ends=ends, relative=relative)
    assert a.ok, a.reason


def test_topk_all_equal_and_negative_values():
    x = torch.full((3, 50), -2.5)
    x[1, 10:] = -0.0
    x[2] = -torch.arange(50).float()  # strictly decreasing negatives: the first K
    got = topk_indices(x, 20)
    for row in range(3):
        a = topk_agreement(got[row : row + 1], x[row : row + 1].double(), 20)
        assert a.ok, a.reason
    assert sorted(got[2].tolist()) == list(range(20))


def test_topk_default_rows_and_padding():
    x = torch.tensor([[1.0, -math.inf, 3.0, 2.0]])
    got = topk_indices(x, 6)
    assert sorted(got[0, :3].tolist()) == [0, 2, 3] and got[0, 3:].tolist() == [-1, -1, -1]


@settings(max_examples=10)
@given(st.integers(1, 6), st.integers(1, 120), st.integers(1, 40), st.integers(0, 2**16))
def test_topk_property(m, n, k, seed):
    x, starts, ends = _topk_logits(seed, m, n)
    got = topk_indices(x, k, row_starts=starts, row_ends=ends, block=32)
    assert topk_agreement(got, x.double(), k, row_starts=starts, row_ends=ends).ok


def test_topk_relative_needs_row_starts():
    with pytest.raises(ValueError, match="row_starts"):
        topk_indices(torch.zeros(2, 4), 2, relative=True)
