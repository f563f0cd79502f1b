"""A fleet with secure aggregation, run over either transport with the same sans-I/O objects.

:class:`Fleet` builds N enrolled devices (identities, registry, a privacy ledger each in
``workdir/ledgers``, a data shard each from ``tools.partition``, one shared engine) and the
aggregator's :class:`aggregator.rounds.RoundMachine` (policy from the :class:`SimConfig`),
then drives them through

* ``inproc``: :class:`tools.inproc.MemoryBroker` and a simulated clock, or
* ``mqtt``: a real mosquitto (``tools.broker.Broker``: TLS, a password per device, ACLs)
  with all N device endpoints and the aggregator endpoint on one ``edge_sdk.mqtt.MqttLoop``.

Both paths run the same :class:`edge_sdk.session.DeviceSession` and ``RoundMachine`` code;
only the wrappers below sit between them and the transport. A run is a function of the
seeds, so both transports produce the same rounds, bit for bit in the integer sums:

* rounds start only when every device has checked in with the current model (the
  machine's ``start_gate``), so the cohort (seeded by policy seed and round id over the
  sorted eligible devices) does not depend on message timing;
* dropouts (``dropout = F``): for each round a seeded F of the cohort vanishes at a seeded
  stage (``tools.dropouts``, which says what each stage means), on receipt of the message
  that opens it. A vanished device answers nothing; over MQTT its TCP connection is also cut
  (``MqttLoop.drop``: the broker sees a network failure and publishes its will). It comes
  back once the round is over, with whatever model and error notice it missed;
* a stage closes when every device still expected answered, or at its deadline. Missing
  devices are detected by deadline: when only vanished devices are still awaited, the
  aggregator's clock jumps to the deadline (on both transports the same rule, so the same
  devices are dropped). The real ``stage_timeout`` stays a safety net for anything else and
  is kept generous over MQTT, so that a live device is never dropped for being slow.

Devices' status (last-will) messages are not fed to the machine: the harness knows which
devices are live, and the moment the broker notices a cut connection is not deterministic.

Key material comes from seeded generators here (reproducible simulation); a deployment
uses ``os.urandom`` (the default of both endpoints).
"""

from __future__ import annotations

import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from aggregator.round_core import RoundPolicy, mechanism_params
from aggregator.rounds import (
    Event,
    RoundEnded,
    RoundMachine,
    RoundOutcome,
    RoundStarted,
)
from aggregator.site import Upstream
from aggregator.store import CheckpointStore
from edge_sdk import secagg, wire
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.engine import Engine, load_engine
from edge_sdk.errors import RemoteProtocolError
from edge_sdk.ledger import Budget, Ledger
from edge_sdk.model import ModelSpec, build_spec, init_params
from edge_sdk.session import DeviceSession, SessionEvent
from edge_sdk.wire import CheckIn, Publish
from models import manifest_path
from tools.broker import device_names
from tools.datasets import Dataset, load_dataset
from tools.dropouts import DropoutSchedule
from tools.evaluate import evaluate
from tools.inproc import MemoryBroker
from tools.partition import partition
from tools.seeding import device_seed, round_random_bytes, seeded_bytes
from tools.simconfig import FLEET_BUDGET_EPSILON, FLEET_NAME, SimConfig, round_policy
from tools.summary import EPSILON_NOTE, model_sha256, sum_sha256, worst

__all__ = ["DROP_STAGES", "DeviceAgent", "Fleet", "simulate_fleet"]

AGGREGATOR = "aggregator"
# The stage a device vanishes in -> the downlink kind on whose receipt it vanishes.
DROP_STAGES: Mapping[str, str] = {
    "keys": "plan",
    "shares": "neighbour_keys",
    "masked": "forwarded_shares",
    "unmask": "unmask_request",
}
# The same for the amortized protocol (issue 18), which has no key stages: a device that
# vanishes before its upload vanishes on the plan, one after it on the reveal request
# (which only survivors with a dropped neighbour get: the others have nothing to drop).
AMORTIZED_DROP_STAGES: Mapping[str, str] = {
    "keys": "plan",
    "shares": "plan",
    "masked": "plan",
    "unmask": "reveal_request",
}
_TICK_S = 0.1  # the inproc clock's step while messages flow




