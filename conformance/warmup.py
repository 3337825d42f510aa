"""Warm-up workers: a JIT backend's kernels compiled in parallel, ahead of the worker that is judged.

A Triton backend (FlashInfer too) compiles each kernel variant the first time a case needs it, in the process that
runs the case: on a cold full-scale run that is most of the run, one kernel after another (issue 18 measured 174 s
of a 232 s run on the H200). With ``mlaspec check --warm N``, once the judged worker has loaded the backend, N more
processes run the same cases ahead of it, each its own share (process ``k`` takes cases ``1+k, 1+k+N, ...``; the
judged worker starts with case 0), through the same :func:`~mlaspec.conformance.worker.invoke`, and throw the outputs
away: what they compile lands in the backend's on-disk cache (Triton's ``~/.triton/cache``, written to a temporary
name and renamed, so two processes compiling one kernel is safe), where the judged worker finds it.

What keeps them out of the verdicts:

* Each is a process of its own (its own session, so ``stop`` takes its compiler children too; it dies with the
  run on Linux). One that dies is started again after the case it died on (at most :data:`MAX_RESTARTS` times);
  one the judged worker has overtaken (it is still on a case the judged worker finished: a long compile, a hang) is
  killed and started again after that case. A case they skip or die on is the judged worker's to judge as ever.
* On a CUDA backend each holds at most ``1 / (2 N)`` of its device's memory through torch's caching allocator (their
  CUDA contexts and anything allocated outside torch are not limited).
* A judged case that errs, crashes or times out while any of them ran (:meth:`WarmUp.contended`, wired to the judged
  worker's ``on_trouble``) stops them for the rest of the run and runs again alone: its verdict is that second run's,
  and the first attempt is kept with the result (``Result.retried``, in the report and at the end of the run). A
  ``fail`` (wrong numbers) is never run again: a kernel that computes wrong values beside other processes is wrong.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
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

import torch

from .cases import Case

__all__ = ["MAX_RESTARTS", "WarmUp"]

MAX_RESTARTS = 8
"""A warm-up process that dies this often is left dead: the judged worker compiles for itself."""
_POLL = 0.2  # seconds between a keeper's looks at its process


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
    (or use it as a context manager). ``stopped_because`` says why they were stopped early (None otherwise);
    ``restarts`` counts the processes started again after dying. The folder of their logs, :attr:`dir`, is removed
    at :meth:`stop` unless something went wrong there."""

    def __init__(self, backend_name: str, cases: list[Case], workers: int, device: str | None = None):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.backend_name, self.workers, self.total, self.device = backend_name, workers, len(cases), device
        self.dir = Path(tempfile.mkdtemp(prefix="mlaspec-warm-"))
        (self.dir / "cases.pkl").write_bytes(pickle.dumps([_case_dict(c) for c in cases]))
        self._reached = self.dir / "reached"
        _write(self._reached, "0")
        self.restarts, self.stopped_because = 0, None
        self._lock = threading.Lock()
        self._stopped = False
        self._ended_at: float | None = None  # when the last of them ended (time.monotonic)
        self._procs: dict[int, subprocess.Popen] = {}
        shares = [k for k in range(workers) if 1 + k < self.total]
        self._threads = [threading.Thread(target=self._keep, args=(k,), daemon=True) for k in shares]
        self._running = len(self._threads)
        if not self._threads:
            self._ended_at = time.monotonic()
        for t in self._threads:
            t.start()

    @property
    def logs(self) -> list[Path]:
        return [self.dir / f"warm-{k}.log" for k in range(self.workers)]

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
                argv = [sys.executable, "-m", "mlaspec.conformance.warmup", self.backend_name, str(self.dir)]
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
                overtaken = False
                while proc.poll() is None:
                    at, reached = _read_int(self.dir / f"warm-{k}.at"), _read_int(self._reached)
                    if at is not None and reached is not None and reached > at:  # the judged worker is past it
                        _kill(proc)
                        overtaken = True
                    time.sleep(_POLL)
                at = _read_int(self.dir / f"warm-{k}.at")
                if proc.returncode == 0 or self._stopped or at is None:  # done, stopped, or died before any case
                    return
                if not overtaken:
                    deaths += 1
                    with self._lock:
                        self.restarts += 1
                start = at + self.workers
        finally:
            with self._lock:
                self._running -= 1
                if not self._running:
                    self._ended_at = time.monotonic()

    def reached(self, i: int) -> None:
        """The judged worker takes case ``i``: the warm-up processes skip it and those before it."""
        if not self._stopped:
            _write(self._reached, str(i))

    def contended(self, case: Case, since: float) -> bool:
        """Whether any warm-up process ran at or after ``since`` (``time.monotonic``), the start of ``case`` in the
        judged worker; if so they are stopped now (``case`` runs again alone)."""
        with self._lock:
            ended = self._ended_at
        if ended is not None and ended < since:
            return False
        self.stop(f"{case.id} failed to run beside them")
        return True

    def stop(self, because: str | None = None) -> None:
        """Stop every warm-up process now (``because``: why, when it is before the end of the run)."""
        with self._lock:
            if not self._stopped and because is not None:
                self.stopped_because = because
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
        if not (self.restarts or self.stopped_because):
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> WarmUp:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and its session (a compiler it started)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _case_dict(case: Case) -> dict:
    return dict(op=case.op, name=case.name, dtype=case.dtype, params=case.params)


