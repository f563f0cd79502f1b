"""A site of gateways, simulated with the deployed objects (issue 19; ``aggregator.site``).

:class:`Hierarchy` splits a simulated fleet of ``cfg.devices`` devices into ``gateways``
contiguous groups. Each group is a :class:`tools.fleet.Fleet` whose round machine is a
gateway (``RoundMachine(upstream=...)``, cohorts of ``cfg.cohort_size`` of its own
devices, ``sum_cohort`` = gateways x cohort_size); above them a
:class:`aggregator.site.SiteMachine`. Each device keeps its name, data shard, identity and
seeds of the whole fleet, so :meth:`Hierarchy.flat_twin` can build the same fleet as one
flat gateway whose cohort each round is the union of the gateways' cohorts (the same
stratified draw) with the same dropouts: the two runs' final models agree bit for bit
(``tests/test_hierarchy.py``), because the site's sum of the gateways' sums is the flat
round's sum.

Transport ``inproc``: one :class:`tools.inproc.MemoryBroker` per gateway and one for the
site, joined by :class:`MemoryBridge` s that forward exactly what a mosquitto bridge's
``topic`` lines forward (the gateway's uplink to the site, the site's retained round and
model down). A gateway can be killed at a stage of a round (``kill``): its broker stops
delivering and its bridge stops forwarding, as when its mosquitto dies; it comes back
after that site round ends.

Dropouts: gateway g drops devices with ``DropoutSchedule(cfg.dropout, cfg.seed + g + 1)``
over its own cohort (:class:`StratifiedDropouts` gives the flat twin the same victims).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aggregator.round_core import RoundPolicy, draw_cohort
from aggregator.site import (
    SiteMachine,
    SiteOutcome,
    SitePolicy,
    SiteRoundEnded,
    Upstream,
)
from edge_sdk import secagg, wire
from edge_sdk.wire import Publish
from tools.datasets import Dataset
from tools.dropouts import DropoutSchedule
from tools.evaluate import evaluate
from tools.fleet import DROP_STAGES, Fleet, data_and_engine, shard_indices
from tools.inproc import MemoryBroker
from tools.seeding import round_random_bytes, seeded_bytes
from tools.simconfig import SimConfig, round_policy
from tools.summary import model_sha256

__all__ = ["SITE", "SITE_NAME", "Hierarchy", "MachineAgent", "MemoryBridge", "SiteAgent",
           "StratifiedDropouts", "gateway_names", "gateway_policy", "groups", "site_identity",
           "stratified_select"]

SITE_NAME = "site"
SITE = "site-aggregator"
_TICK_S = 0.1


def gateway_names(n: int) -> list[str]:
    """``gw-0`` ... ``gw-<n-1>``."""
    return [f"gw-{g}" for g in range(n)]


def groups(devices: int, gateways: int) -> list[list[int]]:
    """Contiguous device indices per gateway (sizes differ by at most one)."""
    if gateways < 1 or devices < gateways:
        raise ValueError(f"need 1 <= gateways <= devices, got {gateways} gateways for "
                         f"{devices} devices")
    return [list(a) for a in np.array_split(np.arange(devices), gateways)]


def stratified_select(groups: Sequence[Sequence[str]], policy: RoundPolicy, *,
                      skip: Mapping[int, set[int]] | None = None):  # noqa: ANN201
    """A ``RoundMachine(select=...)`` rule: each group's cohort is what its gateway draws
    (``round_core.draw_cohort`` over the group's eligible devices under the gateways'
    ``policy``); the round's cohort is their union. ``skip``: round -> groups left out
    (a gateway lost in that round)."""
    sets = [set(g) for g in groups]

    def select(eligible: Sequence[str], round_id: int) -> tuple[str, ...]:
        out: list[str] = []
        for i, members in enumerate(sets):
            if skip and i in skip.get(round_id, set()):
                continue
            mine = [e for e in eligible if e in members]
            if mine:
                out += draw_cohort(mine, policy=policy, round_id=round_id)
        return tuple(sorted(out))

    return select


class StratifiedDropouts:
    """The flat twin's dropouts: each group's victims drawn as its gateway draws them
    (its own ``DropoutSchedule`` over the group's part of the cohort)."""

    def __init__(self, groups: Sequence[Sequence[str]], schedules: Sequence[DropoutSchedule]
                 ) -> None:
        self._groups = [set(g) for g in groups]
        self._schedules = list(schedules)

    def victims(self, round_id: int, cohort: Sequence[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for members, sched in zip(self._groups, self._schedules, strict=True):
            part = [c for c in cohort if c in members]
            if part:
                out.update(sched.victims(round_id, part))
        return out


def site_identity(seed: int) -> secagg.AggregatorIdentity:
    """The simulated site's signing key (seeded: simulation only)."""
    return secagg.AggregatorIdentity.generate(
        random_bytes=seeded_bytes(f"fedge-fleet/{seed}/site-id"))


def gateway_policy(cfg: SimConfig, data: Dataset, gateways: int) -> RoundPolicy:
    """The gateways' round policy, one for all and the site's template: each gateway's
    cohort ``cfg.participation`` of its devices, the grid and ring sized for the site's
    total cohort (``RoundPolicy.sum_cohort``)."""
    sizes = [len(i) for i in shard_indices(cfg, data)]
    n = max(3, round(cfg.participation * min(len(g) for g in groups(cfg.devices, gateways))))
    return dataclasses.replace(round_policy(cfg, sizes), cohort_size=n, sum_cohort=gateways * n)


class MemoryBridge:
    """What a mosquitto bridge between a gateway's broker and the site's forwards, in
    memory: the gateway's uplink (``fedge/<site>/gw/<gw>/up/#``, out) and the site's
    topics (``fedge/<site>/site/#``, in, retained kept). ``alive`` False: the gateway's
    broker is down, nothing crosses."""

    def __init__(self, *, site: str, gateway: str, local: MemoryBroker,
                 remote: MemoryBroker) -> None:
        self.site, self.gateway = site, gateway
        self.local, self.remote = local, remote
        self.alive = True
        self.name = f"bridge-{gateway}"
        outer = self

        class _Out:  # attached to the gateway's broker
            def subscriptions(self) -> list[str]:
                return [f"{wire.fleet_topic(site)}/gw/{gateway}/up/#"]

            def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
                if outer.alive:
                    remote.publish(outer.name, Publish(topic, payload))
                return []

            def on_tick(self, now: float) -> list[Publish]:
                return []

        class _In:  # attached to the site's broker
            def subscriptions(self) -> list[str]:
                return [f"{wire.fleet_topic(site)}/site/#"]

            def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
                if outer.alive:
                    local.publish(outer.name, Publish(topic, payload, retain=True))
                return []

            def on_tick(self, now: float) -> list[Publish]:
                return []

        self.outward, self.inward = _Out(), _In()


class MachineAgent:
    """A transport endpoint around a sans-I/O machine (``SiteMachine``, ``RoundMachine``):
    its four endpoint methods, and each of its events handed to ``on_event`` before the
    call's messages go out (so a driver can subscribe before a round's plans leave)."""

    def __init__(self, machine: Any, on_event: Any = None) -> None:
        self.machine = machine
        self.on_event = on_event

    def subscriptions(self) -> list[str]:
        return self.machine.subscriptions()

    def on_connect(self, now: float) -> list[Publish]:
        return self._out(self.machine.on_connect(now))

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        return self._out(self.machine.on_message(topic, payload, now))

    def on_tick(self, now: float) -> list[Publish]:
        return self._out(self.machine.on_tick(now))

    def _out(self, out: list[Publish]) -> list[Publish]:
        for ev in self.machine.take_events():
            self.event(ev)
        return out

    def event(self, ev: Any) -> None:
        if self.on_event is not None:
            self.on_event(ev)


class SiteAgent(MachineAgent):
    """The site endpoint: the machine, the outcomes of its ended rounds collected."""

    def __init__(self, machine: SiteMachine) -> None:
        super().__init__(machine)
        self.ended: list[SiteOutcome] = []

    def event(self, ev: Any) -> None:
        if isinstance(ev, SiteRoundEnded):
            self.ended.append(ev.outcome)


class Hierarchy:
    """``gateways`` gateway fleets under one site (module docstring).

    Args:
        cfg: the fleet's settings: ``cfg.devices`` in all, each gateway's cohort
            ``cfg.participation`` of its devices, ``cfg.rounds`` site rounds;
            ``cfg.transport`` must be ``inproc``.
        gateways: how many gateways (>= 1).
        round_timeout: the site's wait for gateway sums (simulated seconds).
        kill: (site round, gateway index, stage) -> that gateway's broker dies when its
            round reaches the stage (a ``tools.fleet.DROP_STAGES`` stage name, or
            ``"forward"``: just before its sum leaves); it is back for the next round.
    """

    def __init__(self, cfg: SimConfig, workdir: str | Path, *, gateways: int,
                 round_timeout: float = 600.0,
                 kill: tuple[int, int, str] | None = None) -> None:
        if cfg.transport != "inproc":
            raise ValueError(f"the hierarchy simulates transport 'inproc', got {cfg.transport!r}")
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.data, self.engine = data_and_engine(cfg)
        self.groups = groups(cfg.devices, gateways)
        self.names = gateway_names(gateways)
        self.site_id = site_identity(cfg.seed)
        self.policy = gateway_policy(cfg, self.data, gateways)
        self.schedules = [DropoutSchedule(cfg.dropout, cfg.seed + g + 1) if cfg.dropout > 0
                          else None for g in range(gateways)]
        self.fleets: list[Fleet] = []
        for g, (name, members) in enumerate(zip(self.names, self.groups, strict=True)):
            up = Upstream(site=SITE_NAME, gateway=name, site_key=self.site_id.public_key)
            self.fleets.append(Fleet(cfg, self.workdir / name, data=self.data,
                                     engine=self.engine, members=members, policy=self.policy,
                                     upstream=up, schedule=self.schedules[g]))
        self.initial = self.fleets[0].initial
        self.site = SiteMachine(
            policy=SitePolicy(site=SITE_NAME, round_timeout=round_timeout),
            round_policy=self.policy, identity=self.site_id,
            gateways={n: f.agg_id.public_key for n, f in zip(self.names, self.fleets,
                                                              strict=True)},
            params=self.initial, random_bytes=round_random_bytes(cfg.seed))
        self.kill = kill
        self.killed: dict[int, int] = {}  # site round -> gateway lost in it
        self._down: int | None = None  # the gateway whose broker is down

    # -- the flat twin -------------------------------------------------------------------

    def flat_twin(self, workdir: str | Path) -> Fleet:
        """The same devices as one flat gateway: cohort = the union of what the gateways
        draw (rounds in which a gateway was lost leave its group out), the same dropouts,
        under the gateways' policy with the site's total cohort."""
        members = [list(f.names) for f in self.fleets]
        total = sum(len(m) for m in members)
        policy = dataclasses.replace(self.policy, cohort_size=min(
            total, len(self.fleets) * self.policy.cohort_size), sum_cohort=None)
        skip = {r: {g} for r, g in self.killed.items()}
        scheds = [s for s in self.schedules if s is not None]
        schedule = (StratifiedDropouts(members, [DropoutSchedule(s.fraction, s.seed)
                                                 for s in scheds]) if scheds else None)
        return Fleet(self.cfg, workdir, data=self.data, engine=self.engine, policy=policy,
                     select=stratified_select(members, self.policy, skip=skip),
                     schedule=schedule)

    def run_flat_twin(self, workdir: str | Path) -> dict[str, Any]:
        """:meth:`flat_twin` run (after :meth:`run`), closed; its summary."""
        twin = self.flat_twin(workdir)
        try:
            return twin.run()
        finally:
            twin.close()

    # -- running -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        site_broker = MemoryBroker()
        agent = SiteAgent(self.site)
        brokers: list[MemoryBroker] = []
        bridges: list[MemoryBridge] = []
        now = 0.0
        site_broker.attach(SITE, agent, now)
        for name, fleet in zip(self.names, self.fleets, strict=True):
            b = MemoryBroker()
            bridge = MemoryBridge(site=SITE_NAME, gateway=name, local=b, remote=site_broker)
            b.attach("aggregator", fleet.aggregator, now)
            for n in fleet.names:
                b.attach(n, fleet.agents[n], now)
            b.attach(bridge.name, bridge.outward, now)
            site_broker.attach(bridge.name, bridge.inward, now)
            brokers.append(b)
            bridges.append(bridge)
            fleet.memory = b
        self._arm_kill(brokers, bridges)
        quiet = 0
        while len(agent.ended) < self.cfg.rounds:
            sent = sum(len(b.sent) for b in (site_broker, *brokers))
            for _ in range(2):
                site_broker.run(now)
                for g, b in enumerate(brokers):
                    if g != self._down:
                        b.run(now)
            for f in self.fleets:
                f.observe()
            self._revive(agent, bridges)
            site_broker.tick(now)
            for g, b in enumerate(brokers):
                if g != self._down:
                    b.tick(now)
            if sum(len(b.sent) for b in (site_broker, *brokers)) == sent:
                quiet += 1
                if quiet > 20:
                    raise RuntimeError(f"the hierarchy stalled after {len(agent.ended)} "
                                       "site rounds")
                now += self.policy.stage_timeout
                if self._down is not None and self.site.deadline is not None:
                    now = max(now, self.site.deadline)  # only the lost gateway is awaited
            else:
                quiet = 0
                now += _TICK_S
        return self._summary(agent.ended, time.perf_counter() - t0)

    def _arm_kill(self, brokers: list[MemoryBroker], bridges: list[MemoryBridge]) -> None:
        """At the kill's round and stage, the gateway's broker goes down: nothing more is
        delivered on it and its bridge forwards nothing, until the site round ends."""
        if self.kill is None:
            return
        r_kill, g, stage = self.kill
        kinds = DROP_STAGES  # the stage -> the downlink kind that opens it
        b = brokers[g]
        previous = b.drop
        site_round = wire.gateway_up_topic(SITE_NAME, self.names[g], "gateway_sum")

        def drop(name: str, topic: str, payload: bytes) -> bool:
            if self._down == g:
                return True
            hit = False
            if stage == "forward":
                hit = topic == site_round
            elif topic.endswith("/down/" + kinds[stage]):
                try:
                    head = wire.peek(payload, wire.DOWN_KINDS)
                    hit = head.round == r_kill
                except Exception:  # noqa: BLE001 (not a round message: no kill)
                    hit = False
            if hit and self.site.open_round == r_kill:
                self._down = g
                self.killed[r_kill] = g
                bridges[g].alive = False
                return True
            return previous(name, topic, payload)

        b.drop = drop

    def _revive(self, agent: SiteAgent, bridges: list[MemoryBridge]) -> None:
        """The killed gateway's broker restarts once its site round has ended: what it
        held in memory is lost, and its bridge brings the site's retained round and model
        again (its machine then fails the stale round and adopts the newer model)."""
        if self._down is None or self.kill is None:
            return
        if not any(o.round_id == self.kill[0] for o in agent.ended):
            return
        g, self._down = self._down, None
        bridge = bridges[g]
        bridge.alive = True
        bridge.local.queue.clear()
        for topic, payload in sorted(bridge.remote.retained.items()):
            if topic.startswith(f"{wire.fleet_topic(SITE_NAME)}/site/"):
                bridge.local.publish(bridge.name, Publish(topic, payload, retain=True))

    def _summary(self, ended: list[SiteOutcome], wall: float) -> dict[str, Any]:
        spec, engine = self.engine
        params = self.site.params
        acc = evaluate(engine, params, self.data.x_test, self.data.y_test, self.cfg.eval_batch)
        return {
            "gateways": len(self.fleets),
            "rounds": [{"round": o.round_id, "completed": o.completed,
                        "gateways": list(o.gateways), "missing": dict(o.missing),
                        "survivors": o.survivors, "model_version": o.model_version,
                        "detail": o.detail} for o in ended],
            "killed": {str(r): self.names[g] for r, g in self.killed.items()},
            "model_version": self.site.model_version,
            "model_sha256": model_sha256(params),
            "final_accuracy": acc,
            "wall_seconds": wall,
        }

    def close(self) -> None:
        for f in self.fleets:
            f.close()
