"""Inputs and judging shared by the kernel tests, interpreted (CI) or compiled (on a GPU).

Import it after ``TRITON_INTERPRET`` is decided: it imports :mod:`mlaspec.impl.decode`, whose kernels are fixed as
interpreted or compiled when they are defined.
"""

import math

import torch

from mlaspec.conformance.ops.common import attention_bounds, unit_roundoff
from mlaspec.conformance.ops.sparse import gather_keys, sparse_bounds
from mlaspec.impl.decode import page_cache
from mlaspec.spec import cache_layouts as cl
from mlaspec.spec import indexer as indexer_spec
from mlaspec.spec.forms import mqa_latent_attention
from mlaspec.spec.sparse import global_slot_indices, sparse_decode

SCALE = 192**-0.5


def assert_within(name, got, ref, bound):
    """±inf / NaN positions exactly, then every finite element within its derived bound."""
    __tracebackhide__ = True
    got = got.detach().cpu().to(torch.float64)
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{name}: NaN positions differ"
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], ref[inf]), (
        f"{name}: inf positions differ: got {got[torch.isinf(got) | inf].tolist()}, "
        f"spec {ref[torch.isinf(got) | inf].tolist()}"
    )
    err = torch.where(torch.isfinite(ref), (got - ref).abs(), 0.0)
    bound = torch.broadcast_to(bound, ref.shape)
    ratio = err / bound.clamp_min(1e-300)
    worst = int(ratio.argmax())
    assert ratio.max() <= 1, (
        f"{name}: error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g} at "
        f"{worst}: got {got.flatten()[worst]:.6g}, spec {ref.flatten()[worst]:.6g}"
    )


def decode_case(B, S_q, H, seq_lens, dtype, causal, seed, *, page_size=64):
    """``q [B, S_q, H, 576]``, the dense entries ``kv``, and a shuffled paged cache with NaN in every slot past a
    sequence's end: ``(q, kv, cache, block_table, seq_lens)`` on the CPU."""
    g = torch.Generator().manual_seed(seed)
    s_max = max(seq_lens)
    q = (torch.randn(B, S_q, H, 576, generator=g, dtype=torch.float64) * 3).to(dtype)
    kv = torch.randn(B, s_max, 576, generator=g, dtype=torch.float64).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    cache, block_table, lens = page_cache(kv, page_size=page_size, generator=g, seq_lens=lens)
    return q, kv, cache, block_table, lens


def decode_reference(q, kv, seq_lens, causal, u):
    """Spec per sequence (its own length), and the harness's per-element budgets for unit roundoff ``u``."""
    outs, lses, out_bounds, lse_bounds = [], [], [], []
    for b, n in enumerate(seq_lens):
        qb, kb = q[b : b + 1], kv[b : b + 1, :n]
        ref = mqa_latent_attention(qb, kb, d_v=512, scale=SCALE, causal=causal)
        k = kb[:, :, None]
        ob, lb = attention_bounds(qb, k, k[..., :512], scale=SCALE, causal=causal, ref=ref, u=u)
        outs.append(ref.out), lses.append(ref.lse), out_bounds.append(ob), lse_bounds.append(lb)
    return torch.cat(outs), torch.cat(lses), torch.cat(out_bounds), torch.cat(lse_bounds)


def indexer_case(seed, m, n, h, d, *, starts_past_zero=True):
    """Ragged indexer inputs quantized as the spec does: fp8 ``q [m, h, d]`` with folded weights, fp8 ``k [n, d]``
    with per-key scales; spans ``[ks, ke)`` with an empty one (row 0), starting past 0 unless not
    ``starts_past_zero``; NaN keys (and scales) outside every span."""
    g = torch.Generator().manual_seed(seed)
    q = indexer_spec.quantize_indexer_q(
        torch.randn(m, h, d, generator=g, dtype=torch.float64) * 3, torch.randn(m, h, generator=g, dtype=torch.float64)
    )
    k_fp8, k_scale = indexer_spec.quantize_indexer_k(torch.randn(n, d, generator=g, dtype=torch.float64) * 2)
    ks = torch.randint(0, n // 2 if starts_past_zero else 1, (m,), generator=g)
    ke = torch.minimum(ks + torch.randint(0, n, (m,), generator=g), torch.tensor(n))
    ke[0] = ks[0]  # an empty span
    outside = torch.ones(n, dtype=torch.bool)
    for s, e in zip(ks.tolist(), ke.tolist()):
        outside[s:e] = False
    k_fp8 = k_fp8.view(torch.uint8).masked_fill(outside[:, None], 0x7F).view(torch.float8_e4m3fn)  # NaN keys
    k_scale = k_scale.masked_fill(outside, float("nan"))
    return q.q_fp8, k_fp8, q.weights.float(), ks.int(), ke.int(), k_scale


def assert_logits(got, ref, bound):
    """-inf positions exactly, then every finite logit within the harness's fp32 budget."""
    __tracebackhide__ = True
    got = got.detach().cpu().to(torch.float64)
    assert got.shape == ref.shape, f"shape {list(got.shape)}, spec {list(ref.shape)}"
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), inf), f"-inf positions differ: got {torch.isinf(got).nonzero().tolist()[:8]}"
    assert not torch.isnan(got).any(), "NaN in the logits"
    err = (got - ref).abs()[~inf]
    b = bound[~inf].clamp_min(1e-300)
    assert bool((err <= b).all()), f"worst error/bound {float((err / b).max()):.3g}"


