"""Triton's compile-cache keys, fixed in one order when the package is imported.

Triton keys its on-disk cache of compiled kernels by a hash of the kernel's source and of every JIT function it
calls, computed the first time the kernel is launched in a process. In triton 3.6 (torch 2.11's; made independent of
the order upstream in triton-lang/triton#10494, `python/triton/runtime/jit.py`'s ``DependenciesFinder``) that hash
depends on which other kernels sharing those functions were hashed first: on an H200 (2026-11-29),
``decode_sm90.split_kernel_fp8`` had one key in every process that had launched ``split_kernel`` before it and
another in every process that had not, with the same source, signature, constants and options. A kernel compiled
in one process was then compiled again in the next: in a cold ``mlaspec check --backend triton --scale full``, the
judged worker compiled again what the warm-up processes had compiled for it (cases 148-149 and 224-225, 2-3 s
each), since each process had met the kernels in another order.

:func:`settle` hashes every JIT function of the package's kernel modules in one fixed order (:data:`MODULES`, then
by name) before any is launched; ``mlaspec.impl`` calls it on import, so every process that imports any of the
package's kernels has the same keys, whatever it launches first. It costs the modules' import (~0.3 s on a 2-core
host) and ~0.1 s of hashing (83 functions; under Triton's interpreter only Gluon's 51, the rest being interpreted
functions, which have no key).
"""

from __future__ import annotations

import importlib

from triton.runtime.jit import JITFunction

__all__ = ["MODULES", "settle"]

MODULES = (
    "cache",
    "dcp",
    "decode",
    "decode_sm90",
    "indexer",
    "indexer_sm90",
    "merge",
    "prefill",
    "slot_mapping",
    "sparse",
    "sparse_sm90",
    "sparse_sm90_producer",
)
"""The modules of ``mlaspec.impl`` that define Triton or Gluon JIT functions, in the order they are hashed."""


def settle() -> int:
    """Hash every JIT function defined in :data:`MODULES` (importing them), module by module in that order and by
    name within one; how many were hashed. Idempotent: a key, once computed, is kept by
    its function."""
    hashed = 0
    for name in MODULES:
        module = importlib.import_module(f"{__package__}.{name}")
        for attr in sorted(vars(module)):
            fn = getattr(module, attr)
            if isinstance(fn, JITFunction) and fn.__module__ == module.__name__:  # not one imported from elsewhere
                fn.cache_key  # noqa: B018 - computed and kept by the function
                hashed += 1
    return hashed
