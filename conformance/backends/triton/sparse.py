"""The sparse ops of backend ``triton`` (a mixin of
:class:`mlaspec.conformance.backends.triton.TritonBackend`).

Each method translates the harness's arguments to :func:`mlaspec.impl.sparse.sparse_mla` and back:

* ``sparse_prefill``: ``kv [S_kv, H_kv, D_qk]`` read as rows, indices ``[S_q, H_kv, K]`` as given (every sentinel
  ``< 0`` or ``>= S_kv`` is skipped in the kernel), ``topk_length [S_q]``; one program per query row and head block.
* ``sparse_decode``: the harness hands a dequantized paged cache ``[NB, P, D_qk]``. When the cache is exactly
  representable in FlashMLA's fp8 sparse layout (656 B V3.2 / 584 B V4; the cases flagged ``fp8_cache``), it is
  written in that layout with the spec's writer (:func:`mlaspec.impl.sparse.quantize_keys`, never-named NaN rows
  as ``0xFF``) and the kernel dequantizes inside; otherwise the kernel reads the cache in the case dtype. Global
  slots ``block * P + offset`` are the cache's flat rows; ``topk_length [B]`` is repeated over each request's
  ``S_q`` queries; the V4 extra cache is the kernel's second index list; the slots are split across programs when
  the rows alone would not fill the GPU (merged by LSE).
* ``v4_attention``: the sliding window ``(p - W, p]`` over ``raw_kv`` is the main index list (the spec's
  :func:`mlaspec.spec.sliding_window.swa_indices_and_lens` over one page holding the request, its lengths as
  ``topk_length``) and the compressed entries the extra one (``topk_indices[i, :min((p + 1) // r, K)]``, the count
  from :func:`mlaspec.spec.sliding_window.num_visible_compressed`, as ``extra_topk_length``), as vLLM's V4 decode
  feeds FlashMLA (``vllm/models/deepseek_v4/attention/impl/flashmla.py``).

"""

from __future__ import annotations

import torch

from mlaspec.conformance.ops import implemented_ops
from mlaspec.impl.sparse import float_keys, quantize_keys, sparse_mla, sparse_mla_decode
from mlaspec.spec.sliding_window import num_visible_compressed, swa_indices_and_lens

__all__ = ["SPARSE_OPS", "TritonSparse"]


def _dims_ok(d_qk: int, d_v: int) -> bool:
    rope = d_qk - d_v
    pow2 = lambda x: x >= 16 and not x & (x - 1)  # noqa: E731
    return pow2(d_v) and (rope == 0 or pow2(rope))


class TritonSparse:
    """Sparse MLA prefill / decode and one DeepSeek V4 layer on :mod:`mlaspec.impl.sparse`."""

    device: torch.device
    sparse_fp8 = True  # read fp8-representable decode caches as FlashMLA's fp8 layout (False: case dtype)

    # -- limits, named -------------------------------------------------------------------------------------------
    def _unsupported_dims(self, case) -> str | None:
        p = case.params
        if not _dims_ok(p["D_qk"], p["D_v"]):
            return (
                f"the sparse kernel needs D_v and D_qk - D_v powers of two >= 16, or D_qk == D_v "
                f"(576 = 512 + 64, 512), got D_qk={p['D_qk']}, D_v={p['D_v']}"
            )
        return None

    def _unsupported_sparse_prefill(self, case) -> str | None:
        return self._unsupported_dims(case)

    def _unsupported_sparse_decode(self, case) -> str | None:
        return self._unsupported_dims(case)

    def _unsupported_v4_attention(self, case) -> str | None:
        return self._unsupported_dims(case)

    # -- ops -----------------------------------------------------------------------------------------------------
    def sparse_prefill(self, q, kv, indices, scale, d_v=512, attn_sink=None, topk_length=None):
        dev = self.device
        q, kv = q.to(dev).contiguous(), kv.to(dev).contiguous()
        res = sparse_mla(
            q,
            float_keys(kv),
            indices.to(dev, torch.int32),
            scale=scale,
            d_v=d_v,
            topk_length=None if topk_length is None else topk_length.to(dev),
            attn_sink=None if attn_sink is None else attn_sink.to(dev),
        )
        return res.out, res.max_logits, res.lse

    def _decode_keys(self, cache: torch.Tensor):
        """The kernel's view of a dequantized paged cache ``[NB, P, (1,) D]``: fp8 when exact, else rows."""
        page = cache.shape[1]
        flat = cache.reshape(-1, cache.shape[-1])
        if self.sparse_fp8:
            keys = quantize_keys(flat, page_size=page)
            if keys is not None:
                return keys._replace(data=keys.data.to(self.device))
        return float_keys(flat.to(self.device).contiguous())

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
        dev = self.device
        d = q.shape[-1]
        scale = d**-0.5 if scale is None else scale
        q = q.to(dev).contiguous()
        keys = self._decode_keys(kv_cache.to(q.dtype))
        extra = None if extra_kv_cache is None else self._decode_keys(extra_kv_cache.to(q.dtype))
        on = lambda t: None if t is None else t.to(dev)  # noqa: E731
        return sparse_mla_decode(
            q,
            keys,
            indices.to(dev, torch.int32),
            scale=scale,
            d_v=d_v,
            topk_length=on(topk_length),
            attn_sink=on(attn_sink),
            extra=extra,
            extra_indices=on(extra_indices),
            extra_topk_length=on(extra_topk_length),
        )

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
        dev = self.device
        s_q, s_kv = q.shape[0], raw_kv.shape[0]
        # the window (p - W, p] of the request's last s_q positions, by the spec's rule: raw_kv is one page, so the
        # slots are its rows ([T, 1, W], -1 padded past each row's length)
        swa = swa_indices_and_lens(
            torch.tensor([0, s_q]),
            torch.tensor([s_kv]),
            torch.zeros(1, 1, dtype=torch.int64),
            window=window,
            block_size=max(s_kv, 1),
        )
        kw = {}
        if compress_ratio > 1 and compressed_kv is not None and topk_indices is not None:
            visible = num_visible_compressed(swa.positions, compress_ratio).clamp(max=topk_indices.shape[1])
            kw = dict(
                extra=float_keys(compressed_kv.to(dev).contiguous()),
                extra_indices=topk_indices.to(dev, torch.int32),
                extra_topk_length=visible.to(dev, torch.int32),
            )
        res = sparse_mla(
            q.to(dev).contiguous(),
            float_keys(raw_kv.to(dev).contiguous()),
            swa.indices.to(dev),
            scale=scale,
            d_v=d_v,
            topk_length=swa.lens.to(dev),
            attn_sink=None if attn_sink is None else attn_sink.to(dev),
            **kw,
        )
        return res.out, res.lse


SPARSE_OPS = implemented_ops(TritonSparse)
"""The ops this mixin has a method for."""
