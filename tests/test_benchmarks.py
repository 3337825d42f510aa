"""The benchmark scripts on a CPU: each imports without running anything, and the shared table and figures work on
synthetic rows (no kernel runs here; the timings themselves need the GPU)."""

import importlib
import json
import math
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
SCRIPTS = (
    "common",
    "decode",
    "sparse",
    "indexer",
    "suite",
    "cost_model",
    "dcp",
    "harness",
    "reference_check",
    "stream",
    "warm_timeline",
    "compile_census",
    "power",
    "targets",
)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench():
    """The scripts imported as ``python benchmarks/<name>.py`` sees them (their folder on ``sys.path``)."""
    sys.path.insert(0, BENCH)
    try:
        yield {name: importlib.import_module(name) for name in SCRIPTS}
    finally:
        sys.path.remove(BENCH)
        for name in SCRIPTS:
            sys.modules.pop(name, None)


def _rows(common):
    Row = common.Row
    return [
        Row("decode", "flashmla", {"H": 16, "B": 64, "S_kv": 4096}, 90e-6, 3.0e8, 1.2e11),
        Row("decode", "triton", {"H": 16, "B": 64, "S_kv": 4096}, 180e-6, 3.0e8, 1.2e11),
        Row("decode", "torch", {"H": 16, "B": 64, "S_kv": 4096}, 900e-6, 3.0e8, 1.2e11),
        Row("decode", "read", {"H": 16, "B": 64, "S_kv": 4096}, 60e-6, 3.0e8, 0),  # a floor: no ratio
        Row("decode", "triton", {"H": 128, "B": 64, "S_kv": 4096}, 400e-6, 3.2e8, 9.6e11),  # no reference: "-"
        Row("sparse_prefill", "flashmla", {"S_q": 4096, "S_kv": 8192, "H": 128, "K": 2048}, 4e-3, 1.1e10, 2.3e12),
        Row("sparse_prefill", "triton", {"S_q": 4096, "S_kv": 8192, "H": 128, "K": 2048}, 8e-3, 1.1e10, 2.3e12),
        Row("indexer", "deepgemm", {"S": 8192}, 0.5e-3, 3e8, 4.4e12),
        Row("indexer", "triton", {"S": 8192}, 2e-3, 3e8, 4.4e12),
        Row("topk", "torch", {"S": 8192, "K": 2048}, 1.2e-3, 3e8, 0),
        Row("topk", "triton", {"S": 8192, "K": 2048}, 1.0e-3, 3e8, 0),
    ]


def test_scripts_import_without_running(bench):
    for name in ("decode", "sparse", "indexer", "suite", "dcp"):
        assert callable(bench[name].main)
    assert set(bench["suite"].KERNELS) == set(bench["common"].REFERENCE) - {"decode_sustained"}  # decode's rows


def test_the_sustained_rows_are_the_power_bound_targets_against_flashmla_sustained(bench, monkeypatch):
    """``decode_sustained`` times the 128-head decode at B <= 2 from 64K keys with ``common.sustained`` and takes
    its ratio from FlashMLA's sustained row of the same shape, never from a 50 ms graph timing."""
    common, decode = bench["common"], bench["decode"]
    shapes = [dict(H=h, B=b, S_kv=s) for h in (16, 128) for b in (1, 2, 4, 64) for s in (8192, 65536, 131072)]
    assert [x for x in shapes if decode.power_bound(x)] == [
        dict(H=128, B=b, S_kv=s) for b in (1, 2) for s in (65536, 131072)
    ]
    assert not decode.power_bound(dict(H=128, B=1, S_kv=65536, S_q=2))  # MTP: not the target's decode
    timed = []
    monkeypatch.setattr(common, "sustained", lambda fn, seconds: timed.append(seconds) or (0.0, 1.0, 2e-6))
    monkeypatch.setattr(common, "bench", lambda fn, graph: 1e-6)
    rows, shape = [], dict(H=128, B=1, S_kv=65536)
    for kernel, sustain, provider in [("decode", 0, "flashmla"), ("decode_sustained", 3.0, "flashmla")]:
        common.measure(rows, kernel, provider, shape, None, nbytes=1.0, flops=1.0, graph=True, sustain=sustain)
    rows.append(common.Row("decode_sustained", "triton", shape, 1.6e-6, 1.0, 1.0, "sustained"))
    assert timed == [3.0] and [r.timer for r in rows] == ["graph", "sustained", "sustained"]
    assert common.add_ratios(rows)[-1].ratio == 2e-6 / 1.6e-6  # FlashMLA sustained, not its 1e-6 graph row


