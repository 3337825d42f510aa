"""Triton's compile-cache keys of the package's kernels do not depend on what a process launches first
(:mod:`mlaspec.impl.compile_keys`): the warm-up processes of ``mlaspec check --warm`` compile for the judged worker."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlaspec.impl.compile_keys import MODULES

IMPL = Path(__file__).parents[1] / "impl"

KEYS = """
import json, sys
from triton.runtime.jit import JITFunction
from mlaspec.impl import compile_keys
import importlib
modules = [importlib.import_module(f"mlaspec.impl.{m}") for m in compile_keys.MODULES]
for first in sys.argv[1:]:  # what this process "launches" first: its key, before the others'
    module, name = first.rsplit(".", 1)
    getattr(importlib.import_module(f"mlaspec.impl.{module}"), name).cache_key
keys = {f"{m.__name__}.{a}": f.cache_key for m in modules for a, f in sorted(vars(m).items())
        if isinstance(f, JITFunction) and f.__module__ == m.__name__}
print(json.dumps(keys))
"""


def _keys(*first: str) -> dict[str, str]:
    """Every JIT function's key in a fresh process (compiled Triton, not its interpreter) that hashes ``first``
    (``module.name``) before the others."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", KEYS, *first], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_every_module_that_defines_a_kernel_is_settled():
    """A kernel module left out of :data:`MODULES` would be hashed in launch order again."""
    jit = re.compile(r"^\s*@(triton|gluon)\.jit\b", re.MULTILINE)
    defining = {p.stem for p in IMPL.glob("*.py") if jit.search(p.read_text())}
    assert defining == set(MODULES)


@pytest.mark.parametrize(
    "first",
    [
        ("decode_sm90.split_kernel", "decode_sm90.split_kernel_lead"),  # the 16-bit decode before the fp8 one
        ("decode_sm90.split_kernel_fp8", "sparse_sm90.sparse_kernel"),  # the fp8 decode first (a warm-up's order)
    ],
)
def test_keys_do_not_depend_on_what_a_process_hashes_first(first):
    """On triton 3.6 (torch 2.11's), without :func:`~mlaspec.impl.compile_keys.settle`, ``split_kernel_fp8``'s key
    differed between a process that hashed ``split_kernel`` first and one that did not (an H200, 2026-11-29); the
    keys of a process that hashes in the settled order, and of one that hashes these first, must be equal."""
    settled, reordered = _keys(), _keys(*reversed(first))
    assert len(settled) > 50 and "mlaspec.impl.decode_sm90.split_kernel_fp8" in settled
    assert reordered == settled
