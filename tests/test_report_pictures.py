"""Pictures of failing cases: each op's picture hook draws what the case is next to what the backend did, the runner
saves them next to the heat map, and the report embeds them; generated cases of the newer ops pass a correct
backend."""

import base64
import io
import json
import os
import re

import matplotlib.image as mpimg
import pytest
import torch
from hypothesis import given, settings

from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import case_by_id
from mlaspec.conformance.generated import GENERATED_OPS, case_strategy
from mlaspec.conformance.ops import OPS, unit_roundoff
from mlaspec.conformance.ops.common import prefix_lse_match
from mlaspec.conformance.ops.dense import _attention_bounds_op, _attention_logits, _decode_bounds, _decode_logits
from mlaspec.conformance.report import load_results, write_html
from mlaspec.conformance.runner import run_case, run_cases
from mlaspec.conformance.verdict import Result, judge
from mlaspec.spec.attention import causal_mask
from tests.test_mutants_dense import MtpCausalIgnored, TopLeftCausal, WrongScale
from tests.test_mutants_serving import ChunkBoundaryOffByOne, PaddingSlotWritten
from tests.test_mutants_sparse import TopkLengthIgnored, TopkPadsWithZero

PNG = b"\x89PNG\r\n\x1a\n"

# (mutant, failing case, the pictures its section must show besides the heat map)
FAILURES = [
    (TopLeftCausal, "attention[mqa-extend-bfloat16]", ["mask"]),
    (TopkLengthIgnored, "sparse_prefill[topk-length-shorter-bfloat16]", ["pattern"]),
    (ChunkBoundaryOffByOne, "chunked_prefill_attention[v3-workspace-chunks-no-context-bfloat16]", ["schedule"]),
    (PaddingSlotWritten, "concat_and_cache_mla[v3-bf16-page64-padding-bfloat16]", ["bytes"]),
    (TopkPadsWithZero, "topk_indices[v32-decode-ties-bfloat16]", ["topk"]),
]


def _section(page: str, case_id: str) -> str:
    start = page.index(f'<section id="{case_id}">')
    return page[start : page.index("</section>", start)]


def _decodes_as_png(data: bytes) -> tuple:
    assert data.startswith(PNG)
    return mpimg.imread(io.BytesIO(data), format="png").shape


