"""Sparse MLA (DeepSeek V3.2, top-k 2048), decode and prefill: the Triton kernels of :mod:`mlaspec.impl.sparse`
against FlashMLA and eager torch.

Decode (kernel ``sparse_decode``): each request has one query token (``S_q = 1``) with ``H_q`` heads, attending to
``K`` keys named by global slots into a paged cache of ``S_kv`` tokens per request (64-token pages, shuffled).
Providers:

* ``triton-fp8``: the 656-byte FlashMLA token (512 e4m3 + 4 fp32 scales + 64 bf16), dequantized in the kernel;
* ``triton-bf16``: a bf16 cache of the same shape (1152 bytes a token; random values, timing only);
* ``flashmla``: ``flash_mla_with_kvcache(q [B, 1, 64|128, 576] bf16, cache [blocks, 64, 1, 656] uint8, None, None,
  512, meta, None, indices=[B, 1, K] int32, is_fp8_kvcache=True)`` on the same 656-byte cache (heads zero-padded
  to 64 or 128, as vLLM does);
* ``torch``: gather the named bf16 rows, logits, softmax, ``P @ V`` (skipped above ``--torch-max-gb``).

Traffic per call: ``B * K * token_bytes`` of keys (each named key read once per head block; ``token_bytes`` is the
provider's: 656 fp8, 1152 bf16) plus ``q`` and ``out`` (``B * H_q * (576 + 512) * 2``); FLOPs ``2 * B * H_q * K *
(576 + 512)``.

Prefill (kernel ``sparse_prefill``): the last ``S_q`` tokens of an ``S_kv``-token request, ``q [S_q, H_q, 576]`` and
``kv [S_kv, 1, 576]`` bf16, ``indices [S_q, 1, K]`` int32 naming ``K`` random keys of each query's causal prefix
(``-1`` where the prefix holds fewer). Providers: ``triton`` (:func:`mlaspec.impl.sparse.sparse_mla`),
``flashmla`` (``flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512)``, returns ``out [S_q, H_q, 512]``,
``max_logits``, ``lse [S_q, H_q]``), ``torch``. Counts::

    flops = 2 * S_q * H_q * K * (576 + 512)
    bytes = S_q * K * 576 * 2 + S_q * H_q * (576 + 512) * 2     # gathered kv (an upper bound: keys repeat), q, out

Prints a table with the speed against FlashMLA measured in the same run and writes a bar chart::

    python benchmarks/sparse.py --out sparse.png                         # decode and prefill
    python benchmarks/sparse.py --mode decode --batch 64 128 --heads 64 128 --topk 2048 --s-kv 8192
    python benchmarks/sparse.py --mode prefill --s-q 4096 --s-kv 8192 65536 --heads 64 128
    python benchmarks/sparse.py --mode decode --providers triton-fp8 triton-fp8@64,8,2 triton-fp8@16,4,3   # tiles
    python benchmarks/sparse.py --mode decode --providers triton-fp8 triton-fp8:triton flashmla   # Gluon, readable
    python benchmarks/sparse.py --mode prefill --heads 16 128 --providers triton:sm90 triton:triton flashmla

Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from common import Row, load_flashmla, measure, plot_bars, print_table, skip

D_QK, D_V, PAGE = 576, 512, 64
DECODE_PROVIDERS = ("triton-fp8", "triton-bf16", "flashmla", "torch")
PREFILL_PROVIDERS = ("triton", "flashmla", "torch")


def _fp8_cache(num_tokens: int, device, gen: torch.Generator) -> torch.Tensor:
    """Random 656-byte records ``[num_tokens, 656]`` uint8 with no NaN: e4m3 bytes, power-of-two fp32 scales, bf16."""
    raw = torch.randint(0, 256, (num_tokens, 656), dtype=torch.uint8, device=device, generator=gen)
    raw[:, :512] = torch.where((raw[:, :512] & 0x7F) == 0x7F, 0x3C, raw[:, :512])  # no e4m3 NaN
    scales = torch.exp2(torch.randint(-9, -5, (num_tokens, 4), device=device, generator=gen).float())
    raw[:, 512:528] = scales.view(torch.uint8)
    rope = torch.randn(num_tokens, 64, device=device, generator=gen).to(torch.bfloat16)
    raw[:, 528:] = rope.view(torch.uint8)
    return raw


def decode_problem(B: int, H: int, K: int, s_kv: int, device, seed: int = 0):
    """``q [B, 1, H, 576]`` bf16, the fp8 cache ``[B * pages * 64, 656]`` uint8, slots ``[B, 1, K]`` int32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = -(-s_kv // PAGE)
    num_blocks = B * pages
    perm = torch.randperm(num_blocks, device=device, generator=gen).view(B, pages)  # the shuffled block table
    local = torch.stack([torch.randperm(s_kv, device=device, generator=gen)[:K] for _ in range(B)])  # [B, K]
    slots = perm.gather(1, local // PAGE) * PAGE + local % PAGE
    q = (torch.randn(B, 1, H, D_QK, device=device, generator=gen) * 2).to(torch.bfloat16)
    raw = _fp8_cache(num_blocks * PAGE, device, gen)
    return q, raw, slots[:, None].to(torch.int32).contiguous()


def prefill_problem(S_q: int, S_kv: int, H: int, K: int, device, seed: int = 0):
    """``q [S_q, H, 576]``, ``kv [S_kv, 1, 576]`` bf16 and ``indices [S_q, 1, K]`` int32: query ``i`` names ``K``
    random keys of ``[0, S_kv - S_q + i]`` (``-1`` past the prefix's length)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(S_q, H, D_QK, device=device, generator=gen).to(torch.bfloat16)
    kv = torch.randn(S_kv, 1, D_QK, device=device, generator=gen).to(torch.bfloat16)
    idx = torch.full((S_q, K), -1, dtype=torch.int32, device=device)
    cols = torch.arange(S_kv, device=device)[None, :]
    for start in range(0, S_q, 512):  # [512, S_kv] random scores at a time
        rows = torch.arange(start, min(start + 512, S_q), device=device)
        score = torch.rand(len(rows), S_kv, device=device, generator=gen)
        score.masked_fill_(cols > (S_kv - S_q + rows)[:, None], -1.0)
        top, pos = score.topk(min(K, S_kv), dim=-1)
        idx[start : start + len(rows), : pos.shape[1]] = pos.masked_fill(top < 0, -1).to(torch.int32)
    return q, kv, idx[:, None].contiguous()


def torch_sparse(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """Eager: ``q [R, H, 576]``, rows ``kv [N, 576]``, ``idx [R, K]`` (``-1`` unused) -> ``out [R, H, 512]``; bf16
    matmuls, fp32 softmax."""
    ok = (idx >= 0) & (idx < kv.shape[0])
    keys = kv[idx.clamp(0, kv.shape[0] - 1).long()]  # [R, K, 576]
    s = torch.einsum("rhd,rkd->rhk", q, keys).float() * scale
    p = torch.softmax(s.masked_fill(~ok[:, None], float("-inf")), -1).to(q.dtype)
    return torch.einsum("rhk,rkd->rhd", p, keys[..., :D_V])


def _torch_gb(R: int, H: int, K: int) -> float:
    return (R * K * D_QK * 2 + R * H * K * 12) / 1e9  # gathered rows; bf16 + fp32 logits, fp32 + bf16 p


def _pad_to(H: int, counts) -> int | None:
    """The head count FlashMLA takes for ``H`` query heads (zero-padded up to it), None above the largest."""
    return next((c for c in counts if c >= H), None)


def _decode_fn(prov: str, fm, q, raw, flat, idx, scale: float):
    """``(call, key bytes)`` of sparse-decode provider ``prov`` on one problem (``flat``: the bf16 cache)."""
    import triton

    from mlaspec.conformance.backends.common import pad_heads, pad_last
    from mlaspec.impl.sparse import SparseConfig, float_keys, fp8_keys, sparse_mla_decode

    prov, _, kernel = prov.partition(":")  # "triton-fp8:triton": the readable kernel (sparse_mla's kernel=)
    name, _, tile = prov.partition("@")  # "triton-fp8@64,8,2": block_n, num_warps, num_stages
    cfg = None
    if tile:
        bn, w, st = (int(x) for x in tile.split(","))
        cfg = SparseConfig(min(64, max(16, triton.next_power_of_2(q.shape[2]))), bn, w, st)
    if name == "triton-fp8":
        keys = fp8_keys(raw, "fp8_v32", PAGE)
        return (lambda: sparse_mla_decode(q, keys, idx, scale=scale, config=cfg, kernel=kernel or None)), 656
    if name == "triton-bf16":
        keys = float_keys(flat)
        return (lambda: sparse_mla_decode(q, keys, idx, scale=scale, config=cfg, kernel=kernel or None)), 1152
    if name == "flashmla":  # heads zero-padded to 64 / 128, top-k to a multiple of 64 with -1
        qp = pad_heads(q, _pad_to(q.shape[2], (64, 128)), 2).contiguous()
        cache, idx_p = raw.view(-1, PAGE, 1, 656), pad_last(idx, 64, -1).contiguous()
        meta, _ = fm.get_mla_metadata()
        return (
            lambda: fm.flash_mla_with_kvcache(
                qp, cache, None, None, D_V, meta, None, softmax_scale=scale, is_fp8_kvcache=True, indices=idx_p
            )
        ), 656
    if name == "torch":
        return (lambda: torch_sparse(q[:, 0], flat, idx[:, 0], scale)), 1152
    raise ValueError(f"unknown provider {prov!r}")


def decode_rows(
    batches,
    heads,
    topks,
    contexts,
    providers=DECODE_PROVIDERS,
    *,
    graph: bool = False,
    torch_max_gb: float = 8.0,
    cache_max_gb: float = 40.0,
    device: str = "cuda",
) -> list[Row]:
    """Rows of kernel ``sparse_decode`` for every ``(B, H_q, K, S_kv)`` (``K <= S_kv``)."""
    dev = torch.device(device)
    fm = load_flashmla() if "flashmla" in providers else None
    rows: list[Row] = []
    for B, H, K, s_kv in itertools.product(batches, heads, topks, contexts):
        shape = dict(B=B, H=H, K=K, S_kv=s_kv)
        if s_kv < K or B * s_kv * 1152 > cache_max_gb * 1e9:
            skip("sparse_decode", "*", shape, "K > S_kv" if s_kv < K else f"bf16 cache over {cache_max_gb:g} GB")
            continue
        q, raw, idx = decode_problem(B, H, K, s_kv, dev)
        flat = None
        if any(p.startswith(("triton-bf16", "torch")) for p in providers):
            flat = torch.randn(raw.shape[0], D_QK, device=dev, dtype=torch.bfloat16)  # timing only: any values
        for prov in providers:
            if prov == "flashmla" and (fm is None or _pad_to(H, (64, 128)) is None):
                continue
            if prov == "torch" and _torch_gb(B, H, K) > torch_max_gb:
                skip("sparse_decode", prov, shape, f"{_torch_gb(B, H, K):.0f} GB of temporaries")
                continue
            fn, token = _decode_fn(prov, fm, q, raw, flat, idx, D_QK**-0.5)
            measure(
                rows,
                "sparse_decode",
                prov,
                shape,
                fn,
                nbytes=B * K * token + B * H * (D_QK + D_V) * 2,
                flops=2 * B * H * K * (D_QK + D_V),
                graph=graph,
            )
        q = raw = idx = flat = fn = None  # free the problem before the next one
        torch.cuda.empty_cache()
    return rows


def _prefill_fn(p: str, fm, q, kv, idx, scale: float):
    """Sparse-prefill provider ``p``'s call on one problem."""
    from mlaspec.conformance.backends.common import pad_heads, pad_last
    from mlaspec.impl.sparse import float_keys, sparse_mla

    p, _, kernel = p.partition(":")  # "triton:sm90" / "triton:triton": sparse_mla's kernel=
    if p == "triton":
        keys = float_keys(kv)
        return lambda: sparse_mla(q, keys, idx, scale=scale, d_v=D_V, kernel=kernel or None)
    if p == "flashmla":  # heads zero-padded to a count the kernel has, top-k to a multiple of 128 (SM90) with -1
        sm90 = torch.cuda.get_device_capability(q.device)[0] == 9
        qp = pad_heads(q, _pad_to(q.shape[1], (8, 16, 32, 64, 128) if sm90 else (64, 128)), 1).contiguous()
        idx_p = pad_last(idx, 128, -1).contiguous()
        return lambda: fm.flash_mla_sparse_fwd(qp, kv, idx_p, scale, D_V)
    if p == "torch":
        return lambda: torch_sparse(q, kv[:, 0], idx[:, 0], scale)
    raise ValueError(f"unknown provider {p!r}")


def prefill_rows(
    s_qs, contexts, heads, topks, providers=PREFILL_PROVIDERS, *, torch_max_gb: float = 8.0, device: str = "cuda"
) -> list[Row]:
    """Rows of kernel ``sparse_prefill`` for every ``(S_q, S_kv, H_q, K)`` (``S_q <= S_kv``)."""
    dev = torch.device(device)
    fm = load_flashmla() if "flashmla" in providers else None
    rows: list[Row] = []
    for S_q, s_kv, H, K in itertools.product(s_qs, contexts, heads, topks):
        shape = dict(S_q=S_q, S_kv=s_kv, H=H, K=K)
        if S_q > s_kv:
            skip("sparse_prefill", "*", shape, "S_q > S_kv")
            continue
        q, kv, idx = prefill_problem(S_q, s_kv, H, K, dev)
        for p in providers:
            if p == "flashmla" and (fm is None or H > 128):
                continue
            if p == "torch" and _torch_gb(S_q, H, K) > torch_max_gb:
                skip("sparse_prefill", p, shape, f"{_torch_gb(S_q, H, K):.0f} GB of temporaries")
                continue
            measure(
                rows,
                "sparse_prefill",
                p,
                shape,
                _prefill_fn(p, fm, q, kv, idx, D_QK**-0.5),
                nbytes=S_q * K * D_QK * 2 + S_q * H * (D_QK + D_V) * 2,
                flops=2 * S_q * H * K * (D_QK + D_V),
            )
        q = kv = idx = None  # free the problem before the next one
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("decode", "prefill", "both"), default="both")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 128], help="decode requests")
    ap.add_argument("--s-q", type=int, nargs="+", default=[4096], help="prefill query tokens")
    ap.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--topk", type=int, nargs="+", default=[2048])
    ap.add_argument("--s-kv", type=int, nargs="+", default=[8192], help="cache tokens per request")
    ap.add_argument(
        "--providers",
        nargs="+",
        help=f"decode: {' '.join(DECODE_PROVIDERS)} (tiles: triton-fp8@block_n,warps,stages; a kernel: "
        f"triton-fp8:triton or :sm90); prefill: {' '.join(PREFILL_PROVIDERS)} (a kernel: triton:triton or "
        ":sm90); default all",
    )
    ap.add_argument("--torch-max-gb", type=float, default=8.0, help="skip torch above this many GB of temporaries")
    ap.add_argument("--graphs", action="store_true", help="time decode as CUDA graph replays (default: do_bench)")
    ap.add_argument("--out", default="sparse_bench.png")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    given = a.providers or DECODE_PROVIDERS + PREFILL_PROVIDERS
    rows: list[Row] = []
    if a.mode in ("decode", "both"):
        dec = [p for p in given if p.partition(":")[0].partition("@")[0] in DECODE_PROVIDERS]
        rows += decode_rows(a.batch, a.heads, a.topk, a.s_kv, dec, graph=a.graphs, torch_max_gb=a.torch_max_gb)
    if a.mode in ("prefill", "both"):
        pre = [p for p in given if p.partition(":")[0] in PREFILL_PROVIDERS]
        rows += prefill_rows(a.s_q, a.s_kv, a.heads, a.topk, pre, torch_max_gb=a.torch_max_gb)
    print_table(rows)
    if rows:
        plot_bars(rows, a.out, title=f"Sparse MLA on {torch.cuda.get_device_name()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
