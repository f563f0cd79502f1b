"""Upload compression for constrained uplinks: rand-k, QSGD, bit packing.

Pure functions over numpy arrays; every random choice takes an injected
``numpy.random.Generator``, except the rand-k coordinate set, which is derived from the
round seed with a keyed PRG so that the whole cohort (and the aggregator) computes the
same set bit for bit without sending it. This module is shared with the aggregator: the
coordinate-set PRG and the packed layout are wire formats, pinned
by the golden vectors in ``tests/golden/compress_vectors.json``.

Pieces, with the equation each implements:

* :func:`coordinate_set`, :func:`sparsify`, :func:`desparsify`, :func:`rand_k`: the
  rand_k sparsifier of Fed-SPA (Hu, Gong, Guo) Def. 2, eq. (4), scaled by 1/p as in
  eq. (5) (``S(x) = (1/p) rand_k(x)``) so that the estimate is unbiased.
* :func:`quantize`, :func:`dequantize`: unbiased stochastic quantization with s levels
  (QSGD, Alistarh et al. 2017), privatized FedPAQ (Mohammadi et al.) eq. (20), applied
  after the DP noise as in its Alg. 2 line 9.
* :func:`pack_quantized`, :func:`unpack_quantized`, :func:`packed_size`: sign and level
  jointly coded in ceil(log2(2s+1)) bits per coordinate (FedPAQ, text after eq. (20)).
* :func:`binomial_noise`: the binomial mechanism of cpSGD (Agarwal et al. 2018), the
  baseline Fed-SPA compares against.
* :class:`TopK`, :func:`top_k_feedback`: top-k with error feedback, for non-private runs
  only (refused when DP is on).

Coordinate-set PRG (version ``fedge/randk/v1``)::

    key    = HKDF-SHA256(ikm=round_seed, salt=None (RFC 5869: 32 zero bytes),
                         info=b"fedge/randk/v1", length=32)
    stream = ChaCha20 (RFC 8439) keystream under key, block counter 0, 96-bit nonce 0
             (cryptography's 16-byte nonce = 16 zero bytes)
    words  = stream cut into consecutive 8-byte little-endian unsigned integers w_0, w_1, ...
    a      = [0, 1, ..., d-1]            (virtual; only displaced entries are stored)
    for i in 0 .. k-1:                    (partial Fisher-Yates)
        n = d - i
        t = 2^64 mod n
        w = next word; while w < t: w = next word      (rejection: no modulo bias)
        j = i + (w mod n)
        chosen_i = a[j]; a[j] = a[i]
    omega  = sorted(chosen_0 .. chosen_{k-1}) as int64

Each of the d!/(d-k)! ordered draws is equally likely, so omega is exactly uniform over
the k-subsets of [0, d), and it depends on nothing but (round_seed, d, k). The key, the
words and the partial shuffle are ``edge_sdk.hazmat.prg``'s ``derive_key``, ``WordStream``
and ``fisher_yates``.

Packed QSGD layout (:func:`pack_quantized`), all little-endian::

    offset  size  field
    0       4     norm   float32 (IEEE 754 binary32), finite, >= 0
    4       4     n      uint32, number of coordinates
    8       4     s      uint32, number of levels, 1 <= s <= 2^31 - 1
    12      P     symbols, P = ceil(n * b / 8), b = ceil(log2(2s + 1)) = (2s).bit_length()

Symbol i is ``level_i * (-1 if sign_i else +1) + s``, in [0, 2s]. Symbols form one
LSB-first bit stream: bit m of symbol i is stream bit i*b + m, and stream bit j is bit
(j mod 8) of payload byte j // 8 (for b = 8 the payload is simply one byte per symbol).
Padding bits in the last byte are zero. Decoding rejects any other length, a header
whose n or s differs from what the receiver expects, a non-finite or negative norm,
symbols above 2s and non-zero padding, so every valid message has one decoding.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from edge_sdk._validate import check_int as _check_int
from edge_sdk.hazmat import prg

__all__ = [
    "HEADER_SIZE",
    "RANDK_INFO",
    "Quantized",
    "TopK",
    "binomial_noise",
    "coordinate_set",
    "dequantize",
    "desparsify",
    "kept_count",
    "pack_quantized",
    "packed_size",
    "quantize",
    "rand_k",
    "sparsify",
    "symbol_bits",
    "top_k_feedback",
    "unpack_quantized",
]

RANDK_INFO = b"fedge/randk/v1"
"""HKDF ``info`` label of the coordinate-set PRG; a new label is a new wire version."""

HEADER_SIZE = 12
"""Bytes of the packed-QSGD header: norm (float32), n (uint32), s (uint32)."""

MIN_SEED_BYTES = 16
_MAX_S = 2**31 - 1
_MAX_N = 2**32 - 1
_HEADER = np.dtype([("norm", "<f4"), ("n", "<u4"), ("s", "<u4")])


def _check_fraction(name: str, p: object) -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise ValueError(f"{name} must be a real number in (0, 1], got {p!r}")
    if not (math.isfinite(p) and 0 < p <= 1):
        raise ValueError(f"{name} must be in (0, 1], got {p!r}")
    return float(p)


def _float_vector(name: str, x: object) -> np.ndarray:
    """``x`` as a 1-D float array (float64 unless already floating); finite."""
    a = np.asarray(x)
    if a.dtype.kind not in "fiub":
        raise ValueError(f"{name} must be a numeric array, got dtype {a.dtype}")
    if a.dtype.kind != "f":
        a = a.astype(np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if not np.isfinite(a).all():
        bad = int(np.flatnonzero(~np.isfinite(a))[0])
        raise ValueError(f"{name} must be finite, got {a[bad]!r} at index {bad}")
    return a


# --------------------------------------------------------------------------- rand-k


def kept_count(d: int, p: float) -> int:
    """The number k of coordinates rand-k keeps of d at kept fraction p.

    ``k = max(1, round(p * d))`` with Python's ``round`` (half to even), so ``1 <= k <= d``.
    The unbiased scaling (Fed-SPA eq. (5)) then uses the realized fraction ``k / d``.

    Args:
        d: dimension, >= 1.
        p: kept fraction in (0, 1].

    Returns:
        k.

    Raises:
        ValueError: d < 1 or p outside (0, 1].
    """
    d = _check_int("d", d, 1)
    p = _check_fraction("p (kept fraction)", p)
    return min(d, max(1, round(p * d)))


def coordinate_set(round_seed: bytes, d: int, k: int) -> np.ndarray:
    """The round's rand-k coordinate set omega, derived from the round seed.

    Fed-SPA Def. 2: omega is drawn uniformly from the k-subsets of [d]. Here the draw is
    a keyed PRG of the round seed (HKDF-SHA256 then ChaCha20, see the module docstring
    for the exact algorithm), so every device of the cohort and the aggregator obtain the
    same set without sending indices (secure aggregation needs the same coordinates on
    every device), and the set is independent of the data (the privacy argument needs it).

    Args:
        round_seed: secret per-round seed from the round plan, >= 16 bytes.
        d: dimension of the flattened update, >= 1.
        k: number of kept coordinates, 1 <= k <= d (see :func:`kept_count`).

    Returns:
        Sorted int64 array of k distinct indices in [0, d).

    Raises:
        ValueError: seed too short or not bytes, d or k out of range.
    """
    if not isinstance(round_seed, bytes | bytearray | memoryview):
        raise ValueError(f"round_seed must be bytes, got {type(round_seed).__name__}")
    seed = bytes(round_seed)
    if len(seed) < MIN_SEED_BYTES:
        raise ValueError(f"round_seed must be at least {MIN_SEED_BYTES} bytes, got {len(seed)}")
    d = _check_int("d", d, 1, 2**63 - 1)
    k = _check_int("k", k, 1, d)
    words = prg.WordStream(prg.derive_key(seed, info=RANDK_INFO), chunk=k + 8)
    return np.sort(np.asarray(prg.fisher_yates(words, d, k), dtype=np.int64))


def _check_indices(idx: object, d: int) -> np.ndarray:
    a = np.asarray(idx)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"idx must be a 1-D integer array, got dtype {a.dtype} shape {a.shape}")
    if a.size and (a.min() < 0 or a.max() >= d):
        raise ValueError(f"idx must lie in [0, {d}), got range [{a.min()}, {a.max()}]")
    repeats = a.size - np.unique(a).size
    if repeats:
        raise ValueError(f"idx must be distinct, got {repeats} repeated entries")
    return a.astype(np.int64, copy=False)


def sparsify(x: np.ndarray, idx: np.ndarray, p: float | None = None) -> np.ndarray:
    """The kept values of the scaled sparsifier: ``x[idx] / p``.

    Fed-SPA eq. (5), ``S(x) = (1/p) rand_k(x, omega)``, restricted to omega (the values
    that travel). With p the inclusion probability of each coordinate, ``k / d`` for a
    uniform k-subset, ``E[S(x)] = x``.

    Args:
        x: dense 1-D update of length d, finite.
        idx: the coordinate set omega (distinct indices in [0, d)).
        p: the 1/p scaling's p in (0, 1]; defaults to ``len(idx) / d``, the value that
            makes the estimate unbiased.

    Returns:
        ``x[idx] / p`` in x's float dtype (float64 for integer x).

    Raises:
        ValueError: x not 1-D or not finite, bad indices, p outside (0, 1].
    """
    x = _float_vector("x", x)
    idx = _check_indices(idx, x.size)
    if p is None:
        if idx.size == 0:
            raise ValueError("idx must not be empty when p is implied (p = len(idx) / d)")
        p = idx.size / x.size
    p = _check_fraction("p", p)
    return (x[idx].astype(np.float64) / p).astype(x.dtype)


def desparsify(values: np.ndarray, idx: np.ndarray, d: int) -> np.ndarray:
    """The dense vector with ``values`` at ``idx`` and zeros elsewhere.

    Inverse layout of :func:`sparsify`: ``desparsify(sparsify(x, idx, p), idx, d)`` is
    Fed-SPA's ``(1/p) rand_k(x, omega)`` (Def. 2, eq. (4), scaled as in eq. (5)).

    Args:
        values: 1-D values, one per index.
        idx: distinct indices in [0, d).
        d: dimension of the result.

    Returns:
        Dense array of length d, values' dtype.

    Raises:
        ValueError: lengths differ, bad indices.
    """
    d = _check_int("d", d, 1)
    v = np.asarray(values)
    idx = _check_indices(idx, d)
    if v.ndim != 1 or v.size != idx.size:
        raise ValueError(
            f"values must be 1-D with len(idx) = {idx.size} entries, got shape {v.shape}"
        )
    dense = np.zeros(d, dtype=v.dtype)
    dense[idx] = v
    return dense


def rand_k(x: np.ndarray, p: float, rng: np.random.Generator) -> np.ndarray:
    """One draw of the scaled sparsifier ``(d/k) rand_k(x)`` with a fresh uniform set.

    Fed-SPA Def. 2 with eq. (5) scaling, omega drawn from ``rng`` (not from a round
    seed): ``k = kept_count(d, p)`` and the scale is the realized ``d / k``, so
    ``E = x`` and ``E ||S(x) - x||^2 = (d/k - 1) ||x||^2`` exactly.

    Args:
        x: dense 1-D finite update.
        p: kept fraction in (0, 1].
        rng: source of the coordinate set.

    Returns:
        Dense array like x: ``x_j * d / k`` on the kept coordinates, 0 elsewhere.
    """
    x = _float_vector("x", x)
    k = kept_count(x.size, p)
    idx = np.sort(rng.choice(x.size, size=k, replace=False))
    return desparsify(sparsify(x, idx), idx, x.size)


# --------------------------------------------------------------------------- QSGD


def _level_dtype(s: int) -> np.dtype:
    if s <= 0xFF:
        return np.dtype(np.uint8)
    if s <= 0xFFFF:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


def symbol_bits(s: int) -> int:
    """Bits per packed coordinate, ``ceil(log2(2s + 1))``, for s levels (s >= 1)."""
    s = _check_int("s (quantization levels)", s, 1, _MAX_S)
    return (2 * s).bit_length()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Quantized:
    """A QSGD-quantized vector: ``Q_i = norm * (-1)^signs_i * levels_i / s``.

    FedPAQ eq. (20) with ``vartheta_i = levels_i / s``. Construction validates and
    canonicalizes: the arrays become read-only copies and a sign on a zero level is
    cleared (it carries no information and does not survive packing).

    Attributes:
        norm: the scale, a float32 >= 0 (the L2 norm rounded up to float32).
        signs: bool array, True where the coordinate is negative.
        levels: unsigned array of levels in [0, s].
        s: number of quantization levels, >= 1.
    """

    norm: np.float32
    signs: np.ndarray
    levels: np.ndarray
    s: int

    def __post_init__(self) -> None:
        s = _check_int("s (quantization levels)", self.s, 1, _MAX_S)
        norm = np.float32(self.norm)
        if not (np.isfinite(norm) and norm >= 0):
            raise ValueError(f"norm must be a finite float32 >= 0, got {self.norm!r}")
        levels = np.asarray(self.levels)
        signs = np.asarray(self.signs)
        if levels.ndim != 1 or levels.dtype.kind not in "iu":
            raise ValueError(
                f"levels must be a 1-D integer array, got dtype {levels.dtype} shape {levels.shape}"
            )
        if signs.shape != levels.shape or signs.dtype != np.bool_:
            raise ValueError(
                f"signs must be a bool array shaped like levels {levels.shape}, "
                f"got dtype {signs.dtype} shape {signs.shape}"
            )
        if levels.size and (levels.min() < 0 or levels.max() > s):
            raise ValueError(
                f"levels must lie in [0, s={s}], got range [{levels.min()}, {levels.max()}]"
            )
        levels = levels.astype(_level_dtype(s))
        signs = signs & (levels > 0)
        levels.setflags(write=False)
        signs.setflags(write=False)
        object.__setattr__(self, "s", s)
        object.__setattr__(self, "norm", norm)
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "signs", signs)

    @property
    def n(self) -> int:
        """Number of coordinates."""
        return int(self.levels.size)


def _float32_ceil(v: float) -> np.float32:
    """The smallest float32 >= v (v finite, >= 0); inf if v exceeds float32's range."""
    f = np.float32(v) if v <= float(np.finfo(np.float32).max) else np.float32(np.inf)
    if float(f) < v:
        f = np.nextafter(f, np.float32(np.inf))
    return f


