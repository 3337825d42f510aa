"""``mlaspec``: check a backend against the spec and report.

    mlaspec check [--backend torch] [--ops attention,mla_decode] [--dtypes bfloat16] [--case ID] [--report DIR]
    mlaspec check --backend triton --scale full --generated 50 --seed 0
    mlaspec check --backend torch --op attention --name hyp-3 --dtypes bfloat16 --params '{"B": 1, ...}'
    mlaspec backends
    mlaspec report DIR
    mlaspec matrix --backends flashmla,deepgemm,flashinfer,vllm,torch_sdpa,torch,spec --scale full --out docs/matrix

``check`` exits 1 when any case fails or errors, so it can gate a CI job. Every failure is printed as
``FAILED <case id>: <reason>`` and the one command that reruns that case alone
(:meth:`~mlaspec.conformance.cases.Case.repro`).

``--generated N`` adds, per op that has a case generator (:func:`mlaspec.conformance.generated.generated_ops`), ``N``
cases drawn by hypothesis from a fixed seed (``--seed``, default 0): the same command draws the same cases again.
``--op`` with ``--params`` runs one case that is not in the curated list (a generated case's reproducer).

While the cases run (:class:`~mlaspec.conformance.progress.Progress`), a terminal shows one progress bar on stderr
naming the case in flight, and a log (stderr not a terminal) a count line every tenth of the run; stdout gets a line
for each case that did not pass or skip. Then come the failures, each with its rerun line, then the counts with the
skips grouped by reason; ``--verbose`` adds a line per case and the full table.

Before each generated or ``--params`` case runs, its reproducer is printed on stdout
(``[ i/n] RUN   mlaspec check ...``): a kernel that corrupts the CUDA context (an illegal address) may take the
process down with it, and then the last line is the command that reruns the culprit alone (a curated case's id,
which is its reproducer, stays on the bar). When CUDA is available and its context no longer works after a case, the
run stops there (every later launch would fail), says how many cases were not run, and exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from .cpus import parent_share, usable_cpus
from .heap import keep_freed_memory

__all__ = ["main", "parser"]


class UsageError(Exception):
    """A mistake on the command line: printed as one line, exit status 2."""


EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_EMPTY = 0, 1, 2, 3


def _load(name: str, *, isolated: bool, timeout: float | None, dcp: int | None = None, started=None):
    """The backend ``name``, in a worker process (``isolated``; ``started``: one already started for it,
    :func:`~mlaspec.conformance.spawn.spawn`), in ``dcp`` processes of one group
    (:class:`~mlaspec.conformance.distributed.RankGroup`) or in this one; a usage error when it cannot be loaded."""
    from .worker import load_failure, open_backend

    try:
        if dcp:
            from .distributed import RankGroup

            return RankGroup(name, dcp, timeout=timeout)
        return open_backend(name, isolated=isolated, timeout=timeout, started=started)
    except Exception as exc:  # not importable, no such attribute, raises on construction
        message = load_failure(exc, isolated=isolated).removeprefix(f"backend {name!r} could not be loaded: ")
        hint = ""
        if ":" in name:
            hint = (
                " (a 'module:attr' backend must be importable: the current directory is on the path; elsewhere "
                "install it or set PYTHONPATH)"
            )
        raise UsageError(f"backend {name!r} could not be loaded: {message}{hint}") from None


def _names(text: str | None, known, what: str) -> tuple[str, ...] | None:
    """``text`` split at commas, each checked against ``known`` (a usage error names the unknown ones)."""
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(f"unknown {what} {', '.join(map(repr, unknown)) or repr(text)}; known: {', '.join(known)}")
    return names


WARM_AUTO = 15  # --warm auto on a CUDA backend: warm-up processes, at most all the CPUs but one


def _warm_arg(text: str) -> int | str:
    """``--warm``'s value: ``auto`` or a count."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--warm takes a count or 'auto', got {text!r}") from None