def test_table_ratios_come_from_the_same_run_reference(bench):
    common = bench["common"]
    rows = _rows(common)
    table = common.markdown_table(rows)
    lines = table.splitlines()
    assert lines[0].split("|")[1:-1] == [
        " kernel ",
        " shape ",
        " provider ",
        " µs ",
        " GB/s ",
        " TFLOP/s ",
        " vs reference ",
    ]
    cells = {}  # (kernel, shape, provider) -> the "vs reference" cell
    for line in lines[2:]:
        if line.startswith("| "):
            c = [x.strip() for x in line.strip("|").split("|")]
            cells[c[0], c[1], c[2]] = c[6]
    assert cells["decode", "H=16 B=64 S_kv=4096", "triton"] == "0.50x flashmla"  # 90 us / 180 us
    assert cells["decode", "H=16 B=64 S_kv=4096", "flashmla"] == "1.00x flashmla"
    assert cells["decode", "H=16 B=64 S_kv=4096", "torch"] == "0.10x flashmla"
    assert cells["decode", "H=128 B=64 S_kv=4096", "triton"] == "-"  # FlashMLA did not run at this shape
    assert cells["decode", "H=16 B=64 S_kv=4096", "read"] == "floor" and rows[3].ratio is None
    assert cells["sparse_prefill", "S_q=4096 S_kv=8192 H=128 K=2048", "triton"] == "0.50x flashmla"
    assert cells["indexer", "S=8192", "triton"] == "0.25x deepgemm"
    assert cells["topk", "S=8192 K=2048", "triton"] == "1.20x torch"
    assert rows[1].ratio == pytest.approx(0.5) and rows[1].gbps == pytest.approx(3e8 / 180e-6 / 1e9)
    assert rows[1].tflops == pytest.approx(1.2e11 / 180e-6 / 1e12)
    assert "| decode | H=16 B=64 S_kv=4096 | triton | 180.0 | 1667 | 666.7 | 0.50x flashmla |" in table


def test_figures_and_results_files(bench, tmp_path):
    common, suite = bench["common"], bench["suite"]
    rows = _rows(common)
    path = tmp_path / "roofline.png"
    common.plot_roofline(rows, 4.25e12, 7.9e14, str(path), fp8_rate=1.3e15)
    assert path.read_bytes().startswith(PNG)
    common.plot_sweep(
        [r for r in rows if r.kernel == "decode"],
        str(tmp_path / "sweep.png"),
        x="S_kv",
        panel="H",
        series="B",
        ceiling=4250,
    )
    common.plot_bars(rows, str(tmp_path / "bars.png"))
    assert (tmp_path / "sweep.png").read_bytes().startswith(PNG) and (tmp_path / "bars.png").read_bytes()[:8] == PNG
    env = {"gpu": "test card", "roofline": common.Roofline(4.25e12, 7.9e14, None)._asdict()}
    text = suite.write(rows, env, str(tmp_path))
    assert "copy 4250 GB/s" in text and "0.50x flashmla" in text
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["environment"]["gpu"] == "test card"
    assert data["rows"][1]["ratio"] == pytest.approx(0.5) and data["rows"][1]["reference"] == "flashmla"
    assert (tmp_path / "bench.md").read_text() == text


def test_dcp_skips_with_a_message_where_gpus_are_missing(bench, capsys):
    import torch

    n = torch.cuda.device_count() + 1  # one more GPU than this machine has
    assert bench["dcp"].main(["--world-size", str(n)]) == 0
    assert f"skipped: DCP over {n} GPUs needs as many" in capsys.readouterr().out


def test_dcp_speedup_table(bench):
    Row, dcp = bench["common"].Row, bench["dcp"]
    shape = {"H": 128, "B": 2, "S_kv": 1 << 20}
    rows = [
        Row(dcp.KERNEL, "triton 1 GPU", shape, 1e-3, 0, 0),
        Row(dcp.KERNEL, "triton DCP2", shape, 0.5e-3, 0, 0),
        Row(dcp.KERNEL, "triton DCP2 collectives", shape, 0.1e-3, 0, 0),
    ]
    assert dcp.speedup_table(rows, 2).splitlines()[2] == "| 2 | 1048576 | 2000 | 4000 | 2.00x | 100 | 20% |"


def test_dcp_page_says_how_it_timed(bench, tmp_path):
    import types

    Row, dcp = bench["common"].Row, bench["dcp"]
    shape = {"H": 128, "B": 1, "S_kv": 1 << 20}
    rows = [Row(dcp.KERNEL, p, shape, t, 0, 0, "steps") for p, t in (("triton 1 GPU", 2e-3), ("triton DCP2", 1e-3))]
    rows.append(Row(dcp.KERNEL, "triton DCP2 collectives", shape, 0.0, 0, 0, "steps"))
    dcp.write(rows, types.SimpleNamespace(world_size=2, heads=128, out_dir=str(tmp_path)))
    page = (tmp_path / "dcp2.md").read_text()
    assert "timed as eager steps (a capture failed)" in page and "| 1 | 1048576 | 500 | 1000 | 2.00x |" in page
    assert {p.name for p in tmp_path.iterdir()} == {"dcp2.md", "dcp2.json", "dcp2.png"}


