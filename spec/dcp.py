"""Decode context parallelism (DCP): the KV cache of every request sharded over ``N_cp`` ranks, each rank attending
with all heads over its share, the partial results combined by their LSEs.

**Token to rank.** With interleave size ``I`` (vLLM's ``cp_kv_cache_interleave_size``), global token ``t`` of a
request is stored on rank ``(t // I) % N_cp``: runs of ``I`` consecutive tokens are dealt round-robin, so a newly
decoded token always lands on a known rank and no token moves. A rank's tokens are kept in their global order, so
the keys it holds among the first ``n`` tokens of a request are its *first* ``local(n)`` keys, with (vLLM's
``get_dcp_local_seq_lens``, ``vllm/v1/attention/backends/utils.py``)::

    base     = n // I // N_cp * I                       whole rounds of N_cp * I tokens
    local(n) = base + clip(n - base * N_cp - rank * I, 0, I)

The same formula covers every prefix a kernel needs: a decode (``n = seq_len``), each MTP query token (query ``i``
of ``S_q`` sees the prefix ``n = seq_len - S_q + 1 + i``, so its local length is ``local(n)``, not ``local(seq_len)
- S_q + 1 + i``: the causal mask on a rank is *not* bottom-right aligned), and a chunk ``[a, b)`` of a chunked
prefill's context (``local(b) - local(a)`` keys, starting at local key ``local(a)``).

**Pages.** Every rank keeps the request's one block table; block ``j`` of it holds, on rank ``r``, that rank's
local keys ``[j P, (j + 1) P)``: a rank pages its local sequence exactly as a single device pages a whole one
(:func:`dcp_slot_mapping`; vLLM's "virtual block" of ``P N_cp`` global positions, ``vllm/v1/worker/block_table.py``).

**Combine.** Rank ``r`` returns ``o_r`` (normalised over its keys) and ``lse_r`` (natural log; an empty share gives
``o_r = 0`` and ``lse_r = -inf``). With ``lse = log Σ_r exp(lse_r)`` the single-device result is::

    out = Σ_r c_r o_r,     c_r = exp(lse_r - lse)       (c_r = 0 for an empty share; all empty: out 0, lse -inf)

vLLM has two ways to do this over the group (``vllm/v1/attention/ops/common.py``, ``cp_lse_ag_out_rs``: all-gather
the ``[B, H]`` LSEs, scale the local ``[B, H, D]`` output by ``c_r`` (``_correct_attn_cp_out_kernel``, which reads
``+inf`` and NaN LSEs as ``-inf`` and writes 0 where ``c_r = 0``), reduce-scatter the sum over heads; and an
all-to-all variant, ``vllm/v1/attention/ops/dcp_alltoall.py``, that first sends each rank the head slice it owns
and combines there). Both are the sum above, reordered: :func:`dcp_combine_ag_rs` and :func:`dcp_combine_a2a`
simulate them and agree with :func:`dcp_combine` (tests/test_dcp.py). ``lse_base=2`` is the combine of a backend
whose LSE is ``log2`` (FlashInfer; vLLM's ``is_lse_base_on_e=False``): ``c_r = 2^(lse_r - lse)``.

Layouts: partial outputs stacked ``outs [N_cp, B, S_q, H_q, D_v]``, LSEs ``lses [N_cp, B, H_q, S_q]`` (the layout
of :func:`~mlaspec.spec.forms.mqa_latent_attention`, one per rank). Computed in float64.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .attention import AttentionOutput
from .checks import FLOAT, INT, Dims, boolean, choice, in_range, positive_int
from .forms import mqa_latent_attention
from .paged_cache import slot_mapping_from_block_table

__all__ = [
    "DCPShard",
    "dcp_attention",
    "dcp_combine",
    "dcp_combine_a2a",
    "dcp_combine_ag_rs",
    "dcp_correction",
    "dcp_local_seq_lens",
    "dcp_owner",
    "dcp_partial_attention",
    "dcp_query_prefix_lens",
    "dcp_shard",
    "dcp_slot_mapping",
]


def _group(world_size: object, interleave: object, rank: object = None) -> None:
    positive_int("world_size", world_size)
    positive_int("interleave", interleave)
    if rank is not None:
        positive_int("rank", rank, minimum=0)
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size={world_size}, got {rank}")


def dcp_owner(positions: torch.Tensor, *, world_size: int, interleave: int = 1) -> torch.Tensor:
    """The rank that stores each global token position: ``(t // interleave) % world_size``.

    Args:
        positions: any shape, int, non-negative token positions within their request.
        world_size: ``N_cp``, the ranks of the DCP group (vLLM ``dcp_world_size``).
        interleave: ``I``, consecutive tokens per rank (vLLM ``cp_kv_cache_interleave_size``).

    Returns:
        int64, the shape of ``positions``.

    Example: ``dcp_owner(arange(8), world_size=2, interleave=2) = [0, 0, 1, 1, 0, 0, 1, 1]``.
    """
    _group(world_size, interleave)
    if not isinstance(positions, torch.Tensor) or positions.dtype not in INT:
        raise TypeError(f"positions must be an int torch.Tensor, got {getattr(positions, 'dtype', type(positions))}")
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
    return positions.to(torch.int64) // interleave % world_size


def dcp_local_seq_lens(
    seq_lens: torch.Tensor, *, world_size: int, interleave: int = 1, rank: int | None = None
) -> torch.Tensor:
    """Keys each rank holds of each request's first ``seq_lens[b]`` tokens (vLLM's ``get_dcp_local_seq_lens``).

    Args:
        seq_lens: ``[B]`` int, non-negative prefix lengths (any shape is accepted: each element is a prefix).
        world_size, interleave: as :func:`dcp_owner`.
        rank: one rank, or None for every rank.

    Returns:
        int64: ``seq_lens.shape + [N_cp]`` for every rank, ``seq_lens.shape`` for one.

    Example: ``seq_lens = [10]``, ``world_size = 4``, ``interleave = 2``: tokens 0-1, 8-9 on rank 0, 2-3 on rank 1,
    4-5 on rank 2, 6-7 on rank 3, so ``[[4, 2, 2, 2]]``.
    """
    _group(world_size, interleave, rank)
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype not in INT:
        raise TypeError(f"seq_lens must be an int torch.Tensor, got {getattr(seq_lens, 'dtype', type(seq_lens))}")
    if seq_lens.numel() and int(seq_lens.min()) < 0:
        raise ValueError(f"seq_lens must be >= 0, got {int(seq_lens.min())}")
    n = seq_lens.to(torch.int64)[..., None]
    ranks = torch.arange(world_size, device=n.device) if rank is None else torch.tensor([rank], device=n.device)
    base = n // interleave // world_size * interleave
    local = base + (n - base * world_size - ranks * interleave).clamp(0, interleave)
    return local if rank is None else local[..., 0]


def dcp_query_prefix_lens(seq_lens: torch.Tensor, s_q: int, *, causal: bool) -> torch.Tensor:
    """The global prefix each query token sees, ``[B, S_q]`` int64: ``seq_len - S_q + 1 + i`` under ``causal`` (the
    queries are the request's last ``S_q`` tokens, clipped at 0), ``seq_len`` otherwise.

    Args:
        seq_lens: ``[B]`` int, keys per request (``>= 0``).
        s_q: ``S_q``, query tokens per request (MTP: ``next_n``).
        causal: bottom-right aligned, as :func:`~mlaspec.spec.attention.seq_lens_mask`.

    Example: ``seq_lens = [5]``, ``S_q = 2``, causal: ``[[4, 5]]``.
    """
    Dims().tensor("seq_lens", seq_lens, ("B",), INT)
    positive_int("s_q", s_q)
    boolean("causal", causal)
    n = seq_lens.to(torch.int64)[:, None]
    if bool((n < 0).any()):
        raise ValueError(f"seq_lens must be >= 0, got {seq_lens.tolist()}")
    i = torch.arange(s_q, device=n.device)[None, :]
    return (n - s_q + 1 + i).clamp(min=0) if causal else n.expand(-1, s_q)


class DCPShard(NamedTuple):
    """One rank's share of a padded batch: ``kv [B, S_loc, D_qk]`` (or ``[B, S_loc, token_bytes]`` uint8 records;
    its tokens in global order, zero past ``seq_lens``) and ``seq_lens [B]`` int64, ``positions [B, S_loc]`` int64
    (each local key's global position, ``-1`` past ``seq_lens``)."""

    kv: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor


def dcp_shard(kv: torch.Tensor, seq_lens: torch.Tensor, *, world_size: int, rank: int, interleave: int = 1) -> DCPShard:
    """The keys rank ``rank`` stores: request ``b``'s tokens ``t < seq_lens[b]`` with ``dcp_owner(t) == rank``.

    Args:
        kv: ``[B, S_kv, D_qk]`` float, the cache entries of the whole (unsharded) batch; or ``[B, S_kv,
            token_bytes]`` uint8, its fp8 cache records (:mod:`~mlaspec.spec.cache_layouts`): a rank stores each
            of its tokens' records whole, scales included.
        seq_lens: ``[B]`` int in ``[0, S_kv]``.
        world_size, interleave: as :func:`dcp_owner`. rank: in ``[0, world_size)``.

    Returns:
        :class:`DCPShard`, ``S_loc = max(1, max_b local(seq_lens[b]))`` (at least one slot, so a rank with nothing
        still has a well-formed, empty cache).
    """
    dims = Dims()
    dims.tensor("kv", kv, ("B", "S_kv", "D_qk"), FLOAT + (torch.uint8,))
    dims.tensor("seq_lens", seq_lens, ("B",), INT)
    in_range("seq_lens", seq_lens, 0, dims["S_kv"] + 1)
    local = dcp_local_seq_lens(seq_lens, world_size=world_size, interleave=interleave, rank=rank).cpu()
    s_loc = max(1, int(local.max()) if local.numel() else 1)
    t = torch.arange(dims["S_kv"])
    positions = torch.full((dims["B"], s_loc), -1, dtype=torch.int64)
    for b in range(dims["B"]):
        mine = t[(t < int(seq_lens[b])) & (dcp_owner(t, world_size=world_size, interleave=interleave) == rank)]
        positions[b, : mine.numel()] = mine
    gathered = torch.gather(kv, 1, positions.clamp(min=0).to(kv.device)[..., None].expand(-1, -1, dims["D_qk"]))
    gathered = torch.where((positions >= 0).to(kv.device)[..., None], gathered, torch.zeros((), dtype=kv.dtype))
    return DCPShard(gathered, local.to(torch.int64), positions)


def dcp_partial_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    world_size: int,
    rank: int,
    interleave: int = 1,
    d_v: int,
    scale: float,
    causal: bool = True,
) -> AttentionOutput:
    """Rank ``rank``'s partial attention: every head over the rank's share (:func:`dcp_shard`), query ``i`` of
    request ``b`` reading the share's first ``local(dcp_query_prefix_lens[b, i])`` keys.

    Args:
        q: ``[B, S_q, H_q, D_qk]`` float, the absorbed queries (every rank gets all heads).
        kv: ``[B, S_kv, D_qk]`` float, the whole batch's cache entries. seq_lens: ``[B]`` int in ``[0, S_kv]``.
        world_size, rank, interleave: as :func:`dcp_shard`. d_v, scale: as
            :func:`~mlaspec.spec.forms.mqa_latent_attention`. causal: as :func:`dcp_query_prefix_lens`.

    Returns:
        ``out [B, S_q, H_q, d_v]`` and natural-log ``lse [B, H_q, S_q]``, float64; a query whose share is empty
        gets ``out = 0`` and ``lse = -inf``.
    """
    dims = Dims()
    dims.tensor("q", q, ("B", "S_q", "H_q", "D_qk"), FLOAT)
    dims.tensor("kv", kv, ("B", "S_kv", "D_qk"), FLOAT)
    shard = dcp_shard(kv, seq_lens, world_size=world_size, rank=rank, interleave=interleave)
    prefix = dcp_query_prefix_lens(seq_lens, dims["S_q"], causal=causal)  # [B, S_q]
    visible = dcp_local_seq_lens(prefix, world_size=world_size, interleave=interleave, rank=rank)  # [B, S_q]
    mask = torch.arange(shard.kv.shape[1])[None, None, :] < visible[..., None]  # [B, S_q, S_loc]
    return mqa_latent_attention(q, shard.kv, d_v=d_v, scale=scale, mask=mask.to(q.device))


