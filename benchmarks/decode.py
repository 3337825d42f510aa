"""Paged MLA decode, bf16 or vLLM's per-tensor fp8 cache: the Triton kernels against FlashMLA and eager torch.

For each ``(H_q, B, S_kv)`` it times one decode step (``S_q`` query tokens per sequence, a 64-slot paged cache with
shuffled pages) and prints microseconds, GB/s, TFLOP/s and the speed against FlashMLA measured in the same run,
then writes a plot of the achieved bandwidth against the measured copy bandwidth. The counts, per step::

    bytes = B * S_kv * 576 * e          # the cache, each entry read once (e = 2 bf16, 1 fp8)
          + B * S_q * H_q * 576 * 2     # q (bf16)
          + B * S_q * H_q * 512 * 2     # out (bf16)
    flops = 2 * B * S_q * H_q * S_kv * (576 + 512)     # q k^T and p v (causal MTP masks a few more: ignored)

Roofline: ``time >= max(bytes / copy bandwidth, flops / bf16 matmul rate)``, both measured here first
(:func:`common.measure_roofline`). Providers, bf16 cache (kernel ``decode``): ``triton``
(:func:`mlaspec.impl.decode.mla_decode_paged`), ``flashmla`` (``flash_mla_with_kvcache``), ``torch`` (gather the
pages, fp32 logits, softmax, bf16 ``P @ V``), ``read`` (no decode: a plain streaming read of the same cache's bytes,
the fastest of :data:`stream.CONFIGS`; what any kernel reading that cache once can reach at this size, the floor
the bandwidth targets are judged beside). With ``--fp8`` (kernel ``decode_fp8``, cache ``[pages, 64, 576]`` e4m3
bytes and a per-tensor ``k_scale``): ``triton`` (the same function with ``k_scale``), ``triton-e4m3`` (its e4m3
path, q quantized to e4m3 before timing as for FlashMLA: FlashMLA's arithmetic),
``flashmla`` (``torch.ops._flashmla_extension_C.fwd_kvcache_mla_fp8``, SM90; q quantized to e4m3 before timing, as
vLLM's ``_DecodeConcatQuantFP8`` does outside the kernel), ``torch`` (dequantize the cache, then as bf16). FlashMLA
is skipped with a note when it does not import; torch above ``--torch-max-gb`` of temporaries; a shape whose cache
exceeds ``--cache-max-gb``. Kernel ``decode_sustained``: ``triton`` and ``flashmla`` again at the shapes
:func:`power_bound` names, replayed back to back for 2 s after 1 s idle, the last second timed
(:func:`common.sustained`): the time under a lasting load, as serving runs, where the card's power limit holds the
clock (the ``decode`` rows time ~50 ms of replays, part of them at a clock the power limit later takes away).

    python benchmarks/decode.py                                  # the full sweep, ~3 minutes on an H200
    python benchmarks/decode.py --batches 1,64 --contexts 4096 --heads 128 --s-q 2 --out mtp.png
    python benchmarks/decode.py --fp8 --out decode_fp8.png

Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import itertools
import math

import stream
import torch
from common import (
    Row,
    describe_roofline,
    load_flashmla,
    load_flashmla_fp8,
    measure,
    measure_roofline,
    plot_sweep,
    print_table,
    skip,
)

D_QK, D_V, PAGE = 576, 512, 64
PROVIDERS = ("triton", "triton-e4m3", "flashmla", "torch", "read")  # triton-e4m3: the fp8 cache only
FP8 = torch.float8_e4m3fn
SUSTAIN = 1.0
"""Seconds each ``decode_sustained`` row is timed, after 1 s idle and 1 s of replays untimed."""


def power_bound(shape: dict) -> bool:
    """The bf16 decodes timed again as kernel ``decode_sustained`` (:func:`common.sustained`): 128 heads at
    ``B <= 2`` from 64K keys, the issue-18 target's shapes, where both kernels draw the H200's 700 W and the clock
    the power limit allows is not the clock of a 50 ms timing (``docs/bench/power.md``, 2026-11-30)."""
    return shape["H"] == 128 and shape["B"] <= 2 and shape["S_kv"] >= 65536 and shape.get("S_q", 1) == 1


def make_problem(B: int, S_kv: int, device: torch.device, *, fp8: bool = False, seed: int = 0):
    """A shuffled paged cache ``[pages, 64, 1, 576]`` (bf16, or e4m3 bytes as ``uint8`` without NaN) for ``B``
    sequences of ``S_kv`` keys: ``(cache, block_table [B, pages] int32, seq_lens [B] int32)``."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = math.ceil(S_kv / PAGE)
    num_pages = B * pages
    cache = torch.randn(num_pages, PAGE, 1, D_QK, generator=g, device=device, dtype=torch.bfloat16)  # as FlashMLA
    if fp8:
        cache = cache.to(FP8).view(torch.uint8)
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