def _check_warm(args: argparse.Namespace) -> None:
    """``--warm N`` (:mod:`~mlaspec.conformance.warmup`) as the rest of the command line allows it."""
    if args.warm == "auto":
        return
    if args.warm < 0:
        raise UsageError(f"--warm must be >= 0, got {args.warm}")
    if args.warm and (args.isolation != "process" or args.dcp is not None):
        raise UsageError("--warm runs beside the judged worker: it needs --isolation process and no --dcp")


def warm_count(warm: int | str, device: str | None, *, jit: bool, isolated: bool, dcp: int | None) -> int:
    """The warm-up processes to start: ``warm`` itself, or for ``auto`` :data:`WARM_AUTO` (at most all the CPUs
    this process may use but one) when the judged worker's backend compiles kernels on first use (``jit``) and runs on a
    CUDA device, with process isolation and no ``--dcp``, else none. ``auto``'s start at once over an empty Triton
    cache (:func:`~mlaspec.conformance.warmup.compile_cache_empty`), else when a judged call first compiles
    (:class:`~mlaspec.conformance.warmup.WarmUp` ``lazy``): with nothing to compile they only contend (a warm triton
    run on the H200, 54.3-55.0 s with 8 started at once, 48.4 s without).
    A JIT backend compiles each kernel variant in the process that first needs it: the full-scale triton run on an
    H200 took 77 s cold with 8 warm-ups, 212 s without; on the CPU there is nothing to compile (8.8 s against
    7.5 s on the float32 tiny run, 2 cores). A cold run's compiling is most of its CPU time and spread over the
    warm-ups, so more go faster while there are CPUs for them: on one H200 lease of 16 CPUs (2026-11-29, cold
    full-scale triton runs) 73.7 / 69.8 s with 8, 66.9 with 12, 63.9 / 60.2 with 15, where half the CPUs gave 8."""
    if warm != "auto":
        return int(warm)
    on_cuda = str(device or "").startswith("cuda")
    return min(WARM_AUTO, usable_cpus() - 1) if jit and on_cuda and isolated and dcp is None else 0


def _check(args: argparse.Namespace) -> int:
    """``mlaspec check``. The judged worker starts first (:mod:`~mlaspec.conformance.spawn`): its imports run
    beside this process's."""
    from .spawn import spawn

    started = spawn(args.backend) if args.isolation == "process" and args.dcp is None else None
    beside = started is not None or args.dcp is not None  # a worker (and any warm-ups), or a DCP group's ranks
    try:  # then this process takes its share of the CPUs
        with parent_share() if beside else contextlib.nullcontext():
            return _check_cases(args, started)
    finally:
        if started is not None:  # stopped by the run that took it; else (a usage error first) stopped here
            started.kill()


