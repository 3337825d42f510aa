"""MLA's two forms of attention, and why they are equal.

Both start from the same tensors (:mod:`mlaspec.spec.projections`): per-head ``q_nope [S_q, H_q, D_nope]`` and
rotated ``q_pe [S_q, H_q, D_rope]``, and per token the latent ``kv_c [S_kv, Lkv]`` and rotated ``k_pe [S_kv,
D_rope]`` (names: ``docs/glossary.md``).

**Compute-friendly form** (vLLM: prefill). Up-project the latent into per-head keys and values, then run ordinary
multi-head attention with ``D_qk = D_nope + D_rope = 192`` and ``D_v = 128``::

    k_nope = kv_c @ W_UK                    [S_kv, H_q, D_nope]   reads Lkv, writes H_q*D_nope per token
    v      = kv_c @ W_UV                    [S_kv, H_q, D_v]
    q      = [q_nope, q_pe]                 [S_q, H_q, 192]
    k      = [k_nope, k_pe (every head)]    [S_kv, H_q, 192]
    o      = MHA(q, k, v)                   [S_q, H_q, D_v]

**Data-movement-friendly form** (vLLM: decode; FlashMLA). Absorb ``W_UK`` into the query and ``W_UV`` into the
output, so attention runs directly on the cache: multi-query attention with one KV head, ``D_qk = Lkv + D_rope =
576``, ``D_v = Lkv = 512``::

    ql_nope = q_nope @ W_UK^T (per head)    [S_q, H_q, Lkv]
    q       = [ql_nope, q_pe]               [S_q, H_q, 576]
    k       = [kv_c, k_pe]                  [S_kv, 1, 576]    = the cache entry itself
    v       = kv_c                          [S_kv, 1, 512]    = the first 512 of the entry
    o_lat   = MQA(q, k, v)                  [S_q, H_q, Lkv]
    o       = o_lat @ W_UV (per head)       [S_q, H_q, D_v]

**Why they are equal.** For head ``n``, query ``i``, key ``j`` the logits agree by associativity::

    q_nope[i,n] . k_nope[j,n] = q_nope[i,n] . (W_UK[:,n,:]^T kv_c[j]) = (W_UK[:,n,:] q_nope[i,n]) . kv_c[j]
                              = ql_nope[i,n] . kv_c[j]

and the rope parts are literally the same product ``q_pe[i,n] . k_pe[j]``. Same logits and the same scale give
the same softmax weights ``p`` and the same LSE. The outputs agree by linearity::

    sum_j p[j] v[j,n] = sum_j p[j] (W_UV[:,n,:]^T kv_c[j]) = W_UV[:,n,:]^T (sum_j p[j] kv_c[j]) = o_lat[n] @ W_UV[:,n,:]

The scale is ``1/sqrt(192)`` (times YaRN's mscale²) in both forms: it belongs to the model, not to the width of
the dot product the kernel happens to compute. The forms differ only in cost (:mod:`mlaspec.spec.cost`): the first
moves ``H_q * (D_nope + D_v)`` values per context token but does ``192 + 128``-wide products per head; the second
moves only the 576-wide entry but does ``576 + 512``-wide products per head.

Source: vLLM ``vllm/model_executor/layers/attention/mla_attention.py`` (module docstring, ``W_UK_T``, ``W_UV``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .attention import AttentionOutput, attention, seq_lens_mask
from .checks import FLOAT, INT, Dims

__all__ = [
    "AbsorbedInputs",
    "MHAInputs",
    "absorb_query",
    "absorbed_inputs",
    "mha_inputs",
    "mla_absorbed",
    "mla_mha",
    "mqa_latent_attention",
    "unabsorb_output",
]


def _check(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV) -> Dims:
    dims = Dims()
    dims.tensor("q_nope", q_nope, ("B", "S_q", "H_q", "D_nope"), FLOAT)
    dims.tensor("q_pe", q_pe, ("B", "S_q", "H_q", "D_rope"), FLOAT)
    dims.tensor("kv_c", kv_c, ("B", "S_kv", "Lkv"), FLOAT)
    dims.tensor("k_pe", k_pe, ("B", "S_kv", "D_rope"), FLOAT)
    dims.tensor("W_UK", W_UK, ("Lkv", "H_q", "D_nope"), FLOAT)
    dims.tensor("W_UV", W_UV, ("Lkv", "H_q", "D_v"), FLOAT)
    return dims


def _f64(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(torch.float64) for t in ts]


class MHAInputs(NamedTuple):
    """The compute-friendly form's attention inputs, float64: ``q [B, S_q, H_q, D_nope + D_rope]``, ``k [B, S_kv,
    H_q, D_nope + D_rope]``, ``v [B, S_kv, H_q, D_v]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def mha_inputs(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
) -> MHAInputs:
    """Up-project the latent into per-head keys and values: the MHA inputs of the compute-friendly form.

    Pseudocode (per batch ``b``, token ``j``, head ``n``)::

        k_nope[j, n] = kv_c[j] @ W_UK[:, n, :]              [D_nope]
        v[j, n]      = kv_c[j] @ W_UV[:, n, :]              [D_v]
        q[i, n]      = [q_nope[i, n], q_pe[i, n]]           [D_nope + D_rope]
        k[j, n]      = [k_nope[j, n], k_pe[j]]              [D_nope + D_rope]   the rope key is shared by every head

    Example: ``Lkv = 2, H_q = 1, D_nope = D_v = 1, D_rope = 1``, ``kv_c = [[1, 2]]``, ``W_UK[:, 0, 0] = [3, 4]``,
    ``W_UV[:, 0, 0] = [5, 6]``, ``k_pe = [[7]]`` give ``k = [[[11, 7]]]`` and ``v = [[[17]]]`` (per batch).

    Args:
        q_nope: ``[B, S_q, H_q, D_nope]`` float.
        q_pe: ``[B, S_q, H_q, D_rope]`` float, already rotated.
        kv_c: ``[B, S_kv, Lkv]`` float, the normed latent.
        k_pe: ``[B, S_kv, D_rope]`` float, already rotated.
        W_UK: ``[Lkv, H_q, D_nope]`` float.
        W_UV: ``[Lkv, H_q, D_v]`` float.

    Returns:
        :class:`MHAInputs` ``q [B, S_q, H_q, D_nope + D_rope]``, ``k [B, S_kv, H_q, D_nope + D_rope]``, ``v [B, S_kv,
        H_q, D_v]``, float64.
    """
    dims = _check(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV)
    q_nope, q_pe, kv_c, k_pe, W_UK, W_UV = _f64(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV)
    k_nope = torch.einsum("bsl,lnp->bsnp", kv_c, W_UK)  # [B, S_kv, H_q, D_nope]
    v = torch.einsum("bsl,lnv->bsnv", kv_c, W_UV)  # [B, S_kv, H_q, D_v]
    k_pe_heads = k_pe[:, :, None, :].expand(-1, -1, dims["H_q"], -1)  # the shared rope key, for every head
    q = torch.cat([q_nope, q_pe], dim=-1)  # [B, S_q, H_q, D_nope + D_rope]
    k = torch.cat([k_nope, k_pe_heads], dim=-1)  # [B, S_kv, H_q, D_nope + D_rope]
    return MHAInputs(q, k, v)


