"""Benchmark 4d: one gateway's aggregation over 1 and 2 worker processes (issue 19).

Each row is one run of ``tools.workers_mqtt``: a fresh mosquitto (TLS, a user per party),
a coordinator process (check-ins, the round's draw of 2 x n devices split into 2 jobs, the
sums, the model), ``workers`` worker processes taking the jobs through the MQTT v5 shared
subscription ``$share/workers/fedge/<fleet>/site/job``, and one process with every
device; digits + logreg, 2 local DP-SGD steps, no dropouts (the in-memory tests drop
devices), ``rounds`` rounds. One worker runs the two jobs of a round one after the other,
two run them side by side.

* ``device_rounds_per_minute``: uploads summed over the rounds' wall time (from the first
  round's announcement to the last round's end, on the coordinator's clock);
* ``vs_one_worker``: that against the 1-worker row of the same run (issue 19: two workers
  give more device-rounds per minute on two cores);
* ``same_sums``: every round's ring sum equal to the 1-worker row's (and the model).
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any, TextIO

__all__ = ["run_workers_bench"]


def run_workers_bench(*, quick: bool = False,
                      out: TextIO | None = sys.stdout) -> list[dict[str, Any]]:
    """1 worker, then 2, on the same fleet (module docstring)."""
    from tools.simconfig import SimConfig
    from tools.workers_mqtt import run_workers_mqtt

    devices = 100 if quick else 500
    cfg = SimConfig(dataset="digits", model="logreg", devices=devices, participation=0.4,
                    local_steps=2, batch_size=16, lr=0.5, clip=1.0, noise_multiplier=1.0,
                    value_bound=2.0, seed=3, secagg=True, progress=False, rounds=3,
                    dropout=0.0, transport="mqtt")
    rows: list[dict[str, Any]] = []
    for workers in (1, 2):
        with tempfile.TemporaryDirectory(prefix="fedge-workers-") as tmp:
            r = run_workers_mqtt(cfg, tmp, workers=workers, jobs=2)
        wall = r["rounds_wall_seconds"]
        rows.append({"devices": devices, "workers": workers, "jobs": 2, "rounds": cfg.rounds,
                     "rounds_completed": sum(x["completed"] for x in r["rounds"]),
                     "device_rounds": r["device_rounds"], "rounds_wall_seconds": wall,
                     "device_rounds_per_minute": 60.0 * r["device_rounds"] / wall,
                     "sums": [x["sum"] for x in r["rounds"]],
                     "model_sha256": r["model_sha256"]})
    one = rows[0]
    for row in rows:
        row["vs_one_worker"] = row["device_rounds_per_minute"] / one["device_rounds_per_minute"]
        row["same_sums"] = row["sums"] == one["sums"] and row["model_sha256"] == one[
            "model_sha256"]
    for row in rows:
        del row["sums"]
    if out is not None:
        print(f"# one gateway's aggregation over worker processes: {devices} devices, 2 jobs "
              f"of {round(0.4 * devices / 2)} per round through a shared subscription, "
              "over mosquitto (TLS); coordinator, workers and devices each a process", file=out)
        print("| workers | rounds ok | device-rounds | rounds wall s | device-rounds/min "
              "| vs 1 worker | same sums and model |", file=out)
        print("|---|---|---|---|---|---|---|", file=out)
        for r in rows:
            print(f"| {r['workers']} | {r['rounds_completed']}/{r['rounds']} "
                  f"| {r['device_rounds']} | {r['rounds_wall_seconds']:.1f} "
                  f"| {r['device_rounds_per_minute']:.0f} | {r['vs_one_worker']:.2f}x "
                  f"| {'yes' if r['same_sums'] else 'NO'} |", file=out)
    return rows
