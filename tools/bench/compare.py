"""``fedge bench compare BEFORE AFTER``: every ratio of two ``fedge bench all --json-out``
files side by side; exit 1 where AFTER is worse than BEFORE by more than the noise.

Only ratios are compared: each is measured against a reference in the same run (report.py),
so it carries over between runs far better than a raw time does. A ratio is a numeric field
of a section's row (or of a one-row section) whose name is in :data:`DIRECTIONS`, which says
for each whether higher or lower is better, from how the benchmark computes it (the
formula is beside each entry; ``report.TARGETS``' ``>=``/``<=`` agree, which
tests/test_bench_compare.py checks). A numeric field whose name looks like a ratio
(:data:`RATIO_NAME`) but is not in the table is an error: a new ratio must be given its
direction here before it can be compared, never silently skipped.

Rows are matched by their configuration fields (:data:`ROW_KEYS`: model, batch, cohort
size, transport, ...). With ``noise`` = n, a ratio is

* ``worse`` when it moved the wrong way by more than a factor 1 + n: ``after > before *
  (1 + n)`` for a lower-is-better ratio, ``after < before / (1 + n)`` for a higher-is-better
  one (the same test on the log scale both ways);
* ``better`` when it moved the right way by more than that factor, else ``same``;
* ``missing`` when BEFORE has it and AFTER does not (the section did not run or failed, the
  row is gone): it cannot be shown not to be worse;
* ``incomparable`` when one side is zero, negative or not finite and they differ;
* ``new`` when only AFTER has it (reported, never a failure).

``worse``, ``missing`` and ``incomparable`` make the exit status 1. The plan (issue 15 §6.4)
takes the noise as max/min - 1 of a ratio over three runs, at least 0.1: given several AFTER
files (``fedge bench compare BEFORE AFTER1 AFTER2 AFTER3``), each ratio's AFTER is the median
of the runs and its noise is max(``noise``, max/min - 1 over the runs) (:func:`combine`), so a
ratio that scatters by 40 % between three runs of the same code is not called worse for
moving 30 %.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

__all__ = ["DIRECTIONS", "FAILING", "RATIO_NAME", "ROW_KEYS", "Comparison", "combine", "compare",
           "load", "main", "print_table", "run"]

Better = Literal["higher", "lower"]

DIRECTIONS: Mapping[str, Better] = {
    # client: fedge / Opacus samples per second; fedge / the matmul FLOP floor's samples/s
    "speed_ratio": "higher",
    "fedge_fraction_of_floor": "higher",
    # client: fedge samples/s at 2 threads / at 1 thread (issue 18)
    "threads_2_over_1": "higher",
    # client: fedge / Opacus peak RSS
    "rss_ratio": "lower",
    # stacks: device stack / torch + Opacus, installed bytes and import seconds
    "size_ratio": "lower",
    "import_ratio": "lower",
    # accountant: dp_accounting seconds / fedge seconds
    "rdp_speedup": "higher",
    "pld_speedup": "higher",
    "pld_dpa_grid_speedup": "higher",
    "pld_tighter_grid_speedup": "higher",
    # secagg: seconds / the PRG (or memory-bandwidth) floor's seconds
    "client_mask_over_bound": "lower",
    "server_unmask_over_bound": "lower",
    "collect_over_floor": "lower",
    # fleet_mqtt: MQTT device-rounds/min / in-process device-rounds/min
    "vs_inproc": "higher",
    # wire: float32 FedAvg's bytes / this setting's bytes
    "ratio_vs_float32": "higher",
    # envelope: peak RSS / the memory cap
    "rss_over_cap": "lower",
    # round_timeline: a round's wall time / (training + crypto + 4 broker round trips), with
    # the devices' work summed (one thread) and with the slowest device's only
    "wall_over_floor": "lower",
    "wall_over_parallel_floor": "lower",
    # small_upload: bytes per upload / the float32 update's bytes
    "bytes_over_float32": "lower",
    # scale (issue 19): peak RSS at 10x the registered devices / at 10,000
    "rss_vs_small_fleet": "lower",
    # workers (issue 19): device-rounds/min with 2 worker processes / with 1
    "vs_one_worker": "higher",
}

RATIO_NAME = re.compile(r"ratio|speedup|_over_|fraction_of|(^|_)vs_")
"""Field names that look like ratios: each must be in :data:`DIRECTIONS`."""

ROW_KEYS = ("model", "batch", "threads", "steps", "clients", "dim", "dropout", "full_graph",
            "bits", "devices", "transport", "setting", "registered", "cohort", "workers")
"""The fields that name a row's configuration (the rest are measurements)."""