def paged_fp8(num_blocks, page, d, dtype, gen):
    """A cache ``[NB, P, d]`` exactly representable in the fp8 sparse layout (FlashMLA's pow2 scales)."""
    x = torch.randn(num_blocks * page, d, generator=gen, dtype=torch.float64)
    layout = cl.FP8_DS_MLA_V32 if d == 576 else cl.FP8_DS_MLA_V4
    x = cl.dequantize(cl.quantize(x, layout, pow2_scales=d == 576).raw, layout).entries
    return x.to(dtype).view(num_blocks, page, d)


def sparse_decode_case(d, seed, dtype=torch.float16, page=16, *, h_q=5, k=20, seq_lens=(40, 9, 33), lengths=None):
    """Requests of ``seq_lens`` tokens over shuffled pages, two query tokens each; per-request top-k ``k`` as global
    slots (``-1`` past a prefix); NaN in every slot not named. ``(q [b, 2, h_q, d], cache [NB, page, d], slots [b, 2,
    k] int32, topk_length [b])`` on the CPU; ``topk_length`` ``lengths`` (default ``[k, 4, 0]``: one request that
    uses no slot)."""
    g = torch.Generator().manual_seed(seed)
    b, s_q = len(seq_lens), 2
    pages = [-(-n // page) for n in seq_lens]
    num_blocks = sum(pages) + 2
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((b, max(pages) + 1), -1, dtype=torch.int64)
    at = 0
    for r, n in enumerate(pages):
        table[r, :n] = perm[at : at + n]
        at += n
    local = torch.full((b * s_q, k), -1, dtype=torch.int64)
    for r, n in enumerate(seq_lens):
        for j in range(s_q):
            ctx = n - s_q + j + 1
            local[r * s_q + j, : min(k, ctx)] = torch.randperm(ctx, generator=g)[:k]
    slots = global_slot_indices(local, torch.arange(b).repeat_interleave(s_q), table, page).view(b, s_q, k)
    cache = paged_fp8(num_blocks, page, d, dtype, g)
    used = torch.zeros(num_blocks * page, dtype=torch.bool)
    used[slots[slots >= 0].long()] = True
    cache = cache.view(-1, d).masked_fill(~used[:, None], math.nan).view(num_blocks, page, d)
    q = (torch.randn(b, s_q, h_q, d, generator=g, dtype=torch.float64) * 2).to(dtype)
    lengths = [k, 4, 0] if lengths is None else lengths
    return q, cache, slots.to(torch.int32), torch.tensor(lengths, dtype=torch.int32)


def check_sparse_decode(q, cache, slots, lengths, out, lse, *, extra=None, sink=None):
    """A sparse decode's ``out`` / ``lse`` (scale 0.1, ``d_v`` 512) against the float64 spec within the harness's
    budgets (:func:`mlaspec.conformance.ops.sparse.sparse_bounds`); ``extra``: ``(cache, indices, lengths)``."""
    b, s_q, h_q, d = q.shape
    kw = {}
    if extra is not None:
        kw = dict(extra_kv_cache=extra[0].double(), extra_indices=extra[1], extra_topk_length=extra[2])
    spec = sparse_decode(
        q.double(), cache.double(), slots, scale=0.1, d_v=512, topk_length=lengths, attn_sink=sink, **kw
    )
    rows = cache.reshape(-1, 1, d)
    idx = slots.reshape(b * s_q, 1, -1)
    valid = (idx >= 0) & (torch.arange(idx.shape[-1]) < lengths.repeat_interleave(s_q)[:, None, None])
    keys = gather_keys(rows, idx, valid)
    if extra is not None:
        e_idx = extra[1].reshape(b * s_q, 1, -1)
        e_valid = (e_idx >= 0) & (torch.arange(e_idx.shape[-1]) < extra[2].repeat_interleave(s_q)[:, None, None])
        keys = torch.cat([keys, gather_keys(extra[0].reshape(-1, 1, d), e_idx, e_valid)], 1)
        valid = torch.cat([valid, e_valid], -1)
    out_b, lse_b, _ = sparse_bounds(
        q.reshape(b * s_q, h_q, d),
        keys,
        valid,
        scale=0.1,
        d_v=512,
        attn_sink=sink,
        out=spec.out.reshape(b * s_q, h_q, -1),
        lse=spec.lse.transpose(1, 2).reshape(b * s_q, h_q),
        u=unit_roundoff(q.dtype),
    )
    assert_within("out", out, spec.out, out_b.reshape(spec.out.shape))
    assert_within("lse", lse, spec.lse, lse_b.reshape(b, s_q, h_q).transpose(1, 2))


def record(monkeypatch, module, *names, launches: list | None = None) -> list:
    """Which of ``module``'s kernels ``names`` launch, in order, from here on (each still runs); ``launches``, where
    given, gets each launch's keyword arguments (its constexprs) too, with its positional ones under ``"args"``."""
    ran = []

    class Recorded:
        def __init__(self, name):
            self.name, self.real = name, getattr(module, name)

        def __getitem__(self, grid):
            ran.append(self.name)
            launch = self.real[grid]
            if launches is None:
                return launch

            def recorded(*args, **kwargs):
                launches.append({**kwargs, "args": args})
                return launch(*args, **kwargs)

            return recorded

    for name in names:
        monkeypatch.setattr(module, name, Recorded(name))
    return ran


def splits_of(launch: dict) -> tuple[int, int]:
    """``(blocks_per_split, num_splits)`` of a split kernel's launch that :func:`record` kept: its positional
    arguments 24 and 25 in ``mla_decode_paged``'s order (the readable and the Gluon split kernels alike)."""
    blocks_per_split, num_splits = launch["args"][24:26]
    return blocks_per_split, num_splits