def quantize(x: np.ndarray, s: int, rng: np.random.Generator) -> Quantized:
    """Unbiased stochastic quantization of x with s levels (QSGD).

    Privatized FedPAQ eq. (20): ``Q_i(x) = ||x|| sign(x_i) vartheta_i(x, s)`` where
    vartheta_i is ``(l+1)/s`` with probability ``|x_i|/||x|| * s - l`` and ``l/s``
    otherwise, ``l = floor(|x_i|/||x|| * s)``. The norm travels as float32, rounded *up*,
    and the ratios are taken against that stored norm, so ``E[dequantize(q)] = x`` holds
    for the values actually sent (not just up to float32 rounding of the norm), and
    ``E ||Q(x) - x||^2 = (norm/s)^2 sum_i f_i (1 - f_i) <= min(d/s^2, sqrt(d)/s) ||x||^2``
    (Alistarh et al. 2017, Lemma 3.1; f_i the fractional part of s |x_i| / norm).

    Args:
        x: 1-D finite vector (any float dtype; integer input is taken as float64).
        s: number of levels, 1 <= s <= 2^31 - 1 (s = 127 codes each value in 8 bits).
        rng: randomness of the stochastic rounding.

    Returns:
        The :class:`Quantized` value. A zero vector gives norm 0 and all levels 0.

    Raises:
        ValueError: x not 1-D, not finite, or its norm exceeds float32's range; bad s.
    """
    s = _check_int("s (quantization levels)", s, 1, _MAX_S)
    x = _float_vector("x", x)
    a = np.abs(x.astype(np.float64))
    top = float(a.max()) if a.size else 0.0
    # Scaled by the largest entry so that squares of tiny (or huge) entries cannot
    # underflow (or overflow): a norm of 0 must mean x == 0.
    norm64 = top * float(np.sqrt(np.sum((a / top) ** 2))) if top > 0 else 0.0
    norm = _float32_ceil(norm64)
    if not np.isfinite(norm):
        raise ValueError(
            f"the norm of x must fit float32 (<= {np.finfo(np.float32).max}), got {norm64!r}"
        )
    if norm == 0:
        levels = np.zeros(x.size, dtype=_level_dtype(s))
        return Quantized(norm=norm, signs=np.zeros(x.size, dtype=bool), levels=levels, s=s)
    u = np.minimum(a / float(norm), 1.0) * s
    low = np.floor(u)
    levels = low + (rng.random(x.size) < (u - low))
    return Quantized(norm=norm, signs=x < 0, levels=levels.astype(_level_dtype(s)), s=s)


