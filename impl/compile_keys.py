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

:func:`settle` hashes every JIT function of the package's modules in one fixed order (by module name, then by
function name) before any is launched; ``mlaspec.impl`` calls it on import, so every process that imports any of the
package's kernels has the same keys, whatever it launches first. It costs the modules' import and the hashing (83
functions; under Triton's interpreter only Gluon's 51, the rest being interpreted functions, which have no key):
~0.22 s on a 2-core host, of which ~0.06 s is hashing and ~0.16 s importing modules a process often imports anyway.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from pathlib import Path

from triton.runtime.jit import JITFunction, KernelInterface

__all__ = ["modules", "settle"]


def modules() -> list[str]:
    """The names of ``mlaspec.impl``'s modules, in the order :func:`settle` hashes them."""
    return sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]))


def _jit_function(obj: object) -> JITFunction | None:
    """``obj`` if it is a JIT function, the one an autotuner or heuristics wrapper holds, else None (an interpreted
    function: no key)."""
    while isinstance(obj, KernelInterface) and not isinstance(obj, JITFunction):
        obj = getattr(obj, "fn", None)
    return obj if isinstance(obj, JITFunction) else None


def settle() -> int:
    """Compute the key of every JIT function defined in the package's :func:`modules` (importing them), module by
    module in that order and by name within one; how many JIT functions they define. A key, once computed, is kept
    by its function, so a second call changes nothing. A key that cannot be computed is left to the launch, as
    without this."""
    found = 0
    for name in modules():
        module = importlib.import_module(f"{__package__}.{name}")
        for attr in sorted(vars(module)):
            fn = _jit_function(getattr(module, attr))
            if fn is None or fn.__module__ != module.__name__:  # not one imported from elsewhere
                continue
            found += 1
            with contextlib.suppress(Exception):  # a speed-up only: the launch computes it (and raises) as before
                fn.cache_key  # noqa: B018 - computed and kept by the function
    return found
