"""The slot mapping of a batch's scheduled tokens, computed on the device from the block table.

Implements :func:`mlaspec.spec.paged_cache.slot_mapping_from_block_table` the way vLLM computes it every step:
``_compute_slot_mapping_kernel`` in ``vllm/v1/worker/block_table.py`` (launched by
``BlockTable.compute_slot_mapping``), one program per request plus one that writes the CUDA-graph padding::

    for b in range(B):                                        # program b
        for t in range(query_start_loc[b], query_start_loc[b + 1]):
            page         = block_table[b, positions[t] // P]
            slot[t]      = page * P + positions[t] % P
            block_ids[t] = page
            offsets[t]   = positions[t] % P
    slot[T:pad_to] = block_ids[T:pad_to] = offsets[T:pad_to] = -1    # program B (PAD_SLOT_ID)

Differences from vLLM's kernel, none of which changes a slot: decode context parallelism (DCP, the
``TOTAL_CP_WORLD_SIZE`` / interleave arithmetic) is not modelled (vLLM's world size 1); the page ids and offsets
are returned next to the slots, as the spec does; a position past the block table's width is refused on the host
rather than read out of bounds (the kernel masks that load, too).

Traffic: reads ``T`` positions and ``T`` block-table entries, writes ``3 * pad_to`` int64; nothing to tile. A
program walks its request's tokens ``BLOCK`` at a time (vLLM: 1024), so a long prefill needs no second grid axis.

The argument checks the spec makes (positions ``>= 0`` and inside the table, every page used ``>= 0`` and below
``num_blocks``, ``query_start_loc`` from 0 to ``T``) are made here too, at the cost of a device-to-host copy of a
few scalars; vLLM trusts its scheduler instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["SlotMapping", "slot_mapping_from_block_table"]

PAD_SLOT_ID = -1  # vLLM vllm/v1/attention/backends/utils.py
_INT = (torch.int32, torch.int64)


@triton.jit
def _slot_mapping_kernel(
    QSL,
    POS,
    TABLE,  # query_start_loc [B + 1], positions [T], block_table [B, max_blocks] (int32 or int64)
    SLOTS,
    BLOCK_IDS,
    OFFSETS,  # [pad_to] int64 each
    num_tokens,
    pad_to,
    stride_table,
    max_blocks,
    block_size,
    PAD_ID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    if b == tl.num_programs(0) - 1:
        # the last program: the CUDA-graph padding tail [T, pad_to) is -1 in all three outputs
        for i in range(num_tokens, pad_to, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            pad = offs < pad_to
            tl.store(SLOTS + offs, PAD_ID, mask=pad)
            tl.store(BLOCK_IDS + offs, PAD_ID, mask=pad)
            tl.store(OFFSETS + offs, PAD_ID, mask=pad)
        return
    # request b's tokens [start, end), BLOCK at a time
    start = tl.load(QSL + b).to(tl.int64)
    end = tl.load(QSL + b + 1).to(tl.int64)
    row = TABLE + b.to(tl.int64) * stride_table
    for i in range(start, end, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        ok = offs < end
        pos = tl.load(POS + offs, mask=ok, other=0).to(tl.int64)
        logical = pos // block_size  # the logical block, the block-table column
        page = tl.load(row + logical, mask=ok & (logical < max_blocks), other=PAD_ID).to(tl.int64)
        within = pos - logical * block_size
        tl.store(SLOTS + offs, page * block_size + within, mask=ok)
        tl.store(BLOCK_IDS + offs, page, mask=ok)
        tl.store(OFFSETS + offs, within, mask=ok)


class SlotMapping(NamedTuple):
    """``slot_mapping``, ``block_ids``, ``block_offsets``: each ``[pad_to]`` int64, ``-1`` on the padding."""

    slot_mapping: torch.Tensor
    block_ids: torch.Tensor
    block_offsets: torch.Tensor


def _int_tensor(name: str, x: object, rank: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INT:
        raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {list(x.shape)}")
    return x


def _int_arg(name: str, x: object, minimum: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def slot_mapping_from_block_table(
    block_table: torch.Tensor,
    block_size: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    *,
    num_blocks: int | None = None,
    pad_to: int | None = None,
    block: int = 1024,
) -> SlotMapping:
    """Slot of every scheduled token (see the module docstring).

    Args:
        block_table: ``[B, max_blocks]`` int32/int64, the physical page of each logical block of request ``b``
            (columns past a request's pages are not read).
        block_size: ``P``, the page size (any positive int).
        query_start_loc: ``[B + 1]`` int32/int64, from 0 to ``T``, non-decreasing.
        positions: ``[T]`` int32/int64, each token's logical position (``>= 0``, inside the block table).
        num_blocks: if given, every page used must be in ``[0, num_blocks)``.
        pad_to: length ``>= T`` of the outputs (CUDA-graph padding, ``-1``); default ``T``.
        block: tokens a program handles per step, a power of two (vLLM: 1024).

    All tensors on one device (CPU under ``TRITON_INTERPRET=1``).

    Returns:
        :class:`SlotMapping` of ``[pad_to]`` int64 tensors.

    Raises:
        TypeError: a tensor that is not int32/int64, or a non-int size.
        ValueError: shapes that disagree, ``query_start_loc`` not from 0 to ``T``, a negative position or one past
            the block table, a page used that is negative or ``>= num_blocks``, ``pad_to < T``.
    """
    _int_tensor("block_table", block_table, 2)
    P = _int_arg("block_size", block_size, 1)
    _int_tensor("query_start_loc", query_start_loc, 1)
    _int_tensor("positions", positions, 1)
    B, max_blocks = block_table.shape
    T = positions.shape[0]
    if query_start_loc.shape[0] != B + 1:
        raise ValueError(
            f"query_start_loc must be [B + 1] = [{B + 1}] (B from block_table), got {list(query_start_loc.shape)}"
        )
    if num_blocks is not None:
        _int_arg("num_blocks", num_blocks, 1)
    total = T if pad_to is None else _int_arg("pad_to", pad_to, T)
    if _int_arg("block", block, 1) & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    dev = positions.device
    for name, t in (("block_table", block_table), ("query_start_loc", query_start_loc)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, positions on {dev}: pass all tensors on one device")
    qsl = query_start_loc.contiguous()
    steps = qsl[1:] - qsl[:-1]
    if int(qsl[0]) != 0 or int(qsl[-1]) != T or bool((steps < 0).any()):
        raise ValueError(f"query_start_loc must rise from 0 to T={T} (from positions), got {qsl.tolist()}")
    if T and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {positions.tolist()}")
    if T and int(positions.max()) // P >= max_blocks:
        raise ValueError(
            f"positions need logical blocks up to {int(positions.max()) // P} but block_table has "
            f"max_blocks={max_blocks} (block_size={P})"
        )

    out = SlotMapping(*(torch.empty(total, dtype=torch.int64, device=dev) for _ in range(3)))
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    _slot_mapping_kernel[(B + 1,)](
        qsl,
        positions.contiguous(),
        table,
        out.slot_mapping,
        out.block_ids,
        out.block_offsets,
        T,
        total,
        table.stride(0),
        max_blocks,
        P,
        PAD_ID=PAD_SLOT_ID,
        BLOCK=block,
        num_warps=4,
    )
    used = out.block_ids[:T]
    bad = (used < 0) if num_blocks is None else (used < 0) | (used >= num_blocks)
    if bool(bad.any()):
        limit = "" if num_blocks is None else f" and < num_blocks={num_blocks}"
        raise ValueError(f"block_table must hold page ids >= 0{limit} where it is used, got {used[bad].tolist()}")
    return out
