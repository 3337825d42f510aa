"""The harness itself: the spec and torch backends pass, wrong backends fail with a reproducer, results stream."""

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.conformance.backend import load_backend
from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import Case, case_by_id, curated_cases
from mlaspec.conformance.cli import EXIT_FAILED, main
from mlaspec.conformance.report import load_results
from mlaspec.conformance.runner import run_case, run_cases
from mlaspec.conformance.verdict import Result, format_failure

CASES = curated_cases(dtypes=("bfloat16",))


@pytest.mark.parametrize("backend", ["spec", "torch"])
def test_builtin_backends_pass_everything(backend):
    b = load_backend(backend)
    for case in curated_cases():
        r = run_case(b, case, backend_name=backend)
        assert r.verdict == "pass", (case.id, r.reason)


def test_unsupported_is_skipped_with_reason():
    class DecodeOnly(TorchBackend):
        ops = frozenset({"mla_decode"})
        dtypes = frozenset({"bfloat16"})

        def unsupported(self, case):
            return "needs 128 heads" if case.params["H_q"] != 128 and case.name == "v3-tp1" else None

    results = run_cases(DecodeOnly(), curated_cases(), backend_name="d")
    skipped = [r for r in results if r.verdict == "skip"]
    assert skipped and all(r.reason for r in skipped)
    assert any("does not implement attention" in r.reason for r in skipped)
    assert any("needs 128 heads" in r.reason for r in skipped)
    assert all(r.verdict == "pass" for r in results if r.verdict != "skip")


def test_timeout_fails_the_case_and_the_run_goes_on():
    class Hangs(TorchBackend):
        def attention(self, *a, **k):
            import time

            time.sleep(5)

    cases = [c for c in CASES if c.op in ("attention", "merge_attn_states")][:2] + CASES[-1:]
    results = run_cases(Hangs(), cases, backend_name="h", timeout=0.2)
    assert results[0].verdict == "timeout" and "timed out" in results[0].reason
    assert results[-1].verdict == "pass"


def test_cli_writes_report_and_reproducer_reruns_one_case(tmp_path, capsys):
    out = tmp_path / "rep"
    assert (
        main(
            [
                "check",
                "--backend",
                "tests.test_mutants_dense:WrongScale",
                "--ops",
                "mla_decode",
                "--dtypes",
                "bfloat16",
                "--report",
                str(out),
            ]
        )
        == 1
    )
    text = capsys.readouterr().out
    assert "FAILED mla_decode[" in text and "rerun: mlaspec check" in text
    header, *lines = (out / "results.jsonl").read_text().splitlines()
    assert json.loads(header)["mlaspec_run"]["planned"] == [c.id for c in CASES if c.op == "mla_decode"]
    assert len(lines) == len([c for c in CASES if c.op == "mla_decode"])
    failing = next(json.loads(line) for line in lines if json.loads(line)["verdict"] == "fail")
    page = (out / "report.html").read_text()
    assert failing["repro"].replace("'", "&#x27;") in page and "data:image/png;base64," in page
    # the reproducer names exactly one case, and rerunning it fails again
    rerun = failing["repro"].split("--case ")[1].strip("'")
    assert case_by_id(rerun).id == failing["case_id"]
    assert (
        main(
            [
                "check",
                "--backend",
                "tests.test_mutants_dense:WrongScale",
                "--case",
                rerun,
                "--report",
                str(tmp_path / "one"),
            ]
        )
        == 1
    )
    # the report can be rebuilt from the JSON lines alone, and exits like check: 1, the run it reports failed
    (out / "report.html").unlink()
    assert main(["report", str(out)]) == EXIT_FAILED and (out / "report.html").exists()
    assert [r.case_id for r in load_results(out)] == [json.loads(line)["case_id"] for line in lines]


def test_cli_passes_on_torch(tmp_path):
    assert main(["check", "--ops", "merge_attn_states", "--report", str(tmp_path)]) == 0


def test_load_backend_errors():
    with pytest.raises(ValueError, match="neither a registered name"):
        load_backend("nonexistent")
    with pytest.raises(ValueError, match="names no curated case"):
        case_by_id("attention[nope-bfloat16]")


def test_repro_names_a_curated_case_by_id_and_any_other_by_its_parameters():
    case = case_by_id("attention[mha-causal-bfloat16]")
    assert case.repro("torch") == "mlaspec check --backend torch --case 'attention[mha-causal-bfloat16]'"
    full = case_by_id("mla_decode[v3-tp8-bfloat16]", scale="full")
    assert (
        full.repro("mod.x:B", "full")
        == "mlaspec check --backend mod.x:B --case 'mla_decode[v3-tp8-bfloat16]' --scale full"
    )
    # the same id with other parameters (a tiny case at full scale, a --params case, a generated one) is not curated
    assert "--params" in case_by_id("mla_decode[v3-tp8-bfloat16]").repro("torch", "full")
    other = Case(case.op, case.name, case.dtype, {**case.params, "S_kv": 6})
    assert other.repro("my backend") == (
        "mlaspec check --backend 'my backend' --op attention --name mha-causal --dtypes bfloat16 --params "
        """'{"B":2,"D_qk":24,"D_v":16,"H_kv":4,"H_q":4,"S_kv":6,"S_q":5,"causal":true}'"""
    )
    assert other.repro("torch", "full").endswith("}' --scale full")