class AbsorbedInputs(NamedTuple):
    """The data-movement-friendly form's attention inputs, float64: the absorbed ``q [B, S_q, H_q, Lkv + D_rope]``
    and the cache entries ``kv [B, S_kv, Lkv + D_rope]`` (keys; their first ``Lkv`` columns are the values)."""

    q: torch.Tensor
    kv: torch.Tensor


def absorbed_inputs(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, W_UK: torch.Tensor
) -> AbsorbedInputs:
    """Absorb ``W_UK`` into the query and lay out the cache entries: the MQA inputs of the absorbed form.

    Pseudocode::

        q[i, n] = [q_nope[i, n] @ W_UK[:, n, :]^T, q_pe[i, n]]      [Lkv + D_rope]   (:func:`absorb_query`)
        kv[j]   = [kv_c[j], k_pe[j]]                               [Lkv + D_rope]   the cache entry, latent first

    Example: ``Lkv = 2, H_q = 1, D_nope = 1, D_rope = 1``, ``q_nope = [[[[2]]]]``, ``W_UK[:, 0, 0] = [3, 4]``,
    ``q_pe = [[[[5]]]]``, ``kv_c = [[[1, 2]]]``, ``k_pe = [[[7]]]`` give ``q = [[[[6, 8, 5]]]]`` and ``kv = [[[1, 2,
    7]]]``.

    Args: as :func:`mha_inputs`, without ``W_UV``.

    Returns:
        :class:`AbsorbedInputs` ``q [B, S_q, H_q, Lkv + D_rope]`` and ``kv [B, S_kv, Lkv + D_rope]``, float64.
    """
    dims = Dims()
    dims.tensor("q_nope", q_nope, ("B", "S_q", "H_q", "D_nope"), FLOAT)
    dims.tensor("q_pe", q_pe, ("B", "S_q", "H_q", "D_rope"), FLOAT)
    dims.tensor("kv_c", kv_c, ("B", "S_kv", "Lkv"), FLOAT)
    dims.tensor("k_pe", k_pe, ("B", "S_kv", "D_rope"), FLOAT)
    dims.tensor("W_UK", W_UK, ("Lkv", "H_q", "D_nope"), FLOAT)
    q = absorb_query(q_nope, q_pe, W_UK)  # [B, S_q, H_q, Lkv + D_rope]
    kv = torch.cat([kv_c.to(torch.float64), k_pe.to(torch.float64)], dim=-1)  # [B, S_kv, Lkv + D_rope]: cache entries
    return AbsorbedInputs(q, kv)


