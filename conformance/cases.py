"""Conformance cases: an op, a name, a dtype, a seed and the op's size parameters.

A case is reproducible from its id alone (``op[name-dtype]``), which is what the reproducer line of a failure
names. The curated cases are each op's own (``Op.cases`` in :mod:`mlaspec.conformance.ops`), named after the
deployments they stand for, in two scales: ``tiny`` (CPU and the Triton interpreter, seconds) and ``full`` (real
DeepSeek dimensions, for GPUs).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case", "case_by_id", "curated_cases"]


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


def curated_cases(
    *, scale: str = "tiny", dtypes: tuple[str, ...] = ("bfloat16", "float16"), ops: tuple[str, ...] | None = None
) -> list[Case]:
    """The curated case list (the same for ``mlaspec check`` and the pytest plugin): every registered op's
    ``cases`` at ``scale`` (:class:`~mlaspec.conformance.ops.Op`), in registry order, each in every dtype."""
    from .ops import OPS, Scale  # the ops import Case: resolved at call time

    at = Scale.named(scale)
    return [
        Case(op.name, name, dtype, params)
        for op in OPS.values()
        if ops is None or op.name in ops
        for name, params in op.cases(at)
        for dtype in dtypes
    ]


def case_by_id(case_id: str, *, scale: str = "tiny") -> Case:
    """The case named ``op[name-dtype]`` (as printed in a reproducer)."""
    for dtype in ("bfloat16", "float16", "float32"):
        for case in curated_cases(scale=scale, dtypes=(dtype,)):
            if case.id == case_id:
                return case
    raise ValueError(f"case_id {case_id!r} names no curated case at scale {scale!r}")