def _flashmla_fn(fm, q, cache, block_table, seq_lens, scale):
    """``flash_mla_with_kvcache`` over the bf16 cache ``[pages, 64, 1, 576]``."""
    S_q, H = q.shape[1], q.shape[2]
    try:  # FlashMLA <= 2025-08: metadata from the lengths; later ones take (and ignore) them, filling it on use
        meta, splits = fm.get_mla_metadata(seq_lens, S_q * H, 1)
    except TypeError:
        meta, splits = fm.get_mla_metadata(), None
    return lambda: fm.flash_mla_with_kvcache(
        q, cache, block_table, seq_lens, D_V, meta, splits, softmax_scale=scale, causal=True
    )


def _e4m3_query(q):
    """``(e4m3(q / q_scale), q_scale)`` with ``q_scale`` its amax over e4m3's 448: q as the fp8 decodes take it,
    quantized before timing (vLLM's ``_DecodeConcatQuantFP8`` runs outside the kernel)."""
    q_scale = float(q.abs().amax()) / 448
    return (q.float() / q_scale).to(FP8).contiguous(), q_scale


def _flashmla_fp8_fn(ext, q, cache, block_table, seq_lens, scale, k_scale):
    """``fwd_kvcache_mla_fp8(q e4m3 [B, S_q, H, 576], cache e4m3 [pages, 64, 1, 576], 512, seq_lens, block_table,
    scale, causal, meta, splits, descale_q [1], descale_k [1])``, as the conformance adapter calls it."""
    S_q, H = q.shape[1], q.shape[2]
    q8, q_scale = _e4m3_query(q)
    cache8 = cache.view(FP8)
    descale_q = torch.tensor([q_scale], dtype=torch.float32, device=q.device)
    descale_k = torch.tensor([k_scale], dtype=torch.float32, device=q.device)
    meta, splits = ext.get_mla_decoding_metadata_dense_fp8(seq_lens, S_q * H, 1)
    return lambda: ext.fwd_kvcache_mla_fp8(
        q8, cache8, D_V, seq_lens, block_table, scale, True, meta, splits, descale_q, descale_k
    )


def _fn(p: str, fm, q, cache, block_table, seq_lens, S_kv: int, scale: float, k_scale: float | None, **options):
    """Provider ``p``'s call on one problem (``k_scale`` given: the fp8 cache); ``options``: ``triton``'s further
    arguments of ``mla_decode_paged`` (``kernel``, ``config``)."""
    from mlaspec.impl.decode import mla_decode_paged

    cache3 = cache.view(-1, PAGE, D_QK)
    if p == "triton":
        return lambda: mla_decode_paged(
            q, cache3, block_table, seq_lens, d_v=D_V, scale=scale, causal=True, k_scale=k_scale, max_seq_len=S_kv,
            **options,
        )  # fmt: skip
    if p == "triton-e4m3":  # q quantized as for FlashMLA's fp8 kernel
        q8, q_scale = _e4m3_query(q)
        return lambda: mla_decode_paged(
            q8, cache3, block_table, seq_lens, d_v=D_V, scale=scale, causal=True, k_scale=k_scale, q_scale=q_scale,
            max_seq_len=S_kv, **options,
        )  # fmt: skip
    if p == "flashmla":
        if k_scale is None:
            return _flashmla_fn(fm, q, cache, block_table, seq_lens, scale)
        return _flashmla_fp8_fn(fm, q, cache, block_table, seq_lens, scale, k_scale)
    if p == "torch" and k_scale is None:
        return lambda: torch_decode(q, cache3, block_table, seq_lens, S_kv, scale)
    if p == "torch":
        return lambda: torch_decode(q, cache3.view(FP8).to(q.dtype) * k_scale, block_table, seq_lens, S_kv, scale)
    raise ValueError(f"unknown provider {p!r}")


