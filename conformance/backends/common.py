"""What the kernel adapters share: lazy imports with a clear reason, the CUDA device, and the pure translations
between the spec's layouts and the kernels' (paging a gathered cache, LSE bases, padding heads and top-k).

Everything here is plain PyTorch and runs on CPU, so the translations are unit-tested without a GPU
(``tests/test_adapters.py``). The adapters import their kernel library only in their constructor: an adapter
module imports on any machine, and ``mlaspec backends`` reports a missing library as ``not usable: <reason>``.
"""

from __future__ import annotations

import importlib
import math
import os
from types import ModuleType
from typing import NamedTuple

import torch

from mlaspec.spec import dcp
from mlaspec.spec.paged_cache import page_entries

__all__ = [
    "LN2",
    "PagedKV",
    "case_param",
    "combine_partials",
    "cuda_capability",
    "dcp_decode_by_ranks",
    "dcp_rank_decode",
    "import_first",
    "importable",
    "ln_to_log2",
    "log2_to_ln",
    "pad_heads",
    "pad_last",
    "page_kv",
    "rank_partial",
    "require_cuda",
    "round_up",
]

LN2 = math.log(2.0)
INSTALL_HINT = (
    "pip install vllm==0.33.0: its wheel vendors FlashMLA as vllm.third_party.flashmla and ships DeepGEMM as "
    "deep_gemm; or install upstream FlashMLA / DeepGEMM"
)


def import_first(*names: str, what: str, hint: str = INSTALL_HINT) -> ModuleType:
    """The first of ``names`` that imports; ``ImportError`` naming every attempt and ``hint`` otherwise."""
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except Exception as exc:  # a broken extension raises OSError/RuntimeError, not only ImportError
            errors.append(f"{name}: {type(exc).__name__}: {exc}".splitlines()[0])
    raise ImportError(f"{what} not installed ({hint}); tried " + "; ".join(errors))


def importable(name: str) -> bool:
    """Whether module ``name`` imports here (any exception counts as no, as in :func:`import_first`)."""
    try:
        importlib.import_module(name)
        return True
    except Exception:
        return False


def require_cuda(what: str) -> torch.device:
    """The CUDA device (``MLASPEC_DEVICE`` if it names one), or ``RuntimeError``: the kernels run on GPUs only."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs CUDA (torch {torch.__version__} sees no GPU)")
    device = torch.device(os.environ.get("MLASPEC_DEVICE", "cuda"))
    if device.type != "cuda":
        device = torch.device("cuda")
    return device


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of ``device`` (``(9, 0)`` on H100/H200)."""
    return torch.cuda.get_device_capability(device)


def case_param(case, name: str, default=None):
    """The case's parameter ``name``, or ``default`` where the case has none. Every op names a size by the
    glossary (``docs/glossary.md``): one name per dimension, so an adapter asks for that name and no other."""
    return case.params.get(name, default)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# ------------------------------------------------------------------------------------------------------ LSE bases


def log2_to_ln(lse: torch.Tensor) -> torch.Tensor:
    """A base-2 log-sum-exp ``log2(sum 2^(s log2 e))`` to the natural log the spec uses: multiply by ``ln 2``.

    ``±inf`` and NaN pass through unchanged (``inf * ln 2 = inf``). Computed in float32 as kernels return it.
    """
    return lse.float() * LN2