def test_a_row_of_no_traffic_and_no_time_goes_in_the_table(bench):
    """The DCP collectives' row is the step's time beyond its decode: 0 where both are within noise (it raised
    ZeroDivisionError on the H100 pair, 2026-11-27)."""
    common = bench["common"]
    rows = [common.Row("dcp_decode", "triton 1 GPU", {"B": 2}, 1e-3, 1e9, 1e12, "graph")]
    rows.append(common.Row("dcp_decode", "triton DCP2 collectives", {"B": 2}, 0.0, 0.0, 0.0, "graph"))
    table = common.markdown_table(rows, {"dcp_decode": "triton 1 GPU"})
    assert "| dcp_decode | B=2 | triton DCP2 collectives | 0.0 | 0 | - | - |" in table.splitlines()
    assert rows[0].gbps == 1000 and rows[0].tflops == 1000


def test_harness_table_and_figure(bench, tmp_path):
    harness = bench["harness"]
    parts = dict(zip(("inputs", "call", "reply", "reference", "wait", "judge"), (9.0, 8.0, 0.5, 20.0, 6.0, 4.0)))
    runs = [harness.Run("cold", 0, 95.0, 400.0, 0, "158 passed", 60.0, "", parts)]
    runs += [
        harness.Run("warm", 0, 50.0, 120.0, 0, "158 passed", 8.0),
        harness.Run("cold", 8, 70.0, 500.0, 0, "158 passed", 9.5),
    ]
    text = harness.markdown(runs, "triton", "full", {"gpu": "H200"}, "python benchmarks/harness.py")
    assert "| parts s: inputs / call / reply / reference / wait / judge |" in text  # the trace's parts, in order
    assert (
        "| cold | 0 | 95.0 | 400.0 | 60.0 | 9.0 / 8.0 / 0.5 / 20.0 / 6.0 / 4.0 | <= 90 missed | 158 passed | 0 |"
        in text
    )
    assert "| warm | 0 | 50.0 | 120.0 | 8.0 | - | <= 60 met | 158 passed | 0 |" in text  # no trace read
    assert "| cold | 8 | 70.0 | 500.0 | 9.5 | - | <= 90 met | 158 passed | 0 |" in text
    harness.plot(runs, str(tmp_path / "harness.png"), "t")
    assert (tmp_path / "harness.png").read_bytes().startswith(PNG)


def test_harness_table_names_the_tree_each_run_imported(bench, tmp_path):
    """``--against``: a code column, this tree's and the other's runs side by side; without it, no column."""
    harness = bench["harness"]
    runs = [harness.Run("warm", "auto", 45.0, 200.0, 0, "308 passed", 7.7, "this tree")]
    runs.append(harness.Run("warm", "auto", 71.0, 700.0, 0, "308 passed", 7.9, "0f559be"))
    text = harness.markdown(runs, "triton", "full", {"gpu": "H100"}, "python benchmarks/harness.py --against x")
    assert "| code | phase | --warm |" in text
    assert "| this tree | warm | auto | 45.0 | 200.0 | 7.7 | - | <= 60 met | 308 passed | 0 |" in text.splitlines()
    assert "| 0f559be | warm | auto | 71.0 | 700.0 | 7.9 | - | <= 60 missed | 308 passed | 0 |" in text.splitlines()
    only = [harness.Run("warm", 0, 1.0, 1.0, 0, "x", 0.5)]
    assert "| code |" not in harness.markdown(only, "triton", "full", {}, "c")
    harness.plot(runs, str(tmp_path / "harness.png"), "t")
    assert (tmp_path / "harness.png").read_bytes().startswith(PNG)


def test_harness_sums_the_judged_workers_backend_seconds(bench, tmp_path):
    """A timed run's ``backend``: the seconds of the backend's calls its results record, summed over the cases, and
    each part of its cases summed from its trace (the calls' part: the same seconds); nan and no parts for a run that
    wrote no results and traced nothing (not the last run's)."""
    from mlaspec.conformance.report import read_jsonl
    from mlaspec.conformance.trace import PARTS

    harness, report = bench["harness"], str(tmp_path / "report")
    run = harness.time_check(["--backend", "torch", "--ops", "merge_attn_states"], report, os.environ, "cold")
    assert run.status == 0 and "passed" in run.counts
    records = read_jsonl(tmp_path / "report" / "results.jsonl")[1]
    assert records and run.backend == sum(r["seconds"] for r in records) > 0
    assert tuple(run.parts) == PARTS and all(t > 0 for t in run.parts.values()), run.parts
    assert run.parts["call"] == pytest.approx(run.backend, abs=1e-4 * len(records))  # 4 decimals a case
    dead = harness.time_check(["--backend", "no-such-backend"], report, os.environ, "cold")  # dies before any case
    assert dead.status not in (0, 1) and math.isnan(dead.backend) and dead.parts == {}


