"""The Triton kernels of ``mlaspec.impl`` through Triton's interpreter, against the float64 spec.

``@triton.jit`` decides at decoration time whether a kernel is compiled or interpreted, and the interpreter reads
``TRITON_INTERPRET`` again while it runs, so this module sets ``TRITON_INTERPRET=1`` for its (xdist worker) process
*before* importing ``mlaspec.impl``, and leaves it set. If another module of the same process imported the kernels
compiled first, the module is skipped with that reason rather than run wrongly. bf16 is not tested here: the
interpreter's ``tl.dot`` is wrong for bf16 (triton 3.9); ``mlaspec check --backend triton`` covers it on a GPU.

Budgets are the harness's (:func:`mlaspec.conformance.ops.common.attention_bounds`): derived from the fp32
logit accumulation and the rounding of the weights ``p`` and the output to the case dtype, per element.
"""

import math
import os
import shlex
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

from mlaspec.conformance import cli
from mlaspec.conformance.backends.triton import TritonBackend, TritonE4m3Backend, interpreted
from mlaspec.conformance.cases import Case, curated_cases
from mlaspec.conformance.ops.common import attention_bounds, unit_roundoff
from mlaspec.conformance.runner import run_case
from mlaspec.impl.decode import (
    DecodeConfig,
    _combine,
    combine_config,
    mla_decode_paged,
    num_splits_heuristic,
    page_cache,
)
from mlaspec.impl.merge import merge_attn_states
from mlaspec.impl.prefill import PrefillConfig, flash_attn_varlen, prefill_config, split_head_dim
from mlaspec.spec import merge as spec_merge
from mlaspec.spec.attention import attention_varlen
from tests.interpreter_cases import interpreter_cases
from tests.kernel_checks import SCALE, assert_within, decode_case, decode_reference, record, splits_of

pytestmark = pytest.mark.interpreter


def test_kernels_are_interpreted():
    assert interpreted()


# -- decode ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "B, S_q, H, seq_lens, causal, num_splits",
    [
        (2, 1, 16, [37, 5], True, None),  # TP8 decode, ragged lengths, heuristic splits
        (1, 4, 16, [70], True, 3),  # MTP next_n 4 over two pages, three splits
        (3, 2, 5, [3, 1, 0], True, 2),  # odd head count; a row that sees nothing; an empty sequence
        (1, 2, 3, [130], False, 1),  # non-causal, one split: the kernel writes the result itself
    ],
)
def test_decode_matches_spec(dtype, B, S_q, H, seq_lens, causal, num_splits):
    q, kv, cache, block_table, lens = decode_case(B, S_q, H, seq_lens, dtype, causal, seed=B * 100 + S_q * 10 + H)
    out, lse = mla_decode_paged(q, cache, block_table, lens, d_v=512, scale=SCALE, causal=causal, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == (B, S_q, H, 512) and lse.shape == (B, H, S_q)
    ref_out, ref_lse, out_bound, lse_bound = decode_reference(q, kv, seq_lens, causal, unit_roundoff(dtype))
    assert_within("out", out, ref_out, out_bound)
    assert_within("lse", lse, ref_lse, lse_bound)


def test_decode_ignores_page_order_and_split_count():
    q, kv, cache, block_table, lens = decode_case(1, 1, 16, [100], torch.float16, True, seed=7)
    a = mla_decode_paged(q, cache, block_table, lens, scale=SCALE, num_splits=2)
    # the same pages in another physical order: bitwise the same result
    perm = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(1))
    moved = torch.empty_like(cache)
    moved[perm] = cache
    b = mla_decode_paged(
        q, moved, torch.where(block_table >= 0, perm[block_table.long()], -1).int(), lens, scale=SCALE, num_splits=2
    )
    assert torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse)
    # one split instead of two: the same numbers up to fp32 reassociation and the final rounding
    c = mla_decode_paged(q, cache, block_table, lens, scale=SCALE, num_splits=1)
    assert torch.allclose(a.out.float(), c.out.float(), atol=2e-3, rtol=1e-2)
    assert torch.allclose(a.lse, c.lse, atol=1e-5, rtol=1e-5)


