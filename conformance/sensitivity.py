"""How small a systematic error the default run detects, per op and dtype: the sensitivity table.

Each probe wraps the built-in ``torch`` backend (which rounds where the budgets' model says) with one systematic
error of size ``c`` and runs an op's default cases (tiny scale) through the same judge as ``mlaspec check``:

* ``output scale``: the main output (``out``, ``logits``) plus ``c ref``, returned in float64 (rounding it to the
  case dtype again would undo an error below half an ulp, where a kernel's fp32 result scaled so does round
  differently; the judge still holds the output to the case dtype's budget);
* ``softmax scale``: the op called with ``scale * (1 + c)`` (ops that take a ``scale``);
* ``LSE offset``: ``c`` (nats) added to every LSE;
* ``one head``: the last head's output times ``1 + c`` (the second 64-head tile where a case has 128 heads);
* ``one request``: the last request's output times ``1 + c`` (the last token where the op's output is varlen).

The table gives, per kind, the smallest ``c`` on the ladder :data:`LADDER` at and above which some case fails
(bisection, so detection is assumed monotone in ``c``); ``—`` where the kind does not apply, ``> 1`` where nothing up
to ``c = 1`` is caught. A wrong page or a wrong split-KV piece is not a scalar error: the mutation corpus
(``tests/test_mutants_*.py``, ``docs/mutants.md``) covers those.

    python -m mlaspec.conformance.sensitivity [--ops a,b] [--dtypes bfloat16,float16] [--out docs/sensitivity.md]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable

import torch

from .backends.torch_eager import TorchBackend
from .cases import Case, curated_cases
from .ops import DTYPES, OPS, unit_roundoff

__all__ = ["GOALS", "KINDS", "LADDER", "detected", "sensitivity", "smallest_detected", "table"]

LADDER = tuple(m * 10.0**e for e in range(-6, 0) for m in (1, 2, 5)) + (1.0,)
"""The error sizes probed: 1e-6, 2e-6, 5e-6, ..., 0.5, 1."""

KINDS = ("output scale", "softmax scale", "LSE offset", "one head", "one request")

GOALS = {("output scale", "bfloat16"): 5e-3, ("softmax scale", "bfloat16"): 1e-3}
"""Issue 16's goals for the attention-type ops: detect these in the default run."""

ATTENTION_OPS = (
    "attention",
    "mla_decode",
    "mla_prefill",
    "mla_absorbed",
    "merge_attn_states",
    "mla_decode_fp8",
    "chunked_prefill_attention",
    "mla_mixed_batch",
    "sparse_prefill",
    "sparse_decode",
    "v4_attention",
)
"""The ops the goals hold for (``indexer_logits`` and ``paged_indexer_logits`` are in the table too)."""

_MAIN = ("out", "logits")


