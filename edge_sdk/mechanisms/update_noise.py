"""Privatized FedPAQ: Gaussian noise once on the clipped update, in fixed point.

Device half: :func:`edge_sdk.train.local_round_update_noise` (Reisizadeh et al., AISTATS
2020, Alg. 2: E clipped SGD steps on a subsample of E*b records drawn without replacement,
the update clipped to L2 norm S, N(0, (z S)^2 I) added once), then QSGD (optional, Alg. 2
line 9), a clamp to the plan's value bound and stochastic rounding to the fixed-point
grid mod 2^bits.

Privacy: the local event is :func:`edge_sdk.train.update_noise_event`: the Gaussian
mechanism of substitution sensitivity 2S on the subsample, amplified by sampling without
replacement (``SampledWithoutReplacementGaussian(z / 2, E*b, m)``; Wang, Balle,
Kasiviswanathan, AISTATS 2019, the Theorem 27 RDP bound of ``privacy.rdp``; substitution
adjacency, zero-out a special case), valid for any
post-processing of the noisy update. The aggregate event is
:func:`edge_sdk.privacy.aggregate.aggregate_event` with ``linear_sum=False``: QSGD, the
clamp and the rounding act on each member's update before the sum, so the sum is charged
the local event (loose, never low). FedPAQ's own eq. (16) epsilon is a paper figure the
simulator reports as a labelled extra, never an event.

Value bound (plan15 R4): the noise std z S is far above 1 in the paper's settings (S = 1),
so a clamp at 1 would wreck utility. :func:`value_bound` is S + c z S with c the two-sided
standard normal quantile of the stated per-coordinate clamp probability
(:data:`CLAMP_PROBABILITY`): a coordinate of the noisy update is u_i + n_i with |u_i| <= S,
so P(|u_i + n_i| > bound) <= P(|n_i| > c z S) <= that probability. (With QSGD the
quantized value can exceed the noisy one by up to one level, ||x|| / s; the ``clamped``
diagnostic counts what the clamp did.) Clamping is post-processing: privacy holds either
way. :func:`fixed_point_for` picks the finest power-of-two scale at which a cohort's sum of
such values fits the ring.

Randomness (plan15 R8): everything comes from the round's ``rng``, in this order: the
subsample, the update's noise, QSGD's ``rng.random``, the fixed-point rounding's
``rng.random``: the simulator's order up to its upload, then the encoding.

Server half: the decoded sum divided by the number of survivors (an unweighted mean),
shaped like the model (dense: no rand-k).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from edge_sdk.engine import Engine
from edge_sdk.fixedpoint import FixedPoint
from edge_sdk.mechanisms._layout import Layout, encode_reals, layout_of, shaped
from edge_sdk.mechanisms.base import Contribution
from edge_sdk.model import flatten_params
from edge_sdk.privacy.aggregate import aggregate_event
from edge_sdk.privacy.events import Event
from edge_sdk.train import LocalTraining, local_round_update_noise, update_noise_event
from edge_sdk.wire import RoundPlan, UpdateNoiseParams

__all__ = [
    "CLAMP_PROBABILITY",
    "UpdateNoise",
    "UpdateNoiseDevice",
    "UpdateNoiseRound",
    "UpdateNoiseServer",
    "fixed_point_for",
    "normal_tail_quantile",
    "update_noise_params",
    "value_bound",
]

CLAMP_PROBABILITY = 1e-9
"""Default per-coordinate probability that the clamp at :func:`value_bound` bites (R4)."""


def normal_tail_quantile(p: float) -> float:
    """The smallest c (to float precision, rounded up) with P(|N(0, 1)| > c) <= ``p``.

    Bisection on ``math.erfc(c / sqrt(2))``, which is P(|N(0, 1)| > c) and falls in c.

    Raises:
        ValueError: p not in (0, 1).
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < 1:
        raise ValueError(f"probability must be in (0, 1), got {p!r}")
    lo, hi = 0.0, 40.0  # erfc(40 / sqrt 2) ~ 1e-349 < any float p
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if math.erfc(mid / math.sqrt(2.0)) <= p:
            hi = mid
        else:
            lo = mid
    return hi


