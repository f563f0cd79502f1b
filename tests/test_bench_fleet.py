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
