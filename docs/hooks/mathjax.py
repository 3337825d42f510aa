"""MathJax served from the built site, not a CDN, so every formula renders on a machine without internet.

The package is pinned by the repository's ``package.json`` and ``package-lock.json`` (npm's ``mathjax`` 3.2.2, the
last MathJax 3) and installed by ``npm ci`` into ``node_modules/``; nothing of it is committed. This hook (mkdocs.yml,
``hooks:``) adds MathJax's entry script and the folders it loads from at run time (fonts, TeX extensions such as
``textmacros``, the menu, the accessibility and speech components) to the site under ``js/mathjax/``, where
mkdocs.yml's ``extra_javascript`` names the script. Without the package the build stops and says how to get it.
"""

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

SITE_FOLDER = "js/mathjax"
ENTRY = "tex-mml-chtml.js"  # TeX and MathML in, CommonHTML out: MathJax's default combined component


def es5_folder(config: MkDocsConfig) -> Path:
    """MathJax's browser build, ``node_modules/mathjax/es5`` beside mkdocs.yml; a ``PluginError`` saying how to get
    it where it is missing."""
    root = Path(config.config_file_path).parent
    es5 = root / "node_modules" / "mathjax" / "es5"
    if not (es5 / ENTRY).is_file():
        raise PluginError(
            f"MathJax is missing ({es5 / ENTRY} does not exist): the docs serve it from the site, not a CDN. "
            f"Install the pinned package with `npm ci` in {root} (package-lock.json; needs Node.js and npm, "
            "e.g. `apt-get install npm`), then build again."
        )
    return es5


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """Fail before the build when the package is missing or mkdocs.yml does not load the copy this hook serves."""
    es5_folder(config)
    script = f"{SITE_FOLDER}/{ENTRY}"
    if script not in [str(s) for s in config.extra_javascript]:
        raise PluginError(f"mkdocs.yml's extra_javascript must name {script}, the MathJax this hook serves")
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the entry script and every folder under ``es5/`` (what it loads at run time) to the site's files."""
    es5 = es5_folder(config)
    folders = (p for folder in es5.iterdir() if folder.is_dir() for p in folder.rglob("*") if p.is_file())
    for path in (es5 / ENTRY, *sorted(folders)):
        src_uri = path.relative_to(es5).as_posix()
        files.append(
            File(
                src_uri,
                str(es5),
                config.site_dir,
                config.use_directory_urls,
                dest_uri=f"{SITE_FOLDER}/{src_uri}",
            )
        )
    return files
