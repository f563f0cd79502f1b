"""Masks of secure aggregation: the mask PRG, the seed derivations, the sign convention.

Hazmat (see :mod:`edge_sdk.hazmat`): these functions add and remove masks and derive the
seeds; they do not agree keys, check rounds or keep seeds secret. The recipes are
``edge_sdk.secagg`` (device) and ``aggregator.secagg_server``. Everything here is a wire
format, pinned by ``tests/golden/secagg_vectors.json``.

Mask PRG (version ``fedge/secagg/v2``, protocol 3), ``prg.expand(seed, n, ring)``::

    w     = the ring's width: 8, 16, 32 or 64 bits, the narrowest that holds b bits
            (``Ring.dtype``; 32 at b = 32)
    words = ChaCha20 (RFC 8439) keystream under key = seed (32 bytes), block counter 0,
            96-bit nonce 0 (cryptography's 16-byte nonce = 16 zero bytes),
            cut into consecutive w-bit little-endian unsigned integers w_0, w_1, ...
    mask  = (w_0 .. w_{n-1}) & (2^b - 1)       (ring arithmetic in the w-bit dtype)

Since 2^b divides 2^w, each mask is exactly uniform, and a w-bit sum wraps to the right
residue. The seed 0^32 gives RFC 8439 Appendix A.1 test vector #1. ChaCha20 rather than
AES-CTR because the fleet's ARM cores (Raspberry Pi 3/4) lack AES instructions. The stream
and the HKDF are those of :mod:`edge_sdk.hazmat.prg`.

Seed derivations (HKDF-SHA256, RFC 5869, L = 32; ``digest`` is the round's
``RoundConfig.digest()``; ``lp(s)`` is :func:`length_prefixed`: the UTF-8 of s prefixed by
its 2-byte big-endian length)::

    pairwise mask seed s_uv = HKDF(ikm=X25519(mask_u, mask_v), salt=digest,
                                   info=b"fedge/secagg/v1/pairwise-mask")
    share-encryption key    = HKDF(ikm=X25519(enc_u, enc_v), salt=digest,
                                   info=b"fedge/secagg/v1/share-key")
    self-mask seed b_u      = 32 fresh random bytes (the PRG key itself)
    amortized pair seed     = HKDF(ikm=X25519(agree_u, agree_v), salt=None,
                                   info=b"fedge/secagg/v1/amortized-pair" + lp(lo) + lp(hi))
    amortized round seed    = HKDF(ikm=pair seed, salt=None,
                                   info=b"fedge/secagg/v1/amortized-round" + u64be(round_id))

Mask sign convention (:func:`mask_sign`): for a pair u != v, the device whose id sorts
lower (Python ``str`` order = Unicode code point order = UTF-8 byte order) **adds**
PRG(s_uv), the higher one **subtracts** it, so the pair cancels in the sum. This is the
zCDP paper's eq. (7) ``r_ij - r_ji`` with one symmetric seed per pair: ``r_ij = G(seed, t)``
when i < j and 0 otherwise. The self mask is always added.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable

import numpy as np

from edge_sdk._validate import check_bytes as _check_bytes
from edge_sdk._validate import check_device_id as _check_id
from edge_sdk._validate import check_int as _check_int
from edge_sdk.hazmat import prg
from edge_sdk.hazmat.ring import Ring

__all__ = [
    "AMORTIZED_PAIR_INFO",
    "AMORTIZED_ROUND_INFO",
    "PAIRWISE_INFO",
    "SEED_BYTES",
    "SHARE_KEY_INFO",
    "amortized_pair_seed",
    "amortized_round_seed",
    "derive_pairwise_seed",
    "derive_share_key",
    "length_prefixed",
    "mask",
    "mask_sign",
    "unmask",
]

SEED_BYTES = 32
"""Length of every PRG seed and derived key (a full 256-bit ChaCha20 key)."""

PAIRWISE_INFO = b"fedge/secagg/v1/pairwise-mask"
SHARE_KEY_INFO = b"fedge/secagg/v1/share-key"
AMORTIZED_PAIR_INFO = b"fedge/secagg/v1/amortized-pair"
AMORTIZED_ROUND_INFO = b"fedge/secagg/v1/amortized-round"

_KEY_BYTES = 32
_MAX_LENGTH = 1 << 31
_U64_MAX = (1 << 64) - 1


def length_prefixed(s: str) -> bytes:
    """``lp(s)``: the UTF-8 bytes of ``s`` after their 2-byte big-endian length (HKDF info
    and AEAD associated data of the protocol)."""
    b = s.encode("utf-8")
    return len(b).to_bytes(2, "big") + b


def derive_pairwise_seed(shared_secret: bytes, *, context: bytes) -> bytes:
    """Pairwise mask seed s_uv from an X25519 shared secret (Bonawitz et al. Fig. 4, round 2).

    ``HKDF-SHA256(ikm=shared_secret, salt=context, info=PAIRWISE_INFO, L=32)``; context is
    the round's :meth:`RoundConfig.digest`, so seeds never repeat across rounds.
    """
    ikm = _check_bytes("shared_secret", shared_secret, _KEY_BYTES)
    return prg.derive_key(ikm, salt=_check_bytes("context", context, 32), info=PAIRWISE_INFO)


def derive_share_key(shared_secret: bytes, *, context: bytes) -> bytes:
    """ChaCha20-Poly1305 key for the shares exchanged by one pair in one round.

    ``HKDF-SHA256(ikm=shared_secret, salt=context, info=SHARE_KEY_INFO, L=32)``.
    """
    ikm = _check_bytes("shared_secret", shared_secret, _KEY_BYTES)
    return prg.derive_key(ikm, salt=_check_bytes("context", context, 32), info=SHARE_KEY_INFO)


def amortized_pair_seed(shared_secret: bytes, a: str, b: str) -> bytes:
    """Long-term pairwise seed of the amortized variant (zCDP paper, Fig. 2 initialization).

    ``HKDF-SHA256(ikm=X25519(agree_a, agree_b), salt=None,
    info=AMORTIZED_PAIR_INFO + lp(lo) + lp(hi))`` with (lo, hi) the two ids sorted.
    """
    ikm = _check_bytes("shared_secret", shared_secret, _KEY_BYTES)
    lo, hi = sorted((_check_id("a", a), _check_id("b", b)))
    if lo == hi:
        raise ValueError(f"a pair needs two distinct devices, got {a!r} twice")
    return prg.derive_key(ikm, info=AMORTIZED_PAIR_INFO + length_prefixed(lo) + length_prefixed(hi))


def amortized_round_seed(pair_seed: bytes, round_id: int) -> bytes:
    """The PRF ``G(seed_ij, t)`` of the zCDP paper, eq. (7): this round's pairwise mask seed.

    ``HKDF-SHA256(ikm=pair_seed, salt=None, info=AMORTIZED_ROUND_INFO + u64be(round_id))``.
    Revealing it for one round reveals nothing about the long-term seed or other rounds.
    """
    seed = _check_bytes("pair_seed", pair_seed, SEED_BYTES)
    r = _check_int("round_id", round_id, 0, _U64_MAX)
    return prg.derive_key(seed, info=AMORTIZED_ROUND_INFO + r.to_bytes(8, "big"))


def mask_sign(owner: str, peer: str) -> int:
    """The sign with which ``owner`` applies the pairwise mask shared with ``peer``.

    +1 (add) if ``owner < peer`` in ``str`` order (code points = UTF-8 bytes), else -1
    (subtract); so the two masks of a pair cancel in the sum.

    Raises:
        ValueError: owner == peer.
    """
    if owner == peer:
        raise ValueError(f"a pairwise mask needs two distinct devices, got {owner!r} twice")
    return 1 if owner < peer else -1


_CHUNK_BYTES = 1 << 17
"""Bytes of the vector masked per pass over the streams (128 KiB: 2^15 words at 32 bits).
The chunk of the result, one chunk of keystream and the zeros ChaCha20 reads fit a 512 KiB
L2 together (64 KiB measured no faster on the benchmark machine, 192-256 KiB slower); the
chunk only sets speed, never the words."""

_BIG_ENDIAN = sys.byteorder == "big"

_Fill = Callable[[memoryview, np.ndarray], object]


def _streams(
    terms: Iterable[tuple[int, bytes]], direction: int, dtype: np.dtype
) -> tuple[list[_Fill], list[_Fill]]:
    """(streams added, streams subtracted) for ``direction * sum(sign * PRG(seed))``: for
    each seed, ``fill(zeros, raw)`` writes the stream's next ``raw.size`` bytes into the
    uint8 view ``raw`` of an array of ``dtype`` (:attr:`prg.Keystream.xor_into` of zeros;
    on a big-endian host the words are then swapped, the words being little-endian by
    definition). Checks every term before any stream is read."""
    adds: list[_Fill] = []
    subs: list[_Fill] = []
    for sign, seed in terms:
        if sign not in (1, -1) or isinstance(sign, bool):
            raise ValueError(f"a mask term's sign must be +1 or -1, got {sign!r}")
        fill: _Fill = prg.Keystream(_check_bytes("seed", seed, SEED_BYTES)).xor_into
        if _BIG_ENDIAN:
            fill = functools.partial(_fill_swapped, fill, dtype)
        (adds if sign * direction > 0 else subs).append(fill)
    return adds, subs


def _fill_swapped(fill: _Fill, dtype: np.dtype, zeros: memoryview, raw: np.ndarray) -> None:
    fill(zeros, raw)
    raw.view(dtype).byteswap(inplace=True)


def _in_ring(a: np.ndarray, bits: int) -> bool:
    if not a.size:
        return True
    if a.dtype.kind == "u":  # the OR of all entries has a bit >= b set iff one has
        return not int(np.bitwise_or.reduce(a)) >> bits
    return int(a.min()) >= 0 and not int(a.max()) >> bits


def _combine(
    a: np.ndarray, ring: Ring, terms: Iterable[tuple[int, bytes]], direction: int, *,
    check: bool,
) -> np.ndarray:
    """``a + direction * sum(sign * PRG(seed)) mod 2^bits`` as a new array of ``ring.dtype``.

    ``a`` is a 1-D integer array, read mod 2^(ring's width) (a wrapped unsigned sum as it
    is); with ``check`` every entry must be a residue in [0, 2^bits) (checked chunk by
    chunk, before the chunk is used; the error names the first entry out of range). The
    words are those of ``prg.expand``, each term's ChaCha20 stream read on across chunks.

    Chunk by chunk (:data:`_CHUNK_BYTES`), streams inner, so the chunk of the result and
    of the keystream stay in cache: when ``a`` is of the ring's dtype, the first term's
    keystream is written straight into the result's chunk and ``a`` added to it (or the
    chunk subtracted from ``a``); every further term's keystream goes to one reused buffer
    and is added or subtracted in place, in the ring's width (no widening, no
    temporaries); the reduction mod 2^bits, where the width exceeds b bits, is done on the
    chunk while it is in cache. Two calls per term and chunk, nothing else: the keystream's
    ``update_into`` and the in-place ufunc.
    """
    dtype = ring.dtype
    adds, subs = _streams(terms, direction, dtype)
    n = a.size
    acc = np.empty(n, dtype=dtype)
    if not n:
        return acc
    bits = ring.bits
    top = None if 8 * dtype.itemsize == bits else dtype.type(ring.modulus - 1)
    first = None
    first_op = np.add if adds else np.subtract
    if a.dtype == dtype and (adds or subs):
        first = adds.pop(0) if adds else subs.pop(0)
    step = max(1, _CHUNK_BYTES // dtype.itemsize)
    words = np.empty(min(step, n), dtype=dtype)
    w, raw = words, words.view(np.uint8)
    zeros = memoryview(bytes(raw.size))
    add, subtract, bitwise_and = np.add, np.subtract, np.bitwise_and
    for lo in range(0, n, step):
        part, xs = acc[lo : lo + step], a[lo : lo + step]
        if part.size < w.size:  # the last, partial chunk
            w = words[: part.size]
            raw = w.view(np.uint8)
            zeros = zeros[: raw.size]
        if check and not _in_ring(xs, bits):
            ring.check_residues(a, name="x")  # raises, naming the first entry out of range
        if first is None:
            np.copyto(part, xs, casting="unsafe")  # wraps mod 2^width, a multiple of 2^bits
        else:
            first(zeros, part.view(np.uint8))
            if first_op is add:
                add(part, xs, part)
            else:
                subtract(xs, part, part)
        for fill in adds:
            fill(zeros, raw)
            add(part, w, part)
        for fill in subs:
            fill(zeros, raw)
            subtract(part, w, part)
        if top is not None:
            bitwise_and(part, top, part)
    return acc


def mask(x: np.ndarray, *, bits: int, terms: Iterable[tuple[int, bytes]]) -> np.ndarray:
    """Add masks to residues: ``x + sum(sign * PRG(seed)) mod 2^bits``.

    Bonawitz et al. Fig. 4 round 2: ``y_u = x_u + PRG(b_u) + sum_v sign(u, v) PRG(s_uv)``;
    the self mask is the term ``(+1, b_u)``, a pairwise one ``(mask_sign(u, v), s_uv)``.
    PRG is ``prg.expand`` at the ring's width (module docstring).

    Args:
        x: 1-D integer array of residues in [0, 2^bits).
        bits: ring size exponent b, 1 <= b <= 64.
        terms: (sign +-1, 32-byte seed) pairs.

    Returns:
        New array of residues in [0, 2^bits), of the ring's dtype (uint32 at b = 32).
    """
    ring = Ring(bits=_check_int("bits", bits, 1, 64))
    a = np.asarray(x)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        ring.check_residues(a, name="x")  # raises: not a 1-D integer array
    # an unsigned dtype no wider than b bits holds residues only
    check = a.dtype.kind == "i" or 8 * a.dtype.itemsize > ring.bits
    return _combine(a, ring, terms, +1, check=check)


def unmask(y: np.ndarray, *, bits: int, terms: Iterable[tuple[int, bytes]]) -> np.ndarray:
    """Inverse of :func:`mask`: ``y - sum(sign * PRG(seed)) mod 2^bits``.

    The aggregator calls it on the sum of the masked inputs with the masks that do not
    cancel: every survivor's self mask ``(+1, b_u)`` and, for a survivor u and a dropped
    neighbour v, ``(mask_sign(u, v), s_uv)``.

    Args:
        y: 1-D integer array in [0, 2^64), e.g. a running sum in the ring's dtype or in
            uint64 (2^bits divides both ranges, so it need not be reduced first).
        bits: ring size exponent b, 1 <= b <= 64.
        terms: (sign +-1, 32-byte seed) pairs.

    Returns:
        New array of residues in [0, 2^bits), of the ring's dtype.
    """
    ring = Ring(bits=_check_int("bits", bits, 1, 64))
    a = np.asarray(y)
    if not (a.ndim == 1 and a.dtype.kind == "u"):  # a wrapped unsigned sum needs no check
        a = Ring(bits=64).check_residues(a, name="y")
    return _combine(a, ring, terms, -1, check=False)  # read mod 2^width, a multiple of 2^bits
