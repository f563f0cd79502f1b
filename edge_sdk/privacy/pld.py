"""Privacy loss distribution (PLD) accounting with pessimistic discretization.

The privacy loss of a pair (P, Q) is L = log(P(x) / Q(x)) with x ~ P; its law (plus an
atom at +inf for where Q = 0) determines delta at every epsilon,
delta(eps) = E[(1 - e^(eps - L))_+] + P(L = inf), and the loss of a composition is the sum
of independent losses, so PLDs compose by convolution (Meiser-Mohammadi 2018; Koskela,
Jalko, Honkela 2020; Sommer, Meiser, Mohammadi 2019).

Soundness: the continuous loss is replaced by one on the grid {k * interval} whose pair
*dominates* the true pair (its hockey-stick divergence is at least as large at every
e^eps >= 0), and dominance survives composition (Zhu, Dong, Wang 2022, Thm. 10). Each
grid cell's P-mass a and Q-mass b are split between its two end points so that both
masses are kept ("connect the dots", Doroshenko, Ghazi, Kamath, Kumar, Manurangsi 2022):
the resulting hockey-stick curve is the chord of the true, convex one, hence above it,
with an error O(interval^2) instead of the O(interval) bias of rounding every loss up.
Tails are handled pessimistically too: mass above the grid goes to the +inf atom, mass
below the grid is moved up to its lowest point, Q-mass is only ever removed. After
every convolution tails of mass below 1e-15 are cut the same way, and a rigorous bound on
the floating-point error of the FFT convolutions is carried along and added to delta.

Speed (issue 18). n runs of one step are composed by squaring while the operand is
peaked (its largest entries times their neighbourhood summed by a pairwise tree, only
the flat remainder by FFT), then, once the error bound of one FFT raised to the
remaining power is below 5e-11, by that single FFT: the last squared operand's DFT
raised to the remaining power times the DFTs of the operands of the set bits below it
(no convolution of their own), on a window sized by Chernoff bounds (its outside folds
onto it and is also charged to +inf). Only the remove direction is composed: the add
direction is its reversal (:meth:`DiscretePld.reverse`), whose slack is larger, so the
add direction is composed on its own only where that bound could decide the answer
(:meth:`PldAccountant.get_epsilon`). `fedge bench accountant` times it against
dp_accounting. The price is a slack of about 1e-10 at 70,000 steps of q = 1e-3 (5.6e-11
with compensated sums and squaring throughout): invisible at delta = 1e-5, 0.03% of
epsilon at delta = 1e-8.

Scope: the Gaussian and the Poisson-subsampled Gaussian under add/remove adjacency; both
directions (remove: P = (1-q) N(0, z^2) + q N(1, z^2) vs Q = N(0, z^2); add: the reverse)
are bounded and the larger epsilon is reported.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from edge_sdk.privacy._math import ndtr, sf_normal
from edge_sdk.privacy.events import (
    _EVENT_TYPES,
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
    "DiscretePld",
    "PldAccountant",
    "discretize_subsampled_gaussian",
]

Direction = Literal["remove", "add"]

_TAIL_MASS = 1e-15  # cut from each tail after a convolution (pessimistically)
_X_TAIL = 8.5  # the per-step grid covers x in [-8.5 z, 1 + 8.5 z]: tails below 1e-17
_GRID_TAIL = 1e-17  # ... and above x it stops where the P-mass above is that (_upper_x)
_UNIT_ROUNDOFF = 2.0**-53
# A sum of n non-negative terms, each with a relative error of a few u, by numpy's pairwise
# summation: relative error below (log2 n + 16) u < 1e-13 for any n we meet; sums whose
# rounding could lower an epsilon are moved by this much the safe way.
_SUM_RTOL = 1e-12
_FFT_ERROR_CONSTANT = 10.0  # generous constant in the FFT error bound (see _convolve)
# Largest entries of each operand convolved directly (see _convolve): at least _CORE, at
# most _CORE_MAX, enough to leave an l2 norm <= _REST_NORM for the FFT.
_CORE = 16
_CORE_MAX = 128
_REST_NORM = 5e-3
_SPREAD_NORM = 0.05
# l2 norm of an operand's tail left out of the compensated sums (see _convolve): its FFT
# error then stays at that of the two rests, _REST_NORM^2.
_TAIL_NORM = _REST_NORM**2
# Largest round-off bound (l1, added to delta) accepted from one FFT raised to a power
# (_fft_power); above it self_compose squares once more (a smaller power, a flatter operand).
_POWER_SLACK = 5e-11
# Automatic grid: this fraction of the smallest per-step loss std. The connect-the-dots
# error in epsilon is about 0.1 * (interval / std)^2 relative: 4e-5 here.
_AUTO_INTERVAL_FRACTION = 0.02


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DiscretePld:
    """A privacy loss distribution on the grid {k * interval}.

    Attributes:
        interval: grid spacing, in nats.
        offset: the grid index of ``pmf[0]`` (its loss is ``offset * interval``).
        pmf: probability masses (under P) of the losses ``(offset + i) * interval``.
        inf_mass: the mass of the loss +inf (where Q = 0, or tails cut off above).
        slack: added to every delta: there is a PLD w* of a pair dominating the true one,
            on this grid range and +inf, with ||w*_finite - pmf||_1 + (w*(+inf) -
            inf_mass)_+ <= slack (floating-point error, folded tails). Every operation
            keeps that (:meth:`compose` takes masses as at least 1 for it).
    """

    interval: float
    offset: int
    pmf: np.ndarray
    inf_mass: float = 0.0
    slack: float = 0.0

    @property
    def losses(self) -> np.ndarray:
        """The loss value of each entry of ``pmf``."""
        return (self.offset + np.arange(self.pmf.size)) * self.interval

    def compose(self, other: DiscretePld) -> DiscretePld:
        """The PLD of running both mechanisms (convolution), tails cut pessimistically."""
        if other.interval != self.interval:
            raise ValueError(
                f"intervals differ: {self.interval!r} and {other.interval!r}; "
                "discretize both on the same grid"
            )
        pmf, err = _convolve(self.pmf, None if other is self else other.pmf)
        # Masses taken as at least 1: part of an operand's slack may sit in its +inf atom.
        mass_a, mass_b = max(float(self.pmf.sum()), 1.0), max(float(other.pmf.sum()), 1.0)
        slack = self.slack * (mass_b + other.slack) + other.slack * mass_a + err
        inf_mass = 1.0 - (1.0 - self.inf_mass) * (1.0 - other.inf_mass)
        return _truncate(
            DiscretePld(interval=self.interval, offset=self.offset + other.offset, pmf=pmf,
                        inf_mass=inf_mass, slack=slack)
        )

    def self_compose(self, count: int) -> DiscretePld:
        """The PLD of ``count`` independent runs.

        Binary powering by convolution (:meth:`compose`) while the operand is peaked, then
        one FFT raised to the remaining power (:func:`_fft_power`) once its rigorous
        floating-point error bound, which grows with the power and the operand's l2 norm,
        is below ``_POWER_SLACK``: a peaked one-step PLD of a small sampling rate would
        otherwise make that bound large (it is n times the FFT's own error).
        """
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        base = self
        n = int(count)
        factors: list[DiscretePld] = []  # base at the set bits of count passed so far
        sizes: list[tuple[float, float]] = []  # (mass, l2 norm) of each factor
        # Every level's powering ends in the same distribution: an estimate of its width
        # sizes the FFT in the error bound that decides when to stop squaring (the bound
        # added to slack is recomputed on the true window).
        width = _width_estimate(self, n) if n >= 2 else 0
        while n:
            if n >= 2:
                parts = [(base, n), *((f, 1) for f in factors)]
                base_size = _mass_and_norm(base)
                if _power_error(parts, (0, width), [base_size, *sizes]) <= _POWER_SLACK:
                    return _fft_power(parts)
            if n & 1:
                factors.append(base)
                sizes.append(_mass_and_norm(base))
            n >>= 1
            if n:
                base = base.compose(base)
        result = DiscretePld(interval=self.interval, offset=0, pmf=np.ones(1))
        for f in factors:
            result = result.compose(f)
        return result

    def reverse(self) -> DiscretePld:
        """The PLD of the reversed pair (Q, P): the add direction from the remove one.

        With L = log(P/Q) under P (law w, +inf atom included), the reversed pair's loss is
        -L under Q, and Q has density e^(-l) w(l) at the finite losses and mass
        1 - sum_l w(l) e^(-l) where P = 0 (loss +inf of the reversed pair). Exact for the
        pair this PLD stands for, so its delta is an upper bound on the reversed true
        pair's: reversing a post-processing is a post-processing (Blackwell), so a pair
        dominating (P, Q) reversed dominates (Q, P). Composing once and reversing replaces
        composing the second direction (issue 18).

        Soundness with round-off. Every PLD here stands for a dominating pair whose P-law
        w* lives on this grid range and +inf with (w*(inf) - inf_mass)_+ + ||w*_fin -
        pmf||_1 <= slack (each operation keeps that; it is what makes ``get_delta``
        sound). The reversed +inf atom is w*(inf) + sum_l w*(l) (1 - e^(-l)), bounded
        by inf_mass + sum_l pmf(l) (1 - e^(-l)) (rounded up) plus the error, and its
        finite part's error is sum_l |w* - pmf|(l) e^(-l): the new slack is
        max(1, 2 e^(-l_min) - 1) slack (l_min the lowest grid loss) plus the rounding of
        e^(-l) pmf(l).
        """
        pmf = self.pmf
        ell = self.losses
        if pmf.size == 0 or -float(ell[0]) > 700.0:  # e^(-l) would overflow: a vacuous PLD
            return DiscretePld(interval=self.interval, offset=0, pmf=np.zeros(1),
                               inf_mass=1.0)
        q_mass = pmf * np.exp(-ell)  # the Q-mass of each loss, within 4 u relative
        # sum_l pmf(l) (1 - e^(-l)), as one sum over the losses > 0 and one over the rest
        # (each of terms of one sign, up to round-off) and rounded up: every term is
        # within 5 u (pmf + Q-mass) of its exact value, the sums within _SUM_RTOL.
        k = int(np.searchsorted(ell, 0.0, side="right"))
        pos = float(np.sum(pmf[k:] - q_mass[k:]))
        neg = float(np.sum(q_mass[:k] - pmf[:k]))
        total_q = float(q_mass.sum())
        margin = (_SUM_RTOL * (abs(pos) + abs(neg))
                  + 8.0 * _UNIT_ROUNDOFF * (float(pmf.sum()) + total_q + self.inf_mass))
        inf_mass = self.inf_mass + (pos - neg) + margin
        mirrored = q_mass[::-1].copy()
        rounding = 4.0 * _UNIT_ROUNDOFF * total_q * (1.0 + _SUM_RTOL)
        grow = max(1.0, 2.0 * math.exp(-float(ell[0])) - 1.0)
        return DiscretePld(interval=self.interval, offset=-(self.offset + pmf.size - 1),
                           pmf=mirrored, inf_mass=min(max(inf_mass, 0.0), 1.0),
                           slack=grow * self.slack + rounding)

    def get_delta(self, epsilon: float) -> float:
        """delta at ``epsilon`` (an upper bound on the true pair's delta)."""
        if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not (
            epsilon >= 0
        ):
            raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
        if math.isinf(epsilon):
            return min(1.0, self.inf_mass + self.slack)
        tail = self._excess(self.losses, self.pmf, float(epsilon))
        return min(1.0, self.inf_mass + tail + self.slack)

    def get_epsilon(self, delta: float) -> float:
        """The smallest epsilon >= 0 with delta(epsilon) <= ``delta`` (inf if none)."""
        if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta <= 1:
            raise ValueError(f"delta must be in (0, 1], got {delta!r}")
        budget = delta - self.inf_mass - self.slack
        if budget <= 0:
            return math.inf
        ell = self.losses
        start = int(np.searchsorted(ell, 0.0, side="right"))  # only losses > 0 count
        ell, w = ell[start:], self.pmf[start:]
        if not w.any():
            return 0.0
        # excess(eps) = delta(eps) - inf - slack = sum_{l_i > eps} w_i (1 - e^(eps - l_i)),
        # continuous and decreasing; on [l_{j-1}, l_j] only atoms i >= j exceed eps, so
        # there excess = A_j - e^eps B_j with the suffix sums A_j = sum_{i>=j} w_i and B_j =
        # sum_{i>=j} w_i e^(-l_i).
        if float(ell[-1] - ell[0]) >= 700.0:  # e^l would overflow
            return self._epsilon_in_log_space(ell, w, budget)
        # Suffix sums by cumsum (sequential: relative error below (n - 1) u for n
        # non-negative terms), plus the exponentials' few u: rtol bounds them all.
        rtol = 1.01 * (w.size + 8) * _UNIT_ROUNDOFF
        a_sums = np.cumsum(w[::-1])[::-1] * (1.0 + rtol)
        b_sums = np.cumsum((w * np.exp(ell[0] - ell))[::-1])[::-1] * (1.0 - rtol)  # e^l_0 B
        # Upper bounds on excess(l_j); the first one within budget ends the cell.
        fits = a_sums - np.exp(ell - ell[0]) * b_sums <= budget
        if not fits.any():
            return float(ell[-1])  # excess(l_last) = 0: always within budget
        j = int(np.argmax(fits))
        lo = float(ell[j - 1]) if j > 0 else 0.0
        a, b = float(a_sums[j]), float(b_sums[j])
        if a <= budget or b <= 0:
            return lo
        # A - e^(eps - l_0) (e^l_0 B) = budget, nudged up past the rounding of the log.
        log_term = math.log((a - budget) / b)
        eps = float(ell[0]) + log_term
        eps += 4.0 * _UNIT_ROUNDOFF * (abs(float(ell[0])) + abs(log_term) + 1.0)
        return max(lo, min(eps, float(ell[j])))

    def _epsilon_in_log_space(self, ell: np.ndarray, w: np.ndarray, budget: float) -> float:
        """:meth:`get_epsilon` for a loss range too wide for e^l: locate the cell by
        cumulative sums in log space (only a guide), check it with direct sums, then solve
        exactly inside it."""
        s1_after = np.append(np.cumsum(w[::-1])[::-1][1:], 0.0)
        with np.errstate(divide="ignore"):
            log_s2 = np.logaddexp.accumulate((np.log(w) - ell)[::-1])[::-1]
        at_grid = s1_after - np.exp(ell + np.append(log_s2[1:], -math.inf))
        j = int(np.argmax(at_grid <= budget))  # the top grid point always qualifies
        while j > 0 and self._excess(ell, w, float(ell[j - 1])) <= budget:
            j -= 1
        while j < ell.size - 1 and self._excess(ell, w, float(ell[j])) > budget:
            j += 1
        if j == 0 and self._excess(ell, w, 0.0) <= budget:
            return 0.0
        a = float(np.sum(w[j:])) * (1.0 + _SUM_RTOL)
        b = float(np.sum(w[j:] * np.exp(-(ell[j:] - ell[j])))) * (1.0 - _SUM_RTOL)
        lo = float(ell[j - 1]) if j > 0 else 0.0
        if a <= budget or b <= 0:
            return lo
        eps = float(ell[j]) + math.log((a - budget) / b)
        return max(lo, min(eps, float(ell[j])))

    @staticmethod
    def _excess(ell: np.ndarray, w: np.ndarray, eps: float) -> float:
        """sum_{l_i > eps} w_i (1 - e^(eps - l_i)) over increasing ``ell``, rounded up (see
        ``_SUM_RTOL``)."""
        i = int(np.searchsorted(ell, eps, side="right"))  # ell[i:] > eps
        return float(np.sum(w[i:] * -np.expm1(eps - ell[i:]))) * (1.0 + _SUM_RTOL)


def _convolve(a: np.ndarray, b: np.ndarray | None) -> tuple[np.ndarray, float]:
    """Linear convolution of two non-negative vectors (b None: a with itself) and a bound
    on the l1 norm of its floating-point error.

    The error of an FFT convolution scales with ||a||_2 ||b||_2, which is large for the
    peaked one-step PLDs of small sampling rates, and every error is later multiplied by
    the number of times the result is composed. So each operand is split into its
    largest entries C (:func:`_split_core`) and the rest R, and each operand's body B (a
    window holding C and all but l2 norm ``_TAIL_NORM`` of it, :func:`_body`) from its
    thin tail T: conv(a, b) = conv(Ca, Bb) + conv(Ra restricted to Ba, Cb) [shifted copies
    summed pairwise, over the bodies] + conv(Ca, Tb) + conv(Ra restricted to Ta,
    Cb) + conv(Ra, Rb) [one FFT: every pair has a small l2 norm product]. Summing over
    the bodies only, not the whole tails (thousands of entries for the one-step PLD of a
    small sampling rate), is what makes it fast.
    """
    bb = a if b is None else b
    n = a.size + bb.size - 1
    mass = float(a.sum() * bb.sum())
    if min(a.size, bb.size) <= _CORE_MAX:
        out = np.convolve(a, bb)
        # Each output is a sum of <= m products of non-negatives: relative error <= 2 m u.
        err = 2.0 * min(a.size, bb.size) * _UNIT_ROUNDOFF * mass
        return np.maximum(out, 0.0), err
    core_a, rest_a = _split_core(a)
    core_b, rest_b = (core_a, rest_a) if b is None else _split_core(bb)
    lo_a, hi_a = _body(a, core_a)
    lo_b, hi_b = (lo_a, hi_a) if b is None else _body(bb, core_b)
    total = np.zeros(n)
    # The shifted copies, one row each, summed pairwise down the rows (a tree of depth
    # ceil(log2 rows)): relative error <= (depth + 1) u, the product's rounding included.
    rows = [(core_a + lo_b, a[core_a], bb[lo_b:hi_b]), (core_b + lo_a, bb[core_b],
                                                         rest_a[lo_a:hi_a])]
    rows = [r for r in rows if r[0].size]
    depth = 0
    if rows:
        lo = min(int(starts.min()) for starts, _, _ in rows)
        hi = max(int(starts.max()) + body.size for starts, _, body in rows)
        count = sum(starts.size for starts, _, _ in rows)
        depth = max(count - 1, 1).bit_length()
        grid = np.zeros((1 << depth, hi - lo))
        at = 0
        for starts, scales, body in rows:
            _place_rows(grid[at : at + starts.size], starts - lo, scales, body)
            at += starts.size
        while grid.shape[0] > 1:
            half = grid.shape[0] // 2
            grid = np.add(grid[:half], grid[half:], out=grid[:half])
        total[lo:hi] = grid[0]
    err = 1.01 * (depth + 1) * _UNIT_ROUNDOFF * mass
    pairs = []  # the FFT's operands: (x, y) with conv(x, y) a part of the result
    if core_a.size:
        tail_b = _outside(bb, lo_b, hi_b)
        pairs.append((_only(a, core_a), tail_b))
    if core_b.size:  # in a squaring the same pair again: Ra outside Ba is Ta
        pairs.append(pairs[0] if b is None else (_outside(rest_a, lo_a, hi_a),
                                                  _only(bb, core_b)))
    pairs.append((rest_a, rest_b))
    pairs = [(x, y) for x, y in pairs if x.any() and y.any()]
    if pairs:
        nfft = _fft_size(n)
        spectra: dict[int, np.ndarray] = {}

        def spectrum(x: np.ndarray) -> np.ndarray:
            if id(x) not in spectra:
                spectra[id(x)] = np.fft.rfft(x, nfft)
            return spectra[id(x)]

        acc = spectrum(pairs[0][0]) * spectrum(pairs[0][1])
        for x, y in pairs[1:]:
            acc += spectrum(x) * spectrum(y)
        fft_part = np.fft.irfft(acc, nfft)[:n]
        # FFT convolution error: ||err||_2 <= c log2(nfft) u ||x||_2 ||y||_2 per pair
        # (Higham, Accuracy and Stability of Numerical Algorithms, Sec. 24.1; c generous,
        # which also covers summing the pairs' spectra), and ||err||_1 <= sqrt(n)
        # ||err||_2. err2 also bounds every entry's error, so in the tails, beyond the
        # first and last entries above it, the FFT output is round-off noise that would
        # stop truncation: drop it, charging its mass to the bound (which keeps the l1
        # bound valid).
        err2 = _FFT_ERROR_CONSTANT * math.log2(nfft) * _UNIT_ROUNDOFF * sum(
            float(np.linalg.norm(x) * np.linalg.norm(y)) for x, y in pairs)
        err += math.sqrt(n) * err2
        above = np.flatnonzero(fft_part > err2)
        lo, hi = (int(above[0]), int(above[-1]) + 1) if above.size else (0, 0)
        for tail in (fft_part[:lo], fft_part[hi:]):
            err += float(np.sum(tail[tail > 0]))
            tail[:] = 0.0
        total += fft_part
        err += 2.0 * _UNIT_ROUNDOFF * mass  # the final addition
    return np.maximum(total, 0.0), err


def _place_rows(block: np.ndarray, cols: np.ndarray, scales: np.ndarray, body: np.ndarray) -> None:
    """block[i, cols[i]:cols[i] + body.size] = scales[i] * body for every row i.

    A peaked PMF's largest entries are consecutive indices; then the rows are a skewed
    copy, written through one strided view of the block (row stride width + 1), about
    ten times as fast as the fancy-indexed assignment used otherwise.
    """
    order = np.argsort(cols, kind="stable")
    cols, scales = cols[order], scales[order]
    rows, width = block.shape
    if rows > 1 and int(cols[-1]) - int(cols[0]) == rows - 1:
        flat = block.reshape(-1)
        view = np.lib.stride_tricks.as_strided(
            flat[int(cols[0]):], shape=(rows, body.size),
            strides=((width + 1) * flat.itemsize, flat.itemsize), writeable=True)
        np.multiply(scales[:, None], body, out=view)
        return
    block[np.arange(rows)[:, None], cols[:, None] + np.arange(body.size)] = (
        scales[:, None] * body)


def _body(x: np.ndarray, core: np.ndarray) -> tuple[int, int]:
    """The window [lo, hi) of ``x`` holding ``core`` and all of ``x`` but entries of l2
    norm at most ``_TAIL_NORM`` (half of its square on each side; the whole vector when
    ``core`` is empty)."""
    if core.size == 0:
        return 0, x.size
    below = np.concatenate(([0.0], np.cumsum(x * x)))  # below[i]: squares of x[:i]
    half = 0.5 * _TAIL_NORM**2 * (1.0 - 1e-9)  # the margin absorbs the cumsum's rounding
    lo = min(int(np.searchsorted(below, half, side="right")) - 1, int(core.min()))
    above = below[-1] - below  # above[i]: squares of x[i:]
    hi = max(int(np.searchsorted(-above, -half, side="left")), int(core.max()) + 1)
    return max(lo, 0), min(hi, x.size)

def _outside(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``x`` with [lo, hi) set to zero (a copy)."""
    out = x.copy()
    out[lo:hi] = 0.0
    return out


def _only(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Zeros but ``x`` at ``idx``."""
    out = np.zeros_like(x)
    out[idx] = x[idx]
    return out

def _log_mgf(pld: DiscretePld, lams: np.ndarray, center: float) -> np.ndarray:
    """Upper bounds on log sum_i p_i e^(lam (k_i - center)) over the grid indices k_i, one
    per ``lam``, for every pmf within l1 distance ``pld.slack`` of ``pld.pmf`` on the same
    support.

    The grid is arithmetic, so the pmf is cut into chunks of B entries: one matrix product
    with e^(lam j), j < B, sums every chunk (no exponential per entry), and the chunks'
    sums, weighted by e^(lam (k_chunk - center)), are added in log space. B keeps
    |lam| j <= 500: no overflow, no underflow.
    """
    pmf = pld.pmf
    size = pmf.size
    reach = float(np.max(np.abs(lams)))
    block = max(1, min(256, int(500.0 / reach) if reach > 0 else 256, size))
    chunks = -(-size // block)
    padded = np.zeros(chunks * block)
    padded[:size] = pmf
    sums = padded.reshape(chunks, block) @ np.exp(np.outer(np.arange(block), lams))
    starts = pld.offset + block * np.arange(chunks) - center
    with np.errstate(divide="ignore"):
        v = np.log(sums) + starts[:, None] * lams[None, :]  # (chunks, lams)
    top = np.max(v, axis=0)
    s = top + np.log(np.sum(np.exp(v - top[None, :]), axis=0))
    if pld.slack > 0:
        idx_lo, idx_hi = pld.offset - center, pld.offset + size - 1 - center
        far = np.where(lams > 0, idx_hi, idx_lo)  # where e^(lam k) is largest
        s = np.logaddexp(s, math.log(pld.slack) + lams * far)
    # Round-off of the products, sums and logs: relative error below (size + 2) u (the
    # sums have non-negative terms), taken generously.
    return s + 4.0 * (size + 2) * _UNIT_ROUNDOFF


def _width_estimate(pld: DiscretePld, count: int) -> int:
    """Grid points spanned by ``count`` runs of ``pld``: 20 standard deviations plus one run's
    support (only sizes a decision; nothing rests on it)."""
    mass = float(pld.pmf.sum())
    if not mass > 0:
        return pld.pmf.size
    w = pld.pmf / mass
    idx = np.arange(pld.pmf.size)
    var = float(np.dot(w, (idx - float(np.dot(w, idx))) ** 2))
    return int(20.0 * math.sqrt(count * var)) + pld.pmf.size


Parts = list[tuple[DiscretePld, int]]  # PLDs and how many times each is composed


def _support(parts: Parts) -> tuple[int, int]:
    """The first and last grid index of the finite part of the composition of ``parts``."""
    return (sum(c * p.offset for p, c in parts),
            sum(c * (p.offset + p.pmf.size - 1) for p, c in parts))


def _power_window(parts: Parts) -> tuple[int, int, float]:
    """Grid indices [lo, hi] holding all but at most ``_TAIL_MASS`` on each side of the
    finite part of the composition of ``parts``, and the tail mass charged.

    Chernoff bounds, mass(k > hi) <= e^(-lam hi) E[e^(lam k)] for every lam > 0 (and the
    mirror image below), evaluated on a geometric set of lam around the Gaussian optimum;
    every moment generating function is bounded from above (:func:`_log_mgf`), so the
    window is valid for the true pmfs, not only for the computed ones.
    """
    var, center, stats = 0.0, 0.0, []
    for pld, count in parts:
        w = pld.pmf / pld.pmf.sum()
        idx = pld.offset + np.arange(pld.pmf.size)
        mean = float(np.dot(w, idx))
        stats.append((pld, count, mean))
        center += count * mean
        var += count * float(np.dot(w, (idx - mean) ** 2))
    lam0 = math.sqrt(2.0 * math.log(1.0 / _TAIL_MASS)) / max(math.sqrt(var), 1.0)
    lams = lam0 * 2.0 ** np.arange(-2.0, 3.0)
    lams = np.concatenate((lams, -lams))
    log_m = sum(count * _log_mgf(pld, lams, mean) for pld, count, mean in stats)
    reach = (log_m - math.log(_TAIL_MASS)) / np.abs(lams)  # distance from the center
    up, down = float(np.min(reach[:5])), float(np.min(reach[5:]))
    support = _support(parts)
    lo = max(support[0], math.floor(center - down)) if math.isfinite(down) else support[0]
    hi = min(support[1], math.ceil(center + up)) if math.isfinite(up) else support[1]
    charged = (_TAIL_MASS if lo > support[0] else 0.0) + (_TAIL_MASS if hi < support[1] else 0.0)
    return lo, hi, charged


def _mass_and_norm(pld: DiscretePld) -> tuple[float, float]:
    return float(pld.pmf.sum()), float(np.linalg.norm(pld.pmf))


def _fft_size_for(parts: Parts, window: tuple[int, int]) -> int:
    return _fft_size(max(window[1] - window[0] + 1, *(p.pmf.size for p, _ in parts)))


def _power_error(parts: Parts, window: tuple[int, int],
                 sizes: list[tuple[float, float]] | None = None) -> float:
    """The l1 round-off bound of :func:`_fft_power` on a window of that size.

    With u the unit round-off, N the FFT length, g = c u log2 N the FFT's relative l2
    error bound (Higham, Accuracy and Stability of Numerical Algorithms, Sec. 24.1), the
    parts a_j (each raised to m_j), R_j >= max |DFT(a_j)_k| (mass(a_j) + g sqrt(N)
    ||a_j||_2), Pi = prod_j R_j^(m_j), P the computed spectrum and T the exact one
    (Parseval: a spectrum's l2 norm is sqrt(N) that of its vector), replacing one factor
    at a time (the others bounded by R):

        ||out - exact||_1 <= sqrt(N) ||out - exact||_2 <= ||P - T||_2 + g ||P||_2,
        ||P - T||_2 <= sum_j m_j (Pi / R_j) g sqrt(N) ||a_j||_2 + e ||P||_2,
        ||P||_2 <= (Pi / R_j) (1 + g) sqrt(N) ||a_j||_2 for every j (the smallest taken),

    e = 1.01 (sum_j m_j + 1) sqrt(5) u: a complex product's relative error is at most
    sqrt(5) u (Brent, Percival, Zimmermann 2007), and the relative errors add along the
    products (binary powering needs fewer than m_j for a_j^(m_j)).

    ``sizes``: each part's :func:`_mass_and_norm`, if already known.
    """
    if sizes is None:
        sizes = [_mass_and_norm(pld) for pld, _ in parts]
    stats = [(count, *size) for (_, count), size in zip(parts, sizes, strict=True)]
    if not all(mass > 0 for _, mass, _ in stats):  # all mass at +inf: nothing to transform
        return math.inf
    n_fft = _fft_size_for(parts, window)
    g = _FFT_ERROR_CONSTANT * math.log2(max(n_fft, 2)) * _UNIT_ROUNDOFF
    root_n = math.sqrt(n_fft)
    rows = [(count, mass + g * root_n * norm, norm)  # (count, radius R, l2 norm) per part
            for count, mass, norm in stats]
    total = math.prod(r**c for c, r, _ in rows)
    e = 1.01 * (sum(c for c, _, _ in rows) + 1) * math.sqrt(5.0) * _UNIT_ROUNDOFF
    p_norm = min(total / r * (1.0 + g) * root_n * norm for _, r, norm in rows)
    spectra = sum(c * total / r * g * root_n * norm for c, r, norm in rows)
    return spectra + e * p_norm + g * (1.0 + e) * p_norm


def _fft_power(parts: Parts) -> DiscretePld:
    """The composition of ``parts`` (each PLD composed its count of times) by one FFT: the
    product of their DFTs, each raised to its count (binary powering, elementwise),
    transformed back; its round-off bound (:func:`_power_error`) is added to ``slack``.

    Used with the operand of the last squaring raised to the remaining power and the
    operands of the set bits below it once each: those need no convolution of their own.

    The transform is cyclic, of a length N holding the Chernoff window
    (:func:`_power_window`): mass outside it (at most ``_TAIL_MASS`` a side) folds onto
    the window, which only adds non-negative mass, and is also charged to the +inf atom
    (pessimistic twice over).
    """
    lo, hi, charged = _power_window(parts)
    n_fft = _fft_size_for(parts, (lo, hi))
    err = _power_error(parts, (lo, hi))
    acc = None
    for pld, count in sorted(parts, key=lambda pc: pc[1]):
        spectrum = np.fft.rfft(pld.pmf, n_fft)
        m = count
        while m:  # acc *= spectrum^count by squaring, in place
            if m & 1:
                if acc is None:
                    acc = spectrum.copy() if m > 1 else spectrum
                else:
                    acc *= spectrum
            m >>= 1
            if m:
                np.multiply(spectrum, spectrum, out=spectrum)
    cyclic = np.fft.irfft(acc, n_fft)
    # Linear index k sits at cyclic position (k - start) mod N.
    start = _support(parts)[0]
    pmf = np.maximum(np.roll(cyclic, start - lo)[: hi - lo + 1], 0.0)
    # Input slack: ||prod_j a'_j^(m_j) - prod_j a_j^(m_j)||_1 <= prod_j (M_j + s_j)^(m_j)
    # - prod_j M_j^(m_j), the masses M_j taken as at least 1 (part of a slack may sit in
    # the +inf atom: see DiscretePld.reverse).
    log_mass, log_grown = 0.0, 0.0
    for pld, count in parts:
        mass = max(float(pld.pmf.sum()), 1.0)
        log_mass += count * math.log(mass)
        log_grown += count * math.log1p(pld.slack / mass)
    grown = math.exp(log_mass) * math.expm1(log_grown)
    # The folded mass (at most `charged`) also sits on the window, where the tails moved
    # to its ends and to +inf would be: an l1 error of twice that, negligible but charged
    # (the reversed PLD relies on it; the +inf atom alone covers this direction).
    slack = grown + err + 2.0 * charged
    kept = math.prod((1.0 - p.inf_mass) ** c for p, c in parts)
    inf_mass = 1.0 - kept + charged
    return _truncate(DiscretePld(interval=parts[0][0].interval, offset=lo, pmf=pmf,
                                 inf_mass=min(inf_mass, 1.0), slack=slack))


def _split_core(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the largest entries of ``a`` and ``a`` without them.

    None if ``a`` is already spread out (l2 norm <= ``_SPREAD_NORM``); else as few as
    possible (from ``_CORE`` up to ``_CORE_MAX``) such that the rest has l2 norm at most
    ``_REST_NORM``: that norm sets the FFT error (see :func:`_convolve`).
    """
    if float(np.linalg.norm(a)) <= _SPREAD_NORM:  # spread out: the FFT alone is accurate
        return np.zeros(0, dtype=np.intp), a
    top = min(_CORE_MAX, a.size)
    largest = np.argpartition(a, -top)[-top:]
    largest = largest[np.argsort(a[largest])[::-1]]  # descending
    # Squared l2 norm of the rest once the k largest are out, for every k (a guide only:
    # the FFT's error bound uses the norm of the rest as it is).
    rest_sq = float(np.dot(a, a)) - np.cumsum(a[largest] ** 2)
    k = _CORE
    while k < top and rest_sq[k - 1] > _REST_NORM**2:
        k *= 2
    core = largest[: min(k, top)]
    rest = a.copy()
    rest[core] = 0.0
    return core, rest


@functools.lru_cache(maxsize=256)
def _fft_size(n: int) -> int:
    """The smallest 2^a 3^b 5^c >= n (fast sizes for numpy's FFT)."""
    best = 1 << (n - 1).bit_length()
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            m = p35
            while m < n:
                m *= 2
            best = min(best, m)
            p35 *= 3
        p5 *= 5
    return best


def _light_prefix(x: np.ndarray, tail: float) -> tuple[int, float]:
    """The longest prefix of ``x`` with (cumulative) mass <= ``tail``: its length and mass.

    Prefixes of growing length are summed until the crossing is inside one, so the cost
    follows the tail, not the whole vector (same sums as one cumsum over it)."""
    k = 256
    while True:
        csum = np.cumsum(x[:k])
        i = int(np.searchsorted(csum, tail, side="right"))
        if i < csum.size or csum.size == x.size:
            return i, float(csum[i - 1]) if i > 0 else 0.0
        k *= 4


def _truncate(pld: DiscretePld, tail: float = _TAIL_MASS) -> DiscretePld:
    """Cut tails of mass <= ``tail``: the top to +inf, the bottom moved up (pessimistic)."""
    pmf = pld.pmf
    if pmf.size <= 1:
        return pld
    lo, moved_up = _light_prefix(pmf, tail)  # pmf[:lo] has mass <= tail
    cut, to_inf = _light_prefix(pmf[::-1], tail)  # so have the top `cut` entries
    hi = pmf.size - cut
    if lo >= hi:  # degenerate: keep everything
        return pld
    new = pmf[lo:hi].copy()
    new[0] += moved_up
    return DiscretePld(
        interval=pld.interval,
        offset=pld.offset + lo,
        pmf=new,
        inf_mass=pld.inf_mass + to_inf,
        slack=pld.slack,
    )


def _loss(x: np.ndarray, q: float, z: float) -> np.ndarray:
    """Privacy loss log(P/Q)(x) of the remove pair, increasing in x."""
    t = (2.0 * x - 1.0) / (2.0 * z * z)
    if q == 1.0:
        return t
    return np.logaddexp(math.log1p(-q), math.log(q) + t)


def _inverse_loss(ell: np.ndarray, q: float, z: float) -> np.ndarray:
    """x with loss(x) = ell (-inf below the loss's lower bound log(1 - q))."""
    if q == 1.0:
        return ell * z * z + 0.5
    out = np.full(ell.shape, -math.inf)
    ok = ell > math.log1p(-q)
    # e^ell - (1 - q) = e^ell (1 - e^(log(1-q) - ell)), kept in log space.
    log_excess = ell[ok] + np.log(-np.expm1(math.log1p(-q) - ell[ok]))
    out[ok] = z * z * (log_excess - math.log(q)) + 0.5
    return out


def _cell_masses(edges: np.ndarray, mean: float, z: float) -> np.ndarray:
    """N(mean, z^2) mass of each cell (edges[k], edges[k+1]] of increasing ``edges``,
    accurate in both tails: one normal tail per edge, the lower one below the mean and the
    upper one above it (the cell holding the mean is 1 minus both)."""
    t = (edges - mean) / z
    upper = t >= 0
    tail = np.empty(t.shape)
    tail[upper] = sf_normal(t[upper])
    tail[~upper] = ndtr(t[~upper])
    lo_up, hi_up = upper[:-1], upper[1:]
    out = np.where(lo_up, tail[:-1] - tail[1:], tail[1:] - tail[:-1])
    straddle = ~lo_up & hi_up
    out[straddle] = 1.0 - tail[1:][straddle] - tail[:-1][straddle]
    return np.maximum(out, 0.0)

def _split(a: np.ndarray, b: np.ndarray, lo_loss: np.ndarray, interval: float) -> np.ndarray:
    """P-mass put on the upper end point when (a, b) is split over [lo, lo + interval].

    Solves p_lo + p_hi = a, p_lo e^-lo + p_hi e^-(lo + h) = b. Clipped to [0, a]: the
    lower clip only removes Q-mass (pessimistic); the upper one absorbs round-off.
    """
    with np.errstate(divide="ignore"):
        b_scaled = np.exp(np.log(b) + lo_loss)  # b e^lo without overflow
    p_hi = (a - b_scaled) / -np.expm1(-interval)
    return np.clip(p_hi, 0.0, a)


def _upper_x(q: float, z: float) -> float:
    """The smallest x <= 1 + 8.5 z (to 1e-9 z) above which the remove pair's P-mass,
    (1 - q) Pr[N(0, z^2) > x] + q Pr[N(1, z^2) > x], is at most 1e-17.

    For a small q the N(1, z^2) component's weight q leaves that tail far below 1e-17 at
    1 + 8.5 z, and the privacy loss grows linearly in x up there: the cells above x carry
    almost no mass (a step's truncation would cut them) yet are most of the grid. Any x
    is sound (the mass above it is the +inf atom); this one only saves the work.
    """
    def tail(x: float) -> float:
        return ((1.0 - q) * 0.5 * math.erfc(x / z / math.sqrt(2.0))
                + q * 0.5 * math.erfc((x - 1.0) / z / math.sqrt(2.0)))

    lo, hi = 0.0, 1.0 + _X_TAIL * z  # tail(lo) > 1e-17 >= tail(hi)
    if tail(hi) > _GRID_TAIL:
        return hi
    while hi - lo > 1e-9 * z:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if tail(mid) <= _GRID_TAIL else (mid, hi)
    return hi


@functools.lru_cache(maxsize=8)
def _grid_masses(
    z: float, q: float, interval: float
) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    """The loss grid of the remove pair and the P- and Q-mass of each of its cells (and
    the two tails), shared by both directions (read-only arrays)."""
    x_bounds = np.array([-_X_TAIL * z, _upper_x(q, z)])
    l_lo, l_hi = _loss(x_bounds, q, z)
    k_lo, k_hi = math.floor(l_lo / interval), math.ceil(l_hi / interval)
    grid = np.arange(k_lo, k_hi + 1) * interval  # K + 1 end points, K cells
    xs = _inverse_loss(grid, q, z)
    # Cells (x_k, x_{k+1}], plus the tails (-inf, x_0] and (x_K, inf).
    edges = np.concatenate(([-math.inf], xs, [math.inf]))
    q_mass = _cell_masses(edges, 0.0, z)  # Q = N(0, z^2)
    if q == 1.0:
        p_mass = _cell_masses(edges, 1.0, z)
    else:
        p_mass = (1.0 - q) * q_mass + q * _cell_masses(edges, 1.0, z)
    for arr in (grid, p_mass, q_mass):
        arr.flags.writeable = False
    return k_lo, k_hi, grid, p_mass, q_mass


def discretize_subsampled_gaussian(
    noise_multiplier: float,
    sample_rate: float,
    interval: float,
    *,
    direction: Direction = "remove",
) -> DiscretePld:
    """Pessimistic discrete PLD of one Poisson-subsampled Gaussian release.

    Remove direction: P = (1 - q) N(0, z^2) + q N(1, z^2), Q = N(0, z^2), loss
    log((1 - q) + q exp((2x - 1) / (2 z^2))). Add direction: the same pair reversed. With
    q = 1 this is the plain Gaussian (both directions alike).

    Args:
        noise_multiplier: z > 0, noise std / L2 sensitivity.
        sample_rate: Poisson rate q in (0, 1].
        interval: grid spacing in nats (> 0).
        direction: ``"remove"`` or ``"add"``.

    Returns:
        A PLD whose pair dominates the true one (see the module docstring).
    """
    z, q = noise_multiplier, sample_rate
    if isinstance(z, bool) or not isinstance(z, numbers.Real) or not (
        math.isfinite(z) and z > 0
    ):
        raise ValueError(f"noise_multiplier must be finite and > 0, got {z!r}")
    if isinstance(q, bool) or not isinstance(q, numbers.Real) or not 0 < q <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {q!r}")
    if not (math.isfinite(interval) and interval > 0):
        raise ValueError(f"interval must be finite and > 0, got {interval!r}")
    if direction not in ("remove", "add"):
        raise ValueError(f"direction must be 'remove' or 'add', got {direction!r}")
    k_lo, k_hi, grid, p_mass, q_mass = _grid_masses(float(z), float(q), float(interval))
    low_p, low_q = p_mass[0], q_mass[0]
    top_p, top_q = p_mass[-1], q_mass[-1]
    a, b = p_mass[1:-1], q_mass[1:-1]  # cell k: loss in (grid[k], grid[k+1]]
    if direction == "remove":
        hi_part = _split(a, b, grid[:-1], interval)
        pmf = np.zeros(grid.size)
        pmf[1:] += hi_part
        pmf[:-1] += a - hi_part
        pmf[0] += low_p  # losses below the grid, moved up to its lowest point
        return DiscretePld(interval=interval, offset=k_lo, pmf=pmf, inf_mass=float(top_p))
    # Add: loss -l, P-mass b, Q-mass a; cell k becomes (-grid[k+1], -grid[k]].
    neg_lo = -grid[1:]
    hi_part = _split(b, a, neg_lo, interval)  # mass at -grid[k]
    pmf_rev = np.zeros(grid.size)  # index i <-> loss -grid[i]
    pmf_rev[:-1] += hi_part
    pmf_rev[1:] += b - hi_part
    pmf_rev[-1] += top_q  # x above the grid: losses below -grid[K], moved up to it
    return DiscretePld(
        interval=interval, offset=-k_hi, pmf=pmf_rev[::-1].copy(), inf_mass=float(low_q)
    )


# ------------------------------------------------------------------------- accountant


def _leaves(event: Event, count: int, out: dict[tuple[float, float], int]) -> None:
    if isinstance(event, Composed):
        for e in event.events:
            _leaves(e, count, out)
    elif isinstance(event, SelfComposed):
        _leaves(event.event, count * event.count, out)
    elif isinstance(event, Gaussian):
        key = (float(event.noise_multiplier), 1.0)
        out[key] = out.get(key, 0) + count * event.steps
    elif isinstance(event, PoissonSubsampledGaussian):
        key = (float(event.noise_multiplier), float(event.sample_rate))
        out[key] = out.get(key, 0) + count * event.steps
    elif isinstance(event, SampledWithoutReplacementGaussian):
        raise UnsupportedEventError(
            "SampledWithoutReplacementGaussian (substitution adjacency) is not supported by "
            "the PLD accountant (add/remove); use RdpAccountant(adjacency='substitution')"
        )
    elif isinstance(event, Binomial):
        raise UnsupportedEventError(
            "Binomial (cpSGD) is not supported by the PLD accountant: it has no single "
            "privacy loss distribution here, only a restricted Renyi moment with an additive "
            "delta0; use RdpAccountant(orders=event.orders)")
    else:  # the discrete events: no PLD here; RdpAccountant takes them
        raise UnsupportedEventError(f"unsupported privacy event {event!r}")


def _counts_of(event: object, count: int, adjacency: Adjacency) -> dict[tuple[float, float], int]:
    """{(z, q): runs} of ``count`` runs of ``event`` restated under ``adjacency``; pure, so a
    rejected event changes nothing. Raises UnsupportedEventError."""
    if not isinstance(event, _EVENT_TYPES):
        raise UnsupportedEventError(f"unsupported privacy event {event!r}")
    if not isinstance(event, SampledWithoutReplacementGaussian):
        event = restate(event, adjacency)
    found: dict[tuple[float, float], int] = {}
    _leaves(event, count, found)
    return found


def _loss_std(z: float, q: float) -> float:
    """Standard deviation of one step's privacy loss (remove pair), by quadrature in x."""
    x = np.linspace(-_X_TAIL * z, 1.0 + _X_TAIL * z, 8001)
    dens = (1.0 - q) * np.exp(-0.5 * (x / z) ** 2) + q * np.exp(-0.5 * ((x - 1.0) / z) ** 2)
    w = dens / dens.sum()
    ell = _loss(x, q, z)
    mean = float(np.dot(w, ell))
    return math.sqrt(max(float(np.dot(w, (ell - mean) ** 2)), 0.0))


class PldAccountant:
    """PLD accountant (add/remove or zero-out adjacency): the tightest epsilon we give, an
    upper bound.

    Under zero-out the Gaussian and Poisson-subsampled Gaussian have exactly their add/remove
    privacy loss distributions (a zero-out pair is a remove pair for mechanisms that ignore
    the null record; :mod:`edge_sdk.privacy.events`, rule 2), so the same computation serves
    both; every event is first restated under the accountant's adjacency.

    Events are recorded as data; the composed PLD is built on demand (and cached), which
    lets the grid be chosen for the whole composition. By default (``None``) the spacing
    is 1/50 of the smallest per-step loss standard deviation (the connect-the-dots error
    grows like (spacing / std)^2: a few 1e-5 relative in epsilon); a given spacing is used
    as is. Either way, if the composed loss would need more than ``max_bins`` grid points
    the grid is coarsened (still sound, only looser).

    Args:
        value_discretization_interval: grid spacing in nats, or None (default) for automatic.
        max_bins: cap on the number of grid points of a composed PLD (default 2**21).
        adjacency: ``"add_remove"`` (default) or ``"zero_out"``.
    """

    __slots__ = ("_adjacency", "_add_cache", "_cache", "_counts", "_interval", "_max_bins")

    def __init__(
        self, *, value_discretization_interval: float | None = None, max_bins: int = 1 << 21,
        adjacency: Adjacency = "add_remove",
    ) -> None:
        if adjacency not in ("add_remove", "zero_out"):
            raise ValueError(f"the PLD accountant supports adjacency 'add_remove' or 'zero_out', "
                             f"got {adjacency!r}")
        self._adjacency = adjacency
        h = value_discretization_interval
        if h is not None and (isinstance(h, bool) or not isinstance(h, numbers.Real) or not (
            math.isfinite(h) and h > 0
        )):
            raise ValueError(f"value_discretization_interval must be > 0 or None, got {h!r}")
        if isinstance(max_bins, bool) or not isinstance(max_bins, numbers.Integral) or (
            max_bins < 1024
        ):
            raise ValueError(f"max_bins must be an integer >= 1024, got {max_bins!r}")
        self._interval = None if h is None else float(h)
        self._max_bins = int(max_bins)
        self._counts: dict[tuple[float, float], int] = {}
        self._cache: tuple[tuple, tuple[DiscretePld, DiscretePld] | None] | None = None
        self._add_cache: tuple[tuple, DiscretePld] | None = None

    def __repr__(self) -> str:
        return (
            f"PldAccountant(value_discretization_interval={self._interval!r}, "
            f"events={len(self._counts)})"
        )

    def supports(self, event: object) -> bool:
        """Whether :meth:`compose` takes ``event``: Gaussian and Poisson-subsampled Gaussian
        leaves (in Composed / SelfComposed too) that restate under this adjacency; not
        sampling without replacement, not the discrete events."""
        try:
            _counts_of(event, 1, self._adjacency)
        except UnsupportedEventError:
            return False
        return True

    def compose(self, event: Event, count: int = 1) -> PldAccountant:
        """Add ``count`` runs of ``event``; returns self. Nothing changes if it raises.

        Raises:
            UnsupportedEventError: :meth:`supports` is False.
            ValueError: bad ``count``.
        """
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        found = _counts_of(event, int(count), self._adjacency)
        for key, n in found.items():
            if n:
                self._counts[key] = self._counts.get(key, 0) + n
        return self

    def _state(self) -> tuple:
        return tuple(sorted(self._counts.items()))

    def _plds(self) -> tuple[DiscretePld, DiscretePld] | None:
        """(remove, add) PLDs, the add one the composed remove PLD reversed (a fast upper
        bound, :meth:`DiscretePld.reverse`); None when some event has no noise (eps = inf).
        """
        state = self._state()
        if self._cache is not None and self._cache[0] == state:
            return self._cache[1]
        result: tuple[DiscretePld, DiscretePld] | None
        if any(z == 0 for (z, _q) in self._counts):
            result = None
        else:
            remove = self._compose("remove")
            # With q = 1 throughout, the add pair is the remove pair mirrored: same PLD.
            same = all(q == 1.0 for (_z, q) in self._counts)
            result = (remove, remove if same else remove.reverse())
        self._cache = (state, result)
        return result

    def _add_pld(self) -> DiscretePld:
        """The add direction composed on its own (cached): needed only where the reversed
        remove PLD's larger slack could decide the answer (see :meth:`get_epsilon`)."""
        state = self._state()
        if self._add_cache is None or self._add_cache[0] != state:
            self._add_cache = (state, self._compose("add"))
        return self._add_cache[1]

    def _compose(self, direction: Direction) -> DiscretePld:
        h = self._choose_interval()
        total = DiscretePld(interval=h, offset=0, pmf=np.ones(1))
        for (z, q), n in self._state():
            step = discretize_subsampled_gaussian(z, q, h, direction=direction)
            total = total.compose(_truncate(step).self_compose(n))
        return total

    def _choose_interval(self) -> float:
        """The grid spacing: requested or automatic, coarsened if the loss is too wide.

        The composed loss has variance sum_k n_k std_k^2; 24 standard deviations plus the
        widest single step must fit in ``max_bins`` grid points.
        """
        if not self._counts:
            return self._interval or 1e-4
        stds = {key: _loss_std(*key) for key in self._counts}
        if self._interval is None:
            h = min(max(_AUTO_INTERVAL_FRACTION * min(stds.values()), 1e-7), 0.05)
        else:
            h = self._interval
        var = sum(n * stds[key] ** 2 for key, n in self._counts.items())
        width_one = max(
            (2.0 * _X_TAIL * z + 1.0) / (z * z) if q == 1.0 else
            float(np.ptp(_loss(np.array([-_X_TAIL * z, 1.0 + _X_TAIL * z]), q, z)))
            for (z, q) in self._counts
        )
        width = 24.0 * math.sqrt(var) + width_one
        return max(h, width / self._max_bins)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon at ``delta``: the max over the add and remove directions (upper bound;
        the add direction bounded as in :meth:`_larger`)."""
        if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta <= 1:
            raise ValueError(f"delta must be in (0, 1], got {delta!r}")
        if self._plds() is None:
            return math.inf
        return self._larger(lambda pld: pld.get_epsilon(delta))

    def get_delta(self, epsilon: float) -> float:
        """delta at ``epsilon``: the max over the add and remove directions (upper bound;
        the add direction bounded as in :meth:`_larger`)."""
        if self._plds() is None:
            if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not (
                epsilon >= 0
            ):
                raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
            return 1.0
        return self._larger(lambda pld: pld.get_delta(epsilon))

    def _larger(self, bound: Callable[[DiscretePld], float]) -> float:
        """The larger of ``bound`` (an upper bound read off a PLD: epsilon at a delta, or
        delta at an epsilon) over the two directions.

        The add direction is first bounded by the reversed remove PLD, whose slack is
        larger (``DiscretePld.reverse``); only if that bound exceeds the remove direction's
        is the add direction composed on its own, and the smaller of its two upper bounds
        taken. Subsampled Gaussians are usually decided by the remove direction: one
        composition, not two (issue 18).
        """
        plds = self._plds()
        assert plds is not None
        remove, add = plds
        value = bound(remove)
        if add is remove:
            return value
        value_add = bound(add)
        if value_add > value:
            value_add = min(value_add, bound(self._add_pld()))
        return max(value, value_add)
