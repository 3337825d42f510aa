"""Serving ops: the paged cache writer and gathers, the fp8 cache layouts, chunked-prefill context, batch metadata.

Each op wraps one spec function (same name, same keyword arguments) from :mod:`mlaspec.spec.paged_cache`,
:mod:`mlaspec.spec.cache_layouts`, :mod:`mlaspec.spec.chunked_context` or :mod:`mlaspec.spec.batch`. Most outputs
here are bytes or integers, so most ops judge with a ``compare`` hook rather than a float budget:

* **Integer metadata** (slot mappings, query offsets, block tables, split counts, reorders, local virtual batches)
  and **gathers** (bytes copied bit for bit) must be exactly equal (:func:`~mlaspec.conformance.verdict.judge_exact`;
  float caches are compared as their bit patterns, so NaN in a slot that should be untouched stays NaN).
* **Cache writers** (``concat_and_cache_mla``, ``write_pages``, ``quantize``) are judged field by field, from the
  layout records of :mod:`mlaspec.spec.cache_layouts`:

  - every byte of a slot that no token maps to (unused slots, padding tokens' ``slot -1``) must be unchanged;
  - ``kv_cache_dtype="auto"`` caches, scale bytes, bf16 RoPE and pad bytes must be exact: they are deterministic
    functions of the inputs (a group's amax is exact, ``fp32(amax / 448)`` and ``ceil(log2(amax / 448))`` are
    correctly rounded, a bf16 copy rounds to nearest even). A power-of-two scale where vLLM stores ``amax / 448``
    fails here: the inputs plant a group of amax 336 (``336 / 448 = 0.75``, not a power of two). Which rule is right
    is the case's: ``concat_and_cache_mla``'s parameter ``writer`` names the vLLM version whose ``fp8_ds_mla`` writer
    the case asks for (:data:`CONCAT_WRITERS`: ``"vllm-0.33"`` raw ``amax / 448``, the default; ``"vllm-pow2"``
    power-of-two scales, vLLM PR #49435), passed to the spec as ``pow2_scales`` and named in the case;
  - fp8 values are judged *after dequantization* against the entry: a kernel divides in fp32 first and can land
    one fp8 step from the spec at a tie, so the per-element budget is the spec's documented error bound
    (:func:`~mlaspec.spec.cache_layouts.error_bound`) plus ``2^-22 |x|`` for the fp32 division (or the
    multiplication by a reciprocal): ``|y - x/s| <= 2^-23 |x/s|``, then rounding ``y`` costs at most the spec's
    half step of ``y``.
* **Dequantization** is deterministic: the backend's values must equal the spec's float64 values rounded once to
  the dtype the backend returns, ``|got - ref| <= (u_out + ε32) |ref|`` (``u_out`` the unit roundoff of the
  returned dtype; ``ε32`` for an fp32 product before it; 0 for float64 output, i.e. exact).
* **Chunked-prefill attention** equals causal attention over ``context + new tokens`` (a spec property), so it is
  budgeted as that attention (:func:`~mlaspec.conformance.ops.common.attention_bounds`, with the up-projected
  ``k_nope`` / ``v`` accumulated in fp32 and materialised in the case dtype as in ``mla_prefill``:
  :func:`~mlaspec.conformance.ops.dense._prefill_bounds`) plus the merges: every one of the
  ``n_chunks + 1`` parts has its output rounded to the case dtype (``u/2`` of a magnitude at most ``M``) and is
  merged with fp32 weights (``4 ε32 M``), and each merge's LSE costs ``2 ε32 (|lse| + 1)``. The op returns only
  ``(out, lse)``, so the workspace limit is not checked here (the plan is an input; the spec checks its chunks
  fit).
* **A mixed batch** (``mla_mixed_batch``: decodes, MTP decodes and prefills in one step, vLLM's ``MLACommonImpl``)
  is budgeted per request by the path the spec sends it down: a decode as the absorbed form over its whole
  sequence (:func:`~mlaspec.conformance.ops.dense._absorbed_bounds`: ``ql_nope`` and the latent output rounded to
  the case dtype, root-sum-square over the 512-long sums), the prefills as ``chunked_prefill_attention`` above with
  the plan the spec derives from ``workspace_size``. The backend gets what a serving layer gets: the paged cache
  holding every request's *context* (the new tokens' slots are still NaN: a layer writes them first, as vLLM's
  ``concat_and_cache_mla`` does before attention), the batch metadata (reordered decodes first, shuffled pages, the
  unused block-table columns pointing at a NaN page), the new tokens' ``kv_c`` / ``k_pe`` and the weights.

Inputs are hostile by default: NaN (all ``0xFF`` bytes) in every cache slot nobody writes, padding slots ``-1``,
the last slot left unused so a ``-1`` that wraps shows, shuffled block tables whose unused columns point at a NaN
page, irregular sizes, groups of amax 336, 448 (a power-of-two boundary for e8m0), 0 and ``1e-3`` (fp8 subnormals),
values past the per-tensor fp8 range (saturation).
"""

from __future__ import annotations

import math

import torch

from mlaspec.spec import cache_layouts as cl
from mlaspec.spec.attention import attention
from mlaspec.spec.batch import (
    Request,
    build_metadata,
    make_local_attention_virtual_batches,
    reorder_batch_to_split_decodes_and_prefills,
    split_decodes_and_prefills,
)
from mlaspec.spec.chunked_context import chunked_prefill_attention, mla_mixed_batch, plan_context_chunks
from mlaspec.spec.config import MLAConfig, make_weights
from mlaspec.spec.forms import mha_inputs
from mlaspec.spec.paged_cache import (
    concat_and_cache_mla,
    gather_cache,
    slot_mapping_from_block_table,
    token_positions,
)

from ..cases import Case
from ..verdict import Metric, argmax_index, judge, judge_exact
from .common import (
    DTYPES,
    EPS32,
    LIMITS,
    Op,
    Scale,
    abs_logits_max,
    attention_bounds,
    composite,
    normal,
    projection_error,
    randn,
    st,
    worst_rows,
)
from .dense import V3_SCALE, _absorbed_bounds

QUANTIZED_CACHE = {
    "fp8": cl.FP8_PER_TENSOR,
    "fp8_e4m3": cl.FP8_PER_TENSOR,
    "fp8_e5m2": cl.FP8_E5M2_PER_TENSOR,
    "fp8_ds_mla": cl.FP8_DS_MLA_V32,
}
FILL = 0xFF  # every field of every layout decodes 0xFF bytes as NaN (e4m3 0x7F/0xFF, fp32 / bf16 all-ones)
DIVISION = 2.0**-22  # a kernel's fp32 x / s (or x * (1 / s)) before rounding to fp8, relative to |x|


