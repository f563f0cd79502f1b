"""edge_sdk.mechanisms.device_dp (issue 16): device-level DP-FedAvg with the distributed
discrete Gaussian, on the one path.

Plans come from the round core (``aggregator.round_core.draw_plan``), devices run
``edge_sdk.round.open_round`` with the real engine on the digits data and a ``Book``, the
survivors' residues go through ``aggregator.plain_sum.PlainSum`` (SecAgg+'s survivor rules,
no masks) and the server half decodes. What a device should have sent is recomputed by
replaying its round's seeded rng through the same local-training call."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import numpy as np
import pytest
from exact_support import log_pmf_sum
from scipy.special import logsumexp

from aggregator.plain_sum import PlainSum
from aggregator.round_core import RoundPolicy, draw_plan, mechanism_params, server_half
from edge_sdk import ddp, secagg, wire
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.ledger import Book, Budget, epsilon_rdp
from edge_sdk.mechanisms import MECHANISMS, DeviceDpRound
from edge_sdk.mechanisms.device_dp import (
    DeviceDpDevice,
    device_sigma,
    local_update,
    ring_bits,
    share_variance,
    target_variance,
)
from edge_sdk.model import init_params
from edge_sdk.privacy.events import (
    DistributedDiscreteGaussian,
    PoissonSubsampledGaussian,
    SelfSampled,
)
from edge_sdk.privacy.rdp import discrete_epsilon, rdp_of, rdp_to_epsilon
from edge_sdk.round import Declined, Prepared, coordinates, open_round
from tools.seeding import seeded_bytes

FLEET = "lab"
AGG = secagg.AggregatorIdentity.generate(random_bytes=seeded_bytes("device-dp/agg"))
DELTA = 1e-5
COHORT = tuple(f"d{i:02d}" for i in range(8))
S = 0.27  # the updates of these rounds have norms 0.23..0.30: some are clipped, some not
GAMMA = S / 1024


@pytest.fixture(scope="module")
def model(engine: Any, digits: Any) -> dict[str, Any]:
    spec, eng = engine
    params = init_params(spec, np.random.default_rng(1))
    shards = {n: (digits.x_train[40 * i: 40 * (i + 1)], digits.y_train[40 * i: 40 * (i + 1)])
              for i, n in enumerate(COHORT)}
    return {"eng": eng, "params": params, "d": sum(p.size for p in params), "shards": shards}


def _policy(**kw: Any) -> RoundPolicy:
    base = dict(fleet=FLEET, cohort_size=len(COHORT), mechanism="device-dp", steps=3,
                batch_size=8, lr=0.1, clip=1.0, noise_multiplier=1.0, update_clip=S,
                gamma=GAMMA, min_survivors=5, max_colluders=1)
    return RoundPolicy(**{**base, **kw})


def _plan(model: dict[str, Any], policy: RoundPolicy, round_id: int = 1) -> wire.RoundPlan:
    return draw_plan(policy, round_id=round_id, model_version=0, cohort=COHORT,
                     dim=model["d"], random_bytes=seeded_bytes(f"device-dp/{round_id}"))


def _open(model: dict[str, Any], plan: wire.RoundPlan, name: str, ledger: Any, *,
          seed: int, max_colluders: int = 1) -> Declined | Prepared:
    return open_round(plan, fleet=FLEET, ledger=ledger, params=model["params"],
                      model_version=0, data=lambda: model["shards"][name],
                      engine=model["eng"], dim=model["d"], round_rng=seeded_round_rng(seed),
                      max_colluders=max_colluders)


def _book(limit: bool = True) -> Book:
    """A device's ledger; without a limit (simulation only) for the noiseless rounds."""
    if not limit:
        return Book(budget=None, delta=DELTA)
    return Book(budget=Budget(epsilon=1e6, delta=DELTA))


def _expected(model: dict[str, Any], plan: wire.RoundPlan, name: str, seed: int) -> np.ndarray:
    """The device's clipped kept update, from its round's rng replayed through the same
    training call (the training draws first)."""
    settings = DeviceDpRound.from_plan(plan, dim=model["d"])
    x, y = model["shards"][name]
    update, _ = local_update(model["eng"], model["params"], x, y, settings.training,
                             seeded_round_rng(seed)(plan.round_id))
    coords = coordinates(plan, dim=model["d"])
    kept = update if coords is None else update[coords]
    return kept * min(1.0, settings.update_clip / max(np.linalg.norm(kept), 1e-300))


def _round(model: dict[str, Any], plan: wire.RoundPlan, survivors: tuple[str, ...],
           seed: int) -> tuple[np.ndarray, np.ndarray, dict[str, Prepared]]:
    """(The decoded mean on the kept coordinates, the clipped kept updates' mean, the
    survivors' Prepared) of ``plan`` when the others vanish before uploading."""
    vanished = {n: "masked" for n in plan.cohort if n not in survivors}
    prepared = {}
    for i, name in enumerate(plan.cohort):
        out = _open(model, plan, name, _book(plan.params.sigma > 0), seed=seed + i)
        assert isinstance(out, Prepared), out
        prepared[name] = out
    acc = PlainSum.for_config(prepared[plan.cohort[0]].config, vanished=vanished)
    assert acc.survivors == tuple(sorted(survivors))
    for name in acc.survivors:
        acc.add(name, prepared[name].contribution.values)
    d = model["d"]
    server = server_half(plan, dim=d)
    delta, _ = server.decode(acc.total(), len(acc.survivors), server.init(model["params"]),
                             coords=coordinates(plan, dim=d))
    flat = np.concatenate([p.reshape(-1) for p in delta]).astype(np.float64)
    coords = coordinates(plan, dim=d)
    decoded = flat if coords is None else flat[coords]
    want = np.mean([_expected(model, plan, n, seed + plan.cohort.index(n))
                    for n in acc.survivors], axis=0)
    return decoded, want, {n: prepared[n] for n in acc.survivors}


