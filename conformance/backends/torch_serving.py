"""The torch backend's serving ops (a mixin of :class:`~mlaspec.conformance.backends.torch_eager.TorchBackend`).

Written the way the kernels work, independently of the spec functions (which the harness compares against):
writers quantize in fp32 (``x / s`` then a saturating cast to e4m3, as vLLM's ``scaled_convert``; fp32 scales
``amax / 448``, or powers of two ``2^ceil(log2(max(amax / 448, 1e-4)))`` when asked; e8m0 scales from ``frexp``),
gathers index the block table, chunked prefill runs the context chunk by chunk through :meth:`mla_prefill` and
folds the parts with :meth:`merge_attn_states` (outputs in the case dtype, LSE in fp32), a mixed batch writes its
new tokens into the cache, then runs the decodes through :meth:`mla_absorbed` and the prefills through the chunked
path with the context read through the block table, and the batch metadata is computed with tensor ops
(``searchsorted`` for the request of each token). Only the layout *records*
(:class:`~mlaspec.spec.cache_layouts.CacheLayout`: offsets, dtypes, group sizes) and the plain input records
(``Request``, ``ChunkPlan``, ``CommonAttentionMetadata``) are shared with the spec.

The small ``_``-methods are the places real kernels get wrong; the serving mutants
(``tests/test_mutants_serving.py``) override them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mlaspec.spec.cache_layouts import LAYOUTS, CacheLayout
from mlaspec.spec.chunked_context import ChunkPlan


def _ceil_log2(y: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(y))`` of ``y > 0`` (int32): ``y = m 2^e`` with ``m`` in ``[0.5, 1)``, one less at a power of two."""
    m, e = torch.frexp(y)
    return torch.where(m == 0.5, e - 1, e)


_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
_VERBATIM = {"bf16": torch.bfloat16, "fp16": torch.float16}  # unquantized fields (the 656-byte record's RoPE)
_CACHE_DTYPES = {
    "fp8": "fp8_e4m3_per_tensor",
    "fp8_e4m3": "fp8_e4m3_per_tensor",
    "fp8_e5m2": "fp8_e5m2_per_tensor",
    "fp8_ds_mla": "fp8_ds_mla_v32",
}


class ReorderResult(NamedTuple):
    order: tuple[int, ...]
    regions: tuple[int, ...]
    modified: bool
    swaps: tuple[tuple[int, int], ...]


class MetadataResult(NamedTuple):
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    is_prefilling: torch.Tensor


