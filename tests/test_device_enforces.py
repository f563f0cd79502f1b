"""Issue 14, findings 5 and 8: a device enforces what its ledger is accounted on.

* An unmask request for a sum of fewer than the plan's ``min_survivors`` uploads (or one
  whose count contradicts the survivors it names) gets no answer; the genuine request that
  follows is answered and the round completes.
* The ``diverged`` decline reveals a bit of the noisy update, so it leaves only after the
  round is reserved in the ledger; a ledger that cannot reserve means nothing leaves.
* ``max_colluders`` travels in the signed plan and is validated against the threshold on
  both ends.

The fleet harness (20 devices, one aggregator, the in-memory broker) is
``tests/test_session_rounds.py``'s.
"""

from __future__ import annotations

import dataclasses
import logging

import msgpack
import pytest
from test_session_rounds import FLEET, Fleet, _down_kind

from aggregator.rounds import RoundPolicy
from edge_sdk import secagg, wire
from edge_sdk.ledger import LedgerError
from edge_sdk.wire import WireError


def _forged(plan: wire.RoundPlan, agg: secagg.AggregatorIdentity, payload: bytes,
            **changes) -> bytes:
    """The aggregator's unmask request with ``changes``, validly signed by the aggregator."""
    req = wire.decode(payload, wire.ALL_KINDS)
    digest = secagg.RoundConfig.of_plan(plan).digest()
    return wire.encode(wire.sign(dataclasses.replace(req, **changes), agg, context=digest))


def _plans(fleet: Fleet) -> dict[int, wire.RoundPlan]:
    return {p.round_id: p for p in (wire.decode(pl, wire.ALL_KINDS)
                                    for _, t, pl in fleet.broker.sent
                                    if t.endswith("/down/plan"))}


