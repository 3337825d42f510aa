"""The triton backend's composed ops through Triton's interpreter, against the spec: the slot-mapping kernel
(:mod:`mlaspec.impl.slot_mapping`), chunked prefill (:func:`mlaspec.impl.layer.chunked_prefill` behind
``chunked_prefill_attention``), the whole absorbed form (``mla_absorbed``: torch projections around the paged decode
or the varlen kernel), and the host-side metadata ops named with their reason.

Float ops are judged with the harness's own derived budgets (fp16 and fp32: the interpreter's bf16 ``tl.dot`` is
wrong), and each test also checks that a 5% softmax-scale bug *fails* those budgets, so a pass means something.
The slot mapping is integer metadata: exact equality with the spec over hypothesis-drawn batches.
"""

import os
import sys

import pytest

if "mlaspec.impl.decode" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "mlaspec.impl was imported compiled (without TRITON_INTERPRET=1) in this process", allow_module_level=True
    )
os.environ["TRITON_INTERPRET"] = "1"

import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.conformance.backend import missing_op_reason, skip_reason
from mlaspec.conformance.backends.triton import TritonBackend
from mlaspec.conformance.backends.triton.metadata import HOST_SIDE
from mlaspec.conformance.cases import Case, curated_cases
from mlaspec.conformance.ops import unit_roundoff
from mlaspec.conformance.ops.dense import _absorbed_bounds
from mlaspec.conformance.ops.serving import _chunked_bounds
from mlaspec.conformance.runner import run_case
from mlaspec.conformance.verdict import judge
from mlaspec.impl.slot_mapping import slot_mapping_from_block_table
from mlaspec.spec import paged_cache as spec_paged
from mlaspec.spec.chunked_context import chunked_prefill_attention, plan_context_chunks
from mlaspec.spec.config import MLAConfig, make_weights
from mlaspec.spec.forms import mla_absorbed
from tests.interpreter_cases import interpreter_cases

pytestmark = pytest.mark.interpreter
NEW_OPS = ("chunked_prefill_attention", "mla_absorbed", "slot_mapping_from_block_table")


# -- the harness's curated cases -----------------------------------------------------------------------------------
# float32 here; float16 runs in test_impl_interpreter.py, chunked_prefill_attention's float32 in test_impl_layer.py
@pytest.mark.parametrize(
    "case",
    interpreter_cases(curated_cases(ops=("mla_absorbed", "slot_mapping_from_block_table"), dtypes=("float32",))),
    ids=str,
)
def test_harness_cases_pass(case):
    r = run_case(TritonBackend(), case, backend_name="triton", timeout=None)
    assert r.verdict == "pass", f"{case.id}: {r.verdict}: {r.reason}"


def test_bf16_skips_only_the_ops_that_multiply():
    b = TritonBackend()
    for case in curated_cases(ops=NEW_OPS, dtypes=("bfloat16",)):
        reason = skip_reason(b, case)
        if case.op == "slot_mapping_from_block_table":  # integer arithmetic: runs in the interpreter in bf16 too
            assert reason is None
        else:
            assert "bfloat16" in reason and "interpreter" in reason, (case.id, reason)


@pytest.mark.parametrize("op", sorted(HOST_SIDE))
def test_host_side_metadata_is_skipped_with_its_reason(op):
    b = TritonBackend()
    assert op not in b.ops and not hasattr(b, op)
    for case in curated_cases(ops=(op,), dtypes=("float16",)):
        r = run_case(b, case, backend_name="triton")
        assert r.verdict == "skip"
        assert (
            r.reason == f"triton does not implement {op} (host-side batch metadata: vLLM builds it on the CPU; "
            f"no Triton kernel to judge)"
        )


def test_missing_op_reason_without_a_note():
    class Plain:
        name, ops = "plain", frozenset()

    assert missing_op_reason(Plain(), "attention") == "plain does not implement attention"


