"""Decode context parallelism (spec/dcp.py): worked examples, and the property that sharding the keys over ranks and
combining by LSE gives single-device attention for any world size, interleave size and lengths."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.spec import dcp
from mlaspec.spec.forms import mqa_latent_attention
from mlaspec.spec.merge import merge_attn_states


def test_owner_example():
    assert dcp.dcp_owner(torch.arange(8), world_size=2, interleave=2).tolist() == [0, 0, 1, 1, 0, 0, 1, 1]


def test_local_seq_lens_example():
    got = dcp.dcp_local_seq_lens(torch.tensor([10]), world_size=4, interleave=2)
    assert got.tolist() == [[4, 2, 2, 2]]
    assert dcp.dcp_local_seq_lens(torch.tensor([10]), world_size=4, interleave=2, rank=1).tolist() == [2]


def test_query_prefix_lens_example():
    assert dcp.dcp_query_prefix_lens(torch.tensor([5, 1]), 2, causal=True).tolist() == [[4, 5], [0, 1]]
    assert dcp.dcp_query_prefix_lens(torch.tensor([5]), 2, causal=False).tolist() == [[5, 5]]


@given(n=st.integers(0, 300), world=st.integers(1, 8), interleave=st.sampled_from([1, 2, 3, 16, 64]), rank=st.data())
def test_local_seq_lens_count_owned_tokens(n, world, interleave, rank):
    """``local(n)`` is the number of tokens ``t < n`` with ``owner(t) == r`` (brute force), and the shares add up."""
    owners = dcp.dcp_owner(torch.arange(n), world_size=world, interleave=interleave)
    local = dcp.dcp_local_seq_lens(torch.tensor([n]), world_size=world, interleave=interleave)[0]
    assert local.tolist() == [int((owners == r).sum()) for r in range(world)]
    assert int(local.sum()) == n


def test_chunk_of_a_chunked_prefill():
    """A context chunk [a, b) holds local(b) - local(a) keys of a rank, starting at local key local(a)."""
    a, b, world, interleave = 13, 41, 4, 2
    la, lb = (dcp.dcp_local_seq_lens(torch.tensor([x]), world_size=world, interleave=interleave)[0] for x in (a, b))
    owners = dcp.dcp_owner(torch.arange(a, b), world_size=world, interleave=interleave)
    assert (lb - la).tolist() == [int((owners == r).sum()) for r in range(world)]


def test_combine_example_is_merge():
    """Two ranks, one head: the combine is merge_attn_states' worked example."""
    outs = torch.tensor([2.0, 5.0], dtype=torch.float64).reshape(2, 1, 1, 1, 1)
    lses = torch.tensor([1.0, 0.0], dtype=torch.float64).reshape(2, 1, 1, 1)
    got = dcp.dcp_combine(outs, lses)
    want = merge_attn_states(outs[0, 0], lses[0, 0], outs[1, 0], lses[1, 0])
    assert math.isclose(float(got.out), (2 * math.e + 5) / (math.e + 1))
    assert math.isclose(float(got.out), float(want.out)) and math.isclose(float(got.lse), math.log(math.e + 1))


def test_empty_shares():
    """+inf, -inf and NaN LSEs are empty shares (weight 0, their outputs ignored); all empty: out 0, lse -inf."""
    outs = torch.tensor([3.0, float("nan"), 7.0], dtype=torch.float64).reshape(3, 1, 1, 1, 1)
    lses = torch.tensor([0.5, float("inf"), -math.inf], dtype=torch.float64).reshape(3, 1, 1, 1)
    got = dcp.dcp_combine(outs, lses)
    assert float(got.out) == 3.0 and float(got.lse) == 0.5
    none = dcp.dcp_combine(torch.zeros(2, 1, 1, 1, 1), torch.full((2, 1, 1, 1), -math.inf))
    assert float(none.out) == 0.0 and math.isinf(float(none.lse)) and float(none.lse) < 0


