"""The split kernels of :mod:`mlaspec.impl.decode` for Hopper, in Gluon (a 16-bit cache, with one or several 64-row
blocks, and vLLM's per-tensor fp8 cache; and at 32 query rows or fewer over that cache, 16 or fewer over a 16-bit
one, the keys as the MMAs' rows, items 4 and 6): the next key tile streams in while this one is used.

Same math and outputs as ``_mla_decode_split_kernel``, and its arguments less ``PRECISION`` and ``FP8`` (read
that one first: it is the readable version); this one is what 64 query rows a program (128 heads, or 16 heads with
3-4 MTP tokens) need to go fast on an H100/H200, written in Triton's lower-level Gluon dialect because the first
two things it does differently cannot be asked of Triton's compiler (triton 3.6):

1. **The next tile in flight during this one's dots, in two buffers.** ``q`` (72 KB) and two 64-key tiles (72 KB
   each) fill 216 of the 227 KB an SM has. Triton's software pipeliner keeps a third tile buffer for a prefetch
   that runs during the asynchronous MMAs (288 KB: does not fit) or, with two, issues the next tile's copy after
   this tile's dots, so nothing overlaps. Here the copy of tile ``j + 1`` is issued at the top of iteration
   ``j``, into the buffer whose last reader (the ``P @ V`` of tile ``j - 1``) has finished, before the wait for
   tile ``j``: two tiles in flight while it waits (since 2026-11-30; issued after that wait, the 16-head decode at
   B1-2 took 1.1-2.4% longer on an H200, the speed log's stop 60). Where the cache's
   pages are one stride of slots apart (vLLM's layout) a whole tile goes as two **tensor-memory (TMA) copies**
   issued by one thread, which signal the buffer's ``mbarrier`` (:func:`cache_descriptors`; FlashMLA's
   ``csrc/sm90/decode`` loads its tiles the same way); a sequence's last, part-filled tile, and every tile of
   any other cache, by ``cp.async``, which zero-fills the slots past a sequence's end as the readable kernel's
   masked loads do. On the H200 the TMA copies (and the row sums below) took the 128-head decode from
   0.73-0.78x to 0.82-0.86x FlashMLA at B64-128 and from 1.07x to 1.19x at B1 64K (``benchmarks/suite.py``): the
   ``cp.async`` copies cost each thread 18 copies and their addresses a tile (75 M instructions against
   FlashMLA's 61 M at B64 8K, Nsight Compute).
2. **Each logit once.** Triton lays the ``[64, 64]`` logits out over both warpgroups by rows (``[8, 1]``), so
   each warpgroup computes all of ``q @ k^T`` -- half the tensor-core work twice. Here the two warpgroups take 32
   keys each (``[4, 2]``), the row max crosses them, and ``P`` goes through 8 KB of shared memory into
   ``P @ V``, where each warpgroup owns 256 of the 512 value columns (FlashMLA's ``csrc/sm90/decode`` splits
   the value columns between its two warpgroups the same way). The row sums are kept per key column
   (``[64, 64]``) and summed once at the end, so the warpgroups meet for the maximum only (as
   :mod:`mlaspec.impl.sparse_sm90`), and a tile every row sees whole skips the mask.
3. And **the page-table read one tile ahead** (a plain Triton loop could do this one): the physical page of tile
   ``j + 2`` is read in iteration ``j``, so the scalar load's latency hides behind a tile's work.

4. **vLLM's per-tensor fp8 cache** (``split_kernel_fp8``; e4m3 bytes ``e4m3(entry / k_scale)``, 576 a token),
   with a producer warpgroup as :mod:`mlaspec.impl.sparse_sm90_producer`'s: 4 more warps load the next tile's bytes
   into registers and convert them, exactly, into the second of two bf16 key tiles while the 8 warps above multiply
   the first (q, two key tiles and ``P``: 224 KB; consumers 192 registers a thread, the producer 120). ``k_scale``
   sits in the logits' scale and the epilogue, as in the readable kernel, so its outputs equal this file's bf16
   kernel's on the cache converted to bf16, bit for bit (``tests/test_impl_decode_sm90.py``). Rows are padded to 64
   (fewer rows take ``split_kernel_fp8_keys``, below). Measured on an H100 (2026-11-27,
   CUDA-graph replays, against the readable kernel's fp8 path): 128 heads 1.5-1.6x faster (B64 8K 768 -> 482 us),
   16 heads 1.2x (B64 8K 296 -> 254 us), with the conversion done by all 8 warps between the MMAs instead 3-8% slower
   than with the producer; still 0.45-0.72x FlashMLA's fp8 decode, which also rounds q and ``P`` to e4m3 and
   multiplies in fp8 (half the tensor-core work; ``docs/backends.md``). The producer, converting a tile while its
   next tile's loads wait behind it, set the pace: 3.8 us a tile a program at 128 heads B64 8K, against 2.7 for the
   bf16 kernel. Since 2026-11-29 (evening) it converts through fp32 (:mod:`mlaspec.impl.fp8`), not through Triton's
   ``cvt.bf16.f16`` (an ``F2F`` a value): 1.05-1.34x faster on an H200 (128 heads B64 8K 493 -> 372 us), about 3 us
   a tile at 16 and 128 heads alike, near this file's bf16 ``split_kernel``, and its consumers bind it
   (``benchmarks/decode_ablation.py --kernel fp8``: both MMAs off 1.37-1.58x faster, the producer's loads off at most
   1.05x). At 32 rows or fewer (:func:`keys_rows`) ``split_kernel_fp8_keys`` runs instead: the same producer beside
   one consumer warpgroup that multiplies with the keys as the MMAs' 64 rows and the 16 or 32 query rows as their
   ``N`` (``S^T = K q^T``, ``O^T += V^T P^T``; the softmax on the logits' transposed register view), so none of its
   MMA work is padding: 1.28-1.33x faster than the padded kernel at 16 heads on an H200 (B1 64K 30.5 -> 23.5 us, B64
   4K 102.1 -> 79.6), 1.15x at 32 rows. There both sides bound it about evenly, and its producer copies the next
   tile's bytes into shared memory by ``cp.async`` (the room 64-row kernels lack) while it converts this one:
   another 1.03-1.06x at B2 128K and B64 (4K-64K), 2.5% slower at B1 64K.

5. **Rows whose key tiles other programs read too** (``split_kernel_lead``: 128 heads are two 64-row blocks, each
   tile read by both programs, the second time from L2): there the tile's arithmetic sets the pace, and
   ``split_kernel``'s two warpgroups, 32 keys each, read all of q twice a tile (N = 32 MMAs, shared-memory bound:
   Nsight Compute on an H100, B64 64K: 41.9 M warpgroup MMA instructions and 343 M shared-memory wavefronts
   against FlashMLA's 23.1 M and 234 M, tensor pipes active 50% of the time against 74%; both read the 4.84 GB
   cache from DRAM once). In ``split_kernel_lead`` a leader warpgroup computes each whole tile's logits (N = 64)
   and softmax and one helper warpgroup multiplies half of ``P @ V`` with the leader's ``P``; the next tile's
   logits go to the tensor cores right behind this tile's ``P @ V``. 23.1 M instructions and 255 M wavefronts,
   tensor pipes 63% active; 128 heads on an H100 (CUDA-graph replays): B64-128 0.76-0.89x -> 0.86-1.02x FlashMLA,
   B1 64K 1.24x -> 1.33x, B2 128K 0.89x -> 1.04x (``benchmarks/suite.py``). What it leaves: the leader's softmax,
   during which only the helper's half of ``P @ V`` can run. One 64-row block (16 heads, or 64 without MTP)
   streams its tiles from memory, and there ``split_kernel``, whose copies lead by a whole tile step, stays 2-7%
   faster (:func:`lead_applies`). Over the fp8 cache the same two warpgroups take their tiles from
   ``split_kernel_fp8``'s producer, a third warpgroup (registers 224 / 160 / 120 a thread): 1.09-1.15x faster than
   ``split_kernel_fp8`` at 128 heads on an H200 from B1 4K up (B64 8K 376 -> 338 us, B1 64K 60.8 -> 54.0;
   ``docs/bench/fp8``), and its outputs are the bf16 lead kernel's on the converted cache, bit for bit.

6. **16 query rows or fewer over a 16-bit cache** (``split_kernel_keys``: 16 heads without MTP): ``split_kernel``'s
   loop run by one warpgroup whose MMAs take the keys as their 64 rows and the query rows as ``N``
   (:func:`_keys_step`, shared with ``split_kernel_fp8_keys``), so none of its MMA work is padding. On an H200
   (2026-11-29, night; CUDA-graph replays) 1.02-1.14x the readable kernel that served these rows before (16 heads
   B1 8K 9.9 -> 8.7 us, B1 64K 28.7 -> 28.1, B64 1K 28.8 -> 27.8, B64 4K 80.1 -> 78.8), where the padded
   ``split_kernel`` was 1.3-8% slower than it.

7. **The e4m3 path** (``split_kernel_e4m3_keys``: q, the keys and ``P`` in e4m3, FlashMLA's fp8 arithmetic,
   :mod:`mlaspec.impl.decode`): the key tile lands by tensor-memory copies as bytes and is the logits' MMA operand as it
   is; an e4m3 MMA takes only K-major operands, so a producer warpgroup writes the tile's values transposed for ``P
   V`` (:func:`_transpose_values`) while the others multiply. 16 query rows a program, or 64 in
   :func:`split_kernel_lead`'s roles (:func:`_lead_e4m3`, :func:`_help_e4m3`: each tile read and transposed once for
   64 rows, not once for 16); the fp8 MMAs' ~14-bit accumulation promoted to fp32 every 64 logit columns (the
   conformance harness's bias check failed coarser promotion) and, at 16 rows, every tile's ``P V``. On an H200
   (2026-11-30) 0.99-1.56x FlashMLA's fp8 kernel at 16 heads; at 128 heads 0.71-1.34x (0.71-0.77x from B1 64K and at
   B64 up, 1.02-1.12x our exact path there), bound by the producer's transpose and the leader's chain of logit
   parts; its verdicts: ``docs/backends.md``, "Our e4m3 path".

Rounding is the readable kernel's: fp32 logits from the MMA, ``P`` rounded to q's dtype for ``P @ V``, fp32
accumulation, the same online softmax in base 2 (the row sum's fp32 additions in another order). The conformance
harness judges both kernels (``MLASPEC_DECODE_KERNEL``, :func:`mlaspec.impl.decode.mla_decode_paged`).
"""

# no `from __future__ import annotations`: triton 3.6's aggregates (_Split) read their fields' types at run time

import functools

import torch

from .fp8 import CONSTRAINTS, E4M3_TO_BF16, PACK, USE_ASM

try:  # Gluon ships with triton >= 3.5; without it the readable kernel runs everywhere
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.core import _aggregate

    # renamed after triton 3.6 (the H200 image's), same arguments: the cp.async copy, the CTA barrier
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # and the tensor-memory copy
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # `_reinterpret` in triton 3.6

    def aggregate(cls):
        """Triton's ``_aggregate`` of ``cls`` (fields: its annotations) with a constructor taking the fields in their
        order, what the warp-specialized kernels' partitions share (:class:`_Split` here; ``sparse_sm90_producer``'s,
        the probes')."""
        names = tuple(cls.__annotations__)

        @gluon.constexpr_function
        def __init__(self, *values):
            for name, value in zip(names, values, strict=True):
                setattr(self, name, value)

        cls.__init__ = __init__
        return _aggregate(cls)
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed triton (a later rename)
    gluon = None

__all__ = [
    "AVAILABLE",
    "BLOCK_M",
    "BLOCK_N",
    "KEYS_WARPS",
    "LEAD_WARPS",
    "NUM_WARPS",
    "cache_descriptors",
    "e4m3_rows",
    "keys_rows",
    "lead_applies",
    "split_kernel",
    "split_kernel_e4m3_keys",
    "split_kernel_fp8",
    "split_kernel_fp8_keys",
    "split_kernel_keys",
    "split_kernel_lead",
]

AVAILABLE = gluon is not None
BLOCK_M, BLOCK_N, NUM_WARPS = 64, 64, 8  # one warpgroup MMA tall; two warpgroups
LEAD_WARPS = 4  # split_kernel_lead's launch: its leader warpgroup (the helper is the one worker partition)
KEYS_WARPS = 4  # the keys kernels' launch: one warpgroup (split_kernel_fp8_keys's consumer; its producer a worker)
D_LATENT = 512  # an entry: 512 latent values, then 64 RoPE values


def cache_descriptors(kv_cache, page_size: int, value_cols: int = D_LATENT):
    """The tensor-memory-copy descriptors of ``kv_cache [pages, page_size, 576]`` (16-bit, or e4m3 for
    :func:`split_kernel_e4m3_keys`) seen as ``[slots, 576]``:
    one for ``[64, value_cols]`` of a tile's latent part (512: the whole part, :func:`split_kernel`; 256: a half,
    :func:`split_kernel_lead`), one for its ``[64, 64]`` RoPE part; ``None`` where the pages are not one stride of
    slots apart (the copies then go by ``cp.async``)."""
    pages, page, width = kv_cache.shape
    if kv_cache.stride(2) != 1 or (pages > 1 and kv_cache.stride(0) != page_size * kv_cache.stride(1)):
        return None
    shape, strides = [pages * page, width], [kv_cache.stride(1), 1]
    return tuple(
        TensorDescriptor(kv_cache, shape, strides, block, layout)
        for block, layout in _tile_layouts(kv_cache.dtype, width, value_cols)
    )


