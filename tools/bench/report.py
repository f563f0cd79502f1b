"""``fedge bench all``: every benchmark in one run, written to docs/benchmarks.md.

Each section is a table printed by its benchmark, with the reference it is measured
against in the same run and the ratio; the report states the machine, its load, the peer
versions and the exact command. Benchmarks that cannot run in this checkout are listed as
not run with the reason, never faked. Every figure that misses a target of the issue it
belongs to is listed at the top of the report with its gap (:data:`TARGETS`,
:func:`check_targets`).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import io
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from tools.bench.client import REPO, machine

__all__ = ["DOC", "NotRun", "Section", "TARGETS", "Target", "check_targets", "run_all"]

DOC = REPO / "docs" / "benchmarks.md"
PEERS = ("torch", "opacus", "dp-accounting")


class NotRun(Exception):
    """A benchmark that cannot run in this checkout; the message is the reason."""


@dataclass(frozen=True, slots=True)
class Section:
    key: str
    title: str
    run: Callable[[TextIO], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """A figure an issue asks for: ``row[key] op bound`` on the selected rows.

    ``where`` selects rows of a list-valued section by equality of their fields (every
    row when empty); a dict-valued section is one row.
    """

    issue: int
    what: str
    section: str
    key: str
    op: Literal[">=", "<="]
    bound: float
    where: Mapping[str, Any] = field(default_factory=dict)
    why: str | None = None  # a row key whose text says where the time goes (issue 18)


TARGETS: tuple[Target, ...] = (
    Target(issue=2, what="client step, CNN b32 1 thread: fedge / Opacus samples/s",
           section="client", where={"model": "cnn", "batch": 32, "threads": 1},
           key="speed_ratio", op=">=", bound=1.2, why="time_split"),
    Target(issue=2, what="client step, MLP b64 1 thread: fedge / Opacus samples/s",
           section="client", where={"model": "mlp", "batch": 64, "threads": 1},
           key="speed_ratio", op=">=", bound=5.0, why="time_split"),
    Target(issue=2, what="client step: fedge / Opacus peak RSS", section="client",
           key="rss_ratio", op="<=", bound=0.25),
    Target(issue=8, what="client step, CNN b32 1 thread: fedge / Opacus samples/s",
           section="client", where={"model": "cnn", "batch": 32, "threads": 1},
           key="speed_ratio", op=">=", bound=2.0, why="time_split"),
    Target(issue=8, what="client step, CNN b32 1 thread: fedge / Opacus peak RSS",
           section="client", where={"model": "cnn", "batch": 32, "threads": 1},
           key="rss_ratio", op="<=", bound=0.25),
    Target(issue=8, what="installed size: device stack / torch + Opacus", section="stacks",
           key="size_ratio", op="<=", bound=0.2),
    # Issue 3 states both for 70,000 steps; the PLD comparison is "at equal or better
    # accuracy", so fedge runs on a grid 0.9x dp_accounting's (its epsilon is then at or
    # below dp_accounting's). fedge's automatic grid is finer still and slower: it is in
    # the table, not a target.
    Target(issue=3, what="accountant, 70,000 steps: RDP speedup over dp_accounting RDP",
           section="accountant", where={"steps": 70_000},
           key="rdp_speedup", op=">=", bound=10.0),
    Target(issue=3, what="accountant, 70,000 steps: PLD speedup over dp_accounting PLD at "
                         "equal or better accuracy (no slower)",
           section="accountant", where={"steps": 70_000},
           key="pld_tighter_grid_speedup", op=">=", bound=1.0),
    Target(issue=18, what="ledger, 10,000 entries: epsilon_if ms (worst of new/repeated "
                          "event, cold/warm)",
           section="ledger", where={"entries": 10_000}, key="epsilon_if_ms", op="<=",
           bound=50.0),
    Target(issue=5, what="secagg n=1000 d=1e5 10% dropouts: client masking / PRG floor",
           section="secagg",
           where={"clients": 1000, "dim": 100_000, "dropout": 0.1, "full_graph": False},
           key="client_mask_over_bound", op="<=", bound=2.0),
    Target(issue=5, what="secagg n=1000 d=1e5 10% dropouts: server unmask / PRG floor",
           section="secagg",
           where={"clients": 1000, "dim": 100_000, "dropout": 0.1, "full_graph": False},
           key="server_unmask_over_bound", op="<=", bound=2.0),
    # masking with the seeds derived (as at upload: share_keys derives them a stage earlier;
    # client_keyagree_s reports that part) against exactly 4 keystream bytes per value (b = 32)
    Target(issue=15, what="secagg n=1000 d=1e5 10% dropouts: client masking / 4-byte "
                          "ChaCha20 floor",
           section="secagg",
           where={"clients": 1000, "dim": 100_000, "dropout": 0.1, "full_graph": False},
           key="client_mask_over_bound", op="<=", bound=1.3),
)

# Issue 18: closer to the floor. Each as measured in the same run; the last two need their
# sections (a round timeline, bytes of a small model's upload), which a run without them
# lists as not measured.
_I18_SECAGG = {"clients": 1000, "dropout": 0.1, "full_graph": False}
TARGETS += (
    Target(issue=18, what="client step, CNN b32 1 thread: fedge / Opacus samples/s",
           section="client", where={"model": "cnn", "batch": 32, "threads": 1},
           key="speed_ratio", op=">=", bound=4.0, why="time_split"),
    Target(issue=18, what="client step, CNN b32 1 thread: fedge fraction of the FLOP floor",
           section="client", where={"model": "cnn", "batch": 32, "threads": 1},
           key="fedge_fraction_of_floor", op=">=", bound=0.25, why="time_split"),
    Target(issue=18, what="client step, MLP b64 1 thread: fedge / Opacus samples/s",
           section="client", where={"model": "mlp", "batch": 64, "threads": 1},
           key="speed_ratio", op=">=", bound=15.0, why="time_split"),
    Target(issue=18, what="client step: fedge samples/s, 2 threads / 1 thread (faster: > 1)",
           section="client", where={"threads": 2}, key="threads_2_over_1", op=">=",
           bound=1.0, why="time_split"),
    *(Target(issue=18, what=f"secagg n=1000 d=1e{e} 10% dropouts: client masking / 4-byte "
                            "ChaCha20 floor",
             section="secagg", where={**_I18_SECAGG, "dim": 10**e},
             key="client_mask_over_bound", op="<=", bound=1.2, why="client_time_split")
      for e in (5, 6)),
    *(Target(issue=18, what=f"secagg n=1000 d=1e{e} 10% dropouts: server unmask / PRG floor",
             section="secagg", where={**_I18_SECAGG, "dim": 10**e},
             key="server_unmask_over_bound", op="<=", bound=1.5) for e in (5, 6)),
    Target(issue=18, what="fleet of 100 over MQTT: device-rounds/min / in-process",
           section="fleet_mqtt", where={"devices": 100, "transport": "mqtt"},
           key="vs_inproc", op=">=", bound=0.85),
    Target(issue=18, what="accountant, 70,000 steps: PLD speedup over dp_accounting PLD at "
                          "equal or better accuracy",
           section="accountant", where={"steps": 70_000},
           key="pld_tighter_grid_speedup", op=">=", bound=5.0, why="pld_time_split"),
    Target(issue=18, what="10-device SecAgg round over mosquitto: wall / (training + crypto + "
                          "4 broker round trips; the devices share one thread)",
           section="round_timeline", where={"devices": 10}, key="wall_over_floor", op="<=",
           bound=1.5),
    Target(issue=19, what="peak RSS, 100,000 vs 10,000 registered devices at cohort 100 "
                          "(memory grows with the cohort, not the fleet)",
           section="scale", where={"registered": 100_000, "cohort": 100},
           key="rss_vs_small_fleet", op="<=", bound=1.5),
    Target(issue=19, what="one gateway, 2 worker processes vs 1: device-rounds/min "
                          "(faster: > 1)",
           section="workers", where={"workers": 2}, key="vs_one_worker", op=">=", bound=1.0),
    Target(issue=18, what="logreg (650 parameters), cohort 10: bytes per upload / float32",
           section="small_upload",
           where={"model": "logreg", "cohort": 10, "protocol": "amortized"},
           key="bytes_over_float32", op="<=", bound=2.0),
)

_ROW_LABEL_KEYS = ("model", "batch", "threads", "steps", "clients", "dim", "dropout")


def _label(t: Target, row: Mapping[str, Any], many: bool) -> str:
    if not many:
        return t.what
    parts = [f"{k}={row[k]}" for k in _ROW_LABEL_KEYS if k in row and k not in t.where]
    return f"{t.what} ({', '.join(parts)})" if parts else t.what


def _gap(op: str, measured: float, bound: float) -> str:
    if op == ">=":
        return (f"{measured:.3g} vs target >= {bound:g}: {measured / bound:.0%} of the target, "
                f"{bound / measured:.2f}x short" if measured > 0 else
                f"{measured:.3g} vs target >= {bound:g}")
    return f"{measured:.3g} vs bound <= {bound:g}: {measured / bound:.2f}x the bound"


def check_targets(results: Mapping[str, Any],
                  targets: Sequence[Target] = TARGETS) -> list[dict[str, Any]]:
    """Evaluate every target on the results; one check per (target, matching row).

    Each check: ``issue, what, key, op, bound, measured`` (None when not measured),
    ``ok`` and ``gap`` (a sentence; for a missing measurement, why it is missing).
    A target with no matching row, or a section that did not run, is a failed check:
    an unmeasured target is a shortfall too.
    """
    checks: list[dict[str, Any]] = []
    for t in targets:
        res = results.get(t.section)
        base = {"issue": t.issue, "key": t.key, "op": t.op, "bound": t.bound}
        if res is None or (isinstance(res, Mapping) and ("not_run" in res or "failed" in res)):
            why = ("section not in this run" if res is None
                   else f"section {res.get('not_run') or res.get('failed')}")
            checks.append({**base, "what": t.what, "measured": None, "ok": False,
                           "gap": f"not measured: {why}"})
            continue
        rows = [res] if isinstance(res, Mapping) else list(res)
        rows = [r for r in rows if all(r.get(k) == v for k, v in t.where.items())]
        if not rows:
            checks.append({**base, "what": t.what, "measured": None, "ok": False,
                           "gap": "not measured: no such configuration in this run"})
            continue
        for r in rows:
            label = _label(t, r, len(rows) > 1)
            v = r.get(t.key)
            if v is None:
                why = r.get("not_run") or r.get("failed") or f"{t.key} missing"
                checks.append({**base, "what": label, "measured": None, "ok": False,
                               "gap": f"not measured: {why}"})
                continue
            ok = v >= t.bound if t.op == ">=" else v <= t.bound
            gap = None if ok else _gap(t.op, v, t.bound)
            if gap is not None and t.why is not None and r.get(t.why):
                gap += f"; where the time goes (measured in this run): {r[t.why]}"
            checks.append({**base, "what": label, "measured": v, "ok": bool(ok), "gap": gap})
    return checks


def _fleet_reason() -> str:
    parts = {"edge_sdk.mqtt": "the MQTT adapter (edge_sdk.mqtt)",
             "edge_sdk.device": "the MQTT device agent (edge_sdk.device)",
             "tools.fleet": "the fleet simulator (tools.fleet)"}
    have = {m: importlib.util.find_spec(m) is not None for m in parts}
    present = [parts[m] for m, ok in have.items() if ok]
    missing = [parts[m] for m, ok in have.items() if not ok]
    text = "device-rounds/min and broker bytes for 100 and 1,000 devices through mosquitto "
    if missing:
        return text + f"need {', '.join(missing)}, which this checkout does not have yet"
    return (text + f"need a benchmark driving {', '.join(present)}; those exist in this "
            "checkout, but tools.bench.fleet.run_fleet_bench, which this section calls, "
            "is not written yet")


def _sections(quick: bool) -> list[Section]:
    def client(out: TextIO) -> Any:
        from tools.bench.client import run_client_bench

        return run_client_bench(quick=quick, out=out)

    def stacks(out: TextIO) -> Any:
        from tools.bench.stacks import run_stacks_bench

        return run_stacks_bench(quick=quick, out=out)

    def accountant(out: TextIO) -> Any:
        from tools.bench.accountant import run_accountant_bench

        rows = run_accountant_bench(quick=quick, out=out)
        print("", file=out)
        print("# accountant timings over repetitions: median (min-max) seconds", file=out)
        print("| steps | reps | fedge RDP | dp_accounting RDP | fedge PLD | dp_accounting PLD |",
              file=out)
        print("|---|---|---|---|---|---|", file=out)
        for r in rows:
            cells = [f"{r[f'{k}_s']:.4f} ({r[f'{k}_s_min']:.4f}-{r[f'{k}_s_max']:.4f})"
                     for k in ("fedge_rdp", "dp_accounting_rdp", "fedge_pld",
                               "dp_accounting_pld")]
            print(f"| {r['steps']} | {r.get('reps', '')} | {' | '.join(cells)} |", file=out)
        return rows

    def ledger(out: TextIO) -> Any:
        from tools.bench.ledger import run_ledger_bench

        return run_ledger_bench(out=out)  # 10,000 entries even in quick: the target's size

    def secagg(out: TextIO) -> Any:
        from tools.bench.secagg_grid import run_secagg_grid

        return run_secagg_grid(quick=quick, out=out)

    def fleet(out: TextIO) -> Any:
        if importlib.util.find_spec("tools.bench.fleet") is None:
            raise NotRun(_fleet_reason())
        from tools.bench.fleet import run_fleet_bench  # type: ignore[import-not-found]

        return run_fleet_bench(quick=quick, out=out)

    def wire(out: TextIO) -> Any:
        from tools.bench.wire import run_wire_bench

        return run_wire_bench(out=out)

    def round_timeline(out: TextIO) -> Any:
        from tools.bench.round_timeline import run_round_timeline_bench

        return run_round_timeline_bench(out=out)

    def small_upload(out: TextIO) -> Any:
        from tools.bench.small_upload import run_small_upload_bench

        return run_small_upload_bench(out=out)

    def scale(out: TextIO) -> Any:
        from tools.bench.scale import run_scale_bench

        return run_scale_bench(quick=quick, out=out)

    def workers(out: TextIO) -> Any:
        from tools.bench.workers import run_workers_bench

        return run_workers_bench(quick=quick, out=out)

    def envelope(out: TextIO) -> Any:
        from tools.bench.envelope import run_envelope_bench

        return run_envelope_bench(quick=quick, out=out)

    return [
        Section("client", "1. Client DP-SGD step: fedge (onnxruntime + numpy) vs Opacus "
                "(torch), beside the matmul FLOP floor", client),
        Section("stacks", "1b. Import time and installed size: device stack vs torch + Opacus",
                stacks),
        Section("accountant", "2. Accountant: fedge RDP/PLD vs dp_accounting RDP/PLD",
                accountant),
        Section("ledger", "2b. Ledger: epsilon_if on 10,000 entries", ledger),
        Section("secagg", "3. Secure aggregation (SecAgg+ and the O(n^2) full graph) vs the "
                "PRG and memory-bandwidth floors", secagg),
        Section("fleet_mqtt", "4. Fleet over MQTT: device-rounds/min and broker bytes", fleet),
        Section("round_timeline", "4b. Where a 10-device SecAgg+ round's time goes over "
                "mosquitto", round_timeline),
        Section("scale", "4c. 100,000 registered devices: memory and device-rounds/min "
                "by cohort", scale),
        Section("workers", "4d. One gateway over 1 and 2 worker processes (MQTT v5 shared "
                "subscriptions)", workers),
        Section("wire", "5. Bytes per upload vs float32 FedAvg", wire),
        Section("small_upload", "5b. A small model's bytes per round: SecAgg+ vs the "
                "amortized protocol", small_upload),
        Section("envelope", "6. Pi-class envelope: one device round pinned to one core "
                "under 512 MiB", envelope),
    ]


def _peer_versions() -> str:
    vs = []
    for p in PEERS:
        try:
            vs.append(f"{p} {md.version(p)}")
        except md.PackageNotFoundError:
            vs.append(f"{p} not installed")
    return ", ".join(vs)


def _load() -> str:
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def _shortfall_lines(checks: list[dict[str, Any]]) -> list[str]:
    bad = [c for c in checks if not c["ok"]]
    good = [c for c in checks if c["ok"]]
    lines = ["## Shortfalls against the issues' targets", ""]
    if bad:
        lines += [f"- issue {c['issue']}: {c['what']}: {c['gap']}" for c in bad]
    else:
        lines.append("None: every target below was measured and met in this run.")
    lines.append("")
    if good:
        lines.append("Met in this run: " + "; ".join(
            f"issue {c['issue']}: {c['what']} = {c['measured']:.3g} ({c['op']} {c['bound']:g})"
            for c in good) + ".")
        lines.append("")
    return lines


def run_all(*, quick: bool = False, json_out: str | None = None, doc: Path | None = None,
            out: TextIO = sys.stdout, sections: list[Section] | None = None) -> dict[str, Any]:
    """Run every benchmark, write ``doc`` (markdown, default :data:`DOC`) and optionally
    ``json_out`` (JSON).

    Returns the JSON object: one entry per section key (its rows, or ``{"not_run": why}``
    / ``{"failed": error}``), plus ``checks`` (every target), ``shortfalls`` (the failed
    checks), ``command``, ``machine``, ``generated``, ``wall_s``.
    """
    command = ("fedge bench all" + (" --quick" if quick else "")
               + (f" --json-out {json_out}" if json_out else ""))
    sections = _sections(quick) if sections is None else sections
    load_before = _load()
    started = time.perf_counter()
    generated = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: dict[str, Any] = {}
    bodies: list[str] = []
    for sec in sections:
        buf = io.StringIO()
        t0 = time.perf_counter()
        try:
            results[sec.key] = sec.run(buf)
            status = "done"
        except (NotRun, ModuleNotFoundError) as exc:
            results[sec.key] = {"not_run": str(exc)}
            print(f"not run: {exc}", file=buf)
            status = "not run"
        except Exception as exc:  # one broken benchmark must not hide the others
            results[sec.key] = {"failed": f"{type(exc).__name__}: {exc}"}
            print(f"FAILED: {type(exc).__name__}: {exc}", file=buf)
            status = "FAILED"
        # each benchmark's own "# caption" lines become captions under our heading
        body = "\n".join(f"_{line[2:]}_" if line.startswith("# ") else line
                         for line in buf.getvalue().splitlines())
        bodies += [f"## {sec.title}", "", body.rstrip(), "",
                   f"_{time.perf_counter() - t0:.0f} s_", ""]
        print(f"{sec.key}: {status} ({time.perf_counter() - t0:.0f} s)", file=out, flush=True)
    wall = time.perf_counter() - started
    checks = check_targets(results)
    shortfalls = [c for c in checks if not c["ok"]]
    head = [
        "# fedge benchmarks",
        "",
        f"Generated by `{command}` on {generated}, in {wall:.0f} s.",
        f"Machine: {machine()}; load average (1/5/15 min) {load_before} before the run, "
        f"{_load()} after (the machine is shared: other processes' load is in these numbers).",
        f"Peers (benchmark environment, `tools/bench/requirements.txt`): {_peer_versions()}.",
        "Every ratio is against a reference measured in the same run (interleaved, fresh "
        "processes where memory is reported); medians over repetitions with (min-max) where "
        "there are several.",
        "",
    ]
    doc = DOC if doc is None else doc
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(head + _shortfall_lines(checks) + bodies) + "\n")
    payload = {"command": command, "generated": generated, "machine": machine(),
               "wall_s": wall, **results, "checks": checks, "shortfalls": shortfalls}
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(f"wrote {doc} ({wall:.0f} s); {len(shortfalls)} shortfall(s)", file=out)
    return payload

