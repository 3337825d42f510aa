"""References on the GPU against references on the CPU: every full-scale curated case, its float64 reference and
budgets computed on both (:func:`mlaspec.conformance.references.device_disagreement`), the worst ``|Δref| / budget``
and ``|Δbound| / bound`` per op printed, and the exit status 1 when any passes
:data:`~mlaspec.conformance.references.DEVICE_AGREEMENT` (``docs/conformance.md``, "Where references are computed").

    python benchmarks/reference_check.py                       # full scale, bf16 and fp16, on cuda (~3 min CPU side)
    python benchmarks/reference_check.py --scale tiny --device cpu   # the code path, anywhere

Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.references import DEVICE_AGREEMENT, device_disagreement


def check(scale: str, dtypes: tuple[str, ...], device: torch.device, ops: tuple[str, ...] | None = None) -> dict:
    """``{op: (cases, worst gap, worst case id)}`` over the curated cases at ``scale``."""
    worst: dict[str, tuple[int, float, str]] = {}
    for case in curated_cases(scale=scale, dtypes=dtypes, ops=ops):
        try:
            gap = max(device_disagreement(case, device).values(), default=0.0)
        except Exception as exc:  # the spec breaks on this device: the harness falls back to the CPU, say so
            print(f"{case.id}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            gap = math.inf
        n, w, at = worst.get(case.op, (0, -1.0, ""))
        worst[case.op] = (n + 1, *((gap, case.id) if gap > w else (w, at)))
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="full", choices=["tiny", "full"])
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--ops", help="comma list (default: all)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    ops = tuple(args.ops.split(",")) if args.ops else None
    worst = check(args.scale, tuple(args.dtypes.split(",")), torch.device(args.device), ops)
    print("| op | cases | worst gap / budget | at |\n|---|---:|---:|---|")
    for op, (n, gap, at) in worst.items():
        print(f"| {op} | {n} | {gap:.2e} | `{at}` |")
    over = {op: w for op, w in worst.items() if w[1] > DEVICE_AGREEMENT}
    print(
        f"\n{sum(n for n, _, _ in worst.values())} cases in {time.perf_counter() - start:.0f} s on {args.device}; "
        f"bound {DEVICE_AGREEMENT:g}: {'exceeded by ' + ', '.join(over) if over else 'held everywhere'}"
    )
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
