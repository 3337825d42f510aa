"""The docs site's formulas render on a machine without internet.

``mkdocs build --strict`` builds the whole site (6-10 s on 2 busy cores), a local server serves it on 127.0.0.1, and
headless Chromium, to which every other host is unreachable, opens each page that has math (the chapters' arithmatex
formulas, the notebooks' ``$`` math). On each, MathJax must have loaded from the site itself (docs/hooks/mathjax.py
copies the pinned npm package in) and typeset every formula: each arithmatex element holds an ``mjx-container``, no raw
TeX (``$``, ``\\(``, ``\\command{``) is left in the visible text, and no formula's MathML holds an error or a backslash
shown as text (``\\texttt{kv\\_c\\_normed}`` without MathJax's ``textmacros`` shows ``kv\\_c\\_normed``). Skips
where Chromium, the docs extra or the npm package is absent (the README's test command installs neither of the last
two), except under ``MLASPEC_REQUIRE_DOCS=1`` (CI), where it fails; its DevTools client is ``test_report_browser.py``'s.
"""

import contextlib
import functools
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.test_report_browser import CHROMIUM, DevTools

ROOT = Path(__file__).resolve().parents[1]


def _missing_toolchain() -> str | None:
    """Why the docs cannot be built and opened here (Chromium, the docs extra, the npm package), or None."""
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is absent (apt-get install chromium)"
    if importlib.util.find_spec("mkdocs") is None:
        return "the docs extra is not installed (pip install -e '.[docs]')"
    if not (ROOT / "node_modules" / "mathjax").is_dir():
        return "the pinned MathJax package is not installed (npm ci)"
    return None


# The README's test command installs neither the docs extra nor MathJax: skipped there with the reason. CI installs
# both and sets MLASPEC_REQUIRE_DOCS=1, where a missing piece fails instead of skipping.
if _missing_toolchain() and os.environ.get("MLASPEC_REQUIRE_DOCS") == "1":
    raise RuntimeError(f"MLASPEC_REQUIRE_DOCS=1 but {_missing_toolchain()}")
pytestmark = pytest.mark.skipif(_missing_toolchain() is not None, reason=str(_missing_toolchain()))
# The network off: every request goes to a proxy at the discard port, where nothing listens, and no name resolves.
# Chromium never proxies loopback addresses, so the local server stays reachable.
OFFLINE = ("--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")

# Waits for MathJax's typesetting and reports what a reader sees; null where MathJax never loaded. Raw TeX is a ``$``,
# a ``\(`` or ``\[``, or a ``\command{`` in the text outside code and typeset math.
MATH_ON_PAGE = r"""(async () => {
  if (!(window.MathJax && MathJax.startup && MathJax.startup.promise)) return null;
  await MathJax.startup.promise;
  const visible = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  while (walker.nextNode()) {
    const node = walker.currentNode;
    if (!node.parentElement.closest("pre, code, script, style, mjx-container")) visible.push(node.textContent);
  }
  const mml = Array.from(MathJax.startup.document.math, (item) => MathJax.startup.toMML(item.root));
  return {
    has_arithmatex: document.querySelector(".arithmatex") !== null,
    formulas: mml.length,
    untypeset: Array.from(document.querySelectorAll(".arithmatex"))
      .filter((e) => !e.querySelector("mjx-container")).map((e) => e.textContent.slice(0, 80)),
    raw: visible.join(" ").match(/\\[()[\]]|\$|\\[a-zA-Z]+\{/g) || [],
    errors: mml.filter((m) => m.includes("<merror")),
    backslashes_as_text: mml.flatMap((m) => m.match(/<mtext[^>]*>[^<]*\\[^<]*<\/mtext>/g) || []),
    offsite_scripts: Array.from(document.scripts, (s) => s.src)
      .filter((src) => src && new URL(src).origin !== location.origin),
  };
})()"""


