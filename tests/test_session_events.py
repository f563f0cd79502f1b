"""DeviceSession's events (plan15 E2): each is emitted exactly once, when it happens.

Sans-I/O: one session is handed plans, secure-aggregation messages, models and error
notices signed by the fleet's aggregator identity, and ``take_events()`` after each call is
compared with what the session published. A whole round runs on the in-memory broker of
``tests/test_session_rounds.py`` (20 devices, the real ``RoundMachine``), and the device
adapter (``edge_sdk.device._Agent``) is checked to report from these events.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest
from test_device_enforces import _NoReserve
from test_session_rounds import FLEET, Fleet, _down_kind

from edge_sdk import secagg, wire
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.device import _Agent, _Data
from edge_sdk.session import (
    CheckedIn,
    Declined,
    DeviceSession,
    ModelAdopted,
    RoundClosed,
    RoundOpened,
    Uploaded,
)

COHORT = ("d00", "d01", "d02", "d03", "d04")
ME = "d00"
PLAN_TOPIC = wire.device_down_topic(FLEET, ME, "plan")


def _plan(fleet: Fleet, round_id: int = 1, *, cohort: tuple[str, ...] = COHORT,
          **changes: Any) -> wire.RoundPlan:
    """A valid plan for ``cohort`` over the fleet's model, signed by the fleet's aggregator."""
    d = sum(p.size for p in fleet.initial)
    cfg = secagg.RoundConfig.for_cohort(round_id=round_id, nonce=bytes([round_id]) * 32,
                                        cohort=list(cohort), bits=32, length=d)
    params = wire.GaussianParams(steps=2, batch_size=8, lr=0.1, sampling="poisson", clip=1.0,
                                 noise_multiplier=1.0, sparsity=1.0, quant_levels=0,
                                 scale=2.0**10, value_bound=1.0)
    plan = wire.RoundPlan(
        round_id=round_id, model_version=0, cohort=cfg.cohort, mechanism="gaussian",
        params=params, round_seed=bytes(32), bits=32,
        length=d, nonce=cfg.nonce, degree=cfg.degree, threshold=cfg.threshold,
        min_survivors=cfg.threshold, max_colluders=1, stage_timeout=10.0)
    pfields = {f.name for f in dataclasses.fields(wire.GaussianParams)}
    pchanges = {k: changes.pop(k) for k in list(changes) if k in pfields}
    plan = dataclasses.replace(plan, params=dataclasses.replace(params, **pchanges), **changes)
    return wire.sign(plan, fleet.agg_id)


def _fresh(fleet: Fleet, name: str = ME) -> DeviceSession:
    """The device's session with its events so far (connect, model 0) taken."""
    s = fleet.sessions[name]
    assert s.model_version == 0
    s.take_events()
    return s


def _decline_of(out: list[wire.Publish]) -> wire.Decline:
    # the decline, then a check-in: the round is over for the device
    assert [p.topic.rsplit("/", 1)[1] for p in out] == ["decline", "checkin"]
    msg = wire.decode(out[0].payload, wire.UP_KINDS)
    assert isinstance(msg, wire.Decline)
    return msg


def _declined(s: DeviceSession) -> list[Any]:
    """The session's events after a decline, less the check-in that follows it."""
    ev = s.take_events()
    assert [type(e) for e in ev] == [Declined, CheckedIn]
    return ev[:1]


@pytest.fixture
def fleet(tmp_path, digits, engine):
    f = Fleet(tmp_path, digits, engine, rounds=0)  # the machine never starts a round
    yield f
    f.close()


# ----------------------------------------------------------------------- check-in, model


def test_connect_and_model_adoption(fleet) -> None:
    s = fleet.sessions[ME]
    first = s.take_events()  # attached: the retained model 0, then on_connect
    assert [type(e) for e in first] == [ModelAdopted, CheckedIn, CheckedIn]
    assert first[0] == ModelAdopted(version=0, round_id=0)
    assert all(e.model_version == 0 and e.data_size == len(fleet.shards[0])
               for e in first[1:])
    assert s.take_events() == []  # taken once
    out = s.on_connect(1.0)
    ck = wire.decode(out[0].payload, wire.UP_KINDS)
    assert s.take_events() == [CheckedIn(model_version=0, data_size=ck.data_size,
                                         remaining_epsilon=ck.remaining_epsilon,
                                         spent_epsilon=ck.spent_epsilon,
                                         budget_epsilon=ck.budget_epsilon,
                                         budget_delta=ck.budget_delta)]
    retained = fleet.broker.retained[wire.model_topic(FLEET)]
    assert s.on_message(wire.model_topic(FLEET), retained, 2.0) == []
    assert s.take_events() == []  # the model it holds again: no adoption


