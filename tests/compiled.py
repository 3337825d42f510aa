"""What the Triton compiler makes of a kernel for a GPU that is not here (Hopper, ``sm_90``): its TTGIR and PTX.

The tests check the *structure* of a compiled kernel on machines with no GPU (CI): how far ahead its software
pipeline loads a tile, whether an instruction is emitted. ``triton.compile`` needs no device for that, only the
real ``triton.language`` -- the interpreter (``TRITON_INTERPRET=1``, set for the other tests) replaces it -- so the
tests run this file in a process of its own::

    python tests/compiled.py '{"kernel": "mlaspec.impl.decode:_mla_decode_split_kernel", ...}'   # prints JSON

Pointer arguments and ``stride_*`` integers are compiled as 16-divisible, as Triton specialises them at launch for
the aligned tensors the kernels get (without that hint the loads are not vectorised and nothing is pipelined).
"""

from __future__ import annotations

import importlib
import json
import re
import sys


def compile_for(
    kernel, pointers: dict, constexprs: dict, *, num_warps: int, num_stages: int, capability: int = 90, **options
):
    """Compile ``kernel`` for ``cuda:capability``; every argument not in ``pointers`` (name -> ``"*bf16"`` etc., or
    a Gluon tensor descriptor's type, :func:`descriptor`) or ``constexprs`` is an ``fp32`` if its name ends in
    ``scale``, else an ``i32``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if getattr(kernel, "is_gluon", lambda: False)():  # a Gluon kernel builds its IR through its own source class
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    names = list(kernel.arg_names)
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    constexprs = {**defaults, **constexprs}  # a constexpr left out takes its default, as a launch does
    sig = {
        n: pointers.get(n) or ("constexpr" if n in constexprs else "fp32" if n.endswith("scale") else "i32")
        for n in names
    }
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n][0] == "*" or n[:6] == "stride"}
    source = ASTSource(kernel, sig, constexprs={(names.index(n),): v for n, v in constexprs.items()}, attrs=aligned)
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(source, target=target, options=dict(num_warps=num_warps, num_stages=num_stages, **options))


def descriptor(block: list[int], dtype: str = "bf16") -> str:
    """The argument type of a Gluon TMA descriptor of ``block`` with the default swizzle (``dtype``: ``"bf16"``,
    ``"fp16"``, ``"fp32"`` or ``"fp8e4nv"``)."""
    from triton.experimental.gluon import language as gl

    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8e4nv": "float8e4nv"}
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, names[dtype]))
    return f"tensordesc<{dtype}[{','.join(map(str, block))}],{layout!r}>"


def prefetched(ttgir: str, tile: str) -> int:
    """How many ``tile``-shaped loads (e.g. ``"64x512xbf16"``) the software pipeline issues before its loop
    starts: the tiles in flight when the first one is used (1: the next tile is loaded only after this one's use)."""
    prologue = ttgir.split("scf.for", 1)[0]
    return len(re.findall(r"async_copy_global_to_local .* -> <" + re.escape(tile) + r",", prologue))


ASYNC_COPY = re.compile(r"async_(tma_)?copy_global_to_local")  # a cp.async or a tensor-memory copy, in TTGIR


def copies_before_dots(ttgir: str) -> bool:
    """Whether the main loop issues an async copy (the next tile's) before its first warpgroup MMA, so the copy
    runs during this iteration's dots."""
    body = ttgir.split("scf.for", 1)[1]
    copy = ASYNC_COPY.search(body)
    dot = body.find("warp_group_dot ")
    return copy is not None and 0 <= copy.start() < dot


def copy_before_loads(ttgir: str) -> bool:
    """Whether the kernel issues an async copy before its first load into registers (``tt.load``), so the copy's
    latency overlaps the loads'."""
    copy = ASYNC_COPY.search(ttgir)
    load = ttgir.find("tt.load ")
    return copy is not None and (load < 0 or copy.start() < load)


def _argument(t):
    """A pointer's type as given, or a descriptor's: from its block (``[64, 256]``: bf16) or ``{"block": [64, 256],
    "dtype": "fp32"}``."""
    if isinstance(t, list):
        return descriptor(t)
    return descriptor(t["block"], t["dtype"]) if isinstance(t, dict) else t


def main(spec: dict) -> dict:
    sys.path[:0] = spec.get("path", [])  # e.g. benchmarks/, for a script's kernel
    module, name = spec["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), name)
    compiled = compile_for(
        kernel,
        {n: _argument(t) for n, t in spec["pointers"].items()},
        spec["constexprs"],
        num_warps=spec["num_warps"],
        num_stages=spec["num_stages"],
        capability=spec.get("capability", 90),
        **spec.get("options", {}),  # e.g. maxnreg
    )
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    return {
        "shared": compiled.metadata.shared,
        "prefetched": {tile: prefetched(ttgir, tile) for tile in spec.get("tiles", [])},
        "copies_before_dots": copies_before_dots(ttgir),
        "copy_before_loads": copy_before_loads(ttgir),
        "ptx_has": {word: word in ptx for word in spec.get("ptx_words", [])},
        "ptx_at": {word: ptx.find(word) for word in spec.get("ptx_words", [])},  # its first place, or -1
        "ttgir_has": {word: word in ttgir for word in spec.get("ttgir_words", [])},
    }


def cannot_compile_here(exc: BaseException) -> str | None:
    """Why this machine cannot compile for the GPU at all (no NVIDIA backend in this Triton, no ``ptxas``), or None:
    then ``exc`` is a real failure of the kernel or of this file."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ImportError) and "nvidia" in text:
        return text
    if "ptxas" in text and any(w in text for w in ("not found", "No such file", "could not find", "Could not find")):
        return text
    return None


if __name__ == "__main__":
    try:
        print(json.dumps(main(json.loads(sys.argv[1]))))
    except Exception as exc:
        if (why := cannot_compile_here(exc)) is None:
            raise
        print(json.dumps({"cannot_compile_here": why.splitlines()[0]}))
