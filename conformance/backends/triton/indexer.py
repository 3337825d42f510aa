"""Harness-facing methods for the indexer kernels of :mod:`mlaspec.impl.indexer` (a mixin of ``TritonBackend``).

* ``indexer_logits``: the fp8 ``q [M, H, D]`` / ``k [N, D]``, folded weights, spans and per-key scales go straight to
  :func:`mlaspec.impl.indexer.indexer_logits` (absolute columns, ``-inf`` outside ``[ks, ke)``);
* ``paged_indexer_logits``: the byte-level cache ``uint8 [NB, P, D + 4]`` and 1-D or 2-D context lengths go
  to :func:`mlaspec.impl.indexer.paged_indexer_logits`;
* ``topk_indices``: the fp32 logits to :func:`mlaspec.impl.indexer.topk_indices` (threshold select, ``-1`` padded).

No op multiplies in the case dtype (the logits' inputs are fp8 already, the top-k compares fp32), so bf16 cases run
in the interpreter too.
"""

from __future__ import annotations

from mlaspec.conformance.ops import implemented_ops
from mlaspec.impl.indexer import indexer_logits, paged_indexer_logits, topk_indices

__all__ = ["INDEXER_OPS", "TritonIndexer"]


def _pow2(x: int, minimum: int = 1) -> bool:
    return x >= minimum and not x & (x - 1)


class TritonIndexer:
    """The indexer ops; expects ``self.device`` (set by ``TritonBackend.__init__``)."""

    # -- limits, named -------------------------------------------------------------------------------------------
    def _unsupported_indexer_logits(self, case) -> str | None:
        p = case.params
        if not (_pow2(p["H"]) and _pow2(p["D"], 16)):
            return f"indexer_logits needs H and D powers of two (D >= 16), got H={p['H']}, D={p['D']}"
        return None

    def _unsupported_paged_indexer_logits(self, case) -> str | None:
        p = case.params
        if not (_pow2(p["H"]) and _pow2(p["D"], 16)):
            return f"paged_indexer_logits needs H and D powers of two (D >= 16), got H={p['H']}, D={p['D']}"
        return None

    def _unsupported_topk_indices(self, case) -> str | None:
        return None

    # -- ops -----------------------------------------------------------------------------------------------------
    def indexer_logits(self, q, k, weights, ks, ke, k_scale=None):
        dev = self.device
        return indexer_logits(
            q.to(dev), k.to(dev), weights.to(dev), ks.to(dev), ke.to(dev), None if k_scale is None else k_scale.to(dev)
        )

    def paged_indexer_logits(self, q, cache, block_table, context_lens, weights, *, max_context_len=None):
        dev = self.device
        return paged_indexer_logits(
            q.to(dev),
            cache.to(dev),
            block_table.to(dev),
            context_lens.to(dev),
            weights.to(dev),
            max_context_len=max_context_len,
        )

    def topk_indices(self, logits, k, *, row_starts=None, row_ends=None, relative=False):
        dev = self.device
        return topk_indices(
            logits.to(dev),
            k,
            row_starts=None if row_starts is None else row_starts.to(dev),
            row_ends=None if row_ends is None else row_ends.to(dev),
            relative=relative,
        )


INDEXER_OPS = implemented_ops(TritonIndexer)
"""The ops this mixin has a method for."""
