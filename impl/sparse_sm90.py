"""The sparse decode of :mod:`mlaspec.impl.sparse` over FlashMLA's 656-byte fp8 cache at 64 query heads a program
(DeepSeek V3.2 at 64 or 128 heads) for Hopper, in Gluon: the next two tiles' bytes stream in while this one is used.

Same math and outputs as ``_sparse_mla_kernel`` with ``FMT = fp8_v32``, ``BLOCK_H = BLOCK_N = 64`` and no extra
cache (read that one first: it is the readable version). Its 64-key tiles are gathered, each key a 656-byte record
anywhere in the cache: on an H200 one program alone walks 32 tiles in ~130 us (~4 us a tile, with this kernel's
prefetch) against ~1 us of tensor-core work a tile holds. The gathers set the pace, so what matters is how early
each load is issued. What this kernel does differently from the readable one:

1. **Two tiles' bytes in flight, in shared memory.** The e4m3 bytes of tiles ``j + 1`` and ``j + 2`` (32 KB a
   tile) stream into two byte buffers by ``cp.async``, which holds no registers while in flight; the scales and
   RoPE values (24 + 128 bytes a key) are loaded into registers a tile ahead, and the indices three tiles ahead, so
   no copy waits on its index load. Each tile is dequantized once (``e4m3 * scale`` in fp32, rounded to q's dtype)
   from its byte buffer into the one bf16 key tile the MMAs read: q 72 KB, the key tile 72 KB, ``P`` 8 KB and the
   byte buffers 64 KB make 216 of the 227 KB an SM has. The readable kernel, compiled for ``sm_90``, loads,
   dequantizes in registers and only then multiplies. FlashMLA's sparse decode (``csrc/sm90/decode/sparse_fp8/
   splitkv_mla.cuh``) dequantizes into bf16 shared memory too, in a producer warpgroup.
2. **Each logit once.** The two warpgroups take 32 keys each of the ``[64, 64]`` logits, ``P`` goes through 8 KB
   of shared memory, and each warpgroup owns 256 of the 512 value columns in ``P @ V`` (the dense 64-row decode of
   :mod:`mlaspec.impl.decode_sm90` splits them the same way).
3. **Row sums per key column.** ``l`` is kept as ``[64, 64]`` fp32, rescaled by ``alpha`` each tile and summed once
   at the end, so the warpgroups meet for the row maximum only: five CTA barriers a tile instead of seven.

Tried first and measured slower on an H200 (CUDA-graph replays, top-k 2048): the next tile's bytes, scales and
RoPE values prefetched into registers one tile ahead and dequantized into a second bf16 key tile under ``P @ V``
(224 KB): 0.50-0.79x FlashMLA at B = 1-128 against 0.71-0.91x for item 1 alone; item 3 then made B = 128, 64 heads
156.1 -> 140.0 us and 128 heads 288.2 -> 268.0 us. On an H100 (2026-11-27): the e4m3 bytes decoded by integer and f16
instructions instead of the conversion unit, 6-9% slower; ``q k^T`` in four column chunks, each issued while the
next chunk is dequantized, 18% slower (three more CTA barriers a tile). What the remaining gap to FlashMLA at 128
heads asks for is in ``docs/backends.md`` ("Where the 128-head sparse decode's time goes").

For splits of at most 4 or at least 32 tiles, :func:`mlaspec.impl.sparse.sparse_producer_runs` takes its twin
:mod:`mlaspec.impl.sparse_sm90_producer`, where a producer warpgroup dequantizes beside the MMAs (same outputs).

**Keys already in q's dtype** (the prefill's ``kv [S_kv, 1, 576]``, FlashMLA's ``flash_mla_sparse_fwd``; a bf16
cache) take :func:`sparse_kernel_float`: nothing to convert, so each tile's 64 rows (1152 bytes each, anywhere) are
gathered by ``cp.async`` straight into one of two bf16 key tiles, the next tile's in flight while this one is
multiplied (q, two tiles and ``P``: 224 KB); the logits, softmax, ``P @ V`` and epilogue are :func:`sparse_kernel`'s.
On an H200 (2026-11-29, top-k 2048, ``do_bench``) the prefill at S_q = 4096 and 64 / 128 heads took 0.66-0.74x /
0.65-0.73x FlashMLA's time-ratio against the readable kernel's 0.46-0.48x / 0.45-0.46x; at 16 heads, whose rows fill
a quarter of its 64-row tile, the readable kernel's 16-row tiles stay faster where the rows are many
(:func:`mlaspec.impl.sparse.float_keys_sm90`).

Rounding is the readable kernel's: the key rounded to q's dtype after its scale, fp32 logits, ``P`` rounded to
q's dtype, fp32 accumulation, the same base-2 online softmax; only the order of the row sum's fp32 additions
differs. The conformance harness judges both kernels (``MLASPEC_SPARSE_KERNEL``,
:func:`mlaspec.impl.sparse.sparse_mla`).
"""

