"""The backend in a process of its own: whatever it does, the run goes on and every case gets a verdict.

The parent (the CLI or the pytest plugin) owns the case list, the float64 reference, the judge and the results
file; a worker process (``spawn``: no state inherited but the environment and the working directory) loads the
backend by name and runs one case at a time. What crosses between them is small:

* parent -> worker: the case (op, name, dtype, params). The worker rebuilds the inputs from the case's seed, so no
  tensor is sent; the parent builds the same inputs for the reference, bit for bit. Once, the run's case list
  (:meth:`WorkerBackend.plan`), so that the worker builds each case's inputs on a thread while it runs the case
  before (:class:`InputsAhead`).
* worker -> parent: the outputs, moved to CPU and pickled (one copy of each output; none of
  the inputs), with the seconds the call took and any breach of the input contract (an input written that the op
  does not write, an output that aliases an input).

The worker is ``python -m mlaspec.conformance.worker`` started with :mod:`subprocess` (never ``fork``: a CUDA
context does not survive one), connected over a local socket, its stdout and stderr going to a log file.

While the worker runs a case, the parent computes that case's reference and budget and judges the case before it
(:func:`~mlaspec.conformance.runner.run_cases` sends a case once the previous one's outputs are in), so the
isolation costs the transfers and, after a crash, a fresh worker's start (the backend's import and, for a GPU, its
CUDA context).

A worker that dies (any exit status, any signal, ``sys.exit`` or ``os._exit`` inside an op) gives the case a
``crash`` verdict naming the status or signal and the last lines of the worker's output; one that runs past the
per-case timeout, even spinning in native code where no Python signal handler can interrupt it, is killed and
gives ``timeout``. Either way the next case runs in a new worker.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from .cases import Case
from .cpus import worker_threads
from .heap import keep_freed_memory
from .spawn import Spawned, spawn
from .trace import timed, trace

__all__ = ["InputsAhead", "Outcome", "WorkerBackend", "contract_breaches", "error_message", "invoke"]

_START_TIMEOUT = 600.0  # importing a backend may compile kernels


@dataclass
class Outcome:
    """What running one case in the worker gave: ``kind`` is ``"ok"`` (``outputs`` holds what the op returned, on
    CPU), ``"error"`` (the op raised: ``reason``), ``"crash"`` or ``"timeout"`` (``reason`` and ``log``, the tail of
    the worker's stdout and stderr). ``breaches`` lists input-contract violations of an ``ok`` call."""

    kind: str
    outputs: object = None
    reason: str = ""
    seconds: float = 0.0
    breaches: tuple[str, ...] = ()
    log: str = ""
    retried: str = ""  # what a first attempt gave beside warm-up workers, when the case ran again alone


# -- the worker side ------------------------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes on CPU (bit patterns, so NaN equals NaN)."""
    t = t.detach()
    if t.is_sparse or t.layout != torch.strided:
        t = t.to_dense()
    return t.contiguous().cpu().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _storage_span(t: torch.Tensor) -> tuple[str, int, int] | None:
    """``(device, first byte, end byte)`` of the memory a strided tensor can reach; None if it has none."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta" or not t.numel():
        return None
    start = t.data_ptr()
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0) + 1
    return str(t.device), start, start + extent * t.element_size()


def contract_breaches(
    inputs: Mapping[str, object], given: Mapping[str, object], outputs: object, writes: tuple[str, ...] = ()
) -> list[str]:
    """The input contract: ``given`` (the tensors the backend was handed) must still equal ``inputs`` (the
    untouched originals) byte for byte, except the arguments an op declares it ``writes``; and no output may share
    memory with an input (except a written one, which an op may return)."""
    breaches = []
    for name, original in inputs.items():
        if not isinstance(original, torch.Tensor) or name in writes:
            continue
        after = given[name]
        if (
            not isinstance(after, torch.Tensor)
            or after.shape != original.shape
            or not torch.equal(_bytes(after), _bytes(original))
        ):
            breaches.append(f"the backend wrote into its input {name!r}, which the op does not write")
    spans = {name: _storage_span(t) for name, t in given.items() if name not in writes}
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for i, out in enumerate(outs):
        o = _storage_span(out) if isinstance(out, torch.Tensor) else None
        for name, s in spans.items():
            if o is not None and s is not None and o[0] == s[0] and o[1] < s[2] and s[1] < o[2]:
                breaches.append(f"output {i} shares memory with the input {name!r}")
    return breaches


def invoke(backend, op: str, inputs: Mapping[str, object], writes: tuple[str, ...]) -> tuple[object, float, tuple]:
    """Call ``backend``'s ``op`` on clones of ``inputs`` and wait for the device: ``(outputs, seconds, breaches)``,
    the breaches of the input contract (:func:`contract_breaches`) against the untouched ``inputs``. The one call
    of an op, in a worker or in the harness's own process."""
    given = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    start = time.perf_counter()
    got = getattr(backend, op)(**given)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return got, seconds, tuple(contract_breaches(inputs, given, got, writes))


def _to_cpu(x: object) -> object:
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta":
            raise TypeError("an output is on the 'meta' device: it has no values to judge")
        return x.detach().to("cpu").clone()
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple
        return type(x)(*(_to_cpu(v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x


def error_message(exc: BaseException) -> str:
    """``Type: first line`` of an exception, cut at 300 characters (compiler errors run to pages)."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(message) > 300:
        message = message[:300] + " ..."
    return f"{type(exc).__name__}: {message}"


def _cuda_broken() -> bool:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    try:
        torch.cuda.synchronize()
    except Exception:  # any CUDA error here means the context is gone
        return True
    return False


def _pack(outputs: object) -> bytes:
    return pickle.dumps(outputs, protocol=pickle.HIGHEST_PROTOCOL)


def _serve(backend_name: str, conn) -> None:  # pragma: no cover - runs in the worker process
    """The worker's loop: load the backend, then answer ``("skip", case)`` and ``("run", case, writes)``, and take
    ``("plan", cases)`` (:class:`InputsAhead`), until ``("stop",)``."""
    from .backend import load_backend
    from .ops import OPS  # noqa: F401 - before "ready": the first case does not pay for the import

    try:
        backend = load_backend(backend_name)
    except BaseException as exc:
        conn.send(("load-error", f"{type(exc).__name__}: {exc}"))
        return
    meta = dict(
        name=str(backend.name),
        version=str(backend.version),
        ops=frozenset(backend.ops),
        dtypes=frozenset(backend.dtypes),
        not_implemented=dict(getattr(backend, "not_implemented", None) or {}),
        has_unsupported=callable(getattr(backend, "unsupported", None)),
        unavailable=getattr(backend, "unavailable", None),
        numerics={op: tuple(v) for op, v in (getattr(backend, "numerics", None) or {}).items()},
        device=str(getattr(backend, "device", None) or "") or None,
        jit=bool(getattr(backend, "jit", False)),
    )
    conn.send(("ready", meta))
    ahead = InputsAhead(backend)
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "plan":
            ahead.plan = [Case(**c) for c in msg[1]]
            trace("plan", len(ahead.plan))
            continue
        case = Case(**msg[1])
        try:
            if msg[0] == "skip":
                conn.send(("ok", backend.unsupported(case)))
                continue
            got, seconds, breaches = _judged_call(backend, case, msg[2], ahead)
            start = time.perf_counter()
            reply = ("ok", _pack(_to_cpu(got)), seconds, breaches)
            timed("reply", case.id, start)
        except Exception as exc:  # the op's failure is the case's verdict, not the worker's end
            traceback.print_exc()
            reply = ("error", error_message(exc))
        # an illegal address breaks this process's CUDA context: every later launch would fail, so the worker
        # retires after this reply, and the parent starts a new one (a new context) for the next case
        retire = _cuda_broken()
        conn.send((*reply, retire))
        if retire:
            return


class InputsAhead:
    """The judged worker's inputs, each case's built on a thread while the backend runs the case before it.

    The parent sends the run's cases once (:meth:`WorkerBackend.plan`); when the worker takes a case, :meth:`inputs`
    gives its inputs (built ahead, else built now) and starts building those of the next planned case the backend
    runs (its ``ops`` and ``dtypes``: asked here ahead of its turn, an ``unsupported`` that crashes would take the case
    in flight with it). A case its ``unsupported`` skips is built for nothing, so after a case that came out of turn
    (the parent skipped the one expected) none is built ahead: FlashMLA, which skips 228 of the 336 full-scale cases,
    cost 20-27% more CPU seconds with every next case built. Warm on 2 cores the worker
    is the run's path (its inputs 3.3 s and calls 2.5 s of the default run, traced, while the run's process waits),
    and the run's process leaves the other core idle. ``make_inputs`` is a function of the case alone (its own
    seeded generators), so inputs built ahead are the inputs built in turn, bit for bit."""

    def __init__(self, backend: object):
        from concurrent.futures import ThreadPoolExecutor

        self.backend = backend
        self.plan = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlaspec-inputs")
        self._pending = None  # (case id, the future of its inputs)
        self._expected = None  # the next planned case the backend runs, after the last one taken

    @property
    def plan(self) -> list[Case]:
        """The run's cases in their order (the parent's ``("plan", cases)``)."""
        return self._plan

    @plan.setter
    def plan(self, cases: list[Case]) -> None:
        self._plan, self._position = list(cases), {c.id: i for i, c in enumerate(cases)}

    @property
    def building(self) -> str | None:
        """The id of the case whose inputs are built ahead (None: none)."""
        return None if self._pending is None else self._pending[0]

    def _next(self, case: Case) -> Case | None:
        if case.id not in self._position:
            return None
        ops, dtypes = getattr(self.backend, "ops", ()), getattr(self.backend, "dtypes", ())
        after = self._plan[self._position[case.id] + 1 :]
        return next((c for c in after if c.op in ops and c.dtype in dtypes), None)

    def inputs(self, case: Case) -> dict:
        """``case``'s inputs (an exception building them is raised here, as when built in turn); the next planned
        case's start building on the thread."""
        from .ops import OPS

        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == case.id:
            inputs = pending[1].result()
            trace("prebuilt", case.id)
        else:  # none built ahead (the first case, one sent out of plan or after a skip, or run again alone)
            inputs = OPS[case.op].make_inputs(case)
        in_turn, after = self._expected in (None, case.id), self._next(case)
        self._expected = None if after is None else after.id
        if after is not None and in_turn:  # after a skip, none: where skips come often, none is built for nothing
            self._pending = (after.id, self._pool.submit(OPS[after.op].make_inputs, after))
        return inputs


def _judged_call(backend, case: Case, writes: tuple[str, ...], ahead: InputsAhead):
    """:func:`invoke` on ``case``'s inputs (``ahead``'s; their memory goes when this returns), the two traced
    (:mod:`~mlaspec.conformance.trace`)."""
    start = time.perf_counter()
    inputs = ahead.inputs(case)
    timed("inputs", case.id, start)
    got, seconds, breaches = invoke(backend, case.op, inputs, writes)
    trace("call", case.id, f"{seconds:.4f}")
    return got, seconds, breaches


# -- the parent side ------------------------------------------------------------------------------------------------
def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def open_backend(name: str, *, isolated: bool, timeout: float | None, started: Spawned | None = None):
    """The backend ``name`` in a worker process (``isolated``: a :class:`WorkerBackend`, in ``started`` if given)
    or in this one."""
    from .backend import load_backend

    return WorkerBackend(name, timeout=timeout, started=started) if isolated else load_backend(name)


def load_failure(exc: BaseException, *, isolated: bool) -> str:
    """Why :func:`open_backend` failed, in words: the worker's message (its first line), or the exception's type and
    message when the backend was loaded in this process."""
    if isolated:
        return (str(exc).splitlines() or [type(exc).__name__])[0]
    return f"{type(exc).__name__}: {exc}"


class WorkerBackend:
    """A backend, by name, in a worker process; it quacks like a backend for what the harness asks before a call
    (``name``, ``version``, ``ops``, ``dtypes``, ``not_implemented``, ``unavailable``, ``numerics``, ``device``,
    ``unsupported``) and runs ops through :meth:`send` / :meth:`collect`. Raises ``RuntimeError`` when the backend
    cannot be loaded (the message is the worker's)."""

    def __init__(self, backend_name: str, *, timeout: float | None = 120.0, started: Spawned | None = None):
        self.backend_name = backend_name
        self.timeout = timeout
        self._log = None
        self._proc = None
        self._conn = None
        meta = self._start(started)
        self.name, self.version = meta["name"], meta["version"]
        self.ops, self.dtypes = meta["ops"], meta["dtypes"]
        self.not_implemented = meta["not_implemented"]
        self._has_unsupported = meta["has_unsupported"]
        self.unavailable = meta["unavailable"]
        self.numerics = meta["numerics"]
        self.in_flight: Case | None = None  # the case sent and not yet collected
        self._plan = None  # the "plan" message, sent again to a worker started again
        # what runs beside this worker (conformance.warmup.WarmUp): when a case errs, crashes or times out, its
        # ``contended(case, since)`` says whether it ran meanwhile and is stopped now; the case then runs again alone,
        # and if that fails the same way, ``resume()`` starts it again (it was not the cause)
        self.beside = None
        self.device = meta["device"]  # where the backend runs (its own ``device``), or None: unknown
        self.jit = meta["jit"]  # it compiles kernels on first use (the protocol's optional ``jit``)
        self.starts = 1

    def _start(self, started: Spawned | None = None) -> dict:
        """Start a worker (or take ``started``, one :func:`~mlaspec.conformance.spawn.spawn` began for this backend)
        and wait for its ``ready``: the backend's description."""
        if started is not None and started.backend_name != self.backend_name:
            raise ValueError(f"started: a worker of {started.backend_name!r}, not of {self.backend_name!r}")
        w = started or spawn(self.backend_name, self._log)
        self._proc, self._conn, self._log = w.proc, w.conn, w.log
        reply = self._receive(_START_TIMEOUT)
        if reply is None or reply[0] != "ready":
            if reply is not None and reply[0] == "load-error":
                why = reply[1]
            else:
                why = f"the worker {_status(self._proc.poll())}: {_tail(self._log, 4)}"
            self.close()
            raise RuntimeError(f"backend {self.backend_name!r} could not be loaded: {why}")
        return reply[1]

    def _receive(self, timeout: float | None):
        """The worker's reply, or None if it died or ``timeout`` passed first (then it is killed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.5 if deadline is None else min(0.5, max(deadline - time.monotonic(), 0.0))
            try:
                if self._conn.poll(wait):
                    return self._conn.recv()
            except (EOFError, OSError):
                return None
            if self._proc.poll() is not None and not self._conn.poll(0):
                return None
            if deadline is not None and time.monotonic() >= deadline:
                self._kill()
                return None

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _kill(self) -> None:
        if self._alive():
            self._proc.kill()
        if self._proc is not None:
            self._proc.wait(10)

    def _restart(self) -> None:
        self._kill()
        self._start()
        self.starts += 1
        if self._plan is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(self._plan)

    def _failure(self, since: float, timeout: float | None) -> Outcome:
        """The outcome of a call the worker did not answer (it died, or ``timeout`` passed); a new worker starts with
        the next call (after what runs beside it has stopped, when the case runs again alone)."""
        seconds = time.perf_counter() - since
        if timeout is not None and seconds >= timeout:
            self._kill()
            outcome = Outcome("timeout", reason=f"timed out after {timeout:g} s; the worker was killed")
        else:  # the connection closed: the worker is exiting, or gone
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(10)
            status = _status(self._proc.poll())
            self._kill()
            outcome = Outcome("crash", reason=f"the backend's worker {status} during the call")
        outcome.seconds, outcome.log = seconds, _tail(self._log)
        return outcome

    def _send(self, message: tuple) -> float:
        if not self._alive():
            self._restart()
        with contextlib.suppress(BrokenPipeError, OSError):  # a worker that died meanwhile: _failure says why
            self._conn.send(message)
        return time.perf_counter()

    def plan(self, cases: list[Case]) -> None:
        """Tell the worker the run's cases in their order, so that it builds each one's inputs while it runs the one
        before (:class:`InputsAhead`; a worker started again after a crash is told too)."""
        self._plan = ("plan", [_case_dict(c) for c in cases])
        self._send(self._plan)

    def send(self, case: Case, writes: tuple[str, ...] = ()) -> None:
        """Start running ``case`` (collect it with :meth:`collect`); ``writes`` names the inputs the op writes."""
        self._pending = self._send(("run", _case_dict(case), tuple(writes)))
        self.in_flight, self._writes, self._since = case, tuple(writes), time.monotonic()

    def collect(self, *, rerun: bool = True) -> Outcome:
        """The outcome of the case :meth:`send` started; with ``rerun``, a case that failed to run while something
        ran beside the worker runs again alone (the first attempt then in ``retried``, with its log)."""
        case = self.in_flight
        outcome = self._collect()
        trouble = outcome.kind in ("error", "crash", "timeout")
        if rerun and trouble and self.beside is not None and self.beside.contended(case, self._since):
            self.send(case, self._writes)
            first, outcome = outcome, self._collect()
            outcome.retried = f"{first.kind}: {first.reason}" + (f"\n{first.log}" if first.log else "")
            if outcome.kind == first.kind:
                self.beside.resume()
        return outcome

    def _collect(self) -> Outcome:
        self.in_flight = None
        reply = self._receive(self.timeout)
        if reply is None:
            return self._failure(self._pending, self.timeout)
        if reply[-1]:  # the worker retires (its CUDA context is lost): the next call starts a new one
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(30)
            self._kill()
        if reply[0] == "error":
            return Outcome("error", reason=reply[1], seconds=time.perf_counter() - self._pending)
        _, packed, seconds, breaches, _ = reply
        outputs = pickle.loads(packed)  # our own worker's bytes
        return Outcome("ok", outputs=outputs, seconds=seconds, breaches=breaches)

    def unsupported(self, case: Case) -> str | None:
        """The backend's own skip reason for ``case`` (its ``unsupported``), asked in the worker."""
        if not self._has_unsupported:
            return None
        since = self._send(("skip", _case_dict(case)))
        reply = self._receive(self.timeout)
        if reply is None:
            failure = self._failure(since, self.timeout)
            raise RuntimeError(f"unsupported(case): {failure.reason}")
        if reply[0] == "error":
            raise RuntimeError(f"unsupported(case) raised {reply[1]}")
        return reply[1]

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(("stop",))
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            self._kill()

    def __enter__(self) -> WorkerBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _case_dict(case: Case) -> dict:
    return dict(op=case.op, name=case.name, dtype=case.dtype, params=case.params)


def _main() -> None:  # pragma: no cover - the worker process
    faulthandler.enable()  # a fatal signal writes the Python stack to the log the parent shows
    keep_freed_memory()  # each case's inputs reuse the memory of the last (mlaspec.conformance.heap)
    torch.set_num_threads(worker_threads())  # the parent's float64 references are the run's CPU work
    device = os.environ.get("MLASPEC_DEVICE", "")
    if device.startswith("cuda:"):  # a sharded run's GPU (pytest --mla-device cuda): the current device too
        torch.cuda.set_device(torch.device(device))
    fd, backend_name = int(sys.argv[1]), sys.argv[2]
    with Connection(fd) as conn:
        _serve(backend_name, conn)
    # done: leave without the interpreter's teardown (torch's and a backend's take a second or more, which the parent
    # would wait for at close); the log is flushed first
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main()