def _survivable(plan: wire.RoundPlan, n: int) -> tuple[str, ...]:
    """The first n members (in combination order) whose SecAgg+ round survives when the
    others vanish before uploading (the neighbour graph is the round's)."""
    cfg = secagg.RoundConfig.of_plan(plan)
    for keep in itertools.combinations(plan.cohort, n):
        acc = PlainSum.for_config(cfg, vanished={u: "masked" for u in plan.cohort
                                                 if u not in keep})
        if acc.failed is None:
            return keep
    raise AssertionError(f"no {n} members of round {plan.round_id} survive")


# --------------------------------------------------------------------------- registry


def test_registered_and_planned(model) -> None:
    assert MECHANISMS["device-dp"].Params is wire.DeviceDpParams
    assert wire.MECHANISM_PARAMS["device-dp"] is wire.DeviceDpParams
    pol = _policy()
    params, length, bits = mechanism_params(pol, dim=model["d"])
    assert isinstance(params, wire.DeviceDpParams)
    assert length == ddp.padded_dim(model["d"]) == 1024
    # sigma calibrated on the 5 - 1 = 4 honest shares, never on the cohort or survivors
    assert params.sigma == device_sigma(1.0, S, GAMMA, 4)
    assert 4 * share_variance(params.sigma) >= target_variance(1.0, S, GAMMA)
    assert 2 <= bits <= 62
    with pytest.raises(ValueError, match="needs update_clip"):
        _policy(update_clip=None)
    with pytest.raises(ValueError, match="local_noise_multiplier is a setting"):
        RoundPolicy(fleet=FLEET, cohort_size=8, local_noise_multiplier=1.0)


def test_device_sigma_is_the_smallest_that_carries_the_target() -> None:
    for z, shares in ((1.0, 4), (0.3, 7), (2.0, 1)):
        s = device_sigma(z, 1.0, 1.0 / 8, shares)  # small sigma: the deficit matters
        t = target_variance(z, 1.0, 1.0 / 8)
        assert shares * share_variance(s) >= t > shares * share_variance(s * (1 - 1e-6))
    assert device_sigma(0.0, 1.0, 0.01, 3) == 0.0


def test_wire_round_trip_of_the_plan(model) -> None:
    plan = wire.sign(_plan(model, _policy(sparsity=0.25, local_noise_multiplier=0.7)), AGG)
    back = wire.decode(wire.encode(plan), wire.DOWN_KINDS)
    assert back == plan and isinstance(back.params, wire.DeviceDpParams)
    wire.verify(back, AGG.public_key)
    assert back.params.local_noise_multiplier == 0.7 and back.params.sparsity == 0.25
    settings = DeviceDpRound.from_plan(back, dim=model["d"])
    assert settings.kept == len(coordinates(back, dim=model["d"]))
    assert back.length == ddp.padded_dim(settings.kept)
    # a record that breaks the schema does not travel; a length that is not k' is refused
    bad = dataclasses.replace(plan.params, sigma=-1.0)
    with pytest.raises(ValueError, match="DeviceDpParams: field 'sigma'"):
        wire.encode(dataclasses.replace(plan, params=bad))
    with pytest.raises(ValueError, match="padded to"):
        DeviceDpRound.from_plan(dataclasses.replace(plan, length=settings.kept), dim=model["d"])


# ---------------------------------------------------------------------- the round path


def test_ring_bounds() -> None:
    """The rotated bound needs fewer bits than the deterministic one and still keeps the
    wrap probability (by ddp's bound) below the target: at the issue's scale, 2-byte
    residues against 4."""
    sigma = device_sigma(1.0, 1.0, 1 / 1024, 89)
    kw = dict(update_clip=1.0, gamma=1 / 1024, sigma=sigma, cohort_size=100, length=32768)
    bounded = ring_bits(**kw)
    rotated = ring_bits(**kw, bound="rotated")
    assert (bounded, rotated) == (18, 15)
    assert ddp.wrap_probability_bound(100, 32768, 1.0, 1 / 1024, sigma, 15) <= 1e-9
    assert ddp.wrap_probability_bound(100, 32768, 1.0, 1 / 1024, sigma, 14) > 1e-9
    assert ddp.bounded_wrap_probability(100 * ddp.rounded_l2_bound(
        1024.0, 32768, ddp.DEFAULT_BETA), 100, 32768, sigma, 18) <= 1e-9
    with pytest.raises(ValueError, match="bound must be one of"):
        ring_bits(**kw, bound="loose")
    with pytest.raises(ValueError, match="ring_bound is a setting of mechanism 'device-dp'"):
        RoundPolicy(fleet=FLEET, cohort_size=8, ring_bound="rotated")
    with pytest.raises(ValueError, match="ring_bound must be one of"):
        _policy(ring_bound="tight")


@pytest.mark.parametrize(("sparsity", "ring_bound"), [(1.0, "bounded"), (0.3, "bounded"),
                                                      (1.0, "rotated")])
def test_decoded_mean_is_the_clipped_mean_within_the_rounding(model, sparsity: float,
                                                              ring_bound: str) -> None:
    """Without noise, the decode is the clipped updates' mean up to the rounding alone:
    each survivor's integers are within 1 of its scaled rotated update per coordinate, so
    the sum is within n sqrt(k') steps of gamma (the rotation is orthogonal). No wrap in
    either ring (the rotated one is narrower)."""
    plan = _plan(model, _policy(noise_multiplier=0.0, sparsity=sparsity,
                                ring_bound=ring_bound))
    if ring_bound == "rotated":  # a narrower ring than the deterministic bound's
        assert plan.bits < mechanism_params(_policy(noise_multiplier=0.0), dim=model["d"])[2]
    survivors = COHORT[:6]
    decoded, want, prepared = _round(model, plan, survivors, seed=11)
    g, kp = plan.params.gamma, plan.length
    err = np.linalg.norm(decoded - want)
    assert err <= g * len(survivors) * math.sqrt(kp) / len(survivors)
    # the clip bit: dense, some updates were longer than S, some not (rand-k keeps ~30%
    # of each, within S); the mean is inside the ball either way
    clipped = sum(p.contribution.diagnostics["clipped"] for p in prepared.values())
    assert 0 < clipped < len(prepared) if sparsity == 1.0 else clipped == 0
    assert np.linalg.norm(want) <= plan.params.update_clip + 1e-9


