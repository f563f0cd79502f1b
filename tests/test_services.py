"""The real services over a real mosquitto: `fedge aggregator` and `fedge device` processes,
enrollment files, crashes and restarts (issue 6, "Must show 2").

Each test starts its own broker (``tools.broker.Broker``, TLS + passwords + ACLs) and a
fleet directory written by ``tools.enroll.enroll``. The aggregator always runs as a real
``fedge aggregator`` subprocess; most devices are ``DeviceSession`` s on one ``MqttLoop`` in
this process (pumped while the test waits), one is a real ``fedge device`` subprocess.
Nothing counted twice is checked bit for bit: every completed round's unmasked integer
sum must equal the sum of its survivors' encoded inputs (in-process sessions keep theirs;
the device process writes its own with ``--audit``), and every ledger must hold at most
one reservation per round.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aggregator.rounds import RoundMachine
from aggregator.service import AggregatorConfig
from aggregator.store import CheckpointStore
from edge_sdk import wire
from edge_sdk.config import (
    ConfigError,
    load_aggregator_identity,
    load_device_identity,
    load_registry,
)
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.device import DeviceConfig
from edge_sdk.engine import load_engine
from edge_sdk.ledger import Ledger
from edge_sdk.mqtt import BrokerAddress, ClientConfig, MqttLoop
from edge_sdk.session import DeviceSession
from edge_sdk.wire import Publish
from models import ONNX_DIR
from tools.broker import Broker
from tools.enroll import enroll
from tools.partition import partition

pytestmark = pytest.mark.broker

FLEET = "svc"
MODEL = "logreg-64-10"
REPO = Path(__file__).resolve().parents[1]
POLICY = {"cohort_size": 6, "min_cohort": 3, "min_survivors": 3, "checkin_window": 3.0,
          "stage_timeout": 4.0,
          "steps": 3, "batch_size": 16, "lr": 0.5, "noise_multiplier": 1.0,
          "value_bound": 2.0, "seed": 7}


# ----------------------------------------------------------------------- processes


class Proc:
    """A `fedge` subprocess whose stdout JSON lines are collected by a reader thread."""

    def __init__(self, args: list[str], log: Path, *,
                 command: Sequence[str] = (sys.executable, "-m", "tools.cli"),
                 cwd: Path = REPO, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.lines: list[dict[str, Any]] = []
        # wait_line searches from just after its last match, not from the end of `lines`:
        # one drain can bring the awaited line and the next one together.
        self.cursor = 0
        self._q: queue.Queue[dict[str, Any]] = queue.Queue()
        self._err = open(log, "ab")  # noqa: SIM115 (closed in wait/kill)
        self.p = subprocess.Popen([*command, *args], cwd=cwd, env=env,
                                  stdout=subprocess.PIPE, stderr=self._err,
                                  start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for raw in self.p.stdout:
            try:
                self._q.put(json.loads(raw))
            except ValueError:
                self._q.put({"event": "non-json", "text": raw.decode(errors="replace")})

    def drain(self) -> list[dict[str, Any]]:
        new = []
        while True:
            try:
                new.append(self._q.get_nowait())
            except queue.Empty:
                self.lines += new
                return new

    def signal(self, sig: int) -> None:
        os.kill(self.p.pid, sig)

    def wait(self, timeout: float = 20.0) -> int:
        rc = self.p.wait(timeout)
        self._reader.join(5.0)
        self.drain()
        if self.p.stdout is not None:
            self.p.stdout.close()
        self._err.close()
        return rc

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        if not self._err.closed:
            self.wait()


def pump_until(loop: MqttLoop | None, cond: Callable[[], bool], timeout: float,
               procs: list[Proc] = (), what: str = "") -> None:  # type: ignore[assignment]
    """Run the in-process loop (if any) until ``cond()``, failing on a dead process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if loop is not None:
            loop.run(timeout=0.02)
        else:
            time.sleep(0.02)
        for p in procs:
            p.drain()
        if cond():
            return
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last lines: "
                         f"{[p.lines[-5:] for p in procs]}")


# ----------------------------------------------------------------------- the fleet


@pytest.fixture(scope="module")
def engine() -> Any:
    return load_engine(ONNX_DIR / f"{MODEL}.json")


