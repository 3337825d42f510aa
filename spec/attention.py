"""Scaled dot-product attention that also returns the log-sum-exp of each row.

Every attention in MLA reduces to this one function: the compute-friendly prefill form is multi-head attention
with ``D_qk = 192, D_v = 128``; the absorbed decode form is multi-query attention (``H_kv = 1``) with
``D_qk = 576, D_v = 512``; sparse and sliding-window attention are this function under a mask.

Math, per batch ``b``, query head ``h``, query ``i``, with ``g = H_q // H_kv`` query heads per KV head::

    s[j]   = scale * q[b, i, h] . k[b, j, h // g]          for every key j allowed by the mask
    lse    = log(sum_j exp(s[j]))                           natural log; -inf when no key is allowed
    out    = sum_j exp(s[j] - lse) * v[b, j, h // g]        0 when no key is allowed

Conventions (and where they come from):

* LSE is the natural log, laid out ``[B, H_q, S_q]`` as FlashMLA returns ``softmax_lse``
  (FlashMLA ``flash_mla/flash_mla_interface.py``, ``flash_mla_with_kvcache``). The varlen form lays it out
  ``[H_q, T_q]`` as flash-attn's varlen kernels and vLLM's ``merge_attn_states`` do.
* ``causal`` aligns the queries to the *end* of the keys (bottom-right): query ``i`` of ``S_q`` sees key ``j``
  iff ``j <= i + S_kv - S_q``. This is how vLLM appends new tokens after a context and how FlashMLA's dense
  decode treats ``q_len > 1`` (MTP).
* Keys that no query may attend are never read: NaN in unused pages or slots cannot reach the output.
* A row with no allowed key has output 0 and LSE ``-inf``; :func:`mlaspec.spec.merge.merge_attn_states` then
  gives it zero weight. FlashMLA reports such a row as ``+inf`` in *all* its kernels: the sparse ones (see the
  sparse spec, ``tests/ref.py``) and the dense decode ``flash_mla_with_kvcache`` too (a request with
  ``cache_seqlens = 0``: its reference ``ref_mla`` in ``tests/test_flash_mla_dense_decoding.py`` sets
  ``lse[lonely_q_mask] = +inf``, and the ``flashmla`` conformance backend reads ``+inf`` back from the kernel),
  as FlashAttention-2 does. Both mean "no key"; vLLM's merge treats them alike.
* The default scale is ``1 / sqrt(D_qk)``. MLA passes its own scale: ``1/sqrt(192)`` (times the YaRN mscale²)
  in *both* forms, although the absorbed form's dot product is 576 wide.

The spec computes in float64 whatever the input dtype and returns float64.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .checks import BOOL, FLOAT, INT, Dims, boolean, cu_seqlens, finite_float, in_range, positive_int
from .checks import device as _device

__all__ = ["AttentionOutput", "attention", "attention_varlen", "causal_mask", "seq_lens_mask"]


class AttentionOutput(NamedTuple):
    """``out [..., S_q, H_q, D_v]`` and ``lse`` (natural log; -inf for rows with no key), both float64."""

    out: torch.Tensor
    lse: torch.Tensor


def causal_mask(s_q: int, s_kv: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Bottom-right aligned causal mask ``[S_q, S_kv]`` bool: query ``i`` sees key ``j`` iff ``j <= i + S_kv - S_q``.

    Example (``S_q = 2, S_kv = 4``: the two new tokens are the last two positions)::

        [[1, 1, 1, 0],
         [1, 1, 1, 1]]

    ``s_q`` and ``s_kv`` are ints ``>= 0`` (``S_q > S_kv`` leaves the first ``S_q - S_kv`` rows empty).
    """
    s_q = positive_int("s_q", s_q, minimum=0)
    s_kv = positive_int("s_kv", s_kv, minimum=0)
    device = _device("device", device)
    i = torch.arange(s_q, device=device)[:, None]
    j = torch.arange(s_kv, device=device)[None, :]
    return j <= i + (s_kv - s_q)