def dequantize(q: Quantized) -> np.ndarray:
    """The float32 vector ``norm * (-1)^sign * level / s`` (FedPAQ eq. (20)).

    Computed in float64 and rounded once to float32.
    """
    if not isinstance(q, Quantized):
        raise ValueError(f"q must be a Quantized, got {type(q).__name__}")
    mag = float(q.norm) * (q.levels.astype(np.float64) / q.s)
    return np.where(q.signs, -mag, mag).astype(np.float32)


def packed_size(n: int, s: int) -> int:
    """Exact byte length of :func:`pack_quantized` for n coordinates and s levels.

    ``HEADER_SIZE + ceil(n * ceil(log2(2s + 1)) / 8)``; e.g. 12 + n for s = 127.
    """
    n = _check_int("n", n, 0, _MAX_N)
    return HEADER_SIZE + (n * symbol_bits(s) + 7) // 8


def pack_quantized(q: Quantized) -> bytes:
    """Serialize q in the packed layout of the module docstring.

    Args:
        q: the quantized vector (at most 2^32 - 1 coordinates).

    Returns:
        ``packed_size(q.n, q.s)`` bytes.
    """
    if not isinstance(q, Quantized):
        raise ValueError(f"q must be a Quantized, got {type(q).__name__}")
    n = _check_int("number of coordinates", q.n, 0, _MAX_N)
    b = symbol_bits(q.s)
    header = np.array((q.norm, n, q.s), dtype=_HEADER).tobytes()
    sym = q.levels.astype(np.int64)
    sym = np.where(q.signs, -sym, sym) + q.s
    if b == 8:
        return header + sym.astype(np.uint8).tobytes()
    bits = ((sym[:, None] >> np.arange(b, dtype=np.int64)) & 1).astype(np.uint8)
    return header + np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def unpack_quantized(data: bytes | bytearray | memoryview, n: int, s: int) -> Quantized:
    """Parse bytes from :func:`pack_quantized`, expecting n coordinates and s levels.

    Args:
        data: the whole message, exactly ``packed_size(n, s)`` bytes.
        n: number of coordinates the receiver expects (the round's k).
        s: number of levels the receiver expects.

    Returns:
        The :class:`Quantized`; ``pack_quantized`` of it gives back ``data``.

    Raises:
        ValueError: wrong length (expected vs actual), header n or s not the expected
            ones, non-finite or negative norm, a symbol above 2s, non-zero padding bits.
        TypeError: data is not bytes-like.
    """
    n = _check_int("n", n, 0, _MAX_N)
    s = _check_int("s (quantization levels)", s, 1, _MAX_S)
    try:
        buf = memoryview(data).cast("B")
    except TypeError as exc:
        raise TypeError(f"data must be bytes-like, got {type(data).__name__}") from exc
    expected = packed_size(n, s)
    if len(buf) != expected:
        raise ValueError(
            f"packed QSGD for n={n}, s={s} must be exactly {expected} bytes "
            f"({HEADER_SIZE} header + {expected - HEADER_SIZE} payload), "
            f"got {len(buf)}"
        )
    head = np.frombuffer(buf[:HEADER_SIZE], dtype=_HEADER)[0]
    if int(head["n"]) != n or int(head["s"]) != s:
        raise ValueError(
            f"header says n={int(head['n'])}, s={int(head['s'])}, expected n={n}, s={s}"
        )
    norm = head["norm"]
    if not (np.isfinite(norm) and norm >= 0):
        raise ValueError(f"header norm must be a finite float32 >= 0, got {float(norm)!r}")
    payload = np.frombuffer(buf[HEADER_SIZE:], dtype=np.uint8)
    b = symbol_bits(s)
    if b == 8:
        sym = payload.astype(np.int64)
    else:
        bits = np.unpackbits(payload, bitorder="little")
        if bits[n * b :].any():
            raise ValueError(f"padding bits after {n} symbols of {b} bits must be zero")
        sym = (bits[: n * b].reshape(n, b).astype(np.int64) << np.arange(b)).sum(axis=1)
    if sym.size and sym.max() > 2 * s:
        bad = int(np.argmax(sym > 2 * s))
        raise ValueError(f"symbol {int(sym[bad])} at coordinate {bad} exceeds 2s = {2 * s}")
    signed = sym - s
    return Quantized(norm=norm, signs=signed < 0, levels=np.abs(signed), s=s)


