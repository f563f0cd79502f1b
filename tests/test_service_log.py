"""The aggregator service's JSON log, without a broker: the service's MQTT endpoint driven
through the in-memory broker on a deterministic clock, so that every line it writes from the
round machine's events (rounds, stages, rejections, duplicates, declines, quarantines,
re-sends, status, rate-limit summaries) can be checked field for field."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aggregator.service import AggregatorConfig, AggregatorService
from edge_sdk import wire
from edge_sdk.config import load_device_identity, load_registry
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.device import DeviceConfig
from edge_sdk.engine import load_engine
from edge_sdk.ledger import Ledger
from edge_sdk.session import DeviceSession
from edge_sdk.wire import Publish
from models import ONNX_DIR
from tools.enroll import enroll
from tools.inproc import MemoryBroker
from tools.seeding import seeded_bytes

FLEET = "log"
MODEL = "logreg-64-10"
AGG = "aggregator"


def _secagg_kind(topic: str, payload: bytes) -> str | None:
    """The plan or secure-aggregation kind a downlink carries (its envelope's), else None."""
    if "/down/" not in topic:
        return None
    kind = wire.peek(payload, wire.DOWN_KINDS).kind
    return kind if kind in wire.SECAGG_DOWN or kind == "plan" else None


def run_scenario(tmp: Path, digits: Any) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Four rounds of five devices (cohort 4) with everything the log reports: its lines,
    and the service's metrics at the end (Prometheus sample -> value)."""
    names = [f"dev-{i:04d}" for i in range(5)]
    fl = enroll(tmp / "fleet", devices=names, fleet=FLEET, port=18883, tls=False,
                policy={"cohort_size": 4, "stage_timeout": 8.0, "max_rounds": 4},
                budget_epsilon=1000.0, model=MODEL, metrics_port=None)
    assert fl.aggregator_config is not None
    cfg = dataclasses.replace(AggregatorConfig.from_toml(fl.aggregator_config),
                              flood_burst=40, flood_rate=1.0, log_per_key=2,
                              zoo_dir=ONNX_DIR)
    clock = [0.0]
    out = io.StringIO()
    svc = AggregatorService(cfg, out=out, random_bytes=seeded_bytes("svc-log"),
                            clock=lambda: clock[0], wall=lambda: 1000.0 + clock[0])
    engine = load_engine(ONNX_DIR / f"{MODEL}.json")
    registry = load_registry(fl.registry, fleet=FLEET)
    broker = MemoryBroker()
    ledgers: list[Ledger] = []
    idents = {}
    try:
        broker.attach(AGG, svc.endpoint, clock[0])
        for i, name in enumerate(names):
            dc = DeviceConfig.from_toml(fl.device_configs[name])
            led = Ledger.open(dc.ledger, device_id=name, create=False)
            ledgers.append(led)
            idents[name] = load_device_identity(dc.identity)
            x, y = digits.x_train[i::5], digits.y_train[i::5]
            broker.attach(name, DeviceSession(
                fleet=FLEET, identity=idents[name], registry=registry, ledger=led,
                engine=engine, spec=engine.spec, data=lambda x=x, y=y: (x, y),
                round_rng=seeded_round_rng(i), random_bytes=seeded_bytes(f"svc-log/{name}")),
                clock[0])

        def up(device: str, kind: str, payload: bytes) -> None:
            broker.publish(device, Publish(wire.device_up_topic(FLEET, device, kind), payload))

        plans: dict[int, wire.RoundPlan] = {}
        done: set[str] = set()

        def once(what: str) -> bool:
            first = what not in done
            done.add(what)
            return first

        def drop(name: str, topic: str, payload: bytes) -> bool:
            """Every delivery passes here: the scenario's faults, at chosen moments."""
            kind = _secagg_kind(topic, payload)
            if kind == "plan":
                plan = wire.decode(payload, wire.DOWN_KINDS)
                assert isinstance(plan, wire.RoundPlan)
                plans[plan.round_id] = plan
            rnd = max(plans, default=0)
            cohort = plans[rnd].cohort if rnd else ()
            if rnd == 1 and kind == "plan" and name == cohort[0] and once("lost"):
                return True  # its plan is sent again after stage_timeout / 4
            if rnd == 1 and kind == "plan" and name == cohort[1] and once("garbage"):
                # rejections, rate limited to 2 lines per device and reason
                for _ in range(5):
                    up(names[0], "checkin", b"\x81\xa1x\x01")
                broker.publish(names[1], Publish(f"fedge/{FLEET}/dev/{names[1]}/up/nonsense",
                                                 b"x"))
                broker.publish(names[1], Publish(wire.status_topic(FLEET, names[1]),
                                                 b"online"))
            if rnd == 2 and kind == "plan" and name == cohort[-1] and once("decline"):
                d = wire.encode(wire.sign(wire.Decline(round_id=2, sender=name,
                                                       reason="budget"), idents[name]))
                up(name, "decline", d)
                up(name, "decline", d)  # the same again: a duplicate
                return True
            if rnd == 3 and kind == "unmask_request" and name in cohort[1:]:
                return True  # too few unmask: round 3 fails at its deadline
            if rnd == 4 and kind == "plan" and name == cohort[0] and once("flood"):
                for _ in range(60):  # a flood: quarantined, the round goes on without it
                    up(name, "checkin", b"\x90")
            return False

        broker.drop = drop
        m = svc.machine
        for _ in range(200):
            broker.run(clock[0])
            if len(m.history) == 4:
                break
            clock[0] += 1.0
            broker.tick(clock[0])
        assert len(m.history) == 4, (m.stage, m.history, out.getvalue()[-800:])
        metrics = {k: float(v) for k, v in (line.rsplit(" ", 1) for line in
                                            svc.metrics.text().splitlines()
                                            if not line.startswith("#"))}
    finally:
        svc.close()
        for led in ledgers:
            led.close()
    return [json.loads(line) for line in out.getvalue().splitlines()], metrics


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory,
             digits: Any) -> tuple[list[dict[str, Any]], dict[str, float]]:
    return run_scenario(tmp_path_factory.mktemp("svc-log"), digits)


