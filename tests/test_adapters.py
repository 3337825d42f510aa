"""The kernel adapters on a CPU machine: they import, refuse to construct with a clear reason, their pure
translations agree with the spec, torch_sdpa passes the dense cases, and the matrix writes its two files."""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import math
import os
import re
from contextlib import redirect_stdout

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.conformance import backend as backend_mod
from mlaspec.conformance.backends.common import (
    import_first,
    importable,
    ln_to_log2,
    log2_to_ln,
    pad_heads,
    pad_last,
    page_kv,
)
from mlaspec.conformance.backends.deepgemm import absolute_from_kernel, expand_context_lens, mask_paged_tail
from mlaspec.conformance.backends.flashinfer import page_table_csr
from mlaspec.conformance.backends.flashmla import quantize_sparse_cache
from mlaspec.conformance.backends.torch_fp8 import TorchFP8, decode_records
from mlaspec.conformance.backends.vllm import num_kv_splits
from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.cli import main
from mlaspec.conformance.matrix import KNOWN_BACKENDS, _word, run_matrix, write_matrix
from mlaspec.conformance.runner import run_case
from mlaspec.spec import cache_layouts as cl
from mlaspec.spec.batch import Request
from mlaspec.spec.indexer import absolute_to_compressed, indexer_logits

ADAPTERS = ["flashmla", "deepgemm", "flashinfer", "torch_sdpa", "vllm", "common", "torch_fp8"]
KERNEL_BACKENDS = {
    "flashmla": "flash_mla not installed",
    "deepgemm": "deep_gemm not installed",
    "flashinfer": "flashinfer not installed",
}


@pytest.mark.parametrize("module", ADAPTERS)
def test_every_adapter_module_imports(module):
    importlib.import_module(f"mlaspec.conformance.backends.{module}")


@pytest.mark.parametrize("name", sorted(KERNEL_BACKENDS))
def test_kernel_backend_without_its_library_raises_with_the_reason(name):
    lib = {"flashmla": "flash_mla", "deepgemm": "deep_gemm", "flashinfer": "flashinfer"}[name]
    if importable(lib):
        pytest.skip(f"{lib} is installed here")
    with pytest.raises(ImportError, match=KERNEL_BACKENDS[name]) as info:
        backend_mod.load_backend(KNOWN_BACKENDS[name])
    assert "vendor" in str(info.value)


def test_vllm_backend_without_cuda_interpreter_or_sources_raises(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    if importable("vllm.v1.attention.backends.utils"):
        pytest.skip("vllm is installed here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MLASPEC_VLLM_WHEEL_DIR", raising=False)
    with pytest.raises(RuntimeError, match="need CUDA.*metadata helpers not loaded.*MLASPEC_VLLM_WHEEL_DIR"):
        backend_mod.load_backend(KNOWN_BACKENDS["vllm"])


def test_vllm_sources_missing_is_a_clear_import_error(monkeypatch, tmp_path):
    from mlaspec.conformance.backends.vllm import find_vllm_source

    if importable("vllm.v1.attention.ops.triton_merge_attn_states"):
        pytest.skip("vllm is installed here")
    monkeypatch.delenv("MLASPEC_VLLM_WHEEL_DIR", raising=False)
    with pytest.raises(ImportError, match="MLASPEC_VLLM_WHEEL_DIR"):
        find_vllm_source()
    monkeypatch.setenv("MLASPEC_VLLM_WHEEL_DIR", str(tmp_path))
    with pytest.raises(ImportError, match="neither"):
        find_vllm_source()


def test_import_first_names_every_attempt():
    with pytest.raises(ImportError, match="no_such_a: .*no_such_b") as info:
        import_first("no_such_a", "no_such_b", what="thing", hint="install it")
    assert "thing not installed (install it)" in str(info.value)


def test_backends_command_lists_the_adapters_as_not_usable(monkeypatch):
    monkeypatch.setattr(backend_mod, "available_backends", lambda: dict(KNOWN_BACKENDS))
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["backends"]) == 0
    lines = {line.split()[0]: line for line in buf.getvalue().splitlines() if line.strip()}
    assert set(KNOWN_BACKENDS) <= set(lines)
    for name, reason in KERNEL_BACKENDS.items():
        if not importable({"flashmla": "flash_mla", "deepgemm": "deep_gemm", "flashinfer": "flashinfer"}[name]):
            assert f"not usable: ImportError: {reason}" in lines[name]
    assert "usable (" in lines["torch_sdpa"] and "attention" in lines["torch_sdpa"]


