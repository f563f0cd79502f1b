"""The accountant benchmark runs end to end and agrees with dp_accounting (small K, smoke)."""

from __future__ import annotations

import io

import pytest

from tools.bench.accountant import run_accountant_bench

ROW_KEYS = {
    "steps", "sample_rate", "noise_multiplier", "delta",
    "fedge_rdp_s", "dp_accounting_rdp_s", "fedge_pld_s", "dp_accounting_pld_s",
    "fedge_rdp_eps", "dp_accounting_rdp_eps", "fedge_pld_eps", "dp_accounting_pld_eps",
    "fedge_pld_mem_mib", "dp_accounting_pld_mem_mib", "rdp_speedup", "pld_speedup",
    "fedge_pld_dpa_grid_s", "fedge_pld_dpa_grid_eps", "fedge_pld_dpa_grid_mem_mib",
    "pld_dpa_grid_speedup", "fedge_pld_tighter_grid_s", "fedge_pld_tighter_grid_eps",
    "fedge_pld_tighter_grid_mem_mib", "pld_tighter_grid_speedup",
}


def test_accountant_bench_row_against_dp_accounting() -> None:
    buf = io.StringIO()
    (row,) = run_accountant_bench(steps_list=(100,), reps=1, out=buf)
    assert ROW_KEYS <= row.keys()
    assert (row["steps"], row["sample_rate"], row["noise_multiplier"], row["delta"]) == (
        100, 0.01, 1.1, 1e-5)
    for key in ("fedge_rdp_s", "dp_accounting_rdp_s", "fedge_pld_s", "dp_accounting_pld_s"):
        assert row[key] > 0, key
    for key in ("fedge_pld_mem_mib", "fedge_pld_dpa_grid_mem_mib",
                "fedge_pld_tighter_grid_mem_mib", "dp_accounting_pld_mem_mib"):
        assert row[key] >= 0, key
    assert row["rdp_speedup"] == pytest.approx(
        row["dp_accounting_rdp_s"] / row["fedge_rdp_s"])
    assert row["pld_speedup"] == pytest.approx(
        row["dp_accounting_pld_s"] / row["fedge_pld_s"])
    assert row["fedge_rdp_eps"] == pytest.approx(row["dp_accounting_rdp_eps"], rel=1e-2)
    assert row["fedge_pld_eps"] == pytest.approx(row["dp_accounting_pld_eps"], rel=1e-2)
    table = buf.getvalue().splitlines()
    assert table[1].startswith("| steps |") and table[3].startswith("| 100 | 0.01 |")
    header = [c.strip() for c in table[1].strip("|").split("|")]
    cells = table[3].strip("|").split("|")
    assert len(cells) == len(header) == table[2].count("---")
    for col in ("RDP speedup", "fedge PLD MiB", "fedge PLD @1e-4 MiB", "dp_acc PLD MiB",
                "fedge PLD @9e-5 MiB"):
        assert col in header, col