def test_harness_against_alternates_the_trees_over_caches_of_their_own(bench, tmp_path, monkeypatch):
    """``measure(against=...)``: each phase times both trees, the one that goes first alternating (so that over two
    runs each goes first as often), each tree over fresh caches of its own, the other tree's folder first on a
    ``PYTHONPATH`` that keeps what was there."""
    harness = bench["harness"]
    tree = tmp_path / "0f559be"
    for name in harness.SUBPACKAGES:
        (tree / name).mkdir(parents=True)
    calls = []

    def time_check(args, report, env, phase, workers=0, code=""):
        calls.append((phase, code, env.get("PYTHONPATH"), env["TRITON_CACHE_DIR"], env["MLASPEC_CACHE_DIR"]))
        return harness.Run(phase, workers, 1.0, 1.0, 0, "x", 1.0, code)

    monkeypatch.setattr(harness, "time_check", time_check)
    monkeypatch.setenv("PYTHONPATH", "/kept")
    runs = list(harness.measure("torch", "tiny", "bfloat16", 2, against=str(tree)))
    order = [(phase, code) for phase, code, *_ in calls]
    assert order == [
        ("cold", "this tree"), ("cold", "0f559be"), ("warm", "0f559be"), ("warm", "this tree"),
        ("cold", "0f559be"), ("cold", "this tree"), ("warm", "this tree"), ("warm", "0f559be"),
    ]  # fmt: skip
    assert [r.code for r in runs] == [code for _, code in order]
    by_cache = {}
    for phase, code, path, triton_cache, cache in calls:
        kept = path.split(os.pathsep)[code != "this tree" :]  # the other tree's folder first, then what was there
        assert kept == ["/kept"], path
        by_cache.setdefault((triton_cache, cache), []).append((phase, code))
    # four fresh cache folders (two runs x two trees), each one tree's cold run and then its warm run
    assert sorted(by_cache.values()) == sorted([[("cold", c), ("warm", c)] for c in ("this tree", "0f559be")] * 2)


def test_harness_against_imports_the_other_tree(bench, tmp_path):
    """The folder ``--against`` puts first on ``PYTHONPATH`` makes ``import mlaspec`` (and so the CLI and its
    workers) load the other tree's sub-packages, ahead of this checkout's install; a folder that is not a tree of
    the package is refused, naming what it lacks."""
    import subprocess

    harness, root = bench["harness"], os.path.dirname(BENCH)
    tree = tmp_path / "other"
    tree.mkdir()
    for name in harness.SUBPACKAGES:
        (tree / name).symlink_to(os.path.join(root, name))
    folder = harness.package_path(str(tree), str(tmp_path / "path"))
    env = os.environ | {"PYTHONPATH": folder}
    code = "import mlaspec.conformance.cli as c, mlaspec.spec as s; print(c.__file__); print(list(s.__path__)[0])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert all(line.startswith(folder) for line in out.split()), out
    (tmp_path / "half" / "spec").mkdir(parents=True)
    with pytest.raises(ValueError, match="no impl, conformance"):
        harness.package_path(str(tmp_path / "half"), str(tmp_path / "p2"))


def test_reference_check_on_the_cpu(bench):
    worst = bench["reference_check"].check(
        "tiny", ("bfloat16",), __import__("torch").device("cpu"), ("merge_attn_states",)
    )
    assert set(worst) == {"merge_attn_states"} and worst["merge_attn_states"][1] == 0.0


@pytest.mark.interpreter
@pytest.mark.parametrize("programs, block", [(1, 64), (3, 16), (7, 32)])
def test_the_plain_read_reads_every_word_once(bench, programs, block):
    """The decode's ``read`` floor (``benchmarks/stream.py``) loads each 32-bit word of the cache exactly once: the XOR
    of its programs' words is the XOR of all of them (a word read twice cancels, a word skipped is missing), over
    stretches that do not divide evenly; and it takes no tensor it would read wrongly."""
    import numpy as np
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernel through Triton's interpreter")
    g = torch.Generator().manual_seed(programs)
    x = torch.randint(-(2**15), 2**15, (5, 3, 74), generator=g, dtype=torch.int16).to(torch.bfloat16)  # 2220 bytes
    fn, out = bench["stream"].reader(x, programs, block, stages=2, warps=1)
    fn()
    words = x.reshape(-1).view(torch.int32).numpy()
    assert np.bitwise_xor.reduce(out.numpy()) == np.bitwise_xor.reduce(words)
    with pytest.raises(ValueError, match="contiguous"):
        bench["stream"].reader(x.transpose(0, 1), programs, block, 2, 1)
    with pytest.raises(ValueError, match="multiple of 4"):
        bench["stream"].reader(x[..., :1].contiguous(), programs, block, 2, 1)