def _stacked(outs: object, lses: object) -> Dims:
    dims = Dims()
    dims.tensor("outs", outs, ("N_cp", "B", "S_q", "H_q", "D_v"), FLOAT)
    dims.tensor("lses", lses, ("N_cp", "B", "H_q", "S_q"), FLOAT)
    return dims


def _empty_as_neg_inf(lses: torch.Tensor) -> torch.Tensor:
    """``+inf`` (FA2 / FlashMLA's empty row) and NaN read as ``-inf``, as ``_correct_attn_cp_out_kernel`` does."""
    lses = lses.to(torch.float64)
    return lses.masked_fill(torch.isnan(lses) | (lses == math.inf), -math.inf)


def dcp_correction(lses: torch.Tensor, *, lse_base: float = math.e) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's correction factor ``c_r = base^(lse_r - lse)`` and the global ``lse = log_base Σ_r base^lse_r``.

    Args:
        lses: ``[N_cp, B, H_q, S_q]`` float, the gathered LSEs in ``lse_base`` (``±inf`` or NaN: an empty share).
        lse_base: ``math.e`` (FlashMLA, vLLM's Triton decode) or ``2`` (FlashInfer).

    Returns:
        ``c [N_cp, B, H_q, S_q]`` (0 for an empty share; ``Σ_r c_r = 1`` unless every share is empty, then all 0)
        and ``lse [B, H_q, S_q]`` (``-inf`` where every share is empty), float64, ``lse`` in ``lse_base``.

    Example: ``lses = [[[[0.]]], [[[-inf]]]]`` gives ``c = [1, 0]``, ``lse = 0``.
    """
    Dims().tensor("lses", lses, ("N_cp", "B", "H_q", "S_q"), FLOAT)
    choice("lse_base", lse_base, (math.e, 2.0, 2))
    ln_base = math.log(lse_base)
    lse = _empty_as_neg_inf(lses) * ln_base  # natural log from here on
    total = torch.logsumexp(lse, dim=0)  # [B, H_q, S_q]
    c = torch.where(torch.isneginf(lse), 0.0, torch.exp(lse - total))  # all empty: -inf - -inf is NaN, but c = 0
    return c, total / ln_base


def dcp_combine(outs: torch.Tensor, lses: torch.Tensor, *, lse_base: float = math.e) -> AttentionOutput:
    """``out = Σ_r c_r o_r`` with :func:`dcp_correction`'s factors: the single-device result from the partials.

    Args:
        outs: ``[N_cp, B, S_q, H_q, D_v]`` float, each rank's partial output (NaN / inf of an empty share ignored).
        lses: ``[N_cp, B, H_q, S_q]`` float, their LSEs in ``lse_base``.
        lse_base: as :func:`dcp_correction`.

    Returns:
        ``out [B, S_q, H_q, D_v]`` and ``lse [B, H_q, S_q]`` (in ``lse_base``), float64.

    Example: two ranks, one head, ``o = [2, 5]``, ``lse = [1, 0]``: ``out = (2e + 5) / (e + 1) = 2.807``, ``lse =
    log(e + 1) = 1.313`` (:func:`~mlaspec.spec.merge.merge_attn_states`' example: a two-rank combine is that merge).
    """
    _stacked(outs, lses)
    c, lse = dcp_correction(lses, lse_base=lse_base)
    o = torch.nan_to_num(outs.to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    return AttentionOutput(torch.einsum("rbhs,rbshd->bshd", c, o), lse)


def _head_slices(world_size: int, h_q: int) -> list[slice]:
    if h_q % world_size:
        raise ValueError(f"outs must have H_q divisible by N_cp={world_size} to scatter heads, got H_q={h_q}")
    n = h_q // world_size
    return [slice(r * n, (r + 1) * n) for r in range(world_size)]


def dcp_combine_ag_rs(outs: torch.Tensor, lses: torch.Tensor, *, lse_base: float = math.e) -> AttentionOutput:
    """vLLM's ``cp_lse_ag_out_rs``, every rank simulated: rank ``r`` corrects its own full-head output with the
    all-gathered LSEs (``c_r o_r``), then a reduce-scatter over heads leaves rank ``r'`` the sum over ``r`` of head
    slice ``r'``. Returns the slices put back together (equal to :func:`dcp_combine`).

    Args: as :func:`dcp_combine`; ``H_q`` divisible by ``N_cp``.

    Returns: ``out [B, S_q, H_q, D_v]``, ``lse [B, H_q, S_q]``, float64.
    """
    dims = _stacked(outs, lses)
    c, lse = dcp_correction(lses, lse_base=lse_base)  # all_gather(lse) then each rank's own factor
    o = torch.nan_to_num(outs.to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    corrected = [c[r].transpose(1, 2)[..., None] * o[r] for r in range(dims["N_cp"])]  # on rank r, all heads
    slices = _head_slices(dims["N_cp"], dims["H_q"])
    scattered = [sum(x[:, :, s] for x in corrected) for s in slices]  # reduce_scatter(dim=heads): rank r' gets s_r'
    return AttentionOutput(torch.cat(scattered, dim=2), lse)


def dcp_combine_a2a(outs: torch.Tensor, lses: torch.Tensor, *, lse_base: float = math.e) -> AttentionOutput:
    """vLLM's all-to-all combine (``vllm/v1/attention/ops/dcp_alltoall.py``), every rank simulated: rank ``r``
    sends head slice ``r'`` of ``(o_r, lse_r)`` to rank ``r'``, which combines the ``N_cp`` partials of its heads
    locally. Returns the slices put back together (equal to :func:`dcp_combine`).

    Args: as :func:`dcp_combine`; ``H_q`` divisible by ``N_cp``.

    Returns: ``out [B, S_q, H_q, D_v]``, ``lse [B, H_q, S_q]``, float64.
    """
    dims = _stacked(outs, lses)
    slices = _head_slices(dims["N_cp"], dims["H_q"])  # rank r' receives head slice r' of every rank's partial
    parts = [dcp_combine(outs[:, :, :, s], lses[:, :, s], lse_base=lse_base) for s in slices]
    return AttentionOutput(torch.cat([p.out for p in parts], dim=2), torch.cat([p.lse for p in parts], dim=1))


def dcp_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    world_size: int,
    interleave: int = 1,
    d_v: int,
    scale: float,
    causal: bool = True,
) -> AttentionOutput:
    """DCP decode end to end: every rank's :func:`dcp_partial_attention`, then :func:`dcp_combine`. Equal to
    ``mqa_latent_attention(q, kv, d_v=d_v, scale=scale, causal=causal, seq_lens=seq_lens)`` for any world size,
    interleave size and lengths (tests/test_dcp.py).

    Args: as :func:`dcp_partial_attention`, without ``rank``.

    Returns: ``out [B, S_q, H_q, d_v]``, ``lse [B, H_q, S_q]``, float64.
    """
    _group(world_size, interleave)
    parts = [
        dcp_partial_attention(
            q, kv, seq_lens, world_size=world_size, rank=r, interleave=interleave, d_v=d_v, scale=scale, causal=causal
        )
        for r in range(world_size)
    ]
    return dcp_combine(torch.stack([p.out for p in parts]), torch.stack([p.lse for p in parts]))


def dcp_slot_mapping(
    block_table: torch.Tensor,
    block_size: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    *,
    world_size: int,
    rank: int,
    interleave: int = 1,
) -> torch.Tensor:
    """Slot of every scheduled token in rank ``rank``'s cache, ``-1`` for a token another rank stores, as vLLM's
    slot mapping under DCP (``vllm/v1/worker/block_table.py``, ``ComputeSlotMappingKernel``).

    vLLM computes it through a *virtual block* of ``P N_cp`` global positions::

        vb, vo = pos // (P * N_cp), pos % (P * N_cp)
        local  = (vo // I) % N_cp == rank
        slot   = block_table[b, vb] * P + vo // (N_cp * I) * I + vo % I      (-1 where not local)

    which is the single-device slot mapping (:func:`~mlaspec.spec.paged_cache.slot_mapping_from_block_table`) of
    the token's *local* position ``local(pos)`` (:func:`dcp_local_seq_lens`: the keys the rank holds before it),
    because with ``I`` dividing ``P`` every virtual block deals each rank exactly ``P`` keys. The spec computes the
    latter; tests/test_dcp.py checks it equals the former.

    Args:
        block_table: ``[B, max_blocks]`` int, the request's block table (the same on every rank).
        block_size: ``P``; ``interleave`` must divide it (vLLM asserts the same).
        query_start_loc: ``[B + 1]`` int, as :func:`~mlaspec.spec.paged_cache.slot_mapping_from_block_table`.
        positions: ``[T]`` int, non-negative global positions.
        world_size, rank, interleave: as :func:`dcp_owner`.

    Returns:
        ``[T]`` int64 slots, ``-1`` where the token is stored on another rank.

    Example: ``P = 2``, ``N_cp = 2``, ``I = 1``, block table ``[[5, 9]]``, positions ``0..5``: rank 0 stores tokens
    0, 2, 4 at local positions 0, 1, 2, i.e. slots ``[10, -1, 11, -1, 18, -1]``.
    """
    _group(world_size, interleave, rank)
    block_size = positive_int("block_size", block_size)
    if block_size % interleave:
        raise ValueError(f"interleave must divide block_size, got interleave={interleave}, block_size={block_size}")
    owned = dcp_owner(positions, world_size=world_size, interleave=interleave) == rank  # checks positions
    local = dcp_local_seq_lens(positions, world_size=world_size, interleave=interleave, rank=rank)
    local = torch.where(owned, local, 0)  # another rank's token: no local position to page (masked below)
    slots = slot_mapping_from_block_table(block_table, block_size, query_start_loc, local).slot_mapping
    return torch.where(owned, slots, -1)
