"""One MLA attention step over a mixed batch (decodes, MTP decodes, chunked prefills) on a paged cache.

Implements :func:`mlaspec.spec.chunked_context.mla_mixed_batch` the way vLLM's ``MLACommonImpl.forward`` runs it
(``vllm/model_executor/layers/attention/mla_attention.py``): the batch is reordered decodes first, the new tokens'
``[kv_c | k_pe]`` are written into the cache (``concat_and_cache_mla``), then

* **decodes** (leading requests with ``query_len <= decode_threshold``; MTP queries too) run the absorbed form over
  the paged cache: ``ql_nope = q_nope W_UK`` (:func:`absorb_query`: a torch matmul, rounded to the activation
  dtype), the split-KV decode kernel :func:`mlaspec.impl.decode.mla_decode_paged` over the 576-wide entries, and
  ``o_lat W_UV`` (:func:`unabsorb_output`);
* **prefills** run the compute-friendly form with their context in workspace-sized chunks (vLLM's
  ``_compute_prefill_context``; :func:`chunked_prefill`, which also serves the harness's
  ``chunked_prefill_attention`` on its own): per chunk, :func:`mlaspec.impl.cache.gather_cache` copies each
  prefill's slice of context (``seq_starts``) into the workspace, the latent is up-projected (``k_nope = kv_c
  W_UK``, ``v = kv_c W_UV`` in the activation dtype), :func:`mlaspec.impl.prefill.flash_attn_varlen` attends
  without a mask and returns the LSE, and :func:`mlaspec.impl.merge.merge_attn_states` folds the chunk into the
  running result; the new tokens attend causally last and are merged in the same way (``_forward_prefill``).

The result is one ``out [T, H_q, D_v]`` in the batch's token order and ``lse [H_q, T]`` fp32 (natural log).

Decodes of different query lengths share one launch: each request's queries are placed at the *end* of a
``max_query_len``-long row block (the kernel's causal rule aligns queries to the end of the sequence), and the
padding rows in front are dropped afterwards.

The chunk plan follows vLLM's builder: ``W = round_down(workspace_size // #prefills_with_context, block_size)``,
chunk ``i`` covers context positions ``[i W, (i + 1) W)`` of every prefill; the width comes from the spec's
:func:`mlaspec.spec.chunked_context.plan_context_chunks` (host-side input preparation). The split is plain integer
arithmetic on the query lengths; the arithmetic of the attention is this module's and the kernels'.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mlaspec.spec.chunked_context import plan_context_chunks

from .cache import concat_and_cache_mla, gather_cache
from .decode import mla_decode_paged
from .merge import merge_attn_states
from .prefill import flash_attn_varlen

__all__ = [
    "LayerOutput",
    "absorb_query",
    "chunked_prefill",
    "context_chunks",
    "mla_mixed_batch_layer",
    "split_decodes",
    "unabsorb_output",
]


class LayerOutput(NamedTuple):
    """``out [T, H_q, D_v]`` in the activation dtype and ``lse [H_q, T]`` fp32 (natural log), in token order."""

    out: torch.Tensor
    lse: torch.Tensor


def split_decodes(query_lens: list[int], decode_threshold: int) -> int:
    """How many leading requests are decodes: those before the first ``query_len > decode_threshold``."""
    for b, q in enumerate(query_lens):
        if q > decode_threshold:
            return b
    return len(query_lens)


def context_chunks(context_lens: list[int], workspace_size: int, block_size: int) -> tuple[int, int]:
    """``(W, n)``: the chunk width every prefill gets and the number of chunks (``(0, 0)`` without context).

    ``W = round_down(workspace_size // #(context_lens > 0), block_size)``, ``n = ceil(max(context_lens) / W)``: the
    spec's plan (:func:`mlaspec.spec.chunked_context.plan_context_chunks`), which raises ``ValueError`` when ``W``
    would be 0.
    """
    plan = plan_context_chunks(list(context_lens), workspace_size, block_size)
    return plan.max_context_chunk, plan.num_chunks


def _up_project(kv_c: torch.Tensor, k_pe: torch.Tensor, W_UK: torch.Tensor, W_UV: torch.Tensor, dtype):
    """``[S, Lkv]``, ``[S, D_rope]`` -> ``k [S, H_q, D_nope + D_rope]``, ``v [S, H_q, D_v]`` in ``dtype`` (fp32
    matmul, then rounded)."""
    n = W_UK.shape[1]
    k_nope = torch.einsum("sl,lnp->snp", kv_c.float(), W_UK.float()).to(dtype)
    v = torch.einsum("sl,lnv->snv", kv_c.float(), W_UV.float()).to(dtype)
    k = torch.cat([k_nope, k_pe.to(dtype)[:, None].expand(-1, n, -1)], -1)
    return k, v


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, W_UK: torch.Tensor) -> torch.Tensor:
    """``[q_nope W_UK^T, q_pe]``: ``[..., H_q, D_nope]``, ``[..., H_q, D_rope]`` -> ``[..., H_q, Lkv + D_rope]`` in
    q_nope's dtype.

    vLLM's ``_forward_decode`` absorbs ``W_UK`` with a torch (cuBLAS) bmm and hands the kernel the result rounded to
    the activation dtype; here an fp32 matmul, then rounded. Reads ``T H_q D_nope + Lkv H_q D_nope``, writes ``T H_q
    Lkv``.
    """
    dtype = q_nope.dtype
    ql_nope = torch.einsum("...np,lnp->...nl", q_nope.float(), W_UK.float()).to(dtype)
    return torch.cat([ql_nope, q_pe.to(dtype)], -1)


def unabsorb_output(o_lat: torch.Tensor, W_UV: torch.Tensor) -> torch.Tensor:
    """``o_lat W_UV`` per head: ``[..., H_q, Lkv]`` -> ``[..., H_q, D_v]`` in o_lat's dtype (fp32 matmul, then rounded,
    as vLLM's ``_v_up_proj`` bmm). Reads ``T H_q Lkv + Lkv H_q D_v``, writes ``T H_q D_v``."""
    return torch.einsum("...nl,lnv->...nv", o_lat.float(), W_UV.float()).to(o_lat.dtype)


def _decodes(q_nope, q_pe, kv_cache, block_table, seq_lens, query_lens, W_UK, W_UV, *, scale):
    """The absorbed form for ``B_d`` decodes: ``out [T_d, H_q, D_v]``, ``lse [H_q, T_d]``."""
    dev = q_nope.device
    n_dec = len(query_lens)
    s_max = max(query_lens)
    t_d = sum(query_lens)
    q = absorb_query(q_nope, q_pe, W_UK)  # [T_d, H_q, Lkv + D_rope]
    # each request's queries at the end of its row block of s_max rows (causal alignment), zeros in front
    req = torch.repeat_interleave(torch.arange(n_dec), torch.tensor(query_lens))
    first = torch.tensor(query_lens).cumsum(0) - torch.tensor(query_lens)
    row = s_max - torch.tensor(query_lens)[req] + torch.arange(t_d) - first[req]
    flat = (req * s_max + row).to(dev)
    q_pad = q.new_zeros(n_dec * s_max, *q.shape[1:])
    q_pad[flat] = q
    o_lat, lse = mla_decode_paged(
        q_pad.view(n_dec, s_max, *q.shape[1:]),
        kv_cache,
        block_table,
        seq_lens,
        d_v=W_UK.shape[0],
        scale=scale,
        causal=True,
    )
    o_lat = o_lat.reshape(n_dec * s_max, *o_lat.shape[2:])[flat]  # [T_d, H_q, Lkv]
    lse = lse.transpose(1, 2).reshape(n_dec * s_max, -1)[flat].T  # [H_q, T_d]
    return unabsorb_output(o_lat, W_UV), lse


def chunked_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
    *,
    scale: float,
    chunk_width: int,
) -> LayerOutput:
    """Prefills with chunked context (vLLM's ``_forward_prefill``): the context chunk by chunk, then the new tokens.

    Implements :func:`mlaspec.spec.chunked_context.chunked_prefill_attention` over a paged cache. Chunk ``i``
    covers context positions ``[i W, (i + 1) W)`` of every prefill (``W = chunk_width``, vLLM's
    ``max_context_chunk``); :func:`mlaspec.impl.cache.gather_cache` packs each prefill's slice into the workspace,
    the latent is up-projected (``k_nope = kv_c W_UK``, ``v = kv_c W_UV``, fp32 matmul rounded to the activation
    dtype), :func:`mlaspec.impl.prefill.flash_attn_varlen` attends without a mask and
    :func:`mlaspec.impl.merge.merge_attn_states` folds the chunk into the running result (a prefill with nothing in
    a chunk is an empty part: output 0, LSE ``-inf``); the new tokens attend causally last and are merged the same
    way.

    Args:
        q_nope: ``[T_p, H_q, D_nope]`` bf16/fp16/fp32. q_pe: ``[T_p, H_q, D_rope]``, rotated. Packed by ``query_lens``.
        kv_c: ``[T_p, Lkv]``. k_pe: ``[T_p, D_rope]``: the new tokens' latents and rotated rope keys.
        kv_cache: ``[NB, P, Lkv + D_rope]`` in the activation dtype, holding every prefill's context.
        block_table: ``[B_p, M]`` int32, the prefills' pages; columns past a prefill's context are never read.
        query_lens: ``B_p`` new-token counts. context_lens: ``B_p`` context lengths (cached tokens).
        W_UK: ``[Lkv, H_q, D_nope]``. W_UV: ``[Lkv, H_q, D_v]``. ``D_nope + D_rope <= 256`` and ``D_v <= 256`` (the
            varlen kernel).
        scale: softmax scale.
        chunk_width: ``W`` (> 0 when any context is non-empty; any value otherwise).

    Returns:
        :class:`LayerOutput` ``(out [T_p, H_q, D_v], lse [H_q, T_p])``.
    """
    dtype, dev = q_nope.dtype, q_nope.device
    lkv = W_UK.shape[0]
    q = torch.cat([q_nope, q_pe.to(dtype)], -1)  # [T_p, H_q, D_nope + D_rope]
    cu_q = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    max_q = max(query_lens, default=0)
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    longest = max(context_lens, default=0)
    if longest and chunk_width <= 0:
        raise ValueError(f"chunk_width must be > 0 when a prefill has context, got {chunk_width}")
    run = None  # (out, lse) over the context chunks so far
    for start in range(0, longest, max(chunk_width, 1)):
        # the chunk [start, start + W) of each prefill's context, packed into the workspace
        lens = (ctx.clamp(max=start + chunk_width) - start).clamp(min=0)
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
        starts = torch.full((len(context_lens),), start, dtype=torch.int32)
        ws = gather_cache(kv_cache, block_table, cu_k.to(dev), len(context_lens), starts.to(dev))  # [tot, Lkv + D_rope]
        k, v = _up_project(ws[:, :lkv], ws[:, lkv:], W_UK, W_UV, dtype)
        part = flash_attn_varlen(q, k, v, cu_q, cu_k.to(dev), max_seqlen_q=max_q, scale=scale, causal=False)
        run = tuple(part) if run is None else tuple(merge_attn_states(run[0], run[1], part.out, part.lse))
    k, v = _up_project(kv_c, k_pe, W_UK, W_UV, dtype)  # the new tokens, causal within each prefill
    new = flash_attn_varlen(q, k, v, cu_q, cu_q, max_seqlen_q=max_q, scale=scale, causal=True)
    if run is None:
        return LayerOutput(new.out, new.lse)
    return LayerOutput(*merge_attn_states(run[0], run[1], new.out, new.lse))


