"""Compiles ``census_probe.copy`` ahead of time for sm_90 into the Triton cache named by ``TRITON_CACHE_DIR`` once the
file ``GO`` exists, and prints ``miss`` if this process compiled it, ``hit`` if it found it compiled (no GPU needed).
``test_compiles.py`` starts several at once, with (``shared``) and without (``plain``)
:func:`mlaspec.conformance.compiles.share_compiles`, in processes of their own without ``TRITON_INTERPRET``.

    TRITON_CACHE_DIR=/tmp/tc python tests/compile_lock_probe.py shared /tmp/go
"""

import os
import sys
import time

import triton
from census_probe import copy
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mlaspec.conformance.compiles import share_compiles

if __name__ == "__main__":
    mode, go = sys.argv[1:3]
    if mode == "shared":
        assert share_compiles()
    seen = []
    knobs.compilation.listener = lambda **kw: seen.append("hit" if kw["cache_hit"] else "miss")
    sig = {"X": "*fp16", "Y": "*fp16", "n": "i32", "s": "i32", "BLOCK": "constexpr"}
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.002)
    triton.compile(ASTSource(copy, sig, {(4,): 64}, {}), target=GPUTarget("cuda", 90, 32))
    print(*seen, flush=True)