# -- slot mapping ---------------------------------------------------------------------------------------------------
@st.composite
def _batches(draw):
    P = draw(st.sampled_from([1, 3, 4, 16]))
    q_lens = draw(st.lists(st.integers(0, 9), min_size=0, max_size=5))
    ctx = [draw(st.integers(0, 40)) for _ in q_lens]
    width = max([-(-(c + q) // P) for c, q in zip(ctx, q_lens)], default=0) + draw(st.integers(0, 2))
    num_blocks = len(q_lens) * max(width, 1) + 1
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    table = torch.randperm(num_blocks, generator=g)[: len(q_lens) * width].view(len(q_lens), width)
    qsl = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()])
    pos = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, q_lens)] or [torch.zeros(0, dtype=torch.int64)])
    dtypes = draw(st.tuples(*[st.sampled_from([torch.int32, torch.int64])] * 3))
    table, qsl, pos = (t.to(d) for t, d in zip((table, qsl, pos), dtypes))
    pad = draw(st.integers(0, 5))
    return dict(
        block_table=table,
        block_size=P,
        query_start_loc=qsl,
        positions=pos,
        num_blocks=num_blocks,
        pad_to=pos.numel() + pad,
    ), draw(st.sampled_from([1, 2, 4, 1024]))


@given(_batches())
def test_slot_mapping_equals_spec(batch):
    kw, block = batch
    got = slot_mapping_from_block_table(**kw, block=block)
    ref = spec_paged.slot_mapping_from_block_table(**kw)
    for name, g, r in zip(("slot_mapping", "block_ids", "block_offsets"), got, ref):
        assert g.dtype == torch.int64 and torch.equal(g, r), (name, g.tolist(), r.tolist())


def test_slot_mapping_reads_the_requests_own_row():
    # two requests at the same positions, different pages: swapping rows must swap the slots
    table = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    pos = torch.tensor([3, 4, 3, 4])
    got = slot_mapping_from_block_table(table, 4, qsl, pos, pad_to=6)
    assert got.slot_mapping.tolist() == [23, 8, 31, 0, -1, -1]
    assert got.block_ids.tolist() == [5, 2, 7, 0, -1, -1] and got.block_offsets.tolist() == [3, 0, 3, 0, -1, -1]


def _slot_args(**over):
    kw = dict(
        block_table=torch.tensor([[1, 2], [0, 3]], dtype=torch.int32),
        block_size=4,
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
        positions=torch.tensor([5, 6, 4]),
        num_blocks=4,
        pad_to=None,
    )
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over, exc, name",
    [
        (dict(positions=torch.tensor([5.0, 6.0, 4.0])), TypeError, "positions"),
        (dict(block_table=torch.tensor([1, 2, 0, 3], dtype=torch.int32)), ValueError, "block_table"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=4.0), TypeError, "block_size"),
        (dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32)), ValueError, "query_start_loc"),
        (dict(query_start_loc=torch.tensor([0, 2, 2], dtype=torch.int32)), ValueError, "query_start_loc"),
        (dict(query_start_loc=torch.tensor([0, 4, 3], dtype=torch.int32)), ValueError, "query_start_loc"),
        (dict(positions=torch.tensor([5, -1, 4])), ValueError, "positions"),
        (dict(positions=torch.tensor([5, 8, 4])), ValueError, "positions"),  # logical block 2 of a 2-wide table
        (dict(num_blocks=3), ValueError, "block_table"),  # request 1 at position 4 uses page 3
        (dict(block_table=torch.tensor([[1, -1], [0, 3]], dtype=torch.int32)), ValueError, "block_table"),
        (dict(pad_to=2), ValueError, "pad_to"),
    ],
)
def test_slot_mapping_rejects_bad_input_by_name(over, exc, name):
    with pytest.raises(exc, match=name):
        slot_mapping_from_block_table(**_slot_args(**over))


def test_slot_mapping_rejects_a_block_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="block"):
        slot_mapping_from_block_table(**_slot_args(), block=3)


# -- chunked prefill --------------------------------------------------------------------------------------------------
def _weights(n, lkv, p, r, v, dtype, seed):
    cfg = MLAConfig.tiny(num_heads=n, kv_lora_rank=lkv, qk_nope_head_dim=p, qk_rope_head_dim=r, v_head_dim=v)
    return cfg, make_weights(cfg, seed=seed, dtype=dtype)


