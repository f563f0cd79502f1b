"""aggregator.round_core (plan15 G2): the aggregator's round without messages.

Pure parts on their own (the cohort draw, the plan and its only two draws from the round
source, the policy's mechanism), then the proof that the round core is the round machine's:
over the uploads of a real fleet (20 DeviceSessions and the RoundMachine on the in-memory
broker, with dropouts at every stage), ``PlainSum`` (the survivors decided from the same
vanish stages) plus ``round_core.finish`` gives the machine's survivors, sums and new
model, bit for bit, round after round (a stateful server optimizer carries over)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from test_session_rounds import Fleet, _down_kind

from aggregator.optimizers import OPTIMIZERS
from aggregator.plain_sum import PlainSum
from aggregator.round_core import (
    RoundPolicy,
    check_plannable,
    draw_cohort,
    draw_plan,
    eligible_devices,
    finish,
    mechanism_params,
    mechanisms,
    round_secrets,
    select_cohort,
    server_half,
    too_few_eligible,
    with_update_clip,
)
from aggregator.rounds import RoundMachine, SnapshotError
from aggregator.rounds import RoundPolicy as ReExported
from edge_sdk import compress, secagg, wire
from edge_sdk.mechanisms import MECHANISMS, ddg, update_noise

NAMES = [f"d{i:02d}" for i in range(20)]


def _policy(**kw: Any) -> RoundPolicy:
    return RoundPolicy(**{"fleet": "lab", "cohort_size": 7, "seed": 11, **kw})


class _Source:
    """A seeded byte source that records each draw's size."""

    def __init__(self) -> None:
        self.draws: list[int] = []

    def __call__(self, n: int) -> bytes:
        self.draws.append(n)
        return hashlib.sha256(str(len(self.draws)).encode()).digest()[:n]


def test_the_policy_names_its_mechanism_and_refuses_one_it_does_not_have() -> None:
    assert ReExported is RoundPolicy
    assert _policy().mechanism == "gaussian"
    assert mechanisms() == ("binomial", "ddg", "device-dp", "gaussian", "update-noise")
    assert set(mechanisms()) <= set(MECHANISMS)
    with pytest.raises(ValueError, match=r"mechanism must be one of "
                       r"\['binomial', 'ddg', 'device-dp', 'gaussian', 'update-noise'\]"
                       r".*'ddg-x'"):
        _policy(mechanism="ddg-x")


def test_draw_cohort_is_select_cohort_of_the_policy() -> None:
    pol = _policy()
    for r in (1, 2, 9):
        assert draw_cohort(NAMES, policy=pol, round_id=r) == select_cohort(
            NAMES, 7, seed=11, round_id=r)
    assert draw_cohort(NAMES[:4], policy=pol, round_id=1) == tuple(NAMES[:4])  # fewer


def test_draw_plan_states_the_policy_and_draws_seed_then_nonce() -> None:
    pol = _policy(sparsity=0.25, bits=40, quant_levels=3, max_colluders=2, stage_timeout=7.0,
                  degree=4, threshold=3, min_survivors=4)
    d = 1000
    cohort = draw_cohort(NAMES, policy=pol, round_id=4)
    src = _Source()
    plan = draw_plan(pol, round_id=4, model_version=2, cohort=cohort, dim=d, random_bytes=src)
    assert src.draws == [32, 32]  # the round's only draws: round_seed, then nonce
    again = _Source()
    assert (plan.round_seed, plan.nonce) == round_secrets(again) and again.draws == [32, 32]
    k = compress.kept_count(d, 0.25)
    params, length, bits = mechanism_params(pol, dim=d)
    assert length == plan.length == k and bits == plan.bits == 40
    assert plan.params == params == wire.GaussianParams(
        steps=pol.steps, batch_size=pol.batch_size, lr=pol.lr, sampling=pol.sampling,
        clip=pol.clip, noise_multiplier=pol.noise_multiplier, sparsity=0.25, quant_levels=3,
        scale=pol.fixed_point_scale(), value_bound=pol.value_bound)
    assert (plan.round_id, plan.model_version, plan.cohort, plan.mechanism) == (
        4, 2, cohort, "gaussian")
    assert (plan.bits, plan.degree, plan.threshold, plan.min_survivors, plan.max_colluders,
            plan.stage_timeout) == (40, 4, 3, 4, 2, 7.0)
    # what a device reads from it: the secagg config and the mechanism's settings
    secagg.RoundConfig.of_plan(wire.sign(plan, secagg.AggregatorIdentity.generate()))
    assert server_half(plan, dim=d).params.length == k
    dense = draw_plan(_policy(), round_id=1, model_version=0, cohort=cohort, dim=d,
                      random_bytes=_Source())
    assert dense.length == d and dense.params.sparsity == 1.0


