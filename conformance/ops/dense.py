"""Dense ops: attention with LSE, the absorbed decode, the compute-friendly prefill, merge_attn_states."""

from __future__ import annotations

import math

import torch

from mlaspec.spec.attention import attention, causal_mask, seq_lens_mask
from mlaspec.spec.config import MLAConfig, make_weights
from mlaspec.spec.forms import absorbed_inputs, mha_inputs, mla_absorbed, mla_mha, mqa_latent_attention
from mlaspec.spec.merge import merge_attn_states

from ..cases import Case
from .common import (
    DTYPES,
    EPS32,
    LIMITS,
    Op,
    Scale,
    abs_logits_max,
    attention_bounds,
    composite,
    logit_error,
    prefix_lse_match,
    projection_error,
    randn,
    st,
    unit_roundoff,
    worst_rows,
)

#: DeepSeek-V3's softmax scale: ``192^-0.5 * mscale^2`` with YaRN's ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``
#: (factor 40, mscale_all_dim 1.0), ``0.1352`` rather than ``192^-0.5 = 0.0722`` (:attr:`MLAConfig.softmax_scale`).
V3_SCALE = MLAConfig.deepseek_v3().softmax_scale


# -- attention ----------------------------------------------------------------------------------------------------
def _attention_inputs(c: Case) -> dict:
    p, r = c.params, randn(c)
    b, s_q, s_kv, h_q, h_kv, d, dv = (p[k] for k in ("B", "S_q", "S_kv", "H_q", "H_kv", "D_qk", "D_v"))
    return dict(
        q=r(b, s_q, h_q, d, scale=2.0),
        k=r(b, s_kv, h_kv, d),
        v=r(b, s_kv, h_kv, dv),
        scale=p.get("scale", d**-0.5),
        causal=p["causal"],
    )


def _attention_bounds_op(kw, ref, u):
    return attention_bounds(kw["q"], kw["k"], kw["v"], scale=kw["scale"], causal=kw["causal"], ref=ref, u=u)


# -- mla_decode: FlashMLA's dense decode on gathered cache entries -------------------------------------------------
def _decode_inputs(c: Case) -> dict:
    """``seq_lens`` (a case param, optional): per-request key counts ``[B]`` int32, FlashMLA's ``cache_seqlens``;
    ``S_kv`` is then the longest, and the slots past a request's length hold keys it must not read."""
    p, r = c.params, randn(c)
    b, s_q, s_kv, h, d, dv = (p[k] for k in ("B", "S_q", "S_kv", "H_q", "D_qk", "D_v"))
    kw = dict(
        q=r(b, s_q, h, d, scale=3.0), kv=r(b, s_kv, d), d_v=dv, scale=p.get("scale", 192**-0.5), causal=p["causal"]
    )
    if "seq_lens" in p:
        kw["seq_lens"] = torch.tensor(p["seq_lens"], dtype=torch.int32)
    return kw


def _decode_mask(kw) -> tuple[torch.Tensor | None, bool]:
    """``(mask, causal)`` of :func:`~mlaspec.spec.attention.attention` that the decode's arguments stand for."""
    if kw.get("seq_lens") is None:
        return None, kw["causal"]
    return seq_lens_mask(kw["seq_lens"], kw["q"].shape[1], kw["kv"].shape[1], causal=kw["causal"]), False


def _decode_bounds(kw, ref, u):
    k = kw["kv"][:, :, None]
    mask, causal = _decode_mask(kw)
    return attention_bounds(kw["q"], k, k[..., : kw["d_v"]], scale=kw["scale"], causal=causal, mask=mask, ref=ref, u=u)


