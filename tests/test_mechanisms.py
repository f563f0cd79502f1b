"""edge_sdk.mechanisms (plan15 G1, G4, G5): the mechanisms' device and server halves.

That DeviceSession and RoundMachine now run these halves with the randomness drawn in
the order of before (R8) is proven by tests/test_onepath_pins.py (the fleet pins hold);
here each half is checked on its own."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from aggregator.plain_sum import PlainSum
from edge_sdk import compress, secagg, wire
from edge_sdk.ddp import choose_bits_bounded
from edge_sdk.fixedpoint import FixedPoint
from edge_sdk.hazmat.ring import Ring
from edge_sdk.mechanisms import (
    MECHANISMS,
    Binomial,
    Contribution,
    Ddg,
    DeviceDp,
    Gaussian,
    GaussianRound,
    UpdateNoise,
    ddg,
)
from edge_sdk.mechanisms import binomial as binomial_mech
from edge_sdk.mechanisms.binomial import BinomialRound, binomial_params
from edge_sdk.mechanisms.ddg import DdgRound
from edge_sdk.mechanisms.update_noise import (
    CLAMP_PROBABILITY,
    UpdateNoiseRound,
    fixed_point_for,
    normal_tail_quantile,
    update_noise_params,
    value_bound,
)
from edge_sdk.model import flatten_params, init_params
from edge_sdk.privacy import discrete_epsilon
from edge_sdk.privacy.aggregate import aggregate_event
from edge_sdk.train import (
    LocalTraining,
    TrainingDiverged,
    local_round,
    local_round_binomial,
    local_round_ddg,
    local_round_update_noise,
    round_event,
)

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
    assert dict(MECHANISMS) == {"gaussian": Gaussian, "update-noise": UpdateNoise, "ddg": Ddg,
                                "binomial": Binomial, "device-dp": DeviceDp}
    assert Gaussian.name == "gaussian" and Gaussian.Params is wire.GaussianParams
    # every registered mechanism's params can travel in a plan, and nothing else can
    assert set(wire.MECHANISM_PARAMS) == set(MECHANISMS)
    for name, mech in MECHANISMS.items():
        assert mech.name == name and mech.Params is wire.MECHANISM_PARAMS[name]


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


# ------------------------------------------------------------ update-noise and ddg (G4, G5)
#
# Each: contribute -> PlainSum (the fast path's sum, aggregator/plain_sum.py) -> decode,
# against what tools/simulate.py computed for the same inputs and seeds before the bodies
# moved (written out here as the simulator wrote it; since plan15 G3 the simulator runs
# these mechanisms, so this is the record of what moved).


def _sim_upload(values: np.ndarray, quant_levels: int, rng: np.random.Generator) -> np.ndarray:
    """What the pre-G3 simulator's aggregator decoded from one upload (its ``_upload``):
    QSGD values, or the float32 values."""
    if quant_levels:
        return compress.dequantize(compress.quantize(values, quant_levels, rng))
    return values.astype("<f4")


@dataclasses.dataclass(frozen=True)
class _SimDdgPlan:
    """The pre-G3 simulator's ddg parameters (its ``DdgPlan``): n = r shares."""

    gamma: float
    sigma: float
    l2_sensitivity: float
    l1_sensitivity: float
    dim: int
    devices: int

    def event(self, steps: int = 1, *, adjacency: str) -> Any:
        return ddg.sample_event(l2=self.l2_sensitivity, l1=self.l1_sensitivity,
                                sigma=self.sigma, devices=self.devices, dim=self.dim,
                                steps=steps, adjacency=adjacency)


def _sim_ddg_plan(sim: Any, d: int) -> _SimDdgPlan:
    """The pre-G3 simulator's ``ddg_plan(cfg, d)``."""
    k = d if sim.sparsity == 1.0 else compress.kept_count(d, sim.sparsity)
    r = sim.cohort_size
    l2, l1 = ddg.sensitivities(sim.clip, sim.gamma, k)
    return _SimDdgPlan(gamma=sim.gamma,
                       sigma=ddg.device_sigma(sim.noise_multiplier, sim.clip, sim.gamma, r),
                       l2_sensitivity=l2, l1_sensitivity=l1, dim=k, devices=r)


