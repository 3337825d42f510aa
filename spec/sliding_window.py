"""DeepSeek V4 attention: a sliding window over the raw cache, plus (per layer) a compressed cache.

Every V4 attention layer is sparse MLA (:mod:`mlaspec.spec.sparse`) with ``D_qk = D_v = 512`` over up to two sets
of keys in one softmax. What a layer sees depends on its ``compress_ratios[layer]`` (``hf_config``):

==========  =========  =======================================================================================
ratio ``r``  kind       keys of the query at absolute position ``p``
==========  =========  =======================================================================================
1           swaonly    the window: raw positions ``max(p - W + 1, 0) .. p`` (``W`` keys, itself included)
4           c4a        the window + the indexer's top-k among the compressed entries ``c < (p + 1) // 4``
128         c128a      the window + *every* compressed entry ``c < (p + 1) // 128`` (a dense "top-k")
==========  =========  =======================================================================================

(``_layer_type_for`` in ``vllm/v1/attention/backends/mla/sparse_swa.py``; any other ratio raises.)

**The window.** ``_compute_swa_indices_and_lens_kernel`` (``sparse_swa.py``): token ``t`` of request ``r`` sits at
``pos = (seq_len - query_len) + (t - query_start)`` and sees ``start = max(pos - W + 1, 0)`` to ``end = pos + 1``,
so ``swa_len = end - start = min(pos + 1, W)``. ``W`` is ``hf_config.sliding_window``. The window includes the
query itself and reaches ``W - 1`` tokens back: the interval ``(p - W, p]``.

**Compressed entries.** The compressor (``vllm/models/deepseek_v4/compressor.py``,
``common/ops/fused_compress_quant_cache.py``) writes entry ``c`` when the token at position ``(c + 1) * r - 1`` is
processed, i.e. once its group is complete. It is a softmax-weighted sum of raw positions
``(c + 1) * r - (1 + overlap) * r .. (c + 1) * r - 1`` (negative positions dropped), where ``overlap = (r == 4)``:
a c4a entry covers 8 tokens (its group and the previous one), a c128a entry its own 128. Its RoPE position is
``c * r``. A query at ``p`` may use entry ``c`` iff ``(c + 1) * r - 1 <= p``, i.e. ``c < (p + 1) // r`` — the
``topk_len = min((pos + 1) // r, top_k)`` of ``combine_topk_swa_indices``. There is no partial entry for the
group still being filled: those raw tokens are reached through the window.

**Metadata.** Decode (``query_len <= 1 + num_speculative_tokens``, so MTP decodes too) gets per-token paged SWA
indices ``[T, 1, W]`` (global slots, ``-1`` padded) and lengths ``[T]`` (:func:`swa_indices_and_lens`); the
compressed keys come as FlashMLA's ``extra`` cache (c4a: the indexer's local top-k mapped through the block table;
c128a: ``[0, 1, ..., n - 1, -1, ...]`` mapped likewise, :func:`c128a_topk_indices`). Prefill gathers, per request,
the compressed entries into ``[0, N)`` of a bf16 workspace row of width ``M`` and the last
``gather_len = query_len + min(prefix_len, W - 1)`` raw tokens into ``[N, N + gather_len)``
(:func:`prefill_gather_lens`, :func:`prefill_workspace`), then builds indices into that flat workspace
(:func:`combine_topk_swa_indices`), in chunks of requests (:func:`prefill_chunk_plan`).

:func:`v4_attention` is the definition every one of those paths must equal; :func:`v4_attention_indices` is the
same layer as one index list per query (compressed top-k, then the window), the form a sparse kernel reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .attention import attention
from .checks import FLOAT, INT, Dims, cu_seqlens, finite_float, positive_int
from .checks import device as _device

__all__ = [
    "LAYER_KINDS",
    "CombinedIndices",
    "PrefillChunk",
    "SWAIndices",
    "c128a_topk_indices",
    "combine_topk_swa_indices",
    "compressed_mask",
    "compressed_span",
    "layer_kind",
    "num_visible_compressed",
    "prefill_chunk_plan",
    "prefill_gather_lens",
    "prefill_workspace",
    "swa_indices_and_lens",
    "v4_attention",
    "v4_attention_indices",
    "window_mask",
]

LAYER_KINDS = {1: "swaonly", 4: "c4a", 128: "c128a"}
"""``compress_ratio -> layer kind`` (``sparse_swa.py``: ``_layer_type_for``; ratios ``<= 1`` are ``swaonly``)."""

SPARSE_PREFILL_TOPK_ALIGNMENT = 128
"""Width of the combined prefill index rows is rounded up to this (``_SPARSE_PREFILL_TOPK_ALIGNMENT``)."""


def layer_kind(compress_ratio: int) -> str:
    """``"swaonly"`` (ratio 0 or 1), ``"c4a"`` (4) or ``"c128a"`` (128); any other ratio raises ``ValueError``.

    0 is DeepSeek V4's own mark of an SWA-only layer (its ``config.json`` ``compress_ratios`` starts ``[0, 0, 4, 128,
    ...]``) and vLLM maps every ratio ``<= 1`` to ``swaonly``; a negative ratio is refused.
    """
    compress_ratio = positive_int("compress_ratio", compress_ratio, minimum=0)
    if compress_ratio <= 1:
        return "swaonly"
    if compress_ratio in LAYER_KINDS:
        return LAYER_KINDS[compress_ratio]
    raise ValueError(f"compress_ratio must be 1, 4 or 128 (DeepSeek V4 layer kinds), got {compress_ratio}")


def window_mask(s_q: int, s_kv: int, window: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Sliding-window causal mask ``[S_q, S_kv]`` bool, bottom-right aligned as
    :func:`~mlaspec.spec.attention.causal_mask`.

    Query ``i`` is at position ``p = i + S_kv - S_q`` and sees key ``j`` iff ``p - window < j <= p``
    (``window`` keys, itself included). Example ``S_q = S_kv = 4, window = 2``::

        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [0, 1, 1, 0],
         [0, 0, 1, 1]]
    """
    s_q = positive_int("s_q", s_q, minimum=0)
    s_kv = positive_int("s_kv", s_kv, minimum=0)
    window = positive_int("window", window)
    if s_q > s_kv:
        raise ValueError(f"s_q must be <= s_kv (queries are the last s_q positions), got s_q={s_q}, s_kv={s_kv}")
    device = _device("device", device)
    p = torch.arange(s_q, device=device)[:, None] + (s_kv - s_q)
    j = torch.arange(s_kv, device=device)[None, :]
    return (j <= p) & (j > p - window)


