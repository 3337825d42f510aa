"""CONTRIBUTING.md's walkthroughs, run as written: its code blocks become a temporary package, the example op is
registered and judged through the harness (the spec backend, the walkthrough's backend, a wrong backend that must
fail), and ``mlaspec check`` runs the walkthrough's backend by ``module:attr``."""

import importlib
import re
import sys
from pathlib import Path

import pytest

from mlaspec.conformance.backends.reference import SpecBackend
from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.cli import main
from mlaspec.conformance.ops import OPS
from mlaspec.conformance.runner import run_cases

CONTRIBUTING = Path(__file__).resolve().parents[1] / "CONTRIBUTING.md"


def _files() -> dict[str, str]:
    """``{file name: source}`` from the ```python blocks whose first line is ``# file: NAME``, concatenated in order."""
    files: dict[str, str] = {}
    for block in re.findall(r"```python\n(.*?)```", CONTRIBUTING.read_text(), re.S):
        first, _, body = block.partition("\n")
        m = re.fullmatch(r"# file: (\S+)", first.strip())
        if m:
            files[m.group(1)] = files.get(m.group(1), "") + body + "\n"
    return files


@pytest.fixture
def walkthrough(tmp_path, monkeypatch):
    for name, source in _files().items():
        (tmp_path / name).write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    try:
        yield importlib.import_module("example_backend")
    finally:
        OPS.pop("lse_to_base2", None)
        for mod in ("example_backend", "example_op"):
            sys.modules.pop(mod, None)


def test_the_walkthroughs_name_both_files():
    assert set(_files()) == {"example_op.py", "example_backend.py"}


def test_the_example_op_registers_and_passes_its_own_spec(walkthrough):
    assert "lse_to_base2" in OPS and "lse_to_base2" in SpecBackend().ops
    cases = curated_cases(ops=("lse_to_base2",), dtypes=("bfloat16", "float16", "float32"))
    assert [c.name for c in cases] == ["v3-tp8"] * 3
    assert {r.verdict for r in run_cases(SpecBackend(), cases, backend_name="spec")} == {"pass"}


def test_the_walkthrough_backend_passes_and_a_wrong_one_fails(walkthrough):
    backend = walkthrough.MyBackend()
    assert backend.ops == {"lse_to_base2", "merge_attn_states"}
    cases = curated_cases(ops=("lse_to_base2", "merge_attn_states"), dtypes=("bfloat16", "float32"))
    results = run_cases(backend, cases, backend_name="example_backend:MyBackend")
    assert [r.verdict for r in results] == ["pass"] * len(cases), [r.reason for r in results]

    class Natural(walkthrough.MyBackend):  # forgets the conversion: the bug the op exists to catch
        def lse_to_base2(self, lse):
            return (lse.clone(),)

    wrong = run_cases(Natural(), curated_cases(ops=("lse_to_base2",)), backend_name="natural")
    assert {r.verdict for r in wrong} == {"fail"}


def test_the_walkthrough_backend_runs_under_the_cli(walkthrough, tmp_path):
    argv = ["check", "--backend", "example_backend:MyBackend", "--ops", "lse_to_base2,merge_attn_states"]
    assert main([*argv, "--report", str(tmp_path / "report")]) == 0
    n = len(curated_cases(ops=("lse_to_base2", "merge_attn_states")))  # the default dtypes, bf16 and fp16
    assert (tmp_path / "report" / "results.jsonl").read_text().count('"verdict": "pass"') == n


def test_the_example_op_has_generated_cases(walkthrough):
    from hypothesis import given, settings

    from mlaspec.conformance.generated import case_strategy, generated_ops

    assert "lse_to_base2" in generated_ops()
    seen = []

    @settings(max_examples=5, database=None, deadline=None)
    @given(case_strategy("lse_to_base2"))
    def draw(case):
        seen.append(case)
        assert run_cases(SpecBackend(), [case], backend_name="spec")[0].verdict == "pass"

    draw()
    assert seen and all(1 <= c.params["H"] <= 4 for c in seen)
