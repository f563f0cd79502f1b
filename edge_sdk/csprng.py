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

Generator (fast-key-erasure, Bernstein 2017, on the mask PRG's stream)::

    key_0   = random_bytes(32)                       (os.urandom on a device)
    block_i = 4 + W uint64 words of prg.keystream_into(key_i, ...)
                                                     (ChaCha20, RFC 8439, nonce 0; the words
                                                     of prg.expand at a 64-bit ring)
    key_i+1 = words 0..3 of block_i                  (the old key is overwritten)
    output  = words 4 .. 4 + W - 1 of block_i        (uniform uint64 words)

It reuses ``edge_sdk.hazmat.prg`` (``update_into`` into a reused buffer; no further copy of
the keystream code). Replacing the key by the block's first words, and zeroing words once
handed out, means a later look at the process memory does not reveal earlier output; the
Gaussian sampler, which converts words where they lie in the block and works in reused
buffers (for speed: no temporaries), zeroes those words and buffers before it returns.

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

from edge_sdk.hazmat import prg

__all__ = ["Rng", "RoundRng", "SecureRng", "secure_round_rng", "seeded_round_rng"]

_KEY_WORDS = 4  # 32-byte ChaCha20 key
_BLOCK_WORDS = 1 << 15  # 256 KiB of output per rekey
_CHUNK = 8192  # Gaussians per pass of the four-sum (32768 polar draws; measured best)
_PAIRS = 2 * _CHUNK  # polar slots per pass (work buffers ~1.2 MiB, reused)
_SLOT_PASS_MIN = 1024  # fewer slots: per-call overhead dominates, skip the in-place pass
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


def _refill_pairs(open_slots: int) -> int:
    """Pairs to draw for ``open_slots`` open polar slots: 4/pi per slot (the acceptance is
    pi/4) plus about 6 standard deviations, so one pass almost always fills them all."""
    return min(_PAIRS, int(1.2733 * open_slots + 3 * math.sqrt(open_slots)) + 8)


def _shaped(a: np.ndarray, shape: tuple[int, ...] | None) -> Any:
    return a[0].item() if shape is None else a.reshape(shape)


class SecureRng:
    """A ChaCha20 fast-key-erasure generator keyed from ``random_bytes`` (module docstring).

    Args:
        random_bytes: the key source, called once for 32 bytes (``os.urandom``; tests may
            pass a deterministic source to make a run reproducible).
    """

    __slots__ = ("_key", "_buf", "_pos", "_work")

    def __init__(self, *, random_bytes: Callable[[int], bytes] = os.urandom) -> None:
        key = random_bytes(32)
        if not isinstance(key, bytes) or len(key) != 32:
            raise ValueError("random_bytes(32) must return 32 bytes")
        self._key = key
        self._buf = np.empty(_KEY_WORDS + _BLOCK_WORDS, dtype=np.uint64)
        self._pos = len(self._buf)
        self._work: tuple[np.ndarray, ...] | None = None

    # ------------------------------------------------------------------ words

    def _rekeyed(self, out: np.ndarray) -> None:
        prg.keystream_into(self._key, out)
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
        threshold = np.uint64(prg.rejection_threshold(n))
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

    def _signed53_into(self, f: np.ndarray) -> None:
        """Fill ``f`` (float64, 1-D, contiguous) with uniforms on the 53-bit grid of [-1, 1).

        Each value is ``((w >> 11) - 2^52) * 2^-52`` for a fresh word w: an integer of
        magnitude at most 2^52 (exact in float64) times a power of two, so exact. The words
        are converted where they lie in the block (no copy) and zeroed at once (fast key
        erasure: once used they are not kept in memory).
        """
        done, k = 0, f.size
        while done < k:
            if self._pos == len(self._buf):
                self._rekeyed(self._buf)
                self._pos = _KEY_WORDS
            take = min(k - done, len(self._buf) - self._pos)
            w = self._buf[self._pos:self._pos + take]
            w >>= np.uint64(11)
            signed = w.view(np.int64)
            signed -= 1 << 52
            dst = f[done:done + take]
            np.copyto(dst, signed, casting="unsafe")  # |signed| <= 2^52: exact
            dst *= 2.0**-52
            w.fill(0)
            self._pos += take
            done += take

    def _scratch(self) -> tuple[np.ndarray, ...]:
        """The Gaussian path's work buffers, made on first use and then reused: fresh large
        temporaries cost allocation and page faults; reused ones stay in cache."""
        if self._work is None:  # zeros (calloc'd pages): no stale heap contents either
            self._work = (np.zeros(_PAIRS), np.zeros(_PAIRS), np.zeros(_PAIRS),
                          np.zeros(_PAIRS, dtype=bool), np.zeros(_PAIRS, dtype=bool),
                          np.zeros(2 * _PAIRS), np.zeros(4 * _CHUNK))
        return self._work

    def _polar_pass(self, buf: np.ndarray) -> np.ndarray:
        """Fresh 53-bit uniforms on [-1, 1) into ``buf`` (length 2k: k pairs, the u of all
        pairs then their v), each pair turned in place into (u f, v f) with
        f = sqrt(-2 ln(s) / s), s = u^2 + v^2. Returns the mask of the pairs Marsaglia's
        polar method accepts, 0 < s < 1; the others hold garbage (inf or nan)."""
        s, t, fac, acc, pos, _, _ = self._scratch()
        k = buf.size // 2
        self._signed53_into(buf)
        u, v, sk, tk, fk, ak, pk = buf[:k], buf[k:], s[:k], t[:k], fac[:k], acc[:k], pos[:k]
        np.multiply(u, u, out=sk)
        np.multiply(v, v, out=tk)
        sk += tk
        np.less(sk, 1.0, out=ak)
        np.greater(sk, 0.0, out=pk)  # s == 0 (probability 2^-106 a pair): rejected too
        ak &= pk
        with np.errstate(divide="ignore", invalid="ignore"):  # rejected pairs: inf or nan
            np.log(sk, out=fk)
            fk *= -2.0
            fk /= sk
            np.sqrt(fk, out=fk)
            u *= fk
            v *= fk
        return ak

    def _polar_into(self, dst: np.ndarray) -> None:
        """Fill ``dst`` (float64, contiguous, even length 2p, p <= _PAIRS) with N(0, 1)
        draws by Marsaglia's polar method.

        Slot i holds the pair (dst[i], dst[p + i]). The first pass draws a pair for every
        slot in place (no compaction, the costly step); a slot whose pair is rejected
        (about 21%) is open. Below ``_SLOT_PASS_MIN`` slots there is no such pass: all are
        open. Later passes draw :func:`_refill_pairs` pairs and give the
        open slots, in order, the accepted pairs in stream order, until none is open.
        Every slot so holds its first accepted pair, a polar draw, and the slots are
        independent (which slots are open does not depend on the values kept).
        """
        s, t, fac, _, _, sub, _ = self._scratch()
        p = dst.size // 2
        if p >= _SLOT_PASS_MIN:
            open_ = np.flatnonzero(~self._polar_pass(dst))
        else:  # few slots: one oversampled pass below (usually) fills them all, one pass
            open_ = np.arange(p)  # fewer than the slot pass and its refill
        top = p if p >= _SLOT_PASS_MIN else 0  # the most pairs a pass used
        while open_.size:
            m = _refill_pairs(open_.size)
            top = max(top, m)
            buf = sub[:2 * m]
            kept = np.flatnonzero(self._polar_pass(buf))[:open_.size]
            j = kept.size
            dst[open_[:j]] = buf[kept]
            dst[p + open_[:j]] = buf[m + kept]
            open_ = open_[j:]
            buf.fill(0.0)
        # nothing that would let a later look at memory recompute these draws stays there
        for b in (s[:top], t[:top], fac[:top]):
            b.fill(0.0)

    def standard_normal(self, size: Any = None) -> Any:
        """N(0, 1) values, each the sum of four polar draws over 2 (module docstring)."""
        n, shape = _count(size)
        return _shaped(self._hardened(n, 0.5), shape)

    def _hardened(self, n: int, factor: float) -> np.ndarray:
        """``n`` values ``(g_1 + g_2 + g_3 + g_4) * factor``, the g_i independent polar
        draws; factor = scale / 2 gives N(0, scale^2)."""
        out = np.empty(n, dtype=np.float64)
        work = self._scratch()[-1]
        for i in range(0, n, _CHUNK):  # one chunk's draws fit the reused buffers
            c = min(_CHUNK, n - i)
            g = work[:4 * c]
            self._polar_into(g)
            o = out[i:i + c]
            np.add(g[:c], g[c:2 * c], out=o)
            o += g[2 * c:3 * c]
            o += g[3 * c:]
            o *= factor
        work[:4 * min(n, _CHUNK)] = 0.0  # the draws are not kept once summed
        return out

    def normal(self, loc: float = 0.0, scale: float = 1.0, size: Any = None) -> Any:
        """N(loc, scale^2) values (:meth:`standard_normal` scaled)."""
        if not scale >= 0:
            raise ValueError(f"scale must be >= 0, got {scale!r}")
        n, shape = _count(size)
        z = self._hardened(n, 0.5 * scale)  # (sum * 0.5) * scale: 0.5 is exact either way
        if loc != 0:
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
