"""Run the conformance cases against the ``triton`` backend and print one line per case.

On a GPU (real DeepSeek sizes, bf16 and fp16)::

    python -m mlaspec.impl.selfcheck                     # --scale full --dtypes bfloat16,float16
    python -m mlaspec.impl.selfcheck --generated 50      # plus 50 hypothesis-drawn cases per op (--seed: which)
    python -m mlaspec.impl.selfcheck --ops attention --case '{"op": "attention", "name": "hyp-3", ...}'

On a CPU, through Triton's interpreter (tiny sizes; bf16 is skipped there)::

    TRITON_INTERPRET=1 python -m mlaspec.impl.selfcheck --scale tiny --dtypes float16,float32

Generated cases are drawn from a fixed hypothesis seed (``--seed``, default 0), so the same command draws the same
cases again. Before each generated case runs, its ``Case`` as JSON is printed (``# case {...}``): a kernel that
corrupts the CUDA context (an illegal address) takes the process down with it, and the last such line is the
reproducer, to rerun alone with ``--case``. After such an error the run stops, since every later launch would fail.

The same run through the harness's CLI, with the HTML report:
``mlaspec check --backend triton --scale full``. Exit status 1 when any case fails.
"""

from __future__ import annotations

import argparse
import json
import sys


def _generated(n: int, dtypes: list[str], seed: int = 0) -> list:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    from mlaspec.conformance.generated import GENERATED_OPS, case_strategy

    drawn: list = []
    for op in GENERATED_OPS:

        @hypothesis_seed(seed)
        @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case_strategy(op, tuple(dtypes)))
        def draw(case):
            drawn.append(case)

        draw()
    return drawn


def case_json(case) -> str:
    """``case`` as the one-line JSON ``--case`` takes back."""
    return json.dumps(dict(op=case.op, name=case.name, dtype=case.dtype, params=case.params), sort_keys=True)


def _case_from_json(text: str):
    from mlaspec.conformance.cases import Case

    d = json.loads(text)
    return Case(d["op"], d["name"], d["dtype"], d["params"])


def _cuda_broken(torch) -> str | None:
    """The error message when the CUDA context no longer works (after an illegal address), else None."""
    if not torch.cuda.is_available():
        return None
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as exc:  # any CUDA error here means the context is gone
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="full", choices=["tiny", "full"])
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--ops", help="comma-separated op names (default: all four)")
    parser.add_argument("--generated", type=int, default=0, help="hypothesis-drawn cases per op, on top")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed of the generated cases")
    parser.add_argument(
        "--prefill-config",
        metavar="M,N,WARPS,STAGES",
        help="tile override of the attention / mla_prefill kernel, e.g. 64,32,4,2",
    )
    parser.add_argument(
        "--case", action="append", default=[], help="run only this case, JSON as printed by '# case' lines (repeatable)"
    )
    args = parser.parse_args(argv)

    import torch

    from mlaspec.conformance.backends.triton import TritonBackend
    from mlaspec.conformance.cases import curated_cases
    from mlaspec.conformance.report import environment
    from mlaspec.conformance.runner import run_case

    from .prefill import PrefillConfig

    tile = PrefillConfig(*map(int, args.prefill_config.split(","))) if args.prefill_config else None
    backend = TritonBackend(prefill_config=tile)
    dtypes = args.dtypes.split(",")
    ops = tuple(args.ops.split(",")) if args.ops else tuple(sorted(backend.ops))
    if args.case:
        cases, announce = [_case_from_json(c) for c in args.case], True
    else:
        cases, announce = curated_cases(scale=args.scale, dtypes=tuple(dtypes), ops=ops), False
        if args.generated:
            cases += [c for c in _generated(args.generated, dtypes, args.seed) if c.op in ops]
    env = environment()
    print(
        f"backend {backend.name} ({backend.version}) on {backend.device}"
        + (f", prefill tile {tile}" if tile else "")
        + "; "
        + ", ".join(f"{k} {v}" for k, v in env.items())
    )
    print(f"{'case':<48} {'verdict':<7} {'seconds':>8}  worst error/bound  reason")
    failed = not_run = 0
    for i, case in enumerate(cases):
        if announce or case.name.startswith("hyp-"):  # the reproducer first: a crash must not take it along
            print(f"# case {case_json(case)}", flush=True)
        r = run_case(backend, case, backend_name="triton", scale=args.scale, timeout=300.0)
        worst = max((m.value / (m.bound or 1) for m in r.metrics if m.name == "max_error/bound"), default=float("nan"))
        failed += r.verdict in ("fail", "error")
        print(f"{case.id:<48} {r.verdict:<7} {r.seconds or 0:8.3f}  {worst:17.3f}  {r.reason or ''}", flush=True)
        if r.verdict in ("fail", "error"):
            print(
                f"#   rerun: python -m mlaspec.impl.selfcheck --scale {args.scale} --case '{case_json(case)}'",
                flush=True,
            )
        broken = _cuda_broken(torch)
        if broken:
            not_run = len(cases) - i - 1
            print(f"# CUDA context lost after {case.id} ({broken}); the {not_run} cases after it not run", flush=True)
            break
    print(f"{len(cases)} cases, {failed} failed or errored" + (f", {not_run} not run" if not_run else ""))
    return 1 if failed or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
