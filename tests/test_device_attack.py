"""Issue 14, finding 1: the enroller / aggregator plays the attacker against a real device.

The device is built exactly as ``fedge enroll`` sets it up (``enroll`` into a temporary
directory, ``DeviceConfig.from_toml``, ``Device``) and takes part in one round with the
aggregator's round machine over the in-memory broker. The attacker knows every file
enrollment wrote, everything on the wire (plan, round id, model, the data size sent at
check-in) and, to be generous, the device's data. With batch size = data size the Poisson
rate is 1, so the noise-free clipped sum is a deterministic function of what the attacker
knows, and the only thing standing between the upload and the data is the Gaussian noise.

Two checks, each in a chi-square band around the truth (d = 650 coordinates):

* the upload minus the noise-free update has the noise's full variance sigma^2 (the noise
  is really there, at the planned scale);
* the upload minus the attacker's replay of the old seeded generator
  (``default_rng([seed, round_id])`` with the seed ``fedge enroll`` used to write, the
  device's index, and the default 0) has variance 2 sigma^2: the replay's noise is
  independent of the device's. Against the old code the replay matched the upload to
  ~1e-9 (the whole pipeline, stochastic rounding included, was replayed bit for bit).

This module imports nothing that the old code lacked, so it can be run against it (there,
import the key-file readers from ``edge_sdk.device`` and drop ``zoo_dir``: issue 15
moved them to ``edge_sdk.config``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from aggregator.rounds import RoundMachine, RoundPolicy
from edge_sdk import wire
from edge_sdk.config import load_aggregator_identity, load_registry, resolve_manifest
from edge_sdk.device import Device, DeviceConfig
from edge_sdk.engine import load_engine, load_manifest
from edge_sdk.fixedpoint import FixedPoint
from edge_sdk.model import flatten_params, init_params
from edge_sdk.train import LocalTraining, local_round
from models import ONNX_DIR
from tools.datasets import load_dataset
from tools.enroll import enroll
from tools.inproc import MemoryBroker

FLEET = "lab"
M = 20  # samples per device = batch size: Poisson rate 1, the batch is the whole set
LR, CLIP, Z = 1.0, 1.0, 5.0


def _band(d: int, target: float) -> tuple[float, float]:
    """A 7-sigma band for sum(r^2) / (d sigma^2) when r has variance target * sigma^2."""
    half = 7 * target * math.sqrt(2 / d)
    return target - half, target + half


@pytest.fixture(scope="module")
def round_done(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("attack")
    names = [f"dev-{i:04d}" for i in range(3)]
    enrolled = enroll(tmp / "fleet", devices=names, fleet=FLEET, tls=False, port=1883,
                      metrics_port=None)
    digits = load_dataset("digits")
    data = {n: (digits.x_train[i * M:(i + 1) * M], digits.y_train[i * M:(i + 1) * M])
            for i, n in enumerate(names)}
    devices = {n: Device(DeviceConfig.from_toml(enrolled.device_configs[n], zoo_dir=ONNX_DIR),
                         data=data[n])
               for n in names}
    agg_dir = enrolled.aggregator_config.parent
    manifest = resolve_manifest("logreg-64-10", None, zoo_dir=ONNX_DIR)
    spec = load_manifest(manifest).spec
    params = init_params(spec, np.random.default_rng(1))
    policy = RoundPolicy(fleet=FLEET, cohort_size=3, stage_timeout=10.0, max_rounds=1,
                         steps=1, batch_size=M, lr=LR, clip=CLIP, noise_multiplier=Z,
                         value_bound=4.0, seed=0)
    machine = RoundMachine(policy=policy, registry=load_registry(enrolled.registry),
                           identity=load_aggregator_identity(agg_dir / "identity.key"),
                           params=params)
    broker, now = MemoryBroker(), 0.0
    broker.attach("aggregator", machine, now)
    for n, dev in devices.items():
        broker.attach(n, dev.session, now)
    broker.run(now)
    for _ in range(40):
        if machine.history:
            break
        now += policy.stage_timeout + 0.5
        broker.tick(now)
    try:
        assert machine.history and machine.history[0].completed, machine.history
        plans = [wire.decode(p, wire.ALL_KINDS) for _, t, p in broker.sent
                 if t.endswith("/down/plan")]
        uploads = {n: devices[n].session.encoded_input(plans[0].round_id) for n in names}
    finally:
        for dev in devices.values():
            dev.close()
    return {"plan": plans[0], "params": params, "data": data, "uploads": uploads,
            "engine": load_engine(manifest), "names": names}


def _decode(plan, residues: np.ndarray) -> np.ndarray:
    return FixedPoint(scale=plan.params.scale, bits=plan.bits).decode(residues, 1)


def _attacker_views(r: dict, name: str) -> tuple[np.ndarray, dict[int, np.ndarray], float]:
    """The upload minus the noise-free update, minus each seeded replay; and sigma."""
    plan, engine, params = r["plan"], r["engine"], r["params"]
    p = plan.params
    x, y = r["data"][name]
    upload = _decode(plan, r["uploads"][name])
    cfg = dict(steps=p.steps, batch_size=p.batch_size, lr=p.lr, clip=p.clip,
               sampling=p.sampling, sparsity=1.0)
    clean = local_round(engine, params, x, y, LocalTraining(noise_multiplier=0.0, **cfg),
                        np.random.default_rng(0))
    u0 = flatten_params(clean.update).astype(np.float64)
    replays = {}
    for seed in sorted({r["names"].index(name), 0}):  # enroll's old seed = i; default 0
        rng = np.random.default_rng([seed, plan.round_id])  # the old session, verbatim
        res = local_round(engine, params, x, y,
                          LocalTraining(noise_multiplier=p.noise_multiplier, **cfg), rng)
        values = np.clip(flatten_params(res.update).astype(np.float64), -p.value_bound,
                         p.value_bound)
        fp = FixedPoint(scale=p.scale, bits=plan.bits)
        replays[seed] = upload - fp.decode(fp.encode(values, rng), 1)
    sigma = p.lr * p.noise_multiplier * p.clip / len(y)  # one step, denominator m
    return upload - u0, replays, sigma


def test_the_plan_is_the_one_the_attack_needs(round_done) -> None:
    p = round_done["plan"].params
    assert (p.steps, p.batch_size, p.sampling, p.sparsity) == (1, M, "poisson", 1.0)
    assert p.quant_levels == 0 and p.noise_multiplier == Z


@pytest.mark.parametrize("index", [0, 1, 2])
def test_enroller_cannot_regenerate_the_noise(round_done, index: int) -> None:
    name = round_done["names"][index]
    vs_clean, vs_replays, sigma = _attacker_views(round_done, name)
    d = vs_clean.size
    assert d == 650
    # the upload carries the full noise on top of the noise-free update
    lo, hi = _band(d, 1.0)
    stat = float(np.sum(vs_clean**2) / (d * sigma**2))
    assert lo < stat < hi, (name, stat, (lo, hi))
    # ... and the old seeded generator, replayed with every seed enrollment ever wrote,
    # explains none of it (independent noise: twice the variance, not ~0)
    lo2, hi2 = _band(d, 2.0)
    for seed, resid in vs_replays.items():
        stat2 = float(np.sum(resid**2) / (d * sigma**2))
        assert lo2 < stat2 < hi2, (name, seed, stat2, (lo2, hi2))


def test_enrolled_device_files_hold_no_seed(round_done, tmp_path: Path) -> None:
    names = ["dev-a", "dev-b", "dev-c"]
    enrolled = enroll(tmp_path / "f", devices=names, fleet=FLEET, tls=False, port=1883,
                      metrics_port=None, ledgers=False)
    for n in names:
        text = enrolled.device_configs[n].read_text()
        assert "seed" not in text, text
