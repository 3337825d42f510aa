"""Regenerate the figures of docs/serving.md (a batch's life: regions, reorder, chunk schedule, merge weights).

Run from the repository root: ``python docs/img/make_schedule.py``.
"""

from pathlib import Path

import torch

from mlaspec.conformance.viz.schedule import draw_batch, draw_chunk_schedule, draw_merge_weights
from mlaspec.spec.batch import Request, build_metadata, reorder_batch_to_split_decodes_and_prefills
from mlaspec.spec.chunked_context import plan_context_chunks
from mlaspec.spec.forms import mla_mha

OUT = Path(__file__).parent

# The persistent batch as the scheduler left it: new requests appended at the back, decodes scattered.
BATCH = [Request(0, 9), Request(12, 1), Request(20, 6), Request(30, 1), Request(7, 3), Request(25, 1)]


def batch_before():
    m = build_metadata(BATCH, block_size=4)
    return draw_batch(m, title="before the reorder: decodes and prefills interleaved")


def batch_after():
    r = reorder_batch_to_split_decodes_and_prefills(BATCH, regions=2)
    m = build_metadata(list(r.requests), block_size=4)
    swaps = ", ".join(f"{i}<->{j}" for i, j in r.swaps)
    return draw_batch(m, title=f"after the seed's reorder (swaps {swaps}): decodes first")


def chunk_schedule():
    plan = plan_context_chunks([700, 0, 300, 1000], workspace_size=1024, block_size=64)
    return draw_chunk_schedule(plan)


def merge_weights():
    # one prefill with 11 context tokens (chunk width 4) and 3 new tokens; the last new token, head 0
    g = torch.Generator().manual_seed(2)
    n, p, r, lkv, v, c, q = 2, 4, 2, 6, 4, 11, 3
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q_nope, q_pe = rnd(1, q, n, p), rnd(1, q, n, r)
    kv_c, k_pe = rnd(1, c + q, lkv), rnd(1, c + q, r)
    w_uk, w_uv = rnd(lkv, n, p), rnd(lkv, n, v)
    plan = plan_context_chunks([c], workspace_size=4, block_size=1)
    lses = {}
    for i in range(plan.num_chunks):
        s, length = int(plan.starts[i, 0]), int(plan.seq_lens[i, 0])
        _, lse = mla_mha(q_nope, q_pe, kv_c[:, s : s + length], k_pe[:, s : s + length], w_uk, w_uv, scale=0.5)
        lses[f"chunk {i}\n[{s}, {s + length})"] = float(lse[0, 0, -1])
    _, lse = mla_mha(q_nope, q_pe, kv_c[:, c:], k_pe[:, c:], w_uk, w_uv, scale=0.5, causal=True)
    lses["new tokens\n(causal)"] = float(lse[0, 0, -1])
    return draw_merge_weights(lses, title="one query's attention, split by part: merge weights exp(lse_i - lse)")


if __name__ == "__main__":
    for name, make in [
        ("batch_before_reorder", batch_before),
        ("batch_after_reorder", batch_after),
        ("chunk_schedule", chunk_schedule),
        ("merge_weights", merge_weights),
    ]:
        fig = make()
        fig.savefig(OUT / f"{name}.png", dpi=110)
        print("wrote", OUT / f"{name}.png")
