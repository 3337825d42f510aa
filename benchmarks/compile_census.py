"""What a cold run compiled: the kernel variants in a Triton cache, and what tells each kernel's variants apart.

A cold full-scale ``mlaspec check --backend triton`` on the H200 waits on its 15 warm-up processes, which compile
(done at 39-49 s of a 56-64 s run; run at a lower CPU priority they only handed compiles to the judged worker:
``docs/speed_log.md``, 2026-11-29 (day)); what would shorten it is compiling less. Triton compiles a kernel once
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

Or without a GPU, ``--launches``: the Triton backend is called on the curated cases (their inputs built as the
harness builds them) as on an H200 (compute capability 9.0, 132 SMs, so the Gluon kernels are chosen where they
would be there), and every kernel launch is specialized for sm_90 as Triton specializes it, recorded, and not run
(what no kernel writes reads as zeros: host code that checks it may still fail, and its case is named).
``--compile`` then compiles each variant ahead of time for sm_90 on this machine's CPU (Triton needs no GPU for
that) and adds its compile seconds and what ``cuobjdump`` says of it: registers a thread, local memory (spills),
shared memory.

    python benchmarks/compile_census.py --launches full --compile --out-dir /tmp/census

Writes ``compile_census.md`` (the table), ``compile_census.json`` (the same, and each compiled variant) and
``compile_census.png`` (variants per kernel) under ``--out-dir``.
Importing this module runs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from unittest import mock

import torch
from common import _pyplot, _save

IR_SUFFIXES = (".source", ".ttir", ".ttgir")  # where a kernel's signature is read, first found first
INTS = ("i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64")  # integer argument types
_OPEN, _CLOSE = "(<{[", ")>}]"


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: its ``name``, its cache entry or launch key (``key``), its arguments as ``(name, type,
    class)`` (class ``"16"``: divisible by 16, ``""``: plain; an argument absent was a constant), its launch options
    and, where a launch says them (a cache does not), the values of its declared constexpr parameters."""

    name: str
    key: str
    args: tuple[tuple[str, str, str], ...]
    num_warps: int
    num_stages: int
    constexprs: str | None = None

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


@dataclass(frozen=True)
class Launch:
    """One specialization of a kernel as a launch asks for it: what Triton compiles for it (``triton.compile``'s
    signature, constexprs, attributes and options)."""

    kernel: object  # the JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: object

    def variant(self, key: str) -> Variant:
        """The :class:`Variant` this launch compiles to (``key``: its launch key)."""
        args = tuple(
            (name, kind, "16" if ["tt.divisibility", 16] in self.attrs.get((i,), []) else "")
            for i, (name, kind) in enumerate(self.signature.items())
            if kind != "constexpr"
        )
        declared = [(p.name, self.constexprs[(i,)]) for i, p in enumerate(self.kernel.params) if p.is_constexpr]
        o = self.options
        return Variant(self.kernel.__name__, key, args, o.num_warps, o.num_stages, repr(declared))


