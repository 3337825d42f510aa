"""The report: a summary table for the terminal and one self-contained HTML page (figures embedded, no network).

Both are built from ``results.jsonl`` alone (or the per-worker ``results-<worker>.jsonl`` files of a sharded pytest
run, merged), so a report can be rebuilt after a crash: ``mlaspec report DIR``.
"""

from __future__ import annotations

import base64
import html
import importlib.metadata
import json
import math
import platform
import warnings
from pathlib import Path

from .verdict import FAILED, Result, format_failure

__all__ = [
    "HEADER",
    "compact_summary",
    "environment",
    "header_line",
    "load_results",
    "load_run",
    "read_jsonl",
    "skips_by_reason",
    "summary_table",
    "write_html",
]


def environment() -> dict[str, str]:
    """Where the run happened: versions and the device."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = str(torch.version.cuda)
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):  # its metadata: importing triton takes 0.4 s
        try:
            env["triton"] = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return env


def _curated_rank() -> dict[str, int]:
    from .cases import curated_cases

    return {c.id: i for i, c in enumerate(curated_cases(dtypes=("bfloat16", "float16", "float32")))}


HEADER = "mlaspec_run"
"""The key of a results file's first line: ``{"mlaspec_run": {"backend", "version", "environment", "planned"}}``,
written before any case runs, so a run that dies still says what it was asked to do."""


def header_line(backend: str, version: str, env: dict, planned: list[str]) -> str:
    """The first line of a ``results.jsonl``: the backend, its version, the environment and the planned case ids."""
    return json.dumps({HEADER: dict(backend=backend, version=version, environment=env, planned=planned)})


def read_jsonl(path: Path) -> tuple[dict | None, list[dict]]:
    """``(header, verdict records)`` of one results file. A line that is not complete JSON (the last line of a run
    killed while writing it) is skipped with a warning; a file written before headers existed has none."""
    header, records = None, []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            warnings.warn(
                f"{path}:{n}: skipped a line that is not complete JSON (a run killed mid-line?)", stacklevel=2
            )
            continue
        if HEADER in record:
            header = record[HEADER]
        else:
            records.append(record)
    return header, records


def load_run(out_dir: Path) -> tuple[list[dict], list[Result]]:
    """The headers and the verdicts in ``out_dir/results.jsonl``, or merged from every ``results*.jsonl`` there (one
    per pytest-xdist worker: ``results-gw0.jsonl``, ...) in the curated order, generated cases after the curated
    ones."""
    files = sorted(Path(out_dir).glob("results*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no results.jsonl (or results-<worker>.jsonl) in {out_dir}")
    headers, results = [], []
    for f in files:
        header, records = read_jsonl(f)
        headers += [header] if header else []
        results += [Result.from_json(r) for r in records]
    if len(files) > 1:
        rank = _curated_rank()
        results.sort(key=lambda r: rank.get(r.case_id, len(rank)))  # stable: generated cases keep their order
    return headers, results


def load_results(out_dir: Path) -> list[Result]:
    """The verdicts of :func:`load_run`."""
    return load_run(out_dir)[1]


def _worst(r: Result) -> tuple[str, str]:
    ratios = [m for m in r.metrics if m.name in ("max_error/bound", "nonfinite_mismatch")]
    if not ratios:
        return "-", "-"
    m = max(ratios, key=lambda m: m.value / (m.bound or 1))
    return f"{m.output} {m.value:.3g}", "1" if m.name == "max_error/bound" else "exact"


def _assumed(r: Result) -> str:
    """The declared numerics a verdict assumed, as a prefix of its reason (empty under the exact spec)."""
    return f"[numerics: {', '.join(r.numerics)}] " if r.numerics else ""


def summary_table(results: list[Result]) -> str:
    """Plain-text table: op, case, worst error/bound, bound, verdict; then the counts."""
    rows = [("op", "case", "worst error/bound", "bound", "verdict")]
    for r in results:
        rows.append((r.op, r.case_id.split("[", 1)[1].rstrip("]"), *_worst(r), r.verdict.upper()))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(verdict_counts(results))
    return "\n".join(lines)


def compact_summary(results: list[Result]) -> str:
    """The verdict counts, then the skips counted by reason (most frequent first): what a run says at its end
    when the per-case table is not asked for (``mlaspec check --verbose``)."""
    lines = [verdict_counts(results)]
    lines += [f"  skipped {len(ids):>4}: {reason}" for reason, ids in skips_by_reason(results).items()]
    return "\n".join(lines)


def skips_by_reason(results: list[Result]) -> dict[str, list[str]]:
    """``reason -> the ids of the cases skipped for it``, the most frequent reason first."""
    by_reason: dict[str, list[str]] = {}
    for r in results:
        if r.verdict == "skip":
            by_reason.setdefault(r.reason, []).append(r.case_id)
    return dict(sorted(by_reason.items(), key=lambda kv: -len(kv[1])))


_COUNTED = {"pass": "passed", "fail": "failed", "error": "errors", "crash": "crashed", "timeout": "timed out"}


def verdict_counts(results: list[Result]) -> str:
    """``"3 passed, 1 failed, 0 errors, 2 skipped"`` (crashes and timeouts named only when there are some)."""
    shown = [v for v in _COUNTED if v in ("pass", "fail", "error") or any(r.verdict == v for r in results)]
    counts = [f"{sum(r.verdict == v for r in results)} {_COUNTED[v]}" for v in shown]
    return ", ".join([*counts, f"{sum(r.verdict == 'skip' for r in results)} skipped"])


def _img(path: str, alt: str = "error heat map") -> str:
    p = Path(path)
    if not path or not p.exists():
        return ""
    data = base64.b64encode(p.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _pictures(r: Result) -> str:
    """The heat map, then the op's pictures (named after the file: ``<case>.<picture>.png``)."""
    imgs = [_img(r.figure)] + [_img(f, Path(f).stem.rsplit(".", 1)[-1].replace("_", " ")) for f in r.figures]
    return "".join(i for i in imgs if i)


