"""Privacy events: what a device released, as frozen data.

An event describes a mechanism and how often it ran; it computes nothing. Accountants
(:mod:`edge_sdk.privacy.rdp`, :mod:`edge_sdk.privacy.pld`, :mod:`edge_sdk.privacy.zcdp`)
interpret events, in the manner of Google ``dp_accounting``'s ``DpEvent``.

Units, for every event here: ``noise_multiplier`` z is the standard deviation of the
Gaussian noise divided by the L2 sensitivity of the query it is added to, under the
adjacency the event is stated for. ``noise_multiplier == 0`` is allowed and means no noise:
every accountant then reports an infinite epsilon.

Adjacency is data: every leaf event carries the neighbouring relation its numbers hold
under, in its ``adjacency`` field, one of

* ``"add_remove"``: D and D' differ by adding or removing one record;
* ``"substitution"``: D and D' differ by replacing one record by another;
* ``"zero_out"``: D' is D with one record replaced by the *null record*, whose clipped
  gradient is 0 (Kairouz, McMahan, Song, Thakkar, Thakurta, Xu 2021, "Practical and private
  (deep) learning without sampling or shuffling", section 2). Both neighbours have the same
  number of records, so a device may reveal its data size m without breaking it.

Which events may carry which: :class:`Gaussian` any of the three (z relative to the
sensitivity under it); :class:`PoissonSubsampledGaussian` add/remove or zero-out;
:class:`SampledWithoutReplacementGaussian` substitution or zero-out (z relative to the
substitution sensitivity, 2C for a sum of per-sample gradients clipped to C);
:class:`DistributedDiscreteGaussian` and :class:`DistributedSkellam` any of the three (their
sensitivities are stated by whoever builds them, for the relation they name; the record is
a device in :func:`edge_sdk.ddp.event`, a sample in the simulator's ``ddg`` plan: each
producer's docstring says which). Their RDP bounds are in :mod:`edge_sdk.privacy.discrete`.
:class:`SelfSampled` wraps one discrete release in which the record (a device) took part
with probability q by its own hidden coin; zero-out only (its theorem needs the null record
in the same place in both neighbours).
:class:`Binomial` (the cpSGD binomial mechanism) substitution or zero-out; it carries no
RDP curve but a restricted Renyi moment and an additive delta0
(:mod:`edge_sdk.privacy.binomial`), which only :class:`~edge_sdk.privacy.rdp.RdpAccountant`
composes.
:class:`Composed` and :class:`SelfComposed` carry no adjacency: their leaves do.

Accountants say which events they interpret (``supports(event)``) and raise
:class:`UnsupportedEventError` for any other, before any state changes.

:func:`restate` turns an event into one whose numbers hold under another adjacency, or
raises; accountants compose only events restated to their own adjacency. Its rules:

1. substitution -> zero-out, unchanged: a zero-out pair is a substitution pair (the null
   record is a record), so every substitution bound holds for it.
2. add/remove -> zero-out, unchanged, only for mechanisms that ignore the null record
   (:data:`IGNORES_NULL_RECORD`): then M(D with the null record) has exactly the law of
   M(D without the record), and a zero-out pair is an add/remove pair. Every Gaussian and
   Poisson-subsampled Gaussian event fedge emits is Gaussian noise on a sum of per-record
   clipped contributions divided by a public constant (the plan's batch size B, never the
   data size), in which a null record contributes 0 and, under Poisson sampling, is sampled
   independently of the others. A general add/remove guarantee does NOT imply zero-out.
3. add/remove or zero-out -> substitution, for :class:`Gaussian` only: by the triangle
   inequality through D without the record (or with the null record) the substitution
   sensitivity is at most twice the other, so z becomes z / 2.
4. :class:`SelfSampled` is stated under zero-out and restates to nothing else (its inner
   event stays under zero-out; see the class).
5. Anything else (zero-out or substitution -> add/remove; a subsampled event -> substitution;
   a discrete event -> substitution, or add/remove -> zero-out: a device that is the null
   record still adds its noise share, one that is absent does not) has no general sound
   conversion: :class:`UnsupportedEventError`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Literal, TypeAlias

from edge_sdk.errors import EdgeError

__all__ = [
    "ADJACENCIES",
    "IGNORES_NULL_RECORD",
    "Adjacency",
    "Binomial",
    "Composed",
    "DiscreteEvent",
    "DistributedDiscreteGaussian",
    "DistributedSkellam",
    "Event",
    "Gaussian",
    "PoissonSubsampledGaussian",
    "SampledWithoutReplacementGaussian",
    "SelfComposed",
    "SelfSampled",
    "UnsupportedEventError",
    "adjacencies_of",
    "restate",
]

Adjacency: TypeAlias = Literal["add_remove", "substitution", "zero_out"]
ADJACENCIES: tuple[Adjacency, ...] = ("add_remove", "substitution", "zero_out")


class UnsupportedEventError(EdgeError, ValueError):
    """An accountant cannot interpret this privacy event: an event type it has no theorem
    for, or one stated under an adjacency with no sound restatement under its own. Also a
    ValueError, as these were before accountants said which events they support."""


def _check_noise_multiplier(z: object) -> None:
    if isinstance(z, bool) or not isinstance(z, numbers.Real):
        raise ValueError(f"noise_multiplier must be a real number >= 0, got {z!r}")
    if not (math.isfinite(z) and z >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {z!r}")


def _check_adjacency(cls: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{cls}.adjacency must be one of {', '.join(allowed)}, got {value!r}")


def _check_count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite real number >= 0, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return v


@dataclass(frozen=True, slots=True, kw_only=True)
class Gaussian:
    """The Gaussian mechanism, no subsampling, run ``steps`` times.

    Attributes:
        noise_multiplier: noise std / L2 sensitivity under ``adjacency`` (>= 0; 0 means no
            privacy).
        steps: number of releases (>= 1).
        adjacency: the neighbouring relation the sensitivity is stated for.
    """

    noise_multiplier: float
    steps: int = 1
    adjacency: Adjacency = "add_remove"

    def __post_init__(self) -> None:
        _check_noise_multiplier(self.noise_multiplier)
        _check_count("steps", self.steps, 1)
        _check_adjacency("Gaussian", self.adjacency, ADJACENCIES)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoissonSubsampledGaussian:
    """The Gaussian mechanism on a Poisson subsample (each record kept with prob. q).

    Add/remove adjacency (DP-SGD with Poisson sampling: Abadi et al. 2016; Mironov,
    Talwar, Zhang 2019), or zero-out, under which the same bounds hold (rule 2 of the
    module docstring).

    Attributes:
        noise_multiplier: noise std / L2 sensitivity (>= 0; 0 means no privacy).
        sample_rate: the Poisson rate q in (0, 1] (q = 1 is the plain Gaussian).
        steps: number of releases (>= 1).
        adjacency: ``"add_remove"`` or ``"zero_out"``.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int = 1
    adjacency: Adjacency = "add_remove"

    def __post_init__(self) -> None:
        _check_noise_multiplier(self.noise_multiplier)
        q = self.sample_rate
        if isinstance(q, bool) or not isinstance(q, numbers.Real) or not 0 < q <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {q!r}")
        _check_count("steps", self.steps, 1)
        _check_adjacency("PoissonSubsampledGaussian", self.adjacency, ("add_remove", "zero_out"))


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledWithoutReplacementGaussian:
    """The Gaussian mechanism on a fixed-size batch drawn without replacement.

    Each release draws ``sample_size`` distinct records uniformly from ``dataset_size``.
    Substitution (replace-one) adjacency, as in Wang, Balle, Kasiviswanathan (2019), or
    zero-out, a special case of it (rule 1 of the module docstring).

    Attributes:
        noise_multiplier: noise std / L2 sensitivity under substitution (>= 0), whatever
            ``adjacency`` says: 2C is the sensitivity of a sum of gradients clipped to C.
        sample_size: the batch size B, 1 <= B <= dataset_size.
        dataset_size: the number of records m (>= 1).
        steps: number of releases (>= 1).
        adjacency: ``"substitution"`` or ``"zero_out"``.
    """

    noise_multiplier: float
    sample_size: int
    dataset_size: int
    steps: int = 1
    adjacency: Adjacency = "substitution"

    def __post_init__(self) -> None:
        _check_noise_multiplier(self.noise_multiplier)
        _check_count("dataset_size", self.dataset_size, 1)
        _check_count("sample_size", self.sample_size, 1)
        if self.sample_size > self.dataset_size:
            raise ValueError(
                f"sample_size must be <= dataset_size={self.dataset_size!r}, "
                f"got {self.sample_size!r}"
            )
        _check_count("steps", self.steps, 1)
        _check_adjacency("SampledWithoutReplacementGaussian", self.adjacency,
                         ("substitution", "zero_out"))

    @property
    def sample_rate(self) -> float:
        """The sampling fraction B / m."""
        return self.sample_size / self.dataset_size