def _check_cases(args: argparse.Namespace, started) -> int:
    from .cases import case_by_id, curated_cases
    from .ops import DTYPES, OPS
    from .progress import Progress
    from .report import compact_summary, environment, header_line, summary_table, write_html
    from .runner import repro_options, run_cases

    ops = _names(args.ops, tuple(OPS), "op")
    if args.dcp is not None:
        ops = _dcp_ops(args, ops)
    dtypes = _names(args.dtypes, tuple(DTYPES), "dtype")
    references = _reference_options(args)
    if args.params is not None or args.op is not None:
        if args.generated:
            raise UsageError("--generated adds drawn cases to the curated ones, not to --params")
        cases = _param_cases(args)
        announced = 0  # every case is announced
    else:
        if args.case:
            try:
                cases = [case_by_id(c, scale=args.scale) for c in args.case]
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        else:
            cases = curated_cases(scale=args.scale, dtypes=dtypes, ops=ops)
        announced = len(cases)  # the curated ones are not announced, the generated ones after them are
        if args.generated:
            cases += _generated_cases(args.generated, dtypes, args.seed, ops)
    _check_warm(args)
    backend = _load(
        args.backend, isolated=args.isolation == "process", timeout=args.timeout, dcp=args.dcp, started=started
    )
    from .ahead import start_ahead

    warm = ahead = None
    try:
        device = getattr(backend, "device", None)
        jit = bool(getattr(backend, "jit", False))
        workers = warm_count(args.warm, device, jit=jit, isolated=args.isolation == "process", dcp=args.dcp)
        if workers:  # after the judged worker has its device (a GPU in exclusive-process mode takes one process)
            from .warmup import WarmUp, compile_cache_empty

            lazy = args.warm == "auto" and not compile_cache_empty()  # a cold cache: every kernel compiles, start now
            warm = backend.beside = WarmUp(args.backend, cases, workers, device, lazy=lazy)
        ahead = start_ahead(backend, cases, scale=args.scale, strict_numerics=args.strict_numerics, **references)
        out_dir = Path(args.report)
        for stale in out_dir.glob("results-*.jsonl"):  # a sharded pytest run's files would merge into this report
            stale.unlink()
        env = environment()
        print(f"mlaspec check: backend {backend.name} ({backend.version}), {len(cases)} cases, report in {out_dir}/")

        progress = Progress(
            len(cases),
            announced=announced,
            repro=lambda c: c.repro(args.backend, args.scale) + repro_options(backend),
            verbose=args.verbose,
        )
        lost: list[str] = []

        def context_lost(i: int, r) -> bool:
            broken = None if args.isolation == "process" else _cuda_broken()  # a worker restarts with a new one
            if broken:
                not_run = len(cases) - i - 1
                lost.append(f"CUDA context lost after {r.case_id} ({broken}); the {not_run} cases after it not run")
                progress.write(lost[0])
            return bool(broken)

        def before(i: int, c) -> None:
            for helper in (warm, ahead):  # they go no further than the case the run takes
                if helper is not None:
                    helper.reached(i)
            progress.before(i, c)

        def after(i: int, r) -> None:
            if warm is not None:
                warm.judged(r.seconds)  # --warm auto starts them at the first call that compiled
            progress.after(i, r)

        with progress:
            results = run_cases(
                backend,
                cases,
                backend_name=args.backend,
                out_dir=out_dir,
                scale=args.scale,
                timeout=args.timeout,
                on_result=after,
                before=before,
                stop=context_lost,
                header=header_line(args.backend, backend.version, env, [c.id for c in cases]),
                strict_numerics=args.strict_numerics,
                **references,
            )
    finally:
        for helper in (warm, ahead):
            if helper is not None:
                helper.stop()
        if hasattr(backend, "close"):
            backend.close()
    (out_dir / "environment.json").write_text(json.dumps({"backend": args.backend, "version": backend.version, **env}))
    print()
    if warm is not None and warm.summary():
        print(warm.summary())
    for r in results:
        if r.retried:
            first = r.retried.splitlines()[0]
            print(f"RAN AGAIN {r.case_id}: beside the warm-up workers it gave {first}; alone: {r.verdict}")
    if args.verbose:
        print(summary_table(results) + "\n")
    page = write_html(results, out_dir, backend=args.backend, version=backend.version, env=env)
    footer = f"{compact_summary(results)}\nreport: {page}"
    return _verdict(results, [c.id for c in cases], allow_empty=args.allow_empty, why_not_run=lost, footer=footer)


def _verdict(
    results: list, planned: list[str], *, allow_empty: bool, why_not_run: list[str] = (), footer: str = ""
) -> int:
    """Print the failures, the cases that never ran, then ``footer`` (the counts, the report's path), and say the
    exit status: 0 when every planned case passed or was skipped with a reason and at least one ran; 1 on any fail /
    error / crash / timeout or a planned case with no verdict; 3 when nothing was checked (no case, or every case
    skipped) unless ``allow_empty``."""
    from .verdict import FAILED, format_failure

    failed = [r for r in results if r.verdict in FAILED]
    for r in failed:
        print(format_failure(r))
    seen = {r.case_id for r in results}
    missing = [c for c in planned if c not in seen]
    if missing:
        why = why_not_run[0] if why_not_run else "the run stopped before them"
        shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        print(f"NOT RUN: {len(missing)} of {len(planned)} planned cases have no verdict ({why}): {shown}")
    if footer:
        print(("\n" if failed or missing else "") + footer)
    if failed or missing:
        return EXIT_FAILED
    if not any(r.verdict == "pass" for r in results) and not allow_empty:
        print("NOTHING CHECKED: no case ran (none selected, or every one skipped); --allow-empty accepts that")
        return EXIT_EMPTY
    return EXIT_OK


