"""A leader-warpgroup sparse attention over keys in q's dtype for Hopper, in Gluon: an experiment, measured and not
wired in.

Written in the session of 2026-11-29 (stop 49) as the next step for the sparse prefill at 64-128 heads a GPU, after
:func:`mlaspec.impl.sparse_sm90.sparse_kernel_float` took it from 0.41-0.50x to 0.65-0.76x FlashMLA on an H200
(``docs/backends.md``, "Nor a target"). That kernel is :mod:`mlaspec.impl.decode_sm90`'s ``split_kernel`` schedule
over gathered rows: two warpgroups of 32 keys each read all of q for ``q k^T``, twice a tile, and one tile's gather is
in flight beside the MMAs. On the dense decode the same schedule gave way to ``split_kernel_lead`` (1.1-1.2x faster
at 128 heads, ``docs/backends.md``, "Where the 128-head decode's time goes"). This is that kernel's schedule over
gathered keys:

* a **leader** warpgroup (the default partition) computes each whole tile's logits (``q k^T`` at N = 64: q read once a
  tile), the softmax, ``P @ V`` of value columns 0-255 with ``P`` from registers, and publishes ``P`` and the rescale
  factor through shared memory; a **helper** warpgroup multiplies columns 256-511 with that ``P``;
* the next tile's logits go to the tensor cores right behind this tile's ``P @ V``;
* a tile's three parts (value columns 0-255, 256-511, RoPE) are gathered by ``cp.async`` by the warpgroup that reads
  each last, as soon as it has: the RoPE part after the logits, each value half after its ``P @ V``. A part's
  landing is signalled by the hardware (``cp.async.mbarrier.arrive``: each issuing thread's copies arrive on the
  part's ``mbarrier`` when they land, Gluon's ``async_copy.mbarrier_arrive``), so the other warpgroup waits on the
  barrier, not on the issuer's progress.

``python benchmarks/sparse_lead_probe.py`` (an H100/H200) runs it beside ``sparse_kernel_float`` on the sparse
prefill's problems (S_q 4096, top-k 2048, 64 and 128 heads, ``-1`` past each causal prefix) and prints the largest
difference of their outputs, LSEs and ``max_logits`` and both times (``do_bench``). On an H200 (2026-11-29, evening,
``docs/speed_log.md``): within one bf16 step of it, 3% faster at S_kv 8K (the cache in L2) and 4-8% slower at 64K
(64 heads 3125 / 3513 us against 3227 / 3250, 128 heads 6138 / 6670 against 6341 / 6390): its gathers, each issued
one tile ahead by the 128 threads of the warpgroup that reads the part last, do not cover a read from HBM.
It compiles for ``sm_90`` with ``ptxas`` reporting 176 bytes of stack a thread under 248 registers (triton 3.9);
``tests/test_impl_pipelining.py`` keeps it compiling. Importing this module runs nothing.
"""

