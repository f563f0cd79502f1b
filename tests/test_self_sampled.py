"""The self-sampled release (issue 16's check-ins): its claimed RDP is never below the exact
Renyi divergence of worst cases built here, in either direction.

A device takes part in a round with its data with probability q, by its own coin, the null
record (zero) otherwise, its noise share in the sum either way
(:class:`edge_sdk.privacy.SelfSampled`). Under device-level zero-out the two output laws
are P = (1 - q) mu_0 + q mu_1 and Q = mu_0. The claim is Zhu and Wang 2019's Theorem 6 on
the inner release's curve (``edge_sdk.privacy.rdp.zhu_wang_bound``); here it is checked
against what an adversary faces exactly: the mixture pair, both orders of it, computed
on a grid, for the Gaussian (also against dp_accounting's exact sampled Gaussian) and for
the sum of a few discrete Gaussian shares with sigma small enough that KLS's extra term is
live.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event, rdp
from exact_support import log_pmf_sum

from edge_sdk.privacy import (
    DistributedDiscreteGaussian,
    RdpAccountant,
    SelfSampled,
    UnsupportedEventError,
    rdp_of,
    restate,
)
from edge_sdk.privacy._math import logsumexp
from edge_sdk.privacy.rdp import rdp_to_epsilon, zhu_wang_bound

DELTA = 1e-5


def _mixture_divergences(log_mu0: np.ndarray, log_mu1: np.ndarray, q: float,
                         orders: tuple[float, ...], log_w: np.ndarray | None = None
                         ) -> np.ndarray:
    """max(D_a(P || Q), D_a(Q || P)) at each order, P = (1-q) mu0 + q mu1, Q = mu0, the laws
    given by their logs on one grid (``log_w``: log quadrature weights of a density)."""
    lq = log_mu0
    lp = np.logaddexp(math.log1p(-q) + log_mu0, math.log(q) + log_mu1)
    ok = np.isfinite(lp) & np.isfinite(lq)
    w = np.zeros(ok.sum()) if log_w is None else log_w[ok]
    lp, lq = lp[ok], lq[ok]
    out = []
    for a in orders:
        pq = logsumexp(w + a * lp + (1 - a) * lq) / (a - 1)
        qp = logsumexp(w + a * lq + (1 - a) * lp) / (a - 1)
        out.append(max(pq, qp))
    return np.array(out)


def _gaussian_curve(z: float, top: int) -> np.ndarray:
    return np.arange(2, top + 1) / (2 * z * z)


@pytest.mark.parametrize("z", [0.8, 1.5, 4.0])
@pytest.mark.parametrize("q", [0.01, 0.1, 0.5, 0.9])
def test_theorem_6_on_the_gaussian_is_above_both_directions(z: float, q: float) -> None:
    orders = (2.0, 3.0, 4.0, 6.0, 8.0, 12.0)
    x = np.linspace(-40 * z, 1 + 40 * z, 20_001)
    log_w = np.full(x.size, math.log(x[1] - x[0]))
    norm = -0.5 * math.log(2 * math.pi * z * z)
    exact = _mixture_divergences(norm - x * x / (2 * z * z), norm - (x - 1) ** 2 / (2 * z * z),
                                 q, orders, log_w)
    curve = _gaussian_curve(z, int(max(orders)))
    claimed = np.array([zhu_wang_bound(curve, q, int(a)) for a in orders])
    assert np.all(claimed >= exact - 1e-9), (claimed, exact)
    # dp_accounting's exact sampled Gaussian (the remove direction, the larger for it)
    acct = rdp.RdpAccountant(list(orders))
    acct.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)))
    ref = np.array(acct._rdp)  # noqa: SLF001 - the accountant's own curve, no public getter
    assert np.allclose(exact, ref, rtol=1e-4, atol=1e-10), (exact, ref)
    assert np.all(claimed >= ref - 1e-12)


def _inner(delta: int, sigma: float, n: int) -> DistributedDiscreteGaussian:
    return DistributedDiscreteGaussian(l2_sensitivity=float(delta), l1_sensitivity=float(delta),
                                       sigma=sigma, devices=n, dim=1, adjacency="zero_out")


@pytest.mark.parametrize(("sigma", "n"), [(0.5, 1), (0.6, 2), (1.0, 3), (3.0, 2)])
@pytest.mark.parametrize("delta", [1, 3])
@pytest.mark.parametrize("q", [0.05, 0.3, 0.8])
def test_claimed_rdp_and_epsilon_are_not_below_the_exact_discrete_mixture(
        sigma: float, n: int, delta: int, q: float) -> None:
    """One coordinate, ``n`` honest shares, the device's rounded update ``delta`` (its
    largest: D1 = D2 = delta) or the null record: P = (1-q) mu_0 + q mu_delta against
    Q = mu_0, both orders, at integer and fractional orders; and epsilon at DELTA from the
    exact hockey-stick divergence of the pair."""
    orders = (1.5, 2.0, 2.5, 3.0, 5.0, 8.0, 16.0)
    half = int(math.ceil(40 * sigma + 2 * max(orders) * delta)) + 10
    lmu0 = log_pmf_sum(sigma, n, half)
    lmu1 = np.full(lmu0.size, -math.inf)
    lmu1[delta:] = lmu0[:-delta]
    exact = _mixture_divergences(lmu0, lmu1, q, orders)
    event = SelfSampled(event=_inner(delta, sigma, n), sample_rate=q)
    claimed = rdp_of(event, orders)
    assert np.all(claimed >= exact - 1e-12), (claimed, exact)
    assert np.all(claimed <= rdp_of(event.event, orders) + 1e-15)  # never above the inner
    # epsilon: the exact one of the pair (hockey stick, both directions) is below ours
    lp = np.logaddexp(math.log1p(-q) + lmu0, math.log(q) + lmu1)
    p, qq = np.exp(lp), np.exp(lmu0)

    def hockey(eps: float) -> float:
        return max(float(np.maximum(p - math.exp(eps) * qq, 0).sum()),
                   float(np.maximum(qq - math.exp(eps) * p, 0).sum()))

    lo, hi = 0.0, 50.0
    if hockey(0.0) <= DELTA:
        hi = 0.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if hockey(mid) > DELTA else (lo, mid)
    orders_all = np.array(RdpAccountant(adjacency="zero_out").orders)
    ours = rdp_to_epsilon(rdp_of(event), orders_all, DELTA)[0]
    assert ours >= hi - 1e-9, (ours, hi)


def test_it_amplifies_where_it_should_and_reduces_to_the_inner_release_at_q_1() -> None:
    inner = _inner(1000, 1000 * 4 / math.sqrt(90), 90)
    def acct() -> RdpAccountant:
        return RdpAccountant(adjacency="zero_out")

    whole = acct().compose(inner, 60).get_epsilon(DELTA)
    same = acct().compose(SelfSampled(event=inner, sample_rate=1.0), 60)
    assert same.get_epsilon(DELTA) == pytest.approx(whole, rel=1e-12)
    tenth = acct().compose(SelfSampled(event=inner, sample_rate=0.1), 60)
    assert tenth.get_epsilon(DELTA) < 0.3 * whole


def test_it_is_zero_out_only_and_validated() -> None:
    inner = _inner(3, 2.0, 4)
    ev = SelfSampled(event=inner, sample_rate=0.2)
    assert restate(ev, "zero_out") is ev
    for other in ("add_remove", "substitution"):
        with pytest.raises(UnsupportedEventError, match="zero-out"):
            restate(ev, other)
    assert not RdpAccountant(adjacency="add_remove").supports(ev)
    assert RdpAccountant(adjacency="zero_out").supports(ev)
    with pytest.raises(ValueError, match="sample_rate"):
        SelfSampled(event=inner, sample_rate=0.0)
    with pytest.raises(ValueError, match="zero-out"):
        SelfSampled(event=DistributedDiscreteGaussian(
            l2_sensitivity=3.0, l1_sensitivity=3.0, sigma=2.0, devices=4, dim=1,
            adjacency="substitution"), sample_rate=0.5)
    with pytest.raises(ValueError, match="steps 1"):
        SelfSampled(event=DistributedDiscreteGaussian(
            l2_sensitivity=3.0, l1_sensitivity=3.0, sigma=2.0, devices=4, dim=1, steps=2,
            adjacency="zero_out"), sample_rate=0.5)
