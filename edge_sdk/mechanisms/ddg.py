"""FedSGD with the distributed discrete Gaussian: integers straight into the ring.

Device half: :func:`edge_sdk.train.local_round_ddg` (Kairouz, Liu, Steinke, ICML 2021,
sample level): every local sample's gradient, restricted to the round's rand-k set, is
clipped to C, scaled by 1/gamma and conditionally rounded on its own
(:func:`edge_sdk.ddp.round_rows`), so one sample moves the device's integer sum by at most
D2 = rounded_l2_bound(C / gamma, k, beta) in L2 (:func:`sensitivities`); the device adds
N_Z(0, sigma^2) per coordinate and uploads the residues mod 2^bits. No fixed point, no
clamp: the integers are the ring's values, and the plan's bits come from
:func:`ring_bits` (``ddp.choose_bits_bounded`` on public facts: the cohort, the fleet's
largest local data size) so the sum wraps with probability <= :data:`WRAP_PROBABILITY`.

Privacy (:func:`sample_event`): KLS 2021 Theorem 1 (the distributed discrete Gaussian's
RDP, :func:`edge_sdk.privacy.discrete.rdp_distributed_discrete_gaussian`) for one SAMPLE
of the device's data, adjacency ``"zero_out"`` (a null sample's clipped gradient is 0, its
rounded row 0, so the same D2 as add/remove; the device stays in the round and its noise
share stays in the sum, which the theorem needs: it compares x + Z with x' + Z for the
same summed noise Z). The device half never states ``"add_remove"``: the ledger's relation
is zero-out. The aggregate event (against whoever sees only the sum) counts ``devices`` =
``honest`` = min_survivors - max_colluders shares: the honest uploads certainly in the sum,
the target included (privacy review of issue 15, Q2: colluders can subtract their own
shares; an upload that drops after masking stays in the sum). The local event (against
whoever sees one upload) counts the device's own share only (devices = 1). q = 1: no
amplification by sampling is claimed. One release per round: with several local steps
only the last would provably be covered by the other devices' noise.

Randomness (plan15 R8): everything comes from the round's ``rng``, in
:func:`~edge_sdk.train.local_round_ddg`'s order (each chunk's conditional rounding, then
the noise), the simulator's order.

Server half (:func:`fedsgd_step`): the centered residue of the survivors' sum, times gamma,
divided by the survivors times the public nominal local data size, times -lr / p: the
FedSGD step along the mean clipped gradient (Fed-SPA eq. (5) for rand-k), which the server
optimizer applies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from edge_sdk import compress
from edge_sdk.ddp import DEFAULT_BETA, MAX_BITS, choose_bits_bounded, rounded_l2_bound
from edge_sdk.engine import Engine
from edge_sdk.hazmat.ring import Ring
from edge_sdk.mechanisms._layout import Layout, layout_of, shaped
from edge_sdk.mechanisms.base import Contribution
from edge_sdk.privacy.events import DistributedDiscreteGaussian, Event
from edge_sdk.train import local_round_ddg
from edge_sdk.wire import DdgParams, RoundPlan

__all__ = [
    "WRAP_PROBABILITY",
    "Ddg",
    "DdgDevice",
    "DdgRound",
    "DdgServer",
    "ddg_public",
    "device_sigma",
    "fedsgd_step",
    "max_abs_signal",
    "ring_bits",
    "sample_event",
    "sensitivities",
]

WRAP_PROBABILITY = 1e-9
"""Per round bound on the probability that the sum wraps (a union bound over 45 rounds is
still negligible)."""


def sensitivities(clip: float, gamma: float, length: int) -> tuple[float, float]:
    """(D2, D1) of one sample on the integer scale: D2 = rounded_l2_bound(C / gamma, k,
    beta) (one sample's rounded row), D1 = min(sqrt(k) D2, D2^2) (integer coordinates),
    rounded up."""
    l2 = rounded_l2_bound(clip / gamma, length, DEFAULT_BETA)
    return l2, math.nextafter(min(math.sqrt(length) * l2, l2 * l2), math.inf)


def device_sigma(noise_multiplier: float, clip: float, gamma: float, shares: int) -> float:
    """Each device's sigma (integer scale) so that ``shares`` of them sum to a noise std of
    z (C / gamma): z (C / gamma) / sqrt(shares). Calibrate ``shares`` with the honest count
    the events account (R3: min_survivors - max_colluders)."""
    return noise_multiplier * (clip / gamma) / math.sqrt(shares)


def sample_event(*, l2: float, l1: float, sigma: float, devices: int, dim: int,
                 steps: int = 1, adjacency: str) -> DistributedDiscreteGaussian:
    """The privacy event of ``steps`` rounds of one device (KLS 2021 Theorem 1), for one
    SAMPLE of its data under ``adjacency`` (required): ``"add_remove"`` or ``"zero_out"``
    (the same D2: a null sample's rounded row is 0; either way the device stays in the
    round and its noise share stays in the sum, which the bound needs), or
    ``"substitution"`` (D2 and D1 doubled). ``devices``: the honest shares certainly in
    the sum, the target included (module docstring).

    Raises:
        ValueError: an unknown adjacency (or bad values, from the event).
    """
    if adjacency not in ("add_remove", "zero_out", "substitution"):
        raise ValueError("adjacency must be 'add_remove', 'zero_out' or 'substitution', "
                         f"got {adjacency!r}")
    twice = 2.0 if adjacency == "substitution" else 1.0  # exact scaling
    return DistributedDiscreteGaussian(
        l2_sensitivity=twice * l2, l1_sensitivity=twice * l1, sigma=sigma,
        devices=devices, dim=dim, steps=steps, adjacency=adjacency)


def max_abs_signal(cohort_size: int, max_local_samples: int, l2: float) -> float:
    """Bound on every coordinate of the cohort's summed signal (integer scale): each of r
    devices sums at most the fleet's largest local data size of rows, each of L2 (so every
    coordinate's magnitude) at most D2."""
    return cohort_size * max_local_samples * l2


def ring_bits(*, signal: float, cohort_size: int, length: int, sigma: float,
              wrap_probability: float = WRAP_PROBABILITY) -> int:
    """The plan's bits: :func:`edge_sdk.ddp.choose_bits_bounded` for the summed signal bound
    ``signal`` (:func:`max_abs_signal`) and ``cohort_size`` noise shares (fewer survivors
    only narrow the noise).

    Raises:
        ValueError: more than 62 bits needed (raise gamma).
    """
    return choose_bits_bounded(signal, cohort_size, length, sigma, wrap_probability)


def fedsgd_step(total: np.ndarray, *, bits: int, gamma: float, lr: float, dim: int,
                length: int, survivors: int, nominal_samples: float) -> np.ndarray:
    """The server's step on the kept coordinates from the survivors' ring sum ``total``:
    -lr (d / k) gamma / (survivors x nominal) times the centered residue, float32."""
    summed = Ring(bits=bits).to_signed(total)
    scale = -lr * (dim / length) * gamma / (survivors * nominal_samples)
    return (scale * summed.astype(np.float64)).astype(np.float32)


def ddg_public(*, noise_multiplier: float, clip: float, gamma: float, sparsity: float,
               lr: float, dim: int, cohort_size: int, honest: int, nominal_samples: float,
               max_local_samples: int,
               wrap_probability: float = WRAP_PROBABILITY) -> tuple[DdgParams, int, int]:
    """The server's choice for one round (plan15 R3): (the plan's record, bits, length).

    sigma is calibrated on the ``honest`` = min_survivors - max_colluders shares the events
    account (:func:`device_sigma`), so the target's noise z (C / gamma) survives colluders
    and dropouts; bits on all ``cohort_size`` shares (more shares, a wider sum) and the
    public facts ``max_local_samples`` (the fleet's largest local data size) and
    ``nominal_samples`` (its mean), never a round's data.

    Raises:
        ValueError: more than 62 bits needed, or bad values (named).
    """
    if not 1 <= honest <= cohort_size:
        raise ValueError(f"honest must be in [1, cohort_size={cohort_size}], got {honest}")
    length = dim if sparsity == 1.0 else compress.kept_count(dim, sparsity)
    sigma = device_sigma(noise_multiplier, clip, gamma, honest)
    l2, _ = sensitivities(clip, gamma, length)
    bits = ring_bits(signal=max_abs_signal(cohort_size, max_local_samples, l2),
                     cohort_size=cohort_size, length=length, sigma=sigma,
                     wrap_probability=wrap_probability)
    params = DdgParams(clip=clip, gamma=gamma, sigma=sigma, sparsity=sparsity, lr=lr,
                       nominal_samples=nominal_samples)
    return params, bits, length


@dataclass(frozen=True, slots=True, kw_only=True)
class DdgRound:
    """One round's public settings of the ddg mechanism.

    Attributes:
        clip: C, per-sample L2 bound (model units, > 0).
        gamma: model units per integer step (> 0).
        sigma: each device's discrete Gaussian parameter (integer scale, >= 0).
        sparsity: rand-k kept fraction p (1: dense).
        lr: the server's FedSGD step size.
        nominal_samples: the fleet's public mean local data size (> 0).
        bits: the ring's exponent (2..62).
        dim: d, the model's parameter count.
        length: k, coordinates summed (d when dense).
        cohort_size: members of the cohort.

    Raises:
        ValueError: ``length`` is not rand-k's count at p of d, or bits beyond 62.
    """

    clip: float
    gamma: float
    sigma: float
    sparsity: float
    lr: float
    nominal_samples: float
    bits: int
    dim: int
    length: int
    cohort_size: int

    def __post_init__(self) -> None:
        p = self.sparsity
        k = self.dim if p == 1.0 else compress.kept_count(self.dim, p)
        if self.length != k:
            raise ValueError(f"length {self.length}, but rand-k at p = {p} of {self.dim} "
                             f"parameters keeps {k}")
        if not 2 <= self.bits <= MAX_BITS:
            raise ValueError(f"ddg needs bits in [2, {MAX_BITS}], got {self.bits}")

    @property
    def l2_sensitivity(self) -> float:
        """D2 (:func:`sensitivities`)."""
        return sensitivities(self.clip, self.gamma, self.length)[0]

    @property
    def l1_sensitivity(self) -> float:
        """D1 (:func:`sensitivities`)."""
        return sensitivities(self.clip, self.gamma, self.length)[1]

    @classmethod
    def from_plan(cls, plan: RoundPlan, *, dim: int) -> DdgRound:
        """The settings a signed plan states, for a model of ``dim`` parameters.

        Raises:
            ValueError: settings that cannot go together (see the class).
        """
        w: DdgParams = plan.params
        return cls(clip=w.clip, gamma=w.gamma, sigma=w.sigma, sparsity=w.sparsity, lr=w.lr,
                   nominal_samples=w.nominal_samples, bits=plan.bits, dim=dim,
                   length=plan.length, cohort_size=len(plan.cohort))


@dataclass(frozen=True, slots=True)
class DdgDevice:
    """The device half (see the module docstring)."""

    params: DdgRound

    def refusal(self, *, honest: int) -> str | None:
        """None: this mechanism's noise does not depend on the honest count's promise (its
        events are charged with what ``honest`` gives)."""
        return None

    def device_event(self, *, honest: int) -> Event | None:
        """None: per-sample clipping bounds one sample's influence, not the whole device's (its rows
        sum to up to m C): no device-level theorem."""
        return None

    def events(self, *, m: int, honest: int) -> tuple[Event, Event]:
        """(local, aggregate) events of one round, zero-out of one sample: the device's own
        share (devices = 1), and the ``honest`` = min_survivors - max_colluders shares
        certainly in the sum. Independent of ``m`` (q = 1, sample level)."""
        p = self.params
        l2, l1 = sensitivities(p.clip, p.gamma, p.length)

        def ev(devices: int) -> DistributedDiscreteGaussian:
            return sample_event(l2=l2, l1=l1, sigma=p.sigma, devices=devices, dim=p.length,
                                adjacency="zero_out")

        return ev(1), ev(honest)

    def contribute(self, *, params: Sequence[np.ndarray], data: tuple[np.ndarray, np.ndarray],
                   engine: Engine, coords: np.ndarray | None, honest: int,
                   rng: np.random.Generator) -> Contribution:
        """Round each sample's clipped gradient, sum, add the noise, reduce mod 2^bits.

        Raises:
            ValueError: ``coords`` does not match the round (None iff dense, k of them).
            edge_sdk.train.TrainingDiverged: a non-finite gradient (nothing to release).
        """
        p = self.params
        if (coords is None) != (p.sparsity == 1.0) or (
                coords is not None and len(coords) != p.length):
            raise ValueError(f"coords must be None when dense and {p.length} indices "
                             f"otherwise (sparsity {p.sparsity})")
        x, y = data
        res = local_round_ddg(engine, list(params), x, y, rng, clip=p.clip, gamma=p.gamma,
                              sigma=p.sigma, bits=p.bits, coords=coords)
        event, aggregate = self.events(m=len(y), honest=honest)
        peak = int(np.abs(res.integers).max()) if res.integers.size else 0
        return Contribution(values=res.residues, event=event, aggregate_event=aggregate,
                            num_samples=res.num_samples, mean_loss=res.mean_loss,
                            diagnostics={"max_abs_integer": peak})


@dataclass(frozen=True, slots=True)
class DdgServer:
    """The server half (see the module docstring). Its state is the model's layout."""

    params: DdgRound

    def init(self, params: Sequence[np.ndarray]) -> Layout:
        """The layout of the model ``params`` (graph order), which :meth:`decode` fills.

        Raises:
            ValueError: the model does not have the ``dim`` parameters of the round.
        """
        return layout_of(params, self.params.dim)

    def decode(self, total: np.ndarray, survivors: int, state: Layout, *,
               coords: np.ndarray | None) -> tuple[list[np.ndarray], Layout]:
        """The FedSGD step (:func:`fedsgd_step`) of the ``survivors`` (>= 1) whose residues
        sum to ``total``, zero off ``coords``, as float32 arrays of ``state``."""
        p = self.params
        if survivors < 1:
            raise ValueError(f"survivors must be >= 1, got {survivors}")
        kept = fedsgd_step(total, bits=p.bits, gamma=p.gamma, lr=p.lr, dim=p.dim,
                           length=p.length, survivors=survivors,
                           nominal_samples=p.nominal_samples)
        return shaped(kept, p.dim, coords, state), state


class Ddg:
    """The mechanism object (registry name ``"ddg"``)."""

    name: ClassVar[str] = "ddg"
    Params: ClassVar[type] = DdgParams  # what travels in RoundPlan.params
    Round: ClassVar[type] = DdgRound  # settings read from a plan: Round.from_plan

    def device(self, params: DdgRound) -> DdgDevice:
        return DdgDevice(params)

    def server(self, params: DdgRound) -> DdgServer:
        return DdgServer(params)