def test_decode_splits_start_inside_the_block_table(monkeypatch):
    """A ``max_seq_len`` past what the block table holds (the model's longest, say) cuts the keys as the table's
    width does, so every split's first tile has its entry in the table (Hopper's kernels read that page beside the
    sequence's length, before they know whether they use it); a table of no pages is read as a row of one. The
    results are the spec's."""
    import mlaspec.impl.decode as decode

    launches = []
    record(monkeypatch, decode, "_mla_decode_split_kernel", launches=launches)
    q, kv, cache, block_table, lens = decode_case(2, 1, 4, [37, 5], torch.float32, True, seed=5)
    got = mla_decode_paged(q, cache, block_table, lens, scale=SCALE, max_seq_len=1 << 20, num_splits=64)
    launched = [(a["args"][2].shape[1], *splits_of(a)) for a in launches]  # (table pages, blocks a split, splits)
    pages, blocks_per_split, num_splits = launched[-1]
    tiles = pages * 64 // decode.decode_config(4, 64, torch.float32).block_n  # what the table holds
    assert (num_splits - 1) * blocks_per_split < tiles, launched
    ref_out, ref_lse, out_bound, lse_bound = decode_reference(q, kv, [37, 5], True, unit_roundoff(torch.float32))
    assert_within("out", got.out, ref_out, out_bound)
    assert_within("lse", got.lse, ref_lse, lse_bound)
    empty = mla_decode_paged(q, cache, block_table[:, :0], torch.zeros(2, dtype=torch.int32), scale=SCALE)
    assert launches[-1]["args"][2].shape[1] == 1, launched  # the table of no pages read as a row of one
    assert not empty.out.any() and (empty.lse == float("-inf")).all()


@pytest.mark.parametrize("H, B", [(4, 1), (16, 2)])  # B * H below / above 4 x the interpreter's 4 "SMs"
def test_decode_combine_layouts_agree_with_one_split(H, B):
    """The combine takes 32-column programs for few rows and whole rows for many (``B * R >= 4 SMs``): both give
    the one-split result up to fp32 reassociation and the final rounding."""
    q, kv, cache, block_table, lens = decode_case(B, 1, H, [300] * B, torch.float16, True, seed=3)
    split = mla_decode_paged(q, cache, block_table, lens, scale=SCALE, num_splits=5)
    whole = mla_decode_paged(q, cache, block_table, lens, scale=SCALE, num_splits=1)
    assert torch.allclose(split.out.float(), whole.out.float(), atol=2e-3, rtol=1e-2)
    assert torch.allclose(split.lse, whole.lse, atol=1e-5, rtol=1e-5)


def test_decode_tile_override_runs_half_pages():
    q, kv, cache, block_table, lens = decode_case(1, 1, 4, [40], torch.float32, True, seed=3)
    got = mla_decode_paged(q, cache, block_table, lens, scale=SCALE, config=DecodeConfig(16, 32, 4, 1))
    ref_out, ref_lse, out_bound, lse_bound = decode_reference(q, kv, [40], True, unit_roundoff(torch.float32))
    assert_within("out", got.out, ref_out, out_bound)
    assert_within("lse", got.lse, ref_lse, lse_bound)


def test_decode_errors_name_the_limit():
    q, kv, cache, block_table, lens = decode_case(1, 1, 2, [8], torch.float16, True, seed=0)
    with pytest.raises(ValueError, match="d_v"):
        mla_decode_paged(q, cache, block_table, lens, d_v=500, scale=SCALE)
    with pytest.raises(ValueError, match="block_table"):
        mla_decode_paged(q, cache, block_table.long(), lens, scale=SCALE)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_decode_paged(q, cache, block_table, lens[:0], scale=SCALE)
    with pytest.raises(ValueError, match="page size"):
        mla_decode_paged(q, cache[:, :48].contiguous(), block_table, lens, scale=SCALE)
    with pytest.raises(TypeError, match="dtype"):
        mla_decode_paged(q.float(), cache, block_table, lens, scale=SCALE)


@pytest.mark.parametrize(
    "batch, row_blocks, seq, expected",
    [
        (4, 2, 65536, 16),  # 128 heads: one whole wave of 132 SMs (17 splits would start a second for 8 programs)
        (4, 1, 65536, 33),  # 16 heads: one whole wave, 31 key blocks a split
        (1, 1, 65536, 132),  # one long sequence: a split per SM
        (1, 1, 300, 5),  # short: at most one split per key block of 64
        (128, 2, 65536, 1),  # the batch alone fills the card
        (128, 1, 4096, 1),  # 128 programs: one wave already
    ],
)
def test_num_splits_heuristic_examples(batch, row_blocks, seq, expected):
    assert num_splits_heuristic(batch, row_blocks, seq, 132) == expected
    assert num_splits_heuristic(batch, row_blocks, seq, 66, programs_per_sm=2) == expected  # two a SM: the same


