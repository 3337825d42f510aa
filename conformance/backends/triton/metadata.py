"""Harness-facing methods for the batch metadata vLLM computes on the GPU (a mixin of ``TritonBackend``).

* ``slot_mapping_from_block_table``: :func:`mlaspec.impl.slot_mapping.slot_mapping_from_block_table`, the Triton
  kernel vLLM runs every step (``_compute_slot_mapping_kernel``), on the harness's block table (shuffled pages, the
  unused columns pointing at a spare page) and CUDA-graph padding.

The rest of the batch metadata (``build_metadata``, ``split_decodes_and_prefills``,
``reorder_batch_to_split_decodes_and_prefills``, ``make_local_attention_virtual_batches``) is host-side Python in
vLLM, run on the CPU by the scheduler and the metadata builders: there is no kernel to write or to judge, so the
backend names them in :data:`HOST_SIDE` (the harness shows the reason in the skip) instead of implementing them.

No op here multiplies matrices, so bf16 cases run in the interpreter too.
"""

from __future__ import annotations

from mlaspec.conformance.ops import implemented_ops
from mlaspec.impl.slot_mapping import slot_mapping_from_block_table

__all__ = ["HOST_SIDE", "METADATA_OPS", "TritonMetadata"]


_HOST = "host-side batch metadata: vLLM builds it on the CPU; no Triton kernel to judge"
HOST_SIDE = {
    op: _HOST
    for op in (
        "build_metadata",
        "split_decodes_and_prefills",
        "reorder_batch_to_split_decodes_and_prefills",
        "make_local_attention_virtual_batches",
    )
}
"""The ops this backend leaves out on purpose, and why (the protocol's optional ``not_implemented``)."""


class TritonMetadata:
    """The slot-mapping kernel; expects ``self.device`` (set by ``TritonBackend.__init__``)."""

    # -- ops -----------------------------------------------------------------------------------------------------
    def slot_mapping_from_block_table(
        self, block_table, block_size, query_start_loc, positions, *, num_blocks=None, pad_to=None
    ):
        """``(slot_mapping, block_ids, block_offsets)``, each ``[pad_to]`` int64, from the spec's arguments
        (:func:`mlaspec.spec.paged_cache.slot_mapping_from_block_table`)."""
        dev = self.device
        out = slot_mapping_from_block_table(
            block_table.to(dev),
            block_size,
            query_start_loc.to(dev),
            positions.to(dev),
            num_blocks=num_blocks,
            pad_to=pad_to,
        )
        return tuple(out)


METADATA_OPS = implemented_ops(TritonMetadata)
"""The ops this mixin has a method for."""
