"""The settings of a simulated fleet, shared by both paths and the experiments.

:class:`SimConfig` is validated on construction, for the fast in-process simulator
(``tools.simulate``) and the fleet path with secure aggregation (``tools.fleet``) alike;
:func:`tools.run.run` picks the path from ``cfg.secagg``. Both paths run rounds under the
one :class:`aggregator.round_core.RoundPolicy` that :func:`round_policy` maps these flat
settings onto. This module imports neither path, so each of them, and the experiment
runner, can depend on it without a cycle.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from aggregator.optimizers import OPTIMIZERS
from aggregator.round_core import RoundPolicy
from edge_sdk import wire
from edge_sdk.mechanisms import MECHANISMS
from edge_sdk.train import LocalTraining
from tools.datasets import DATASETS
from tools.partition import parse_scheme

__all__ = ["DDG_SCALE", "FLEET_BUDGET_EPSILON", "FLEET_NAME", "MECHANISM_NAMES",
           "SIMULATION_ONLY", "SimConfig", "load_config", "round_policy"]

SIMULATION_ONLY: tuple[str, ...] = ()
"""Mechanisms only the fast path runs (no device half in ``edge_sdk.mechanisms``): none since
issue 15 G6 put cpSGD's binomial baseline on the device."""

MECHANISM_NAMES: tuple[str, ...] = (*sorted(MECHANISMS), *SIMULATION_ONLY)
"""Every ``mechanism`` a config may name: the registered ones, then the simulation-only."""

FLEET_NAME = "sim"
"""The fleet name of every simulated fleet (topics ``fedge/sim/...``, ledger round names)."""

FLEET_BUDGET_EPSILON = 100.0
"""Each device ledger's lifetime budget on the fleet path when ``budget_epsilon`` is unset
(a device's ledger always has a finite budget; the fast path then has none)."""

