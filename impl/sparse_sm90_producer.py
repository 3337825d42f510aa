"""The sparse decode of :mod:`mlaspec.impl.sparse_sm90` with a producer warpgroup, for Hopper, in Gluon: tiles are
gathered and dequantized beside the MMAs, not between them.

Same arguments, math and outputs as :func:`mlaspec.impl.sparse_sm90.sparse_kernel` (read that one first), bit for
bit: the same roundings in the same order. What it changes is who dequantizes, and when (FlashMLA's
``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh`` schedule, without its 2-CTA cluster):

* a **producer** partition of 4 warps (``gl.warp_specialize``, 120 registers a thread) gathers the next tile's e4m3
  bytes, scales and RoPE values from global memory straight into registers (no e4m3 staging in shared memory),
  waits until the consumers are done with the bf16 key tile it is to fill, dequantizes into it (``e4m3 * scale`` in
  fp32, rounded to q's dtype; four keys a warp, so each store meets all 8 bank slots of a swizzled row) and signals
  an ``mbarrier``;
* the **consumers**, the default partition's 8 warps (192 registers), do what the other kernel does with a ready
  tile: ``q k^T`` with the keys split 32 a warpgroup, the online softmax, ``P`` through shared memory, ``P @ V``
  with the value columns split 256 a warpgroup, then free the tile.

Shared memory: q 72 KB, **two bf16 key tiles** 144 KB, ``P`` 8 KB (224.5 of 227 KB). In the other kernel all 8 warps
dequantize each tile while the tensor cores wait: 26% of its time at 128 heads (``benchmarks/decode_ablation.py
--kernel sparse``). Measured on an H100 (2026-11-27, CUDA-graph replays, top-k 2048, the two kernels alternated in
one process, outputs equal): faster where a program walks a whole row's 32 tiles (128 heads B48-128: 129.2 ->
124.8, 133.7 -> 127.8, 262.8 -> 249.2 us; 16 and 64 heads B128: 140.8 -> 132.3, 152.8 -> 141.3) or at most 4 tiles
(B1-16: 6-11%), slower where the rows are split into 8-16 tiles (16 heads B32-64 7-10%, 64 heads B64 6%, 128 heads
B16-32 2-4%): its producer, one warpgroup, takes longer over a tile than eight warps do, which a split's first tile
and a short walk do not hide. :func:`mlaspec.impl.sparse.sparse_producer_runs` chooses by those measurements.
"""

from . import sparse_sm90

__all__ = ["AVAILABLE", "NUM_WARPS", "sparse_kernel"]

