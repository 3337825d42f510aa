"""Where the 64-row Gluon decodes' time goes: a kernel timed with one part of its tile loop switched off at a time.

Each ablation is a copy of :mod:`mlaspec.impl.decode_sm90`'s source with named lines replaced (:data:`ABLATIONS`),
written to a temporary module at run time (no second copy of the kernel in the tree) and launched through
:func:`mlaspec.impl.decode.mla_decode_paged` in the landed kernel's place, alternated with it in one process
(CUDA-graph replays, :func:`common.bench`), and beside the decode as called (``as called``: at 128 heads
``split_kernel_lead``, which is not ablated here). Its outputs are then wrong; its time says what the part costs, and a
part whose removal saves nothing is hidden behind another. The first table of ``docs/backends.md``, "Where the
128-head decode's time goes" (2026-11-27, one H100), was measured with the same parts switched off in a hand-made
copy of the kernel, before this script existed.

    python benchmarks/decode_ablation.py                                 # 128 heads: B64 8K and B1 128K
    python benchmarks/decode_ablation.py --shapes 128x2x65536 --out /tmp/ablation.png
    python benchmarks/decode_ablation.py --kernel lead       # split_kernel_lead: softmax, MMAs, partials, copies,
                                                             # block-table reads, the MMAs alone, one copy a tile,
                                                             # copies from L2 (benchmarks/power.py: their energy)
    python benchmarks/decode_ablation.py --kernel fp8        # split_kernel_fp8 (per-tensor fp8 cache): its producer's
                                                             # loads and conversion, its consumers' MMAs and softmax
    python benchmarks/decode_ablation.py --kernel fp8lead    # split_kernel_lead over the fp8 cache (128 heads): its
                                                             # compute, partials and producer
    python benchmarks/decode_ablation.py --kernel keys       # split_kernel_fp8_keys (the fp8 cache at <= 32 rows):
                                                             # the same producer parts, its consumer's, the partials
    python benchmarks/decode_ablation.py --kernel keys16     # split_kernel_keys (16 bf16 rows: 16 heads as called):
                                                             # its MMAs, softmax and partial stores, beside a plain read
    python benchmarks/decode_ablation.py --kernel seesaw     # benchmarks/seesaw_probe.py with its copies off
    python benchmarks/decode_ablation.py --kernel sparse     # the sparse decode (mlaspec.impl.sparse_sm90), top-k 2048
    python benchmarks/decode_ablation.py --padded            # 16 heads on split_kernel, beside a plain read

If the kernel's source changes so that an ablation's lines are no longer found, building it fails and names them
(``tests/test_impl_pipelining.py`` checks that every ablation still applies and compiles for sm_90).

Importing this module compiles nothing and needs no GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
import types
from pathlib import Path

# part -> the kernel's lines it replaces, and with what (indentation included)
ABLATIONS = {
    "softmax": [
        (
            "p, alpha, m_i_new = _softmax_step(qk, m_i)",
            "p, alpha, m_i_new = qk, gl.full([BLOCK_M], 1.0, gl.float32, ROW_QK), m_i",
        )
    ],
    "rescale": [("        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, PV)), 1)\n", "")],
    "q k^T": [
        (
            "            qk = warpgroup_mma(q_v, k_v.permute((1, 0)), zero_qk, use_acc=False, is_async=True)\n"
            "            qk = warpgroup_mma(q_r, kv_r.index(buf).permute((1, 0)), qk, is_async=True)\n"
            "            qk = warpgroup_mma_wait(0, deps=(qk,))\n",
            "            qk = zero_qk + 1.0\n",
        )
    ],
    "P @ V": [
        (
            "        acc = warpgroup_mma(p_smem, v, acc, is_async=True)\n"
            "        return warpgroup_mma_wait(0, deps=(acc,))\n",
            "        return acc\n",
        )
    ],
    "P store + barrier": [
        ("        p_smem.store(p.to(p_smem.dtype))\n        fence_async_shared()\n        _barrier()\n", "")
    ],
    "copy waits": [
        (  # in _next_tile, which split_kernel_keys shares (not ablated: 16 rows run split_kernel here)
            "        async_copy.wait_group(1)  # this tile (and q); tile blk + 1 stays in flight\n"
            "        if TMA:\n"
            "            mbarrier.wait(bars.index(buf), ((blk - blk_lo) // 2) & 1)\n",
            "",
        ),
        (
            "        if blk + 1 < blk_hi:\n            _issue_tile(",
            "        if blk < 0:  # never\n            _issue_tile(",
        ),
    ],
}
# benchmarks/seesaw_probe.py: its copies off, each part's barrier signalled at once (the tiles then garbage)
SEESAW_ABLATIONS = {
    "copies": [
        (
            "    if (blk + 1) * n <= p.seq_len:\n        row = page",
            "    if blk >= 0:  # ablated: no copy\n        mbarrier.arrive(bar)\n"
            "    elif (blk + 1) * n <= p.seq_len:\n        row = page",
        )
    ]
}
# mlaspec.impl.sparse_sm90 (the fp8 656-byte sparse decode): its tile loop's parts
SPARSE_ABLATIONS = {
    # the gathers of the next tiles (the first two tiles' bytes are still copied): their e4m3 bytes, scales, RoPE values
    "byte copies": [("            _copy_e4m3(e4m3.index(buf), KV, s2)\n", "")],
    "scale loads": [("            scale = _load_scales(KVF, s1)\n", "")],
    "RoPE loads": [("            rope = _load_rope(KVB, r1)\n", "")],
    "dequant": [
        (
            "            k_v.store(_dequantize(e4m3.index(buf).load(RAW), scale, dtype))\n"
            "            k_r.store(rope.to(dtype))\n",
            "",
        )
    ],
    # the parts of its tile step, _attend
    "q k^T": [
        (
            "        qk = warpgroup_mma(q_v, k_v.permute((1, 0)), zero_qk, use_acc=False, is_async=True)\n"
            "        qk = warpgroup_mma(q_r, k_r.permute((1, 0)), qk, is_async=True)\n"
            "        qk = warpgroup_mma_wait(0, deps=(qk,))\n",
            "        qk = zero_qk + 1.0\n",
        )
    ],
    "softmax": [
        (
            "p, alpha, m_new = _softmax_step(qk, m_i)",
            "p, alpha, m_new = qk, gl.full([64], 1.0, gl.float32, gl.SliceLayout(1, QK)), m_i",
        )
    ],
    "P @ V": [  # with P's store and barrier; the rescale stays
        (
            "        return m_new, l_i, _p_times_v(p, alpha, acc, p_smem, k_v)\n",
            "        return m_new, l_i, acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, PV)), 1)\n",
        )
    ],
}
# mlaspec.impl.decode_sm90.split_kernel_fp8 (vLLM's per-tensor fp8 cache): its producer's loads and conversion, its
# consumers' parts (the tiles the producer hands over are then garbage, the handoffs stay)
FP8_ABLATIONS = {
    "byte loads": [
        (
            "            raw, rope = _load_bytes(p.KV, page, blk, p.seq_len, p.stride_kp, p.stride_ks, p.page, n)\n",
            "            raw = gl.full([n, 4, 128], 0, gl.uint8, PRAW)\n"
            "            rope = gl.full([n, 64], 0, gl.uint8, PRAW_R)\n",
        )
    ],
    "conversion": [  # each byte moved to a bf16's high byte: integer instructions only
        ("_e4m3_to(raw, p.q_v.dtype)", "(raw.to(gl.int16) << 8).to(p.q_v.dtype, bitcast=True)"),
        ("_e4m3_to(rope, p.q_v.dtype)", "(rope.to(gl.int16) << 8).to(p.q_v.dtype, bitcast=True)"),
    ],
    "q k^T": [
        (
            "            qk = warpgroup_mma(p.q_v, k_v.permute((1, 0)), zero_qk, use_acc=False, is_async=True)\n"
            "            qk = warpgroup_mma(p.q_r, p.k_r.index(b).permute((1, 0)), qk, is_async=True)\n"
            "            qk = warpgroup_mma_wait(0, deps=(qk,))\n",
            "            qk = zero_qk + 1.0\n",
        )
    ],
    "softmax": [
        (
            "prob, alpha, m_i_new = _softmax_step(qk, m_i)",
            "prob, alpha, m_i_new = qk, gl.full([M], 1.0, gl.float32, gl.SliceLayout(1, QK)), m_i",
        )
    ],
    "P @ V": ABLATIONS["P @ V"],  # in _p_times_v, which split_kernel shares
}
FP8_PRODUCER = ("byte loads", "conversion")
FP8_CONSUMER = ("q k^T", "softmax", "P @ V")
# mlaspec.impl.decode_sm90.split_kernel_fp8_keys (the fp8 cache at 32 rows or fewer, the keys as the MMAs' rows): its
# producer's byte copies and conversion (the latter shared with split_kernel_fp8), its one consumer warpgroup's parts
# (in _keys_step, which split_kernel_keys shares)
KEYS_ABLATIONS = {
    "byte loads": [  # the copies into shared memory of every tile but the first (the bytes then stale)
        (
            "            if blk + 1 < p.blk_hi:\n                _copy_bytes(",
            "            if blk < 0:  # ablated: no copy\n                _copy_bytes(",
        )
    ],
    "conversion": FP8_ABLATIONS["conversion"],
    "q k^T": [
        (
            "        s_t = warpgroup_mma(k_v, q_v.permute((1, 0)), zero_t, use_acc=False, is_async=True)\n"
            "        s_t = warpgroup_mma(k_r, q_r.permute((1, 0)), s_t, is_async=True)\n"
            "        s_t = warpgroup_mma_wait(0, deps=(s_t,))\n",
            "        s_t = zero_t + 1.0\n",
        )
    ],
    "softmax": [
        (
            "prob, alpha, m_new = _softmax_step(s, m_i)",
            "prob, alpha, m_new = s, gl.full([s.shape[0]], 1.0, gl.float32, gl.SliceLayout(1, s.type.layout)), m_i",
        )
    ],
    "P @ V": [
        (
            "        acc_t = warpgroup_mma(k_v.permute((1, 0)), p_smem.permute((1, 0)), acc_t, is_async=True)\n"
            "        return m_new, l_i, warpgroup_mma_wait(0, deps=(acc_t,))\n",
            "        return m_new, l_i, acc_t\n",
        )
    ],
}
# mlaspec.impl.decode_sm90.split_kernel_lead (128 heads): its leader's softmax and both warpgroups' MMAs (its copy
# waits stay: with three barriers a buffer, a copy issued before the last one landed would arrive twice); all three
# off leave the copies and the handoffs, "copies" off the compute alone
LEAD_ABLATIONS = {
    "softmax": [
        (
            "        prob, alpha, m_i = _softmax_step(s, m_i)\n",
            "        prob, alpha = s, gl.full([s.shape[0]], 1.0, gl.float32, gl.SliceLayout(1, QK1))\n",
        )
    ],
    "q k^T": [
        (
            "        s = warpgroup_mma(p.q_v.slice(0, HALF, dim=1), k_v.slice(0, HALF, dim=1).permute((1, 0)), s,"
            " use_acc=False,\n                          is_async=True)  # fmt: skip\n",
            "",
        ),
        (
            "        s = warpgroup_mma(p.q_v.slice(HALF, HALF, dim=1), k_v.slice(HALF, HALF, dim=1).permute((1, 0)),"
            " s,\n                          is_async=True)  # fmt: skip\n",
            "",
        ),
        (
            "        return warpgroup_mma(p.q_r, p.k_r.index(t % 2).permute((1, 0)), s, is_async=True)\n",
            "        return s + 1.0\n",
        ),
    ],
    "P @ V": [
        (
            "        pv = warpgroup_mma(gl.convert_layout(p16, P_A), v, acc, is_async=True)\n",
            "        pv = acc\n",
        ),
        (
            "            pv = warpgroup_mma(p.p_smem, p.k_v.index(i % 2).slice(HALF, HALF, dim=1), acc,"
            " is_async=True)\n",
            "            pv = acc\n",
        ),
    ],
}
# the epilogue's fp32 partials (_write_rows; split_kernel_lead's _store_partial): their stores predicated off by a
# condition the compiler cannot see is false (removing them would let it drop every MMA that feeds them)
LEAD_ABLATIONS["partial stores"] = [
    (
        "                out,\n                mask=gl.expand_dims(row_ok, 1),\n            )\n"
        "            if WITH_LSE:\n                gl.store(LSE_PART",
        "                out,\n                mask=gl.expand_dims(row_ok & (num_splits < 0), 1),\n            )\n"
        "            if WITH_LSE:\n                gl.store(LSE_PART",
    ),
    (  # split_kernel_lead's, as tensor-memory copies
        "        _tma_store(DESC_O, [row0, col0], stage)\n",
        "        if p.num_splits < 0:\n            _tma_store(DESC_O, [row0, col0], stage)\n",
    ),
]
# its copies: none issued, each part's barrier signalled at once (the tiles then stale): what the compute alone takes
LEAD_ABLATIONS["copies"] = [
    (
        "        if (blk + 1) * n <= p.seq_len:\n            row = page.to(gl.int32) * p.page + slot0\n",
        "        if blk >= 0:  # ablated: no copy\n            mbarrier.arrive(bar)\n"
        "        elif (blk + 1) * n <= p.seq_len:\n            row = page.to(gl.int32) * p.page + slot0\n",
    )
]
# the second head block's tensor-memory copies (each tile's second reader, from L2): none issued, their barriers
# signalled at once (a sequence's part-filled last tile is still copied);
# with the compute off, what the copies alone take when each tile crosses from L2 to an SM once, not twice
LEAD_ABLATIONS["second copies"] = [
    (
        f"                mbarrier.expect(bar, {d}.block_type.nbytes)\n"
        f"                _tma_load({d}, [row, {c}], bar, dst)\n",
        f"                mbarrier.expect(bar, {d}.block_type.nbytes, pred=p.pid_m % 2 == 0)\n"
        f"                mbarrier.arrive(bar, pred=p.pid_m % 2 == 1)\n"
        f"                _tma_load({d}, [row, {c}], bar, dst, pred=p.pid_m % 2 == 0)\n",
    )
    for d, c in (("DESC_R", "2 * HALF"), ("DESC_H", "PART * HALF"))
]
# the block-table reads on the copies' path: each sequence's pages taken in order instead (the benchmark's caches
# hold B whole sequences of pages; the keys then differ, the bytes read do not)
LEAD_ABLATIONS["block-table reads"] = [
    (
        "        page = gl.load(p.bt + blk // (p.page // n)).to(gl.int64)\n",
        "        page = (blk // (p.page // n) + p.b * gl.cdiv(p.seq_len, p.page)).to(gl.int64)\n",
    )
]
# every copy of a split reads the split's first tile again (from L2 after its first read): the same shared-memory
# writes and barriers, no DRAM stream; the outputs then wrong
LEAD_ABLATIONS["L2 copies"] = [
    (  # (the page read above is then dead: the compiler drops it)
        "        slot0 = (blk % (p.page // n)) * n\n",
        "        page = gl.load(p.bt + p.blk_lo // (p.page // n)).to(gl.int64)  # ablated\n"
        "        slot0 = (p.blk_lo % (p.page // n)) * n\n",
    )
]
LEAD_COMPUTE = ("softmax", "q k^T", "P @ V")
# split_kernel's partials are stored from registers (_write_rows): the first of the lead kernel's two replacements
# (so the default --kernel landed run times it too)
ABLATIONS["partial stores"] = LEAD_ABLATIONS["partial stores"][:1]
KEYS_ABLATIONS["partial stores"] = ABLATIONS["partial stores"]  # (so is split_kernel_fp8_keys's)
# split_kernel_keys (a 16-bit cache at 16 rows or fewer): the consumer parts of split_kernel_fp8_keys, which it shares
KEYS16_COMPUTE = ("q k^T", "softmax", "P @ V")
KEYS16_ABLATIONS = {part: KEYS_ABLATIONS[part] for part in (*KEYS16_COMPUTE, "partial stores")}
# the kernels judged against their own unablated copy (the others against the landed split_kernel)
OWN_REFERENCE = ("fp8", "keys", "keys16", "fp8lead")
# --padded (16 heads on split_kernel, rows padded to its 64-row tile): what its copies, launches and combine take alone
PADDED_VARIANTS = [(), ("q k^T", "P @ V"), LEAD_COMPUTE, ("partial stores",), (*LEAD_COMPUTE, "partial stores")]
GATHERS = ("byte copies", "scale loads", "RoPE loads")
# split_kernel_lead over the fp8 cache: its leader's and helper's compute, its partials and the producer's loads
# and conversion (split_kernel_fp8's, shared; its tiles are then garbage, the handoffs stay)
FP8_LEAD_ABLATIONS = {
    **{part: LEAD_ABLATIONS[part] for part in (*LEAD_COMPUTE, "partial stores")},
    **{part: FP8_ABLATIONS[part] for part in FP8_PRODUCER},
}
# kernel -> (its source file, its ablations, the variants timed by default: as it is, each part alone, ...)
KERNELS = {
    "landed": ("impl/decode_sm90.py", ABLATIONS, [(), *((n,) for n in ABLATIONS), ("copy waits", "q k^T", "P @ V")]),
    "lead": (
        "impl/decode_sm90.py",
        LEAD_ABLATIONS,
        [
            (),
            *((n,) for n in LEAD_ABLATIONS),
            ("q k^T", "P @ V"),
            LEAD_COMPUTE,
            (*LEAD_COMPUTE, "partial stores"),
            ("copies", "softmax"),  # the MMAs and handoffs alone
            ("copies", "q k^T"),  # the compute alone without q k^T: is its overlap lost to q k^T or to the balance?
            ("copies", "P @ V"),  # the compute alone without P @ V
            ("softmax", "P @ V"),  # q k^T alone beside the copies: does it lose the overlap when it is short?
            ("copies", "softmax", "P @ V"),  # q k^T alone
            (*LEAD_COMPUTE, "second copies"),  # the copies alone, each tile into one SM of the two that read it
            (*LEAD_COMPUTE, "L2 copies"),  # the copies alone, from L2: what the stream from memory adds
        ],
    ),
    "fp8": (
        "impl/decode_sm90.py",
        FP8_ABLATIONS,
        [(), *((n,) for n in FP8_ABLATIONS), FP8_PRODUCER, ("q k^T", "P @ V"), FP8_CONSUMER],
    ),
    "keys": (
        "impl/decode_sm90.py",
        KEYS_ABLATIONS,
        [(), *((n,) for n in KEYS_ABLATIONS), FP8_PRODUCER, ("q k^T", "P @ V"), FP8_CONSUMER, ("partial stores",)],
    ),
    "keys16": (
        "impl/decode_sm90.py",
        KEYS16_ABLATIONS,
        [(), *((n,) for n in KEYS16_ABLATIONS), KEYS16_COMPUTE, (*KEYS16_COMPUTE, "partial stores")],
    ),
    "fp8lead": (
        "impl/decode_sm90.py",
        FP8_LEAD_ABLATIONS,
        [(), *((n,) for n in FP8_LEAD_ABLATIONS), FP8_PRODUCER, ("q k^T", "P @ V"), LEAD_COMPUTE],
    ),
    "seesaw": ("benchmarks/seesaw_probe.py", SEESAW_ABLATIONS, [(), ("copies",)]),
    "sparse": (
        "impl/sparse_sm90.py",
        SPARSE_ABLATIONS,
        [(), *((n,) for n in SPARSE_ABLATIONS), GATHERS, ("q k^T", "P @ V"), (*GATHERS, "dequant")],
    ),
}


def ablated_source(parts, kernel: str = "landed") -> str:
    """``kernel``'s source (:data:`KERNELS`) with ``parts`` (names of its ablations) switched off."""
    path, ablations, _ = KERNELS[kernel]
    source = (Path(__file__).parents[1] / path).read_text()
    for part in parts:
        for old, new in ablations[part]:
            if source.count(old) != 1:
                raise ValueError(f"ablation {part!r}: the kernel's source holds {source.count(old)} of {old!r}")
            source = source.replace(old, new)
    return re.sub(r"^(\s*)from \.(\w+) import", r"\1from mlaspec.impl.\2 import", source, flags=re.M)  # its own module


