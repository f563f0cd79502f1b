"""PLD accounting: an upper bound, close to dp_accounting's PLD and to the exact Gaussian.

Oracles: the exact (eps, delta) curve of the Gaussian (Balle-Wang 2018), dp_accounting's
pessimistic PLD (also an upper bound: both carry discretization error, so agreement is to
~1e-3, ours usually the tighter) and dp_accounting's *optimistic* PLD (a lower bound on
the true epsilon, which ours must never undercut).
"""

from __future__ import annotations

import logging
import math

import dp_accounting
import numpy as np
import pytest
from scipy import optimize, special

from edge_sdk.privacy.events import (
    Composed,
    Gaussian,
    PoissonSubsampledGaussian,
    SampledWithoutReplacementGaussian,
)
from edge_sdk.privacy.pld import DiscretePld, PldAccountant, discretize_subsampled_gaussian
from edge_sdk.privacy.rdp import RdpAccountant


def exact_gaussian_delta(mu: float, eps: float) -> float:
    """Balle-Wang 2018, Thm. 8: delta(eps) of the Gaussian with sensitivity/std = mu."""
    return float(
        special.ndtr(-eps / mu + mu / 2) - math.exp(eps) * special.ndtr(-eps / mu - mu / 2)
    )


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    if exact_gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    return optimize.brentq(lambda e: exact_gaussian_delta(mu, e) - delta, 0.0, 500.0,
                           xtol=1e-13, rtol=1e-13)


def _optimistic_lower_bound(
    q: float, sigma: float, steps: int, delta: float, interval: float
) -> float:
    """dp_accounting's optimistic PLD (losses rounded down): at most the true epsilon."""
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)  # it warns that connect-the-dots is not used; we know
    try:
        pld = dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
            sigma, sampling_prob=q, pessimistic_estimate=False,
            value_discretization_interval=interval, use_connect_dots=False,
        )
    finally:
        logger.setLevel(level)
    return pld.self_compose(steps).get_epsilon_for_delta(delta)


def _theirs(q: float, sigma: float, steps: int, delta: float) -> float:
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return acc.get_epsilon(delta)


@pytest.mark.reference
@pytest.mark.parametrize(
    ("q", "sigma", "steps", "delta"),
    [
        (0.001, 1.0, 70_000, 1e-5),
        (0.001, 0.8, 10_000, 1e-5),
        (0.01, 1.0, 1000, 1e-5),
        (0.01, 2.0, 5000, 1e-6),
        (0.05, 0.8, 1000, 1e-5),
        (0.3, 2.0, 100, 1e-5),
        (0.9, 0.7, 50, 1e-3),
        (1.0, 1.0, 1, 1e-5),
        (1.0, 2.0, 100, 1e-5),
    ],
)
def test_matches_dp_accounting_pld(q: float, sigma: float, steps: int, delta: float) -> None:
    ours = PldAccountant().compose(
        PoissonSubsampledGaussian(noise_multiplier=sigma, sample_rate=q, steps=steps)
    ).get_epsilon(delta)
    theirs = _theirs(q, sigma, steps, delta)
    # Both are upper bounds with discretization error (theirs: up to ~5e-4 relative at
    # q = 0.001, where its 1e-4 grid is coarse next to the per-step loss).
    assert theirs * (1 - 1e-3) <= ours <= theirs * 1.02
    rdp = RdpAccountant().compose(
        PoissonSubsampledGaussian(noise_multiplier=sigma, sample_rate=q, steps=steps)
    ).get_epsilon(delta)
    assert ours <= rdp  # and tighter than RDP


@pytest.mark.reference
@pytest.mark.parametrize(
    ("sigma", "steps", "delta"),
    [(1.0, 1, 1e-5), (1.0, 1, 1e-10), (2.0, 100, 1e-5), (0.8, 100, 1e-5), (50.0, 1, 1e-5),
     (50.0, 70_000, 1e-5), (1.0, 3, 0.3), (5.0, 10_000, 1e-5)],
)
def test_never_below_the_exact_gaussian(sigma: float, steps: int, delta: float) -> None:
    exact = exact_gaussian_epsilon(math.sqrt(steps) / sigma, delta)
    ours = PldAccountant().compose(Gaussian(noise_multiplier=sigma, steps=steps)).get_epsilon(delta)
    assert ours >= exact
    assert ours <= exact * (1 + 2e-4) + 1e-9


