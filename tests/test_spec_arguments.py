"""Every public spec function refuses every bad argument with a ``ValueError`` / ``TypeError`` naming it.

Generated: the functions come from each spec module's ``__all__`` (a new function without a valid example in
``tests/spec_arguments.py`` fails :func:`test_every_public_function_has_a_valid_call`); each argument of a valid
call is broken in turn, the generic ways its kind can be broken (wrong type, a float for an int, a bool, a negative,
wrong rank, wrong dtype, a size that disagrees with the other arguments, an unknown option), plus the specific
breakages in ``EXTRA``. A generic breakage that is a *valid* value of the argument is listed in ``ALLOWED`` with the
convention that makes it valid.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil

import pytest
import torch
from spec_arguments import ALLOWED, EXTRA, UNSET, VALID

import mlaspec.spec

MODULES = sorted(m.name for m in pkgutil.iter_modules(mlaspec.spec.__path__))
FUNCTIONS = {
    f"{m}.{name}": getattr(importlib.import_module(f"mlaspec.spec.{m}"), name)
    for m in MODULES
    for name in getattr(importlib.import_module(f"mlaspec.spec.{m}"), "__all__", ())
    if inspect.isfunction(getattr(importlib.import_module(f"mlaspec.spec.{m}"), name))
}


def _other_dtype(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bool:
        return x.to(torch.int32)
    if x.dtype == torch.uint8:
        return x.to(torch.float32)
    if x.dtype.is_floating_point:
        return x.to(torch.int64) if x.dtype in (torch.float64, torch.float32) else x.to(torch.float64)
    return x.to(torch.float64)


def breakages(value: object) -> list[tuple[str, object]]:
    """The generic ways to break an argument whose valid value is ``value``: ``[(kind, bad value)]``."""
    if isinstance(value, bool):
        return [("int", int(value)), ("str", "yes")]
    if isinstance(value, int):
        return [
            ("float", value + 0.5),
            ("integral float", float(value)),
            ("str", str(value)),
            ("bool", True),
            ("negative", -1),
        ]
    if isinstance(value, float):
        return [("str", str(value)), ("bool", True), ("nan", math.nan), ("inf", math.inf)]
    if isinstance(value, str):
        return [("int", 3), ("unknown", "bogus")]
    if isinstance(value, torch.Tensor):
        out = [("list", value.tolist()), ("rank", value[None]), ("dtype", _other_dtype(value))]
        if value.dim():
            out.append(("size", torch.cat([value, value[:1] if len(value) else torch.zeros_like(value[None, 0])])))
        if value.dtype.is_signed and not value.dtype.is_floating_point and value.numel():
            out.append(("negative", torch.full_like(value, -5)))
        return out
    if isinstance(value, (list, tuple)):
        return [("str", "x"), ("int", 3)]
    if value is None:
        return []
    return [("object", object())]


def _expected_name(function: str, arg: str, kwargs: dict) -> str:
    """The name the message must contain: the argument's, or for the checks helpers the ``name`` they are given."""
    if function.startswith("checks.") and arg not in ("name", "minimum", "options", "batch", "batch_from", "lo", "hi"):
        return kwargs["name"]
    return arg


def _failures(function: str) -> list[str]:
    f, make = FUNCTIONS[function], VALID[function]
    problems = []
    for arg in make():
        allowed = ALLOWED.get((function, arg), {})
        for kind, bad in breakages(make()[arg]) + EXTRA.get((function, arg), []):
            if kind in allowed:
                continue
            kwargs = make()
            kwargs[arg] = bad
            want = _expected_name(function, arg, kwargs)
            try:
                f(**kwargs)
            except (ValueError, TypeError) as e:
                if want not in str(e):
                    problems.append(f"{arg} ({kind}): {type(e).__name__} does not name {want!r}: {e}")
            except Exception as e:  # an obscure error (IndexError, AttributeError, ...) is what this test is about
                problems.append(f"{arg} ({kind}): {type(e).__name__}: {e}")
            else:
                problems.append(f"{arg} ({kind}): accepted {bad!r:.60}")
    return problems


def test_every_public_function_has_a_valid_call():
    assert set(FUNCTIONS) == set(VALID), (
        f"missing valid examples: {sorted(set(FUNCTIONS) - set(VALID))}; stale: {sorted(set(VALID) - set(FUNCTIONS))}"
    )
    for function, f in FUNCTIONS.items():
        given = set(VALID[function]())
        params = set(inspect.signature(f).parameters)
        unset = {p for p in params - given if (function, p) not in UNSET}
        assert not unset, f"{function}: the valid call leaves {sorted(unset)} unset (give them, or say why in UNSET)"
        assert given <= params, f"{function}: unknown arguments {sorted(given - params)}"


@pytest.mark.parametrize("function", sorted(VALID))
def test_valid_call_runs(function):
    FUNCTIONS[function](**VALID[function]())


@pytest.mark.parametrize("function", sorted(VALID))
def test_bad_arguments_raise_naming_them(function):
    problems = _failures(function)
    assert not problems, f"{function}:\n  " + "\n  ".join(problems)
