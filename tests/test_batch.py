"""Batch metadata: construction and its checks, the decode/prefill split, both reorders, local virtual batches."""

import itertools
from collections import deque

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.spec.batch import (
    CommonAttentionMetadata,
    Request,
    build_metadata,
    make_local_attention_virtual_batches,
    reorder_batch_to_split_decodes_and_prefills,
    request_region,
    split_decodes_and_prefills,
)

# One request per 0.33 region, threshold 1: decode, short extend, long extend, prefill.
BY_REGION = {0: Request(3, 1), 1: Request(3, 1, prompt_len=10), 2: Request(3, 5), 3: Request(0, 5)}


def requests_strategy(max_size=6, max_new=5):
    req = st.builds(
        Request,
        context_len=st.integers(0, 9),
        new_tokens=st.integers(1, max_new),
        prompt_len=st.one_of(st.none(), st.integers(1, 12)),
    )
    return st.lists(req, min_size=0, max_size=max_size)


def min_swaps(labels):
    """Fewest swaps that sort ``labels`` into contiguous regions (breadth-first search; tiny batches only)."""
    start, target = tuple(labels), tuple(sorted(labels))
    dist, todo = {start: 0}, deque([start])
    while todo:
        s = todo.popleft()
        if s == target:
            return dist[s]
        for i, j in itertools.combinations(range(len(s)), 2):
            if s[i] != s[j]:
                t = list(s)
                t[i], t[j] = t[j], t[i]
                t = tuple(t)
                if t not in dist:
                    dist[t] = dist[s] + 1
                    todo.append(t)
    raise AssertionError("unreachable")


# -- metadata -----------------------------------------------------------------------------------------------------


def test_build_metadata_docstring_example():
    m = build_metadata([Request(5, 1), Request(0, 4), Request(7, 2)], block_size=4)
    assert m.query_start_loc.tolist() == [0, 1, 5, 7]
    assert m.seq_lens.tolist() == [6, 4, 9]
    assert m.num_computed_tokens.tolist() == [5, 0, 7]
    assert m.block_table.tolist() == [[0, 1, -1], [2, -1, -1], [3, 4, 5]]
    assert m.slot_mapping.tolist() == [5, 8, 9, 10, 11, 19, 20]
    assert (m.num_reqs, m.num_actual_tokens, m.max_query_len, m.max_seq_len) == (3, 7, 4, 9)
    assert m.token_request().tolist() == [0, 1, 1, 1, 1, 2, 2]
    assert m.token_positions().tolist() == [5, 0, 1, 2, 3, 7, 8]


def test_given_block_table_drives_slots():
    table = torch.tensor([[7, 2], [0, 5]])
    m = build_metadata([Request(3, 2), Request(1, 1)], block_size=4, block_table=table, num_blocks=8)
    # request 0: positions 3, 4 -> page 7 slot 3, page 2 slot 0; request 1: position 1 -> page 0 slot 1
    assert m.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 0 * 4 + 1]