def mla_mixed_batch_layer(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
    scale: float,
    workspace_size: int,
    decode_threshold: int = 1,
) -> LayerOutput:
    """One MLA step over a reordered mixed batch (see the module docstring).

    Args:
        q_nope: ``[T, H_q, D_nope]`` bf16/fp16/fp32. q_pe: ``[T, H_q, D_rope]``, rotated. Packed by ``query_start_loc``.
        kv_c: ``[T, Lkv]``. k_pe: ``[T, D_rope]``, rotated: the new tokens' cache entries (``Lkv``, ``D_rope`` powers of
            two >= 16, the decode kernel's split of the entry).
        kv_cache: ``[NB, P, Lkv + D_rope]`` in the activation dtype; written in place at ``slot_mapping``
            (vLLM's order: write, then attend). Slots no request owns may hold anything (NaN included).
        query_start_loc: ``[B + 1]`` int. context_lens: ``[B]`` int (vLLM ``num_computed_tokens``).
        block_table: ``[B, M]`` int, page ids; columns past a request's pages are never read.
        slot_mapping: ``[T]`` int, the new tokens' slots (``-1`` skipped).
        W_UK: ``[Lkv, H_q, D_nope]``. W_UV: ``[Lkv, H_q, D_v]``.
        scale: softmax scale. workspace_size: context workspace rows. decode_threshold: longest decode query.

    Returns:
        :class:`LayerOutput` ``(out [T, H_q, D_v], lse [H_q, T])``.

    Raises:
        ValueError: the batch is not reordered decodes first (a short query with context after a prefill).
    """
    dtype, dev = q_nope.dtype, q_nope.device
    T, H_q, _ = q_nope.shape
    D_v = W_UV.shape[2]
    qsl = [int(x) for x in query_start_loc.tolist()]
    ctx = [int(x) for x in context_lens.tolist()]
    q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    n_dec = split_decodes(q_lens, decode_threshold)
    late = [b for b in range(n_dec, len(q_lens)) if q_lens[b] <= decode_threshold and ctx[b] > 0]
    if late:
        raise ValueError(
            f"query_start_loc: request {late[0]} is a decode after the first prefill; reorder the batch decodes first"
        )
    table = block_table.to(device=dev, dtype=torch.int32)
    concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping.to(dev), out=kv_cache)  # the new tokens, first
    out = torch.empty(T, H_q, D_v, dtype=dtype, device=dev)
    lse = torch.empty(H_q, T, dtype=torch.float32, device=dev)
    d_tok = qsl[n_dec]
    if n_dec and d_tok:
        seq = torch.tensor([c + q for c, q in zip(ctx[:n_dec], q_lens[:n_dec])], dtype=torch.int32, device=dev)
        keep = [b for b in range(n_dec) if q_lens[b]]  # CUDA-graph padding rows (query_len 0) have no output
        sel = torch.tensor(keep, device=dev)
        out[:d_tok], lse[:, :d_tok] = _decodes(
            q_nope[:d_tok],
            q_pe[:d_tok],
            kv_cache,
            table[sel],
            seq[sel],
            [q_lens[b] for b in keep],
            W_UK,
            W_UV,
            scale=scale,
        )
    if n_dec < len(q_lens) and d_tok < T:
        width, _ = context_chunks(ctx[n_dec:], workspace_size, kv_cache.shape[1])
        out[d_tok:], lse[:, d_tok:] = chunked_prefill(
            q_nope[d_tok:],
            q_pe[d_tok:],
            kv_c[d_tok:],
            k_pe[d_tok:],
            kv_cache,
            table[n_dec:],
            q_lens[n_dec:],
            ctx[n_dec:],
            W_UK,
            W_UV,
            scale=scale,
            chunk_width=width,
        )
    return LayerOutput(out, lse)
