"""Paged KV cache: block tables, slot mappings, writing entries (``concat_and_cache_mla``) and gathering them back.

The cache is ``NB`` (vLLM's ``num_blocks``) physical pages of ``P`` (block size) entries each. A request's *logical*
token position ``pos`` lives in logical block ``pos // P`` at offset ``pos % P``; its block table row maps logical
blocks to physical pages, and the flat *slot* of the token is::

    slot = block_table[b, pos // P] * P + pos % P          # slot -1 = padding: written nowhere, read as nothing

An MLA cache entry is one token's ``D_qk = 576`` values: the normed latent ``kv_c`` (512) first, then the RoPE'd
``k_pe`` (64) -- vLLM ``csrc/cache_kernels.cu`` ``concat_and_cache_mla_kernel`` copies ``kv_c`` to ``[0, 512)`` and
``k_pe`` to ``[512, 576)``.

Conventions and sources (vLLM 0.33):

* Slot mapping: ``vllm/v1/worker/block_table.py`` ``ComputeSlotMappingKernel`` (``slot = block_number * P +
  pos % P`` per request's query tokens ``query_start_loc[b]:query_start_loc[b+1]``; tokens past the real ones are
  padded with ``PAD_SLOT_ID = -1`` for CUDA graphs, ``vllm/v1/attention/backends/utils.py``). Decode context
  parallelism (DCP) is not modelled.
* Writing: ``concat_and_cache_mla`` skips ``slot < 0``; ``kv_cache_dtype="fp8"/"fp8_e4m3"`` stores
  ``e4m3(x / scale)`` for all 576 values (see :mod:`mlaspec.spec.cache_layouts`); ``"fp8_ds_mla"`` the 656-byte
  record, its RoPE part in ``k_pe``'s dtype (fp16 input: fp16 RoPE bytes, ``FP8_DS_MLA_V32_FP16``; otherwise bf16,
  ``FP8_DS_MLA_V32``), and it takes and ignores ``scale``: vLLM passes the layer's ``k_scale`` (``[1]`` fp32, 1.0
  unless scales are calibrated) to every cache dtype, and ``concat_and_cache_ds_mla_kernel`` never reads it (its
  scales are per 128 values, computed from the data).
* The ``fp8_ds_mla`` scale rule depends on the vLLM version, so the writer takes it as ``pow2_scales``: ``False``
  (default) is vLLM 0.33.0's raw ``max(amax / 448, FLT_MIN)`` (``concat_and_cache_ds_mla_kernel``,
  ``csrc/libtorch_stable/cache_kernels.cu`` at ``00eb0c87``); ``True`` is vLLM after PR #49435
  (https://github.com/vllm-project/vllm/pull/49435, "Fix SM100 fp8_ds_mla cache scales"), which rounds every group
  scale up to a power of two, ``2^ceil(log2(max(amax / 448, 1e-4)))``, FlashMLA's ``tests/quant.py`` rule (see
  :func:`mlaspec.spec.cache_layouts.quantize`). Example (vLLM's ``tests/kernels/attention/test_flashmla_sparse.py``
  ``test_sparse_flashmla_decode_matches_cache_writer_scales``): a group with ``amax = 336`` stores the scale
  ``0.75`` under vLLM 0.33 and ``1.0`` after the PR; an all-zero group stores ``FLT_MIN`` and ``2^-13``.
* Gathering for chunked-prefill context: vLLM 0.33's MLA (``vllm/model_executor/layers/attention/mla_attention.py``,
  ``_compute_prefill_context``) gathers each context chunk with ``ops.gather_and_maybe_dequant_cache`` (bf16 / fp8
  with per-tensor dequant), ``ops.cp_gather_cache`` (fp8 prefill: raw copy) or ``cp_gather_and_upconvert_fp8_kv_cache``
  (``fp8_ds_mla``). All read request ``b``'s tokens ``seq_starts[b] + i`` for ``i < cu_seq_lens[b+1] -
  cu_seq_lens[b]`` into output rows ``cu_seq_lens[b] + i``, where ``seq_starts[b]`` is the chunk's start *in tokens*
  within the request's context (``chunk.starts``). ``cp_gather_cache`` accepts any start; the older
  ``gather_and_maybe_dequant_cache`` offsets the block table by ``seq_starts[b] // P`` whole blocks and so needs
  block-aligned starts (vLLM aligns its chunks for it). :func:`gather_cache` models both and rejects unaligned starts
  for the latter instead of reading the wrong tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import cache_layouts
from .checks import FLOAT, INT, Dims, boolean, choice, cu_seqlens, positive_int, positive_scale

__all__ = [
    "GatheredCache",
    "PagedEntries",
    "SlotMapping",
    "TokenPositions",
    "concat_and_cache_mla",
    "gather_cache",
    "page_entries",
    "slot_mapping_from_block_table",
    "token_positions",
]

PAD_SLOT_ID = -1
_INDEX = (torch.int64, torch.int32)


class TokenPositions(NamedTuple):
    """``positions [T]`` int64 (logical position of each query token) and ``req_indices [T]`` int64."""

    positions: torch.Tensor
    req_indices: torch.Tensor


class SlotMapping(NamedTuple):
    """``slot_mapping [T_pad]`` int64 and its ``block_ids`` / ``block_offsets`` ``[T_pad]`` int64 (-1 on padding)."""

    slot_mapping: torch.Tensor
    block_ids: torch.Tensor
    block_offsets: torch.Tensor


class GatheredCache(NamedTuple):
    """``entries [T, *entry]`` (the cache's dtype, copied bit for bit) and the ``slots [T]`` int64 they came from."""

    entries: torch.Tensor
    slots: torch.Tensor


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> TokenPositions:
    """Positions of the scheduled (query) tokens: the last ``q_b`` positions of each request's ``seq_lens[b]``.

    ``q_b = query_start_loc[b+1] - query_start_loc[b]``; token ``i`` of request ``b`` is at position
    ``seq_lens[b] - q_b + i`` (new tokens come after the context, as in vLLM's ``CommonAttentionMetadata``).

    Args:
        query_start_loc: ``[B + 1]`` int, starts at 0, non-decreasing.
        seq_lens: ``[B]`` int, ``seq_lens[b] >= q_b`` (context + new tokens).
    """
    qsl = cu_seqlens("query_start_loc", query_start_loc)
    b = qsl.numel() - 1
    Dims().bind("query_start_loc", B=b).tensor("seq_lens", seq_lens, ("B",), INT)
    q_lens = (qsl[1:] - qsl[:-1]).to(torch.int64)
    s = seq_lens.to(torch.int64)
    if bool((s < q_lens).any()):
        raise ValueError(f"seq_lens must be >= the query lengths {q_lens.tolist()}, got {s.tolist()}")
    req = torch.repeat_interleave(torch.arange(b, device=qsl.device), q_lens)
    within = torch.arange(int(qsl[-1]), device=qsl.device) - qsl.to(torch.int64)[req]
    return TokenPositions((s - q_lens)[req] + within, req)


def slot_mapping_from_block_table(
    block_table: torch.Tensor,
    block_size: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    *,
    num_blocks: int | None = None,
    pad_to: int | None = None,
) -> SlotMapping:
    """Slot of every scheduled token, as vLLM's ``ComputeSlotMappingKernel`` (without DCP).

    Pseudocode::

        for b in range(B):
            for t in range(query_start_loc[b], query_start_loc[b + 1]):
                pos = positions[t]
                slot[t] = block_table[b, pos // P] * P + pos % P
        slot[T:pad_to] = -1                                   # CUDA-graph padding

    Args:
        block_table: ``[B, max_blocks]`` int; physical page of each logical block (entries past a request's
            blocks are unused and not checked).
        block_size: ``P``.
        query_start_loc: ``[B + 1]`` int, starts at 0, non-decreasing, ends at ``T``.
        positions: ``[T]`` int, non-negative logical positions (see :func:`token_positions`).
        num_blocks: if given, every page used must be in ``[0, num_blocks)``.
        pad_to: total length ``>= T`` of the returned mapping; the tail is ``-1``.

    Returns:
        ``slot_mapping``, ``block_ids``, ``block_offsets``, each ``[pad_to or T]`` int64 (``-1`` on padding).
    """
    p = positive_int("block_size", block_size)
    dims = Dims()
    dims.tensor("block_table", block_table, ("B", "max_blocks"), INT)
    qsl = cu_seqlens("query_start_loc", query_start_loc, batch=dims["B"], batch_from="block_table")
    dims.tensor("positions", positions, ("T",), INT)
    t = dims["T"]
    if int(qsl[-1]) != t:
        raise ValueError(f"query_start_loc must end at T={t} (from positions), got {qsl.tolist()}")
    pos = positions.to(torch.int64)
    if bool((pos < 0).any()):
        raise ValueError(f"positions must be >= 0, got {pos.tolist()}")
    req = torch.repeat_interleave(torch.arange(dims["B"], device=pos.device), (qsl[1:] - qsl[:-1]).to(torch.int64))
    logical = pos // p
    if bool((logical >= dims["max_blocks"]).any()):
        raise ValueError(
            f"positions need logical blocks up to {int(logical.max())} but block_table has max_blocks="
            f"{dims['max_blocks']} (block_size={p})"
        )
    block_ids = block_table.to(torch.int64)[req, logical]
    if num_blocks is not None:
        positive_int("num_blocks", num_blocks, minimum=0)
    _check_pages("block_table", block_ids, num_blocks)
    total = t if pad_to is None else positive_int("pad_to", pad_to, minimum=t)
    pad = torch.full((total - t,), PAD_SLOT_ID, dtype=torch.int64, device=pos.device)
    offsets = pos % p
    return SlotMapping(
        torch.cat([block_ids * p + offsets, pad]), torch.cat([block_ids, pad]), torch.cat([offsets, pad])
    )


def _check_pages(name: str, pages: torch.Tensor, num_blocks: int | None, bound: str = "num_blocks") -> None:
    if bool((pages < 0).any()):
        raise ValueError(f"{name} must hold page ids >= 0 where it is used, got {pages.tolist()}")
    if num_blocks is not None and bool((pages >= num_blocks).any()):
        raise ValueError(f"{name} must hold page ids < {bound}={num_blocks} where it is used, got {pages.tolist()}")


_QUANTIZED = {
    "fp8": cache_layouts.FP8_PER_TENSOR,
    "fp8_e4m3": cache_layouts.FP8_PER_TENSOR,
    "fp8_e5m2": cache_layouts.FP8_E5M2_PER_TENSOR,
    "fp8_ds_mla": cache_layouts.FP8_DS_MLA_V32,
}


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    scale: float | torch.Tensor | None = None,
    pow2_scales: bool = False,
) -> torch.Tensor:
    """Write ``[kv_c | k_pe]`` entries into the slots of a paged cache; returns the NEW cache (the input is untouched).

    Pseudocode (vLLM ``concat_and_cache_mla_kernel``)::

        new = kv_cache.clone()
        for t in range(T):
            if slot_mapping[t] < 0: continue                  # padding token
            blk, off = divmod(slot_mapping[t], P)
            new[blk, off] = encode(concat(kv_c[t], k_pe[t]))  # latent [0, 512), rope [512, 576)

    ``encode`` is a cast to the cache dtype for ``"auto"`` (exact for a float64 cache; round-to-nearest-even
    otherwise) and :func:`mlaspec.spec.cache_layouts.quantize` for the fp8 dtypes.

    Args:
        kv_c: ``[T, Lkv]`` float (``Lkv = 512``), the normed latent.
        k_pe: ``[T, D_rope]`` float (``D_rope = 64``), the RoPE'd key part.
        kv_cache: ``[NB, P, Lkv + D_rope]`` float for ``"auto"``; uint8 ``[NB, P, 576]`` for
            ``"fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"``; uint8 ``[NB, P, 656]`` for ``"fp8_ds_mla"``.
        slot_mapping: ``[T]`` int; ``-1`` = padding (skipped); others in ``[0, NB * P)``, no repeats.
        kv_cache_dtype: vLLM's cache dtype string.
        scale: the per-tensor fp32 scale (``k_scale``): required for ``"fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"``;
            accepted and ignored for ``"fp8_ds_mla"`` (as vLLM's kernel does); must be None for ``"auto"``. A
            positive finite number or a one-element float tensor.
        pow2_scales: ``"fp8_ds_mla"`` only: the writer's group scale rule (module docstring). ``False``: vLLM 0.33's
            raw fp32 ``amax / 448``; ``True``: vLLM after PR #49435, the power of two ``2^ceil(log2(max(amax / 448,
            1e-4)))``. Must be False for the other cache dtypes (their scale is the per-tensor ``k_scale``).

    Returns:
        the new cache, same shape and dtype as ``kv_cache``.
    """
    choice("kv_cache_dtype", kv_cache_dtype, ("auto", *sorted(_QUANTIZED)))
    if boolean("pow2_scales", pow2_scales) and kv_cache_dtype != "fp8_ds_mla":
        raise ValueError(f"pow2_scales applies only to kv_cache_dtype='fp8_ds_mla', not {kv_cache_dtype!r}")
    dims = Dims()
    dims.tensor("kv_c", kv_c, ("T", "Lkv"), FLOAT)
    dims.tensor("k_pe", k_pe, ("T", "D_rope"), FLOAT)
    dims.tensor("slot_mapping", slot_mapping, ("T",), _INDEX)
    width = dims["Lkv"] + dims["D_rope"]
    if kv_cache_dtype == "auto":
        dims.tensor("kv_cache", kv_cache, ("NB", "P", width), FLOAT)
    else:
        layout = _QUANTIZED[kv_cache_dtype]
        if kv_cache_dtype == "fp8_ds_mla":
            if k_pe.dtype == torch.float16:  # the RoPE bytes are the input's (concat_and_cache_ds_mla_kernel)
                layout = cache_layouts.FP8_DS_MLA_V32_FP16
            if scale is not None:
                positive_scale("scale", scale)  # vLLM's k_scale: checked, then ignored like the kernel does
                scale = None
        if width != layout.entry_dim:
            raise ValueError(
                f"kv_c and k_pe must be {layout.entry_dim} wide together for {kv_cache_dtype}, got {width}"
            )
        dims.tensor("kv_cache", kv_cache, ("NB", "P", layout.token_bytes), (torch.uint8,))
    total = dims["NB"] * dims["P"]
    s = slot_mapping.to(torch.int64)
    if bool(((s < -1) | (s >= total)).any()):
        raise ValueError(f"slot_mapping must be -1 or in [0, NB * P = {total}), got {s.tolist()}")
    keep = s >= 0
    if int(keep.sum()) != torch.unique(s[keep]).numel():
        raise ValueError(f"slot_mapping must not repeat a slot (the kernel would race), got {s.tolist()}")

    entries = torch.cat([kv_c.to(torch.float64), k_pe.to(torch.float64)], dim=1)[keep]  # [T_kept, 576]
    new = kv_cache.clone()
    flat = new.view(total, -1)
    if kv_cache_dtype == "auto":
        if scale is not None:
            raise ValueError("scale must be None for kv_cache_dtype='auto'")
        flat[s[keep]] = entries.to(kv_cache.dtype)
    else:
        flat[s[keep]] = cache_layouts.quantize(entries, layout, scale=scale, pow2_scales=pow2_scales).raw
    return new


