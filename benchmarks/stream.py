"""A plain streaming read of a tensor's bytes: the floor under any kernel that must read those bytes once.

``benchmarks/decode.py`` times it beside each decode (provider ``read``, over the same cache, in the same run), so a
bandwidth target is judged against what the card allows at that size, not only against the 2 GiB copy of
:func:`common.measure_roofline`: a short read pays a launch, the memory system's ramp and a last wave, and on an
H200 a plain read of 75 MB reached 81% of the copy rate, of 151 MB 91% (speed log, 2026-11-25).

The kernel: each program XORs a contiguous stretch of the tensor's 32-bit words into one word (so nothing it loads
can be dropped) and stores it; :data:`CONFIGS` are the launches tried, :func:`fastest` keeps the quickest.

    from stream import fastest
    seconds, fn = fastest(cache)       # graph replays, as the decode rows

Importing this module compiles nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

# (programs an SM, 32-bit words a load step, pipeline stages, warps)
CONFIGS = ((1, 4096, 4, 8), (2, 2048, 4, 4), (4, 2048, 3, 4))


@triton.jit
def _read_kernel(X, OUT, n, chunk, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """``OUT[pid]``: the XOR of words ``[pid * chunk, (pid + 1) * chunk)`` of ``X`` (those below ``n``)."""
    pid = tl.program_id(0)
    lo = pid.to(tl.int64) * chunk
    hi = tl.minimum(lo + chunk, n)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(X + offs, mask=offs < hi, other=0)
    tl.store(OUT + pid, tl.xor_sum(acc, 0))


def reader(
    x: torch.Tensor, programs: int, block: int, stages: int, warps: int
) -> tuple[Callable[[], None], torch.Tensor]:
    """``(fn, out)``: ``fn()`` reads every byte of the contiguous ``x`` (a multiple of 4 bytes) once, with
    ``programs`` programs, each a stretch of whole ``block``-word steps; ``out [programs]`` int32 gets their XORs."""
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    nbytes = x.numel() * x.element_size()
    if nbytes % 4:
        raise ValueError(f"x must hold a multiple of 4 bytes, got {nbytes}")
    words = x.reshape(-1).view(torch.uint8).view(torch.int32)
    n = words.numel()
    chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
    out = torch.zeros(programs, dtype=torch.int32, device=x.device)

    def fn() -> None:
        _read_kernel[(programs,)](words, out, n, chunk, BLOCK=block, STAGES=stages, num_warps=warps)

    return fn, out


def fastest(x: torch.Tensor, configs=CONFIGS, *, graph: bool = True) -> tuple[float, Callable[[], None]]:
    """The quickest of ``configs`` reading ``x`` on its GPU: ``(median seconds, fn)``, timed as the decode rows are
    (``graph``: CUDA-graph replays, else ``do_bench``)."""
    from common import bench

    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    timed = []
    for per_sm, block, stages, warps in configs:
        fn, _ = reader(x, per_sm * sms, block, stages, warps)
        timed.append((bench(fn, graph=graph), fn))
    return min(timed, key=lambda t: t[0])
