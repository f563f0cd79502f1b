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
remaining power is below 5e-11, by that single FFT power on a window sized by Chernoff
bounds (its outside folds onto it and is also charged to +inf); `fedge bench
accountant` times it against dp_accounting. The price is a slack of about 1e-10 at
70,000 steps of q = 1e-3 (5.6e-11 with compensated sums and squaring throughout):
invisible at delta = 1e-5, 0.03% of epsilon at delta = 1e-8.

Scope: the Gaussian and the Poisson-subsampled Gaussian under add/remove adjacency; both
directions (remove: P = (1-q) N(0, z^2) + q N(1, z^2) vs Q = N(0, z^2); add: the reverse)
are composed separately and the larger epsilon is reported.
"""

from __future__ import annotations

import functools
import math
import numbers
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
        slack: a bound on the l1 floating-point error of ``pmf``, added to every delta.
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
        mass_a, mass_b = float(self.pmf.sum()), float(other.pmf.sum())
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
        result = DiscretePld(interval=self.interval, offset=0, pmf=np.ones(1))
        base = self
        n = int(count)
        # Every level's powering ends in the same distribution: an estimate of its width
        # sizes the FFT in the error bound that decides when to stop squaring (the bound
        # added to slack is recomputed on the true window).
        width = _width_estimate(self, n) if n >= 2 else 0
        while n:
            if n >= 2 and _power_error(base, n, result, (0, width)) <= _POWER_SLACK:
                return _fft_power(base, n, result)
            if n & 1:
                result = result.compose(base)
            n >>= 1
            if n:
                base = base.compose(base)
        return result

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
        keep = (ell > 0) & (self.pmf > 0)
        ell, w = ell[keep], self.pmf[keep]
        if w.size == 0:
            return 0.0
        # excess(eps) = delta(eps) - inf - slack = sum_{l_i > eps} w_i (1 - e^(eps - l_i)),
        # continuous and decreasing. Locate the grid cell where it crosses the budget
        # (cumulative sums, the second one in log space so that e^l never overflows), check
        # the cell with direct sums, then solve exactly inside it.
        if self._excess(ell, w, 0.0) <= budget:
            return 0.0
        s1_after = np.append(np.cumsum(w[::-1])[::-1][1:], 0.0)
        with np.errstate(divide="ignore"):
            log_s2 = np.logaddexp.accumulate((np.log(w) - ell)[::-1])[::-1]
        log_s2_after = np.append(log_s2[1:], -math.inf)
        at_grid = s1_after - np.exp(ell + log_s2_after)
        j = int(np.argmax(at_grid <= budget))  # the top grid point always qualifies
        while j > 0 and self._excess(ell, w, float(ell[j - 1])) <= budget:
            j -= 1
        while j < ell.size - 1 and self._excess(ell, w, float(ell[j])) > budget:
            j += 1
        # On [l_{j-1}, l_j] only atoms i >= j exceed eps: excess = A - e^eps B.
        a = float(np.sum(w[j:])) * (1.0 + _SUM_RTOL)
        b = float(np.sum(w[j:] * np.exp(-(ell[j:] - ell[j])))) * (1.0 - _SUM_RTOL)
        lo = float(ell[j - 1]) if j > 0 else 0.0
        if a <= budget or b <= 0:
            return lo
        eps = float(ell[j]) + math.log((a - budget) / b)
        return max(lo, min(eps, float(ell[j])))

    @staticmethod
    def _excess(ell: np.ndarray, w: np.ndarray, eps: float) -> float:
        """sum_{l_i > eps} w_i (1 - e^(eps - l_i)), rounded up (see ``_SUM_RTOL``)."""
        above = ell > eps
        return float(np.sum(w[above] * -np.expm1(eps - ell[above]))) * (1.0 + _SUM_RTOL)


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

def _log_mgf(pld: DiscretePld, lam: float, center: float, log_pmf: np.ndarray) -> float:
    """An upper bound on log sum_i p_i e^(lam (k_i - center)) over the grid indices k_i, for
    every pmf within l1 distance ``pld.slack`` of ``pld.pmf`` on the same support."""
    idx = pld.offset + np.arange(pld.pmf.size) - center
    v = log_pmf + lam * idx
    top = float(np.max(v))
    s = top + math.log(float(np.sum(np.exp(v - top))))
    if pld.slack > 0:
        far = float(idx[-1] if lam > 0 else idx[0])  # where e^(lam k) is largest
        s = float(np.logaddexp(s, math.log(pld.slack) + lam * far))
    # Round-off of the sum and its log: relative error below (size + 2) u, taken generously.
    return s + 4.0 * (pld.pmf.size + 2) * _UNIT_ROUNDOFF


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


def _power_window(base: DiscretePld, power: int, other: DiscretePld) -> tuple[int, int, float]:
    """Grid indices [lo, hi] holding all but at most ``_TAIL_MASS`` on each side of the
    finite part of ``base`` composed ``power`` times with ``other``, and the tail mass charged.

    Chernoff bounds, mass(k > hi) <= e^(-lam hi) E[e^(lam k)] for every lam > 0 (and the
    mirror image below), evaluated on a geometric set of lam around the Gaussian optimum;
    every moment generating function is bounded from above (:func:`_log_mgf`), so the
    window is valid for the true pmfs, not only for the computed ones.
    """
    sides = []
    with np.errstate(divide="ignore"):
        logs = (np.log(base.pmf), np.log(other.pmf))
    var, centers = 0.0, []
    for pld, count in ((base, power), (other, 1)):
        w = pld.pmf / pld.pmf.sum()
        idx = pld.offset + np.arange(pld.pmf.size)
        mean = float(np.dot(w, idx))
        centers.append(mean)
        var += count * float(np.dot(w, (idx - mean) ** 2))
    center = power * centers[0] + centers[1]
    lam0 = math.sqrt(2.0 * math.log(1.0 / _TAIL_MASS)) / max(math.sqrt(var), 1.0)
    log_tail = math.log(_TAIL_MASS)
    support = (power * base.offset + other.offset,
               power * (base.offset + base.pmf.size - 1) + other.offset + other.pmf.size - 1)
    for sign in (1.0, -1.0):
        best = math.inf
        for k in range(-2, 3):
            lam = sign * lam0 * 2.0**k
            log_m = (power * _log_mgf(base, lam, centers[0], logs[0])
                     + _log_mgf(other, lam, centers[1], logs[1]))
            best = min(best, (log_m - log_tail) / abs(lam))
        sides.append(best)
    lo = max(support[0], math.floor(center - sides[1])) if math.isfinite(sides[1]) else support[0]
    hi = min(support[1], math.ceil(center + sides[0])) if math.isfinite(sides[0]) else support[1]
    charged = (_TAIL_MASS if lo > support[0] else 0.0) + (_TAIL_MASS if hi < support[1] else 0.0)
    return lo, hi, charged


def _fft_size_for(base: DiscretePld, other: DiscretePld, window: tuple[int, int]) -> int:
    return _fft_size(max(window[1] - window[0] + 1, base.pmf.size, other.pmf.size))


def _power_error(
    base: DiscretePld, power: int, other: DiscretePld, window: tuple[int, int]
) -> float:
    """The l1 round-off bound of :func:`_fft_power` on a window of that size.

    With u the unit round-off, N the FFT length, g = c u log2 N the FFT's relative l2
    error bound (Higham, Accuracy and Stability of Numerical Algorithms, Sec. 24.1),
    a, b the two pmfs, R >= max |DFT(a)_k| (mass(a) + g sqrt(N) ||a||_2), Rb likewise,
    P the computed spectrum and T the exact one (Parseval: a spectrum's l2 norm is
    sqrt(N) that of its vector):

        ||out - exact||_1 <= sqrt(N) ||out - exact||_2 <= ||P - T||_2 + g ||P||_2,
        ||P - T||_2 <= m R^(m-1) Rb g sqrt(N) ||a||_2 + g sqrt(N) ||b||_2 + e ||P||_2,
        ||P||_2 <= R^(m-1) Rb (1 + g) sqrt(N) ||a||_2,

    e = 1.01 (m + 1) sqrt(5) u: a complex product's relative error is at most sqrt(5) u
    (Brent, Percival, Zimmermann 2007), and binary powering's relative errors add along
    its m - 1 products (and one more for b).
    """
    a, b = base.pmf, other.pmf
    if not (a.sum() > 0 and b.sum() > 0):  # all mass at +inf: nothing to transform
        return math.inf
    n_fft = _fft_size_for(base, other, window)
    g = _FFT_ERROR_CONSTANT * math.log2(max(n_fft, 2)) * _UNIT_ROUNDOFF
    root_n = math.sqrt(n_fft)
    norm_a, norm_b = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    r_a = float(a.sum()) + g * root_n * norm_a
    r_b = float(b.sum()) + g * root_n * norm_b
    e = 1.01 * (power + 1) * math.sqrt(5.0) * _UNIT_ROUNDOFF
    p_norm = r_a ** (power - 1) * r_b * (1.0 + g) * root_n * norm_a
    return (power * r_a ** (power - 1) * r_b * g * root_n * norm_a + g * root_n * norm_b
            + e * p_norm + g * (1.0 + e) * p_norm)


def _fft_power(base: DiscretePld, power: int, other: DiscretePld) -> DiscretePld:
    """``base`` composed ``power`` (>= 2) times, then with ``other``, by one FFT: the DFT of
    ``base`` raised to ``power`` (binary powering, elementwise), times that of ``other``,
    transformed back; its round-off bound (:func:`_power_error`) is added to ``slack``.

    The transform is cyclic, of a length N holding the Chernoff window
    (:func:`_power_window`): mass outside it (at most ``_TAIL_MASS`` a side) folds onto
    the window, which only adds non-negative mass, and is also charged to the +inf atom
    (pessimistic twice over).
    """
    a, b = base.pmf, other.pmf
    mass_a, mass_b = float(a.sum()), float(b.sum())
    lo, hi, charged = _power_window(base, power, other)
    n_fft = _fft_size_for(base, other, (lo, hi))
    spectrum = np.fft.rfft(a, n_fft)
    acc = np.fft.rfft(b, n_fft)
    err = _power_error(base, power, other, (lo, hi))
    m = power
    while m:  # acc *= spectrum^power by squaring, in place
        if m & 1:
            acc *= spectrum
        m >>= 1
        if m:
            np.multiply(spectrum, spectrum, out=spectrum)
    cyclic = np.fft.irfft(acc, n_fft)
    # Linear index k sits at cyclic position (k - start) mod N.
    start = power * base.offset + other.offset
    pmf = np.maximum(np.roll(cyclic, start - lo)[: hi - lo + 1], 0.0)
    # Input slack: ||a'^m * b' - a^m * b||_1 <= ((ma + sa)^m - ma^m)(mb + sb) + ma^m sb.
    grown = math.expm1(power * math.log1p(base.slack / mass_a)) if base.slack else 0.0
    slack = (mass_a ** power * grown * (mass_b + other.slack) + mass_a ** power * other.slack
             + err)
    inf_mass = 1.0 - (1.0 - base.inf_mass) ** power * (1.0 - other.inf_mass) + charged
    return _truncate(DiscretePld(interval=base.interval, offset=lo, pmf=pmf,
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


@functools.lru_cache(maxsize=8)
def _grid_masses(
    z: float, q: float, interval: float
) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    """The loss grid of the remove pair and the P- and Q-mass of each of its cells (and
    the two tails), shared by both directions (read-only arrays)."""
    x_bounds = np.array([-_X_TAIL * z, 1.0 + _X_TAIL * z])
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

    __slots__ = ("_adjacency", "_cache", "_counts", "_interval", "_max_bins")

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

    def _plds(self) -> tuple[DiscretePld, DiscretePld] | None:
        """(remove, add) composed PLDs; None when some event has no noise (eps = inf)."""
        state = tuple(sorted(self._counts.items()))
        if self._cache is not None and self._cache[0] == state:
            return self._cache[1]
        result: tuple[DiscretePld, DiscretePld] | None
        if any(z == 0 for (z, _q) in self._counts):
            result = None
        else:
            h = self._choose_interval()
            # With q = 1 throughout, the add pair is the remove pair mirrored: same PLD.
            directions = ("remove",) if all(q == 1.0 for (_z, q) in self._counts) else (
                "remove", "add")
            composed = []
            for direction in directions:
                total = DiscretePld(interval=h, offset=0, pmf=np.ones(1))
                for (z, q), n in state:
                    step = discretize_subsampled_gaussian(z, q, h, direction=direction)
                    total = total.compose(_truncate(step).self_compose(n))
                composed.append(total)
            result = (composed[0], composed[-1])
        self._cache = (state, result)
        return result

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
        """Epsilon at ``delta``: the max over the add and remove directions (upper bound)."""
        if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta <= 1:
            raise ValueError(f"delta must be in (0, 1], got {delta!r}")
        plds = self._plds()
        if plds is None:
            return math.inf
        return max(p.get_epsilon(delta) for p in plds)

    def get_delta(self, epsilon: float) -> float:
        """delta at ``epsilon``: the max over the add and remove directions (upper bound)."""
        plds = self._plds()
        if plds is None:
            if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not (
                epsilon >= 0
            ):
                raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
            return 1.0
        return max(p.get_delta(epsilon) for p in plds)
