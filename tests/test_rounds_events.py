"""The round machine's events (``RoundMachine.take_events``), checked call by call against
the machine's state: every stage change, round start and round end is reported exactly in
the call that makes it, in the order it happened; refused messages become Rejected (with
the reason) or Duplicate; nothing is lost between two takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
from test_session_rounds import Fleet, _down_kind

from aggregator.rounds import (
    Declined,
    Duplicate,
    Event,
    Quarantined,
    Rejected,
    Released,
    RoundEnded,
    RoundMachine,
    RoundStarted,
    StageChanged,
)
from edge_sdk import wire
from edge_sdk.errors import RemoteProtocolError
from edge_sdk.wire import Publish

FLEET = "lab"


def _state(m: RoundMachine) -> tuple[int | None, str, int]:
    plan = m.current_plan
    return (None if plan is None else plan.round_id, m.stage,
            m.history[-1].round_id if m.history else 0)


class Recorder:
    """The machine as a broker endpoint, its state and events kept around every call."""

    def __init__(self, machine: RoundMachine, *, take: bool = True) -> None:
        self.m = machine
        self.take = take
        self.calls: list[tuple[tuple[int | None, str, int], tuple[int | None, str, int],
                               list[Event]]] = []

    def subscriptions(self) -> list[str]:
        return self.m.subscriptions()

    def _call(self, fn: Any, *args: Any) -> list[Publish]:
        before = _state(self.m)
        out = fn(*args)
        self.calls.append((before, _state(self.m), self.m.take_events() if self.take else []))
        return out

    def on_connect(self, now: float) -> list[Publish]:
        return self._call(self.m.on_connect, now)

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        return self._call(self.m.on_message, topic, payload, now)

    def on_tick(self, now: float) -> list[Publish]:
        return self._call(self.m.on_tick, now)


def _recorded(tmp: Path, digits: Any, engine: Any, *, rounds: int,
              take: bool = True) -> tuple[Fleet, Recorder]:
    fleet = Fleet(tmp, digits, engine, rounds=rounds)
    rec = Recorder(fleet.machine, take=take)
    fleet.broker.detach("aggregator")  # nothing was delivered yet
    fleet.broker.attach("aggregator", rec, fleet.now)
    return fleet, rec


def _view(ev: Event) -> tuple[Any, ...]:
    """An event as comparable values (a round's outcome holds an array)."""
    if isinstance(ev, RoundEnded):
        o = ev.outcome
        return ("RoundEnded", o.round_id, o.completed, o.survivors, o.detail,
                None if o.total is None else o.total.tobytes(), o.uploaded, ev.cohort,
                ev.declined)
    return (type(ev).__name__, *(getattr(ev, f) for f in ev.__slots__))


def test_each_call_reports_exactly_what_it_changed(
        tmp_path: Path, digits: Any, engine: Any) -> None:
    fleet, rec = _recorded(tmp_path, digits, engine, rounds=2)
    m = fleet.machine
    plans: dict[int, wire.RoundPlan] = {}
    faults: set[str] = set()

    def drop(name: str, topic: str, payload: bytes) -> bool:
        kind = _down_kind(topic, payload)
        if kind == "plan":
            plan = wire.decode(payload, wire.DOWN_KINDS)
            plans[plan.round_id] = plan
        rnd = max(plans, default=0)
        cohort = plans[rnd].cohort if rnd else ()
        if rnd == 1 and kind == "plan" and name == cohort[-1]:
            if "decline" not in faults:  # it declines (twice: the second is a duplicate)
                faults.add("decline")
                d = wire.encode(wire.sign(wire.Decline(round_id=1, sender=name,
                                                       reason="budget"),
                                          fleet.ids[int(name[1:])]))
                for _ in range(2):
                    fleet.broker.publish(name, Publish(wire.device_up_topic(FLEET, name,
                                                                            "decline"), d))
            return True
        if rnd == 2 and kind == "plan" and name == cohort[-1] and "flood" not in faults:
            faults.add("flood")  # quarantined, released when round 2 ends
            for _ in range(250):
                fleet.broker.publish(name, Publish(wire.device_up_topic(FLEET, name,
                                                                        "checkin"), b"\x90"))
        if rnd == 2 and kind == "forwarded_shares" and name in cohort[:6]:
            return True  # too few upload: round 2 fails at the deadline
        return False

    fleet.broker.drop = drop
    fleet.settle(until=lambda: len(m.history) == 2 and m.stage == "idle")
    assert [o.completed for o in m.history] == [True, False]
    seen: list[Event] = []
    for before, after, evs in rec.calls:
        seen += evs
        changes = [e for e in evs if isinstance(e, StageChanged)]
        if before[:2] == after[:2]:
            assert changes == [], (before, after, evs)
        else:  # one transition per call at most
            assert changes == [StageChanged(round_id=after[0] or before[0], stage=after[1],
                                            prev=before[1])], (before, after, evs)
        starts = [e for e in evs if isinstance(e, RoundStarted)]
        if after[0] is not None and after[0] != before[0]:
            plan = m.current_plan if m.current_plan and m.current_plan.round_id == after[0] \
                else plans[after[0]]
            assert starts == [RoundStarted(round_id=after[0], cohort=plan.cohort,
                                           model_version=plan.model_version)]
            assert evs.index(starts[0]) + 1 == evs.index(changes[0])
        else:
            assert starts == []
        ends = [e for e in evs if isinstance(e, RoundEnded)]
        if after[2] != before[2]:
            (end,) = ends
            assert end.outcome is next(o for o in m.history if o.round_id == after[2])
            # quarantines are lifted first; the stage change to idle comes last
            i = evs.index(end)
            assert evs[i + 1:] == [StageChanged(round_id=after[2], stage="idle",
                                                prev=before[1])]
            assert not any(isinstance(e, Released) for e in evs[i:])
        else:
            assert ends == []
    ends = [e for e in seen if isinstance(e, RoundEnded)]
    assert [e.outcome.round_id for e in ends] == [1, 2]
    assert ends[0].cohort == plans[1].cohort and ends[1].cohort == plans[2].cohort
    assert ends[0].declined == (plans[1].cohort[-1],) and ends[1].declined == ()
    (dec,) = [e for e in seen if isinstance(e, Declined)]
    assert dec == Declined(device=plans[1].cohort[-1], round_id=1, reason="budget")
    (dup,) = [e for e in seen if isinstance(e, Duplicate)]
    assert dup.device == dec.device and dup.round_id == 1 and dup.topic.endswith("/decline")
    assert "already recorded" in dup.reason
    assert seen.index(dec) < seen.index(dup)
    (q,) = [e for e in seen if isinstance(e, Quarantined)]
    (r,) = [e for e in seen if isinstance(e, Released)]
    assert q.device == r.device == plans[2].cohort[-1] and q.until_round == 2
    assert seen.index(r) + 1 == seen.index(ends[1])  # lifted by round 2's end
    flood = [e for e in seen if isinstance(e, Rejected) and e.device == q.device]
    assert flood and all(e.round_id == 2 and "must be a map" in e.reason for e in flood)
    # each message of the flood is refused or dropped unread, and so is the device's
    # advertise, sent after the flood
    assert len(flood) + r.dropped == 250 + 1, (len(flood), r.dropped)
    fleet.close()


def test_a_refused_message_is_a_rejected_event_with_the_reason(
        tmp_path: Path, digits: Any, engine: Any) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=1)
    m = fleet.machine
    m.take_events()
    garbage = msgpack.packb({"v": 2, "kind": "checkin"})
    with pytest.raises(RemoteProtocolError) as err:
        wire.decode(garbage, wire.UP_KINDS)
    cases = [
        (wire.device_up_topic(FLEET, "d01", "checkin"), garbage, "d01", str(err.value)),
        ("fedge/other/dev/d02/up/checkin", b"x", "d02", "not a topic of fleet 'lab'"),
        (wire.device_up_topic(FLEET, "zz", "checkin"), b"x", "zz",
         "message from outsider 'zz'"),
        ("elsewhere", b"x", None, "not a topic of fleet 'lab'"),
    ]
    for topic, payload, device, reason in cases:
        before = m.snapshot()
        assert m.on_message(topic, payload, 0.0) == []
        assert m.snapshot() == before
        assert m.take_events() == [Rejected(topic=topic, device=device, reason=reason,
                                            round_id=None, stage="idle")]
    assert m.take_events() == []  # taken events are gone
    fleet.close()


