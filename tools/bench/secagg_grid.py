"""Benchmark 3: secure aggregation across cohort sizes and dimensions, beside its floors.

Each configuration is one ``run_secagg_bench`` round (:mod:`tools.bench.secagg`: a complete
SecAgg+ round in memory, exactness checked) in a fresh process, so its peak RSS is its own
and a configuration that does not fit ends alone. The process gets ``RLIMIT_AS`` =
``mem_cap_gib`` and a wall-clock limit; what exceeds either is reported as not completed,
with the limit, and every larger d at the same (n, graph) is then skipped (it cannot be
cheaper).

A cell whose *predicted* round time or peak RSS is over the per-cell budget
(``cell_budget_s``: 300 s with ``--quick``, 600 s otherwise) or the memory cap is not
started; its row says ``not run: estimated ...`` with the prediction and what it rests on
(:func:`estimate`: linear in d through the measured cells of the same n and graph, else the
same d at a smaller n scaled by the pairwise work n * k), and the command that measures it.
An estimate is never reported as a measurement.

Floors beside the measured times:

* client masking and server unmasking: the ChaCha20 keystream of the same number of masks
  at the ring's width, read chunk by chunk into one reused buffer at the fastest chunk
  (``prg_bound_s``, ``server_prg_bound_s`` from the round itself;
  :func:`tools.bench.floors.keystream_pass`);
* the aggregator's running sum of the uploads (``server_collect_s``, which also verifies
  signatures and unpacks): survivors x one in-place uint64 addition of d words
  (:func:`tools.bench.floors.add_seconds`, memory bandwidth), measured in this process.

The grid: n in {100, 1000}, d in {1e4, 1e5, 1e6}, dropouts 0 and 10 %, SecAgg+ degree
``2 ceil(log2 n)``, and the same for the O(n^2) full graph. ``--quick`` (under 10 minutes
for ``fedge bench all --quick`` on a shared 2-core machine): d in {1e4, 1e5}; no dropouts
only for SecAgg+ at n = 100; the full graph only at n = 100.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, TextIO

from edge_sdk.hazmat.graph import default_degree
from tools.bench.client import REPO
from tools.bench.floors import add_seconds
from tools.bench.secagg import CLIENT_REPS

__all__ = ["estimate", "grid", "run_secagg_grid"]

_CHILD = r'''
import json, resource, sys
from tools.bench.secagg import run_secagg_bench
n, d, drop = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
full, reps = sys.argv[4] == "1", int(sys.argv[5])
r = run_secagg_bench(n, d, drop, None, full, reps=reps, out=None)
from tools.bench.rss import peak_rss_mib
r["peak_rss_mib"] = peak_rss_mib()
print(json.dumps(r))
'''


def grid(quick: bool) -> list[tuple[int, int, float, bool]]:
    """(n, d, dropout, full_graph) in the order they run (cheapest first per (n, graph))."""
    dims = (10_000, 100_000) if quick else (10_000, 100_000, 1_000_000)
    cells = []
    for full in (False, True):
        for n in (100, 1000):
            if full and quick and n > 100:
                continue
            for d in dims:
                for drop in (0.0, 0.1):
                    # --quick: without dropouts only at n = 100 (time on a shared machine)
                    if not (quick and drop == 0.0 and (full or n > 100)):
                        cells.append((n, d, drop, full))
    return cells


def estimate(n: int, d: int, full: bool, measured: list[dict[str, Any]],
             key: str = "run_s") -> tuple[float, str] | None:
    """Predict ``key`` (``run_s`` or ``peak_rss_mib``) of cell (n, d, graph) from measured rows.

    Same n and graph at smaller d: linear in d through the two largest measured d (one
    point: times the growth from that d to this one at the largest smaller n measured at
    both, else proportional to d, which overstates when fixed costs dominate). Else the same d
    at the largest smaller n of that graph, scaled by the pairwise work n * k (k = n - 1 for
    the full graph, SecAgg+'s ``default_degree`` otherwise), the part that grows fastest.
    Rows of either dropout count; at each d the larger value is used. None: no basis.
    """
    def k(m: int) -> int:
        return m - 1 if full else default_degree(m)

    by_d: dict[int, float] = {}
    for r in measured:
        if r.get("clients") == n and r.get("full_graph") == full and key in r:
            by_d[r["dim"]] = max(by_d.get(r["dim"], 0.0), float(r[key]))
    pts = sorted((dd, v) for dd, v in by_d.items() if dd < d)
    graph = "full graph" if full else "SecAgg+"
    if len(pts) >= 2:
        (d1, v1), (d2, v2) = pts[-2:]
        slope = max(0.0, (v2 - v1) / (d2 - d1))
        return v2 + slope * (d - d2), f"linear in d through n={n} {graph} d={d1:g}, {d2:g}"
    if len(pts) == 1:
        d1, v1 = pts[0]
        # how the same graph grew from d1 to d at a smaller n, else proportional to d
        for n0 in sorted({r["clients"] for r in measured if r.get("clients", n) < n},
                         reverse=True):
            at = {r["dim"]: float(r[key]) for r in measured
                  if r.get("clients") == n0 and r.get("full_graph") == full and key in r}
            if d1 in at and d in at and at[d1] > 0:
                return (v1 * at[d] / at[d1],
                        f"n={n} {graph} d={d1:g} times the d={d1:g} -> {d:g} growth at n={n0}")
        return v1 * d / d1, f"proportional to d from n={n} {graph} d={d1:g}"
    smaller = [r for r in measured if r.get("full_graph") == full and r.get("dim") == d
               and key in r and r.get("clients", n) < n]
    if smaller:
        n0 = max(r["clients"] for r in smaller)
        v0 = max(float(r[key]) for r in smaller if r["clients"] == n0)
        return (v0 * (n * k(n)) / (n0 * k(n0)),
                f"n={n0} {graph} d={d:g} scaled by the pairwise work n*k")
    return None


def _run_one(n: int, d: int, drop: float, full: bool, *, reps: int, timeout_s: float,
             mem_cap_gib: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    cap = int(mem_cap_gib * 2**30)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(n), str(d), repr(drop), "1" if full else "0",
             str(reps)], capture_output=True, text=True, env=env, cwd=REPO,
            timeout=timeout_s, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return {"not_run": f"did not finish within {timeout_s:.0f} s on this machine"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        why = ("did not fit in memory" if "MemoryError" in proc.stderr
               or proc.returncode in (-9, 137) else "failed")
        return {"not_run": f"{why} (RLIMIT_AS {mem_cap_gib:g} GiB, "
                           f"{time.perf_counter() - t0:.0f} s): {tail[0][:160]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_secagg_grid(*, quick: bool = False, cells: list[tuple[int, int, float, bool]] | None = None,
                    reps: int | None = None, timeout_s: float | None = None,
                    cell_budget_s: float | None = None, mem_cap_gib: float = 16.0,
                    out: TextIO = sys.stdout) -> list[dict[str, Any]]:
    """Run every cell of the grid; print one table; return one row per cell.

    A row is ``run_secagg_bench``'s result plus ``peak_rss_mib``, ``sum_floor_s`` and
    ``collect_over_floor``, or ``{clients, dim, dropout, full_graph, not_run: reason}``
    (with ``estimated_run_s`` / ``estimated_peak_rss_mib`` where a prediction over the
    budget kept the cell from starting). ``timeout_s`` (default 300 / 1800 s) stops a
    started cell; ``cell_budget_s`` (default 300 / 600 s) keeps one from starting.
    """
    default_grid = cells is None
    cells = grid(quick) if cells is None else cells
    reps = reps or (2 if quick else 3)
    timeout_s = timeout_s or (300.0 if quick else 1800.0)
    cell_budget_s = cell_budget_s or (300.0 if quick else 600.0)
    add_floor: dict[int, float] = {}
    print(f"# secure aggregation, one full round per configuration in a fresh process "
          f"(RLIMIT_AS {mem_cap_gib:g} GiB, limit {timeout_s:.0f} s), 32-bit ring; "
          f"client masking (seeds derived, as at upload; key agreement is client_keyagree_s "
          f"in the JSON) and its ChaCha20 keystream floor (4 keystream bytes per value, "
          f"best chunk): best of max({reps}, {CLIENT_REPS}), timed in turn; "
          f"server times: the round's "
          "single run. Ratio = time / floor"
          + ("; --quick leaves d = 1e6, the full graph at n = 1000, and the 0 % dropout "
             "rows at n = 1000 and for the full graph, to the full run"
             if quick and default_grid else "")
          + f". Cells predicted to take over {cell_budget_s:.0f} s or {mem_cap_gib:g} GiB are "
          "not started: their rows give the estimate and its basis"
          + ". Floors and times are best-of timings on a shared machine: a ratio below 1 "
          "means other load slowed the floor's own timing", file=out)
    print("| n | d | dropout | graph (k) | exact | client mask s | PRG floor s | ratio "
          "| server unmask s | PRG floor s | ratio | Shamir s | collect s | sum floor s "
          "| ratio | B up/client | vector B | overhead | round s | peak RSS MiB |", file=out)
    print("|" + "---|" * 20, file=out, flush=True)
    rows: list[dict[str, Any]] = []
    given_up: dict[tuple[int, bool], str] = {}
    for n, d, drop, full in cells:
        graph = "full" if full else "SecAgg+"
        measured = [r for r in rows if "not_run" not in r]
        t_est = estimate(n, d, full, measured)
        m_est = estimate(n, d, full, measured, key="peak_rss_mib")
        if (n, full) in given_up:
            row = {"clients": n, "dim": d, "dropout": drop, "full_graph": full,
                   "not_run": f"skipped: {given_up[(n, full)]}"}
        elif ((t_est and t_est[0] > cell_budget_s)
              or (m_est and m_est[0] > mem_cap_gib * 1024)):
            flag = " --full-graph" if full else ""
            why = [f"{t_est[0]:.0f} s ({t_est[1]})"] if t_est else []
            why += [f"peak RSS {m_est[0]:.0f} MiB ({m_est[1]})"] if m_est else []
            row = {"clients": n, "dim": d, "dropout": drop, "full_graph": full,
                   "estimated_run_s": t_est and round(t_est[0], 1),
                   "estimated_peak_rss_mib": m_est and round(m_est[0]),
                   "not_run": f"estimated {'; '.join(why)}, over the per-cell budget of "
                              f"{cell_budget_s:.0f} s / {mem_cap_gib:g} GiB; measure it with "
                              f"`fedge bench secagg --clients {n} --dim {d} --dropout {drop:g}"
                              f"{flag}`"}
        else:
            row = _run_one(n, d, drop, full, reps=reps, timeout_s=timeout_s,
                           mem_cap_gib=mem_cap_gib)
            row.update(clients=n, dim=d, dropout=drop, full_graph=full)
            if "not_run" in row:
                given_up[(n, full)] = f"n={n} {graph} at d={d:g} {row['not_run']}"
        if "not_run" in row:
            print(f"| {n} | {d:g} | {drop:.0%} | {graph} | not run: {row['not_run']} "
                  + "| " * 15 + "|", file=out, flush=True)
            rows.append(row)
            continue
        if d not in add_floor:
            add_floor[d] = add_seconds(d)
        row["sum_floor_s"] = row["survivors"] * add_floor[d]
        row["collect_over_floor"] = row["server_collect_s"] / row["sum_floor_s"]
        rows.append(row)

        def f(v: float | None, spec: str = ".4f") -> str:
            return "-" if v is None else f"{v:{spec}}"

        print(f"| {n} | {d:g} | {drop:.0%} | {graph} ({row['degree']}) | {row['exact']} "
              f"| {f(row['client_mask_s'])} | {f(row['prg_bound_s'])} "
              f"| {f(row['client_mask_over_bound'], '.2f')}x | {f(row['server_unmask_s'])} "
              f"| {f(row['server_prg_bound_s'])} | {f(row['server_unmask_over_bound'], '.2f')}x "
              f"| {f(row['server_shamir_s'])} | {f(row['server_collect_s'], '.3f')} "
              f"| {f(row['sum_floor_s'])} | {row['collect_over_floor']:.0f}x "
              f"| {row['bytes_up_per_client']} | {row['bytes_vector']} "
              f"| {row['bytes_up_per_client'] / row['bytes_vector']:.3f} | {row['run_s']:.1f} "
              f"| {row['peak_rss_mib']:.0f} |", file=out, flush=True)
    return rows
