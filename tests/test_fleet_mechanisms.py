"""tools/fleet.py with mechanisms update-noise, ddg and binomial (plan15 G4-G6): the aggregator
plans their rounds (``aggregator.round_core``), the devices read the plans, train, reserve
their ledgers and upload through SecAgg+ with dropouts, and the sums are the survivors'
inputs bit for bit; each device's ledger holds the mechanism's event."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_fleet import BASE, _assert_clean_rounds

from aggregator.round_core import mechanism_params
from edge_sdk.ledger.accounting import epsilon_rdp
from edge_sdk.mechanisms import binomial, ddg, update_noise
from edge_sdk.privacy.binomial import CpsgdBinomial
from edge_sdk.privacy.events import DistributedDiscreteGaussian, SampledWithoutReplacementGaussian
from edge_sdk.wire import BinomialParams, DdgParams, UpdateNoiseParams
from tools.cli import main
from tools.fleet import FLEET_NAME, Fleet
from tools.simconfig import DDG_SCALE, SimConfig

# 8 devices, all in every round: min_survivors 4 (the threshold), 1 colluder, so the
# aggregate view of ddg counts 3 honest shares; 2 of the 8 vanish per round
SMALL = dict(devices=8, participation=1.0, rounds=3, dropout=0.2)
SETTINGS = {"update-noise": dict(local_steps=5), "ddg": dict(local_steps=1),
            # binomial: N = 1024, grid S / 31; a budget its per-round epsilon fits 3 times
            "binomial": dict(local_steps=5, binomial_trials=1024, quant_levels=31,
                             budget_epsilon=1e4)}


def _fleet(tmp: Path, digits: Any, engine: Any, mechanism: str) -> tuple[Fleet, dict]:
    cfg = SimConfig(**{**BASE, **SMALL, **SETTINGS[mechanism], "mechanism": mechanism})
    fleet = Fleet(cfg, tmp, data=digits, engine=engine)
    return fleet, fleet.run()


def _reserved_rounds(fleet: Fleet, summary: dict, name: str) -> list[str]:
    """The rounds ``name`` reserved budget for: every round but those in which it vanished
    on receipt of the plan (stage ``keys``), before it could read it."""
    return [f"{FLEET_NAME}/{r['round']}" for r in summary["rounds"]
            if r["dropped"].get(name) != "keys"]


@pytest.mark.parametrize("mechanism", ["update-noise", "ddg"])
def test_inproc_fleet_runs_the_mechanism_with_dropouts(tmp_path, digits, engine,
                                                       mechanism: str) -> None:
    fleet, summary = _fleet(tmp_path, digits, engine, mechanism)
    _assert_clean_rounds(fleet, summary, 3)  # includes fleet.check_sums(): exact sums
    assert summary["rounds_completed"] == 3
    assert all(len(r["dropped"]) == 2 for r in summary["rounds"])
    assert any(r["survivors"] < 8 for r in summary["rounds"])  # someone's input is missing
    for o in fleet.outcomes.values():
        assert o.total is not None and np.any(o.total != 0)
    pol = fleet.policy
    assert pol.mechanism == mechanism
    d = sum(p.size for p in fleet.initial)
    params, length, bits = mechanism_params(pol, dim=d, cohort_size=8)
    assert length == d
    honest = pol.survivors_needed(8) - pol.max_colluders
    assert (pol.survivors_needed(8), honest) == (4, 3)
    changed = [not np.array_equal(a, b) for a, b in zip(fleet.machine.params, fleet.initial,
                                                        strict=True)]
    assert any(changed) and fleet.machine.model_version == 3
    for name in fleet.names:
        m = len(fleet.shards[name][1])
        reservations = fleet.ledgers[name].reservations()
        assert [r.plan.round_id for r in reservations] == _reserved_rounds(fleet, summary, name)
        for r in reservations:
            plan = r.plan
            assert plan.cohort_size == 4  # min_survivors, for the record
            if mechanism == "update-noise":
                assert isinstance(params, UpdateNoiseParams) and bits == 32
                # S = E lr C, noise std z S on a without-replacement subsample of E b
                assert params.update_clip == 5 * 0.5 * 1.0
                assert plan.event == SampledWithoutReplacementGaussian(
                    noise_multiplier=0.5, sample_size=5 * 16, dataset_size=m, steps=1,
                    adjacency="substitution")
                assert plan.aggregate_event == plan.event  # clamped and rounded: no less
            else:
                assert isinstance(params, DdgParams)
                gamma = 1.0 / DDG_SCALE
                assert params.gamma == gamma and bits < 32
                l2, l1 = ddg.sensitivities(1.0, gamma, d)
                sigma = 1.0 * DDG_SCALE / math.sqrt(honest)  # z (C / gamma) / sqrt(honest)
                assert params.sigma == pytest.approx(sigma, rel=1e-12)
                common = dict(l2_sensitivity=l2, l1_sensitivity=l1, sigma=params.sigma,
                              dim=d, steps=1, adjacency="zero_out")
                assert plan.event == DistributedDiscreteGaussian(devices=1, **common)
                assert plan.aggregate_event == DistributedDiscreteGaussian(devices=honest,
                                                                           **common)
    if mechanism == "ddg":  # the honest members' shares cover the sum: a smaller epsilon
        assert 0 < summary["epsilon_aggregate"] < summary["epsilon"]
        assert bits == ddg.ddg_public(
            noise_multiplier=1.0, clip=1.0, gamma=1.0 / DDG_SCALE, sparsity=1.0, lr=0.5,
            dim=d, cohort_size=8, honest=3, nominal_samples=pol.nominal_samples,
            max_local_samples=pol.max_local_samples)[1]
        sizes = [len(y) for _, y in fleet.shards.values()]
        assert (pol.max_local_samples, pol.nominal_samples) == (max(sizes), np.mean(sizes))
    else:
        assert 0 < summary["epsilon_aggregate"] == summary["epsilon"]
        assert params == update_noise.update_noise_params(
            steps=5, batch_size=16, lr=0.5, clip=1.0, noise_multiplier=1.0, update_clip=None,
            quant_levels=0, cohort_size=8, bits=32)
    json.dumps(summary, allow_nan=False)
    fleet.close()


def test_cli_runs_ddg_on_the_fleet_path(tmp_path) -> None:
    out = tmp_path / "fleet.json"
    rc = main(["simulate", "--secagg", "--transport", "inproc", "--mechanism", "ddg",
               "--dataset", "digits", "--model", "logreg", "--devices", "6",
               "--participation", "1", "--rounds", "2", "--local-steps", "1", "--clip", "1",
               "--noise-multiplier", "1", "--ddg-gamma", "0.002", "--dropout", "0.2",
               "--seed", "4", "--quiet", "--workdir", str(tmp_path / "w"),
               "--json-out", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["config"]["mechanism"] == "ddg" and summary["rounds_completed"] == 2
    assert all(len(r["dropped"]) == 1 for r in summary["rounds"])
    assert 0 < summary["epsilon_aggregate"] < summary["epsilon"]


def test_inproc_fleet_runs_binomial_with_dropouts(tmp_path, digits, engine) -> None:
    """cpSGD on the devices: integers straight into the ring, exact sums, and each ledger
    holding the Binomial event (restricted moment + delta0), never cpSGD's Thm 1."""
    fleet, summary = _fleet(tmp_path, digits, engine, "binomial")
    _assert_clean_rounds(fleet, summary, 3)  # includes fleet.check_sums(): exact sums
    assert summary["rounds_completed"] == 3
    assert all(len(r["dropped"]) == 2 for r in summary["rounds"])
    assert any(r["survivors"] < 8 for r in summary["rounds"])
    pol = fleet.policy
    assert (pol.mechanism, pol.trials, pol.levels, pol.quant_levels) == ("binomial", 1024, 31, 0)
    d = sum(p.size for p in fleet.initial)
    params, length, bits = mechanism_params(pol, dim=d, cohort_size=8)
    s_bound = 5 * 0.5 * 1.0  # E lr C
    assert params == BinomialParams(steps=5, batch_size=16, lr=0.5, clip=1.0,
                                    update_clip=s_bound, trials=1024, levels=31)
    assert length == d and bits == binomial.ring_bits(cohort_size=8, levels=31, trials=1024)
    assert bits == math.ceil(math.log2(2 * 8 * (31 + 512) + 1)) == 14
    for o in fleet.outcomes.values():
        assert o.total is not None and np.any(o.total != 0)
    assert fleet.machine.model_version == 3
    want = CpsgdBinomial(trials=1024, grid=s_bound / 31, dim=d, update_clip=s_bound,
                         sample_rate=1.0).event()
    for name in fleet.names:
        reservations = fleet.ledgers[name].reservations()
        assert [r.plan.round_id for r in reservations] == _reserved_rounds(fleet, summary, name)
        for r in reservations:
            assert r.plan.event == r.plan.aggregate_event == want
        spent = fleet.ledgers[name].spent()
        assert spent.local_epsilon == epsilon_rdp([want] * len(reservations), spent.delta)
        assert spent.local_epsilon == want_eps(want, len(reservations), spent.delta)
    assert 0 < summary["epsilon_aggregate"] == summary["epsilon"] < 1e4
    json.dumps(summary, allow_nan=False)
    fleet.close()