def test_checkin_states_the_ledgers_budget_and_spend(fleet) -> None:
    """The check-in carries the ledger's budget and its spent local epsilon at the budget's
    delta (``spent()``); a ledger that cannot be read gives no spend (None), never 0."""
    s = _fresh(fleet)
    led = fleet.ledgers[ME]
    ck = wire.decode(s.on_connect(1.0)[0].payload, wire.UP_KINDS)
    assert (ck.spent_epsilon, ck.budget_epsilon, ck.budget_delta, ck.remaining_epsilon) == (
        led.spent().local_epsilon, led.budget.epsilon, led.budget.delta, led.remaining())
    assert ck.spent_epsilon == 0.0 and ck.budget_epsilon == 50.0 and ck.budget_delta == 1e-5
    led.close()  # the device can no longer read its ledger
    s.take_events()
    ck = wire.decode(s.on_connect(2.0)[0].payload, wire.UP_KINDS)
    fleet.registry.verify_message(ck)  # still a valid, signed check-in
    assert (ck.spent_epsilon, ck.remaining_epsilon, ck.data_size) == (None, 0.0, 0)
    assert (ck.budget_epsilon, ck.budget_delta) == (50.0, 1e-5)  # fixed at creation
    (ev,) = s.take_events()
    assert isinstance(ev, CheckedIn) and ev.spent_epsilon is None


def test_checkin_every_restarts_on_each_checkin(fleet) -> None:
    i = 0
    s = DeviceSession(fleet=FLEET, identity=fleet.ids[i], registry=fleet.registry,
                      ledger=fleet.ledgers[ME], engine=fleet.engine, spec=fleet.spec,
                      data=lambda: (fleet.digits.x_train[:5], fleet.digits.y_train[:5]),
                      round_rng=seeded_round_rng(1), checkin_every=30.0)
    assert len(s.on_connect(100.0)) == 1 and len(s.take_events()) == 1
    assert s.on_tick(129.0) == [] and s.take_events() == []
    assert len(s.on_tick(130.0)) == 1
    assert [type(e) for e in s.take_events()] == [CheckedIn]
    assert s.on_tick(159.0) == [] and s.take_events() == []


# ----------------------------------------------------------------------- plans and declines


def test_round_opened_once_and_a_redelivered_plan_emits_nothing(fleet) -> None:
    s = _fresh(fleet)
    plan = _plan(fleet)
    raw = wire.encode(plan)
    out = s.on_message(PLAN_TOPIC, raw, 0.0)
    assert [p.topic.rsplit("/", 1)[1] for p in out] == ["advertise_keys"]
    assert s.take_events() == [RoundOpened(round_id=1, model_version=0, length=plan.length,
                                           cohort_size=len(COHORT))]
    assert s.on_message(PLAN_TOPIC, raw, 1.0) == out  # redelivered: the same answer
    assert s.take_events() == []
    assert len(fleet.ledgers[ME].reservations()) == 1


def _decline_case(fleet: Fleet, reason: str) -> tuple[DeviceSession, wire.RoundPlan]:
    s = _fresh(fleet)
    plan = _plan(fleet)
    if reason == "stale_model":
        plan = _plan(fleet, model_version=1)
    elif reason == "ledger":
        s._ledger = _NoReserve(fleet.ledgers[ME])  # noqa: SLF001  (a full disk)
    elif reason == "diverged":
        plan = _plan(fleet, lr=1e300)  # overflows the float32 step
    elif reason == "already_committed":
        assert s.on_message(PLAN_TOPIC, wire.encode(plan), 0.0)  # took part, then crashed
        s = fleet.start_device(ME)  # a new process on the reopened ledger
        s.take_events()
    elif reason == "no_data":
        empty = fleet.digits.x_train[:0], fleet.digits.y_train[:0]
        s = DeviceSession(fleet=FLEET, identity=fleet.ids[0], registry=fleet.registry,
                          ledger=fleet.ledgers[ME], engine=fleet.engine, spec=fleet.spec,
                          data=lambda: empty, round_rng=seeded_round_rng(1))
        s.on_message(wire.model_topic(FLEET), fleet.broker.retained[wire.model_topic(FLEET)],
                     0.0)
        s.take_events()
    return s, plan


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("reason", ["stale_model", "ledger", "already_committed", "no_data",
                                    "diverged"])
