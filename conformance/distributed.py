"""``mlaspec check --dcp N``: the ``dcp_decode`` and ``dcp_decode_fp8`` cases across ``N`` real processes, combined by
real collectives.

Every rank is a process of its own (``torch.multiprocessing``, spawn) in one ``torch.distributed`` group on a free
TCP port of localhost: NCCL when every rank has a GPU of its own (rank ``r`` on ``cuda:r``), gloo on the CPU
otherwise. For each case every rank builds the case's inputs (the same seed, so the same tensors), decodes its share
of the cache with the backend's ``mla_decode`` (``dcp_decode``) or ``mla_decode_fp8`` over the fp8 records
(``dcp_decode_fp8``) as the spec shards it (:func:`~mlaspec.conformance.backends.common.dcp_rank_decode`,
:func:`~mlaspec.conformance.backends.common.dcp_rank_decode_fp8`, :func:`mlaspec.spec.dcp.dcp_shard`), and the group
combines the partials as vLLM does (``vllm/v1/attention/ops/common.py``, ``cp_lse_ag_out_rs``,
https://github.com/vllm-project/vllm/blob/main/vllm/v1/attention/ops/common.py):

* **all-gather** of the ``[B, H_q, S_q]`` LSEs, each rank's output **corrected** by its factor ``c_r =
  exp(lse_r - lse)`` (vLLM's ``_correct_attn_cp_out_kernel``: an ``+inf`` / NaN LSE is an empty share, weight 0),
  then a **reduce-scatter** of the sum over heads: rank ``r`` holds heads ``[r H_q / N, (r + 1) H_q / N)``;
* a backend with its own ``dcp_combine`` (ours: ``impl/dcp.py``) combines with it instead, after vLLM's
  **all-to-all** (``vllm/v1/attention/ops/dcp_alltoall.py``, ``dcp_a2a_lse_reduce``): rank ``r`` receives head slice
  ``r`` of every rank's partial and its LSE, and combines them locally.

An all-gather of the head slices then gives rank 0 the whole output, which the parent judges against the
single-device spec with the op's budgets (:class:`RankGroup` is an isolated backend to
:func:`~mlaspec.conformance.runner.run_case`, as :class:`~mlaspec.conformance.worker.WorkerBackend` is). The sum
over ranks is done in fp32 and rounded once to the case dtype (vLLM reduce-scatters in the output dtype).

Failures. After its decode every rank says whether it succeeded (an all-reduce of one flag), so a rank that raises
stops the whole group before the combine and every rank answers: the case's ``error`` names each rank that raised
and its message. A rank that dies (an exit, a segfault) or hangs fails the case (``crash`` / ``timeout``, naming
the rank and its log's tail), and the whole group is killed and started again on a new port for the next case.
Collectives time out :data:`_GRACE` seconds after the case timeout, so a hung rank is the case's ``timeout``
whatever the load: with both at the case timeout, the waiting rank's own collective timeout (its clock started
before the harness's) could fire first and turn a peer's hang into that rank's ``error`` (seen in CI on 2 busy
cores). On GPUs NVLink multicast stays off (:data:`NO_MULTICAST`).

Rank ``r``'s output goes to ``<tmp>/mlaspec-dcp-*/rank<r>.log``.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pickle
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mlaspec.spec.dcp import dcp_correction

from .backends.common import dcp_rank_decode, dcp_rank_decode_fp8
from .cases import Case
from .cpus import worker_threads
from .heap import keep_freed_memory
from .worker import Outcome, _case_dict, _pack, _status, _tail, _to_cpu, error_message, invoke

__all__ = ["NO_MULTICAST", "RankGroup", "combine_over_group", "gather_heads", "process_group_backend"]

DECODES = {"dcp_decode": "mla_decode", "dcp_decode_fp8": "mla_decode_fp8"}
"""The ops a group runs, each by the backend's single-device decode of one rank's share."""
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off on the GPU machines (NCCL's NVLS, torch's symmetric memory, NVSHMEM), set in every rank."""
_GRACE = 10.0  # seconds the other ranks get to answer once one has answered with an error


class PeerFailed(RuntimeError):
    """Another rank of the group failed its decode, so this one skipped the combine."""


