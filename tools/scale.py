"""A fleet of many registered devices, of which only the active ones exist (issue 19).

:class:`ScaleFleet` registers ``cfg.devices`` devices (100,000 and more): the aggregator's
registry holds every device's public keys, as an enrollment would give it, and nothing
else exists per registered device. Each round a seeded set of ``available`` devices comes
online (the availability model: uniformly ``available`` of the registered devices, drawn
with ``default_rng([seed, 11, round])``, as devices that wake on their own schedules).
Only they are built, from their seeds: identity (re-derived from the same seeded label as
at registration), privacy ledger (a file under ``workdir/ledgers``, created on the
device's first activation and reopened on later ones, so its spending persists), data
and a :class:`edge_sdk.session.DeviceSession` on the in-memory broker. They check in, the
aggregator's round machine selects ``cfg.cohort_size`` of them and runs SecAgg+ with the
seeded dropouts of ``tools.dropouts``; when the round has ended they go offline again:
their sessions are dropped and ledgers closed. Memory thus follows the available set and
the cohort, not the registered fleet: the round machine forgets check-ins on older models
and full flood buckets with each new model (``RoundMachine._forget_stale``).

The devices and the aggregator are the deployed objects (``tools.fleet``'s ``DeviceAgent``
and ``AggregatorAgent`` around them, the same dropout and deadline rules); what is
simulated is the transport (``tools.inproc.MemoryBroker``), the keys' randomness (seeded)
and the data: every device's ``samples`` training examples are drawn from the dataset's
training set by its own seed (``default_rng([seed, 13, index])``, without replacement
within a device), so the devices' data overlap when the fleet outnumbers the examples.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from aggregator.rounds import RoundEnded, RoundMachine, RoundStarted
from edge_sdk import secagg, wire
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.engine import Engine, load_engine
from edge_sdk.ledger import Budget, Ledger
from edge_sdk.model import ModelSpec, build_spec
from edge_sdk.session import DeviceSession
from edge_sdk.wire import CheckIn, Publish
from models import manifest_path
from tools.bench.rss import peak_rss_mib
from tools.broker import device_names
from tools.datasets import Dataset, load_dataset
from tools.dropouts import DropoutSchedule
from tools.evaluate import evaluate
from tools.fleet import AggregatorAgent, DeviceAgent, Meter, aggregator_identity, initial_params
from tools.inproc import MemoryBroker
from tools.seeding import device_seed, round_random_bytes, seeded_bytes
from tools.simconfig import FLEET_BUDGET_EPSILON, FLEET_NAME, SimConfig, round_policy
from tools.summary import model_sha256

__all__ = ["ScaleFleet", "peak_rss_mib"]

_TICK_S = 0.1



def _identity(seed: int, name: str) -> secagg.DeviceIdentity:
    # the label tools.fleet.Fleet uses: a device has the same keys in every harness
    return secagg.DeviceIdentity.generate(name, random_bytes=seeded_bytes(
        f"fedge-fleet/{seed}/id/{name}"))


class ScaleFleet:
    """``cfg.devices`` registered devices, ``available`` online per round (module docstring).

    Args:
        cfg: ``devices`` registered, ``participation`` x devices per cohort, ``rounds``,
            ``dropout``, the mechanism and local settings; transport ``inproc``.
        workdir: ledgers (one file per device ever activated).
        available: devices online per round (default: cohort + a quarter).
        samples: training examples per device.
    """

    def __init__(self, cfg: SimConfig, workdir: str | Path, *, available: int | None = None,
                 samples: int = 32, data: Dataset | None = None,
                 engine: tuple[ModelSpec, Engine] | None = None,
                 out: TextIO | None = None) -> None:
        if cfg.transport != "inproc":
            raise ValueError(f"ScaleFleet runs transport 'inproc', got {cfg.transport!r}")
        t0 = time.perf_counter()
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.out = sys.stderr if out is None else out
        self.data = load_dataset(cfg.dataset) if data is None else data
        if engine is None:
            spec = build_spec(cfg.model, self.data.input_shape, self.data.num_classes)
            engine = spec, load_engine(manifest_path(spec.name, spec.input_shape,
                                                     spec.num_classes),
                                       backend=cfg.backend, threads=cfg.threads)
        self.spec, self.engine = engine
        n = len(self.data.y_train)
        if not 1 <= samples <= n:
            raise ValueError(f"samples must be in [1, {n}] (the training set), got {samples}")
        self.samples = samples
        cohort = cfg.cohort_size
        self.available = cohort + cohort // 4 if available is None else available
        if not cohort <= self.available <= cfg.devices:
            raise ValueError(f"available must be in [cohort={cohort}, devices={cfg.devices}]"
                             f", got {self.available}")
        self.names = device_names(cfg.devices)
        self.agg_id = aggregator_identity(cfg.seed)
        t_reg = time.perf_counter()
        self.registry = secagg.Registry(
            aggregator_key=self.agg_id.public_key,
            devices={nm: _identity(cfg.seed, nm).enrollment() for nm in self.names})
        self.registration_seconds = time.perf_counter() - t_reg
        self.budget = Budget(epsilon=(FLEET_BUDGET_EPSILON if cfg.budget_epsilon is None
                                      else cfg.budget_epsilon), delta=cfg.delta)
        self.policy = round_policy(cfg, [samples] * cfg.devices)
        self.initial = initial_params(cfg, self.spec)
        (self.workdir / "ledgers").mkdir(parents=True, exist_ok=True)
        self.machine = RoundMachine(policy=self.policy, identity=self.agg_id,
                                    registry=self.registry, params=self.initial,
                                    random_bytes=round_random_bytes(cfg.seed),
                                    start_gate=self._all_active_checked_in)
        self.gone: set[str] = set()
        self.meter = Meter()
        self.schedule = DropoutSchedule(cfg.dropout, cfg.seed) if cfg.dropout > 0 else None
        self.aggregator = AggregatorAgent(self.machine, gone=self.gone, meter=self.meter,
                                          on_event=self._note, wills=True)
        self.broker = MemoryBroker()
        self.broker.attach("aggregator", self.aggregator, 0.0)
        self.active: dict[str, DeviceAgent] = {}
        self.ledgers: dict[str, Ledger] = {}
        self.activated: set[str] = set()  # devices with a ledger file
        self.rows: list[dict[str, Any]] = []
        self._ended: list[Any] = []
        self._cohort: dict[int, tuple[str, ...]] = {}
        self._wanted = False  # the harness wants a round with the devices now online
        self.setup_seconds = time.perf_counter() - t0
        self.rss_after_setup = peak_rss_mib()

    # -- devices -------------------------------------------------------------------------

    def _shard(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        i = int(name.split("-")[-1])
        rng = np.random.default_rng([self.cfg.seed, 13, i])
        idx = np.sort(rng.choice(len(self.data.y_train), self.samples, replace=False))
        return self.data.x_train[idx], self.data.y_train[idx]

    def _activate(self, names: list[str], round_id: int, now: float) -> None:
        for nm in names:
            path = self.workdir / "ledgers" / f"{nm}.db"
            led = Ledger.open(path, budget=self.budget, device_id=nm,
                              create=not path.exists())
            self.ledgers[nm] = led
            self.activated.add(nm)
            x, y = self._shard(nm)
            session = DeviceSession(
                fleet=FLEET_NAME, identity=_identity(self.cfg.seed, nm),
                registry=self.registry, ledger=led, engine=self.engine, spec=self.spec,
                data=lambda x=x, y=y: (x, y),
                round_rng=seeded_round_rng(device_seed(self.cfg.seed,
                                                       int(nm.split("-")[-1]))),
                random_bytes=seeded_bytes(f"fedge-fleet/{self.cfg.seed}/dev/{nm}/{round_id}"))
            agent = DeviceAgent(nm, session, fleet=FLEET_NAME, schedule=self.schedule,
                                gone=self.gone, meter=self.meter)
            self.active[nm] = agent
            self.broker.attach(nm, agent, now)

    def _deactivate(self, now: float) -> None:
        for nm in list(self.active):
            self.broker.detach(nm)
            self.ledgers.pop(nm).close()
            # its last will, as the broker publishes it when the connection ends: the
            # aggregator withdraws its check-in (RoundMachine, "status")
            self.broker.publish(nm, Publish(wire.status_topic(FLEET_NAME, nm), b"offline"))
        self.broker.run(now)
        self.active.clear()
        self.gone.clear()
        self.broker.retained = {k: v for k, v in self.broker.retained.items()
                                if "/dev/" not in k}

    def _all_active_checked_in(self, checkins: Mapping[str, CheckIn]) -> bool:
        # one round per online period: the devices go offline once it has ended
        if not self._wanted:
            return False
        v = self.machine.model_version
        return all(nm in checkins and checkins[nm].model_version == v for nm in self.active)

    def _note(self, ev: Any) -> None:
        if isinstance(ev, RoundStarted):
            self._wanted = False
            self._cohort[ev.round_id] = ev.cohort
        elif isinstance(ev, RoundEnded):
            self._ended.append(ev.outcome)

    # -- running -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """``cfg.rounds`` rounds (module docstring); the summary."""
        t_run = time.perf_counter()
        now = 0.0
        for r in range(1, self.cfg.rounds + 1):
            t0 = time.perf_counter()
            pick = np.random.default_rng([self.cfg.seed, 11, r]).choice(
                self.cfg.devices, self.available, replace=False)
            self._activate([self.names[int(i)] for i in np.sort(pick)], r, now)
            self._wanted = True
            quiet = 0
            while not self._ended:
                before = len(self.broker.sent)
                self.broker.run(now)
                self.broker.tick(now)
                if self._ended:
                    break
                if len(self.broker.sent) == before:
                    quiet += 1
                    if quiet > 8:
                        raise RuntimeError(f"round {r} stalled: nothing happened")
                    now += self.policy.stage_timeout
                else:
                    quiet = 0
                    now += _TICK_S
            self.broker.run(now)  # the round's last messages (model, error notices)
            outcome = self._ended.pop()
            self._ended.clear()
            active = len(self.active)
            self._deactivate(now)
            self.broker.sent.clear()  # the log of every publish would grow with the run
            self.rows.append({
                "round": outcome.round_id, "completed": outcome.completed,
                "cohort": len(self._cohort.pop(outcome.round_id, ())),
                "survivors": len(outcome.survivors), "active": active,
                "wall_seconds": time.perf_counter() - t0,
                "peak_rss_mib": peak_rss_mib(),
                "ledger_files": len(self.activated)})
            if self.cfg.progress:
                row = self.rows[-1]
                self.out.write(f"[scale] round {r}/{self.cfg.rounds} "
                               f"{'done' if row['completed'] else 'FAILED'} survivors "
                               f"{row['survivors']}/{row['cohort']} of {active} online, "
                               f"{row['wall_seconds']:.1f} s, peak RSS "
                               f"{row['peak_rss_mib']:.0f} MiB\n")
                self.out.flush()
        wall = time.perf_counter() - t_run
        params = self.machine.params
        acc = evaluate(self.engine, params, self.data.x_test, self.data.y_test,
                       self.cfg.eval_batch)
        uploads = sum(r["survivors"] for r in self.rows if r["completed"])
        return {
            "registered": self.cfg.devices, "available": self.available,
            "cohort": self.cfg.cohort_size, "samples": self.samples,
            "rounds": self.rows,
            "rounds_completed": sum(r["completed"] for r in self.rows),
            "device_rounds": uploads,
            "device_rounds_per_minute": 60.0 * uploads / wall if wall > 0 else None,
            "registration_seconds": self.registration_seconds,
            "setup_seconds": self.setup_seconds, "wall_seconds": wall,
            "rss_after_setup_mib": self.rss_after_setup, "peak_rss_mib": peak_rss_mib(),
            "ledger_files": len(self.activated),
            "machine_checkins": len(self.machine.checkins),
            "final_accuracy": acc, "model_sha256": model_sha256(params),
        }

    def close(self) -> None:
        for led in self.ledgers.values():
            led.close()
        self.ledgers.clear()
