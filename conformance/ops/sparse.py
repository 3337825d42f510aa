"""Sparse ops: FlashMLA's sparse prefill and sparse decode (DeepSeek V3.2 / V4), and one DeepSeek V4 layer.

* ``sparse_prefill`` checks :func:`mlaspec.spec.sparse.sparse_prefill` (``flash_mla_sparse_fwd``): ``out``,
  ``max_logits``, ``lse`` (``[S_q, H_q]``, natural log, **+inf on a row with no valid index**);
* ``sparse_decode`` checks :func:`mlaspec.spec.sparse.sparse_decode` (``flash_mla_with_kvcache(indices=...)``)
  over a dequantized paged cache ``[NB, P, D_qk]`` with global slots ``block * P + offset``,
  ``topk_length [B]`` per request, an attention sink and, for V4, the ``extra`` cache;
* ``v4_attention`` checks :func:`mlaspec.spec.sliding_window.v4_attention`, the definition of one DeepSeek V4
  layer for one request (window ``(p - W, p]`` over the raw keys, plus the compressed entries of a c4a / c128a
  layer). An adapter for a FlashMLA-style kernel turns the layer into index rows (the spec's
  :func:`~mlaspec.spec.sliding_window.v4_attention_indices`) and calls its sparse kernel on them.

**Budget derivation.** Sparse attention *is* dense attention over the gathered keys: row ``i`` (a query and a KV
head) is a batch of one query attending to the ``K`` keys its slots name, under the mask "slot is valid"
(``0 <= index < S_kv``, or ``!= -1`` for decode, and ``slot < topk_length``). That is how the spec computes it,
and it is how the budget is derived: the logit error ``δs = γ_D scale max_j Σ_d |q_d k_jd|``
(:func:`~mlaspec.conformance.ops.common.logit_error`) and the magnitude ``M = Σ_j p_j |v_j|`` are computed over
the gathered keys (zero at invalid slots, so NaN in unused cache rows never enters a budget; query heads grouped
by KV head, the keys never repeated per head), which gives the dense bound of :mod:`mlaspec.conformance.ops`,
with the sink factor ``f`` and the underflow floor ``η/2`` added::

    |out - ref| <= 2 * (u |ref| + (u + 2 δs) f M + (δs + 4 ε32) |ref| + η/2 (1 + f A))
    |lse - ref| <= 2 * (δs + ε32 |ref|),   |max_logits - ref| <= 2 * (δs + ε32 |ref|)

``f = sigmoid(lse - attn_sink)`` is the sink factor (1 without a sink): the softmax part scales by ``f``, and
``f`` itself, computed in fp32 from an LSE that is off by ``δs``, is off by at most ``f (1 - f) δs + 4 ε32 f
<= f (δs + 4 ε32)`` relatively, which is the third term (``|ref| = f |out without sink|``).

**Underflow.** ``u`` is relative only down to the smallest normal of the case dtype (``2^-14`` in fp16); below it
rounding costs up to ``η/2``, half the smallest subnormal (:func:`~mlaspec.conformance.ops.common.underflow_floor`,
``2^-25`` fp16, ``2^-134`` bf16), whatever the value. Two roundings of the case dtype meet it: the output (``η/2``)
and each weight ``p_j`` (``η/2`` per key, ``p_j`` normalised or relative to a running maximum and later scaled
down: either way at most ``η/2`` in the normalised weight), which costs ``η/2 f A`` with ``A = Σ_j |v_j|`` over
the row's valid keys. It shows where ``f M`` is tiny: a sink far above the LSE in fp16 (``f ~ 5e-4``, one key)
puts whole rows below ``2^-14``, where a correctly rounded output is ``~η/2`` off while ``u |ref|`` is far smaller.
A row whose exact output is 0 (no valid key, or ``f = 0`` under a ``+inf`` sink) gets no floor: a zero is not
rounded, so those rows must stay exactly 0. fp32's own floor (``2^-150``) in ``f`` and the accumulators is below
``η/2`` by ``2^16`` or more for fp16 and bf16 cases; for fp32 cases it is of the order of the fp32 accumulation
error, which the budget, like the dense one, leaves to its factor 2.

**Exact conventions.** NaN and ±inf positions are compared exactly before any value
(:func:`~mlaspec.conformance.verdict.judge`): an empty sparse row must give LSE ``+inf`` (FlashMLA's choice; the
judge's ``+inf -> -inf`` allowance applies only where the *spec* says ``-inf``, which it never does here), output
0 and ``max_logits -inf``; a sink of ``+inf`` must give an output of exactly 0.

**Hostile inputs.** Every cache row no slot names is NaN, and so are row 0 and the last row (a ``-1`` read as
index 0, or wrapped Python-style to the last key, shows up as NaN). Prefill rows mix FlashMLA's invalid sentinels
(``-1``, ``S_kv``, ``INT_MIN``, ``INT_MAX``) at random slots, not only at the end; a top-k wider than the keys
ends every row in ``-1`` padding. Slots past ``topk_length`` hold
*valid* indices of finite rows, so a kernel that ignores ``topk_length`` attends to the wrong keys but does not hit
FlashMLA's documented NaN caveat ("a valid topk index between topk_length[i] ~ s_kv that points to a k token
containing NaN", ``flash_mla/flash_mla_interface.py``). Indices within a row are unique (FlashMLA's tests and
vLLM's indexer never repeat one). In ``v4_attention`` the raw keys no query's window reaches and the compressed
entries no query selects are NaN; the reference is the spec itself, which never reads a key no query may attend
(:func:`~mlaspec.spec.attention.attention`), so only a kernel that reads outside a window or an unselected entry
sees the NaN.
"""

