"""Benchmark 6: the Pi-class envelope — a real device agent on one core under 512 MiB.

One round of the real services over a real broker, with one device measured:

* a mosquitto (``tools.broker.Broker``: TLS, per-device passwords, ACLs) and a fleet
  directory written by ``tools.enroll.enroll`` for a cohort of 10 devices, every
  ``device.toml`` and the ``aggregator.toml`` naming the Fed-SPA CNN
  (``model = "cnn-1x28x28-10"``, enroll's ``model`` argument);
* the aggregator as a real ``fedge aggregator --config ... --exit-when-done`` process
  (policy: cohort 10 = every device, one round, tau = 20 Poisson-sampled steps at
  expected batch 32, lr 0.05, C = 1, z = 1, values clamped to +-1, a 32-bit ring;
  SecAgg+ with the policy's default degree);
* the measured device as a real agent process::

      taskset -c 0 prlimit --as=536870912 -- fedge device --config <dev-0000>/device.toml \
          --dataset fashion-mnist --shard 0 --shards 10 --rounds 1 --audit <dir>

  ``prlimit --as`` sets ``RLIMIT_AS`` (virtual address space, the same cap as
  ``ulimit -v 524288``; stricter than a resident-memory cap, since it also counts
  reserved-but-untouched mappings) on itself and execs the agent; no cgroup is used.
  The ``fedge device`` CLI reads and standardises the whole Fashion-MNIST training set
  (60,000 images, float32 temporaries) before indexing its shard, and that does not fit
  in 512 MiB of address space beside the agent's libraries: when the agent fails so, the
  benchmark reports the failure and its reason, runs the same command under
  ``RLIMIT_DATA`` = 512 MiB (``prlimit --data``: heap and private writable mappings, not
  the libraries' or thread stacks' reservations), and runs the same agent
  (``edge_sdk.device.Device`` with the CLI's JSON lines) under ``RLIMIT_AS`` = 512 MiB in a
  script that reads only its shard from ``.npy`` files, as a device's own software would;
* the nine other devices as ``DeviceSession`` s on one ``MqttLoop`` in this process.

This process, the broker, the aggregator and the nine sessions run on the other CPUs
(this process's affinity minus CPU 0, inherited by the children it starts); only the
agent is on CPU 0. Nothing else is pinned away, so other load on the machine shares it.

Measured, for the agent:

* peak RSS: ``ru_maxrss`` from ``wait4`` in a small launcher process that forks and execs
  the agent (a child spawned straight from this large process would carry this process's
  high-water mark in its ``ru_maxrss``: Linux keeps it across exec), beside ``VmHWM`` and
  ``VmPeak`` (peak virtual size, what ``RLIMIT_AS`` bounds) sampled from
  ``/proc/<pid>/status`` every 50 ms (both are high-water marks since exec; growth after
  the last sample is missed); its CPU seconds (user + system) from the same ``wait4``;
* the round as it experienced it, from the JSON log lines (``ts``, ms resolution) of the
  agent and the aggregator, one clock: plan published (the aggregator's ``stage`` line
  ``collect_keys``) -> agent trained and advertised (its ``round`` line, emitted after the
  local round, the fixed-point encoding and key generation) -> shares forwarded (the
  aggregator's ``collect_masked``) -> agent uploaded (``uploaded``: masked, reserved in
  its ledger, chunked) -> agent holds the new model (``round_end``, ``contributed``);
* bytes: the upload's payload bytes (the agent's ``uploaded`` line); every byte of its
  broker connection over its whole life, counted by a loopback TCP relay in this process
  that the agent's ``device.toml`` points at (TLS records, MQTT framing, the retained
  model, check-ins, the new model); the whole round's payload bytes at the aggregator
  (its ``round_end`` line: ``bytes_in`` from all devices, ``bytes_out`` to them);
* the round's outcome: completed, the agent among the survivors, and ``exact``: the
  aggregator's unmasked sum (from its checkpoint) equals the sum of the survivors'
  encoded inputs (the agent's written with ``--audit``, the sessions' kept in memory).

Floors, measured afterwards in a probe process started the same way (``taskset -c 0
prlimit --as=...``): the local round's matmul FLOPs over the pinned 1-thread sgemm rate,
and the ChaCha20 PRG expansion of the k + 1 masks the device adds; the probe also times
the same local round (random data of the shard's shape) alone, to split the agent's
plan -> trained interval into training and the rest.

The wheel check asks PyPI (``pip download --only-binary=:all: --platform P
--python-version 3.11 --no-deps``, P = manylinux2014_aarch64, then manylinux_2_28_aarch64)
for each distribution of the device stack at the version installed here.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from tools.bench.client import REPO

__all__ = ["MEMORY_CAP_MIB", "AgentFailed", "aarch64_wheels", "run_agent_round",
           "run_envelope_bench"]

MEMORY_CAP_MIB = 512
COHORT = 10
FLEET = "envelope"
MODEL = "cnn-1x28x28-10"
DATASET = "fashion-mnist"
STEPS = 20
BATCH = 32
LIMITS = {"as": "--as", "data": "--data"}  # prlimit option per RLIMIT_AS / RLIMIT_DATA


def _policy(cohort: int, steps: int, batch_size: int) -> dict[str, Any]:
    return {"cohort_size": cohort, "stage_timeout": 60.0, "max_rounds": 1,
            "steps": steps, "batch_size": batch_size, "lr": 0.05, "clip": 1.0,
            "noise_multiplier": 1.0, "value_bound": 1.0, "bits": 32, "seed": 8}


_PROBE = r'''
import json, math, sys, time
import numpy as np
from edge_sdk.csprng import SecureRng
from edge_sdk.engine import load_engine
from edge_sdk.model import init_params
from edge_sdk.hazmat.prg import expand
from edge_sdk.hazmat.ring import Ring
from edge_sdk.train import LocalTraining, local_round
from models import ONNX_DIR
model, samples, steps, batch, masks, dim = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                            int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
rng = np.random.default_rng(8)
n = 512
a = rng.standard_normal((n, n), dtype=np.float32); b = a.T.copy(); c = np.empty_like(a)
np.matmul(a, b, out=c)
best = math.inf
for _ in range(7):
    t = time.perf_counter(); np.matmul(a, b, out=c); best = min(best, time.perf_counter() - t)
gflops = 2 * n ** 3 / best / 1e9
ring = Ring(bits=32)  # the fleet's ring: the mask PRG writes 4 bytes per value
buf = np.empty(dim, dtype=ring.dtype)
seeds = [bytes([i]) * 32 for i in range(masks)]
prg = math.inf
for _ in range(5):
    t = time.perf_counter()
    for s in seeds:
        expand(s, dim, ring, out=buf)
    prg = min(prg, time.perf_counter() - t)
engine = load_engine(ONNX_DIR / f"{model}.json", threads=1)
x = rng.standard_normal((samples, *engine.spec.input_shape)).astype(np.float32)
y = rng.integers(0, engine.spec.num_classes, samples)
params = init_params(engine.spec, rng)
train = LocalTraining(steps=steps, batch_size=batch, lr=0.05, clip=1.0, noise_multiplier=1.0)
local_round(engine, params, x, y, train, SecureRng())  # warm-up (the device's sampler)
times = []
for _ in range(3):
    t = time.perf_counter(); local_round(engine, params, x, y, train, SecureRng())
    times.append(time.perf_counter() - t)
print(json.dumps({"sgemm_gflops_pinned": gflops, "prg_floor_s": prg,
                  "local_round_probe_s": sorted(times)[1]}))
'''


_EMBEDDED = r'''
import json, os, sys, time
from pathlib import Path
import numpy as np
from edge_sdk.device import Device, DeviceConfig
config = DeviceConfig.from_toml(sys.argv[1], zoo_dir=sys.argv[5])
x, y, audit = np.load(sys.argv[2]), np.load(sys.argv[3]), Path(sys.argv[4])
holder = []
def emit(event):
    if event["event"] == "uploaded" and holder:
        np.save(audit / f"{config.device}-round-{event['round']}.npy",
                holder[0].session.encoded_input(event["round"]), allow_pickle=False)
    print(json.dumps({"ts": round(time.time(), 3), "device": config.device, **event}),
          flush=True)
device = Device(config, data=lambda: (x, y), on_event=emit)
holder.append(device)
print(json.dumps({"ts": round(time.time(), 3), "device": config.device, "event": "start",
                  "pid": os.getpid(), "samples": len(y)}), flush=True)
try:
    device.run_rounds(1)
finally:
    device.close()
'''


# Starts the agent from a small process and reports its rusage. A child spawned straight
# from this (large) benchmark process would inherit this process's RSS high-water mark in
# its ru_maxrss (Linux keeps it across exec); the launcher's is a few MiB.
_LAUNCH = r'''
import json, os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, ru = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"pid": pid, "maxrss_kib": ru.ru_maxrss, "cpu_s": ru.ru_utime + ru.ru_stime}, f)
sys.exit(os.waitstatus_to_exitcode(status))
'''


class AgentFailed(RuntimeError):
    """The agent (or the aggregator) process failed; ``reason`` is its last stderr line."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Relay:
    """A loopback TCP relay to the broker that counts the bytes each way.

    The agent connects to the relay instead of the broker, so every byte of its
    connection (TLS records, MQTT framing, the retained model, check-ins) is counted
    exactly, over its whole life, reconnections included.
    """

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._srv = socket.create_server((host, 0))
        self.port: int = self._srv.getsockname()[1]
        self.sent = 0       # agent -> broker
        self.received = 0   # broker -> agent
        self.connections = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._srv.accept()
            except OSError:  # closed (close() shuts the socket down to wake this accept)
                return
            try:
                upstream = socket.create_connection(self._target, timeout=10.0)
                upstream.settimeout(None)
            except OSError:
                client.close()
                return
            self.connections += 1
            for src, dst, up in ((client, upstream, True), (upstream, client, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, up), daemon=True)
                t.start()
                self._threads.append(t)
            del client, upstream  # the pumps own them now

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        """Copy ``src`` to ``dst`` until either side ends, then end both and close ``src``
        (each socket is the source of exactly one pump, so each is closed once). Left to
        the garbage collector, a socket raises a ResourceWarning in whatever test runs when
        it is collected; once seen in CI (from the accept thread, during a ledger test)."""
        try:
            while data := src.recv(65536):
                with self._lock:
                    if up:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (dst, src):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            src.close()

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting and wait for the pumps; every socket is closed when it returns
        (unless a thread outlives ``timeout``)."""
        try:  # close() alone does not wake a thread blocked in accept() on Linux
            self._srv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._srv.close()
        self._acceptor.join(timeout)
        for t in self._threads:
            t.join(timeout)


class _Lines:
    """The JSON log lines of a child's stdout, collected by a reader thread."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.lines: list[dict[str, Any]] = []
        self._q: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stream = proc.stdout
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self._stream is not None
        try:
            for raw in self._stream:
                try:
                    self._q.put(json.loads(raw))
                except ValueError:
                    self._q.put({"event": "non-json", "text": raw.decode(errors="replace")})
        except (OSError, ValueError):  # the stream was closed under us (clean-up)
            return

    def drain(self) -> list[dict[str, Any]]:
        while True:
            try:
                self.lines.append(self._q.get_nowait())
            except queue.Empty:
                return self.lines

    def finish(self) -> list[dict[str, Any]]:
        self._t.join(5.0)
        return self.drain()