def test_format_failure_is_the_one_failure_line():
    case = case_by_id("attention[mha-causal-bfloat16]")
    r = Result(case.id, case.op, case.dtype, "fail", reason="out: max |error|/bound = 2", repro=case.repro("torch"))
    assert format_failure(r) == (
        "FAILED attention[mha-causal-bfloat16]: out: max |error|/bound = 2\n"
        "  rerun: mlaspec check --backend torch --case 'attention[mha-causal-bfloat16]'"
    )
    r.verdict, r.reason = "error", "RuntimeError: boom"
    assert format_failure(r).startswith("ERROR attention[mha-causal-bfloat16]: RuntimeError: boom\n  rerun: ")


def test_cli_stops_when_the_cuda_context_is_lost(tmp_path, capsys, monkeypatch):
    """In-process (``--isolation none``), after a case that breaks the CUDA context every later launch would fail: the
    run stops and says so. (A worker process whose context breaks exits, and the next case gets a new one.)"""
    from mlaspec.conformance import cli

    monkeypatch.setattr(cli, "_cuda_broken", lambda: "AcceleratorError: CUDA error: an illegal memory access")
    argv = ["check", "--backend", "spec", "--ops", "merge_attn_states", "--dtypes", "float32", "--generated", "2"]
    argv += ["--isolation", "none"]
    assert main([*argv, "--report", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    n = len(curated_cases(dtypes=("float32",), ops=("merge_attn_states",))) + 2
    assert "CUDA context lost after merge_attn_states[tp8-float32] (AcceleratorError: " in out
    assert f"NOT RUN: {n - 1} of {n} planned cases have no verdict (CUDA context lost" in out
    assert "RUN   mlaspec" not in out  # no drawn case started
    assert len(load_results(tmp_path)) == 1


def test_cli_generated_cases_are_announced_before_they_run(tmp_path, capsys):
    argv = ["check", "--backend", "spec", "--ops", "merge_attn_states", "--dtypes", "float32", "--generated", "3"]
    assert main([*argv, "--seed", "5", "--report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = [i for i, line in enumerate(lines) if "] RUN   mlaspec check --backend spec --op merge_attn_states" in line]
    assert runs and all(lines[i + 1].split("] ", 1)[0] == lines[i].split("] ", 1)[0] for i in runs)
    results = load_results(tmp_path)
    assert [r.repro for r in results if r.case_id.startswith("merge_attn_states[hyp-")] == [
        lines[i].split("RUN   ", 1)[1] for i in runs
    ]


def test_cli_generated_does_not_go_with_params(capsys):
    assert main(["check", "--op", "attention", "--params", "{}", "--generated", "1"]) == 2
    assert "--generated" in capsys.readouterr().err


def test_normal_draws_small_tensors_as_randn_and_large_ones_in_fixed_parts(monkeypatch):
    """Up to a chunk: exactly ``torch.randn`` (the tiny cases' inputs never changed). Larger: a function of the
    generator's state alone -- the same on one thread as on many --, every part its own stream, standard normal."""
    from mlaspec.conformance.ops import common
    from mlaspec.conformance.ops.common import normal

    small = normal(3, 5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(small, torch.randn(3, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64))
    monkeypatch.setattr(common, "NORMAL_CHUNK", 1000)
    monkeypatch.setattr(common, "NORMAL_PART", 250)
    g = torch.Generator().manual_seed(7)
    x, y = normal(25, 400, generator=g), normal(25, 400, generator=g)
    assert x.shape == (25, 400) and x.dtype == torch.float64 and not torch.equal(x, y)  # the state moved on
    monkeypatch.setattr(common, "usable_cpus", lambda: 1)
    assert torch.equal(normal(25, 400, generator=torch.Generator().manual_seed(7)), x)  # one thread: same bits
    parts = x.flatten().view(40, 250)
    assert all(not torch.equal(parts[0], c) for c in parts[1:])  # no part repeats another's stream
    assert abs(float(x.mean())) < 4 / 100 and abs(float(x.std()) - 1) < 0.03  # 10^4 draws: 4 sigma of each


@given(seed=st.integers(0, 2**31), n=st.integers(1, 3000))
def test_normal_is_a_function_of_the_seed(seed, n):
    from mlaspec.conformance.ops import common

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "NORMAL_CHUNK", 512)
        mp.setattr(common, "NORMAL_PART", 128)
        a = common.normal(n, generator=torch.Generator().manual_seed(seed))
        b = common.normal(n, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(a, b) and torch.isfinite(a).all()


def test_projection_error_is_gamma_n_of_the_contracted_length():
    from mlaspec.conformance.ops.common import EPS32, gamma, projection_error

    u = 2.0**-8
    x, w = torch.ones(2, 3, 5), torch.ones(5, 4, 6)
    got = projection_error("bsl,lnp->bsnp", x, w, u)  # n = Lkv = 5: (1 + u/2) γ_5 * 5 everywhere
    assert got.shape == (2, 3, 4, 6) and torch.allclose(got, torch.full_like(got, (1 + u / 2) * gamma(5) * 5.0))
    q = torch.ones(2, 3, 4, 6)
    got = projection_error("bsnp,lnp->bsnl", q, w, u)  # the absorbed query: n = D_nope = 6
    assert torch.allclose(got, torch.full_like(got, (1 + u / 2) * gamma(6) * 6.0))
    assert gamma(512) == 512 * EPS32 / (1 - 512 * EPS32)
    with pytest.raises(ValueError, match="n u_w < 1"):
        gamma(512, 2.0**-8)  # bf16 accumulation of 512 terms: no bound at all


def test_projection_error_covers_fp32_accumulation_where_terms_cancel():
    """fp32 sums of 512 products whose result nearly cancels: the error is far above one rounding of the result
    (``2^-25 |y|``), and within ``γ_512 |x|.|w|``."""
    from mlaspec.conformance.ops.common import EPS32, projection_error

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g, dtype=torch.float64).float()
    w = torch.randn(512, 2, 8, generator=g, dtype=torch.float64)
    w -= torch.einsum("sl,lnp->snp", x[:1].double(), w)[0] * x[0].double()[:, None, None] / x[0].double().square().sum()
    w = w.float()  # row 0 of x @ w cancels down to w's rounding
    exact = torch.einsum("sl,lnp->snp", x.double(), w.double())
    err = (torch.einsum("sl,lnp->snp", x, w).double() - exact).abs()
    assert (err > EPS32 / 2 * exact.abs()).any()  # one rounding of the result would not cover it
    assert (err <= projection_error("sl,lnp->snp", x, w, EPS32)).all()


def test_the_docs_op_table_is_the_registry():
    """docs/conformance.md's op table has one row per registered op, naming the spec function the op checks."""
    import re
    from pathlib import Path

    from mlaspec.conformance.ops import OPS

    text = (Path(__file__).resolve().parents[1] / "docs" / "conformance.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_0-9]+)` \| `(spec\.[a-z_.0-9]+)`", text, re.M))
    assert set(rows) == set(OPS), (
        f"ops without a row: {set(OPS) - set(rows)}; rows without an op: {set(rows) - set(OPS)}"
    )
    for name, op in OPS.items():
        f = op.spec_function
        assert rows[name] == f"{f.__module__.removeprefix('mlaspec.')}.{f.__name__}", name


def test_report_lists_failures_first_and_counts_skips_by_reason(tmp_path):
    from mlaspec.conformance.report import write_html
    from mlaspec.conformance.verdict import Metric, Result

    results = [
        Result("attention[a-bfloat16]", "attention", "bfloat16", "pass", metrics=[Metric("out", "rel", 0.1, math.inf)]),
        Result("attention[b-bfloat16]", "attention", "bfloat16", "skip", reason="no bf16 here"),
        Result("attention[c-bfloat16]", "attention", "bfloat16", "fail", reason="lse off", repro="mlaspec check ..."),
        Result("attention[d-bfloat16]", "attention", "bfloat16", "skip", reason="no bf16 here"),
    ]
    results[2].metrics = [Metric("out", "rel_frobenius", 0.5, math.inf), Metric("lse", "max_error/bound", 3.0, 1.0)]
    page = write_html(results, tmp_path, backend="b").read_text()
    assert page.index("attention[c-bfloat16]") < page.index("attention[a-bfloat16]")  # failures first
    assert "<tr><td>2</td><td>no bf16 here</td>" in page and "attention[b-bfloat16]</td><td>" not in page
    assert "rel_frobenius" not in page and "bound inf" not in page and "max_error/bound = 3" in page


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_tiny_output_may_round_to_the_subnormal_grid(dtype):
    """An output far below the dtype's smallest normal rounds to its subnormal grid (fp16: 6.6e-9 -> 0, an absolute
    error of up to 2^-25): the attention budget admits exactly that rounding, and not a relative error of it."""
    from mlaspec.conformance.ops.common import attention_bounds, underflow_floor, unit_roundoff
    from mlaspec.spec.attention import attention

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 2, 8, generator=g, dtype=torch.float64), torch.randn(1, 5, 2, 8, generator=g)
    v = torch.randn(1, 5, 2, 4, generator=g, dtype=torch.float64) * 1e-8
    ref = attention(q, k.double(), v, scale=0.3, causal=False)
    out_bound, _ = attention_bounds(q, k.double(), v, scale=0.3, causal=False, ref=ref, u=unit_roundoff(dtype))
    rounded = ref.out.to(dtype).double()  # what any kernel writing the exact result in `dtype` returns
    assert bool(((rounded - ref.out).abs() <= out_bound).all())
    assert bool((out_bound >= underflow_floor(dtype)).all())
    if dtype == torch.float16:  # below fp16's subnormals: the bound is the floor, no more than a few of its units
        assert float(out_bound.max()) < 4 * underflow_floor(dtype)