from __future__ import annotations

import math

import torch

from mlaspec.spec.attention import causal_mask
from mlaspec.spec.config import MLAConfig
from mlaspec.spec.sliding_window import (
    c128a_topk_indices,
    num_visible_compressed,
    swa_indices_and_lens,
    v4_attention,
    v4_attention_indices,
)
from mlaspec.spec.sparse import global_slot_indices, indices_to_mask, sparse_decode, sparse_prefill, valid_slots

from .. import numerics
from ..cases import Case
from .common import EPS32, LIMITS, Op, Scale, composite, gamma, normal, randn, st, underflow_floor, worst_rows
from .writers import read_as, written

INT_MIN, INT_MAX = -(2**31), 2**31 - 1

#: DeepSeek-V3.2's softmax scale, YaRN-corrected: ``mscale^2 / sqrt(192)`` with ``mscale = 0.1 ln(40) + 1``
#: (:attr:`~mlaspec.spec.config.MLAConfig.softmax_scale`), the same for the 576-wide absorbed form the sparse
#: kernels see; about 3.2 times FlashMLA's default ``576^-0.5``.
YARN_SCALE = MLAConfig.deepseek_v3().softmax_scale


def _scale(p: dict, d: int) -> float:
    """The case's softmax scale: ``"yarn"`` (:data:`YARN_SCALE`), a number, or by default ``d^-0.5``."""
    scale = p.get("scale", d**-0.5)
    return YARN_SCALE if scale == "yarn" else scale


