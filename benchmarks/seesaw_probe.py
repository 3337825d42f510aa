"""A seesaw 64-row decode split kernel for Hopper, in Gluon (FlashMLA's ``csrc/sm90/decode/dense/splitkv_mla.cuh``
schedule, simplified): an experiment, not wired in.

Written in the session of 2026-11-27 as the next step for issue 18's 128-head targets (``docs/backends.md``, "Issue
18's targets"), after an ablation of :mod:`mlaspec.impl.decode_sm90` showed where its time goes: each of its
warpgroups reads all of q for ``q k^T`` (the logits split 32 keys a warpgroup), the softmax runs while the tensor
cores wait, and 13-18% is waiting for the next tile. It is right -- ``mlaspec check --backend triton --ops
mla_decode,dcp_decode --scale full --generated 20`` with this kernel in the landed one's place: 98 passed on an
H100, outputs within one bf16 step of the landed kernel's -- and **1.2-1.3x slower** (H100, CUDA-graph replays, 128
heads: B1 64K 68.2-69.1 against 55.1-56.3 us, B2 64K 108.7-111.3 against 93.6-95.1, B64 8K 393-419 against 336-343;
16 heads with 4 MTP tokens, B8 8K, 60.4 against 45.9), so :func:`mlaspec.impl.decode.mla_decode_paged` never runs
it.

The design, two warpgroups (``gl.warp_specialize``: the default partition and one worker of 4 warps, 256 threads):

* warpgroup 0 computes the logits of even tiles, warpgroup 1 of odd ones, each a whole 64-key tile (``q k^T`` at
  N = 64 reads q once a tile, not twice), q's latent part from shared memory and its RoPE part from registers
  (which leaves room for both warpgroups' ``P`` beside q and two tiles: 226 of 227 KB);
* each owns 256 of the 512 value columns of ``P @ V`` for every tile: its own tile's ``P`` from registers, the
  other's through shared memory with its running max and rescale factor (``mbarrier`` handoffs); the softmax of one
  warpgroup runs under the other's MMAs;
* no loader warp: each warpgroup copies (tensor-memory copies; ``cp.async``, zero-filled, for a sequence's last,
  part-filled tile) the parts of a tile buffer it is the last to read -- warpgroup 0 the value columns 0-255 after
  its ``P @ V``, warpgroup 1 columns 256-511, each the RoPE part of its own tiles after their ``q k^T`` -- and the
  logits wait for the RoPE part, then each half, as they land.

Same math as the landed kernel (``P`` rounded to q's dtype relative to the running max, fp32 accumulation; the
RoPE part's products are accumulated first and the row sums per warpgroup, so the last bits differ).

Why it is slower, and what a next attempt should change:

1. **Registers.** A consumer thread holds the ``[64, 256]`` fp32 accumulator (128 registers), the tile's logits and
   ``P`` (48), q's RoPE part (16); under ``maxnreg`` 248 it spills 144-680 bytes (``ptxas -v`` on triton 3.9's
   PTX, depending on the code's order). A first version with a one-warp loader beside them (288 threads, 224
   registers) spilled 1084 bytes and was 1.55x slower than the landed kernel (H200).
2. **The copies' lead.** With two tile buffers, a buffer is refilled only when both warpgroups finished its
   ``P @ V``, and warpgroup 1 needs its next tile right after its own ``P @ V``: almost no lead, where the landed
   kernel gives a copy a whole iteration. Delaying warpgroup 1's ``q k^T`` behind its ``P @ V`` of the other's tile
   measured slower again (B2 64K 119 us). FlashMLA splits the logits of the next tile into phases by column chunk
   (nine barriers a buffer) so each warpgroup starts on the chunks freed first.

   Where the lead is lost, part by part (a tile's value halves: L, read by warpgroup 0's ``P @ V``, R by warpgroup
   1's; its RoPE part, read only by its own ``q k^T``): the RoPE parts are freed a softmax and two ``P @ V`` early,
   but both halves of buffer 0 only about one ``P @ V`` before warpgroup 0 computes the next even tile's logits, and
   buffer 1's R half by warpgroup 1 right before the next odd tile's: no lead at all. What to try next, in FlashMLA's
   order (``wg1_subroutine``): warpgroup 1 multiplies its own tile first and the other's after, so buffer 1's R half
   is freed one ``P @ V`` earlier; that needs warpgroup 0's ``P`` rescaled to the max after tile 1 before it is
   published (``wg0_scale_rP0``), since warpgroup 1 then adds it last.

The second is what costs. With its copies switched off (each part's barrier signalled at once), this kernel computes
B1 64K in 43.3-43.5 us and B64 8K in 220-223 us, against 48.8-49.1 and 276 for the landed kernel without its copy
waits (H100, alternated in one process): its arithmetic is 11-20% faster, and 46% of its B64 8K time is waiting for
tiles (the landed kernel's: 19%). The next attempt's work is the copies' lead.

**This file now holds that next step, and it did not help.** Every number above is of the order before it (git
f7e4297: warpgroup 1 multiplied warpgroup 0's tile first). Here warpgroup 1 multiplies its own tile first and then
warpgroup 0's, whose ``P`` warpgroup 0 publishes already rescaled to the max after tile 1, in a separate handoff from
the max (``_publish_max``, ``_publish_p``), and frees its buffer's R half as soon as its own ``P @ V`` is done
(``warpgroup_mma_wait(1)``): 104 bytes of spills under ``ptxas -v`` (176 before). Run on an H100 on 2026-11-27
(afternoon): right (the 98 full-scale cases above pass; outputs within one bf16 step of the landed kernel's) and as
slow as before -- B1 64K 69.1 against 56.1 us, B2 64K 112.7 / 94.8, B64 8K 404.7 / 343.7, 16 heads MTP4 B8 8K
59.8 / 45.1; with its copies off (``decode_ablation.py --kernel seesaw``) B64 8K 309.0 us and B1 128K 89.5, against
338.0 / 95.0 for the landed kernel with its copies.

What landed for 128 heads instead (the same night): :func:`mlaspec.impl.decode_sm90.split_kernel_lead`, which
keeps this probe's whole-tile logits (N = 64) but not its alternation: one warpgroup computes every tile's logits
and softmax, the other multiplies half of ``P @ V``, and the copies keep their lead. Here the landed kernel below
is ``split_kernel`` (the kernel 128 heads ran before), so the timings compare against the schedule this probe was
written to beat.

    python benchmarks/seesaw_probe.py          # on an H100/H200: outputs against the landed kernel, then timings

Importing this module compiles nothing and needs no GPU.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mlaspec.impl import decode_sm90
from mlaspec.impl.decode_sm90 import _barrier, _copy_part, _tma_load, aggregate

LOAD_V4 = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))
QKL = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
PVL = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
A_QK = gl.constexpr(gl.DotOperandLayout(0, QKL, 2))
A_PV = gl.constexpr(gl.DotOperandLayout(0, PVL, 2))
ROW_QK = gl.constexpr(gl.SliceLayout(1, QKL))
ROW_PV = gl.constexpr(gl.SliceLayout(1, PVL))
SH1 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
# barriers, one array
Q_READY = gl.constexpr(0)
READY = gl.constexpr(1)  # [2 buffers x 3 parts]: value columns 0-255, 256-511, RoPE
M_READY = gl.constexpr(7)  # [2]: warpgroup w published its max and rescale factor
P_READY = gl.constexpr(9)  # [2]: warpgroup w published its P
P_FREE = gl.constexpr(11)  # [2]: the other read sP[w]
L_READY = gl.constexpr(13)  # [2]
NBAR = gl.constexpr(15)
LEFT, RIGHT, ROPE = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
LOAD_R4 = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # [64, 64]
MAXNREG = 248


@aggregate
class S:
    Q: gl.tensor  # q of this batch entry
    KV: gl.tensor
    bt: gl.tensor
    seq_len: gl.tensor
    blk_lo: gl.tensor
    n: gl.tensor
    page: gl.tensor
    stride_kp: gl.tensor
    stride_ks: gl.tensor
    pid_m: gl.tensor
    S_Q: gl.tensor
    H_Q: gl.tensor
    stride_qs: gl.tensor
    stride_qh: gl.tensor
    causal: gl.tensor
    qk_scale: gl.tensor
    k_scale: gl.tensor
    b: gl.tensor
    split: gl.tensor
    num_splits: gl.tensor
    OUT: gl.tensor
    LSE: gl.tensor
    O_PART: gl.tensor
    LSE_PART: gl.tensor
    stride_ob: gl.tensor
    stride_os: gl.tensor
    stride_oh: gl.tensor
    stride_lb: gl.tensor
    stride_lh: gl.tensor
    stride_ls: gl.tensor
    q_v: gl.shared_memory_descriptor
    kv_v: gl.shared_memory_descriptor
    kv_r: gl.shared_memory_descriptor
    sp: gl.shared_memory_descriptor  # [2, 64, 64]
    sm: gl.shared_memory_descriptor  # [2, 64] maxima
    sa: gl.shared_memory_descriptor  # [2, 64] rescale factors
    sl: gl.shared_memory_descriptor  # [2, 64] row sums
    bars: gl.shared_memory_descriptor


@gluon.jit
def _issue(p, DESC_H, DESC_R, buf, blk, PART: gl.constexpr):
    """Start the copy of one part of key tile ``blk`` into buffer ``buf``: a whole tile's by one tensor-memory copy
    that signals the part's barrier, a sequence's last, part-filled tile's by cp.async (zero-filled past the end),
    the barrier signalled once it landed."""
    n: gl.constexpr = p.kv_v.shape[1]
    HALF: gl.constexpr = p.kv_v.shape[2] // 2
    page = gl.load(p.bt + blk // (p.page // n)).to(gl.int64)
    slot0 = (blk % (p.page // n)) * n
    bar = p.bars.index(READY + buf * 3 + PART)
    if PART == ROPE:
        dst = p.kv_r.index(buf)
    else:
        dst = p.kv_v.index(buf).slice(PART * HALF, HALF, dim=1)
    if (blk + 1) * n <= p.seq_len:
        row = page.to(gl.int32) * p.page + slot0
        if PART == ROPE:
            mbarrier.expect(bar, DESC_R.block_type.nbytes)
            _tma_load(DESC_R, [row, 2 * HALF], bar, dst)
        else:
            mbarrier.expect(bar, DESC_H.block_type.nbytes)
            _tma_load(DESC_H, [row, PART * HALF], bar, dst)
    else:
        limit = slot0 + p.seq_len - blk * n
        base = p.KV + page * p.stride_kp
        if PART == ROPE:
            _copy_part(dst, base, slot0, limit, p.page, 0, p.stride_ks, 2 * HALF, LOAD_R4)
        else:
            for c in gl.static_range(HALF // 64):  # a [64, 64] chunk at a time: few address registers
                _copy_part(dst.slice(c * 64, 64, dim=1), base, slot0, limit, p.page, 0, p.stride_ks,
                           PART * HALF + c * 64, LOAD_R4)  # fmt: skip
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        _barrier()
        mbarrier.arrive(bar)


@gluon.jit
def _qk(p, q_rope, buf, k):
    """This warpgroup's whole tile of logits, fp32 [64, 64], chunk by chunk as the chunks land."""
    rdy = READY + buf * 3
    ph = k & 1
    M: gl.constexpr = p.q_v.shape[0]
    T: gl.constexpr = p.kv_v.shape[1]
    s = gl.zeros([M, T], gl.float32, QKL)
    kv = p.kv_v.index(buf)
    mbarrier.wait(p.bars.index(rdy + ROPE), ph)
    s = warpgroup_mma(q_rope, p.kv_r.index(buf).permute((1, 0)), s, use_acc=False, is_async=True)
    for c in gl.static_range(8):
        if c % 4 == 0:
            mbarrier.wait(p.bars.index(rdy + c // 4), ph)
        s = warpgroup_mma(p.q_v.slice(c * 64, 64, dim=1), kv.slice(c * 64, 64, dim=1).permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(0, deps=(s,))


@gluon.jit
def _softmax(p, s, blk, m_prev, n_keys, n_seen):
    """(P fp32, m_new, alpha) of one tile's raw logits against the running max m_prev (base 2)."""
    T: gl.constexpr = s.shape[1]
    if (blk + 1) * T > n_seen:
        keys = blk * T + gl.arange(0, T, layout=gl.SliceLayout(0, QKL))
        allowed = gl.expand_dims(keys < p.seq_len, 0) & (gl.expand_dims(keys, 0) < gl.expand_dims(n_keys, 1))
        s = gl.where(allowed, s * p.qk_scale, float("-inf"))
    else:
        s = s * p.qk_scale
    m_new = gl.maximum(m_prev, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_prev - m_use)
    prob = gl.exp2(s - gl.expand_dims(m_use, 1))
    return prob, m_new, alpha


@gluon.jit
def _publish_max(p, W: gl.constexpr, m_new, alpha):
    """Warpgroup ``W``'s running max after its tile and the factor that rescales what came before, for the other."""
    p.sm.index(W).store(m_new)
    p.sa.index(W).store(alpha)
    _barrier()
    mbarrier.arrive(p.bars.index(M_READY + W), count=1)


@gluon.jit
def _publish_p(p, W: gl.constexpr, prob, k):
    """Warpgroup ``W``'s ``P`` (rounded to q's dtype) for the other's ``P @ V``, once the other read the last one."""
    mbarrier.wait(p.bars.index(P_FREE + W), (k - 1) & 1, pred=k > 0)
    p.sp.index(W).store(prob.to(p.q_v.dtype))
    fence_async_shared()
    _barrier()
    mbarrier.arrive(p.bars.index(P_READY + W), count=1)


@gluon.jit
def _their_p_times_v(p, acc, O: gl.constexpr, v, k):
    """``acc + P @ v`` with warpgroup ``O``'s ``P``, once it is published (tile pair ``k``)."""
    mbarrier.wait(p.bars.index(P_READY + O), k & 1)
    acc = warpgroup_mma(p.sp.index(O), v, acc, is_async=True)
    return warpgroup_mma_wait(0, deps=(acc,))


@gluon.jit
def _rows(x):
    return gl.convert_layout(x, ROW_PV)


@gluon.jit
def _consume(p, DESC_H, DESC_R, W: gl.constexpr, SINGLE: gl.constexpr):
    M: gl.constexpr = p.q_v.shape[0]
    T: gl.constexpr = p.kv_v.shape[1]
    HALF: gl.constexpr = p.kv_v.shape[2] // 2
    dtype: gl.constexpr = p.q_v.dtype
    R = p.S_Q * p.H_Q
    # q: warpgroup 0 copies the latent part into shared memory; each keeps the RoPE part in registers
    rq = p.pid_m * M + gl.arange(0, M, layout=gl.SliceLayout(1, A_QK))
    D_V: gl.constexpr = p.q_v.shape[1]
    cq = D_V + gl.arange(0, 64, layout=gl.SliceLayout(0, A_QK))
    q_off = (rq // p.H_Q).to(gl.int64) * p.stride_qs + (rq % p.H_Q) * p.stride_qh
    q_rope = gl.load(p.Q + gl.expand_dims(q_off, 1) + gl.expand_dims(cq, 0), mask=gl.expand_dims(rq < R, 1), other=0.0)
    if W == 0:
        _copy_part(p.q_v, p.Q, p.pid_m * M, R, p.H_Q, p.stride_qs, p.stride_qh, 0, LOAD_V4)
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        _barrier()
        mbarrier.arrive(p.bars.index(Q_READY), count=1)
    mbarrier.wait(p.bars.index(Q_READY), 0)

    rows = p.pid_m * M + gl.arange(0, M, layout=ROW_QK)
    n_keys = gl.zeros([M], gl.int32, ROW_QK) + p.seq_len
    n_seen = p.seq_len
    if p.causal:
        n_keys = p.seq_len - p.S_Q + 1 + rows // p.H_Q
        n_seen = p.seq_len - p.S_Q + 1
    m_i = gl.full([M], float("-inf"), gl.float32, ROW_QK)
    l_i = gl.zeros([M], gl.float32, ROW_QK)
    acc = gl.zeros([M, HALF], gl.float32, PVL)
    # the first two tiles: each warpgroup copies the parts it is the last to read
    if W == 0:
        if p.n > 0:
            _issue(p, DESC_H, DESC_R, 0, p.blk_lo, ROPE)
            _issue(p, DESC_H, DESC_R, 0, p.blk_lo, LEFT)
        if p.n > 1:
            _issue(p, DESC_H, DESC_R, 1, p.blk_lo + 1, LEFT)
    else:
        if p.n > 0:
            _issue(p, DESC_H, DESC_R, 0, p.blk_lo, RIGHT)
        if p.n > 1:
            _issue(p, DESC_H, DESC_R, 1, p.blk_lo + 1, RIGHT)
            _issue(p, DESC_H, DESC_R, 1, p.blk_lo + 1, ROPE)
    for k in range(0, (p.n + 1) // 2):
        blk0 = p.blk_lo + 2 * k
        has1 = 2 * k + 1 < p.n
        more0 = 2 * k + 2 < p.n
        more1 = 2 * k + 3 < p.n
        v0 = p.kv_v.index(0).slice(W * HALF, HALF, dim=1)
        v1 = p.kv_v.index(1).slice(W * HALF, HALF, dim=1)
        if W == 0:
            s = _qk(p, q_rope, 0, k)
            if more0:
                _issue(p, DESC_H, DESC_R, 0, blk0 + 2, ROPE)
            prob, m0, alpha0 = _softmax(p, s, blk0, m_i, n_keys, n_seen)
            l_i = l_i * alpha0 + gl.sum(prob, 1)
            _publish_max(p, 0, m0, alpha0)
            acc = acc * gl.expand_dims(_rows(alpha0), 1)
            acc = warpgroup_mma(gl.convert_layout(prob.to(dtype), A_PV), v0, acc, is_async=True)
            # warpgroup 1 adds this tile after its own: P published relative to the max after both
            mbarrier.wait(p.bars.index(M_READY + 1), k & 1, pred=has1)
            alpha1 = gl.full([M], 1.0, gl.float32, ROW_QK)
            m_i = m0
            if has1:
                alpha1 = p.sa.index(1).load(ROW_QK)
                m_i = p.sm.index(1).load(ROW_QK)
            _publish_p(p, 0, prob * gl.expand_dims(alpha1, 1), k)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if more0:
                _issue(p, DESC_H, DESC_R, 0, blk0 + 2, LEFT)
            if has1:
                l_i = l_i * alpha1
                acc = acc * gl.expand_dims(_rows(alpha1), 1)
                acc = _their_p_times_v(p, acc, 1, v1, k)
                mbarrier.arrive(p.bars.index(P_FREE + 1), count=1)
                if more1:
                    _issue(p, DESC_H, DESC_R, 1, blk0 + 3, LEFT)
        else:
            s = gl.zeros([M, T], gl.float32, QKL)
            if has1:
                s = _qk(p, q_rope, 1, k)
                if more1:
                    _issue(p, DESC_H, DESC_R, 1, blk0 + 3, ROPE)
            mbarrier.wait(p.bars.index(M_READY + 0), k & 1)
            alpha0 = p.sa.index(0).load(ROW_QK)
            m_i = p.sm.index(0).load(ROW_QK)
            l_i = l_i * alpha0
            acc = acc * gl.expand_dims(_rows(alpha0), 1)
            if has1:
                prob, m1, alpha1 = _softmax(p, s, blk0 + 1, m_i, n_keys, n_seen)
                l_i = l_i * alpha1 + gl.sum(prob, 1)
                _publish_max(p, 1, m1, alpha1)
                _publish_p(p, 1, prob, k)
                m_i = m1
                # its own tile first, then warpgroup 0's (P already relative to m1): its buffer's half is freed first
                acc = acc * gl.expand_dims(_rows(alpha1), 1)
                acc = warpgroup_mma(gl.convert_layout(prob.to(dtype), A_PV), v1, acc, is_async=True)
                mbarrier.wait(p.bars.index(P_READY + 0), k & 1)
                acc = warpgroup_mma(p.sp.index(0), v0, acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc,))
                if more1:
                    _issue(p, DESC_H, DESC_R, 1, blk0 + 3, RIGHT)
                acc = warpgroup_mma_wait(0, deps=(acc,))
            else:
                acc = _their_p_times_v(p, acc, 0, v0, k)
            mbarrier.arrive(p.bars.index(P_FREE + 0), count=1)
            if more0:
                _issue(p, DESC_H, DESC_R, 0, blk0 + 2, RIGHT)

    # -- the row sums of both warpgroups (relative to the same last max), then this warpgroup's half ----------------
    p.sl.index(W).store(l_i)
    _barrier()
    mbarrier.arrive(p.bars.index(L_READY + W), count=1)
    mbarrier.wait(p.bars.index(L_READY + 1 - W), 0)
    l_o = _rows(l_i + p.sl.index(1 - W).load(ROW_QK))
    has_keys = l_o > 0.0
    l_use = gl.where(has_keys, l_o, 1.0)
    out = acc * gl.expand_dims(p.k_scale / l_use, 1)
    lse2 = gl.where(has_keys, _rows(m_i) + gl.log2(l_use), float("-inf"))
    rows_o = p.pid_m * M + gl.arange(0, M, layout=ROW_PV)
    row_ok = rows_o < R
    cols_o = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, PVL))
    if SINGLE:
        s_, h = rows_o // p.H_Q, rows_o % p.H_Q
        o_row = p.b.to(gl.int64) * p.stride_ob + s_ * p.stride_os + h * p.stride_oh
        gl.store(
            p.OUT + gl.expand_dims(o_row, 1) + gl.expand_dims(cols_o, 0), out.to(dtype), mask=gl.expand_dims(row_ok, 1)
        )
        if W == 0:
            gl.store(
                p.LSE + p.b * p.stride_lb + h * p.stride_lh + s_ * p.stride_ls, lse2 * 0.6931471805599453, mask=row_ok
            )
    else:
        part = (p.b * p.num_splits + p.split).to(gl.int64) * R + rows_o
        gl.store(
            p.O_PART + gl.expand_dims(part * (2 * HALF), 1) + gl.expand_dims(cols_o, 0),
            out,
            mask=gl.expand_dims(row_ok, 1),
        )
        if W == 0:
            gl.store(p.LSE_PART + part, lse2, mask=row_ok)


# the partitions, one function each: constexprs do not cross warp_specialize in triton 3.6 (they arrive as runtime
# values), literals written in a partition's own body do


@gluon.jit
def _wg0_single(p, DESC_H, DESC_R):
    _consume(p, DESC_H, DESC_R, 0, True)


@gluon.jit
def _wg0_split(p, DESC_H, DESC_R):
    _consume(p, DESC_H, DESC_R, 0, False)


@gluon.jit
def _wg1_single(p, DESC_H, DESC_R):
    _consume(p, DESC_H, DESC_R, 1, True)


@gluon.jit
def _wg1_split(p, DESC_H, DESC_R):
    _consume(p, DESC_H, DESC_R, 1, False)


@gluon.jit
def seesaw_kernel(
    Q,
    KV,
    BLOCK_TABLE,
    SEQ_LENS,
    O_PART,
    LSE_PART,
    OUT,
    LSE,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_btb,
    stride_ob,
    stride_os,
    stride_oh,
    stride_lb,
    stride_lh,
    stride_ls,
    qk_scale,
    k_scale,
    S_Q,
    H_Q,
    blocks_per_split,
    num_splits,
    DESC_H,
    DESC_R,
    CAUSAL: gl.constexpr,
    D_V: gl.constexpr,
    D_ROPE: gl.constexpr,
    PAGE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    SINGLE: gl.constexpr,
    TMA: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    SH_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_V], dtype)
    SH_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], dtype)
    SH_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    pid_m, split, b = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    seq_len = gl.load(SEQ_LENS + b)
    n_blocks = gl.cdiv(seq_len, BLOCK_N)
    blk_lo = split * blocks_per_split
    n = gl.maximum(gl.minimum(blk_lo + blocks_per_split, n_blocks) - blk_lo, 0)
    bars = gl.allocate_shared_memory(gl.int64, [NBAR, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBAR):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    p = S(
        Q + b.to(gl.int64) * stride_qb,
        KV,
        BLOCK_TABLE + b * stride_btb,
        seq_len,
        blk_lo,
        n,
        gl.to_tensor(PAGE),
        gl.to_tensor(stride_kp),
        gl.to_tensor(stride_ks),
        pid_m,
        gl.to_tensor(S_Q),
        gl.to_tensor(H_Q),
        gl.to_tensor(stride_qs),
        gl.to_tensor(stride_qh),
        gl.to_tensor(CAUSAL),
        gl.to_tensor(qk_scale),
        gl.to_tensor(k_scale),
        b,
        split,
        gl.to_tensor(num_splits),
        OUT,
        LSE,
        O_PART,
        LSE_PART,
        gl.to_tensor(stride_ob),
        gl.to_tensor(stride_os),
        gl.to_tensor(stride_oh),
        gl.to_tensor(stride_lb),
        gl.to_tensor(stride_lh),
        gl.to_tensor(stride_ls),
        gl.allocate_shared_memory(dtype, [BLOCK_M, D_V], SH_V),
        gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_V], SH_V),
        gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_ROPE], SH_R),
        gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], SH_P),
        gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], SH1),
        gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], SH1),
        gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], SH1),
        bars,
    )
    if SINGLE:
        gl.warp_specialize([(_wg0_single, (p, DESC_H, DESC_R)), (_wg1_single, (p, DESC_H, DESC_R))], [4], [248])
    else:
        gl.warp_specialize([(_wg0_split, (p, DESC_H, DESC_R)), (_wg1_split, (p, DESC_H, DESC_R))], [4], [248])


