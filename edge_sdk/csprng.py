"""The device's randomness: a ChaCha20 CSPRNG keyed from the OS, with numpy's sampling API.

Every draw a device's privacy rests on (Poisson batch membership, shuffles, Gaussian and
discrete noise, QSGD and fixed-point randomized rounding, rand-k when used with private
randomness) comes from a :class:`SecureRng`. It offers the subset of
``numpy.random.Generator`` the device code calls (``random``, ``integers``, ``normal``,
``standard_normal``, ``uniform``, ``choice``, ``permutation``, ``binomial``, ``poisson``),
so the pure functions in ``edge_sdk.train``, ``compress`` and ``ddp`` take either: a seeded
``Generator`` in simulators and tests (:func:`seeded_round_rng`), a :class:`SecureRng` on a
device (:func:`secure_round_rng`, the only factory ``edge_sdk.device.Device`` uses; no
device configuration can select another).

Generator (fast-key-erasure, Bernstein 2017, on the mask PRG)::

    key_0   = random_bytes(32)                       (os.urandom on a device)
    block_i = secagg.prg_expand(key_i, 4 + W)        (ChaCha20, RFC 8439, nonce 0)
    key_i+1 = words 0..3 of block_i                  (the old key is overwritten)
    output  = words 4 .. 4 + W - 1 of block_i        (uniform uint64 words)

It reuses ``secagg.prg_expand`` (``update_into`` into a reused buffer; no further copy of
the keystream code). Replacing the key by the block's first words, and zeroing words once
handed out, means a later look at the process memory does not reveal earlier output.

What it guarantees:

* **Unpredictability.** Without the 256-bit key (from the OS CSPRNG) the words are
  indistinguishable from uniform (ChaCha20's PRF security). Nothing in any configuration
  file, the enrollment or the wire determines them: an enroller or aggregator that knows
  every file and every message cannot regenerate the batches or the noise.
* **Exact discrete draws.** ``random``: 53-bit uniforms ``(w >> 11) * 2^-53``, exactly
  uniform on that grid. ``integers``: rejection of words below ``2^64 mod n``, no modulo
  bias. ``permutation``/``choice(replace=False)``: argsort of 64-bit keys, redrawn until
  all keys differ, so every order is exactly equally likely. ``binomial(n, 1/2)``: the
  popcount of n fresh bits (exact; other p are refused).
* **Gaussians hardened against floating-point attacks.** A textbook sampler's output
  ``x + noise`` can reveal x through the floating-point grid of the noise (Mironov 2012
  for the Laplace mechanism; Holohan and Braghin 2021, "Secure Random Sampling in
  Differential Privacy", for Gaussians: with the sampler's uniforms recoverable from one
  output, the noise can be recomputed and subtracted). As Opacus' ``secure_mode`` does
  (``opacus.optimizers.optimizer._generate_noise``, following Holohan and Braghin), each
  N(0, s^2) value is ``(g_1 + g_2 + g_3 + g_4) / 2`` with g_i independent N(0, s^2)
  draws (Marsaglia's polar method on 53-bit uniforms in [-1, 1)): inverting one output
  now needs a search over about 2^(53 * 3) uniforms instead of 2^53. The smallest
  accepted radius is 2^-104, so each g_i is truncated near |g| <= 12 s (tail mass
  ~1e-33 per draw, far below any delta used here).

What it does not guarantee: the Gaussian is a floating-point approximation, not an exact
sampler (a different output grid, correct to float64 rounding); the privacy statements of
``edge_sdk.privacy`` are for the ideal continuous Gaussian and hold up to that rounding,
which the summation makes unexploitable in practice, not provably harmless. For exact
sampling use the integer mechanisms (``ddp.sample_discrete_gaussian``, Canonne, Kamath
and Steinke 2020), which take their words from this generator too. ``poisson`` (for
Skellam noise) is Hormann's PTRS (1993) in float64: unpredictable, not exact. The key and
buffer live in Python memory, which the OS neither locks nor wipes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from edge_sdk.secagg import prg_expand

__all__ = ["Rng", "RoundRng", "SecureRng", "secure_round_rng", "seeded_round_rng"]

_KEY_WORDS = 4  # 32-byte ChaCha20 key
_BLOCK_WORDS = 1 << 15  # 256 KiB of output per rekey
_CHUNK = 2048  # Gaussians per pass (8192 polar draws: the temporaries stay in cache)
_TWO64 = 1 << 64
_INV53 = 2.0**-53


class Rng(Protocol):
    """The sampling methods device code may call (``numpy.random.Generator`` has them)."""

    def random(self, size: Any = None) -> Any: ...

    def integers(self, low: int, high: int | None = None, size: Any = None,
                 dtype: Any = np.int64) -> Any: ...

    def normal(self, loc: float = 0.0, scale: float = 1.0, size: Any = None) -> Any: ...

    def uniform(self, low: float = 0.0, high: float = 1.0, size: Any = None) -> Any: ...

    def choice(self, a: Any, size: Any = None, replace: bool = True) -> Any: ...

    def permutation(self, x: Any) -> Any: ...

    def binomial(self, n: int, p: float, size: Any = None) -> Any: ...

    def poisson(self, lam: float = 1.0, size: Any = None) -> Any: ...


RoundRng = Callable[[int], Rng]
"""A factory: round id -> the randomness of that round (one fresh generator per round)."""


def secure_round_rng(random_bytes: Callable[[int], bytes] = os.urandom) -> RoundRng:
    """The device's factory: each round gets a :class:`SecureRng` with a fresh key from
    ``random_bytes`` (``os.urandom``); the round id does not enter the key."""

    def make(round_id: int) -> Rng:
        return SecureRng(random_bytes=random_bytes)

    return make


def seeded_round_rng(seed: int) -> RoundRng:
    """Simulation and tests only: round r's randomness is ``default_rng([seed, r])``,
    reproducible and therefore predictable by anyone who knows the seed. The device agent
    never calls this and no device configuration reaches it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")

    def make(round_id: int) -> Rng:
        return np.random.default_rng([seed, round_id])  # type: ignore[return-value]

    return make