def process_group_backend(world_size: int) -> str:
    """``"nccl"`` when every one of ``world_size`` ranks has a GPU of its own, else ``"gloo"`` (CPU)."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the collectives, on one rank ----------------------------------------------------------------------------------
def _head_slice(h_q: int) -> slice:
    n, r = dist.get_world_size(), dist.get_rank()
    return slice(r * h_q // n, (r + 1) * h_q // n)


def _all_ok(ok: bool, device: torch.device) -> bool:
    """Whether every rank's ``ok`` is true (an all-reduce of one flag: every rank reaches it, failed or not)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x``, stacked: ``[N, *x.shape]`` (gathered along a flat first dimension, as gloo wants)."""
    x = x.contiguous()
    parts = torch.empty((dist.get_world_size() * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(parts, x)
    return parts.unflatten(0, (dist.get_world_size(), x.shape[0]))


def _by_head_slices(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with its head dimension ``dim`` split into ``N`` slices, stacked first: the send buffer of a
    reduce-scatter or an all-to-all over heads."""
    n = dist.get_world_size()
    return x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()


def _lse_ag_out_rs(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``cp_lse_ag_out_rs`` on this rank: all-gather the LSEs, correct this rank's output by ``c_r``
    (:func:`mlaspec.spec.dcp.dcp_correction`), reduce-scatter the sum over heads (fp32). ``out [B, S_q, H_q, D_v]``,
    ``lse [B, H_q, S_q]``; returns this rank's heads, ``out [B, S_q, H_q/N, D_v]`` and ``lse [B, H_q/N, S_q]``
    fp32."""
    r = dist.get_rank()
    c, total = dcp_correction(_all_gather(lse.float()))  # [N, B, H_q, S_q], [B, H_q, S_q]
    c_r = c[r].transpose(1, 2)[..., None].float()  # [B, S_q, H_q, 1]
    corrected = torch.where(c_r > 0, out.float() * c_r, 0.0)  # an empty share's NaN stays out
    mine = torch.empty_like(corrected[:, :, _head_slice(out.shape[2])]).contiguous()
    dist.reduce_scatter_tensor(mine, _by_head_slices(corrected, 2).flatten(0, 1))  # gloo: a flat first dimension
    return mine, total[:, _head_slice(out.shape[2])].float()


def _lse_a2a(out: torch.Tensor, lse: torch.Tensor, combine, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``dcp_a2a_lse_reduce`` on this rank: all-to-all (on ``device``) of the head slices of the partial output
    and its LSE, both issued before either is waited on (as vLLM does), then ``combine(outs [N, B, S_q, H_q/N, D_v],
    lses [N, B, H_q/N, S_q])`` (the backend's ``dcp_combine``, on ``out``'s device)."""
    sent = (_by_head_slices(out, 2).to(device), _by_head_slices(lse, 1).to(device))
    got = tuple(torch.empty_like(x) for x in sent)
    works = [dist.all_to_all_single(recv, send, async_op=True) for recv, send in zip(got, sent)]
    for work in works:
        work.wait()
    return combine(*(x.to(out.device) for x in got))


def combine_over_group(
    out: torch.Tensor, lse: torch.Tensor, combine=None, *, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's heads of the combined result, from its partial ``out [B, S_q, H_q, D_v]``, ``lse [B, H_q, S_q]``:
    :func:`_lse_a2a` with ``combine`` (a backend's ``dcp_combine``, run where ``out`` is), else
    :func:`_lse_ag_out_rs`. The collectives run on ``device`` (default ``out``'s; gloo's is the CPU). ``H_q`` must
    be divisible by the world size. Returns ``out [B, S_q, H_q/N, D_v]``, ``lse [B, H_q/N, S_q]`` on ``device``."""
    device = out.device if device is None else device
    if combine is not None:
        return tuple(t.to(device) for t in _lse_a2a(out, lse, combine, device))
    return _lse_ag_out_rs(out.to(device), lse.to(device))


def gather_heads(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's head slice put back together on every rank (all-gather): ``out [B, S_q, H_q, D_v]``,
    ``lse [B, H_q, S_q]``."""
    return tuple(_all_gather(x).movedim(0, dim).flatten(dim, dim + 1) for x, dim in ((out, 2), (lse.float(), 1)))


class _Rank:
    """One rank's ``dcp_decode`` / ``dcp_decode_fp8`` (called through :func:`~mlaspec.conformance.worker.invoke`): its
    partial by the backend's ``mla_decode`` / ``mla_decode_fp8``, the group's combine, the whole result gathered."""

    def __init__(self, backend, device: torch.device):
        self.backend, self.device = backend, device

    def dcp_decode(self, q, kv, **args):
        return self._combined(dcp_rank_decode, q, kv, args)

    def dcp_decode_fp8(self, q, kv_cache, **args):
        return self._combined(dcp_rank_decode_fp8, q, kv_cache, args)

    def _combined(self, rank_decode, q, kv, args):
        part, failure = None, None
        try:
            part = rank_decode(self.backend, q, kv, **args, rank=dist.get_rank())
        except Exception as exc:  # reported by this rank; the others learn of it below and stop too
            failure = exc
        if not _all_ok(failure is None, self.device):
            raise failure or PeerFailed("another rank failed its decode; this rank skipped the combine")
        combine = getattr(self.backend, "dcp_combine", None)
        mine = combine_over_group(*part, combine if callable(combine) else None, device=self.device)
        out, lse = gather_heads(*mine)
        return out.to(q.dtype), lse


def _serve_rank(  # pragma: no cover - runs in the rank's process
    backend_name: str, rank: int, world_size: int, port: int, timeout: float, conn, log: str
) -> None:
    """Rank ``rank``'s loop (in its own process): load the backend, join the group, then answer ``("skip", case)``
    and ``("run", case, writes)`` until ``("stop",)``."""
    from .backend import load_backend
    from .ops import OPS

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    faulthandler.enable()  # a fatal signal writes the Python stack to the log the parent shows
    keep_freed_memory()  # each case's inputs reuse the memory of the last (mlaspec.conformance.heap)
    torch.set_num_threads(worker_threads(workers=world_size))  # the ranks share the CPUs with each other and the parent
    os.environ.update(NO_MULTICAST)
    kind = process_group_backend(world_size)
    device = torch.device(f"cuda:{rank}" if kind == "nccl" else "cpu")
    if kind == "nccl":
        torch.cuda.set_device(device)
        os.environ["MLASPEC_DEVICE"] = str(device)
    try:
        backend = load_backend(backend_name)
        dist.init_process_group(
            kind,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except BaseException as exc:
        conn.send(("load-error", error_message(exc)))
        return
    conn.send(("ready", _meta(backend, world_size, kind)))
    rank_op = _Rank(backend, device)
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            dist.destroy_process_group()
            return
        case = Case(**msg[1])
        try:
            if msg[0] == "skip":
                conn.send(("ok", backend.unsupported(case)))
                continue
            got, seconds, breaches = invoke(rank_op, case.op, OPS[case.op].make_inputs(case), msg[2])
            conn.send(("ok", _pack(_to_cpu(got)) if rank == 0 else None, seconds, breaches))
        except Exception as exc:  # the case's verdict, not the rank's end
            conn.send(("error", error_message(exc), isinstance(exc, PeerFailed)))


def _meta(backend, world_size: int, kind: str) -> dict:
    from .ops import OPS

    ops = frozenset(op for op, decode in DECODES.items() if decode in backend.ops)
    why = f"a group of {world_size} processes ({kind}) runs {' and '.join(DECODES)} only"
    declared = getattr(backend, "numerics", None) or {}
    return dict(
        name=str(backend.name),
        version=f"{backend.version}; {world_size} ranks over {kind}",
        ops=ops,
        dtypes=frozenset(backend.dtypes),
        not_implemented={op: why for op in OPS if op not in DECODES}
        | {op: f"it has no {decode}" for op, decode in DECODES.items() if op not in ops},
        has_unsupported=callable(getattr(backend, "unsupported", None)),
        unavailable=getattr(backend, "unavailable", None),
        numerics={op: tuple(declared.get(op, ())) for op in ops},
    )


# -- the parent side ------------------------------------------------------------------------------------------------
class RankGroup:
    """The backend ``backend_name`` on ``world_size`` processes in one ``torch.distributed`` group. To the harness it
    is an isolated backend (``name``, ``version``, ``ops``, ``dtypes``, ``not_implemented``, ``unavailable``,
    ``numerics``, ``unsupported``; :meth:`send` / :meth:`collect`) that runs the ``dcp_decode`` and
    ``dcp_decode_fp8`` cases of ``world_size`` ranks. ``timeout`` bounds each case (its collectives: :data:`_GRACE`
    seconds longer); ``init_timeout`` the group's start. Raises ``RuntimeError`` (naming the rank and its message)
    when the group cannot start."""

    def __init__(self, backend_name: str, world_size: int, *, timeout: float | None = 120.0, init_timeout=600.0):
        if world_size < 2:
            raise ValueError(f"world_size must be >= 2 (one process is the simulated dcp_decode), got {world_size}")
        self.backend_name, self.world_size = backend_name, world_size
        self.timeout, self.init_timeout = timeout, init_timeout
        self._dir = Path(tempfile.mkdtemp(prefix="mlaspec-dcp-"))
        self._procs, self._conns = [], []
        meta = self._start()
        self.name, self.version = meta["name"], meta["version"]
        self.ops, self.dtypes = meta["ops"], meta["dtypes"]
        self.not_implemented, self.numerics = meta["not_implemented"], meta["numerics"]
        self._has_unsupported, self.unavailable = meta["has_unsupported"], meta["unavailable"]
        self.starts = 1

    def _log(self, rank: int) -> Path:
        return self._dir / f"rank{rank}.log"

    def _start(self) -> dict:
        ctx = mp.get_context("spawn")
        port, collective_timeout = _free_port(), (self.timeout or 600.0) + _GRACE  # the case's timeout fires first
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            args = (self.backend_name, rank, self.world_size, port, collective_timeout, child, str(self._log(rank)))
            proc = ctx.Process(target=_serve_rank, args=args, daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        replies = self._gather(self.init_timeout)
        bad = {r: reply for r, reply in replies.items() if reply is None or reply[0] != "ready"}
        if bad:
            why = "; ".join(
                f"rank {r}: {reply[1]}" if reply is not None else f"rank {r}: {self._silence(r)}"
                for r, reply in sorted(bad.items())
            )
            self.close()
            raise RuntimeError(f"backend {self.backend_name!r} could not start on {self.world_size} ranks: {why}")
        return replies[0][1]

    def _silence(self, rank: int) -> str:
        """Why rank ``rank`` gave no answer: its exit status (or that it still runs) and its log's tail."""
        status = _status(self._procs[rank].exitcode)
        return f"no answer, the process {status}" + (
            f"; its last output:\n{tail}" if (tail := _tail(self._log(rank))) else ""
        )

    def _gather(self, timeout: float | None, ranks: range | None = None) -> dict[int, tuple | None]:
        """The reply of each of ``ranks`` (default: all; None: it died, or gave none before ``timeout``; once one
        rank has answered with an error, the rest get :data:`_GRACE` seconds: they may be blocked in a collective
        that will not finish)."""
        ranks = ranks or range(self.world_size)
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: dict[int, tuple | None] = {}
        while len(replies) < len(ranks):
            for r in ranks:
                if r in replies:
                    continue
                conn, proc = self._conns[r], self._procs[r]
                try:
                    if conn.poll(0.05):
                        replies[r] = conn.recv()
                        if replies[r][0] == "error" and not replies[r][2]:
                            cut = time.monotonic() + _GRACE
                            deadline = cut if deadline is None else min(deadline, cut)
                    elif not proc.is_alive():
                        replies[r] = None
                except (EOFError, OSError):  # its end closed: the rank is exiting; wait so its status is known
                    proc.join(_GRACE if deadline is None else min(_GRACE, max(0.0, deadline - time.monotonic())))
                    replies[r] = None
            if deadline is not None and time.monotonic() >= deadline:
                break
        return {r: replies.get(r) for r in ranks}

    def _kill(self) -> None:
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
        self._procs, self._conns = [], []

    def _restart(self) -> None:
        self._kill()
        self._start()
        self.starts += 1

    def _send_all(self, message: tuple, ranks: range | None = None) -> None:
        if not self._procs:
            self._restart()
        for r in ranks or range(self.world_size):
            with contextlib.suppress(BrokenPipeError, OSError):  # a rank that died meanwhile: _gather says so
                self._conns[r].send(message)

    def send(self, case: Case, writes: tuple[str, ...] = ()) -> None:
        """Start running ``case`` on every rank (collect it with :meth:`collect`)."""
        self._send_all(("run", _case_dict(case), tuple(writes)))
        self._pending = time.perf_counter()

    def collect(self) -> Outcome:
        """The outcome of the case :meth:`send` started, judged by rank 0's output; any rank's failure fails it."""
        replies = self._gather(self.timeout)
        seconds = time.perf_counter() - self._pending
        silent = [r for r, reply in replies.items() if reply is None]
        raised = {r: reply[1] for r, reply in replies.items() if reply is not None and reply[0] == "error"}
        own = {r: m for r, m in raised.items() if not replies[r][2]}  # not the PeerFailed of a rank told to stop
        if silent:
            if own and all(self._procs[r].is_alive() for r in silent):
                outcome = self._left_waiting(own, silent, seconds)
            else:
                outcome = self._silent_outcome(silent, seconds)
                outcome.reason += "".join(f"; meanwhile rank {r} raised {m}" for r, m in raised.items())
            self._restart()  # the survivors may be stuck in a collective: a new group for the next case
            return outcome
        if raised:
            return Outcome(
                "error", reason="; ".join(f"rank {r}: {m}" for r, m in (own or raised).items()), seconds=seconds
            )
        breaches = tuple(f"rank {r}: {b}" for r, reply in replies.items() for b in reply[3])
        outputs = pickle.loads(replies[0][1])  # our own rank's bytes
        return Outcome("ok", outputs=outputs, seconds=max(reply[2] for reply in replies.values()), breaches=breaches)

    def _left_waiting(self, own: dict[int, str], silent: list[int], seconds: float) -> Outcome:
        """A rank raised and the others, alive, gave no answer within :data:`_GRACE` seconds of it: they wait in a
        collective the failed rank will not join (one whose CUDA context an illegal access broke raises in every
        collective after it). The case's error is the rank's own, not a timeout of the others."""
        errors = "; ".join(f"rank {r}: {m}" for r, m in own.items())
        waiting = ", ".join(map(str, silent))
        reason = f"{errors}; rank {waiting} gave no answer within {_GRACE:g} s of it (left waiting in a collective)"
        return Outcome("error", reason=f"{reason}; the group was restarted", seconds=seconds)

    def _silent_outcome(self, silent: list[int], seconds: float) -> Outcome:
        dead = [r for r in silent if not self._procs[r].is_alive()]
        logs = "\n".join(f"rank {r}: {_tail(self._log(r), 8)}" for r in silent if _tail(self._log(r), 8))
        if dead:
            what = ", ".join(f"rank {r} {_status(self._procs[r].exitcode)}" for r in dead)
            return Outcome(
                "crash", reason=f"{what} during the call; the group was restarted", seconds=seconds, log=logs
            )
        ranks = ", ".join(map(str, silent))
        limit = f"{self.timeout:g} s" if self.timeout is not None else "its grace period"
        reason = f"timed out after {limit}: rank {ranks} gave no answer; the group was killed and restarted"
        return Outcome("timeout", reason=reason, seconds=seconds, log=logs)

    def unsupported(self, case: Case) -> str | None:
        """Why the group cannot run ``case``: another world size, heads not divisible by it, or the backend's own
        reason (asked on rank 0)."""
        n = case.params.get("world_size")
        if case.op in DECODES and n != self.world_size:
            return f"a case of N_cp={n} on a group of {self.world_size} processes (--dcp {n} runs it)"
        if case.op in DECODES and case.params["H_q"] % self.world_size:
            return f"H_q={case.params['H_q']} is not divisible by N_cp={n}: the combine scatters heads over the ranks"
        if not self._has_unsupported:
            return None
        self._send_all(("skip", _case_dict(case)), range(1))
        reply = self._gather(self.timeout, ranks=range(1))[0]
        if reply is None or reply[0] == "error":
            raise RuntimeError(f"unsupported(case) on rank 0: {reply[1] if reply else self._silence(0)}")
        return reply[1]

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("stop",))
        for proc in self._procs:
            proc.join(5)
        self._kill()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