@dataclass(slots=True)
class Meter:
    """Bytes and messages as the endpoints published / received them."""

    up_payload: int = 0
    up_packets: int = 0  # MQTT PUBLISH packet bytes (header + topic + payload)
    up_messages: int = 0
    down_payload: int = 0
    down_packets: int = 0
    down_messages: int = 0
    delivered_payload: int = 0  # what reached devices (the broker fans the model out)

    def snapshot(self) -> dict[str, int]:
        return {"up_payload": self.up_payload, "up_packets": self.up_packets,
                "up_messages": self.up_messages, "down_payload": self.down_payload,
                "down_packets": self.down_packets, "down_messages": self.down_messages,
                "delivered_payload": self.delivered_payload}


def _count(out: list[Publish], up: bool, meter: Meter) -> list[Publish]:
    payload = sum(len(p.payload) for p in out)
    packets = sum(wire.mqtt_publish_size(p.topic, len(p.payload)) for p in out)
    if up:
        meter.up_payload += payload
        meter.up_packets += packets
        meter.up_messages += len(out)
    else:
        meter.down_payload += payload
        meter.down_packets += packets
        meter.down_messages += len(out)
    return out


class DeviceAgent:
    """A device endpoint around a :class:`DeviceSession` that may vanish mid-round.

    While gone it answers nothing (messages, ticks, reconnects); it keeps the newest model
    and the error notice of the round it left, and replays them into the session on the
    first tick after :meth:`revive`. Messages of a round it left never reach the session
    (a QoS 1 redelivery after the cut connection must not make it upload late).

    What the session did (opened a round, uploaded, declined, left a round) is taken from
    its events into :attr:`events`, never inferred from what it published. Whether to
    vanish is decided before the session sees a message, so that much still reads the
    downlink itself (:meth:`_peek`: its round and, for a SecAgg packet, the inner kind)
    until plan15 D2 gives the wire a header peek.
    """

    def __init__(self, name: str, session: DeviceSession, *, fleet: str,
                 schedule: DropoutSchedule | None, gone: set[str], meter: Meter,
                 on_vanish: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.session = session
        self.fleet = fleet
        self.schedule = schedule
        self.gone_set = gone
        self.meter = meter
        self.on_vanish = on_vanish
        self.vanished: dict[int, str] = {}  # round -> stage it vanished in
        self.sent: list[Publish] = []  # everything it published (tests audit uploads)
        self.events: list[SessionEvent] = []  # what its session(s) did, oldest first
        self._target: tuple[int, str] | None = None  # (round, stage) to vanish in
        self._drop_kinds: Mapping[str, str] = DROP_STAGES  # stage -> downlink kind, by protocol
        self._dead_round = 0
        self._revive = False
        self._stash_model: bytes | None = None
        self._stash_error: bytes | None = None
        self._model_topic = wire.model_topic(fleet)
        self._down = wire.device_down_topic(fleet, name, "x")[:-1]

    @property
    def gone(self) -> bool:
        return self.name in self.gone_set

    def revive(self) -> None:
        """Come back (the round it vanished in is over); takes effect on the next tick."""
        if self.gone:
            self.gone_set.discard(self.name)
            self._revive = True

    def replace_session(self, session: DeviceSession) -> None:
        """A restarted device process: a new session (on the reopened ledger)."""
        self.events.extend(self.session.take_events())
        self.session = session

    # -- endpoint ----------------------------------------------------------------------

    def subscriptions(self) -> list[str]:
        return self.session.subscriptions()

    def on_connect(self, now: float) -> list[Publish]:
        if self.gone:
            return []
        return self._out(self.session.on_connect(now))

    def on_tick(self, now: float) -> list[Publish]:
        if self.gone:
            return []
        if self._revive:
            self._revive = False
            out: list[Publish] = []
            error, model = self._stash_error, self._stash_model
            self._stash_error = self._stash_model = None
            if error is not None and self.session.round_id == self._dead_round:
                out += self.session.on_message(self._down + "error", error, now)
            if model is not None:
                out += self.session.on_message(self._model_topic, model, now)
            if not out:
                out = self.session.on_connect(now)
            return self._out(out)
        return self._out(self.session.on_tick(now))

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        self.meter.delivered_payload += len(payload)
        if topic == self._model_topic:
            if self.gone:
                self._stash_model = payload
                return []
            return self._out(self.session.on_message(topic, payload, now))
        kind = topic[len(self._down):] if topic.startswith(self._down) else ""
        round_id, inner = self._peek(kind, payload)
        if round_id is not None and kind != "error" and round_id <= self._dead_round:
            return []  # a message of a round this device left
        if self.gone:
            if kind == "error" and round_id == self._dead_round:
                self._stash_error = payload
            return []
        if kind == "plan" and self.schedule is not None and round_id is not None:
            plan = wire.decode(payload, wire.DOWN_KINDS)
            stage = self.schedule.victims(round_id, plan.cohort).get(self.name)  # type: ignore[attr-defined]
            self._target = None if stage is None else (round_id, stage)
            self._drop_kinds = (AMORTIZED_DROP_STAGES if plan.secagg == "amortized"  # type: ignore[attr-defined]
                                else DROP_STAGES)
        if self._target is not None and self._target[0] == round_id \
                and self._drop_kinds[self._target[1]] == inner:
            self.vanished[round_id] = self._target[1]
            self._target = None
            self._dead_round = round_id
            self.gone_set.add(self.name)
            if self.on_vanish is not None:
                self.on_vanish(self.name)
            return []
        return self._out(self.session.on_message(topic, payload, now))

    # -- helpers -----------------------------------------------------------------------

    def _peek(self, kind: str, payload: bytes) -> tuple[int | None, str]:
        """(round id, message kind: plan / a secagg kind / error) of a downlink, from its
        envelope (``wire.peek``)."""
        if kind not in wire.DOWN_KINDS:
            return None, kind
        try:
            head = wire.peek(payload, wire.DOWN_KINDS)
        except RemoteProtocolError:
            return None, kind  # the session logs and ignores it
        return head.round, head.kind

    def _out(self, out: list[Publish]) -> list[Publish]:
        self.events.extend(self.session.take_events())
        self.sent.extend(out)
        return _count(out, True, self.meter)


class AggregatorAgent:
    """The aggregator endpoint around a ``RoundMachine``: counts bytes, drops status
    messages (unless ``wills``: a harness that publishes them at fixed points), jumps its
    clock to the stage deadline once only vanished devices are awaited (see the module
    docstring), and hands the machine's events to ``on_event`` after each call, before
    that call's output is counted."""

    def __init__(self, machine: RoundMachine, *, gone: set[str], meter: Meter,
                 on_event: Callable[[Event], None], wills: bool = False) -> None:
        self.machine = machine
        self.wills = wills  # status messages reach the machine (tools.scale: deterministic)
        self.gone_set = gone
        self.meter = meter
        self.offset = 0.0  # simulated seconds added to the transport's clock
        self._on_event = on_event

    def subscriptions(self) -> list[str]:
        return self.machine.subscriptions()

    def on_connect(self, now: float) -> list[Publish]:
        return self._out(self.machine.on_connect(now + self.offset), now)

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        if "/status/" in topic and not self.wills:
            return []
        return self._out(self.machine.on_message(topic, payload, now + self.offset), now)

    def on_tick(self, now: float) -> list[Publish]:
        return self._out(self.machine.on_tick(now + self.offset), now)

    def _out(self, out: list[Publish], now: float) -> list[Publish]:
        m = self.machine
        while self.gone_set:
            waiting = m.waiting_for
            deadline = m.deadline
            if not waiting or not waiting <= self.gone_set or deadline is None:
                break
            self.offset += max(0.0, deadline - (now + self.offset))
            out = out + m.on_tick(now + self.offset)
            if m.deadline == deadline and m.waiting_for == waiting:
                break  # the machine did not close the stage (e.g. just restored)
        for ev in m.take_events():
            self._on_event(ev)
        return _count(out, False, self.meter)


@dataclass(slots=True)
class _RoundRecord:
    round_id: int
    cohort: tuple[str, ...]
    started: float
    meter_before: dict[str, int]


def data_and_engine(cfg: SimConfig) -> tuple[Dataset, tuple[ModelSpec, Engine]]:
    """``cfg``'s dataset, and its model's spec with the engine that runs it (one engine for
    every simulated device of a process)."""
    data = load_dataset(cfg.dataset)
    spec = build_spec(cfg.model, data.input_shape, data.num_classes)
    return data, (spec, load_engine(manifest_path(spec.name, spec.input_shape,
                                                  spec.num_classes),
                                    backend=cfg.backend, threads=cfg.threads))


def aggregator_identity(seed: int, gateway: str | None = None) -> secagg.AggregatorIdentity:
    """The simulated fleet's aggregator key (seeded: simulation only), or gateway
    ``gateway``'s in a site (``tools.hierarchy``; the site knows its gateways' keys as a
    deployment's enrollment would tell it)."""
    label = "" if gateway is None else f"/gateway/{gateway}"
    return secagg.AggregatorIdentity.generate(
        random_bytes=seeded_bytes(f"fedge-fleet/{seed}/aggregator-id{label}"))


def initial_params(cfg: SimConfig, spec: ModelSpec) -> list[np.ndarray]:
    """The fleet's model version 0 (``init_params`` with the fleet's second seed)."""
    return init_params(spec, np.random.default_rng(np.random.SeedSequence(cfg.seed).spawn(3)[1]))


def shard_indices(cfg: SimConfig, data: Dataset) -> list[np.ndarray]:
    """Each device's training-set indices (``tools.partition`` with the fleet's first
    seed), in ``device_names`` order: what every simulated fleet of ``cfg`` holds."""
    part_rng = np.random.default_rng(np.random.SeedSequence(cfg.seed).spawn(3)[0])
    return partition(data.y_train, cfg.devices, cfg.partition, part_rng,
                     num_classes=data.num_classes)


class Fleet:
    """N devices and an aggregator, ready to run over ``inproc`` or ``mqtt``.

    Args:
        cfg: the simulation settings (``cfg.transport``, ``cfg.dropout`` and the round
            policy fields).
        workdir: where ledgers, the aggregator's checkpoint and the broker's files go.
        out: progress lines (when ``cfg.progress``).
        members: the 0-based indices (in the fleet of ``cfg.devices``) of the devices this
            aggregator serves (None: all): a gateway of a site (``tools.hierarchy``). Each
            device keeps its name, data shard, identity and seeds of the whole fleet.
        policy: the round policy (default ``round_policy(cfg, ...)``).
        upstream: the aggregator is a site's gateway (``RoundMachine(upstream=...)``).
        select: the round machine's cohort rule (``RoundMachine(select=...)``).
        schedule: the dropouts (an object with ``victims(round_id, cohort)``; default
            ``DropoutSchedule(cfg.dropout, cfg.seed)`` when ``cfg.dropout > 0``).
        share, start_gate: the round machine's (``RoundMachine(share=..., start_gate=...)``;
            default gate: every device checked in on the current model).
        budget: every device ledger's budget (default: ``cfg.budget_epsilon`` or
            :data:`FLEET_BUDGET_EPSILON` at ``cfg.delta``, no device-level limit).
    """

    def __init__(self, cfg: SimConfig, workdir: str | Path, *, out: TextIO | None = None,
                 data: Dataset | None = None, engine: tuple[ModelSpec, Engine] | None = None,
                 members: Sequence[int] | None = None, policy: RoundPolicy | None = None,
                 upstream: Upstream | None = None,
                 select: Callable[[Sequence[str], int], tuple[str, ...]] | None = None,
                 schedule: Any = None, share: str | None = None,
                 start_gate: Callable[[Mapping[str, CheckIn]], bool] | None = None,
                 budget: Budget | None = None) -> None:
        t0 = time.perf_counter()
        cfg.fleet_checks()
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.out = sys.stderr if out is None else out  # at call time: a replaced stderr
        self.data = load_dataset(cfg.dataset) if data is None else data
        if engine is None:
            spec = build_spec(cfg.model, self.data.input_shape, self.data.num_classes)
            engine = spec, load_engine(
                manifest_path(spec.name, spec.input_shape, spec.num_classes),
                backend=cfg.backend, threads=cfg.threads)
        self.spec, self.engine = engine
        everyone = device_names(cfg.devices)
        self.index = {n: i for i, n in enumerate(everyone)}
        self.names = everyone if members is None else [everyone[i] for i in members]
        self.upstream = upstream
        shards = shard_indices(cfg, self.data)
        sizes = [len(idx) for idx in shards]  # the whole fleet's public facts
        self.shards = {n: (self.data.x_train[shards[self.index[n]]],
                           self.data.y_train[shards[self.index[n]]]) for n in self.names}
        label = "" if upstream is None else f"/gateway/{upstream.gateway}"
        self.agg_id = aggregator_identity(cfg.seed, None if upstream is None
                                          else upstream.gateway)
        self.ids = {n: secagg.DeviceIdentity.generate(n, random_bytes=seeded_bytes(
            f"fedge-fleet/{cfg.seed}/id/{n}")) for n in self.names}
        self.registry = secagg.Registry.of(self.agg_id, list(self.ids.values()))
        self.budget = budget if budget is not None else Budget(
            epsilon=(FLEET_BUDGET_EPSILON if cfg.budget_epsilon is None
                     else cfg.budget_epsilon), delta=cfg.delta)
        self.policy = round_policy(cfg, sizes) if policy is None else policy
        self.initial = initial_params(cfg, self.spec)
        (self.workdir / "ledgers").mkdir(parents=True, exist_ok=True)
        self.store = CheckpointStore(self.workdir / "aggregator.ckpt")
        self.machine = RoundMachine(
            policy=self.policy, identity=self.agg_id, registry=self.registry,
            params=self.initial, random_bytes=round_random_bytes(cfg.seed) if upstream is None
            else seeded_bytes(f"fedge-fleet/{cfg.seed}/rounds{label}"),
            checkpoint=self.store.save,
            start_gate=self._all_checked_in if start_gate is None else start_gate,
            upstream=upstream, select=select, share=share)
        self.gone: set[str] = set()
        self.meter = Meter()
        self.schedule = schedule if schedule is not None else (
            DropoutSchedule(cfg.dropout, cfg.seed) if cfg.dropout > 0 else None)
        self.ledgers: dict[str, Ledger] = {}
        self.agents: dict[str, DeviceAgent] = {}
        for n in self.names:
            self.ledgers[n] = Ledger.open(self.ledger_path(n), budget=self.budget,
                                          device_id=n, create=True)
            self.agents[n] = DeviceAgent(n, self.new_session(n), fleet=FLEET_NAME,
                                         schedule=self.schedule, gone=self.gone,
                                         meter=self.meter)
        self.aggregator = AggregatorAgent(self.machine, gone=self.gone, meter=self.meter,
                                          on_event=self._note)
        self.records: dict[int, _RoundRecord] = {}
        self.outcomes: dict[int, RoundOutcome] = {}
        self._ended: list[RoundOutcome] = []  # rounds that ended, not yet recorded
        self._last_end: float | None = None  # when the last round was recorded
        self.broker_config: Any = None  # the MQTT run's broker (for measurements)
        self.broker: Any = None  # the MQTT run's tools.broker.Broker, while it runs
        self.rows: list[dict[str, Any]] = []
        self.eps_local = 0.0
        self.eps_aggregate = 0.0
        self.eps_device: float | None = 0.0  # None once any device's has no theorem
        self.setup_seconds = time.perf_counter() - t0
        self._acc = self._evaluate(self.initial)
        self._t_run = 0.0
        self.on_step: Callable[[], None] | None = None  # called between transport steps
        self.memory: MemoryBroker | None = None  # the inproc transport, while it runs
        self.loop: Any = None  # the MqttLoop, while the mqtt transport runs

    # -- building ----------------------------------------------------------------------

    def ledger_path(self, name: str) -> Path:
        return self.workdir / "ledgers" / f"{name}.db"

    def new_session(self, name: str, *, restart: int = 0) -> DeviceSession:
        """The device's session (``restart`` > 0: a new process, other key material)."""
        seed = device_seed(self.cfg.seed, self.index[name])
        x, y = self.shards[name]
        return DeviceSession(
            fleet=FLEET_NAME, identity=self.ids[name], registry=self.registry,
            ledger=self.ledgers[name], engine=self.engine, spec=self.spec,
            data=lambda: (x, y), round_rng=seeded_round_rng(seed),
            random_bytes=seeded_bytes(f"fedge-fleet/{self.cfg.seed}/dev/{name}/{restart}"))

    def restart_device(self, name: str) -> DeviceSession:
        """Crash + restart: close and reopen the ledger, a new session in the same agent."""
        self.ledgers[name].close()
        self.ledgers[name] = Ledger.open(self.ledger_path(name), budget=self.budget,
                                         device_id=name)
        s = self.new_session(name, restart=1)
        self.agents[name].replace_session(s)
        return s

    def _all_checked_in(self, checkins: Mapping[str, CheckIn]) -> bool:
        if len(checkins) < len(self.names):
            return False
        v = self.machine.model_version
        return all(c.model_version == v for c in checkins.values())

    def _out_of_budget(self) -> str | None:
        """The note that ends the fleet when, idle with every device checked in on the
        current model, too few can pay for a round (``round_core.too_few_eligible``)."""
        m = self.machine
        if m.stage != "idle" or not self._all_checked_in(m.checkins):
            return None
        why = m.out_of_budget
        return None if why is None else f"ended after {len(self.outcomes)} rounds: {why}"

    # -- observing ---------------------------------------------------------------------

    def _note(self, ev: Event) -> None:
        """A machine event: a round's start is timed and metered from here (its plans
        not yet counted); its end is recorded at the next :meth:`observe`."""
        if isinstance(ev, RoundStarted):
            self.records[ev.round_id] = _RoundRecord(
                round_id=ev.round_id, cohort=ev.cohort, started=time.perf_counter(),
                meter_before=self.meter.snapshot())
        elif isinstance(ev, RoundEnded):
            self._ended.append(ev.outcome)

    def _evaluate(self, params: list[np.ndarray]) -> float:
        return evaluate(self.engine, params, self.data.x_test, self.data.y_test,
                        self.cfg.eval_batch)

    def observe(self) -> bool:
        """Record rounds that ended, bring their vanished devices back; True when done."""
        if self.on_step is not None:
            self.on_step()
        if self._ended:
            ended, self._ended = self._ended, []
            for o in ended:
                self._record(o)
            for n in list(self.gone):
                self.agents[n].revive()
        return len(self.outcomes) >= self.cfg.rounds

    def _record(self, o: RoundOutcome) -> None:
        self.outcomes[o.round_id] = o
        self._last_end = time.perf_counter()
        rec = self.records.get(o.round_id)
        cohort = rec.cohort if rec else ()
        for n in cohort:
            spent = self.ledgers[n].spent()
            self.eps_local = max(self.eps_local, spent.local_epsilon)
            self.eps_aggregate = max(self.eps_aggregate, spent.aggregate_epsilon)
            self.eps_device = worst(self.eps_device, spent.device_epsilon)
        if o.completed and self.upstream is None:  # a gateway's model comes from its site
            self._acc = self._evaluate(self.machine.params)
        now = self.meter.snapshot()
        before = rec.meter_before if rec else {k: 0 for k in now}
        dropped = {n: a.vanished[o.round_id] for n, a in self.agents.items()
                   if o.round_id in a.vanished}
        row = {
            "round": o.round_id, "completed": o.completed, "detail": o.detail,
            "cohort": len(cohort), "survivors": len(o.survivors),
            "dropped": dict(sorted(dropped.items())), "model_version": o.model_version,
            "accuracy": self._acc,
            "wall_seconds": time.perf_counter() - rec.started if rec else None,
            "bytes": {k: now[k] - before[k] for k in now},
            "epsilon_local": _finite(self.eps_local),
            "epsilon_aggregate": _finite(self.eps_aggregate),
            "epsilon_device": _finite_or_none(self.eps_device),
            "sum_sha256": None if o.total is None else sum_sha256(o.total),
        }
        self.rows.append(row)
        if self.cfg.progress:
            state = "done  " if o.completed else "FAILED"
            self.out.write(
                f"[{self.cfg.transport}] round {o.round_id:>4}/{self.cfg.rounds} {state} "
                f"survivors {len(o.survivors):>4}/{len(cohort):<4} dropped {len(dropped):>3} "
                f"acc {self._acc:.4f} eps sample-level local {self.eps_local:.3f} "
                + ("" if self.eps_device is None else
                   f"eps device-level {self.eps_device:.3f} ")
                + f"{time.perf_counter() - self._t_run:7.1f}s"
                + ("" if o.completed else f"  ({o.detail})") + "\n")
            self.out.flush()

    # -- running -----------------------------------------------------------------------

    def run(self, *, broker_options: Mapping[str, Any] | None = None,
            until: Callable[[], bool] | None = None, patience: float | None = None
            ) -> dict[str, Any]:
        """Run ``cfg.rounds`` rounds over ``cfg.transport``; return the summary.

        MQTT only: ``broker_options`` go to ``tools.broker.Broker`` (a gateway's bridge
        and listeners, ``tools.hierarchy``); ``until``: stop when it returns True instead
        of after ``cfg.rounds`` rounds (a gateway runs until its site is done), giving up
        after ``patience`` seconds without a round ending (default from the stage
        timeout)."""
        self._t_run = time.perf_counter()
        note = ""
        if self.cfg.transport == "mqtt":
            note = self._run_mqtt(broker_options or {}, until, patience)
        else:
            note = self._run_inproc()
        return self._summary(time.perf_counter() - self._t_run, note)

    def _run_inproc(self) -> str:
        broker = MemoryBroker()
        self.memory = broker
        now = 0.0
        broker.attach(AGGREGATOR, self.aggregator, now)
        for n in self.names:
            broker.attach(n, self.agents[n], now)
        quiet = 0
        while True:
            broker.run(now)
            if self.observe():
                return ""
            before = len(broker.sent)
            broker.tick(now)
            if self.observe():
                return ""
            if len(broker.sent) == before:
                # every message delivered: if too few can pay for a round, it is over
                why = self._out_of_budget()
                if why:
                    return why
                # nothing happens: let time pass to the next deadline
                quiet += 1
                if quiet > 8:
                    return (f"stalled after {len(self.outcomes)} rounds: no round could "
                            "start (too few devices with budget left?)")
                now += self.policy.stage_timeout
            else:
                quiet = 0
                now += _TICK_S

    def _run_mqtt(self, broker_options: Mapping[str, Any],
                  until: Callable[[], bool] | None, patience: float | None) -> str:
        from edge_sdk.mqtt import BrokerAddress, ClientConfig, MqttLoop
        from tools.broker import Broker

        cfg = self.cfg
        def done() -> bool:  # observe() records ended rounds and revives devices: always call
            finished = self.observe()
            return finished if until is None else until()

        with Broker(devices=self.names, fleet=FLEET_NAME, aggregator=AGGREGATOR,
                    directory=self.workdir / "broker", **broker_options) as broker:
            self.broker = broker
            bc = broker.config
            self.broker_config = bc  # for measurements against the same broker (bench)
            address = BrokerAddress(host=bc.host, port=bc.port,
                                    ca_file=str(bc.ca_file) if bc.ca_file else None)
            with MqttLoop(address, rng=random.Random(cfg.seed)) as loop:
                self.loop = loop
                loop.add(ClientConfig(username=AGGREGATOR, password=bc.password(AGGREGATOR),
                                      max_inflight=100), self.aggregator)
                if not loop.run(until=lambda: loop.is_ready(AGGREGATOR), timeout=30):
                    return "the aggregator could not connect to the broker"
                for n in self.names:
                    self.agents[n].on_vanish = loop.drop
                    loop.add(ClientConfig(username=n, password=bc.password(n),
                                          status_topic=wire.status_topic(FLEET_NAME, n),
                                          backoff_initial_s=0.05, backoff_max_s=1.0),
                             self.agents[n])
                # a round never waits longer than its stages' deadlines; past that it stalled
                if patience is None:
                    patience = 5 * cfg.stage_timeout + 60.0
                while True:
                    seen = len(self.outcomes)
                    ok = loop.run(until=lambda s=seen: done() or len(self.outcomes) > s
                                  or self._out_of_budget() is not None, timeout=patience)
                    if done():
                        return ""
                    why = self._out_of_budget()
                    if why:
                        return why
                    if not ok:
                        return (f"stalled after {len(self.outcomes)} rounds: nothing ended "
                                f"for {patience:.0f} s")

    def _summary(self, wall: float, note: str) -> dict[str, Any]:
        cfg = self.cfg
        for led in self.ledgers.values():
            spent = led.spent()
            self.eps_local = max(self.eps_local, spent.local_epsilon)
            self.eps_aggregate = max(self.eps_aggregate, spent.aggregate_epsilon)
            self.eps_device = worst(self.eps_device, spent.device_epsilon)
        m = self.meter
        uploads = sum(len(o.survivors) for o in self.outcomes.values())
        params = self.machine.params
        d = sum(p.size for p in params)
        done = [r for r in self.rows if r["completed"]]
        return {
            "transport": cfg.transport,
            "secagg": True,
            "final_accuracy": self._acc,
            "accuracy_per_round": [r["accuracy"] for r in self.rows],
            "rounds": self.rows,
            "rounds_completed": len(done),
            "rounds_failed": len(self.rows) - len(done),
            "note": note,
            "model_version": self.machine.model_version,
            "model_sha256": model_sha256(params),
            "epsilon": _finite(self.eps_local),
            "epsilon_aggregate": _finite(self.eps_aggregate),
            "epsilon_per_round": [r["epsilon_local"] for r in self.rows],
            "epsilon_aggregate_per_round": [r["epsilon_aggregate"] for r in self.rows],
            "epsilon_device": _finite_or_none(self.eps_device),
            "epsilon_device_per_round": [r["epsilon_device"] for r in self.rows],
            "device_level_epsilon": {n: _finite_or_none(led.spent().device_epsilon)
                                     for n, led in sorted(self.ledgers.items())},
            "epsilon_note": EPSILON_NOTE,
        # what the aggregate figures assume, resolved (None in the config: the threshold)
        "min_survivors": self.policy.survivors_needed(self.policy.cohort_size),
        "max_colluders": self.policy.max_colluders,
            "paper_epsilon": None,
            "delta": cfg.delta,
            "bytes_up_total": m.up_packets,
            "bytes_up_payload": m.up_payload,
            "bytes_up_overhead": m.up_packets - m.up_payload,
            "bytes_up_messages": m.up_messages,
            "bytes_down_total": m.down_packets,
            "bytes_down_payload": m.down_payload,
            "bytes_down_messages": m.down_messages,
            "bytes_delivered_to_devices": m.delivered_payload,
            "bytes_up_per_upload": m.up_packets / uploads if uploads else None,
            "bytes_up_float32_per_upload": 4 * d,
            "device_rounds": uploads,
            "num_params": d,
            "setup_seconds": self.setup_seconds,
            "wall_seconds": wall,
            # the rounds alone: first round's start to the last round's end (without the
            # broker's start and the fleet's connects, which a long-running fleet pays once)
            "rounds_wall_seconds": self._rounds_wall(),
            "config": cfg.as_dict(),
        }

    def _rounds_wall(self) -> float | None:
        starts = [r.started for r in self.records.values()]
        end = self._last_end
        return None if not starts or end is None else end - min(starts)

    def check_sums(self) -> None:
        """Every completed round's integer sum is its survivors' encoded inputs summed
        mod 2^bits (the devices keep their inputs of the last few rounds)."""
        d = sum(p.size for p in self.initial)
        for o in self.outcomes.values():
            if not o.completed or o.total is None:
                continue
            # the round's ring (ddg's bits depend on the cohort's size)
            _, _, bits = mechanism_params(self.policy, dim=d,
                                          cohort_size=len(self.records[o.round_id].cohort))
            mask = np.uint64((1 << bits) - 1)
            want = np.zeros_like(o.total)
            for n in o.survivors:
                x = self.agents[n].session.encoded_input(o.round_id)
                if x is None:
                    raise AssertionError(f"{n} kept no input of round {o.round_id}")
                want = want + x
            if not np.array_equal(o.total, want & mask):
                raise AssertionError(f"round {o.round_id}: the sum is not the survivors'")

    def close(self) -> None:
        for led in self.ledgers.values():
            led.close()


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _finite_or_none(v: float | None) -> float | None:
    """A JSON-safe epsilon: None for none stated or infinite."""
    return v if v is not None and math.isfinite(v) else None


def simulate_fleet(cfg: SimConfig, *, workdir: str | Path | None = None,
                   out: TextIO | None = None) -> dict[str, Any]:
    """Build a :class:`Fleet` and run it; the summary (JSON-able). Without ``workdir`` the
    ledgers, checkpoint and broker files live in a temporary directory."""
    if workdir is not None:
        fleet = Fleet(cfg, workdir, out=out)
        try:
            return fleet.run()
        finally:
            fleet.close()
    with tempfile.TemporaryDirectory(prefix="fedge-fleet-") as tmp:
        fleet = Fleet(cfg, tmp, out=out)
        try:
            return fleet.run()
        finally:
            fleet.close()
