"""Plots of every run and of a ledger (issue 20): ``fedge simulate --json-out F`` writes F's
PNG beside it, ``fedge ledger show --plot`` draws a device's spend against its budget.

The drawn numbers are checked through the pure functions that build them
(:func:`tools.plots.run_series`, :func:`tools.plots.ledger_series`) against the JSON the
same command wrote; the PNGs are checked for being whole, valid PNGs of a sane size."""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from edge_sdk.ledger import Budget, Ledger, Plan
from edge_sdk.privacy import PoissonSubsampledGaussian, aggregate_event
from tools.cli import main
from tools.ledger_cli import add_ledger_parser, run_ledger
from tools.plots import ledger_series, png_beside, run_series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_png(path: Path) -> tuple[int, int]:
    """A whole PNG: signature, every chunk's CRC, IHDR first and IEND last; (width, height)."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, data[:8]
    assert 5_000 < len(data) < 2_000_000, len(data)
    pos, kinds = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, (kind, pos)
        kinds.append(kind)
        pos += 12 + length
    assert pos == len(data) and kinds[0] == b"IHDR" and kinds[-1] == b"IEND", kinds
    assert b"IDAT" in kinds
    width, height = struct.unpack(">II", data[16:24])
    assert 400 <= width <= 3000 and 300 <= height <= 3000, (width, height)
    return width, height


def test_fast_simulator_writes_its_plot_and_the_series_are_the_summarys(tmp_path) -> None:
    out = tmp_path / "run.json"
    rc = main(["simulate", "--dataset", "digits", "--model", "logreg", "--devices", "10",
               "--participation", "0.5", "--rounds", "4", "--local-steps", "3",
               "--clip", "1", "--noise-multiplier", "1.0", "--eval-every", "2",
               "--seed", "1", "--quiet", "--json-out", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert _check_png(tmp_path / "run.png") == (800, 1000)
    s = run_series(summary)
    assert s.rounds == (1, 2, 3, 4)
    assert list(s.accuracy) == summary["accuracy_per_round"]
    assert s.accuracy[0] is None and s.accuracy[1] is not None  # evaluated every 2nd round
    # the fast path's rows are the fleet's since plan15 G3: both views of the ledgers
    local, aggregate = s.epsilon.values()
    assert list(s.epsilon) == ["sample-level local (anyone who sees an upload)",
                               "sample-level aggregate (secure sum only)"]  # no device-level
    assert list(local) == summary["epsilon_per_round"]
    assert list(aggregate) == summary["epsilon_aggregate_per_round"]
    assert s.delta == summary["delta"]
    assert sum(s.bytes_up) == summary["bytes_up_total"]
    assert sum(s.bytes_down) == summary["bytes_down_total"]
    assert all(b > 0 for b in s.bytes_up + s.bytes_down)


def test_fleet_writes_its_plot_with_both_epsilon_views(tmp_path) -> None:
    out = tmp_path / "fleet.json"
    rc = main(["simulate", "--secagg", "--dataset", "digits", "--model", "logreg",
               "--devices", "20", "--participation", "0.3", "--rounds", "2",
               "--local-steps", "3", "--clip", "1", "--noise-multiplier", "1",
               "--dropout", "0.17", "--seed", "2", "--quiet", "--json-out", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    _check_png(tmp_path / "fleet.png")
    s = run_series(summary)
    rows = summary["rounds"]
    assert s.rounds == tuple(r["round"] for r in rows) and len(rows) == 2
    assert list(s.accuracy) == summary["accuracy_per_round"]
    local, aggregate = s.epsilon.values()
    assert list(local) == summary["epsilon_per_round"] == [r["epsilon_local"] for r in rows]
    assert list(aggregate) == [r["epsilon_aggregate"] for r in rows]
    assert local[-1] == summary["epsilon"] and aggregate[-1] == summary["epsilon_aggregate"]
    assert summary["rounds_completed"] >= 1
    assert list(s.bytes_up) == [r["bytes"]["up_packets"] for r in rows]
    assert list(s.bytes_down) == [r["bytes"]["down_packets"] for r in rows]
    # the totals also count what flows outside rounds (check-ins, the first model)
    assert 0 < sum(s.bytes_up) <= summary["bytes_up_total"]
    assert 0 < sum(s.bytes_down) <= summary["bytes_down_total"]


def test_neither_the_plots_nor_the_clis_import_matplotlib_until_they_draw() -> None:
    code = ("import sys, tools.plots, tools.ledger_cli, tools.cli; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_series_refuse_what_they_cannot_draw() -> None:
    with pytest.raises(ValueError, match=r"must not be a \.png.*'x\.png'"):
        png_beside("x.png")
    assert png_beside("out/fleet.json") == Path("out/fleet.png")
    with pytest.raises(ValueError, match=r"no per-round data.*'delta'"):
        run_series({"delta": 1e-5})
    short = {"delta": 1e-5, "accuracy_per_round": [0.5], "epsilon_per_round": [1.0, 2.0],
             "bytes_per_round": [{"up_payload": 1, "up_overhead": 1, "down": 1}] * 2}
    with pytest.raises(ValueError, match=r"one value per round \(2\).*'accuracy': 1"):
        run_series(short)


def _ledger_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_ledger_parser(parser.add_subparsers(dest="command", required=True))
    return run_ledger(parser.parse_args(["ledger", *argv]))


def test_ledger_show_plots_the_running_spend_against_the_budget(tmp_path, capsys) -> None:
    path = tmp_path / "dev.db"
    event = PoissonSubsampledGaussian(noise_multiplier=1.0, sample_rate=0.05, steps=20)
    agg = aggregate_event(event, honest_members=7, linear_sum=True)
    with Ledger.open(path, budget=Budget(epsilon=8.0, delta=1e-5), device_id="dev-7",
                     create=True) as led:
        for i in range(6):
            res = led.reserve(Plan(round_id=f"r{i}", model_id="m1", event=event,
                                   aggregate_event=agg, cohort_size=8, secagg_threshold=5))
            if i % 2:
                led.commit(res)
        entries = led.entries()
    png = tmp_path / "spend.png"
    assert _ledger_cli("show", "--path", str(path), "--json", "--plot", str(png)) == 0
    shown = json.loads(capsys.readouterr().out)
    _check_png(png)
    with Ledger.open(path, create=False) as led:
        from tools.ledger_cli import _running

        running = _running(led, led.entries())
    s = ledger_series(device_id="dev-7", entries=entries, running=running, budget_epsilon=8.0,
                      delta=1e-5, accountant="rdp")
    rows = shown["entries"]
    assert len(rows) == 9  # 6 reservations, 3 commits
    assert list(s.seq) == [r["seq"] for r in rows]
    assert list(s.local) == [r["running_local_epsilon"] for r in rows]
    assert list(s.aggregate) == [r["running_aggregate_epsilon"] for r in rows]
    assert s.local[-1] == shown["local_epsilon"] and s.budget_epsilon == 8.0
    assert s.local == tuple(sorted(s.local)) and s.local[-1] < 8.0
    with pytest.raises(ValueError, match="one running total per entry"):
        ledger_series(device_id="d", entries=entries, running=running[:-1],
                      budget_epsilon=8.0, delta=1e-5, accountant="rdp")
