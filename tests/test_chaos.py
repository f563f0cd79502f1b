"""Chaos over the links IoT devices really have (issue 13): real `fedge device` processes
reach the broker only through an impairment proxy (tools/impair.py: latency and jitter,
bandwidth caps, stalls, random TCP resets), while the test SIGKILLs and restarts the
aggregator and devices and restarts the broker, at times drawn from one seeded RNG.

Where this process may make network namespaces (root, ``ip``), the devices run in their own
namespace joined to the gateway's (this process: broker, aggregator, proxy) by a veth pair;
otherwise everything shares the loopback and the figures say why.

What must hold, whatever the chaos did:

- every round ends, completed or failed, and each failure names its cause;
- every completed round's unmasked sum is exactly its survivors' encoded inputs, each
  counted once (``ServiceFleet.check_sums``);
- no ledger double-spends: each ledger verifies, holds at most one reservation per round
  and one for every round its device survived (``ServiceFleet.check_ledger``), and a
  device uploads at most once per round across all its lives.

The default suite runs a short version; the long one is ``slow``. Replay a run with its
seed; write its figures as JSON with ``FEDGE_CHAOS_OUT``; ``FEDGE_CHAOS_NETNS=0`` keeps
everything on the loopback even where namespaces work::

    FEDGE_CHAOS_SEED=13 FEDGE_CHAOS_OUT=out/chaos.json \\
        .venv/bin/python -m pytest tests/test_chaos.py -m slow -s
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_services import FLEET, MODEL, POLICY, Proc, ServiceFleet, pump_until

from edge_sdk.device import DeviceConfig
from edge_sdk.engine import load_engine
from edge_sdk.ledger import Ledger
from models import ONNX_DIR
from tools.enroll import toml_text
from tools.impair import Impairment, Link, ProxyThread

pytestmark = pytest.mark.broker

SEED = int(os.environ.get("FEDGE_CHAOS_SEED", "13"))
_CLONE_NEWNET = 0x40000000


# ----------------------------------------------------------------------- namespaces


def netns_unavailable() -> str | None:
    """Why devices cannot get their own network namespace here (None: they can)."""
    if os.environ.get("FEDGE_CHAOS_NETNS") == "0":
        return "FEDGE_CHAOS_NETNS=0 asked for the loopback"
    if os.geteuid() != 0:
        return "not root: cannot create network namespaces"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is missing"
    if not Path("/proc/thread-self/ns/net").exists():
        return "no /proc/thread-self/ns/net"
    return None


class DeviceNetns:
    """A network namespace for the devices, joined to this process's namespace (the
    gateway) by a veth pair: gateway 10.213.S.1/30, devices 10.213.S.2/30."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.name = f"fedge-chaos-{pid}"
        self.gw_if, self.dev_if = f"fcg{pid % 100000}", f"fcd{pid % 100000}"
        sub = 4 * (pid % 60)
        self.gateway_ip, self.device_ip = f"10.213.{pid % 250}.{sub + 1}", \
            f"10.213.{pid % 250}.{sub + 2}"
        cmds = [["ip", "netns", "add", self.name],
                ["ip", "link", "add", self.gw_if, "type", "veth", "peer", "name", self.dev_if],
                ["ip", "link", "set", self.dev_if, "netns", self.name],
                ["ip", "addr", "add", f"{self.gateway_ip}/30", "dev", self.gw_if],
                ["ip", "link", "set", self.gw_if, "up"],
                ["ip", "-n", self.name, "addr", "add", f"{self.device_ip}/30", "dev",
                 self.dev_if],
                ["ip", "-n", self.name, "link", "set", self.dev_if, "up"],
                ["ip", "-n", self.name, "link", "set", "lo", "up"]]
        try:
            for c in cmds:
                subprocess.run(c, check=True, capture_output=True, timeout=30)
        except subprocess.CalledProcessError as e:
            self.close()
            raise OSError(f"{' '.join(c)}: {e.stderr.decode(errors='replace').strip()}") \
                from None

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """This thread in the devices' namespace (children started here inherit it)."""
        libc = ctypes.CDLL(None, use_errno=True)
        here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        there = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
        try:
            if libc.setns(there, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.name}")
            try:
                yield
            finally:
                if libc.setns(here, _CLONE_NEWNET) != 0:  # pragma: no cover
                    raise OSError(ctypes.get_errno(), "setns back to the gateway")
        finally:
            os.close(here)
            os.close(there)

    def close(self) -> None:
        # deleting the namespace deletes the veth pair with it
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.gw_if], capture_output=True, timeout=30)


