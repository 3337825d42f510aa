"""Lightning-indexer logits and top-k: the Triton kernels against DeepGEMM and torch, on one GPU.

Prefill (ragged) logits for one causal request of ``S`` tokens (``M = N = S``, query ``i`` sees keys ``[0, i]``),
``H = 64`` heads of ``D = 128``, fp8 e4m3 q / k (kernel ``indexer``), then a decode-style top-k (``K = 2048``) over
the rows (kernel ``topk``). Counts::

    flops = 2 * H * D * sum_m (ke[m] - ks[m])        # the useful q k^T (about H D S^2)
    bytes = M * H * D + N * D + 4 * N + 4 * M * H    # fp8 q, fp8 k, k scales, weights
          + 4 * M * W                                # fp32 logits: W = N absolute columns (triton, torch),
                                                     # W = max(ke - ks) compressed columns (DeepGEMM >= 2.8)
    top-k: bytes = 4 * M * N + 4 * M * K             # read the logits, write int32 indices; no FLOPs counted

Timers: kernel ``indexer`` is ``do_bench`` of the call (L2 flushed before each, the host's launch path included:
prefill runs eagerly), ``indexer_graph`` (``--graph``) the same call as CUDA-graph replays, the GPU's time alone (L2
not flushed). They differ where the call is short: ``do_bench`` flushes L2 with a ~60 us memset before each call, and
a call that takes the host about as long is timed on the host, not the GPU (S = 1K: the triton call 31 us on the
H200's host, its kernel launched directly by :class:`mlaspec.impl.launch.Launcher`, 42 us through Triton's launch;
DeepGEMM's C++ binding 20-35 us). With ``--graph`` each provider's host time a call is printed too.

Providers: ``triton`` (:func:`mlaspec.impl.indexer.indexer_logits` as called: on Hopper the Gluon kernel of
:mod:`mlaspec.impl.indexer_sm90`, ``MLASPEC_INDEXER_KERNEL=triton`` for the readable one), ``deepgemm``
(``fp8_fp4_mqa_logits`` / ``fp8_mqa_logits`` through
:class:`mlaspec.conformance.backends.deepgemm.DeepGEMMBackend`'s bound functions, the raw call only, skipped with a
note when not importable), ``torch`` (fp32 einsum, as vLLM's fallback). The top-k compares
:func:`mlaspec.impl.indexer.topk_indices` with ``torch.topk`` on the same logits. The table gives the speed against
DeepGEMM (logits) and ``torch.topk`` measured in the same run.

    python benchmarks/indexer.py --seqs 1024,4096,8192 --out indexer.png
    python benchmarks/indexer.py --seqs 1024 --graph --providers triton,deepgemm   # GPU time next to do_bench
    python benchmarks/indexer.py --sweep 8192                    # the ragged kernel's launch options
    python benchmarks/indexer.py --seqs 1024,8192 --tiles 8,32,256  # the Gluon kernel's key tiles a program

Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
from common import Row, bench, host_seconds, load_deepgemm, measure, plot_sweep, print_table, shape_str, skip

H, D, K = 64, 128, 2048
PROVIDERS = ("triton", "deepgemm", "torch")


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


def _logits_fn(p: str, dg, q, k, k_scale, w, ks, ke):
    """Provider ``p``'s logits call on one problem."""
    from mlaspec.impl.indexer import indexer_logits

    if p == "triton":
        return lambda: indexer_logits(q, k, w, ks, ke, k_scale)
    if p == "deepgemm" and dg.compressed:  # the widest span is every key: as many columns as the absolute rows
        return lambda: dg.ragged((q, None), (k, k_scale), w, ks, ke, k.shape[0])
    if p == "deepgemm":
        return lambda: dg.ragged(q, (k, k_scale), w, ks, ke, clean_logits=True)
    if p == "torch":

        def fn():
            s = torch.einsum("mhd,nd->mhn", q.float(), k.float()).relu_()
            return torch.einsum("mhn,mh->mn", s, w) * k_scale[None, :]

        return fn
    raise ValueError(f"unknown provider {p!r}")


def run(
    seqs,
    providers=PROVIDERS,
    *,
    logits: bool = True,
    topk: bool = True,
    graph: bool = False,
    torch_max_gb: float = 20.0,
    device: str = "cuda",
) -> list[Row]:
    """Rows of kernel ``indexer`` (when ``logits``), ``indexer_graph`` (when ``graph``: the same calls as CUDA-graph
    replays; not torch's, whose temporaries a graph would keep) and ``topk`` (when ``topk``) for every ``S``."""
    from mlaspec.impl.indexer import indexer_logits, topk_indices

    dev = torch.device(device)
    dg = load_deepgemm() if (logits or graph) and "deepgemm" in providers else None
    rows: list[Row] = []
    for S in seqs:
        q, k, k_scale, w, ks, ke = make_problem(S, dev)
        flops = 2 * H * D * S * (S + 1) / 2
        nbytes = S * H * D + S * D + 4 * S + 4 * S * H + 4 * S * S
        for p in providers if logits or graph else ():
            if p == "deepgemm" and dg is None:
                continue
            if p == "torch" and torch_max_gb * 1e9 < S * S * H * 4:
                skip("indexer", p, dict(S=S), f"{S * S * H * 4 / 1e9:.0f} GB of fp32 scores")
                continue
            fn = _logits_fn(p, dg, q, k, k_scale, w, ks, ke)
            if logits:
                measure(rows, "indexer", p, dict(S=S), fn, nbytes=nbytes, flops=flops)
            if graph and p != "torch":
                measure(rows, "indexer_graph", p, dict(S=S), fn, nbytes=nbytes, flops=flops, graph=True)
                print(f"  {'host':<14} {shape_str(dict(S=S)):<30} {p:<12} {host_seconds(fn) * 1e6:10.1f} us a call")
        if topk:  # over the logits, decode-style rows [0, ke)
            lg = indexer_logits(q, k, w, ks, ke, k_scale)
            tk, nbytes = dict(S=S, K=K), 4 * S * S + 4 * S * K
            fns = {
                "triton": lambda: topk_indices(lg, K, row_ends=ke),  # noqa: B023 - timed inside this iteration
                "torch": lambda: torch.topk(lg, min(K, S), -1),  # noqa: B023 - timed inside this iteration
            }
            for p in [p for p in fns if p in providers]:
                measure(rows, "topk", p, tk, fns[p], nbytes=nbytes, flops=0)
        q = k = lg = fn = fns = None  # free the problem before the next one
        torch.cuda.empty_cache()
    return rows