def test_backends_command_aligns_its_columns_to_the_longest_name(monkeypatch):
    """``triton-e4m3`` is longer than the names before it: every row's target still starts in one column."""
    spec = "mlaspec.conformance.backends.reference:SpecBackend"
    monkeypatch.setattr(backend_mod, "available_backends", lambda: {"s": spec, "a-name-of-fifteen": spec})
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["backends"]) == 0
    lines = [line for line in buf.getvalue().splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].index(spec) == lines[1].index(spec) == len("a-name-of-fifteen") + 1


# -- translations ----------------------------------------------------------------------------------------------------
def test_page_kv_round_trips_with_shuffled_blocks_and_nan_elsewhere():
    kv = torch.randn(3, 10, 5, dtype=torch.float64)
    lens = torch.tensor([10, 4, 0])
    paged = page_kv(kv, 4, seqlens=lens, seed=3)
    assert paged.block_table.dtype == torch.int32 and paged.seqlens.dtype == torch.int32
    flat = paged.cache.reshape(-1, 5)
    seen = torch.zeros(flat.shape[0], dtype=torch.bool)
    for b in range(3):
        for t in range(int(lens[b])):
            slot = int(paged.block_table[b, t // 4]) * 4 + t % 4
            assert torch.equal(flat[slot], kv[b, t])
            seen[slot] = True
    assert torch.isnan(flat[~seen]).all()  # every slot nobody owns is NaN
    owned = paged.block_table[0, :3].tolist()
    assert owned != sorted(owned) or owned[0] != 0  # physical blocks are not the identity


def test_page_kv_rejects_bad_lengths():
    with pytest.raises(ValueError, match="seq_lens"):  # checked by the spec's page_entries, in its own words
        page_kv(torch.zeros(2, 3, 1), 2, seqlens=torch.tensor([4, 1]))


def test_log2_lse_converts_to_the_natural_log():
    s = torch.randn(4, 7, dtype=torch.float64) * 5
    ln = torch.logsumexp(s, -1)
    log2 = torch.log2(torch.exp2(s * math.log2(math.e)).sum(-1))  # FlashInfer's base-2 LSE
    assert torch.allclose(log2_to_ln(log2).double(), ln, rtol=1e-6)
    assert torch.allclose(ln_to_log2(ln).double(), log2, rtol=1e-6)
    inf = torch.tensor([math.inf, -math.inf])
    assert torch.equal(log2_to_ln(inf), inf.float()) and torch.equal(ln_to_log2(inf), inf.float())


def test_compressed_logits_expand_to_the_spec_absolute_columns():
    g = torch.Generator().manual_seed(0)
    m, n, h, d = 5, 12, 3, 8
    q, k, w = torch.randn(m, h, d, generator=g), torch.randn(n, d, generator=g), torch.rand(m, h, generator=g)
    ks, ke = torch.tensor([0, 0, 3, 5, 7]), torch.tensor([2, 3, 9, 5, 12])
    ref = indexer_logits(q, k, w, ks, ke)
    comp = absolute_to_compressed(ref, ks, ke).float()
    comp = torch.where(torch.isinf(comp), torch.tensor(123.0), comp)  # DeepGEMM leaves the tail uninitialised
    got = absolute_from_kernel(comp, ks, ke, n, compressed=True)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert torch.allclose(got.double()[torch.isfinite(ref)], ref[torch.isfinite(ref)], rtol=1e-6)
    garbage = torch.where(torch.isinf(ref), torch.tensor(7.0, dtype=torch.float64), ref)  # an uncleaned absolute row
    got_abs = absolute_from_kernel(garbage, ks, ke, n, compressed=False)
    assert torch.equal(torch.isinf(got_abs), torch.isinf(ref))


def test_context_lens_expand_by_the_spec_rule_and_the_tail_is_masked():
    lens = expand_context_lens(torch.tensor([5, 1]), 2)
    assert lens.tolist() == [[4, 5], [0, 1]] and lens.dtype == torch.int32
    two_d = torch.tensor([[3, 4]], dtype=torch.int32)
    assert expand_context_lens(two_d, 2) is not None and expand_context_lens(two_d, 2).tolist() == [[3, 4]]
    got = mask_paged_tail(torch.ones(4, 6), lens, 5)
    assert got.shape == (4, 5)
    assert torch.isinf(got).sum(1).tolist() == [1, 0, 5, 4]


def test_sparse_cache_is_the_spec_layout_and_refuses_what_it_cannot_hold():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 576, generator=g, dtype=torch.float64)
    exact = cl.dequantize(cl.quantize(x, cl.FP8_DS_MLA_V32, pow2_scales=True).raw, cl.FP8_DS_MLA_V32).entries
    exact[5] = math.nan  # a hostile unused slot
    pages = quantize_sparse_cache(exact)
    assert pages.shape == (2, 64, 1, 656) and pages.dtype == torch.uint8
    base = pages.as_strided((2, cl.page_bytes(cl.FP8_DS_MLA_V32, 64)), (pages.stride(0), 1))
    back = cl.dequantize(cl.from_pages(base, cl.FP8_DS_MLA_V32, 64)[:70], cl.FP8_DS_MLA_V32).entries
    keep = torch.arange(70) != 5
    assert torch.equal(back[keep], exact[keep])
    assert (cl.from_pages(base, cl.FP8_DS_MLA_V32, 64)[5] == 0xFF).all()
    with pytest.raises(ValueError, match="not exactly representable"):
        quantize_sparse_cache(x)
    v4 = cl.dequantize(cl.quantize(x[:, :512], cl.FP8_DS_MLA_V4).raw, cl.FP8_DS_MLA_V4).entries
    assert quantize_sparse_cache(v4).shape == (2, 64, 1, 584)


def test_padding_changes_nothing_it_keeps():
    q = torch.randn(2, 3, 5)
    p = pad_heads(q, 8, 1)
    assert p.shape == (2, 8, 5) and torch.equal(p[:, :3], q) and (p[:, 3:] == 0).all()
    idx = torch.arange(6, dtype=torch.int32).reshape(1, 6)
    assert pad_last(idx, 4, -1).tolist() == [[0, 1, 2, 3, 4, 5, -1, -1]]
    with pytest.raises(ValueError, match="heads"):
        pad_heads(q, 2, 1)


def test_page_table_csr_lists_each_request_pages():
    table = torch.tensor([[4, 1, 7], [2, 7, 7]])
    indptr, indices = page_table_csr(table, torch.tensor([9, 3]), 4)
    assert indptr.tolist() == [0, 3, 4] and indices.tolist() == [4, 1, 7, 2]


def test_num_kv_splits_follows_triton_mla():
    assert [num_kv_splits(n, 132) for n in (1, 600, 1100, 4096, 10**7)] == [1, 1, 2, 8, 264]


# -- torch_sdpa runs -------------------------------------------------------------------------------------------------
DENSE = curated_cases(dtypes=("bfloat16",), ops=("attention", "mla_decode"))


@pytest.mark.parametrize("case", DENSE, ids=lambda c: c.id)
def test_torch_sdpa_passes_the_dense_cases_on_cpu(case):
    from mlaspec.conformance.backends.torch_sdpa import TorchSDPABackend

    r = run_case(TorchSDPABackend(device="cpu"), case, backend_name="torch_sdpa")
    if r.verdict == "skip":
        assert "S_kv > 0" in r.reason
    else:
        assert r.verdict == "pass", r.reason


def test_torch_sdpa_mode_sdpa_also_passes():
    from mlaspec.conformance.backends.torch_sdpa import TorchSDPABackend

    b = TorchSDPABackend(device="cpu", mode="sdpa")
    for case in curated_cases(dtypes=("float16",), ops=("attention",))[:2]:
        r = run_case(b, case, backend_name="torch_sdpa")
        assert r.verdict == "pass", r.reason
    with pytest.raises(ValueError, match="MLASPEC_SDPA_MODE"):
        TorchSDPABackend(device="cpu", mode="nope")


# -- the matrix ------------------------------------------------------------------------------------------------------
def test_matrix_writes_markdown_and_json(tmp_path):
    ops = ("attention", "merge_attn_states")
    data = run_matrix(["spec", "torch", "torch_sdpa", "flashmla"], out_dir=tmp_path, ops=ops)
    md, js = write_matrix(data, tmp_path)
    text = md.read_text()
    assert "### `attention`" in text and "| mha-causal-bfloat16 | " + _word("pass") + " 0 |" in text
    assert "`torch_sdpa`" in text and "x torch_sdpa does not implement merge_attn_states" in text
    assert "Not run by `flashmla`." in text
    assert not re.search(r"(^|[\s(])/\w", text), "a machine path on the page"
    loaded = json.loads(js.read_text())
    assert loaded["backends"]["spec"]["usable"] and "python" in loaded["environment"]
    if not importable("flash_mla"):
        assert not loaded["backends"]["flashmla"]["usable"] and "flash_mla not installed" in text
    assert (tmp_path / "torch" / "results.jsonl").exists()
    verdicts = {r["verdict"] for r in loaded["backends"]["torch"]["results"]}
    assert verdicts == {"pass"}


def test_matrix_cli(tmp_path):
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["matrix", "--backends", "spec", "--ops", "merge_attn_states", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "matrix.md").exists() and "matrix:" in buf.getvalue()


def test_matrix_merge_keeps_other_backends(tmp_path):
    with redirect_stdout(io.StringIO()):
        main(["matrix", "--backends", "spec", "--ops", "merge_attn_states", "--out", str(tmp_path)])
        main(["matrix", "--backends", "torch", "--ops", "merge_attn_states", "--out", str(tmp_path), "--merge"])
    data = json.loads((tmp_path / "matrix.json").read_text())
    assert list(data["backends"]) == ["spec", "torch"]
    assert f"| tp8-bfloat16 | {_word('pass')} 0 | {_word('pass')}" in (tmp_path / "matrix.md").read_text()


def test_matrix_merge_of_a_few_ops_keeps_the_other_cases(tmp_path):
    """A re-run of one op with --merge replaces that op's cells (matrix and results.jsonl) and keeps every other
    case of every backend."""
    with redirect_stdout(io.StringIO()):
        main(["matrix", "--backends", "spec,torch", "--ops", "merge_attn_states,attention", "--out", str(tmp_path)])
        before = json.loads((tmp_path / "matrix.json").read_text())
        main(["matrix", "--backends", "spec", "--ops", "attention", "--out", str(tmp_path), "--merge"])
    after = json.loads((tmp_path / "matrix.json").read_text())
    assert [c["id"] for c in after["cases"]] == [c["id"] for c in before["cases"]]
    for name in ("spec", "torch"):
        assert [r["case_id"] for r in after["backends"][name]["results"]] == [c["id"] for c in before["cases"]]
    lines = (tmp_path / "spec" / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["case_id"] for x in lines) == sorted(c["id"] for c in before["cases"])
    assert "merge_attn_states" in (tmp_path / "matrix.md").read_text()


# -- vllm's own metadata helpers on CPU (needs vLLM 0.33's utils.py + backend.py: skipped in CI) ----------------------
def _vllm_033_source():
    """A folder or wheel holding vLLM 0.33's ``utils.py`` and ``backend.py``, or None (CI fetches no 400 MB wheel)."""
    from pathlib import Path

    from mlaspec.conformance.backends.vllm import BACKEND, UTILS

    env = os.environ.get("MLASPEC_VLLM_WHEEL_DIR")
    repo = Path(__file__).resolve().parents[1] / ".vendor" / "vllm-py"
    for folder in ([Path(env)] if env else []) + [repo]:
        if (folder / UTILS).exists() and (folder / BACKEND).exists():
            return folder
    wheels = sorted((Path.home() / ".cache" / "mla-vendor").glob("vllm-0.33.0-*.whl"))
    return wheels[0] if wheels else None


VLLM_033 = _vllm_033_source()
needs_vllm_033 = pytest.mark.skipif(
    VLLM_033 is None,
    reason="vLLM 0.33 sources not available (no .vendor/vllm-py, "
    "no ~/.cache/mla-vendor wheel, no MLASPEC_VLLM_WHEEL_DIR)",
)
METADATA_OPS = (
    "split_decodes_and_prefills",
    "reorder_batch_to_split_decodes_and_prefills",
    "make_local_attention_virtual_batches",
)


@pytest.fixture(scope="module")
def vllm_cpu():
    from mlaspec.conformance.backends.vllm import VLLMBackend

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLASPEC_VLLM_WHEEL_DIR", str(VLLM_033))
        mp.delenv("TRITON_INTERPRET", raising=False)  # metadata only: the kernels must not be needed
        if torch.cuda.is_available():
            pytest.skip("a GPU is present: the CPU-only path is what this tests")
        return VLLMBackend()


@needs_vllm_033
def test_vllm_metadata_helpers_load_without_leaving_a_fake_vllm(vllm_cpu):
    import sys

    if importlib.util.find_spec("vllm") is None:  # no real vllm: the stand-in package is gone after the load
        assert not [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]
    assert vllm_cpu.utils.CommonAttentionMetadata.__name__ == "CommonAttentionMetadata"
    assert "metadata helpers from" in vllm_cpu.version


@needs_vllm_033
@pytest.mark.parametrize("case", curated_cases(dtypes=("bfloat16",), ops=METADATA_OPS), ids=lambda c: c.id)
def test_vllm_metadata_helpers_pass_the_curated_cases_on_cpu(vllm_cpu, case):
    r = run_case(vllm_cpu, case, backend_name="vllm")
    if case.params.get("regions", 4) == 2:
        assert r.verdict == "skip" and "four regions" in r.reason
    else:
        assert r.verdict == "pass", r.reason


@needs_vllm_033
def test_vllm_kernel_ops_are_declared_unsupported_on_cpu(vllm_cpu):
    case = curated_cases(dtypes=("bfloat16",), ops=("mla_decode",))[0]
    r = run_case(vllm_cpu, case, backend_name="vllm")
    assert r.verdict == "skip" and "need CUDA" in r.reason


_request = st.builds(
    lambda c, q, p, first: Request(0 if first else c, max(q, 1) if first else q, p),
    st.integers(1, 30),
    st.integers(0, 12),
    st.one_of(st.none(), st.integers(1, 40)),
    st.booleans(),
)


@needs_vllm_033
@given(
    requests=st.lists(_request, min_size=1, max_size=7),
    threshold=st.integers(1, 4),
    require_uniform=st.booleans(),
    short_as_decodes=st.booleans(),
)
def test_vllm_split_and_reorder_agree_with_the_spec(vllm_cpu, requests, threshold, require_uniform, short_as_decodes):
    from mlaspec.spec.batch import build_metadata
    from mlaspec.spec.batch import reorder_batch_to_split_decodes_and_prefills as reorder
    from mlaspec.spec.batch import split_decodes_and_prefills as split

    r = reorder(requests, threshold, regions=4)
    assert vllm_cpu.reorder_batch_to_split_decodes_and_prefills(requests, threshold) == (r.order, r.regions, r.modified)
    m = build_metadata(list(r.requests), block_size=4)
    got = vllm_cpu.split_decodes_and_prefills(m, threshold, require_uniform, short_as_decodes)
    assert got == tuple(split(m, threshold, require_uniform, short_as_decodes))


@needs_vllm_033
@given(requests=st.lists(_request, min_size=1, max_size=5), chunk=st.sampled_from([2, 4, 8]))
def test_vllm_local_virtual_batches_agree_with_the_spec(vllm_cpu, requests, chunk):
    from mlaspec.spec.batch import build_metadata, make_local_attention_virtual_batches

    requests = [Request(r.context_len, max(r.new_tokens, 1), r.prompt_len) for r in requests]  # q > 0 required
    m = build_metadata(requests, block_size=2)
    ref = make_local_attention_virtual_batches(chunk, m)
    got = vllm_cpu.make_local_attention_virtual_batches(chunk, m)
    names = ("seqlens_q_local", "cu_seqlens_q_local", "seqlens_k_local", "block_table_local", "k_seqstarts_absolute")
    for name, g in zip(names, got):
        assert torch.equal(g.long(), getattr(ref, name).long()), name


# -- mla_decode_fp8: the op, its budget, the torch fp8 mixin ---------------------------------------------------------
FP8_CASES = curated_cases(dtypes=("bfloat16", "float16"), ops=("mla_decode_fp8",))


class _TorchFP8(TorchFP8):
    name, version, device = "torch_fp8", "test", torch.device("cpu")
    ops, dtypes = frozenset({"mla_decode_fp8"}), frozenset({"bfloat16", "float16", "float32"})


class _DropsKScale(_TorchFP8):
    def mla_decode_fp8(self, q, kv_cache, **kw):
        return super().mla_decode_fp8(q, kv_cache, **{**kw, "k_scale": 1.0})


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c.id)
def test_spec_and_torch_fp8_pass_mla_decode_fp8(case):
    """(A kernel with e4m3 weights, declared: tests/test_numerics.py, PInE4M3.)"""
    from mlaspec.conformance.backends.reference import SpecBackend

    assert run_case(SpecBackend(), case, backend_name="spec").verdict == "pass"
    r = run_case(_TorchFP8(), case, backend_name="torch_fp8")
    assert r.verdict == "pass", r.reason


