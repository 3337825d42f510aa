"""The architecture as tests: which package may import which, and which packages a regular install ships.

``mlaspec`` is three packages, each a top-level folder (``pyproject.toml``: ``[tool.setuptools] package-dir``):
``spec`` (the definitions), ``impl`` (the Triton kernels and their host launchers, which implement the spec) and
``conformance`` (the harness, which judges any implementation against the spec, ``impl`` through its adapter). The
import rules, read from the source (``ast``) of every ``.py`` under the three folders, imports inside functions
(lazy ones) included:

(a) ``spec`` imports nothing of ``mlaspec.impl`` or ``mlaspec.conformance``, and its relative imports resolve inside
    ``mlaspec.spec``;
(b) ``impl`` imports only public names of ``mlaspec.spec`` and nothing of ``mlaspec.conformance``;
(c) ``conformance`` imports ``mlaspec.impl`` only in ``conformance/backends/triton/`` (the triton adapter);
(d) no module imports another package's private module or name (a dotted component after the package that starts
    with ``_``, dunders aside);
(e) the package-level import graph has no cycle.

A violation names the file, the line, the rule and the import. The checker is tested on synthetic sources too, so
that a rule that could never fail would be seen.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
FOLDERS = {folder: package for package, folder in PYPROJECT["package-dir"].items()}  # "spec" -> "mlaspec.spec"
PACKAGES = tuple(FOLDERS.values())
SPEC, IMPL, CONFORMANCE = "mlaspec.spec", "mlaspec.impl", "mlaspec.conformance"
TRITON_ADAPTER = "conformance/backends/triton/"


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # the absolute dotted name imported: a module, or a name in one
    relative: bool


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: rule ({self.rule}) {self.message}"


def module_of(path: str) -> tuple[str, bool]:
    """The dotted module name of ``path`` (relative to the repository root) and whether it is a package's
    ``__init__``."""
    parts = Path(path).with_suffix("").parts
    if parts[0] not in FOLDERS:
        raise ValueError(f"{path} lies in none of the package folders {', '.join(FOLDERS)}")
    is_init = parts[-1] == "__init__"
    return ".".join((FOLDERS[parts[0]], *parts[1 : len(parts) - is_init])), is_init


def package_of(name: str) -> str | None:
    """Which of the three packages ``name`` lies in (None: another module, or the namespace ``mlaspec`` itself)."""
    return next((p for p in PACKAGES if name == p or name.startswith(p + ".")), None)


def imports_of(source: str, path: str) -> list[Import]:
    """Every import of ``source`` (module level, in functions and classes alike), resolved to absolute names.

    ``from X import a, b`` yields ``X`` (unless it is the namespace ``mlaspec``) and ``X.a``, ``X.b``: a name may be
    a module or an attribute, and either way it belongs to ``X``'s package.
    """
    module, is_init = module_of(path)
    package = module if is_init else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name, False) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                if node.level - 1 > len(parts) - 1:
                    found.append(Import(node.lineno, "." * node.level + base, True))  # beyond mlaspec: no package
                    continue
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            if base != "mlaspec":
                found.append(Import(node.lineno, base, bool(node.level)))
            found += [Import(node.lineno, f"{base}.{a.name}", bool(node.level)) for a in node.names if a.name != "*"]
    return found


def _private(name: str, package: str) -> str | None:
    """The first component of ``name`` after ``package`` that is private (``_x``, not a dunder), if any."""
    for part in name[len(package) + 1 :].split("."):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            return part
    return None


def check_source(source: str, path: str) -> list[Violation]:
    """The rules (a) to (d) on one file; ``path`` is relative to the repository root (``spec/x.py``)."""
    module, _ = module_of(path)
    own = package_of(module)
    out = []
    seen = set()
    for imp in imports_of(source, path):
        target, pkg = imp.target, package_of(imp.target)

        def flag(rule: str, message: str, imp=imp) -> None:
            if (imp.line, rule) not in seen:  # one per import statement and rule
                seen.add((imp.line, rule))
                out.append(Violation(path, imp.line, rule, f"{message}: imports {imp.target}"))

        if own == SPEC:
            if pkg in (IMPL, CONFORMANCE):
                flag("a", f"spec imports nothing of {pkg}")
            if imp.relative and pkg != SPEC:
                flag("a", "spec's relative imports resolve inside mlaspec.spec")
        if own == IMPL:
            if pkg == CONFORMANCE:
                flag("b", "impl imports nothing of mlaspec.conformance")
            if pkg == SPEC and _private(target, SPEC):
                flag("b", f"impl imports only public names of mlaspec.spec, not {_private(target, SPEC)}")
        if own == CONFORMANCE and pkg == IMPL and not path.startswith(TRITON_ADAPTER):
            flag("c", f"conformance imports mlaspec.impl only in {TRITON_ADAPTER} (the triton adapter)")
        if pkg is not None and pkg != own and _private(target, pkg):
            flag("d", f"no module imports another package's private module or name ({_private(target, pkg)})")
    return out


def package_edges(sources: dict[str, str]) -> dict[tuple[str, str], tuple[str, int]]:
    """``(importer's package, imported package) -> (file, line)`` of one import that makes the edge."""
    edges = {}
    for path, source in sources.items():
        own = package_of(module_of(path)[0])
        for imp in imports_of(source, path):
            pkg = package_of(imp.target)
            if pkg is not None and pkg != own:
                edges.setdefault((own, pkg), (path, imp.line))
    return edges


def find_cycle(edges) -> list[str] | None:
    """A cycle of the directed graph ``edges`` (pairs), as the list of its nodes, first repeated last; or None."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def cycle_violations(sources: dict[str, str]) -> list[Violation]:
    """Rule (e): one violation per edge of a cycle of the package graph, at an import that makes the edge."""
    edges = package_edges(sources)
    cycle = find_cycle(edges)
    if cycle is None:
        return []
    loop = " -> ".join(cycle)
    return [
        Violation(*edges[(a, b)], "e", f"no import cycle between the packages: {a} imports {b} in the cycle {loop}")
        for a, b in zip(cycle, cycle[1:])
    ]


def repository_sources() -> dict[str, str]:
    return {
        path.relative_to(ROOT).as_posix(): path.read_text()
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


# -- the repository follows the rules --------------------------------------------------------------------------------
def test_every_module_follows_the_import_rules():
    sources = repository_sources()
    assert len(sources) > 50 and all(any(p.startswith(f + "/") for p in sources) for f in FOLDERS)
    violations = [v for path, source in sources.items() for v in check_source(source, path)]
    violations += cycle_violations(sources)
    assert not violations, "import rules broken:\n" + "\n".join(map(str, violations))


def test_the_package_graph_is_the_layering():
    """spec <- impl <- conformance, and conformance -> spec: nothing else (and so no cycle)."""
    edges = set(package_edges(repository_sources()))
    assert edges == {(IMPL, SPEC), (CONFORMANCE, SPEC), (CONFORMANCE, IMPL)}
    assert find_cycle(edges) is None


def test_the_triton_adapter_is_the_only_bridge_to_impl():
    bridges = {
        path
        for path, source in repository_sources().items()
        if path.startswith("conformance/") and any(package_of(i.target) == IMPL for i in imports_of(source, path))
    }
    assert bridges and all(p.startswith(TRITON_ADAPTER) for p in bridges), bridges


# -- the checker can fail ----------------------------------------------------------------------------------------
SYNTHETIC = [
    # (file, source, the rule that must fire, at which line)
    ("spec/x.py", "import torch\nfrom mlaspec.impl.decode import mla_decode_paged\n", "a", 2),
    ("spec/x.py", "def f():\n    from mlaspec.conformance import cases\n", "a", 2),  # a lazy import counts
    ("spec/x.py", "from .. import impl\n", "a", 1),  # a relative import that leaves spec
    ("spec/sub/x.py", "from ...conformance.cases import Case\n", "a", 1),
    ("spec/x.py", "import mlaspec.conformance.cli as cli\n", "a", 1),
    ("impl/x.py", "from mlaspec.spec._checks import Dims\n", "b", 1),  # a private module of spec
    ("impl/x.py", "from mlaspec.spec.sparse import _valid\n", "b", 1),  # a private name of spec
    ("impl/x.py", "from mlaspec.spec import _checks\n", "b", 1),
    ("impl/x.py", "class K:\n    def f(self):\n        import mlaspec.conformance.runner\n", "b", 3),
    ("impl/x.py", "from ..conformance import cases\n", "b", 1),
    ("conformance/runner.py", "from mlaspec.impl.decode import page_cache\n", "c", 1),
    ("conformance/backends/flashmla.py", "def f():\n    from mlaspec.impl import sparse\n", "c", 2),
    ("conformance/ops/x.py", "from mlaspec.spec._checks import Dims\n", "d", 1),
    ("conformance/backends/triton/x.py", "from mlaspec.impl.decode import _num_sms\n", "d", 1),
    ("conformance/x.py", "import mlaspec.spec._private.helpers\n", "d", 1),
]


@pytest.mark.parametrize(
    "path, source, rule, line", SYNTHETIC, ids=[f"{r}-{i}" for i, (_, _, r, _) in enumerate(SYNTHETIC)]
)
def test_the_checker_catches_a_broken_rule(path, source, rule, line):
    violations = check_source(source, path)
    hit = [v for v in violations if v.rule == rule and v.line == line]
    assert hit, violations
    text = str(hit[0])
    assert text.startswith(f"{path}:{line}: rule ({rule}) ") and "imports mlaspec" in text


ALLOWED = [
    ("spec/x.py", "from .attention import attention\nfrom . import checks\nimport torch\n"),
    ("spec/sub/x.py", "from ..checks import Dims\n"),
    ("impl/x.py", "from mlaspec.spec import cache_layouts as cl\nfrom mlaspec.spec.checks import Dims\n"),
    ("impl/x.py", "from .decode import _num_sms\n"),  # a private name of its own package
    ("conformance/backends/triton/x.py", "from mlaspec.impl.decode import page_cache\nimport triton\n"),
    ("conformance/ops/x.py", "from .dense import _absorbed_bounds\nfrom mlaspec.spec.sparse import sparse_decode\n"),
    ("conformance/x.py", "from mlaspec.spec import __version__\n"),  # a dunder is not private
]


@pytest.mark.parametrize("path, source", ALLOWED, ids=[str(i) for i in range(len(ALLOWED))])
def test_the_checker_allows_what_the_rules_allow(path, source):
    assert check_source(source, path) == []


def test_relative_imports_resolve_against_the_package():
    assert [i.target for i in imports_of("from .dense import f\n", "conformance/backends/triton/layer.py")] == [
        "mlaspec.conformance.backends.triton.dense",
        "mlaspec.conformance.backends.triton.dense.f",
    ]
    init = imports_of("from .dense import f\nfrom .. import common\n", "conformance/backends/triton/__init__.py")
    assert [i.target for i in init] == [
        "mlaspec.conformance.backends.triton.dense",
        "mlaspec.conformance.backends.triton.dense.f",
        "mlaspec.conformance.backends",
        "mlaspec.conformance.backends.common",
    ]


def test_the_cycle_check_fails_on_a_cycle():
    sources = {
        "spec/a.py": "import torch\n",
        "impl/b.py": "from mlaspec.spec import a\n",
        "conformance/c.py": "from mlaspec.spec import a\n",
        "spec/d.py": "\n\ndef lazy():\n    from mlaspec.impl import b\n",  # spec -> impl, lazily: a cycle
    }
    violations = cycle_violations(sources)
    assert {(v.path, v.line) for v in violations} == {("spec/d.py", 4), ("impl/b.py", 1)}
    assert all(v.rule == "e" and "mlaspec.spec -> mlaspec.impl -> mlaspec.spec" in v.message for v in violations)
    assert find_cycle({("a", "b"), ("b", "c"), ("c", "a")}) == ["a", "b", "c", "a"]
    assert find_cycle({("a", "b"), ("b", "c"), ("a", "c")}) is None
    del sources["spec/d.py"]
    assert cycle_violations(sources) == []


# -- the packages a regular install ships -----------------------------------------------------------------------
def shipped_mismatch(packages: list[str], package_dir: dict[str, str], root: Path) -> tuple[set[str], set[str]]:
    """``(folders with an __init__.py not listed, listed packages with no such folder)``: a regular (non-editable)
    install ships only the listed packages, from the folders ``package_dir`` maps them to."""
    on_disk = set()
    for package, folder in package_dir.items():
        for init in (root / folder).rglob("__init__.py"):
            on_disk.add(".".join((package, *init.parent.relative_to(root / folder).parts)))
    return on_disk - set(packages), set(packages) - on_disk


def test_every_package_folder_is_listed_in_pyproject_and_vice_versa():
    unlisted, missing = shipped_mismatch(PYPROJECT["packages"], PYPROJECT["package-dir"], ROOT)
    assert not unlisted, f"folders with an __init__.py not in pyproject's [tool.setuptools] packages: {unlisted}"
    assert not missing, f"pyproject's [tool.setuptools] packages with no folder holding an __init__.py: {missing}"


def test_the_shipped_check_fails_both_ways(tmp_path):
    for folder in ("top", "top/sub", "top/data"):
        (tmp_path / folder).mkdir()
    (tmp_path / "top" / "__init__.py").write_text("")
    (tmp_path / "top" / "sub" / "__init__.py").write_text("")
    listed = ["mlaspec.top", "mlaspec.top.sub"]
    assert shipped_mismatch(listed, {"mlaspec.top": "top"}, tmp_path) == (set(), set())
    assert shipped_mismatch(listed[:1], {"mlaspec.top": "top"}, tmp_path) == ({"mlaspec.top.sub"}, set())
    assert shipped_mismatch([*listed, "mlaspec.top.data"], {"mlaspec.top": "top"}, tmp_path) == (
        set(),
        {"mlaspec.top.data"},  # a folder without __init__.py is no package
    )
