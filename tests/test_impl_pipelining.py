"""The decode kernel as the compiler builds it for Hopper: the next key tile is in flight while this one is used.

Speed lives in ``benchmarks/``; this checks the structure speed depends on, on a machine with no GPU, by compiling
for ``sm_90`` (:mod:`compiled`). Triton's pipeliner gives the page-table read (a load feeding the key tile's address)
stages of its own: with too few, the next key tile is loaded only after this one's dots (nothing in flight then),
and the decode streams at ~2.3 instead of ~3.8 TB/s on an H200 (``impl.decode.decode_config``). A config change, a
Triton upgrade or a kernel edit that loses the prefetch fails here. ``.ci/run`` runs this file twice: under pip's newest
Triton and under 3.6, the H200 image's (a kernel can build under one and not the other).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlaspec.impl.decode import decode_config

HOPPER_SHARED = 227 * 1024  # bytes of shared memory one block may use on an H100 / H200
POINTERS = {
    "Q": "*bf16",
    "KV": "*bf16",
    "BLOCK_TABLE": "*i32",
    "SEQ_LENS": "*i32",
    "O_PART": "*fp32",
    "LSE_PART": "*fp32",
    "OUT": "*bf16",
    "LSE": "*fp32",
}
# e4m3 to bf16 as mlaspec.impl.fp8 converts it, and the conversion it replaces
FP8_WORDS, SLOW_CVT = ["cvt.rn.f16x2.e4m3x2", "cvt.f32.f16", "cvt.rn.bf16x2.f32"], "cvt.bf16.f16"
PDL_WORDS = ["griddepcontrol.launch_dependents", "griddepcontrol.wait", "ld.global"]  # and the first load
REGISTER_A = "#ttg.dot_op<{opIdx = 0"  # an MMA's A operand from registers (TTGIR)
# split_kernel_lead's tensor-memory-copy descriptors: a tile's value halves and RoPE part, the fp32 partials' blocks
LEAD_DESCRIPTORS = dict(DESC_H=[64, 256], DESC_R=[64, 64], DESC_O={"block": [64, 256], "dtype": "fp32"})
# the sparse decode's (mlaspec.impl.sparse_sm90.sparse_kernel) pointers and constexprs
SPARSE_POINTERS = dict(Q="*bf16", KV="*u8", KVF="*fp32", KVB="*bf16", IDX="*i32", LENS="*i32", SINK="*fp32")
SPARSE_POINTERS.update(OUT="*bf16", LSE="*fp32", MAXL="*fp32", O_PART="*fp32", ML_PART="*fp32")
SPARSE_CONST = dict(HAS_LENS=True, HAS_SINK=False, D_V=512, D_ROPE=64, BLOCK_H=64, BLOCK_N=64, SINGLE=False)


def compiled(kernel: str, pointers: dict, constexprs: dict, **spec) -> dict:
    """Compile in a process without the interpreter; skip where this Triton cannot target sm_90 without a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    arg = json.dumps(dict(kernel=kernel, pointers=pointers, constexprs=constexprs, **spec))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("compiled.py")), arg], env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise AssertionError(proc.stderr)
    out = json.loads(proc.stdout.splitlines()[-1])
    if "cannot_compile_here" in out:  # no NVIDIA backend or no ptxas in this Triton: nothing to look at
        pytest.skip(f"this Triton cannot compile for sm_90 here: {out['cannot_compile_here']}")
    return out


def split_kernel(rows: int, page: int = 64) -> tuple[dict, dict]:
    cfg = decode_config(rows, page, torch.bfloat16)
    const = dict(CAUSAL=True, D_V=512, D_ROPE=64, PAGE=page, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    const.update(SINGLE=False, PRECISION="tf32", FP8=False)
    spec = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, tiles=[f"{cfg.block_n}x512xbf16"])
    return compiled("mlaspec.impl.decode:_mla_decode_split_kernel", POINTERS, const, **spec), spec


