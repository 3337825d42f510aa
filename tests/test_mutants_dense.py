"""Proof that the harness catches real bugs (dense ops): each mutant is the torch backend with one bug class seen
in real kernels; the harness must fail every mutant on some curated case and pass the unmutated backend."""

import math

import pytest
import torch

from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import Case, curated_cases
from mlaspec.conformance.runner import run_case


def _gqa(q, k):
    return q.shape[2] // k.shape[2]


class WrongScale(TorchBackend):
    """Softmax scale 2% off (e.g. YaRN mscale applied once instead of squared)."""

    def mla_decode(self, q, kv, *, d_v, scale, causal=False):
        return super().mla_decode(q, kv, d_v=d_v, scale=scale * 1.02, causal=causal)


class ScaleFromAbsorbedWidth(TorchBackend):
    """Scale 1/sqrt(576) from the absorbed dot-product width instead of the model's 1/sqrt(192)."""

    def mla_decode(self, q, kv, *, d_v, scale, causal=False):
        return super().mla_decode(q, kv, d_v=d_v, scale=q.shape[-1] ** -0.5, causal=causal)


class Log2Lse(TorchBackend):
    """LSE returned in base 2, as FlashInfer's MLA wrapper does, where natural log is expected."""

    def attention(self, q, k, v, *, scale, causal=False, mask=None):
        out, lse = super().attention(q, k, v, scale=scale, causal=causal)
        return out, lse / math.log(2)