def _die_with_parent() -> None:  # pragma: no cover - in the warm-up process
    """On Linux, have the kernel kill this process when the run that started it dies (``PR_SET_PDEATHSIG``)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _cuda_setup(device: str, workers: int) -> None:  # pragma: no cover - in the warm-up process
    """The backend's device current, and this process's share of its memory, before the backend loads."""
    if device.startswith("cuda:"):
        torch.cuda.set_device(torch.device(device))
    torch.cuda.set_per_process_memory_fraction(1 / (2 * workers))


def _warm(backend_name: str, folder: Path, k: int, workers: int, start: int, device: str) -> None:  # pragma: no cover
    """Warm-up process ``k`` of ``workers``: run its share of the cases from ``start``, outputs thrown away."""
    from .backend import load_backend, skip_reason
    from .ops import OPS
    from .worker import _cuda_broken, invoke

    parent = os.getppid()
    _die_with_parent()
    torch.set_num_threads(1)  # the parent's references and the judged worker need the cores more
    if device.startswith("cuda") or (not device and torch.cuda.is_available()):
        _cuda_setup(device, workers)
    try:
        backend = load_backend(backend_name)
    except Exception:  # the judged worker loaded it: nothing to warm here (a device this process cannot have)
        traceback.print_exc()
        return
    cases = [Case(**c) for c in pickle.loads((folder / "cases.pkl").read_bytes())]
    for i in range(start, len(cases), workers):
        if os.getppid() != parent:
            return  # the run is gone
        if i <= (_read_int(folder / "reached") or 0):
            continue  # the judged worker is there already
        _write(folder / f"warm-{k}.at", str(i))  # if this case kills the process, the keeper starts after it
        case = cases[i]
        try:
            if skip_reason(backend, case):
                continue
            invoke(backend, case.op, OPS[case.op].make_inputs(case), OPS[case.op].writes)  # as the judged worker calls
        except Exception:  # not a verdict: the judged worker runs the case and says what it does
            print(f"warm-up: {case.id}", flush=True)
            traceback.print_exc()
            if _cuda_broken():
                sys.exit(3)  # a new process (a new CUDA context) goes on after this case
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()


if __name__ == "__main__":  # pragma: no cover - python -m mlaspec.conformance.warmup BACKEND DIR K N START DEVICE
    faulthandler.enable()
    _name, _dir, _k, _n, _start, _device = sys.argv[1:7]
    _warm(_name, Path(_dir), int(_k), int(_n), int(_start), _device)
    sys.stdout.flush()
    os._exit(0)  # without the interpreter's teardown (as the judged worker leaves)
