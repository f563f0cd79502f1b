"""Zero-concentrated DP (zCDP) of Gaussian mechanisms, composition, conversion to (eps, delta).

A mechanism is rho-zCDP (Bun and Steinke 2016) if its RDP is at most a * rho at every
order a > 1. The Gaussian mechanism with noise multiplier z is 1 / (2 z^2)-zCDP per
release, rho adds up under composition, and two conversions to (eps, delta)-DP are given:

* Bun-Steinke 2016, Prop. 1.3: eps = rho + 2 sqrt(rho log(1/delta)).
* Canonne-Kamath-Steinke 2020 ("The Discrete Gaussian for Differential Privacy"),
  Prop. 12 / Cor. 13: eps = inf_{a > 1} a rho + log1p(-1/a) - (log(delta) + log(a)) / (a - 1),
  always at most the Bun-Steinke value.

zCDP claims no amplification by subsampling: a subsampled Gaussian event is charged the
zCDP of its un-subsampled Gaussian (true, since subsampling never increases RDP, but loose;
use :mod:`edge_sdk.privacy.rdp` or :mod:`edge_sdk.privacy.pld` for amplified accounting).
"""

from __future__ import annotations

import math
import numbers
from typing import Literal

import numpy as np

from edge_sdk.privacy.events import (
    _EVENT_TYPES,
    ADJACENCIES,
    Adjacency,
    Binomial,
    Composed,
    Event,
    Gaussian,
    PoissonSubsampledGaussian,
    SampledWithoutReplacementGaussian,
    SelfComposed,
    UnsupportedEventError,
    restate,
)

__all__ = [
    "Conversion",
    "ZcdpAccountant",
    "compute_rho",
    "gaussian_rho",
    "rho_to_epsilon",
    "rho_to_epsilon_bun_steinke",
    "rho_to_epsilon_cks",
]

Conversion = Literal["cks", "bun_steinke"]

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def _check_rho(rho: object) -> float:
    if isinstance(rho, bool) or not isinstance(rho, numbers.Real) or not rho >= 0:
        raise ValueError(f"rho must be >= 0 (inf allowed), got {rho!r}")
    return float(rho)


def _check_delta(delta: object) -> float:
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