def test_base_two():
    """A base-2 combine of log2 LSEs is the natural-log combine of the same weights."""
    g = torch.Generator().manual_seed(0)
    outs, lses = torch.randn(4, 2, 1, 4, 3, generator=g, dtype=torch.float64), torch.randn(4, 2, 4, 1, generator=g)
    natural = dcp.dcp_combine(outs, lses.double())
    base2 = dcp.dcp_combine(outs, lses.double() / math.log(2), lse_base=2)
    torch.testing.assert_close(base2.out, natural.out)
    torch.testing.assert_close(base2.lse * math.log(2), natural.lse)


@st.composite
def _dcp_problem(draw):
    b, s_q, h = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4, 8]))
    s_kv = draw(st.integers(1, 40))
    seq_lens = draw(st.lists(st.integers(0, s_kv), min_size=b, max_size=b))
    world = draw(st.sampled_from([1, 2, 3, 4, 8]))
    return dict(
        b=b,
        s_q=s_q,
        h=h,
        s_kv=s_kv,
        seq_lens=seq_lens,
        world=world,
        interleave=draw(st.sampled_from([1, 2, 5, 16, 64])),
        causal=draw(st.booleans()),
        seed=draw(st.integers(0, 99)),
    )


@given(_dcp_problem())
def test_dcp_equals_single_device(p):
    """Shard, attend per rank, combine (each of the three combines): single-device attention, empty shares included."""
    g = torch.Generator().manual_seed(p["seed"])
    d_qk, d_v = 6, 4
    q = torch.randn(p["b"], p["s_q"], p["h"], d_qk, generator=g, dtype=torch.float64) * 2
    kv = torch.randn(p["b"], p["s_kv"], d_qk, generator=g, dtype=torch.float64)
    seq_lens = torch.tensor(p["seq_lens"], dtype=torch.int32)
    kw = dict(d_v=d_v, scale=0.7, causal=p["causal"])
    want = mqa_latent_attention(q, kv, seq_lens=seq_lens, **kw)
    parts = [
        dcp.dcp_partial_attention(q, kv, seq_lens, world_size=p["world"], rank=r, interleave=p["interleave"], **kw)
        for r in range(p["world"])
    ]
    outs, lses = torch.stack([x.out for x in parts]), torch.stack([x.lse for x in parts])
    combines = [dcp.dcp_combine]
    if p["h"] % p["world"] == 0:
        combines += [dcp.dcp_combine_ag_rs, dcp.dcp_combine_a2a]
    for combine in combines:
        got = combine(outs, lses)
        torch.testing.assert_close(got.out, want.out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.lse, want.lse, rtol=1e-12, atol=1e-12)
    end_to_end = dcp.dcp_attention(q, kv, seq_lens, world_size=p["world"], interleave=p["interleave"], **kw)
    torch.testing.assert_close(end_to_end.lse, want.lse, rtol=1e-12, atol=1e-12)


def test_partial_empty_share_is_zero_and_neg_inf():
    """A rank with no token of a request returns out 0 and lse -inf for it."""
    q, kv = torch.ones(1, 1, 2, 3, dtype=torch.float64), torch.ones(1, 4, 3, dtype=torch.float64)
    got = dcp.dcp_partial_attention(q, kv, torch.tensor([2]), world_size=4, rank=3, d_v=2, scale=1.0)
    assert bool((got.out == 0).all()) and bool(torch.isneginf(got.lse).all())


def test_mtp_causal_is_not_bottom_right_on_a_rank():
    """Query 0 of two (MTP) sees the prefix seq_len - 1: on the rank owning the last token it reads one key fewer."""
    seq_lens = torch.tensor([4])
    prefix = dcp.dcp_query_prefix_lens(seq_lens, 2, causal=True)  # [[3, 4]]
    local = dcp.dcp_local_seq_lens(prefix, world_size=2, interleave=1)  # token 3 is rank 1's
    assert local.tolist() == [[[2, 1], [2, 2]]]


