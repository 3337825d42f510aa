"""Valid example calls of every public spec function, for ``tests/test_spec_arguments.py``.

``VALID["module.function"]()`` returns the keyword arguments of one small valid call (every parameter the function
has, optional ones included, unless ``UNSET`` says why not). The test then breaks one argument at a time.

``ALLOWED[("module.function", "argument")]`` lists the generic breakages (``"negative"``, ``"size"``, ...) that are
*valid* values of that argument, each with the convention that makes them valid; ``EXTRA`` adds breakages specific
to one argument (a value out of its documented range, a size that disagrees with another argument).
"""

from __future__ import annotations

import math

import torch

from mlaspec.spec import cache_layouts as cl
from mlaspec.spec import chunked_context as cc
from mlaspec.spec import indexer as ix
from mlaspec.spec.batch import Request, build_metadata
from mlaspec.spec.config import MLAConfig, make_weights
from mlaspec.spec.cost import mla_cost

F64, I32, I64 = torch.float64, torch.int32, torch.int64


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed), dtype=F64)


def ints(*values: int, dtype: torch.dtype = I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


_CONFIG = MLAConfig.tiny()
_WEIGHTS = make_weights(_CONFIG)
_META = build_metadata([Request(2, 1), Request(0, 3)], block_size=2)
_IXCACHE = ix.write_indexer_k_cache(ix.IndexerCacheLayout(4, 8).empty(3), randn(5, 8), ints(0, 1, 2, 5, 9, dtype=I64))
_LAYOUT = cl.FP8_DS_MLA_V32
_ENTRIES = randn(2, 576)
_RAW = cl.quantize(_ENTRIES, _LAYOUT).raw
_PAGES = cl.to_pages(_RAW, _LAYOUT, 2)


def _mla(h: int = 2, t: int = 3, s: int = 4, lkv: int = 8, nope: int = 4, rope: int = 2, d_v: int = 3, b=(1,)) -> dict:
    return dict(
        q_nope=randn(*b, t, h, nope, seed=1),
        q_pe=randn(*b, t, h, rope, seed=2),
        kv_c=randn(*b, s, lkv, seed=3),
        k_pe=randn(*b, s, rope, seed=4),
        W_UK=randn(lkv, h, nope, seed=5),
        W_UV=randn(lkv, h, d_v, seed=6),
    )


def _context(lkv: int = 8, rope: int = 2) -> list:
    return [(randn(2, lkv, seed=7), randn(2, rope, seed=8)), (randn(0, lkv), randn(0, rope))]


VALID = {
    # attention
    "attention.causal_mask": lambda: dict(s_q=2, s_kv=4, device="cpu"),
    "attention.seq_lens_mask": lambda: dict(
        seq_lens=torch.tensor([4, 1], dtype=torch.int32), s_q=2, s_kv=4, causal=True
    ),
    "attention.attention": lambda: dict(
        q=randn(1, 2, 2, 4),
        k=randn(1, 3, 1, 4, seed=1),
        v=randn(1, 3, 1, 3, seed=2),
        scale=0.5,
        causal=True,
        mask=torch.ones(1, 2, 3, dtype=torch.bool),
    ),
    "attention.attention_varlen": lambda: dict(
        q=randn(3, 2, 4),
        k=randn(5, 1, 4, seed=1),
        v=randn(5, 1, 3, seed=2),
        cu_seqlens_q=ints(0, 1, 3),
        cu_seqlens_k=ints(0, 2, 5),
        scale=0.5,
        causal=True,
    ),
    # batch
    "batch.build_metadata": lambda: dict(
        requests=[Request(2, 1), Request(0, 3)],
        block_size=2,
        block_table=ints(0, 1, 2, 3).reshape(2, 2),
        num_blocks=4,
        num_actual_tokens=5,
    ),
    "batch.split_decodes_and_prefills": lambda: dict(
        metadata=_META, decode_threshold=1, require_uniform=False, treat_short_extends_as_decodes=True
    ),
    "batch.request_region": lambda: dict(request=Request(2, 1), decode_threshold=1, regions=4),
    "batch.reorder_batch_to_split_decodes_and_prefills": lambda: dict(
        requests=[Request(0, 3), Request(2, 1)], decode_threshold=1, regions=4
    ),
    "batch.make_local_attention_virtual_batches": lambda: dict(attn_chunk_size=2, metadata=_META, block_size=2),
    # cache layouts
    "cache_layouts.round_to_format": lambda: dict(x=randn(4), fmt=cl.E4M3),
    "cache_layouts.decode_e8m0": lambda: dict(raw=ints(127, 128, 255, dtype=torch.uint8)),
    "cache_layouts.quantize": lambda: dict(
        entries=_ENTRIES, layout=_LAYOUT, scale=None, pow2_scales=True, e8m0_rule="exact"
    ),
    "cache_layouts.dequantize": lambda: dict(raw=_RAW, layout=_LAYOUT, scale=None),
    "cache_layouts.error_bound": lambda: dict(
        entries=_ENTRIES, layout=_LAYOUT, scale=None, pow2_scales=False, e8m0_rule="exact"
    ),
    "cache_layouts.page_bytes": lambda: dict(layout=_LAYOUT, block_size=2),
    "cache_layouts.to_pages": lambda: dict(raw=_RAW, layout=_LAYOUT, block_size=2),
    "cache_layouts.from_pages": lambda: dict(pages=_PAGES, layout=_LAYOUT, block_size=2),
    "cache_layouts.read_tokens": lambda: dict(pages=_PAGES, layout=_LAYOUT, block_size=2, slots=ints(1, -1)),
    "cache_layouts.write_pages": lambda: dict(
        pages=_PAGES,
        entries=_ENTRIES,
        slot_mapping=ints(1, -1),
        layout=_LAYOUT,
        block_size=2,
        scale=None,
        pow2_scales=False,
        e8m0_rule="exact",
    ),
    "cache_layouts.exact_pages": lambda: dict(
        entries=cl.dequantize(_RAW, _LAYOUT).entries, layout=_LAYOUT, block_size=2
    ),
    "cache_layouts.validate_layout": lambda: dict(
        raw=_RAW, layout=_LAYOUT, e8m0_range=(87, 147), fp32_range=(1e-30, 1e6), min_plausible=1.0
    ),
    "cache_layouts.detect_layout": lambda: dict(raw_pages=_PAGES, block_size=2),
    # checks
    "checks.positive_int": lambda: dict(name="n", value=3, minimum=1),
    "checks.finite_float": lambda: dict(name="s", value=0.5),
    "checks.cu_seqlens": lambda: dict(name="cu", x=ints(0, 1, 3), batch=2, batch_from="q"),
    "checks.boolean": lambda: dict(name="flag", value=True),
    "checks.choice": lambda: dict(name="kind", value="a", options=("a", "b")),
    "checks.device": lambda: dict(name="where", value="cpu"),
    "checks.in_range": lambda: dict(name="lens", x=ints(0, 2), lo=0, hi=3),
    "checks.positive_scale": lambda: dict(name="k_scale", value=1.0),
    # chunked context
    "chunked_context.chunked_prefill_workspace_size": lambda: dict(
        max_model_len=4096, max_num_seqs=4, block_size=16, version="0.33"
    ),
    "chunked_context.plan_context_chunks": lambda: dict(
        context_lens=[2, 0], workspace_size=4, block_size=2, align_to_block=True
    ),
    "chunked_context.chunked_prefill_attention": lambda: dict(
        **{k: v for k, v in _mla(t=4, b=()).items() if k not in ("kv_c", "k_pe")},
        kv_c=randn(4, 8, seed=3),
        k_pe=randn(4, 2, seed=4),
        cu_seqlens_q=ints(0, 2, 4),
        context=_context(),
        plan=cc.plan_context_chunks([2, 0], 4, 2),
        scale=0.5,
    ),
    "chunked_context.mla_mixed_batch": lambda: dict(
        **{k: v for k, v in _mla(t=4, b=()).items() if k not in ("kv_c", "k_pe")},
        kv_c=randn(4, 8, seed=3),
        k_pe=randn(4, 2, seed=4),
        metadata=_META,
        context=_context(),
        scale=0.5,
        workspace_size=4,
        decode_threshold=1,
        W_O=randn(6, 5, seed=9),
        align_to_block=True,
    ),
    # config
    "config.yarn_get_mscale": lambda: dict(scale=40.0, mscale=1.0),
    "config.make_weights": lambda: dict(config=_CONFIG, seed=0, dtype=F64),
    # cost
    "cost.attention_pairs": lambda: dict(s_q=2, s_kv=5, causal=True),
    "cost.mla_cost": lambda: dict(
        form="mha", batch=2, s_q=1, s_kv=64, num_heads=16, dtype=torch.bfloat16, config=MLAConfig(), causal=False
    ),
    "cost.time_estimate": lambda: dict(cost=mla_cost("mha", 1, 1, 64), peak_flops=1e15, bandwidth=4e12),
    "cost.crossover": lambda: dict(
        s_kv=1024,
        batch=1,
        num_heads=16,
        dtype=torch.bfloat16,
        config=MLAConfig(),
        causal=False,
        peak_flops=1e15,
        bandwidth=4e12,
    ),
    # forms
    "forms.absorb_query": lambda: {k: v for k, v in _mla().items() if k in ("q_nope", "q_pe", "W_UK")},
    "forms.unabsorb_output": lambda: dict(o_latent=randn(3, 2, 8), W_UV=randn(8, 2, 3)),
    "forms.absorbed_inputs": lambda: {k: v for k, v in _mla().items() if k != "W_UV"},
    "forms.mha_inputs": lambda: _mla(),
    "forms.mqa_latent_attention": lambda: dict(
        q=randn(1, 3, 2, 10),
        kv=randn(1, 4, 10, seed=1),
        d_v=8,
        scale=0.5,
        causal=True,
        mask=None,
        seq_lens=torch.tensor([3], dtype=torch.int32),
    ),
    "forms.mla_absorbed": lambda: dict(**_mla(), scale=0.5, causal=True, mask=None),
    "forms.mla_mha": lambda: dict(**_mla(), scale=0.5, causal=True, mask=None),
    # indexer
    "indexer.indexer_logits": lambda: dict(
        q=randn(2, 3, 8),
        k=randn(4, 8, seed=1),
        weights=randn(2, 3, seed=2),
        ks=ints(0, 1),
        ke=ints(2, 4),
        k_scale=torch.ones(4, dtype=torch.float32),
    ),
    "indexer.fold_indexer_weights": lambda: dict(
        weights=randn(2, 3), q_scale=torch.ones(2, 3, dtype=torch.float32), head_dim=8
    ),
    "indexer.hadamard_rotate": lambda: dict(x=randn(2, 8)),
    "indexer.quantize_indexer_q": lambda: dict(
        q=randn(2, 3, 8), weights=randn(2, 3, seed=1), scale_fmt="ue8m0", eps=1e-10
    ),
    "indexer.quantize_indexer_k": lambda: dict(k=randn(3, 8), scale_fmt="ue8m0", eps=1e-4),
    "indexer.fp8_e4m3_error_bound": lambda: dict(x=randn(3, 8), scale=torch.full((3, 1), 0.01, dtype=torch.float32)),
    "indexer.write_indexer_k_cache": lambda: dict(
        cache=ix.IndexerCacheLayout(4, 8).empty(2),
        k=randn(2, 8),
        slot_mapping=ints(3, -1, dtype=I64),
        scale_fmt="ue8m0",
    ),
    "indexer.read_indexer_k_cache": lambda: dict(cache=_IXCACHE, slots=ints(0, 5, dtype=I64)),
    "indexer.gather_indexer_k_cache": lambda: dict(
        cache=_IXCACHE, block_table=ints(0, 1, 2, 0).reshape(2, 2), seq_lens=ints(3, 2)
    ),
    "indexer.paged_indexer_logits": lambda: dict(
        q=randn(2, 1, 3, 8),
        cache=_IXCACHE,
        block_table=ints(0, 1, 2, 0).reshape(2, 2),
        context_lens=ints(3, 2),
        weights=randn(2, 3, seed=1),
        max_context_len=5,
    ),
    "indexer.compressed_to_absolute": lambda: dict(logits=randn(2, 3), ks=ints(0, 1), ke=ints(2, 4), num_keys=5),
    "indexer.absolute_to_compressed": lambda: dict(logits=randn(2, 5), ks=ints(0, 1), ke=ints(2, 4), width=3),
    "indexer.kv_spans_from_batches": lambda: dict(start_seq_loc=ints(0, 2, 3), seq_len_per_batch=ints(4, 6)),
    "indexer.split_indexer_prefill_chunks": lambda: dict(
        seq_lens=ints(4, 6), query_lens=ints(2, 1), workspace_size=16, max_logits_bytes=1024, request_offset=0
    ),
    "indexer.prefill_chunk_metadata": lambda: dict(
        query_start_loc=ints(0, 2, 3), seq_lens=ints(4, 6), chunk=ix.IndexerPrefillChunk(slice(0, 2), slice(0, 3))
    ),
    "indexer.decode_context_lens_flattened": lambda: dict(seq_lens=ints(10, 7), decode_lens=ints(2, 1)),
    "indexer.decode_context_lens_native": lambda: dict(seq_lens=ints(10, 7), next_n=2),
    # dcp
    "dcp.dcp_owner": lambda: dict(positions=torch.arange(5), world_size=2, interleave=2),
    "dcp.dcp_local_seq_lens": lambda: dict(seq_lens=ints(10, 3), world_size=4, interleave=2, rank=1),
    "dcp.dcp_slot_mapping": lambda: dict(
        block_table=torch.tensor([[5, 9]], dtype=I32),
        block_size=2,
        query_start_loc=ints(0, 6),
        positions=torch.arange(6),
        world_size=2,
        rank=0,
        interleave=1,
    ),
    "dcp.dcp_query_prefix_lens": lambda: dict(seq_lens=ints(5, 1), s_q=2, causal=True),
    "dcp.dcp_shard": lambda: dict(kv=randn(2, 5, 3), seq_lens=ints(5, 2), world_size=2, rank=1, interleave=2),
    "dcp.dcp_partial_attention": lambda: dict(
        q=randn(2, 2, 2, 3, seed=1),
        kv=randn(2, 5, 3),
        seq_lens=ints(5, 2),
        world_size=2,
        rank=1,
        interleave=2,
        d_v=2,
        scale=0.5,
        causal=True,
    ),
    "dcp.dcp_attention": lambda: dict(
        q=randn(2, 2, 2, 3, seed=1),
        kv=randn(2, 5, 3),
        seq_lens=ints(5, 2),
        world_size=2,
        interleave=2,
        d_v=2,
        scale=0.5,
        causal=True,
    ),
    "dcp.dcp_correction": lambda: dict(lses=randn(2, 1, 2, 3), lse_base=math.e),
    "dcp.dcp_combine": lambda: dict(outs=randn(2, 1, 3, 2, 4), lses=randn(2, 1, 2, 3, seed=1), lse_base=math.e),
    "dcp.dcp_combine_ag_rs": lambda: dict(outs=randn(2, 1, 3, 2, 4), lses=randn(2, 1, 2, 3, seed=1), lse_base=math.e),
    "dcp.dcp_combine_a2a": lambda: dict(outs=randn(2, 1, 3, 2, 4), lses=randn(2, 1, 2, 3, seed=1), lse_base=math.e),
    # layer, merge, projections, rope
    "layer.mla_layer": lambda: dict(
        hidden=randn(3, _CONFIG.hidden_size), positions=torch.arange(3), weights=_WEIGHTS, config=_CONFIG, form="mha"
    ),
    "merge.merge_attn_states": lambda: dict(
        prefix_output=randn(3, 2, 4),
        prefix_lse=randn(2, 3, seed=1),
        suffix_output=randn(3, 2, 4, seed=2),
        suffix_lse=randn(2, 3, seed=3),
    ),
    "merge.merge_attn_states_n": lambda: dict(
        outputs=[randn(3, 2, 4), randn(3, 2, 4, seed=1)], lses=[randn(2, 3, seed=2), randn(2, 3, seed=3)]
    ),
    "projections.rms_norm": lambda: dict(x=randn(3, 4), weight=randn(4, seed=1), eps=1e-6),
    "projections.project": lambda: dict(
        hidden=randn(3, _CONFIG.hidden_size), positions=torch.arange(3), weights=_WEIGHTS, config=_CONFIG
    ),
    "projections.output_projection": lambda: dict(o=randn(3, _CONFIG.num_heads, _CONFIG.v_head_dim), weights=_WEIGHTS),
    "rope.inv_freq": lambda: dict(config=_CONFIG),
    "rope.rope_cos_sin": lambda: dict(config=_CONFIG, positions=torch.arange(3)),
    "rope.apply_rope": lambda: dict(
        x=randn(3, 2, _CONFIG.qk_rope_head_dim), positions=torch.arange(3), config=_CONFIG, style="gptj"
    ),
    # paged cache
    "paged_cache.token_positions": lambda: dict(query_start_loc=ints(0, 1, 3), seq_lens=ints(4, 2)),
    "paged_cache.slot_mapping_from_block_table": lambda: dict(
        block_table=ints(0, 1, 2, 3).reshape(2, 2),
        block_size=2,
        query_start_loc=ints(0, 1, 3),
        positions=ints(3, 0, 1),
        num_blocks=4,
        pad_to=4,
    ),
    "paged_cache.concat_and_cache_mla": lambda: dict(
        kv_c=randn(2, 8),
        k_pe=randn(2, 2),
        kv_cache=torch.zeros(2, 2, 10, dtype=F64),
        slot_mapping=ints(3, -1),
        kv_cache_dtype="auto",
        scale=None,
        pow2_scales=False,
    ),
    "paged_cache.gather_cache": lambda: dict(
        kv_cache=randn(3, 2, 4),
        block_table=ints(0, 1, 2, 0).reshape(2, 2),
        cu_seq_lens=ints(0, 3, 4),
        batch_size=2,
        seq_starts=ints(0, 1),
        kernel="cp_gather_cache",
    ),
    "paged_cache.page_entries": lambda: dict(
        kv=randn(2, 3, 4),
        page_size=2,
        seq_lens=ints(3, 1),
        generator=_g(),
        spare_pages=1,
        fill=math.nan,
        spare_column=False,
    ),
    # sliding window
    "sliding_window.layer_kind": lambda: dict(compress_ratio=4),
    "sliding_window.window_mask": lambda: dict(s_q=2, s_kv=4, window=2, device="cpu"),
    "sliding_window.compressed_span": lambda: dict(index=2, compress_ratio=4),
    "sliding_window.num_visible_compressed": lambda: dict(positions=ints(0, 3, 9), compress_ratio=4),
    "sliding_window.compressed_mask": lambda: dict(s_q=2, seq_len=9, compress_ratio=4),
    "sliding_window.swa_indices_and_lens": lambda: dict(
        query_start_loc=ints(0, 1, 3),
        seq_lens=ints(4, 2),
        block_table=ints(0, 1, 2, 3).reshape(2, 2),
        window=2,
        block_size=2,
        is_valid_token=torch.tensor([True, True, False]),
    ),
    "sliding_window.prefill_gather_lens": lambda: dict(seq_lens=ints(10, 3), query_lens=ints(3, 3), window=4),
    "sliding_window.c128a_topk_indices": lambda: dict(
        positions=ints(3, 9), compress_ratio=4, width=3, is_valid_token=torch.tensor([True, False])
    ),
    "sliding_window.combine_topk_swa_indices": lambda: dict(
        topk_indices=ints(0, 1, 1, 0).reshape(2, 2),
        query_start_loc=ints(0, 2),
        seq_lens=ints(9),
        gather_lens=ints(3),
        window=2,
        compress_ratio=4,
        topk=2,
        M=8,
        N=3,
    ),
    "sliding_window.prefill_workspace": lambda: dict(
        raw_kv=[randn(9, 4)], compressed_kv=[randn(2, 4, seed=1)], gather_lens=ints(3), M=8, N=3, fill=math.nan
    ),
    "sliding_window.prefill_chunk_plan": lambda: dict(
        seq_lens=ints(9, 5),
        query_lens=ints(2, 5),
        window=2,
        compress_ratio=4,
        chunk_size=4,
        max_model_len=64,
        max_num_batched_tokens=16,
    ),
    "sliding_window.v4_attention_indices": lambda: dict(
        s_q=2, s_kv=9, window=3, compress_ratio=4, topk_indices=ints(1, 0, 0, 1).reshape(2, 2), num_compressed=2
    ),
    "sliding_window.v4_attention": lambda: dict(
        q=randn(2, 2, 6),
        raw_kv=randn(9, 6, seed=1),
        window=3,
        scale=0.5,
        compressed_kv=randn(2, 6, seed=2),
        compress_ratio=4,
        topk_indices=ints(1, 0, 0, 1).reshape(2, 2),
        attn_sink=randn(2, seed=3),
        d_v=4,
    ),
    # sparse
    "sparse.valid_slots": lambda: dict(indices=ints(0, -1, 2, 1).reshape(2, 1, 2), s_kv=3, topk_length=ints(1, 2)),
    "sparse.indices_to_mask": lambda: dict(indices=ints(0, -1, 2, 1).reshape(2, 1, 2), s_kv=3, topk_length=ints(1, 2)),
    "sparse.sparse_attention": lambda: dict(
        q=randn(2, 2, 6),
        kv=randn(3, 1, 6, seed=1),
        indices=ints(0, -1, 2, 1).reshape(2, 1, 2),
        scale=0.5,
        d_v=4,
        topk_length=ints(1, 2),
        attn_sink=randn(2, seed=2),
        extra_kv=randn(2, 1, 6, seed=3),
        extra_indices=ints(1, 0).reshape(2, 1, 1),
        extra_topk_length=ints(1, 0),
        empty_lse="+inf",
    ),
    "sparse.sparse_prefill": lambda: dict(
        q=randn(2, 2, 6),
        kv=randn(3, 1, 6, seed=1),
        indices=ints(0, -1, 2, 1).reshape(2, 1, 2),
        scale=0.5,
        d_v=4,
        attn_sink=randn(2, seed=2),
        topk_length=ints(1, 2),
    ),
    "sparse.sparse_decode": lambda: dict(
        q=randn(1, 2, 2, 6),
        kv_cache=randn(2, 2, 6, seed=1),
        indices=ints(0, -1, 3, 1).reshape(1, 2, 2),
        scale=0.5,
        d_v=4,
        topk_length=ints(2),
        attn_sink=randn(2, seed=2),
        extra_kv_cache=randn(1, 2, 6, seed=3),
        extra_indices=ints(1, 0).reshape(1, 2, 1),
        extra_topk_length=ints(1),
    ),
    "sparse.global_slot_indices": lambda: dict(
        local_indices=ints(0, 3, -1, 1).reshape(2, 2),
        token_to_req=ints(0, 1),
        block_table=ints(0, 1, 2, 3).reshape(2, 2),
        block_size=2,
    ),
    # top-k
    "topk.topk_indices": lambda: dict(
        logits=randn(2, 5), k=2, row_starts=ints(0, 1), row_ends=ints(4, 5), relative=False
    ),
    "topk.topk_valid_mask": lambda: dict(logits=randn(2, 5), row_starts=ints(0, 1), row_ends=ints(4, 5)),
    "topk.topk_agreement": lambda: dict(
        candidate=ints(1, 2, 3, 4).reshape(2, 2),
        logits=randn(2, 5),
        k=2,
        row_starts=ints(0, 1),
        row_ends=ints(4, 5),
        relative=False,
    ),
}

UNSET: dict[tuple[str, str], str] = {}
"""Parameters a valid call leaves at their default, with the reason."""

_FREE_ROWS = "a free leading size: one more row is another valid call"
_ANY_SHAPE = "any shape is valid"
_NOT_NEGATIVE = "a negative index is padding, read as nothing"
_NAN_FILL = "a NaN or infinite fill is the point (hostile unused slots)"
_ANY_NAME = "any str names an argument"


def _allow(function: str, arg: str, reason: str, *kinds: str) -> None:
    ALLOWED.setdefault((function, arg), {}).update(dict.fromkeys(kinds, reason))


ALLOWED: dict[tuple[str, str], dict[str, str]] = {}
"""Generic breakages that are valid values of an argument: ``{kind: the convention that makes it valid}``."""

for _f in ("boolean", "choice", "cu_seqlens", "device", "finite_float", "in_range", "positive_int", "positive_scale"):
    _allow(f"checks.{_f}", "name", _ANY_NAME, "unknown")
_allow("checks.positive_int", "minimum", "any int is a lower bound", "negative")
_allow("checks.in_range", "x", _ANY_SHAPE + " and any dtype compares", "rank", "size", "dtype")
_allow("checks.in_range", "lo", "any int is a lower bound", "negative")
_allow("attention.seq_lens_mask", "seq_lens", "its length is the batch: one more request is another valid call", "size")
_allow("checks.in_range", "hi", "a negative bound is valid; the values are then what is out of range", "negative")
_allow("checks.choice", "options", "a str is a sequence of its characters", "str")
_allow("cache_layouts.decode_e8m0", "raw", _ANY_SHAPE, "rank", "size")
_allow("cache_layouts.round_to_format", "x", _ANY_SHAPE, "rank", "size")
for _f, _a in (
    ("quantize", "entries"),
    ("error_bound", "entries"),
    ("exact_pages", "entries"),
    ("dequantize", "raw"),
    ("validate_layout", "raw"),
    ("from_pages", "pages"),
    ("read_tokens", "pages"),
    ("write_pages", "pages"),
    ("detect_layout", "raw_pages"),
    ("read_tokens", "slots"),
):
    _allow(f"cache_layouts.{_f}", _a, _FREE_ROWS, "size")
_allow("dcp.dcp_owner", "positions", _ANY_SHAPE + ": each element is a position", "rank", "size")
_allow("dcp.dcp_local_seq_lens", "seq_lens", _ANY_SHAPE + ": each element is a prefix length", "rank", "size")
_allow("dcp.dcp_query_prefix_lens", "seq_lens", _FREE_ROWS, "size")
_allow("dcp.dcp_correction", "lses", "N_cp, B, H_q and S_q are all bound by lses alone", "size")
_allow("forms.absorb_query", "W_UK", "Lkv is bound by W_UK alone", "size")
_allow("forms.unabsorb_output", "o_latent", "leading dimensions are free", "rank", "size")
_allow("indexer.decode_context_lens_native", "seq_lens", _FREE_ROWS, "size")
_allow("indexer.hadamard_rotate", "x", "leading dimensions are free", "rank", "size")
_allow("indexer.fp8_e4m3_error_bound", "x", "any shape scale broadcasts to", "rank")
_allow("indexer.fp8_e4m3_error_bound", "scale", "a leading 1 still broadcasts", "rank")
for _f in ("gather_indexer_k_cache", "paged_indexer_logits", "read_indexer_k_cache", "write_indexer_k_cache"):
    _allow(f"indexer.{_f}", "cache", "NB, the number of pages, is free", "size")
_allow("indexer.quantize_indexer_k", "k", _FREE_ROWS, "size")
_allow("indexer.read_indexer_k_cache", "slots", _FREE_ROWS, "size")
_allow("indexer.split_indexer_prefill_chunks", "seq_lens", "a list of ints is accepted", "list")
_allow("indexer.split_indexer_prefill_chunks", "query_lens", "a list of ints is accepted", "list")
_allow("paged_cache.concat_and_cache_mla", "kv_cache", "NB, the number of pages, is free", "size")
_allow(
    "paged_cache.gather_cache", "kv_cache", "any cache dtype and entry shape [NB, P, *entry], NB free", "dtype", "size"
)
_allow("checks.cu_seqlens", "batch_from", _ANY_NAME, "unknown")
_allow("paged_cache.page_entries", "fill", _NAN_FILL, "nan", "inf")
_allow("sliding_window.prefill_workspace", "fill", _NAN_FILL, "nan", "inf")
_allow("projections.output_projection", "o", _FREE_ROWS, "size")
_allow("projections.rms_norm", "x", "leading dimensions are free", "rank", "size")
_allow("rope.rope_cos_sin", "positions", _FREE_ROWS, "size")
_allow("sliding_window.num_visible_compressed", "positions", _FREE_ROWS, "size")
_allow("sliding_window.v4_attention", "raw_kv", "S_kv is bound by raw_kv alone", "size")
_allow("sliding_window.v4_attention", "compressed_kv", "C >= seq_len // r is free", "size")
_allow("sparse.global_slot_indices", "local_indices", _NOT_NEGATIVE, "negative")
_allow("sparse.global_slot_indices", "block_table", "B, the rows of the table, may exceed the requests", "size")
for _f in ("indices_to_mask", "valid_slots", "sparse_attention", "sparse_prefill"):
    _allow(f"sparse.{_f}", "indices", _NOT_NEGATIVE, "negative")
_allow("sparse.sparse_attention", "extra_indices", _NOT_NEGATIVE, "negative")
for _f in ("sparse_attention", "sparse_prefill"):
    _allow(f"sparse.{_f}", "kv", "S_kv is bound by kv alone", "size")
_allow("sparse.sparse_attention", "extra_kv", "S_extra is bound by extra_kv alone", "size")
_allow("sparse.sparse_decode", "kv_cache", "NB, the number of pages, is free", "size")
_allow("sparse.sparse_decode", "extra_kv_cache", "NB_extra, the number of pages, is free", "size")
_allow("topk.topk_agreement", "candidate", "a wrong candidate is a verdict, not an error", "negative")

EXTRA: dict[tuple[str, str], list[tuple[str, object]]] = {
    ("attention.causal_mask", "s_q"): [("float", 1.5)],
    ("sparse.valid_slots", "s_kv"): [("float", 1.5)],
    ("sparse.valid_slots", "indices"): [("float", torch.tensor([[[0.0, 1.0]], [[2.0, -1.0]]]))],
    ("sparse.sparse_attention", "d_v"): [("> D_qk", 7)],
    ("sliding_window.v4_attention", "d_v"): [("> D_qk", 7), ("negative", -3)],
    ("sliding_window.num_visible_compressed", "compress_ratio"): [("zero-ish", -4)],
    ("sliding_window.compressed_mask", "compress_ratio"): [("negative", -4)],
    ("sliding_window.prefill_chunk_plan", "compress_ratio"): [("negative", -4)],
    ("sliding_window.swa_indices_and_lens", "block_table"): [("negative id", ints(-3, -2, -4, -5).reshape(2, 2))],
    ("sparse.global_slot_indices", "block_table"): [("negative id", ints(-3, -2, -4, -5).reshape(2, 2))],
    ("indexer.paged_indexer_logits", "context_lens"): [("negative length", ints(3, -2))],
    ("cache_layouts.decode_e8m0", "raw"): [("float bytes", torch.tensor([300.0])), ("a float", 300.0)],
    ("sparse.sparse_attention", "topk_length"): [("> K", ints(1, 3))],
    ("paged_cache.concat_and_cache_mla", "scale"): [("per-tensor scale with auto", 1.0)],
    ("paged_cache.concat_and_cache_mla", "pow2_scales"): [("group scale rule with auto", True)],
}
"""Breakages specific to one argument: ``[(what, value)]`` (the issue's list of garbage, among others)."""
