"""What every op module shares: the Op record, dtypes, unit roundoff, seeded inputs, and the attention budget."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from mlaspec.spec.attention import attention

from ..cases import Case
from ..cpus import usable_cpus
from ..numerics import accumulation_roundoff
from ..verdict import judge

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy


class _Strategies:
    """``hypothesis.strategies``, imported at its first use: the ops' case generators draw only in a generated run
    or test, and the import takes ~0.25 s of each process's start (a run's and its worker's)."""

    def __getattr__(self, name: str):
        from hypothesis import strategies

        return getattr(strategies, name)


st = _Strategies()


def composite(fn: Callable) -> Callable:
    """hypothesis's ``@composite`` on ``fn``, applied when the strategy is first built (:data:`st`)."""

    @functools.wraps(fn)
    def strategy(*args, **kwargs):
        return st.composite(fn)(*args, **kwargs)

    return strategy


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
EPS32 = 2.0**-24


def unit_roundoff(dtype: torch.dtype) -> float:
    """``2^-(mantissa bits + 1)``: the largest relative error of rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def underflow_floor(dtype: torch.dtype) -> float:
    """``η/2``, half the smallest subnormal of ``dtype`` (``2^-25`` fp16, ``2^-134`` bf16, ``2^-150`` fp32): the
    largest *absolute* error of rounding to ``dtype`` (round to nearest, gradual underflow) a value below its
    smallest normal, where the relative ``u`` no longer holds. Rounding ``x`` costs at most ``u |x| + η/2``."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps / 2


class Scale(NamedTuple):
    """The sizes a curated case list is drawn at: ``tiny`` (CPU and the Triton interpreter, seconds) or ``full``
    (real DeepSeek dimensions, for GPUs). ``ctx`` is the context length the decode cases share: irregular when tiny,
    so that padding paths run."""

    full: bool
    ctx: int

    @classmethod
    def named(cls, scale: str) -> Scale:
        if scale not in ("tiny", "full"):
            raise ValueError(f"scale must be 'tiny' or 'full', got {scale!r}")
        return cls(True, 4096) if scale == "full" else cls(False, 37)


#: Inclusive upper limits of the sizes the generators draw (:mod:`mlaspec.conformance.generated`): small, so a
#: generated case runs in milliseconds on a CPU.
LIMITS = dict(
    B=3,
    S_q=6,
    S_kv=24,
    H_kv=3,
    group=3,
    D_qk=40,
    D_v=24,
    H_decode=16,
    Lkv=32,
    D_nope=16,
    D_rope=8,
    D_v_mla=16,  # the MLA ops' per-head value width (attention's is D_v)
    T=9,
    H=4,
    D=64,
    K=16,
    H_sparse=8,
    requests=4,
    context=20,
    q_len=5,
    M=8,
    N=40,
    blocks=4,
    tag=999,
)


def _no_cases(scale: Scale) -> list[tuple[str, dict]]:
    return []