def mla_mha(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> AttentionOutput:
    """The compute-friendly (prefill) form: up-project (:func:`mha_inputs`), then MHA with ``D_qk = D_nope +
    D_rope`` and the value width ``D_v``.

    Args:
        q_nope, q_pe, kv_c, k_pe, W_UK, W_UV: as :func:`mha_inputs` (``[B, S_q, H_q, D_nope]``, ``[B, S_q, H_q,
            D_rope]``, ``[B, S_kv, Lkv]``, ``[B, S_kv, D_rope]``, ``[Lkv, H_q, D_nope]``, ``[Lkv, H_q, D_v]``, float).
        scale: softmax scale (``MLAConfig.softmax_scale``).
        causal, mask: as :func:`mlaspec.spec.attention.attention`.

    Returns:
        ``out [B, S_q, H_q, D_v]`` and ``lse [B, H_q, S_q]``, float64.
    """
    q, k, v = mha_inputs(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV)
    return attention(q, k, v, scale=scale, causal=causal, mask=mask)


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, W_UK: torch.Tensor) -> torch.Tensor:
    """``[q_nope @ W_UK^T, q_pe]``: the absorbed query ``[..., H_q, Lkv + D_rope]`` float64.

    Args:
        q_nope: ``[..., H_q, D_nope]`` float. q_pe: ``[..., H_q, D_rope]`` float. W_UK: ``[Lkv, H_q, D_nope]``
            float.
    """
    dims = Dims()
    dims.tensor("W_UK", W_UK, ("Lkv", "H_q", "D_nope"), FLOAT)
    lead = (None,) * (q_nope.dim() - 2) if isinstance(q_nope, torch.Tensor) and q_nope.dim() >= 2 else ()
    dims.tensor("q_nope", q_nope, lead + ("H_q", "D_nope"), FLOAT)
    if isinstance(q_pe, torch.Tensor) and q_pe.dim() != q_nope.dim():
        raise ValueError(f"q_pe must have the rank of q_nope {list(q_nope.shape)}, got shape {list(q_pe.shape)}")
    dims.tensor("q_pe", q_pe, lead + ("H_q", "D_rope"), FLOAT)
    if q_pe.shape[:-2] != q_nope.shape[:-2]:
        raise ValueError(
            f"q_pe must have leading shape {list(q_nope.shape[:-2])} (from q_nope), got {list(q_pe.shape)}"
        )
    ql_nope = torch.einsum("...np,lnp->...nl", q_nope.to(torch.float64), W_UK.to(torch.float64))
    return torch.cat([ql_nope, q_pe.to(torch.float64)], dim=-1)


