"""The decode over vLLM's per-tensor fp8 cache at 16 query rows or fewer, with the keys as the MMAs' rows: an
experiment for Hopper, in Gluon, not wired in and not yet run on a GPU.

Written on 2026-11-29 (evening) as the next step for the 16-head fp8 decode, after :mod:`mlaspec.impl.fp8` took
the conversion's ``F2F`` out (``docs/speed_log.md``). :func:`mlaspec.impl.decode_sm90.split_kernel_fp8` pads 16
query rows to its 64-row tile, so three quarters of its MMAs multiply zeros, and it takes about 3 us a 64-key tile
at 16 heads as at 128. This kernel keeps that kernel's producer warpgroup (:func:`~mlaspec.impl.decode_sm90.
_produce_fp8`: the next tile's bytes into registers, converted into the second of two bf16 key tiles) and replaces
its consumers by one warpgroup that multiplies with the keys as the 64 rows (``M``) and the 16 query rows as
``N``, so no MMA work is padding:

* the logits transposed, ``S^T [64 keys, 16] = K q^T`` (``K``: the tile, the MMA's A operand; ``q^T``: q's shared
  memory viewed transposed, as the other kernels view a key tile);
* the online softmax on the transposed view of ``S^T`` (``gl.permute``: a register layout, no data moved), by the
  very helpers the other kernels use (:func:`~mlaspec.impl.decode_sm90._scale_and_mask`,
  :func:`~mlaspec.impl.decode_sm90._softmax_step`): the maximum over a tile's keys crosses the warpgroup's four
  warps;
* the output transposed, ``O^T [512, 16] += V^T P^T`` (``V^T``: the tile viewed transposed, an A operand whose
  ``M`` runs along its rows' contiguous values; ``P^T``: ``P [16, 64]`` stored to shared memory and viewed
  transposed), eight ``m64n16k16`` MMAs a key step;
* the epilogue the other kernels' (:func:`~mlaspec.impl.decode_sm90._write_rows`) on ``O^T`` viewed back.

Per 64-key tile the MMAs are ``2 x 64 x 16 x 1088`` FLOP (a quarter of the padded kernel's) and read 136 KB of
A operands from shared memory, about 1,100 cycles at 128 bytes a cycle: under the 1.1 us in which an SM's share
of the copy bandwidth brings a 36 KB fp8 tile. Whether the producer then keeps up is the measurement's question
(``benchmarks/decode_ablation.py --kernel fp8`` first tells which side bounds the landed kernel). One consumer
warpgroup leaves the producer room for more registers than the landed kernel's 120, but not for the next tile's
bytes beside this one's: written that way (the next tile loaded before this one is converted, 232 registers), the
producer spilled 614 stores a thread under triton 3.6 (two tiles' bytes take 160 registers, and a tile converted
whole before its store 144 more); a part at a time (value columns 0-255, 256-511, RoPE: each part's next bytes
loaded once this tile's are stored) still spilled 500, so the next form must hold its bytes some other way (in shared
memory, by ``cp.async``, where this kernel's 168 KB leaves room for one byte tile).

``python benchmarks/fp8_keys_probe.py`` (an H100/H200) runs it through :func:`mlaspec.impl.decode.mla_decode_paged`
in ``split_kernel_fp8``'s place (same arguments, same grid; rows must be at most 16) beside the landed kernel, on
16-head problems, and prints the largest differences of their outputs and LSEs and both times (CUDA-graph
replays). ``tests/test_impl_pipelining.py`` keeps it compiling for ``sm_90``. Importing this module runs nothing.
"""

# no `from __future__ import annotations`: triton 3.6's Gluon reads annotations at run time

