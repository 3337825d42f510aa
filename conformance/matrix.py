"""The conformance matrix: every curated case on every backend, one table (backend x op x case).

    mlaspec matrix --backends flashmla,deepgemm,flashinfer,vllm,torch_sdpa,torch,spec --scale full --out docs/matrix

runs the curated cases for each backend (a backend that cannot load -- library missing, no GPU -- is listed with
its reason and every case marked unavailable), streams each backend's verdicts to ``OUT/<backend>/results.jsonl``
(``mlaspec report OUT/<backend>`` rebuilds that backend's HTML report), and writes

* ``OUT/matrix.md``: the environment, a summary per backend, and the matrix -- one row per case, one column per
  backend, each cell the verdict and the worst ``|error| / bound`` -- then every failure and skip with its reason;
* ``OUT/matrix.json``: the same, machine-readable, with the environment (GPU, driver, CUDA, library versions).

The same command regenerates both; nothing else goes into them.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .backend import available_backends
from .cases import curated_cases
from .report import environment
from .runner import run_cases
from .verdict import FAILED, Result

__all__ = ["KNOWN_BACKENDS", "matrix_markdown", "merge_matrix", "merge_results_jsonl", "run_matrix", "write_matrix"]

# The adapters shipped in mlaspec.conformance.backends, found by name even before the entry points are installed.
KNOWN_BACKENDS = {
    "spec": "mlaspec.conformance.backends.reference:SpecBackend",
    "torch": "mlaspec.conformance.backends.torch_eager:TorchBackend",
    "torch_sdpa": "mlaspec.conformance.backends.torch_sdpa:TorchSDPABackend",
    "flashmla": "mlaspec.conformance.backends.flashmla:FlashMLABackend",
    "deepgemm": "mlaspec.conformance.backends.deepgemm:DeepGEMMBackend",
    "flashinfer": "mlaspec.conformance.backends.flashinfer:FlashInferBackend",
    "vllm": "mlaspec.conformance.backends.vllm:VLLMBackend",
}
PACKAGES = ("torch", "triton", "flashinfer-python", "vllm", "deep_gemm", "flash_mla")


def _resolve(name: str) -> str:
    return available_backends().get(name) or KNOWN_BACKENDS.get(name) or name


def matrix_environment() -> dict:
    """:func:`~mlaspec.conformance.report.environment` plus the GPU driver and the installed library versions."""
    env = dict(environment())
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        env["nvidia-smi"] = out.strip().splitlines()[0] if out.strip() else ""
    except Exception:  # no driver on a CPU machine
        pass
    for pkg in PACKAGES:
        with contextlib.suppress(PackageNotFoundError):
            env[f"pkg:{pkg}"] = version(pkg)
    env["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return env


def _worst(r: Result) -> float | None:
    vals = [m.value for m in r.metrics if m.name == "max_error/bound"]
    if any(m.name in ("nonfinite_mismatch", "mismatches") and m.value > 0 for m in r.metrics):
        return float("inf")
    return max(vals) if vals else None


def run_matrix(
    backends: list[str],
    *,
    out_dir: Path,
    scale: str = "tiny",
    dtypes: tuple[str, ...] = ("bfloat16",),
    ops: tuple[str, ...] | None = None,
    timeout: float | None = 300.0,
    progress=None,
    reference_device: str = "auto",
    cache=None,
    isolated: bool = True,
) -> dict:
    """Run the curated cases on each backend; returns the matrix as a JSON-able dict (see :func:`write_matrix`).
    ``reference_device`` and ``cache`` (a :class:`~mlaspec.conformance.references.ReferenceCache`, shared by the
    backends) are :func:`~mlaspec.conformance.runner.run_case`'s. ``isolated`` (default): each backend in a worker
    process (:class:`~mlaspec.conformance.worker.WorkerBackend`), as ``mlaspec check`` runs it, so a backend that
    crashes, exits or corrupts its CUDA context fails its own case and not the cases after it, nor the references
    this process computes on the same GPU (in-process, a FlashMLA illegal address turned the 19 cases after it into
    errors on the H200)."""
    from .worker import load_failure, open_backend

    cases = curated_cases(scale=scale, dtypes=dtypes, ops=ops)
    out_dir = Path(out_dir)
    data = {
        "scale": scale,
        "dtypes": list(dtypes),
        "environment": matrix_environment(),
        "cases": [dict(id=c.id, op=c.op, params=c.params) for c in cases],
        "backends": {},
    }
    for name in backends:
        target = _resolve(name)
        entry = {"target": target, "usable": False, "version": "", "reason": "", "results": []}
        data["backends"][name] = entry
        try:
            backend = open_backend(target, isolated=isolated, timeout=timeout)
        except Exception as exc:  # a backend that cannot load is a row of the matrix, not a crash
            entry["reason"] = load_failure(exc, isolated=isolated)
            if progress:
                progress(f"{name}: not usable: {entry['reason']}")
            continue
        entry.update(usable=True, version=getattr(backend, "version", ""))

        def on_result(i, r, name=name):
            if progress:
                progress(f"{name} [{i + 1:>3}/{len(cases)}] {r.verdict.upper():<5} {r.case_id}")

        try:
            results = run_cases(
                backend,
                cases,
                backend_name=name,
                out_dir=out_dir / name,
                scale=scale,
                timeout=timeout,
                on_result=on_result,
                reference_device=reference_device,
                cache=cache,
            )
        finally:
            if isolated:
                backend.close()
        entry["results"] = [
            dict(
                case_id=r.case_id,
                op=r.op,
                verdict=r.verdict,
                reason=r.reason,
                worst=_worst(r),
                seconds=round(r.seconds, 4),
                repro=r.repro,
                numerics=list(r.numerics),
            )
            for r in results
        ]
    return data


COLOUR = {"pass": "#1a7f37", "fail": "#cf222e", "error": "#bc4c00", "crash": "#bc4c00", "timeout": "#bc4c00"}


def _word(verdict: str) -> str:
    """A verdict as a coloured word (the colour is decoration: the word reads without it)."""
    colour = COLOUR.get(verdict)
    return f'<span style="color:{colour}"><b>{verdict}</b></span>' if colour else verdict


def _cell(res: dict | None, usable: bool) -> str:
    if not usable or res is None:
        return "n/a"
    v, w = res["verdict"], res["worst"]
    declared = "†" if res.get("numerics") else ""  # judged under the backend's declared numerics
    if v in ("pass", "fail") and w is not None:
        return f"{_word(v)} {'nonfinite' if w == float('inf') else f'{w:.2g}'}{declared}"
    return _word(v) + declared


def _no_paths(text: str) -> str:
    """``text`` with each absolute path cut to its last two parts, as code (no machine paths on the page)."""
    return re.sub(r"/(?:[^\s,()/]+/)*([^\s,()/]+/[^\s,()/]+)", lambda m: f"`{m.group(1)}`", text)


def _reasons(results: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in results:
        if r["verdict"] == "skip":
            counts[r["reason"]] = counts.get(r["reason"], 0) + 1
    return "; ".join(f"{n} x {reason}" for reason, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def matrix_markdown(data: dict) -> str:
    """The matrix as a markdown page: the environment, a summary per backend, then one table per op with a column
    for each backend that runs it, then every failure with its reproducer and the skips counted by reason."""
    names = list(data["backends"])
    env = data["environment"]
    lines = [
        "# Conformance matrix",
        "",
        f"Every curated case (scale `{data['scale']}`, dtypes {', '.join(data['dtypes'])}) on every backend. "
        "A cell is the verdict and the worst `|error| / bound` over the case's outputs (pass needs <= 1; "
        "`nonfinite` = a NaN/±inf position differs from the spec); `skip`: the backend declares the case unsupported "
        "(the reasons are counted below); `n/a`: the backend is not usable here or did not run the case. "
        "† judged under the arithmetic the backend declares for the op (`mlaspec.conformance.numerics`: the "
        "budget term it changes, no other; `mlaspec check --strict-numerics` judges against the exact spec).",
        "",
        "Regenerate: `mlaspec matrix --backends " + ",".join(names) + f" --scale {data['scale']} "
        f"--dtypes {','.join(data['dtypes'])} --out <dir>`",
        "",
        "## Environment",
        "",
    ]
    lines += [f"- **{k}**: {_no_paths(str(v))}" for k, v in env.items()]
    lines += [
        "",
        "## Backends",
        "",
        "| backend | version | pass | fail | error | skip |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n in names:
        e = data["backends"][n]
        if not e["usable"]:
            lines.append(f"| `{n}` | not usable: {_no_paths(e['reason'])} | | | | |")
            continue
        c = {v: sum(r["verdict"] == v for r in e["results"]) for v in ("pass", "fail", "error", "skip")}
        c["error"] += sum(r["verdict"] in ("crash", "timeout") for r in e["results"])
        lines.append(f"| `{n}` | {_no_paths(e['version'])} | {c['pass']} | {c['fail']} | {c['error']} | {c['skip']} |")
    for n in names:
        declared: dict[tuple[str, ...], list[str]] = {}
        for r in data["backends"][n]["results"]:
            if r.get("numerics") and r["op"] not in declared.get(tuple(r["numerics"]), []):
                declared.setdefault(tuple(r["numerics"]), []).append(r["op"])
        for numerics, ops in declared.items():
            lines.append(f"\n† `{n}` declares {', '.join(numerics)} for {', '.join(ops)}.")
    lines += ["", "## By op", ""]
    by = {n: {r["case_id"]: r for r in data["backends"][n]["results"]} for n in names}
    ops = list(dict.fromkeys(c["op"] for c in data["cases"]))
    for op in ops:
        cases = [c for c in data["cases"] if c["op"] == op]
        runs = [n for n in names if any(by[n].get(c["id"], {}).get("verdict", "skip") != "skip" for c in cases)]
        others = [n for n in names if n not in runs]
        lines += [f"### `{op}`", ""]
        if not runs:
            lines += ["No backend runs it here.", ""]
            continue
        lines += ["| case | " + " | ".join(f"`{n}`" for n in runs) + " |", "| --- |" + " --- |" * len(runs)]
        for c in cases:
            case = c["id"].split("[", 1)[1].rstrip("]")
            cells = [_cell(by[n].get(c["id"]), data["backends"][n]["usable"]) for n in runs]
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
        if others:
            lines += ["", "Not run by " + ", ".join(f"`{n}`" for n in others) + "."]
        lines.append("")
    lines += ["## Failures, errors and skips", ""]
    for n in names:
        results = data["backends"][n]["results"]
        bad = [r for r in results if r["verdict"] in FAILED]
        skips = _reasons(results)
        if not bad and not skips:
            continue
        lines += [f"### `{n}`", ""]
        for r in bad:
            reason = r["reason"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"- {_word(r['verdict'])} `{r['case_id']}`: {reason} — rerun: `{r['repro']}`")
        if skips:
            lines.append(f"- skipped: {skips}")
        lines.append("")
    return "\n".join(lines) + "\n"


def merge_matrix(old: dict, new: dict) -> dict:
    """``new`` laid over ``old`` case by case: the cases and backends of either, a (backend, case) cell from ``new``
    where it ran one, else from ``old``; the environment is ``new``'s. Matrices of another scale or dtypes are not
    merged (``new`` alone)."""
    if (old.get("scale"), old.get("dtypes")) != (new["scale"], new["dtypes"]):
        return new
    ran = {c["id"] for c in new["cases"]}
    cases = [c for c in old["cases"] if c["id"] not in ran]
    order = {c["id"]: i for i, c in enumerate(old["cases"])}
    cases = sorted(cases + new["cases"], key=lambda c: order.get(c["id"], len(order)))  # old order, new cases last
    rank = {c["id"]: i for i, c in enumerate(cases)}
    backends = dict(old["backends"])
    for name, entry in new["backends"].items():
        kept = [r for r in backends.get(name, {}).get("results", []) if r["case_id"] not in ran]
        results = sorted(kept + entry["results"], key=lambda r: rank.get(r["case_id"], len(rank)))
        backends[name] = {**entry, "results": results}
    return {**new, "cases": cases, "backends": backends}


def merge_results_jsonl(path: Path, old_lines: list[str]) -> None:
    """Put back into a backend's ``results.jsonl`` the lines of ``old_lines`` whose case this run did not redo."""
    path = Path(path)
    new = [
        (line, json.loads(line)) for line in (path.read_text().splitlines() if path.exists() else []) if line.strip()
    ]
    header = [line for line, d in new if "case_id" not in d]  # this run's header stays first
    ran = {d["case_id"] for _, d in new if "case_id" in d}
    old = [(line, json.loads(line)) for line in old_lines if line.strip()]
    kept = [line for line, d in old if "case_id" in d and d["case_id"] not in ran]
    path.write_text("".join(line + "\n" for line in header + kept + [line for line, d in new if "case_id" in d]))


def write_matrix(data: dict, out_dir: Path, *, merge: bool = False) -> tuple[Path, Path]:
    """Write ``OUT/matrix.md`` and ``OUT/matrix.json``; returns their paths. ``merge``: lay this run over an existing
    ``OUT/matrix.json`` case by case (:func:`merge_matrix`), so one backend, or a few ops, per command still build
    one matrix."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / "matrix.md", out_dir / "matrix.json"
    if merge and js.exists():
        data = merge_matrix(json.loads(js.read_text()), data)
    md.write_text(matrix_markdown(data))
    js.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return md, js
