"""The Gluon decode kernel for Hopper (:mod:`mlaspec.impl.decode_sm90`): when it runs, and what it computes.

Its numbers need an H100/H200 (Gluon has no interpreter): ``test_matches_spec`` runs there against the float64
spec within the harness's budgets, beside the readable kernel on the same inputs, and skips elsewhere (CI). Its
structure -- the next key tile issued before this tile's dots, in 227 KB -- is checked without a GPU in
``tests/test_impl_pipelining.py``; which kernel a call takes, here on any machine.
"""

import re

import pytest
import torch

from mlaspec.conformance.backends.triton import TritonE4m3Backend
from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.ops.common import unit_roundoff
from mlaspec.conformance.runner import run_case
from mlaspec.impl import decode_sm90
from mlaspec.impl.decode import (
    GLUON_TILE,
    DecodeConfig,
    decode_config,
    mla_decode_paged,
    sm90_why_not,
    use_sm90,
)
from tests.kernel_checks import SCALE, assert_within, decode_case, decode_reference, record, splits_of

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _why(capability=(9, 0), dtype=torch.bfloat16, rows=128, fp8=False, d_v=512, d_rope=64, page_size=64, aligned=True):
    cfg = decode_config(rows, page_size, dtype, fp8)
    return sm90_why_not(capability, dtype, cfg, d_v=d_v, d_rope=d_rope, aligned=aligned)


@pytest.mark.skipif(not decode_sm90.AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(), None),  # 128 heads, bf16, on an H200: the Gluon kernel
        (dict(rows=64, dtype=torch.float16, page_size=128), None),
        (dict(capability=None), "Hopper"),
        (dict(capability=(10, 0)), "Hopper"),  # Blackwell: not this kernel's instructions
        (dict(capability=(8, 0)), "Hopper"),
        (dict(dtype=torch.float32), "bf16 / fp16"),
        (dict(fp8=True), None),  # vLLM's per-tensor fp8 cache: split_kernel_fp8
        (dict(fp8=True, dtype=torch.float32), "bf16 / fp16"),
        (dict(fp8=True, dtype=torch.float8_e4m3fn), None),  # the e4m3 path: split_kernel_e4m3_keys
        (dict(fp8=True, dtype=torch.float8_e4m3fn, capability=None), "Hopper"),
        (dict(rows=32), "64-row"),  # 16 heads with MTP 2: the readable kernel's 5-stage pipeline
        (dict(page_size=32), "64-row tiles of 64 keys"),  # a 32-slot page: 32-key tiles
        (dict(d_v=256, d_rope=64), "512 \\+ 64"),
        (dict(aligned=False), "16-byte aligned"),  # q sliced out of wider rows: the readable kernel takes it
    ],
)
def test_where_the_gluon_kernel_applies(kw, why):
    got = _why(**kw)
    assert got is None if why is None else re.search(why, got), got


@pytest.mark.parametrize("rows, keys", [(1, 16), (16, 16), (17, 32), (32, 32), (33, None), (64, None), (128, None)])
def test_which_fp8_rows_take_the_keys_as_mma_rows(rows, keys):
    """16 or 32 query rows a program of ``split_kernel_fp8_keys`` (the MMAs' ``N``) up to 32 rows; above,
    ``split_kernel_fp8``'s 64-row tile, in :data:`GLUON_TILE` either way (its 64-key tiles)."""
    assert decode_sm90.keys_rows(rows) == keys
    assert decode_config(rows, 64, torch.bfloat16, True, gluon=True) == DecodeConfig(64, 64, 8, 1) == GLUON_TILE


