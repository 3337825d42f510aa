"""Sparse MLA (DeepSeek V3.2 DSA, DeepSeek V4): attention over a per-query list of key indices.

Each query row attends only to the keys its ``indices`` row names (the top-k picked by the lightning indexer, a
sliding window, or both). FlashMLA serves it with two kernels, and this module gives one definition and two thin
views over it:

* :func:`sparse_attention` — the definition, over a contiguous ``kv [S_kv, H_kv, D_qk]``;
* :func:`sparse_prefill` — ``flash_mla_sparse_fwd`` (bf16 ``kv``, indices into it, returns ``out, max_logits, lse``);
* :func:`sparse_decode` — ``flash_mla_with_kvcache`` with ``indices`` (a *paged* cache, indices are global slots
  ``block * P + offset``, optional V4 ``extra`` cache), over an already-dequantized cache; compose with the
  656-byte / 584-byte dequantizers of :mod:`mlaspec.spec.cache_layouts` for the fp8 cache.

Math, per query ``i`` and query head ``h`` (KV head ``h // g``, ``g = H_q // H_kv``)::

    slots  = [t for t in range(K) if t < topk_length[i] and 0 <= indices[i, h//g, t] < S_kv]     (+ the extra slots)
    s[t]   = scale * q[i, h] . kv[indices[i, h//g, t], h//g]            for t in slots
    lse    = log(sum_t exp(s[t]))                                        natural log
    out    = sum_t exp(s[t] - lse) * kv[indices[i, h//g, t], h//g, :D_v] the value: the first D_v columns of kv
    out   *= exp(lse) / (exp(lse) + exp(attn_sink[h]))                   only with a sink; lse is NOT changed
    max_logits = max_t s[t]

Conventions (``FlashMLA tests/ref.py``: ``ref_sparse_attn_fwd`` and ``ref_sparse_attn_decode``, and the docstrings
of ``flash_mla/flash_mla_interface.py``):

* **Invalid index.** Prefill: any index ``< 0`` or ``>= S_kv`` (FlashMLA's tests use ``-1``, ``S_kv``, ``INT_MIN``,
  ``INT_MAX``). Decode: only ``-1``; any other out-of-range slot is an illegal memory access in the kernel
  (``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh`` maps only ``-1`` to a safe address), so :func:`sparse_decode`
  raises on it. Slots past ``topk_length`` are never read, whatever they hold.
* **topk_length.** Only the first ``topk_length[i]`` slots of row ``i`` are used: ``-1`` padding equals a shorter
  ``topk_length``. Prefill: ``[S_q]``; decode: ``[B]`` (one per *request*, shared by its ``S_q`` queries).
* **Duplicated index.** Every slot is a separate term of the softmax (the reference gathers per slot with
  ``index_select``; the kernels loop over slots), so an index listed twice is attended twice — its weight doubles.
  FlashMLA's tests only generate unique indices (``_randperm_batch``) and vLLM's indexer emits unique top-k, so
  this is the definition, not a tested kernel behaviour.
* **Empty row** (no valid slot): output 0, LSE ``+inf`` (FlashMLA's choice, "so that the merge gives it zero
  weight"; ``empty_lse="-inf"`` gives the dense convention), ``max_logits`` ``-inf``. An empty *key set* is the
  same case for every row: ``K = 0`` slots, or ``S_kv = 0`` (``kv [0, H_kv, D_qk]``, or a decode cache of ``NB = 0``
  pages) with every index ``-1``, gives output 0 and LSE ``+inf`` everywhere, as ``tests/ref.py`` does for a row
  whose indices are all invalid (``lonely_q_mask``), not an indexing error.
* **Attention sink** ``[H_q]``: scales the output by ``sigmoid(lse - sink)``; ``-inf`` does nothing, ``+inf`` gives
  zeros; LSE and ``max_logits`` are unchanged.
* **LSE layout.** Prefill ``[S_q, H_q]`` (``sparse_prefill_fwd``); decode ``[B, H_q, S_q]`` (the kernel writes
  ``[B, S_q, H_q]`` and returns ``lse.transpose(1, 2)``, ``csrc/api/sparse_decode.h``). Natural log in both.
* **v = k[:D_v].** The value is the first ``D_v = 512`` columns of the same latent row (V3.2: ``D_qk = 576``;
  V4: ``D_qk = D_v = 512``, so the value is the whole key).
* **Extra cache (V4).** ``extra_kv`` / ``extra_indices`` / ``extra_topk_length`` add more keys to the *same*
  softmax (one LSE over both); vLLM's V4 decode passes the sliding window as the main cache and the compressed
  cache as the extra one (``vllm/models/deepseek_v4/attention/impl/flashmla.py``).

Unlike the kernel, the spec never reads an invalid slot, so NaN in unused cache rows cannot leak into the output
(FlashMLA's prefill docstring warns that it can, for NaN rows named past ``topk_length``).

Computed in float64, returned float64.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .attention import attention
from .checks import FLOAT, INT, Dims, choice, finite_float, in_range, positive_int

__all__ = [
    "SparseDecodeOutput",
    "SparseOutput",
    "SparsePrefillOutput",
    "global_slot_indices",
    "indices_to_mask",
    "sparse_attention",
    "sparse_decode",
    "sparse_prefill",
    "valid_slots",
]


class SparseOutput(NamedTuple):
    """``out [S_q, H_q, D_v]``, ``lse [S_q, H_q]`` (natural log) and ``max_logits [S_q, H_q]``, float64."""

    out: torch.Tensor
    lse: torch.Tensor
    max_logits: torch.Tensor


class SparsePrefillOutput(NamedTuple):
    """``flash_mla_sparse_fwd``'s results, in its order: ``out [S_q, H_q, D_v]``, ``max_logits``, ``lse [S_q, H_q]``."""

    out: torch.Tensor
    max_logits: torch.Tensor
    lse: torch.Tensor