def test_warm_timeline_reads_a_trace_and_draws_it(bench, tmp_path):
    """A cold run's trace (:data:`mlaspec.conformance.trace.TRACE`) read back: the judged worker's case starts, each
    warm-up's case spans (one killed on its case: no end), the kills, and the cases the judged worker compiled with
    what ran beside them."""
    tl_mod, t0 = bench["warm_timeline"], 1000.0
    events = [
        (1.0, "start"),
        (1.0, "spawn 0 1"),
        (1.0, "spawn 1 2"),
        (1.1, "reached 0"),
        (3.0, "up 0"),
        (3.2, "up 1"),
        (3.3, "begin 0 1"),
        (3.4, "begin 1 2"),
        (3.6, "reached 1"),
        (4.0, "end 0 1"),
        (4.1, "begin 0 3"),
        (4.5, "end 0 3"),
        (5.0, "reached 2"),
        (6.0, "reached 3"),
        (70.0, "kill 1"),
        (70.1, "spawn 1 4"),
    ]
    parts = [(6.5, f"{part} c{i} {0.1 * (i + 1):.4f}") for i in range(4) for part in tl_mod.PARTS]  # by case id
    trace = tmp_path / "trace.txt"
    again = [(6.6, "wait no-such-case 9.0"), (6.7, "wait c0 0.5")]  # an id not in the results; case 0 run again
    trace.write_text("".join(f"{t0 + t:.3f} {e}\n" for t, e in events + parts + again))
    results = [dict(case_id=f"c{i}", seconds=s) for i, s in enumerate([2.5, 0.1, 1.2, 0.01])]
    tl = tl_mod.read(str(trace), results, t0)
    assert tl.reached == pytest.approx({0: 1.1, 1: 3.6, 2: 5.0, 3: 6.0})
    assert tl.slow() == [0, 2]  # the judged calls of 0.5 s or more
    assert tl.beside(1) == [(0, pytest.approx(3.3), pytest.approx(4.0))]
    [(k, b, e)] = tl.beside(2)  # killed on it: no end
    assert (k, b) == (1, pytest.approx(3.4)) and math.isnan(e) and tl.cut[1, 2, b] == pytest.approx(70.0)
    assert tl.kills == [(pytest.approx(70.0), 1)] and len(tl.spawns) == 3 and len(tl.ups) == 2
    text = "\n".join(tl_mod.summary(tl))
    assert "2 processes, 3 starts, 1 kills; up 3.0-3.2 s; their last case ended at 4.5 s" in text
    assert "judged worker while the warm-ups ran: 2 cases in 3.9 s, its calls 2.6 s of it" in text  # cases 0, 1
    assert "judged worker after: 1 cases in 1.0 s, its calls 1.2 s of it" in text  # case 2 (3: no next start)
    assert tl.parts["wait"] == pytest.approx({0: 0.6, 1: 0.2, 2: 0.3, 3: 0.4})  # both of case 0's; no unknown id
    assert "  inputs 0.3 s, call 0.3 s, reply 0.3 s, reference 0.3 s, wait 0.8 s, judge 0.3 s" in text  # cases 0, 1
    assert "case 0 c0: 2.50 s at 1.1 s; no warm-up" in text
    assert "case 2 c2: 1.20 s at 5.0 s; warm-up 1 3.4-nan s" in text
    tl_mod.plot(tl, str(tmp_path / "t.png"), "title")
    assert (tmp_path / "t.png").read_bytes().startswith(PNG)


def test_warm_timeline_cuts_the_cases_a_halt_or_a_new_start_leaves_unfinished(bench, tmp_path):
    """A halt (every warm-up stopped so that a case runs again alone) leaves the cases in flight unfinished, and a
    process that begins a case again after it gets a second span; neither end is taken for the other's."""
    tl_mod = bench["warm_timeline"]
    events = ["1.0 spawn 0 1", "2.0 begin 0 1", "3.0 halt", "4.0 spawn 0 1", "5.0 begin 0 1", "6.0 end 0 1",
              "7.0 begin 0 3", "8.0 begin 0 5", "9.0 end 0 3"]  # fmt: skip
    (tmp_path / "trace.txt").write_text("\n".join(events) + "\n")
    tl = tl_mod.read(str(tmp_path / "trace.txt"), [dict(case_id="c", seconds=0.0)], 0.0)
    assert tl.halts == [3.0]
    (k, b, e), second = tl.beside(1)
    assert (k, b) == (0, 2.0) and math.isnan(e) and tl.cut[0, 1, 2.0] == 3.0 and second == (0, 5.0, 6.0)
    [(_, b3, e3)] = tl.beside(3)  # case 3 was cut off when case 5 began; its end line is not case 5's
    assert b3 == 7.0 and math.isnan(e3) and tl.cut[0, 3, 7.0] == 8.0
    [(_, b5, e5)] = tl.beside(5)  # the run ended on it: cut at the trace's last event
    assert b5 == 8.0 and math.isnan(e5) and tl.cut[0, 5, 8.0] == 9.0
    tl_mod.plot(tl, str(tmp_path / "t.png"), "title")
    assert (tmp_path / "t.png").read_bytes().startswith(PNG)