def _chunked_inputs(ctx, q_lens, *, workspace, block, dtype, align=True, seed=0, n=2, lkv=16, p=16, r=8, v=16):
    g = torch.Generator().manual_seed(seed)
    cfg, w = _weights(n, lkv, p, r, v, dtype, seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)
    t = sum(q_lens)
    return dict(
        q_nope=rnd(t, n, p, scale=2.0),
        q_pe=rnd(t, n, r, scale=2.0),
        kv_c=rnd(t, lkv),
        k_pe=rnd(t, r),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        context=[(rnd(c, lkv), rnd(c, r)) for c in ctx],
        plan=plan_context_chunks(ctx, workspace, block, align_to_block=align),
        W_UK=w.W_UK,
        W_UV=w.W_UV,
        scale=cfg.softmax_scale,
    )


def _judge(kw, got, ref, bounds_fn, dtype):
    return judge(("out", "lse"), got, ref, bounds_fn(kw, ref, unit_roundoff(dtype)))[:2]


@pytest.mark.parametrize(
    "ctx, q_lens, workspace, block, align, dtype",
    [
        ([13, 0, 7], [2, 3, 1], 8, 4, True, torch.float32),  # 2 prefills with context: W = 4, 4 chunks, one empty
        ([13, 0, 7], [2, 3, 1], 8, 4, False, torch.float16),  # the same, chunks not page-aligned (W = 4 as well)
        ([9, 5], [1, 4], 7, 2, False, torch.float32),  # W = 3: chunk starts off the page boundaries
        ([30], [3], 64, 16, True, torch.float16),  # the whole context in one chunk
        ([0, 0], [2, 5], 16, 4, True, torch.float32),
    ],  # no context at all: only the causal part
)
def test_chunked_prefill_attention_matches_spec(ctx, q_lens, workspace, block, align, dtype):
    kw = _chunked_inputs(ctx, q_lens, workspace=workspace, block=block, dtype=dtype, align=align, seed=len(ctx))
    ref = tuple(chunked_prefill_attention(**kw))
    got = TritonBackend().chunked_prefill_attention(**kw)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert _judge(kw, got, ref, _chunked_bounds, dtype) == ("pass", ""), _judge(kw, got, ref, _chunked_bounds, dtype)
    wrong = TritonBackend().chunked_prefill_attention(**{**kw, "scale": kw["scale"] * 1.05})
    assert _judge(kw, wrong, ref, _chunked_bounds, dtype)[0] == "fail"


def test_chunked_prefill_attention_takes_a_gather_callable():
    kw = _chunked_inputs([11, 6], [2, 2], workspace=8, block=4, dtype=torch.float32)
    ctx = kw["context"]
    got = TritonBackend().chunked_prefill_attention(
        **{**kw, "context": lambda b, s, n: tuple(t[s : s + n] for t in ctx[b])}
    )
    ref = TritonBackend().chunked_prefill_attention(**kw)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_chunked_prefill_attention_rejects_bad_input_by_name():
    kw = _chunked_inputs([5, 3], [2, 1], workspace=8, block=4, dtype=torch.float32)
    b = TritonBackend()
    with pytest.raises(TypeError, match="plan"):
        b.chunked_prefill_attention(**{**kw, "plan": [5, 3]})
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        b.chunked_prefill_attention(**{**kw, "cu_seqlens_q": torch.tensor([0, 3], dtype=torch.int32)})
    with pytest.raises(ValueError, match="context"):
        b.chunked_prefill_attention(**{**kw, "context": kw["context"][:1]})
    with pytest.raises(ValueError, match=r"context\[1\]"):
        b.chunked_prefill_attention(
            **{**kw, "context": [kw["context"][0], (kw["context"][1][0][:2], kw["context"][1][1][:2])]}
        )


def test_chunked_prefill_unsupported_head_dims_are_named():
    case = Case(
        "chunked_prefill_attention",
        "wide",
        "float16",
        dict(H_q=2, Lkv=32, D_nope=256, D_rope=64, D_v=16, contexts=[4], q_lens=[1], block_size=4, workspace_size=8),
    )
    assert "256" in TritonBackend().unsupported(case)


