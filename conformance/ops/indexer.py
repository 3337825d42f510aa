"""Indexer ops: DeepSeek V3.2's lightning-indexer logits (ragged prefill and paged decode) and the top-k over them.

* ``indexer_logits`` checks :func:`mlaspec.spec.indexer.indexer_logits` (DeepGEMM ``fp8_mqa_logits``): the backend
  gets ``q`` and ``k`` already fp8 e4m3 (quantized by the spec's own quantizers, ue8m0 scales), the folded
  ``weights [M, H]`` fp32, the per-key ``k_scale [N]`` fp32 and the ragged spans ``ks, ke [M]``, and returns
  ``logits [M, N]`` in **absolute** columns with ``-inf`` outside each row's span;
* ``paged_indexer_logits`` checks :func:`mlaspec.spec.indexer.paged_indexer_logits` (DeepGEMM
  ``fp8_paged_mqa_logits``) over the byte-level paged cache ``uint8 [NB, P, D + 4]`` (a block is ``P * D``
  fp8 values, then ``P`` fp32 scales), with 1-D or 2-D (MTP, vLLM 0.33) ``context_lens``;
* ``topk_indices`` checks :func:`mlaspec.spec.topk.topk_indices` (vLLM ``top_k_per_row_prefill`` /
  ``top_k_per_row_decode``) with a tie-aware comparison (:func:`mlaspec.spec.topk.topk_agreement`): any valid choice
  among logits tied at the ``K``-th value passes, in any order; ``-1`` padding must be trailing; the backend may
  return the indices tensor alone or a tuple whose first item is it.

**Budget derivation (logits).** The reference computes in float64 from the *same* fp8 values and fp32 scales, so
quantization is no error source; what is left is fp32 arithmetic: each head's ``D``-long dot product
(``D ε32 Σ_d |q_hd k_d|``), the ReLU (1-Lipschitz), the weighted sum over ``H`` heads and the two products with
``weights`` and ``k_scale``. With ``S[m, n] = |k_scale[n]| Σ_h |w_mh| Σ_d |q_mhd| |k_nd|``::

    |logits - ref| <= 2 (D + H + 2) ε32 S[m, n]                 (the factor 2 is headroom)

This assumes true fp32 accumulation. Hopper's FP8 tensor-core MMA accumulates with fewer bits (DeepSeek-V3
report, section 3.3.2); DeepGEMM's indexer logits reduce only ``D = 128`` per MMA chain, and a kernel that fails
by a small ratio here should be read with that in mind. ``-inf`` positions (outside ``[ks, ke)``, past a context
length, past the row) are compared exactly.

**Hostile inputs.** Keys outside every span (the tail of the K buffer, unwritten cache slots, block 0 and the last
block of the paged cache) are fp8 NaN with NaN scales; keys get very different magnitudes so their ue8m0 scales
differ (a scale applied to the wrong key shows); some rows start at ``ks > 0`` (a kernel that returns compressed
columns shifts them); one row has an empty span. Top-k logits sit on a coarse grid so ties are everywhere, and
each row long enough has a tie straddling the ``K``-th position; some rows have fewer than ``K`` valid keys,
``-inf`` inside their range, and columns outside ``[row_starts, row_ends)`` hold garbage (``+inf``, ``1e30``),
as DeepGEMM leaves them uninitialised. Every documented form of an argument has a case: ``k_scale``, ``row_ends``
and ``max_context_len`` given and omitted, 1-D and 2-D ``context_lens`` with ``next_n > 1``, top-k indices relative
to ``row_starts`` and absolute with ``row_starts`` given, ``K`` wider than every row, pages of 16, 32 and 64.
"""

from __future__ import annotations

import math

import torch

from mlaspec.spec.indexer import (
    IndexerCacheLayout,
    decode_context_lens_native,
    gather_indexer_k_cache,
    indexer_logits,
    kv_spans_from_batches,
    paged_indexer_logits,
    quantize_indexer_k,
    quantize_indexer_q,
    write_indexer_k_cache,
)
from mlaspec.spec.paged_cache import slot_mapping_from_block_table
from mlaspec.spec.topk import topk_agreement, topk_indices