def test_each_decline_is_one_event_with_the_published_reason(fleet, reason: str) -> None:
    s, plan = _decline_case(fleet, reason)
    out = s.on_message(PLAN_TOPIC, wire.encode(plan), 0.0)
    msg = _decline_of(out)
    assert msg.reason == reason
    assert _declined(s) == [Declined(round_id=1, reason=reason, detail=msg.detail)]
    assert s.round_id is None
    reserved = [r for r in fleet.ledgers[ME].reservations() if r.plan.round_id == f"{FLEET}/1"]
    # only a decline after training (diverged) or a round taken before is in the ledger
    assert bool(reserved) == (reason in ("diverged", "already_committed"))


def test_a_mechanism_the_device_lacks_is_declined_before_anything(fleet, monkeypatch) -> None:
    """A device built without the plan's mechanism (an older build) declines with reason
    ``mechanism``: one event, nothing reserved, never trained."""
    import edge_sdk.round

    monkeypatch.setattr(edge_sdk.round, "MECHANISMS", {})
    s = _fresh(fleet)
    msg = _decline_of(s.on_message(PLAN_TOPIC, wire.encode(_plan(fleet)), 0.0))
    assert msg.reason == "mechanism" and "'gaussian'" in msg.detail
    assert _declined(s) == [Declined(round_id=1, reason="mechanism", detail=msg.detail)]
    assert s.round_id is None and fleet.ledgers[ME].reservations() == ()


def test_budget_decline(tmp_path, digits, engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=0, epsilon=0.5)
    try:
        s = _fresh(fleet)
        msg = _decline_of(s.on_message(PLAN_TOPIC, wire.encode(_plan(fleet)), 0.0))
        assert msg.reason == "budget" and "epsilon would reach" in msg.detail
        assert _declined(s) == [Declined(round_id=1, reason="budget", detail=msg.detail)]
        assert not fleet.ledgers[ME].reservations()
    finally:
        fleet.close()


def test_colluder_floor(fleet) -> None:
    # a device assuming more colluders than the plan's survivor floor allows still takes
    # part, with no credit for others' noise (r'' floored at 1: aggregate view = local)
    s = DeviceSession(fleet=FLEET, identity=fleet.ids[0], registry=fleet.registry,
                      ledger=fleet.ledgers[ME], engine=fleet.engine, spec=fleet.spec,
                      data=lambda: (fleet.digits.x_train[:40], fleet.digits.y_train[:40]),
                      round_rng=seeded_round_rng(1), max_colluders=len(COHORT))
    s.on_message(wire.model_topic(FLEET), fleet.broker.retained[wire.model_topic(FLEET)], 0.0)
    s.take_events()
    plan = _plan(fleet)
    assert s.on_message(PLAN_TOPIC, wire.encode(plan), 0.0)
    assert [type(e) for e in s.take_events()] == [RoundOpened]
    (res,) = fleet.ledgers[ME].reservations()
    assert res.plan.aggregate_event == res.plan.event
    # a plan whose own max_colluders leaves no honest member cannot be built or signed (the
    # schema checks it as a receiver would; the decode-side refusal of such bytes is in
    # test_device_enforces): the session sees nothing and emits nothing
    with pytest.raises(ValueError, match="max_colluders must be below"):
        _plan(fleet, round_id=2, max_colluders=plan.threshold)
    assert s.take_events() == [] and s.round_id == 1


