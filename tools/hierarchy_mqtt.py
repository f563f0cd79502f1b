"""A site and its gateways over real mosquittos joined by bridges, one process each (issue 19).

Topology (what ``tools.hierarchy`` simulates in memory, here with the real parts)::

    process gw-g: mosquitto (loopback listener) + the gateway's RoundMachine + its devices
                  on one MqttLoop; the broker's bridge dials the site's broker
    process site: mosquitto (listening where the gateways reach it) + SiteMachine

Each gateway's mosquitto carries a ``connection`` section (mosquitto.conf(5), "Bridges"):
MQTT v5, TLS against the site broker's CA, the gateway's own user name and password at
the site, and two topic lines: its uplink ``fedge/<site>/gw/<gw>/up/#`` out, the site's
``fedge/<site>/site/#`` (retained round and model) in. The site broker's ACL lets each
gateway write only its own uplink and read only the site topics; the device topics never
cross a bridge.

With ``netns=True`` (root, ``ip netns``) every process runs in its own network namespace
made for the run: the site's and each gateway's, joined by one veth pair per gateway
(10.250.<g+1>.1 site side, .2 gateway side); devices reach their gateway's broker over
the namespace's own loopback, and only the bridges cross the veths. Without namespaces
the same processes run on loopback ports (:func:`netns_available` says whether
namespaces can be made here).

The processes share the work directory (namespaces separate networks, not files): the
site writes its broker's credentials and a ``ready`` marker there, one line per ended
site round to ``site/rounds.jsonl``, its result and a ``done`` marker at the end; the
gateways read them. Key material is seeded (simulation), as in ``tools.fleet``.

Run: ``python -m tools.hierarchy_mqtt site|gateway SPEC [INDEX]`` (one process), or
:func:`run_site_mqtt` for the whole topology.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aggregator.site import SiteMachine, SitePolicy, Upstream
from aggregator.store import CheckpointStore
from edge_sdk import wire
from edge_sdk.engine import load_engine
from edge_sdk.model import build_spec
from models import manifest_path
from tools.broker import Broker, read_broker_config
from tools.datasets import load_dataset
from tools.dropouts import DropoutSchedule
from tools.evaluate import evaluate
from tools.fleet import Fleet, aggregator_identity, initial_params
from tools.hierarchy import (
    SITE,
    SITE_NAME,
    SiteAgent,
    gateway_names,
    gateway_policy,
    groups,
    site_identity,
)
from tools.seeding import round_random_bytes
from tools.simconfig import SimConfig
from tools.summary import model_sha256

__all__ = ["netns_available", "run_gateway", "run_site", "run_site_mqtt", "site_acl"]

_POLL_S = 0.05
_KILL_STAGES = {"keys": "collect_keys", "shares": "collect_shares",
                "masked": "collect_masked", "unmask": "collect_unmask"}


def site_acl(site: str, gateways: Sequence[str], aggregator: str = SITE) -> str:
    """The site broker's ACL: the site aggregator owns the site's topics; each gateway
    (its bridge's user) writes only its own uplink and reads the site's round and model."""
    root = wire.fleet_topic(site)
    lines = ["# Written by tools/hierarchy_mqtt.py: a site's broker.", "",
             f"user {wire.check_name('aggregator', aggregator)}", f"topic readwrite {root}/#"]
    for g in gateways:
        lines += ["", f"user {wire.check_name('gateway', g)}",
                  f"topic write {root}/gw/{g}/up/#", f"topic read {root}/site/#"]
    return "\n".join(lines) + "\n"


def _bridge_conf(*, gateway: str, host: str, port: int, password: str, ca_file: str) -> str:
    root = wire.fleet_topic(SITE_NAME)
    return "\n".join([
        "# The bridge to the site's broker (tools/hierarchy_mqtt.py).",
        f"connection {gateway}",
        f"address {host}:{port}",
        "bridge_protocol_version mqttv50",
        f"remote_clientid {gateway}",
        f"remote_username {gateway}",
        f"remote_password {password}",
        f"bridge_cafile {ca_file}",
        "cleansession false",
        "restart_timeout 1 5",
        f"topic {root}/gw/{gateway}/up/# out 1",
        f"topic {root}/site/# in 1",
        "",
    ])


def _gateway_acl(gateway: str) -> str:
    root = wire.fleet_topic(SITE_NAME)
    return "\n".join(["# The gateway aggregator's site topics (over the bridge).",
                      "user aggregator", f"topic read {root}/site/#",
                      f"topic write {root}/gw/{gateway}/up/#"])


def _wait_for(path: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} ({path}) within {timeout:.0f} s")
        time.sleep(_POLL_S)


# ---------------------------------------------------------------------------- processes


def run_site(spec: dict[str, Any]) -> dict[str, Any]:
    """The site process: its broker, the SiteMachine, until ``cfg.rounds`` site rounds
    ended; writes ``site/result.json`` and ``site/done``."""
    from edge_sdk.mqtt import BrokerAddress, ClientConfig, MqttLoop

    cfg = SimConfig(**spec["cfg"])
    work = Path(spec["workdir"]) / "site"
    work.mkdir(parents=True, exist_ok=True)
    data = load_dataset(cfg.dataset)
    mspec = build_spec(cfg.model, data.input_shape, data.num_classes)
    gws = gateway_names(spec["gateways"])
    policy = gateway_policy(cfg, data, spec["gateways"])
    site_id = site_identity(cfg.seed)
    store = CheckpointStore(work / "site.ckpt")  # a restarted site resumes from it
    kw: dict[str, Any] = dict(
        policy=SitePolicy(site=SITE_NAME, round_timeout=float(spec["round_timeout"])),
        round_policy=policy, identity=site_id,
        gateways={g: aggregator_identity(cfg.seed, g).public_key for g in gws},
        random_bytes=round_random_bytes(cfg.seed), checkpoint=store.save)
    machine = (SiteMachine.restore(store.load(), **kw) if store.path.exists()
               else SiteMachine(params=initial_params(cfg, mspec), **kw))
    agent = SiteAgent(machine)
    listen = list(spec["site_listen"])
    with Broker(devices=gws, fleet=SITE_NAME, aggregator=SITE, directory=work / "broker",
                host=listen[0], extra_hosts=listen[1:], port=int(spec["site_port"]),
                acl=site_acl(SITE_NAME, gws)) as broker:
        bc = broker.config
        (work / "ready").write_text("ready\n")
        address = BrokerAddress(host=spec["site_host"], port=bc.port, ca_file=str(bc.ca_file))
        log = (work / "rounds.jsonl").open("a")
        seen = 0
        with MqttLoop(address, rng=random.Random(cfg.seed)) as loop:
            loop.add(ClientConfig(username=SITE, password=bc.password(SITE), max_inflight=100),
                     agent)

            def progress() -> bool:
                nonlocal seen
                for o in agent.ended[seen:]:
                    log.write(json.dumps({"round": o.round_id, "completed": o.completed,
                                          "gateways": list(o.gateways),
                                          "missing": dict(o.missing),
                                          "survivors": o.survivors}) + "\n")
                    log.flush()
                seen = len(agent.ended)
                return seen >= cfg.rounds

            ok = loop.run(until=progress, timeout=float(spec.get("timeout", 600)))
            loop.run(timeout=0.5)  # the last model reaches the gateways before we go
        log.close()
    params = machine.params
    engine = load_engine(manifest_path(mspec.name, mspec.input_shape, mspec.num_classes),
                         backend=cfg.backend, threads=cfg.threads)
    result = {
        "finished": ok,
        "rounds": [json.loads(line) for line in (work / "rounds.jsonl").read_text().splitlines()],
        "model_version": machine.model_version,
        "model_sha256": model_sha256(params),
        "final_accuracy": evaluate(engine, params, data.x_test, data.y_test, cfg.eval_batch),
    }
    (work / "result.json").write_text(json.dumps(result, indent=1))
    np.savez(work / "params.npz", *params)
    (work / "done").write_text("done\n")
    return result


def run_gateway(spec: dict[str, Any], index: int) -> dict[str, Any]:
    """Gateway ``index``'s process: its devices, broker (bridged to the site's) and round
    machine, until the site is done. ``spec["kill"] = [round, index, stage]`` kills this
    gateway's mosquitto (SIGKILL) when its round reaches the stage, and starts it again
    once the site has ended that round."""
    cfg = SimConfig(**{**spec["cfg"], "transport": "mqtt"})
    root = Path(spec["workdir"])
    gws = gateway_names(spec["gateways"])
    name = gws[index]
    data = load_dataset(cfg.dataset)
    policy = gateway_policy(cfg, data, spec["gateways"])
    members = groups(cfg.devices, spec["gateways"])[index]
    site_key = site_identity(cfg.seed).public_key
    schedule = DropoutSchedule(cfg.dropout, cfg.seed + index + 1) if cfg.dropout > 0 else None
    fleet = Fleet(cfg, root / name, data=data, members=members, policy=policy,
                  upstream=Upstream(site=SITE_NAME, gateway=name, site_key=site_key),
                  schedule=schedule)
    _wait_for(root / "site" / "ready", 120, "site broker")
    sbc = read_broker_config(root / "site" / "broker")
    bridge = _bridge_conf(gateway=name, host=spec["bridge_hosts"][name],
                          port=sbc.port, password=sbc.password(name),
                          ca_file=str(sbc.ca_file))
    done = root / "site" / "done"
    kill = spec.get("kill")
    state = {"killed": False}

    def step() -> None:
        if kill is None or state["killed"] or kill[1] != index:
            return
        plan = fleet.machine.current_plan
        if (plan is not None and plan.round_id == kill[0]
                and fleet.machine.stage == _KILL_STAGES[kill[2]] and fleet.broker is not None):
            state["killed"] = True
            fleet.broker.kill()
            _wait_for_round(root / "site" / "rounds.jsonl", kill[0], 600)
            fleet.broker.start()

    fleet.on_step = step
    try:
        summary = fleet.run(broker_options={"extra_conf": bridge,
                                            "extra_acl": _gateway_acl(name)},
                            until=done.exists, patience=float(spec.get("timeout", 600)))
    finally:
        fleet.close()
    out = {"gateway": name, "note": summary["note"], "killed": state["killed"],
           "rounds": [{"round": r["round"], "completed": r["completed"],
                       "survivors": r["survivors"], "detail": r["detail"]}
                      for r in summary["rounds"]]}
    (root / f"{name}.json").write_text(json.dumps(out, indent=1))
    return out


def _wait_for_round(path: Path, round_id: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and any(json.loads(line)["round"] >= round_id
                                 for line in path.read_text().splitlines()):
            return
        time.sleep(_POLL_S)
    raise TimeoutError(f"site round {round_id} did not end within {timeout:.0f} s")


# ---------------------------------------------------------------------------- orchestration


def netns_available() -> str | None:
    """None if this process can make network namespaces and veth pairs (root, ``ip``),
    else why not."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"fedge-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


