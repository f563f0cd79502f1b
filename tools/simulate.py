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
  S / levels, plus Binomial(N, 1/2) noise. Its epsilon is cpSGD's Theorem 1 (a paper
  bound) per round at delta / rounds, amplified by the subsample, composed by summing.
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
  noise. Each device's :class:`~edge_sdk.privacy.rdp.RdpAccountant` (add/remove)
  composes one distributed-discrete-Gaussian event per round it took part in.
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
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from aggregator.fedavg import select_cohort
from aggregator.optimizers import OPTIMIZERS
from edge_sdk import compress
from edge_sdk.ddp import (
    DEFAULT_BETA,
    bounded_wrap_probability,
    choose_bits_bounded,
    rounded_l2_bound,
)
from edge_sdk.engine import load_engine
from edge_sdk.hazmat.ring import Ring
from edge_sdk.model import build_spec, flatten_params, init_params, unflatten_params
from edge_sdk.privacy import DistributedDiscreteGaussian, RdpAccountant
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
from tools.datasets import load_dataset
from tools.evaluate import evaluate
from tools.partition import partition
from tools.simconfig import SimConfig
from tools.summary import model_sha256

__all__ = ["DDG_SCALE", "DdgPlan", "ddg_plan", "simulate"]

DDG_SCALE = 1024
"""Default C / gamma of mechanism ``ddg``: a clipped sample spans 2^10 integer steps, so
rounding adds at most sqrt(k) to its L2 bound (0.3% at the CNN's k = 21,840) and its
variance is far below the noise's."""

# Per round; a union bound over 45 rounds is still negligible.
_DDG_WRAP_PROBABILITY = 1e-9


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


