"""``mla_decode_fp8``: the absorbed MLA decode over an fp8 KV cache, as vLLM 0.33 serves ``--kv-cache-dtype fp8``.

What it checks: :func:`~mlaspec.spec.forms.mqa_latent_attention` over the *dequantized* cache, i.e. the kernel
must read the cache records of a layout of :mod:`mlaspec.spec.cache_layouts` and apply their scales; the
quantization itself is not its error (the inputs are chosen so nothing is lost before the kernel runs).

Inputs (``B`` requests, ``S_kv`` cached tokens each):

* ``q [B, S_q, H_q, 576]`` in the case dtype, **fp8-representable**: every element is ``e4m3(x / q_scale) *
  q_scale`` and exact in bf16/fp16. vLLM quantizes the absorbed query to e4m3 with the layer's static per-tensor
  ``_q_scale`` before FlashMLA's fp8 kernel (``vllm/model_executor/layers/attention/mla_attention.py``,
  ``_DecodeConcatQuantFP8``); a backend that does the same loses nothing, one that keeps q in bf16 loses nothing
  either.
* ``kv_cache [B, S_kv, token_bytes]`` uint8: each request's tokens as records of ``layout``, written by the spec
  (:func:`~mlaspec.spec.cache_layouts.quantize`, by the case's ``writer``, :mod:`~mlaspec.conformance.ops.writers`:
  ``vllm-per-tensor`` or ``flashmla``): ``fp8_e4m3_per_tensor`` (576 B, ``e4m3(x / k_scale)``, vLLM's
  ``fp8`` / ``fp8_e4m3`` cache, what the dense FlashMLA fp8 kernel reads) or ``fp8_ds_mla_v32`` (656 B, per-128
  fp32 scales and bf16 RoPE, vLLM's ``fp8_ds_mla``, read by the *sparse* kernels only), its per-128 scales
  **powers of two** (FlashMLA's ``tests/quant.py`` rule, as the sparse ops' caches): FlashMLA's sparse kernel, the
  one reader of this layout in vLLM, rounds ``e4m3 * scale`` to bf16 to feed its MMA
  (``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh``), which loses nothing only when the scale is a power of two.
  With vLLM's raw ``amax / 448`` scales that rounding is the layout's error, not the kernel's, and a budget wide
  enough to hold it would hide a 2% softmax-scale bug at DeepSeek's logit sizes.
* ``k_scale`` (per-tensor layouts), ``q_scale``: floats, neither a power of two (a kernel that drops or swaps a
  descale is off by a factor the budget cannot hide).
* ``seq_lens`` (optional, as ``mla_decode``'s): ``[B]`` int32, request ``b`` reads its first ``seq_lens[b]`` records
  (``0`` allowed), MTP causal aligned to its own end: FlashMLA's ``cache_seqlens``, which vLLM's
  ``flash_mla_with_kvcache_fp8(q, k_cache, block_table, cache_seqlens, ...)`` hands to ``fwd_kvcache_mla_fp8``
  (``vllm/v1/attention/ops/flashmla.py``). What a DCP rank hands its decode (``dcp_decode_fp8``,
  :mod:`~mlaspec.conformance.ops.dcp`): its share's local length per request.

Reference: ``mqa_latent_attention(q, dequantize(kv_cache), d_v, scale, causal, seq_lens)`` in float64.

**Budget.** As :func:`~mlaspec.conformance.ops.common.attention_bounds` (fp32 logits, the softmax weights and the
output rounded to the case dtype): the exact spec. A kernel that declares ``p_in_e4m3``
(:mod:`mlaspec.conformance.numerics`) rounds the softmax weights to **e4m3** rather than the case dtype: an fp8
tensor-core ``p @ v`` needs both operands in fp8 (``run_mha_fwd_splitkv_mla<cutlass::float_e4m3_t,
cutlass::bfloat16_t, 576>`` in vLLM's ``_flashmla_extension_C``; the conversion at vllm-project/FlashMLA
``csrc/extension/sm90/dense_fp8/flash_fwd_mla_kernel.h`` lines 384-385). Rounding ``p`` in ``[0, 1]`` to e4m3 costs
``|δp| <= 2^-4 p`` for normal values and at most ``2^-10`` (half the smallest subnormal) below ``2^-6``, so under that
declaration, per output element::

    |out - ref| <= 2 * (u |ref| + (2^-4 + 2 δs) M + 2^-10 A)       A = Σ_j |v_j| / ℓ,  ℓ = Σ_j exp(s_j - max s)

(``M = Σ_j p_j |v_j|`` as in the dense budget; ``A`` is what flushing every weight by ``2^-10`` could cost, over
the row's sum of weights ``ℓ >= 1``). A kernel that keeps ``p`` in bf16 passes either way.
"""

