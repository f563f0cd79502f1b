"""``fedge ledger show`` and ``fedge ledger verify``: read a device's privacy ledger.

``show`` prints every entry with the running local and aggregate epsilon (nats, at the
budget's delta) after it, then the totals; ``--plot OUT.png`` also draws that running spend
against the budget line (:func:`tools.plots.plot_ledger`). ``--json`` prints one object::

    {"entries": [{"seq", "kind", "reservation", "round_id", "model_id", "time", "event",
                  "aggregate_event", "cohort_size", "secagg_threshold", "prev_hash", "hash",
                  "running_local_epsilon", "running_aggregate_epsilon"}, ...],
     "local_epsilon": float, "aggregate_epsilon": float, "device_epsilon": float | null,
     "delta": float, "adjacency": "zero_out",
     "figures": [{"unit": "sample" | "device", "view": "local" | "aggregate",
                  "epsilon": float | null, "delta", "adjacency",
                  "assumptions": {"min_survivors", "secagg_threshold", "colluders",
                                  "semi_honest_aggregator"}}, ...],
     "accountant": "rdp" | "pld",
     "budget": {"epsilon": float, "delta": float, "device_epsilon": float | null},
     "device_id": str, "head": str, "reservations": int, "pending": int, "version": int}

Two units (issue 16): the sample-level figures (local and aggregate: the record is one
sample) and the device-level aggregate figure (the record is the device, its whole data
set), each printed with its adjacency and assumptions. The device-level figure is null
(``none`` in text: no theorem) as soon as one reservation has no device-level event: only
device-dp states one.

An infinite epsilon (a release without noise) is ``null``. Every reservation counts,
committed or not. Both figures are stated under zero-out adjacency; the aggregate figures
hold only under the secure-aggregation threshold, collusion and semi-honest-aggregator
assumptions (see :mod:`edge_sdk.ledger`), and equal the local ones wherever no theorem
supports less (every round whose upload is clamped or rounded before the sum).

Exit status: 0 ok; 3 the ledger is missing or corrupted (a device must not train on it);
1 any other ledger error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from edge_sdk.ledger import (
    Entry,
    Figure,
    Ledger,
    LedgerCorrupted,
    LedgerError,
    entry_to_json,
    epsilon_pld,
    epsilon_rdp,
    running_epsilon,
)

__all__ = ["add_ledger_parser", "run_ledger"]

DEFAULT_PATH = "fedge-ledger.db"
EXIT_ERROR = 1
EXIT_CORRUPTED = 3
_PATH_HELP = f"the ledger file (default {DEFAULT_PATH})"
ACCOUNTANTS = {"rdp": epsilon_rdp, "pld": epsilon_pld}


def add_ledger_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``ledger show`` and ``ledger verify`` on the ``fedge`` parser."""
    p = subparsers.add_parser("ledger", help="a device's privacy ledger")
    lsub = p.add_subparsers(dest="ledger_command", required=True)
    show = lsub.add_parser("show", help="every entry and the running local/aggregate epsilon")
    show.add_argument("--path", default=DEFAULT_PATH, help=_PATH_HELP)
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.add_argument("--accountant", choices=sorted(ACCOUNTANTS), default="rdp",
                      help="rdp (default: what the device enforces its budget with) or pld "
                           "(tightest; slow on long ledgers)")
    show.add_argument("--plot", metavar="OUT.png",
                      help="also draw the running spend after each entry against the budget "
                           "into this PNG (needs matplotlib, the sim extra)")
    verify = lsub.add_parser("verify", help="check the file, its schema and its hash chain")
    verify.add_argument("--path", default=DEFAULT_PATH, help=_PATH_HELP)


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _eps(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else "inf"


def run_ledger(args: argparse.Namespace) -> int:
    """Run ``fedge ledger show|verify``; returns the exit status (see the module docstring)."""
    accountant = ACCOUNTANTS[getattr(args, "accountant", "rdp")]
    try:
        with Ledger.open(args.path, create=False, accountant=accountant) as ledger:
            if args.ledger_command == "verify":
                _verify(ledger)
            else:
                _show(ledger, args.json, getattr(args, "accountant", "rdp"),
                      getattr(args, "plot", None))
    except LedgerCorrupted as exc:
        print(f"fedge ledger: {exc}", file=sys.stderr)
        print("fedge ledger: the device must not train on this ledger", file=sys.stderr)
        return EXIT_CORRUPTED
    except LedgerError as exc:
        print(f"fedge ledger: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return 0


def _verify(ledger: Ledger) -> None:
    entries = ledger.entries()
    kinds = [e.kind for e in entries]
    print(f"ok: {ledger.path}: {len(entries)} entries, {kinds.count('reserve')} reservations "
          f"({kinds.count('commit')} committed, {kinds.count('abort')} aborted, "
          f"{len(ledger.pending())} pending), head {ledger.head()}")


def _running(ledger: Ledger, entries: tuple[Entry, ...]) -> list[tuple[float, float]]:
    """(local, aggregate) epsilon after each entry; commit/abort entries change nothing."""
    reservations = ledger.reservations()
    totals = dict(zip((r.seq for r in reservations),
                      running_epsilon([r.plan for r in reservations], ledger.budget.delta,
                                      ledger.accountant), strict=True))
    out, last = [], (0.0, 0.0)
    for e in entries:
        last = totals.get(e.seq, last)
        out.append(last)
    return out


def _opt(v: float | None) -> float | None:
    return None if v is None else _finite(v)


def _figure_json(f: Figure) -> dict[str, object]:
    a = f.assumptions
    return {"unit": f.unit, "view": f.view, "epsilon": _opt(f.epsilon), "delta": f.delta,
            "adjacency": f.adjacency,
            "assumptions": {"min_survivors": a.min_survivors,
                            "secagg_threshold": a.secagg_threshold, "colluders": a.colluders,
                            "semi_honest_aggregator": a.semi_honest_aggregator}}


def _figure_line(f: Figure) -> str:
    """One figure with its unit, view, adjacency and assumptions, for the text output."""
    eps = "none (no device-level theorem for some release)" if f.epsilon is None else _eps(
        f.epsilon)
    a = f.assumptions
    if f.view == "local":
        rests = "no trust needed"
    else:
        rests = (f"secure aggregation threshold t>={a.secagg_threshold}, sums of >="
                 f"{a.min_survivors} survivors, <={'?' if a.colluders is None else a.colluders}"
                 f" colluders tolerated, semi-honest aggregator")
    return (f"  {f.unit}-level {f.view:<9} eps={eps} at delta={f.delta:g}; {f.adjacency} of "
            f"one {f.unit}; {rests}")


def _show(ledger: Ledger, as_json: bool, accountant: str, plot: str | None = None) -> None:
    entries = ledger.entries()
    running = _running(ledger, entries)
    spent = ledger.spent()
    figures = ledger.figures()
    if plot:
        # lazily: matplotlib is a tools extra, never needed to read a ledger on a device
        from tools.plots import ledger_series, plot_ledger

        plot_ledger(ledger_series(device_id=ledger.device_id, entries=entries, running=running,
                                  budget_epsilon=ledger.budget.epsilon,
                                  delta=ledger.budget.delta, accountant=accountant), plot)
    if as_json:
        rows = []
        for e, (local, agg) in zip(entries, running, strict=True):
            row = entry_to_json(e)
            row["running_local_epsilon"] = _finite(local)
            row["running_aggregate_epsilon"] = _finite(agg)
            rows.append(row)
        print(json.dumps({
            "entries": rows,
            "local_epsilon": _finite(spent.local_epsilon),
            "aggregate_epsilon": _finite(spent.aggregate_epsilon),
            "device_epsilon": _opt(spent.device_epsilon),
            "delta": spent.delta,
            "adjacency": spent.adjacency,
            "figures": [_figure_json(f) for f in figures],
            "accountant": accountant,
            "budget": {"epsilon": ledger.budget.epsilon, "delta": ledger.budget.delta,
                       "device_epsilon": ledger.budget.device_epsilon},
            "version": ledger.version,
            "device_id": ledger.device_id,
            "head": ledger.head(),
            "reservations": spent.entries,
            "pending": len(ledger.pending()),
        }, allow_nan=False))
        return
    b = ledger.budget
    device_budget = ("none" if b.device_epsilon is None else f"{b.device_epsilon:g}")
    print(f"ledger {ledger.path}: device {ledger.device_id}, budget eps={b.epsilon:g} "
          f"(sample-level, local) and device-level eps={device_budget} (aggregate) at "
          f"delta={b.delta:g}, accountant {accountant}")
    print(f"{'seq':>6}  {'time (UTC)':<19}  {'kind':<7}  {'round':<10} {'model':<10} "
          f"{'r':>4} {'t':>4}  {'local eps':>9} {'aggr. eps':>9}  event")
    for e, (local, agg) in zip(entries, running, strict=True):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.time))
        r = "" if e.cohort_size is None else str(e.cohort_size)
        t = "" if e.secagg_threshold is None else str(e.secagg_threshold)
        what = repr(e.event) if e.kind == "reserve" else f"({e.kind} of entry {e.reservation})"
        print(f"{e.seq:>6}  {when:<19}  {e.kind:<7}  {e.round_id:<10} {e.model_id:<10} "
              f"{r:>4} {t:>4}  {_eps(local):>9} {_eps(agg):>9}  {what}")
    print(f"spent: local eps={_eps(spent.local_epsilon)}, aggregate eps="
          f"{_eps(spent.aggregate_epsilon)} (aggregate valid only under the secure-aggregation "
          f"threshold, collusion and semi-honest-aggregator assumptions) at "
          f"delta={spent.delta:g}, {spent.adjacency} adjacency; {spent.entries} reservations, "
          f"{len(ledger.pending())} pending, all counted; {_eps(ledger.remaining())} of the "
          "budget left")
    print("by unit (every reservation counted):")
    for f in figures:
        print(_figure_line(f))
