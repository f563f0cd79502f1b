"""RDP accounting against dp_accounting, an mpmath integral and Wang-Balle-Kasiviswanathan.

dp_accounting (2.4.x) is exact at integer orders, and there we agree to 1e-6 in RDP and in
epsilon. At fractional orders its series (``_compute_log_a_frac``) adds the absolute values
of the generalized binomial terms, which alternate in sign, so it over-states RDP (by up to
~90% near order 1.1 for q = 0.3) and sometimes gives up (inf); ours keeps the signs and
matches a direct numerical integral of the Renyi divergence. There we check ours <= theirs
and ours == the integral.
"""

from __future__ import annotations

import functools
import itertools
import math

import dp_accounting
import mpmath
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.privacy.events import (
    Composed,
    Gaussian,
    PoissonSubsampledGaussian,
    SampledWithoutReplacementGaussian,
)
from edge_sdk.privacy.rdp import (
    DEFAULT_ORDERS,
    RdpAccountant,
    compute_rdp,
    rdp_gaussian,
    rdp_poisson_subsampled_gaussian,
    rdp_sampled_without_replacement_gaussian,
    rdp_to_epsilon,
    rdp_to_epsilon_classic,
)

QS = (1e-3, 0.01, 0.05, 0.3, 1.0)
SIGMAS = (0.5, 0.8, 1.0, 2.0, 5.0)
STEPS = (1, 100, 10_000)
INT_ORDERS = [a for a in DEFAULT_ORDERS if float(a).is_integer()]
FRAC_ORDERS = [a for a in DEFAULT_ORDERS if not float(a).is_integer()]
FAST_ORDERS = (1.5, 2.0, 2.5, 3.0, 4.5, 8.0, 16.0, 32.0, 64.0)


def _dp_event(q: float, sigma: float, steps: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )


@functools.cache
def _theirs_frac(q: float, sigma: float) -> np.ndarray:
    acc = dp_accounting.rdp.RdpAccountant(orders=FRAC_ORDERS)
    acc.compose(_dp_event(q, sigma, 1))
    return acc._rdp.copy()


def _exact_rdp_integral(q: float, sigma: float, alpha: float) -> float:
    """D_alpha(mixture || N(0, s^2)) by mpmath quadrature (the definition, not a series)."""
    with mpmath.workdps(30):
        q_, s, a = mpmath.mpf(q), mpmath.mpf(sigma), mpmath.mpf(alpha)

        def f(x):
            ratio = mpmath.exp((2 * x - 1) / (2 * s * s))
            return mpmath.npdf(x, 0, s) * ((1 - q_) + q_ * ratio) ** a

        z0 = s * s * mpmath.log(1 / q_ - 1) + mpmath.mpf(1) / 2
        cuts = sorted({-40 * s, mpmath.mpf(0), z0, mpmath.mpf(1), a + 40 * s})
        total = mpmath.quad(f, [-mpmath.inf, *cuts, mpmath.inf])
        return float(mpmath.log(total) / (a - 1))


# ------------------------------------------------------------- dp_accounting oracle


@pytest.mark.reference
@pytest.mark.parametrize(("q", "sigma", "steps"), list(itertools.product(QS, SIGMAS, STEPS)))
def test_integer_orders_match_dp_accounting(q: float, sigma: float, steps: int) -> None:
    theirs = dp_accounting.rdp.RdpAccountant(orders=INT_ORDERS)
    theirs.compose(_dp_event(q, sigma, steps))
    ours = RdpAccountant(orders=INT_ORDERS).compose(
        PoissonSubsampledGaussian(noise_multiplier=sigma, sample_rate=q, steps=steps)
    )
    finite = np.isfinite(theirs._rdp)
    assert finite.all()
    np.testing.assert_allclose(ours.rdp, theirs._rdp, rtol=1e-6, atol=0)
    for delta in (1e-5, 1e-3):
        e_theirs, o_theirs = theirs.get_epsilon_and_optimal_order(delta)
        e_ours, o_ours = ours.get_epsilon_and_order(delta)
        assert e_ours == pytest.approx(e_theirs, rel=1e-6, abs=1e-12)


@pytest.mark.reference
@pytest.mark.parametrize(("q", "sigma"), list(itertools.product(QS[:-1], SIGMAS)))
def test_fractional_orders_never_above_dp_accounting(q: float, sigma: float) -> None:
    ours = rdp_poisson_subsampled_gaussian(q, sigma, FRAC_ORDERS)
    theirs = _theirs_frac(q, sigma)
    finite = np.isfinite(theirs)
    assert np.all(ours[finite] <= theirs[finite] * (1 + 1e-9))
    assert np.all(np.isfinite(ours))


