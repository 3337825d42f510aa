"""Curated conformance cases, named after the deployments they stand for.

A case is an op, a name, a dtype, a seed and the op's size parameters; a curated one is reproducible from its id
alone (``op[name-dtype]``), any other (generated, ``--params``) from its op, name, dtype and parameters:
:meth:`Case.repro` is the one command that reruns a case, whichever it is. Sizes come in two scales: ``tiny``
(CPU and the Triton interpreter, seconds) and ``full`` (real DeepSeek dimensions, for GPUs).
"""

from __future__ import annotations

import functools
import json
import shlex
import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case", "case_by_id", "curated_cases"]


@dataclass(frozen=True)
class Case:
    """One conformance case. ``params`` holds the op's sizes (``B, S_q, S_kv, H_q, ...``) and flags."""

    op: str
    name: str
    dtype: str
    params: dict[str, Any] = field(hash=False, compare=False)

    @property
    def id(self) -> str:
        return f"{self.op}[{self.name}-{self.dtype}]"

    @property
    def seed(self) -> int:
        """Derived from the id, so a case draws the same inputs wherever it runs."""
        return zlib.crc32(self.id.encode())

    def is_curated(self, scale: str = "tiny") -> bool:
        """Whether this is the curated case of its id at ``scale`` (the same parameters, not only the same id)."""
        return _curated_params(scale).get((self.op, self.name)) == self.params

    def repro(self, backend: str, scale: str = "tiny") -> str:
        """The one-line command that reruns exactly this case on ``backend``.

        A curated case (:meth:`is_curated` at ``scale``) is named by its id, ``mlaspec check --backend B --case
        'ID'``; any other case (generated, ``--params``) by its parameters, ``mlaspec check --backend B --op OP
        --name NAME --dtypes D --params 'JSON'`` (the name seeds the inputs, so the same tensors come back). Either
        ends in ``--scale full`` at full scale.
        """
        if self.is_curated(scale):
            command = f"mlaspec check --backend {shlex.quote(backend)} --case '{self.id}'"
        else:
            params = json.dumps(self.params, sort_keys=True, separators=(",", ":"))
            command = (
                f"mlaspec check --backend {shlex.quote(backend)} --op {self.op} --name {shlex.quote(self.name)} "
                f"--dtypes {self.dtype} --params {shlex.quote(params)}"
            )
        return command if scale == "tiny" else f"{command} --scale {scale}"