def partial_descriptor(o_part):
    """The tensor-memory-copy descriptor of the split kernel's fp32 partials ``o_part [B, splits, rows, 512]`` seen
    as ``[B * splits * rows, 512]``, in ``[64, 256]`` blocks (a warpgroup's half of a row block), for
    :func:`split_kernel_lead`'s epilogue; ``None`` where a row block would run into the next split's rows (``rows``
    not a multiple of 64) or ``o_part`` is not contiguous (the epilogue then stores from registers)."""
    B, splits, rows, width = o_part.shape
    if rows % BLOCK_M or not o_part.is_contiguous():
        return None
    flat = o_part.view(B * splits * rows, width)
    return TensorDescriptor.from_tensor(flat, [BLOCK_M, width // 2], _partial_layout())


@functools.cache
def _partial_layout():
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_LATENT // 2], gl.float32)


def keys_rows(rows: int) -> int | None:
    """The query rows a program of the keys kernels (:func:`split_kernel_fp8_keys`; :func:`split_kernel_keys` at 16
    rows or fewer) takes for ``rows = S_q * H_q``: 16 or 32, their MMAs' ``N``; ``None`` above 32, where
    :func:`split_kernel_fp8`'s 64-row tile pads at most 31 rows of 64."""
    return 16 if rows <= 16 else 32 if rows <= 32 else None


def e4m3_rows(batch: int, rows: int, key_tiles: int, sms: int) -> int:
    """The query rows a program of :func:`split_kernel_e4m3_keys` takes for ``rows = S_q * H_q`` of ``batch``
    sequences of up to ``key_tiles`` 64-key tiles on ``sms`` SMs: 64 (each key tile read and transposed once for 64
    rows) beyond 16 rows where the 64-row programs' tile steps outnumber the SMs, else 16 (one consumer; at 128 heads
    eight programs read each tile, but spread over more SMs: 1.15-1.5x faster than the 64-row programs of the time at
    B1-4 1K and B1 4K on an H200, 2026-11-30)."""
    return 64 if rows > 16 and batch * -(-rows // 64) * key_tiles > sms else 16


def lead_applies(row_blocks: int) -> bool:
    """Whether a decode of ``row_blocks`` 64-row blocks (over a cache with tensor-memory copies) runs
    :func:`split_kernel_lead`: where each key tile is read by two or more programs (128 heads, or 64 with MTP), so
    all but the first read hit L2 and the tile's arithmetic sets the pace. One block streams every tile from
    memory, and :func:`split_kernel`, whose copies lead by a whole tile step, is 2-7% faster there (H100: 16 heads
    with 4 MTP tokens, B8-64 8K)."""
    return row_blocks > 1


@functools.cache
def _tile_layouts(dtype: torch.dtype, width: int, value_cols: int) -> tuple:
    """``(block, shared layout)`` of a tile's latent (``value_cols`` of it) and RoPE parts, once a dtype: building the
    layouts took 40 of the 71 us a call spent on its descriptors (a shared 2-core host), on every decode's launch
    path."""
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    blocks = ([BLOCK_N, value_cols], [BLOCK_N, width - D_LATENT])
    return tuple((block, gl.NVMMASharedLayout.get_default_for(block, gl_dtype)) for block in blocks)


if AVAILABLE:
    # the copies' register layouts, 16 bytes a thread: rows of 512 over a warp, rows of 64 over a quarter warp
    LOAD_V = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 2], [1, 0]))
    LOAD_R = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))
    # the MMAs' register layouts, two warpgroups: logits [64, 64] as two x 32 keys, the output [64, 512] as two x 256
    # value columns (also the sparse decode's, :mod:`mlaspec.impl.sparse_sm90`)
    QK = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]))
    PV = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]))

    @gluon.jit
    def _copy_part(dst, base, first, limit, div, stride_hi, stride_lo, col0, LOAD: gl.constexpr):
        """Columns ``col0 ..`` of the rows :func:`_copy_rows` names, into ``dst``."""
        r = first + gl.arange(0, dst.shape[0], layout=gl.SliceLayout(1, LOAD))
        off = (r // div).to(gl.int64) * stride_hi + (r % div) * stride_lo
        cols = col0 + gl.arange(0, dst.shape[1], layout=gl.SliceLayout(0, LOAD))
        _async_load(dst, base + gl.expand_dims(off, 1) + gl.expand_dims(cols, 0), mask=gl.expand_dims(r < limit, 1))

    @gluon.jit
    def _copy_rows(dst_v, dst_r, base, first, limit, div, stride_hi, stride_lo, LAYOUTS: gl.constexpr):
        """Issue the copy of entries ``[512 | 64]`` into ``dst_v`` / ``dst_r``: entry ``r`` of ``first, first + 1,
        ..`` at ``base + (r // div) * stride_hi + (r % div) * stride_lo``; entries ``r >= limit`` are zero-filled
        (never read: their slots may hold NaN). ``LAYOUTS``: the two copies' register layouts, ``(LOAD_V, LOAD_R)``
        here (the copying warps' count is in them)."""
        _copy_part(dst_v, base, first, limit, div, stride_hi, stride_lo, 0, LAYOUTS[0])
        _copy_part(dst_r, base, first, limit, div, stride_hi, stride_lo, dst_v.shape[1], LAYOUTS[1])

    @gluon.jit
    def _copy_tile(kv_v, kv_r, KV, page, blk, seq_len, stride_kp, stride_ks, PAGE: gl.constexpr):
        """Key tile ``blk`` (as many entries as ``kv_v`` holds, of physical page ``page``); keys past ``seq_len``
        zero-filled; by the 8 warps of a 64-row kernel, or by one warpgroup."""
        n: gl.constexpr = kv_v.shape[0]
        slot0 = (blk % (PAGE // n)) * n
        limit = slot0 + seq_len - blk * n
        if gl.num_warps() == 4:
            _copy_rows(kv_v, kv_r, KV + page * stride_kp, slot0, limit, PAGE, 0, stride_ks, (LOAD_V4, LOAD_R4))
        else:
            _copy_rows(kv_v, kv_r, KV + page * stride_kp, slot0, limit, PAGE, 0, stride_ks, (LOAD_V, LOAD_R))

    @gluon.jit
    def _issue_tile(kv_v, kv_r, bar, KV, DESC_V, DESC_R, page, blk, seq_len, stride_kp, stride_ks, PAGE: gl.constexpr,
                    TMA: gl.constexpr):  # fmt: skip
        """Start the copy of key tile ``blk`` (of physical page ``page``) into ``kv_v`` / ``kv_r``, as one copy group.
        ``TMA``: a whole tile as two tensor-memory copies (``DESC_V``, ``DESC_R``: the cache as ``[slots, 576]``)
        that signal ``bar``; a sequence's last, partial tile by ``cp.async`` with zero-filled slots (the cache
        holds whatever was there past the end), ``bar`` signalled at once."""
        n: gl.constexpr = kv_v.shape[0]
        if TMA:
            if (blk + 1) * n <= seq_len:
                row = page.to(gl.int32) * PAGE + (blk % (PAGE // n)) * n
                mbarrier.expect(bar, DESC_V.block_type.nbytes + DESC_R.block_type.nbytes)
                _tma_load(DESC_V, [row, 0], bar, kv_v)
                _tma_load(DESC_R, [row, kv_v.shape[1]], bar, kv_r)
            else:
                _copy_tile(kv_v, kv_r, KV, page, blk, seq_len, stride_kp, stride_ks, PAGE)
                mbarrier.arrive(bar)
        else:
            _copy_tile(kv_v, kv_r, KV, page, blk, seq_len, stride_kp, stride_ks, PAGE)
        async_copy.commit_group()

    @gluon.jit
    def _keys_seen(pid_m, seq_len, S_Q, H_Q, CAUSAL, BLOCK_M: gl.constexpr, LOGITS: gl.constexpr):
        """``(n_keys [BLOCK_M], n_seen)``: how many keys each of this program's rows may see (causal: query ``s`` sees
        keys ``j <= s + seq_len - S_q``; in the rows' layout of logits laid out as ``LOGITS``), and how many every row
        sees."""
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOGITS))
        n_keys = gl.zeros([BLOCK_M], gl.int32, gl.SliceLayout(1, LOGITS)) + seq_len
        n_seen = seq_len
        if CAUSAL:  # a constexpr, or (inside a warp-specialized partition) a runtime flag
            n_keys = seq_len - S_Q + 1 + rows // H_Q
            n_seen = seq_len - S_Q + 1
        return n_keys, n_seen

    @gluon.jit
    def _scale_and_mask(qk, blk, qk_scale, seq_len, n_keys, n_seen):
        """Key tile ``blk``'s logits ``qk [BLOCK_M, BLOCK_N]`` times ``qk_scale``; ``-inf`` past ``seq_len`` and past
        each row's ``n_keys`` (a tile every row sees whole skips the mask)."""
        n: gl.constexpr = qk.shape[1]
        if (blk + 1) * n > n_seen:
            keys = blk * n + gl.arange(0, n, layout=gl.SliceLayout(0, qk.type.layout))
            allowed = gl.expand_dims(keys < seq_len, 0) & (gl.expand_dims(keys, 0) < gl.expand_dims(n_keys, 1))
            return gl.where(allowed, qk * qk_scale, float("-inf"))
        return qk * qk_scale

    @gluon.jit
    def _write(acc, m_i, l_i, k_scale, pid_m, split, b, S_Q, H_Q, num_splits, outs, SINGLE: gl.constexpr):
        """The epilogue of the two warpgroups' ``acc [64, 512]``: :func:`_write_rows` with the row sums kept per key
        column (``l_i [64, 64]``) summed once."""
        ROW_PV: gl.constexpr = gl.SliceLayout(1, PV)
        m_o, l_o = gl.convert_layout(m_i, ROW_PV), gl.convert_layout(gl.sum(l_i, 1), ROW_PV)
        _write_rows(acc, m_o, l_o, k_scale, pid_m, split, b, S_Q, H_Q, num_splits, outs, 0, acc.shape[1], True, SINGLE)

    @gluon.jit
    def _write_rows(acc, m_o, l_o, k_scale, pid_m, split, b, S_Q, H_Q, num_splits, outs, col0, WIDTH: gl.constexpr,
                    WITH_LSE: gl.constexpr, SINGLE: gl.constexpr):  # fmt: skip
        """The epilogue, as the readable kernel's, of value columns ``col0 ..`` (of ``WIDTH``) of rows ``pid_m * 64
        ..`` (``acc``, in its MMA's layout; ``m_o``, ``l_o``: the rows' final base-2 max and row sums, in its row
        layout):
        ``SINGLE`` (one split) the output in q's dtype and (``WITH_LSE``) the natural-log LSE, else the split's
        normalised fp32 partial and base-2 LSE. ``outs``: ``(OUT, LSE, O_PART, LSE_PART, stride_ob, stride_os,
        stride_oh, stride_lb, stride_lh, stride_ls)``."""
        OUT, LSE, O_PART, LSE_PART, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls = outs
        LAYOUT: gl.constexpr = acc.type.layout
        R = S_Q * H_Q
        out, lse2 = _normalised(acc, m_o, l_o, k_scale)
        rows_o = pid_m * acc.shape[0] + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, LAYOUT))
        row_ok = rows_o < R
        cols_o = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, LAYOUT))
        if SINGLE:
            s, h = rows_o // H_Q, rows_o % H_Q
            o_row = b.to(gl.int64) * stride_ob + s * stride_os + h * stride_oh
            gl.store(
                OUT + gl.expand_dims(o_row, 1) + gl.expand_dims(cols_o, 0),
                out.to(OUT.dtype.element_ty),
                mask=gl.expand_dims(row_ok, 1),
            )
            if WITH_LSE:
                gl.store(LSE + b * stride_lb + h * stride_lh + s * stride_ls, lse2 * 0.6931471805599453, mask=row_ok)
        else:
            part = (b * num_splits + split).to(gl.int64) * R + rows_o
            gl.store(
                O_PART + gl.expand_dims(part * WIDTH, 1) + gl.expand_dims(cols_o, 0),
                out,
                mask=gl.expand_dims(row_ok, 1),
            )
            if WITH_LSE:
                gl.store(LSE_PART + part, lse2, mask=row_ok)

    @gluon.jit
    def _normalised(acc, m_o, l_o, k_scale):
        """``acc`` over its row sums ``l_o`` (times the cache's ``k_scale``), and the rows' base-2 LSEs (``m_o``: their
        maxima); rows that saw no key: zeros and ``-inf``."""
        has_keys = l_o > 0.0
        l_use = gl.where(has_keys, l_o, 1.0)
        return acc * gl.expand_dims(k_scale / l_use, 1), gl.where(has_keys, m_o + gl.log2(l_use), float("-inf"))

    @gluon.jit
    def _as_fp32(buf, M: gl.constexpr, N: gl.constexpr):
        """The bytes of shared-memory buffer ``buf`` as an fp32 ``[M, N]`` buffer in the default swizzle (as
        :func:`partial_descriptor`'s)."""
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, N], gl.float32)
        if _REINTERPRET:
            return buf.reinterpret(gl.float32, [M, N], layout)
        else:
            return buf._reinterpret(gl.float32, [M, N], layout)

    @gluon.jit
    def _store_partial(acc, m_o, l_o, p, DESC_O, stage, col0, WITH_LSE: gl.constexpr):
        """:func:`_write_rows` of a split's partial, value columns ``col0 ..`` of ``acc [64, 256]``, as one
        tensor-memory copy through ``DESC_O`` (:func:`partial_descriptor`) from ``stage`` (64 KB of shared memory
        this warpgroup has done with): whole lines, where a store from the MMA's registers writes a row's 32 bytes at
        a time. Unmasked: the rows must be a multiple of 64 (as :func:`partial_descriptor` makes sure), else a block
        would overwrite the next split's first rows."""
        out, lse2 = _normalised(acc, m_o, l_o, p.k_scale)
        row0 = (p.b * p.num_splits + p.split) * (p.S_Q * p.H_Q) + p.pid_m * acc.shape[0]
        if WITH_LSE:
            gl.store(p.LSE_PART + row0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, acc.type.layout)), lse2)
        stage.store(out)
        fence_async_shared()
        _barrier()
        _tma_store(DESC_O, [row0, col0], stage)
        tma.store_wait(0)

    @gluon.jit
    def _softmax_step(qk, m_i):
        """One online-softmax step over base-2 logits ``qk [64, keys]`` (rows with nothing yet keep ``m = -inf``):
        ``(p, alpha, m_new)``, ``alpha`` rescaling what the rows had."""
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(qk - gl.expand_dims(m_use, 1))
        return p, alpha, m_new

    @gluon.jit
    def _p_times_v(p, alpha, acc, p_smem, v):
        """``acc * alpha + P @ v``: ``P`` rounded to ``p_smem``'s dtype through it, each warpgroup its 256 columns."""
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        _barrier()
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, PV)), 1)
        acc = warpgroup_mma(p_smem, v, acc, is_async=True)
        return warpgroup_mma_wait(0, deps=(acc,))

    @gluon.jit
    def _two_tiles(dtype: gl.constexpr, M: gl.constexpr, N: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr,
                   TILES: gl.constexpr = 2):  # fmt: skip
        """Shared memory of a program that multiplies ``M`` query rows with one key tile while the next streams in:
        ``(q_v [M, D_V], q_r [M, D_ROPE], k_v [TILES, N, D_V], k_r [TILES, N, D_ROPE], p [M, N])`` in ``dtype``, each
        in the MMAs' default swizzle (224 KB at 64 x 64 over 512 + 64 bf16, two tiles)."""
        SH_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, D_V], dtype)
        SH_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, D_ROPE], dtype)
        SH_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, N], dtype)
        return (
            gl.allocate_shared_memory(dtype, [M, D_V], SH_V),
            gl.allocate_shared_memory(dtype, [M, D_ROPE], SH_R),
            gl.allocate_shared_memory(dtype, [TILES, N, D_V], SH_V),
            gl.allocate_shared_memory(dtype, [TILES, N, D_ROPE], SH_R),
            gl.allocate_shared_memory(dtype, [M, N], SH_P),
        )

    @gluon.jit
    def _tile_barriers(TMA: gl.constexpr):
        """The two key tiles' mbarriers (a buffer's copy is in), initialised where tiles arrive by tensor-memory
        copies."""
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        if TMA:
            mbarrier.init(bars.index(0), count=1)
            mbarrier.init(bars.index(1), count=1)
            fence_async_shared()
        return bars

    @gluon.jit
    def _split_start(SEQ_LENS, bt, b, split, blocks_per_split, num_splits, BLOCK_N: gl.constexpr, PAGE: gl.constexpr):
        """``(seq_len, blk_lo, blk_hi, page_lo, page_next)``: split ``split``'s key tiles ``[blk_lo, blk_hi)`` of
        sequence ``b`` (``bt``: its block-table row) and the physical pages of its first two tiles, read beside the
        sequence's length, which ``blk_hi`` needs: one round trip before the first tile's copy, not two. The first
        tile's entry is in the table whatever the length (``mla_decode_paged`` caps the splits' tiles at the table's
        width), and so is the second's but in the last split, which reads it once the length is known."""
        SUB: gl.constexpr = PAGE // BLOCK_N
        blk_lo = split * blocks_per_split
        seq_len = gl.load(SEQ_LENS + b)
        page_lo = gl.load(bt + blk_lo // SUB)
        page_next = gl.load(bt + (blk_lo + 1) // SUB, mask=(blocks_per_split > 1) & (split + 1 < num_splits), other=0)
        blk_hi = gl.minimum(blk_lo + blocks_per_split, gl.cdiv(seq_len, BLOCK_N))
        if split + 1 == num_splits:
            page_next = gl.load(bt + (blk_lo + 1) // SUB, mask=blk_lo + 1 < blk_hi, other=0)
        return seq_len, blk_lo, blk_hi, page_lo.to(gl.int64), page_next.to(gl.int64)

    @gluon.jit
    def _first_tile(kv_v, kv_r, bars, KV, DESC_V, DESC_R, page, blk_lo, blk_hi, seq_len, stride_kp, stride_ks,
                    PAGE: gl.constexpr, TMA: gl.constexpr):  # fmt: skip
        """Issue the split's first key tile (of physical page ``page``) into buffer 0."""
        if blk_lo < blk_hi:
            _issue_tile(kv_v.index(0), kv_r.index(0), bars.index(0), KV, DESC_V, DESC_R, page, blk_lo, seq_len,
                        stride_kp, stride_ks, PAGE, TMA)  # fmt: skip

    @gluon.jit
    def _next_tile(kv_v, kv_r, bars, KV, DESC_V, DESC_R, bt, blk, blk_lo, blk_hi, next_page, seq_len, stride_kp,
                   stride_ks, PAGE: gl.constexpr, TMA: gl.constexpr):  # fmt: skip
        """The top of tile ``blk``'s iteration: issue tile ``blk + 1`` (of page ``next_page``) into the other buffer,
        whose tile ``blk - 1`` every warpgroup is done with, then wait for tile ``blk`` (issued an iteration earlier):
        two tiles in flight during the wait, one during this tile's work. ``(buf, the page of tile blk + 2)``,
        ``buf`` the buffer holding tile ``blk``."""
        SUB: gl.constexpr = PAGE // kv_v.shape[1]
        buf = (blk - blk_lo) % 2
        _barrier()  # every warpgroup is done with the other buffer (tile blk - 1) and P
        if blk + 1 < blk_hi:
            _issue_tile(kv_v.index(1 - buf), kv_r.index(1 - buf), bars.index(1 - buf), KV, DESC_V, DESC_R, next_page,
                        blk + 1, seq_len, stride_kp, stride_ks, PAGE, TMA)  # fmt: skip
        else:
            async_copy.commit_group()  # (empty: so this tile's group is always the one before the newest)
        after = gl.load(bt + (blk + 2) // SUB, mask=blk + 2 < blk_hi, other=0).to(gl.int64)
        async_copy.wait_group(1)  # this tile (and q); tile blk + 1 stays in flight
        if TMA:
            mbarrier.wait(bars.index(buf), ((blk - blk_lo) // 2) & 1)
        fence_async_shared()
        _barrier()  # every thread's part of the tile is in
        return buf, after

    @gluon.jit
    def split_kernel(
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
        DESC_V,
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
        ROW_QK: gl.constexpr = gl.SliceLayout(1, QK)

        pid_m, split, b = gl.program_id(0), gl.program_id(1), gl.program_id(2)
        R = S_Q * H_Q
        bt = BLOCK_TABLE + b * stride_btb
        seq_len, blk_lo, blk_hi, page_lo, next_page = _split_start(SEQ_LENS, bt, b, split, blocks_per_split,
                                                                   num_splits, BLOCK_N, PAGE)  # fmt: skip

        q_v, q_r, kv_v, kv_r, p_smem = _two_tiles(dtype, BLOCK_M, BLOCK_N, D_V, D_ROPE)  # 224 KB
        bars = _tile_barriers(TMA)

        # -- copy groups 0 and 1: the query block (rows (s, h) in q's order; rows past R are zeros), the first tile ---
        q_b = Q + b.to(gl.int64) * stride_qb
        _copy_rows(q_v, q_r, q_b, pid_m * BLOCK_M, R, H_Q, stride_qs, stride_qh, (LOAD_V, LOAD_R))
        async_copy.commit_group()
        _first_tile(kv_v, kv_r, bars, KV, DESC_V, DESC_R, page_lo, blk_lo, blk_hi, seq_len, stride_kp, stride_ks, PAGE,
                    TMA)  # fmt: skip

        n_keys, n_seen = _keys_seen(pid_m, seq_len, S_Q, H_Q, CAUSAL, BLOCK_M, QK)

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_QK)
        l_i = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, QK)  # row sums per key column: summed once at the end
        acc = gl.zeros([BLOCK_M, D_V], gl.float32, PV)
        zero_qk = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, QK)
        for blk in range(blk_lo, blk_hi):
            buf, next_page = _next_tile(kv_v, kv_r, bars, KV, DESC_V, DESC_R, bt, blk, blk_lo, blk_hi, next_page,
                                        seq_len, stride_kp, stride_ks, PAGE, TMA)  # fmt: skip

            # -- logits in base 2, fp32: each warpgroup 32 of the 64 keys -------------------------------------------
            k_v = kv_v.index(buf)
            qk = warpgroup_mma(q_v, k_v.permute((1, 0)), zero_qk, use_acc=False, is_async=True)
            qk = warpgroup_mma(q_r, kv_r.index(buf).permute((1, 0)), qk, is_async=True)
            qk = warpgroup_mma_wait(0, deps=(qk,))
            qk = _scale_and_mask(qk, blk, qk_scale, seq_len, n_keys, n_seen)

            # -- online softmax, then P @ V (P rounded to q's dtype) ------------------------------------------------
            p, alpha, m_i_new = _softmax_step(qk, m_i)
            l_i = l_i * gl.expand_dims(alpha, 1) + p  # no barrier a tile for the row sums
            m_i = m_i_new
            acc = _p_times_v(p, alpha, acc, p_smem, k_v)
        async_copy.wait_group(0)
        outs = (OUT, LSE, O_PART, LSE_PART, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls)
        _write(acc, m_i, l_i, k_scale, pid_m, split, b, S_Q, H_Q, num_splits, outs, SINGLE)

    @gluon.jit
    def _keys_state(pid_m, seq_len, S_Q, H_Q, CAUSAL, R: gl.constexpr, N: gl.constexpr, D: gl.constexpr,
                    K: gl.constexpr):  # fmt: skip
        """What a keys kernel's warpgroup starts its ``R`` query rows with, in its MMAs' layout (the keys as their 64
        rows, the rows as ``N``): ``(zero_t [N, R]`` (not read: the logits' register shape), ``n_keys, n_seen``
        (:func:`_keys_seen`), ``m_i [R]``, ``l_i [R, N]`` (row sums kept per key column), ``acc_t [D, R])``; ``m_i``
        and ``l_i`` in the logits' transposed view. ``K``: the MMA instruction's depth, 16 (16-bit) or 32 (e4m3)."""
        KEYS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R, K])
        zero_t = gl.zeros([N, R], gl.float32, KEYS)
        LOGITS: gl.constexpr = gl.permute(zero_t, (1, 0)).type.layout  # [R, N]: rows, then keys (no data moved)
        n_keys, n_seen = _keys_seen(pid_m, seq_len, S_Q, H_Q, CAUSAL, R, LOGITS)
        m_i = gl.full([R], float("-inf"), gl.float32, gl.SliceLayout(1, LOGITS))
        return zero_t, n_keys, n_seen, m_i, gl.zeros([R, N], gl.float32, LOGITS), gl.zeros([D, R], gl.float32, KEYS)

    @gluon.jit
    def _write_keys(acc_t, m_i, l_i, k_scale, pid_m, split, b, S_Q, H_Q, num_splits, outs, SINGLE: gl.constexpr):
        """A keys kernel's epilogue: :func:`_write_rows` of ``O^T`` (``acc_t [D, R]``) viewed back as ``[R, D]``, the
        row sums (``l_i [R, N]``) summed once."""
        acc = gl.permute(acc_t, (1, 0))
        ROW: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        m_o, l_o = gl.convert_layout(m_i, ROW), gl.convert_layout(gl.sum(l_i, 1), ROW)
        _write_rows(acc, m_o, l_o, k_scale, pid_m, split, b, S_Q, H_Q, num_splits, outs, 0, acc.shape[1], True, SINGLE)

    @gluon.jit
    def _keys_step(k_v, k_r, q_v, q_r, p_smem, zero_t, blk, qk_scale, seq_len, n_keys, n_seen, m_i, l_i, acc_t):
        """One key tile with the keys as the MMAs' rows (``k_v [64, 512]``, ``k_r [64, 64]``; the query rows ``R`` the
        MMAs' ``N``): the logits transposed, ``S^T [64, R] = K q^T``; the online softmax on their transposed register
        view (a row's maximum crosses the warpgroup's warps); ``O^T [512, R] += V^T P^T``, ``P`` rounded to q's dtype
        through ``p_smem`` and viewed transposed, ``V^T`` the tile viewed transposed. ``(m_i, l_i, acc_t)`` after it."""
        s_t = warpgroup_mma(k_v, q_v.permute((1, 0)), zero_t, use_acc=False, is_async=True)
        s_t = warpgroup_mma(k_r, q_r.permute((1, 0)), s_t, is_async=True)
        s_t = warpgroup_mma_wait(0, deps=(s_t,))
        s = _scale_and_mask(gl.permute(s_t, (1, 0)), blk, qk_scale, seq_len, n_keys, n_seen)
        prob, alpha, m_new = _softmax_step(s, m_i)
        l_i = l_i * gl.expand_dims(alpha, 1) + prob
        p_smem.store(prob.to(p_smem.dtype))  # P [R, 64]; the MMA reads it as P^T
        fence_async_shared()
        _barrier()
        acc_t = acc_t * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, acc_t.type.layout)), 0)
        acc_t = warpgroup_mma(k_v.permute((1, 0)), p_smem.permute((1, 0)), acc_t, is_async=True)
        return m_new, l_i, warpgroup_mma_wait(0, deps=(acc_t,))

    # -- 16 query rows or fewer over a 16-bit cache: the keys as the MMAs' rows, one warpgroup ------------------------
    @gluon.jit
    def split_kernel_keys(
        Q, KV, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kp, stride_ks,
        stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale, k_scale, S_Q, H_Q,
        blocks_per_split, num_splits, DESC_V, DESC_R, CAUSAL: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr,
        PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SINGLE: gl.constexpr, TMA: gl.constexpr,
    ):  # fmt: skip
        """:func:`split_kernel` for ``BLOCK_M`` = 16 query rows a program (launch with ``KEYS_WARPS``): its loop (the
        next tile issued into the other of two buffers at the top of each iteration, before the wait for this one)
        run by one warpgroup whose MMAs take the keys as their 64 rows and the query rows as ``N``, as
        :func:`split_kernel_fp8_keys`'s consumer: ``S^T = K q^T``, the softmax on the transposed register view, ``O^T
        += V^T P^T`` (q, two tiles and ``P``: 164 KB; three value buffers, the next two tiles' values in flight during
        this one's MMAs, were 3-7% slower on an H200, the speed log's stop 62). Its combine may launch at once
        (``launch_pdl``: the combine's one-warp programs wait beside this kernel's, at their ``griddepcontrol.wait``,
        for its partials)."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)  # fmt: skip
        dtype: gl.constexpr = Q.dtype.element_ty
        pid_m, split, b = gl.program_id(0), gl.program_id(1), gl.program_id(2)
        bt = BLOCK_TABLE + b * stride_btb
        seq_len, blk_lo, blk_hi, page_lo, next_page = _split_start(SEQ_LENS, bt, b, split, blocks_per_split,
                                                                   num_splits, BLOCK_N, PAGE)  # fmt: skip
        q_v, q_r, kv_v, kv_r, p_smem = _two_tiles(dtype, BLOCK_M, BLOCK_N, D_V, D_ROPE)
        bars = _tile_barriers(TMA)
        q_b = Q + b.to(gl.int64) * stride_qb
        _copy_rows(q_v, q_r, q_b, pid_m * BLOCK_M, S_Q * H_Q, H_Q, stride_qs, stride_qh, (LOAD_V4, LOAD_R4))
        async_copy.commit_group()
        _first_tile(kv_v, kv_r, bars, KV, DESC_V, DESC_R, page_lo, blk_lo, blk_hi, seq_len, stride_kp, stride_ks, PAGE,
                    TMA)  # fmt: skip

        zero_t, n_keys, n_seen, m_i, l_i, acc_t = _keys_state(pid_m, seq_len, S_Q, H_Q, CAUSAL, BLOCK_M, BLOCK_N, D_V,
                                                              16)  # fmt: skip
        for blk in range(blk_lo, blk_hi):
            buf, next_page = _next_tile(kv_v, kv_r, bars, KV, DESC_V, DESC_R, bt, blk, blk_lo, blk_hi, next_page,
                                        seq_len, stride_kp, stride_ks, PAGE, TMA)  # fmt: skip
            m_i, l_i, acc_t = _keys_step(kv_v.index(buf), kv_r.index(buf), q_v, q_r, p_smem, zero_t, blk, qk_scale,
                                         seq_len, n_keys, n_seen, m_i, l_i, acc_t)  # fmt: skip
        async_copy.wait_group(0)
        outs = (OUT, LSE, O_PART, LSE_PART, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls)
        _write_keys(acc_t, m_i, l_i, k_scale, pid_m, split, b, S_Q, H_Q, num_splits, outs, SINGLE)

    # -- the fp8 decode with a producer warpgroup -----------------------------------------------------------------
    FP8_PRODUCER_REGS = gl.constexpr(120)
    # the producer's layouts (4 warps): a tile's 512 value bytes as [64, 4, 128] four keys a warp, 16 a thread (each
    # 16-byte store of the converted bf16 tile then meets all 8 bank slots of its 128-byte-swizzled row, as in
    # mlaspec.impl.sparse_sm90), its 64 RoPE bytes as [64, 64] a quarter warp a key
    PRAW = gl.constexpr(gl.BlockedLayout([1, 1, 16], [4, 1, 8], [4, 1, 1], [2, 1, 0]))
    PRAW_R = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
    READY = gl.constexpr(0)  # [2]: key tile b holds its tile
    FREE = gl.constexpr(2)  # [2]: the consumers (split_kernel_lead's leader) are done with key tile b
    FREE_HELP = gl.constexpr(4)  # [2]: split_kernel_lead's helper is done with key tile b (its fp8 cache only)
    ROWS = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # [3, 64] fp32 per-row values (.index: rank 1)
    # the staged bytes (split_kernel_fp8_keys), unswizzled: a warp's 16-byte reads in PRAW's order meet each bank
    # slot once a 128-byte wavefront
    RAW_SHARED = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    RAW_SHARED_R = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))

    @aggregate
    class _Split:  # what a warp-specialized kernel's partitions share: the split, its outputs, its shared memory
        Q: gl.tensor  # this sequence's q
        KV: gl.tensor
        bt: gl.tensor  # this sequence's block-table row
        seq_len: gl.tensor
        blk_lo: gl.tensor
        blk_hi: gl.tensor
        pid_m: gl.tensor
        split: gl.tensor
        b: gl.tensor
        S_Q: gl.tensor
        H_Q: gl.tensor
        stride_qs: gl.tensor
        stride_qh: gl.tensor
        stride_kp: gl.tensor
        stride_ks: gl.tensor
        page: gl.tensor  # slots a page
        causal: gl.tensor
        qk_scale: gl.tensor
        k_scale: gl.tensor
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
        q_r: gl.shared_memory_descriptor
        k_v: gl.shared_memory_descriptor  # [2, 64, 512]
        k_r: gl.shared_memory_descriptor  # [2, 64, 64]
        p_smem: gl.shared_memory_descriptor
        rows: gl.shared_memory_descriptor  # [3, 64] fp32 (split_kernel_lead): alpha, then the final max and row sums
        bars: gl.shared_memory_descriptor

    @gluon.jit
    def _byte_addresses(KV, page, blk, seq_len, stride_kp, stride_ks, PAGE, n: gl.constexpr, ROPE: gl.constexpr):
        """Where key tile ``blk``'s e4m3 bytes (of physical page ``page``) are, in the producer's layouts, with their
        mask (the slots before ``seq_len``): its values ``[n, 4, 128]`` (``PRAW``), or (``ROPE``) its RoPE part ``[n,
        64]`` (``PRAW_R``)."""
        slot0 = (blk % (PAGE // n)) * n
        limit = slot0 + seq_len - blk * n
        base = KV + page * stride_kp
        if ROPE:
            rr = slot0 + gl.arange(0, n, layout=gl.SliceLayout(1, PRAW_R))
            cr = 512 + gl.arange(0, 64, layout=gl.SliceLayout(0, PRAW_R))
            return base + gl.expand_dims(rr.to(gl.int64) * stride_ks, 1) + gl.expand_dims(cr, 0), gl.expand_dims(
                rr < limit, 1
            )
        else:
            r = slot0 + gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, PRAW)))
            g = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, PRAW)))
            c = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, PRAW)))
            row = gl.expand_dims(r.to(gl.int64) * stride_ks, 1) + gl.expand_dims(g * 128, 0)
            ptrs = base + gl.expand_dims(row, 2) + gl.expand_dims(gl.expand_dims(c, 0), 1)
            return ptrs, gl.expand_dims(gl.expand_dims(r < limit, 1), 2)

    @gluon.jit
    def _load_bytes(KV, page, blk, seq_len, stride_kp, stride_ks, PAGE, n: gl.constexpr):
        """Key tile ``blk``'s e4m3 bytes (of physical page ``page``) into the producer's registers: values ``[n, 4,
        128]``, RoPE ``[n, 64]``; 0 past ``seq_len``. (Its addresses are :func:`_byte_addresses`', computed here in
        the order of the loads: as two calls, split_kernel_fp8's producer spills two more stores, triton 3.6.)"""
        slot0 = (blk % (PAGE // n)) * n
        limit = slot0 + seq_len - blk * n
        base = KV + page * stride_kp
        r = slot0 + gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, PRAW)))
        g = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, PRAW)))
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, PRAW)))
        row = gl.expand_dims(r.to(gl.int64) * stride_ks, 1) + gl.expand_dims(g * 128, 0)
        raw = gl.load(base + gl.expand_dims(row, 2) + gl.expand_dims(gl.expand_dims(c, 0), 1),
                      mask=gl.expand_dims(gl.expand_dims(r < limit, 1), 2), other=0)  # fmt: skip
        rr = slot0 + gl.arange(0, n, layout=gl.SliceLayout(1, PRAW_R))
        cr = 512 + gl.arange(0, 64, layout=gl.SliceLayout(0, PRAW_R))
        rope = gl.load(base + gl.expand_dims(rr.to(gl.int64) * stride_ks, 1) + gl.expand_dims(cr, 0),
                       mask=gl.expand_dims(rr < limit, 1), other=0)  # fmt: skip
        return raw, rope

    @gluon.jit
    def _copy_bytes(raw_v, raw_r, KV, page, blk, seq_len, stride_kp, stride_ks, PAGE):
        """Issue the copy (``cp.async``, one group) of key tile ``blk``'s e4m3 bytes into ``raw_v [n, 4, 128]`` /
        ``raw_r [n, 64]``, zero-filled past ``seq_len``: each producer thread copies the bytes it later reads."""
        n: gl.constexpr = raw_v.shape[0]
        ptrs, mask = _byte_addresses(KV, page, blk, seq_len, stride_kp, stride_ks, PAGE, n, False)
        _async_load(raw_v, ptrs, mask=mask)
        ptrs, mask = _byte_addresses(KV, page, blk, seq_len, stride_kp, stride_ks, PAGE, n, True)
        _async_load(raw_r, ptrs, mask=mask)
        async_copy.commit_group()

    @gluon.jit
    def _e4m3_to(x, dtype: gl.constexpr):
        """:func:`mlaspec.impl.fp8.e4m3_to` in Gluon: the e4m3 values of bytes ``x`` in ``dtype``."""
        if USE_ASM and dtype == gl.bfloat16:
            return gl.inline_asm_elementwise(E4M3_TO_BF16, CONSTRAINTS, [x], dtype=gl.bfloat16, is_pure=True, pack=PACK)
        else:
            return x.to(gl.float8e4nv, bitcast=True).to(dtype)

    @gluon.jit
    def _produce_fp8(p):
        """Load, convert and hand over the split's tiles, one bf16 key tile of two at a time."""
        n: gl.constexpr = p.k_v.shape[1]
        sub = p.page // n
        page = gl.load(p.bt + p.blk_lo // sub, mask=p.blk_lo < p.blk_hi, other=0).to(gl.int64)
        for i in range(p.blk_hi - p.blk_lo):
            blk = p.blk_lo + i
            raw, rope = _load_bytes(p.KV, page, blk, p.seq_len, p.stride_kp, p.stride_ks, p.page, n)
            page = gl.load(p.bt + (blk + 1) // sub, mask=blk + 1 < p.blk_hi, other=0).to(gl.int64)
            _hand_over(p, raw, rope, i)  # the loads are in flight while the consumers finish with the buffer

    @gluon.jit
    def _produce_fp8_staged(p, raw_v, raw_r):
        """:func:`_produce_fp8` with the bytes staged in shared memory (``raw_v [n, 4, 128]``, ``raw_r [n, 64]``):
        the next tile's bytes are copied by ``cp.async`` while this one is converted and handed over."""
        n: gl.constexpr = p.k_v.shape[1]
        sub = p.page // n
        page = gl.load(p.bt + p.blk_lo // sub, mask=p.blk_lo < p.blk_hi, other=0).to(gl.int64)
        if p.blk_lo < p.blk_hi:
            _copy_bytes(raw_v, raw_r, p.KV, page, p.blk_lo, p.seq_len, p.stride_kp, p.stride_ks, p.page)
        for i in range(p.blk_hi - p.blk_lo):
            blk = p.blk_lo + i
            page = gl.load(p.bt + (blk + 1) // sub, mask=blk + 1 < p.blk_hi, other=0).to(gl.int64)
            async_copy.wait_group(0)  # this thread's copies: each thread reads only the bytes it copied (PRAW)
            raw, rope = raw_v.load(PRAW), raw_r.load(PRAW_R)
            _barrier()  # the producer has read this tile's bytes: the next tile's may land
            if blk + 1 < p.blk_hi:
                _copy_bytes(raw_v, raw_r, p.KV, page, blk + 1, p.seq_len, p.stride_kp, p.stride_ks, p.page)
            _hand_over(p, raw, rope, i)

    @gluon.jit
    def _hand_over(p, raw, rope, i):
        """Tile ``i``'s bytes (``raw [n, 4, 128]``, ``rope [n, 64]``) converted into bf16 key tile ``i % 2`` once the
        consumers are done with the tile it held, then announced to them."""
        n: gl.constexpr = p.k_v.shape[1]
        D: gl.constexpr = p.k_v.shape[2]
        b = i % 2
        mbarrier.wait(p.bars.index(FREE + b), ((i // 2) & 1) ^ 1, pred=i >= 2)
        if p.bars.shape[0] > FREE_HELP:  # split_kernel_lead's barriers: two warpgroups read each tile
            mbarrier.wait(p.bars.index(FREE_HELP + b), ((i // 2) & 1) ^ 1, pred=i >= 2)
        p.k_v.index(b).store(gl.reshape(_e4m3_to(raw, p.q_v.dtype), [n, D]))
        p.k_r.index(b).store(_e4m3_to(rope, p.q_v.dtype))
        fence_async_shared()
        _barrier()
        mbarrier.arrive(p.bars.index(READY + b), count=1)

    @gluon.jit
    def _tile_ready(p, i):
        """The consumers' side of :func:`_hand_over`: wait until the split's tile ``i`` is in its bf16 key tile; that
        tile's index."""
        b = i % 2
        mbarrier.wait(p.bars.index(READY + b), (i // 2) & 1)
        return b

    @gluon.jit
    def _tile_done(p, b):
        """The consumers are done with key tile ``b`` (and ``P``): the producer may refill it."""
        _release(p, FREE + b)

    @gluon.jit
    def _release(p, bar):
        """Arrive on barrier ``bar`` once every thread of this partition got there."""
        _barrier()
        mbarrier.arrive(p.bars.index(bar), count=1)

    @gluon.jit
    def _load_q(p, LAYOUTS: gl.constexpr):
        """Copy this program's query rows into ``p.q_v`` / ``p.q_r`` and wait for them (``LAYOUTS``: the copying
        partition's, as :func:`_copy_rows` takes them)."""
        R: gl.constexpr = p.q_v.shape[0]
        _copy_rows(p.q_v, p.q_r, p.Q, p.pid_m * R, p.S_Q * p.H_Q, p.H_Q, p.stride_qs, p.stride_qh, LAYOUTS)
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        _barrier()

    @gluon.jit
    def _consume_fp8(p, SINGLE: gl.constexpr):
        """:func:`split_kernel`'s tile step on the ready tiles, then its epilogue."""
        M: gl.constexpr = p.q_v.shape[0]
        N: gl.constexpr = p.k_v.shape[1]
        D: gl.constexpr = p.k_v.shape[2]
        _load_q(p, (LOAD_V, LOAD_R))
        n_keys, n_seen = _keys_seen(p.pid_m, p.seq_len, p.S_Q, p.H_Q, p.causal, M, QK)
        m_i = gl.full([M], float("-inf"), gl.float32, gl.SliceLayout(1, QK))
        l_i = gl.zeros([M, N], gl.float32, QK)
        acc = gl.zeros([M, D], gl.float32, PV)
        zero_qk = gl.zeros([M, N], gl.float32, QK)
        for i in range(p.blk_hi - p.blk_lo):
            b = _tile_ready(p, i)
            k_v = p.k_v.index(b)
            qk = warpgroup_mma(p.q_v, k_v.permute((1, 0)), zero_qk, use_acc=False, is_async=True)
            qk = warpgroup_mma(p.q_r, p.k_r.index(b).permute((1, 0)), qk, is_async=True)
            qk = warpgroup_mma_wait(0, deps=(qk,))
            qk = _scale_and_mask(qk, p.blk_lo + i, p.qk_scale, p.seq_len, n_keys, n_seen)
            prob, alpha, m_i_new = _softmax_step(qk, m_i)
            l_i = l_i * gl.expand_dims(alpha, 1) + prob
            m_i = m_i_new
            acc = _p_times_v(prob, alpha, acc, p.p_smem, k_v)
            _tile_done(p, b)
        _write(acc, m_i, l_i, p.k_scale, p.pid_m, p.split, p.b, p.S_Q, p.H_Q, p.num_splits, _outs(p), SINGLE)

    # the consumers, one function a SINGLE: constexprs do not cross warp_specialize in triton 3.6 (they arrive as
    # runtime values); literals written in a partition's body do

    @gluon.jit
    def _consume_fp8_single(p):
        _consume_fp8(p, True)

    @gluon.jit
    def _consume_fp8_split(p):
        _consume_fp8(p, False)

    @gluon.jit
    def _outs(p):
        """A :class:`_Split`'s outputs and their strides, as :func:`_write_rows` takes them."""
        strides = (p.stride_ob, p.stride_os, p.stride_oh, p.stride_lb, p.stride_lh, p.stride_ls)
        return (p.OUT, p.LSE, p.O_PART, p.LSE_PART) + strides

    @gluon.jit
    def _split_state(
        Q, KV, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kp, stride_ks,
        stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale, k_scale, S_Q, H_Q,
        blocks_per_split, num_splits, CAUSAL: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr,
        PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BARRIERS: gl.constexpr,
        TILES: gl.constexpr = 2,
    ):  # fmt: skip
        """This program's :class:`_Split` (a warp-specialized kernel's arguments, as :func:`split_kernel`'s): its
        shared memory (q, two 16-bit key tiles, ``P``, three rows of fp32: 225 KB) and ``BARRIERS`` mbarriers."""
        dtype: gl.constexpr = Q.dtype.element_ty
        pid_m, split, b = gl.program_id(0), gl.program_id(1), gl.program_id(2)
        seq_len = gl.load(SEQ_LENS + b)
        blk_lo = split * blocks_per_split
        blk_hi = gl.maximum(gl.minimum(blk_lo + blocks_per_split, gl.cdiv(seq_len, BLOCK_N)), blk_lo)
        bars = gl.allocate_shared_memory(gl.int64, [BARRIERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(BARRIERS):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        q_v, q_r, k_v, k_r, p_smem = _two_tiles(dtype, BLOCK_M, BLOCK_N, D_V, D_ROPE, TILES)
        return _Split(
            Q + b.to(gl.int64) * stride_qb,
            KV,
            BLOCK_TABLE + b * stride_btb,
            seq_len,
            blk_lo,
            blk_hi,
            pid_m,
            split,
            b,
            gl.to_tensor(S_Q),
            gl.to_tensor(H_Q),
            gl.to_tensor(stride_qs),
            gl.to_tensor(stride_qh),
            gl.to_tensor(stride_kp),
            gl.to_tensor(stride_ks),
            gl.to_tensor(PAGE),
            gl.to_tensor(CAUSAL),
            gl.to_tensor(qk_scale),
            gl.to_tensor(k_scale),
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
            q_v,
            q_r,
            k_v,
            k_r,
            p_smem,
            gl.allocate_shared_memory(gl.float32, [3, BLOCK_M], ROWS),
            bars,
        )

    @gluon.jit
    def split_kernel_fp8(
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
        CAUSAL: gl.constexpr,
        D_V: gl.constexpr,
        D_ROPE: gl.constexpr,
        PAGE: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        SINGLE: gl.constexpr,
    ):
        """:func:`split_kernel` over vLLM's per-tensor fp8 cache (``KV``: e4m3 bytes, 576 a token), with a producer
        warpgroup (:mod:`mlaspec.impl.sparse_sm90_producer`'s schedule): 4 warps load the next tile's bytes into
        registers and convert them, exactly, into the second of two bf16 key tiles while the 8 consumer warps
        multiply the first (q, two key tiles and ``P``: 224 KB); ``k_scale`` sits in ``qk_scale`` and the epilogue,
        as in the readable kernel."""
        p = _split_state(
            Q, KV, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kp,
            stride_ks, stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale, k_scale,
            S_Q, H_Q, blocks_per_split, num_splits, CAUSAL, D_V, D_ROPE, PAGE, BLOCK_M, BLOCK_N, 4,
        )  # fmt: skip
        if SINGLE:
            gl.warp_specialize([(_consume_fp8_single, (p,)), (_produce_fp8, (p,))], [4], [FP8_PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consume_fp8_split, (p,)), (_produce_fp8, (p,))], [4], [FP8_PRODUCER_REGS])

    # -- the fp8 decode at 32 query rows or fewer: the keys as the MMAs' rows ---------------------------------------
    @gluon.jit
    def _consume_keys(p, SINGLE: gl.constexpr):
        """One consumer warpgroup over the producer's tiles with the ``R`` query rows as the MMAs' ``N``: per tile the
        logits transposed, ``S^T [64, R] = K q^T``, the online softmax on their transposed register view, and the output
        transposed, ``O^T [512, R] += V^T P^T`` (``P`` through shared memory, viewed transposed); then the epilogue on
        ``O^T`` viewed back."""
        R: gl.constexpr = p.q_v.shape[0]
        N: gl.constexpr = p.k_v.shape[1]
        D: gl.constexpr = p.k_v.shape[2]
        _load_q(p, (LOAD_V4, LOAD_R4))
        zero_t, n_keys, n_seen, m_i, l_i, acc_t = _keys_state(p.pid_m, p.seq_len, p.S_Q, p.H_Q, p.causal, R, N, D, 16)
        for i in range(p.blk_hi - p.blk_lo):
            b = _tile_ready(p, i)
            m_i, l_i, acc_t = _keys_step(p.k_v.index(b), p.k_r.index(b), p.q_v, p.q_r, p.p_smem, zero_t, p.blk_lo + i,
                                         p.qk_scale, p.seq_len, n_keys, n_seen, m_i, l_i, acc_t)  # fmt: skip
            _tile_done(p, b)
        _write_keys(acc_t, m_i, l_i, p.k_scale, p.pid_m, p.split, p.b, p.S_Q, p.H_Q, p.num_splits, _outs(p), SINGLE)

    @gluon.jit
    def _consume_keys_single(p):
        _consume_keys(p, True)

    @gluon.jit
    def _consume_keys_split(p):
        _consume_keys(p, False)

    @gluon.jit
    def split_kernel_fp8_keys(
        Q, KV, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kp, stride_ks,
        stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale, k_scale, S_Q, H_Q,
        blocks_per_split, num_splits, CAUSAL: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr,
        PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SINGLE: gl.constexpr,
    ):  # fmt: skip
        """:func:`split_kernel_fp8` for ``BLOCK_M`` (:func:`keys_rows`: 16 or 32) query rows a program, with the keys
        as the MMAs' rows: one consumer warpgroup (:func:`_consume_keys`, the default partition: launch with 4 warps)
        beside :func:`split_kernel_fp8`'s producer with its bytes staged in shared memory
        (:func:`_produce_fp8_staged`: the next tile's bytes travel while this one is converted; q, two key tiles,
        ``P`` and one tile of bytes: 200 KB at 16 rows, 221 at 32)."""
        p = _split_state(
            Q, KV, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kp,
            stride_ks, stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale, k_scale,
            S_Q, H_Q, blocks_per_split, num_splits, CAUSAL, D_V, D_ROPE, PAGE, BLOCK_M, BLOCK_N, 4,
        )  # fmt: skip
        raw_v = gl.allocate_shared_memory(gl.uint8, [BLOCK_N, 4, 128], RAW_SHARED)  # the next tile's bytes: 36 KB
        raw_r = gl.allocate_shared_memory(gl.uint8, [BLOCK_N, D_ROPE], RAW_SHARED_R)
        if SINGLE:
            gl.warp_specialize([(_consume_keys_single, (p,)), (_produce_fp8_staged, (p, raw_v, raw_r))], [4],
                               [FP8_PRODUCER_REGS])  # fmt: skip
        else:
            gl.warp_specialize([(_consume_keys_split, (p,)), (_produce_fp8_staged, (p, raw_v, raw_r))], [4],
                               [FP8_PRODUCER_REGS])  # fmt: skip

    # -- the e4m3 path: the keys kernel with fp8 MMAs and a transposing producer ------------------------------------
    # half a tile's value bytes, [64 keys, 256 values], 16 keys x 8 values a thread: read as 8-byte runs of values
    # (VT_LOAD), renumbered in registers keys first (VT_KEYS: the same lanes and warps) and written as 16-byte runs of
    # keys into V^T. The lanes over the 4 runs of keys and 8 of values, the warps over the values: a tile's reads and
    # writes take 1024 shared-memory wavefronts (twice the 512 its 64 KB need), where 8 x 8 a thread took 1536 at best
    # (lanes over the keys) and 1536 + 512 with the lanes over the values (16-way writes), which ran the whole decode
    # 1.4-1.7x slower on the H200; reading the values again from global memory (L2) was 1.1-1.25x slower (2026-11-30)
    VT_COLS = gl.constexpr(256)

    def _transposing(reg_bases):
        """The transpose's layout of ``[64 keys, 256 values]`` bytes with a thread's 16 x 8 in the order ``reg_bases``
        (the lanes over 4 runs of keys and 8 of values, the warps over the values)."""
        lanes, warps = [[16, 0], [32, 0], [0, 8], [0, 16], [0, 32]], [[0, 64], [0, 128]]
        layout = gl.DistributedLinearLayout(
            reg_bases=reg_bases, lane_bases=lanes, warp_bases=warps, block_bases=[], shape=[64, VT_COLS.value]
        )
        return gl.constexpr(layout)

    VT_LOAD = _transposing([[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [8, 0]])  # values first
    VT_KEYS = _transposing([[1, 0], [2, 0], [4, 0], [8, 0], [0, 1], [0, 2], [0, 4]])  # keys first

    @gluon.jit
    def _transpose_values(k_v, vt):
        """``vt [512, 64] = k_v[:, :512]^T``: the value bytes with the keys contiguous, the K-major operand an fp8
        ``P V`` needs (an e4m3 MMA takes no transposed operand), ``VT_COLS`` columns at a time."""
        for c in gl.static_range(512 // VT_COLS):
            v = gl.convert_layout(k_v.slice(c * VT_COLS, VT_COLS, dim=1).load(VT_LOAD), VT_KEYS)  # within each thread
            vt.slice(c * VT_COLS, VT_COLS, dim=0).store(gl.permute(v, (1, 0)))

    E4M3_TILES = gl.constexpr(3)  # key tiles in flight or in use
    # the 64-row program's registers a thread, the helper and the producer (the leader: what is left, 248; an SM's
    # 64 K over 384 threads, 504 a thread-slot of all three)
    E4M3_HELP_REGS, E4M3_PRODUCER_REGS = gl.constexpr(208), gl.constexpr(48)
    LAND, V_READY = gl.constexpr(0), gl.constexpr(3)  # [3] key tile k landed; [2] V^T buffer v written
    K_FREE = gl.constexpr(5)  # [3] the logits' MMAs are done with key tile k
    # [2] the P V of V^T reader c (the 16-row consumer or the 64-row leader; the helper) is done with V^T v, at + 2 c
    V_FREE = gl.constexpr(8)
    # the 64-row leader published P (and alpha), the helper read P; the leader's final sums
    E4M3_P_READY, E4M3_P_FREE, E4M3_SUMS = gl.constexpr(12), gl.constexpr(13), gl.constexpr(14)
    E4M3_BARRIERS = gl.constexpr(15)

    @gluon.constexpr_function
    def e4m3_value_readers(rows):
        """Warpgroups of :func:`split_kernel_e4m3_keys` that read ``V^T`` at ``rows`` query rows a program: the
        consumer at 16, the leader and the helper at 64."""
        return 1 if rows <= 16 else 2

    @gluon.jit
    def _page_of(p, blk):
        """The physical page of the split's key tile ``blk``."""
        return gl.load(p.bt + blk // (p.page // p.k_v.shape[1])).to(gl.int64)

    @gluon.jit
    def _first_slot(p, blk):
        """The slot of key tile ``blk``'s first key in its page."""
        return (blk % (p.page // p.k_v.shape[1])) * p.k_v.shape[1]

    @gluon.jit
    def _issue_e4m3_tile(p, DESC_V, DESC_R, t):
        """Start the copy of the split's key tile ``t`` into key buffer ``t % 3``, its bytes as they are: two
        tensor-memory copies that complete ``LAND``, or for a sequence's part-filled last tile ``cp.async``, zero-filled
        past its end, waited for, then ``LAND`` signalled (by the producer's warps)."""
        n: gl.constexpr = p.k_v.shape[1]
        blk = p.blk_lo + t
        page = _page_of(p, blk)
        kb = t % E4M3_TILES
        bar = p.bars.index(LAND + kb)
        if (blk + 1) * n <= p.seq_len:
            row = page.to(gl.int32) * p.page + _first_slot(p, blk)
            mbarrier.expect(bar, DESC_V.block_type.nbytes + DESC_R.block_type.nbytes)
            _tma_load(DESC_V, [row, 0], bar, p.k_v.index(kb))
            _tma_load(DESC_R, [row, p.k_v.shape[2]], bar, p.k_r.index(kb))
        else:
            slot0 = _first_slot(p, blk)
            _copy_rows(p.k_v.index(kb), p.k_r.index(kb), p.KV + page * p.stride_kp, slot0, slot0 + p.seq_len - blk * n,
                       p.page, 0, p.stride_ks, (LOAD_V4, LOAD_R4))  # fmt: skip
            async_copy.commit_group()
            async_copy.wait_group(0)
            fence_async_shared()
            _barrier()
            mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _produce_e4m3(p, vt, DESC_V, DESC_R):
        """The producer warpgroup: keeps three key tiles in flight and writes each landed tile's values transposed
        into a ``V^T`` buffer (:func:`_transpose_values`) while the logits' MMAs read the same tile."""
        n = p.blk_hi - p.blk_lo
        for t in gl.static_range(E4M3_TILES):
            if t < n:
                _issue_e4m3_tile(p, DESC_V, DESC_R, t)
        for i in range(n):
            kb = i % E4M3_TILES
            vb = i % 2
            mbarrier.wait(p.bars.index(LAND + kb), (i // E4M3_TILES) & 1)
            for c in gl.static_range(e4m3_value_readers(p.q_v.shape[0])):  # each reader's P V of tile i - 2 is done
                mbarrier.wait(p.bars.index(V_FREE + 2 * c + vb), ((i // 2) & 1) ^ 1, pred=i >= 2)
            _transpose_values(p.k_v.index(kb), vt.index(vb))
            fence_async_shared()
            _barrier()
            mbarrier.arrive(p.bars.index(V_READY + vb), count=1)
            if i + E4M3_TILES < n:  # the buffer's next tile, once the logits are done with this one
                mbarrier.wait(p.bars.index(K_FREE + kb), (i // E4M3_TILES) & 1)
                _issue_e4m3_tile(p, DESC_V, DESC_R, i + E4M3_TILES)

    @gluon.jit
    def _chunk(k_v, q_v, c: gl.constexpr, zero_t):
        """Issue ``S^T``'s part over latent columns ``64 c ..`` (two k32 steps), from zero."""
        return warpgroup_mma(k_v.slice(c * 64, 64, dim=1), q_v.slice(c * 64, 64, dim=1).permute((1, 0)), zero_t,
                             use_acc=False, is_async=True)  # fmt: skip

    @gluon.jit
    def _issue_logits(p, kb, zero_t):
        """Issue ``S^T = K q^T`` of key buffer ``kb`` in e4m3 as nine MMAs from zero, 64 columns each (the RoPE part
        the ninth), to be added in fp32 (:func:`_sum_logits`): the fp8 MMA's ~14-bit accumulator, run over all 576
        columns, left the logits small enough that the output leaned by -0.031% at DeepSeek's logits of ~150 (the
        harness's bias check, 2026-11-30); over 128 columns still -0.013%. DeepGEMM promotes every 128 products."""
        k_v, q_v = p.k_v.index(kb), p.q_v
        rope = warpgroup_mma(p.k_r.index(kb), p.q_r.permute((1, 0)), zero_t, use_acc=False, is_async=True)
        return (rope, _chunk(k_v, q_v, 0, zero_t), _chunk(k_v, q_v, 1, zero_t), _chunk(k_v, q_v, 2, zero_t),
                _chunk(k_v, q_v, 3, zero_t), _chunk(k_v, q_v, 4, zero_t), _chunk(k_v, q_v, 5, zero_t),
                _chunk(k_v, q_v, 6, zero_t), _chunk(k_v, q_v, 7, zero_t))  # fmt: skip

    @gluon.jit
    def _sum_logits(parts):
        """Wait for :func:`_issue_logits`' nine MMAs and add their parts in fp32."""
        a, b, c, d, e, f, g, h, i = warpgroup_mma_wait(0, deps=parts)
        return (((a + b) + (c + d)) + ((e + f) + (g + h))) + i

    @gluon.jit
    def _consume_e4m3(p, vt, SINGLE: gl.constexpr):
        """The consumer warpgroup, one tile behind its own MMAs: tile ``i``'s online softmax on the logits' transposed
        view, ``P`` rounded to e4m3 (``cvt.rn.satfinite``, as FlashMLA's fp8 kernel converts it) and ``O^T += V^T P^T``
        issued once the producer wrote ``V^T``, then tile ``i + 1``'s logits issued behind it, so the tensor cores take
        both while this warpgroup waits for the first; then the epilogue."""
        R: gl.constexpr = p.q_v.shape[0]
        N: gl.constexpr = p.k_v.shape[1]
        D: gl.constexpr = p.k_v.shape[2]
        _load_q(p, (LOAD_V4, LOAD_R4))
        zero_t, n_keys, n_seen, m_i, l_i, acc_t = _keys_state(p.pid_m, p.seq_len, p.S_Q, p.H_Q, p.causal, R, N, D, 32)
        n = p.blk_hi - p.blk_lo
        s_t = zero_t
        if n > 0:
            mbarrier.wait(p.bars.index(LAND), 0)
            s_t = _sum_logits(_issue_logits(p, 0, zero_t))
            _release(p, K_FREE)
        for i in range(n):
            vb = i % 2
            s = _scale_and_mask(gl.permute(s_t, (1, 0)), p.blk_lo + i, p.qk_scale, p.seq_len, n_keys, n_seen)
            prob, alpha, m_i = _softmax_step(s, m_i)  # tile i, base 2
            l_i = l_i * gl.expand_dims(alpha, 1) + prob
            p.p_smem.store(prob.to(gl.float8e4nv))  # P [R, 64] in e4m3; the MMA reads it as P^T
            fence_async_shared()
            _barrier()
            mbarrier.wait(p.bars.index(V_READY + vb), (i // 2) & 1)
            # a tile's P V from zero, added to acc_t in fp32: the running sum kept out of the fp8 MMA's ~14-bit
            # accumulator (what leaned, 2026-11-30, was the logits: _issue_logits)
            pv_mma = warpgroup_mma(vt.index(vb), p.p_smem.permute((1, 0)), acc_t, use_acc=False, is_async=True)
            if i + 1 < n:
                kb = (i + 1) % E4M3_TILES
                mbarrier.wait(p.bars.index(LAND + kb), ((i + 1) // E4M3_TILES) & 1)
                parts = _issue_logits(p, kb, zero_t)
                pv = warpgroup_mma_wait(9, deps=(pv_mma,))  # the nine logits MMAs, issued after it, may still run
                _release(p, V_FREE + vb)
                acc_t = acc_t * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, acc_t.type.layout)), 0) + pv
                s_t = _sum_logits(parts)
                _release(p, K_FREE + kb)
            else:
                pv = warpgroup_mma_wait(0, deps=(pv_mma,))
                _release(p, V_FREE + vb)
                acc_t = acc_t * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, acc_t.type.layout)), 0) + pv
        _write_keys(acc_t, m_i, l_i, p.k_scale, p.pid_m, p.split, p.b, p.S_Q, p.H_Q, p.num_splits, _outs(p), SINGLE)

    @gluon.jit
    def _consume_e4m3_single(p, vt):
        _consume_e4m3(p, vt, True)

    @gluon.jit
    def _consume_e4m3_split(p, vt):
        _consume_e4m3(p, vt, False)

    # the 64-row program: a leader warpgroup with each whole tile's logits and softmax (the query rows as the MMAs'
    # rows, so a row's maximum and sum stay within a warp) and half the output, a helper with the other half
    QK8 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32]))
    PV8 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 32]))

    @gluon.jit
    def _lead_state(p, QK: gl.constexpr, PV: gl.constexpr):
        """What a leader warpgroup (:func:`_lead`, :func:`_lead_e4m3`) starts with, in its MMAs' layouts (``QK``: the
        logits', ``PV``: its half of the output's): ``(n_keys, n_seen)`` (:func:`_keys_seen`), ``m_i``, ``l_i``,
        ``acc [64, 256]``, and zero logits ``[64, 64]`` (their register shape)."""
        M: gl.constexpr = p.q_v.shape[0]
        N: gl.constexpr = p.k_v.shape[1]  # shapes through constexprs: triton 3.6 takes no bare int in a shape list
        HALF: gl.constexpr = p.k_v.shape[2] // 2
        ROW: gl.constexpr = gl.SliceLayout(1, QK)
        n_keys, n_seen = _keys_seen(p.pid_m, p.seq_len, p.S_Q, p.H_Q, p.causal, M, QK)
        m_i = gl.full([M], float("-inf"), gl.float32, ROW)
        l_i = gl.zeros([M], gl.float32, ROW)
        return n_keys, n_seen, m_i, l_i, gl.zeros([M, HALF], gl.float32, PV), gl.zeros([M, N], gl.float32, QK)

    @gluon.jit
    def _e4m3_tile_logits(p, kb, zero):
        """``S = q K^T`` of key buffer ``kb`` (fp32 ``[64, 64]``, the query rows as the MMA's rows): the RoPE part,
        then the latent's 64-column parts of :func:`_issue_logits`, added in fp32 as each completes, two in flight."""
        k_v = p.k_v.index(kb)
        rope = warpgroup_mma(p.q_r, p.k_r.index(kb).permute((1, 0)), zero, use_acc=False, is_async=True)
        last = warpgroup_mma(p.q_v.slice(0, 64, dim=1), k_v.slice(0, 64, dim=1).permute((1, 0)), zero,
                             use_acc=False, is_async=True)  # fmt: skip
        s = warpgroup_mma_wait(1, deps=(rope,))
        for c in gl.static_range(1, 8):
            part = warpgroup_mma(p.q_v.slice(c * 64, 64, dim=1), k_v.slice(c * 64, 64, dim=1).permute((1, 0)), zero,
                                 use_acc=False, is_async=True)  # fmt: skip
            s = s + warpgroup_mma_wait(1, deps=(last,))
            last = part
        return s + warpgroup_mma_wait(0, deps=(last,))

    @gluon.jit
    def _lead_e4m3(p, vt, SINGLE: gl.constexpr):
        """The 64-row program's leader: q; each tile's logits (:func:`_e4m3_tile_logits`) and online softmax, ``P``
        rounded to e4m3 (``cvt.rn.satfinite``, as FlashMLA's fp8 kernel converts it) and published with the rescale
        factor once the helper read the last; the next tile's logits; then ``O[:, :256] += P V`` on the producer's
        ``V^T`` (``P V`` accumulated in the fp8 MMA; the bias check passes with it), which runs under the next
        softmax (1.03-1.04x faster than before the logits on an H200, 2026-11-30); at the end the final max and row
        sums for the helper, and its half of the epilogue with the LSE."""
        HALF: gl.constexpr = p.k_v.shape[2] // 2
        ROW_O: gl.constexpr = gl.SliceLayout(1, PV8)
        _load_q(p, (LOAD_V4, LOAD_R4))
        n_keys, n_seen, m_i, l_i, acc, zero = _lead_state(p, QK8, PV8)
        s = zero
        n = p.blk_hi - p.blk_lo
        if n > 0:
            mbarrier.wait(p.bars.index(LAND), 0)
            s = _e4m3_tile_logits(p, 0, zero)
            _release(p, K_FREE)
        pv = warpgroup_mma_init(acc)
        for i in range(n):
            vb = i % 2
            s = _scale_and_mask(s, p.blk_lo + i, p.qk_scale, p.seq_len, n_keys, n_seen)
            prob, alpha, m_i = _softmax_step(s, m_i)  # while tile i - 1's P V runs
            l_i = l_i * alpha + gl.sum(prob, 1)
            acc = warpgroup_mma_wait(0, deps=(pv,))
            if i > 0:
                _release(p, V_FREE + 1 - vb)
            mbarrier.wait(p.bars.index(E4M3_P_FREE), (i - 1) & 1, pred=i > 0)  # the helper read the last P
            p.p_smem.store(prob.to(gl.float8e4nv))
            p.rows.index(0).store(alpha)
            fence_async_shared()
            _release(p, E4M3_P_READY)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
            if i + 1 < n:
                kb = (i + 1) % E4M3_TILES
                mbarrier.wait(p.bars.index(LAND + kb), ((i + 1) // E4M3_TILES) & 1)
                s = _e4m3_tile_logits(p, kb, zero)
                _release(p, K_FREE + kb)
            mbarrier.wait(p.bars.index(V_READY + vb), (i // 2) & 1)
            pv = warpgroup_mma(p.p_smem, vt.index(vb).slice(0, HALF, dim=0).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(pv,))
        if n > 0:
            _release(p, V_FREE + (n - 1) % 2)
        _publish_sums(p, m_i, l_i, E4M3_SUMS)
        m_o, l_o = gl.convert_layout(m_i, ROW_O), gl.convert_layout(l_i, ROW_O)
        _write_half(acc, m_o, l_o, p, None, None, 0, True, SINGLE)

    @gluon.jit
    def _help_e4m3(p, vt, SINGLE: gl.constexpr):
        """The 64-row program's helper: ``O[:, 256:] += P V`` with the leader's ``P`` and rescale factor, then its
        half of the epilogue."""
        M: gl.constexpr = p.q_v.shape[0]
        HALF: gl.constexpr = p.k_v.shape[2] // 2
        ROW: gl.constexpr = gl.SliceLayout(1, PV8)
        acc = gl.zeros([M, HALF], gl.float32, PV8)
        for i in range(p.blk_hi - p.blk_lo):
            vb = i % 2
            mbarrier.wait(p.bars.index(E4M3_P_READY), i & 1)
            acc = acc * gl.expand_dims(p.rows.index(0).load(ROW), 1)
            mbarrier.wait(p.bars.index(V_READY + vb), (i // 2) & 1)
            pv = warpgroup_mma(p.p_smem, vt.index(vb).slice(HALF, HALF, dim=0).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(pv,))
            _release(p, E4M3_P_FREE)
            _release(p, V_FREE + 2 + vb)
        m_o, l_o = _read_sums(p, E4M3_SUMS, ROW)
        _write_half(acc, m_o, l_o, p, None, None, HALF, False, SINGLE)

    # one function a role and SINGLE: constexprs do not cross warp_specialize (above, _consume_fp8_single)
    @gluon.jit
    def _lead_e4m3_single(p, vt):
        _lead_e4m3(p, vt, True)

    @gluon.jit
    def _lead_e4m3_split(p, vt):
        _lead_e4m3(p, vt, False)

    @gluon.jit
    def _help_e4m3_single(p, vt):
        _help_e4m3(p, vt, True)

    @gluon.jit
    def _help_e4m3_split(p, vt):
        _help_e4m3(p, vt, False)

    @gluon.jit
    def split_kernel_e4m3_keys(
        Q, KV, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kp, stride_ks,
        stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale, k_scale, S_Q, H_Q,
        blocks_per_split, num_splits, DESC_V, DESC_R, CAUSAL: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr,
        PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SINGLE: gl.constexpr,
    ):  # fmt: skip
        """The e4m3 path (``Q``, ``KV``: e4m3 bytes; ``qk_scale`` holds ``q_scale`` too; ``DESC_V``, ``DESC_R``:
        :func:`cache_descriptors` of the e4m3 cache), launched with 4 warps. An e4m3 MMA takes both operands K-major:
        the key tile as it lands is the logits' operand, but ``P V`` needs the values with the keys contiguous, so a
        producer warpgroup (:func:`_produce_e4m3`) writes each tile's values transposed into one of two ``V^T``
        buffers while the others multiply; three key tiles in flight.
        ``BLOCK_M`` = 16 query rows a program: one consumer (:func:`_consume_e4m3`, the default partition; the
        output's partial sums and a tile's ``P V`` take 64 registers a thread each; q, three tiles, two ``V^T``,
        ``P``: 182 KB); 64: a leader and a helper with the query rows as their MMAs' rows (:func:`_lead_e4m3`,
        :func:`_help_e4m3`; half the output's sums each, 128 registers a thread, take ``P V`` in the MMA itself;
        213 KB)."""
        p = _split_state(
            Q, KV, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kp,
            stride_ks, stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale, k_scale,
            S_Q, H_Q, blocks_per_split, num_splits, CAUSAL, D_V, D_ROPE, PAGE, BLOCK_M, BLOCK_N, E4M3_BARRIERS,
            E4M3_TILES,
        )  # fmt: skip
        SH_VT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D_V, BLOCK_N], gl.float8e4nv)
        vt = gl.allocate_shared_memory(gl.float8e4nv, [2, D_V, BLOCK_N], SH_VT)
        feed = (p, vt, DESC_V, DESC_R)  # the producer's arguments
        if BLOCK_M > 16:  # the leader (the default partition), the helper, the producer
            if SINGLE:
                gl.warp_specialize([(_lead_e4m3_single, (p, vt)), (_help_e4m3_single, (p, vt)), (_produce_e4m3, feed)],
                                   [4, 4], [E4M3_HELP_REGS, E4M3_PRODUCER_REGS])  # fmt: skip
            else:
                gl.warp_specialize([(_lead_e4m3_split, (p, vt)), (_help_e4m3_split, (p, vt)), (_produce_e4m3, feed)],
                                   [4, 4], [E4M3_HELP_REGS, E4M3_PRODUCER_REGS])  # fmt: skip
        elif SINGLE:
            gl.warp_specialize([(_consume_e4m3_single, (p, vt)), (_produce_e4m3, feed)], [4],
                               [FP8_PRODUCER_REGS])  # fmt: skip
        else:
            gl.warp_specialize([(_consume_e4m3_split, (p, vt)), (_produce_e4m3, feed)], [4],
                               [FP8_PRODUCER_REGS])  # fmt: skip

    # -- the 64-row decode where each tile is read by two or more programs: a leader warpgroup ----------------------
    LEAD_REGS = gl.constexpr(248)  # registers a thread, both warpgroups (248 x 256 threads: an SM's 64 K)
    HELP_REGS = gl.constexpr(160)  # the helper's over the fp8 cache, beside the producer's 120: the leader's 224
    LOAD_V4 = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))  # LOAD_V, LOAD_R over one warpgroup
    LOAD_R4 = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
    # one warpgroup's MMAs: a whole tile's logits [64, 64], half the output [64, 256]
    QK1 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
    PV1 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
    P_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=PV1, k_width=2))  # the leader's P as an MMA operand
    # barriers: [2 buffers x 3 parts] a part of a tile landed (value columns 0-255, 256-511, RoPE), P and alpha
    # published, P read, the final max and row sums published
    LANDED = gl.constexpr(0)
    P_READY, P_FREE, SUMS_READY, LEAD_BARRIERS = gl.constexpr(6), gl.constexpr(7), gl.constexpr(8), gl.constexpr(9)
    LEFT, RIGHT, ROPE = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)

    @gluon.jit
    def _issue_part(p, DESC_H, DESC_R, t, PART: gl.constexpr):
        """Start the copy of one part of the split's tile ``t`` (``LEFT`` / ``RIGHT``: value columns 0-255 /
        256-511, ``ROPE``) into buffer ``t % 2``: by tensor-memory copy (``DESC_H``: the cache's ``[64, 256]``
        blocks), or for a sequence's part-filled last tile by ``cp.async``, zero-filled past its end, the barrier
        then signalled once it landed."""
        n: gl.constexpr = p.k_v.shape[1]
        HALF: gl.constexpr = p.k_v.shape[2] // 2
        blk = p.blk_lo + t
        page = gl.load(p.bt + blk // (p.page // n)).to(gl.int64)
        slot0 = (blk % (p.page // n)) * n
        bar = p.bars.index(LANDED + (t % 2) * 3 + PART)
        if PART == ROPE:
            dst = p.k_r.index(t % 2)
        else:
            dst = p.k_v.index(t % 2).slice(PART * HALF, HALF, dim=1)
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
                for c in gl.static_range(HALF // 64):  # [64, 64] at a time: few address registers
                    _copy_part(dst.slice(c * 64, 64, dim=1), base, slot0, limit, p.page, 0, p.stride_ks,
                               PART * HALF + c * 64, LOAD_R4)  # fmt: skip
            async_copy.commit_group()
            async_copy.wait_group(0)
            fence_async_shared()
            _barrier()
            mbarrier.arrive(bar)

    @gluon.jit
    def _whole_tile_logits(p, t):
        """Issue the split's tile ``t``'s logits, fp32 ``[64, 64]`` (the latent part, then RoPE: the order of
        :func:`split_kernel`'s MMAs), each part once it landed: three MMA groups."""
        M: gl.constexpr = p.q_v.shape[0]
        N: gl.constexpr = p.k_v.shape[1]
        HALF: gl.constexpr = p.k_v.shape[2] // 2
        FED: gl.constexpr = p.KV.dtype.element_ty == gl.uint8  # a producer converts whole tiles (:func:`_hand_over`)
        phase = (t // 2) & 1
        k_v = p.k_v.index(t % 2)
        s = gl.zeros([M, N], gl.float32, QK1)  # not read (use_acc=False): the MMA's register shape
        if FED:
            mbarrier.wait(p.bars.index(READY + t % 2), phase)
        else:
            mbarrier.wait(p.bars.index(LANDED + (t % 2) * 3 + LEFT), phase)
        s = warpgroup_mma(p.q_v.slice(0, HALF, dim=1), k_v.slice(0, HALF, dim=1).permute((1, 0)), s, use_acc=False,
                          is_async=True)  # fmt: skip
        if not FED:
            mbarrier.wait(p.bars.index(LANDED + (t % 2) * 3 + RIGHT), phase)
        s = warpgroup_mma(p.q_v.slice(HALF, HALF, dim=1), k_v.slice(HALF, HALF, dim=1).permute((1, 0)), s,
                          is_async=True)  # fmt: skip
        if not FED:
            mbarrier.wait(p.bars.index(LANDED + (t % 2) * 3 + ROPE), phase)
        return warpgroup_mma(p.q_r, p.k_r.index(t % 2).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _lead_step(p, s, m_i, l_i, acc, i, v):
        """The leader's step on tile ``i``'s masked base-2 logits ``s``: the online softmax, ``P`` rounded to q's
        dtype, ``P @ v`` (its value columns, ``P`` from registers) issued on the rescaled ``acc``, then ``P`` and
        the rescale factor published for the helper (once it read the last ``P``): ``(P @ V's MMA, m_i, l_i)``."""
        prob, alpha, m_i = _softmax_step(s, m_i)
        l_i = l_i * alpha + gl.sum(prob, 1)
        p16 = prob.to(p.p_smem.dtype)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, PV1)), 1)
        pv = warpgroup_mma(gl.convert_layout(p16, P_A), v, acc, is_async=True)
        mbarrier.wait(p.bars.index(P_FREE), (i - 1) & 1, pred=i > 0)  # the helper read the last P
        p.p_smem.store(p16)
        p.rows.index(0).store(alpha)
        fence_async_shared()
        _barrier()
        mbarrier.arrive(p.bars.index(P_READY), count=1)
        return pv, m_i, l_i

    @gluon.jit
    def _publish_sums(p, m_i, l_i, ready):
        """The leader's rows' final max and row sums, for the helper's epilogue; then barrier ``ready``."""
        p.rows.index(1).store(m_i)
        p.rows.index(2).store(l_i)
        _barrier()
        mbarrier.arrive(p.bars.index(ready), count=1)

    @gluon.jit
    def _read_sums(p, ready, ROW: gl.constexpr):
        """The helper's side of :func:`_publish_sums`: once barrier ``ready`` completes, the leader's rows' final max
        and row sums, in layout ``ROW``."""
        mbarrier.wait(p.bars.index(ready), 0)
        return p.rows.index(1).load(ROW), p.rows.index(2).load(ROW)

    @gluon.jit
    def _lead(p, DESC_H, DESC_R, DESC_O, SINGLE: gl.constexpr):
        """The leader warpgroup: q; each tile's logits and softmax; ``P @ V`` of value columns 0-255."""
        M: gl.constexpr = p.q_v.shape[0]
        HALF: gl.constexpr = p.k_v.shape[2] // 2
        FED: gl.constexpr = p.KV.dtype.element_ty == gl.uint8  # the producer's tiles, not copies issued here
        n = p.blk_hi - p.blk_lo
        for t in gl.static_range(2):
            if t < n and not FED:
                _issue_part(p, DESC_H, DESC_R, t, ROPE)
                _issue_part(p, DESC_H, DESC_R, t, LEFT)
        _load_q(p, (LOAD_V4, LOAD_R4))
        n_keys, n_seen, m_i, l_i, acc, s = _lead_state(p, QK1, PV1)
        if n > 0:
            first = _whole_tile_logits(p, 0)
            s = warpgroup_mma_wait(0, deps=(first,))
            if n > 2 and not FED:
                _issue_part(p, DESC_H, DESC_R, 2, ROPE)
        for i in range(n):
            # -- tile i's softmax (base 2), P rounded to q's dtype ----------------------------------------------------
            s = _scale_and_mask(s, p.blk_lo + i, p.qk_scale, p.seq_len, n_keys, n_seen)
            pv, m_i, l_i = _lead_step(p, s, m_i, l_i, acc, i, p.k_v.index(i % 2).slice(0, HALF, dim=1))
            # -- right behind it on the tensor cores, the next tile's logits --------------------------------------
            if i + 1 < n:
                nxt = _whole_tile_logits(p, i + 1)
                acc = warpgroup_mma_wait(3, deps=(pv,))
                if FED:  # the leader is done with this tile
                    _release(p, FREE + i % 2)
                elif i + 2 < n:  # this buffer's left half is read: the tile after next
                    _issue_part(p, DESC_H, DESC_R, i + 2, LEFT)
                s = warpgroup_mma_wait(0, deps=(nxt,))
                if i + 3 < n and not FED:  # the other buffer's RoPE part is read
                    _issue_part(p, DESC_H, DESC_R, i + 3, ROPE)
            else:
                acc = warpgroup_mma_wait(0, deps=(pv,))
        _publish_sums(p, m_i, l_i, SUMS_READY)
        m_o, l_o = gl.convert_layout(m_i, gl.SliceLayout(1, PV1)), gl.convert_layout(l_i, gl.SliceLayout(1, PV1))
        _write_half(acc, m_o, l_o, p, DESC_O, _as_fp32(p.q_v, M, HALF), 0, True, SINGLE)  # q is read: its 64 KB

    @gluon.jit
    def _help(p, DESC_H, DESC_R, DESC_O, SINGLE: gl.constexpr):
        """The helper warpgroup: ``P @ V`` of value columns 256-511, with the leader's ``P``."""
        M: gl.constexpr = p.q_v.shape[0]
        HALF: gl.constexpr = p.k_v.shape[2] // 2
        ROW: gl.constexpr = gl.SliceLayout(1, PV1)
        FED: gl.constexpr = p.KV.dtype.element_ty == gl.uint8
        n = p.blk_hi - p.blk_lo
        for t in gl.static_range(2):
            if t < n and not FED:
                _issue_part(p, DESC_H, DESC_R, t, RIGHT)
        acc = gl.zeros([M, HALF], gl.float32, PV1)
        for i in range(n):
            mbarrier.wait(p.bars.index(P_READY), i & 1)
            if FED:
                mbarrier.wait(p.bars.index(READY + i % 2), (i // 2) & 1)
            else:
                mbarrier.wait(p.bars.index(LANDED + (i % 2) * 3 + RIGHT), (i // 2) & 1)
            acc = acc * gl.expand_dims(p.rows.index(0).load(ROW), 1)
            pv = warpgroup_mma(p.p_smem, p.k_v.index(i % 2).slice(HALF, HALF, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(pv,))
            _release(p, P_FREE)
            if FED:
                mbarrier.arrive(p.bars.index(FREE_HELP + i % 2), count=1)
            elif i + 2 < n:  # this buffer's right half is read
                _issue_part(p, DESC_H, DESC_R, i + 2, RIGHT)
        m_o, l_o = _read_sums(p, SUMS_READY, ROW)
        # the stage: the other tile buffer, tile n - 2's (both warpgroups were done with it before the last P was
        # ready) or never used (n <= 1); no copy comes after the last tile
        _write_half(acc, m_o, l_o, p, DESC_O, _as_fp32(p.k_v.index(n % 2), M, HALF), HALF, False, SINGLE)

    @gluon.jit
    def _write_half(acc, m_o, l_o, p, DESC_O, stage, col0, WITH_LSE: gl.constexpr, SINGLE: gl.constexpr):
        """A warpgroup's epilogue in :func:`split_kernel_lead` and the e4m3 path's 64-row program: its half of the
        value columns (``col0 ..``), as tensor-memory copies from ``stage`` where ``DESC_O`` is given
        (:func:`_store_partial`), else from registers (:func:`_write_rows`)."""
        if DESC_O is None:
            _write_rows(acc, m_o, l_o, p.k_scale, p.pid_m, p.split, p.b, p.S_Q, p.H_Q, p.num_splits, _outs(p), col0,
                        2 * acc.shape[1], WITH_LSE, SINGLE)  # fmt: skip
        else:
            _store_partial(acc, m_o, l_o, p, DESC_O, stage, col0, WITH_LSE)

    # the partitions, one function a SINGLE (as the fp8 kernel's)

    @gluon.jit
    def _lead_single(p, DESC_H, DESC_R, DESC_O):
        _lead(p, DESC_H, DESC_R, DESC_O, True)

    @gluon.jit
    def _lead_split(p, DESC_H, DESC_R, DESC_O):
        _lead(p, DESC_H, DESC_R, DESC_O, False)

    @gluon.jit
    def _help_single(p, DESC_H, DESC_R, DESC_O):
        _help(p, DESC_H, DESC_R, DESC_O, True)

    @gluon.jit
    def _help_split(p, DESC_H, DESC_R, DESC_O):
        _help(p, DESC_H, DESC_R, DESC_O, False)

    @gluon.jit
    def split_kernel_lead(
        Q, KV, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kp, stride_ks,
        stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale, k_scale, S_Q, H_Q,
        blocks_per_split, num_splits, DESC_H, DESC_R, DESC_O, CAUSAL: gl.constexpr, D_V: gl.constexpr,
        D_ROPE: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SINGLE: gl.constexpr,
    ):  # fmt: skip
        """:func:`split_kernel` for rows whose key tiles other programs read too (two or more 64-row blocks: the
        second read of a tile comes from L2, so the tile's arithmetic, not its bytes, sets the pace), with
        tensor-memory copies (``DESC_H``, ``DESC_R``: :func:`cache_descriptors` with ``value_cols=256``; ``DESC_O``:
        :func:`partial_descriptor`, or ``None`` to store a split's partial from registers).

        Two warpgroups of different roles (``gl.warp_specialize``). The **leader** (the default partition) computes
        each whole tile's logits, ``q k^T`` at N = 64 (one MMA reads q once a tile; :func:`split_kernel`'s two
        warpgroups, 32 keys each, read it twice, twice the MMA instructions), and its softmax, multiplies ``P @ V``
        for value columns 0-255 with ``P`` from registers (an MMA operand in a register layout, as FA3's second
        MMA), then publishes ``P`` and the rescale factor through shared memory; the **helper** multiplies columns
        256-511 with the same ``P`` from there. (``P`` from registers: outputs bit-identical, the decode 0.2-2.4%
        faster at 11 of 15 shape-runs on an H100, 0.2-1.4% slower at 4; 2026-11-28.) The leader issues the next
        tile's ``q k^T`` right behind its ``P @ V``, so the tensor cores take both ``P @ V`` halves and the next
        logits back to back, and the softmax runs beside the helper's half. Copies as three parts a tile (value
        columns 0-255, 256-511, RoPE), each issued by the warpgroup that reads it last as soon as it has: the
        next-but-one tile's RoPE part after this tile's logits, its value halves after each warpgroup's ``P @ V``.

        Nsight Compute on an H100 (B64, 64K keys, 128 heads; 2026-11-27): :func:`split_kernel` issues 41.9 M
        warpgroup MMA instructions and reads 343 M shared-memory wavefronts, FlashMLA 23.1 M and 234 M, both read
        the cache from DRAM once (4.84 GB: the second head block's reads hit L2); tensor pipes active 50% of the
        time against FlashMLA's 74%. Rounding as :func:`split_kernel`'s, but the row sums are summed a tile at a
        time (not per key column), so the last bits of the output differ.

        Over vLLM's per-tensor fp8 cache (``KV`` of bytes; ``DESC_H = DESC_R = None``) a third warpgroup, the producer
        of :func:`split_kernel_fp8` (:func:`_produce_fp8`), converts each tile into the two bf16 buffers, and hands it
        over whole (one ``READY`` barrier a buffer, freed by the leader after its ``P @ V`` and by the helper after
        its half: :func:`_hand_over`); ``k_scale`` sits in ``qk_scale`` and the epilogue. Registers: leader 224, helper
        ``HELP_REGS`` (160; 152 spills), producer 120, of the launch's 168 x 384 threads.

        A split's fp32 partial (64 KB a warpgroup) goes out as one tensor-memory copy from shared memory it is done
        with (q's, and the tile buffer the last tile left). All 132 programs write theirs at once, 17 MB at 128 heads,
        B1-2: from registers that burst took 5.0-5.5 us of a B1 decode (``decode_ablation.py --kernel lead``,
        ``partial stores``), as copies 3.3-4.2 us; the decode 0.2-1.1 us faster at B1-2 (H100, 2026-11-28)."""
        p = _split_state(
            Q, KV, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART, OUT, LSE, stride_qb, stride_qs, stride_qh, stride_kp,
            stride_ks, stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, qk_scale, k_scale,
            S_Q, H_Q, blocks_per_split, num_splits, CAUSAL, D_V, D_ROPE, PAGE, BLOCK_M, BLOCK_N, LEAD_BARRIERS,
        )  # fmt: skip
        parts = (p, DESC_H, DESC_R, None if SINGLE else DESC_O)  # one split: its output in q's dtype, from registers
        FP8: gl.constexpr = KV.dtype.element_ty == gl.uint8  # vLLM's fp8 cache: split_kernel_fp8's producer converts
        if FP8 and SINGLE:
            gl.warp_specialize([(_lead_single, parts), (_help_single, parts), (_produce_fp8, (p,))], [4, 4],
                               [HELP_REGS, FP8_PRODUCER_REGS])  # fmt: skip
        elif FP8:
            gl.warp_specialize([(_lead_split, parts), (_help_split, parts), (_produce_fp8, (p,))], [4, 4],
                               [HELP_REGS, FP8_PRODUCER_REGS])  # fmt: skip
        elif SINGLE:
            gl.warp_specialize([(_lead_single, parts), (_help_single, parts)], [4], [LEAD_REGS])
        else:
            gl.warp_specialize([(_lead_split, parts), (_help_split, parts)], [4], [LEAD_REGS])
