"""Bad input over a real broker (issue 6, "Must show 3").

Part one: the real ``fedge aggregator`` process, its round held in collect_masked (one
cohort member's forwarded shares are withheld in this process), receives bad payloads sent
with the real ``mosquitto_pub`` client, each with a device's own credentials into that
device's up topic: truncated msgpack, wrong types, wrong shapes and widths, NaN/inf,
oversized uploads, a replayed upload, an upload from a device outside the cohort,
unsigned and mis-signed messages. Each is answered by a JSON log line naming the reason;
the checkpoint does not change, the process keeps running, and the round then completes
with an exact sum.

Part two: a ``RoundMachine`` on an ``MqttLoop`` in this process, fed every truncated
prefix of valid messages and hypothesis-generated mutations of them through the broker;
its snapshot is byte-identical after each, and each is logged as rejected or duplicate.
"""

from __future__ import annotations

import logging
import math
import subprocess
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_services import MODEL, POLICY, ServiceFleet, pump_until

from aggregator.guard import FloodLimits
from aggregator.rounds import RoundMachine
from aggregator.service import AggregatorConfig
from aggregator.store import CheckpointStore
from edge_sdk import secagg, wire
from edge_sdk.config import load_aggregator_identity, load_device_identity
from edge_sdk.engine import load_engine
from edge_sdk.model import init_params
from edge_sdk.mqtt import ClientConfig
from edge_sdk.session import DeviceSession
from edge_sdk.wire import Publish
from models import ONNX_DIR

pytestmark = pytest.mark.broker

FLEET = "svc"


@pytest.fixture(scope="module")
def engine() -> Any:
    return load_engine(ONNX_DIR / f"{MODEL}.json")


class Gate:
    """A device session whose forwarded shares can be held back (to freeze a round in
    collect_masked), recording what it sends."""

    def __init__(self, name: str, session: DeviceSession) -> None:
        self.name, self.s = name, session
        self.hold = False
        self.held: list[tuple[str, bytes]] = []
        self.sent: list[Publish] = []
        self.plan: wire.RoundPlan | None = None

    def subscriptions(self) -> list[str]:
        return self.s.subscriptions()

    def on_connect(self, now: float) -> list[Publish]:
        return self._out(self.s.on_connect(now))

    def on_tick(self, now: float) -> list[Publish]:
        out: list[Publish] = []
        if not self.hold:
            while self.held:
                t, p = self.held.pop(0)
                out += self.s.on_message(t, p, now)
        return self._out(out + self.s.on_tick(now))

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        if topic.endswith("/down/plan"):
            self.plan = wire.decode(payload, wire.ALL_KINDS)  # type: ignore[assignment]
            self.hold = self.plan is not None and self.plan.cohort[0] == self.name
        if self.hold and topic.endswith("/down/forwarded_shares"):
            self.held.append((topic, payload))
            return []
        return self._out(self.s.on_message(topic, payload, now))

    def _out(self, out: list[Publish]) -> list[Publish]:
        self.sent += out
        return out

    def last(self, kind: str) -> bytes:
        return [p.payload for p in self.sent if p.topic.endswith(f"/up/{kind}")][-1]


class GatedFleet(ServiceFleet):
    def wrap(self, name: str, session: DeviceSession) -> Any:
        self.gates = getattr(self, "gates", {})
        self.gates[name] = Gate(name, session)
        return self.gates[name]


def _held_round(tmp: Path, digits: Any, engine: Any) -> GatedFleet:
    return GatedFleet(tmp, digits, engine, devices=4, in_process=4,
                      policy={**POLICY, "cohort_size": 3, "min_cohort": 3,
                              "stage_timeout": 120.0, "max_rounds": 1})


