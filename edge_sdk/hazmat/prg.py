"""Keyed ChaCha20 streams: the one place fedge turns a secret into pseudorandom numbers.

Every shared-seed draw of the protocol (SecAgg+ masks and neighbour graph, the rand-k
coordinate set, the DDG rotation signs) and the device's CSPRNG read this stream::

    key    = derive_key(ikm, info=LABEL, salt=None)   HKDF-SHA256 (RFC 5869), L = 32 bytes;
                                                      salt None means 32 zero bytes
    stream = ChaCha20 (RFC 8439) keystream under key, block counter 0, 96-bit nonce 0
             (cryptography's 16-byte nonce = 16 zero bytes); key 0^32 gives RFC 8439
             Appendix A.1 test vector #1
    words  = the stream cut into consecutive little-endian unsigned integers
             (uint64 for WordStream; the ring's width for the mask PRG, :func:`expand`;
             any unsigned dtype for keystream_into)

The mask PRG (version ``fedge/secagg/v2``, protocol 3) is :func:`expand`: n words of the
ring's :attr:`~edge_sdk.hazmat.ring.Ring.dtype` (8, 16, 32 or 64 bits, the narrowest that
holds b bits), a mask being ``words & (2^b - 1)``: exactly uniform, since 2^b divides the
word's range, and no more keystream than the ring needs (4 bytes per coordinate at b = 32).

Integers below n (1 <= n <= 2^64) come from the uint64 words by rejection: a word w below
``rejection_threshold(n) = 2^64 mod n`` is dropped and the next one read, so ``w mod n`` of an
accepted word is exactly uniform on [0, n) (:func:`below`). :func:`fisher_yates` makes the
first k draws of a Fisher-Yates shuffle of range(n) from such integers (Knuth's Algorithm P,
position i swapped with i + below(n - i)), so a k-subset, or with k = n a permutation, is
exactly uniform given uniform words.

The output of every function here is pinned bit for bit by the golden vectors of the recipes
(tests/golden: secagg masks and graph, rand-k coordinate sets, DDG rotation signs, the
CSPRNG's block layout); a change of any of it is a new wire version. ChaCha20 rather than
AES-CTR because the fleet's ARM cores (Raspberry Pi 3/4) lack AES instructions.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from edge_sdk._validate import check_bytes as _check_bytes
from edge_sdk._validate import check_int as _check_int
from edge_sdk.hazmat.ring import Ring

__all__ = [
    "KEY_BYTES",
    "Keystream",
    "WordStream",
    "below",
    "derive_key",
    "expand",
    "fisher_yates",
    "keystream_bytes",
    "keystream_into",
    "rejection_threshold",
]

KEY_BYTES = 32
"""Length of every stream key and derived key in bytes (a full 256-bit ChaCha20 key)."""

_TWO64 = 1 << 64
_MAX_LENGTH = 1 << 31
_NONCE = bytes(16)  # 32-bit block counter 0 + 96-bit nonce 0 (one key, one stream)


def _check_key(key: object) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {got}")
    return key


def derive_key(ikm: bytes, *, info: bytes, salt: bytes | None = None) -> bytes:
    """A 32-byte key from input keying material: HKDF-SHA256 (RFC 5869) with L = 32.

    Args:
        ikm: the secret (a shared seed, an X25519 shared secret, a pair seed).
        info: the label that separates uses; a new label gives an independent key.
        salt: optional salt (a round's config digest); None means 32 zero bytes (RFC 5869).

    Returns:
        32 bytes.

    Raises:
        ValueError: ikm, info or salt not bytes.
    """
    for name, value in (("ikm", ikm), ("info", info)):
        if not isinstance(value, bytes):
            raise ValueError(f"{name} must be bytes, got {type(value).__name__}")
    if salt is not None and not isinstance(salt, bytes):
        raise ValueError(f"salt must be bytes or None, got {type(salt).__name__}")
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=info).derive(ikm)


@functools.lru_cache(maxsize=4)
def _zeros(nbytes: int) -> bytes:
    # the keystream is ChaCha20 applied to zeros; reusing the zero buffer saves an allocation
    # per call in the masking loop and the CSPRNG's rekeying (both ask the same sizes)
    return bytes(nbytes)


def _big_endian(dtype: np.dtype) -> bool:
    order = dtype.byteorder
    return order == ">" or (order == "=" and sys.byteorder == "big")


def _check_out(out: object) -> np.ndarray:
    if not (
        isinstance(out, np.ndarray)
        and out.dtype.kind == "u"
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        what = f"dtype {out.dtype}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(
            f"out must be a writable C-contiguous unsigned-integer array, got {what}"
        )
    return out


class Keystream:
    """One key's ChaCha20 keystream (module docstring), read in order across calls.

    ``into(a)`` then ``into(b)`` fills a and b with consecutive stretches of the stream, so a
    long stream can be consumed in chunks.

    ``xor_into(data, buf)`` is the cipher's own ``update_into``: it writes ``data`` XOR the
    next ``len(data)`` bytes of the stream into the writable buffer ``buf`` (at least as long
    as data) and returns that length; with data all zeros it writes the keystream's bytes.
    It checks nothing beyond the lengths and costs no Python frame, for loops that call it
    thousands of times per vector (the masking loop keeps one per seed, fills cache-sized
    chunks and on a big-endian host swaps the words itself).

    Args:
        key: the 32-byte key.

    Raises:
        ValueError: key not 32 bytes.
    """

    __slots__ = ("_enc", "xor_into")

    def __init__(self, key: bytes) -> None:
        self._enc = Cipher(algorithms.ChaCha20(_check_key(key), _NONCE), mode=None).encryptor()
        self.xor_into: Callable[[bytes | memoryview, memoryview | np.ndarray], int] = (
            self._enc.update_into
        )

    def into(self, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` with the next ``out.nbytes`` bytes of the stream, each element read as
        a little-endian unsigned integer; returns ``out``.

        Raises:
            ValueError: out not a writable C-contiguous unsigned-integer array.
        """
        out = _check_out(out)
        if out.nbytes:
            self._enc.update_into(_zeros(out.nbytes), out.view(np.uint8))
            if out.dtype.itemsize > 1 and _big_endian(out.dtype):
                out.byteswap(inplace=True)  # the words are little-endian by definition
        return out

    def read(self, n: int) -> bytes:
        """The next ``n`` bytes of the stream (n >= 0)."""
        return self._enc.update(bytes(_check_int("n", n, 0)))


def keystream_into(key: bytes, out: np.ndarray) -> np.ndarray:
    """Fill ``out`` with the start of key's keystream, as little-endian unsigned integers.

    With an ``out`` of a ring's dtype these are the mask PRG's words (:func:`expand`); with
    uint8, the first ``out.size`` bytes. No allocation beyond a cached zero buffer.

    Returns:
        ``out``.

    Raises:
        ValueError: key not 32 bytes; out not a writable C-contiguous unsigned array.
    """
    return Keystream(key).into(out)


def expand(seed: bytes, n: int, ring: Ring, *, out: np.ndarray | None = None) -> np.ndarray:
    """The mask PRG: the first ``n`` words of seed's keystream at the ring's width.

    Words are little-endian ``ring.dtype`` integers (module docstring); a mask is
    ``words & (2^b - 1)``. The same words as ``keystream_into(seed, out)`` with such an out.

    Args:
        seed: the 32-byte PRG key (a derived pairwise seed or a self-mask seed).
        n: number of words, 0 <= n <= 2^31.
        ring: the ring whose :attr:`~edge_sdk.hazmat.ring.Ring.dtype` sets the width.
        out: optional C-contiguous, writable array of ``ring.dtype`` and length n to fill
            (no allocation: a masking loop reuses one buffer).

    Returns:
        A writable ``ring.dtype`` array of length n (``out`` when given).

    Raises:
        ValueError: seed not 32 bytes, n out of range, ring not a Ring, bad ``out``.
    """
    key = _check_bytes("seed", seed, KEY_BYTES)
    count = _check_int("n", n, 0, _MAX_LENGTH)
    if not isinstance(ring, Ring):
        raise ValueError(f"ring must be a Ring, got {type(ring).__name__}")
    if out is None:
        out = np.empty(count, dtype=ring.dtype)
    elif not (
        isinstance(out, np.ndarray)
        and out.dtype == ring.dtype
        and out.shape == (count,)
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        raise ValueError(
            f"out must be a writable contiguous {ring.dtype} array of shape ({count},)"
        )
    if count:
        Keystream(key).into(out)
    return out


def keystream_bytes(key: bytes, n: int) -> bytes:
    """The first ``n`` bytes of key's keystream."""
    return Keystream(key).read(n)


class WordStream:
    """Key's keystream as consecutive little-endian uint64 words; ``stream()`` is the next.

    Args:
        key: the 32-byte key.
        chunk: words fetched per refill (only speed depends on it, never the words).
    """

    __slots__ = ("_ks", "_buf", "_words", "_pos")

    def __init__(self, key: bytes, *, chunk: int = 64) -> None:
        self._ks = Keystream(key)
        self._buf = np.empty(_check_int("chunk", chunk, 1), dtype=np.uint64)
        self._words: list[int] = []
        self._pos = 0

    def __call__(self) -> int:
        if self._pos == len(self._words):
            self._words = self._ks.into(self._buf).tolist()
            self._pos = 0
        w = self._words[self._pos]
        self._pos += 1
        return w


def rejection_threshold(n: int) -> int:
    """``2^64 mod n``: uint64 words below it are rejected, so ``w mod n`` is exactly uniform.

    Raises:
        ValueError: n not an integer in [1, 2^64].
    """
    return _TWO64 % _check_int("n", n, 1, _TWO64)


def below(next_word: Callable[[], int], n: int) -> int:
    """An integer exactly uniform on [0, n) from uniform uint64 words (rejection sampling).

    Args:
        next_word: returns the next uniform integer in [0, 2^64) (a :class:`WordStream`).
        n: the bound, 1 <= n <= 2^64.

    Raises:
        ValueError: n out of range.
    """
    threshold = rejection_threshold(n)
    w = next_word()
    while w < threshold:
        w = next_word()
    return w % n


def fisher_yates(next_word: Callable[[], int], n: int, k: int) -> list[int]:
    """The first k draws of a Fisher-Yates shuffle of range(n), driven by uint64 words.

    Step i (0 <= i < k) swaps position i with ``i + below(n - i)`` and yields the value now
    at position i; one accepted word per step (plus the rejected ones), in order. The k
    values are a uniform k-subset in uniform order; k = n gives a uniform permutation. The
    positions touched are kept in a dict, so memory is O(k), not O(n).

    Args:
        next_word: returns the next uniform integer in [0, 2^64).
        n: size of the range, >= 0.
        k: number of draws, 0 <= k <= n.

    Returns:
        k distinct integers in [0, n).

    Raises:
        ValueError: n or k out of range.
    """
    n = _check_int("n", n, 0)
    k = _check_int("k", k, 0, n)
    displaced: dict[int, int] = {}
    chosen: list[int] = []
    for i in range(k):
        m = n - i
        threshold = _TWO64 % m  # inline below(): this loop runs once per kept coordinate
        w = next_word()
        while w < threshold:
            w = next_word()
        j = i + w % m
        chosen.append(displaced.get(j, j))
        displaced[j] = displaced.get(i, i)
    return chosen