def test_rejected_messages_emit_nothing(fleet) -> None:
    s = _fresh(fleet)
    forged = wire.encode(wire.sign(_plan(fleet), fleet.outsider))
    for topic, payload in [(PLAN_TOPIC, forged), (PLAN_TOPIC, b"\xc1"),
                           (wire.model_topic(FLEET), b"\x80"),
                           (wire.device_down_topic(FLEET, ME, "error"), wire.encode(wire.sign(
                               wire.ErrorNotice(round_id=1, recipient=ME, code="round_failed"),
                               fleet.agg_id)))]:  # no open round
        assert s.on_message(topic, payload, 0.0) == []
    assert s.take_events() == []


# ----------------------------------------------------------------------- leaving a round


def _opened(fleet: Fleet) -> DeviceSession:
    s = _fresh(fleet)
    assert s.on_message(PLAN_TOPIC, wire.encode(_plan(fleet)), 0.0)
    assert [type(e) for e in s.take_events()] == [RoundOpened]
    return s


def test_superseded_round_closes_then_the_new_one_opens(fleet) -> None:
    s = _opened(fleet)
    assert s.on_message(PLAN_TOPIC, wire.encode(_plan(fleet, round_id=2)), 1.0)
    ev = s.take_events()
    assert ev[0] == RoundClosed(round_id=1, reason="superseded", uploaded=False,
                                model_version=0)
    assert [type(e) for e in ev] == [RoundClosed, RoundOpened] and ev[1].round_id == 2
    assert not ev[0].contributed


def test_silent_round_closes_on_tick(fleet) -> None:
    s = _opened(fleet)
    assert s.on_tick(60.0) == [] and s.take_events() == []  # 6 stage timeouts not yet over
    out = s.on_tick(60.5)
    assert [p.topic.rsplit("/", 1)[1] for p in out] == ["checkin"]
    ev = s.take_events()
    assert ev[0] == RoundClosed(round_id=1, reason="silent", uploaded=False, model_version=0)
    assert [type(e) for e in ev] == [RoundClosed, CheckedIn]


def test_error_notice_closes_the_round_with_its_code(fleet) -> None:
    s = _opened(fleet)
    notice = wire.encode(wire.sign(wire.ErrorNotice(round_id=1, recipient=ME,
                                                    code="round_failed"), fleet.agg_id))
    out = s.on_message(wire.device_down_topic(FLEET, ME, "error"), notice, 1.0)
    assert [p.topic.rsplit("/", 1)[1] for p in out] == ["checkin"]
    ev = s.take_events()
    assert ev[0] == RoundClosed(round_id=1, reason="round_failed", uploaded=False,
                                model_version=0)
    assert [type(e) for e in ev] == [RoundClosed, CheckedIn]


def test_new_model_closes_the_round(fleet) -> None:
    s = _opened(fleet)
    params = [p + 1 for p in fleet.initial]
    model = wire.encode(wire.sign(wire.ModelUpdate.of(version=1, round_id=1, params=params),
                                  fleet.agg_id))
    out = s.on_message(wire.model_topic(FLEET), model, 1.0)
    assert [p.topic.rsplit("/", 1)[1] for p in out] == ["checkin"]
    ev = s.take_events()
    assert ev[:2] == [ModelAdopted(version=1, round_id=1),
                      RoundClosed(round_id=1, reason="new model", uploaded=False,
                                  model_version=1)]
    assert [type(e) for e in ev] == [ModelAdopted, RoundClosed, CheckedIn]
    assert ev[2].model_version == 1 and not ev[1].contributed


# ----------------------------------------------------------------------- a whole round


def _round_with_held_shares(fleet: Fleet) -> dict[str, bytes]:
    """Run round 1 up to collect_masked, holding back every forwarded-shares downlink;
    returns device -> the held payload."""
    held: dict[str, bytes] = {}

    def hold(name: str, topic: str, payload: bytes) -> bool:
        if _down_kind(topic, payload) == "forwarded_shares":
            held[name] = payload
            return True
        return False

    fleet.broker.drop = hold
    fleet.broker.run(fleet.now)
    assert fleet.machine.stage == "collect_masked" and held
    return held


def _release(fleet: Fleet) -> None:
    """Deliver the held shares again (an aggregator reconnect re-sends its outbox) and
    finish the round."""
    m = fleet.machine
    fleet.broker.drop = lambda *a: False
    fleet.broker.detach("aggregator")
    fleet.broker.attach("aggregator", m, fleet.now)
    fleet.settle(until=lambda: len(m.history) >= 1 and m.stage == "idle")
    assert m.history[0].completed


