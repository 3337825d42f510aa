"""``dcp_decode``: decode context parallelism simulated on one device, judged against single-device attention.

A backend's ``dcp_decode`` takes ``mla_decode``'s arguments plus ``world_size`` (``N_cp``) and ``interleave`` (vLLM's
``cp_kv_cache_interleave_size``): it runs its own ``mla_decode`` on each rank's share of the keys
(:func:`mlaspec.conformance.backends.common.dcp_decode_by_ranks`, :func:`mlaspec.spec.dcp.dcp_shard`) and combines
the partials by their LSEs (the spec's :func:`~mlaspec.spec.dcp.dcp_combine`, or the backend's own ``dcp_combine``).
The reference is single-device attention (:func:`~mlaspec.spec.forms.mqa_latent_attention` over all the keys), so
a wrong shard, a wrong local length, an MTP mask aligned to the rank's last key, an LSE in the wrong base or an
empty share read as weight 1 all show.

**Budget** (docs/backends.md, "LSE accounting for DCP"). Rank ``r``'s partial is an ordinary attention over its
share with the output budget ``β_r`` and LSE budget ``δ_r`` of :func:`~.common.attention_bounds`. With the exact
weights ``c_r = exp(lse_r - lse)`` and ``δ = max_r δ_r`` over the ranks with keys, perturbed LSEs move each weight by
a factor in ``[e^-2δ, e^2δ]`` (only their spread counts), so::

    |out - ref| <= e^(2δ) Σ_r c_r β_r + (e^(2δ) - 1) Σ_r c_r |o_r| + 2 u |ref|     (the last: the combine's rounding)
    |lse - ref| <= δ + 2 (N_cp ε32 + ε32 |ref|)                                     (log-sum-exp is 1-Lipschitz)

A backend that declares ``lse_in_query_dtype`` (:mod:`mlaspec.conformance.numerics`) adds each partial LSE's rounding
``u |lse_r|`` to ``δ_r``: how far that precision carries through the combine is then part of the budget.

``dcp_decode_fp8`` is the same over an fp8 cache: ``mla_decode_fp8``'s arguments (vLLM's per-tensor e4m3 records,
``k_scale``, ``q_scale``; :mod:`~mlaspec.conformance.ops.fp8_decode`) plus the group, each rank's share of the records
through the backend's ``mla_decode_fp8`` (:class:`mlaspec.conformance.backends.common.DCPFP8ByRanks`), judged against
single-device attention over the dequantized cache. ``β_r``, ``δ_r`` are ``mla_decode_fp8``'s
(:func:`~mlaspec.conformance.ops.fp8_decode.latent_bounds`) under the numerics the backend declares for
``dcp_decode_fp8`` (FlashMLA: those of its ``mla_decode_fp8``, whose ``fp8_mma_accumulation`` makes ``δ_r`` tens of
nats at DeepSeek's logit sizes, and so ``e^(2δ)`` this budget vacuous: docs/dcp.md).
"""

from __future__ import annotations

import torch

from mlaspec.spec.config import MLAConfig
from mlaspec.spec.dcp import (
    dcp_attention,
    dcp_correction,
    dcp_local_seq_lens,
    dcp_partial_attention,
    dcp_query_prefix_lens,
    dcp_shard,
)
from mlaspec.spec.forms import mqa_latent_attention

from ..cases import Case
from ..numerics import lse_rounded
from .common import EPS32, LIMITS, Op, Scale, composite, randn, st
from .fp8_decode import dequantized_entries, fp8_decode_inputs, latent_bounds, mla_decode_fp8_reference

_V3_SCALE = MLAConfig.deepseek_v3().softmax_scale


def dcp_decode_reference(q, kv, *, d_v, scale, causal, seq_lens, world_size, interleave) -> tuple:
    """Single-device attention over all the keys: what a DCP decode must equal (``world_size`` and ``interleave``
    only say how the backend splits the work)."""
    return tuple(mqa_latent_attention(q, kv, d_v=d_v, scale=scale, causal=causal, seq_lens=seq_lens))


def _inputs(c: Case) -> dict:
    p, r = c.params, randn(c)
    b, s_q, s_kv, h, d, dv = (p[k] for k in ("B", "S_q", "S_kv", "H_q", "D_qk", "D_v"))
    return dict(
        q=r(b, s_q, h, d, scale=3.0),
        kv=r(b, s_kv, d),
        d_v=dv,
        scale=p.get("scale", 192**-0.5),
        causal=p["causal"],
        seq_lens=torch.tensor(p.get("seq_lens", [s_kv] * b), dtype=torch.int32),
        world_size=p["world_size"],
        interleave=p["interleave"],
    )