def _plain_sum(contributions: list[Contribution], *, bits: int, length: int) -> np.ndarray:
    names = [f"d{i}" for i in range(len(contributions))]
    cfg = secagg.RoundConfig.for_cohort(round_id=1, nonce=bytes(32), cohort=names, bits=bits,
                                        length=length)
    plain = PlainSum.for_config(cfg, vanished={})
    assert plain.survivors == tuple(names)
    for name, c in zip(names, contributions, strict=True):
        plain.add(name, c.values)
    return plain.total()


def _un_round(d: int, *, quant_levels: int, cohort: int) -> UpdateNoiseRound:
    w = update_noise_params(steps=3, batch_size=8, lr=0.5, clip=1.0, noise_multiplier=0.5,
                            update_clip=None, quant_levels=quant_levels, cohort_size=cohort,
                            bits=32)
    return UpdateNoiseRound(
        training=LocalTraining(steps=w.steps, batch_size=w.batch_size, lr=w.lr, clip=w.clip,
                               noise_multiplier=w.noise_multiplier),
        update_clip=w.update_clip, quant_levels=w.quant_levels, value_bound=w.value_bound,
        fixed_point=FixedPoint(scale=w.scale, bits=32), dim=d, cohort_size=cohort)


def test_update_noise_value_bound_is_stated_by_its_clamp_probability() -> None:
    c = normal_tail_quantile(CLAMP_PROBABILITY)
    assert math.erfc(c / math.sqrt(2)) <= 1e-9 < math.erfc((c - 1e-9) / math.sqrt(2))
    assert c == pytest.approx(6.1094, abs=1e-4)
    assert value_bound(2.0, 0.5) == 2.0 + c * 0.5 * 2.0
    assert value_bound(2.0, 0.0) == 2.0  # no noise: the clip radius
    for bad in (0.0, 1.0, math.nan):
        with pytest.raises(ValueError, match="probability"):
            normal_tail_quantile(bad)
    with pytest.raises(ValueError, match="update_clip"):
        value_bound(math.inf, 1.0)
    # the finest power-of-two scale that fits: twice it would wrap
    fp = fixed_point_for(value_bound(1.5, 1.0), 10, 32)
    assert fp.check_no_wrap(value_bound(1.5, 1.0), 10) <= 32
    with pytest.raises(ValueError, match="may wrap"):
        FixedPoint(scale=2 * fp.scale, bits=32).check_no_wrap(value_bound(1.5, 1.0), 10)


@pytest.mark.parametrize("quant_levels", [0, 16])
def test_update_noise_sum_decodes_to_the_simulators_mean(model, digits,
                                                         quant_levels: int) -> None:
    from tools.simconfig import SimConfig

    _, eng, params, d = model
    n = 4
    p = _un_round(d, quant_levels=quant_levels, cohort=n)
    shards = _shards(digits, n)
    half = UpdateNoise().device(p)
    contributions = [half.contribute(params=params, data=shard, engine=eng, coords=None,
                                     honest=n - 1, rng=np.random.default_rng(100 + i))
                     for i, shard in enumerate(shards)]
    total = _plain_sum(contributions, bits=32, length=d)
    server = UpdateNoise().server(p)
    delta, _ = server.decode(total, n, server.init(params), coords=None)
    # the simulator's round (tools/simulate.py, mechanism "update-noise", weighting uniform)
    sim = SimConfig(dataset="digits", model="logreg", devices=n, participation=1.0,
                    rounds=1, local_steps=3, batch_size=8, lr=0.5, clip=1.0,
                    noise_multiplier=0.5, mechanism="update-noise",
                    quant_levels=quant_levels, progress=False)
    acc = np.zeros(d)
    for i, (x, y) in enumerate(shards):
        rng = np.random.default_rng(100 + i)
        res = local_round_update_noise(eng, params, x, y, sim.local(), rng, update_clip=None)
        decoded = _sim_upload(flatten_params(res.update), sim.quant_levels, rng)
        acc += decoded
        c = contributions[i]
        # the events the simulator accounts; the sum gets no credit for others' noise
        assert c.event == res.event == c.aggregate_event
        assert c.event == UpdateNoise().device(p).events(m=len(y), honest=n - 1)[0]
        assert c.diagnostics == {"clamped": 0}  # R4: the bound does not bite
    mean = (acc / n).astype(np.float32)
    got = flatten_params(delta)
    # Not bit-identical: the simulator sends float32 (or QSGD) values, the mechanism rounds
    # them stochastically onto the fixed-point grid (its rng draws come after the
    # simulator's, so the values before encoding are the same). Each device's rounding moves
    # a value by < 1/scale, so the mean by < 1/scale; plus one float32 rounding of each side.
    ulp = float(np.spacing(np.float32(np.abs(mean).max())))
    assert np.abs(got.astype(np.float64) - mean).max() <= 1 / p.fixed_point.scale + 2 * ulp
    # in float64, before either float32 cast: the sum within n roundings of the simulator's
    assert np.abs(p.fixed_point.decode(total, n) - acc).max() <= n / p.fixed_point.scale