def run(
    batches,
    contexts,
    heads,
    *,
    s_q: int = 1,
    fp8: bool = False,
    providers=PROVIDERS,
    graph: bool = True,
    torch_max_gb: float = 8.0,
    cache_max_gb: float = 40.0,
    device: str = "cuda",
) -> list[Row]:
    """Rows of kernel ``decode`` (or ``decode_fp8``) for every ``(B, S_kv, H_q)``."""
    device = torch.device(device)
    kernel = "decode_fp8" if fp8 else "decode"
    fm = (load_flashmla_fp8() if fp8 else load_flashmla()) if "flashmla" in providers else None
    providers = [p for p in providers if (p != "flashmla" or fm is not None) and (p != "triton-e4m3" or fp8)]
    scale, k_scale, elt = 192**-0.5, 0.05 if fp8 else None, 1 if fp8 else 2
    rows: list[Row] = []
    for B, S_kv in itertools.product(batches, contexts):
        if B * S_kv * D_QK * elt > cache_max_gb * 1e9:
            skip(kernel, "*", dict(B=B, S_kv=S_kv), f"cache over {cache_max_gb:g} GB")
            continue
        cache, block_table, seq_lens = make_problem(B, S_kv, device, fp8=fp8)
        cache_bytes, read = cache.numel() * cache.element_size(), None
        if "read" in providers:  # the plain read's fastest launch, chosen once a cache
            try:
                read = stream.fastest(cache, graph=graph)[1]
            except Exception as exc:  # a note, and the other providers go on
                skip(kernel, "read", dict(B=B, S_kv=S_kv), f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        for H in heads:
            q = torch.randn(B, s_q, H, D_QK, device=device, dtype=torch.bfloat16)
            shape = dict(H=H, B=B, S_kv=S_kv) | ({"S_q": s_q} if s_q != 1 else {})
            nbytes = B * S_kv * D_QK * elt + 2 * B * s_q * H * (D_QK + D_V)
            flops = 2 * B * s_q * H * S_kv * (D_QK + D_V)
            for p in providers:
                temp = B * S_kv * D_QK * (6 + 2 * fp8) + B * H * s_q * S_kv * 4 * 3  # torch: gathered kv, fp32 s, p
                if p == "torch" and temp > torch_max_gb * 1e9:
                    skip(kernel, p, shape, f"{temp / 1e9:.0f} GB of temporaries > {torch_max_gb:g}")
                    continue
                if p == "read":  # the cache's bytes alone, no FLOPs (left off the roofline plot)
                    if read is not None:
                        measure(rows, kernel, p, shape, read, nbytes=cache_bytes, flops=0, graph=graph)
                    continue
                fn = _fn(p, fm, q, cache, block_table, seq_lens, S_kv, scale, k_scale)
                measure(rows, kernel, p, shape, fn, nbytes=nbytes, flops=flops, graph=graph)
                if graph and not fp8 and p in ("triton", "flashmla") and power_bound(shape):
                    measure(rows, "decode_sustained", p, shape, fn, nbytes=nbytes, flops=flops, sustain=SUSTAIN)
        cache = block_table = seq_lens = q = fn = read = None  # free the problem before the next one
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description="Paged MLA decode benchmark (triton vs FlashMLA vs torch)")
    parser.add_argument("--batches", type=ints, default=[1, 8, 32, 128])
    parser.add_argument("--contexts", type=ints, default=[1024, 4096, 16384, 65536])
    parser.add_argument("--heads", type=ints, default=[16, 128])
    parser.add_argument("--s-q", type=int, default=1, help="query tokens per sequence (MTP: 2..4)")
    parser.add_argument("--fp8", action="store_true", help="vLLM's per-tensor fp8 cache (576 e4m3 bytes a token)")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--torch-max-gb", type=float, default=8.0, help="skip torch above this many GB of temporaries")
    parser.add_argument("--cache-max-gb", type=float, default=40.0, help="skip shapes whose cache is larger")
    parser.add_argument("--out", default="decode_bench.png")
    parser.add_argument("--no-graphs", action="store_true", help="time launches from Python, not graph replays")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    roof = measure_roofline(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: {describe_roofline(roof)}")
    rows = run(
        args.batches,
        args.contexts,
        args.heads,
        s_q=args.s_q,
        fp8=args.fp8,
        providers=args.providers.split(","),
        graph=not args.no_graphs,
        torch_max_gb=args.torch_max_gb,
        cache_max_gb=args.cache_max_gb,
    )
    print_table(rows)
    cache = "fp8 per-tensor" if args.fp8 else "bf16"
    plot_sweep(
        rows,
        args.out,
        x="S_kv",
        metric="gbps",
        panel="H",
        series="B",
        ceiling=roof.copy_bw / 1e9,
        title=f"MLA decode, {cache}, page 64",
        ylabel="GB/s (cache + q + out)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
