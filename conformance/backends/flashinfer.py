"""Backend ``flashinfer``: FlashInfer's MLA paged decode and its two-state merge.

Imports ``flashinfer`` (FlashInfer 0.7.2.post1 from PyPI: ``pip install flashinfer-python==0.7.2.post1``; its
kernels JIT-compile with the machine's ``nvcc`` on first use). Ops:

* ``mla_decode`` -> ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (``plan`` then ``run``): the query is split
  into ``q_nope [B * S_q, H, 512]`` and ``q_pe [B * S_q, H, 64]``, the gathered ``kv [B, S_kv, 576]`` is paged
  (shuffled pages, NaN in unused slots: :func:`~mlaspec.conformance.backends.common.page_kv`) and split into the
  ``ckv [pages, P, 512]`` and ``kpe [pages, P, 64]`` caches, with ``kv_indptr``/``kv_indices`` listing each
  request's pages and ``kv_len_arr`` its length. Causal masking in FlashInfer aligns queries to the end of the
  context (bottom-right), as the spec does.
  **The LSE comes back in base 2** (``log2(sum(exp2(s * log2 e)))``, FlashInfer's internal base; ``run``'s
  ``return_lse_base_on_e`` defaults to False in ``flashinfer/mla/_core.py``), ``[B * S_q, H]``: the adapter
  multiplies by ``ln 2`` (:func:`~mlaspec.conformance.backends.common.log2_to_ln`) and transposes to the spec's
  ``[B, H, S_q]``. Without that conversion every LSE is off by a factor ``1 / ln 2 = 1.44``.
* ``merge_attn_states`` -> ``flashinfer.merge_state(v_a, s_a, v_b, s_b)``: LSEs ``[T, H]`` in **base 2**
  (``include/flashinfer/attention/cascade.cuh``: "Both s and s_other are logsumexp values with base 2"). The
  adapter converts the spec's natural-log ``[H, T]`` LSEs to base 2 and back, and transposes; nothing else.
  FlashInfer's merge reads only ``-inf`` as empty (``exp2(max(s - s_max, -inf))`` turns a ``+inf`` part into a
  NaN weight), and an all-empty row merges to a zero output; vLLM's merge -- the spec -- reads ``+inf`` as empty
  too and keeps the prefix output. Those cases are left to fail: they are real differences of convention.

``MLASPEC_FLASHINFER_BACKEND`` picks the wrapper backend (``auto``: fa3 on SM90, fa2 elsewhere) and
``MLASPEC_FLASHINFER_PAGE`` the page size (default 64).
"""

from __future__ import annotations

import os

import torch

from .common import DCPByRanks, case_param, import_first, ln_to_log2, log2_to_ln, page_kv, require_cuda

__all__ = ["FlashInferBackend", "page_table_csr"]


def page_table_csr(block_table: torch.Tensor, seqlens: torch.Tensor, page_size: int):
    """A padded block table as FlashInfer's CSR page list: ``kv_indptr [B + 1]`` and ``kv_indices`` (int32), the
    first ``ceil(seqlens[b] / P)`` pages of each row."""
    used = [-(-int(n) // page_size) for n in seqlens.tolist()]
    rows = [block_table[i, :u].to(torch.int32) for i, u in enumerate(used)]
    indices = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int32)
    indptr = torch.zeros(len(used) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(used, dtype=torch.int32).cumsum(0)
    return indptr, indices


class FlashInferBackend(DCPByRanks):
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` and ``merge_state`` (see the module docstring)."""

    name = "flashinfer"
    ops = frozenset({"mla_decode", "dcp_decode", "merge_attn_states"})
    jit = True  # its kernels JIT-compile on first use (~20 s each on the H200)
    dtypes = frozenset({"bfloat16", "float16"})

    def __init__(self, device: str | None = None):
        hint = (
            "pip install flashinfer-python==0.7.2.post1, FlashInfer 0.7.2.post1 from PyPI; where there is no "
            "network, vendor that wheel onto PYTHONPATH"
        )
        self.fi = import_first("flashinfer", what="flashinfer", hint=hint)
        self.device = torch.device(device) if device else require_cuda("flashinfer")
        self.backend = os.environ.get("MLASPEC_FLASHINFER_BACKEND", "auto")
        self.page = int(os.environ.get("MLASPEC_FLASHINFER_PAGE", "64"))
        self.version = f"flashinfer {getattr(self.fi, '__version__', '?')} (mla backend {self.backend})"
        self._workspace = None

    def unsupported(self, case) -> str | None:
        if case.op in ("mla_decode", "dcp_decode"):
            d, d_v = case_param(case, "D_qk"), case_param(case, "D_v", default=512)
            if d_v != 512 or d - d_v not in (0, 64):
                return f"FlashInfer MLA takes head_dim_ckv 512 and head_dim_kpe 64 (or 0), case has {d}/{d_v}"
        if case.op == "merge_attn_states" and case_param(case, "D") not in (64, 128, 256, 512):
            # flashinfer/attention/cascade.cuh MergeState: DISPATCH_HEAD_DIM (include/flashinfer/utils.cuh)
            return f"FlashInfer's merge_state takes head_dim 64, 128, 256 or 512, case has {case_param(case, 'D')}"
        return None

    def mla_decode(self, q, kv, *, d_v, scale, causal=False, seq_lens=None):
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        dev = self.device
        b, s_q, h, d = q.shape
        paged = page_kv(kv.to(dev), self.page, seqlens=seq_lens, seed=b * 7919 + kv.shape[1])
        indptr, indices = page_table_csr(paged.block_table.cpu(), paged.seqlens.cpu(), self.page)
        if self._workspace is None:
            self._workspace = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device=dev)
        wrapper = BatchMLAPagedAttentionWrapper(self._workspace, backend=self.backend)
        qo_indptr = (torch.arange(b + 1, dtype=torch.int32) * s_q).to(dev)
        wrapper.plan(
            qo_indptr,
            indptr.to(dev),
            indices.to(dev),
            paged.seqlens,
            h,
            d_v,
            d - d_v,
            self.page,
            causal,
            scale,
            q.dtype,
            kv.dtype,
        )
        qf = q.to(dev).reshape(b * s_q, h, d)
        ckv = paged.cache[..., :d_v].contiguous()
        kpe = paged.cache[..., d_v:].contiguous()
        out, lse = wrapper.run(qf[..., :d_v].contiguous(), qf[..., d_v:].contiguous(), ckv, kpe, return_lse=True)
        lse = log2_to_ln(lse).reshape(b, s_q, h).transpose(1, 2)  # base 2 -> natural log, [B, H, S_q]
        return out.reshape(b, s_q, h, d_v), lse

    def merge_attn_states(self, prefix_output, prefix_lse, suffix_output, suffix_lse):
        dev = self.device
        s_a = ln_to_log2(prefix_lse.to(dev)).T.contiguous()  # [H, T] natural log -> [T, H] base 2
        s_b = ln_to_log2(suffix_lse.to(dev)).T.contiguous()
        v, s = self.fi.merge_state(prefix_output.to(dev).contiguous(), s_a, suffix_output.to(dev).contiguous(), s_b)
        return v, log2_to_ln(s).T  # [T, H, D], [H, T] natural log
