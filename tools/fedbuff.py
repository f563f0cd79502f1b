"""Buffered asynchronous rounds (FedBuff) against synchronous ones, on a simulated clock
under a stated availability model (issue 19).

Both runs drive the deployed code: every device is an ``edge_sdk.session.DeviceSession``
with its durable ledger, the aggregator an ``aggregator.rounds.RoundMachine`` (synchronous
by default, ``RoundPolicy(buffered=True)`` for FedBuff), routed by
``tools.inproc.MemoryBroker`` (MQTT topic matching, retained messages). Only time is
simulated, by an event queue: what this module adds is *when* each endpoint's messages
leave, under :class:`Availability`:

* **online / offline**: device i alternates online and offline periods drawn from
  exponential distributions (means ``online_mean_s`` and ``offline_mean_s``, its own
  seeded stream; it starts online with the stationary probability). Going offline it
  disconnects (nothing reaches it; what it would send is lost); its last will
  ("offline" on its status topic, which withdraws its check-in) reaches the aggregator
  ``will_delay_s`` later unless it is back by then (the broker's keep-alive detection).
  Coming back it reconnects: retained model and offer, then ``on_connect`` (check-in, and
  in buffered rounds the Ready of an update it holds). A device keeps its state across
  the gap (it lost connectivity, not memory).
* **compute**: device i's local round takes ``train_median_s x LogNormal(0,
  speed_sigma)`` seconds (its own seeded draw, fixed for the run: slow devices stay
  slow). A device trains when its session trains (a synchronous plan; an update trained
  ahead, ``TrainedAhead``); while it trains its outputs wait (a device busy until t sends
  nothing before t). Everything else a device does is instantaneous in this model.
* **network**: each message takes ``latency_s`` to arrive.
* **aggregator**: instantaneous. Its CPU time here (a few ms per message, SecAgg
  included) is well below one message's latency; measuring it into the clock would make a
  run depend on the machine's load, and a run must be a function of its seeds.

The accuracy curve is the model's test accuracy after every completed round, at the
simulated time the model was published. "Reaches the target" means: the mean accuracy of
the last ``window`` models is at least ``target`` (one noisy model is not a level).

Privacy: both runs use the same mechanism (``device-dp``), the same per-round settings
(clip S, noise multiplier z, cohort/buffer size K, min_survivors, colluders) and the same
device-level budget in every ledger: each participation reserves the same device-level
event, so both fleets carry the same guarantee per device; the reported epsilons are each
run's largest device-level spend (``Ledger.spent().device_epsilon``) when it reached the
target. A buffered member's update is weighted by (1 + tau)^-a <= 1 before noise, which
does not change its event (``edge_sdk.round.open_buffered``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from aggregator.rounds import RoundEnded, RoundMachine, RoundStarted
from edge_sdk import wire
from edge_sdk.ledger import Book, Budget, Ledger
from edge_sdk.session import DeviceSession, RoundOpened, TrainedAhead
from edge_sdk.wire import Publish
from tools.fleet import Fleet, data_and_engine, shard_indices
from tools.inproc import MemoryBroker
from tools.simconfig import FLEET_NAME, SimConfig, round_policy

__all__ = ["Availability", "TimedRun", "compare_fedbuff", "device_epsilon_after", "run_timed"]

AGGREGATOR = "aggregator"
_AGG_TICK_S = 1.0  # the aggregator's tick (deadlines, re-sends, round starts)
_DEVICE_TICK_S = 10.0  # the devices' tick (a session gives up on a silent round)


@dataclass(frozen=True, slots=True, kw_only=True)
class Availability:
    """The stated availability, compute and network model (module docstring; seconds)."""

    online_mean_s: float = 600.0
    offline_mean_s: float = 1200.0
    train_median_s: float = 30.0
    speed_sigma: float = 0.7
    latency_s: float = 0.25
    will_delay_s: float = 20.0
    seed: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "seed" and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{f.name} must be finite and >= 0, got {v!r}")
        if not (self.online_mean_s > 0 and self.offline_mean_s >= 0):
            raise ValueError("online_mean_s must be > 0")

    @property
    def online_fraction(self) -> float:
        """The stationary probability that a device is online."""
        return self.online_mean_s / (self.online_mean_s + self.offline_mean_s)

    def train_seconds(self, device: int) -> float:
        """Device ``device``'s local round time (fixed for the run)."""
        rng = np.random.default_rng([self.seed, 1, device])
        return float(self.train_median_s * rng.lognormal(0.0, self.speed_sigma))

    def periods(self, device: int, horizon: float) -> list[tuple[float, float]]:
        """Device ``device``'s online periods [start, end) up to ``horizon``."""
        rng = np.random.default_rng([self.seed, 2, device])
        t, online = 0.0, bool(rng.random() < self.online_fraction)
        out: list[tuple[float, float]] = []
        while t < horizon:
            mean = self.online_mean_s if online else self.offline_mean_s
            d = float(rng.exponential(mean)) if mean > 0 else 0.0
            if online:
                out.append((t, min(t + d, horizon)))
            t += d
            online = not online
        return out


