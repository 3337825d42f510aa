"""Backend ``deepgemm``: DeepGEMM's lightning-indexer logits, as vLLM 0.33 calls them.

Imports ``deep_gemm`` (upstream, or DeepGEMM 2.8.1 as the vLLM 0.33.0 wheel ships it: ``pip install
vllm==0.33.0``), else ``vllm.third_party.deep_gemm``. DeepGEMM JIT-compiles its kernels on first use and needs
``nvcc`` (``CUDA_HOME``). Ops:

* ``indexer_logits`` -> ``fp8_fp4_mqa_logits((q_fp8, None), (k_fp8, k_scale), weights, ks, ke, max_seqlen_k)``
  (DeepGEMM >= 2.8; ``vllm/utils/deep_gemm.py``), or the older ``fp8_mqa_logits(q, (k, k_scale), weights, ks, ke,
  clean_logits=True)``. The 2.8 kernel returns *compressed* rows -- column ``j`` of row ``m`` is key
  ``ks[m] + j``, width ``max(ke - ks)``, tail uncleaned -- which the adapter expands to the spec's absolute
  columns with :func:`mlaspec.spec.indexer.compressed_to_absolute` (``-inf`` outside each span); the older kernel
  returns absolute columns already (vLLM's torch fallback ``fp8_mqa_logits_torch`` does too).
* ``paged_indexer_logits`` -> ``get_paged_mqa_logits_metadata`` + ``fp8_fp4_paged_mqa_logits`` over the paged fp8
  cache ``uint8 [NB, P, 1, D + 4]`` (the spec's :class:`~mlaspec.spec.indexer.IndexerCacheLayout` bytes,
  passed through unchanged). vLLM 0.33 always passes 2-D ``context_lens [B, next_n]``; a 1-D one is expanded
  with the spec's rule ``len[b, j] = context_lens[b] - next_n + j + 1``. Columns past each row's length are
  not cleaned by the kernel; the adapter writes ``-inf`` there, as the spec does.

Inputs must already be fp8 (``q`` e4m3 with its scale folded into ``weights``, ``k`` e4m3 with an fp32 per-token
``k_scale``): the kernel has no bf16 path, and quantizing here would add an error the spec does not model.
Skipped: ``next_n`` other than 1, 2, 4 on SM90 (``native_next_n_supported``), page sizes other than 32/64
(``get_paged_mqa_page_sizes``), SM100 (its MQA kernels take MX-scaled inputs, not these).
"""

from __future__ import annotations

import inspect
import math
from types import MappingProxyType

import torch

from mlaspec.spec.indexer import compressed_to_absolute, decode_context_lens_native

from .common import case_param, cuda_capability, import_first, require_cuda

__all__ = ["DeepGEMMBackend", "absolute_from_kernel", "expand_context_lens", "mask_paged_tail"]

FP8 = (torch.float8_e4m3fn,)


def absolute_from_kernel(
    logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, num_keys: int, compressed: bool
) -> torch.Tensor:
    """The kernel's ``[M, W]`` logits as the spec's absolute ``[M, N]`` float32, ``-inf`` outside ``[ks, ke)``."""
    ks, ke = ks.to("cpu", torch.int64), ke.to("cpu", torch.int64)
    if compressed:
        return compressed_to_absolute(logits.to("cpu", torch.float64), ks, ke, num_keys).float()
    cols = torch.arange(num_keys)[None, :]
    inside = (cols >= ks[:, None]) & (cols < ke[:, None])
    return logits.to("cpu", torch.float32)[:, :num_keys].masked_fill(~inside, -math.inf)


