"""Buffered asynchronous rounds (FedBuff, issue 19): the device's train-ahead and weighted
encoding, the round machine's buffers, a fleet of them on the in-memory broker, and the
timed comparison with synchronous rounds (``tools.fedbuff``).

What a device sends is recomputed as an adversary who knows the seeds could: the held
update from the same training call and rng, the weight from the public versions, the
noise from the round's rng."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aggregator.round_core import RoundPolicy, draw_offer, draw_plan
from aggregator.rounds import Duplicate, Rejected, RoundMachine
from edge_sdk import ddp, secagg, wire
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.ledger import Book, Budget
from edge_sdk.mechanisms import DeviceDpRound
from edge_sdk.mechanisms.device_dp import local_update
from edge_sdk.model import init_params
from edge_sdk.round import (
    Declined,
    Held,
    Prepared,
    open_buffered,
    open_round,
    train_ahead,
)
from edge_sdk.session import TrainedAhead
from tests.test_session_rounds import Fleet, _accuracy
from tools.seeding import seeded_bytes
from tools.simconfig import FLEET_NAME

FLEET = "lab"
DELTA = 1e-5
COHORT = tuple(f"d{i:02d}" for i in range(6))
S = 0.27
AGG = secagg.AggregatorIdentity.generate(random_bytes=seeded_bytes("fedbuff/agg"))
DEVS = [secagg.DeviceIdentity.generate(n, random_bytes=seeded_bytes(f"fedbuff/{n}"))
        for n in COHORT]
REG = secagg.Registry.of(AGG, DEVS)


@pytest.fixture(scope="module")
def model(engine: Any, digits: Any) -> dict[str, Any]:
    spec, eng = engine
    params = init_params(spec, np.random.default_rng(1))
    return {"eng": eng, "params": params, "d": sum(p.size for p in params),
            "data": (digits.x_train[:40], digits.y_train[:40])}


def _policy(**kw: Any) -> RoundPolicy:
    base = dict(fleet=FLEET, cohort_size=len(COHORT), mechanism="device-dp", steps=3,
                batch_size=8, lr=0.1, clip=1.0, noise_multiplier=1.0, update_clip=S,
                gamma=S / 1024, min_survivors=4, max_colluders=1, buffered=True,
                max_staleness=3, staleness_exponent=0.5)
    return RoundPolicy(**{**base, **kw})


def _plan(model: dict[str, Any], policy: RoundPolicy, *, version: int,
          round_id: int = 5) -> wire.RoundPlan:
    return draw_plan(policy, round_id=round_id, model_version=version, cohort=COHORT,
                     dim=model["d"], random_bytes=seeded_bytes(f"fedbuff/plan/{round_id}"))


def _ahead(model: dict[str, Any], offer: wire.BufferOffer, ledger: Any, *, version: int = 2,
           seed: int = 11, engine: Any = None) -> Declined | Held:
    return train_ahead(offer, fleet=FLEET, ledger=ledger, params=model["params"],
                       model_version=version, data=lambda: model["data"],
                       engine=model["eng"] if engine is None else engine, dim=model["d"],
                       round_rng=seeded_round_rng(seed), max_colluders=1)


def _book() -> Book:
    return Book(budget=Budget(epsilon=1e6, delta=DELTA, device_epsilon=1e3))


# ----------------------------------------------------------------------- the device


def test_the_spend_is_reserved_before_training(model) -> None:
    offer = draw_offer(_policy(), dim=model["d"])
    book = _book()
    seen: list[int] = []

    class Watch:  # the engine: every call during training sees the reservation already
        def __getattr__(self, name: str) -> Any:
            seen.append(len(book.reservations()))
            return getattr(model["eng"], name)

    held = _ahead(model, offer, book, engine=Watch())
    assert isinstance(held, Held) and seen and min(seen) == 1
    (res,) = book.reservations()
    assert res.plan.round_id == f"{FLEET}/ahead/2.0" and res is held.reservation
    # the reserved event is exactly a synchronous round's with the same settings
    plan = _plan(model, _policy(buffered=False), version=2)
    sync = open_round(plan, fleet=FLEET, ledger=_book(), params=model["params"],
                      model_version=2, data=lambda: model["data"], engine=model["eng"],
                      dim=model["d"], round_rng=seeded_round_rng(11), max_colluders=1)
    assert isinstance(sync, Prepared)
    assert dataclasses.replace(sync.ledger_plan, round_id=res.plan.round_id) == res.plan
    # a second update on the same model is a second spend, under a new name
    again = _ahead(model, offer, book)
    assert isinstance(again, Held) and again.ledger_plan.round_id == f"{FLEET}/ahead/2.1"
    assert len(book.reservations()) == 2


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_the_weighted_encoding_is_what_an_adversary_recomputes(model, tau) -> None:
    policy = _policy()
    offer = draw_offer(policy, dim=model["d"])
    held = _ahead(model, offer, _book(), version=2, seed=11)
    assert isinstance(held, Held)
    plan = _plan(model, policy, version=2 + tau)
    got = open_buffered(plan, held, dim=model["d"], round_rng=seeded_round_rng(11),
                        max_colluders=1)
    assert isinstance(got, Prepared) and got.reservation is held.reservation
    # the adversary's replay: the same training call and rng, the public weight
    settings = DeviceDpRound.from_plan(plan, dim=model["d"])
    x, y = model["data"]
    update, _ = local_update(model["eng"], model["params"], x, y, settings.training,
                             seeded_round_rng(11)(offer_rng_id(2)))
    np.testing.assert_array_equal(update, held.update)
    w = (1 + tau) ** -0.5
    assert offer.weight(tau) == pytest.approx(w)
    clipped = update * min(1.0, S / np.linalg.norm(update))
    want = ddp.encode_device(w * clipped, settings.encoding, plan.round_seed,
                             seeded_round_rng(11)(plan.round_id))
    np.testing.assert_array_equal(got.contribution.values, want)


def offer_rng_id(version: int) -> int:
    from edge_sdk.round import _AHEAD_RNG
    return _AHEAD_RNG + version


def test_a_weighted_update_never_exceeds_the_clip(model, monkeypatch) -> None:
    """The event is stated for S; what encode hands the noise step, w clip_S(u), must stay
    within S for every update and tau (tiny, exactly-S, huge and overflowing norms), so
    the weight can only lower the sensitivity."""
    import edge_sdk.mechanisms.device_dp as device_dp

    policy = _policy()
    settings = DeviceDpRound.from_plan(_plan(model, policy, version=3), dim=model["d"])
    half = device_dp.DeviceDpDevice(settings)
    seen: list[np.ndarray] = []

    def capture(kept: np.ndarray, cfg: Any, seed: bytes, rng: Any) -> np.ndarray:
        seen.append(np.array(kept))
        return np.zeros(settings.length, np.uint64)

    monkeypatch.setattr(device_dp.ddp, "encode_device", capture)
    rng = np.random.default_rng(0)
    weights = sorted({(1 + t) ** -a for t in range(0, 9) for a in (0.0, 0.5, 1.0, 2.0)})
    for scale in (1e-12, 1e-3, S / 25.5, 1.0, 1e6, 1e200):
        u = rng.normal(size=model["d"]) * scale
        for w in weights:
            with np.errstate(over="ignore"):
                half.encode(u, m=40, loss=0.0, coords=None, honest=3, rng=rng, weight=w)
            v = seen.pop()
            assert np.isfinite(v).all()
            if w < 1:  # weighted: already within w S; unweighted: encode_device clips
                with np.errstate(over="ignore"):
                    assert np.linalg.norm(v) <= w * S * (1 + 1e-12)
    with pytest.raises(ValueError, match="weight"):
        half.encode(u, m=40, loss=0.0, coords=None, honest=3, rng=rng, weight=1.5)


def test_stale_or_altered_plans_are_declined(model) -> None:
    policy = _policy()
    offer = draw_offer(policy, dim=model["d"])
    held = _ahead(model, offer, _book(), version=2)
    assert isinstance(held, Held)

    def open_(plan: wire.RoundPlan) -> Declined | Prepared:
        return open_buffered(plan, held, dim=model["d"], round_rng=seeded_round_rng(1),
                             max_colluders=1)

    for version in (1, 2 + policy.max_staleness + 1):  # older than the update; too stale
        out = open_(_plan(model, policy, version=version))
        assert isinstance(out, Declined) and out.reason == "stale_model"
    # less noise, fewer survivors, more colluders: each another event than the one reserved
    for change in ({"noise_multiplier": 0.5}, {"min_survivors": 3}, {"max_colluders": 2},
                   {"update_clip": 2 * S}):
        out = open_(_plan(model, _policy(**change), version=3))
        assert isinstance(out, Declined) and out.reason == "mechanism", change


def test_a_device_refuses_what_it_cannot_train_ahead_for(model) -> None:
    """An offer the policy would never make (adaptive clipping, whose indicator a weight
    would move) is declined before anything is reserved, not crashed on later."""
    policy = _policy(buffered=False, adaptive_clip_quantile=0.5)
    offer = dataclasses.replace(draw_offer(_policy(), dim=model["d"]),
                                params=draw_offer(policy, dim=model["d"]).params)
    book = _book()
    out = _ahead(model, offer, book)
    assert isinstance(out, Declined) and out.reason == "mechanism"
    assert book.reservations() == ()


def test_only_device_dp_over_secagg_plus_is_buffered() -> None:
    for bad in ({"mechanism": "gaussian", "update_clip": None, "gamma": None},
                {"secagg": "amortized"}, {"adaptive_clip_quantile": 0.5},
                {"min_cohort": 5}):
        with pytest.raises(ValueError, match="buffered rounds cannot go with"):
            _policy(**bad)
    with pytest.raises(ValueError, match="max_staleness"):
        _policy(max_staleness=-1)


# ----------------------------------------------------------------------- the aggregator


def _machine(model: dict[str, Any], **kw: Any) -> RoundMachine:
    return RoundMachine(policy=_policy(**kw), identity=AGG, registry=REG,
                        params=model["params"], random_bytes=seeded_bytes("fedbuff/m"))


def _ready(i: int, *, offer: int = 1, version: int = 0,
           attempt: int = 0) -> tuple[str, bytes]:
    msg = wire.sign(wire.Ready(round_id=0, sender=COHORT[i], offer=offer,
                               trained_version=version, attempt=attempt), DEVS[i])
    return wire.device_up_topic(FLEET, COHORT[i], "ready"), wire.encode(msg)


def _checkin(i: int) -> tuple[str, bytes]:
    msg = wire.sign(wire.CheckIn(round_id=0, sender=COHORT[i], data_size=40,
                                 remaining_epsilon=10.0, budget_epsilon=10.0,
                                 budget_delta=DELTA, spent_epsilon=0.0, model_version=0),
                    DEVS[i])
    return wire.device_up_topic(FLEET, COHORT[i], "checkin"), wire.encode(msg)


def test_the_machine_starts_a_buffer_when_k_are_ready(model) -> None:
    m = _machine(model)
    out = m.on_connect(0.0)
    offers = [p for p in out if p.topic == wire.round_topic(FLEET)]
    assert len(offers) == 1 and offers[0].retain
    offer = wire.decode(offers[0].payload, wire.OFFER_KINDS)
    REG.verify_message(offer)
    assert offer.buffer_size == len(COHORT) and offer.max_staleness == 3
    for i in range(len(COHORT)):
        m.on_message(*_checkin(i), 1.0)
    assert m.stage == "idle"  # checked in, none ready
    for i in range(len(COHORT) - 1):
        m.on_message(*_ready(i), 2.0)
    assert m.stage == "idle"
    plans = m.on_message(*_ready(len(COHORT) - 1), 3.0)
    assert m.stage != "idle" and len(plans) == len(COHORT)
    plan = m.current_plan  # what every member checks against its offer
    assert plan.cohort == COHORT
    assert (plan.mechanism, plan.params, plan.bits, plan.length, plan.min_survivors) == (
        offer.mechanism, offer.params, offer.bits, offer.length, offer.min_survivors)
    m.take_events()
    # a Ready again for the update the round took is a duplicate, not a new queue entry
    m.on_message(*_ready(0), 4.0)
    assert any(isinstance(e, Duplicate) for e in m.take_events())
    # the round fails (nobody answers): its members train again on the same model (their
    # second update on it) and queue again; the first ones stay spent
    t = 4.0
    while m.stage != "idle":
        t += m.policy.stage_timeout + 1
        m.on_tick(t)
    assert not m.history[-1].completed and m.model_version == 0
    for i in range(len(COHORT)):
        m.on_message(*_checkin(i), t)
        m.on_message(*_ready(i, attempt=1), t)
    assert m.stage != "idle" and m.current_plan.round_id == 2


def test_the_machine_rejects_bad_ready_messages(model) -> None:
    m = _machine(model)
    m.on_connect(0.0)
    topic, payload = _ready(0, offer=9)
    m.on_message(topic, payload, 1.0)
    m.on_message(*_ready(1, version=4), 1.0)  # a model the aggregator never published
    m.on_message(_ready(2)[0], _ready(3)[1], 1.0)  # another device's Ready
    m.on_message(_ready(2)[0], b"\x81\xa1v\x08", 1.0)
    rejected = [e for e in m.take_events() if isinstance(e, Rejected)]
    assert len(rejected) == 4
    assert "offer 9" in rejected[0].reason and "newer than 0" in rejected[1].reason
    sync = _machine(model, buffered=False)
    sync.on_connect(0.0)
    assert all(p.topic != wire.round_topic(FLEET) for p in sync.on_connect(0.0))
    sync.on_message(*_ready(0), 1.0)
    (e,) = [e for e in sync.take_events() if isinstance(e, Rejected)]
    assert "synchronous" in e.reason


# ----------------------------------------------------------------------- a fleet


def test_a_buffered_fleet_learns_with_one_spend_per_update(tmp_path: Path, digits,
                                                          engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=6, epsilon=1e4, policy={
        "mechanism": "device-dp", "update_clip": 1.0, "gamma": 1 / 1024, "cohort_size": 5,
        "noise_multiplier": 0.3, "buffered": True, "max_staleness": 3})
    fleet.settle(until=lambda: len(fleet.machine.history) >= 6
                 and fleet.machine.stage == "idle")
    hist = fleet.machine.history
    assert [o.completed for o in hist] == [True] * 6
    bits = {}
    for _, topic, payload in fleet.broker.sent:
        if topic.endswith("/down/plan"):
            plan = wire.decode(payload, wire.DOWN_KINDS)
            bits[plan.round_id] = plan.bits
    for o in hist:  # each sum is its members' weighted, noised inputs, bit for bit
        want = sum(fleet.sessions[d].encoded_input(o.round_id).astype(object)
                   for d in o.survivors)
        mask = (1 << bits[o.round_id]) - 1
        assert [int(v) & mask for v in want] == [int(v) for v in o.total], o.round_id
    acc0 = _accuracy(fleet.engine, fleet.initial, digits)
    assert _accuracy(fleet.engine, fleet.machine.params, digits) > acc0 + 0.2
    for name, s in fleet.sessions.items():
        trained = [e for e in s.take_events() if isinstance(e, TrainedAhead)]
        res = fleet.ledgers[name].reservations()
        # every spend is one update trained ahead, and each is in at most one round
        assert [r.plan.round_id for r in res] == [e.ledger_round for e in trained]
        assert all(r.plan.round_id.startswith(f"{FLEET}/ahead/") for r in res)
        rounds_in = [o for o in hist if name in o.survivors]
        assert len(rounds_in) <= len(res)
        # committed at the unmask request: exactly the rounds it is in (no dropouts here)
        assert len(res) - len(fleet.ledgers[name].pending()) == len(rounds_in)
    # a member restarted after its update went in gets that round's plan again: it holds
    # no update, so it declines instead of training (and spending) a second time
    name = hist[-1].survivors[0]
    plan = [p for _, t, p in fleet.broker.sent
            if t == wire.device_down_topic(FLEET, name, "plan")][-1]
    s = fleet.start_device(name)  # (it trains ahead on the model it gets: a new spend)
    before = fleet.ledgers[name].reservations()
    if s.held_version is not None:
        s._held = None  # as if it restarted again before that finished
    out = s.on_message(wire.device_down_topic(FLEET, name, "plan"), plan, fleet.now)
    assert [p.topic.rsplit("/", 1)[1] for p in out][0] == "decline"
    assert fleet.ledgers[name].reservations() == before
    fleet.close()


# ----------------------------------------------------------------------- on the clock


def _fleet_config(**kw: Any) -> Any:
    """A small device-dp fleet with secure aggregation (digits + logreg)."""
    from tools.simconfig import SimConfig

    return SimConfig(**{"dataset": "digits", "model": "logreg", "local_steps": 5,
                        "batch_size": 16, "lr": 0.5, "mechanism": "device-dp",
                        "update_clip": 1.0, "noise_multiplier": 1.0, "seed": 3,
                        "secagg": True, "progress": False, "rounds": 1, **kw})


def test_buffered_rounds_outpace_synchronous_ones_on_the_clock(tmp_path: Path) -> None:
    from tools.fedbuff import Availability, compare_fedbuff

    cfg = _fleet_config(devices=40, participation=0.125)
    av = Availability(online_mean_s=600, offline_mean_s=600, seed=1)
    r = compare_fedbuff(cfg, av, tmp_path, target=2.0, horizon_s=600.0,
                        device_epsilon=40.0, out=None)
    sync, buf = r["sync"], r["buffered"]
    assert not sync["reached"] and not buf["reached"]  # a target no model reaches: 10 min
    assert buf["rounds_completed"] > sync["rounds_completed"] >= 1
    assert buf["staleness_max"] >= 1 and sync["staleness_max"] is None
    for row in (sync, buf):
        assert row["max_device_epsilon"] <= row["device_budget"] == 40.0
        assert [c["t"] for c in row["curve"]] == sorted(c["t"] for c in row["curve"])


@pytest.mark.broker
def test_buffered_rounds_over_mosquitto_with_dropouts(tmp_path: Path) -> None:
    """The same offer, Ready, plans and weighted uploads over a real mosquitto (TLS, a
    password and ACLs per device): the offer is readable on the fleet's round topic, Ready
    publishable on each device's uplink, and dropouts are recovered as in a round."""
    from tools.fleet import Fleet, data_and_engine, shard_indices
    from tools.simconfig import round_policy

    cfg = _fleet_config(devices=12, participation=1 / 3, noise_multiplier=0.5, rounds=3,
                        transport="mqtt", dropout=0.25)
    data, eng = data_and_engine(cfg)
    sizes = [len(s) for s in shard_indices(cfg, data)]
    policy = dataclasses.replace(round_policy(cfg, sizes), buffered=True, max_staleness=2)
    fleet = Fleet(cfg, tmp_path, data=data, engine=eng, policy=policy)
    try:
        res = fleet.run()
        assert res["rounds_completed"] == 3
        assert all(r["dropped"] for r in res["rounds"])  # one vanished in each
        fleet.check_sums()  # each sum is its survivors' inputs, bit for bit
        for name, led in fleet.ledgers.items():
            assert all(r.plan.round_id.startswith(f"{FLEET_NAME}/ahead/")
                       for r in led.reservations()), name
    finally:
        fleet.close()


def test_a_timed_run_is_a_function_of_its_seeds(tmp_path: Path) -> None:
    """Nothing measured enters the simulated clock: the same seeds, the same run."""
    from tools.fedbuff import Availability, run_timed

    cfg = _fleet_config(devices=20, participation=0.25, local_steps=3)
    av = Availability(online_mean_s=300, offline_mean_s=300, train_median_s=10, seed=4)
    runs = [run_timed(cfg, av, tmp_path / str(i), buffered=True, target=2.0,
                      horizon_s=300.0, device_epsilon=40.0) for i in range(2)]
    assert runs[0]["rounds_completed"] >= 2
    assert runs[0]["curve"] == runs[1]["curve"]
