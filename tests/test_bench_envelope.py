"""Benchmark 6's harness on a small round: the real `fedge device` agent, pinned to CPU 0
and capped with prlimit, against a real mosquitto and a real `fedge aggregator`.

The numbers are not checked (they are the benchmark's); the plumbing is: the round
completes with the agent among the survivors, the aggregate is exact, the agent's bytes
were counted by the relay and its memory was measured.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tools.bench.envelope import AgentFailed, run_agent_round
from tools.datasets import FASHION_MNIST_DIR

pytestmark = [
    pytest.mark.broker,
    pytest.mark.skipif(shutil.which("mosquitto") is None, reason="needs mosquitto"),
    pytest.mark.skipif(not Path(FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz").exists(),
                       reason="needs the dataset-fashion-mnist package"),
]


def test_a_capped_pinned_agent_completes_a_secure_round() -> None:
    r = run_agent_round(limit="data", cohort=3, steps=2, batch_size=8, probe=False,
                        timeout_s=35.0)
    assert r["completed"] and r["agent_survived"] and r["agent_contributed"]
    assert r["exact"]
    assert r["survivors"] == 3
    assert r["limit"] == "RLIMIT_DATA" and "prlimit --data=536870912" in r["command"]
    assert r["command"].startswith("taskset -c 0 ")
    # the relay saw the whole upload and the retained model + the new one come back
    assert r["tcp_bytes_sent"] > r["bytes_upload_payload"] > 4 * r["dim"]
    assert r["tcp_bytes_received"] > 2 * 4 * r["dim"]
    assert 0 < r["vm_hwm_mib"] <= r["peak_rss_mib"] + 1 and r["vm_peak_mib"] > 0
    for key in ("plan_to_trained_s", "shares_to_upload_s", "round_wall_s"):
        assert r[key] is not None and r[key] >= 0, key


def test_bad_arguments_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="limit must be one of"):
        run_agent_round(limit="rss")
    with pytest.raises(ValueError, match="agent must be"):
        run_agent_round(agent="docker")
    assert issubclass(AgentFailed, RuntimeError)