def _dcp_ops(args: argparse.Namespace, ops: tuple[str, ...] | None) -> tuple[str, ...]:
    """The ops of a ``--dcp N`` run: ``dcp_decode`` and ``dcp_decode_fp8`` (or those of them ``--ops`` names), on
    ``N >= 2`` processes of the backend."""
    from .distributed import DECODES

    if args.dcp < 2:
        raise UsageError(f"--dcp must be >= 2 (the simulated ranks of --ops dcp_decode need no flag), got {args.dcp}")
    if args.isolation != "process":
        raise UsageError("--dcp runs the backend in its own processes; --isolation none does not go with it")
    if ops is not None and not set(ops) <= set(DECODES):
        raise UsageError(f"--dcp runs {' and '.join(DECODES)} only, got --ops {','.join(ops)}")
    return tuple(ops or DECODES)


def _reference_options(args: argparse.Namespace) -> dict:
    """Where references are computed and the disk cache they are kept in (None under ``--no-cache``), from the
    command line (:mod:`mlaspec.conformance.references`)."""
    import torch

    from .references import ReferenceCache

    if args.reference_device != "auto":
        try:
            torch.device(args.reference_device)
        except RuntimeError as exc:
            raise UsageError(f"--reference-device must be 'auto' or a device ('cpu', 'cuda:0'): {exc}") from None
    return dict(reference_device=args.reference_device, cache=None if args.no_cache else ReferenceCache.default())


def _param_cases(args: argparse.Namespace) -> list:
    """One case per dtype from ``--op``, ``--name`` and ``--params`` (a JSON object of the op's sizes and flags)."""
    from .cases import Case
    from .ops import OPS

    if args.op is None or args.params is None:
        raise UsageError("--op and --params go together (--params '{\"B\": 1, ...}' --op attention)")
    if args.op not in OPS:
        raise UsageError(f"--op must be one of {', '.join(OPS)}, got {args.op!r}")
    try:
        params = json.loads(args.params)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--params is not valid JSON: {exc}") from None
    if not isinstance(params, dict):
        raise UsageError(f"--params must be a JSON object, got {args.params!r}")
    cases = [Case(args.op, args.name, dtype, params) for dtype in args.dtypes.split(",")]
    try:  # the harness builds these inputs too: parameters it cannot build from are the user's to fix
        OPS[args.op].make_inputs(cases[0])
    except KeyError as exc:
        raise UsageError(f"--params lacks {exc} for op {args.op}") from None
    except Exception as exc:
        raise UsageError(f"--params cannot build a {args.op} case: {type(exc).__name__}: {exc}") from None
    return cases


def _generated_cases(n: int, dtypes: tuple[str, ...], seed: int, ops: tuple[str, ...] | None = None) -> list:
    """Up to ``n`` hypothesis-drawn cases of each generated op (of ``ops``, when given), from the fixed ``seed``:
    the same arguments draw the same cases, in the same order."""
    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import seed as hypothesis_seed
    except ImportError:
        raise UsageError("--generated draws cases with hypothesis (pip install hypothesis)") from None
    from .generated import case_strategy, generated_ops

    drawn: list = []
    for op in generated_ops():
        if ops is not None and op not in ops:
            continue

        @hypothesis_seed(seed)
        @settings(
            max_examples=n, database=None, deadline=None, derandomize=False, suppress_health_check=list(HealthCheck)
        )
        @given(case_strategy(op, dtypes))
        def draw(case):
            drawn.append(case)

        draw()
    return drawn