def test_update_noise_is_dense_and_refuses_a_wrapping_encoding(model, digits) -> None:
    _, eng, params, d = model
    p = _un_round(d, quant_levels=0, cohort=4)
    with pytest.raises(ValueError, match="dense"):
        UpdateNoise().device(p).contribute(params=params, data=_shards(digits, 1)[0],
                                           engine=eng, coords=np.arange(3), honest=1,
                                           rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="may wrap"):
        dataclasses.replace(p, fixed_point=FixedPoint(scale=2 * p.fixed_point.scale, bits=32))
    with pytest.raises(ValueError, match="sparsity"):
        dataclasses.replace(p, training=dataclasses.replace(p.training, sparsity=0.5))


def _ddg_setup(d: int, sparsity: float, n: int, sizes: list[int]):
    """The pre-G3 simulator's ddg parameters (its ddg_plan and bits) and the round."""
    from tools.simconfig import SimConfig

    sim = SimConfig(dataset="digits", model="logreg", devices=n, participation=1.0, rounds=1,
                    local_steps=1, batch_size=16, lr=5.0, clip=1.0, delta=1e-3,
                    noise_multiplier=2.0, mechanism="ddg", sparsity=sparsity, progress=False)
    plan = _sim_ddg_plan(sim, d)
    # as simulate() computed them before the bodies moved
    bits = choose_bits_bounded(n * max(sizes) * plan.l2_sensitivity, n, plan.dim, plan.sigma,
                               1e-9)
    assert bits == ddg.ring_bits(signal=ddg.max_abs_signal(n, max(sizes), plan.l2_sensitivity),
                                 cohort_size=n, length=plan.dim, sigma=plan.sigma)
    assert plan.sigma == ddg.device_sigma(2.0, 1.0, plan.gamma, n)
    rnd = DdgRound(clip=1.0, gamma=plan.gamma, sigma=plan.sigma, sparsity=sparsity, lr=5.0,
                   nominal_samples=float(np.mean(sizes)), bits=bits, dim=d, length=plan.dim,
                   cohort_size=n)
    assert (rnd.l2_sensitivity, rnd.l1_sensitivity) == (plan.l2_sensitivity,
                                                        plan.l1_sensitivity)
    return sim, plan, rnd


