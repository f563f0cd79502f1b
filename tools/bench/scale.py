"""Benchmark 4c: a fleet of 100,000 registered devices, cohorts of 100 to 1,000 (issue 19).

Each row is one run of :class:`tools.scale.ScaleFleet` in a fresh process (its peak RSS is
the row's alone): ``registered`` devices in the aggregator's registry (every public key,
generated at registration), ``available`` of them online per round (the seeded
availability model), a SecAgg+ cohort of ``cohort`` over the in-memory broker, digits +
logreg, 2 local DP-SGD steps on 32 examples, 5% seeded dropouts, the ledgers on tmpfs
(``/dev/shm`` where it exists: the simulation serializes every device's fsyncs, which
devices do on their own storage).

* ``device_rounds_per_minute``: uploads summed over the rounds' wall time (registration
  and set-up excluded, reported apart);
* ``peak_rss_mib``: the process's peak resident set; ``rss_after_setup_mib`` before the
  first round (interpreter, onnxruntime, dataset, registry);
* the memory claim, "grows with the cohort, not the fleet": the rows at the same cohort and
  10x the registered devices (``rss_vs_small_fleet``: their peak RSS ratio).

The full run (100,000 registered, 20 rounds of 1,000: about half an hour on a quiet
machine) is kept in :data:`STORED` whenever it runs (``fedge bench scale``); ``--quick``
(and so ``fedge bench all --quick``) does not run it but shows the stored row beside its
own, marked with the date it was measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["STORED", "run_scale_bench"]

STORED = Path(__file__).resolve().parents[2] / "docs" / "results" / "scale" / "full-100k.json"
"""The last full run's row (100,000 registered, 20 rounds of 1,000), with when it ran."""

_CHILD = r"""
import json, sys, tempfile
from pathlib import Path
from tools.simconfig import SimConfig
from tools.scale import ScaleFleet
registered, cohort, rounds = (int(a) for a in sys.argv[1:4])
cfg = SimConfig(dataset="digits", model="logreg", devices=registered,
                participation=cohort / registered, local_steps=2, batch_size=16, lr=0.5,
                clip=1.0, noise_multiplier=1.0, value_bound=2.0, seed=5, secagg=True,
                progress=True, rounds=rounds, dropout=0.05)
shm = Path("/dev/shm")
with tempfile.TemporaryDirectory(prefix="fedge-scale-", dir=shm if shm.is_dir() else None) as d:
    fleet = ScaleFleet(cfg, d)
    try:
        s = fleet.run()
    finally:
        fleet.close()
s["rounds_wall"] = [r["wall_seconds"] for r in s.pop("rounds")]
print("FEDGE-SCALE " + json.dumps(s))
"""


def _child(registered: int, cohort: int, rounds: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(registered), str(cohort),
                           str(rounds)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FEDGE-SCALE ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"scale child ({registered}, {cohort}, {rounds}) failed "
                           f"({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line[len("FEDGE-SCALE "):])


def run_scale_bench(*, quick: bool = False,
                    out: TextIO | None = sys.stdout) -> list[dict[str, Any]]:
    """The rows of the module docstring: 10,000 and 100,000 registered at a cohort of 100
    (the memory comparison), and (not ``quick``) 100,000 with 20 rounds of 1,000."""
    configs = [(10_000, 100, 3), (100_000, 100, 3)]
    if not quick:
        configs.append((100_000, 1_000, 20))
    rows = []
    for registered, cohort, rounds in configs:
        s = _child(registered, cohort, rounds)
        rows.append({"registered": registered, "cohort": cohort, "rounds": rounds,
                     "available": s["available"], "rounds_completed": s["rounds_completed"],
                     "device_rounds": s["device_rounds"],
                     "device_rounds_per_minute": s["device_rounds_per_minute"],
                     "wall_seconds": s["wall_seconds"],
                     "registration_seconds": s["registration_seconds"],
                     "rss_after_setup_mib": s["rss_after_setup_mib"],
                     "peak_rss_mib": s["peak_rss_mib"], "ledger_files": s["ledger_files"],
                     "machine_checkins_after": s["machine_checkins"],
                     "final_accuracy": s["final_accuracy"]})
    if not quick:
        STORED.parent.mkdir(parents=True, exist_ok=True)
        full = {**rows[-1], "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        STORED.write_text(json.dumps(full, indent=1) + "\n")
    elif STORED.exists():
        rows.append({**json.loads(STORED.read_text()), "stored": True})
    small = {r["cohort"]: r for r in rows if r["registered"] == 10_000}
    for r in rows:
        ref = small.get(r["cohort"])
        r["rss_vs_small_fleet"] = (r["peak_rss_mib"] / ref["peak_rss_mib"]
                                   if ref and r is not ref else None)
    if out is not None:
        print("# registered devices vs memory and throughput: SecAgg+ over the in-memory "
              "broker, digits + logreg, 2 local steps on 32 examples, 5% dropouts; one "
              "fresh process per row", file=out)
        print("| registered | online/round | cohort | rounds ok | device-rounds | "
              "device-rounds/min | registration s | RSS after setup MiB | peak RSS MiB "
              "| vs 10,000 registered | ledger files |", file=out)
        print("|---|---|---|---|---|---|---|---|---|---|---|", file=out)
        for r in rows:
            vs = "" if r["rss_vs_small_fleet"] is None else f"{r['rss_vs_small_fleet']:.2f}x"
            when = f" (stored full run, {r['measured']})" if r.get("stored") else ""
            print(f"| {r['registered']:,}{when} | {r['available']:,} | {r['cohort']:,} "
                  f"| {r['rounds_completed']}/{r['rounds']} | {r['device_rounds']:,} "
                  f"| {r['device_rounds_per_minute']:.0f} | {r['registration_seconds']:.1f} "
                  f"| {r['rss_after_setup_mib']:.0f} | {r['peak_rss_mib']:.0f} | {vs} "
                  f"| {r['ledger_files']:,} |", file=out)
    return rows