DDG_SCALE = 1024
"""Default C / gamma of mechanism ``ddg``: a clipped sample spans 2^10 integer steps, so
rounding adds at most sqrt(k) to its L2 bound (0.3% at the CNN's k = 21,840) and its
variance is far below the noise's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """A simulated fleet. Units: clip C is an L2 norm bound per sample; noise_multiplier z
    is the noise std on the clipped sum divided by C (mechanism ``ddg``: the std of the
    summed noise divided by C, so each device's sigma is z (C/gamma) / sqrt(n) integer
    steps, n = r on the fast path (no dropouts, no colluders) and the round's honest
    members min_survivors - max_colluders, on both paths); ``ddg_gamma`` is model
    units per integer step (None: C / 1024); epsilon is reported at ``delta``.

    Every mechanism runs on both paths under the policy :func:`round_policy` maps these
    settings onto (``binomial``, cpSGD, too since issue 15 G6: its sound restricted-RDP
    event is in the device ledger). ``device-dp`` (device-level DP-FedAvg,
    ``edge_sdk.mechanisms.device_dp``): ``update_clip`` is S (required), ``noise_multiplier``
    z the device-level target (the noise summed over the honest members has std z S),
    ``ddg_gamma`` its granularity (default S / :data:`DDG_SCALE`); the local round is plain
    SGD. ``weighting`` is kept as a key of the experiment files and must be ``"uniform"``: a
    sum weighted by local data size would reveal each device's m to whoever sees its upload
    (plan15 G3). ``budget_epsilon``: each device ledger's lifetime budget at ``delta``;
    unset, the fast path's ledgers have no limit and the fleet's have
    :data:`FLEET_BUDGET_EPSILON`. ``min_survivors`` and ``max_colluders``: the round
    policy's (None: SecAgg+'s threshold; 1)."""

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
    # device-dp: adaptive clipping (Andrew et al. 2021) toward this quantile of the devices'
    # update norms, S' = S exp(-lr (b_hat - quantile)); None: S fixed
    adaptive_clip_quantile: float | None = None
    adaptive_clip_lr: float = 0.2
    # device-dp: self-sampled check-ins, each member sends its data with this probability
    # by its own hidden coin (RoundPolicy.self_sample_rate); 1: always
    self_sample_rate: float = 1.0
    binomial_trials: int = 4096
    ddg_gamma: float | None = None
    backend: str = "onnx"
    threads: int = 1
    seed: int = 0
    eval_every: int = 1
    eval_batch: int = 2000
    # The fleet path (tools.fleet): device sessions with ledgers, secure aggregation.
    transport: str = "inproc"  # "inproc" (in-memory broker) | "mqtt" (a real mosquitto)
    secagg: bool | None = None  # None: on for transport "mqtt", off for "inproc"
    # the plan's secure-aggregation protocol (fleet path): "secagg+" or "amortized" (issue 18)
    secagg_protocol: str = "secagg+"
    dropout: float = 0.0  # fraction of each cohort that vanishes at a random stage (both paths)
    stage_timeout: float = 120.0  # seconds per secure-aggregation stage (a safety net)
    value_bound: float = 1.0  # uploads are clamped to [-B, B] before fixed-point encoding
    budget_epsilon: float | None = None  # each device ledger's budget (see the class)
    min_survivors: int | None = None  # the fewest uploads a round may sum (None: threshold)
    max_colluders: int = 1  # cohort members assumed to collude with the aggregator
    # buffered asynchronous rounds (FedBuff, issue 19; RoundPolicy.buffered): fleet path,
    # device-dp over secagg+ only; a member's update may lag up to max_staleness versions
    # and is weighted (1 + tau)^-staleness_exponent on the device
    buffered: bool = False
    max_staleness: int = 4
    staleness_exponent: float = 0.5
    progress: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        if self.transport not in ("inproc", "mqtt"):
            raise ValueError(f"transport must be 'inproc' or 'mqtt', got {self.transport!r}")
        if self.secagg is None:
            object.__setattr__(self, "secagg", self.transport == "mqtt")
        if self.secagg_protocol not in wire.SECAGG_PROTOCOLS:
            raise ValueError(f"secagg_protocol must be one of {list(wire.SECAGG_PROTOCOLS)}, "
                             f"got {self.secagg_protocol!r}")
        if self.secagg_protocol != "secagg+" and not self.secagg:
            raise ValueError(f"secagg_protocol {self.secagg_protocol!r} is a protocol of the "
                             "fleet path: run it with secure aggregation (--secagg)")
        elif self.transport == "mqtt" and not self.secagg:
            raise ValueError("transport 'mqtt' runs the fleet with secure aggregation; "
                             "secagg = false is only for transport 'inproc'")
        if self.buffered and not self.secagg:
            raise ValueError("buffered rounds run on the fleet path (devices train ahead "
                             "in their sessions): run them with secure aggregation "
                             "(--secagg)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
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
        if self.weighting != "uniform":
            raise ValueError(f"weighting must be 'uniform', got {self.weighting!r} (the sum "
                             "is unweighted: weights by data size would reveal each "
                             "device's m)")
        if self.mechanism not in MECHANISM_NAMES:
            raise ValueError(f"mechanism must be one of {list(MECHANISM_NAMES)}, "
                             f"got {self.mechanism!r}")
        if self.server_opt not in OPTIMIZERS:
            raise ValueError(f"server_opt must be one of {sorted(OPTIMIZERS)}, "
                             f"got {self.server_opt!r}")
        if self.quant_levels < 0:
            raise ValueError(f"quant_levels must be >= 0 (0: float32), got {self.quant_levels!r}")
        if self.mechanism not in ("gaussian", "ddg", "device-dp") and self.sparsity != 1.0:
            raise ValueError(f"mechanism {self.mechanism!r} is dense: use sparsity 1")
        if self.mechanism == "ddg":
            self.ddg_checks()
        elif self.mechanism == "device-dp":
            self.device_dp_checks()
        elif self.ddg_gamma is not None:
            raise ValueError(f"ddg_gamma applies to mechanism 'ddg' only, got mechanism "
                             f"{self.mechanism!r} with ddg_gamma={self.ddg_gamma!r}")
        if self.self_sample_rate != 1.0 and self.mechanism != "device-dp":
            raise ValueError(f"self_sample_rate applies to mechanism 'device-dp' only, got "
                             f"mechanism {self.mechanism!r} with self_sample_rate="
                             f"{self.self_sample_rate!r}")
        if self.eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every!r}")
        parse_scheme(self.partition)
        self.local()  # validates the local-round settings
        b = self.budget_epsilon
        if b is not None and not (isinstance(b, int | float) and not isinstance(b, bool)
                                  and math.isfinite(b) and b > 0):
            raise ValueError(f"budget_epsilon must be None (see SimConfig) or finite and > 0, "
                             f"got {b!r}")
        if self.cohort_size < 3:
            raise ValueError(f"a round needs a cohort of >= 3 devices (secure aggregation's "
                             f"minimum, and the round core's on both paths), participation "
                             f"* devices gives {self.cohort_size}")
        if self.secagg:
            self.fleet_checks()

    @property
    def cohort_size(self) -> int:
        return max(1, round(self.participation * self.devices))

    @property
    def gamma(self) -> float:
        """Mechanism ``ddg``'s model units per integer step: ``ddg_gamma``, or C /
        :data:`DDG_SCALE` when unset (both paths)."""
        if self.ddg_gamma is not None:
            return self.ddg_gamma
        if self.mechanism == "device-dp" and self.update_clip is not None:
            return self.update_clip / DDG_SCALE  # device-dp scales the update's bound S
        return self.clip / DDG_SCALE

    def device_dp_checks(self) -> None:
        """Raise ValueError for settings mechanism ``device-dp`` cannot run (see the class)."""
        s = self.update_clip
        if s is None or not (math.isfinite(s) and s > 0):
            raise ValueError(f"mechanism 'device-dp' needs update_clip S (the update's L2 "
                             f"bound, finite > 0), got {s!r}")
        if self.quant_levels:
            raise ValueError(f"mechanism 'device-dp' uploads integers mod 2^bits, not QSGD: "
                             f"quant_levels must be 0, got {self.quant_levels!r}")

    def ddg_checks(self) -> None:
        """Raise ValueError for settings mechanism ``ddg`` cannot run (see the module)."""
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"mechanism 'ddg' needs a finite clip > 0 (the per-sample "
                             f"integer norm bound depends on it), got {self.clip!r}")
        if self.local_steps != 1:
            raise ValueError(f"mechanism 'ddg' is one full-batch step per round (FedSGD: "
                             f"other devices' noise covers only the released sum), so "
                             f"local_steps must be 1, got {self.local_steps!r}")
        if self.quant_levels:
            raise ValueError(f"mechanism 'ddg' uploads integers mod 2^bits, not QSGD: "
                             f"quant_levels must be 0, got {self.quant_levels!r}")
        if self.update_clip is not None:
            raise ValueError(f"mechanism 'ddg' clips per sample, not the update: "
                             f"update_clip must be unset, got {self.update_clip!r}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be finite and >= 0, "
                             f"got {self.noise_multiplier!r}")
        if self.ddg_gamma is not None:
            g = self.ddg_gamma
            if isinstance(g, bool) or not (isinstance(g, int | float) and math.isfinite(g)
                                           and g > 0):
                raise ValueError(f"ddg_gamma must be finite and > 0, got {g!r}")
            if self.clip / g > 2**30:
                raise ValueError(f"clip / ddg_gamma must be <= 2^30, got {self.clip / g!r}")

    def fleet_checks(self) -> None:
        """Raise ValueError for settings the fleet path (secure aggregation) cannot run."""
        if self.mechanism in SIMULATION_ONLY:
            raise ValueError(f"secure aggregation runs mechanisms {sorted(MECHANISMS)} "
                             f"({self.mechanism} is simulation-only), got "
                             f"{self.mechanism!r}")
        if not math.isfinite(self.clip) and self.mechanism != "device-dp":  # its bound: S
            raise ValueError("secure aggregation needs a finite clip (the devices' ledgers "
                             "and the fixed-point range depend on it)")
        if not self.noise_multiplier > 0 and self.mechanism != "binomial":  # its noise: trials
            raise ValueError("the fleet path needs noise_multiplier > 0: a device's ledger "
                             "refuses a release with unbounded epsilon")
        for name in ("stage_timeout", "value_bound"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v!r}")

    def without_noise(self) -> SimConfig:
        """This run without noise: noise multiplier 0, everything else kept (seeds, cohorts,
        dropouts, clipping, compression), on the fast path, which ends with the model the
        fleet path would (tests/test_one_path.py), without a budget (no noise: no finite
        epsilon) and without progress output. The accuracy it reaches is what the noise
        costs.

        Raises:
            ValueError: a mechanism whose noise is not the noise multiplier (binomial: the
                coin flips are its noise).
        """
        if self.mechanism == "binomial":
            raise ValueError("binomial's noise is its coin flips (binomial_trials), not the "
                             "noise multiplier: no noise-free twin of the same mechanism")
        return replace(self, noise_multiplier=0.0, transport="inproc", secagg=False,
                       budget_epsilon=None, progress=False)

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
            # device-dp's noise multiplier is the device-level one, on the whole update
            # (std z S over the honest shares): its local steps are plain SGD
            noise_multiplier=0.0 if self.mechanism == "device-dp" else self.noise_multiplier,
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


def round_policy(cfg: SimConfig, sizes: list[int], *, stage_timeout: float | None = None
                 ) -> RoundPolicy:
    """The round policy both paths run ``cfg`` under, for a fleet whose local data sets
    have ``sizes`` samples (ddg's public largest and mean sizes; a simulated fleet's
    public facts). ``stage_timeout``: the fleet's (default ``cfg.stage_timeout``).

    Raises:
        ValueError: settings the round core cannot plan (``RoundPolicy`` names which).
    """
    extra: dict[str, Any] = {}
    quant_levels = cfg.quant_levels
    if cfg.mechanism == "update-noise":
        extra = {"update_clip": cfg.update_clip}
    elif cfg.mechanism == "ddg":
        extra = {"gamma": cfg.gamma, "max_local_samples": max(sizes),
                 "nominal_samples": float(np.mean(sizes))}
    elif cfg.mechanism == "binomial":  # its quant_levels are its grid levels
        extra = {"update_clip": cfg.update_clip, "trials": cfg.binomial_trials,
                 "levels": cfg.quant_levels or 127}
        quant_levels = 0
    elif cfg.mechanism == "device-dp":
        extra = {"update_clip": cfg.update_clip, "gamma": cfg.gamma,
                 "adaptive_clip_quantile": cfg.adaptive_clip_quantile,
                 "adaptive_clip_lr": cfg.adaptive_clip_lr,
                 "self_sample_rate": cfg.self_sample_rate}
    return RoundPolicy(
        fleet=FLEET_NAME, cohort_size=cfg.cohort_size,
        stage_timeout=cfg.stage_timeout if stage_timeout is None else stage_timeout,
        min_survivors=cfg.min_survivors, max_colluders=cfg.max_colluders,
        max_rounds=cfg.rounds, mechanism=cfg.mechanism, steps=cfg.local_steps,
        batch_size=cfg.batch_size, lr=cfg.lr, sampling=cfg.sampling, clip=cfg.clip,
        noise_multiplier=cfg.noise_multiplier, sparsity=cfg.sparsity,
        quant_levels=quant_levels, value_bound=cfg.value_bound,
        server_opt=cfg.server_opt, server_lr=cfg.server_lr, seed=cfg.seed,
        secagg=cfg.secagg_protocol, buffered=cfg.buffered, max_staleness=cfg.max_staleness,
        staleness_exponent=cfg.staleness_exponent, **extra)
