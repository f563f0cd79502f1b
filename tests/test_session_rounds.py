"""Devices and the aggregator wired through an in-memory MQTT-like broker.

The broker drives every endpoint through the four methods the MQTT adapter uses
(``subscriptions``, ``on_connect``, ``on_message``, ``on_tick``), with MQTT topic-filter
matching and retained messages, so what passes here is what runs over mosquitto.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from aggregator.rounds import RoundMachine, RoundPolicy, SnapshotError
from aggregator.store import CheckpointCorrupted, CheckpointStore
from edge_sdk import secagg, wire
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.hazmat.ring import Ring
from edge_sdk.ledger import Budget, Ledger
from edge_sdk.model import init_params
from edge_sdk.session import DeviceSession
from tools.inproc import MemoryBroker, topic_matches

FLEET = "lab"
N_DEVICES = 20


# ----------------------------------------------------------------------- the broker


def test_topic_matching() -> None:
    assert topic_matches("fedge/f/dev/+/up/+", "fedge/f/dev/d1/up/chunk")
    assert not topic_matches("fedge/f/dev/+/up/+", "fedge/f/dev/d1/down/chunk")
    assert topic_matches("fedge/#", "fedge") and topic_matches("fedge/#", "fedge/a/b")
    assert not topic_matches("fedge/+", "fedge/a/b")


# ----------------------------------------------------------------------- the fleet


def _seeded_bytes(label: str) -> Callable[[int], bytes]:
    counter = [0]

    def random_bytes(n: int) -> bytes:
        out = b""
        while len(out) < n:
            out += hashlib.sha256(f"{label}/{counter[0]}".encode()).digest()
            counter[0] += 1
        return out[:n]

    return random_bytes




def _accuracy(engine: Any, params: list[np.ndarray], digits: Any) -> float:
    logits = engine.logits(params, digits.x_test)
    return float((logits.argmax(axis=1) == digits.y_test).mean())


class Fleet:
    """N devices + one aggregator on a MemoryBroker, with a clock."""

    def __init__(self, tmp: Path, digits: Any, engine: Any, *, rounds: int, epsilon: float = 50.0,
                 policy: dict[str, Any] | None = None) -> None:
        self.tmp, self.digits = tmp, digits
        self.spec, self.engine = engine
        self.now = 0.0
        self.agg_id = secagg.AggregatorIdentity.generate(random_bytes=_seeded_bytes("agg"))
        self.ids = [secagg.DeviceIdentity.generate(f"d{i:02d}", random_bytes=_seeded_bytes(
            f"id{i}")) for i in range(N_DEVICES)]
        self.outsider = secagg.DeviceIdentity.generate("zz", random_bytes=_seeded_bytes("zz"))
        self.registry = secagg.Registry.of(self.agg_id, self.ids)
        order = np.random.default_rng(0).permutation(len(digits.y_train))
        self.shards = np.array_split(order, N_DEVICES)
        self.policy = RoundPolicy(**{
            "fleet": FLEET, "cohort_size": 10, "stage_timeout": 10.0, "max_rounds": rounds,
            "steps": 10, "batch_size": 16, "lr": 0.5, "clip": 1.0, "noise_multiplier": 0.5,
            "value_bound": 2.0, "seed": 7, **(policy or {})})
        self.store = CheckpointStore(tmp / "aggregator.ckpt")
        params = init_params(self.spec, np.random.default_rng(1))
        self.machine = RoundMachine(policy=self.policy, identity=self.agg_id,
                                    registry=self.registry, params=params,
                                    random_bytes=_seeded_bytes("agg-rounds"),
                                    checkpoint=self.store.save)
        self.initial = [p.copy() for p in params]
        self.broker = MemoryBroker()
        self.broker.attach("aggregator", self.machine, self.now)
        self.budget = Budget(epsilon=epsilon, delta=1e-5)
        self.sessions: dict[str, DeviceSession] = {}
        self.ledgers: dict[str, Ledger] = {}
        for ident in self.ids:
            self.start_device(ident.device, create=True)

    def start_device(self, name: str, *, create: bool = False) -> DeviceSession:
        i = int(name[1:])
        if name in self.ledgers:
            self.ledgers[name].close()
        self.ledgers[name] = Ledger.open(self.tmp / f"{name}.db", budget=self.budget,
                                         device_id=name, create=create)
        idx = self.shards[i]
        x, y = self.digits.x_train[idx], self.digits.y_train[idx]
        s = DeviceSession(fleet=FLEET, identity=self.ids[i], registry=self.registry,
                          ledger=self.ledgers[name], engine=self.engine, spec=self.spec,
                          data=lambda: (x, y), round_rng=seeded_round_rng(1000 + i),
                          random_bytes=_seeded_bytes(f"dev{i}-{len(self.broker.sent)}"))
        self.sessions[name] = s
        self.broker.detach(name)
        self.broker.attach(name, s, self.now)
        return s

    def settle(self, *, max_ticks: int = 40, until: Callable[[], bool] | None = None) -> None:
        """Deliver everything; advance the clock past deadlines until ``until()``."""
        self.broker.run(self.now)
        for _ in range(max_ticks):
            if until is not None and until():
                return
            self.now += self.policy.stage_timeout + 0.5
            self.broker.tick(self.now)
        assert until is None, "the fleet did not reach the expected state"

    def close(self) -> None:
        for led in self.ledgers.values():
            led.close()


def _down_kind(topic: str, payload: bytes) -> str | None:
    """The secagg (or plan) message kind a downlink carries (its envelope's)."""
    if "/down/" not in topic:
        return None
    kind = wire.peek(payload, wire.DOWN_KINDS).kind
    return kind if kind in wire.SECAGG_DOWN or kind == "plan" else None


def _check_sums(fleet: Fleet) -> None:
    """Every completed round's integer sum is the survivors' encoded inputs summed, bitwise."""
    bits = fleet.policy.bits
    for o in fleet.machine.history:
        if not o.completed:
            continue
        want = np.zeros_like(o.total)
        for dev in o.survivors:
            x = fleet.sessions[dev].encoded_input(o.round_id)
            assert x is not None, (dev, o.round_id)
            want = want + x
        want &= np.uint64((1 << bits) - 1)
        assert o.total.dtype == Ring(bits=bits).dtype and np.array_equal(o.total, want), \
            o.round_id


# ----------------------------------------------------------------------- scenarios


def test_fleet_learns_with_secure_aggregation_and_dropouts(tmp_path, digits, engine) -> None:
    rounds = 5
    fleet = Fleet(tmp_path, digits, engine, rounds=rounds)
    rng = np.random.default_rng(42)
    stages = ["plan", "neighbour_keys", "forwarded_shares", "unmask_request"]
    gone: dict[str, str] = {}  # device -> the downlink kind at which it vanishes
    seen_rounds: set[int] = set()

    def drop(name: str, topic: str, payload: bytes) -> bool:
        kind = _down_kind(topic, payload)
        if kind == "plan":
            plan = wire.decode(payload, wire.DOWN_KINDS)
            if plan.round_id not in seen_rounds:  # pick this round's victims in its cohort
                seen_rounds.add(plan.round_id)
                gone.clear()
                if plan.round_id == 3:  # too many vanish before uploading: fails by policy
                    for dev in plan.cohort[:6]:
                        gone[dev] = "forwarded_shares"
                else:
                    for dev in rng.choice(plan.cohort, 2, replace=False):
                        gone[str(dev)] = str(rng.choice(stages))
        if name in gone and kind == gone[name]:
            fleet.broker.detach(name)  # offline from here on
            return True
        return False

    fleet.broker.drop = drop
    acc0 = _accuracy(fleet.engine, fleet.initial, digits)
    for r in range(1, rounds + 1):
        fleet.settle(until=lambda r=r: len(fleet.machine.history) >= r
                     and fleet.machine.stage == "idle")
        for dev in list(gone):  # the vanished come back between rounds
            if dev not in fleet.broker.endpoints:
                fleet.broker.attach(dev, fleet.sessions[dev], fleet.now)
        fleet.broker.run(fleet.now)
    hist = fleet.machine.history
    assert [o.round_id for o in hist] == list(range(1, rounds + 1))
    assert [o.completed for o in hist] == [True, True, False, True, True]
    assert "below min_survivors" in hist[2].detail and hist[2].total is None
    for o in hist:
        if o.completed:
            assert 8 <= len(o.survivors) <= 10
    _check_sums(fleet)
    assert fleet.machine.model_version == sum(o.completed for o in hist)
    acc = _accuracy(fleet.engine, fleet.machine.params, digits)
    assert acc > acc0 + 0.3, (acc0, acc)
    # devices hold the published model, and each ledger counts one reservation per upload
    for name, s in fleet.sessions.items():
        if name in fleet.broker.endpoints:
            assert s.model_version == fleet.machine.model_version
        uploads = [o for o in hist if o.completed and name in o.survivors]
        assert len(fleet.ledgers[name].reservations()) >= len(uploads)
        # the upload is clamped and rounded before the sum: the aggregate view is the local
        # one, recorded explicitly (issue 14, finding 4)
        assert all(r.plan.aggregate_event == r.plan.event
                   for r in fleet.ledgers[name].reservations())
    # every upload stayed below the packet size
    assert all(len(p) <= wire.DEFAULT_MAX_PACKET for _, _, p in fleet.broker.sent
               if "/up/" in _)
    fleet.close()


def _reference_run(tmp: Path, digits, engine) -> Fleet:
    fleet = Fleet(tmp, digits, engine, rounds=2)
    fleet.settle(until=lambda: len(fleet.machine.history) >= 2 and fleet.machine.stage == "idle")
    return fleet


@pytest.mark.parametrize("crash_at", ["collect_keys", "collect_shares", "collect_masked",
                                      "collect_unmask", "idle"])
def test_aggregator_restart_from_checkpoint_at_every_stage(tmp_path, digits, engine,
                                                           crash_at: str) -> None:
    (tmp_path / "ref").mkdir()
    ref = _reference_run(tmp_path / "ref", digits, engine)
    ref_params = ref.machine.params
    ref.close()

    fleet = Fleet(tmp_path, digits, engine, rounds=2)
    crashed = []

    def after(name: str) -> bool:
        # crash in round 2 right after the checkpoint of the transition into `crash_at`
        m = fleet.machine
        if (name != "aggregator" or crashed or m.stage != crash_at
                or (m.current_plan is not None and m.current_plan.round_id != 2)
                or (crash_at == "idle" and len(m.history) < 2)):
            return False
        crashed.append(fleet.store.load())
        fleet.broker.detach("aggregator")
        fleet.machine = RoundMachine.restore(fleet.store.load(), policy=fleet.policy,
                                             identity=fleet.agg_id, registry=fleet.registry,
                                             random_bytes=_seeded_bytes("agg-rounds-2"),
                                             checkpoint=fleet.store.save)
        assert fleet.machine.snapshot() == crashed[0]
        fleet.broker.attach("aggregator", fleet.machine, fleet.now)
        return True

    fleet.broker.after = after
    fleet.settle(until=lambda: len(fleet.machine.history) >= 2 and fleet.machine.stage == "idle")
    assert crashed, f"never reached {crash_at}"
    hist = fleet.machine.history
    assert [(o.round_id, o.completed) for o in hist] == [(1, True), (2, True)]
    assert fleet.machine.model_version == 2  # each update applied exactly once
    _check_sums(fleet)
    for a, b in zip(fleet.machine.params, ref_params, strict=True):
        assert np.array_equal(a, b)  # bit for bit the run without a crash
    fleet.close()


def test_device_restart_mid_round_neither_double_spends_nor_uploads_twice(
        tmp_path, digits, engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=1)
    victim: list[str] = []
    plan_payload: list[bytes] = []

    def after(name: str) -> bool:
        s = fleet.sessions.get(name)
        if victim or s is None or s.encoded_input(1) is None:
            return False
        victim.append(name)  # it reserved and masked: restart before or after the upload
        return False

    def drop(name: str, topic: str, payload: bytes) -> bool:
        if "/down/plan" in topic and not plan_payload:
            plan_payload.append(payload)
        return False

    fleet.broker.after, fleet.broker.drop = after, drop
    fleet.broker.run(fleet.now)
    assert fleet.machine.stage in ("collect_unmask", "idle") and victim
    name = victim[0]
    old = fleet.sessions[name]
    x_old = old.encoded_input(1)
    key = f"{FLEET}/1"
    assert [r.plan.round_id for r in fleet.ledgers[name].reservations()] == [key]
    # restart: a fresh session on the reopened ledger; the plan is delivered again
    new = fleet.start_device(name)
    before = len(fleet.broker.sent)
    out = new.on_message(wire.device_down_topic(FLEET, name, "plan"), plan_payload[0],
                         fleet.now)
    kinds = [p.topic.rsplit("/", 1)[1] for p in out]
    assert kinds == ["decline", "checkin"]  # idle again: it checks in at once
    assert msgpack.unpackb(out[0].payload)["reason"] == "already_committed"
    fleet.settle(until=lambda: len(fleet.machine.history) >= 1 and fleet.machine.stage == "idle")
    o = fleet.machine.history[0]
    assert o.completed and o.survivors.count(name) <= 1
    chunks_after = [t for s, t, _ in fleet.broker.sent[before:]
                    if s == name and "/up/masked_part" in t]
    assert chunks_after == []
    assert [r.plan.round_id for r in fleet.ledgers[name].reservations()] == [key]
    fleet.sessions[name] = old  # its input is the one in the sum
    assert np.array_equal(old.encoded_input(1), x_old)
    _check_sums(fleet)
    fleet.close()


def test_budget_exhausted_devices_decline(tmp_path, digits, engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=1, epsilon=0.5)
    fleet.broker.run(fleet.now)
    declines = [msgpack.unpackb(p) for s, t, p in fleet.broker.sent if t.endswith("/up/decline")]
    assert len(declines) == 10 and {d["reason"] for d in declines} == {"budget"}
    assert all(not led.reservations() for led in fleet.ledgers.values())
    assert fleet.machine.history[0].completed is False  # failed cleanly, nothing revealed
    # each decliner checked in again at once, and is not selected again (its remaining
    # epsilon is what it was when it declined); a restored machine remembers it
    assert sorted(fleet.machine.checkins) == [i.device for i in fleet.ids]
    decliners = {s for s, t, _ in fleet.broker.sent if t.endswith("/up/decline")}
    assert len(decliners) == 10
    others = tuple(sorted({i.device for i in fleet.ids} - decliners))
    assert fleet.machine.eligible == others and len(others) == len(fleet.ids) - 10
    m = RoundMachine.restore(fleet.machine.snapshot(), policy=fleet.policy,
                             identity=fleet.agg_id, registry=fleet.registry)
    assert m.eligible == others
    fleet.close()


# ----------------------------------------------------------------------- bad inputs


def test_bad_inputs_are_rejected_without_state_change(tmp_path, digits, engine, caplog) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=1)
    up: dict[str, list[tuple[str, bytes]]] = {}

    def keep(name: str, topic: str, payload: bytes) -> bool:
        if name == "aggregator":
            up.setdefault(topic.rsplit("/", 1)[1], []).append((topic, payload))
        # hold the round in collect_masked: no forwarded shares reach the devices
        return _down_kind(topic, payload) == "forwarded_shares"

    fleet.broker.drop = keep
    fleet.broker.run(fleet.now)
    m = fleet.machine
    assert m.stage == "collect_masked"
    plan = m.current_plan
    member = plan.cohort[0]
    outsider_in_fleet = next(d.device for d in fleet.ids if d.device not in plan.cohort)
    topic = wire.device_up_topic
    ck_topic, ck = up["checkin"][0]
    adv_topic, adv = up["advertise_keys"][0]
    adv_sender = adv_topic.split("/")[3]
    # a masked input of the wrong length, properly signed by a cohort member, in parts
    cfg = secagg.RoundConfig.of_plan(plan)
    signer = fleet.ids[int(member[1:])]
    count = plan.length - 1
    wrong_shape = [wire.encode(wire.sign(p, signer, context=cfg.digest()))
                   for p in wire.split_masked(round_id=plan.round_id, sender=member,
                                              bits=plan.bits, count=count,
                                              data=bytes((count * plan.bits + 7) // 8),
                                              max_packet=1024)]
    wrong_round = msgpack.packb({**msgpack.unpackb(adv), "round": 99})
    unsigned_ck = wire.encode(wire.CheckIn(round_id=0, sender=member, data_size=1,
                                           remaining_epsilon=1.0, spent_epsilon=0.0,
                                           budget_epsilon=1.0, budget_delta=1e-5,
                                           model_version=0, sig=bytes(64)))
    nan_ck = msgpack.packb({**msgpack.unpackb(ck), "remaining_epsilon": float("nan")})
    inf_spent_ck = msgpack.packb({**msgpack.unpackb(ck), "spent_epsilon": float("inf")})
    bad: list[Any] = [
        (topic(FLEET, member, "checkin"), b"\x93garbage"),
        (ck_topic, ck[:-5]),  # truncated
        (ck_topic, nan_ck),
        (ck_topic, inf_spent_ck),
        (topic(FLEET, member, "checkin"), unsigned_ck),  # mis-signed
        (topic(FLEET, member, "checkin"), next(  # someone else's check-in on this topic
            p for t, p in up["checkin"] if f"/{member}/" not in t)),
        (topic(FLEET, "zz", "checkin"), ck),  # outsider
        (adv_topic, wrong_round),
        (adv_topic, adv),  # replay of an accepted message
        (topic(FLEET, outsider_in_fleet, "advertise_keys"),  # someone's advert, renamed
         msgpack.packb({**msgpack.unpackb(adv), "from": outsider_in_fleet})),
        (topic(FLEET, member, "masked_part"), b""),
        [(topic(FLEET, member, "masked_part"), p) for p in wrong_shape],
        (topic(FLEET, outsider_in_fleet, "decline"), wire.encode(wire.sign(wire.Decline(
            round_id=plan.round_id, sender=outsider_in_fleet, reason="budget"),
            fleet.ids[int(outsider_in_fleet[1:])]))),  # not in the cohort
        (topic(FLEET, member, "advertise_keys"), wrong_shape[0]),  # a part on another topic
        (topic(FLEET, member, "model"), fleet.broker.retained[wire.model_topic(FLEET)]),
        (f"fedge/other/dev/{member}/up/checkin", ck),
        (topic(FLEET, adv_sender, "decline"), wire.encode(wire.sign(wire.Decline(
            round_id=plan.round_id, sender=adv_sender, reason="budget"), fleet.outsider))),
    ]
    for case in bad:
        group = case if isinstance(case, list) else [case]  # a multi-chunk upload: one input
        before = m.snapshot()
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="aggregator.rounds"):
            for t, payload in group:
                assert m.on_message(t, payload, fleet.now) == []
        assert m.snapshot() == before, t
        records = [r for r in caplog.records if r.name == "aggregator.rounds"]
        assert records and all(hasattr(r, "fedge") for r in records), t
        assert all(r.fedge["event"] in ("rejected", "duplicate") for r in records)
    # the round still finishes normally afterwards: a reconnect re-sends the held-back
    # forwarded shares (the open stage's outbox)
    fleet.broker.drop = lambda *a: False
    fleet.broker.detach("aggregator")
    fleet.broker.attach("aggregator", m, fleet.now)
    fleet.settle(until=lambda: len(m.history) >= 1 and m.stage == "idle")
    assert m.history[0].completed
    fleet.close()


