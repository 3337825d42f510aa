"""The harness catches real bug classes of sparse MLA, V4 sliding-window, indexer and top-k kernels.

Each mutant is the torch backend with one method made wrong the way a real kernel or adapter has been wrong; the
harness must fail (or error) it on at least one curated case, with a reproducer. The unmutated torch backend and the
spec itself pass every one of these cases.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaspec.conformance.backend import load_backend
from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import Case, curated_cases
from mlaspec.conformance.generated import case_strategy
from mlaspec.conformance.ops import OPS, unit_roundoff
from mlaspec.conformance.runner import run_case
from mlaspec.spec.config import yarn_get_mscale
from mlaspec.spec.sliding_window import v4_attention_indices
from mlaspec.spec.sparse import sparse_prefill

SPARSE_OPS = (
    "sparse_prefill",
    "sparse_decode",
    "v4_attention",
    "indexer_logits",
    "paged_indexer_logits",
    "topk_indices",
)


def _cases(op, dtypes=("bfloat16",)):
    return [c for c in curated_cases(dtypes=dtypes) if c.op == op]


# -- sparse attention ------------------------------------------------------------------------------------------------
class NegOneAsIndexZero(TorchBackend):
    """``-1`` clamped to 0 for a safe load and then attended: key 0 joins every padded row. Kernels map ``-1`` to
    a safe address and must mask it too (FlashMLA ``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh``)."""

    source = "https://github.com/HKUSTDial/flash-sparse-attention/pull/138"
    shapes = "-1 padding in indices"

    def sparse_prefill(self, q, kv, indices, scale, d_v=512, attn_sink=None, topk_length=None):
        return super().sparse_prefill(q, kv, indices.clamp_min(0), scale, d_v, attn_sink, topk_length)


class NegOneWrapsToLast(TorchBackend):
    """``-1`` used as a Python index: ``cache[-1]`` is the last slot, attended as a key. Seen in torch fallbacks that
    gather with ``kv[indices]`` without a validity mask."""

    source = "https://github.com/vllm-project/vllm/issues/48611"
    shapes = "-1 padding in indices"

    @staticmethod
    def _paged_rows(cache, indices, lengths, s_q):
        rows, idx, valid = TorchBackend._paged_rows(cache, indices, lengths, s_q)
        n = rows.shape[0]
        in_length = valid | (idx == -1)
        if lengths is not None:
            in_length &= torch.arange(idx.shape[-1])[None, None, :] < lengths.repeat_interleave(s_q)[:, None, None]
        return rows, torch.where(idx == -1, n - 1, idx), in_length


class TopkLengthIgnored(TorchBackend):
    """``topk_length`` dropped: slots past it (which hold valid indices) are attended. Seen when an adapter forwards
    only ``indices`` (FlashMLA added ``topk_length`` after its first sparse release)."""

    source = "https://github.com/flashinfer-ai/flashinfer/issues/5095"
    shapes = "topk_length < K"

    def sparse_prefill(self, q, kv, indices, scale, d_v=512, attn_sink=None, topk_length=None):
        return super().sparse_prefill(q, kv, indices, scale, d_v, attn_sink, None)


class SinkInLse(TorchBackend):
    """The sink treated as one more softmax column, so the LSE includes it (``logaddexp(lse, sink)``). That is the
    gpt-oss sink convention of some attention kernels; FlashMLA leaves the LSE unchanged."""

    source = "https://github.com/pytorch/torchtitan/pull/2211"
    shapes = "attn_sink given"

    def sparse_prefill(self, q, kv, indices, scale, d_v=512, attn_sink=None, topk_length=None):
        out, ml, lse = super().sparse_prefill(q, kv, indices, scale, d_v, attn_sink, topk_length)
        if attn_sink is not None:
            lse = torch.where(torch.isposinf(lse), lse, torch.logaddexp(lse, attn_sink.float()[None, :]))
        return out, ml, lse


class SinkWrongSign(TorchBackend):
    """``sigmoid(lse + sink)`` instead of ``sigmoid(lse - sink)``: the sink's sign flipped (a ``exp(-sink)`` vs
    ``exp(sink)`` slip in the rescale)."""

    source = "https://github.com/sgl-project/sgl-kernel-npu/pull/216"
    shapes = "attn_sink given"

    def sparse_decode(self, q, kv_cache, indices, *, attn_sink=None, **kw):
        return super().sparse_decode(q, kv_cache, indices, attn_sink=None if attn_sink is None else -attn_sink, **kw)


class EmptyLseNegInf(TorchBackend):
    """An empty sparse row reported with the dense convention, LSE ``-inf``, where FlashMLA's sparse kernels (and
    the spec) report ``+inf``."""

    source = "https://github.com/sgl-project/sgl-kernel-xpu/pull/337"
    shapes = "a row with no valid index"

    def sparse_prefill(self, *a, **kw):
        out, ml, lse = super().sparse_prefill(*a, **kw)
        return out, ml, lse.masked_fill(torch.isposinf(lse), -math.inf)


class EmptyLseNaN(TorchBackend):
    """An empty row's LSE computed as ``max + log(sum)`` with ``max = -inf``: ``-inf + inf`` is NaN (the online
    softmax without an empty-row guard)."""

    source = "https://github.com/flashinfer-ai/flashinfer/pull/5203"
    shapes = "a row with no valid index"

    def sparse_decode(self, *a, **kw):
        out, lse = super().sparse_decode(*a, **kw)
        return out, lse.masked_fill(torch.isposinf(lse), math.nan)


class TopkLengthPerQuery(TorchBackend):
    """``topk_length [B]`` (one per request) read as one per query row, ``lengths.repeat(S_q)`` instead of
    ``repeat_interleave``: an MTP layout mismatch (vLLM's V4 path passes per-token lengths with ``S_q = 1``)."""

    source = "https://github.com/vllm-project/vllm/pull/51538"
    shapes = "S_q > 1 (MTP) and B > 1 with topk_length"

    @staticmethod
    def _paged_rows(cache, indices, lengths, s_q):
        rows = cache.reshape(-1, 1, cache.shape[-1])
        idx = indices.reshape(-1, 1, indices.shape[-1])
        valid = idx != -1
        if lengths is not None:
            valid &= torch.arange(idx.shape[-1])[None, None, :] < lengths.repeat(s_q)[:, None, None]
        return rows, idx, valid


# -- V4 sliding window -------------------------------------------------------------------------------------------
class WindowOffByOne(TorchBackend):
    """A window of ``W + 1`` keys, ``[p - W, p]`` instead of ``(p - W, p]``: ``start = pos - W`` where vLLM's
    ``_compute_swa_indices_and_lens_kernel`` has ``pos - W + 1`` (flash-attn's ``window_size=(W, 0)`` also means
    ``W + 1`` keys)."""

    source = "https://github.com/vllm-project/vllm/pull/51538"
    shapes = "S_kv > W"

    def v4_attention(self, q, raw_kv, *, window, **kw):
        return super().v4_attention(q, raw_kv, window=window + 1, **kw)


# -- indexer ---------------------------------------------------------------------------------------------------------
class ScaleOfCompressedColumn(TorchBackend):
    """``k_scale`` indexed by the compressed column ``n - ks[m]`` instead of the key ``n``: the scale of the wrong key
    for every row whose span does not start at 0."""

    source = "https://github.com/vllm-project/vllm/pull/56749"
    shapes = "ks > 0 (a span not starting at key 0)"

    def indexer_logits(self, q, k, weights, ks, ke, k_scale=None):
        logits = super().indexer_logits(q, k, weights, ks, ke, None)
        if k_scale is None:
            return logits
        col = (torch.arange(k.shape[0])[None, :] - ks.long()[:, None]).clamp(0, k.shape[0] - 1)
        return torch.where(torch.isneginf(logits), logits, logits * k_scale.float()[col])


class CompressedColumns(TorchBackend):
    """Compressed columns (``j`` = key ``ks[m] + j``, DeepGEMM's ``max_seqlen_k > 0`` form) returned where absolute
    columns are expected, padded to the right width with ``-inf``."""

    source = "https://github.com/vllm-project/vllm/pull/56749"
    shapes = "ks > 0 (a span not starting at key 0)"

    def indexer_logits(self, q, k, weights, ks, ke, k_scale=None):
        logits = super().indexer_logits(q, k, weights, ks, ke, k_scale)
        out = torch.full_like(logits, -math.inf)
        for m in range(logits.shape[0]):
            s, e = int(ks[m]), int(ke[m])
            out[m, : e - s] = logits[m, s:e]
        return out


class LastQuerySeesAll(TorchBackend):
    """2-D MTP ``context_lens [B, next_n]`` reduced to one length per request (the last column): every draft token
    sees the whole context, its future included (the seed's 1-D convention applied to 0.33's 2-D lengths)."""

    source = "https://github.com/vllm-project/vllm/pull/38865"
    shapes = "2-D context_lens, next_n > 1"

    def paged_indexer_logits(self, q, cache, block_table, context_lens, weights, *, max_context_len=None):
        if context_lens.dim() == 2:
            context_lens = context_lens[:, -1:].expand(-1, context_lens.shape[1]).contiguous()
        return super().paged_indexer_logits(
            q, cache, block_table, context_lens, weights, max_context_len=max_context_len
        )


# -- top-k -----------------------------------------------------------------------------------------------------------
class TopkPadsWithZero(TorchBackend):
    """Short rows padded with ``0`` instead of ``-1`` (a zero-initialised output buffer; vLLM pre-fills ``-1``)."""

    source = "https://github.com/hw-native-sys/pypto-lib/pull/838"
    shapes = "K > valid keys of a row"

    def topk_indices(self, logits, k, **kw):
        idx = super().topk_indices(logits, k, **kw)
        return idx.masked_fill(idx == -1, 0)


class TopkDuplicatesTie(TorchBackend):
    """A tie at the K-th value resolved by writing the same index twice (two threads of the threshold bin claim
    one output slot's key)."""

    source = "https://github.com/sgl-project/sglang/issues/35257"
    shapes = "a tie at the K-th value"

    def topk_indices(self, logits, k, **kw):
        idx = super().topk_indices(logits, k, **kw)
        full = idx[:, -1] != -1
        idx[full, -1] = idx[full, -2]
        return idx


class TopkSkipsThresholdBin(TorchBackend):
    """The last pick taken from the bin *below* the threshold: a strictly smaller, non-tied logit replaces a K-th
    value (a radix select that miscounts the threshold bin)."""

    source = "https://github.com/vllm-project/vllm/issues/51782"
    shapes = "a row with more than K valid keys"

    def topk_indices(self, logits, k, *, row_starts=None, row_ends=None, relative=False):
        idx = super().topk_indices(logits, k, row_starts=row_starts, row_ends=row_ends, relative=False)
        x = logits.double()
        cols = torch.arange(x.shape[1])[None, :]
        ok = x > -math.inf
        if row_starts is not None:
            ok &= cols >= row_starts.long()[:, None]
        if row_ends is not None:
            ok &= cols < row_ends.long()[:, None]
        for m in range(x.shape[0]):
            if idx[m, -1] == -1:
                continue
            threshold = x[m, idx[m].long()].min()
            below = ok[m] & (x[m] < threshold)
            if bool(below.any()):
                idx[m, -1] = int(torch.where(below, x[m], -math.inf).argmax())
        if relative:
            idx = torch.where(idx == -1, -1, idx - row_starts.to(idx.dtype)[:, None])
        return idx


# -- new bug classes (issue 16): each visible only where its shape (``shapes``) occurs, unless ``shapes`` is '' -----
TILE = 64  # FlashMLA's sparse kernels tile query heads, query tokens and top-k slots by 64


class SinkOfFirstHeadTile(TorchBackend):
    """Heads of the second 64-head tile read the sinks of the first (``sink[h % 64]``): the per-head sink indexed
    with the tile-local head, as when ``attn_sink`` is loaded or sliced for the wrong heads (DeepSeek V4's
    ``attn_sink [H]`` loaded unsharded into a TP rank's heads)."""

    source = "https://github.com/lightseekorg/tokenspeed/pull/254"
    shapes = "H_q > 64 with attn_sink"

    def sparse_decode(self, q, kv_cache, indices, *, attn_sink=None, **kw):
        if attn_sink is not None:
            attn_sink = attn_sink[torch.arange(attn_sink.shape[0]) % TILE]
        return super().sparse_decode(q, kv_cache, indices, attn_sink=attn_sink, **kw)


class SecondHeadTileReadsFirstTileQuery(TorchBackend):
    """The head-block index decomposed wrongly: every 64-head block reads the queries of block 0 (``h % 64``), a
    bug that 64 heads or fewer never show (FlagGems' sparse MLA kernel read the wrong head group)."""

    source = "https://github.com/flagos-ai/FlagGems/pull/3759"
    shapes = "H_q > 64"

    def sparse_prefill(self, q, kv, indices, scale, d_v=512, attn_sink=None, topk_length=None):
        q = q[:, torch.arange(q.shape[1]) % TILE]
        return super().sparse_prefill(q, kv, indices, scale, d_v, attn_sink, topk_length)


class LseInLog2(TorchBackend):
    """The LSE returned in base 2 (``log2 sum 2^(s log2 e)``, the exp2 fast path's own unit) where FlashMLA and the
    spec return the natural log (FlashInfer's SM120 sparse MLA returns base-2 LSEs)."""

    source = "https://github.com/flashinfer-ai/flashinfer/pull/5203"
    shapes = ""

    def sparse_prefill(self, *a, **kw):
        out, ml, lse = super().sparse_prefill(*a, **kw)
        return out, ml, torch.where(torch.isfinite(lse), lse / math.log(2.0), lse)


class TopkLengthIgnoredPastQueryTile(TorchBackend):
    """``topk_length`` honoured only for the first 64 query tokens: the prefill path taken past 64 tokens reads
    the slots past it (FlashInfer's SM120 sparse prefill corrupted outputs for more than 64 query tokens until the
    caller masked lanes past ``topk_length`` with -1)."""

    source = "https://github.com/flashinfer-ai/flashinfer/issues/5095"
    shapes = "S_q > 64 with topk_length < K"

    def sparse_prefill(self, q, kv, indices, scale, d_v=512, attn_sink=None, topk_length=None):
        if topk_length is not None:
            topk_length = torch.where(torch.arange(q.shape[0]) < TILE, topk_length, indices.shape[-1]).to(torch.int32)
        return super().sparse_prefill(q, kv, indices, scale, d_v, attn_sink, topk_length)


class LastSplitDropped(TorchBackend):
    """The last 64-slot piece of a row's top-k list never reaches the combine when the row has more than one: a
    split-KV work partition that does not cover the whole list (ROCm's sparse MLA decode reused one chunk's
    persistent split metadata for another and collapsed at long context)."""

    source = "https://github.com/vllm-project/vllm/pull/47766"
    shapes = "K > 64 (more than one split-KV piece)"

    @staticmethod
    def _paged_rows(cache, indices, lengths, s_q):
        rows, idx, valid = TorchBackend._paged_rows(cache, indices, lengths, s_q)
        k = idx.shape[-1]
        if k > TILE:
            valid &= torch.arange(k)[None, None, :] < TILE * ((k - 1) // TILE)
        return rows, idx, valid


class SplitsAveragedNotMerged(TorchBackend):
    """Two split-KV pieces (slots ``[0, 64)`` and the rest) combined by averaging their normalised outputs instead
    of weighting each by ``exp(lse_i - lse)``; the LSE itself is merged right (the partial-reduction step of a
    split-KV sparse decode gone wrong, which worsens as contexts grow and splits multiply)."""

    source = "https://github.com/vllm-project/vllm/issues/47042"
    shapes = "K > 64 (more than one split-KV piece), one cache"

    def sparse_decode(self, q, kv_cache, indices, **kw):
        if kw.get("extra_kv_cache") is not None:  # V4's two caches: one piece each, merged right
            return super().sparse_decode(q, kv_cache, indices, **kw)
        first = torch.arange(indices.shape[-1]) < TILE
        out1, lse1 = super().sparse_decode(q, kv_cache, torch.where(first, indices, -1), **kw)
        out2, lse2 = super().sparse_decode(q, kv_cache, torch.where(first, -1, indices), **kw)
        e1, e2 = torch.isposinf(lse1), torch.isposinf(lse2)  # [B, H_q, S_q]: an empty piece has +inf
        both = (~e1 & ~e2).transpose(1, 2)[..., None]
        out = torch.where(
            both, (out1.float() + out2.float()) / 2, torch.where(e2.transpose(1, 2)[..., None], out1, out2)
        )
        lse = torch.where(e1, lse2, torch.where(e2, lse1, torch.logaddexp(lse1, lse2)))
        return out.to(out1.dtype), lse


class MtpQueryRowsTransposed(TorchBackend):
    """Multi-token decode reads query ``(b, s)`` at the packed offset of ``(s, b)``: the queries of every request
    but the first are another request's (FlashInfer's multi-token decode mis-indexed packed Q/O)."""

    source = "https://github.com/flashinfer-ai/flashinfer/pull/4059"
    shapes = "S_q > 1 (MTP) and B > 1"

    def sparse_decode(self, q, kv_cache, indices, **kw):
        b, s_q = q.shape[:2]
        return super().sparse_decode(q.transpose(0, 1).reshape(q.shape), kv_cache, indices, **kw)


class ScaleIgnored(TorchBackend):
    """The softmax scale argument dropped: the kernel's default ``D_qk^-0.5`` used instead of the model's YaRN
    scale (an SDPA call without ``scale=`` fell back to ``1/sqrt(head_dim)`` for DeepSeek-V3)."""

    source = "https://github.com/huggingface/optimum-intel/pull/1877"
    shapes = "scale != D_qk^-0.5 (the YaRN scale)"

    def sparse_prefill(self, q, kv, indices, scale, d_v=512, attn_sink=None, topk_length=None):
        return super().sparse_prefill(q, kv, indices, q.shape[-1] ** -0.5, d_v, attn_sink, topk_length)


class YarnMscaleMissing(TorchBackend):
    """The YaRN softmax correction missing: ``scale / mscale^2`` (``192^-0.5`` for DeepSeek-V3's
    ``192^-0.5 mscale^2``), the ~1.87x too-flat softmax of an MLA that applied YaRN to rope only."""

    source = "https://github.com/onnxruntime/mobius/pull/548"
    shapes = ""

    def sparse_decode(self, q, kv_cache, indices, *, scale=None, **kw):
        m = yarn_get_mscale(40.0, 1.0)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return super().sparse_decode(q, kv_cache, indices, scale=scale / (m * m), **kw)


class WindowIgnored(TorchBackend):
    """No sliding window: every raw key up to the query's position attended (unbounded causal attention where
    DeepSeek V4 restricts every layer to its 128 most recent keys)."""

    source = "https://github.com/onnxruntime/mobius/pull/596"
    shapes = "S_kv > W"

    def v4_attention(self, q, raw_kv, *, window, **kw):
        return super().v4_attention(q, raw_kv, window=raw_kv.shape[0], **kw)


class InProgressGroupVisible(TorchBackend):
    """The compressed entry still being filled (``p // r``) made visible to the query inside it: a causal bound
    ``e <= p // r`` where V4's reference has ``e < (p + 1) // r`` (the TPU streamindex_topk kernel's mask)."""

    source = "https://github.com/vllm-project/tpu-inference/issues/3536"
    shapes = "c4a / c128a layer with (p + 1) % r != 0"

    def v4_attention(self, q, raw_kv, *, window, scale, compressed_kv=None, compress_ratio=1, topk_indices=None, **kw):
        if compress_ratio == 1:
            return super().v4_attention(q, raw_kv, window=window, scale=scale, **kw)
        s_q, s_kv, n_c = q.shape[0], raw_kv.shape[0], compressed_kv.shape[0]
        idx = v4_attention_indices(
            s_q, s_kv, window=window, compress_ratio=compress_ratio, topk_indices=topk_indices, num_compressed=n_c
        ).long()
        for i in range(s_q):
            p = s_kv - s_q + i
            free = torch.nonzero(idx[i, : topk_indices.shape[1]] == -1).flatten()
            if (p + 1) % compress_ratio and free.numel():
                idx[i, free[0]] = p // compress_ratio  # the open group joins the row
        rows = torch.cat([compressed_kv, raw_kv])[:, None]
        out, lse, _ = self._sparse_rows(
            q, rows, idx[:, None], idx[:, None] >= 0, scale=scale, d_v=kw.get("d_v", 512), attn_sink=kw.get("attn_sink")
        )
        return out, lse


class V4SinkDropped(TorchBackend):
    """The attention sink left out of a V4 layer (a sparse attention without the ``attention_sink`` argument
    DeepSeek V4 needs)."""

    source = "https://github.com/tenstorrent/tt-metal/issues/54173"
    shapes = "attn_sink given"

    def v4_attention(self, q, raw_kv, *, attn_sink=None, **kw):
        return super().v4_attention(q, raw_kv, attn_sink=None, **kw)


# -- indexer and top-k -------------------------------------------------------------------------------------------
LONG_ROW = 512  # the scaled-down length past which the mutants below take their "long row" path


class TopkLongRowIgnoresRowStart(TorchBackend):
    """Rows longer than the short-row path read the window ``[0, len)`` instead of ``[row_start, row_start + len)``
    and report those columns (ROCm aiter's long-row ``top_k_per_row_prefill`` path before its fix; the real
    threshold is far above this tiny one)."""

    source = "https://github.com/ROCm/aiter/pull/2901"
    shapes = "row span > 512 with row_starts > 0"

    def topk_indices(self, logits, k, *, row_starts=None, row_ends=None, relative=False):
        if row_starts is not None and row_ends is not None:
            span = row_ends.long() - row_starts.long()
            row_starts = torch.where(span > LONG_ROW, 0, row_starts.long()).to(torch.int32)
            row_ends = torch.where(span > LONG_ROW, span, row_ends.long()).to(torch.int32)
        return super().topk_indices(logits, k, row_starts=row_starts, row_ends=row_ends, relative=relative)


class TopkAbsoluteMadeRelative(TorchBackend):
    """``row_starts`` subtracted although absolute indices were asked for (the long-row path of aiter's
    ``top_k_per_row_prefill`` must add ``rowStart`` back to its internal, relative indices)."""

    source = "https://github.com/ROCm/aiter/pull/2901"
    shapes = "absolute indices (relative=False) with row_starts > 0"

    def topk_indices(self, logits, k, *, row_starts=None, row_ends=None, relative=False):
        return super().topk_indices(
            logits, k, row_starts=row_starts, row_ends=row_ends, relative=row_starts is not None
        )


class TopkRelativeIgnored(TorchBackend):
    """Absolute columns returned where the prefill consumer expects indices relative to each row's ``ks`` (vLLM's
    deterministic DSA top-k helper returned absolute indices to a relative-index consumer)."""

    source = "https://github.com/vllm-project/vllm/pull/56749"
    shapes = "relative indices with row_starts > 0"

    def topk_indices(self, logits, k, **kw):
        return super().topk_indices(logits, k, **{**kw, "relative": False})


class TopkTieBinOverflow(TorchBackend):
    """The radix select's candidate buffer for the threshold bin holds 64 entries; past that, tied candidates are
    dropped and the row comes back short (-1) although valid keys remain (SGLang's fast_topk_v2, 4096 entries
    for K = 2048; scaled to the tiny K here)."""

    source = "https://github.com/sgl-project/sglang/issues/36807"
    shapes = "long rows with more than 64 logits tied at the K-th value"

    def topk_indices(self, logits, k, *, row_starts=None, row_ends=None, relative=False):
        idx = super().topk_indices(logits, k, row_starts=row_starts, row_ends=row_ends, relative=False)
        x = logits.double()
        for m in range(x.shape[0]):
            if idx[m, -1] == -1:
                continue
            chosen = x[m, idx[m].long()]
            kth = chosen.min()
            valid = torch.isfinite(x[m]) | (x[m] == math.inf)
            if row_starts is not None:
                valid &= torch.arange(x.shape[1]) >= int(row_starts[m])
            if row_ends is not None:
                valid &= torch.arange(x.shape[1]) < int(row_ends[m])
            ties = int((valid & (x[m] == kth)).sum())
            if ties > TILE:  # the bin overflowed: its candidates past the buffer are lost
                lost = int((chosen == kth).sum()) - TILE
                if lost > 0:
                    keep = torch.nonzero(chosen == kth).flatten()[TILE:]
                    idx[m, keep] = -1
                    idx[m] = torch.cat([idx[m][idx[m] != -1], idx[m][idx[m] == -1]])
        if relative:
            idx = torch.where(idx == -1, -1, idx - row_starts.to(idx.dtype)[:, None])
        return idx


class TopkPadsPastRowEnd(TorchBackend):
    """A row with fewer valid keys than K padded with the next columns (``row_end, row_end + 1, ...``) instead of
    -1: indices outside the row's logical range (ROCm aiter's tiered decode top-k, when a sequence is longer than
    the logits it was handed)."""

    source = "https://github.com/ROCm/aiter/pull/4355"
    shapes = "K > valid keys of a row"

    def topk_indices(self, logits, k, **kw):
        idx = super().topk_indices(logits, k, **kw)
        n = logits.shape[1]
        pad = (idx == -1).cumsum(1) - 1 + (idx != -1).sum(1, keepdim=True)
        return torch.where(idx == -1, pad.clamp(max=n - 1), idx).to(torch.int32)


class TopkRowStrideAligned(TorchBackend):
    """Row ``m`` read at offset ``m * align(N, 256)``: the row stride of DeepGEMM's 256-padded logits buffer
    assumed for a tensor whose rows are ``N`` apart (vLLM's persistent top-k used ``logits.size(1)`` as the
    stride of a sliced, non-contiguous buffer)."""

    source = "https://github.com/vllm-project/vllm/pull/42169"
    shapes = "M > 1 with N not a multiple of 256"

    def topk_indices(self, logits, k, **kw):
        m, n = logits.shape
        stride = -(-n // 256) * 256
        pos = torch.arange(m)[:, None] * stride + torch.arange(n)[None, :]
        flat = logits.reshape(-1)
        read = torch.where(pos < flat.numel(), flat[pos.clamp(max=flat.numel() - 1)], -math.inf)
        return super().topk_indices(read, k, **kw)


class PagedBlockSizeOne(TorchBackend):
    """Each key position used as the block-table index (a cache of one token per block assumed): ROCm aiter's
    paged MQA logits stage-1 kernel before it supported blocks of more than one token."""

    source = "https://github.com/ROCm/aiter/pull/4440"
    shapes = "P > 1"

    @staticmethod
    def _key_slots(table_row, positions, block):
        return table_row[positions.clamp(max=table_row.numel() - 1)].long(), positions * 0


class PagedBlockSize64(TorchBackend):
    """The indexer cache's block size hard-coded to 64 (DeepGEMM's paged MQA kernels are templated for
    ``block_kv`` 32 and 64; a cache of any other page size is read as 64)."""

    source = "https://github.com/vllm-project/vllm/issues/53635"
    shapes = "P != 64"

    @staticmethod
    def _key_slots(table_row, positions, block):
        logical = (positions // 64).clamp(max=table_row.numel() - 1)
        return table_row[logical].long(), positions % 64 % block


class PagedMtpRowsTransposed(TorchBackend):
    """Logit rows written at ``j * B + b`` instead of ``b * next_n + j``: the packed multi-token offset of the
    output mis-indexed (FlashInfer's trtllm-gen multi-token decode reduction)."""

    source = "https://github.com/flashinfer-ai/flashinfer/pull/4382"
    shapes = "next_n > 1 and B > 1"

    def paged_indexer_logits(self, q, cache, block_table, context_lens, weights, *, max_context_len=None):
        out = super().paged_indexer_logits(
            q, cache, block_table, context_lens, weights, max_context_len=max_context_len
        )
        b, next_n = q.shape[:2]
        return out.reshape(next_n, b, -1).transpose(0, 1).reshape(out.shape)


class OneDLensNotShifted(TorchBackend):
    """1-D ``context_lens`` read as every draft token's length: query ``j`` of ``next_n`` sees the whole context
    instead of ``len - next_n + j + 1`` (a Triton paged MQA logits kernel that loads one ``context_len`` per
    request for every speculative token)."""

    source = "https://github.com/vllm-project/vllm/pull/39168"
    shapes = "1-D context_lens with next_n > 1"

    def paged_indexer_logits(self, q, cache, block_table, context_lens, weights, *, max_context_len=None):
        if context_lens.dim() == 1:
            context_lens = context_lens[:, None].expand(-1, q.shape[1]).contiguous()
        return super().paged_indexer_logits(
            q, cache, block_table, context_lens, weights, max_context_len=max_context_len
        )


class IndexerReluMissing(TorchBackend):
    """The ReLU on each head's score left out (``Σ_h w_h q_h.k`` instead of ``Σ_h w_h relu(q_h.k)``), a port of
    the lightning indexer that incoherent long outputs traced back to."""

    source = "https://github.com/ml-explore/mlx-lm/pull/512"
    shapes = ""

    def indexer_logits(self, q, k, weights, ks, ke, k_scale=None):
        q, k, w = (t.float() for t in (q, k, weights))
        logits = torch.einsum("mhn,mh->mn", torch.einsum("mhd,nd->mhn", q, k), w)
        if k_scale is not None:
            logits = logits * k_scale.float()[None, :]
        cols = torch.arange(k.shape[0])[None, :]
        return logits.masked_fill(~((cols >= ks[:, None]) & (cols < ke[:, None])), -math.inf)


MUTANTS = [
    (NegOneAsIndexZero, "sparse_prefill"),
    (NegOneWrapsToLast, "sparse_decode"),
    (TopkLengthIgnored, "sparse_prefill"),
    (SinkInLse, "sparse_prefill"),
    (SinkWrongSign, "sparse_decode"),
    (EmptyLseNegInf, "sparse_prefill"),
    (EmptyLseNaN, "sparse_decode"),
    (TopkLengthPerQuery, "sparse_decode"),
    (WindowOffByOne, "v4_attention"),
    (ScaleOfCompressedColumn, "indexer_logits"),
    (CompressedColumns, "indexer_logits"),
    (LastQuerySeesAll, "paged_indexer_logits"),
    (TopkPadsWithZero, "topk_indices"),
    (TopkDuplicatesTie, "topk_indices"),
    (TopkSkipsThresholdBin, "topk_indices"),
    (SinkOfFirstHeadTile, "sparse_decode"),
    (SecondHeadTileReadsFirstTileQuery, "sparse_prefill"),
    (LseInLog2, "sparse_prefill"),
    (TopkLengthIgnoredPastQueryTile, "sparse_prefill"),
    (LastSplitDropped, "sparse_decode"),
    (SplitsAveragedNotMerged, "sparse_decode"),
    (MtpQueryRowsTransposed, "sparse_decode"),
    (ScaleIgnored, "sparse_prefill"),
    (YarnMscaleMissing, "sparse_decode"),
    (WindowIgnored, "v4_attention"),
    (InProgressGroupVisible, "v4_attention"),
    (V4SinkDropped, "v4_attention"),
    (TopkLongRowIgnoresRowStart, "topk_indices"),
    (TopkAbsoluteMadeRelative, "topk_indices"),
    (TopkRelativeIgnored, "topk_indices"),
    (TopkTieBinOverflow, "topk_indices"),
    (TopkPadsPastRowEnd, "topk_indices"),
    (TopkRowStrideAligned, "topk_indices"),
    (PagedBlockSizeOne, "paged_indexer_logits"),
    (PagedBlockSize64, "paged_indexer_logits"),
    (PagedMtpRowsTransposed, "paged_indexer_logits"),
    (OneDLensNotShifted, "paged_indexer_logits"),
    (IndexerReluMissing, "indexer_logits"),
]


def _marked(mutant, op):
    """A mutant only the statistical checks can catch (``needs = "statistics"``) is an expected failure here."""
    marks = ()
    if getattr(mutant, "needs", None) == "statistics":
        marks = (pytest.mark.xfail(strict=False, reason="needs the statistical checks"),)
    return pytest.param(mutant, op, id=mutant.__name__, marks=marks)


@pytest.mark.parametrize("mutant, op", [_marked(m, op) for m, op in MUTANTS])
def test_mutant_fails(mutant, op):
    """Some default case (tiny, bf16 or fp16) of the mutant's op fails or errors it, with a reason and a repro."""
    cases = _cases(op, ("bfloat16", "float16"))
    bad = next((r for r in (run_case(mutant(), c, backend_name="m") for c in cases) if r.verdict != "pass"), None)
    assert bad is not None, f"{mutant.__name__} passed every {op} case: {[c.id for c in cases]}"
    assert bad.verdict in ("fail", "error") and bad.reason
    assert bad.repro.startswith("mlaspec check --backend m --case ")


def test_every_mutant_names_its_report_and_shapes():
    """Each bug class cites the issue, PR or commit it comes from and says which shapes expose it ('' for any);
    at least ten of them are visible only on particular shapes."""
    for mutant, _ in MUTANTS:
        assert mutant.source.startswith("https://github.com/"), mutant.__name__
        assert isinstance(mutant.shapes, str), mutant.__name__
    assert len({m for m, _ in MUTANTS}) == len(MUTANTS)
    assert sum(bool(m.shapes) for m, _ in MUTANTS) >= 10


def test_every_sparse_op_has_cases_and_a_mutant():
    assert set(SPARSE_OPS) <= set(OPS)
    assert {op for _, op in MUTANTS} == set(SPARSE_OPS)
    for op in SPARSE_OPS:
        assert _cases(op), op


@pytest.mark.parametrize("backend", ["spec", "torch"])
def test_builtin_backends_pass_sparse_cases(backend):
    b = load_backend(backend)
    assert set(SPARSE_OPS) <= b.ops
    for case in curated_cases(ops=SPARSE_OPS):
        r = run_case(b, case, backend_name=backend)
        assert r.verdict == "pass", (case.id, r.reason)


def test_empty_row_lse_must_be_exactly_plus_inf():
    """The judge's +inf -> -inf allowance applies only where the spec says -inf: here it says +inf."""
    case = next(c for c in _cases("sparse_prefill") if c.name == "empty-rows")
    ok = run_case(TorchBackend(), case, backend_name="t")
    neg = run_case(EmptyLseNegInf(), case, backend_name="m")
    assert ok.verdict == "pass" and neg.verdict == "fail" and "+inf pattern" in neg.reason


def test_topk_accepts_any_tie_choice():
    """Order is free: reversing the chosen indices of every row still passes (ties are left to torch.topk)."""

    class Reversed(TorchBackend):
        def topk_indices(self, logits, k, **kw):
            idx = super().topk_indices(logits, k, **kw)
            n = (idx != -1).sum(1)
            out = idx.clone()
            for m in range(idx.shape[0]):
                out[m, : n[m]] = idx[m, : n[m]].flip(0)
            return out

    for case in _cases("topk_indices", dtypes=("bfloat16", "float16")):
        assert run_case(Reversed(), case, backend_name="r").verdict == "pass", case.id


# -- budgets: fp16 underflow under a sink ----------------------------------------------------------------------------
# Found by hypothesis (dev profile): a sink ~7.7 above a one-key row's LSE scales it by f ~ 5e-4, so the fp16 output
# lies below 2^-14 where rounding costs up to 2^-25 absolute; the torch and Triton backends return the correctly
# rounded spec there and failed a budget that had only the relative u.
HYP_164 = Case(
    "sparse_prefill",
    "hyp-164",
    "float16",
    {
        "S_q": 2,
        "S_kv": 3,
        "H_q": 2,
        "H_kv": 1,
        "D_qk": 576,
        "D_v": 512,
        "K": 1,
        "invalid": 0.0,
        "topk_length": False,
        "empty": 0,
        "sink": "finite",
    },
)


class RoundedSpec(TorchBackend):
    """The float64 spec correctly rounded to the case dtype (``lse``, ``max_logits`` fp32): the best any kernel can
    return, so every budget must pass it."""

    def sparse_prefill(self, q, kv, indices, scale, d_v=512, attn_sink=None, topk_length=None):
        out, max_logits, lse = sparse_prefill(q, kv, indices, scale, d_v, attn_sink, topk_length)
        return out.to(q.dtype), max_logits.float(), lse.float()


class FlushesSubnormals(TorchBackend):
    """fp16 outputs below the smallest normal flushed to zero (an FTZ store): the floor must not hide it."""

    def sparse_prefill(self, q, kv, indices, scale, d_v=512, attn_sink=None, topk_length=None):
        out, max_logits, lse = super().sparse_prefill(q, kv, indices, scale, d_v, attn_sink, topk_length)
        return out.masked_fill(out.abs() < torch.finfo(out.dtype).smallest_normal, 0.0), max_logits, lse


def _verdict(backend, kw, ref):
    """The harness's judgement of ``backend`` on sparse prefill inputs ``kw`` (``ref``: the spec's outputs)."""
    op = OPS["sparse_prefill"]
    u = unit_roundoff(kw["q"].dtype)
    return op.verdict(backend.sparse_prefill(**kw), ref, op.bounds(kw, ref, u), u, lambda: kw)


def test_hyp_164_fp16_output_below_the_smallest_normal_passes():
    op = OPS["sparse_prefill"]
    kw = op.make_inputs(HYP_164)
    ref = op.reference(**kw)
    tiny = ref[0].abs() < torch.finfo(torch.float16).smallest_normal
    assert int(tiny.sum()) > 10, "the case no longer reaches fp16's subnormal range"
    for backend in (TorchBackend(), RoundedSpec()):
        r = run_case(backend, HYP_164, backend_name="t")
        assert r.verdict == "pass", r.reason
    assert run_case(FlushesSubnormals(), HYP_164, backend_name="m").verdict == "fail"


@settings(max_examples=15)
@given(case=case_strategy("sparse_prefill", dtypes=("float16",)), gap=st.floats(3.0, 16.0))
def test_fp16_sink_far_above_lse_passes_correctly_rounded_outputs(case, gap):
    """The family of hyp-164: a sink ``gap`` above each head's largest LSE (so ``f <= sigmoid(-gap)``) pushes
    fp16 outputs into the subnormal range; the correctly rounded spec and the torch backend must pass."""
    op = OPS["sparse_prefill"]
    kw = op.make_inputs(case)
    lse = op.reference(**kw)[2]  # the sink does not change the LSE
    top = torch.where(torch.isfinite(lse), lse, -math.inf).amax(0)
    kw["attn_sink"] = (torch.where(torch.isfinite(top), top, 0.0) + gap).float()
    ref = op.reference(**kw)
    for backend in (RoundedSpec(), TorchBackend()):
        verdict, reason, *_ = _verdict(backend, kw, ref)
        assert verdict == "pass", (type(backend).__name__, case, gap, reason)
