"""Compiles four specializations of one small kernel ahead of time for sm_90 into the Triton cache named on the
command line (no GPU needed): ``n`` divisible by 16 or not, ``s`` a constant (1), the last two alike but for a
constexpr. ``test_benchmarks.test_compile_census_reads_what_triton_writes`` runs it in a process of its own, without
``TRITON_INTERPRET`` (an interpreted kernel run earlier in a process patches ``triton.language`` for good).

    TRITON_CACHE_DIR=/tmp/tc python tests/census_probe.py
"""

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def copy(X, Y, n, s, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + i * s, tl.load(X + i, mask=i < n), mask=i < n)


SIGNATURE = {"X": "*fp16", "Y": "*fp16", "n": "i32", "s": "i32", "BLOCK": "constexpr"}  # copy's, for triton.compile


if __name__ == "__main__":
    d16 = [["tt.divisibility", 16]]
    for attrs, constexprs in [
        ({(0,): d16, (1,): d16, (2,): d16}, {(4,): 64}),
        ({(0,): d16, (1,): d16}, {(4,): 64}),
        ({(0,): d16, (1,): d16}, {(3,): 1, (4,): 64}),
        ({(0,): d16, (1,): d16}, {(3,): 1, (4,): 128}),
    ]:
        signature = {**SIGNATURE, "s": "constexpr"} if (3,) in constexprs else SIGNATURE
        triton.compile(ASTSource(copy, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32))
