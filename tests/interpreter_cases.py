"""Which curated cases the Triton interpreter tests run: all but those that take the varlen attention kernel minutes.

The interpreter runs one Python step per program and key block, so the varlen prefill kernel (``attention``,
``mla_prefill``, the prefills of ``chunked_prefill_attention`` and ``mla_mixed_batch``) costs about a second per
~5,000 (query, key, head) triples: the long-context, 128-head cases take 1-3 minutes each there. They run in
``mlaspec check --backend triton`` on a GPU and in the CPU backends' tests; the decode kernels (``mla_decode``,
``mla_absorbed``, ``mla_decode_fp8``) tile the heads and stay in seconds at those sizes, so they are kept.
"""

from mlaspec.conformance.cases import Case

VARLEN_OPS = ("attention", "mla_prefill", "chunked_prefill_attention", "mla_mixed_batch")
MAX_TRIPLES = 100_000  # (query, key, head) triples through the varlen kernel: ~20 s in the interpreter


def attention_triples(params: dict) -> int:
    """(query, key, head) triples a case's attention computes (every request's queries over context + itself)."""
    h = params.get("H_q", params.get("H", 1))
    if "contexts" in params:
        return h * sum(q * (c + q) for c, q in zip(params["contexts"], params["q_lens"]))
    if "requests" in params:
        return h * sum(q * (c + q) for c, q, *_ in params["requests"])
    return h * params.get("B", 1) * params.get("S_q", 1) * params.get("S_kv", 0)


def interpreter_cases(cases: list[Case]) -> list[Case]:
    """``cases`` without those the interpreter's varlen kernel would take minutes on."""
    return [c for c in cases if c.op not in VARLEN_OPS or attention_triples(c.params) <= MAX_TRIPLES]
