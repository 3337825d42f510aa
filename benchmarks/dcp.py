"""Decode context parallelism on ``N`` GPUs against one: our Triton decode, long contexts, small batches.

One process per GPU in an NCCL group (NVLink multicast off, :data:`mlaspec.conformance.distributed.NO_MULTICAST`).
For each ``(B, S_kv)`` every rank times, with the same fixed number of steps (a collective inside a timer that picks
its own repetitions would deadlock):

* **1 GPU**: the Triton paged decode (:func:`mlaspec.impl.decode.mla_decode_paged`) over all ``S_kv`` keys of
  each request, on its own GPU, as a single-GPU server runs it;
* **DCP N**: the same kernel over the rank's ``S_kv / N`` keys, then the combine our Triton adapter runs under
  ``mlaspec check --backend triton --dcp N``: vLLM's all-to-all of the head slices of the partials and their LSEs
  (``vllm/v1/attention/ops/dcp_alltoall.py``) and our Triton combine (``impl/dcp.py``)
  (:func:`mlaspec.conformance.distributed.combine_over_group`), leaving each rank ``H_q / N`` heads, as vLLM's
  attention layer does before its output projection;
* **collectives**: the DCP step minus its decode, the combine's share of the step.

Each is timed as a CUDA-graph replay, the decode's launches and the collectives in one graph a rank (NCCL
collectives are captured as every rank's graph issues the same sequence), as the single-GPU rows of the suite
and as vLLM serves decode: an eager step would time the host's launches (~300 us of Python and NCCL calls on the
H100 pair, 2026-11-27) rather than the GPUs. Where capture fails the eager step is timed and the rows say so (their
``timer``). Each step starts on every rank at once (a barrier), so a rank's time includes its wait for the slowest;
the table takes the slowest rank's median. Throughput is ``B / time`` (requests decoded per second); the speed-up is the
1-GPU time over the DCP time, both from this run. The counts (``bytes``: the cache read once, the whole batch over
all GPUs; ``flops``: ``2 B H_q S_kv (576 + 512)``) are those of ``benchmarks/decode.py``.

    python benchmarks/dcp.py --out-dir docs/bench                  # B 1-4, 128K-1M keys, 2 GPUs: docs/bench/dcp2.md
    python benchmarks/dcp.py --world-size 4 --out-dir docs/bench   # 4 GPUs: docs/bench/dcp4.md

Needs ``N`` GPUs; with fewer it says so and exits 0 (nothing timed). Goal (issue 20): at two GPUs, >= 1.8x the
1-GPU throughput at the longest contexts. Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
from pathlib import Path

import torch
from common import Row, environment, markdown_table, plot_bars
from decode import D_QK, D_V, _fn, make_problem

KERNEL = "dcp_decode"
TIMERS = {"graph": "CUDA-graph replays", "steps": "eager steps (a capture failed)"}
SCALE = 192**-0.5


def _steps(fn, *, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` steps, each started on every rank together (fixed counts: the
    ranks' collectives must pair up)."""
    import torch.distributed as dist

    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def _graphed(fn, *, warmup: int):
    """``(replay, "graph")``: ``fn`` captured in a CUDA graph after ``warmup`` calls on a side stream (every rank
    captures the same collectives); ``(fn, "steps")`` where capture fails on any rank."""
    import torch.distributed as dist

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        ok = True
    except RuntimeError as exc:  # e.g. a collective this NCCL cannot capture: time the eager step instead
        print(f"  capture failed, timing eager steps: {exc}", flush=True)
        ok = False
    flag = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item():
        return fn, "steps"

    def replay(fn=fn):  # holds fn, and so the inputs the graph reads: freed, their memory is reused under it
        graph.replay()

    return replay, "graph"


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank_rows(rank: int, args) -> list[Row]:
    """This rank's share of every measurement; the times are the slowest rank's."""
    from mlaspec.conformance.backends.triton import TritonBackend
    from mlaspec.conformance.distributed import combine_over_group

    n, device, combine = args.world_size, torch.device("cuda", rank), TritonBackend().dcp_combine
    rows = []
    for B, S_kv in itertools.product(args.batches, args.contexts):
        shape = dict(H=args.heads, B=B, S_kv=S_kv)
        nbytes, flops = B * S_kv * D_QK * 2, 2 * B * args.heads * S_kv * (D_QK + D_V)
        q = torch.randn(B, 1, args.heads, D_QK, device=device, dtype=torch.bfloat16)
        whole, timer = _graphed(
            _fn("triton", None, q, *make_problem(B, S_kv, device, seed=rank), S_kv, SCALE, None), warmup=args.warmup
        )
        one = _slowest(_steps(whole, iters=args.iters))
        whole = None  # free the whole cache (and its graph) before the share's
        torch.cuda.empty_cache()
        s_loc = -(-S_kv // n)  # the first rank's share, the largest (dcp_local_seq_lens)
        part = _fn("triton", None, q, *make_problem(B, s_loc, device, seed=rank), s_loc, SCALE, None)

        def step(part=part):
            out, lse = part()
            return combine_over_group(out, lse, combine)

        decode = _slowest(_steps(_graphed(part, warmup=args.warmup)[0], iters=args.iters))
        dcp_step, dcp_timer = _graphed(step, warmup=args.warmup)
        dcp = _slowest(_steps(dcp_step, iters=args.iters))
        rows += [
            Row(KERNEL, "triton 1 GPU", shape, one, nbytes, flops, timer),
            Row(KERNEL, f"triton DCP{n}", shape, dcp, nbytes, flops, dcp_timer),
            # the step's time beyond its decode; 0 where the two are within noise (no bytes: its GB/s is 0)
            Row(KERNEL, f"triton DCP{n} collectives", shape, max(dcp - decode, 0.0), 0.0, 0.0, dcp_timer),
        ]
        if rank == 0:
            times = f"1 GPU {one * 1e6:.0f} us, DCP{n} {dcp * 1e6:.0f} us (decode {decode * 1e6:.0f} us)"
            print(f"  B={B} S_kv={S_kv}: {times}", flush=True)
        part = q = dcp_step = None
        torch.cuda.empty_cache()
    return rows


def _rank_main(rank: int, args) -> None:  # one process per GPU (torch.multiprocessing.spawn)
    import torch.distributed as dist

    from mlaspec.conformance.distributed import NO_MULTICAST

    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=600),
        device_id=torch.device("cuda", rank),
    )
    try:
        rows = _rank_rows(rank, args)
        if rank == 0:
            write(rows, args)
    finally:
        dist.destroy_process_group()


