"""Backend ``triton``: the kernels of :mod:`mlaspec.impl` behind the conformance harness's protocol.

The adapter lives here, in the harness, so that :mod:`mlaspec.impl` holds only kernels and their host launchers
(the import rules of ``tests/test_architecture.py``): each mixin translates the harness's arguments (the spec
function's) to a kernel's interface and back, and names the limits of the kernels as skip reasons:

* :mod:`.dense`: ``attention``, ``mla_decode``, ``mla_prefill``, ``mla_absorbed``, ``merge_attn_states``;
* :mod:`.layer`: the mixed batch, chunked prefill and the fp8 decode;
* :mod:`.sparse`: sparse prefill / decode and one DeepSeek V4 layer;
* :mod:`.indexer`: the lightning indexer's logits and top-k;
* :mod:`.serving`: the cache ops;
* :mod:`.metadata`: the slot-mapping kernel (the host-side metadata ops are named in ``not_implemented`` with the
  reason).

Device: CUDA when available. Without a GPU the kernels run on CPU tensors through Triton's interpreter, which
must be switched on (``TRITON_INTERPRET=1``) *before* :mod:`mlaspec.impl` is imported, since ``@triton.jit``
decides at decoration time; otherwise every case is skipped with that reason. The interpreter's ``tl.dot`` is
wrong for bfloat16 (triton 3.9), so bf16 cases of the ops that multiply matrices are skipped there too.

Environment: ``MLASPEC_TRITON_PREFILL_CONFIG=M,N,WARPS,STAGES`` (e.g. ``64,32,4,2``) overrides the tile of the
varlen kernel (``attention``, ``mla_prefill``; :class:`mlaspec.impl.prefill.PrefillConfig`) for every case, where
its heuristic (:func:`mlaspec.impl.prefill.prefill_config`) would choose one; the override shows in ``version``.
An explicit ``prefill_config=`` argument wins over the variable.

Built in as ``triton`` (``mlaspec check --backend triton``); the target is
``mlaspec.conformance.backends.triton:TritonBackend``. Built in as ``triton-e4m3``
(:class:`TritonE4m3Backend`): the fp8 decode's e4m3 path alone, the arithmetic of FlashMLA's dense fp8 kernel.
"""

from __future__ import annotations

import os
from types import MappingProxyType

import torch
import triton

from mlaspec.conformance.ops import implemented_ops
from mlaspec.impl.prefill import PrefillConfig

from .dense import DENSE_OPS, TritonDense, interpreted
from .indexer import TritonIndexer
from .layer import LAYER_OPS, TritonLayer
from .metadata import HOST_SIDE, TritonMetadata
from .serving import TritonServing
from .sparse import SPARSE_OPS, TritonSparse

__all__ = ["PREFILL_CONFIG_ENV", "TritonBackend", "TritonE4m3Backend", "interpreted", "prefill_config_from_env"]

PREFILL_CONFIG_ENV = "MLASPEC_TRITON_PREFILL_CONFIG"

# ops whose kernels multiply in the case dtype: the interpreter's bf16 tl.dot is wrong for them
_DOT_OPS = (DENSE_OPS - {"merge_attn_states"}) | SPARSE_OPS | LAYER_OPS


def prefill_config_from_env() -> PrefillConfig | None:
    """The varlen kernel's tile from ``MLASPEC_TRITON_PREFILL_CONFIG=M,N,WARPS,STAGES`` (None when unset or empty)."""
    text = os.environ.get(PREFILL_CONFIG_ENV, "").strip()
    if not text:
        return None
    try:
        fields = [int(f) for f in text.split(",")]
    except ValueError:
        fields = []
    if len(fields) != 4:
        raise ValueError(f"{PREFILL_CONFIG_ENV} must be four integers M,N,WARPS,STAGES (e.g. 64,32,4,2), got {text!r}")
    return PrefillConfig(*fields)


