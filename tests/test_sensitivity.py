"""The sensitivity table in docs/sensitivity.md is what the probes measure today, and it meets the output-scale
goal for every attention-type op."""

import math
import re
from pathlib import Path

import pytest

from mlaspec.conformance import sensitivity as sens

DOC = Path(__file__).parents[1] / "docs" / "sensitivity.md"


@pytest.fixture(scope="module")
def measured():
    return sens.sensitivity(sens.ATTENTION_OPS + ("indexer_logits", "paged_indexer_logits"), ("bfloat16", "float16"))


def test_the_docs_table_is_current(measured):
    page = DOC.read_text()
    table = page.split("<!-- SENSITIVITY START -->\n")[1].split("<!-- SENSITIVITY END -->")[0]
    assert table == sens.table(measured), "stale: python -m mlaspec.conformance.sensitivity --out docs/sensitivity.md"


@pytest.mark.parametrize("op", sens.ATTENTION_OPS)
def test_an_output_scale_of_half_a_percent_fails_in_bf16(measured, op):
    assert measured[op, "bfloat16"]["output scale"] <= sens.GOALS["output scale", "bfloat16"]


@pytest.mark.parametrize("op", sens.ATTENTION_OPS)
def test_the_probe_sees_nothing_without_an_error(op):
    prepared = [sens._Prepared(c, sens.TorchBackend()) for c in sens.curated_cases(ops=(op,))]
    assert all(sens.detected(prepared, kind, 0.0) in (False, None) for kind in sens.KINDS if kind != "softmax scale")


def test_a_missed_goal_is_marked_in_the_table():
    row = {k: None for k in sens.KINDS} | {"output scale": 2e-2, "softmax scale": math.inf}
    line = sens.table({("mla_decode", "bfloat16"): row}).splitlines()[-1]
    assert re.search(r"2e-2 \(goal 5e-3\) \| > 1 \(goal 1e-3\)", line), line
