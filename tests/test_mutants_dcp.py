"""The harness catches real bug classes of decode context parallelism (``dcp_decode``).

Each mutant is the torch backend with one step of the DCP path made wrong the way a serving stack has been wrong;
the harness must fail (or error) it on at least one curated case, with a reproducer. The unmutated torch backend and
the spec itself pass every ``dcp_decode`` case.
"""

from types import MappingProxyType

import pytest
import torch

from mlaspec.conformance.backend import load_backend
from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import case_by_id, curated_cases
from mlaspec.conformance.runner import run_case
from mlaspec.spec import dcp


def _cases(op, dtypes=("bfloat16",)):
    return [c for c in curated_cases(dtypes=dtypes) if c.op == op]


class CombineBaseTwo(TorchBackend):
    """Natural-log LSEs combined as if they were base 2 (``exp2(lse_r - lse)``): the weights of FlashInfer's
    convention applied to FlashMLA's numbers, or the reverse (vLLM hard-coded ``is_lse_base_on_e=True`` for
    FlashInfer MLA's log2 LSE)."""

    source = "https://github.com/vllm-project/vllm/pull/47079"
    shapes = "ranks whose LSEs differ"

    def dcp_combine(self, outs, lses):
        got = dcp.dcp_combine(outs, lses, lse_base=2)
        return got.out.to(outs.dtype), got.lse.float()


class EmptyShareWeightOne(TorchBackend):
    """A rank with no key of a request reports LSE 0 (a kernel's initial value) beside output 0, so the empty share
    weighs ``e^0`` in the combine and pulls the result towards 0 (vLLM's MLA backends before the empty-shard fix)."""

    source = "https://github.com/vllm-project/vllm/pull/38416"
    shapes = "requests shorter than N_cp * interleave (empty shares)"

    def mla_decode(self, q, kv, *, d_v, scale, causal=False, seq_lens=None):
        out, lse = super().mla_decode(q, kv, d_v=d_v, scale=scale, causal=causal, seq_lens=seq_lens)
        return out.nan_to_num(0.0), torch.where(torch.isinf(lse), 0.0, lse)


class RankLocalCausal(TorchBackend):
    """MTP queries masked causally against the rank's *local* length (bottom-right aligned to the rank's last key)
    instead of each query token's global prefix: query ``i`` of ``S_q`` reads ``local(seq_len) - S_q + 1 + i`` keys
    of the share, which is wrong once the keys are interleaved over ranks."""

    source = "https://github.com/lightseekorg/tokenspeed/pull/364"
    shapes = "MTP (S_q > 1) with causal"

    def dcp_decode(self, q, kv, *, d_v, scale, causal, seq_lens, world_size, interleave):
        parts = []
        for rank in range(world_size):
            shard = dcp.dcp_shard(kv, seq_lens, world_size=world_size, rank=rank, interleave=interleave)
            parts.append(self.mla_decode(q, shard.kv, d_v=d_v, scale=scale, causal=causal, seq_lens=shard.seq_lens))
        got = dcp.dcp_combine(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        return got.out.to(q.dtype), got.lse.float()


class DescaleTwiceOnOneRank(TorchBackend):
    """One rank dequantizes its share of the fp8 cache twice (``e4m3 * k_scale * k_scale``: its records dequantized
    on the way to the kernel and the kernel's ``descale_k`` on top), so its keys and values shrink by ``k_scale`` and
    its partial is wrong while every other rank's is right. The bug class: an fp8 MLA cache's descales applied on
    the wrong path (sglang#34765: K descale restored only in BMM1, V descale omitted, writes at unit scale)."""

    source = "https://github.com/sgl-project/sglang/pull/34765"
    shapes = "DCP over an fp8 cache whose k_scale is not 1"
    _rank = None  # inside dcp_decode_fp8: the rank whose share the next mla_decode_fp8 decodes

    def dcp_decode_fp8(self, q, kv_cache, **kw):
        self._rank = 0
        try:
            return super().dcp_decode_fp8(q, kv_cache, **kw)
        finally:
            self._rank = None

    def mla_decode_fp8(self, q, kv_cache, *, k_scale, **kw):
        twice = self._rank == 0
        if self._rank is not None:
            self._rank += 1
        return super().mla_decode_fp8(q, kv_cache, k_scale=k_scale * k_scale if twice else k_scale, **kw)


MUTANTS = [
    (CombineBaseTwo, "dcp_decode"),
    (EmptyShareWeightOne, "dcp_decode"),
    (RankLocalCausal, "dcp_decode"),
    (DescaleTwiceOnOneRank, "dcp_decode_fp8"),
]


@pytest.mark.parametrize("mutant, op", MUTANTS)
def test_mutant_fails(mutant, op):
    """Some default case (tiny, bf16) of ``dcp_decode`` fails or errors the mutant, with a reason and a repro."""
    cases = _cases(op)
    bad = next((r for r in (run_case(mutant(), c, backend_name="m") for c in cases) if r.verdict != "pass"), None)
    assert bad is not None, f"{mutant.__name__} passed every {op} case: {[c.id for c in cases]}"
    assert bad.verdict in ("fail", "error") and bad.reason
    assert bad.repro.startswith("mlaspec check --backend m --case ")


def test_every_mutant_names_its_report_and_shapes():
    for mutant, _ in MUTANTS:
        assert mutant.source.startswith("https://github.com/"), mutant.__name__
        assert isinstance(mutant.shapes, str) and mutant.shapes, mutant.__name__


@pytest.mark.parametrize("op", ["dcp_decode", "dcp_decode_fp8"])
@pytest.mark.parametrize("backend", ["spec", "torch"])
def test_builtin_backends_pass_dcp_cases(backend, op):
    b = load_backend(backend)
    assert op in b.ops
    for case in _cases(op, ("bfloat16", "float32")):
        r = run_case(b, case, backend_name=backend)
        assert r.verdict == "pass", (case.id, r.reason)


def test_the_declared_numerics_of_mla_decode_fp8_carry_into_dcp_decode_fp8():
    """FlashMLA's fp8 decode declares fp8_mma_accumulation: each partial LSE may be off by its (wide) budget, and the
    combined output's budget carries that (``e^(2δ)``). A torch fp8 decode whose every partial LSE leans low by 0.1
    (FlashMLA's measured lean, docs/backends.md) with the weights of that lean (a common shift: the output is right)
    passes under the declaration and fails the exact LSE budget."""

    class LeansLow(TorchBackend):
        numerics = MappingProxyType({"dcp_decode_fp8": ("fp8_mma_accumulation", "p_in_e4m3")})

        def mla_decode_fp8(self, q, kv_cache, **kw):
            out, lse = super().mla_decode_fp8(q, kv_cache, **kw)
            return out, lse - 0.1

    case = case_by_id("dcp_decode_fp8[v3-tp8-dcp4-i16-bfloat16]")
    assert run_case(LeansLow(), case, backend_name="leans").verdict == "pass"
    strict = run_case(LeansLow(), case, backend_name="leans", strict_numerics=True)
    assert strict.verdict == "fail" and "lse" in strict.reason