def sweep(S: int) -> None:
    """Time the readable ragged kernel's launch options on one problem (block_m, block_n, tiles, warps, stages)."""
    from mlaspec.impl.indexer import indexer_logits

    q, k, k_scale, w, ks, ke = make_problem(S, torch.device("cuda"))
    flops = 2 * H * D * S * (S + 1) / 2
    print(f"sweep S={S}: block_m block_n tiles warps stages -> us TFLOP/s")
    for bm, bn, tiles, nw, ns in [
        (2, 128, 4, 8, 2),
        (2, 128, 8, 8, 3),
        (2, 64, 8, 4, 3),
        (4, 128, 4, 8, 2),
        (4, 64, 8, 8, 3),
        (2, 256, 2, 8, 2),
        (1, 128, 8, 4, 3),
        (4, 128, 8, 16, 2),
    ]:
        try:
            config = dict(block_m=bm, block_n=bn, tiles=tiles, num_warps=nw, num_stages=ns)
            t = bench(functools.partial(indexer_logits, q, k, w, ks, ke, k_scale, **config))
            print(f"  {bm:>2} {bn:>4} {tiles:>2} {nw:>2} {ns:>2} -> {t * 1e6:9.1f} {flops / t / 1e12:7.1f}", flush=True)
        except Exception as exc:  # a config that does not compile is a note
            print(f"  {bm:>2} {bn:>4} {tiles:>2} {nw:>2} {ns:>2} -> failed: {type(exc).__name__}: {str(exc)[:120]}")


def tiles_sweep(seqs, tiles, rounds: int = 5) -> None:
    """The Gluon kernel (:mod:`mlaspec.impl.indexer_sm90`) with each of ``tiles`` key tiles a program, beside DeepGEMM,
    at every ``S`` of ``seqs``: CUDA-graph replays, ``rounds`` rounds alternated, the median of each (``*``: the count
    :func:`~mlaspec.impl.indexer_sm90.tiles_for` takes). Every count's logits must equal the default call's bit for
    bit (a count changes which program computes a tile, not how)."""
    from mlaspec.impl import indexer_sm90
    from mlaspec.impl.indexer import indexer_logits

    dev = torch.device("cuda")
    dg = load_deepgemm()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"key tiles a program (us, CUDA-graph replays, median of {rounds} alternated rounds; *: tiles_for's)")
    for S in seqs:
        q, k, k_scale, w, ks, ke = make_problem(S, dev)
        fns = {t: functools.partial(indexer_logits, q, k, w, ks, ke, k_scale, kernel="sm90", tiles=t) for t in tiles}
        ref = indexer_logits(q, k, w, ks, ke, k_scale)
        for t, fn in fns.items():
            if not torch.equal(fn(), ref):
                raise AssertionError(f"S={S}: {t} key tiles a program changed the logits")
        if dg is not None:
            fns["deepgemm"] = _logits_fn("deepgemm", dg, q, k, k_scale, w, ks, ke)
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(bench(fn, graph=True) * 1e6)
        chosen = indexer_sm90.tiles_for(S, S, sms)
        cells = [f"{name}{'*' if name == chosen else ''} {statistics.median(t):.1f}" for name, t in times.items()]
        print(f"  S={S}: " + "  ".join(cells), flush=True)
        q = k = ref = fns = None  # free the problem before the next one
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--out", default="indexer.png")
    ap.add_argument("--sweep", type=int, default=0, help="time launch options at this S and exit")
    ap.add_argument("--graph", action="store_true", help="also time the logits as CUDA-graph replays (indexer_graph)")
    ap.add_argument("--tiles", help="key tiles a program (e.g. 8,32,256): time the Gluon kernel with each at --seqs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/indexer.py needs a CUDA device")
        return 1
    if args.sweep:
        sweep(args.sweep)
        return 0
    if args.tiles:
        tiles_sweep([int(s) for s in args.seqs.split(",")], [int(t) for t in args.tiles.split(",")])
        return 0
    rows = run([int(s) for s in args.seqs.split(",")], args.providers.split(","), graph=args.graph)
    print_table(rows)
    plot_sweep(
        [r for r in rows if r.kernel == "indexer"],
        args.out,
        x="S",
        metric="tflops",
        title=f"indexer logits, H={H}, D={D}, fp8 e4m3",
        ylabel="TFLOP/s (useful q k^T)",
    )
    return 0 if any(r.kernel == "indexer" and r.provider == "triton" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