class ServiceFleet:
    """Broker + enrolled fleet directory + in-process device sessions on one loop."""

    def __init__(self, tmp: Path, digits: Any, engine: Any, *, devices: int,
                 in_process: int, policy: dict[str, Any], broker_host: str = "127.0.0.1") -> None:
        self.tmp = tmp
        self.names = [f"dev-{i:04d}" for i in range(devices)]
        self.broker = Broker(devices=self.names, fleet=FLEET, directory=tmp / "broker",
                             host=broker_host)  # type: ignore[arg-type]
        self.broker.start()
        self.fleet = enroll(tmp / "fleet", devices=self.names, fleet=FLEET,
                            broker_config=self.broker.config, policy=policy,
                            budget_epsilon=1000.0, model=MODEL, metrics_port=0,
                            device_settings={"checkin_every": 1.0})
        assert self.fleet.aggregator_config is not None
        self.agg_config = self.fleet.aggregator_config
        self.policy = AggregatorConfig.from_toml(self.agg_config).policy
        self.registry = load_registry(self.fleet.registry, fleet=FLEET)
        self.shards = partition(digits.y_train, devices, "iid", np.random.default_rng(0))
        c = self.broker.config
        self.loop = MqttLoop(BrokerAddress(host=c.host, port=c.port, ca_file=str(c.ca_file)),
                             rng=random.Random(0))
        self.sessions: dict[str, DeviceSession] = {}
        self.ledgers: dict[str, Ledger] = {}
        for name in self.names[:in_process]:
            cfg = DeviceConfig.from_toml(self.fleet.device_configs[name])
            self.ledgers[name] = Ledger.open(cfg.ledger, device_id=name, create=False)
            idx = self.shards[self.names.index(name)]
            x, y = digits.x_train[idx], digits.y_train[idx]
            s = DeviceSession(fleet=FLEET, identity=load_device_identity(cfg.identity),
                              registry=self.registry, ledger=self.ledgers[name],
                              engine=engine, spec=engine.spec, data=lambda x=x, y=y: (x, y),
                              round_rng=seeded_round_rng(self.names.index(name)),
                              checkin_every=1.0)
            self.sessions[name] = s
            self.loop.add(self.client(name), self.wrap(name, s))
        self.procs: list[Proc] = []

    def wrap(self, name: str, session: DeviceSession) -> Any:
        return session

    def client(self, name: str) -> ClientConfig:
        return ClientConfig(username=name, password=self.broker.config.password(name),
                            status_topic=wire.status_topic(FLEET, name),
                            backoff_initial_s=0.05, backoff_max_s=1.0)

    def start_aggregator(self, *extra: str) -> Proc:
        p = Proc(["aggregator", "--config", str(self.agg_config), *extra],
                 self.tmp / "aggregator.err")
        self.procs.append(p)
        return p

    def start_device(self, name: str) -> Proc:
        i = self.names.index(name)
        p = Proc(["device", "--config", str(self.fleet.device_configs[name]), "--dataset",
                  "digits", "--shard", str(i), "--shards", str(len(self.names)), "--audit",
                  str(self.tmp / "audit")], self.tmp / f"{name}.err")
        self.procs.append(p)
        return p

    def wait_line(self, proc: Proc, pred: Callable[[dict[str, Any]], bool], timeout: float,
                  what: str) -> dict[str, Any]:
        start = proc.cursor
        found: list[int] = []

        def cond() -> bool:
            dead = proc.p.poll() is not None
            if dead:
                proc.drain()
            found[:] = [i for i in range(start, len(proc.lines)) if pred(proc.lines[i])][:1]
            if not found and dead:
                raise AssertionError(f"{proc.args[0]} exited {proc.p.returncode} before "
                                     f"{what}; see {self.tmp}/*.err; {proc.lines[-5:]}")
            return bool(found)

        pump_until(self.loop, cond, timeout, self.procs, what)
        proc.cursor = found[0] + 1
        return proc.lines[found[0]]

    def machine(self) -> RoundMachine:
        """The aggregator's state from its checkpoint (after it stopped)."""
        cfg = AggregatorConfig.from_toml(self.agg_config)
        return RoundMachine.restore(CheckpointStore(cfg.checkpoint).load(), policy=cfg.policy,
                                    identity=load_aggregator_identity(cfg.identity),
                                    registry=self.registry)

    def encoded_input(self, device: str, round_id: int) -> np.ndarray | None:
        if device in self.sessions:
            return self.sessions[device].encoded_input(round_id)
        f = self.tmp / "audit" / f"{device}-round-{round_id}.npy"
        return np.load(f, allow_pickle=False) if f.exists() else None

    def check_sums(self, m: RoundMachine) -> None:
        """Each completed round's sum is its survivors' inputs, each counted once."""
        mask = np.uint64((1 << m.policy.bits) - 1)
        for o in m.history:
            if not o.completed:
                continue
            want = np.zeros_like(o.total)
            for dev in o.survivors:
                x = self.encoded_input(dev, o.round_id)
                assert x is not None, (dev, o.round_id)
                want = want + x
            assert np.array_equal(o.total, want & mask), f"round {o.round_id}"

    def check_ledger(self, ledger: Ledger, m: RoundMachine, name: str) -> list[str]:
        keys = [r.plan.round_id for r in ledger.reservations()]
        assert len(keys) == len(set(keys)), (name, keys)  # one reservation per round at most
        for o in m.history:
            if name in o.survivors:
                assert f"{FLEET}/{o.round_id}" in keys, (name, o.round_id)
        return keys

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        self.loop.close(timeout=1.0)
        for led in self.ledgers.values():
            led.close()
        self.broker.stop()


