"""Adapters that misbehave the ways a real backend can, each wrapped around the CPU ``torch`` backend and doing its
mischief in ``attention`` only, on the case named ``BAD`` (every other case is the honest backend's).

Loaded by ``module:attr`` from a worker process (``tests/test_isolation.py`` puts this folder on the path), as a
kernel author's adapter would be. ``spin`` calls a C function compiled at test time that spins with every signal
blocked, so no Python-level timeout (SIGALRM) can stop it: only killing the process can.
"""

import ctypes
import os
import sys

import torch
from heap_probe import heap_kept

from mlaspec.conformance.backends.torch_eager import TorchBackend

BAD = "gqa-noncausal"  # the case each adapter misbehaves on (attention[gqa-noncausal-<dtype>])


class _Misbehaving(TorchBackend):
    def attention(self, q, k, v, **kw):
        if q.shape[2] == 6:  # gqa-noncausal is the only attention case with 6 query heads
            return self.misbehave(q, k, v, **kw)
        return super().attention(q, k, v, **kw)

    def misbehave(self, q, k, v, **kw):
        return self.honest(q, k, v, **kw)  # the well-behaved adapter (``_Misbehaving`` itself)

    def honest(self, q, k, v, **kw):
        return TorchBackend.attention(self, q, k, v, **kw)


class SysExit(_Misbehaving):
    def misbehave(self, q, k, v, **kw):
        sys.exit(0)


class OsExit(_Misbehaving):
    def misbehave(self, q, k, v, **kw):
        os._exit(0)


class Segfault(_Misbehaving):
    def misbehave(self, q, k, v, **kw):
        ctypes.string_at(0)  # reads address 0: SIGSEGV


class Spin(_Misbehaving):
    def misbehave(self, q, k, v, **kw):
        ctypes.CDLL(os.environ["MLASPEC_TEST_SPIN_LIB"]).spin()


class MetaOutput(_Misbehaving):
    def misbehave(self, q, k, v, **kw):
        out, lse = self.honest(q, k, v, **kw)
        return out.to("meta"), lse


class NotATensor(_Misbehaving):
    def misbehave(self, q, k, v, **kw):
        out, lse = self.honest(q, k, v, **kw)
        return out, None


class SparseOutput(_Misbehaving):
    def misbehave(self, q, k, v, **kw):
        out, lse = self.honest(q, k, v, **kw)
        return out.to_sparse(), lse


class WritesInput(_Misbehaving):
    def misbehave(self, q, k, v, **kw):
        out, lse = self.honest(q, k, v, **kw)
        k.zero_()  # scribbles over its input after using it: the output is right
        return out, lse


class AliasesInput(_Misbehaving):
    def misbehave(self, q, k, v, **kw):
        out, lse = self.honest(q, k, v, **kw)
        if out.shape == q[..., : out.shape[-1]].shape:
            q[..., : out.shape[-1]] = out  # returns its output in the input's memory
            return q[..., : out.shape[-1]], lse
        return out, lse


class HugeAllocation(_Misbehaving):
    def misbehave(self, q, k, v, **kw):
        torch.empty(1 << 62, dtype=torch.uint8)  # raises: more memory than any machine has


class FailsToImport:
    def __init__(self):
        raise ImportError("the adapter's kernels are not built")


SPIN_C = """
#include <signal.h>
void spin(void) {
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, 0);
    for (volatile unsigned long i = 0;; ++i) {}
}
"""


class Unavailable(TorchBackend):
    unavailable = "needs a device this machine does not have"


class CudaIllegalAccess(_Misbehaving):
    """A device-side out-of-bounds index: the CUDA context of the process is lost (GPU only)."""

    def misbehave(self, q, k, v, **kw):
        x = torch.zeros(4, device="cuda")
        x[torch.tensor([1 << 40], device="cuda")] += 1
        torch.cuda.synchronize()
        return self.honest(q, k, v, **kw)


# -- DCP ranks (``mlaspec check --dcp 2``): rank 1 misbehaves in ``mla_decode`` on ``BAD_DCP`` --------------------
BAD_DCP = "length-1-dcp2"  # dcp_decode[length-1-dcp2-<dtype>]: B = 3 requests of one key, the only such shard


class _MisbehavingRank(TorchBackend):
    def mla_decode(self, q, kv, **kw):
        import torch.distributed as dist

        if kv.shape[:2] == (3, 1) and dist.is_initialized() and dist.get_rank() == 1:
            return self.misbehave(q, kv, **kw)
        return super().mla_decode(q, kv, **kw)


class RankRaises(_MisbehavingRank):
    def misbehave(self, q, kv, **kw):
        raise RuntimeError("rank one's kernel refused the shard")


class RankDies(_MisbehavingRank):
    def misbehave(self, q, kv, **kw):
        os._exit(3)


class RankHangs(_MisbehavingRank):
    def misbehave(self, q, kv, **kw):
        import time

        time.sleep(3600)  # rank 0 waits in the group's collective meanwhile


