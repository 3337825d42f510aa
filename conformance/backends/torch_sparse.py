"""The torch backend's sparse ops (a mixin of :class:`~mlaspec.conformance.backends.torch_eager.TorchBackend`)."""

from __future__ import annotations


class TorchSparse:
    """Eager-torch implementations of the sparse ops, rounding where a fused kernel rounds."""
