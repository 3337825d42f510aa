"""Conformance cases: an op, a name, a dtype, a seed and the op's size parameters.

A case is reproducible from its id alone when it is curated (``op[name-dtype]``), any other (generated,
``--params``) from its op, name, dtype and parameters: :meth:`Case.repro` is the one command that reruns a case,
whichever it is. The curated cases are each op's own (``Op.cases`` in :mod:`mlaspec.conformance.ops`), named after
the deployments they stand for, in two scales: ``tiny`` (CPU and the Triton interpreter, seconds) and ``full``
(real DeepSeek dimensions, for GPUs).
"""

from __future__ import annotations

import json
import shlex
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

    def is_curated(self, scale: str = "tiny") -> bool:
        """Whether this is the curated case of its id at ``scale`` (the same parameters, not only the same id)."""
        return _curated_params(scale).get((self.op, self.name)) == self.params

    def repro(self, backend: str, scale: str = "tiny") -> str:
        """The one-line command that reruns exactly this case on ``backend``.

        A curated case (:meth:`is_curated` at ``scale``) is named by its id, ``mlaspec check --backend B --case
        'ID'``; any other case (generated, ``--params``) by its parameters, ``mlaspec check --backend B --op OP
        --name NAME --dtypes D --params 'JSON'`` (the name seeds the inputs, so the same tensors come back). Either
        ends in ``--scale full`` at full scale.
        """
        if self.is_curated(scale):
            command = f"mlaspec check --backend {shlex.quote(backend)} --case '{self.id}'"
        else:
            params = json.dumps(self.params, sort_keys=True, separators=(",", ":"))
            command = (
                f"mlaspec check --backend {shlex.quote(backend)} --op {self.op} --name {shlex.quote(self.name)} "
                f"--dtypes {self.dtype} --params {shlex.quote(params)}"
            )
        return command if scale == "tiny" else f"{command} --scale {scale}"


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


def _curated_params(scale: str) -> dict[tuple[str, str], dict]:
    """``(op, name) -> params`` of the curated cases at ``scale`` (of the registry as it is now)."""
    return {(c.op, c.name): c.params for c in curated_cases(scale=scale, dtypes=("float32",))}


def case_by_id(case_id: str, *, scale: str = "tiny") -> Case:
    """The case named ``op[name-dtype]`` (as printed in a reproducer)."""
    for dtype in ("bfloat16", "float16", "float32"):
        for case in curated_cases(scale=scale, dtypes=(dtype,)):
            if case.id == case_id:
                return case
    raise ValueError(f"case_id {case_id!r} names no curated case at scale {scale!r}")
