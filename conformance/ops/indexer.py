"""Conformance ops for the indexer spec (being written: this module's OPS list grows as the ops land)."""

from __future__ import annotations

from .common import Op

OPS: list[Op] = []