def test_mla_decode_fp8_catches_a_dropped_k_scale():
    # every per-tensor case but vLLM's default k_scale of 1.0, which dropping leaves as it was
    for case in [c for c in FP8_CASES if c.params["layout"] == "fp8_e4m3_per_tensor" and c.params["k_scale"] != 1.0]:
        r = run_case(_DropsKScale(), case, backend_name="drops")
        assert r.verdict == "fail", case.id


def test_fp8_inputs_are_exact_and_decode_like_the_spec():
    from mlaspec.conformance.ops import OPS
    from mlaspec.conformance.ops.fp8_decode import dequantized_entries, fp8_query

    for case in FP8_CASES:
        kw = OPS["mla_decode_fp8"].make_inputs(case)
        q8 = (kw["q"].float() / kw["q_scale"]).to(torch.float8_e4m3fn).float() * kw["q_scale"]
        assert torch.equal(q8.to(kw["q"].dtype), kw["q"])  # quantizing q to e4m3 loses nothing
        ref = dequantized_entries(kw["kv_cache"], kw["layout"], kw["k_scale"])
        assert torch.allclose(
            decode_records(kw["kv_cache"], kw["layout"], kw["k_scale"]).double(), ref, rtol=2**-23, atol=0
        )
    with pytest.raises(ValueError, match="q_scale"):
        fp8_query(torch.tensor([1.3, 2.7]), 0.1, torch.bfloat16)  # e4m3 * 0.1 needs more than bf16's 8 bits
    with pytest.raises(ValueError, match="layout"):
        decode_records(torch.zeros(1, 584, dtype=torch.uint8), "fp8_ds_mla_v4", None)
