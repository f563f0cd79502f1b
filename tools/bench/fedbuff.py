"""Benchmark 4e: buffered asynchronous rounds (FedBuff) against synchronous rounds, time to
target accuracy on the simulated clock at the same device-level budget (issue 19).

Each seed is one availability draw (``tools.fedbuff.Availability(seed=...)``: who is online
when, how slow each device is) run three ways on the same fleet, data and model:
synchronous rounds with a 60 s and a 120 s stage timeout (a short timeout drops slow
devices sooner, a long one waits for them: both are shown, so the comparison is with
synchronous rounds at their better setting), and buffered rounds (buffer K = the cohort,
max staleness 4, weight (1 + tau)^-1/2) with the same 120 s and with 15 s. A synchronous
round's first stage holds its members' training, so its timeout must cover the slow
devices; a buffered round's stages hold only messages and the encoding, so 15 s is its
natural setting (a member that went offline while queued then costs 15 s a stage, not
120). Every run goes to the horizon; the time to each target is read from its accuracy
curve (the mean of the last 3 models >= the target).

Row fields: ``time_to`` (target -> simulated seconds, None: not reached within the
horizon) and ``epsilon_at`` (the largest device-level epsilon any device had spent by
then), ``rounds_per_hour``, participations (reservations: an update trained ahead that no
round took is spent all the same) and the largest device-level epsilon spent by the
horizon (every ledger's budget is the same), ``trainings`` (local rounds run: the fleet's
compute), ``staleness_mean``. The summary's
speedups per target are the better synchronous run's time over each buffered run's (the
median over seeds; only seeds where both reached it).
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any, TextIO

import numpy as np

__all__ = ["run_fedbuff_bench", "summarize", "table", "time_to"]

TARGETS = (0.6, 0.7, 0.75, 0.8)


def _reached(curve: list[dict[str, Any]], target: float, window: int) -> int | None:
    accs = [r["accuracy"] for r in curve]
    for i in range(window - 1, len(curve)):
        if float(np.mean(accs[i - window + 1:i + 1])) >= target:
            return i
    return None


def time_to(curve: list[dict[str, Any]], target: float, window: int = 3) -> float | None:
    """The first time the mean accuracy of the last ``window`` models is >= ``target``."""
    i = _reached(curve, target, window)
    return None if i is None else float(curve[i]["t"])


def run_fedbuff_bench(*, quick: bool = False, seeds: tuple[int, ...] | None = None,
                      budget: float = 30.0,
                      out: TextIO | None = sys.stdout) -> dict[str, Any]:
    """Synchronous (60 s, 120 s stage timeouts) and buffered runs per seed (module
    docstring), every ledger's device-level budget ``budget`` (nats at delta 1e-5);
    {"rows": [...], "summary": {...}}."""
    from tools.fedbuff import Availability, run_timed
    from tools.simconfig import SimConfig

    devices, cohort, horizon = (40, 5, 3600.0) if quick else (100, 10, 14400.0)
    seeds = seeds if seeds is not None else ((1,) if quick else (1, 2, 3, 4))
    cfg = SimConfig(dataset="digits", model="logreg", devices=devices,
                    participation=cohort / devices, local_steps=10, batch_size=16, lr=0.5,
                    mechanism="device-dp", update_clip=1.0, noise_multiplier=1.0, seed=3,
                    secagg=True, progress=False, rounds=1)
    runs = (("sync", False, 60.0), ("sync", False, 120.0), ("buffered", True, 120.0),
            ("buffered", True, 15.0))
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        av = Availability(seed=seed)
        for mode, buffered, timeout in runs:
            with tempfile.TemporaryDirectory(prefix="fedge-fedbuff-") as tmp:
                r = run_timed(cfg, av, tmp, buffered=buffered, target=2.0,
                              horizon_s=horizon, device_epsilon=budget,
                              stage_timeout=timeout)
            row = {"seed": seed, "mode": mode, "stage_timeout": timeout,
                   "devices": devices, "cohort": cohort, "horizon_s": horizon,
                   "time_to": {str(t): time_to(r["curve"], t) for t in TARGETS},
                   # the largest device-level epsilon any device had spent by then
                   "epsilon_at": {str(t): (None if (i := _reached(r["curve"], t, 3)) is None
                                           else r["epsilon_of"][
                                               r["curve"][i]["max_participations"]])
                                  for t in TARGETS},
                   **{k: r[k] for k in ("rounds_completed", "rounds_per_hour",
                                         "final_accuracy", "max_participations",
                                         "mean_participations", "max_device_epsilon",
                                         "device_budget", "staleness_mean",
                                         "staleness_max", "trainings", "cpu_seconds")}}
            rows.append(row)
            if out is not None:
                print(f"  seed {seed} {mode:8s} timeout {timeout:5.0f} s: "
                      f"{row['rounds_completed']} rounds, final acc "
                      f"{row['final_accuracy']}, time to {row['time_to']}", file=out,
                      flush=True)
    summary = summarize(rows)
    if out is not None:
        table(rows, summary, out)
    return {"rows": rows, "summary": summary}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per target: the median over seeds of the better synchronous time over each buffered
    run's time (seeds where both reached it), and how many seeds that is."""
    seeds = sorted({r["seed"] for r in rows})
    summary: dict[str, Any] = {}
    for t in TARGETS:
        ratios: dict[float, list[float]] = {}
        for seed in seeds:
            mine = {(r["mode"], r["stage_timeout"]): r["time_to"][str(t)]
                    for r in rows if r["seed"] == seed}
            syncs = [v for (m, _), v in mine.items() if m == "sync" and v is not None]
            for timeout in (120.0, 15.0):
                buf = mine[("buffered", timeout)]
                if syncs and buf is not None:
                    ratios.setdefault(timeout, []).append(min(syncs) / buf)
        summary[str(t)] = {
            f"speedup_median_buffered_{timeout:.0f}s":
                float(np.median(ratios[timeout])) if ratios.get(timeout) else None
            for timeout in (120.0, 15.0)}
        summary[str(t)]["seeds_both_reached"] = {
            f"{timeout:.0f}s": len(ratios.get(timeout, [])) for timeout in (120.0, 15.0)}
    return summary


