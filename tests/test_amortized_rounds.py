"""The amortized secure-aggregation protocol as a round plan selects it (issue 18).

Devices and the aggregator through the in-memory MQTT-like broker of
``tests.test_session_rounds`` (what passes there runs over mosquitto: ``tests/test_fleet.py``
runs the same fleet over both transports). What the protocol promises, and what it does
not (``edge_sdk.secagg``): the sum is exact and nothing but the masked vector leaves a
device in a round nobody drops from; a dropped device's masks are removed by its
neighbours' reveals of this round's seeds; a neighbour that vanishes before revealing fails
the round; a round id is never masked for twice, also across a restart.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from aggregator.rounds import RoundMachine
from edge_sdk import wire
from edge_sdk.secagg import RoundConfig
from edge_sdk.wire import RevealRequest
from tests.test_session_rounds import FLEET, Fleet, _accuracy, _check_sums, _seeded_bytes

AMORTIZED = {"secagg": "amortized"}


def _up_kinds(fleet: Fleet, name: str, start: int = 0) -> list[str]:
    return [t.rsplit("/", 1)[1] for s, t, _ in fleet.broker.sent[start:]
            if s == name and "/up/" in t]


def test_plans_name_the_protocol_and_a_round_sends_only_the_masked_vector(
        tmp_path, digits, engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=3, policy=AMORTIZED)
    acc0 = _accuracy(fleet.engine, fleet.initial, digits)
    fleet.settle(until=lambda: len(fleet.machine.history) >= 3 and fleet.machine.stage == "idle")
    hist = fleet.machine.history
    assert [(o.round_id, o.completed, len(o.survivors)) for o in hist] == [
        (1, True, 10), (2, True, 10), (3, True, 10)]
    _check_sums(fleet)
    plans = [wire.decode(p, wire.DOWN_KINDS) for _, t, p in fleet.broker.sent
             if t.endswith("/down/plan")]
    assert plans and all(p.secagg == "amortized" for p in plans)
    # no keys, no shares, no unmask answers: check-ins and the masked parts only
    for name in fleet.sessions:
        assert set(_up_kinds(fleet, name)) <= {"checkin", "masked_part"}
        # each round's reservation committed when the new model showed the sum
        assert fleet.ledgers[name].pending() == ()
        assert len(fleet.ledgers[name].reservations()) == sum(name in o.survivors
                                                              for o in hist)
    assert _accuracy(fleet.engine, fleet.machine.params, digits) > acc0 + 0.2
    fleet.close()


def test_dropped_devices_masks_are_revealed_by_their_neighbours(tmp_path, digits,
                                                               engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=2, policy=AMORTIZED)
    victims: dict[int, tuple[str, ...]] = {}

    def drop(name: str, topic: str, payload: bytes) -> bool:
        if topic.endswith("/down/plan"):
            plan = wire.decode(payload, wire.DOWN_KINDS)
            victims.setdefault(plan.round_id, plan.cohort[:2])
            if name in victims[plan.round_id]:
                fleet.broker.detach(name)  # it never uploads
                return True
        return False

    fleet.broker.drop = drop
    fleet.settle(until=lambda: len(fleet.machine.history) >= 1 and fleet.machine.stage == "idle")
    o = fleet.machine.history[0]
    assert o.completed and sorted(set(fleet.machine.history[0].survivors)
                                  | set(victims[1])) == sorted(
        wire.decode(next(p for _, t, p in fleet.broker.sent if t.endswith("/down/plan")),
                    wire.DOWN_KINDS).cohort)
    _check_sums(fleet)  # the dropped devices' masks are gone from the sum, bit for bit
    revealed = [name for name in fleet.sessions if "reveal_response" in _up_kinds(fleet, name)]
    assert revealed and not set(revealed) & set(victims[1])
    fleet.close()


def test_a_neighbour_gone_before_revealing_fails_the_round_and_the_next_one_runs(
        tmp_path, digits, engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=2, policy=AMORTIZED)
    first: list[str] = []

    def drop(name: str, topic: str, payload: bytes) -> bool:
        if topic.endswith("/down/plan") and wire.decode(payload, wire.DOWN_KINDS).round_id == 1:
            plan = wire.decode(payload, wire.DOWN_KINDS)
            if name == plan.cohort[0]:
                fleet.broker.detach(name)
                return True
        if topic.endswith("/down/reveal_request") and not first:
            first.append(name)
            fleet.broker.detach(name)  # uploaded, then gone: its seeds are the only copy
            return True
        return False

    fleet.broker.drop = drop
    fleet.settle(until=lambda: len(fleet.machine.history) >= 1 and fleet.machine.stage == "idle")
    o = fleet.machine.history[0]
    assert not o.completed and "did not reveal their seeds" in o.detail and first
    version = o.model_version  # the model when the round failed
    for name in (first[0],):
        fleet.broker.attach(name, fleet.sessions[name], fleet.now)
    fleet.broker.drop = lambda *a: False
    for name in fleet.sessions:
        if name not in fleet.broker.endpoints:
            fleet.broker.attach(name, fleet.sessions[name], fleet.now)
    fleet.settle(until=lambda: len(fleet.machine.history) >= 2 and fleet.machine.stage == "idle")
    assert fleet.machine.history[1].completed
    # the failed round made no model; the next one made exactly one
    assert fleet.machine.history[1].model_version == version + 1 == fleet.machine.model_version
    _check_sums(fleet)
    fleet.close()


@pytest.mark.parametrize("crash_at", ["collect_masked", "collect_unmask"])
def test_aggregator_restart_mid_round_ends_with_the_uncrashed_model(
        tmp_path, digits, engine, crash_at: str) -> None:
    def run(tmp, crash: bool) -> Fleet:
        tmp.mkdir()
        fleet = Fleet(tmp, digits, engine, rounds=1, policy=AMORTIZED)
        gone = []

        def drop(name: str, topic: str, payload: bytes) -> bool:
            if topic.endswith("/down/plan") and not gone:
                gone.append(name)  # one device never uploads: the round needs a reveal
            if name in gone:
                fleet.broker.detach(name)
                return True
            return False

        crashed: list[bool] = []

        def after(name: str) -> bool:
            m = fleet.machine
            if not crash or crashed or name != "aggregator" or m.stage != crash_at:
                return False
            crashed.append(True)
            fleet.broker.detach("aggregator")
            fleet.machine = RoundMachine.restore(
                fleet.store.load(), policy=fleet.policy, identity=fleet.agg_id,
                registry=fleet.registry, random_bytes=_seeded_bytes("agg-rounds-2"),
                checkpoint=fleet.store.save)
            fleet.broker.attach("aggregator", fleet.machine, fleet.now)
            return True

        fleet.broker.drop, fleet.broker.after = drop, after
        fleet.settle(until=lambda: len(fleet.machine.history) >= 1
                     and fleet.machine.stage == "idle")
        assert not crash or crashed, f"never reached {crash_at}"
        return fleet

    ref = run(tmp_path / "ref", crash=False)
    fleet = run(tmp_path / "crash", crash=True)
    assert fleet.machine.history[0].completed and fleet.machine.model_version == 1
    _check_sums(fleet)
    for a, b in zip(fleet.machine.params, ref.machine.params, strict=True):
        assert np.array_equal(a, b)
    ref.close()
    fleet.close()


def test_a_device_never_masks_twice_for_one_round_id(tmp_path, digits, engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=2, policy=AMORTIZED)
    plans: dict[int, bytes] = {}

    def drop(name: str, topic: str, payload: bytes) -> bool:
        if topic.endswith("/down/plan"):
            plans.setdefault(wire.decode(payload, wire.DOWN_KINDS).round_id, payload)
        return False

    fleet.broker.drop = drop
    fleet.settle(until=lambda: len(fleet.machine.history) >= 2 and fleet.machine.stage == "idle")
    plan1 = wire.decode(plans[1], wire.DOWN_KINDS)
    name = next(n for n in plan1.cohort
                if n in wire.decode(plans[2], wire.DOWN_KINDS).cohort)
    reserved = [r.plan.round_id for r in fleet.ledgers[name].reservations()]
    assert reserved == [f"{FLEET}/1", f"{FLEET}/2"]
    # a restarted device, offered round 1's plan again (an aggregator that reuses ids, or a
    # replay): refused before anything is reserved, trained or masked
    new = fleet.start_device(name)
    out = new.on_message(wire.device_down_topic(FLEET, name, "plan"), plans[1], fleet.now)
    assert [p.topic.rsplit("/", 1)[1] for p in out] == ["decline", "checkin"]
    assert msgpack.unpackb(out[0].payload)["reason"] == "already_committed"
    assert [r.plan.round_id for r in fleet.ledgers[name].reservations()] == reserved
    assert new.encoded_input(1) is None
    fleet.close()


def test_a_reveal_that_would_leave_too_few_uploads_is_refused(tmp_path, digits,
                                                              engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=1, policy=AMORTIZED)
    plans: list[bytes] = []

    def drop(name: str, topic: str, payload: bytes) -> bool:
        if topic.endswith("/down/plan"):
            plans.append(payload)
            if len(plans) == 1:  # one member never uploads: the others wait in the round
                fleet.broker.detach(name)
                return True
        return False

    fleet.broker.drop = drop
    fleet.broker.run(fleet.now)  # no clock: the upload stage is still open
    plan = wire.decode(plans[0], wire.DOWN_KINDS)
    assert fleet.machine.stage == "collect_masked"
    name = next(n for n in plan.cohort if fleet.sessions[n].encoded_input(1) is not None)
    # signed by the aggregator, but claiming so many dropped neighbours that the sum would
    # hold fewer than min_survivors uploads: refused, nothing revealed
    others = [d for d in plan.cohort if d != name]
    dropped = tuple(sorted(others[: len(plan.cohort) - plan.min_survivors + 1]))
    digest = RoundConfig.of_plan(plan).digest()
    req = wire.sign(RevealRequest(round_id=plan.round_id, recipient=name, dropped=dropped),
                    fleet.agg_id, context=digest)
    out = fleet.sessions[name].on_message(
        wire.device_down_topic(FLEET, name, "reveal_request"), wire.encode(req), fleet.now)
    assert out == []
    assert "reveal_response" not in _up_kinds(fleet, name)
    fleet.close()


def test_a_redelivered_plan_gets_the_same_upload_not_a_second_masking(tmp_path, digits,
                                                                      engine) -> None:
    from edge_sdk.session import Uploaded

    fleet = Fleet(tmp_path, digits, engine, rounds=1, policy=AMORTIZED)
    plans: list[tuple[str, bytes]] = []

    def drop(name: str, topic: str, payload: bytes) -> bool:
        if topic.endswith("/down/plan"):
            plans.append((name, payload))
            if len(plans) == 1:  # keep the round open: one member never uploads
                fleet.broker.detach(name)
                return True
        return False

    fleet.broker.drop = drop
    fleet.broker.run(fleet.now)
    name, raw = plans[1]
    s = fleet.sessions[name]
    s.take_events()
    first = [p for _, t, p in fleet.broker.sent if t == wire.device_up_topic(
        FLEET, name, "masked_part")]
    again = s.on_message(wire.device_down_topic(FLEET, name, "plan"), raw, fleet.now)
    assert [p.payload for p in again] == first  # the same bytes: the masks are not redrawn
    [event] = s.take_events()
    assert isinstance(event, Uploaded) and event.resent and event.round_id == 1
    fleet.close()
