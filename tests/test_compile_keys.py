"""Triton's compile-cache keys of the package's kernels do not depend on what a process launches first
(:mod:`mlaspec.impl.compile_keys`): the warm-up processes of ``mlaspec check --warm`` compile for the judged worker.

Each check runs in a fresh process with compiled Triton (not its interpreter), so that this test session never
imports ``mlaspec.impl`` compiled beside the interpreter tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

IMPL = Path(__file__).parents[1] / "impl"

KEYS = """
import importlib, json, pathlib, sys
from mlaspec.impl import compile_keys  # importing the package computes the keys (settle)
from mlaspec.impl.decode_sm90 import AVAILABLE
folder = pathlib.Path(compile_keys.__file__).parent
files = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
modules = [importlib.import_module(f"mlaspec.impl.{m}") for m in files]
held = {}
for m in modules:
    for a, f in sorted(vars(m).items()):
        fn = compile_keys._jit_function(f)
        if fn is not None and fn.__module__ == m.__name__:
            held[f"{m.__name__}.{a}"] = fn.hash is not None  # computed before anything here asked for it
for first in sys.argv[1:]:  # what this process "launches" first
    module, name = first.rsplit(".", 1)
    getattr(importlib.import_module(f"mlaspec.impl.{module}"), name).cache_key
keys = {k: compile_keys._jit_function(getattr(importlib.import_module(k.rsplit(".", 1)[0]), k.rsplit(".", 1)[1]))
        .cache_key for k in held}
defining = sorted({k.split(".")[2] for k in held})
print(json.dumps({"files": files, "modules": compile_keys.modules(), "defining": defining, "gluon": AVAILABLE,
                  "held": held, "keys": keys}))
"""


def _process(*first: str) -> dict:
    """What a fresh process that hashes ``first`` (``module.name``) before the rest reports: the modules of ``impl/``
    by file and as :func:`~mlaspec.impl.compile_keys.modules` finds them, those that define a JIT function, whether
    Gluon is there, which JIT functions held their key on import, and every key."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", KEYS, *first], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_every_module_that_defines_a_kernel_is_settled():
    """A kernel module :func:`~mlaspec.impl.compile_keys.modules` missed would be hashed in launch order: it finds
    every module file of ``impl/``, and the JIT functions found in them are those of every file with such
    decorators."""
    found = _process()
    assert found["modules"] == found["files"]
    jit = re.compile(r"^\s*@(triton|gluon)\.jit\b", re.MULTILINE)
    assert {p.stem for p in IMPL.glob("*.py") if jit.search(p.read_text())} == set(found["defining"])


def test_importing_the_package_computes_every_key():
    """Every JIT function of the kernel modules holds its key once ``mlaspec.impl`` is imported, before any launch
    (any triton: without :func:`~mlaspec.impl.compile_keys.settle`, none would)."""
    held = _process()["held"]
    assert len(held) > 20 and all(held.values()), [k for k, v in held.items() if not v]


@pytest.mark.parametrize(
    "first",
    [
        ("decode_sm90.split_kernel", "decode_sm90.split_kernel_lead"),  # the 16-bit decode before the fp8 one
        ("decode_sm90.split_kernel_fp8", "sparse_sm90.sparse_kernel"),  # the fp8 decode first (a warm-up's order)
    ],
)
def test_keys_do_not_depend_on_what_a_process_hashes_first(first):
    """On triton 3.6 (torch 2.11's), without :func:`~mlaspec.impl.compile_keys.settle`, ``split_kernel_fp8``'s key
    differed between a process that hashed ``split_kernel`` first and one that did not (an H200, 2026-11-29: this
    test failed there without it); triton 3.9 hashes in any order alike."""
    settled = _process()
    if not settled["gluon"]:
        pytest.skip("no Gluon in this triton: the Hopper kernels, whose keys differed, are not defined")
    reordered = _process(*reversed(first))
    assert "mlaspec.impl.decode_sm90.split_kernel_fp8" in settled["keys"]
    assert reordered["keys"] == settled["keys"]