# -- the absorbed form ------------------------------------------------------------------------------------------------
def _absorbed_inputs(b, s_q, s_kv, n, lkv, p, r, v, *, causal, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg, w = _weights(n, lkv, p, r, v, dtype, seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)
    return dict(
        q_nope=rnd(b, s_q, n, p, scale=2.0),
        q_pe=rnd(b, s_q, n, r, scale=2.0),
        kv_c=rnd(b, s_kv, lkv),
        k_pe=rnd(b, s_kv, r),
        W_UK=w.W_UK,
        W_UV=w.W_UV,
        scale=cfg.softmax_scale,
        causal=causal,
    )


@pytest.mark.parametrize(
    "b, s_q, s_kv, n, lkv, p, r, v, causal, dtype",
    [
        (2, 2, 37, 4, 32, 16, 16, 16, True, torch.float32),  # the paged decode kernel (Lkv, D_rope powers of 2), MTP 2
        (1, 3, 70, 2, 64, 8, 16, 8, True, torch.float16),  # decode kernel, two pages, MTP 3
        (2, 1, 9, 3, 32, 16, 16, 24, False, torch.float16),  # decode kernel, not causal, D_v > D_nope
        (1, 3, 2, 2, 32, 16, 16, 16, True, torch.float32),  # more queries than keys: the first row sees nothing
        (2, 2, 11, 4, 24, 16, 8, 16, True, torch.float32),  # D_rope = 8: the varlen kernel as MQA
        (1, 1, 13, 16, 64, 16, 8, 16, True, torch.float16),
    ],  # H_q = D_v = 16 (the curated n-equals-v), varlen
)
def test_mla_absorbed_matches_spec(b, s_q, s_kv, n, lkv, p, r, v, causal, dtype):
    kw = _absorbed_inputs(b, s_q, s_kv, n, lkv, p, r, v, causal=causal, dtype=dtype, seed=s_kv)
    ref = tuple(mla_absorbed(**kw))
    got = TritonBackend().mla_absorbed(**kw)
    assert got[0].shape == (b, s_q, n, v) and got[0].dtype == dtype and got[1].shape == (b, n, s_q)
    verdict = _judge(kw, got, ref, _absorbed_bounds, dtype)
    assert verdict == ("pass", ""), verdict
    if s_kv < s_q and causal:  # rows with no key: output 0, LSE -inf, as the spec
        assert torch.isneginf(got[1][..., 0]).all() and not got[0][:, 0].any()
    wrong = TritonBackend().mla_absorbed(**{**kw, "scale": kw["scale"] * 1.05})
    assert _judge(kw, wrong, ref, _absorbed_bounds, dtype)[0] == "fail"


def test_mla_absorbed_uses_w_uv_untransposed_when_n_equals_v():
    # H_q = D_v: W_UV [Lkv, H_q, D_v] transposed in its last two dims still has its shape; the result must differ
    kw = _absorbed_inputs(1, 1, 5, 8, 32, 16, 16, 8, causal=True, dtype=torch.float32)
    ref = tuple(mla_absorbed(**kw))
    bad = tuple(mla_absorbed(**{**kw, "W_UV": kw["W_UV"].transpose(1, 2)}))
    got = TritonBackend().mla_absorbed(**kw)
    assert _judge(kw, got, ref, _absorbed_bounds, torch.float32)[0] == "pass"
    assert _judge(kw, got, bad, _absorbed_bounds, torch.float32)[0] == "fail"


def test_mla_absorbed_rejects_bad_input_by_name():
    kw = _absorbed_inputs(1, 1, 5, 2, 32, 16, 16, 16, causal=True, dtype=torch.float32)
    b = TritonBackend()
    with pytest.raises(ValueError, match="mask"):
        b.mla_absorbed(**kw, mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="k_pe"):
        b.mla_absorbed(**{**kw, "k_pe": kw["k_pe"].half()})
    wide = _absorbed_inputs(1, 1, 3, 2, 512, 16, 8, 16, causal=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="Lkv=512, D_rope=8"):
        b.mla_absorbed(**wide)


def test_mla_absorbed_unsupported_widths_are_named():
    b = TritonBackend()
    params = dict(B=1, S_q=1, S_kv=4, H_q=2, D_nope=16, D_v=16, causal=True)
    assert b.unsupported(Case("mla_absorbed", "x", "float16", dict(params, Lkv=512, D_rope=64))) is None  # decode
    assert b.unsupported(Case("mla_absorbed", "x", "float16", dict(params, Lkv=200, D_rope=8))) is None  # varlen
    reason = b.unsupported(Case("mla_absorbed", "x", "float16", dict(params, Lkv=512, D_rope=8)))
    assert "Lkv=512, D_rope=8" in reason and "decode" in reason and "varlen" in reason
