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

Each op's strategy is its ``Op.generator`` (:mod:`mlaspec.conformance.ops`). Limits (``LIMITS``) keep each
dimension small; the decode keeps DeepSeek's 576 / 512 widths, which a real MLA
kernel needs, and varies everything else.
"""

from __future__ import annotations

from hypothesis import strategies as st

from .cases import Case
from .ops import LIMITS, OPS

__all__ = ["GENERATED_OPS", "LIMITS", "case_strategy", "cases", "generated_ops"]


def generated_ops() -> tuple[str, ...]:
    """The registered ops with a generator (``Op.generator``), in registry order."""
    return tuple(name for name, op in OPS.items() if op.generator is not None)


GENERATED_OPS = generated_ops()
"""The built-in ops with a generator; :func:`generated_ops` also sees ops registered later."""


def case_strategy(op: str, dtypes: tuple[str, ...] = ("bfloat16", "float16")) -> st.SearchStrategy[Case]:
    """Cases of ``op`` with drawn sizes, one of ``dtypes`` and a drawn name ``hyp-<n>`` (which seeds the inputs)."""
    if op not in generated_ops():
        raise ValueError(f"op must be one of {', '.join(generated_ops())}, got {op!r}")
    if not dtypes:
        raise ValueError("dtypes must name at least one dtype")
    return st.builds(
        lambda params, dtype, tag: Case(op, f"hyp-{tag}", dtype, params),
        OPS[op].generator(),
        st.sampled_from(tuple(dtypes)),
        st.integers(0, LIMITS["tag"]),
    )


def cases(ops: tuple[str, ...] = GENERATED_OPS, dtypes: tuple[str, ...] = ("bfloat16", "float16")):
    """Cases of any of ``ops``."""
    return st.one_of(*(case_strategy(op, dtypes) for op in ops))