# -- shared helpers --------------------------------------------------------------------------------------------
def _gen(c: Case, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(c.seed + salt)


def _normalise(got: object, names: tuple[str, ...]) -> object:
    """A backend may return the spec's record (attributes named like the outputs), a tuple, or one tensor."""
    if isinstance(got, torch.Tensor) and len(names) == 1:
        return (got,)
    if all(hasattr(got, n) for n in names) and not isinstance(got, torch.Tensor):
        return tuple(getattr(got, n) for n in names)
    return got


def _bits(t: object) -> object:
    """Floating tensors as their bit patterns (so NaN equals NaN and -0 differs from 0); others unchanged."""
    if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return t.detach().cpu().contiguous().view(ints[t.element_size()])
    return t


def _exact(names: tuple[str, ...], *, bits: bool = False):
    def compare(kw, got, ref):
        got = _normalise(got, names)
        if bits:
            if not isinstance(got, (tuple, list)) or len(got) != len(names):
                return judge_exact(names, got, ref)
            for n, g, r in zip(names, got, ref):
                if isinstance(g, torch.Tensor) and isinstance(r, torch.Tensor) and g.dtype != r.dtype:
                    return "error", f"{n}: dtype {g.dtype}, spec {r.dtype} (a gather copies bit for bit)", [], {}, {}
            got, ref = tuple(_bits(g) for g in got), tuple(_bits(r) for r in ref)
            return judge_exact(tuple(f"{n} (bit patterns)" for n in names), got, ref)
        return judge_exact(names, got, ref)

    return compare


def _records(cache: torch.Tensor) -> torch.Tensor:
    """``[NB, P, width]`` (any dtype) -> ``[NB * P, bytes]`` uint8."""
    flat = cache.detach().cpu().contiguous().reshape(cache.shape[0] * cache.shape[1], -1)
    return flat.view(torch.uint8)


def _hostile_entries(c: Case, t: int, d: int, group: int, *, saturate: float | None = None) -> torch.Tensor:
    """``[t, d]`` in the case dtype: random values of per-token magnitude ``2^k``, with planted groups.

    Token 0's first group has amax 336 (``336/448`` separates an fp32 scale from a power of two), token 1's second
    group is all zero, token 2's first group is ``~1e-3`` (fp8 subnormals, the e8m0 floor), token 3 holds 448 (a
    power-of-two boundary of ``amax / 448``); ``saturate`` plants a value that far past the per-tensor range.
    """
    g = _gen(c, 1)
    x = normal(t, d, generator=g)
    x *= torch.exp2(torch.randint(-3, 4, (t, 1), generator=g).to(torch.float64))
    x[0, :group] = x[0, :group].clamp(-300, 300)
    x[0, 3] = 336.0
    if t > 1:
        x[1, group : 2 * group] = 0.0
    if t > 2:
        x[2, :group] *= 1e-3
    if t > 3:
        x[3, 1] = -448.0
    if saturate is not None:
        x[t // 2, 5] = saturate  # mid-batch: the trailing tokens may be padding
    return x.to(DTYPES[c.dtype])


def _group_of(layout: cl.CacheLayout | None) -> int:
    if layout is None:
        return 64
    groups = [f.group for f in layout.value_fields if f.group]
    return groups[0] if groups else 64


def _judge_records(
    names_prefix: str,
    got: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    layout: cl.CacheLayout | None,
    scale,
    *,
    pow2_scales: bool = False,
) -> tuple:
    """Judge a written cache given as records ``[NB * P, token_bytes]`` uint8 (see the module docstring).

    ``slots [W]`` are the written records, ``x [W, D]`` their entries; ``pow2_scales`` the scale rule they were
    written under (it sets the error bound of the fp8 values).
    """
    metrics, worst, reasons = [], {}, []
    written = torch.zeros(got.shape[0], dtype=torch.bool)
    written[slots] = True
    changed = (got[~written] != old[~written]).any(dim=1)
    untouched_ids = (~written).nonzero().flatten()
    metrics.append(Metric(f"{names_prefix}untouched", "slots_changed", float(changed.sum()), 0.0))
    if bool(changed.any()):
        s = int(untouched_ids[changed.nonzero()[0]])
        worst["untouched"] = dict(index=[s], got=0.0, spec=0.0, bound=0.0)
        reasons.append(
            f"{int(changed.sum())} slot(s) no token maps to were changed; first: slot {s} "
            f"(padding slot -1 written? out-of-range write?)"
        )
    g, r = got[slots], ref[slots]
    if layout is None:  # a plain cast: every byte is deterministic
        exact_cols = torch.ones(g.shape[1], dtype=torch.bool)
    else:
        exact_cols = torch.zeros(g.shape[1], dtype=torch.bool)
        for f in layout.fields:
            fp8_values = f.elements is not None and f.dtype in ("e4m3", "e5m2")
            if not fp8_values:
                exact_cols[f.offset : f.end] = True
    bad = (g[:, exact_cols] != r[:, exact_cols]).any(dim=1)
    metrics.append(Metric(f"{names_prefix}written", "records_with_wrong_exact_bytes", float(bad.sum()), 0.0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        col = int(exact_cols.nonzero().flatten()[(g[i, exact_cols] != r[i, exact_cols]).nonzero()[0]])
        field = "entry" if layout is None else next(f.name for f in layout.fields if f.offset <= col < f.end)
        worst["exact_bytes"] = dict(index=[int(slots[i]), col], got=int(g[i, col]), spec=int(r[i, col]), bound=0.0)
        reasons.append(
            f"{int(bad.sum())} written record(s) differ in deterministic bytes; first: slot "
            f"{int(slots[i])} byte {col} ({field}): got 0x{int(g[i, col]):02x}, spec 0x{int(r[i, col]):02x}"
        )
    if layout is not None and g.shape[0]:
        cols = torch.zeros(layout.entry_dim, dtype=torch.bool)
        for f in layout.value_fields:
            if f.dtype in ("e4m3", "e5m2"):
                cols[f.elements[0] : f.elements[1]] = True
        xs = x.to(torch.float64)
        deq = cl.dequantize(g.contiguous(), layout, scale=scale).entries
        bound = cl.error_bound(xs, layout, scale=scale, pow2_scales=pow2_scales) + DIVISION * xs.abs()
        err = torch.where(torch.isnan(deq), math.inf, (deq - xs).abs())[:, cols]
        ratio = torch.where(err > 0, err / bound[:, cols].clamp_min(1e-300), 0.0)
        w = ratio.max().item()
        metrics.append(Metric(f"{names_prefix}values", "max_error/bound", w, 1.0))
        if w > 1.0:
            i, j = argmax_index(ratio)
            col = int(cols.nonzero().flatten()[j])
            worst["values"] = dict(
                index=[int(slots[i]), col], got=deq[i, col].item(), spec=xs[i, col].item(), bound=bound[i, col].item()
            )
            reasons.append(
                f"dequantized value off by {w:.3g} x its bound at slot {int(slots[i])} element {col}: "
                f"got {deq[i, col].item():.6g}, entry {xs[i, col].item():.6g}, "
                f"bound {bound[i, col].item():.3g}"
            )
    return ("fail" if reasons else "pass"), "; ".join(reasons), metrics, worst, {}


def _output_like(got: object, name: str, ref: torch.Tensor, what: str, *, more: bool = False):
    """``(tensor, "")``: the backend's output ``name`` (:func:`_normalise`), a tensor of ``ref``'s shape and dtype;
    else ``(None, why not)``, ``what`` naming the output. ``more``: further outputs may follow it."""
    got = _normalise(got, (name,))
    if not isinstance(got, (tuple, list)) or len(got) < 1 or (len(got) > 1 and not more):
        return None, f"expected {what}, got {type(got).__name__}"
    g = got[0]
    if not isinstance(g, torch.Tensor):
        return None, f"{name}: expected a tensor, got {type(g).__name__}"
    if tuple(g.shape) != tuple(ref.shape) or g.dtype != ref.dtype:
        return None, f"{name}: {g.dtype} {list(g.shape)}, spec {ref.dtype} {list(ref.shape)}"
    return g, ""


# -- concat_and_cache_mla --------------------------------------------------------------------------------------
def _slots(c: Case, t: int, total: int, pad: int) -> torch.Tensor:
    """``t`` distinct slots in ``[0, total - 1)`` (the last slot stays unused), then ``pad`` padding ``-1``."""
    perm = torch.randperm(total - 1, generator=_gen(c, 2))[: t - pad]
    return torch.cat([perm, torch.full((pad,), -1)]).to(torch.int64)


CONCAT_WRITERS = {"vllm-0.33": False, "vllm-pow2": True}
"""``concat_and_cache_mla``'s case parameter ``writer`` (:mod:`~mlaspec.conformance.ops.writers`) -> the spec's
``pow2_scales``: vLLM 0.33.0's raw ``amax / 448`` group scales, or vLLM's power-of-two scales after PR #49435
(https://github.com/vllm-project/vllm/pull/49435). Only ``fp8_ds_mla`` has group scales."""


def _concat_inputs(c: Case) -> dict:
    p = c.params
    t, blk, nb, kind = p["T"], p["P"], p["NB"], p["kv_cache_dtype"]
    layout = QUANTIZED_CACHE.get(kind)
    scale = p.get("scale")
    x = _hostile_entries(c, t, 576, _group_of(layout), saturate=None if scale is None else 600.0 * scale)
    if layout is None:
        cache = torch.full((nb, blk, 576), math.nan, dtype=DTYPES[c.dtype])
    else:
        cache = torch.full((nb, blk, layout.token_bytes), FILL, dtype=torch.uint8)
    return dict(
        kv_c=x[:, :512].contiguous(),
        k_pe=x[:, 512:].contiguous(),
        kv_cache=cache,
        slot_mapping=_slots(c, t, nb * blk, p.get("pad", 0)),
        kv_cache_dtype=kind,
        scale=scale,
        pow2_scales=CONCAT_WRITERS[p.get("writer", "vllm-0.33")],
    )


def _concat_reference(**kw) -> tuple:
    return (concat_and_cache_mla(**kw),)


def _concat_compare(kw, got, ref):
    g, bad = _output_like(got, "kv_cache", ref[0], "the new cache")
    if bad:
        return "error", bad, [], {}, {}
    s = kw["slot_mapping"].to(torch.int64)
    keep = s >= 0
    x = torch.cat([kw["kv_c"], kw["k_pe"]], dim=1)[keep]
    return _judge_records(
        "kv_cache ",
        _records(g),
        _records(kw["kv_cache"]),
        _records(ref[0]),
        s[keep],
        x,
        QUANTIZED_CACHE.get(kw["kv_cache_dtype"]),
        kw["scale"],
        pow2_scales=kw["pow2_scales"],
    )


# -- gather_cache ----------------------------------------------------------------------------------------------
def _paged_cache(c: Case, nb: int, blk: int, entry: str, used_pages: torch.Tensor) -> torch.Tensor:
    """A cache whose ``used_pages`` hold entries (bf16 values or 656-byte records) and every other page NaN."""
    if entry == "fp8_ds_mla":
        cache = torch.full((nb, blk, 656), FILL, dtype=torch.uint8)
        x = _hostile_entries(c, used_pages.numel() * blk, 576, 128)
        cache[used_pages] = cl.quantize(x, cl.FP8_DS_MLA_V32).raw.reshape(-1, blk, 656)
    else:
        cache = torch.full((nb, blk, 576), math.nan, dtype=DTYPES[c.dtype])
        cache[used_pages] = randn(c)(used_pages.numel(), blk, 576)
    return cache


def _block_table(c: Case, pages_needed: list[int], nb: int, spare: int) -> torch.Tensor:
    """Shuffled pages per request; unused columns point at the (NaN) page ``spare``."""
    width = max(max(pages_needed, default=1), 1)
    perm = torch.randperm(nb, generator=_gen(c, 3))
    perm = perm[perm != spare]
    table = torch.full((len(pages_needed), width), spare, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = perm[at : at + n].to(torch.int32)
        at += n
    return table


def _gather_inputs(c: Case) -> dict:
    p = c.params
    blk, lens, starts = p["P"], p["lens"], p.get("starts")
    st = starts or [0] * len(lens)
    pages = [-(-(s + n) // blk) for s, n in zip(st, lens)]
    nb = sum(pages) + 3
    table = _block_table(c, pages, nb, spare=nb - 1)
    used = torch.unique(torch.cat([table[b, :n] for b, n in enumerate(pages)]).long())
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return dict(
        kv_cache=_paged_cache(c, nb, blk, p.get("entry", "auto"), used),
        block_table=table,
        cu_seq_lens=cu,
        batch_size=len(lens) if p.get("batch_size", True) else None,
        seq_starts=None if starts is None else torch.tensor(starts, dtype=torch.int32),
        kernel=p.get("kernel", "cp_gather_cache"),
    )


def _gather_reference(**kw) -> tuple:
    return (gather_cache(**kw).entries,)


# -- slot_mapping_from_block_table -----------------------------------------------------------------------------
def _requests(p: dict) -> list[Request]:
    return [Request(*r) for r in p["requests"]]


def _slot_inputs(c: Case) -> dict:
    p = c.params
    reqs, blk = _requests(p), p["P"]
    pages = [-(-r.seq_len // blk) for r in reqs]
    nb = sum(pages) + 2
    table = _block_table(c, pages, nb, spare=nb - 1)
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([r.new_tokens for r in reqs]), 0)
    pos = token_positions(qsl, torch.tensor([r.seq_len for r in reqs])).positions
    return dict(
        block_table=table,
        block_size=blk,
        query_start_loc=qsl,
        positions=pos,
        num_blocks=nb,
        pad_to=int(qsl[-1]) + p.get("pad", 0),
    )


# -- quantize / dequantize / write_pages / read_tokens ---------------------------------------------------------
def _layout_scale(p: dict) -> tuple[cl.CacheLayout, float | None]:
    layout = cl.LAYOUTS[p["layout"]]
    return layout, (p.get("scale") if layout.scale_rule.kind == "per_tensor" else None)


def _quantize_inputs(c: Case) -> dict:
    layout, scale = _layout_scale(c.params)
    sat = None if scale is None else 600.0 * scale
    x = _hostile_entries(c, c.params["T"], layout.entry_dim, _group_of(layout), saturate=sat)
    return dict(entries=x, layout=layout.name, scale=scale, pow2_scales=False)


def _quantize_reference(**kw) -> tuple:
    return (cl.quantize(**kw).raw,)


def _quantize_compare(kw, got, ref):
    g, bad = _output_like(got, "raw", ref[0], "the records", more=True)
    if bad:
        return "error", bad, [], {}, {}
    t = ref[0].shape[0]
    return _judge_records(
        "raw ", g.detach().cpu(), ref[0], ref[0], torch.arange(t), kw["entries"], cl.LAYOUTS[kw["layout"]], kw["scale"]
    )


def _dequantize_inputs(c: Case) -> dict:
    q = _quantize_inputs(c)
    raw = cl.quantize(q["entries"], q["layout"], scale=q["scale"]).raw
    return dict(raw=raw, layout=q["layout"], scale=q["scale"])


def _dequantize_reference(**kw) -> tuple:
    return (cl.dequantize(**kw).entries,)


def _dequantize_compare(kw, got, ref):
    got = _normalise(got, ("entries",))
    if not isinstance(got, (tuple, list)) or len(got) < 1 or not isinstance(got[0], torch.Tensor):
        return "error", f"expected the entries tensor, got {type(got).__name__}", [], {}, {}
    g = got[0]
    if not g.dtype.is_floating_point:
        return "error", f"entries: dtype {g.dtype} is not floating point", [], {}, {}
    u = 0.0 if g.dtype == torch.float64 else torch.finfo(g.dtype).eps / 2 + (EPS32 if g.dtype != torch.float32 else 0)
    return judge(("entries",), (g,), ref, (u * ref[0].abs().nan_to_num(0.0),))


def _pages_inputs(c: Case) -> dict:
    p = c.params
    layout, scale = _layout_scale(p)
    blk, nb, t = p["P"], p["NB"], p["T"]
    pages = torch.full((nb, cl.page_bytes(layout, blk)), FILL, dtype=torch.uint8)
    x = _hostile_entries(c, t, layout.entry_dim, _group_of(layout))
    return dict(
        pages=pages,
        entries=x,
        slot_mapping=_slots(c, t, nb * blk, p.get("pad", 0)),
        layout=layout.name,
        block_size=blk,
        scale=scale,
        pow2_scales=False,
    )


def _write_pages_reference(**kw) -> tuple:
    return (cl.write_pages(**kw),)


def _write_pages_compare(kw, got, ref):
    g, bad = _output_like(got, "pages", ref[0], "the new pages")
    if bad:
        return "error", bad, [], {}, {}
    layout, blk = cl.LAYOUTS[kw["layout"]], kw["block_size"]
    g = g.detach().cpu()
    tail = blk * layout.token_bytes
    verdict = list(
        _judge_records(
            "pages ",
            cl.from_pages(g, layout, blk),
            cl.from_pages(kw["pages"], layout, blk),
            cl.from_pages(ref[0], layout, blk),
            *_written(kw),
            layout,
            kw["scale"],
        )
    )
    if not torch.equal(g[:, tail:], kw["pages"][:, tail:]):
        verdict[0] = "fail"
        verdict[1] = "; ".join(filter(None, [verdict[1], "alignment padding bytes past P * token_bytes changed"]))
    return tuple(verdict)


def _written(kw) -> tuple[torch.Tensor, torch.Tensor]:
    s = kw["slot_mapping"].to(torch.int64)
    return s[s >= 0], kw["entries"][s >= 0]


def _read_inputs(c: Case) -> dict:
    p = c.params
    kw = _pages_inputs(c)
    pages = cl.write_pages(**kw)
    blk, nb, n = p["P"], p["NB"], p["T_read"]
    slots = torch.randint(0, nb * blk, (n,), generator=_gen(c, 4))
    slots[:: max(n // 3, 1)] = -1  # invalid indices
    slots[1] = kw["slot_mapping"][0]  # a written one for sure
    return dict(pages=pages, layout=kw["layout"], block_size=blk, slots=slots)


def _read_reference(**kw) -> tuple:
    return tuple(cl.read_tokens(**kw))


# -- chunked_prefill_attention ---------------------------------------------------------------------------------
def _chunked_inputs(c: Case) -> dict:
    p, r = c.params, randn(c)
    cfg = MLAConfig.tiny(
        num_heads=p["H_q"],
        kv_lora_rank=p["Lkv"],
        qk_nope_head_dim=p["D_nope"],
        qk_rope_head_dim=p["D_rope"],
        v_head_dim=p["D_v"],
    )
    w = make_weights(cfg, seed=c.seed, dtype=DTYPES[c.dtype])
    ctx, q_lens = p["contexts"], p["q_lens"]
    t = sum(q_lens)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    context = [(r(n, cfg.kv_lora_rank), r(n, cfg.qk_rope_head_dim)) for n in ctx]
    plan = plan_context_chunks(ctx, p["workspace_size"], p["block_size"])
    return dict(
        q_nope=r(t, cfg.num_heads, cfg.qk_nope_head_dim, scale=2.0),
        q_pe=r(t, cfg.num_heads, cfg.qk_rope_head_dim, scale=2.0),
        kv_c=r(t, cfg.kv_lora_rank),
        k_pe=r(t, cfg.qk_rope_head_dim),
        cu_seqlens_q=cu,
        context=context,
        plan=plan,
        W_UK=w.W_UK,
        W_UV=w.W_UV,
        scale=p.get("scale", cfg.softmax_scale),
    )


def _chunked_bounds(kw, ref, u):
    cu = kw["cu_seqlens_q"].long()
    wuk, wuv = kw["W_UK"].double(), kw["W_UV"].double()
    n_parts = kw["plan"].num_chunks + 1
    out_b, lse_b = torch.zeros_like(ref[0]), torch.zeros_like(ref[1])
    for b in range(cu.numel() - 1):
        qs, qe = int(cu[b]), int(cu[b + 1])
        if qe == qs:
            continue
        ckv, cpe = kw["context"][b]
        kv = torch.cat([ckv, kw["kv_c"][qs:qe]]).double()  # context then new tokens: one causal sequence
        pe = torch.cat([cpe, kw["k_pe"][qs:qe]]).double()
        q_nope, q_pe = kw["q_nope"][qs:qe][None], kw["q_pe"][qs:qe][None]
        q, k, v = mha_inputs(q_nope, q_pe, kv[None], pe[None], wuk, wuv)  # the compute-friendly form, one request
        rounding = u / 2 * abs_logits_max(q, k, kw["scale"])  # k_nope rounded to the case dtype
        dk = projection_error("sl,lnp->snp", kv, wuk, u)[None]  # k_nope's fp32 accumulation (as in _prefill_bounds)
        accumulation = abs_logits_max(q[..., : q_nope.shape[-1]], dk, kw["scale"])
        ref_b = (ref[0][qs:qe][None], ref[1][:, qs:qe][None])
        o, l = attention_bounds(
            q,
            k,
            v,
            scale=kw["scale"],
            causal=True,
            ref=ref_b,
            u=1.5 * u,
            extra_logit_err=rounding + accumulation,
            v_err=projection_error("sl,lnv->snv", kv, wuv, u)[None],
        )
        m = attention(q, k, v.abs(), scale=kw["scale"], causal=True).out
        merges_out = n_parts * (u + 8 * EPS32) * m  # each part's output rounded, fp32 merge weights
        merges_lse = n_parts * 4 * EPS32 * (ref_b[1].abs() + 1)
        out_b[qs:qe], lse_b[:, qs:qe] = (o + merges_out)[0], (l + merges_lse)[0]
    return out_b, lse_b


# -- mla_mixed_batch -------------------------------------------------------------------------------------------
def _mixed_inputs(c: Case) -> dict:
    """A reordered mixed batch over a paged cache that holds every request's context and NaN everywhere else."""
    p, r = c.params, randn(c)
    cfg = MLAConfig.tiny(
        num_heads=p["H_q"],
        kv_lora_rank=p["Lkv"],
        qk_nope_head_dim=p["D_nope"],
        qk_rope_head_dim=p["D_rope"],
        v_head_dim=p["D_v"],
    )
    w = make_weights(cfg, seed=c.seed, dtype=DTYPES[c.dtype])
    reqs, blk = _requests(p), p["block_size"]
    pages = [-(-q.seq_len // blk) for q in reqs]
    nb = sum(pages) + 2  # one page nobody owns, one spare that the unused block-table columns point at
    meta = build_metadata(reqs, block_size=blk, block_table=_block_table(c, pages, nb, spare=nb - 1), num_blocks=nb)
    cache = torch.full((nb, blk, cfg.kv_entry_dim), math.nan, dtype=DTYPES[c.dtype])
    for b, q in enumerate(reqs):  # the context only: the new tokens' slots stay NaN until a layer writes them
        pos = torch.arange(q.context_len)
        cache[meta.block_table[b, pos // blk].long(), pos % blk] = r(q.context_len, cfg.kv_entry_dim)
    t = meta.num_actual_tokens
    return dict(
        q_nope=r(t, cfg.num_heads, cfg.qk_nope_head_dim, scale=2.0),
        q_pe=r(t, cfg.num_heads, cfg.qk_rope_head_dim, scale=2.0),
        kv_c=r(t, cfg.kv_lora_rank),
        k_pe=r(t, cfg.qk_rope_head_dim),
        metadata=meta,
        kv_cache=cache,
        W_UK=w.W_UK,
        W_UV=w.W_UV,
        scale=p.get("scale", cfg.softmax_scale),
        workspace_size=p["workspace_size"],
        decode_threshold=p["decode_threshold"],
    )


def _cache_context(kv_cache: torch.Tensor, metadata, lkv: int):
    """``gather(b, start, length) -> (kv_c, k_pe)``: request ``b``'s context read through its block table."""
    blk = kv_cache.shape[1]

    def gather(b: int, start: int, length: int):
        pos = torch.arange(start, start + length)
        e = kv_cache[metadata.block_table[b, pos // blk].long(), pos % blk]
        return e[:, :lkv], e[:, lkv:]

    return gather


def _mixed_reference(
    q_nope, q_pe, kv_c, k_pe, metadata, kv_cache, W_UK, W_UV, *, scale, workspace_size, decode_threshold=1
) -> tuple:
    res = mla_mixed_batch(
        q_nope,
        q_pe,
        kv_c,
        k_pe,
        metadata,
        _cache_context(kv_cache, metadata, kv_c.shape[1]),
        W_UK,
        W_UV,
        scale=scale,
        workspace_size=workspace_size,
        decode_threshold=decode_threshold,
    )
    return res.out, res.lse


def _mixed_bounds(kw, ref, u):
    meta = kw["metadata"]
    split = split_decodes_and_prefills(meta, kw["decode_threshold"])
    gather = _cache_context(kw["kv_cache"], meta, kw["kv_c"].shape[1])
    qsl, ctx = meta.query_start_loc.long(), meta.num_computed_tokens.long()
    shared = {k: kw[k] for k in ("W_UK", "W_UV", "scale")}
    out_b, lse_b = torch.zeros_like(ref[0]), torch.zeros_like(ref[1])
    for b in range(split.num_decodes):  # the absorbed form over context + new tokens, causal
        qs, qe = int(qsl[b]), int(qsl[b + 1])
        if qe == qs:
            continue
        ckv, cpe = gather(b, 0, int(ctx[b]))
        one = dict(
            q_nope=kw["q_nope"][None, qs:qe],
            q_pe=kw["q_pe"][None, qs:qe],
            kv_c=torch.cat([ckv, kw["kv_c"][qs:qe]])[None],
            k_pe=torch.cat([cpe, kw["k_pe"][qs:qe]])[None],
            causal=True,
            **shared,
        )
        o, l = _absorbed_bounds(one, (ref[0][None, qs:qe], ref[1][None, :, qs:qe]), u)
        out_b[qs:qe], lse_b[:, qs:qe] = o[0], l[0]
    if split.num_prefills:  # the chunked compute-friendly form, with the spec's plan
        d, p0 = split.num_decodes, split.num_decode_tokens
        pre = dict(
            q_nope=kw["q_nope"][p0:],
            q_pe=kw["q_pe"][p0:],
            kv_c=kw["kv_c"][p0:],
            k_pe=kw["k_pe"][p0:],
            cu_seqlens_q=qsl[d:] - p0,
            context=[gather(b, 0, int(ctx[b])) for b in range(d, meta.num_reqs)],
            plan=plan_context_chunks(ctx[d:], kw["workspace_size"], meta.block_size),
            **shared,
        )
        o, l = _chunked_bounds(pre, (ref[0][p0:], ref[1][:, p0:]), u)
        out_b[p0:], lse_b[:, p0:] = o, l
    return out_b, lse_b


# -- batch metadata --------------------------------------------------------------------------------------------
META_FIELDS = ("query_start_loc", "seq_lens", "num_computed_tokens", "block_table", "slot_mapping", "is_prefilling")
SPLIT_FIELDS = ("num_decodes", "num_prefills", "num_decode_tokens", "num_prefill_tokens")
REORDER_FIELDS = ("order", "regions", "modified")
LOCAL_FIELDS = ("seqlens_q_local", "cu_seqlens_q_local", "seqlens_k_local", "block_table_local", "k_seqstarts_absolute")


def _metadata_inputs(c: Case) -> dict:
    p = c.params
    reqs = _requests(p)
    table, nb = None, None
    if p.get("shuffle"):
        pages = [-(-r.seq_len // p["P"]) for r in reqs]
        nb = sum(pages) + 2
        table = _block_table(c, pages, nb, spare=nb - 1)
    elif "block_table" in p:
        table = torch.tensor(p["block_table"], dtype=torch.int32)
        nb = int(table.max()) + 1
    return dict(requests=reqs, block_size=p["P"], block_table=table, num_blocks=nb)


def _metadata_reference(**kw) -> tuple:
    m = build_metadata(**kw)
    return tuple(getattr(m, f) for f in META_FIELDS)


def _split_inputs(c: Case) -> dict:
    p = c.params
    return dict(
        metadata=build_metadata(**_metadata_inputs(c)),
        decode_threshold=p.get("decode_threshold", 1),
        require_uniform=p.get("require_uniform", False),
        treat_short_extends_as_decodes=p.get("treat_short_extends_as_decodes", True),
    )


def _reorder_inputs(c: Case) -> dict:
    p = c.params
    return dict(requests=_requests(p), decode_threshold=p.get("decode_threshold", 1), regions=p["regions"])


def _reorder_reference(**kw) -> tuple:
    r = reorder_batch_to_split_decodes_and_prefills(**kw)
    return r.order, r.regions, r.modified


def _local_inputs(c: Case) -> dict:
    p = c.params
    return dict(attn_chunk_size=p["attn_chunk_size"], metadata=build_metadata(**_metadata_inputs(c)), block_size=p["P"])


def _local_reference(**kw) -> tuple:
    r = make_local_attention_virtual_batches(**kw)
    return tuple(getattr(r, f) for f in LOCAL_FIELDS)


# -- pictures of failing cases ----------------------------------------------------------------------------------
def _records_picture(
    got: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor,
    slots: torch.Tensor,
    layout: cl.CacheLayout | None,
    *,
    block_size: int | None,
    entry_label: str = "",
    title: str = "",
) -> dict:
    """The record layout with the bytes where written records differ from the spec's, and every slot's status
    (untouched, written as the spec, written differently, changed although no token maps to it)."""
    from ..viz.layouts import draw_byte_differences

    written = torch.zeros(got.shape[0], dtype=torch.bool)
    written[slots] = True
    differs = (got != ref).any(1)
    status = torch.zeros(got.shape[0], dtype=torch.int64)
    status[written] = torch.where(differs[written], 2, 1)
    status[~written & (got != old).any(1)] = 3
    fig = draw_byte_differences(
        (got[slots] != ref[slots]).sum(0),
        status,
        layout=layout,
        entry_label=entry_label,
        block_size=block_size,
        title=title,
    )
    return {"bytes": fig}


def _concat_picture(kw, got, ref, ratios, *, title=""):
    g, bad = _output_like(got, "kv_cache", ref[0], "the new cache")
    if bad:
        return {}
    s = kw["slot_mapping"].to(torch.int64)
    layout = QUANTIZED_CACHE.get(kw["kv_cache_dtype"])
    label = f"entry: [kv_c | k_pe] = {kw['kv_c'].shape[1] + kw['k_pe'].shape[1]} x {str(ref[0].dtype)[6:]}"
    return _records_picture(
        _records(g),
        _records(kw["kv_cache"]),
        _records(ref[0]),
        s[s >= 0],
        layout,
        block_size=kw["kv_cache"].shape[1],
        entry_label=label,
        title=title,
    )


def _write_pages_picture(kw, got, ref, ratios, *, title=""):
    g, bad = _output_like(got, "pages", ref[0], "the new pages")
    if bad:
        return {}
    layout, blk = cl.LAYOUTS[kw["layout"]], kw["block_size"]
    records = [cl.from_pages(p.detach().cpu(), layout, blk) for p in (g, kw["pages"], ref[0])]
    return _records_picture(*records, _written(kw)[0], layout, block_size=blk, title=title)


def _quantize_picture(kw, got, ref, ratios, *, title=""):
    g, bad = _output_like(got, "raw", ref[0], "the records", more=True)
    if bad:
        return {}
    return _records_picture(
        g.detach().cpu(),
        ref[0],
        ref[0],
        torch.arange(ref[0].shape[0]),
        cl.LAYOUTS[kw["layout"]],
        block_size=None,
        title=title,
    )


def _chunked_picture(kw, got, ref, ratios, *, title=""):
    """The chunk schedule of the case's plan with each request's worst ``|error| / bound`` and the failing ones
    outlined."""
    from ..viz.schedule import draw_chunk_schedule_failures

    g = got if isinstance(got, (tuple, list)) and len(got) == 2 else (None, None)
    r_lse = ratios.get("lse")
    g_lse = g[1].T if isinstance(g[1], torch.Tensor) and g[1].dim() == 2 else None
    tokens = worst_rows(
        [("out", g[0], ref[0], ratios.get("out")), ("lse", g_lse, ref[1].T, None if r_lse is None else r_lse.T)]
    )
    cu = kw["cu_seqlens_q"].long().tolist()
    per_request = [float(tokens[a:b].max()) if b > a else 0.0 for a, b in zip(cu[:-1], cu[1:])]
    return {"schedule": draw_chunk_schedule_failures(kw["plan"], per_request, title=title)}


# A mixed batch as vLLM schedules one, ``[context_len, new_tokens, prompt_len]`` per request (spec.batch.Request):
# decodes, MTP decodes, chunked and first prefills interleaved; and the same requests in vLLM's reordered layout.
MIXED_REQUESTS = [
    [0, 9, 9],
    [12, 1, 5],
    [8, 7, 20],
    [30, 2, 10],
    [6, 3, 16],
    [0, 1, 7],
    [40, 4, 33],
    [3, 1, None],
    [0, 13, 13],
]
REORDERED_REQUESTS = [
    [12, 1, 5],
    [30, 2, 10],
    [40, 4, 33],
    [3, 1, None],
    [6, 3, 16],
    [8, 7, 20],
    [0, 9, 9],
    [0, 1, 7],
    [0, 13, 13],
]


# -- the curated cases (named after the deployments they stand for) and the generated parameters ----------------
def _concat_and_cache_mla_cases(scale: Scale) -> list[tuple[str, dict]]:
    full = scale.full
    return [
        # serving: paged cache writes (NaN in unused slots, padding slots -1), fp8 layouts, gathers
        (
            "v3-bf16-page64-padding",
            dict(
                T=300 if full else 13,
                pad=20 if full else 3,
                P=64 if full else 16,
                NB=12 if full else 3,
                kv_cache_dtype="auto",
            ),
        ),
        (
            "v3-fp8-per-tensor",
            dict(
                T=300 if full else 13,
                pad=4,
                P=64 if full else 16,
                NB=12 if full else 3,
                kv_cache_dtype="fp8",
                scale=0.09375,
            ),
        ),
        (
            "v32-fp8-ds-mla-656",
            dict(
                T=300 if full else 13,
                pad=4,
                P=64 if full else 16,
                NB=12 if full else 3,
                kv_cache_dtype="fp8_ds_mla",
            ),
        ),
        # the same record as vLLM writes it after PR #49435: power-of-two group scales (the amax-336 group stores
        # 1.0, not vLLM 0.33's 0.75)
        (
            "v32-fp8-ds-mla-656-writer-vllm-pow2",
            dict(
                T=300 if full else 13,
                pad=4,
                P=64 if full else 16,
                NB=12 if full else 3,
                kv_cache_dtype="fp8_ds_mla",
                writer="vllm-pow2",
            ),
        ),
        # page sizes other than 64: one token a page (slot = page), and 128-token pages
        ("page1-fp8-per-tensor", dict(T=13, pad=2, P=1, NB=16, kv_cache_dtype="fp8", scale=0.09375)),
        ("page128-bf16", dict(T=150, pad=5, P=128, NB=2, kv_cache_dtype="auto")),
    ]


@composite
def _concat_and_cache_mla_params(draw) -> dict:
    """A paged cache of a few blocks, ``T`` tokens of which the last ``pad`` are padding (slot ``-1``), in every
    cache dtype (the per-tensor fp8 ones with a drawn scale, ``fp8_ds_mla`` with a drawn ``writer``)."""
    block = draw(st.sampled_from([1, 2, 4, 16]))
    blocks = draw(st.integers(2 if block == 1 else 1, LIMITS["blocks"]))  # the last slot stays unused
    pad = draw(st.integers(0, 3))
    t = pad + draw(st.integers(1, min(LIMITS["T"], blocks * block - 1)))
    kind = draw(st.sampled_from(["auto", "fp8", "fp8_e5m2", "fp8_ds_mla"]))
    p = dict(T=t, pad=pad, P=block, NB=blocks, kv_cache_dtype=kind)
    if kind in ("fp8", "fp8_e5m2"):
        p["scale"] = draw(st.sampled_from([0.09375, 0.5, 1.0, 2.0]))
    if kind == "fp8_ds_mla":
        p["writer"] = draw(st.sampled_from(sorted(CONCAT_WRITERS)))
    return p


def _gather_cache_cases(scale: Scale) -> list[tuple[str, dict]]:
    full = scale.full
    return [
        (
            "v3-context-chunk-seq-starts",
            dict(
                P=64 if full else 16,
                lens=[300, 0, 1000, 64] if full else [5, 0, 21, 9],
                starts=[70, 5, 640, 1000] if full else [3, 7, 16, 40],
            ),
        ),
        (
            "v3-dequant-gather-aligned",
            dict(
                P=64 if full else 16,
                lens=[100, 640, 33] if full else [7, 16, 19],
                starts=[0, 64, 640] if full else [0, 16, 32],
                kernel="gather_and_maybe_dequant_cache",
            ),
        ),
        (
            "v32-fp8-ds-mla-raw",
            dict(
                P=64 if full else 16,
                lens=[130, 700, 9] if full else [6, 13, 4],
                starts=[1, 0, 65] if full else [1, 0, 9],
                entry="fp8_ds_mla",
            ),
        ),
        # without the optional arguments (every request from its start, batch size from cu_seq_lens), 1-token pages
        ("page1-no-seq-starts", dict(P=1, lens=[5, 0, 21, 9], batch_size=False)),
        # 128-token pages, chunks starting past the first page
        (
            "page128-dequant-gather",
            dict(P=128, lens=[300, 0, 130], starts=[0, 128, 256], kernel="gather_and_maybe_dequant_cache"),
        ),
    ]


def _slot_mapping_from_block_table_cases(scale: Scale) -> list[tuple[str, dict]]:
    full = scale.full
    return [
        ("mixed-batch-cudagraph-pad", dict(P=64 if full else 16, pad=5, requests=MIXED_REQUESTS)),
        ("page1", dict(P=1, pad=2, requests=MIXED_REQUESTS)),
        ("page128-long", dict(P=128, pad=0, requests=[[1500, 1, None], [0, 200, 200], [300, 3, None]])),
    ]


def _quantize_cases(scale: Scale) -> list[tuple[str, dict]]:
    return [
        ("v32-656", dict(T=6, layout="fp8_ds_mla_v32")),
        ("v4-584", dict(T=6, layout="fp8_ds_mla_v4")),
        ("v41-528", dict(T=6, layout="mxfp8_ds_mla_v41")),
        ("fp8-per-tensor", dict(T=6, layout="fp8_e4m3_per_tensor", scale=0.09375)),
    ]


def _dequantize_cases(scale: Scale) -> list[tuple[str, dict]]:
    return [
        ("v32-656", dict(T=6, layout="fp8_ds_mla_v32")),
        ("v4-584", dict(T=6, layout="fp8_ds_mla_v4")),
        ("v41-528", dict(T=6, layout="mxfp8_ds_mla_v41")),
        ("fp8-per-tensor", dict(T=6, layout="fp8_e4m3_per_tensor", scale=0.09375)),
    ]


def _write_pages_cases(scale: Scale) -> list[tuple[str, dict]]:
    full = scale.full
    return [
        ("v4-584-paged", dict(T=40 if full else 13, pad=2, P=64 if full else 16, NB=3, layout="fp8_ds_mla_v4")),
        (
            "v41-528-paged",
            dict(T=40 if full else 13, pad=2, P=64 if full else 16, NB=3, layout="mxfp8_ds_mla_v41"),
        ),
        (
            "v32-656-paged",
            dict(T=40 if full else 13, pad=2, P=64 if full else 16, NB=3, layout="fp8_ds_mla_v32"),
        ),
        ("v4-584-page1", dict(T=9, pad=2, P=1, NB=12, layout="fp8_ds_mla_v4")),
        ("v41-528-page128", dict(T=150, pad=3, P=128, NB=2, layout="mxfp8_ds_mla_v41")),
    ]


def _read_tokens_cases(scale: Scale) -> list[tuple[str, dict]]:
    full = scale.full
    return [
        ("v4-584-paged", dict(T=40 if full else 13, P=64 if full else 16, NB=3, T_read=12, layout="fp8_ds_mla_v4")),
        (
            "v41-528-paged",
            dict(T=40 if full else 13, P=64 if full else 16, NB=3, T_read=12, layout="mxfp8_ds_mla_v41"),
        ),
        ("v4-584-page1", dict(T=9, P=1, NB=12, T_read=12, layout="fp8_ds_mla_v4")),
        ("v41-528-page128", dict(T=150, P=128, NB=2, T_read=24, layout="mxfp8_ds_mla_v41")),
    ]


def _chunked_prefill_attention_cases(scale: Scale) -> list[tuple[str, dict]]:
    full = scale.full
    return [
        # serving: chunked-prefill context (3+ chunks, a prefill without context), batch metadata
        (
            "v3-workspace-chunks-no-context",
            dict(
                H_q=16,
                Lkv=512,
                D_nope=128,
                D_rope=64,
                D_v=128,
                contexts=[4096, 0, 1000, 300],
                q_lens=[64, 128, 17, 33],
                block_size=64,
                workspace_size=2048,
            )
            if full
            else dict(
                H_q=4,
                Lkv=32,
                D_nope=16,
                D_rope=8,
                D_v=16,
                contexts=[37, 0, 20, 9],
                q_lens=[3, 5, 1, 4],
                block_size=4,
                workspace_size=24,
            ),
        ),
        (
            "first-chunks-only",
            dict(
                H_q=4,
                Lkv=32,
                D_nope=16,
                D_rope=8,
                D_v=16,
                contexts=[0, 0],
                q_lens=[4, 2],
                block_size=4,
                workspace_size=16,
            ),
        ),
        # two 64-head tiles, contexts in 3 workspace chunks of 128-token pages, different context and query lengths
        # per request, the model's YaRN scale
        (
            "yarn-128-heads-page128",
            dict(
                H_q=128,
                Lkv=32,
                D_nope=16,
                D_rope=8,
                D_v=16,
                contexts=[300, 0, 130, 7],
                q_lens=[2, 5, 1, 3],
                block_size=128,
                workspace_size=384,
                scale=V3_SCALE,
            ),
        ),
        # one token a page (chunks end anywhere), a ~2000-token context in 10 workspace chunks
        (
            "page1-long-context",
            dict(
                H_q=8,
                Lkv=32,
                D_nope=16,
                D_rope=8,
                D_v=16,
                contexts=[1900, 3, 0, 17],
                q_lens=[1, 4, 6, 2],
                block_size=1,
                workspace_size=600,
            ),
        ),
    ]


@composite
def _chunked_prefill_attention_params(draw) -> dict:
    """Requests with and without context, a workspace from one page per prefill with context up to a few, so the
    plan runs one to several chunks."""
    n = draw(st.integers(1, LIMITS["requests"]))
    contexts = draw(st.lists(st.integers(0, LIMITS["context"]), min_size=n, max_size=n))
    block = draw(st.sampled_from([1, 2, 4]))
    with_context = max(sum(c > 0 for c in contexts), 1)
    workspace = with_context * block * draw(st.integers(1, 4)) + draw(st.integers(0, block - 1))
    return dict(
        H_q=draw(st.integers(1, LIMITS["H"])),
        Lkv=draw(st.integers(1, LIMITS["Lkv"])),
        D_nope=draw(st.integers(1, LIMITS["D_nope"])),
        D_rope=2 * draw(st.integers(1, LIMITS["D_rope"] // 2)),
        D_v=draw(st.integers(1, LIMITS["D_v_mla"])),
        contexts=contexts,
        q_lens=draw(st.lists(st.integers(1, LIMITS["q_len"]), min_size=n, max_size=n)),
        block_size=block,
        workspace_size=workspace,
    )


def _build_metadata_cases(scale: Scale) -> list[tuple[str, dict]]:
    full = scale.full
    return [
        ("v3-mixed-default-pages", dict(P=64 if full else 16, requests=MIXED_REQUESTS)),
        ("mixed-shuffled-table", dict(P=64 if full else 4, requests=MIXED_REQUESTS, shuffle=True)),
        ("page1-shuffled", dict(P=1, requests=MIXED_REQUESTS, shuffle=True)),
    ]


def _split_decodes_and_prefills_cases(scale: Scale) -> list[tuple[str, dict]]:
    return [
        ("mtp4-mixed", dict(P=16, decode_threshold=4, requests=REORDERED_REQUESTS)),
        (
            "mtp4-short-extends-as-prefills",
            dict(P=16, decode_threshold=4, requests=REORDERED_REQUESTS, treat_short_extends_as_decodes=False),
        ),
        ("mtp4-require-uniform", dict(P=16, decode_threshold=4, requests=REORDERED_REQUESTS, require_uniform=True)),
        (
            "mtp2-uniform-cudagraph-pad",
            dict(P=16, decode_threshold=2, requests=[[5, 2, None], [7, 2, None], [9, 0, None]], require_uniform=True),
        ),
        (
            "uniform-padding-row-before-prefill",  # vLLM 0.33: q = 0 is never a prefill
            dict(
                P=16,
                decode_threshold=1,
                requests=[[30, 1, None], [15, 0, None], [7, 1, None], [0, 2, None]],
                require_uniform=True,
            ),
        ),
    ]


def _reorder_batch_to_split_decodes_and_prefills_cases(scale: Scale) -> list[tuple[str, dict]]:
    return [
        ("mtp4-mixed-4-regions", dict(requests=MIXED_REQUESTS, decode_threshold=4, regions=4)),
        ("mtp4-mixed-2-regions", dict(requests=MIXED_REQUESTS, decode_threshold=4, regions=2)),
        ("decode-1-2-regions", dict(requests=MIXED_REQUESTS, decode_threshold=1, regions=2)),
    ]


def _make_local_attention_virtual_batches_cases(scale: Scale) -> list[tuple[str, dict]]:
    return [
        (
            "seed-example-chunk4",
            dict(
                attn_chunk_size=4,
                P=2,
                requests=[[2, 4, None], [7, 10, None], [4, 5, None]],
                block_table=[list(range(10 * b, 10 * b + 10)) for b in range(3)],
            ),
        ),
        ("chunk8-shuffled", dict(attn_chunk_size=8, P=4, requests=MIXED_REQUESTS, shuffle=True)),
    ]


def _mla_mixed_batch_cases(scale: Scale) -> list[tuple[str, dict]]:
    full, ctx = scale
    return [
        # one MLA step over a mixed batch from a paged cache: decodes (MTP query_len 2) through the absorbed form,
        # prefills with and without context through a workspace smaller than the longest context (3+ chunks)
        (
            "v3-tp8-mixed-mtp2-chunked",
            dict(
                H_q=16,
                Lkv=512,
                D_nope=128,
                D_rope=64,
                D_v=128,
                block_size=64,
                workspace_size=2048,
                decode_threshold=2,
                requests=[[4096, 1], [3000, 2], [1, 2], [777, 1], [3000, 64], [0, 128], [700, 33], [0, 1]],
            )
            if full
            else dict(
                H_q=4,
                Lkv=32,
                D_nope=16,
                D_rope=16,
                D_v=16,
                block_size=16,
                workspace_size=32,
                decode_threshold=2,
                requests=[[37, 1], [20, 2], [5, 2], [16, 1], [40, 5], [0, 4], [19, 3], [0, 1]],
            ),
        ),
        (
            "v3-tp1-decodes-only-mtp2",
            dict(
                H_q=128 if full else 16,
                Lkv=512 if full else 32,
                D_nope=128 if full else 16,
                D_rope=64 if full else 16,
                D_v=128 if full else 16,
                block_size=64 if full else 16,
                workspace_size=2048 if full else 32,
                decode_threshold=2,
                requests=[[ctx, 2], [ctx // 3, 2], [0, 1], [65, 1]],
            ),
        ),
        (
            "prefills-only-long-context",
            dict(
                H_q=16,
                Lkv=512,
                D_nope=128,
                D_rope=64,
                D_v=128,
                block_size=64,
                workspace_size=4096,
                decode_threshold=1,
                requests=[[8000, 100], [64, 200], [0, 50]],
            )
            if full
            else dict(
                H_q=4,
                Lkv=32,
                D_nope=16,
                D_rope=16,
                D_v=16,
                block_size=16,
                workspace_size=32,
                decode_threshold=1,
                requests=[[50, 6], [3, 9], [0, 7]],
            ),
        ),
        # two 64-head tiles, decodes over several hundred keys (split-KV), 128-token pages, the model's YaRN scale
        (
            "yarn-128-heads-page128",
            dict(
                H_q=128,
                Lkv=32,
                D_nope=16,
                D_rope=16,
                D_v=16,
                block_size=128,
                workspace_size=256,
                decode_threshold=2,
                requests=[[700, 1], [0, 1], [300, 2], [150, 1], [400, 5], [0, 3]],
                scale=V3_SCALE,
            ),
        ),
        # one token a page, a decode over ~2000 keys
        (
            "page1-long-context",
            dict(
                H_q=16,
                Lkv=32,
                D_nope=16,
                D_rope=16,
                D_v=16,
                block_size=1,
                workspace_size=24,
                decode_threshold=1,
                requests=[[1900, 1], [0, 1], [9, 1], [40, 3], [0, 5]],
            ),
        ),
    ]


OPS = [
    Op(
        "concat_and_cache_mla",
        _concat_inputs,
        _concat_reference,
        None,
        outputs=("kv_cache",),
        compare=_concat_compare,
        picture=_concat_picture,
        doc="Write [kv_c | k_pe] into a paged cache (auto / fp8 per-tensor / fp8_ds_mla 656 B); slot -1 skipped "
        "(spec.paged_cache.concat_and_cache_mla)",
        cases=_concat_and_cache_mla_cases,
        generator=_concat_and_cache_mla_params,
        spec=concat_and_cache_mla,
        writes=("kv_cache",),
    ),
    Op(
        "gather_cache",
        _gather_inputs,
        _gather_reference,
        None,
        outputs=("entries",),
        compare=_exact(("entries",), bits=True),
        doc="Gather each request's entries from seq_starts[b] into packed rows, bit for bit "
        "(spec.paged_cache.gather_cache)",
        cases=_gather_cache_cases,
        spec=gather_cache,
    ),
    Op(
        "slot_mapping_from_block_table",
        _slot_inputs,
        lambda **kw: tuple(slot_mapping_from_block_table(**kw)),
        None,
        outputs=("slot_mapping", "block_ids", "block_offsets"),
        compare=_exact(("slot_mapping", "block_ids", "block_offsets")),
        doc="slot = block_table[b, pos // P] * P + pos % P, padded with -1 (spec.paged_cache)",
        cases=_slot_mapping_from_block_table_cases,
        spec=slot_mapping_from_block_table,
    ),
    Op(
        "quantize",
        _quantize_inputs,
        _quantize_reference,
        None,
        outputs=("raw",),
        compare=_quantize_compare,
        picture=_quantize_picture,
        doc="Entries -> token records of a cache layout; judged after dequantization, scale bytes exact "
        "(spec.cache_layouts.quantize)",
        cases=_quantize_cases,
        spec=cl.quantize,
    ),
    Op(
        "dequantize",
        _dequantize_inputs,
        _dequantize_reference,
        None,
        outputs=("entries",),
        compare=_dequantize_compare,
        doc="Token records -> entries; deterministic: the spec's value rounded once to the returned dtype "
        "(spec.cache_layouts.dequantize)",
        cases=_dequantize_cases,
        spec=cl.dequantize,
    ),
    Op(
        "write_pages",
        _pages_inputs,
        _write_pages_reference,
        None,
        outputs=("pages",),
        compare=_write_pages_compare,
        picture=_write_pages_picture,
        doc="Quantize and place records in page blocks (V4 / V4.1: data rows, then scale rows) "
        "(spec.cache_layouts.write_pages)",
        cases=_write_pages_cases,
        spec=cl.write_pages,
        writes=("pages",),
    ),
    Op(
        "read_tokens",
        _read_inputs,
        _read_reference,
        None,
        outputs=("raw", "valid"),
        compare=_exact(("raw", "valid")),
        doc="Read records at slots out of page blocks, -1 invalid (spec.cache_layouts.read_tokens)",
        cases=_read_tokens_cases,
        spec=cl.read_tokens,
    ),
    Op(
        "chunked_prefill_attention",
        _chunked_inputs,
        chunked_prefill_attention,
        _chunked_bounds,
        picture=_chunked_picture,
        doc="Prefill attention with workspace-chunked context merged by LSE, then new tokens "
        "(spec.chunked_context.chunked_prefill_attention)",
        cases=_chunked_prefill_attention_cases,
        generator=_chunked_prefill_attention_params,
    ),
    Op(
        "mla_mixed_batch",
        _mixed_inputs,
        _mixed_reference,
        _mixed_bounds,
        doc="One MLA step over a mixed batch from a paged cache: decodes (MTP too) through the absorbed form, "
        "prefills through workspace-chunked context, outputs in token order (spec.chunked_context.mla_mixed_batch)",
        cases=_mla_mixed_batch_cases,
        spec=mla_mixed_batch,
        writes=("kv_cache",),
    ),
    Op(
        "build_metadata",
        _metadata_inputs,
        _metadata_reference,
        None,
        outputs=META_FIELDS,
        compare=_exact(META_FIELDS),
        doc="CommonAttentionMetadata from a request list (spec.batch.build_metadata)",
        cases=_build_metadata_cases,
        spec=build_metadata,
    ),
    Op(
        "split_decodes_and_prefills",
        _split_inputs,
        split_decodes_and_prefills,
        None,
        outputs=SPLIT_FIELDS,
        compare=_exact(SPLIT_FIELDS),
        doc="Decode / prefill boundary of a reordered batch (spec.batch)",
        cases=_split_decodes_and_prefills_cases,
    ),
    Op(
        "reorder_batch_to_split_decodes_and_prefills",
        _reorder_inputs,
        _reorder_reference,
        None,
        outputs=REORDER_FIELDS,
        compare=_exact(REORDER_FIELDS),
        doc="Decodes first: the seed's 2 regions or 0.33's 4 (spec.batch)",
        cases=_reorder_batch_to_split_decodes_and_prefills_cases,
        spec=reorder_batch_to_split_decodes_and_prefills,
    ),
    Op(
        "make_local_attention_virtual_batches",
        _local_inputs,
        _local_reference,
        None,
        outputs=LOCAL_FIELDS,
        compare=_exact(LOCAL_FIELDS),
        doc="Local attention as virtual requests, one per chunk (spec.batch)",
        cases=_make_local_attention_virtual_batches_cases,
        spec=make_local_attention_virtual_batches,
    ),
]