def test_device_ignores_forged_and_stray_messages(tmp_path, digits, engine, caplog) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=0)
    s = fleet.sessions["d00"]
    assert s.model_version == 0
    params = s.params
    forged = wire.encode(wire.sign(wire.ModelUpdate.of(version=5, round_id=5, params=params),
                                   fleet.outsider))
    wrong_shape = wire.encode(wire.sign(wire.ModelUpdate.of(
        version=5, round_id=5, params=[params[0][:1], params[1]]), fleet.agg_id))
    for t, p in [(wire.model_topic(FLEET), forged), (wire.model_topic(FLEET), wrong_shape),
                 (wire.model_topic(FLEET), b"\xc1"),
                 (wire.device_down_topic(FLEET, "d00", "neighbour_keys"), b"\x80")]:
        with caplog.at_level(logging.WARNING, logger="edge_sdk.session"):
            assert s.on_message(t, p, 0.0) == []
    assert s.model_version == 0 and all(np.array_equal(a, b) for a, b in
                                        zip(s.params, params, strict=True))
    assert len([r for r in caplog.records if r.name == "edge_sdk.session"]) == 4
    fleet.close()


# ----------------------------------------------------------------------- store


def test_store_round_trips_and_rejects_corruption(tmp_path) -> None:
    store = CheckpointStore(tmp_path / "c.ckpt")
    with pytest.raises(CheckpointCorrupted, match="no checkpoint"):
        store.load()
    store.save(b"hello" * 100)
    assert store.load() == b"hello" * 100
    store.save(b"second")
    assert store.load() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]  # no temp file left
    raw = store.path.read_bytes()
    store.path.write_bytes(raw[:-1])
    with pytest.raises(CheckpointCorrupted, match="truncated"):
        store.load()
    store.path.write_bytes(raw[:-1] + b"X")
    with pytest.raises(CheckpointCorrupted, match="checksum"):
        store.load()
    store.path.write_bytes(b"NOTACKPT" + raw[8:])
    with pytest.raises(CheckpointCorrupted, match="magic"):
        store.load()


def test_restore_refuses_another_policy_or_garbage(tmp_path, digits, engine) -> None:
    fleet = Fleet(tmp_path, digits, engine, rounds=0)
    snap = fleet.machine.snapshot()
    other = RoundPolicy(**{**{f: getattr(fleet.policy, f) for f in
                              fleet.policy.__dataclass_fields__}, "cohort_size": 12})
    with pytest.raises(SnapshotError, match="another policy"):
        RoundMachine.restore(snap, policy=other, identity=fleet.agg_id, registry=fleet.registry)
    with pytest.raises(SnapshotError):
        RoundMachine.restore(snap[:-3], policy=fleet.policy, identity=fleet.agg_id,
                             registry=fleet.registry)
    m = RoundMachine.restore(snap, policy=fleet.policy, identity=fleet.agg_id,
                             registry=fleet.registry)
    assert m.snapshot() == snap
    fleet.close()