def test_upload_once_resent_on_redelivery_and_round_closed_contributed(
        tmp_path, digits, engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=1)
    try:
        for s in fleet.sessions.values():
            s.take_events()
        held = _round_with_held_shares(fleet)
        plan = fleet.machine.current_plan
        events = {n: s.take_events() for n, s in fleet.sessions.items()}
        for n, ev in events.items():  # the plan: members opened the round, nobody else did
            assert [type(e) for e in ev] == ([RoundOpened] if n in plan.cohort else [])
        me = sorted(held)[0]
        s = fleet.sessions[me]
        topic = wire.device_down_topic(FLEET, me, "forwarded_shares")
        out = s.on_message(topic, held[me], fleet.now)
        parts = [p for p in out if p.topic.endswith("/up/masked_part")]
        assert parts == out and parts
        size = sum(len(p.payload) for p in out)
        assert s.take_events() == [Uploaded(round_id=plan.round_id, parts=len(out), size=size)]
        for p in out:
            fleet.broker.publish(me, p)
        assert s.on_message(topic, held[me], fleet.now) == out  # redelivered: resent
        assert s.take_events() == [Uploaded(round_id=plan.round_id, parts=len(out), size=size,
                                            resent=True)]
        _release(fleet)
        o = fleet.machine.history[0]
        for n, sess in fleet.sessions.items():
            ev = sess.take_events()
            if n not in plan.cohort:
                assert [type(e) for e in ev] == [ModelAdopted, CheckedIn], n
                continue
            uploads = [e for e in ev if isinstance(e, Uploaded)]
            if n == me:  # its upload already left: the re-sent request gets it again
                assert uploads and all(e.resent for e in uploads)
            else:
                assert [e.resent for e in uploads] == [False], n
                assert uploads[0].size == sum(len(p) for sender, t, p in fleet.broker.sent
                                              if sender == n and t.endswith("/up/masked_part"))
            closed = [e for e in ev if isinstance(e, RoundClosed)]
            assert closed == [RoundClosed(round_id=o.round_id, reason="new model",
                                          uploaded=True, model_version=1)], n
            assert closed[0].contributed
            assert [type(e) for e in ev if not isinstance(e, Uploaded)] == \
                [ModelAdopted, RoundClosed, CheckedIn], n
            assert n in o.survivors
    finally:
        fleet.close()


def test_a_round_failed_after_the_upload_is_not_contributed(tmp_path, digits, engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=1)
    try:
        held = _round_with_held_shares(fleet)
        me = sorted(held)[0]
        s = fleet.sessions[me]
        s.take_events()
        assert s.on_message(wire.device_down_topic(FLEET, me, "forwarded_shares"), held[me],
                           fleet.now)
        assert [type(e) for e in s.take_events()] == [Uploaded]
        notice = wire.encode(wire.sign(wire.ErrorNotice(round_id=1, recipient=me,
                                                        code="round_failed"), fleet.agg_id))
        s.on_message(wire.device_down_topic(FLEET, me, "error"), notice, fleet.now)
        closed, checkin = s.take_events()
        assert closed == RoundClosed(round_id=1, reason="round_failed", uploaded=True,
                                     model_version=0)
        assert not closed.contributed and isinstance(checkin, CheckedIn)
    finally:
        fleet.close()