class Freezer:
    """A device session that stops answering once it receives a chosen message (kept, not
    lost) until unfrozen: it holds the aggregator in a stage for as long as the test needs,
    so a SIGKILL lands in that stage and not in the next one."""

    def __init__(self, session: DeviceSession) -> None:
        self.s = session
        self.freeze_on: Callable[[str, bytes], bool] | None = None
        self.frozen = False
        self.held: list[tuple[str, bytes]] = []

    def subscriptions(self) -> list[str]:
        return self.s.subscriptions()

    def on_connect(self, now: float) -> list[Publish]:
        return self.s.on_connect(now)

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        if self.frozen or (self.freeze_on is not None and self.freeze_on(topic, payload)):
            self.frozen = True
            self.held.append((topic, payload))
            return []
        return self.s.on_message(topic, payload, now)

    def on_tick(self, now: float) -> list[Publish]:
        if self.frozen:
            return []
        out: list[Publish] = []
        while self.held:
            out += self.s.on_message(*self.held.pop(0), now)
        return out + self.s.on_tick(now)


def _secagg_kind(topic: str, payload: bytes) -> str | None:
    kind = topic.rsplit("/", 1)[1]
    return kind if "/down/" in topic and kind in wire.SECAGG_DOWN else None


def _model_version(payload: bytes) -> int:
    msg = wire.decode(payload, wire.ALL_KINDS)
    assert isinstance(msg, wire.ModelUpdate), msg
    return msg.version


# The message each stage of a round sends the devices: frozen on it, they cannot answer
# and the aggregator stays in that stage.
STAGE_TRIGGERS: dict[str, Callable[[str, bytes], bool]] = {
    "collect_keys": lambda t, p: t.endswith("/down/plan"),
    "collect_shares": lambda t, p: _secagg_kind(t, p) == "neighbour_keys",
    "collect_masked": lambda t, p: _secagg_kind(t, p) == "forwarded_shares",
    "collect_unmask": lambda t, p: _secagg_kind(t, p) == "unmask_request",
    # only a model newer than v0: every restarted aggregator re-publishes the retained
    # model it holds, and freezing on that v0 would stop devices before they answer the
    # requests the restart re-sends (the round would then fail at its deadline)
    "idle": lambda t, p: t == wire.model_topic(FLEET) and _model_version(p) >= 1,
}


class FrozenFleet(ServiceFleet):
    def wrap(self, name: str, session: DeviceSession) -> Any:
        self.freezers = getattr(self, "freezers", {})
        self.freezers[name] = Freezer(session)
        return self.freezers[name]

    def freeze_on(self, stage: str | None) -> None:
        for fz in self.freezers.values():
            fz.freeze_on = None if stage is None else STAGE_TRIGGERS[stage]
            fz.frozen = False  # held messages are replayed on the next tick


