"""tools/bench/ledger.py: the epsilon_if bench measures a real durable ledger, checks its
answer against the accountant from scratch, and feeds issue 18's target."""

from __future__ import annotations

import pytest

from tools.bench import ledger as bench
from tools.bench.report import TARGETS, check_targets


def test_one_history_measures_a_durable_ledger_and_checks_its_answer(tmp_path) -> None:
    row = bench._one("distinct", 40, tmp_path)
    assert row["entries"] == 80 and row["distinct_events"] == 40  # reserve + commit each
    assert (tmp_path / "distinct.db").exists()
    for key in ("new_cold_ms", "new_warm_ms", "repeat_cold_ms", "repeat_warm_ms",
                "new_scratch_ms", "repeat_scratch_ms", "open_s", "build_s"):
        assert row[key] > 0
    assert row["epsilon_if_ms"] == max(row["new_cold_ms"], row["repeat_cold_ms"],
                                       row["new_warm_ms"], row["repeat_warm_ms"])
    assert 0 < row["repeat_epsilon"] < row["new_epsilon"]  # q grows with the event index
    repeated = bench._one("repeated", 40, tmp_path)
    assert repeated["distinct_events"] == 1


def test_a_wrong_answer_fails_the_bench(tmp_path, monkeypatch) -> None:
    from edge_sdk.ledger import store

    real = store.Ledger.epsilon_if
    monkeypatch.setattr(store.Ledger, "epsilon_if", lambda self, plan: real(self, plan) * 0.999)
    with pytest.raises(AssertionError, match="!= epsilon_rdp"):
        bench._one("repeated", 5, tmp_path)


def test_the_target_reads_the_10000_entry_rows() -> None:
    [target] = [t for t in TARGETS if t.section == "ledger"]
    rows = [{"history": "repeated", "entries": 10_000, "epsilon_if_ms": 3.0},
            {"history": "distinct", "entries": 10_000, "epsilon_if_ms": 60.0}]
    checks = check_targets({"ledger": rows}, (target,))
    assert [c["ok"] for c in checks] == [True, False]
    assert check_targets({}, (target,))[0]["ok"] is False
