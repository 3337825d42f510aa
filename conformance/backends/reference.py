"""Backend ``spec``: the float64 spec itself, run on the case's inputs. It must pass every case (self-check)."""

from __future__ import annotations

from ..ops import OPS


class SpecBackend:
    name = "spec"
    version = "float64 reference"
    ops = frozenset(OPS)
    dtypes = frozenset({"bfloat16", "float16", "float32"})

    def __getattr__(self, op: str):
        if op in OPS:
            return OPS[op].reference
        raise AttributeError(op)
