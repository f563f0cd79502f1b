"""Isolation between devices without a broker (issue 13): the flood guard and the bounded
log (``aggregator.guard``), and the round machine's quarantines, re-sends, status events
and failed-round uploads, driven through the in-memory broker on a deterministic clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_session_rounds import Fleet, _check_sums, _down_kind

from aggregator.guard import FloodGuard, FloodLimits, LogLimiter, reason_class
from aggregator.rounds import Duplicate, Quarantined, Released, Resent, StatusSeen
from edge_sdk import wire
from edge_sdk.wire import Publish

FLEET = "lab"




# ----------------------------------------------------------------------- pure parts


def test_flood_guard_burst_refill_and_size() -> None:
    g = FloodGuard(FloodLimits(burst=5, rate=2.0))
    assert all(g.admit("a", 0.0) for _ in range(5))
    assert not g.admit("a", 0.0)
    assert g.admit("b", 0.0)  # one device's bucket is its own
    assert not g.admit("a", 0.4)  # 0.8 tokens refilled: not yet
    assert g.admit("a", 0.5) and not g.admit("a", 0.5)  # 1 token at 0.5 s
    assert g.admit("a", 100.0) and sum(g.admit("a", 100.0) for _ in range(10)) == 4  # capped
    g.reset("a")
    assert not g.admit("a", 100.0, size=5 * 2**20)  # 6 tokens > burst 5: refused, none taken
    assert g.admit("a", 100.0, size=4 * 2**20 - 1)  # 4 tokens
    assert g.admit("a", 100.0) and not g.admit("a", 100.0)
    with pytest.raises(ValueError, match="burst must be"):
        FloodLimits(burst=0)
    with pytest.raises(ValueError, match="rate must be"):
        FloodLimits(rate=float("nan"))


def test_log_limiter_counts_what_it_does_not_write() -> None:
    lim = LogLimiter(interval_s=10.0, per_key=2, reasons_per_device=2)
    writes = [lim.admit("d1", f"round {i}: 'x{i}' is bad", 1.0)[0] for i in range(5)]
    assert writes == [True, True, False, False, False]  # one reason class despite the values
    assert lim.admit("d2", "round 3: 'y' is bad", 2.0) == (True, [])  # per device
    assert lim.admit("d1", "other", 3.0)[0] and lim.admit("d1", "third", 3.0)[0]  # -> "*"
    assert lim.admit("d1", "fourth", 3.0)[0]  # "*" counts per key like any other
    assert lim.admit("d1", "fifth", 3.0)[0] is False
    assert lim.flush(9.9) == []
    write, done = lim.admit("d1", "round 9: 'z' is bad", 11.0)  # a new interval
    assert write
    assert [(s.device, s.reason, s.count) for s in done] == [
        ("d1", "*", 1), ("d1", "round #: '…' is bad", 3)]
    assert lim.flush(11.0) == [] and lim.flush(25.0) == []  # each summary once
    assert reason_class("chunk 12 of 'dev-1' " + "x" * 200) == "chunk # of '…' " + "x" * 65


# ----------------------------------------------------------------------- the machine


def _fleet(tmp: Path, digits: Any, engine: Any, **policy: Any) -> Fleet:
    return Fleet(tmp, digits, engine, rounds=1, policy={"stage_timeout": 8.0, **policy})


def _step(fleet: Fleet, dt: float) -> None:
    fleet.now += dt
    fleet.broker.tick(fleet.now)


def test_a_dropped_request_is_sent_again_to_the_device_still_pending(
        tmp_path: Path, digits: Any, engine: Any) -> None:
    fleet = _fleet(tmp_path, digits, engine)
    lost: list[str] = []

    def drop(name: str, topic: str, payload: bytes) -> bool:  # each stage's first request
        kind = _down_kind(topic, payload)
        if kind is not None and kind not in lost and name == fleet.machine.current_plan.cohort[0]:
            lost.append(kind)
            return True
        return False

    fleet.broker.drop = drop
    fleet.broker.run(fleet.now)
    m = fleet.machine
    victim = m.current_plan.cohort[0]
    resent: list[Resent] = []
    for _ in range(40):  # re-sends at 2 s (stage_timeout / 4), long before the 8 s deadline
        _step(fleet, 2.0)
        resent += [e for e in m.take_events() if isinstance(e, Resent)]
        if m.history:
            break
    assert lost == ["plan", "neighbour_keys", "forwarded_shares", "unmask_request"]
    assert [(e.stage, e.devices, e.attempt) for e in resent] == [
        ("collect_keys", (victim,), 1), ("collect_shares", (victim,), 1),
        ("collect_masked", (victim,), 1), ("collect_unmask", (victim,), 1)]
    (o,) = m.history
    assert o.completed and victim in o.survivors and len(o.survivors) == 10
    assert o.uploaded == o.survivors
    _check_sums(fleet)
    fleet.close()


def test_resends_are_capped_and_a_failed_round_reports_who_spent_budget(
        tmp_path: Path, digits: Any, engine: Any) -> None:
    fleet = _fleet(tmp_path, digits, engine)
    fleet.broker.drop = lambda name, topic, payload: _down_kind(topic, payload) == \
        "unmask_request"  # every device's, re-sends too: the round cannot finish
    fleet.broker.run(fleet.now)
    m = fleet.machine
    assert m.stage == "collect_unmask"
    for _ in range(10):
        _step(fleet, 1.0)
    attempts = [e.attempt for e in m.take_events() if isinstance(e, Resent)]
    assert attempts == [1, 2, 3]  # at 2, 4, 6 s; none more before the 8 s deadline
    (o,) = m.history
    assert not o.completed and o.total is None and o.survivors == ()
    assert len(o.uploaded) == 10  # all uploaded, i.e. reserved budget, for a failed round
    fleet.close()


def test_a_flooding_device_is_quarantined_and_the_round_goes_on(
        tmp_path: Path, digits: Any, engine: Any) -> None:
    fleet = _fleet(tmp_path, digits, engine)
    m = fleet.machine
    hold = [True]
    fleet.broker.drop = lambda name, topic, payload: hold[0] and _down_kind(
        topic, payload) == "unmask_request"
    fleet.broker.run(fleet.now)
    assert m.stage == "collect_unmask"
    m.take_events()
    flooder = m.current_plan.cohort[-1]
    chunk = next(p for n, t, p in reversed(fleet.broker.sent)
                 if n == flooder and t.endswith("/up/masked_part"))
    before = m.snapshot()
    # within its burst (less what it sent in the round so far, all at t = 0): each rejected
    # (a replay of an accepted upload part: a duplicate), nothing changes
    for _ in range(FloodLimits().burst // 2):
        fleet.broker.publish(flooder, Publish(wire.device_up_topic(FLEET, flooder, "masked_part"),
                                              chunk))
    fleet.broker.run(fleet.now)
    assert m.quarantined == frozenset() and m.snapshot() == before
    refused = Duplicate(topic=wire.device_up_topic(FLEET, flooder, "masked_part"),
                        device=flooder, reason=f"masked_part from {flooder!r} already accepted",
                        round_id=1, stage="collect_unmask")
    assert m.take_events() == [refused] * (FloodLimits().burst // 2)
    for _ in range(5000):
        fleet.broker.publish(flooder, Publish(wire.device_up_topic(FLEET, flooder, "masked_part"),
                                              chunk))
    fleet.broker.run(fleet.now)
    ev = m.take_events()
    assert ev[-1:] == [Quarantined(device=flooder, round_id=1, until_round=1,
                                   stage="collect_unmask")]
    assert set(ev[:-1]) == {refused}  # what was left of its burst, refused one by one
    assert m.quarantined == {flooder}
    assert flooder not in m.waiting_for
    subs = m.subscriptions(per_device=True)
    assert not any(f"/{flooder}/" in f or f.endswith(f"/{flooder}") for f in subs)
    assert len(subs) == 2 * (len(fleet.registry.devices) - 1)
    # its status is dropped unread too; another device's is seen and logged
    other = next(d for d in fleet.registry.devices if d not in m.current_plan.cohort)
    for dev in (flooder, other):
        fleet.broker.publish(dev, Publish(wire.status_topic(FLEET, dev), b"offline"))
    fleet.broker.run(fleet.now)
    assert m.take_events() == [StatusSeen(device=other, status="offline", removed=True)]
    hold[0] = False
    _step(fleet, 2.0)  # the re-sent unmask requests now arrive; the flooder does not hold
    (o,) = m.history
    assert o.completed and flooder in o.survivors  # it had uploaded before flooding
    _check_sums(fleet)
    ev = m.take_events()
    (rel,) = [e for e in ev if isinstance(e, Released)]
    # the flood less what was left of its burst, plus its status message
    assert rel.device == flooder and 5000 - FloodLimits().burst // 2 < rel.dropped <= 5001
    assert m.quarantined == frozenset()
    fleet.close()


def test_quarantine_survives_a_snapshot(tmp_path: Path, digits: Any, engine: Any) -> None:
    fleet = _fleet(tmp_path, digits, engine)
    m = fleet.machine
    dev = sorted(fleet.registry.devices)[0]
    for _ in range(FloodLimits().burst + 1):
        m.on_message(wire.status_topic(FLEET, dev), b"online", 0.0)
    assert m.quarantined == {dev}  # idle: until the next round has ended
    assert [e for e in m.take_events() if isinstance(e, Quarantined)] == [
        Quarantined(device=dev, round_id=None, until_round=1, stage="idle")]
    restored = type(m).restore(m.snapshot(), policy=m.policy, identity=fleet.agg_id,
                               registry=fleet.registry)
    assert restored.quarantined == {dev}
    assert restored.snapshot() == m.snapshot()
    assert np.array_equal(restored.params[0], m.params[0])
    fleet.close()
