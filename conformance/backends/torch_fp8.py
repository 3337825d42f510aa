"""The ``torch`` backend's fp8-cache decode: a mixin of :class:`~mlaspec.conformance.backends.torch_eager.TorchBackend`.

Decodes the cache records with PyTorch's own fp8 dtypes -- independently of the spec's bit-level decoder -- into
fp32 entries (``e4m3 * k_scale``; for the 656-byte layout ``e4m3 * s_g`` per 128 values and the bf16 RoPE), then
attends in fp32 with the weights ``p`` rounded to the case dtype, like the dense ``mla_decode``.
"""

from __future__ import annotations

import math

import torch

from mlaspec.spec.attention import causal_mask, seq_lens_mask

__all__ = ["TorchFP8", "decode_records"]


def decode_records(raw: torch.Tensor, layout: str, k_scale: float | None) -> torch.Tensor:
    """``[..., token_bytes]`` uint8 -> ``[..., 576]`` float32 (``fp8_e4m3_per_tensor`` or ``fp8_ds_mla_v32``)."""
    raw = raw.contiguous()
    if layout == "fp8_e4m3_per_tensor":
        return raw.view(torch.float8_e4m3fn).float() * k_scale
    if layout == "fp8_ds_mla_v32":
        nope = raw[..., :512].contiguous().view(torch.float8_e4m3fn).float()
        scales = raw[..., 512:528].contiguous().view(torch.float32)  # 4 per token, one per 128 values
        rope = raw[..., 528:656].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope * scales.repeat_interleave(128, -1), rope], -1)
    raise ValueError(f"layout must be fp8_e4m3_per_tensor or fp8_ds_mla_v32, got {layout!r}")


class TorchFP8:
    def mla_decode_fp8(self, q, kv_cache, *, layout, k_scale, q_scale, d_v, scale, causal=False, seq_lens=None):
        dtype = q.dtype
        dev = getattr(self, "device", q.device)
        kv = decode_records(kv_cache.to(dev), layout, k_scale)  # [B, S_kv, 576] fp32
        s = torch.einsum("bqhd,bkd->bhqk", q.to(dev).float(), kv) * scale
        if seq_lens is not None:  # [B, S_q, S_kv]: request b's first seq_lens[b] keys, causal to its own end
            s = s.masked_fill(
                ~seq_lens_mask(seq_lens, q.shape[1], kv.shape[1], causal=causal)[:, None].to(dev), -math.inf
            )
        elif causal:
            s = s.masked_fill(~causal_mask(q.shape[1], kv.shape[1], device=dev), -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0).to(dtype).float()  # p in the case dtype
        out = torch.einsum("bhqk,bkd->bqhd", p, kv[..., :d_v])
        return out.to(dtype), lse
