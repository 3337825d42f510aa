"""Declared numerics: a departure changes exactly its budget term, is recorded with the verdict, is ignored under
strict numerics, and a kernel beyond what it declares still fails."""

from types import MappingProxyType

import pytest
import torch

from mlaspec.conformance import numerics
from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import Case
from mlaspec.conformance.ops.common import EPS32, gamma
from mlaspec.conformance.runner import run_case
from mlaspec.conformance.statistics import rounding_statistics

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
        assert d.doc and d.source and (d.accumulation or d.bias_floor or d.lse_rounded)


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


def test_a_declared_bf16_lse_still_fails_a_wrong_lse():
    class LseInBf16Off(LseInBf16):
        def mla_decode(self, q, kv, **kw):
            out, lse = super().mla_decode(q, kv, **kw)
            return out, (lse.float() + 0.25).to(q.dtype)  # two bf16 ulps at 18

    assert run_case(LseInBf16Off(), DECODE, backend_name="off").verdict == "fail"
