"""Declared numerics: a departure changes exactly its budget term, is recorded with the verdict, is ignored under
strict numerics, and a kernel beyond what it declares still fails."""

import math
from types import MappingProxyType

import pytest
import torch

from mlaspec.conformance import numerics
from mlaspec.conformance.backends.flashmla import quantize_sparse_cache
from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.backends.torch_fp8 import decode_records
from mlaspec.conformance.cases import Case, case_by_id, curated_cases
from mlaspec.conformance.ops.common import EPS32, gamma
from mlaspec.conformance.runner import run_case
from mlaspec.conformance.statistics import rounding_statistics
from mlaspec.spec.attention import seq_lens_mask

# 64 rows of 40 keys: enough rows for the bias check to see a lean
CASE = Case("indexer_logits", "rows-64", "bfloat16", dict(H=4, D=32, query_lens=[12, 20, 32], seq_lens=[40, 33, 40]))


class Leaning(TorchBackend):
    """The indexer's logits scaled by ``1 + lean`` (a truncating accumulator's lean is ~ -4e-5)."""

    lean = -4e-5
    numerics = MappingProxyType({"indexer_logits": ("fp8_mma_accumulation",)})

    def indexer_logits(self, *args, **kw):
        logits = super().indexer_logits(*args, **kw)
        return (logits.double() * (1 + self.lean)).float()


class LeaningTooFar(Leaning):
    """Beyond 2^-14 (6.1e-5): more than the accumulator's resolution explains."""

    lean = -2.5e-4


def test_the_vocabulary_names_its_sources():
    for d in numerics.DEPARTURES.values():
        assert d.doc and d.source and (d.accumulation or d.bias_floor or d.lse_rounded or d.key_format or d.p_format)


def test_a_departure_changes_only_inside_its_block():
    assert gamma(128) == pytest.approx(128 * EPS32, rel=1e-5)
    with numerics.assuming(("fp8_mma_accumulation",)):
        assert gamma(128) == pytest.approx(128 * 2**-14 / (1 - 128 * 2**-14))
        assert numerics.bias_floor(2**-18) == 2**-14
    assert gamma(128) == pytest.approx(128 * EPS32, rel=1e-5) and numerics.bias_floor(2**-18) == 2**-18


def test_an_unknown_declaration_is_an_error_naming_it():
    class Typo(TorchBackend):
        numerics = MappingProxyType({"indexer_logits": ("fp8_mma_acumulation",)})

    r = run_case(Typo(), CASE, backend_name="typo")
    assert r.verdict == "error" and "fp8_mma_acumulation" in r.reason


def test_a_declared_lean_passes_and_is_recorded():
    r = run_case(Leaning(), CASE, backend_name="leaning")
    assert r.verdict == "pass", r.reason
    assert r.numerics == ["fp8_mma_accumulation"]


def test_strict_numerics_fails_the_same_lean_naming_it():
    r = run_case(Leaning(), CASE, backend_name="leaning", strict_numerics=True)
    assert r.verdict == "fail" and r.numerics == []  # past the fp32 per-element budget, here


def test_a_lean_beyond_the_declared_resolution_fails_anyway():
    r = run_case(LeaningTooFar(), CASE, backend_name="too-far")
    assert r.verdict == "fail" and "systematic error -0.025%" in r.reason


def test_the_bias_floor_follows_the_declaration():
    ref = torch.randn(40, 8, dtype=torch.float64)
    err = ref * -4e-5
    with numerics.assuming(("fp8_mma_accumulation",)):
        assert not rounding_statistics(err, ref, ref.abs(), relative=True, u=0.0).biased
    assert rounding_statistics(err, ref, ref.abs(), relative=True, u=0.0).biased


class LseInBf16(TorchBackend):
    """mla_decode's LSE returned in the query dtype, as vLLM 0.33's Triton MLA decode stores it."""

    numerics = MappingProxyType({"mla_decode": ("lse_in_query_dtype",)})

    def mla_decode(self, q, kv, **kw):
        out, lse = super().mla_decode(q, kv, **kw)
        return out, lse.to(q.dtype)


DECODE = Case("mla_decode", "lse-18", "bfloat16", dict(B=3, S_q=1, S_kv=37, H_q=16, D_qk=576, D_v=512, causal=True))


def test_a_declared_bf16_lse_passes_and_strict_numerics_fails_it():
    assert run_case(LseInBf16(), DECODE, backend_name="bf16-lse").verdict == "pass"
    strict = run_case(LseInBf16(), DECODE, backend_name="bf16-lse", strict_numerics=True)
    assert strict.verdict == "fail" and strict.reason.startswith("lse: max |error|/bound")
    assert "strict numerics: not assumed the lse_in_query_dtype that bf16-lse declares for mla_decode" in strict.reason


# -- scales_in_bf16: FlashMLA's sparse decode on the caches each writer writes ---------------------------------------
WRITER_CASES = {w: case_by_id(f"sparse_decode[v32-writer-{w}-bfloat16]") for w in ("flashmla", "vllm033", "vllm-pow2")}


