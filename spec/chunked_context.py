"""Chunked-prefill context: attention over a long cached context through a fixed-size workspace.

The compute-friendly form up-projects every context token to ``H_q * (D_nope + D_v)`` values, which for a long
context does not fit in memory. vLLM therefore processes the *context* of the prefills in chunks that fit a fixed
workspace of ``workspace_size`` cache entries, and the *new tokens* once with a causal mask, then merges the
pieces by their log-sum-exp::

    plan:  max_context_chunk = round_down(workspace_size // #prefills_with_context, block_size)
           chunk i covers context positions [i * max_context_chunk, (i + 1) * max_context_chunk) of every prefill
    run:   for each chunk i:
               gather each prefill's part of chunk i into the workspace      (seq_tot[i] <= workspace_size rows)
               o_i, lse_i = MHA(q, up-project(workspace part), causal=False)  (a request with no context in the
                                                                               chunk: o = 0, lse = -inf)
               o_ctx, lse_ctx = merge(o_ctx, lse_ctx, o_i, lse_i)            (first chunk initialises)
           o_new, lse_new = MHA(q, up-project(new tokens), causal=True)
           o, lse = merge(prefix = o_ctx, lse_ctx, suffix = o_new, lse_new)

Every query sees its whole context (no mask) plus the new tokens up to itself, so the result equals causal
attention over ``context + new tokens`` (tested as a property). The merge follows vLLM's rules
(:mod:`mlaspec.spec.merge`): an empty part (LSE ``-inf``) gets weight 0, and when every part is empty the first
part's output is kept; the new-token part is never empty (a query sees itself), so the result never is.

:func:`mla_mixed_batch` puts a whole step together: decodes through the absorbed form over their full
sequence, prefills through the chunked compute-friendly form, outputs back in the batch's token order.

Sources: vLLM ``vllm/model_executor/layers/attention/mla_attention.py`` (``MLACommonMetadataBuilder``:
``determine_chunked_prefill_workspace_size``, the chunk plan in ``build``; ``MLACommonImpl``:
``_compute_prefill_context``, ``_forward_prefill``) and, for the older version, the V0 doc seed
``vllm/attention/backends/mla/common.py`` (module docstring "Chunked Prefill", ``MLACommonMetadataBuilder``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from .attention import AttentionOutput
from .batch import CommonAttentionMetadata, SplitCounts, split_decodes_and_prefills
from .checks import FLOAT, INT, Dims, boolean, choice, cu_seqlens, finite_float, positive_int
from .forms import mla_absorbed, mla_mha
from .merge import merge_attn_states

__all__ = [
    "ChunkPlan",
    "ContextSource",
    "MixedBatchOutput",
    "chunked_prefill_attention",
    "chunked_prefill_workspace_size",
    "mla_mixed_batch",
    "plan_context_chunks",
]

# A request's context: either the tensors themselves, per request ``(kv_c [S_ctx_b, Lkv], k_pe [S_ctx_b, D_rope])``, or
# a callable ``gather(request, start, length) -> (kv_c [length, Lkv], k_pe [length, D_rope])`` (e.g. reading a
# paged cache through the block table).
_Entries = tuple[torch.Tensor, torch.Tensor]
ContextSource = Sequence[_Entries] | Callable[[int, int, int], _Entries]


def chunked_prefill_workspace_size(
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    *,
    version: Literal["0.33", "seed"] = "0.33",
) -> int:
    """Rows (cache entries) of the context workspace, as vLLM sizes it.

    Math::

        target = max(8 * max_model_len, 4 * max_num_seqs * block_size)   # 8 full requests, or 4 pages each
        0.33:  max(min(target, 64 * 1024), max_num_seqs * block_size)    # cap 64K, floor: 1 page per request
        seed:  min(target, 128 * 1024)                                   # cap 128K; vLLM asserts
                                                                         #   >= max_num_seqs * block_size

    At 64K rows the workspace holds ``2 * 576 * 64K`` bytes = 72 MiB of bf16 cache entries, and the up-projected
    keys and values of one chunk ``2 * (192 + 128) * 128 * 64K`` bytes = 5 GiB for 128 heads.

    Args:
        max_model_len, max_num_seqs, block_size: the engine's settings (positive ints).
        version: ``"0.33"`` (``vllm/model_executor/layers/attention/mla_attention.py``,
            ``MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size``) or ``"seed"`` (V0
            ``vllm/attention/backends/mla/common.py``, ``MLACommonState.__init__``).

    Raises:
        ValueError: ``"seed"`` where the capped size is below ``max_num_seqs * block_size`` (vLLM's assert).
    """
    positive_int("max_model_len", max_model_len)
    positive_int("max_num_seqs", max_num_seqs)
    positive_int("block_size", block_size)
    target = max(8 * max_model_len, 4 * max_num_seqs * block_size)
    floor = max_num_seqs * block_size
    choice("version", version, ("0.33", "seed"))
    if version == "0.33":
        return max(min(target, 64 * 1024), floor)
    size = min(target, 128 * 1024)  # the seed version
    if size < floor:
        raise ValueError(
            f"max_num_seqs * block_size = {floor} must not exceed the seed's workspace {size} "
            f"(vLLM asserts context_chunk_workspace_size >= max_num_seqs * block_size)"
        )
    return size


@dataclass(frozen=True, eq=False)
class ChunkPlan:
    """How the prefills' contexts are cut into workspace-sized chunks (vLLM ``ChunkedContextMetadata``).

    ``B_p`` prefills, ``n`` chunks (``n = 0`` when no prefill has context; vLLM then has no chunked context):

    * ``context_lens [B_p]`` int64: each prefill's context length.
    * ``workspace_size``, ``block_size``, ``max_context_chunk``: the chunk width every prefill gets.
    * ``starts [n, B_p]`` int64: ``i * max_context_chunk`` (vLLM ``starts``; the same for every request).
    * ``seq_lens [n, B_p]`` int64: ``clamp(min(context_len, start + max_context_chunk) - start, min=0)``.
    * ``cu_seq_lens [n, B_p + 1]`` int64: per chunk, where each request's part lies in the workspace.
    * ``seq_tot``: per chunk, rows of the workspace used (``cu_seq_lens[i, -1]``), each ``<= workspace_size``.
    * ``max_seq_lens``: per chunk, the longest part.
    """

    context_lens: torch.Tensor
    workspace_size: int
    block_size: int
    max_context_chunk: int
    starts: torch.Tensor
    seq_lens: torch.Tensor
    cu_seq_lens: torch.Tensor
    seq_tot: tuple[int, ...]
    max_seq_lens: tuple[int, ...]

    @property
    def num_chunks(self) -> int:
        """``n``."""
        return len(self.seq_tot)

    @property
    def num_prefills(self) -> int:
        """``B_p``."""
        return self.context_lens.numel()


def plan_context_chunks(
    context_lens: Sequence[int] | torch.Tensor,
    workspace_size: int,
    block_size: int,
    *,
    align_to_block: bool = True,
) -> ChunkPlan:
    """Cut the prefills' contexts into chunks that fit the workspace.

    Math::

        w = workspace_size // #(context_lens > 0)          # equal share per prefill with context
        w = round_down(w, block_size)   if align_to_block  # gather kernels need page-aligned chunk starts
        n = ceil(max(context_lens) / w)                    # w is max_context_chunk
        starts[i, b]   = i * w
        seq_lens[i, b] = clamp(min(context_lens[b], starts[i, b] + w) - starts[i, b], min=0)

    So ``seq_tot[i] = sum_b seq_lens[i, b] <= #with_context * w <= workspace_size``.

    Example (``workspace_size = 1024``, ``block_size = 64``, contexts ``[700, 0, 300, 1000]``): three prefills
    with context share it, ``w = round_down(341, 64) = 320``, ``n = ceil(1000 / 320) = 4``::

        seq_lens = [[320, 0, 300, 320],
                    [320, 0,   0, 320],
                    [ 60, 0,   0, 320],
                    [  0, 0,   0,  40]]      seq_tot = [940, 640, 380, 40]

    Args:
        context_lens: ``[B_p]`` int, ``>= 0``: the context of each prefill (in batch order).
        workspace_size: rows of the workspace (:func:`chunked_prefill_workspace_size`).
        block_size: the cache page size.
        align_to_block: round the chunk width down to ``block_size`` (vLLM does on CUDA, ``aot_schedule``).

    Raises:
        ValueError: a negative context length, or a workspace too small to give each prefill with context one
            aligned page (vLLM asserts ``max_context_chunk > 0``).

    Source: vLLM ``vllm/model_executor/layers/attention/mla_attention.py`` (``MLACommonMetadataBuilder.build``).
    """
    if isinstance(context_lens, torch.Tensor):
        ctx = Dims().tensor("context_lens", context_lens, ("B_p",), INT).long()
    else:
        if not isinstance(context_lens, Sequence):
            raise TypeError(
                f"context_lens must be a sequence of ints or an int tensor, got {type(context_lens).__name__}"
            )
        ctx = torch.tensor(
            [positive_int(f"context_lens[{i}]", c, minimum=0) for i, c in enumerate(context_lens)], dtype=torch.int64
        ).reshape(-1)
    if bool((ctx < 0).any()):
        raise ValueError(f"context_lens must be >= 0, got {ctx.tolist()}")
    positive_int("workspace_size", workspace_size)
    positive_int("block_size", block_size)
    boolean("align_to_block", align_to_block)
    b = ctx.numel()
    with_context = int((ctx > 0).sum())
    empty = torch.zeros(0, b, dtype=torch.int64)
    if with_context == 0:
        no_cu = torch.zeros(0, b + 1, dtype=torch.int64)
        return ChunkPlan(ctx, workspace_size, block_size, 0, empty, empty, no_cu, (), ())
    width = workspace_size // with_context
    if align_to_block:
        width = width // block_size * block_size
    if width <= 0:
        raise ValueError(
            f"workspace_size={workspace_size} must give each of the {with_context} prefills with context at least "
            f"one page of block_size={block_size} (max_context_chunk would be {width})"
        )
    n = math.ceil(int(ctx.max()) / width)
    starts = (torch.arange(n, dtype=torch.int64) * width)[:, None].expand(n, b).clone()
    seq_lens = (torch.minimum(ctx[None, :], starts + width) - starts).clamp(min=0)
    cu = torch.zeros(n, b + 1, dtype=torch.int64)
    cu[:, 1:] = torch.cumsum(seq_lens, dim=1)
    seq_tot = tuple(int(x) for x in cu[:, -1])
    max_seq_lens = tuple(int(x) for x in seq_lens.max(dim=1).values) if b else (0,) * n
    return ChunkPlan(ctx, workspace_size, block_size, width, starts, seq_lens, cu, seq_tot, max_seq_lens)


def _check_packed(dims: Dims, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV) -> None:
    """The packed (varlen) MLA tensors of a batch's new tokens, and the up-projections."""
    dims.tensor("q_nope", q_nope, ("T", "H_q", "D_nope"), FLOAT)
    dims.tensor("q_pe", q_pe, ("T", "H_q", "D_rope"), FLOAT)
    dims.tensor("kv_c", kv_c, ("T", "Lkv"), FLOAT)
    dims.tensor("k_pe", k_pe, ("T", "D_rope"), FLOAT)
    dims.tensor("W_UK", W_UK, ("Lkv", "H_q", "D_nope"), FLOAT)
    dims.tensor("W_UV", W_UV, ("Lkv", "H_q", "D_v"), FLOAT)


def _gatherer(context: ContextSource, n_req: int) -> Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]:
    if callable(context):
        return context
    if not isinstance(context, Sequence) or len(context) != n_req:
        got = len(context) if isinstance(context, Sequence) else type(context).__name__
        raise ValueError(f"context must be a callable or a sequence of {n_req} (kv_c, k_pe) pairs, got {got}")

    def gather(b: int, start: int, length: int):
        kv_c, k_pe = context[b]
        return kv_c[start : start + length], k_pe[start : start + length]

    return gather


