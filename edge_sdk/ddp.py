"""Distributed DP in the integers: the device-side encoding and the server-side decoding.

Kairouz, Liu, Steinke 2021 ("The Distributed Discrete Gaussian Mechanism for Federated
Learning with Secure Aggregation", KLS), Algorithms 1 and 2, with the Skellam noise of
Agarwal, Kairouz, Liu 2021 ("The Skellam Mechanism for Differentially Private Federated
Learning", AKL) as an alternative. A device

1. clips its update x to L2 norm ``clip`` (C);
2. pads it to d' = the next power of two and rotates it, ``H D x`` with H the orthogonal
   (normalized) Walsh-Hadamard matrix and D a diagonal of random signs derived from the
   shared round seed, so every coordinate is small (KLS Sec. 4: flattening);
3. scales by 1/gamma (gamma: the granularity, model units per integer step);
4. rounds each coordinate stochastically, retrying until the rounded vector's L2 norm is
   at most the bound of :func:`rounded_l2_bound` (conditional randomized rounding, KLS
   Sec. 4); that bound is the L2 sensitivity the accountant uses;
5. adds integer noise: the discrete Gaussian N_Z(0, sigma^2) (exact sampler of Canonne,
   Kamath, Steinke 2020, "The Discrete Gaussian for Differential Privacy", CKS, Alg. 1-3)
   or Skellam Sk(mu, mu) = Poisson(mu) - Poisson(mu);
6. reduces mod 2^bits.

Secure aggregation delivers the sum of the devices' residues mod 2^bits (a uint64 sum
wraps mod 2^64, a multiple of 2^bits, so numpy uint64 addition is enough). The server
(:func:`decode_sum`) takes the centered residue, multiplies by gamma and unrotates. The
sum is decoded exactly unless it wraps; :func:`choose_bits` picks the ring so that the
probability of a wrap is below a target.

Sample-level form (:func:`round_rows`, used by the simulator's ``ddg`` mechanism): each
record's contribution is clipped and conditionally rounded on its own and a device sums
the integer rows, so one record moves the device's vector by at most the rounded bound;
no rotation (coordinates are then bounded only by that norm: :func:`choose_bits_bounded`
sizes the ring for it).

The privacy of the released sum is :func:`event`, a
:class:`~edge_sdk.privacy.events.DistributedDiscreteGaussian` or
:class:`~edge_sdk.privacy.events.DistributedSkellam` with sensitivities on the integer
scale, for :class:`~edge_sdk.privacy.rdp.RdpAccountant` to account (by the bounds of
:mod:`edge_sdk.privacy.discrete`), stated under zero-out or substitution of one device: the
caller must name the relation, and device-level add/remove is refused, because the bound
needs the target's noise share in both neighbouring sums.

Rotation PRG (version ``fedge/ddp/rotation/v1``), shared by devices and server::

    key    = HKDF-SHA256(ikm=round_seed, salt=None (RFC 5869: 32 zero bytes),
                         info=b"fedge/ddp/rotation/v1", length=32)
    stream = ChaCha20 (RFC 8439) keystream under key, block counter 0, nonce 0
             (cryptography's 16-byte nonce = 16 zero bytes), ceil(d'/8) bytes
    bit_i  = bit (i mod 8) of stream byte i // 8 (LSB first), for i in [0, d')
    D_ii   = +1 if bit_i == 0 else -1      (key and stream: edge_sdk.hazmat.prg)

The rotation is for utility (fewer wraps at a given bit width), not privacy: the privacy
argument needs only the L2 bound enforced in step 4, whatever the signs.

Numbers: the discrete Gaussian sampler is exact (integer and rational arithmetic, uniform
64-bit words from the injected Generator); the Skellam noise uses numpy's Poisson sampler
(floating point, not exact in the CKS sense); stochastic rounding compares a float64
uniform with the fractional part (its probabilities are off by at most 2^-53, which moves
no privacy guarantee: the sensitivity is enforced by the integer norm check).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, TypeAlias

import numpy as np

from edge_sdk._validate import check_int as _check_int
from edge_sdk.errors import EdgeError
from edge_sdk.hazmat import prg
from edge_sdk.hazmat.ring import Ring
from edge_sdk.privacy.events import DistributedDiscreteGaussian, DistributedSkellam

__all__ = [
    "MAX_BITS",
    "ROTATION_INFO",
    "DEFAULT_BETA",
    "DEVICE_ADD_REMOVE_REFUSAL",
    "ConditionalRoundingFailed",
    "DistributedDP",
    "NoiseKind",
    "bounded_wrap_probability",
    "choose_bits",
    "choose_bits_bounded",
    "conditional_round",
    "decode_sum",
    "discrete_gaussian_variance",
    "encode_device",
    "event",
    "noise_variance",
    "padded_dim",
    "rotate",
    "rotation_signs",
    "round_rows",
    "rounded_l2_bound",
    "rounding_bias_bound",
    "sample_discrete_gaussian",
    "sample_discrete_laplace",
    "sample_skellam",
    "unrotate",
    "wrap_probability_bound",
]

NoiseKind: TypeAlias = Literal["discrete_gaussian", "skellam"]

ROTATION_INFO = b"fedge/ddp/rotation/v1"
"""HKDF ``info`` label of the rotation-sign PRG; a new label is a new wire version."""

MAX_BITS = 62
"""Largest ring exponent: centered residues and their sums stay well inside int64."""

DEFAULT_BETA = math.exp(-0.5)
"""Conditional rounding's beta in KLS 2021's experiments (each try passes w.p. >= 1 - beta)."""

MIN_SEED_BYTES = 16
_TWO64 = 1 << 64
# Integer-scale magnitudes are kept below this so squared norms are exact in int64.
_MAX_SQ_NORM = 1 << 62


class ConditionalRoundingFailed(EdgeError, ArithmeticError):
    """Conditional randomized rounding found no rounding within the norm bound in time.

    With ``||x|| <= clip`` each try succeeds with probability at least 1 - beta (KLS
    2021), so this means an input that escaped clipping or a cap far too low.
    """


# --------------------------------------------------------------------------- validation


def _check_pos(name: str, value: object, *, allow_zero: bool = False) -> float:
    what = ">= 0" if allow_zero else "> 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite real number {what}, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and (v >= 0 if allow_zero else v > 0)):
        raise ValueError(f"{name} must be finite and {what}, got {value!r}")
    return v


def _check_seed(round_seed: object) -> bytes:
    if not isinstance(round_seed, bytes | bytearray | memoryview):
        raise ValueError(f"round_seed must be bytes, got {type(round_seed).__name__}")
    seed = bytes(round_seed)
    if len(seed) < MIN_SEED_BYTES:
        raise ValueError(f"round_seed must be at least {MIN_SEED_BYTES} bytes, got {len(seed)}")
    return seed


def _float_rows(name: str, x: object) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise ValueError(f"{name} must be a numeric array, got dtype {a.dtype}")
    a = a.astype(np.float64)
    if a.ndim not in (1, 2) or a.shape[-1] == 0:
        raise ValueError(f"{name} must be 1-D (d,) or 2-D (rows, d) with d >= 1, got {a.shape}")
    if not np.isfinite(a).all():
        bad = int(np.flatnonzero(~np.isfinite(a.reshape(-1)))[0])
        got = float(a.reshape(-1)[bad])
        raise ValueError(f"{name} must be finite, got {got!r} at flat index {bad}")
    return a


def padded_dim(d: int) -> int:
    """d' = the smallest power of two >= d (the rotated, noised length)."""
    d = _check_int("d", d, 1)
    return 1 << (d - 1).bit_length()


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True, kw_only=True)
class DistributedDP:
    """Parameters of the distributed-DP encoding, shared by every device and the server.

    Attributes:
        clip: C, the L2 bound each update is clipped to, model units (> 0).
        gamma: granularity: one integer step is gamma model units (> 0); the encoder
            scales by 1/gamma. ``clip / gamma`` must be at most 2^30.
        noise: ``"discrete_gaussian"`` (give ``sigma``) or ``"skellam"`` (give ``mu``).
        bits: ring exponent, the sum lives in Z_{2^bits}, 2 <= bits <= 62 (see
            :func:`choose_bits`).
        sigma: per-device discrete Gaussian parameter on the integer scale (>= 0; 0 adds
            no noise and the accountant reports inf).
        mu: per-device Skellam Poisson rate on the integer scale (noise variance 2 mu)
            (>= 0; 0 adds no noise).
        beta: conditional rounding parameter in [0, 1) (KLS 2021): larger beta, tighter
            norm bound, more retries (each try passes with probability >= 1 - beta). 0
            turns conditioning off (bound C/gamma + sqrt(d')). Default exp(-1/2) as in
            KLS's experiments.
        max_rounding_tries: cap on rounding attempts per vector (>= 1).
    """

    clip: float
    gamma: float
    noise: NoiseKind
    bits: int
    sigma: float | None = None
    mu: float | None = None
    beta: float = DEFAULT_BETA
    max_rounding_tries: int = 100

    def __post_init__(self) -> None:
        _check_pos("clip", self.clip)
        _check_pos("gamma", self.gamma)
        if self.clip / self.gamma > 2**30:
            raise ValueError(
                f"clip / gamma must be <= 2^30 (integer-scale norms stay exact in int64), "
                f"got {self.clip / self.gamma!r}"
            )
        _check_int("bits", self.bits, 2, MAX_BITS)
        if self.noise == "discrete_gaussian":
            if self.sigma is None or self.mu is not None:
                raise ValueError(
                    f"noise='discrete_gaussian' takes sigma and no mu, got sigma={self.sigma!r}, "
                    f"mu={self.mu!r}"
                )
            _check_pos("sigma", self.sigma, allow_zero=True)
        elif self.noise == "skellam":
            if self.mu is None or self.sigma is not None:
                raise ValueError(
                    f"noise='skellam' takes mu and no sigma, got mu={self.mu!r}, "
                    f"sigma={self.sigma!r}"
                )
            _check_pos("mu", self.mu, allow_zero=True)
        else:
            raise ValueError(f"noise must be 'discrete_gaussian' or 'skellam', got {self.noise!r}")
        b = self.beta
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not 0 <= b < 1:
            raise ValueError(f"beta must be in [0, 1), got {b!r}")
        _check_int("max_rounding_tries", self.max_rounding_tries, 1)

    @property
    def modulus(self) -> int:
        """2^bits."""
        return 1 << self.bits

    @property
    def noise_parameter(self) -> float:
        """sigma for the discrete Gaussian, mu for Skellam (per device, integer scale)."""
        value = self.sigma if self.noise == "discrete_gaussian" else self.mu
        if value is None:  # pragma: no cover - __post_init__ rules it out
            raise ValueError(f"noise={self.noise!r} has no parameter set")
        return float(value)

    @property
    def local_std(self) -> float:
        """The per-device noise parameter as a std: sigma, or sqrt(2 mu) for Skellam."""
        if self.noise == "discrete_gaussian":
            return self.noise_parameter
        return math.sqrt(2.0 * self.noise_parameter)


