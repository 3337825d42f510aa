"""Paged MLA decode: the Triton kernel against FlashMLA and eager torch, with the card's roofline.

For each ``(H_q, B, S_kv)`` it times one decode step (``S_q`` query tokens per sequence, a 64-slot paged bf16
cache with shuffled pages) and prints microseconds, GB/s and TFLOP/s per provider, then writes a plot of the
achieved bandwidth against the measured copy bandwidth. The counts, per step::

    bytes = B * S_kv * 576 * 2          # the cache, each entry read once (the traffic that matters)
          + B * S_q * H_q * 576 * 2     # q
          + B * S_q * H_q * 512 * 2     # out
    flops = 2 * B * S_q * H_q * S_kv * (576 + 512)     # q k^T and p v (causal MTP masks a few more: ignored)

Roofline: ``time >= max(bytes / copy bandwidth, flops / bf16 matmul rate)``, both measured here first (a large
device-to-device copy; an 8192^3 bf16 matmul). Providers: ``triton`` (:mod:`mlaspec.impl.decode`), ``flashmla``
(``flash_mla.flash_mla_with_kvcache`` with ``get_mla_metadata``, skipped with a note when not installed), ``torch``
(gather the pages, fp32 logits, softmax, bf16 ``P @ V``; skipped above ``--torch-max-gb`` of temporaries).

    python benchmarks/decode.py                                  # the full sweep, ~3 minutes on an H200
    python benchmarks/decode.py --batches 1,64 --contexts 4096 --heads 128 --s-q 2 --out mtp.png

Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch

D_QK, D_V, PAGE = 576, 512, 64


GRAPHS = True  # set by --no-graphs


def _bench(fn: Callable[[], object], *, graph: bool | None = None) -> float:
    """Median seconds of ``fn``: replayed from a CUDA graph (as serving runs decode; no Python launch overhead,
    L2 not flushed, so caches under ~50 MB partly hit L2), or with ``--no-graphs`` by ``do_bench`` (L2 flushed,
    launch overhead included)."""
    import triton.testing

    if GRAPHS if graph is None else graph:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e-3
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


def measure_roofline(device: torch.device) -> tuple[float, float]:
    """``(copy bytes/s, bf16 matmul FLOP/s)`` of this card: a 2 GiB device-to-device copy (read + write counted)
    and an 8192^3 bf16 matmul on random data."""
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB
    src = torch.empty(n, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 2 / _bench(lambda: dst.copy_(src), graph=False)  # large: launch cost is noise
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm = 2 * 8192**3 / _bench(lambda: a @ b, graph=False)
    return copy_bw, mm


def make_problem(B: int, S_kv: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A shuffled paged cache for ``B`` sequences of ``S_kv`` keys: ``(cache, block_table, seq_lens)``."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = math.ceil(S_kv / PAGE)
    num_pages = B * pages
    cache = torch.randn(num_pages, PAGE, 1, D_QK, generator=g, device=device, dtype=dtype)  # 4-D, as FlashMLA
    block_table = torch.randperm(num_pages, generator=g, device=device).view(B, pages).to(torch.int32)
    seq_lens = torch.full((B,), S_kv, dtype=torch.int32, device=device)
    return cache, block_table, seq_lens


def torch_decode(q, cache, block_table, seq_lens, S_kv: int, scale: float):
    """Eager reference: gather the pages, fp32 logits and softmax, P in bf16 for P @ V (causal, MTP-aligned)."""
    B, S_q, H, _ = q.shape
    kv = cache[block_table.long()].view(B, -1, D_QK)[:, :S_kv]  # [B, S_kv, 576]: read + write the whole cache
    s = torch.einsum("bqhd,bkd->bhqk", q.float(), kv.float()) * scale  # [B, H, S_q, S_kv] fp32
    i = torch.arange(S_q, device=q.device)[:, None]
    j = torch.arange(S_kv, device=q.device)[None, :]
    s = s.masked_fill(j > i + S_kv - S_q, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).to(q.dtype)
    return torch.einsum("bhqk,bkd->bqhd", p, kv[..., :D_V]), lse


def _flashmla():
    """``(flash_mla_with_kvcache, get_mla_metadata)`` or a note saying why not."""
    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    except Exception as exc:  # noqa: BLE001 - absent, or built for another card / torch
        return None, f"FlashMLA not available ({type(exc).__name__}: {exc})"
    return (flash_mla_with_kvcache, get_mla_metadata), ""


def _flashmla_call(fm, q, cache, block_table, seq_lens, scale):
    flash_mla_with_kvcache, get_mla_metadata = fm
    S_q, H = q.shape[1], q.shape[2]
    try:  # FlashMLA <= 2025-08: metadata from the lengths
        meta, splits = get_mla_metadata(seq_lens, S_q * H, 1)
    except TypeError:  # later: the metadata is filled on first use
        meta, splits = get_mla_metadata(), None
    return lambda: flash_mla_with_kvcache(q, cache, block_table, seq_lens, D_V, meta, splits,
                                          softmax_scale=scale, causal=True)  # fmt: skip


def run(args) -> list[dict]:
    from mlaspec.impl.decode import mla_decode_paged

    device = torch.device("cuda")
    dtype = torch.bfloat16
    copy_bw, mm_rate = measure_roofline(device)
    print(f"{torch.cuda.get_device_name(device)}: copy {copy_bw / 1e9:.0f} GB/s, bf16 matmul {mm_rate / 1e12:.0f} "
          f"TFLOP/s (ridge {mm_rate / copy_bw:.0f} FLOP/byte)")  # fmt: skip
    fm, note = _flashmla()
    if note:
        print(note + ": its column is left out")
    providers = [p for p in args.providers.split(",") if p != "flashmla" or fm is not None]
    scale = 192**-0.5
    rows = []
    head = f"{'H_q':>4} {'B':>4} {'S_kv':>6} {'roof us':>8}"
    print(head + "".join(f" | {p + ' us':>11} {'GB/s':>6} {'TF/s':>5} {'%roof':>5}" for p in providers))
    for B in args.batches:
        for S_kv in args.contexts:
            cache, block_table, seq_lens = make_problem(B, S_kv, device, dtype)
            cache3 = cache.view(-1, PAGE, D_QK)
            for H in args.heads:
                q = torch.randn(B, args.s_q, H, D_QK, device=device, dtype=dtype)
                nbytes = 2 * (B * S_kv * D_QK + B * args.s_q * H * (D_QK + D_V))
                flops = 2 * B * args.s_q * H * S_kv * (D_QK + D_V)
                roof = max(nbytes / copy_bw, flops / mm_rate)
                row = dict(H=H, B=B, S_kv=S_kv, bytes=nbytes, flops=flops, roof=roof)
                for p in providers:
                    if p == "triton":
                        def fn(q=q, cache3=cache3, block_table=block_table, seq_lens=seq_lens, S_kv=S_kv):
                            return mla_decode_paged(q, cache3, block_table, seq_lens, d_v=D_V, scale=scale,
                                                    causal=True, max_seq_len=S_kv)
                    elif p == "flashmla":
                        fn = _flashmla_call(fm, q, cache, block_table, seq_lens, scale)
                    elif p == "torch":
                        if B * S_kv * D_QK * 6 + B * H * args.s_q * S_kv * 4 * 3 > args.torch_max_gb * 1e9:
                            row[p] = math.nan
                            continue
                        fn = lambda: torch_decode(q, cache3, block_table, seq_lens, S_kv, scale)  # noqa: E731
                    else:
                        raise ValueError(f"unknown provider {p!r}")
                    try:
                        row[p] = _bench(fn)
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"  {p} failed at H={H} B={B} S_kv={S_kv}: {type(exc).__name__}: {exc}")
                        row[p] = math.nan
                rows.append(row)
                line = f"{H:>4} {B:>4} {S_kv:>6} {roof * 1e6:8.1f}"
                for p in providers:
                    t = row.get(p, math.nan)
                    line += (f" | {t * 1e6:11.1f} {nbytes / t / 1e9:6.0f} {flops / t / 1e12:5.1f} {100 * roof / t:5.0f}"
                             if t == t else f" | {'-':>11} {'-':>6} {'-':>5} {'-':>5}")  # fmt: skip
                print(line, flush=True)
                del q
            del cache, cache3, block_table, seq_lens
            torch.cuda.empty_cache()
    for r in rows:
        r["copy_bw"], r["mm_rate"] = copy_bw, mm_rate
    return rows


def plot(rows: list[dict], providers: list[str], path: str) -> None:
    """Achieved GB/s against context, one panel per head count, the copy bandwidth as the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = sorted({r["H"] for r in rows})
    batches = sorted({r["B"] for r in rows})
    fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 4.5), squeeze=False, sharey=True)
    styles = {"triton": "-o", "flashmla": "--s", "torch": ":x"}
    cmap = plt.get_cmap("viridis")
    for ax, H in zip(axes[0], heads):
        for bi, B in enumerate(batches):
            sel = sorted((r for r in rows if r["H"] == H and r["B"] == B), key=lambda r: r["S_kv"])
            for p in providers:
                xs = [r["S_kv"] for r in sel if r.get(p, math.nan) == r.get(p, math.nan)]
                ys = [r["bytes"] / r[p] / 1e9 for r in sel if r.get(p, math.nan) == r.get(p, math.nan)]
                if xs:
                    ax.plot(xs, ys, styles.get(p, "-"), color=cmap(bi / max(1, len(batches) - 1)),
                            label=f"{p} B={B}", ms=4)  # fmt: skip
        ax.axhline(rows[0]["copy_bw"] / 1e9, color="k", lw=1, ls="--", label="copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context S_kv (keys)")
        ax.set_title(f"MLA decode, H_q={H}, bf16, page 64")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s (cache + q + out)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description="Paged MLA decode benchmark (triton vs FlashMLA vs torch)")
    parser.add_argument("--batches", type=ints, default=[1, 8, 32, 128])
    parser.add_argument("--contexts", type=ints, default=[1024, 4096, 16384, 65536])
    parser.add_argument("--heads", type=ints, default=[16, 128])
    parser.add_argument("--s-q", type=int, default=1, help="query tokens per sequence (MTP: 2..4)")
    parser.add_argument("--providers", default="triton,flashmla,torch")
    parser.add_argument("--torch-max-gb", type=float, default=8.0, help="skip torch above this many GB of temporaries")
    parser.add_argument("--out", default="decode_bench.png")
    parser.add_argument("--no-graphs", action="store_true", help="time launches from Python, not graph replays")
    args = parser.parse_args(argv)
    global GRAPHS
    GRAPHS = not args.no_graphs
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    rows = run(args)
    providers = [p for p in args.providers.split(",") if any(p in r for r in rows)]
    plot(rows, providers, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