from __future__ import annotations

from .decode_sm90 import AVAILABLE, LOAD_R, LOAD_V, PV, QK, _copy_rows, _p_times_v, _softmax_step, _two_tiles

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .decode_sm90 import _async_load, _barrier

__all__ = ["AVAILABLE", "BLOCK_H", "BLOCK_N", "NUM_WARPS", "sparse_kernel", "sparse_kernel_float"]

BLOCK_H, BLOCK_N, NUM_WARPS = 64, 64, 8  # one warpgroup MMA tall; two warpgroups

if AVAILABLE:
    # a tile's e4m3 bytes [64 keys, 4 scale groups, 128] over four keys a warp, a key's scale group over 8 threads,
    # 16 bytes a thread (each thread's bytes share one scale); the scales [64, 4] and the rows' slots [64] as slices
    # of it; the RoPE values [64, 64] bf16 over a quarter warp a key. Four keys a warp, not one, because of the
    # dequantized tile's store: a thread's 16 values are two 16-byte pieces of a 128-byte-swizzled row, and one key a
    # warp put a store's 32 pieces in 4 of a row's 8 bank slots, four keys (four swizzles) in all 8 -- half the
    # shared-memory wavefronts (H100, 2026-11-27: 128 heads B64-128 1-3% faster, 16 heads B64 14%; same outputs)
    RAW = gl.constexpr(gl.BlockedLayout([1, 1, 16], [4, 1, 8], [8, 1, 1], [2, 1, 0]))
    SCALE = gl.constexpr(gl.SliceLayout(2, RAW))
    ROW = gl.constexpr(gl.SliceLayout(1, SCALE))
    ROPE_ROW = gl.constexpr(gl.SliceLayout(1, LOAD_R))
    SH_RAW = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))  # a warp reads 4 keys' 128 bytes: no conflict

    @gluon.jit
    def _slots(IDX, tile, n_main, n_rows, valid, LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr):
        """The cache rows of slots ``tile * BLOCK_N ..`` in ``LAYOUT``: int32, ``-1`` where unused (past
        ``n_main`` or the split, or an index outside ``[0, n_rows)``)."""
        t = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=LAYOUT)
        slots = gl.load(IDX + t, mask=(t < n_main) & valid, other=-1)
        return gl.where((slots >= 0) & (slots < n_rows), slots, -1)

    @gluon.jit
    def _e4m3_ptrs(KV, slots):
        """Pointers to the keys' e4m3 bytes ``[BLOCK_N, 4, 128]`` (bytes ``[0, 512)`` of each 656-byte record) in
        the 3-d layout whose ``[BLOCK_N]`` slice ``slots`` has, and the mask of the used slots."""
        L: gl.constexpr = slots.type.layout.parent.parent
        g = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
        row = gl.expand_dims(gl.maximum(slots, 0).to(gl.int64) * 656, 1) + gl.expand_dims(g * 128, 0)
        ptr = KV + gl.expand_dims(row, 2) + gl.expand_dims(gl.expand_dims(c, 0), 1)
        return ptr, gl.expand_dims(gl.expand_dims(slots >= 0, 1), 2)

    @gluon.jit
    def _copy_e4m3(dst, KV, slots):
        """Issue the ``cp.async`` of the keys' e4m3 bytes into ``dst [BLOCK_N, 4, 128]``; unused slots zero-filled,
        never read."""
        ptr, used = _e4m3_ptrs(KV, slots)
        _async_load(dst, ptr, mask=used)

    @gluon.jit
    def _load_e4m3(KV, slots):
        """The keys' e4m3 bytes ``[BLOCK_N, 4, 128]`` (uint8) into registers; 0 where unused."""
        ptr, used = _e4m3_ptrs(KV, slots)
        return gl.load(ptr, mask=used, other=0)

    @gluon.jit
    def _load_scales(KVF, slots):
        """The keys' four fp32 scales ``[BLOCK_N, 4]`` (bytes ``[512, 528)``) in the layout whose row slice
        ``slots`` has; 0 where unused."""
        g = gl.arange(0, 4, layout=gl.SliceLayout(0, slots.type.layout.parent))
        ptr = KVF + gl.expand_dims(gl.maximum(slots, 0).to(gl.int64) * 164 + 128, 1) + gl.expand_dims(g, 0)
        return gl.load(ptr, mask=gl.expand_dims(slots >= 0, 1), other=0.0)

    @gluon.jit
    def _load_rope(KVB, slots):
        """The keys' 64 bf16 RoPE values ``[BLOCK_N, 64]`` (bytes ``[528, 656)``) in the layout whose row slice
        ``slots`` has; 0 where unused."""
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, slots.type.layout.parent))
        ptr = KVB + gl.expand_dims(gl.maximum(slots, 0).to(gl.int64) * 328 + 264, 1) + gl.expand_dims(c, 0)
        return gl.load(ptr, mask=gl.expand_dims(slots >= 0, 1), other=0.0)

    @gluon.jit
    def _dequantize(raw, scale, dtype: gl.constexpr):
        """A tile's e4m3 bytes ``raw [BLOCK_N, 4, 128]`` times their scales ``[BLOCK_N, 4]`` in fp32, rounded to
        ``dtype``: the bf16 key tile ``[BLOCK_N, 512]``."""
        vals = raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(scale, 2)
        return gl.reshape(vals.to(dtype), [raw.shape[0], raw.shape[1] * raw.shape[2]])

    @gluon.jit
    def _attend(q_v, q_r, k_v, k_r, used, qk_scale, m_i, l_i, acc, p_smem, zero_qk):
        """One key tile's step: its logits in base 2 (fp32, each warpgroup 32 of the 64 keys; ``-inf`` where not
        ``used``), the online softmax, then ``P @ V`` (``P`` rounded to q's dtype): ``(m_i, l_i, acc)``.
        ``zero_qk``: a ``[64, 64]`` fp32 tensor in ``QK``, the logits' register shape (not read)."""
        qk = warpgroup_mma(q_v, k_v.permute((1, 0)), zero_qk, use_acc=False, is_async=True)
        qk = warpgroup_mma(q_r, k_r.permute((1, 0)), qk, is_async=True)
        qk = warpgroup_mma_wait(0, deps=(qk,))
        qk = gl.where(gl.expand_dims(used, 0), qk * qk_scale, float("-inf"))
        p, alpha, m_new = _softmax_step(qk, m_i)
        l_i = l_i * gl.expand_dims(alpha, 1) + p  # per key column: summed once at the end, no barrier a tile
        return m_new, l_i, _p_times_v(p, alpha, acc, p_smem, k_v)

    @gluon.jit
    def _empty_state(BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr):
        """``(m_i, l_i, acc, zero_qk)`` before the first tile: the rows' maxima ``-inf``, their row sums per key
        column, the output and the logits' register shape (:func:`_attend`'s ``zero_qk``), zeros."""
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, QK))
        l_i = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, QK)
        return m_i, l_i, gl.zeros([BLOCK_H, D_V], gl.float32, PV), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, QK)

    @gluon.jit
    def _row_tiles(LENS, r, K, split, tiles_per_split, HAS_LENS: gl.constexpr, BLOCK_N: gl.constexpr):
        """``(n_main, lo, hi)``: a row's slots in use (``K``, or its ``topk_length``) and this split's tiles."""
        n_main = gl.to_tensor(K)
        if HAS_LENS:
            n_main = gl.minimum(gl.load(LENS + r), K)
        lo = split * tiles_per_split
        return n_main, lo, gl.minimum(lo + tiles_per_split, gl.cdiv(n_main, BLOCK_N))

    @gluon.jit
    def _finish(acc, m_i, l_i, head_ok, sink_ptr, has_sink, outs, parts, SINGLE: gl.constexpr):
        """Write a program's result, as the readable kernel's ``_finish``: ``SINGLE`` (the split is the whole row)
        ``out`` (normalised, times ``sigmoid(lse - sink)`` where ``has_sink``: a sink of ``+inf`` gives 0, ``-inf``
        exactly 1), ``lse`` (natural log, ``+inf`` on empty rows) and ``max_logits``; else the split's unnormalised
        ``acc`` and its ``(m, l)`` in base 2. ``outs``: ``(OUT, LSE, MAXL, out row offsets, lse offsets)``;
        ``parts``: ``(O_PART, ML_PART, part indices)``; the offsets per head, ``[BLOCK_H]``."""
        ROW: gl.constexpr = gl.SliceLayout(1, PV)
        cols = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, PV))
        m_o = gl.convert_layout(m_i, ROW)
        l_o = gl.convert_layout(gl.sum(l_i, 1), ROW)
        if SINGLE:
            OUT, LSE, MAXL, o_row, l_off = outs
            has_keys = l_o > 0.0
            l_use = gl.where(has_keys, l_o, 1.0)
            lse2 = m_o + gl.log2(l_use)
            out = acc / gl.expand_dims(l_use, 1)  # empty rows: acc = 0
            sink = gl.load(sink_ptr, mask=head_ok & has_sink, other=float("-inf")).to(gl.float32)
            f = 1.0 / (1.0 + gl.exp2(sink * 1.4426950408889634 - gl.where(has_keys, lse2, 0.0)))
            out = out * gl.expand_dims(f, 1)
            o_ptr = OUT + gl.expand_dims(o_row, 1) + gl.expand_dims(cols, 0)
            gl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=gl.expand_dims(head_ok, 1))
            gl.store(LSE + l_off, gl.where(has_keys, lse2 * 0.6931471805599453, float("inf")), mask=head_ok)
            gl.store(MAXL + l_off, m_o * 0.6931471805599453, mask=head_ok)
        else:
            O_PART, ML_PART, part = parts
            o_ptr = O_PART + gl.expand_dims(part * acc.shape[1], 1) + gl.expand_dims(cols, 0)
            gl.store(o_ptr, acc, mask=gl.expand_dims(head_ok, 1))
            gl.store(ML_PART + part * 2, m_o, mask=head_ok)
            gl.store(ML_PART + part * 2 + 1, l_o, mask=head_ok)

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
        dtype: gl.constexpr = Q.dtype.element_ty
        SH_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_V], dtype)
        SH_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], dtype)
        SH_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)

        # head blocks vary fastest: the programs that gather the same keys run together and share them in L2
        pid_h, r, split = gl.program_id(0), gl.program_id(1), gl.program_id(2)
        r64 = r.to(gl.int64)
        n_main, lo, hi = _row_tiles(LENS, r, K, split, tiles_per_split, HAS_LENS, BLOCK_N)
        idx = IDX + r64 * stride_ir

        # -- shared memory: q, one bf16 key tile, P, two tiles of e4m3 bytes in flight (216 KB) ----------------------
        q_v = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], SH_V)
        q_r = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], SH_R)
        k_v = gl.allocate_shared_memory(dtype, [BLOCK_N, D_V], SH_V)
        k_r = gl.allocate_shared_memory(dtype, [BLOCK_N, D_ROPE], SH_R)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], SH_P)
        e4m3 = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, 4, D_V // 4], SH_RAW)

        # -- copy groups: this program's heads (rows past H_q zeros), then the e4m3 bytes of tiles lo and lo + 1 ------
        _copy_rows(q_v, q_r, Q + r64 * stride_qr, pid_h * BLOCK_H, H_Q, 1, stride_qh, 0, (LOAD_V, LOAD_R))
        async_copy.commit_group()
        s0 = _slots(idx, lo, n_main, n_rows, lo < hi, ROW, BLOCK_N)
        s1 = _slots(idx, lo + 1, n_main, n_rows, lo + 1 < hi, ROW, BLOCK_N)
        _copy_e4m3(e4m3.index(0), KV, s0)
        async_copy.commit_group()
        _copy_e4m3(e4m3.index(1), KV, s1)
        async_copy.commit_group()
        # registers a tile ahead: the next tile's scales and RoPE values; slots up to three tiles ahead
        scale = _load_scales(KVF, s0)  # s0 is in ROW, the row slice of SCALE
        rope = _load_rope(KVB, _slots(idx, lo, n_main, n_rows, lo < hi, ROPE_ROW, BLOCK_N))
        r1 = _slots(idx, lo + 1, n_main, n_rows, lo + 1 < hi, ROPE_ROW, BLOCK_N)
        s2 = _slots(idx, lo + 2, n_main, n_rows, lo + 2 < hi, ROW, BLOCK_N)

        m_i, l_i, acc, zero_qk = _empty_state(BLOCK_H, BLOCK_N, D_V)
        for tile in range(lo, hi):
            buf = (tile - lo) % 2
            async_copy.wait_group(1)  # this tile's bytes (and q) are in; the next tile's may still be in flight
            _barrier()  # every thread's copies are in; every warpgroup is done with the key tile and P
            # -- dequantize this tile into the bf16 key tile: e4m3 * scale in fp32, rounded to q's dtype -------------
            k_v.store(_dequantize(e4m3.index(buf).load(RAW), scale, dtype))
            k_r.store(rope.to(dtype))
            fence_async_shared()
            _barrier()  # the key tile is whole; this tile's bytes are read
            # -- tile + 2's bytes into the buffer just read; the next tile's scales and RoPE values into registers ---
            _copy_e4m3(e4m3.index(buf), KV, s2)
            async_copy.commit_group()
            scale = _load_scales(KVF, s1)
            rope = _load_rope(KVB, r1)
            r1 = _slots(idx, tile + 2, n_main, n_rows, tile + 2 < hi, ROPE_ROW, BLOCK_N)
            s1 = s2
            s2 = _slots(idx, tile + 3, n_main, n_rows, tile + 3 < hi, ROW, BLOCK_N)
            used = _slots(idx, tile, n_main, n_rows, True, gl.SliceLayout(0, QK), BLOCK_N) >= 0
            m_i, l_i, acc = _attend(q_v, q_r, k_v, k_r, used, qk_scale, m_i, l_i, acc, p_smem, zero_qk)
        async_copy.wait_group(0)

        # -- epilogue: as the readable kernel's _finish ---------------------------------------------------------------
        heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, PV))
        outs = (OUT, LSE, MAXL, r64 * stride_or + heads * stride_oh, r64 * stride_lr + heads)
        parts = (O_PART, ML_PART, (r64 * H_Q + heads) * num_splits + split)
        _finish(acc, m_i, l_i, heads < H_Q, SINK + heads, HAS_SINK, outs, parts, SINGLE)

    # -- keys already in q's dtype (the prefill's kv [N, 1, 576], FlashMLA's flash_mla_sparse_fwd): no bytes to convert

    @gluon.jit
    def _gather(dst, KV, stride_kn, slots, col0, LOAD: gl.constexpr):
        """Issue the ``cp.async`` gather of columns ``col0 ..`` (as many as ``dst`` holds) of the key rows ``slots``
        names (in the row slice of ``LOAD``, the copy's register layout) into ``dst``: row ``slot`` at ``KV + slot *
        stride_kn``; unused slots (``-1``) zero-filled."""
        cols = col0 + gl.arange(0, dst.shape[1], layout=gl.SliceLayout(0, LOAD))
        row = gl.expand_dims(gl.maximum(slots, 0).to(gl.int64) * stride_kn, 1)
        _async_load(dst, KV + row + gl.expand_dims(cols, 0), mask=gl.expand_dims(slots >= 0, 1))

    @gluon.jit
    def _copy_keys(dst_v, dst_r, KV, stride_kn, slots_v, slots_r):
        """:func:`_gather` of a key tile's latent part ``dst_v [BLOCK_N, 512]`` and RoPE part ``dst_r [BLOCK_N,
        64]`` (the same slots, in the row slices of ``LOAD_V`` and ``LOAD_R``)."""
        _gather(dst_v, KV, stride_kn, slots_v, 0, LOAD_V)
        _gather(dst_r, KV, stride_kn, slots_r, dst_v.shape[1], LOAD_R)

    @gluon.jit
    def sparse_kernel_float(
        Q, stride_qr, stride_qh, KV, stride_kn, n_rows, IDX, stride_ir, LENS, K, SINK, OUT, LSE, MAXL, stride_or,
        stride_oh, stride_lr, O_PART, ML_PART, H_Q, tiles_per_split, num_splits, qk_scale, HAS_LENS: gl.constexpr,
        HAS_SINK: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        SINGLE: gl.constexpr,
    ):  # fmt: skip
        """:func:`sparse_kernel` over keys already in q's dtype (``KV``: rows of ``D_V + D_ROPE`` values,
        ``stride_kn`` apart; one KV head), as the readable kernel's ``FMT = float``: two key tiles in shared memory,
        the next one's gather in flight by ``cp.async`` while this one is multiplied (q 72 KB, two tiles 144 KB,
        ``P`` 8 KB: 224 KB), the slots two tiles ahead in registers. The logits, softmax, ``P @ V`` and epilogue are
        :func:`sparse_kernel`'s."""
        dtype: gl.constexpr = Q.dtype.element_ty
        ROW_V: gl.constexpr = gl.SliceLayout(1, LOAD_V)

        pid_h, r, split = gl.program_id(0), gl.program_id(1), gl.program_id(2)  # head blocks fastest: they share keys
        r64 = r.to(gl.int64)
        n_main, lo, hi = _row_tiles(LENS, r, K, split, tiles_per_split, HAS_LENS, BLOCK_N)
        idx = IDX + r64 * stride_ir

        q_v, q_r, k_v, k_r, p_smem = _two_tiles(dtype, BLOCK_H, BLOCK_N, D_V, D_ROPE)

        # -- copy groups: this program's heads (rows past H_q zeros), then the keys of tiles lo and lo + 1 ------------
        _copy_rows(q_v, q_r, Q + r64 * stride_qr, pid_h * BLOCK_H, H_Q, 1, stride_qh, 0, (LOAD_V, LOAD_R))
        async_copy.commit_group()
        for t in gl.static_range(2):
            sv = _slots(idx, lo + t, n_main, n_rows, lo + t < hi, ROW_V, BLOCK_N)
            sr = _slots(idx, lo + t, n_main, n_rows, lo + t < hi, ROPE_ROW, BLOCK_N)
            _copy_keys(k_v.index(t), k_r.index(t), KV, stride_kn, sv, sr)
            async_copy.commit_group()

        m_i, l_i, acc, zero_qk = _empty_state(BLOCK_H, BLOCK_N, D_V)
        for tile in range(lo, hi):
            buf = (tile - lo) % 2
            # tile + 2's slots now, so that their load is not what its copy waits for
            sv = _slots(idx, tile + 2, n_main, n_rows, tile + 2 < hi, ROW_V, BLOCK_N)
            sr = _slots(idx, tile + 2, n_main, n_rows, tile + 2 < hi, ROPE_ROW, BLOCK_N)
            used = _slots(idx, tile, n_main, n_rows, True, gl.SliceLayout(0, QK), BLOCK_N) >= 0
            async_copy.wait_group(1)  # this tile's keys (and q) are in; the next tile's may still be in flight
            fence_async_shared()
            _barrier()  # every thread's copies are in
            m_i, l_i, acc = _attend(q_v, q_r, k_v.index(buf), k_r.index(buf), used, qk_scale, m_i, l_i, acc, p_smem,
                                    zero_qk)  # fmt: skip
            _barrier()  # both warpgroups are done with this tile's buffer
            _copy_keys(k_v.index(buf), k_r.index(buf), KV, stride_kn, sv, sr)
            async_copy.commit_group()
        async_copy.wait_group(0)

        heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, PV))
        outs = (OUT, LSE, MAXL, r64 * stride_or + heads * stride_oh, r64 * stride_lr + heads)
        parts = (O_PART, ML_PART, (r64 * H_Q + heads) * num_splits + split)
        _finish(acc, m_i, l_i, heads < H_Q, SINK + heads, HAS_SINK, outs, parts, SINGLE)