def load(parts, folder: str, kernel: str = "landed"):
    """The ablated kernel's module (written to ``folder``: Triton reads a kernel's source from its file)."""
    name = f"{kernel}_without_" + "_".join("".join(c for c in p if c.isalnum()) for p in parts)
    path = Path(folder) / f"{name}.py"
    path.write_text(ablated_source(parts, kernel))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _in_place(module, landed, kernel: str = "landed"):
    """What ``mlaspec.impl.decode`` sees as ``decode_sm90``: ``module`` itself if it is a copy of the landed kernel's
    module, running the kernel the ablations edit (``"landed"``: ``split_kernel`` at every row count, called with its
    64-row tile; ``"lead"``, ``"fp8lead"``: ``split_kernel_lead`` where it applies (over the 16-bit or the fp8
    cache); ``"fp8"``: ``split_kernel_fp8`` at every row count; ``"keys"``: ``split_kernel_fp8_keys`` at 32 rows or
    fewer; ``"keys16"``: ``split_kernel_keys`` at 16 rows or fewer), else the landed module with ``module``'s split
    kernel (the seesaw probe)."""
    if hasattr(module, "cache_descriptors"):
        if kernel == "landed":
            module.lead_applies = lambda row_blocks: False
        if kernel == "fp8":  # split_kernel_fp8 at any row count, rows padded to its 64-row tile
            module.keys_rows = lambda rows: None
            module.lead_applies = lambda row_blocks: False
        return module
    names = ("AVAILABLE", "BLOCK_M", "BLOCK_N", "NUM_WARPS", "cache_descriptors")
    return types.SimpleNamespace(
        **{n: getattr(landed, n) for n in names},
        split_kernel=module.split_kernel,
        lead_applies=lambda row_blocks: False,
    )