class _Watch:
    """Samples the agent's /proc status (VmHWM, VmPeak: per-exec high-water marks) until
    it exits; the agent is the launcher's child."""

    def __init__(self, launcher: subprocess.Popen[bytes]) -> None:
        self.launcher = launcher
        self.pid: int | None = None
        self.vm: dict[str, int] = {}          # VmHWM / VmPeak maxima, KiB
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        lp = self.launcher.pid
        while self.launcher.poll() is None:
            if self.pid is None:
                try:
                    kids = Path(f"/proc/{lp}/task/{lp}/children").read_text().split()
                    self.pid = int(kids[0]) if kids else None
                except (OSError, ValueError):
                    pass
            if self.pid is not None:
                try:
                    for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                        key = line.split(":", 1)[0]
                        if key in ("VmHWM", "VmPeak"):
                            self.vm[key] = max(self.vm.get(key, 0), int(line.split()[1]))
                except (OSError, ValueError, IndexError):
                    pass
            time.sleep(0.05)

    def join(self, timeout: float) -> None:
        self._t.join(timeout)


def _fedge() -> list[str]:
    script = Path(sys.executable).with_name("fedge")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tools.cli"]


def _first(lines: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]
           ) -> dict[str, Any] | None:
    return next((e for e in lines if pred(e)), None)


