"""Backend ``torch_sdpa``: PyTorch's own fused attention entry points, on CPU or CUDA (``MLASPEC_DEVICE``).

``scaled_dot_product_attention`` returns no LSE, so by default (``MLASPEC_SDPA_MODE=flex``) the adapter runs
``torch.nn.attention.flex_attention.flex_attention`` with the LSE requested (``return_aux=AuxRequest(lse=True)``,
or ``return_lse=True`` on torch < 2.9) and a block mask for the causal case. FlexAttention's LSE is the natural
log (the dense cases pass within their LSE budget in ``tests/test_adapters.py``), ``[B, H, S_q]`` as the spec's.
Causal is the spec's bottom-right rule, written as the mask ``kv_idx <= q_idx + S_kv - S_q``.

On CUDA the adapter compiles ``flex_attention`` (the fused Triton kernel; ``MLASPEC_SDPA_COMPILE=0`` turns it
off); on CPU it runs eagerly by default (PyTorch's unfused reference path, with a warning), since compiling needs
a C++ toolchain (``MLASPEC_SDPA_COMPILE=1`` to try).

``MLASPEC_SDPA_MODE=sdpa`` instead runs ``scaled_dot_product_attention`` (``enable_gqa``, a boolean mask for
causal) for the output and computes the LSE beside it in fp32 (``logsumexp`` of the scaled logits): the output
is then SDPA's, the LSE the adapter's own.

Ops: ``attention`` and ``mla_decode`` (``k = v`` prefix: MQA over the 576-wide entries, ``v = kv[..., :512]``).
Skipped: ``S_kv = 0`` (FlexAttention builds no block mask over zero keys).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from .common import DCPByRanks, case_param

__all__ = ["TorchSDPABackend"]


class TorchSDPABackend(DCPByRanks):
    """``attention`` and ``mla_decode`` through FlexAttention (default) or SDPA (see the module docstring)."""

    name = "torch_sdpa"
    ops = frozenset({"attention", "mla_decode", "dcp_decode"})
    dtypes = frozenset({"bfloat16", "float16", "float32"})

    def __init__(self, device: str | None = None, mode: str | None = None):
        self.device = torch.device(device or os.environ.get("MLASPEC_DEVICE", "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("torch_sdpa: MLASPEC_DEVICE names CUDA but torch sees no GPU")
        self.mode = mode or os.environ.get("MLASPEC_SDPA_MODE", "flex")
        if self.mode not in ("flex", "sdpa"):
            raise ValueError(f"MLASPEC_SDPA_MODE must be 'flex' or 'sdpa', got {self.mode!r}")
        self._flex = None
        if self.mode == "flex":
            try:
                from torch.nn.attention import flex_attention as fa
            except ImportError as exc:
                msg = f"torch {torch.__version__} has no FlexAttention (needs torch >= 2.5): {exc}"
                raise ImportError(msg) from exc
            self._fa = fa
            default = "1" if self.device.type == "cuda" else "0"
            fn = fa.flex_attention
            if os.environ.get("MLASPEC_SDPA_COMPILE", default) == "1":
                fn = torch.compile(fn, dynamic=False)
            self._flex = fn
        self.version = f"torch {torch.__version__} ({self.mode}, {self.device})"

    def unsupported(self, case) -> str | None:
        if self.mode == "flex" and case_param(case, "S_kv", default=1) == 0:
            return "FlexAttention needs S_kv > 0 (no block mask over zero keys)"
        if self.mode == "flex" and self.device.type == "cuda":
            dims = [case_param(case, d, default=16) for d in ("D_qk", "D_v")]
            if min(dims) < 16:
                return f"FlexAttention on CUDA needs head dims >= 16 (torch's Triton template), got {dims}"
            if case.op in ("mla_decode", "dcp_decode") and case_param(case, "H_q", default=16) > 64:
                return (
                    "FlexAttention on CUDA runs out of shared memory at D_qk 576 with more than 64 query heads "
                    "per KV head"
                )
        return None

    # -- the two ops ---------------------------------------------------------------------------------------------
    def attention(self, q, k, v, *, scale, causal=False, mask=None):
        if mask is not None:
            raise ValueError("torch_sdpa takes causal or no mask, not an explicit mask")
        return self._attend(q, k, v, scale=scale, causal=causal)

    def mla_decode(self, q, kv, *, d_v, scale, causal=False, seq_lens=None):
        k = kv[:, :, None]
        return self._attend(q, k, k[..., :d_v], scale=scale, causal=causal, seq_lens=seq_lens)

    # -- implementations -----------------------------------------------------------------------------------------
    def _attend(self, q, k, v, *, scale, causal, seq_lens=None):
        """``seq_lens [B]``: request ``b`` reads keys ``j < seq_lens[b]``, ``causal`` aligned to its own end."""
        q, k, v = (t.to(self.device).transpose(1, 2).contiguous() for t in (q, k, v))  # [B, H, S, D]
        lens = None if seq_lens is None else seq_lens.to(self.device, torch.int64)
        run = self._run_flex if self.mode == "flex" else self._run_sdpa
        out, lse = run(q, k, v, scale=scale, causal=causal, lens=lens)
        return out.transpose(1, 2), lse  # [B, S_q, H_q, D_v], [B, H_q, S_q]

    def _run_flex(self, q, k, v, *, scale, causal, lens=None):
        fa = self._fa
        s_q, s_kv = q.shape[2], k.shape[2]
        block_mask = None
        if lens is not None:

            def own_length(b, h, q_idx, kv_idx):
                n = lens[b]
                inside = kv_idx < n
                return inside & (kv_idx <= q_idx + n - s_q) if causal else inside

            block_mask = fa.create_block_mask(own_length, q.shape[0], None, s_q, s_kv, device=self.device)
        elif causal:
            offset = s_kv - s_q

            def bottom_right(b, h, q_idx, kv_idx):
                return kv_idx <= q_idx + offset

            block_mask = fa.create_block_mask(bottom_right, None, None, s_q, s_kv, device=self.device)
        gqa = q.shape[1] != k.shape[1]
        if hasattr(fa, "AuxRequest"):
            out, aux = self._flex(
                q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=fa.AuxRequest(lse=True)
            )
            return out, aux.lse
        return self._flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True)

    def _run_sdpa(self, q, k, v, *, scale, causal, lens=None):
        s_q, s_kv = q.shape[2], k.shape[2]
        allowed = None
        rows, cols = torch.arange(s_q, device=self.device), torch.arange(s_kv, device=self.device)
        if lens is not None:  # [B, 1, S_q, S_kv]
            n = lens[:, None, None, None]
            allowed = (cols < n).expand(-1, -1, s_q, -1)
            if causal:
                allowed = allowed & (cols[None, :] <= rows[:, None] + n - s_q)
        elif causal:
            allowed = cols[None, :] <= rows[:, None] + (s_kv - s_q)
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
        if allowed is not None:  # SDPA leaves a row with no key NaN; the spec's is 0
            out = out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
        g = q.shape[1] // k.shape[1]
        s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float().repeat_interleave(g, 1)) * scale
        if allowed is not None:
            s = s.masked_fill(~allowed, -math.inf)
        lse = torch.logsumexp(s, -1) if s_kv else s.new_full(s.shape[:-1], -math.inf)
        return out, lse
