"""A site and two gateways over real mosquittos joined by bridges, one process each
(issue 19, tools/hierarchy_mqtt.py): in three network namespaces made by the test (veth
pairs; inside each, devices reach their broker over loopback), or, where namespaces cannot
be made, on loopback ports. 2 x 20 devices, secure aggregation with dropouts in each
gateway; the final model equals the flat single-gateway run with the same seeds and
cohorts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.hierarchy import Hierarchy
from tools.hierarchy_mqtt import netns_available, run_site_mqtt
from tools.simconfig import SimConfig

pytestmark = pytest.mark.broker

CFG = dict(dataset="digits", model="logreg", devices=40, participation=0.5, local_steps=5,
           batch_size=16, lr=0.5, clip=1.0, noise_multiplier=1.0, value_bound=2.0, seed=3,
           secagg=True, progress=False, rounds=3, dropout=0.1)
NO_NETNS = netns_available()


def _flat_sha(tmp: Path, cfg: SimConfig, kill: tuple[int, int, str] | None
              ) -> tuple[str, list[int]]:
    """The flat single-gateway run's model (and survivors per round) with the cohorts
    the gateways draw, without the lost gateway's cohort in the round it was lost."""
    h = Hierarchy(cfg, tmp / "sim", gateways=2, kill=kill, round_timeout=3600.0)
    try:
        sim = h.run()
        flat = h.run_flat_twin(tmp / "flat")
    finally:
        h.close()
    assert sim["model_sha256"] == flat["model_sha256"]
    return flat["model_sha256"], [r["survivors"] for r in flat["rounds"]]


def _check(result: dict, sha: str, survivors: list[int], killed: bool) -> None:
    assert result["finished"]
    rounds = result["rounds"]
    assert [r["completed"] for r in rounds] == [True, True, True]
    assert [r["survivors"] for r in rounds] == survivors
    assert sum(survivors) < 60  # devices dropped (and were recovered) in the gateways
    if killed:  # gw-1's broker died in round 2: that round is gw-0's cohort alone
        assert rounds[1]["gateways"] == ["gw-0"] and "gw-1" in rounds[1]["missing"]
        assert rounds[2]["gateways"] == ["gw-0", "gw-1"]  # and it is back afterwards
        assert [g["killed"] for g in result["gateway_reports"]] == [False, True]
    else:
        assert all(r["gateways"] == ["gw-0", "gw-1"] for r in rounds)
    assert result["model_sha256"] == sha  # equal to the flat run, bit for bit


@pytest.mark.skipif(NO_NETNS is not None, reason=f"no network namespaces here "
                    f"({NO_NETNS}); test_loopback_ports runs the same topology")
def test_network_namespaces_with_a_gateway_broker_killed_mid_round(tmp_path) -> None:
    cfg = SimConfig(**CFG)
    kill = (2, 1, "masked")
    sha, survivors = _flat_sha(tmp_path, cfg, kill)
    result = run_site_mqtt(cfg, tmp_path / "mqtt", gateways=2, netns=True, kill=kill,
                           round_timeout=12.0, timeout=300.0)
    assert result["netns"]
    _check(result, sha, survivors, killed=True)
    # the bridges came over the veth pairs, each from its own gateway's namespace
    log = (tmp_path / "mqtt" / "site" / "broker" / "mosquitto.log").read_text()
    seen = dict(re.findall(r"connected from (10\.250\.\d\.\d):\d+ as (gw-\d)", log)[::-1])
    assert {v: k for k, v in seen.items()} == {"gw-0": "10.250.1.2", "gw-1": "10.250.2.2"}
    for g in ("gw-0", "gw-1"):  # devices stayed on their namespace's loopback
        glog = (tmp_path / "mqtt" / g / "broker" / "mosquitto.log").read_text()
        froms = set(re.findall(r"connected from ([\d.]+):", glog))
        assert froms == {"127.0.0.1"}, froms


def test_loopback_ports(tmp_path) -> None:
    if NO_NETNS is None:
        pytest.skip("network namespaces work here: the namespace test runs this topology")
    cfg = SimConfig(**CFG)
    kill = (2, 1, "masked")
    sha, survivors = _flat_sha(tmp_path, cfg, kill)
    result = run_site_mqtt(cfg, tmp_path / "mqtt", gateways=2, netns=False, kill=kill,
                           round_timeout=12.0, timeout=300.0)
    _check(result, sha, survivors, killed=True)
