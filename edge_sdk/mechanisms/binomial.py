"""The cpSGD binomial mechanism: grid integers plus binomial noise, straight into the ring.

Device half: :func:`edge_sdk.train.local_round_binomial` (Agarwal, Suresh, Yu, Kumar,
McMahan, NeurIPS 2018, the baseline Fed-SPA compares against): E clipped SGD steps on a
subsample of E*b records drawn without replacement, the update clipped to L2 norm S, each
coordinate rounded without bias onto the grid of spacing g = S / levels, plus
Binomial(N, 1/2) - N/2 (N = ``trials``, even). The noisy integers are the ring's values:
no fixed point, no scale. Every integer lies in [-(levels + N/2), levels + N/2] (|u_i| <=
||u|| <= S puts the rounded value within levels grid steps; the device clamps to that
range as post-processing, which only bites if float rounding of the clip put a value a
hair above S, and the ``clamped`` diagnostic counts it), so r of them sum within
[-r (levels + N/2), r (levels + N/2)] and the plan's

    bits = ceil(log2(2 r (levels + N/2) + 1))            (:func:`ring_bits`)

hold that sum exactly: it cannot wrap, whoever drops out (fewer survivors, a narrower sum).

Privacy (:func:`round_event`): the restricted-RDP bound of :mod:`edge_sdk.privacy.binomial`
as the event :class:`~edge_sdk.privacy.events.Binomial` (a restricted Renyi moment at
:data:`~edge_sdk.privacy.binomial.BINOMIAL_ORDERS` and an additive delta0), never cpSGD's
Theorem 1 (below the true epsilon in reachable configurations; a paper figure only).
Sensitivities in grid units under SUBSTITUTION of one record (the clipped update moves by
at most 2S in L2; rounding by the coupling argument of
:meth:`~edge_sdk.privacy.binomial.CpsgdBinomial.sensitivities`): D2 = 2 levels + sqrt(d),
Dinf = 2 levels + 1, D1 = 2 levels sqrt(d) + d. Zero-out, the ledger's relation, is a
special case, so the ledger restates it unchanged. Each round is charged in full: no
amplification by the subsample is claimed (unproved for the restricted moment). The
aggregate event is the local one: no claim is made for the other members' binomial noise
in the sum (loose, never low). The ledger composes the event with the device's other
events by :class:`~edge_sdk.privacy.rdp.RdpAccountant` (sum of moments, sum of delta0,
converted at delta - sum delta0; the theorem is in :mod:`edge_sdk.privacy.rdp`).

Randomness (plan15 R8): everything comes from the round's ``rng``, in
:func:`~edge_sdk.train.local_round_binomial`'s order (the subsample, the rounding's
``rng.random``, the binomial noise): the simulator's order.

Server half: the centered residue of the survivors' sum times g, divided by the number of
survivors: the unweighted mean of the noisy quantized updates (the simulator's
``weighting = "uniform"``), shaped like the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from edge_sdk.ddp import MAX_BITS
from edge_sdk.engine import Engine
from edge_sdk.hazmat.ring import Ring
from edge_sdk.mechanisms._layout import Layout, layout_of, shaped
from edge_sdk.mechanisms.base import Contribution
from edge_sdk.privacy.binomial import CpsgdBinomial
from edge_sdk.privacy.events import Binomial as BinomialEvent
from edge_sdk.privacy.events import Event
from edge_sdk.train import LocalTraining, local_round_binomial, subsample_size
from edge_sdk.wire import BinomialParams, RoundPlan

__all__ = [
    "MAX_TRIALS",
    "MAX_WORK",
    "Binomial",
    "BinomialDevice",
    "BinomialRound",
    "BinomialServer",
    "binomial_params",
    "encode",
    "ring_bits",
    "round_event",
    "value_bound",
]

MAX_TRIALS = 1 << 20
"""The most coin flips a plan may ask for."""

MAX_WORK = 1 << 26
"""The most (2 levels + 1) x trials a plan may ask for: the event's restricted moment costs
Dinf x N per order on the device, once per setting (the experiments' defaults, 255 x 4096,
take about 2.6 s on one core; the largest the privacy review studied, 1023 x 65536, is
this bound), so a plan cannot make a device compute for hours."""


def value_bound(levels: int, trials: int) -> int:
    """levels + N/2: the largest magnitude of one device's noisy integer (module docstring)."""
    return levels + trials // 2


