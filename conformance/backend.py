"""The backend protocol: what an adapter declares and implements, and how backends are found by name.

An adapter is any object with

* ``name: str`` and ``version: str`` (shown in the report header);
* ``ops: frozenset[str]``: the op names it implements (see :data:`mlaspec.conformance.ops.OPS`);
* ``dtypes: frozenset[str]``: the case dtypes it accepts (``"bfloat16"``, ``"float16"``, ``"float32"``);
* optionally ``unsupported(case) -> str | None``: a reason to skip a case it cannot run (a head count, a page
  size, a top-k multiple...). A skip is reported with its reason, never counted as a pass;
* optionally ``unavailable: str | None``: why no case can run on this machine (no GPU, a library missing), shown by
  ``mlaspec backends``; every case then skips with it;
* optionally ``not_implemented: Mapping[str, str]``: op name -> why the backend leaves that op out on purpose (e.g.
  host-side metadata that has no kernel); the skip of its cases says so after "does not implement";
* optionally ``numerics: Mapping[str, tuple[str, ...]]``: op name -> the arithmetic departures its kernel makes by
  design (:data:`mlaspec.conformance.numerics.DEPARTURES`, e.g. ``("fp8_mma_accumulation",)``): the op is judged under
  exactly that arithmetic and the verdict records it; ``--strict-numerics`` ignores the declaration;
* optionally ``device`` (where it runs) and ``jit: bool``: it compiles kernels the first time a shape needs them
  (Triton, FlashInfer); ``mlaspec check --warm auto`` starts warm-up processes only beside a ``jit`` backend on a
  CUDA ``device``;
* one method per op, named after it, taking the op's keyword arguments (the spec function's) and returning the
  spec's outputs (e.g. ``(out, lse)``) in the backend's own dtype and on any device.

Backends are found by name through the entry-point group ``mlaspec.backends`` (``name = "module:attr"``), or
directly as ``module:attr``; ``attr`` may be a backend object, a class or a factory taking no arguments.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import entry_points
from typing import Protocol, runtime_checkable

from .cases import Case

__all__ = ["Backend", "available_backends", "load_backend", "missing_op_reason", "skip_reason"]

GROUP = "mlaspec.backends"


@runtime_checkable
class Backend(Protocol):
    name: str
    version: str
    ops: frozenset[str]
    dtypes: frozenset[str]


def missing_op_reason(backend: Backend, op: str) -> str:
    """The skip reason of an op outside ``backend.ops``, with the backend's ``not_implemented`` note if it has one."""
    why = (getattr(backend, "not_implemented", None) or {}).get(op)
    return f"{backend.name} does not implement {op}" + (f" ({why})" if why else "")


def skip_reason(backend: Backend, case: Case) -> str | None:
    """Why ``backend`` cannot run ``case`` (None when it can)."""
    if getattr(backend, "unavailable", None):
        return str(backend.unavailable)
    if case.op not in backend.ops:
        return missing_op_reason(backend, case.op)
    if case.dtype not in backend.dtypes:
        return f"{backend.name} does not support dtype {case.dtype}"
    check = getattr(backend, "unsupported", None)
    return check(case) if check is not None else None


# The backends mlaspec ships. Named here rather than as entry points so that they resolve from a source tree
# too (the GPU machines run mlaspec from a checkout on PYTHONPATH); third-party adapters use the entry points.
BUILTIN = {
    "spec": "mlaspec.conformance.backends.reference:SpecBackend",
    "torch": "mlaspec.conformance.backends.torch_eager:TorchBackend",
    "torch_sdpa": "mlaspec.conformance.backends.torch_sdpa:TorchSDPABackend",
    "triton": "mlaspec.conformance.backends.triton:TritonBackend",
    "triton-e4m3": "mlaspec.conformance.backends.triton:TritonE4m3Backend",
    "flashmla": "mlaspec.conformance.backends.flashmla:FlashMLABackend",
    "deepgemm": "mlaspec.conformance.backends.deepgemm:DeepGEMMBackend",
    "flashinfer": "mlaspec.conformance.backends.flashinfer:FlashInferBackend",
    "vllm": "mlaspec.conformance.backends.vllm:VLLMBackend",
}


def available_backends() -> dict[str, str]:
    """Backend names -> ``module:attr``: the built-in ones and those registered under ``mlaspec.backends``."""
    return {**BUILTIN, **{ep.name: ep.value for ep in entry_points(group=GROUP)}}


def load_backend(spec: str) -> Backend:
    """A backend by registered name or ``module:attr``; a backend that imported Triton has its compiles shared with
    the run's other processes (:func:`~mlaspec.conformance.compiles.share_compiles`)."""
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"backend must be a name or 'module:attr', got {spec!r}")
    target = available_backends().get(spec, spec)
    if ":" not in target:
        names = ", ".join(sorted(available_backends())) or "none"
        raise ValueError(f"backend {spec!r} is neither a registered name ({names}) nor 'module:attr'")
    module, attr = target.split(":", 1)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `module:attr` names a module of the user's project, as `python -m` would
    obj = getattr(importlib.import_module(module), attr)
    backend = obj() if isinstance(obj, type) or (callable(obj) and not isinstance(obj, Backend)) else obj
    if not isinstance(backend, Backend):
        raise TypeError(f"backend {spec!r} lacks the protocol's attributes name, version, ops, dtypes")
    if "triton" in sys.modules:  # else it compiles nothing with Triton: the torch backend need not import it
        from .compiles import share_compiles

        share_compiles()
    return backend