# -- mla_prefill: the compute-friendly form ----------------------------------------------------------------------
def _prefill_inputs(c: Case) -> dict:
    p, r = c.params, randn(c)
    cfg = MLAConfig.tiny(
        num_heads=p["H_q"],
        kv_lora_rank=p["Lkv"],
        qk_nope_head_dim=p["D_nope"],
        qk_rope_head_dim=p["D_rope"],
        v_head_dim=p["D_v"],
    )
    w = make_weights(cfg, seed=c.seed, dtype=DTYPES[c.dtype])
    b, s_q, s_kv = p["B"], p["S_q"], p["S_kv"]
    return dict(
        q_nope=r(b, s_q, cfg.num_heads, cfg.qk_nope_head_dim, scale=2.0),
        q_pe=r(b, s_q, cfg.num_heads, cfg.qk_rope_head_dim, scale=2.0),
        kv_c=r(b, s_kv, cfg.kv_lora_rank),
        k_pe=r(b, s_kv, cfg.qk_rope_head_dim),
        W_UK=w.W_UK,
        W_UV=w.W_UV,
        scale=p.get("scale", cfg.softmax_scale),
        causal=p["causal"],
    )


def _mha_inputs(kw):
    """The compute-friendly form's ``q, k, v`` (float64) of the op's inputs (:func:`~mlaspec.spec.forms.mha_inputs`)."""
    return mha_inputs(kw["q_nope"], kw["q_pe"], kw["kv_c"], kw["k_pe"], kw["W_UK"], kw["W_UV"])


def _absorbed_inputs(kw):
    """The absorbed query and the cache entries (float64) of the op's inputs
    (:func:`~mlaspec.spec.forms.absorbed_inputs`)."""
    return absorbed_inputs(kw["q_nope"], kw["q_pe"], kw["kv_c"], kw["k_pe"], kw["W_UK"])


def _prefill_bounds(kw, ref, u):
    """A kernel materialises ``k_nope = kv_c W_UK`` and ``v = kv_c W_UV``: ``Lkv``-long dot products accumulated in
    fp32 (``γ_Lkv (|kv_c| @ |W|)``, :func:`~mlaspec.conformance.ops.common.projection_error`), then rounded to the
    case dtype (``u/2`` relative). Both are elementwise perturbations of the keys and values the attention sees: the
    rounding of ``k_nope`` costs the logits at most ``u/2 scale max_j Σ|q||k_j|``, its accumulation error
    ``scale max_j Σ_p |q_nope_p| δk_jp``; the rounding of ``v`` is carried as ``1.5 u`` in place of ``u``, its
    accumulation error as ``Σ_j p_j δv_j`` in the output."""
    kv_c, wuk, wuv = kw["kv_c"].double(), kw["W_UK"].double(), kw["W_UV"].double()
    q, k, v = _mha_inputs(kw)
    rounding = u / 2 * abs_logits_max(q, k, kw["scale"])  # k_nope rounded to the case dtype, in the logits
    accumulation = abs_logits_max(
        q[..., : kw["q_nope"].shape[-1]], projection_error("bsl,lnp->bsnp", kv_c, wuk, u), kw["scale"]
    )
    out_b, lse_b = attention_bounds(
        q,
        k,
        v,
        scale=kw["scale"],
        causal=kw["causal"],
        ref=ref,
        u=1.5 * u,
        extra_logit_err=rounding + accumulation,
        v_err=projection_error("bsl,lnv->bsnv", kv_c, wuv, u),
    )
    return out_b, lse_b


