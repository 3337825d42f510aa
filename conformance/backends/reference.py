"""Backend ``spec``: the float64 spec itself, run on the case's inputs. It must pass every case (self-check)."""

from __future__ import annotations

from ..ops import OPS


class SpecBackend:
    name = "spec"
    version = "float64 reference"
    dtypes = frozenset({"bfloat16", "float16", "float32"})

    @property
    def ops(self) -> frozenset[str]:
        """Every registered op, those registered after this backend was made included."""
        return frozenset(OPS)

    def __getattr__(self, op: str):
        if op in OPS:
            return OPS[op].reference
        raise AttributeError(op)