def test_device_adapter_reports_from_session_events(tmp_path, digits, engine) -> None:
    """``_Agent`` (the MQTT adapter's endpoint) turns session events into its reports."""
    fleet = Fleet(tmp_path, digits, engine, rounds=1)
    reports: dict[str, list[dict[str, Any]]] = {}
    agents: dict[str, _Agent] = {}
    try:
        for i, ident in enumerate(fleet.ids):
            n = ident.device
            idx = fleet.shards[i]
            fleet.sessions[n].take_events()  # those before the adapter wraps the session
            reports[n] = []
            agents[n] = _Agent(fleet.sessions[n], _Data((digits.x_train[idx],
                                                          digits.y_train[idx])),
                               reports[n].append)
            fleet.broker.detach(n)
            fleet.broker.attach(n, agents[n], fleet.now)
        fleet.settle(until=lambda: len(fleet.machine.history) >= 1
                     and fleet.machine.stage == "idle")
        o = fleet.machine.history[0]
        assert o.completed
        for n, rep in reports.items():
            kinds = [r["event"] for r in rep]
            assert kinds[:2] == ["connected", "checkin"], n  # model 0 already held
            if n not in o.survivors:
                assert kinds[2:] == ["model", "checkin"], (n, kinds)
                assert agents[n].contributed == 0
                continue
            assert kinds[2:] == ["round", "uploaded", "model", "round_end", "checkin"], n
            chunks = [p for s, t, p in fleet.broker.sent
                      if s == n and t.endswith("/up/masked_part")]
            assert rep[3] == {"event": "uploaded", "round": 1, "chunks": len(chunks),
                              "bytes": sum(len(p) for p in chunks)}
            assert rep[5] == {"event": "round_end", "round": 1, "contributed": True,
                              "model_version": 1}
            assert agents[n].contributed == 1
            assert fleet.sessions[n].take_events() == []  # the adapter took them all
        # a decline is reported with the reason it published
        me = o.survivors[0]
        plan = _plan(fleet, round_id=9, cohort=tuple(sorted({me, *COHORT})))  # model 0: stale
        out = agents[me].on_message(wire.device_down_topic(FLEET, me, "plan"),
                                    wire.encode(plan), fleet.now)
        sent = msgpack.unpackb(out[0].payload)
        assert reports[me][-2] == {"event": "declined", "round": 9, "reason": sent["reason"]}
        assert reports[me][-1]["event"] == "checkin"  # the round is over for it
        assert sent["reason"] == "stale_model"
    finally:
        fleet.close()


def test_events_are_bounded_for_a_driver_that_never_takes_them(fleet) -> None:
    s = fleet.sessions[ME]
    for t in range(1100):
        s.on_connect(float(t))
    ev = s.take_events()
    assert 0 < len(ev) <= 1024 and all(isinstance(e, CheckedIn) for e in ev)
    assert np.isfinite(ev[-1].remaining_epsilon)


def test_fleet_agents_take_events_that_match_the_dropouts(tmp_path, digits, engine) -> None:
    """tools.fleet's DeviceAgent keeps its session's events: they agree with the dropout
    schedule and with the aggregator's record of who uploaded."""
    from tools.fleet import Fleet as SimFleet
    from tools.simconfig import SimConfig

    cfg = SimConfig(dataset="digits", model="logreg", devices=30, participation=0.34,
                    rounds=3, local_steps=3, batch_size=16, lr=0.5, clip=1.0,
                    noise_multiplier=1.0, value_bound=2.0, seed=3, secagg=True,
                    progress=False, dropout=0.3)
    fleet = SimFleet(cfg, tmp_path, data=digits, engine=engine)
    try:
        summary = fleet.run()
        assert summary["note"] == "" and sorted(fleet.outcomes) == [1, 2, 3]
        stages = set()
        for r, o in fleet.outcomes.items():
            uploaded = set()
            for n, a in fleet.agents.items():
                mine = [e for e in a.events if getattr(e, "round_id", None) == r
                        and not isinstance(e, ModelAdopted)]
                opened = [e for e in mine if isinstance(e, RoundOpened)]
                ups = [e for e in mine if isinstance(e, Uploaded) and not e.resent]
                closed = [e for e in mine if isinstance(e, RoundClosed)]
                assert len(opened) <= 1 and len(ups) <= 1 and len(closed) <= 1, (n, mine)
                assert len(ups) <= len(opened) and not [e for e in mine
                                                        if isinstance(e, Declined)]
                stage = a.vanished.get(r)
                stages.add(stage)
                if stage == "keys":
                    assert not opened, n
                elif stage in ("shares", "masked"):
                    assert opened and not ups, (n, stage)
                elif stage == "unmask":
                    assert opened and ups, n
                if ups:
                    uploaded.add(n)
                if opened and stage is None:
                    assert closed, n  # every member still there leaves the round once
                for c in closed:
                    assert c.uploaded == bool(ups)
                    assert c.contributed == (o.completed and bool(ups)), (n, c)
            assert uploaded == set(o.uploaded), r
        assert {"keys", "masked", "unmask"} <= stages  # the schedule exercised them
    finally:
        fleet.close()