def problems(math: dict | None) -> dict:
    """What is wrong with one page's math, by kind; empty where every formula rendered."""
    if math is None:
        return {"mathjax": "never loaded"}
    found = {k: v for k, v in math.items() if k not in ("has_arithmatex", "formulas") and v}
    if math["has_arithmatex"] and not math["formulas"]:
        found["formulas"] = 0
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The whole site, built as CI builds it."""
    site_dir = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, f"mkdocs build --strict failed (pip install -e '.[docs]' and npm ci):\n{build.stderr}"
    return site_dir


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # pytest shows a failing test's output: the requests are noise there
        pass


@contextlib.contextmanager
def serving(folder: Path) -> Iterator[str]:
    """``folder``'s root URL on a local server, while the context lasts."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def offline_browser(tmp_path) -> Iterator[DevTools]:
    b = DevTools(tmp_path / "chromium-profile", flags=OFFLINE)
    yield b
    b.close()


def pages_with_math(site: Path) -> list[str]:
    """Every built page that can hold a formula: arithmatex's markup, or a notebook's markdown cells."""
    return sorted(
        p.relative_to(site).as_posix()
        for p in site.rglob("index.html")
        if 'class="arithmatex"' in (text := p.read_text()) or "jp-RenderedMarkdown" in text
    )


def test_every_formula_renders_offline(site, offline_browser):
    pages = pages_with_math(site)
    assert "two_forms/index.html" in pages and len(pages) >= 8, pages
    found = {}

    def look(url: str) -> dict:
        offline_browser.events.clear()
        offline_browser.open(url)
        found = problems(offline_browser.evaluate(MATH_ON_PAGE))
        mathjax_errors = [e for e in offline_browser.console_errors() if "mathjax" in e.lower()]
        return found | ({"console": mathjax_errors} if mathjax_errors else {})

    with serving(site) as root:
        for page in pages:
            try:
                found[page] = look(root + page)
            except TimeoutError:  # Chromium stalled (CI once, on 2 busy cores): a fresh one, once; a page that
                offline_browser.restart()  # hangs it (MathJax never settling) times out again and fails
                found[page] = look(root + page)
    failing = {page: p for page, p in found.items() if p}
    assert not failing, "math that did not render offline:\n" + "\n".join(f"{k}: {v}" for k, v in failing.items())


# Pages of one formula, each broken in one way the site once was: MathJax from a CDN (offline it never loads), and
# MathJax from the site without mathjax-config.js (no textmacros: the identifier keeps its backslashes).
BROKEN = {
    "cdn": ("https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js", {"mathjax": "never loaded"}),
    "no-textmacros": (
        "js/mathjax/tex-mml-chtml.js",
        {"backslashes_as_text": ['<mtext mathvariant="monospace">kv\\_c\\_normed</mtext>']},
    ),
}


@pytest.mark.parametrize("name", BROKEN)
def test_the_checks_catch_a_broken_page(name, tmp_path, offline_browser):
    """The page served beside the MathJax package, as the site serves it (no build needed)."""
    script, expected = BROKEN[name]
    (tmp_path / "js").mkdir()
    (tmp_path / "js" / "mathjax").symlink_to(ROOT / "node_modules" / "mathjax" / "es5")
    (tmp_path / "broken.html").write_text(
        '<!doctype html><html><body><p><span class="arithmatex">\\(\\texttt{kv\\_c\\_normed}\\)</span></p>'
        f'<script src="{script}"></script></body></html>'
    )
    with serving(tmp_path) as root:
        offline_browser.open(root + "broken.html")
        assert problems(offline_browser.evaluate(MATH_ON_PAGE)) == expected


def test_a_build_without_mathjax_says_how_to_get_it(tmp_path):
    """The hook stops the build where ``node_modules/mathjax`` is missing, naming ``npm ci``."""
    from mkdocs.exceptions import PluginError  # the docs extra, like the build above

    spec = importlib.util.spec_from_file_location("mathjax_hook", ROOT / "docs" / "hooks" / "mathjax.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    config = SimpleNamespace(config_file_path=str(tmp_path / "mkdocs.yml"))
    with pytest.raises(PluginError, match="npm ci"):
        hook.es5_folder(config)
    assert hook.es5_folder(SimpleNamespace(config_file_path=str(ROOT / "mkdocs.yml"))).is_dir()
