"""Warm-up workers: a JIT backend's kernels compiled in parallel, ahead of the worker that is judged.

A Triton backend (FlashInfer too) compiles each kernel variant the first time a case needs it, in the process that
runs the case: on a cold full-scale run that is most of the run, one kernel after another (issue 18 measured 174 s
of a 232 s run on the H200). With ``mlaspec check --warm N``, once the judged worker has loaded the backend, N more
processes run the same cases ahead of it, each its own share (process ``k`` takes cases ``1+k, 1+k+N, ...``; the
judged worker starts with case 0), through the same :func:`~mlaspec.conformance.worker.invoke`, and throw the outputs
away (``--warm auto``: at once over an empty Triton cache, else from the first judged call that compiled on,
:data:`COMPILING`): what they compile lands in the backend's on-disk cache (Triton's ``~/.triton/cache``, written to
a temporary name and renamed, so two processes compiling one kernel is safe), where the judged worker finds it.
Round-robin rather than in contiguous blocks: taking every N-th case a process moves up to N times as fast through
the list as the judged worker and stays ahead of it; in blocks the judged worker caught up with the process of each
block, and a cold full-scale triton run on an H200 took 86.0 s against 69.9 (2026-11-29).

What keeps them out of the verdicts:

* Each is a process of its own (its own session, so ``stop`` takes its compiler children too; it dies with the
  run on Linux). One that dies is started again after the case it died on (at most :data:`MAX_RESTARTS` times);
  one the judged worker has overtaken and that is still on that case :data:`OVERTAKEN_GRACE` seconds after it began
  it (a hang) is killed and started again after it. A case they skip or die on is the judged worker's to judge as ever.
* On a CUDA backend each holds at most ``1 / (2 N)`` of its device's memory through torch's caching allocator (their
  CUDA contexts and anything allocated outside torch are not limited).
* A judged case that errs, crashes or times out while any of them ran (:meth:`WarmUp.contended`, the judged
  worker's ``beside``) stops them and runs again alone: its verdict is that second run's, and the first attempt is
  kept with the result (``Result.retried``, in the report and at the end of the run). When the second run fails the
  same way, they were not the cause and start again (:meth:`WarmUp.resume`). A ``fail`` (wrong numbers) is never
  run again: a kernel that computes wrong values beside other processes is wrong.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from .cases import Case
from .cpus import WARM_UP_THREADS
from .heap import keep_freed_memory
from .trace import trace
from .worker import _case_dict

__all__ = ["COMPILING", "MAX_RESTARTS", "OVERTAKEN_GRACE", "WarmUp", "compile_cache_empty"]

MAX_RESTARTS = 8
"""A warm-up process that dies this often is left dead: the judged worker compiles for itself."""
COMPILING = 1.0
"""Seconds of a judged call that mean it compiled (a Triton kernel takes 1-5 s to compile on the H200's host, a
compiled full-scale call milliseconds): ``--warm auto`` starts its warm-up processes at the first such call."""
_POLL = 0.2  # seconds between a keeper's looks at its process
OVERTAKEN_GRACE = 60.0
"""Seconds after a warm-up process began a case the judged worker has passed before it is killed (a hang) and started
again after that case: longer than any case's compiles. Killed at once (before 2026-11-29), the processes the judged
worker passed on their first case (compiling what it also compiled) lost 4-5 s each to start again, and came late to
their next cases, which the judged worker then compiled itself. A hang before a process's first case (loading the
backend) is not caught: the judged worker is not waiting on it."""


def compile_cache_empty() -> bool:
    """Whether Triton's disk cache (``$TRITON_CACHE_DIR``, else ``~/.triton/cache``: triton 3.6's default) holds
    nothing: a run that will compile every kernel, where ``--warm auto`` starts its processes at once rather than at
    the first call that compiled (on the H200, 2026-11-25, one lease: cold 83.6 s started at once, 95.2 s lazily;
    warm 61.5 s started at once, 51.5 s lazily)."""
    folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return not folder.is_dir() or next(folder.iterdir(), None) is None


def _write(path: Path, text: str) -> None:
    """``text`` into ``path`` at once (a reader sees the old text or the new, never half)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


