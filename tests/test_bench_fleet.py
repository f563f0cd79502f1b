"""Smoke test of the MQTT fleet benchmark at a tiny size (the real run is `fedge bench all`)."""

from __future__ import annotations

import io

import pytest

from tools.bench.fleet import run_fleet_bench


@pytest.mark.broker
def test_fleet_bench_runs_both_transports_to_the_same_model() -> None:
    buf = io.StringIO()
    rows = run_fleet_bench(quick=True, sizes=(40,), out=buf)
    ref, mq = rows
    assert (ref["transport"], mq["transport"]) == ("inproc", "mqtt")
    assert mq["same_model"] and mq["rounds_completed"] == 3 and mq["note"] == ""
    assert mq["device_rounds"] == ref["device_rounds"] > 0
    assert mq["device_rounds_per_min"] > 0 and mq["vs_inproc"] > 0
    assert mq["broker_cpu_s"] >= 0 and mq["broker_peak_rss_mib"] > 0
    assert mq["bytes_up"] == ref["bytes_up"] > 0  # the same messages, counted the same way
    assert "| 40 | mqtt | 3/0 |" in buf.getvalue()


@pytest.mark.broker
def test_round_timeline_accounts_for_the_round() -> None:
    """Issue 18's round timeline: each stage timed, the busy time and the broker round trip
    (real mosquitto_pub/mosquitto_sub) measured, and the floor never above the wall."""
    from tools.bench.round_timeline import run_round_timeline_bench

    buf = io.StringIO()
    [row] = run_round_timeline_bench(rounds=3, out=buf)
    assert row["devices"] == 10 and row["rounds_completed"] == 3
    assert set(row["stages_ms"]) == {"collect_keys", "collect_shares", "collect_masked",
                                     "collect_unmask"}
    assert 0 < row["rtt_ms"] < 1000
    assert 0 < row["slowest_device_ms"] <= row["devices_busy_ms"]
    for r in row["rounds_detail"]:
        # what the endpoints did inside the round cannot exceed its wall time
        assert r["devices_busy_ms"] + r["aggregator_busy_ms"] <= r["wall_ms"] * 1.05
        assert abs(sum(r["stages_ms"].values()) - r["wall_ms"]) < 1e-6 * r["wall_ms"] + 1e-3
    assert row["wall_over_floor"] > 0 and "| wall ms |" in buf.getvalue()
