"""Run the conformance cases against the ``triton`` backend and print one line per case.

On a GPU (real DeepSeek sizes, bf16 and fp16)::

    python -m mlaspec.impl.selfcheck                     # --scale full --dtypes bfloat16,float16
    python -m mlaspec.impl.selfcheck --generated 50      # plus 50 hypothesis-drawn cases per op

On a CPU, through Triton's interpreter (tiny sizes; bf16 is skipped there)::

    TRITON_INTERPRET=1 python -m mlaspec.impl.selfcheck --scale tiny --dtypes float16,float32

The same run through the harness's CLI, with the HTML report:
``mlaspec check --backend mlaspec.impl.backend:TritonBackend --scale full``. Exit status 1 when any case fails.
"""

from __future__ import annotations

import argparse
import sys


def _generated(n: int, dtypes: list[str]) -> list:
    from hypothesis import HealthCheck, given, settings

    from mlaspec.conformance.generated import GENERATED_OPS, case_strategy

    drawn: list = []
    for op in GENERATED_OPS:

        @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case_strategy(op, tuple(dtypes)))
        def draw(case):
            drawn.append(case)

        draw()
    return drawn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="full", choices=["tiny", "full"])
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--ops", help="comma-separated op names (default: all four)")
    parser.add_argument("--generated", type=int, default=0, help="hypothesis-drawn cases per op, on top")
    args = parser.parse_args(argv)

    import torch

    from mlaspec.conformance.cases import curated_cases
    from mlaspec.conformance.report import environment
    from mlaspec.conformance.runner import run_case

    from .backend import TritonBackend

    backend = TritonBackend()
    dtypes = args.dtypes.split(",")
    ops = tuple(args.ops.split(",")) if args.ops else tuple(sorted(backend.ops))
    cases = curated_cases(scale=args.scale, dtypes=tuple(dtypes), ops=ops)
    if args.generated:
        cases += [c for c in _generated(args.generated, dtypes) if c.op in ops]
    env = environment()
    print(f"backend {backend.name} ({backend.version}) on {backend.device}; "
          + ", ".join(f"{k} {v}" for k, v in env.items()))  # fmt: skip
    print(f"{'case':<48} {'verdict':<7} {'seconds':>8}  worst error/bound  reason")
    failed = 0
    for case in cases:
        r = run_case(backend, case, backend_name="mlaspec.impl.backend:TritonBackend", scale=args.scale,
                     timeout=300.0)  # fmt: skip
        worst = max((m.value / (m.bound or 1) for m in r.metrics if m.name == "max_error/bound"), default=float("nan"))
        failed += r.verdict in ("fail", "error")
        print(f"{case.id:<48} {r.verdict:<7} {r.seconds or 0:8.3f}  {worst:17.3f}  {r.reason or ''}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"{len(cases)} cases, {failed} failed or errored")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