@pytest.mark.parametrize(
    "batch, rows, key_tiles, want",
    [
        (64, 16, 128, 16),  # 16 heads: one consumer, whatever the work
        (64, 17, 128, 64),  # beyond 16 rows: a 64-row program (its rows past 17 masked)
        (64, 128, 128, 64),  # 128 heads, B64 8K: 2 x 64 x 128 tile steps
        (1, 128, 16, 16),  # 128 heads, B1 1K: 32 tile steps on 132 SMs, sixteen-row programs spread wider
        (1, 128, 66, 16),  # 132 steps: not more than the SMs
        (1, 128, 67, 64),
    ],
)
def test_which_e4m3_rows_a_program_takes(batch, rows, key_tiles, want):
    """``split_kernel_e4m3_keys`` takes 64 rows (a leader and a helper) beyond 16 rows where its tile steps outnumber
    the SMs, else 16: the rule ``mla_decode_paged`` applies on Hopper (132 SMs here, an H100's and H200's)."""
    assert decode_sm90.e4m3_rows(batch, rows, key_tiles, 132) == want


def test_the_readable_kernel_when_asked_or_off_hopper():
    q = torch.empty(1, 1, 128, 576, dtype=torch.bfloat16)  # on the CPU
    cache = torch.empty(2, 64, 576, dtype=torch.bfloat16)
    cfg = decode_config(128, 64, torch.bfloat16)
    shape = dict(d_v=512, d_rope=64)
    assert not use_sm90("auto", q, cache, cfg, **shape) and not use_sm90("triton", q, cache, cfg, **shape)
    with pytest.raises(ValueError, match="Hopper"):
        use_sm90("sm90", q, cache, cfg, **shape)
    with pytest.raises(ValueError, match="kernel must be one of"):
        use_sm90("gluon", q, cache, cfg, **shape)
    q8, cache8 = q.to(torch.float8_e4m3fn), cache.to(torch.float8_e4m3fn)  # the e4m3 path asks for it the same way
    with pytest.raises(ValueError, match="e4m3 path's Gluon kernel"):
        mla_decode_paged(q8, cache8, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([64], dtype=torch.int32),
                         scale=SCALE, k_scale=1.0, q_scale=1.0, kernel="sm90")  # fmt: skip
    empty = torch.empty(0, 1, 128, 576)  # checked before the early return of an empty batch
    with pytest.raises(ValueError, match="kernel must be one of"):
        mla_decode_paged(empty, cache.float(), torch.empty(0, 1, dtype=torch.int32), torch.empty(0, dtype=torch.int32),
                         scale=SCALE, kernel="gluon")  # fmt: skip