@dataclass(frozen=True)
class Op:
    """A checkable op: everything the harness knows about it, in one record (the registry is
    :data:`mlaspec.conformance.ops.OPS`; every op set of the project is derived from it).

    ``name`` is the method a backend implements, taking the keyword arguments ``make_inputs`` builds (those of the
    spec function) and returning the outputs named ``outputs``. ``spec`` is the spec function the op checks (shown
    in the docs and the report); ``reference`` computes the float64 reference from the same keyword arguments:
    ``spec`` itself unless a harness-side wrapper is needed (e.g. to zero what no query may read).

    ``make_inputs(case) -> kwargs`` (tensors in the case dtype, from the case's seed); ``reference(**kwargs) ->
    tuple`` of float64 outputs; ``bounds(kwargs, ref, u) -> tuple`` of per-element absolute error bounds, one per
    output, broadcastable to it (``None`` for ops judged by ``compare`` alone). They are computed with the reference,
    on the reference device, and kept beside it in the reference cache (:mod:`mlaspec.conformance.references`), so a
    warm run neither builds the inputs in its own process nor computes a budget.

    ``compare(kwargs, got, ref) -> (verdict, reason, metrics, worst, ratios)`` replaces the default per-element
    judgement (:func:`mlaspec.conformance.verdict.judge`) where equality is not the right question: exact
    equality for integer metadata (:func:`~mlaspec.conformance.verdict.judge_exact`), tie-aware agreement for
    top-k indices.

    ``heat_map`` lays an output's error / bound map out as ``[..., heads, positions]`` for the report's heat map
    and pictures, where its shape is not one the runner reduces itself (e.g. ``{"lse": lambda r: r.T}``).
    ``fp8_query``: the op's query is fp8 (the indexer's), so the judge's ``u`` is 0 and the output dtype's rounding
    alone sets the statistics' floor, where other ops take the case dtype's (:meth:`verdict`).
    ``picture(kwargs, got, ref, ratios, *, title) -> {name: Figure}`` draws, for a failing case, what the case is
    next to what the backend did (``ratios`` is the verdict's error / bound maps, possibly empty); the runner saves
    each figure next to the heat map. It draws through :mod:`mlaspec.conformance.viz` and never changes a verdict.

    ``cases(scale) -> [(name, params), ...]`` are the op's curated cases at a :class:`Scale`, named after the
    deployments they stand for; ``generator`` is a hypothesis ``@composite`` strategy of ``params`` (sizes within
    :data:`LIMITS`), or ``None`` where the op has no generated cases.

    ``writes`` names the arguments the op may write in place (a cache a kernel fills, e.g. ``kv_cache``): the harness
    checks that a backend leaves every other input bit for bit as it was given, and that no output shares memory
    with an input it does not write.
    """

    name: str
    make_inputs: Callable[[Case], dict]
    reference: Callable[..., tuple]
    bounds: Callable[[dict, tuple, float], tuple] | None
    outputs: tuple[str, ...] = ("out", "lse")
    doc: str = ""
    compare: Callable[[dict, object, tuple], tuple] | None = None
    picture: Callable[..., dict] | None = None
    spec: Callable[..., tuple] | None = None
    cases: Callable[[Scale], list[tuple[str, dict]]] = _no_cases
    generator: Callable[[], SearchStrategy[dict]] | None = None
    writes: tuple[str, ...] = ()
    heat_map: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict, hash=False)
    fp8_query: bool = False

    @property
    def spec_function(self) -> Callable[..., tuple]:
        """The spec function this op checks."""
        return self.spec or self.reference

    def verdict(self, got: object, ref: tuple, bounds: tuple | None, u: float, inputs: Callable[[], dict]) -> tuple:
        """``(verdict, reason, metrics, worst, ratios)`` of a backend's outputs ``got``: ``compare`` on ``inputs()``
        where the op has one, else :func:`~mlaspec.conformance.verdict.judge` against ``bounds`` with the case dtype's
        unit roundoff ``u`` (0 for an ``fp8_query`` op), a bare tensor taken for a single output; the ratio maps laid
        out by ``heat_map`` and capped at :data:`RATIO_CAP`. ``inputs`` is called only by ``compare``."""
        if self.compare is not None:
            return self.compare(inputs(), got, ref)
        if len(self.outputs) == 1 and isinstance(got, torch.Tensor):
            got = (got,)
        verdict = judge(self.outputs, got, ref, bounds, u=0.0 if self.fp8_query else u)
        ratios = {k: self.heat_map.get(k, _as_is)(v).clamp(max=RATIO_CAP) for k, v in verdict[4].items()}
        return (*verdict[:4], ratios)


RATIO_CAP = 1e12
"""Error / bound ratios above this are drawn as this: a zero budget (an exact 0 expected, e.g. under a ``+inf``
sink) gives ratios near ``1e300``, which would flatten a heat map's scale."""


def _as_is(ratio: torch.Tensor) -> torch.Tensor:
    return ratio


NORMAL_CHUNK = 1 << 22  # float64 normals one generator draws (every tiny case's); larger draws: in parts, in parallel
NORMAL_PART = 1 << 18  # a larger draw's part: one generator each, filled on a thread pool


