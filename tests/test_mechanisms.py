"""edge_sdk.mechanisms (plan15 G1): the Gaussian mechanism's device and server halves.

That DeviceSession and RoundMachine now run these halves with the randomness drawn in
the order of before (R8) is proven by tests/test_onepath_pins.py (the fleet pins hold);
here each half is checked on its own."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from edge_sdk import compress, secagg, wire
from edge_sdk.fixedpoint import FixedPoint
from edge_sdk.mechanisms import (
    MECHANISMS,
    Contribution,
    Gaussian,
    GaussianRound,
)
from edge_sdk.model import flatten_params, init_params
from edge_sdk.privacy.aggregate import aggregate_event
from edge_sdk.train import LocalTraining, TrainingDiverged, local_round, round_event

SCALE = 2.0**16


def _params(dim: int, *, sparsity: float = 1.0, quant_levels: int = 0,
            value_bound: float = 1.0, cohort: int = 5, lr: float = 0.5) -> GaussianRound:
    length = dim if sparsity == 1.0 else compress.kept_count(dim, sparsity)
    return GaussianRound(
        training=LocalTraining(steps=3, batch_size=16, lr=lr, clip=1.0, noise_multiplier=1.0,
                               sparsity=sparsity),
        quant_levels=quant_levels, value_bound=value_bound,
        fixed_point=FixedPoint(scale=SCALE, bits=32), dim=dim, length=length,
        cohort_size=cohort)


@pytest.fixture(scope="module")
def model(engine: Any) -> tuple[Any, Any, list[np.ndarray], int]:
    spec, eng = engine
    params = init_params(spec, np.random.default_rng(1))
    return spec, eng, params, sum(p.size for p in params)


def _shards(digits: Any, n: int, size: int = 60) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(digits.x_train[i * size:(i + 1) * size], digits.y_train[i * size:(i + 1) * size])
            for i in range(n)]


def test_registry() -> None:
    assert dict(MECHANISMS) == {"gaussian": Gaussian}
    assert Gaussian.name == "gaussian" and Gaussian.Params is wire.GaussianParams


def test_events_are_the_round_event_and_the_local_view_for_the_sum(model) -> None:
    _, _, _, d = model
    for sparsity in (1.0, 0.25):
        p = _params(d, sparsity=sparsity)
        local, agg = Gaussian().device(p).events(m=60, honest=4)
        assert local == round_event(60, p.training, p.length / d)
        # clamped and rounded before the sum: no credit for others' noise
        assert agg == aggregate_event(local, honest_members=4, linear_sum=False) == local


@pytest.mark.parametrize("sparsity", [1.0, 0.3])
def test_one_contribution_is_the_clamped_update_in_fixed_point(model, digits,
                                                               sparsity: float) -> None:
    _, eng, params, d = model
    p = _params(d, sparsity=sparsity, value_bound=0.02)
    coords = None if sparsity == 1.0 else compress.coordinate_set(bytes(32), d, p.length)
    x, y = _shards(digits, 1)[0]
    c = Gaussian().device(p).contribute(params=params, data=(x, y), engine=eng,
                                        coords=coords, honest=1,
                                        rng=np.random.default_rng(7))
    assert isinstance(c, Contribution)
    assert c.values.dtype == np.uint64 and c.values.shape == (p.length,)
    assert c.num_samples == len(y) and math.isfinite(c.mean_loss)
    assert (c.event, c.aggregate_event) == Gaussian().device(p).events(m=len(y), honest=1)
    # the rng draws the local round first: the same seed gives the same update
    ref = local_round(eng, params, x, y, p.training, np.random.default_rng(7), coords=coords)
    flat = flatten_params(ref.update).astype(np.float64)
    want = flat if coords is None else flat[coords]
    assert c.diagnostics["clamped"] == int(np.count_nonzero(np.abs(want) > 0.02)) > 0
    got = p.fixed_point.decode(c.values, 1)
    assert np.abs(got - np.clip(want, -0.02, 0.02)).max() <= 1 / SCALE
    # all randomness from rng: the same seed again is bit-identical, another is not
    again = Gaussian().device(p).contribute(params=params, data=(x, y), engine=eng,
                                            coords=coords, honest=1,
                                            rng=np.random.default_rng(7))
    assert np.array_equal(again.values, c.values)
    other = Gaussian().device(p).contribute(params=params, data=(x, y), engine=eng,
                                            coords=coords, honest=1,
                                            rng=np.random.default_rng(8))
    assert not np.array_equal(other.values, c.values)


@pytest.mark.parametrize("sparsity", [1.0, 0.3])
def test_server_decodes_the_sum_to_the_mean_delta(model, digits, sparsity: float) -> None:
    _, eng, params, d = model
    n = 4
    p = _params(d, sparsity=sparsity, quant_levels=16, cohort=n)
    coords = None if sparsity == 1.0 else compress.coordinate_set(b"\x01" * 32, d, p.length)
    half = Gaussian().device(p)
    contributions = [half.contribute(params=params, data=shard, engine=eng, coords=coords,
                                     honest=1, rng=np.random.default_rng(100 + i))
                     for i, shard in enumerate(_shards(digits, n))]
    total = sum(c.values for c in contributions) & np.uint64(2**32 - 1)
    server = Gaussian().server(p)
    layout = server.init(params)
    assert layout == tuple(p_.shape for p_ in params)
    delta, state = server.decode(total, n, layout, coords=coords)
    assert state == layout
    assert [a.shape for a in delta] == [a.shape for a in params]
    assert all(a.dtype == np.float32 for a in delta)
    dense = flatten_params(delta).astype(np.float64)
    mean = sum(p.fixed_point.decode(c.values, 1) for c in contributions) / n
    if coords is None:
        np.testing.assert_allclose(dense, mean, rtol=0, atol=1e-6)
    else:
        off = np.ones(d, dtype=bool)
        off[coords] = False
        assert not dense[off].any()  # nothing off the coordinate set
        np.testing.assert_allclose(dense[coords], mean, rtol=0, atol=1e-6)


def test_server_init_refuses_another_model(model) -> None:
    _, _, params, d = model
    with pytest.raises(ValueError, match=f"round's {d + 1} parameters"):
        Gaussian().server(_params(d + 1)).init(params)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_diverged_update_raises(model, digits) -> None:
    _, eng, params, d = model
    with pytest.raises(TrainingDiverged):
        Gaussian().device(_params(d, lr=1e300)).contribute(
            params=params, data=_shards(digits, 1)[0], engine=eng, coords=None, honest=1,
            rng=np.random.default_rng(0))


def test_params_from_a_plan_and_their_checks(model) -> None:
    _, _, _, d = model
    agg = secagg.AggregatorIdentity.generate()
    cohort = [f"d{i}" for i in range(5)]
    k = compress.kept_count(d, 0.5)
    cfg = secagg.RoundConfig.for_cohort(round_id=3, nonce=bytes(32), cohort=cohort, bits=32,
                                        length=k)
    params = wire.GaussianParams(steps=2, batch_size=8, lr=0.1, sampling="shuffle", clip=1.0,
                                 noise_multiplier=1.5, sparsity=0.5, quant_levels=4,
                                 scale=2.0**10, value_bound=1.0)
    plan = wire.sign(wire.RoundPlan(
        round_id=3, model_version=0, cohort=cfg.cohort, mechanism="gaussian", params=params,
        round_seed=bytes(32), bits=32, length=k, nonce=cfg.nonce, degree=cfg.degree,
        threshold=cfg.threshold,
        min_survivors=cfg.threshold, max_colluders=1, stage_timeout=10.0), agg)
    p = GaussianRound.from_plan(plan, dim=d)
    assert p.training == LocalTraining(steps=2, batch_size=8, lr=0.1, clip=1.0,
                                       noise_multiplier=1.5, sampling="shuffle", sparsity=0.5)
    assert (p.quant_levels, p.value_bound, p.length, p.dim, p.cohort_size) == (4, 1.0, k, d, 5)
    assert p.fixed_point == FixedPoint(scale=2.0**10, bits=32)
    with pytest.raises(ValueError, match=f"length {k}, but rand-k at p = 0.5 of {d + 7}"):
        GaussianRound.from_plan(plan, dim=d + 7)
    with pytest.raises(ValueError, match="lr"):
        GaussianRound.from_plan(
            dataclasses.replace(plan, params=dataclasses.replace(params, lr=-1.0)), dim=d)
    with pytest.raises(ValueError):  # value_bound x cohort does not fit 32 bits at 2^30
        GaussianRound.from_plan(
            dataclasses.replace(plan, params=dataclasses.replace(params, scale=2.0**30)), dim=d)
