"""Top-k selection of indexer logits: which ``K`` keys each query's sparse attention reads.

Math, per row ``m`` of ``logits [M, N]``::

    valid[m]   = { n : logits[m, n] > -inf  and  row_starts[m] <= n < row_ends[m] }
    chosen[m]  = the min(K, |valid[m]|) members of valid[m] with the largest logits
    indices[m] = chosen[m] (sorted: larger logit first, equal logits lower index first), then -1 up to K

Conventions, and what the real kernels do (vLLM ``csrc/sampler.cu``: ``top_k_per_row_prefill`` /
``top_k_per_row_decode``, a radix-histogram select; ``vllm/model_executor/layers/sparse_attn_indexer.py``):

* **Row range.** Prefill rows use ``[ks[m], ke[m])`` of the absolute-column logits; decode rows use
  ``[0, seq_len - next_n + (m % next_n) + 1)``. Columns outside are never read (DeepGEMM leaves them
  uninitialised). The spec also treats ``-inf`` inside the range as invalid, which only matters for
  logits that are not the indexer's (the indexer's in-range logits are finite).
* **Index base.** The prefill kernel writes indices *relative to the row start* (``idx - rowStart``: position
  within the request's keys); decode rows start at 0, so the two agree: an index is a token position within
  the request. ``relative=True`` subtracts ``row_starts`` the same way. :mod:`mlaspec.spec.sparse` maps these
  positions to cache slots.
* **Padding.** A row with fewer than ``K`` valid keys returns all of them and then ``-1`` (the kernel's short
  path writes positions ``0 .. len - 1`` in order, then ``-1``). vLLM pre-fills the whole buffer with ``-1``.
* **Order.** The kernel's output order is *unspecified*: indices above the threshold bin land in atomic
  order, the threshold bin is sorted. The spec sorts (descending logit) to be deterministic; compare
  selections as sets (:func:`topk_agreement`).
* **Ties.** The kernel breaks ties at the K-th value by the order in which threads reach a shared-memory
  counter, so *which* of several equal logits is kept is unspecified. The spec keeps the lowest index first
  (a documented choice, not the kernel's), and :func:`topk_agreement` accepts every valid tie choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .checks import FLOAT, INT, Dims, boolean, in_range, positive_int

__all__ = ["TopK", "TopKAgreement", "topk_agreement", "topk_indices", "topk_valid_mask"]


class TopK(NamedTuple):
    """``indices [M, K]`` int32 (``-1`` padded), ``values [M, K]`` float64 (``-inf`` there), ``num_valid [M]``."""

    indices: torch.Tensor
    values: torch.Tensor
    num_valid: torch.Tensor


def _rows(dims: Dims, name: str, x: torch.Tensor | None) -> torch.Tensor | None:
    if x is None:
        return None
    return in_range(name, dims.tensor(name, x, ("M",), INT), 0).to(torch.int64)


def topk_valid_mask(
    logits: torch.Tensor,
    *,
    row_starts: torch.Tensor | None = None,
    row_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """The keys a top-k may pick: ``logits > -inf`` and ``row_starts <= n < row_ends``, ``[M, N]`` bool.

    Args:
        logits: ``[M, N]`` float, no NaN.
        row_starts: optional ``[M]`` int ``>= 0`` (default 0).
        row_ends: optional ``[M]`` int ``>= 0`` (default ``N``); values beyond ``N`` are read as ``N``.
    """
    dims = Dims()
    dims.tensor("logits", logits, ("M", "N"), FLOAT)
    if bool(torch.isnan(logits).any()):
        raise ValueError("logits must not contain NaN")
    starts, ends = _rows(dims, "row_starts", row_starts), _rows(dims, "row_ends", row_ends)
    valid = logits > -math.inf
    cols = torch.arange(dims["N"], device=logits.device)[None, :]
    if starts is not None:
        valid &= cols >= starts[:, None]
    if ends is not None:
        valid &= cols < ends[:, None]
    return valid


def topk_indices(
    logits: torch.Tensor,
    k: int,
    *,
    row_starts: torch.Tensor | None = None,
    row_ends: torch.Tensor | None = None,
    relative: bool = False,
) -> TopK:
    """Indices of the ``k`` largest valid logits of each row, ``-1`` padded; ties go to the lowest index.

    Math (see the module docstring for the kernel conventions)::

        order   = sort valid n by (-logits[m, n], n)
        idx[m]  = order[:k] (minus row_starts[m] if relative), then -1 up to k

    Args:
        logits: ``[M, N]`` float (absolute columns), no NaN; ``-inf`` marks an invalid key.
        k: ``K >= 1`` (DeepSeek V3.2: 2048).
        row_starts: optional ``[M]`` int, first key of each row (prefill ``cu_seqlen_ks``).
        row_ends: optional ``[M]`` int, one past the last key (prefill ``cu_seqlen_ke``, decode context length).
        relative: subtract ``row_starts`` from the chosen indices, as ``top_k_per_row_prefill`` does.

    Returns:
        :class:`TopK`: ``indices [M, K]`` int32, ``values [M, K]`` float64, ``num_valid [M]``.

    Source: vLLM ``csrc/sampler.cu`` (``topKPerRowJob``), ``vllm/model_executor/layers/sparse_attn_indexer.py``.
    """
    positive_int("k", k)
    boolean("relative", relative)
    valid = topk_valid_mask(logits, row_starts=row_starts, row_ends=row_ends)
    if relative and row_starts is None:
        raise ValueError("row_starts must be given when relative=True")
    m, n = valid.shape
    vals = torch.where(valid, logits.to(torch.float64), -math.inf)
    # Stable descending sort on values keeps equal logits in ascending index order: the lowest index wins ties.
    order = torch.sort(vals, dim=1, descending=True, stable=True).indices  # [M, N]
    width = min(k, n)
    idx = torch.full((m, k), -1, dtype=torch.int64, device=logits.device)
    idx[:, :width] = order[:, :width]
    num_valid = valid.sum(dim=1)
    keep = torch.arange(k, device=logits.device)[None, :] < num_valid[:, None]
    idx = torch.where(keep, idx, -1)
    out_vals = torch.where(keep, torch.gather(vals, 1, idx.clamp_min(0)), -math.inf)
    if relative:
        idx = torch.where(keep, idx - row_starts.to(torch.int64)[:, None], -1)
    return TopK(idx.to(torch.int32), out_vals, num_valid)


@dataclass(frozen=True)
class TopKAgreement:
    """Verdict of :func:`topk_agreement`.

    ``ok``: every row is a valid top-k. ``reason``: why the worst row failed (``""`` when ok).
    ``worst_row``: the failing row with the largest severity (structural errors first, then the largest
    logit deficit ``max(unchosen) - min(chosen)``), ``None`` when ok. ``bad_rows``: every failing row.
    """

    ok: bool
    reason: str
    worst_row: int | None
    bad_rows: tuple[int, ...]

    def __bool__(self) -> bool:
        return self.ok


def _row_verdict(cand: list[int], vals: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[str, float]:
    """Reason and severity for one row ('' and 0 if the row is fine)."""
    n = vals.numel()
    chosen = [c for c in cand if c != -1]
    n_valid = int(valid.sum())
    want = min(k, n_valid)
    pads = [i for i, c in enumerate(cand) if c == -1]
    if any(c < -1 or c >= n for c in cand):
        bad = [c for c in cand if c < -1 or c >= n]
        return f"index out of range [0, {n}) (or -1): {bad[:4]}", math.inf
    if len(set(chosen)) != len(chosen):
        dup = sorted({c for c in chosen if chosen.count(c) > 1})
        return f"duplicate indices {dup[:4]}", math.inf
    if pads and pads[0] != len(chosen):
        return f"-1 padding must be trailing, found -1 at position {pads[0]} before a real index", math.inf
    invalid = [c for c in chosen if not bool(valid[c])]
    if invalid:
        return f"chosen keys are not valid (masked or -inf) for this row: {invalid[:4]}", math.inf
    if len(chosen) != want:
        return f"expected {want} real indices (K={k}, {n_valid} valid keys), got {len(chosen)}", math.inf
    if not chosen:
        return "", 0.0
    mask = valid.clone()
    mask[torch.tensor(chosen)] = False
    if not bool(mask.any()):
        return "", 0.0
    low = float(vals[torch.tensor(chosen)].min())
    high = float(vals[mask].max())
    if high > low:
        return f"not maximal: chose a key with logit {low!r} while a key with logit {high!r} was left out", high - low
    return "", 0.0


def topk_agreement(
    candidate: torch.Tensor,
    logits: torch.Tensor,
    k: int,
    *,
    row_starts: torch.Tensor | None = None,
    row_ends: torch.Tensor | None = None,
    relative: bool = False,
) -> TopKAgreement:
    """Check a backend's top-k indices against the logits, accepting any valid choice among tied logits.

    A row passes iff, read as a set (order is free, as in the kernel):

    * every entry is ``-1`` or a column in ``[0, N)`` (``relative``: in ``[0, N - row_starts)``, shifted back);
    * no column repeats; ``-1`` appears only after the last real index;
    * every chosen column is valid (:func:`topk_valid_mask`);
    * there are exactly ``min(K, #valid)`` real indices;
    * ``min(chosen logits) >= max(unchosen valid logits)`` (ties at the boundary may go either way).

    Args:
        candidate: ``[M, K]`` int, the indices under test.
        logits: ``[M, N]`` float, the reference logits (usually the spec's, float64).
        k: ``K``; must equal ``candidate.shape[1]``.
        row_starts, row_ends, relative: as in :func:`topk_indices`.

    Returns:
        :class:`TopKAgreement` (never raises for a wrong candidate; raises for malformed arguments).
    """
    positive_int("k", k)
    boolean("relative", relative)
    dims = Dims(K=k)
    dims.tensor("candidate", candidate, ("M", "K"), INT)
    dims.tensor("logits", logits, ("M", "N"), FLOAT)
    valid = topk_valid_mask(logits, row_starts=row_starts, row_ends=row_ends)
    if relative and row_starts is None:
        raise ValueError("row_starts must be given when relative=True")
    cand = candidate.to(torch.int64)
    if relative:
        shift = row_starts.to(torch.int64)[:, None]
        cand = torch.where(cand == -1, -1, torch.where(cand < -1, -2, cand + shift))
    vals = logits.to(torch.float64)
    bad: list[tuple[int, str, float]] = []
    for m in range(dims["M"]):
        reason, severity = _row_verdict(cand[m].tolist(), vals[m], valid[m], k)
        if reason:
            bad.append((m, reason, severity))
    if not bad:
        return TopKAgreement(True, "", None, ())
    worst = max(bad, key=lambda t: (t[2], -t[0]))
    return TopKAgreement(False, f"row {worst[0]}: {worst[1]}", worst[0], tuple(b[0] for b in bad))