def test_decoded_mean_within_the_accounted_noise(model) -> None:
    """With noise, decoded - clipped mean is the rounding plus the summed shares, whose
    std per coordinate (integer scale) is sqrt(n Var) over n = 6 survivors: its norm is
    within the chi-square spread of that (k' = 1024 coordinates: +-20% is > 6 sd)."""
    plan = _plan(model, _policy())
    survivors = COHORT[:6]
    decoded, want, _ = _round(model, plan, survivors, seed=21)
    g, kp, n = plan.params.gamma, plan.length, len(survivors)
    noise_sd = math.sqrt(n * share_variance(plan.params.sigma))  # integer scale, summed
    err = np.linalg.norm((decoded - want) * n / g)  # back on the integer scale, summed
    expect = noise_sd * math.sqrt(kp)
    assert abs(err - expect) <= 0.2 * expect + n * math.sqrt(kp)


def test_noise_at_exactly_min_survivors_has_at_least_the_target_variance(model) -> None:
    """min_survivors = 5 of 8 survive (3 vanish before uploading). The decoded sum's noise
    (decoded - clipped mean, times n / gamma: integer scale) over 12 rounds x d = 650
    coordinates: its sample variance V^ must be >= the target (z S / gamma)^2 that the
    4 honest shares are accounted with, and match 5 Var(sigma) (what 5 shares give).
    Margin: V^ over N = 7800 uncorrelated coordinates (an orthogonal map of iid shares)
    has relative sd sqrt(2 / N) ~ 1.6%; we allow 6 sd (9.6%). Measured: V^ = 1.242 x the
    target, against 5/4 = 1.25 expected. Calibrating sigma on the cohort (8 shares) would
    give 5/8 of the target and fail."""
    pol = _policy(degree=7)  # the complete graph: degree 6 has no 5 members that survive
    errs = []
    for r in range(1, 13):
        plan = _plan(model, pol, round_id=r)
        assert plan.min_survivors == 5 and plan.max_colluders == 1
        decoded, want, _ = _round(model, plan, _survivable(plan, 5), seed=100 * r)
        errs.append((decoded - want) * 5 / plan.params.gamma)
    e = np.concatenate(errs)
    v_hat = float(np.mean(e * e))  # the noise's mean is 0 (symmetric shares)
    margin = 6 * math.sqrt(2 / e.size)
    target = target_variance(1.0, S, GAMMA)
    sigma = plan.params.sigma
    assert v_hat >= target * (1 - margin)
    assert v_hat >= 5 * share_variance(sigma) * (1 - margin)
    assert v_hat <= 5 * share_variance(sigma) * (1 + margin) + 5  # + rounding (< 1/4 each)
    assert 5 / 4 * target * (1 - margin) > target  # the test tells 4 from 5 shares apart


def test_device_declines_a_plan_with_too_few_honest_shares(model) -> None:
    """sigma is calibrated on 4 honest shares (min_survivors 5, 1 colluder). A device that
    assumes 2 colluders counts 3; a plan that says min_survivors 4 leaves 3: both
    decline with reason "noise" before anything is reserved or trained."""
    plan = _plan(model, _policy())
    book = _book()
    out = _open(model, plan, COHORT[0], book, seed=1, max_colluders=2)
    assert isinstance(out, Declined) and out.reason == "noise", out
    assert "3 honest shares" in out.detail and book.reservations() == ()
    low = dataclasses.replace(plan, min_survivors=4)
    out = _open(model, low, COHORT[0], book, seed=1)
    assert isinstance(out, Declined) and out.reason == "noise"
    assert book.reservations() == ()
    # the plan as drawn is taken, and charged with the 4 shares it was calibrated on
    out = _open(model, plan, COHORT[0], book, seed=1)
    assert isinstance(out, Prepared) and out.honest == 4
    agg = out.ledger_plan.aggregate_event
    assert isinstance(agg, DistributedDiscreteGaussian)
    assert (agg.devices, agg.adjacency, agg.dim) == (4, "substitution", 1024)


def test_events_units_and_adjacency(model) -> None:
    plain = DeviceDpRound.from_plan(_plan(model, _policy()), dim=model["d"])
    local, agg = DeviceDpDevice(plain).events(m=40, honest=4)
    assert isinstance(local, DistributedDiscreteGaussian) and local.devices == 1
    assert local.adjacency == agg.adjacency == "substitution"
    assert agg.sigma == plain.sigma and agg.dim == 1024
    assert agg.l2_sensitivity == 2 * ddp.rounded_l2_bound(1024.0, 1024, ddp.DEFAULT_BETA)
    e_local, e_agg = (epsilon_rdp([e], DELTA) for e in (local, agg))
    assert e_agg < e_local < math.inf  # 4 shares beat 1
    dpsgd = DeviceDpRound.from_plan(_plan(model, _policy(local_noise_multiplier=1.1)),
                                    dim=model["d"])
    local, agg2 = DeviceDpDevice(dpsgd).events(m=40, honest=4)
    assert local == PoissonSubsampledGaussian(noise_multiplier=1.1, sample_rate=8 / 40,
                                              steps=3)
    assert agg2 == agg  # the device-level view does not depend on the local noise
    # the device unit (issue 16): zero-out of the device, D2 (half the substitution shift)
    dev = DeviceDpDevice(plain).device_event(honest=4)
    assert dev == DeviceDpDevice(dpsgd).device_event(honest=4)
    assert isinstance(dev, DistributedDiscreteGaussian) and dev.adjacency == "zero_out"
    assert (dev.devices, dev.sigma, dev.dim) == (4, agg.sigma, agg.dim)
    assert dev.l2_sensitivity == ddp.rounded_l2_bound(1024.0, 1024, ddp.DEFAULT_BETA)
    assert 0 < epsilon_rdp([dev], DELTA) < e_agg


def test_other_mechanisms_state_no_device_level_event() -> None:
    """Report nothing rather than something: only device-dp has a device-level theorem."""
    import inspect

    for name, mech in MECHANISMS.items():
        if name == "device-dp":
            continue
        half = next(c for c in vars(inspect.getmodule(mech)).values()
                    if isinstance(c, type) and c.__name__.endswith("Device")
                    and hasattr(c, "device_event"))
        assert half.device_event(object.__new__(half), honest=5) is None, name