def seq_lens_mask(seq_lens: torch.Tensor, s_q: int, s_kv: int, *, causal: bool) -> torch.Tensor:
    """Keys each request may read when it holds ``seq_lens[b] <= S_kv`` of the ``S_kv`` key slots, ``[B, S_q, S_kv]``
    bool: key ``j`` iff ``j < seq_lens[b]`` and, with ``causal``, ``j <= i + seq_lens[b] - S_q`` (the queries are the
    last ``S_q`` positions of *their own* request, FlashMLA's ``cache_seqlens`` with ``causal``).

    Example (``seq_lens = [4, 1]``, ``S_q = 2``, ``S_kv = 4``, causal; request 1's first query sees no key)::

        [[[1, 1, 1, 0],      [[0, 0, 0, 0],
          [1, 1, 1, 1]],      [1, 0, 0, 0]]]
    """
    s_q = positive_int("s_q", s_q, minimum=0)
    s_kv = positive_int("s_kv", s_kv, minimum=0)
    causal = boolean("causal", causal)
    Dims().tensor("seq_lens", seq_lens, ("B",), INT)
    lens = in_range("seq_lens", seq_lens, 0, s_kv).to(torch.int64)
    i = torch.arange(s_q, device=lens.device)[None, :, None]  # on seq_lens' device, whatever the default device
    j = torch.arange(s_kv, device=lens.device)[None, None, :]
    n = lens[:, None, None]
    allowed = j < n
    return allowed & (j <= i + n - s_q) if causal else allowed.expand(-1, s_q, -1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> AttentionOutput:
    """Attention with log-sum-exp over a padded batch.

    Args:
        q: ``[B, S_q, H_q, D_qk]`` float.
        k: ``[B, S_kv, H_kv, D_qk]`` float; ``H_q % H_kv == 0`` (``H_kv = 1`` is MQA).
        v: ``[B, S_kv, H_kv, D_v]`` float.
        scale: softmax scale; default ``1 / sqrt(D_qk)``.
        causal: bottom-right aligned causal mask (see module docstring).
        mask: optional bool ``[B, S_q, S_kv]`` (shared by heads) or ``[B, H_q, S_q, S_kv]``; True = may attend.
            Combined with ``causal`` by logical and.

    Returns:
        ``out [B, S_q, H_q, D_v]`` and ``lse [B, H_q, S_q]``, float64.
    """
    dims = Dims()
    dims.tensor("q", q, ("B", "S_q", "H_q", "D_qk"), FLOAT)
    dims.tensor("k", k, ("B", "S_kv", "H_kv", "D_qk"), FLOAT)
    dims.tensor("v", v, ("B", "S_kv", "H_kv", "D_v"), FLOAT)
    h_q, h_kv = dims["H_q"], dims["H_kv"]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"k must have a head count H_kv that divides H_q={h_q}, got H_kv={h_kv}")
    boolean("causal", causal)
    scale = 1.0 / math.sqrt(dims["D_qk"]) if scale is None else finite_float("scale", scale)

    allowed = torch.ones(1, 1, dims["S_q"], dims["S_kv"], dtype=torch.bool, device=q.device)
    if mask is not None:
        if isinstance(mask, torch.Tensor) and mask.dim() == 3:
            allowed = dims.tensor("mask", mask, ("B", "S_q", "S_kv"), BOOL)[:, None]
        else:
            allowed = dims.tensor("mask", mask, ("B", "H_q", "S_q", "S_kv"), BOOL)
    if causal:
        allowed = allowed & causal_mask(dims["S_q"], dims["S_kv"], device=q.device)

    g = h_q // h_kv
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    if allowed.shape[1] > 1:  # a mask per query head: each query head's own copy of its KV head
        k64, v64, h_kv, g = k64.repeat_interleave(g, dim=2), v64.repeat_interleave(g, dim=2), h_q, 1
    b, s_q, s_kv = q.shape[0], dims["S_q"], dims["S_kv"]
    q64 = q64.reshape(b, s_q, h_kv, g, dims["D_qk"])  # query head h = (h // g, h % g) reads KV head h // g
    s = torch.einsum("bqkgd,bjkd->bkgqj", q64, k64).reshape(b, h_q, s_q, s_kv) * scale  # [B, H_q, S_q, S_kv]
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [B, H_q, S_q]; -inf where the row is empty
    p = torch.where(allowed, torch.exp(s - lse[..., None]), 0.0)  # empty rows: 0, not NaN
    reachable = allowed.any(dim=2).transpose(1, 2)[..., None]  # [B, S_kv, 1 or H_q, 1]: some query may read the key
    v64 = torch.where(reachable, v64, 0.0)  # a key no query may read is never read (NaN-filled pages stay out)
    out = torch.einsum("bkgqj,bjkd->bqkgd", p.reshape(b, h_kv, g, s_q, s_kv), v64)
    return AttentionOutput(out.reshape(b, s_q, h_q, dims["D_v"]), lse)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
) -> AttentionOutput:
    """Attention over a packed (varlen) batch, as flash-attn's ``flash_attn_varlen_func``.

    Sequence ``b`` owns queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``;
    ``causal`` is aligned bottom-right within each sequence.

    Args:
        q: ``[T_q, H_q, D_qk]`` float.
        k: ``[T_kv, H_kv, D_qk]`` float.
        v: ``[T_kv, H_kv, D_v]`` float.
        cu_seqlens_q: ``[B + 1]`` int, starts at 0, non-decreasing, ends at ``T_q``.
        cu_seqlens_k: ``[B + 1]`` int, likewise, ends at ``T_kv``.

    Returns:
        ``out [T_q, H_q, D_v]`` and ``lse [H_q, T_q]`` (flash-attn's varlen layout), float64.
    """
    dims = Dims()
    dims.tensor("q", q, ("T_q", "H_q", "D_qk"), FLOAT)
    dims.tensor("k", k, ("T_kv", "H_kv", "D_qk"), FLOAT)
    dims.tensor("v", v, ("T_kv", "H_kv", "D_v"), FLOAT)
    cq = cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    ck = cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch=cq.numel() - 1, batch_from="cu_seqlens_q")
    if int(cq[-1]) != dims["T_q"]:
        raise ValueError(f"cu_seqlens_q must end at T_q={dims['T_q']} (from q), got {cq.tolist()}")
    if int(ck[-1]) != dims["T_kv"]:
        raise ValueError(f"cu_seqlens_k must end at T_kv={dims['T_kv']} (from k), got {ck.tolist()}")
    boolean("causal", causal)
    if scale is not None:
        finite_float("scale", scale)

    out = torch.zeros(dims["T_q"], dims["H_q"], dims["D_v"], dtype=torch.float64, device=q.device)
    lse = torch.full((dims["H_q"], dims["T_q"]), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(cq.numel() - 1):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if qe == qs:
            continue
        o, l = attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], scale=scale, causal=causal)
        out[qs:qe], lse[:, qs:qe] = o[0], l[0]
    return AttentionOutput(out, lse)
