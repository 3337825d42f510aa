"""Every benchmark in one run on one GPU: the Triton kernels against FlashMLA, DeepGEMM and eager torch, with the
card's roofline measured first in the same run.

Kernels (``--kernels``, comma list; default all), each with its providers and counts as its script documents:

* ``decode``, ``decode_fp8`` (:mod:`decode`): dense paged decode over a bf16 / per-tensor fp8 cache, heads 16 and
  128, batch 1..128, context 1K..128K; ``triton``, ``flashmla``, ``torch``; with ``decode``, the rows of
  ``decode_sustained``: the 128-head decode at B 1-2 from 64K keys timed again under a lasting load
  (:func:`decode.power_bound`);
* ``sparse_decode``, ``sparse_prefill`` (:mod:`sparse`): top-k 2048 over a 656-byte fp8 or bf16 cache, and the
  prefill over bf16 ``kv``; ``triton(-fp8|-bf16)``, ``flashmla``, ``torch``;
* ``indexer``, ``indexer_graph``, ``topk`` (:mod:`indexer`): fp8 causal logits, H 64, D 128; ``triton``,
  ``deepgemm``, ``torch``; the top-k (K 2048) ``triton`` against ``torch.topk``.

Decode kernels are timed as CUDA-graph replays (as serving runs them; ``--no-graphs`` for ``do_bench``), prefill,
indexer and top-k with ``do_bench`` (L2 flushed, the host's launch path included: prefill runs eagerly);
``indexer_graph`` is the indexer's logits again as graph replays, the GPU's time alone (:mod:`indexer` says where
the two differ). A provider that does not import, or a shape over the memory caps,
is skipped with a printed note. Writes to ``--out-dir``: ``bench.md`` (environment, roofs and the table: µs, GB/s,
TFLOP/s and the speed against FlashMLA / DeepGEMM / ``torch.topk`` measured in this run; then issue 18's targets
judged from those rows, :mod:`targets`), ``bench.json`` (the same,
rows with their counts) and ``roofline.png`` (every row against the measured copy bandwidth and matmul rates).

    python benchmarks/suite.py --out-dir docs/bench              # about 5 minutes on an H200
    python benchmarks/suite.py --quick --out-dir /tmp/bench      # a handful of shapes, under a minute
    python benchmarks/suite.py --kernels sparse_prefill,indexer --out-dir /tmp/bench

FlashMLA and DeepGEMM come from the vLLM 0.33.0 wheel (``pip install vllm==0.33.0``: ``vllm.third_party.flashmla``
and ``deep_gemm``) or from upstream; DeepGEMM JIT-compiles on first use and needs ``nvcc``.

Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import decode
import indexer
import sparse
import targets
import torch
from common import REFERENCE, Row, describe_roofline, environment, markdown_table, measure_roofline, plot_roofline

KERNELS = tuple(k for k in REFERENCE if k != "decode_sustained")  # decode_sustained: rows of decode
GRIDS = {
    "full": dict(
        decode=dict(batches=[1, 2, 4, 64, 128], contexts=[1024, 4096, 8192, 65536, 131072], heads=[16, 128]),
        sparse_decode=dict(batches=[1, 64, 128], heads=[16, 64, 128], topks=[2048], contexts=[8192, 65536]),
        sparse_prefill=dict(s_qs=[4096], contexts=[8192, 65536], heads=[16, 64, 128], topks=[2048]),
        indexer=dict(seqs=[1024, 4096, 8192, 16384]),
    ),
    "quick": dict(
        decode=dict(batches=[64], contexts=[4096], heads=[16, 128]),
        sparse_decode=dict(batches=[64], heads=[128], topks=[2048], contexts=[8192]),
        sparse_prefill=dict(s_qs=[1024], contexts=[8192], heads=[128], topks=[2048]),
        indexer=dict(seqs=[4096]),
    ),
}


def _providers(wanted: list[str] | None, offered) -> list[str]:
    """``offered`` names whose base (``triton-fp8`` -> ``triton``) is in ``wanted`` (all when None)."""
    return [p for p in offered if wanted is None or p.split("-")[0].split("@")[0] in wanted]


def run(
    kernels,
    grid: dict,
    *,
    providers: list[str] | None = None,
    graph: bool = True,
    torch_max_gb: float = 8.0,
    cache_max_gb: float = 40.0,
) -> list[Row]:
    rows: list[Row] = []
    caps = dict(torch_max_gb=torch_max_gb, cache_max_gb=cache_max_gb)
    for fp8, kernel in ((False, "decode"), (True, "decode_fp8")):
        if kernel in kernels:
            print(f"\n## {kernel}")
            rows += decode.run(
                **grid["decode"], fp8=fp8, providers=_providers(providers, decode.PROVIDERS), graph=graph, **caps
            )
    if "sparse_decode" in kernels:
        print("\n## sparse_decode")
        rows += sparse.decode_rows(
            **grid["sparse_decode"], providers=_providers(providers, sparse.DECODE_PROVIDERS), graph=graph, **caps
        )
    if "sparse_prefill" in kernels:
        print("\n## sparse_prefill")
        rows += sparse.prefill_rows(
            **grid["sparse_prefill"],
            torch_max_gb=torch_max_gb,
            providers=_providers(providers, sparse.PREFILL_PROVIDERS),
        )
    if {"indexer", "indexer_graph", "topk"} & set(kernels):
        print("\n## indexer / topk")
        rows += indexer.run(
            **grid["indexer"],
            providers=_providers(providers, indexer.PROVIDERS),
            logits="indexer" in kernels,
            graph="indexer_graph" in kernels,
            topk="topk" in kernels,
        )
    return rows


def write(rows: list[Row], env: dict, out_dir: str) -> str:
    """``bench.md`` and ``bench.json`` under ``out_dir``; returns the markdown."""
    os.makedirs(out_dir, exist_ok=True)
    roof = env.get("roofline") or {}
    head = [
        f"# MLA kernel benchmarks: {env.get('gpu', '?')}",
        "",
        f"driver {env.get('driver')}, torch {env.get('torch')} (CUDA {env.get('cuda')}), triton {env.get('triton')}"
        f"; `{env.get('command', '')}`",
        "",
    ]
    if roof:
        fp8 = f", fp8 matmul {roof['fp8'] / 1e12:.0f} TFLOP/s" if roof.get("fp8") else ""
        head += [
            f"Measured in this run: copy {roof['copy_bw'] / 1e9:.0f} GB/s, bf16 matmul {roof['bf16'] / 1e12:.0f} "
            f"TFLOP/s{fp8}.",
            "",
            "![roofline](roofline.png)",
            "",
        ]
    text = "\n".join(head) + "\n" + markdown_table(rows) + "\n"
    if roof and (judged := targets.section(rows, roof["copy_bw"])):  # issue 18's targets, judged from these rows
        text += "\n" + judged
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"environment": env, "rows": [r.as_dict() for r in rows]}, f, indent=1)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a handful of shapes (under a minute)")
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of {', '.join(KERNELS)}")
    ap.add_argument("--providers", help="comma list of triton, flashmla, deepgemm, torch (default all)")
    ap.add_argument("--out-dir", default="bench")
    ap.add_argument("--no-graphs", action="store_true", help="time decode launches from Python, not graph replays")
    ap.add_argument("--torch-max-gb", type=float, default=8.0, help="skip torch above this many GB of temporaries")
    ap.add_argument("--cache-max-gb", type=float, default=40.0, help="skip decode shapes whose cache is larger")
    args = ap.parse_args(argv)
    kernels = args.kernels.split(",")
    if unknown := set(kernels) - set(KERNELS):
        ap.error(f"unknown kernels {sorted(unknown)}; choose from {', '.join(KERNELS)}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    t0 = time.time()
    roof = measure_roofline(torch.device("cuda"))
    env = environment(roof) | {
        "command": " ".join(["python", *sys.argv]) if argv is None else f"main({argv})",
        "graphs": not args.no_graphs,
    }
    print(f"{env.get('gpu')}: {describe_roofline(roof)}")
    rows = run(
        kernels,
        GRIDS["quick" if args.quick else "full"],
        providers=args.providers.split(",") if args.providers else None,
        graph=not args.no_graphs,
        torch_max_gb=args.torch_max_gb,
        cache_max_gb=args.cache_max_gb,
    )
    env["seconds"] = round(time.time() - t0, 1)
    print()
    print(write(rows, env, args.out_dir))
    plot_roofline(
        rows,
        roof.copy_bw,
        roof.bf16,
        os.path.join(args.out_dir, "roofline.png"),
        fp8_rate=roof.fp8,
        title=f"MLA kernels on {env.get('gpu')} against the roofline measured in the same run",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