@dataclass(frozen=True, slots=True, kw_only=True)
class DistributedDiscreteGaussian:
    """Each of ``devices`` devices adds N_Z(0, sigma^2) noise to a ``dim``-vector of integers.

    Kairouz, Liu, Steinke 2021 (distributed discrete Gaussian, DDGauss). Only the sum of
    the devices' vectors is released (secure aggregation). Units: the integer scale of
    :mod:`edge_sdk.ddp`; ``sigma`` is per device. RDP:
    :func:`edge_sdk.privacy.discrete.rdp_distributed_discrete_gaussian`.

    Attributes:
        l2_sensitivity: D2, bound on ||v - v'||_2 on the integer scale (>= 0).
        l1_sensitivity: D1, bound on ||v - v'||_1 on the integer scale (>= 0); for integer
            vectors min(sqrt(dim) D2, D2^2) always holds.
        sigma: per-device discrete Gaussian parameter, integer scale (>= 0; 0: no privacy).
        devices: n, the noise shares certainly in the released sum that the adversary
            cannot subtract (>= 1): honest uploads, the target included, i.e.
            min_survivors - max_colluders under secure aggregation with dropouts.
        dim: d, the number of noised coordinates (after padding) (>= 1).
        steps: number of releases (>= 1).
        adjacency: the neighbouring relation D2 and D1 are stated for (default add/remove).
            The bound needs the same n shares in both neighbours: sample-level add/remove
            is fine (the device stays), device-level add/remove is not (the absent device's
            share leaves with it; :func:`edge_sdk.ddp.event` refuses it).
    """

    l2_sensitivity: float
    l1_sensitivity: float
    sigma: float
    devices: int
    dim: int
    steps: int = 1
    adjacency: Adjacency = "add_remove"

    def __post_init__(self) -> None:
        _check_real("l2_sensitivity", self.l2_sensitivity)
        _check_real("l1_sensitivity", self.l1_sensitivity)
        _check_real("sigma", self.sigma)
        _check_count("devices", self.devices)
        _check_count("dim", self.dim)
        _check_count("steps", self.steps)
        _check_adjacency("DistributedDiscreteGaussian", self.adjacency, ADJACENCIES)


