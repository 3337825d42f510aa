"""The two forms agree (float64, ~1e-10 relative) for random configs, batches, causal masks and varlen batches."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.spec.attention import attention, seq_lens_mask
from mlaspec.spec.config import MLAConfig, make_weights
from mlaspec.spec.forms import (
    absorb_query,
    absorbed_inputs,
    mha_inputs,
    mla_absorbed,
    mla_mha,
    mqa_latent_attention,
    unabsorb_output,
)
from mlaspec.spec.layer import mla_layer
from mlaspec.spec.projections import project

RTOL = 1e-10


@st.composite
def configs(draw):
    return MLAConfig.tiny(
        num_heads=draw(st.sampled_from([1, 2, 3, 4])),
        kv_lora_rank=draw(st.sampled_from([4, 8, 16])),
        qk_nope_head_dim=draw(st.sampled_from([2, 4, 8])),
        qk_rope_head_dim=draw(st.sampled_from([2, 4, 8])),
        v_head_dim=draw(st.sampled_from([2, 4, 8])),
    )


@st.composite
def inputs(draw):
    c = draw(configs())
    b, s_q, ctx = draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(0, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    w = make_weights(c, seed=draw(st.integers(0, 100)))
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    n, p, r, lkv = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    s_kv = s_q + ctx
    return c, w, (mk(b, s_q, n, p), mk(b, s_q, n, r), mk(b, s_kv, lkv), mk(b, s_kv, r))


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@given(inputs(), st.booleans())
def test_forms_agree(problem, causal):
    c, w, (q_nope, q_pe, kv_c, k_pe) = problem
    a = mla_mha(q_nope, q_pe, kv_c, k_pe, w.W_UK, w.W_UV, scale=c.softmax_scale, causal=causal)
    b = mla_absorbed(q_nope, q_pe, kv_c, k_pe, w.W_UK, w.W_UV, scale=c.softmax_scale, causal=causal)
    assert a.out.shape == b.out.shape == (*q_nope.shape[:3], c.v_head_dim)
    assert rel_err(b.out, a.out) < RTOL
    torch.testing.assert_close(b.lse, a.lse, rtol=RTOL, atol=RTOL)


@given(inputs(), st.data())
def test_forms_agree_under_any_mask(problem, data):
    c, w, (q_nope, q_pe, kv_c, k_pe) = problem
    b, s_q, s_kv = q_nope.shape[0], q_nope.shape[1], kv_c.shape[1]
    bits = data.draw(st.lists(st.booleans(), min_size=b * s_q * s_kv, max_size=b * s_q * s_kv))
    mask = torch.tensor(bits, dtype=torch.bool).reshape(b, s_q, s_kv)
    a = mla_mha(q_nope, q_pe, kv_c, k_pe, w.W_UK, w.W_UV, scale=0.3, mask=mask)
    m = mla_absorbed(q_nope, q_pe, kv_c, k_pe, w.W_UK, w.W_UV, scale=0.3, mask=mask)
    assert rel_err(m.out, a.out) < RTOL or a.out.norm() == 0
    torch.testing.assert_close(m.lse, a.lse, rtol=RTOL, atol=RTOL)


def test_form_inputs_worked_example():
    # Lkv = 2, H_q = 1, D_nope = D_v = D_rope = 1: k_nope = [1, 2] . [3, 4] = 11, v = [1, 2] . [5, 6] = 17,
    # ql_nope = 2 * [3, 4]
    W_UK = torch.tensor([3.0, 4.0]).reshape(2, 1, 1)
    W_UV = torch.tensor([5.0, 6.0]).reshape(2, 1, 1)
    q_nope, q_pe = torch.tensor([[[[2.0]]]]), torch.tensor([[[[5.0]]]])
    kv_c, k_pe = torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[7.0]]])
    q, k, v = mha_inputs(q_nope, q_pe, kv_c, k_pe, W_UK, W_UV)
    assert q.tolist() == [[[[2.0, 5.0]]]] and k.tolist() == [[[[11.0, 7.0]]]] and v.tolist() == [[[[17.0]]]]
    assert q.dtype == k.dtype == v.dtype == torch.float64
    qa, kv = absorbed_inputs(q_nope, q_pe, kv_c, k_pe, W_UK)
    assert qa.tolist() == [[[[6.0, 8.0, 5.0]]]] and kv.tolist() == [[[1.0, 2.0, 7.0]]]
    # the same logit both ways: 2 * 11 + 5 * 7 = 6 * 1 + 8 * 2 + 5 * 7 = 57
    assert (q * k).sum().item() == (qa * kv).sum().item() == 57.0


@given(inputs())
def test_form_inputs_give_the_same_logits_and_values(problem):
    """Why the forms are equal, on their inputs: per head ``q . k_j = q_abs . kv_j`` (associativity) and
    ``v_j = kv_j[:Lkv] @ W_UV`` (linearity)."""
    c, w, (q_nope, q_pe, kv_c, k_pe) = problem
    q, k, v = mha_inputs(q_nope, q_pe, kv_c, k_pe, w.W_UK, w.W_UV)
    qa, kv = absorbed_inputs(q_nope, q_pe, kv_c, k_pe, w.W_UK)
    b, s_q, n = q_nope.shape[:3]
    s_kv = kv_c.shape[1]
    assert q.shape == (b, s_q, n, c.qk_head_dim) and k.shape == (b, s_kv, n, c.qk_head_dim)
    assert v.shape == (b, s_kv, n, c.v_head_dim) and qa.shape == (b, s_q, n, c.kv_entry_dim)
    assert kv.shape == (b, s_kv, c.kv_entry_dim)
    mha = torch.einsum("bqnd,bknd->bnqk", q, k)
    mqa = torch.einsum("bqnd,bkd->bnqk", qa, kv)
    torch.testing.assert_close(mqa, mha, rtol=RTOL, atol=RTOL * max(1.0, mha.abs().max().item()))
    latent = kv[..., : c.kv_lora_rank]  # the values of the absorbed form, one latent per token for every head
    torch.testing.assert_close(unabsorb_output(latent[:, :, None].expand(-1, -1, n, -1), w.W_UV), v)


def test_varlen_batch_equals_each_request_alone():
    # a varlen batch of (context, new) requests: each request's rows through either form, alone or in the batch
    c = MLAConfig.tiny()
    w = make_weights(c, seed=1)
    g = torch.Generator().manual_seed(2)
    for ctx, new in [(0, 3), (5, 1), (2, 4)]:
        h = torch.randn(ctx + new, c.hidden_size, generator=g, dtype=torch.float64)
        p = project(h, torch.arange(ctx + new), w, c)
        q = (p.q_nope[None, ctx:], p.q_pe[None, ctx:])
        a = mla_mha(*q, p.kv_c[None], p.k_pe[None], w.W_UK, w.W_UV, scale=c.softmax_scale, causal=True)
        b = mla_absorbed(*q, p.kv_c[None], p.k_pe[None], w.W_UK, w.W_UV, scale=c.softmax_scale, causal=True)
        assert rel_err(b.out, a.out) < RTOL
        full = mla_mha(
            p.q_nope[None], p.q_pe[None], p.kv_c[None], p.k_pe[None], w.W_UK, w.W_UV, scale=c.softmax_scale, causal=True
        )
        torch.testing.assert_close(a.out, full.out[:, ctx:], rtol=RTOL, atol=RTOL)


def test_absorbed_pieces_compose():
    c = MLAConfig.tiny()
    w = make_weights(c)
    q_nope, q_pe = torch.randn(2, c.num_heads, c.qk_nope_head_dim), torch.randn(2, c.num_heads, c.qk_rope_head_dim)
    q = absorb_query(q_nope, q_pe, w.W_UK)
    assert q.shape == (2, c.num_heads, c.kv_entry_dim)
    # the latent part is W_UK applied per head: ql[t, n, l] = sum_p q_nope[t, n, p] W_UK[l, n, p]
    for n in range(c.num_heads):
        torch.testing.assert_close(q[:, n, : c.kv_lora_rank], q_nope[:, n].double() @ w.W_UK[:, n].T)
    torch.testing.assert_close(q[..., c.kv_lora_rank :], q_pe.double())
    o_lat = torch.randn(2, c.num_heads, c.kv_lora_rank, dtype=torch.float64)
    for n in range(c.num_heads):
        torch.testing.assert_close(unabsorb_output(o_lat, w.W_UV)[:, n], o_lat[:, n] @ w.W_UV[:, n])


def test_mqa_latent_attention_is_mqa_with_v_the_leading_part():
    q, kv = torch.randn(2, 3, 4, 10, dtype=torch.float64), torch.randn(2, 5, 10, dtype=torch.float64)
    a = mqa_latent_attention(q, kv, d_v=6, scale=0.5, causal=True)
    b = attention(q, kv[:, :, None], kv[:, :, None, :6], scale=0.5, causal=True)
    torch.testing.assert_close(a.out, b.out)
    assert a.out.shape == (2, 3, 4, 6) and a.lse.shape == (2, 4, 3)


def test_deepseek_v3_shapes_one_token():
    # full DeepSeek-V3 dims at TP8 on one decode token: the absorbed q and the cache entry are 576 wide
    c = MLAConfig.deepseek_v3().tensor_parallel(8)
    assert (c.num_heads, c.qk_head_dim, c.kv_entry_dim) == (16, 192, 576)
    w = make_weights(c, dtype=torch.float32)
    p = project(torch.randn(4, c.hidden_size), torch.arange(4), w, c)
    q = absorb_query(p.q_nope[-1:], p.q_pe[-1:], w.W_UK)
    assert q.shape == (1, 16, 576)
    args = (p.q_nope[None, -1:], p.q_pe[None, -1:], p.kv_c[None], p.k_pe[None], w.W_UK, w.W_UV)
    a = mla_mha(*args, scale=c.softmax_scale, causal=True)
    b = mla_absorbed(*args, scale=c.softmax_scale, causal=True)
    assert rel_err(b.out, a.out) < RTOL


@pytest.mark.parametrize("form", ["mha", "absorbed"])
def test_layer_batch_of_one_is_causal(form):
    # changing a later token leaves earlier outputs unchanged
    c = MLAConfig.tiny()
    w = make_weights(c)
    h = torch.randn(6, c.hidden_size, dtype=torch.float64)
    h2 = h.clone()
    h2[4:] += 1
    a, b = mla_layer(h, torch.arange(6), w, c, form=form), mla_layer(h2, torch.arange(6), w, c, form=form)
    torch.testing.assert_close(a[:4], b[:4])
    assert not torch.allclose(a[4:], b[4:])


def test_layer_forms_agree():
    c = MLAConfig.tiny(num_heads=3)
    w = make_weights(c, seed=5)
    h = torch.randn(9, c.hidden_size, dtype=torch.float64)
    pos = torch.arange(100, 109)
    assert rel_err(mla_layer(h, pos, w, c, form="absorbed"), mla_layer(h, pos, w, c)) < RTOL


def test_bad_input():
    c = MLAConfig.tiny()
    w = make_weights(c)
    q_nope, q_pe = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 8)
    kv_c, k_pe = torch.randn(1, 3, 32), torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="k_pe must have shape"):
        mla_mha(q_nope, q_pe, kv_c, torch.randn(2, 3, 8), w.W_UK, w.W_UV, scale=1.0)
    with pytest.raises(ValueError, match="W_UK must have shape"):
        mla_absorbed(q_nope, q_pe, kv_c, k_pe, w.W_UK[:, :2], w.W_UV, scale=1.0)
    with pytest.raises(ValueError, match="d_v"):
        mqa_latent_attention(torch.randn(1, 2, 4, 40), torch.randn(1, 3, 40), d_v=41, scale=1.0)
    with pytest.raises(ValueError, match="W_UV must have shape"):
        mha_inputs(q_nope, q_pe, kv_c, k_pe, w.W_UK, w.W_UV[:, :2])
    with pytest.raises(TypeError, match="kv_c"):
        mha_inputs(q_nope, q_pe, kv_c.to(torch.int32), k_pe, w.W_UK, w.W_UV)
    with pytest.raises(ValueError, match="q_pe must have shape"):
        absorbed_inputs(q_nope, torch.randn(1, 2, 3, 8), kv_c, k_pe, w.W_UK)
    with pytest.raises(ValueError, match="kv_c must have shape"):
        absorbed_inputs(q_nope, q_pe, torch.randn(2, 3, 32), k_pe, w.W_UK)
    with pytest.raises(TypeError, match="W_UK"):
        absorbed_inputs(q_nope, q_pe, kv_c, k_pe, None)
    with pytest.raises(ValueError, match="form"):
        mla_layer(torch.randn(2, c.hidden_size), torch.arange(2), w, c, form="flash")
    with pytest.raises(ValueError, match="hidden must have shape"):
        mla_layer(torch.randn(2, 7), torch.arange(2), w, c)
    with pytest.raises(ValueError, match="weights.W_O must have shape"):
        mla_layer(torch.randn(2, c.hidden_size), torch.arange(2), dataclasses.replace(w, W_O=w.W_O[1:]), c)
    with pytest.raises(TypeError, match="weights must be an MLAWeights"):
        mla_layer(torch.randn(2, c.hidden_size), torch.arange(2), {}, c)


def test_seq_lens_mask_worked_example():
    # request 0 holds all 4 keys; request 1 holds 1, so its first MTP query sees none and its second key 0
    got = seq_lens_mask(torch.tensor([4, 1]), 2, 4, causal=True)
    want = torch.tensor([[[1, 1, 1, 0], [1, 1, 1, 1]], [[0, 0, 0, 0], [1, 0, 0, 0]]], dtype=torch.bool)
    assert torch.equal(got, want)
    assert torch.equal(seq_lens_mask(torch.tensor([2]), 2, 3, causal=False), torch.tensor([[[1, 1, 0], [1, 1, 0]]]))


@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=3),
    st.integers(1, 3),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_mqa_latent_attention_seq_lens_is_each_request_alone(lens, s_q, causal, seed):
    g = torch.Generator().manual_seed(seed)
    s_kv = max(lens)
    q = torch.randn(len(lens), s_q, 2, 8, generator=g, dtype=torch.float64)
    kv = torch.randn(len(lens), s_kv, 8, generator=g, dtype=torch.float64)
    kv_nan = kv.clone()
    for b, n in enumerate(lens):
        kv_nan[b, n:] = math.nan  # slots past a request's length are never read
    got = mqa_latent_attention(q, kv_nan, d_v=6, scale=0.3, causal=causal, seq_lens=torch.tensor(lens))
    for b, n in enumerate(lens):
        want = mqa_latent_attention(q[b : b + 1], kv[b : b + 1, :n], d_v=6, scale=0.3, causal=causal)
        torch.testing.assert_close(got.out[b : b + 1], want.out, rtol=1e-12, atol=1e-12)
        assert torch.equal(torch.isneginf(got.lse[b : b + 1]), torch.isneginf(want.lse))
        torch.testing.assert_close(got.lse[b : b + 1].nan_to_num(neginf=0.0), want.lse.nan_to_num(neginf=0.0))


@pytest.mark.parametrize("lens", [[3, 5], [-1], [[2]]], ids=["past-S_kv", "negative", "2-D"])
def test_seq_lens_rejected_by_name(lens):
    q, kv = torch.zeros(len(lens), 1, 2, 8), torch.zeros(len(lens), 4, 8)
    with pytest.raises(ValueError, match="seq_lens"):
        mqa_latent_attention(q, kv, d_v=6, scale=0.3, seq_lens=torch.tensor(lens))