@contextlib.contextmanager
def h200_launches(sms: int = 132, capability: tuple[int, int] = (9, 0)):
    """Inside: the package's kernel launches are specialized for ``sm_{capability}`` as Triton's ``JITFunction.run``
    specializes them (triton 3.9's binder, no driver), recorded in the yielded ``{key: Launch}`` and not run; and the
    package sees a GPU of ``capability`` with ``sms`` SMs, so that it picks the kernels and grids it picks there;
    ``torch.empty`` and ``torch.empty_like`` return zeros (the outputs no kernel writes)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    import mlaspec.impl as impl

    backend = make_backend(GPUTarget("cuda", 10 * capability[0] + capability[1], 32))
    seen: dict[str, Launch] = {}
    binders: dict[int, object] = {}

    def run(self, *args, grid, warmup, **kwargs):  # JITFunction.run up to the compile, then record
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, name):
                kwargs[name] = getattr(knobs.compilation, name)
        if id(self) not in binders:
            binders[id(self)] = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binders[id(self)](*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        what = (self._fn_name, signature, constexprs, attrs, options.__dict__)
        key = hashlib.sha256(repr(what).encode()).hexdigest()[:16]
        seen.setdefault(key, Launch(self, signature, constexprs, attrs, options))

    new, new_like = torch.empty, torch.empty_like

    def zeroed(make):  # what no kernel writes reads as zeros, not as whatever the memory held: the same every run
        return lambda *args, **kwargs: make(*args, **kwargs).zero_()

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(JITFunction, "run", run))
        stack.enter_context(mock.patch.object(torch, "empty", zeroed(new)))
        stack.enter_context(mock.patch.object(torch, "empty_like", zeroed(new_like)))
        for info in pkgutil.iter_modules(impl.__path__):
            module = importlib.import_module(f"{impl.__name__}.{info.name}")
            if hasattr(module, "compiled_capability"):
                stack.enter_context(mock.patch.object(module, "compiled_capability", lambda device: capability))
            if hasattr(module, "_num_sms"):
                stack.enter_context(mock.patch.object(module, "_num_sms", lambda device: sms))
        yield seen


def record(scale: str, dtypes: tuple[str, ...], ops: tuple[str, ...] | None = None):
    """The launches of the Triton backend over the curated cases at ``scale`` in ``dtypes`` (:func:`h200_launches`)
    and the cases whose host code failed on what no kernel wrote (``{case id: error}``)."""
    from mlaspec.conformance.backends.triton import TritonBackend
    from mlaspec.conformance.cases import curated_cases
    from mlaspec.conformance.ops import OPS
    from mlaspec.conformance.worker import error_message

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("--launches: unset TRITON_INTERPRET (interpreted kernels are not specialized)")
    backend = TritonBackend(device="cpu")
    failed = {}
    with mock.patch.object(TritonBackend, "unavailable", None), h200_launches() as seen:
        for case in curated_cases(scale=scale, dtypes=dtypes, ops=ops):
            if case.op not in backend.ops or backend.unsupported(case):
                continue
            try:
                getattr(backend, case.op)(**OPS[case.op].make_inputs(case))
            except Exception as exc:  # host code that checks an output no kernel wrote
                failed[case.id] = error_message(exc)
    return seen, failed


@dataclass
class Compiled:
    """What compiling one variant for sm_90 on this machine took and gave (``cuobjdump --dump-resource-usage``):
    registers a thread, local memory (bytes a thread: spills), shared memory (static + Triton's dynamic, bytes)."""

    seconds: float
    registers: int
    local: int
    shared: int


def compile_launch(launch: Launch) -> Compiled:
    """Compile ``launch`` ahead of time for sm_90 (a fresh ``TRITON_CACHE_DIR`` makes it cold) and read its
    resources from the cubin with the ``cuobjdump`` that Triton ships."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    source = (GluonASTSource if launch.kernel.is_gluon() else ASTSource)(
        launch.kernel, launch.signature, launch.constexprs, launch.attrs
    )
    start = time.perf_counter()
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch.options.__dict__)
    seconds = time.perf_counter() - start
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    field = {k: int(v) for k, v in re.findall(r"(REG|LOCAL|SHARED):(\d+)", usage)}
    return Compiled(
        seconds, field.get("REG", 0), field.get("LOCAL", 0), field.get("SHARED", 0) + kernel.metadata.shared
    )


@dataclass
class Kernel:
    """One kernel's variants: how many, the launch options among them, the arguments whose class differs
    (``{arg: sorted labels}``, a label ``"16"`` divisible, ``"-"`` plain, ``"const"`` absent: a constant), how many
    combinations of argument types (dtypes) they have, how many repeat another's signature and options (so differ in
    constexpr values), and how many would be left if no integer argument were specialized (``None`` where the
    variants do not say their constexprs: read from a cache)."""

    name: str
    variants: int
    options: list[str]
    differing: dict[str, list[str]]
    dtypes: int
    constexpr_only: int
    without_int_classes: int | None = None


def census(variants: list[Variant]) -> list[Kernel]:
    """:class:`Kernel` rows, the kernels with the most variants first."""
    by_name: dict[str, list[Variant]] = defaultdict(list)
    for v in variants:
        by_name[v.name].append(v)
    rows = []
    for name, vs in by_name.items():
        names = list(dict.fromkeys(a[0] for v in vs for a in v.args))
        labels: dict[str, set[str]] = {n: set() for n in names}
        for v in vs:
            given = {a[0]: a for a in v.args}
            for n in names:
                if n in given:
                    labels[n].add(given[n][2] or "-")
                else:
                    labels[n].add("const")
        differing = {n: sorted(labels[n]) for n in names if len(labels[n]) > 1}
        dtypes = len({tuple(a[:2] for a in v.args if a[1] not in INTS) for v in vs})
        shapes = Counter((v.args, v.options) for v in vs)
        plain = None  # the variants left if no integer were specialized (do_not_specialize): launches only
        if all(v.constexprs is not None for v in vs):
            plain = len({(tuple(a for a in v.args if a[1] not in INTS), v.options, v.constexprs) for v in vs})
        options = sorted({v.options for v in vs})
        rows.append(Kernel(name, len(vs), options, differing, dtypes, len(vs) - len(shapes), plain))
    return sorted(rows, key=lambda k: (-k.variants, k.name))


def markdown(rows: list[Kernel], source: str, compiled: dict[str, list[Compiled]] | None = None) -> str:
    """The census as a page: ``source`` says where the variants came from; ``compiled`` (kernel name -> its variants'
    :class:`Compiled`) adds each kernel's compile seconds and its largest registers, spills and shared memory."""
    plain = all(k.without_int_classes is not None for k in rows)
    legend = (
        f"{source}: {sum(k.variants for k in rows)} variants of {len(rows)} kernels. *Differing*: the arguments "
        "whose class is not the same in every variant (`16`: divisible by 16, `-`: plain, `const`: a constant, 1); "
        "*warps/stages*: the launch's `num_warps` and `num_stages` (read from a cache, the compiled kernel's, whose "
        "warps count a warp-specialized Gluon kernel's worker partitions too: `split_kernel_lead` 4 launched, 8 "
        "compiled); "
        "*types*: the combinations of argument types (dtypes); *constexpr only*: variants with another's signature "
        "and launch options"
    )
    if plain:
        legend += "; *without int classes*: the variants left if no integer argument were specialized"
    lines = ["# Kernel variants", "", legend + ".", ""]
    extra = (" without int classes |" if plain else "") + (
        " compile s | registers | local B | shared KB |" if compiled else ""
    )
    lines += [f"| kernel | variants | warps/stages | types | differing arguments | constexpr only |{extra}"]
    lines += ["|---|---:|---|---:|---|---:|" + "---:|" * (plain + 4 * bool(compiled))]
    for k in rows:
        differing = "; ".join(f"`{n}` {'/'.join(v)}" for n, v in k.differing.items()) or "none"
        row = f"| `{k.name}` | {k.variants} | {', '.join(k.options)} | {k.dtypes} | {differing} | {k.constexpr_only} |"
        if plain:
            row += f" {k.without_int_classes} |"
        if compiled and k.name not in compiled:
            row += " | | | |"
        elif compiled:
            c = compiled[k.name]
            row += f" {sum(x.seconds for x in c):.1f} | {max(x.registers for x in c)} | {max(x.local for x in c)} |"
            row += f" {max(x.shared for x in c) / 1024:.0f} |"
        lines.append(row)
    if compiled:
        total = sum(x.seconds for c in compiled.values() for x in c)
        lines += ["", f"Compiled for sm_90 on this machine's CPU, one at a time: {total:.0f} s in all."]
    return "\n".join(lines) + "\n"