@pytest.mark.reference
def test_never_below_dp_accounting_optimistic_bound() -> None:
    q, sigma, steps, delta = 0.3, 2.0, 100, 1e-5
    lower = _optimistic_lower_bound(q, sigma, steps, delta, 1e-4)
    ours = PldAccountant().compose(
        PoissonSubsampledGaussian(noise_multiplier=sigma, sample_rate=q, steps=steps)
    ).get_epsilon(delta)
    assert lower <= ours <= lower * 1.001


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.parametrize(
    ("q", "sigma", "steps"),
    [(0.01, 1.0, 1000), (0.05, 0.8, 1000), (0.3, 2.0, 100), (0.9, 0.7, 50), (0.01, 2.0, 5000)],
)
def test_sandwiched_by_fine_optimistic_bound(q: float, sigma: float, steps: int) -> None:
    lower = _optimistic_lower_bound(q, sigma, steps, 1e-5, 1e-5)
    ours = PldAccountant().compose(
        PoissonSubsampledGaussian(noise_multiplier=sigma, sample_rate=q, steps=steps)
    ).get_epsilon(1e-5)
    assert lower <= ours <= lower * 1.02


@pytest.mark.reference
def test_coarse_grid_is_looser_but_still_sound() -> None:
    event = Gaussian(noise_multiplier=2.0, steps=100)
    exact = exact_gaussian_epsilon(math.sqrt(100) / 2.0, 1e-5)
    fine = PldAccountant(value_discretization_interval=1e-3).compose(event).get_epsilon(1e-5)
    coarse = PldAccountant(value_discretization_interval=0.05).compose(event).get_epsilon(1e-5)
    capped = PldAccountant(max_bins=1024).compose(event).get_epsilon(1e-5)
    assert exact <= fine <= coarse
    assert exact <= capped
    assert coarse < exact * 1.05


@pytest.mark.reference
def test_heterogeneous_composition() -> None:
    events = Composed(events=(
        PoissonSubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01, steps=500),
        PoissonSubsampledGaussian(noise_multiplier=2.0, sample_rate=0.05, steps=300),
        Gaussian(noise_multiplier=10.0, steps=5),
    ))
    ours = PldAccountant().compose(events).get_epsilon(1e-6)
    theirs = dp_accounting.pld.PLDAccountant()
    theirs.compose(dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 500),
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(2.0)), 300),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(10.0), 5),
    ]))
    assert theirs.get_epsilon(1e-6) * (1 - 1e-3) <= ours <= theirs.get_epsilon(1e-6) * 1.02
    # Composing piecewise is the same as composing once.
    piecewise = PldAccountant()
    for e in events.events:
        piecewise.compose(e)
    assert piecewise.get_epsilon(1e-6) == ours


def test_discretization_keeps_both_masses_and_dominates() -> None:
    h = 1e-3
    for direction in ("remove", "add"):
        pld = discretize_subsampled_gaussian(1.0, 0.1, h, direction=direction)
        ell = pld.losses
        # Total P-mass is 1 (with the +inf atom); implied Q-mass never exceeds 1.
        assert pld.pmf.sum() + pld.inf_mass == pytest.approx(1.0, abs=1e-12)
        assert float(np.sum(pld.pmf * np.exp(-ell))) <= 1.0 + 1e-12
        assert np.all(pld.pmf >= 0)


def test_delta_and_epsilon_are_inverse() -> None:
    acc = PldAccountant().compose(
        PoissonSubsampledGaussian(noise_multiplier=1.0, sample_rate=0.02, steps=300))
    eps = acc.get_epsilon(1e-5)
    assert acc.get_delta(eps) == pytest.approx(1e-5, rel=1e-6)
    assert acc.get_delta(eps * 1.01) < 1e-5 < acc.get_delta(eps * 0.99)


def test_no_noise_and_trivial_cases() -> None:
    acc = PldAccountant().compose(Gaussian(noise_multiplier=0.0))
    assert acc.get_epsilon(1e-5) == math.inf and acc.get_delta(3.0) == 1.0
    assert PldAccountant().get_epsilon(1e-5) == 0.0
    assert PldAccountant().compose(Gaussian(noise_multiplier=100.0)).get_epsilon(0.5) == 0.0