class RankLosesItsDevice(_MisbehavingRank):
    """As FlashMLA's fp8 decode on an idle rank (H200 pair, 2026-11-27): an illegal memory access breaks the rank's
    CUDA context, so its decode raises and so does every collective after it; rank 0 is left waiting."""

    def misbehave(self, q, kv, **kw):
        import torch.distributed as dist

        def lost(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        dist.all_reduce = dist.all_gather_into_tensor = dist.all_to_all_single = lost
        lost()


class ThreadsAsShared(TorchBackend):
    """Honest, but its decode refuses to run on other torch threads than the harness gives the process that runs the
    backend: the judged worker's, or each DCP rank's share (:func:`mlaspec.conformance.cpus.worker_threads`)."""

    def mla_decode(self, q, kv, **kw):
        import torch
        import torch.distributed as dist

        from mlaspec.conformance.cpus import worker_threads

        expected = worker_threads(workers=dist.get_world_size() if dist.is_initialized() else 1)
        if torch.get_num_threads() != expected:
            raise RuntimeError(f"{torch.get_num_threads()} torch threads, not the {expected} of this process's share")
        return super().mla_decode(q, kv, **kw)


class HeapKept(TorchBackend):
    """Honest, but its decode refuses to run in a process that gives the memory it frees back to the kernel: the
    run's own (``--isolation none``), the judged worker and each DCP rank keep it (:mod:`mlaspec.conformance.heap`)."""

    def mla_decode(self, q, kv, **kw):
        if not heap_kept():
            raise RuntimeError(f"process {os.getpid()} ({sys.argv[0]}) gives freed memory back to the kernel")
        return super().mla_decode(q, kv, **kw)


class WithCombine(TorchBackend):
    """Honest, with a ``dcp_combine`` of its own: the group combines by all-to-all and this (the spec's combine)."""

    def dcp_combine(self, outs, lses):
        from mlaspec.spec.dcp import dcp_combine

        got = dcp_combine(outs, lses)
        return got.out.to(outs.dtype), got.lse.float()


# -- a JIT backend in miniature (``mlaspec check --warm N``, tests/test_isolation.py) -------------------------------
def _in_warm_up() -> bool:
    return sys.argv[0] == "-c" and "mlaspec.conformance.warmup" in sys.modules  # warmup._BOOT runs it


def _wait_for(test, seconds: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not test() and time.monotonic() < deadline:
        time.sleep(0.05)


class FakeJit(TorchBackend):
    """The first ``attention`` call of a shape, in any process, "compiles" (sleeps) and leaves its kernel in the
    folder ``$MLASPEC_TEST_JIT_CACHE``: a file naming the process that built it; later calls, anywhere, find it.
    With ``$MLASPEC_TEST_JIT_WAIT`` set, the judged worker's first call waits until a warm-up process has built one
    (so that a test does not race the warm-up processes' start)."""

    jit = True

    compile_seconds = 1.5

    def attention(self, q, k, v, **kw):
        import time
        from pathlib import Path

        cache = Path(os.environ["MLASPEC_TEST_JIT_CACHE"])
        if os.environ.get("MLASPEC_TEST_JIT_WAIT") and not _in_warm_up():
            _wait_for(lambda: any(p.read_text().split()[1:] == ["-c"] for p in cache.glob("kernel-*")))
        kernel = cache / f"kernel-{q.dtype}-{'x'.join(map(str, q.shape))}"
        if not kernel.exists():
            time.sleep(self.compile_seconds)
            part = kernel.with_suffix(f".{os.getpid()}")
            part.write_text(f"{os.getpid()} {sys.argv[0]}")
            os.replace(part, kernel)
        if q.shape[2] == 6:
            self.misbehave(cache)
        return super().attention(q, k, v, **kw)

    def misbehave(self, cache):
        pass


class FakeJitHeapKept(FakeJit):
    """:class:`FakeJit` that leaves, for each process it runs a case in (the judged worker, the warm-up processes),
    a file ``heap-<pid>`` in the cache folder: whether it keeps freed memory (:func:`heap_kept`), then its script."""

    def attention(self, q, k, v, **kw):
        from pathlib import Path

        record = Path(os.environ["MLASPEC_TEST_JIT_CACHE"]) / f"heap-{os.getpid()}"
        record.write_text(f"{heap_kept()}\n{sys.argv[0]}")
        return super().attention(q, k, v, **kw)


class FakeJitDies(FakeJit):
    def misbehave(self, cache):
        os._exit(3)  # in the judged worker and in the warm-up process alike


class FakeJitHangs(FakeJit):
    def misbehave(self, cache):
        if _in_warm_up():
            (cache / "warm-up-hangs").write_text("")
            import time

            time.sleep(3600)


class FakeJitOutOfMemory(FakeJit):
    """Runs out of device memory once in the judged worker, while a warm-up process sits on the same case (with
    ``$MLASPEC_TEST_JIT_WAIT``), or on its own."""

    def misbehave(self, cache):
        import time

        if _in_warm_up():
            (cache / "warm-up-here").write_text("")
            time.sleep(3600)  # a long compile: it is still running when the judged worker comes
        if os.environ.get("MLASPEC_TEST_JIT_WAIT"):
            _wait_for(lambda: (cache / "warm-up-here").exists())
        once = cache / "out-of-memory"
        if not once.exists():
            once.write_text("")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