@pytest.mark.parametrize("bad", [dict(world_size=0), dict(interleave=0), dict(world_size=2, rank=2)])
def test_bad_group_arguments(bad):
    kw = dict(world_size=2, interleave=1) | bad
    with pytest.raises(ValueError, match=next(iter(bad if "rank" not in bad else {"rank": 0}))):
        dcp.dcp_local_seq_lens(torch.tensor([3]), **kw)


def test_pictures_draw_what_they_are_given():
    """The sharding figure labels each interleave row with the ranks' local lengths; the error figure has a line per
    series."""
    from mlaspec.conformance.viz.dcp import draw_dcp_error, draw_dcp_sharding

    fig = draw_dcp_sharding(10, 4, [1, 2])
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["I = 1   local lens [3, 3, 2, 2]", "I = 2   local lens [4, 2, 2, 2]"]
    err = draw_dcp_error({"a": {1: 1e-3, 2: 2e-3}, "b": {1: 1e-6, 4: 1e-6}})
    assert len(err.axes[0].get_lines()) == 2
    with pytest.raises(ValueError, match="interleaves"):
        draw_dcp_sharding(10, 4, [])


# -- pages: a rank pages its local sequence as one device pages a whole one -------------------------------------------
def test_slot_mapping_worked_example():
    table = torch.tensor([[5, 9]], dtype=torch.int32)
    qsl = torch.tensor([0, 6], dtype=torch.int32)
    slots = [
        dcp.dcp_slot_mapping(table, 2, qsl, torch.arange(6), world_size=2, rank=r, interleave=1).tolist()
        for r in (0, 1)
    ]
    assert slots == [[10, -1, 11, -1, 18, -1], [-1, 10, -1, 11, -1, 18]]


def _vllm_slots(table, block_size, qsl, positions, world_size, rank, interleave):
    """vLLM's formula, written out as ``vllm/v1/worker/block_table.py`` computes it (the virtual block)."""
    req = torch.repeat_interleave(torch.arange(len(qsl) - 1), (qsl[1:] - qsl[:-1]).long())
    vb, vo = positions // (block_size * world_size), positions % (block_size * world_size)
    local = (vo // interleave) % world_size == rank
    slots = table[req, vb].long() * block_size + vo // (world_size * interleave) * interleave + vo % interleave
    return torch.where(local, slots, -1)


@given(
    st.integers(1, 8),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([8, 16, 64]),
    st.lists(st.integers(1, 200), min_size=1, max_size=4),
    st.data(),
)
def test_slot_mapping_is_vllms_virtual_block(world_size, interleave, block_size, lens, data):
    rank = data.draw(st.integers(0, world_size - 1))
    blocks = max(-(-n // (block_size * world_size)) for n in lens)
    table = torch.randperm(len(lens) * blocks * 2)[: len(lens) * blocks].reshape(len(lens), blocks).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = dcp.dcp_slot_mapping(
        table, block_size, qsl, positions, world_size=world_size, rank=rank, interleave=interleave
    )
    assert torch.equal(slots, _vllm_slots(table, block_size, qsl, positions, world_size, rank, interleave))
    owned = slots[slots >= 0]
    assert owned.unique().numel() == owned.numel()  # no two tokens share a slot
    local = dcp.dcp_local_seq_lens(torch.tensor(lens), world_size=world_size, interleave=interleave, rank=rank)
    assert owned.numel() == int(local.sum())  # every key the rank holds has a slot


def test_slot_mapping_names_a_bad_interleave():
    with pytest.raises(ValueError, match="interleave must divide block_size"):
        dcp.dcp_slot_mapping(
            torch.zeros(1, 1, dtype=torch.int32),
            6,
            torch.tensor([0, 1]),
            torch.arange(1),
            world_size=2,
            rank=0,
            interleave=4,
        )
