"""One round of the aggregator, pure: who takes part, the plan they get, what the sum makes.

The round machine (``aggregator.rounds.RoundMachine``, over SecAgg+ messages) and the fast
simulator (over ``aggregator.plain_sum.PlainSum``) run a round with the same three steps
(plan15 §3.3)::

    check-ins -> eligible_devices(remaining, short)                       who may be drawn
    eligible -> draw_cohort(eligible, policy, round_id)                 who
             -> draw_plan(policy, round_id, model_version, cohort, dim,  what they are told
                          random_bytes)
    (the aggregation: SecAgg+ or PlainSum sums the survivors' ring values)
    total, survivors -> finish(plan, total, survivors, params, server half, optimizer)
                                                                         the new model

The randomness is fixed by the plan's inputs alone: the cohort is
:func:`select_cohort` (seeded by the public ``policy.seed`` and the round),
and the only draws from ``random_bytes`` are :func:`round_secrets`' two per round, in
order. A simulator that replays a seeded source therefore replays the fleet's rounds.

The mechanism is the policy's (:attr:`RoundPolicy.mechanism`), dispatched by name through
``edge_sdk.mechanisms.MECHANISMS``: its public per-round parameters travel in the plan
(:func:`mechanism_params`), and its server half, read from the plan exactly as a device
reads its device half (``edge_sdk.round.mechanism_round``), decodes the sum.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aggregator.optimizers import OPTIMIZERS, ServerOptimizer
from edge_sdk import compress, wire
from edge_sdk.fixedpoint import FixedPoint
from edge_sdk.hazmat import graph
from edge_sdk.mechanisms import ServerHalf, binomial, ddg, device_dp, update_noise
from edge_sdk.round import coordinates, has_mechanism, mechanism_round
from edge_sdk.wire import BufferOffer, GaussianParams, RoundPlan
from edge_sdk.wire.schema import Record

__all__ = [
    "Finished",
    "RoundPolicy",
    "check_plannable",
    "draw_cohort",
    "draw_offer",
    "draw_plan",
    "eligible_devices",
    "finish",
    "mechanism_params",
    "mechanisms",
    "next_update_clip",
    "round_secrets",
    "select_cohort",
    "server_half",
    "with_update_clip",
    "short_of_survivors",
    "too_few_eligible",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundPolicy:
    """How the aggregator runs rounds (validated on construction).

    Attributes:
        fleet: the fleet name (topics ``fedge/<fleet>/...``).
        cohort_size: r, devices selected per round (>= 3, secure aggregation's minimum).
        min_cohort: start a round with fewer (>= 3) once ``checkin_window`` has passed
            with at least this many eligible devices; default ``cohort_size``.
        checkin_window: seconds to wait for a full cohort once ``min_cohort`` is reached.
        stage_timeout: seconds per secure-aggregation stage.
        min_survivors: the fewest uploads ever unmasked (a round with fewer fails; the
            devices' aggregate view counts min_survivors - max_colluders members' noise
            where a theorem allows it, and devices refuse to unmask fewer); default the
            threshold.
        max_colluders: cohort members assumed to collude with the aggregator (default 1,
            sent in every plan; the aggregate view counts only the other members' noise).
            Must be below the threshold and leave min_survivors - max_colluders >= 1
            (``wire.colluder_problem``).
        max_rounds: stop starting rounds after this many (None: never stop).
        mechanism: what each device adds to the sum and what the sum means: a name of
            :func:`mechanisms` (default ``"gaussian"``); the settings below are its.
        steps, batch_size, lr, sampling, clip, noise_multiplier: the local round (clip
            inf only without noise: a non-private baseline, which only a simulation's
            unlimited ledger can run; or device-dp without local noise, which clips the
            whole update to update_clip instead).
        sparsity: rand-k kept fraction p; quant_levels: QSGD levels (0: none).
        bits: ring size of the secure sum; value_bound: each uploaded value is clamped to
            [-value_bound, value_bound]; scale: fixed-point scale (None: the largest for
            which a cohort's sum cannot wrap).
        update_clip, clamp_probability: ``"update-noise"`` only
            (``edge_sdk.mechanisms.update_noise``): S, the update's L2 bound (model units;
            None: steps * lr * clip), and the per-coordinate probability that the clamp at
            the plan's value bound bites (the plan's value bound and scale follow from
            them; ``value_bound``, ``scale`` and ``sampling`` are not used: the subsample
            is without replacement). z = ``noise_multiplier`` (noise std z S).
            ``update_clip`` is also ``"binomial"``'s S.
        trials, levels: ``"binomial"`` only (``edge_sdk.mechanisms.binomial``, cpSGD):
            N, the even number of coin flips per coordinate, and the grid steps per S
            (grid S / levels), both required; the plan's bits follow from them and the
            cohort (``bits``, ``scale``, ``value_bound``, ``sampling``, ``quant_levels``
            and ``noise_multiplier`` are not used: the noise is the binomial's).
        gamma, wrap_probability, max_local_samples, nominal_samples: ``"ddg"`` only
            (``edge_sdk.mechanisms.ddg``): model units per integer step (> 0), the
            per-round bound on the probability that the sum wraps, and the fleet's public
            largest and mean local data sizes (the ring's worst case and the decode's
            divisor; public facts, never a round's data). C = ``clip``; z =
            ``noise_multiplier`` is the std of the noise summed over the round's honest
            members (min_survivors - max_colluders, privacy review Q2) over C; ``lr`` is
            the server's FedSGD step; the plan's bits come from these (``bits``, ``scale``,
            ``value_bound``, ``steps``, ``batch_size`` and ``sampling`` are not used).
        local_noise_multiplier: ``"device-dp"`` only (``edge_sdk.mechanisms.device_dp``):
            z_l of a local DP-SGD round (per-sample clip ``clip``) when a sample-level
            local guarantee is wanted too; 0 (default): plain SGD. For ``"device-dp"``,
            ``update_clip`` is S (required), ``gamma`` (required) the model units per
            integer step, ``noise_multiplier`` z the target: the noise summed over the
            honest members (min_survivors - max_colluders) has std z S / gamma;
            ``wrap_probability`` bounds the sum's wrap per round; ``steps``,
            ``batch_size``, ``lr``, ``sampling`` the local round; ``sparsity`` rand-k (the
            plan's bits come from these: ``bits``, ``scale``, ``value_bound`` and
            ``quant_levels`` are not used).
        adaptive_clip_quantile, adaptive_clip_lr, indicator_ratio: ``"device-dp"`` only:
            adaptive clipping (Andrew et al. 2021; None: S fixed). Each round's S moves
            geometrically toward the target quantile gamma_q of the devices' update norms,
            S' = S exp(-lr (b_hat - gamma_q)) (:func:`next_update_clip`; ``update_clip``
            is the first round's S); the devices release their indicator at scale
            c = 2 r S (r = ``indicator_ratio``): the count's noise std is
            z sqrt(1 + r^2) / (2 r) devices, the update's noise grows by sqrt(1 + r^2).
        self_sample_rate: ``"device-dp"`` only: q in (0, 1] of self-sampled check-ins
            (issue 16): each member sends its data with probability q by its own hidden
            coin, the null record otherwise, its noise share either way; the device charges
            the amplified release (``privacy.SelfSampled``) and the server divides the sum
            by q times the survivors. 1 (default): always its data, no amplification.
        ring_bound: ``"device-dp"`` only: how the plan's bits bound the sum,
            ``"bounded"`` (default, deterministic) or ``"rotated"`` (the rotation's
            sub-Gaussian tail: fewer bits; ``device_dp.ring_bits`` says when it holds).
        degree, threshold: SecAgg+ neighbourhood (None: ``secagg`` defaults).
        secagg: the plan's secure-aggregation protocol (``wire.SECAGG_PROTOCOLS``):
            ``"secagg+"`` (default) or ``"amortized"`` (pairwise seeds from enrollment: no
            per-round keys or shares, so an upload is little more than the masked vector;
            only a semi-honest aggregator, and a dropped device's neighbours must all
            answer the reveal; see ``edge_sdk.secagg``).
        server_opt, server_lr: server optimizer from ``aggregator.optimizers.OPTIMIZERS``.
        seed: seeds the cohort selection (with the round id).
        max_packet: largest MQTT payload the devices may send (their chunk size).
        buffered, max_staleness, staleness_exponent: buffered asynchronous rounds (FedBuff,
            Nguyen et al. 2022; issue 19; default False: synchronous rounds). The machine
            publishes a ``wire.BufferOffer`` (retained) with every plan setting; devices
            train ahead on the newest model they hold and say ``Ready``; a round starts
            as soon as ``cohort_size`` eligible devices hold an update at most
            ``max_staleness`` versions behind the current model (the longest-waiting
            first), and each member weights its clipped update by (1 + tau)^-a,
            a = ``staleness_exponent``, before noise and masking. ``"device-dp"`` over
            ``"secagg+"`` with fixed clipping only (the device must train before the
            round's plan exists; the weight must not move the indicator of adaptive
            clipping).
        sum_cohort: the most uploads one decoded sum may hold, >= cohort_size (None:
            cohort_size). A gateway that forwards its cohort's sum to a site
            (``aggregator.site``) sets it to the site's total, gateways x cohort_size, so
            that the site's sum of the gateways' sums cannot wrap: it sizes the
            fixed-point grid (``"gaussian"``) and the ring (``"device-dp"``), never the
            noise, which stays calibrated on this cohort's honest members alone.
    """

    fleet: str
    cohort_size: int
    min_cohort: int | None = None
    checkin_window: float = 0.0
    stage_timeout: float = 30.0
    min_survivors: int | None = None
    max_colluders: int = 1
    max_rounds: int | None = None
    mechanism: str = "gaussian"
    steps: int = 10
    batch_size: int = 16
    lr: float = 0.1
    sampling: str = "poisson"
    clip: float = 1.0
    noise_multiplier: float = 1.0
    sparsity: float = 1.0
    quant_levels: int = 0
    bits: int = 32
    value_bound: float = 1.0
    scale: float | None = None
    update_clip: float | None = None
    clamp_probability: float = update_noise.CLAMP_PROBABILITY
    gamma: float | None = None
    wrap_probability: float = ddg.WRAP_PROBABILITY
    max_local_samples: int | None = None
    nominal_samples: float | None = None
    trials: int | None = None
    levels: int | None = None
    local_noise_multiplier: float = 0.0
    adaptive_clip_quantile: float | None = None
    adaptive_clip_lr: float = 0.2
    indicator_ratio: float = 0.4
    self_sample_rate: float = 1.0
    ring_bound: str = "bounded"
    degree: int | None = None
    threshold: int | None = None
    secagg: str = "secagg+"
    server_opt: str = "fedavg"
    server_lr: float = 1.0
    seed: int = 0
    sum_cohort: int | None = None
    max_packet: int = wire.DEFAULT_MAX_PACKET
    buffered: bool = False
    max_staleness: int = 4
    staleness_exponent: float = 0.5

    def __post_init__(self) -> None:
        wire.check_name("fleet", self.fleet)
        if not (isinstance(self.cohort_size, int) and self.cohort_size >= 3):
            raise ValueError(f"cohort_size must be an integer >= 3, got {self.cohort_size!r}")
        if self.min_cohort is not None and not 3 <= self.min_cohort <= self.cohort_size:
            raise ValueError(f"min_cohort must be in [3, cohort_size={self.cohort_size}], "
                             f"got {self.min_cohort!r}")
        if self.sum_cohort is not None and not (
                isinstance(self.sum_cohort, int) and self.sum_cohort >= self.cohort_size):
            raise ValueError(f"sum_cohort must be None or an integer >= cohort_size="
                             f"{self.cohort_size}, got {self.sum_cohort!r}")
        for name in ("checkin_window", "stage_timeout"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
        if not self.stage_timeout > 0:
            raise ValueError(f"stage_timeout must be > 0, got {self.stage_timeout!r}")
        if self.max_rounds is not None and self.max_rounds < 0:
            raise ValueError(f"max_rounds must be None or >= 0, got {self.max_rounds!r}")
        if self.mechanism not in mechanisms():
            raise ValueError(f"mechanism must be one of {list(mechanisms())} (the mechanisms "
                             f"this aggregator can plan), got {self.mechanism!r}")
        if self.sampling not in ("poisson", "shuffle"):
            raise ValueError(f"sampling must be 'poisson' or 'shuffle', got {self.sampling!r}")
        plain_local = self.mechanism == "device-dp" and self.local_noise_multiplier == 0
        if not (self.clip > 0 and (math.isfinite(self.clip) or self.noise_multiplier == 0
                                   or plain_local)):
            # inf only for a non-private baseline (no noise: epsilon inf, which no device
            # budget can pay; a simulator's unlimited Book only, plan15 R5), or device-dp
            # with plain local SGD, whose noise (std z S) is on the whole clipped update
            raise ValueError(f"clip must be finite and > 0 (inf only with noise_multiplier "
                             f"0), got {self.clip!r}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(
                f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier!r}")
        if not 0 < self.sparsity <= 1:
            raise ValueError(f"sparsity must be in (0, 1], got {self.sparsity!r}")
        if not (math.isfinite(self.value_bound) and self.value_bound > 0):
            raise ValueError(f"value_bound must be finite and > 0, got {self.value_bound!r}")
        self._check_mechanism_settings()
        if self.secagg not in wire.SECAGG_PROTOCOLS:
            raise ValueError(f"secagg must be one of {list(wire.SECAGG_PROTOCOLS)}, "
                             f"got {self.secagg!r}")
        if self.server_opt not in OPTIMIZERS:
            raise ValueError(f"server_opt must be one of {sorted(OPTIMIZERS)}, "
                             f"got {self.server_opt!r}")
        k = self.config_degree(self.cohort_size)
        t = self.config_threshold(k)
        if not 2 * t > k or t > k:
            raise ValueError(f"threshold must be in (degree/2, degree] = ({k / 2}, {k}], got {t}")
        s = self.survivors_needed(self.min_cohort or self.cohort_size)
        if not t <= s <= (self.min_cohort or self.cohort_size):
            raise ValueError(f"min_survivors must be in [threshold={t}, min cohort], got {s}")
        n_min = self.min_cohort or self.cohort_size  # the smallest cohort has the lowest t
        problem = wire.colluder_problem(
            self.max_colluders, threshold=self.config_threshold(self.config_degree(n_min)),
            min_survivors=s)
        if problem:
            raise ValueError(problem)
        FixedPoint(scale=self.fixed_point_scale(), bits=self.bits).check_no_wrap(
            self.value_bound, self.ring_cohort)
        self._check_buffered()

    def _check_buffered(self) -> None:
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got "
                             f"{self.max_staleness!r}")
        a = self.staleness_exponent
        if not (isinstance(a, int | float) and 0 <= a <= 8):
            raise ValueError(f"staleness_exponent must be in [0, 8], got {a!r}")
        if not self.buffered:
            return
        why = []
        if self.mechanism != "device-dp":
            why.append(f"mechanism {self.mechanism!r} (device-dp only: its device trains "
                       f"before the plan exists)")
        if self.secagg != "secagg+":
            why.append(f"secagg {self.secagg!r} (secagg+ only)")
        if self.adaptive_clip_quantile is not None:
            why.append("adaptive clipping (the weight would move its indicator)")
        if self.min_cohort not in (None, self.cohort_size):
            why.append(f"min_cohort {self.min_cohort} (a buffer closes at cohort_size "
                       f"{self.cohort_size})")
        if why:
            raise ValueError("buffered rounds cannot go with " + "; ".join(why))

    def _check_mechanism_settings(self) -> None:
        """The update-noise, ddg and binomial settings (see the class): each valid on its
        own, each only with its mechanisms, and what the mechanism needs present."""
        for name in ("clamp_probability", "wrap_probability"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1):
                raise ValueError(f"{name} must be in (0, 1), got {v!r}")
        for name in ("update_clip", "gamma", "nominal_samples"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be None or finite and > 0, got {v!r}")
        m = self.max_local_samples
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_local_samples must be None or an integer >= 1, got {m!r}")
        for name in ("trials", "levels"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {v!r}")
        z_l = self.local_noise_multiplier
        if isinstance(z_l, bool) or not isinstance(z_l, (int, float)) or not (
                math.isfinite(z_l) and z_l >= 0):
            raise ValueError(f"local_noise_multiplier must be finite and >= 0, got {z_l!r}")
        own = {"update_clip": ("update-noise", "binomial", "device-dp"),
               "gamma": ("ddg", "device-dp"),
               "max_local_samples": ("ddg",), "nominal_samples": ("ddg",),
               "trials": ("binomial",), "levels": ("binomial",)}
        for name, mechs in own.items():
            if getattr(self, name) is not None and self.mechanism not in mechs:
                raise ValueError(f"{name} is a setting of mechanism "
                                 f"{' and '.join(map(repr, mechs))}, but mechanism "
                                 f"is {self.mechanism!r}: remove {name}")
        if z_l and self.mechanism != "device-dp":
            raise ValueError(f"local_noise_multiplier is a setting of mechanism 'device-dp', "
                             f"but mechanism is {self.mechanism!r}: remove it")
        q = self.adaptive_clip_quantile
        if q is not None:
            if self.mechanism != "device-dp":
                raise ValueError(f"adaptive_clip_quantile is a setting of mechanism "
                                 f"'device-dp', but mechanism is {self.mechanism!r}")
            if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q < 1:
                raise ValueError(f"adaptive_clip_quantile must be in (0, 1), got {q!r}")
        for name in ("adaptive_clip_lr", "indicator_ratio"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v!r}")
        r = self.self_sample_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"self_sample_rate must be in (0, 1], got {r!r}")
        if r != 1 and self.mechanism != "device-dp":
            raise ValueError(f"self_sample_rate is a setting of mechanism 'device-dp', but "
                             f"mechanism is {self.mechanism!r}: remove it")
        if self.ring_bound not in device_dp.RING_BOUNDS:
            raise ValueError(f"ring_bound must be one of {device_dp.RING_BOUNDS}, "
                             f"got {self.ring_bound!r}")
        if self.ring_bound != "bounded" and self.mechanism != "device-dp":
            raise ValueError(f"ring_bound is a setting of mechanism 'device-dp', but "
                             f"mechanism is {self.mechanism!r}: remove it")
        if self.mechanism == "device-dp":
            if self.quant_levels:
                raise ValueError(f"mechanism 'device-dp' uploads integers, not QSGD: "
                                 f"quant_levels must be 0, got {self.quant_levels!r}")
            for name in ("update_clip", "gamma"):
                if getattr(self, name) is None:
                    raise ValueError(f"mechanism 'device-dp' needs {name}, got None")
            if self.update_clip / self.gamma > 2**30:
                raise ValueError(f"update_clip / gamma must be <= 2^30, got "
                                 f"{self.update_clip / self.gamma!r}")
        if self.mechanism in ("update-noise", "binomial") and self.sparsity != 1.0:
            raise ValueError(f"mechanism {self.mechanism!r} is dense: sparsity must be 1, "
                             f"got {self.sparsity!r}")
        if self.mechanism == "binomial":
            if self.quant_levels:
                raise ValueError(f"mechanism 'binomial' uploads integers, not QSGD: "
                                 f"quant_levels must be 0, got {self.quant_levels!r}")
            for name in ("trials", "levels"):
                if getattr(self, name) is None:
                    raise ValueError(f"mechanism 'binomial' needs {name} (its noise and grid), "
                                     "got None")
            s_bound = (self.steps * self.lr * self.clip if self.update_clip is None
                       else self.update_clip)
            if not math.isfinite(s_bound):
                raise ValueError(f"mechanism 'binomial' needs a finite update_clip S (or a "
                                 f"finite clip), got {s_bound!r}")
            binomial.binomial_params(  # the checks a device makes on the plan, now
                steps=self.steps, batch_size=self.batch_size, lr=float(self.lr),
                clip=float(self.clip), update_clip=self.update_clip, trials=self.trials,
                levels=self.levels, cohort_size=self.cohort_size)
        if self.mechanism == "ddg":
            if self.quant_levels:
                raise ValueError(f"mechanism 'ddg' uploads integers, not QSGD: quant_levels "
                                 f"must be 0, got {self.quant_levels!r}")
            for name in ("gamma", "max_local_samples", "nominal_samples"):
                if getattr(self, name) is None:
                    raise ValueError(f"mechanism 'ddg' needs {name} (a public fact the "
                                     f"round's noise, ring or decode rests on), got None")
            if self.nominal_samples > self.max_local_samples:
                raise ValueError(f"nominal_samples (the fleet's mean local data size) must "
                                 f"be <= max_local_samples={self.max_local_samples}, "
                                 f"got {self.nominal_samples!r}")

    def config_degree(self, n: int) -> int:
        if self.degree is None:
            return graph.default_degree(n)
        return min(n - 1, self.degree + self.degree % 2)

    def config_threshold(self, degree: int) -> int:
        return graph.default_threshold(degree) if self.threshold is None else self.threshold

    def survivors_needed(self, n: int) -> int:
        if self.min_survivors is not None:
            return self.min_survivors
        return self.config_threshold(self.config_degree(n))

    @property
    def ring_cohort(self) -> int:
        """The uploads one decoded sum may hold: ``sum_cohort``, else ``cohort_size``."""
        return self.cohort_size if self.sum_cohort is None else self.sum_cohort

    def fixed_point_scale(self) -> float:
        if self.scale is not None:
            return self.scale
        # two bits of margin below the exact bound, so that no float rounding of
        # value_bound * scale can push the sum across the sign bit
        cohort_bits = (self.ring_cohort - 1).bit_length()
        return min(2.0 ** (self.bits - 3 - cohort_bits), 2.0**52) / self.value_bound


def select_cohort(names: Sequence[str], size: int, *, seed: int,
                  round_id: int) -> tuple[str, ...]:
    """``size`` distinct names out of ``names``, uniformly without replacement (zCDP paper
    Alg. 1 line 2), sorted.

    The draw is ``default_rng([seed, round_id]).choice`` over the names in sorted order, so
    it depends only on the seed, the round and the set of names: the round machine's cohort
    (``RoundPolicy.seed``; a deployment's seed is public, the cohort is not secret) and the
    fast simulator's are the same draw.
    """
    pool = sorted(names)
    if len(set(pool)) != len(pool):
        raise ValueError(f"device names must be distinct, got {len(pool)} names with repeats")
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= len(pool):
        raise ValueError(f"cohort size must be an integer in [1, {len(pool)}] (the names "
                         f"given), got {size!r}")
    rng = np.random.default_rng([seed, round_id])
    return tuple(sorted(pool[i] for i in rng.choice(len(pool), size, replace=False)))


def round_secrets(random_bytes: Callable[[int], bytes]) -> tuple[bytes, bytes]:
    """A round's (round_seed, nonce), 32 bytes each, drawn from ``random_bytes`` in that
    order: the only draws an ``aggregator.rounds.RoundMachine`` makes from its source, one
    pair per round it starts (a simulator that replays a seeded source replays the rounds'
    seeds)."""
    round_seed = random_bytes(32)
    return round_seed, random_bytes(32)


# ---------------------------------------------------------------------------- mechanisms


def _gaussian(policy: RoundPolicy, dim: int, cohort_size: int) -> tuple[Record, int, int]:
    k = dim if policy.sparsity == 1.0 else compress.kept_count(dim, policy.sparsity)
    return GaussianParams(
        steps=policy.steps, batch_size=policy.batch_size, lr=float(policy.lr),
        sampling=policy.sampling, clip=float(policy.clip),
        noise_multiplier=float(policy.noise_multiplier), sparsity=float(policy.sparsity),
        quant_levels=policy.quant_levels, scale=float(policy.fixed_point_scale()),
        value_bound=float(policy.value_bound)), k, policy.bits


def _update_noise(policy: RoundPolicy, dim: int, cohort_size: int) -> tuple[Record, int, int]:
    params = update_noise.update_noise_params(
        steps=policy.steps, batch_size=policy.batch_size, lr=float(policy.lr),
        clip=float(policy.clip), noise_multiplier=float(policy.noise_multiplier),
        update_clip=policy.update_clip, quant_levels=policy.quant_levels,
        cohort_size=cohort_size, bits=policy.bits,
        clamp_probability=policy.clamp_probability)
    return params, dim, policy.bits


def _ddg(policy: RoundPolicy, dim: int, cohort_size: int) -> tuple[Record, int, int]:
    # sigma on the shares certainly in the sum from honest members (privacy review Q2):
    # the devices account the same count (edge_sdk.round.honest_members, never more)
    honest = policy.survivors_needed(cohort_size) - policy.max_colluders
    assert policy.gamma is not None and policy.max_local_samples is not None  # __post_init__
    assert policy.nominal_samples is not None
    params, bits, length = ddg.ddg_public(
        noise_multiplier=float(policy.noise_multiplier), clip=float(policy.clip),
        gamma=float(policy.gamma), sparsity=float(policy.sparsity), lr=float(policy.lr),
        dim=dim, cohort_size=cohort_size, honest=honest,
        nominal_samples=float(policy.nominal_samples),
        max_local_samples=policy.max_local_samples, wrap_probability=policy.wrap_probability)
    return params, length, bits


def _binomial(policy: RoundPolicy, dim: int, cohort_size: int) -> tuple[Record, int, int]:
    assert policy.trials is not None and policy.levels is not None  # __post_init__
    params, bits = binomial.binomial_params(
        steps=policy.steps, batch_size=policy.batch_size, lr=float(policy.lr),
        clip=float(policy.clip), update_clip=policy.update_clip, trials=policy.trials,
        levels=policy.levels, cohort_size=cohort_size)
    return params, dim, bits


def _device_dp(policy: RoundPolicy, dim: int, cohort_size: int) -> tuple[Record, int, int]:
    # sigma on the honest shares the devices account and check (privacy review Q2)
    honest = policy.survivors_needed(cohort_size) - policy.max_colluders
    assert policy.update_clip is not None and policy.gamma is not None  # __post_init__
    params, bits, length = device_dp.device_dp_public(
        steps=policy.steps, batch_size=policy.batch_size, lr=float(policy.lr),
        # the wire's local_clip is finite; with plain local SGD the device ignores it
        # (DeviceDpParams), so an unbounded per-sample clip travels as S
        sampling=policy.sampling,
        local_clip=float(policy.clip if math.isfinite(policy.clip) else policy.update_clip),
        local_noise_multiplier=float(policy.local_noise_multiplier),
        update_clip=float(policy.update_clip), gamma=float(policy.gamma),
        noise_multiplier=float(policy.noise_multiplier), sparsity=float(policy.sparsity),
        # the ring holds every upload a decoded sum may add up (a site's: sum_cohort)
        dim=dim, cohort_size=max(cohort_size, policy.ring_cohort), honest=honest,
        wrap_probability=policy.wrap_probability, ring_bound=policy.ring_bound,
        indicator_scale=(0.0 if policy.adaptive_clip_quantile is None
                         else 2.0 * policy.indicator_ratio * float(policy.update_clip)),
        sample_rate=float(policy.self_sample_rate))
    return params, length, bits


# How the aggregator states each mechanism's public settings for a round: (policy, d, the
# cohort's size) -> (the plan's params record, the number of values summed, the ring's bits).
_PUBLIC: dict[str, Callable[[RoundPolicy, int, int], tuple[Record, int, int]]] = {
    "gaussian": _gaussian, "update-noise": _update_noise, "ddg": _ddg, "binomial": _binomial,
    "device-dp": _device_dp}


def mechanisms() -> tuple[str, ...]:
    """The mechanisms this aggregator can plan (sorted): registered in
    ``edge_sdk.mechanisms.MECHANISMS``, readable from a plan, and with public settings
    here."""
    return tuple(sorted(n for n in _PUBLIC if has_mechanism(n)))


def mechanism_params(policy: RoundPolicy, *, dim: int,
                     cohort_size: int | None = None) -> tuple[Record, int, int]:
    """(The plan's ``params`` record for ``policy.mechanism``, the plan's ``length``: how
    many ring values each device adds, the plan's ``bits``) for a model of ``dim``
    parameters and a cohort of ``cohort_size`` (default ``policy.cohort_size``).

    Raises:
        ValueError: the settings cannot be planned for this model and cohort (ddg: more
            than 62 bits needed; update-noise: no fixed-point scale fits), named.
    """
    n = policy.cohort_size if cohort_size is None else cohort_size
    return _PUBLIC[policy.mechanism](policy, dim, n)


def check_plannable(policy: RoundPolicy, *, dim: int) -> None:
    """Raise ValueError unless every cohort size a round of ``policy`` can have
    (min_cohort..cohort_size) can be planned for a model of ``dim`` parameters, so that no
    round start meets the error later."""
    for n in range(policy.min_cohort or policy.cohort_size, policy.cohort_size + 1):
        mechanism_params(policy, dim=dim, cohort_size=n)


# ---------------------------------------------------------------------------- the round


def eligible_devices(remaining: Mapping[str, float], *,
                     short: Mapping[str, float] | None = None) -> list[str]:
    """The devices a round may select (sorted), from each one's ``remaining`` epsilon (its
    ledger's figure, as its check-in states it; math.inf: no limit).

    A device is eligible while its remaining epsilon is above zero and, if it declined a
    round for budget, above ``short[device]``, the remaining epsilon it had when it was
    selected for that round: a ledger only grows, so until its budget is raised the device
    cannot pay for a round of this policy's cost (a cost the aggregator cannot compute: it
    depends on the device's data and its whole history of events) and would decline again,
    while the members who can pay would train, reserve and spend for a round too short of
    answers to complete. The round machine and the fast simulator both keep ``short``
    (set on a ``"budget"`` decline) and select from this list."""
    short = short or {}
    return sorted(n for n, r in remaining.items()
                  if r > 0 and (n not in short or r > short[n]))


def too_few_eligible(count: int, *, policy: RoundPolicy) -> str | None:
    """Why no round can start with ``count`` eligible devices (:func:`eligible_devices`), or None:
    fewer than the policy's min_cohort (default cohort_size). When every device has checked
    in, the fleet's rounds are over (the fleet ends with this note)."""
    least = policy.min_cohort or policy.cohort_size
    if count < least:
        return (f"devices with budget for a round: {count}, fewer than the min cohort "
                f"{least}; no round can start")
    return None


def draw_cohort(eligible: Sequence[str], *, policy: RoundPolicy,
                round_id: int) -> tuple[str, ...]:
    """Round ``round_id``'s cohort (sorted): ``min(cohort_size, len(eligible))`` of the
    ``eligible`` devices, uniformly without replacement (``select_cohort`` seeded by
    ``policy.seed`` and the round)."""
    n = min(policy.cohort_size, len(eligible))
    return select_cohort(eligible, n, seed=policy.seed, round_id=round_id)


def draw_plan(policy: RoundPolicy, *, round_id: int, model_version: int,
              cohort: tuple[str, ...], dim: int,
              random_bytes: Callable[[int], bytes],
              round_seed: bytes | None = None) -> RoundPlan:
    """Round ``round_id``'s plan (unsigned) for ``cohort``, training from model
    ``model_version`` of ``dim`` parameters: the mechanism's public settings
    (:func:`mechanism_params`), the round's secrets (:func:`round_secrets`, the round's
    only draws from ``random_bytes``) and the SecAgg+ settings of a cohort of that size.
    ``round_seed``: a gateway's round takes its site's seed (``aggregator.site``), and
    draws only the nonce."""
    n = len(cohort)
    params, length, bits = mechanism_params(policy, dim=dim, cohort_size=n)
    if round_seed is None:
        round_seed, nonce = round_secrets(random_bytes)
    else:
        nonce = random_bytes(32)
    degree = policy.config_degree(n)
    return RoundPlan(
        round_id=round_id, model_version=model_version, cohort=cohort,
        mechanism=policy.mechanism, params=params, round_seed=round_seed, bits=bits,
        length=length, nonce=nonce, degree=degree,
        threshold=policy.config_threshold(degree), min_survivors=policy.survivors_needed(n),
        max_colluders=policy.max_colluders, stage_timeout=float(policy.stage_timeout),
        secagg=policy.secagg)


def draw_offer(policy: RoundPolicy, *, dim: int, generation: int = 1) -> BufferOffer:
    """The offer (unsigned) of a buffered fleet (``policy.buffered``): every setting its
    rounds' plans (:func:`draw_plan` with a cohort of ``cohort_size``) will carry, so a
    device can reserve a round's spend and train before any plan exists. ``generation``:
    the offer's round id (>= 1)."""
    n = policy.cohort_size
    params, length, bits = mechanism_params(policy, dim=dim, cohort_size=n)
    degree = policy.config_degree(n)
    return BufferOffer(
        round_id=generation, mechanism=policy.mechanism, params=params, bits=bits,
        length=length, degree=degree, threshold=policy.config_threshold(degree),
        min_survivors=policy.survivors_needed(n), max_colluders=policy.max_colluders,
        stage_timeout=float(policy.stage_timeout), secagg=policy.secagg, buffer_size=n,
        max_staleness=policy.max_staleness,
        staleness_exponent=float(policy.staleness_exponent))


def short_of_survivors(stage: str, answered: int, *, min_survivors: int,
                       why: str = "all answered") -> str | None:
    """Why a round fails when ``answered`` devices answered collecting stage ``stage``
    (a ``ServerStage`` value before the unmask stage) by the time it closes (``why``), or
    None: fewer than the plan's ``min_survivors`` (the devices' aggregate view is
    accounted on at least that many, and they refuse to unmask fewer). The round machine
    checks it before secure aggregation closes the stage; the fast simulator with
    ``PlainSum.answered``."""
    if answered < min_survivors:
        return (f"{stage}: {answered} devices answered by the {why}, "
                f"below min_survivors {min_survivors}")
    return None


def next_update_clip(policy: RoundPolicy, update_clip: float, quantile: float | None,
                     ) -> float:
    """Adaptive clipping's next S (Andrew et al. 2021, geometric update): S exp(-lr (b_hat -
    gamma_q)) from the round's noised fraction ``quantile`` b_hat of devices whose update
    norm was <= S; S unchanged without adaptive clipping or without a fraction (a failed
    round). Post-processing of the released sum: no privacy cost."""
    if policy.adaptive_clip_quantile is None or quantile is None:
        return update_clip
    return update_clip * math.exp(-policy.adaptive_clip_lr
                                  * (quantile - policy.adaptive_clip_quantile))


def with_update_clip(policy: RoundPolicy, update_clip: float) -> RoundPolicy:
    """``policy`` for a round at clip S = ``update_clip`` (adaptive clipping), gamma scaled
    with it so that S / gamma, and with it the integer grid and the ring, stay the plan's."""
    if policy.update_clip is None or update_clip == policy.update_clip:
        return policy
    assert policy.gamma is not None  # device-dp: __post_init__
    return dataclasses.replace(policy, update_clip=update_clip,
                               gamma=policy.gamma * update_clip / policy.update_clip)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    """What a completed round makes: ``params`` (float32, graph order), the optimizer's
    new ``opt_state``, ``delta``, the decoded model delta the optimizer applied, and
    ``quantile``, adaptive clipping's noised fraction b_hat (None without it), which
    :func:`next_update_clip` turns into the next round's S."""

    params: list[np.ndarray]
    opt_state: Any
    delta: list[np.ndarray]
    quantile: float | None = None


def server_half(plan: RoundPlan, *, dim: int) -> ServerHalf:
    """The server half of ``plan``'s mechanism, for a model of ``dim`` parameters.

    Raises:
        ValueError: the plan's mechanism is not in this build, or its settings cannot go
            together.
    """
    mechanism, settings = mechanism_round(plan, dim=dim)
    return mechanism.server(settings)


def finish(plan: RoundPlan, total: np.ndarray, survivors: int, *,
           params: Sequence[np.ndarray], server: ServerHalf, optimizer: ServerOptimizer,
           opt_state: Any) -> Finished:
    """The new model of a round: the ``survivors`` (>= 1) whose ring values sum to
    ``total`` (mod 2^plan.bits), decoded by the mechanism's ``server`` half (on the plan's
    coordinate set) into a delta, which ``optimizer`` applies to the global ``params`` from
    state ``opt_state``."""
    if isinstance(survivors, bool) or not isinstance(survivors, int) or survivors < 1:
        raise ValueError(f"survivors must be an integer >= 1, got {survivors!r}")
    model = [np.asarray(p, dtype=np.float32) for p in params]
    dim = sum(p.size for p in model)
    delta, _ = server.decode(total, survivors, server.init(model),
                             coords=coordinates(plan, dim=dim))
    new, state = optimizer.update(delta, opt_state, model)
    return Finished(params=[np.asarray(p, dtype=np.float32) for p in new], opt_state=state,
                    delta=delta, quantile=server.quantile(total, survivors))