class _Timed:
    """An endpoint whose outputs leave when the model says (module docstring)."""

    def __init__(self, run: TimedRun, name: str, inner: Any, train_s: float) -> None:
        self.run, self.name, self.inner, self.train_s = run, name, inner, train_s

    def subscriptions(self) -> list[str]:
        return self.inner.subscriptions()  # type: ignore[no-any-return]

    def on_connect(self, now: float) -> list[Publish]:
        return self._out(lambda: self.inner.on_connect(now), now)

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        return self._out(lambda: self.inner.on_message(topic, payload, now), now)

    def on_tick(self, now: float) -> list[Publish]:
        return self._out(lambda: self.inner.on_tick(now), now)

    def _out(self, call: Callable[[], list[Publish]], now: float) -> list[Publish]:
        run = self.run
        start = max(now, run.busy.get(self.name, now))
        out = call()
        if self.name == AGGREGATOR:
            done = start
            run.note_aggregator(done)
        else:
            events = self.inner.take_events()
            trained = any(isinstance(e, TrainedAhead) or (
                isinstance(e, RoundOpened) and not run.buffered) for e in events)
            done = start + (self.train_s if trained else 0.0)
            run.trainings += trained
        run.busy[self.name] = done
        if out:
            run.schedule(done + run.av.latency_s, "send", self.name, out)
        return []  # they leave from the event queue