# ----------------------------------------------------------------------- the run


@dataclass(frozen=True, slots=True, kw_only=True)
class ChaosPlan:
    """How much chaos: counts of each fault, spread uniformly over ``window_s`` seconds
    after the first check-ins, by a ``random.Random(seed)``."""

    devices: int
    rounds: int
    aggregator_kills: int
    device_kills: int
    broker_restarts: int
    link_outages: int
    window_s: float
    timeout_s: float
    link: Impairment  # every device's link
    capped_devices: int  # this many also get bandwidth_bps
    bandwidth_bps: float
    stage_timeout: float
    mass_kills: int = 0  # moments when mass_kill_size devices are SIGKILLed together
    mass_kill_size: int = 0


SHORT = ChaosPlan(devices=5, rounds=4, aggregator_kills=1, device_kills=1, broker_restarts=1,
                  link_outages=2, window_s=15.0, timeout_s=100.0,
                  link=Impairment(latency_s=0.2, jitter_s=0.1, stall_every_s=20.0, stall_s=1.0,
                                  reset_every_s=40.0),
                  capped_devices=2, bandwidth_bps=4000.0, stage_timeout=8.0)
LONG = ChaosPlan(devices=6, rounds=20, aggregator_kills=4, device_kills=5, broker_restarts=2,
                 link_outages=8, window_s=70.0, timeout_s=900.0,
                 link=Impairment(latency_s=0.2, jitter_s=0.1, stall_every_s=15.0, stall_s=1.5,
                                 reset_every_s=30.0),
                 capped_devices=2, bandwidth_bps=3000.0, stage_timeout=8.0,
                 mass_kills=1, mass_kill_size=4)


def schedule(plan: ChaosPlan, names: list[str], rng: random.Random) -> list[tuple[float, str,
                                                                                  str]]:
    """(seconds after start, action, target), sorted; the replayable part of a run."""
    acts = [(rng.uniform(2.0, plan.window_s), "kill_aggregator", "aggregator")
            for _ in range(plan.aggregator_kills)]
    acts += [(rng.uniform(2.0, plan.window_s), "kill_device", rng.choice(names))
             for _ in range(plan.device_kills)]
    acts += [(rng.uniform(2.0, plan.window_s), "restart_broker", "broker")
             for _ in range(plan.broker_restarts)]
    acts += [(rng.uniform(2.0, plan.window_s), "link_outage", rng.choice(names))
             for _ in range(plan.link_outages)]
    acts += [(rng.uniform(2.0, plan.window_s), "kill_many",
              ",".join(rng.sample(names, plan.mass_kill_size))) for _ in range(plan.mass_kills)]
    return sorted(acts)


def cause(detail: str) -> str:
    """A failure's cause with the numbers taken out (so causes can be counted)."""
    return re.sub(r"\d+", "N", detail)


class ChaosFleet(ServiceFleet):
    """Device processes only, each reaching the broker through its own impaired link."""

    def point_devices_at(self, links: dict[str, Link]) -> None:
        for name, link in links.items():
            path = self.fleet.device_configs[name]
            doc = tomllib.loads(path.read_text())
            host, port = link.address
            doc["broker"].update(host=host, port=port, keepalive_s=5, backoff_initial_s=0.2,
                                 backoff_max_s=2.0)
            path.write_text(toml_text(doc, comment=f"chaos: {name} through its impaired link"))


