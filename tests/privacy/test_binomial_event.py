"""The Binomial (cpSGD) privacy event in the one Event union, the RDP accountant and the
ledger: composed with the other events, stored and reloaded, refused where no theorem holds.

Oracle for soundness: the EXACT hockey-stick divergence of the composed binomial pairs,
computed by brute force over every output (small N, one to three rounds, one or two
coordinates); the ledger's epsilon must never be below the exact one (equivalently: the
exact delta at the ledger's epsilon is within the ledger's delta).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from binomial_exact import eps_exact, log_pmf

from edge_sdk.ledger import Book, Budget, BudgetExhausted, Ledger, Plan
from edge_sdk.ledger.accounting import epsilon_pld, epsilon_rdp, event_from_json, event_to_json
from edge_sdk.privacy import (
    Binomial,
    Composed,
    Gaussian,
    PldAccountant,
    PoissonSubsampledGaussian,
    RdpAccountant,
    SelfComposed,
    UnsupportedEventError,
    ZcdpAccountant,
    compute_rdp,
    restate,
)
from edge_sdk.privacy.binomial import (
    BINOMIAL_ORDERS,
    CpsgdBinomial,
    binomial_event,
    restricted_rdp,
    restricted_rdp_epsilon,
)


def _exact_delta(n: int, shifts: list[tuple[int, ...]], eps: float) -> float:
    """Exact delta(eps) of P = the product over releases and coordinates of Bin(n, 1/2)
    against Q = the same shifted by ``shifts`` (one tuple per release, one int per
    coordinate), by enumerating every output: E_P[(1 - e^(eps - L))_+], L = +inf off
    supp(Q)."""
    lp = log_pmf(n)
    y = np.arange(n + 1)
    coords = [k for release in shifts for k in release]
    # per coordinate: log P(y) and the loss log P(y) - log P(y - k) (inf off the support)
    losses, logps = [], []
    for k in coords:
        lq = np.full(n + 1, -np.inf)
        inside = (y - k >= 0) & (y - k <= n)
        lq[inside] = lp[y[inside] - k]
        losses.append(lp - lq)
        logps.append(lp)
    total_loss = np.zeros(1)
    total_lp = np.zeros(1)
    for loss, logp in zip(losses, logps, strict=True):
        total_loss = (total_loss[:, None] + loss[None, :]).ravel()
        total_lp = (total_lp[:, None] + logp[None, :]).ravel()
    sel = total_loss > eps
    with np.errstate(over="ignore"):
        term = np.where(np.isinf(total_loss[sel]), 1.0,
                        -np.expm1(np.minimum(eps - total_loss[sel], 0.0)))
    return float(np.sum(np.exp(total_lp[sel]) * term))


def _book(delta: float) -> Book:
    return Book(budget=None, delta=delta)


def _plan(i: int, event) -> Plan:
    return Plan(round_id=f"r{i}", model_id="m", event=event)


def test_event_is_data_and_checks_its_form() -> None:
    ev = binomial_event(trials=64, l2=3.0, linf=3.0, l1=3.0, dim=1)
    rho, delta0 = restricted_rdp(trials=64, l2=3.0, linf=3.0, l1=3.0, dim=1)
    assert ev.rho == tuple(float(r) for r in rho) and ev.delta0 == delta0
    assert ev.orders == BINOMIAL_ORDERS and ev.adjacency == "substitution"
    # substitution -> zero-out unchanged (rule 1); never add/remove
    assert restate(ev, "zero_out").rho == ev.rho
    with pytest.raises(UnsupportedEventError, match="Binomial stated under substitution"):
        restate(ev, "add_remove")
    with pytest.raises(ValueError, match="Binomial.adjacency must be one of"):
        binomial_event(trials=64, l2=3.0, linf=3.0, l1=3.0, dim=1, adjacency="add_remove")
    base = {"trials": 8, "l2_sensitivity": 1.0, "linf_sensitivity": 1.0,
            "l1_sensitivity": 1.0, "dim": 1, "orders": (2.0, 3.0), "rho": (0.1, 0.2),
            "delta0": 0.0}
    Binomial(**base)
    for bad, match in (({"rho": (0.1,)}, "one value per order"),
                       ({"orders": (3.0, 2.0)}, "strictly increasing"),
                       ({"orders": (1.0, 2.0)}, "strictly increasing"),
                       ({"rho": (0.1, math.inf)}, "finite and >= 0"),
                       ({"rho": (-0.1, 0.2)}, "finite and >= 0"),
                       ({"delta0": 1.0}, r"delta0 must be in \[0, 1\)"),
                       ({"linf_sensitivity": 8.0}, "must be < trials=8"),
                       ({"steps": 0}, "steps must be an integer >= 1")):
        with pytest.raises(ValueError, match=match):
            Binomial(**{**base, **bad})


@pytest.mark.parametrize("n,k", [(16, 1), (16, 3), (64, 2), (64, 9), (256, 12)])
def test_ledger_epsilon_never_below_the_exact_one_round(n: int, k: int) -> None:
    # The attacker's pair: a 1-D shift of k grid steps, the worst a (k, k, k) box allows.
    for delta in (1e-5, 1e-3, 0.05):
        book = _book(delta)
        book.reserve(_plan(1, binomial_event(trials=n, l2=k, linf=k, l1=k, dim=1)))
        ours = book.spent().local_epsilon
        exact = eps_exact(n, k, delta)
        assert ours >= exact, (n, k, delta, ours, exact)
        if math.isfinite(ours):
            assert _exact_delta(n, [(k,)], ours) <= delta * (1 + 1e-9)


@pytest.mark.parametrize("n,shifts", [
    (32, [(2,), (2,)]),
    (32, [(4,), (1,), (3,)]),  # different events, the ledger composes them
    (24, [(3, 2), (1, 3)]),  # two coordinates per release: the (l2, linf, l1) box
])
def test_ledger_epsilon_never_below_the_exact_several_rounds(
        n: int, shifts: list[tuple[int, ...]]) -> None:
    for delta in (1e-4, 1e-2):
        book = _book(delta)
        for i, s in enumerate(shifts):
            v = np.array(s, dtype=float)
            book.reserve(_plan(i, binomial_event(
                trials=n, l2=float(np.linalg.norm(v)), linf=float(v.max()),
                l1=float(v.sum()), dim=len(s))))
        ours = book.spent().local_epsilon
        assert math.isfinite(ours)
        exact_delta = _exact_delta(n, shifts, ours)
        assert exact_delta <= delta, (shifts, delta, ours, exact_delta)
        # and the bound is not vacuous: it is within a factor 2 of the exact epsilon
        lo, hi = 0.0, ours
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _exact_delta(n, shifts, mid) > delta else (lo, mid)
        assert hi <= ours <= 2 * hi + 1.0


def test_worst_vector_in_the_box_two_coordinates() -> None:
    # The event covers EVERY integer shift vector in its (D2, Dinf, D1) box, not one.
    n, l2, linf, l1 = 20, 3.0, 3.0, 4.0
    ev = binomial_event(trials=n, l2=l2, linf=linf, l1=l1, dim=2)
    delta = 1e-3
    ours = epsilon_rdp([ev], delta)
    for k in itertools.product(range(4), repeat=2):
        v = np.array(k, dtype=float)
        if np.linalg.norm(v) <= l2 and v.max() <= linf and v.sum() <= l1:
            assert _exact_delta(n, [k], ours) <= delta, k


def test_composes_with_gaussian_events_sum_of_moments_and_delta0() -> None:
    ev = binomial_event(trials=64, l2=4.0, linf=4.0, l1=4.0, dim=1)
    g = PoissonSubsampledGaussian(noise_multiplier=1.1, sample_rate=0.05, steps=20,
                                  adjacency="zero_out")
    delta = 1e-5
    got = epsilon_rdp([ev, g, ev], delta)
    a = np.array(BINOMIAL_ORDERS)
    moments = 2 * np.array(ev.rho) + compute_rdp(g, a, adjacency="zero_out")
    want = restricted_rdp_epsilon(moments, a, 2 * ev.delta0, delta)
    assert got == want
    # composing costs: more than either part alone
    assert got > epsilon_rdp([ev, ev], delta) and got > epsilon_rdp([g], delta)
    # SelfComposed and Composed say the same as the flat list
    assert epsilon_rdp([Composed(events=(SelfComposed(event=ev, count=2), g))], delta) == got
    # the accountant keeps delta0 apart and converts at delta - delta0
    acc = RdpAccountant(orders=BINOMIAL_ORDERS, adjacency="zero_out").compose(ev, 2).compose(g)
    assert acc.delta0 == 2 * ev.delta0 and acc.get_epsilon(delta) == got


def test_infinite_when_delta_at_most_sum_delta0_no_kl_shortcut() -> None:
    # N = 8, shift 7: P(B) = 0.965 per release, so no epsilon holds at delta = 0.5 (exact:
    # inf); the moment near a = 1 is 0, which a KL shortcut would have turned into eps = 0.
    ev = binomial_event(trials=8, l2=7.0, linf=7.0, l1=7.0, dim=1)
    assert ev.delta0 > 0.5
    assert eps_exact(8, 7, 0.5) == math.inf
    assert epsilon_rdp([ev], 0.5) == math.inf
    # with a Gaussian in the history too, still no shortcut anywhere
    assert epsilon_rdp([Gaussian(noise_multiplier=100.0, adjacency="zero_out"), ev], 0.5) \
        == math.inf
    # delta0 adds over releases: one release fits delta, enough releases do not
    small = binomial_event(trials=16, l2=4.0, linf=4.0, l1=4.0, dim=1)
    d = 3 * small.delta0
    assert math.isfinite(epsilon_rdp([small, small], d))
    assert epsilon_rdp([small] * 3, d) == math.inf


def test_refused_where_no_theorem_takes_it() -> None:
    ev = binomial_event(trials=64, l2=2.0, linf=2.0, l1=2.0, dim=1)
    with pytest.raises(UnsupportedEventError, match="not supported by the PLD accountant"):
        PldAccountant(adjacency="zero_out").compose(ev)
    assert not PldAccountant(adjacency="zero_out").supports(ev)
    with pytest.raises(UnsupportedEventError, match="no zCDP rho"):
        ZcdpAccountant(adjacency="zero_out").compose(ev)
    with pytest.raises(UnsupportedEventError, match="has no RDP curve"):
        compute_rdp(ev, BINOMIAL_ORDERS, adjacency="zero_out")
    # an accountant at orders the event does not state its moment at
    acc = RdpAccountant(adjacency="zero_out")  # the default orders
    assert not acc.supports(ev)
    with pytest.raises(UnsupportedEventError, match="not one of them"):
        acc.compose(ev)
    assert acc.get_epsilon(1e-5) == 0.0 and acc.delta0 == 0.0  # nothing changed
    # the ledger's PLD accountant falls back to the RDP answer (the PLD refuses it)
    g = Gaussian(noise_multiplier=2.0, adjacency="zero_out")
    assert epsilon_pld([ev, g], 1e-5) == epsilon_rdp([ev, g], 1e-5)
    # events at disjoint orders cannot be composed
    other = binomial_event(trials=64, l2=2.0, linf=2.0, l1=2.0, dim=1, orders=[2.5, 3.5])
    with pytest.raises(ValueError, match="no common order"):
        epsilon_rdp([ev, other], 1e-5)
    # events sharing some orders compose at those
    some = binomial_event(trials=64, l2=2.0, linf=2.0, l1=2.0, dim=1,
                          orders=[BINOMIAL_ORDERS[40], BINOMIAL_ORDERS[60], 7.25])
    assert epsilon_rdp([ev, some], 1e-5) >= epsilon_rdp([ev, ev], 1e-5)


def test_json_round_trip_and_the_store(tmp_path) -> None:
    ev = CpsgdBinomial(trials=64, grid=0.25, dim=3, update_clip=1.0, sample_rate=0.5).event(
        adjacency="zero_out")
    data = event_to_json(ev)
    assert data["type"] == "Binomial" and isinstance(data["rho"], list)
    assert event_from_json(data) == ev
    nested = Composed(events=(SelfComposed(event=ev, count=3),
                              Gaussian(noise_multiplier=1.0, adjacency="zero_out")))
    assert event_from_json(event_to_json(nested)) == nested
    for bad in ({**data, "rho": data["rho"][:-1]}, {**data, "rho": "x"},
                {**data, "orders": [True] * len(data["orders"])},
                {k: v for k, v in data.items() if k != "delta0"}):
        with pytest.raises(ValueError):
            event_from_json(bad)
    # a device ledger reserves it, and reads the same spend back after a reopen
    path = tmp_path / "ledger.db"
    budget = Budget(epsilon=1e6, delta=1e-5)
    with Ledger.open(path, budget=budget, device_id="dev-1", create=True) as led:
        for i in range(3):
            led.commit(led.reserve(Plan(round_id=f"r{i}", model_id="m", event=ev)))
        spent = led.spent()
    with Ledger.open(path) as led:
        assert led.spent() == spent
        assert [r.plan.event for r in led.reservations()] == [ev] * 3
    assert spent.local_epsilon == CpsgdBinomial(
        trials=64, grid=0.25, dim=3, update_clip=1.0, sample_rate=0.5).epsilon(1e-5, 3)


def test_budget_refuses_the_round_that_would_exceed() -> None:
    ev = binomial_event(trials=256, l2=8.0, linf=8.0, l1=8.0, dim=1)
    one = epsilon_rdp([ev], 1e-5)
    two = epsilon_rdp([ev, ev], 1e-5)
    book = Book(budget=Budget(epsilon=0.5 * (one + two), delta=1e-5))
    book.reserve(_plan(1, ev))
    with pytest.raises(BudgetExhausted):
        book.reserve(_plan(2, ev))
    assert book.spent().local_epsilon == one


@pytest.mark.slow
def test_never_below_the_pld_at_the_experiments_defaults() -> None:
    # N = 4096, 127 levels, d = 650 (the code's sensitivities: D2 = 279.5, Dinf = 255):
    # vectors at the edge of the box over 1 and 3 rounds, and mixed with a Gaussian event,
    # against dp_accounting's pessimistic PLD (an upper bound on the true delta).
    from dp_accounting.pld import privacy_loss_distribution as dp_pld

    n, delta = 4096, 1e-5
    ev = CpsgdBinomial(trials=n, grid=1 / 127, dim=650, update_clip=1.0,
                       sample_rate=1.0).event(adjacency="zero_out")
    lp = log_pmf(n)
    cache: dict[int, object] = {}

    def one(k: int):
        if k not in cache:
            cache[k] = dp_pld.from_two_probability_mass_functions(
                {i: float(lp[i]) for i in range(n + 1)},
                {i + k: float(lp[i]) for i in range(n + 1)},
                pessimistic_estimate=True, value_discretization_interval=1e-3)
        return cache[k]

    z = 2.0
    gauss = dp_pld.from_gaussian_mechanism(z, sensitivity=1.0, pessimistic_estimate=True,
                                           value_discretization_interval=1e-3)
    for vec in ([255, 114], [51] * 30):
        v = np.array(vec, dtype=float)
        assert np.linalg.norm(v) <= ev.l2_sensitivity and v.max() <= ev.linf_sensitivity
        release = one(vec[0])
        for k in vec[1:]:
            release = release.compose(one(k))
        three = release.compose(release).compose(release)
        for pld, events in ((release, [ev]), (three, [ev] * 3),
                            (three.compose(gauss),
                             [ev] * 3 + [Gaussian(noise_multiplier=z, adjacency="zero_out")])):
            ours = epsilon_rdp(events, delta)
            assert pld.get_delta_for_epsilon(ours) <= delta, (vec, len(events))
            assert ours <= 1.1 * pld.get_epsilon_for_delta(delta)  # and tight