def _retried(r: Result) -> str:
    first = r.retried.splitlines()[0] if r.retried else ""
    return f" [ran again alone: beside the warm-up workers it first gave {first}]" if first else ""


def _failure_markup(r: Result) -> str:
    """The text of :func:`~mlaspec.conformance.verdict.format_failure`, escaped, the reproducer in
    ``<code class="repro">``."""
    text = html.escape(format_failure(r))
    repro = html.escape(r.repro)
    if not repro:
        return text
    head, _, tail = text.rpartition(repro)
    return f'{head}<code class="repro">{repro}</code>{tail}'


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}th{background:#f3f3f3}.pass{color:#17752a}
.fail,.error,.crash,.timeout{color:#b00020;font-weight:bold}.skip{color:#777}code{background:#f5f5f5;padding:2px 4px}
section{border-top:2px solid #b00020;margin-top:2em}img{max-width:100%}
pre.failure{white-space:pre-wrap}"""


def _skips(results: list[Result]) -> str:
    """The skipped cases as one row per reason: how many, the reason, and the first few case ids."""
    by_reason = skips_by_reason(results)
    if not by_reason:
        return ""
    rows = "".join(
        f"<tr><td>{len(ids)}</td><td>{html.escape(reason)}</td><td>{html.escape(', '.join(ids[:3]))}"
        f"{' ...' if len(ids) > 3 else ''}</td></tr>"
        for reason, ids in by_reason.items()
    )
    return f"<h2>Skipped, by reason</h2><table><tr><th>cases</th><th>reason</th><th>e.g.</th></tr>{rows}</table>"


def write_html(
    results: list[Result], out_dir: Path, *, backend: str, version: str = "", env: dict | None = None
) -> Path:
    """Write ``out_dir/report.html`` and return its path."""
    env = env or {}
    esc = html.escape
    head = "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(str(v))}</td></tr>"
        for k, v in {"backend": backend, "version": version, **env}.items()
    )
    rows = []
    # the failures first, then the passes; the skips are counted by reason below the table, not listed one by one
    shown = [r for r in results if r.verdict in FAILED] + [r for r in results if r.verdict == "pass"]
    for r in shown:
        worst, bound = _worst(r)
        link = f'<a href="#{esc(r.case_id)}">{esc(r.case_id)}</a>' if r.verdict in FAILED else esc(r.case_id)
        rows.append(
            f"<tr><td>{esc(r.op)}</td><td>{link}</td><td>{esc(worst)}</td><td>{bound}</td>"
            f'<td class="{r.verdict}">{r.verdict.upper()}</td><td>{esc(_assumed(r) + r.reason + _retried(r))}</td></tr>'
        )
    failures = []
    for r in results:
        if r.verdict not in FAILED:
            continue
        metrics = "".join(
            f"<li>{esc(m.output)} {esc(m.name)} = {m.value:.4g} (bound {m.bound:.4g})</li>"
            for m in r.metrics
            if math.isfinite(m.bound)  # a statistic no bound enforces is not shown as if one did
        )
        failures.append(
            f'<section id="{esc(r.case_id)}"><h3>{esc(r.case_id)}: {r.verdict.upper()}</h3>'
            f'<pre class="failure">{_failure_markup(r)}</pre><ul>{metrics}</ul>{_pictures(r)}</section>'
        )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>mlaspec report: {esc(backend)}</title>
<style>{CSS}</style></head><body><h1>mlaspec conformance report</h1><table>{head}</table>
<h2>Summary: {verdict_counts(results)}</h2>
<table><tr><th>op</th><th>case</th><th>worst error/bound</th><th>bound</th><th>verdict</th><th>reason</th></tr>
{"".join(rows)}</table>{_skips(results)}{"".join(failures)}</body></html>"""
    path = Path(out_dir) / "report.html"
    path.write_text(page)
    return path