@given(requests_strategy(), st.integers(1, 4))
def test_every_token_has_one_slot_and_one_request(reqs, block_size):
    m = build_metadata(reqs, block_size=block_size)
    assert m.num_actual_tokens == sum(r.new_tokens for r in reqs)
    assert len(set(m.slot_mapping.tolist())) == m.num_actual_tokens  # identity allocation: no slot shared
    assert torch.bincount(m.token_request(), minlength=len(reqs)).tolist() == [r.new_tokens for r in reqs]
    # the slot of a token at position pos sits in the page the block table lists for pos
    pages = m.slot_mapping // block_size
    table_pages = m.block_table.long()[m.token_request(), m.token_positions() // block_size]
    assert torch.equal(pages, table_pages)


def _valid_parts():
    m = build_metadata([Request(2, 1), Request(0, 3)], block_size=2)
    return dict(
        query_start_loc=m.query_start_loc,
        seq_lens=m.seq_lens,
        num_computed_tokens=m.num_computed_tokens,
        block_table=m.block_table,
        slot_mapping=m.slot_mapping,
        is_prefilling=m.is_prefilling,
        block_size=2,
        num_blocks=m.num_blocks,
    )


def test_valid_parts_construct():
    assert CommonAttentionMetadata(**_valid_parts()).num_actual_tokens == 4


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(query_start_loc=torch.tensor([0, 3, 1], dtype=torch.int32)), "query_start_loc must be non-decreasing"),
        (dict(query_start_loc=torch.tensor([1, 2, 4], dtype=torch.int32)), "query_start_loc must start at 0"),
        (dict(query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32)), "query_start_loc must end at T"),
        (dict(seq_lens=torch.tensor([3, 4], dtype=torch.int32)), "seq_lens must equal"),
        (dict(num_computed_tokens=torch.tensor([2, -1], dtype=torch.int32)), "num_computed_tokens must be >= 0"),
        (dict(slot_mapping=torch.tensor([4, 6, 7, 99])), "slot_mapping must lie in the cache"),
        (dict(slot_mapping=torch.tensor([4, 6, 7, 6])), "slot_mapping must follow block_table"),
        (dict(block_table=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)), "block_table row 0"),
        (dict(block_table=torch.tensor([[0], [2]], dtype=torch.int32)), "block_table must have at least 2"),
        (dict(seq_lens=torch.tensor([3, 3, 3], dtype=torch.int32)), "seq_lens must have shape"),
        (dict(is_prefilling=torch.tensor([1, 0])), "is_prefilling must have dtype bool"),
    ],
)
def test_bad_metadata_raises(change, match):
    parts = {**_valid_parts(), **change}
    with pytest.raises((ValueError, TypeError), match=match):
        CommonAttentionMetadata(**parts)


def test_bad_requests_raise():
    with pytest.raises(ValueError, match="context_len"):
        Request(-1, 2)
    with pytest.raises(TypeError, match="new_tokens"):
        Request(0, 1.5)
    with pytest.raises(ValueError, match="block_table"):
        build_metadata([Request(4, 1)], block_size=2, block_table=torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="block_table"):
        build_metadata([Request(1, 1)], block_size=2, block_table=torch.tensor([[5]]), num_blocks=4)
    with pytest.raises(TypeError, match="requests"):
        build_metadata([(1, 1)], block_size=2)


# -- split ----------------------------------------------------------------------------------------------------------


def test_split_example():
    # two decodes (1 token), then prefills of 4 and 2 tokens
    m = build_metadata([Request(5, 1), Request(9, 1), Request(0, 4), Request(7, 2)], block_size=4)
    assert split_decodes_and_prefills(m) == (2, 2, 2, 6)
    # MTP: with 1 + 2 speculative tokens, a 2-token query is a decode but then it follows a prefill
    with pytest.raises(ValueError, match="metadata must be reordered"):
        split_decodes_and_prefills(m, decode_threshold=3)
    mtp = build_metadata([Request(5, 3), Request(9, 2), Request(0, 4)], block_size=4)
    assert split_decodes_and_prefills(mtp, decode_threshold=3) == (2, 1, 5, 4)
    assert split_decodes_and_prefills(mtp) == (0, 3, 0, 9)  # first query longer than 1: no decodes


def test_split_all_decode_and_empty():
    m = build_metadata([Request(5, 1), Request(9, 1)], block_size=4)
    assert split_decodes_and_prefills(m) == (2, 0, 2, 0)
    assert split_decodes_and_prefills(build_metadata([], block_size=4)) == (0, 0, 0, 0)


def test_split_require_uniform():
    uniform = build_metadata([Request(5, 2), Request(9, 2), Request(1, 0)], block_size=4)  # last one: padding
    assert split_decodes_and_prefills(uniform, decode_threshold=2, require_uniform=True) == (3, 0, 4, 0)
    mixed = build_metadata([Request(5, 2), Request(9, 1), Request(0, 4)], block_size=4)
    assert split_decodes_and_prefills(mixed, decode_threshold=2) == (2, 1, 3, 4)
    # uniform decodes required: the 1-token query breaks uniformity and goes to the prefill side
    assert split_decodes_and_prefills(mixed, decode_threshold=2, require_uniform=True) == (1, 2, 2, 5)


def test_split_short_extends():
    # a 1-token chunk of a prompt still being prefilled (short extend) sits between decodes and long extends
    m = build_metadata([Request(5, 1), Request(3, 1, prompt_len=10), Request(3, 5)], block_size=4)
    assert split_decodes_and_prefills(m) == (2, 1, 2, 5)
    assert split_decodes_and_prefills(m, treat_short_extends_as_decodes=False) == (1, 2, 1, 6)
    # a 1-token first chunk after a prefill (0.33's prefill region) counts as a prefill, not as a misplaced decode
    first_chunks = build_metadata([Request(5, 1), Request(0, 3), Request(0, 1)], block_size=4)
    assert split_decodes_and_prefills(first_chunks) == (1, 2, 1, 4)