@pytest.mark.parametrize("sparsity", [1.0, 0.3])
def test_ddg_sum_decodes_bit_identically_to_the_simulator(model, digits,
                                                          sparsity: float) -> None:
    _, eng, params, d = model
    n = 4
    shards = [(x[: 40 + 5 * i], y[: 40 + 5 * i]) for i, (x, y) in enumerate(_shards(digits, n))]
    sizes = [len(y) for _, y in shards]
    sim, plan, p = _ddg_setup(d, sparsity, n, sizes)
    coords = None if sparsity == 1.0 else compress.coordinate_set(b"\x02" * 32, d, p.length)
    half = Ddg().device(p)
    contributions = [half.contribute(params=params, data=shard, engine=eng, coords=coords,
                                     honest=n, rng=np.random.default_rng(200 + i))
                     for i, shard in enumerate(shards)]
    total = _plain_sum(contributions, bits=p.bits, length=p.length)
    server = Ddg().server(p)
    delta, _ = server.decode(total, n, server.init(params), coords=coords)
    # the simulator's round, as tools/simulate.py wrote it
    residue_sum = np.zeros(p.length, dtype=np.uint64)
    for i, (x, y) in enumerate(shards):
        res = local_round_ddg(eng, params, x, y, np.random.default_rng(200 + i), clip=sim.clip,
                              gamma=plan.gamma, sigma=plan.sigma, bits=p.bits, coords=coords)
        residue_sum += res.residues
        c = contributions[i]
        assert np.array_equal(c.values, res.residues)
        assert c.diagnostics["max_abs_integer"] == int(np.abs(res.integers).max())
        # the event the simulator accounts (n = r shares, zero-out), and the upload alone
        assert c.aggregate_event == plan.event(adjacency="zero_out")
        assert c.event == dataclasses.replace(plan.event(adjacency="zero_out"), devices=1)
    summed = Ring(bits=p.bits).to_signed(residue_sum)
    scale = -sim.lr * (d / p.length) * plan.gamma / (n * float(np.mean(sizes)))
    mean_kept = (scale * summed.astype(np.float64)).astype(np.float32)
    dense = mean_kept if coords is None else np.zeros(d, dtype=np.float32)
    if coords is not None:
        dense[coords] = mean_kept
    got = flatten_params(delta)
    assert got.dtype == np.float32 and np.array_equal(got, dense)  # same integers, same ops
    assert np.abs(dense).max() > 0


def test_ddg_events_count_the_honest_shares_under_zero_out(model) -> None:
    _, _, _, d = model
    _, plan, p = _ddg_setup(d, 1.0, 6, [60])
    local, agg = Ddg().device(p).events(m=60, honest=6 - 1 - 1)  # min_survivors 5, 1 colluder
    assert agg.devices == 4 and local.devices == 1
    assert agg.adjacency == local.adjacency == "zero_out"
    assert (agg.l2_sensitivity, agg.sigma, agg.dim) == (plan.l2_sensitivity, plan.sigma, p.length)
    # fewer honest shares: a larger epsilon, never the cohort's smaller one (R3)
    eps = [discrete_epsilon(e, 1e-5) for e in (plan.event(adjacency="zero_out"), agg, local)]
    assert eps[0] < eps[1] < eps[2]


def test_ddg_refuses_coordinates_that_are_not_the_rounds(model, digits) -> None:
    _, eng, params, d = model
    _, _, p = _ddg_setup(d, 0.3, 4, [60])
    for coords in (None, np.arange(p.length - 1)):
        with pytest.raises(ValueError, match="coords"):
            Ddg().device(p).contribute(params=params, data=_shards(digits, 1)[0], engine=eng,
                                       coords=coords, honest=1, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="rand-k"):
        dataclasses.replace(p, length=p.length + 1)
    with pytest.raises(ValueError, match="bits"):
        dataclasses.replace(p, bits=63)


def _plan(mechanism: str, params: Any, *, bits: int, length: int) -> Any:
    agg = secagg.AggregatorIdentity.generate()
    cfg = secagg.RoundConfig.for_cohort(round_id=3, nonce=bytes(32),
                                        cohort=[f"d{i}" for i in range(5)], bits=bits,
                                        length=length)
    plan = wire.sign(wire.RoundPlan(
        round_id=3, model_version=0, cohort=cfg.cohort, mechanism=mechanism, params=params,
        round_seed=bytes(32), bits=bits, length=length, nonce=cfg.nonce, degree=cfg.degree,
        threshold=cfg.threshold, min_survivors=cfg.threshold, max_colluders=1,
        stage_timeout=10.0), agg)
    back = wire.decode(wire.encode(plan), wire.ALL_KINDS)
    assert back == plan and type(back.params) is type(params)  # the record round-trips
    return back