def normal(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """Standard normal float64 draws of ``shape``, a function of ``generator``'s state alone (not of the machine).

    Up to :data:`NORMAL_CHUNK` elements (every draw of the tiny cases, so the default run's inputs, and what
    ``docs/sensitivity.md`` measured on them, are those of plain ``torch.randn``): ``torch.randn`` from
    ``generator``. Larger (the full-scale caches): one 64-bit seed is drawn from ``generator``, and part ``i`` of
    :data:`NORMAL_PART` elements of the flat tensor comes from a generator seeded with ``seed + i * φ·2^64`` (mod
    2^63), filled on a thread pool (``normal_`` releases the GIL). The full-scale triton run drew its inputs one
    normal at a time: 30 of its 62 seconds (H200 host, 2026-11-24); in parts of ``NORMAL_CHUNK`` its draws of 4-9 M
    normals took 1-3 threads each, 16.7 s of its 36.8 s of inputs; in parts of ``NORMAL_PART``, every thread."""
    n = math.prod(shape)
    if n <= NORMAL_CHUNK:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    out = torch.empty(n, dtype=torch.float64)

    def fill(i: int) -> None:
        part = torch.Generator().manual_seed((seed + i * 0x9E3779B97F4A7C15) % 2**63)
        out[i * NORMAL_PART : (i + 1) * NORMAL_PART].normal_(generator=part)

    with ThreadPoolExecutor(max_workers=min(16, usable_cpus())) as pool:
        list(pool.map(fill, range(math.ceil(n / NORMAL_PART))))
    return out.view(shape)


def randn(case: Case) -> Callable[..., torch.Tensor]:
    """``randn(*shape, scale=1.0)``: :func:`normal` draws from the case's seed, times ``scale``, in its dtype."""
    g = torch.Generator().manual_seed(case.seed)
    dtype = DTYPES[case.dtype]
    return lambda *shape, scale=1.0: (normal(*shape, generator=g) * scale).to(dtype)


def gamma(n: int, u_w: float | None = None) -> float:
    """Higham's ``γ_n = n u_w / (1 - n u_w)``: ``|fl(x.y) - x.y| <= γ_n |x|.|y|`` for a dot product of length ``n``
    evaluated in a precision of unit roundoff ``u_w``, in any order of summation, FMA or not (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2nd ed., eq. 3.5 and §3.1); the default ``u_w`` is fp32's, the accumulator
    every conforming kernel sums in, or the larger one a declared departure says
    (:func:`~mlaspec.conformance.numerics.accumulation_roundoff`; ``n u_w < 1`` or the bound says nothing)."""
    u_w = accumulation_roundoff(EPS32) if u_w is None else u_w
    if n * u_w >= 1:
        raise ValueError(f"γ_n needs n u_w < 1, got n = {n}, u_w = {u_w:g}")
    return n * u_w / (1 - n * u_w)


def abs_logits_max(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale max_j Σ_d |q_d| |k_jd|`` per (b, h, i) as ``[B, H, S_q]`` (``q [B, S_q, H, D]``, ``k [B, S_kv, H_kv,
    D]``, heads repeated for GQA; 0 with no keys): what an elementwise perturbation of size ``|k|`` (or ``|q|``) can
    move a row's largest logit by. Masked keys count too, which only overstates."""
    b, s_q, h_q, d = q.shape
    h_kv = k.shape[2]
    qg = q.abs().double().reshape(b, s_q, h_kv, h_q // h_kv, d)  # query head h reads KV head h // g
    qk = torch.einsum("bqkgd,bjkd->bkgqj", qg, k.abs().double()).reshape(b, h_q, s_q, k.shape[1])
    return scale * (qk.amax(-1) if qk.shape[-1] else qk.sum(-1))  # no keys: 0


def logit_error(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``γ_D scale max_j Σ_d |q_d k_jd|`` per (b, h, i): the fp32 accumulation error bound of the logits."""
    return gamma(q.shape[-1]) * abs_logits_max(q, k, scale)  # [B, H, S_q]


def projection_error(equation: str, x: torch.Tensor, w: torch.Tensor, u: float) -> torch.Tensor:
    """``(1 + u/2) γ_n (|x| @ |w|)`` per element of the product ``einsum(equation, x, w)``, ``n`` the length of the
    contracted index (``"bsl,lnp->bsnp"``: ``n = Lkv``): a bound on how far a kernel's product, accumulated in fp32
    and then rounded to the case dtype (unit roundoff ``u``), can be from the exact one *beyond* the ``u/2`` rounding
    of the exact value. With ``y`` exact and ``e`` the accumulation error (``|e| <= γ_n |x|.|w|``),
    ``|fl_u(y + e) - y| <= |e| + u/2 |y + e| <= u/2 |y| + (1 + u/2) |e|``."""
    inputs, output = equation.replace(" ", "").split("->")
    a, b = inputs.split(",")
    n = math.prod(x.shape[a.index(c)] for c in set(a) & set(b) if c not in output)
    return (1 + u / 2) * gamma(n) * torch.einsum(equation, x.abs().double(), w.abs().double())


def output_underflow(u: float) -> float:
    """``η/2`` (:func:`underflow_floor`) of the case dtype whose unit roundoff is ``u`` (0 for a ``u`` of no case
    dtype): the absolute error of rounding an output below the dtype's smallest normal (fp16: ``2^-25``, where an
    output of ``6.6e-9`` rounds to 0 -- seen on the H200 with a per-tensor fp8 cache of scale 1)."""
    return next((underflow_floor(dt) for dt in DTYPES.values() if unit_roundoff(dt) == u), 0.0)


def attention_bounds(q, k, v, *, scale, causal, mask=None, ref, u, extra_logit_err=0.0, v_err=None):
    """The output and LSE budgets of attention (see :mod:`mlaspec.conformance.ops`). ``extra_logit_err``
    (``[B, H, S_q]`` or a scalar) adds to ``δs`` what perturbed ``q`` or ``k`` cost the logits; ``v_err`` (an
    elementwise bound of a perturbation of ``v``, shaped like it) adds ``Σ_j p_j v_err_j`` (the spec's weights) to
    the output's error, inside the factor 2. The output's rounding to the case dtype costs ``u |out| + η/2``
    (:func:`output_underflow`)."""
    ds = logit_error(q, k, scale) + extra_logit_err  # [B, H, S_q]
    m = attention(q, k, v.abs(), scale=scale, causal=causal, mask=mask).out  # [B, S_q, H, D_v]
    out_bound = 2 * (u * ref[0].abs() + output_underflow(u) + (u + 2 * ds.transpose(1, 2)[..., None]) * m)
    if v_err is not None:
        out_bound = out_bound + 2 * attention(q, k, v_err, scale=scale, causal=causal, mask=mask).out
    # the fp32 sum of up to S_kv exponentials (relative S_kv ε32) and its log (ε32 |lse|)
    lse_bound = 2 * (ds + k.shape[1] * EPS32 + EPS32 * ref[1].abs().nan_to_num(0.0, posinf=0.0, neginf=0.0))
    return out_bound, lse_bound


# -- pictures of failing cases --------------------------------------------------------------------------------------
def _cpu64(t: object) -> torch.Tensor | None:
    return t.detach().to("cpu", torch.float64) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point else None


def worst_rows(outputs: list[tuple[str, object, torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """The worst ``|error| / bound`` per row over several outputs, ``+inf`` where a row's NaN / ±inf pattern differs.

    ``outputs`` holds ``(name, got, ref, ratio)`` with the row as dimension 0 of ``got``, ``ref`` and ``ratio``
    (``ratio`` None where the verdict has no map: the pattern differed). A backend's ``+inf`` where the spec's LSE
    is ``-inf`` counts as agreeing, as :func:`~mlaspec.conformance.verdict.judge` counts it.
    """
    rows = outputs[0][2].shape[0]
    worst = torch.zeros(rows, dtype=torch.float64)
    for name, got, ref, ratio in outputs:
        if ratio is not None and ratio.numel():
            worst = torch.maximum(worst, ratio.reshape(rows, -1).amax(1).double())
        g = _cpu64(got)
        if g is None or g.shape != ref.shape:
            continue
        if name == "lse":
            g = torch.where(torch.isposinf(g) & torch.isneginf(ref), -math.inf, g)
        differ = torch.zeros(ref.shape, dtype=torch.bool)
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            differ |= test(g) != test(ref)
        worst = torch.where(differ.reshape(rows, -1).any(1), math.inf, worst)
    return worst


def prefix_lse_match(logits: torch.Tensor, lse: torch.Tensor, bound: torch.Tensor, spec_lengths: torch.Tensor):
    """Which prefix of the keys a backend's LSE is consistent with, per query row.

    ``logits [B, H, S_q, S_kv]`` float64 (the spec's ``scale q.k``), the backend's ``lse [B, H, S_q]``, its budget
    ``bound [B, H, S_q]`` and the spec's keys per row ``spec_lengths [S_q]``. For each row the distance to attending
    keys ``[0, n)`` is ``max_{b, h} |lse - logsumexp(logits[b, h, i, :n])| / bound``; ``n`` is the spec's own length
    where that is within the budget, else the nearest prefix. Returns ``(lengths [S_q], explained [S_q] bool)``:
    ``explained`` is False where no prefix is within the budget (the bug is not a mask, or not a prefix mask).
    A key of negligible weight moves the LSE by less than the budget, so ``n`` is "a prefix consistent with the
    LSE", not proof of which keys were read.
    """
    b, h, s_q, s_kv = logits.shape
    prefix = torch.cat(
        [torch.full((b, h, s_q, 1), -math.inf, dtype=torch.float64), torch.logcumsumexp(logits, -1)], -1
    )  # [B, H, S_q, S_kv + 1]
    g = lse.detach().to("cpu", torch.float64)[..., None]
    empty_got = torch.isinf(g) & ~torch.isnan(g)  # ±inf: an empty row
    dist = torch.where(
        torch.isinf(prefix),
        torch.where(empty_got, 0.0, math.inf),
        torch.where(empty_got | torch.isnan(g), math.inf, (g - prefix).abs()),
    )
    dist = (dist / bound.to(torch.float64).clamp_min(1e-300)[..., None]).amax((0, 1))  # [S_q, S_kv + 1]
    nearest = dist.argmin(-1)
    own = dist.gather(1, spec_lengths.long()[:, None])[:, 0] <= 1.0
    lengths = torch.where(own, spec_lengths.long(), nearest)
    return lengths, dist.gather(1, lengths[:, None])[:, 0] <= 1.0
