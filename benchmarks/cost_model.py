"""The cost model of MLA's two forms as a table and a plot; no GPU, only :mod:`mlaspec.spec.cost`.

For each ``(S_q, S_kv, B, N)`` it prints the FLOPs, bytes and roofline time of the compute-friendly (``mha``) and
the absorbed form, and which wins; then the crossover query length per ``S_kv``; then writes the crossover plot::

    python benchmarks/cost_model.py --out cost_crossover.png
    python benchmarks/cost_model.py --heads 16 --batch 64 --causal --peak-flops 989e12 --bandwidth 4.8e12

Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterable, Sequence

import torch

from mlaspec.spec.config import MLAConfig
from mlaspec.spec.cost import H200_BANDWIDTH, H200_PEAK_FLOPS, crossover, mla_cost, time_estimate

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:7.2f} {prefix}{unit}"
    return f"{x:7.2f}  {unit}"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:10.2f} us"


def cost_table(
    s_q_values: Iterable[int],
    s_kv_values: Iterable[int],
    batches: Iterable[int],
    heads: Iterable[int],
    *,
    dtype: torch.dtype = torch.bfloat16,
    config: MLAConfig | None = None,
    causal: bool = False,
    peak_flops: float = H200_PEAK_FLOPS,
    bandwidth: float = H200_BANDWIDTH,
) -> list[str]:
    """Lines of the table: one row per ``(S_q, S_kv, B, N)`` with ``S_q <= S_kv``."""
    header = (
        f"{'S_q':>6} {'S_kv':>7} {'B':>4} {'N':>4} | {'mha FLOPs':>12} {'mha bytes':>11} {'mha time':>13} | "
        f"{'abs FLOPs':>12} {'abs bytes':>11} {'abs time':>13} | winner"
    )
    lines = [header, "-" * len(header)]
    for s_kv, s_q, b, n in itertools.product(s_kv_values, s_q_values, batches, heads):
        if s_q > s_kv:
            continue
        row = f"{s_q:>6} {s_kv:>7} {b:>4} {n:>4} |"
        times = {}
        for form in ("mha", "absorbed"):
            cost = mla_cost(form, b, s_q, s_kv, num_heads=n, dtype=dtype, config=config, causal=causal)
            est = time_estimate(cost, peak_flops, bandwidth)
            times[form] = est.seconds
            row += f" {_si(cost.flops, 'F')} {_si(cost.bytes, 'B')} {_us(est.seconds)} {est.bound[0]}|"
        winner = min(times, key=times.get)
        lines.append(f"{row} {winner} ({max(times.values()) / min(times.values()):.1f}x)")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="cost_crossover.png", help="where to write the crossover plot (PNG)")
    parser.add_argument("--s-q", type=int, nargs="+", default=[1, 2, 4, 16, 64, 128, 256, 1024, 8192])
    parser.add_argument("--s-kv", type=int, nargs="+", default=[1024, 8192, 65536])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--heads", type=int, nargs="+", default=[128], help="N per GPU (128 at TP1, 16 at TP8)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--causal", action="store_true", help="count only the pairs the causal mask keeps")
    parser.add_argument("--peak-flops", type=float, default=H200_PEAK_FLOPS, help="FLOP/s (default: H200, measured)")
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="bytes/s (default: H200, measured)")
    args = parser.parse_args(argv)
    roof = dict(peak_flops=args.peak_flops, bandwidth=args.bandwidth)
    dtype = DTYPES[args.dtype]

    print(
        f"MLA attention (DeepSeek-V3 dims), {args.dtype}, roofline {args.peak_flops:.3g} FLOP/s, "
        f"{args.bandwidth:.3g} B/s; time column ends in c/m = compute/memory bound"
    )
    for line in cost_table(args.s_q, args.s_kv, args.batch, args.heads, dtype=dtype, causal=args.causal, **roof):
        print(line)
    print("\ncrossover: smallest S_q where mha is faster")
    for s_kv, b, n in itertools.product(args.s_kv, args.batch, args.heads):
        x = crossover(s_kv, batch=b, num_heads=n, dtype=dtype, causal=args.causal, **roof)
        print(f"  S_kv={s_kv:>7} B={b:>4} N={n:>4}: S_q* = {x.s_q if x.s_q is not None else 'never (<= S_kv)'}")

    import matplotlib

    matplotlib.use("Agg")
    from mlaspec.conformance.viz.cost import draw_cost_crossover

    fig = draw_cost_crossover(
        args.s_kv, batch=args.batch[0], num_heads=args.heads[0], dtype=dtype, causal=args.causal, **roof
    )
    fig.savefig(args.out, dpi=110)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
