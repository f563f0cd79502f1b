"""A gateway's coordinator, workers and devices over one real mosquitto, a process each
(issue 19; the in-memory version and the design: ``tools.workers``).

Processes: the coordinator (``SiteMachine(jobs=J)``: check-ins, the round's draw, the jobs,
the sums, the model), one per worker (``RoundMachine(share="workers", upstream=...)``,
taking jobs through ``$share/workers/fedge/<fleet>/site/job``), and one for all the
devices (``tools.fleet``'s device agents on one ``MqttLoop``). They share the work
directory: the broker's credentials, the coordinator's ``result.json`` and ``done``.
Key material and data are seeded, as in every simulated fleet.

``python -m tools.workers_mqtt coordinator|worker|devices SPEC [INDEX]`` runs one process;
:func:`run_workers_mqtt` the whole topology (``fedge bench workers`` compares 1 and 2
workers on it).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aggregator.rounds import RoundEnded, RoundMachine, RoundStarted
from aggregator.site import SiteMachine, SitePolicy, Upstream
from edge_sdk import secagg, wire
from tools.broker import Broker, read_broker_config
from tools.datasets import load_dataset
from tools.fleet import Fleet, aggregator_identity, initial_params
from tools.hierarchy import MachineAgent, SiteAgent, site_identity
from tools.seeding import round_random_bytes, seeded_bytes
from tools.simconfig import FLEET_NAME, SimConfig
from tools.summary import model_sha256
from tools.workers import SHARE_GROUP, worker_names, worker_policy

__all__ = ["run_workers_mqtt"]

COORDINATOR = "coordinator"
_POLL_S = 0.05


def _registry(cfg: SimConfig) -> secagg.Registry:
    from tools.broker import device_names

    agg = aggregator_identity(cfg.seed)
    ids = [secagg.DeviceIdentity.generate(n, random_bytes=seeded_bytes(
        f"fedge-fleet/{cfg.seed}/id/{n}")) for n in device_names(cfg.devices)]
    return secagg.Registry.of(agg, ids)


def _address(root: Path) -> tuple[Any, Any]:
    from edge_sdk.mqtt import BrokerAddress

    bc = read_broker_config(root / "broker")
    return bc, BrokerAddress(host=bc.host, port=bc.port,
                             ca_file=str(bc.ca_file) if bc.ca_file else None)


def run_coordinator(spec: dict[str, Any]) -> dict[str, Any]:
    from edge_sdk.mqtt import ClientConfig, MqttLoop

    cfg = SimConfig(**spec["cfg"])
    root = Path(spec["workdir"])
    data = load_dataset(cfg.dataset)
    policy = worker_policy(cfg, data, spec["jobs"])
    from edge_sdk.model import build_spec

    mspec = build_spec(cfg.model, data.input_shape, data.num_classes)
    names = worker_names(spec["workers"])
    reg = _registry(cfg)
    site = SiteMachine(
        policy=SitePolicy(site=FLEET_NAME, round_timeout=float(spec["round_timeout"])),
        round_policy=policy, identity=site_identity(cfg.seed),
        gateways=dict.fromkeys(names, aggregator_identity(cfg.seed).public_key),
        params=initial_params(cfg, mspec), random_bytes=round_random_bytes(cfg.seed),
        jobs=spec["jobs"], registry=reg,
        start_gate=lambda: sum(c.model_version == site.model_version
                               for c in site.checkins.values()) >= cfg.devices)
    agent = SiteAgent(site)
    bc, address = _address(root)
    starts: list[float] = []
    with MqttLoop(address, rng=random.Random(cfg.seed)) as loop:
        loop.add(ClientConfig(username=COORDINATOR, password=bc.password(COORDINATOR),
                              max_inflight=100), agent)

        def done() -> bool:
            if site.open_round is not None and len(starts) < site.open_round:
                starts.append(time.perf_counter())
            return len(agent.ended) >= cfg.rounds

        ok = loop.run(until=done, timeout=float(spec["timeout"]))
        end = time.perf_counter()
        loop.run(timeout=0.3)
    rounds = [{"round": o.round_id, "completed": o.completed, "jobs": list(o.gateways),
               "survivors": o.survivors, "sum": None if o.total is None else o.total.tolist()}
              for o in agent.ended]
    result = {"finished": ok, "workers": spec["workers"], "jobs": spec["jobs"],
              "rounds": rounds, "rounds_wall_seconds": end - starts[0] if starts else None,
              "device_rounds": sum(r["survivors"] for r in rounds if r["completed"]),
              "model_sha256": model_sha256(site.params)}
    (root / "result.json").write_text(json.dumps(result))
    (root / "done").write_text("done\n")
    return result


def run_worker(spec: dict[str, Any], index: int) -> None:
    from edge_sdk.model import build_spec
    from edge_sdk.mqtt import ClientConfig, MqttLoop

    cfg = SimConfig(**spec["cfg"])
    root = Path(spec["workdir"])
    data = load_dataset(cfg.dataset)
    mspec = build_spec(cfg.model, data.input_shape, data.num_classes)
    name = worker_names(spec["workers"])[index]
    machine = RoundMachine(
        policy=worker_policy(cfg, data, spec["jobs"]), identity=aggregator_identity(cfg.seed),
        registry=_registry(cfg), params=initial_params(cfg, mspec),
        random_bytes=seeded_bytes(f"fedge-fleet/{cfg.seed}/rounds/{name}"),
        upstream=Upstream(site=FLEET_NAME, gateway=name,
                          site_key=site_identity(cfg.seed).public_key),
        share=SHARE_GROUP)
    bc, address = _address(root)
    done = root / "done"
    with MqttLoop(address, rng=random.Random(cfg.seed + index)) as loop:
        def on_event(ev: Any) -> None:  # a job's cohort's uplinks, before its plans leave
            if isinstance(ev, RoundStarted):
                loop.subscribe(name, machine.round_subscriptions(ev.cohort))
            elif isinstance(ev, RoundEnded):
                loop.unsubscribe(name, machine.round_subscriptions(ev.cohort))

        agent = MachineAgent(machine, on_event)
        loop.add(ClientConfig(username=name, password=bc.password(name), max_inflight=100),
                 agent)
        loop.run(until=done.exists, timeout=float(spec["timeout"]))


def run_devices(spec: dict[str, Any]) -> None:
    from edge_sdk.mqtt import ClientConfig, MqttLoop

    cfg = SimConfig(**{**spec["cfg"], "dropout": 0.0})
    root = Path(spec["workdir"])
    data = load_dataset(cfg.dataset)
    # the devices of a Fleet (its own round machine is not connected: the workers serve)
    fleet = Fleet(cfg, root / "devices", data=data,
                  policy=worker_policy(cfg, data, spec["jobs"]))
    bc, address = _address(root)
    done = root / "done"
    try:
        with MqttLoop(address, rng=random.Random(cfg.seed)) as loop:
            for n in fleet.names:
                loop.add(ClientConfig(username=n, password=bc.password(n),
                                      status_topic=wire.status_topic(FLEET_NAME, n),
                                      backoff_initial_s=0.05, backoff_max_s=1.0),
                         fleet.agents[n])
            loop.run(until=done.exists, timeout=float(spec["timeout"]))
    finally:
        fleet.close()


def run_workers_mqtt(cfg: SimConfig, workdir: str | Path, *, workers: int, jobs: int,
                     round_timeout: float = 120.0, timeout: float = 900.0) -> dict[str, Any]:
    """The whole topology over a fresh mosquitto (TLS, a user per party); the
    coordinator's result (sums per round, the rounds' wall time, device-rounds, model).
    Dropouts are off here (``tools.workers`` tests them in memory).

    Raises:
        RuntimeError: a process failed (its log's tail in the message).
    """
    from tools.broker import device_names

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    names = worker_names(workers)
    root = wire.fleet_topic(FLEET_NAME)
    acl = "\n".join(f"user {u}\ntopic readwrite {root}/#\n" for u in (COORDINATOR, *names))
    spec = {"cfg": cfg.as_dict(), "workers": workers, "jobs": jobs,
            "workdir": str(work.resolve()), "round_timeout": round_timeout,
            "timeout": timeout}
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    procs: list[tuple[str, subprocess.Popen[bytes], Any]] = []
    with Broker(devices=device_names(cfg.devices), fleet=FLEET_NAME,
                directory=work / "broker", extra_users=[COORDINATOR, *names],
                extra_acl=acl) as broker:
        del broker
        try:
            roles = [("coordinator", ["coordinator"])] + [
                (w, ["worker", str(i)]) for i, w in enumerate(names)] + [
                ("devices", ["devices"])]
            for label, args in roles:
                log = (work / f"{label}.log").open("wb")
                procs.append((label, subprocess.Popen(
                    [sys.executable, "-m", "tools.workers_mqtt", args[0], str(spec_file),
                     *args[1:]], stdout=log, stderr=subprocess.STDOUT, env=env), log))
            deadline = time.monotonic() + timeout + 60
            for label, p, log in procs:
                try:
                    p.wait(max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                log.close()
                if p.returncode != 0:
                    tail = (work / f"{label}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{label} exited with {p.returncode}:\n{tail}")
        finally:
            for _, p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return json.loads((work / "result.json").read_text())


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] not in ("coordinator", "worker", "devices"):
        print("usage: python -m tools.workers_mqtt coordinator|worker|devices SPEC [INDEX]",
              file=sys.stderr)
        return 2
    spec = json.loads(Path(args[1]).read_text())
    if args[0] == "coordinator":
        run_coordinator(spec)
    elif args[0] == "worker":
        run_worker(spec, int(args[2]))
    else:
        run_devices(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
