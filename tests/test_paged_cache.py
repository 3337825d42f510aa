"""Tests for mlaspec.spec.paged_cache: slot mapping, concat_and_cache_mla, gather_cache."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.spec import cache_layouts
from mlaspec.spec.paged_cache import (
    concat_and_cache_mla,
    gather_cache,
    page_entries,
    slot_mapping_from_block_table,
    token_positions,
)

F64 = torch.float64


# ------------------------------------------------------------------------------------------ worked examples


def test_slot_mapping_worked_example():
    # Two requests, P = 4. Request 0: context 5 + 2 new tokens (positions 5, 6) on pages [7, 2];
    # request 1: a fresh prompt of 3 tokens (positions 0..2) on page [5]. Padded to 8 for a CUDA graph.
    block_table = torch.tensor([[7, 2, 0], [5, 0, 0]], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 2, 5], dtype=torch.int32)
    seq_lens = torch.tensor([7, 3], dtype=torch.int32)
    pos = token_positions(query_start_loc, seq_lens)
    assert pos.positions.tolist() == [5, 6, 0, 1, 2]
    assert pos.req_indices.tolist() == [0, 0, 1, 1, 1]
    sm = slot_mapping_from_block_table(block_table, 4, query_start_loc, pos.positions, pad_to=8)
    # position 5 -> logical block 1 -> page 2, offset 1 -> slot 9
    assert sm.slot_mapping.tolist() == [9, 10, 20, 21, 22, -1, -1, -1]
    assert sm.block_ids.tolist() == [2, 2, 5, 5, 5, -1, -1, -1]
    assert sm.block_offsets.tolist() == [1, 2, 0, 1, 2, -1, -1, -1]


def test_gather_worked_example_seq_starts_in_tokens():
    # P = 2; cache entry value = its slot number, so the gathered values are the slots read.
    cache = torch.arange(6 * 2, dtype=F64).reshape(6, 2, 1).expand(6, 2, 3).clone()
    block_table = torch.tensor([[4, 1, 3], [0, 5, 2]], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    out = gather_cache(cache, block_table, cu, 2, torch.tensor([1, 2], dtype=torch.int32))
    # request 0 reads positions 1, 2, 3: (page 4, off 1), (page 1, off 0), (page 1, off 1) -> slots 9, 2, 3
    # request 1 reads positions 2, 3: (page 5, off 0), (page 5, off 1) -> slots 10, 11
    assert out.slots.tolist() == [9, 2, 3, 10, 11]
    assert out.entries[:, 0].tolist() == [9.0, 2.0, 3.0, 10.0, 11.0]
    assert out.entries.shape == (5, 3)


def test_concat_and_cache_mla_latent_first_rope_after():
    kv_c = torch.full((1, 512), 1.0, dtype=F64)
    k_pe = torch.full((1, 64), 2.0, dtype=F64)
    cache = torch.zeros(2, 2, 576, dtype=F64)
    new = concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([3]))
    assert torch.all(new[1, 1, :512] == 1.0) and torch.all(new[1, 1, 512:] == 2.0)
    assert torch.count_nonzero(new[0]) == 0 and torch.count_nonzero(new[1, 0]) == 0
    assert torch.count_nonzero(cache) == 0  # the input is not written


def test_concat_and_cache_mla_fp8_per_tensor_divides_by_scale():
    # 336 / 448 tells "x / scale" from "x * scale": with scale 0.75, 336 -> 448 (e4m3 max), read back 336.
    kv_c = torch.zeros(1, 512, dtype=F64)
    kv_c[0, 0] = 336.0
    k_pe = torch.zeros(1, 64, dtype=F64)
    cache = torch.zeros(1, 4, 576, dtype=torch.uint8)
    new = concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([2]), kv_cache_dtype="fp8", scale=0.75)
    stored = new[0, 2].view(torch.float8_e4m3fn).to(F64)
    assert stored[0] == 448.0
    back = cache_layouts.dequantize(new[0, 2:3], "fp8_e4m3_per_tensor", scale=0.75).entries
    assert back[0, 0] == 336.0


def test_concat_and_cache_mla_fp8_ds_mla_record():
    kv_c = torch.randn(3, 512, dtype=F64)
    k_pe = torch.randn(3, 64, dtype=F64).to(torch.bfloat16).to(F64)
    cache = torch.zeros(2, 2, 656, dtype=torch.uint8)
    new = concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, -1, 3]), kv_cache_dtype="fp8_ds_mla")
    want = cache_layouts.quantize(torch.cat([kv_c, k_pe], 1), "fp8_ds_mla_v32").raw
    assert torch.equal(new.view(4, 656)[0], want[0]) and torch.equal(new.view(4, 656)[3], want[2])
    assert torch.count_nonzero(new.view(4, 656)[1:3]) == 0


def test_fp8_ds_mla_scales_by_vllm_version_worked_example():
    """vLLM's ``test_sparse_flashmla_decode_matches_cache_writer_scales`` (``tests/kernels/attention/
    test_flashmla_sparse.py``, after PR #49435): ``kv_c`` all 336 with its last 128 values 0, ``k_pe`` 0, ``k_scale``
    1. ``336 / 448 = 0.75`` is not a power of two: vLLM 0.33 stores it raw, vLLM after the PR stores ``1.0``, and the
    zero group ``FLT_MIN`` vs ``2^-13`` (the ``1e-4`` floor)."""
    kv_c = torch.full((1, 512), 336.0, dtype=torch.bfloat16)
    kv_c[:, -128:] = 0
    k_pe = torch.zeros(1, 64, dtype=torch.bfloat16)
    cache = torch.zeros(1, 64, 656, dtype=torch.uint8)
    kw = dict(kv_cache_dtype="fp8_ds_mla", scale=torch.ones(1))
    scales = {}
    for pow2 in (False, True):
        new = concat_and_cache_mla(kv_c, k_pe, cache, torch.zeros(1, dtype=torch.int64), pow2_scales=pow2, **kw)
        scales[pow2] = new[0, 0, 512:528].contiguous().view(torch.float32).tolist()
        nope = new[0, 0, :512].contiguous().view(torch.float8_e4m3fn).float()
        # e4m3(336 / 0.75) = 448 exactly; e4m3(336 / 1) is a tie between 320 and 352, to even: 320
        assert torch.equal(nope[:384], torch.full((384,), 320.0 if pow2 else 448.0))
    assert scales[False] == [0.75, 0.75, 0.75, torch.finfo(torch.float32).tiny]
    assert scales[True] == [1.0, 1.0, 1.0, 2.0**-13]
    with pytest.raises(ValueError, match="pow2_scales"):  # per-tensor fp8 has no group scales
        concat_and_cache_mla(
            kv_c, k_pe, cache[..., :576], torch.zeros(1), kv_cache_dtype="fp8", scale=1.0, pow2_scales=True
        )
    with pytest.raises(TypeError, match="pow2_scales"):
        concat_and_cache_mla(kv_c, k_pe, cache, torch.zeros(1), kv_cache_dtype="fp8_ds_mla", pow2_scales=1)


@given(st.integers(0, 2**16), st.floats(-20, 8))
def test_pow2_scales_round_the_raw_scale_up_to_a_power_of_two(seed, log_mag):
    """For any entries, the two writers store the same RoPE bytes, and each power-of-two group scale is the raw
    scale ``amax / 448`` rounded up to the next power of two (at least ``2^-13``): ``raw <= pow2 < 2 max(raw,
    1e-4)``, so no value saturates and the fp8 values still dequantize within the spec's error bound."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 576, generator=g, dtype=F64) * 2.0**log_mag).to(torch.bfloat16)
    cache = torch.zeros(1, 4, 656, dtype=torch.uint8)
    slots = torch.tensor([2, -1, 0])
    raw, pow2 = (
        concat_and_cache_mla(x[:, :512], x[:, 512:], cache, slots, kv_cache_dtype="fp8_ds_mla", pow2_scales=p).view(
            4, 656
        )[[2, 0]]
        for p in (False, True)
    )
    assert torch.equal(raw[:, 528:], pow2[:, 528:])
    s_raw = cache_layouts.dequantize(raw, "fp8_ds_mla_v32").scales
    back = cache_layouts.dequantize(pow2, "fp8_ds_mla_v32")
    s = back.scales
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    assert bool((s >= s_raw).all() and (s >= 2.0**-13).all() and (s < 2 * s_raw.clamp_min(1e-4)).all())
    kept = x[[0, 2]].to(F64)
    bound = cache_layouts.error_bound(kept, "fp8_ds_mla_v32", pow2_scales=True)
    assert bool(((back.entries - kept).abs() <= bound).all())


