"""Renyi differential privacy (RDP) of Gaussian mechanisms, and conversion to (eps, delta).

RDP at order a > 1 of a mechanism is the largest Renyi divergence D_a(M(D) || M(D')) over
adjacent data sets, in nats. RDP composes additively, so an accountant keeps one number
per order and converts to (eps, delta)-DP at the end, taking the best order.

What is computed, and how tight:

* Gaussian, noise multiplier z: exactly a / (2 z^2) (Mironov 2017, Prop. 7).
* Poisson-subsampled Gaussian (add/remove): exact at every order, integer (binomial
  expansion) and fractional (the two-sided series of Mironov, Talwar, Zhang 2019, Sec.
  3.3), the fractional series summed with its signs and truncated with a bracket that
  keeps the result an upper bound.
* Gaussian on a batch drawn without replacement (substitution): the upper bound of Wang,
  Balle, Kasiviswanathan 2019, Theorem 27, at integer orders >= 2, and its convex
  (log-moment) interpolation in between (their Corollary 10).
* A discrete release the device took part in by its own coin of probability q
  (:class:`~edge_sdk.privacy.events.SelfSampled`, zero-out): the general upper bound of
  Zhu and Wang 2019, Theorem 6, on the inner release's RDP curve, at the integer order
  ceil(a) (RDP grows with the order), and never above the inner curve itself.
* Conversion to (eps, delta): the improved bound of Balle et al. 2020 / Canonne, Kamath,
  Steinke 2020, with the classic bound of Mironov 2017 (Prop. 3) alongside.
* The cpSGD binomial mechanism (:class:`~edge_sdk.privacy.events.Binomial`) has no RDP
  curve (infinite Renyi divergence: the supports differ) but a RESTRICTED moment rho_B(a)
  and an additive delta0 (:mod:`edge_sdk.privacy.binomial`). :class:`RdpAccountant`
  composes it with everything else at the orders it carries; :func:`compute_rdp` refuses
  it (a restricted moment converted as RDP would drop delta0).

Composition with restricted moments (the accountant's theorem; it is the argument by which
approximate zCDP composes with its deltas adding, Bun & Steinke 2016 (their approximate
zCDP), proved here directly for the one-sided form used, so it rests on no lemma number):
call a release (rho, delta0)-restricted at order a if, for every adjacent pair, with P, Q
its output laws, L = log dP/dQ, there is an event B with P(B) <= delta0 and E_P[1_{not B}
e^{(a-1) L}] <= e^{(a-1) rho}. An RDP bound r(a) is (r(a), 0)-restricted (B empty:
E_P[e^{(a-1)L}] = E_Q[(dP/dQ)^a] = e^{(a-1) D_a}). For an adaptive sequence of releases,
each restricted for EVERY adjacent pair and hence given any earlier outputs, the joint
loss is the sum of the per-release losses, and with B = the union of the B_t, peeling
releases off the end (tower property) gives E_P[1_{not B} e^{(a-1) sum L_t}] <= e^{(a-1)
sum rho_t}, while P(B) <= sum delta0_t (union bound). Conversion: the hockey-stick
divergence is delta(eps) = E_P[(1 - e^{eps - L})_+] <= P(B) + E_P[1_{not B} (1 - e^{eps -
L})_+], and (1 - e^{-x})_+ <= c_a e^{(a-1) x} with c_a = (a-1)^{a-1} / a^a for every real
x (the pointwise step of Canonne, Kamath, Steinke 2020 Prop. 12; the maximum of (1 - t)
t^{a-1} over t in (0, 1] is c_a), so delta(eps) <= sum delta0 + c_a e^{(a-1)(sum rho -
eps)}, i.e. eps(delta) = min_a sum rho(a) + log1p(-1/a) - (log(delta - sum delta0) + log
a) / (a - 1), infinite when delta <= sum delta0. No Bretagnolle-Huber shortcut (it needs
KL <= RDP; KL is infinite here). Both directions of every pair are covered: the events'
bounds are stated for every ordered pair.

Everything here is an upper bound on the true epsilon, never below it, up to float64
rounding (relative 1e-12 or so). Only numpy and math are used.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable, Sequence
from decimal import Context, Decimal, localcontext
from typing import NamedTuple

import numpy as np

from edge_sdk.privacy._math import DEFAULT_ORDERS, log1pexp, log_expm1, log_ndtr, logsumexp
from edge_sdk.privacy.discrete import rdp_distributed_discrete_gaussian, rdp_distributed_skellam
from edge_sdk.privacy.events import (
    _EVENT_TYPES,
    ADJACENCIES,
    Adjacency,
    Binomial,
    Composed,
    DistributedDiscreteGaussian,
    DistributedSkellam,
    Event,
    Gaussian,
    PoissonSubsampledGaussian,
    SampledWithoutReplacementGaussian,
    SelfComposed,
    SelfSampled,
    UnsupportedEventError,
    restate,
)

__all__ = [
    "DEFAULT_ORDERS",
    "Adjacency",
    "RdpAccountant",
    "compute_rdp",
    "discrete_epsilon",
    "rdp_gaussian",
    "rdp_of",
    "rdp_poisson_subsampled_gaussian",
    "rdp_sampled_without_replacement_gaussian",
    "rdp_self_sampled",
    "rdp_to_epsilon",
    "rdp_to_epsilon_classic",
    "zhu_wang_bound",
]

# Fractional-order series: stop once a term in the alternating tail is below this
# fraction of the partial sum (the true value is then bracketed by the last two partial
# sums; the larger is returned), or after this many terms. Terms are summed in chunks of
# columns, the first at least _FRAC_CHUNK wide (at q = 1e-3 every default order ends
# within 13 terms), doubling up to _FRAC_CHUNK_MAX for the slow tails of large q.
_FRAC_RTOL = 1e-15
_FRAC_MAX_TERMS = 1 << 20
_FRAC_CHUNK = 16
_FRAC_CHUNK_MAX = 4096
# Forward differences for the without-replacement bound: exact only up to this order.
_WOR_MAX_DIFF_ORDER = 256


# --------------------------------------------------------------------------- validation


def _as_orders(orders: Iterable[float]) -> np.ndarray:
    arr = np.asarray(list(orders) if not isinstance(orders, np.ndarray) else orders,
                     dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"orders must be a non-empty 1-d sequence, got shape {arr.shape}")
    bad = ~(np.isfinite(arr) & (arr > 1.0))
    if np.any(bad):
        raise ValueError(f"orders must be finite and > 1, got {arr[bad][0]!r}")
    return arr


def _check_z(z: object) -> float:
    if isinstance(z, bool) or not isinstance(z, numbers.Real) or not (
        math.isfinite(z) and z >= 0
    ):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {z!r}")
    return float(z)


def _check_q(q: object, name: str = "sample_rate") -> float:
    if isinstance(q, bool) or not isinstance(q, numbers.Real) or not 0 <= q <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {q!r}")
    return float(q)


def _check_delta(delta: object) -> float:
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 <= delta <= 1:
        raise ValueError(f"delta must be in [0, 1], got {delta!r}")
    return float(delta)


# ----------------------------------------------------------------------- Gaussian, plain


def rdp_gaussian(noise_multiplier: float, orders: Iterable[float]) -> np.ndarray:
    """RDP of one Gaussian release: a / (2 z^2) at each order a (Mironov 2017, Prop. 7).

    Args:
        noise_multiplier: z, noise std / L2 sensitivity (0 gives inf).
        orders: RDP orders a > 1.

    Returns:
        RDP in nats, one value per order.
    """
    z = _check_z(noise_multiplier)
    a = _as_orders(orders)
    if z == 0:
        return np.full_like(a, math.inf)
    return a / (2.0 * z * z)


# ----------------------------------------------------------- Poisson-subsampled Gaussian


class _IntTerms(NamedTuple):
    """The terms i = 2..alpha of every integer order, laid end to end (orders-only data)."""

    alphas: np.ndarray  # the integer orders (int64)
    starts: np.ndarray  # offset of each order's first term in the flat arrays
    counts: np.ndarray  # alpha - 1 terms per order
    i: np.ndarray  # term index i, per term
    log_comb: np.ndarray  # log C(alpha, i), per term


def _int_terms(alphas: np.ndarray) -> _IntTerms:
    a = alphas.astype(np.int64)
    counts = a - 1  # terms i = 2..alpha
    starts = np.zeros(a.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    a_rep = np.repeat(a, counts)
    i = np.arange(a_rep.size, dtype=np.int64) - np.repeat(starts - 2, counts)
    lf = _log_factorials(int(a.max()))
    log_comb = lf[a_rep] - lf[i] - lf[a_rep - i]
    return _IntTerms(a, starts, counts, i, log_comb)


def _log_a_int(q: float, z: float, terms: _IntTerms) -> np.ndarray:
    """log A_alpha at integer orders alpha >= 2, 0 < q < 1 (Mironov, Talwar, Zhang 2019, Sec. 3.3).

    A = sum_i C(a,i) q^i (1-q)^(a-i) exp((i^2-i)/(2 z^2)); since the binomial weights sum to
    1, A - 1 = sum_{i>=2} C(a,i) q^i (1-q)^(a-i) expm1((i^2-i)/(2 z^2)), all terms positive,
    which keeps full relative precision when A is close to 1 (small q, large z).

    All orders at once: their terms (i = 2..alpha, about 9,500 for the default grid) lie end
    to end in flat arrays (:func:`_int_terms`) and are reduced per order with ``reduceat``
    (a logsumexp per segment): a few numpy passes instead of one Python call per order.
    Summing positive terms in order is accurate to (alpha - 1) ulps of A - 1 (1e-13).
    """
    top = int(terms.alphas.max())
    i_all = np.arange(top + 1, dtype=np.float64)
    # q^i (1-q)^(a-i) = (1-q)^a (q/(1-q))^i: an order-only factor, added after the sum,
    # and i-only factors, tabulated once up to the largest order and gathered.
    with np.errstate(divide="ignore"):  # i = 0, 1: expm1(0) = 0, never gathered
        per_i = i_all * (math.log(q) - math.log1p(-q)) + log_expm1(
            (i_all * i_all - i_all) / (2.0 * z * z))
    log_terms = per_i[terms.i]
    log_terms += terms.log_comb
    m = np.maximum.reduceat(log_terms, terms.starts)
    with np.errstate(invalid="ignore", over="ignore"):  # m = inf: inf - inf, handled below
        log_terms -= np.repeat(m, terms.counts)
        # Terms below e^-700 of the largest are raised to it: far below rounding, only ever
        # up, and it keeps exp() off its ~100x slower subnormal results.
        np.fmax(log_terms, -700.0, out=log_terms)
        s = np.add.reduceat(np.exp(log_terms), terms.starts)
        log_a_minus_1 = m + np.log(s) + terms.alphas * math.log1p(-q)
        out = np.logaddexp(0.0, log_a_minus_1)  # log(1 + (A - 1)), accurate near A = 1
    return np.where(np.isposinf(m), math.inf, out)


def _two_sum_into(hi: np.ndarray, lo: np.ndarray, x: np.ndarray) -> None:
    """hi + lo += x in place, error-free (Knuth's TwoSum; hi + lo is a double-double)."""
    s = hi + x
    bb = s - hi
    lo += (hi - (s - bb)) + (x - bb)
    hi[...] = s


class _FracOrders(NamedTuple):
    """The fractional orders and what the series needs of them (orders-only data)."""

    alphas: np.ndarray
    floor: np.ndarray  # floor(alpha), int64
    fracs: np.ndarray  # the distinct fractional parts alpha - floor(alpha)
    frac_of: np.ndarray  # index into ``fracs``, per order


def _frac_orders(alphas: np.ndarray) -> _FracOrders:
    floor = np.floor(alphas)
    f = alphas - floor  # exact
    # np.unique(f, return_inverse=True) without its overhead (0.15 ms in a fresh process).
    order = np.argsort(f, kind="stable")
    f_sorted = f[order]
    first = np.empty(f.size, dtype=bool)
    first[:1] = True
    np.not_equal(f_sorted[1:], f_sorted[:-1], out=first[1:])
    frac_of = np.empty(f.size, dtype=np.int64)
    frac_of[order] = np.cumsum(first) - 1
    return _FracOrders(alphas, floor.astype(np.int64), f_sorted[first], frac_of)


def _log_a_frac(q: float, z: float, orders: _FracOrders) -> np.ndarray:
    """log A_alpha at fractional orders alpha > 1, 0 < q < 1: the exact series, as upper bounds.

    Mironov, Talwar, Zhang 2019, Sec. 3.3: split the integral of
    mu0 * ((1-q) + q mu1/mu0)^alpha at z0, where (1-q) mu0 = q mu1, and expand each side in
    the convergent generalized binomial series. Term i of the two series is
    C(alpha, i) * [T0_i + T1_i] with T0_i = q^i (1-q)^(alpha-i) e^((i^2-i)/2z^2) Phi((z0-i)/z)
    and T1_i = q^j (1-q)^i e^((j^2-j)/2z^2) Phi((j-z0)/z), j = alpha - i. C(alpha, i) is
    positive up to i = floor(alpha)+1 and then alternates in sign, and T0_i + T1_i is
    non-increasing in i (each is an integral of a power <= 1 of a likelihood ratio), so
    past floor(alpha)+1 the series is alternating with decreasing terms: the true sum lies
    between any two consecutive partial sums. We stop when a tail term is negligible and
    return the larger of the last two partial sums (never below the true value).

    (``dp_accounting``'s ``_compute_log_a_frac`` adds |C(alpha, i)|, i.e. drops the signs:
    also an upper bound, but a looser one, by up to ~90% in RDP near alpha = 1.)

    All orders are summed together, chunk by chunk (rows: orders, columns: terms); the
    first chunk is short because at small q the series ends a few terms past
    floor(alpha) + 1, and the chunks double for the slowly converging large-q tails.
    Partial sums are double-doubles: each chunk's first term is added exactly (TwoSum) and
    the rest, small beside it at small q, as one plain sum, so log A keeps its precision
    when A is close to 1 (better than the exactly rounded sum it replaces, which rounds
    A itself), without a Python loop over orders.
    """
    sigma2 = z * z
    log_q, log_1mq = math.log(q), math.log1p(-q)
    z0 = sigma2 * (log_1mq - log_q) + 0.5
    alphas, floor_int, fracs, frac_of = orders
    n = alphas.size
    out = np.empty(n)
    rows = np.arange(n)  # orders still being summed
    first_alt = floor_int + 2  # C(alpha, i) < 0 first at this i
    # j = alpha - i = frac(alpha) + (floor(alpha) - i), and both sides round the same real
    # number, so orders that share a fractional part (the default grid has 19) share
    # their values of j: T1's j-only factors are tabulated per (fraction, integer offset).
    ref = np.full(n, math.nan)  # per-order scale: terms are stored / e^ref
    hi, lo = np.zeros(n), np.zeros(n)  # running partial sum (scaled), hi + lo
    log_c_next = np.zeros(n)  # log|C(alpha, start)|, carried between chunks
    last_val = np.zeros(n)  # the last term added (scaled), per order
    start = 0
    # The first chunk holds every order's positive head (i < floor(alpha) + 2) and a few
    # alternating terms: at small q that is the whole series.
    chunk = max(_FRAC_CHUNK, int(first_alt.max()) + 4)
    while rows.size and start < _FRAC_MAX_TERMS:
        i_int = np.arange(start, start + chunk)
        i1 = i_int.astype(np.float64)
        j = alphas[rows][:, None] - i1
        # log|C(alpha, i+1)| = log|C(alpha, i)| + log|alpha - i| - log(i + 1)
        steps = np.log(np.abs(j))
        steps -= np.log1p(i1)
        log_c = np.empty_like(steps)
        log_c[:, 0] = log_c_next[rows]
        np.cumsum(steps[:, :-1], axis=1, out=log_c[:, 1:])
        log_c[:, 1:] += log_c[:, :1]
        log_c_next[rows] = log_c[:, -1] + steps[:, -1]
        # T0's i-only factors, Phi((z0 - i)/z) included: one row, broadcast.
        t0 = j * log_1mq
        t0 += i1 * log_q + (i1 * i1 - i1) / (2 * sigma2) + log_ndtr((z0 - i1) / z)
        # T1's j-only factors q^j e^((j^2-j)/2z^2) Phi((j-z0)/z), from the table.
        fl = floor_int[rows]
        off_lo = int(fl.min()) - (start + chunk - 1)
        width = int(fl.max()) - start - off_lo + 1
        if fracs.size * width <= j.size:
            jt = fracs[:, None] + np.arange(off_lo, off_lo + width, dtype=np.float64)
            g = jt * log_q + (jt * jt - jt) / (2 * sigma2) + log_ndtr((jt - z0) / z)
            g = g.ravel()[(frac_of[rows] * width + fl - off_lo)[:, None] - i_int]
        else:  # orders with (nearly) all-distinct fractions: direct
            g = j * log_q + (j * j - j) / (2 * sigma2) + log_ndtr((j - z0) / z)
        g += i1 * log_1mq
        # log(e^t0 + e^g), not by np.logaddexp: its scalar loop is 30x slower here, 300x
        # where e^(t0 - g) is subnormal. Differences below -50 are raised to -50, which
        # adds at most log1p(e^-50) = 2e-22 (up, never down) and keeps exp() off
        # subnormals.
        log_t = np.maximum(t0, g)
        d = np.minimum(t0, g)
        d -= log_t
        np.fmax(d, -50.0, out=d)  # fmax: nan (both -inf) becomes -50, log_t stays -inf
        log_t += np.log1p(np.exp(d))
        log_t += log_c
        top = np.max(log_t, axis=1)
        new = np.isnan(ref[rows])
        ref[rows[new]] = top[new]
        grow = top > ref[rows] + 300.0  # never seen in practice; rescale, don't overflow
        if grow.any():
            r = rows[grow]
            factor = np.exp(ref[r] - top[grow])
            hi[r] *= factor
            lo[r] *= factor
            ref[r] = top[grow]
        log_t -= ref[rows][:, None]
        # Terms below e^-700 of the largest are far below rounding; raising them to e^-700
        # keeps exp() off its slow subnormal results (and only ever rounds up).
        vals = np.exp(np.fmax(log_t, -700.0, out=log_t))
        # C(alpha, i) > 0 below floor(alpha) + 2, then -, +, -, ...
        past = i_int - first_alt[rows][:, None]
        alternating = past >= 0
        vals[alternating & (past % 2 == 0)] *= -1.0
        partial = np.cumsum(vals, axis=1)
        partial += (hi[rows] + lo[rows])[:, None]
        stop = alternating & (np.abs(vals) <= _FRAC_RTOL * partial)
        finished = stop.any(axis=1)
        # Sum up to the end of the chunk, or for a finished order up to its stopping term m
        # if that term is positive, else to m - 1: the top end of the bracket.
        m = np.argmax(stop, axis=1)
        last = np.where(finished, m - (vals[np.arange(rows.size), m] < 0), chunk - 1)
        vals[np.arange(chunk) > last[:, None]] = 0.0
        h, l_ = hi[rows], lo[rows]
        _two_sum_into(h, l_, vals[:, 0])
        _two_sum_into(h, l_, vals[:, 1:].sum(axis=1))
        hi[rows], lo[rows] = h, l_
        last_val[rows] = vals[:, -1]
        done = rows[finished]
        out[done] = ref[done] + np.log(hi[done]) + np.log1p(lo[done] / hi[done])
        rows = rows[~finished]
        start += chunk
        chunk = min(chunk * 2, _FRAC_CHUNK_MAX)
    if rows.size:  # cap reached: the last two partial sums still bracket the truth
        top_sum = hi[rows] + lo[rows] + np.maximum(0.0, -last_val[rows])
        out[rows] = ref[rows] + np.log(top_sum)
    return out


@functools.lru_cache(maxsize=64)
def _poisson_layout(
    orders: tuple[float, ...],
) -> tuple[np.ndarray, _IntTerms | None, _FracOrders | None]:
    """What the Poisson series need of an order grid, independent of (q, z): built once."""
    a = np.array(orders)
    integer = a == np.floor(a)
    return (
        integer,
        _int_terms(a[integer]) if integer.any() else None,
        _frac_orders(a[~integer]) if not integer.all() else None,
    )


def _rdp_poisson(q: float, z: float, orders: tuple[float, ...]) -> np.ndarray:
    integer, int_terms, frac_orders = _poisson_layout(orders)
    a = np.array(orders)
    out = np.empty(a.size)
    if int_terms is not None:
        out[integer] = _log_a_int(q, z, int_terms)
    if frac_orders is not None:
        out[~integer] = _log_a_frac(q, z, frac_orders)
    # Subsampling never hurts: the plain Gaussian bound also holds (and guards rounding);
    # and A >= 1, so log A >= 0 (a rounding below it is lifted: sound).
    return np.minimum(np.maximum(out, 0.0) / (a - 1.0), a / (2.0 * z * z))


@functools.lru_cache(maxsize=1024)
def _rdp_poisson_cached(q: float, z: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(_rdp_poisson(q, z, orders).tolist())


def rdp_poisson_subsampled_gaussian(
    q: float, noise_multiplier: float, orders: Iterable[float]
) -> np.ndarray:
    """RDP of one Poisson-subsampled Gaussian release, exact at every order (add/remove).

    Mironov, Talwar, Zhang 2019 ("Renyi Differential Privacy of the Sampled Gaussian
    Mechanism"), Sec. 3.3: RDP(a) = log(A_a) / (a - 1) with
    A_a = E_{x ~ N(0, z^2)} [((1 - q) + q exp((2x - 1) / (2 z^2)))^a].

    Args:
        q: Poisson sampling rate in [0, 1] (0: nothing released, RDP 0; 1: plain Gaussian).
        noise_multiplier: z, noise std / L2 sensitivity (0 gives inf when q > 0).
        orders: RDP orders a > 1 (integer and fractional).

    Returns:
        RDP in nats, one value per order; an upper bound that is exact up to rounding.
    """
    return _poisson_rdp(_check_q(q, "q"), _check_z(noise_multiplier), _as_orders(orders))


def _poisson_rdp(q: float, z: float, a: np.ndarray) -> np.ndarray:
    """:func:`rdp_poisson_subsampled_gaussian` on checked arguments."""
    if q == 0:
        return np.zeros_like(a)
    if z == 0:
        return np.full_like(a, math.inf)
    if q == 1:
        return a / (2.0 * z * z)
    return np.array(_rdp_poisson_cached(q, z, tuple(a.tolist())))


# ------------------------------------------------- Gaussian, sampling without replacement


@functools.lru_cache(maxsize=64)
def _log_pearson_vajda(z: float, max_order: int) -> tuple[float, ...]:
    """Upper bounds on log E_Q[(P/Q - 1)^l] for P = N(1, z^2), Q = N(0, z^2), even l.

    Entry l (even l <= max_order; odd entries are nan) bounds the log of the l-th forward
    difference at 0 of exp((i - 1) eps(i)) = exp(i (i - 1) / (2 z^2)), that is
    sum_i (-1)^(l-i) C(l, i) exp(i (i - 1) / (2 z^2)). The alternating sum cancels badly
    in float64, so it is computed in decimal arithmetic, the precision doubled until a
    rigorous rounding-error bound is below 1e-9 of the result; the bound is added. An
    entry that no precision up to the cap resolves is +inf (the caller's other bound then
    applies).
    """
    out = [math.nan] * (max_order + 1)
    out[0] = 0.0
    pending = list(range(2, max_order + 1, 2))
    prec = 60
    while pending and prec <= 4000:
        with localcontext(Context(prec=prec, Emax=999_999_999, Emin=-999_999_999)):
            two_sigma2 = Decimal(z) * Decimal(z) * 2
            top = max(pending)
            a = [(Decimal(i * (i - 1)) / two_sigma2).exp() for i in range(top + 1)]
            ulp = Decimal(10) ** (1 - prec)
            still = []
            for ell in pending:
                total = Decimal(0)
                abs_total = Decimal(0)
                for i in range(ell + 1):
                    term = math.comb(ell, i) * a[i]
                    abs_total += term
                    total += term if (ell - i) % 2 == 0 else -term
                # Each term carries relative error <= 4 ulp (exp, division, product) and
                # each addition 1 ulp of the running magnitude: a safe absolute bound.
                err = abs_total * (4 * (ell + 2)) * ulp
                if total > 0 and err <= total * Decimal("1e-9"):
                    out[ell] = float((total + err).ln())
                else:
                    still.append(ell)
            pending = still
        prec *= 2
    for ell in pending:
        out[ell] = math.inf
    return tuple(out)


# log(k!) for k < _STIRLING_FROM (every order of the default grid up to 64) comes from
# math.lgamma; above, from Stirling's series.
_STIRLING_FROM = 65
# Stirling's series for log Gamma(x): B_2k / (2k (2k - 1) x^(2k - 1)), k = 1..5; at
# x >= 66 the first omitted term (691 / (360360 x^11)) is below 1e-22.
_STIRLING = (1.0 / 12.0, -1.0 / 360.0, 1.0 / 1260.0, -1.0 / 1680.0, 1.0 / 1188.0)


@functools.lru_cache(maxsize=8)
def _log_factorials(n: int) -> np.ndarray:
    """log(k!) for k = 0..n, to a few ulps of log(n!).

    math.lgamma (to rounding) for k < 65; Stirling's series, vectorized, above, where its
    truncation error is far below float64 rounding and the result within 4 ulps of
    lgamma's: a table of 1025 then costs microseconds, not the ~0.3 ms of 1025 lgamma calls.
    """
    out = np.empty(n + 1)
    small = min(n + 1, _STIRLING_FROM)
    out[:small] = [math.lgamma(k + 1) for k in range(small)]
    if n + 1 > small:
        x = np.arange(small + 1, n + 2, dtype=np.float64)  # Gamma(k + 1), k >= small
        inv2 = 1.0 / (x * x)
        corr = _STIRLING[-1]
        for c in _STIRLING[-2::-1]:
            corr = corr * inv2 + c
        out[small:] = (x - 0.5) * np.log(x) - x + 0.5 * math.log(2.0 * math.pi) + corr / x
    return out


def _log_comb_int(n: int, k: np.ndarray) -> np.ndarray:
    size = 1 << max(10, (n + 1).bit_length())
    lf = _log_factorials(size)
    return lf[n] - lf[k] - lf[n - k]


def _log_a_wor(q: float, z: float, alpha: int, log_d: np.ndarray) -> float:
    """log of the Theorem 27 bound (Wang, Balle, Kasiviswanathan 2019) at integer alpha >= 2.

    For a base mechanism with RDP eps(.) that satisfies their "tight pair" condition (the
    Gaussian does, with eps(l) = l / (2 z^2) and eps(inf) = inf), sampling a fraction q
    without replacement, under substitution:

        (alpha - 1) RDP'(alpha) <= log(1 + q^2 C(alpha, 2) min{4 (e^eps(2) - 1), 2 e^eps(2)}
                                     + sum_{j=3}^alpha q^j C(alpha, j)
                                       min{4 sqrt(D_{2 floor(j/2)} D_{2 ceil(j/2)}),
                                           2 e^((j-1) eps(j))})

    where D_l = E[(P/Q - 1)^l] are Pearson-Vajda moments (the term for j = 2 is the same
    formula with D_2 = e^eps(2) - 1). ``log_d[l]`` bounds log D_l for even l; where it
    does not reach (beyond ``_WOR_MAX_DIFF_ORDER``) only the second branch of the min is
    used, which is still a valid bound.
    """
    two_sigma2 = 2.0 * z * z
    j = np.arange(2, alpha + 1)
    jf = j.astype(np.float64)
    log_comb = _log_comb_int(alpha, j)
    simple = math.log(2.0) + jf * (jf - 1) / two_sigma2
    diff_max = log_d.size - 1
    lo, hi = 2 * (j // 2), 2 * ((j + 1) // 2)
    ok = hi <= diff_max
    refined = np.full(jf.shape, math.inf)
    refined[ok] = math.log(4.0) + 0.5 * (log_d[lo[ok]] + log_d[hi[ok]])
    log_terms = log_comb + jf * math.log(q) + np.minimum(simple, refined)
    return log1pexp(logsumexp(log_terms))


@functools.lru_cache(maxsize=256)
def _rdp_wor_cached(q: float, z: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    cgf: dict[int, float] = {1: 0.0}
    diff_max = min(math.ceil(max(orders)) + 1, _WOR_MAX_DIFF_ORDER)
    log_d = np.array(_log_pearson_vajda(z, diff_max + diff_max % 2))

    def k(a: int) -> float:  # (a - 1) * RDP(a): the log-moment function at lambda = a - 1
        if a not in cgf:
            cgf[a] = _log_a_wor(q, z, a, log_d)
        return cgf[a]

    out = []
    for a in orders:
        lo, hi = math.floor(a), math.ceil(a)
        if lo == hi:
            val = k(lo) / (a - 1)
        else:  # the log-moment function is convex: interpolate (WBK 2019, Corollary 10)
            t = a - lo
            val = ((1 - t) * k(lo) + t * k(hi)) / (a - 1)
        out.append(min(val, a / (2.0 * z * z)))
    return tuple(out)


def rdp_sampled_without_replacement_gaussian(
    sample_rate: float, noise_multiplier: float, orders: Iterable[float]
) -> np.ndarray:
    """RDP upper bound for a Gaussian on a batch sampled without replacement (substitution).

    Wang, Balle, Kasiviswanathan 2019 ("Subsampled Renyi Differential Privacy and
    Analytical Moments Accountant"), Theorem 27 at integer orders >= 2; at fractional
    orders the convex interpolation of the log-moment function between the neighbouring
    integers (their Corollary 10; at orders in (1, 2) between 1, where it is 0, and 2).
    Never above the un-amplified a / (2 z^2), which also holds.

    Args:
        sample_rate: B / m, the batch size over the data set size, in [0, 1].
        noise_multiplier: z, noise std / L2 sensitivity under substitution.
        orders: RDP orders a > 1.

    Returns:
        RDP upper bounds in nats, one per order.
    """
    return _wor_rdp(_check_q(sample_rate), _check_z(noise_multiplier), _as_orders(orders))


def _wor_rdp(q: float, z: float, a: np.ndarray) -> np.ndarray:
    """:func:`rdp_sampled_without_replacement_gaussian` on checked arguments."""
    if q == 0:
        return np.zeros_like(a)
    if z == 0:
        return np.full_like(a, math.inf)
    if q == 1:
        return a / (2.0 * z * z)
    return np.array(_rdp_wor_cached(q, z, tuple(a.tolist())))


# ------------------------------------------------------------- self-sampled releases


def _log_binom(n: int, k: np.ndarray) -> np.ndarray:
    return (math.lgamma(n + 1) - np.array([math.lgamma(j + 1) for j in k])
            - np.array([math.lgamma(n - j + 1) for j in k]))


def zhu_wang_bound(inner: np.ndarray, q: float, order: int) -> float:
    """Zhu and Wang 2019 (ICML), Theorem 6: the RDP at integer ``order`` m >= 2 of a
    mechanism run on a Poisson subsample of rate ``q`` in (0, 1), from the RDP eps(l) of
    the mechanism itself at the integer orders l = 2..m (``inner[l - 2]``), both directions
    of a pair in which the record is in the sample or is the null record:

        1/(m-1) log[ (1-q)^(m-1) (1 + (m-1) q) + C(m,2) q^2 (1-q)^(m-2) e^eps(2)
                     + 3 sum_{l=3..m} C(m,l) q^l (1-q)^(m-l) e^((l-1) eps(l)) ].

    (The first direction alone is the binomial expansion of E_Q[(1 - q + q L)^m] with
    E_Q[L^l] = e^((l-1) D_l) <= e^((l-1) eps(l)); the factor 3 pays for the other.)
    Infinite if any eps(l) is.
    """
    m = int(order)
    if m < 2 or not 0 < q < 1 or len(inner) < m - 1:
        raise ValueError(f"need an integer order >= 2, q in (0, 1) and eps(2..{m}); got "
                         f"order {order!r}, q {q!r}, {len(inner)} values")
    eps = np.asarray(inner[: m - 1], dtype=np.float64)
    if not np.all(np.isfinite(eps)):
        return math.inf
    lq, l1q = math.log(q), math.log1p(-q)
    terms = [(m - 1) * l1q + math.log1p((m - 1) * q)]
    ls = np.arange(2, m + 1)
    logs = (_log_binom(m, ls) + ls * lq + (m - ls) * l1q + (ls - 1) * eps
            + np.where(ls >= 3, math.log(3.0), 0.0))
    return float(logsumexp(np.concatenate([terms, logs]))) / (m - 1)


def rdp_self_sampled(event: SelfSampled, orders: Iterable[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP (nats) at each order of one :class:`~edge_sdk.privacy.events.SelfSampled`
    release, device-level zero-out: at order a, the least of the inner release's own RDP
    at a (a mixture of the pair is no further apart than the pair: joint quasi-convexity
    of the Renyi divergence) and :func:`zhu_wang_bound` at the integer order ceil(a) (at
    least 2), on the inner curve (KLS 2021 Theorem 1 for the discrete Gaussian, AKL 2021
    Theorem 3.5 for Skellam) at the integer orders. q = 1: the inner curve.
    """
    a = _as_orders(orders)
    return np.array(_self_sampled_cached(event, tuple(a.tolist())))


@functools.lru_cache(maxsize=256)
def _self_sampled_cached(event: SelfSampled, orders: tuple[float, ...]) -> tuple[float, ...]:
    a = np.array(orders)
    own = _rdp_of(event.event, a)
    q = float(event.sample_rate)
    if q == 1.0:
        return tuple(own.tolist())
    ms = np.maximum(2, np.ceil(a - 1e-12)).astype(int)
    inner = _rdp_of(event.event, np.arange(2, int(ms.max()) + 1, dtype=np.float64))
    bound = {m: zhu_wang_bound(inner, q, m) for m in sorted(set(ms.tolist()))}
    return tuple(min(float(o), bound[m]) for o, m in zip(own, ms.tolist(), strict=True))


# ------------------------------------------------------------------------------ events


def _check_event(event: object, adjacency: Adjacency) -> Event:
    """``event`` restated under ``adjacency`` (:func:`~edge_sdk.privacy.events.restate`), or
    UnsupportedEventError if it cannot be accounted under it (no effects). Every event of
    the union has an RDP bound here."""
    if not isinstance(event, _EVENT_TYPES):
        raise UnsupportedEventError(f"unsupported privacy event {event!r}")
    return restate(event, adjacency)


def _binomial_moment(event: Binomial, orders: np.ndarray) -> np.ndarray:
    """The restricted moment of ``event``'s ``steps`` releases at ``orders``, each of which
    must be one of the event's own (UnsupportedEventError otherwise: the moment is known
    only there)."""
    at = dict(zip(event.orders, event.rho, strict=True))
    missing = [float(a) for a in orders if float(a) not in at]
    if missing:
        raise UnsupportedEventError(
            f"a Binomial event states its restricted moment at its own {len(event.orders)} "
            f"orders only; this accountant's orders include {missing[0]!r}, which is not one "
            "of them (use RdpAccountant(orders=event.orders))")
    return event.steps * np.array([at[float(a)] for a in orders])


def _check_binomial_orders(event: Event, orders: np.ndarray) -> None:
    """UnsupportedEventError unless every Binomial leaf of ``event`` states its moment at
    every one of ``orders``."""
    if isinstance(event, Composed):
        for e in event.events:
            _check_binomial_orders(e, orders)
    elif isinstance(event, SelfComposed):
        _check_binomial_orders(event.event, orders)
    elif isinstance(event, Binomial):
        _binomial_moment(event, orders)


def _moments_of(event: Event, orders: np.ndarray) -> tuple[np.ndarray, float, bool]:
    """(restricted moment at ``orders``, delta0, whether a Binomial leaf is in): RDP curves
    are restricted moments with delta0 = 0 (module docstring); both add over composition."""
    if isinstance(event, Composed):
        total, d0, restricted = np.zeros_like(orders), 0.0, False
        for e in event.events:
            r, d, b = _moments_of(e, orders)
            total, d0, restricted = total + r, d0 + d, restricted or b
        return total, d0, restricted
    if isinstance(event, SelfComposed):
        r, d, b = _moments_of(event.event, orders)
        return event.count * r, event.count * d, b
    if isinstance(event, Binomial):
        return _binomial_moment(event, orders), event.steps * event.delta0, True
    return _rdp_of(event, orders), 0.0, False


def _rdp_of(event: Event, orders: np.ndarray) -> np.ndarray:
    if isinstance(event, Binomial):
        raise UnsupportedEventError(
            "a Binomial event has no RDP curve (binomial pairs have different supports), "
            "only a restricted moment with an additive delta0: compose it in an "
            "RdpAccountant (orders=event.orders), which converts with delta - delta0")
    if isinstance(event, Composed):
        total = np.zeros_like(orders)
        for e in event.events:
            total = total + _rdp_of(e, orders)
        return total
    if isinstance(event, SelfComposed):
        return event.count * _rdp_of(event.event, orders)
    if isinstance(event, SelfSampled):
        # Zhu-Wang 2019 Thm 6 on the inner discrete curve (rdp_self_sampled).
        return np.array(_self_sampled_cached(event, tuple(orders.tolist())))
    if isinstance(event, DistributedDiscreteGaussian):
        # KLS 2021 Thm 1 / Prop. 14, the bound of edge_sdk.privacy.discrete.
        return event.steps * rdp_distributed_discrete_gaussian(
            event.l2_sensitivity, event.l1_sensitivity, event.sigma, event.devices,
            event.dim, orders)
    if isinstance(event, DistributedSkellam):
        # Agarwal, Kairouz, Liu 2021 Thm 3.5, the bound of edge_sdk.privacy.discrete.
        return event.steps * rdp_distributed_skellam(
            event.l1_sensitivity, event.l2_sensitivity, event.mu, event.devices, orders)
    if isinstance(event, Gaussian):
        return event.steps * rdp_gaussian(event.noise_multiplier, orders)
    # ``orders`` is validated once, by the caller; the events validated themselves.
    if isinstance(event, PoissonSubsampledGaussian):
        return event.steps * _poisson_rdp(
            _check_q(event.sample_rate, "q"), _check_z(event.noise_multiplier), orders
        )
    if isinstance(event, SampledWithoutReplacementGaussian):
        return event.steps * _wor_rdp(
            _check_q(event.sample_rate), _check_z(event.noise_multiplier), orders
        )
    raise UnsupportedEventError(f"unsupported privacy event {event!r}")  # pragma: no cover


def compute_rdp(
    event: Event,
    orders: Iterable[float] = DEFAULT_ORDERS,
    *,
    adjacency: Adjacency = "add_remove",
) -> np.ndarray:
    """RDP of an event at each order (a pure function; the accountant adds these up).

    Args:
        event: the mechanism, as data.
        orders: RDP orders a > 1.
        adjacency: ``"add_remove"``, ``"substitution"`` or ``"zero_out"``; each event is
            first restated under it (:func:`~edge_sdk.privacy.events.restate`).

    Returns:
        RDP in nats, one value per order (inf where there is no guarantee).

    Raises:
        UnsupportedEventError: an event that has no RDP bound under ``adjacency``, or one
            containing a :class:`~edge_sdk.privacy.events.Binomial` (no RDP curve: compose
            it in an :class:`RdpAccountant`).
        ValueError: bad ``orders`` or ``adjacency``.
    """
    if adjacency not in ADJACENCIES:
        raise ValueError(f"adjacency must be one of {', '.join(ADJACENCIES)}, got {adjacency!r}")
    return _compute_rdp(event, _as_orders(orders), adjacency)


def rdp_of(
    event: Event,
    orders: Iterable[float] = DEFAULT_ORDERS,
    *,
    adjacency: Adjacency | None = None,
) -> np.ndarray:
    """:func:`compute_rdp`, under the event's own adjacency by default for a discrete event.

    Args:
        event: any event of the union.
        orders: RDP orders a > 1.
        adjacency: the relation to state the RDP under; None (default) means the event's
            own for a :class:`~edge_sdk.privacy.events.DistributedDiscreteGaussian` or
            :class:`~edge_sdk.privacy.events.DistributedSkellam` (their sensitivities are
            stated for it), and ``"add_remove"`` for any other event.

    Returns:
        RDP in nats, one value per order (inf where there is no guarantee).

    Raises:
        UnsupportedEventError: no sound restatement under ``adjacency``.
    """
    if adjacency is None:
        discrete = isinstance(event, DistributedDiscreteGaussian | DistributedSkellam
                              | SelfSampled)
        adjacency = event.adjacency if discrete else "add_remove"  # type: ignore[union-attr]
    return compute_rdp(event, orders, adjacency=adjacency)


def discrete_epsilon(
    event: DistributedDiscreteGaussian | DistributedSkellam,
    delta: float,
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> float:
    """Epsilon at ``delta`` of one discrete event under its own adjacency, by
    :func:`rdp_to_epsilon` of :func:`rdp_of`.

    Args:
        event: the event (its ``steps`` releases composed).
        delta: target delta in [0, 1].
        orders: RDP orders a > 1.

    Returns:
        epsilon in nats (inf when there is no noise).
    """
    a = _as_orders(orders)
    return rdp_to_epsilon(rdp_of(event, a), a, delta)[0]


def _compute_rdp(event: Event, orders: np.ndarray, adjacency: Adjacency) -> np.ndarray:
    """:func:`compute_rdp` on validated orders and adjacency."""
    event = _check_event(event, adjacency)
    with np.errstate(invalid="ignore"):  # 0 * inf never arises: steps >= 1
        return _rdp_of(event, orders)


def _compute_moments(event: Event, orders: np.ndarray,
                     adjacency: Adjacency) -> tuple[np.ndarray, float, bool]:
    """:func:`_moments_of` of ``event`` restated under ``adjacency`` (validated orders).

    Memoised (the increment is read-only): a device's ledger composes the same few events
    entry after entry, and a simulated fleet's ledgers each other's, so an event's curve is
    computed once (a Poisson-subsampled Gaussian's takes milliseconds at 60-odd orders).
    Events are frozen and hashable, equal events have equal curves; a rejected event raises
    every time (exceptions are not memoised)."""
    return _moments_memo(event, orders.tobytes(), adjacency)


@functools.lru_cache(maxsize=8192)
def _moments_memo(event: Event, orders: bytes,
                  adjacency: Adjacency) -> tuple[np.ndarray, float, bool]:
    a = np.frombuffer(orders, dtype=np.float64)
    event = _check_event(event, adjacency)
    with np.errstate(invalid="ignore"):  # 0 * inf never arises: steps >= 1
        increment, delta0, restricted = _moments_of(event, a)
    increment = np.array(increment, dtype=np.float64)  # its own buffer, then frozen
    increment.setflags(write=False)
    return increment, delta0, restricted


def _epsilon_restricted(r: np.ndarray, a: np.ndarray, delta: float,
                        delta0: float) -> tuple[float, float]:
    """(eps, order) at ``delta`` from a composed restricted moment ``r`` and delta0: the
    least over orders of r + log1p(-1/a) - (log(delta - delta0) + log a) / (a - 1), at
    least 0; (inf, nan) when delta <= delta0 (module docstring). No KL shortcut."""
    rest = delta - delta0
    if not rest > 0:
        return math.inf, math.nan
    with np.errstate(invalid="ignore", over="ignore"):
        eps = r + np.log1p(-1.0 / a) - (math.log(rest) + np.log(a)) / (a - 1.0)
    eps = np.where(np.isnan(eps), math.inf, eps)
    k = int(np.argmin(eps))
    if not math.isfinite(eps[k]):
        return math.inf, math.nan
    return max(0.0, float(eps[k])), float(a[k])


# -------------------------------------------------------------------------- conversion


def _prepare(rdp: Iterable[float], orders: Iterable[float], delta: float):
    a = _as_orders(orders)
    r = np.asarray(list(rdp) if not isinstance(rdp, np.ndarray) else rdp, dtype=np.float64)
    if r.shape != a.shape:
        raise ValueError(f"rdp and orders must have the same shape, got {r.shape} and {a.shape}")
    if np.any(np.isnan(r)) or np.any(r < 0):
        raise ValueError(f"rdp values must be >= 0 (inf allowed), got {r[~(r >= 0)][0]!r}")
    return r, a, _check_delta(delta)


def rdp_to_epsilon(
    rdp: Iterable[float], orders: Iterable[float], delta: float
) -> tuple[float, float]:
    """Convert an RDP curve to (eps, delta)-DP with the improved conversion.

    eps(a) = rdp(a) + log1p(-1/a) - (log(delta) + log(a)) / (a - 1), minimized over the
    orders (Balle, Barthe, Gaboardi, Hsu, Sato 2020, Thm. 21; Canonne, Kamath, Steinke
    2020, Prop. 12 / eq. (20)). Also eps = 0 where delta >= sqrt(1 - exp(-rdp(a))), since
    the KL divergence is at most rdp(a) and bounds the total variation distance
    (Bretagnolle-Huber), as ``dp_accounting`` does. Never below 0.

    Args:
        rdp: RDP values in nats at ``orders`` (inf allowed).
        orders: RDP orders a > 1.
        delta: target delta in [0, 1].

    Returns:
        (epsilon, order): epsilon at ``delta`` and the order that attains it (nan when
        epsilon is inf at every order).
    """
    return _epsilon_improved(*_prepare(rdp, orders, delta))


def _epsilon_improved(r: np.ndarray, a: np.ndarray, delta: float) -> tuple[float, float]:
    """:func:`rdp_to_epsilon` on validated arguments."""
    if delta == 0:
        return (0.0, float(a[0])) if np.all(r == 0) else (math.inf, math.nan)
    with np.errstate(invalid="ignore", over="ignore"):
        eps = r + np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1.0)
        kl_ok = delta * delta + np.expm1(-r) >= 0
    eps = np.where(kl_ok, 0.0, eps)
    eps = np.where(np.isnan(eps), math.inf, eps)
    k = int(np.argmin(eps))
    if not math.isfinite(eps[k]):
        return math.inf, math.nan
    return max(0.0, float(eps[k])), float(a[k])


def rdp_to_epsilon_classic(
    rdp: Iterable[float], orders: Iterable[float], delta: float
) -> tuple[float, float]:
    """Convert an RDP curve to (eps, delta)-DP with the classic conversion.

    eps = min_a rdp(a) + log(1/delta) / (a - 1) (Mironov 2017, Prop. 3). Looser than
    :func:`rdp_to_epsilon` at every order; kept for comparison with papers that use it.

    Args:
        rdp: RDP values in nats at ``orders``.
        orders: RDP orders a > 1.
        delta: target delta in (0, 1].

    Returns:
        (epsilon, order), epsilon never below 0 (order nan when epsilon is inf).
    """
    r, a, delta = _prepare(rdp, orders, delta)
    if delta == 0:
        return (0.0, float(a[0])) if np.all(r == 0) else (math.inf, math.nan)
    eps = r - math.log(delta) / (a - 1.0)
    k = int(np.argmin(eps))
    if not math.isfinite(eps[k]):
        return math.inf, math.nan
    return max(0.0, float(eps[k])), float(a[k])


# -------------------------------------------------------------------------- accountant


class RdpAccountant:
    """Accumulates the RDP of composed events and reports (eps, delta).

    Takes every event of :data:`~edge_sdk.privacy.events.Event`: the Gaussian family by the
    bounds above, the distributed discrete Gaussian and Skellam by those of
    :mod:`edge_sdk.privacy.discrete`, each restated under this accountant's adjacency; a
    :class:`~edge_sdk.privacy.events.Binomial` when every order of the accountant is one of
    the event's (its restricted moment is added to the others' RDP and its delta0 kept
    apart; once one is composed, epsilon is converted at delta - delta0 without the KL
    shortcut: module docstring).

    Composition is check-then-commit: an event is validated and its RDP computed in full
    before the running total changes, so a rejected event leaves the accountant as it was.

    Args:
        orders: RDP orders a > 1 (default :data:`DEFAULT_ORDERS`).
        adjacency: ``"add_remove"`` (default), ``"substitution"`` or ``"zero_out"``: the
            relation every guarantee is stated under. Each composed event is restated under
            it first (:func:`~edge_sdk.privacy.events.restate`: converted soundly, or
            ValueError).

    Example:
        >>> acc = RdpAccountant().compose(
        ...     PoissonSubsampledGaussian(noise_multiplier=1.1, sample_rate=0.01, steps=1000))
        >>> round(acc.get_epsilon(1e-5), 2)
        1.71

        Discrete events (distributed DP under secure aggregation) compose the same way:

        >>> acc = RdpAccountant().compose(DistributedSkellam(
        ...     l1_sensitivity=1e4, l2_sensitivity=100.0, mu=5e3, devices=10), count=10)
        >>> round(acc.get_epsilon(1e-5), 2)
        4.75
    """

    __slots__ = ("_adjacency", "_delta0", "_orders", "_rdp", "_restricted")

    def __init__(
        self,
        orders: Sequence[float] | np.ndarray | None = None,
        *,
        adjacency: Adjacency = "add_remove",
    ) -> None:
        if adjacency not in ADJACENCIES:
            raise ValueError(
                f"adjacency must be one of {', '.join(ADJACENCIES)}, got {adjacency!r}"
            )
        self._orders = _as_orders(DEFAULT_ORDERS if orders is None else orders)
        self._rdp = np.zeros_like(self._orders)
        self._adjacency: Adjacency = adjacency
        self._delta0 = 0.0  # summed delta0 of the Binomial events composed
        self._restricted = False  # a Binomial event was composed: no KL shortcut

    def __repr__(self) -> str:
        return (
            f"RdpAccountant(orders=<{self._orders.size} orders>, "
            f"adjacency={self._adjacency!r})"
        )

    @property
    def orders(self) -> np.ndarray:
        """The RDP orders (a copy)."""
        return self._orders.copy()

    @property
    def rdp(self) -> np.ndarray:
        """The accumulated RDP at each order, in nats (a copy); a restricted moment once a
        Binomial event is composed (:attr:`delta0`)."""
        return self._rdp.copy()

    @property
    def delta0(self) -> float:
        """The summed delta0 of the composed Binomial events (0 without one)."""
        return self._delta0

    @property
    def adjacency(self) -> Adjacency:
        """The adjacency relation the guarantees are stated for."""
        return self._adjacency

    def supports(self, event: object) -> bool:
        """Whether :meth:`compose` takes ``event``: any event of the union, discrete ones
        included, that restates soundly under this accountant's adjacency (a Binomial one
        only if it states its moment at every order of this accountant)."""
        try:
            _check_binomial_orders(_check_event(event, self._adjacency), self._orders)
        except UnsupportedEventError:
            return False
        return True

    def compose(self, event: Event, count: int = 1) -> RdpAccountant:
        """Add ``count`` runs of ``event``; returns self. Nothing changes if it raises.

        Raises:
            UnsupportedEventError: an event unsupported under this adjacency
                (:meth:`supports` is False).
            ValueError: bad ``count``.
        """
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        increment, delta0, restricted = _compute_moments(event, self._orders, self._adjacency)
        if count:
            self._rdp = self._rdp + count * increment
            self._delta0 += count * delta0
            self._restricted = self._restricted or restricted
        return self

    def get_epsilon_and_order(self, delta: float) -> tuple[float, float]:
        """(epsilon at ``delta``, the best order), by :func:`rdp_to_epsilon`; once a Binomial
        event is composed, by the restricted conversion at ``delta`` - :attr:`delta0`
        (module docstring; inf when delta <= delta0)."""
        # The orders were checked on construction and the RDP is >= 0 by construction.
        delta = _check_delta(delta)
        if self._restricted:
            return _epsilon_restricted(self._rdp, self._orders, delta, self._delta0)
        return _epsilon_improved(self._rdp, self._orders, delta)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon at ``delta`` (inf if some composed event had no noise)."""
        return self.get_epsilon_and_order(delta)[0]
