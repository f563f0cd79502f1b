"""Pictures of a run and of a ledger (issue 20): the PNG beside ``fedge simulate``'s JSON
summary, and ``fedge ledger show --plot``.

The series are built by pure functions from what the summary or the ledger already states
(:func:`run_series`, :func:`ledger_series`), so the tests compare the plotted numbers with
the summary's, not pixels; :func:`plot_run` and :func:`plot_ledger` only draw them.
matplotlib (the ``sim`` extra) is imported inside the drawing functions, with the headless
``Agg`` backend: the device stack never imports this module's dependencies.

Units: accuracy is a fraction of the test set in [0, 1]; epsilon is in nats at the stated
delta, the maximum over the devices (a run) or one device's running total (a ledger); bytes
are whole MQTT PUBLISH packets (fixed header, topic and payload) per round, as the summary's
``bytes_up_total`` / ``bytes_down_total`` count them (on the fleet path a round's bytes are
those between its start and its end: check-ins and model fan-out between rounds count only
in the totals).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LedgerSeries", "RunSeries", "ledger_series", "plot_ledger", "plot_run",
           "png_beside", "run_series"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSeries:
    """One run's per-round numbers, ready to draw.

    ``epsilon`` maps a label (the unit: which view, which theorem's figure) to one value per
    round, None where no guarantee holds (an infinite epsilon). ``accuracy`` holds None for
    rounds that were not evaluated.
    """

    rounds: tuple[int, ...]
    accuracy: tuple[float | None, ...]
    epsilon: dict[str, tuple[float | None, ...]]
    delta: float
    epsilon_note: str
    bytes_up: tuple[int, ...]
    bytes_down: tuple[int, ...]
    title: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerSeries:
    """A device ledger's running spend after each entry against its budget (nats)."""

    device_id: str
    seq: tuple[int, ...]
    time: tuple[float, ...]  # entry time, seconds since the epoch (UTC)
    local: tuple[float | None, ...]  # None: infinite (a release without noise)
    aggregate: tuple[float | None, ...]
    budget_epsilon: float
    delta: float
    accountant: str


def png_beside(json_path: str | Path) -> Path:
    """The PNG path written beside a JSON summary: ``out/fleet.json`` -> ``out/fleet.png``."""
    p = Path(json_path)
    if p.suffix.lower() == ".png":
        raise ValueError(f"the summary path must not be a .png (the plot goes beside it), "
                         f"got {str(p)!r}")
    return p.with_suffix(".png")


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def run_series(summary: dict[str, Any]) -> RunSeries:
    """The per-round series of a summary of either simulator path.

    With per-round rows (``summary["rounds"]``, one row per ended round, failed ones
    included: the fleet path's, and the fast path's since plan15 G3): the round ids, each
    row's accuracy, ``epsilon_local``, ``epsilon_aggregate`` (and ``epsilon_device``
    where a row states one: device-dp) and its ``bytes``
    (``up_packets``, ``down_packets``). Without them (older fast-path summaries): rounds
    1..R, ``accuracy_per_round``, ``epsilon_per_round`` and ``bytes_per_round`` (up =
    payload + overhead, down).

    Raises:
        ValueError: a summary without per-round data, or with series of unequal lengths.
    """
    delta = float(summary["delta"])
    note = str(summary.get("epsilon_note") or "")
    if "rounds" in summary and isinstance(summary["rounds"], list):
        rows = summary["rounds"]
        rounds = tuple(int(r["round"]) for r in rows)
        accuracy = tuple(r["accuracy"] for r in rows)
        epsilon = {
            "sample-level local (anyone who sees an upload)":
                tuple(_finite(r["epsilon_local"]) for r in rows),
            "sample-level aggregate (secure sum only)":
                tuple(_finite(r["epsilon_aggregate"]) for r in rows),
        }
        device = tuple(_finite(r.get("epsilon_device")) for r in rows)
        if any(v is not None for v in device):  # device-dp: zero-out of a device's data
            epsilon["device-level aggregate (secure sum only)"] = device
        up = tuple(int(r["bytes"]["up_packets"]) for r in rows)
        down = tuple(int(r["bytes"]["down_packets"]) for r in rows)
        cfg = summary.get("config", {})
        path = ("in-process simulation" if summary.get("secagg") is False else
                f"fleet over {summary.get('transport', '?')}, secure aggregation")
        title = (f"{path}: {cfg.get('devices', '?')} devices, mechanism "
                 f"{cfg.get('mechanism', '?')}, {summary.get('rounds_completed', '?')} "
                 f"of {len(rows)} rounds completed")
    elif "bytes_per_round" in summary:
        per = summary["bytes_per_round"]
        rounds = tuple(range(1, len(per) + 1))
        accuracy = tuple(summary["accuracy_per_round"])
        # the note's tail names the theorem behind the figure (RDP accountant, cpSGD's bound)
        how = note.split(". ", 1)[1] if ". " in note else note
        label = f"max over devices ({how})" if how else "max over devices"
        epsilon = {label: tuple(_finite(e) for e in summary["epsilon_per_round"])}
        up = tuple(int(b["up_payload"]) + int(b["up_overhead"]) for b in per)
        down = tuple(int(b["down"]) for b in per)
        cfg = summary.get("config", {})
        title = (f"in-process simulation: {cfg.get('devices', '?')} devices, "
                 f"mechanism {cfg.get('mechanism', '?')}")
    else:
        raise ValueError("the summary has no per-round data ('rounds' of the fleet path or "
                         f"'bytes_per_round' of the fast path), got keys {sorted(summary)}")
    n = len(rounds)
    lengths = {"accuracy": len(accuracy), "bytes_up": len(up), "bytes_down": len(down),
               **{f"epsilon {k}": len(v) for k, v in epsilon.items()}}
    bad = {k: v for k, v in lengths.items() if v != n}
    if bad:
        raise ValueError(f"per-round series must have one value per round ({n}), got {bad}")
    return RunSeries(rounds=rounds, accuracy=accuracy, epsilon=epsilon, delta=delta,
                     epsilon_note=note, bytes_up=up, bytes_down=down, title=title)


def ledger_series(*, device_id: str, entries: Sequence[Any],
                  running: Sequence[tuple[float, float]], budget_epsilon: float,
                  delta: float, accountant: str) -> LedgerSeries:
    """The running (local, aggregate) epsilon after each ledger entry (``running`` as
    ``fedge ledger show`` computes it: commits and aborts change nothing, every reservation
    counts), with each entry's seq and time."""
    if len(entries) != len(running):
        raise ValueError(f"one running total per entry expected, got {len(running)} for "
                         f"{len(entries)} entries")
    return LedgerSeries(
        device_id=device_id,
        seq=tuple(int(e.seq) for e in entries),
        time=tuple(float(e.time) for e in entries),
        local=tuple(_finite(loc) for loc, _ in running),
        aggregate=tuple(_finite(agg) for _, agg in running),
        budget_epsilon=float(budget_epsilon), delta=float(delta), accountant=accountant)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _nan(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def _byte_unit(largest: int) -> tuple[int, str]:
    """The binary unit that keeps the largest value of a bytes axis readable."""
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= 10 * scale:
            return scale, unit
    return 1, "bytes"


def plot_run(series: RunSeries, path: str | Path) -> Path:
    """Draw accuracy, epsilon (each unit) and bytes up/down per round into a PNG."""
    plt = _plt()
    fig, (ax_acc, ax_eps, ax_bytes) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    try:
        fig.suptitle(series.title, fontsize=10)
        evaluated = [(r, a) for r, a in zip(series.rounds, series.accuracy, strict=True)
                     if a is not None]
        if evaluated:
            ax_acc.plot(*zip(*evaluated, strict=True), marker="o", markersize=3)
        ax_acc.set_ylabel("test accuracy (fraction, 0-1)")
        ax_acc.set_ylim(0, 1)
        ax_acc.set_title("accuracy per round (evaluated rounds)", fontsize=9)
        plotted = False
        for (label, eps), style in zip(series.epsilon.items(), ("-", "--"), strict=False):
            if any(e is not None for e in eps):
                ax_eps.plot(series.rounds, _nan(eps), style, marker=".", label=label)
                plotted = True
        if plotted:
            ax_eps.legend(fontsize=8)
        else:
            ax_eps.text(0.5, 0.5, "no DP guarantee (no noise): epsilon is infinite",
                        ha="center", va="center", transform=ax_eps.transAxes)
        ax_eps.set_ylabel(f"epsilon (nats) at delta={series.delta:g},\nmax over devices")
        ax_eps.set_title("epsilon per round (the legend names each view)", fontsize=9)
        largest = max((*series.bytes_up, *series.bytes_down), default=0)
        scale, unit = _byte_unit(largest)
        ax_bytes.plot(series.rounds, [b / scale for b in series.bytes_up], marker=".",
                      label="up (devices' uploads)")
        ax_bytes.plot(series.rounds, [b / scale for b in series.bytes_down], marker=".",
                      label="down (the aggregator's messages)")
        ax_bytes.set_ylim(0, max(largest / scale * 1.15, 1))
        ax_bytes.set_ylabel(f"{unit} per round (MQTT PUBLISH packets)")
        ax_bytes.set_xlabel("round")
        ax_bytes.legend(fontsize=8)
        ax_bytes.set_title("bytes per round", fontsize=9)
        for ax in (ax_acc, ax_eps, ax_bytes):
            ax.grid(alpha=0.3)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out


def plot_ledger(series: LedgerSeries, path: str | Path) -> Path:
    """Draw a device's running spend after each entry against its budget line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        ax.step(series.seq, _nan(series.local), where="post", label="local epsilon")
        ax.step(series.seq, _nan(series.aggregate), "--", where="post",
                label="aggregate epsilon (secure sum only)")
        ax.axhline(series.budget_epsilon, color="red", linestyle=":",
                   label=f"budget: epsilon {series.budget_epsilon:g}")
        span = ""
        if series.time:
            fmt = "%Y-%m-%d %H:%M:%S"
            span = (f"; {time.strftime(fmt, time.gmtime(series.time[0]))} to "
                    f"{time.strftime(fmt, time.gmtime(series.time[-1]))} UTC")
        ax.set_xlabel(f"ledger entry (seq){span}")
        ax.set_ylabel(f"epsilon spent (nats) at delta={series.delta:g}")
        ax.set_title(f"device {series.device_id}: privacy spend ({series.accountant} "
                     "accountant, every reservation counted)", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out