# no `from __future__ import annotations`: triton 3.6's aggregates (_Gather) read their fields' types at run time

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

    # the barriers of decode_sm90's split_kernel_lead, whose leader steps this kernel shares: [2 buffers x 3 parts
    # (LEFT, RIGHT, ROPE)] a part landed, P and alpha published, P read, the final max and row sums published
    from mlaspec.impl.decode_sm90 import LEAD_BARRIERS as BARRIERS
    from mlaspec.impl.decode_sm90 import (
        LEAD_REGS,
        LEFT,
        LOAD_R4,
        LOAD_V4,
        P_FREE,
        P_READY,
        PV1,
        QK1,
        RIGHT,
        ROPE,
        ROWS,
        SUMS_READY,
        _barrier,
        _copy_rows,
        _lead_step,
        _publish_sums,
        _two_tiles,
        aggregate,
    )
    from mlaspec.impl.sparse_sm90 import _gather, _row_tiles, _slots

    @aggregate
    class _Gather:  # what the two partitions share: the shared memory, the query side, the key side
        q_v: gl.shared_memory_descriptor
        q_r: gl.shared_memory_descriptor
        k_v: gl.shared_memory_descriptor  # [2, 64, 512]
        k_r: gl.shared_memory_descriptor  # [2, 64, 64]
        p_smem: gl.shared_memory_descriptor
        rows: gl.shared_memory_descriptor  # [3, 64] fp32: alpha, then the final max and row sums
        bars: gl.shared_memory_descriptor
        Q: gl.tensor  # this row's q
        stride_qh: gl.tensor
        pid_h: gl.tensor
        H_Q: gl.tensor
        qk_scale: gl.tensor
        KV: gl.tensor
        stride_kn: gl.tensor
        n_rows: gl.tensor
        idx: gl.tensor  # this row's indices
        n_main: gl.tensor
        lo: gl.tensor
        hi: gl.tensor

    @gluon.jit
    def _gather_part(p, t, PART: gl.constexpr):
        """Issue the ``cp.async`` gather of one part of tile ``t`` (``LEFT`` / ``RIGHT``: value columns 0-255 /
        256-511, ``ROPE``) into buffer ``t % 2``, by this warpgroup; its landing arrives on the part's barrier (unused
        slots and tiles past the split zero-filled)."""
        HALF: gl.constexpr = p.k_v.shape[2] // 2
        n: gl.constexpr = p.k_v.shape[1]
        bar = p.bars.index((t % 2) * 3 + PART)
        if PART == ROPE:
            slots = _slots(p.idx, t, p.n_main, p.n_rows, t < p.hi, gl.SliceLayout(1, LOAD_R4), n)
            _gather(p.k_r.index(t % 2), p.KV, p.stride_kn, slots, 2 * HALF, LOAD_R4)
        else:
            slots = _slots(p.idx, t, p.n_main, p.n_rows, t < p.hi, gl.SliceLayout(1, LOAD_V4), n)
            dst = p.k_v.index(t % 2).slice(PART * HALF, HALF, dim=1)
            _gather(dst, p.KV, p.stride_kn, slots, PART * HALF, LOAD_V4)
        async_copy.mbarrier_arrive(bar)  # each thread's copies arrive on it when they land (the count raised first)
        _barrier()
        mbarrier.arrive(bar, count=1)  # the one arrival the barrier was made for: the phase ends with the copies

    @gluon.jit
    def _tile_logits(p, t):
        """Issue tile ``t``'s logits, fp32 ``[64, 64]``, each part once it landed."""
        M: gl.constexpr = p.q_v.shape[0]
        N: gl.constexpr = p.k_v.shape[1]
        HALF: gl.constexpr = p.k_v.shape[2] // 2
        phase = ((t - p.lo) // 2) & 1
        k_v = p.k_v.index(t % 2)
        s = gl.zeros([M, N], gl.float32, QK1)  # not read (use_acc=False): the MMA's register shape
        mbarrier.wait(p.bars.index((t % 2) * 3 + LEFT), phase)
        s = warpgroup_mma(p.q_v.slice(0, HALF, dim=1), k_v.slice(0, HALF, dim=1).permute((1, 0)), s, use_acc=False,
                          is_async=True)  # fmt: skip
        mbarrier.wait(p.bars.index((t % 2) * 3 + RIGHT), phase)
        s = warpgroup_mma(p.q_v.slice(HALF, HALF, dim=1), k_v.slice(HALF, HALF, dim=1).permute((1, 0)), s,
                          is_async=True)  # fmt: skip
        mbarrier.wait(p.bars.index((t % 2) * 3 + ROPE), phase)
        return warpgroup_mma(p.q_r, p.k_r.index(t % 2).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _lead(p):
        """The leader warpgroup: q; each tile's logits and softmax; ``P @ V`` of value columns 0-255. Returns its
        accumulator and the rows' final max and row sums (base 2)."""
        M: gl.constexpr = p.q_v.shape[0]
        N: gl.constexpr = p.k_v.shape[1]
        HALF: gl.constexpr = p.k_v.shape[2] // 2
        ROW: gl.constexpr = gl.SliceLayout(1, QK1)
        _copy_rows(p.q_v, p.q_r, p.Q, p.pid_h * M, p.H_Q, 1, p.stride_qh, 0, (LOAD_V4, LOAD_R4))
        async_copy.commit_group()  # q: the one copy group; the gathers after it are tracked by their barriers
        for t in gl.static_range(2):
            _gather_part(p, p.lo + t, ROPE)
            _gather_part(p, p.lo + t, LEFT)
        async_copy.wait_group(0)
        fence_async_shared()
        _barrier()

        m_i = gl.full([M], float("-inf"), gl.float32, ROW)
        l_i = gl.zeros([M], gl.float32, ROW)
        acc = gl.zeros([M, HALF], gl.float32, PV1)
        s = gl.zeros([M, N], gl.float32, QK1)
        if p.lo < p.hi:
            s = warpgroup_mma_wait(0, deps=(_tile_logits(p, p.lo),))
            _gather_part(p, p.lo + 2, ROPE)
        for t in range(p.lo, p.hi):
            i = t - p.lo
            used = _slots(p.idx, t, p.n_main, p.n_rows, True, gl.SliceLayout(0, QK1), N) >= 0
            s = gl.where(gl.expand_dims(used, 0), s * p.qk_scale, float("-inf"))
            pv, m_i, l_i = _lead_step(p, s, m_i, l_i, acc, i, p.k_v.index(t % 2).slice(0, HALF, dim=1))
            if t + 1 < p.hi:
                nxt = _tile_logits(p, t + 1)
                acc = warpgroup_mma_wait(3, deps=(pv,))
                _gather_part(p, t + 2, LEFT)  # this buffer's left half is read
                s = warpgroup_mma_wait(0, deps=(nxt,))
                _gather_part(p, t + 3, ROPE)  # the other buffer's RoPE part is read
            else:
                acc = warpgroup_mma_wait(0, deps=(pv,))
        _publish_sums(p, m_i, l_i, SUMS_READY)
        async_copy.commit_group()  # the gathers past the row's last tile (zero-filled, never waited for) land
        async_copy.wait_group(0)
        return acc, gl.convert_layout(m_i, gl.SliceLayout(1, PV1)), gl.convert_layout(l_i, gl.SliceLayout(1, PV1))

    @gluon.jit
    def _help(p):
        """The helper warpgroup: ``P @ V`` of value columns 256-511, with the leader's ``P``."""
        M: gl.constexpr = p.q_v.shape[0]
        HALF: gl.constexpr = p.k_v.shape[2] // 2
        ROW: gl.constexpr = gl.SliceLayout(1, PV1)
        for t in gl.static_range(2):
            _gather_part(p, p.lo + t, RIGHT)
        acc = gl.zeros([M, HALF], gl.float32, PV1)
        for t in range(p.lo, p.hi):
            i = t - p.lo
            mbarrier.wait(p.bars.index(P_READY), i & 1)
            mbarrier.wait(p.bars.index((t % 2) * 3 + RIGHT), (i // 2) & 1)
            acc = acc * gl.expand_dims(p.rows.index(0).load(ROW), 1)
            pv = warpgroup_mma(p.p_smem, p.k_v.index(t % 2).slice(HALF, HALF, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(pv,))
            _barrier()
            mbarrier.arrive(p.bars.index(P_FREE), count=1)
            _gather_part(p, t + 2, RIGHT)  # this buffer's right half is read
        mbarrier.wait(p.bars.index(SUMS_READY), 0)
        async_copy.commit_group()  # as the leader's
        async_copy.wait_group(0)
        return acc, p.rows.index(1).load(ROW), p.rows.index(2).load(ROW)

    @gluon.jit
    def _finish_half(acc, m_o, l_o, p, SINK, has_sink, OUT, LSE, MAXL, stride_or, stride_oh, stride_lr, r64, col0,
                     WITH_STATS: gl.constexpr):  # fmt: skip
        """One warpgroup's half of the value columns (``col0 ..``) of a whole row, as ``sparse_sm90._finish`` with
        ``SINGLE``: normalised, times ``sigmoid(lse - sink)``; ``WITH_STATS`` also the LSE (natural log, ``+inf`` on
        an empty row) and ``max_logits``."""
        heads = p.pid_h * acc.shape[0] + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, PV1))
        head_ok = heads < p.H_Q
        cols = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, PV1))
        has_keys = l_o > 0.0
        l_use = gl.where(has_keys, l_o, 1.0)
        lse2 = m_o + gl.log2(l_use)
        sink = gl.load(SINK + heads, mask=head_ok & has_sink, other=float("-inf")).to(gl.float32)
        f = 1.0 / (1.0 + gl.exp2(sink * 1.4426950408889634 - gl.where(has_keys, lse2, 0.0)))
        out = acc / gl.expand_dims(l_use, 1) * gl.expand_dims(f, 1)
        o_ptr = OUT + gl.expand_dims(r64 * stride_or + heads * stride_oh, 1) + gl.expand_dims(cols, 0)
        gl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=gl.expand_dims(head_ok, 1))
        if WITH_STATS:
            l_off = r64 * stride_lr + heads
            gl.store(LSE + l_off, gl.where(has_keys, lse2 * 0.6931471805599453, float("inf")), mask=head_ok)
            gl.store(MAXL + l_off, m_o * 0.6931471805599453, mask=head_ok)

    @gluon.jit
    def _lead_part(p, SINK, has_sink, OUT, LSE, MAXL, stride_or, stride_oh, stride_lr, r64):
        acc, m_o, l_o = _lead(p)
        _finish_half(acc, m_o, l_o, p, SINK, has_sink, OUT, LSE, MAXL, stride_or, stride_oh, stride_lr, r64, 0, True)

    @gluon.jit
    def _help_part(p, SINK, has_sink, OUT, LSE, MAXL, stride_or, stride_oh, stride_lr, r64):
        acc, m_o, l_o = _help(p)
        _finish_half(acc, m_o, l_o, p, SINK, has_sink, OUT, LSE, MAXL, stride_or, stride_oh, stride_lr, r64,
                     acc.shape[1], False)  # fmt: skip

    @gluon.jit
    def sparse_lead_kernel(
        Q, stride_qr, stride_qh, KV, stride_kn, n_rows, IDX, stride_ir, LENS, K, SINK, OUT, LSE, MAXL, stride_or,
        stride_oh, stride_lr, H_Q, qk_scale, HAS_LENS: gl.constexpr, HAS_SINK: gl.constexpr, D_V: gl.constexpr,
        D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """Sparse attention of one query row's ``BLOCK_H`` heads over the keys its indices name (whole rows, no
        splits: the prefill), keys in q's dtype ``stride_kn`` apart; ``sparse_kernel_float``'s arguments but the
        splits'. Launch with 4 warps (the leader; the helper is the one worker partition) and ``maxnreg`` 248."""
        dtype: gl.constexpr = Q.dtype.element_ty
        pid_h, r = gl.program_id(0), gl.program_id(1)
        r64 = r.to(gl.int64)
        n_main, lo, hi = _row_tiles(LENS, r, K, 0, 1 << 20, HAS_LENS, BLOCK_N)
        bars = gl.allocate_shared_memory(gl.int64, [BARRIERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(BARRIERS):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        q_v, q_r, k_v, k_r, p_smem = _two_tiles(dtype, BLOCK_H, BLOCK_N, D_V, D_ROPE)
        rows = gl.allocate_shared_memory(gl.float32, [3, BLOCK_H], ROWS)
        p = _Gather(
            q_v, q_r, k_v, k_r, p_smem, rows, bars, Q + r64 * stride_qr, gl.to_tensor(stride_qh), pid_h,
            gl.to_tensor(H_Q), gl.to_tensor(qk_scale), KV, gl.to_tensor(stride_kn), gl.to_tensor(n_rows),
            IDX + r64 * stride_ir, n_main, lo, hi,
        )  # fmt: skip
        outs = (p, SINK, gl.to_tensor(HAS_SINK), OUT, LSE, MAXL, gl.to_tensor(stride_or), gl.to_tensor(stride_oh),
                gl.to_tensor(stride_lr), r64)  # fmt: skip
        gl.warp_specialize([(_lead_part, outs), (_help_part, outs)], [4], [LEAD_REGS])


def run_probe(S_q: int, S_kv: int, heads: int, topk: int) -> str:
    """The probe beside ``sparse_kernel_float`` on one sparse-prefill problem: a line with the largest differences
    and both kernels' ``do_bench`` times."""
    import torch
    from common import bench
    from sparse import D_QK, D_V, prefill_problem

    from mlaspec.impl.sparse import float_keys, sparse_mla

    dev = torch.device("cuda")
    q, kv, idx = prefill_problem(S_q, S_kv, heads, topk, dev)
    scale = D_QK**-0.5
    landed = lambda: sparse_mla(q, float_keys(kv), idx, scale=scale, d_v=D_V, kernel="sm90")  # noqa: E731
    out = torch.empty(S_q, heads, D_V, dtype=q.dtype, device=dev)
    lse = torch.empty(S_q, heads, dtype=torch.float32, device=dev)
    maxl = torch.empty_like(lse)
    sink = lse  # not read (HAS_SINK False)
    ix = idx[:, 0]
    consts = dict(HAS_LENS=False, HAS_SINK=False, D_V=D_V, D_ROPE=D_QK - D_V, BLOCK_H=64, BLOCK_N=64)
    grid = (-(-heads // consts["BLOCK_H"]), S_q)

    def probe():
        sparse_lead_kernel[grid](
            q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.shape[0], ix, ix.stride(0), ix, topk, sink, out, lse,
            maxl, out.stride(0), out.stride(1), lse.stride(0), heads, scale * 1.4426950408889634, **consts,
            num_warps=4, maxnreg=LEAD_REGS.value,
        )  # fmt: skip

    ref = landed()
    probe()
    torch.cuda.synchronize()
    d_out = (out.float() - ref.out.float()).abs().max().item()
    d_lse = (lse - ref.lse).abs().max().item()
    d_max = (maxl - ref.max_logits).abs().max().item()
    t_landed, t_probe = bench(landed) * 1e6, bench(probe) * 1e6
    return (
        f"S_q {S_q} S_kv {S_kv} H {heads} K {topk}: max |d out| {d_out:.3g} |d lse| {d_lse:.3g} "
        f"|d max_logits| {d_max:.3g}; sparse_kernel_float {t_landed:.1f} us, probe {t_probe:.1f} us"
    )


if __name__ == "__main__":
    for h in (64, 128):
        for s_kv in (8192, 65536):
            print(run_probe(4096, s_kv, h, 2048), flush=True)