def test_compose_is_check_then_commit() -> None:
    acc = PldAccountant().compose(Gaussian(noise_multiplier=2.0))
    before = acc.get_epsilon(1e-5)
    wor = SampledWithoutReplacementGaussian(noise_multiplier=1.0, sample_size=1, dataset_size=9)
    with pytest.raises(ValueError, match="substitution"):
        acc.compose(Composed(events=(Gaussian(noise_multiplier=0.5), wor)))
    with pytest.raises(ValueError, match="count"):
        acc.compose(Gaussian(noise_multiplier=0.5), count=1.5)  # type: ignore[arg-type]
    assert acc.get_epsilon(1e-5) == before


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: PldAccountant(value_discretization_interval=0.0), "interval"),
        (lambda: PldAccountant(max_bins=10), "max_bins"),
        (lambda: PldAccountant().get_epsilon(0.0), "delta"),
        (lambda: PldAccountant().compose(Gaussian(noise_multiplier=1.0)).get_delta(-1.0),
         "epsilon"),
        (lambda: discretize_subsampled_gaussian(0.0, 0.5, 1e-3), "noise_multiplier"),
        (lambda: discretize_subsampled_gaussian(1.0, 0.0, 1e-3), "sample_rate"),
        (lambda: discretize_subsampled_gaussian(1.0, 0.5, -1.0), "interval"),
        (lambda: discretize_subsampled_gaussian(1.0, 0.5, 1e-3, direction="up"), "direction"),
        (lambda: DiscretePld(interval=1.0, offset=0, pmf=np.ones(1)).compose(
            DiscretePld(interval=0.5, offset=0, pmf=np.ones(1))), "interval"),
        (lambda: DiscretePld(interval=1.0, offset=0, pmf=np.ones(1)).self_compose(-1), "count"),
    ],
)
def test_bad_arguments_name_the_value(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_roundoff_bound_is_tracked_and_small() -> None:
    acc = PldAccountant().compose(
        PoissonSubsampledGaussian(noise_multiplier=1.0, sample_rate=0.01, steps=1000))
    plds = acc._plds()
    assert plds is not None
    remove, reversed_remove = plds
    for pld in (remove, acc._add_pld()):
        assert 0 < pld.slack < 1e-10
    # The add direction's fast bound, the remove PLD reversed, carries the remove slack
    # times max(1, 2 e^(-l_min) - 1) (DiscretePld.reverse).
    grow = max(1.0, 2.0 * math.exp(-float(remove.losses[0])) - 1.0)
    assert reversed_remove.slack <= grow * remove.slack * (1 + 1e-9) + 1e-14
    # Small deltas stay finite and ordered.
    eps = [acc.get_epsilon(d) for d in (1e-5, 1e-7, 1e-9)]
    assert eps[0] < eps[1] < eps[2] < math.inf


# ------------------------------------------- the FFT power (issue 18: PLD at 5x dp_accounting)


def _exact_self_composition(pld: DiscretePld, count: int) -> tuple[int, np.ndarray, float]:
    """(offset, pmf, inf mass) of ``count`` runs by repeated direct convolution: no FFT,
    no truncation (float64 sums of non-negative products, relative error ~count * u)."""
    pmf = np.ones(1)
    for _ in range(count):
        pmf = np.convolve(pmf, pld.pmf)
    return count * pld.offset, pmf, 1.0 - (1.0 - pld.inf_mass) ** count


def _delta_of(offset: int, pmf: np.ndarray, inf_mass: float, interval: float, eps: float) -> float:
    ell = (offset + np.arange(pmf.size)) * interval
    above = ell > eps
    return inf_mass + math.fsum(pmf[above] * -np.expm1(eps - ell[above]))


@pytest.mark.parametrize(("z", "q", "h", "count"), [(1.0, 0.3, 0.02, 60), (0.8, 0.05, 0.01, 90),
                                                    (2.0, 1.0, 0.01, 40)])
@pytest.mark.parametrize("direction", ["remove", "add"])
def test_fft_power_is_never_below_the_exact_composition(z, q, h, count, direction) -> None:
    from edge_sdk.privacy.pld import _fft_power, _truncate

    step = _truncate(discretize_subsampled_gaussian(z, q, h, direction=direction))
    offset, exact, inf_exact = _exact_self_composition(step, count)
    power = _fft_power([(step, count)])
    assert 0 < power.slack < 5e-11 and power.pmf.min() >= 0
    # The round-off bound holds: the computed pmf is within slack of the exact one.
    start = power.offset - offset
    assert np.abs(power.pmf - exact[start : start + power.pmf.size]).sum() <= power.slack
    for eps in np.linspace(0.0, float(power.losses[-1]), 25):
        truth = _delta_of(offset, exact, inf_exact, h, float(eps))
        ours = power.get_delta(float(eps))
        assert ours >= truth
        # Only the slack, the tails (1e-15 a side, also folded in) and the 1e-12 relative
        # by which sums are rounded up (_SUM_RTOL) added.
        assert ours <= (truth + power.slack) * (1 + 2e-12) + 5e-15
    # Its support is the Chernoff window: all but 1e-15 of the exact mass on each side.
    lo, hi = power.offset, power.offset + power.pmf.size - 1
    outside = exact[: max(lo - offset, 0)].sum() + exact[hi - offset + 1 :].sum()
    assert outside <= 2e-15 + power.inf_mass - inf_exact


def test_fft_power_after_squaring_matches_binary_powering(monkeypatch) -> None:
    """The same composition by squaring alone (the FFT power disabled) and by the default
    (squaring while the operand is peaked, then one FFT power): the same epsilon at
    delta = 1e-5 to 1e-6 relative, both slacks far below delta."""
    import edge_sdk.privacy.pld as pld_module

    step = pld_module._truncate(discretize_subsampled_gaussian(1.1, 1e-3, 2e-4))
    default = step.self_compose(70_000)
    monkeypatch.setattr(pld_module, "_POWER_SLACK", 0.0)
    squaring = step.self_compose(70_000)
    ours, ref = default.get_epsilon(1e-5), squaring.get_epsilon(1e-5)
    assert ref * (1 - 1e-6) <= ours <= ref * (1 + 1e-6)
    # At a delta near the slacks (1e-10 here) their difference shows: 0.03% at 1e-8.
    ours, ref = default.get_epsilon(1e-8), squaring.get_epsilon(1e-8)
    assert ref * (1 - 1e-6) <= ours <= ref * (1 + 1e-3)
    assert default.slack < 2e-10 and squaring.slack < 2e-10


@pytest.mark.parametrize("seed", range(20))
def test_core_and_body_split_as_documented(seed: int) -> None:
    from edge_sdk.privacy.pld import _REST_NORM, _TAIL_NORM, _body, _split_core

    rng = np.random.default_rng(seed)
    x = rng.exponential(size=int(rng.integers(300, 5000))) ** 8
    x /= x.sum()
    core, rest = _split_core(x)
    assert core.size > 0  # peaked: l2 norm above the spread threshold
    assert np.all(rest[core] == 0) and np.array_equal(rest + np.where(rest == 0, x, 0), x)
    assert x[core].min() >= np.delete(x, core).max()  # the largest entries
    if core.size < 128:
        assert np.linalg.norm(rest) <= _REST_NORM * (1 + 1e-9)
    lo, hi = _body(x, core)
    assert lo <= core.min() and hi > core.max()
    assert np.linalg.norm(np.concatenate((x[:lo], x[hi:]))) <= _TAIL_NORM


# ------------------------------------ one composition for both directions (DiscretePld.reverse)


def _exact_add_delta(p_law: np.ndarray, q_law: np.ndarray, q_only: float, ell: np.ndarray,
                     eps: float) -> float:
    """delta of the reversed pair (Q, P) at eps: sum over outcomes of (Q - e^eps P)_+, by
    the losses' P- and Q-laws (exact sums; no FFT, nothing truncated)."""
    return q_only + math.fsum(np.maximum(q_law - math.exp(eps) * p_law, 0.0))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("count", [1, 5, 40])
def test_reverse_is_never_below_the_exact_add_direction(seed: int, count: int) -> None:
    """An attacker's check: a pair with grid losses composed exactly by direct convolution
    of its P-law and of its Q-law; the reversed composed PLD (through the FFT and its
    truncations) must never report a smaller delta for the reversed pair, nor a smaller
    epsilon, and be looser by no more than its slack and the cut tails."""
    h = 0.002
    rng = np.random.default_rng(seed)
    p = rng.exponential(size=300) ** 3  # the P-mass of the losses (offset + i) h
    p_inf = 1e-3 * rng.random()  # P-only (loss +inf)
    p *= (1.0 - p_inf) / p.sum()
    # The offset that leaves Q-mass 1 - sum_i p_i e^(-l_i) >= 1e-3 at loss -inf (Q-only).
    q_at_zero = float(np.sum(p * np.exp(-h * np.arange(p.size))))  # the Q-mass at offset 0
    offset = math.ceil(math.log(q_at_zero / 0.999) / h)
    ell = (offset + np.arange(p.size)) * h
    q = p * np.exp(-ell)
    q_only = 1.0 - q.sum()
    assert q_only >= 1e-3 * (1 - 1e-9)
    pld = DiscretePld(interval=h, offset=offset, pmf=p, inf_mass=p_inf)
    composed = pld.self_compose(count)
    reversed_pld = composed.reverse()
    # Exact laws of the composed loss under P and under Q.
    p_law, q_law = np.ones(1), np.ones(1)
    for _ in range(count):
        p_law, q_law = np.convolve(p_law, p), np.convolve(q_law, q)
    q_only_n = 1.0 - (1.0 - q_only) ** count
    ell_n = (count * offset + np.arange(p_law.size)) * h
    for eps in np.linspace(0.0, 3.0, 31):
        truth = _exact_add_delta(p_law, q_law, q_only_n, ell_n, float(eps))
        ours = reversed_pld.get_delta(float(eps))
        assert ours >= truth
        assert ours <= (truth + reversed_pld.slack) * (1 + 1e-9) + 1e-12
    for delta in (1e-2, 1e-4, 1e-6):
        ours = reversed_pld.get_epsilon(delta)
        if math.isinf(ours):
            continue
        assert _exact_add_delta(p_law, q_law, q_only_n, ell_n, ours) <= delta
        # The smallest epsilon meeting delta is not far below: the exact delta just under
        # it is above delta (unless ours is 0).
        if ours > 1e-6:
            assert _exact_add_delta(p_law, q_law, q_only_n, ell_n, ours - 1e-3) > delta * (
                1 - 1e-6) - reversed_pld.slack


@pytest.mark.parametrize(("z", "q", "steps"), [(1.0, 0.01, 1000), (0.8, 0.05, 1000),
                                                (2.0, 0.3, 100), (1.1, 1e-3, 3000)])
def test_accountant_never_looser_than_composing_both_directions(z, q, steps) -> None:
    """The add direction by the reversed remove PLD, falling back to its own composition
    where that bound is too loose (0.8, 0.05: the reversed slack is huge), never reports
    more than composing both directions, and never less than the remove direction."""
    acc = PldAccountant().compose(
        PoissonSubsampledGaussian(noise_multiplier=z, sample_rate=q, steps=steps))
    plds = acc._plds()
    assert plds is not None
    remove, _ = plds
    both = PldAccountant().compose(
        PoissonSubsampledGaussian(noise_multiplier=z, sample_rate=q, steps=steps))
    for delta in (1e-5, 1e-8):
        ours = acc.get_epsilon(delta)
        full = max(remove.get_epsilon(delta), both._add_pld().get_epsilon(delta))
        assert remove.get_epsilon(delta) <= ours <= full
        assert math.isfinite(ours)
    for eps in (0.5, 1.0, 4.0):
        ours = acc.get_delta(eps)
        full = max(remove.get_delta(eps), both._add_pld().get_delta(eps))
        assert remove.get_delta(eps) <= ours <= full


@pytest.mark.reference
def test_reversed_add_direction_against_dp_accountings_add_pmf() -> None:
    """The reversed remove PLD against dp_accounting's own add-direction PLD (pessimistic,
    composed separately) and its optimistic one: sandwiched."""
    z, q, steps, h = 1.0, 0.01, 500, 1e-4
    ours = PldAccountant(value_discretization_interval=h).compose(
        PoissonSubsampledGaussian(noise_multiplier=z, sample_rate=q, steps=steps))
    plds = ours._plds()
    assert plds is not None
    reversed_add = plds[1]
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        bounds = []
        for pessimistic in (True, False):
            pld = dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
                z, sampling_prob=q, pessimistic_estimate=pessimistic,
                value_discretization_interval=h, use_connect_dots=pessimistic)
            bounds.append(pld.self_compose(steps)._pmf_add)
    finally:
        logger.setLevel(level)
    upper, lower = bounds
    for eps in (0.2, 0.5, 1.0, 1.5):
        ours_delta = reversed_add.get_delta(eps)
        assert lower.get_delta_for_epsilon(eps) <= ours_delta
        assert ours_delta <= upper.get_delta_for_epsilon(eps) * (1 + 1e-3) + 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_fft_power_of_several_parts_is_never_below_the_exact_composition(seed: int) -> None:
    """The final FFT raises the last squared operand to its power and multiplies in the
    operands of the set bits below it: against direct convolution, never below, within
    the slack."""
    from edge_sdk.privacy.pld import _fft_power, _truncate

    h = 0.01
    step = _truncate(discretize_subsampled_gaussian(0.8, 0.05, h))
    rng = np.random.default_rng(seed)
    counts = [int(rng.integers(2, 30)), 1, 1, int(rng.integers(1, 3))]
    parts, exact, offset, inf_exact = [], np.ones(1), 0, 0.0
    for c in counts:
        part = step.self_compose(int(rng.integers(1, 4)))
        parts.append((part, c))
        for _ in range(c):
            exact = np.convolve(exact, part.pmf)
            offset += part.offset
            inf_exact = 1.0 - (1.0 - inf_exact) * (1.0 - part.inf_mass)
    power = _fft_power(parts)
    start = power.offset - offset
    # Each part is itself computed (slack > 0): only the power's own round-off is tested.
    own = power.slack - sum(c * p.slack for p, c in parts) * 1.01
    assert np.abs(power.pmf - exact[start : start + power.pmf.size]).sum() <= power.slack
    assert own > 0
    for eps in np.linspace(0.0, float(power.losses[-1]), 25):
        truth = _delta_of(offset, exact, inf_exact, h, float(eps))
        assert power.get_delta(float(eps)) >= truth


