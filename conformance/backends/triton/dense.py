"""The dense ops of backend ``triton`` (a mixin of :class:`mlaspec.conformance.backends.triton.TritonBackend`).

Each method translates the harness's arguments (the spec function's, padded batch) to a kernel's interface and
back:

* ``mla_decode``: the gathered entries ``kv [B, S_kv, 576]`` are scattered into a paged cache with 64-slot pages
  in *shuffled* physical order, NaN in every unused slot and page, a block table with a spare ``-1`` column, then
  :func:`mlaspec.impl.decode.mla_decode_paged` runs (split-KV plus combine, as in serving).
* ``attention``: the padded batch is packed to varlen (``cu_seqlens``) for
  :func:`mlaspec.impl.prefill.flash_attn_varlen`; the LSE comes back ``[H_q, T]`` and is laid out ``[B, H_q, S_q]``.
* ``mla_prefill``: ``k_nope = kv_c W_UK`` and ``v = kv_c W_UV`` are materialised in the case dtype (fp32 matmul,
  as vLLM's prefill does), ``k_pe`` is broadcast to every head, then the varlen kernel runs with ``D_qk = 192``.
* ``mla_absorbed``: the whole absorbed (decode) form as vLLM runs it: the small projections in torch, as vLLM's
  cuBLAS bmm (:func:`mlaspec.impl.layer.absorb_query`: ``ql_nope = q_nope W_UK^T`` rounded to the case dtype;
  :func:`mlaspec.impl.layer.unabsorb_output`: ``o_lat W_UV``), the attention over the entries ``[kv_c | k_pe]``
  through a kernel: the paged decode kernel (as ``mla_decode`` above, MTP queries causal and aligned to the end)
  when ``Lkv`` and ``D_rope`` are powers of two >= 16 (DeepSeek's 512 + 64), else the varlen kernel as MQA (one KV
  head, ``v = kv_c``) when ``Lkv + D_rope <= 256``; other widths are a named limit.
* ``merge_attn_states``: :func:`mlaspec.impl.merge.merge_attn_states` directly.
* ``dcp_decode``: our DCP path, the paged decode kernel on each rank's share
  (:func:`mlaspec.conformance.backends.common.dcp_decode_by_ranks`) and the Triton combine
  :func:`mlaspec.impl.dcp.dcp_combine` (``dcp_combine`` below) in place of the spec's.
"""

from __future__ import annotations

import torch

from mlaspec.conformance.ops import implemented_ops
from mlaspec.impl import decode as _decode
from mlaspec.impl.dcp import dcp_combine as _dcp_combine
from mlaspec.impl.decode import mla_decode_paged, page_cache
from mlaspec.impl.layer import absorb_query, unabsorb_output
from mlaspec.impl.merge import merge_attn_states as _merge
from mlaspec.impl.prefill import PrefillConfig, flash_attn_varlen

from ..common import DCPByRanks

__all__ = ["DENSE_OPS", "TritonDense", "interpreted", "pow2_at_least_16"]