def mqa_latent_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    *,
    d_v: int,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
) -> AttentionOutput:
    """The op FlashMLA's dense decode computes: MQA of absorbed queries over cache entries, ``v = kv[..., :d_v]``.

    Args:
        q: ``[B, S_q, H_q, D_qk]`` float (``D_qk = 576`` for DeepSeek).
        kv: ``[B, S_kv, D_qk]`` float, the cache entries (one KV head).
        d_v: value width, the leading part of each entry (``512``).
        scale: softmax scale.
        causal, mask: as :func:`mlaspec.spec.attention.attention`; FlashMLA's ``causal`` with ``S_q > 1`` aligns
            the queries to the end of the context, as here.
        seq_lens: optional ``[B]`` int, request ``b`` holds only keys ``[0, seq_lens[b])`` of its ``S_kv`` slots
            (``0`` allowed: output 0, LSE ``-inf``), and ``causal`` aligns its queries to the end of *its* keys
            (:func:`~mlaspec.spec.attention.seq_lens_mask`): FlashMLA's ``cache_seqlens``
            (``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, ...)``). Slots past a request's
            length are never read. Default: every request holds all ``S_kv``.

    Returns:
        ``out [B, S_q, H_q, d_v]`` (latent space) and ``lse [B, H_q, S_q]``, float64.
    """
    dims = Dims()
    dims.tensor("q", q, ("B", "S_q", "H_q", "D_qk"), FLOAT)
    dims.tensor("kv", kv, ("B", "S_kv", "D_qk"), FLOAT)
    if isinstance(d_v, bool) or not isinstance(d_v, int) or not 0 < d_v <= dims["D_qk"]:
        raise ValueError(f"d_v must be an int in [1, D_qk={dims['D_qk']}], got {d_v!r}")
    k = kv[:, :, None, :]  # [B, S_kv, 1, D_qk]
    if seq_lens is not None:
        dims.tensor("seq_lens", seq_lens, ("B",), INT)
        lengths = seq_lens_mask(seq_lens, dims["S_q"], dims["S_kv"], causal=causal).to(q.device)
        if mask is not None:  # [B, S_q, S_kv] or [B, H_q, S_q, S_kv]: attention checks its shape
            lengths = (lengths if mask.dim() == 3 else lengths[:, None]) & mask.to(q.device)
        mask = lengths
        causal = False
    return attention(q, k, k[..., :d_v], scale=scale, causal=causal, mask=mask)


def unabsorb_output(o_latent: torch.Tensor, W_UV: torch.Tensor) -> torch.Tensor:
    """``o_latent @ W_UV`` per head: ``[..., H_q, Lkv]`` -> ``[..., H_q, D_v]`` float64."""
    dims = Dims()
    dims.tensor("W_UV", W_UV, ("Lkv", "H_q", "D_v"), FLOAT)
    lead = (None,) * (o_latent.dim() - 2) if isinstance(o_latent, torch.Tensor) else ()
    dims.tensor("o_latent", o_latent, lead + ("H_q", "Lkv"), FLOAT)
    return torch.einsum("...nl,lnv->...nv", o_latent.to(torch.float64), W_UV.to(torch.float64))


def mla_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> AttentionOutput:
    """The data-movement-friendly (decode) form: absorb ``W_UK``, MQA over the 576-wide entries, then ``W_UV``.

    Same arguments and results as :func:`mla_mha` (``out [B, S_q, H_q, D_v]``, ``lse [B, H_q, S_q]``, float64).
    """
    dims = _check(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV)
    q, kv = absorbed_inputs(q_nope, q_pe, kv_c, k_pe, W_UK)
    o_latent, lse = mqa_latent_attention(q, kv, d_v=dims["Lkv"], scale=scale, causal=causal, mask=mask)
    return AttentionOutput(unabsorb_output(o_latent, W_UV), lse)