class _Prepared:
    """One case with its inputs, reference, budgets and the torch backend's outputs, computed once."""

    def __init__(self, case: Case, backend: TorchBackend):
        self.case, self.op = case, OPS[case.op]
        self.inputs = self.op.make_inputs(case)
        self.ref = tuple(self.op.reference(**self.inputs))
        self.u = unit_roundoff(DTYPES[case.dtype])
        self.bounds = None if self.op.bounds is None else self.op.bounds(self.inputs, self.ref, self.u)
        self.backend = backend
        self.got = self.call(self.inputs)

    def call(self, inputs: dict) -> tuple:
        fresh = {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
        got = getattr(self.backend, self.case.op)(**fresh)
        return tuple(got) if isinstance(got, (tuple, list)) else (got,)

    def fails(self, got: tuple) -> bool:
        return self.op.verdict(got, self.ref, self.bounds, self.u, lambda: self.inputs)[0] != "pass"


def _index(name: str) -> Callable[[torch.Tensor], tuple]:
    """The slice of one output a ``one head`` / ``one request`` error touches."""
    if name == "one head":
        return lambda t: (..., t.shape[-2] - 1, slice(None)) if t.dim() >= 3 else None
    return lambda t: (t.shape[0] - 1,) if t.dim() >= 2 else None


def _perturbed(p: _Prepared, kind: str, c: float) -> tuple | None:
    """``p``'s outputs with the error ``kind`` of size ``c``; None where the kind does not apply to the op."""
    names = p.op.outputs
    if kind == "softmax scale":
        scale = p.inputs.get("scale")
        if not isinstance(scale, float):
            return None
        return p.call({**p.inputs, "scale": scale * (1 + c)})
    out = list(p.got)
    if kind == "LSE offset":
        if "lse" not in names:
            return None
        i = names.index("lse")
        out[i] = out[i] + c
        return tuple(out)
    main = next((n for n in names if n in _MAIN), None)
    if main is None:
        return None
    i = names.index(main)
    got, ref = out[i].double(), p.ref[i]
    scaled = torch.zeros_like(ref)
    where = (...,) if kind == "output scale" else _index(kind)(ref)
    if where is None:
        return None
    scaled[where] = c * ref[where].nan_to_num(0.0, posinf=0.0, neginf=0.0)
    out[i] = got + scaled  # float64, not rounded again: c = 0 gives the backend's own output back
    return tuple(out)


def detected(prepared: list[_Prepared], kind: str, c: float) -> bool | None:
    """Whether an error ``kind`` of size ``c`` fails some case of ``prepared`` (None: the kind does not apply)."""
    applies = False
    for p in prepared:
        got = _perturbed(p, kind, c)
        if got is None:
            continue
        applies = True
        if p.fails(got):
            return True
    return False if applies else None


def smallest_detected(prepared: list[_Prepared], kind: str) -> float | None:
    """The smallest ladder size from which on ``kind`` is detected (``math.inf``: not even ``c = 1``; None: n/a)."""
    top = detected(prepared, kind, LADDER[-1])
    if top is None:
        return None
    if not top:
        return math.inf
    lo, hi = -1, len(LADDER) - 1  # invariant: LADDER[hi] detected, LADDER[lo] not (lo = -1: below the ladder)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if detected(prepared, kind, LADDER[mid]):
            hi = mid
        else:
            lo = mid
    return LADDER[hi]


def sensitivity(ops: Iterable[str], dtypes: Iterable[str]) -> dict[tuple[str, str], dict[str, float | None]]:
    """``{(op, dtype): {kind: smallest detected size}}`` over the default (tiny) cases."""
    backend = TorchBackend()
    result = {}
    for op in ops:
        for dtype in dtypes:
            prepared = [_Prepared(c, backend) for c in curated_cases(dtypes=(dtype,), ops=(op,))]
            if prepared:
                result[op, dtype] = {kind: smallest_detected(prepared, kind) for kind in KINDS}
    return result


def _cell(c: float | None) -> str:
    if c is None:
        return "—"
    return "> 1" if math.isinf(c) else f"{c:.0e}".replace("e-0", "e-")


def table(result: dict[tuple[str, str], dict[str, float | None]]) -> str:
    """The markdown table: one row per (op, dtype), one column per kind; a goal missed is marked ``(goal …)``."""
    lines = ["| op | dtype | " + " | ".join(KINDS) + " |", "|---|---|" + "---|" * len(KINDS)]
    for (op, dtype), row in result.items():
        cells = []
        for kind in KINDS:
            cell, goal = _cell(row[kind]), GOALS.get((kind, dtype))
            if goal is not None and op in ATTENTION_OPS and row[kind] is not None and row[kind] > goal:
                cell += f" (goal {_cell(goal)})"
            cells.append(cell)
        lines.append(f"| `{op}` | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mlaspec.conformance.sensitivity", description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default=",".join((*ATTENTION_OPS, "indexer_logits", "paged_indexer_logits")))
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--out", help="write the table into this markdown file, between its SENSITIVITY markers")
    args = ap.parse_args(argv)
    text = table(sensitivity(args.ops.split(","), args.dtypes.split(",")))
    if args.out:
        from pathlib import Path

        path = Path(args.out)
        page = path.read_text()
        start, end = "<!-- SENSITIVITY START -->\n", "<!-- SENSITIVITY END -->"
        head, rest = page.split(start)
        path.write_text(head + start + text + end + rest.split(end, 1)[1])
    print(text, end="")


if __name__ == "__main__":
    main()