def test_split_padded_batch_as_vllm_counts_it():
    """CUDA-graph padding: ``num_actual_tokens`` larger than ``query_start_loc[-1]``. vLLM's
    ``tests/v1/attention/test_attention_splitting.py``
    (``test_split_decodes_and_prefills_uniform_padded_batch_all_same``): query lengths ``[2, 2, 2, 0]`` padded
    to 8 tokens, ``decode_threshold=3``, ``require_uniform=True`` give ``(4, 0, 8, 0)``: all decodes, the padding
    counted with them."""
    reqs = [Request(5, 2), Request(9, 2), Request(3, 2), Request(0, 0)]
    m = build_metadata(reqs, block_size=4, num_actual_tokens=8)
    assert (m.num_tokens, m.num_actual_tokens) == (6, 8)
    assert split_decodes_and_prefills(m, 3, True) == (4, 0, 8, 0)
    # with a prefill, the padding goes to the prefill side: num_actual_tokens - query_start_loc[num_decodes]
    mixed = build_metadata([Request(5, 1), Request(0, 3)], block_size=4, num_actual_tokens=8)
    assert split_decodes_and_prefills(mixed) == (1, 1, 1, 7)
    assert split_decodes_and_prefills(build_metadata([], block_size=4, num_actual_tokens=2)) == (0, 0, 2, 0)
    with pytest.raises(ValueError, match="num_actual_tokens"):
        build_metadata(reqs, block_size=4, num_actual_tokens=5)  # fewer than the real tokens


@given(requests_strategy(max_size=6), st.integers(1, 3), st.integers(0, 5))
def test_split_padding_adds_to_the_last_side(reqs, threshold, pad):
    """Padding changes no boundary; its tokens join the prefills when there are any, else the decodes."""
    reqs = list(reorder_batch_to_split_decodes_and_prefills(reqs, threshold).requests)
    plain = split_decodes_and_prefills(build_metadata(reqs, block_size=4), threshold)
    t = sum(r.new_tokens for r in reqs)
    padded = split_decodes_and_prefills(build_metadata(reqs, block_size=4, num_actual_tokens=t + pad), threshold)
    assert padded[:2] == plain[:2]
    if plain.num_prefills:
        assert padded[2:] == (plain.num_decode_tokens, plain.num_prefill_tokens + pad)
    else:
        assert padded[2:] == (plain.num_decode_tokens + pad, 0)


def test_split_raises_when_a_decode_follows_a_first_prefill():
    """The documented ``Raises`` holds when request 0 is itself the prefill (vLLM returns ``(0, B, 0, T)`` there
    without looking further); a 1-token first chunk (no context) after it is a prefill, not a misplaced decode."""
    m = build_metadata([Request(0, 4), Request(7, 1)], block_size=4)
    with pytest.raises(ValueError, match="request 1 .* is a decode after the first prefill, request 0"):
        split_decodes_and_prefills(m)
    assert split_decodes_and_prefills(build_metadata([Request(0, 4), Request(0, 1)], block_size=4)) == (0, 2, 0, 5)
    # require_uniform sends such rows to the prefill side, as vLLM does: no error
    assert split_decodes_and_prefills(m, require_uniform=True) == (0, 2, 0, 5)


def test_split_bad_input():
    m = build_metadata([Request(5, 1)], block_size=4)
    with pytest.raises(ValueError, match="decode_threshold"):
        split_decodes_and_prefills(m, decode_threshold=0)
    with pytest.raises(TypeError, match="metadata"):
        split_decodes_and_prefills("batch")
    with pytest.raises(TypeError, match="require_uniform"):
        split_decodes_and_prefills(m, require_uniform=1)


