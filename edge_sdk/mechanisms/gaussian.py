"""Local Gaussian DP-SGD, optionally rand-k sparsified and QSGD-quantized, in fixed point.

Device half: tau steps of per-sample-clipped DP-SGD with N(0, (z C)^2) noise per step
(:func:`edge_sdk.train.local_round`; Fed-SPA's rand-k with the kept values clipped to
sqrt(p) C), then, on the round's coordinate set, QSGD (optional), a clamp to the plan's
value bound and stochastic rounding to the fixed-point grid mod 2^bits.

Privacy: the local event is :func:`edge_sdk.train.round_event` (the subsampled Gaussian
of Mironov et al. 2019 for Poisson batches, add/remove and zero-out adjacency; a
substitution Gaussian for shuffled batches), valid for any post-processing of the update.
The aggregate event is :func:`edge_sdk.privacy.aggregate.aggregate_event` with
``linear_sum=False``: QSGD, the clamp and the rounding act on each member's update before
the sum and can remove its noise, so the last-step theorem does not apply and the sum is
charged the local event (loose, never low).

Randomness (plan15 R8): everything comes from the round's ``rng``, in this order: the
local round's batches and noise, QSGD's ``rng.random``, the fixed-point rounding's
``rng.random``. The order is part of the mechanism: changing it changes every seeded run
(the fleet pins in tests/golden/onepath_pins.json catch it).

Server half: the decoded sum divided by the number of survivors (an unweighted mean),
scattered onto the coordinate set (zeros elsewhere) and shaped like the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from edge_sdk import compress
from edge_sdk.engine import Engine
from edge_sdk.fixedpoint import FixedPoint
from edge_sdk.mechanisms._layout import Layout, encode_reals, layout_of, shaped
from edge_sdk.mechanisms.base import Contribution
from edge_sdk.model import flatten_params
from edge_sdk.privacy.aggregate import aggregate_event
from edge_sdk.privacy.events import Event
from edge_sdk.train import LocalTraining, local_round, round_event
from edge_sdk.wire import GaussianParams, RoundPlan

__all__ = ["Gaussian", "GaussianDevice", "GaussianRound", "GaussianServer"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GaussianRound:
    """One round's public settings of the Gaussian mechanism.

    Attributes:
        training: the local DP-SGD settings (steps, B, lr, C, z, sampling, rand-k p).
        quant_levels: QSGD levels s (0: no quantization).
        value_bound: every encoded value is clamped to [-value_bound, value_bound].
        fixed_point: the encoding (scale, bits): residues mod 2^bits.
        dim: d, the model's parameter count.
        length: k, the number of coordinates summed (d when dense).
        cohort_size: members of the cohort (the sum of that many may not wrap).

    Raises:
        ValueError: ``length`` is not rand-k's count at p of d, or value_bound times the
            cohort does not fit the ring (a wrapped sum would decode to garbage).
    """

    training: LocalTraining
    quant_levels: int
    value_bound: float
    fixed_point: FixedPoint
    dim: int
    length: int
    cohort_size: int

    def __post_init__(self) -> None:
        p = self.training.sparsity
        k = self.dim if p == 1.0 else compress.kept_count(self.dim, p)
        if self.length != k:
            raise ValueError(f"length {self.length}, but rand-k at p = {p} of {self.dim} "
                             f"parameters keeps {k}")
        self.fixed_point.check_no_wrap(self.value_bound, self.cohort_size)

    @classmethod
    def from_plan(cls, plan: RoundPlan, *, dim: int) -> GaussianRound:
        """The settings a signed plan states, for a model of ``dim`` parameters.

        Raises:
            ValueError: settings that cannot go together (see the class).
        """
        w = plan.params  # the plan's wire record (wire.GaussianParams), checked on decode
        return cls(
            training=LocalTraining(steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                                   clip=w.clip, noise_multiplier=w.noise_multiplier,
                                   sampling=w.sampling,  # type: ignore[arg-type]
                                   sparsity=w.sparsity),
            quant_levels=w.quant_levels, value_bound=w.value_bound,
            fixed_point=FixedPoint(scale=w.scale, bits=plan.bits), dim=dim,
            length=plan.length, cohort_size=len(plan.cohort))


@dataclass(frozen=True, slots=True)
class GaussianDevice:
    """The device half (see the module docstring)."""

    params: GaussianRound

    def refusal(self, *, honest: int) -> str | None:
        """None: this mechanism's noise does not depend on the honest count's promise (its
        events are charged with what ``honest`` gives)."""
        return None

    def device_event(self, *, honest: int) -> Event | None:
        """None: per-sample clipping and noise bound one sample's influence, not the
        whole device's: no device-level theorem."""
        return None

    def events(self, *, m: int, honest: int) -> tuple[Event, Event]:
        """(local, aggregate) events over ``m`` samples; the aggregate one is the local
        one (linear_sum=False, see the module docstring)."""
        p = self.params
        event = round_event(m, p.training, p.length / p.dim)
        return event, aggregate_event(event, honest_members=honest, linear_sum=False)

    def contribute(self, *, params: Sequence[np.ndarray], data: tuple[np.ndarray, np.ndarray],
                   engine: Engine, coords: np.ndarray | None, honest: int,
                   rng: np.random.Generator) -> Contribution:
        """Train, quantize, clamp and encode (rng order: see the module docstring).

        Raises:
            edge_sdk.train.TrainingDiverged: a non-finite update (nothing to release).
        """
        p = self.params
        x, y = data
        res = local_round(engine, list(params), x, y, p.training, rng, coords=coords)
        flat = flatten_params(res.update).astype(np.float64)
        values = flat if coords is None else flat[coords]
        residues, clamped = encode_reals(values, quant_levels=p.quant_levels,
                                         value_bound=p.value_bound,
                                         fixed_point=p.fixed_point, rng=rng)
        event, aggregate = self.events(m=len(y), honest=honest)
        return Contribution(values=residues, event=event, aggregate_event=aggregate,
                            num_samples=res.num_samples, mean_loss=res.mean_loss,
                            diagnostics={"clamped": clamped})


@dataclass(frozen=True, slots=True)
class GaussianServer:
    """The server half (see the module docstring). Its state is the model's layout (the
    parameter shapes), fixed by :meth:`init`."""

    params: GaussianRound

    def init(self, params: Sequence[np.ndarray]) -> Layout:
        """The layout of the model ``params`` (graph order), which :meth:`decode` fills.

        Raises:
            ValueError: the model does not have the ``dim`` parameters of the round.
        """
        return layout_of(params, self.params.dim)

    def decode(self, total: np.ndarray, survivors: int, state: Layout, *,
               coords: np.ndarray | None) -> tuple[list[np.ndarray], Layout]:
        """The unweighted mean update of the ``survivors`` (>= 1) whose residues sum to
        ``total``, zero off the coordinate set ``coords`` (None: dense), as float32 arrays
        of the layout ``state``; the state unchanged."""
        p = self.params
        mean = p.fixed_point.decode(total, survivors) / survivors
        return shaped(mean, p.dim, coords, state), state


class Gaussian:
    """The mechanism object (registry name ``"gaussian"``)."""

    name: ClassVar[str] = "gaussian"
    Params: ClassVar[type] = GaussianParams  # what travels in RoundPlan.params
    Round: ClassVar[type] = GaussianRound  # settings read from a plan: Round.from_plan

    def device(self, params: GaussianRound) -> GaussianDevice:
        return GaussianDevice(params)

    def server(self, params: GaussianRound) -> GaussianServer:
        return GaussianServer(params)