@pytest.mark.parametrize("lie", ["below_min_survivors", "contradicts_named_survivors"])
def test_device_refuses_unmask_below_min_survivors(tmp_path, digits, engine, caplog,
                                                    lie) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=1,
                  policy={"min_survivors": 8, "degree": 9})  # complete graph over 10
    refused: list[tuple[str, list]] = []

    def drop(name: str, topic: str, payload: bytes) -> bool:
        if _down_kind(topic, payload) == "unmask_request" and not refused:
            req = wire.decode(payload, wire.ALL_KINDS)
            plan = _plans(fleet)[req.round_id]
            assert req.survivor_count == len(req.survivors) + 1 >= plan.min_survivors
            count = (plan.min_survivors - 1 if lie == "below_min_survivors"
                     else req.survivor_count + 1)  # more than the device can see survived
            with caplog.at_level(logging.WARNING, logger="edge_sdk.session"):
                out = fleet.sessions[name].on_message(
                    topic, _forged(plan, fleet.agg_id, payload, survivor_count=count), fleet.now)
            refused.append((name, out))
        return False  # the genuine request is delivered after the forged one

    fleet.broker.drop = drop
    try:
        fleet.settle(until=lambda: len(fleet.machine.history) >= 1)
        assert refused, "no unmask request was sent"
        name, out = refused[0]
        assert out == [], "the device answered an unmask request it must refuse"
        assert any("refused" in r.getMessage() and name in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        outcome = fleet.machine.history[0]
        assert outcome.completed and name in outcome.survivors  # the genuine one: answered
        committed = [r for r in fleet.ledgers[name].reservations()
                     if r.plan.round_id == f"{FLEET}/1"]
        assert committed and not fleet.ledgers[name].pending()
    finally:
        fleet.close()


def _declines(fleet: Fleet, round_id: int) -> dict[str, str]:
    out = {}
    for sender, topic, payload in fleet.broker.sent:
        if topic.endswith("/up/decline"):
            msg = wire.decode(payload, wire.ALL_KINDS)
            if msg.round_id == round_id:
                out[sender] = msg.reason
    return out


class _NoReserve:
    """The device's real ledger, except that writing a reservation fails (a full disk)."""

    def __init__(self, ledger) -> None:
        self._ledger = ledger

    def __getattr__(self, name: str):
        return getattr(self._ledger, name)

    def reserve(self, plan):
        raise LedgerError("disk full (injected)")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_diverged_decline_is_reserved_first(tmp_path, digits, engine) -> None:
    # lr = 1e300 overflows the float32 step: every cohort member's update is non-finite
    fleet = Fleet(tmp_path, digits, engine, rounds=1, policy={"lr": 1e300})
    broken = fleet.ids[0].device

    fleet.sessions[broken]._ledger = _NoReserve(fleet.ledgers[broken])  # fault injection
    try:
        fleet.settle(until=lambda: bool(_plans(fleet)) and len(
            _declines(fleet, 1)) >= len(_plans(fleet)[1].cohort) - (
                broken in _plans(fleet)[1].cohort))
        plan = _plans(fleet)[1]
        declines = _declines(fleet, 1)
        for dev in plan.cohort:
            reserved = [r for r in fleet.ledgers[dev].reservations()
                        if r.plan.round_id == f"{FLEET}/1"] if dev != broken else []
            if dev == broken:
                # it could not reserve, so it declined before training ("ledger": a fact
                # about its disk, nothing about its data) and sent nothing else
                assert declines.get(dev) == "ledger", (dev, declines.get(dev))
                assert not [t for s, t, _ in fleet.broker.sent
                            if s == dev and t.endswith("/up/advertise_keys")], "it trained and sent"
                continue
            assert declines.get(dev) == "diverged", (dev, declines.get(dev))
            assert reserved and not fleet.ledgers[dev].pending(), dev
            detail = next(wire.decode(p, wire.ALL_KINDS).detail
                          for s, t, p in fleet.broker.sent
                          if s == dev and t.endswith("/up/decline"))
            assert not any(ch.isdigit() for ch in detail), detail  # no data-derived value
    finally:
        fleet.close()


def test_max_colluders_is_in_the_signed_plan(tmp_path, digits, engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=1, policy={"max_colluders": 2})
    try:
        fleet.settle(until=lambda: len(fleet.machine.history) >= 1)
        plan = _plans(fleet)[1]
        assert plan.max_colluders == 2
        assert plan.min_survivors - plan.max_colluders >= 1
        assert fleet.machine.history[0].completed
    finally:
        fleet.close()


def test_max_colluders_is_validated() -> None:
    base = {"fleet": FLEET, "cohort_size": 10}
    assert RoundPolicy(**base).max_colluders == 1  # the default assumes one colluder
    RoundPolicy(**base, max_colluders=0)
    t = RoundPolicy(**base).config_threshold(RoundPolicy(**base).config_degree(10))
    with pytest.raises(ValueError, match="below the secagg threshold"):
        RoundPolicy(**base, max_colluders=t)
    with pytest.raises(ValueError, match="max_colluders must be an integer"):
        RoundPolicy(**base, max_colluders=-1)
    # a smaller min_cohort has a lower threshold: checked there too
    small = {**base, "min_cohort": 6, "min_survivors": 5}
    small_t = RoundPolicy(**small).config_threshold(RoundPolicy(**small).config_degree(6))
    assert small_t < t
    RoundPolicy(**small, max_colluders=small_t - 1)
    with pytest.raises(ValueError, match="below the secagg threshold"):
        RoundPolicy(**small, max_colluders=small_t)
    assert wire.colluder_problem(1, threshold=2, min_survivors=2) is None
    assert "honest" in wire.colluder_problem(1, threshold=1 + 1, min_survivors=1)


def test_plan_with_bad_max_colluders_is_rejected_on_decode() -> None:
    agg = secagg.AggregatorIdentity.generate()
    devs = [secagg.DeviceIdentity.generate(f"d{i}") for i in range(5)]
    cfg = secagg.RoundConfig.for_cohort(round_id=3, nonce=bytes(32),
                                        cohort=[d.device for d in devs], bits=32, length=4)
    params = wire.GaussianParams(steps=1, batch_size=8, lr=0.1, sampling="poisson", clip=1.0,
                                 noise_multiplier=1.0, sparsity=1.0, quant_levels=0,
                                 scale=2.0**10, value_bound=1.0)
    plan = wire.RoundPlan(
        round_id=3, model_version=0, cohort=cfg.cohort, mechanism="gaussian", params=params,
        round_seed=bytes(32), bits=32, length=4, nonce=cfg.nonce, degree=cfg.degree,
        threshold=cfg.threshold, min_survivors=cfg.threshold, max_colluders=1,
        stage_timeout=10.0)
    signed = wire.sign(plan, agg)
    assert wire.decode(wire.encode(signed), wire.ALL_KINDS).max_colluders == 1
    for bad in (cfg.threshold, cfg.threshold + 3):
        # the aggregator cannot even sign such a plan; a peer's bytes are refused
        with pytest.raises(ValueError, match="max_colluders"):
            wire.sign(dataclasses.replace(plan, max_colluders=bad), agg)
        raw = msgpack.packb({**signed.to_wire(), "max_colluders": bad}, use_bin_type=True)
        with pytest.raises(WireError, match="max_colluders"):
            wire.decode(raw, wire.ALL_KINDS)
    obj = msgpack.unpackb(wire.encode(signed))
    del obj["max_colluders"]
    with pytest.raises(WireError):
        wire.decode(msgpack.packb(obj), wire.ALL_KINDS)