@pytest.fixture
def lines(scenario: tuple[list[dict[str, Any]], dict[str, float]]) -> list[dict[str, Any]]:
    return scenario[0]


def _of(lines: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in lines if e["event"] == event]


def test_round_and_stage_lines(lines: list[dict[str, Any]]) -> None:
    assert lines[0]["event"] == "start" and lines[-1]["event"] == "stop"
    ends = _of(lines, "round_end")
    assert [(e["round"], e["completed"]) for e in ends] == [
        (1, True), (2, True), (3, False), (4, True)]
    for e in ends:
        assert list(e) == ["ts", "event", "round", "completed", "cohort", "survivors",
                           "declined", "dropped", "survivor_ids", "bytes_in", "bytes_out",
                           "duration_s", "model_version", "detail", "uploaded", "accuracy",
                           "loss"]
        assert (e["accuracy"], e["loss"]) == (None, None)  # no evaluation set configured
        assert e["cohort"] == 4 and e["bytes_in"] > 0 and e["bytes_out"] > 0
        assert e["survivors"] + e["declined"] + e["dropped"] == e["cohort"], e
    assert ends[1]["declined"] == 1 and ends[1]["survivors"] == 3
    assert ends[2]["survivors"] == 0 and len(ends[2]["uploaded"]) == 4
    assert ends[2]["dropped"] == 4 and "round 3 failed" in ends[2]["detail"]
    assert ends[3]["survivors"] == 3 and ends[3]["dropped"] == 1  # the quarantined one
    stages = _of(lines, "stage")
    for e in stages:
        assert list(e) == ["ts", "event", "round", "stage", "prev", "prev_s", "round_s"]
    cycle = ["collect_keys", "collect_shares", "collect_masked", "collect_unmask", "idle"]
    for r in (1, 2, 4):
        seq = [(e["prev"], e["stage"]) for e in stages if e["round"] == r]
        assert seq == list(zip(["idle", *cycle[:-1]], cycle, strict=True)), (r, seq)
    r3 = [(e["prev"], e["stage"]) for e in stages if e["round"] == 3]
    assert r3[-1] == ("collect_unmask", "idle")
    for e in stages:
        if e["prev"] == "idle":
            assert e["round_s"] == 0.0
    # each round's end comes before its last stage line, each start after the round before
    i_end = lines.index(ends[0])
    assert lines[i_end + 1]["event"] == "stage" and lines[i_end + 1]["stage"] == "idle"