def plot(rows: list[Kernel], path: str, compiled: dict[str, list[Compiled]] | None = None) -> None:
    """Each kernel's variants (or, with ``compiled``, their compile seconds), split into those that integer
    specialization alone adds (where the launches say) and the rest."""
    plt = _pyplot()
    shown = rows[:30]
    fig, ax = plt.subplots(figsize=(7, 0.28 * len(shown) + 1.2))
    y = list(range(len(shown)))
    total = [sum(c.seconds for c in compiled.get(k.name, ())) if compiled else k.variants for k in shown]
    share = [(k.variants - (k.without_int_classes or k.variants)) / k.variants for k in shown]
    added = [t * f for t, f in zip(total, share)]
    ax.barh(y, [t - a for t, a in zip(total, added)], label="the variants left without integer specialization")
    ax.barh(y, added, left=[t - a for t, a in zip(total, added)], label="added by integer arguments' classes")
    ax.set_yticks(y)
    ax.set_yticklabels([k.name for k in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("compile seconds (each kernel's variants, one at a time)" if compiled else "compiled variants")
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path, plt)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache"))
    ap.add_argument("--launches", choices=["tiny", "full"], help="record the curated cases' launches instead")
    ap.add_argument("--dtypes", default="bfloat16,float16", help="with --launches")
    ap.add_argument("--ops", help="with --launches: comma-separated ops (default: all)")
    ap.add_argument(
        "--compile",
        nargs="?",
        const="",
        help="with --launches: compile each variant for sm_90 here (of these kernels only: comma-separated names)",
    )
    ap.add_argument("--out-dir", default="bench")
    args = ap.parse_args(argv)
    if args.compile is not None and not args.launches:
        ap.error("--compile compiles recorded launches: give --launches too")
    compiled = None
    if args.launches:
        ops = tuple(args.ops.split(",")) if args.ops else None
        seen, failed = record(args.launches, tuple(args.dtypes.split(",")), ops)
        variants = [launch.variant(key) for key, launch in seen.items()]
        source = f"The Triton backend's launches over the curated cases (`--scale {args.launches}`, {args.dtypes})"
        source += " as on an H200"
        if failed:
            source += f" ({len(failed)} cases' host code failed on what no kernel wrote: {', '.join(sorted(failed))})"
        if args.compile is not None:
            only = set(filter(None, args.compile.split(",")))
            compiled = defaultdict(list)
            with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, TRITON_CACHE_DIR=cache):
                for launch in seen.values():
                    if not only or launch.kernel.__name__ in only:
                        compiled[launch.kernel.__name__].append(compile_launch(launch))
    else:
        variants, source = read_cache(args.cache), f"The Triton cache `{args.cache}`"
    import triton

    command = " ".join(["python", *sys.argv]) if argv is None else f"main({argv})"
    source = f"`{command}` (triton {triton.__version__}, {os.cpu_count()} CPUs). {source}"
    rows = census(variants)
    os.makedirs(args.out_dir, exist_ok=True)
    text = markdown(rows, source, compiled)
    with open(os.path.join(args.out_dir, "compile_census.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out_dir, "compile_census.json"), "w") as f:
        json.dump(
            {
                "source": source,
                "kernels": [asdict(k) for k in rows],
                "compiled": compiled and {name: [asdict(c) for c in cs] for name, cs in compiled.items()},
            },
            f,
            indent=1,
        )
    if rows:
        plot(rows, os.path.join(args.out_dir, "compile_census.png"), compiled)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