LANDED = decode_sm90.split_kernel


def _half_descriptor(kv_cache):
    """The tensor-memory-copy descriptor of ``kv_cache [pages, page_size, 576]`` seen as ``[slots, 576]`` in blocks
    of ``[64, 256]`` (a value half of a tile)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    pages, page, width = kv_cache.shape
    dtype = {"torch.bfloat16": gl.bfloat16, "torch.float16": gl.float16}[str(kv_cache.dtype)]
    layout = gl.NVMMASharedLayout.get_default_for([64, 256], dtype)
    return TensorDescriptor(kv_cache, [pages * page, width], [kv_cache.stride(1), 1], [64, 256], layout)


class _Launcher:
    """``split_kernel[grid](...)`` as :func:`mlaspec.impl.decode.mla_decode_paged` launches the landed kernel's; a
    cache whose pages are not one stride apart (no tensor-memory copies) runs the landed kernel."""

    def __getitem__(self, grid):
        def launch(*a, **kw):
            if not kw["TMA"]:
                kw["num_warps"] = 8
                return LANDED[grid](*a, **kw)
            kw["num_warps"] = 4
            a = list(a)
            a[-2] = _half_descriptor(a[1])
            seesaw_kernel[grid](*a, **kw, maxnreg=MAXNREG)

        return launch


split_kernel = _Launcher()


def main() -> None:
    import torch
    from common import bench
    from decode import D_QK, PAGE, make_problem

    from mlaspec.impl.decode import mla_decode_paged

    decode_sm90.lead_applies = lambda row_blocks: False  # split_kernel's place, at every head count
    print("shape                      landed us  seesaw us  max |out diff|")
    for heads, batch, keys, s_q in [(128, 1, 65536, 1), (128, 2, 65536, 1), (128, 64, 8192, 1), (16, 8, 8192, 4)]:
        cache, bt, sl = make_problem(batch, keys, torch.device("cuda"))
        if batch > 1:  # ragged: part-filled last tiles, splits that end early
            sl = (sl - torch.randint(0, 700, sl.shape, device="cuda", dtype=sl.dtype)).clamp_(min=1)
        q = torch.randn(batch, s_q, heads, D_QK, device="cuda", dtype=torch.bfloat16)
        c3 = cache.view(-1, PAGE, D_QK)

        def run(q=q, c3=c3, bt=bt, sl=sl, keys=keys):
            return mla_decode_paged(q, c3, bt, sl, scale=192**-0.5, max_seq_len=keys, kernel="sm90")

        times, outs = [], []
        for kernel in (LANDED, split_kernel):
            decode_sm90.split_kernel = kernel
            try:
                outs.append(run().out.float())
                times.append(bench(run, graph=True) * 1e6)
            finally:
                decode_sm90.split_kernel = LANDED
        diff = (outs[0] - outs[1]).abs().max().item()
        print(f"H{heads} B{batch} {keys:>6} keys S_q {s_q}  {times[0]:9.1f}  {times[1]:9.1f}  {diff:.1e}")


if __name__ == "__main__":
    main()