def run(shapes, kernel: str = "landed", *, padded: bool = False) -> list:
    """:class:`common.Row` s, one a variant of ``kernel`` and shape (provider ``kernel`` or ``"<kernel> without
    <parts>"``), the landed kernel's, and FlashMLA's where it imports. ``padded``: ``split_kernel`` at any head
    count, rows padded to its 64-row tile (``kernel="sm90"``, :data:`mlaspec.impl.decode.GLUON_TILE`; at 16 heads
    the decode as called runs ``split_kernel_keys``, the readable kernel before 2026-11-29, night), the variants
    :data:`PADDED_VARIANTS`, and the plain read of the same cache (``benchmarks/stream.py``): the floor of any kernel
    reading it once (beside ``keys16`` too)."""
    import stream
    import torch
    from common import Row, bench, load_flashmla, load_flashmla_fp8
    from decode import D_QK, _fn, make_problem

    import mlaspec.impl.decode as dec

    if padded and kernel != "landed":
        raise ValueError(f"padded runs the landed split_kernel, not {kernel!r}")
    if kernel == "sparse":
        return _sparse_rows(shapes)
    fp8 = kernel in ("fp8", "keys", "fp8lead")  # vLLM's per-tensor fp8 cache (k_scale 0.5), FlashMLA's fp8 beside
    landed, rows, fm = dec.decode_sm90, [], load_flashmla_fp8() if fp8 else load_flashmla()
    variants = [(kernel, parts) for parts in (PADDED_VARIANTS if padded else KERNELS[kernel][2])]
    if kernel != "landed" and kernel not in OWN_REFERENCE:
        variants.insert(0, ("landed", ()))
    with tempfile.TemporaryDirectory() as folder:
        modules = {(k, parts): _in_place(load(parts, folder, k), landed, k) for k, parts in variants}
        if kernel not in ("lead", "keys", "keys16", "fp8lead"):  # (their unablated copies are the decode as called)
            modules[("as called", ())] = landed  # split_kernel_lead where it applies (decode_sm90.lead_applies)
        for heads, batch, keys in shapes:
            cache, bt, sl = make_problem(batch, keys, torch.device("cuda"), fp8=fp8)
            q = torch.randn(batch, 1, heads, D_QK, device="cuda", dtype=torch.bfloat16)
            problem = (q, cache, bt, sl, keys, 192**-0.5, 0.5 if fp8 else None)
            shape = dict(H=heads, B=batch, S_kv=keys)
            if fm:
                rows.append(Row("decode", "flashmla", shape, bench(_fn("flashmla", fm, *problem), graph=True), 0, 0))
            if padded or kernel == "keys16":
                rows.append(Row("decode", "read", shape, stream.fastest(cache)[0], 0, 0, timer="graph"))
            as_called = _fn("triton", fm, *problem, **({"kernel": "sm90"} if fp8 else {}))  # fp8: the Gluon kernels
            # split_kernel itself at any row count (16 bf16 rows as called take split_kernel_keys, not ablated here)
            padded_call = padded or kernel == "landed"
            call = _fn("triton", fm, *problem, kernel="sm90", config=dec.GLUON_TILE) if padded_call else as_called
            for (k, parts), module in modules.items():
                dec.decode_sm90 = module
                try:
                    seconds = bench(as_called if k == "as called" else call, graph=True)
                finally:
                    dec.decode_sm90 = landed
                provider = f"{k} without " + " + ".join(parts) if parts else k
                rows.append(Row("decode", provider, shape, seconds, 0, 0, timer="graph"))
    return rows