def test_num_splits_heuristic_fills_two_programs_per_sm():
    """The fp8 cache's small tiles: two programs on each SM at once (B = 2, 64K keys: 132 splits, 264 programs)."""
    assert num_splits_heuristic(2, 1, 65536, 132, programs_per_sm=2) == 132
    assert num_splits_heuristic(2, 1, 65536, 132) == 66


@given(
    batch=st.integers(1, 256),
    row_blocks=st.integers(1, 4),
    seq=st.integers(1, 1 << 17),
    sms=st.integers(1, 300),
    per_sm=st.integers(1, 3),
)
def test_num_splits_heuristic_fills_one_wave(batch, row_blocks, seq, sms, per_sm):
    splits = num_splits_heuristic(batch, row_blocks, seq, sms, programs_per_sm=per_sm)
    programs, wave = batch * row_blocks * splits, per_sm * sms
    assert 1 <= splits <= min(256, math.ceil(seq / 64))  # at least one key block of 64 a split
    assert splits == 1 or programs <= wave  # never a partial second wave
    assert splits == 256 or splits == math.ceil(seq / 64) or programs + batch * row_blocks > wave  # the wave is full


@pytest.mark.parametrize(
    "rows, splits, expected",
    [
        (128, 66, (128, 32, 1)),  # 128 heads, B = 1: 128 columns, 32 splits a load (two loads), one warp
        (512, 16, (128, 16, 1)),  # 128 heads, B = 4: still under four rows an SM
        (1024, 2, (512, 2, 1)),  # 16 heads, B = 64: a whole row a program
        (16, 132, (32, 256, 4)),  # 16 heads, B = 1, 132 splits: all at once over four warps
        (16, 128, (32, 128, 1)),  # 128 splits of 32 columns: 4096 partials, one warp
        (64, 33, (64, 64, 1)),  # 16 heads, B = 4
    ],
)
def test_combine_config_examples(rows, splits, expected):
    assert combine_config(rows, splits, 512, 132) == expected


@given(rows=st.integers(1, 1 << 14), splits=st.integers(2, 256), d_v=st.sampled_from([16, 64, 512]))
def test_combine_config_tiles_every_column_and_split(rows, splits, d_v):
    block_d, chunk, warps = combine_config(rows, splits, d_v, 132)
    assert d_v % block_d == 0 and chunk & (chunk - 1) == 0 and 1 <= chunk <= 1 << (splits - 1).bit_length()
    assert chunk * block_d <= 4096 * warps  # at most 128 partials a thread in one load