def _rank_bounds(kw: dict, kv: torch.Tensor, rank: int, u: float) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s exact partial ``(o_r, lse_r)`` and its budgets ``(β_r, δ_r)`` as a decode over its share of
    the entries ``kv [B, S_kv, D_qk]`` float64 (:func:`~.fp8_decode.latent_bounds`: the dense budget, e4m3 weights
    where declared)."""
    n, interleave, seq_lens, q = kw["world_size"], kw["interleave"], kw["seq_lens"], kw["q"].double()
    part = dcp_partial_attention(
        q,
        kv,
        seq_lens,
        world_size=n,
        rank=rank,
        interleave=interleave,
        d_v=kw["d_v"],
        scale=kw["scale"],
        causal=kw["causal"],
    )
    shard = dcp_shard(kv, seq_lens, world_size=n, rank=rank, interleave=interleave)
    prefix = dcp_query_prefix_lens(seq_lens, q.shape[1], causal=kw["causal"])
    visible = dcp_local_seq_lens(prefix, world_size=n, interleave=interleave, rank=rank)
    mask = torch.arange(shard.kv.shape[1])[None, None, :] < visible[..., None]  # [B, S_q, S_loc]
    beta, delta = latent_bounds(q, shard.kv, d_v=kw["d_v"], scale=kw["scale"], mask=mask, ref=tuple(part), u=u)
    return part.out, part.lse, beta, delta


def combined_bounds(kw: dict, kv: torch.Tensor, ref: tuple, u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The combined output's and LSE's budgets from each rank's (module docstring), ``kv [B, S_kv, D_qk]`` the
    entries the ranks share out."""
    parts = [_rank_bounds(kw, kv, r, u) for r in range(kw["world_size"])]
    outs, lses, betas, deltas = (torch.stack(x) for x in zip(*parts))  # [N_cp, ...]
    if lse_rounded():  # a declared LSE in the query dtype (vLLM's Triton decode): each partial's one rounding
        deltas = deltas + u * lses.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    c, _ = dcp_correction(lses)  # [N_cp, B, H_q, S_q]
    delta = torch.where(c > 0, deltas, 0.0).amax(0)  # [B, H_q, S_q]: the ranks with keys
    c_o = c.transpose(2, 3)[..., None]  # [N_cp, B, S_q, H_q, 1]
    grow = torch.exp(2 * delta).transpose(1, 2)[..., None]  # [B, S_q, H_q, 1]
    out_bound = grow * (c_o * betas).sum(0) + (grow - 1) * (c_o * outs.abs()).sum(0) + 2 * u * ref[0].abs()
    lse_ref = ref[1].nan_to_num(0.0, posinf=0.0, neginf=0.0)
    lse_bound = delta + 2 * (kw["world_size"] * EPS32 + EPS32 * lse_ref.abs())
    return out_bound, lse_bound


