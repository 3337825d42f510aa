"""Judging one backend output against the spec: ±inf/NaN positions exactly first, then every finite element
against its own derived bound (:mod:`mlaspec.conformance.ops`), then the error as a whole against what random
rounding gives: no systematic lean (bias) and no more noise than the budget allows (norm) —
:mod:`mlaspec.conformance.statistics`.

A verdict is a plain record that serialises to one JSON line, so a crashed run keeps what it judged;
:func:`format_failure` is how a failing one reads wherever it is shown (``mlaspec check``, the pytest plugin, the
HTML report).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from .numerics import lse_rounded
from .statistics import ALPHA, rounding_statistics

__all__ = ["Metric", "Result", "argmax_index", "format_failure", "judge", "judge_exact"]


@dataclass
class Metric:
    output: str
    name: str
    value: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.value <= self.bound


@dataclass
class Result:
    """The verdict on one case: ``pass``, ``fail`` (wrong numbers or non-finite pattern, or an input written or
    aliased against the op's contract), ``error`` (raised, wrong shape or type, an output that cannot be judged),
    ``crash`` (the backend's worker process died), ``timeout`` or ``skip`` (unsupported, with the reason).

    ``figure`` is the error heat map of a failing case; ``figures`` are its op's pictures (the mask, sparse pattern,
    chunk schedule, top-k or byte layout the case stands for, next to what the backend did). JSON lines written
    before ``figures`` existed load with it empty. ``numerics`` are the arithmetic departures the verdict assumed (the
    backend's declaration for the op, :mod:`mlaspec.conformance.numerics`; empty: the exact spec's arithmetic).
    ``retried`` is what the case first gave beside ``mlaspec check --warm``'s warm-up workers when it then ran again
    alone (:mod:`mlaspec.conformance.warmup`); the verdict is the second run's."""

    case_id: str
    op: str
    dtype: str
    verdict: str
    reason: str = ""
    metrics: list[Metric] = field(default_factory=list)
    worst: dict = field(default_factory=dict)
    seconds: float = 0.0
    repro: str = ""
    figure: str = ""
    figures: list[str] = field(default_factory=list)
    numerics: list[str] = field(default_factory=list)
    retried: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Result:
        return cls(**{**d, "metrics": [Metric(**m) for m in d.get("metrics", [])]})


ADDITIVE = ("lse", "max_logits")
"""Outputs whose errors are offsets, not scales (log-domain values): judged per element by the bias check."""

FAILED = ("fail", "error", "crash", "timeout")
"""The verdicts that fail a run: wrong numbers or a broken input contract, an output that cannot be judged or a
raise, a worker that died, a case past its timeout."""


def format_failure(result: Result) -> str:
    """A failing verdict as two lines: ``FAILED <case id>: <reason>`` (``ERROR``: the backend raised or returned
    what cannot be judged; ``CRASH``: its worker died; ``TIMEOUT``) and ``  rerun: <the case's reproducer>``."""
    word = {"error": "ERROR", "crash": "CRASH", "timeout": "TIMEOUT"}.get(result.verdict, "FAILED")
    return f"{word} {result.case_id}: {result.reason}\n  rerun: {result.repro}"


def _nonfinite_mismatch(name: str, got: torch.Tensor, ref: torch.Tensor) -> str:
    for label, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        g, r = test(got), test(ref)
        if not torch.equal(g, r):
            where = (g != r).nonzero()[0].tolist()
            return (
                f"{name}: {label} pattern differs from the spec ({int((g & ~r).sum())} unexpected, "
                f"{int((r & ~g).sum())} missing); first at index {where}: got {got[tuple(where)].item():.6g}, "
                f"spec {ref[tuple(where)].item():.6g}"
            )
    return ""


def argmax_index(t: torch.Tensor) -> tuple[int, ...]:
    """The index of ``t``'s largest element as a tuple (``torch.unravel_index`` without its first call's import of
    sympy, a second of the default run)."""
    flat, idx = int(t.argmax()), []
    for n in reversed(t.shape):
        flat, i = divmod(flat, n)
        idx.append(i)
    return tuple(reversed(idx))


def judge(
    names: tuple[str, ...], got: object, ref: tuple, bounds: tuple, *, u: float = 0.0
) -> tuple[str, str, list[Metric], dict, dict]:
    """Compare a backend's outputs with the spec's.

    Returns ``(verdict, reason, metrics, worst, ratios)``; ``ratios[name]`` is the error / bound tensor (for pictures).
    LSE rows the spec reports empty (``-inf``) may come back as ``+inf``: vLLM's merge reads both as empty.

    Each output within its per-element budget is then judged as a whole
    (:func:`~mlaspec.conformance.statistics.rounding_statistics`): ``bias/floor`` (the systematic error over the
    floor, 0 where the rows do not lean one way beyond chance) and ``rms/budget`` (the RMS error over the RMS budget,
    against what random rounding reaches). ``u`` is the case dtype's unit roundoff, the precision the kernel is
    entitled to: the bias floor is a quarter of the larger of it and the output dtype's. The outputs in
    :data:`ADDITIVE` and any 1-D output are judged as additive offsets, every other output as a relative scale per row
    (its last dimension).
    """
    if not isinstance(got, (tuple, list)) or len(got) != len(names):
        return "error", f"expected {len(names)} outputs ({', '.join(names)}), got {type(got).__name__}", [], {}, {}
    metrics, worst, ratios, reasons = [], {}, {}, []
    for name, g, r, b in zip(names, got, ref, bounds):
        if not isinstance(g, torch.Tensor):
            return "error", f"{name}: expected a tensor, got {type(g).__name__}", [], {}, {}
        if g.layout != torch.strided or g.device.type == "meta":
            return (
                "error",
                f"{name}: a {g.layout} tensor on {g.device}: expected a dense tensor with values",
                [],
                {},
                {},
            )
        if tuple(g.shape) != tuple(r.shape):
            return "error", f"{name}: shape {list(g.shape)}, spec {list(r.shape)}", [], {}, {}
        if not (g.dtype.is_floating_point or g.dtype.is_complex):
            return "error", f"{name}: dtype {g.dtype} is not floating point", [], {}, {}
        u_out = max(u, torch.finfo(g.dtype).eps / 2 if g.dtype.is_floating_point else 0.0)
        g = g.detach().to("cpu", torch.float64)
        if name == "lse":
            g = torch.where(torch.isposinf(g) & torch.isneginf(r), -math.inf, g)
        bad = _nonfinite_mismatch(name, g, r)
        if bad:
            reasons.append(bad)
            metrics.append(Metric(name, "nonfinite_mismatch", 1.0, 0.0))
            continue
        finite = torch.isfinite(r)
        err = torch.where(finite, (g - r).abs(), 0.0)
        b = torch.broadcast_to(b, r.shape).to(torch.float64)
        if name == "lse" and lse_rounded():  # a declared LSE in the query dtype: its one rounding
            b = b + 2 * u * r.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
        ratio = torch.where(err > 0, err / b.clamp_min(1e-300), 0.0)
        ratios[name] = ratio
        worst_ratio = ratio.max().item() if ratio.numel() else 0.0
        metrics.append(Metric(name, "max_error/bound", worst_ratio, 1.0))
        if ratio.numel() and worst_ratio > 0:
            idx = argmax_index(ratio)
            worst[name] = dict(index=list(idx), got=g[idx].item(), spec=r[idx].item(), bound=b[idx].item())
        if worst_ratio > 1.0:
            w = worst[name]
            reasons.append(
                f"{name}: max |error|/bound = {worst_ratio:.3g} at {w['index']}: got {w['got']:.6g}, "
                f"spec {w['spec']:.6g}, bound {w['bound']:.3g}"
            )
            continue
        relative = name not in ADDITIVE and r.dim() >= 2
        stats = rounding_statistics(torch.where(finite, g - r, 0.0), r, b, relative=relative, u=u_out)
        metrics.append(Metric(name, "bias/floor", abs(stats.bias) / stats.floor if stats.p <= ALPHA else 0.0, 1.0))
        metrics.append(Metric(name, "rms/budget", stats.rho, stats.rho_bound))
        if stats.biased:
            reasons.append(stats.bias_reason(name, relative))
        if stats.noisy:
            reasons.append(stats.norm_reason(name))
    return ("fail" if reasons else "pass"), "; ".join(reasons), metrics, worst, ratios


def judge_exact(names: tuple[str, ...], got: object, ref: tuple) -> tuple[str, str, list[Metric], dict, dict]:
    """Exact equality, for integer metadata (slot mappings, start locations, indices, counts).

    Each output may be a tensor or a plain int / list; the first differing position is reported.
    """
    if not isinstance(got, (tuple, list)) or len(got) != len(names):
        return "error", f"expected {len(names)} outputs ({', '.join(names)}), got {type(got).__name__}", [], {}, {}
    metrics, worst, reasons = [], {}, []
    for name, g, r in zip(names, got, ref):
        g = torch.as_tensor(g).detach().cpu()
        r = torch.as_tensor(r).cpu()
        if tuple(g.shape) != tuple(r.shape):
            return "error", f"{name}: shape {list(g.shape)}, spec {list(r.shape)}", [], {}, {}
        differ = g.to(r.dtype) != r if g.dtype != torch.bool else g != r.bool()
        n = int(differ.sum())
        metrics.append(Metric(name, "mismatches", float(n), 0.0))
        if n:
            idx = [int(i) for i in differ.nonzero()[0]]
            worst[name] = dict(index=idx, got=g[tuple(idx)].item(), spec=r[tuple(idx)].item(), bound=0.0)
            reasons.append(
                f"{name}: {n} of {r.numel()} entries differ; first at {idx}: got {worst[name]['got']}, "
                f"spec {worst[name]['spec']}"
            )
    return ("fail" if reasons else "pass"), "; ".join(reasons), metrics, worst, {}