# top-level fields of the JSON that are not sections
_META = frozenset({"command", "generated", "machine", "wall_s", "checks", "shortfalls"})

Verdict = Literal["worse", "better", "same", "missing", "incomparable", "new"]
FAILING: frozenset[str] = frozenset({"worse", "missing", "incomparable"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """One ratio in both files.

    Attributes:
        section, row, key: where it is (``row`` is its configuration, "" for a one-row
            section).
        better: "higher" or "lower".
        before, after: the values (None where absent).
        worse_by: how many times worse AFTER is (> 1 worse, < 1 better), or None.
        verdict: see the module docstring.
        noise: the relative change this ratio was allowed (the global noise, or the AFTER
            runs' own spread where larger).
    """

    section: str
    row: str
    key: str
    better: Better
    before: float | None
    after: float | None
    worse_by: float | None
    verdict: Verdict
    noise: float = 0.1


def load(path: str | Path) -> dict[tuple[str, str, str], float]:
    """The ratios of one ``fedge bench all --json-out`` file: {(section, row, key): value}.

    Raises:
        ValueError: not such a JSON object, or a ratio-like field without a direction.
        FileNotFoundError: no such file.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or "command" not in data:
        raise ValueError(f"{path}: not a `fedge bench all --json-out` file (no 'command')")
    out: dict[tuple[str, str, str], float] = {}
    unknown: set[str] = set()
    for section, value in data.items():
        if section in _META:
            continue
        for row, fields in _rows(value):
            for key, v in fields.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                if key in DIRECTIONS:
                    out[(section, row, key)] = float(v)
                elif RATIO_NAME.search(key):
                    unknown.add(f"{section}.{key}")
    if unknown:
        raise ValueError(f"{path}: ratios without a direction: {sorted(unknown)}; add them "
                         f"to DIRECTIONS in {__name__}")
    return out


def _rows(value: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(row name, fields) of a section: its list's rows, or the section itself as one row;
    a section that did not run has none."""
    if isinstance(value, Mapping):
        if "not_run" not in value and "failed" not in value:
            yield "", value
        return
    if not isinstance(value, list):
        return
    seen: dict[str, int] = {}
    for r in value:
        if not isinstance(r, Mapping):
            continue
        name = ", ".join(f"{k}={r[k]}" for k in ROW_KEYS if k in r)
        seen[name] = seen.get(name, 0) + 1
        yield (name if seen[name] == 1 else f"{name} #{seen[name]}"), r


def combine(runs: Sequence[Mapping[tuple[str, str, str], float]],
            ) -> tuple[dict[tuple[str, str, str], float], dict[tuple[str, str, str], float]]:
    """Several runs of one code as one AFTER: (median of each ratio, its spread max/min - 1).

    A ratio is kept only where every run has it (a run that lacks it cannot be shown not
    to be worse: it is then missing); a spread over non-positive or non-finite values is 0
    (no noise estimate: the global noise applies, and :func:`compare` calls such a value
    incomparable if it differs from BEFORE).

    Raises:
        ValueError: no runs.
    """
    if not runs:
        raise ValueError("combine needs at least one run")
    median: dict[tuple[str, str, str], float] = {}
    spread: dict[tuple[str, str, str], float] = {}
    for k in runs[0]:
        vals = [r[k] for r in runs if k in r]
        if len(vals) != len(runs):
            continue
        median[k] = statistics.median(vals)
        lo, hi = min(vals), max(vals)
        spread[k] = hi / lo - 1 if lo > 0 and math.isfinite(hi) else 0.0
    return median, spread


def compare(before: Mapping[tuple[str, str, str], float],
            after: Mapping[tuple[str, str, str], float], *,
            noise: float = 0.1,
            spread: Mapping[tuple[str, str, str], float] | None = None) -> list[Comparison]:
    """Every ratio of either side, in BEFORE's order then AFTER's new ones (module
    docstring for the verdicts). ``spread`` (from :func:`combine`): a ratio's own
    run-to-run noise, used where larger than ``noise``.

    Raises:
        ValueError: noise negative or not finite.
    """
    if not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    spread = {} if spread is None else spread
    keys = list(before) + [k for k in after if k not in before]
    out = []
    for k in keys:
        better = DIRECTIONS[k[2]]
        n = max(noise, spread.get(k, 0.0))
        b, a = before.get(k), after.get(k)
        worse_by = None
        if b is None:
            verdict: Verdict = "new"
        elif a is None:
            verdict = "missing"
        elif a == b:
            verdict, worse_by = "same", 1.0
        elif not all(math.isfinite(x) and x > 0 for x in (a, b)):
            verdict = "incomparable"
        else:
            worse_by = a / b if better == "lower" else b / a
            verdict = ("worse" if worse_by > 1 + n else
                       "better" if worse_by < 1 / (1 + n) else "same")
        out.append(Comparison(section=k[0], row=k[1], key=k[2], better=better, before=b,
                              after=a, worse_by=worse_by, verdict=verdict, noise=n))
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def print_table(rows: Sequence[Comparison], *, noise: float, out: TextIO) -> None:
    """The comparison as a markdown table, then one summary line."""
    print("| section | row | ratio | better | before | after | after is x worse | noise "
          "| verdict |", file=out)
    print("|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        mark = f"**{r.verdict}**" if r.verdict in FAILING else r.verdict
        print(f"| {r.section} | {r.row} | {r.key} | {r.better} | {_fmt(r.before)} "
              f"| {_fmt(r.after)} | {_fmt(r.worse_by)} | {r.noise:.2f} | {mark} |", file=out)
    bad = [r for r in rows if r.verdict in FAILING]
    counts = {v: sum(r.verdict == v for r in rows) for v in
              ("worse", "missing", "incomparable", "better", "same", "new")}
    print(f"\n{len(rows)} ratios, noise {noise:g} (or a ratio's own spread over the AFTER "
          "runs where larger): "
          + ", ".join(f"{n} {v}" for v, n in counts.items() if n)
          + ("; FAIL" if bad else "; OK"), file=out)


def run(before: str | Path, *after: str | Path, noise: float = 0.1,
        json_out: str | Path | None = None, out: TextIO | None = None) -> int:
    """Compare BEFORE with one AFTER file, or with the median of several (each ratio's noise
    then at least their spread: :func:`combine`); print the table to ``out`` (default:
    stdout) and write the rows as JSON to ``json_out``; returns the exit status: 1 if any
    ratio is worse, missing or incomparable, else 0.

    Raises:
        ValueError: no AFTER file, or a file that is not a bench JSON.
    """
    if not after:
        raise ValueError("bench compare needs BEFORE and at least one AFTER file")
    median, spread = combine([load(a) for a in after])
    rows = compare(load(before), median, noise=noise, spread=spread)
    print_table(rows, noise=noise, out=sys.stdout if out is None else out)
    if json_out is not None:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return int(any(r.verdict in FAILING for r in rows))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tools.bench.compare BEFORE AFTER [AFTER ...] [--noise N]`` (as ``fedge
    bench compare``); exit 2 on unreadable input."""
    p = argparse.ArgumentParser(prog="fedge bench compare", description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after", nargs="+", help="one run, or several runs of the same code")
    p.add_argument("--noise", type=float, default=0.1,
                   help="allowed relative change the wrong way (default 0.1)")
    p.add_argument("--json-out", help="write the comparison rows as JSON here")
    args = p.parse_args(argv)
    try:
        return run(args.before, *args.after, noise=args.noise, json_out=args.json_out)
    except (ValueError, FileNotFoundError) as e:
        print(f"fedge bench compare: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