class TopLeftCausal(TorchBackend):
    """Causal mask aligned top-left (query i sees keys <= i): wrong whenever S_q != S_kv."""

    def attention(self, q, k, v, *, scale, causal=False, mask=None):
        if not causal:
            return super().attention(q, k, v, scale=scale)
        g = _gqa(q, k)
        m = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(g, 2)) * scale
        s = s.masked_fill(~m, -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        out = torch.einsum("bhqk,bkhd->bqhd", p, v.float().repeat_interleave(g, 2))
        return out.to(q.dtype), lse


class MtpCausalIgnored(TorchBackend):
    """MTP decode (S_q > 1) run without the causal mask: draft tokens see the tokens after them."""

    def mla_decode(self, q, kv, *, d_v, scale, causal=False):
        return super().mla_decode(q, kv, d_v=d_v, scale=scale, causal=False)


class DroppedRope(TorchBackend):
    """The 64-wide rope part left out of the logits (only the 512 latent dims dotted)."""

    def mla_decode(self, q, kv, *, d_v, scale, causal=False):
        return super().mla_decode(q[..., :d_v], kv[..., :d_v], d_v=d_v, scale=scale, causal=causal)


class RopeAsValue(TorchBackend):
    """V taken as the last 512 dims of the entry (rope included) instead of the first 512."""

    def mla_decode(self, q, kv, *, d_v, scale, causal=False):
        out, lse = super().mla_decode(q, kv.flip(-1), d_v=d_v, scale=scale, causal=causal)
        return out.flip(-1), lse


class TransposedWUV(TorchBackend):
    """W_UV [Lkv, H_q, D_v] read as [Lkv, D_v, H_q]: shape-compatible when H_q == D_v (DeepSeek-V3 at TP1: 128 and
    128)."""

    def mla_absorbed(self, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, *, scale, causal=False):
        return super().mla_absorbed(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV.transpose(1, 2), scale=scale, causal=causal)


class AbsorbedCausalDropped(TorchBackend):
    """The whole absorbed decode form run without its causal mask (MTP draft tokens see their successors)."""

    def mla_absorbed(self, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, *, scale, causal=False):
        return super().mla_absorbed(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, scale=scale, causal=False)


class WrongGqaHeadMapping(TorchBackend):
    """Query head h reads KV head h % H_kv instead of h // (H_q / H_kv)."""

    def attention(self, q, k, v, *, scale, causal=False, mask=None):
        g = _gqa(q, k)
        return super().attention(q, k.repeat(1, 1, g, 1), v.repeat(1, 1, g, 1), scale=scale, causal=causal)


class EmptyRowNaN(TorchBackend):
    """No guard for rows with no key: 0/0 gives NaN output (and the LSE comes back +inf)."""

    def attention(self, q, k, v, *, scale, causal=False, mask=None):
        out, lse = super().attention(q, k, v, scale=scale, causal=causal)
        empty = torch.isneginf(lse).transpose(1, 2)[..., None]
        return torch.where(empty, math.nan, out.float()).to(out.dtype), lse


class MaxInsteadOfLse(TorchBackend):
    """The running max (max_logits) returned where the LSE belongs."""

    def mla_decode(self, q, kv, *, d_v, scale, causal=False):
        out, lse = super().mla_decode(q, kv, d_v=d_v, scale=scale, causal=causal)
        s = torch.einsum("bqhd,bkd->bhqk", q.float(), kv.float()) * scale
        if causal:
            from mlaspec.spec.attention import causal_mask

            s = s.masked_fill(~causal_mask(q.shape[1], kv.shape[1]), -math.inf)
        return out, s.amax(-1)


class MergeWithoutInfGuard(TorchBackend):
    """merge_attn_states without vLLM's ±inf handling: +inf and all-empty rows poison the output."""

    def merge_attn_states(self, prefix_output, prefix_lse, suffix_output, suffix_lse):
        m = torch.maximum(prefix_lse, suffix_lse).float()
        p_w, s_w = torch.exp(prefix_lse - m), torch.exp(suffix_lse - m)
        out = prefix_output * (p_w / (p_w + s_w)).T[..., None] + suffix_output * (s_w / (p_w + s_w)).T[..., None]
        return out.to(prefix_output.dtype), torch.log(p_w + s_w) + m


class MergeSwappedWeights(TorchBackend):
    """Prefix output weighted by the suffix's share and vice versa."""

    def merge_attn_states(self, prefix_output, prefix_lse, suffix_output, suffix_lse):
        out, lse = super().merge_attn_states(suffix_output, prefix_lse, prefix_output, suffix_lse)
        return out, lse


class Raises(TorchBackend):
    """The kernel raises (an illegal memory access surfaces as a RuntimeError)."""

    def attention(self, *a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class LseTransposed(TorchBackend):
    """LSE in [B, S_q, H] instead of FlashMLA's [B, H, S_q]."""

    def attention(self, q, k, v, **kw):
        out, lse = super().attention(q, k, v, **kw)
        return out, lse.transpose(1, 2)


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to TF32 (10 mantissa bits, to nearest even), as fp32 tensor cores read their inputs."""
    b = x.float().contiguous().view(torch.int32)
    return ((b + 0xFFF + ((b >> 13) & 1)) & ~0x1FFF).view(torch.float32)


class Tf32UpProjection(TorchBackend):
    """The up-projection as a TF32 GEMM (``allow_tf32``, or Triton's default ``tl.dot`` precision for fp32 inputs):
    ``kv_c`` and ``W_UK`` / ``W_UV`` read with 10 mantissa bits, ~5e-4 relative each, where fp32 accumulation is
    due. fp16 and bf16 inputs are exact in TF32, so only fp32 cases can tell; the chunked prefill goes through it."""

    def mla_prefill(self, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, *, scale, causal=False):
        return super().mla_prefill(
            q_nope, q_pe, _tf32(kv_c), k_pe, _tf32(W_UK), _tf32(W_UV), scale=scale, causal=causal
        )


class Tf32Absorbed(TorchBackend):
    """The absorbed form's two projections (``q_nope W_UK^T``, ``o_lat W_UV``) as TF32 GEMMs."""

    def mla_absorbed(self, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, *, scale, causal=False):
        ql_nope = torch.einsum("bsnp,lnp->bsnl", _tf32(q_nope), _tf32(W_UK)).to(q_nope.dtype)
        o_lat, lse = self.mla_decode(
            torch.cat([ql_nope, q_pe], -1), torch.cat([kv_c, k_pe], -1), d_v=kv_c.shape[-1], scale=scale, causal=causal
        )
        return torch.einsum("bsnl,lnv->bsnv", _tf32(o_lat), _tf32(W_UV)).to(q_nope.dtype), lse


class UpProjection1e3Off(TorchBackend):
    """``k_nope`` and ``v`` 1e-3 relative too large (a weight scale folded in slightly wrong)."""

    def mla_prefill(self, q_nope, q_pe, kv_c, k_pe, W_UK, W_UV, *, scale, causal=False):
        return super().mla_prefill(
            q_nope, q_pe, kv_c, k_pe, W_UK * (1 + 1e-3), W_UV * (1 + 1e-3), scale=scale, causal=causal
        )


MUTANTS = [
    WrongScale,
    ScaleFromAbsorbedWidth,
    Log2Lse,
    TopLeftCausal,
    MtpCausalIgnored,
    DroppedRope,
    RopeAsValue,
    TransposedWUV,
    AbsorbedCausalDropped,
    WrongGqaHeadMapping,
    EmptyRowNaN,
    MaxInsteadOfLse,
    MergeWithoutInfGuard,
    MergeSwappedWeights,
    Raises,
    LseTransposed,
]


def _overridden_ops(cls):
    return {name for name in vars(cls) if not name.startswith("_")}


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
def test_harness_fails_the_mutant(mutant):
    ops = _overridden_ops(mutant)
    results = [run_case(mutant(), c, backend_name=mutant.__name__) for c in curated_cases() if c.op in ops]
    failed = [r for r in results if r.verdict in ("fail", "error")]
    assert failed, f"{mutant.__name__} ({mutant.__doc__}) passed every case of {sorted(ops)}"
    assert all(r.reason and r.repro.startswith(f"mlaspec check --backend {mutant.__name__} --case ") for r in failed)


def test_unmutated_torch_backend_passes_the_same_cases():
    ops = set().union(*(_overridden_ops(m) for m in MUTANTS))
    for case in curated_cases():
        if case.op in ops:
            assert run_case(TorchBackend(), case, backend_name="torch").verdict == "pass", case.id


# -- the fp32 up-projection budget: γ_Lkv |kv_c|.|W| of fp32 accumulation, and no more -------------------------------
# The reported reproducer (fp32 accumulation of k_nope / v, at error/bound 1.2 before the budget carried it).
HYP_1 = Case(
    "chunked_prefill_attention",
    "hyp-1",
    "float32",
    dict(H_q=3, Lkv=4, D_nope=2, D_rope=2, D_v=9, block_size=1, contexts=[0], q_lens=[2], workspace_size=1),
)
FP32_PROJECTION_CASES = [
    *curated_cases(dtypes=("float32",), ops=("mla_prefill", "chunked_prefill_attention", "mla_absorbed")),
    HYP_1,
]


@pytest.mark.parametrize(
    "mutant, case_id",
    [
        (Tf32UpProjection, "mla_prefill[tiny-noncausal-float32]"),
        (Tf32UpProjection, "chunked_prefill_attention[v3-workspace-chunks-no-context-float32]"),
        (Tf32UpProjection, "chunked_prefill_attention[first-chunks-only-float32]"),
        (Tf32UpProjection, HYP_1.id),
        (Tf32Absorbed, "mla_absorbed[n-equals-v-float32]"),
        (UpProjection1e3Off, "mla_prefill[tiny-noncausal-float32]"),
        (UpProjection1e3Off, "chunked_prefill_attention[v3-workspace-chunks-no-context-float32]"),
        (UpProjection1e3Off, "chunked_prefill_attention[first-chunks-only-float32]"),
        (UpProjection1e3Off, HYP_1.id),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else x,
)
def test_fp32_projection_mutant_fails(mutant, case_id):
    case = next(c for c in FP32_PROJECTION_CASES if c.id == case_id)
    r = run_case(mutant(), case, backend_name=mutant.__name__)
    assert r.verdict == "fail", f"{mutant.__name__} ({mutant.__doc__}) {r.verdict} on {case_id}"


@pytest.mark.parametrize("case", FP32_PROJECTION_CASES, ids=lambda c: c.id)
def test_fp32_projection_cases_pass_the_unmutated_torch_backend(case):
    r = run_case(TorchBackend(), case, backend_name="torch")
    assert r.verdict == "pass", (case.id, r.reason)
