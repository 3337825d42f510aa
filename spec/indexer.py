"""DeepSeek V3.2's lightning indexer: the scores that pick which keys sparse MLA reads.

For every query token ``m`` the indexer scores every key ``n`` it may see with a small multi-head ReLU
attention (``H = 64`` index heads of width ``D = 128``, one shared key per token) and keeps the ``K = 2048``
best (:mod:`mlaspec.spec.topk`). Math, as DeepGEMM's ``fp8_mqa_logits`` computes it::

    logits[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h] . k[n])    for ks[m] <= n < ke[m]
    logits[m, n] = -inf                                                      otherwise

The model folds three factors into ``weights`` before the kernel sees them (vLLM
``vllm/model_executor/models/deepseek_v2.py``, ``Indexer.forward``)::

    weights[m, h] = weights_proj(x)[m, h] * q_scale[m, h] * softmax_scale * H ** -0.5,   softmax_scale = D ** -0.5

``q_scale`` is the per-(token, head) fp8 scale of ``q`` and ``k_scale`` the per-token fp8 scale of ``k``;
both are positive, so pulling them out of the ReLU changes nothing.

Where the pieces come from, in model order:

1. ``q = wq_b(q_lora)`` viewed ``[T, H, D]``; ``k = LayerNorm(wk(x))`` ``[T, D]``.
2. RoPE on the *first* ``D_rope = 64`` dims of each (``q_pe, q_nope = split(q, [64, 64])``; NeoX style in vLLM's
   ``rotary_emb`` by default; the fused Triton kernel rounds the rotated half to bf16).
3. **Hadamard rotation (DeepSeek's reference only).** ``DeepSeek-V3.2-Exp/inference/model.py`` applies
   ``rotate_activation(x) = hadamard_transform(x, scale=D ** -0.5)`` to ``q`` and ``k`` after RoPE and *before*
   fp8 quantization. The rotation is orthogonal, so in exact arithmetic the logits do not change; it only
   spreads outliers so fp8 loses less. vLLM 0.33's ``Indexer.forward`` (read at the commit cited above) does
   not apply it; :func:`hadamard_rotate` lets a caller reproduce either.
4. fp8 e4m3 quantization: ``q`` per (token, head) with the scale folded into ``weights``
   (:func:`quantize_indexer_q`); ``k`` per token, written to the paged indexer cache with its fp32 scale
   (:func:`quantize_indexer_k`, :func:`write_indexer_k_cache`).
5. Logits: ragged prefill (:func:`indexer_logits`) or paged decode (:func:`paged_indexer_logits`), then top-k.

Column conventions drift between versions, so both are here with a converter:

* **absolute** columns: column ``n`` is key ``n`` of the K buffer (DeepGEMM with ``max_seqlen_k = 0``; vLLM's
  torch fallback ``fp8_mqa_logits_torch``). This module returns absolute columns.
* **compressed** columns: column ``j`` of row ``m`` is key ``ks[m] + j`` (DeepGEMM ``fp8_fp4_mqa_logits`` with
  ``max_seqlen_k > 0``; width ``max(ke - ks)``). See :func:`absolute_to_compressed`, :func:`compressed_to_absolute`.

DeepGEMM leaves columns it does not compute uninitialised unless ``clean_logits=True`` (which is refused for the
compressed form and for 2-D ``context_lens``); the spec writes ``-inf`` there, which is what a top-k must treat
them as. Sources: DeepGEMM ``csrc/apis/attention.hpp``, ``deep_gemm/include/deep_gemm/impls/sm90_fp8_mqa_logits.cuh``,
``tests/test_attention.py``; vLLM ``vllm/model_executor/layers/sparse_attn_indexer.py``,
``vllm/v1/attention/backends/mla/indexer.py``, ``csrc/cache_kernels.cu``.

Logits are computed in float64 and returned float64. Quantization emulates the kernels bit for bit (fp32 scale
arithmetic, round-to-nearest-even e4m3 with saturation) and returns fp8 / fp32 tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .checks import FLOAT, FP8, INT, Dims, choice, cu_seqlens, in_range, positive_int, positive_scale

__all__ = [
    "FP8_E4M3_MAX",
    "INDEXER_HEAD_DIM",
    "INDEXER_NUM_HEADS",
    "INDEXER_ROPE_DIM",
    "INDEXER_TOPK",
    "FlattenedDecode",
    "GatheredIndexerK",
    "IndexerCacheLayout",
    "IndexerPrefillChunk",
    "KVSpans",
    "PrefillChunkMetadata",
    "QuantizedIndexerK",
    "QuantizedIndexerQ",
    "absolute_to_compressed",
    "compressed_to_absolute",
    "decode_context_lens_flattened",
    "decode_context_lens_native",
    "fold_indexer_weights",
    "fp8_e4m3_error_bound",
    "gather_indexer_k_cache",
    "hadamard_rotate",
    "indexer_logits",
    "kv_spans_from_batches",
    "paged_indexer_logits",
    "prefill_chunk_metadata",
    "quantize_indexer_k",
    "quantize_indexer_q",
    "read_indexer_k_cache",
    "split_indexer_prefill_chunks",
    "write_indexer_k_cache",
]

INDEXER_NUM_HEADS = 64  # config.index_n_heads
INDEXER_HEAD_DIM = 128  # config.index_head_dim
INDEXER_ROPE_DIM = 64  # config.qk_rope_head_dim; the rope part comes FIRST in the 128-wide head
INDEXER_TOPK = 2048  # config.index_topk
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn

_SCALE_FMTS = ("ue8m0", None)


# ---------------------------------------------------------------------------------------------------------------
# Logits
# ---------------------------------------------------------------------------------------------------------------


def _int_vector(name: str, x: object, dims: Dims, dim: str) -> torch.Tensor:
    x = dims.tensor(name, x, (dim,), INT)
    return x.to(torch.int64)


def indexer_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Lightning-indexer logits over a ragged K buffer (DeepGEMM ``fp8_mqa_logits``), absolute columns.

    Math::

        logits[m, n] = k_scale[n] * sum_h weights[m, h] * max(q[m, h] . k[n], 0)    ks[m] <= n < ke[m]
        logits[m, n] = -inf                                                        elsewhere

    DeepGEMM's SM90 kernel applies ``k_scale`` *after* the ReLU and the head sum (``v = sum * scale_kv``);
    vLLM's torch fallback multiplies the score by it *before* the ReLU. They agree for ``k_scale > 0``, which
    the quantizers guarantee; the spec follows the kernel.

    Args:
        q: ``[M, H, D]`` float or fp8 (fp8 values are read as their exact real values; the q scale lives in
            ``weights``, see :func:`quantize_indexer_q`).
        k: ``[N, D]`` float or fp8, the keys of every sequence in the chunk, concatenated.
        weights: ``[M, H]`` float, the per-head weights with ``q_scale * D**-0.5 * H**-0.5`` already folded in
            (:func:`fold_indexer_weights`).
        ks: ``[M]`` int, first key of query ``m``'s span (``cu_seqlen_ks``), ``0 <= ks[m]``.
        ke: ``[M]`` int, one past the last key (``cu_seqlen_ke``), ``ks[m] <= ke[m] <= N``; an empty span gives
            a row of ``-inf``.
        k_scale: optional ``[N]`` float, the per-key dequantization scale; default 1.

    Returns:
        ``logits [M, N]`` float64, ``-inf`` outside each row's span.

    Source: DeepGEMM ``deep_gemm/include/deep_gemm/impls/sm90_fp8_mqa_logits.cuh``, ``tests/test_attention.py``
    (``ref_fp8_mqa_logits``); vLLM ``vllm/v1/attention/ops`` torch fallback ``fp8_mqa_logits_torch``.
    """
    dims = Dims()
    dims.tensor("q", q, ("M", "H", "D"), FLOAT + FP8)
    dims.tensor("k", k, ("N", "D"), FLOAT + FP8)
    dims.tensor("weights", weights, ("M", "H"), FLOAT)
    ks64 = _int_vector("ks", ks, dims, "M")
    ke64 = _int_vector("ke", ke, dims, "M")
    n = dims["N"]
    if k_scale is not None:
        dims.tensor("k_scale", k_scale, ("N",), FLOAT)
    if bool((ks64 < 0).any()):
        raise ValueError(f"ks must be >= 0, got {ks64.tolist()}")
    if bool((ke64 < ks64).any()):
        raise ValueError(f"ke must be >= ks elementwise, got ks={ks64.tolist()}, ke={ke64.tolist()}")
    if bool((ke64 > n).any()):
        raise ValueError(f"ke must be <= N={n} (from k), got {ke64.tolist()}")

    q64, k64, w64 = (t.to(torch.float64) for t in (q, k, weights))
    score = torch.einsum("mhd,nd->mhn", q64, k64)  # [M, H, N]; read M*H*D + N*D
    logits = torch.einsum("mhn,mh->mn", score.clamp_min(0.0), w64)  # ReLU, then weighted head sum
    if k_scale is not None:
        logits = logits * k_scale.to(torch.float64)[None, :]  # the kernel's scale_kv, outside the sum
    cols = torch.arange(n, device=logits.device)[None, :]
    inside = (cols >= ks64[:, None]) & (cols < ke64[:, None])
    return logits.masked_fill(~inside, -math.inf)


