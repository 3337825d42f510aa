"""The statistical budgets: the sign test's p-value, the bias and norm statistics on outputs that round to nearest
(no alarm) and on outputs with a systematic or a noisy error (alarm), and the judge enforcing both."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaspec.conformance.statistics import ALPHA, rounding_statistics, sign_test_p
from mlaspec.conformance.verdict import judge

U_BF16 = 2.0**-8


def _exact_p(k: int, n: int) -> float:
    """The two-sided binomial tail by its definition, a math.comb a term (the exact oracle up to n ~ 5000)."""
    m = max(k, n - k)
    if 2 * m == n:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(m, n + 1)) / 2**n)


def _exact_p_by_ratios(k: int, n: int) -> float:
    """The same tail in exact integers from C(n, m) by C(n, i + 1) = C(n, i) (n - i) / (i + 1): the oracle at
    n = 20001, where a math.comb a term takes 30-45 s a case."""
    m = max(k, n - k)
    if 2 * m == n:
        return 1.0
    term = total = math.comb(n, m)
    for i in range(m, n):
        term = term * (n - i) // (i + 1)
        total += term
    return min(1.0, 2 * total / 2**n)


@given(st.integers(0, 2100).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_sign_test_p_is_the_binomial_tail(kn):
    k, n = kn
    assert sign_test_p(k, n) == pytest.approx(_exact_p(k, n), rel=1e-6)


@pytest.mark.parametrize("n", [2001, 2094, 5000, 20001])
@pytest.mark.parametrize("share", [0.4355, 0.5, 0.51, 0.53, 0.56, 0.6, 1.0])
def test_sign_test_p_past_the_exact_range(n, share):
    k = round(share * n)
    exact = _exact_p(k, n) if n <= 5000 else _exact_p_by_ratios(k, n)
    assert sign_test_p(k, n) == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 2001, 5000])
def test_the_exact_oracles_agree(n):
    assert all(_exact_p_by_ratios(k, n) == _exact_p(k, n) for k in {0, 1, n // 3, n // 2, n - 1, n})


def test_sign_test_needs_21_rows_for_one_in_a_million():
    assert sign_test_p(20, 20) > ALPHA  # 2 * 2^-20
    assert sign_test_p(21, 21) <= ALPHA
    assert sign_test_p(0, 21) <= ALPHA  # two-sided


@pytest.mark.parametrize("bad", [(-1, 3), (4, 3), (1, -1)])
def test_sign_test_rejects_impossible_counts(bad):
    with pytest.raises(ValueError, match="positive"):
        sign_test_p(*bad)


def _outputs(seed: int, rows: int, width: int):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(rows, width, generator=g, dtype=torch.float64)
    bound = 2 * U_BF16 * ref.abs() + 1e-300  # one rounding, doubled: the budgets' shape
    return ref, bound


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(21, 200), st.integers(1, 64))
def test_round_to_nearest_raises_no_alarm(seed, rows, width):
    ref, bound = _outputs(seed, rows, width)
    err = ref.to(torch.bfloat16).double() - ref
    s = rounding_statistics(err, ref, bound, relative=True, u=U_BF16)
    assert not s.biased and not s.noisy, vars(s)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(40, 200), st.integers(16, 64), st.sampled_from([-1, 1]))
def test_a_scale_error_of_half_a_unit_roundoff_is_biased(seed, rows, width, sign):
    ref, bound = _outputs(seed, rows, width)
    c = sign * U_BF16 / 2  # 0.2%: inside every element's budget of 2u
    got = (ref * (1 + c)).to(torch.bfloat16).double()
    assert ((got - ref).abs() <= bound).all()
    s = rounding_statistics(got - ref, ref, bound, relative=True, u=U_BF16)
    assert s.biased and s.bias == pytest.approx(c, rel=0.3) and s.p <= ALPHA
    assert "systematic error" in s.bias_reason("out", True) and f"of {rows} rows" in s.bias_reason("out", True)


def test_few_rows_cannot_be_called_biased():
    ref, bound = _outputs(0, 20, 64)
    got = (ref * 1.02).to(torch.bfloat16).double()  # 2%: large, but only 20 independent rows
    assert not rounding_statistics(got - ref, ref, bound.mul(10), relative=True, u=U_BF16).biased


def test_bias_below_the_floor_is_not_reported():
    ref, bound = _outputs(1, 100, 64)
    got = ref * (1 + U_BF16 / 8)  # significant (every row leans up) but under u / 4
    s = rounding_statistics(got - ref, ref, bound, relative=True, u=U_BF16)
    assert s.p <= ALPHA and not s.biased


def test_an_additive_offset_is_judged_per_element():
    ref = torch.linspace(-3, 9, 64, dtype=torch.float64)
    bound = torch.full_like(ref, 1e-5)
    s = rounding_statistics(torch.full_like(ref, 0.6e-5), ref, bound, relative=False, u=0.0)
    assert s.biased and s.floor == pytest.approx(0.5e-5) and s.rows == 64
    assert not rounding_statistics(torch.full_like(ref, 0.4e-5), ref, bound, relative=False, u=0.0).biased


def test_noise_that_uses_the_whole_budget_is_noisy():
    ref, bound = _outputs(2, 200, 64)
    sign = torch.randint(0, 2, ref.shape, generator=torch.Generator().manual_seed(3)).double() * 2 - 1
    err = 0.6 * bound * sign  # every element inside its budget, none rounding-sized
    s = rounding_statistics(err, ref, bound, relative=True, u=U_BF16)
    assert s.noisy and not s.biased and s.rho == pytest.approx(0.6)
    assert "RMS error" in s.norm_reason("out")


def test_the_norm_bound_tightens_towards_one_over_sqrt_12_as_rows_are_added():
    bounds = [rounding_statistics(*(3 * [_outputs(0, n, 8)[0]]), relative=True, u=U_BF16).rho_bound for n in (30, 3000)]
    assert 1 >= bounds[0] > bounds[1] > math.sqrt(1 / 12)


def test_non_finite_reference_elements_are_left_out():
    ref, bound = _outputs(4, 40, 16)
    ref[0, 0], ref[1, :] = math.inf, -math.inf
    err = torch.where(torch.isfinite(ref), ref.to(torch.bfloat16).double() - ref, 0.0)
    s = rounding_statistics(err, ref, bound, relative=True, u=U_BF16)
    assert math.isfinite(s.bias) and math.isfinite(s.rho) and not s.biased


def test_judge_fails_a_biased_output_within_its_per_element_budget():
    ref, bound = _outputs(5, 64, 32)
    lse = torch.randn(64, dtype=torch.float64)
    got = ((ref * (1 + U_BF16 / 2)).to(torch.bfloat16), lse.float())
    bounds = (bound, torch.full_like(lse, 1e-6))
    verdict, reason, metrics, _, _ = judge(("out", "lse"), got, (ref, lse), bounds, u=U_BF16)
    by = {(m.output, m.name): m for m in metrics}
    assert verdict == "fail" and reason.startswith("out: systematic error +0.")
    assert by["out", "max_error/bound"].ok and not by["out", "bias/floor"].ok and by["lse", "bias/floor"].ok
    assert by["out", "rms/budget"].ok


def test_judge_passes_a_correctly_rounded_output():
    ref, bound = _outputs(6, 64, 32)
    verdict, reason, metrics, _, _ = judge(("out",), (ref.to(torch.bfloat16),), (ref,), (bound,), u=U_BF16)
    assert verdict == "pass", reason
    assert {m.name for m in metrics} == {"max_error/bound", "bias/floor", "rms/budget"}


def test_an_empty_output_has_nothing_to_judge():
    empty = torch.zeros(3, 0, dtype=torch.float64)
    s = rounding_statistics(empty, empty, empty, relative=True, u=U_BF16)
    assert not s.biased and not s.noisy and s.rows == 0
