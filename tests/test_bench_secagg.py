"""Smoke test of the secure-aggregation benchmark at tiny n and d (the real run is manual)."""

from __future__ import annotations

import io
import json

import pytest

from tools.bench.secagg import run_secagg_bench
from tools.cli import main

CONTRACT = {
    "exact": bool,
    "client_mask_s": float,
    "server_unmask_s": float,
    "bytes_up_per_client": int,
    "prg_bound_s": float,
}


@pytest.mark.parametrize(
    ("kw", "degree"), [({}, 8), ({"full_graph": True}, 9), ({"neighbors": 5}, 6)]
)
def test_bench_smoke(kw: dict, degree: int) -> None:
    buf = io.StringIO()
    res = run_secagg_bench(10, 40, 0.2, bits=12, reps=1, out=buf, **kw)
    assert json.loads(buf.getvalue()) == res
    for key, kind in CONTRACT.items():
        assert isinstance(res[key], kind), key
    assert res["exact"] and res["failed"] is None
    assert res["degree"] == degree and res["survivors"] == 8
    assert res["bytes_vector"] == 40 * 12 // 8
    assert res["bytes_masked_input"] > res["bytes_vector"]
    assert res["bytes_up_per_client"] > res["bytes_masked_input"]
    assert res["masks_client"] == degree + 1 and res["masks_server"] >= 8
    assert res["prg_bound_s"] > 0 and res["server_unmask_s"] > 0


def test_bench_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="dropout must be in"):
        run_secagg_bench(5, 4, 1.0, out=None)
    with pytest.raises(ValueError, match="clients must be"):
        run_secagg_bench(2, 4, 0.0, out=None)


def test_bench_reports_a_failed_round_without_nan() -> None:
    buf = io.StringIO()
    res = run_secagg_bench(8, 4, 0.5, neighbors=4, reps=1, out=buf)
    assert json.loads(buf.getvalue()) == res  # valid JSON: no NaN
    assert res["exact"] is False and "failed" in res["failed"]
    assert res["server_unmask_s"] is None


TINY = ["bench", "secagg", "--clients", "10", "--dim", "40", "--dropout", "0.2", "--bits", "12"]


@pytest.mark.parametrize(
    ("flags", "degree"), [([], 8), (["--full-graph"], 9), (["--neighbors", "5"], 6)]
)
def test_cli_prints_the_contract_as_json(capsys, flags: list[str], degree: int) -> None:
    assert main([*TINY, *flags, "--quick", "--json"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1
    res = json.loads(out)
    for key, kind in CONTRACT.items():
        assert isinstance(res[key], kind), key
    assert res["exact"] and res["failed"] is None
    assert (res["clients"], res["dim"], res["bits"], res["dropout"]) == (10, 40, 12, 0.2)
    assert res["degree"] == degree and res["full_graph"] == ("--full-graph" in flags)


def test_cli_summary_and_json_out(capsys, tmp_path) -> None:
    path = tmp_path / "secagg.json"
    assert main([*TINY, "--quick", "--json-out", str(path)]) == 0
    line = capsys.readouterr().out
    assert line.startswith("secagg n=10 d=40 k=8: exact=True") and "{" not in line
    assert json.loads(path.read_text())["secagg"]["exact"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "secagg", "--clients", "10", "--dim", "40"], "needs --dropout"),
        ([*TINY, "--full-graph", "--neighbors", "4"], "exclude each other"),
        ([*TINY[:-2], "--dropout", "1.0"], "dropout must be in"),
        (["bench", "wire", "--clients", "10", "--json"], "--clients, --json only apply"),
    ],
)
def test_cli_rejects_bad_flags(capsys, argv: list[str], message: str) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_grid_estimates_cells_from_the_measured_ones() -> None:
    from tools.bench.secagg_grid import estimate

    rows = [{"clients": 100, "dim": 10_000, "full_graph": True, "run_s": 8.0},
            {"clients": 100, "dim": 100_000, "full_graph": True, "run_s": 11.0},
            {"clients": 100, "dim": 100_000, "full_graph": False, "run_s": 2.0}]
    t, basis = estimate(100, 1_000_000, True, rows)
    assert t == pytest.approx(11.0 + 3.0 / 90_000 * 900_000) and "linear in d" in basis
    t, basis = estimate(1000, 10_000, True, rows)  # full graph: pairwise work n (n - 1)
    assert t == pytest.approx(8.0 * 1000 * 999 / (100 * 99)) and "n=100" in basis
    assert estimate(1000, 10_000, False, rows) is None  # no SecAgg+ row at d = 1e4
    # one point at this n: the growth from d = 1e4 to 1e5 seen at n = 100 (x 11/8)
    rows.append({"clients": 1000, "dim": 10_000, "full_graph": True, "run_s": 800.0})
    t, basis = estimate(1000, 100_000, True, rows)
    assert t == pytest.approx(800.0 * 11.0 / 8.0) and "growth at n=100" in basis
    t, basis = estimate(1000, 1_000_000, True, rows)  # no n = 100 row at 1e6: proportional
    assert t == pytest.approx(800.0 * 100) and "proportional" in basis


def test_grid_does_not_start_a_cell_predicted_over_budget() -> None:
    from tools.bench.secagg_grid import run_secagg_grid

    out = io.StringIO()
    rows = run_secagg_grid(cells=[(20, 1000, 0.0, False), (20_000, 1000, 0.0, False)],
                           reps=1, cell_budget_s=30.0, out=out)
    assert rows[0]["exact"] is True
    # n = 20,000 is predicted from n = 20 by the pairwise work n * k (x 3000): not started
    assert rows[1]["estimated_run_s"] == pytest.approx(
        rows[0]["run_s"] * 20_000 * 30 / (20 * 10), rel=0.01)
    assert rows[1]["not_run"].startswith("estimated ") and "exact" not in rows[1]
    assert "fedge bench secagg --clients 20000 --dim 1000 --dropout 0`" in rows[1]["not_run"]
    assert "not run: estimated" in out.getvalue()


def test_keystream_floor_chunks_and_pass() -> None:
    from tools.bench.floors import KEYSTREAM_CHUNKS, keystream_chunks, keystream_pass

    assert keystream_chunks(10**9) == sorted(KEYSTREAM_CHUNKS)
    assert keystream_chunks(100_000) == [1 << 15, 1 << 16, 100_000]  # a short stream whole
    keystream_pass(3, 70_000, 1 << 15)()  # two full chunks and a partial one
    with pytest.raises(ValueError, match="chunk >= 1"):
        keystream_pass(3, 10, 0)