def gaussian_rho(noise_multiplier: float, steps: int = 1) -> float:
    """zCDP of ``steps`` Gaussian releases: rho = steps / (2 z^2) (Bun-Steinke 2016, Prop. 1.6).

    With sensitivity C and noise std z C this is steps * C^2 / (2 (z C)^2).

    Args:
        noise_multiplier: z, noise std / L2 sensitivity (0 gives inf).
        steps: number of releases (>= 1).

    Returns:
        rho, in nats (RDP at order a is at most a * rho).
    """
    z = noise_multiplier
    if isinstance(z, bool) or not isinstance(z, numbers.Real) or not (math.isfinite(z) and z >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {z!r}")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if z == 0:
        return math.inf
    return steps / (2.0 * float(z) ** 2)


def compute_rho(event: Event) -> float:
    """zCDP rho of an event (no subsampling amplification is claimed).

    Raises:
        UnsupportedEventError: an unsupported event (the discrete ones: no zCDP theorem is
            applied to them here; RdpAccountant takes them).
    """
    if isinstance(event, Composed):
        return math.fsum(compute_rho(e) for e in event.events)
    if isinstance(event, SelfComposed):
        return event.count * compute_rho(event.event)
    if isinstance(event, Gaussian | PoissonSubsampledGaussian | SampledWithoutReplacementGaussian):
        return gaussian_rho(event.noise_multiplier, event.steps)
    if isinstance(event, Binomial):
        raise UnsupportedEventError(
            "Binomial (cpSGD) has no zCDP rho (binomial pairs have different supports), only "
            "a restricted Renyi moment with an additive delta0: use RdpAccountant")
    raise UnsupportedEventError(f"unsupported privacy event {event!r}")


def rho_to_epsilon_bun_steinke(rho: float, delta: float) -> float:
    """eps = rho + 2 sqrt(rho log(1/delta)) (Bun-Steinke 2016, Prop. 1.3).

    Args:
        rho: zCDP parameter (>= 0, inf allowed).
        delta: target delta in (0, 1).

    Returns:
        epsilon at ``delta``.
    """
    rho, delta = _check_rho(rho), _check_delta(delta)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def _cks(alpha: np.ndarray, rho: float, log_delta: float) -> np.ndarray:
    return alpha * rho + np.log1p(-1.0 / alpha) - (log_delta + np.log(alpha)) / (alpha - 1.0)


def rho_to_epsilon_cks(rho: float, delta: float) -> float:
    """Tight conversion: inf over a > 1 of a rho + log1p(-1/a) - (log(delta) + log(a)) / (a - 1).

    Canonne, Kamath, Steinke 2020, Prop. 12 applied to RDP(a) = a rho. Every order a gives a
    valid bound, so the numerical minimization (a log-spaced grid over a - 1 in
    [1e-8, 1e8], then golden-section refinement) can only err upwards. Also 0 when
    delta >= sqrt(1 - exp(-rho)) (KL <= rho bounds the total variation distance).

    Args:
        rho: zCDP parameter (>= 0, inf allowed).
        delta: target delta in (0, 1).

    Returns:
        epsilon at ``delta``, never below 0.
    """
    rho, delta = _check_rho(rho), _check_delta(delta)
    if rho == 0 or delta * delta + math.expm1(-rho) >= 0:
        return 0.0
    if math.isinf(rho):
        return math.inf
    log_delta = math.log(delta)
    u = np.linspace(math.log(1e-8), math.log(1e8), 2001)
    vals = _cks(1.0 + np.exp(u), rho, log_delta)
    k = int(np.argmin(vals))
    best = float(vals[k])
    lo, hi = u[max(k - 1, 0)], u[min(k + 1, u.size - 1)]
    for _ in range(80):  # golden-section search on the bracket
        m1 = hi - _GOLDEN * (hi - lo)
        m2 = lo + _GOLDEN * (hi - lo)
        f1 = float(_cks(np.array([1.0 + math.exp(m1)]), rho, log_delta)[0])
        f2 = float(_cks(np.array([1.0 + math.exp(m2)]), rho, log_delta)[0])
        best = min(best, f1, f2)
        if f1 < f2:
            hi = m2
        else:
            lo = m1
    return max(0.0, best)


def rho_to_epsilon(rho: float, delta: float, *, conversion: Conversion = "cks") -> float:
    """Convert rho-zCDP to epsilon at ``delta`` with the named conversion (default: CKS)."""
    if conversion == "cks":
        return rho_to_epsilon_cks(rho, delta)
    if conversion == "bun_steinke":
        return rho_to_epsilon_bun_steinke(rho, delta)
    raise ValueError(f"conversion must be 'cks' or 'bun_steinke', got {conversion!r}")


class ZcdpAccountant:
    """Adds up zCDP rho over composed events (check-then-commit) and converts to (eps, delta).

    Args:
        adjacency: the relation the guarantee is stated under (default ``"add_remove"``);
            each event is restated under it first (:func:`~edge_sdk.privacy.events.restate`:
            converted soundly, or ValueError), never mixed silently.

    Example:
        >>> acc = ZcdpAccountant().compose(Gaussian(noise_multiplier=10.0, steps=50))
        >>> acc.rho
        0.25
    """

    __slots__ = ("_adjacency", "_rho")

    def __init__(self, *, adjacency: Adjacency = "add_remove") -> None:
        if adjacency not in ADJACENCIES:
            raise ValueError(
                f"adjacency must be one of {', '.join(ADJACENCIES)}, got {adjacency!r}")
        self._adjacency: Adjacency = adjacency
        self._rho = 0.0

    def __repr__(self) -> str:
        return f"ZcdpAccountant(rho={self._rho!r}, adjacency={self._adjacency!r})"

    @property
    def adjacency(self) -> Adjacency:
        """The adjacency relation the guarantee is stated for."""
        return self._adjacency

    @property
    def rho(self) -> float:
        """The accumulated rho."""
        return self._rho

    def _rho_of(self, event: object) -> float:
        """rho of one run of ``event`` restated under this adjacency (pure)."""
        if not isinstance(event, _EVENT_TYPES):
            raise UnsupportedEventError(f"unsupported privacy event {event!r}")
        return compute_rho(restate(event, self._adjacency))

    def supports(self, event: object) -> bool:
        """Whether :meth:`compose` takes ``event``: the Gaussian family (in Composed /
        SelfComposed too) restated under this adjacency; not the discrete events."""
        try:
            self._rho_of(event)
        except UnsupportedEventError:
            return False
        return True

    def compose(self, event: Event, count: int = 1) -> ZcdpAccountant:
        """Add ``count`` runs of ``event``; returns self. Nothing changes if it raises.

        Raises:
            UnsupportedEventError: :meth:`supports` is False.
            ValueError: bad ``count``.
        """
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        increment = self._rho_of(event)
        if count:
            self._rho = self._rho + count * increment
        return self

    def get_epsilon(self, delta: float, *, conversion: Conversion = "cks") -> float:
        """Epsilon at ``delta`` (CKS conversion by default; ``"bun_steinke"`` for the classic)."""
        return rho_to_epsilon(self._rho, delta, conversion=conversion)