def table(rows: list[dict[str, Any]], summary: dict[str, Any], out: TextIO) -> None:
    r0 = rows[0]
    print(f"# FedBuff vs synchronous rounds: {r0['devices']} devices, K = {r0['cohort']}, "
          f"device-dp z = 1, device-level budget {r0['device_budget']:g} per device, "
          f"simulated clock ({r0['horizon_s'] / 3600:g} h horizon)", file=out)
    heads = " | ".join(f"to {t:g} s (max eps)" for t in TARGETS)
    print(f"| seed | mode | stage timeout s | rounds | rounds/h | {heads} | final acc "
          f"| max eps (dev) | mean particip. | trainings | staleness mean |", file=out)
    print("|" + "---|" * (10 + len(TARGETS)), file=out)
    for r in rows:
        tt = " | ".join("-" if r["time_to"][str(t)] is None else
                        f"{r['time_to'][str(t)]:.0f} ({r['epsilon_at'][str(t)]:.1f})"
                        for t in TARGETS)
        st = "-" if r["staleness_mean"] is None else f"{r['staleness_mean']:.2f}"
        print(f"| {r['seed']} | {r['mode']} | {r['stage_timeout']:.0f} | "
              f"{r['rounds_completed']} | {r['rounds_per_hour']:.1f} | {tt} | "
              f"{r['final_accuracy']:.3f} | {r['max_device_epsilon']:.2f} | "
              f"{r['mean_participations']:.2f} | {r['trainings']} | {st} |", file=out)
    for timeout in ("120s", "15s"):
        parts = []
        for t, v in summary.items():
            x = v[f"speedup_median_buffered_{timeout}"]
            parts.append(f"{t}: {'-' if x is None else f'{x:.2f}'} "
                         f"({v['seeds_both_reached'][timeout]} seeds)")
        print(f"speedup, better sync time / buffered ({timeout} stage timeout) time, "
              f"median over seeds: " + ", ".join(parts), file=out)