def run_chaos(tmp: Path, digits: Any, engine: Any, plan: ChaosPlan, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    why_no_ns = netns_unavailable()
    ns: DeviceNetns | None = None
    if why_no_ns is None:
        try:
            ns = DeviceNetns()
        except OSError as e:
            why_no_ns = f"could not set up namespaces: {e}"
    gateway = ns.gateway_ip if ns else "127.0.0.1"
    policy = {**POLICY, "cohort_size": plan.devices, "min_cohort": 3, "min_survivors": 3,
              "stage_timeout": plan.stage_timeout, "max_rounds": plan.rounds}
    f: ChaosFleet | None = None
    proxies = ProxyThread()
    try:
        f = ChaosFleet(tmp, digits, engine, devices=plan.devices, in_process=0, policy=policy,
                       broker_host=gateway)
        links = {}
        for i, name in enumerate(f.names):
            imp = plan.link
            if i < plan.capped_devices:
                imp = Impairment(**{**_fields(imp), "bandwidth_bps": plan.bandwidth_bps})
            links[name] = proxies.add(Link(name=name, listen=(gateway, 0),
                                           target=(gateway, f.broker.port), impairment=imp,
                                           seed=seed))
        f.point_devices_at(links)
        return _drive(f, plan, rng, links, proxies, ns, why_no_ns, seed)
    finally:
        proxies.close()
        if f is not None:
            f.close()
        if ns is not None:
            ns.close()


def _fields(imp: Impairment) -> dict[str, Any]:
    return {k: getattr(imp, k) for k in imp.__slots__}  # type: ignore[attr-defined]


def _drive(f: ChaosFleet, plan: ChaosPlan, rng: random.Random, links: dict[str, Link],
           proxies: ProxyThread, ns: DeviceNetns | None, why_no_ns: str | None,
           seed: int) -> dict[str, Any]:
    lives: dict[str, list[Proc]] = {n: [] for n in f.names}

    def start_device(name: str) -> None:
        with ns.entered() if ns is not None else contextlib.nullcontext():
            lives[name].append(f.start_device(name))

    for name in f.names:
        start_device(name)
    aggs = [f.start_aggregator("--exit-when-done")]
    acts = schedule(plan, f.names, rng)
    restarts: list[tuple[float, str, str]] = []
    done: list[dict[str, Any]] = []
    start = time.monotonic()
    # the faults' clock starts with round 1 (device processes take a while to start)
    f.wait_line(aggs[0], lambda e: e["event"] == "stage" and e["round"] == 1, plan.timeout_s,
                "round 1")
    t0 = time.monotonic()

    def agg_stage() -> str | None:
        stages = [e for e in aggs[-1].lines if e["event"] in ("stage", "start")]
        return f"{stages[-1].get('round')}/{stages[-1].get('stage')}" if stages else None

    def step() -> bool:
        now = time.monotonic() - t0
        while acts and acts[0][0] <= now:
            _, act, target = acts.pop(0)
            agg = aggs[-1]
            if act == "kill_aggregator" and agg.p.poll() is None:
                agg.drain()
                where = agg_stage()
                agg.signal(signal.SIGKILL)
                agg.wait()
                done.append({"t": round(now, 1), "action": act, "at": where})
                restarts.append((now + rng.uniform(0.5, 3.0), "aggregator", ""))
            elif act == "kill_device" and lives[target][-1].p.poll() is None:
                lives[target][-1].signal(signal.SIGKILL)
                lives[target][-1].wait()
                done.append({"t": round(now, 1), "action": act, "device": target,
                             "at": agg_stage()})
                restarts.append((now + rng.uniform(0.5, 4.0), "device", target))
            elif act == "kill_many":  # more at once than min_survivors tolerates
                hit = [n for n in target.split(",") if lives[n][-1].p.poll() is None]
                for n in hit:
                    lives[n][-1].signal(signal.SIGKILL)
                    lives[n][-1].wait()
                    restarts.append((now + rng.uniform(2.0, 6.0), "device", n))
                done.append({"t": round(now, 1), "action": act, "devices": hit,
                             "at": agg_stage()})
            elif act == "restart_broker":
                f.broker.restart()
                done.append({"t": round(now, 1), "action": act, "at": agg_stage()})
            elif act == "link_outage":
                n = proxies.reset(links[target])
                done.append({"t": round(now, 1), "action": act, "device": target,
                             "connections": n, "at": agg_stage()})
        for r in sorted(restarts):
            if r[0] <= now:
                restarts.remove(r)
                if r[1] == "aggregator":
                    aggs.append(f.start_aggregator("--exit-when-done"))
                else:
                    start_device(r[2])
        agg = aggs[-1]
        return agg.p.poll() is not None and not restarts and not acts

    pump_until(None, step, plan.timeout_s, f.procs, "the rounds under chaos")
    elapsed = time.monotonic() - start
    assert aggs[-1].wait() == 0, aggs[-1].lines[-5:]
    for name in f.names:
        p = lives[name][-1]
        if p.p.poll() is None:
            p.signal(signal.SIGTERM)
            assert p.wait(30) == 0, (name, p.lines[-5:])

    # ---- what must hold
    m = f.machine()
    assert [o.round_id for o in m.history] == list(range(1, plan.rounds + 1))
    failed = [o for o in m.history if not o.completed]
    assert all(o.detail for o in failed), [(o.round_id, o.detail) for o in failed]
    f.check_sums(m)  # every completed round's sum: its survivors' inputs, each once
    ledgers: dict[str, dict[str, Any]] = {}
    for name in f.names:
        cfg = DeviceConfig.from_toml(f.fleet.device_configs[name])
        with Ledger.open(cfg.ledger, create=False) as led:  # opening verifies the whole file
            keys = f.check_ledger(led, m, name)
            pending = len(led.pending())
        uploads = [e["round"] for p in lives[name] for e in p.lines if e["event"] == "uploaded"]
        assert len(uploads) == len(set(uploads)), (name, uploads)  # once per round, all lives
        assert {f"{FLEET}/{r}" for r in uploads} <= set(keys), (name, uploads, keys)
        ledgers[name] = {"reservations": len(keys), "uploads": len(uploads), "pending": pending,
                         "lives": len(lives[name])}
    ends = [e for a in aggs for e in a.lines if e["event"] == "round_end"]
    stats = {n: lk.stats.as_dict() for n, lk in links.items()}
    total = Counter()
    for s in stats.values():
        total.update({k: v for k, v in s.items() if k not in ("mean_delay_s", "max_delay_s")})
    chunks = sum(lk.stats.chunks for lk in links.values())
    figures = {
        "seed": seed, "plan": {k: getattr(plan, k) for k in plan.__slots__ if k != "link"},
        "link": _fields(plan.link),
        "netns": ns is not None, "netns_skipped_because": why_no_ns,
        "elapsed_s": round(elapsed, 1),
        "rounds": {"completed": sum(o.completed for o in m.history), "failed": len(failed),
                   "failed_by_cause": dict(Counter(cause(o.detail) for o in failed)),
                   "survivors": [len(o.survivors) for o in m.history],
                   "model_version": m.model_version},
        "sums_exact": sum(o.completed for o in m.history),
        "round_end_lines": len(ends),
        "actions": done,
        "ledgers": ledgers,
        "proxy": {"total": {**dict(total), "mean_delay_s": round(
            sum(lk.stats.delay_sum_s for lk in links.values()) / chunks, 4) if chunks else 0},
            "per_device": stats},
    }
    assert m.model_version == figures["rounds"]["completed"]  # each update applied once
    return figures


@pytest.fixture(scope="module")
def engine() -> Any:
    return load_engine(ONNX_DIR / f"{MODEL}.json")


@pytest.fixture
def chaos(tmp_path: Path, digits: Any, engine: Any) -> Callable[[ChaosPlan], dict[str, Any]]:
    def run(plan: ChaosPlan) -> dict[str, Any]:
        figures = run_chaos(tmp_path, digits, engine, plan, SEED)
        text = json.dumps(figures, indent=1)
        print("\n" + text)
        out = os.environ.get("FEDGE_CHAOS_OUT")
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(text + "\n")
        return figures

    return run


def test_chaos_short(chaos: Callable[[ChaosPlan], dict[str, Any]]) -> None:
    """Five devices over impaired links; one aggregator kill, one device kill, one broker
    restart, two link outages; four rounds end, each completed one exact."""
    fig = chaos(SHORT)
    kinds = Counter(a["action"] for a in fig["actions"])
    # the chaos really happened (the aggregator was alive and the device running)
    assert kinds["kill_aggregator"] == 1 and kinds["kill_device"] == 1
    assert kinds["restart_broker"] == 1 and kinds["link_outage"] == 2
    assert fig["rounds"]["completed"] >= 1
    assert all(s["connections"] >= 1 for s in fig["proxy"]["per_device"].values())
    assert fig["proxy"]["total"]["bytes_up"] > 0 and fig["proxy"]["total"]["mean_delay_s"] > 0.1


@pytest.mark.slow
def test_chaos_long(chaos: Callable[[ChaosPlan], dict[str, Any]]) -> None:
    """The long run whose figures docs/chaos.md reports."""
    fig = chaos(LONG)
    assert fig["rounds"]["completed"] >= LONG.rounds // 2
