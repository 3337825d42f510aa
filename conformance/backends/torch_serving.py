"""The torch backend's serving ops (a mixin of :class:`~mlaspec.conformance.backends.torch_eager.TorchBackend`)."""

from __future__ import annotations


class TorchServing:
    """Eager-torch implementations of the serving ops, rounding where a fused kernel rounds."""