# --------------------------------------------------------------------------- rotation


@functools.lru_cache(maxsize=64)
def _signs_cached(seed: bytes, n: int) -> np.ndarray:
    key = prg.derive_key(seed, info=ROTATION_INFO)
    stream = np.frombuffer(prg.keystream_bytes(key, (n + 7) // 8), dtype=np.uint8)
    bits = np.unpackbits(stream, bitorder="little")[:n]
    signs = 1.0 - 2.0 * bits.astype(np.float64)
    signs.setflags(write=False)
    return signs


def rotation_signs(round_seed: bytes, n: int) -> np.ndarray:
    """The diagonal D of the rotation: n signs +-1 from the round seed (module docstring).

    Args:
        round_seed: the round's shared seed, >= 16 bytes.
        n: how many signs (the padded dimension d').

    Returns:
        Read-only float64 array of +-1.0, length n.
    """
    return _signs_cached(_check_seed(round_seed), _check_int("n", n, 1))


def _fwht(x: np.ndarray) -> np.ndarray:
    """Orthogonal Walsh-Hadamard transform along the last axis (length a power of two).

    H_ij = (-1)^popcount(i & j) / sqrt(n) (Sylvester order); H is symmetric and H H = I.
    """
    n = x.shape[-1]
    lead = x.shape[:-1]
    y = np.array(x, dtype=np.float64).reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(y.shape[0], n // (2 * h), 2, h)
        y = np.stack((y[:, :, 0, :] + y[:, :, 1, :], y[:, :, 0, :] - y[:, :, 1, :]), axis=2)
        h *= 2
    return y.reshape(*lead, n) / math.sqrt(n)


def rotate(x: np.ndarray, round_seed: bytes) -> np.ndarray:
    """The randomized Hadamard rotation ``H D pad(x)`` (KLS 2021, Sec. 4).

    Args:
        x: real array (d,) or (rows, d); each row is rotated.
        round_seed: the round's shared seed (>= 16 bytes).

    Returns:
        float64 array (..., d') with d' = :func:`padded_dim` (d); norms are preserved.
    """
    a = _float_rows("x", x)
    d = a.shape[-1]
    dp = padded_dim(d)
    if dp != d:
        a = np.concatenate((a, np.zeros((*a.shape[:-1], dp - d))), axis=-1)
    return _fwht(a * rotation_signs(round_seed, dp))


def unrotate(y: np.ndarray, round_seed: bytes, d: int) -> np.ndarray:
    """Inverse of :func:`rotate`: ``(D H y)[..., :d]``.

    Args:
        y: real array (d',) or (rows, d'), d' a power of two.
        round_seed: the seed :func:`rotate` used.
        d: the original dimension, d' == :func:`padded_dim` (d).

    Returns:
        float64 array (..., d).
    """
    a = _float_rows("y", y)
    dp = padded_dim(d)
    if a.shape[-1] != dp:
        raise ValueError(f"y must have padded_dim(d={d}) = {dp} entries per row, got {a.shape[-1]}")
    return (_fwht(a) * rotation_signs(round_seed, dp))[..., :d]


# ------------------------------------------------------------------ conditional rounding


def rounded_l2_bound(c: float, dim: int, beta: float) -> float:
    """L2 bound on a stochastically rounded vector of norm <= c (KLS 2021, Sec. 4).

    ``min(c + sqrt(d), sqrt(c^2 + d/4 + sqrt(2 log(1/beta)) (c + sqrt(d)/2)))``, the
    second only for beta > 0: unconditional rounding moves each coordinate by less than
    1, and the rounded norm exceeds the second bound with probability at most beta.

    Args:
        c: norm bound of the vector before rounding, integer scale (>= 0).
        dim: its dimension d (>= 1).
        beta: in [0, 1).

    Returns:
        The bound (integer scale); it is the L2 sensitivity of the rounded vector.
    """
    c = _check_pos("c", c, allow_zero=True)
    d = _check_int("dim", dim, 1)
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}")
    bound_1 = c + math.sqrt(d)
    if beta == 0:
        return bound_1
    sq = c * c + d / 4.0 + math.sqrt(2.0 * math.log(1.0 / beta)) * (c + math.sqrt(d) / 2.0)
    return min(bound_1, math.sqrt(sq))


def rounding_bias_bound(dim: int, beta: float) -> float:
    """Bound on ||E[conditionally rounded y] - y||_2 for ||y|| <= c (integer scale).

    With R the unconditional stochastic rounding (E R = y, ||R - y||_2 < sqrt(d),
    E||R - y||^2 <= d/4) and p = P(||R|| > bound) <= beta (KLS 2021),
    ``E[R | ok] - y = -E[(R - y) 1{not ok}] / (1 - p)``, so by the triangle and
    Cauchy-Schwarz inequalities the bias is at most
    ``min(sqrt(d) beta, sqrt(d beta) / 2) / (1 - beta)``. 0 when beta = 0.

    Args:
        dim: d (>= 1).
        beta: in [0, 1).

    Returns:
        The bound, integer scale (multiply by gamma for model units; rotation keeps it).
    """
    d = _check_int("dim", dim, 1)
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}")
    return min(math.sqrt(d) * beta, math.sqrt(d * beta) / 2.0) / (1.0 - beta)


def conditional_round(
    y: np.ndarray, l2_bound: float, rng: np.random.Generator, *, max_tries: int = 100
) -> np.ndarray:
    """Conditional randomized rounding (KLS 2021, Sec. 4): round until ||r||_2 <= bound.

    Each coordinate rounds up with probability equal to its fractional part; a row whose
    rounded norm exceeds ``l2_bound`` is rounded again from scratch. The check is exact
    (integer squared norm against floor(l2_bound^2) in rational arithmetic).

    Args:
        y: real array (d,) or (rows, d), integer scale.
        l2_bound: the norm every returned row satisfies (from :func:`rounded_l2_bound`).
        rng: randomness of the rounding.
        max_tries: attempts per row before giving up (>= 1).

    Returns:
        int64 array shaped like y.

    Raises:
        ConditionalRoundingFailed: some row still above the bound after ``max_tries``.
        ValueError: non-finite y, or magnitudes whose squared norm would not be exact.
    """
    a = _float_rows("y", y)
    bound = _check_pos("l2_bound", l2_bound, allow_zero=True)
    tries = _check_int("max_tries", max_tries, 1)
    bound_sq = int(Fraction(bound) ** 2)  # floor: ||r||^2 <= bound^2 iff <= this
    rows = a.reshape(-1, a.shape[-1])
    if rows.shape[0] == 0:
        return np.zeros(a.shape, dtype=np.int64)
    # ||r|| < ||y|| + sqrt(d): below 2^31 keeps every partial sum of r_i^2 exact in int64.
    top = float(np.linalg.norm(rows, axis=1).max()) + math.sqrt(rows.shape[1])
    if top * top >= _MAX_SQ_NORM or bound_sq >= _MAX_SQ_NORM:
        raise ValueError(
            f"row norm {top - math.sqrt(rows.shape[1])!r} over {rows.shape[1]} coordinates "
            f"is too large for exact integer norms (squared norm must stay below 2^62)"
        )
    out = np.empty(rows.shape, dtype=np.int64)
    pending = np.arange(rows.shape[0])
    low = np.floor(rows)
    frac = rows - low
    low = low.astype(np.int64)
    for _ in range(tries):
        r = low[pending] + (rng.random((pending.size, rows.shape[1])) < frac[pending])
        ok = np.einsum("ij,ij->i", r, r) <= bound_sq
        out[pending[ok]] = r[ok]
        pending = pending[~ok]
        if pending.size == 0:
            return out.reshape(a.shape)
    raise ConditionalRoundingFailed(
        f"{pending.size} of {rows.shape[0]} rows still had L2 norm above {bound!r} after "
        f"{tries} rounding tries (row norms before rounding up to "
        f"{float(np.linalg.norm(rows[pending], axis=1).max())!r}); clip before rounding"
    )


def round_rows(
    rows: np.ndarray,
    clip: float,
    gamma: float,
    rng: np.random.Generator,
    *,
    beta: float = DEFAULT_BETA,
    max_tries: int = 100,
) -> np.ndarray:
    """Per-record integer encoding: clip each row to L2 ``clip``, scale by 1/gamma, round.

    The record-level form of steps 1, 3 and 4 of the module docstring, for sample-level
    distributed DP: each row (one record's contribution, e.g. a per-sample gradient) is
    clipped to ``clip`` (model units), divided by ``gamma`` and conditionally rounded
    (:func:`conditional_round`) to L2 norm <= :func:`rounded_l2_bound` (clip / gamma, d,
    beta). A device's integer vector is the sum of its rows' encodings, so adding or
    removing one record moves it by one row, of L2 norm at most that bound: the
    sensitivity to account. No rotation: it would only flatten coordinates (fewer bits),
    and the privacy argument needs only the enforced norm bound.

    Args:
        rows: real array (rows, d), model units.
        clip: C, the L2 bound per row, model units (> 0).
        gamma: granularity, model units per integer step (> 0); clip / gamma <= 2^30.
        rng: randomness of the rounding (fresh per row and per try).
        beta: conditional rounding parameter in [0, 1).
        max_tries: attempts per row (>= 1).

    Returns:
        int64 array (rows, d), every row of L2 norm <= rounded_l2_bound(clip/gamma, d, beta).

    Raises:
        ValueError: bad arguments or non-finite rows.
        ConditionalRoundingFailed: see :func:`conditional_round`.
    """
    a = _float_rows("rows", rows)
    if a.ndim != 2:
        raise ValueError(f"rows must be 2-D (rows, d), got shape {a.shape}")
    c = _check_pos("clip", clip)
    g = _check_pos("gamma", gamma)
    if c / g > 2**30:
        raise ValueError(f"clip / gamma must be <= 2^30, got {c / g!r}")
    bound = rounded_l2_bound(c / g, a.shape[1], beta)
    return conditional_round(_clip_rows(a, c) / g, bound, rng, max_tries=max_tries)


# ------------------------------------------------------------------ exact sampling (CKS)


def _bernoulli_tail(num: int, den: int, rng: np.random.Generator) -> bool:
    """Is u < num/den for a fresh uniform u in [0, 1)? Compared 64 bits at a time."""
    while True:
        c, num = divmod(num << 64, den)
        u = int(rng.integers(0, _TWO64, dtype=np.uint64))
        if u != c:
            return u < c


def _bernoulli(
    nums: Sequence[int], den: int, group: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Exact Bernoulli(nums[g] / den) for each element i with g = group[i] (0 <= nums[g] <= den).

    u (a uniform 64-bit word) is compared with floor(p 2^64); a tie (probability 2^-64)
    goes on to the next 64 bits of u and p, so P(True) = p exactly.
    """
    present = np.unique(group)
    thr = np.zeros(len(nums), dtype=np.uint64)
    sure = np.zeros(len(nums), dtype=bool)
    full: dict[int, int] = {}
    for g in present.tolist():
        c = (nums[g] << 64) // den
        full[g] = c
        if c >= _TWO64:
            sure[g] = True
        else:
            thr[g] = c
    u = rng.integers(0, _TWO64, size=group.size, dtype=np.uint64)
    t = thr[group]
    s = sure[group]
    out = (u < t) | s
    for i in np.flatnonzero((u == t) & ~s).tolist():
        g = int(group[i])
        out[i] = _bernoulli_tail((nums[g] << 64) - full[g] * den, den, rng)
    return out


def _bernoulli_exp_neg_unit(
    nums: Sequence[int], den: int, group: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Exact Bernoulli(exp(-nums[g]/den)) for nums[g]/den in [0, 1] (CKS 2020, Alg. 1).

    K = 1; while Bernoulli(gamma / K): K += 1; return K odd. All elements advance together,
    so the survivors of round k share K = k + 1.
    """
    odd = np.ones(group.size, dtype=bool)
    active = np.arange(group.size)
    k = 1
    while active.size:
        active = active[_bernoulli(nums, den * k, group[active], rng)]
        odd[active] = (k + 1) % 2 == 1
        k += 1
    return odd


def _bernoulli_exp_neg(
    nums: Sequence[int], den: int, group: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Exact Bernoulli(exp(-gamma_g)), gamma_g = nums[g]/den >= 0 (CKS 2020, Alg. 1).

    floor(gamma) Bernoulli(exp(-1)) trials must all succeed, then one Bernoulli(exp(-frac)).
    """
    whole = [x // den for x in nums]
    frac = [x - w * den for x, w in zip(nums, whole, strict=True)]
    out = np.ones(group.size, dtype=bool)
    need = np.array([min(w, 1 << 62) for w in whole], dtype=np.int64)[group]
    alive = np.flatnonzero(need > 0)
    while alive.size:
        ok = _bernoulli_exp_neg_unit((1,), 1, np.zeros(alive.size, dtype=np.intp), rng)
        out[alive[~ok]] = False
        alive = alive[ok]
        need[alive] -= 1
        alive = alive[need[alive] > 0]
    idx = np.flatnonzero(out)
    if idx.size:
        out[idx] = _bernoulli_exp_neg_unit(frac, den, group[idx], rng)
    return out


def _size(shape: int | tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    shp = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    for s in shp:
        _check_int("shape entries", s, 0)
    return tuple(int(s) for s in shp), math.prod(int(s) for s in shp)


def sample_discrete_laplace(
    t: int, shape: int | tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
    """Exact discrete Laplace, P(y) proportional to exp(-|y| / t) on the integers.

    CKS 2020, Algorithm 2 with integer scale t: U uniform on [0, t), kept with probability
    exp(-U/t); V geometric (count of Bernoulli(exp(-1)) successes); X = U + t V; a fair
    sign, rejecting -0. Vectorized; every decision is an exact integer comparison.

    Args:
        t: the scale, an integer >= 1.
        shape: output shape.
        rng: randomness.

    Returns:
        int64 array of the given shape.
    """
    t = _check_int("t", t, 1, 1 << 40)
    shp, size = _size(shape)
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        m = size - filled
        u = rng.integers(0, t, size=m, dtype=np.int64)
        vals, inv = np.unique(u, return_inverse=True)
        u = u[_bernoulli_exp_neg_unit(vals.tolist(), t, inv.reshape(-1), rng)]
        v = np.zeros(u.size, dtype=np.int64)
        alive = np.arange(u.size)
        while alive.size:
            alive = alive[_bernoulli_exp_neg_unit((1,), 1, np.zeros(alive.size, np.intp), rng)]
            v[alive] += 1
        x = u + t * v
        neg = rng.integers(0, 2, size=x.size, dtype=np.int8).astype(bool)
        y = np.where(neg, -x, x)[~(neg & (x == 0))]
        take = min(y.size, size - filled)
        out[filled : filled + take] = y[:take]
        filled += take
    return out.reshape(shp)


def sample_discrete_gaussian(
    sigma: float, shape: int | tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
    """Exact samples of N_Z(0, sigma^2): P(y) proportional to exp(-y^2 / (2 sigma^2)).

    CKS 2020, Algorithm 3: t = floor(sigma) + 1, Y ~ discrete Laplace(t), accepted with
    probability exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2)). sigma^2 is taken as the exact
    rational value of the float sigma squared, so the acceptance test is exact: with
    sigma^2 = P/Q, gamma(|Y|) = (|Y| t Q - P)^2 / (2 P Q t^2).

    Args:
        sigma: the parameter (>= 0; 0 gives zeros). Variance is slightly below sigma^2
            (:func:`discrete_gaussian_variance`).
        shape: output shape.
        rng: randomness.

    Returns:
        int64 array of the given shape.
    """
    sigma = _check_pos("sigma", sigma, allow_zero=True)
    if sigma > 2.0**40:
        raise ValueError(f"sigma must be <= 2^40, got {sigma!r}")
    shp, size = _size(shape)
    if sigma == 0:
        return np.zeros(shp, dtype=np.int64)
    s2 = Fraction(sigma) ** 2
    p, q = s2.numerator, s2.denominator
    t = math.floor(sigma) + 1
    den = 2 * p * q * t * t
    tq = t * q
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        m = size - filled
        y = sample_discrete_laplace(t, m, rng)
        vals, inv = np.unique(np.abs(y), return_inverse=True)
        nums = [(v * tq - p) ** 2 for v in vals.tolist()]
        y = y[_bernoulli_exp_neg(nums, den, inv.reshape(-1), rng)]
        take = min(y.size, size - filled)
        out[filled : filled + take] = y[:take]
        filled += take
    return out.reshape(shp)


def discrete_gaussian_variance(sigma: float) -> float:
    """Variance of N_Z(0, sigma^2), summed to float64 precision (below sigma^2, CKS 2020).

    Args:
        sigma: the parameter (>= 0).

    Returns:
        sum_y y^2 p(y), integer scale.
    """
    sigma = _check_pos("sigma", sigma, allow_zero=True)
    if sigma == 0:
        return 0.0
    top = math.ceil(40.0 * sigma) + 2  # the mass beyond 40 sigma is below e^-800
    y = np.arange(1, top + 1, dtype=np.float64)
    w = np.exp(-(y * y) / (2.0 * sigma * sigma))
    return 2.0 * math.fsum(y * y * w) / (1.0 + 2.0 * math.fsum(w))


def sample_skellam(mu: float, shape: int | tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Skellam Sk(mu, mu) = Poisson(mu) - Poisson(mu) (AKL 2021): mean 0, variance 2 mu.

    Uses the Generator's Poisson sampler (floating point; see the module docstring).

    Args:
        mu: Poisson rate (>= 0; 0 gives zeros).
        shape: output shape.
        rng: randomness.

    Returns:
        int64 array of the given shape.
    """
    mu = _check_pos("mu", mu, allow_zero=True)
    if mu > 1e15:
        raise ValueError(f"mu must be <= 1e15, got {mu!r}")
    shp, _ = _size(shape)
    return rng.poisson(mu, size=shp).astype(np.int64) - rng.poisson(mu, size=shp).astype(np.int64)


def noise_variance(cfg: DistributedDP) -> float:
    """Per-device, per-coordinate noise variance on the integer scale.

    Discrete Gaussian: :func:`discrete_gaussian_variance` (sigma); Skellam: 2 mu. The sum
    of n devices' noise has n times this; decoded, gamma^2 n times this in model units.
    """
    if cfg.noise == "discrete_gaussian":
        return discrete_gaussian_variance(cfg.noise_parameter)
    return 2.0 * cfg.noise_parameter


# ------------------------------------------------------------------ encode / decode


def _l2_bound(cfg: DistributedDP, dp: int) -> float:
    return rounded_l2_bound(cfg.clip / cfg.gamma, dp, cfg.beta)


def _clip_rows(a: np.ndarray, bound: float) -> np.ndarray:
    norms = np.linalg.norm(a, axis=-1, keepdims=True)
    return a * np.minimum(1.0, bound / np.maximum(norms, np.finfo(np.float64).tiny))


def encode_device(
    x: np.ndarray, cfg: DistributedDP, round_seed: bytes, rng: np.random.Generator
) -> np.ndarray:
    """One device's (or each row's) clipped, rotated, rounded, noised update mod 2^bits.

    KLS 2021 Algorithm 1 (client): clip to ``cfg.clip``, rotate with the round's signs,
    scale by 1/gamma, conditional randomized rounding to L2 norm <= the bound of
    :func:`event`, add per-device noise (discrete Gaussian or Skellam), reduce mod 2^bits.

    Args:
        x: the update, real (d,), or (rows, d) to encode rows as independent devices
            (same round, fresh randomness per row).
        cfg: the encoding parameters.
        round_seed: the round's shared seed (>= 16 bytes), as the server will use.
        rng: randomness for rounding and noise (never the rotation).

    Returns:
        uint64 array (d',) or (rows, d'), entries in [0, 2^bits), d' = padded_dim(d).

    Raises:
        ValueError: non-finite or malformed x, bad seed.
        ConditionalRoundingFailed: rounding never met the norm bound (see the class).
    """
    a = _float_rows("x", x)
    y = rotate(_clip_rows(a, cfg.clip), round_seed) / cfg.gamma
    dp = y.shape[-1]
    r = conditional_round(y, _l2_bound(cfg, dp), rng, max_tries=cfg.max_rounding_tries)
    if cfg.noise == "discrete_gaussian":
        z = sample_discrete_gaussian(cfg.noise_parameter, r.shape, rng)
    else:
        z = sample_skellam(cfg.noise_parameter, r.shape, rng)
    return (r + z).view(np.uint64) & np.uint64(cfg.modulus - 1)


def decode_sum(
    sum_mod: np.ndarray, cfg: DistributedDP, round_seed: bytes, d: int, devices: int
) -> np.ndarray:
    """The server's estimate of the sum of the devices' clipped updates, model units.

    KLS 2021 Algorithm 2 (server): centered residue mod 2^bits, times gamma, unrotate,
    drop the padding. Exact (up to rounding and the noise, which are what the accountant
    accounts) unless the integer sum left [-2^(bits-1), 2^(bits-1)); see
    :func:`choose_bits`.

    Args:
        sum_mod: the (modular) sum of the devices' encodings, integer (d',) or (rows, d').
        cfg: the encoding parameters the devices used.
        round_seed: the round's seed.
        d: the original dimension.
        devices: how many encodings were summed (>= 1). Decoding does not depend on it;
            it is checked against the ring: 2^(bits-1) must exceed it, else even the
            rounding errors alone can wrap.

    Returns:
        float64 array (d,) or (rows, d).
    """
    n = _check_int("devices", devices, 1)
    if n >= 1 << (cfg.bits - 1):
        raise ValueError(
            f"devices={n} cannot be decoded in {cfg.bits} bits: need 2^(bits-1) > devices"
        )
    a = np.asarray(sum_mod)
    if a.dtype.kind not in "iu":
        raise ValueError(f"sum_mod must be an integer array, got dtype {a.dtype}")
    dp = padded_dim(d)
    if a.ndim not in (1, 2) or a.shape[-1] != dp:
        raise ValueError(
            f"sum_mod must be (d',) or (rows, d') with d' = padded_dim({d}) = {dp}, "
            f"got shape {a.shape}"
        )
    signed = Ring(bits=cfg.bits).to_signed(a)
    return unrotate(signed.astype(np.float64) * cfg.gamma, round_seed, d)


DEVICE_ADD_REMOVE_REFUSAL = (
    "device-level add/remove is not a relation the distributed discrete Gaussian or Skellam "
    "bound covers: the removed device takes its noise share with it, so the neighbours carry "
    "n and n-1 shares, and KLS 2021 Theorem 1 (AKL 2021 likewise) needs the same noise in "
    "both. Every coordinate then leaks the variance change, whatever sigma: at n = 89 "
    "devices, d' = 32768, z = 1 the claimed (4.77, 1e-5) has true delta >= 1.2e-2 (privacy "
    "review of issue 15/16, /work/wt/pr/review.md, Q2). Use adjacency='zero_out' (the device "
    "takes part with a null update, its share stays in the sum) or 'substitution' (its data "
    "replaced, its share stays; sensitivities doubled)"
)
"""Why :func:`event` refuses device-level ``"add_remove"`` (the text of its error)."""


def event(
    cfg: DistributedDP, devices: int, dim: int, steps: int = 1, *, adjacency: str
) -> DistributedDiscreteGaussian | DistributedSkellam:
    """The privacy event of releasing the decoded sum, for one device (the record is a device).

    Sensitivities on the integer scale: D2 = :func:`rounded_l2_bound` (clip/gamma, d',
    beta), the bound conditional rounding enforces on one device's vector, and
    D1 = min(sqrt(d') D2, D2^2) (integer coordinates: |v_i| <= v_i^2), both rounded up. The
    noise is in d' = padded_dim(dim) coordinates. The bound is KLS 2021 Theorem 1 (Skellam:
    AKL 2021), which compares x + Z with x' + Z for the SAME summed noise Z, so it holds
    only for relations under which the target device's noise share is in both neighbours:

    * ``"zero_out"``: the device takes part with a null update (its clipped update is 0,
      its rounded vector 0) and its share stays: D2 and D1 as above;
    * ``"substitution"``: the device's data is replaced and its share stays: the vectors of
      the two neighbours differ by at most 2 D2 (2 D1), by the triangle inequality through 0;
    * ``"add_remove"`` is refused (:data:`DEVICE_ADD_REMOVE_REFUSAL`): an absent device adds
      no share, so the neighbours have n and n-1 shares and no bound here applies.

    Args:
        cfg: the encoding parameters.
        devices: n, the honest uploads certainly in the released sum, the target device
            included: min_survivors - max_colluders (uploads that drop after masking stay in
            the sum; colluders can subtract their own shares). Not SecAgg's threshold t,
            which bounds collusion, not the number of uploads summed.
        dim: the update's dimension d (before padding).
        steps: number of such releases (rounds) to charge.
        adjacency: ``"zero_out"`` or ``"substitution"`` (required: the relation is the
            caller's claim, never a default).

    Returns:
        A :class:`~edge_sdk.privacy.events.DistributedDiscreteGaussian` or
        :class:`~edge_sdk.privacy.events.DistributedSkellam` stated under ``adjacency``.

    Raises:
        ValueError: ``adjacency`` is ``"add_remove"`` (see above) or not a known relation;
            bad ``devices``, ``dim`` or ``steps``.
    """
    if adjacency == "add_remove":
        raise ValueError(f"adjacency={adjacency!r}: {DEVICE_ADD_REMOVE_REFUSAL}")
    if adjacency not in ("zero_out", "substitution"):
        raise ValueError(
            f"adjacency must be 'zero_out' or 'substitution' (device level), got {adjacency!r}"
        )
    n = _check_int("devices", devices, 1)
    dp = padded_dim(dim)
    l2 = _l2_bound(cfg, dp)
    l1 = min(math.sqrt(dp) * l2, l2 * l2)
    if adjacency == "substitution":  # x - x' = (x - 0) + (0 - x'); doubling is exact
        l2, l1 = 2.0 * l2, 2.0 * l1
    l1 = math.nextafter(l1, math.inf)  # never round down
    if cfg.noise == "discrete_gaussian":
        return DistributedDiscreteGaussian(
            l2_sensitivity=l2,
            l1_sensitivity=l1,
            sigma=cfg.noise_parameter,
            devices=n,
            dim=dp,
            steps=steps,
            adjacency=adjacency,
        )
    return DistributedSkellam(
        l1_sensitivity=l1,
        l2_sensitivity=l2,
        mu=cfg.noise_parameter,
        devices=n,
        steps=steps,
        adjacency=adjacency,
    )


# ------------------------------------------------------------------------ bit budget


def _tail(a: float, v_signal: float, n: int, sigma: float, noise: NoiseKind) -> float:
    """Bound on P(|S + N| >= a) for one coordinate (two-sided).

    S is sub-Gaussian with variance proxy ``v_signal`` (a Rademacher sum); N is the sum
    of n noise shares: discrete Gaussian shares are sigma^2-sub-Gaussian (CKS 2020: the
    MGF is e^(t^2 sigma^2 / 2) times a ratio of theta functions that is at most 1),
    Skellam shares have log-MGF mu (e^t + e^-t - 2), mu = sigma^2 / 2 (Chernoff).
    """
    if a <= 0:
        return 1.0
    if noise == "discrete_gaussian":
        v = v_signal + n * sigma * sigma
        return 0.0 if v == 0 else min(1.0, 2.0 * math.exp(-a * a / (2.0 * v)))
    lam = n * sigma * sigma  # 2 n mu: log-MGF of the summed noise is lam (cosh t - 1)
    if lam == 0 and v_signal == 0:
        return 0.0
    hi = math.asinh(a / lam) if lam > 0 else a / v_signal
    if v_signal > 0:
        hi = min(hi, a / v_signal)
    hi = min(hi, 700.0)  # any t >= 0 gives a bound; this keeps cosh(t) finite
    lo = 0.0
    for _ in range(200):  # f'(t) = t v + lam sinh t - a is increasing; any t is a bound
        mid = 0.5 * (lo + hi)
        if mid * v_signal + lam * math.sinh(mid) < a:
            lo = mid
        else:
            hi = mid
    t = 0.5 * (lo + hi)
    log_p = t * t * v_signal / 2.0 + lam * (math.cosh(t) - 1.0) - t * a
    return min(1.0, 2.0 * math.exp(min(log_p, 0.0)))


def wrap_probability_bound(
    devices: int,
    dim: int,
    c: float,
    gamma: float,
    sigma: float,
    bits: int,
    *,
    noise: NoiseKind = "discrete_gaussian",
) -> float:
    """Bound on the probability that some coordinate of the integer sum wraps mod 2^bits.

    Coordinate j of the sum is S_j + R_j + N_j: S_j = (H D sum_k x_k)_j / gamma, a
    Rademacher sum (the signs D) with variance proxy ||sum_k x_k||^2 / (gamma^2 d') <=
    (n c / gamma)^2 / d'; |R_j| < n (each device's rounding moves it by < 1); N_j the
    summed noise. Centered decoding is exact when |S_j + R_j + N_j| < 2^(bits-1), which
    holds unless |S_j + N_j| >= 2^(bits-1) - n; a union bound over the d' coordinates.
    Assumes the signs are uniform and independent of the updates (an honest seed).

    Args:
        devices: n (>= 1).
        dim: d (>= 1), padded to d'.
        c: clip norm, model units (> 0).
        gamma: granularity (> 0).
        sigma: per-device noise std on the integer scale: the discrete Gaussian's sigma,
            or sqrt(2 mu) for Skellam (>= 0).
        bits: ring exponent (>= 1; need not be <= 62 here).
        noise: which noise the devices add.

    Returns:
        The bound, in [0, 1].
    """
    n = _check_int("devices", devices, 1)
    dp = padded_dim(dim)
    c = _check_pos("c", c)
    gamma = _check_pos("gamma", gamma)
    sigma = _check_pos("sigma", sigma, allow_zero=True)
    b = _check_int("bits", bits, 1)
    if noise not in ("discrete_gaussian", "skellam"):
        raise ValueError(f"noise must be 'discrete_gaussian' or 'skellam', got {noise!r}")
    v_signal = (n * c / gamma) ** 2 / dp
    return min(1.0, dp * _tail(2.0 ** (b - 1) - n, v_signal, n, sigma, noise))


def choose_bits(
    devices: int,
    dim: int,
    c: float,
    gamma: float,
    sigma: float,
    wrap_probability: float,
    *,
    noise: NoiseKind = "discrete_gaussian",
) -> int:
    """The smallest ring exponent b whose wrap probability bound is <= ``wrap_probability``.

    KLS 2021 (Sec. 4) choose gamma for a given b from the sub-Gaussian tail of the sum;
    this is the converse, with the rigorous bound of :func:`wrap_probability_bound`.

    Args:
        devices: n, encodings in the sum (>= 1).
        dim: d, the update's dimension (padded to d').
        c: clip norm, model units (> 0).
        gamma: granularity (> 0).
        sigma: per-device noise std on the integer scale (sigma, or sqrt(2 mu) for
            Skellam).
        wrap_probability: target in (0, 1).
        noise: which noise the devices add.

    Returns:
        b, 2 <= b <= 62.

    Raises:
        ValueError: bad arguments, or more than 62 bits needed (the message says how many).
    """
    return _smallest_bits(
        lambda b: wrap_probability_bound(devices, dim, c, gamma, sigma, b, noise=noise),
        wrap_probability,
        f"devices={devices}, dim={dim}, c={c}, gamma={gamma}, sigma={sigma}; raise gamma "
        f"or lower sigma",
    )


def _smallest_bits(bound: Callable[[int], float], wrap_probability: object, what: str) -> int:
    """The smallest b in [2, 62] with ``bound(b) <= wrap_probability`` (bound falls in b)."""
    p = wrap_probability
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p < 1:
        raise ValueError(f"wrap_probability must be in (0, 1), got {p!r}")
    for b in range(2, 1025):
        if bound(b) <= p:
            if b > MAX_BITS:
                raise ValueError(f"wrap probability <= {p} needs {b} bits > {MAX_BITS} for "
                                 f"{what}")
            return b
    raise ValueError(  # pragma: no cover - only for absurd inputs (sums beyond 2^1024)
        f"no ring of up to 1024 bits keeps the wrap probability <= {p}"
    )


def bounded_wrap_probability(
    max_abs_signal: float,
    devices: int,
    dim: int,
    sigma: float,
    bits: int,
    *,
    noise: NoiseKind = "discrete_gaussian",
) -> float:
    """Wrap probability bound when every coordinate of the summed signal is bounded.

    For unrotated sums (e.g. per-record encodings, :func:`round_rows`): coordinate j of
    the integer sum is S_j + N_j with |S_j| <= ``max_abs_signal`` (rounding included, a
    deterministic bound: a rounded row of L2 norm <= D2 has every |coordinate| <= D2) and
    N_j the sum of the ``devices`` noise shares. Centered decoding is exact when
    |S_j + N_j| < 2^(bits-1), which holds unless |N_j| >= 2^(bits-1) - max_abs_signal; a
    union bound over the ``dim`` coordinates, with the noise tails of
    :func:`wrap_probability_bound`.

    Args:
        max_abs_signal: bound on |S_j|, integer scale (>= 0).
        devices: noise shares in the sum (>= 1).
        dim: coordinates (>= 1), not padded.
        sigma: per-device noise std on the integer scale (sigma, or sqrt(2 mu)) (>= 0).
        bits: ring exponent (>= 1).
        noise: which noise the devices add.

    Returns:
        The bound, in [0, 1].
    """
    s = _check_pos("max_abs_signal", max_abs_signal, allow_zero=True)
    n = _check_int("devices", devices, 1)
    d = _check_int("dim", dim, 1)
    sigma = _check_pos("sigma", sigma, allow_zero=True)
    b = _check_int("bits", bits, 1)
    if noise not in ("discrete_gaussian", "skellam"):
        raise ValueError(f"noise must be 'discrete_gaussian' or 'skellam', got {noise!r}")
    a = 2.0 ** (b - 1) - s
    if a <= 0:
        return 1.0
    return min(1.0, d * _tail(a, 0.0, n, sigma, noise))


def choose_bits_bounded(
    max_abs_signal: float,
    devices: int,
    dim: int,
    sigma: float,
    wrap_probability: float,
    *,
    noise: NoiseKind = "discrete_gaussian",
) -> int:
    """The smallest ring exponent whose :func:`bounded_wrap_probability` is <= the target.

    Args:
        max_abs_signal: bound on every coordinate of the summed signal, integer scale.
        devices: noise shares in the sum.
        dim: coordinates.
        sigma: per-device noise std, integer scale.
        wrap_probability: target in (0, 1).
        noise: which noise the devices add.

    Returns:
        b, 2 <= b <= 62.

    Raises:
        ValueError: bad arguments, or more than 62 bits needed (the message says how many).
    """
    return _smallest_bits(
        lambda b: bounded_wrap_probability(max_abs_signal, devices, dim, sigma, b, noise=noise),
        wrap_probability,
        f"max_abs_signal={max_abs_signal}, devices={devices}, sigma={sigma}; raise gamma",
    )