def test_no_event_is_lost_between_takes(tmp_path: Path, digits: Any, engine: Any) -> None:
    # the same seeded round twice: events taken after every call, or once at the end
    runs = []
    for take in (True, False):
        (tmp_path / str(take)).mkdir()
        fleet, rec = _recorded(tmp_path / str(take), digits, engine, rounds=1, take=take)
        fleet.settle(until=lambda f=fleet: len(f.machine.history) == 1)
        evs = [e for _, _, evs in rec.calls for e in evs] + fleet.machine.take_events()
        runs.append([_view(e) for e in evs])
        fleet.close()
    assert runs[0] == runs[1]
    kinds = [v[0] for v in runs[0] if v[0] != "CheckInSeen"]  # check-ins come any time
    assert kinds[:2] == ["RoundStarted", "StageChanged"] and kinds[-2:] == [
        "RoundEnded", "StageChanged"] and kinds.count("StageChanged") == 5


@pytest.mark.parametrize("module", ["rounds", "site"])
def test_every_log_line_of_the_round_machine_carries_its_structured_fields(module) -> None:
    """The service's JSON log lines (and the tests that read them) take each record's
    ``fedge`` fields: a record without them (once, a stage's re-send) loses its event and
    broke a filter that read ``r.fedge`` on a loaded machine. The site's machine too."""
    import ast
    from pathlib import Path

    src = Path(__file__).parents[1] / "aggregator" / f"{module}.py"
    missing = []
    for node in ast.walk(ast.parse(src.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "logger"
                and not any(k.arg == "extra" for k in node.keywords)):
            missing.append(node.lineno)
    assert missing == [], f"logger calls without extra={{'fedge': ...}} at lines {missing}"