@pytest.mark.parametrize("rows, page", [(16, 64), (32, 64), (16, 32)])
def test_a_light_decode_prefetches_the_next_key_tile(rows, page):
    """16-32 query rows (DeepSeek-V3 at TP8, with MTP): two key tiles issued before the loop, so one is in flight
    during the other's dots, within Hopper's shared memory."""
    out, spec = split_kernel(rows, page)
    assert out["prefetched"][spec["tiles"][0]] == 2, out
    assert out["shared"] <= HOPPER_SHARED, out


def test_the_64_row_decode_fits_hopper():
    """64 query rows, the readable kernel: it fits 227 KB, but Triton's pipeliner issues the next tile's copy after
    this tile's dots (a tile in flight during them needs a third buffer beside q, which does not fit) -- why the
    Gluon kernel below exists. Should a Triton upgrade overlap them here, this fails and the Gluon kernel can go."""
    out, spec = split_kernel(128)
    assert out["prefetched"][spec["tiles"][0]] == 1, out
    assert not out["copies_before_dots"], out
    assert out["shared"] <= HOPPER_SHARED, out


@pytest.mark.parametrize("tma", [True, False])
def test_the_gluon_decode_streams_during_its_dots(tma):
    """64 query rows on Hopper (:mod:`mlaspec.impl.decode_sm90`): the loop issues the next tile's copy before this
    tile's first MMA, with q, two tiles and P in 227 KB; over a cache whose pages are one stride apart (``tma``)
    as tensor-memory copies, else as ``cp.async``."""
    from mlaspec.impl import decode_sm90

    if not decode_sm90.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    const = dict(CAUSAL=True, D_V=512, D_ROPE=64, PAGE=64, BLOCK_M=decode_sm90.BLOCK_M, BLOCK_N=decode_sm90.BLOCK_N)
    const.update(SINGLE=False, TMA=tma)
    pointers = dict(POINTERS)
    if tma:
        pointers.update(DESC_V=[64, 512], DESC_R=[64, 64])
    else:
        const.update(DESC_V=None, DESC_R=None)
    out = compiled(
        "mlaspec.impl.decode_sm90:split_kernel", pointers, const, num_warps=decode_sm90.NUM_WARPS, num_stages=1,
        ptx_words=["cp.async.bulk.tensor.2d"],
    )  # fmt: skip
    assert out["copies_before_dots"], out
    assert out["ptx_has"]["cp.async.bulk.tensor.2d"] == tma, out
    assert out["shared"] <= HOPPER_SHARED, out


def test_the_gluon_fp8_decode_converts_in_warps_of_its_own():
    """The decode over vLLM's per-tensor fp8 cache on Hopper (``decode_sm90.split_kernel_fp8``): warp-specialized
    (a 4-warp producer gives registers to the 8 consumers by ``setmaxnreg``), tiles handed over by ``mbarrier``, with
    q, two bf16 key tiles and P in 227 KB."""
    from mlaspec.impl import decode_sm90

    if not decode_sm90.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    pointers = dict(POINTERS, KV="*u8")
    words = ["setmaxnreg.dec", "setmaxnreg.inc", "mbarrier.try_wait", *FP8_WORDS]
    for single in (True, False):
        const = dict(CAUSAL=True, D_V=512, D_ROPE=64, PAGE=64, BLOCK_M=64, BLOCK_N=64, SINGLE=single)
        out = compiled("mlaspec.impl.decode_sm90:split_kernel_fp8", pointers, const, num_warps=decode_sm90.NUM_WARPS,
                       num_stages=1, ptx_words=words + [SLOW_CVT])  # fmt: skip
        assert all(out["ptx_has"][w] for w in words) and not out["ptx_has"][SLOW_CVT], out
        assert 2 * 64 * 576 * 2 < out["shared"] <= HOPPER_SHARED, out