class FlashMLALike(TorchBackend):
    """FlashMLA's SM90 sparse decode arithmetic on torch: the 656-byte records the ``flashmla`` adapter writes
    (:func:`~mlaspec.conformance.backends.flashmla.quantize_sparse_cache`), each fp32 scale read as bf16 and
    ``e4m3 * bf16(s)`` a bf16 product (``splitkv_mla.cuh:550``, ``dequant.h:25``); then the torch backend's attention.
    ``scale_dtype`` is what the scale is read as, ``product_dtype`` what the product is rounded to."""

    numerics = MappingProxyType({"sparse_decode": ("scales_in_bf16",)})
    scale_dtype = torch.bfloat16
    product_dtype = torch.bfloat16

    def _scales(self, scales: torch.Tensor) -> torch.Tensor:
        return scales.to(self.scale_dtype).to(torch.float32)

    def _read(self, cache: torch.Tensor) -> torch.Tensor:
        rows = cache.reshape(-1, 576)
        records = quantize_sparse_cache(rows).reshape(-1, 656)[: rows.shape[0]]
        e4m3 = records[:, :512].contiguous().view(torch.float8_e4m3fn).to(torch.float32).reshape(-1, 4, 128)
        s = self._scales(records[:, 512:528].contiguous().view(torch.float32))
        nope = (e4m3 * s[..., None]).to(self.product_dtype).reshape(-1, 512)  # fp32 product, rounded once
        rope = records[:, 528:].contiguous().view(torch.bfloat16)
        return torch.cat([nope.to(torch.bfloat16), rope], dim=1).reshape(cache.shape)

    def sparse_decode(self, q, kv_cache, indices, **kw):
        return super().sparse_decode(q, self._read(kv_cache), indices, **kw)


class ScalesInFp16(FlashMLALike):
    """Declares bf16 scales, reads them as fp16 (3 more bits): not the arithmetic it declares."""

    scale_dtype = torch.float16


class ScalesInE8m0(FlashMLALike):
    """Declares bf16 scales, reads them as e8m0 (SM100's reader), i.e. rounded to a power of two."""

    scale_dtype = torch.float8_e8m0fnu


class ScaleIgnored(FlashMLALike):
    """Declares bf16 scales, drops them: keys are the bare e4m3 values."""

    def _scales(self, scales):
        return torch.ones_like(scales)


def test_a_bf16_scale_reader_passes_every_writer_under_its_declaration():
    for writer, case in WRITER_CASES.items():
        r = run_case(FlashMLALike(), case, backend_name="flashmla-like")
        assert r.verdict == "pass", (writer, r.reason)
        assert r.numerics == ["scales_in_bf16"]


def test_strict_numerics_fails_a_bf16_scale_reader_on_raw_scales_only_naming_numerics_and_writer():
    for writer, case in WRITER_CASES.items():
        r = run_case(FlashMLALike(), case, backend_name="flashmla-like", strict_numerics=True)
        if writer == "vllm033":  # vLLM 0.33's raw amax / 448: bf16(s) moves every key
            assert r.verdict == "fail" and r.reason.startswith("lse: max |error|/bound")
            assert "not assumed the scales_in_bf16 that flashmla-like declares for sparse_decode" in r.reason
            assert "writer-vllm033" in r.case_id and "writer-vllm033" in r.repro
        else:  # power-of-two scales: bf16(s) = s, the product e4m3 * 2^k is exact in bf16
            assert r.verdict == "pass", (writer, r.reason)


@pytest.mark.parametrize("mutant", [ScalesInFp16, ScalesInE8m0, ScaleIgnored], ids=lambda m: m.__name__)
def test_a_reader_beyond_its_declared_scale_format_fails(mutant):
    r = run_case(mutant(), WRITER_CASES["vllm033"], backend_name=mutant.__name__)
    assert r.verdict == "fail", r.reason


class KeysInQueryDtype(TorchBackend):
    """The ``triton`` adapter's path: the cache handed to the kernel in q's dtype, keys rounded once (``e4m3 * s`` in
    fp32, then bf16: ``impl/sparse.py`` lines 113, 290); declares it."""

    numerics = MappingProxyType({"sparse_decode": ("keys_in_query_dtype",)})

    def sparse_decode(self, q, kv_cache, indices, **kw):
        return super().sparse_decode(q, kv_cache.to(q.dtype), indices, **kw)


class ScalesInBf16DeclaredAsKeys(FlashMLALike):
    """FlashMLA's arithmetic (the scale read as bf16 too) declared as ``keys_in_query_dtype`` only."""

    numerics = MappingProxyType({"sparse_decode": ("keys_in_query_dtype",)})


