"""Backend ``torch``: eager PyTorch in the case dtype, rounding where a fused kernel rounds.

Logits and softmax in fp32, the weights ``p`` rounded to the case dtype for ``p @ v``, the output in the case dtype,
LSE in fp32 (natural log). Runs on CPU, or on CUDA when ``MLASPEC_DEVICE=cuda``. A plain implementation to show
what a backend looks like; it also keeps the harness honest: it must pass within the derived budgets.
"""

from __future__ import annotations

import math
import os

import torch

from mlaspec.spec.attention import causal_mask, seq_lens_mask

from ..ops import OPS
from .common import DCPByRanks, DCPFP8ByRanks
from .torch_fp8 import TorchFP8
from .torch_serving import TorchServing
from .torch_sparse import TorchSparse


class TorchBackend(TorchServing, TorchSparse, TorchFP8, DCPByRanks, DCPFP8ByRanks):
    name = "torch"
    version = f"torch {torch.__version__}"
    dtypes = frozenset({"bfloat16", "float16", "float32"})

    @property
    def ops(self) -> frozenset[str]:
        """Every op this class implements a method for."""
        return frozenset(op for op in OPS if callable(getattr(type(self), op, None)))

    def __init__(self, device: str | None = None):
        self.device = torch.device(device or os.environ.get("MLASPEC_DEVICE", "cpu"))

    def attention(self, q, k, v, *, scale, causal=False, mask=None):
        dtype = q.dtype
        q, k, v = (t.to(self.device) for t in (q, k, v))
        b, s_q, h_q, d = q.shape
        h_kv, s_kv = k.shape[2], k.shape[1]
        g = h_q // h_kv  # query head h reads KV head h // g
        s = torch.einsum("bqkgd,bjkd->bkgqj", q.float().reshape(b, s_q, h_kv, g, d), k.float())
        s = s.reshape(b, h_q, s_q, s_kv) * scale
        allowed = torch.ones(s.shape[-2:], dtype=torch.bool, device=self.device)
        if causal:
            allowed = causal_mask(q.shape[1], k.shape[1], device=self.device)
        if mask is not None:  # [B, S_q, S_kv] or [B, H_q, S_q, S_kv]
            allowed = allowed & (mask[:, None] if mask.dim() == 3 else mask).to(self.device)
        s = s.masked_fill(~allowed, -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0).to(dtype)  # p in the case dtype, as kernels feed the MMA
        out = torch.einsum("bkgqj,bjkd->bqkgd", p.reshape(b, h_kv, g, s_q, s_kv), v)
        return out.reshape(b, s_q, h_q, v.shape[-1]).to(dtype), lse

    def mla_decode(self, q, kv, *, d_v, scale, causal=False, seq_lens=None):
        k = kv[:, :, None]
        if seq_lens is None:
            return self.attention(q, k, k[..., :d_v], scale=scale, causal=causal)
        mask = seq_lens_mask(seq_lens, q.shape[1], kv.shape[1], causal=causal)
        return self.attention(q, k, k[..., :d_v], scale=scale, mask=mask)

    def mla_prefill(self, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, *, scale, causal=False):
        dtype = q_nope.dtype
        k_nope = torch.einsum("bsl,lnp->bsnp", kv_c.float(), W_UK.float()).to(dtype)  # materialised, as vLLM does
        v = torch.einsum("bsl,lnv->bsnv", kv_c.float(), W_UV.float()).to(dtype)
        q = torch.cat([q_nope, q_pe], -1)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, k_nope.shape[2], -1)], -1)
        return self.attention(q, k, v, scale=scale, causal=causal)

    def mla_absorbed(self, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, *, scale, causal=False):
        dtype = q_nope.dtype
        ql_nope = torch.einsum("bsnp,lnp->bsnl", q_nope.float(), W_UK.float()).to(dtype)  # as vLLM's bmm with W_UK_T
        o_lat, lse = self.mla_decode(
            torch.cat([ql_nope, q_pe], -1), torch.cat([kv_c, k_pe], -1), d_v=kv_c.shape[-1], scale=scale, causal=causal
        )
        out = torch.einsum("bsnl,lnv->bsnv", o_lat.float(), W_UV.to(o_lat.device).float())
        return out.to(dtype), lse

    def merge_attn_states(self, prefix_output, prefix_lse, suffix_output, suffix_lse):
        p_lse, s_lse = (l.float().masked_fill(l == math.inf, -math.inf) for l in (prefix_lse, suffix_lse))
        m = torch.maximum(p_lse, s_lse)
        empty = torch.isneginf(m)
        m = m.masked_fill(empty, 0.0)
        p_w, s_w = torch.exp(p_lse - m), torch.exp(s_lse - m)
        total = p_w + s_w
        out = prefix_output.float() * (p_w / total).T[..., None] + suffix_output.float() * (s_w / total).T[..., None]
        out = torch.where(empty.T[..., None], prefix_output.float(), out)
        lse = torch.where(empty, -math.inf, torch.log(total) + m)
        return out.to(prefix_output.dtype), lse