def run_agent_round(*, cap_mib: int | None = MEMORY_CAP_MIB, limit: str = "as", cpu: int = 0,
                    agent: str = "cli", cohort: int = COHORT, steps: int = STEPS,
                    batch_size: int = BATCH, timeout_s: float = 240.0,
                    probe: bool = True) -> dict[str, Any]:
    """One round of the real services with the agent ``dev-0000`` pinned and capped.

    Args:
        cap_mib: the cap in MiB (None: no cap, for comparison).
        limit: ``"as"`` (RLIMIT_AS, ``prlimit --as``) or ``"data"`` (RLIMIT_DATA,
            ``prlimit --data``: heap and private writable mappings only, so shared
            libraries' and thread stacks' reservations do not count).
        cpu: the agent's CPU; everything else here runs on the others.
        agent: ``"cli"``: ``fedge device`` (loads the whole data set, then its shard);
            ``"embedded"``: the same agent (``edge_sdk.device.Device`` with the same JSON
            lines) in a script that reads only its shard from ``.npy`` files, as a
            device's own software would.
        probe: also run the floors probe (pinned and capped the same way).

    Returns the measurements named in the module docstring (``peak_rss_mib``,
    ``round_wall_s``, ``tcp_bytes_*``, ``exact``...), the agent's and the aggregator's log
    lines (``agent_log``, ``aggregator_log``) and ``command``.

    Raises:
        AgentFailed: the agent or the aggregator exited with an error.
        RuntimeError: the round did not finish within ``timeout_s``.
    """
    from aggregator.rounds import RoundMachine
    from aggregator.service import AggregatorConfig
    from aggregator.store import CheckpointStore
    from edge_sdk import wire
    from edge_sdk.config import load_aggregator_identity, load_device_identity, load_registry
    from edge_sdk.csprng import secure_round_rng
    from edge_sdk.device import DeviceConfig
    from edge_sdk.engine import load_engine
    from edge_sdk.ledger import Ledger
    from edge_sdk.mqtt import BrokerAddress, ClientConfig, MqttLoop
    from edge_sdk.session import DeviceSession
    from models import ONNX_DIR
    from tools.broker import Broker
    from tools.datasets import load_dataset
    from tools.enroll import enroll
    from tools.partition import partition

    if limit not in LIMITS:
        raise ValueError(f"limit must be one of {sorted(LIMITS)}, got {limit!r}")
    if agent not in ("cli", "embedded"):
        raise ValueError(f"agent must be 'cli' or 'embedded', got {agent!r}")
    if cap_mib is not None and cap_mib <= 0:
        raise ValueError(f"cap_mib must be > 0 or None, got {cap_mib!r}")
    if shutil.which("taskset") is None or (cap_mib is not None and shutil.which("prlimit") is None):
        raise RuntimeError("needs taskset and prlimit (util-linux)")
    mine = os.sched_getaffinity(0)
    rest = sorted(mine - {cpu}) or sorted(mine)
    names = [f"dev-{i:04d}" for i in range(cohort)]
    agent_name = names[0]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    cap_args = ([] if cap_mib is None
                else ["prlimit", f"{LIMITS[limit]}={cap_mib * 2**20}", "--"])
    ledgers: list[Ledger] = []
    procs: list[subprocess.Popen[bytes]] = []
    relay: _Relay | None = None
    os.sched_setaffinity(0, rest)
    try:
        with tempfile.TemporaryDirectory(prefix="fedge-envelope-") as tmp_name:
            tmp = Path(tmp_name)
            broker = Broker(devices=names, fleet=FLEET, directory=tmp / "broker")
            broker.start()
            try:
                fleet = enroll(tmp / "fleet", devices=names, fleet=FLEET,
                               broker_config=broker.config,
                               policy=_policy(cohort, steps, batch_size),
                               budget_epsilon=100.0, model=MODEL, metrics_port=None,
                               device_settings={"checkin_every": 1.0})
                assert fleet.aggregator_config is not None
                agg_cfg = AggregatorConfig.from_toml(fleet.aggregator_config)
                registry = load_registry(fleet.registry, fleet=FLEET)
                ds = load_dataset(DATASET)
                shards = partition(ds.y_train, cohort, "iid", np.random.default_rng(0))
                engine = load_engine(ONNX_DIR / f"{MODEL}.json", threads=1)
                c = broker.config
                loop = MqttLoop(BrokerAddress(host=c.host, port=c.port,
                                              ca_file=str(c.ca_file) if c.ca_file else None),
                                rng=random.Random(0))
                sessions: dict[str, DeviceSession] = {}
                for i, name in enumerate(names[1:], start=1):
                    dc = DeviceConfig.from_toml(fleet.device_configs[name])
                    ledger = Ledger.open(dc.ledger, device_id=name, create=False)
                    ledgers.append(ledger)
                    x, y = ds.x_train[shards[i]], ds.y_train[shards[i]]
                    s = DeviceSession(fleet=FLEET, identity=load_device_identity(dc.identity),
                                      registry=registry, ledger=ledger, engine=engine,
                                      spec=engine.spec, data=lambda x=x, y=y: (x, y),
                                      round_rng=secure_round_rng(),
                                      checkin_every=1.0)
                    sessions[name] = s
                    loop.add(ClientConfig(username=name, password=c.password(name),
                                          status_topic=wire.status_topic(FLEET, name),
                                          backoff_initial_s=0.05, backoff_max_s=1.0), s)

                with open(tmp / "aggregator.err", "wb") as err_file:
                    agg = subprocess.Popen(
                        [*_fedge(), "aggregator", "--config", str(fleet.aggregator_config),
                         "--exit-when-done"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                        stderr=err_file)
                procs.append(agg)
                agg_lines = _Lines(agg)
                # the agent reaches the broker through the counting relay
                relay = _Relay(c.host, c.port)
                agent_toml = fleet.device_configs[agent_name]
                text = agent_toml.read_text()
                if text.count(f"port = {c.port}\n") != 1:
                    raise RuntimeError(f"{agent_toml}: no unique broker port line")
                agent_toml.write_text(text.replace(f"port = {c.port}\n",
                                                   f"port = {relay.port}\n"))
                audit = tmp / "audit"
                audit.mkdir()
                if agent == "cli":
                    run = [*_fedge(), "device", "--config", str(agent_toml), "--dataset",
                           DATASET, "--shard", "0", "--shards", str(cohort), "--rounds", "1",
                           "--audit", str(audit)]
                    shown = ["fedge", *run[len(_fedge()):]]
                else:
                    np.save(tmp / "x.npy", ds.x_train[shards[0]], allow_pickle=False)
                    np.save(tmp / "y.npy", ds.y_train[shards[0]], allow_pickle=False)
                    run = [sys.executable, "-c", _EMBEDDED, str(agent_toml),
                           str(tmp / "x.npy"), str(tmp / "y.npy"), str(audit), str(ONNX_DIR)]
                    shown = ["python", "-c", "<edge_sdk.device.Device, shard from .npy>",
                             "device.toml", "x.npy", "y.npy", "<audit>", "<models/onnx>"]
                command = " ".join(["taskset", "-c", str(cpu), *cap_args, *shown]).replace(
                    str(tmp), "<tmp>")
                agent_argv = [sys.executable, "-c", _LAUNCH, str(tmp / "rusage.json"),
                              "taskset", "-c", str(cpu), *cap_args, *run]
                t_spawn = time.time()
                with open(tmp / "agent.err", "wb") as err_file:
                    proc = subprocess.Popen(agent_argv, cwd=REPO, env=env,
                                            stdout=subprocess.PIPE, start_new_session=True,
                                            stderr=err_file)
                procs.append(proc)
                agent_lines = _Lines(proc)
                watch = _Watch(proc)
                deadline = time.monotonic() + timeout_s
                while not (proc.poll() is not None and agg.poll() is not None):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the round did not finish in {timeout_s:.0f} s; "
                                           f"agent: {agent_lines.drain()[-4:]}; aggregator: "
                                           f"{agg_lines.drain()[-4:]}")
                    loop.run(timeout=0.02)
                    if proc.poll() not in (None, 0):
                        break
                    if agg.poll() not in (None, 0):
                        break
                watch.join(5.0)
                alog, glog = agent_lines.finish(), agg_lines.finish()
                if proc.wait(30) != 0 or agg.wait(30) != 0:
                    err = (tmp / "agent.err").read_text(errors="replace")
                    gerr = (tmp / "aggregator.err").read_text(errors="replace")
                    last = [ln for ln in (err if proc.returncode else gerr).splitlines()
                            if ln.strip()]
                    raise AgentFailed(f"agent exited {proc.returncode}, aggregator "
                                      f"{agg.returncode}; agent stderr: {err[-1500:]}; "
                                      f"aggregator stderr: {gerr[-600:]}; agent log: "
                                      f"{alog[-4:]}", last[-1] if last else "no stderr")
                loop.close(2.0)
                usage = json.loads((tmp / "rusage.json").read_text())
                machine = RoundMachine.restore(
                    CheckpointStore(agg_cfg.checkpoint).load(), policy=agg_cfg.policy,
                    identity=load_aggregator_identity(agg_cfg.identity), registry=registry)
                outcome = machine.history[-1] if machine.history else None
                exact = False
                if outcome is not None and outcome.completed:
                    ring = np.uint64((1 << agg_cfg.policy.bits) - 1)
                    want = np.zeros_like(outcome.total)
                    for dev in outcome.survivors:
                        if dev == agent_name:
                            f = audit / f"{dev}-round-{outcome.round_id}.npy"
                            x = np.load(f, allow_pickle=False) if f.exists() else None
                        else:
                            x = sessions[dev].encoded_input(outcome.round_id)
                        if x is None:
                            break
                        want = want + x
                    else:
                        exact = bool(np.array_equal(outcome.total, want & ring))
            finally:
                for p in procs:
                    if p.poll() is None:
                        if p is procs[-1] and len(procs) == 2:
                            os.killpg(p.pid, signal.SIGKILL)  # the launcher and the agent
                        else:
                            p.kill()
                        p.wait(10)
                    if p.stdout is not None:
                        p.stdout.close()
                for led in ledgers:
                    led.close()
                if relay is not None:
                    relay.close(2.0)
                broker.stop()
    finally:
        os.sched_setaffinity(0, mine)

    rep = _summarise(alog, glog, agent_name, t_spawn, watch, usage)
    degree = agg_cfg.policy.config_degree(cohort)
    dim = engine.spec.num_params
    rep.update({
        "exact": exact, "cohort": cohort, "degree": degree, "dim": dim, "cap_mib": cap_mib,
        "limit": None if cap_mib is None else f"RLIMIT_{limit.upper()}", "cpu": cpu,
        "others_cpus": rest, "steps": steps, "batch_size": batch_size,
        "samples": len(shards[0]),
        "command": command, "agent": agent, "tcp_bytes_sent": relay.sent,
        "tcp_bytes_received": relay.received, "tcp_connections": relay.connections,
        "agent_log": alog, "aggregator_log": glog,
    })
    if probe:
        rep.update(_probe(cpu, cap_args, env, len(shards[0]), steps, batch_size, degree + 1,
                          dim))
    return rep