def _layout(layout) -> CacheLayout:
    return LAYOUTS[layout] if isinstance(layout, str) else layout


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class TorchServing:
    """Eager-torch implementations of the serving ops, rounding where a fused kernel rounds."""

    # -- helpers a kernel can get wrong ---------------------------------------------------------------------
    def _entries(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """One cache entry per token: the latent first, then the rope part."""
        return torch.cat([kv_c, k_pe], dim=-1)

    def _scale_for_group(self, scales: torch.Tensor) -> torch.Tensor:
        """``[T, G]`` group scales -> the scale each value group is divided by (group g uses scale g)."""
        return scales

    def _fp32_scale(self, amax: torch.Tensor, max_q: float) -> torch.Tensor:
        """vLLM's fp32 group scale of the 656-byte layout: ``max(amax / 448, FLT_MIN)``, divided in fp32."""
        return (amax / max_q).clamp_min(torch.finfo(torch.float32).tiny)

    def _pow2_scale(self, amax: torch.Tensor, max_q: float) -> torch.Tensor:
        """vLLM's group scale after PR #49435 (FlashMLA ``tests/quant.py``): ``2^ceil(log2(max(amax / 448, 1e-4)))``,
        the exponent read off ``frexp`` (fp32 ``log2`` can land on ``k`` just above ``2^k``)."""
        pow2 = torch.exp2(_ceil_log2((amax / max_q).clamp_min(1e-4)))
        return torch.where(torch.isfinite(amax), pow2, amax)  # inf / NaN stay (log2 of them would)

    def _token_requests(self, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The request of every packed token: ``b`` with ``qsl[b] <= t < qsl[b + 1]``."""
        return torch.searchsorted(query_start_loc[1:].long(), torch.arange(num_tokens), right=True)

    def _record_index(self, layout: CacheLayout, block_size: int) -> torch.Tensor:
        """``[P, token_bytes]``: the byte of the page block holding byte ``j`` of token ``t``'s record."""
        t = torch.arange(block_size)[:, None]
        j = torch.arange(layout.token_bytes)[None, :]
        if layout.split_at is None:  # token-interleaved
            return t * layout.token_bytes + j
        data, tail = layout.split_at, layout.token_bytes - layout.split_at  # data rows, then scale rows
        return torch.where(j < data, t * data + j, block_size * data + t * tail + (j - data))

    # -- quantization ---------------------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, layout: CacheLayout, scale, pow2_scales: bool = False) -> torch.Tensor:
        """``[T, D]`` entries -> ``[T, token_bytes]`` uint8 records, in fp32 as a kernel does (``pow2_scales``:
        power-of-two fp32 group scales, :meth:`_pow2_scale`)."""
        x = x.float()
        t = x.shape[0]
        out = torch.zeros(t, layout.token_bytes, dtype=torch.uint8, device=x.device)
        for f in layout.value_fields:
            a, b = f.elements
            v = x[:, a:b]
            if f.dtype in _VERBATIM:  # stored verbatim
                out[:, f.offset : f.end] = _u8(v.to(_VERBATIM[f.dtype]))
                continue
            top = _FP8_MAX[f.dtype]
            if f.group is None:  # per-tensor scale
                s = torch.tensor(float(scale), dtype=torch.float32)
                q = (v / s).clamp(-top, top)
            else:
                n = (b - a) // f.group
                g = v.reshape(t, n, f.group)
                amax = g.abs().amax(-1)
                sf = layout.field(f.scale_field)
                if sf.dtype == "e8m0":
                    e = _ceil_log2(amax.clamp_min(layout.scale_rule.amax_floor) / layout.scale_rule.max_q)
                    code = (e + 127).clamp(0, 255)
                    s = torch.exp2(code.float() - 127)
                    out[:, sf.offset : sf.end] = code.to(torch.uint8)
                else:
                    rule = self._pow2_scale if pow2_scales else self._fp32_scale
                    s = rule(amax, layout.scale_rule.max_q)
                    out[:, sf.offset : sf.end] = _u8(s).reshape(t, -1)
                q = (g / self._scale_for_group(s)[..., None]).clamp(-top, top).reshape(t, b - a)
            out[:, f.offset : f.end] = _u8(q.to(_FP8[f.dtype]))
        return out

    def _decode(self, raw: torch.Tensor, layout: CacheLayout, scale) -> torch.Tensor:
        """``[T, token_bytes]`` uint8 -> ``[T, D]`` float32."""
        t = raw.shape[0]
        out = torch.empty(t, layout.entry_dim, dtype=torch.float32, device=raw.device)
        for f in layout.value_fields:
            a, b = f.elements
            field = raw[:, f.offset : f.end].contiguous()
            if f.dtype in _VERBATIM:
                out[:, a:b] = field.view(_VERBATIM[f.dtype]).float()
                continue
            v = field.view(_FP8[f.dtype]).float()
            if f.group is None:
                out[:, a:b] = v * float(scale)
                continue
            sf = layout.field(f.scale_field)
            sb = raw[:, sf.offset : sf.end].contiguous()
            if sf.dtype == "e8m0":
                s = torch.where(sb == 255, math.nan, torch.exp2(sb.float() - 127))
            else:
                s = sb.view(torch.float32)
            out[:, a:b] = (v.reshape(t, -1, f.group) * s[..., None]).reshape(t, b - a)
        return out

    def quantize(self, entries, layout, *, scale=None, pow2_scales=False):
        if pow2_scales:
            raise NotImplementedError("pow2_scales (FlashMLA's test quantizer) is not implemented")
        return (self._encode(entries, _layout(layout), scale),)

    def dequantize(self, raw, layout, *, scale=None):
        return (self._decode(raw, _layout(layout), scale),)

    # -- paged cache ----------------------------------------------------------------------------------------
    def concat_and_cache_mla(
        self, kv_c, k_pe, kv_cache, slot_mapping, *, kv_cache_dtype="auto", scale=None, pow2_scales=False
    ):
        new = kv_cache.clone()
        flat = new.view(kv_cache.shape[0] * kv_cache.shape[1], -1)
        s = slot_mapping.long()
        keep = s >= 0  # padding tokens write nothing
        x = self._entries(kv_c, k_pe)[keep]
        if kv_cache_dtype == "auto":
            flat[s[keep]] = x.to(kv_cache.dtype)
        else:
            name = _CACHE_DTYPES[kv_cache_dtype]
            if kv_cache_dtype == "fp8_ds_mla":  # the RoPE in the input dtype; vLLM's k_scale is not read
                name, scale = ("fp8_ds_mla_v32_fp16" if k_pe.dtype == torch.float16 else name), None
            flat[s[keep]] = self._encode(x, LAYOUTS[name], scale, pow2_scales)
        return (new,)

    def gather_cache(
        self, kv_cache, block_table, cu_seq_lens, batch_size=None, seq_starts=None, *, kernel="cp_gather_cache"
    ):
        p = kv_cache.shape[1]
        cu = cu_seq_lens.long()
        b = block_table.shape[0] if batch_size is None else batch_size
        rows = []
        for r in range(b):
            n = int(cu[r + 1] - cu[r])
            start = 0 if seq_starts is None else int(seq_starts[r])
            i = torch.arange(n)
            if kernel == "gather_and_maybe_dequant_cache":  # block table offset by whole blocks
                pages = block_table[r, start // p + i // p].long()
                offsets = i % p
            else:
                pages = block_table[r, (start + i) // p].long()
                offsets = (start + i) % p
            rows.append(kv_cache[pages, offsets])
        return (torch.cat(rows) if rows else kv_cache.new_empty(0, *kv_cache.shape[2:]),)

    def slot_mapping_from_block_table(
        self, block_table, block_size, query_start_loc, positions, *, num_blocks=None, pad_to=None
    ):
        t = positions.numel()
        req = self._token_requests(query_start_loc, t)
        pos = positions.long()
        blocks = block_table.long()[req, pos // block_size]
        offsets = pos % block_size
        pad = torch.full(((pad_to or t) - t,), -1, dtype=torch.int64)
        return torch.cat([blocks * block_size + offsets, pad]), torch.cat([blocks, pad]), torch.cat([offsets, pad])

    def write_pages(self, pages, entries, slot_mapping, layout, block_size, *, scale=None, pow2_scales=False):
        if pow2_scales:
            raise NotImplementedError("pow2_scales (FlashMLA's test quantizer) is not implemented")
        layout = _layout(layout)
        new = pages.clone()
        s = slot_mapping.long()
        keep = s >= 0
        records = self._encode(entries[keep], layout, scale)  # [W, token_bytes]
        idx = self._record_index(layout, block_size)[s[keep] % block_size]  # [W, token_bytes]
        new[(s[keep] // block_size)[:, None], idx] = records
        return (new,)

    def read_tokens(self, pages, layout, block_size, slots):
        layout = _layout(layout)
        s = slots.long()
        valid = s >= 0
        sc = s.clamp(min=0)
        idx = self._record_index(layout, block_size)[sc % block_size]
        raw = pages[(sc // block_size)[:, None], idx]
        return torch.where(valid[:, None], raw, 0).to(torch.uint8), valid

    # -- chunked prefill ------------------------------------------------------------------------------------
    def chunked_prefill_attention(self, q_nope, q_pe, kv_c, k_pe, cu_seqlens_q, context, plan, W_UK, W_UV, *, scale):
        dtype, dev = q_nope.dtype, getattr(self, "device", q_nope.device)
        q_nope, q_pe, kv_c, k_pe, W_UK, W_UV = (x.to(dev) for x in (q_nope, q_pe, kv_c, k_pe, W_UK, W_UV))
        cu = cu_seqlens_q.long()
        n_heads, v_dim = W_UV.shape[1], W_UV.shape[2]
        out = torch.zeros(q_nope.shape[0], n_heads, v_dim, dtype=dtype, device=dev)
        lse = torch.full((n_heads, q_nope.shape[0]), -math.inf, dtype=torch.float32, device=dev)

        def rows(b, start, length):  # this request's rows of the workspace
            if callable(context):
                ckv, cpe = context(b, start, length)
            else:
                ckv, cpe = context[b]
                ckv, cpe = ckv[start : start + length], cpe[start : start + length]
            return ckv.to(dev), cpe.to(dev)

        for b in range(cu.numel() - 1):
            qs, qe = int(cu[b]), int(cu[b + 1])
            if qe == qs:
                continue
            qn, qp = q_nope[None, qs:qe], q_pe[None, qs:qe]
            run = None
            for i in range(plan.num_chunks):  # the workspace: this request's rows of chunk i
                length = int(plan.seq_lens[i, b])
                if length == 0:
                    part = (
                        torch.zeros(qe - qs, n_heads, v_dim, dtype=dtype, device=dev),
                        torch.full((n_heads, qe - qs), -math.inf, dtype=torch.float32, device=dev),
                    )
                else:
                    ckv, cpe = rows(b, int(plan.starts[i, b]), length)
                    o, l = self.mla_prefill(qn, qp, ckv[None], cpe[None], W_UK, W_UV, scale=scale, causal=False)
                    part = (o[0], l[0])
                run = part if run is None else self.merge_attn_states(run[0], run[1], part[0], part[1])
            o, l = self.mla_prefill(qn, qp, kv_c[None, qs:qe], k_pe[None, qs:qe], W_UK, W_UV, scale=scale, causal=True)
            o, l = o[0], l[0]
            if run is not None:
                o, l = self.merge_attn_states(run[0], run[1], o, l)
            out[qs:qe], lse[:, qs:qe] = o, l
        return out, lse

    # -- one step over a mixed batch -------------------------------------------------------------------------
    def _context_plan(self, context_lens: torch.Tensor, workspace_size: int, block_size: int) -> ChunkPlan:
        """vLLM's chunk plan: every prefill with context gets ``round_down(workspace / #with_context, P)`` rows."""
        ctx = context_lens.long().cpu()
        b = ctx.numel()
        with_ctx = int((ctx > 0).sum())
        width = workspace_size // max(with_ctx, 1) // block_size * block_size
        n = -(-int(ctx.max()) // width) if with_ctx else 0
        starts = (torch.arange(n)[:, None] * width).expand(n, b).clone()
        seq_lens = (torch.minimum(ctx[None, :], starts + width) - starts).clamp(min=0)
        cu = torch.cat([torch.zeros(n, 1, dtype=torch.int64), torch.cumsum(seq_lens, 1)], 1)
        return ChunkPlan(
            ctx,
            workspace_size,
            block_size,
            width,
            starts,
            seq_lens,
            cu,
            tuple(cu[:, -1].tolist()),
            tuple(seq_lens.amax(1).tolist()) if b else (0,) * n,
        )

    def mla_mixed_batch(
        self, q_nope, q_pe, kv_c, k_pe, metadata, kv_cache, W_UK, W_UV, *, scale, workspace_size, decode_threshold=1
    ):
        """As a serving layer: write the new tokens into the cache, decodes through :meth:`mla_absorbed` over the
        cache, prefills through :meth:`chunked_prefill_attention` with the context read from the cache."""
        dev = getattr(self, "device", q_nope.device)
        (cache,) = self.concat_and_cache_mla(kv_c, k_pe, kv_cache, metadata.slot_mapping)  # new tokens first
        cache = cache.to(dev)
        q_nope, q_pe, kv_c, k_pe, W_UK, W_UV = (x.to(dev) for x in (q_nope, q_pe, kv_c, k_pe, W_UK, W_UV))
        lkv, p = kv_c.shape[1], cache.shape[1]
        table = metadata.block_table.long().to(dev)
        qsl = metadata.query_start_loc.long()
        ctx = metadata.num_computed_tokens.long()

        def read(b, start, length):  # request b's positions [start, start + length) through its block table
            pos = torch.arange(start, start + length, device=dev)
            e = cache[table[b, pos // p], pos % p]
            return e[:, :lkv], e[:, lkv:]

        d, _, d_tok, _ = self.split_decodes_and_prefills(metadata, decode_threshold)
        n_heads, v_dim = W_UV.shape[1], W_UV.shape[2]
        out = torch.zeros(q_nope.shape[0], n_heads, v_dim, dtype=q_nope.dtype, device=dev)
        lse = torch.full((n_heads, q_nope.shape[0]), -math.inf, dtype=torch.float32, device=dev)
        for b in range(d):  # decodes: the whole sequence (context + the tokens just written) from the cache
            qs, qe = int(qsl[b]), int(qsl[b + 1])
            if qe == qs:
                continue
            skv, spe = read(b, 0, int(ctx[b]) + qe - qs)
            o, l = self.mla_absorbed(
                q_nope[None, qs:qe], q_pe[None, qs:qe], skv[None], spe[None], W_UK, W_UV, scale=scale, causal=True
            )
            out[qs:qe], lse[:, qs:qe] = o[0], l[0]
        if d < metadata.num_reqs:  # prefills: context chunk by chunk from the cache, new tokens as given
            plan = self._context_plan(ctx[d:], workspace_size, p)
            o, l = self.chunked_prefill_attention(
                q_nope[d_tok:],
                q_pe[d_tok:],
                kv_c[d_tok:],
                k_pe[d_tok:],
                qsl[d:] - d_tok,
                lambda b, s, n: read(b + d, s, n),
                plan,
                W_UK,
                W_UV,
                scale=scale,
            )
            out[d_tok:], lse[:, d_tok:] = o, l
        return out, lse

    # -- batch metadata -------------------------------------------------------------------------------------
    def build_metadata(self, requests, *, block_size, block_table=None, num_blocks=None):
        ctx = torch.tensor([r.context_len for r in requests], dtype=torch.int64)
        q = torch.tensor([r.new_tokens for r in requests], dtype=torch.int64)
        seq = ctx + q
        qsl = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(q, 0)])
        pages = (seq + block_size - 1) // block_size
        if block_table is None:  # request b takes the next pages after request b - 1's
            width = max(int(pages.max()) if len(requests) else 0, 1)
            first = torch.cumsum(pages, 0) - pages
            col = torch.arange(width)[None, :]
            block_table = torch.where(col < pages[:, None], first[:, None] + col, -1)
        t = int(qsl[-1])
        req = self._token_requests(qsl, t)
        pos = ctx[req] + torch.arange(t) - qsl[req]
        slots = block_table.long()[req, pos // block_size] * block_size + pos % block_size
        prefilling = [r.context_len == 0 if r.prompt_len is None else r.context_len < r.prompt_len for r in requests]
        return MetadataResult(qsl, seq, ctx, block_table.long(), slots, torch.tensor(prefilling, dtype=torch.bool))

    def split_decodes_and_prefills(
        self, metadata, decode_threshold=1, require_uniform=False, treat_short_extends_as_decodes=True
    ):
        qsl = metadata.query_start_loc.long()
        q = qsl[1:] - qsl[:-1]
        b, t = q.numel(), int(qsl[-1])
        if b == 0:
            return 0, 0, 0, 0
        if (
            int(q.max()) <= decode_threshold
            and (not require_uniform or decode_threshold <= 1)
            and treat_short_extends_as_decodes
        ):
            return b, 0, t, 0
        if int(q[0]) > decode_threshold:
            return 0, b, 0, t
        if require_uniform:  # vLLM 0.33: the shortcut needs treat_short_extends_as_decodes; q = 0 is padding
            if treat_short_extends_as_decodes and bool(((q == q[0]) | (q == 0)).all()):
                return b, 0, t, 0
            prefill = (q != q[0]) & (q != 0)
        else:
            prefill = q > decode_threshold
        if not treat_short_extends_as_decodes:
            prefill = prefill | metadata.is_prefilling.bool()
        if not bool(prefill.any()):
            return b, 0, t, 0
        first = int(prefill.nonzero()[0])
        return first, b - first, int(qsl[first]), t - int(qsl[first])

    def reorder_batch_to_split_decodes_and_prefills(self, requests, decode_threshold=1, *, regions=4):
        def region(r):
            short = r.new_tokens <= decode_threshold
            if regions == 2:
                return 0 if short else 1
            if r.context_len == 0:
                return 3
            if not short:
                return 2
            prefilling = r.context_len == 0 if r.prompt_len is None else r.context_len < r.prompt_len
            return 1 if prefilling else 0

        reg = [region(r) for r in requests]
        order = list(range(len(requests)))
        swaps = []
        if regions == 2:  # pair the last misplaced decodes with the first prefills
            dec = [i for i, g in enumerate(reg) if g == 0]
            pre = [i for i, g in enumerate(reg) if g == 1]
            for k in range(min(len(dec), len(pre))):
                d, p = dec[len(dec) - 1 - k], pre[k]
                if d < len(dec):
                    break
                order[p], order[d] = order[d], order[p]
                swaps.append((p, d))
        else:  # misplaced requests, sorted by region (stable), fill the misplaced positions in order
            target = sorted(reg)
            wrong = [i for i in range(len(reg)) if reg[i] != target[i]]
            movers = sorted(wrong, key=lambda i: reg[i])
            order = list(range(len(reg)))
            for pos, src in zip(wrong, movers):
                order[pos] = src
            swaps = [(pos, src) for pos, src in zip(wrong, movers) if pos != src]
        return ReorderResult(tuple(order), tuple(reg[i] for i in order), bool(swaps), tuple(swaps))

    def make_local_attention_virtual_batches(self, attn_chunk_size, metadata, block_size=None):
        c = attn_chunk_size
        p = block_size or metadata.block_size
        qsl = metadata.query_start_loc.long()
        q = qsl[1:] - qsl[:-1]
        seq = metadata.seq_lens.long()
        ctx = seq - q
        first_chunk, last_chunk = ctx // c, (seq - 1) // c
        n = last_chunk - first_chunk + 1  # virtual requests per request
        req = torch.repeat_interleave(torch.arange(q.numel()), n)
        k = first_chunk[req] + torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        k_start = k * c
        k_end = torch.minimum(k_start + c, seq[req])
        seqlens_q = k_end - torch.maximum(ctx[req], k_start)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(seqlens_q, 0)])
        table = metadata.block_table.long()
        cols = (k_start // p)[:, None] + torch.arange(c // p)[None, :]
        local = table[req[:, None], cols.clamp(max=table.shape[1] - 1)]
        return seqlens_q, cu, k_end - k_start, local, k_start
