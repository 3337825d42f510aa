"""Hypothesis strategies that generate conformance cases beyond the curated list.

Each strategy draws a whole :class:`~mlaspec.conformance.cases.Case` for one op: sizes within small limits (so a
case runs in milliseconds on a CPU), a dtype, the causal flag, and for ``merge_attn_states`` the fraction of empty
(``±inf`` LSE) parts; ``sparse_prefill`` draws invalid-index rates, ``topk_length``, empty rows and sinks,
``chunked_prefill_attention`` contexts (some empty) and a workspace that gives one to several chunks,
``topk_indices`` prefill or decode rows with ties, ``concat_and_cache_mla`` every cache dtype with padding slots
``-1``. A case's inputs come from its seed, which is derived from its id, and the id carries a drawn
``name`` (``hyp-<n>``): the same drawn parameters always mean the same tensors, so a case found by hypothesis is
rerun exactly by its :meth:`~mlaspec.conformance.cases.Case.repro` (``mlaspec check --op OP --name NAME --dtypes D
--params JSON``).

Hypothesis shrinks a failing case towards fewer batches, shorter sequences, fewer heads and narrower heads; the
pytest plugin prints the minimal one as a ``Case(...)`` literal plus that command, and ``mlaspec check --generated
N --seed S`` draws N cases per op from a fixed seed.

Limits (``LIMITS``) keep each dimension small; the decode keeps DeepSeek's 576 / 512 widths, which a real MLA
kernel needs, and varies everything else.
"""

from __future__ import annotations

from hypothesis import strategies as st

from .cases import Case

__all__ = ["GENERATED_OPS", "LIMITS", "case_strategy", "cases"]

GENERATED_OPS = (
    "attention",
    "mla_decode",
    "mla_prefill",
    "merge_attn_states",
    "sparse_prefill",
    "chunked_prefill_attention",
    "topk_indices",
    "concat_and_cache_mla",
)

#: Inclusive upper limits of the drawn sizes.
LIMITS = dict(
    B=3,
    S_q=6,
    S_kv=24,
    H_kv=3,
    group=3,
    D_qk=40,
    D_v=24,
    H_decode=16,
    Lkv=32,
    P=16,
    R=8,
    V=16,
    T=9,
    H=4,
    D=64,
    K=16,
    H_sparse=8,
    requests=4,
    context=20,
    q_len=5,
    M=8,
    N=40,
    blocks=4,
    tag=999,
)


@st.composite
def _attention(draw) -> dict:
    h_kv = draw(st.integers(1, LIMITS["H_kv"]))
    return dict(
        B=draw(st.integers(1, LIMITS["B"])),
        S_q=draw(st.integers(1, LIMITS["S_q"])),
        S_kv=draw(st.integers(0, LIMITS["S_kv"])),
        H_q=h_kv * draw(st.integers(1, LIMITS["group"])),
        H_kv=h_kv,
        D_qk=draw(st.integers(1, LIMITS["D_qk"])),
        D_v=draw(st.integers(1, LIMITS["D_v"])),
        causal=draw(st.booleans()),
    )


@st.composite
def _mla_decode(draw) -> dict:
    return dict(
        B=draw(st.integers(1, LIMITS["B"])),
        S_q=draw(st.integers(1, 4)),
        S_kv=draw(st.integers(1, LIMITS["S_kv"])),
        H_q=draw(st.integers(1, LIMITS["H_decode"])),
        D_qk=576,
        D_v=512,
        causal=draw(st.booleans()),
    )


