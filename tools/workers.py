"""One gateway's aggregation over several worker processes: MQTT v5 shared subscriptions
(issue 19).

A coordinator (``aggregator.site.SiteMachine(jobs=J)``) takes the devices' check-ins,
draws one cohort of J x n devices each round (the round core's uniform draw) and splits it
into J disjoint jobs of n, published on ``fedge/<fleet>/site/job``. ``workers`` worker
round machines (``RoundMachine(share="workers", upstream=...)``) take the jobs through the
shared subscription ``$share/workers/fedge/<fleet>/site/job``: the broker gives each job to
one worker (in turn), which runs that cohort's secure aggregation (subscribing its
devices' uplinks for the round, ``RoundMachine.round_subscriptions``) and forwards the
released sum; a worker with several jobs runs them one after the other. The coordinator
adds the J sums in the ring, decodes once and applies the server optimizer; the workers
adopt and republish the model. The workers share the gateway's signing key, so the
devices see one aggregator.

So the workers own disjoint cohorts of the same round and their sums add up to the
round's: which worker ran which job does not change a sum, and 1 worker running the J
jobs in turn gives the same sums and model as W running them side by side
(``tests/test_workers.py``). :class:`Workers` runs them in one process over
``tools.inproc.MemoryBroker`` (which implements shared subscriptions); over mosquitto, one
process per worker, ``tools.bench.workers``. Dropouts: :class:`CohortDropouts`, seeded by
the round and the job's cohort.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aggregator.plain_sum import STAGES
from aggregator.round_core import RoundPolicy
from aggregator.rounds import RoundEnded, RoundMachine, RoundStarted
from aggregator.site import SiteMachine, SiteOutcome, SitePolicy, Upstream
from tools.evaluate import evaluate
from tools.fleet import AggregatorAgent, Fleet, data_and_engine, shard_indices
from tools.hierarchy import SiteAgent, site_identity
from tools.inproc import MemoryBroker
from tools.seeding import round_random_bytes, seeded_bytes
from tools.simconfig import FLEET_NAME, SimConfig, round_policy
from tools.summary import model_sha256

__all__ = ["CohortDropouts", "SHARE_GROUP", "Workers", "worker_names", "worker_policy"]

SHARE_GROUP = "workers"
SITE = "combiner"
_TICK_S = 0.1


def worker_names(n: int) -> list[str]:
    return [f"worker-{i}" for i in range(n)]


class CohortDropouts:
    """Which members of a cohort vanish in a round, and at which stage: ``round(fraction x
    len(cohort))`` of them, drawn with ``default_rng([seed, 7, round, crc32(cohort)])``
    from the sorted cohort, each at a uniform stage of ``aggregator.plain_sum.STAGES``
    (``tools.dropouts.DropoutSchedule``'s rule, per cohort instead of per round). With
    ``parts`` (round -> the cohorts a round's union is made of), a union's victims are
    those of its parts: the flat twin drops what the workers dropped."""

    def __init__(self, fraction: float, seed: int,
                 parts: Mapping[int, Sequence[tuple[str, ...]]] | None = None) -> None:
        if not 0 <= fraction < 1:
            raise ValueError(f"dropout must be in [0, 1), got {fraction!r}")
        self.fraction, self.seed, self.parts = fraction, seed, parts

    def _one(self, round_id: int, cohort: Sequence[str]) -> dict[str, str]:
        members = sorted(cohort)
        m = min(len(members), round(self.fraction * len(members)))
        rng = np.random.default_rng([self.seed, 7, round_id,
                                     zlib.crc32(",".join(members).encode())])
        picked = rng.choice(len(members), m, replace=False) if m else []
        stages = list(STAGES)
        return {members[int(i)]: stages[int(rng.integers(len(stages)))] for i in picked}

    def victims(self, round_id: int, cohort: Sequence[str]) -> dict[str, str]:
        if self.parts is None or round_id not in self.parts:
            return self._one(round_id, cohort)
        out: dict[str, str] = {}
        for part in self.parts[round_id]:
            out.update(self._one(round_id, part))
        return out


class Workers:
    """A coordinator, ``workers`` worker round machines and ``cfg.devices`` devices on one
    in-memory broker (module docstring).

    Args:
        cfg: ``devices``; ``participation`` the round's whole cohort fraction, split into
            ``jobs`` (default: one per worker) cohorts of ``participation`` x devices /
            jobs; ``rounds`` coordinator rounds; dropouts.
    """

    def __init__(self, cfg: SimConfig, workdir: str | Path, *, workers: int,
                 jobs: int | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.data, self.engine = data_and_engine(cfg)
        self.names = worker_names(workers)
        self.jobs = workers if jobs is None else jobs
        self.policy = worker_policy(cfg, self.data, self.jobs)
        self.site_id = site_identity(cfg.seed)
        self.dropouts = CohortDropouts(cfg.dropout, cfg.seed) if cfg.dropout > 0 else None
        ups = [Upstream(site=FLEET_NAME, gateway=w, site_key=self.site_id.public_key)
               for w in self.names]
        # worker 0 comes with the devices (a Fleet); the others share its key and registry
        self.fleet = Fleet(cfg, self.workdir / "fleet", data=self.data, engine=self.engine,
                           policy=self.policy, upstream=ups[0], schedule=self.dropouts,
                           share=SHARE_GROUP)
        self.machines = [self.fleet.machine] + [
            RoundMachine(policy=self.policy, identity=self.fleet.agg_id,
                         registry=self.fleet.registry, params=self.fleet.initial,
                         random_bytes=seeded_bytes(f"fedge-fleet/{cfg.seed}/rounds/{w}"),
                         upstream=up, share=SHARE_GROUP)
            for w, up in zip(self.names[1:], ups[1:], strict=True)]
        self.site = SiteMachine(
            policy=SitePolicy(site=FLEET_NAME, round_timeout=600.0), round_policy=self.policy,
            identity=self.site_id,
            gateways=dict.fromkeys(self.names, self.fleet.agg_id.public_key),
            params=self.fleet.initial, random_bytes=round_random_bytes(cfg.seed),
            jobs=self.jobs, registry=self.fleet.registry, start_gate=self._gate)
        self.ran: dict[int, dict[str, str]] = {}  # round -> {job's first device: worker}
        self.broker: MemoryBroker | None = None

    def _gate(self) -> bool:
        """Rounds start once every device has checked in on the current model (so the
        draw does not depend on message timing)."""
        v = self.site.model_version
        return sum(c.model_version == v for c in self.site.checkins.values()) >= len(
            self.fleet.names)

    def _agent(self, i: int) -> AggregatorAgent:
        if i == 0:
            agent = self.fleet.aggregator
            inner = agent._on_event
        else:
            agent = AggregatorAgent(self.machines[i], gone=self.fleet.gone,
                                    meter=self.fleet.meter, on_event=lambda ev: None)
            inner = None
        name, machine = self.names[i], self.machines[i]

        def on_event(ev: Any) -> None:
            assert self.broker is not None
            if isinstance(ev, RoundStarted):  # before the plans leave: the cohort's uplinks
                self.ran.setdefault(ev.round_id, {})[ev.cohort[0]] = name
                self.broker.subscribe(name, machine.round_subscriptions(ev.cohort))
            elif isinstance(ev, RoundEnded):
                self.broker.unsubscribe(name, machine.round_subscriptions(ev.cohort))
                for d in ev.cohort:  # its vanished devices come back
                    self.fleet.agents[d].revive()
            if inner is not None:
                inner(ev)

        agent._on_event = on_event
        return agent

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        broker = self.broker = MemoryBroker()
        site = SiteAgent(self.site)
        now = 0.0
        broker.attach(SITE, site, now)
        for i, w in enumerate(self.names):
            broker.attach(w, self._agent(i), now)
        for d in self.fleet.names:
            broker.attach(d, self.fleet.agents[d], now)
        quiet = 0
        while len(site.ended) < self.cfg.rounds:
            before = len(broker.sent)
            broker.run(now)
            self.fleet.observe()
            broker.tick(now)
            if len(broker.sent) == before:
                quiet += 1
                if quiet > 20:
                    raise RuntimeError(f"the workers stalled after {len(site.ended)} rounds")
                now += self.policy.stage_timeout
            else:
                quiet = 0
                now += _TICK_S
        return self._summary(site.ended, time.perf_counter() - t0)

    def _summary(self, ended: list[SiteOutcome], wall: float) -> dict[str, Any]:
        params = self.site.params
        _, engine = self.engine
        return {
            "workers": len(self.names), "jobs": self.jobs,
            "rounds": [{"round": o.round_id, "completed": o.completed,
                        "jobs": list(o.gateways), "survivors": o.survivors,
                        "sum": None if o.total is None else o.total.tolist()}
                       for o in ended],
            "ran_by": {str(r): sorted(set(w.values())) for r, w in self.ran.items()},
            "model_sha256": model_sha256(params),
            "final_accuracy": evaluate(engine, params, self.data.x_test, self.data.y_test,
                                       self.cfg.eval_batch),
            "wall_seconds": wall,
        }

    def close(self) -> None:
        self.fleet.close()


def worker_policy(cfg: SimConfig, data: Any, jobs: int) -> RoundPolicy:
    """The workers' round policy: each job a full cohort of ``participation`` x devices /
    jobs, the grid and ring sized for the round's ``jobs`` x that (``sum_cohort``)."""
    n = max(3, round(cfg.participation * cfg.devices / jobs))
    sizes = [len(i) for i in shard_indices(cfg, data)]
    return dataclasses.replace(round_policy(cfg, sizes), cohort_size=n, sum_cohort=jobs * n)
