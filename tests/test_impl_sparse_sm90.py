"""The Gluon sparse decode for Hopper (:mod:`mlaspec.impl.sparse_sm90`): when it runs, and what it computes.

Its numbers need an H100/H200 (Gluon has no interpreter): ``test_matches_spec`` runs there against the float64 spec
within the harness's budgets, beside the readable kernel on the same inputs, and skips elsewhere (CI); its structure
(224 KB of shared memory, no spills to local memory) is checked without a GPU in ``tests/test_impl_pipelining.py``;
which kernel a call takes, here on any machine.
"""

import math
import re

import pytest
import torch

from mlaspec.impl import sparse_sm90, sparse_sm90_producer
from mlaspec.impl.sparse import (
    SparseConfig,
    float_keys,
    fp8_keys,
    quantize_keys,
    sparse_mla_decode,
    sparse_sm90_why_not,
)
from tests.kernel_checks import check_sparse_decode, sparse_decode_case

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _why(capability=(9, 0), dtype=torch.bfloat16, fmt="fp8_v32", d_v=512, d_rope=64, **kw):
    return sparse_sm90_why_not(capability, dtype, fmt, d_v=d_v, d_rope=d_rope, **kw)


@pytest.mark.skipif(not sparse_sm90.AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(), None),  # V3.2 on an H200, any head count: the Gluon kernel
        (dict(dtype=torch.float16), None),
        (dict(tile=(64, 64)), None),  # a config override of its own tiles
        (dict(capability=None), "Hopper"),
        (dict(capability=(10, 0)), "Hopper"),
        (dict(tile=(16, 32)), "64 heads x 64 slots"),  # the readable kernel's few-head tiles
        (dict(dtype=torch.float32), "bf16/fp16"),
        (dict(fmt="float"), None),  # keys in q's dtype (the prefill's kv): sparse_kernel_float
        (dict(fmt="float", kv_heads=2), "one KV head"),
        (dict(fmt="float", aligned=False), "multiples of 16 elements"),
        (dict(fmt="fp8_v4", d_v=512, d_rope=0), "656-byte"),
        (dict(paged=True), "BlockTable"),
        (dict(extra=True), "extra"),
        (dict(d_v=256), "512 \\+ 64"),
        (dict(aligned=False), "16-byte aligned"),
    ],
)
def test_where_the_gluon_kernel_applies(kw, why):
    got = _why(**kw)
    assert got is None if why is None else re.search(why, got), got


def test_the_readable_kernel_when_asked_or_off_hopper(monkeypatch):
    q, cache, slots, lengths = sparse_decode_case(576, seed=3, dtype=torch.float32, h_q=64, k=8)
    keys = quantize_keys(cache.view(-1, 576), page_size=16)
    with pytest.raises(ValueError, match="Hopper"):  # on the CPU (or interpreted): no compiled kernel
        sparse_mla_decode(q, keys, slots, scale=0.1, kernel="sm90")
    with pytest.raises(ValueError, match="kernel must be one of"):
        sparse_mla_decode(q, keys, slots, scale=0.1, kernel="gluon")
    monkeypatch.setenv("MLASPEC_SPARSE_KERNEL", "nonsense")
    with pytest.raises(ValueError, match="MLASPEC_SPARSE_KERNEL"):
        sparse_mla_decode(q, keys, slots, scale=0.1)


