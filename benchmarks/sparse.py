"""Sparse MLA decode (DeepSeek V3.2, top-k 2048): the Triton kernel of :mod:`mlaspec.impl.sparse` against FlashMLA.

Each request has one query token (``S_q = 1``) with ``H_q`` heads, attending to ``K`` keys named by global slots into
a paged cache of ``S_kv`` tokens per request (64-token pages, shuffled). Providers:

* ``triton-fp8``: the 656-byte FlashMLA token (512 e4m3 + 4 fp32 scales + 64 bf16), dequantized in the kernel;
* ``triton-bf16``: a bf16 cache of the same shape (1152 bytes a token; random values, timing only);
* ``flashmla``: ``flash_mla_with_kvcache(..., indices=..., is_fp8_kvcache=True)`` on the same 656-byte cache (when
  ``flash_mla`` imports).

Traffic per call: ``B * K * token_bytes`` of keys (each named key read once per head block) plus ``q`` and ``out``
(``B * H_q * (576 + 512) * 2``); the GB/s column divides that by the median time of
:func:`triton.testing.do_bench`. Prints a table and writes a plot::

    python benchmarks/sparse_decode.py --out sparse_decode.png
    python benchmarks/sparse_decode.py --batch 64 128 --heads 64 128 --topk 2048 --s-kv 8192
    python benchmarks/sparse_decode.py --providers triton-fp8 triton-fp8@64,8,2 triton-fp8@16,4,3   # tiles

Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import itertools

import torch


def _fp8_cache(num_tokens: int, device, gen: torch.Generator) -> torch.Tensor:
    """Random 656-byte records ``[num_tokens, 656]`` uint8 with no NaN: e4m3 bytes, power-of-two fp32 scales, bf16."""
    raw = torch.randint(0, 256, (num_tokens, 656), dtype=torch.uint8, device=device, generator=gen)
    raw[:, :512] = torch.where((raw[:, :512] & 0x7F) == 0x7F, 0x3C, raw[:, :512])  # no e4m3 NaN
    scales = torch.exp2(torch.randint(-9, -5, (num_tokens, 4), device=device, generator=gen).float())
    raw[:, 512:528] = scales.view(torch.uint8)
    rope = torch.randn(num_tokens, 64, device=device, generator=gen).to(torch.bfloat16)
    raw[:, 528:] = rope.view(torch.uint8)
    return raw


def _problem(B: int, H: int, K: int, s_kv: int, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    page = 64
    pages = -(-s_kv // page)
    num_blocks = B * pages
    perm = torch.randperm(num_blocks, device=device, generator=gen).view(B, pages)  # the shuffled block table
    local = torch.stack([torch.randperm(s_kv, device=device, generator=gen)[:K] for _ in range(B)])  # [B, K]
    slots = perm.gather(1, local // page) * page + local % page
    q = (torch.randn(B, 1, H, 576, device=device, generator=gen) * 2).to(torch.bfloat16)
    raw = _fp8_cache(num_blocks * page, device, gen)
    return q, raw, slots[:, None].to(torch.int32).contiguous()


def bench(batches, heads, topks, s_kv: int, providers):
    """Rows ``(provider, B, H_q, K, microseconds, GB/s)``."""
    import triton

    from mlaspec.impl.sparse import SparseConfig, float_keys, fp8_keys, sparse_mla_decode

    dev = torch.device("cuda")
    rows = []
    fm = None
    if "flashmla" in providers:
        try:
            import flash_mla as fm
        except ImportError:
            print("flash_mla not importable: skipping the flashmla provider")
    for B, H, K in itertools.product(batches, heads, topks):
        q, raw, idx = _problem(B, H, K, s_kv, dev)
        scale = 576**-0.5
        io = B * H * (576 + 512) * 2
        for prov in providers:
            name, _, tile = prov.partition("@")  # "triton-fp8@64,8,2": block_n, num_warps, num_stages
            cfg = None
            if tile:
                bn, w, st = (int(x) for x in tile.split(","))
                cfg = SparseConfig(min(64, max(16, triton.next_power_of_2(H))), bn, w, st)
            if name == "triton-fp8":
                keys = fp8_keys(raw, "fp8_v32", 64)
                fn = lambda: sparse_mla_decode(q, keys, idx, scale=scale, config=cfg)  # noqa: E731
                token = 656
            elif name == "triton-bf16":
                flat = torch.randn(raw.shape[0], 576, device=dev).to(torch.bfloat16)  # timing only: any values
                keys = float_keys(flat)
                fn = lambda: sparse_mla_decode(q, keys, idx, scale=scale, config=cfg)  # noqa: E731
                token = 1152
            elif name == "flashmla" and fm is not None:
                cache = raw.view(-1, 64, 1, 656)
                hp = 64 if H <= 64 else 128
                qp = q if H == hp else torch.nn.functional.pad(q, (0, 0, 0, hp - H))
                meta, _ = fm.get_mla_metadata()

                def fn(qp=qp, cache=cache, meta=meta):
                    return fm.flash_mla_with_kvcache(qp, cache, None, None, 512, meta, None, softmax_scale=scale,
                                                     is_fp8_kvcache=True, indices=idx)  # fmt: skip

                token = 656
            else:
                continue
            try:
                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
            except Exception as exc:  # noqa: BLE001 - one provider failing leaves the others' rows
                print(f"{prov} B={B} H={H} K={K}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                continue
            gbs = (B * K * token + io) / (ms * 1e-3) / 1e9
            rows.append((prov, B, H, K, ms * 1e3, gbs))
    return rows


def print_table(rows) -> None:
    print(f"{'provider':>20} {'B':>5} {'H_q':>5} {'K':>6} {'us':>10} {'GB/s':>8}")
    for prov, B, H, K, us, gbs in rows:
        print(f"{prov:>20} {B:>5} {H:>5} {K:>6} {us:>10.1f} {gbs:>8.0f}")


def plot(rows, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(B, H, K) for _, B, H, K, _, _ in rows})
    provs = sorted({r[0] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / max(len(provs), 1)
    for i, prov in enumerate(provs):
        t = {(B, H, K): us for p, B, H, K, us, _ in rows if p == prov}
        xs = [j + i * w for j, c in enumerate(configs) if c in t]
        ax.bar(xs, [t[c] for c in configs if c in t], w, label=prov)
    ax.set_xticks([j + w * (len(provs) - 1) / 2 for j in range(len(configs))])
    ax.set_xticklabels([f"B={B}\nH={H}\nK={K}" for B, H, K in configs], fontsize=8)
    ax.set_ylabel("time (us), lower is better")
    ax.set_title("Sparse MLA decode, S_q = 1 (H200)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--topk", type=int, nargs="+", default=[2048])
    ap.add_argument("--s-kv", type=int, default=8192)
    ap.add_argument("--providers", nargs="+", default=["triton-fp8", "triton-bf16", "flashmla"])
    ap.add_argument("--out", default="sparse_decode.png")
    a = ap.parse_args(argv)
    rows = bench(a.batch, a.heads, a.topk, a.s_kv, a.providers)
    print_table(rows)
    if rows:
        plot(rows, a.out)


if __name__ == "__main__":
    main()