def ln_to_log2(lse: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`log2_to_ln`: natural log to base 2 (divide by ``ln 2``), for kernels that read log2."""
    return lse.float() / LN2


# --------------------------------------------------------------------------------------------------------- paging


class PagedKV(NamedTuple):
    """``cache [NB, P, *entry]``, ``block_table [B, max_blocks]`` int32 and ``seqlens [B]`` int32."""

    cache: torch.Tensor
    block_table: torch.Tensor
    seqlens: torch.Tensor


def page_kv(
    kv: torch.Tensor,
    page_size: int,
    *,
    seqlens: torch.Tensor | None = None,
    seed: int = 0,
    fill: float = math.nan,
    spare_blocks: int = 1,
) -> PagedKV:
    """Page a gathered cache ``kv [B, S_kv, *entry]`` into a shuffled paged cache, hostile where unused: the spec's
    :func:`mlaspec.spec.paged_cache.page_entries` with the permutation seeded by ``seed``.

    Request ``b``'s token ``t < seqlens[b]`` goes to slot ``block_table[b, t // P] * P + t % P``. The physical
    blocks are a random permutation (seeded), so a kernel that ignores the block table reads the wrong tokens;
    slots past a request's length, and ``spare_blocks`` blocks nobody owns, hold ``fill`` (NaN by default), so a
    kernel that reads past ``seqlens`` poisons its output.

    Args:
        kv: ``[B, S_kv, *entry]`` float (``entry`` is ``[576]`` for MLA, or ``[H_kv, D]``).
        page_size: ``P``, tokens per block (64 for FlashMLA).
        seqlens: optional ``[B]`` int, tokens of each request (default ``S_kv`` for all).
        seed: the permutation's seed.
        fill: the value of unused slots.
        spare_blocks: extra blocks no request owns.

    Returns:
        :class:`PagedKV` with ``cache`` in ``kv``'s dtype on ``kv``'s device, int32 ``block_table`` and ``seqlens``.
    """
    g = torch.Generator().manual_seed(seed)
    paged = page_entries(kv, page_size, seq_lens=seqlens, generator=g, spare_pages=spare_blocks, fill=fill)
    return PagedKV(*paged)


# -------------------------------------------------------------------------------------------------------- padding


def pad_heads(q: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """``q`` with its head dimension ``dim`` zero-padded to ``heads`` (vLLM pads query heads for FlashMLA the same
    way; the padded heads' outputs are sliced off, so they change nothing)."""
    have = q.shape[dim]
    if have == heads:
        return q
    if have > heads:
        raise ValueError(f"q has {have} heads, more than the {heads} to pad to")
    shape = list(q.shape)
    shape[dim] = heads - have
    return torch.cat([q, q.new_zeros(shape)], dim=dim)


def pad_last(x: torch.Tensor, multiple: int, value) -> torch.Tensor:
    """``x`` with its last dimension padded with ``value`` up to a multiple of ``multiple`` (``-1`` for indices:
    an invalid index contributes nothing, so this is exact)."""
    k = x.shape[-1]
    target = max(multiple, round_up(k, multiple))
    if target == k:
        return x
    return torch.cat([x, x.new_full((*x.shape[:-1], target - k), value)], dim=-1)


class DCPByRanks:
    """Mixin: the ``dcp_decode`` op of any backend with an ``mla_decode`` (:func:`dcp_decode_by_ranks`)."""

    def dcp_decode(self, q, kv, *, d_v, scale, causal, seq_lens, world_size, interleave):
        return dcp_decode_by_ranks(
            self,
            q,
            kv,
            d_v=d_v,
            scale=scale,
            causal=causal,
            seq_lens=seq_lens,
            world_size=world_size,
            interleave=interleave,
        )


class DCPFP8ByRanks:
    """Mixin: the ``dcp_decode_fp8`` op of any backend with an ``mla_decode_fp8``: each rank's share of the fp8
    records through the backend's ``mla_decode_fp8`` (:func:`dcp_rank_decode_fp8`), the layout and both scales the
    same on every rank (one per-tensor ``k_scale`` for the whole cache, vLLM's layer scale), combined as
    ``dcp_decode``."""

    def dcp_decode_fp8(self, q, kv_cache, *, world_size, **args):
        ranks = range(world_size)
        parts = [dcp_rank_decode_fp8(self, q, kv_cache, world_size=world_size, **args, rank=r) for r in ranks]
        return combine_partials(self, q, parts)


def rank_partial(decode, q, kv, *, causal, seq_lens, world_size, interleave, rank):
    """Rank ``rank``'s partial of a DCP decode: its share of ``kv`` (:func:`mlaspec.spec.dcp.dcp_shard`: cache
    entries, or an fp8 cache's uint8 records) through ``decode(q_rows, kv_rows, local_seq_lens) -> (out, lse)`` (a
    backend's decode), with one ``S_q = 1`` row per query token and the local length of *its* prefix
    (:func:`~mlaspec.spec.dcp.dcp_query_prefix_lens`): on a rank, MTP's causal mask is not bottom-right aligned to the
    rank's last key, so a kernel's ``causal`` would be wrong there (vLLM's DCP backends decode the same way, one row
    per query token). ``q [B, S_q, H_q, D_qk]``, ``kv [B, S_kv, *entry]``, ``seq_lens [B]`` int.
    Returns ``out [B, S_q, H_q, d_v]`` and ``lse [B, H_q, S_q]``, as the backend returns them."""
    b, s_q, h_q, _ = q.shape
    prefix = dcp.dcp_query_prefix_lens(seq_lens.cpu(), s_q, causal=causal)  # [B, S_q]
    shard = dcp.dcp_shard(kv, seq_lens.cpu(), world_size=world_size, rank=rank, interleave=interleave)
    local = dcp.dcp_local_seq_lens(prefix, world_size=world_size, interleave=interleave, rank=rank)
    rows_kv = shard.kv.repeat_interleave(s_q, dim=0).contiguous()  # [B * S_q, S_loc, *entry]
    out, lse = decode(q.reshape(b * s_q, 1, h_q, -1), rows_kv, local.reshape(-1).to(torch.int32).to(q.device))
    return out.reshape(b, s_q, h_q, -1), lse.reshape(b, s_q, h_q).transpose(1, 2)


def dcp_rank_decode(backend, q, kv, *, d_v, scale, causal, seq_lens, world_size, interleave, rank):
    """Rank ``rank``'s partial of a DCP decode by the backend's ``mla_decode`` (:func:`rank_partial`).
    ``kv [B, S_kv, D_qk]``; returns ``out [B, S_q, H_q, d_v]`` and ``lse [B, H_q, S_q]``, as the backend returns
    them."""

    def decode(rows_q, rows_kv, local):
        return backend.mla_decode(rows_q, rows_kv, d_v=d_v, scale=scale, causal=False, seq_lens=local)

    group = dict(causal=causal, seq_lens=seq_lens, world_size=world_size, interleave=interleave)
    return rank_partial(decode, q, kv, **group, rank=rank)


def dcp_rank_decode_fp8(
    backend, q, kv_cache, *, layout, k_scale, q_scale, d_v, scale, causal, seq_lens, world_size, interleave, rank
):
    """Rank ``rank``'s partial of a DCP decode over an fp8 cache by the backend's ``mla_decode_fp8``
    (:func:`rank_partial` on the cache's uint8 records ``kv_cache [B, S_kv, record bytes]``); returns ``out [B, S_q,
    H_q, d_v]`` and ``lse [B, H_q, S_q]``, as the backend returns them."""

    def decode(rows_q, rows_kv, local):
        fp8 = dict(layout=layout, k_scale=k_scale, q_scale=q_scale)
        return backend.mla_decode_fp8(rows_q, rows_kv, **fp8, d_v=d_v, scale=scale, causal=False, seq_lens=local)

    group = dict(causal=causal, seq_lens=seq_lens, world_size=world_size, interleave=interleave)
    return rank_partial(decode, q, kv_cache, **group, rank=rank)


def combine_partials(backend, q, parts):
    """The ranks' partials ``[(out [B, S_q, H_q, d_v], lse [B, H_q, S_q]), ...]`` combined by the backend's
    ``dcp_combine(outs, lses) -> (out, lse)`` if it has one, the spec's :func:`~mlaspec.spec.dcp.dcp_combine`
    otherwise (float64, cast back to ``q``'s dtype / fp32). Returns ``out`` and the natural-log ``lse``."""
    outs, lses = (torch.stack(x) for x in zip(*parts))
    combine = getattr(backend, "dcp_combine", None)
    if callable(combine):
        return combine(outs, lses)
    got = dcp.dcp_combine(outs, lses)
    return got.out.to(q.dtype), got.lse.to(torch.float32)


def dcp_decode_by_ranks(backend, q, kv, *, d_v, scale, causal, seq_lens, world_size, interleave):
    """``dcp_decode`` built from a backend's ``mla_decode``: every rank's :func:`dcp_rank_decode` on this device,
    then :func:`combine_partials`. Returns ``out [B, S_q, H_q, d_v]`` (``q``'s dtype), ``lse [B, H_q, S_q]`` fp32,
    natural log.
    """
    args = dict(d_v=d_v, scale=scale, causal=causal, seq_lens=seq_lens, world_size=world_size, interleave=interleave)
    return combine_partials(backend, q, [dcp_rank_decode(backend, q, kv, **args, rank=r) for r in range(world_size)])