def test_device_budget_refuses_in_open_round(model) -> None:
    """A budget set on the device unit: open_round's check-then-reserve refuses with reason
    "budget" once the device-level figure would pass it, before anything is reserved;
    the sample-level budget is far from reached."""
    plan = _plan(model, _policy())
    dev = DeviceDpDevice(DeviceDpRound.from_plan(plan, dim=model["d"])).device_event(
        honest=4)
    one = epsilon_rdp([dev], DELTA)
    limit = one * (1 + 1e-9)  # one round, not two
    assert epsilon_rdp([dev] * 2, DELTA) > limit
    book = Book(budget=Budget(epsilon=1e6, delta=DELTA, device_epsilon=limit))
    first = _open(model, plan, COHORT[0], book, seed=1)
    assert isinstance(first, Prepared) and first.ledger_plan.device_event == dev
    assert first.ledger_plan.colluders == 1
    assert book.spent().device_epsilon == pytest.approx(one)
    out = _open(model, _plan(model, _policy(), round_id=2), COHORT[0], book, seed=2)
    assert isinstance(out, Declined) and out.reason == "budget", out
    assert "device-level epsilon would reach" in out.detail
    assert f"(budget {limit:g})" in out.detail
    assert len(book.reservations()) == 1


# --------------------------------------------------------------- the claim is not low


def _renyi_shift(logp: np.ndarray, shift: int, a: float) -> float:
    """D_a(Y + shift || Y) on a contiguous grid (shift >= 0)."""
    if shift == 0:
        return 0.0
    lp, lq = logp[: logp.size - shift], logp[shift:]
    ok = np.isfinite(lp) & np.isfinite(lq)
    return float(logsumexp(a * lp[ok] + (1 - a) * lq[ok]) / (a - 1))


@pytest.mark.parametrize(("z", "honest"), [(0.5, 3), (0.6, 2), (1.0, 3)])
def test_claimed_epsilon_is_not_below_the_exact_worst_case(z: float, honest: int) -> None:
    """d = 4 (k' = 4), S / gamma = 2: D2 = rounded_l2_bound(2, 4, beta) = sqrt(8). Every
    pair of integer vectors v, v' with ||v||, ||v'|| <= D2 (what conditional rounding can
    send; the device's substitution, which the event states with 2 D2), noise the sum of
    ``honest`` shares of the device half's sigma (small: KLS's tau term is live). The exact
    RDP sum_i D_a(v_i - v'_i + Z || Z) (convolved pmfs, a grid wide enough for the orders'
    tilt), maximized over the pairs, must be <= the device half's event at every order,
    and its epsilon <= the event's."""
    s, gamma = 2.0, 1.0
    sigma = device_sigma(z, s, gamma, honest)
    rnd = DeviceDpRound.from_plan(dataclasses.replace(
        _tiny_plan(honest + 1), params=wire.DeviceDpParams(
            steps=1, batch_size=1, lr=0.1, sampling="poisson", local_clip=1.0,
            local_noise_multiplier=0.0, update_clip=s, gamma=gamma, noise_multiplier=z,
            sigma=sigma, sparsity=1.0, indicator_scale=0.0, sample_rate=1.0)), dim=4)
    _, event = DeviceDpDevice(rnd).events(m=10, honest=honest)
    d2 = event.l2_sensitivity / 2
    assert event.adjacency == "substitution"
    assert d2 == pytest.approx(math.sqrt(8)) and event.devices == honest
    orders = (1.5, 2.0, 3.0, 5.0, 8.0)
    top = int(math.floor(d2))
    half = int(math.ceil(max(orders) * 2 * top + 40 * sigma)) + 10
    logp = log_pmf_sum(sigma, honest, half)
    per = {k: np.array([_renyi_shift(logp, k, a) for a in orders]) for k in range(2 * top + 1)}
    ball = [v for v in itertools.product(range(-top, top + 1), repeat=4)
            if sum(x * x for x in v) <= d2 * d2]
    diffs = {tuple(sorted(abs(a - b) for a, b in zip(v, w, strict=True)))
             for v in ball for w in ball}  # the pmf is symmetric: |difference| per coordinate
    worst = np.zeros(len(orders))
    for u in diffs:
        worst = np.maximum(worst, sum(per[x] for x in u))
    claimed = rdp_of(event, orders)
    assert np.all(claimed >= worst), (claimed, worst)
    assert worst.max() > 0.2 * claimed.max()  # the worst case is a real one, not a straw
    exact_eps = rdp_to_epsilon(worst, np.array(orders), DELTA)[0]
    assert discrete_epsilon(event, DELTA, orders) >= exact_eps


def _tiny_plan(min_survivors: int) -> wire.RoundPlan:
    """A plan of 4 parameters over 5 members (its params are replaced by the caller)."""
    cfg = secagg.RoundConfig.for_cohort(round_id=1, nonce=bytes(32), cohort=list(COHORT[:5]),
                                        bits=20, length=4)
    params = wire.DeviceDpParams(steps=1, batch_size=1, lr=0.1, sampling="poisson",
                                 local_clip=1.0, local_noise_multiplier=0.0, update_clip=2.0,
                                 gamma=1.0, noise_multiplier=0.0, sigma=0.0, sparsity=1.0,
                                 indicator_scale=0.0, sample_rate=1.0)
    return wire.RoundPlan(
        round_id=1, model_version=0, cohort=cfg.cohort, mechanism="device-dp",
        params=params, round_seed=bytes(range(32)), bits=20, length=4, nonce=cfg.nonce,
        degree=cfg.degree, threshold=cfg.threshold,
        min_survivors=max(min_survivors, cfg.threshold), max_colluders=1, stage_timeout=10.0)


# ------------------------------------------------------------------------- the fleet