@pytest.mark.parametrize("rows", [16, 32])
def test_the_readable_fp8_decode_converts_through_fp32(rows):
    """The readable decode over the fp8 cache (16-32 rows; off Hopper, or asked for): each e4m3 pair to fp16, each
    value to fp32, each pair packed to bf16 (``mlaspec.impl.fp8``), not Triton's ``cvt.bf16.f16`` (``F2F``), which
    held the fp8 decodes to 12-29% of the copy bandwidth on an H200 (2026-11-29)."""
    cfg = decode_config(rows, 64, torch.bfloat16, True)
    const = dict(CAUSAL=True, D_V=512, D_ROPE=64, PAGE=64, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    const.update(SINGLE=False, PRECISION="tf32", FP8=True)
    out = compiled("mlaspec.impl.decode:_mla_decode_split_kernel", dict(POINTERS, KV="*u8"), const,
                   num_warps=cfg.num_warps, num_stages=cfg.num_stages, ptx_words=FP8_WORDS + [SLOW_CVT])  # fmt: skip
    assert all(out["ptx_has"][w] for w in FP8_WORDS) and not out["ptx_has"][SLOW_CVT], out


def test_the_gluon_lead_decode_hands_p_to_a_helper_warpgroup():
    """The decode where each key tile is read by several programs (``decode_sm90.split_kernel_lead``): two warpgroups
    (one worker partition: ``mbarrier`` handoffs), a tile as tensor-memory copies of its three parts, the logits as
    ``[64, 64]`` warpgroup MMAs (N = 64: q read once a tile), the leader's own ``P @ V`` with ``P`` from registers
    (an MMA operand in a register layout), within 227 KB."""
    from mlaspec.impl import decode_sm90

    if not decode_sm90.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    pointers = dict(POINTERS, **LEAD_DESCRIPTORS)
    words = ["cp.async.bulk.tensor.2d", "mbarrier.try_wait", "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"]
    store = "cp.async.bulk.tensor.2d.global.shared"  # a split's partial, as tensor-memory copies
    words.append(store)
    for single in (True, False):
        const = dict(CAUSAL=True, D_V=512, D_ROPE=64, PAGE=64, BLOCK_M=64, BLOCK_N=64, SINGLE=single)
        out = compiled("mlaspec.impl.decode_sm90:split_kernel_lead", pointers, const, num_warps=decode_sm90.LEAD_WARPS,
                       num_stages=1, options={"maxnreg": decode_sm90.LEAD_REGS.value}, ptx_words=words,
                       ttgir_words=[REGISTER_A])  # fmt: skip
        assert all(out["ptx_has"][w] for w in words if w != store), out
        assert out["ttgir_has"][REGISTER_A], out
        assert out["ptx_has"][store] == (not single), out
        assert 2 * 64 * 576 * 2 < out["shared"] <= HOPPER_SHARED, out


def test_the_seesaw_probe_still_compiles_for_hopper():
    """``benchmarks/seesaw_probe.py`` (a warp-specialised decode in FlashMLA's seesaw schedule, right but measured
    slower and not wired in) keeps compiling for sm_90 within 227 KB, so the next attempt at the 128-head schedule
    starts from a kernel that builds."""
    from mlaspec.impl import decode_sm90

    if not decode_sm90.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    const = dict(CAUSAL=True, D_V=512, D_ROPE=64, PAGE=64, BLOCK_M=64, BLOCK_N=64, SINGLE=False, TMA=True)
    pointers = dict(POINTERS, DESC_H=[64, 256], DESC_R=[64, 64])
    bench = str(Path(__file__).parents[1] / "benchmarks")
    spec = dict(num_warps=4, num_stages=1, options={"maxnreg": 248}, path=[bench])
    out = compiled("seesaw_probe:seesaw_kernel", pointers, const, **spec)
    assert out["shared"] <= HOPPER_SHARED, out


@pytest.mark.parametrize("force_left", [False, True])
def test_the_merge_probe_still_applies_and_compiles_for_hopper(force_left):
    """``benchmarks/merge_probe.py`` (the split-KV combine inside ``split_kernel_keys``: right, cannot hang, measured
    slower, not wired in) still finds its lines in the landed kernel and builds for sm_90 within 227 KB, with its
    counters' release and acquire and its partials' loads past L1 (``.cg``), so its figures can be measured again."""
    from mlaspec.impl import decode_sm90

    if not decode_sm90.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    const = dict(CAUSAL=True, D_V=512, D_ROPE=64, PAGE=64, BLOCK_M=16, BLOCK_N=64, SINGLE=False, TMA=True)
    const.update(MERGE=True, SPLITS_P2=128, FORCE_LEFT=force_left)
    pointers = dict(POINTERS, DESC_V=[64, 512], DESC_R=[64, 64], COUNTS="*i32", LEFT="*i32")
    words = ["atom.global.gpu.acq_rel.add", "ld.global.gpu.acquire", "ld.global.cg"]
    bench = str(Path(__file__).parents[1] / "benchmarks")
    spec = dict(num_warps=decode_sm90.KEYS_WARPS, num_stages=1, path=[bench], ptx_words=words)
    out = compiled("merge_probe:split_kernel_keys_merged", pointers, const, **spec)
    assert all(out["ptx_has"][w] for w in words), out
    assert out["shared"] <= HOPPER_SHARED, out


def test_the_sparse_lead_probe_compiles_for_hopper():
    """``benchmarks/sparse_lead_probe.py`` (the leader-warpgroup schedule over gathered keys in q's dtype, not yet
    run on a GPU, not wired in) builds for sm_90 within 227 KB: its gathers' landings arrive on ``mbarrier``s
    (``cp.async.mbarrier.arrive``), the logits are whole-tile ``[64, 64]`` MMAs, the two warpgroups hand ``P`` over
    by ``mbarrier``."""
    from mlaspec.impl import decode_sm90

    if not decode_sm90.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    pointers = dict(SPARSE_POINTERS, KV="*bf16")
    const = {k: v for k, v in SPARSE_CONST.items() if k != "SINGLE"}
    words = ["cp.async.mbarrier.arrive", "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", "mbarrier.try_wait"]
    bench = str(Path(__file__).parents[1] / "benchmarks")
    spec = dict(num_warps=4, num_stages=1, options={"maxnreg": 248}, path=[bench], ptx_words=words)
    out = compiled("sparse_lead_probe:sparse_lead_kernel", pointers, const, **spec)
    assert all(out["ptx_has"].values()), out
    assert 3 * 64 * 576 * 2 < out["shared"] <= HOPPER_SHARED, out


@pytest.mark.parametrize("rows, single", [(16, True), (16, False), (32, False)])
def test_the_fp8_decode_with_keys_as_rows_has_no_padded_mma(rows, single):
    """``split_kernel_fp8_keys`` (vLLM's fp8 cache at 32 query rows or fewer) builds for sm_90 with ``m64n{rows}k16``
    MMAs only, the keys as their 64 rows (none of ``split_kernel_fp8``'s 64-row MMAs, whose rows past 16 or 32 would
    be padding), the producer warpgroup beside one consumer warpgroup (``setmaxnreg``), the exact conversion, the next
    tile's bytes copied by ``cp.async`` (staged in shared memory, not loaded into registers), and q, two key tiles,
    ``P`` and one tile of bytes within Hopper's shared memory."""
    from mlaspec.impl import decode_sm90

    if not decode_sm90.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    mma = "wgmma.mma_async.sync.aligned.m64n{}k16.f32.bf16.bf16"
    words = [mma.format(rows), mma.format(64), "setmaxnreg.dec", "cp.async.cg.shared.global", *FP8_WORDS, SLOW_CVT]
    const = dict(CAUSAL=True, D_V=512, D_ROPE=64, PAGE=64, BLOCK_M=rows, BLOCK_N=64, SINGLE=single)
    spec = dict(num_warps=decode_sm90.KEYS_WARPS, num_stages=1, ptx_words=words)
    out = compiled("mlaspec.impl.decode_sm90:split_kernel_fp8_keys", dict(POINTERS, KV="*u8"), const, **spec)
    has = out["ptx_has"]
    assert has[mma.format(rows)] and not has[mma.format(64)] and has["setmaxnreg.dec"], out
    assert all(has[w] for w in FP8_WORDS) and has["cp.async.cg.shared.global"] and not has[SLOW_CVT], out
    tiles, q_and_p, staged = 2 * 64 * 576 * 2, rows * (576 + 64) * 2, 64 * 576
    assert tiles + q_and_p + staged <= out["shared"] <= min(tiles + q_and_p + staged + 4 * 1024, HOPPER_SHARED), out


@pytest.mark.parametrize("single", [True, False])
def test_the_16_row_decode_with_keys_as_rows_has_no_padded_mma(single):
    """``split_kernel_keys`` (a 16-bit cache at 16 query rows or fewer) builds for sm_90: ``m64n16k16`` MMAs only, the
    tiles by tensor-memory copies, q of 16 rows, two key tiles and ``P`` in shared memory, and the next tile's copy
    group issued before the wait for this one's (``wait_group 1``: one group left in flight); and it lets its
    combine launch at once (``griddepcontrol.launch_dependents``, before its first load)."""
    from mlaspec.impl import decode_sm90

    if not decode_sm90.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    mma = "wgmma.mma_async.sync.aligned.m64n{}k16.f32.bf16.bf16"
    words = [mma.format(16), mma.format(64), "cp.async.bulk.tensor.2d", "cp.async.wait_group \t1;", *PDL_WORDS]
    const = dict(CAUSAL=True, D_V=512, D_ROPE=64, PAGE=64, BLOCK_M=16, BLOCK_N=64, SINGLE=single, TMA=True)
    pointers = dict(POINTERS, DESC_V=[64, 512], DESC_R=[64, 64])
    spec = dict(num_warps=decode_sm90.KEYS_WARPS, num_stages=1, ptx_words=words)
    out = compiled("mlaspec.impl.decode_sm90:split_kernel_keys", pointers, const, **spec)
    has = out["ptx_has"]
    assert has[mma.format(16)] and not has[mma.format(64)] and has["cp.async.bulk.tensor.2d"], out
    assert has["cp.async.wait_group \t1;"], out
    assert 0 <= out["ptx_at"]["griddepcontrol.launch_dependents"] < out["ptx_at"]["ld.global"], out
    assert 2 * 64 * 576 * 2 + 16 * (576 + 64) * 2 <= out["shared"] <= 2 * 64 * 576 * 2 + 24 * 1024, out


@pytest.mark.parametrize("pdl", [True, False])
def test_the_combine_launched_early_waits_before_reading_a_partial(pdl):
    """The split-KV combine launched as a programmatic dependent (``PDL``, after ``split_kernel_keys``) waits for the
    split kernel's grid (``griddepcontrol.wait``) before its first load; launched plainly it has no wait."""
    const = dict(D_V=512, BLOCK_D=32, SPLITS_P2=128, CHUNK=128, PDL=pdl)
    pointers = dict(O_PART="*fp32", LSE_PART="*fp32", OUT="*bf16", LSE="*fp32")
    out = compiled("mlaspec.impl.decode:_mla_decode_combine_kernel", pointers, const, num_warps=1, num_stages=1,
                   ptx_words=PDL_WORDS)  # fmt: skip
    at = out["ptx_at"]
    assert (0 <= at["griddepcontrol.wait"] < at["ld.global"]) if pdl else at["griddepcontrol.wait"] < 0, out


def test_every_decode_ablation_still_applies_and_compiles(tmp_path):
    """``benchmarks/decode_ablation.py`` switches parts of the Gluon decode (and of the seesaw probe) off by replacing
    their lines: each replacement still finds its lines in the kernel's source (else the tool would time a kernel it
    did not change), and each kernel with every part off compiles for sm_90."""
    from mlaspec.impl import decode_sm90

    if not decode_sm90.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        import decode_ablation
    finally:
        sys.path.pop(0)
    for kernel, (_, ablations, variants) in decode_ablation.KERNELS.items():
        assert all(part in ablations for parts in variants for part in parts), kernel  # every variant's parts exist
        for part in ablations:
            assert decode_ablation.ablated_source([part], kernel) != decode_ablation.ablated_source([], kernel)
        (tmp_path / f"{kernel}_all.py").write_text(decode_ablation.ablated_source(list(ablations), kernel))
    assert all(part in decode_ablation.ABLATIONS for parts in decode_ablation.PADDED_VARIANTS for part in parts)
    const = dict(CAUSAL=True, D_V=512, D_ROPE=64, PAGE=64, BLOCK_M=64, BLOCK_N=64, SINGLE=False, TMA=True)
    spec = dict(num_stages=1, path=[str(tmp_path), str(Path(__file__).parents[1] / "benchmarks")])
    landed = compiled("landed_all:split_kernel", dict(POINTERS, DESC_V=[64, 512], DESC_R=[64, 64]), const,
                      num_warps=8, **spec)  # fmt: skip
    seesaw = compiled("seesaw_all:seesaw_kernel", dict(POINTERS, DESC_H=[64, 256], DESC_R=[64, 64]), const,
                      num_warps=4, options={"maxnreg": 248}, **spec)  # fmt: skip
    sparse = compiled("sparse_all:sparse_kernel", SPARSE_POINTERS, SPARSE_CONST, num_warps=8, **spec)
    lead_const = {k: v for k, v in const.items() if k != "TMA"}
    lead_options = {"maxnreg": decode_sm90.LEAD_REGS.value}
    lead = compiled("lead_all:split_kernel_lead", dict(POINTERS, **LEAD_DESCRIPTORS), lead_const,
                    num_warps=decode_sm90.LEAD_WARPS, options=lead_options, **spec)  # fmt: skip
    fp8 = compiled("fp8_all:split_kernel_fp8", dict(POINTERS, KV="*u8"), dict(lead_const),
                   num_warps=decode_sm90.NUM_WARPS, **spec)  # fmt: skip
    keys = compiled("keys_all:split_kernel_fp8_keys", dict(POINTERS, KV="*u8"), dict(lead_const, BLOCK_M=16),
                    num_warps=decode_sm90.KEYS_WARPS, **spec)  # fmt: skip
    keys16 = compiled("keys16_all:split_kernel_keys", dict(POINTERS, DESC_V=[64, 512], DESC_R=[64, 64]),
                      dict(const, BLOCK_M=16), num_warps=decode_sm90.KEYS_WARPS, **spec)  # fmt: skip
    fp8lead_pointers = dict(POINTERS, KV="*u8", DESC_O=LEAD_DESCRIPTORS["DESC_O"])
    fp8lead = compiled("fp8lead_all:split_kernel_lead", fp8lead_pointers, dict(lead_const, DESC_H=None, DESC_R=None),
                       num_warps=decode_sm90.LEAD_WARPS, **spec)  # fmt: skip
    kernels = (landed, seesaw, sparse, lead, fp8, keys, keys16, fp8lead)
    assert all(k["shared"] <= HOPPER_SHARED for k in kernels), kernels


@pytest.mark.parametrize("tiles", [256, 32, 16, 8])
def test_the_gluon_indexer_waits_for_one_token_at_a_time(tiles):
    """The indexer's logits on Hopper (:mod:`mlaspec.impl.indexer_sm90`): fp8 warpgroup MMAs, the first token's
    waited for alone (``wgmma.wait_group 1``) so its epilogue runs under the second's, the next tile's copy issued
    before this tile's MMAs, and shared memory small enough for four programs an SM. A short program (8 key tiles)
    issues q's copy before it loads the spans; a longer one only once it knows it reads a key."""
    from mlaspec.impl import indexer_sm90 as g

    if not g.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    assert tiles in g.TILES
    pointers = dict(Q="*fp8e4nv", K="*fp8e4nv", W="*fp32", KS="*i32", KE="*i32", KSCALE="*fp32", OUT="*fp32")
    const = dict(H=g.HEADS, D=g.DIM, BLOCK_N=g.BLOCK_N, TILES=tiles, STAGES=g.STAGES, HAS_SCALE=True)
    words = ["wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3", "wgmma.wait_group.sync.aligned 1;"]
    out = compiled("mlaspec.impl.indexer_sm90:logits_kernel", pointers, const, num_warps=g.NUM_WARPS, num_stages=1,
                   ptx_words=words)  # fmt: skip
    assert all(out["ptx_has"].values()), out
    assert out["copies_before_dots"], out
    assert out["copy_before_loads"] == (tiles <= g.EARLY_TILES), out
    assert g.PROGRAMS_PER_SM * out["shared"] <= HOPPER_SHARED, out


def test_the_gluon_sparse_decode_keeps_two_tiles_in_flight():
    """The sparse decode over the 656-byte fp8 cache on Hopper (:mod:`mlaspec.impl.sparse_sm90`): the loop waits for
    all but the newest copy group (``cp.async.wait_group 1``: the next tile's bytes stay in flight), issues the copy
    two tiles ahead before this tile's first MMA, with q, the bf16 key tile, P and two byte tiles in 227 KB."""
    from mlaspec.impl import sparse_sm90 as g

    if not g.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    out = compiled("mlaspec.impl.sparse_sm90:sparse_kernel", SPARSE_POINTERS, SPARSE_CONST, num_warps=g.NUM_WARPS,
                   num_stages=1,
                   ptx_words=["cp.async.wait_group \t1;"])  # fmt: skip
    assert all(out["ptx_has"].values()), out
    assert out["copies_before_dots"], out
    assert out["shared"] <= HOPPER_SHARED, out


def test_the_gluon_sparse_gather_of_keys_in_q_dtype_keeps_the_next_tile_in_flight():
    """The sparse attention over keys already in q's dtype on Hopper (``sparse_sm90.sparse_kernel_float``, the
    prefill's): the loop waits for all but the newest copy group (``cp.async.wait_group 1``: the next tile's gather
    stays in flight while this one is multiplied), with q and two key tiles in 227 KB."""
    from mlaspec.impl import sparse_sm90 as g

    if not g.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    out = compiled("mlaspec.impl.sparse_sm90:sparse_kernel_float", dict(SPARSE_POINTERS, KV="*bf16"), SPARSE_CONST,
                   num_warps=g.NUM_WARPS, num_stages=1, ptx_words=["cp.async.wait_group \t1;"])  # fmt: skip
    assert all(out["ptx_has"].values()), out
    assert 3 * 64 * 576 * 2 < out["shared"] <= HOPPER_SHARED, out


def test_the_gluon_sparse_producer_dequantizes_in_warps_of_its_own():
    """The sparse decode with a producer warpgroup (:mod:`mlaspec.impl.sparse_sm90_producer`): warp-specialized
    (the producer's 4 warps give registers to the 8 consumers by ``setmaxnreg``), handing tiles over by
    ``mbarrier``, with q, two bf16 key tiles and P in 227 KB."""
    from mlaspec.impl import sparse_sm90_producer as g

    if not g.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    words = ["setmaxnreg.dec", "setmaxnreg.inc", "mbarrier.try_wait"]
    for single in (True, False):
        out = compiled("mlaspec.impl.sparse_sm90_producer:sparse_kernel", SPARSE_POINTERS,
                       dict(SPARSE_CONST, SINGLE=single), num_warps=g.NUM_WARPS, num_stages=1,
                       ptx_words=words)  # fmt: skip
        assert all(out["ptx_has"].values()), out
        assert 2 * 64 * 576 * 2 < out["shared"] <= HOPPER_SHARED, out


def test_the_e4m3_decode_multiplies_in_e4m3_with_a_transposing_producer():
    """The e4m3 path on Hopper (``decode_sm90.split_kernel_e4m3_keys``, 16 and 64 rows): every MMA an e4m3 one (no
    16-bit MMA, no conversion of the key bytes), warp-specialized (the producer gives registers back by
    ``setmaxnreg``), P rounded by ``cvt.rn.satfinite``, no local arrays in the PTX; q, three key tiles and two ``V^T``
    in 227 KB."""
    from mlaspec.impl import decode_sm90

    if not decode_sm90.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    pointers = dict(POINTERS, Q="*fp8e4nv", KV="*fp8e4nv")
    pointers.update(DESC_V={"block": [64, 512], "dtype": "fp8e4nv"}, DESC_R={"block": [64, 64], "dtype": "fp8e4nv"})
    words = ["setmaxnreg.dec", "cvt.rn.satfinite.e4m3x2.f32"]
    bad = ["f32.bf16.bf16", "cvt.rn.f16x2.e4m3x2", "st.local", "ld.local"]
    for rows, single in [(16, True), (16, False), (64, True), (64, False)]:
        # 16 rows: one consumer, the keys as the MMAs' rows (N = 16); 64 rows: the query rows as the MMAs' rows, the
        # leader's logits at N = 64 keys, each half of the output at N = 256 value columns
        mmas = [f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3" for n in ([16] if rows == 16 else [64, 256])]
        const = dict(CAUSAL=True, D_V=512, D_ROPE=64, PAGE=64, BLOCK_M=rows, BLOCK_N=64, SINGLE=single)
        out = compiled("mlaspec.impl.decode_sm90:split_kernel_e4m3_keys", pointers, const,
                       num_warps=decode_sm90.KEYS_WARPS, num_stages=1, ptx_words=[*mmas, *words, *bad])  # fmt: skip
        want = [*mmas, *words]
        assert all(out["ptx_has"][w] for w in want) and not any(out["ptx_has"][w] for w in bad), out
        assert 3 * 64 * 576 + 2 * 512 * 64 + rows * 576 < out["shared"] <= HOPPER_SHARED, out


def _constexpr_names(source: str) -> list[str]:
    """The module-level names ``source`` binds to ``gl.constexpr(...)`` (also under a module-level ``if`` / ``try``),
    one entry a binding."""
    import ast

    def constexpr(node) -> bool:
        return isinstance(node, ast.Call) and ast.unparse(node.func) == "gl.constexpr"

    names, todo = [], list(ast.parse(source).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + getattr(node, "handlers", [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                unpacked = isinstance(target, ast.Tuple) and isinstance(node.value, (ast.Tuple, ast.List))
                pairs = zip(target.elts, node.value.elts) if unpacked else [(target, node.value)]
                names += [t.id for t, v in pairs if isinstance(t, ast.Name) and constexpr(v)]
    return names


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "impl").glob("*.py")), ids=lambda p: p.name)
def test_every_gluon_constant_is_bound_once(path):
    """A Gluon kernel reads its module's constants when it is compiled, so a name bound twice (two barrier tables
    that both say ``P_FREE``) silently gives every kernel the later value: on an H200 that hung the 64-row e4m3
    decode (2026-11-30), with nothing on a machine without a GPU to show it."""
    names = _constexpr_names(path.read_text())
    assert not {n for n in names if names.count(n) > 1}


def test_a_gluon_constant_bound_twice_is_seen():
    lines = ["if X:", "    A, B = gl.constexpr(1), gl.constexpr(2)", "    B = gl.constexpr(3)", "    C = 4",
             "    D: int = gl.constexpr(5)", "    E, F = pair()"]  # fmt: skip
    assert sorted(_constexpr_names("\n".join(lines))) == ["A", "B", "B", "D"]