def _part(plan: wire.RoundPlan, ident: secagg.DeviceIdentity, *, count: int,
          bits: int) -> bytes:
    """A one-part masked upload of ``count`` zero residues at ``bits``, signed by ``ident``
    for the plan's round."""
    (p,) = wire.split_masked(round_id=plan.round_id, sender=ident.device, bits=bits,
                             count=count, data=bytes((count * bits + 7) // 8))
    digest = secagg.RoundConfig.of_plan(plan).digest()
    return wire.encode(wire.sign(p, ident, context=digest))


def test_bad_input_via_mosquitto_pub_is_rejected_and_changes_nothing(
        tmp_path: Path, digits: Any, engine: Any) -> None:
    f = _held_round(tmp_path, digits, engine)
    try:
        agg = f.start_aggregator("--exit-when-done")
        f.wait_line(agg, lambda e: e["event"] == "stage" and e["stage"] == "collect_masked",
                    60, "collect_masked")
        plan = next(g.plan for g in f.gates.values() if g.plan is not None)
        assert plan is not None
        held, a, b = plan.cohort
        x = next(n for n in f.names if n not in plan.cohort)
        pump_until(f.loop, lambda: all(any(p.topic.endswith("/up/masked_part")
                                           for p in f.gates[d].sent)
                                       and f.loop.pending(d) == 0 for d in (a, b)),
                   30, [agg], "the two uploads")
        f.loop.run(timeout=0.5)  # the aggregator takes both uploads in
        for d in (held, a):  # their clients leave; mosquitto_pub takes over their sessions
            f.loop.remove(d, timeout=2.0)
        ckpt = CheckpointStore(AggregatorConfig.from_toml(f.agg_config).checkpoint)
        before = ckpt.load()
        ids = {n: load_device_identity(tmp_path / "fleet" / "devices" / n / "identity.key")
               for n in f.names}
        c = f.broker.config
        up = wire.device_up_topic
        ck = msgpack.unpackb(f.gates[a].last("checkin"))
        chunk_a = f.gates[a].last("masked_part")
        d_k = plan.length
        cases: list[tuple[str, str, bytes | None, str]] = [
            (a, up(FLEET, a, "masked_part"), None, "malformed message bytes"),  # empty
            (a, up(FLEET, a, "masked_part"), chunk_a[:1], "malformed message bytes"),
            (a, up(FLEET, a, "masked_part"), chunk_a[: len(chunk_a) // 2],
             "malformed message bytes"),
            (a, up(FLEET, a, "masked_part"), chunk_a[:-1], "malformed message bytes"),
            (a, up(FLEET, a, "checkin"), msgpack.packb({**ck, "data_size": "lots"}),
             "'data_size' must be an integer"),
            (a, up(FLEET, a, "checkin"), msgpack.packb({**ck, "remaining_epsilon": math.nan}),
             "'remaining_epsilon' must be a finite float"),
            (a, up(FLEET, a, "checkin"), msgpack.packb({**ck, "remaining_epsilon": math.inf}),
             "'remaining_epsilon' must be a finite float"),
            (a, up(FLEET, a, "checkin"), msgpack.packb({**ck, "sig": bytes(64)}),
             "bad signature"),  # unsigned (a zero signature)
            (a, up(FLEET, a, "decline"), wire.encode(wire.sign(wire.Decline(
                round_id=plan.round_id, sender=a, reason="budget"), ids[x])),
             "bad signature"),  # mis-signed: another device's key
            (a, up(FLEET, a, "masked_part"), chunk_a, "already accepted"),  # replayed upload
            (a, up(FLEET, a, "masked_part"), _part(plan, ids[a], count=d_k, bits=plan.bits),
             "second, different masked_part"),  # a second, different upload
            (held, up(FLEET, held, "masked_part"), _part(plan, ids[held], count=d_k - 1,
                                                         bits=plan.bits),
             f"has {d_k - 1} values"),  # wrong shape
            (held, up(FLEET, held, "masked_part"), _part(plan, ids[held], count=d_k, bits=16),
             "of 16 bits"),  # wrong width
            (held, up(FLEET, held, "masked_part"),
             msgpack.packb({**msgpack.unpackb(chunk_a), "from": held, "count": 1 << 31}),
             "above 268435456"),  # oversized
            (held, up(FLEET, held, "advertise_keys"),
             _part(plan, ids[held], count=d_k, bits=plan.bits),
             "masked_part message on the 'advertise_keys' topic"),
            (x, up(FLEET, x, "masked_part"), _part(plan, ids[x], count=d_k, bits=plan.bits),
             "not in round 1's cohort"),  # an upload from outside the cohort
            (x, up(FLEET, x, "checkin"), msgpack.packb({**ck}), "names device"),
        ]
        for i, (who, topic, payload, reason) in enumerate(cases):
            args = ["mosquitto_pub", "-h", c.host, "-p", str(c.port), "--cafile",
                    str(c.ca_file), "-u", who, "-P", c.password(who), "-i", who, "-c", "-x",
                    "86400", "-V", "mqttv5", "-q", "1", "-t", topic]
            if payload is None:
                args.append("-n")
            else:
                path = tmp_path / f"payload-{i}.bin"
                path.write_bytes(payload)
                args += ["-f", str(path)]
            r = subprocess.run(args, capture_output=True, text=True, timeout=20)
            assert r.returncode == 0, (i, r.stderr)
            line = f.wait_line(agg, lambda e, t=topic: e["event"] in ("rejected", "duplicate")
                               and e["topic"] == t, 20, f"case {i} ({reason})")
            assert reason in line["reason"], (i, line)
        assert agg.p.poll() is None  # still running
        assert ckpt.load() == before  # no transition, no state written
        # the round still completes: both clients come back, the held shares go through
        for d in (held, a):
            f.loop.add(f.client(d), f.gates[d])
        f.gates[held].hold = False
        pump_until(f.loop, lambda: agg.p.poll() is not None, 60, [agg], "the round's end")
        assert agg.wait() == 0
        m = f.machine()
        assert [(o.round_id, o.completed) for o in m.history] == [(1, True)]
        assert sorted(m.history[0].survivors) == sorted(plan.cohort)
        f.check_sums(m)
        rejected = [e for e in agg.lines if e["event"] == "rejected"]
        assert len(rejected) == len(cases) - 1  # the exact replay is a logged duplicate
    finally:
        f.close()


def test_every_prefix_and_hypothesis_mutations_leave_the_machine_unchanged(
        tmp_path: Path, digits: Any, engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    f = _held_round(tmp_path, digits, engine)
    try:
        cfg = AggregatorConfig.from_toml(f.agg_config)
        # thousands of bad messages from one device are a flood by the default limits (its
        # quarantine would be a state change): this test is about each message alone
        machine = RoundMachine(policy=cfg.policy, identity=load_aggregator_identity(cfg.identity),
                               registry=f.registry,
                               params=init_params(engine.spec, np.random.default_rng(0)),
                               limits=FloodLimits(burst=10**9, rate=1e9))
        seen = [0]
        sender = [""]  # the topic prefix of the test's publisher, once chosen

        class Counting:
            def subscriptions(self) -> list[str]:
                return machine.subscriptions()

            def on_connect(self, now: float) -> list[Publish]:
                return machine.on_connect(now)

            def on_tick(self, now: float) -> list[Publish]:
                return machine.on_tick(now)

            def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
                # count only what the test sends: a status message (a client's will or
                # "online"), or an upload of another cohort member, arriving meanwhile must
                # not end a delivery wait one early (once seen in CI: 231 records of 232)
                if sender[0] and topic.startswith(sender[0]):
                    seen[0] += 1
                return machine.on_message(topic, payload, now)

        f.loop.add(ClientConfig(username="aggregator", password=f.broker.config.password(
            "aggregator"), backoff_initial_s=0.05, backoff_max_s=1.0), Counting())
        pump_until(f.loop, lambda: machine.stage == "collect_masked", 60, [], "collect_masked")
        plan = machine.current_plan
        assert plan is not None
        held, a, _ = plan.cohort
        pump_until(f.loop, lambda: len(machine.snapshot()) > 0 and a in set(
            machine._round.server.survivors), 30, [], "a's upload")  # noqa: SLF001
        f.loop.remove(a, timeout=2.0)
        sender[0] = wire.device_up_topic(FLEET, a, "checkin").rsplit("/", 1)[0] + "/"
        f.loop.add(f.client(a), _Publisher())
        pump_until(f.loop, lambda: f.loop.is_ready(a), 10, [], "publisher")
        gate = f.gates[a]
        base = {"checkin": gate.last("checkin"), "masked_part": gate.last("masked_part"),
                "advertise_keys": gate.last("advertise_keys")}

        def deliver(items: list[tuple[str, bytes]]) -> list[logging.LogRecord]:
            before, n = machine.snapshot(), seen[0]
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="aggregator.rounds"):
                # in slices: mosquitto drops what exceeds a client's queue (1000 here)
                for start in range(0, len(items), 200):
                    for kind, payload in items[start : start + 200]:
                        f.loop.publish(a, Publish(wire.device_up_topic(FLEET, a, kind),
                                                  payload))
                    want = n + min(len(items), start + 200)
                    pump_until(f.loop, lambda w=want: seen[0] >= w, 30, [],
                               f"delivery ({seen[0] - n} of {len(items)})")
            assert machine.snapshot() == before
            # only what the test sent: a status message (a reconnecting client's will or
            # "online") or another member's message may be logged in the same window
            # (a stage's re-send, which a slow machine reaches meanwhile, is logged too)
            recs = [r for r in caplog.records if r.name == "aggregator.rounds"
                    and str(r.fedge.get("topic", "")).startswith(sender[0])]
            assert all(r.fedge["event"] in ("rejected", "duplicate") for r in recs)
            return recs

        for kind, valid in base.items():  # every truncated prefix, the empty one included
            recs = deliver([(kind, valid[:i]) for i in range(len(valid))])
            assert len(recs) == len(valid), kind
        big = st.integers(-(2**63), 2**64 - 1)
        values = st.one_of(st.none(), st.booleans(), big,
                           st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=80),
                           st.binary(max_size=300), st.lists(big, max_size=5),
                           st.dictionaries(st.text(max_size=5), st.integers(-9, 9), max_size=3))

        @settings(max_examples=150, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow])
        @given(kind=st.sampled_from(sorted(base)), data=st.data())
        def mutated(kind: str, data: st.DataObject) -> None:
            obj = msgpack.unpackb(base[kind])
            op = data.draw(st.sampled_from(["set", "drop", "add", "bytes"]))
            if op == "bytes":
                payload = data.draw(st.binary(max_size=400))
            else:
                key = data.draw(st.sampled_from(sorted(obj)))
                if op == "set":
                    obj[key] = data.draw(values)
                elif op == "drop":
                    del obj[key]
                else:
                    obj[data.draw(st.text(min_size=1, max_size=8))] = data.draw(values)
                payload = msgpack.packb(obj)
            if payload == base[kind] and kind == "checkin":
                return  # unchanged check-in: not bad input
            recs = deliver([(kind, payload)])
            assert len(recs) == 1 and recs[0].fedge.get("reason"), payload[:40]

        mutated()
        # the round still completes over the broker
        f.loop.remove(a, timeout=2.0)
        f.loop.add(f.client(a), f.gates[a])
        f.gates[held].hold = False
        pump_until(f.loop, lambda: bool(machine.history), 60, [], "the round's end")
        assert machine.history[0].completed
        f.check_sums(machine)
    finally:
        f.close()


class _Publisher:
    def subscriptions(self) -> list[str]:
        return []

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        return []

    def on_tick(self, now: float) -> list[Publish]:
        return []