def _device_fleet(tmp: Any, digits: Any, engine: Any, transport: str = "inproc") -> Any:
    """8 devices, all in every round, SecAgg+, 2 vanish per round at random stages."""
    from test_fleet import BASE

    from tools.fleet import Fleet
    from tools.simconfig import SimConfig

    cfg = SimConfig(**{**BASE, "devices": 8, "participation": 1.0, "rounds": 3,
                       "dropout": 0.2, "mechanism": "device-dp", "update_clip": 1.0,
                       "noise_multiplier": 1.0, "budget_epsilon": 1000.0,
                       "transport": transport})
    return Fleet(cfg, tmp, data=digits, engine=engine)


def _check_device_fleet(fleet: Any, summary: dict[str, Any]) -> None:
    """Rounds complete, each sum is the survivors' inputs bit for bit (``check_sums``), the
    model moves, and every device's ledger holds, for each round it reserved, the
    device-level zero-out event of min_survivors - max_colluders = 3 honest shares (and the
    local event of its own share), and reports the epsilon the accountant gives for them."""
    from test_fleet import _assert_clean_rounds

    from tools.fleet import FLEET_NAME

    _assert_clean_rounds(fleet, summary, 3)  # includes check_sums: exact ring sums
    assert summary["rounds_completed"] == 3
    assert all(len(r["dropped"]) == 2 for r in summary["rounds"])
    assert fleet.machine.model_version == 3
    assert any(not np.array_equal(a, b)
               for a, b in zip(fleet.machine.params, fleet.initial, strict=True))
    pol = fleet.policy
    assert (pol.mechanism, pol.update_clip, pol.gamma) == ("device-dp", 1.0, 1.0 / 1024)
    d = sum(p.size for p in fleet.initial)
    params, length, _ = mechanism_params(pol, dim=d, cohort_size=8)
    honest = pol.survivors_needed(8) - pol.max_colluders
    assert honest == 3 and length == ddp.padded_dim(d)
    cfg_ddp = ddp.DistributedDP(clip=1.0, gamma=1.0 / 1024, noise="discrete_gaussian",
                                bits=20, sigma=params.sigma)
    want_agg = ddp.event(cfg_ddp, honest, d, adjacency="substitution")
    want_local = ddp.event(cfg_ddp, 1, d, adjacency="substitution")
    want_dev = ddp.event(cfg_ddp, honest, d, adjacency="zero_out")
    for name in fleet.names:
        res = fleet.ledgers[name].reservations()
        vanished_early = [r["round"] for r in summary["rounds"]
                          if r["dropped"].get(name) == "keys"]
        assert len(res) == 3 - len(vanished_early) >= 1
        for r in res:
            assert r.plan.aggregate_event == want_agg
            assert r.plan.event == want_local
            assert r.plan.device_event == want_dev
            assert r.plan.colluders == pol.max_colluders
            assert r.plan.round_id.startswith(f"{FLEET_NAME}/")
        spent = fleet.ledgers[name].spent()
        assert spent.aggregate_epsilon == pytest.approx(
            epsilon_rdp([want_agg] * len(res), DELTA), rel=1e-9)
        assert spent.local_epsilon == pytest.approx(
            epsilon_rdp([want_local] * len(res), DELTA), rel=1e-9)
        assert 0 < spent.aggregate_epsilon < spent.local_epsilon < math.inf
        # both units: the device-level figure below the sample-level aggregate one
        assert spent.device_epsilon == pytest.approx(
            epsilon_rdp([want_dev] * len(res), DELTA), rel=1e-9)
        assert 0 < spent.device_epsilon < spent.aggregate_epsilon
        units = [(f.unit, f.view, f.epsilon) for f in fleet.ledgers[name].figures()]
        assert units == [("sample", "local", spent.local_epsilon),
                         ("sample", "aggregate", spent.aggregate_epsilon),
                         ("device", "aggregate", spent.device_epsilon)]
    assert summary["epsilon_aggregate"] == pytest.approx(
        max(led.spent().aggregate_epsilon for led in fleet.ledgers.values()), rel=1e-12)


def test_inproc_fleet_with_secagg_and_dropouts(tmp_path, digits, engine) -> None:
    """tools.fleet over the in-memory broker (:func:`_check_device_fleet`)."""
    fleet = _device_fleet(tmp_path, digits, engine)
    try:
        _check_device_fleet(fleet, fleet.run())
    finally:
        fleet.close()


@pytest.mark.broker
def test_mosquitto_fleet_equals_the_inproc_run(tmp_path, digits, engine) -> None:
    """The same rounds over a real mosquitto: the same checks, and the same survivors,
    integer sums (bit for bit), model and ledgers as in process."""
    ref = _device_fleet(tmp_path / "inproc", digits, engine)
    net = _device_fleet(tmp_path / "mqtt", digits, engine, transport="mqtt")
    try:
        ref_summary, net_summary = ref.run(), net.run()
        _check_device_fleet(net, net_summary)
        assert [r["dropped"] for r in net.rows] == [r["dropped"] for r in ref.rows]
        for r, o in ref.outcomes.items():
            other = net.outcomes[r]
            assert (o.survivors, o.model_version) == (other.survivors, other.model_version)
            assert np.array_equal(o.total, other.total)
        assert net_summary["model_sha256"] == ref_summary["model_sha256"]
        for n in ref.names:
            assert ref.ledgers[n].spent() == net.ledgers[n].spent(), n
    finally:
        ref.close()
        net.close()