def expand_context_lens(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """``[B]`` -> ``[B, next_n]`` by the spec's rule ``len[b, j] = context_lens[b] - next_n + j + 1`` (clamped at 0,
    :func:`~mlaspec.spec.indexer.decode_context_lens_native`); a 2-D tensor passes through. int32."""
    if context_lens.dim() == 2:
        return context_lens.to(torch.int32)
    return decode_context_lens_native(context_lens.cpu(), next_n).to(context_lens.device, torch.int32)


def mask_paged_tail(logits: torch.Tensor, lens: torch.Tensor, width: int) -> torch.Tensor:
    """Row ``r``'s columns ``>= lens.flatten()[r]`` set to ``-inf`` (DeepGEMM leaves them uninitialised), float32,
    cut to ``width`` columns."""
    lens = lens.reshape(-1).to("cpu", torch.int64)
    out = logits.to("cpu", torch.float32)[:, :width]
    cols = torch.arange(width)[None, :]
    return out.masked_fill(cols >= lens[:, None], -math.inf)


class DeepGEMMBackend:
    """DeepGEMM's ``fp8(_fp4)_mqa_logits`` and ``fp8(_fp4)_paged_mqa_logits`` (see the module docstring)."""

    name = "deepgemm"
    ops = frozenset({"indexer_logits", "paged_indexer_logits"})
    dtypes = frozenset({"bfloat16", "float16", "float32"})  # the case dtype names the float inputs; q/k are fp8
    # QGMMA on e4m3 keeps ~14 bits of its accumulator (mlaspec.conformance.numerics; seen on the H200: every row of
    # fp8_mqa_logits leans by -4e-5 relative, docs/backends.md)
    numerics = MappingProxyType({op: ("fp8_mma_accumulation",) for op in ("indexer_logits", "paged_indexer_logits")})

    def __init__(self, device: str | None = None):
        self.dg = import_first("deep_gemm", "vllm.third_party.deep_gemm", what="deep_gemm")
        self.device = torch.device(device) if device else require_cuda("deepgemm")
        self.capability = cuda_capability(self.device)
        if self.capability[0] != 9:
            raise RuntimeError(
                f"deepgemm adapter covers SM90 (fp8 q, fp32 k_scale); SM{self.capability} takes MX-scaled inputs"
            )
        self.ragged = getattr(self.dg, "fp8_fp4_mqa_logits", None) or getattr(self.dg, "fp8_mqa_logits", None)
        self.paged = getattr(self.dg, "fp8_fp4_paged_mqa_logits", None) or getattr(
            self.dg, "fp8_paged_mqa_logits", None
        )
        if self.ragged is None or self.paged is None:
            raise ImportError("deep_gemm has neither fp8_fp4_mqa_logits nor fp8_mqa_logits")
        self.compressed = "clean_logits" not in _params(self.ragged)
        self.version = f"deep_gemm {getattr(self.dg, '__version__', '?')} ({self.ragged.__name__})"

    def unsupported(self, case) -> str | None:
        if case.op == "paged_indexer_logits":
            next_n = case_param(case, "next_n", default=1)
            if next_n not in (1, 2, 4):
                return f"DeepGEMM's SM90 paged MQA logits take next_n 1, 2 or 4 (native_next_n_supported), got {next_n}"
            p = case_param(case, "P", default=64)
            if p not in (32, 64):
                return f"DeepGEMM's paged MQA logits take page sizes 32 or 64 (get_paged_mqa_page_sizes), got {p}"
        return None

    def _fp8(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in FP8:
            raise TypeError(f"DeepGEMM needs {name} in float8_e4m3fn (quantize_indexer_q/k first), got {x.dtype}")
        return x.to(self.device).contiguous()

    def indexer_logits(self, q, k, weights, ks, ke, k_scale=None):
        dev = self.device
        n = k.shape[0]
        qd, kd = self._fp8("q", q), self._fp8("k", k)
        scale = torch.ones(n, dtype=torch.float32) if k_scale is None else k_scale
        kv = (kd, scale.to(dev, torch.float32).contiguous())
        w = weights.to(dev, torch.float32).contiguous()
        ks32, ke32 = ks.to(dev, torch.int32).contiguous(), ke.to(dev, torch.int32).contiguous()
        if self.compressed:
            width = int((ke.long() - ks.long()).max()) if ks.numel() else 0
            logits = self.ragged((qd, None), kv, w, ks32, ke32, max(width, 1))
        else:
            logits = self.ragged(qd, kv, w, ks32, ke32, clean_logits=True)
        return absolute_from_kernel(logits, ks, ke, n, self.compressed)

    def paged_indexer_logits(self, q, cache, block_table, context_lens, weights, *, max_context_len=None):
        dev = self.device
        b, next_n = q.shape[:2]
        lens = expand_context_lens(context_lens, next_n)
        width = int(lens.max()) if max_context_len is None and lens.numel() else (max_context_len or 0)
        qd = self._fp8("q", q)
        kv = cache.to(dev).unsqueeze(-2)  # [NB, P, 1, D + 4], DeepGEMM's view (vLLM: kv_cache.unsqueeze(-2))
        lens_d = lens.to(dev).contiguous()
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
        slots = num_sms // 2 if next_n == 4 else num_sms  # SM90 next_n=4 runs one task per 2-CTA cluster
        meta = self.dg.get_paged_mqa_logits_metadata(lens_d, cache.shape[1], slots)
        bt = block_table.to(dev, torch.int32).contiguous()
        w = weights.to(dev, torch.float32).contiguous()
        if self.paged.__name__.startswith("fp8_fp4"):  # DeepGEMM >= 2.8: q = (values, scales or None)
            logits = self.paged((qd, None), kv, w, lens_d, bt, meta, max(width, 1))
        else:
            logits = self.paged(qd, kv, w, lens_d, bt, meta, max(width, 1), False)
        return mask_paged_tail(logits, lens, width)


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()
