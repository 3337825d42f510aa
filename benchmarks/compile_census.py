"""What a cold run compiled: the kernel variants in a Triton cache, and what tells each kernel's variants apart.

A cold full-scale ``mlaspec check --backend triton`` on the H200 is bounded by its compiling: its 15 warm-up
processes, which compile, finish at 39-49 s of a 56-64 s run and spend most of its 680 CPU seconds
(``docs/speed_log.md``, 2026-11-29 (day)); what would shorten it is compiling less. Triton compiles a kernel once
per *specialization*: the constexpr values, the launch options (warps, stages), each pointer's dtype, and each
integer argument's class, ``tt.divisibility = 16`` when it is a multiple of 16, a constant when it is 1, plain
otherwise (pointers too are marked divisible when 16-byte aligned). An integer that only bounds a loop or a mask
can then cost a kernel two or three compiles over the curated cases' deliberately odd shapes. This script reads
each cached kernel's signature from its IR (the first ``tt.func public @name(...)`` of ``<name>.source``, else
``.ttir``, else ``.ttgir``) and its launch options from ``<name>.json``, and prints, per kernel, the variants and the
arguments whose class differs among them; variants whose signature and options are all the same differ in
constexpr values. It reads files only: no GPU, no compiler.

    TRITON_CACHE_DIR=/tmp/tc mlaspec check --backend triton --scale full --no-cache   # a cold run, on a GPU
    python benchmarks/compile_census.py --cache /tmp/tc --out-dir /tmp/census

Writes ``compile_census.md`` (the table) and ``compile_census.png`` (variants per kernel) under ``--out-dir``.
Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

from common import _pyplot, _save

IR_SUFFIXES = (".source", ".ttir", ".ttgir")  # where a kernel's signature is read, first found first
_OPEN, _CLOSE = "(<{[", ")>}]"


@dataclass(frozen=True)
class Variant:
    """One compiled kernel in the cache: its ``name``, its cache entry (``key``: the folder), its arguments as
    ``(name, type, class)`` (class ``"16"``: divisible by 16, ``""``: plain; an argument absent was a constant) and
    its launch options."""

    name: str
    key: str
    args: tuple[tuple[str, str, str], ...]
    num_warps: int
    num_stages: int

    @property
    def options(self) -> str:
        return f"{self.num_warps}w/{self.num_stages}s"


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` outside brackets of any kind."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def signature(ir: str) -> tuple[str, tuple[tuple[str, str, str], ...]] | None:
    """The first public function's name and arguments ``(name, type, class)`` in MLIR text ``ir``; None if none."""
    m = re.search(r"tt\.func public @([\w$.]+)\(", ir)
    if m is None:
        return None
    depth, end = 1, m.end()
    while depth and end < len(ir):
        depth += {"(": 1, ")": -1}.get(ir[end], 0)
        end += 1
    args = []
    for part in _split_top(ir[m.end() : end - 1], ","):
        name, _, rest = part.partition(":")
        fields = _split_top(rest, " ")
        kind = fields[0] if fields else ""
        attrs = next((f for f in fields[1:] if f.startswith("{")), "")
        div = re.search(r"tt\.divisibility = (\d+)", attrs)
        args.append((name.strip().lstrip("%"), kind, div.group(1) if div else ""))
    return m.group(1), tuple(args)


def read_cache(folder: str) -> list[Variant]:
    """Every compiled kernel under the Triton cache ``folder`` (one per entry that holds a ``<name>.json`` and its IR;
    the launcher and utility libraries the cache also keeps are not kernels and are skipped)."""
    variants = []
    for key in sorted(os.listdir(folder)):
        entry = os.path.join(folder, key)
        if not os.path.isdir(entry):
            continue
        for meta_file in sorted(f for f in os.listdir(entry) if f.endswith(".json") and not f.startswith("__grp__")):
            base = meta_file[: -len(".json")]
            try:
                with open(os.path.join(entry, meta_file)) as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                continue
            found = [os.path.join(entry, base + s) for s in IR_SUFFIXES]
            ir = next((path for path in found if os.path.exists(path)), None)
            if not isinstance(meta, dict) or "name" not in meta or ir is None:
                continue
            with open(ir, errors="replace") as f:
                sig = signature(f.read())
            if sig is None:
                continue
            variants.append(Variant(sig[0], key, sig[1], int(meta.get("num_warps", 0)), int(meta.get("num_stages", 0))))
    return variants