def test_finish_decodes_then_applies_the_optimizer() -> None:
    pol = _policy(sparsity=0.5, server_opt="fedavgm")
    shapes = [(3, 4), (4,)]
    model = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones(4, np.float32)]
    d = 16
    plan = draw_plan(pol, round_id=1, model_version=0, cohort=tuple(NAMES[:7]), dim=d,
                     random_bytes=_Source())
    server = server_half(plan, dim=d)
    fp = server.params.fixed_point
    rng = np.random.default_rng(0)
    ups = [rng.uniform(-1, 1, plan.length) for _ in range(3)]
    total = sum(fp.encode(u, rng).astype(np.uint64) for u in ups) & np.uint64(2**32 - 1)
    opt = OPTIMIZERS["fedavgm"](server_lr=1.0)
    state = opt.init(model)
    done = finish(plan, total, 3, params=model, server=server, optimizer=opt, opt_state=state)
    coords = compress.coordinate_set(plan.round_seed, d, plan.length)
    want_delta, _ = server.decode(total, 3, server.init(model), coords=coords)
    want, want_state = opt.update(want_delta, state, model)
    assert [p.shape for p in done.params] == shapes and all(
        p.dtype == np.float32 for p in done.params)
    for a, b in zip(done.params, want, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(done.delta, want_delta, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(done.opt_state, want_state, strict=True):
        np.testing.assert_array_equal(a, b)
    # off the coordinate set the delta is zero; on it, close to the mean upload
    flat = np.concatenate([x.ravel() for x in done.delta])
    assert not flat[np.setdiff1d(np.arange(d), coords)].any()
    np.testing.assert_allclose(flat[coords], np.mean(ups, axis=0), atol=1e-3)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="survivors must be an integer >= 1"):
            finish(plan, total, bad, params=model, server=server, optimizer=opt,
                   opt_state=state)


# the downlink at which a device vanishes -> PlainSum's vanish stage
AS_PLAIN = {"plan": "keys", "neighbour_keys": "shares", "forwarded_shares": "masked",
            "unmask_request": "unmask"}


def test_plain_sum_and_finish_give_the_round_machines_model(tmp_path, digits, engine) -> None:
    rounds = 4
    fleet = Fleet(tmp_path, digits, engine, rounds=rounds,
                  policy={"server_opt": "fedavgm", "sparsity": 0.5})
    rng = np.random.default_rng(5)
    plans: dict[int, wire.RoundPlan] = {}
    vanished: dict[int, dict[str, str]] = {}
    gone: dict[str, str] = {}

    def drop(name: str, topic: str, payload: bytes) -> bool:
        kind = _down_kind(topic, payload)
        if kind == "plan":
            plan = wire.decode(payload, wire.DOWN_KINDS)
            if plan.round_id not in plans:  # this round's victims, at every stage
                plans[plan.round_id] = plan
                gone.clear()
                for dev, stage in zip(rng.choice(plan.cohort, 3, replace=False),
                                      rng.permutation(list(AS_PLAIN))[:3], strict=True):
                    gone[str(dev)] = str(stage)
                vanished[plan.round_id] = {d: AS_PLAIN[s] for d, s in gone.items()}
        if name in gone and kind == gone[name]:
            fleet.broker.detach(name)
            return True
        return False

    fleet.broker.drop = drop
    for r in range(1, rounds + 1):
        fleet.settle(until=lambda r=r: len(fleet.machine.history) >= r
                     and fleet.machine.stage == "idle")
        for dev in list(gone):
            if dev not in fleet.broker.endpoints:
                fleet.broker.attach(dev, fleet.sessions[dev], fleet.now)
        fleet.broker.run(fleet.now)
    hist = fleet.machine.history
    assert [o.round_id for o in hist] == list(range(1, rounds + 1))
    assert sum(o.completed for o in hist) >= 2, [o.detail for o in hist]

    opt = OPTIMIZERS["fedavgm"](server_lr=1.0)
    params = [p.copy() for p in fleet.initial]
    state = opt.init(params)
    d = sum(p.size for p in params)
    for o in hist:
        plan = plans[o.round_id]
        ps = PlainSum.for_config(secagg.RoundConfig.of_plan(plan),
                                 vanished=vanished[o.round_id])
        if not o.completed:
            assert ps.failed is not None or len(ps.survivors) < plan.min_survivors, o
            continue
        assert ps.failed is None and ps.survivors == o.survivors
        for dev in ps.survivors:
            ps.add(dev, fleet.sessions[dev].encoded_input(o.round_id))
        total = ps.total()
        np.testing.assert_array_equal(total, o.total)
        done = finish(plan, total, len(ps.survivors), params=params,
                      server=server_half(plan, dim=d), optimizer=opt, opt_state=state)
        params, state = done.params, done.opt_state
    for a, b in zip(params, fleet.machine.params, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)  # bit for bit
    assert any(not np.array_equal(a, b) for a, b in zip(params, fleet.initial, strict=True))
    fleet.close()


def test_eligible_devices_have_budget_left_and_more_than_at_a_budget_decline() -> None:
    remaining = {"b": 0.5, "a": math.inf, "c": 0.0, "d": 2.0, "e": 1.0}
    assert eligible_devices(remaining) == ["a", "b", "d", "e"]  # sorted, none spent out
    # "b" and "d" declined for budget with 0.5 and 1.5 left: "b" still has 0.5 (out),
    # "d"'s budget was raised since (in)
    assert eligible_devices(remaining, short={"b": 0.5, "d": 1.5}) == ["a", "d", "e"]
    assert eligible_devices({}) == []


def test_too_few_eligible_is_below_the_min_cohort() -> None:
    pol = RoundPolicy(fleet="f", cohort_size=10, min_cohort=8, min_survivors=6)
    assert too_few_eligible(8, policy=pol) is None
    assert too_few_eligible(7, policy=pol) == ("devices with budget for a round: 7, fewer "
                                               "than the min cohort 8; no round can start")
    full = RoundPolicy(fleet="f", cohort_size=6)  # min_cohort: the cohort size
    assert too_few_eligible(6, policy=full) is None
    assert too_few_eligible(5, policy=full) is not None


def test_policy_snapshot_from_before_the_mechanism_field_restores(tmp_path, digits,
                                                                    engine) -> None:
    """A checkpoint whose policy predates ``mechanism`` ran gaussian, the only one there was:
    it restores under a gaussian policy. So does one from before the update-noise and ddg
    settings (they had their defaults), but not under a policy that changed one."""
    fleet = Fleet(tmp_path, digits, engine, rounds=0)
    snap = msgpack.unpackb(fleet.machine.snapshot(), raw=False)
    for key in ("mechanism", *NEW_SETTINGS):
        del snap["policy"][key]
    old = msgpack.packb(snap, use_bin_type=True)
    changed = dataclasses.replace(fleet.policy, clamp_probability=1e-6)
    with pytest.raises(SnapshotError, match="another policy"):
        RoundMachine.restore(old, policy=changed, identity=fleet.agg_id,
                             registry=fleet.registry)
    m = RoundMachine.restore(old, policy=fleet.policy, identity=fleet.agg_id,
                             registry=fleet.registry)
    assert m.model_version == 0
    assert dataclasses.asdict(m.policy)["mechanism"] == "gaussian"
    fleet.close()


# ----------------------------------------------------------------- update-noise and ddg

NEW_SETTINGS = ("update_clip", "clamp_probability", "gamma", "wrap_probability",
                "max_local_samples", "nominal_samples")
DDG = {"mechanism": "ddg", "gamma": 1 / 1024, "max_local_samples": 300,
       "nominal_samples": 180.0, "steps": 1}


@pytest.mark.parametrize("bad, match", [
    ({"mechanism": "update-noise", "sparsity": 0.5},
     "mechanism 'update-noise' is dense: sparsity must be 1, got 0.5"),
    ({"mechanism": "update-noise", "update_clip": 0.0},
     "update_clip must be None or finite and > 0, got 0.0"),
    ({"mechanism": "update-noise", "update_clip": math.inf},
     "update_clip must be None or finite and > 0, got inf"),
    ({"mechanism": "update-noise", "clamp_probability": 1.0},
     r"clamp_probability must be in \(0, 1\), got 1.0"),
    ({"update_clip": 1.0}, "update_clip is a setting of mechanism 'update-noise' and "
                           "'binomial' and 'device-dp', but mechanism is 'gaussian'"),
    ({**DDG, "gamma": None}, "mechanism 'ddg' needs gamma"),
    ({**DDG, "max_local_samples": None}, "mechanism 'ddg' needs max_local_samples"),
    ({**DDG, "nominal_samples": None}, "mechanism 'ddg' needs nominal_samples"),
    ({**DDG, "max_local_samples": 0}, "max_local_samples must be None or an integer >= 1, "
                                      "got 0"),
    ({**DDG, "max_local_samples": 2.5}, "max_local_samples must be None or an integer"),
    ({**DDG, "nominal_samples": 301.0}, r"nominal_samples .* must be <= "
                                        r"max_local_samples=300, got 301.0"),
    ({**DDG, "gamma": -1.0}, "gamma must be None or finite and > 0, got -1.0"),
    ({**DDG, "wrap_probability": 0.0}, r"wrap_probability must be in \(0, 1\), got 0.0"),
    ({**DDG, "quant_levels": 3}, "mechanism 'ddg' uploads integers, not QSGD: quant_levels "
                                 "must be 0, got 3"),
    ({**DDG, "mechanism": "update-noise"},
     "gamma is a setting of mechanism 'ddg' and 'device-dp'"),
    ({**DDG, "mechanism": "update-noise", "gamma": None},
     "max_local_samples is a setting of mechanism 'ddg'"),
    ({"mechanism": "device-dp", "gamma": 0.001}, "mechanism 'device-dp' needs update_clip"),
    ({"mechanism": "device-dp", "update_clip": 1.0}, "mechanism 'device-dp' needs gamma"),
    ({"mechanism": "device-dp", "update_clip": 1.0, "gamma": 1e-10},
     r"update_clip / gamma must be <= 2\^30"),
    ({"mechanism": "device-dp", "update_clip": 1.0, "gamma": 0.001, "quant_levels": 4},
     "mechanism 'device-dp' uploads integers, not QSGD"),
    ({"mechanism": "device-dp", "update_clip": 1.0, "gamma": 0.001,
      "local_noise_multiplier": -1.0}, "local_noise_multiplier must be finite and >= 0"),
    ({"local_noise_multiplier": 0.5}, "local_noise_multiplier is a setting of mechanism "
                                      "'device-dp'"),
])
def test_update_noise_and_ddg_settings_are_checked_by_name(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _policy(**bad)


def test_update_noise_plan_is_update_noise_params_of_the_policy() -> None:
    pol = _policy(mechanism="update-noise", steps=4, lr=0.25, clip=2.0, noise_multiplier=1.5,
                  quant_levels=5, clamp_probability=1e-6, bits=40)
    d = 500
    cohort = tuple(NAMES[:6])  # fewer than cohort_size: the plan is for these six
    plan = draw_plan(pol, round_id=1, model_version=0, cohort=cohort, dim=d,
                     random_bytes=_Source())
    want = update_noise.update_noise_params(
        steps=4, batch_size=pol.batch_size, lr=0.25, clip=2.0, noise_multiplier=1.5,
        update_clip=None, quant_levels=5, cohort_size=6, bits=40, clamp_probability=1e-6)
    assert plan.params == want and (plan.mechanism, plan.length, plan.bits) == (
        "update-noise", d, 40)
    assert want.update_clip == 4 * 0.25 * 2.0  # S = E lr C by default
    assert want.value_bound == update_noise.value_bound(2.0, 1.5, 1e-6)
    explicit = draw_plan(dataclasses.replace(pol, update_clip=0.7), round_id=1,
                         model_version=0, cohort=cohort, dim=d, random_bytes=_Source())
    assert explicit.params.update_clip == 0.7
    half = server_half(plan, dim=d)  # the plan reads back on the server (and devices)
    assert (half.params.update_clip, half.params.cohort_size) == (2.0, 6)


def test_ddg_plan_is_ddg_public_on_the_honest_members() -> None:
    pol = _policy(**DDG, sparsity=0.5, max_colluders=2, min_survivors=5, lr=3.0,
                  noise_multiplier=0.8, clip=0.5, wrap_probability=1e-6)
    d = 2000
    for n in (7, 6):  # a full and a smaller cohort: honest = min_survivors - max_colluders
        cohort = tuple(NAMES[:n])
        plan = draw_plan(pol, round_id=2, model_version=1, cohort=cohort, dim=d,
                         random_bytes=_Source())
        params, bits, length = ddg.ddg_public(
            noise_multiplier=0.8, clip=0.5, gamma=1 / 1024, sparsity=0.5, lr=3.0, dim=d,
            cohort_size=n, honest=5 - 2, nominal_samples=180.0, max_local_samples=300,
            wrap_probability=1e-6)
        assert (plan.params, plan.bits, plan.length) == (params, bits, length)
        assert plan.params.sigma == pytest.approx(0.8 * 0.5 * 1024 / math.sqrt(3), rel=1e-12)
        assert plan.bits != pol.bits and plan.length == compress.kept_count(d, 0.5)
        assert (plan.min_survivors, plan.max_colluders) == (5, 2)
        assert mechanism_params(pol, dim=d, cohort_size=n) == (params, length, bits)
        assert server_half(plan, dim=d).params.sigma == params.sigma


def test_a_policy_the_model_cannot_be_planned_for_is_refused_before_any_round() -> None:
    # a ring of more than 62 bits: 2^30 integer steps per clip, a million samples each
    pol = _policy(**{**DDG, "gamma": 2.0**-30, "max_local_samples": 10**9,
                     "nominal_samples": 1.0})
    with pytest.raises(ValueError, match="62"):
        check_plannable(pol, dim=100)
    check_plannable(_policy(**DDG), dim=100)
    identity = secagg.AggregatorIdentity.generate()
    registry = secagg.Registry.of(identity, [])
    with pytest.raises(ValueError, match="62"):
        RoundMachine(policy=pol, identity=identity, registry=registry,
                     params=[np.zeros(100, np.float32)])


def test_adaptive_clip_state_survives_a_snapshot(tmp_path, digits, engine) -> None:
    """device-dp's S under adaptive clipping is the round machine's state: a snapshot
    carries it, a restore resumes from it (the next plan states it), and a snapshot from
    before the field restores at the policy's S; a bad stored S is refused."""
    dp = {"mechanism": "device-dp", "update_clip": 1.0, "gamma": 1.0 / 1024,
          "adaptive_clip_quantile": 0.5, "steps": 2}
    fleet = Fleet(tmp_path, digits, engine, rounds=0, policy=dp)
    fleet.machine._update_clip = 0.625  # as if the rounds had moved it
    snap = fleet.machine.snapshot()
    m = RoundMachine.restore(snap, policy=fleet.policy, identity=fleet.agg_id,
                             registry=fleet.registry)
    assert m._update_clip == 0.625
    pol = with_update_clip(fleet.policy, 0.625)
    assert pol.gamma == pytest.approx(0.625 / 1024)  # S / gamma stays the plan's
    cohort = tuple(sorted(fleet.sessions))[:4]
    plan = draw_plan(pol, round_id=1, model_version=0, cohort=cohort,
                     dim=fleet.machine.dimension, random_bytes=_Source())
    assert plan.params.update_clip == 0.625
    assert plan.params.indicator_scale == pytest.approx(2 * 0.4 * 0.625)
    raw = msgpack.unpackb(snap, raw=False)
    del raw["update_clip"]
    old = RoundMachine.restore(msgpack.packb(raw, use_bin_type=True), policy=fleet.policy,
                               identity=fleet.agg_id, registry=fleet.registry)
    assert old._update_clip == 1.0
    raw["update_clip"] = float("nan")
    with pytest.raises(SnapshotError, match="update_clip"):
        RoundMachine.restore(msgpack.packb(raw, use_bin_type=True), policy=fleet.policy,
                             identity=fleet.agg_id, registry=fleet.registry)
    fleet.close()