@given(requests_strategy(max_size=7), st.integers(1, 3), st.sampled_from([2, 4]))
def test_split_after_reorder(reqs, threshold, regions):
    r = reorder_batch_to_split_decodes_and_prefills(reqs, threshold, regions=regions)
    m = build_metadata(list(r.requests), block_size=4)
    d, p, dt, pt = split_decodes_and_prefills(m, threshold)
    q = [x.new_tokens for x in r.requests]
    assert d + p == len(reqs) and dt + pt == m.num_actual_tokens
    assert all(x <= threshold for x in q[:d])
    # after the boundary: long queries, or (0.33 only) short first chunks, which have no context
    assert all(x.new_tokens > threshold or (regions == 4 and x.context_len == 0) for x in r.requests[d:])
    assert dt == sum(q[:d])


# -- reorder --------------------------------------------------------------------------------------------------------


def test_reorder_seed_example():
    # prefill, decode, prefill, decode: the decode at the back swaps with the prefill at the front
    reqs = [Request(0, 5), Request(3, 1), Request(0, 2), Request(4, 1)]
    r = reorder_batch_to_split_decodes_and_prefills(reqs, regions=2)
    assert r.swaps == ((0, 3),)
    assert r.order == (3, 1, 2, 0)
    assert r.regions == (0, 0, 1, 1)
    assert r.modified


def test_reorder_0_33_example_not_minimal():
    # regions short_extend, long_extend, decode, short_extend: the cycle walk takes 3 swaps, 2 would do
    labels = (1, 2, 0, 1)
    r = reorder_batch_to_split_decodes_and_prefills([BY_REGION[g] for g in labels])
    assert r.regions == (0, 1, 1, 2)
    assert len(r.swaps) == 3
    assert min_swaps(labels) == 2


@given(requests_strategy(max_size=7), st.integers(1, 3), st.sampled_from([2, 4]))
def test_reorder_partitions_and_keeps_every_request(reqs, threshold, regions):
    r = reorder_batch_to_split_decodes_and_prefills(reqs, threshold, regions=regions)
    assert sorted(r.order) == list(range(len(reqs)))  # a permutation: every request exactly once
    assert list(r.requests) == [reqs[i] for i in r.order]
    assert list(r.regions) == sorted(r.regions)  # contiguous regions, decodes first
    assert list(r.regions) == [request_region(x, threshold, regions) for x in r.requests]
    again = reorder_batch_to_split_decodes_and_prefills(list(r.requests), threshold, regions=regions)
    assert not again.modified  # already partitioned: nothing to do


@given(requests_strategy(max_size=7), st.integers(1, 3))
def test_reorder_seed_swaps_are_minimal(reqs, threshold):
    labels = [request_region(x, threshold, 2) for x in reqs]
    r = reorder_batch_to_split_decodes_and_prefills(reqs, threshold, regions=2)
    assert len(r.swaps) == min_swaps(labels)


@given(st.lists(st.integers(0, 3), max_size=6))
def test_reorder_0_33_swaps_never_below_minimum(labels):
    r = reorder_batch_to_split_decodes_and_prefills([BY_REGION[g] for g in labels])
    assert list(r.regions) == sorted(labels)
    assert len(r.swaps) >= min_swaps(labels)
    if len(set(labels)) <= 2:  # two regions out of place: pairs of swaps, minimal
        assert len(r.swaps) == min_swaps(labels)


def test_regions_0_33():
    assert [request_region(BY_REGION[g]) for g in range(4)] == [0, 1, 2, 3]
    assert request_region(Request(0, 1)) == 3  # a 1-token first chunk is a prefill in 0.33 ...
    assert request_region(Request(0, 1), regions=2) == 0  # ... and a decode in the seed's split
    with pytest.raises(ValueError, match="regions"):
        request_region(Request(0, 1), regions=3)
    with pytest.raises(ValueError, match="regions"):
        reorder_batch_to_split_decodes_and_prefills([Request(0, 1)], regions=3)


# -- local attention virtual batches --------------------------------------------------------------------------------