@pytest.mark.reference
@pytest.mark.parametrize(("q", "sigma", "steps"), list(itertools.product(QS, SIGMAS, STEPS)))
def test_default_grid_epsilon_never_above_dp_accounting(q: float, sigma: float, steps: int) -> None:
    delta = 1e-5
    orders = np.asarray(DEFAULT_ORDERS)
    frac = ~np.equal(np.mod(orders, 1), 0)
    theirs = np.empty_like(orders)
    theirs[frac] = _theirs_frac(q, sigma) if q < 1 else orders[frac] / (2 * sigma**2)
    theirs[~frac] = dp_rdp._compute_rdp_poisson_subsampled_gaussian(q, sigma, orders[~frac])
    e_theirs, _ = dp_rdp.compute_epsilon(orders, steps * theirs, delta)
    ours = RdpAccountant().compose(
        PoissonSubsampledGaussian(noise_multiplier=sigma, sample_rate=q, steps=steps)
    )
    e_ours = ours.get_epsilon(delta)
    assert e_ours <= e_theirs * (1 + 1e-9) + 1e-12
    # ... and no lower than what exact integer orders alone certify, minus rounding.
    e_int, _ = dp_rdp.compute_epsilon(orders[~frac], steps * theirs[~frac], delta)
    assert e_ours <= e_int * (1 + 1e-9) + 1e-12


@pytest.mark.reference
@pytest.mark.parametrize(
    ("q", "sigma", "alpha"),
    [(0.3, 0.8, 1.25), (0.05, 1.0, 1.3), (0.3, 2.0, 1.5), (0.05, 0.5, 2.5), (0.3, 1.0, 3.7),
     (0.01, 0.5, 5.5)],
)
def test_fractional_orders_match_numerical_integral(q: float, sigma: float, alpha: float) -> None:
    ours = rdp_poisson_subsampled_gaussian(q, sigma, [alpha])[0]
    assert ours == pytest.approx(_exact_rdp_integral(q, sigma, alpha), rel=1e-6)
    assert ours >= _exact_rdp_integral(q, sigma, alpha) * (1 - 1e-12)


@pytest.mark.reference
def test_integer_order_matches_numerical_integral() -> None:
    ours = rdp_poisson_subsampled_gaussian(0.3, 1.0, [7.0])[0]
    assert ours == pytest.approx(_exact_rdp_integral(0.3, 1.0, 7.0), rel=1e-9)


@pytest.mark.reference
@pytest.mark.parametrize(
    ("q", "sigma", "alpha"), [(1e-4, 10.0, 1.15), (1e-4, 5.0, 1.1), (1e-3, 5.0, 1.1)]
)
def test_fractional_orders_near_one_keep_their_precision(
    q: float, sigma: float, alpha: float
) -> None:
    # A - 1 ~ 1e-11 here: log A is only as good as the sum's rounding near 1, which the
    # double-double partial sums keep (an exactly rounded sum was 1e-5 below the truth).
    ours = rdp_poisson_subsampled_gaussian(q, sigma, [alpha])[0]
    exact = _exact_rdp_integral(q, sigma, alpha)
    assert exact * (1 - 1e-12) <= ours <= exact * (1 + 1e-6)


def test_orders_computed_together_match_orders_alone() -> None:
    # All integer orders share one flat reduction and all fractional ones one table of
    # j-only factors (or, for many distinct fractional parts, direct evaluation): an
    # order's RDP must not depend on which other orders it is computed with (beyond
    # rounding: the chunk widths of the series depend on the largest order).
    orders = [1.13, 2.27, 3.41, 4.5, 7.5, 2.0, 3.0, 17.0, 256.0, 1024.0, 10.95, 50.5]
    for q, sigma in ((1e-3, 1.1), (0.05, 0.8), (0.3, 2.0)):
        together = rdp_poisson_subsampled_gaussian(q, sigma, orders)
        alone = [rdp_poisson_subsampled_gaussian(q, sigma, [a])[0] for a in orders]
        np.testing.assert_allclose(together, alone, rtol=1e-12, atol=0)


def test_log_factorial_table_matches_lgamma() -> None:
    from edge_sdk.privacy.rdp import _log_factorials

    table = _log_factorials(3000)
    exact = np.array([math.lgamma(k + 1) for k in range(3001)])
    np.testing.assert_array_equal(table[:65], exact[:65])  # lgamma itself below 65
    assert np.all(np.abs(table - exact) <= 4 * np.spacing(np.maximum(exact, 1.0)))


