"""A case's float64 reference and budgets: computed on a chosen device, and kept in a disk cache between runs.

The reference (``op.reference``) and the budgets (``op.bounds``) are the harness's own work, and at full scale most
of a run's time: float64 einsums over real DeepSeek sizes. Two things make them cheap.

**Where they are computed** (:func:`reference_device`): the inputs are always built on the CPU from the case's seed
(:func:`~mlaspec.conformance.ops.common.randn`), so every device sees the same bits; they are then moved to the
reference device, the reference and the budgets are computed there (inside ``with torch.device(dev):``, so the
spec's factory calls land there too), and the results come back to the CPU, where they are judged. float64 on a GPU
is IEEE arithmetic as on the CPU, but reductions (einsum, sum, logsumexp) may add in another order: a GPU reference
may differ from the CPU's in the last bits, relative ``~1e-13``, far below any budget
(``docs/conformance.md``, "Where references are computed"; ``tests/test_references.py`` measures it on a GPU).

**The disk cache** (:class:`ReferenceCache`): one file per case under ``$MLASPEC_CACHE_DIR``, else
``$XDG_CACHE_HOME/mlaspec``, else ``~/.cache/mlaspec``, holding only the reference and the budgets (never the
inputs). Its key is everything they depend on (:func:`cache_key`): the op, the case (id, parameters, seed, dtype),
the scale, the declared numerics in force, the device type it was computed on, the torch version and the *spec
version* (:func:`spec_version`, a hash of the sources the reference and the budgets are computed from). A file is
written atomically (a temporary file, then a rename); one that cannot be read, or whose stored key is not the one
asked for, is recomputed and rewritten, never trusted.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path

import torch

from .cases import Case
from .numerics import assuming

__all__ = [
    "DEVICE_AGREEMENT",
    "ReferenceCache",
    "cache_dir",
    "cache_key",
    "device_disagreement",
    "reference_device",
    "spec_version",
    "to_device",
]

_PACKAGE = Path(__file__).resolve().parent.parent  # the mlaspec package: spec/, conformance/
_SOURCES = ("spec/*.py", "conformance/ops/*.py", "conformance/cases.py", "conformance/numerics.py")


@functools.cache
def _package_hash() -> str:
    digest = hashlib.sha256()
    for pattern in _SOURCES:
        for path in sorted(_PACKAGE.glob(pattern)):
            digest.update(path.relative_to(_PACKAGE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def _file_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _source_file(fn: object) -> str | None:
    """The file that defines ``fn`` (through ``functools.partial`` and decorators), None where there is none."""
    fn = getattr(fn, "func", fn)
    try:
        return inspect.getsourcefile(inspect.unwrap(fn)) if fn is not None else None
    except TypeError:  # a builtin, or a callable object: no source to hash
        return None


def spec_version(op=None) -> str:
    """A hash of the sources a reference and its budgets are computed from: ``spec/*.py``, ``conformance/ops/*.py``,
    ``conformance/cases.py`` (the seed) and ``conformance/numerics.py``, computed once per process; with ``op``,
    also the files that define its ``make_inputs``, ``reference`` and ``bounds`` where they live outside the package
    (an op a user registered)."""
    extra = []
    if op is not None:
        for fn in (op.make_inputs, op.reference, op.bounds):
            path = _source_file(fn)
            if path and not Path(path).resolve().is_relative_to(_PACKAGE):
                extra.append(_file_hash(path))
    return "-".join([_package_hash(), *extra])


def cache_dir() -> Path:
    """``$MLASPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/mlaspec``, else ``~/.cache/mlaspec``."""
    if os.environ.get("MLASPEC_CACHE_DIR"):
        return Path(os.environ["MLASPEC_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlaspec"


def cache_key(case: Case, *, scale: str, numerics: tuple[str, ...], device: torch.device, op=None) -> dict:
    """Everything a case's reference and budgets depend on, as a JSON-able dict (:class:`ReferenceCache`'s key)."""
    return dict(
        op=case.op,
        case=case.id,
        params=json.dumps(case.params, sort_keys=True, default=repr),
        seed=case.seed,
        dtype=case.dtype,
        scale=scale,
        numerics=list(numerics),
        device=torch.device(device).type,
        torch=str(torch.__version__),
        spec=spec_version(op),
    )


@dataclass(frozen=True)
class ReferenceCache:
    """References and budgets on disk under ``root``, one ``torch.save`` file per :func:`cache_key`."""

    root: Path

    @classmethod
    def default(cls) -> ReferenceCache:
        return cls(cache_dir() / "references")

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return self.root / key["op"] / f"{digest[:32]}.pt"

    def load(self, key: dict) -> tuple[tuple, tuple | None] | None:
        """``(ref, bounds)`` stored under ``key``, or None: absent, unreadable, or stored under another key."""
        try:
            entry = torch.load(self.path(key), map_location="cpu", weights_only=True)
            if entry["key"] != key:
                return None
            return tuple(entry["ref"]), None if entry["bounds"] is None else tuple(entry["bounds"])
        except Exception:  # a missing, truncated or foreign file: recomputed, never trusted
            return None

    def store(self, key: dict, ref: tuple, bounds: tuple | None) -> None:
        """Write ``(ref, bounds)`` under ``key``: a temporary file (``.tmp-<pid>-*``) renamed into place, so a reader
        never sees half of one; a cache that cannot be written is no error (the run goes on uncached)."""
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{os.getpid()}-", suffix=".pt")
            try:
                with os.fdopen(fd, "wb") as f:
                    torch.save(dict(key=key, ref=_compact(ref), bounds=_compact(bounds)), f)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError:
            pass


def _compact(x: object) -> object:
    """``x`` with each tensor that is a view into a larger storage copied out (``torch.save`` writes a tensor's
    whole storage); an expanded tensor, smaller than its view, stays as it is."""
    if isinstance(x, torch.Tensor):
        return x.clone() if x.untyped_storage().nbytes() > x.numel() * x.element_size() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_compact(v) for v in x)
    return x


def reference_device(option: str | torch.device = "auto", backend: object = None) -> torch.device:
    """The device references are computed on: ``option`` when it names one (``"cpu"``, ``"cuda:1"``); ``"auto"``:
    the backend's device when it is CUDA (its ``device`` attribute, else ``$MLASPEC_DEVICE``), else the CPU."""
    if option != "auto":
        return torch.device(option)
    env = os.environ.get("MLASPEC_DEVICE") or "cpu"
    device = torch.device(getattr(backend, "device", None) or env)
    if device.type == "cuda" and device.index is None and env.startswith("cuda:"):
        device = torch.device(env)  # a backend on "cuda" runs on the worker's current device, MLASPEC_DEVICE's
    return device if device.type == "cuda" and torch.cuda.is_available() else torch.device("cpu")


def to_device(x: object, device: torch.device) -> object:
    """``x`` with every tensor in it moved to ``device`` (through tuples, lists, dicts and dataclasses)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple
        return type(x)(*(to_device(v, device) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if is_dataclass(x) and not isinstance(x, type):
        return replace(x, **{f.name: to_device(getattr(x, f.name), device) for f in fields(x) if f.init})
    return x


def compute(op, inputs: dict, u: float, numerics: tuple[str, ...], device: torch.device) -> tuple[tuple, tuple | None]:
    """``(ref, bounds)`` of ``op`` on ``inputs`` (built on the CPU), computed on ``device`` under the declared
    ``numerics``, returned on the CPU."""
    on_cpu = device.type == "cpu"
    # off the CPU, the spec's own factory calls (torch.arange, torch.zeros) land on the device too; on the CPU that
    # context is only the default, and would cost every torch call a Python-level dispatch
    with assuming(numerics), contextlib.nullcontext() if on_cpu else torch.device(device):
        kwargs = inputs if on_cpu else to_device(inputs, device)
        ref = tuple(op.reference(**kwargs))
        bounds = None if op.bounds is None else op.bounds(kwargs, ref, u)
    if on_cpu:
        return ref, bounds
    return to_device(ref, torch.device("cpu")), to_device(bounds, torch.device("cpu"))


_WARNED: set[tuple[str, str]] = set()


def _warn_once(op: str, device: torch.device, exc: Exception) -> None:
    if (op, str(device)) not in _WARNED:
        _WARNED.add((op, str(device)))
        message = f"{op}: a reference could not be computed on {device} ({type(exc).__name__}: {exc}); on the CPU"
        warnings.warn(message, stacklevel=3)


def reference(
    op,
    case: Case,
    make_inputs: Callable[[], dict],
    u: float,
    *,
    scale: str,
    numerics: tuple[str, ...],
    device: torch.device,
    cache: ReferenceCache | None,
) -> tuple[tuple, tuple | None]:
    """``(ref, bounds)`` of ``case`` from ``cache`` when it holds them, else computed (:func:`compute`, on the inputs
    ``make_inputs()`` builds) and stored there. Where the computation raises on a device other than the CPU, it is
    done again on the CPU with a warning, once per op (a verdict never depends on where its reference was computed;
    ``benchmarks/reference_check.py`` shows such an op as not agreeing)."""
    for where in dict.fromkeys([device, torch.device("cpu")]):  # the device, then the CPU if the spec breaks there
        key = None if cache is None else cache_key(case, scale=scale, numerics=numerics, device=where, op=op)
        hit = None if cache is None else cache.load(key)
        if hit is not None:
            return hit
        try:
            ref, bounds = compute(op, make_inputs(), u, numerics, where)
        except Exception as exc:  # a spec path that breaks off the CPU must not change a verdict: the CPU computes it
            if where.type == "cpu":
                raise
            _warn_once(op.name, where, exc)
            continue
        if cache is not None:
            cache.store(key, ref, bounds)
        return ref, bounds
    raise AssertionError("unreachable: the CPU either computes or raises")


#: How far a reference computed on another device may be from the CPU's: float64 on both, the same inputs, only the
#: order of additions inside reductions differs (relative ``~1e-16`` per addition, ``~1e-13`` after thousands),
#: against a budget of at least ``2^-24`` relative: ``~1e-6`` of the budget at the very worst. Measured on the H200
#: over every full-scale curated case: ``6.1e-9`` at worst (``sparse_decode`` fp16), below ``2e-10`` elsewhere.
DEVICE_AGREEMENT = 1e-6


def device_disagreement(case: Case, device: torch.device, *, numerics: tuple[str, ...] = ()) -> dict[str, float]:
    """How far ``case``'s reference and budgets computed on ``device`` are from the CPU's, per output: ``|Δref| /
    budget`` (``bounds`` as the CPU computes them; ``|Δref| / |ref|`` for an op judged by ``compare``, which has
    none), and ``|Δbound| / bound``; ``inf`` where the NaN / ±inf positions, a shape or an exact (integer, bool)
    output differ. Within :data:`DEVICE_AGREEMENT` everywhere, the device's verdicts are the CPU's."""
    from .ops import DTYPES, OPS, unit_roundoff

    op = OPS[case.op]
    u = unit_roundoff(DTYPES[case.dtype])
    inputs = op.make_inputs(case)
    ref, bounds = compute(op, inputs, u, numerics, torch.device("cpu"))
    ref_dev, bounds_dev = compute(op, op.make_inputs(case), u, numerics, device)
    budgets = bounds or (None,) * len(ref)
    out = {}
    for i, (a, b, budget) in enumerate(zip(ref, ref_dev, budgets, strict=True)):
        out[f"ref{i}"] = _relative_gap(a, b, budget)
    for i, (a, b) in enumerate(zip(bounds or (), bounds_dev or (), strict=True)):
        out[f"bound{i}"] = _relative_gap(a, b, None)
    return out


def _relative_gap(a: object, b: object, scale: torch.Tensor | None) -> float:
    """``max |a - b| / scale`` (``scale`` default ``|a|``) over the finite entries of two float tensors; 0 or ``inf``
    for anything else, equal or not."""
    if not isinstance(a, torch.Tensor) or not a.dtype.is_floating_point:
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
        return 0.0 if same else math.inf
    if a.shape != b.shape or not all(torch.equal(t(a), t(b)) for t in (torch.isnan, torch.isposinf, torch.isneginf)):
        return math.inf
    finite = torch.isfinite(a)
    gap = torch.where(finite, (a - b).abs(), 0.0)
    scale = a.abs() if scale is None else torch.broadcast_to(scale, a.shape)
    ratio = torch.where(gap > 0, gap / scale.clamp_min(1e-300), 0.0)
    return float(ratio.max()) if ratio.numel() else 0.0