def value_bound(update_clip: float, noise_multiplier: float,
                clamp_probability: float = CLAMP_PROBABILITY) -> float:
    """S + c z S, model units: every coordinate of the noisy update (clipped to L2 norm S,
    noise std z S) lies within it except with probability <= ``clamp_probability``
    (c = :func:`normal_tail_quantile`; module docstring).

    Raises:
        ValueError: S not finite and > 0, z not finite and >= 0, or a bad probability.
    """
    if not (math.isfinite(update_clip) and update_clip > 0):
        raise ValueError(f"update_clip S must be finite and > 0, got {update_clip!r}")
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
    c = normal_tail_quantile(clamp_probability)
    return update_clip + c * noise_multiplier * update_clip


def fixed_point_for(bound: float, cohort_size: int, bits: int) -> FixedPoint:
    """The finest power-of-two scale at which ``cohort_size`` values of ``|x| <= bound`` sum
    without wrapping in 2^bits (:meth:`FixedPoint.check_no_wrap`).

    Raises:
        ValueError: no scale >= 2^-60 fits (the message names the numbers).
    """
    if not (math.isfinite(bound) and bound > 0):
        raise ValueError(f"bound must be finite and > 0, got {bound!r}")
    top = (1 << (bits - 1 - (cohort_size - 1).bit_length())) - 1  # largest rounded magnitude
    exp = min(math.floor(math.log2(top / bound)) if top > 0 else -61, 52)
    for e in range(exp, max(exp - 4, -61), -1):  # log2 may be off by one at the edges
        fp = FixedPoint(scale=2.0**e, bits=bits)
        try:
            fp.check_no_wrap(bound, cohort_size)
        except ValueError:
            continue
        return fp
    raise ValueError(f"no fixed-point scale fits {cohort_size} values of |x| <= {bound} in "
                     f"{bits} bits; raise bits")


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateNoiseRound:
    """One round's public settings of the update-noise mechanism.

    Attributes:
        training: E = steps, b = batch_size, lr, per-sample clip C and z (sampling and
            sparsity at their defaults: the subsample is without replacement, dense).
        update_clip: S, the update's L2 bound (finite, > 0).
        quant_levels: QSGD levels s (0: no quantization).
        value_bound: every encoded value is clamped to [-value_bound, value_bound].
        fixed_point: the encoding (scale, bits): residues mod 2^bits.
        dim: d, the model's parameter count (every coordinate is summed).
        cohort_size: members of the cohort (the sum of that many may not wrap).

    Raises:
        ValueError: sparsity below 1, S not finite and > 0, or value_bound times the cohort
            does not fit the ring.
    """

    training: LocalTraining
    update_clip: float
    quant_levels: int
    value_bound: float
    fixed_point: FixedPoint
    dim: int
    cohort_size: int

    def __post_init__(self) -> None:
        if self.training.sparsity != 1.0:
            raise ValueError(f"update-noise is dense: sparsity must be 1, got "
                             f"{self.training.sparsity}")
        if not (math.isfinite(self.update_clip) and self.update_clip > 0):
            raise ValueError(f"update_clip S must be finite and > 0, got {self.update_clip!r}")
        self.fixed_point.check_no_wrap(self.value_bound, self.cohort_size)

    @property
    def length(self) -> int:
        """k = d: values summed per device."""
        return self.dim

    @classmethod
    def from_plan(cls, plan: RoundPlan, *, dim: int) -> UpdateNoiseRound:
        """The settings a signed plan states, for a model of ``dim`` parameters.

        Raises:
            ValueError: the plan's length is not ``dim``, or settings that cannot go
                together (see the class).
        """
        if plan.length != dim:
            raise ValueError(f"length {plan.length}, but update-noise sums all {dim} "
                             f"parameters")
        w: UpdateNoiseParams = plan.params
        return cls(
            training=LocalTraining(steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                                   clip=w.clip, noise_multiplier=w.noise_multiplier),
            update_clip=w.update_clip, quant_levels=w.quant_levels,
            value_bound=w.value_bound, fixed_point=FixedPoint(scale=w.scale, bits=plan.bits),
            dim=dim, cohort_size=len(plan.cohort))