def test_peer_lines_and_their_rate_limit(lines: list[dict[str, Any]]) -> None:
    rejected = _of(lines, "rejected")
    for e in rejected:
        assert list(e) == ["ts", "event", "topic", "reason", "round", "stage"]
    garbage = [e for e in rejected if e["topic"].endswith("dev-0000/up/checkin")
               and e["round"] == 1]
    assert len(garbage) == 2 and all(e["round"] == 1 and e["stage"] == "collect_keys"
                                     for e in garbage)  # 5 sent, 2 per reason written
    assert any("nonsense" in e["topic"] for e in rejected)
    sup = [e for e in _of(lines, "suppressed") if e["device"] == "dev-0000"]
    assert sup[0]["count"] == 3 and "protocol version" in sup[0]["reason"]
    assert sup[1]["count"] > 0 and "must be a map" in sup[1]["reason"]  # round 4's flood
    assert list(sup[0]) == ["ts", "event", "device", "reason", "count", "interval_s"]
    (dup,) = _of(lines, "duplicate")
    assert list(dup) == ["ts", "event", "topic", "reason"] and "decline" in dup["reason"]
    (dec,) = _of(lines, "declined")
    assert list(dec) == ["ts", "event", "device", "round", "reason"]
    assert dec["round"] == 2 and dec["reason"] == "budget"
    assert lines.index(dec) < lines.index(dup)
    (st,) = [e for e in _of(lines, "status") if e["device"] == "dev-0001"]
    assert st == {**st, "status": "online", "removed": False}
    (q,) = _of(lines, "quarantined")
    assert q["round"] == 4 and q["until_round"] == 4 and q["burst"] == 40
    (rel,) = _of(lines, "released")
    assert rel["device"] == q["device"] and rel["dropped"] > 0
    assert lines.index(q) < lines.index(rel)
    resent = _of(lines, "resent")
    assert resent and resent[0]["round"] == 1 and resent[0]["stage"] == "collect_keys"
    assert resent[0]["attempt"] == 1 and len(resent[0]["devices"]) == 1


def test_metrics_follow_the_events(
        scenario: tuple[list[dict[str, Any]], dict[str, float]]) -> None:
    lines, metrics = scenario
    p = "fedge_aggregator_"
    assert metrics[p + 'rounds_total{result="completed"}'] == 3
    assert metrics[p + 'rounds_total{result="failed"}'] == 1
    suppressed = sum(e["count"] for e in _of(lines, "suppressed"))
    assert metrics[p + "suppressed_log_lines_total"] == suppressed > 0
    assert metrics[p + "rejected_messages_total"] == (
        len(_of(lines, "rejected")) + len(_of(lines, "duplicate")) + suppressed)
    assert metrics[p + "failed_round_uploads_total"] == 4
    assert metrics[p + "resent_requests_total"] == sum(
        len(e["devices"]) for e in _of(lines, "resent"))
    (rel,) = _of(lines, "released")
    dev = rel["device"]
    label = f'{{device="{dev}"}}'
    assert metrics[p + "quarantined_total" + label] == 1
    assert metrics[p + "flood_dropped_messages_total" + label] == rel["dropped"]
    stages = _of(lines, "stage")
    assert sum(v for k, v in metrics.items()
               if k.startswith(p + "stage_duration_seconds_count")) == len(stages)
    assert metrics[p + "devices_in_quarantine"] == 0
    assert (metrics[p + "round"], metrics[p + "model_version"]) == (4, 3)
    assert metrics[p + 'stage{stage="idle"}'] == 1
    ends = _of(lines, "round_end")
    assert np.isclose(sum(e["duration_s"] for e in ends),
                      sum(e["prev_s"] for e in stages if e["prev"] != "idle"), atol=0.01)