class SparseDecodeOutput(NamedTuple):
    """``flash_mla_with_kvcache``'s results: ``out [B, S_q, H_q, D_v]`` and ``lse [B, H_q, S_q]``, float64."""

    out: torch.Tensor
    lse: torch.Tensor


def valid_slots(indices: torch.Tensor, s_kv: int, topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """Which slots of ``indices`` are used: ``0 <= index < s_kv`` and ``slot < topk_length[row]``.

    Args:
        indices: ``[S_q, H_kv, K]`` int.
        s_kv: number of keys, ``>= 0`` (0: every slot is invalid).
        topk_length: optional ``[S_q]`` int in ``[0, K]``.

    Returns:
        ``[S_q, H_kv, K]`` bool.
    """
    dims = Dims()
    dims.tensor("indices", indices, ("S_q", "H_kv", "K"), INT)
    s_kv = positive_int("s_kv", s_kv, minimum=0)
    _check_lengths("topk_length", topk_length, dims, "K")
    return _valid_slots(indices, s_kv, topk_length)


def _valid_slots(indices: torch.Tensor, s_kv: int, topk_length: torch.Tensor | None) -> torch.Tensor:
    valid = (indices >= 0) & (indices < s_kv)
    if topk_length is not None:
        slot = torch.arange(indices.shape[-1], device=indices.device)
        valid = valid & (slot[None, None, :] < topk_length.to(indices.device)[:, None, None])
    return valid


def indices_to_mask(indices: torch.Tensor, s_kv: int, topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """The dense mask a sparse row stands for: ``mask[i, h, j]`` iff some used slot of row ``(i, h)`` names ``j``.

    Duplicates collapse (a mask cannot count), so :func:`sparse_attention` equals masked dense attention exactly
    when each row's used indices are unique.

    Args:
        indices: ``[S_q, H_kv, K]`` int; invalid entries (``< 0``, ``>= s_kv``, past ``topk_length``) are ignored.
        s_kv: number of keys.
        topk_length: optional ``[S_q]`` int.

    Returns:
        ``[S_q, H_kv, S_kv]`` bool.
    """
    dims = Dims()
    dims.tensor("indices", indices, ("S_q", "H_kv", "K"), INT)
    s_kv = positive_int("s_kv", s_kv, minimum=0)
    _check_lengths("topk_length", topk_length, dims, "K")
    valid = _valid_slots(indices, s_kv, topk_length)
    mask = torch.zeros(*indices.shape[:2], s_kv + 1, dtype=torch.bool, device=indices.device)
    target = torch.where(valid, indices.long(), s_kv)  # invalid slots land in a spill column
    mask.scatter_(2, target, True)
    return mask[..., :s_kv]


def _gather(kv: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``kv[indices[i, h, t], h]`` as ``[S_q, K, H_kv, D]`` float64, zero at invalid slots (never reads them)."""
    h_kv = kv.shape[1]
    if kv.shape[0] == 0:  # S_kv = 0: no slot is valid, there is nothing to read
        return torch.zeros(
            *indices.shape[:1], indices.shape[2], h_kv, kv.shape[2], dtype=torch.float64, device=kv.device
        )
    safe = torch.where(valid, indices.long(), 0)  # [S_q, H_kv, K]
    heads = torch.arange(h_kv, device=kv.device)[None, :, None]
    g = kv.to(torch.float64)[safe, heads]  # [S_q, H_kv, K, D]
    g = torch.where(valid[..., None], g, 0.0)  # an invalid slot reads nothing, not even NaN
    return g.permute(0, 2, 1, 3)


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    scale: float,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    empty_lse: str = "+inf",
) -> SparseOutput:
    """Sparse attention: query row ``i`` attends to the keys ``indices[i]`` names (see the module docstring).

    Built on :func:`mlaspec.spec.attention.attention`: the named keys are gathered slot by slot into a batch of
    one-query problems ``[S_q, K, H_kv, D_qk]`` and attended under the mask "slot is valid".

    Args:
        q: ``[S_q, H_q, D_qk]`` float.
        kv: ``[S_kv, H_kv, D_qk]`` float; ``H_q % H_kv == 0``; the value is ``kv[..., :d_v]``.
        indices: ``[S_q, H_kv, K]`` int; an index ``< 0`` or ``>= S_kv`` is invalid (skipped).
        scale: the softmax scale (FlashMLA's ``sm_scale``); finite.
        d_v: value width, ``1 <= d_v <= D_qk`` (FlashMLA: 512).
        topk_length: optional ``[S_q]`` int in ``[0, K]``; only slots ``t < topk_length[i]`` are used.
        attn_sink: optional ``[H_q]`` float; ``±inf`` allowed, NaN not.
        extra_kv: optional ``[S_extra, H_kv, D_qk]`` float, more keys in the same softmax (V4).
        extra_indices: ``[S_q, H_kv, K_extra]`` int into ``extra_kv``; required with ``extra_kv`` and only with it.
        extra_topk_length: optional ``[S_q]`` int in ``[0, K_extra]``; only with ``extra_kv``.
        empty_lse: ``"+inf"`` (FlashMLA's sparse kernels) or ``"-inf"`` (dense convention) for rows with no key.

    Returns:
        ``out [S_q, H_q, d_v]``, ``lse [S_q, H_q]``, ``max_logits [S_q, H_q]``, float64.
    """
    dims = Dims()
    dims.tensor("q", q, ("S_q", "H_q", "D_qk"), FLOAT)
    dims.tensor("kv", kv, ("S_kv", "H_kv", "D_qk"), FLOAT)
    dims.tensor("indices", indices, ("S_q", "H_kv", "K"), INT)
    h_q, h_kv, d_qk = dims["H_q"], dims["H_kv"], dims["D_qk"]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"kv must have a head count H_kv that divides H_q={h_q}, got H_kv={h_kv}")
    scale = finite_float("scale", scale)
    d_v = positive_int("d_v", d_v)
    if d_v > d_qk:
        raise ValueError(f"d_v must be <= D_qk={d_qk} (the value is the first d_v columns of kv), got {d_v}")
    choice("empty_lse", empty_lse, ("+inf", "-inf"))
    _check_lengths("topk_length", topk_length, dims, "K")
    if attn_sink is not None:
        dims.tensor("attn_sink", attn_sink, ("H_q",), FLOAT)
        if bool(torch.isnan(attn_sink).any()):
            raise ValueError("attn_sink must not contain NaN")
    if extra_kv is None:
        if extra_indices is not None or extra_topk_length is not None:
            raise ValueError("extra_indices and extra_topk_length need extra_kv")
    else:
        dims.tensor("extra_kv", extra_kv, ("S_extra", "H_kv", "D_qk"), FLOAT)
        if extra_indices is None:
            raise ValueError("extra_indices must be given with extra_kv")
        dims.tensor("extra_indices", extra_indices, ("S_q", "H_kv", "K_extra"), INT)
        _check_lengths("extra_topk_length", extra_topk_length, dims, "K_extra")

    valid = _valid_slots(indices, dims["S_kv"], topk_length)  # [S_q, H_kv, K]
    keys = _gather(kv, indices, valid)  # [S_q, K, H_kv, D_qk]
    if extra_kv is not None:
        extra_valid = _valid_slots(extra_indices, dims["S_extra"], extra_topk_length)
        keys = torch.cat([keys, _gather(extra_kv, extra_indices, extra_valid)], dim=1)
        valid = torch.cat([valid, extra_valid], dim=-1)

    g = h_q // h_kv
    per_head = valid.repeat_interleave(g, dim=1)  # [S_q, H_q, K_total]: query head h reads KV head h // g
    # one KV head (MLA): one mask [S_q, 1, K_total] shared by every query head, so the keys are never repeated
    mask = valid[:, :1] if h_kv == 1 else per_head[:, :, None, :]
    out, lse = attention(q[:, None], keys, keys[..., :d_v], scale=scale, mask=mask)
    out, lse = out[:, 0], lse[..., 0]  # [S_q, H_q, d_v], [S_q, H_q]

    # max_logits: the largest scaled score of the row (FlashMLA returns it for the backward pass); -inf if empty.
    qg = q.to(torch.float64).reshape(dims["S_q"], h_kv, g, d_qk)  # query head h = (h // g, h % g)
    logits = torch.einsum("scgd,skcd->scgk", qg, keys).reshape(dims["S_q"], h_q, -1) * scale  # [S_q, H_q, K_total]
    logits = torch.nn.functional.pad(logits.masked_fill(~per_head, -math.inf), (0, 1), value=-math.inf)
    max_logits = logits.amax(dim=-1)  # the -inf column: a row with no slot at all (K = 0) has max -inf too

    empty = torch.isneginf(lse)
    if attn_sink is not None:
        sink = attn_sink.to(torch.float64)[None, :]
        factor = torch.where(empty, 0.0, torch.sigmoid(lse - sink))  # exp(lse) / (exp(lse) + exp(sink))
        out = out * factor[..., None]
    if empty_lse == "+inf":
        lse = lse.masked_fill(empty, math.inf)
    return SparseOutput(out, lse, max_logits)


def _check_lengths(name: str, lengths: torch.Tensor | None, dims: Dims, width: str) -> None:
    if lengths is None:
        return
    dims.tensor(name, lengths, ("S_q",), INT)
    in_range(name, lengths, 0, dims[width])


def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> SparsePrefillOutput:
    """``flash_mla_sparse_fwd``: the prefill view, FlashMLA's argument order and result order (the glossary's
    argument names: ``scale`` for its ``sm_scale``).

    Args:
        q: ``[S_q, H_q, D_qk]`` float (bf16 in the kernel; ``D_qk`` 576 for V3.2, 512 for V4).
        kv: ``[S_kv, H_kv, D_qk]`` float (bf16 in the kernel; vLLM passes the dequantized, gathered cache).
        indices: ``[S_q, H_kv, K]`` int32; invalid entries are ``-1`` or any value ``>= S_kv`` (or ``< 0``).
        scale: the softmax scale (FlashMLA's ``sm_scale``, its fourth positional argument).
        d_v: 512 in the kernel.
        attn_sink: optional ``[H_q]`` float32.
        topk_length: optional ``[S_q]`` int32.

    Returns:
        ``out [S_q, H_q, d_v]``, ``max_logits [S_q, H_q]`` (``-inf`` on empty rows), ``lse [S_q, H_q]`` (``+inf``
        on empty rows), float64. Source: ``flash_mla/flash_mla_interface.py`` and ``tests/ref.py``.
    """
    out, lse, max_logits = sparse_attention(
        q, kv, indices, scale=scale, d_v=d_v, topk_length=topk_length, attn_sink=attn_sink
    )
    return SparsePrefillOutput(out, max_logits, lse)


def _flat_cache(name: str, cache: torch.Tensor, dims: Dims, prefix: str) -> torch.Tensor:
    """``[NB, P, D]`` or FlashMLA's ``[NB, P, 1, D]`` -> ``[NB * P, 1, D]``."""
    if isinstance(cache, torch.Tensor) and cache.dim() == 4:
        dims.tensor(name, cache, (f"{prefix}NB", f"{prefix}P", 1, "D_qk"), FLOAT)
    else:
        dims.tensor(name, cache, (f"{prefix}NB", f"{prefix}P", "D_qk"), FLOAT)
    return cache.reshape(-1, 1, cache.shape[-1])


def _check_decode_indices(name: str, indices: torch.Tensor, lengths: torch.Tensor | None, slots: int) -> None:
    used = torch.ones_like(indices, dtype=torch.bool)
    if lengths is not None:
        used = torch.arange(indices.shape[-1], device=indices.device)[None, None, :] < lengths[:, None, None]
    bad = used & (indices != -1) & ((indices < 0) | (indices >= slots))
    if bool(bad.any()):
        where = tuple(int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{name} must be -1 or a slot in [0, NB * P = {slots}) within topk_length; "
            f"got {int(indices[where])} at {list(where)}"
        )


def sparse_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    scale: float | None = None,
    d_v: int = 512,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> SparseDecodeOutput:
    """``flash_mla_with_kvcache(..., indices=...)``: the decode view over a paged, already-dequantized cache.

    ``indices[b, s, t]`` is a *global* slot ``block * P + offset`` into the whole cache (no block table): see
    :func:`global_slot_indices`. The fp8 cache (656 bytes per token for V3.2, 584 for V4) is dequantized first by
    the caller, e.g. with :mod:`mlaspec.spec.cache_layouts`.

    Args:
        q: ``[B, S_q, H_q, D_qk]`` float (``S_q > 1`` for MTP; vLLM's V4 passes ``[T, 1, H_q, D_qk]``).
        kv_cache: ``[NB, P, D_qk]`` or ``[NB, P, 1, D_qk]`` float (``H_kv = 1``).
        indices: ``[B, S_q, K]`` int; ``-1`` is the only invalid value; others must be in ``[0, NB * P)``.
        scale: the softmax scale (FlashMLA's ``softmax_scale``); default ``D_qk ** -0.5`` as FlashMLA.
        d_v: the value width (FlashMLA's ``head_dim_v``), 512.
        topk_length: optional ``[B]`` int in ``[0, K]``, one per request (shared by its ``S_q`` queries).
        attn_sink: optional ``[H_q]`` float.
        extra_kv_cache: optional second paged cache ``[NB_extra, P_extra, D_qk]`` (V4: the compressed cache).
        extra_indices: ``[B, S_q, K_extra]`` int, global slots into ``extra_kv_cache``.
        extra_topk_length: optional ``[B]`` int.

    Returns:
        ``out [B, S_q, H_q, D_v]`` and ``lse [B, H_q, S_q]`` (``+inf`` on empty rows), float64.
        Source: ``flash_mla/flash_mla_interface.py``, ``csrc/api/sparse_decode.h``, ``tests/ref.py``.
    """
    dims = Dims()
    dims.tensor("q", q, ("B", "S_q", "H_q", "D_qk"), FLOAT)
    cache = _flat_cache("kv_cache", kv_cache, dims, "")
    dims.tensor("indices", indices, ("B", "S_q", "K"), INT)
    b, s_q = dims["B"], dims["S_q"]
    if topk_length is not None:
        dims.tensor("topk_length", topk_length, ("B",), INT)
    _check_decode_indices("indices", indices, topk_length, cache.shape[0])
    scale = dims["D_qk"] ** -0.5 if scale is None else scale

    def per_query(lengths):  # [B] -> [B * S_q]: every query of a request shares its length
        return None if lengths is None else lengths.repeat_interleave(s_q)

    extra = None
    if extra_kv_cache is not None:
        extra = _flat_cache("extra_kv_cache", extra_kv_cache, dims, "extra_")
        if extra_indices is None:
            raise ValueError("extra_indices must be given with extra_kv_cache")
        dims.tensor("extra_indices", extra_indices, ("B", "S_q", "K_extra"), INT)
        if extra_topk_length is not None:
            dims.tensor("extra_topk_length", extra_topk_length, ("B",), INT)
        _check_decode_indices("extra_indices", extra_indices, extra_topk_length, extra.shape[0])
        extra_indices = extra_indices.reshape(b * s_q, 1, -1)
    elif extra_indices is not None or extra_topk_length is not None:
        raise ValueError("extra_indices and extra_topk_length need extra_kv_cache")

    out, lse, _ = sparse_attention(
        q.reshape(b * s_q, *q.shape[2:]),
        cache,
        indices.reshape(b * s_q, 1, -1),
        scale=scale,
        d_v=d_v,
        topk_length=per_query(topk_length),
        attn_sink=attn_sink,
        extra_kv=extra,
        extra_indices=extra_indices,
        extra_topk_length=per_query(extra_topk_length),
    )
    out = out.reshape(b, s_q, *out.shape[1:])
    lse = lse.reshape(b, s_q, -1).transpose(1, 2)  # the kernel's [B, S_q, H_q] buffer, returned transposed
    return SparseDecodeOutput(out, lse)


def global_slot_indices(
    local_indices: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Per-request positions to global cache slots: ``block_table[req, pos // P] * P + pos % P``; ``-1`` stays.

    This is vLLM's ``compute_global_topk_indices_and_lens`` (``vllm/models/deepseek_v4/common/ops/cache_utils.py``)
    and the slot rule of ``_compute_swa_indices_and_lens_kernel`` (``backends/mla/sparse_swa.py``); any negative
    local index is treated as padding.

    Args:
        local_indices: ``[T, K]`` int, positions within each token's request (``< 0`` = padding).
        token_to_req: ``[T]`` int, the request of each token.
        block_table: ``[B, max_blocks]`` int, physical block of each logical block; ``>= 0`` wherever a valid
            local index reads it (``-1`` columns past a request's pages are fine while nothing reads them).
        block_size: ``P``, tokens per block.

    Returns:
        ``[T, K]`` int32 global slots, ``-1`` where padding.
    """
    dims = Dims()
    dims.tensor("local_indices", local_indices, ("T", "K"), INT)
    dims.tensor("token_to_req", token_to_req, ("T",), INT)
    dims.tensor("block_table", block_table, ("B", "max_blocks"), INT)
    p = positive_int("block_size", block_size)
    if token_to_req.numel() and (int(token_to_req.min()) < 0 or int(token_to_req.max()) >= dims["B"]):
        raise ValueError(f"token_to_req must lie in [0, B={dims['B']}), got {token_to_req.tolist()}")
    valid = local_indices >= 0
    logical = torch.where(valid, local_indices.long(), 0) // p
    if bool((valid & (logical >= dims["max_blocks"])).any()):
        raise ValueError(f"local_indices must be < max_blocks * block_size = {dims['max_blocks'] * p}")
    blocks = block_table.long()[token_to_req.long()[:, None], logical]
    if bool((valid & (blocks < 0)).any()):
        raise ValueError(
            f"block_table must hold page ids >= 0 where a local index reads it, got {block_table.tolist()}"
        )
    slots = blocks * p + torch.where(valid, local_indices.long(), 0) % p
    return torch.where(valid, slots, -1).to(torch.int32)