@dataclass(frozen=True, slots=True, kw_only=True)
class DistributedSkellam:
    """Each of ``devices`` devices adds Sk(mu, mu) = Poisson(mu) - Poisson(mu) per coordinate.

    Agarwal, Kairouz, Liu 2021 (the Skellam mechanism). The released sum carries
    Sk(n mu, n mu) noise, of variance 2 n mu, in every coordinate. Units: the integer
    scale; ``mu`` is per device. RDP: :func:`edge_sdk.privacy.discrete.rdp_distributed_skellam`.

    Attributes:
        l1_sensitivity: D1, bound on ||v - v'||_1 on the integer scale (>= 0).
        l2_sensitivity: D2, bound on ||v - v'||_2 on the integer scale (>= 0).
        mu: per-device Poisson rate (each device's noise has variance 2 mu) (>= 0; 0: no
            privacy).
        devices: n, the noise shares certainly in the released sum that the adversary
            cannot subtract (>= 1), as for :class:`DistributedDiscreteGaussian`.
        steps: number of releases (>= 1).
        adjacency: the neighbouring relation D1 and D2 are stated for (default add/remove;
            as for :class:`DistributedDiscreteGaussian`, never device-level add/remove).
    """

    l1_sensitivity: float
    l2_sensitivity: float
    mu: float
    devices: int
    steps: int = 1
    adjacency: Adjacency = "add_remove"

    def __post_init__(self) -> None:
        _check_real("l1_sensitivity", self.l1_sensitivity)
        _check_real("l2_sensitivity", self.l2_sensitivity)
        _check_real("mu", self.mu)
        _check_count("devices", self.devices)
        _check_count("steps", self.steps)
        _check_adjacency("DistributedSkellam", self.adjacency, ADJACENCIES)

    @property
    def variance(self) -> float:
        """V = 2 n mu, the variance of the summed noise per coordinate."""
        return 2.0 * self.devices * self.mu