# -- mla_absorbed: the whole decode form (absorb W_UK, MQA over the entries, W_UV) --------------------------------
def _absorbed_bounds(kw, ref, u):
    # vLLM materialises the absorbed query ql_nope and the latent output o_lat in the case dtype (u/2 each), then
    # the W_UV product rounds once more. Those roundings pass through 512-long sums (ql . kv and o_lat @ W_UV), where
    # a worst-case sum of |terms| overstates them ~20x and would let real bugs through (a dropped causal mask moves
    # the output 4%); independent roundings add in quadrature (probabilistic error analysis, Higham & Mary 2019), so
    # those two sums use the root-sum-square with a factor 4 of headroom. The fp32 logit sums stay worst case, and
    # so do the fp32 accumulations of the two projections (D_nope-long q_nope W_UK^T, Lkv-long o_lat W_UV: γ_n |x|.|w|,
    # common.projection_error): at u_w = 2^-24 and Lkv = 512 they add ~10% to bf16 budgets and ~55% to fp16 ones,
    # and they are what an fp32 case's budget is made of.
    wuk, wuv = kw["W_UK"].double(), kw["W_UV"].double()
    q, kv = _absorbed_inputs(kw)  # [B, S_q, H_q, Lkv + D_rope], [B, S_kv, Lkv + D_rope]
    kv = kv[:, :, None]  # [B, S_kv, 1, Lkv + D_rope]
    lkv = kw["kv_c"].shape[-1]
    ql_rss = torch.einsum("bqhd,bkd->bhqk", q[..., :lkv] ** 2, kv[:, :, 0, :lkv] ** 2).sqrt()  # [B, H_q, S_q, S_kv]
    ql_err = 4 * u / 2 * kw["scale"] * (ql_rss.amax(-1) if ql_rss.shape[-1] else ql_rss.sum(-1))
    ql_acc = abs_logits_max(
        projection_error("bsnp,lnp->bsnl", kw["q_nope"].double(), wuk, u), kv[..., :lkv], kw["scale"]
    )
    ds = logit_error(q, kv, kw["scale"]) + ql_err + ql_acc  # [B, H_q, S_q]
    o_lat = attention(q, kv, kv[..., :lkv], scale=kw["scale"], causal=kw["causal"]).out
    m_lat = attention(q, kv, kv[..., :lkv].abs(), scale=kw["scale"], causal=kw["causal"]).out
    err_lat = (u + 2 * ds.transpose(1, 2)[..., None]) * m_lat + u / 2 * o_lat.abs()  # [B, S_q, H_q, Lkv]
    err = 4 * torch.einsum("bsnl,lnv->bsnv", err_lat**2, wuv**2).sqrt()
    acc = projection_error("bsnl,lnv->bsnv", o_lat.abs() + err_lat, wuv, u)  # the backend's o_lat, up to err_lat
    lse_bound = 2 * (ds + kv.shape[1] * EPS32 + EPS32 * ref[1].abs().nan_to_num(0.0, posinf=0.0, neginf=0.0))
    return 2 * (err + acc + u / 2 * ref[0].abs()), lse_bound


# -- merge_attn_states --------------------------------------------------------------------------------------------
def _merge_inputs(c: Case) -> dict:
    p, r = c.params, randn(c)
    t, h, d = p["T"], p["H"], p["D"]
    lse = [r(h, t, scale=4.0).float() + p.get("lse_offset", 0.0) for _ in range(2)]
    g = torch.Generator().manual_seed(c.seed + 1)
    for l in lse:  # empty parts, reported as -inf (FA3) or +inf (FA2, FlashMLA sparse)
        empty = torch.rand(h, t, generator=g) < p.get("empty", 0.0)
        sign = torch.where(torch.rand(h, t, generator=g) < 0.5, math.inf, -math.inf)
        l[empty] = sign[empty]
    outs = [r(t, h, d) for _ in range(2)]
    for o, l in zip(outs, lse):  # an empty part's output is 0, as every attention kernel writes it
        o[~torch.isfinite(l).T] = 0
    return dict(prefix_output=outs[0], prefix_lse=lse[0], suffix_output=outs[1], suffix_lse=lse[1])


def _merge_bounds(kw, ref, u):
    m = merge_attn_states(kw["prefix_output"].abs(), kw["prefix_lse"], kw["suffix_output"].abs(), kw["suffix_lse"])
    out_bound = 2 * (u * ref[0].abs() + 4 * EPS32 * m.out)  # fp32 weights, output rounded to the case dtype
    lse_bound = 2 * EPS32 * (ref[1].abs().nan_to_num(0.0, posinf=0.0, neginf=0.0) + 1)
    return out_bound, lse_bound


