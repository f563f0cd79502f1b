"""RDP of the distributed discrete Gaussian and Skellam sums (edge_sdk.privacy.discrete).

Oracles: hand-computed values of the paper formulas; the exact Renyi divergence of the
summed noise (the pmf of a sum of n discrete Gaussians by convolution, the Skellam pmf from
scipy), which every bound must dominate; dp_accounting, which has neither mechanism but has
the one-device discrete Gaussian (its PLD) and the Gaussian, the large-noise limit of both.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from scipy.special import logsumexp

from edge_sdk.privacy.discrete import (
    ddg_tau,
    rdp_distributed_discrete_gaussian,
    rdp_distributed_skellam,
)
from edge_sdk.privacy.events import (
    DistributedDiscreteGaussian,
    DistributedSkellam,
    Gaussian,
    PoissonSubsampledGaussian,
    UnsupportedEventError,
)
from edge_sdk.privacy.rdp import (
    DEFAULT_ORDERS,
    RdpAccountant,
    discrete_epsilon,
    rdp_of,
    rdp_to_epsilon,
)

FAST_ORDERS = (1.1, 1.5, 2.0, 2.5, 3.0, 5.0, 8.0, 16.0, 32.0, 64.0, 256.0)
INT_ORDERS = tuple(a for a in DEFAULT_ORDERS if float(a).is_integer())


# ----------------------------------------------------------------------- hand values


def test_tau_by_hand() -> None:
    assert ddg_tau(1.0, 1) == 0.0
    assert ddg_tau(1.0, 2) == pytest.approx(10 * math.exp(-(math.pi**2)), rel=1e-15)
    three = 10 * (math.exp(-2 * math.pi**2 / 2) + math.exp(-2 * math.pi**2 * 2 / 3))
    assert ddg_tau(1.0, 3) == pytest.approx(three, rel=1e-15)
    k = np.arange(1, 7)
    assert ddg_tau(0.6, 7) == pytest.approx(
        10 * np.exp(-2 * math.pi**2 * 0.36 * k / (k + 1)).sum(), rel=1e-14
    )


def test_ddg_one_device_is_the_discrete_gaussian() -> None:
    # n = 1: tau = 0 and every branch is a D2^2 / (2 sigma^2) (CKS 2020).
    r = rdp_distributed_discrete_gaussian(3.0, 7.0, 2.0, 1, 10, FAST_ORDERS)
    np.testing.assert_allclose(r, np.array(FAST_ORDERS) * 9 / 8, rtol=1e-15)


def test_ddg_by_hand() -> None:
    # sigma = 1, n = 2, d = 4, D2 = 2, D1 = 4, order 2: tau = 10 e^-pi^2, s^2 = 2.
    tau = 10 * math.exp(-(math.pi**2))
    a, s2, d, d2, d1 = 2.0, 2.0, 4, 2.0, 4.0
    first = max(a * d2**2 / (2 * s2) + tau * d, a * (d2**2 / (2 * s2) + tau * d / 4))
    second = a / 2 * (d2**2 / s2 + 2 * d1 * tau / math.sqrt(s2) + tau**2 * d)
    third = a / 2 * (d2 / math.sqrt(s2) + tau * math.sqrt(d)) ** 2
    one_device = a * d2**2 / 2
    want = min(first, second, third, one_device)
    assert want == pytest.approx(2.0020689, abs=1e-7)  # the first branch, A reading
    got = rdp_distributed_discrete_gaussian(d2, d1, 1.0, 2, d, [a])
    assert got[0] == pytest.approx(want, rel=1e-14)


def test_ddg_first_branch_charges_the_looser_reading() -> None:
    # Small orders: Prop. 14 (+ tau d) is the larger; large orders: Thm. 1 (a tau d / 4).
    sigma, n, d, d2 = 0.7, 3, 50, 1.0
    tau = ddg_tau(sigma, n)
    s2 = n * sigma**2
    for a in (1.5, 8.0):
        # D1 huge: the L1 branch is out; d large: the third branch is out.
        got = rdp_distributed_discrete_gaussian(d2, 1e6, sigma, n, d, [a])[0]
        want = max(a * d2**2 / (2 * s2) + tau * d, a * (d2**2 / (2 * s2) + tau * d / 4))
        assert got == pytest.approx(min(want, a * d2**2 / (2 * sigma**2)), rel=1e-12)


def test_skellam_by_hand() -> None:
    # D2 = 2, D1 = 4, mu = 1, n = 3: V = 6. Order 3: 3*4/12 + min(44/144, 12/12).
    want = 1.0 + 44.0 / 144.0
    got = rdp_distributed_skellam(4.0, 2.0, 1.0, 3, [3.0, 2.5, 2.0])
    assert got[0] == pytest.approx(want, rel=1e-15)
    assert got[1] == got[0]  # fractional orders are charged at ceil(a)
    assert got[2] == pytest.approx(2 * 4 / 12 + min((3 * 4 + 24) / 144, 1.0), rel=1e-15)
    # Small V: the second branch of the min, 3 D1 / (2 V).
    small = rdp_distributed_skellam(4.0, 2.0, 0.05, 1, [2.0])[0]
    assert small == pytest.approx(2 * 4 / 0.2 + 3 * 4 / 0.2, rel=1e-15)


def test_no_noise_and_no_sensitivity() -> None:
    assert np.all(np.isinf(rdp_distributed_discrete_gaussian(1.0, 1.0, 0.0, 5, 3)))
    assert np.all(np.isinf(rdp_distributed_skellam(1.0, 1.0, 0.0, 5)))
    assert np.all(rdp_distributed_discrete_gaussian(0.0, 0.0, 0.3, 5, 3) == 0)
    assert np.all(rdp_distributed_skellam(0.0, 0.0, 1.0, 5) == 0)
    ev = DistributedSkellam(l1_sensitivity=1, l2_sensitivity=1, mu=0, devices=2, steps=3)
    assert discrete_epsilon(ev, 1e-5) == math.inf


# -------------------------------------------------------------------- exact oracles


def _log_pmf_sum_of_dgauss(sigma: float, n: int) -> tuple[np.ndarray, int]:
    half = int(12 * sigma) + 12
    z = np.arange(-half, half + 1, dtype=np.float64)
    p = np.exp(-(z**2) / (2 * sigma**2))
    p /= p.sum()
    out = p
    for _ in range(n - 1):
        out = np.convolve(out, p)
    with np.errstate(divide="ignore"):
        return np.log(out), n * half  # index of 0


def _renyi_shift(logp: np.ndarray, shift: int, a: float) -> float:
    """D_a(Y + shift || Y) from log-pmf values on a contiguous integer grid."""
    lp = logp[: logp.size - shift] if shift else logp  # P(Y + shift = y) = p(y - shift)
    lq = logp[shift:]
    ok = np.isfinite(lp) & np.isfinite(lq)
    return float(logsumexp(a * lp[ok] + (1 - a) * lq[ok]) / (a - 1))


@pytest.mark.parametrize(("sigma", "n"), [(0.5, 2), (0.5, 6), (0.7, 3), (0.6, 10), (1.0, 4)])
def test_ddg_bound_dominates_the_exact_divergence(sigma: float, n: int) -> None:
    logp, _ = _log_pmf_sum_of_dgauss(sigma, n)
    orders = (1.1, 1.5, 2.0, 3.0, 5.0, 8.0)
    for shift in (1, 2, 3):
        exact = np.array([_renyi_shift(logp, shift, a) for a in orders])
        # One coordinate moved by `shift` (d = 1), and two coordinates each moved (d = 2).
        one = rdp_distributed_discrete_gaussian(shift, shift, sigma, n, 1, orders)
        two = rdp_distributed_discrete_gaussian(
            shift * math.sqrt(2), 2 * shift, sigma, n, 2, orders
        )
        assert np.all(one >= exact * (1 - 1e-9))
        assert np.all(two >= 2 * exact * (1 - 1e-9))


@pytest.mark.parametrize("mu", [0.05, 0.3, 1.0, 4.0, 30.0, 500.0])
@pytest.mark.parametrize("n", [1, 7])
def test_skellam_bound_dominates_the_exact_divergence(mu: float, n: int) -> None:
    m = n * mu  # the sum is Sk(n mu, n mu)
    half = int(40 * math.sqrt(2 * m)) + 80
    z = np.arange(-half, half + 1)
    logp = stats.skellam.logpmf(z, m, m)
    orders = (1.01, 1.3, 2.0, 2.5, 4.0, 10.0, 32.0)
    for shift in (1, 2, 5):
        exact = np.array([_renyi_shift(logp, shift, a) for a in orders])
        bound = rdp_distributed_skellam(shift, shift, mu, n, orders)
        assert np.all(bound >= exact * (1 - 1e-9)), (shift, bound / exact)
    # Sharp for large variance: within 0.5% of the truth at integer orders.
    if m >= 500:
        assert bound[4] == pytest.approx(exact[4], rel=5e-3)


# ------------------------------------------------------------------ dp_accounting


def _dp_gaussian_eps(z: float, delta: float, orders: tuple[float, ...]) -> float:
    acc = dp_accounting.rdp.RdpAccountant(orders=list(orders))
    acc.compose(dp_accounting.GaussianDpEvent(z))
    return acc.get_epsilon(delta)


@pytest.mark.reference
def test_one_device_matches_dp_accounting_gaussian_rdp() -> None:
    # N_Z(0, sigma^2) has RDP a D^2 / (2 sigma^2), the Gaussian's at z = sigma / D.
    for sigma, d2 in ((2.0, 1.0), (5.0, 3.0), (40.0, 17.0)):
        ev = DistributedDiscreteGaussian(
            l2_sensitivity=d2, l1_sensitivity=d2, sigma=sigma, devices=1, dim=1
        )
        ours = discrete_epsilon(ev, 1e-5, INT_ORDERS)
        assert ours == pytest.approx(_dp_gaussian_eps(sigma / d2, 1e-5, INT_ORDERS), rel=1e-6)


@pytest.mark.reference
def test_one_device_not_below_dp_accounting_discrete_gaussian_pld() -> None:
    for sigma, sens in ((1.0, 1), (3.0, 2), (10.0, 5)):
        pld = dp_pld.from_discrete_gaussian_mechanism(sigma, sensitivity=sens)
        theirs = pld.get_epsilon_for_delta(1e-5)
        ev = DistributedDiscreteGaussian(
            l2_sensitivity=sens, l1_sensitivity=sens, sigma=sigma, devices=1, dim=1
        )
        ours = discrete_epsilon(ev, 1e-5)
        assert theirs * (1 - 1e-3) <= ours <= theirs * 1.3


@pytest.mark.reference
def test_large_noise_limit_is_the_gaussian() -> None:
    # tau ~ 0 and V large: both sums behave like a Gaussian of std sqrt(n) sigma.
    n, d2, d = 50, 10.0, 100
    for sigma in (5.0, 20.0):
        z = math.sqrt(n) * sigma / d2
        gauss = _dp_gaussian_eps(z, 1e-5, DEFAULT_ORDERS)
        ddg = DistributedDiscreteGaussian(
            l2_sensitivity=d2, l1_sensitivity=d2 * math.sqrt(d), sigma=sigma, devices=n, dim=d
        )
        sk = DistributedSkellam(
            l1_sensitivity=d2 * math.sqrt(d), l2_sensitivity=d2, mu=sigma**2 / 2, devices=n
        )
        for ev, rel in ((ddg, 1e-6), (sk, 0.02)):
            ours = discrete_epsilon(ev, 1e-5)
            assert gauss * (1 - 1e-6) <= ours <= gauss * (1 + rel)


# ------------------------------------------------------------------------ properties


@settings(max_examples=60, deadline=None)
@given(
    sigma=st.floats(0.2, 6.0),
    factor=st.floats(1.0, 3.0),
    n=st.integers(1, 300),
    extra=st.integers(1, 300),
    d=st.integers(1, 5000),
    d2=st.floats(0.5, 50.0),
    l1_frac=st.floats(0.0, 1.0),
    steps=st.integers(1, 50),
)
def test_ddg_monotone(
    sigma: float,
    factor: float,
    n: int,
    extra: int,
    d: int,
    d2: float,
    l1_frac: float,
    steps: int,
) -> None:
    d1 = d2 + l1_frac * (math.sqrt(d) - 1) * d2

    def rdp(**kw: float) -> np.ndarray:
        args = {
            "l2_sensitivity": d2,
            "l1_sensitivity": d1,
            "sigma": sigma,
            "devices": n,
            "dim": d,
            "steps": 1,
        } | kw
        return rdp_of(DistributedDiscreteGaussian(**args), FAST_ORDERS)  # type: ignore[arg-type]

    base = rdp()
    tol = 1e-12 * base + 1e-300
    assert np.all(rdp(sigma=sigma * factor) <= base + tol)
    assert np.all(rdp(devices=n + extra) <= base + tol)
    assert np.all(rdp(dim=d + extra) >= base - tol)
    assert np.all(rdp(l2_sensitivity=d2 * factor, l1_sensitivity=d1 * factor) >= base - tol)
    np.testing.assert_allclose(rdp(steps=steps), steps * base, rtol=1e-15)
    assert np.all(np.diff(base) >= -tol[1:])  # non-decreasing in the order


@settings(max_examples=60, deadline=None)
@given(
    mu=st.floats(0.01, 1e4),
    factor=st.floats(1.0, 3.0),
    n=st.integers(1, 10_000),
    extra=st.integers(1, 1000),
    d2=st.floats(0.5, 100.0),
    l1_factor=st.floats(1.0, 100.0),
    steps=st.integers(1, 50),
)
def test_skellam_monotone(
    mu: float, factor: float, n: int, extra: int, d2: float, l1_factor: float, steps: int
) -> None:
    def rdp(**kw: float) -> np.ndarray:
        args = {
            "l1_sensitivity": d2 * l1_factor,
            "l2_sensitivity": d2,
            "mu": mu,
            "devices": n,
            "steps": 1,
        } | kw
        return rdp_of(DistributedSkellam(**args), FAST_ORDERS)  # type: ignore[arg-type]

    base = rdp()
    tol = 1e-12 * base
    assert np.all(rdp(mu=mu * factor) <= base + tol)
    assert np.all(rdp(devices=n + extra) <= base + tol)
    assert np.all(rdp(l2_sensitivity=d2 * factor) >= base - tol)
    np.testing.assert_allclose(rdp(steps=steps), steps * base, rtol=1e-15)
    assert np.all(np.diff(base) >= -tol[1:])


# ------------------------------------------------------------------------ accountant


def test_accountant_composes_discrete_and_gaussian_events() -> None:
    ddg = DistributedDiscreteGaussian(
        l2_sensitivity=30.0, l1_sensitivity=300.0, sigma=8.0, devices=20, dim=128, steps=2
    )
    sk = DistributedSkellam(l1_sensitivity=300.0, l2_sensitivity=30.0, mu=40.0, devices=20)
    g = Gaussian(noise_multiplier=3.0)
    acc = RdpAccountant().compose(ddg).compose(sk, count=3).compose(g)
    orders = np.array(DEFAULT_ORDERS)
    total = rdp_of(ddg) + 3 * rdp_of(sk) + rdp_of(g)
    np.testing.assert_allclose(acc.rdp, total, rtol=1e-14)
    assert acc.get_epsilon(1e-5) == rdp_to_epsilon(total, orders, 1e-5)[0]


def test_accountant_check_then_commit() -> None:
    # Since F1 the accountant checks a discrete event's adjacency: this one is stated under
    # substitution, as the accountant is; the add/remove one below is refused (rule 4).
    ev = DistributedSkellam(l1_sensitivity=10.0, l2_sensitivity=3.0, mu=5.0, devices=4,
                            adjacency="substitution")
    acc = RdpAccountant(adjacency="substitution").compose(ev)
    before = acc.rdp
    with pytest.raises(UnsupportedEventError, match="DistributedSkellam stated under add_remove"):
        acc.compose(DistributedSkellam(l1_sensitivity=10.0, l2_sensitivity=3.0, mu=5.0,
                                       devices=4))
    with pytest.raises(ValueError, match="count must be an integer >= 0, got -1"):
        acc.compose(ev, count=-1)
    with pytest.raises(ValueError, match="add/remove"):
        acc.compose(PoissonSubsampledGaussian(noise_multiplier=1.0, sample_rate=0.1))
    np.testing.assert_array_equal(acc.rdp, before)
    acc.compose(ev, count=0)
    np.testing.assert_array_equal(acc.rdp, before)


# ------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sigma": -1.0}, "sigma must be finite and >= 0, got -1.0"),
        ({"sigma": math.nan}, "sigma must be finite"),
        ({"devices": 0}, "devices must be an integer >= 1, got 0"),
        ({"devices": True}, "devices must be an integer >= 1, got True"),
        ({"dim": 2.0}, "dim must be an integer >= 1, got 2.0"),
        ({"l2_sensitivity": "1"}, "l2_sensitivity must be a finite real number >= 0"),
        ({"steps": 0}, "steps must be an integer >= 1, got 0"),
    ],
)
def test_ddg_event_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "l2_sensitivity": 1.0,
        "l1_sensitivity": 1.0,
        "sigma": 1.0,
        "devices": 2,
        "dim": 3,
    } | kwargs
    with pytest.raises(ValueError, match=match):
        DistributedDiscreteGaussian(**args)  # type: ignore[arg-type]


def test_skellam_event_validation_and_variance() -> None:
    with pytest.raises(ValueError, match="mu must be finite and >= 0, got -0.5"):
        DistributedSkellam(l1_sensitivity=1, l2_sensitivity=1, mu=-0.5, devices=2)
    with pytest.raises(ValueError, match="orders must be finite and > 1, got 1.0"):
        rdp_distributed_skellam(1.0, 1.0, 1.0, 2, [1.0])
    ev = DistributedSkellam(l1_sensitivity=1, l2_sensitivity=1, mu=2.5, devices=4)
    assert ev.variance == 20.0
    with pytest.raises(AttributeError):
        ev.mu = 3.0  # type: ignore[misc]