def test_update_noise_params_travel_in_a_plan(model) -> None:
    _, _, _, d = model
    w = update_noise_params(steps=2, batch_size=8, lr=0.1, clip=1.0, noise_multiplier=1.5,
                            update_clip=0.3, quant_levels=4, cohort_size=5, bits=32)
    plan = _plan("update-noise", w, bits=32, length=d)
    p = UpdateNoiseRound.from_plan(plan, dim=d)
    assert p.training == LocalTraining(steps=2, batch_size=8, lr=0.1, clip=1.0,
                                       noise_multiplier=1.5)
    assert (p.update_clip, p.quant_levels, p.value_bound, p.dim, p.cohort_size) == (
        0.3, 4, value_bound(0.3, 1.5), d, 5)
    assert p.fixed_point == FixedPoint(scale=w.scale, bits=32)
    with pytest.raises(ValueError, match="length"):
        UpdateNoiseRound.from_plan(plan, dim=d + 1)
    with pytest.raises(ValueError, match="update_clip"):  # checked as a receiver checks
        wire.encode(dataclasses.replace(plan, params=dataclasses.replace(w, update_clip=-1.0)))
    with pytest.raises(ValueError, match="must be a DdgParams"):  # another mechanism's record
        wire.encode(dataclasses.replace(plan, mechanism="ddg"))


def test_ddg_params_travel_in_a_plan(model) -> None:
    _, _, _, d = model
    k = compress.kept_count(d, 0.5)
    w = wire.DdgParams(clip=1.0, gamma=1 / 1024, sigma=300.5, sparsity=0.5, lr=5.0,
                       nominal_samples=59.5)
    plan = _plan("ddg", w, bits=40, length=k)
    p = DdgRound.from_plan(plan, dim=d)
    assert p == DdgRound(clip=1.0, gamma=1 / 1024, sigma=300.5, sparsity=0.5, lr=5.0,
                         nominal_samples=59.5, bits=40, dim=d, length=k, cohort_size=5)
    with pytest.raises(ValueError, match="rand-k"):
        DdgRound.from_plan(plan, dim=d + 7)
    with pytest.raises(ValueError, match="sigma"):  # checked as a receiver checks
        wire.encode(dataclasses.replace(plan, params=dataclasses.replace(w, sigma=-1.0)))
    with pytest.raises(ValueError, match="bits"):  # the ring's width, on the plan
        DdgRound.from_plan(dataclasses.replace(plan, bits=64), dim=d)


def test_ddg_decodes_the_survivors_after_a_dropout(model, digits) -> None:
    """A member that vanishes before uploading is not in PlainSum's total; the server
    divides by the survivors it is told (the simulator's formula with r = survivors)."""
    _, eng, params, d = model
    n = 4
    shards = _shards(digits, n)
    _, plan, p = _ddg_setup(d, 1.0, n, [len(y) for _, y in shards])
    contributions = [Ddg().device(p).contribute(params=params, data=shard, engine=eng,
                                                coords=None, honest=n - 1,
                                                rng=np.random.default_rng(300 + i))
                     for i, shard in enumerate(shards)]
    names = [f"d{i}" for i in range(n)]
    cfg = secagg.RoundConfig.for_cohort(round_id=1, nonce=bytes(32), cohort=names, bits=p.bits,
                                        length=p.length)
    plain = PlainSum.for_config(cfg, vanished={"d2": "masked"})
    assert plain.survivors == ("d0", "d1", "d3")
    for name in plain.survivors:
        plain.add(name, contributions[names.index(name)].values)
    server = Ddg().server(p)
    delta, _ = server.decode(plain.total(), 3, server.init(params), coords=None)
    residue_sum = sum(contributions[i].values for i in (0, 1, 3))
    summed = Ring(bits=p.bits).to_signed(residue_sum)
    want = ((-p.lr * plan.gamma / (3 * p.nominal_samples)) * summed.astype(np.float64))
    assert np.array_equal(flatten_params(delta), want.astype(np.float32))
    with pytest.raises(ValueError, match="survivors"):
        server.decode(plain.total(), 0, server.init(params), coords=None)