AVAILABLE = sparse_sm90.AVAILABLE
NUM_WARPS = 8  # the consumers; the producer's 4 warps come on top

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
    )

    from .decode_sm90 import LOAD_R, LOAD_V, PV, QK, _barrier, _copy_rows, aggregate
    from .sparse_sm90 import _attend, _dequantize, _finish, _load_e4m3, _load_rope, _load_scales, _row_tiles, _slots

    PRODUCER_REGS = gl.constexpr(120)
    TILE = gl.constexpr(64)
    # the producer's layouts (4 warps): a tile's bytes [64 keys, 4 scale groups, 128] four keys a warp (the dequantized
    # tile's stores then meet all 8 bank slots of a swizzled row), 16 bytes a thread; the RoPE values [64, 64]
    PRAW = gl.constexpr(gl.BlockedLayout([1, 1, 16], [4, 1, 8], [4, 1, 1], [2, 1, 0]))
    PSCALE = gl.constexpr(gl.SliceLayout(2, PRAW))
    PROPE = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
    READY = gl.constexpr(0)  # [2]: key tile b holds its tile
    FREE = gl.constexpr(2)  # [2]: the consumers are done with key tile b
    NBAR = gl.constexpr(4)

    @aggregate
    class S:
        Q: gl.tensor  # this row's q
        KV: gl.tensor
        KVF: gl.tensor
        KVB: gl.tensor
        idx: gl.tensor  # this row's slots
        n_rows: gl.tensor
        n_main: gl.tensor
        lo: gl.tensor
        hi: gl.tensor
        pid_h: gl.tensor
        H_Q: gl.tensor
        stride_qh: gl.tensor
        qk_scale: gl.tensor
        r64: gl.tensor
        split: gl.tensor
        num_splits: gl.tensor
        has_sink: gl.tensor
        SINK: gl.tensor
        OUT: gl.tensor
        LSE: gl.tensor
        MAXL: gl.tensor
        stride_or: gl.tensor
        stride_oh: gl.tensor
        stride_lr: gl.tensor
        O_PART: gl.tensor
        ML_PART: gl.tensor
        q_v: gl.shared_memory_descriptor
        q_r: gl.shared_memory_descriptor
        k_v: gl.shared_memory_descriptor  # [2, 64, 512]
        k_r: gl.shared_memory_descriptor  # [2, 64, 64]
        p_smem: gl.shared_memory_descriptor
        bars: gl.shared_memory_descriptor

    @gluon.jit
    def _produce(p):
        """Gather, dequantize and hand over the split's tiles, one bf16 key tile of two at a time."""
        dtype: gl.constexpr = p.q_v.dtype
        for i in range(p.hi - p.lo):
            b = i % 2
            s = _slots(p.idx, p.lo + i, p.n_main, p.n_rows, True, gl.SliceLayout(1, PSCALE), TILE)
            raw = _load_e4m3(p.KV, s)
            scale = _load_scales(p.KVF, s)
            rope_slots = _slots(p.idx, p.lo + i, p.n_main, p.n_rows, True, gl.SliceLayout(1, PROPE), TILE)
            rope = _load_rope(p.KVB, rope_slots)
            # the loads are in flight while the consumers finish with this buffer's tile before last
            mbarrier.wait(p.bars.index(FREE + b), ((i // 2) & 1) ^ 1, pred=i >= 2)
            p.k_v.index(b).store(_dequantize(raw, scale, dtype))
            p.k_r.index(b).store(rope.to(dtype))
            fence_async_shared()
            _barrier()
            mbarrier.arrive(p.bars.index(READY + b), count=1)

    @gluon.jit
    def _consume(p, SINGLE: gl.constexpr):
        """sparse_sm90's loop (less its gathers and dequantization) and epilogue, on the ready tiles."""
        _copy_rows(p.q_v, p.q_r, p.Q, p.pid_h * TILE, p.H_Q, 1, p.stride_qh, 0, (LOAD_V, LOAD_R))
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        _barrier()
        m_i = gl.full([TILE], float("-inf"), gl.float32, gl.SliceLayout(1, QK))
        l_i = gl.zeros([TILE, TILE], gl.float32, QK)
        acc = gl.zeros([TILE, 512], gl.float32, PV)
        zero_qk = gl.zeros([TILE, TILE], gl.float32, QK)
        for i in range(p.hi - p.lo):
            b = i % 2
            used = _slots(p.idx, p.lo + i, p.n_main, p.n_rows, True, gl.SliceLayout(0, QK), TILE) >= 0
            mbarrier.wait(p.bars.index(READY + b), (i // 2) & 1)
            k_v = p.k_v.index(b)
            k_r = p.k_r.index(b)
            m_i, l_i, acc = _attend(p.q_v, p.q_r, k_v, k_r, used, p.qk_scale, m_i, l_i, acc, p.p_smem, zero_qk)
            _barrier()  # both warpgroups are done with key tile b (and P)
            mbarrier.arrive(p.bars.index(FREE + b), count=1)

        # -- epilogue: sparse_sm90's ---------------------------------------------------------------------------------
        heads = p.pid_h * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, PV))
        outs = (p.OUT, p.LSE, p.MAXL, p.r64 * p.stride_or + heads * p.stride_oh, p.r64 * p.stride_lr + heads)
        parts = (p.O_PART, p.ML_PART, (p.r64 * p.H_Q + heads) * p.num_splits + p.split)
        _finish(acc, m_i, l_i, heads < p.H_Q, p.SINK + heads, p.has_sink, outs, parts, SINGLE)

    # the consumers, one function a SINGLE: constexprs do not cross warp_specialize in triton 3.6 (they arrive as
    # runtime values, and a runtime branch around the epilogue trips its lowering); literals in a partition's body do

    @gluon.jit
    def _consume_single(p):
        _consume(p, True)

    @gluon.jit
    def _consume_split(p):
        _consume(p, False)

    @gluon.jit
    def sparse_kernel(
        Q,
        stride_qr,
        stride_qh,
        KV,
        KVF,
        KVB,
        n_rows,
        IDX,
        stride_ir,
        LENS,
        K,
        SINK,
        OUT,
        LSE,
        MAXL,
        stride_or,
        stride_oh,
        stride_lr,
        O_PART,
        ML_PART,
        H_Q,
        tiles_per_split,
        num_splits,
        qk_scale,
        HAS_LENS: gl.constexpr,
        HAS_SINK: gl.constexpr,
        D_V: gl.constexpr,
        D_ROPE: gl.constexpr,
        BLOCK_H: gl.constexpr,
        BLOCK_N: gl.constexpr,
        SINGLE: gl.constexpr,
    ):
        """:func:`mlaspec.impl.sparse_sm90.sparse_kernel`'s arguments and outputs (``D_V`` 512, ``D_ROPE`` 64, 64 x 64
        tiles), launched by :func:`mlaspec.impl.sparse.sparse_mla` in its place."""
        dtype: gl.constexpr = Q.dtype.element_ty
        SH_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_V], dtype)
        SH_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], dtype)
        SH_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
        pid_h, r, split = gl.program_id(0), gl.program_id(1), gl.program_id(2)
        r64 = r.to(gl.int64)
        n_main, lo, hi = _row_tiles(LENS, r, K, split, tiles_per_split, HAS_LENS, BLOCK_N)
        bars = gl.allocate_shared_memory(gl.int64, [NBAR, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NBAR):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        p = S(
            Q + r64 * stride_qr,
            KV,
            KVF,
            KVB,
            IDX + r64 * stride_ir,
            gl.to_tensor(n_rows),
            n_main,
            lo,
            hi,
            pid_h,
            gl.to_tensor(H_Q),
            gl.to_tensor(stride_qh),
            gl.to_tensor(qk_scale),
            r64,
            split,
            gl.to_tensor(num_splits),
            gl.to_tensor(HAS_SINK),
            SINK,
            OUT,
            LSE,
            MAXL,
            gl.to_tensor(stride_or),
            gl.to_tensor(stride_oh),
            gl.to_tensor(stride_lr),
            O_PART,
            ML_PART,
            gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], SH_V),
            gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], SH_R),
            gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_V], SH_V),
            gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_ROPE], SH_R),
            gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], SH_P),
            bars,
        )
        if SINGLE:
            gl.warp_specialize([(_consume_single, (p,)), (_produce, (p,))], [4], [PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consume_split, (p,)), (_produce, (p,))], [4], [PRODUCER_REGS])