def gather_cache(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    batch_size: int | None = None,
    seq_starts: torch.Tensor | None = None,
    *,
    kernel: str = "cp_gather_cache",
) -> GatheredCache:
    """Gather each request's cache entries into one packed ``[T, ...]`` tensor (vLLM's context-chunk gather).

    Pseudocode (``cp_gather_cache`` in vLLM ``csrc/cache_kernels.cu``)::

        for b in range(batch_size):
            for i in range(cu_seq_lens[b + 1] - cu_seq_lens[b]):
                pos  = seq_starts[b] + i                      # 0 when seq_starts is None
                page = block_table[b, pos // P]
                out[cu_seq_lens[b] + i] = kv_cache[page, pos % P]

    ``kernel="gather_and_maybe_dequant_cache"`` is the same gather with the block table offset by whole blocks
    (``seq_starts[b] // P``); the spec then requires ``seq_starts[b] % P == 0``. Dequantization (that kernel's fp8
    path) is separate: :func:`mlaspec.spec.cache_layouts.dequantize` on the gathered bytes.

    Args:
        kv_cache: ``[NB, P, *entry]`` any dtype (float ``[.., 576]``, or uint8 records).
        block_table: ``[B, max_blocks]`` int; only the entries a request actually reads are checked and must be
            in ``[0, NB)``.
        cu_seq_lens: ``[B + 1]`` int, starts at 0, non-decreasing; ``T = cu_seq_lens[-1]``.
        batch_size: ``B`` (vLLM passes it separately); must equal ``block_table.shape[0]`` when given.
        seq_starts: optional ``[B]`` int >= 0, the first logical position read for each request (tokens).
        kernel: ``"cp_gather_cache"`` (any start) or ``"gather_and_maybe_dequant_cache"`` (block-aligned starts).

    Returns:
        ``entries [T, *entry]`` (a copy, same dtype as the cache) and ``slots [T]`` int64.
    """
    choice("kernel", kernel, ("cp_gather_cache", "gather_and_maybe_dequant_cache"))
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() < 3:
        raise ValueError(f"kv_cache must have shape [NB, P, *entry], got {list(kv_cache.shape)}")
    dims = Dims(NB=kv_cache.shape[0], P=kv_cache.shape[1])
    dims.tensor("block_table", block_table, ("B", "max_blocks"), INT)
    b = dims["B"]
    if batch_size is not None and positive_int("batch_size", batch_size, minimum=0) != b:
        raise ValueError(f"batch_size must equal block_table.shape[0]={b}, got {batch_size}")
    cu = cu_seqlens("cu_seq_lens", cu_seq_lens, batch=b, batch_from="block_table").to(torch.int64)
    p = dims["P"]
    lens = cu[1:] - cu[:-1]
    if seq_starts is None:
        starts = torch.zeros(b, dtype=torch.int64, device=cu.device)
    else:
        starts = dims.tensor("seq_starts", seq_starts, ("B",), INT).to(torch.int64)
        if bool((starts < 0).any()):
            raise ValueError(f"seq_starts must be >= 0, got {starts.tolist()}")
        if kernel == "gather_and_maybe_dequant_cache" and bool((starts % p != 0).any()):
            raise ValueError(
                f"seq_starts must be multiples of block_size P={p} for gather_and_maybe_dequant_cache "
                f"(it offsets the block table by whole blocks), got {starts.tolist()}"
            )
    need = starts + lens  # one past the last logical position each request reads
    if bool((-(-need // p) > dims["max_blocks"]).any()):
        raise ValueError(
            f"seq_starts + lengths need up to {int((-(-need // p)).max())} blocks per request but block_table has "
            f"max_blocks={dims['max_blocks']} (P={p}); starts={starts.tolist()}, lengths={lens.tolist()}"
        )
    req = torch.repeat_interleave(torch.arange(b, device=cu.device), lens)
    pos = starts[req] + torch.arange(int(cu[-1]), device=cu.device) - cu[:-1][req]
    pages = block_table.to(torch.int64)[req, pos // p]
    _check_pages("block_table", pages, dims["NB"], "NB (pages of kv_cache)")
    slots = pages * p + pos % p
    entries = kv_cache.reshape(dims["NB"] * p, *kv_cache.shape[2:])[slots].clone()
    return GatheredCache(entries, slots)


class PagedEntries(NamedTuple):
    """``cache [NB, P, *entry]`` (``kv``'s dtype), ``block_table [B, pages (+ 1)]`` int32, ``seq_lens [B]``
    int32, all on ``kv``'s device."""

    cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor


def page_entries(
    kv: torch.Tensor,
    page_size: int,
    *,
    seq_lens: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    spare_pages: int = 1,
    fill: float = math.nan,
    spare_column: bool = False,
) -> PagedEntries:
    """Scatter gathered entries ``kv [B, S_kv, *entry]`` into a paged cache that is hostile wherever it is not read.

    The inverse of :func:`gather_cache`, for handing a paged kernel the entries a case gives densely. Physical
    pages are drawn at random, so a kernel that ignores the block table reads the wrong tokens; every slot past a
    request's length, and ``spare_pages`` pages nobody owns, hold ``fill`` (NaN, or ``0xFF`` -- the e4m3 NaN -- for
    a byte cache), so a kernel that reads past ``seq_lens`` poisons its output. Pseudocode::

        pages  = max(1, ceil(S_kv / P))                              per request
        perm   = torch.randperm(B * pages + spare_pages, generator=generator)
        table  = perm[:B * pages].reshape(B, pages)                  request-major: the draws are fixed by the seed
        cache  = full([B * pages + spare_pages, P, *entry], fill)
        for b, t < seq_lens[b]:  cache[table[b, t // P], t % P] = kv[b, t]
        block_table = table, plus a column of -1 if spare_column (a column no kernel may follow)

    Example: ``B = 2, S_kv = 3, P = 2, spare_pages = 1``: ``torch.randperm(5, generator=manual_seed(0))`` is
    ``[4, 0, 1, 3, 2]`` (torch's CPU generator), so ``block_table = [[4, 0], [1, 3]]``; request 0's tokens sit in
    slots ``8, 9, 0``, request 1's in ``2, 3, 6``; slots ``1`` and ``7`` (past the length) and page 2 hold ``fill``.

    Args:
        kv: ``[B, S_kv, *entry]`` any dtype (``entry`` is ``[576]`` for an MLA cache, ``[656]`` for the bytes of the
            656-byte record, or ``[H_kv, D]``).
        page_size: ``P``, tokens per page.
        seq_lens: optional ``[B]`` int in ``[0, S_kv]``, tokens of each request (default ``S_kv`` for all).
        generator: the page permutation's generator (``None``: torch's default generator).
        spare_pages: pages no request owns (``>= 0``).
        fill: the value of every slot not written; an int in the dtype's range for an integer ``kv``.
        spare_column: append a column of ``-1`` to the block table.

    Returns:
        :class:`PagedEntries`: ``cache [B * pages + spare_pages, P, *entry]``, ``block_table [B, pages]`` (``+ 1``
        with ``spare_column``) int32 and ``seq_lens [B]`` int32.
    """
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() < 2:
        raise ValueError(f"kv must have shape [B, S_kv, *entry], got {list(kv.shape)}")
    p = positive_int("page_size", page_size)
    spare = positive_int("spare_pages", spare_pages, minimum=0)
    boolean("spare_column", spare_column)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        raise TypeError(f"fill must be a number, got {type(fill).__name__}")
    if not kv.dtype.is_floating_point:
        info = torch.iinfo(kv.dtype) if kv.dtype != torch.bool else None
        if info is None or not float(fill).is_integer() or not info.min <= fill <= info.max:
            raise ValueError(f"fill must be an int in the range of kv's dtype {kv.dtype}, got {fill!r}")
    b, s_kv = kv.shape[:2]
    # the page table is drawn on the CPU (``generator`` is a CPU generator), whatever the default device
    if seq_lens is None:
        lens = torch.full((b,), s_kv, dtype=torch.int64, device="cpu")
    else:
        dims = Dims()
        dims.tensor("kv", kv, ("B", "S_kv") + (None,) * (kv.dim() - 2))
        lens = dims.tensor("seq_lens", seq_lens, ("B",), INT).to("cpu", torch.int64)
        if bool(((lens < 0) | (lens > s_kv)).any()):
            raise ValueError(f"seq_lens must lie in [0, S_kv={s_kv}], got {lens.tolist()}")
    pages = max(1, -(-s_kv // p))
    total = b * pages + spare
    table = torch.randperm(total, generator=generator, device="cpu")[: b * pages].reshape(b, pages)
    cache = torch.full((total, p, *kv.shape[2:]), fill, dtype=kv.dtype, device=kv.device)
    t = torch.arange(s_kv, device="cpu")
    slots = table[:, t // p] * p + t % p  # [B, S_kv]
    keep = t[None, :] < lens[:, None]
    cache.view(total * p, *kv.shape[2:])[slots[keep].to(kv.device)] = kv[keep.to(kv.device)]
    if spare_column:
        table = torch.cat([table, torch.full((b, 1), -1, dtype=table.dtype, device="cpu")], dim=1)
    return PagedEntries(cache, table.to(torch.int32).to(kv.device), lens.to(torch.int32).to(kv.device))