def _cases(scale: str) -> list[tuple[str, str, dict]]:
    full = scale == "full"
    ctx = 4096 if full else 37  # irregular sizes, so padding paths run
    # a table, one case a line or two: kept as written
    # fmt: off
    return [
        # dense attention with LSE: GQA/MQA shapes, causal alignment, empty rows
        ("attention", "mha-causal", dict(B=2, S_q=5, S_kv=5, H_q=4, H_kv=4, D_qk=24, D_v=16, causal=True)),
        ("attention", "mqa-extend", dict(B=1, S_q=3, S_kv=11, H_q=4, H_kv=1, D_qk=24, D_v=16, causal=True)),
        ("attention", "gqa-noncausal", dict(B=2, S_q=4, S_kv=9, H_q=6, H_kv=2, D_qk=8, D_v=8, causal=False)),
        ("attention", "more-queries-than-keys", dict(B=1, S_q=6, S_kv=3, H_q=2, H_kv=1, D_qk=8, D_v=4, causal=True)),
        ("attention", "empty-context", dict(B=1, S_q=2, S_kv=0, H_q=2, H_kv=1, D_qk=8, D_v=4, causal=False)),
        # absorbed decode: DeepSeek-V3 TP1 (128 heads) and TP8 (16 heads), MTP next_n 2 and 4
        ("mla_decode", "v3-tp8", dict(B=4 if full else 2, S_q=1, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True)),
        ("mla_decode", "v3-tp1", dict(B=2, S_q=1, S_kv=ctx, H_q=128 if full else 32, D_qk=576, D_v=512, causal=True)),
        ("mla_decode", "mtp2", dict(B=2, S_q=2, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True)),
        ("mla_decode", "mtp4", dict(B=1, S_q=4, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True)),
        ("mla_decode", "length-1", dict(B=3, S_q=1, S_kv=1, H_q=16, D_qk=576, D_v=512, causal=True)),
        # absorbed decode over an fp8 cache: vLLM's per-tensor e4m3 cache (FlashMLA's dense fp8 kernel), and the
        # 656-byte fp8_ds_mla records (sparse kernels only); q e4m3-representable, scales not powers of two
        ("mla_decode_fp8", "v3-tp8-per-tensor", dict(B=4 if full else 2, S_q=1, S_kv=ctx, H_q=16, D_qk=576, D_v=512,
                                                    causal=True, layout="fp8_e4m3_per_tensor", k_scale=0.046875,
                                                    q_scale=0.15625)),
        ("mla_decode_fp8", "v3-tp1-per-tensor", dict(B=2, S_q=1, S_kv=ctx, H_q=128 if full else 32, D_qk=576,
                                                    D_v=512, causal=True, layout="fp8_e4m3_per_tensor",
                                                    k_scale=0.046875, q_scale=0.15625)),
        ("mla_decode_fp8", "mtp2-per-tensor", dict(B=2, S_q=2, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True,
                                                  layout="fp8_e4m3_per_tensor", k_scale=0.046875,
                                                  q_scale=0.15625)),
        ("mla_decode_fp8", "v32-656-dense", dict(B=2, S_q=1, S_kv=ctx, H_q=16, D_qk=576, D_v=512, causal=True,
                                                layout="fp8_ds_mla_v32", q_scale=0.15625)),
        # compute-friendly prefill: qk 192 / v 128 per head over a 512 latent
        ("mla_prefill", "v3-tp8-chunk", dict(B=1, S_q=7 if not full else 512, S_kv=(7 if not full else 512) + ctx,
                                             H_q=16, Lkv=512, P=128, R=64, V=128, causal=True)),
        ("mla_prefill", "tiny-noncausal", dict(B=2, S_q=5, S_kv=13, H_q=4, Lkv=32, P=16, R=8, V=16, causal=False)),
        # the whole absorbed decode form; TP1 has N = V = 128 heads, so a transposed W_UV still fits its shape
        ("mla_absorbed", "v3-tp8-mtp2", dict(B=2, S_q=2, S_kv=ctx, H_q=16, Lkv=512, P=128, R=64, V=128, causal=True)),
        ("mla_absorbed", "n-equals-v", dict(B=1, S_q=1, S_kv=ctx, H_q=128 if full else 16, Lkv=512 if full else 64,
                                            P=128 if full else 16, R=64 if full else 8, V=128 if full else 16,
                                            causal=True)),
        # merge_attn_states: vLLM's layouts, some parts empty (±inf)
        ("merge_attn_states", "tp8", dict(T=9, H=16, D=512, empty=0.0)),
        ("merge_attn_states", "empty-parts", dict(T=7, H=4, D=128, empty=0.4)),
        # serving: paged cache writes (NaN in unused slots, padding slots -1), fp8 layouts, gathers
        ("concat_and_cache_mla", "v3-bf16-page64-padding",
         dict(T=300 if full else 13, pad=20 if full else 3, P=64 if full else 16, num_blocks=12 if full else 3,
              kv_cache_dtype="auto")),
        ("concat_and_cache_mla", "v3-fp8-per-tensor",
         dict(T=300 if full else 13, pad=4, P=64 if full else 16, num_blocks=12 if full else 3,
              kv_cache_dtype="fp8", scale=0.09375)),
        ("concat_and_cache_mla", "v32-fp8-ds-mla-656",
         dict(T=300 if full else 13, pad=4, P=64 if full else 16, num_blocks=12 if full else 3,
              kv_cache_dtype="fp8_ds_mla")),
        ("gather_cache", "v3-context-chunk-seq-starts",
         dict(P=64 if full else 16, lens=[300, 0, 1000, 64] if full else [5, 0, 21, 9],
              starts=[70, 5, 640, 1000] if full else [3, 7, 16, 40])),
        ("gather_cache", "v3-dequant-gather-aligned",
         dict(P=64 if full else 16, lens=[100, 640, 33] if full else [7, 16, 19],
              starts=[0, 64, 640] if full else [0, 16, 32], kernel="gather_and_maybe_dequant_cache")),
        ("gather_cache", "v32-fp8-ds-mla-raw",
         dict(P=64 if full else 16, lens=[130, 700, 9] if full else [6, 13, 4],
              starts=[1, 0, 65] if full else [1, 0, 9], entry="fp8_ds_mla")),
        ("slot_mapping_from_block_table", "mixed-batch-cudagraph-pad",
         dict(P=64 if full else 16, pad=5, requests=(mixed := [[0, 9, 9], [12, 1, 5], [8, 7, 20], [30, 2, 10],
              [6, 3, 16], [0, 1, 7], [40, 4, 33], [3, 1, None], [0, 13, 13]]))),
        ("quantize", "v32-656", dict(T=6, layout="fp8_ds_mla_v32")),
        ("quantize", "v4-584", dict(T=6, layout="fp8_ds_mla_v4")),
        ("quantize", "v41-528", dict(T=6, layout="mxfp8_ds_mla_v41")),
        ("quantize", "fp8-per-tensor", dict(T=6, layout="fp8_e4m3_per_tensor", scale=0.09375)),
        ("dequantize", "v32-656", dict(T=6, layout="fp8_ds_mla_v32")),
        ("dequantize", "v4-584", dict(T=6, layout="fp8_ds_mla_v4")),
        ("dequantize", "v41-528", dict(T=6, layout="mxfp8_ds_mla_v41")),
        ("dequantize", "fp8-per-tensor", dict(T=6, layout="fp8_e4m3_per_tensor", scale=0.09375)),
        ("write_pages", "v4-584-paged", dict(T=40 if full else 13, pad=2, P=64 if full else 16, num_blocks=3,
                                             layout="fp8_ds_mla_v4")),
        ("write_pages", "v41-528-paged", dict(T=40 if full else 13, pad=2, P=64 if full else 16, num_blocks=3,
                                              layout="mxfp8_ds_mla_v41")),
        ("write_pages", "v32-656-paged", dict(T=40 if full else 13, pad=2, P=64 if full else 16, num_blocks=3,
                                              layout="fp8_ds_mla_v32")),
        ("read_tokens", "v4-584-paged", dict(T=40 if full else 13, P=64 if full else 16, num_blocks=3, N=12,
                                             layout="fp8_ds_mla_v4")),
        ("read_tokens", "v41-528-paged", dict(T=40 if full else 13, P=64 if full else 16, num_blocks=3, N=12,
                                              layout="mxfp8_ds_mla_v41")),
        # serving: chunked-prefill context (3+ chunks, a prefill without context), batch metadata
        ("chunked_prefill_attention", "v3-workspace-chunks-no-context",
         dict(H_q=16, Lkv=512, P=128, R=64, V=128, contexts=[4096, 0, 1000, 300], q_lens=[64, 128, 17, 33],
              block_size=64, workspace_size=2048) if full else
         dict(H_q=4, Lkv=32, P=16, R=8, V=16, contexts=[37, 0, 20, 9], q_lens=[3, 5, 1, 4], block_size=4,
              workspace_size=24)),
        ("chunked_prefill_attention", "first-chunks-only",
         dict(H_q=4, Lkv=32, P=16, R=8, V=16, contexts=[0, 0], q_lens=[4, 2], block_size=4, workspace_size=16)),
        # one MLA step over a mixed batch from a paged cache: decodes (MTP query_len 2) through the absorbed form,
        # prefills with and without context through a workspace smaller than the longest context (3+ chunks)
        ("mla_mixed_batch", "v3-tp8-mixed-mtp2-chunked",
         dict(H_q=16, Lkv=512, P=128, R=64, V=128, block_size=64, workspace_size=2048, decode_threshold=2,
              requests=[[4096, 1], [3000, 2], [1, 2], [777, 1], [3000, 64], [0, 128], [700, 33], [0, 1]])
         if full else
         dict(H_q=4, Lkv=32, P=16, R=16, V=16, block_size=16, workspace_size=32, decode_threshold=2,
              requests=[[37, 1], [20, 2], [5, 2], [16, 1], [40, 5], [0, 4], [19, 3], [0, 1]])),
        ("mla_mixed_batch", "v3-tp1-decodes-only-mtp2",
         dict(H_q=128 if full else 16, Lkv=512 if full else 32, P=128 if full else 16, R=64 if full else 16,
              V=128 if full else 16, block_size=64 if full else 16, workspace_size=2048 if full else 32,
              decode_threshold=2, requests=[[ctx, 2], [ctx // 3, 2], [0, 1], [65, 1]])),
        ("mla_mixed_batch", "prefills-only-long-context",
         dict(H_q=16, Lkv=512, P=128, R=64, V=128, block_size=64, workspace_size=4096, decode_threshold=1,
              requests=[[8000, 100], [64, 200], [0, 50]])
         if full else
         dict(H_q=4, Lkv=32, P=16, R=16, V=16, block_size=16, workspace_size=32, decode_threshold=1,
              requests=[[50, 6], [3, 9], [0, 7]])),
        ("build_metadata", "v3-mixed-default-pages", dict(P=64 if full else 16, requests=mixed)),
        ("build_metadata", "mixed-shuffled-table", dict(P=64 if full else 4, requests=mixed, shuffle=True)),
        ("split_decodes_and_prefills", "mtp4-mixed",
         dict(P=16, decode_threshold=4, requests=(reordered := [[12, 1, 5], [30, 2, 10], [40, 4, 33], [3, 1, None],
              [6, 3, 16], [8, 7, 20], [0, 9, 9], [0, 1, 7], [0, 13, 13]]))),
        ("split_decodes_and_prefills", "mtp4-short-extends-as-prefills",
         dict(P=16, decode_threshold=4, requests=reordered, treat_short_extends_as_decodes=False)),
        ("split_decodes_and_prefills", "mtp4-require-uniform",
         dict(P=16, decode_threshold=4, requests=reordered, require_uniform=True)),
        ("split_decodes_and_prefills", "mtp2-uniform-cudagraph-pad",
         dict(P=16, decode_threshold=2, requests=[[5, 2, None], [7, 2, None], [9, 0, None]], require_uniform=True)),
        ("split_decodes_and_prefills", "uniform-padding-row-before-prefill",  # vLLM 0.33: q = 0 is never a prefill
         dict(P=16, decode_threshold=1, requests=[[30, 1, None], [15, 0, None], [7, 1, None], [0, 2, None]],
              require_uniform=True)),
        ("reorder_batch_to_split_decodes_and_prefills", "mtp4-mixed-4-regions",
         dict(requests=mixed, decode_threshold=4, regions=4)),
        ("reorder_batch_to_split_decodes_and_prefills", "mtp4-mixed-2-regions",
         dict(requests=mixed, decode_threshold=4, regions=2)),
        ("reorder_batch_to_split_decodes_and_prefills", "decode-1-2-regions",
         dict(requests=mixed, decode_threshold=1, regions=2)),
        ("make_local_attention_virtual_batches", "seed-example-chunk4",
         dict(attn_chunk_size=4, P=2, requests=[[2, 4, None], [7, 10, None], [4, 5, None]],
              block_table=[list(range(10 * b, 10 * b + 10)) for b in range(3)])),
        ("make_local_attention_virtual_batches", "chunk8-shuffled",
         dict(attn_chunk_size=8, P=4, requests=mixed, shuffle=True)),
        # sparse MLA prefill (FlashMLA flash_mla_sparse_fwd): V3.2 top-2048 (tiny: 64), invalid sentinels, sinks.
        # Full sizes keep S_q * K * H_q small: the float64 reference materialises the gathered keys per query head.
        ("sparse_prefill", "v32-top2048", dict(S_q=3 if full else 4, S_kv=ctx if full else 150, H_q=64 if full else 8,
                                               H_kv=1, D_qk=576, D_v=512, K=2048 if full else 64)),
        ("sparse_prefill", "topk-length-shorter", dict(S_q=8 if full else 5, S_kv=ctx if full else 90,
                                                       H_q=16 if full else 8, H_kv=1, D_qk=576, D_v=512,
                                                       K=2048 if full else 32, topk_length=True)),
        ("sparse_prefill", "empty-rows", dict(S_q=5, S_kv=ctx if full else 60, H_q=16 if full else 4, H_kv=1,
                                              D_qk=576, D_v=512, K=2048 if full else 24, topk_length=True,
                                              empty=2)),
        ("sparse_prefill", "sink-finite", dict(S_q=4, S_kv=ctx if full else 60, H_q=16 if full else 4, H_kv=1,
                                               D_qk=576, D_v=512, K=2048 if full else 24, sink="finite")),
        ("sparse_prefill", "sink-inf-empty", dict(S_q=4, S_kv=ctx if full else 60, H_q=16 if full else 4, H_kv=1,
                                                  D_qk=576, D_v=512, K=2048 if full else 24, sink="inf",
                                                  empty=1)),
        ("sparse_prefill", "v4-d512", dict(S_q=4, S_kv=ctx if full else 50, H_q=64 if full else 4,
                                           H_kv=1, D_qk=512, D_v=512, K=640 if full else 24, topk_length=True,
                                           sink="finite")),
        # sparse MLA decode over a paged cache (flash_mla_with_kvcache with indices): V3.2 and V4 with extra cache
        ("sparse_decode", "v32-top2048", dict(B=2, S_q=1, S_kv=ctx if full else 150,
                                              H_q=64 if full else 8, D_qk=576, D_v=512, K=2048 if full else 64,
                                              P=64, fp8_cache=True)),
        ("sparse_decode", "v32-mtp2", dict(B=3, S_q=2, S_kv=ctx if full else 100, H_q=32 if full else 4, D_qk=576,
                                           D_v=512, K=2048 if full else 32, P=64, short_request=True,
                                           topk_length=True)),
        ("sparse_decode", "topk-length-empty", dict(B=3, S_q=1, S_kv=ctx if full else 70, H_q=16 if full else 4,
                                                    D_qk=576, D_v=512, K=2048 if full else 24, P=64,
                                                    topk_length=True, empty=1, sink="inf")),
        ("sparse_decode", "v4-swa-c4a", dict(B=3, S_q=1, S_kv=ctx if full else 60, H_q=64 if full else 4, D_qk=512,
                                             D_v=512, P=64, layer=4, window=128 if full else 8, P_extra=64,
                                             K_extra=512 if full else 8, sink="finite", fp8_cache=True)),
        ("sparse_decode", "v4-c128a-mtp2", dict(B=2, S_q=2, S_kv=8192 if full else 300, H_q=64 if full else 4,
                                                D_qk=512, D_v=512, P=64, layer=128, window=128 if full else 8,
                                                P_extra=64, K_extra=64 if full else 4, sink="finite",
                                                fp8_cache=True)),
        # one DeepSeek V4 layer: sliding window (W = 128, tiny 8) over raw keys, plus compressed entries
        ("v4_attention", "swaonly", dict(S_q=1, S_kv=ctx + 37 if full else 37, H_q=64 if full else 8, D_qk=512,
                                         D_v=512, window=128 if full else 8, layer=1, sink="finite")),
        ("v4_attention", "c4a-mtp2", dict(S_q=2, S_kv=ctx + 37 if full else 45, H_q=64 if full else 8, D_qk=512,
                                          D_v=512, window=128 if full else 8, layer=4, K=512 if full else 4,
                                          sink="finite")),
        ("v4_attention", "c128a-mtp2", dict(S_q=2, S_kv=ctx if full else 256, H_q=64 if full else 8, D_qk=512,
                                            D_v=512, window=128 if full else 8, layer=128, sink="inf")),
        ("v4_attention", "prefill-shorter-than-window", dict(S_q=5, S_kv=5, H_q=8, D_qk=512, D_v=512,
                                                             window=128 if full else 8, layer=1)),
        # lightning indexer (DeepGEMM fp8_mqa_logits / fp8_paged_mqa_logits) and the top-k over its logits
        ("indexer_logits", "v32-prefill-ragged", dict(H=64 if full else 8, D=128,
                                                      query_lens=[64, 16, 7] if full else [3, 1, 4],
                                                      seq_lens=[2048, 300, 7] if full else [5, 9, 4],
                                                      empty=True)),
        ("indexer_logits", "one-request", dict(H=64 if full else 8, D=128, query_lens=[32 if full else 6],
                                               seq_lens=[ctx if full else 40])),
        ("paged_indexer_logits", "v32-decode", dict(B=8 if full else 3, next_n=1, S_kv=ctx if full else 37,
                                                    P=64 if full else 16, H=64 if full else 8, D=128)),
        ("paged_indexer_logits", "v32-mtp2", dict(B=4 if full else 3, next_n=2, S_kv=ctx if full else 37,
                                                  P=64 if full else 16, H=64 if full else 8, D=128,
                                                  padded=True)),
        ("topk_indices", "v32-prefill-ties", dict(mode="prefill", K=2048 if full else 16,
                                                  query_lens=[8, 4] if full else [3, 1, 4, 2],
                                                  seq_lens=[4096, 1000] if full else [40, 9, 30, 20])),
        ("topk_indices", "v32-decode-ties", dict(mode="decode", M=8 if full else 9, N=ctx + 37 if full else 70,
                                                 K=2048 if full else 16)),
        ("topk_indices", "short-rows", dict(mode="decode", M=5, N=10, K=2048 if full else 16)),
    ]
    # fmt: on


def curated_cases(
    *, scale: str = "tiny", dtypes: tuple[str, ...] = ("bfloat16", "float16"), ops: tuple[str, ...] | None = None
) -> list[Case]:
    """The curated case list (the same for ``mlaspec check`` and the pytest plugin)."""
    if scale not in ("tiny", "full"):
        raise ValueError(f"scale must be 'tiny' or 'full', got {scale!r}")
    return [
        Case(op, name, dtype, params)
        for op, name, params in _cases(scale)
        if ops is None or op in ops
        for dtype in dtypes
    ]


@functools.cache
def _curated_params(scale: str) -> dict[tuple[str, str], dict]:
    """``(op, name) -> params`` of the curated cases at ``scale``, built once (read it, never change it)."""
    if scale not in ("tiny", "full"):
        raise ValueError(f"scale must be 'tiny' or 'full', got {scale!r}")
    return {(op, name): params for op, name, params in _cases(scale)}


def case_by_id(case_id: str, *, scale: str = "tiny") -> Case:
    """The case named ``op[name-dtype]`` (as printed in a reproducer)."""
    for dtype in ("bfloat16", "float16", "float32"):
        for case in curated_cases(scale=scale, dtypes=(dtype,)):
            if case.id == case_id:
                return case
    raise ValueError(f"case_id {case_id!r} names no curated case at scale {scale!r}")
