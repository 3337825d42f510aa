"""Regenerate the figures of docs/indexer.md: ``python docs/img/make_indexer.py`` (from the repository root)."""

from __future__ import annotations

from pathlib import Path

import torch

from mlaspec.conformance.viz.indexer import draw_indexer_logits, draw_prefill_chunks
from mlaspec.spec.indexer import (
    fold_indexer_weights,
    indexer_logits,
    kv_spans_from_batches,
    quantize_indexer_k,
    quantize_indexer_q,
    split_indexer_prefill_chunks,
)
from mlaspec.spec.topk import topk_indices

HERE = Path(__file__).parent


def main() -> None:
    g = torch.Generator().manual_seed(0)
    # two prefill requests: 6 keys / 4 new queries and 9 keys / 5 new queries
    qsl, lens = torch.tensor([0, 4, 9]), torch.tensor([6, 9])
    ks, ke = kv_spans_from_batches(qsl, lens)
    h, d = 8, 128
    q = torch.randn(9, h, d, generator=g)
    k = torch.randn(15, d, generator=g)
    w = torch.randn(9, h, generator=g)
    qq, qk = quantize_indexer_q(q, w), quantize_indexer_k(k)
    logits = indexer_logits(qq.q_fp8, qk.k_fp8, qq.weights, ks, ke, qk.k_scale)
    top = topk_indices(logits, 4, row_starts=ks, row_ends=ke, relative=True)
    fig = draw_indexer_logits(logits, top.indices, row_starts=ks, title="fp8 indexer logits, K = 4 (two requests)")
    fig.savefig(HERE / "indexer_logits.png")

    exact = indexer_logits(q, k, fold_indexer_weights(w), ks, ke)
    fig = draw_indexer_logits(exact - torch.where(torch.isfinite(logits), logits, exact), title="float64 - fp8 logits")
    fig.savefig(HERE / "indexer_fp8_error.png")

    seq_lens, query_lens = torch.tensor([40, 120, 64, 300]), torch.tensor([40, 30, 64, 300])
    chunks = split_indexer_prefill_chunks(seq_lens, query_lens, workspace_size=400, max_logits_bytes=4 * 20000)
    fig = draw_prefill_chunks(chunks, seq_lens, query_lens, title="split_indexer_prefill_chunks (budget 20000 logits)")
    fig.savefig(HERE / "indexer_prefill_chunks.png")


if __name__ == "__main__":
    main()