# --------------------------------------------------------------------------- cpSGD


def binomial_noise(shape: int | tuple[int, ...], m: int, rng: np.random.Generator) -> np.ndarray:
    """Centered binomial noise ``Binomial(m, 1/2) - m/2`` (cpSGD, Agarwal et al. 2018).

    The binomial mechanism: added to the quantized integers, it keeps them integers
    (so they stay packable and summable under secure aggregation). Each entry has mean 0
    and variance ``m/4``, and lies in [-m/2, m/2].

    Args:
        shape: output shape.
        m: number of fair coin flips, even (so m/2 is an integer) and >= 0.
        rng: randomness.

    Returns:
        int64 array of the given shape.
    """
    m = _check_int("m (binomial trials)", m, 0, 2**62)
    if m % 2:
        raise ValueError(f"m must be even so that Binomial(m, 1/2) - m/2 is an integer, got {m}")
    return rng.binomial(m, 0.5, size=shape).astype(np.int64) - m // 2


# --------------------------------------------------------------------------- top-k


_TOPK_REFUSAL = (
    "top-k is refused when DP is enabled: it keeps the largest-magnitude coordinates, so "
    "its index set is data-dependent. That leaks through the indices and voids the DP "
    "argument (which needs a data-independent coordinate set, Fed-SPA Def. 2), and devices "
    "would keep different coordinates, which breaks secure-aggregation mask cancellation. "
    "Use the seeded rand-k set (coordinate_set, sparsify) instead."
)


