"""The torch backend's sparse and indexer ops (a mixin of ``TorchBackend``).

Written the way an adapter for a real kernel would be: the sparse ops gather the named keys (masking invalid slots
*before* the softmax and zeroing them, so NaN in unused cache rows never leaks), compute logits and softmax in fp32,
round ``p`` to the case dtype for ``p @ v``, apply the sink in fp32 and report an empty row's LSE as ``+inf``;
``v4_attention`` takes the layer's window and compressed indices from the spec (input preparation:
:func:`~mlaspec.spec.sliding_window.v4_attention_indices`) and calls the same sparse core, its own second
implementation of the attention math; the indexer ops read fp8 as fp32 and accumulate in fp32; ``topk_indices`` uses
``torch.topk`` (ties broken however torch breaks them) and writes ``-1`` past each row's valid keys.
"""

from __future__ import annotations

import math

import torch

from mlaspec.spec.indexer import decode_context_lens_native
from mlaspec.spec.sliding_window import v4_attention_indices


class TorchSparse:
    """Eager-torch implementations of the sparse ops, rounding where a fused kernel rounds."""

    device: torch.device

    # -- sparse attention core ---------------------------------------------------------------------------------------
    def _sparse_rows(self, q, rows, idx, valid, *, scale, d_v, attn_sink):
        """``q [R, H_q, D]`` over ``rows [S, H_kv, D]`` named by ``idx [R, H_kv, K]`` where ``valid``.

        Returns ``out [R, H_q, d_v]`` (case dtype), ``lse [R, H_q]`` fp32 (+inf on empty rows), ``max_logits``.
        """
        dtype = q.dtype
        q, rows, idx, valid = (t.to(self.device) for t in (q, rows, idx, valid))
        h_kv = rows.shape[1]
        g = q.shape[1] // h_kv
        safe = torch.where(valid, idx.long(), 0)
        heads = torch.arange(h_kv, device=self.device)[None, :, None]
        keys = torch.where(valid[..., None], rows[safe, heads], 0)  # [R, H_kv, K, D]: an invalid slot reads nothing
        qg = q.reshape(q.shape[0], h_kv, g, q.shape[-1]).float()  # query head h reads KV head h // g
        s = torch.einsum("rcgd,rckd->rcgk", qg, keys.float()) * scale
        s = s.masked_fill(~valid[:, :, None, :], -math.inf).flatten(1, 2)  # [R, H_q, K]
        lse = torch.logsumexp(s, -1)  # -inf on empty rows
        max_logits = s.amax(-1) if s.shape[-1] else torch.full_like(lse, -math.inf)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0).to(dtype)  # p in the case dtype, as fed to the MMA
        p = p.reshape(q.shape[0], h_kv, g, -1).float()
        out = torch.einsum("rcgk,rckd->rcgd", p, keys[..., :d_v].float()).flatten(1, 2)  # exact products, fp32 sums
        empty = torch.isneginf(lse)
        if attn_sink is not None:
            sink = attn_sink.to(self.device, torch.float32)[None, :]
            out = out * torch.where(empty, 0.0, torch.sigmoid(lse - sink))[..., None]  # LSE itself unchanged
        return out.to(dtype), lse.masked_fill(empty, math.inf), max_logits

    def sparse_prefill(self, q, kv, indices, scale, d_v=512, attn_sink=None, topk_length=None):
        valid = (indices >= 0) & (indices < kv.shape[0])
        if topk_length is not None:
            valid &= torch.arange(indices.shape[-1])[None, None, :] < topk_length[:, None, None]
        out, lse, max_logits = self._sparse_rows(q, kv, indices, valid, scale=scale, d_v=d_v, attn_sink=attn_sink)
        return out, max_logits, lse

    @staticmethod
    def _paged_rows(cache, indices, lengths, s_q):
        rows = cache.reshape(-1, 1, cache.shape[-1])  # global slot block * P + offset is a flat row
        idx = indices.reshape(-1, 1, indices.shape[-1])
        valid = idx != -1
        if lengths is not None:  # one length per request, shared by its S_q queries
            valid &= torch.arange(idx.shape[-1])[None, None, :] < lengths.repeat_interleave(s_q)[:, None, None]
        return rows, idx, valid

    def sparse_decode(
        self,
        q,
        kv_cache,
        indices,
        *,
        scale=None,
        d_v=512,
        topk_length=None,
        attn_sink=None,
        extra_kv_cache=None,
        extra_indices=None,
        extra_topk_length=None,
    ):
        b, s_q, h_q, d = q.shape
        scale = d**-0.5 if scale is None else scale
        rows, idx, valid = self._paged_rows(kv_cache, indices, topk_length, s_q)
        if extra_kv_cache is not None:  # one softmax over both caches: stack them and offset the extra indices
            e_rows, e_idx, e_valid = self._paged_rows(extra_kv_cache, extra_indices, extra_topk_length, s_q)
            idx = torch.cat([idx, torch.where(e_valid, e_idx + rows.shape[0], -1)], -1)
            valid = torch.cat([valid, e_valid], -1)
            rows = torch.cat([rows, e_rows])
        out, lse, _ = self._sparse_rows(
            q.reshape(b * s_q, h_q, d), rows, idx, valid, scale=scale, d_v=d_v, attn_sink=attn_sink
        )
        return out.reshape(b, s_q, h_q, -1), lse.reshape(b, s_q, h_q).transpose(1, 2)

    def v4_attention(
        self,
        q,
        raw_kv,
        *,
        window,
        scale,
        compressed_kv=None,
        compress_ratio=1,
        topk_indices=None,
        attn_sink=None,
        d_v=512,
    ):
        compressed = compress_ratio > 1  # compressed entries first, then the raw keys, one buffer
        rows = torch.cat([compressed_kv, raw_kv]) if compressed else raw_kv
        idx = v4_attention_indices(  # the layer's keys as index rows: input preparation, the spec's rule
            q.shape[0],
            raw_kv.shape[0],
            window=window,
            compress_ratio=compress_ratio,
            topk_indices=topk_indices if compressed else None,
            num_compressed=compressed_kv.shape[0] if compressed else 0,
        )
        out, lse, _ = self._sparse_rows(
            q, rows[:, None], idx[:, None], idx[:, None] >= 0, scale=scale, d_v=d_v, attn_sink=attn_sink
        )
        return out, lse

    # -- indexer ---------------------------------------------------------------------------------------------------
    def indexer_logits(self, q, k, weights, ks, ke, k_scale=None):
        q, k, w = (t.to(self.device).float() for t in (q, k, weights))
        score = torch.einsum("mhd,nd->mhn", q, k).relu()
        logits = torch.einsum("mhn,mh->mn", score, w)
        if k_scale is not None:
            logits = logits * k_scale.to(self.device).float()[None, :]
        cols = torch.arange(k.shape[0], device=self.device)[None, :]
        inside = (cols >= ks.to(self.device)[:, None]) & (cols < ke.to(self.device)[:, None])
        return logits.masked_fill(~inside, -math.inf)

    def paged_indexer_logits(self, q, cache, block_table, context_lens, weights, *, max_context_len=None):
        b, next_n, h, d = q.shape
        block = cache.shape[1]
        if context_lens.dim() == 1:
            lens = decode_context_lens_native(context_lens, next_n)  # the spec's convention for 1-D lengths
        else:
            lens = context_lens.long()
        width = int(lens.max()) if max_context_len is None else max_context_len
        out = torch.full((b * next_n, width), -math.inf, device=self.device)
        flat = cache.reshape(cache.shape[0], -1)  # a block: P * D fp8 values, then P fp32 scales
        for r in range(b):
            n = int(lens[r].max())
            if n == 0:
                continue
            blocks, off = self._key_slots(block_table[r], torch.arange(n), block)
            vals = flat[blocks[:, None], off[:, None] * d + torch.arange(d)].view(torch.float8_e4m3fn)
            scale_bytes = flat[blocks[:, None], block * d + 4 * off[:, None] + torch.arange(4)]
            scale = scale_bytes.contiguous().view(torch.float32).reshape(-1)
            zeros = torch.zeros(next_n, dtype=torch.int64)
            rows = slice(r * next_n, (r + 1) * next_n)
            out[rows, :n] = self.indexer_logits(q[r], vals, weights[rows], zeros, lens[r], scale)
        return out

    @staticmethod
    def _key_slots(table_row, positions, block):
        """Physical block and offset of each key position of one request: ``table_row[n // P]``, ``n % P``."""
        return table_row[positions // block].long(), positions % block

    # -- top-k -----------------------------------------------------------------------------------------------------
    def topk_indices(self, logits, k, *, row_starts=None, row_ends=None, relative=False):
        m, n = logits.shape
        x = logits.to(self.device).float()
        cols = torch.arange(n, device=self.device)[None, :]
        valid = x > -math.inf
        if row_starts is not None:
            valid &= cols >= row_starts.to(self.device)[:, None]
        if row_ends is not None:
            valid &= cols < row_ends.to(self.device)[:, None]
        x = torch.nn.functional.pad(x.masked_fill(~valid, -math.inf), (0, max(k - n, 0)), value=-math.inf)
        vals, idx = torch.topk(x, k, dim=-1)
        if relative:
            idx = idx - row_starts.to(self.device).long()[:, None]
        return torch.where(torch.isneginf(vals), -1, idx).to(torch.int32)