def test_ddg_public_calibrates_sigma_on_the_honest_shares(model) -> None:
    _, _, _, d = model
    sizes = [60, 70, 50, 60]
    for sparsity in (1.0, 0.3):
        _, plan, p = _ddg_setup(d, sparsity, 4, sizes)
        kw = dict(noise_multiplier=2.0, clip=1.0, gamma=plan.gamma, sparsity=sparsity, lr=5.0,
                  dim=d, cohort_size=4, nominal_samples=60.0, max_local_samples=70)
        w, bits, length = ddg.ddg_public(honest=4, **kw)  # the simulator's n = r
        assert (w.sigma, bits, length) == (plan.sigma, p.bits, plan.dim)
        assert w == wire.DdgParams(clip=1.0, gamma=plan.gamma, sigma=plan.sigma,
                                   sparsity=sparsity, lr=5.0, nominal_samples=60.0)
        # R3: 1 colluder, min_survivors 3: each share is larger, so 2 of them carry z C/gamma
        w2, bits2, _ = ddg.ddg_public(honest=2, **kw)
        assert w2.sigma == pytest.approx(2.0 * 1024 / math.sqrt(2)) and bits2 >= bits
    with pytest.raises(ValueError, match="honest"):
        ddg.ddg_public(honest=5, **kw)


# ----------------------------------------------------------------------------- binomial

# small N for fast tests (the event's moment costs Dinf x N per order); Dinf = 2 levels + 1
BINOM = dict(steps=3, batch_size=8, lr=0.5, clip=1.0, update_clip=None, trials=256, levels=15)


def _binom_round(d: int, cohort: int, **kw: Any) -> BinomialRound:
    w, bits = binomial_params(**{**BINOM, **kw}, cohort_size=cohort)
    return BinomialRound(
        training=LocalTraining(steps=w.steps, batch_size=w.batch_size, lr=w.lr, clip=w.clip,
                               noise_multiplier=0.0),
        update_clip=w.update_clip, trials=w.trials, levels=w.levels, bits=bits, dim=d,
        cohort_size=cohort)