def test_keys_rounded_to_the_query_dtype_pass_declared_and_fail_strict_on_raw_scales():
    for writer, case in WRITER_CASES.items():
        assert run_case(KeysInQueryDtype(), case, backend_name="keys").verdict == "pass", writer
        strict = run_case(KeysInQueryDtype(), case, backend_name="keys", strict_numerics=True)
        assert strict.verdict == ("fail" if writer == "vllm033" else "pass"), (writer, strict.reason)


def test_the_two_key_readings_are_told_apart():
    assert run_case(ScalesInBf16DeclaredAsKeys(), WRITER_CASES["vllm033"], backend_name="m").verdict == "fail"


def test_the_scale_format_follows_the_declaration():
    assert numerics.scale_format() is None and numerics.key_format() is None
    with numerics.assuming(("scales_in_bf16",)):
        assert numerics.scale_format() == "bf16" and numerics.key_format() == "bf16"
    with numerics.assuming(("keys_in_query_dtype",)):
        assert numerics.scale_format() is None and numerics.key_format() == "query"
    assert numerics.scale_format() is None


# -- p_in_e4m3: FlashMLA's dense fp8 decode rounds the softmax weights to e4m3 for P V ---------------------------------
FP8_DECODE = case_by_id("mla_decode_fp8[v3-tp8-per-tensor-bfloat16]")


class PInE4M3(TorchBackend):
    """The fp8 decode with ``exp(s - max)`` rounded to e4m3 before ``P V`` (``flash_fwd_mla_kernel.h:384-385``),
    normalised after; declares it."""

    numerics = MappingProxyType({"mla_decode_fp8": ("p_in_e4m3",)})

    def _weights(self, p: torch.Tensor) -> torch.Tensor:
        return p.to(torch.float8_e4m3fn).float()

    def mla_decode_fp8(self, q, kv_cache, *, layout, k_scale, q_scale, d_v, scale, causal=False, seq_lens=None):
        kv = decode_records(kv_cache, layout, k_scale)
        (b, s_q), s_kv = q.shape[:2], kv.shape[1]
        lens = torch.full((b,), s_kv) if seq_lens is None else seq_lens
        s = torch.einsum("bqhd,bkd->bhqk", q.float(), kv) * scale
        s = s.masked_fill(~seq_lens_mask(lens, s_q, s_kv, causal=causal)[:, None], -math.inf)
        m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)  # a row without keys: p = 0, out 0, lse -inf
        p = torch.exp(s - m)
        ell = p.sum(-1)
        out = torch.einsum("bhqk,bkd->bqhd", self._weights(p), kv[..., :d_v])
        return (out / ell.transpose(1, 2)[..., None]).nan_to_num(0.0).to(q.dtype), torch.log(ell) + m[..., 0]


class PFlushedInE4M3(PInE4M3):
    """Declares e4m3 weights, flushes e4m3's subnormals (below ``2^-6``) to zero: a conversion without gradual
    underflow, more than e4m3 rounding loses."""

    def _weights(self, p):
        return super()._weights(torch.where(p < 2.0**-6, 0.0, p))


@pytest.mark.parametrize(
    "case", curated_cases(dtypes=("bfloat16", "float16"), ops=("mla_decode_fp8",)), ids=lambda c: c.id
)
def test_declared_e4m3_weights_pass_and_strict_numerics_fails_them(case):
    r = run_case(PInE4M3(), case, backend_name="p-e4m3")
    assert r.verdict == "pass", r.reason
    strict = run_case(PInE4M3(), case, backend_name="p-e4m3", strict_numerics=True)
    assert strict.verdict == "fail" and "not assumed the p_in_e4m3 that p-e4m3 declares" in strict.reason


def test_the_weights_format_follows_the_declaration():
    with numerics.assuming(("p_in_e4m3",)):
        assert numerics.p_format() == "e4m3"
    assert numerics.p_format() is None


# -- every departure has a mutant that breaks it and is caught -------------------------------------------------------
class LseInBf16Off(LseInBf16):
    """Declares the LSE in bf16, and is two bf16 ulps off at an LSE of 18."""

    def mla_decode(self, q, kv, **kw):
        out, lse = super().mla_decode(q, kv, **kw)
        return out, (lse.float() + 0.25).to(q.dtype)


VIOLATIONS = {
    "fp8_mma_accumulation": (LeaningTooFar, CASE),
    "lse_in_query_dtype": (LseInBf16Off, DECODE),
    "scales_in_bf16": (ScalesInFp16, WRITER_CASES["vllm033"]),
    "keys_in_query_dtype": (ScalesInBf16DeclaredAsKeys, WRITER_CASES["vllm033"]),
    "p_in_e4m3": (PFlushedInE4M3, FP8_DECODE),
}


@pytest.mark.parametrize("name", sorted(numerics.DEPARTURES))
def test_every_departure_has_a_mutant_beyond_it_that_fails(name):
    assert name in VIOLATIONS, f"no mutant violates the departure {name}"
    backend, case = VIOLATIONS[name]
    assert name in backend.numerics[case.op]
    assert run_case(backend(), case, backend_name=backend.__name__).verdict == "fail"