from ..cases import Case
from ..numerics import accumulation_roundoff
from ..verdict import Metric
from .common import DTYPES, EPS32, LIMITS, Op, Scale, composite, normal, st, worst_rows

FP8_NAN = 0x7F  # e4m3fn NaN bit pattern


def _gen(c: Case, offset: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(c.seed + offset)


def _queries(c: Case, m: int, h: int, d: int, g: torch.Generator):
    """fp8 queries and their folded fp32 weights, from case-dtype queries (what vLLM's fused kernel quantizes)."""
    q = (normal(m, h, d, generator=g) * 2.0).to(DTYPES[c.dtype])
    w = normal(m, h, generator=g).to(DTYPES[c.dtype])
    quant = quantize_indexer_q(q, w)
    return quant.q_fp8, quant.weights.to(torch.float32)


def _keys(c: Case, n: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Case-dtype keys whose magnitudes span ~2^±4, so per-token ue8m0 scales differ."""
    mag = torch.exp2(torch.randint(-4, 5, (n, 1), generator=g).to(torch.float64))
    return (normal(n, d, generator=g) * mag).to(DTYPES[c.dtype])


def logits_bound(q, k, weights, k_scale) -> torch.Tensor:
    """``2 (D u_acc + (H + 2) ε32) |k_scale[n]| Σ_h |w_mh| Σ_d |q_mhd| |k_nd|`` as ``[M, N]`` (NaN keys count as 0);
    ``u_acc`` the dot product's accumulation roundoff, ``ε32`` unless declared otherwise
    (:func:`~mlaspec.conformance.numerics.accumulation_roundoff`)."""
    h, d = q.shape[1], q.shape[2]
    k64 = k.to(torch.float64).nan_to_num(0.0).abs()
    s = torch.einsum("mhd,nd->mhn", q.to(torch.float64).abs(), k64)
    s = torch.einsum("mhn,mh->mn", s, weights.to(torch.float64).abs())
    if k_scale is not None:
        s = s * k_scale.to(torch.float64).nan_to_num(0.0).abs()[None, :]
    return 2 * (d * accumulation_roundoff(EPS32) + (h + 2) * EPS32) * s


def _indexer_reference(q, k, weights, ks, ke, k_scale=None) -> tuple:
    return (indexer_logits(q, k, weights, ks, ke, k_scale),)


def _paged_reference(q, cache, block_table, context_lens, weights, *, max_context_len=None) -> tuple:
    return (paged_indexer_logits(q, cache, block_table, context_lens, weights, max_context_len=max_context_len),)


_LOGITS_MAP = {"logits": lambda r: r[..., None]}  # [M, N] -> heat map [keys, query rows]


# -- indexer_logits ----------------------------------------------------------------------------------------------
def _indexer_inputs(c: Case) -> dict:
    p, g = c.params, _gen(c)
    qlens, slens = p["query_lens"], p["seq_lens"]
    ks, ke = kv_spans_from_batches(torch.tensor([0, *qlens]).cumsum(0), torch.tensor(slens))
    if p.get("empty"):  # a padded query row: empty span, inside the buffer
        ks, ke = torch.cat([ks, torch.tensor([3])]), torch.cat([ke, torch.tensor([3])])
    n = sum(slens) + p.get("tail", 5)  # the tail belongs to no span: NaN
    q, w = _queries(c, ks.numel(), p["H"], p["D"], g)
    k_fp8, k_scale = quantize_indexer_k(_keys(c, n, p["D"], g))
    tail = torch.arange(n) >= sum(slens)
    k_fp8 = k_fp8.view(torch.uint8).masked_fill(tail[:, None], FP8_NAN).view(torch.float8_e4m3fn)
    k_scale = k_scale.masked_fill(tail, math.nan)
    if p.get("no_k_scale"):  # the optional scale omitted: the keys' fp8 values are the keys
        k_scale = None
    return dict(q=q, k=k_fp8, weights=w, ks=ks.to(torch.int32), ke=ke.to(torch.int32), k_scale=k_scale)


def _indexer_bounds(kw, ref, u):
    return (logits_bound(kw["q"], kw["k"], kw["weights"], kw["k_scale"]),)


# -- paged_indexer_logits ------------------------------------------------------------------------------------------
def _paged_inputs(c: Case) -> dict:
    p, g = c.params, _gen(c)
    b_, next_n, block, h, d = p["B"], p["next_n"], p["P"], p["H"], p["D"]
    seq_lens = torch.randint(next_n, p["S_kv"] + 1, (b_,), generator=g)
    seq_lens[0] = p["S_kv"]
    if p.get("padded"):
        seq_lens[-1] = 0  # a CUDA-graph padding request
    need = [-(-int(s) // block) for s in seq_lens]
    num_blocks = sum(need) + 2
    pool = 1 + torch.randperm(num_blocks - 2, generator=g)  # blocks 0 and num_blocks - 1 stay NaN (0xFF)
    table = torch.zeros(b_, max(need) + 1, dtype=torch.int64)  # unused entries name block 0
    at = 0
    for b, k in enumerate(need):
        table[b, :k] = pool[at : at + k]
        at += k
    pos = torch.cat([torch.arange(int(s)) for s in seq_lens])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), seq_lens.cumsum(0)])
    slots = slot_mapping_from_block_table(table, block, qsl, pos).slot_mapping  # every token of every request
    cache = write_indexer_k_cache(IndexerCacheLayout(block, d).empty(num_blocks), _keys(c, slots.numel(), d, g), slots)
    q, w = _queries(c, b_ * next_n, h, d, g)
    if p.get("lens_2d", next_n > 1):
        context_lens = decode_context_lens_native(seq_lens, next_n)
    else:
        context_lens = seq_lens
    longest = int(seq_lens.max())
    return dict(
        q=q.reshape(b_, next_n, h, d),
        cache=cache,
        block_table=table.to(torch.int32),
        context_lens=context_lens.to(torch.int32),
        weights=w,
        max_context_len=None if p.get("no_width") else longest + p.get("extra_cols", 3),
    )


def _paged_bounds(kw, ref, u):
    q, table, lens2 = kw["q"], kw["block_table"].long(), kw["context_lens"].long()
    b_, next_n, h, d = q.shape
    lens = lens2 if lens2.dim() == 2 else decode_context_lens_native(lens2, next_n)
    keys = gather_indexer_k_cache(kw["cache"], table, lens.amax(1))  # each request's keys, through its block table
    bound = torch.zeros(ref[0].shape, dtype=torch.float64)
    for b in range(b_):
        lo, hi = int(keys.cu_seq_lens[b]), int(keys.cu_seq_lens[b + 1])
        if hi == lo:
            continue
        rows = slice(b * next_n, (b + 1) * next_n)
        bound[rows, : hi - lo] = logits_bound(q[b], keys.k_fp8[lo:hi], kw["weights"][rows], keys.k_scale[lo:hi])
    return (bound,)


# -- topk_indices ----------------------------------------------------------------------------------------------------
def _topk_inputs(c: Case) -> dict:
    p, g = c.params, _gen(c)
    k = p["K"]
    if p["mode"] == "prefill":  # ragged spans; relative indices as top_k_per_row_prefill writes them, or absolute
        qlens, slens = p["query_lens"], p["seq_lens"]
        starts, ends = kv_spans_from_batches(torch.tensor([0, *qlens]).cumsum(0), torch.tensor(slens))
        m, n = starts.numel(), sum(slens) + 2
    else:  # decode rows: [0, context length)
        m, n = p["M"], p["N"]
        starts, ends = None, torch.randint(1, n + 1, (m,), generator=g)
        ends[: m // 3] = torch.randint(1, k, (m // 3,), generator=g)  # short rows: fewer than K keys
        if p.get("no_row_ends"):  # the optional row_ends omitted: every column is the row's
            ends = torch.full((m,), n)
    logits = torch.round(normal(m, n, generator=g) * 3.0) / 2.0  # a coarse grid: ties
    logits = logits.masked_fill(torch.rand(m, n, generator=g) < 0.05, -math.inf)  # masked keys inside a range
    lo = torch.zeros(m, dtype=torch.int64) if starts is None else starts
    cols = torch.arange(n)[None, :]
    inside = (cols >= lo[:, None]) & (cols < ends[:, None])
    for row in range(m):  # a tie straddling the K-th position, wherever a row has more than K valid keys
        vals = torch.where(inside[row], logits[row], -math.inf)
        order = torch.sort(vals, descending=True, stable=True).indices
        if int((vals > -math.inf).sum()) > k:
            logits[row, order[k]] = logits[row, order[k - 1]]
    garbage = torch.where(torch.rand(m, n, generator=g) < 0.5, math.inf, 1e30).to(torch.float64)
    logits = torch.where(inside, logits, garbage)  # uninitialised columns: never read
    return dict(
        logits=logits.to(torch.float32),
        k=k,
        row_starts=None if starts is None else starts.to(torch.int32),
        row_ends=None if p.get("no_row_ends") else ends.to(torch.int32),
        relative=p["mode"] == "prefill" and p.get("relative", True),
    )


def _topk_reference(logits, k, *, row_starts=None, row_ends=None, relative=False) -> tuple:
    return (topk_indices(logits, k, row_starts=row_starts, row_ends=row_ends, relative=relative).indices,)


def _topk_compare(kw, got, ref):
    """Tie-aware: :func:`mlaspec.spec.topk.topk_agreement` on the logits the backend got (fp32, read exactly)."""
    if isinstance(got, (tuple, list)) and got:
        got = got[0]
    if not isinstance(got, torch.Tensor):
        return "error", f"indices: expected a tensor, got {type(got).__name__}", [], {}, {}
    if tuple(got.shape) != tuple(ref[0].shape):
        return "error", f"indices: shape {list(got.shape)}, spec {list(ref[0].shape)}", [], {}, {}
    if got.dtype.is_floating_point or got.dtype == torch.bool:
        return "error", f"indices: dtype {got.dtype} is not an integer type", [], {}, {}
    a = topk_agreement(
        got.detach().cpu(),
        kw["logits"].to(torch.float64),
        kw["k"],
        row_starts=kw["row_starts"],
        row_ends=kw["row_ends"],
        relative=kw["relative"],
    )
    metrics = [Metric("indices", "bad_rows", float(len(a.bad_rows)), 0.0)]
    if a.ok:
        return "pass", "", metrics, {}, {}
    row = a.worst_row
    worst = {
        "indices": dict(index=[row], got=str(got[row].tolist()[:8]), spec=str(ref[0][row].tolist()[:8]), bound=0.0)
    }
    reason = f"indices: {len(a.bad_rows)} of {got.shape[0]} rows are not a valid top-k; {a.reason}"
    return "fail", reason, metrics, worst, {}


# -- pictures: logits heat maps with the top-k circled, the spec's next to the backend's ------------------------------
PICTURE_K = 4  # the logits ops have no K: the pictures circle each row's top 4, what a top-k downstream would see


def _top(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's ``k`` largest columns ``[M, k]``, ``-1`` where fewer than ``k`` exceed ``-inf`` (NaN: ``-inf``)."""
    x = logits.detach().to("cpu", torch.float64).nan_to_num(nan=-math.inf)
    v, i = x.topk(min(k, x.shape[1]), dim=1)
    return torch.where(v > -math.inf, i, -1)


def _logits_picture(kw, got, ref, ratios, *, title=""):
    """The spec's logits and the backend's, each with its own top-4 per row circled, failing rows marked."""
    from ..viz.indexer import draw_indexer_comparison

    g = got[0] if isinstance(got, (tuple, list)) and len(got) == 1 else got
    if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(ref[0].shape):
        return {}
    r = ratios.get("logits")
    rows = worst_rows([("logits", g, ref[0], None if r is None else r[..., 0])])
    failing = [int(i) for i in torch.nonzero(~(rows <= 1.0)).flatten()]
    fig = draw_indexer_comparison(
        ref[0],
        g.detach().cpu().double(),
        _top(ref[0], PICTURE_K),
        _top(g, PICTURE_K),
        failing_rows=failing,
        titles=(f"spec logits, top-{PICTURE_K} circled", f"backend logits, top-{PICTURE_K} circled"),
        title=title,
    )
    return {"logits": fig}


def _topk_picture(kw, got, ref, ratios, *, title=""):
    """The logits the backend got (columns outside each row's range grey), the spec's top-k (one valid choice among
    ties) next to the backend's, rows that are not a valid top-k marked."""
    from ..viz.indexer import draw_indexer_comparison

    g = got[0] if isinstance(got, (tuple, list)) and got else got
    if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(ref[0].shape):
        return {}
    logits = kw["logits"].to(torch.float64)
    m, n = logits.shape
    lo = torch.zeros(m, dtype=torch.int64) if kw["row_starts"] is None else kw["row_starts"].long()
    cols = torch.arange(n)[None, :]
    hi = torch.full((m,), n) if kw["row_ends"] is None else kw["row_ends"].long()
    shown = torch.where((cols >= lo[:, None]) & (cols < hi[:, None]), logits, -math.inf)
    a = topk_agreement(
        g.detach().cpu(), logits, kw["k"], row_starts=kw["row_starts"], row_ends=kw["row_ends"], relative=kw["relative"]
    )
    starts = kw["row_starts"] if kw["relative"] else None
    fig = draw_indexer_comparison(
        shown,
        shown,
        ref[0],
        g.detach().cpu().long(),
        row_starts=starts,
        failing_rows=list(a.bad_rows),
        titles=(f"spec top-{kw['k']} (one valid choice)", f"backend top-{kw['k']}"),
        title=title,
    )
    return {"topk": fig}


# -- the curated cases (named after the deployments they stand for) and the generated parameters ----------------
def _indexer_logits_cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    return [
        # lightning indexer (DeepGEMM fp8_mqa_logits / fp8_paged_mqa_logits) and the top-k over its logits
        (
            "v32-prefill-ragged",
            dict(
                H=64 if full else 8,
                D=128,
                query_lens=[64, 16, 7] if full else [3, 1, 4],
                seq_lens=[2048, 300, 7] if full else [5, 9, 4],
                empty=True,
            ),
        ),
        (
            "one-request",
            dict(H=64 if full else 8, D=128, query_lens=[32 if full else 6], seq_lens=[ctx if full else 40]),
        ),
        # Real kernels' code paths: 4 requests, spans of 40..700 keys (several 256-key DeepGEMM blocks) starting
        # far past 0, 24 query rows
        (
            "long-ragged",
            dict(H=64 if full else 16, D=128, query_lens=[8, 6, 7, 3], seq_lens=[500, 150, 700, 40], empty=True),
        ),
        # the optional k_scale omitted (the keys' fp8 values are the keys)
        ("no-k-scale", dict(H=64 if full else 8, D=128, query_lens=[3, 2], seq_lens=[20, 30], no_k_scale=True)),
    ]


def _paged_indexer_logits_cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    return [
        (
            "v32-decode",
            dict(
                B=8 if full else 3, next_n=1, S_kv=ctx if full else 37, P=64 if full else 16, H=64 if full else 8, D=128
            ),
        ),
        (
            "v32-mtp2",
            dict(
                B=4 if full else 3,
                next_n=2,
                S_kv=ctx if full else 37,
                P=64 if full else 16,
                H=64 if full else 8,
                D=128,
                padded=True,
            ),
        ),
        # Real kernels' code paths: 4 requests of up to 400 keys, MTP 3 (2-D context_lens), pages of 32 (DeepGEMM
        # has kernels for 32 and 64)
        (
            "mtp3-long-p32",
            dict(B=4, next_n=3, S_kv=ctx if full else 400, P=32, H=64 if full else 16, D=128, padded=True),
        ),
        # MTP 2 with 1-D context_lens (the last query sees the whole context) and max_context_len omitted
        (
            "mtp2-lens-1d-no-width",
            dict(
                B=4,
                next_n=2,
                S_kv=ctx if full else 100,
                P=64,
                H=64 if full else 8,
                D=128,
                lens_2d=False,
                no_width=True,
            ),
        ),
    ]


def _topk_indices_cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    return [
        (
            "v32-prefill-ties",
            dict(
                mode="prefill",
                K=2048 if full else 16,
                query_lens=[8, 4] if full else [3, 1, 4, 2],
                seq_lens=[4096, 1000] if full else [40, 9, 30, 20],
            ),
        ),
        (
            "v32-decode-ties",
            dict(mode="decode", M=8 if full else 9, N=ctx + 37 if full else 70, K=2048 if full else 16),
        ),
        ("short-rows", dict(mode="decode", M=5, N=10, K=2048 if full else 16)),
        # Real kernels' code paths: prefill spans of 200..900 keys starting far past 0, absolute indices (row starts
        # given, relative=False), 24 rows
        (
            "prefill-absolute-long",
            dict(
                mode="prefill",
                K=2048 if full else 64,
                query_lens=[10, 8, 6],
                seq_lens=[4096, 700, 3000] if full else [600, 200, 900],
                relative=False,
            ),
        ),
        # decode rows of up to 1000 keys, 24 rows
        ("decode-long-rows", dict(mode="decode", M=24, N=ctx if full else 1000, K=2048 if full else 256)),
        # K wider than every row, row_ends omitted (-inf alone marks invalid keys)
        ("k-exceeds-n-no-row-ends", dict(mode="decode", M=21, N=100, K=2048 if full else 256, no_row_ends=True)),
    ]


@composite
def _topk_indices_params(draw) -> dict:
    """Prefill (ragged spans, relative indices) or decode rows (some shorter than ``K``); the case's inputs put
    logits on a coarse grid with a tie straddling the ``K``-th position."""
    k = draw(st.integers(2, LIMITS["K"]))
    if draw(st.booleans()):
        n = draw(st.integers(1, LIMITS["requests"]))
        q = draw(st.lists(st.integers(1, LIMITS["q_len"]), min_size=n, max_size=n))
        extra = draw(st.lists(st.integers(0, LIMITS["N"] - LIMITS["q_len"]), min_size=n, max_size=n))
        return dict(mode="prefill", K=k, query_lens=q, seq_lens=[a + b for a, b in zip(q, extra)])
    return dict(mode="decode", K=k, M=draw(st.integers(1, LIMITS["M"])), N=draw(st.integers(1, LIMITS["N"])))


OPS = [
    Op(
        "indexer_logits",
        _indexer_inputs,
        _indexer_reference,
        _indexer_bounds,
        outputs=("logits",),
        heat_map=_LOGITS_MAP,
        fp8_query=True,
        picture=_logits_picture,
        doc="Lightning-indexer logits over a ragged fp8 K buffer, absolute columns, -inf outside [ks, ke) "
        "(spec.indexer.indexer_logits)",
        cases=_indexer_logits_cases,
        spec=indexer_logits,
    ),
    Op(
        "paged_indexer_logits",
        _paged_inputs,
        _paged_reference,
        _paged_bounds,
        outputs=("logits",),
        heat_map=_LOGITS_MAP,
        fp8_query=True,
        picture=_logits_picture,
        doc="Decode indexer logits read from the paged fp8 cache (values then scales per block), MTP context "
        "lengths (spec.indexer.paged_indexer_logits)",
        cases=_paged_indexer_logits_cases,
        spec=paged_indexer_logits,
    ),
    Op(
        "topk_indices",
        _topk_inputs,
        _topk_reference,
        None,
        outputs=("indices",),
        compare=_topk_compare,
        picture=_topk_picture,
        doc="Top-k per row with -1 padding; any choice among tied logits passes (spec.topk.topk_indices, "
        "judged by spec.topk.topk_agreement)",
        cases=_topk_indices_cases,
        generator=_topk_indices_params,
        spec=topk_indices,
    ),
]

__all__ = ["OPS", "logits_bound"]
