"""The in-process fleet simulator: the same device and aggregator code, no network.

Each round the aggregator picks a cohort of r = participation * n devices uniformly
without replacement, each cohort member runs a local round on its own partition, and
the server optimizer (FedAvg, or Fed-SPA's adaptive update) applies the mean update.
Every device keeps its own RDP accountant over the rounds it took part in; the reported
epsilon is the maximum over devices at ``delta`` (sample-level DP of each device's data).

Mechanisms (``mechanism``):
* ``gaussian``: noise on every step's clipped sum (zCDP paper Alg. 1; with ``sparsity``
  p < 1, Fed-SPA's sparsified steps over the round's shared rand-k set).
* ``update-noise``: privatized FedPAQ (Alg. 2): clipped SGD on a subsample drawn without
  replacement, Gaussian noise once on the clipped update.
* ``binomial``: the cpSGD baseline: the same clipped update quantized onto a grid of
  S / levels, plus Binomial(N, 1/2) noise. Its ``epsilon`` is the restricted-RDP bound of
  :mod:`edge_sdk.privacy.binomial` (each round charged in full, composed, converted at
  delta); cpSGD's Theorem 1 can be below the true epsilon, so it is reported only as the
  labelled ``paper_epsilon`` (per round at delta / rounds, amplified, summed).
* ``ddg``: FedSGD with the distributed discrete Gaussian (Kairouz, Liu, Steinke 2021)
  under secure aggregation, sample-level: each round every cohort device sums ALL its
  samples' gradients (q = 1, no amplification by sampling), each restricted to the
  round's rand-k set and clipped to C, scaled by 1/gamma and conditionally rounded on its
  own (one sample moves the sum by at most D2 in L2), adds N_Z(0, sigma^2) per coordinate
  with sigma = z (C / gamma) / sqrt(r), and uploads the residues mod 2^bits. The simulator
  applies secure aggregation's arithmetic (the sum of residues mod 2^bits; the masks
  cancel) but not its key agreement, which ``tools.fleet`` and the secagg tests cover. The
  server takes the centered residue, times gamma, divided by the public r x mean local
  data size, and hands -lr / p times that mean gradient to the server optimizer: one
  release, one step per round. Why not tau local steps: other devices' noise provably
  covers only the released sum, so intermediate local states would each need their own
  noise. Each device's :class:`~edge_sdk.privacy.rdp.RdpAccountant` (zero-out of one
  sample) composes one distributed-discrete-Gaussian event per round it took part in, with
  n = r noise shares: that assumes no dropouts (none here) and no colluders.
Uploads: the kept values (k = p*d of them), optionally quantized with s levels (QSGD,
after the noise), counted in bytes: payload, msgpack framing and the MQTT PUBLISH header.

The settings are a :class:`tools.simconfig.SimConfig`. With ``secagg`` (implied by
``transport = "mqtt"``) a config belongs to the fleet path instead (``tools.fleet``: real
device sessions with ledgers and secure aggregation, dropouts, over the in-memory broker or
a real mosquitto); :func:`tools.run.run` picks the path, and :func:`simulate` refuses such
a config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from aggregator.fedavg import select_cohort
from aggregator.optimizers import OPTIMIZERS
from aggregator.rounds import round_secrets
from edge_sdk import compress
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.ddp import DEFAULT_BETA, bounded_wrap_probability
from edge_sdk.engine import load_engine
from edge_sdk.hazmat.ring import Ring
from edge_sdk.mechanisms import ddg as ddg_mech
from edge_sdk.model import build_spec, flatten_params, init_params, unflatten_params
from edge_sdk.privacy import DistributedDiscreteGaussian, RdpAccountant
from edge_sdk.privacy.binomial import (
    BINOMIAL_ORDERS,
    PAPER_BOUND_LABEL,
    restricted_rdp_epsilon,
)
from edge_sdk.privacy.paper_bounds import fedpaq_epsilon_from_noise
from edge_sdk.train import (
    local_round,
    local_round_binomial,
    local_round_ddg,
    local_round_update_noise,
)
from edge_sdk.wire import ModelUpdate, mqtt_publish_size, upload_sizes
from edge_sdk.wire import encode as wire_encode
from models import manifest_path
from tools.broker import device_names
from tools.datasets import load_dataset
from tools.evaluate import evaluate
from tools.partition import partition
from tools.seeding import device_seed, round_random_bytes
from tools.simconfig import DDG_SCALE, SimConfig
from tools.summary import model_sha256

__all__ = ["DDG_SCALE", "PATH_VERSION", "DdgPlan", "ddg_plan", "round_draws", "simulate"]

PATH_VERSION = 2
"""The fast simulator's numbers' version, part of every stored experiment run's key
(``tools.experiments.spec.RunSpec.key``): bumped whenever a change moves its results, so
``fedge experiment run`` reruns stored runs instead of keeping the old path's numbers.
1: before issue 15; 2: issue 15 G0, cohorts, round seeds and device randomness drawn as the
fleet draws them (:func:`round_draws`)."""


# Per round; a union bound over 45 rounds is still negligible.
_DDG_WRAP_PROBABILITY = ddg_mech.WRAP_PROBABILITY


class _Progress:
    def __init__(self, total: int, out: TextIO, enabled: bool) -> None:
        self.total, self.out, self.enabled = total, out, enabled
        self.tty = enabled and out.isatty()
        self.start = time.perf_counter()

    def show(self, rnd: int, acc: float | None, eps: float) -> None:
        if not self.enabled:
            return
        width = 24
        done = int(width * rnd / self.total)
        bar = "#" * done + "." * (width - done)
        acc_s = "  -  " if acc is None else f"{acc:.4f}"
        eps_s = "inf" if math.isinf(eps) else f"{eps:.3f}"
        line = (f"round {rnd:>4}/{self.total} [{bar}] acc {acc_s} eps {eps_s} "
                f"{time.perf_counter() - self.start:6.1f}s")
        if self.tty:
            self.out.write("\r" + line + ("\n" if rnd == self.total else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()


def round_draws(seed: int, devices: int, cohort_size: int, rounds: int
                ) -> Iterator[tuple[int, tuple[int, ...], bytes]]:
    """(round id, cohort as sorted device indices, round seed) of rounds 1..``rounds``,
    drawn as a simulated fleet of ``seed`` draws them (``tools.fleet``): the round
    machine's cohort over all ``devices`` (every device is eligible: the fast simulator
    has no budgets) and its round seed and nonce from the fleet's seeded source. A
    deployment's aggregator draws the seeds from os.urandom."""
    names = device_names(devices)
    index = {n: i for i, n in enumerate(names)}
    random_bytes = round_random_bytes(seed)
    for rnd in range(1, rounds + 1):
        cohort = select_cohort(names, min(cohort_size, devices), seed=seed, round_id=rnd)
        round_seed, _nonce = round_secrets(random_bytes)  # the nonce: secure aggregation's
        yield rnd, tuple(index[n] for n in cohort), round_seed