def fold_indexer_weights(
    weights: torch.Tensor,
    q_scale: torch.Tensor | None = None,
    *,
    head_dim: int = INDEXER_HEAD_DIM,
) -> torch.Tensor:
    """Fold the softmax scale, the head-count factor and the q fp8 scale into the indexer weights.

    Math (vLLM ``Indexer.forward``; the fused Triton kernel ``_fused_indexer_q_rope_quant_kernel`` does the same
    as ``weight * q_scale * softmax_scale * head_scale``)::

        out[t, h] = weights[t, h] * q_scale[t, h] * head_dim ** -0.5 * H ** -0.5

    Args:
        weights: ``[T, H]`` float, the raw ``weights_proj(x)`` output.
        q_scale: optional ``[T, H]`` float, the q dequantization scale (1 when q is not quantized).
        head_dim: the indexer head width ``D`` (128), whose ``-0.5`` power is the softmax scale.

    Returns:
        ``[T, H]`` float64.

    Source: vLLM ``vllm/model_executor/models/deepseek_v2.py`` (``Indexer``: ``softmax_scale = head_dim**-0.5``,
    ``n_head_scale = n_head**-0.5``), ``vllm/model_executor/layers/sparse_attn_indexer.py``.
    """
    dims = Dims()
    dims.tensor("weights", weights, ("T", "H"), FLOAT)
    positive_int("head_dim", head_dim)
    out = weights.to(torch.float64) * (head_dim**-0.5) * (dims["H"] ** -0.5)
    if q_scale is not None:
        out = out * dims.tensor("q_scale", q_scale, ("T", "H"), FLOAT).to(torch.float64)
    return out


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """The Sylvester-Hadamard rotation DeepSeek's reference applies to indexer q and k before fp8 quantization.

    Math: ``out = x @ H_D / sqrt(D)`` with ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]`` (what
    ``fast_hadamard_transform.hadamard_transform(x, scale=D**-0.5)`` computes). ``H_D / sqrt(D)`` is symmetric
    and orthogonal, so ``rot(q) . rot(k) = q . k`` and applying it twice is the identity.

    Where: ``DeepSeek-V3.2-Exp/inference/model.py`` ``rotate_activation``, called on ``q`` and ``k`` after RoPE
    and before ``act_quant``. vLLM 0.33's ``Indexer.forward`` omits it (same logits in exact arithmetic,
    different fp8 rounding).

    Args:
        x: ``[..., D]`` float, ``D`` a power of two.

    Returns:
        ``[..., D]`` float64.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT:
        raise TypeError(f"x must have a float dtype, got {str(x.dtype).removeprefix('torch.')}")
    if x.dim() < 1 or x.shape[-1] < 1 or x.shape[-1] & (x.shape[-1] - 1):
        raise ValueError(f"x must have a last dimension D that is a power of two, got shape {list(x.shape)}")
    d = x.shape[-1]
    y = x.to(torch.float64).reshape(-1, d)
    h = 1
    while h < d:  # butterfly: pairs (a, b) at stride h become (a + b, a - b)
        y = y.reshape(-1, d // (2 * h), 2, h)
        y = torch.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], dim=2)
        h *= 2
    return (y.reshape(x.shape) * d**-0.5).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# fp8 e4m3 quantization
# ---------------------------------------------------------------------------------------------------------------


class QuantizedIndexerQ(NamedTuple):
    """``q_fp8 [T, H, D]`` float8_e4m3fn, ``q_scale [T, H]`` float32 and ``weights [T, H]`` float64 (folded)."""

    q_fp8: torch.Tensor
    q_scale: torch.Tensor
    weights: torch.Tensor


class QuantizedIndexerK(NamedTuple):
    """``k_fp8 [T, D]`` float8_e4m3fn and ``k_scale [T]`` float32 (dequantized key = ``k_fp8 * k_scale``)."""

    k_fp8: torch.Tensor
    k_scale: torch.Tensor


def _fp8_scale(amax: torch.Tensor, eps: float, scale_fmt: str | None) -> torch.Tensor:
    """fp32 ``max(amax, eps) / 448``, rounded up to a power of two for ue8m0 (the kernels' arithmetic)."""
    scale = torch.clamp(amax.to(torch.float32), min=eps) / torch.tensor(FP8_E4M3_MAX, dtype=torch.float32)
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def _to_e4m3(x32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` in fp32, then round-to-nearest-even to e4m3 (``__NV_SATFINITE``)."""
    return torch.clamp(x32 / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _quantize_vectors(name: str, x: torch.Tensor, scale_fmt: object, eps: object) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per vector along the last dim: ``s = _fp8_scale(amax |x|)``, then ``(e4m3(x / s), s)``."""
    if scale_fmt is not None:
        choice("scale_fmt", scale_fmt, ("ue8m0",))
    positive_scale("eps", eps)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be finite")
    x32 = x.to(torch.float32)
    scale = _fp8_scale(x32.abs().amax(dim=-1), eps, scale_fmt)
    return _to_e4m3(x32, scale[..., None]), scale


def quantize_indexer_q(
    q: torch.Tensor,
    weights: torch.Tensor,
    *,
    scale_fmt: str | None = "ue8m0",
    eps: float = 1e-10,
) -> QuantizedIndexerQ:
    """Quantize indexer queries to fp8 e4m3 per (token, head) and fold the scale into the weights.

    Math, per token ``t`` and head ``h`` (one quantization group = the whole ``D = 128`` head)::

        s[t, h]      = max(amax_d |q[t, h, d]|, eps) / 448            (fp32)
        s[t, h]      = 2 ** ceil(log2(s[t, h]))                       if scale_fmt == "ue8m0"
        q_fp8[t,h,d] = e4m3(clamp(q[t, h, d] / s[t, h], -448, 448))   round to nearest even
        weights'     = weights * s * D ** -0.5 * H ** -0.5            (:func:`fold_indexer_weights`)

    The kernel then sees ``q_fp8`` without a scale; ``sum_h weights'[t,h] * relu(q_fp8 . k)`` equals
    ``sum_h weights[t,h] * D**-0.5 * H**-0.5 * relu(deq(q) . k)`` because ``s > 0``.

    Error bound (e4m3 has 3 mantissa bits): ``|q - q_fp8 * s| <= max(2**-4 * |q|, 2**-10 * s)``
    (:func:`fp8_e4m3_error_bound`); with ue8m0 the scale is at most twice the amax-exact one, so small entries
    may fall one binade lower into the subnormal range.

    Rotation: DeepSeek's reference rotates ``q`` with :func:`hadamard_rotate` before this step; vLLM 0.33 does not.
    Apply it to ``q`` first to reproduce the reference.

    Args:
        q: ``[T, H, D]`` float, after RoPE (bf16 in vLLM; fp32 arithmetic below is exact for bf16 input).
        weights: ``[T, H]`` float, raw ``weights_proj`` output.
        scale_fmt: ``"ue8m0"`` (power-of-two scales, vLLM's only setting for V3.2) or ``None`` (plain fp32).
        eps: lower clamp on ``amax`` (``1e-10`` in ``_fused_indexer_q_rope_quant_kernel``).

    Returns:
        ``q_fp8 [T, H, D]`` float8_e4m3fn, ``q_scale [T, H]`` float32, folded ``weights [T, H]`` float64.

    Source: vLLM ``vllm/model_executor/layers/sparse_attn_indexer.py`` (``_fused_indexer_q_rope_quant_kernel``),
    ``vllm/model_executor/models/deepseek_v2.py`` (``per_token_group_quant_fp8(q, 128, use_ue8m0=True)``).
    """
    dims = Dims()
    dims.tensor("q", q, ("T", "H", "D"), FLOAT)
    dims.tensor("weights", weights, ("T", "H"), FLOAT)
    q_fp8, scale = _quantize_vectors("q", q, scale_fmt, eps)  # scale [T, H]
    folded = fold_indexer_weights(weights, scale, head_dim=dims["D"])
    return QuantizedIndexerQ(q_fp8, scale, folded)


def quantize_indexer_k(
    k: torch.Tensor,
    *,
    scale_fmt: str | None = "ue8m0",
    eps: float = 1e-4,
) -> QuantizedIndexerK:
    """Quantize indexer keys to fp8 e4m3 with one fp32 scale per token, as the cache writer does.

    Math, per token ``t`` (``quant_block_size = D = 128``, one group per token)::

        s[t]      = max(amax_d |k[t, d]|, 1e-4) / 448       (fp32; ue8m0: 2 ** ceil(log2(s)))
        k_fp8[t]  = e4m3(clamp(k[t] / s[t], -448, 448))

    Error bound: ``|k - k_fp8 * s| <= max(2**-4 * |k|, 2**-10 * s)`` elementwise (:func:`fp8_e4m3_error_bound`).
    Rotation: DeepSeek's reference applies :func:`hadamard_rotate` to ``k`` before this; vLLM 0.33 does not.

    Args:
        k: ``[T, D]`` float, after LayerNorm and RoPE.
        scale_fmt: ``"ue8m0"`` (vLLM's V3.2 setting) or ``None``.
        eps: lower clamp on ``amax`` (``1e-4`` in ``indexer_k_quant_and_cache_kernel``; ROCm gfx942 divides by
            224 instead of 448, not modelled).

    Returns:
        ``k_fp8 [T, D]`` float8_e4m3fn and ``k_scale [T]`` float32.

    Source: vLLM ``csrc/cache_kernels.cu`` (``indexer_k_quant_and_cache_kernel``); DeepGEMM
    ``tests/test_attention.py`` (``kv_cache_cast_to_fp8``: same rule without ue8m0).
    """
    dims = Dims()
    dims.tensor("k", k, ("T", "D"), FLOAT)
    return QuantizedIndexerK(*_quantize_vectors("k", k, scale_fmt, eps))  # scale [T]


def fp8_e4m3_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on ``|x - e4m3(x / scale) * scale|`` for a scale with ``|x| / scale <= 448``.

    Math: e4m3 normals (``>= 2**-6``) carry 3 mantissa bits, so round-to-nearest errs by at most half an ulp,
    ``2**-4`` relative; below ``2**-6`` the spacing is the subnormal step ``2**-9``, so the error is at most
    ``2**-10`` absolute (in units of ``scale``)::

        bound = max(2**-4 * |x|, 2**-10 * scale)

    Args:
        x: ``[...]`` float, the values before quantization.
        scale: float broadcastable to ``x``, the quantization scale.

    Returns:
        ``[...]`` float64.
    """
    for name, t in (("x", x), ("scale", scale)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            what = str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a floating-point tensor, got {what}")
    try:
        shape = torch.broadcast_shapes(x.shape, scale.shape)
    except RuntimeError as e:
        raise ValueError(f"scale {list(scale.shape)} must broadcast to x {list(x.shape)}") from e
    if shape != x.shape:
        raise ValueError(f"scale {list(scale.shape)} must broadcast to x's shape {list(x.shape)}, not widen it")
    x64, s64 = x.to(torch.float64), scale.to(torch.float64)
    return torch.maximum(x64.abs() * 2.0**-4, s64 * 2.0**-10)


# ---------------------------------------------------------------------------------------------------------------
# Paged indexer K cache
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexerCacheLayout:
    """Byte layout of one block (page) of the fp8 indexer K cache, as DeepGEMM reads it.

    A block of ``P`` tokens is ``P * (D + 4)`` bytes: first all ``P * D`` fp8 values, token-major, then ``P``
    little-endian fp32 scales, one per token. It is *not* ``P`` rows of ``D + 4`` bytes, although vLLM allocates
    it as ``uint8 [NB, P, D + 4]`` and DeepGEMM views it as ``[NB, P, 1, D + 4]``.

    Source: vLLM ``csrc/cache_kernels.cu`` (``indexer_k_quant_and_cache_kernel`` /
    ``cp_gather_indexer_k_quant_cache_kernel``); DeepGEMM ``csrc/apis/attention.hpp``
    (``fp8_fp4_paged_mqa_logits``: values at ``block * stride``, scales at ``+ block_kv * head_dim``).
    """

    block_size: int
    head_dim: int = INDEXER_HEAD_DIM

    def __post_init__(self) -> None:
        positive_int("block_size", self.block_size)
        positive_int("head_dim", self.head_dim)

    @property
    def token_bytes(self) -> int:
        """``D + 4``: the last dimension of the vLLM allocation."""
        return self.head_dim + 4

    @property
    def block_bytes(self) -> int:
        """``P * (D + 4)``."""
        return self.block_size * self.token_bytes

    @property
    def scale_offset(self) -> int:
        """Byte offset of the first scale inside a block: ``P * D``."""
        return self.block_size * self.head_dim

    def value_offset(self, token: int) -> int:
        """Byte offset of token ``token``'s first fp8 value inside its block: ``token * D``."""
        return token * self.head_dim

    def scale_byte_offset(self, token: int) -> int:
        """Byte offset of token ``token``'s fp32 scale inside its block: ``P * D + 4 * token``."""
        return self.scale_offset + 4 * token

    def empty(self, num_blocks: int, *, fill: int = 0xFF) -> torch.Tensor:
        """A cache ``uint8 [NB, P, D + 4]`` (``NB = num_blocks``) filled with ``fill`` (0xFF reads as fp8 NaN:
        hostile)."""
        positive_int("num_blocks", num_blocks)
        return torch.full((num_blocks, self.block_size, self.token_bytes), fill, dtype=torch.uint8)


def _cache_layout(name: str, cache: object, head_dim: int | None = None) -> IndexerCacheLayout:
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype != torch.uint8:
        raise TypeError(f"{name} must have dtype uint8, got {str(cache.dtype).removeprefix('torch.')}")
    if cache.dim() != 3 or cache.shape[2] <= 4:
        raise ValueError(f"{name} must have shape [NB, P, D + 4], got {list(cache.shape)}")
    layout = IndexerCacheLayout(cache.shape[1], cache.shape[2] - 4)
    if head_dim is not None and layout.head_dim != head_dim:
        raise ValueError(f"{name} must have last dimension D + 4 = {head_dim + 4}, got {cache.shape[2]}")
    return layout


def _slot_bytes(layout: IndexerCacheLayout, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat byte indices ``[T, D]`` of the values and ``[T, 4]`` of the scale of each slot."""
    block, off = slots // layout.block_size, slots % layout.block_size
    base = block * layout.block_bytes
    vals = (base + off * layout.head_dim)[:, None] + torch.arange(layout.head_dim)[None, :]
    scale = (base + layout.scale_offset + 4 * off)[:, None] + torch.arange(4)[None, :]
    return vals, scale


def write_indexer_k_cache(
    cache: torch.Tensor,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale_fmt: str | None = "ue8m0",
) -> torch.Tensor:
    """Quantize ``k`` and store it at ``slot_mapping`` in a copy of the paged indexer cache.

    Math: ``(k_fp8, k_scale) = quantize_indexer_k(k)``; for each token ``t`` with ``slot = slot_mapping[t] >= 0``,
    block ``slot // P`` gets ``k_fp8[t]`` at bytes ``(slot % P) * D`` and ``k_scale[t]`` (fp32, little-endian) at
    ``P * D + 4 * (slot % P)``. ``slot = -1`` (a padded token) writes nothing.

    Args:
        cache: ``[NB, P, D + 4]`` uint8 (:class:`IndexerCacheLayout`); not modified.
        k: ``[T, D]`` float, keys after RoPE (and the Hadamard rotation, for DeepSeek's reference).
        slot_mapping: ``[T]`` int, ``block * P + offset``, or ``-1``; valid slots must be distinct and in range.
        scale_fmt: see :func:`quantize_indexer_k`.

    Returns:
        The new cache, ``[NB, P, D + 4]`` uint8.

    Source: vLLM ``csrc/cache_kernels.cu`` ``indexer_k_quant_and_cache_kernel``.
    """
    layout = _cache_layout("cache", cache)
    dims = Dims(D=layout.head_dim)
    dims.tensor("k", k, ("T", "D"), FLOAT)
    slots = _int_vector("slot_mapping", slot_mapping, dims, "T")
    total = cache.shape[0] * layout.block_size
    valid = slots >= 0
    if bool((slots < -1).any()) or bool((slots >= total).any()):
        raise ValueError(f"slot_mapping must be -1 or in [0, {total}), got {slots.tolist()}")
    if int(valid.sum()) != torch.unique(slots[valid]).numel():
        raise ValueError(f"slot_mapping must not repeat a slot, got {slots.tolist()}")
    k_fp8, k_scale = quantize_indexer_k(k, scale_fmt=scale_fmt)
    out = cache.clone().reshape(-1)
    vals, scale = _slot_bytes(layout, slots[valid])
    out[vals] = k_fp8[valid].view(torch.uint8)
    out[scale] = k_scale[valid].contiguous().view(torch.uint8).reshape(-1, 4)
    return out.reshape(cache.shape)


def read_indexer_k_cache(cache: torch.Tensor, slots: torch.Tensor) -> QuantizedIndexerK:
    """Read the fp8 keys and fp32 scales stored at ``slots`` (inverse of :func:`write_indexer_k_cache`).

    Args:
        cache: ``[NB, P, D + 4]`` uint8.
        slots: ``[T]`` int, each in ``[0, NB * P)``.

    Returns:
        ``k_fp8 [T, D]`` float8_e4m3fn and ``k_scale [T]`` float32.
    """
    layout = _cache_layout("cache", cache)
    slots64 = _int_vector("slots", slots, Dims(), "T")
    total = cache.shape[0] * layout.block_size
    if bool((slots64 < 0).any()) or bool((slots64 >= total).any()):
        raise ValueError(f"slots must be in [0, {total}), got {slots64.tolist()}")
    flat = cache.reshape(-1)
    vals, scale = _slot_bytes(layout, slots64)
    k_fp8 = flat[vals].view(torch.float8_e4m3fn)
    k_scale = flat[scale].contiguous().view(torch.float32).reshape(-1)
    return QuantizedIndexerK(k_fp8, k_scale)


class GatheredIndexerK(NamedTuple):
    """``k_fp8 [T, D]``, ``k_scale [T]`` float32 and ``cu_seq_lens [B + 1]`` int64 of the gathered ragged keys."""

    k_fp8: torch.Tensor
    k_scale: torch.Tensor
    cu_seq_lens: torch.Tensor


def _request_slots(block_table: torch.Tensor, b: int, length: int, block_size: int, num_blocks: int) -> torch.Tensor:
    pos = torch.arange(length)
    need = (length + block_size - 1) // block_size
    if need > block_table.shape[1]:
        raise ValueError(f"block_table must have at least {need} columns for row {b}, got {block_table.shape[1]}")
    blocks = block_table[b, :need].to(torch.int64)
    if bool((blocks < 0).any()) or bool((blocks >= num_blocks).any()):
        raise ValueError(f"block_table[{b}, :{need}] must be in [0, {num_blocks}), got {blocks.tolist()}")
    return blocks[pos // block_size] * block_size + pos % block_size


def gather_indexer_k_cache(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> GatheredIndexerK:
    """Gather every request's keys from the paged cache into one ragged buffer (the prefill K workspace).

    Math: request ``b``'s token ``t < seq_lens[b]`` lives at slot ``block_table[b, t // P] * P + t % P``; the
    gathered buffer holds request 0's tokens, then request 1's, ... (``cu_seq_lens`` marks the boundaries).

    Args:
        cache: ``[NB, P, D + 4]`` uint8.
        block_table: ``[B, max_blocks]`` int; only the first ``ceil(seq_lens[b] / P)`` entries of a row are read.
        seq_lens: ``[B]`` int, ``>= 0``.

    Returns:
        ``k_fp8 [sum(seq_lens), D]``, ``k_scale [sum(seq_lens)]`` float32, ``cu_seq_lens [B + 1]`` int64.

    Source: vLLM ``csrc/cache_kernels.cu`` ``cp_gather_indexer_k_quant_cache_kernel``.
    """
    layout = _cache_layout("cache", cache)
    dims = Dims()
    dims.tensor("block_table", block_table, ("B", None), INT)
    lens = _int_vector("seq_lens", seq_lens, dims, "B")
    if bool((lens < 0).any()):
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()}")
    slots = [
        _request_slots(block_table, b, int(lens[b]), layout.block_size, cache.shape[0]) for b in range(lens.numel())
    ]
    flat = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
    k_fp8, k_scale = read_indexer_k_cache(cache, flat)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    return GatheredIndexerK(k_fp8, k_scale, cu)


def paged_indexer_logits(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    weights: torch.Tensor,
    *,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Decode-time indexer logits read straight from the paged fp8 cache (DeepGEMM ``fp8_paged_mqa_logits``).

    Row ``r = b * next_n + j`` is query ``j`` of request ``b``; its columns are key *positions within request b*::

        logits[r, n] = k_scale[n] * sum_h weights[r, h] * relu(q[b, j, h] . k_fp8[n])    n < len[b, j]
        logits[r, n] = -inf                                                             otherwise
        len[b, j]    = context_lens[b, j]                     (2-D context_lens, what vLLM 0.33 passes)
                     = context_lens[b] - next_n + j + 1       (1-D: the last query sees the whole context)

    key ``n`` of request ``b`` is read from slot ``block_table[b, n // P] * P + n % P``.

    Args:
        q: ``[B, next_n, H, D]`` float or fp8 (its scale folded into ``weights``).
        cache: ``[NB, P, D + 4]`` uint8 (:class:`IndexerCacheLayout`), or DeepGEMM's own view of the same bytes
            ``[NB, P, 1, D + 4]`` (``tests/test_attention.py`` and vLLM's ``kv_cache.unsqueeze(-2)``).
        block_table: ``[B, max_blocks]`` int.
        context_lens: ``[B]`` or ``[B, next_n]`` int, ``>= 0`` (a 1-D length shorter than ``next_n`` leaves the
            first queries' derived lengths at 0).
        weights: ``[B * next_n, H]`` float, folded (:func:`fold_indexer_weights`).
        max_context_len: number of output columns; default the largest length. DeepGEMM pads the row stride,
            vLLM passes ``max_model_len``.

    Returns:
        ``logits [B * next_n, max_context_len]`` float64.

    Source: DeepGEMM ``csrc/apis/attention.hpp`` (``fp8_fp4_paged_mqa_logits``), ``tests/test_attention.py``
    (``ref_paged_mqa_logits``); vLLM ``vllm/model_executor/layers/sparse_attn_indexer.py``.
    """
    if isinstance(cache, torch.Tensor) and cache.dim() == 4:  # DeepGEMM's own view [NB, P, 1, D + 4]
        if cache.shape[2] != 1:
            raise ValueError(f"cache must have shape [NB, P, D + 4] or [NB, P, 1, D + 4], got {list(cache.shape)}")
        cache = cache.squeeze(2)
    layout = _cache_layout("cache", cache)
    dims = Dims(D=layout.head_dim)
    dims.tensor("q", q, ("B", "next_n", "H", "D"), FLOAT + FP8)
    dims.tensor("block_table", block_table, ("B", None), INT)
    b_, next_n = dims["B"], dims["next_n"]
    if not isinstance(context_lens, torch.Tensor):
        raise TypeError(f"context_lens must be a torch.Tensor, got {type(context_lens).__name__}")
    dims.tensor("context_lens", context_lens, ("B",) if context_lens.dim() == 1 else ("B", "next_n"), INT)
    in_range("context_lens", context_lens, 0)
    if context_lens.dim() == 1:
        lens = decode_context_lens_native(context_lens, next_n)  # clamped at 0 (a padding request)
    else:
        lens = context_lens.to(torch.int64)
    dims.tensor("weights", weights, (None, "H"), FLOAT)
    if weights.shape[0] != b_ * next_n:
        raise ValueError(
            f"weights must have shape [B * next_n, H] with B * next_n = {b_ * next_n}, got {list(weights.shape)}"
        )
    longest = int(lens.max()) if lens.numel() else 0
    width = longest if max_context_len is None else positive_int("max_context_len", max_context_len, minimum=0)
    if width < longest:
        raise ValueError(f"max_context_len must be >= the longest context {longest}, got {width}")

    out = torch.full((b_ * next_n, width), -math.inf, dtype=torch.float64)
    for b in range(b_):
        length = int(lens[b].max()) if next_n else 0
        if length == 0:
            continue
        slots = _request_slots(block_table, b, length, layout.block_size, cache.shape[0])
        k_fp8, k_scale = read_indexer_k_cache(cache, slots)
        rows = slice(b * next_n, (b + 1) * next_n)
        zeros = torch.zeros(next_n, dtype=torch.int64)
        out[rows, :length] = indexer_logits(q[b], k_fp8, weights[rows], zeros, lens[b], k_scale)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Column forms
# ---------------------------------------------------------------------------------------------------------------


def _spans(ks: object, ke: object, dims: Dims) -> tuple[torch.Tensor, torch.Tensor]:
    ks64 = _int_vector("ks", ks, dims, "M")
    ke64 = _int_vector("ke", ke, dims, "M")
    if bool((ks64 < 0).any()) or bool((ke64 < ks64).any()):
        raise ValueError(f"ks and ke must satisfy 0 <= ks <= ke, got ks={ks64.tolist()}, ke={ke64.tolist()}")
    return ks64, ke64


def compressed_to_absolute(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Expand DeepGEMM's compressed logits (column ``j`` = key ``ks[m] + j``) to absolute columns.

    Math::

        out[m, ks[m] + j] = logits[m, j]     for 0 <= j < ke[m] - ks[m]
        out[m, n]         = -inf             elsewhere (compressed columns past ke - ks are garbage: ignored)

    Args:
        logits: ``[M, N_c]`` float, ``N_c >= max(ke - ks)``.
        ks, ke: ``[M]`` int spans, ``0 <= ks <= ke <= num_keys``.
        num_keys: ``N``, the number of absolute columns.

    Returns:
        ``[M, N]`` float64.

    Source: DeepGEMM ``sm90_fp8_mqa_logits.cuh`` (``kIsCompressedLogits``: stores at ``kv - seq_k_start``) and
    ``tests/test_attention.py`` (the post-processing loop).
    """
    dims = Dims()
    dims.tensor("logits", logits, ("M", "N_c"), FLOAT)
    ks64, ke64 = _spans(ks, ke, dims)
    n = positive_int("num_keys", num_keys, minimum=0)
    if bool((ke64 > n).any()):
        raise ValueError(f"ke must be <= num_keys={n}, got {ke64.tolist()}")
    if ks64.numel() and int((ke64 - ks64).max()) > dims["N_c"]:
        longest = int((ke64 - ks64).max())
        raise ValueError(f"logits must have at least max(ke - ks) = {longest} columns, got {dims['N_c']}")
    out = torch.full((dims["M"], n), -math.inf, dtype=torch.float64)
    for m in range(dims["M"]):
        s, e = int(ks64[m]), int(ke64[m])
        out[m, s:e] = logits[m, : e - s].to(torch.float64)
    return out


def absolute_to_compressed(
    logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, width: int | None = None
) -> torch.Tensor:
    """Shift each row so its span starts at column 0 (DeepGEMM's compressed form), ``-inf`` past the span.

    Math: ``out[m, j] = logits[m, ks[m] + j]`` for ``j < ke[m] - ks[m]``, ``-inf`` for the rest of the row.
    (DeepGEMM leaves those columns uninitialised; ``-inf`` is the value a top-k must give them.)

    Args:
        logits: ``[M, N]`` float, absolute columns.
        ks, ke: ``[M]`` int spans, ``ke <= N``.
        width: output columns ``N_c``; default ``max(ke - ks)`` (DeepGEMM's ``max_seqlen_k``).

    Returns:
        ``[M, N_c]`` float64.
    """
    dims = Dims()
    dims.tensor("logits", logits, ("M", "N"), FLOAT)
    ks64, ke64 = _spans(ks, ke, dims)
    if bool((ke64 > dims["N"]).any()):
        raise ValueError(f"ke must be <= N={dims['N']} (from logits), got {ke64.tolist()}")
    longest = int((ke64 - ks64).max()) if ks64.numel() else 0
    w = longest if width is None else positive_int("width", width, minimum=0)
    if w < longest:
        raise ValueError(f"width must be >= max(ke - ks) = {longest}, got {w}")
    out = torch.full((dims["M"], w), -math.inf, dtype=torch.float64)
    for m in range(dims["M"]):
        s, e = int(ks64[m]), int(ke64[m])
        out[m, : e - s] = logits[m, s:e].to(torch.float64)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Ragged (prefill) and paged (decode) metadata
# ---------------------------------------------------------------------------------------------------------------


class KVSpans(NamedTuple):
    """``ks [T]`` and ``ke [T]`` int64: query ``t`` scores keys ``ks[t] <= n < ke[t]`` of the ragged K buffer."""

    ks: torch.Tensor
    ke: torch.Tensor


def kv_spans_from_batches(start_seq_loc: torch.Tensor, seq_len_per_batch: torch.Tensor) -> KVSpans:
    """Per-query key spans in the concatenated K buffer of a ragged batch (causal, queries at the end).

    Math, for query ``i`` of request ``b`` (``0 <= i < c_b = start_seq_loc[b+1] - start_seq_loc[b]``),
    ``L_b = seq_len_per_batch[b]``::

        ks = sum_{b' < b} L_b'            (request b's first key)
        ke = ks + L_b - c_b + i + 1       (the query is token L_b - c_b + i; it sees itself and everything before)

    Example (from vLLM's docstring): ``start_seq_loc = [0, 2, 4, 7]``, ``seq_len_per_batch = [5, 9, 4]`` gives
    ``ks = [0, 0, 5, 5, 14, 14, 14]``, ``ke = [4, 5, 13, 14, 16, 17, 18]``.

    Args:
        start_seq_loc: ``[B + 1]`` int, cumulative query counts (``query_start_loc`` rebased to 0).
        seq_len_per_batch: ``[B]`` int, each request's full length (context + new tokens), ``>= c_b``.

    Returns:
        ``ks [T]``, ``ke [T]`` int64 (vLLM returns int32).

    Source: vLLM ``vllm/v1/attention/backends/mla/indexer.py`` ``kv_spans_from_batches``.
    """
    q = cu_seqlens("start_seq_loc", start_seq_loc).to(torch.int64)
    dims = Dims().bind("start_seq_loc", B=q.numel() - 1)
    lens = _int_vector("seq_len_per_batch", seq_len_per_batch, dims, "B")
    counts = q[1:] - q[:-1]
    if bool((counts > lens).any()):
        raise ValueError(
            f"seq_len_per_batch must be >= each request's query count {counts.tolist()}, got {lens.tolist()}"
        )
    batch = torch.repeat_interleave(torch.arange(lens.numel()), counts)  # [T]
    ks = (lens.cumsum(0) - lens)[batch]
    local = torch.arange(int(q[-1])) - q[:-1][batch]  # 0 .. c_b - 1
    ke = ks + lens[batch] - counts[batch] + local + 1
    return KVSpans(ks, ke)


class IndexerPrefillChunk(NamedTuple):
    """One prefill chunk: requests ``req_slice`` (absolute request ids) and queries ``query_slice`` of the chunk."""

    req_slice: slice
    query_slice: slice


def split_indexer_prefill_chunks(
    seq_lens: torch.Tensor | Sequence[int],
    query_lens: torch.Tensor | Sequence[int],
    workspace_size: int,
    max_logits_bytes: int,
    request_offset: int = 0,
) -> list[IndexerPrefillChunk]:
    """Split prefill requests into indexer chunks that bound the K workspace and the fp32 logits buffer.

    Greedy, in request order: a chunk takes requests while ``N = sum(seq_lens) <= workspace_size`` and
    ``M * N <= max_logits_bytes // 4`` (``M = sum(query_lens)``; the logits are ``M x N`` fp32). A request that
    fits in no chunk by itself becomes a chunk of its own. Each chunk is then cut on the query axis into
    sub-chunks of ``max(1, (max_logits_bytes // 4) // N)`` queries (the whole chunk when ``N = 0``)::

        for each chunk (requests [start, end), M, N):
            max_q = max(1, budget // N) if N > 0 else max(1, M)
            emit (slice(start + off, end + off), slice(q0, min(q0 + max_q, M)))  for q0 in 0, max_q, ... < M

    ``query_slice`` counts queries from the chunk's first query. Bounds: a multi-request chunk keeps both
    limits; a single oversized request can exceed ``workspace_size`` (vLLM asserts later), and if
    ``N > budget`` even one query exceeds the logits limit.

    Version: vLLM 0.33 writes ``max(1, chunk_m)`` for ``N = 0``; older releases (the seed page) wrote
    ``chunk_m``, which differs only for an empty chunk. This follows 0.33.

    Args:
        seq_lens: ``[B]`` int, full length of each prefill request.
        query_lens: ``[B]`` int, new tokens of each prefill request.
        workspace_size: max keys gathered at once (vLLM: ``40 * max_model_len``).
        max_logits_bytes: logits budget in bytes (``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB * 2**20``).
        request_offset: added to request ids (the number of decode requests before the prefills).

    Returns:
        list of :class:`IndexerPrefillChunk` ``(req_slice, query_slice)``.

    Source: vLLM ``vllm/v1/attention/backends/mla/indexer.py`` ``split_indexer_prefill_chunks``.
    """
    s = torch.as_tensor(seq_lens)
    qn = torch.as_tensor(query_lens)
    dims = Dims()
    s = _int_vector("seq_lens", s, dims, "B")
    qn = _int_vector("query_lens", qn, dims, "B")
    if bool((s < 0).any()) or bool((qn < 0).any()):
        raise ValueError(f"seq_lens and query_lens must be >= 0, got {s.tolist()} and {qn.tolist()}")
    positive_int("workspace_size", workspace_size)
    positive_int("max_logits_bytes", max_logits_bytes, minimum=4)
    positive_int("request_offset", request_offset, minimum=0)
    budget = max_logits_bytes // 4
    chunks: list[IndexerPrefillChunk] = []
    n, end = s.numel(), 0
    while end < n:
        start, m_, n_ = end, 0, 0
        while end < n:
            new_m, new_n = m_ + int(qn[end]), n_ + int(s[end])
            if new_n > workspace_size or new_m * new_n > budget:
                break
            m_, n_, end = new_m, new_n, end + 1
        if end == start:  # one request over budget on its own
            m_, n_, end = int(qn[end]), int(s[end]), end + 1
        req = slice(start + request_offset, end + request_offset)
        max_q = max(1, budget // n_) if n_ > 0 else max(1, m_)
        for q0 in range(0, m_, max_q):
            chunks.append(IndexerPrefillChunk(req, slice(q0, min(q0 + max_q, m_))))
    return chunks


class PrefillChunkMetadata(NamedTuple):
    """What one indexer prefill chunk needs: spans into the chunk's K buffer and the token range it scores.

    ``ks, ke [M_chunk]`` int64 (keys of the chunk's gathered buffer), ``cu_seq_lens [B_chunk + 1]`` int64 (request
    boundaries in that buffer), ``token_start, token_end`` (rows of the batch's query tokens).
    """

    ks: torch.Tensor
    ke: torch.Tensor
    cu_seq_lens: torch.Tensor
    token_start: int
    token_end: int


def prefill_chunk_metadata(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, chunk: IndexerPrefillChunk
) -> PrefillChunkMetadata:
    """Spans and token range of one chunk from :func:`split_indexer_prefill_chunks`.

    Math: the chunk gathers the keys of requests ``req_slice`` into one buffer (``cu_seq_lens``), computes
    ``kv_spans_from_batches`` for all their queries, and keeps the ``query_slice`` rows::

        qsl     = query_start_loc[req.start : req.stop + 1] - query_start_loc[req.start]
        ks, ke  = kv_spans_from_batches(qsl, seq_lens[req])[query_slice]
        tokens  = query_start_loc[req.start] + query_slice

    Sub-chunks after the first reuse the gathered keys (vLLM's ``skip_kv_gather``).

    Args:
        query_start_loc: ``[B + 1]`` int over *all* requests of the batch (decodes first).
        seq_lens: ``[B]`` int.
        chunk: one ``(req_slice, query_slice)``.

    Returns:
        :class:`PrefillChunkMetadata`.

    Source: vLLM ``vllm/v1/attention/backends/mla/indexer.py`` ``build_one_prefill_chunk`` (seed version).
    """
    qsl = cu_seqlens("query_start_loc", query_start_loc).to(torch.int64)
    dims = Dims().bind("query_start_loc", B=qsl.numel() - 1)
    lens = in_range("seq_lens", _int_vector("seq_lens", seq_lens, dims, "B"), 0)
    if not isinstance(chunk, tuple) or len(chunk) != 2 or not all(isinstance(x, slice) for x in chunk):
        raise TypeError("chunk must be a (req_slice, query_slice) pair of slices")
    req, qs = chunk
    if not (0 <= req.start < req.stop <= lens.numel()):
        raise ValueError(f"chunk.req_slice must lie in [0, {lens.numel()}), got {req}")
    local = qsl[req.start : req.stop + 1] - qsl[req.start]
    if not (0 <= qs.start <= qs.stop <= int(local[-1])):
        raise ValueError(f"chunk.query_slice must lie in [0, {int(local[-1])}], got {qs}")
    ks, ke = kv_spans_from_batches(local, lens[req])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens[req].cumsum(0)])
    token0 = int(qsl[req.start])
    return PrefillChunkMetadata(ks[qs], ke[qs], cu, token0 + qs.start, token0 + qs.stop)


class FlattenedDecode(NamedTuple):
    """``context_lens [T]`` int64 (keys each flattened row sees), ``request [T]`` int64 (its block-table row)."""

    context_lens: torch.Tensor
    request: torch.Tensor


def decode_context_lens_flattened(seq_lens: torch.Tensor, decode_lens: torch.Tensor) -> FlattenedDecode:
    """Per-token context lengths when multi-token (MTP) decodes are flattened to one query per row.

    Math, for the ``i``-th new token of request ``b`` (``0 <= i < decode_lens[b]``)::

        context_lens = seq_lens[b] - decode_lens[b] + i + 1,     request = b

    Worked example (vLLM's comment): ``seq_lens = [10, 7, 12, 0]``, ``decode_lens = [3, 1, 4, 0]`` gives
    ``[8, 9, 10, 7, 9, 10, 11, 12]`` with requests ``[0, 0, 0, 1, 2, 2, 2, 2]``. Each row then uses its request's
    block-table row and ``next_n = 1``. Used when the kernel has no native ``next_n`` (vLLM:
    ``natively_supported_next_n = [1, 2]`` on SM90) or decode lengths are not uniform.

    Args:
        seq_lens: ``[B]`` int, full length of each decode request (context + its new tokens).
        decode_lens: ``[B]`` int, new tokens per request, ``0 <= decode_lens <= seq_lens``.

    Returns:
        :class:`FlattenedDecode` of length ``sum(decode_lens)``.

    Source: vLLM ``vllm/v1/attention/backends/mla/indexer.py`` ``_prepare_decode_tensors`` (flatten path).
    """
    dims = Dims()
    lens = _int_vector("seq_lens", seq_lens, dims, "B")
    dl = _int_vector("decode_lens", decode_lens, dims, "B")
    if bool((dl < 0).any()) or bool((dl > lens).any()):
        raise ValueError(
            f"decode_lens must satisfy 0 <= decode_lens <= seq_lens, got {dl.tolist()} for {lens.tolist()}"
        )
    request = torch.repeat_interleave(torch.arange(lens.numel()), dl)
    starts = torch.cumsum(dl, 0) - dl
    i = torch.arange(int(dl.sum())) - starts[request]
    return FlattenedDecode(lens[request] - dl[request] + i + 1, request)


def decode_context_lens_native(seq_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """2-D context lengths for native MTP decode: ``[b, j] = max(seq_lens[b] - next_n + j + 1, 0)``.

    Query ``j`` of ``next_n`` sees everything up to and including itself. vLLM 0.33 clamps at 0 (padding
    requests have ``seq_len = 0``); the seed version did not clamp. For uniform ``decode_lens == next_n`` this
    equals :func:`decode_context_lens_flattened` reshaped to ``[B, next_n]``.

    Args:
        seq_lens: ``[B]`` int.
        next_n: ``>= 1``, tokens per request (``1 + num_speculative_tokens``).

    Returns:
        ``[B, next_n]`` int64.

    Source: vLLM ``vllm/v1/attention/backends/mla/indexer.py`` ``_prepare_decode_tensors`` (native path).
    """
    lens = in_range("seq_lens", _int_vector("seq_lens", seq_lens, Dims(), "B"), 0)
    positive_int("next_n", next_n)
    return (lens[:, None] - next_n + 1 + torch.arange(next_n)[None, :]).clamp_min(0)
