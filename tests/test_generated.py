"""The ops' generators draw only cases in their op's domain: inputs that fit the case dtype, shapes the op accepts,
budgets a correct backend meets (issue 21: a test strategy planted ``-448 * 2^k`` past fp16's 65504, an ``inf``
that made a NaN scale)."""

import zlib
from dataclasses import replace
from unittest import mock

import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import Case, curated_cases
from mlaspec.conformance.generated import GENERATED_OPS, case_strategy
from mlaspec.conformance.ops import OPS
from mlaspec.conformance.runner import run_case


def _overflows(case: Case) -> list[str]:
    """The fp16 inputs of ``case`` that are ``±inf`` or NaN where the same draw in fp32 (the same seed) is finite:
    a value past fp16's range, not one of the op's planted sentinels (``-inf`` LSEs, NaN pages)."""
    same_seed = property(lambda c: zlib.crc32(f"{c.op}[{c.name}]".encode()))  # the id without its dtype
    with mock.patch.object(Case, "seed", same_seed):
        wide = OPS[case.op].make_inputs(replace(case, dtype="float32"))
        narrow = OPS[case.op].make_inputs(replace(case, dtype="float16"))
    found = []
    for name, x in narrow.items():
        if isinstance(x, torch.Tensor) and x.dtype == torch.float16:
            lost = torch.isfinite(wide[name]) & ~torch.isfinite(x)
            if lost.any():
                found.append(f"{case.id} {name}: {int(lost.sum())} values past fp16, up to {wide[name][lost].max()}")
    return found


def test_curated_inputs_fit_fp16():
    assert [f for c in curated_cases(dtypes=("float16",)) for f in _overflows(c)] == []


def test_the_overflow_check_sees_a_value_past_fp16():
    merge = OPS["merge_attn_states"]

    def loud(case: Case) -> dict:  # the parts' outputs 1e5 times larger: past fp16, well inside fp32
        return {k: v * 1e5 if k.endswith("_output") else v for k, v in merge.make_inputs(case).items()}

    with mock.patch.dict(OPS, {"merge_attn_states": replace(merge, make_inputs=loud)}):
        found = _overflows(Case("merge_attn_states", "loud", "float16", dict(T=3, H=2, D=8)))
    assert found and found[0].startswith("merge_attn_states[loud-float16] prefix_output: ")


@given(st.sampled_from(GENERATED_OPS).flatmap(lambda op: case_strategy(op, ("float16",))))
def test_drawn_inputs_fit_fp16(case):
    assert _overflows(case) == []


@given(st.sampled_from(GENERATED_OPS).flatmap(lambda op: case_strategy(op, ("bfloat16", "float16", "float32"))))
def test_drawn_cases_pass_on_the_torch_backend(case):
    """Every generated op (not only the dense four of test_plugin): the harness builds the case (no shape the op
    rejects), and a correct backend in the case's dtype meets the derived budgets (no NaN scale, no overflow)."""
    r = run_case(TorchBackend(), case, backend_name="torch", timeout=None)
    assert r.verdict == "pass", (case, r.reason)