def top_k_feedback(
    x: np.ndarray, residual: np.ndarray, k: int, *, dp_enabled: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-k sparsification with error feedback, for NON-private runs only.

    Adds the carried residual to x, keeps the k largest magnitudes (ties: lowest index),
    and carries what was not sent (including the float rounding of what was).

    Args:
        x: 1-D finite update.
        residual: the carried error, float64, same length (zeros at first).
        k: coordinates to keep, 1 <= k <= len(x).
        dp_enabled: must be False; True raises.

    Returns:
        (sorted int64 indices, values in x's float dtype, new float64 residual).

    Raises:
        ValueError: dp_enabled is True (see the message), or bad arguments.
    """
    if dp_enabled:
        raise ValueError(_TOPK_REFUSAL)
    x = _float_vector("x", x)
    r = np.asarray(residual, dtype=np.float64)
    if r.shape != x.shape:
        raise ValueError(f"residual must have shape {x.shape}, got {r.shape}")
    k = _check_int("k", k, 1, x.size)
    acc = x.astype(np.float64) + r
    idx = np.sort(np.argsort(-np.abs(acc), kind="stable")[:k]).astype(np.int64)
    values = acc[idx].astype(x.dtype)
    new_residual = acc.copy()
    new_residual[idx] -= values.astype(np.float64)
    return idx, values, new_residual


class TopK:
    """Holds the error-feedback residual of :func:`top_k_feedback` across rounds.

    Non-private runs only: ``dp_enabled=True`` raises ``ValueError`` at construction.
    """

    __slots__ = ("_d", "_dp_enabled", "_k", "_residual")

    def __init__(self, *, k: int, d: int, dp_enabled: bool) -> None:
        if dp_enabled:
            raise ValueError(_TOPK_REFUSAL)
        self._d = _check_int("d", d, 1)
        self._k = _check_int("k", k, 1, self._d)
        self._dp_enabled = False
        self._residual = np.zeros(self._d, dtype=np.float64)

    @property
    def residual(self) -> np.ndarray:
        """A copy of the carried error."""
        return self._residual.copy()

    def compress(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Send the top k of ``x + residual``; keep the rest as the new residual."""
        idx, values, self._residual = top_k_feedback(
            x, self._residual, self._k, dp_enabled=self._dp_enabled
        )
        return idx, values