def _check_context(gather, plan_or_lens: torch.Tensor, lkv: int, r: int) -> None:
    """Each request's context must have the announced length and the latent/rope widths."""
    for b, c in enumerate(plan_or_lens.tolist()):
        kv_c, k_pe = gather(b, 0, c)
        dims = Dims(S_ctx=c, Lkv=lkv, D_rope=r)
        dims.tensor(f"context[{b}] kv_c", kv_c, ("S_ctx", "Lkv"), FLOAT)
        dims.tensor(f"context[{b}] k_pe", k_pe, ("S_ctx", "D_rope"), FLOAT)


def chunked_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context: ContextSource,
    plan: ChunkPlan,
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
    *,
    scale: float,
) -> AttentionOutput:
    """Prefill attention with chunked context: context chunk by chunk (no mask), then the new tokens (causal).

    Math (per prefill ``b`` with queries ``Q_b``, context ``S_ctx_b``, new keys ``K_b``)::

        o, lse = (0, -inf)
        for chunk i in plan:                                     # rows cu_seq_lens[i, b]:cu_seq_lens[i, b+1]
            ws     = [gather(b, starts[i, b], seq_lens[i, b]) for b]               # the workspace
            o_i    = mla_mha(Q_b, ws_b, causal=False)            # seq_lens[i, b] = 0: o_i = 0, lse_i = -inf
            o, lse = o_i, lse_i  if i == 0  else  merge_attn_states(o, lse, o_i, lse_i)
        o_new  = mla_mha(Q_b, K_b, causal=True)
        o, lse = merge_attn_states(prefix=(o, lse), suffix=o_new)     (no context at all: just o_new)

    Args:
        q_nope: ``[T_p, H_q, D_nope]`` float, the prefills' queries (nope part), packed by ``cu_seqlens_q``.
        q_pe: ``[T_p, H_q, D_rope]`` float, rotated.
        kv_c: ``[T_p, Lkv]`` float, the new tokens' latents.
        k_pe: ``[T_p, D_rope]`` float, the new tokens' rotated rope keys.
        cu_seqlens_q: ``[B_p + 1]`` int, starts at 0, ends at ``T_p``.
        context: per prefill ``(kv_c [S_ctx_b, Lkv], k_pe [S_ctx_b, D_rope])`` with
            ``S_ctx_b = plan.context_lens[b]``, or a callable ``gather(b, start, length)`` returning that slice
            (``b`` indexes the prefills).
        plan: :func:`plan_context_chunks` over the same ``B_p`` prefills.
        W_UK: ``[Lkv, H_q, D_nope]`` float. W_UV: ``[Lkv, H_q, D_v]`` float.
        scale: softmax scale.

    Returns:
        ``out [T_p, H_q, D_v]`` and ``lse [H_q, T_p]``, float64.

    Raises:
        ValueError: shapes disagree, the plan is for another batch, or a chunk would overflow the workspace.

    Source: vLLM ``vllm/model_executor/layers/attention/mla_attention.py`` (``_compute_prefill_context``,
    ``_forward_prefill``); the order of the merges follows it (context chunks folded left, new tokens last).
    """
    dims = Dims()
    _check_packed(dims, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV)
    if not isinstance(plan, ChunkPlan):
        raise TypeError(f"plan must be a ChunkPlan, got {type(plan).__name__}")
    cq = cu_seqlens("cu_seqlens_q", cu_seqlens_q, batch=plan.num_prefills, batch_from="plan").long()
    if int(cq[-1]) != dims["T"]:
        raise ValueError(f"cu_seqlens_q must end at T={dims['T']} (from q_nope), got {cq.tolist()}")
    scale = finite_float("scale", scale)
    for i, tot in enumerate(plan.seq_tot):
        if tot > plan.workspace_size:
            raise ValueError(
                f"plan chunk {i} needs {tot} workspace rows, more than workspace_size={plan.workspace_size}"
            )
    gather = _gatherer(context, plan.num_prefills)
    _check_context(gather, plan.context_lens, dims["Lkv"], dims["D_rope"])

    n_heads, t = dims["H_q"], dims["T"]
    out = torch.zeros(t, n_heads, dims["D_v"], dtype=torch.float64)
    lse = torch.full((n_heads, t), -math.inf, dtype=torch.float64)
    for b in range(plan.num_prefills):
        qs, qe = int(cq[b]), int(cq[b + 1])
        if qe == qs:
            continue
        qn, qp = q_nope[None, qs:qe], q_pe[None, qs:qe]
        run = None  # (out [S_q, H_q, D_v], lse [H_q, S_q]) over the context so far
        for i in range(plan.num_chunks):
            # The workspace rows of this request in chunk i: cu_seq_lens[i, b] : cu_seq_lens[i, b + 1].
            length = int(plan.seq_lens[i, b])
            if length == 0:  # nothing of this request in chunk i: an empty part
                part = (
                    torch.zeros(qe - qs, n_heads, dims["D_v"], dtype=torch.float64),
                    torch.full((n_heads, qe - qs), -math.inf, dtype=torch.float64),
                )
            else:
                ckv, cpe = gather(b, int(plan.starts[i, b]), length)
                o_i, l_i = mla_mha(qn, qp, ckv[None], cpe[None], W_UK, W_UV, scale=scale, causal=False)
                part = (o_i[0], l_i[0])
            run = part if run is None else tuple(merge_attn_states(run[0], run[1], part[0], part[1]))
        o_new, l_new = mla_mha(qn, qp, kv_c[None, qs:qe], k_pe[None, qs:qe], W_UK, W_UV, scale=scale, causal=True)
        o_b, l_b = o_new[0], l_new[0]
        if run is not None:
            o_b, l_b = merge_attn_states(run[0], run[1], o_b, l_b)
        out[qs:qe], lse[:, qs:qe] = o_b, l_b
    return AttentionOutput(out, lse)


