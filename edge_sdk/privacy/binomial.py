"""The cpSGD binomial mechanism's privacy, as its paper states it (a paper bound).

cpSGD (Agarwal, Suresh, Yu, Kumar, McMahan 2018), Theorem 1: integers q(x) on a grid of
spacing s, plus s * (Binomial(N, p) - N p) per coordinate, is (eps, delta)-DP with

    eps = D2 sqrt(2 log(1.25/delta)) / (s sqrt(N p (1-p)))
        + (D2 c_p sqrt(log(10/delta)) + D1 b_p) / (s N p (1-p) (1 - delta/10))
        + (2/3 Dinf log(1.25/delta) + Dinf d_p log(20 d/delta) log(10/delta)) / (s N p (1-p))

when N p (1-p) >= max(23 log(10 d / delta), 2 Dinf / s), with b_p, c_p, d_p of its eqs.
(17), (12), (16). D1, D2, Dinf bound the L1, L2, Linf sensitivity of the query in the same
units as s. We report infinity outside its stated conditions.

This figure is a PAPER BOUND, NOT VERIFIED, and it can be BELOW the true epsilon: the
transcription above (the paper itself is not available here to check it against) under-states
epsilon once the shift exceeds about 2.5-4 noise standard deviations (sigma = sqrt(N)/2),
inside the theorem's own condition. The exact hockey-stick divergence of Bin(N, 1/2) against
Bin(N, 1/2) + k shows it (privacy review of issue 15, /work/wt/pr/review.md, Q1): in 1-D at
N = 4096, delta = 2.2e-5, k = 512 it claims 142.6 where the true epsilon is 195.8 (true delta
at the claim 0.19); 84 of 370 grid points and 104 of 471 points with the code's own
sensitivities are below the truth (L = 511, N = 16384, d = 21,840: 155.3 claimed, 192.6
true). At the experiments' defaults (127 levels, N = 4096) it happens to be above. So it is
only ever shown as a labelled paper figure (:data:`PAPER_BOUND_LABEL`, the simulator's
``paper_epsilon``), never as an epsilon of ours.

Our sound epsilon (:func:`restricted_rdp`, :func:`restricted_rdp_epsilon`,
:meth:`CpsgdBinomial.epsilon`) is the review's restricted-RDP bound. Bin(N, 1/2) and a
shifted copy have different supports, so their Renyi divergence is infinite and neither
plain RDP nor a Bretagnolle-Huber shortcut (KL is infinite) applies. Instead, with B the
event that some coordinate falls outside the other neighbour's support, and P, Q the two
output laws of one release (grid units, shift vector k with |k_i| <= Dinf, ||k||_2 <= D2,
at most min(d, D1) nonzero coordinates):

    delta(eps) <= P(B) + c_a exp((a-1)(rho(a) - eps)),   c_a = (a-1)^(a-1) / a^a
    exp((a-1) rho(a)) >= E_P[1_{not B} e^{(a-1) L}] = prod_i G_a(k_i),
    G_a(k) = sum_{y=k..N} P(y)^a P(y-k)^(1-a),  P the Bin(N, 1/2) pmf
    rho(a) = D2^2 max(0, max_{1<=k<=Dinf} log G_a(k) / k^2) / (a - 1)
    P(B)  <= delta0 = min(d, D1) P(Bin(N, 1/2) <= Dinf - 1)

The first line is the pointwise bound (1 - e^(eps-L))_+ <= c_a e^((a-1)(L-eps)) behind
Canonne, Kamath, Steinke 2020 Prop. 12 (CKS), applied off B; the product is over the
independent coordinates (G_a(-k) = G_a(k) by the symmetry of p = 1/2, and both directions
of the pair are the same by it); the max over every shift k <= Dinf is needed because
log G_a(k) / k^2 is not monotone in k. Over releases (adaptive composition) the moments
multiply (tower property: the bound holds for every input pair) and the P(B) add (union
bound): T releases give rho = sum_t rho_t, delta0 = sum_t delta0_t, converted by CKS at
delta - delta0. Each release is charged in full: amplification by subsampling is not proved
for the restricted moment. The rounding's randomness is handled by the coupling of
:meth:`CpsgdBinomial.sensitivities` (the bound holds for each U; the released law is the
mixture, and the hockey-stick divergence is jointly convex). Adjacency: substitution of one
record (so zero-out too). In 1-D the bound is within 3.5-7 % of the exact epsilon (review:
N = 4096, k = 512, delta = 2.2e-5: exact 195.80, this bound 203.50, Thm 1 142.60).

On the device (issue 15 G6, :mod:`edge_sdk.mechanisms.binomial`) the ledger accounts this
bound, never Thm 1: :func:`binomial_event` puts (rho, delta0) into the privacy event
:class:`~edge_sdk.privacy.events.Binomial`, and :class:`~edge_sdk.privacy.rdp.RdpAccountant`
composes it with the device's other events (restricted moments and RDP curves add, delta0s
add; converted at delta - sum delta0 without the KL shortcut; the composition theorem is in
:mod:`edge_sdk.privacy.rdp`). A ledger must never under-count, so Thm 1 (below the truth in
reachable configurations) is only ever a labelled paper figure.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge_sdk.privacy._math import logsumexp
from edge_sdk.privacy.events import Binomial

__all__ = [
    "BINOMIAL_ORDERS",
    "PAPER_BOUND_LABEL",
    "CpsgdBinomial",
    "binomial_event",
    "cpsgd_epsilon",
    "restricted_rdp",
    "restricted_rdp_epsilon",
    "subsampled_wor_epsilon_delta",
]

PAPER_BOUND_LABEL = ("cpSGD Thm 1, paper bound, not verified: can be below the true epsilon, "
                     "see edge_sdk/privacy/binomial.py (privacy review, issue 15 Q1)")
"""How every cpSGD Theorem 1 figure is labelled wherever it is shown."""


def _b(p: float) -> float:
    return (2 / 3) * (p**2 + (1 - p) ** 2) + 1 - 2 * p


def _c(p: float) -> float:
    return math.sqrt(2) * (3 * p**3 + 3 * (1 - p) ** 3 + 2 * p**2 + 2 * (1 - p) ** 2)


def _d(p: float) -> float:
    return (4 / 3) * (p**2 + (1 - p) ** 2)


def cpsgd_epsilon(*, trials: int, grid: float, dim: int, l1: float, l2: float, linf: float,
                  delta: float, p: float = 0.5) -> float:
    """cpSGD Thm 1 as transcribed: a paper bound, not verified, that can be BELOW the true
    epsilon (module docstring); ``inf`` where the theorem's condition on N p (1-p) fails.
    Never report it as an epsilon of ours: label it with :data:`PAPER_BOUND_LABEL`."""
    if trials < 1 or not grid > 0 or dim < 1 or not 0 < delta < 1 or not 0 < p < 1:
        raise ValueError(f"need trials >= 1, grid > 0, dim >= 1, 0 < delta < 1, 0 < p < 1; "
                         f"got {trials}, {grid}, {dim}, {delta}, {p}")
    var = trials * p * (1 - p)
    if var < max(23 * math.log(10 * dim / delta), 2 * linf / grid):
        return math.inf
    first = l2 * math.sqrt(2 * math.log(1.25 / delta)) / (grid * math.sqrt(var))
    second = (l2 * _c(p) * math.sqrt(math.log(10 / delta)) + l1 * _b(p)) / (
        grid * var * (1 - delta / 10)
    )
    third = ((2 / 3) * linf * math.log(1.25 / delta)
             + linf * _d(p) * math.log(20 * dim / delta) * math.log(10 / delta)) / (grid * var)
    return first + second + third


#: Orders a of :func:`restricted_rdp`: a - 1 geometric from 1e-3 to 511 (120 points). Small
#: a - 1 matter here: the binomial mechanism's per-release epsilon is large, and the best
#: order of a large moment is close to 1.
BINOMIAL_ORDERS: tuple[float, ...] = tuple(float(1.0 + x) for x in np.geomspace(1e-3, 511.0, 120))

# Relative margin on rho and delta0 for float64 rounding in their sums (the review's
# float64 log-space evaluation agreed with 60-digit mpmath to 3e-12).
_MARGIN = 1e-9


def _grid_floor(x: float) -> int:
    """floor(x) for a value meant to be an integer in grid units, never rounding a float
    that should be an integer down (255 computed as 254.99999999999997 counts as 255)."""
    return math.floor(x * (1.0 + 1e-12))


@functools.lru_cache(maxsize=16)
def _log_g_over_k2(trials: int, kmax: int, orders: tuple[float, ...]) -> np.ndarray:
    """max(0, max_{1<=k<=kmax} log G_a(k) / k^2) per order (cached: Dinf x N per order)."""
    lg = np.array([math.lgamma(y + 1.0) for y in range(trials + 1)])
    lp = lg[trials] - lg - lg[::-1] - trials * math.log(2.0)  # log Bin(N, 1/2) pmf
    a = np.asarray(orders, dtype=np.float64)[:, None]
    best = np.zeros(len(orders))
    for k in range(1, kmax + 1):
        x = a * lp[k:][None, :] + (1.0 - a) * lp[: trials + 1 - k][None, :]
        m = x.max(axis=1)
        g = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
        best = np.maximum(best, g / (k * k))
    return best


def restricted_rdp(*, trials: int, l2: float, linf: float, l1: float, dim: int,
                   orders: Sequence[float] = BINOMIAL_ORDERS) -> tuple[np.ndarray, float]:
    """The restricted Renyi moment rho(a) and delta0 of ONE release of the binomial
    mechanism (module docstring; the privacy review's option (b)).

    Args:
        trials: N, coin flips per coordinate (p = 1/2).
        l2, linf, l1: D2, Dinf, D1 bounds on the integer shift between neighbours, in grid
            units (Dinf and D1 are used through their floors: shifts are integers).
        dim: d, the released coordinates.
        orders: orders a > 1.

    Returns:
        (rho, delta0): rho(a) in nats at each order, and delta0 = min(d, D1) P(Bin(N, 1/2)
        <= Dinf - 1), the probability bound of the support-mismatch event. Both add over
        releases; :func:`restricted_rdp_epsilon` converts.

    Raises:
        ValueError: bad parameters, or Dinf >= N (the supports can be disjoint).
    """
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be an int >= 1, got {trials!r}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be an int >= 1, got {dim!r}")
    for name, v in (("l2", l2), ("linf", linf), ("l1", l1)):
        if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be finite and >= 0 (grid units), got {v!r}")
    a = tuple(float(x) for x in orders)
    if not a or any(not (x > 1 and math.isfinite(x)) for x in a):
        raise ValueError(f"orders must be finite and > 1, got {orders!r}")
    kmax = _grid_floor(linf)
    if kmax >= trials:
        raise ValueError(f"linf = {linf!r} grid steps >= trials = {trials}: the shifted "
                         "supports can be disjoint; use more trials")
    if kmax == 0 or l2 == 0:
        return np.zeros(len(a)), 0.0
    ratio = _log_g_over_k2(trials, kmax, a)
    rho = (1.0 + _MARGIN) * l2 * l2 * ratio / (np.asarray(a) - 1.0)
    # P(Bin(N, 1/2) <= kmax - 1) in log space (it underflows for the usual parameters)
    lg = [math.lgamma(y + 1.0) for y in range(kmax)]
    log_tail = logsumexp(np.array([math.lgamma(trials + 1.0) - lg[y] - math.lgamma(trials - y + 1.0)
                                   for y in range(kmax)]) - trials * math.log(2.0))
    count = min(dim, _grid_floor(l1))
    delta0 = (1.0 + _MARGIN) * count * math.exp(log_tail)
    return rho, delta0


def binomial_event(*, trials: int, l2: float, linf: float, l1: float, dim: int,
                   steps: int = 1, adjacency: str = "substitution",
                   orders: Sequence[float] = BINOMIAL_ORDERS) -> Binomial:
    """The privacy event of ``steps`` releases of the binomial mechanism, with its
    restricted moment and delta0 per release from :func:`restricted_rdp` (sensitivities
    in grid units, stated under ``adjacency``: ``"substitution"``, or ``"zero_out"``, a
    special case of it). Each release is charged in full: no amplification by sampling.

    Raises:
        ValueError: bad parameters (as :func:`restricted_rdp`, or from the event).
    """
    rho, delta0 = restricted_rdp(trials=trials, l2=l2, linf=linf, l1=l1, dim=dim,
                                 orders=orders)
    return Binomial(trials=trials, l2_sensitivity=float(l2), linf_sensitivity=float(linf),
                    l1_sensitivity=float(l1), dim=dim,
                    orders=tuple(float(a) for a in orders),
                    rho=tuple(float(r) for r in rho), delta0=float(delta0), steps=steps,
                    adjacency=adjacency)  # type: ignore[arg-type]


def restricted_rdp_epsilon(rho: Sequence[float] | np.ndarray, orders: Sequence[float],
                           delta0: float, delta: float) -> float:
    """Epsilon at ``delta`` from a (composed) restricted moment: the least over orders of
    rho(a) + log1p(-1/a) - (log(delta - delta0) + log a) / (a - 1), at least 0 (CKS 2020
    Prop. 12 applied off the support-mismatch event). ``inf`` when delta0 >= delta. No
    Bretagnolle-Huber shortcut: the KL divergence of binomial pairs is infinite.
    """
    r = np.asarray(rho, dtype=np.float64)
    a = np.asarray(orders, dtype=np.float64)
    if r.shape != a.shape or r.ndim != 1 or not np.all(a > 1):
        raise ValueError(f"rho and orders must be 1-D of one length, orders > 1; got shapes "
                         f"{r.shape}, {a.shape}")
    if not 0 < delta < 1 or not delta0 >= 0:
        raise ValueError(f"need 0 < delta < 1 and delta0 >= 0, got {delta!r}, {delta0!r}")
    rest = delta - delta0
    if rest <= 0:
        return math.inf
    eps = r + np.log1p(-1.0 / a) - (math.log(rest) + np.log(a)) / (a - 1.0)
    return float(max(0.0, float(np.min(eps))))


def subsampled_wor_epsilon_delta(eps: float, delta: float, rate: float) -> tuple[float, float]:
    """(eps, delta) after sampling a fraction ``rate`` without replacement (substitution):
    (log(1 + rate (e^eps - 1)), rate delta) (Balle, Barthe, Gaboardi 2018).

    Evaluated without overflow: for eps > 1 as eps + log(rate + (1 - rate) e^-eps) (the same
    number; e^eps overflows a float beyond eps = 709.78), else as log1p(rate expm1(eps)).
    """
    if not 0 < rate <= 1:
        raise ValueError(f"rate must be in (0, 1], got {rate!r}")
    if math.isinf(eps):
        return math.inf, rate * delta
    if eps > 1.0:
        return eps + math.log(rate + (1.0 - rate) * math.exp(-eps)), rate * delta
    return math.log1p(rate * math.expm1(eps)), rate * delta


@dataclass(frozen=True, slots=True, kw_only=True)
class CpsgdBinomial:
    """One release of the binomial mechanism on a (subsampled) clipped update.

    Attributes:
        trials: N (coin flips per coordinate; p = 1/2).
        grid: spacing s of the integer grid, in update units.
        dim: number of released coordinates d.
        update_clip: L2 bound S on the update before quantization.
        sample_rate: fraction of the local data the update was computed on (without
            replacement), for amplification.
    """

    trials: int
    grid: float
    dim: int
    update_clip: float
    sample_rate: float

    def sensitivities(self) -> tuple[float, float, float]:
        """(L1, L2, Linf) bounds, in update units, of the quantized update's change when one
        record is substituted: the update moves by at most 2S in L2 (so 2S sqrt(d) in L1,
        2S in Linf), plus one grid step g per coordinate from the rounding, i.e.
        2S sqrt(d) + g d, 2S + g sqrt(d), 2S + g.

        These are NOT deterministic bounds on two independent roundings (x/g = 1.1 and
        x'/g = 0.9 can round to 2 and 0). They hold through a coupling: the code's unbiased
        rounding has the law of q(x) = floor(x/g + U) with U uniform on [0, 1)^d, and with
        the SAME U for both neighbours |q_i - q'_i| <= ceil(|x_i - x'_i| / g), so the integer
        difference is within the bounds above for every U; the released law is the mixture
        over U, and the hockey-stick divergence is jointly convex, so a per-U guarantee
        carries over to the mixture (privacy review, issue 15 Q1).
        """
        s, g, d = self.update_clip, self.grid, self.dim
        return 2 * s * math.sqrt(d) + g * d, 2 * s + g * math.sqrt(d), 2 * s + g

    def restricted_rdp(self, orders: Sequence[float] = BINOMIAL_ORDERS
                       ) -> tuple[np.ndarray, float]:
        """(rho, delta0) of this release (:func:`restricted_rdp`, sensitivities in grid
        units); the sample rate is ignored: no amplification is claimed."""
        l1, l2, linf = (x / self.grid for x in self.sensitivities())
        return restricted_rdp(trials=self.trials, l2=l2, linf=linf, l1=l1, dim=self.dim,
                              orders=orders)

    def event(self, *, adjacency: str = "substitution") -> Binomial:
        """This release as a privacy event (:func:`binomial_event`, sensitivities in grid
        units, substitution of one record or its special case zero-out); the sample rate is
        ignored: no amplification is claimed."""
        l1, l2, linf = (x / self.grid for x in self.sensitivities())
        return binomial_event(trials=self.trials, l2=l2, linf=linf, l1=l1, dim=self.dim,
                              adjacency=adjacency)

    def epsilon(self, delta: float, releases: int = 1) -> float:
        """Sound epsilon at ``delta`` of ``releases`` such releases (substitution of one
        record): the restricted-RDP bound, each release charged in full, composed and
        converted by :func:`restricted_rdp_epsilon`."""
        if isinstance(releases, bool) or not isinstance(releases, int) or releases < 1:
            raise ValueError(f"releases must be an int >= 1, got {releases!r}")
        rho, delta0 = self.restricted_rdp()
        return restricted_rdp_epsilon(releases * rho, BINOMIAL_ORDERS, releases * delta0,
                                      delta)

    def paper_epsilon_delta(self, delta: float) -> tuple[float, float]:
        """(eps, delta') of this release by cpSGD Thm 1, then amplification by sampling
        without replacement: a paper figure (:data:`PAPER_BOUND_LABEL`), not a guarantee."""
        l1, l2, linf = self.sensitivities()
        eps = cpsgd_epsilon(trials=self.trials, grid=self.grid, dim=self.dim, l1=l1, l2=l2,
                            linf=linf, delta=delta)
        return subsampled_wor_epsilon_delta(eps, delta, self.sample_rate)