@st.composite
def _mla_prefill(draw) -> dict:
    s_q = draw(st.integers(1, LIMITS["S_q"]))
    return dict(
        B=draw(st.integers(1, 2)),
        S_q=s_q,
        S_kv=s_q + draw(st.integers(0, LIMITS["S_kv"] // 2)),
        H_q=draw(st.integers(1, LIMITS["H"])),
        Lkv=draw(st.integers(1, LIMITS["Lkv"])),
        P=draw(st.integers(1, LIMITS["P"])),
        R=2 * draw(st.integers(1, LIMITS["R"] // 2)),
        V=draw(st.integers(1, LIMITS["V"])),
        causal=draw(st.booleans()),
    )


@st.composite
def _merge_attn_states(draw) -> dict:
    return dict(
        T=draw(st.integers(1, LIMITS["T"])),
        H=draw(st.integers(1, LIMITS["H"])),
        D=draw(st.integers(1, LIMITS["D"])),
        empty=draw(st.sampled_from([0.0, 0.3, 1.0])),
    )


@st.composite
def _sparse_prefill(draw) -> dict:
    """FlashMLA's widths (576 / 512, or V4's 512 / 512) and one KV head; ``K <= S_kv - 2`` distinct keys per row
    (rows 0 and ``S_kv - 1`` stay NaN), invalid sentinels at a drawn rate, optional ``topk_length``, empty rows
    and sink."""
    s_kv = draw(st.integers(3, LIMITS["S_kv"]))
    d_qk = draw(st.sampled_from([576, 512]))
    p = dict(
        S_q=draw(st.integers(1, LIMITS["S_q"])),
        S_kv=s_kv,
        H_q=draw(st.integers(1, LIMITS["H_sparse"])),
        H_kv=1,
        D_qk=d_qk,
        D_v=512,
        K=draw(st.integers(1, min(LIMITS["K"], s_kv - 2))),
        invalid=draw(st.sampled_from([0.0, 0.2, 0.5])),
        topk_length=draw(st.booleans()),
        empty=draw(st.integers(0, 2)),
    )
    sink = draw(st.sampled_from([None, "finite", "inf"]))
    if sink is not None:
        p["sink"] = sink
    return p


@st.composite
def _chunked_prefill_attention(draw) -> dict:
    """Requests with and without context, a workspace from one page per prefill with context up to a few, so the
    plan runs one to several chunks."""
    n = draw(st.integers(1, LIMITS["requests"]))
    contexts = draw(st.lists(st.integers(0, LIMITS["context"]), min_size=n, max_size=n))
    block = draw(st.sampled_from([1, 2, 4]))
    with_context = max(sum(c > 0 for c in contexts), 1)
    workspace = with_context * block * draw(st.integers(1, 4)) + draw(st.integers(0, block - 1))
    return dict(
        H_q=draw(st.integers(1, LIMITS["H"])),
        Lkv=draw(st.integers(1, LIMITS["Lkv"])),
        P=draw(st.integers(1, LIMITS["P"])),
        R=2 * draw(st.integers(1, LIMITS["R"] // 2)),
        V=draw(st.integers(1, LIMITS["V"])),
        contexts=contexts,
        q_lens=draw(st.lists(st.integers(1, LIMITS["q_len"]), min_size=n, max_size=n)),
        block_size=block,
        workspace_size=workspace,
    )


@st.composite
def _topk_indices(draw) -> dict:
    """Prefill (ragged spans, relative indices) or decode rows (some shorter than ``K``); the case's inputs put
    logits on a coarse grid with a tie straddling the ``K``-th position."""
    k = draw(st.integers(2, LIMITS["K"]))
    if draw(st.booleans()):
        n = draw(st.integers(1, LIMITS["requests"]))
        q = draw(st.lists(st.integers(1, LIMITS["q_len"]), min_size=n, max_size=n))
        extra = draw(st.lists(st.integers(0, LIMITS["N"] - LIMITS["q_len"]), min_size=n, max_size=n))
        return dict(mode="prefill", K=k, query_lens=q, seq_lens=[a + b for a, b in zip(q, extra)])
    return dict(mode="decode", K=k, M=draw(st.integers(1, LIMITS["M"])), N=draw(st.integers(1, LIMITS["N"])))


@st.composite
def _concat_and_cache_mla(draw) -> dict:
    """A paged cache of a few blocks, ``T`` tokens of which the last ``pad`` are padding (slot ``-1``), in every
    cache dtype (the per-tensor fp8 ones with a drawn scale)."""
    block = draw(st.sampled_from([1, 2, 4, 16]))
    blocks = draw(st.integers(2 if block == 1 else 1, LIMITS["blocks"]))  # the last slot stays unused
    pad = draw(st.integers(0, 3))
    t = pad + draw(st.integers(1, min(LIMITS["T"], blocks * block - 1)))
    kind = draw(st.sampled_from(["auto", "fp8", "fp8_e5m2", "fp8_ds_mla"]))
    p = dict(T=t, pad=pad, P=block, num_blocks=blocks, kv_cache_dtype=kind)
    if kind in ("fp8", "fp8_e5m2"):
        p["scale"] = draw(st.sampled_from([0.09375, 0.5, 1.0, 2.0]))
    return p


_PARAMS = {
    "attention": _attention,
    "mla_decode": _mla_decode,
    "mla_prefill": _mla_prefill,
    "merge_attn_states": _merge_attn_states,
    "sparse_prefill": _sparse_prefill,
    "chunked_prefill_attention": _chunked_prefill_attention,
    "topk_indices": _topk_indices,
    "concat_and_cache_mla": _concat_and_cache_mla,
}


def case_strategy(op: str, dtypes: tuple[str, ...] = ("bfloat16", "float16")) -> st.SearchStrategy[Case]:
    """Cases of ``op`` with drawn sizes, one of ``dtypes`` and a drawn name ``hyp-<n>`` (which seeds the inputs)."""
    if op not in _PARAMS:
        raise ValueError(f"op must be one of {', '.join(_PARAMS)}, got {op!r}")
    if not dtypes:
        raise ValueError("dtypes must name at least one dtype")
    return st.builds(
        lambda params, dtype, tag: Case(op, f"hyp-{tag}", dtype, params),
        _PARAMS[op](),
        st.sampled_from(tuple(dtypes)),
        st.integers(0, LIMITS["tag"]),
    )


def cases(ops: tuple[str, ...] = GENERATED_OPS, dtypes: tuple[str, ...] = ("bfloat16", "float16")):
    """Cases of any of ``ops``."""
    return st.one_of(*(case_strategy(op, dtypes) for op in ops))