def test_binomial_ring_bits_are_exact_and_cannot_wrap() -> None:
    # ceil(log2(2 r (levels + N/2) + 1)), e.g. the experiments' defaults at r = 8: 16 bits
    assert binomial_mech.ring_bits(cohort_size=8, levels=127, trials=4096) == 16
    for r, lv, n in ((1, 1, 2), (3, 15, 256), (8, 127, 4096), (10, 255, 16384), (5, 1, 6)):
        bits = binomial_mech.ring_bits(cohort_size=r, levels=lv, trials=n)
        bound = r * (lv + n // 2)
        assert 2 ** bits >= 2 * bound + 1 and (bits == 2 or 2 ** (bits - 1) < 2 * bound + 1)
        assert bits == max(2, math.ceil(math.log2(2 * bound + 1)))
        # the extreme sums, all members at +bound or all at -bound, read back exactly
        one = lv + n // 2
        for sign in (1, -1):
            res, clamped = binomial_mech.encode(np.full(3, sign * one), levels=lv, trials=n,
                                                bits=bits)
            assert clamped == 0
            total = (res * np.uint64(r)) & np.uint64((1 << bits) - 1)
            assert np.array_equal(Ring(bits=bits).to_signed(total), np.full(3, sign * bound))
    # beyond the bound (a float hair above S): clamped, counted; post-processing only
    res, clamped = binomial_mech.encode(np.array([17 + 128, -(17 + 128), 3]), levels=15,
                                        trials=256, bits=12)
    assert clamped == 2
    assert list(Ring(bits=12).to_signed(res)) == [143, -143, 3]
    with pytest.raises(ValueError, match="more than 62"):
        binomial_mech.ring_bits(cohort_size=1 << 45, levels=1 << 20, trials=1 << 20)


def test_binomial_sum_decodes_to_the_simulators_mean(model, digits) -> None:
    from tools.simconfig import SimConfig

    _, eng, params, d = model
    n = 4
    p = _binom_round(d, n)
    shards = _shards(digits, n)
    half = Binomial().device(p)
    contributions = [half.contribute(params=params, data=shard, engine=eng, coords=None,
                                     honest=n - 1, rng=np.random.default_rng(200 + i))
                     for i, shard in enumerate(shards)]
    total = _plain_sum(contributions, bits=p.bits, length=d)
    server = Binomial().server(p)
    delta, _ = server.decode(total, n, server.init(params), coords=None)
    # the simulator's round (tools/simulate.py, mechanism "binomial", weighting uniform):
    # local_round_binomial, then the integers times the grid summed in float64, / n
    sim = SimConfig(dataset="digits", model="logreg", devices=n, participation=1.0,
                    rounds=1, local_steps=3, batch_size=8, lr=0.5, clip=1.0,
                    mechanism="binomial", binomial_trials=256, quant_levels=15,
                    progress=False)
    acc = np.zeros(d)
    ints = np.zeros(d, dtype=np.int64)
    for i, (x, y) in enumerate(shards):
        res = local_round_binomial(eng, params, x, y, sim.local(), np.random.default_rng(200 + i),
                                   trials=256, levels=15, update_clip=None)
        assert res.grid == p.grid == 3 * 0.5 * 1.0 / 15
        acc += res.integers * res.grid
        ints += res.integers
        c = contributions[i]
        assert c.diagnostics == {"clamped": 0}
        assert np.array_equal(Ring(bits=p.bits).to_signed(c.values), res.integers)
        # the events are the simulator's accounting: its restricted moment and delta0
        rho, delta0 = res.event.restricted_rdp()
        assert c.event == c.aggregate_event
        assert c.event.rho == tuple(float(v) for v in rho) and c.event.delta0 == delta0
        assert c.event.adjacency == "substitution" and c.event.steps == 1
        assert (c.event, c.aggregate_event) == half.events(m=len(y), honest=n - 1)
    # the ring sum is the integers' sum exactly (no wrap), and the mean the simulator's up
    # to float rounding: (sum ints) g / n against sum (ints g) / n, then one float32 cast
    assert np.array_equal(Ring(bits=p.bits).to_signed(total), ints)
    mean = acc / n
    got = flatten_params(delta).astype(np.float64)
    assert np.abs(got - mean).max() <= float(np.spacing(np.float32(np.abs(mean).max())))
    assert np.abs(ints * p.grid / n - mean).max() <= 1e-12 * np.abs(mean).max()
    # all randomness from rng: the same seed again is bit-identical
    again = half.contribute(params=params, data=shards[0], engine=eng, coords=None,
                            honest=n - 1, rng=np.random.default_rng(200))
    assert np.array_equal(again.values, contributions[0].values)


def test_binomial_decodes_the_survivors_after_a_dropout(model, digits) -> None:
    _, eng, params, d = model
    n = 4
    p = _binom_round(d, n)
    contributions = [Binomial().device(p).contribute(
        params=params, data=shard, engine=eng, coords=None, honest=n - 1,
        rng=np.random.default_rng(400 + i)) for i, shard in enumerate(_shards(digits, n))]
    names = [f"d{i}" for i in range(n)]
    cfg = secagg.RoundConfig.for_cohort(round_id=1, nonce=bytes(32), cohort=names, bits=p.bits,
                                        length=d)
    plain = PlainSum.for_config(cfg, vanished={"d1": "masked"})
    for name in plain.survivors:
        plain.add(name, contributions[names.index(name)].values)
    server = Binomial().server(p)
    delta, _ = server.decode(plain.total(), 3, server.init(params), coords=None)
    ints = sum(Ring(bits=p.bits).to_signed(contributions[i].values) for i in (0, 2, 3))
    want = (ints.astype(np.float64) * p.grid / 3).astype(np.float32)
    assert np.array_equal(flatten_params(delta), want)
    with pytest.raises(ValueError, match="survivors"):
        server.decode(plain.total(), 0, server.init(params), coords=None)
    with pytest.raises(ValueError, match="dense"):
        server.decode(plain.total(), 3, server.init(params), coords=np.arange(3))
    with pytest.raises(ValueError, match="dense"):
        Binomial().device(p).contribute(params=params, data=_shards(digits, 1)[0], engine=eng,
                                        coords=np.arange(3), honest=1,
                                        rng=np.random.default_rng(0))


def test_binomial_params_travel_in_a_plan_and_are_checked(model) -> None:
    _, _, _, d = model
    w, bits = binomial_params(**{**BINOM, "update_clip": 0.4}, cohort_size=5)
    assert w == wire.BinomialParams(steps=3, batch_size=8, lr=0.5, clip=1.0, update_clip=0.4,
                                    trials=256, levels=15)
    assert bits == binomial_mech.ring_bits(cohort_size=5, levels=15, trials=256)
    plan = _plan("binomial", w, bits=bits, length=d)
    p = BinomialRound.from_plan(plan, dim=d)
    assert (p.update_clip, p.trials, p.levels, p.bits, p.dim, p.cohort_size) == (
        0.4, 256, 15, bits, d, 5)
    assert p.training == LocalTraining(steps=3, batch_size=8, lr=0.5, clip=1.0,
                                       noise_multiplier=0.0)
    # S defaults to E lr C
    assert binomial_params(**BINOM, cohort_size=5)[0].update_clip == 3 * 0.5 * 1.0
    with pytest.raises(ValueError, match="length"):
        BinomialRound.from_plan(plan, dim=d + 1)
    # a plan whose ring is too narrow for the cohort's sum, or that names odd trials, or a
    # grid so fine that the neighbours' supports can be disjoint: the device refuses it
    with pytest.raises(ValueError, match="needs"):
        BinomialRound.from_plan(dataclasses.replace(plan, bits=bits - 1), dim=d)
    for bad, match in (({"trials": 255}, "even"), ({"levels": 128}, "2 levels \\+ 1 < trials")):
        with pytest.raises(ValueError, match=match):
            BinomialRound.from_plan(dataclasses.replace(
                plan, params=dataclasses.replace(w, **bad)), dim=d)
    with pytest.raises(ValueError, match="exceeds"):  # a plan cannot make a device compute
        BinomialRound.from_plan(dataclasses.replace(   # the event for hours
            plan, params=dataclasses.replace(w, trials=1 << 20, levels=64)), dim=d)
    with pytest.raises(ValueError, match="trials"):  # checked as a receiver checks
        wire.encode(dataclasses.replace(plan, params=dataclasses.replace(w, trials=1)))
    with pytest.raises(ValueError, match="must be a BinomialParams"):
        wire.encode(dataclasses.replace(plan, params=wire.DdgParams(
            clip=1.0, gamma=0.01, sigma=1.0, sparsity=1.0, lr=1.0, nominal_samples=1.0)))


def test_binomial_policy_settings() -> None:
    from aggregator.round_core import RoundPolicy, mechanism_params

    pol = RoundPolicy(fleet="f", cohort_size=5, mechanism="binomial", steps=3, batch_size=8,
                      lr=0.5, trials=256, levels=15, update_clip=0.4)
    w, length, bits = mechanism_params(pol, dim=650, cohort_size=5)
    assert (w, bits) == binomial_params(**{**BINOM, "update_clip": 0.4}, cohort_size=5)
    assert length == 650
    with pytest.raises(ValueError, match="needs trials"):
        RoundPolicy(fleet="f", cohort_size=5, mechanism="binomial", levels=15)
    with pytest.raises(ValueError, match="needs levels"):
        RoundPolicy(fleet="f", cohort_size=5, mechanism="binomial", trials=256)
    with pytest.raises(ValueError, match="trials is a setting of mechanism 'binomial'"):
        RoundPolicy(fleet="f", cohort_size=5, mechanism="gaussian", trials=256)
    with pytest.raises(ValueError, match="dense"):
        RoundPolicy(fleet="f", cohort_size=5, mechanism="binomial", trials=256, levels=15,
                    sparsity=0.5)
    with pytest.raises(ValueError, match="2 levels"):
        RoundPolicy(fleet="f", cohort_size=5, mechanism="binomial", trials=16, levels=8)
    # update_clip is update-noise's and binomial's
    RoundPolicy(fleet="f", cohort_size=5, mechanism="update-noise", update_clip=0.4)
    with pytest.raises(ValueError, match="update_clip is a setting of mechanism"):
        RoundPolicy(fleet="f", cohort_size=5, mechanism="ddg", update_clip=0.4, gamma=0.01,
                    max_local_samples=10, nominal_samples=5.0)