@pytest.mark.parametrize(
    "config",
    [
        None,  # the interpreter's: whole rows, 8 splits a load (two loads)
        (32, 4, 1),  # the GPU's at <= 32 rows: 16 column blocks, here in three loads
        (128, 16, 1),  # four column blocks, one load
    ],
)
def test_combine_merges_splits_over_several_loads(config):
    """The combine against the float64 LSE merge where a program loads the splits in parts and (with a config of
    fewer columns than a row) where a row's columns are split over programs, with an empty split (-inf) and a row
    whose splits are all empty: a program that reads only its first load, or a row of which only the first column
    block is written, fails it."""
    B, splits, R, d_v = 2, 12, 8, 512
    g = torch.Generator().manual_seed(0)
    o_part = torch.randn(B, splits, R, d_v, generator=g)
    lse_part = torch.randn(B, splits, R, generator=g) * 4
    lse_part[0, 9] = float("-inf")
    lse_part[1, :, 3] = float("-inf")
    out, lse = torch.full((B, 1, R, d_v), math.nan), torch.full((B, R, 1), math.nan)
    _combine(o_part, lse_part, out, lse, 4, config=config)
    w = torch.exp2(lse_part.double())  # [B, splits, R]
    total = w.sum(1)  # [B, R]
    ref = torch.einsum("bsr,bsrd->brd", w, o_part.double()) / total.clamp_min(1e-300)[..., None]
    ref_lse = torch.log(total)
    assert torch.allclose(out[:, 0].double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse[..., 0].double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert (out[1, 0, 3] == 0).all() and lse[1, 3, 0] == float("-inf")


# -- prefill (varlen flash attention) ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "lens_q, lens_k, H_q, H_kv, D_qk, D_v, causal",
    [
        ([5, 0, 20], [5, 3, 33], 4, 2, 24, 16, True),  # GQA, an empty query run, blocks of 16 crossed
        ([3, 7], [1, 9], 2, 1, 192, 128, True),  # MLA prefill widths (128 + 64), MQA
        ([6], [3], 2, 1, 40, 24, True),  # more queries than keys: early rows see nothing
        ([4, 2], [4, 0], 3, 3, 8, 4, False),  # no keys at all for one sequence
    ],
)
def test_prefill_matches_spec(dtype, lens_q, lens_k, H_q, H_kv, D_qk, D_v, causal):
    g = torch.Generator().manual_seed(sum(lens_q) + D_qk)
    cq = torch.tensor([0, *lens_q]).cumsum(0).int()
    ck = torch.tensor([0, *lens_k]).cumsum(0).int()
    q = (torch.randn(int(cq[-1]), H_q, D_qk, generator=g, dtype=torch.float64) * 2).to(dtype)
    k = torch.randn(int(ck[-1]), H_kv, D_qk, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(int(ck[-1]), H_kv, D_v, generator=g, dtype=torch.float64).to(dtype)
    out, lse = flash_attn_varlen(q, k, v, cq, ck, scale=D_qk**-0.5, causal=causal)
    ref = attention_varlen(q, k, v, cq, ck, scale=D_qk**-0.5, causal=causal)
    assert out.dtype == dtype and lse.shape == (H_q, int(cq[-1]))
    u = unit_roundoff(dtype)
    for b in range(len(lens_q)):  # the harness's budget, per sequence
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if qe == qs:
            continue
        r = (ref.out[None, qs:qe], ref.lse[None, :, qs:qe])
        ob, lb = attention_bounds(
            q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], scale=D_qk**-0.5, causal=causal, ref=r, u=u
        )
        assert_within(f"out[seq {b}]", out[None, qs:qe], r[0], ob)
        assert_within(f"lse[seq {b}]", lse[None, :, qs:qe], r[1], lb)


def test_split_head_dim():
    assert [split_head_dim(d) for d in (192, 576, 128, 24, 200, 1)] == [
        (128, 64),
        (512, 64),
        (128, 0),
        (32, 0),
        (256, 0),
        (16, 0),
    ]


def test_prefill_errors_name_the_limit():
    t = torch.zeros(3, 2, 264, dtype=torch.float16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="head dims"):
        flash_attn_varlen(t, t, t, cu, cu)
    with pytest.raises(ValueError, match="H_kv"):
        flash_attn_varlen(t[:, :, :8], t[:, :, :8].repeat(1, 2, 1)[:, :3], t[:, :, :8].repeat(1, 2, 1)[:, :3], cu, cu)


# -- prefill at the GPU's tiles: the generated-case classes the H200 self-check failed on ----------------------------
# The H200 run (triton 3.6) failed attention[hyp-261-float16] and attention[hyp-83-float16] (unexpected NaN in out)
# and attention[hyp-396-float16] (illegal address); their parameters were not printed and the draw was not seeded, so
# these are the shape classes the curated cases never reach on a GPU: head dims split in three dots (33..40 = 32 + 16),
# D_v padded to 32, odd widths, widths of 1 (specialised to constants), no keys, more queries than keys under causal.
GPU_TILES = [PrefillConfig(128, 64, 8, 3), PrefillConfig(64, 32, 8, 2)]  # prefill_config's fp16 and fp32/wide tiles
GENERATED_CLASSES = [
    dict(B=2, S_q=5, S_kv=21, H_q=6, H_kv=2, D_qk=37, D_v=3, causal=True),
    dict(B=3, S_q=6, S_kv=4, H_q=9, H_kv=3, D_qk=40, D_v=24, causal=True),
    dict(B=1, S_q=3, S_kv=0, H_q=3, H_kv=1, D_qk=33, D_v=17, causal=False),
    dict(B=2, S_q=1, S_kv=24, H_q=1, H_kv=1, D_qk=1, D_v=1, causal=True),
    dict(B=3, S_q=6, S_kv=24, H_q=4, H_kv=2, D_qk=16, D_v=16, causal=False),
]