@pytest.fixture
def make_fleet(tmp_path: Path, digits: Any, engine: Any):
    made: list[ServiceFleet] = []

    def make(cls: type[ServiceFleet] = ServiceFleet, **kw: Any) -> Any:
        f = cls(tmp_path, digits, engine, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


# ----------------------------------------------------------------------- enrollment


def test_enroll_writes_a_usable_private_fleet_directory(tmp_path: Path) -> None:
    out = enroll(tmp_path / "f", devices=3, fleet="lab", port=18883, budget_epsilon=5.0,
                 policy={"cohort_size": 3})
    reg = json.loads(out.registry.read_text())
    assert reg["format"] == "fedge-registry" and sorted(reg["devices"]) == [
        "dev-0000", "dev-0001", "dev-0002"]
    registry = load_registry(out.registry, fleet="lab")
    for name, path in out.device_configs.items():
        cfg = DeviceConfig.from_toml(path)
        assert (cfg.device, cfg.broker_port, cfg.budget_epsilon) == (name, 18883, 5.0)
        assert cfg.ca_file is not None and cfg.ca_file.exists()
        for secret in (cfg.identity, cfg.password_file):
            assert secret.stat().st_mode & 0o777 == 0o600
        ident = load_device_identity(cfg.identity, fleet="lab", device=name)
        assert registry.devices[name] == ident.enrollment()
        with Ledger.open(cfg.ledger, create=False) as led:  # provisioned, fail-closed open
            assert led.device_id == name and led.budget.epsilon == 5.0
    acfg = AggregatorConfig.from_toml(out.aggregator_config)
    assert load_aggregator_identity(acfg.identity).public_key == registry.aggregator_key
    assert acfg.policy.cohort_size == 3 and acfg.metrics_port == 9464
    # refusals: enrolling over a fleet, a key file others can read, the wrong device's keys
    with pytest.raises(ValueError, match="already holds"):
        enroll(tmp_path / "f", devices=3, fleet="lab")
    key = out.device_configs["dev-0000"].parent / "identity.key"
    os.chmod(key, 0o644)
    with pytest.raises(ConfigError, match="group/others"):
        load_device_identity(key)
    os.chmod(key, 0o600)
    with pytest.raises(ConfigError, match="not 'dev-0001'"):
        load_device_identity(key, device="dev-0001")
    # nothing pickled anywhere: every non-ledger file is text
    for f in (tmp_path / "f").rglob("*"):
        if f.is_file() and f.suffix != ".db":
            f.read_text()


def test_enroll_cli(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "tools.cli", "enroll", "--devices", "3",
                        "--fleet", "lab", "--out", str(tmp_path / "f"), "--no-tls",
                        "--no-ledgers"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "fedge aggregator --config" in r.stdout
    assert "--data FILE.npz (its owner's data" in r.stdout
    assert (tmp_path / "f" / "broker" / "mosquitto.conf").exists()
    assert not (tmp_path / "f" / "devices" / "dev-0000" / "ledger.db").exists()


# ----------------------------------------------------------------------- crashes


def test_aggregator_sigkilled_at_every_stage_and_a_device_killed_mid_round(
        make_fleet: Callable[..., Any]) -> None:
    """SIGKILL the aggregator right after it enters each stage of round 1 (and after the
    round ends), restart it with the same config each time; then SIGKILL the device
    process right after its round-2 upload and restart it. Three rounds complete; every
    sum counts each survivor once; no ledger holds two reservations for a round and the
    device process uploaded at most once per round across both of its lives."""
    # in-process devices freeze on each stage's message so every kill lands in its stage;
    # the long stage timeout keeps a slow restart from dropping the frozen devices
    f = make_fleet(FrozenFleet, devices=6, in_process=5,
                   policy={**POLICY, "max_rounds": 3, "stage_timeout": 30.0})
    dev = f.names[5]
    device = f.start_device(dev)
    f.wait_line(device, lambda e: e["event"] == "connected", 60, "the device process")
    agg = f.start_aggregator("--exit-when-done")
    t0 = time.monotonic()
    kills = []
    for target in [(1, "collect_keys"), (1, "collect_shares"), (1, "collect_masked"),
                   (1, "collect_unmask"), (1, "idle")]:
        f.freeze_on(target[1])
        f.wait_line(agg, lambda e, t=target: e["event"] == "stage"
                    and (e["round"], e["stage"]) == t, 60, f"stage {target}")
        agg.signal(signal.SIGKILL)
        assert agg.wait() == -signal.SIGKILL
        kills.append(target)
        agg = f.start_aggregator("--exit-when-done")
        start = f.wait_line(agg, lambda e: e["event"] == "start", 30, "restart")
        assert start["resumed"] is True and start["stage"] == target[1], (target, start)
    f.freeze_on(None)
    up = f.wait_line(device, lambda e: e["event"] == "uploaded" and e["round"] >= 2, 60,
                     "the device's round-2 upload")
    device.signal(signal.SIGKILL)
    device.wait()
    first_life = list(device.lines)
    device = f.start_device(dev)
    again = f.wait_line(device, lambda e: e["event"] == "start", 60, "device restart")
    assert again["reservations"] == len([e for e in first_life if e["event"] == "uploaded"])
    pump_until(f.loop, lambda: agg.p.poll() is not None, 120, f.procs, "three rounds")
    assert agg.wait() == 0
    elapsed = time.monotonic() - t0
    device.signal(signal.SIGTERM)
    assert device.wait() == 0

    m = f.machine()
    assert [(o.round_id, o.completed) for o in m.history] == [(1, True), (2, True), (3, True)]
    assert m.model_version == 3  # each round's update applied exactly once
    assert set(m.history[0].survivors) == set(f.names)  # round 1 survived five kills whole
    f.check_sums(m)
    for name, led in f.ledgers.items():
        f.check_ledger(led, m, name)
    cfg = DeviceConfig.from_toml(f.fleet.device_configs[dev])
    with Ledger.open(cfg.ledger, create=False) as led:
        keys = f.check_ledger(led, m, dev)
    uploads = [e["round"] for e in first_life + device.lines if e["event"] == "uploaded"]
    assert len(uploads) == len(set(uploads)), uploads  # never uploaded twice for a round
    assert sorted(f"{FLEET}/{r}" for r in uploads) == sorted(keys)
    assert up["round"] in uploads
    print(f"\n5 aggregator kills + 1 device kill, 3 rounds: {elapsed:.1f} s; "
          f"survivors {[len(o.survivors) for o in m.history]}")


def test_broker_restart_mid_round_the_fleet_reconnects_and_continues(
        make_fleet: Callable[..., ServiceFleet]) -> None:
    f = make_fleet(devices=5, in_process=5,
                   policy={**POLICY, "cohort_size": 5, "max_rounds": 2})
    agg = f.start_aggregator("--exit-when-done")
    start = f.wait_line(agg, lambda e: e["event"] == "start", 30, "the aggregator")
    connects = f.loop.stats.connects
    f.wait_line(agg, lambda e: e["event"] == "stage" and e["stage"] == "collect_shares", 60,
                "round 1's share stage")
    t0 = time.monotonic()
    f.broker.restart()
    pump_until(f.loop, lambda: agg.p.poll() is not None, 90, f.procs, "two rounds")
    assert agg.wait() == 0
    assert f.loop.stats.connects >= connects + 5  # every device came back
    m = f.machine()
    assert [(o.round_id, o.completed) for o in m.history] == [(1, True), (2, True)]
    f.check_sums(m)
    for name, led in f.ledgers.items():
        f.check_ledger(led, m, name)
    ends = [e for e in agg.lines if e["event"] == "round_end"]
    assert [e["survivors"] for e in ends] == [len(o.survivors) for o in m.history]
    assert all(e["bytes_in"] > 0 and e["duration_s"] >= 0 for e in ends)
    assert start["metrics_port"]
    print(f"\nbroker restart mid-round, rounds done {time.monotonic() - t0:.1f} s later")


def test_metrics_endpoint_and_sigterm(make_fleet: Callable[..., ServiceFleet]) -> None:
    f = make_fleet(devices=3, in_process=0, policy={**POLICY, "cohort_size": 3})
    agg = f.start_aggregator()
    start = f.wait_line(agg, lambda e: e["event"] == "start", 30, "the aggregator")
    url = f"http://127.0.0.1:{start['metrics_port']}/metrics"
    pump_until(None, lambda: b"fedge_aggregator_connected 1.0" in urllib.request.urlopen(
        url, timeout=5).read(), 20, [agg], "connected gauge")
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for name in ("fedge_aggregator_stage{stage=\"idle\"} 1.0", "fedge_aggregator_round ",
                 "fedge_aggregator_model_version 0.0", "fedge_aggregator_rejected_messages_total"):
        assert name in text, name
    agg.signal(signal.SIGTERM)
    assert agg.wait() == 0
    assert agg.lines[-1]["event"] == "stop"
    assert CheckpointStore(AggregatorConfig.from_toml(f.agg_config).checkpoint).exists()
