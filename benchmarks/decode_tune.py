"""Sweep the Triton decode's tile, pipeline depth and split count on a few shapes; print each shape's best.

:func:`mlaspec.impl.decode.decode_config` and :func:`~mlaspec.impl.decode.num_splits_heuristic` choose these for
every shape; this script is how their choices were measured (FlashMLA timed alongside, in the same run, where it
imports). Times are CUDA-graph replays (:func:`common.bench`), problems as :mod:`decode` builds them.

    python benchmarks/decode_tune.py --shapes 16x1x65536,128x1x65536 --out /tmp/tune.json
    python benchmarks/decode_tune.py --shapes 16x1x65536 --block-n 32,64 --stages 2,5 --waves 1,2,4
    python benchmarks/decode_tune.py --fp8 --block-n 32,64 --stages 2,5,7   # vLLM's per-tensor fp8 cache
    python benchmarks/decode_tune.py --shapes 128x1x65536 --kernels triton,sm90 --block-n 64 --stages 2 --warps 8
    python benchmarks/decode_tune.py --fp8 --as-called --kernels triton,sm90 --shapes 16x1x1024,16x64x1024

``--kernels``: which split kernel runs a config (``mla_decode_paged``'s ``kernel``): ``auto`` (default) and
``triton`` the readable one (a tile override keeps it), ``sm90`` the Gluon one (:mod:`mlaspec.impl.decode_sm90`;
64 x 64 tiles only, stages and warps ignored). Each row's ``default_us`` is the call without a config, as served.
``--as-called``: each kernel as ``auto`` would call it (its own tile and split count, no config): both sides of a
choice between two kernels (``--kernels auto,triton``: at 16 heads the keys kernels against the readable one, the
measurement that moved the fp8 cache at 16-32 rows and a 16-bit cache at 16 rows to the Gluon kernels).

Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
from common import bench, load_flashmla, load_flashmla_fp8
from decode import D_QK, D_V, PAGE, _fn, make_problem


def tune(
    shape, *, block_ns, stages, warps, waves, block_ms=(None,), kernels=("auto",), fp8=False, fm=None, as_called=False
) -> list[dict]:
    """Time every config on one ``(H, B, S_kv)``; rows sorted fastest first, FlashMLA's and the default config's
    times in each row. ``waves``: programs per SM, from which the split count follows; ``block_ms``: query rows per
    program (None: :func:`~mlaspec.impl.decode.decode_config`'s); ``kernels``: ``mla_decode_paged``'s ``kernel``;
    ``fp8``: vLLM's per-tensor e4m3 cache (FlashMLA:
    its dense fp8 decode, ``fm`` the extension); ``as_called``: each kernel with no config (the tile arguments
    ignored)."""
    from mlaspec.impl.decode import DecodeConfig, decode_config, mla_decode_paged

    H, B, S_kv = shape
    dev = torch.device("cuda")
    cache, block_table, seq_lens = make_problem(B, S_kv, dev, fp8=fp8)
    q = torch.randn(B, 1, H, D_QK, device=dev, dtype=torch.bfloat16)
    scale, cache3, k_scale = 192**-0.5, cache.view(-1, PAGE, D_QK), 0.5 if fp8 else None
    nbytes = B * S_kv * D_QK * (1 if fp8 else 2) + 2 * B * H * (D_QK + D_V)
    base = decode_config(H, PAGE, torch.bfloat16, fp8)
    problem = (q, cache, block_table, seq_lens, S_kv, scale, k_scale)
    flashmla = bench(_fn("flashmla", fm, *problem), graph=True) if fm else float("nan")
    default = bench(_fn("triton", fm, *problem), graph=True)
    call = functools.partial(mla_decode_paged, q, cache3, block_table, seq_lens, scale=scale, k_scale=k_scale)
    rows, sms = [], torch.cuda.get_device_properties(dev).multi_processor_count
    configs = itertools.product(kernels, block_ms, block_ns, stages, warps, waves)
    for kernel, bm, bn, st, w, wv in ((k, *(None,) * 5) for k in kernels) if as_called else configs:
        bm = bm or base.block_m
        sp = None if as_called else max(1, wv * sms // (B * -(-H // bm)))  # wv programs per SM
        cfg = None if as_called else DecodeConfig(bm, bn, w, st)
        fn = functools.partial(call, max_seq_len=S_kv, num_splits=sp, config=cfg, kernel=kernel)
        try:
            # once outside the graph first: a config that fails must fail here, not inside a capture (a capture that
            # raises leaves the CUDA RNG mid-capture, and the next shape's randn fails; seen on the H200)
            fn()
            t = bench(fn, graph=True)
        except Exception as exc:  # out of shared memory, or a config the compiler rejects: noted, the sweep goes on
            print(f"  {shape} {cfg} splits={sp}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
            continue
        config = dict(kernel=kernel, block_m=bm, block_n=bn, stages=st, warps=w, splits=sp, waves=wv, fp8=fp8)
        rows.append(dict(H=H, B=B, S_kv=S_kv, **config, us=t * 1e6, gbps=nbytes / t / 1e9))
        rows[-1].update(flashmla_us=flashmla * 1e6, default_us=default * 1e6)
        print(f"  {shape} {kernel} bm={bm} bn={bn} st={st} w={w} splits={sp}: {t * 1e6:7.1f} us", flush=True)
    return sorted(rows, key=lambda r: r["us"])


def main(argv: list[str] | None = None) -> int:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16x1x65536,16x1x131072,16x2x65536,128x1x65536,128x2x32768")
    parser.add_argument("--block-m", type=ints, help="query rows per program (default: decode_config's)")
    parser.add_argument("--block-n", type=ints, default=[32, 64])
    parser.add_argument("--stages", type=ints, default=[2, 5])
    parser.add_argument("--warps", type=ints, default=[4, 8])
    parser.add_argument("--waves", type=ints, default=[1, 2], help="programs per SM (the split count follows)")
    parser.add_argument("--kernels", default="auto", help="split kernels to time: auto, triton, sm90 (comma-separated)")
    parser.add_argument("--fp8", action="store_true", help="vLLM's per-tensor fp8 cache (FlashMLA: its fp8 decode)")
    parser.add_argument("--as-called", action="store_true", help="each kernel with its own tile and splits (no config)")
    parser.add_argument("--out", default="decode_tune.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    fm = load_flashmla_fp8() if args.fp8 else load_flashmla()
    results = []
    for text in args.shapes.split(","):
        shape = tuple(int(x) for x in text.split("x"))
        tiles = dict(block_ns=args.block_n, stages=args.stages, warps=args.warps, waves=args.waves)
        tiles.update(block_ms=args.block_m or (None,), kernels=args.kernels.split(","))
        rows = tune(shape, **tiles, fp8=args.fp8, fm=fm, as_called=args.as_called)
        results += rows
        for r in rows[:5]:
            print(f"best {shape}: {r}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
