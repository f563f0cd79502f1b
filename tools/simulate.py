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
Uploads: the kept values (k = p*d of them), optionally quantized with s levels (QSGD,
after the noise), counted in bytes: payload, msgpack framing and the MQTT PUBLISH header.

With ``secagg`` (implied by ``transport = "mqtt"``) :func:`simulate` runs the fleet path
instead (``tools.fleet``): real device sessions with ledgers and secure aggregation,
dropouts (``dropout``), over the in-memory broker or a real mosquitto.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from aggregator.fedavg import select_cohort
from aggregator.optimizers import OPTIMIZERS
from edge_sdk import compress
from edge_sdk.engine import Engine, load_engine
from edge_sdk.model import build_spec, flatten_params, init_params, unflatten_params
from edge_sdk.privacy import RdpAccountant
from edge_sdk.privacy.paper_bounds import fedpaq_epsilon_from_noise
from edge_sdk.train import (
    LocalTraining,
    local_round,
    local_round_binomial,
    local_round_update_noise,
)
from edge_sdk.wire import encode_update, mqtt_publish_size, update_topic
from models import manifest_path
from tools.datasets import DATASETS, load_dataset
from tools.partition import parse_scheme, partition

__all__ = ["SimConfig", "load_config", "simulate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """A simulated fleet. Units: clip C is an L2 norm bound per sample; noise_multiplier z
    is the noise std on the clipped sum divided by C; epsilon is reported at ``delta``."""

    dataset: str = "fashion-mnist"
    model: str = "cnn"
    devices: int = 100
    participation: float = 0.1
    rounds: int = 30
    local_steps: int = 20
    batch_size: int = 32
    lr: float = 0.05
    clip: float = math.inf
    noise_multiplier: float = 0.0
    delta: float = 1e-5
    partition: str = "iid"
    sampling: str = "poisson"
    server_lr: float = 1.0
    server_opt: str = "fedavg"
    weighting: str = "uniform"
    mechanism: str = "gaussian"
    sparsity: float = 1.0
    quant_levels: int = 0
    update_clip: float | None = None
    binomial_trials: int = 4096
    backend: str = "onnx"
    threads: int = 1
    seed: int = 0
    eval_every: int = 1
    eval_batch: int = 2000
    # The fleet path (tools.fleet): device sessions with ledgers, secure aggregation.
    transport: str = "inproc"  # "inproc" (in-memory broker) | "mqtt" (a real mosquitto)
    secagg: bool | None = None  # None: on for transport "mqtt", off for "inproc"
    dropout: float = 0.0  # fraction of each cohort that vanishes at a random stage
    stage_timeout: float = 120.0  # seconds per secure-aggregation stage (a safety net)
    value_bound: float = 1.0  # uploads are clamped to [-B, B] before fixed-point encoding
    budget_epsilon: float = 100.0  # each device ledger's lifetime budget at delta
    progress: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        if self.transport not in ("inproc", "mqtt"):
            raise ValueError(f"transport must be 'inproc' or 'mqtt', got {self.transport!r}")
        if self.secagg is None:
            object.__setattr__(self, "secagg", self.transport == "mqtt")
        elif self.transport == "mqtt" and not self.secagg:
            raise ValueError("transport 'mqtt' runs the fleet with secure aggregation; "
                             "secagg = false is only for transport 'inproc'")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.dropout and not self.secagg:
            raise ValueError("dropout needs the fleet path (secagg = true or transport 'mqtt')")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices!r}")
        if not 0 < self.participation <= 1:
            raise ValueError(f"participation must be in (0, 1], got {self.participation!r}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta!r}")
        if self.weighting not in ("uniform", "samples"):
            raise ValueError(f"weighting must be 'uniform' or 'samples', got {self.weighting!r}")
        if self.mechanism not in ("gaussian", "update-noise", "binomial"):
            raise ValueError("mechanism must be 'gaussian', 'update-noise' or 'binomial', "
                             f"got {self.mechanism!r}")
        if self.server_opt not in OPTIMIZERS:
            raise ValueError(f"server_opt must be one of {sorted(OPTIMIZERS)}, "
                             f"got {self.server_opt!r}")
        if self.quant_levels < 0:
            raise ValueError(f"quant_levels must be >= 0 (0: float32), got {self.quant_levels!r}")
        if self.mechanism != "gaussian" and self.sparsity != 1.0:
            raise ValueError(f"mechanism {self.mechanism!r} is dense: use sparsity 1")
        if self.eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every!r}")
        parse_scheme(self.partition)
        self.local()  # validates the local-round settings
        if self.secagg:
            self.fleet_checks()

    @property
    def cohort_size(self) -> int:
        return max(1, round(self.participation * self.devices))

    def fleet_checks(self) -> None:
        """Raise ValueError for settings the fleet path (secure aggregation) cannot run."""
        if self.mechanism != "gaussian":
            raise ValueError(f"secure aggregation runs mechanism 'gaussian', "
                             f"got {self.mechanism!r}")
        if self.weighting != "uniform":
            raise ValueError("secure aggregation sums uniformly: weighting must be 'uniform'")
        if not math.isfinite(self.clip):
            raise ValueError("secure aggregation needs a finite clip (the devices' ledgers "
                             "and the fixed-point range depend on it)")
        if not self.noise_multiplier > 0:
            raise ValueError("the fleet path needs noise_multiplier > 0: a device's ledger "
                             "refuses a release with unbounded epsilon")
        if self.cohort_size < 3:
            raise ValueError(f"secure aggregation needs a cohort of >= 3 devices, "
                             f"participation * devices gives {self.cohort_size}")
        for name in ("stage_timeout", "value_bound", "budget_epsilon"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v!r}")

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON-able values (non-finite floats as None)."""
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                for k, v in dataclasses.asdict(self).items()}

    def local(self) -> LocalTraining:
        return LocalTraining(
            steps=self.local_steps,
            batch_size=self.batch_size,
            lr=self.lr,
            clip=self.clip,
            noise_multiplier=self.noise_multiplier,
            sampling=self.sampling,  # type: ignore[arg-type]
            sparsity=self.sparsity,
        )