@pytest.mark.parametrize("scale", [1e-4, 0.05, 3.0, 40.0])
def test_log_mgf_is_an_upper_bound(scale: float) -> None:
    """The chunked moment generating function (one matrix product per chunk of the grid)
    against a log-space sum over every entry: never below, and close."""
    from edge_sdk.privacy.pld import _log_mgf

    rng = np.random.default_rng(1)
    pmf = rng.exponential(size=1500) ** 4
    pmf /= pmf.sum()
    pmf[:200] = 0.0
    pld = DiscretePld(interval=1.0, offset=-700, pmf=pmf)
    lams = scale * 2.0 ** np.arange(-2.0, 3.0)
    lams = np.concatenate((lams, -lams))
    center = -700 + 810.5
    ours = _log_mgf(pld, lams, center)
    idx = -700 + np.arange(pmf.size) - center
    with np.errstate(divide="ignore"):
        log_pmf = np.log(pmf)
    for lam, bound in zip(lams, ours, strict=True):
        v = log_pmf + lam * idx
        top = float(np.max(v))
        exact = top + math.log(math.fsum(np.exp(v - top)))
        assert exact <= bound <= exact + 1e-9


@pytest.mark.parametrize("seed", range(8))
def test_epsilon_search_is_sound_and_tight_on_random_plds(seed: int) -> None:
    """get_epsilon (suffix sums with a rounding bound; log space for ranges past e^700)
    against get_delta (direct sums): the delta at the epsilon returned meets the target,
    and a slightly smaller epsilon does not."""
    rng = np.random.default_rng(seed)
    for _ in range(60):
        n = int(rng.integers(1, 3000))
        pmf = rng.exponential(size=n) ** float(rng.uniform(1, 6))
        if rng.random() < 0.3:
            pmf[rng.random(n) < 0.5] = 0.0
        pmf /= pmf.sum() * (1 + 0.01 * rng.random())
        h = float(10 ** rng.uniform(-4, -0.5))  # up to 900 nats wide: both code paths
        pld = DiscretePld(interval=h, offset=int(rng.integers(-n, n // 2 + 1)), pmf=pmf,
                          inf_mass=1e-6 * float(rng.random()), slack=1e-9 * float(rng.random()))
        for delta in (1e-1, 1e-3, 1e-5, 1e-7):
            eps = pld.get_epsilon(delta)
            if math.isinf(eps):
                assert pld.inf_mass + pld.slack >= delta
                continue
            assert pld.get_delta(eps) <= delta * (1 + 1e-9)
            below = eps - 1e-7 * max(1.0, eps)
            if below > 0:
                assert pld.get_delta(below) > delta * (1 - 1e-6)