def _check_curve(orders: object, rho: object) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(orders, rho) as tuples of floats: orders finite, > 1 and strictly increasing; rho
    finite and >= 0, one per order. Lists are accepted."""
    def floats(name: str, value: object) -> tuple[float, ...]:
        if not isinstance(value, tuple | list) or not value:
            raise ValueError(f"{name} must be a non-empty tuple of numbers, got {value!r}")
        if any(isinstance(x, bool) or not isinstance(x, numbers.Real) for x in value):
            raise ValueError(f"{name} must hold real numbers only, got {value!r}")
        return tuple(float(x) for x in value)

    a, r = floats("orders", orders), floats("rho", rho)
    if any(not (math.isfinite(x) and x > 1) for x in a) or any(
            y <= x for x, y in zip(a, a[1:], strict=False)):
        raise ValueError(f"orders must be finite, > 1 and strictly increasing, got {orders!r}")
    if len(r) != len(a):
        raise ValueError(f"rho needs one value per order ({len(a)}), got {len(r)}")
    if any(not (math.isfinite(x) and x >= 0) for x in r):
        raise ValueError(f"rho must be finite and >= 0 at every order, got {rho!r}")
    return a, r


@dataclass(frozen=True, slots=True, kw_only=True)
class Binomial:
    """The cpSGD binomial mechanism (Agarwal, Suresh, Yu, Kumar, McMahan 2018): integers on
    a grid plus Binomial(N, 1/2) - N/2 per coordinate, run ``steps`` times.

    Binomial pairs have infinite Renyi divergence (their supports differ), so the event
    carries what :func:`edge_sdk.privacy.binomial.restricted_rdp` proves instead, per
    release: a RESTRICTED Renyi moment ``rho`` at ``orders`` and the probability bound
    ``delta0`` of the support-mismatch event B, i.e. for every neighbouring pair (P, Q the
    output laws, L the privacy loss log dP/dQ)

        E_P[1_{not B} exp((a-1) L)] <= exp((a-1) rho(a))  at each order a,   P(B) <= delta0.

    An ordinary RDP curve r(a) is the special case B = empty, delta0 = 0, so both kinds
    compose (:class:`~edge_sdk.privacy.rdp.RdpAccountant`; the theorem is in
    :mod:`edge_sdk.privacy.binomial`). Build it with
    :func:`edge_sdk.privacy.binomial.binomial_event`, which computes ``rho`` and ``delta0``
    from the sensitivities; the constructor checks their form, not their values.

    Attributes:
        trials: N, coin flips per coordinate (p = 1/2).
        l2_sensitivity, linf_sensitivity, l1_sensitivity: D2, Dinf, D1, bounds on the
            integer shift between the two neighbours' grid values, in grid units, under
            ``adjacency`` (>= 0; Dinf < N).
        dim: d, the released coordinates.
        orders: the orders a > 1 the moment is stated at (strictly increasing).
        rho: the restricted moment of ONE release at each order, nats (finite, >= 0).
        delta0: P(B) of ONE release, in [0, 1).
        steps: number of releases (>= 1): moments and delta0 add over them.
        adjacency: ``"substitution"`` (the sensitivities' relation) or ``"zero_out"`` (a
            special case of it, rule 1 of the module docstring).
    """

    trials: int
    l2_sensitivity: float
    linf_sensitivity: float
    l1_sensitivity: float
    dim: int
    orders: tuple[float, ...]
    rho: tuple[float, ...]
    delta0: float
    steps: int = 1
    adjacency: Adjacency = "substitution"

    def __post_init__(self) -> None:
        _check_count("trials", self.trials)
        _check_real("l2_sensitivity", self.l2_sensitivity)
        linf = _check_real("linf_sensitivity", self.linf_sensitivity)
        _check_real("l1_sensitivity", self.l1_sensitivity)
        if linf >= self.trials:
            raise ValueError(f"linf_sensitivity must be < trials={self.trials} (else the "
                             f"supports can be disjoint), got {self.linf_sensitivity!r}")
        _check_count("dim", self.dim)
        orders, rho = _check_curve(self.orders, self.rho)
        object.__setattr__(self, "orders", orders)
        object.__setattr__(self, "rho", rho)
        d0 = _check_real("delta0", self.delta0)
        if not d0 < 1:
            raise ValueError(f"delta0 must be in [0, 1), got {self.delta0!r}")
        _check_count("steps", self.steps)
        _check_adjacency("Binomial", self.adjacency, ("substitution", "zero_out"))


@dataclass(frozen=True, slots=True, kw_only=True)
class SelfSampled:
    """One discrete release in which the record took part with probability q, by a coin
    that only it saw (issue 16's self-sampled check-ins).

    The record is a device. Each time it takes part in a round it draws b ~ Bernoulli(q)
    from its own CSPRNG and uploads its clipped update if b = 1, the zero vector (the null
    record) if b = 0, its noise share either way; the upload is masked, so nobody who sees
    less than the secure sum learns b. Under device-level zero-out (neighbour: the same
    device with the null record; the coin independent of the data; everything else the
    same) the two output laws are P = (1 - q) mu_0 + q mu_1 and Q = mu_0, with (mu_1, mu_0)
    a zero-out pair of :attr:`event` (the null record is what b = 0 sends, so it sits in
    the same place in both neighbours: the "dummy record" condition under which Poisson
    subsampling amplifies). That is the Poisson-subsampled mechanism of Zhu and Wang 2019
    ("Poisson subsampled Renyi differential privacy", ICML), whose Theorem 6 bounds its
    RDP at integer orders, in both directions, by the inner mechanism's RDP curve alone;
    :func:`edge_sdk.privacy.rdp.rdp_self_sampled` computes it.

    Attributes:
        event: the inner release (one step), a :class:`DistributedDiscreteGaussian` or
            :class:`DistributedSkellam` stated under zero-out.
        sample_rate: q in (0, 1], the probability that the record's data is in.
    """

    event: DistributedDiscreteGaussian | DistributedSkellam
    sample_rate: float

    def __post_init__(self) -> None:
        e = self.event
        if not isinstance(e, DistributedDiscreteGaussian | DistributedSkellam):
            raise ValueError("SelfSampled.event must be a DistributedDiscreteGaussian or "
                             f"DistributedSkellam, got {type(e).__name__}")
        if e.adjacency != "zero_out" or e.steps != 1:
            raise ValueError("SelfSampled.event must be one release (steps 1) under zero-out "
                             f"adjacency, got steps {e.steps} under {e.adjacency}")
        q = self.sample_rate
        if isinstance(q, bool) or not isinstance(q, numbers.Real) or not 0 < q <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {q!r}")

    @property
    def adjacency(self) -> Adjacency:
        """Always ``"zero_out"`` (the inner event's)."""
        return "zero_out"


@dataclass(frozen=True, slots=True, kw_only=True)
class SelfComposed:
    """One event run ``count`` times in a row (``dp_accounting``'s ``SelfComposedDpEvent``).

    Means exactly ``Composed(events=(event,) * count)``; accountants multiply instead of
    repeating.

    Attributes:
        event: the event repeated; any event of the union, nested ones included.
        count: how many times it runs (>= 1).
    """

    event: Event
    count: int

    def __post_init__(self) -> None:
        if not isinstance(self.event, _EVENT_TYPES):
            raise ValueError(
                f"event must be one of {', '.join(t.__name__ for t in _EVENT_TYPES)}, "
                f"got {self.event!r}"
            )
        _check_count("count", self.count, 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Composed:
    """Several events run one after another (adaptive composition).

    Attributes:
        events: the events, in order; may nest other :class:`Composed` events. A list is
            accepted and stored as a tuple.
    """

    events: tuple[Event, ...]

    def __post_init__(self) -> None:
        events = self.events
        if isinstance(events, list):
            events = tuple(events)
            object.__setattr__(self, "events", events)
        if not isinstance(events, tuple):
            raise ValueError(f"events must be a tuple of events, got {type(events).__name__}")
        for i, e in enumerate(events):
            if not isinstance(e, _EVENT_TYPES):
                raise ValueError(
                    f"events[{i}] must be one of {', '.join(t.__name__ for t in _EVENT_TYPES)}, "
                    f"got {e!r}"
                )


DiscreteEvent: TypeAlias = DistributedDiscreteGaussian | DistributedSkellam

Event: TypeAlias = (
    Gaussian | PoissonSubsampledGaussian | SampledWithoutReplacementGaussian
    | DistributedDiscreteGaussian | DistributedSkellam | Binomial | SelfSampled | Composed
    | SelfComposed
)
_EVENT_TYPES = (Gaussian, PoissonSubsampledGaussian, SampledWithoutReplacementGaussian,
                DistributedDiscreteGaussian, DistributedSkellam, Binomial, SelfSampled,
                Composed, SelfComposed)

#: Event types whose mechanism ignores a null record (rule 2 of the module docstring):
#: their add/remove bounds hold for zero-out pairs unchanged.
IGNORES_NULL_RECORD: tuple[type, ...] = (Gaussian, PoissonSubsampledGaussian)


def restate(event: Event, adjacency: Adjacency) -> Event:
    """``event`` with numbers that hold under ``adjacency`` (the module docstring's rules).

    Pure: returns a new event (or the same one when nothing changes).

    Raises:
        UnsupportedEventError: no sound conversion exists (names the event and both
            relations), or ``event`` is not an event.
        ValueError: ``adjacency`` is not one of :data:`ADJACENCIES`.
    """
    if adjacency not in ADJACENCIES:
        raise ValueError(f"adjacency must be one of {', '.join(ADJACENCIES)}, got {adjacency!r}")
    if isinstance(event, Composed):
        return Composed(events=tuple(restate(e, adjacency) for e in event.events))
    if isinstance(event, SelfComposed):
        return SelfComposed(event=restate(event.event, adjacency), count=event.count)
    if not isinstance(event, _EVENT_TYPES):
        raise UnsupportedEventError(f"unsupported privacy event {event!r}")
    have = event.adjacency
    if have == adjacency:
        return event
    if isinstance(event, SelfSampled):
        raise UnsupportedEventError(
            f"SelfSampled is stated under zero-out adjacency only (its amplification needs "
            f"the null record in both neighbours); no sound restatement under {adjacency}")
    if adjacency == "zero_out" and (
        have == "substitution" or isinstance(event, IGNORES_NULL_RECORD)
    ):
        return replace(event, adjacency="zero_out")
    if adjacency == "substitution" and isinstance(event, Gaussian):
        return Gaussian(noise_multiplier=event.noise_multiplier / 2, steps=event.steps,
                        adjacency="substitution")
    raise UnsupportedEventError(
        f"{type(event).__name__} stated under {have} adjacency has no sound restatement under "
        f"{adjacency} adjacency (only substitution -> zero-out, add/remove -> zero-out for "
        "null-ignoring mechanisms, and Gaussian -> substitution at z/2)"
    )


def adjacencies_of(event: Event) -> frozenset[str]:
    """The adjacencies the leaves of ``event`` are stated under."""
    if isinstance(event, Composed):
        return frozenset().union(*(adjacencies_of(e) for e in event.events))
    if isinstance(event, SelfComposed):
        return adjacencies_of(event.event)
    return frozenset({event.adjacency})
