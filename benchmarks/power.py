"""Time, SM clock, board power and energy of a decode run back to back: where the card's power limit, not its
copies or its tensor cores, sets the pace.

Each variant -- FlashMLA, the decode as called, and at two or more 64-row blocks (128 heads) ``split_kernel_lead``
with parts switched off (:data:`decode_ablation.LEAD_ABLATIONS`) -- is replayed from a CUDA graph of 20 decodes for
``--seconds`` while ``nvidia-smi`` samples the SM clock, the board power and the clock-event reasons every 50 ms
(the first second is left out: the clock settles). A decode's energy is its time times the median power. Where
the reasons say ``power cap``, the card has lowered its clock to stay under its power limit, and the time is the
energy over that limit (the figure: such points lie on the line ``E = limit x t``). ``--burst`` also times the
first milliseconds after 2 s idle, window by window: short benchmarks (``common.bench``: ~50 ms of replays) see
part of the clock the power limit later takes away.

    python benchmarks/power.py                                   # the issue-18 shapes; writes power.png
    python benchmarks/power.py --shapes 128x2x131072 --seconds 2 --burst --out /tmp/power.png

Importing this module runs nothing and needs no GPU.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from typing import NamedTuple

# nvidia-smi's clocks_event_reasons bits (NVML's nvmlClocksEventReason*)
REASONS = {
    0x1: "idle",
    0x2: "application clocks",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
}
FIELDS = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"
WINDOWS_MS = (0, 10, 50, 200, 2000)  # --burst: the windows after an idle pause
DEFAULT_SHAPES = "128x1x65536,128x1x131072,128x2x65536,128x2x131072,128x64x8192,16x1x131072,16x2x131072"


class Sample(NamedTuple):
    t: float  # seconds since the epoch
    mhz: float  # SM clock
    watts: float  # board power
    mask: int  # clock-event reasons


def reasons(mask: int) -> str:
    """The clock-event reasons in ``mask``, by name (``"none"``: the clock is what the card would give)."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    return ", ".join(names) or "none"