@pytest.mark.parametrize("tile", GPU_TILES, ids=lambda t: f"{t.block_m}x{t.block_n}")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("params", GENERATED_CLASSES, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_attention_generated_classes_at_gpu_tiles(params, dtype, tile):
    case = Case("attention", "regression", dtype, params)
    r = run_case(TritonBackend(prefill_config=tile), case, backend_name="triton", timeout=None)
    assert r.verdict == "pass", f"{case!r} at {tile}: {r.verdict}: {r.reason}"


# The seeded H200 run (`mlaspec check --backend triton --scale full --generated 120 --seed 0`, then run as `selfcheck`,
# triton 3.6) failed these three, all fp16 with D_qk in 33..40 (32 + 16 blocks) and a 16-wide v block: NaN at
# out[2, 0, 2, 2], error/bound 467 at out[0, 1, 0, 0], and an illegal address. The interpreter computes them right (the
# kernel's masks are sound; the fault is in Triton 3.6's Hopper code for these narrow, masked head dims, not yet worked
# around), so here they pin the shapes at the CPU tile and at both GPU tiles; each one's reproducer
# (`mlaspec check --backend triton --op attention --name ... --params ...`) reruns it on the GPU.
H200_SEED0_FAILURES = [
    ("hyp-376", dict(B=3, D_qk=35, D_v=3, H_kv=1, H_q=3, S_kv=17, S_q=2, causal=False)),
    ("hyp-379", dict(B=3, D_qk=35, D_v=5, H_kv=1, H_q=1, S_kv=20, S_q=2, causal=True)),
    ("hyp-1", dict(B=1, D_qk=37, D_v=2, H_kv=2, H_q=4, S_kv=2, S_q=4, causal=False)),
]


@pytest.mark.parametrize("tile", [None, *GPU_TILES], ids=lambda t: "cpu" if t is None else f"{t.block_m}x{t.block_n}")
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("name, params", H200_SEED0_FAILURES, ids=[n for n, _ in H200_SEED0_FAILURES])
def test_attention_h200_seed0_failures(name, params, dtype, tile):
    case = Case("attention", name, dtype, params)
    r = run_case(TritonBackend(prefill_config=tile), case, backend_name="triton", timeout=None)
    assert r.verdict == "pass", f"{case!r} at {tile}: {r.verdict}: {r.reason}"


@pytest.mark.parametrize("tile", [None, *GPU_TILES])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_writes_every_output_element(dtype, tile):
    """An ``out`` full of NaN (as reused device memory may be) comes back NaN-free: no element is left unwritten."""
    g = torch.Generator().manual_seed(5)
    cq = torch.tensor([0, 3, 3, 9], dtype=torch.int32)  # an empty query run in the middle
    ck = torch.tensor([0, 0, 7, 12], dtype=torch.int32)  # a sequence with no key
    q = torch.randn(9, 4, 37, generator=g).to(dtype)
    k, v = torch.randn(12, 2, 37, generator=g).to(dtype), torch.randn(12, 2, 5, generator=g).to(dtype)
    out = torch.full((9, 4, 5), math.nan, dtype=dtype)
    got = flash_attn_varlen(q, k, v, cq, ck, causal=True, config=tile, out=out)
    assert got.out is out and not torch.isnan(out).any()
    assert torch.equal(out[:3], torch.zeros_like(out[:3])) and torch.isneginf(got.lse[:, :3]).all()  # no key: 0, -inf
    ref = attention_varlen(q, k, v, cq, ck, causal=True)
    assert torch.allclose(out.double(), ref.out, atol=5e-3, rtol=5e-3)


def test_prefill_config_and_out_are_checked():
    assert prefill_config(192, 128, torch.bfloat16) == PrefillConfig(64, 32, 8, 2)  # MLA prefill widths
    assert prefill_config(24, 16, torch.float16) == PrefillConfig(128, 64, 8, 3)
    assert prefill_config(24, 16, torch.float16, "cpu").block_m == 16
    t = torch.zeros(3, 2, 8, dtype=torch.float16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_m"):
        flash_attn_varlen(t, t, t, cu, cu, config=PrefillConfig(24, 16, 4, 1))
    with pytest.raises(ValueError, match="out"):
        flash_attn_varlen(t, t, t, cu, cu, out=torch.empty(3, 2, 4, dtype=torch.float16))


# -- fp32 up-projections: the harness's budget once lacked their accumulation error ------------------------------------
# mla_prefill and chunked_prefill_attention materialise k_nope = kv_c W_UK and v = kv_c W_UV with an fp32 matmul. Where
# the Lkv terms cancel, its accumulation error is far above one rounding of the result, which was all the budget
# allowed: these failed at error/bound 1.2 (the reported reproducer) and 7.3, 37.8, 1.01, 1.26 (`mlaspec check --backend
# triton --dtypes float32 --generated 200 --seed 0`, then `selfcheck`; S_kv = 1 makes the output v itself). The budget
# now carries γ_Lkv |kv_c|.|W| (conformance.ops.common.projection_error); a float64 projection passed them all along.
FP32_PROJECTION_CASES = [
    (
        "chunked_prefill_attention",
        "hyp-1",
        dict(H_q=3, Lkv=4, D_nope=2, D_rope=2, D_v=9, block_size=1, contexts=[0], q_lens=[2], workspace_size=1),
    ),
    ("mla_prefill", "hyp-14", dict(B=1, H_q=4, Lkv=25, D_nope=1, D_rope=2, S_kv=1, S_q=1, D_v=14, causal=True)),
    ("mla_prefill", "hyp-14", dict(B=1, H_q=1, Lkv=25, D_nope=1, D_rope=2, S_kv=1, S_q=1, D_v=14, causal=True)),
    ("mla_prefill", "hyp-14", dict(B=1, H_q=1, Lkv=14, D_nope=1, D_rope=2, S_kv=1, S_q=1, D_v=14, causal=True)),
    ("mla_prefill", "hyp-485", dict(B=2, H_q=1, Lkv=14, D_nope=5, D_rope=2, S_kv=5, S_q=5, D_v=10, causal=True)),
]


@pytest.mark.parametrize(
    "op, name, params", FP32_PROJECTION_CASES, ids=[f"{o}-{n}-{i}" for i, (o, n, _) in enumerate(FP32_PROJECTION_CASES)]
)
def test_fp32_up_projection_accumulation_is_budgeted(op, name, params):
    r = run_case(TritonBackend(), Case(op, name, "float32", params), backend_name="triton", timeout=None)
    assert r.verdict == "pass", f"{op}[{name}] {params}: {r.verdict}: {r.reason}"


# -- mlaspec check --generated: seeded draws, and the reproducer printed before the case runs -------------------------
def test_generated_draws_are_seeded():
    a, b = cli._generated_cases(3, ("float16",), seed=7), cli._generated_cases(3, ("float16",), seed=7)
    assert [(c.id, c.params) for c in a] == [(c.id, c.params) for c in b]


def test_check_prints_the_reproducer_before_running_the_case(tmp_path, capsys):
    case = Case("attention", "hyp-261", "float16", GENERATED_CLASSES[0])
    argv = shlex.split(case.repro("triton"))[1:]
    assert cli.main([*argv, "--report", str(tmp_path / "one")]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = next(i for i, line in enumerate(lines) if "RUN   mlaspec check" in line)
    assert lines[i].split("RUN   ", 1)[1] == case.repro("triton") and lines[i + 1].endswith(f"PASS  {case.id}")
    # the printed line reruns exactly that case
    again = cli._param_cases(cli.parser().parse_args(shlex.split(lines[i].split("RUN   ", 1)[1])[1:]))
    assert [(c, c.params) for c in again] == [(case, case.params)]


def test_check_generated_announces_each_drawn_case_with_the_same_draws(tmp_path, capsys):
    argv = ["check", "--backend", "triton", "--ops", "merge_attn_states", "--dtypes", "float32", "--generated", "2"]
    runs = []
    for k in range(2):
        assert cli.main([*argv, "--seed", "3", "--report", str(tmp_path / str(k))]) == 0
        runs.append([line for line in capsys.readouterr().out.splitlines() if "RUN   " in line])
    curated = len(curated_cases(dtypes=("float32",), ops=("merge_attn_states",)))
    drawn = cli._generated_cases(2, ("float32",), seed=3, ops=("merge_attn_states",))
    assert runs[0] == runs[1] and len(runs[0]) == len(drawn) > 0  # only the drawn cases are announced
    assert [line.split("RUN   ", 1)[1] for line in runs[0]] == [c.repro("triton") for c in drawn]
    assert runs[0][0].startswith(f"[{curated + 1:>3}/{curated + len(drawn)}] RUN   ")


def test_prefill_tile_from_the_environment(tmp_path, capsys, monkeypatch):
    """``MLASPEC_TRITON_PREFILL_CONFIG=M,N,WARPS,STAGES`` (once selfcheck's ``--prefill-config``) pins the tile."""
    monkeypatch.setenv("MLASPEC_TRITON_PREFILL_CONFIG", "64,32,8,2")
    b = TritonBackend()
    assert b.prefill_config == GPU_TILES[1]
    assert b.version.endswith("prefill tile 64,32,8,2 (MLASPEC_TRITON_PREFILL_CONFIG)")
    assert TritonBackend(prefill_config=GPU_TILES[0]).prefill_config == GPU_TILES[0]  # an argument wins
    case = Case("attention", "hyp-261", "float16", GENERATED_CLASSES[0])
    assert cli.main([*shlex.split(case.repro("triton"))[1:], "--report", str(tmp_path)]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("mlaspec check: backend triton (") and "prefill tile 64,32,8,2" in header
    for bad in ("64,32", "64,32,8,x"):
        monkeypatch.setenv("MLASPEC_TRITON_PREFILL_CONFIG", bad)
        with pytest.raises(ValueError, match="MLASPEC_TRITON_PREFILL_CONFIG must be four integers"):
            TritonBackend()
    monkeypatch.delenv("MLASPEC_TRITON_PREFILL_CONFIG")
    assert TritonBackend().prefill_config is None and TritonBackend().version == TritonBackend.version


# -- merge_attn_states ------------------------------------------------------------------------------------------------
@settings(max_examples=10, deadline=None)
@given(
    T=st.integers(1, 5),
    H=st.integers(1, 3),
    D=st.sampled_from([1, 16, 40]),
    seed=st.integers(0, 99),
    dtype=st.sampled_from([torch.float16, torch.float32, torch.bfloat16]),
)
def test_merge_matches_spec(T, H, D, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    p_out, s_out = (torch.randn(T, H, D, generator=g).to(dtype) for _ in range(2))
    p_lse, s_lse = (torch.randn(H, T, generator=g) * 4 for _ in range(2))
    pick = torch.randint(0, 4, (2, H, T), generator=g)  # 0: finite, 1: -inf, 2: +inf (read as empty), 3: finite
    for lse, sel in ((p_lse, pick[0]), (s_lse, pick[1])):
        lse[sel == 1], lse[sel == 2] = -math.inf, math.inf
    out, lse = merge_attn_states(p_out, p_lse, s_out, s_lse)
    ref = spec_merge.merge_attn_states(p_out, p_lse, s_out, s_lse)
    u = unit_roundoff(dtype)
    assert_within("out", out, ref.out, 2 * (u * ref.out.abs() + 1e-6 * (p_out.abs() + s_out.abs()).double()))
    assert_within("lse", lse, ref.lse, 1e-6 * (ref.lse.abs().nan_to_num(0, posinf=0, neginf=0) + 1))


def test_merge_both_empty_keeps_prefix():
    p_out = torch.arange(4.0).view(1, 1, 4)
    out, lse = merge_attn_states(p_out, torch.tensor([[math.inf]]), -p_out, torch.tensor([[-math.inf]]))
    assert torch.equal(out, p_out) and lse.item() == -math.inf


# -- the harness itself, on the curated tiny cases --------------------------------------------------------------------
TINY_FP16 = interpreter_cases(curated_cases(dtypes=("float16",), ops=tuple(sorted(TritonBackend.ops))))


@pytest.mark.parametrize("case", TINY_FP16, ids=lambda c: c.id)
def test_backend_passes_curated_tiny_cases(case):
    backend = TritonBackend()
    declared = getattr(backend, f"_unsupported_{case.op}", lambda c: None)(case)  # a named limit (V4 layouts...)
    r = run_case(backend, case, backend_name="triton", timeout=None)
    expected = "skip" if declared else "pass"
    assert r.verdict == expected, f"{case.id}: {r.verdict}: {r.reason} (rerun: {r.repro})"


def test_backend_skips_bf16_matmul_ops_with_reason():
    case = curated_cases(dtypes=("bfloat16",), ops=("mla_decode",))[0]
    r = run_case(TritonBackend(), case, backend_name="triton")
    assert r.verdict == "skip" and "interpreter" in r.reason


# -- the e4m3 path: q, the keys and P in e4m3 (FlashMLA's dense fp8 arithmetic), judged as the backend triton-e4m3 --
FP8_DECODES = curated_cases(dtypes=("float16",), ops=("mla_decode_fp8",))
E4M3_CASES = [c for c in FP8_DECODES if c.params["layout"] == "fp8_e4m3_per_tensor"][:2]


@pytest.mark.parametrize("case", E4M3_CASES, ids=lambda c: c.id)
def test_e4m3_path_passes_under_its_declared_numerics_and_fails_without(case):
    """Under ``fp8_mma_accumulation`` and ``p_in_e4m3`` (declared) it passes; against the exact spec
    (``--strict-numerics``) its e4m3 softmax weights are out of the budget: the declaration is what lets it pass."""
    assert run_case(TritonE4m3Backend(), case, backend_name="triton-e4m3").verdict == "pass"
    strict = run_case(TritonE4m3Backend(), case, backend_name="triton-e4m3", strict_numerics=True)
    assert strict.verdict == "fail" and "p_in_e4m3" in strict.reason, strict.reason


def test_e4m3_path_rounds_the_weights_to_e4m3():
    """One key a row (the weight is exactly 1) gives the exact value row, ``q`` is not used beyond the LSE; two keys
    with logits ln 3 apart give weights 1 and 1/3, and 1/3 rounds to e4m3's 0.3125 (mantissa 010 at 2^-2): the output
    is ``(v0 + 0.3125 v1) / (4/3)``, not the exact ``(3 v0 + v1) / 4``."""
    kv = torch.zeros(1, 2, 576)
    kv[0, :, :512] = torch.tensor([[1.0], [2.0]])  # v0 = 1, v1 = 2 in every column
    kv[0, 0, 512] = kv[0, 1, 512] = 1.0
    q = torch.zeros(1, 1, 1, 576)
    q[..., 512] = 1.0  # logit 1 for both keys, then key 1's lowered by ln 3 through its RoPE part
    kv[0, 1, 512] = 1.0 - math.log(3.0)
    k_scale, q_scale = 1.0, 1.0
    cache, table, lens = page_cache(kv.to(torch.float8_e4m3fn).view(torch.uint8), page_size=64, fill=0)
    kv8 = kv.to(torch.float8_e4m3fn).float()
    s1 = float(kv8[0, 1, 512])  # key 1's logit as e4m3 holds it
    w = math.exp(s1 - 1.0)  # its weight beside key 0's 1
    got = mla_decode_paged(q.to(torch.float8_e4m3fn), cache, table, lens, scale=1.0, k_scale=k_scale, q_scale=q_scale,
                           out_dtype=torch.float16)  # fmt: skip
    w8 = float(torch.tensor(w).to(torch.float8_e4m3fn))
    assert w8 != w  # the example is one where rounding shows
    assert torch.allclose(got.out.float(), torch.full((1, 1, 1, 512), (1 + 2 * w8) / (1 + w)), rtol=1e-3)
    assert not torch.allclose(got.out.float(), torch.full((1, 1, 1, 512), (1 + 2 * w) / (1 + w)), rtol=1e-3)


def test_e4m3_path_errors_name_the_argument():
    q, kv, cache, block_table, lens = decode_case(1, 1, 2, [8], torch.float16, True, seed=0)
    q8 = q.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_scale"):
        mla_decode_paged(q8, cache, block_table, lens, scale=SCALE)  # no q_scale
    with pytest.raises(ValueError, match="q_scale"):
        mla_decode_paged(q, cache, block_table, lens, scale=SCALE, q_scale=0.5)  # q_scale for a 16-bit q
    with pytest.raises(TypeError, match="fp8 cache"):
        mla_decode_paged(q8, cache, block_table, lens, scale=SCALE, q_scale=0.5)  # an fp16 cache
    with pytest.raises(TypeError, match="out_dtype"):
        mla_decode_paged(q, cache, block_table, lens, scale=SCALE, out_dtype=torch.bfloat16)
