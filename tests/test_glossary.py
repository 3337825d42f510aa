"""docs/glossary.md is the project's one list of names: the spec's shape checks use only its sizes, and no spec
function spells the softmax scale or the output width another way."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path

import mlaspec.spec

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"
SPEC = ROOT / "spec"

# the argument names the glossary replaced by ``scale`` and ``d_v``
FORBIDDEN_PARAMETERS = {"sm_scale": "scale", "softmax_scale": "scale", "head_dim_v": "d_v"}


# -- the two readers -------------------------------------------------------------------------------------------------
def size_names(markdown: str) -> list[str]:
    """The names in the first column of the table under ``## Sizes`` (every backticked name of a cell, so a row may
    name several), in order, repeats kept."""
    section = re.search(r"^## Sizes\s*$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    if section is None:
        raise ValueError("the glossary has no '## Sizes' section")
    names = []
    for line in section.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if not cells or set(cells[0]) <= set("-: ") or cells[0] == "name":
            continue  # not a table row, the separator, or the header
        names += re.findall(r"`([^`]+)`", cells[0])
    if not names:
        raise ValueError("the glossary's '## Sizes' section has no table")
    return names


def shape_names(source: str, filename: str = "<source>") -> dict[str, list[str]]:
    """The dimension names a source's shape checks bind, ``name -> ["file:line", ...]``: the strings in the shape
    argument (the third) of every ``*.tensor(...)`` call, and the keyword names of every ``Dims(...)`` call. Names
    built at run time (f-strings, a prefix added to a name) and fixed sizes (ints) are not names and are skipped."""
    found: dict[str, list[str]] = {}

    def add(name: str, node: ast.AST) -> None:
        found.setdefault(name, []).append(f"{filename}:{node.lineno}")

    def strings(node: ast.AST) -> Iterable[ast.Constant]:
        if isinstance(node, ast.JoinedStr):
            return  # an f-string: built at run time
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node
            return
        for child in ast.iter_child_nodes(node):
            yield from strings(child)

    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "tensor":
            shapes = node.args[2:3] or [k.value for k in node.keywords if k.arg == "shape"]
            for const in (c for shape in shapes for c in strings(shape)):
                add(const.value, const)
        elif isinstance(func, ast.Name) and func.id == "Dims":
            for kw in node.keywords:
                if kw.arg is not None:
                    add(kw.arg, kw)
                elif isinstance(kw.value, ast.Dict):  # Dims(**{"H_q*D_v": ...})
                    for key in kw.value.keys:
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            add(key.value, key)
    return found


def unknown_names(used: dict[str, list[str]], glossary: Iterable[str]) -> dict[str, list[str]]:
    """The used names (a product ``A*B`` counts as its factors) the glossary does not define, with where."""
    known = set(glossary)
    return {name: where for name, where in used.items() if any(part not in known for part in name.split("*"))}


def forbidden_parameters(functions: Iterable[tuple[str, Callable]]) -> list[str]:
    """``"qualname(parameter)"`` for every parameter of ``functions`` named like :data:`FORBIDDEN_PARAMETERS`."""
    bad = []
    for qualname, fn in functions:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        bad += [f"{qualname}({p})" for p in params if p in FORBIDDEN_PARAMETERS]
    return bad


def public_spec_functions() -> list[tuple[str, Callable]]:
    """Every public function of every ``mlaspec.spec`` module, and the public methods of its public classes."""
    out = []
    for info in pkgutil.iter_modules(mlaspec.spec.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"mlaspec.spec.{info.name}")
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                out.append((f"{module.__name__}.{name}", obj))
            elif inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                    if not attr.startswith("_") and inspect.isfunction(fn):
                        out.append((f"{module.__name__}.{name}.{attr}", fn))
    return out


# -- the project's checks ----------------------------------------------------------------------------------------------
def test_every_dimension_the_spec_checks_is_in_the_glossary():
    used: dict[str, list[str]] = {}
    for path in sorted(SPEC.glob("*.py")):
        for name, where in shape_names(path.read_text(), path.name).items():
            used.setdefault(name, []).extend(where)
    assert len(used) > 20, sorted(used)  # the reader found the spec's checks
    missing = unknown_names(used, size_names(GLOSSARY.read_text()))
    assert not missing, f"dimension names the glossary's size table lacks (add them, or use its names): {missing}"


def test_the_glossary_names_each_size_once():
    names = size_names(GLOSSARY.read_text())
    assert {"B", "S_q", "H_q", "D_nope", "D_rope", "D_v", "Lkv", "P", "NB"} <= set(names)
    assert "scale" not in names  # the arguments table is not read as sizes
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_no_spec_function_spells_the_scale_or_the_output_width_another_way():
    functions = public_spec_functions()
    assert any(q == "mlaspec.spec.sparse.sparse_decode" for q, _ in functions)  # the walk reaches the spec
    assert any(q == "mlaspec.spec.indexer.IndexerCacheLayout.empty" for q, _ in functions)  # and its methods
    bad = forbidden_parameters(functions)
    assert not bad, f"spec parameters named otherwise than the glossary ({FORBIDDEN_PARAMETERS}): {bad}"


# -- the readers themselves, on synthetic input: each check can fail ---------------------------------------------------
SYNTHETIC_SOURCE = textwrap.dedent(
    """
    def f(q, x, cache, prefix):
        dims = Dims(H_q=4, **{"H_q*D_v": 8})
        dims.tensor("q", q, ("B", "S_q", 4, None), FLOAT)
        Dims().tensor("x", x, ("T",) + (None,) * (x.dim() - 2) + ("D_rope",), FLOAT)
        dims.tensor("cache", cache, (f"{prefix}NB", "P", layout.entry_dim), FLOAT)
        dims.tensor("q", q, shape=("Q",))
        other.tensor("not a shape check")
        torch.tensor([1, 2])
        return dims["B"]
    """
)

SYNTHETIC_GLOSSARY = textwrap.dedent(
    """
    # Glossary

    ## Sizes

    | name | meaning |
    |---|---|
    | `B` | requests |
    | `S_q`, `T` | query tokens; tokens |
    | `H_q` | heads |

    ## Arguments

    | name | meaning |
    |---|---|
    | `scale` | the softmax scale |
    """
)


def test_shape_names_reads_the_shape_argument_and_the_dims_keywords():
    used = shape_names(SYNTHETIC_SOURCE, "f.py")
    assert set(used) == {"H_q", "H_q*D_v", "B", "S_q", "T", "D_rope", "P", "Q"}
    assert used["B"] == ["f.py:4"] and used["H_q"] == ["f.py:3"]


def test_size_names_reads_only_the_size_table():
    assert size_names(SYNTHETIC_GLOSSARY) == ["B", "S_q", "T", "H_q"]


def test_unknown_names_catches_a_name_and_a_product_factor_outside_the_glossary():
    used = shape_names(SYNTHETIC_SOURCE, "f.py")
    missing = unknown_names(used, size_names(SYNTHETIC_GLOSSARY))
    assert set(missing) == {"H_q*D_v", "D_rope", "P", "Q"} and missing["P"] == ["f.py:6"]
    assert not unknown_names({"H_q*T": ["f.py:1"], "B": ["f.py:2"]}, size_names(SYNTHETIC_GLOSSARY))


def test_forbidden_parameters_catches_every_other_spelling():
    def decode(q, kv, *, softmax_scale=None, head_dim_v=512):
        return q

    def prefill(q, kv, indices, sm_scale, d_v=512):
        return q

    def good(q, kv, *, scale, d_v=512):
        return q

    found = forbidden_parameters([("decode", decode), ("prefill", prefill), ("good", good), ("len", len)])
    assert found == ["decode(softmax_scale)", "decode(head_dim_v)", "prefill(sm_scale)"]