def test_fp8_ds_mla_rope_in_the_input_dtype_and_vllms_k_scale():
    """vLLM's ``concat_and_cache_ds_mla_kernel`` copies ``k_pe`` into bytes 528..655 as its ``scalar_t`` (bf16 or
    fp16: it checks ``kv_c.itemsize() == 2``), and FlashMLA's ``tests/quant.py`` views them as
    ``input_k_cache.dtype``: an fp16 model stores fp16 RoPE bytes, a bf16 model bf16 ones. vLLM also passes the
    layer's ``k_scale`` (``[1]`` fp32, 1.0) to the writer, which this kernel never reads."""
    g = torch.Generator().manual_seed(0)
    kv_c = torch.randn(2, 512, generator=g)
    k_pe = torch.tensor([[1.0 / 3.0, 1e-3] * 32, [-2.5, 65504.0] * 32])  # 1/3 and 1e-3 round differently in each
    cache = torch.zeros(1, 4, 656, dtype=torch.uint8)
    for dtype, layout in ((torch.float16, "fp8_ds_mla_v32_fp16"), (torch.bfloat16, "fp8_ds_mla_v32")):
        x, pe = kv_c.to(dtype), k_pe.to(dtype)
        new = concat_and_cache_mla(x, pe, cache, torch.tensor([1, 3]), kv_cache_dtype="fp8_ds_mla")
        rows = new.view(4, 656)[[1, 3]]
        assert torch.equal(rows[:, 528:].contiguous().view(dtype), pe)  # the input's own bytes
        back = cache_layouts.dequantize(rows, layout).entries
        assert torch.equal(back[:, 512:], pe.to(F64))
        for k_scale in (1.0, torch.tensor([1.0]), 0.5):  # accepted, and changes nothing
            kw = dict(kv_cache_dtype="fp8_ds_mla", scale=k_scale)
            assert torch.equal(concat_and_cache_mla(x, pe, cache, torch.tensor([1, 3]), **kw), new)
    assert not torch.equal(  # the two layouts read the same bytes differently
        cache_layouts.dequantize(rows, "fp8_ds_mla_v32_fp16").entries[:, 512:], k_pe.to(torch.bfloat16).to(F64)
    )
    with pytest.raises(ValueError, match="scale"):
        concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([1, 3]), kv_cache_dtype="fp8_ds_mla", scale=0.0)
    with pytest.raises(ValueError, match="scale"):
        concat_and_cache_mla(kv_c, k_pe, torch.zeros(1, 4, 576), torch.tensor([1, 3]), scale=1.0)