class MixedBatchOutput(NamedTuple):
    """Result of :func:`mla_mixed_batch`.

    * ``out``: ``[T, H_q, D_v]`` float64, or ``[T, D_hidden]`` when ``W_O`` was given; rows in the batch's token
      order.
    * ``lse``: ``[H_q, T]`` float64 (natural log), for every token.
    * ``split``: the decode / prefill boundary used.
    * ``plan``: the prefills' chunk plan.
    """

    out: torch.Tensor
    lse: torch.Tensor
    split: SplitCounts
    plan: ChunkPlan


def mla_mixed_batch(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    metadata: CommonAttentionMetadata,
    context: ContextSource,
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
    *,
    scale: float,
    workspace_size: int,
    decode_threshold: int = 1,
    W_O: torch.Tensor | None = None,
    align_to_block: bool = True,
) -> MixedBatchOutput:
    """One MLA attention step over a mixed batch, the way vLLM's ``MLACommonImpl`` splits it.

    Math (``B_d`` decodes first, then prefills; :func:`mlaspec.spec.batch.split_decodes_and_prefills`)::

        for decode b < B_d: out[tokens of b] = mla_absorbed(q_b, [context_b, new_b], causal=True)   # MTP ok
        prefills:           out[tokens of b >= B_d] = chunked_prefill_attention(..., plan_context_chunks(
                                                   context_lens[B_d:], workspace_size, block_size))
        out = out.reshape(T, H_q * D_v) @ W_O     if W_O is given

    Each request's result equals causal attention of its new tokens over ``context + new tokens`` in either
    form (property tested): the split changes the cost, not the value.

    Args:
        q_nope: ``[T, H_q, D_nope]`` float. q_pe: ``[T, H_q, D_rope]`` float, rotated. Packed by
            ``metadata.query_start_loc``.
        kv_c: ``[T, Lkv]`` float. k_pe: ``[T, D_rope]`` float, rotated: the new tokens' cache entries.
        metadata: the batch, reordered decodes first.
        context: per request ``(kv_c [S_ctx_b, Lkv], k_pe [S_ctx_b, D_rope])`` with ``S_ctx_b =
            metadata.num_computed_tokens[b]``, or ``gather(b, start, length)`` with ``b`` the request's index in
            ``metadata``.
        W_UK: ``[Lkv, H_q, D_nope]`` float. W_UV: ``[Lkv, H_q, D_v]`` float.
        scale: softmax scale (``MLAConfig.softmax_scale``).
        workspace_size: context workspace rows (:func:`chunked_prefill_workspace_size`).
        decode_threshold: longest decode query (``1 + num_speculative_tokens``).
        W_O: optional ``[H_q * D_v, D_hidden]`` float, the output projection.
        align_to_block: as :func:`plan_context_chunks`.

    Returns:
        :class:`MixedBatchOutput`.

    Source: vLLM ``vllm/model_executor/layers/attention/mla_attention.py`` (``MLACommonImpl.forward``: decode
    tokens ``[:num_decode_tokens]`` through ``_forward_decode``, the rest through ``_forward_prefill``).
    """
    if not isinstance(metadata, CommonAttentionMetadata):
        raise TypeError(f"metadata must be a CommonAttentionMetadata, got {type(metadata).__name__}")
    dims = Dims().bind("metadata", T=metadata.num_tokens)
    _check_packed(dims, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV)
    if W_O is not None:
        dims.tensor("W_O", W_O, (None, "D_hidden"), FLOAT)
        if W_O.shape[0] != dims["H_q"] * dims["D_v"]:
            raise ValueError(f"W_O must have H_q * D_v = {dims['H_q'] * dims['D_v']} rows, got shape {list(W_O.shape)}")
    scale = finite_float("scale", scale)
    split = split_decodes_and_prefills(metadata, decode_threshold)
    gather = _gatherer(context, metadata.num_reqs)
    _check_context(gather, metadata.num_computed_tokens, dims["Lkv"], dims["D_rope"])
    qsl = metadata.query_start_loc.long()
    t, n_heads = dims["T"], dims["H_q"]
    out = torch.zeros(t, n_heads, dims["D_v"], dtype=torch.float64)
    lse = torch.full((n_heads, t), -math.inf, dtype=torch.float64)

    # Decodes: the absorbed (data-movement-friendly) form over the whole sequence, context then new tokens.
    for b in range(split.num_decodes):
        qs, qe, c = int(qsl[b]), int(qsl[b + 1]), int(metadata.num_computed_tokens[b])
        if qe == qs:
            continue
        ckv, cpe = gather(b, 0, c)
        seq_kv = torch.cat([ckv.to(torch.float64), kv_c[qs:qe].to(torch.float64)])
        seq_pe = torch.cat([cpe.to(torch.float64), k_pe[qs:qe].to(torch.float64)])
        o, l = mla_absorbed(
            q_nope[None, qs:qe], q_pe[None, qs:qe], seq_kv[None], seq_pe[None], W_UK, W_UV, scale=scale, causal=True
        )
        out[qs:qe], lse[:, qs:qe] = o[0], l[0]

    # Prefills: the compute-friendly form, context through the chunked workspace.
    d = split.num_decodes
    plan = plan_context_chunks(
        metadata.num_computed_tokens[d:].long(), workspace_size, metadata.block_size, align_to_block=align_to_block
    )
    if split.num_prefills:
        p0 = split.num_decode_tokens
        res = chunked_prefill_attention(
            q_nope[p0:],
            q_pe[p0:],
            kv_c[p0:],
            k_pe[p0:],
            qsl[d:] - p0,
            lambda b, start, length: gather(b + d, start, length),
            plan,
            W_UK,
            W_UV,
            scale=scale,
        )
        out[p0:], lse[:, p0:] = res.out, res.lse
    if W_O is not None:
        out = out.reshape(t, -1) @ W_O.to(torch.float64)
    return MixedBatchOutput(out, lse, split, plan)
