"""Curated conformance cases, named after the deployments they stand for.

A case is an op, a name, a dtype, a seed and the op's size parameters; it is reproducible from its id alone
(``op[name-dtype]``), which is what the reproducer line of a failure names. Sizes come in two scales: ``tiny``
(CPU and the Triton interpreter, seconds) and ``full`` (real DeepSeek dimensions, for GPUs).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case", "curated_cases", "case_by_id"]


@dataclass(frozen=True)
class Case:
    """One conformance case. ``params`` holds the op's sizes (``B, S_q, S_kv, H_q, ...``) and flags."""

    op: str
    name: str
    dtype: str
    params: dict[str, Any] = field(hash=False, compare=False)

    @property
    def id(self) -> str:
        return f"{self.op}[{self.name}-{self.dtype}]"

    @property
    def seed(self) -> int:
        """Derived from the id, so a case draws the same inputs wherever it runs."""
        return zlib.crc32(self.id.encode())


def _cases(scale: str) -> list[tuple[str, str, dict]]:
    full = scale == "full"
    ctx = 4096 if full else 37  # irregular sizes, so padding paths run
    return [
        # dense attention with LSE: GQA/MQA shapes, causal alignment, empty rows
        ("attention", "mha-causal", dict(B=2, S_q=5, S_kv=5, H_q=4, H_kv=4, D_qk=24, D_v=16, causal=True)),
        ("attention", "mqa-extend", dict(B=1, S_q=3, S_kv=11, H_q=4, H_kv=1, D_qk=24, D_v=16, causal=True)),
        ("attention", "gqa-noncausal", dict(B=2, S_q=4, S_kv=9, H_q=6, H_kv=2, D_qk=8, D_v=8, causal=False)),
        ("attention", "more-queries-than-keys", dict(B=1, S_q=6, S_kv=3, H_q=2, H_kv=1, D_qk=8, D_v=4, causal=True)),
        ("attention", "empty-context", dict(B=1, S_q=2, S_kv=0, H_q=2, H_kv=1, D_qk=8, D_v=4, causal=False)),
        # absorbed decode: DeepSeek-V3 TP1 (128 heads) and TP8 (16 heads), MTP next_n 2 and 4
        ("mla_decode", "v3-tp8", dict(B=4 if full else 2, S_q=1, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True)),
        ("mla_decode", "v3-tp1", dict(B=2, S_q=1, S_kv=ctx, H_q=128 if full else 32, D_qk=576, D_v=512, causal=True)),
        ("mla_decode", "mtp2", dict(B=2, S_q=2, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True)),
        ("mla_decode", "mtp4", dict(B=1, S_q=4, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True)),
        ("mla_decode", "length-1", dict(B=3, S_q=1, S_kv=1, H_q=16, D_qk=576, D_v=512, causal=True)),
        # compute-friendly prefill: qk 192 / v 128 per head over a 512 latent
        ("mla_prefill", "v3-tp8-chunk", dict(B=1, S_q=7 if not full else 512, S_kv=(7 if not full else 512) + ctx,
                                             H_q=16, Lkv=512, P=128, R=64, V=128, causal=True)),  # fmt: skip
        ("mla_prefill", "tiny-noncausal", dict(B=2, S_q=5, S_kv=13, H_q=4, Lkv=32, P=16, R=8, V=16, causal=False)),
        # the whole absorbed decode form; TP1 has N = V = 128 heads, so a transposed W_UV still fits its shape
        ("mla_absorbed", "v3-tp8-mtp2", dict(B=2, S_q=2, S_kv=ctx, H_q=16, Lkv=512, P=128, R=64, V=128, causal=True)),
        ("mla_absorbed", "n-equals-v", dict(B=1, S_q=1, S_kv=ctx, H_q=128 if full else 16, Lkv=512 if full else 64,
                                            P=128 if full else 16, R=64 if full else 8, V=128 if full else 16,
                                            causal=True)),  # fmt: skip
        # merge_attn_states: vLLM's layouts, some parts empty (±inf)
        ("merge_attn_states", "tp8", dict(T=9, H=16, D=512, empty=0.0)),
        ("merge_attn_states", "empty-parts", dict(T=7, H=4, D=128, empty=0.4)),
    ]


def curated_cases(
    *, scale: str = "tiny", dtypes: tuple[str, ...] = ("bfloat16", "float16"), ops: tuple[str, ...] | None = None
) -> list[Case]:
    """The curated case list (the same for ``mlaspec check`` and the pytest plugin)."""
    if scale not in ("tiny", "full"):
        raise ValueError(f"scale must be 'tiny' or 'full', got {scale!r}")
    return [
        Case(op, name, dtype, params)
        for op, name, params in _cases(scale)
        if ops is None or op in ops
        for dtype in dtypes
    ]


def case_by_id(case_id: str, *, scale: str = "tiny") -> Case:
    """The case named ``op[name-dtype]`` (as printed in a reproducer)."""
    for dtype in ("bfloat16", "float16", "float32"):
        for case in curated_cases(scale=scale, dtypes=(dtype,)):
            if case.id == case_id:
                return case
    raise ValueError(f"case_id {case_id!r} names no curated case at scale {scale!r}")