def load_config(path: str | Path, **overrides: Any) -> SimConfig:
    """A :class:`SimConfig` from a TOML file (keys as the dataclass fields, dashes allowed,
    optionally under a ``[simulate]`` table), with ``overrides`` applied on top."""
    data = tomllib.loads(Path(path).read_text())
    data = data.get("simulate", data)
    known = {f.name for f in dataclasses.fields(SimConfig)}
    values = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"{path}: unknown setting {key!r}; known: {sorted(known)}")
        values[name] = value
    values.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("clip", "update_clip"):
        if isinstance(values.get(key), str):
            values[key] = float(values[key])
    return SimConfig(**values)


def evaluate(engine: Engine, params: list[np.ndarray], x: np.ndarray, y: np.ndarray,
             batch: int = 2000) -> float:
    """Top-1 accuracy of ``params`` on (x, y)."""
    correct = 0
    for s in range(0, len(y), batch):
        logits = engine.logits(params, x[s : s + batch])
        correct += int((logits.argmax(axis=1) == y[s : s + batch]).sum())
    return correct / len(y)


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


def _upload(values: np.ndarray, cfg: SimConfig, rng: np.random.Generator, rnd: int,
            device: int) -> tuple[np.ndarray, int, int]:
    """What the aggregator decodes from one device's upload, and (payload, overhead) bytes."""
    if cfg.quant_levels:
        q = compress.quantize(values, cfg.quant_levels, rng)
        payload = compress.pack_quantized(q)
        decoded = compress.dequantize(q)
        encoding = f"qsgd{cfg.quant_levels}"
    else:
        decoded = values.astype("<f4")
        payload = decoded.tobytes()
        encoding = "f32"
    message = encode_update(round_id=rnd, device=f"d{device}", encoding=encoding,
                            count=len(values), payload=payload)
    wire = mqtt_publish_size(update_topic("sim", f"d{device}"), len(message))
    return decoded, len(payload), wire - len(payload)


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
    message = encode_update(round_id=rnd, device=f"d{device}", encoding=f"int{bits}",
                            count=int(ints.size), payload=bytes(payload_len))
    wire = mqtt_publish_size(update_topic("sim", f"d{device}"), len(message))
    return ints * grid, payload_len, wire - payload_len


def simulate(cfg: SimConfig, *, out: TextIO = sys.stderr) -> dict[str, Any]:
    """Run the fleet; return the JSON-able summary (see module docstring for epsilon)."""
    if cfg.secagg:
        from tools.fleet import simulate_fleet

        return simulate_fleet(cfg, out=out)
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
    adjacency = "substitution" if cfg.mechanism == "update-noise" else "add_remove"
    accountants = [RdpAccountant(adjacency=adjacency) for _ in range(cfg.devices)]
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
        model_bytes = encode_update(round_id=rnd, device="server", encoding="f32", count=d,
                                    payload=flatten_params(params).tobytes())
        total = np.zeros(k, dtype=np.float64)
        weights, losses = [], []
        for i in cohort:
            x, y = device_data[i]
            if cfg.mechanism == "binomial":
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
            total += w * decoded
            weights.append(w)
            losses.append(res.mean_loss)
            bytes_up_payload += payload
            bytes_up_overhead += overhead
            bytes_down += mqtt_publish_size("fedge/sim/model", len(model_bytes))
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
               if cfg.mechanism == "binomial" else "RDP accountant")),
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
        "device_rounds": uploads,
        "max_rounds_per_device": int(participated.max()),
        "num_params": d,
        "wall_seconds": time.perf_counter() - t0,
        "config": {k: (finite(v) if isinstance(v, float) else v)
                   for k, v in dataclasses.asdict(cfg).items()},
    }


def write_json(summary: dict[str, Any], path: str | Path) -> None:
    """Write the summary as strict JSON (no NaN/Infinity)."""
    Path(path).write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
