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