class TritonBackend(TritonDense, TritonLayer, TritonSparse, TritonIndexer, TritonServing, TritonMetadata):
    name = "triton"
    version = f"triton {triton.__version__}"
    jit = True  # Triton compiles each kernel variant on first use (mlaspec check --warm auto)
    not_implemented = HOST_SIDE  # left out on purpose, with the reason the harness shows in the skip
    dtypes = frozenset({"bfloat16", "float16", "float32"})
    # impl/indexer.py's tl.dot on e4m3 is a QGMMA on Hopper: ~14 accumulator bits; impl/sparse.py rounds an fp8
    # cache's dequantized keys to q's dtype for its dot (lines 113, 290) (mlaspec.conformance.numerics)
    numerics = MappingProxyType(
        {
            **{op: ("fp8_mma_accumulation",) for op in ("indexer_logits", "paged_indexer_logits")},
            "sparse_decode": ("keys_in_query_dtype",),
        }
    )

    def __init__(self, device: str | None = None, *, prefill_config: PrefillConfig | None = None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() and not interpreted() else "cpu"
        self.device = torch.device(device)
        if prefill_config is None:
            prefill_config = prefill_config_from_env()
            if prefill_config is not None:
                tile = ",".join(map(str, prefill_config))
                self.version = f"{type(self).version}, prefill tile {tile} ({PREFILL_CONFIG_ENV})"
        self.prefill_config = prefill_config  # tile override of the varlen kernel (None: its heuristic)

    @property
    def unavailable(self) -> str | None:
        """Why no case can run here (the protocol's optional ``unavailable``), None when some can."""
        if self.device.type != "cuda" and not interpreted():
            return "needs CUDA (or TRITON_INTERPRET=1, set before mlaspec.impl is imported)"
        return None

    def unsupported(self, case) -> str | None:
        """Why a case cannot run here (None when it can): no device, bf16 in the interpreter, or a mixin's limit."""
        if self.unavailable:
            return self.unavailable
        if interpreted() and case.dtype == "bfloat16" and case.op in _DOT_OPS:
            return "the Triton interpreter's tl.dot is wrong for bfloat16 (triton 3.9): run bf16 on a GPU"
        check = getattr(self, f"_unsupported_{case.op}", None)  # the mixins' named limits
        return None if check is None else check(case)


TritonBackend.ops = implemented_ops(TritonBackend)  # every op some mixin has a method for


class TritonE4m3Backend(TritonBackend):
    """The fp8 decode's **e4m3 path** (:func:`mlaspec.impl.decode.mla_decode_paged` with an e4m3 ``q``): the query
    quantized to e4m3 with its ``q_scale`` as vLLM hands it to FlashMLA's dense fp8 kernel, both products multiplied
    in e4m3 (Hopper's fp8 tensor cores, ~14 accumulator bits) and the softmax weights rounded to e4m3 for ``P V``:
    the arithmetic of FlashMLA's ``fwd_kvcache_mla_fp8``, declared as FlashMLA's adapter declares it, and half the
    tensor-core work of the ``triton`` backend's exact path. Only the ops that run it: ``mla_decode_fp8`` over
    vLLM's per-tensor cache, and ``dcp_decode_fp8`` (each rank's share through it); every other op is ``triton``'s."""

    name = "triton-e4m3"
    e4m3 = True
    dtypes = frozenset({"bfloat16", "float16"})  # the e4m3 path writes bf16 or fp16
    ops = frozenset({"mla_decode_fp8", "dcp_decode_fp8"})
    numerics = MappingProxyType(
        {op: ("fp8_mma_accumulation", "p_in_e4m3") for op in ("mla_decode_fp8", "dcp_decode_fp8")}
    )

    def _unsupported_mla_decode_fp8(self, case) -> str | None:
        if case.params["layout"] != "fp8_e4m3_per_tensor":
            return f"mla_decode_fp8: the e4m3 path reads vLLM's fp8_e4m3_per_tensor cache, not {case.params['layout']}"
        return super()._unsupported_mla_decode_fp8(case)