@pytest.mark.skipif(not (HOPPER and sparse_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
@pytest.mark.parametrize(
    "h_q, k, seq_lens, lengths, dtype, splits, sink",
    [
        (128, 2048, (3000, 100, 2100), (2048, 70, 0), torch.bfloat16, None, False),  # V3.2 TP1; an empty request
        (128, 2048, (3000, 100, 2100), (2048, 70, 0), torch.bfloat16, 1, True),  # one split: writes the result
        (64, 1000, (1500, 900), (1000, 999), torch.float16, 7, True),  # K not a multiple of 64; -1 past a prefix
        (40, 256, (300, 64), (256, 64), torch.bfloat16, 3, False),  # 24 zero heads in the tile
        (16, 300, (500, 120), (300, 100), torch.bfloat16, None, True),  # V3.2 over 8 GPUs: 48 zero heads
    ],
)
@pytest.mark.parametrize("producer", [True, False], ids=["producer", "dequantizing-consumers"])
def test_matches_spec(monkeypatch, h_q, k, seq_lens, lengths, dtype, splits, sink, producer):
    """Both Gluon kernels (:mod:`mlaspec.impl.sparse_sm90_producer` forced on or off) against the float64 spec, and
    against the readable kernel; the two Gluon kernels bit for bit against each other."""
    import mlaspec.impl.sparse as sparse

    monkeypatch.setattr(sparse, "sparse_producer_runs", lambda tiles: producer)
    shape = dict(h_q=h_q, k=k, seq_lens=seq_lens, lengths=lengths)
    q, cache, slots, lens = sparse_decode_case(576, h_q + k, dtype, 64, **shape)
    keys = quantize_keys(cache.view(-1, 576), page_size=64)
    args, kw, results = _both_kernels(q, cache, slots, lens, keys._replace(data=keys.data.cuda()), splits, sink, 1)
    monkeypatch.setattr(sparse, "sparse_producer_runs", lambda tiles: not producer)
    other = sparse_mla_decode(*args, **kw, kernel="sm90")
    assert torch.equal(other[0], results["sm90"][0]) and torch.equal(other[1], results["sm90"][1])


def _both_kernels(q, cache, slots, lens, keys, splits, sink: bool, seed: int):
    """The Gluon and the readable kernel on one case (``keys`` on the GPU; a sink per head drawn from ``seed``, its
    first three ``+inf``, ``-inf``, 0), each against the float64 spec within the harness's budgets, and against each
    other: the same roundings, only the order of the MMAs' sums differs. ``(args, kwargs, {kernel: output})``."""
    attn_sink = None
    if sink:
        attn_sink = torch.randn(q.shape[2], generator=torch.Generator().manual_seed(seed)) * 2
        attn_sink[:3] = torch.tensor([math.inf, -math.inf, 0.0])
    args = (q.cuda(), keys, slots.cuda())
    kw = dict(scale=0.1, topk_length=lens.cuda(), num_splits=splits)
    kw["attn_sink"] = None if attn_sink is None else attn_sink.cuda()
    results = {}
    for kernel in ("sm90", "triton"):
        out, lse = results[kernel] = sparse_mla_decode(*args, **kw, kernel=kernel)
        check_sparse_decode(q, cache, slots, lens, out.cpu(), lse.cpu(), sink=attn_sink)
    diff = (results["sm90"][0].float() - results["triton"][0].float()).abs().max()
    assert float(diff) <= 2**-7 * float(results["triton"][0].float().abs().max()), float(diff)
    return args, kw, results


@pytest.mark.skipif(not (HOPPER and sparse_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
@pytest.mark.parametrize(
    "h_q, k, seq_lens, lengths, dtype, splits, sink",
    [
        (128, 2048, (3000, 100, 2100), (2048, 70, 0), torch.bfloat16, 1, True),  # V3.2's prefill, TP1; an empty row
        (64, 1000, (1500, 900), (1000, 999), torch.float16, 7, True),  # K not a multiple of 64; -1 past a prefix
        (40, 256, (300, 64), (256, 64), torch.bfloat16, None, False),  # 24 zero heads in the tile
        (16, 300, (500, 120), (300, 100), torch.bfloat16, 1, True),  # V3.2 over 8 GPUs: 48 zero heads
    ],
)
def test_matches_spec_over_keys_in_q_dtype(h_q, k, seq_lens, lengths, dtype, splits, sink):
    """:func:`sparse_sm90.sparse_kernel_float` (keys already in q's dtype, gathered by ``cp.async``; NaN in every
    row not named) against the float64 spec and beside the readable kernel, with and without splits."""
    shape = dict(h_q=h_q, k=k, seq_lens=seq_lens, lengths=lengths)
    q, cache, slots, lens = sparse_decode_case(576, h_q + k + 1, dtype, 64, **shape)
    _both_kernels(q, cache, slots, lens, float_keys(cache.view(-1, 1, 576).cuda()), splits, sink, 2)


@pytest.mark.skipif(not (HOPPER and sparse_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
def test_a_tile_override_keeps_the_readable_kernel(monkeypatch):
    shape = dict(h_q=128, k=128, seq_lens=(200, 300), lengths=(128, 50))
    q, cache, slots, lens = sparse_decode_case(576, 9, torch.bfloat16, 64, **shape)
    keys = quantize_keys(cache.view(-1, 576), page_size=64)
    args = (q.cuda(), keys._replace(data=keys.data.cuda()), slots.cuda())

    class Refused:
        def __getitem__(self, grid):
            raise AssertionError("the Gluon kernel ran")

    monkeypatch.setattr(sparse_sm90, "sparse_kernel", Refused())
    monkeypatch.setattr(sparse_sm90_producer, "sparse_kernel", Refused())
    out, lse = sparse_mla_decode(*args, scale=0.1, topk_length=lens.cuda(), config=SparseConfig(64, 64, 8, 2))
    check_sparse_decode(q, cache, slots, lens, out.cpu(), lse.cpu())
    with pytest.raises(AssertionError, match="Gluon kernel ran"):  # and the stub is what the default would call
        sparse_mla_decode(*args, scale=0.1, topk_length=lens.cuda())


@pytest.mark.skipif(not sparse_sm90.AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize(
    "heads, batch, k, fmt, grid, kernel",
    [
        (128, 1, 2048, "fp8_v32", (2, 1, 16), "producer"),  # 66 splits fill the card; 16 keep two of 32 tiles each
        (16, 1, 2048, "fp8_v32", (1, 1, 16), "producer"),  # 16 heads: one 64-row tile, zero rows past them
        (16, 8, 2048, "fp8_v32", (1, 8, 16), "producer"),
        (64, 1, 64, "fp8_v32", (1, 1, 1), "producer"),  # one tile: one split
        (128, 64, 2048, "fp8_v32", (2, 64, 1), "producer"),  # 128 programs: one wave already, whole rows
        (16, 64, 2048, "fp8_v32", (1, 64, 2), "sm90"),  # splits of 16 tiles: the dequantizing consumers'
        (128, 16, 2048, "fp8_v32", (2, 16, 4), "sm90"),  # 8 tiles
        (128, 1, 2048, "float", (2, 1, 16), "sm90-float"),  # keys in q's dtype: the gathering kernel
        (16, 128, 2048, "float", (1, 128, 1), "sm90-float"),  # 16 heads, one wave of whole rows: the same
        (16, 1, 2048, "float", (1, 1, 32), "triton"),  # 16 heads at B1: the readable kernel's 32 one-tile splits
        (64, 1, 2048, "float+8", (1, 1, 32), "triton"),  # key rows 584 apart: no 16-byte gather, the readable one
        (16, 256, 2048, "float", (1, 256, 1), "triton"),  # more rows at 16 heads: the readable kernel's 16-row tiles
        (64, 256, 2048, "float", (1, 256, 1), "sm90-float"),  # 64 heads: the gathering kernel at any row count
        (128, 1, 2048, "fp8_v32+8", (2, 1, 32), "triton"),  # a cache 8 bytes off 16-byte alignment: no cp.async
    ],
)
def test_which_kernel_and_splits_a_hopper_decode_takes(monkeypatch, heads, batch, k, fmt, grid, kernel):
    """On an H100 / H200 (its capability and 132 SMs stood in for, the kernels stubbed out): which kernel a decode
    launches and with how many splits."""
    import mlaspec.impl.sparse as sparse

    launched = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((self.name, grid))

    monkeypatch.setattr(sparse, "compiled_capability", lambda device: (9, 0))
    monkeypatch.setattr(sparse, "_num_sms", lambda device: 132)
    monkeypatch.setattr(sparse_sm90, "sparse_kernel", Stub("sm90"))
    monkeypatch.setattr(sparse_sm90_producer, "sparse_kernel", Stub("producer"))
    monkeypatch.setattr(sparse_sm90, "sparse_kernel_float", Stub("sm90-float"))
    monkeypatch.setattr(sparse, "_sparse_mla_kernel", Stub("triton"))
    monkeypatch.setattr(sparse, "_sparse_mla_combine_kernel", Stub("combine"))
    q = torch.zeros(batch, 1, heads, 576, dtype=torch.bfloat16)
    if fmt.startswith("fp8_v32"):
        offset = 8 if fmt.endswith("+8") else 0
        keys = fp8_keys(torch.zeros(4096 * 656 + offset, dtype=torch.uint8)[offset:], "fp8_v32", 64)
    else:  # "float+8": rows of 576 in a buffer 584 wide (16-byte aligned, not a multiple of 16 elements)
        width = 584 if fmt.endswith("+8") else 576
        keys = float_keys(torch.zeros(4096, 1, width, dtype=torch.bfloat16)[..., :576])
    idx = torch.zeros(batch, 1, k, dtype=torch.int32)
    sparse_mla_decode(q, keys, idx, scale=0.1)
    assert launched[0] == (kernel, grid), launched
    assert [name for name, _ in launched[1:]] == (["combine"] if grid[2] > 1 else [])