from __future__ import annotations

import math

import torch

from mlaspec.spec import cache_layouts as cl
from mlaspec.spec.attention import attention, seq_lens_mask
from mlaspec.spec.forms import mqa_latent_attention

from .. import numerics
from ..cases import Case
from .common import DTYPES, Op, Scale, attention_bounds, normal
from .dense import V3_SCALE
from .writers import WRITERS

U_P = 2.0**-4  # e4m3 unit roundoff (3 mantissa bits)
P_FLOOR = 2.0**-10  # half the smallest e4m3 subnormal (2^-9)


def fp8_query(x: torch.Tensor, q_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``e4m3(x / q_scale) * q_scale`` in ``dtype``; ``ValueError`` if that is not exact in ``dtype``."""
    q = cl.round_to_format(x.double() / q_scale, cl.E4M3) * q_scale
    out = q.to(dtype)
    if not torch.equal(out.double(), q):
        raise ValueError(f"q_scale={q_scale} makes e4m3 queries that {dtype} cannot hold exactly")
    return out


def _writer(p: dict, layout: cl.CacheLayout) -> str:
    """The case's cache writer (:mod:`~mlaspec.conformance.ops.writers`): ``p["writer"]``, by default vLLM's
    per-tensor writer for the 576-byte cache and FlashMLA's power-of-two quantizer for the 656-byte one."""
    return p.get("writer", "flashmla" if layout is cl.FP8_DS_MLA_V32 else "vllm-per-tensor")


def fp8_decode_inputs(c: Case) -> dict:
    """``seq_lens`` (a case param, optional): per-request key counts ``[B]`` int32 (FlashMLA's ``cache_seqlens``), as
    ``mla_decode``'s; the records past a request's length are real records it must not read."""
    p = c.params
    b, s_q, s_kv, h, d, dv = (p[k] for k in ("B", "S_q", "S_kv", "H_q", "D_qk", "D_v"))
    layout = cl.LAYOUTS[p["layout"]]
    k_scale = p.get("k_scale") if layout.scale_rule.kind == "per_tensor" else None
    g = torch.Generator().manual_seed(c.seed)
    x = normal(b * s_kv, d, generator=g)
    x *= torch.exp2(torch.randint(-2, 3, (b * s_kv, 1), generator=g).to(torch.float64))  # per-token magnitudes
    raw = WRITERS[_writer(p, layout)](x, k_scale)
    if raw.shape[-1] != layout.token_bytes:
        raise ValueError(f"writer {p['writer']!r} does not write the {layout.name} layout")
    raw = raw.reshape(b, s_kv, layout.token_bytes)
    q = fp8_query(normal(b, s_q, h, d, generator=g) * 3.0, p["q_scale"], DTYPES[c.dtype])
    kw = dict(
        q=q,
        kv_cache=raw,
        layout=layout.name,
        k_scale=k_scale,
        q_scale=p["q_scale"],
        d_v=dv,
        scale=p.get("scale", 192**-0.5),
        causal=p["causal"],
    )
    if "seq_lens" in p:
        kw["seq_lens"] = torch.tensor(p["seq_lens"], dtype=torch.int32)
    return kw


def dequantized_entries(kv_cache: torch.Tensor, layout: str, k_scale: float | None) -> torch.Tensor:
    """``[B, S_kv, token_bytes]`` uint8 records -> ``[B, S_kv, 576]`` float64 entries (the spec's decoder)."""
    b, s = kv_cache.shape[:2]
    flat = kv_cache.reshape(b * s, -1)
    return cl.dequantize(flat, layout, scale=k_scale).entries.reshape(b, s, -1)


def mla_decode_fp8_reference(
    q, kv_cache, *, layout, k_scale, q_scale, d_v, scale, causal=False, seq_lens=None
) -> tuple:
    """Spec attention over the dequantized cache (``q_scale`` only tells a kernel how q was quantized)."""
    kv = dequantized_entries(kv_cache, layout, k_scale)
    return tuple(mqa_latent_attention(q.double(), kv, d_v=d_v, scale=scale, causal=causal, seq_lens=seq_lens))


def latent_bounds(q, kv, *, d_v, scale, mask, ref, u) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and LSE budgets of MQA over cache entries (module docstring): those of
    :func:`~.common.attention_bounds`, with e4m3 softmax weights where ``p_in_e4m3`` is declared.

    ``q [B, S_q, H_q, D_qk]``, ``kv [B, S_kv, D_qk]`` float64 entries, ``mask [B, S_q, S_kv]`` bool (the keys each
    query reads), ``ref = (out, lse)`` the spec's; returns ``out``'s ``[B, S_q, H_q, d_v]`` and ``lse``'s ``[B, H_q,
    S_q]`` budgets."""
    q, k = q.double(), kv[:, :, None]
    v = k[..., :d_v]
    out_b, lse_b = attention_bounds(q, k, v, scale=scale, causal=False, mask=mask, ref=ref, u=u)
    if numerics.p_format() != "e4m3":  # the exact spec: p rounded to the case dtype, already in attention_bounds
        return out_b, lse_b
    m = attention(q, k, v.abs(), scale=scale, mask=mask).out  # [B, S_q, H, D_v]
    s = (torch.einsum("bqhd,bkd->bhqk", q, kv) * scale).masked_fill(~mask[:, None], -math.inf)
    ell = torch.exp(s - s.amax(-1, keepdim=True)).nan_to_num(0.0).sum(-1).clamp_min(1.0)  # [B, H, S_q]
    total_v = torch.einsum("bqk,bkd->bqd", mask.double(), v[:, :, 0].abs())  # [B, S_q, D_v]
    a = total_v[:, :, None] / ell.transpose(1, 2)[..., None]  # [B, S_q, H, D_v]
    return out_b + 2 * (U_P * m + P_FLOOR * a), lse_b


def read_keys(kw: dict) -> torch.Tensor:
    """The keys each query of the op's arguments reads, ``[B, S_q, S_kv]`` bool: ``seq_lens`` (default ``S_kv`` for
    every request) and ``causal`` (:func:`~mlaspec.spec.attention.seq_lens_mask`)."""
    b, s_kv = kw["kv_cache"].shape[:2]
    lens = kw.get("seq_lens")
    lens = torch.full((b,), s_kv, dtype=torch.int32) if lens is None else lens
    return seq_lens_mask(lens, kw["q"].shape[1], s_kv, causal=kw["causal"])


def _bounds(kw, ref, u):
    kv = dequantized_entries(kw["kv_cache"], kw["layout"], kw["k_scale"])
    return latent_bounds(kw["q"], kv, d_v=kw["d_v"], scale=kw["scale"], mask=read_keys(kw), ref=ref, u=u)


# -- the curated cases (named after the deployments they stand for) and the generated parameters ----------------
def _mla_decode_fp8_cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    return [
        # absorbed decode over an fp8 cache: vLLM's per-tensor e4m3 cache (FlashMLA's dense fp8 kernel), and the
        # 656-byte fp8_ds_mla records (sparse kernels only); q e4m3-representable, scales not powers of two
        (
            "v3-tp8-per-tensor",
            dict(
                B=4 if full else 2,
                S_q=1,
                S_kv=ctx,
                H_q=16,
                D_qk=576,
                D_v=512,
                causal=True,
                layout="fp8_e4m3_per_tensor",
                k_scale=0.046875,
                q_scale=0.15625,
            ),
        ),
        (
            "v3-tp1-per-tensor",
            dict(
                B=2,
                S_q=1,
                S_kv=ctx,
                H_q=128 if full else 32,
                D_qk=576,
                D_v=512,
                causal=True,
                layout="fp8_e4m3_per_tensor",
                k_scale=0.046875,
                q_scale=0.15625,
            ),
        ),
        (
            "mtp2-per-tensor",
            dict(
                B=2,
                S_q=2,
                S_kv=ctx,
                H_q=16,
                D_qk=576,
                D_v=512,
                causal=True,
                layout="fp8_e4m3_per_tensor",
                k_scale=0.046875,
                q_scale=0.15625,
            ),
        ),
        # two 64-head tiles over 13 64-key blocks (split-KV pieces), the model's YaRN scale
        (
            "v3-tp1-per-tensor-yarn-long-context",
            dict(
                B=2,
                S_q=1,
                S_kv=max(ctx, 800),
                H_q=128,
                D_qk=576,
                D_v=512,
                causal=True,
                layout="fp8_e4m3_per_tensor",
                k_scale=0.046875,
                q_scale=0.15625,
                scale=V3_SCALE,
            ),
        ),
        # vLLM's per-tensor writer with the k_scale a layer has without calibrated scales (1.0): e4m3(x) itself
        (
            "v3-writer-vllm-per-tensor-kscale1",
            dict(
                B=2,
                S_q=1,
                S_kv=ctx,
                H_q=16,
                D_qk=576,
                D_v=512,
                causal=True,
                layout="fp8_e4m3_per_tensor",
                writer="vllm-per-tensor",
                k_scale=1.0,
                q_scale=0.15625,
            ),
        ),
        (
            "v32-656-dense",
            dict(
                B=2, S_q=1, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True, layout="fp8_ds_mla_v32", q_scale=0.15625
            ),
        ),
        # per-request lengths (FlashMLA's cache_seqlens), an empty request, two 64-head tiles, the model's YaRN scale
        (
            "v3-tp1-per-tensor-ragged-yarn",
            dict(
                B=4,
                S_q=1,
                S_kv=4096 if full else 300,
                seq_lens=[4096, 0, 1000, 3001] if full else [300, 0, 77, 193],
                H_q=128,
                D_qk=576,
                D_v=512,
                causal=True,
                layout="fp8_e4m3_per_tensor",
                k_scale=0.046875,
                q_scale=0.15625,
                scale=V3_SCALE,
            ),
        ),
        # MTP over 13 64-key blocks, a request shorter than its queries (its row 0 reads no key)
        (
            "mtp2-per-tensor-ragged",
            dict(
                B=3,
                S_q=2,
                S_kv=max(ctx, 800),
                seq_lens=[max(ctx, 800), 1, 650],
                H_q=16,
                D_qk=576,
                D_v=512,
                causal=True,
                layout="fp8_e4m3_per_tensor",
                k_scale=0.046875,
                q_scale=0.15625,
                scale=V3_SCALE,
            ),
        ),
        (
            "v32-656-dense-ragged",
            dict(
                B=3,
                S_q=1,
                S_kv=ctx,
                seq_lens=[ctx, 0, ctx // 2],
                H_q=16,
                D_qk=576,
                D_v=512,
                causal=True,
                layout="fp8_ds_mla_v32",
                q_scale=0.15625,
            ),
        ),
    ]


OPS = [
    Op(
        "mla_decode_fp8",
        fp8_decode_inputs,
        mla_decode_fp8_reference,
        _bounds,
        doc="Absorbed-form MQA over an fp8 KV cache (per-tensor e4m3 576 B, or 656 B fp8_ds_mla), judged against "
        "spec attention over the dequantized cache; p in e4m3 where declared (spec.forms.mqa_latent_attention)",
        cases=_mla_decode_fp8_cases,
        spec=mqa_latent_attention,
    ),
]
