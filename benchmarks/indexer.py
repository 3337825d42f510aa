"""Lightning-indexer logits and top-k: the Triton kernels against DeepGEMM and torch, on one GPU.

Prefill (ragged) logits for one causal request of ``S`` tokens (``M = N = S``, query ``i`` sees keys ``[0, i]``),
``H = 64`` heads of ``D = 128``, fp8 e4m3 q / k, then a decode-style top-k (``K = 2048``) over the rows. Counts::

    flops = 2 * H * D * sum_m (ke[m] - ks[m])        # the useful q k^T (about H D S^2)
    bytes = M * H * D + N * D + 4 * N + 4 * M * H    # fp8 q, fp8 k, k scales, weights
          + 4 * M * W                                # fp32 logits: W = N absolute columns (triton, torch),
                                                     # W = max(ke - ks) compressed columns (DeepGEMM >= 2.8)

Providers: ``triton`` (:func:`mlaspec.impl.indexer.indexer_logits`), ``deepgemm`` (``fp8_fp4_mqa_logits`` /
``fp8_mqa_logits`` through :class:`mlaspec.conformance.backends.deepgemm.DeepGEMMBackend`'s bound functions, the raw
call only, skipped with a note when not importable), ``torch`` (fp32 einsum, as vLLM's fallback). The top-k compares
:func:`mlaspec.impl.indexer.topk_indices` with ``torch.topk`` on the same logits.

    python benchmarks/indexer.py --seqs 1024,4096,8192 --out indexer.png

Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import math

import torch

H, D, K = 64, 128, 2048


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


def make_problem(S: int, device: torch.device, seed: int = 0):
    """fp8 q ``[S, H, D]``, fp8 k ``[S, D]``, fp32 scales and weights, causal spans of one request."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(S, H, D, generator=g) * 4).to(torch.float8_e4m3fn).to(device)
    k = (torch.randn(S, D, generator=g) * 4).to(torch.float8_e4m3fn).to(device)
    k_scale = torch.rand(S, generator=g).add_(0.5).to(device)
    w = (torch.randn(S, H, generator=g) * 0.01).to(device)
    ks = torch.zeros(S, dtype=torch.int32, device=device)
    ke = torch.arange(1, S + 1, dtype=torch.int32, device=device)
    return q, k, k_scale, w, ks, ke


def _deepgemm():
    try:
        from mlaspec.conformance.backends.deepgemm import DeepGEMMBackend

        return DeepGEMMBackend()
    except Exception as exc:  # noqa: BLE001 - a missing provider is a note, not a failure
        print(f"deepgemm: not available ({type(exc).__name__}: {exc})")
        return None


def run(seqs: list[int], providers: list[str]) -> list[dict]:
    from mlaspec.impl.indexer import indexer_logits, topk_indices

    dev = torch.device("cuda")
    dg = _deepgemm() if "deepgemm" in providers else None
    rows = []
    print(f"{'S':>6} | {'provider':>9} {'us':>10} {'TFLOP/s':>8} {'GB/s':>7}")
    for S in seqs:
        q, k, k_scale, w, ks, ke = make_problem(S, dev)
        flops = 2 * H * D * S * (S + 1) / 2
        base = S * H * D + S * D + 4 * S + 4 * S * H
        row = {"S": S, "flops": flops}
        for p in providers:
            if p == "triton":
                fn, width = (lambda: indexer_logits(q, k, w, ks, ke, k_scale)), S
            elif p == "deepgemm":
                if dg is None:
                    continue
                kv = (k, k_scale)
                if dg.compressed:
                    fn, width = (lambda: dg.ragged((q, None), kv, w, ks, ke, S)), S
                else:
                    fn, width = (lambda: dg.ragged(q, kv, w, ks, ke, clean_logits=True)), S
            elif p == "torch":
                if S * S * H * 4 > 20e9:
                    continue

                def fn():
                    s = torch.einsum("mhd,nd->mhn", q.float(), k.float()).relu_()
                    return torch.einsum("mhn,mh->mn", s, w) * k_scale[None, :]

                width = S
            else:
                raise ValueError(f"unknown provider {p!r}")
            try:
                t = _bench(fn)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"  {p} failed at S={S}: {type(exc).__name__}: {exc}")
                continue
            nbytes = base + 4 * S * width
            row[p] = t
            print(f"{S:>6} | {p:>9} {t * 1e6:10.1f} {flops / t / 1e12:8.1f} {nbytes / t / 1e9:7.0f}", flush=True)
        # top-k over the logits (decode-style rows: [0, ke))
        logits = indexer_logits(q, k, w, ks, ke, k_scale)
        row["topk_triton"] = _bench(lambda: topk_indices(logits, K, row_ends=ke))
        row["topk_torch"] = _bench(lambda: torch.topk(logits, min(K, S), dim=-1))
        print(f"{S:>6} | {'topk tri':>9} {row['topk_triton'] * 1e6:10.1f}   | "
              f"torch.topk {row['topk_torch'] * 1e6:.1f} us")
        rows.append(row)
        del q, k, logits
        torch.cuda.empty_cache()
    return rows


def sweep(S: int) -> None:
    """Time the ragged kernel's launch options on one problem (block_m, block_n, tiles, warps, stages)."""
    from mlaspec.impl.indexer import indexer_logits

    q, k, k_scale, w, ks, ke = make_problem(S, torch.device("cuda"))
    flops = 2 * H * D * S * (S + 1) / 2
    print(f"sweep S={S}: block_m block_n tiles warps stages -> us TFLOP/s")
    for bm, bn, tiles, nw, ns in [(2, 128, 4, 8, 2), (2, 128, 8, 8, 3), (2, 64, 8, 4, 3), (4, 128, 4, 8, 2),
                                  (4, 64, 8, 8, 3), (2, 256, 2, 8, 2), (1, 128, 8, 4, 3), (4, 128, 8, 16, 2)]:
        try:
            t = _bench(lambda: indexer_logits(q, k, w, ks, ke, k_scale, block_m=bm, block_n=bn, tiles=tiles,
                                              num_warps=nw, num_stages=ns))  # fmt: skip
            print(f"  {bm:>2} {bn:>4} {tiles:>2} {nw:>2} {ns:>2} -> {t * 1e6:9.1f} {flops / t / 1e12:7.1f}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a note
            print(f"  {bm:>2} {bn:>4} {tiles:>2} {nw:>2} {ns:>2} -> failed: {type(exc).__name__}: {str(exc)[:120]}")


def plot(rows: list[dict], providers: list[str], path: str) -> None:
    """TFLOP/s of the logits against S, one line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for p, style in zip(providers, ("-o", "--s", ":x")):
        xs = [r["S"] for r in rows if p in r]
        ys = [r["flops"] / r[p] / 1e12 for r in rows if p in r]
        if xs:
            ax.plot(xs, ys, style, label=p)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("S (causal prefill tokens = keys)")
    ax.set_ylabel("TFLOP/s (useful q k^T)")
    ax.set_title(f"indexer logits, H={H}, D={D}, fp8 e4m3")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--providers", default="triton,deepgemm,torch")
    ap.add_argument("--out", default="indexer.png")
    ap.add_argument("--sweep", type=int, default=0, help="time launch options at this S and exit")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/indexer.py needs a CUDA device")
        return 1
    if args.sweep:
        sweep(args.sweep)
        return 0
    providers = args.providers.split(",")
    rows = run([int(s) for s in args.seqs.split(",")], providers)
    plot(rows, providers, args.out)
    return 0 if rows and not any(math.isnan(r.get("triton", 0.0)) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