def interpreted() -> bool:
    """Whether this process's kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(_decode._mla_decode_split_kernel).__name__ == "InterpretedFunction"


def pow2_at_least_16(x: int) -> bool:
    return x >= 16 and not x & (x - 1)


def _absorbed_by_decode(lkv: int, r: int) -> bool:
    """Whether the paged decode kernel takes entries of ``Lkv + D_rope`` (it splits them into two power-of-two
    dots)."""
    return pow2_at_least_16(lkv) and pow2_at_least_16(r)


class TritonDense(DCPByRanks):
    """Dense attention, the MLA decode / prefill / absorbed forms and the merge; expects ``self.device`` and
    ``self.prefill_config`` (set by ``TritonBackend.__init__``)."""

    device: torch.device
    prefill_config: PrefillConfig | None

    # -- limits, named -------------------------------------------------------------------------------------------
    def _unsupported_attention(self, case) -> str | None:
        p = case.params
        if p["D_qk"] > 256 or p["D_v"] > 256:
            return f"attention head dims must be <= 256, got D_qk={p['D_qk']}, D_v={p['D_v']}"
        return None

    def _unsupported_mla_decode(self, case) -> str | None:
        p = case.params
        if not (pow2_at_least_16(p["D_v"]) and pow2_at_least_16(p["D_qk"] - p["D_v"])):
            return f"mla_decode needs D_v and D_qk - D_v powers of two >= 16 (512 + 64), got {p['D_v']}, {p['D_qk']}"
        return None

    def _unsupported_mla_prefill(self, case) -> str | None:
        p = case.params
        if p["D_nope"] + p["D_rope"] > 256 or p["D_v"] > 256:
            return (
                f"mla_prefill head dims must be <= 256, got D_qk = D_nope + D_rope = {p['D_nope']} + {p['D_rope']}, "
                f"D_v = {p['D_v']}"
            )
        return None

    def _unsupported_mla_absorbed(self, case) -> str | None:
        p = case.params
        if _absorbed_by_decode(p["Lkv"], p["D_rope"]) or p["Lkv"] + p["D_rope"] <= 256:
            return None
        return (
            f"mla_absorbed: the paged decode kernel needs Lkv and D_rope powers of two >= 16 (512 + 64) and the "
            f"varlen kernel Lkv + D_rope <= 256, got Lkv={p['Lkv']}, D_rope={p['D_rope']}"
        )

    # -- ops -----------------------------------------------------------------------------------------------------
    def attention(self, q, k, v, *, scale, causal=False, mask=None):
        if mask is not None:
            raise ValueError("mask: the triton attention kernel supports only causal masking")
        B, S_q, H_q, _ = q.shape
        S_kv = k.shape[1]
        q, k, v = (t.to(self.device) for t in (q, k, v))
        cu_q = torch.arange(B + 1, dtype=torch.int32, device=self.device) * S_q
        cu_k = torch.arange(B + 1, dtype=torch.int32, device=self.device) * S_kv
        out, lse = flash_attn_varlen(
            q.flatten(0, 1),
            k.flatten(0, 1),
            v.flatten(0, 1),
            cu_q,
            cu_k,
            max_seqlen_q=S_q,
            scale=scale,
            causal=causal,
            config=self.prefill_config,
        )
        return out.view(B, S_q, H_q, -1), lse.view(H_q, B, S_q).transpose(0, 1)

    def mla_decode(self, q, kv, *, d_v, scale, causal=False, seq_lens=None):
        S_kv = kv.shape[1]
        q, kv = q.to(self.device), kv.to(self.device)
        g = torch.Generator().manual_seed(S_kv)  # the page shuffle: fixed per shape, different across shapes
        cache, block_table, seq_lens = page_cache(kv, page_size=64, generator=g, seq_lens=seq_lens)
        return mla_decode_paged(q, cache, block_table, seq_lens, d_v=d_v, scale=scale, causal=causal, max_seq_len=S_kv)

    def mla_prefill(self, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, *, scale, causal=False):
        dtype = q_nope.dtype
        q_nope, q_pe, kv_c, k_pe, W_UK, W_UV = (t.to(self.device) for t in (q_nope, q_pe, kv_c, k_pe, W_UK, W_UV))
        B, S_q, H_q, _ = q_nope.shape
        # up-project the latent once per key, rounded to the case dtype, as vLLM materialises k_nope and v
        k_nope = torch.einsum("bsl,lnp->bsnp", kv_c.float(), W_UK.float()).to(dtype)  # [B, S_kv, H_q, D_nope]
        v = torch.einsum("bsl,lnv->bsnv", kv_c.float(), W_UV.float()).to(dtype)  # [B, S_kv, H_q, D_v]
        q = torch.cat([q_nope, q_pe], -1)  # [B, S_q, H_q, D_nope + D_rope]
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, H_q, -1)], -1)  # [B, S_kv, H_q, D_nope + D_rope]
        return self.attention(q, k, v, scale=scale, causal=causal)

    def mla_absorbed(self, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, *, scale, causal=False, mask=None):
        """``out [B, S_q, H_q, D_v]`` (q_nope's dtype) and ``lse [B, H_q, S_q]`` fp32 from the spec's arguments
        (:func:`mlaspec.spec.forms.mla_absorbed`: ``q_nope [B, S_q, H_q, D_nope]``, ``q_pe [B, S_q, H_q, D_rope]``,
        ``kv_c [B, S_kv, Lkv]``, ``k_pe [B, S_kv, D_rope]``, ``W_UK [Lkv, H_q, D_nope]``, ``W_UV [Lkv, H_q,
        D_v]``)."""
        if mask is not None:
            raise ValueError("mask: the triton absorbed form supports only causal masking")
        dev, lkv, r = self.device, kv_c.shape[-1], k_pe.shape[-1]
        if k_pe.dtype != kv_c.dtype:
            raise TypeError(f"k_pe must have kv_c's dtype {kv_c.dtype}, got {k_pe.dtype}")
        q = absorb_query(q_nope.to(dev), q_pe.to(dev), W_UK.to(dev))  # [B, S_q, H_q, Lkv + D_rope]
        kv = torch.cat([kv_c, k_pe], -1).to(dev, q.dtype)  # [B, S_kv, Lkv + D_rope]: the cache entries
        if _absorbed_by_decode(lkv, r):
            o_lat, lse = self.mla_decode(q, kv, d_v=lkv, scale=scale, causal=causal)
        elif lkv + r <= 256:
            o_lat, lse = self.attention(q, kv[:, :, None], kv[:, :, None, :lkv], scale=scale, causal=causal)
        else:
            raise ValueError(
                f"kv_c, k_pe: Lkv={lkv}, D_rope={r} fit neither the decode kernel (powers of two >= 16) nor "
                f"the varlen kernel (Lkv + D_rope <= 256)"
            )
        return unabsorb_output(o_lat, W_UV.to(dev)), lse

    def merge_attn_states(self, prefix_output, prefix_lse, suffix_output, suffix_lse):
        args = (t.to(self.device) for t in (prefix_output, prefix_lse, suffix_output, suffix_lse))
        return tuple(_merge(*args))

    # -- decode context parallelism ------------------------------------------------------------------------------
    def dcp_combine(self, outs, lses):
        """The Triton combine on the stacked partials ``outs [N_cp, B, S_q, H_q, D_v]``, ``lses [N_cp, B, H_q,
        S_q]`` (rows ``B * S_q``, vLLM's ``[N, B, H, D]`` / ``[N, B, H]``)."""
        n, b, s_q, h, d = outs.shape
        got = _dcp_combine(outs.reshape(n, b * s_q, h, d), lses.transpose(2, 3).reshape(n, b * s_q, h))
        return got.out.reshape(b, s_q, h, d), got.lse.reshape(b, s_q, h).transpose(1, 2)


DENSE_OPS = implemented_ops(TritonDense)
"""The ops this mixin has a method for."""
