"""One round of the aggregator, pure: who takes part, the plan they get, what the sum makes.

The round machine (``aggregator.rounds.RoundMachine``, over SecAgg+ messages) and the fast
simulator (over ``aggregator.plain_sum.PlainSum``) run a round with the same three steps
(plan15 §3.3)::

    eligible -> draw_cohort(eligible, policy, round_id)                 who
             -> draw_plan(policy, round_id, model_version, cohort, dim,  what they are told
                          random_bytes)
    (the aggregation: SecAgg+ or PlainSum sums the survivors' ring values)
    total, survivors -> finish(plan, total, survivors, params, server half, optimizer)
                                                                         the new model

The randomness is fixed by the plan's inputs alone: the cohort is
``aggregator.fedavg.select_cohort`` (seeded by the public ``policy.seed`` and the round),
and the only draws from ``random_bytes`` are :func:`round_secrets`' two per round, in
order. A simulator that replays a seeded source therefore replays the fleet's rounds.

The mechanism is the policy's (:attr:`RoundPolicy.mechanism`), dispatched by name through
``edge_sdk.mechanisms.MECHANISMS``: its public per-round parameters travel in the plan
(:func:`mechanism_params`), and its server half, read from the plan exactly as a device
reads its device half (``edge_sdk.round.mechanism_round``), decodes the sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aggregator.fedavg import select_cohort
from aggregator.optimizers import OPTIMIZERS, ServerOptimizer
from edge_sdk import compress, wire
from edge_sdk.fixedpoint import FixedPoint
from edge_sdk.hazmat import graph
from edge_sdk.mechanisms import ServerHalf
from edge_sdk.round import coordinates, has_mechanism, mechanism_round
from edge_sdk.wire import GaussianParams, RoundPlan
from edge_sdk.wire.schema import Record

__all__ = [
    "Finished",
    "RoundPolicy",
    "draw_cohort",
    "draw_plan",
    "finish",
    "mechanism_params",
    "mechanisms",
    "round_secrets",
    "server_half",
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
        steps, batch_size, lr, sampling, clip, noise_multiplier: the local round.
        sparsity: rand-k kept fraction p; quant_levels: QSGD levels (0: none).
        bits: ring size of the secure sum; value_bound: each uploaded value is clamped to
            [-value_bound, value_bound]; scale: fixed-point scale (None: the largest for
            which a cohort's sum cannot wrap).
        degree, threshold: SecAgg+ neighbourhood (None: ``secagg`` defaults).
        server_opt, server_lr: server optimizer from ``aggregator.optimizers.OPTIMIZERS``.
        seed: seeds the cohort selection (with the round id).
        max_packet: largest MQTT payload the devices may send (their chunk size).
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
    degree: int | None = None
    threshold: int | None = None
    server_opt: str = "fedavg"
    server_lr: float = 1.0
    seed: int = 0
    max_packet: int = wire.DEFAULT_MAX_PACKET

    def __post_init__(self) -> None:
        wire.check_name("fleet", self.fleet)
        if not (isinstance(self.cohort_size, int) and self.cohort_size >= 3):
            raise ValueError(f"cohort_size must be an integer >= 3, got {self.cohort_size!r}")
        if self.min_cohort is not None and not 3 <= self.min_cohort <= self.cohort_size:
            raise ValueError(f"min_cohort must be in [3, cohort_size={self.cohort_size}], "
                             f"got {self.min_cohort!r}")
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
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be finite and > 0, got {self.clip!r}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(
                f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier!r}")
        if not 0 < self.sparsity <= 1:
            raise ValueError(f"sparsity must be in (0, 1], got {self.sparsity!r}")
        if not (math.isfinite(self.value_bound) and self.value_bound > 0):
            raise ValueError(f"value_bound must be finite and > 0, got {self.value_bound!r}")
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
            self.value_bound, self.cohort_size)

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

    def fixed_point_scale(self) -> float:
        if self.scale is not None:
            return self.scale
        # two bits of margin below the exact bound, so that no float rounding of
        # value_bound * scale can push the sum across the sign bit
        cohort_bits = (self.cohort_size - 1).bit_length()
        return min(2.0 ** (self.bits - 3 - cohort_bits), 2.0**52) / self.value_bound


def round_secrets(random_bytes: Callable[[int], bytes]) -> tuple[bytes, bytes]:
    """A round's (round_seed, nonce), 32 bytes each, drawn from ``random_bytes`` in that
    order: the only draws an ``aggregator.rounds.RoundMachine`` makes from its source, one
    pair per round it starts (a simulator that replays a seeded source replays the rounds'
    seeds)."""
    round_seed = random_bytes(32)
    return round_seed, random_bytes(32)


# ---------------------------------------------------------------------------- mechanisms


def _gaussian(policy: RoundPolicy, dim: int) -> tuple[GaussianParams, int]:
    k = dim if policy.sparsity == 1.0 else compress.kept_count(dim, policy.sparsity)
    return GaussianParams(
        steps=policy.steps, batch_size=policy.batch_size, lr=float(policy.lr),
        sampling=policy.sampling, clip=float(policy.clip),
        noise_multiplier=float(policy.noise_multiplier), sparsity=float(policy.sparsity),
        quant_levels=policy.quant_levels, scale=float(policy.fixed_point_scale()),
        value_bound=float(policy.value_bound)), k


# How the aggregator states each mechanism's public settings for a round:
# (policy, d) -> (the plan's params record, the number of values summed).
_PUBLIC: dict[str, Callable[[RoundPolicy, int], tuple[Record, int]]] = {"gaussian": _gaussian}


def mechanisms() -> tuple[str, ...]:
    """The mechanisms this aggregator can plan (sorted): registered in
    ``edge_sdk.mechanisms.MECHANISMS``, readable from a plan, and with public settings
    here."""
    return tuple(sorted(n for n in _PUBLIC if has_mechanism(n)))


def mechanism_params(policy: RoundPolicy, *, dim: int) -> tuple[Record, int]:
    """(The plan's ``params`` record for ``policy.mechanism``, the plan's ``length``: how
    many ring values each device adds) for a model of ``dim`` parameters."""
    return _PUBLIC[policy.mechanism](policy, dim)


# ---------------------------------------------------------------------------- the round


def draw_cohort(eligible: Sequence[str], *, policy: RoundPolicy,
                round_id: int) -> tuple[str, ...]:
    """Round ``round_id``'s cohort (sorted): ``min(cohort_size, len(eligible))`` of the
    ``eligible`` devices, uniformly without replacement (``select_cohort`` seeded by
    ``policy.seed`` and the round)."""
    n = min(policy.cohort_size, len(eligible))
    return select_cohort(eligible, n, seed=policy.seed, round_id=round_id)


def draw_plan(policy: RoundPolicy, *, round_id: int, model_version: int,
              cohort: tuple[str, ...], dim: int,
              random_bytes: Callable[[int], bytes]) -> RoundPlan:
    """Round ``round_id``'s plan (unsigned) for ``cohort``, training from model
    ``model_version`` of ``dim`` parameters: the mechanism's public settings
    (:func:`mechanism_params`), the round's secrets (:func:`round_secrets`, the round's
    only draws from ``random_bytes``) and the SecAgg+ settings of a cohort of that size."""
    n = len(cohort)
    params, length = mechanism_params(policy, dim=dim)
    round_seed, nonce = round_secrets(random_bytes)
    degree = policy.config_degree(n)
    return RoundPlan(
        round_id=round_id, model_version=model_version, cohort=cohort,
        mechanism=policy.mechanism, params=params, round_seed=round_seed, bits=policy.bits,
        length=length, nonce=nonce, degree=degree,
        threshold=policy.config_threshold(degree), min_survivors=policy.survivors_needed(n),
        max_colluders=policy.max_colluders, stage_timeout=float(policy.stage_timeout))


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    """What a completed round makes: ``params`` (float32, graph order), the optimizer's
    new ``opt_state``, and ``delta``, the decoded model delta the optimizer applied."""

    params: list[np.ndarray]
    opt_state: Any
    delta: list[np.ndarray]


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
                    delta=delta)