def ring_bits(*, cohort_size: int, levels: int, trials: int) -> int:
    """ceil(log2(2 r (levels + N/2) + 1)), exactly (integers): the fewest bits whose ring
    holds the sum of r values in [-(levels + N/2), levels + N/2] without wrapping.

    Raises:
        ValueError: bad values, or more than 62 bits needed.
    """
    for name, v, lo in (("cohort_size", cohort_size, 1), ("levels", levels, 1),
                        ("trials", trials, 2)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    bound = cohort_size * value_bound(levels, trials)
    bits = (2 * bound).bit_length()  # 2^(bits-1) <= 2 bound < 2^bits, so 2^bits >= 2 bound + 1
    if bits > MAX_BITS:
        raise ValueError(f"the sum of {cohort_size} values within +-{value_bound(levels, trials)}"
                         f" needs {bits} bits, more than {MAX_BITS}: use fewer trials or levels")
    return max(bits, 2)


def encode(integers: np.ndarray, *, levels: int, trials: int,
           bits: int) -> tuple[np.ndarray, int]:
    """(Residues mod 2^bits of ``integers`` clamped to +-(levels + N/2), how many were
    clamped): the upload. Clamping is post-processing (module docstring)."""
    bound = value_bound(levels, trials)
    ints = np.asarray(integers, dtype=np.int64)
    clamped = int(np.count_nonzero(np.abs(ints) > bound))
    ints = np.clip(ints, -bound, bound)
    return ints.view(np.uint64) & np.uint64((1 << bits) - 1), clamped


def round_event(*, trials: int, levels: int, update_clip: float, dim: int,
                sample_rate: float = 1.0) -> BinomialEvent:
    """The privacy event of one round (module docstring): substitution of one record,
    grid g = S / levels, the restricted moment and delta0 of
    :meth:`~edge_sdk.privacy.binomial.CpsgdBinomial.event` (the simulator's accounting);
    ``sample_rate`` is recorded nowhere (no amplification is claimed)."""
    return CpsgdBinomial(trials=trials, grid=update_clip / levels, dim=dim,
                         update_clip=update_clip, sample_rate=sample_rate).event()


@dataclass(frozen=True, slots=True, kw_only=True)
class BinomialRound:
    """One round's public settings of the binomial mechanism.

    Attributes:
        training: E = steps, b = batch_size, lr and per-sample clip C (dense, a
            without-replacement subsample; the noise multiplier is unused).
        update_clip: S, the update's L2 bound (model units, finite, > 0).
        trials: N, even, in [2, :data:`MAX_TRIALS`].
        levels: grid steps per S (the grid is S / levels), >= 1, with 2 levels + 1 < N
            (else the neighbours' supports can be disjoint) and (2 levels + 1) N at most
            :data:`MAX_WORK`.
        bits: the ring's exponent; at least :func:`ring_bits` of the cohort.
        dim: d, the model's parameter count (every coordinate is summed).
        cohort_size: members of the cohort.

    Raises:
        ValueError: any of the above violated (named).
    """

    training: LocalTraining
    update_clip: float
    trials: int
    levels: int
    bits: int
    dim: int
    cohort_size: int

    def __post_init__(self) -> None:
        if self.training.sparsity != 1.0:
            raise ValueError(f"binomial is dense: sparsity must be 1, got "
                             f"{self.training.sparsity}")
        if not (math.isfinite(self.update_clip) and self.update_clip > 0):
            raise ValueError(f"update_clip S must be finite and > 0, got {self.update_clip!r}")
        n, lv = self.trials, self.levels
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_TRIALS or n % 2:
            raise ValueError(f"trials must be an even integer in [2, {MAX_TRIALS}], got {n!r}")
        if isinstance(lv, bool) or not isinstance(lv, int) or not 1 <= lv or 2 * lv + 1 >= n:
            raise ValueError(f"levels must be an integer >= 1 with 2 levels + 1 < trials = {n} "
                             f"(else the shifted supports can be disjoint), got {lv!r}")
        if (2 * lv + 1) * n > MAX_WORK:
            raise ValueError(f"(2 levels + 1) x trials = {(2 * lv + 1) * n} exceeds {MAX_WORK} "
                             "(the device's cost of the privacy event): use fewer of either")
        need = ring_bits(cohort_size=self.cohort_size, levels=lv, trials=n)
        if not need <= self.bits <= MAX_BITS:
            raise ValueError(f"bits {self.bits}: the sum of {self.cohort_size} binomial uploads "
                             f"needs [{need}, {MAX_BITS}]")

    @property
    def length(self) -> int:
        """k = d: values summed per device."""
        return self.dim

    @property
    def grid(self) -> float:
        """g = S / levels, model units per integer step."""
        return self.update_clip / self.levels

    @classmethod
    def from_plan(cls, plan: RoundPlan, *, dim: int) -> BinomialRound:
        """The settings a signed plan states, for a model of ``dim`` parameters.

        Raises:
            ValueError: the plan's length is not ``dim``, or settings that cannot go
                together (see the class).
        """
        if plan.length != dim:
            raise ValueError(f"length {plan.length}, but binomial sums all {dim} parameters")
        w: BinomialParams = plan.params
        return cls(
            training=LocalTraining(steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                                   clip=w.clip, noise_multiplier=0.0),
            update_clip=w.update_clip, trials=w.trials, levels=w.levels, bits=plan.bits,
            dim=dim, cohort_size=len(plan.cohort))


def binomial_params(*, steps: int, batch_size: int, lr: float, clip: float,
                    update_clip: float | None, trials: int, levels: int,
                    cohort_size: int) -> tuple[BinomialParams, int]:
    """(The plan's record, the plan's bits) for these settings (the server's choice): S
    defaults to E * lr * C (the radius every update lies in); bits :func:`ring_bits`.

    Raises:
        ValueError: settings that cannot go together (as :class:`BinomialRound`).
    """
    s_bound = steps * lr * clip if update_clip is None else float(update_clip)
    bits = ring_bits(cohort_size=cohort_size, levels=levels, trials=trials)
    params = BinomialParams(steps=steps, batch_size=batch_size, lr=lr, clip=clip,
                            update_clip=s_bound, trials=trials, levels=levels)
    # the same checks a device makes on reading the plan
    BinomialRound(training=LocalTraining(steps=steps, batch_size=batch_size, lr=lr, clip=clip,
                                         noise_multiplier=0.0),
                  update_clip=s_bound, trials=trials, levels=levels, bits=bits, dim=1,
                  cohort_size=cohort_size)
    return params, bits


@dataclass(frozen=True, slots=True)
class BinomialDevice:
    """The device half (see the module docstring)."""

    params: BinomialRound

    def refusal(self, *, honest: int) -> str | None:
        """None: this mechanism's noise does not depend on the honest count's promise (its
        events are charged with what ``honest`` gives)."""
        return None

    def device_event(self, *, honest: int) -> Event | None:
        """None: simulation-only and per-sample: no device-level theorem."""
        return None

    def events(self, *, m: int, honest: int) -> tuple[Event, Event]:
        """(local, aggregate) events over ``m`` >= 1 samples: :func:`round_event`, the same
        for both views (no credit for the other members' noise)."""
        p = self.params
        rate = subsample_size(m, p.training) / m
        event = round_event(trials=p.trials, levels=p.levels, update_clip=p.update_clip,
                            dim=p.dim, sample_rate=rate)
        return event, event

    def contribute(self, *, params: Sequence[np.ndarray], data: tuple[np.ndarray, np.ndarray],
                   engine: Engine, coords: np.ndarray | None, honest: int,
                   rng: np.random.Generator) -> Contribution:
        """Train, round onto the grid, add the binomial noise, reduce mod 2^bits.

        Raises:
            ValueError: a coordinate set was given (the mechanism is dense).
            edge_sdk.train.TrainingDiverged: a non-finite update (nothing to release).
        """
        if coords is not None:
            raise ValueError("binomial is dense: coords must be None")
        p = self.params
        x, y = data
        res = local_round_binomial(engine, list(params), x, y, p.training, rng,
                                   trials=p.trials, levels=p.levels, update_clip=p.update_clip)
        residues, clamped = encode(res.integers, levels=p.levels, trials=p.trials, bits=p.bits)
        event, aggregate = self.events(m=len(y), honest=honest)
        return Contribution(values=residues, event=event, aggregate_event=aggregate,
                            num_samples=res.num_samples, mean_loss=res.mean_loss,
                            diagnostics={"clamped": clamped})


@dataclass(frozen=True, slots=True)
class BinomialServer:
    """The server half (see the module docstring). Its state is the model's layout."""

    params: BinomialRound

    def init(self, params: Sequence[np.ndarray]) -> Layout:
        """The layout of the model ``params`` (graph order), which :meth:`decode` fills.

        Raises:
            ValueError: the model does not have the ``dim`` parameters of the round.
        """
        return layout_of(params, self.params.dim)

    def decode(self, total: np.ndarray, survivors: int, state: Layout, *,
               coords: np.ndarray | None) -> tuple[list[np.ndarray], Layout]:
        """The unweighted mean of the ``survivors`` (>= 1) noisy quantized updates whose
        residues sum to ``total``: centered residue x g / survivors, as float32 arrays of
        the layout ``state``; the state unchanged.

        Raises:
            ValueError: a coordinate set was given (dense), or survivors < 1.
        """
        if coords is not None:
            raise ValueError("binomial is dense: coords must be None")
        if survivors < 1:
            raise ValueError(f"survivors must be >= 1, got {survivors}")
        p = self.params
        summed = Ring(bits=p.bits).to_signed(total).astype(np.float64)
        return shaped(summed * p.grid / survivors, p.dim, None, state), state


class Binomial:
    """The mechanism object (registry name ``"binomial"``)."""

    name: ClassVar[str] = "binomial"
    Params: ClassVar[type] = BinomialParams  # what travels in RoundPlan.params
    Round: ClassVar[type] = BinomialRound  # settings read from a plan: Round.from_plan

    def device(self, params: BinomialRound) -> BinomialDevice:
        return BinomialDevice(params)

    def server(self, params: BinomialRound) -> BinomialServer:
        return BinomialServer(params)