def _sparse_rows(shapes, topk: int = 2048) -> list:
    """:func:`run` for the sparse decode: ``shapes`` as ``(H, B, S_kv)``, ``topk`` keys a row (fp8 656-byte cache)."""
    import torch
    from common import Row, bench, load_flashmla
    from sparse import _decode_fn, decode_problem

    import mlaspec.impl.sparse as sp

    landed, rows, fm = sp.sparse_sm90, [], load_flashmla()
    chooser, sp.sparse_producer_runs = sp.sparse_producer_runs, lambda tiles: False  # the kernel ablated here
    with tempfile.TemporaryDirectory() as folder:
        modules = {parts: load(parts, folder, "sparse") if parts else landed for parts in KERNELS["sparse"][2]}
        for heads, batch, s_kv in shapes:
            q, raw, idx = decode_problem(batch, heads, topk, s_kv, torch.device("cuda"))
            shape = dict(H=heads, B=batch, K=topk)
            providers = ["flashmla", "triton-fp8"] if fm else ["triton-fp8"]
            for provider in providers:
                call, _ = _decode_fn(provider, fm, q, raw, None, idx, 576**-0.5)
                for parts, module in modules.items() if provider != "flashmla" else [((), None)]:
                    sp.sparse_sm90 = module or landed
                    try:
                        seconds = bench(call, graph=True)
                    finally:
                        sp.sparse_sm90 = landed
                    name = "flashmla" if provider == "flashmla" else "sparse"
                    if parts:
                        name += " without " + " + ".join(parts)
                    rows.append(Row("sparse_decode", name, shape, seconds, 0, 0, timer="graph"))
    sp.sparse_producer_runs = chooser
    return rows


