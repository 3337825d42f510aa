"""The lightning indexer: fp8 MQA logits (ragged prefill and paged decode) and the top-k over them.

Implements :func:`mlaspec.spec.indexer.indexer_logits` (DeepGEMM ``fp8_mqa_logits``),
:func:`mlaspec.spec.indexer.paged_indexer_logits` (DeepGEMM ``fp8_paged_mqa_logits``) and
:func:`mlaspec.spec.topk.topk_indices` (vLLM ``top_k_per_row_prefill`` / ``top_k_per_row_decode``). Conventions, as
the spec states them:

* logits are in **absolute** columns (column ``n`` is key ``n`` of the K buffer), ``-inf`` outside each row's span
  ``[ks, ke)``; ``k_scale`` multiplies *after* the ReLU and the weighted head sum (DeepGEMM's ``scale_kv``);
* the paged cache is ``uint8 [num_blocks, P, D + 4]`` read as blocks of ``P * D`` fp8 e4m3 values (token-major)
  then ``P`` fp32 scales (:class:`mlaspec.spec.indexer.IndexerCacheLayout`); row ``r = b * next_n + j`` sees
  ``len[b, j]`` keys: ``context_lens[b, j]`` (2-D, vLLM 0.33) or ``max(context_lens[b] - next_n + j + 1, 0)`` (1-D);
* top-k: the ``K`` largest logits among ``row_starts <= n < row_ends`` that are not ``-inf``, then ``-1`` padding;
  ``relative`` subtracts ``row_starts``. The order is unspecified (as the CUDA kernel's); among logits tied at the
  ``K``-th value the lowest indices are kept.

The naive computation and its traffic (``M`` queries, ``N`` keys, ``H`` heads of width ``D``)::

    s      = einsum("mhd,nd->mhn", q, k)          # read M H D + N D (fp8), write M H N fp32
    logits = einsum("mhn,mh->mn", relu(s), w)     # read M H N + M H, write M N
    logits = logits * k_scale; mask outside span  # read M N + N, write M N

The kernel keeps ``s`` in registers: a program takes ``BLOCK_M`` query tokens with all their ``H`` heads as the
columns of one ``[D, BLOCK_M * H]`` fp8 tile, loops over key tiles ``[BLOCK_N, D]``, does one ``tl.dot`` per tile
with the keys as the MMA's rows (fp8 e4m3 inputs, fp32 accumulation; on Hopper a ``QGMMA``; DeepGEMM's layout, so
the head sum stays inside a warp), the ReLU, the weighted head sum and the scale, and writes only the
``[BLOCK_M, BLOCK_N]`` logits: read ``M H D + (M / BLOCK_M) N D`` bytes, write ``4 M N``. Key tiles
that no row of the block can see are not read; their columns are written ``-inf``. On Hopper, 64 heads of 128
(DeepSeek V3.2) run the same math as :mod:`mlaspec.impl.indexer_sm90` (Gluon), whose MMAs are issued one per token
so a token's epilogue runs while the next token's MMA does (``kernel=``, :func:`indexer_sm90_why_not`).

The top-k is a threshold select: the ``K``-th largest valid logit is found bit by bit on an order-preserving
32-bit key of the fp32 value (32 counting passes over the row), then one pass writes every index above the
threshold and the first ``K - count_above`` indices equal to it, compacted with a prefix sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import indexer_sm90
from .decode import _num_sms, aligned16, compiled_capability, gluon_runs, hopper_why_not, kernel_named
from .launch import Launcher

__all__ = ["indexer_logits", "indexer_sm90_why_not", "paged_indexer_logits", "topk_indices"]


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _head_weighted_relu(k, qt, w, ROWS: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys ``k [BLOCK_N, D]`` against ``qt [D, ROWS]`` (``ROWS // H`` tokens x ``H`` heads) -> ``sum_h w relu(k .
    q)``, ``[BLOCK_N, ROWS // H]``.

    The keys are the MMA's rows and the heads its columns, as DeepGEMM's ``fp8_mqa_logits`` lays them out: the sum
    over heads then runs along the accumulator's columns, inside a thread and across the four lanes that share a
    row, never through shared memory. (Heads as rows made it a cross-warp reduction: 2.2x slower on an H200.)
    """
    s = tl.dot(k, qt, out_dtype=tl.float32)  # [BLOCK_N, ROWS]: fp8 x fp8 -> fp32 (a QGMMA on Hopper)
    s = tl.maximum(s, 0.0) * w[None, :]  # ReLU, then the head weight (q scale and softmax scale folded in)
    return tl.sum(tl.reshape(s, (BLOCK_N, ROWS // H, H)), axis=2)


@triton.jit
def _query_heads(Q, W, first, count, ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    """``count`` tokens from ``first``, all ``H`` heads of each, as the columns of one tile (column ``r``: token
    ``first + r // H``, head ``r % H``): ``q^T [D, ROWS]`` fp8 and head weights ``[ROWS]``, 0 past ``count``."""
    r = tl.arange(0, ROWS)
    r_ok = r // H < count
    head = (first + r // H).to(tl.int64) * H + r % H  # row of q viewed [tokens * H, D]
    q = tl.load(Q + head[:, None] * D + tl.arange(0, D)[None, :], mask=r_ok[:, None], other=0.0)
    w = tl.load(W + head, mask=r_ok, other=0.0)
    return tl.trans(q), w


@triton.jit
def _indexer_logits_kernel(
    Q,
    K,
    W,
    KS,
    KE,
    KSCALE,
    OUT,  # q [M, H, D] fp8, k [N, D] fp8, w [M, H] fp32, ks/ke [M] int32, [N] fp32, [M, N]
    M,
    N,
    stride_om,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    ROWS: tl.constexpr = BLOCK_M * H

    # -- the block's query tokens, their spans, and all their heads as the rows of one fp8 tile -----------------------
    tok = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_ok = tok < M
    ks = tl.load(KS + tok, mask=tok_ok, other=0)
    ke = tl.load(KE + tok, mask=tok_ok, other=0)
    lo = tl.min(tl.where(tok_ok & (ke > ks), ks, 2147483647), axis=0)  # union of the block's non-empty spans
    hi = tl.max(tl.where(tok_ok & (ke > ks), ke, 0), axis=0)
    qt, w = _query_heads(Q, W, pid_m * BLOCK_M, M - pid_m * BLOCK_M, ROWS, H, D)
    d = tl.arange(0, D)

    # -- tiles of BLOCK_N keys; each is computed transposed, [BLOCK_N keys, BLOCK_M tokens] ---------------------------
    for i in range(TILES):
        n0 = (pid_n * TILES + i) * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])  # [BLOCK_N, BLOCK_M]
        logits = tl.full((BLOCK_N, BLOCK_M), float("-inf"), tl.float32)
        if (n0 < hi) & (n0 + BLOCK_N > lo):  # some row sees a key of this tile: read it
            # -- k q^T (fp8, fp32 accumulation), ReLU, weighted sum over heads, then the per-key scale (after the
            #    sum, as DeepGEMM) -----------------------------------------------------------------------------------
            k = tl.load(K + cols.to(tl.int64)[:, None] * D + d[None, :], mask=col_ok[:, None], other=0.0)
            val = _head_weighted_relu(k, qt, w, ROWS, H, BLOCK_N)
            if HAS_SCALE:
                val = val * tl.load(KSCALE + cols, mask=col_ok, other=0.0)[:, None]
            logits = tl.where(inside, val, float("-inf"))  # NaN keys outside every span never leak
        out = OUT + tok.to(tl.int64)[None, :] * stride_om + cols[:, None]
        tl.store(out, logits, mask=tok_ok[None, :] & col_ok[:, None])


@triton.jit
def _paged_indexer_logits_kernel(
    Q,
    CACHE8,
    CACHE32,
    TABLE,
    LENS,
    W,
    OUT,  # q [B, next_n, H, D] fp8; the cache as fp8 and fp32 words
    next_n,
    width,
    stride_tb,
    stride_om,
    P: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    LENS_2D: tl.constexpr,
):
    b, pid_n = tl.program_id(0), tl.program_id(1)
    J: tl.constexpr = ROWS // H  # query slots of the tile (next_n, padded)

    # -- the request's next_n queries x H heads as one fp8 tile, and each query's causal length ----------------------
    j = tl.arange(0, J)
    j_ok = j < next_n
    if LENS_2D:
        lens = tl.load(LENS + b * next_n + j, mask=j_ok, other=0)
    else:
        lens = tl.maximum(tl.load(LENS + b) - next_n + 1 + j, 0)  # the last query sees the whole context
    lens = tl.where(j_ok, lens, 0)
    longest = tl.max(lens, axis=0)
    qt, w = _query_heads(Q, W, b * next_n, next_n, ROWS, H, D)  # flat query rows b * next_n + j
    d = tl.arange(0, D)

    for i in range(TILES):
        n0 = (pid_n * TILES + i) * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        logits = tl.full((BLOCK_N, J), float("-inf"), tl.float32)  # transposed, as in the ragged kernel
        if n0 < longest:
            # -- key n of request b: block table[b, n // P], token n % P: values at it * D, scale at P * D + 4 it --
            key_ok = cols < longest
            page = tl.load(TABLE + b.to(tl.int64) * stride_tb + cols // P, mask=key_ok, other=0).to(tl.int64)
            off = cols % P
            base = page * (P * (D + 4))  # bytes; a multiple of 4
            k = tl.load(CACHE8 + (base + off * D)[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
            k_scale = tl.load(CACHE32 + (base + P * D) // 4 + off, mask=key_ok, other=0.0)
            val = _head_weighted_relu(k, qt, w, ROWS, H, BLOCK_N) * k_scale[:, None]
            logits = tl.where(cols[:, None] < lens[None, :], val, float("-inf"))
        out = OUT + (b * next_n + j).to(tl.int64)[None, :] * stride_om + cols[:, None]
        tl.store(out, logits, mask=j_ok[None, :] & (cols < width)[:, None])


@triton.jit
def _order_key(x):
    """fp32 -> int64 in ``[0, 2^32)`` with the same order (negative floats: lower 31 bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key.to(tl.int64) + 2147483648


@triton.jit
def _topk_kernel(
    X,
    STARTS,
    ENDS,
    OUT,  # logits [M, N] fp32, row starts / ends [M] int32, indices [M, K] int32
    N,
    K,
    stride_xm,
    stride_om,
    HAS_STARTS: tl.constexpr,
    HAS_ENDS: tl.constexpr,
    RELATIVE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0)
    x_row = X + m.to(tl.int64) * stride_xm
    o_row = OUT + m.to(tl.int64) * stride_om
    lo = 0
    hi = N
    if HAS_STARTS:
        lo = tl.load(STARTS + m)
    if HAS_ENDS:
        hi = tl.minimum(tl.load(ENDS + m), N)  # ends past N read as N; columns outside are never read

    # -- how many keys are valid (in range and not -inf) ------------------------------------------------------------
    num_valid = 0
    for n0 in range(lo, hi, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < hi, other=float("-inf"))
        num_valid += tl.sum((x > float("-inf")).to(tl.int32), axis=0)

    # -- the K-th largest key, bit by bit from the top: the largest t with count(key >= t) >= K -----------------------
    thr = tl.full((), -1, tl.int64)  # every valid key (>= 0) is above -1: fewer than K valid keys take them all
    if num_valid > K:
        thr = tl.full((), 0, tl.int64)
        for i in range(32):
            cand = thr | (tl.full((), 1, tl.int64) << (31 - i))
            count = 0
            for n0 in range(lo, hi, BLOCK):
                cols = n0 + tl.arange(0, BLOCK)
                x = tl.load(x_row + cols, mask=cols < hi, other=float("-inf"))
                hit = (x > float("-inf")) & (_order_key(x) >= cand)
                count += tl.sum(hit.to(tl.int32), axis=0)
            if count >= K:
                thr = cand

    # -- write the keys above the threshold, then the lowest-indexed ones equal to it, compacted by prefix sums --------
    above = 0
    for n0 in range(lo, hi, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < hi, other=float("-inf"))
        above += tl.sum(((x > float("-inf")) & (_order_key(x) > thr)).to(tl.int32), axis=0)
    ties_wanted = K - above
    written = 0
    ties_seen = 0
    for n0 in range(lo, hi, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < hi, other=float("-inf"))
        valid = x > float("-inf")
        key = _order_key(x)
        tie = valid & (key == thr)
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        take = (valid & (key > thr)) | (tie & (tie_rank < ties_wanted))
        pos = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        idx = cols
        if RELATIVE:
            idx = cols - lo
        tl.store(o_row + pos, idx, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)

    # -- -1 padding after the chosen ones ----------------------------------------------------------------------------
    for k0 in range(0, K, BLOCK):
        pos = k0 + tl.arange(0, BLOCK)
        tl.store(o_row + pos, tl.full((BLOCK,), -1, tl.int32), mask=(pos >= written) & (pos < K))


# ---------------------------------------------------------------------------------------------------------------
# Host launchers
# ---------------------------------------------------------------------------------------------------------------


def _pow2(name: str, x: int, minimum: int = 1) -> None:
    if x < minimum or x & (x - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {x}")


def _on(x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``x`` on ``device`` in ``dtype``, contiguous: itself when it already is (``.to`` costs ~1 us a call)."""
    if x.dtype == dtype and x.device == device and x.is_contiguous():
        return x
    return x.to(device=device, dtype=dtype).contiguous()


def _fp8(name: str, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name} must be float8_e4m3fn, got {str(x.dtype).removeprefix('torch.')}")
    return x.contiguous()


def indexer_sm90_why_not(
    capability: tuple[int, int] | None, heads: int, dim: int, *, aligned: bool = True
) -> str | None:
    """Why :mod:`mlaspec.impl.indexer_sm90` cannot compute these logits, or ``None`` where it can.

    It needs Gluon in this Triton, a Hopper GPU (``capability``: the CUDA device's compute capability, ``None`` off
    CUDA or under the interpreter), ``q [M, 64, 128]`` (``heads``, ``dim``: DeepSeek V3.2's indexer, the shape it is
    compiled and timed for) and (``aligned``) q and k 16-byte aligned (its ``cp.async`` copies move 16 bytes).
    """
    g = indexer_sm90
    if why := hopper_why_not("indexer_sm90", g.AVAILABLE, capability):
        return why
    if (heads, dim) != (g.HEADS, g.DIM):
        return f"indexer_sm90 takes {g.HEADS} heads of {g.DIM}, got {heads} of {dim}"
    if not aligned:
        return "indexer_sm90 takes q and k 16-byte aligned"
    return None


_logits_sm90 = Launcher(indexer_sm90.logits_kernel) if indexer_sm90.AVAILABLE else None  # the Gluon kernel's launch


def indexer_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    tiles: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """Ragged fp8 indexer logits, absolute columns (see the module docstring).

    Args:
        q: ``[M, H, D]`` float8_e4m3fn; ``H`` and ``D`` powers of two, ``D >= 16``.
        k: ``[N, D]`` float8_e4m3fn.
        weights: ``[M, H]`` float (read as fp32), folded weights.
        ks, ke: ``[M]`` int, ``0 <= ks <= ke <= N``.
        k_scale: optional ``[N]`` float (fp32), the per-key scale.
        block_m: query tokens per program (default ``128 / H``, at least ``16 / H``); ``block_n``: keys per
            tile (default 64, fewer when ``N`` is small); ``tiles``: key tiles per program (default 32);
            ``num_warps`` / ``num_stages``: Triton's launch options (default 4 and 3). The defaults were the
            fastest of 19 configurations timed on an H200 (S = 8192 causal: 659 TFLOP/s; 8 tiles a program 584,
            128-key tiles or 8 warps 370-520). Any of them given keeps the readable kernel unless
            ``kernel="sm90"``, which takes ``tiles`` (default :func:`mlaspec.impl.indexer_sm90.tiles_for`) and
            raises a ``ValueError`` for the others.
        kernel: ``"auto"`` (default; or the ``MLASPEC_INDEXER_KERNEL`` environment variable): on Hopper, for 64
            heads of 128, :mod:`mlaspec.impl.indexer_sm90` (Gluon; 1.3-1.4x the readable kernel), else the
            readable one; ``"triton"``: the readable kernel; ``"sm90"``: the Gluon kernel, a ``ValueError`` saying
            why where it does not apply (:func:`indexer_sm90_why_not`).

    Returns:
        ``logits [M, N]`` float32, ``-inf`` outside ``[ks, ke)``.
    """
    q, k = _fp8("q", q), _fp8("k", k)
    if q.dim() != 3 or k.dim() != 2 or k.shape[1] != q.shape[2]:
        raise ValueError(f"q must be [M, H, D] and k [N, D], got {list(q.shape)} and {list(k.shape)}")
    M, H, D = q.shape
    N = k.shape[0]
    _pow2("H", H)
    _pow2("D", D, 16)
    dev = q.device
    w = _on(weights, dev, torch.float32)
    ks32, ke32 = _on(ks, dev, torch.int32), _on(ke, dev, torch.int32)
    scale = None if k_scale is None else _on(k_scale, dev, torch.float32)
    kernel = kernel_named(kernel, "MLASPEC_INDEXER_KERNEL")
    options = {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
    readable_only = [name for name, x in options.items() if x is not None]
    if kernel == "sm90" and readable_only:
        raise ValueError(f"{', '.join(readable_only)} tune the readable kernel; kernel='sm90' takes only tiles")
    why = indexer_sm90_why_not(compiled_capability(dev), H, D, aligned=aligned16(q, k))
    gluon = gluon_runs(kernel, why, tuned=tiles is not None or bool(readable_only))
    out = torch.empty(M, N, dtype=torch.float32, device=dev)
    if M == 0 or N == 0:
        return out
    scale_arg = scale if scale is not None else w  # not read without HAS_SCALE
    if gluon:
        g = indexer_sm90
        if tiles is None:
            tiles = g.tiles_for(M, N, _num_sms(dev))
        _pow2("tiles", tiles)
        constexprs = dict(H=H, D=D, BLOCK_N=g.BLOCK_N, TILES=tiles, STAGES=g.STAGES, HAS_SCALE=scale is not None)
        args = (q, k, w, ks32, ke32, scale_arg, out, M, N, out.stride(0))
        _logits_sm90((g.programs(M, N, tiles),), args, constexprs, num_warps=g.NUM_WARPS)
        return out
    if block_m is None:
        block_m = max(1, 128 // H)  # 128 rows of the MMA tile
    _pow2("block_m", block_m)
    block_m = max(block_m, 16 // H)  # tl.dot needs at least 16 rows: H * BLOCK_M >= 16
    block_n = min(block_n or 64, max(16, triton.next_power_of_2(N)))
    tiles, num_warps, num_stages = tiles or 32, num_warps or 4, num_stages or 3
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n * tiles))
    _indexer_logits_kernel[grid](
        q,
        k,
        w,
        ks32,
        ke32,
        scale_arg,
        out,
        M,
        N,
        out.stride(0),
        H=H,
        D=D,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        TILES=tiles,
        HAS_SCALE=scale is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def paged_indexer_logits(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    weights: torch.Tensor,
    *,
    max_context_len: int | None = None,
    block_n: int = 64,
    tiles: int = 8,
) -> torch.Tensor:
    """Decode indexer logits read from the paged fp8 cache (see the module docstring).

    Args:
        q: ``[B, next_n, H, D]`` float8_e4m3fn; ``H``, ``D`` powers of two, ``D >= 16``.
        cache: ``[num_blocks, P, D + 4]`` uint8.
        block_table: ``[B, max_blocks]`` int.
        context_lens: ``[B]`` or ``[B, next_n]`` int.
        weights: ``[B * next_n, H]`` float.
        max_context_len: output columns (default: the longest length, read back to the host).

    Returns:
        ``logits [B * next_n, max_context_len]`` float32.
    """
    q = _fp8("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, next_n, H, D], got {list(q.shape)}")
    B, next_n, H, D = q.shape
    _pow2("H", H)
    _pow2("D", D, 16)
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != D + 4:
        raise ValueError(f"cache must be uint8 [num_blocks, P, D + 4 = {D + 4}], got {cache.dtype} {list(cache.shape)}")
    dev = q.device
    P = cache.shape[1]
    cache = cache.contiguous()
    lens = _on(context_lens, dev, torch.int32)
    if lens.dim() not in (1, 2):
        raise ValueError(f"context_lens must be [B] or [B, next_n], got {list(context_lens.shape)}")
    if max_context_len is None:  # the longest row: with 1-D lengths, the last query of b sees context_lens[b] keys
        max_context_len = max(int(lens.max()), 0) if lens.numel() and next_n else 0
    table = _on(block_table, dev, torch.int32)
    w = _on(weights, dev, torch.float32)
    out = torch.empty(B * next_n, max_context_len, dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out
    rows = max(16, triton.next_power_of_2(next_n) * H)
    grid = (B, triton.cdiv(max_context_len, block_n * tiles))
    _paged_indexer_logits_kernel[grid](
        q,
        cache.view(torch.float8_e4m3fn),
        cache.view(-1).view(torch.float32),
        table,
        lens,
        w,
        out,
        next_n,
        max_context_len,
        table.stride(0),
        out.stride(0),
        P=P,
        H=H,
        D=D,
        ROWS=rows,
        BLOCK_N=block_n,
        TILES=tiles,
        LENS_2D=lens.dim() == 2,
        num_warps=8 if rows >= 128 else 4,
    )
    return out


def topk_indices(
    logits: torch.Tensor,
    k: int,
    *,
    row_starts: torch.Tensor | None = None,
    row_ends: torch.Tensor | None = None,
    relative: bool = False,
    block: int = 1024,
) -> torch.Tensor:
    """Indices of the ``k`` largest valid logits per row, ``-1`` padded (see the module docstring).

    Args:
        logits: ``[M, N]`` float32 (other floats are cast), no NaN inside the row ranges.
        k: ``K >= 1``.
        row_starts, row_ends: optional ``[M]`` int (defaults ``0`` and ``N``).
        relative: subtract ``row_starts`` from the indices (``top_k_per_row_prefill``).

    Returns:
        ``indices [M, K]`` int32, the chosen ones first (in index order), then ``-1``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [M, N], got {list(logits.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if relative and row_starts is None:
        raise ValueError("row_starts must be given when relative=True")
    dev = logits.device
    x = logits.to(torch.float32)
    if x.stride(1) != 1:
        x = x.contiguous()
    M, N = x.shape
    starts = None if row_starts is None else _on(row_starts, dev, torch.int32)
    ends = None if row_ends is None else _on(row_ends, dev, torch.int32)
    out = torch.empty(M, k, dtype=torch.int32, device=dev)
    if M == 0:
        return out
    block = min(block, max(16, triton.next_power_of_2(max(N, k))))
    _topk_kernel[(M,)](
        x,
        starts if starts is not None else out,
        ends if ends is not None else out,
        out,
        N,
        k,
        x.stride(0),
        out.stride(0),
        HAS_STARTS=starts is not None,
        HAS_ENDS=ends is not None,
        RELATIVE=relative,
        BLOCK=block,
        num_warps=4,
    )
    return out
