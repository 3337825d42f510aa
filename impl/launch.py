"""Launching a compiled Triton kernel again without Triton's per-call argument binding.

``kernel[grid](*args)`` binds and specializes every argument in Python before it launches: ~20 us a call on the
H200's host (triton 3.6), where the launch itself takes ~7 us and DeepGEMM's whole ``fp8_mqa_logits`` binding ~22 us.
A kernel of 15 us called eagerly (the indexer at S = 1K: vLLM runs it outside CUDA graphs, in prefill) is then timed
on the host. :class:`Launcher` keeps the compiled kernel that Triton's own launch returned under a key of what Triton
specializes an argument on, and launches it directly the next time that key comes.

What Triton (3.x, NVIDIA) specializes an argument on, and so the key: a tensor's dtype and whether its address is a
multiple of 16 bytes; an integer's being 1, a multiple of 16, and its type (32 bits, 64, or unsigned beyond); a
float by its type; ``None``, a bool or a constexpr by its value (by name); the launch options by name; the debug and
instrumentation knobs. An argument of any other type (a tuple, a tensor descriptor) takes Triton's launch.
``tests/test_impl_launch.py`` checks on a GPU that the key gives the very kernel object Triton's launch returns for
the same arguments, over lengths of 1, 16, 17 and misaligned views. Where the launch is observed (Triton's launch
hooks set, as a profiler does) or Triton's compiled kernel lacks what the direct call needs (another Triton), every
call goes through ``kernel[grid]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from triton import knobs

__all__ = ["Launcher"]

_INT32 = 2**31


def _spec(x) -> object:
    """What Triton specializes the argument ``x`` on (see the module docstring); ``None`` for a type it is not written
    for (a tuple, a tensor descriptor: those calls take Triton's launch)."""
    if isinstance(x, torch.Tensor):
        return x.dtype, not x.data_ptr() & 15
    if type(x) is int:  # i32, i64 or u64, as Triton types it
        return x == 1, not x & 15, (-_INT32 <= x < _INT32) + 2 * (x >= 2**63)
    if isinstance(x, float):
        return float
    if isinstance(x, bool) or x is None:
        return type(x), x
    return None


class Launcher:
    """``Launcher(kernel)(grid, args, constexprs, **options)`` is ``kernel[grid](*args, **constexprs, **options)``;
    from the second call with the same key on (the device, ``constexprs``, ``options`` and what Triton specializes
    ``args`` on) it launches the kernel Triton compiled directly, on the current stream.

    ``args``: the kernel's leading, non-constexpr parameters, in order; ``constexprs``: the rest, by name."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict = {}
        # False under the interpreter, or once a direct launch failed (this Triton's compiled kernels differ)
        self.direct = type(kernel).__name__ != "InterpretedFunction"

    def __call__(self, grid: Sequence[int], args: Sequence, constexprs: dict, **options):
        def through_triton():
            return self.kernel[tuple(grid)](*args, **constexprs, **options)

        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)  # a hook, or a chain of them
        specs = tuple(map(_spec, args))
        if not self.direct or any(getattr(hook, "calls", hook) for hook in hooks) or None in specs:
            return through_triton()
        device = torch.cuda.current_device()
        knob = (knobs.runtime.debug, getattr(knobs.compilation, "instrumentation_mode", None))  # in Triton's key too
        key = (device, knob, tuple(constexprs.items()), tuple(options.items()), specs)
        try:
            compiled = self._compiled.get(key)
        except TypeError:  # a constexpr or option that is not hashable: Triton's own launch
            return through_triton()
        if compiled is None:
            names = list(self.kernel.arg_names)
            if names[len(args) :] != list(constexprs):
                raise ValueError(f"constexprs must be {names[len(args) :]} in order, got {list(constexprs)}")
            compiled = through_triton()
            if all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
                self._compiled[key] = compiled  # else (a compile still under way): Triton's launch next time too
            return compiled
        g0, g1, g2 = (*grid, 1, 1)[:3]
        stream = torch._C._cuda_getCurrentRawStream(device)
        try:
            compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args,
                         *constexprs.values())  # fmt: skip
        except TypeError:  # another launcher's signature: fall back for good (nothing was launched)
            self.direct = False
            return through_triton()
        return compiled
