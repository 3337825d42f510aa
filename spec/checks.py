"""The spec's shared validation helpers: the input checks every spec function makes, public so that the kernels'
host launchers (:mod:`mlaspec.impl`) validate their arguments by the same rules and with the same messages.

One rule for the whole spec: a malformed argument raises at the boundary, and the message names the argument,
what was expected and what came. Shapes are checked against named dimensions (``B, S_q, S_kv, H_q, H_kv, D_qk,
D_v, ...``) bound by the first argument that carries them, so a mismatch says where the other value came from::

    dims = Dims()
    dims.tensor("q", q, ("B", "S_q", "H_q", "D_qk"), FLOAT)
    dims.tensor("k", k, ("B", "S_kv", "H_kv", "D_qk"), FLOAT)
    # ValueError: k must have shape [B, S_kv, H_kv, D_qk] with B=2, D_qk=576 (from q); got [3, 7, 1, 576]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "BOOL",
    "FLOAT",
    "FP8",
    "INT",
    "Dims",
    "boolean",
    "choice",
    "cu_seqlens",
    "device",
    "finite_float",
    "in_range",
    "positive_int",
    "positive_scale",
]

FLOAT = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
INT = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
BOOL = (torch.bool,)


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


class Dims:
    """Binds named dimensions across the arguments of one call and checks each tensor against them."""

    def __init__(self, **known: int):
        self.sizes: dict[str, int] = dict(known)
        self.source: dict[str, str] = {k: "the arguments" for k in known}

    def tensor(
        self,
        name: str,
        x: object,
        shape: Sequence[str | int | None],
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> torch.Tensor:
        """Check that ``x`` is a tensor of ``shape`` (names bind, ints are fixed, None is free) and dtype."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if dtypes is not None and x.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype {_names(dtypes)}, got {str(x.dtype).removeprefix('torch.')}")
        want = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
        if x.dim() != len(shape):
            raise ValueError(f"{name} must have rank {len(shape)} with shape {want}, got shape {list(x.shape)}")
        for dim, size in zip(shape, x.shape):
            if dim is None:
                continue
            if isinstance(dim, int):
                if size != dim:
                    raise ValueError(f"{name} must have shape {want}, got {list(x.shape)}")
                continue
            if dim in self.sizes and self.sizes[dim] != size:
                bound = ", ".join(f"{d}={self.sizes[d]}" for d in shape if isinstance(d, str) and d in self.sizes)
                sources = sorted({self.source[d] for d in shape if isinstance(d, str) and d in self.source})
                raise ValueError(
                    f"{name} must have shape {want} with {bound} (from {', '.join(sources)}); got {list(x.shape)}"
                )
            self.sizes.setdefault(dim, size)
            self.source.setdefault(dim, name)
        return x

    def bind(self, source: str, **sizes: int) -> Dims:
        """Bind dimensions computed from the argument ``source`` (a later mismatch names it)."""
        for dim, size in sizes.items():
            self.sizes[dim], self.source[dim] = size, source
        return self

    def __getitem__(self, dim: str) -> int:
        return self.sizes[dim]


def _name(name: object, label: str = "name") -> str:
    if not isinstance(name, str):
        raise TypeError(f"{label} must be a str (an argument's name), got {type(name).__name__}")
    return name


def positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    """An int (not a bool, not a float such as ``1.0``) of at least ``minimum``."""
    name = _name(name)
    if isinstance(minimum, bool) or not isinstance(minimum, int):
        raise TypeError(f"minimum must be an int, got {type(minimum).__name__}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def boolean(name: str, value: object) -> bool:
    """A bool (not an int such as ``1``, not None)."""
    name = _name(name)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def choice(name: str, value: object, options: Sequence[object]) -> object:
    """One of ``options`` (compared with ``==``; a bool never matches an int option)."""
    name = _name(name)
    if isinstance(options, (str, bytes)) or not isinstance(options, (Sequence, set, frozenset)):
        raise TypeError(f"options must be a sequence or set of the allowed values, got {type(options).__name__}")
    if not any(type(value) is type(o) for o in options):
        raise TypeError(f"{name} must be one of {list(options)}, got a {type(value).__name__}")
    try:
        ok = value in options
    except TypeError:  # an unhashable value against a set or dict of options
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {list(options)}, got {value!r}")
    return value


def device(name: str, value: object) -> torch.device | None:
    """None, or a ``torch.device`` / a device string torch understands (``"cpu"``, ``"cuda:0"``)."""
    name = _name(name)
    if value is None or isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a torch.device, a str or None, got {type(value).__name__}")
    try:
        return torch.device(value)
    except RuntimeError as e:
        raise ValueError(f"{name} must name a device, got {value!r}") from e


def in_range(name: str, x: torch.Tensor, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
    """Every element of the tensor ``x`` (any shape) in ``[lo, hi]``, ints (either end open when None)."""
    name = _name(name)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    for end, v in (("lo", lo), ("hi", hi)):
        if v is not None:
            positive_int(end, v, minimum=-(2**63))
    if x.numel() == 0:
        return x
    bad = torch.zeros_like(x, dtype=torch.bool)
    if lo is not None:
        bad |= x < lo
    if hi is not None:
        bad |= x > hi
    if bool(bad.any()):
        where = [int(i) for i in bad.nonzero()[0]]
        want = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise ValueError(f"{name} must lie in {want}, got {x[tuple(where)].item()} at {where}")
    return x


def finite_float(name: str, value: object) -> float:
    """A finite real number."""
    name = _name(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not torch.isfinite(torch.tensor(float(value))):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def positive_scale(name: str, value: object) -> float:
    """A finite scale ``> 0``: a number or a one-element floating tensor (vLLM's ``k_scale`` is ``[1]`` fp32)."""
    name = _name(name)
    if isinstance(value, torch.Tensor):
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {str(value.dtype).removeprefix('torch.')}")
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {list(value.shape)}")
        value = float(value.reshape(()))
    s = finite_float(name, value)
    if s <= 0:
        raise ValueError(f"{name} must be > 0, got {s}")
    return s


def cu_seqlens(name: str, x: object, batch: int | None = None, *, batch_from: str = "the arguments") -> torch.Tensor:
    """Cumulative sequence lengths: int tensor [B + 1], starting at 0, non-decreasing (``B = batch`` when given,
    bound by the argument ``batch_from``, which a mismatch names)."""
    name = _name(name)
    dims = Dims()
    if batch is not None:
        dims.bind(_name(batch_from, "batch_from"), B_plus_1=positive_int("batch", batch, minimum=0) + 1)
    x = dims.tensor(name, x, ("B_plus_1",), INT)
    if x.numel() == 0 or int(x[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {x.tolist()}")
    if bool((x[1:] < x[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {x.tolist()}")
    return x
