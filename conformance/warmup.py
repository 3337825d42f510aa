"""Warm-up workers: a JIT backend's kernels compiled in parallel, ahead of the worker that is judged.

A Triton backend (FlashInfer too) compiles each kernel variant the first time a case needs it, in the process that
runs the case: on a cold full-scale run that is most of the run, one kernel after another (issue 18 measured 174 s
of a 232 s run on the H200). With ``mlaspec check --warm N``, N more processes run the same cases ahead of the
judged worker, each its own share (process ``k`` takes cases ``k, k+N, ...``, skipping those the judged worker has
reached) and throws the outputs away: what they compile lands in the backend's on-disk cache (Triton's
``~/.triton/cache``), where the judged worker finds it instead of compiling.

Nothing a warm-up process does reaches a verdict:

* it is a process of its own; one that dies (a crash, a lost CUDA context) is started again at its next case, and
  its output goes to a log that is shown to nobody but the curious (:attr:`WarmUp.logs`);
* on a GPU each holds at most ``1 / (2 N)`` of the device's memory, so the judged worker keeps at least half; a
  judged case that still runs out of device memory while they run stops them and runs again on its own
  (:meth:`WarmUp.stop`, wired to the worker's ``on_out_of_memory``), and the run says so at its end;
* the judged worker's inputs, reference and verdicts are those of a run without them; only its timings are
  contended (they are not judged).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import torch

from .cases import Case

__all__ = ["WarmUp"]

_MAX_RESTARTS = 8  # a warm-up process that dies this often is left dead: the judged worker compiles for itself


def _write(path: Path, text: str) -> None:
    """``text`` into ``path`` at once (a reader sees the old text or the new, never half)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_int(path: Path, default: int) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return default


class WarmUp:
    """``workers`` processes that run ``cases`` of the backend ``backend_name`` ahead of the judged worker.

    Call :meth:`reached` with the index of each case as the judged worker takes it, and :meth:`stop` at the end
    (or use it as a context manager). ``stopped_because`` says why they were stopped early (None otherwise);
    ``restarts`` counts the processes started again after dying."""

    def __init__(self, backend_name: str, cases: list[Case], workers: int):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.backend_name, self.workers, self.total = backend_name, workers, len(cases)
        self.dir = Path(tempfile.mkdtemp(prefix="mlaspec-warm-"))
        (self.dir / "cases.pkl").write_bytes(pickle.dumps([_case_dict(c) for c in cases]))
        self._reached = self.dir / "reached"
        _write(self._reached, "-1")
        self.restarts, self.stopped_because = 0, None
        self._lock = threading.Lock()
        self._stopped = False
        self._procs: dict[int, subprocess.Popen] = {}
        self._threads = [threading.Thread(target=self._keep, args=(k,), daemon=True) for k in range(workers)]
        for t in self._threads:
            t.start()

    @property
    def logs(self) -> list[Path]:
        return [self.dir / f"warm-{k}.log" for k in range(self.workers)]

    def _spawn(self, k: int, start: int) -> subprocess.Popen | None:
        with self._lock:
            if self._stopped:
                return None
            with open(self.dir / f"warm-{k}.log", "ab") as log:
                argv = [sys.executable, "-m", "mlaspec.conformance.warmup", self.backend_name, str(self.dir)]
                argv += [str(k), str(self.workers), str(start)]
                self._procs[k] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            return self._procs[k]

    def _keep(self, k: int) -> None:
        """Process ``k``'s keeper: start it, and start it again after the case it died on."""
        start = k
        for _ in range(_MAX_RESTARTS + 1):
            proc = self._spawn(k, start)
            if proc is None or proc.wait() == 0 or self._stopped:
                return
            start = _read_int(self.dir / f"warm-{k}.at", start) + self.workers  # past the case it died on
            if start >= self.total:
                return
            with self._lock:
                self.restarts += 1

    @property
    def done(self) -> bool:
        """Whether every warm-up process has finished its share (or was stopped)."""
        return not any(t.is_alive() for t in self._threads)

    def reached(self, i: int) -> None:
        """The judged worker takes case ``i``: the warm-up processes skip it and those before it."""
        if not self._stopped:
            _write(self._reached, str(i))

    def stop(self, because: str | None = None) -> None:
        """Stop every warm-up process now (``because``: why, when it is before the end of the run)."""
        with self._lock:
            if not self._stopped and because is not None:
                self.stopped_because = because
            self._stopped = True
            for proc in self._procs.values():
                if proc.poll() is None:
                    proc.kill()
        for proc in self._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for t in self._threads:
            t.join(10)

    def __enter__(self) -> WarmUp:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _case_dict(case: Case) -> dict:
    return dict(op=case.op, name=case.name, dtype=case.dtype, params=case.params)


def _warm(backend_name: str, folder: Path, k: int, workers: int, start: int) -> None:  # pragma: no cover - a process
    """Warm-up process ``k`` of ``workers``: run its share of the cases from ``start``, outputs thrown away."""
    from .backend import load_backend, skip_reason
    from .ops import OPS
    from .worker import _cuda_broken

    torch.set_num_threads(1)  # the parent's references and the judged worker need the cores more
    try:
        backend = load_backend(backend_name)
    except Exception:  # the judged worker says why; nothing to warm
        traceback.print_exc()
        return
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1 / (2 * workers))
    cases = [Case(**c) for c in pickle.loads((folder / "cases.pkl").read_bytes())]
    for i in range(start, len(cases), workers):
        if i <= _read_int(folder / "reached", -1):
            continue  # the judged worker is there already
        _write(folder / f"warm-{k}.at", str(i))  # if this case kills the process, the keeper starts after it
        case = cases[i]
        try:
            if skip_reason(backend, case):
                continue
            getattr(backend, case.op)(**OPS[case.op].make_inputs(case))
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        except Exception:  # not a verdict: the judged worker runs the case and says what it does
            print(f"warm-up: {case.id}", flush=True)
            traceback.print_exc()
            if _cuda_broken():
                sys.exit(3)  # a new process (a new CUDA context) goes on after this case
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()


if __name__ == "__main__":  # pragma: no cover - python -m mlaspec.conformance.warmup BACKEND DIR K N START
    faulthandler.enable()
    _name, _dir, _k, _n, _start = sys.argv[1:6]
    _warm(_name, Path(_dir), int(_k), int(_n), int(_start))
    sys.stdout.flush()
    os._exit(0)  # without the interpreter's teardown (as the judged worker leaves)
