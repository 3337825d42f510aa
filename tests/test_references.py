"""The disk cache of references and budgets, and references computed on another device
(:mod:`mlaspec.conformance.references`)."""

import dataclasses
import math
import os

import pytest
import torch

from mlaspec.conformance import cli, references
from mlaspec.conformance.cases import Case, case_by_id, curated_cases
from mlaspec.conformance.ops import DTYPES, OPS, unit_roundoff
from mlaspec.conformance.references import ReferenceCache, cache_key, reference

DECODE = "mla_decode[v3-tp8-bfloat16]"  # judged by budgets
COMPARED = "gather_cache[v3-context-chunk-seq-starts-bfloat16]"  # judged by compare: no budgets


def _bits(x):
    """Every tensor of ``x`` as its bytes (NaN equals NaN), anything else as it is."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, tuple(x.shape), x.contiguous().view(torch.uint8).tolist() if x.numel() else [])
    if isinstance(x, (tuple, list)):
        return [_bits(v) for v in x]
    return x


def _reference(case, cache, *, numerics=(), scale="tiny", device="cpu", calls=None):
    op = OPS[case.op]

    def inputs():
        if calls is not None:
            calls.append(case.id)
        return op.make_inputs(case)

    u = unit_roundoff(DTYPES[case.dtype])
    return reference(op, case, inputs, u, scale=scale, numerics=numerics, device=torch.device(device), cache=cache)


@pytest.mark.parametrize("case_id", [DECODE, COMPARED])
def test_a_hit_is_bit_identical_and_builds_no_inputs(tmp_path, case_id):
    case, cache, calls = case_by_id(case_id), ReferenceCache(tmp_path), []
    first = _reference(case, cache, calls=calls)
    again = _reference(case, cache, calls=calls)
    assert calls == [case.id]  # the second came from the disk
    assert _bits(again) == _bits(first)
    assert _bits(_reference(case, None)) == _bits(first)  # and equals what no cache computes
    assert len(list(tmp_path.rglob("*.pt"))) == 1


def test_a_warm_run_builds_no_inputs_for_an_op_judged_by_budgets(tmp_path, monkeypatch):
    """With every reference and budget in the cache, the run's own process builds no inputs for any op judged by
    budgets (the judged worker builds its own): the sparse, indexer and V4 ops computed their budgets from the inputs
    at judge time, in every run, until they moved to ``bounds`` (2026-11-29)."""
    from mlaspec.conformance.runner import run_case
    from mlaspec.conformance.worker import WorkerBackend

    budgeted = [op for op in OPS.values() if op.compare is None]
    assert {"sparse_prefill", "sparse_decode", "v4_attention", "indexer_logits"} <= {op.name for op in budgeted}
    cases = [next(c for c in curated_cases(ops=(op.name,), dtypes=("float16",))) for op in budgeted]
    built = []
    for op in budgeted:
        counted = dataclasses.replace(op, make_inputs=lambda c, f=op.make_inputs: built.append(c.op) or f(c))
        monkeypatch.setitem(OPS, op.name, counted)  # the run's process only: the worker imports its own
    cache = ReferenceCache(tmp_path)
    with WorkerBackend("torch", timeout=120) as backend:
        cold = [run_case(backend, c, backend_name="torch", cache=cache).verdict for c in cases]
        assert sorted(built) == sorted(c.op for c in cases)  # cold: each once, for its reference and budgets
        built.clear()
        warm = [run_case(backend, c, backend_name="torch", cache=cache).verdict for c in cases]
    assert built == [] and cold == warm == ["pass"] * len(cases), (built, cold, warm)


def test_every_key_part_misses(tmp_path):
    case = case_by_id(DECODE)
    cache = ReferenceCache(tmp_path)
    key = cache_key(case, scale="tiny", numerics=(), device=torch.device("cpu"), op=OPS[case.op])
    cache.store(key, (torch.ones(2),), None)
    assert cache.load(key) is not None
    for part in key:
        assert cache.load({**key, part: "other"}) is None, part
    # and what a run changes changes the key: the case, its dtype, the scale, the numerics, the device
    other = case_by_id("mla_decode[v3-tp8-float16]")
    moved = Case(case.op, case.name, case.dtype, {**case.params, "B": case.params["B"] + 1})
    keys = [
        cache_key(other, scale="tiny", numerics=(), device=torch.device("cpu")),
        cache_key(moved, scale="tiny", numerics=(), device=torch.device("cpu")),
        cache_key(case, scale="full", numerics=(), device=torch.device("cpu")),
        cache_key(case, scale="tiny", numerics=("p_in_e4m3",), device=torch.device("cpu")),
        cache_key(case, scale="tiny", numerics=(), device=torch.device("meta")),
    ]
    assert all(cache.load(k) is None for k in keys)
    assert len({cache.path(k) for k in [key, *keys]}) == 6


def test_the_numerics_in_force_are_their_own_entries(tmp_path):
    case = case_by_id(DECODE)
    cache, calls = ReferenceCache(tmp_path), []
    exact = _reference(case, cache, calls=calls)
    coarse = _reference(case, cache, numerics=("fp8_mma_accumulation",), calls=calls)
    assert calls == [case.id, case.id]
    assert not torch.equal(exact[1][1], coarse[1][1])  # the LSE budget: a coarser accumulator


def test_the_spec_version_follows_the_sources(tmp_path, monkeypatch):
    for pattern in references._SOURCES:
        for path in references._PACKAGE.glob(pattern):
            target = tmp_path / path.relative_to(references._PACKAGE)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    monkeypatch.setattr(references, "_PACKAGE", tmp_path)
    references._package_hash.cache_clear()
    try:
        before = references.spec_version()
        with open(tmp_path / "spec" / "attention.py", "a") as f:
            f.write("\n# a changed spec\n")
        references._package_hash.cache_clear()
        assert references.spec_version() != before
    finally:
        references._package_hash.cache_clear()


def test_an_op_registered_elsewhere_hashes_its_own_file(tmp_path):
    module = tmp_path / "my_op.py"
    module.write_text("def inputs(case):\n    return {}\n")
    namespace = {}
    exec(compile(module.read_text(), str(module), "exec"), namespace)
    op = dataclasses.replace(OPS["mla_decode"], make_inputs=namespace["inputs"])
    assert references.spec_version(op) != references.spec_version(OPS["mla_decode"])


@pytest.mark.parametrize("garbage", [b"", b"not a torch file", None])
def test_a_corrupt_entry_is_recomputed(tmp_path, garbage):
    case = case_by_id(DECODE)
    cache, calls = ReferenceCache(tmp_path), []
    first = _reference(case, cache, calls=calls)
    (path,) = tmp_path.rglob("*.pt")
    if garbage is None:  # a valid file of another key (a hash collision, a file moved by hand)
        key = cache_key(case_by_id("mla_decode[v3-tp8-float16]"), scale="tiny", numerics=(), device="cpu")
        cache.store(key, (torch.zeros(1),), None)
        path.write_bytes(cache.path(key).read_bytes())
    else:
        path.write_bytes(garbage)
    again = _reference(case, cache, calls=calls)
    assert calls == [case.id, case.id]
    assert _bits(again) == _bits(first)
    assert cache.load(cache_key(case, scale="tiny", numerics=(), device="cpu", op=OPS[case.op])) is not None


def test_a_cache_that_cannot_be_written_is_no_error(tmp_path):
    (tmp_path / "file").write_text("")
    case = case_by_id(DECODE)
    assert _bits(_reference(case, ReferenceCache(tmp_path / "file" / "below"))) == _bits(_reference(case, None))


def test_where_the_cache_lives(monkeypatch, tmp_path):
    monkeypatch.delenv("MLASPEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert references.cache_dir() == tmp_path / "xdg" / "mlaspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert references.cache_dir() == tmp_path / "home" / ".cache" / "mlaspec"
    monkeypatch.setenv("MLASPEC_CACHE_DIR", str(tmp_path / "mine"))
    assert references.cache_dir() == tmp_path / "mine"


def _check(tmp_path, *extra):
    return cli.main(
        ["check", "--case", DECODE, "--case", COMPARED, "--isolation", "none", "--report", str(tmp_path / "r"), *extra]
    )


def test_check_caches_and_no_cache_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MLASPEC_CACHE_DIR", str(tmp_path / "cache"))
    assert _check(tmp_path, "--no-cache") == 0
    assert not (tmp_path / "cache").exists()
    assert _check(tmp_path) == 0
    assert len(list((tmp_path / "cache").rglob("*.pt"))) == 2
    assert _check(tmp_path) == 0  # warm: the same verdicts from the disk


def test_the_default_run_judges_alike_cold_and_warm(tmp_path, monkeypatch):
    """Every tiny curated case of a few ops (both kinds: budgets and compare) gets the same verdict and the same
    worst error ratio with no cache, a cold cache and a warm one."""
    from mlaspec.conformance.backend import load_backend
    from mlaspec.conformance.runner import run_cases

    cases = curated_cases(ops=("mla_decode", "gather_cache", "build_metadata"))
    backend = load_backend("torch")

    def run(cache):
        return [(r.case_id, r.verdict, r.metrics) for r in run_cases(backend, cases, backend_name="torch", cache=cache)]

    cache = ReferenceCache(tmp_path)
    assert run(None) == run(cache) == run(cache)


def test_reference_device_auto(monkeypatch):
    monkeypatch.delenv("MLASPEC_DEVICE", raising=False)
    assert references.reference_device("auto", None) == torch.device("cpu")
    assert references.reference_device("cpu", object()) == torch.device("cpu")
    backend = type("B", (), {"device": torch.device("cuda:1")})()
    expected = torch.device("cuda:1") if torch.cuda.is_available() else torch.device("cpu")
    assert references.reference_device("auto", backend) == expected
    monkeypatch.setenv("MLASPEC_DEVICE", "cuda")
    assert references.reference_device("auto", None).type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_to_device_goes_through_containers():
    @dataclasses.dataclass(frozen=True)
    class Plan:  # as CommonAttentionMetadata: a frozen record of tensors and ints
        lens: torch.Tensor
        n: int

    inputs = dict(q=torch.ones(2), plan=Plan(torch.ones(3), 3), chunks=[(torch.ones(1), 4)], scale=0.5)
    moved = references.to_device(inputs, torch.device("meta"))
    assert moved["q"].is_meta and moved["plan"].lens.is_meta and moved["chunks"][0][0].is_meta
    assert (moved["plan"].n, moved["chunks"][0][1], moved["scale"]) == (3, 4, 0.5)
    assert not inputs["q"].is_meta  # the CPU inputs stay as they were


def test_device_disagreement_on_the_cpu_is_zero():
    for case_id in (DECODE, COMPARED):
        gaps = references.device_disagreement(case_by_id(case_id), torch.device("cpu"))
        assert gaps and set(gaps.values()) == {0.0}


def test_a_gap_is_measured_against_the_budget():
    a = torch.tensor([1.0, math.inf, 2.0], dtype=torch.float64)
    assert references._relative_gap(a, a + torch.tensor([1e-3, 0.0, 0.0]), torch.tensor(1.0)) == pytest.approx(1e-3)
    assert references._relative_gap(a, torch.tensor([1.0, math.nan, 2.0]), None) == math.inf
    assert references._relative_gap(torch.tensor([1, 2]), torch.tensor([1, 3]), None) == math.inf


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", curated_cases(scale="full"), ids=str)
def test_full_scale_references_agree_on_cuda(case):
    """A reference and its budgets computed on the GPU are the CPU's within ``DEVICE_AGREEMENT`` of the budget (the
    order of float64 additions differs; ``docs/conformance.md``, "Where references are computed")."""
    gaps = references.device_disagreement(case, torch.device("cuda"))
    assert max(gaps.values()) <= references.DEVICE_AGREEMENT, gaps


def test_tests_do_not_write_the_users_cache():
    assert os.environ["MLASPEC_CACHE_DIR"]


def test_a_reference_that_breaks_on_the_device_is_computed_on_the_cpu(tmp_path, monkeypatch):
    """The fallback: a reference that raises off the CPU (here: every one on ``meta``, which has no values) is
    computed on the CPU with a warning, stored under the CPU's key, and read from there the next time (after the device
    is tried again: it may work then)."""
    case, cache, calls = case_by_id(DECODE), ReferenceCache(tmp_path), []
    monkeypatch.setattr(references, "_WARNED", set())
    with pytest.warns(UserWarning, match="on the CPU"):
        first = _reference(case, cache, device="meta", calls=calls)
    assert _bits(first) == _bits(_reference(case, None))
    again = _reference(case, cache, device="meta", calls=calls)
    assert _bits(again) == _bits(first)
    assert calls == [case.id] * 3  # built for meta and for the CPU, then for meta again (the runner builds once)


def test_a_bad_reference_device_is_a_usage_error(tmp_path, capsys):
    assert _check(tmp_path, "--reference-device", "bogus") == 2
    err = capsys.readouterr().err
    assert "--reference-device must be 'auto' or a device" in err and not (tmp_path / "r").exists()