def update_noise_params(*, steps: int, batch_size: int, lr: float, clip: float,
                        noise_multiplier: float, update_clip: float | None, quant_levels: int,
                        cohort_size: int, bits: int,
                        clamp_probability: float = CLAMP_PROBABILITY) -> UpdateNoiseParams:
    """The plan's record for these settings (the server's choice, plan15 R4): S defaults to
    E * lr * C (the radius every update lies in), the value bound is :func:`value_bound` at
    ``clamp_probability`` and the scale :func:`fixed_point_for` it, the cohort and ``bits``.
    """
    s_bound = steps * lr * clip if update_clip is None else float(update_clip)
    bound = value_bound(s_bound, noise_multiplier, clamp_probability)
    fp = fixed_point_for(bound, cohort_size, bits)
    return UpdateNoiseParams(steps=steps, batch_size=batch_size, lr=lr, clip=clip,
                             update_clip=s_bound, noise_multiplier=noise_multiplier,
                             quant_levels=quant_levels, scale=fp.scale, value_bound=bound)


@dataclass(frozen=True, slots=True)
class UpdateNoiseDevice:
    """The device half (see the module docstring)."""

    params: UpdateNoiseRound

    def refusal(self, *, honest: int) -> str | None:
        """None: this mechanism's noise does not depend on the honest count's promise (its
        events are charged with what ``honest`` gives)."""
        return None

    def device_event(self, *, honest: int) -> Event | None:
        """None: its noise is calibrated to one sample's influence on the update, not the whole
        device's: no device-level theorem."""
        return None

    def events(self, *, m: int, honest: int) -> tuple[Event, Event]:
        """(local, aggregate) events over ``m`` >= 1 samples; the aggregate one is the
        local one (linear_sum=False, see the module docstring)."""
        event = update_noise_event(m, self.params.training)
        return event, aggregate_event(event, honest_members=honest, linear_sum=False)

    def contribute(self, *, params: Sequence[np.ndarray], data: tuple[np.ndarray, np.ndarray],
                   engine: Engine, coords: np.ndarray | None, honest: int,
                   rng: np.random.Generator) -> Contribution:
        """Train, add the noise, quantize, clamp and encode (rng order: module docstring).

        Raises:
            ValueError: a coordinate set was given (the mechanism is dense).
            edge_sdk.train.TrainingDiverged: a non-finite update (nothing to release).
        """
        if coords is not None:
            raise ValueError("update-noise is dense: coords must be None")
        p = self.params
        x, y = data
        res = local_round_update_noise(engine, list(params), x, y, p.training, rng,
                                       update_clip=p.update_clip)
        values = flatten_params(res.update).astype(np.float64)
        residues, clamped = encode_reals(values, quant_levels=p.quant_levels,
                                         value_bound=p.value_bound,
                                         fixed_point=p.fixed_point, rng=rng)
        event, aggregate = self.events(m=len(y), honest=honest)
        return Contribution(values=residues, event=event, aggregate_event=aggregate,
                            num_samples=res.num_samples, mean_loss=res.mean_loss,
                            diagnostics={"clamped": clamped})


@dataclass(frozen=True, slots=True)
class UpdateNoiseServer:
    """The server half (see the module docstring). Its state is the model's layout."""

    params: UpdateNoiseRound

    def init(self, params: Sequence[np.ndarray]) -> Layout:
        """The layout of the model ``params`` (graph order), which :meth:`decode` fills.

        Raises:
            ValueError: the model does not have the ``dim`` parameters of the round.
        """
        return layout_of(params, self.params.dim)

    def decode(self, total: np.ndarray, survivors: int, state: Layout, *,
               coords: np.ndarray | None) -> tuple[list[np.ndarray], Layout]:
        """The unweighted mean update of the ``survivors`` (>= 1) whose residues sum to
        ``total``, as float32 arrays of the layout ``state``; the state unchanged.

        Raises:
            ValueError: a coordinate set was given (the mechanism is dense).
        """
        if coords is not None:
            raise ValueError("update-noise is dense: coords must be None")
        p = self.params
        mean = p.fixed_point.decode(total, survivors) / survivors
        return shaped(mean, p.dim, None, state), state


class UpdateNoise:
    """The mechanism object (registry name ``"update-noise"``)."""

    name: ClassVar[str] = "update-noise"
    Params: ClassVar[type] = UpdateNoiseParams  # what travels in RoundPlan.params
    Round: ClassVar[type] = UpdateNoiseRound  # settings read from a plan: Round.from_plan

    def device(self, params: UpdateNoiseRound) -> UpdateNoiseDevice:
        return UpdateNoiseDevice(params)

    def server(self, params: UpdateNoiseRound) -> UpdateNoiseServer:
        return UpdateNoiseServer(params)
