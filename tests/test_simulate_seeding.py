"""The fast simulator draws its rounds as the fleet does (plan15 step G0): for the same seed
the same cohorts, the same round seeds (hence the same rand-k sets) and, on each device, the
same round randomness, so its runs differ from the fleet's only by the arithmetic the later
steps unify.

The fleet side is observed, not recomputed: its cohorts and round seeds are read from the
plans the round machine published (decoded off the in-memory broker), each device's
randomness from the residues it fed into the secure sum."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_sdk import compress, wire
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.fixedpoint import FixedPoint
from edge_sdk.model import flatten_params
from edge_sdk.train import local_round
from tools.fleet import AGGREGATOR, Fleet
from tools.seeding import device_seed
from tools.simconfig import SimConfig
from tools.simulate import round_draws

# digits + logreg, 12 devices, cohorts of 6, rand-k at half the coordinates (the round seed
# then decides which), noise on: every draw G0 aligns shows up in the devices' inputs
SETTINGS = dict(dataset="digits", model="logreg", devices=12, participation=0.5, rounds=3,
                local_steps=3, batch_size=16, lr=0.5, clip=1.0, noise_multiplier=1.0,
                value_bound=2.0, sparsity=0.5, progress=False, secagg=True, transport="inproc")


def _fleet_plans(fleet: Fleet) -> dict[int, tuple[tuple[str, ...], bytes]]:
    """round id -> (cohort, round seed) of the plans the aggregator published (each cohort
    member gets the same plan)."""
    assert fleet.memory is not None
    seen: dict[int, set[tuple[tuple[str, ...], bytes]]] = {}
    for sender, topic, payload in fleet.memory.sent:
        if sender == AGGREGATOR and topic.endswith("/plan"):
            plan = wire.decode(payload, wire.DOWN_KINDS)
            assert isinstance(plan, wire.RoundPlan)
            seen.setdefault(plan.round_id, set()).add((tuple(plan.cohort), plan.round_seed))
    assert all(len(v) == 1 for v in seen.values()), seen
    return {r: next(iter(v)) for r, v in sorted(seen.items())}


@pytest.mark.parametrize("seed", [5, 6])
def test_fast_simulator_draws_the_inproc_fleets_rounds(seed: int, tmp_path: Path,
                                                       digits: Any, engine: Any) -> None:
    cfg = SimConfig(**SETTINGS, seed=seed)
    fleet = Fleet(cfg, tmp_path, data=digits, engine=engine)
    try:
        summary = fleet.run()
        assert summary["note"] == "" and summary["rounds_completed"] == cfg.rounds
        plans = _fleet_plans(fleet)

        fast = {rnd: (tuple(fleet.names[i] for i in cohort), round_seed)
                for rnd, cohort, round_seed in round_draws(seed, cfg.devices,
                                                           cfg.cohort_size, cfg.rounds)}
        assert fast == plans  # cohorts and round seeds, round by round
        assert len({c for c, _ in fast.values()}) > 1  # the cohort does change per round

        # Round 1 (both start from the same initial model): each cohort member's input to
        # the secure sum is the fast simulator's update of that device, drawn from the same
        # round generator on the same rand-k set, up to the fleet's fixed-point rounding.
        cohort, round_seed = fast[1]
        d = fleet.spec.num_params
        k = compress.kept_count(d, cfg.sparsity)
        coords = compress.coordinate_set(round_seed, d, k)
        fp = FixedPoint(scale=fleet.policy.fixed_point_scale(), bits=fleet.policy.bits)
        for name in cohort:
            i = fleet.names.index(name)
            x, y = fleet.shards[name]
            rng = seeded_round_rng(device_seed(seed, i))(1)
            res = local_round(fleet.engine, fleet.initial, x, y, cfg.local(), rng,
                              coords=coords)
            want = flatten_params(res.update).astype(np.float64)[coords]
            assert np.abs(want).max() < cfg.value_bound  # nothing clamped
            got = fleet.agents[name].session.encoded_input(1)
            assert got is not None and got.shape == (k,)
            assert np.abs(fp.decode(got, 1) - want).max() <= 1.0 / fp.scale
            # another round's generator would not do: the noise alone is ~lr z C / B
            other = seeded_round_rng(device_seed(seed, i))(2)
            res2 = local_round(fleet.engine, fleet.initial, x, y, cfg.local(), other,
                               coords=coords)
            assert np.abs(fp.decode(got, 1)
                          - flatten_params(res2.update).astype(np.float64)[coords]).max() > 1e-3
    finally:
        fleet.close()