def _upload_bytes(count: int, bits: int, device: int) -> tuple[int, int]:
    """(payload, overhead) bytes of one upload of ``count`` values of ``bits`` each, as the
    wire carries it: signed ``masked_part`` s of the packed bytes under MQTT v5 headers
    (``wire.upload_sizes`` encodes real messages)."""
    return upload_sizes(count, bits, fleet="sim", device=f"d{device}")


def _upload(values: np.ndarray, cfg: SimConfig, rng: np.random.Generator, rnd: int,
            device: int) -> tuple[np.ndarray, int, int]:
    """What the aggregator decodes from one device's upload, and (payload, overhead) bytes."""
    if cfg.quant_levels:
        q = compress.quantize(values, cfg.quant_levels, rng)
        payload = compress.pack_quantized(q)
        decoded = compress.dequantize(q)
    else:
        decoded = values.astype("<f4")
        payload = decoded.tobytes()
    return (decoded, *_upload_bytes(len(payload), 8, device))


def _fedpaq_paper_epsilon(cfg: SimConfig, m: int) -> float:
    """Per-round epsilon FedPAQ's eq. (16) claims for this run's noise, at delta / rounds,
    with the same update sensitivity 2S our accountant charges (paper bound)."""
    if cfg.noise_multiplier == 0:
        return math.inf
    s_bound = cfg.update_clip or cfg.local_steps * cfg.lr * cfg.clip
    b = min(cfg.batch_size, max(1, m // cfg.local_steps))
    return fedpaq_epsilon_from_noise(
        sensitivity=2 * s_bound, noise_std=cfg.noise_multiplier * s_bound,
        delta=cfg.delta / cfg.rounds, batch_size=b, local_steps=cfg.local_steps,
        dataset_size=m)


def _upload_integers(ints: np.ndarray, grid: float, rnd: int,
                     device: int) -> tuple[np.ndarray, int, int]:
    """Binomial-mechanism upload: integers bit-packed at the width their range needs."""
    span = int(np.abs(ints).max()) if ints.size else 0
    bits = max(1, math.ceil(math.log2(2 * span + 1)))
    payload_len = 8 + math.ceil(ints.size * bits / 8)  # grid (float32) + width + count
    return (ints * grid, *_upload_bytes(payload_len, 8, device))


@dataclass(frozen=True, slots=True, kw_only=True)
class DdgPlan:
    """The public parameters of a ``ddg`` run (integer scale unless stated).

    Attributes:
        gamma: model units per integer step.
        sigma: per-device discrete Gaussian parameter.
        l2_sensitivity: D2 = rounded_l2_bound(C/gamma, k, beta): one sample's rounded
            vector, so one sample's change to a device's integer sum (add/remove).
        l1_sensitivity: min(sqrt(k) D2, D2^2) (integer coordinates), rounded up.
        dim: k, the coordinates noised and uploaded.
        devices: n = r, the cohort: the noise shares in every released sum. n = r assumes
            no dropouts (none here) and no colluders (nobody who can subtract a share); with
            either, n = min_survivors - max_colluders (privacy review, Q2: 1 colluder at
            r = 10 moves the true epsilon from 1.0 to 1.066).
    """

    gamma: float
    sigma: float
    l2_sensitivity: float
    l1_sensitivity: float
    dim: int
    devices: int

    def event(self, steps: int = 1, *, adjacency: str) -> DistributedDiscreteGaussian:
        """The privacy event of ``steps`` rounds of one device (KLS 2021 Theorem 1), for
        one SAMPLE of its data under ``adjacency`` (required): ``"add_remove"`` or
        ``"zero_out"`` (the same D2: a null sample's rounded row is 0; either way the device
        stays in the round and its noise share stays in the sum, which the bound needs),
        or ``"substitution"`` (D2 and D1 doubled). Assumes n = r shares (see ``devices``).
        The mechanism's own function (:func:`edge_sdk.mechanisms.ddg.sample_event`).
        """
        return ddg_mech.sample_event(l2=self.l2_sensitivity, l1=self.l1_sensitivity,
                                     sigma=self.sigma, devices=self.devices, dim=self.dim,
                                     steps=steps, adjacency=adjacency)


def ddg_plan(cfg: SimConfig, num_params: int) -> DdgPlan:
    """The :class:`DdgPlan` of a ``ddg`` config for a model of ``num_params`` parameters."""
    if cfg.mechanism != "ddg":
        raise ValueError(f"ddg_plan needs mechanism 'ddg', got {cfg.mechanism!r}")
    gamma = cfg.gamma
    k = num_params if cfg.sparsity == 1.0 else compress.kept_count(num_params, cfg.sparsity)
    r = cfg.cohort_size
    l2, l1 = ddg_mech.sensitivities(cfg.clip, gamma, k)
    return DdgPlan(gamma=gamma, sigma=ddg_mech.device_sigma(cfg.noise_multiplier, cfg.clip,
                                                            gamma, r),
                   l2_sensitivity=l2, l1_sensitivity=l1, dim=k, devices=r)


def _upload_ddg(k: int, bits: int, rnd: int, device: int) -> tuple[int, int]:
    """(payload, overhead) bytes of a ddg upload: k residues bit-packed at ``bits`` each
    (gamma, bits and the coordinate set are public round parameters, not sent)."""
    return _upload_bytes(k, bits, device)


def simulate(cfg: SimConfig, *, out: TextIO = sys.stderr) -> dict[str, Any]:
    """Run the fleet; return the JSON-able summary (see module docstring for epsilon).

    The fast path only: a config with ``secagg`` is the fleet path's, which
    :func:`tools.run.run` dispatches to (this module does not import ``tools.fleet``).
    """
    if cfg.secagg:
        raise ValueError("simulate() is the in-process path without secure aggregation: "
                         "run a config with secagg = true through tools.run.run (the fleet "
                         f"path), got transport={cfg.transport!r}, secagg={cfg.secagg!r}")
    t0 = time.perf_counter()
    data = load_dataset(cfg.dataset)
    spec = build_spec(cfg.model, data.input_shape, data.num_classes)
    engine = load_engine(
        manifest_path(spec.name, spec.input_shape, spec.num_classes),
        backend=cfg.backend,
        threads=cfg.threads,
    )
    seeds = np.random.SeedSequence(cfg.seed).spawn(3)
    part_rng, init_rng, _ = (np.random.default_rng(s) for s in seeds)
    shards = partition(data.y_train, cfg.devices, cfg.partition, part_rng,
                       num_classes=data.num_classes)
    device_data = [(data.x_train[idx], data.y_train[idx]) for idx in shards]
    # each device's randomness: round r's generator from its fleet seed, as the fleet's
    # DeviceSession gets it (csprng.seeded_round_rng)
    device_rngs = [seeded_round_rng(device_seed(cfg.seed, i)) for i in range(cfg.devices)]
    # Zero-out, the relation the device ledger states everything under: Poisson events keep
    # their add/remove numbers, without-replacement and shuffle events their substitution ones.
    adjacency = "zero_out"
    # ddg too: DdgPlan.event under zero-out (one sample's rounded row; the share stays).
    accountants = [RdpAccountant(adjacency=adjacency) for _ in range(cfg.devices)]
    participated = np.zeros(cfg.devices, dtype=np.int64)
    # binomial: per device, eps and delta summed over rounds (basic composition)
    binom_eps = np.zeros(cfg.devices)  # cpSGD Thm 1 (paper figure only)
    # binomial, sound: restricted Renyi moments and delta0 summed over rounds (composition)
    binom_rdp = np.zeros((cfg.devices, len(BINOMIAL_ORDERS)))
    binom_delta0 = np.zeros(cfg.devices)
    paper_eps = np.zeros(cfg.devices)  # update-noise: FedPAQ eq. (16) per round, summed

    params = init_params(spec, init_rng)
    d = spec.num_params
    k = d if cfg.sparsity == 1.0 else compress.kept_count(d, cfg.sparsity)
    server = OPTIMIZERS[cfg.server_opt](server_lr=cfg.server_lr)
    state = server.init(params)
    local = cfg.local()
    r = cfg.cohort_size
    ddg = ddg_plan(cfg, d) if cfg.mechanism == "ddg" else None
    ddg_facts: dict[str, Any] | None = None
    bits, nominal = 0, 0.0
    if ddg is not None:
        sizes = [len(s) for s in shards]
        # Public: the fleet's mean local data size (never the true count of the round,
        # which depends on the data), and the largest one for the ring's worst case.
        nominal = float(np.mean(sizes))
        max_signal = ddg_mech.max_abs_signal(r, max(sizes), ddg.l2_sensitivity)
        bits = ddg_mech.ring_bits(signal=max_signal, cohort_size=r, length=k, sigma=ddg.sigma,
                                  wrap_probability=_DDG_WRAP_PROBABILITY)
        ddg_facts = {"gamma": ddg.gamma, "sigma_dev": ddg.sigma,
                     "summed_noise_std_model_units": ddg.sigma * ddg.gamma * math.sqrt(r),
                     "bits": bits, "l2_sensitivity": ddg.l2_sensitivity,
                     "l1_sensitivity": ddg.l1_sensitivity, "beta": DEFAULT_BETA,
                     "nominal_local_samples": nominal, "max_abs_signal": max_signal,
                     "wrap_probability_bound_per_round": bounded_wrap_probability(
                         max_signal, r, k, ddg.sigma, bits),
                     "wrapped_coordinates": 0}
    acc_hist: list[float | None] = []
    eps_hist: list[float] = []
    loss_hist: list[float] = []
    bytes_hist: list[dict[str, int]] = []
    bytes_up_payload = bytes_up_overhead = bytes_down = 0
    progress = _Progress(cfg.rounds, out, cfg.progress)
    eps = 0.0
    for rnd, cohort, round_seed in round_draws(cfg.seed, cfg.devices, r, cfg.rounds):
        before = (bytes_up_payload, bytes_up_overhead, bytes_down)
        coords = None
        if k < d:  # one rand-k set for the whole cohort, from the round seed
            coords = compress.coordinate_set(round_seed, d, k)
        model_bytes = wire_encode(replace(ModelUpdate.of(version=rnd, round_id=rnd,
                                                         params=params), sig=bytes(64)))
        total = np.zeros(k, dtype=np.float64)
        residue_sum = np.zeros(k, dtype=np.uint64)  # ddg: uint64 wraps mod 2^64, 2^bits | 2^64
        plain_sum = np.zeros(k, dtype=np.int64)  # ddg: the same sum without the ring
        weights, losses = [], []
        for i in cohort:
            x, y = device_data[i]
            rng = device_rngs[i](rnd)
            decoded: np.ndarray | None = None
            if ddg is not None:
                res = local_round_ddg(engine, params, x, y, rng, clip=cfg.clip,
                                      gamma=ddg.gamma, sigma=ddg.sigma, bits=bits,
                                      coords=coords)
                accountants[i].compose(ddg.event(adjacency="zero_out"))
                residue_sum += res.residues
                plain_sum += res.integers
                payload, overhead = _upload_ddg(k, bits, rnd, int(i))
            elif cfg.mechanism == "binomial":
                res = local_round_binomial(engine, params, x, y, local, rng,
                                           trials=cfg.binomial_trials,
                                           levels=cfg.quant_levels or 127,
                                           update_clip=cfg.update_clip)
                e, _ = res.event.paper_epsilon_delta(cfg.delta / cfg.rounds)  # paper figure
                binom_eps[i] += e
                rho, delta0 = res.event.restricted_rdp()  # every round charged in full
                binom_rdp[i] += rho
                binom_delta0[i] += delta0
                decoded, payload, overhead = _upload_integers(res.integers, res.grid, rnd, int(i))
            else:
                if cfg.mechanism == "update-noise":
                    res = local_round_update_noise(engine, params, x, y, local, rng,
                                                   update_clip=cfg.update_clip)
                    paper_eps[i] += _fedpaq_paper_epsilon(cfg, len(y))
                else:
                    res = local_round(engine, params, x, y, local, rng,
                                      coords=coords)
                accountants[i].compose(res.event)
                flat = flatten_params(res.update)
                values = flat if coords is None else flat[coords]
                decoded, payload, overhead = _upload(values, cfg, rng, rnd, int(i))
            participated[i] += 1
            w = res.num_samples if cfg.weighting == "samples" else 1.0
            if decoded is not None:
                total += w * decoded
            weights.append(w)
            losses.append(res.mean_loss)
            bytes_up_payload += payload
            bytes_up_overhead += overhead
            bytes_down += mqtt_publish_size("fedge/sim/model", len(model_bytes))
        if ddg is not None and ddg_facts is not None:
            summed = Ring(bits=bits).to_signed(residue_sum)
            ddg_facts["wrapped_coordinates"] += int(np.count_nonzero(summed != plain_sum))
            # FedSGD: -lr times the mean clipped gradient, / p for rand-k (Fed-SPA eq. (5))
            mean_kept = ddg_mech.fedsgd_step(residue_sum, bits=bits, gamma=ddg.gamma,
                                             lr=cfg.lr, dim=d, length=k, survivors=r,
                                             nominal_samples=nominal)
        else:
            mean_kept = (total / sum(weights)).astype(np.float32)
        dense = mean_kept if coords is None else np.zeros(d, dtype=np.float32)
        if coords is not None:
            dense[coords] = mean_kept
        params, state = server.update(unflatten_params(spec, dense), state, params)
        if cfg.mechanism == "binomial":  # the restricted-RDP bound (not cpSGD Thm 1)
            eps = max(restricted_rdp_epsilon(binom_rdp[i], BINOMIAL_ORDERS, binom_delta0[i],
                                             cfg.delta) for i in np.flatnonzero(participated))
        else:
            eps = max(accountants[i].get_epsilon(cfg.delta)
                      for i in np.flatnonzero(participated))
        eps = max(eps, eps_hist[-1] if eps_hist else 0.0)
        acc = None
        if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:
            acc = evaluate(engine, params, data.x_test, data.y_test, cfg.eval_batch)
        bytes_hist.append({"up_payload": bytes_up_payload - before[0],
                           "up_overhead": bytes_up_overhead - before[1],
                           "down": bytes_down - before[2]})
        acc_hist.append(acc)
        eps_hist.append(eps)
        loss_hist.append(float(np.mean(losses)))
        progress.show(rnd, acc, eps)

    def finite(v: float) -> float | None:
        return v if math.isfinite(v) else None

    uploads = int(participated.sum())
    return {
        "final_accuracy": acc_hist[-1],
        "accuracy_per_round": acc_hist,
        "train_loss_per_round": loss_hist,
        "epsilon": finite(eps),
        "epsilon_per_round": [finite(e) for e in eps_hist],
        "epsilon_note": (
            "max over devices, sample-level DP; null = no DP guarantee. "
            + ("binomial: restricted-RDP bound (edge_sdk.privacy.binomial; substitution), "
               "every round charged in full, no subsampling amplification; cpSGD Thm 1 "
               "is only the labelled paper_epsilon"
               if cfg.mechanism == "binomial" else
               "distributed discrete Gaussian (KLS 2021 Thm 1) RDP accountant, zero-out, "
               "n = r shares: assumes no dropouts and no colluders"
               if cfg.mechanism == "ddg" else "RDP accountant, zero-out adjacency")),
        "delta": cfg.delta,
        "paper_epsilon": (finite(float(paper_eps.max())) if cfg.mechanism == "update-noise"
                          else finite(float(binom_eps.max())) if cfg.mechanism == "binomial"
                          else None),
        "paper_epsilon_note": ("update-noise: FedPAQ eq. (16) per round at delta/rounds, "
                               "summed over a device's rounds (paper bound, not necessarily "
                               "sound)" if cfg.mechanism == "update-noise" else
                               f"{PAPER_BOUND_LABEL}; per round at delta/rounds, amplified by "
                               "the subsample, summed over a device's rounds"
                               if cfg.mechanism == "binomial" else None),
        "bytes_up_total": bytes_up_payload + bytes_up_overhead,
        "bytes_up_payload": bytes_up_payload,
        "bytes_up_overhead": bytes_up_overhead,
        "bytes_up_per_upload": (bytes_up_payload + bytes_up_overhead) / uploads,
        "bytes_up_float32_per_upload": 4 * d,
        "bytes_down_total": bytes_down,
        "bytes_per_round": bytes_hist,
        "kept_coordinates": k,
        "ddg": ddg_facts,
        "device_rounds": uploads,
        "max_rounds_per_device": int(participated.max()),
        "num_params": d,
        "model_sha256": model_sha256(params),
        "wall_seconds": time.perf_counter() - t0,
        "config": {k: (finite(v) if isinstance(v, float) else v)
                   for k, v in dataclasses.asdict(cfg).items()},
    }


def write_json(summary: dict[str, Any], path: str | Path) -> None:
    """Write the summary as strict JSON (no NaN/Infinity)."""
    Path(path).write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
