"""The sparse MLA kernel of ``mlaspec.impl.sparse`` through Triton's interpreter, against the float64 spec.

Kernel-level checks use awkward inputs: every sentinel FlashMLA documents (``-1``, ``S_kv``, ``INT_MIN``,
``INT_MAX``), ``topk_length`` of 0 and of less than a tile, rows with no valid slot, sinks ``finite / +inf / -inf``,
NaN in every cache row no used slot names, shuffled pages, GQA (``H_kv = 2``), split slot lists merged by LSE, and
both fp8 caches (656 B V3.2, 584 B V4) dequantized in the kernel. Budgets are the harness's
(:func:`mlaspec.conformance.ops.sparse.sparse_bounds`). bf16 is not tested here (the interpreter's ``tl.dot`` is
wrong for bf16, triton 3.9); the harness covers it on a GPU. Then the harness's curated tiny cases of the three ops
run through the composed backend.
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

from mlaspec.conformance.backends.triton import TritonBackend
from mlaspec.conformance.backends.triton.sparse import SPARSE_OPS
from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.ops.common import unit_roundoff
from mlaspec.conformance.ops.sparse import gather_keys, sparse_bounds
from mlaspec.conformance.runner import run_case
from mlaspec.impl.sparse import (
    SparseConfig,
    combine_config,
    decode_splits,
    float_keys,
    quantize_keys,
    sparse_config,
    sparse_mla,
    sparse_mla_decode,
)
from mlaspec.spec.sparse import sparse_attention, valid_slots
from tests.kernel_checks import assert_within, check_sparse_decode, paged_fp8, sparse_decode_case

pytestmark = pytest.mark.interpreter
INT_MIN, INT_MAX = -(2**31), 2**31 - 1


def _check(q, kv, idx, res, *, scale, d_v, topk_length=None, sink=None, max_logits=True):
    """``res`` (the kernel's out / lse / max_logits over rows ``kv [S, H_kv, D]``) against the spec and its budget."""
    spec = sparse_attention(q.double(), kv.double(), idx, scale=scale, d_v=d_v, topk_length=topk_length, attn_sink=sink)
    valid = valid_slots(idx, kv.shape[0], topk_length)
    keys = gather_keys(kv, idx, valid)
    out_b, lse_b, ml_b = sparse_bounds(
        q,
        keys,
        valid,
        scale=scale,
        d_v=d_v,
        attn_sink=sink,
        out=spec.out,
        lse=spec.lse,
        max_logits=spec.max_logits,
        u=unit_roundoff(q.dtype),
    )
    assert_within("out", res.out, spec.out, out_b)
    assert_within("lse", res.lse, spec.lse, lse_b)
    if max_logits:
        assert_within("max_logits", res.max_logits, spec.max_logits, ml_b)


def _hostile_prefill(s_q, s_kv, h_q, h_kv, d, k, dtype, seed):
    """Indices with every sentinel at random slots, two empty rows, NaN in every key row no slot names."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(s_q, h_q, d, generator=g, dtype=torch.float64) * 2).to(dtype)
    kv = torch.randn(s_kv, h_kv, d, generator=g, dtype=torch.float64).to(dtype)
    idx = torch.stack([torch.randperm(s_kv - 2, generator=g)[:k] + 1 for _ in range(s_q * h_kv)]).view(s_q, h_kv, k)
    bad = torch.tensor([-1, s_kv, INT_MIN, INT_MAX])
    invalid = torch.rand(s_q, h_kv, k, generator=g) < 0.3
    idx = torch.where(invalid, bad[torch.randint(0, 4, idx.shape, generator=g)], idx)
    idx[-1] = -1  # an empty row
    lengths = torch.randint(0, k + 1, (s_q,), generator=g)
    lengths[0], lengths[1], lengths[-2] = k, 3, 0  # all slots, less than a tile, nothing
    used = torch.zeros(s_kv, h_kv, dtype=torch.bool)
    for r in range(s_q):
        for h in range(h_kv):
            for t in range(k):
                if 0 <= idx[r, h, t] < s_kv:
                    used[idx[r, h, t], h] = True  # named at all: past topk_length too, as FlashMLA's caveat
    kv = kv.masked_fill(~used[..., None], math.nan)
    return q, kv, idx.to(torch.int32), lengths.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("sink", [None, "finite", "inf"])
def test_prefill_hostile_indices_against_spec(dtype, sink):
    s_q, s_kv, h_q, h_kv, d_v, d_rope, k = 7, 61, 6, 2, 32, 16, 37  # H_q 6 over 2 KV heads: 3 heads a program
    q, kv, idx, lengths = _hostile_prefill(s_q, s_kv, h_q, h_kv, d_v + d_rope, k, dtype, seed=3)
    attn_sink = None
    if sink:
        attn_sink = torch.randn(h_q, generator=torch.Generator().manual_seed(1)) * 2
        if sink == "inf":
            attn_sink[0], attn_sink[4] = math.inf, -math.inf
    scale = (d_v + d_rope) ** -0.5
    for lens in (None, lengths):
        res = sparse_mla(q, float_keys(kv), idx, scale=scale, d_v=d_v, topk_length=lens, attn_sink=attn_sink)
        _check(q, kv, idx, res, scale=scale, d_v=d_v, topk_length=lens, sink=attn_sink)
        assert torch.isposinf(res.lse[-1]).all() and torch.isneginf(res.max_logits[-1]).all()
        assert torch.equal(res.out[-1], torch.zeros_like(res.out[-1]))  # empty row: exactly 0
        if sink == "inf":
            assert torch.equal(res.out[:, 0], torch.zeros_like(res.out[:, 0]))  # +inf sink: exactly 0


def test_splits_merge_to_the_same_result_and_padding_equals_shorter_length():
    """Cutting the slots into splits (combine kernel) matches the spec; -1 padding == a shorter topk_length."""
    s_q, s_kv, h_q, d_v, d_rope, k = 5, 90, 4, 32, 16, 70
    q, kv, idx, lengths = _hostile_prefill(s_q, s_kv, h_q, 1, d_v + d_rope, k, torch.float32, seed=5)
    sink = torch.tensor([0.5, math.inf, -1.0, -math.inf])
    cfg = SparseConfig(16, 16, 4, 1)
    scale = 0.2
    for splits in (2, 5):
        res = sparse_mla(
            q,
            float_keys(kv),
            idx,
            scale=scale,
            d_v=d_v,
            topk_length=lengths,
            attn_sink=sink,
            num_splits=splits,
            config=cfg,
        )
        _check(q, kv, idx, res, scale=scale, d_v=d_v, topk_length=lengths, sink=sink)
    padded = torch.where(torch.arange(k)[None, None, :] < lengths[:, None, None], idx, -1)
    a = sparse_mla(q, float_keys(kv), idx, scale=scale, d_v=d_v, topk_length=lengths, config=cfg)
    b = sparse_mla(q, float_keys(kv), padded, scale=scale, d_v=d_v, config=cfg)
    for x, y in zip(a, b):
        assert torch.equal(x, y)  # masked tiles change nothing: alpha = 1, p = 0


@pytest.mark.parametrize(
    "rows, heads, d_v, expected",
    [
        (1, 128, 512, (1, 128, 1)),  # B1 128 heads: 512 one-warp programs of one head's 128 columns
        (8, 64, 512, (1, 128, 1)),  # 512 (row, head) pairs: still one head a program
        (8, 128, 512, (4, 128, 1)),  # more: four heads a program
        (3, 5, 32, (1, 32, 1)),  # a value narrower than 128 columns: one column block
    ],
)
def test_combine_config_examples(rows, heads, d_v, expected):
    assert combine_config(rows, heads, d_v) == expected


@pytest.mark.parametrize("dtype, rows", [(torch.float16, 0), (torch.float16, 32), (torch.float32, 0)])
def test_decode_fp8_v32_cache_dequantized_in_kernel(dtype, rows):
    """656-byte records with 0xFF (NaN) in every slot no index names; page shuffles; the request of length 0; the
    few-head tiles of few rows and (``rows = 32``) of many."""
    q, cache, slots, lengths = sparse_decode_case(576, seed=11, dtype=dtype)
    keys = quantize_keys(cache.view(-1, 576), page_size=16)
    assert keys is not None and keys.fmt == "fp8_v32"
    sink = torch.tensor([1.0, math.inf, -2.0, 0.0, -math.inf])
    cfg = sparse_config(q.shape[2], dtype, True, rows)
    for splits in (1, 3):
        out, lse = sparse_mla_decode(
            q, keys, slots, scale=0.1, topk_length=lengths, attn_sink=sink, num_splits=splits, config=cfg
        )
        check_sparse_decode(q, cache, slots, lengths, out, lse, sink=sink)
        assert torch.isposinf(lse[2]).all() and torch.equal(out[2], torch.zeros_like(out[2]))


def test_decode_fp8_v4_with_extra_cache():
    """V4: the 584-byte split page layout for the main (window) and the extra (compressed) cache, one softmax."""
    q, cache, slots, lengths = sparse_decode_case(512, seed=12)
    g = torch.Generator().manual_seed(2)
    extra = paged_fp8(4, 16, 512, torch.float16, g)
    e_idx = torch.randint(0, 64, (3, 2, 6), generator=g, dtype=torch.int32)
    e_idx[..., -1] = -1
    e_len = torch.tensor([6, 0, 2], dtype=torch.int32)
    used = torch.zeros(64, dtype=torch.bool)
    for r in range(3):
        used[e_idx[r, :, : int(e_len[r])][e_idx[r, :, : int(e_len[r])] >= 0].long()] = True
    extra = extra.view(-1, 512).masked_fill(~used[:, None], math.nan).view(4, 16, 512)
    keys, ekeys = quantize_keys(cache.view(-1, 512), 16), quantize_keys(extra.view(-1, 512), 16)
    assert keys.fmt == ekeys.fmt == "fp8_v4"
    out, lse = sparse_mla_decode(
        q,
        keys,
        slots,
        scale=0.1,
        topk_length=lengths,
        extra=ekeys,
        extra_indices=e_idx,
        extra_topk_length=e_len,
        num_splits=2,
    )
    check_sparse_decode(q, cache, slots, lengths, out, lse, extra=(extra, e_idx, e_len))


def test_bad_input_names_the_argument():
    q = torch.zeros(2, 4, 48)
    kv = float_keys(torch.zeros(10, 1, 48))
    with pytest.raises(ValueError, match="indices"):
        sparse_mla(q, kv, torch.zeros(3, 1, 4, dtype=torch.int32), scale=1.0, d_v=32)
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla(q, kv, torch.zeros(2, 1, 4, dtype=torch.int32), scale=1.0, d_v=24)
    with pytest.raises(ValueError, match="topk_length"):
        sparse_mla(
            q,
            kv,
            torch.zeros(2, 1, 4, dtype=torch.int32),
            scale=1.0,
            d_v=32,
            topk_length=torch.zeros(3, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="attn_sink"):
        sparse_mla(q, kv, torch.zeros(2, 1, 4, dtype=torch.int32), scale=1.0, d_v=32, attn_sink=torch.zeros(3))


def test_quantize_keys_refuses_a_cache_fp8_cannot_hold():
    x = torch.randn(32, 576, dtype=torch.float64)
    assert quantize_keys(x) is None


# -- the harness's curated tiny cases through the composed backend -----------------------------------------------
_Backend = TritonBackend


CASES = [c for c in curated_cases(dtypes=("float16", "float32")) if c.op in SPARSE_OPS]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_curated_case(case):
    result = run_case(_Backend(), case, backend_name="triton")
    assert result.verdict == "pass", f"{result.reason} worst={result.worst}"


@pytest.mark.parametrize(
    "programs, sms, per_sm, expected",
    [(64, 132, 1, 2), (256, 132, 1, 1), (32, 132, 1, 4), (133, 132, 1, 1), (64, 132, 2, 4), (128, 132, 2, 2)],
)
def test_decode_splits_fill_one_whole_wave(programs, sms, per_sm, expected):
    splits = decode_splits(programs, sms, per_sm)
    assert splits == expected
    slots = per_sm * sms
    assert splits == 1 or programs * splits <= slots < programs * (splits + 1)


@pytest.mark.parametrize(
    "heads, fp8, rows, per_sm",
    [(16, True, 64, 2), (8, True, 32, 2), (16, True, 31, 1), (16, False, 64, 1), (64, True, 128, 1)],
)
def test_only_many_rows_of_few_head_fp8_tiles_take_two_programs_an_sm(heads, fp8, rows, per_sm):
    cfg = sparse_config(heads, torch.bfloat16, fp8, rows)
    assert cfg.per_sm == per_sm
    assert cfg.block_n == (32 if per_sm == 2 else 64)
