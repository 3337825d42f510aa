"""The Gluon indexer-logits kernel for Hopper (:mod:`mlaspec.impl.indexer_sm90`): when it runs, and what it computes.

Its numbers need an H100/H200 (Gluon has no interpreter): ``test_matches_spec`` runs there against the float64
spec within the harness's budget, beside the readable kernel on the same inputs, and skips elsewhere (CI). Its
structure is checked without a GPU in ``tests/test_impl_pipelining.py``; which kernel a call takes, here on any
machine.
"""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.conformance.ops.indexer import logits_bound
from mlaspec.impl import indexer_sm90
from mlaspec.impl.indexer import indexer_logits, indexer_sm90_why_not
from mlaspec.spec import indexer as spec
from tests.kernel_checks import assert_logits, indexer_case

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not indexer_sm90.AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(), None),  # 64 heads of 128 on an H200
        (dict(capability=(9, 0)), None),
        (dict(capability=None), "Hopper"),  # off CUDA, or interpreted
        (dict(capability=(10, 0)), "Hopper"),  # Blackwell: DeepGEMM's sm100 kernel, not these instructions
        (dict(capability=(8, 0)), "Hopper"),
        (dict(heads=32), "64 heads of 128"),
        (dict(dim=64), "64 heads of 128"),
        (dict(aligned=False), "16-byte aligned"),
    ],
)
def test_where_the_gluon_kernel_applies(kw, why):
    args = dict(capability=(9, 0), heads=64, dim=128) | kw
    got = indexer_sm90_why_not(args.pop("capability"), args.pop("heads"), args.pop("dim"), **args)
    assert got is None if why is None else re.search(why, got), got


def test_the_kernel_is_chosen_by_name_or_environment(monkeypatch):
    q = torch.zeros(3, 64, 128, dtype=torch.float8_e4m3fn)  # on the CPU: only the readable kernel can run
    k = torch.zeros(5, 128, dtype=torch.float8_e4m3fn)
    w, ks, ke = torch.ones(3, 64), torch.zeros(3, dtype=torch.int32), torch.full((3,), 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="Hopper"):
        indexer_logits(q, k, w, ks, ke, kernel="sm90")
    with pytest.raises(ValueError, match="kernel must be one of"):
        indexer_logits(q, k, w, ks, ke, kernel="gluon")
    monkeypatch.setenv("MLASPEC_INDEXER_KERNEL", "nonsense")
    with pytest.raises(ValueError, match="MLASPEC_INDEXER_KERNEL"):
        indexer_logits(q, k, w, ks, ke)
    monkeypatch.setenv("MLASPEC_INDEXER_KERNEL", "sm90")
    with pytest.raises(ValueError, match="indexer_sm90"):
        indexer_logits(q, k, w, ks, ke)


@pytest.mark.parametrize(
    "m, n, sms, tiles",
    [
        (1024, 1024, 132, 8),  # S = 1K causal on an H200: 512 token pairs, one 2048-key chunk each at 32 tiles
        (2048, 2048, 132, 16),
        (4096, 4096, 132, 256),  # the card filled by whole rows: one chunk a token pair
        (1056, 32768, 132, 256),  # 528 pairs, two 16K-key chunks each: 1056 programs, two a slot
        (1054, 32768, 132, 32),  # 527 pairs: 1054 programs of 256 tiles, short of 1056, so 32
        (4096, 4096, 1024, 16),  # a wider card wants more, shorter programs
        (2, 64, 132, 8),  # nothing fills the card: the fewest tiles
    ],
)
def test_tiles_a_program_fill_every_slot_twice(m, n, sms, tiles):
    assert indexer_sm90.tiles_for(m, n, sms) == tiles


@given(m=st.integers(1, 1 << 16), n=st.integers(1, 1 << 16), sms=st.integers(1, 256))
def test_tiles_a_program_are_the_most_that_fill_the_card(m, n, sms):
    got = indexer_sm90.tiles_for(m, n, sms)
    assert got in indexer_sm90.TILES

    def fills(t):
        programs = -(-m // indexer_sm90.BLOCK_Q) * -(-n // (indexer_sm90.BLOCK_N * t))
        return programs >= 2 * indexer_sm90.PROGRAMS_PER_SM * sms

    assert fills(got) or got == min(indexer_sm90.TILES)
    assert not any(fills(t) for t in indexer_sm90.TILES if t > got)


def test_only_tiles_tune_the_gluon_kernel():
    q, k = torch.zeros(3, 64, 128, dtype=torch.float8_e4m3fn), torch.zeros(5, 128, dtype=torch.float8_e4m3fn)
    w, ks, ke = torch.ones(3, 64), torch.zeros(3, dtype=torch.int32), torch.full((3,), 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_n, num_warps tune the readable kernel"):
        indexer_logits(q, k, w, ks, ke, kernel="sm90", block_n=32, num_warps=8)


@pytest.mark.skipif(not (HOPPER and indexer_sm90.AVAILABLE), reason="needs an H100/H200 (sm_90) and triton's Gluon")
@pytest.mark.parametrize(
    "m, n, scale",
    [
        (2, 5, True),  # fewer keys than a tile: zero-filled rows past N (row 0 empty, row 1 not)
        (7, 100, True),  # an odd token count: the first program's second token is past M
        (64, 1000, False),  # no key scale
        (257, 3001, True),  # N not a multiple of 64; programs past the spans write -inf only
        (300, 4096 + 64, True),  # three or more programs' worth of keys a token pair
        (16, 9000, True),  # spans starting past whole programs' keys: those programs write -inf only
    ],
)
@pytest.mark.parametrize("tiles", [None, 32, 256], ids=["tiles_for", "32-tiles", "256-tiles"])
def test_matches_spec(m, n, scale, tiles):
    """Every case has an empty span and NaN keys (and key scales) outside every span (:func:`indexer_case`); at
    these sizes :func:`tiles_for` takes 8 tiles a program."""
    q, k, w, ks, ke, k_scale = indexer_case(m * n, m, n, 64, 128)
    k_scale = k_scale if scale else None
    ref = spec.indexer_logits(q, k, w, ks, ke, k_scale)
    bound = logits_bound(q, k, w, k_scale)
    args = [t.cuda() for t in (q, k, w, ks, ke)] + [k_scale.cuda() if k_scale is not None else None]
    got = {kernel: indexer_logits(*args, kernel=kernel, tiles=tiles).cpu() for kernel in ("sm90", "triton")}
    for out in got.values():
        assert_logits(out, ref, bound)
    if n >= 64:  # both run Hopper's fp8 MMA on 64-key tiles: the same roundings
        assert torch.equal(got["sm90"], got["triton"])