class _Namespaces:
    """The site's and each gateway's network namespace, a veth pair per gateway; removed
    on exit (deleting a namespace deletes its veth ends)."""

    def __init__(self, gateways: int) -> None:
        tag = f"{os.getpid() % 100000}"
        self.site = f"fedge-{tag}-site"
        self.gws = [f"fedge-{tag}-gw{g}" for g in range(gateways)]
        self.made: list[str] = []

    def __enter__(self) -> _Namespaces:
        try:
            for ns in (self.site, *self.gws):
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("link", "set", "lo", "up", ns=ns)
            for g, ns in enumerate(self.gws):
                a, b = f"fs{g}-{os.getpid() % 10000}", f"fg{g}-{os.getpid() % 10000}"
                _ip("link", "add", a, "netns", self.site, "type", "veth", "peer", "name", b,
                    "netns", ns)
                _ip("addr", "add", f"10.250.{g + 1}.1/24", "dev", a, ns=self.site)
                _ip("addr", "add", f"10.250.{g + 1}.2/24", "dev", b, ns=ns)
                _ip("link", "set", a, "up", ns=self.site)
                _ip("link", "set", b, "up", ns=ns)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()


def run_site_mqtt(cfg: SimConfig, workdir: str | Path, *, gateways: int, netns: bool,
                  round_timeout: float = 60.0, kill: tuple[int, int, str] | None = None,
                  timeout: float = 600.0) -> dict[str, Any]:
    """The whole topology, one process per party (in its own network namespace with
    ``netns``); returns the site's result with each gateway's report under
    ``"gateway_reports"``.

    Raises:
        RuntimeError: a process failed (its output's tail is in the message), or
            namespaces could not be made.
    """
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    gws = gateway_names(gateways)
    if netns:
        site_host = "10.250.1.1"
        listen = [f"10.250.{g + 1}.1" for g in range(gateways)]
        bridge_hosts = {g: f"10.250.{i + 1}.1" for i, g in enumerate(gws)}
    else:
        from tools.broker import free_port
        site_host, listen = "127.0.0.1", ["127.0.0.1"]
        bridge_hosts = dict.fromkeys(gws, "127.0.0.1")
    port = 18830 if netns else free_port()
    spec = {"cfg": cfg.as_dict(), "gateways": gateways, "workdir": str(work.resolve()),
            "site_host": site_host, "site_listen": listen, "site_port": port,
            "bridge_hosts": bridge_hosts, "round_timeout": round_timeout,
            "kill": list(kill) if kill else None, "timeout": timeout}
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}

    def command(ns: str | None, *args: str) -> list[str]:
        base = [sys.executable, "-m", "tools.hierarchy_mqtt", *args]
        return ["ip", "netns", "exec", ns, *base] if ns else base

    ctx = _Namespaces(gateways) if netns else None
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        if ctx is not None:
            ctx.__enter__()
        logs = {n: (work / f"{n}.log").open("wb") for n in ["site", *gws]}
        procs.append(("site", subprocess.Popen(command(ctx.site if ctx else None, "site",
                                                       str(spec_file)),
                                               stdout=logs["site"], stderr=subprocess.STDOUT,
                                               env=env)))
        for i, g in enumerate(gws):
            procs.append((g, subprocess.Popen(command(ctx.gws[i] if ctx else None, "gateway",
                                                      str(spec_file), str(i)),
                                              stdout=logs[g], stderr=subprocess.STDOUT,
                                              env=env)))
        deadline = time.monotonic() + timeout + 120
        for name, p in procs:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.returncode != 0:
                tail = (work / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{tail}")
        for f in logs.values():
            f.close()
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if ctx is not None:
            ctx.__exit__(None, None, None)
    result = json.loads((work / "site" / "result.json").read_text())
    result["gateway_reports"] = [json.loads((work / f"{g}.json").read_text()) for g in gws]
    result["netns"] = netns
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] not in ("site", "gateway"):
        print("usage: python -m tools.hierarchy_mqtt site|gateway SPEC [INDEX]", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[1]).read_text())
    if args[0] == "site":
        run_site(spec)
    else:
        run_gateway(spec, int(args[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