def _cuda_broken() -> str | None:
    """The error when CUDA is available but its context no longer works (after an illegal address), else None."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as exc:  # any CUDA error here means the context is gone
        message = str(exc).strip()
        return f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}"
    return None


def _backends(args: argparse.Namespace) -> int:
    from .backend import available_backends, load_backend

    backends = sorted(available_backends().items())
    width = max((len(name) for name, _ in backends), default=0)
    for name, target in backends:
        try:
            b = load_backend(name)
            why_not = getattr(b, "unavailable", None)
            if why_not:
                status = f"not usable here: {why_not}"
            else:
                status = f"usable ({b.version}); ops: {', '.join(sorted(b.ops))}"
        except Exception as exc:  # report, don't crash, on a broken or absent backend
            status = f"not usable: {type(exc).__name__}: {exc}"
        print(f"{name:<{width}} {target:<50} {status}")
    return 0


def _report(args: argparse.Namespace) -> int:
    """Rebuild the report of a run (whole, killed, or sharded) and say what it found; the exit status is
    :func:`_verdict`'s over the planned cases of the run's header."""
    from .report import compact_summary, load_run, write_html

    out_dir = Path(args.dir)
    try:
        headers, results = load_run(out_dir)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    env_file = out_dir / "environment.json"
    env = json.loads(env_file.read_text()) if env_file.exists() else {}
    backend = env.pop("backend", None) or next((h["backend"] for h in headers), "?")
    version = env.pop("version", None) or next((h["version"] for h in headers), "")
    env = env or next((h["environment"] for h in headers), {})
    planned = list(dict.fromkeys(c for h in headers for c in h["planned"]))
    of = f" of {len(planned)} planned cases" if planned else " (no header: the planned cases are unknown)"
    print(f"mlaspec report: backend {backend} ({version}), {len(results)} verdicts{of}")
    page = write_html(results, out_dir, backend=backend, version=version, env=env)
    footer = f"{compact_summary(results)}\nreport: {page}"
    return _verdict(results, planned or [r.case_id for r in results], allow_empty=True, footer=footer)


def _matrix(args: argparse.Namespace) -> int:
    from .matrix import merge_results_jsonl, run_matrix, write_matrix

    references = _reference_options(args)
    names = [n for n in args.backends.split(",") if n]
    ops = tuple(args.ops.split(",")) if args.ops else None
    jsonl = {n: Path(args.out) / n / "results.jsonl" for n in names}
    old = {n: p.read_text().splitlines() if args.merge and p.exists() else [] for n, p in jsonl.items()}
    data = run_matrix(
        names,
        out_dir=Path(args.out),
        scale=args.scale,
        dtypes=tuple(args.dtypes.split(",")),
        ops=ops,
        timeout=args.timeout,
        progress=lambda line: print(line, flush=True),
        isolated=args.isolation == "process",
        **references,
    )
    if args.merge:  # the cases this run did not redo keep their lines
        for n, p in jsonl.items():
            merge_results_jsonl(p, old[n])
    md, js = write_matrix(data, Path(args.out), merge=args.merge)
    print(f"matrix: {md} and {js}")
    return 0


def _add_reference_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--no-cache",
        action="store_true",
        help="compute every reference afresh and write none to the cache ($MLASPEC_CACHE_DIR, else "
        "$XDG_CACHE_HOME/mlaspec, else ~/.cache/mlaspec)",
    )
    sub.add_argument(
        "--reference-device",
        default="auto",
        metavar="DEVICE",
        help="where the float64 references and budgets are computed (default auto: the backend's device when it is "
        "CUDA, else cpu)",
    )


def parser() -> argparse.ArgumentParser:
    """The command line of ``mlaspec`` (its sub-commands and their options)."""
    parser = argparse.ArgumentParser(prog="mlaspec", description="Check an MLA backend against the mlaspec spec.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run the conformance cases on a backend")
    check.add_argument("--backend", default="torch", help="registered name or module:attr (default: torch)")
    check.add_argument("--ops", help="comma-separated op names (default: all)")
    check.add_argument("--dtypes", default="bfloat16,float16", help="comma-separated case dtypes")
    check.add_argument("--case", action="append", help="run only this case id (repeatable)")
    check.add_argument("--scale", default="tiny", choices=["tiny", "full"], help="case sizes (full: real DeepSeek)")
    check.add_argument("--report", default="mlaspec-report", help="output directory (default: mlaspec-report)")
    check.add_argument("--timeout", type=float, default=120.0, help="per-case timeout in seconds")
    check.add_argument("--op", help="with --params: the op of a case that is not curated")
    check.add_argument("--params", help="with --op: the case's sizes and flags as a JSON object")
    check.add_argument("--name", default="custom", help="with --params: the case name (it seeds the inputs)")
    check.add_argument(
        "--generated", type=int, default=0, metavar="N", help="add N hypothesis-drawn cases per generated op"
    )
    check.add_argument(
        "--strict-numerics",
        action="store_true",
        help="judge against the exact spec's arithmetic, ignoring the numerics the backend declares per op",
    )
    check.add_argument("--seed", type=int, default=0, help="hypothesis seed of the --generated cases (default: 0)")
    check.add_argument(
        "--isolation",
        choices=["process", "none"],
        default="process",
        help="process (default): the backend runs in a worker process, so a crash, exit or hang fails only its "
        "case; none: in this process (for a debugger)",
    )
    check.add_argument(
        "--dcp",
        type=int,
        metavar="N",
        help="run the dcp_decode and dcp_decode_fp8 cases of N_cp=N on N processes of one torch.distributed group "
        "(NCCL with a GPU per rank, else gloo), combined by real collectives (mlaspec.conformance.distributed)",
    )
    check.add_argument(
        "--warm",
        type=_warm_arg,
        default="auto",
        metavar="N",
        help="N more processes run the cases ahead of the judged worker, outputs thrown away, so that a JIT "
        "backend (Triton, FlashInfer) compiles its kernels in parallel into its disk cache (default: auto, "
        f"{WARM_AUTO} beside a JIT backend (Triton, FlashInfer) on a CUDA device, at most all the CPUs but one, "
        "started at once over an empty Triton cache, else when a judged call first compiles; else none; "
        "mlaspec.conformance.warmup)",
    )
    check.add_argument(
        "--verbose", action="store_true", help="a line per case and the full table (default: failures and counts)"
    )
    check.add_argument(
        "--allow-empty", action="store_true", help="exit 0 when nothing was checked (no case ran), instead of 3"
    )
    _add_reference_options(check)
    check.set_defaults(func=_check)
    sub.add_parser("backends", help="list registered backends").set_defaults(func=_backends)
    rep = sub.add_parser("report", help="rebuild the report from DIR/results*.jsonl")
    rep.add_argument("dir")
    rep.set_defaults(func=_report)
    mat = sub.add_parser("matrix", help="run the curated cases on several backends; write OUT/matrix.md and .json")
    mat.add_argument(
        "--backends",
        default="spec,torch,torch_sdpa,flashmla,deepgemm,flashinfer,vllm",
        help="comma-separated backend names or module:attr (default: every shipped adapter)",
    )
    mat.add_argument("--ops", help="comma-separated op names (default: all)")
    mat.add_argument("--dtypes", default="bfloat16", help="comma-separated case dtypes (default: bfloat16)")
    mat.add_argument("--scale", default="tiny", choices=["tiny", "full"], help="case sizes (full: real DeepSeek)")
    mat.add_argument(
        "--out",
        default="mlaspec-matrix",
        help="output directory (default: mlaspec-matrix; the committed pages are regenerated with --out docs/matrix)",
    )
    mat.add_argument("--timeout", type=float, default=300.0, help="per-case timeout in seconds")
    mat.add_argument(
        "--merge",
        action="store_true",
        help="lay this run over OUT/matrix.json and OUT/<backend>/results.jsonl case by case",
    )
    mat.add_argument(
        "--isolation",
        choices=["process", "none"],
        default="process",
        help="process (default): each backend in a worker process, so a crash or a broken CUDA context fails only "
        "its case; none: in this process (for a debugger)",
    )
    _add_reference_options(mat)
    mat.set_defaults(func=_matrix)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``mlaspec``; returns the exit status (0 all passed, 1 a failure or a case without a verdict, 2 a usage
    error, 3 nothing checked)."""
    args = parser().parse_args(argv)
    keep_freed_memory()  # the run's float64 work on the CPU reuses the memory it frees (mlaspec.conformance.heap)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"mlaspec {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
