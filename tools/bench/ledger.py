"""Benchmark 2b: how fast a device's ledger answers ``epsilon_if`` with 10,000 entries.

Issue 18's target: a ledger with 10,000 entries answers ``epsilon_if`` in < 50 ms. Each
round of a device's life adds two entries (the reservation and its commit), so 10,000
entries are 5,000 rounds. Two histories:

* ``repeated``: every round the same DP-SGD event (a device whose data set and plan do
  not change): what the ledger's multiset grouping was built for.
* ``distinct``: every round its own event (the sampling rate drifts as the data set
  grows): the worst case, where every reservation is a distinct RDP curve.

Measured, in one process, for each history: the durable :class:`~edge_sdk.ledger.Ledger`
(sqlite, built entry by entry with ``reserve`` + ``commit`` as a device does, then closed
and reopened: the open time is reported) answering ``epsilon_if`` for a plan with a new
event and for a plan repeating the history's first event (the costliest for the running
composition: every prefix sum after it is recomputed), cold (first question after the
open) and warm (the median of 5 more with fresh plans); beside it the reference, in the
same run, the accountant over the full list of events from scratch (``epsilon_rdp``, what
an uncached book computes, with every curve already memoised: the fastest the old path
could be; the ledger's answer must equal it bit for bit, checked here). A new event's cold
answer includes computing its RDP curve (milliseconds for a subsampled Gaussian at 60-odd
orders), whatever the history.
The quick variant builds 2,000 entries (the per-question cost does not grow with them;
the table says how many).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from tools.bench.client import machine

DELTA = 1e-5


def _event(i: int, distinct: bool) -> Any:
    from edge_sdk.privacy import PoissonSubsampledGaussian

    rate = 0.01 + (i * 1e-7 if distinct else 0.0)
    return PoissonSubsampledGaussian(noise_multiplier=1.1, sample_rate=rate, steps=10)


def _one(history: str, rounds: int, folder: Path) -> dict[str, Any]:
    from edge_sdk.ledger import Budget, Ledger, Plan, epsilon_rdp

    distinct = history == "distinct"
    path = folder / f"{history}.db"
    events = [_event(i, distinct) for i in range(rounds)]
    t0 = time.perf_counter()
    with Ledger.open(path, budget=Budget(epsilon=1e9, delta=DELTA), device_id="bench-1",
                     create=True) as led:
        for i, event in enumerate(events):
            led.commit(led.reserve(Plan(round_id=f"r{i}", model_id="m", event=event)))
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    led = Ledger.open(path, create=False)
    open_s = time.perf_counter() - t0
    try:
        entries = len(led.entries())
        base = 10**6 * (2 if distinct else 1)  # events no run of this bench composed yet
        new = Plan(round_id="new", model_id="m", event=_event(base, True))
        first = Plan(round_id="first", model_id="m", event=events[0])
        out: dict[str, Any] = {"history": history, "entries": entries,
                               "distinct_events": len(set(events)),
                               "build_s": build_s, "open_s": open_s}
        for name, plan in (("new", new), ("repeat", first)):
            t0 = time.perf_counter()
            eps = led.epsilon_if(plan)
            out[f"{name}_cold_ms"] = 1e3 * (time.perf_counter() - t0)
            warm = []
            for k in range(5):  # fresh plans: nothing answered from the cache
                again = Plan(round_id=f"{name}{k}", model_id="m",
                             event=_event(base + 1 + k, True) if name == "new" else events[0])
                t0 = time.perf_counter()
                led.epsilon_if(again)
                warm.append(1e3 * (time.perf_counter() - t0))
            out[f"{name}_warm_ms"] = statistics.median(warm)
            t0 = time.perf_counter()
            ref = epsilon_rdp([*events, plan.event], DELTA)
            out[f"{name}_scratch_ms"] = 1e3 * (time.perf_counter() - t0)
            if eps != ref:
                raise AssertionError(f"ledger epsilon_if {eps!r} != epsilon_rdp {ref!r}")
            out[f"{name}_epsilon"] = eps
        out["epsilon_if_ms"] = max(out["new_cold_ms"], out["repeat_cold_ms"],
                                   out["new_warm_ms"], out["repeat_warm_ms"])
        return out
    finally:
        led.close()


def run_ledger_bench(*, quick: bool = False, out: TextIO = sys.stdout) -> list[dict[str, Any]]:
    """Rows of ``epsilon_if`` latency (ms) on durable ledgers of 10,000 entries (2,000
    with ``quick``), both histories; printed as a markdown table to ``out``."""
    rounds = 1000 if quick else 5000
    print(f"# ledger epsilon_if, durable sqlite ledger; {machine()}; DP-SGD events "
          f"(z=1.1, q~0.01, 10 steps), delta={DELTA:g}; ms", file=out)
    print("| history | entries | distinct events | build s | open s | new event: cold ms "
          "| warm ms | from scratch ms | repeat of the first: cold ms | warm ms "
          "| from scratch ms | epsilon_if ms (worst) |", file=out)
    print("|" + "---|" * 12, file=out, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedge-bench-ledger-") as tmp:
        for history in ("repeated", "distinct"):
            r = _one(history, rounds, Path(tmp))
            rows.append(r)
            print(f"| {history} | {r['entries']:,} | {r['distinct_events']:,} "
                  f"| {r['build_s']:.1f} | {r['open_s']:.2f} | {r['new_cold_ms']:.2f} "
                  f"| {r['new_warm_ms']:.2f} | {r['new_scratch_ms']:.1f} "
                  f"| {r['repeat_cold_ms']:.2f} | {r['repeat_warm_ms']:.2f} "
                  f"| {r['repeat_scratch_ms']:.1f} | {r['epsilon_if_ms']:.2f} |",
                  file=out, flush=True)
    return rows