def compressed_span(index: int, compress_ratio: int) -> tuple[int, int]:
    """Raw positions ``(first, last)`` that compressed entry ``index`` summarises (``first`` clipped at 0).

    ``last = (index + 1) * r - 1`` (the entry is written when that token arrives); ``first = last - (1 + overlap)
    * r + 1`` with ``overlap = (r == 4)`` (``fused_compress_quant_cache.py``: ``start = position - (1 + OVERLAP) *
    COMPRESS_RATIO + 1``). Example: ``compressed_span(2, 4) == (4, 11)``, ``compressed_span(2, 128) == (256, 383)``.
    """
    index = positive_int("index", index, minimum=0)
    if layer_kind(compress_ratio) == "swaonly":
        raise ValueError(f"compress_ratio must be 4 or 128 for a compressed entry, got {compress_ratio}")
    last = (index + 1) * compress_ratio - 1
    overlap = 1 if compress_ratio == 4 else 0
    return max(last - (1 + overlap) * compress_ratio + 1, 0), last


def num_visible_compressed(positions: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    """How many compressed entries a query at each position may use: ``(p + 1) // r`` (0 for swaonly).

    Args:
        positions: ``[T]`` int, absolute positions ``>= 0``.
        compress_ratio: 1, 4 or 128.

    Returns:
        ``[T]`` int64.
    """
    Dims().tensor("positions", positions, ("T",), INT)
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {positions.tolist()}")
    if layer_kind(compress_ratio) == "swaonly":
        return torch.zeros_like(positions, dtype=torch.int64)
    return (positions.long() + 1) // compress_ratio


def compressed_mask(s_q: int, seq_len: int, compress_ratio: int) -> torch.Tensor:
    """Which compressed entries each of the last ``s_q`` queries may use: ``[S_q, seq_len // r]`` bool.

    Query ``i`` is at ``p = seq_len - s_q + i`` and may use entry ``c`` iff ``c < (p + 1) // r``. c128a layers
    attend to all of them; c4a layers to the indexer's top-k among them.
    """
    s_q = positive_int("s_q", s_q, minimum=0)
    seq_len = positive_int("seq_len", seq_len, minimum=0)
    if s_q > seq_len:
        raise ValueError(f"s_q must be <= seq_len, got s_q={s_q}, seq_len={seq_len}")
    n_c = 0 if layer_kind(compress_ratio) == "swaonly" else seq_len // compress_ratio
    p = torch.arange(s_q)[:, None] + (seq_len - s_q)
    c = torch.arange(n_c)[None, :]
    return c < (p + 1) // max(compress_ratio, 1)


def _query_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: its request and its absolute position ``prefix_len + (t - query_start)``."""
    qsl = cu_seqlens("query_start_loc", query_start_loc)
    Dims().bind("query_start_loc", B=qsl.numel() - 1).tensor("seq_lens", seq_lens, ("B",), INT)
    query_lens = (qsl[1:] - qsl[:-1]).long()
    if bool((seq_lens.long() < query_lens).any()):
        raise ValueError(f"seq_lens must be >= query lengths {query_lens.tolist()}, got {seq_lens.tolist()}")
    req = torch.repeat_interleave(torch.arange(query_lens.numel()), query_lens)
    t = torch.arange(int(qsl[-1]))
    pos = (seq_lens.long() - query_lens)[req] + (t - qsl.long()[req])
    return req, pos


class SWAIndices(NamedTuple):
    """``indices [T, 1, W]`` int32 (global slots, ``-1`` padded), ``lens [T]`` int32, ``positions [T]`` int64."""

    indices: torch.Tensor
    lens: torch.Tensor
    positions: torch.Tensor


def swa_indices_and_lens(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    window: int,
    block_size: int,
    is_valid_token: torch.Tensor | None = None,
) -> SWAIndices:
    """Per-token sliding-window indices into the paged SWA cache (``_compute_swa_indices_and_lens_kernel``).

    Math, token ``t`` of request ``r``::

        pos        = (seq_lens[r] - query_len[r]) + (t - query_start_loc[r])
        start, end = max(pos - W + 1, 0), pos + 1
        lens[t]    = end - start                                     = min(pos + 1, W)
        indices[t, 0, k] = block_table[r, (start + k) // P] * P + (start + k) % P   for k < lens[t], else -1

    vLLM runs it on the decode tokens (MTP included: every token of a ``query_len > 1`` decode gets its own window)
    and, for the fp8 paged-direct prefill, on the prefill tokens. These are FlashMLA's ``indices`` /
    ``topk_length`` for the SWA cache (:func:`mlaspec.spec.sparse.sparse_decode`).

    Args:
        query_start_loc: ``[B + 1]`` int, cumulative query lengths.
        seq_lens: ``[B]`` int, context + new tokens of each request (``>= query_len``).
        block_table: ``[B, max_blocks]`` int, the SWA cache's block table.
        window: ``W = hf_config.sliding_window``, ``>= 1``.
        block_size: ``P`` (64 for the V4 SWA cache).
        is_valid_token: optional ``[T]`` bool (vLLM: ``slot_mapping >= 0``); an invalid (padding) token gets
            length 0 and all ``-1`` (vLLM writes only its length and leaves the indices stale; they are unused).

    Returns:
        ``indices [T, 1, W]`` int32, ``lens [T]`` int32, ``positions [T]`` int64.
    """
    window = positive_int("window", window)
    p = positive_int("block_size", block_size)
    req, pos = _query_layout(query_start_loc, seq_lens)
    dims = Dims().bind("query_start_loc and seq_lens", T=pos.numel(), B=seq_lens.numel())
    dims.tensor("block_table", block_table, ("B", "max_blocks"), INT)
    if pos.numel() and int(seq_lens.max()) > dims["max_blocks"] * p:
        raise ValueError(f"block_table must cover seq_lens {seq_lens.tolist()} with block_size={p}")
    valid_tok = torch.ones(pos.numel(), dtype=torch.bool)
    if is_valid_token is not None:
        valid_tok = dims.tensor("is_valid_token", is_valid_token, ("T",), (torch.bool,))

    start = (pos - window + 1).clamp(min=0)
    lens = torch.where(valid_tok, pos + 1 - start, 0)
    k = torch.arange(window)
    local = start[:, None] + k[None, :]
    used = k[None, :] < lens[:, None]
    blocks = block_table.long()[req[:, None], torch.where(used, local, 0) // p]
    if bool((used & (blocks < 0)).any()):
        raise ValueError(
            f"block_table must hold page ids >= 0 for the pages a window reads, got {block_table.tolist()}"
        )
    slots = torch.where(used, blocks * p + local % p, -1)
    return SWAIndices(slots[:, None, :].to(torch.int32), lens.to(torch.int32), pos)


def prefill_gather_lens(seq_lens: torch.Tensor, query_lens: torch.Tensor, window: int) -> torch.Tensor:
    """How many raw tokens a prefill request gathers: ``query_len + min(prefix_len, W - 1)``.

    The first new token needs ``W - 1`` tokens of context before it; later ones are new tokens themselves
    (``_compute_prefill_metadata_kernel`` / ``ComputePrefillMetadataKernel``, ``sparse_swa.py``).

    Args:
        seq_lens: ``[B]`` int, ``prefix_len + query_len``.
        query_lens: ``[B]`` int, ``<= seq_lens``.
        window: ``W >= 1``.

    Returns:
        ``[B]`` int32. Example: ``seq_lens=[10, 3], query_lens=[3, 3], window=4`` gives ``[6, 3]``.
    """
    window = positive_int("window", window)
    dims = Dims()
    dims.tensor("seq_lens", seq_lens, ("B",), INT)
    dims.tensor("query_lens", query_lens, ("B",), INT)
    if bool((query_lens < 0).any()) or bool((seq_lens < query_lens).any()):
        raise ValueError(f"query_lens must lie in [0, seq_lens]; got {query_lens.tolist()} and {seq_lens.tolist()}")
    prefix = seq_lens.long() - query_lens.long()
    return (query_lens.long() + prefix.clamp(max=window - 1)).to(torch.int32)


def c128a_topk_indices(
    positions: torch.Tensor, compress_ratio: int, width: int, *, is_valid_token: torch.Tensor | None = None
) -> torch.Tensor:
    """c128a's "top-k": every visible compressed entry, ``[0, 1, ..., n - 1, -1, ...]``,
    ``n = min((p+1)//r, width)``; ``n = 0`` (an all ``-1`` row) for a token that is not valid.

    ``_build_c128a_topk_metadata_kernel`` (``vllm/v1/attention/backends/mla/flashmla_sparse.py``): prefill uses
    these local indices; decode maps them through the compressed block table (:func:`mlaspec.spec.sparse.
    global_slot_indices`) and passes ``n`` as ``extra_topk_length``. A decode token whose slot is ``-1`` (CUDA-graph
    padding: ``is_valid_token = slot_mapping >= 0``) gets length 0 there (``tl.where(is_valid_token, count, 0)``);
    the spec writes its row as all ``-1``, the same convention as :func:`swa_indices_and_lens` (vLLM leaves the
    row's indices unread behind the length 0).

    Args:
        positions: ``[T]`` int absolute positions, ``>= 0``.
        compress_ratio: the layer's ratio (128 in V4; any ratio > 1 works).
        width: row width (vLLM: ``ceil(max_model_len / r)`` rounded up to 128, trimmed per step), ``>= 0``.
        is_valid_token: optional ``[T]`` bool (vLLM: ``slot_mapping >= 0``); an invalid token's row is all ``-1``.

    Returns:
        ``[T, width]`` int32.
    """
    width = positive_int("width", width, minimum=0)
    if layer_kind(compress_ratio) == "swaonly":
        raise ValueError(f"compress_ratio must be > 1 for compressed indices, got {compress_ratio}")
    n = num_visible_compressed(positions, compress_ratio).clamp(max=width)
    if is_valid_token is not None:
        dims = Dims()
        dims.tensor("positions", positions, ("T",), INT)
        dims.tensor("is_valid_token", is_valid_token, ("T",), (torch.bool,))
        n = torch.where(is_valid_token, n, 0)
    k = torch.arange(width)[None, :]
    return torch.where(k < n[:, None], k, -1).to(torch.int32)


class CombinedIndices(NamedTuple):
    """``indices [T, K_comb]`` int32 into the flat prefill workspace (``-1`` padded) and ``lens [T]`` int32."""

    indices: torch.Tensor
    lens: torch.Tensor


def combine_topk_swa_indices(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    *,
    window: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
) -> CombinedIndices:
    """Prefill indices into the flat workspace ``[B * M, D]``: compressed top-k first, then the window.

    Math, token ``t`` of request ``b`` (chunk-local) at position ``pos``::

        topk_len = min((pos + 1) // r, topk)            0 for swaonly (topk = 0)
        swa_len  = min(pos + 1, W)
        indices[t, :topk_len]                   = b * M + topk_indices[t, :topk_len]    compressed region [0, N)
        indices[t, topk_len:topk_len + swa_len] = b * M + N + (pos - swa_len + 1 - (seq_len - gather_len))
                                                  + [0..swa_len)
        lens[t] = topk_len + swa_len;  row width = ceil((topk + W) / 128) * 128, rest -1

    Source: ``combine_topk_swa_indices`` / ``CombineTopkSwaIndicesKernel`` in
    ``vllm/models/deepseek_v4/common/ops/cache_utils.py``.

    Args:
        topk_indices: ``[T, K]`` int, local compressed indices (c4a: the indexer's; c128a: :func:`c128a_topk_indices`);
            the first ``topk_len`` of each row must lie in ``[0, N)``.
        query_start_loc: ``[B + 1]`` int for the chunk's ``B`` requests (rebased to start at 0 here).
        seq_lens: ``[B]`` int.
        gather_lens: ``[B]`` int (:func:`prefill_gather_lens`).
        window: ``W``.
        compress_ratio: the layer's ratio (1 for swaonly).
        topk: ``K`` used (0 for swaonly).
        M: workspace row width per request, ``N + W + max_num_batched_tokens`` in vLLM.
        N: compressed region width, ``ceil(max_model_len / r)`` (0 for swaonly).

    Returns:
        ``indices [T, K_comb]`` int32 and ``lens [T]`` int32.
    """
    window = positive_int("window", window)
    topk = positive_int("topk", topk, minimum=0)
    n_c = positive_int("N", N, minimum=0)
    m = positive_int("M", M)
    if m < n_c + window:
        raise ValueError(f"M must be >= N + window = {n_c + window}, got {m}")
    swa_only = layer_kind(compress_ratio) == "swaonly"
    if swa_only and topk:
        raise ValueError(f"topk must be 0 for a swaonly layer (compress_ratio={compress_ratio}), got {topk}")
    qsl = Dims().tensor("query_start_loc", query_start_loc, ("B_plus_1",), INT)
    if qsl.numel():
        qsl = qsl - qsl[0]  # a chunk of a larger batch: rebased
    req, pos = _query_layout(qsl, seq_lens)
    dims = Dims().bind("query_start_loc and seq_lens", T=pos.numel(), B=seq_lens.numel())
    dims.tensor("topk_indices", topk_indices, ("T", "K"), INT)
    dims.tensor("gather_lens", gather_lens, ("B",), INT)
    if topk > dims["K"]:
        raise ValueError(f"topk must be <= topk_indices.shape[1]={dims['K']}, got {topk}")
    swa_len = torch.minimum(pos + 1, torch.tensor(window))
    gather_start = seq_lens.long() - gather_lens.long()  # first raw position in the workspace
    if bool((pos - swa_len + 1 < gather_start[req]).any()):
        raise ValueError("gather_lens must cover each query's window (use prefill_gather_lens)")
    if bool((gather_lens.long() > m - n_c).any()):
        raise ValueError(f"gather_lens must be <= M - N = {m - n_c}, got {gather_lens.tolist()}")
    topk_len = torch.zeros_like(pos) if swa_only else torch.minimum((pos + 1) // compress_ratio, torch.tensor(topk))

    width = -(-(topk + window) // SPARSE_PREFILL_TOPK_ALIGNMENT) * SPARSE_PREFILL_TOPK_ALIGNMENT
    k = torch.arange(width)[None, :]
    base = (req * m)[:, None]
    in_topk = k < topk_len[:, None]
    local_topk = topk_indices.long()[:, : min(width, dims["K"])]
    local_topk = torch.nn.functional.pad(local_topk, (0, width - local_topk.shape[1]), value=-1)
    if bool((in_topk & ((local_topk < 0) | (local_topk >= n_c))).any()):
        raise ValueError(f"topk_indices must lie in [0, N={n_c}) in each row's first min((pos+1)//r, topk) slots")
    j = k - topk_len[:, None]
    in_swa = (j >= 0) & (j < swa_len[:, None])
    swa_slot = n_c + (pos - swa_len + 1 - gather_start[req])[:, None] + j
    out = torch.where(in_topk, base + local_topk, torch.where(in_swa, base + swa_slot, -1))
    return CombinedIndices(out.to(torch.int32), (topk_len + swa_len).to(torch.int32))


def prefill_workspace(
    raw_kv: Sequence[torch.Tensor],
    compressed_kv: Sequence[torch.Tensor] | None,
    gather_lens: torch.Tensor,
    *,
    M: int,
    N: int,
    fill: float = math.nan,
) -> torch.Tensor:
    """The bf16 gather workspace of V4 prefill (``dequantize_and_gather_k_cache`` twice), as ``[B, M, D]`` float64.

    Row ``b``: ``[0, seq_len // r)`` holds compressed entries ``0 ..`` (all complete groups), ``[N, N + gather_len)``
    holds raw positions ``seq_len - gather_len .. seq_len - 1``; everything else is ``fill`` (NaN: a read of an
    unfilled slot shows up). vLLM passes ``kv.view(-1, 1, D)`` to ``flash_mla_sparse_fwd``.

    Args:
        raw_kv: ``B`` tensors ``[seq_len_b, D]`` float, the (dequantized) raw latents of each request.
        compressed_kv: ``B`` tensors ``[n_b, D]`` float, the compressed entries (``n_b = seq_len_b // r``), or
            ``None`` for a swaonly layer.
        gather_lens: ``[B]`` int.
        M: workspace row width.
        N: compressed region width (compressed entries live in ``[0, N)``).
        fill: value of unused slots.

    Returns:
        ``[B, M, D]`` float64.
    """
    if not isinstance(raw_kv, Sequence) or not raw_kv:
        raise TypeError("raw_kv must be a non-empty sequence of tensors")
    m, n_c = positive_int("M", M), positive_int("N", N, minimum=0)
    dims = Dims().bind("raw_kv", B=len(raw_kv))
    dims.tensor("gather_lens", gather_lens, ("B",), INT)
    for b, x in enumerate(raw_kv):
        dims.tensor(f"raw_kv[{b}]", x, (None, "D"), FLOAT)
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        raise TypeError(f"fill must be a number, got {type(fill).__name__}")
    if compressed_kv is not None:
        if not isinstance(compressed_kv, Sequence) or isinstance(compressed_kv, str):
            raise TypeError(f"compressed_kv must be a sequence of tensors or None, got {type(compressed_kv).__name__}")
        if len(compressed_kv) != len(raw_kv):
            raise ValueError(f"compressed_kv must have {len(raw_kv)} entries, got {len(compressed_kv)}")
        for b, x in enumerate(compressed_kv):
            dims.tensor(f"compressed_kv[{b}]", x, (None, "D"), FLOAT)
            if x.shape[0] > n_c:
                raise ValueError(f"compressed_kv[{b}] must have <= N={n_c} entries, got {x.shape[0]}")
    ws = torch.full((len(raw_kv), m, dims["D"]), fill, dtype=torch.float64)
    for b, x in enumerate(raw_kv):
        g = int(gather_lens[b])
        if not 0 <= g <= x.shape[0] or n_c + g > m:
            raise ValueError(f"gather_lens[{b}] must lie in [0, min(seq_len={x.shape[0]}, M - N={m - n_c})], got {g}")
        ws[b, n_c : n_c + g] = x[x.shape[0] - g :].to(torch.float64)
        if compressed_kv is not None:
            ws[b, : compressed_kv[b].shape[0]] = compressed_kv[b].to(torch.float64)
    return ws


class PrefillChunk(NamedTuple):
    """Requests ``[start, end)`` of the prefill part; ``max_compressed`` and ``width`` bound their workspace rows."""

    start: int
    end: int
    max_compressed: int
    width: int


def prefill_chunk_plan(
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    *,
    window: int,
    compress_ratio: int,
    chunk_size: int = 4,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> list[PrefillChunk]:
    """Split prefill requests into chunks whose gathered workspace fits
    (``DeepseekSparseSWAMetadata.get_prefill_chunk_plan``).

    Greedy, in request order: a chunk grows while ``count * (max compressed + max gather_len)`` stays
    ``<= chunk_size * (ceil(max_model_len / r) [0 for swaonly] + W + max_num_batched_tokens)``; a chunk always
    takes at least one request. With ``compressed = seq_len // r`` and ``gather_len`` of
    :func:`prefill_gather_lens`, ``width = max_compressed + max_gather``.

    Older vLLM (and the V4 FlashMLA impl's ``PREFILL_CHUNK_SIZE = 4`` loop) cut fixed chunks of ``chunk_size``
    requests: pass ``max_model_len=None`` for that.

    Args:
        seq_lens: ``[B]`` int, of the prefill requests.
        query_lens: ``[B]`` int.
        window: ``W``.
        compress_ratio: 1, 4 or 128.
        chunk_size: ``PREFILL_CHUNK_SIZE`` (4).
        max_model_len: bounds the compressed pool ``ceil(max_model_len / r)``; give it with the next or neither.
        max_num_batched_tokens: bounds the gathered raw tokens.

    Returns:
        list of :class:`PrefillChunk`, covering ``[0, B)`` in order.
    """
    chunk_size = positive_int("chunk_size", chunk_size)
    kind = layer_kind(compress_ratio)
    gather = prefill_gather_lens(seq_lens, query_lens, window).long()
    compressed = torch.zeros_like(gather) if kind == "swaonly" else seq_lens.long() // compress_ratio
    n = seq_lens.numel()
    if (max_model_len is None) != (max_num_batched_tokens is None):
        raise ValueError("max_model_len and max_num_batched_tokens must be given together")
    plan: list[PrefillChunk] = []
    if max_model_len is None:
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            mc, mg = int(compressed[s:e].max()), int(gather[s:e].max())
            plan.append(PrefillChunk(s, e, mc, mc + mg))
        return plan
    max_model_len = positive_int("max_model_len", max_model_len)
    max_num_batched_tokens = positive_int("max_num_batched_tokens", max_num_batched_tokens)
    pool = 0 if kind == "swaonly" else -(-max_model_len // compress_ratio)
    budget = chunk_size * (pool + window + max_num_batched_tokens)
    s = 0
    while s < n:
        mc, mg, e = int(compressed[s]), int(gather[s]), s + 1
        while e < n:
            cmc, cmg = max(mc, int(compressed[e])), max(mg, int(gather[e]))
            if (e - s + 1) * (cmc + cmg) > budget:
                break
            mc, mg, e = cmc, cmg, e + 1
        plan.append(PrefillChunk(s, e, mc, mc + mg))
        s = e
    return plan


def v4_attention_indices(
    s_q: int,
    s_kv: int,
    *,
    window: int,
    compress_ratio: int = 1,
    topk_indices: torch.Tensor | None = None,
    num_compressed: int = 0,
) -> torch.Tensor:
    """The keys :func:`v4_attention` lets each query read, as rows of indices into ``cat(compressed_kv, raw_kv)``.

    Query ``i`` sits at ``p = S_kv - S_q + i``. Its row holds the compressed entries it uses, then its window,
    each part left-aligned and ``-1`` padded (how vLLM's V4 path feeds FlashMLA: the compressed top-k as one index
    list, the window as another, ``vllm/models/deepseek_v4/attention/impl/flashmla.py``)::

        n     = min((p + 1) // r, K)                      0 for swaonly (no topk_indices, K = 0)
        lo    = max(p - W + 1, 0)
        row[:n]                   = topk_indices[i, :n]          compressed rows [0, C)
        row[K : K + p + 1 - lo]   = C + [lo, lo + 1, ..., p]      raw rows, shifted by C = num_compressed
        everything else           = -1

    Example ``S_q = 2, S_kv = 9, W = 3, r = 4, C = 2``, ``topk_indices = [[1, 0], [0, 1]]`` (positions 7 and 8 see
    ``(7 + 1) // 4 = 2`` and ``9 // 4 = 2`` entries)::

        [[1, 0, 2 + 5, 2 + 6, 2 + 7],          -> [[1, 0,  7,  8,  9],
         [0, 1, 2 + 6, 2 + 7, 2 + 8]]              [0, 1,  8,  9, 10]]

    Args:
        s_q: ``S_q``, the request's last ``S_q`` positions are the queries.
        s_kv: ``S_kv >= S_q``, the request's raw keys (``seq_len``).
        window: ``W >= 1``.
        compress_ratio: 1 (swaonly), 4 (c4a) or 128 (c128a).
        topk_indices: ``[S_q, K]`` int local compressed indices (c128a: :func:`c128a_topk_indices`), required for
            c4a / c128a and ``None`` for swaonly; each row's first ``n`` must lie in ``[0, (p + 1) // r)`` and
            below ``num_compressed``.
        num_compressed: ``C >= 0``, the number of compressed rows before the raw ones (``compressed_kv.shape[0]``).

    Returns:
        ``[S_q, K + W]`` int64, ``-1`` where a slot is unused.
    """
    s_q = positive_int("s_q", s_q, minimum=0)
    s_kv = positive_int("s_kv", s_kv, minimum=0)
    window = positive_int("window", window)
    num_c = positive_int("num_compressed", num_compressed, minimum=0)
    if s_q > s_kv:
        raise ValueError(f"s_q must be <= s_kv (queries are the last s_q positions), got s_q={s_q}, s_kv={s_kv}")
    kind = layer_kind(compress_ratio)
    pos = torch.arange(s_q) + (s_kv - s_q)
    if kind == "swaonly":
        if topk_indices is not None:
            raise ValueError(f"topk_indices must be None for a swaonly layer (compress_ratio={compress_ratio})")
        comp = torch.zeros(s_q, 0, dtype=torch.int64)
    else:
        if topk_indices is None:
            raise ValueError(f"topk_indices are required for a {kind} layer (compress_ratio={compress_ratio})")
        dims = Dims(S_q=s_q)
        dims.tensor("topk_indices", topk_indices, ("S_q", "K"), INT)
        vis = (pos + 1) // compress_ratio
        used = torch.arange(dims["K"])[None, :] < torch.clamp(vis, max=dims["K"])[:, None]
        idx = topk_indices.long()
        if bool((used & ((idx < 0) | (idx >= vis[:, None]))).any()):
            raise ValueError("topk_indices must name only compressed entries visible to the query: c < (p + 1) // r")
        if bool((used & (idx >= num_c)).any()):
            raise ValueError(f"topk_indices must be < num_compressed={num_c} where used")
        comp = torch.where(used, idx, -1)
    lo = (pos - window + 1).clamp(min=0)
    k = torch.arange(window)[None, :]
    win = torch.where(k < (pos + 1 - lo)[:, None], num_c + lo[:, None] + k, -1)
    return torch.cat([comp, win], dim=1)


def v4_attention(
    q: torch.Tensor,
    raw_kv: torch.Tensor,
    *,
    window: int,
    scale: float,
    compressed_kv: torch.Tensor | None = None,
    compress_ratio: int = 1,
    topk_indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    d_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of one V4 layer for one request: window over the raw keys ∪ chosen compressed entries.

    The ``S_q`` queries are the last positions ``p = S_kv - S_q + i`` of the request. Query ``i`` attends, in one
    softmax, to raw keys ``j`` with ``p - W < j <= p`` and to compressed entries ``topk_indices[i, :n]`` with
    ``n = min((p + 1) // r, K)`` (c128a: pass :func:`c128a_topk_indices`, i.e. all visible entries). Sink as in
    :mod:`mlaspec.spec.sparse`. Built on :func:`mlaspec.spec.attention.attention` with the union mask.

    Args:
        q: ``[S_q, H_q, D_qk]`` float.
        raw_kv: ``[S_kv, D_qk]`` float, the request's raw latents (``S_kv = seq_len``).
        window: ``W``.
        scale: softmax scale.
        compressed_kv: ``[C, D_qk]`` float compressed entries (``C >= seq_len // r``), ``None`` for swaonly.
        compress_ratio: 1, 4 or 128.
        topk_indices: ``[S_q, K]`` int local compressed indices; the first ``n`` of each row must be unique and in
            ``[0, (p + 1) // r)`` (an entry a query may not see yet raises).
        attn_sink: optional ``[H_q]`` float.
        d_v: value width (512).

    Returns:
        ``out [S_q, H_q, d_v]`` float64 and ``lse [S_q, H_q]`` float64 (``-inf`` never occurs: the window always
        holds the query itself).
    """
    dims = Dims()
    dims.tensor("q", q, ("S_q", "H_q", "D_qk"), FLOAT)
    dims.tensor("raw_kv", raw_kv, ("S_kv", "D_qk"), FLOAT)
    window = positive_int("window", window)
    scale = finite_float("scale", scale)
    d_v = positive_int("d_v", d_v)
    if d_v > dims["D_qk"]:
        raise ValueError(
            f"d_v must be <= D_qk={dims['D_qk']} (the value is the first d_v columns of the key), got {d_v}"
        )
    s_q, s_kv = dims["S_q"], dims["S_kv"]
    kind = layer_kind(compress_ratio)
    mask = window_mask(s_q, s_kv, window)  # [S_q, S_kv]
    keys = raw_kv.to(torch.float64)
    if kind != "swaonly":
        if compressed_kv is None or topk_indices is None:
            raise ValueError(f"compressed_kv and topk_indices are required for a {kind} layer")
        dims.tensor("compressed_kv", compressed_kv, ("C", "D_qk"), FLOAT)
        dims.tensor("topk_indices", topk_indices, ("S_q", "K"), INT)
        pos = torch.arange(s_q) + (s_kv - s_q)
        n = torch.minimum((pos + 1) // compress_ratio, torch.tensor(dims["K"]))
        used = torch.arange(dims["K"])[None, :] < n[:, None]
        idx = topk_indices.long()
        if bool((used & ((idx < 0) | (idx >= ((pos + 1) // compress_ratio)[:, None]))).any()):
            raise ValueError("topk_indices must name only compressed entries visible to the query: c < (p + 1) // r")
        if bool((used & (idx >= dims["C"])).any()):
            raise ValueError(f"topk_indices must be < C={dims['C']}")
        cmask = torch.zeros(s_q, dims["C"] + 1, dtype=torch.bool)
        cmask.scatter_(1, torch.where(used, idx, dims["C"]), True)
        if int(cmask[:, : dims["C"]].sum()) != int(used.sum()):
            raise ValueError("topk_indices must not repeat an entry within a row's used slots")
        mask = torch.cat([cmask[:, : dims["C"]], mask], dim=1)
        keys = torch.cat([compressed_kv.to(torch.float64), keys], dim=0)
    elif compressed_kv is not None or topk_indices is not None:
        raise ValueError("compressed_kv and topk_indices must be None for a swaonly layer")
    k = keys[None, :, None, :]
    out, lse = attention(q[None], k, k[..., :d_v], scale=scale, mask=mask[None])
    out, lse = out[0], lse[0].T  # [S_q, H_q, d_v], [S_q, H_q]
    if attn_sink is not None:
        Dims(H_q=dims["H_q"]).tensor("attn_sink", attn_sink, ("H_q",), FLOAT)
        out = out * torch.sigmoid(lse - attn_sink.to(torch.float64)[None, :])[..., None]
    return out, lse