def test_local_virtual_batches_worked_example():
    # vLLM's docstring: attn_chunk_size 4, q_seqlens [4, 10, 5], kv_seqlens [6, 17, 9], block_size 2
    table = torch.arange(30).reshape(3, 10)
    m = build_metadata([Request(2, 4), Request(7, 10), Request(4, 5)], block_size=2, block_table=table)
    v = make_local_attention_virtual_batches(4, m)
    assert v.seqlens_q_local.tolist() == [2, 2, 1, 4, 4, 1, 4, 1]
    assert v.seqlens_k_local.tolist() == [4, 2, 4, 4, 4, 1, 4, 1]
    assert v.k_seqstarts_absolute.tolist() == [0, 4, 4, 8, 12, 16, 4, 8]
    assert v.block_table_local.tolist() == [[0, 1], [2, 3], [12, 13], [14, 15], [16, 17], [18, 19], [22, 23], [24, 25]]
    # vLLM's comment says [0, 4, 6, 10, 14, 18, 19, 23, 24]; its code computes the cumsum of seqlens_q_local
    assert v.cu_seqlens_q_local.tolist() == [0, 2, 4, 5, 9, 13, 14, 18, 19]
    assert v.request.tolist() == [0, 0, 1, 1, 1, 1, 2, 2]
    assert v.metadata.num_actual_tokens == m.num_actual_tokens


@st.composite
def local_problem(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    chunk = block_size * draw(st.integers(1, 3))
    reqs = draw(st.lists(st.builds(Request, st.integers(0, 12), st.integers(1, 9)), min_size=1, max_size=4))
    return chunk, build_metadata(reqs, block_size=block_size)


@given(local_problem())
def test_virtual_batches_see_the_local_mask(problem):
    chunk, m = problem
    v = make_local_attention_virtual_batches(chunk, m)
    p = m.block_size
    seen = {}  # (request, query position) -> set of absolute key positions
    lm = v.metadata
    for i in range(lm.num_reqs):
        b, k0 = int(v.request[i]), int(v.k_seqstarts_absolute[i])
        q_len, k_len = int(v.seqlens_q_local[i]), int(v.seqlens_k_local[i])
        for j in range(k_len):  # the local block table maps each local key to the real key's page
            assert int(v.block_table_local[i, j // p]) == int(m.block_table[b, (k0 + j) // p])
        for qi in range(q_len):  # bottom-right causal inside the virtual request
            pos = k0 + (k_len - q_len) + qi
            assert (b, pos) not in seen  # each query in exactly one virtual request
            seen[(b, pos)] = {k0 + j for j in range(k_len) if j <= qi + k_len - q_len}
    expected = {}
    for b in range(m.num_reqs):
        for pos in range(int(m.num_computed_tokens[b]), int(m.seq_lens[b])):
            expected[(b, pos)] = {j for j in range(pos + 1) if j // chunk == pos // chunk}
    assert seen == expected
    # tokens keep their order: virtual requests tile the token axis in the original order
    absolute = v.k_seqstarts_absolute.long()[lm.token_request()] + lm.token_positions()
    assert torch.equal(absolute, m.token_positions())
    assert torch.equal(v.request[lm.token_request()], m.token_request())


def test_local_virtual_batches_bad_input():
    m = build_metadata([Request(2, 4)], block_size=4)
    with pytest.raises(ValueError, match="attn_chunk_size"):
        make_local_attention_virtual_batches(6, m)
    with pytest.raises(ValueError, match="attn_chunk_size"):
        make_local_attention_virtual_batches(0, m)
    with pytest.raises(ValueError, match="block_size"):
        make_local_attention_virtual_batches(8, m, block_size=2)
    empty = build_metadata([Request(2, 0)], block_size=4)
    with pytest.raises(ValueError, match="at least one new token"):
        make_local_attention_virtual_batches(4, empty)


def test_split_require_uniform_padding_rows_follow_vllm_033():
    # vLLM 0.33: is_prefill = (q != q[0]) & (q != 0) -- a CUDA-graph padding row (q = 0) before the first longer
    # query is not the first prefill (found by running 0.33's own split_decodes_and_prefills on random batches)
    m = build_metadata([Request(30, 1), Request(15, 0), Request(7, 1), Request(0, 2)], block_size=4)
    assert split_decodes_and_prefills(m, decode_threshold=1, require_uniform=True) == (3, 1, 2, 2)
    # the uniform shortcut applies only when short extends count as decodes: otherwise is_prefilling decides
    u = build_metadata([Request(5, 2), Request(3, 2, prompt_len=10), Request(9, 0)], block_size=4)
    assert split_decodes_and_prefills(u, decode_threshold=2, require_uniform=True) == (3, 0, 4, 0)
    assert split_decodes_and_prefills(
        u, decode_threshold=2, require_uniform=True, treat_short_extends_as_decodes=False
    ) == (1, 2, 2, 2)