class TimedRun:
    """One fleet on the simulated clock (module docstring).

    Args:
        fleet: a built ``tools.fleet.Fleet`` (its sessions and machine are driven here; its
            own transports are not used).
        availability: the model.
        target: the test accuracy to reach; window: models averaged for it.
        horizon_s: simulated seconds after which the run stops anyway.
        out: a progress line per completed round (None: quiet).
    """

    def __init__(self, fleet: Fleet, availability: Availability, *, target: float,
                 horizon_s: float, window: int = 3, out: TextIO | None = None) -> None:
        self.fleet, self.av, self.target, self.horizon = fleet, availability, target, horizon_s
        self.window, self.out = window, out
        self.buffered = fleet.policy.buffered
        self.machine: RoundMachine = fleet.machine
        self.broker = MemoryBroker()
        self.heap: list[tuple[float, int, str, str, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.busy: dict[str, float] = {}
        self.online: set[str] = set()
        self.trainings = 0
        self.sessions: dict[str, DeviceSession] = {n: fleet.new_session(n)
                                                   for n in fleet.names}
        self.curve: list[dict[str, Any]] = []  # one row per completed round
        self.staleness: list[int] = []  # buffered: each member's tau
        self.reached_at: float | None = None
        self.broker.attach(AGGREGATOR, _Timed(self, AGGREGATOR, self.machine, 0.0), 0.0)
        for n in fleet.names:
            for start, end in availability.periods(fleet.index[n], horizon_s):
                self.schedule(start, "online", n, None)
                self.schedule(end, "offline", n, None)
        self.schedule(0.0, "tick", AGGREGATOR, 0)

    def schedule(self, t: float, what: str, name: str, arg: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, what, name, arg))

    def note_aggregator(self, done: float) -> None:
        """Take the machine's events: rounds started (staleness) and ended (accuracy)."""
        for e in self.machine.take_events():
            if isinstance(e, RoundStarted) and self.buffered:
                for d in e.cohort:
                    s = self.sessions[d]
                    if s.held_version is not None:
                        self.staleness.append(e.model_version - s.held_version)
            if isinstance(e, RoundEnded) and e.outcome.completed:
                acc = self.fleet._evaluate(self.machine.params)
                # every reservation is the same event: the most spent is the most counted
                most = max(len(led.reservations()) for led in self.fleet.ledgers.values())
                self.curve.append({"t": done, "round": e.outcome.round_id,
                                   "version": e.outcome.model_version,
                                   "survivors": len(e.outcome.survivors), "accuracy": acc,
                                   "max_participations": most})
                if self.out is not None:
                    print(f"  {'buffered' if self.buffered else 'sync':8s} t={done:8.0f} s "
                          f"round {e.outcome.round_id:3d} model {e.outcome.model_version:3d} "
                          f"acc {acc:.3f} ({len(e.outcome.survivors)} in the sum)",
                          file=self.out, flush=True)
                accs = [r["accuracy"] for r in self.curve[-self.window:]]
                if self.reached_at is None and len(accs) == self.window \
                        and float(np.mean(accs)) >= self.target:
                    self.reached_at = done

    def run(self) -> dict[str, Any]:
        """Until the target is reached or the horizon passes; the run's figures."""
        t0 = time.perf_counter()
        while self.heap and self.reached_at is None:
            t, _, what, name, arg = heapq.heappop(self.heap)
            if t > self.horizon:
                break
            self.now = t
            if what == "tick":
                devices = arg % int(_DEVICE_TICK_S / _AGG_TICK_S) == 0
                self.broker.tick(t, [AGGREGATOR, *(sorted(self.online) if devices else [])])
                self.schedule(t + _AGG_TICK_S, "tick", AGGREGATOR, arg + 1)
            elif what == "online":
                self.online.add(name)
                self.busy[name] = max(self.busy.get(name, t), t)
                self.broker.attach(name, _Timed(self, name, self.sessions[name],
                                                self.av.train_seconds(
                                                    self.fleet.index[name])), t)
            elif what == "offline":
                if name in self.online:
                    self.online.discard(name)
                    self.broker.detach(name)
                    self.schedule(t + self.av.will_delay_s, "will", name, None)
            elif what == "will":
                if name not in self.online:
                    self.broker.publish(name, Publish(wire.status_topic(FLEET_NAME, name),
                                                      b"offline"))
            elif what == "send":
                if name != AGGREGATOR and name not in self.online:
                    continue  # it went offline before this left: lost
                for p in arg:
                    self.broker.publish(name, p)
            self.broker.run(t)
        return self.summary(time.perf_counter() - t0)

    def summary(self, wall: float) -> dict[str, Any]:
        ledgers = self.fleet.ledgers
        counts = {n: len(led.reservations()) for n, led in ledgers.items()}
        most = max(counts, key=lambda n: (counts[n], n))
        spent = ledgers[most].spent()
        t_end = self.reached_at if self.reached_at is not None else self.now
        rounds = len(self.curve)
        return {
            "mode": "buffered" if self.buffered else "sync",
            "target": self.target, "reached": self.reached_at is not None,
            "time_to_target_s": self.reached_at,
            "rounds_completed": rounds,
            "rounds_per_hour": 3600.0 * rounds / t_end if t_end > 0 else None,
            "final_accuracy": self.curve[-1]["accuracy"] if self.curve else None,
            "trainings": self.trainings,
            "max_participations": counts[most],
            "mean_participations": float(np.mean(list(counts.values()))),
            "max_device_epsilon": spent.device_epsilon,
            "device_budget": ledgers[most].budget.device_epsilon,
            "staleness_mean": float(np.mean(self.staleness)) if self.staleness else None,
            "staleness_max": max(self.staleness) if self.staleness else None,
            "curve": self.curve,
            "cpu_seconds": wall,
        }


def device_epsilon_after(ledgers: Mapping[str, Ledger], n: int) -> float | None:
    """The device-level epsilon (nats at the ledgers' delta; zero-out of a device's data,
    against whoever sees only the sums) of ``n`` participations, each the event the fleet's
    ledgers reserve (all reservations of a run have the one event: the run's settings),
    composed by a fresh :class:`~edge_sdk.ledger.Book` as a device's ledger composes them;
    None for n = 0 or no reservation anywhere."""
    plan = next((res[0].plan for led in ledgers.values() if (res := led.reservations())),
                None)
    if plan is None or n == 0:
        return None
    delta = next(iter(ledgers.values())).budget.delta
    book = Book(budget=None, delta=delta)
    for i in range(n):
        book.reserve(dataclasses.replace(plan, round_id=f"composed/{i}"))
    return book.spent().device_epsilon


def run_timed(cfg: SimConfig, availability: Availability, workdir: str | Path, *,
              buffered: bool, target: float, horizon_s: float, device_epsilon: float,
              max_staleness: int = 4, staleness_exponent: float = 0.5,
              stage_timeout: float = 120.0, window: int = 3,
              out: TextIO | None = None) -> dict[str, Any]:
    """One run of ``cfg`` (mechanism ``device-dp``, secure aggregation) on the simulated
    clock; every ledger's device-level budget ``device_epsilon`` (nats at ``cfg.delta``,
    zero-out of a device's whole data set, KLS 2021 Theorem 1 per participation, composed
    by the ledger)."""
    if cfg.mechanism != "device-dp":
        raise ValueError(f"the comparison runs mechanism 'device-dp', got {cfg.mechanism!r}")
    budget = Budget(epsilon=1e9, delta=cfg.delta, device_epsilon=device_epsilon)
    data, engine = data_and_engine(cfg)
    sizes = [len(s) for s in shard_indices(cfg, data)]
    policy = dataclasses.replace(
        round_policy(cfg, sizes, stage_timeout=stage_timeout), max_rounds=None,
        buffered=buffered, max_staleness=max_staleness,
        staleness_exponent=staleness_exponent)
    fleet = Fleet(cfg, workdir, data=data, engine=engine, policy=policy,
                  start_gate=lambda _: True, budget=budget, out=out)
    try:
        run = TimedRun(fleet, availability, target=target, horizon_s=horizon_s,
                       window=window, out=out)
        result = run.run()
        result["epsilon_of"] = {n: device_epsilon_after(fleet.ledgers, n) for n in sorted(
            {c["max_participations"] for c in result["curve"]})}
        return result
    finally:
        fleet.close()


def compare_fedbuff(cfg: SimConfig, availability: Availability, workdir: str | Path, *,
                    target: float, horizon_s: float, device_epsilon: float,
                    max_staleness: int = 4, staleness_exponent: float = 0.5,
                    stage_timeout: float = 120.0,
                    out: TextIO | None = sys.stdout) -> dict[str, Any]:
    """Synchronous rounds, then buffered ones, on the same fleet, seeds and model
    (``run_timed``); ``speedup``: the synchronous time to target over the buffered one
    (None unless both reached it)."""
    rows = {}
    for mode in ("sync", "buffered"):
        rows[mode] = run_timed(cfg, availability, Path(workdir) / mode,
                               buffered=mode == "buffered", target=target,
                               horizon_s=horizon_s, device_epsilon=device_epsilon,
                               max_staleness=max_staleness,
                               staleness_exponent=staleness_exponent,
                               stage_timeout=stage_timeout, out=out)
    s, b = rows["sync"]["time_to_target_s"], rows["buffered"]["time_to_target_s"]
    return {"availability": dataclasses.asdict(availability),
            "config": {"dataset": cfg.dataset, "model": cfg.model, "devices": cfg.devices,
                       "cohort": cfg.cohort_size, "noise_multiplier": cfg.noise_multiplier,
                       "update_clip": cfg.update_clip, "local_steps": cfg.local_steps,
                       "lr": cfg.lr, "server_lr": cfg.server_lr, "delta": cfg.delta,
                       "max_staleness": max_staleness,
                       "staleness_exponent": staleness_exponent,
                       "device_epsilon_budget": device_epsilon,
                       "stage_timeout": stage_timeout},
            "sync": rows["sync"], "buffered": rows["buffered"],
            "speedup": s / b if s is not None and b is not None and b > 0 else None}