def want_eps(event, rounds: int, delta: float) -> float:
    """The simulator's sound figure for ``rounds`` such rounds (CpsgdBinomial.epsilon's
    formula: moments and delta0 times the rounds, the restricted conversion)."""
    from edge_sdk.privacy.binomial import BINOMIAL_ORDERS, restricted_rdp_epsilon
    return restricted_rdp_epsilon(rounds * np.array(event.rho), BINOMIAL_ORDERS,
                                  rounds * event.delta0, delta)


@pytest.mark.broker
@pytest.mark.parametrize("mechanism", ["ddg", "binomial"])
def test_over_mosquitto_equals_the_inproc_run(tmp_path, digits, engine, mechanism: str) -> None:
    """The same ddg or binomial rounds over a real broker: the same survivors and integer
    sums, bit for bit, the same model and the same ledgers."""
    ref, ref_summary = _fleet(tmp_path / "inproc", digits, engine, mechanism)
    cfg = SimConfig(**{**BASE, **SMALL, **SETTINGS[mechanism], "mechanism": mechanism,
                       "transport": "mqtt"})
    net = Fleet(cfg, tmp_path / "mqtt", data=digits, engine=engine)
    net_summary = net.run()
    _assert_clean_rounds(net, net_summary, 3)
    assert net_summary["rounds_completed"] == ref_summary["rounds_completed"] == 3
    assert [r["dropped"] for r in net.rows] == [r["dropped"] for r in ref.rows]
    for r, o in ref.outcomes.items():
        other = net.outcomes[r]
        assert (o.survivors, o.model_version) == (other.survivors, other.model_version)
        assert o.total.dtype == other.total.dtype and np.array_equal(o.total, other.total)
    assert net_summary["model_sha256"] == ref_summary["model_sha256"]
    for n in ref.names:
        assert ref.ledgers[n].spent() == net.ledgers[n].spent(), n
    ref.close()
    net.close()