def _count(size: Any) -> tuple[int, tuple[int, ...] | None]:
    if size is None:
        return 1, None
    shape = (int(size),) if np.ndim(size) == 0 else tuple(int(s) for s in size)
    if any(s < 0 for s in shape):
        raise ValueError(f"size must be non-negative, got {size!r}")
    return math.prod(shape), shape


def _shaped(a: np.ndarray, shape: tuple[int, ...] | None) -> Any:
    return a[0].item() if shape is None else a.reshape(shape)


class SecureRng:
    """A ChaCha20 fast-key-erasure generator keyed from ``random_bytes`` (module docstring).

    Args:
        random_bytes: the key source, called once for 32 bytes (``os.urandom``; tests may
            pass a deterministic source to make a run reproducible).
    """

    __slots__ = ("_key", "_buf", "_pos")

    def __init__(self, *, random_bytes: Callable[[int], bytes] = os.urandom) -> None:
        key = random_bytes(32)
        if not isinstance(key, bytes) or len(key) != 32:
            raise ValueError("random_bytes(32) must return 32 bytes")
        self._key = key
        self._buf = np.empty(_KEY_WORDS + _BLOCK_WORDS, dtype=np.uint64)
        self._pos = len(self._buf)

    # ------------------------------------------------------------------ words

    def _rekeyed(self, out: np.ndarray) -> None:
        prg_expand(self._key, out.size, out=out)
        self._key = out[:_KEY_WORDS].tobytes()
        out[:_KEY_WORDS] = 0

    def words(self, n: int) -> np.ndarray:
        """``n`` fresh uniform uint64 words (a new array)."""
        if n > _BLOCK_WORDS:
            big = np.empty(_KEY_WORDS + n, dtype=np.uint64)
            self._rekeyed(big)
            return big[_KEY_WORDS:]
        if n > len(self._buf) - self._pos:
            self._rekeyed(self._buf)
            self._pos = _KEY_WORDS
        out = self._buf[self._pos:self._pos + n].copy()
        self._buf[self._pos:self._pos + n] = 0  # handed out: not kept in memory
        self._pos += n
        return out

    def _uniform53(self, n: int) -> np.ndarray:
        return (self.words(n) >> np.uint64(11)).astype(np.float64) * _INV53

    def _below(self, n: int, count: int) -> np.ndarray:
        """``count`` uint64 exactly uniform on [0, n), 1 <= n <= 2^64 (rejection)."""
        if n == _TWO64:
            return self.words(count)
        if n & (n - 1) == 0:
            return self.words(count) & np.uint64(n - 1)
        threshold = np.uint64(_TWO64 % n)
        out = np.empty(count, dtype=np.uint64)
        filled = 0
        while filled < count:
            need = count - filled
            w = self.words(need + need // 8 + 4)
            w = w[w >= threshold][:need]
            out[filled:filled + w.size] = w % np.uint64(n)
            filled += w.size
        return out

    # ------------------------------------------------------------------ numpy API

    def random(self, size: Any = None) -> Any:
        """Uniform floats on [0, 1), 53 bits each."""
        n, shape = _count(size)
        return _shaped(self._uniform53(n), shape)

    def uniform(self, low: float = 0.0, high: float = 1.0, size: Any = None) -> Any:
        """Uniform floats on [low, high)."""
        n, shape = _count(size)
        return _shaped(low + (high - low) * self._uniform53(n), shape)

    def integers(self, low: int, high: int | None = None, size: Any = None,
                 dtype: Any = np.int64) -> Any:
        """Integers exactly uniform on [low, high) (numpy's signature; ``high=None``:
        [0, low)). The range must fit in 64 bits and the values in ``dtype``."""
        lo, hi = (0, int(low)) if high is None else (int(low), int(high))
        span = hi - lo
        if not 1 <= span <= _TWO64:
            raise ValueError(f"integers needs 1 <= high - low <= 2^64, got [{lo}, {hi})")
        dt = np.dtype(dtype)
        info = np.iinfo(dt)
        if lo < info.min or hi - 1 > info.max:
            raise ValueError(f"[{lo}, {hi}) does not fit in {dt}")
        n, shape = _count(size)
        r = self._below(span, n)
        if shape is None:
            return dt.type(lo + int(r[0]))
        if dt.kind == "u":
            out = (r + np.uint64(lo)).astype(dt)
        else:  # int64 addition wraps mod 2^64 and lo + r fits in dt: the sum is exact
            out = (r.astype(np.int64) + np.int64(lo)).astype(dt)
        return out.reshape(shape)

    def _polar(self, n: int) -> np.ndarray:
        """n N(0, 1) draws by Marsaglia's polar method (Box-Muller without sin/cos)."""
        parts, have = [], 0
        while have < n:
            m = (n - have + 1) // 2
            m += m // 3 + 16  # acceptance pi/4: one pass almost always suffices
            w = (self.words(2 * m) >> np.uint64(11)).view(np.int64)
            w -= 1 << 52
            uv = w.astype(np.float64).reshape(2, m)
            uv *= 2.0**-52  # 53-bit grid on [-1, 1)
            s = np.einsum("ij,ij->j", uv, uv)
            keep = s < 1.0
            s = s[keep]
            g = np.compress(keep, uv, axis=1)
            if not s.all():  # s == 0 (probability 2^-106 a pair): reject it too
                g, s = g[:, s > 0], s[s > 0]
            f = np.log(s)
            f *= -2.0
            f /= s
            np.sqrt(f, out=f)
            g *= f
            parts.append(g.ravel())
            have += g.size
        return (parts[0] if len(parts) == 1 else np.concatenate(parts))[:n]

    def standard_normal(self, size: Any = None) -> Any:
        """N(0, 1) values, each the sum of four polar draws over 2 (module docstring)."""
        n, shape = _count(size)
        out = np.empty(n, dtype=np.float64)
        for i in range(0, n, _CHUNK):  # small chunks: the temporaries stay in cache
            c = min(_CHUNK, n - i)
            g = self._polar(4 * c)
            o = out[i:i + c]
            np.add(g[:c], g[c:2 * c], out=o)
            o += g[2 * c:3 * c]
            o += g[3 * c:]
            o *= 0.5
        return _shaped(out, shape)

    def normal(self, loc: float = 0.0, scale: float = 1.0, size: Any = None) -> Any:
        """N(loc, scale^2) values (:meth:`standard_normal` scaled)."""
        if not scale >= 0:
            raise ValueError(f"scale must be >= 0, got {scale!r}")
        n, shape = _count(size)
        z = self.standard_normal(n)
        z *= scale
        z += loc
        return _shaped(z, shape)

    def _order(self, n: int) -> np.ndarray:
        while True:  # distinct keys make every order exactly equally likely
            keys = self.words(n)
            order = np.argsort(keys, kind="stable")
            s = keys[order]
            if n < 2 or bool(np.all(s[1:] != s[:-1])):
                return order

    def permutation(self, x: Any) -> np.ndarray:
        """A uniformly random permutation of range(x) (an int) or of the array x."""
        if np.ndim(x) == 0:
            n = int(x)
            if n < 0:
                raise ValueError(f"permutation needs n >= 0, got {n}")
            return self._order(n).astype(np.int64)
        a = np.asarray(x)
        return a[self._order(len(a))]

    def choice(self, a: Any, size: Any = None, replace: bool = True) -> Any:
        """``size`` items of range(a) (an int) or of the array a, uniformly, with or
        without replacement (without: the first items of a uniform permutation)."""
        pool = None if np.ndim(a) == 0 else np.asarray(a)
        m = int(a) if pool is None else len(pool)
        n, shape = _count(size)
        if m < 1 or (not replace and n > m):
            raise ValueError(f"cannot choose {n} of {m} items (replace={replace})")
        idx = (self._below(m, n).astype(np.int64) if replace
               else self._order(m)[:n].astype(np.int64))
        picked = idx if pool is None else pool[idx]
        return _shaped(picked, shape)

    def binomial(self, n: int, p: float, size: Any = None) -> Any:
        """Binomial(n, 1/2): the popcount of n fresh bits each (exact). Other p: refused."""
        if p != 0.5:
            raise ValueError(f"SecureRng.binomial samples p = 1/2 only, got p={p!r}")
        n = int(n)
        if n < 0:
            raise ValueError(f"binomial needs n >= 0, got {n}")
        count, shape = _count(size)
        full, rest = divmod(n, 64)
        per = full + (1 if rest else 0)
        out = np.zeros(count, dtype=np.int64)
        if per:
            w = self.words(count * per).reshape(count, per)
            if rest:
                w[:, -1] &= np.uint64((1 << rest) - 1)
            out = np.bitwise_count(w).sum(axis=1, dtype=np.int64)
        return _shaped(out, shape)

    def poisson(self, lam: float = 1.0, size: Any = None) -> Any:
        """Poisson(lam): multiplication method below 10, Hormann's PTRS (1993) above."""
        lam = float(lam)
        if not (math.isfinite(lam) and lam >= 0):
            raise ValueError(f"lam must be finite and >= 0, got {lam!r}")
        count, shape = _count(size)
        out = np.zeros(count, dtype=np.int64)
        if lam == 0 or count == 0:
            return _shaped(out, shape)
        pending = np.arange(count)
        if lam < 10:
            limit = math.exp(-lam)
            prod = np.ones(count)
            while pending.size:
                prod[pending] *= self._uniform53(pending.size)
                going = prod[pending] > limit
                out[pending[going]] += 1
                pending = pending[going]
            return _shaped(out, shape)
        slam, loglam = math.sqrt(lam), math.log(lam)
        b = 0.931 + 2.53 * slam
        a = -0.059 + 0.02483 * b
        inv_alpha = 1.1239 + 1.1328 / (b - 3.4)
        vr = 0.9277 - 3.6224 / (b - 2)
        while pending.size:
            u = self._uniform53(pending.size) + (2.0**-54 - 0.5)  # in (-1/2, 1/2): us > 0
            v = self._uniform53(pending.size)
            us = 0.5 - np.abs(u)
            k = np.floor((2 * a / us + b) * u + lam + 0.43)
            quick = (us >= 0.07) & (v <= vr)
            maybe = ~quick & (k >= 0) & ~((us < 0.013) & (v > us))
            ok = quick.copy()
            if maybe.any():
                km, um, vm = k[maybe], us[maybe], v[maybe]
                lg = np.array([math.lgamma(kk + 1.0) for kk in km.tolist()])
                ok[maybe] = (np.log(vm * inv_alpha / (a / (um * um) + b))
                             <= -lam + km * loglam - lg)
            out[pending[ok]] = k[ok].astype(np.int64)
            pending = pending[~ok]
        return _shaped(out, shape)
