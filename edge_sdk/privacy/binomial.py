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

The binomial mechanism stays SIMULATION-ONLY on the device path: no device configuration
selects it and no device ledger accounts it. A ledger must never under-count, so it cannot
carry an unverified paper bound that is below the truth in reachable configurations; a sound
bound exists (the review's restricted-RDP bound, with an additive delta0 and no subsampling
amplification) but would need its own ledger event kind, and the distributed discrete
Gaussian (:mod:`edge_sdk.ddp`) already gives the device path integers for secure aggregation
with a tight, proved RDP bound. cpSGD remains an experiment baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PAPER_BOUND_LABEL", "CpsgdBinomial", "cpsgd_epsilon", "subsampled_wor_epsilon_delta"]

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

    def paper_epsilon_delta(self, delta: float) -> tuple[float, float]:
        """(eps, delta') of this release by cpSGD Thm 1, then amplification by sampling
        without replacement: a paper figure (:data:`PAPER_BOUND_LABEL`), not a guarantee."""
        l1, l2, linf = self.sensitivities()
        eps = cpsgd_epsilon(trials=self.trials, grid=self.grid, dim=self.dim, l1=l1, l2=l2,
                            linf=linf, delta=delta)
        return subsampled_wor_epsilon_delta(eps, delta, self.sample_rate)