def test_cli_runs_device_dp_on_the_fleet_path(tmp_path) -> None:
    import json

    from tools.cli import main

    out = tmp_path / "fleet.json"
    rc = main(["simulate", "--secagg", "--transport", "inproc", "--mechanism", "device-dp",
               "--dataset", "digits", "--model", "logreg", "--devices", "6",
               "--participation", "1", "--rounds", "2", "--local-steps", "3", "--clip", "1",
               "--update-clip", "0.5", "--noise-multiplier", "1", "--dropout", "0.2",
               "--seed", "4", "--quiet", "--workdir", str(tmp_path / "w"),
               "--json-out", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["config"]["mechanism"] == "device-dp" and summary["rounds_completed"] == 2
    assert summary["config"]["update_clip"] == 0.5
    assert 0 < summary["epsilon_aggregate"] < summary["epsilon"]


def test_a_device_dp_config_needs_its_update_clip() -> None:
    """Both paths run device-dp (the fast one since G3: tests/test_one_path.py checks they
    give the same model and ledgers); a config without S is refused on either."""
    from tools.simconfig import SimConfig

    for fleet_path in (False, True):
        with pytest.raises(ValueError, match="needs update_clip"):
            SimConfig(dataset="digits", model="logreg", mechanism="device-dp", clip=1.0,
                      secagg=fleet_path)


def test_on_the_device_csprng_both_modes(model) -> None:
    """What a device runs: the secure round rng (os.urandom), plain SGD dense and DP-SGD
    with rand-k. Residues in the ring, k' of them; the local event is the share's or
    DP-SGD's (sample level)."""
    from edge_sdk.csprng import secure_round_rng

    for kw, kp, local in (({}, 1024, DistributedDiscreteGaussian),
                          ({"local_noise_multiplier": 1.0, "sparsity": 0.5}, 512,
                           PoissonSubsampledGaussian)):
        plan = _plan(model, _policy(**kw))
        out = open_round(plan, fleet=FLEET, ledger=_book(), params=model["params"],
                         model_version=0, data=lambda: model["shards"]["d00"],
                         engine=model["eng"], dim=model["d"], round_rng=secure_round_rng(),
                         max_colluders=1)
        assert isinstance(out, Prepared)
        v = out.contribution.values
        assert v.dtype == np.uint64 and v.shape == (kp,) and int(v.max()) < 1 << plan.bits
        assert isinstance(out.ledger_plan.event, local)


def test_sessions_publish_the_noise_decline(tmp_path, digits, engine) -> None:
    """DeviceSessions that assume 3 colluders (the plan's 1) count 5 - 3 = 2 honest shares
    of a sigma calibrated on 5 - 1 = 4: every cohort member publishes a Decline with
    reason "noise", nothing is reserved, and the round fails cleanly."""
    import msgpack
    from test_session_rounds import Fleet as SessionFleet

    from edge_sdk.session import DeviceSession

    fleet = SessionFleet(tmp_path, digits, engine, rounds=1, epsilon=1000.0, policy={
        "mechanism": "device-dp", "update_clip": 1.0, "gamma": 1 / 1024, "steps": 2})
    try:
        for i, ident in enumerate(fleet.ids):
            name = ident.device
            idx = fleet.shards[i]
            x, y = digits.x_train[idx], digits.y_train[idx]
            s = DeviceSession(fleet=FLEET, identity=ident,
                              registry=fleet.registry, ledger=fleet.ledgers[name],
                              engine=fleet.engine, spec=fleet.spec,
                              data=lambda x=x, y=y: (x, y),
                              round_rng=seeded_round_rng(1000 + i),
                              random_bytes=seeded_bytes(f"dev{i}"), max_colluders=3)
            fleet.broker.detach(name)
            fleet.broker.attach(name, s, fleet.now)
        fleet.settle(until=lambda: bool(fleet.machine.history))
        declines = [msgpack.unpackb(p) for _, t, p in fleet.broker.sent
                    if t.endswith("/up/decline")]
        assert len(declines) == 10 and {d["reason"] for d in declines} == {"noise"}
        assert all("2 honest shares" in d["detail"] for d in declines)
        assert all(not led.reservations() for led in fleet.ledgers.values())
        assert fleet.machine.history[0].completed is False
    finally:
        fleet.close()


def test_device_dp_needs_no_per_sample_clip_on_either_path(tmp_path) -> None:
    """device-dp's noise multiplier is the device-level one (std z S on the sum): its plain
    local SGD needs no per-sample clip C, on the fast path or the fleet's; the plan states
    S in the wire's (finite, unused) local_clip."""
    import json

    from tools.cli import main

    common = ["simulate", "--mechanism", "device-dp", "--dataset", "digits", "--model",
              "logreg", "--devices", "6", "--participation", "1", "--rounds", "1",
              "--local-steps", "2", "--update-clip", "0.5", "--noise-multiplier", "2",
              "--seed", "4", "--quiet"]
    assert main([*common, "--json-out", str(tmp_path / "fast.json")]) == 0
    assert main([*common, "--secagg", "--transport", "inproc", "--workdir",
                 str(tmp_path / "w"), "--json-out", str(tmp_path / "fleet.json")]) == 0
    fast, fleet = (json.loads((tmp_path / f).read_text()) for f in ("fast.json", "fleet.json"))
    assert fast["config"]["clip"] is None  # inf: no per-sample clipping
    assert fast["model_sha256"] == fleet["model_sha256"]
    assert fast["epsilon_device"] == fleet["epsilon_device"] > 0
    # the same run with a per-sample clip stated: plain local SGD ignores it, same model
    assert main([*common, "--clip", "0.01", "--json-out", str(tmp_path / "c.json")]) == 0
    clipped = json.loads((tmp_path / "c.json").read_text())
    assert clipped["model_sha256"] == fast["model_sha256"]
    assert (clipped["epsilon"], clipped["epsilon_device"]) == (fast["epsilon"],
                                                               fast["epsilon_device"])


# ------------------------------------------------------------- adaptive clipping (issue 16)


def test_next_update_clip_is_andrew_et_als_geometric_step() -> None:
    from aggregator.round_core import next_update_clip

    pol = _policy(adaptive_clip_quantile=0.5, adaptive_clip_lr=0.2)
    # by hand: S exp(-eta (b_hat - gamma_q))
    assert next_update_clip(pol, 1.0, 0.8) == pytest.approx(math.exp(-0.06), rel=1e-15)
    assert next_update_clip(pol, 2.0, 0.5) == 2.0  # at the target quantile: unchanged
    assert next_update_clip(pol, 1.0, 0.0) > 1.0  # every norm above S: S grows
    assert next_update_clip(pol, 1.0, None) == 1.0  # a round without a fraction: unchanged
    assert next_update_clip(_policy(), 1.0, 0.9) == 1.0  # fixed clipping
    with pytest.raises(ValueError, match="adaptive_clip_quantile must be in"):
        _policy(adaptive_clip_quantile=1.0)
    with pytest.raises(ValueError, match="setting of mechanism 'device-dp'"):
        RoundPolicy(fleet=FLEET, cohort_size=8, adaptive_clip_quantile=0.5)


def test_the_clip_converges_to_the_target_quantile_of_the_norms() -> None:
    """The rule's fixed point is the target quantile: iterated on exact fractions of a
    fixed sample of norms (no noise), S ends within a few percent of that quantile."""
    from aggregator.round_core import next_update_clip

    norms = np.random.default_rng(0).lognormal(mean=-1.0, sigma=0.5, size=2000)
    for q in (0.2, 0.5, 0.8):
        pol = _policy(adaptive_clip_quantile=q, adaptive_clip_lr=0.2)
        s = 10.0
        for _ in range(400):
            s = next_update_clip(pol, s, float(np.mean(norms <= s)))
        assert s == pytest.approx(float(np.quantile(norms, q)), rel=0.05)


def test_the_indicator_rides_in_the_same_release(model) -> None:
    """With adaptive clipping the plan's indicator scale c is 2 r S, the released vector's
    bound S_joint = sqrt(S^2 + c^2/4) (one more coordinate before padding), sigma carries
    z S_joint over the honest shares, and the events are the joint vector's: a round costs
    what fixed clipping at the same z costs (same S_joint / gamma ratio per unit noise)."""
    fixed = _plan(model, _policy())
    ada = _plan(model, _policy(adaptive_clip_quantile=0.5, indicator_ratio=0.4))
    c = ada.params.indicator_scale
    assert fixed.params.indicator_scale == 0.0 and c == pytest.approx(2 * 0.4 * S)
    r = DeviceDpRound.from_plan(ada, dim=model["d"])
    assert r.values == model["d"] + 1 and r.length == ddp.padded_dim(model["d"] + 1)
    assert r.bound == pytest.approx(math.hypot(S, c / 2))
    honest = ada.min_survivors - ada.max_colluders
    assert honest * share_variance(r.sigma) >= (r.bound / GAMMA) ** 2  # z = 1
    half = DeviceDpDevice(r)
    assert half.refusal(honest=honest) is None
    ev = half.device_event(honest=honest)
    fixed_ev = DeviceDpDevice(DeviceDpRound.from_plan(fixed, dim=model["d"])).device_event(
        honest=honest)
    e_ada = discrete_epsilon(ev, DELTA)
    e_fixed = discrete_epsilon(fixed_ev, DELTA)
    assert e_ada == pytest.approx(e_fixed, rel=0.02)  # the same z on the joint bound


def test_the_server_reads_the_fraction_within_the_clip(model) -> None:
    """Noise-free round: the decoded fraction is the fraction of survivors whose update
    norm was <= S (to the integer grid's error), and the update is the clipped mean."""
    plan = _plan(model, _policy(noise_multiplier=0.0, adaptive_clip_quantile=0.5))
    survivors = plan.cohort
    prepared = {}
    for i, name in enumerate(plan.cohort):
        out = _open(model, plan, name, _book(False), seed=40 + i)
        assert isinstance(out, Prepared), out
        prepared[name] = out
    acc = PlainSum.for_config(prepared[plan.cohort[0]].config, vanished={})
    for name in acc.survivors:
        acc.add(name, prepared[name].contribution.values)
    d = model["d"]
    server = server_half(plan, dim=d)
    norms = []
    for i, name in enumerate(survivors):
        settings = DeviceDpRound.from_plan(plan, dim=d)
        x, y = model["shards"][name]
        update, _ = local_update(model["eng"], model["params"], x, y, settings.training,
                                 seeded_round_rng(40 + i)(plan.round_id))
        norms.append(float(np.linalg.norm(update)))
    want = float(np.mean(np.array(norms) <= S))
    assert 0 < want < 1  # S = 0.27 sits inside these updates' norms
    got = server.quantile(acc.total(), len(survivors))
    assert got == pytest.approx(want, abs=0.01)
    delta, _ = server.decode(acc.total(), len(survivors), server.init(model["params"]),
                             coords=None)
    flat = np.concatenate([p.reshape(-1) for p in delta]).astype(np.float64)
    clipped = np.mean([_expected(model, plan, n, 40 + i) for i, n in enumerate(survivors)],
                      axis=0)
    assert np.abs(flat - clipped).max() < 4 * GAMMA
    # a fixed-clipping round has no fraction to read
    plain = _plan(model, _policy(noise_multiplier=0.0))
    assert server_half(plain, dim=d).quantile(acc.total(), len(survivors)) is None


# ------------------------------------------------------------- self-sampled check-ins


def _coins(model: dict[str, Any], plan: wire.RoundPlan, seed: int) -> dict[str, bool]:
    """Each member's coin, replayed from its round rng: the training draws first, then b."""
    settings = DeviceDpRound.from_plan(plan, dim=model["d"])
    out = {}
    for i, name in enumerate(plan.cohort):
        rng = seeded_round_rng(seed + i)(plan.round_id)
        x, y = model["shards"][name]
        local_update(model["eng"], model["params"], x, y, settings.training, rng)
        out[name] = bool(rng.random() < settings.sample_rate)
    return out


def test_self_sampling_sends_the_null_record_behind_the_mask(model) -> None:
    """q = 0.5, no noise: every member uploads the same kind of vector (its length, its
    ring), and the decoded sum is, within the rounding, the clipped updates of exactly the
    members whose coin said yes; the server divides by q x survivors."""
    plan = _plan(model, _policy(noise_multiplier=0.0, self_sample_rate=0.5))
    assert plan.params.sample_rate == 0.5
    survivors = COHORT[:6]
    decoded, _, prepared = _round(model, plan, survivors, seed=31)
    coins = _coins(model, plan, 31)
    yes = [n for n in survivors if coins[n]]
    assert 0 < len(yes) < len(survivors), coins  # this seed draws both
    sizes = {p.contribution.values.shape for p in prepared.values()}
    assert sizes == {(plan.length,)}
    want = np.sum([_expected(model, plan, n, 31 + plan.cohort.index(n)) for n in yes],
                  axis=0)
    g, kp, n = plan.params.gamma, plan.length, len(survivors)
    err = np.linalg.norm(decoded * 0.5 * n - want)
    assert err <= g * n * math.sqrt(kp)
    assert np.linalg.norm(want) > 10 * g * n * math.sqrt(kp)  # a real signal, not rounding


def test_self_sampling_charges_the_amplified_release(model) -> None:
    """The device-level event behind the coin is SelfSampled over the same zero-out release
    (Zhu-Wang Thm 6), cheaper than the release itself over many rounds; the sample-level
    events do not change (no amplification is claimed for them); the ledger stores and
    composes it."""
    full = DeviceDpRound.from_plan(_plan(model, _policy()), dim=model["d"])
    tenth = DeviceDpRound.from_plan(_plan(model, _policy(self_sample_rate=0.1)),
                                    dim=model["d"])
    inner = DeviceDpDevice(full).device_event(honest=4)
    dev = DeviceDpDevice(tenth).device_event(honest=4)
    assert dev == SelfSampled(event=inner, sample_rate=0.1)
    assert DeviceDpDevice(tenth).events(m=40, honest=4) == DeviceDpDevice(full).events(
        m=40, honest=4)
    assert epsilon_rdp([dev] * 50, DELTA) < 0.5 * epsilon_rdp([inner] * 50, DELTA)
    book = _book()
    out = _open(model, _plan(model, _policy(self_sample_rate=0.1)), COHORT[0], book, seed=3)
    assert isinstance(out, Prepared), out
    assert out.contribution.device_event == SelfSampled(
        event=DeviceDpDevice(tenth).device_event(honest=4).event, sample_rate=0.1)
    (res,) = book.reservations()
    assert res.plan.device_event == out.contribution.device_event
    assert book.spent().device_epsilon == pytest.approx(
        epsilon_rdp([out.contribution.device_event], DELTA))


def test_self_sample_rate_is_device_dp_only_and_in_range() -> None:
    with pytest.raises(ValueError, match=r"self_sample_rate must be in \(0, 1\]"):
        _policy(self_sample_rate=0.0)
    with pytest.raises(ValueError, match="self_sample_rate is a setting of mechanism"):
        RoundPolicy(fleet=FLEET, cohort_size=8, mechanism="gaussian", self_sample_rate=0.5)
    from tools.simconfig import SimConfig
    with pytest.raises(ValueError, match="self_sample_rate applies to mechanism 'device-dp'"):
        SimConfig(self_sample_rate=0.5)


@pytest.mark.parametrize(("z", "honest", "q"), [(0.6, 2, 0.3), (1.0, 3, 0.1), (1.0, 2, 0.7)])
def test_self_sampled_claim_is_not_below_the_exact_mixture_of_the_real_release(
        z: float, honest: int, q: float) -> None:
    """The device half's own self-sampled event (d = 3, S / gamma = 2) against what an
    adversary who sees the sum faces: Q = the sum of ``honest`` shares, P = (1 - q) Q + q (Q
    shifted by the rounded update v), for every v conditional rounding can send (by the
    pattern of |v_i|: the pmf is symmetric and the coordinates exchangeable), both orders of
    the pair, exactly on the 3-d grid. The claim must be >= the worst at every order, and its
    epsilon >= the worst pair's (from the exact RDP curve)."""
    dim, s, gamma = 3, 2.0, 1.0
    sigma = device_sigma(z, s, gamma, honest)
    rnd = DeviceDpRound.from_plan(dataclasses.replace(
        _tiny_plan(honest + 1), params=wire.DeviceDpParams(
            steps=1, batch_size=1, lr=0.1, sampling="poisson", local_clip=1.0,
            local_noise_multiplier=0.0, update_clip=s, gamma=gamma, noise_multiplier=z,
            sigma=sigma, sparsity=1.0, indicator_scale=0.0, sample_rate=q)), dim=dim)
    event = DeviceDpDevice(rnd).device_event(honest=honest)
    assert isinstance(event, SelfSampled) and event.sample_rate == q
    d2 = event.event.l2_sensitivity
    assert d2 > s / gamma and event.event.devices == honest
    orders = (1.5, 2.0, 3.0, 5.0, 8.0)
    top = int(math.floor(d2))
    half = int(math.ceil(12 * sigma)) + 2 * top + 2
    lp0 = log_pmf_sum(sigma, honest, half)  # one coordinate of Q
    size = lp0.size
    with np.errstate(divide="ignore"):
        lp0 = np.maximum(lp0, -700.0)  # tails far below every term that matters

    def log_ratio(shift: int) -> np.ndarray:  # log L_i(x) = log p0(x - shift) - log p0(x)
        out = np.full(size, -700.0)
        out[shift:] = lp0[: size - shift]
        return out - lp0

    def outer_sum(parts: list[np.ndarray]) -> np.ndarray:  # x -> sum_i parts[i][x_i]
        return functools.reduce(np.add.outer, parts)

    patterns = {tuple(sorted((abs(x) for x in v), reverse=True))
                for v in itertools.product(range(-top, top + 1), repeat=dim)
                if sum(x * x for x in v) <= d2 * d2} - {(0,) * dim}
    logq = outer_sum([lp0] * dim)
    worst = np.zeros(len(orders))
    for pat in patterns:
        log_l = outer_sum([log_ratio(k) for k in pat])
        log_mix = np.logaddexp(math.log1p(-q), math.log(q) + log_l)  # log P/Q
        for i, a in enumerate(orders):
            pq = logsumexp(logq + a * log_mix) / (a - 1)  # D_a(P || Q)
            qp = logsumexp(logq + (1 - a) * log_mix) / (a - 1)  # D_a(Q || P)
            worst[i] = max(worst[i], pq, qp)
    claimed = rdp_of(event, orders)
    assert np.all(claimed >= worst), (claimed, worst)
    assert worst.max() > 0.05 * claimed.max()  # a real worst case, not a straw
    assert discrete_epsilon(event.event, DELTA, orders) >= rdp_to_epsilon(
        worst, np.array(orders), DELTA)[0]
    assert rdp_to_epsilon(claimed, np.array(orders), DELTA)[0] >= rdp_to_epsilon(
        worst, np.array(orders), DELTA)[0]
