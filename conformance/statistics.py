"""Statistical budgets beside the per-element bound: a bias check and a norm-wise check, each with a false-alarm
probability of at most :data:`ALPHA` per output of a case under the random-rounding model.

The per-element bound ``b_i`` (:mod:`mlaspec.conformance.ops`) is a worst case: every rounding at its largest and
all of one sign. A kernel that rounds to nearest lands far inside it, so a *systematic* error (an output scaled by
1.01, a weight 8% too large) can hide under it. Two statistics see what the worst case cannot.

**The model** (Higham and Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41,
2019, §2): a correct kernel's error ``e_i = got_i - ref_i`` is a sum ``Σ_k c_ik δ_k`` of rounding errors ``δ_k``
that are independent, symmetric about 0, and, within one unit in the last place, uniform: ``E δ_k² <= u²/3``
relative. The per-element budget is ``b_i = 2 Σ_k |c_ik| u_k`` (the factor 2 is its headroom). Errors within one
*row* (the elements sharing every index but the last: one query and head of an attention output) may be correlated
(they share the rounded softmax weights); different rows are taken as independent. An LSE (or any 1-D output) is
judged per element, each its own row.

**Bias** — the projection of the error on the reference, per row ``β_r = <e_r, ref_r> / <ref_r, ref_r>`` (the relative
scale error of the row; an LSE row's plain error ``e_r``, an additive offset). Under the model each ``β_r`` is
symmetric about 0 and the rows are independent, so the number of positive ones among the ``n`` non-zero is Binomial(n,
1/2): the two-sided sign test rejects at ``p <= ALPHA`` only when (almost) all rows lean one way (at least 21 rows are
needed at all: ``2 * 2^-21 < 1e-6``). Round to nearest has no preferred sign, any systematic scale, weight or offset
error has. Because real kernels share some roundings between rows (a value rounded once and read by every query), the
check also asks for *size*: the overall bias ``β = Σ_r <e_r, ref_r> / Σ_r <ref_r, ref_r>`` must exceed a floor, a
quarter of the output dtype's unit roundoff (``u/4``: ``2^-10`` bf16, ``2^-13`` fp16; never below ``2^-18``, where
fp32 accumulation and fast exponentials can leave a few ``ε32``), or for an LSE half its mean per-element budget (an
LSE's budget is fp32-tight, and the fp32 ``exp`` / ``log`` of real kernels are not correctly rounded: the built-in
``torch`` merge's LSE leans by a third of that floor, significantly). A case fails the bias check when both hold; the
sign test alone bounds the false alarm.

**Norm** — ``ρ = sqrt(Σ e_i² / Σ b_i²)``, the RMS error as a fraction of the RMS budget. Under the model ``E e_i² =
Σ_k c_ik² E δ_k² <= (Σ_k |c_ik| u_k)² / 3 = b_i² / 12``, and a row's ``X_r = Σ_{i in r} e_i²`` lies in ``[0, B_r /
4]`` (``B_r = Σ_{i in r} b_i²``; the model's ``|e_i| <= b_i / 2``, the budget without its headroom). Hoeffding's
inequality over the independent rows gives ``P(Σ e² > Σ b²/12 + t) <= ALPHA`` for ``t = sqrt(ln(1/ALPHA) / 2 * Σ_r
(B_r / 4)²)``: the bound on ``ρ²`` is ``1/12 + t / Σ b²``, tending to ``1/12`` (``ρ <= 0.29``) as rows are added,
where the worst case allows ``ρ = 1``. It fails errors that use most of the budget everywhere (noise in place of
rounding: a bf16 accumulator, a stale operand), which no single element shows. The budgets record each element's
rounding terms by their sum, so an accumulation of ``n`` terms enters with its worst case ``~ n ε``, not the ``~
sqrt(n) ε`` the model would allow: the norm check is conservative there (bf16 and fp16 budgets are dominated by single
roundings, where the two agree).
"""

from __future__ import annotations

import math

import torch

from .numerics import bias_floor

__all__ = ["ALPHA", "Statistics", "rounding_statistics", "sign_test_p"]

ALPHA = 1e-6
"""The false-alarm probability of each statistical check, per output of a case, under the random-rounding model."""

RELATIVE_FLOOR_MIN = 2.0**-18
"""The smallest relative bias the bias check reports, whatever the dtype (see the module docstring)."""