@pytest.mark.parametrize("mutant, case_id, pictures", FAILURES, ids=[f[0].__name__ for f in FAILURES])
def test_failure_section_embeds_the_ops_pictures(tmp_path, mutant, case_id, pictures):
    [r] = run_cases(mutant(), [case_by_id(case_id)], backend_name=mutant.__name__, out_dir=tmp_path)
    assert r.verdict == "fail", r.reason
    assert [p.rsplit(".", 2)[-2] for p in r.figures] == pictures
    for path in r.figures:
        height, width = _decodes_as_png(open(path, "rb").read())[:2]
        assert height > 100 and width > 100
    section = _section(write_html(load_results(tmp_path), tmp_path, backend="m").read_text(), case_id)
    images = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([^"]+)">', section)
    heat_map = 1 if r.figure else 0
    assert [alt for alt, _ in images] == ["error heat map"] * heat_map + pictures
    for _, data in images:
        _decodes_as_png(base64.b64decode(data))


def test_passing_cases_and_runs_without_a_figure_dir_draw_nothing(tmp_path):
    case = case_by_id("attention[mqa-extend-bfloat16]")
    assert run_case(TorchBackend(), case, backend_name="t", figure_dir=tmp_path).figures == []
    failing = run_case(TopLeftCausal(), case, backend_name="t")
    assert failing.verdict == "fail" and failing.figures == [] and failing.figure == ""
    assert not any(tmp_path.iterdir())


def test_a_single_query_row_gets_no_mask_picture(tmp_path):
    """One decode query lines up with nothing the heat map does not show: heat map only."""
    r = run_case(WrongScale(), case_by_id("mla_decode[v3-tp8-bfloat16]"), backend_name="w", figure_dir=tmp_path)
    assert r.verdict == "fail" and r.figure and r.figures == []


def test_results_written_before_figures_existed_still_load_and_render(tmp_path):
    [r] = run_cases(TopLeftCausal(), [case_by_id("attention[mqa-extend-bfloat16]")], backend_name="m", out_dir=tmp_path)
    old = r.to_json()
    del old["figures"]
    (tmp_path / "results.jsonl").write_text(json.dumps(old) + "\n")
    [loaded] = load_results(tmp_path)
    assert loaded.figures == [] and loaded.figure == r.figure
    section = _section(write_html([loaded], tmp_path, backend="m").read_text(), r.case_id)
    assert section.count("<img ") == 1
    assert Result.from_json(r.to_json()).figures == r.figures


def _backend_lse(backend, case):
    op = OPS[case.op]
    kw = op.make_inputs(case)
    ref = tuple(op.reference(**kw))
    return kw, ref, getattr(backend, case.op)(**kw)[1]


def test_prefix_inference_recovers_a_top_left_causal_mask():
    """The backend's LSE alone tells which key prefix each row attended: top-left causal on 3 x 11 is [1, 2, 3]."""
    case = case_by_id("attention[mqa-extend-bfloat16]")
    kw, ref, lse = _backend_lse(TopLeftCausal(), case)
    bound = _attention_bounds_op(kw, ref, unit_roundoff(kw["q"].dtype))[1]
    spec = causal_mask(3, 11).sum(1)
    lengths, explained = prefix_lse_match(_attention_logits(kw), lse, bound, spec)
    assert lengths.tolist() == [1, 2, 3] and explained.all()
    lengths, explained = prefix_lse_match(_attention_logits(kw), ref[1], bound, spec)  # the spec's own LSE
    assert lengths.tolist() == spec.tolist() and explained.all()


def test_prefix_inference_says_so_when_no_prefix_fits():
    """A wrong softmax scale is no mask bug: no prefix explains the LSE; an unmasked MTP draft row sees every key."""
    case = case_by_id("mla_decode[mtp4-bfloat16]")
    kw, ref, lse = _backend_lse(WrongScale(), case)
    bound = _decode_bounds(kw, ref, unit_roundoff(kw["q"].dtype))[1]
    spec = causal_mask(4, kw["kv"].shape[1]).sum(1)
    assert not prefix_lse_match(_decode_logits(kw), lse, bound, spec)[1].any()
    kw, ref, lse = _backend_lse(MtpCausalIgnored(), case)
    lengths, explained = prefix_lse_match(_decode_logits(kw), lse, bound, spec)
    assert explained.all() and lengths.tolist() == [kw["kv"].shape[1]] * 4


def test_chunk_schedule_picture_marks_exactly_the_failing_requests():
    """The off-by-one chunk end drops a context token of every request with a full chunk (0, 2, 3), not request 1
    (no context)."""
    from mlaspec.conformance.viz.schedule import draw_chunk_schedule_failures

    case = case_by_id("chunked_prefill_attention[v3-workspace-chunks-no-context-bfloat16]")
    op = OPS[case.op]
    kw = op.make_inputs(case)
    ref = tuple(op.reference(**kw))
    got = ChunkBoundaryOffByOne().chunked_prefill_attention(**kw)
    ratios = judge(op.outputs, got, ref, op.bounds(kw, ref, unit_roundoff(kw["q_nope"].dtype)))[4]
    fig = op.picture(kw, got, ref, ratios, title=case.id)["schedule"]
    top = fig.axes[0]
    red = [t.get_text() for t in top.get_yticklabels() if t.get_color() == "#d62728"]
    assert red == ["prefill 0", "prefill 2", "prefill 3"]
    with pytest.raises(ValueError, match="request_errors"):
        draw_chunk_schedule_failures(kw["plan"], [0.0])


def test_byte_picture_counts_the_changed_padding_slot():
    from mlaspec.conformance.viz.layouts import draw_byte_differences

    case = case_by_id("concat_and_cache_mla[v3-bf16-page64-padding-bfloat16]")
    op = OPS[case.op]
    kw = op.make_inputs(case)
    ref = tuple(op.reference(**kw))
    fig = op.picture(kw, PaddingSlotWritten().concat_and_cache_mla(**kw), ref, {}, title=case.id)["bytes"]
    legend = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert "should be untouched, changed (1)" in legend and "written, bytes differ (0)" in legend
    with pytest.raises(ValueError, match="slot_status"):
        draw_byte_differences(torch.zeros(4), torch.tensor([0, 5]))


NEW_GENERATED = ("sparse_prefill", "chunked_prefill_attention", "topk_indices", "concat_and_cache_mla")


def test_new_generated_ops_are_listed():
    assert set(NEW_GENERATED) <= set(GENERATED_OPS)


@settings(max_examples=12)
@given(
    case=case_strategy("sparse_prefill")
    | case_strategy("chunked_prefill_attention")
    | case_strategy("topk_indices")
    | case_strategy("concat_and_cache_mla")
)
def test_generated_cases_of_the_new_ops_pass_on_the_torch_backend(case):
    """The strategies draw only cases the spec accepts and a correct backend meets."""
    r = run_case(TorchBackend(), case, backend_name="torch")
    assert r.verdict == "pass", (case, r.reason)


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="/usr/bin/chromium is absent")
def test_report_with_pictures_renders_in_a_browser(tmp_path):
    from tests.test_report_browser import IMAGES, DevTools

    cases = [case_by_id(c) for _, c, _ in FAILURES[:2]]
    run_cases(TopLeftCausal(), cases[:1], backend_name="m", out_dir=tmp_path / "a")
    results = load_results(tmp_path / "a")
    run_cases(TopkLengthIgnored(), cases[1:], backend_name="m", out_dir=tmp_path / "b")
    results += load_results(tmp_path / "b")
    page = write_html(results, tmp_path, backend="m")
    browser = DevTools(tmp_path / "profile")
    try:
        browser.open(page.resolve().as_uri())
        assert browser.console_errors() == []
        images = browser.evaluate(IMAGES)
    finally:
        browser.close()
    expected = sum(bool(r.figure) + len(r.figures) for r in results)
    assert expected == 4 and len(images) == expected
    assert all(i["complete"] and i["width"] > 0 for i in images), images


@pytest.mark.parametrize("shape", [(16, 1), (1, 1), (3, 7), (128, 40)])
def test_heat_map_ticks_are_whole_heads_and_positions(shape):
    from mlaspec.conformance.viz.errors import draw_error_heatmaps

    fig = draw_error_heatmaps({"out": torch.full(shape, 2.0)})
    fig.canvas.draw()
    ax = fig.axes[0]
    for ticks, n in ((ax.get_xticks(), shape[1]), (ax.get_yticks(), shape[0])):
        visible = [t for t in ticks if -0.5 <= t <= n - 0.5]
        assert visible and all(float(t).is_integer() for t in visible), (shape, list(ticks))
