"""The status board (aggregator.status): round-machine events in, snapshot out; bounded
memory; strict JSON; the HTTP routes (read-only, the page's CSP admits its own script);
and the round machine's CheckInSeen event the board's privacy figures come from."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge

from aggregator.rounds import (
    CheckInSeen,
    Declined,
    Quarantined,
    Released,
    RoundEnded,
    RoundOutcome,
    RoundStarted,
    StageChanged,
    StatusSeen,
)
from aggregator.status import _CSP, _SCRIPT, PAGE, StatusBoard, serve_http, snapshot_json


def _ended(round_id: int, cohort: tuple[str, ...], survivors: tuple[str, ...],
           declined: tuple[str, ...] = (), completed: bool = True) -> RoundEnded:
    return RoundEnded(outcome=RoundOutcome(
        round_id=round_id, completed=completed, survivors=survivors if completed else (),
        detail="" if completed else "too few survivors", total=None,
        model_version=round_id if completed else round_id - 1, uploaded=survivors),
        cohort=cohort, declined=declined)


def _checkin(device: str, *, remaining: float, spent: float | None, budget: float = 10.0,
             delta: float = 1e-6, data_size: int = 1, model_version: int = 0) -> CheckInSeen:
    return CheckInSeen(device=device, remaining_epsilon=remaining, spent_epsilon=spent,
                       budget_epsilon=budget, budget_delta=delta, data_size=data_size,
                       model_version=model_version)


def test_a_round_from_start_to_end() -> None:
    b = StatusBoard(fleet="lab")
    s = b.snapshot(at=1.0, bytes_in=0, bytes_out=0)
    assert (s.round_id, s.stage, s.rounds, s.devices, s.evaluation) == (None, "idle", (), (),
                                                                        None)
    b.feed([_checkin("a", remaining=9.5, spent=0.5, data_size=40),
            _checkin("b", remaining=8.0, spent=2.0, budget=10.0, delta=1e-5, data_size=30)],
           at=10.0, bytes_in=100, bytes_out=0)
    b.feed([StatusSeen(device="c", status="online", removed=False)], at=11.0, bytes_in=120,
           bytes_out=0)
    b.feed([RoundStarted(round_id=4, cohort=("a", "b", "c"), model_version=3),
            StageChanged(round_id=4, stage="collect_keys", prev="idle")],
           at=12.0, bytes_in=150, bytes_out=1000)
    b.feed([Declined(device="c", round_id=4, reason="budget")], at=13.0, bytes_in=200,
           bytes_out=1000)
    s = b.snapshot(at=14.0, bytes_in=250, bytes_out=1100)
    assert (s.round_id, s.stage, s.stage_since, s.cohort, s.cohort_size, s.declined) == (
        4, "collect_keys", 12.0, ("a", "b", "c"), 3, ("c",))
    assert (s.bytes_in, s.bytes_out, s.model_version) == (250, 1100, 3)
    b.feed([_ended(4, ("a", "b", "c"), ("a", "b"), ("c",)),
            StageChanged(round_id=4, stage="idle", prev="collect_unmask")],
           at=20.5, bytes_in=900, bytes_out=5000)
    s = b.snapshot(at=21.0, bytes_in=900, bytes_out=5000)
    assert (s.round_id, s.stage, s.cohort, s.declined, s.model_version) == (
        None, "idle", (), (), 4)
    (r,) = s.rounds
    assert (r.round_id, r.completed, r.cohort, r.survivors, r.declined, r.dropped,
            r.uploaded) == (4, True, 3, 2, 1, 0, 2)
    assert (r.bytes_in, r.bytes_out, r.duration_s, r.ended_at) == (750, 4000, 8.5, 20.5)
    dev = {d.device: d for d in s.devices}
    assert [d.device for d in s.devices] == ["c", "a", "b"]  # most recently seen first
    assert (dev["a"].remaining_epsilon, dev["a"].data_size, dev["a"].checkin_at,
            dev["a"].last_round, dev["a"].last_uploaded) == (9.5, 40, 10.0, 4, 4)
    assert (dev["a"].spent_epsilon, dev["a"].budget_epsilon, dev["a"].budget_delta) == (
        0.5, 10.0, 1e-6)
    assert (dev["b"].spent_epsilon, dev["b"].budget_epsilon, dev["b"].budget_delta) == (
        2.0, 10.0, 1e-5)
    assert (dev["c"].status, dev["c"].status_at, dev["c"].remaining_epsilon,
            dev["c"].spent_epsilon, dev["c"].budget_epsilon,
            dev["c"].last_uploaded) == ("online", 11.0, None, None, None, None)


def test_failed_round_quarantine_and_news_about_unseen_devices() -> None:
    b = StatusBoard(fleet="lab")
    b.feed([RoundStarted(round_id=1, cohort=("x", "y"), model_version=0),
            Quarantined(device="x", round_id=1, until_round=1, stage="collect_keys")],
           at=1.0, bytes_in=0, bytes_out=0)
    s = b.snapshot(at=2.0, bytes_in=0, bytes_out=0)
    # y was named in a cohort but never heard from: not listed as seen
    assert [(d.device, d.quarantined, d.last_round) for d in s.devices] == [("x", True, None)]
    b.feed([Released(device="x", dropped=7), _ended(1, ("x", "y"), (), completed=False)],
           at=3.0, bytes_in=0, bytes_out=0)
    s = b.snapshot(at=3.0, bytes_in=0, bytes_out=0)
    assert s.devices[0].quarantined is False
    assert (s.rounds[0].completed, s.rounds[0].dropped, s.rounds[0].detail,
            s.model_version) == (False, 2, "too few survivors", 0)


def test_memory_is_bounded() -> None:
    b = StatusBoard(fleet="lab", max_devices=5, max_rounds=3)
    for i in range(20):
        b.feed([StatusSeen(device=f"d{i:02d}", status="online", removed=False)],
               at=float(i), bytes_in=0, bytes_out=0)
    for r in range(1, 8):
        b.feed([RoundStarted(round_id=r, cohort=("d19",), model_version=r - 1),
                _ended(r, ("d19",), ("d19",))], at=100.0 + r, bytes_in=0, bytes_out=0)
    s = b.snapshot(at=200.0, bytes_in=0, bytes_out=0)
    assert [d.device for d in s.devices] == ["d19", "d18", "d17", "d16", "d15"]
    assert (s.devices_seen, s.devices_forgotten) == (5, 15)
    assert [r.round_id for r in s.rounds] == [7, 6, 5]
    with pytest.raises(ValueError, match="max_devices must be an int >= 1, got 0"):
        StatusBoard(fleet="lab", max_devices=0)


def test_large_fleets_are_listed_in_part_and_counted_in_full() -> None:
    b = StatusBoard(fleet="lab")
    cohort = tuple(f"d{i:04d}" for i in range(1000))
    b.feed([RoundStarted(round_id=1, cohort=cohort, model_version=0)], at=0.0, bytes_in=0,
           bytes_out=0)
    s = b.snapshot(at=0.0, bytes_in=0, bytes_out=0)
    assert s.cohort_size == 1000 and s.cohort == cohort[:64]
    for i, d in enumerate(cohort):  # heard from: listed up to the page's limit
        b.feed([StatusSeen(device=d, status="online", removed=False)], at=float(i),
               bytes_in=0, bytes_out=0)
    s = b.snapshot(at=0.0, bytes_in=0, bytes_out=0)
    assert s.devices_seen == 1000 and len(s.devices) == 500
    assert s.devices[0].device == "d0999" and s.devices[-1].device == "d0500"


def test_rounds_carry_the_accuracy_of_their_model_on_the_evaluation_set() -> None:
    with pytest.raises(ValueError, match="no evaluation set"):
        StatusBoard(fleet="lab").evaluated(1, accuracy=0.5, loss=1.0)
    b = StatusBoard(fleet="lab", evaluation="/srv/eval.npz")
    b.feed([RoundStarted(round_id=1, cohort=("a", "b"), model_version=0)], at=1.0,
           bytes_in=0, bytes_out=0)
    b.feed([_ended(1, ("a", "b"), ("a", "b"))], at=2.0, bytes_in=0, bytes_out=0)
    b.evaluated(1, accuracy=0.625, loss=1.25)
    b.evaluated(9, accuracy=0.5, loss=1.0)  # not on the board: ignored
    b.feed([RoundStarted(round_id=2, cohort=("a", "b"), model_version=1),
            _ended(2, ("a", "b"), (), completed=False)], at=3.0, bytes_in=0, bytes_out=0)
    b.feed([RoundStarted(round_id=3, cohort=("a", "b"), model_version=1),
            _ended(3, ("a", "b"), ("a", "b"))], at=4.0, bytes_in=0, bytes_out=0)
    b.evaluated(3, accuracy=0.75, loss=float("inf"))  # not a figure: not reported
    s = b.snapshot(at=5.0, bytes_in=0, bytes_out=0)
    assert s.evaluation == "/srv/eval.npz"
    assert [(r.round_id, r.accuracy, r.loss) for r in s.rounds] == [
        (3, 0.75, None), (2, None, None), (1, 0.625, 1.25)]
    d = json.loads(snapshot_json(s))
    assert [(r["accuracy"], r["loss"]) for r in d["rounds"]] == [
        (0.75, None), (None, None), (0.625, 1.25)]
    for bad in (1.5, -0.1, float("nan"), 1):
        with pytest.raises(ValueError, match="accuracy must be"):
            b.evaluated(1, accuracy=bad, loss=1.0)


def test_score_is_accuracy_and_mean_cross_entropy() -> None:
    import numpy as np

    from aggregator.evaluation import score

    z = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 3.0], [1000.0, 0.0, 0.0]], dtype=np.float32)
    y = np.array([0, 1, 0])
    ev = score(z, y)
    lse = np.log(np.exp(z[:2].astype(np.float64)).sum(axis=1))
    expect = (lse[0] - 2.0 + lse[1] - 1.0 + 0.0) / 3  # the third: log(1 + 2 e^-1000) = 0
    assert (ev.accuracy, ev.samples) == (2 / 3, 3)
    assert ev.loss == pytest.approx(expect, rel=1e-12)
    z[1, 2] = np.nan
    assert score(z, y).loss is None
    with pytest.raises(ValueError, match="expected logits"):
        score(z[:0], y[:0])


def test_json_is_strict_and_complete() -> None:
    b = StatusBoard(fleet="lab")
    b.feed([_checkin("a", remaining=float("inf"), spent=float("nan"),
                     budget=float("inf")),
            _checkin("b", remaining=0.0, spent=None, budget=4.0, delta=1e-6),
            _checkin("c", remaining=0.0, spent=5.5, budget=4.0)],  # over: the ledger's word
           at=1.0, bytes_in=0, bytes_out=0)
    d = json.loads(snapshot_json(b.snapshot(at=2.0, bytes_in=3, bytes_out=4)))
    dev = {x["device"]: x for x in d["devices"]}
    # not figures: not reported (the wire never lets them through; the board holds anyway)
    assert (dev["a"]["remaining_epsilon"], dev["a"]["spent_epsilon"],
            dev["a"]["budget_epsilon"]) == (None, None, None)
    # a device that could not read its ledger reports no spend: None, never 0
    assert (dev["b"]["spent_epsilon"], dev["b"]["budget_epsilon"],
            dev["b"]["budget_delta"]) == (None, 4.0, 1e-6)
    assert (dev["c"]["spent_epsilon"], dev["c"]["budget_epsilon"]) == (5.5, 4.0)
    assert (d["fleet"], d["bytes_in"], d["bytes_out"], d["evaluation"]) == ("lab", 3, 4, None)


def test_the_round_machine_reports_accepted_check_ins(tmp_path, digits, engine) -> None:
    from test_session_rounds import Fleet  # devices and aggregator on a memory broker

    fleet = Fleet(tmp_path, digits, engine, rounds=1)
    m = fleet.machine
    fleet.settle(until=lambda: len(m.history) == 1)
    fleet.settle(max_ticks=2)  # the devices check in again after the round
    checkins = [e for e in m.take_events() if isinstance(e, CheckInSeen)]
    first: dict[str, CheckInSeen] = {}
    last: dict[str, CheckInSeen] = {}
    for e in checkins:
        first.setdefault(e.device, e)
        last[e.device] = e
    assert sorted(first) == sorted(fleet.sessions)
    for name, ev in first.items():  # nothing spent before: the whole budget
        assert ev.remaining_epsilon == fleet.budget.epsilon == 50.0
        assert (ev.spent_epsilon, ev.budget_epsilon, ev.budget_delta) == (
            0.0, 50.0, fleet.budget.delta)
        assert ev.data_size == len(fleet.shards[int(name[1:])]) and ev.model_version == 0
    (outcome,) = m.history
    assert outcome.completed and outcome.uploaded
    for name in outcome.uploaded:  # what the device reports is its ledger's figure
        assert last[name].model_version == 1
        assert last[name].remaining_epsilon == fleet.ledgers[name].remaining() < 50.0
        spent = fleet.ledgers[name].spent()  # at the budget's delta
        assert spent.delta == last[name].budget_delta == fleet.budget.delta
        assert last[name].spent_epsilon == spent.local_epsilon > 0
        assert last[name].budget_epsilon == fleet.ledgers[name].budget.epsilon == 50.0
    fleet.close()


# ----------------------------------------------------------------------- HTTP


@pytest.fixture
def served() -> Iterator[str]:
    reg = CollectorRegistry()
    Gauge("fedge_aggregator_round", "r", registry=reg).set(3)
    b = StatusBoard(fleet="lab")
    b.feed([StatusSeen(device="a", status="online", removed=False)], at=1.0, bytes_in=0,
           bytes_out=0)
    srv = serve_http("127.0.0.1", 0, registry=reg,
                     status=lambda: snapshot_json(b.snapshot(at=2.0, bytes_in=5, bytes_out=6)))
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_routes(served: str) -> None:
    with urllib.request.urlopen(served + "/metrics", timeout=10) as r:
        assert b"fedge_aggregator_round 3.0" in r.read()
    with urllib.request.urlopen(served + "/status.json", timeout=10) as r:
        assert r.headers["Content-Type"] == "application/json"
        assert json.loads(r.read())["devices"][0]["device"] == "a"
    with urllib.request.urlopen(served + "/status", timeout=10) as r:
        assert r.read() == PAGE
        assert r.headers["Content-Security-Policy"] == _CSP
        assert r.headers["X-Content-Type-Options"] == "nosniff"
    for method in ("POST", "PUT", "DELETE"):
        req = urllib.request.Request(served + "/status.json", data=b"x", method=method)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 405
        err.value.close()


def test_page_script_is_the_one_the_policy_admits_and_never_parses_html() -> None:
    digest = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in _CSP and "unsafe" not in _CSP.split(
        "style-src")[0]
    assert f"<script>{_SCRIPT}</script>".encode() in PAGE
    # text only: no API that parses a string as HTML or code
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(",
                         _SCRIPT)


def test_an_address_in_use_is_an_os_error() -> None:
    srv = serve_http("127.0.0.1", 0, registry=CollectorRegistry(), status=lambda: b"{}")
    try:
        with pytest.raises(OSError):
            serve_http("127.0.0.1", srv.server_address[1], registry=CollectorRegistry(),
                       status=lambda: b"{}")
    finally:
        srv.shutdown()
        srv.server_close()