class WarmUp:
    """``workers`` processes that run ``cases`` of the backend ``backend_name`` ahead of the judged worker;
    ``device`` is the backend's (its ``device``, as the judged worker reported it; None: unknown).

    Call :meth:`reached` with the index of each case as the judged worker takes it, and :meth:`stop` at the end
    (or use it as a context manager). ``lazy``: none starts until :meth:`judged` sees a call that compiled (one of
    :data:`COMPILING` seconds or more): over a warm compile cache they would only take the cores the judged worker
    needs (a warm full-scale triton run on the H200, 2026-11-25: 48.4 s without them, 54.3-55.0 s with 8).
    ``restarts`` counts the processes started again after dying, ``unstarted`` those that died before their first
    case (not started again: a device or backend this process cannot have), ``paused`` the cases that ran again
    alone. The folder of their logs, :attr:`dir`, is removed at :meth:`stop` unless one of those happened."""

    def __init__(
        self, backend_name: str, cases: list[Case], workers: int, device: str | None = None, *, lazy: bool = False
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.backend_name, self.workers, self.total, self.device = backend_name, workers, len(cases), device
        self.dir = Path(tempfile.mkdtemp(prefix="mlaspec-warm-"))
        (self.dir / "cases.pkl").write_bytes(pickle.dumps([_case_dict(c) for c in cases]))
        self._reached = self.dir / "reached"
        _write(self._reached, "0")
        self.restarts = self.unstarted = self.paused = 0
        self.grace = OVERTAKEN_GRACE
        self._lock = threading.Lock()
        self._procs: dict[int, subprocess.Popen] = {}
        self._threads: list[threading.Thread] = []
        self.started = not lazy
        trace("start")
        if lazy:  # none runs: none can contend with a judged case
            self._stopped, self._ended_at = False, time.monotonic()
        else:
            self._start_keepers()

    def _start_keepers(self) -> None:
        self._stopped, self._ended_at = False, None  # _ended_at: when the last of them ended (time.monotonic)
        shares = [k for k in range(self.workers) if 1 + k < self.total]
        self._threads = [threading.Thread(target=self._keep, args=(k,), daemon=True) for k in shares]
        self._running = len(self._threads)
        if not self._threads:
            self._ended_at = time.monotonic()
        for t in self._threads:
            t.start()

    @property
    def done(self) -> bool:
        """Whether every warm-up process has finished its share (or was stopped)."""
        return not any(t.is_alive() for t in self._threads)

    def _spawn(self, k: int, start: int) -> subprocess.Popen | None:
        with self._lock:
            if self._stopped:
                return None
            (self.dir / f"warm-{k}.at").unlink(missing_ok=True)
            with open(self.dir / f"warm-{k}.log", "ab") as log:
                argv = [sys.executable, "-c", _BOOT, str(os.getpid()), self.backend_name, str(self.dir)]
                argv += [str(k), str(self.workers), str(start), self.device or ""]
                self._procs[k] = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            return self._procs[k]

    def _keep(self, k: int) -> None:
        """Process ``k``'s keeper: start it; start it again after the case it died on or was overtaken on."""
        try:
            start, deaths = 1 + k, 0
            while start < self.total and deaths <= MAX_RESTARTS:
                proc = self._spawn(k, start)
                if proc is None:
                    return
                trace("spawn", k, start)
                overtaken = False
                while proc.poll() is None:
                    if not overtaken and self._stuck(k):  # killed once; it may take a while to go
                        _kill(proc)
                        trace("kill", k)
                        overtaken = True
                    time.sleep(_POLL)
                at = _read_int(self.dir / f"warm-{k}.at")
                if proc.returncode == 0 or self._stopped:
                    return
                if at is None:  # died before its first case: a device or backend this process cannot have
                    with self._lock:
                        self.unstarted += 1
                    return
                start, deaths = at + self.workers, deaths + (not overtaken)
                if not overtaken and start < self.total and deaths <= MAX_RESTARTS:
                    with self._lock:
                        self.restarts += 1
        finally:
            with self._lock:
                self._running -= 1
                if not self._running:
                    self._ended_at = time.monotonic()

    def _stuck(self, k: int) -> bool:
        """Whether process ``k`` is on a case the judged worker has passed, begun :attr:`grace` seconds ago or more
        (a hang; before that it is a compile that finishes late, cheaper than a new process's start). The case's
        start is the mtime of its ``warm-K.at``, against the same wall clock."""
        at_file = self.dir / f"warm-{k}.at"
        at, reached = _read_int(at_file), _read_int(self._reached)
        if at is None or reached is None or reached <= at:
            return False
        with contextlib.suppress(OSError):
            return time.time() - at_file.stat().st_mtime >= self.grace
        return False

    def judged(self, seconds: float) -> None:
        """A judged call took ``seconds``: a lazy warm-up starts its processes at the first that compiled."""
        if not self.started and seconds >= COMPILING:
            self.started = True
            self._start_keepers()

    def reached(self, i: int) -> None:
        """The judged worker takes case ``i``: the warm-up processes skip it and those before it."""
        trace("reached", i)
        if not self._stopped:
            _write(self._reached, str(i))

    def contended(self, case: Case, since: float) -> bool:
        """Whether any warm-up process ran at or after ``since`` (``time.monotonic``), the start of ``case`` in the
        judged worker; if so they are stopped now (``case`` runs again alone)."""
        with self._lock:
            ended = self._ended_at
        if ended is not None and ended < since:
            return False
        self._halt()
        self.paused += 1
        return True

    def resume(self) -> None:
        """Start them again, from the judged worker's case on (the case that ran alone failed the same way: they
        were not the cause)."""
        self._halt()
        if self.started:
            self._start_keepers()

    def _halt(self) -> None:
        trace("halt")
        with self._lock:
            self._stopped = True
            for proc in self._procs.values():
                _kill(proc)
        for proc in self._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for t in self._threads:
            t.join(10)
        with self._lock:
            self._ended_at = self._ended_at or time.monotonic()

    def stop(self) -> None:
        """Stop every warm-up process now; remove their logs unless something happened there."""
        self._halt()
        if not (self.restarts or self.unstarted or self.paused):
            shutil.rmtree(self.dir, ignore_errors=True)

    def summary(self) -> str:
        """One line on what happened to them, or ``""`` when nothing did."""
        parts = [f"{self.restarts} restarted after dying"] if self.restarts else []
        if self.unstarted:
            parts.append(f"{self.unstarted} died before their first case")
        if self.paused:
            parts.append(f"paused {self.paused} times for a case to run again alone")
        return f"warm-up workers ({self.workers}): " + "; ".join(parts) + f" (logs in {self.dir})" if parts else ""

    def __enter__(self) -> WarmUp:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and its session (a compiler it started)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


_BOOT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the run (Linux)
except AttributeError:  # no prctl (not Linux): the per-case check below is all there is
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)  # the run died before that: nothing to warm
from mlaspec.conformance.warmup import main
main(sys.argv[1:])
"""
"""A warm-up process's first lines: tied to the run's life before the imports (a second or more), so that a run
killed meanwhile leaves none behind."""


def _cuda_setup(device: str, workers: int) -> None:  # pragma: no cover - in the warm-up process
    """The backend's device current, and this process's share of its memory, before the backend loads."""
    import torch

    if device.startswith("cuda:"):
        torch.cuda.set_device(torch.device(device))
    torch.cuda.set_per_process_memory_fraction(1 / (2 * workers))


def main(argv: list[str]) -> None:  # pragma: no cover - the warm-up process: RUN_PID BACKEND DIR K N START DEVICE
    """Warm-up process ``K`` of ``N`` of the run ``RUN_PID``: its share of the cases from ``START``, outputs thrown
    away; then out without the interpreter's teardown (as the judged worker leaves)."""
    import faulthandler

    import torch

    from .backend import load_backend, skip_reason
    from .ops import OPS
    from .worker import _cuda_broken, invoke

    faulthandler.enable()
    keep_freed_memory()  # each case's inputs reuse the memory of the last (mlaspec.conformance.heap)
    run, backend_name, folder, k, workers, start, device = argv[:7]
    run, folder, k, workers, start = int(run), Path(folder), int(k), int(workers), int(start)
    torch.set_num_threads(WARM_UP_THREADS)
    if device.startswith("cuda") or (not device and torch.cuda.is_available()):
        _cuda_setup(device, workers)
    try:
        backend = load_backend(backend_name)
    except Exception:  # the judged worker loaded it; this process cannot (the keeper counts it, the log says why)
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(2)
    cases = [Case(**c) for c in pickle.loads((folder / "cases.pkl").read_bytes())]
    trace("up", k)
    for i in range(start, len(cases), workers):
        if os.getppid() != run:
            break  # the run is gone
        if i <= (_read_int(folder / "reached") or 0):
            continue  # the judged worker is there already
        _write(folder / f"warm-{k}.at", str(i))  # if this case kills the process, the keeper starts after it
        case = cases[i]
        try:
            if skip_reason(backend, case):
                continue
            trace("begin", k, i)
            invoke(backend, case.op, OPS[case.op].make_inputs(case), OPS[case.op].writes)  # as the judged worker calls
            trace("end", k, i)
        except Exception:  # not a verdict: the judged worker runs the case and says what it does
            print(f"warm-up: {case.id}", flush=True)
            traceback.print_exc()
            if _cuda_broken():
                sys.stdout.flush()
                os._exit(3)  # a new process (a new CUDA context) goes on after this case
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
    sys.stdout.flush()
    os._exit(0)
