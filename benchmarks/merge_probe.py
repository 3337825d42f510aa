"""The split-KV combine inside the 16-row decode's split kernel: an experiment, measured slower and not wired in.

Written in stop 60 (2026-11-30) for issue 18's 16-head targets (``docs/backends.md``, "Why the small-batch targets
are missed"): at B1 128K the decode's time beyond a plain read of its cache is ~5 us inside the split kernel, 2.5 us
in the combine kernel and ~1.6 us of launches, and 85% of the copy rate asks 1.6 us less. Merging the partials
inside :func:`mlaspec.impl.decode_sm90.split_kernel_keys` would skip the combine kernel and its launch.

The edit (:data:`EDITS`, applied to the landed kernel's source at run time, as ``decode_ablation.py`` does): each
program counts itself started; after storing its partial, a barrier and one thread's ``acq_rel`` arrival on its
sequence's counter. If every program of the sequence has started, it polls (``acquire``) until all have arrived,
then merges its share of the rows' 32-column blocks (all splits' partials and LSEs of a block in one ``.cg`` load,
the combine kernel's math); if not, it flags its share and the last to arrive merges the flagged shares -- so no
program ever waits on one that has not started, and the kernel cannot hang where the grid is not all resident (an
SM partition, MPS). The last program to finish resets the counters for the next launch; the counters belong to
the grid's sequences, so launches of it must follow one another in one stream (two at once on two streams would
share them). ``FORCE_LEFT`` makes the odd
splits leave their shares, to test that path.

Measured on an H200 (stop 60, CUDA-graph replays, alternated; its outputs equal the landed decode's within one bf16
step, the fp32 sums in another order, and exactly at 97K-128K keys, with ``FORCE_LEFT`` too, and after the replays
without it): slower at every shape, B1 128K 44.6 -> 46.8 us, B2 64K
44.2 -> 47.8, B1 8K 8.4 -> 10.7, and 0.35-0.37x where a sequence has 2-16 splits to share the merge (B1 1K, B64 1K).
The arrival, the wait and the merge's loads are L2 round trips one after another on the path, and a program merges
its share's blocks one at a time, where the combine kernel starts 256 or more one-warp programs with all their loads
in flight; a programmatic dependent launch, which overlaps the kernel boundary this replaces, gained at most 0.5 us
(stop 59, not kept). Where a sequence has few splits the probe's own design adds to it (a program merges 16-128
32-column blocks one after another, each recomputing its LSEs' maximum and sum); at B1 128K a program merges two.

    python benchmarks/merge_probe.py                          # the 16-head shapes of stop 60, on an H100/H200
    python benchmarks/merge_probe.py --shapes 16x1x131072,16x2x65536

Importing this module compiles nothing and needs no GPU.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

# the merge, inserted before split_kernel_keys (Gluon; one warpgroup)
MERGE = """
    MERGE_L = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))  # [splits, 32 columns], one warpgroup
    MERGE_COLS = gl.constexpr(32)

    @gluon.jit
    def _merge_unit(O_PART, LSE_PART, OUT, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                    b, row, col0, R, H_Q, num_splits, D_V: gl.constexpr, SPLITS_P2: gl.constexpr):  # fmt: skip
        sp = gl.arange(0, SPLITS_P2, layout=gl.SliceLayout(1, MERGE_L))
        cc = col0 + gl.arange(0, MERGE_COLS, layout=gl.SliceLayout(0, MERGE_L))
        ok = (sp < num_splits) & (row < R)
        part = (b * num_splits + sp).to(gl.int64) * R + row
        lses = gl.load(LSE_PART + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
        vals = gl.load(O_PART + gl.expand_dims(part * D_V, 1) + gl.expand_dims(cc, 0), mask=gl.expand_dims(ok, 1),
                       other=0.0, cache_modifier=".cg")  # fmt: skip
        m = gl.max(lses, 0)
        m_use = gl.where(m == float("-inf"), 0.0, m)
        w = gl.exp2(lses - m_use)
        total = gl.sum(w, 0)
        acc = gl.sum(gl.expand_dims(w, 1) * vals, 0)
        has_keys = total > 0.0
        total_use = gl.where(has_keys, total, 1.0)
        s, h = row // H_Q, row % H_Q
        if row < R:
            gl.store(OUT + b.to(gl.int64) * stride_ob + s * stride_os + h * stride_oh + cc,
                     (acc / total_use).to(OUT.dtype.element_ty))  # fmt: skip
            if col0 == 0:
                lse = gl.where(has_keys, (m_use + gl.log2(total_use)) * 0.6931471805599453, float("-inf"))
                gl.store(LSE + b * stride_lb + h * stride_lh + s * stride_ls, lse)

    @gluon.jit
    def _merge_share(O_PART, LSE_PART, OUT, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, b,
                     pid_m, share, R, H_Q, num_splits, ROWS: gl.constexpr, D_V: gl.constexpr,
                     SPLITS_P2: gl.constexpr):  # fmt: skip
        PER_ROW: gl.constexpr = D_V // MERGE_COLS
        units = ROWS * PER_ROW
        for u in range(share * units // num_splits, (share + 1) * units // num_splits):
            _merge_unit(O_PART, LSE_PART, OUT, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls, b,
                        pid_m * ROWS + u // PER_ROW, (u % PER_ROW) * MERGE_COLS, R, H_Q, num_splits, D_V,
                        SPLITS_P2)  # fmt: skip

    @gluon.jit
    def _merge_tail(COUNTS, LEFT, O_PART, LSE_PART, OUT, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                    stride_ls, b, pid_m, split, S_Q, H_Q, num_splits, ROWS: gl.constexpr, D_V: gl.constexpr,
                    SPLITS_P2: gl.constexpr, FORCE_LEFT: gl.constexpr):  # fmt: skip
        g = b * gl.num_programs(0) + pid_m
        C = COUNTS + g * 4  # started, arrived, done
        R = S_Q * H_Q
        safe = gl.atomic_add(C, 0, sem="relaxed", scope="gpu") >= num_splits  # every program has started
        if FORCE_LEFT:  # (a test of the last arrival's path: odd splits leave their shares)
            safe = safe & (split % 2 == 0)
        if not safe:
            gl.store(LEFT + g * SPLITS_P2 + split, 1)  # this share left to the last arrival
        _barrier()  # every thread's partial stores (and the flag) before the arrival, released with it
        ticket = gl.atomic_add(C + 1, 1, sem="acq_rel", scope="gpu")
        if safe:
            while gl.atomic_add(C + 1, 0, sem="acquire", scope="gpu") < num_splits:
                pass
            _barrier()
            _merge_share(O_PART, LSE_PART, OUT, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                         b, pid_m, split, R, H_Q, num_splits, ROWS, D_V, SPLITS_P2)  # fmt: skip
        if ticket == num_splits - 1:  # the last arrival: every share nobody merged
            sp = gl.arange(0, SPLITS_P2, layout=gl.SliceLayout(1, MERGE_L))
            left = gl.load(LEFT + g * SPLITS_P2 + sp, mask=sp < num_splits, other=0, cache_modifier=".cg")
            if gl.sum(left, 0) > 0:
                for share in range(0, num_splits):
                    if gl.sum(gl.where(sp == share, left, 0), 0) > 0:
                        _merge_share(O_PART, LSE_PART, OUT, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                                     stride_ls, b, pid_m, share, R, H_Q, num_splits, ROWS, D_V, SPLITS_P2)  # fmt: skip
                gl.store(LEFT + g * SPLITS_P2 + sp, gl.zeros_like(left), mask=sp < num_splits)
        _barrier()
        done = gl.atomic_add(C + 2, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:  # the last to finish: the counters back to zero for the next launch
            gl.atomic_xchg(C, 0, sem="relaxed", scope="gpu")
            gl.atomic_xchg(C + 1, 0, sem="relaxed", scope="gpu")
            gl.atomic_xchg(C + 2, 0, sem="relaxed", scope="gpu")

    # -- 16 query rows or fewer over a 16-bit cache: the keys as the MMAs' rows, one warpgroup ------------------------
"""

# (the landed source's lines, what replaces them; each found once)
_CALL = (
    "            _merge_tail(COUNTS, LEFT, O_PART, LSE_PART, OUT, LSE, stride_ob, stride_os, stride_oh, stride_lb,\n"
    "                        stride_lh, stride_ls, b, pid_m, split, S_Q, H_Q, num_splits, BLOCK_M, D_V,\n"
    "                        SPLITS_P2, FORCE_LEFT)\n"
)
EDITS = [
    ("    @gluon.jit\n    def split_kernel_keys(\n", MERGE + "    @gluon.jit\n    def split_kernel_keys(\n"),
    (
        "num_splits, DESC_V, DESC_R, CAUSAL: gl.constexpr, D_V: gl.constexpr, D_ROPE: gl.constexpr,\n"
        "        PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SINGLE: gl.constexpr,"
        " TMA: gl.constexpr,\n    ):",
        "num_splits, DESC_V, DESC_R, COUNTS, LEFT, CAUSAL: gl.constexpr, D_V: gl.constexpr,"
        " D_ROPE: gl.constexpr,\n"
        "        PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SINGLE: gl.constexpr,"
        " TMA: gl.constexpr,\n"
        "        MERGE: gl.constexpr = False, SPLITS_P2: gl.constexpr = 1, FORCE_LEFT: gl.constexpr = False,\n    ):",
    ),
    (  # (the start count, before q's copy)
        "        _copy_rows(q_v, q_r, q_b, pid_m * BLOCK_M, S_Q * H_Q, H_Q, stride_qs, stride_qh,"
        " (LOAD_V4, LOAD_R4))\n",
        "        if MERGE:\n"
        '            gl.atomic_add(COUNTS + (b * gl.num_programs(0) + pid_m) * 4, 1, sem="relaxed", scope="gpu")\n'
        "        _copy_rows(q_v, q_r, q_b, pid_m * BLOCK_M, S_Q * H_Q, H_Q, stride_qs, stride_qh,"
        " (LOAD_V4, LOAD_R4))\n",
    ),
    (
        "        _write_keys(acc_t, m_i, l_i, k_scale, pid_m, split, b, S_Q, H_Q, num_splits, outs, SINGLE)\n",
        "        _write_keys(acc_t, m_i, l_i, k_scale, pid_m, split, b, S_Q, H_Q, num_splits, outs, SINGLE)\n"
        "        if MERGE:\n" + _CALL,
    ),
]
_MODULE = None


def merged_source() -> str:
    """:mod:`mlaspec.impl.decode_sm90`'s source with :data:`EDITS` applied (``split_kernel_keys`` then takes ``COUNTS,
    LEFT`` after its descriptors and ``MERGE``, ``SPLITS_P2``, ``FORCE_LEFT``)."""
    source = Path(importlib.util.find_spec("mlaspec.impl.decode_sm90").origin).read_text()  # the one imported
    for old, new in EDITS:
        if source.count(old) != 1:
            raise ValueError(f"the kernel's source holds {source.count(old)} of {old[:60]!r}")
        source = source.replace(old, new)
    return re.sub(r"^(\s*)from \.(\w+) import", r"\1from mlaspec.impl.\2 import", source, flags=re.M)


def load():
    """The edited module, written to a temporary file (Triton reads a kernel's source from its file), once."""
    global _MODULE
    if _MODULE is None:
        folder = tempfile.mkdtemp()
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        path = Path(folder) / "merge_probe_sm90.py"
        path.write_text(merged_source())
        spec = importlib.util.spec_from_file_location("merge_probe_sm90", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["merge_probe_sm90"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["merge_probe_sm90"]
            raise
        _MODULE = module
    return _MODULE


def __getattr__(name: str):
    if name == "split_kernel_keys_merged":  # (for tests/compiled.py: "merge_probe:split_kernel_keys_merged")
        return load().split_kernel_keys
    raise AttributeError(name)


class _Merged:
    """Stands in for ``split_kernel_keys`` in the edited module: launches it with ``MERGE`` where there are splits,
    with counters of its own a grid (kept across calls, so CUDA graphs replay them)."""

    def __init__(self, kernel, force_left: bool = False):
        self.kernel, self.force_left, self.buffers = kernel, force_left, {}

    def __getitem__(self, grid):
        import torch
        import triton

        def launch(*args, **kwargs):
            splits = grid[1]
            if grid not in self.buffers:
                groups = grid[0] * grid[2]
                self.buffers[grid] = (
                    torch.zeros(groups * 4, dtype=torch.int32, device="cuda"),
                    torch.zeros(groups * triton.next_power_of_2(splits), dtype=torch.int32, device="cuda"),
                )
            merge = splits > 1
            p2 = triton.next_power_of_2(splits)
            self.kernel[grid](*args, *self.buffers[grid], **kwargs, MERGE=merge, SPLITS_P2=p2,
                              FORCE_LEFT=self.force_left and merge)  # fmt: skip

        return launch


def run(shapes, rounds: int = 3) -> list:
    """``(shape, landed us, merged us, largest difference, with FORCE_LEFT, after the replays)`` a shape ``(H, B,
    S_kv)``: the decode as called against the same decode merging in its split kernel, alternated ``rounds`` times.
    Only 16 heads or fewer (one query token, a bf16 cache) run ``split_kernel_keys``; other shapes are refused."""
    if any(heads > 16 for heads, _, _ in shapes):
        raise ValueError(f"merge_probe edits split_kernel_keys, which takes 16 heads or fewer; got {shapes}")
    import torch
    from common import bench
    from decode import D_QK, _fn, make_problem

    import mlaspec.impl.decode as dec

    landed, combine, module = dec.decode_sm90, dec._combine, load()
    kernel = module.split_kernel_keys
    variants = {"merged": _Merged(kernel), "force": _Merged(kernel, force_left=True)}

    def use(variant):
        module.split_kernel_keys = kernel
        if variant == "landed":
            dec.decode_sm90, dec._combine = landed, combine
        else:
            module.split_kernel_keys = variants[variant]
            dec.decode_sm90, dec._combine = module, (lambda *a, **k: None)

    def diff(a, b) -> float:
        return max((a.out.float() - b.out.float()).abs().max().item(), (a.lse - b.lse).abs().max().item())

    rows = []
    try:
        for heads, batch, keys in shapes:
            cache, bt, sl = make_problem(batch, keys, torch.device("cuda"))
            q = torch.randn(batch, 1, heads, D_QK, device="cuda", dtype=torch.bfloat16)
            fn = _fn("triton", None, q, cache, bt, sl, keys, 192**-0.5, None)
            outs = {}
            for v in ("landed", "merged", "force"):
                use(v)
                outs[v] = fn()
            times = {"landed": [], "merged": []}
            for _ in range(rounds):
                for v in times:
                    use(v)
                    times[v].append(bench(fn, graph=True) * 1e6)
            after = {}
            for v in ("merged", "force"):  # again after the replays: the counters and flags reset each launch
                use(v)
                for _ in range(100):
                    fn()
                after[v] = fn()
            use("landed")
            us = [statistics.median(times[v]) for v in times]
            diffs = [diff(outs["landed"], outs["merged"]), diff(outs["landed"], outs["force"])]
            diffs.append(max(diff(outs["landed"], after[v]) for v in after))
            rows.append(((heads, batch, keys), *us, *diffs))
    finally:
        use("landed")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16x1x1024,16x1x8192,16x1x65536,16x1x131072,16x2x65536,16x64x1024",
                        help="HxBxS_kv, comma-separated (16 heads: the keys kernel)")  # fmt: skip
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    print(
        "| shape | landed (us) | merged in the split kernel (us) | | largest difference | FORCE_LEFT | after replays |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (h, b, s), landed, merged, d, forced, after in run(shapes):
        ratio = landed / merged
        cells = [f"H{h} B{b} {s // 1024}K", f"{landed:.2f}", f"{merged:.2f}", f"{ratio:.2f}x"]
        print("| " + " | ".join(cells + [f"{x:.1e}" for x in (d, forced, after)]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