@dataclass
class Kernel:
    """One kernel's variants: how many, the launch options among them, the arguments whose class or type differs
    (``{arg: sorted labels}``, a label ``"16"`` divisible, ``"-"`` plain, ``"const"`` absent: a constant, or a
    type), and how many variants repeat another's signature and options (so differ in constexpr values)."""

    name: str
    variants: int
    options: list[str]
    differing: dict[str, list[str]]
    constexpr_only: int


def census(variants: list[Variant]) -> list[Kernel]:
    """:class:`Kernel` rows, the kernels with the most variants first."""
    by_name: dict[str, list[Variant]] = defaultdict(list)
    for v in variants:
        by_name[v.name].append(v)
    rows = []
    for name, vs in by_name.items():
        names = list(dict.fromkeys(a[0] for v in vs for a in v.args))
        labels: dict[str, set[str]] = {n: set() for n in names}
        types: dict[str, set[str]] = {n: set() for n in names}
        for v in vs:
            given = {a[0]: a for a in v.args}
            for n in names:
                if n in given:
                    labels[n].add(given[n][2] or "-")
                    types[n].add(given[n][1])
                else:
                    labels[n].add("const")
        differing = {n: sorted(labels[n]) for n in names if len(labels[n]) > 1}
        differing.update({n: sorted(types[n]) for n in names if len(types[n]) > 1})
        shapes = Counter((v.args, v.options) for v in vs)
        rows.append(Kernel(name, len(vs), sorted({v.options for v in vs}), differing, len(vs) - len(shapes)))
    return sorted(rows, key=lambda k: (-k.variants, k.name))


def markdown(rows: list[Kernel], folder: str) -> str:
    lines = [
        "# Kernel variants in a Triton cache",
        "",
        f"`{folder}`: {sum(k.variants for k in rows)} compiled variants of {len(rows)} kernels. *Differing*: the "
        "arguments whose class or type is not the same in every variant (`16`: divisible by 16, `-`: plain, "
        "`const`: a constant, 1); *constexpr only*: variants with another's signature and launch options.",
        "",
        "| kernel | variants | warps/stages | differing arguments | constexpr only |",
        "|---|---:|---|---|---:|",
    ]
    for k in rows:
        differing = "; ".join(f"`{n}` {'/'.join(v)}" for n, v in k.differing.items()) or "none"
        lines.append(f"| `{k.name}` | {k.variants} | {', '.join(k.options)} | {differing} | {k.constexpr_only} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Kernel], path: str) -> None:
    plt = _pyplot()
    shown = rows[:30]
    fig, ax = plt.subplots(figsize=(7, 0.28 * len(shown) + 1.2))
    y = range(len(shown))
    ax.barh(list(y), [k.variants - k.constexpr_only for k in shown], label="another signature or options")
    ax.barh(
        list(y),
        [k.constexpr_only for k in shown],
        left=[k.variants - k.constexpr_only for k in shown],
        label="constexpr values only",
    )
    ax.set_yticks(list(y))
    ax.set_yticklabels([k.name for k in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("compiled variants")
    ax.legend(fontsize=8)
    _save(fig, path, plt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache"))
    ap.add_argument("--out-dir", default="bench")
    args = ap.parse_args(argv)
    rows = census(read_cache(args.cache))
    os.makedirs(args.out_dir, exist_ok=True)
    text = markdown(rows, args.cache)
    with open(os.path.join(args.out_dir, "compile_census.md"), "w") as f:
        f.write(text)
    if rows:
        plot(rows, os.path.join(args.out_dir, "compile_census.png"))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