def test_the_environment_picks_the_kernel(monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors run interpreted only
    q, _, cache, block_table, lens = (t.to(device) for t in decode_case(1, 1, 2, [8], torch.float32, True, seed=0))
    monkeypatch.setenv("MLASPEC_DECODE_KERNEL", "nonsense")
    with pytest.raises(ValueError, match="kernel must be one of"):
        mla_decode_paged(q, cache, block_table, lens, scale=SCALE)
    monkeypatch.setenv("MLASPEC_DECODE_KERNEL", "sm90")
    with pytest.raises(ValueError, match="decode_sm90"):
        mla_decode_paged(q, cache, block_table, lens, scale=SCALE)
    monkeypatch.setenv("MLASPEC_DECODE_KERNEL", "triton")
    assert mla_decode_paged(q, cache, block_table, lens, scale=SCALE).out.shape == (1, 1, 2, 512)


@pytest.mark.skipif(not (HOPPER and decode_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
@pytest.mark.parametrize(
    "B, S_q, H, seq_lens, dtype, causal, page_size, num_splits",
    [
        (1, 1, 128, [1000], torch.bfloat16, True, 64, None),  # TP1 decode, a part-filled last page
        (3, 1, 128, [0, 77, 4096], torch.bfloat16, True, 64, None),  # an empty sequence; splits with nothing
        (2, 2, 64, [5, 300], torch.bfloat16, True, 64, None),  # MTP: rows that see fewer keys
        (2, 1, 40, [129, 64], torch.bfloat16, True, 64, None),  # 40 rows: a tile of 64 with 24 masked rows
        (2, 1, 128, [2000, 3000], torch.float16, True, 64, None),
        (2, 1, 128, [1000, 333], torch.bfloat16, True, 128, None),  # two tiles a page
        (1, 1, 128, [700], torch.bfloat16, True, 64, 1),  # one split: the kernel writes the result itself
        (1, 2, 64, [513], torch.bfloat16, False, 64, None),
        (2, 1, 128, [64, 8192], torch.bfloat16, True, 64, 128),  # a sequence of one tile among 128 splits
        (2, 1, 16, [129, 8192], torch.bfloat16, True, 64, None),  # 16 heads: the keys as the MMAs' rows
        (3, 1, 8, [0, 65, 2000], torch.float16, True, 128, None),  # 8 rows of 16, an empty sequence, two tiles a page
        (1, 1, 16, [700], torch.bfloat16, False, 64, 1),  # ... one split
        (2, 2, 8, [40, 700], torch.bfloat16, True, 64, None),  # ... MTP 2: rows that see fewer keys
    ],
)
def test_matches_spec(B, S_q, H, seq_lens, dtype, causal, page_size, num_splits):
    q, kv, cache, block_table, lens = decode_case(
        B, S_q, H, seq_lens, dtype, causal, seed=H + sum(seq_lens), page_size=page_size
    )
    ref_out, ref_lse, out_bound, lse_bound = decode_reference(q, kv, seq_lens, causal, unit_roundoff(dtype))
    args = [t.cuda() for t in (q, cache, block_table, lens)]
    for kernel in ("sm90", "triton"):
        out, lse = mla_decode_paged(*args, scale=SCALE, causal=causal, num_splits=num_splits, kernel=kernel)
        assert_within(f"{kernel} out", out, ref_out, out_bound)
        assert_within(f"{kernel} lse", lse, ref_lse, lse_bound)


@pytest.mark.skipif(not (HOPPER and decode_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
@pytest.mark.parametrize("S_q, H, keys", [(1, 16, True), (2, 8, True), (1, 8, True), (2, 16, False), (1, 64, False)])
def test_16_rows_or_fewer_take_the_keys_as_mma_rows(S_q, H, keys, monkeypatch):
    """``auto`` sends a 16-bit cache at 16 query rows or fewer to ``split_kernel_keys`` (17-32 rows: the readable
    kernel; 64: ``split_kernel``), and a tile override keeps the padded ``split_kernel``."""
    q, _, cache, block_table, lens = (t.cuda() for t in decode_case(2, S_q, H, [300, 64], torch.bfloat16, True, seed=1))
    ran = record(monkeypatch, decode_sm90, "split_kernel_keys", "split_kernel", "split_kernel_lead")
    mla_decode_paged(q, cache, block_table, lens, scale=SCALE)
    assert ran == (["split_kernel_keys"] if keys else ["split_kernel"] if S_q * H > 32 else []), ran
    ran.clear()
    mla_decode_paged(q, cache, block_table, lens, scale=SCALE, kernel="sm90", config=GLUON_TILE)
    assert ran == ["split_kernel"], ran


@pytest.mark.skipif(not (HOPPER and decode_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
@pytest.mark.parametrize("H, kernel", [(16, "split_kernel_keys"), (64, "split_kernel")])
@pytest.mark.parametrize(
    "lens, page_size",
    [
        ([0, 77, 4096, 130], 64),  # an empty sequence, splits with nothing or one tile to do
        ([4096], 64),  # 64 tiles: one a split at 16 heads
        ([1000, 3000], 128),  # two tiles a page
    ],
)
@pytest.mark.parametrize("max_seq_len", [None, 1 << 20])
def test_first_pages_read_before_the_length_and_the_early_combine(H, kernel, lens, page_size, max_seq_len, monkeypatch):
    """Each split reads its first two pages beside its sequence's length (``decode_sm90._split_start``), also where
    ``max_seq_len`` overstates the table, whose width then sets the splits: every split's first tile is in the
    table, cut here to its sequences' pages. The combine launches as a programmatic dependent after
    ``split_kernel_keys`` only. The spec's results either way."""
    import mlaspec.impl.decode as decode

    q, kv, cache, block_table, seq_lens = decode_case(len(lens), 1, H, lens, torch.bfloat16, True, seed=H,
                                                      page_size=page_size)  # fmt: skip
    block_table = block_table[:, : -(-max(lens) // page_size)]  # no spare column
    launches, combines = [], []
    ran = record(monkeypatch, decode_sm90, kernel, launches=launches)
    record(monkeypatch, decode, "_mla_decode_combine_kernel", launches=combines)
    args = [t.cuda() for t in (q, cache, block_table, seq_lens)]
    out, lse = mla_decode_paged(*args, scale=SCALE, max_seq_len=max_seq_len)
    ref_out, ref_lse, out_bound, lse_bound = decode_reference(q, kv, lens, True, unit_roundoff(q.dtype))
    assert_within("out", out, ref_out, out_bound)
    assert_within("lse", lse, ref_lse, lse_bound)
    assert ran == [kernel], ran
    blocks_per_split, num_splits = splits_of(launches[0])
    assert (num_splits - 1) * blocks_per_split < block_table.shape[1] * page_size // 64, (blocks_per_split, num_splits)
    assert [c.get("launch_pdl", False) for c in combines] == [kernel == "split_kernel_keys"] * (num_splits > 1)


@pytest.mark.skipif(not decode_sm90.AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_memory_copies_where_pages_are_one_stride_apart(dtype):
    """The cache ``[pages, 64, 576]`` as ``[slots, 576]``: a descriptor for a tile's latent part, one for its RoPE
    part; none where a page's slots are not followed by the next page's (then the copies go by ``cp.async``)."""
    cache = torch.zeros(3, 64, 576, dtype=dtype)
    latent, rope = decode_sm90.cache_descriptors(cache, 64)
    assert (latent.shape, latent.strides, latent.block_shape) == ([192, 576], [576, 1], [64, 512])
    assert (rope.shape, rope.block_shape) == ([192, 576], [64, 64])
    assert decode_sm90.cache_descriptors(torch.zeros(3, 65, 576, dtype=dtype)[:, :64], 64) is None  # a slot between
    assert decode_sm90.cache_descriptors(cache[:1], 64) is not None


@pytest.mark.skipif(not decode_sm90.AVAILABLE, reason="this Triton has no Gluon")
def test_split_partials_leave_by_tensor_memory_copies_in_whole_row_blocks():
    """``o_part [B, splits, rows, 512]`` fp32 as ``[B * splits * rows, 512]`` in a warpgroup's ``[64, 256]`` blocks;
    none where a 64-row block would run into the next split's rows or the partials are not contiguous (the
    epilogue then stores from registers, masked)."""
    desc = decode_sm90.partial_descriptor(torch.zeros(2, 3, 128, 512))
    assert (list(desc.shape), list(desc.strides), desc.block_shape) == ([768, 512], [512, 1], [64, 256])
    assert decode_sm90.partial_descriptor(torch.zeros(2, 3, 96, 512)) is None  # 96 heads: a block spans two splits
    assert decode_sm90.partial_descriptor(torch.zeros(2, 128, 3, 512).transpose(1, 2)) is None


@pytest.mark.skipif(not (HOPPER and decode_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
@pytest.mark.parametrize("gap", [False, True])
@pytest.mark.parametrize("heads", [128, 16])
def test_both_copy_paths_match_spec(gap, heads, monkeypatch):
    """Tensor-memory copies (whole tiles; a sequence's last, part-filled tile by ``cp.async`` over NaN slots) where
    the pages are one stride apart, ``cp.async`` throughout where a slot lies between pages (``gap``); 64-row blocks
    (128 heads) and the keys as the MMAs' rows (16)."""
    q, kv, cache, block_table, lens = decode_case(2, 1, heads, [1000, 4096], torch.bfloat16, True, seed=11)
    if gap:
        wide = torch.full((cache.shape[0], 65, 576), float("nan"), dtype=cache.dtype)
        wide[:, :64] = cache
        cache = wide.cuda()[:, :64]
    made = []
    real = decode_sm90.cache_descriptors
    monkeypatch.setattr(decode_sm90, "cache_descriptors", lambda *a: made.append(real(*a)) or made[-1])
    ref_out, ref_lse, out_bound, lse_bound = decode_reference(q, kv, [1000, 4096], True, unit_roundoff(q.dtype))
    out, lse = mla_decode_paged(q.cuda(), cache.cuda(), block_table.cuda(), lens.cuda(), scale=SCALE, kernel="sm90")
    assert made and (made[-1] is None) == gap
    assert_within("out", out, ref_out, out_bound)
    assert_within("lse", lse, ref_lse, lse_bound)


@pytest.mark.skipif(not (HOPPER and decode_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
def test_inputs_it_does_not_take_run_the_readable_kernel(monkeypatch):
    """q sliced out of 584-wide rows (a stride its 16-byte copies are not compiled for), and a tile override: the
    readable kernel runs them under ``auto``, right, and ``kernel="sm90"`` says why it cannot."""
    q, kv, cache, block_table, lens = decode_case(1, 1, 128, [300], torch.bfloat16, True, seed=5)
    wide = torch.zeros(1, 1, 128, 584, dtype=q.dtype)
    wide[..., :576] = q
    ref_out, ref_lse, out_bound, lse_bound = decode_reference(q, kv, [300], True, unit_roundoff(q.dtype))
    args = [wide.cuda()[..., :576], *(t.cuda() for t in (cache, block_table, lens))]
    out, lse = mla_decode_paged(*args, scale=SCALE)
    assert_within("out", out, ref_out, out_bound)
    assert_within("lse", lse, ref_lse, lse_bound)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mla_decode_paged(*args, scale=SCALE, kernel="sm90")
    args[0] = args[0].contiguous()  # now the Gluon kernel applies ...
    assert use_sm90("auto", args[0], args[1], decode_config(128, 64, q.dtype), d_v=512, d_rope=64)

    class Refused:
        def __getitem__(self, grid):
            raise AssertionError("the Gluon kernel ran under a tile override")

    for name in ("split_kernel", "split_kernel_lead"):  # ... but a tile override keeps the readable one
        monkeypatch.setattr(decode_sm90, name, Refused())
    out, lse = mla_decode_paged(*args, scale=SCALE, config=DecodeConfig(64, 64, 8, 2))
    assert_within("out", out, ref_out, out_bound)
    with pytest.raises(AssertionError, match="Gluon kernel ran"):  # and the stub is what the default would call
        mla_decode_paged(*args, scale=SCALE)


@pytest.mark.skipif(not (HOPPER and decode_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
@pytest.mark.parametrize("S_q, H, lead", [(1, 128, True), (2, 64, True), (1, 96, True), (4, 16, False), (1, 64, False)])
def test_the_lead_kernel_takes_rows_whose_tiles_other_programs_read(S_q, H, lead, monkeypatch):
    """Two or more 64-row blocks (128 heads; 64 with 2 MTP tokens) run ``split_kernel_lead``, one block
    ``split_kernel``; both right against the spec (a part-filled last tile, several splits of several tiles each;
    96 heads: a part-filled row block, whose partials leave from registers, 128: as tensor-memory copies)."""
    q, kv, cache, block_table, lens = decode_case(2, S_q, H, [9000, 77], torch.bfloat16, True, seed=H + S_q)
    ref_out, ref_lse, out_bound, lse_bound = decode_reference(q, kv, [9000, 77], True, unit_roundoff(q.dtype))
    copied = []
    real_descriptor = decode_sm90.partial_descriptor
    monkeypatch.setattr(decode_sm90, "partial_descriptor", lambda o: copied.append(real_descriptor(o)) or copied[-1])
    ran = record(monkeypatch, decode_sm90, "split_kernel", "split_kernel_lead")
    out, lse = mla_decode_paged(*(t.cuda() for t in (q, cache, block_table, lens)), scale=SCALE, kernel="sm90")
    assert ran == ["split_kernel_lead" if lead else "split_kernel"]
    assert [c is not None for c in copied] == ([S_q * H % 64 == 0] if lead else [])
    assert decode_sm90.lead_applies(-(-S_q * H // decode_sm90.BLOCK_M)) == lead
    assert_within("out", out, ref_out, out_bound)
    assert_within("lse", lse, ref_lse, lse_bound)


FP8_CASES = [
    (1, 1, 128, [1000], True, 64, None),
    (3, 1, 128, [0, 77, 4096], True, 64, None),  # an empty sequence; splits with nothing
    (2, 2, 64, [5, 300], True, 64, None),  # MTP: rows that see fewer keys
    (2, 1, 16, [129, 64], True, 64, None),  # 16 heads: the keys as the MMAs' rows (sm90)
    (2, 1, 16, [8192, 64], True, 64, None),
    (2, 2, 16, [300, 1000], True, 64, None),  # 16 heads, MTP 2: 32 rows
    (2, 2, 8, [40, 700], True, 64, None),  # MTP 2 at 16 rows: rows that see fewer keys, the keys as MMA rows
    (3, 1, 8, [0, 65, 2000], True, 128, None),  # 8 rows of 16, an empty sequence, two tiles a page
    (1, 1, 16, [700], False, 64, 1),  # one split
    (2, 1, 128, [1000, 333], True, 128, None),  # two tiles a page
    (1, 1, 128, [700], True, 64, 1),  # one split: the kernel writes the result itself
    (1, 2, 64, [513], False, 64, None),
    (2, 4, 16, [300, 2000], True, 64, None),  # 64 rows, one block: split_kernel_fp8 as called
]


def _fp8(cache, k_scale):
    """vLLM's per-tensor fp8 cache of ``cache``: e4m3 bytes of ``cache / k_scale`` (NaN slots stay NaN bytes)."""
    return (cache.float() / k_scale).to(torch.float8_e4m3fn).view(torch.uint8)


@pytest.mark.skipif(not (HOPPER and decode_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
@pytest.mark.parametrize("lead", [True, False])
@pytest.mark.parametrize("B, S_q, H, seq_lens, causal, page_size, num_splits", FP8_CASES)
def test_fp8_equals_the_bf16_kernel_on_the_converted_cache(
    B, S_q, H, seq_lens, causal, page_size, num_splits, lead, monkeypatch
):
    """The fp8 kernels convert each byte to bf16 exactly and keep ``k_scale`` out of the tile: at ``k_scale = 1``
    their outputs are the bf16 kernels' on the cache converted to bf16, bit for bit (same MMAs, same softmax).
    Two or more 64-row blocks run ``split_kernel_lead`` over either cache (over the fp8 one with a producer), one
    block (or ``lead_applies`` off: ``lead=False``) ``split_kernel_fp8`` against the bf16 ``split_kernel``. At 32
    rows or fewer ``split_kernel_fp8_keys`` runs instead, and at 16 or fewer equals ``split_kernel_keys`` on the
    converted cache bit for bit (same tile step; at 17-32 the bf16 cache takes the readable kernel, whose MMAs add in
    another order: ``test_fp8_matches_spec`` judges it there). ``auto`` takes the same Gluon kernel at any size."""
    if not lead:
        monkeypatch.setattr(decode_sm90, "lead_applies", lambda row_blocks: False)
    case = decode_case(B, S_q, H, seq_lens, torch.bfloat16, causal, seed=H + sum(seq_lens), page_size=page_size)
    q, _, cache, block_table, lens = (t.cuda() for t in case)
    c8 = _fp8(cache, 1.0)
    kw = dict(scale=SCALE, causal=causal, num_splits=num_splits)
    calls = record(monkeypatch, decode_sm90, "split_kernel_fp8", "split_kernel_fp8_keys", "split_kernel_lead")
    got = mla_decode_paged(q, c8, block_table, lens, k_scale=1.0, kernel="sm90", **kw)
    keys = decode_sm90.keys_rows(H * S_q) is not None
    shared = decode_sm90.lead_applies(-(-H * S_q // decode_sm90.BLOCK_M))  # (patched off above at lead=False)
    kernel = "split_kernel_fp8_keys" if keys else "split_kernel_lead" if shared else "split_kernel_fp8"
    assert calls == [kernel], calls
    if H * S_q <= 16 or H * S_q > 32:  # the bf16 cache's Gluon kernel with the same tile step (17-32: the readable one)
        calls.clear()
        want = mla_decode_paged(q, c8.view(torch.float8_e4m3fn).to(torch.bfloat16), block_table, lens, kernel="sm90",
                                **kw)  # fmt: skip
        assert calls == (["split_kernel_lead"] if kernel == "split_kernel_lead" else []), calls
        assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)
    calls.clear()
    mla_decode_paged(q, c8, block_table, lens, k_scale=1.0, **kw)
    assert calls == [kernel], calls


@pytest.mark.skipif(not (HOPPER and decode_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
@pytest.mark.parametrize("B, S_q, H, seq_lens, causal, page_size, num_splits", FP8_CASES)
def test_fp8_matches_spec(B, S_q, H, seq_lens, causal, page_size, num_splits):
    """Over the fp8 cache at ``k_scale = 0.37``, against the float64 spec on the dequantized entries, within the
    harness's budgets for q's dtype, beside the readable kernel on the same bytes."""
    k_scale = 0.37
    q, kv, cache, block_table, lens = decode_case(
        B, S_q, H, seq_lens, torch.bfloat16, causal, seed=H + sum(seq_lens), page_size=page_size
    )
    dequantized = (kv.double() / k_scale).to(torch.float8_e4m3fn).double() * k_scale
    ref_out, ref_lse, out_bound, lse_bound = decode_reference(q, dequantized, seq_lens, causal, unit_roundoff(q.dtype))
    args = [q.cuda(), _fp8(cache, k_scale).cuda(), block_table.cuda(), lens.cuda()]
    for kernel in ("sm90", "triton"):
        out, lse = mla_decode_paged(*args, scale=SCALE, causal=causal, k_scale=k_scale, num_splits=num_splits,
                                    kernel=kernel)  # fmt: skip
        assert_within(f"{kernel} out", out, ref_out, out_bound)
        assert_within(f"{kernel} lse", lse, ref_lse, lse_bound)


E4M3_FULL = [
    case
    for case in curated_cases(ops=("mla_decode_fp8",), scale="full")
    if case.params["layout"] == "fp8_e4m3_per_tensor"
]


@pytest.mark.skipif(not (HOPPER and decode_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
@pytest.mark.parametrize("splits", ["auto", "one"])
@pytest.mark.parametrize("case", E4M3_FULL, ids=lambda c: c.id)
def test_the_e4m3_path_passes_its_full_scale_cases(case, splits, monkeypatch):
    """The e4m3 path's Gluon kernel, judged as ``mlaspec check --backend triton-e4m3 --scale full`` judges it, with
    the split count the decode picks and with one split (the kernel writes the output itself, ``SINGLE``): 128 heads
    (B2-4, 4K keys) run its 64-row programs (a leader and a helper), 16 heads its 16-row ones, 16 heads with 2 MTP
    tokens either, as ``e4m3_rows`` picks by the SM count."""
    import mlaspec.impl.decode as decode

    if splits == "one":
        monkeypatch.setattr(decode, "num_splits_heuristic", lambda *args, **kwargs: 1)
    launches = []
    record(monkeypatch, decode_sm90, "split_kernel_e4m3_keys", launches=launches)
    result = run_case(TritonE4m3Backend(), case, backend_name="triton-e4m3", scale="full", timeout=None)
    assert result.verdict == "pass", f"{case.id}: {result.verdict}: {result.reason}"
    rows = [kwargs["BLOCK_M"] for kwargs in launches]
    p = case.params
    batch, key_tiles = p["B"], -(-max(p.get("seq_lens", [p["S_kv"]])) // 64)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert rows == [decode_sm90.e4m3_rows(batch, p["S_q"] * p["H_q"], key_tiles, sms)], rows
    program = {16: 16, 128: 64}.get(p["S_q"] * p["H_q"])  # whatever the rule says, both programs are judged here
    assert program is None or rows == [program], rows