def speedup_table(rows: list[Row], n: int) -> str:
    """Per shape: 1-GPU and DCP throughput (requests/s), the speed-up, and the collectives' share of the DCP step."""
    by = {(r.provider, tuple(r.shape.items())): r for r in rows}
    lines = [
        f"| B | S_kv | 1 GPU req/s | DCP{n} req/s | speed-up | collectives µs | collectives share |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in dict.fromkeys(tuple(r.shape.items()) for r in rows):
        one, dcp = by[("triton 1 GPU", key)], by[(f"triton DCP{n}", key)]
        coll = by[(f"triton DCP{n} collectives", key)]
        b, s_kv = dict(key)["B"], dict(key)["S_kv"]
        lines.append(
            f"| {b} | {s_kv} | {b / one.seconds:.0f} | {b / dcp.seconds:.0f} | {one.seconds / dcp.seconds:.2f}x "
            f"| {coll.us:.0f} | {coll.seconds / dcp.seconds:.0%} |"
        )
    return "\n".join(lines)


def write(rows: list[Row], args) -> None:
    """Print the tables; with ``--out-dir``, write ``dcp<N>.md``, ``dcp<N>.json`` and ``dcp<N>.png`` there."""
    n, env = args.world_size, environment()
    versions = f"driver {env.get('driver', '?')}, torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}"
    text = (
        f"# DCP decode: {n} GPUs against 1 ({env.get('gpu')}, H_q={args.heads}, bf16, page 64)\n\n"
        f"{versions}; timed as {' and '.join(sorted({TIMERS[r.timer] for r in rows}))}. Written by "
        f"`python benchmarks/dcp.py --world-size {n} --out-dir DIR` (its "
        "docstring says what is timed).\n\n"
        + speedup_table(rows, n)
        + "\n\n"
        + markdown_table(rows, {KERNEL: "triton 1 GPU"})
        + "\n"
    )
    print(text)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"dcp{n}.md").write_text(text)
        data = {"environment": env, "rows": [r.as_dict() for r in rows]}
        (out / f"dcp{n}.json").write_text(json.dumps(data, indent=1))
        plot_bars(rows, str(out / f"dcp{n}.png"), title=f"MLA decode, {n} GPUs (DCP) against 1, H_q={args.heads}")


def main(argv: list[str] | None = None) -> int:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description="DCP decode on N GPUs against one GPU (our Triton kernels)")
    parser.add_argument("--world-size", type=int, default=2, help="GPUs of the DCP group (default 2)")
    parser.add_argument("--batches", type=ints, default=[1, 2, 4])
    parser.add_argument("--contexts", type=ints, default=[131072, 262144, 524288, 1048576])
    parser.add_argument("--heads", type=int, default=128, help="H_q per rank (DeepSeek V3 at TP1: 128)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out-dir", help="write dcp<N>.md, dcp<N>.json and dcp<N>.png here (e.g. docs/bench)")
    args = parser.parse_args(argv)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < args.world_size:
        print(f"benchmarks/dcp.py: skipped: DCP over {args.world_size} GPUs needs as many, this machine has {have}")
        return 0
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        args.port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(args,), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