def _probe(cpu: int, cap_args: list[str], env: dict[str, str], samples: int, steps: int,
           batch: int, masks: int, dim: int) -> dict[str, Any]:
    argv = ["taskset", "-c", str(cpu), *cap_args, sys.executable, "-c", _PROBE, MODEL,
            str(samples), str(steps), str(batch), str(masks), str(dim)]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"floors probe exited {proc.returncode}: {proc.stderr[-800:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _summarise(alog: list[dict[str, Any]], glog: list[dict[str, Any]], agent: str,
               t_spawn: float, watch: _Watch, usage: dict[str, Any]) -> dict[str, Any]:
    """The agent's figures from the two logs and the watcher."""
    def ev(lines: list[dict[str, Any]], event: str, **match: Any) -> dict[str, Any] | None:
        return _first(lines, lambda e: e.get("event") == event
                      and all(e.get(k) == v for k, v in match.items()))

    start, connected = ev(alog, "start"), ev(alog, "connected")
    trained, uploaded = ev(alog, "round"), ev(alog, "uploaded")
    end = ev(alog, "round_end")
    rnd = None if trained is None else trained["round"]
    plan = ev(glog, "stage", round=rnd, stage="collect_keys")
    shares = ev(glog, "stage", round=rnd, stage="collect_masked")
    agg_end = ev(glog, "round_end", round=rnd)

    def span(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
        return None if a is None or b is None else round(b["ts"] - a["ts"], 3)

    return {
        "round": rnd,
        "completed": bool(agg_end and agg_end["completed"]),
        "agent_survived": bool(agg_end and agent in agg_end.get("survivor_ids", [])),
        "agent_contributed": bool(end and end.get("contributed")),
        "survivors": None if agg_end is None else agg_end["survivors"],
        "peak_rss_mib": usage["maxrss_kib"] / 1024,
        "vm_hwm_mib": watch.vm.get("VmHWM", 0) / 1024,
        "vm_peak_mib": watch.vm.get("VmPeak", 0) / 1024,
        "agent_cpu_s": usage["cpu_s"],
        "startup_s": None if start is None else round(start["ts"] - t_spawn, 3),
        "connect_s": span(start, connected),
        "plan_to_trained_s": span(plan, trained),
        "shares_to_upload_s": span(shares, uploaded),
        "round_wall_s": span(plan, end),
        "plan_to_upload_s": span(plan, uploaded),
        "aggregator_round_s": None if agg_end is None else agg_end["duration_s"],
        "bytes_upload_payload": None if uploaded is None else uploaded["bytes"],
        "upload_chunks": None if uploaded is None else uploaded["chunks"],
        "round_bytes_in": None if agg_end is None else agg_end["bytes_in"],
        "round_bytes_out": None if agg_end is None else agg_end["bytes_out"],
    }


AARCH64_PLATFORMS = ("manylinux2014_aarch64", "manylinux_2_28_aarch64")


def aarch64_wheels(names: list[str], *, python: str = "3.11",
                   platforms: tuple[str, ...] = AARCH64_PLATFORMS,
                   timeout_s: float = 240.0) -> dict[str, dict[str, Any]]:
    """Ask PyPI for an aarch64 (or pure) wheel of each installed distribution's version.

    ``platforms`` are tried in order (pip also accepts older compatible manylinux tags
    for each); manylinux2014 needs glibc >= 2.17, manylinux_2_28 glibc >= 2.28
    (Raspberry Pi OS bookworm ships 2.36). Returns name -> ``{"version", "ok", "platform",
    "wheel"}`` or ``{"version", "ok": False, "error"}``. Downloads go to a temporary
    directory that is removed afterwards.
    """
    import importlib.metadata as md

    found: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            version = md.version(name)
            pin = version.split("+", 1)[0]
            errors = []
            for plat in platforms:
                dest = os.path.join(tmp, name, plat)
                try:
                    proc = subprocess.run(
                        [sys.executable, "-m", "pip", "download", "--quiet",
                         "--only-binary=:all:", "--platform", plat, "--python-version", python,
                         "--no-deps", "-d", dest, f"{name}=={pin}"],
                        capture_output=True, text=True, timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    errors.append(f"{plat}: pip download timed out after {timeout_s:.0f} s")
                    continue
                wheels = sorted(os.listdir(dest)) if os.path.isdir(dest) else []
                if proc.returncode == 0 and wheels:
                    found[name] = {"version": version, "ok": True, "platform": plat,
                                   "wheel": wheels[0]}
                    break
                err = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
                errors.append(f"{plat}: {err[:160]}")
            else:
                found[name] = {"version": version, "ok": False, "error": "; ".join(errors)}
    return found


def run_envelope_bench(*, quick: bool = False, reps: int | None = None,
                       check_wheels: bool = True, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run the agent's round ``reps`` times (fresh broker, fleet and processes each time);
    print tables; return the result.

    Returns ``runs`` (each :func:`run_agent_round` report), the max ``peak_rss_mib`` and
    ``vm_peak_mib``, ``rss_over_cap``; medians ``round_wall_s`` (plan published -> the
    agent holds the new model), ``plan_to_trained_s``, ``local_round_s`` (the same local
    round alone in the pinned probe), ``local_round_floor_s``, ``shares_to_upload_s``,
    ``prg_floor_s``, ``agent_cpu_s``; the first run's ``bytes_sent`` /
    ``bytes_received`` (the agent's TCP bytes), ``bytes_upload_payload``,
    ``bytes_float32``; ``completed``, ``agent_survived`` and ``exact`` (every run);
    ``aarch64`` (the wheel check, or None when skipped).
    """
    import statistics

    from edge_sdk.model import build_spec
    from tools.bench.floors import step_flops
    from tools.bench.stacks import DEVICE_ROOTS, closure

    reps = reps or (1 if quick else 3)
    cap = MEMORY_CAP_MIB
    # The cap first: RLIMIT_AS on `fedge device`. If the agent cannot live under it,
    # say why and measure under RLIMIT_DATA (same number, heap and private mappings only),
    # and the same agent under RLIMIT_AS with only its shard in memory.
    as_cli: dict[str, Any]
    runs: list[dict[str, Any]] = []
    try:
        runs.append(run_agent_round(limit="as"))
        as_cli = {"ok": True}
    except AgentFailed as e:
        as_cli = {"ok": False, "reason": e.reason}
    limit = "as" if as_cli["ok"] else "data"
    runs += [run_agent_round(limit=limit) for _ in range(reps - len(runs))]
    embedded = None if as_cli["ok"] else run_agent_round(limit="as", agent="embedded",
                                                         probe=False)

    def med(key: str) -> float:
        return float(statistics.median(r[key] for r in runs))

    def fmt(vals: list[float], f: str = ".3f") -> str:
        if len(vals) == 1:
            return f"{vals[0]:{f}}"
        return f"{statistics.median(vals):{f}} ({min(vals):{f}}-{max(vals):{f}})"

    def col(key: str, f: str = ".3f") -> str:
        return fmt([r[key] for r in runs], f)

    r0 = runs[0]
    dim = r0["dim"]
    flops = step_flops(build_spec("cnn", (1, 28, 28), 10))
    for r in runs:
        r["local_round_floor_s"] = STEPS * BATCH * flops / (r["sgemm_gflops_pinned"] * 1e9)
    rss = max(r["peak_rss_mib"] for r in runs)
    hwm = max(r["vm_hwm_mib"] for r in runs)
    vm = max(r["vm_peak_mib"] for r in runs)
    print(f"# the real device agent (`{r0['command']}`; {r0['limit']} = {cap} MiB set by "
          f"prlimit before exec, no cgroup) in a round with secure aggregation against a "
          f"real mosquitto (TLS) and a real `fedge aggregator`; the other {r0['cohort'] - 1} "
          f"devices are DeviceSessions on one MqttLoop in the benchmark process; broker, "
          f"aggregator and sessions on CPU(s) {r0['others_cpus']}. Fed-SPA CNN "
          f"(d={dim}), the agent's Fashion-MNIST shard of {r0['samples']} samples, "
          f"tau={r0['steps']} b={r0['batch_size']}, SecAgg+ k={r0['degree']} in a cohort "
          f"of {r0['cohort']}; median (min-max) of {reps} fresh fleets", file=out)
    if not as_cli["ok"]:
        print(f"# RLIMIT_AS = {cap} MiB (`prlimit --as`) on `fedge device`: the agent FAILED "
              f"before connecting: {as_cli['reason'][:200]} (the CLI reads and standardises "
              f"the whole 60,000-image training set, then indexes its shard). The rows below "
              f"are under RLIMIT_DATA = {cap} MiB instead (`prlimit --data`); the last block "
              f"runs the same agent under RLIMIT_AS with only its shard in memory.", file=out)
    print("| measure | agent | reference / floor | ratio |", file=out)
    print("|---|---|---|---|", file=out)
    print(f"| peak RSS MiB (ru_maxrss from wait4) | {rss:.0f} (VmHWM sampled {hwm:.0f}) "
          f"| cap {cap} | {rss / cap:.2f} |", file=out)
    print(f"| peak virtual size MiB (VmPeak sampled, what RLIMIT_AS bounds) | {vm:.0f} "
          f"| cap {cap} | {vm / cap:.2f} |", file=out)
    lr, fl = [r["local_round_probe_s"] for r in runs], [r["local_round_floor_s"] for r in runs]
    print(f"| plan published -> agent trained and advertised s (local round, encode, keys, "
          f"delivery) | {col('plan_to_trained_s')} | matmul FLOP floor {fmt(fl, '.4f')} "
          f"(pinned 1-thread sgemm) | {med('plan_to_trained_s') / statistics.median(fl):.1f}x |",
          file=out)
    print(f"| the same local round alone (probe, same pin and cap) s | {fmt(lr)} "
          f"| matmul FLOP floor | {statistics.median(lr) / statistics.median(fl):.1f}x |",
          file=out)
    print(f"| shares forwarded -> agent uploaded s (delivery, mask: {r0['degree']} "
          f"agreements, {r0['degree'] + 1} PRG masks of d={dim}; durable ledger reserve; "
          f"chunking) | {col('shares_to_upload_s', '.4f')} | PRG floor "
          f"{col('prg_floor_s', '.4f')} "
          f"| {med('shares_to_upload_s') / med('prg_floor_s'):.1f}x |", file=out)
    print(f"| round wall s (plan published -> agent holds the new model) "
          f"| {col('round_wall_s')} | aggregator's round {col('aggregator_round_s')} | |",
          file=out)
    print(f"| plan published -> agent uploaded s | {col('plan_to_upload_s')} | | |", file=out)
    print(f"| agent start-up s (spawn -> `start` line: imports, data set, model, ledger) "
          f"| {col('startup_s')} | | |", file=out)
    print(f"| agent CPU s (user + system, whole life, wait4) | {col('agent_cpu_s')} | | |",
          file=out)
    f32 = 4 * dim
    up = r0["bytes_upload_payload"]
    print(f"| upload payload bytes ({r0['upload_chunks']} chunk(s), `uploaded` line) | {up} "
          f"| dense float32 update {f32} | {up / f32:.2f} |", file=out)
    print(f"| agent TCP bytes sent (whole life, TLS; counting relay) | {r0['tcp_bytes_sent']} "
          f"| dense float32 update {f32} | {r0['tcp_bytes_sent'] / f32:.2f} |", file=out)
    print(f"| agent TCP bytes received (whole life: retained model, plan, SecAgg, new model) "
          f"| {r0['tcp_bytes_received']} | | |", file=out)
    print(f"| round payload bytes at the aggregator, in / out (all {r0['cohort']} devices) "
          f"| {r0['round_bytes_in']} / {r0['round_bytes_out']} | | |", file=out)
    print(f"| round completed, agent among the survivors, contributed "
          f"| {all(r['completed'] for r in runs)}, {all(r['agent_survived'] for r in runs)}, "
          f"{all(r['agent_contributed'] for r in runs)} "
          f"(survivors {', '.join(str(r['survivors']) for r in runs)}) | | |", file=out)
    print(f"| aggregate exact (unmasked sum = survivors' encoded inputs, agent's from "
          f"--audit) | {all(r['exact'] for r in runs)} | | |", file=out)
    if embedded is not None:
        e = embedded
        print("", file=out)
        print(f"# the same agent (edge_sdk.device.Device, the CLI's JSON lines) reading only "
              f"its {e['samples']}-sample shard from .npy files, as a device's own software "
              f"would: `{e['command']}`; one fresh fleet", file=out)
        print("| measure | agent | cap | ratio |", file=out)
        print("|---|---|---|---|", file=out)
        print(f"| peak RSS MiB (ru_maxrss) | {e['peak_rss_mib']:.0f} (VmHWM sampled "
              f"{e['vm_hwm_mib']:.0f}) | {cap} | {e['peak_rss_mib'] / cap:.2f} |", file=out)
        print(f"| peak virtual size MiB (VmPeak) | {e['vm_peak_mib']:.0f} | {cap} "
              f"| {e['vm_peak_mib'] / cap:.2f} |", file=out)
        print(f"| plan -> trained / round wall s | {e['plan_to_trained_s']:.3f} / "
              f"{e['round_wall_s']:.3f} | | |", file=out)
        print(f"| TCP bytes sent / received | {e['tcp_bytes_sent']} / "
              f"{e['tcp_bytes_received']} | | |", file=out)
        print(f"| completed, agent among the survivors, exact | {e['completed']}, "
              f"{e['agent_survived']}, {e['exact']} | | |", file=out)
    wheels = None
    if check_wheels:
        names = closure(DEVICE_ROOTS)
        wheels = aarch64_wheels(names)
        print("", file=out)
        print("# aarch64 wheels on PyPI for the installed versions of the device stack (`pip "
              "download --only-binary=:all: --platform P --python-version 3.11 --no-deps`, P "
              f"tried in order: {', '.join(AARCH64_PLATFORMS)})", file=out)
        print("| distribution | version | platform asked | aarch64 wheel |", file=out)
        print("|---|---|---|---|", file=out)
        for n, w in wheels.items():
            cell = (f"{w['platform']} | {w['wheel']}" if w["ok"]
                    else f"- | NO: {w['error']}")
            print(f"| {n} | {w['version']} | {cell} |", file=out)
    return {
        "runs": runs, "reps": reps, "cap_mib": cap, "limit": r0["limit"],
        "rlimit_as_cli": as_cli, "embedded": embedded,
        "command": r0["command"],
        "peak_rss_mib": rss, "vm_hwm_mib": hwm, "vm_peak_mib": vm, "rss_over_cap": rss / cap,
        "round_wall_s": med("round_wall_s"), "plan_to_trained_s": med("plan_to_trained_s"),
        "plan_to_upload_s": med("plan_to_upload_s"),
        "local_round_s": statistics.median(lr), "local_round_floor_s": statistics.median(fl),
        "shares_to_upload_s": med("shares_to_upload_s"), "prg_floor_s": med("prg_floor_s"),
        "agent_cpu_s": med("agent_cpu_s"), "startup_s": med("startup_s"),
        "bytes_sent": r0["tcp_bytes_sent"], "bytes_received": r0["tcp_bytes_received"],
        "bytes_upload_payload": up, "bytes_float32": f32,
        "completed": all(r["completed"] for r in runs),
        "agent_survived": all(r["agent_survived"] for r in runs),
        "exact": all(r["exact"] for r in runs), "aarch64": wheels,
    }