def test_warm_timeline_draws_a_trace_it_is_given_and_says_why_a_run_left_nothing(bench, tmp_path):
    """``--trace`` draws a run already made (its page and figure); a run that leaves no results is an error naming
    the command and its output, not a missing file further on."""
    tl_mod = bench["warm_timeline"]
    events = ["10.0 reached 0", "10.5 spawn 0 1", "11.0 begin 0 1", "12.0 end 0 1", "12.5 reached 1"]
    (tmp_path / "trace.txt").write_text("\n".join(events) + "\n")
    records = [dict(case_id=f"c{i}", seconds=s) for i, s in enumerate([1.5, 0.01])]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    argv = ["--trace", str(tmp_path / "trace.txt"), "--results", str(tmp_path / "results.jsonl"), "--t0", "10.0"]
    assert tl_mod.main([*argv, "--out-dir", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "warm_timeline.md").read_text()
    assert "case 0 c0: 1.50 s at 0.0 s; no warm-up" in page and "1 processes, 1 starts, 0 kills" in page
    assert (tmp_path / "out" / "warm_timeline.png").read_bytes().startswith(PNG)
    with pytest.raises(SystemExit):  # --trace without the run's results and start
        tl_mod.main(["--trace", str(tmp_path / "trace.txt"), "--out-dir", str(tmp_path / "out")])
    with pytest.raises(RuntimeError, match="no-such-backend"):
        tl_mod.run_traced(["--backend", "no-such-backend"], str(tmp_path / "run"))


def test_warm_timeline_against_runs_both_trees_in_turn_and_sets_them_side_by_side(bench, tmp_path, monkeypatch):
    """``--against --runs 2``: each tree's cold run traced under the environment that imports it, the one that goes
    first alternating; the page sets the runs side by side (wall, warm-ups done, the judged worker's pace and parts)
    and keeps each run's summary."""
    tl_mod, harness = bench["warm_timeline"], bench["harness"]
    tree = tmp_path / "0f192a7"
    for name in harness.SUBPACKAGES:
        (tree / name).mkdir(parents=True)
    calls = []

    def run_traced(check, folder, warm="auto", env=None):  # the other tree's warm-ups end before case 1
        other = env["PYTHONPATH"] != "/kept"  # the other tree's package folder first
        calls.append(other)
        events = ["0.5 reached 0", "1.0 spawn 0 1", "2.0 begin 0 1", f"{2.0 if other else 5.0} end 0 1"]
        events += ["3.0 reached 1", "10.0 reached 2", "10.5 inputs c0 0.25", "10.5 judge c1 0.5"]
        records = [dict(case_id=f"c{i}", seconds=s) for i, s in enumerate([2.0, 0.1, 0.01])]
        os.makedirs(folder)
        trace, results = os.path.join(folder, "t.txt"), os.path.join(folder, "r.jsonl")
        with open(trace, "w") as f:
            f.write("\n".join(events) + "\n")
        with open(results, "w") as f:
            f.write("\n".join(json.dumps(r) for r in records) + "\n")
        return trace, results, 0.0, 12.0 if other else 11.0

    monkeypatch.setattr(tl_mod, "run_traced", run_traced)
    monkeypatch.setenv("PYTHONPATH", "/kept")
    out = tmp_path / "out"
    assert tl_mod.main(["--against", str(tree), "--runs", "2", "--out-dir", str(out)]) == 0
    assert calls == [False, True, True, False]
    page = (out / "warm_timeline.md").read_text()
    rows = [line.strip("| ").split(" | ") for line in page.splitlines() if line.startswith(("| this", "| 0f1"))]
    # this tree: cases 0 and 1 (0.5 -> 3.0 s, 3.0 -> 10.0 s; case 2 has no next start) began while the warm-ups ran;
    # the other: case 0 only, case 1 after
    parts = ["0.2", "0.0", "0.0", "0.0", "0.0"]  # inputs, call, reply, reference, wait
    assert rows[0] == ["this tree", "11.0", "5.0", "2, 9.5, 2.1", *parts, "0.5", "0, 0.0, 0.0", "1, 2.0 s"]
    assert rows[1] == ["0f192a7", "12.0", "2.0", "1, 2.5, 2.0", *parts, "0.0", "1, 7.0, 0.1", "1, 2.0 s"]
    assert [r[0] for r in rows] == ["this tree", "0f192a7", "0f192a7", "this tree"]
    assert page.count("## ") == 4 and page.count("```") == 8 and "## 1: 0f192a7, 12.0 s" in page
    assert (out / "warm_timeline.png").read_bytes().startswith(PNG)


def _entry(folder, key, name, args, warps=4, stages=3):
    """A fake Triton cache entry: ``<name>.json`` and the first line of a ``<name>.ttir`` with ``args``."""
    entry = folder / key
    entry.mkdir(parents=True)
    (entry / f"{name}.json").write_text(json.dumps({"name": name, "num_warps": warps, "num_stages": stages}))
    (entry / f"__grp__{name}.json").write_text("{}")
    (entry / f"{name}.ttir").write_text(
        f"module {{\n  tt.func public @{name}({', '.join(args)}) attributes {{noinline = false}} {{\n"
    )


def test_compile_census_names_what_tells_a_kernels_variants_apart(bench, tmp_path):
    census = bench["compile_census"]
    div = "{tt.divisibility = 16 : i32}"
    ptr = f'%X: !tt.ptr<f16> {div} loc("X"(#loc))'
    desc = '%D: !tt.tensordesc<tensor<64x128xf16, #shared>> loc("D"(#loc))'  # commas and spaces inside brackets
    cache = tmp_path / "cache"
    _entry(cache, "a", "k", [ptr, f"%n: i32 {div} loc(#l)", "%s: i32 loc(#l)", desc])
    _entry(cache, "b", "k", [ptr, "%n: i32 loc(#l)", "%s: i32 loc(#l)", desc])
    _entry(cache, "c", "k", [ptr, "%n: i32 loc(#l)", desc])  # s was 1: a constant
    _entry(cache, "d", "k", [ptr, "%n: i32 loc(#l)", desc])  # c again: another constexpr value
    _entry(cache, "e", "k", [ptr, "%n: i32 loc(#l)", desc], warps=8)
    _entry(cache, "f", "j", ['%X: !tt.ptr<bf16> loc("X"(#loc))'])
    _entry(cache, "g", "j", ['%X: !tt.ptr<f32> loc("X"(#loc))'])
    (cache / "launcher").mkdir()  # not a kernel: skipped
    (cache / "launcher" / "cuda_utils.so").write_bytes(b"")
    rows = census.census(census.read_cache(str(cache)))
    assert [(r.name, r.variants) for r in rows] == [("k", 5), ("j", 2)]
    k, j = rows
    assert k.differing == {"n": ["-", "16"], "s": ["-", "const"]}
    assert k.options == ["4w/3s", "8w/3s"] and k.constexpr_only == 1
    assert (k.dtypes, j.dtypes) == (1, 2) and j.differing == {} and j.constexpr_only == 0
    out = tmp_path / "out"
    with pytest.raises(SystemExit):  # a cache's variants are not compiled again: a usage error, not a silent no-op
        census.main(["--cache", str(cache), "--compile", "--out-dir", str(out)])
    assert not out.exists()
    assert census.main(["--cache", str(cache), "--out-dir", str(out)]) == 0
    page = (out / "compile_census.md").read_text()
    assert "7 variants of 2 kernels" in page and "without int classes" not in page
    assert "| `k` | 5 | 4w/3s, 8w/3s | 1 | `n` -/16; `s` -/const | 1 |" in page
    assert (out / "compile_census.png").read_bytes().startswith(PNG)


def test_compile_census_reads_what_triton_writes(bench, tmp_path):
    """Four specializations of one kernel compiled ahead of time for sm_90 (``tests/census_probe.py``, no GPU) into a
    fresh cache: the census finds the kernel's variants and what tells them apart."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "census_probe.py")
    done = subprocess.run([sys.executable, probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (k,) = bench["compile_census"].census(bench["compile_census"].read_cache(str(tmp_path)))
    assert (k.name, k.variants, k.constexpr_only) == ("copy", 4, 1)
    assert k.differing == {"n": ["-", "16"], "s": ["-", "const"]}


def _census(tmp_path, *args):
    """``compile_census.py`` in a process of its own without ``TRITON_INTERPRET`` (its kernels must be compiled
    ones), its JSON page read back."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(BENCH, "compile_census.py")
    done = subprocess.run(
        [sys.executable, script, *args, "--out-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "compile_census.json").read_text())


def test_compile_census_launches_picks_and_compiles_the_hopper_kernels_without_a_gpu(tmp_path):
    """``--launches``: the tiny decodes' launches as on an H200, where the dispatch picks the Gluon kernels (the
    16-head, 128-head and fp8 ones: 128 heads over either cache run ``split_kernel_lead``, 16 over the fp8 one
    ``split_kernel_fp8_keys``); ``--compile NAMES`` compiles those variants for sm_90 here and reads their resources
    (they spill nothing; the structure of every Gluon kernel is ``test_impl_pipelining.py``'s)."""
    gluon = "split_kernel,split_kernel_lead"
    page = _census(tmp_path, "--launches", "tiny", "--ops", "mla_decode,mla_decode_fp8", "--compile", gluon)
    kernels = {k["name"]: k for k in page["kernels"]}
    assert {"split_kernel", "split_kernel_lead", "split_kernel_fp8_keys", "_mla_decode_combine_kernel"} <= set(kernels)
    compiled = page["compiled"]
    assert {name: len(c) for name, c in compiled.items()} == {k: kernels[k]["variants"] for k in gluon.split(",")}
    for name in gluon.split(","):
        assert all(c["local"] == 0 and 0 < c["registers"] <= 255 for c in compiled[name]), compiled[name]


def test_power_reads_nvidia_smi_and_puts_a_decodes_energy_beside_its_time(bench, tmp_path):
    """``benchmarks/power.py`` on samples as ``nvidia-smi`` writes them: the clock-event bits by name, the samples
    inside a variant's span summarized (a line it cannot read skipped), and a table whose energy over the power
    limit is the time a capped decode takes; the figure is a PNG."""
    power = bench["power"]
    assert power.reasons(0) == "none" and power.reasons(0x5) == "idle, power cap"
    lines = [
        "2026/11/30 03:01:02.100, 1980, 505.0, 0x0000000000000000",
        "2026/11/30 03:01:02.150, 1700, 699.0, 0x0000000000000004",
        "2026/11/30 03:01:02.200, 1600, 701.0, 0x0000000000000004",
        "[N/A], 1980, 500.0, 0x0",
    ]
    samples = power.parse(lines)
    assert [s.mhz for s in samples] == [1980, 1700, 1600]
    assert samples[1].t - samples[0].t == pytest.approx(0.05, abs=1e-3)
    spans = power.summarize(samples, samples[1].t, samples[2].t)
    assert spans == dict(mhz=1650, mhz_min=1600, watts=700.0, reasons="power cap")
    assert power.summarize(samples, 0, 1) is None
    shape, ramp = "H128 B2 128K", [140e-6, 145e-6, 150e-6, 151e-6]
    rows = [
        dict(shape=shape, variant="as landed", seconds=150e-6, mj=105.0, burst=ramp, **spans),
        dict(shape=shape, variant="compute alone", seconds=124e-6, mj=62.6, burst=None, mhz=1980, mhz_min=1980,
             watts=505.0, reasons="none"),
    ]  # fmt: skip
    text = power.table(rows, 700.0)
    assert "| H128 B2 128K | as landed | 150.0 | 1650 / 1600 | 700 | 105.0 | 150.0 | power cap |" in text
    assert "| 89.4 | none |" in text  # 62.6 mJ at 700 W: 89.4 us, under its 124 us
    assert "| H128 B2 128K | as landed | 140.0 | 145.0 | 150.0 | 151.0 |" in text
    out = tmp_path / "power.png"
    power.plot(rows, 700.0, str(out))
    assert out.read_bytes().startswith(PNG)


def _decode(common, heads, batch, keys, provider, us, nbytes):
    return common.Row("decode", provider, {"H": heads, "B": batch, "S_kv": keys}, us * 1e-6, nbytes, 1e11)


def test_targets_are_judged_from_the_runs_own_rows(bench):
    """Issue 18's targets over one run's rows: met where every shape meets the bound, else the shapes that miss it,
    marked where the plain read of that cache, timed beside it, misses too; targets without rows left out."""
    common = bench["common"]
    rows = [
        *(_decode(common, 16, 1, 65536, p, us, 1.5e8) for p, us in (("flashmla", 60), ("triton", 26), ("read", 18))),
        *(_decode(common, 16, 2, 65536, p, us, 1.5e8) for p, us in (("flashmla", 64), ("triton", 42), ("read", 35))),
        *(_decode(common, 16, 1, 1024, p, us, 1.2e6) for p, us in (("flashmla", 15), ("triton", 6), ("read", 1.7))),
        common.Row("indexer_graph", "deepgemm", {"S": 1024}, 13.6e-6, 1e7, 1e10),
        common.Row("indexer_graph", "triton", {"S": 1024}, 14.4e-6, 1e7, 1e10),
    ]
    text = bench["targets"].section(rows, 4.25e12)
    table = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    lines = {line.split(" | ")[0][2:]: line for line in table}
    assert "4250 GB/s" in text and not any("128 heads" in name or "sparse" in name for name in lines), text
    # 60/26 = 2.3x, 64/42 = 1.52x; 2x asks 32 us at B2, where the read takes 35
    two = lines["16 heads >= 2x FlashMLA, B <= 2, 64K-128K"]
    assert "1.52x - 2.31x over 2 shapes" in two, two
    assert "missed at 1 of 2: H=16 B=2 S_kv=65536 1.52x (read misses too)" in two, two
    assert lines["the same at >= 2.5 TB/s"].endswith("| 3.57 TB/s - 5.77 TB/s over 2 shapes | met at all 2 |")
    # 85% of 4.25 TB/s: B2 64K at 84% (its read 101%), B1 1K at 5% (its read 17%), B1 64K 136%
    copy = lines[">= 85% of the copy rate at every memory-bound decode shape (16 heads)"]
    assert "missed at 2 of 3: H=16 B=1 S_kv=1024 5% (read misses too), H=16 B=2 S_kv=65536 84% |" in copy, copy
    assert lines["stretch: indexer logits >= 0.9x DeepGEMM (graph replays)"].endswith("| 0.94x | met |")


def test_the_suite_page_ends_with_the_targets_and_a_saved_run_gives_them_again(bench, tmp_path, capsys):
    common, suite = bench["common"], bench["suite"]
    rows = [_decode(common, 16, 1, 65536, p, us, 1.5e8) for p, us in (("flashmla", 60), ("triton", 26))]
    env = {"gpu": "H200", "roofline": {"copy_bw": 4.25e12, "bf16": 7.9e14}}
    page = suite.write(rows, env, str(tmp_path))
    section = page[page.index("## Issue 18's targets in this run") :]
    assert "| 2.31x | met |" in section
    assert bench["targets"].main([str(tmp_path / "bench.json")]) == 0
    assert capsys.readouterr().out.strip() == section.strip()
    other = [common.Row("topk", "triton", {"S": 8192, "K": 2048}, 1e-3, 3e8, 0)]
    assert "targets" not in suite.write(other, env, str(tmp_path))  # a page of other kernels: no section