def _round_seed(seed: int, rnd: int) -> bytes:
    # A deployment's aggregator draws this from os.urandom and publishes it in the round
    # plan; the simulator derives it so runs are reproducible.
    return hashlib.sha256(f"fedge-sim/{seed}/{rnd}".encode()).digest()


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
        devices: r, the cohort: noise shares in every released sum (no dropouts here).
    """

    gamma: float
    sigma: float
    l2_sensitivity: float
    l1_sensitivity: float
    dim: int
    devices: int

    def event(self, steps: int = 1) -> DistributedDiscreteGaussian:
        """The privacy event of ``steps`` rounds of one device (KLS 2021)."""
        return DistributedDiscreteGaussian(
            l2_sensitivity=self.l2_sensitivity, l1_sensitivity=self.l1_sensitivity,
            sigma=self.sigma, devices=self.devices, dim=self.dim, steps=steps)


def ddg_plan(cfg: SimConfig, num_params: int) -> DdgPlan:
    """The :class:`DdgPlan` of a ``ddg`` config for a model of ``num_params`` parameters."""
    if cfg.mechanism != "ddg":
        raise ValueError(f"ddg_plan needs mechanism 'ddg', got {cfg.mechanism!r}")
    gamma = cfg.ddg_gamma if cfg.ddg_gamma is not None else cfg.clip / DDG_SCALE
    k = num_params if cfg.sparsity == 1.0 else compress.kept_count(num_params, cfg.sparsity)
    r = cfg.cohort_size
    l2 = rounded_l2_bound(cfg.clip / gamma, k, DEFAULT_BETA)
    return DdgPlan(gamma=gamma, sigma=cfg.noise_multiplier * (cfg.clip / gamma) / math.sqrt(r),
                   l2_sensitivity=l2,
                   l1_sensitivity=math.nextafter(min(math.sqrt(k) * l2, l2 * l2), math.inf),
                   dim=k, devices=r)


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
    part_rng, init_rng, cohort_rng = (np.random.default_rng(s) for s in seeds)
    shards = partition(data.y_train, cfg.devices, cfg.partition, part_rng,
                       num_classes=data.num_classes)
    device_data = [(data.x_train[idx], data.y_train[idx]) for idx in shards]
    device_rngs = [np.random.default_rng([cfg.seed, 1, i]) for i in range(cfg.devices)]
    # Zero-out, the relation the device ledger states everything under: Poisson events keep
    # their add/remove numbers, without-replacement and shuffle events their substitution ones.
    adjacency = "zero_out"
    # ddg: DdgPlan.event is stated under add/remove (one sample's rounded vector).
    accountants = [RdpAccountant(adjacency="add_remove" if cfg.mechanism == "ddg" else adjacency)
                   for _ in range(cfg.devices)]
    participated = np.zeros(cfg.devices, dtype=np.int64)
    # binomial: per device, eps and delta summed over rounds (basic composition)
    binom_eps = np.zeros(cfg.devices)
    binom_delta = np.zeros(cfg.devices)
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
        max_signal = r * max(sizes) * ddg.l2_sensitivity
        bits = choose_bits_bounded(max_signal, r, k, ddg.sigma, _DDG_WRAP_PROBABILITY)
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
    for rnd in range(1, cfg.rounds + 1):
        cohort = select_cohort(cfg.devices, r, cohort_rng)
        before = (bytes_up_payload, bytes_up_overhead, bytes_down)
        coords = None
        if k < d:  # one rand-k set for the whole cohort, from the round seed
            coords = compress.coordinate_set(_round_seed(cfg.seed, rnd), d, k)
        model_bytes = wire_encode(replace(ModelUpdate.of(version=rnd, round_id=rnd,
                                                         params=params), sig=bytes(64)))
        total = np.zeros(k, dtype=np.float64)
        residue_sum = np.zeros(k, dtype=np.uint64)  # ddg: uint64 wraps mod 2^64, 2^bits | 2^64
        plain_sum = np.zeros(k, dtype=np.int64)  # ddg: the same sum without the ring
        weights, losses = [], []
        for i in cohort:
            x, y = device_data[i]
            decoded: np.ndarray | None = None
            if ddg is not None:
                res = local_round_ddg(engine, params, x, y, device_rngs[i], clip=cfg.clip,
                                      gamma=ddg.gamma, sigma=ddg.sigma, bits=bits,
                                      coords=coords)
                accountants[i].compose(ddg.event())
                residue_sum += res.residues
                plain_sum += res.integers
                payload, overhead = _upload_ddg(k, bits, rnd, int(i))
            elif cfg.mechanism == "binomial":
                res = local_round_binomial(engine, params, x, y, local, device_rngs[i],
                                           trials=cfg.binomial_trials,
                                           levels=cfg.quant_levels or 127,
                                           update_clip=cfg.update_clip)
                e, dl = res.event.epsilon_delta(cfg.delta / cfg.rounds)
                binom_eps[i] += e
                binom_delta[i] += dl
                decoded, payload, overhead = _upload_integers(res.integers, res.grid, rnd, int(i))
            else:
                if cfg.mechanism == "update-noise":
                    res = local_round_update_noise(engine, params, x, y, local, device_rngs[i],
                                                   update_clip=cfg.update_clip)
                    paper_eps[i] += _fedpaq_paper_epsilon(cfg, len(y))
                else:
                    res = local_round(engine, params, x, y, local, device_rngs[i],
                                      coords=coords)
                accountants[i].compose(res.event)
                flat = flatten_params(res.update)
                values = flat if coords is None else flat[coords]
                decoded, payload, overhead = _upload(values, cfg, device_rngs[i], rnd, int(i))
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
            scale = -cfg.lr * (d / k) * ddg.gamma / (r * nominal)
            mean_kept = (scale * summed.astype(np.float64)).astype(np.float32)
        else:
            mean_kept = (total / sum(weights)).astype(np.float32)
        dense = mean_kept if coords is None else np.zeros(d, dtype=np.float32)
        if coords is not None:
            dense[coords] = mean_kept
        params, state = server.update(unflatten_params(spec, dense), state, params)
        if cfg.mechanism == "binomial":
            eps = float(binom_eps.max())
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
            + ("cpSGD Thm 1 (paper bound) per round, basic composition"
               if cfg.mechanism == "binomial" else
               "distributed discrete Gaussian (KLS 2021 Thm 1) RDP accountant, r shares"
               if cfg.mechanism == "ddg" else "RDP accountant, zero-out adjacency")),
        "delta": cfg.delta,
        "paper_epsilon": (finite(float(paper_eps.max()))
                          if cfg.mechanism == "update-noise" else None),
        "paper_epsilon_note": ("update-noise: FedPAQ eq. (16) per round at delta/rounds, "
                               "summed over a device's rounds (paper bound, not necessarily "
                               "sound)" if cfg.mechanism == "update-noise" else None),
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
