"""Regenerate docs/img/report_mask_picture.png and docs/img/report_schedule_picture.png, two pictures the report
draws next to a failing case's heat map: ``python docs/img/make_report_pictures.py``.

The backends are eager PyTorch with one bug each: a causal mask aligned top-left instead of bottom-right (on six
queries over three keys), and a context chunk that ends one token early.
"""

import dataclasses
import math
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import torch

from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import case_by_id
from mlaspec.conformance.runner import run_case

HERE = Path(__file__).parent


class TopLeftCausal(TorchBackend):
    """Query i sees keys <= i, whatever S_kv is."""

    def attention(self, q, k, v, *, scale, causal=False, mask=None):
        g = q.shape[2] // k.shape[2]
        m = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(g, 2)) * scale
        s = s.masked_fill(~m, -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        return torch.einsum("bhqk,bkhd->bqhd", p, v.float().repeat_interleave(g, 2)).to(q.dtype), lse


class ChunkBoundaryOffByOne(TorchBackend):
    """A full context chunk ends one token early."""

    def chunked_prefill_attention(self, q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, context, plan, W_UK, W_UV, *, scale):
        plan = dataclasses.replace(plan, seq_lens=plan.seq_lens - (plan.seq_lens == plan.max_context_chunk).long())
        return super().chunked_prefill_attention(
            q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, context, plan, W_UK, W_UV, scale=scale
        )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for backend, case_id, out in [
            (TopLeftCausal(), "attention[more-queries-than-keys-bfloat16]", "report_mask_picture.png"),
            (
                ChunkBoundaryOffByOne(),
                "chunked_prefill_attention[v3-workspace-chunks-no-context-bfloat16]",
                "report_schedule_picture.png",
            ),
        ]:
            r = run_case(backend, case_by_id(case_id), backend_name="mine", figure_dir=Path(tmp))
            (HERE / out).write_bytes(Path(r.figures[0]).read_bytes())


if __name__ == "__main__":
    main()