def parse(lines) -> list[Sample]:
    """``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits`` lines as samples (unreadable lines skipped)."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            stamp, frac = parts[0].split(".") if "." in parts[0] else (parts[0], "0")
            t = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
            out.append(Sample(t, float(parts[1]), float(parts[2]), int(parts[3], 16)))
        except ValueError:
            continue
    return out


def summarize(samples: list[Sample], start: float, stop: float) -> dict | None:
    """Median and lowest SM clock, median power and the union of reasons over the samples in ``[start, stop]``."""
    inside = [s for s in samples if start <= s.t <= stop]
    if not inside:
        return None
    mask = 0
    for s in inside:
        mask |= s.mask
    return dict(
        mhz=statistics.median(s.mhz for s in inside),
        mhz_min=min(s.mhz for s in inside),
        watts=statistics.median(s.watts for s in inside),
        reasons=reasons(mask),
    )


def burst(fn, per_call: float, calls: int = 10) -> list[float]:
    """Seconds a call in each window of :data:`WINDOWS_MS` after 2 s idle (replays of ``calls`` calls, timed on
    the GPU, queued ahead so none waits for the host; ``per_call``: about how long a call takes, for how many)."""
    import torch
    from common import graphed

    graph = graphed(fn, calls)
    time.sleep(2.0)
    replays = max(8, min(4000, int(WINDOWS_MS[-1] * 1.2e-3 / (per_call * calls))))
    events = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
    events[0].record()
    for e in events[1:]:
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    ends = [events[0].elapsed_time(e) for e in events[1:]]  # ms since the first replay began
    out = []
    for lo, hi in zip(WINDOWS_MS, WINDOWS_MS[1:], strict=False):
        idx = [i for i, t in enumerate(ends) if lo < t <= hi]
        if len(idx) < 2:
            out.append(float("nan"))
            continue
        out.append((ends[idx[-1]] - ends[idx[0]]) * 1e-3 / ((idx[-1] - idx[0]) * calls))
    return out


def variants() -> dict:
    """Name -> the parts of ``split_kernel_lead`` switched off (``None``: FlashMLA)."""
    from decode_ablation import LEAD_COMPUTE as LC

    return {
        "flashmla": None,
        "as landed": (),
        "compute alone": ("copies",),
        "copies alone": LC,
        "copies from L2": ("L2 copies",),
        "copies from L2 alone": (*LC, "L2 copies"),
        "one copy a tile": ("second copies",),
        "one copy a tile, alone": (*LC, "second copies"),
    }


def run(shapes, seconds: float = 4.0, with_burst: bool = False) -> tuple[list[dict], float]:
    """One dict a (shape, variant): time, clock, power, energy, reasons (and ``burst``); and the power limit."""
    import torch
    from common import load_flashmla, sustained
    from decode import D_QK, _fn, make_problem
    from decode_ablation import _in_place, load

    import mlaspec.impl.decode as dec

    smi = ["nvidia-smi", "--format=csv,noheader,nounits"]
    limits = subprocess.run([*smi, "--query-gpu=power.limit"], capture_output=True, text=True, check=True).stdout
    limit = float(limits.split()[0])  # (a line a GPU: the first's)
    landed, fm, rows, named = dec.decode_sm90, load_flashmla(), [], variants()
    with tempfile.TemporaryDirectory() as folder, open(f"{folder}/smi.csv", "w+") as log:
        modules = {n: _in_place(load(parts, folder, "lead"), landed, "lead") for n, parts in named.items() if parts}
        sampler = subprocess.Popen([*smi, f"--query-gpu={FIELDS}", "-lms", "50"], stdout=log, text=True)
        try:
            for heads, batch, keys in shapes:
                cache, bt, sl = make_problem(batch, keys, torch.device("cuda"))
                q = torch.randn(batch, 1, heads, D_QK, device="cuda", dtype=torch.bfloat16)
                problem = (q, cache, bt, sl, keys, 192**-0.5, None)
                lead = landed.lead_applies(heads // 64)  # the ablations are split_kernel_lead's
                for name in named:
                    if (name == "flashmla" and fm is None) or (name in modules and not lead):
                        continue
                    fn = _fn("flashmla" if name == "flashmla" else "triton", fm, *problem)
                    dec.decode_sm90 = modules.get(name, landed)
                    try:
                        start, stop, per_call = sustained(fn, seconds - 1.0)
                        windows = burst(fn, per_call) if with_burst and name in ("flashmla", "as landed") else None
                    finally:
                        dec.decode_sm90 = landed
                    shape = f"H{heads} B{batch} {keys // 1024}K"
                    rows.append(dict(shape=shape, variant=name, seconds=per_call, span=(start, stop), burst=windows))
                del cache
                torch.cuda.empty_cache()
        finally:
            sampler.terminate()
            sampler.wait()
        log.seek(0)
        samples = parse(log.read().splitlines())
    for row in rows:
        row.update(summarize(samples, *row.pop("span")) or dict(mhz=0, mhz_min=0, watts=0, reasons="-"))
        row["mj"] = row["seconds"] * row["watts"] * 1e3
    return rows, limit


def table(rows: list[dict], limit: float) -> str:
    """The rows as markdown: time, clock, power, energy a decode, reasons, and (``--burst``) the windows."""
    head = "| shape | variant | µs | SM MHz (median / lowest) | W | mJ a decode | energy / limit (µs) | clock held by |"
    lines = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        floor = r["mj"] * 1e-3 / limit * 1e6
        lines.append(
            f"| {r['shape']} | {r['variant']} | {r['seconds'] * 1e6:.1f} | {r['mhz']:.0f} / {r['mhz_min']:.0f} |"
            f" {r['watts']:.0f} | {r['mj']:.1f} | {floor:.1f} | {r['reasons']} |"
        )
    bursts = [r for r in rows if r.get("burst")]
    if bursts:
        spans = [f"{lo}-{hi} ms" for lo, hi in zip(WINDOWS_MS, WINDOWS_MS[1:], strict=False)]
        lines += ["", "| shape | variant | " + " | ".join(spans) + " |", "| --- | --- |" + " ---: |" * len(spans)]
        for r in bursts:
            times = " | ".join(f"{t * 1e6:.1f}" for t in r["burst"])
            lines.append(f"| {r['shape']} | {r['variant']} | {times} |")
    return "\n".join(lines)


def plot(rows: list[dict], limit: float, path: str) -> None:
    """Energy a decode against its time, a marker a variant; the line ``E = limit x t``: on it, the power limit
    sets the time."""
    from common import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    markers = "os^vD<>Px*"
    for i, name in enumerate(names):
        pts = [r for r in rows if r["variant"] == name]
        ax.scatter([r["seconds"] * 1e6 for r in pts], [r["mj"] for r in pts], marker=markers[i % len(markers)],
                   label=name)  # fmt: skip
    top = max(r["seconds"] for r in rows) * 1e6 * 1.05
    ax.plot([0, top], [0, limit * top * 1e-3], "k--", lw=1, label=f"{limit:.0f} W (the power limit)")
    ax.set_xlabel("µs a decode (replayed back to back)")
    ax.set_ylabel("mJ a decode")
    ax.set_xlim(0, top)
    ax.set_ylim(0)
    ax.legend(fontsize=7)
    ax.set_title("on the dashed line the card's power limit sets the time", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from common import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="HxBxS_kv, comma-separated")
    parser.add_argument("--seconds", type=float, default=4.0, help="replayed back to back this long a variant (> 1)")
    parser.add_argument("--burst", action="store_true", help="also time the first milliseconds after idle")
    parser.add_argument("--out", default="power.png", help="the figure (.png)")
    args = parser.parse_args(argv)
    if args.seconds <= 1.0:
        parser.error("--seconds: more than 1 (the first second is left out)")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows, limit = run(shapes, args.seconds, args.burst)
    env = ", ".join(f"{k} {v}" for k, v in environment().items())
    print(f"power limit {limit:.0f} W; {env}")
    print(table(rows, limit))
    plot(rows, limit, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
