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

from collections.abc import Iterable

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


_CHUNK_WORDS = 1 << 15


def _apply_terms(acc: np.ndarray, terms: Iterable[tuple[int, bytes]], direction: int) -> None:
    """acc += direction * sum(sign * PRG(seed)), in place, mod 2^(acc's width).

    ``acc`` is a ring's :attr:`~edge_sdk.hazmat.ring.Ring.dtype` array and the words are of
    the same width, so nothing is widened. Streams every term's keystream in chunks of 2^15
    words (128 KiB at 32 bits), the terms inner, so the chunk of acc and the keystream stay
    in cache; the words are exactly those of ``prg.expand`` (each term keeps one ChaCha20
    stream across chunks).
    """
    streams = []
    for sign, seed in terms:
        if sign not in (1, -1) or isinstance(sign, bool):
            raise ValueError(f"a mask term's sign must be +1 or -1, got {sign!r}")
        key = _check_bytes("seed", seed, SEED_BYTES)
        streams.append((sign * direction > 0, prg.Keystream(key)))
    n = acc.size
    if not n or not streams:
        return
    chunk = min(n, _CHUNK_WORDS)
    words = np.empty(chunk, dtype=acc.dtype)
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        part, w = acc[lo : lo + m], words[:m]
        for add, stream in streams:
            stream.into(w)
            if add:
                np.add(part, w, out=part)
            else:
                np.subtract(part, w, out=part)


def _reduce(acc: np.ndarray, ring: Ring) -> np.ndarray:
    if 8 * acc.dtype.itemsize != ring.bits:  # the dtype's own wrap-around already reduces
        acc &= acc.dtype.type(ring.modulus - 1)
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
    acc = ring.check_residues(x, name="x")
    _apply_terms(acc, terms, +1)
    return _reduce(acc, ring)


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
    acc = a.astype(ring.dtype, copy=True)  # wraps mod 2^width, a multiple of 2^bits
    _apply_terms(acc, terms, -1)
    return _reduce(acc, ring)