@pytest.mark.reference
@pytest.mark.parametrize(("q", "sigma"), [(0.001, 1.0), (0.01, 0.5), (0.1, 2.0), (0.5, 5.0)])
def test_without_replacement_matches_dp_accounting(q: float, sigma: float) -> None:
    orders = np.arange(2, 65, dtype=float)
    ours = rdp_sampled_without_replacement_gaussian(q, sigma, orders)
    theirs = dp_rdp._compute_rdp_sample_wor_gaussian(q, sigma, orders)
    amplified = theirs < orders / (2 * sigma**2)  # we also cap at the plain Gaussian
    np.testing.assert_allclose(ours[amplified], theirs[amplified], rtol=1e-6)
    assert np.all(ours <= orders / (2 * sigma**2))


def _wbk_theorem27_mpmath(q: float, sigma: float, alpha: int) -> float:
    with mpmath.workdps(300):
        q_, s2 = mpmath.mpf(q), 2 * mpmath.mpf(sigma) ** 2

        def diff(l: int):  # noqa: E741  (l is the paper's symbol)
            return mpmath.fsum(
                (-1) ** (l - i) * mpmath.binomial(l, i) * mpmath.exp(i * (i - 1) / s2)
                for i in range(l + 1)
            )

        e2 = mpmath.exp(2 / s2)
        total = 1 + q_**2 * mpmath.binomial(alpha, 2) * min(4 * (e2 - 1), 2 * e2)
        for j in range(3, alpha + 1):
            pv = 4 * mpmath.sqrt(diff(2 * (j // 2)) * diff(2 * ((j + 1) // 2)))
            total += q_**j * mpmath.binomial(alpha, j) * min(pv, 2 * mpmath.exp(j * (j - 1) / s2))
        return float(min(mpmath.log(total) / (alpha - 1), alpha / s2))


@pytest.mark.reference
@pytest.mark.parametrize(
    ("q", "sigma", "alpha"), [(0.5, 20.0, 64), (0.1, 20.0, 30), (0.5, 5.0, 17)]
)
def test_without_replacement_matches_high_precision_theorem27(
    q: float, sigma: float, alpha: int
) -> None:
    # Large sigma: the forward differences cancel catastrophically in float64 (where
    # dp_accounting's values drift); ours are computed in decimal with an error bound.
    ours = rdp_sampled_without_replacement_gaussian(q, sigma, [float(alpha)])[0]
    exact = _wbk_theorem27_mpmath(q, sigma, alpha)
    assert ours == pytest.approx(exact, rel=1e-8)
    assert ours >= exact


def test_without_replacement_fractional_orders_interpolate_the_log_moments() -> None:
    k = {
        a: (a - 1) * rdp_sampled_without_replacement_gaussian(0.05, 1.0, [a])[0]
        for a in (2.0, 3.0)
    }
    mid = rdp_sampled_without_replacement_gaussian(0.05, 1.0, [2.25])[0]
    assert mid == pytest.approx((0.75 * k[2.0] + 0.25 * k[3.0]) / 1.25, rel=1e-12)
    low = rdp_sampled_without_replacement_gaussian(0.05, 1.0, [1.5])[0]
    assert low == pytest.approx(0.5 * k[2.0] / 0.5, rel=1e-12)


@pytest.mark.reference
def test_conversion_matches_dp_accounting_compute_epsilon() -> None:
    rng = np.random.default_rng(0)
    orders = np.asarray(DEFAULT_ORDERS)
    for _ in range(50):
        rdp = orders * rng.uniform(1e-4, 2.0) + rng.uniform(0, 0.1)
        delta = 10 ** rng.uniform(-10, -1)
        ours = rdp_to_epsilon(rdp, orders, delta)
        theirs = dp_rdp.compute_epsilon(orders, rdp, delta)
        assert ours[0] == pytest.approx(theirs[0], rel=1e-12, abs=1e-15)


# --------------------------------------------------------------- hand-computed values


def test_gaussian_rdp_closed_form() -> None:
    np.testing.assert_allclose(rdp_gaussian(2.0, [2.0, 10.0]), [0.25, 1.25])
    assert np.all(np.isinf(rdp_gaussian(0.0, [2.0])))


def test_improved_conversion_by_hand() -> None:
    # One order: eps = r + log(1 - 1/a) - (log(delta) + log(a)) / (a - 1).
    r, a, d = 0.5, 4.0, 1e-5
    expected = r + math.log(0.75) - (math.log(d) + math.log(a)) / 3
    assert rdp_to_epsilon([r], [a], d) == pytest.approx((expected, 4.0))
    assert rdp_to_epsilon_classic([r], [a], d) == pytest.approx((r - math.log(d) / 3, 4.0))


def test_classic_conversion_is_looser() -> None:
    orders = np.asarray(DEFAULT_ORDERS)
    rdp = rdp_poisson_subsampled_gaussian(0.01, 1.0, orders) * 1000
    assert rdp_to_epsilon_classic(rdp, orders, 1e-5)[0] > rdp_to_epsilon(rdp, orders, 1e-5)[0]


def test_epsilon_is_zero_when_delta_covers_total_variation() -> None:
    # KL <= rdp = 1e-8, so TV <= sqrt(1 - exp(-1e-8)) ~ 1e-4 < delta = 0.01.
    assert rdp_to_epsilon([1e-8], [2.0], 0.01) == (0.0, 2.0)


def test_no_noise_means_infinite_epsilon() -> None:
    acc = RdpAccountant().compose(PoissonSubsampledGaussian(noise_multiplier=0.0, sample_rate=0.1))
    eps, order = acc.get_epsilon_and_order(1e-5)
    assert eps == math.inf and math.isnan(order)
    assert RdpAccountant().compose(Gaussian(noise_multiplier=0.0)).get_epsilon(0.5) == math.inf


def test_delta_zero() -> None:
    assert RdpAccountant().get_epsilon(0.0) == 0.0
    acc = RdpAccountant().compose(Gaussian(noise_multiplier=1.0))
    assert acc.get_epsilon(0.0) == math.inf


def test_published_dp_sgd_value() -> None:
    # TensorFlow Privacy's MNIST tutorial: 60 epochs of batch 256 out of 60,000 with noise
    # multiplier 1.1 is reported as eps = 3.01 at delta = 1e-5 (classic conversion); the
    # improved conversion gives 2.60 (dp_accounting: 2.6003).
    acc = RdpAccountant().compose(
        PoissonSubsampledGaussian(noise_multiplier=1.1, sample_rate=256 / 60_000, steps=60 * 235)
    )
    assert rdp_to_epsilon_classic(acc.rdp, acc.orders, 1e-5)[0] == pytest.approx(3.01, abs=0.005)
    assert acc.get_epsilon(1e-5) == pytest.approx(2.6003, abs=1e-4)


# ------------------------------------------------------------------------ properties

sigmas = st.floats(0.3, 10.0)
rates = st.floats(1e-4, 1.0)
prop_settings = settings(max_examples=25, deadline=None)


@prop_settings
@given(q=rates, sigma=sigmas, steps=st.integers(1, 10_000), more=st.integers(1, 10_000))
def test_epsilon_monotone_in_steps(q: float, sigma: float, steps: int, more: int) -> None:
    a = RdpAccountant(FAST_ORDERS).compose(
        PoissonSubsampledGaussian(noise_multiplier=sigma, sample_rate=q, steps=steps))
    b = RdpAccountant(FAST_ORDERS).compose(
        PoissonSubsampledGaussian(noise_multiplier=sigma, sample_rate=q, steps=steps + more))
    assert b.get_epsilon(1e-5) >= a.get_epsilon(1e-5) >= 0


@prop_settings
@given(q1=rates, q2=rates, sigma=sigmas)
def test_rdp_monotone_in_sample_rate(q1: float, q2: float, sigma: float) -> None:
    lo, hi = sorted((q1, q2))
    r_lo = rdp_poisson_subsampled_gaussian(lo, sigma, FAST_ORDERS)
    r_hi = rdp_poisson_subsampled_gaussian(hi, sigma, FAST_ORDERS)
    assert np.all(r_lo <= r_hi * (1 + 1e-10) + 1e-300)


@prop_settings
@given(q=rates, s1=sigmas, s2=sigmas)
def test_rdp_decreasing_in_noise(q: float, s1: float, s2: float) -> None:
    lo, hi = sorted((s1, s2))
    r_lo = rdp_poisson_subsampled_gaussian(q, lo, FAST_ORDERS)
    r_hi = rdp_poisson_subsampled_gaussian(q, hi, FAST_ORDERS)
    assert np.all(r_hi <= r_lo * (1 + 1e-10) + 1e-300)


@prop_settings
@given(sigma=sigmas, steps=st.integers(1, 1000))
def test_full_sampling_is_the_plain_gaussian(sigma: float, steps: int) -> None:
    orders = np.asarray(FAST_ORDERS)
    ev = PoissonSubsampledGaussian(noise_multiplier=sigma, sample_rate=1.0, steps=steps)
    np.testing.assert_allclose(compute_rdp(ev, orders), steps * orders / (2 * sigma**2))
    np.testing.assert_allclose(
        compute_rdp(ev, orders), compute_rdp(Gaussian(noise_multiplier=sigma, steps=steps), orders)
    )


@prop_settings
@given(q=rates, sigma=sigmas, delta=st.floats(1e-12, 0.5))
def test_epsilon_nonnegative(q: float, sigma: float, delta: float) -> None:
    acc = RdpAccountant(FAST_ORDERS).compose(
        PoissonSubsampledGaussian(noise_multiplier=sigma, sample_rate=q))
    assert acc.get_epsilon(delta) >= 0


@prop_settings
@given(q=rates, sigma=sigmas, z=sigmas, n=st.integers(1, 50), k=st.integers(1, 50))
def test_composition_is_additive(q: float, sigma: float, z: float, n: int, k: int) -> None:
    a = PoissonSubsampledGaussian(noise_multiplier=sigma, sample_rate=q, steps=n)
    b = Gaussian(noise_multiplier=z, steps=k)
    one = RdpAccountant(FAST_ORDERS).compose(a).compose(b, count=3)
    two = RdpAccountant(FAST_ORDERS).compose(Composed(events=(a, b, b, b)))
    np.testing.assert_allclose(one.rdp, two.rdp, rtol=1e-12)
    np.testing.assert_allclose(
        one.rdp, compute_rdp(a, FAST_ORDERS) + 3 * compute_rdp(b, FAST_ORDERS), rtol=1e-12
    )


# ---------------------------------------------------------------- accountant contract


def test_compose_is_check_then_commit() -> None:
    acc = RdpAccountant(FAST_ORDERS).compose(Gaussian(noise_multiplier=2.0))
    before = acc.rdp
    wor = SampledWithoutReplacementGaussian(noise_multiplier=1.0, sample_size=10, dataset_size=100)
    with pytest.raises(ValueError, match="substitution"):
        acc.compose(Composed(events=(Gaussian(noise_multiplier=1.0), wor)))
    with pytest.raises(ValueError, match="count"):
        acc.compose(Gaussian(noise_multiplier=1.0), count=-1)
    with pytest.raises(ValueError, match="unsupported"):
        acc.compose("gaussian")  # type: ignore[arg-type]
    np.testing.assert_array_equal(acc.rdp, before)


def test_substitution_accountant() -> None:
    acc = RdpAccountant(adjacency="substitution")
    wor = SampledWithoutReplacementGaussian(
        noise_multiplier=1.0, sample_size=64, dataset_size=6400, steps=100)
    acc.compose(wor)
    eps = acc.get_epsilon(1e-5)
    plain = RdpAccountant().compose(Gaussian(noise_multiplier=1.0, steps=100))
    assert 0 < eps < plain.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="add/remove"):
        acc.compose(PoissonSubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01))


def test_zero_count_is_a_no_op_and_properties_are_copies() -> None:
    acc = RdpAccountant(FAST_ORDERS).compose(Gaussian(noise_multiplier=1.0), count=0)
    assert np.all(acc.rdp == 0) and acc.get_epsilon(1e-5) == 0.0
    acc.rdp[:] = 5
    acc.orders[:] = 5
    assert np.all(acc.rdp == 0) and acc.orders[0] == 1.5
    assert acc.adjacency == "add_remove"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: RdpAccountant(orders=[1.0, 2.0]), "orders"),
        (lambda: RdpAccountant(orders=[]), "orders"),
        (lambda: RdpAccountant(adjacency="replace"), "adjacency"),  # type: ignore[arg-type]
        (lambda: rdp_poisson_subsampled_gaussian(1.5, 1.0, [2.0]), "q"),
        (lambda: rdp_poisson_subsampled_gaussian(0.5, -1.0, [2.0]), "noise_multiplier"),
        (lambda: rdp_gaussian(math.nan, [2.0]), "noise_multiplier"),
        (lambda: rdp_to_epsilon([1.0], [2.0], 1.5), "delta"),
        (lambda: rdp_to_epsilon([1.0, 2.0], [2.0], 0.1), "same shape"),
        (lambda: rdp_to_epsilon([-1.0], [2.0], 0.1), "rdp"),
        (lambda: RdpAccountant().get_epsilon(-0.1), "delta"),
    ],
)
def test_bad_arguments_name_the_value(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