def main(argv: list[str] | None = None) -> int:
    from common import REFERENCE, plot_bars, print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        help="HxBxS_kv, comma-separated (default: 128x64x8192,128x1x131072; sparse:"
        " 128x64x8192,128x128x8192, top-k 2048; fp8: 128x64x8192,128x1x65536,16x64x4096,16x1x65536; keys:"
        " 16x1x65536,16x2x131072,16x64x4096,32x64x4096; fp8lead: 128x64x8192,128x1x65536,128x2x131072)",
    )
    parser.add_argument("--kernel", choices=list(KERNELS), default="landed", help="whose parts to switch off")
    parser.add_argument(
        "--padded",
        action="store_true",
        help="split_kernel, rows padded to 64, at any head count (default: the 16-head targets), beside a plain read",
    )
    parser.add_argument("--out", help="also write a bar chart here (.png)")
    args = parser.parse_args(argv)
    default = {
        "sparse": "128x64x8192,128x128x8192",
        "fp8": "128x64x8192,128x1x65536,16x64x4096,16x1x65536",
        "keys": "16x1x65536,16x2x131072,16x64x4096,32x64x4096",
        "keys16": "16x1x8192,16x1x65536,16x1x131072,16x2x65536",
        "fp8lead": "128x64x8192,128x1x65536,128x2x131072",
    }.get(args.kernel, "128x64x8192,128x1x131072")
    if args.padded:  # the 16-head targets of issue 18
        default = "16x1x65536,16x1x131072,16x2x65536,16x2x131072,16x1x8192"
    shapes = [tuple(int(x) for x in s.split("x")) for s in (args.shapes or default).split(",")]
    rows = run(shapes, args.kernel, padded=args.padded)
    reference = args.kernel if args.kernel in OWN_REFERENCE else "landed"
    print_table(rows, {**REFERENCE, "decode": reference, "sparse_decode": "sparse"})
    if args.out:
        plot_bars(rows, args.out, title="the Gluon decode without one part (µs, lower is faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
