"""Running cases against a backend: one verdict per case, written as a JSON line the moment it is known.

A backend that raises, returns the wrong shape or dtype, or runs past the per-case timeout fails that case with
the reason and the run goes on. Results stream to ``results.jsonl`` so a crash of the whole process loses nothing
already judged; ``mlaspec report DIR`` rebuilds the report from that file.
"""

from __future__ import annotations

import functools
import json
import re
import signal
import time
import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import torch

from . import references
from .backend import Backend, skip_reason
from .cases import Case
from .distributed import RankGroup
from .numerics import assuming, declared
from .ops import DTYPES, OPS, unit_roundoff
from .references import ReferenceCache
from .trace import timed
from .verdict import Result
from .worker import Outcome, WorkerBackend, error_message, invoke

__all__ = ["repro_options", "run_case", "run_cases"]


class CaseTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float | None):
    if not seconds or not hasattr(signal, "setitimer"):
        yield
        return

    def _raise(signum, frame):
        raise CaseTimeout(f"timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _error_map(name: str, ratio: torch.Tensor) -> torch.Tensor:
    """Reduce an error/bound tensor to [heads, positions] for the heat map."""
    if name == "lse":  # [B, H, S_q] or [H, T]
        return ratio.amax(0) if ratio.dim() == 3 else ratio
    if ratio.dim() == 4:  # [B, S_q, H, D]
        return ratio.amax(dim=(0, 3)).T
    if ratio.dim() == 3:  # [T, H, D]
        return ratio.amax(-1).T
    return ratio.reshape(-1, ratio.shape[-1]) if ratio.dim() else ratio.reshape(1, 1)  # [rows, columns]


def repro_options(backend: Backend) -> str:
    """What a reproducer adds to ``mlaspec check --backend NAME`` to rerun on the same kind of backend: `` --dcp N``
    for a :class:`~mlaspec.conformance.distributed.RankGroup`, nothing otherwise."""
    return f" --dcp {backend.world_size}" if isinstance(backend, RankGroup) else ""


def _call(backend: Backend, case: Case, inputs: dict, writes: tuple[str, ...], timeout: float | None) -> Outcome:
    """Run ``case`` in this process (:func:`~mlaspec.conformance.worker.invoke`), under a Python-level timeout
    (SIGALRM: it cannot stop native code, a worker process can)."""
    start = time.perf_counter()
    try:
        with _time_limit(timeout):
            got, seconds, breaches = invoke(backend, case.op, inputs, writes)
    except CaseTimeout as exc:
        return Outcome("timeout", reason=str(exc), seconds=time.perf_counter() - start)
    except Exception as exc:  # any backend failure is a verdict, not a crash of the run
        return Outcome("error", reason=error_message(exc), seconds=time.perf_counter() - start)
    return Outcome("ok", outputs=got, seconds=seconds, breaches=breaches)


def run_case(
    backend: Backend,
    case: Case,
    *,
    backend_name: str,
    scale: str = "tiny",
    timeout: float | None = 60.0,
    figure_dir: Path | None = None,
    strict_numerics: bool = False,
    reference_device: torch.device | str = "auto",
    cache: ReferenceCache | None = None,
    then: Case | None = None,
) -> Result:
    """Judge ``backend`` on ``case``; the result's ``repro`` is :meth:`Case.repro` of ``backend_name``.

    ``backend`` is an adapter object (run in this process), a :class:`~mlaspec.conformance.worker.WorkerBackend`
    (run in its worker process, while this process computes the reference) or a
    :class:`~mlaspec.conformance.distributed.RankGroup` (``dcp_decode`` on its processes). Whatever it does, the case
    gets exactly one verdict: ``pass``, ``fail`` (numbers, non-finite pattern, or the input contract broken),
    ``error`` (it raised, or returned what cannot be judged), ``crash`` (its worker died), ``timeout`` or ``skip``.

    The budgets and the bias check follow the arithmetic the backend declares for the op
    (:mod:`mlaspec.conformance.numerics`; recorded in ``result.numerics``), or the exact spec's with
    ``strict_numerics``.

    The reference and the budgets are computed on ``reference_device`` (``"auto"``: the backend's device when it is
    CUDA, else the CPU; :func:`~mlaspec.conformance.references.reference_device`) from inputs built on the CPU, or
    read from ``cache`` (:mod:`mlaspec.conformance.references`); the inputs are then built only where something
    reads them (a backend in this process, an op's ``compare``, a failing case's pictures).

    ``then`` (a worker backend only; :func:`run_cases` passes the next case) starts in the worker as soon as this
    case's outputs are in, so that it runs there while this case is judged here.
    """
    repro = case.repro(backend_name, scale) + repro_options(backend)
    result = Result(case.id, case.op, case.dtype, "skip", repro=repro)
    isolated = isinstance(backend, WorkerBackend | RankGroup)
    pipelined = isinstance(backend, WorkerBackend)  # a worker takes the next case while this one is judged
    started = pipelined and backend.in_flight is case  # by the case before it (then): it will run, it runs already
    if not started:
        try:
            reason = skip_reason(backend, case)
        except Exception as exc:  # a backend's unsupported() that raises (or whose worker dies) is its error
            result.verdict, result.reason = "error", f"unsupported(case) failed: {error_message(exc)}"
            return result
        if reason:
            result.reason = reason
            return result
    op = OPS[case.op]
    try:
        result.numerics = [] if strict_numerics else list(declared(backend, case.op))
    except ValueError as exc:
        result.verdict, result.reason = "error", str(exc)
        return result
    if isolated and not started:
        backend.send(case, op.writes)  # the worker computes while the reference is computed here
    u = unit_roundoff(DTYPES[case.dtype])

    @functools.cache
    def inputs() -> dict:
        return op.make_inputs(case)

    clock = time.perf_counter()
    try:  # a departure may change the reference itself (scales read in bf16): the numerics are part of its key
        ref, bounds = references.reference(
            op,
            case,
            inputs,
            u,
            scale=scale,
            numerics=tuple(result.numerics),
            device=references.reference_device(reference_device, backend),
            cache=cache,
        )
    except Exception as exc:  # parameters the harness cannot build from: the case's error, the run goes on
        if isolated:  # the worker's answer to this case, so the next case reads its own; thrown away, never rerun
            backend.collect(rerun=False) if pipelined else backend.collect()
        result.verdict, result.reason = "error", f"the harness could not build this case: {error_message(exc)}"
        return result
    clock = timed("reference", case.id, clock)
    outcome = backend.collect() if isolated else _call(backend, case, inputs(), op.writes, timeout)
    clock = timed("wait", case.id, clock)
    if pipelined and then is not None:
        _start(backend, then)
    result.seconds, result.retried = outcome.seconds, outcome.retried
    if outcome.kind != "ok":
        result.verdict = outcome.kind
        result.reason = outcome.reason + (f"; the worker's last output:\n{outcome.log}" if outcome.log else "")
        return result
    got = outcome.outputs
    try:
        with assuming(tuple(result.numerics)):
            verdict = op.verdict(got, ref, bounds, u, inputs)
    except Exception as exc:  # an output the judge cannot read is the backend's error, never the run's end
        verdict = ("error", f"the output cannot be judged: {error_message(exc)}", [], {}, {})
    result.verdict, result.reason, result.metrics, result.worst, ratios = verdict
    timed("judge", case.id, clock)
    if result.verdict == "fail" and strict_numerics and declared(backend, case.op):
        result.reason += (
            f" (strict numerics: not assumed the {', '.join(declared(backend, case.op))} that {backend_name} declares "
            f"for {case.op})"
        )
    if outcome.breaches:
        result.verdict = "fail" if result.verdict == "pass" else result.verdict
        result.reason = "; ".join(
            ["input contract: " + b for b in outcome.breaches] + [result.reason] * bool(result.reason)
        )
    if result.verdict == "fail" and figure_dir is not None:
        _save_figures(result, op, case, inputs(), got, ref, ratios, figure_dir)
    return result


def _start(backend: WorkerBackend, case: Case) -> None:
    """Send ``case`` to the worker now when it will run (no skip reason, known numerics); anything else is left for
    :func:`run_case` to say."""
    try:
        if skip_reason(backend, case):
            return
        declared(backend, case.op)  # unknown numerics raise: run_case's error to give
    except Exception:  # run_case asks again and gives the verdict
        return
    backend.send(case, OPS[case.op].writes)


def _save_figures(
    result: Result, op, case: Case, inputs: dict, got: object, ref: tuple, ratios: dict, figure_dir: Path
) -> None:
    """The heat map (``result.figure``) and the op's pictures (``result.figures``) of a failing case, as PNGs.

    A picture that cannot be drawn (a backend output too malformed to picture) is left out with a warning; it
    never changes the verdict.
    """
    import matplotlib.pyplot as plt

    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", case.id)
    figure_dir.mkdir(parents=True, exist_ok=True)
    if ratios:
        from .viz.errors import draw_error_heatmaps

        path = figure_dir / f"{stem}.png"
        fig = draw_error_heatmaps({k: _error_map(k, v) for k, v in ratios.items()}, title=case.id)
        fig.savefig(path, dpi=80)
        plt.close(fig)
        result.figure = str(path)
    if op.picture is None:
        return
    try:
        pictures = op.picture(inputs, got, ref, ratios, title=case.id)
    except Exception as exc:  # a picture is an aid; the verdict stands without it
        warnings.warn(f"{case.id}: no picture drawn: {type(exc).__name__}: {exc}", stacklevel=2)
        return
    for name, fig in pictures.items():
        path = figure_dir / f"{stem}.{re.sub(r'[^A-Za-z0-9_-]+', '_', name)}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        result.figures.append(str(path))


def run_cases(
    backend: Backend,
    cases: Iterable[Case],
    *,
    backend_name: str,
    out_dir: Path | None = None,
    scale: str = "tiny",
    timeout: float | None = 60.0,
    on_result: Callable[[int, Result], None] | None = None,
    before: Callable[[int, Case], None] | None = None,
    stop: Callable[[int, Result], bool] | None = None,
    header: str | None = None,
    strict_numerics: bool = False,
    reference_device: torch.device | str = "auto",
    cache: ReferenceCache | None = None,
) -> list[Result]:
    """Run every case; stream each verdict to ``out_dir/results.jsonl`` as it comes.

    ``before(i, case)`` is called before case ``i`` runs (``mlaspec check`` prints a reproducer there, so a case
    that kills the process leaves it as the last line); after ``on_result(i, result)``, the run ends early when
    ``stop(i, result)`` is true (a lost CUDA context, where every later launch would fail): fewer results than cases.
    ``header`` (:func:`~mlaspec.conformance.report.header_line`) is the file's first line. ``reference_device``
    and ``cache`` are :func:`run_case`'s. With a worker backend, each case starts in the worker while the one before
    it is judged here (:func:`run_case`'s ``then``).
    """
    results = []
    sink = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        sink = open(out_dir / "results.jsonl", "w")  # noqa: SIM115 - kept open across cases, closed below
        if header is not None:  # what was asked, before anything runs (report.header_line)
            sink.write(header + "\n")
            sink.flush()
    cases = list(cases)
    if isinstance(backend, WorkerBackend):  # it builds each case's inputs while it runs the one before
        backend.plan(cases)
    try:
        for i, case in enumerate(cases):
            if before is not None:
                before(i, case)
            r = run_case(
                backend,
                case,
                backend_name=backend_name,
                scale=scale,
                timeout=timeout,
                figure_dir=None if out_dir is None else out_dir / "figures",
                strict_numerics=strict_numerics,
                reference_device=reference_device,
                cache=cache,
                then=cases[i + 1] if i + 1 < len(cases) else None,
            )
            results.append(r)
            if sink is not None:
                sink.write(json.dumps(r.to_json()) + "\n")
                sink.flush()
            if on_result is not None:
                on_result(i, r)
            if stop is not None and stop(i, r):
                break
    finally:
        if sink is not None:
            sink.close()
    return results