from mlaspec.impl.decode_sm90 import AVAILABLE

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from mlaspec.impl.decode_sm90 import (
        FP8_PRODUCER_REGS,
        FREE,
        LOAD_R4,
        LOAD_V4,
        READY,
        _barrier,
        _copy_rows,
        _keys_seen,
        _outs,
        _produce_fp8,
        _scale_and_mask,
        _softmax_step,
        _split_state,
        _write_rows,
    )

    ROWS = gl.constexpr(16)  # query rows a program: the MMAs' N
    # one warpgroup's MMAs with the keys as rows: S^T [64, 16] and O^T [512, 16] (eight 64-row blocks a warp cycles)
    KEYS_N = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))

    @gluon.jit
    def _consume_keys(p, SINGLE: gl.constexpr):
        """The consumer warpgroup: q, then each ready tile's transposed logits, softmax and ``O^T``, then the
        epilogue."""
        R: gl.constexpr = p.q_v.shape[0]
        N: gl.constexpr = p.k_v.shape[1]
        D: gl.constexpr = p.k_v.shape[2]
        _copy_rows(p.q_v, p.q_r, p.Q, p.pid_m * R, p.S_Q * p.H_Q, p.H_Q, p.stride_qs, p.stride_qh, (LOAD_V4, LOAD_R4))
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        _barrier()
        zero_t = gl.zeros([N, R], gl.float32, KEYS_N)  # not read (use_acc=False): the logits' register shape
        LOGITS: gl.constexpr = gl.permute(zero_t, (1, 0)).type.layout  # [R, N]: rows, then keys
        n_keys, n_seen = _keys_seen(p.pid_m, p.seq_len, p.S_Q, p.H_Q, p.causal, R, LOGITS)
        m_i = gl.full([R], float("-inf"), gl.float32, gl.SliceLayout(1, LOGITS))
        l_i = gl.zeros([R, N], gl.float32, LOGITS)  # row sums kept per key column, summed once at the end
        acc_t = gl.zeros([D, R], gl.float32, KEYS_N)
        for i in range(p.blk_hi - p.blk_lo):
            b = i % 2
            mbarrier.wait(p.bars.index(READY + b), (i // 2) & 1)
            k_v = p.k_v.index(b)
            s_t = warpgroup_mma(k_v, p.q_v.permute((1, 0)), zero_t, use_acc=False, is_async=True)
            s_t = warpgroup_mma(p.k_r.index(b), p.q_r.permute((1, 0)), s_t, is_async=True)
            s_t = warpgroup_mma_wait(0, deps=(s_t,))
            s = _scale_and_mask(gl.permute(s_t, (1, 0)), p.blk_lo + i, p.qk_scale, p.seq_len, n_keys, n_seen)
            prob, alpha, m_i_new = _softmax_step(s, m_i)
            l_i = l_i * gl.expand_dims(alpha, 1) + prob
            m_i = m_i_new
            p.p_smem.store(prob.to(p.p_smem.dtype))  # P [R, N]; the MMA reads it as P^T
            fence_async_shared()
            _barrier()
            acc_t = acc_t * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, KEYS_N)), 0)
            acc_t = warpgroup_mma(k_v.permute((1, 0)), p.p_smem.permute((1, 0)), acc_t, is_async=True)
            acc_t = warpgroup_mma_wait(0, deps=(acc_t,))
            _barrier()  # the warpgroup is done with key tile b (and P)
            mbarrier.arrive(p.bars.index(FREE + b), count=1)
        acc = gl.permute(acc_t, (1, 0))  # [R, D]
        ROW: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        m_o, l_o = gl.convert_layout(m_i, ROW), gl.convert_layout(gl.sum(l_i, 1), ROW)
        _write_rows(acc, m_o, l_o, p.k_scale, p.pid_m, p.split, p.b, p.S_Q, p.H_Q, p.num_splits, _outs(p), 0, D, True,
                    SINGLE)  # fmt: skip

    # one consumer a SINGLE: constexprs do not cross warp_specialize in triton 3.6

    @gluon.jit
    def _consume_keys_single(p):
        _consume_keys(p, True)

    @gluon.jit
    def _consume_keys_split(p):
        _consume_keys(p, False)

    @gluon.jit
    def split_kernel_fp8(
        Q, KV, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kp, stride_ks,
        stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale, k_scale, S_Q, H_Q,
        blocks_per_split, num_splits, CAUSAL: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr,
        PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SINGLE: gl.constexpr,
    ):  # fmt: skip
        """:func:`mlaspec.impl.decode_sm90.split_kernel_fp8`'s arguments and grid, at most ``ROWS`` query rows
        (``BLOCK_M`` is not read: every program takes rows ``0 .. 15``); one consumer warpgroup (the default
        partition, launched with 4 warps) and the landed kernel's producer (q, two key tiles, ``P``: 165 KB)."""
        p = _split_state(
            Q, KV, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kp,
            stride_ks, stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale, k_scale,
            S_Q, H_Q, blocks_per_split, num_splits, CAUSAL, D_V, D_ROPE, PAGE, ROWS, BLOCK_N, 4,
        )  # fmt: skip
        if SINGLE:
            gl.warp_specialize([(_consume_keys_single, (p,)), (_produce_fp8, (p,))], [4], [FP8_PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consume_keys_split, (p,)), (_produce_fp8, (p,))], [4], [FP8_PRODUCER_REGS])


def run_probe(heads: int, batch: int, keys: int) -> str:
    """The probe in ``split_kernel_fp8``'s place beside the landed kernel on one problem (``heads <= 16``, one query
    token a sequence, vLLM's fp8 cache with ``k_scale`` 0.5): a line with the largest differences and both times."""
    import types

    import torch
    from common import bench
    from decode import D_QK, make_problem

    import mlaspec.impl.decode as dec

    cache, bt, sl = make_problem(batch, keys, torch.device("cuda"), fp8=True)
    q = torch.randn(batch, 1, heads, D_QK, device="cuda", dtype=torch.bfloat16)
    cache3 = cache.view(-1, 64, D_QK)
    call = lambda: dec.mla_decode_paged(q, cache3, bt, sl, scale=192**-0.5, k_scale=0.5, max_seq_len=keys,  # noqa: E731
                                        kernel="sm90")  # fmt: skip
    landed = dec.decode_sm90
    probe = types.SimpleNamespace(**vars(landed))
    probe.split_kernel_fp8, probe.NUM_WARPS = split_kernel_fp8, 4  # one consumer warpgroup in the default partition
    ref = call()
    dec.decode_sm90 = probe
    try:
        got = call()
        torch.cuda.synchronize()
        t_probe = bench(call, graph=True)
    finally:
        dec.decode_sm90 = landed
    t_landed = bench(call, graph=True)
    d_out = (got.out.float() - ref.out.float()).abs().max().item()
    d_lse = (got.lse - ref.lse).abs().max().item()
    return (
        f"H {heads} B {batch} S_kv {keys}: max |d out| {d_out:.3g} |d lse| {d_lse:.3g}; "
        f"split_kernel_fp8 {t_landed * 1e6:.1f} us, probe {t_probe * 1e6:.1f} us"
    )


if __name__ == "__main__":
    for h, b, s in ((16, 1, 65536), (16, 2, 131072), (16, 64, 4096), (16, 64, 65536), (16, 128, 8192), (8, 4, 8192)):
        print(run_probe(h, b, s), flush=True)