# -- pictures: the spec's mask, the key prefix the backend's LSE fits, the failing rows ------------------------------
def _qk(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale q.k`` as ``[B, H_q, S_q, S_kv]`` float64 (``k`` heads repeated for GQA)."""
    g = q.shape[2] // k.shape[2]
    return torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(g, 2)) * scale


def _attention_logits(kw):
    return _qk(kw["q"], kw["k"], kw["scale"])


def _decode_logits(kw):
    return _qk(kw["q"], kw["kv"][:, :, None], kw["scale"])


def _prefill_logits(kw):
    q, k, _ = _mha_inputs(kw)
    return _qk(q, k, kw["scale"])


def _absorbed_logits(kw):
    q, kv = _absorbed_inputs(kw)
    return _qk(q, kv[:, :, None], kw["scale"])


def _mask_picture(logits, bounds):
    """A ``picture`` hook: the spec's mask (bottom-right causal, or none) next to the key prefix each row of the
    backend's LSE is consistent with (:func:`~mlaspec.conformance.ops.common.prefix_lse_match`), failing rows
    outlined, and the worst ``|error| / bound`` per query row (over batches and heads). A case with a single query
    row has no picture: one row lines up with nothing the heat map does not already show; nor has a case with
    per-request ``seq_lens``: its requests have different masks."""

    def picture(kw, got, ref, ratios, *, title=""):
        from ..viz.masks import draw_mask_failures

        out_ref, lse_ref = ref
        s_q = lse_ref.shape[2]
        if s_q < 2 or kw.get("seq_lens") is not None:
            return {}
        s = logits(kw)  # [B, H, S_q, S_kv]
        s_kv = s.shape[-1]
        causal = bool(kw["causal"])
        spec = causal_mask(s_q, s_kv) if causal else torch.ones(s_q, s_kv, dtype=torch.bool)
        g_out, g_lse = got if isinstance(got, (tuple, list)) and len(got) == 2 else (None, None)
        moved = lambda t, d: t.movedim(d, 0) if isinstance(t, torch.Tensor) else t  # noqa: E731 - rows first
        rows = worst_rows(
            [
                ("out", moved(g_out, 1), out_ref.movedim(1, 0), moved(ratios.get("out"), 1)),
                ("lse", moved(g_lse, 2), lse_ref.movedim(2, 0), moved(ratios.get("lse"), 2)),
            ]
        )
        masks = {"spec: bottom-right causal" if causal else "spec: no mask (non-causal)": spec}
        unexplained = {}
        if isinstance(g_lse, torch.Tensor) and tuple(g_lse.shape) == tuple(lse_ref.shape):
            q = next(v for k, v in kw.items() if k in ("q", "q_nope"))
            bound = bounds(kw, ref, unit_roundoff(q.dtype))[1]
            lengths, explained = prefix_lse_match(s, g_lse, bound, spec.sum(1))
            name = "backend: keys [0, n) its LSE fits\n(hatched: no prefix fits)"
            masks[name] = (torch.arange(s_kv)[None, :] < lengths[:, None]) & explained[:, None]
            unexplained[name] = ~explained
        return {"mask": draw_mask_failures(masks, rows, unexplained=unexplained, title=title)}

    return picture


# -- the curated cases (named after the deployments they stand for) and the generated parameters ----------------
def _attention_cases(scale: Scale) -> list[tuple[str, dict]]:
    return [
        # dense attention with LSE: GQA/MQA shapes, causal alignment, empty rows
        ("mha-causal", dict(B=2, S_q=5, S_kv=5, H_q=4, H_kv=4, D_qk=24, D_v=16, causal=True)),
        ("mqa-extend", dict(B=1, S_q=3, S_kv=11, H_q=4, H_kv=1, D_qk=24, D_v=16, causal=True)),
        ("gqa-noncausal", dict(B=2, S_q=4, S_kv=9, H_q=6, H_kv=2, D_qk=8, D_v=8, causal=False)),
        ("more-queries-than-keys", dict(B=1, S_q=6, S_kv=3, H_q=2, H_kv=1, D_qk=8, D_v=4, causal=True)),
        ("empty-context", dict(B=1, S_q=2, S_kv=0, H_q=2, H_kv=1, D_qk=8, D_v=4, causal=False)),
        # two 64-head tiles and 24 64-key blocks (several split-KV pieces), the model's YaRN scale, GQA group 8
        (
            "yarn-128-heads-long-context",
            dict(B=3, S_q=2, S_kv=1500, H_q=128, H_kv=16, D_qk=16, D_v=8, causal=True, scale=V3_SCALE),
        ),
    ]


@composite
def _attention_params(draw) -> dict:
    h_kv = draw(st.integers(1, LIMITS["H_kv"]))
    return dict(
        B=draw(st.integers(1, LIMITS["B"])),
        S_q=draw(st.integers(1, LIMITS["S_q"])),
        S_kv=draw(st.integers(0, LIMITS["S_kv"])),
        H_q=h_kv * draw(st.integers(1, LIMITS["group"])),
        H_kv=h_kv,
        D_qk=draw(st.integers(1, LIMITS["D_qk"])),
        D_v=draw(st.integers(1, LIMITS["D_v"])),
        causal=draw(st.booleans()),
    )


def _mla_decode_cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    return [
        # absorbed decode: DeepSeek-V3 TP1 (128 heads) and TP8 (16 heads), MTP next_n 2 and 4
        ("v3-tp8", dict(B=4 if full else 2, S_q=1, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True)),
        ("v3-tp1", dict(B=2, S_q=1, S_kv=ctx, H_q=128 if full else 32, D_qk=576, D_v=512, causal=True)),
        ("mtp2", dict(B=2, S_q=2, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True)),
        ("mtp4", dict(B=1, S_q=4, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True)),
        ("length-1", dict(B=3, S_q=1, S_kv=1, H_q=16, D_qk=576, D_v=512, causal=True)),
        # per-request lengths (FlashMLA's cache_seqlens), an empty request, two 64-head tiles, the model's YaRN scale
        (
            "v3-tp1-ragged-yarn",
            dict(
                B=4,
                S_q=1,
                S_kv=4096 if full else 300,
                seq_lens=[4096, 0, 1000, 3001] if full else [300, 0, 77, 193],
                H_q=128,
                D_qk=576,
                D_v=512,
                causal=True,
                scale=V3_SCALE,
            ),
        ),
        # MTP over ~30 64-key blocks (several split-KV pieces), a request shorter than its queries (row 0 empty)
        (
            "mtp2-ragged-split-kv",
            dict(
                B=3,
                S_q=2,
                S_kv=max(ctx, 1900),
                seq_lens=[max(ctx, 1900), 1, 650],
                H_q=16,
                D_qk=576,
                D_v=512,
                causal=True,
                scale=V3_SCALE,
            ),
        ),
    ]


@composite
def _mla_decode_params(draw) -> dict:
    return dict(
        B=draw(st.integers(1, LIMITS["B"])),
        S_q=draw(st.integers(1, 4)),
        S_kv=draw(st.integers(1, LIMITS["S_kv"])),
        H_q=draw(st.integers(1, LIMITS["H_decode"])),
        D_qk=576,
        D_v=512,
        causal=draw(st.booleans()),
    )


def _mla_prefill_cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    return [
        # compute-friendly prefill: qk 192 / v 128 per head over a 512 latent
        (
            "v3-tp8-chunk",
            dict(
                B=1,
                S_q=7 if not full else 512,
                S_kv=(7 if not full else 512) + ctx,
                H_q=16,
                Lkv=512,
                D_nope=128,
                D_rope=64,
                D_v=128,
                causal=True,
            ),
        ),
        ("tiny-noncausal", dict(B=2, S_q=5, S_kv=13, H_q=4, Lkv=32, D_nope=16, D_rope=8, D_v=16, causal=False)),
        # two 64-head tiles, a context of 19 64-key blocks after the chunk, the model's YaRN scale
        (
            "yarn-128-heads-long-context",
            dict(B=1, S_q=4, S_kv=1200, H_q=128, Lkv=32, D_nope=16, D_rope=8, D_v=16, causal=True, scale=V3_SCALE),
        ),
    ]


@composite
def _mla_prefill_params(draw) -> dict:
    s_q = draw(st.integers(1, LIMITS["S_q"]))
    return dict(
        B=draw(st.integers(1, 2)),
        S_q=s_q,
        S_kv=s_q + draw(st.integers(0, LIMITS["S_kv"] // 2)),
        H_q=draw(st.integers(1, LIMITS["H"])),
        Lkv=draw(st.integers(1, LIMITS["Lkv"])),
        D_nope=draw(st.integers(1, LIMITS["D_nope"])),
        D_rope=2 * draw(st.integers(1, LIMITS["D_rope"] // 2)),
        D_v=draw(st.integers(1, LIMITS["D_v_mla"])),
        causal=draw(st.booleans()),
    )


def _mla_absorbed_cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    return [
        # the whole absorbed decode form; TP1 has H_q = D_v = 128, so a transposed W_UV still fits its shape
        ("v3-tp8-mtp2", dict(B=2, S_q=2, S_kv=ctx, H_q=16, Lkv=512, D_nope=128, D_rope=64, D_v=128, causal=True)),
        (
            "n-equals-v",
            dict(
                B=1,
                S_q=1,
                S_kv=ctx,
                H_q=128 if full else 16,
                Lkv=512 if full else 64,
                D_nope=128 if full else 16,
                D_rope=64 if full else 8,
                D_v=128 if full else 16,
                causal=True,
            ),
        ),
        # a batch of 3 over 17 64-key blocks, two 64-head tiles, the model's YaRN scale
        (
            "v3-tp1-yarn-long-context",
            dict(B=3, S_q=1, S_kv=1100, H_q=128, Lkv=64, D_nope=16, D_rope=16, D_v=16, causal=True, scale=V3_SCALE),
        ),
    ]


def _merge_attn_states_cases(scale: Scale) -> list[tuple[str, dict]]:
    return [
        # merge_attn_states: vLLM's layouts, some parts empty (±inf)
        ("tp8", dict(T=9, H=16, D=512, empty=0.0)),
        ("empty-parts", dict(T=7, H=4, D=128, empty=0.4)),
        # LSEs far past fp32's exp range (exp overflows past ~88.7, underflows below ~-103): max subtraction needed
        ("lse-far-above-88", dict(T=9, H=128, D=64, empty=0.1, lse_offset=120.0)),
        ("lse-far-below-0", dict(T=5, H=16, D=64, empty=0.0, lse_offset=-120.0)),
    ]


@composite
def _merge_attn_states_params(draw) -> dict:
    return dict(
        T=draw(st.integers(1, LIMITS["T"])),
        H=draw(st.integers(1, LIMITS["H"])),
        D=draw(st.integers(1, LIMITS["D"])),
        empty=draw(st.sampled_from([0.0, 0.3, 1.0])),
    )


OPS = [
    Op(
        "attention",
        _attention_inputs,
        attention,
        _attention_bounds_op,
        picture=_mask_picture(_attention_logits, _attention_bounds_op),
        doc="Attention with natural-log LSE, bottom-right causal (spec.attention.attention)",
        cases=_attention_cases,
        generator=_attention_params,
    ),
    Op(
        "mla_decode",
        _decode_inputs,
        mqa_latent_attention,
        _decode_bounds,
        picture=_mask_picture(_decode_logits, _decode_bounds),
        doc="Absorbed-form MQA over 576-wide entries, v = first 512 (spec.forms.mqa_latent_attention)",
        cases=_mla_decode_cases,
        generator=_mla_decode_params,
    ),
    Op(
        "mla_prefill",
        _prefill_inputs,
        mla_mha,
        _prefill_bounds,
        picture=_mask_picture(_prefill_logits, _prefill_bounds),
        doc="Compute-friendly form: up-project, MHA with qk 192 / v 128 (spec.forms.mla_mha)",
        cases=_mla_prefill_cases,
        generator=_mla_prefill_params,
    ),
    Op(
        "mla_absorbed",
        _prefill_inputs,
        mla_absorbed,
        _absorbed_bounds,
        picture=_mask_picture(_absorbed_logits, _absorbed_bounds),
        doc="The whole decode form: absorb W_UK into q, MQA over the 576-wide entries, W_UV (spec.forms.mla_absorbed)",
        cases=_mla_absorbed_cases,
    ),
    Op(
        "merge_attn_states",
        _merge_inputs,
        merge_attn_states,
        _merge_bounds,
        doc="Two-way LSE merge with vLLM's ±inf rules (spec.merge.merge_attn_states)",
        cases=_merge_attn_states_cases,
        generator=_merge_attn_states_params,
    ),
]