# -- the shared budget ---------------------------------------------------------------------------------------------
def gather_keys(rows: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``rows[indices[r, h, t], h]`` as ``[R, K, H_kv, D]`` float64, zero at invalid slots (never reads them)."""
    safe = torch.where(valid, indices.long(), 0)
    heads = torch.arange(rows.shape[1])[None, :, None]
    g = torch.where(valid[..., None], rows.to(torch.float64)[safe, heads], 0.0)  # [R, H_kv, K, D]
    return g.permute(0, 2, 1, 3)


def sparse_bounds(q, keys, valid, *, scale, d_v, attn_sink, out, lse, max_logits=None, u, eta_half=None):
    """Per-element budgets of sparse attention over gathered ``keys`` (see the module docstring).

    ``q [R, H_q, D]``, ``keys [R, K, H_kv, D]`` float64 (zero where invalid), ``valid [R, H_kv, K]``, the spec's
    ``out [R, H_q, d_v]`` and ``lse [R, H_q]`` (+inf where empty). ``eta_half`` is the case dtype's underflow floor
    ``η/2``, by default that of ``q``'s dtype. Returns ``(out_bound, lse_bound, ml_bound)``.
    """
    r_, h_q, d = q.shape
    h_kv = keys.shape[2]
    g = h_q // h_kv
    qg = q.to(torch.float64).reshape(r_, h_kv, g, d)  # query head h reads KV head h // g: grouped, never repeated
    kg = keys.permute(0, 2, 1, 3)  # [R, H_kv, K, D]
    absqk = torch.einsum("rcgd,rckd->rcgk", qg.abs(), kg.abs())
    ds = (gamma(d) * scale * (absqk.amax(-1) if absqk.shape[-1] else absqk.sum(-1))).reshape(r_, h_q)  # δs
    s = torch.einsum("rcgd,rckd->rcgk", qg, kg).mul(scale).masked_fill(~valid[:, :, None, :], -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # the spec's weights; an empty row has none
    m = torch.einsum("rcgk,rckd->rcgd", p, kg[..., :d_v].abs()).reshape(r_, h_q, d_v)  # M = Σ_j p_j |v_j|
    empty = ~torch.isfinite(lse)
    lse0 = torch.where(empty, 0.0, lse)
    f = torch.ones_like(lse0)
    if attn_sink is not None:
        f = torch.where(empty, 0.0, torch.sigmoid(lse0 - attn_sink.to(torch.float64)[None, :]))
    if eta_half is None:
        eta_half = underflow_floor(q.dtype) if q.dtype.is_floating_point and q.element_size() > 1 else 0.0
    a = kg[..., :d_v].abs().sum(2).repeat_interleave(g, dim=1)  # [R, H_q, d_v]: Σ_j |v_j| over valid keys
    rounded = (~empty & (f > 0)).to(torch.float64)[..., None]  # an exact 0 (no key, +inf sink) is not rounded
    ref = out.abs()
    out_b = 2 * (
        u * ref
        + ((u + 2 * ds) * f)[..., None] * m
        + (ds + 4 * EPS32)[..., None] * ref
        + eta_half * rounded * (1 + f[..., None] * a)
    )
    lse_b = 2 * (ds + EPS32 * lse0.abs())
    ml_b = None
    if max_logits is not None:
        ml_b = 2 * (ds + EPS32 * max_logits.nan_to_num(0.0, posinf=0.0, neginf=0.0).abs())
    return out_b, lse_b, ml_b


def _sink(c: Case, h_q: int) -> torch.Tensor | None:
    """``[H_q]`` float32 sink: ``finite`` (|sink| ~ 2, so it matters), ``inf`` (finite with some ±inf), or None."""
    kind = c.params.get("sink")
    if kind is None:
        return None
    g = torch.Generator().manual_seed(c.seed + 7)
    s = normal(h_q, generator=g) * 2.0 + 1.0
    if kind == "inf":
        s[0], s[1 % h_q] = math.inf, -math.inf
    return s.to(torch.float32)


def _hostile(cache: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """NaN in every row of ``cache [S, ...]`` that ``used [S]`` does not mark."""
    return cache.masked_fill(~used.reshape(-1, *[1] * (cache.dim() - 1)), math.nan)


# -- sparse_prefill --------------------------------------------------------------------------------------------------
def _prefill_inputs(c: Case) -> dict:
    """V3.2 sparse prefill: unique indices of finite rows, invalid sentinels scattered, optional topk_length."""
    p, r = c.params, randn(c)
    s_q, s_kv, h_q, h_kv, d, dv, k = (p[x] for x in ("S_q", "S_kv", "H_q", "H_kv", "D_qk", "D_v", "K"))
    g = torch.Generator().manual_seed(c.seed + 1)
    pool = torch.arange(1, s_kv - 1)  # rows 0 and S_kv - 1 are never named: a wrapped or zeroed -1 reads NaN
    pool = pool[torch.randperm(pool.numel(), generator=g)][: max(k, (3 * pool.numel()) // 4)]  # the rest: unused
    n = min(k, pool.numel())  # K above the usable keys (top-k of a short prefix): the tail is -1 padding
    idx = torch.full((s_q * h_kv, k), -1, dtype=torch.int64)
    for row in idx:
        row[:n] = pool[torch.randperm(pool.numel(), generator=g)[:n]]
    idx = idx.reshape(s_q, h_kv, k)
    bad = torch.tensor([-1, s_kv, INT_MIN, INT_MAX])
    invalid = torch.rand(s_q, h_kv, k, generator=g) < p.get("invalid", 0.2)
    idx = torch.where(invalid, bad[torch.randint(0, 4, (s_q, h_kv, k), generator=g)], idx)
    topk_length = None
    if p.get("topk_length"):
        topk_length = torch.randint(0, k + 1, (s_q,), generator=g)
        topk_length[0] = k
    for row in range(min(p.get("empty", 0), s_q)):  # rows with no valid slot: all -1, or topk_length 0
        if topk_length is not None and row % 2:
            topk_length[-1 - row] = 0
        else:
            idx[-1 - row] = -1
    named = torch.where((idx >= 0) & (idx < s_kv), idx, 0).reshape(-1)
    used = torch.zeros(s_kv, dtype=torch.bool)
    used[named] = True
    used[0] = used[-1] = False
    kv = _hostile(r(s_kv, h_kv, d), used)
    return dict(
        q=r(s_q, h_q, d, scale=2.0),
        kv=kv,
        indices=idx.to(torch.int32),
        scale=_scale(p, d),
        d_v=dv,
        attn_sink=_sink(c, h_q),
        topk_length=None if topk_length is None else topk_length.to(torch.int32),
    )


def _prefill_bounds(kw, ref, u):
    out, max_logits, lse = ref
    valid = valid_slots(kw["indices"], kw["kv"].shape[0], kw["topk_length"])
    keys = gather_keys(kw["kv"], kw["indices"], valid)
    out_b, lse_b, ml_b = sparse_bounds(
        kw["q"],
        keys,
        valid,
        scale=kw["scale"],
        d_v=kw["d_v"],
        attn_sink=kw["attn_sink"],
        out=out,
        lse=lse,
        max_logits=max_logits,
        u=u,
    )
    return out_b, ml_b, lse_b


# -- sparse_decode ---------------------------------------------------------------------------------------------------
def _paged(r, seq_lens: list[int], block: int, d: int, gen: torch.Generator, writer: str | None = None):
    """A paged cache for requests of ``seq_lens``: block table over a shuffled pool that skips the first and last
    blocks (kept NaN), and the cache itself (finite values everywhere; with a ``writer``, the values its fp8 bytes
    hold, :func:`~mlaspec.conformance.ops.writers.written`; callers NaN the unused slots)."""
    need = [-(-s // block) for s in seq_lens]
    num_blocks = sum(need) + 3
    pool = 1 + torch.randperm(num_blocks - 2, generator=gen)
    table = torch.full((len(seq_lens), max(need + [1])), -1, dtype=torch.int64)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = pool[at : at + n]
        at += n
    cache = r(num_blocks, block, d)
    return table, cache if writer is None else written(cache, writer)


def cache_writer(params: dict) -> str | None:
    """The writer of a sparse decode case's fp8 cache: ``params["writer"]`` (:data:`~mlaspec.conformance.ops.
    writers.WRITERS`), ``"flashmla"`` for a case flagged ``fp8_cache`` alone, None for a cache in the case dtype.
    A case with a writer is one a kernel that reads only fp8 caches can be handed (FlashMLA's sparse decode)."""
    writer = params.get("writer")
    return writer if writer is not None else ("flashmla" if params.get("fp8_cache") else None)


def _v32_decode_indices(seq_lens, s_q, k, table, block, gen, *, short, empty):
    """Per request ``b`` and query ``j`` (context ``L_b - s_q + j + 1``): ``min(K, context)`` distinct positions, -1
    padded, mapped to global slots; ``topk_length [B]`` is ``K`` or (``short``) shorter, 0 for ``empty`` requests."""
    b_ = len(seq_lens)
    local = torch.full((b_ * s_q, k), -1, dtype=torch.int64)
    for b, L in enumerate(seq_lens):
        for j in range(s_q):
            ctx = L - s_q + j + 1
            n = min(k, ctx)
            local[b * s_q + j, :n] = torch.randperm(ctx, generator=gen)[:n]
    slots = global_slot_indices(local, torch.arange(b_).repeat_interleave(s_q), table, block).long()
    lengths = torch.full((b_,), k, dtype=torch.int64)
    if short:
        lengths = torch.randint(1, k + 1, (b_,), generator=gen)
    if empty:
        lengths[b_ - empty :] = 0
    return slots.reshape(b_, s_q, k), lengths


def _used_slots(num_slots: int, indices: torch.Tensor) -> torch.Tensor:
    used = torch.zeros(num_slots, dtype=torch.bool)
    named = indices[indices >= 0]
    used[named.long()] = True
    return used


def _decode_inputs(c: Case) -> dict:
    p, r = c.params, randn(c)
    gen = torch.Generator().manual_seed(c.seed + 1)
    h_q, d, dv, block = p["H_q"], p["D_qk"], p["D_v"], p["P"]
    b_, s_q = p["B"], p["S_q"]
    seq_lens = [int(x) for x in torch.randint(p["S_kv"] // 2, p["S_kv"] + 1, (b_,), generator=gen)]
    seq_lens[0] = p["S_kv"]
    if p.get("layer") is None:  # V3.2: the indexer's top-k per query
        k = p["K"]
        if p.get("short_request"):
            seq_lens[-1] = max(s_q, k // 3)  # fewer tokens than K: -1 padding
        table, cache = _paged(r, seq_lens, block, d, gen, cache_writer(p))
        idx, lengths = _v32_decode_indices(
            seq_lens, s_q, k, table, block, gen, short=p.get("topk_length", False), empty=p.get("empty", 0)
        )
        if p.get("short_request"):
            lengths[-1] = k  # its -1 padding lies inside topk_length: only the -1 itself marks it invalid
        flat = cache.reshape(-1, d)
        cache = _hostile(flat, _used_slots(flat.shape[0], idx)).reshape(cache.shape)
        return dict(
            q=r(b_, s_q, h_q, d, scale=2.0),
            kv_cache=cache,
            indices=idx.to(torch.int32),
            scale=_scale(p, d),
            d_v=dv,
            topk_length=lengths.to(torch.int32),
            attn_sink=_sink(c, h_q),
            extra_kv_cache=None,
            extra_indices=None,
            extra_topk_length=None,
        )
    # V4: the sliding window as the main cache, one token per row (q [T, 1, H_q, D]); compressed entries as extra
    window, ratio = p["window"], p["layer"]
    qsl = torch.arange(b_ + 1) * s_q
    table, cache = _paged(r, seq_lens, block, d, gen, cache_writer(p))
    swa = swa_indices_and_lens(qsl, torch.tensor(seq_lens), table, window=window, block_size=block)
    t = b_ * s_q
    flat = cache.reshape(-1, d)
    cache = _hostile(flat, _used_slots(flat.shape[0], swa.indices)).reshape(cache.shape)
    n_c = [s // ratio for s in seq_lens]
    cblock = p["P_extra"]
    ctable, ccache = _paged(r, [max(n, 1) for n in n_c], cblock, d, gen, cache_writer(p))
    vis = num_visible_compressed(swa.positions, ratio)  # [T]
    k_e = p["K_extra"]
    token_req = torch.arange(b_).repeat_interleave(s_q)
    if ratio == 128:
        local = c128a_topk_indices(swa.positions, ratio, k_e).long()
    else:
        local = torch.full((t, k_e), -1, dtype=torch.int64)
        for i in range(t):
            n = min(int(vis[i]), k_e)
            local[i, :n] = torch.randperm(int(vis[i]), generator=gen)[:n]
    extra_idx = global_slot_indices(local, token_req, ctable, cblock).long()
    cflat = ccache.reshape(-1, d)
    ccache = _hostile(cflat, _used_slots(cflat.shape[0], extra_idx)).reshape(ccache.shape)
    return dict(
        q=r(t, 1, h_q, d, scale=2.0),
        kv_cache=cache,
        indices=swa.indices.to(torch.int32),
        scale=_scale(p, d),
        d_v=dv,
        topk_length=swa.lens.to(torch.int32),
        attn_sink=_sink(c, h_q),
        extra_kv_cache=ccache,
        extra_indices=extra_idx[:, None].to(torch.int32),
        extra_topk_length=torch.minimum(vis, torch.tensor(k_e)).to(torch.int32),
    )


def _decode_reference(**kw) -> tuple:
    """:func:`~mlaspec.spec.sparse.sparse_decode`, over the caches as a kernel reads them that declares how it
    dequantizes an fp8 cache (``scales_in_bf16``, ``keys_in_query_dtype``: :func:`mlaspec.conformance.numerics.
    key_format`, :func:`~mlaspec.conformance.ops.writers.read_as`); the exact spec otherwise."""
    key_format = numerics.key_format()
    if key_format is not None:
        if key_format == "query":
            key_format = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[kw["q"].dtype]
        for name in ("kv_cache", "extra_kv_cache"):
            if kw[name] is not None:
                kw = {**kw, name: read_as(kw[name], key_format, numerics.scale_format())}
    return tuple(sparse_decode(**kw))


def _decode_rows(kv_cache, indices, lengths, s_q):
    """Flattened rows ``[NB * P, 1, D]``, indices ``[B * S_q, 1, K]`` and their validity (``-1`` and past length)."""
    rows = kv_cache.reshape(-1, 1, kv_cache.shape[-1])
    idx = indices.reshape(-1, 1, indices.shape[-1])
    valid = idx >= 0
    if lengths is not None:
        valid &= torch.arange(idx.shape[-1])[None, None, :] < lengths.repeat_interleave(s_q)[:, None, None]
    return gather_keys(rows, idx, valid), valid


def _decode_bounds(kw, ref, u):
    out, lse = ref
    b_, s_q, h_q, d = kw["q"].shape
    keys, valid = _decode_rows(kw["kv_cache"], kw["indices"], kw["topk_length"], s_q)
    if kw["extra_kv_cache"] is not None:
        ek, ev = _decode_rows(kw["extra_kv_cache"], kw["extra_indices"], kw["extra_topk_length"], s_q)
        keys, valid = torch.cat([keys, ek], dim=1), torch.cat([valid, ev], dim=-1)
    out_b, lse_b, _ = sparse_bounds(
        kw["q"].reshape(b_ * s_q, h_q, d),
        keys,
        valid,
        scale=kw["scale"],
        d_v=kw["d_v"],
        attn_sink=kw["attn_sink"],
        out=out.reshape(b_ * s_q, h_q, -1),
        lse=lse.transpose(1, 2).reshape(b_ * s_q, h_q),
        u=u,
    )
    return out_b.reshape(out.shape), lse_b.reshape(b_, s_q, h_q).transpose(1, 2)


# -- v4_attention ----------------------------------------------------------------------------------------------------
def _v4_inputs(c: Case) -> dict:
    p, r = c.params, randn(c)
    gen = torch.Generator().manual_seed(c.seed + 1)
    s_q, s_kv, h_q, d, window, ratio = (p[x] for x in ("S_q", "S_kv", "H_q", "D_qk", "window", "layer"))
    raw = r(s_kv, d)
    first = max(s_kv - s_q - window + 1, 0)  # the earliest key any query's window reaches
    raw[:first] = math.nan
    compressed = topk = None
    if ratio > 1:
        pos = torch.arange(s_q) + (s_kv - s_q)
        vis = num_visible_compressed(pos, ratio)
        num_c = s_kv // ratio + 1  # one more than written: the group still being filled, never visible
        k = p.get("K", num_c)
        if ratio == 128:
            topk = c128a_topk_indices(pos, ratio, k)
        else:
            topk = torch.full((s_q, k), -1, dtype=torch.int64)
            for i in range(s_q):
                n = min(int(vis[i]), k)
                topk[i, :n] = torch.randperm(int(vis[i]), generator=gen)[:n]
        compressed = r(num_c, d)
        used = torch.zeros(num_c, dtype=torch.bool)
        used[topk[topk >= 0].long()] = True
        compressed = _hostile(compressed, used)
        topk = topk.to(torch.int32)
    return dict(
        q=r(s_q, h_q, d, scale=2.0),
        raw_kv=raw,
        window=window,
        scale=_scale(p, d),
        compressed_kv=compressed,
        compress_ratio=ratio,
        topk_indices=topk,
        attn_sink=_sink(c, h_q),
        d_v=p["D_v"],
    )


def _v4_rows(kw) -> tuple[torch.Tensor, int]:
    """The op's inputs as index rows ``[S_q, 1, K + W]`` into ``cat(compressed_kv, raw_kv)``
    (:func:`~mlaspec.spec.sliding_window.v4_attention_indices`) and the number ``C`` of compressed rows."""
    comp = kw["compressed_kv"]
    num_c = 0 if comp is None else comp.shape[0]
    idx = v4_attention_indices(
        kw["q"].shape[0],
        kw["raw_kv"].shape[0],
        window=kw["window"],
        compress_ratio=kw["compress_ratio"],
        topk_indices=kw["topk_indices"],
        num_compressed=num_c,
    )
    return idx[:, None], num_c


def _v4_bounds(kw, ref, u):
    out, lse = ref
    comp = kw["compressed_kv"]
    rows = kw["raw_kv"] if comp is None else torch.cat([comp, kw["raw_kv"]])
    idx, _ = _v4_rows(kw)
    valid = idx >= 0
    keys = gather_keys(rows[:, None], idx, valid)
    out_b, lse_b, _ = sparse_bounds(
        kw["q"], keys, valid, scale=kw["scale"], d_v=kw["d_v"], attn_sink=kw["attn_sink"], out=out, lse=lse, u=u
    )
    return out_b, lse_b


# -- pictures: the sparse pattern next to the dense causal mask, failing rows outlined --------------------------------
def _slot_mask(idx: torch.Tensor, valid: torch.Tensor, width: int) -> torch.Tensor:
    """``[R, width]`` bool: row ``r`` reads column ``idx[r, t]`` for each valid slot ``t`` (``idx [R, K]``)."""
    mask = torch.zeros(idx.shape[0], width + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(valid, idx.long(), width), True)
    return mask[:, :width]


def _rows_first(got: object, n: int, order: tuple[tuple[int, ...], ...]) -> list:
    """The backend's ``n`` outputs permuted by ``order`` (rows first), None where missing."""
    if isinstance(got, torch.Tensor) and n == 1:
        got = (got,)
    if not isinstance(got, (tuple, list)) or len(got) != n:
        return [None] * n
    return [g.permute(*o) if isinstance(g, torch.Tensor) and g.dim() == len(o) else None for g, o in zip(got, order)]


def _draw(masks: dict, rows: torch.Tensor, title: str, **kw) -> dict:
    from ..viz.masks import draw_mask_failures

    return {"pattern": draw_mask_failures(masks, rows, title=title, **kw)}


def _prefill_picture(kw, got, ref, ratios, *, title=""):
    """The keys each query row reads (indices, sentinels and ``topk_length`` applied, any KV head) next to the
    dense bottom-right causal mask over the same keys."""
    s_q, s_kv = kw["q"].shape[0], kw["kv"].shape[0]
    pattern = indices_to_mask(kw["indices"], s_kv, kw["topk_length"]).any(1)
    g = _rows_first(got, 3, ((0, 1, 2), (0, 1), (0, 1)))
    r = ratios.get("lse")
    rows = worst_rows(
        [
            ("out", g[0], ref[0], ratios.get("out")),
            ("max_logits", g[1], ref[1], ratios.get("max_logits")),
            ("lse", g[2], ref[2], None if r is None else r.T),
        ]
    )
    name = "spec: indices" + (" within topk_length" if kw["topk_length"] is not None else "")
    return _draw({name: pattern, "dense causal (for reference)": causal_mask(s_q, s_kv)}, rows, title)


def _decode_picture(kw, got, ref, ratios, *, title=""):
    """The cache slots each query token reads (``-1`` and ``topk_length`` applied), over the global slots of the
    main cache and, for V4, the extra cache. The block table is not an input, so no dense mask stands beside it."""
    b_, s_q = kw["q"].shape[:2]
    idx = kw["indices"].reshape(b_ * s_q, -1).long()
    valid = idx >= 0
    if kw["topk_length"] is not None:
        valid &= torch.arange(idx.shape[1])[None] < kw["topk_length"].long().repeat_interleave(s_q)[:, None]
    masks = {"spec: main cache slots read": _slot_mask(idx, valid, kw["kv_cache"].shape[0] * kw["kv_cache"].shape[1])}
    if kw["extra_kv_cache"] is not None:
        e = kw["extra_indices"].reshape(b_ * s_q, -1).long()
        ev = e >= 0
        if kw["extra_topk_length"] is not None:
            ev &= torch.arange(e.shape[1])[None] < kw["extra_topk_length"].long().repeat_interleave(s_q)[:, None]
        masks["spec: extra cache slots read"] = _slot_mask(
            e, ev, kw["extra_kv_cache"].shape[0] * kw["extra_kv_cache"].shape[1]
        )
    g = _rows_first(got, 2, ((0, 1, 2, 3), (0, 2, 1)))
    flat = lambda t: None if t is None else t.reshape(b_ * s_q, -1)  # noqa: E731 - [B, S_q, ...] -> [B * S_q, ...]
    r_lse = ratios.get("lse")
    rows = worst_rows(
        [
            ("out", flat(g[0]), flat(ref[0]), flat(ratios.get("out"))),
            ("lse", flat(g[1]), flat(ref[1].transpose(1, 2)), None if r_lse is None else flat(r_lse.transpose(1, 2))),
        ]
    )
    return _draw(masks, rows, title, xlabel="global slot (block * P + offset)", ylabel="query token (b * S_q + i)")


def _v4_picture(kw, got, ref, ratios, *, title=""):
    """The raw keys each query reads (its window) and the compressed entries it selects, next to the dense
    bottom-right causal mask over the raw keys."""
    s_q, s_kv = kw["q"].shape[0], kw["raw_kv"].shape[0]
    idx, num_c = _v4_rows(kw)
    idx = idx[:, 0]
    masks = {
        f"spec: window W={kw['window']} over raw keys": _slot_mask(idx - num_c, idx >= num_c, s_kv),
        "dense causal (for reference)": causal_mask(s_q, s_kv),
    }
    if num_c:
        masks[f"spec: compressed entries (1 per {kw['compress_ratio']})"] = _slot_mask(
            idx, (idx >= 0) & (idx < num_c), num_c
        )
    g = _rows_first(got, 2, ((0, 1, 2), (0, 1)))
    r = ratios.get("lse")
    rows = worst_rows([("out", g[0], ref[0], ratios.get("out")), ("lse", g[1], ref[1], None if r is None else r.T)])
    return _draw(masks, rows, title)


# -- the curated cases (named after the deployments they stand for) and the generated parameters ----------------
def _sparse_prefill_cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    return [
        # sparse MLA prefill (FlashMLA flash_mla_sparse_fwd): V3.2 top-2048 (tiny: 64), invalid sentinels, sinks.
        # Full sizes keep S_q * K * H_q small: the float64 reference materialises the gathered keys per query head.
        (
            "v32-top2048",
            dict(
                S_q=3 if full else 4,
                S_kv=ctx if full else 150,
                H_q=64 if full else 8,
                H_kv=1,
                D_qk=576,
                D_v=512,
                K=2048 if full else 64,
            ),
        ),
        (
            "topk-length-shorter",
            dict(
                S_q=8 if full else 5,
                S_kv=ctx if full else 90,
                H_q=16 if full else 8,
                H_kv=1,
                D_qk=576,
                D_v=512,
                K=2048 if full else 32,
                topk_length=True,
            ),
        ),
        (
            "empty-rows",
            dict(
                S_q=5,
                S_kv=ctx if full else 60,
                H_q=16 if full else 4,
                H_kv=1,
                D_qk=576,
                D_v=512,
                K=2048 if full else 24,
                topk_length=True,
                empty=2,
            ),
        ),
        (
            "sink-finite",
            dict(
                S_q=4,
                S_kv=ctx if full else 60,
                H_q=16 if full else 4,
                H_kv=1,
                D_qk=576,
                D_v=512,
                K=2048 if full else 24,
                sink="finite",
            ),
        ),
        (
            "sink-inf-empty",
            dict(
                S_q=4,
                S_kv=ctx if full else 60,
                H_q=16 if full else 4,
                H_kv=1,
                D_qk=576,
                D_v=512,
                K=2048 if full else 24,
                sink="inf",
                empty=1,
            ),
        ),
        (
            "v4-d512",
            dict(
                S_q=4,
                S_kv=ctx if full else 50,
                H_q=64 if full else 4,
                H_kv=1,
                D_qk=512,
                D_v=512,
                K=640 if full else 24,
                topk_length=True,
                sink="finite",
            ),
        ),
        # Real kernels' code paths, cheap on CPU: 128 heads (two 64-head tiles), top-128 over 300 keys (two 64-key
        # blocks), the model's YaRN scale, no sink.
        (
            "v32-h128-yarn",
            dict(
                S_q=2 if full else 1,
                S_kv=ctx if full else 300,
                H_q=128,
                H_kv=1,
                D_qk=576,
                D_v=512,
                K=2048 if full else 128,
                invalid=0.1,
                topk_length=True,
                scale="yarn",
            ),
        ),
        # top-k wider than the keys (a prefix shorter than 2048): every row ends in -1 padding
        (
            "topk-exceeds-keys",
            dict(S_q=6, S_kv=40, H_q=8, H_kv=1, D_qk=576, D_v=512, K=2048 if full else 64, sink="finite"),
        ),
        # more than 64 query tokens (prefill kernels tile queries by 64) with topk_length shorter than K
        (
            "s72-topk-length",
            dict(
                S_q=72,
                S_kv=ctx if full else 150,
                H_q=64 if full else 1,
                H_kv=1,
                D_qk=576,
                D_v=512,
                K=2048 if full else 64,
                topk_length=True,
                scale="yarn",
            ),
        ),
    ]


@composite
def _sparse_prefill_params(draw) -> dict:
    """FlashMLA's widths (576 / 512, or V4's 512 / 512) and one KV head; ``K <= S_kv - 2`` distinct keys per row
    (rows 0 and ``S_kv - 1`` stay NaN), invalid sentinels at a drawn rate, optional ``topk_length``, empty rows
    and sink."""
    s_kv = draw(st.integers(3, LIMITS["S_kv"]))
    d_qk = draw(st.sampled_from([576, 512]))
    p = dict(
        S_q=draw(st.integers(1, LIMITS["S_q"])),
        S_kv=s_kv,
        H_q=draw(st.integers(1, LIMITS["H_sparse"])),
        H_kv=1,
        D_qk=d_qk,
        D_v=512,
        K=draw(st.integers(1, min(LIMITS["K"], s_kv - 2))),
        invalid=draw(st.sampled_from([0.0, 0.2, 0.5])),
        topk_length=draw(st.booleans()),
        empty=draw(st.integers(0, 2)),
    )
    sink = draw(st.sampled_from([None, "finite", "inf"]))
    if sink is not None:
        p["sink"] = sink
    return p


def _sparse_decode_cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    return [
        # sparse MLA decode over a paged cache (flash_mla_with_kvcache with indices): V3.2 and V4 with extra cache
        (
            "v32-top2048",
            dict(
                B=2,
                S_q=1,
                S_kv=ctx if full else 150,
                H_q=64 if full else 8,
                D_qk=576,
                D_v=512,
                K=2048 if full else 64,
                P=64,
                fp8_cache=True,
            ),
        ),
        (
            "v32-mtp2",
            dict(
                B=3,
                S_q=2,
                S_kv=ctx if full else 100,
                H_q=32 if full else 4,
                D_qk=576,
                D_v=512,
                K=2048 if full else 32,
                P=64,
                short_request=True,
                topk_length=True,
            ),
        ),
        (
            "topk-length-empty",
            dict(
                B=3,
                S_q=1,
                S_kv=ctx if full else 70,
                H_q=16 if full else 4,
                D_qk=576,
                D_v=512,
                K=2048 if full else 24,
                P=64,
                topk_length=True,
                empty=1,
                sink="inf",
            ),
        ),
        (
            "v4-swa-c4a",
            dict(
                B=3,
                S_q=1,
                S_kv=ctx if full else 60,
                H_q=64 if full else 4,
                D_qk=512,
                D_v=512,
                P=64,
                layer=4,
                window=128 if full else 8,
                P_extra=64,
                K_extra=512 if full else 8,
                sink="finite",
                fp8_cache=True,
            ),
        ),
        (
            "v4-c128a-mtp2",
            dict(
                B=2,
                S_q=2,
                S_kv=8192 if full else 300,
                H_q=64 if full else 4,
                D_qk=512,
                D_v=512,
                P=64,
                layer=128,
                window=128 if full else 8,
                P_extra=64,
                K_extra=64 if full else 4,
                sink="finite",
                fp8_cache=True,
            ),
        ),
        # Real kernels' code paths: 3 requests of different lengths (250..500 keys, several 64-key pages each),
        # 128 heads (two 64-head tiles), shorter topk_length per request, YaRN scale, sink.
        (
            "v32-h128-splits",
            dict(
                B=3,
                S_q=1,
                S_kv=ctx if full else 500,
                H_q=128,
                D_qk=576,
                D_v=512,
                K=2048 if full else 64,
                P=64,
                topk_length=True,
                scale="yarn",
                sink="finite",
                fp8_cache=True,
            ),
        ),
        # top-k wider than every request's context (-1 padding), MTP 2, pages of 32 (global slots do not care)
        (
            "topk-exceeds-context-p32",
            dict(
                B=4,
                S_q=2,
                S_kv=1000 if full else 100,
                H_q=64 if full else 8,
                D_qk=576,
                D_v=512,
                K=2048 if full else 128,
                P=32,
                sink="finite",
                scale="yarn",
            ),
        ),
        # The cache as each writer writes it (:mod:`~mlaspec.conformance.ops.writers`): FlashMLA's quantizer, vLLM
        # 0.33's raw amax / 448 scales, vLLM's power-of-two writer (PR #49435). Random groups give scales that are not
        # powers of two (vLLM's 336 / 448 = 0.75 idea), so the raw writer's bytes differ from the others'. FlashMLA's
        # V3.2 path: 64 / 128 heads, no topk_length; 21 query rows (7 requests, MTP 3) for the worst row to show.
        *[
            (
                f"v32-writer-{tag}",
                dict(
                    B=4 if full else 7,
                    S_q=2 if full else 3,
                    S_kv=ctx if full else 120,
                    H_q=128 if full else 64,
                    D_qk=576,
                    D_v=512,
                    K=2048 if full else 64,
                    P=64,
                    fp8_cache=True,
                    writer=writer,
                ),
            )
            for tag, writer in (("flashmla", "flashmla"), ("vllm033", "vllm-0.33"), ("vllm-pow2", "vllm-pow2"))
        ],
    ]


def _v4_attention_cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    return [
        # one DeepSeek V4 layer: sliding window (W = 128, tiny 8) over raw keys, plus compressed entries
        (
            "swaonly",
            dict(
                S_q=1,
                S_kv=ctx + 37 if full else 37,
                H_q=64 if full else 8,
                D_qk=512,
                D_v=512,
                window=128 if full else 8,
                layer=1,
                sink="finite",
            ),
        ),
        (
            "c4a-mtp2",
            dict(
                S_q=2,
                S_kv=ctx + 37 if full else 45,
                H_q=64 if full else 8,
                D_qk=512,
                D_v=512,
                window=128 if full else 8,
                layer=4,
                K=512 if full else 4,
                sink="finite",
            ),
        ),
        (
            "c128a-mtp2",
            dict(
                S_q=2,
                S_kv=ctx if full else 256,
                H_q=64 if full else 8,
                D_qk=512,
                D_v=512,
                window=128 if full else 8,
                layer=128,
                sink="inf",
            ),
        ),
        (
            "prefill-shorter-than-window",
            dict(S_q=5, S_kv=5, H_q=8, D_qk=512, D_v=512, window=128 if full else 8, layer=1),
        ),
        # Real kernels' code paths: V4-Pro's 128 heads (two 64-head tiles) and the real window of 128 (two 64-key
        # blocks) in a c128a layer over 300 keys, no sink
        (
            "c128a-h128-w128",
            dict(S_q=1, S_kv=8192 if full else 300, H_q=128, D_qk=512, D_v=512, window=128, layer=128),
        ),
        # a c4a layer over 600 keys whose top-k (256) is wider than its 150 visible entries (-1 padding), MTP 3
        (
            "c4a-w128-topk-padded",
            dict(
                S_q=3,
                S_kv=ctx + 37 if full else 600,
                H_q=64 if full else 16,
                D_qk=512,
                D_v=512,
                window=128,
                layer=4,
                K=512 if full else 256,
                sink="finite",
            ),
        ),
    ]


OPS = [
    Op(
        "sparse_prefill",
        _prefill_inputs,
        sparse_prefill,
        _prefill_bounds,
        outputs=("out", "max_logits", "lse"),
        heat_map={"max_logits": lambda r: r[..., None], "lse": lambda r: r.T},
        picture=_prefill_picture,
        doc="FlashMLA sparse prefill: -1 / out-of-range indices skipped, topk_length, sink, LSE +inf on empty rows "
        "(spec.sparse.sparse_prefill)",
        cases=_sparse_prefill_cases,
        generator=_sparse_prefill_params,
    ),
    Op(
        "sparse_decode",
        _decode_inputs,
        _decode_reference,
        _decode_bounds,
        picture=_decode_picture,
        doc="FlashMLA sparse decode over a paged cache with global slots, topk_length per request, sink, V4 extra "
        "cache (spec.sparse.sparse_decode)",
        cases=_sparse_decode_cases,
        spec=sparse_decode,
    ),
    Op(
        "v4_attention",
        _v4_inputs,
        v4_attention,
        _v4_bounds,
        heat_map={"lse": lambda r: r.T},
        picture=_v4_picture,
        doc="One DeepSeek V4 layer: window (p - W, p] plus c4a top-k / c128a compressed entries, one softmax "
        "(spec.sliding_window.v4_attention)",
        cases=_v4_attention_cases,
        spec=v4_attention,
    ),
]

__all__ = ["OPS", "cache_writer", "gather_keys", "sparse_bounds"]
