"""The mutation corpus as a whole: every mutant names the real report its bug class comes from and the shapes that
expose it, the corpus is large enough, and docs/mutants.md lists exactly it (``python tests/test_mutation_corpus.py``
rewrites the page). That the default run kills each mutant is asserted by the corpus files themselves
(``tests/test_mutants_dense.py``, ``test_mutants_serving.py``, ``test_mutants_sparse.py``)."""

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

from mlaspec.conformance.ops import OPS

HERE = Path(__file__).parent
DOC = HERE.parent / "docs" / "mutants.md"
FILES = ("test_mutants_dense.py", "test_mutants_serving.py", "test_mutants_sparse.py", "test_mutants_dcp.py")
START, END = "<!-- MUTANTS START -->\n", "<!-- MUTANTS END -->"


def _module(name: str):
    if name[:-3] in sys.modules:
        return sys.modules[name[:-3]]
    spec = importlib.util.spec_from_file_location(name[:-3], HERE / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name[:-3]] = module
    spec.loader.exec_module(module)
    return module


def _pairs(module) -> list[tuple[type, str | None]]:
    """``(mutant, op or case id or None)`` from a corpus file's ``MUTANTS`` (and ``MUTANT_CASES``, where it has one)."""
    out = []
    for item in [*module.MUTANTS, *getattr(module, "MUTANT_CASES", [])]:
        item = getattr(item, "values", item)  # pytest.param
        out.append((item, None) if isinstance(item, type) else (item[0], item[1]))
    return out


def corpus() -> list[tuple[str, type]]:
    """``(file, mutant class)`` for every mutant of every corpus file, in file order."""
    seen: dict[type, str] = {}
    for f in FILES:
        for cls, _ in _pairs(_module(f)):
            seen.setdefault(cls, f)
    return [(f, cls) for cls, f in seen.items()]


def _ops(cls: type) -> list[str]:
    """The ops a mutant breaks: those it overrides, and those its file pairs it with (a mutant of a shared helper)."""
    ops = {name for c in cls.__mro__ if c.__module__ == cls.__module__ for name in vars(c) if name in OPS}
    ops |= {x.split("[")[0] for c, x in _pairs(sys.modules[cls.__module__]) if c is cls and isinstance(x, str)}
    return sorted(ops & set(OPS))


def _summary(cls: type) -> str:
    return " ".join(inspect.getdoc(cls).split("\n\n")[0].split()).replace("|", "\\|")


def page_table() -> str:
    rows = corpus()
    shaped = sum(bool(cls.shapes) for _, cls in rows)
    lines = [
        f"**{len(rows)} mutants, {shaped} of them visible only on particular shapes; the default run kills all "
        f"{len(rows)}** (CI: `tests/test_mutants_*.py`).",
        "",
        "| mutant | op | bug | shapes that expose it | seen in |",
        "|---|---|---|---|---|",
    ]
    for _, cls in rows:
        ops = ", ".join(f"`{o}`" for o in _ops(cls)) or "—"
        shapes = cls.shapes.replace("|", "\\|") or "any"
        lines.append(f"| `{cls.__name__}` | {ops} | {_summary(cls)} | {shapes} | <{cls.source}> |")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def mutants():
    return corpus()


def test_the_corpus_is_large_and_shape_aware(mutants):
    assert len(mutants) >= 80
    assert sum(bool(cls.shapes) for _, cls in mutants) >= 20
    assert len({cls.__name__ for _, cls in mutants}) == len(mutants), "two mutants share a name"


def test_every_mutant_cites_a_real_report_and_its_shapes(mutants):
    for _, cls in mutants:
        assert isinstance(vars(cls).get("source"), str) and cls.source.startswith("https://"), cls.__name__
        assert isinstance(cls.shapes, str), cls.__name__
        assert inspect.getdoc(cls), cls.__name__


def test_every_mutant_overrides_an_op(mutants):
    assert all(_ops(cls) for _, cls in mutants), [cls.__name__ for _, cls in mutants if not _ops(cls)]


def test_no_mutant_waits_for_a_check_that_exists(mutants):
    """The statistical checks are on: a mutant marked ``needs = "statistics"`` must be killed like any other."""
    assert not [cls.__name__ for _, cls in mutants if getattr(cls, "needs", "") == "statistics"]


def test_the_docs_page_lists_the_corpus():
    page = DOC.read_text()
    assert page.split(START)[1].split(END)[0] == page_table(), "stale: python tests/test_mutation_corpus.py"


if __name__ == "__main__":
    text = DOC.read_text()
    head, rest = text.split(START)
    DOC.write_text(head + START + page_table() + END + rest.split(END, 1)[1])
    print(f"wrote {DOC}: {len(corpus())} mutants")