def sign_test_p(positive: int, n: int) -> float:
    """The two-sided sign-test p-value of ``positive`` successes in ``n`` fair coin flips:
    ``min(1, 2 P(Binomial(n, 1/2) >= max(positive, n - positive)))``; 1 for ``n = 0``. Exact up to ``n = 2000``;
    above, the tail's first term through ``math.lgamma`` and the rest as ratios of consecutive terms, summed until
    they no longer count (relative error below 1e-9; ``torch.lgamma`` was off by 3e-4 at ``n = 2094``, found by the
    ``thorough`` hypothesis profile)."""
    if n < 0 or not 0 <= positive <= n:
        raise ValueError(f"need 0 <= positive <= n, got positive = {positive}, n = {n}")
    m = max(positive, n - positive)
    if n == 0 or 2 * m == n:
        return 1.0
    if n <= 2000:  # exact: C(n, i + 1) = C(n, i) (n - i) / (i + 1) in integers (a math.comb a term: 4x slower)
        term = total = math.comb(n, m)
        for i in range(m, n):
            term = term * (n - i) // (i + 1)
            total += term
        return min(1.0, 2 * total / 2**n)
    log_first = math.lgamma(n + 1) - math.lgamma(m + 1) - math.lgamma(n - m + 1) - n * math.log(2)
    total, term = 0.0, 1.0  # the tail in units of its first term C(n, m) / 2^n; terms shrink as i grows past n/2
    for i in range(m, n + 1):
        total += term
        term *= (n - i) / (i + 1)
        if term < 1e-17 * total:
            break
    return min(1.0, 2 * math.exp(log_first) * total)


class Statistics:
    """The two statistics of one output (see the module docstring), with the numbers a failure message names."""

    def __init__(self, bias: float, floor: float, rows: int, positive: int, p: float, rho: float, rho_bound: float):
        self.bias, self.floor, self.rows, self.positive, self.p = bias, floor, rows, positive, p
        self.rho, self.rho_bound = rho, rho_bound

    @property
    def biased(self) -> bool:
        """The rows lean one way beyond chance (``p <= ALPHA``) by more than the floor."""
        return self.p <= ALPHA and abs(self.bias) > self.floor

    @property
    def noisy(self) -> bool:
        return self.rho > self.rho_bound

    def bias_reason(self, name: str, relative: bool) -> str:
        what = f"{self.bias:+.3%} of the spec" if relative else f"{self.bias:+.3g} on average"
        floor = f"{self.floor * 100:.2g}%" if relative else f"{self.floor:.3g}"
        return (
            f"{name}: systematic error {what} (floor {floor}): {self.positive} of {self.rows} rows err upward, "
            f"p = {self.p:.2g} <= {ALPHA:g} under round-to-nearest"
        )

    def norm_reason(self, name: str) -> str:
        return (
            f"{name}: RMS error {self.rho:.3g} of the RMS budget, above the {self.rho_bound:.3g} random rounding "
            f"stays under with probability 1 - {ALPHA:g}"
        )


def rounding_statistics(
    err: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, *, relative: bool, u: float
) -> Statistics:
    """The bias and norm statistics of an output's error ``err = got - ref`` (float64, 0 where ``ref`` is not
    finite), against the reference ``ref`` and the per-element budget ``bound`` (broadcast to ``ref``'s shape).

    ``relative``: rows are the last dimension (``β_r`` a relative scale; floor ``max(u, 2^-16) / 4`` with ``u`` the
    output dtype's unit roundoff); otherwise every element is its own row (``β_r = e_r``, an additive offset;
    floor half the mean budget, as for an LSE).
    """
    if ref.numel() == 0:  # nothing to judge (an empty output)
        return Statistics(0.0, math.inf, 0, 0, 1.0, 0.0, 1.0)
    finite = torch.isfinite(ref)
    r = torch.where(finite, ref, 0.0)
    if relative and ref.dim() >= 1:
        e2, r2, b2 = (t.reshape(-1, ref.shape[-1]) if ref.dim() else t.reshape(1, 1) for t in (err, r, bound))
    else:
        e2, r2, b2 = (t.reshape(-1, 1) for t in (err, r, bound))
    b2 = torch.where(finite.reshape(b2.shape), b2, 0.0)
    if relative:
        num, den = (e2 * r2).sum(1), (r2 * r2).sum(1)
        rows = den > 0
        beta_rows = num[rows] / den[rows]
        bias = (num.sum() / den.sum()).item() if den.sum() > 0 else 0.0
        floor = bias_floor(max(u, 4 * RELATIVE_FLOOR_MIN) / 4)
    else:
        keep = finite.reshape(-1)
        beta_rows = e2[keep, 0]
        bias = beta_rows.mean().item() if beta_rows.numel() else 0.0
        floor = b2[keep, 0].mean().item() / 2 if beta_rows.numel() else math.inf
    nonzero = beta_rows[beta_rows != 0]
    positive = int((nonzero > 0).sum())
    p = sign_test_p(positive, nonzero.numel())
    sum_b2 = (b2 * b2).sum().item()
    if sum_b2 > 0:
        rho = math.sqrt((e2 * e2).sum().item() / sum_b2)
        t = math.sqrt(math.log(1 / ALPHA) / 2 * ((b2 * b2).sum(1) / 4).pow(2).sum().item())
        rho_bound = math.sqrt(1 / 12 + t / sum_b2)
    else:
        rho, rho_bound = 0.0, math.inf
    return Statistics(bias, floor, nonzero.numel(), positive, p, rho, min(rho_bound, 1.0))