def dcp_bounds(kw: dict, ref: tuple, u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``dcp_decode``'s budgets: :func:`combined_bounds` over the op's entries ``kv``."""
    return combined_bounds(kw, kw["kv"].double(), ref, u)


def _cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    long = 4096 if full else 300
    v3 = dict(D_qk=576, D_v=512, causal=True)
    cases = []
    for n in (2, 4, 8):
        for interleave in (1, 16, 64):
            cases.append(
                (
                    f"v3-tp8-dcp{n}-i{interleave}",
                    dict(B=2, S_q=1, S_kv=long, H_q=16, world_size=n, interleave=interleave, **v3),
                )
            )
    return cases + [
        # ragged lengths with shares that are empty on some ranks (a request shorter than one interleave run)
        (
            "ragged-empty-shares-dcp8-i64",
            dict(B=4, S_q=1, S_kv=long, seq_lens=[long, 0, 5, 70], H_q=16, world_size=8, interleave=64, **v3),
        ),
        (
            "ragged-empty-shares-dcp4-i16",
            dict(B=3, S_q=1, S_kv=40, seq_lens=[40, 1, 17], H_q=16, world_size=4, interleave=16, **v3),
        ),
        ("length-1-dcp2", dict(B=3, S_q=1, S_kv=1, H_q=16, world_size=2, interleave=1, **v3)),
        (
            "tp1-128-heads-dcp8-i1",
            dict(B=2, S_q=1, S_kv=ctx, H_q=128 if full else 32, world_size=8, interleave=1, **v3),
        ),
        # MTP: each query token's own prefix on every rank (not the rank's last key)
        ("mtp2-dcp4-i1", dict(B=2, S_q=2, S_kv=ctx, H_q=16, world_size=4, interleave=1, **v3)),
        ("mtp4-dcp2-i16", dict(B=1, S_q=4, S_kv=ctx, H_q=16, world_size=2, interleave=16, **v3)),
        (
            "mtp2-ragged-dcp8-i64",
            dict(B=3, S_q=2, S_kv=long, seq_lens=[long, 1, 130], H_q=16, world_size=8, interleave=64, **v3),
        ),
        ("yarn-dcp4-i64", dict(B=2, S_q=1, S_kv=long, H_q=16, world_size=4, interleave=64, scale=_V3_SCALE, **v3)),
        # whole ranks without a key: every request shorter than one round, or than one run of 64
        (
            "short-dcp8-i1-idle-ranks",
            dict(B=2, S_q=1, S_kv=7, seq_lens=[7, 3], H_q=16, world_size=8, interleave=1, **v3),
        ),
        (
            "short-dcp2-i64-idle-rank",
            dict(B=2, S_q=1, S_kv=60, seq_lens=[60, 33], H_q=16, world_size=2, interleave=64, **v3),
        ),
        ("mtp4-dcp8-i1", dict(B=2, S_q=4, S_kv=ctx, H_q=16, world_size=8, interleave=1, **v3)),
        (
            "tp1-128-heads-ragged-dcp4-i16",
            dict(
                B=3,
                S_q=1,
                S_kv=long,
                seq_lens=[long, 16, 47],
                H_q=128 if full else 32,
                world_size=4,
                interleave=16,
                **v3,
            ),
        ),
        (
            "noncausal-dcp2-i1",
            dict(B=2, S_q=2, S_kv=ctx, H_q=16, world_size=2, interleave=1, D_qk=576, D_v=512, causal=False),
        ),
    ]


@composite
def _params(draw) -> dict:
    b, s_kv = draw(st.integers(1, LIMITS["B"])), draw(st.integers(1, LIMITS["S_kv"]))
    return dict(
        B=b,
        S_q=draw(st.integers(1, 3)),
        S_kv=s_kv,
        seq_lens=draw(st.lists(st.integers(0, s_kv), min_size=b, max_size=b)),
        H_q=draw(st.integers(1, LIMITS["H_decode"])),
        D_qk=576,
        D_v=512,
        causal=draw(st.booleans()),
        world_size=draw(st.sampled_from([1, 2, 3, 4, 8])),
        interleave=draw(st.sampled_from([1, 2, 16, 64])),
    )


# -- dcp_decode_fp8: the same over an fp8 cache, each rank's share through the backend's mla_decode_fp8 ------------
def dcp_decode_fp8_reference(
    q, kv_cache, *, layout, k_scale, q_scale, d_v, scale, causal, seq_lens, world_size, interleave
) -> tuple:
    """Single-device attention over the whole dequantized cache (:func:`~.fp8_decode.mla_decode_fp8_reference`)."""
    return mla_decode_fp8_reference(
        q,
        kv_cache,
        layout=layout,
        k_scale=k_scale,
        q_scale=q_scale,
        d_v=d_v,
        scale=scale,
        causal=causal,
        seq_lens=seq_lens,
    )


def _fp8_inputs(c: Case) -> dict:
    """``mla_decode_fp8``'s inputs (:func:`~.fp8_decode.fp8_decode_inputs`: e4m3-representable ``q``, the cache
    records) with ``seq_lens`` always given, plus the group."""
    kw = fp8_decode_inputs(c)
    b, s_kv = kw["kv_cache"].shape[:2]
    kw.setdefault("seq_lens", torch.full((b,), s_kv, dtype=torch.int32))
    return dict(kw, world_size=c.params["world_size"], interleave=c.params["interleave"])


def dcp_fp8_bounds(kw: dict, ref: tuple, u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``dcp_decode_fp8``'s budgets: :func:`combined_bounds` over the dequantized cache, each partial's budget
    ``mla_decode_fp8``'s (e4m3 weights and fp8 accumulation where the backend declares them; a partial LSE's
    declared error then enters ``δ`` and grows the output's budget by ``e^(2δ)``)."""
    return combined_bounds(kw, dequantized_entries(kw["kv_cache"], kw["layout"], kw["k_scale"]), ref, u)


FP8_CACHE = dict(layout="fp8_e4m3_per_tensor", k_scale=0.046875, q_scale=0.15625)
"""The fp8 cache of ``dcp_decode_fp8``'s cases: vLLM's per-tensor e4m3 cache (FlashMLA's dense fp8 kernel), the
scales of ``mla_decode_fp8``'s cases (neither a power of two)."""


def _fp8_cases(scale: Scale) -> list[tuple[str, dict]]:
    return [(name, dict(p, **FP8_CACHE)) for name, p in _cases(scale)]


OPS = [
    Op(
        "dcp_decode",
        _inputs,
        dcp_decode_reference,
        dcp_bounds,
        doc="Decode context parallelism: mla_decode per rank's share, LSE combine, vs single-device (spec.dcp)",
        spec=dcp_attention,
        cases=_cases,
        generator=_params,
    ),
    Op(
        "dcp_decode_fp8",
        _fp8_inputs,
        dcp_decode_fp8_reference,
        dcp_fp8_bounds,
        doc="Decode context parallelism over an fp8 cache: mla_decode_fp8 per rank's share of the records, LSE "
        "combine, vs single-device attention over the dequantized cache (spec.dcp)",
        spec=dcp_attention,
        cases=_fp8_cases,
        generator=lambda: _params().map(lambda p: dict(p, **FP8_CACHE)),
    ),
]