@given(st.integers(0, 2**16), st.floats(-8, 8))
def test_fp16_rope_survives_the_656_byte_record_exactly(seed, log_mag):
    """Any finite fp16 RoPE value comes back bit for bit from the fp16 variant of the record (and the NoPE part is
    the bf16 layout's, byte for byte)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 576, generator=g, dtype=F64) * 2.0**log_mag).to(torch.float16)
    raw16 = cache_layouts.quantize(x, cache_layouts.FP8_DS_MLA_V32_FP16).raw
    assert torch.equal(raw16[:, 528:].contiguous().view(torch.float16), x[:, 512:])
    assert torch.equal(cache_layouts.dequantize(raw16, "fp8_ds_mla_v32_fp16").entries[:, 512:], x[:, 512:].to(F64))
    assert torch.equal(raw16[:, :528], cache_layouts.quantize(x, cache_layouts.FP8_DS_MLA_V32).raw[:, :528])


def test_page_entries_worked_example():
    # B = 2, S_kv = 3, P = 2, one spare page: torch.randperm(5) under seed 0 is [4, 0, 1, 3, 2], request-major
    kv = torch.arange(6, dtype=F64).reshape(2, 3, 1)
    paged = page_entries(kv, 2, generator=torch.Generator().manual_seed(0), spare_column=True)
    assert paged.block_table.tolist() == [[4, 0, -1], [1, 3, -1]] and paged.block_table.dtype == torch.int32
    assert paged.seq_lens.tolist() == [3, 3] and paged.seq_lens.dtype == torch.int32
    flat = paged.cache.reshape(-1).tolist()
    assert [flat[s] for s in (8, 9, 0, 2, 3, 6)] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(math.isnan(flat[s]) for s in (1, 7, 4, 5))  # past the length, and the spare page 2
    # a byte cache with 0xFF (e4m3 NaN) fill and a shorter request; no spare page, no spare column
    raw = torch.full((2, 3, 2), 7, dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    paged = page_entries(raw, 2, seq_lens=torch.tensor([3, 1]), generator=g, spare_pages=0, fill=0xFF)
    assert paged.cache.shape == (4, 2, 2) and paged.block_table.shape == (2, 2)
    assert int((paged.cache == 7).all(-1).sum()) == 4 and int((paged.cache == 0xFF).all(-1).sum()) == 4


@given(
    st.integers(1, 3),
    st.integers(0, 9),
    st.integers(1, 4),
    st.integers(0, 2),
    st.booleans(),
    st.integers(0, 2**16),
    st.data(),
)
def test_page_entries_gather_back_and_nothing_else_is_written(b, s_kv, p, spare, column, seed, data):
    lens = data.draw(st.lists(st.integers(0, s_kv), min_size=b, max_size=b))
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(b, s_kv, 2, 3, generator=g, dtype=F64)
    paged = page_entries(kv, p, seq_lens=torch.tensor(lens), generator=g, spare_pages=spare, spare_column=column)
    pages = max(1, -(-s_kv // p))
    assert paged.cache.shape == (b * pages + spare, p, 2, 3)
    table = paged.block_table.long()
    assert table.shape == (b, pages + column)
    if column:
        assert (table[:, -1] == -1).all()
        table = table[:, :-1]
    assert sorted(table.reshape(-1).tolist()) == sorted(set(table.reshape(-1).tolist()))  # each page owned once
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    back = gather_cache(paged.cache, table, cu)
    assert torch.equal(back.entries, torch.cat([kv[i, :n] for i, n in enumerate(lens)]))
    written = torch.zeros(paged.cache.shape[0] * p, dtype=torch.bool)
    written[back.slots] = True
    assert torch.isnan(paged.cache.reshape(-1, 2, 3)[~written]).all()  # past every length, and the spare pages


# ------------------------------------------------------------------------------------------ properties


@st.composite
def paged_problem(draw):
    """A batch with a random page allocation; returns everything needed to write then gather."""
    p = draw(st.integers(1, 4))
    b = draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(0, 7), min_size=b, max_size=b))
    max_blocks = max(1, max(-(-n // p) for n in lens))
    used = sum(-(-n // p) for n in lens)
    num_blocks = used + draw(st.integers(1, 3))  # spare pages stay unused (NaN)
    perm = draw(st.permutations(range(num_blocks)))
    table = torch.zeros(b, max_blocks, dtype=torch.int32)
    k = 0
    for i, n in enumerate(lens):
        for j in range(-(-n // p)):
            table[i, j] = perm[k]
            k += 1
    seed = draw(st.integers(0, 2**16))
    return p, lens, table, num_blocks, seed


def _write_all(p, lens, table, num_blocks, seed, d=6):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    pos = token_positions(qsl, torch.tensor(lens))
    sm = slot_mapping_from_block_table(table, p, qsl, pos.positions, num_blocks=num_blocks)
    kv_c = torch.randn(t, d - 2, generator=g, dtype=F64)
    k_pe = torch.randn(t, 2, generator=g, dtype=F64)
    cache = torch.full((num_blocks, p, d), math.nan, dtype=F64)
    return qsl, sm, kv_c, k_pe, concat_and_cache_mla(kv_c, k_pe, cache, sm.slot_mapping)


@given(paged_problem())
def test_write_then_gather_round_trips_and_nan_pages_never_leak(problem):
    p, lens, table, num_blocks, seed = problem
    qsl, _, kv_c, k_pe, cache = _write_all(*problem)
    out = gather_cache(cache, table, qsl, len(lens))
    assert torch.equal(out.entries, torch.cat([kv_c, k_pe], 1))  # exact, and no NaN from unused pages
    assert not torch.isnan(out.entries).any()


@given(paged_problem(), st.data())
def test_chunked_gather_equals_full_gather(problem, data):
    # vLLM's chunked context: chunk i of request b reads [start, start + len) via seq_starts.
    p, lens, table, num_blocks, seed = problem
    qsl, _, _, _, cache = _write_all(*problem)
    full = gather_cache(cache, table, qsl).entries
    cut = [data.draw(st.integers(0, n)) for n in lens]
    first = gather_cache(cache, table, torch.tensor([0] + torch.tensor(cut).cumsum(0).tolist()))
    rest = [n - c for n, c in zip(lens, cut)]
    second = gather_cache(
        cache, table, torch.tensor([0] + torch.tensor(rest).cumsum(0).tolist()), seq_starts=torch.tensor(cut)
    )
    for b in range(len(lens)):
        a0, a1 = sum(cut[:b]), sum(cut[: b + 1])
        r0, r1 = sum(rest[:b]), sum(rest[: b + 1])
        assert torch.equal(torch.cat([first.entries[a0:a1], second.entries[r0:r1]]), full[qsl[b] : qsl[b + 1]])


@given(paged_problem(), st.data())
def test_permuting_physical_pages_changes_nothing(problem, data):
    p, lens, table, num_blocks, seed = problem
    qsl, _, _, _, cache = _write_all(*problem)
    perm = torch.tensor(data.draw(st.permutations(range(num_blocks))))
    moved = torch.empty_like(cache)
    moved[perm] = cache  # page q now lives at perm[q]
    out = gather_cache(cache, table, qsl).entries
    out_moved = gather_cache(moved, perm[table.long()].to(torch.int32), qsl).entries
    assert torch.equal(out, out_moved)


@given(paged_problem(), st.integers(1, 4))
def test_padding_slots_leave_the_cache_unchanged(problem, n_pad):
    p, lens, table, num_blocks, seed = problem
    cache = torch.randn(num_blocks, p, 6, dtype=F64)
    slots = torch.full((n_pad,), -1)
    new = concat_and_cache_mla(torch.randn(n_pad, 4, dtype=F64), torch.randn(n_pad, 2, dtype=F64), cache, slots)
    assert torch.equal(new, cache)


@given(st.integers(1, 4), st.integers(0, 5), st.integers(0, 9))
def test_gather_kernels_agree_on_block_aligned_starts(p, start_blocks, n):
    num_blocks = start_blocks + -(-n // p) + 1
    cache = torch.randn(num_blocks, p, 3, dtype=F64)
    table = torch.arange(num_blocks, dtype=torch.int32).flip(0)[None]
    cu, starts = torch.tensor([0, n]), torch.tensor([start_blocks * p])
    a = gather_cache(cache, table, cu, seq_starts=starts)
    b = gather_cache(cache, table, cu, seq_starts=starts, kernel="gather_and_maybe_dequant_cache")
    assert torch.equal(a.entries, b.entries)


# ------------------------------------------------------------------------------------------ bad input


def test_page_entries_rejects_bad_input():
    kv = torch.zeros(2, 3, 1)
    with pytest.raises(ValueError, match="seq_lens"):
        page_entries(kv, 2, seq_lens=torch.tensor([4, 1]))
    with pytest.raises(ValueError, match="seq_lens"):
        page_entries(kv, 2, seq_lens=torch.tensor([1, 1, 1]))
    with pytest.raises(TypeError, match="seq_lens"):
        page_entries(kv, 2, seq_lens=torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="page_size"):
        page_entries(kv, 0)
    with pytest.raises(TypeError, match="page_size"):
        page_entries(kv, 2.0)
    with pytest.raises(ValueError, match="kv"):
        page_entries(torch.zeros(3), 2)
    with pytest.raises(TypeError, match="kv"):
        page_entries([[1.0]], 2)
    with pytest.raises(ValueError, match="spare_pages"):
        page_entries(kv, 2, spare_pages=-1)
    with pytest.raises(TypeError, match="generator"):
        page_entries(kv, 2, generator=3)
    with pytest.raises(TypeError, match="spare_column"):
        page_entries(kv, 2, spare_column=1)
    with pytest.raises(ValueError, match="fill"):
        page_entries(kv.to(torch.uint8), 2)  # NaN has no uint8
    with pytest.raises(ValueError, match="fill"):
        page_entries(kv.to(torch.uint8), 2, fill=256)


def test_bad_slot_mapping_raises():
    kv_c, k_pe, cache = torch.zeros(2, 4, dtype=F64), torch.zeros(2, 2, dtype=F64), torch.zeros(2, 2, 6, dtype=F64)
    with pytest.raises(ValueError, match="slot_mapping"):
        concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 4]))  # past the cache
    with pytest.raises(ValueError, match="slot_mapping"):
        concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([1, 1]))  # repeated slot
    with pytest.raises(ValueError, match="slot_mapping"):
        concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, -2]))
    with pytest.raises(ValueError, match="kv_cache"):
        concat_and_cache_mla(kv_c, k_pe, torch.zeros(2, 2, 7, dtype=F64), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="slot_mapping"):
        concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 1]), kv_cache_dtype="int4")


def test_bad_gather_metadata_raises():
    cache = torch.zeros(3, 2, 4, dtype=F64)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens"):
        gather_cache(cache, table, torch.tensor([0, 3, 2]))  # non-monotonic
    with pytest.raises(ValueError, match="cu_seq_lens"):
        gather_cache(cache, table, torch.tensor([0, 3]))  # B disagrees with block_table
    with pytest.raises(ValueError, match="batch_size"):
        gather_cache(cache, table, torch.tensor([0, 1, 2]), 3)
    with pytest.raises(ValueError, match="block_table"):
        gather_cache(cache, torch.tensor([[0, 7], [2, 0]]), torch.tensor([0, 4, 5]))  # page 7 out of range
    with pytest.raises(ValueError, match="block_table"):
        gather_cache(cache, table, torch.tensor([0, 5, 6]))  # needs 3 blocks, table has 2
    with pytest.raises(ValueError, match="seq_starts"):
        gather_cache(cache, table, torch.tensor([0, 1, 2]), seq_starts=torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="seq_starts"):
        gather_cache(
            cache,
            table,
            torch.tensor([0, 1, 2]),
            seq_starts=torch.tensor([1, 0]),
            kernel="gather_and_maybe_dequant_cache",
        )


def test_bad_slot_mapping_metadata_raises():
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc"):
        slot_mapping_from_block_table(table, 2, torch.tensor([0, 2]), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="block_table"):
        slot_mapping_from_block_table(table, 2, torch.tensor([0, 1]), torch.tensor([4]))
    with pytest.raises(ValueError, match="block_table"):
        slot_mapping_from_block_table(table, 2, torch.tensor([0, 1]), torch.tensor([3]), num_blocks=1)
    with pytest.raises(ValueError, match="positions"):
        slot_mapping_from_block_table(table, 2, torch.tensor([0, 1]), torch.tensor([-1]))
    with pytest.raises(ValueError, match="pad_to"):
        slot_mapping_from_block_table(table, 2, torch.tensor([0, 1]), torch.tensor([0]), pad_to=0)
    with pytest.raises(ValueError, match="seq_lens"):
        token_positions(torch.tensor([0, 3]), torch.tensor([2]))
