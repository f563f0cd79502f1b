"""Benchmark 4: a fleet over MQTT — device-rounds per minute, broker bytes, CPU and memory.

Each measurement is one run of :class:`tools.fleet.Fleet` in a fresh subprocess: N device
sessions (each with its own ledger) and the aggregator's round machine, with secure
aggregation and 10% of each cohort vanishing at a random protocol stage, over

* ``mqtt``: a real mosquitto on a loopback port (TLS, per-device passwords, ACLs), every
  endpoint on one :class:`edge_sdk.mqtt.MqttLoop` in the one process; and
* ``inproc`` (the reference, same run): the same endpoints on the in-memory broker.

Both run the same seeds and must end with the same model (``same_model``). The workload
is sklearn's digits with logistic regression and 5 local steps, 10% participation: a
protocol and transport benchmark, not a learning one.

Reported per run: ``device_rounds_per_min`` (uploads that entered a completed or failed
round's sum, over the wall time of the rounds: from the first round's start to the last
one's end, so the broker's start and the fleet's first connects, paid once by a
long-running fleet, are excluded; until issue 18 the MQTT rows counted them); ``bytes_up`` /
``bytes_down`` (MQTT PUBLISH packets the endpoints sent, counted from what they actually
published, headers included) and ``bytes_delivered`` (payload bytes the broker delivered
to devices, the retained model's fan-out included); ``aggregator_cpu_s`` (process CPU time
spent inside the aggregator endpoint's callbacks: its share of the single-threaded loop);
``process_peak_rss_mib`` (the whole simulation process: N devices and the aggregator — the
aggregator alone is not separable here); for ``mqtt`` also the broker's own CPU seconds and
peak RSS (``/proc/<pid>``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, TextIO

from tools.bench.client import REPO

__all__ = ["digits_logreg_fleet", "run_fleet_bench"]


def digits_logreg_fleet(**settings: Any) -> tuple[Any, Any, Any]:
    """(data, (spec, engine), SimConfig) of the fleet benchmarks' workload: digits with
    logistic regression, 5 local steps of 16, clip 1, noise multiplier 1, secure
    aggregation, seed 3; ``settings`` (devices, participation, rounds, transport, ...)
    complete or override the config."""
    from edge_sdk.engine import load_engine
    from edge_sdk.model import build_spec
    from models import manifest_path
    from tools.datasets import load_dataset
    from tools.simconfig import SimConfig

    data = load_dataset("digits")
    spec = build_spec("logreg", data.input_shape, data.num_classes)
    engine = load_engine(manifest_path(spec.name, spec.input_shape, spec.num_classes))
    cfg = SimConfig(**{"dataset": "digits", "model": "logreg", "local_steps": 5,
                       "batch_size": 16, "lr": 0.5, "clip": 1.0, "noise_multiplier": 1.0,
                       "value_bound": 2.0, "seed": 3, "secagg": True, "progress": False,
                       **settings})
    return data, (spec, engine), cfg

_CHILD = r'''
import json, os, resource, sys, tempfile, time
from pathlib import Path
devices, rounds, transport = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
from tools.bench.fleet import digits_logreg_fleet
from tools.bench.rss import peak_rss_mib
from tools.fleet import Fleet

data, (spec, engine), cfg = digits_logreg_fleet(devices=devices, participation=0.1,
                                                rounds=rounds, dropout=0.1,
                                                transport=transport)
tick = os.sysconf("SC_CLK_TCK")
broker = {"cpu_s": 0.0, "peak_rss_kib": 0}

def sample_broker(workdir):
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"mosquitto" not in cmd or str(workdir).encode() not in cmd:
                continue
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            broker["cpu_s"] = max(broker["cpu_s"], (int(stat[11]) + int(stat[12])) / tick)
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    broker["peak_rss_kib"] = max(broker["peak_rss_kib"], int(line.split()[1]))
        except OSError:
            continue

with tempfile.TemporaryDirectory() as tmp:
    fleet = Fleet(cfg, tmp, data=data, engine=(spec, engine))
    agg = fleet.aggregator
    cpu = [0.0]
    def timed(fn):
        def call(*a, **k):
            t0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                cpu[0] += time.process_time() - t0
        return call
    for name in ("on_connect", "on_message", "on_tick"):
        setattr(agg, name, timed(getattr(agg, name)))
    last = [0.0]
    def on_step():
        now = time.monotonic()
        if transport == "mqtt" and now - last[0] > 0.5:
            last[0] = now
            sample_broker(tmp)
    fleet.on_step = on_step
    summary = fleet.run()
wall = summary["rounds_wall_seconds"]
row = {
    "devices": devices, "rounds": rounds, "transport": transport,
    "rounds_completed": summary["rounds_completed"], "rounds_failed": summary["rounds_failed"],
    "device_rounds": summary["device_rounds"], "wall_s": wall,
    "device_rounds_per_min": summary["device_rounds"] / wall * 60.0,
    "bytes_up": summary["bytes_up_total"], "bytes_down": summary["bytes_down_total"],
    "bytes_delivered": summary["bytes_delivered_to_devices"],
    "aggregator_cpu_s": cpu[0],
    "process_peak_rss_mib": peak_rss_mib(),
    "model_sha256": summary["model_sha256"], "note": summary["note"],
}
if transport == "mqtt":
    row["broker_cpu_s"] = broker["cpu_s"]
    row["broker_peak_rss_mib"] = broker["peak_rss_kib"] / 1024
print(json.dumps(row))
'''


def _child(devices: int, rounds: int, transport: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(devices), str(rounds), transport],
        capture_output=True, text=True, env=env, timeout=1800, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"fleet bench child ({devices} devices, {transport}) failed: "
                           f"{proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_fleet_bench(*, quick: bool = False, out: TextIO | None = sys.stdout,
                    sizes: tuple[int, ...] = (100, 1000)) -> list[dict[str, Any]]:
    """Run the fleet over MQTT and in-process (the reference) at each size.

    Args:
        quick: 3 rounds per run instead of 10.
        out: where the markdown table goes (None: nowhere).
        sizes: fleet sizes N (devices); 10% take part in each round.

    Returns:
        One row per (size, transport), the ``mqtt`` rows with ``vs_inproc`` (their
        device-rounds/min over the in-process run's) and ``same_model``.
    """
    rounds = 3 if quick else 10
    rows: list[dict[str, Any]] = []
    for n in sizes:
        ref = _child(n, rounds, "inproc")
        mq = _child(n, rounds, "mqtt")
        mq["vs_inproc"] = mq["device_rounds_per_min"] / ref["device_rounds_per_min"]
        mq["same_model"] = mq["model_sha256"] == ref["model_sha256"]
        rows += [ref, mq]
    if out is not None:
        print(f"# fleet over MQTT vs the same fleet in-process; digits + logreg, secure "
              f"aggregation, 10% dropouts, {rounds} rounds; one run each", file=out)
        print("| devices | transport | rounds ok/failed | device-rounds/min | vs inproc "
              "| MiB up | MiB down | MiB delivered | aggregator CPU s | process RSS MiB "
              "| broker CPU s | broker RSS MiB | same model |", file=out)
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
        mib = 1024 * 1024
        for r in rows:
            mqtt = r["transport"] == "mqtt"
            vs = f"{r['vs_inproc']:.2f}x" if mqtt else "reference"
            b_cpu = f"{r['broker_cpu_s']:.2f}" if mqtt else "-"
            b_rss = f"{r['broker_peak_rss_mib']:.0f}" if mqtt else "-"
            same = ("yes" if r["same_model"] else "NO") if mqtt else "-"
            print(f"| {r['devices']} | {r['transport']} "
                  f"| {r['rounds_completed']}/{r['rounds_failed']} "
                  f"| {r['device_rounds_per_min']:.0f} | {vs} "
                  f"| {r['bytes_up'] / mib:.2f} | {r['bytes_down'] / mib:.2f} "
                  f"| {r['bytes_delivered'] / mib:.2f} | {r['aggregator_cpu_s']:.2f} "
                  f"| {r['process_peak_rss_mib']:.0f} | {b_cpu} | {b_rss} | {same} |", file=out)
    return rows
