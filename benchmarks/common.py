"""What the benchmarks share: the timer, the card's roofline, result rows, the markdown table and the figures.

A :class:`Row` is one provider's median time for one kernel and shape, with the bytes and FLOPs the kernel must move
and do (each benchmark's docstring says how it counts them); GB/s and TFLOP/s divide those by the time. The ratio is
the reference provider's time over the row's time, both measured in the same run (:data:`REFERENCE`: FlashMLA for
the attention kernels, DeepGEMM for the indexer logits, ``torch.topk`` for the top-k): ``1.00x`` is a tie, below 1
is slower. The scripts next to this one import it as ``common`` (``python benchmarks/<name>.py`` puts this folder
on ``sys.path``).

Importing this module runs nothing; only :func:`bench` and :func:`measure_roofline` need a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

# kernel -> the provider its ratio is taken against
REFERENCE = {
    "decode": "flashmla",
    "decode_fp8": "flashmla",
    "decode_sustained": "flashmla",
    "sparse_decode": "flashmla",
    "sparse_prefill": "flashmla",
    "indexer": "deepgemm",
    "indexer_graph": "deepgemm",
    "topk": "torch",
}
# providers that are a floor, not a kernel of the comparison (a plain read of the same bytes): no ratio
FLOORS = ("read",)


def bench(fn: Callable[[], object], *, graph: bool = False) -> float:
    """Median seconds of ``fn``: replayed from a CUDA graph (``graph``: as serving runs decode; no Python launch
    overhead, L2 not flushed, so inputs under ~50 MB partly hit L2), else ``triton.testing.do_bench`` (L2 flushed,
    launch overhead included)."""
    import triton.testing

    # do_bench_cudagraph runs fn on a fresh side stream that does not wait for the default one: without this, fn can
    # start before its inputs exist (behind a 1 GB cache's randn, the block table is still unwritten: garbage page
    # ids, illegal addresses; seen on the H200).
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e-3
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


def graphed(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn`` (after three calls outside it: compiles, allocator pools)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph


def sustained(fn: Callable[[], object], seconds: float, *, settle: float = 1.0, calls: int = 20):
    """``(start, stop, seconds a call)``: ``fn`` replayed from a graph of ``calls`` calls back to back after 1 s
    idle, ``settle`` seconds untimed (the clock settles where the card's power limit holds it: ``power.py``,
    ``docs/bench/power.md``), then ``seconds`` timed on the GPU, from wall time ``start`` to ``stop``."""
    graph = graphed(fn, calls)
    time.sleep(1.0)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, start, reps = time.time(), None, 0
    while time.time() - t0 < settle + seconds:
        if start is None and time.time() - t0 >= settle:
            torch.cuda.synchronize()
            start, reps = time.time(), 0
            begin.record()
        graph.replay()
        reps += 1
        if reps % 8 == 0:
            torch.cuda.synchronize()  # keep the host within a few replays of the GPU
    end.record()
    torch.cuda.synchronize()
    return start, time.time(), begin.elapsed_time(end) * 1e-3 / (reps * calls)


def host_seconds(fn: Callable[[], object], calls: int = 200) -> float:
    """Median host seconds a call of ``fn`` takes to return, over 5 rounds of ``calls`` calls not waited for (the
    GPU runs behind: what eager callers pay on the host, whatever the kernel's time)."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return statistics.median(rounds)


class Roofline(NamedTuple):
    copy_bw: float  # bytes/s of a device-to-device copy, read + write counted
    bf16: float  # FLOP/s of an 8192^3 bf16 matmul
    fp8: float | None  # FLOP/s of an 8192^3 e4m3 torch._scaled_mm (bf16 out), None where it does not run


def measure_roofline(device: torch.device) -> Roofline:
    """The card's roofs, measured: a 2 GiB copy, an 8192^3 bf16 matmul and (if it runs) the same in fp8."""
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB
    src = torch.empty(n, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 2 / bench(lambda: dst.copy_(src))  # large: launch cost is noise
    src = dst = None  # free the 4 GiB
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    bf16 = 2 * m**3 / bench(lambda: a @ b)
    fp8 = None
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # mat2 column-major, as cuBLASLt wants
        one = torch.ones((), dtype=torch.float32, device=device)
        fp8 = 2 * m**3 / bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    except Exception as exc:  # no fp8 MMA on this card or torch: the fp8 roof is left out
        print(f"fp8 matmul rate not measured ({type(exc).__name__}: {_first_line(exc)})")
    return Roofline(copy_bw, bf16, fp8)


def describe_roofline(roof: Roofline) -> str:
    fp8 = f", fp8 matmul {roof.fp8 / 1e12:.0f} TFLOP/s" if roof.fp8 else ""
    return (
        f"copy {roof.copy_bw / 1e9:.0f} GB/s, bf16 matmul {roof.bf16 / 1e12:.0f} TFLOP/s{fp8} "
        f"(bf16 ridge {roof.bf16 / roof.copy_bw:.0f} FLOP/byte)"
    )


def environment(roof: Roofline | None = None) -> dict:
    """The GPU, driver, library versions and (given) the measured roofs, for the results file."""
    import triton

    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        env["capability"] = f"sm{major}{minor}"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        env["driver"] = out.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    if roof is not None:
        env["roofline"] = roof._asdict()
    return env


# -- optional providers: the module, or None after one printed note ----------------------------------------------
def _optional(what: str, load: Callable[[], object]):
    try:
        return load()
    except Exception as exc:  # absent, or built for another card / torch: a note, not a failure
        print(f"{what} not available ({type(exc).__name__}: {_first_line(exc)}): its rows are left out")
        return None


@functools.cache
def load_flashmla():
    """FlashMLA's Python interface (``flash_mla``, else vLLM's vendored copy), or None."""
    from mlaspec.conformance.backends.common import import_first

    return _optional(
        "flashmla", lambda: import_first("flash_mla", "vllm.third_party.flashmla.flash_mla_interface", what="flash_mla")
    )


@functools.cache
def load_flashmla_fp8():
    """``torch.ops._flashmla_extension_C`` (FlashMLA's dense fp8 decode as vLLM 0.33 ships it), or None."""
    from mlaspec.conformance.backends.common import import_first

    def load():
        import_first("vllm._flashmla_extension_C", what="vllm._flashmla_extension_C (FlashMLA dense fp8)")
        return torch.ops._flashmla_extension_C

    return _optional("flashmla fp8 (dense)", load)


@functools.cache
def load_deepgemm():
    """:class:`mlaspec.conformance.backends.deepgemm.DeepGEMMBackend` (its bound raw kernels), or None."""

    def load():
        from mlaspec.conformance.backends.deepgemm import DeepGEMMBackend

        return DeepGEMMBackend()

    return _optional("deepgemm", load)


def skip(kernel: str, provider: str, shape: dict, why: str) -> None:
    print(f"  {kernel:<14} {shape_str(shape):<30} {provider:<12} skipped: {why}")


# -- rows -----------------------------------------------------------------------------------------------------
def shape_str(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


@dataclasses.dataclass
class Row:
    """One measurement: ``seconds`` (median) of ``provider`` on ``kernel`` at ``shape``; ``bytes`` and ``flops``
    the kernel's counted traffic and work; ``ratio`` the reference's seconds over these (set by :func:`add_ratios`)."""

    kernel: str
    provider: str
    shape: dict
    seconds: float
    bytes: float
    flops: float
    timer: str = ""  # "graph" (CUDA graph replay), "do_bench" or "sustained" (graph replays under a lasting load)
    ratio: float | None = None

    @property
    def us(self) -> float:
        return self.seconds * 1e6

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.bytes else 0.0  # a row of no traffic may take no time

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12 if self.flops else 0.0

    @property
    def intensity(self) -> float:
        """FLOP per byte (0 where no bytes are counted)."""
        return self.flops / self.bytes if self.bytes else 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {
            "us": self.us,
            "gbps": self.gbps,
            "tflops": self.tflops,
            "reference": REFERENCE.get(self.kernel),
        }


def measure(
    rows: list[Row],
    kernel: str,
    provider: str,
    shape: dict,
    fn: Callable[[], object],
    *,
    nbytes: float,
    flops: float,
    graph: bool = False,
    sustain: float = 0.0,
) -> Row | None:
    """Time ``fn`` (:func:`bench`; ``sustain`` seconds > 0: :func:`sustained`, a lasting load), append its
    :class:`Row` to ``rows`` and print it; a failure is printed and leaves no row (the other providers go on)."""
    try:
        t = sustained(fn, sustain)[2] if sustain else bench(fn, graph=graph)
    except Exception as exc:  # report and go on
        print(f"  {kernel:<14} {shape_str(shape):<30} {provider:<12} failed: {type(exc).__name__}: {_first_line(exc)}")
        return None
    timer = "sustained" if sustain else "graph" if graph else "do_bench"
    row = Row(kernel, provider, dict(shape), t, nbytes, flops, timer)
    rows.append(row)
    print(
        f"  {kernel:<14} {shape_str(shape):<30} {provider:<12} {row.us:10.1f} us {row.gbps:7.0f} GB/s "
        f"{row.tflops:7.1f} TFLOP/s",
        flush=True,
    )
    return row


def add_ratios(rows: Iterable[Row], reference: dict[str, str] = REFERENCE) -> list[Row]:
    """Set each row's ``ratio``: the time of ``reference[kernel]`` at the same kernel and shape over its own (None
    where that provider has no row)."""
    rows = list(rows)
    ref = {(r.kernel, shape_str(r.shape)): r.seconds for r in rows if r.provider == reference.get(r.kernel)}
    for r in rows:
        t = ref.get((r.kernel, shape_str(r.shape)))
        r.ratio = t / r.seconds if t is not None and r.seconds > 0 and r.provider not in FLOORS else None
    return rows


def markdown_table(rows: Iterable[Row], reference: dict[str, str] = REFERENCE) -> str:
    """One line per row: kernel, shape, provider, µs, GB/s, TFLOP/s and the speed against the same run's reference
    (``ref time / time``), then a line naming the references."""
    rows = add_ratios(rows, reference)
    lines = [
        "| kernel | shape | provider | µs | GB/s | TFLOP/s | vs reference |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ratio = "floor" if r.provider in FLOORS else "-" if r.ratio is None else f"{r.ratio:.2f}x {reference[r.kernel]}"
        tf = f"{r.tflops:.1f}" if r.flops else "-"
        cells = (r.kernel, shape_str(r.shape), r.provider, f"{r.us:.1f}", f"{r.gbps:.0f}", tf, ratio)
        lines.append("| " + " | ".join(cells) + " |")
    used = dict.fromkeys(r.kernel for r in rows)
    refs = ", ".join(f"{k}: {reference[k]}" for k in used if k in reference)
    lines.append("")
    lines.append(f"vs reference: the reference's time over this row's, same run (> 1: faster). References: {refs}.")
    if any(r.provider in FLOORS for r in rows):
        lines.append("")
        lines.append("floor: a plain streaming read of the same cache, no attention (`benchmarks/stream.py`).")
    return "\n".join(lines)


def print_table(rows: Iterable[Row], reference: dict[str, str] = REFERENCE) -> str:
    """Print :func:`markdown_table` and return it."""
    text = markdown_table(rows, reference)
    print(text)
    return text


# -- figures --------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


MARKERS = "osD^vP*Xh<>p"
STYLES = ("-", "--", ":", "-.")


def _save(fig, path: str, plt) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def plot_roofline(
    rows: Iterable[Row],
    copy_bw: float,
    mm_rate: float,
    path: str,
    *,
    fp8_rate: float | None = None,
    title: str = "MLA kernels against the measured roofline",
) -> None:
    """Arithmetic intensity (FLOP/byte, log) against achieved TFLOP/s (log): one colour per kernel, one marker per
    provider, the roofs ``min(copy_bw * I, mm_rate)`` (and the fp8 one, dashed) as lines. Rows without FLOPs are
    left out."""
    import numpy as np
    from matplotlib.lines import Line2D

    plt = _pyplot()
    pts = [r for r in rows if r.flops > 0 and r.bytes > 0 and r.seconds > 0]
    kernels = list(dict.fromkeys(r.kernel for r in pts))
    providers = list(dict.fromkeys(r.provider for r in pts))
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    for r in pts:
        ax.scatter(
            r.intensity,
            r.tflops,
            color=cmap(kernels.index(r.kernel) % 10),
            marker=MARKERS[providers.index(r.provider) % len(MARKERS)],
            s=30,
            alpha=0.85,
        )
    ridge = mm_rate / copy_bw
    lo = min([r.intensity for r in pts] + [ridge]) / 2
    hi = max([r.intensity for r in pts] + [ridge, (fp8_rate or 0) / copy_bw]) * 2
    xs = np.geomspace(lo, hi, 200)
    roof = f"roof: copy {copy_bw / 1e9:.0f} GB/s, bf16 {mm_rate / 1e12:.0f} TFLOP/s"
    handles = [Line2D([], [], color="k", label=roof)]
    ax.plot(xs, np.minimum(copy_bw * xs, mm_rate) / 1e12, "k-", lw=1.2)
    if fp8_rate:
        ax.plot(xs, np.minimum(copy_bw * xs, fp8_rate) / 1e12, "k--", lw=1)
        handles.append(Line2D([], [], color="k", ls="--", label=f"fp8 roof {fp8_rate / 1e12:.0f} TFLOP/s"))
    handles += [Line2D([], [], color=cmap(i % 10), marker="o", ls="", label=k) for i, k in enumerate(kernels)]
    handles += [
        Line2D([], [], color="grey", marker=MARKERS[i % len(MARKERS)], ls="", label=p) for i, p in enumerate(providers)
    ]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte counted)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(handles=handles, fontsize=7, loc="lower right")
    _save(fig, path, plt)


def plot_sweep(
    rows: Iterable[Row],
    path: str,
    *,
    x: str,
    metric: str = "gbps",
    panel: str | None = None,
    series: str | None = None,
    ceiling: float | None = None,
    title: str = "",
    ylabel: str = "",
) -> None:
    """``metric`` (a :class:`Row` property) against the shape key ``x`` (log 2): one panel per value of the shape key
    ``panel``, one line style per provider, one colour per value of the shape key ``series``; ``ceiling`` (in the
    metric's units) as a dashed line."""
    plt = _pyplot()
    rows = list(rows)
    panels = sorted({r.shape.get(panel) for r in rows}) if panel else [None]
    providers = list(dict.fromkeys(r.provider for r in rows))
    values = sorted({r.shape.get(series) for r in rows}) if series else [None]
    cmap = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False, sharey=True)
    for ax, pv in zip(axes[0], panels):
        for pi, p in enumerate(providers):
            for vi, v in enumerate(values):
                sel = sorted(
                    (
                        r
                        for r in rows
                        if r.provider == p
                        and (panel is None or r.shape.get(panel) == pv)
                        and (series is None or r.shape.get(series) == v)
                    ),
                    key=lambda r: r.shape[x],
                )
                if sel:
                    ax.plot(
                        [r.shape[x] for r in sel],
                        [getattr(r, metric) for r in sel],
                        STYLES[pi % len(STYLES)],
                        marker=MARKERS[pi % len(MARKERS)],
                        ms=4,
                        color=cmap(vi / max(1, len(values) - 1)),
                        label=p if series is None else f"{p} {series}={v}",
                    )
        if ceiling:
            ax.axhline(ceiling, color="k", lw=1, ls="--", label="measured ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(x)
        ax.set_title(f"{title}, {panel}={pv}" if panel else title)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel or metric)
    axes[0][-1].legend(fontsize=7, ncol=2)
    _save(fig, path, plt)


def plot_bars(rows: Iterable[Row], path: str, *, title: str = "") -> None:
    """Median µs per (kernel, shape) group, one bar per provider (lower is better)."""
    plt = _pyplot()
    rows = list(rows)
    groups = list(dict.fromkeys((r.kernel, shape_str(r.shape)) for r in rows))
    providers = list(dict.fromkeys(r.provider for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(groups)), 4.5))
    w = 0.8 / max(len(providers), 1)
    for i, p in enumerate(providers):
        t = {(r.kernel, shape_str(r.shape)): r.us for r in rows if r.provider == p}
        ax.bar([j + i * w for j, g in enumerate(groups) if g in t], [t[g] for g in groups if g in t], w, label=p)
    ax.set_xticks([j + w * (len(providers) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{k}\n" + s.replace(" ", "\n") for k, s in groups], fontsize=7)
    ax.set_ylabel("time (µs), lower is better")
    ax.set_title(title)
    ax.legend(fontsize=8)
    _save(fig, path, plt)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:200]
