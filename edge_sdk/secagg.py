"""Secure aggregation: the shared arithmetic, the wire messages and the device's side.

The aggregator learns the sum of a cohort's vectors in Z_{2^b} and nothing else, also
when devices vanish mid-round. This module is shared bit for bit with the aggregator
(``aggregator.secure_sum`` imports it): the mask PRG, the seed derivations, the mask sign
convention, the Shamir field and share encoding, the neighbour graph, the message schemas
and their signatures are wire formats, pinned by ``tests/golden/secagg_vectors.json``.

Protocols
---------

* **SecAgg with SecAgg+ neighbourhoods** (Bonawitz et al., CCS 2017, Fig. 4 "practical
  secure aggregation", with double masking; Bell et al., CCS 2020, SecAgg+): every device
  masks only toward its neighbours in a random k-regular graph over the cohort
  (:func:`neighbour_graph`, k ~ 2 log2 n), and Shamir-shares its secrets t-of-k among
  those neighbours. Per round, device u draws two X25519 key pairs (``mask`` and ``enc``)
  and a self-mask seed b_u, and sends::

      y_u = x_u + PRG(b_u) + sum_{v in N(u) ∩ U2} sign(u, v) * PRG(s_uv)      (mod 2^b)

  with s_uv = HKDF(X25519(mask_u, mask_v)). Shares of mask_u's secret key and of b_u go
  to each neighbour encrypted with ChaCha20-Poly1305 under HKDF(X25519(enc_u, enc_v)),
  relayed by the aggregator. Recovery: for a device that dropped after sharing, its
  surviving neighbours reveal shares of its mask key (the aggregator recomputes the
  pairwise masks toward survivors); for a survivor, shares of b_u. A device never reveals
  both for the same owner (:class:`UnmaskRefused`), and with ``2t > k`` the aggregator can
  never hold t shares of both, so a late upload stays hidden behind its self mask.

* **Amortized variant** (Hu, Guo, Gong, "zCDP secure aggregation", Sec. IV-B, Fig. 2,
  eqs. (7)-(9)): pairwise seeds are agreed once at enrollment (static X25519 between the
  long-term ``agree`` keys, :func:`amortized_pair_seed`); each round every device masks
  with ``PRF(seed_uv, round)`` (:func:`amortized_round_seed`) toward its neighbours, with
  no key exchange, no self mask and no shares. The paper assumes no dropouts; we add a
  recovery in which survivors reveal the *round* seeds (never the long-term seed) toward
  neighbours the aggregator reports as dropped. Its dropout story is weaker, by design:

  - no threshold: one survivor's answer removes a pairwise mask; an aggregator that
    falsely reports v as dropped to all of v's neighbours unmasks v's upload completely
    (there is no self mask to protect a late or withheld upload). Only an
    honest-but-curious aggregator is tolerated. A device refuses a request that would
    leave fewer than t of its own neighbours masked with it (that would expose its own
    input), which bounds, but does not remove, the exposure;
  - no redundancy: a pairwise round seed is known only to its two endpoints, so a
    survivor that drops during recovery fails the round;
  - round ids must never repeat (a repeated mask leaks ``x - x'``); the device refuses any
    round id not above the last one it masked for (:class:`PairwiseSeeds` holds it; the
    caller persists it with the ledger, before the upload leaves the device);
  - no forward secrecy: a stolen long-term key reveals every round's masks with its peers.

* **Sparse rounds**: with rand-k the whole cohort keeps the same coordinate set omega
  (``compress.coordinate_set``, derived from the round seed, never sent). The round's
  ``length`` is k; devices mask and send only the k kept values (pass the dense vector
  and ``coordinates=omega`` to :meth:`SecAggClient.mask_input`), so masks are expanded
  over omega only, and the aggregator scatters the k sums back
  (``SecAggServer.finalize_dense``).

Trust model
-----------

The aggregator is assumed **semi-honest** (honest-but-curious): it follows the protocol
and may only study what it receives. Bonawitz et al.'s active-adversary defences are not
implemented, above all the consistency-check round (Fig. 4, round 3: survivors sign the
set U3 and check each other's signatures before revealing shares). Without it an
aggregator that tells different devices different survivor sets can collect both the
mask-key share and the self-mask share of one device and unmask that device's input
alone. What a device does check: every message's signature and round, never both shares
of one owner in one request (:class:`UnmaskRefused`), only one request per round, and,
in ``edge_sdk.session``, that the request's ``survivor_count`` is at least the plan's
``min_survivors`` and agrees with the survivors it names (exactly, with the complete
graph). Devices colluding with the aggregator are tolerated up to t - 1 of them (fewer
than t shares of any honest device's secrets); the fleet states the number it assumes
as ``RoundPlan.max_colluders`` (< t), which the accounting of the secure sum uses.

Mask PRG (version ``fedge/secagg/v1``), :func:`prg_expand`::

    words = ChaCha20 (RFC 8439) keystream under key = seed (32 bytes), block counter 0,
            96-bit nonce 0 (cryptography's 16-byte nonce = 16 zero bytes),
            cut into consecutive 8-byte little-endian unsigned integers w_0, w_1, ...
    mask  = (w_0 .. w_{n-1}) & (2^b - 1)       (all ring arithmetic in numpy uint64)

The seed 0^32 gives RFC 8439 Appendix A.1 test vector #1. ChaCha20 rather than AES-CTR
because the fleet's ARM cores (Raspberry Pi 3/4) lack AES instructions. The stream, the
HKDF below and the graph's Fisher-Yates are those of :mod:`edge_sdk.hazmat.prg`.

Seed derivations (HKDF-SHA256, RFC 5869, L = 32; ``digest`` is :meth:`RoundConfig.digest`;
``lp(s)`` is the UTF-8 of s prefixed by its 2-byte big-endian length)::

    pairwise mask seed s_uv = HKDF(ikm=X25519(mask_u, mask_v), salt=digest,
                                   info=b"fedge/secagg/v1/pairwise-mask")
    share-encryption key    = HKDF(ikm=X25519(enc_u, enc_v), salt=digest,
                                   info=b"fedge/secagg/v1/share-key")
    self-mask seed b_u      = 32 fresh random bytes (the PRG key itself)
    amortized pair seed     = HKDF(ikm=X25519(agree_u, agree_v), salt=None,
                                   info=b"fedge/secagg/v1/amortized-pair" + lp(lo) + lp(hi))
    amortized round seed    = HKDF(ikm=pair seed, salt=None,
                                   info=b"fedge/secagg/v1/amortized-round" + u64be(round_id))
    graph key               = HKDF(ikm=nonce, salt=None, info=b"fedge/secagg/v1/graph")

Mask sign convention (:func:`mask_sign`): for a pair u != v, the device whose id sorts
lower (Python ``str`` order = Unicode code point order = UTF-8 byte order) **adds**
PRG(s_uv), the higher one **subtracts** it, so the pair cancels in the sum. This is the
zCDP paper's eq. (7) ``r_ij - r_ji`` with one symmetric seed per pair: ``r_ij = G(seed, t)``
when i < j and 0 otherwise. The self mask is always added.

Shamir (:func:`split_secret`, :func:`combine_shares`): over GF(p), p = 2^521 - 1 (a
Mersenne prime, so a 32-byte key is one field element); a device's share sits at
x = 1 + its index in the sorted cohort; shares travel as 66-byte big-endian integers.
Polynomial coefficients are uniform in GF(p) by rejection sampling.

Neighbour graph (:func:`neighbour_graph`): a Harary graph H_{k,n} (node at position i is
joined to positions i +- 1 .. i +- k/2 mod n, k even) over a uniformly random permutation
of the sorted cohort, the permutation drawn by Fisher-Yates from the graph key's PRG
words with rejection (``hazmat.prg.fisher_yates``, as ``compress.coordinate_set``).
k >= n - 1 gives the complete graph, i.e. the original SecAgg. It is a k-regular,
k-connected graph; the random placement plays the role of the random graph of Bell et al.
(an aggregator that grinds nonces could bias it; we assume an honest-but-curious aggregator
there).

Signatures: every message is signed with the sender's long-term Ed25519 key (the
aggregator's own messages with its key) over ``b"fedge/secagg/v1/sig" + digest +
msgpack(message without "sig")``. Binding the config digest means a message from another
round, or built on a different view of the round, fails verification.

Exceptions (defined in :mod:`edge_sdk.errors`, whose docstring draws the whole tree)::

    EdgeError
     +-- LocalProtocolError     this endpoint's caller did wrong (a call out of order)
     +-- RemoteProtocolError    a peer sent something invalid (malformed, bad signature,
     |    |                     outsider, wrong round, wrong stage); no state changed
     |    +-- ReplayedMessage   an exact copy of an accepted message (harmless under QoS 1)
     |    +-- UnmaskRefused     the aggregator asked this device for what it must not reveal
     +-- RoundFailed            too few devices left to finish; nothing was unmasked

Bad arguments from the local caller stay ``ValueError``.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar, TypeAlias

import msgpack
import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from edge_sdk._validate import check_int as _check_int
from edge_sdk.errors import (
    LocalProtocolError,
    RemoteProtocolError,
    ReplayedMessage,
    RoundFailed,
    UnmaskRefused,
)
from edge_sdk.hazmat import prg
from edge_sdk.hazmat.ring import Ring

__all__ = [
    "AMORTIZED_PAIR_INFO",
    "AMORTIZED_ROUND_INFO",
    "GRAPH_INFO",
    "PAIRWISE_INFO",
    "PROTOCOL_VERSION",
    "SEED_BYTES",
    "SHAMIR_PRIME",
    "SHARE_BYTES",
    "SHARE_KEY_INFO",
    "SIGNATURE_LABEL",
    "AdvertiseKeys",
    "AggregatorIdentity",
    "AmortizedSecAggClient",
    "ClientState",
    "DeviceIdentity",
    "EncryptedShare",
    "Enrollment",
    "ForwardedShares",
    "LocalProtocolError",
    "MaskedInput",
    "Message",
    "NeighbourKeys",
    "PairwiseSeeds",
    "Registry",
    "RemoteProtocolError",
    "ReplayedMessage",
    "RevealRequest",
    "RevealResponse",
    "RoundConfig",
    "RoundFailed",
    "SecAggClient",
    "ShareKeys",
    "UnmaskRefused",
    "UnmaskRequest",
    "UnmaskResponse",
    "amortized_pair_seed",
    "amortized_round_seed",
    "combine_shares",
    "decode_message",
    "default_degree",
    "default_threshold",
    "derive_pairwise_seed",
    "derive_share_key",
    "encode_message",
    "mask",
    "mask_sign",
    "neighbour_graph",
    "prg_expand",
    "share_from_bytes",
    "share_to_bytes",
    "split_secret",
    "unmask",
]

PROTOCOL_VERSION = 2
"""Version carried by every message; a new value is a new wire format (2: the unmask
request states the survivor count)."""

SEED_BYTES = 32
"""Length of every PRG seed and derived key (a full 256-bit ChaCha20 key)."""

PAIRWISE_INFO = b"fedge/secagg/v1/pairwise-mask"
SHARE_KEY_INFO = b"fedge/secagg/v1/share-key"
AMORTIZED_PAIR_INFO = b"fedge/secagg/v1/amortized-pair"
AMORTIZED_ROUND_INFO = b"fedge/secagg/v1/amortized-round"
GRAPH_INFO = b"fedge/secagg/v1/graph"
SIGNATURE_LABEL = b"fedge/secagg/v1/sig"
_SHARE_AD_LABEL = b"fedge/secagg/v1/share"
_CONFIG_LABEL = b"fedge/secagg/v1/config"

SHAMIR_PRIME = 2**521 - 1
"""The Shamir field GF(2^521 - 1): a 32-byte secret is one element."""

SHARE_BYTES = 66
"""Bytes of one encoded share (big-endian, < SHAMIR_PRIME)."""

_KEY_BYTES = 32
_SIG_BYTES = 64
_NONCE_BYTES = 12
_MAX_ID_BYTES = 128
_MAX_COHORT = 1 << 16
_MAX_LENGTH = 1 << 31
_U64_MAX = (1 << 64) - 1

RandomBytes: TypeAlias = Callable[[int], bytes]


# --------------------------------------------------------------------------- checks


def _check_bytes(name: str, value: object, size: int) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise ValueError(f"{name} must be {size} bytes, got {type(value).__name__}")
    b = bytes(value)
    if len(b) != size:
        raise ValueError(f"{name} must be {size} bytes, got {len(b)}")
    return b


def _id_problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f"must be a str, got {type(value).__name__}"
    n = len(value.encode("utf-8", "surrogatepass"))
    if not 1 <= n <= _MAX_ID_BYTES:
        return f"must be 1 to {_MAX_ID_BYTES} UTF-8 bytes, got {n}"
    if any(c in value for c in "\x00/#+") or not value.isprintable():
        return "must be printable with no NUL, '/', '#' or '+' (it names MQTT topics)"
    return None


def _check_id(name: str, value: object) -> str:
    problem = _id_problem(value)
    if problem:
        raise ValueError(f"{name} {value!r} {problem}")
    return value  # type: ignore[return-value]


def _lp(s: str) -> bytes:
    b = s.encode("utf-8")
    return len(b).to_bytes(2, "big") + b


# --------------------------------------------------------------------------- PRG and masks


def prg_expand(seed: bytes, n_words: int, *, out: np.ndarray | None = None) -> np.ndarray:
    """Expand a 32-byte seed into ``n_words`` uniform uint64 words (the mask PRG).

    ChaCha20 keystream (RFC 8439) with key = seed, block counter 0, nonce 0, read as
    little-endian uint64 words (module docstring). Masks are these words reduced mod 2^b
    by ``& (2^b - 1)``; since 2^b divides 2^64, each masked word is exactly uniform.

    Args:
        seed: the 32-byte PRG key (a derived pairwise seed or a self-mask seed).
        n_words: number of words, >= 0.
        out: optional C-contiguous, writable uint64 array of length ``n_words`` to fill
            (no allocation: the masking loop reuses one scratch buffer).

    Returns:
        A writable uint64 array of length ``n_words`` (``out`` when given).

    Raises:
        ValueError: seed not 32 bytes, n_words negative or not an integer, bad ``out``.
    """
    key = _check_bytes("seed", seed, SEED_BYTES)
    n = _check_int("n_words", n_words, 0, _MAX_LENGTH)
    if out is None:
        out = np.empty(n, dtype=np.uint64)
    elif not (
        isinstance(out, np.ndarray)
        and out.dtype == np.uint64
        and out.shape == (n,)
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        raise ValueError(f"out must be a writable contiguous uint64 array of shape ({n},)")
    if n:
        prg.keystream_into(key, out)
    return out


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
    return prg.derive_key(ikm, info=AMORTIZED_PAIR_INFO + _lp(lo) + _lp(hi))


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
    """acc += direction * sum(sign * PRG(seed)), in place, mod 2^64.

    Streams every term's keystream in chunks of 2^15 words (256 KiB), the terms inner, so
    the chunk of acc and the keystream stay in cache; the words are exactly those of
    :func:`prg_expand` (each term keeps one ChaCha20 stream across chunks).
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
    words = np.empty(chunk, dtype=np.uint64)
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        part, w = acc[lo : lo + m], words[:m]
        for add, stream in streams:
            stream.into(w)
            if add:
                np.add(part, w, out=part)
            else:
                np.subtract(part, w, out=part)


def mask(x: np.ndarray, *, bits: int, terms: Iterable[tuple[int, bytes]]) -> np.ndarray:
    """Add masks to residues: ``x + sum(sign * PRG(seed)) mod 2^bits``.

    Bonawitz et al. Fig. 4 round 2: ``y_u = x_u + PRG(b_u) + sum_v sign(u, v) PRG(s_uv)``;
    the self mask is the term ``(+1, b_u)``, a pairwise one ``(mask_sign(u, v), s_uv)``.

    Args:
        x: 1-D integer array of residues in [0, 2^bits).
        bits: ring size exponent b, 1 <= b <= 64.
        terms: (sign +-1, 32-byte seed) pairs.

    Returns:
        New uint64 array of residues in [0, 2^bits).
    """
    b = _check_int("bits", bits, 1, 64)
    acc = Ring(bits=b).check_residues(x, name="x")
    _apply_terms(acc, terms, +1)
    acc &= Ring(bits=b).mask
    return acc


def unmask(y: np.ndarray, *, bits: int, terms: Iterable[tuple[int, bytes]]) -> np.ndarray:
    """Inverse of :func:`mask`: ``y - sum(sign * PRG(seed)) mod 2^bits``.

    The aggregator calls it on the sum of the masked inputs with the masks that do not
    cancel: every survivor's self mask ``(+1, b_u)`` and, for a survivor u and a dropped
    neighbour v, ``(mask_sign(u, v), s_uv)``.

    Args:
        y: 1-D integer array in [0, 2^64), e.g. a uint64 running sum (2^bits divides 2^64,
            so it need not be reduced first).
        bits: ring size exponent b, 1 <= b <= 64.
        terms: (sign +-1, 32-byte seed) pairs.

    Returns:
        New uint64 array of residues in [0, 2^bits).
    """
    b = _check_int("bits", bits, 1, 64)
    acc = Ring(bits=64).check_residues(y, name="y")  # a uint64 sum of residues: reduced below
    _apply_terms(acc, terms, -1)
    acc &= Ring(bits=b).mask
    return acc


# --------------------------------------------------------------------------- Shamir


def _random_below(prime: int, random_bytes: RandomBytes) -> int:
    nbits = prime.bit_length()
    nbytes = (nbits + 7) // 8
    top = (1 << nbits) - 1
    while True:
        r = int.from_bytes(random_bytes(nbytes), "big") & top
        if r < prime:
            return r


def _check_prime_field(prime: int) -> int:
    return _check_int("prime", prime, 3)


def split_secret(
    secret: int,
    *,
    threshold: int,
    xs: Sequence[int],
    random_bytes: RandomBytes = os.urandom,
    prime: int = SHAMIR_PRIME,
) -> dict[int, int]:
    """Shamir t-of-n shares of ``secret`` at the points ``xs``.

    A uniformly random polynomial f of degree t - 1 over GF(prime) with f(0) = secret;
    share x is f(x). Any t shares determine f; any t - 1 are uniform and independent of
    the secret (for every secret there is exactly one such f through them).

    Args:
        secret: in [0, prime).
        threshold: t, 1 <= t <= len(xs).
        xs: distinct evaluation points in [1, prime).
        random_bytes: source of randomness (``os.urandom``; seeded in tests).
        prime: field modulus (the default is the wire format; others for tests).

    Returns:
        {x: f(x)}.
    """
    p = _check_prime_field(prime)
    s = _check_int("secret", secret, 0, p - 1)
    points = [_check_int("x", x, 1, p - 1) for x in xs]
    if len(set(points)) != len(points):
        raise ValueError(f"xs must be distinct, got {sorted(points)}")
    t = _check_int("threshold", threshold, 1, max(1, len(points)))
    coeffs = [s] + [_random_below(p, random_bytes) for _ in range(t - 1)]
    out = {}
    for x in points:
        acc = 0
        for c in reversed(coeffs):
            acc = (acc * x + c) % p
        out[x] = acc
    return out


def _lagrange_at_zero(xs: tuple[int, ...], p: int) -> list[int]:
    coeffs = []
    for i, xi in enumerate(xs):
        num = 1
        den = 1
        for j, xj in enumerate(xs):
            if i != j:
                num = num * xj % p
                den = den * (xj - xi) % p
        coeffs.append(num * pow(den, -1, p) % p)
    return coeffs


def combine_shares(shares: Mapping[int, int], *, threshold: int, prime: int = SHAMIR_PRIME) -> int:
    """The secret f(0) from at least t Shamir shares (Lagrange interpolation at 0).

    Uses the t shares with the smallest x. (Extra shares are not cross-checked: callers
    that can verify the secret, as the aggregator does for mask keys against the
    advertised public key, do so.)

    Args:
        shares: {x: f(x)} with distinct x in [1, prime) and values in [0, prime).
        threshold: t, the polynomial's degree + 1.
        prime: field modulus.

    Returns:
        The secret in [0, prime).

    Raises:
        ValueError: fewer than t shares, or out-of-range points or values.
    """
    p = _check_prime_field(prime)
    t = _check_int("threshold", threshold, 1)
    if len(shares) < t:
        raise ValueError(f"need at least threshold = {t} shares, got {len(shares)}")
    xs = tuple(sorted(shares)[:t])
    for x in xs:
        _check_int("share point x", x, 1, p - 1)
        _check_int(f"share value at x={x}", shares[x], 0, p - 1)
    lam = _lagrange_at_zero(xs, p)
    return sum(c * shares[x] for c, x in zip(lam, xs, strict=True)) % p


def share_to_bytes(value: int) -> bytes:
    """A share value as 66 big-endian bytes (the wire encoding)."""
    v = _check_int("share value", value, 0, SHAMIR_PRIME - 1)
    return v.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(data: bytes) -> int:
    """Inverse of :func:`share_to_bytes`.

    Raises:
        ValueError: not 66 bytes, or a value >= 2^521 - 1.
    """
    raw = _check_bytes("share", data, SHARE_BYTES)
    v = int.from_bytes(raw, "big")
    if v >= SHAMIR_PRIME:
        raise ValueError(f"share value must be < 2^521 - 1, got {v}")
    return v


# --------------------------------------------------------------------------- neighbour graph


def default_degree(n: int) -> int:
    """SecAgg+ neighbourhood size for a cohort of n: ``min(n - 1, 2 * ceil(log2 n))``.

    Bell et al. 2020 need k = O(log n); 2 log2 n keeps each neighbourhood connected to
    the rest with overwhelming probability for the dropout rates we target.
    """
    n = _check_int("cohort size", n, 3)
    return min(n - 1, 2 * math.ceil(math.log2(n)))


def default_threshold(degree: int) -> int:
    """Shamir threshold for k share holders: ``k // 2 + 1``, the least t with 2t > k.

    2t > k is what makes "never both" safe: the aggregator cannot gather t mask-key shares
    and t self-mask shares of one device from disjoint halves of its neighbours.
    """
    k = _check_int("degree", degree, 2)
    return k // 2 + 1


def _permutation(seed: bytes, n: int) -> list[int]:
    """The graph's uniform permutation of range(n): Fisher-Yates on the words of
    ``HKDF(seed, info=GRAPH_INFO)`` (module docstring; :mod:`edge_sdk.hazmat.prg`)."""
    words = prg.WordStream(prg.derive_key(seed, info=GRAPH_INFO), chunk=n + 16)
    return prg.fisher_yates(words, n, n)


@functools.lru_cache(maxsize=16)
def _graph(cohort: tuple[str, ...], degree: int, seed: bytes) -> Mapping[str, tuple[str, ...]]:
    n = len(cohort)
    if degree >= n - 1:
        return MappingProxyType({u: tuple(v for v in cohort if v != u) for u in cohort})
    order = [cohort[i] for i in _permutation(seed, n)]
    half = degree // 2
    adj: dict[str, tuple[str, ...]] = {}
    for i, u in enumerate(order):
        peers = {order[(i + j) % n] for j in range(1, half + 1)}
        peers |= {order[(i - j) % n] for j in range(1, half + 1)}
        adj[u] = tuple(sorted(peers))
    return MappingProxyType(dict(sorted(adj.items())))


def neighbour_graph(
    cohort: Sequence[str], *, degree: int, seed: bytes
) -> Mapping[str, tuple[str, ...]]:
    """The SecAgg+ neighbour graph of a cohort (module docstring): Harary H_{k,n} placed by
    a seeded random permutation, or the complete graph when ``degree >= n - 1``.

    Args:
        cohort: distinct device ids, sorted.
        degree: k, even and >= 2 unless it is n - 1.
        seed: the round's public nonce (>= 16 bytes).

    Returns:
        Read-only {device: sorted tuple of its k neighbours}; symmetric.
    """
    ids = tuple(cohort)
    if list(ids) != sorted(set(ids)):
        raise ValueError("cohort must be sorted and distinct")
    n = len(ids)
    if n < 3:
        raise ValueError(f"a cohort needs at least 3 devices, got {n}")
    k = _check_int("degree", degree, 2, n - 1)
    if k < n - 1 and k % 2:
        raise ValueError(f"degree must be even (Harary graph) or n - 1 = {n - 1}, got {k}")
    if not isinstance(seed, bytes) or len(seed) < 16:
        raise ValueError("seed must be at least 16 bytes")
    return _graph(ids, k, bytes(seed))


# --------------------------------------------------------------------------- identities


def _raw_public(key: Ed25519PrivateKey | X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Enrollment:
    """A device's public record, registered once at enrollment (a trusted PKI).

    Attributes:
        device: the device id.
        sign_key: raw Ed25519 public key (32 bytes) that verifies its messages.
        agree_key: raw long-term X25519 public key (32 bytes), used only by the amortized
            variant to agree pairwise seeds without interaction.
    """

    device: str
    sign_key: bytes
    agree_key: bytes

    def __post_init__(self) -> None:
        _check_id("device", self.device)
        _check_bytes("sign_key", self.sign_key, _KEY_BYTES)
        _check_bytes("agree_key", self.agree_key, _KEY_BYTES)


class DeviceIdentity:
    """A device's long-term private keys (Ed25519 signing, X25519 agreement).

    Not a dataclass: it holds secrets, so it has no field-revealing repr or equality.
    """

    __slots__ = ("_agree", "_device", "_sign")

    def __init__(
        self, device: str, *, sign_key: Ed25519PrivateKey, agree_key: X25519PrivateKey
    ) -> None:
        self._device = _check_id("device", device)
        self._sign = sign_key
        self._agree = agree_key

    @classmethod
    def generate(cls, device: str, *, random_bytes: RandomBytes = os.urandom) -> DeviceIdentity:
        """Fresh keys from ``random_bytes`` (``os.urandom``; a seeded source in tests)."""
        return cls(
            device,
            sign_key=Ed25519PrivateKey.from_private_bytes(random_bytes(32)),
            agree_key=X25519PrivateKey.from_private_bytes(random_bytes(32)),
        )

    @property
    def device(self) -> str:
        return self._device

    def private_bytes(self) -> bytes:
        """The 64 secret bytes: raw Ed25519 private key (seed) || raw X25519 private key.

        For the key file written at enrollment (``tools.enroll``); keep them secret.
        """
        sign = self._sign.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
            serialization.NoEncryption())
        return sign + _raw_private(self._agree)

    @classmethod
    def from_private_bytes(cls, device: str, raw: bytes) -> DeviceIdentity:
        """Inverse of :meth:`private_bytes`."""
        _check_bytes("raw", raw, 2 * _KEY_BYTES)
        return cls(device, sign_key=Ed25519PrivateKey.from_private_bytes(raw[:_KEY_BYTES]),
                   agree_key=X25519PrivateKey.from_private_bytes(raw[_KEY_BYTES:]))

    def enrollment(self) -> Enrollment:
        """The public record to register."""
        return Enrollment(
            device=self._device,
            sign_key=_raw_public(self._sign),
            agree_key=_raw_public(self._agree),
        )

    def sign(self, data: bytes) -> bytes:
        return self._sign.sign(data)

    def agree(self, peer_public: bytes) -> bytes:
        """X25519 with the long-term agreement key (amortized variant only)."""
        return self._agree.exchange(X25519PublicKey.from_public_bytes(peer_public))

    def __repr__(self) -> str:
        return f"DeviceIdentity({self._device!r})"


class AggregatorIdentity:
    """The aggregator's long-term Ed25519 signing key (its messages are signed too)."""

    __slots__ = ("_sign",)

    def __init__(self, *, sign_key: Ed25519PrivateKey) -> None:
        self._sign = sign_key

    @classmethod
    def generate(cls, *, random_bytes: RandomBytes = os.urandom) -> AggregatorIdentity:
        return cls(sign_key=Ed25519PrivateKey.from_private_bytes(random_bytes(32)))

    @property
    def public_key(self) -> bytes:
        return _raw_public(self._sign)

    def private_bytes(self) -> bytes:
        """The raw 32-byte Ed25519 private key (seed); keep it secret."""
        return self._sign.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
            serialization.NoEncryption())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> AggregatorIdentity:
        """Inverse of :meth:`private_bytes`."""
        _check_bytes("raw", raw, _KEY_BYTES)
        return cls(sign_key=Ed25519PrivateKey.from_private_bytes(raw))

    def sign(self, data: bytes) -> bytes:
        return self._sign.sign(data)

    def __repr__(self) -> str:
        return "AggregatorIdentity()"


@dataclass(frozen=True, slots=True, kw_only=True)
class Registry:
    """The enrolled devices and the aggregator's public key, as every party knows them.

    Attributes:
        aggregator_key: raw Ed25519 public key of the aggregator.
        devices: {device id: Enrollment}; becomes read-only.
    """

    aggregator_key: bytes
    devices: Mapping[str, Enrollment]
    _verifiers: Mapping[str, Ed25519PublicKey] | None = field(
        init=False, repr=False, compare=False, default=None
    )
    _aggregator_verifier: Ed25519PublicKey | None = field(
        init=False, repr=False, compare=False, default=None
    )

    def __post_init__(self) -> None:
        key = _check_bytes("aggregator_key", self.aggregator_key, _KEY_BYTES)
        devices = dict(self.devices)
        for name, enr in devices.items():
            if not isinstance(enr, Enrollment) or enr.device != name:
                raise ValueError(f"devices[{name!r}] must be the Enrollment of {name!r}")
        object.__setattr__(self, "devices", MappingProxyType(devices))
        object.__setattr__(
            self,
            "_verifiers",
            MappingProxyType(
                {n: Ed25519PublicKey.from_public_bytes(e.sign_key) for n, e in devices.items()}
            ),
        )
        object.__setattr__(self, "_aggregator_verifier", Ed25519PublicKey.from_public_bytes(key))

    @classmethod
    def of(cls, aggregator: AggregatorIdentity, devices: Iterable[DeviceIdentity]) -> Registry:
        """Registry of the given identities (tests, simulations)."""
        return cls(
            aggregator_key=aggregator.public_key,
            devices={d.device: d.enrollment() for d in devices},
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able document of the public keys (hex): ``{"aggregator_key": ...,
        "devices": {name: {"sign_key": ..., "agree_key": ...}}}``."""
        return {
            "aggregator_key": self.aggregator_key.hex(),
            "devices": {n: {"sign_key": e.sign_key.hex(), "agree_key": e.agree_key.hex()}
                        for n, e in sorted(self.devices.items())},
        }

    @classmethod
    def from_json(cls, doc: object) -> Registry:
        """Inverse of :meth:`to_json`; ValueError naming what is wrong."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("devices"), Mapping):
            raise ValueError("a registry must be a map with 'aggregator_key' and 'devices'")

        def key(value: object, what: str) -> bytes:
            if not isinstance(value, str):
                raise ValueError(f"{what} must be a hex string, got {type(value).__name__}")
            try:
                return bytes.fromhex(value)
            except ValueError:
                raise ValueError(f"{what} is not hex: {value[:16]!r}...") from None

        devices = {}
        for name, enr in doc["devices"].items():
            if not isinstance(enr, Mapping):
                raise ValueError(f"devices[{name!r}] must be a map of sign_key and agree_key")
            devices[name] = Enrollment(device=name,
                                       sign_key=key(enr.get("sign_key"), f"{name}.sign_key"),
                                       agree_key=key(enr.get("agree_key"), f"{name}.agree_key"))
        return cls(aggregator_key=key(doc.get("aggregator_key"), "aggregator_key"),
                   devices=devices)

    def verify(self, signer: str | None, sig: bytes, data: bytes, what: str) -> None:
        """Check a signature by ``signer`` (None: the aggregator); RemoteProtocolError if bad."""
        assert self._verifiers is not None
        key = self._aggregator_verifier if signer is None else self._verifiers.get(signer)
        who = "the aggregator" if signer is None else repr(signer)
        if key is None:
            raise RemoteProtocolError(f"{what}: signer {who} is not enrolled")
        try:
            key.verify(sig, data)
        except InvalidSignature:
            raise RemoteProtocolError(f"{what}: bad signature from {who}") from None


# --------------------------------------------------------------------------- round config


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundConfig:
    """Public parameters of one secure-aggregation round, the same on every party.

    Attributes:
        round_id: unique per fleet, never reused, in [0, 2^63).
        nonce: 32 public random bytes from the aggregator; seeds the neighbour graph and
            (through :meth:`digest`) binds every signature and key to this round.
        cohort: the selected devices, sorted, distinct, at least 3.
        bits: ring size exponent b, 1 <= b <= 64 (sums are mod 2^b).
        length: number of values summed (d, or k kept values in a sparse round).
        degree: neighbours per device k (n - 1 = complete graph, original SecAgg);
            otherwise even, 2 <= k < n - 1.
        threshold: Shamir t per neighbourhood, k/2 < t <= k (2t > k, see
            :func:`default_threshold`). Each neighbourhood tolerates k - t dropouts.
        amortized: True for the amortized zCDP-paper variant.
    """

    round_id: int
    nonce: bytes
    cohort: tuple[str, ...]
    bits: int
    length: int
    degree: int
    threshold: int
    amortized: bool = False

    def __post_init__(self) -> None:
        _check_int("round_id", self.round_id, 0, (1 << 63) - 1)
        _check_bytes("nonce", self.nonce, 32)
        if not isinstance(self.cohort, tuple):
            raise ValueError(f"cohort must be a tuple, got {type(self.cohort).__name__}")
        for dev in self.cohort:
            _check_id("cohort member", dev)
        n = len(self.cohort)
        if not 3 <= n <= _MAX_COHORT:
            raise ValueError(f"cohort must have 3 to {_MAX_COHORT} devices, got {n}")
        if list(self.cohort) != sorted(set(self.cohort)):
            raise ValueError("cohort must be sorted and distinct (sort it: order is public)")
        _check_int("bits", self.bits, 1, 64)
        _check_int("length", self.length, 1, _MAX_LENGTH)
        k = _check_int("degree", self.degree, 2, n - 1)
        if k < n - 1 and k % 2:
            raise ValueError(
                f"degree must be even (Harary graph) or the full n - 1 = {n - 1}, got {k}"
            )
        t = _check_int("threshold", self.threshold, 1, k)
        if 2 * t <= k:
            raise ValueError(
                f"threshold must exceed degree / 2 = {k / 2} (else the aggregator could "
                f"collect both kinds of shares of one device), got {t}"
            )
        if not isinstance(self.amortized, bool):
            raise ValueError(f"amortized must be a bool, got {self.amortized!r}")

    @classmethod
    def for_cohort(
        cls,
        *,
        round_id: int,
        nonce: bytes,
        cohort: Iterable[str],
        bits: int,
        length: int,
        degree: int | None = None,
        threshold: int | None = None,
        full_graph: bool = False,
        amortized: bool = False,
    ) -> RoundConfig:
        """A config with the cohort sorted and SecAgg+ defaults for degree and threshold."""
        members = tuple(sorted(cohort))
        n = len(members)
        if full_graph:
            k = n - 1
        elif degree is None:
            k = default_degree(n)
        else:
            k = _check_int("degree", degree, 2)
            k = min(n - 1, k + (k % 2))  # round up to even, cap at the complete graph
        t = default_threshold(k) if threshold is None else threshold
        return cls(
            round_id=round_id,
            nonce=nonce,
            cohort=members,
            bits=bits,
            length=length,
            degree=k,
            threshold=t,
            amortized=amortized,
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": PROTOCOL_VERSION,
            "kind": "round_config",
            "round": self.round_id,
            "nonce": self.nonce,
            "cohort": list(self.cohort),
            "bits": self.bits,
            "length": self.length,
            "degree": self.degree,
            "threshold": self.threshold,
            "amortized": self.amortized,
        }

    @classmethod
    def from_wire(cls, obj: object) -> RoundConfig:
        d = _expect_map(
            obj,
            "round_config",
            {"round", "nonce", "cohort", "bits", "length", "degree", "threshold", "amortized"},
        )
        amortized = d["amortized"]
        if not isinstance(amortized, bool):
            raise RemoteProtocolError(f"round_config.amortized must be a bool, got {amortized!r}")
        try:
            return cls(
                round_id=_int(d, "round", 0, (1 << 63) - 1),
                nonce=_bin(d, "nonce", 32),
                cohort=tuple(_ids(d, "cohort")),
                bits=_int(d, "bits", 1, 64),
                length=_int(d, "length", 1, _MAX_LENGTH),
                degree=_int(d, "degree", 1, _MAX_COHORT),
                threshold=_int(d, "threshold", 1, _MAX_COHORT),
                amortized=amortized,
            )
        except ValueError as e:
            raise RemoteProtocolError(f"round_config: {e}") from None

    def digest(self) -> bytes:
        """SHA-256 of the config's canonical msgpack encoding (binds signatures and keys)."""
        return _config_digest(self)

    def neighbours(self, device: str) -> tuple[str, ...]:
        """The device's neighbours (sorted)."""
        return self.graph()[device]

    def graph(self) -> Mapping[str, tuple[str, ...]]:
        """The whole neighbour graph (:func:`neighbour_graph`)."""
        return neighbour_graph(self.cohort, degree=self.degree, seed=self.nonce)

    def share_point(self, device: str) -> int:
        """The device's Shamir x: 1 + its index in the sorted cohort."""
        return _cohort_index(self.cohort)[device] + 1


@functools.lru_cache(maxsize=16)
def _config_digest(config: RoundConfig) -> bytes:
    return hashlib.sha256(
        _CONFIG_LABEL + msgpack.packb(config.to_wire(), use_bin_type=True)
    ).digest()


@functools.lru_cache(maxsize=16)
def _cohort_index(cohort: tuple[str, ...]) -> Mapping[str, int]:
    return MappingProxyType({d: i for i, d in enumerate(cohort)})


# --------------------------------------------------------------------------- wire helpers


def _expect_map(obj: object, kind: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"{kind} must be a map, got {type(obj).__name__}")
    want = keys | {"v", "kind"}
    got = set(obj)
    if got != want:
        extra, missing = sorted(map(repr, got - want)), sorted(want - got)
        raise RemoteProtocolError(
            f"{kind} must have exactly the fields {sorted(want)}; missing {missing}, "
            f"unexpected {extra}"
        )
    if obj["v"] != PROTOCOL_VERSION or isinstance(obj["v"], bool):
        raise RemoteProtocolError(
            f"{kind}: protocol version must be {PROTOCOL_VERSION}, got {obj['v']!r}"
        )
    if obj["kind"] != kind:
        raise RemoteProtocolError(f"expected a {kind} message, got kind {obj['kind']!r}")
    return obj


def _int(d: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RemoteProtocolError(f"field {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _bin(
    d: dict[str, Any], key: str, size: int | None = None, max_size: int = _MAX_LENGTH
) -> bytes:
    v = d[key]
    if not isinstance(v, bytes):
        raise RemoteProtocolError(f"field {key!r} must be bytes, got {type(v).__name__}")
    if size is not None and len(v) != size:
        raise RemoteProtocolError(f"field {key!r} must be {size} bytes, got {len(v)}")
    if len(v) > max_size:
        raise RemoteProtocolError(f"field {key!r} must be at most {max_size} bytes, got {len(v)}")
    return v


def _wire_id(v: object, what: str) -> str:
    problem = _id_problem(v)
    if problem:
        raise RemoteProtocolError(f"{what} {v!r} {problem}")
    return v  # type: ignore[return-value]


def _id(d: dict[str, Any], key: str) -> str:
    return _wire_id(d[key], f"field {key!r}")


def _list(d: dict[str, Any], key: str, max_len: int = _MAX_COHORT) -> list[Any]:
    v = d[key]
    if not isinstance(v, list):
        raise RemoteProtocolError(f"field {key!r} must be a list, got {type(v).__name__}")
    if len(v) > max_len:
        raise RemoteProtocolError(f"field {key!r} must have at most {max_len} items, got {len(v)}")
    return v


def _ids(d: dict[str, Any], key: str) -> tuple[str, ...]:
    items = tuple(_wire_id(v, f"item of {key!r}") for v in _list(d, key))
    if len(set(items)) != len(items):
        raise RemoteProtocolError(f"field {key!r} must list distinct devices, got {items}")
    return items


def _id_bytes_pairs(d: dict[str, Any], key: str, size: int) -> tuple[tuple[str, bytes], ...]:
    out = []
    for item in _list(d, key):
        if not (isinstance(item, list) and len(item) == 2):
            raise RemoteProtocolError(f"items of {key!r} must be [device, bytes] pairs")
        dev = _wire_id(item[0], f"device in {key!r}")
        blob = item[1]
        if not isinstance(blob, bytes) or len(blob) != size:
            raise RemoteProtocolError(f"{key!r}[{dev!r}] must be {size} bytes")
        out.append((dev, blob))
    owners = [o for o, _ in out]
    if len(set(owners)) != len(owners):
        raise RemoteProtocolError(f"field {key!r} must name each device once, got {owners}")
    return tuple(out)


# --------------------------------------------------------------------------- messages


class _Message:
    """Shared behaviour of the wire messages (each a frozen, keyword-only dataclass)."""

    __slots__ = ()
    KIND: ClassVar[str]
    sig: bytes

    def payload(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able map of this message, signature included."""
        return {**self.payload(), "sig": self.sig}

    def signing_bytes(self, digest: bytes) -> bytes:
        """What the signature covers: label, round digest, msgpack of the unsigned map."""
        return SIGNATURE_LABEL + digest + msgpack.packb(self.payload(), use_bin_type=True)


def _sign_with(msg: Any, signer: DeviceIdentity | AggregatorIdentity, digest: bytes) -> Any:
    return replace(msg, sig=signer.sign(msg.signing_bytes(digest)))


def _head(kind: str, round_id: int) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "kind": kind, "round": round_id}


_ROUND_HI = (1 << 63) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class AdvertiseKeys(_Message):
    """Device -> aggregator -> neighbours: this round's two X25519 public keys
    (Bonawitz et al. Fig. 4, round 0 "AdvertiseKeys")."""

    KIND: ClassVar[str] = "advertise_keys"
    round_id: int
    sender: str
    mask_key: bytes
    enc_key: bytes
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "mask_key": self.mask_key,
            "enc_key": self.enc_key,
        }

    @classmethod
    def from_wire(cls, obj: object) -> AdvertiseKeys:
        d = _expect_map(obj, cls.KIND, {"round", "sender", "mask_key", "enc_key", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            mask_key=_bin(d, "mask_key", _KEY_BYTES),
            enc_key=_bin(d, "enc_key", _KEY_BYTES),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class NeighbourKeys(_Message):
    """Aggregator -> device: the signed advertisements of its neighbours that advertised."""

    KIND: ClassVar[str] = "neighbour_keys"
    round_id: int
    recipient: str
    adverts: tuple[AdvertiseKeys, ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "recipient": self.recipient,
            "adverts": [a.to_wire() for a in self.adverts],
        }

    @classmethod
    def from_wire(cls, obj: object) -> NeighbourKeys:
        d = _expect_map(obj, cls.KIND, {"round", "recipient", "adverts", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            recipient=_id(d, "recipient"),
            adverts=tuple(AdvertiseKeys.from_wire(a) for a in _list(d, "adverts")),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class EncryptedShare(_Message):
    """One owner's two shares for one holder, sealed with ChaCha20-Poly1305.

    Plaintext: mask-key share (66 bytes) || self-mask-seed share (66 bytes). Associated
    data: ``b"fedge/secagg/v1/share" + digest + lp(sender) + lp(recipient)``.
    """

    KIND: ClassVar[str] = "encrypted_share"
    round_id: int
    sender: str
    recipient: str
    nonce: bytes
    ciphertext: bytes
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "recipient": self.recipient,
            "nonce": self.nonce,
            "ciphertext": self.ciphertext,
        }

    @classmethod
    def from_wire(cls, obj: object) -> EncryptedShare:
        d = _expect_map(
            obj, cls.KIND, {"round", "sender", "recipient", "nonce", "ciphertext", "sig"}
        )
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            recipient=_id(d, "recipient"),
            nonce=_bin(d, "nonce", _NONCE_BYTES),
            ciphertext=_bin(d, "ciphertext", _SHARE_CT_BYTES),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


_SHARE_CT_BYTES = 2 * SHARE_BYTES + 16


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareKeys(_Message):
    """Device -> aggregator: its encrypted shares, one per neighbour (round 1 "ShareKeys")."""

    KIND: ClassVar[str] = "share_keys"
    round_id: int
    sender: str
    shares: tuple[EncryptedShare, ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "shares": [s.to_wire() for s in self.shares],
        }

    @classmethod
    def from_wire(cls, obj: object) -> ShareKeys:
        d = _expect_map(obj, cls.KIND, {"round", "sender", "shares", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            shares=tuple(EncryptedShare.from_wire(s) for s in _list(d, "shares")),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardedShares(_Message):
    """Aggregator -> device: the shares its neighbours sealed for it."""

    KIND: ClassVar[str] = "forwarded_shares"
    round_id: int
    recipient: str
    shares: tuple[EncryptedShare, ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "recipient": self.recipient,
            "shares": [s.to_wire() for s in self.shares],
        }

    @classmethod
    def from_wire(cls, obj: object) -> ForwardedShares:
        d = _expect_map(obj, cls.KIND, {"round", "recipient", "shares", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            recipient=_id(d, "recipient"),
            shares=tuple(EncryptedShare.from_wire(s) for s in _list(d, "shares")),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MaskedInput(_Message):
    """Device -> aggregator: the masked vector y_u, ``count`` residues packed at ``bits``
    (:meth:`edge_sdk.hazmat.ring.Ring.pack`): exactly ``ceil(count * bits / 8)`` payload bytes."""

    KIND: ClassVar[str] = "masked_input"
    round_id: int
    sender: str
    bits: int
    count: int
    payload_bytes: bytes
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "bits": self.bits,
            "count": self.count,
            "data": self.payload_bytes,
        }

    @classmethod
    def from_wire(cls, obj: object) -> MaskedInput:
        d = _expect_map(obj, cls.KIND, {"round", "sender", "bits", "count", "data", "sig"})
        bits, count = _int(d, "bits", 1, 64), _int(d, "count", 1, _MAX_LENGTH)
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            bits=bits,
            count=count,
            payload_bytes=_bin(d, "data", (count * bits + 7) // 8),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class UnmaskRequest(_Message):
    """Aggregator -> surviving device: which of its neighbours dropped (reveal their
    mask-key shares) and which survived (reveal their self-mask shares), and how many
    uploads in all (``survivor_count`` = |U3|, the recipient included) the unmasked sum
    will contain: a device whose accounting assumes a minimum checks it before answering
    (``edge_sdk.session``). With the complete graph the device can verify it (its
    surviving neighbours plus itself); with SecAgg+ neighbourhoods it is the
    aggregator's word (the aggregator is assumed semi-honest, see the module docstring)."""

    KIND: ClassVar[str] = "unmask_request"
    round_id: int
    recipient: str
    dropped: tuple[str, ...]
    survivors: tuple[str, ...]
    survivor_count: int
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "recipient": self.recipient,
            "dropped": list(self.dropped),
            "survivors": list(self.survivors),
            "survivor_count": self.survivor_count,
        }

    @classmethod
    def from_wire(cls, obj: object) -> UnmaskRequest:
        d = _expect_map(obj, cls.KIND, {"round", "recipient", "dropped", "survivors",
                                         "survivor_count", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            recipient=_id(d, "recipient"),
            dropped=_ids(d, "dropped"),
            survivors=_ids(d, "survivors"),
            survivor_count=_int(d, "survivor_count", 1, _MAX_COHORT),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class UnmaskResponse(_Message):
    """Device -> aggregator: the requested shares, as (owner, 66-byte share) pairs."""

    KIND: ClassVar[str] = "unmask_response"
    round_id: int
    sender: str
    mask_key_shares: tuple[tuple[str, bytes], ...]
    self_seed_shares: tuple[tuple[str, bytes], ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "mask_key_shares": [[o, s] for o, s in self.mask_key_shares],
            "self_seed_shares": [[o, s] for o, s in self.self_seed_shares],
        }

    @classmethod
    def from_wire(cls, obj: object) -> UnmaskResponse:
        d = _expect_map(
            obj, cls.KIND, {"round", "sender", "mask_key_shares", "self_seed_shares", "sig"}
        )
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            mask_key_shares=_id_bytes_pairs(d, "mask_key_shares", SHARE_BYTES),
            self_seed_shares=_id_bytes_pairs(d, "self_seed_shares", SHARE_BYTES),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RevealRequest(_Message):
    """Amortized variant, aggregator -> survivor: these neighbours of yours dropped."""

    KIND: ClassVar[str] = "reveal_request"
    round_id: int
    recipient: str
    dropped: tuple[str, ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "recipient": self.recipient,
            "dropped": list(self.dropped),
        }

    @classmethod
    def from_wire(cls, obj: object) -> RevealRequest:
        d = _expect_map(obj, cls.KIND, {"round", "recipient", "dropped", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            recipient=_id(d, "recipient"),
            dropped=_ids(d, "dropped"),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RevealResponse(_Message):
    """Amortized variant, survivor -> aggregator: this round's pairwise seeds toward the
    dropped neighbours, as (peer, 32-byte round seed) pairs."""

    KIND: ClassVar[str] = "reveal_response"
    round_id: int
    sender: str
    seeds: tuple[tuple[str, bytes], ...]
    sig: bytes = b""

    def payload(self) -> dict[str, Any]:
        return {
            **_head(self.KIND, self.round_id),
            "sender": self.sender,
            "seeds": [[p, s] for p, s in self.seeds],
        }

    @classmethod
    def from_wire(cls, obj: object) -> RevealResponse:
        d = _expect_map(obj, cls.KIND, {"round", "sender", "seeds", "sig"})
        return cls(
            round_id=_int(d, "round", 0, _ROUND_HI),
            sender=_id(d, "sender"),
            seeds=_id_bytes_pairs(d, "seeds", SEED_BYTES),
            sig=_bin(d, "sig", _SIG_BYTES),
        )


Message: TypeAlias = (
    AdvertiseKeys
    | NeighbourKeys
    | EncryptedShare
    | ShareKeys
    | ForwardedShares
    | MaskedInput
    | UnmaskRequest
    | UnmaskResponse
    | RevealRequest
    | RevealResponse
)
_KINDS: Mapping[str, Any] = MappingProxyType(
    {
        c.KIND: c
        for c in (
            AdvertiseKeys,
            NeighbourKeys,
            EncryptedShare,
            ShareKeys,
            ForwardedShares,
            MaskedInput,
            UnmaskRequest,
            UnmaskResponse,
            RevealRequest,
            RevealResponse,
        )
    }
)


def encode_message(msg: Message) -> bytes:
    """msgpack bytes of a message (its :meth:`to_wire` map)."""
    return msgpack.packb(msg.to_wire(), use_bin_type=True)


def decode_message(data: bytes) -> Message:
    """Parse and validate msgpack bytes into a message (signatures are checked by the
    receiving endpoint, which knows the keys and the round).

    Raises:
        RemoteProtocolError: truncated or malformed bytes, unknown kind or version, a field
            of the wrong type or size.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RemoteProtocolError(f"a message must be bytes, got {type(data).__name__}")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise RemoteProtocolError(f"malformed message bytes: {e}") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"a message must be a map, got {type(obj).__name__}")
    kind = obj.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message kind {obj.get('kind')!r}")
    return cls.from_wire(obj)  # type: ignore[no-any-return]


def _check_round(msg: Any, config: RoundConfig) -> None:
    if msg.round_id != config.round_id:
        raise RemoteProtocolError(
            f"{msg.KIND} is for round {msg.round_id}, this is round {config.round_id}"
        )


def _share_ad(digest: bytes, sender: str, recipient: str) -> bytes:
    return _SHARE_AD_LABEL + digest + _lp(sender) + _lp(recipient)


# --------------------------------------------------------------------------- device side


class ClientState(enum.Enum):
    """Where a device is in one round (h11-style: every method is legal in one state)."""

    IDLE = "idle"  # -> advertise()
    ADVERTISED = "advertised"  # -> share_keys(NeighbourKeys)
    SHARED = "shared"  # -> mask_input(ForwardedShares, x)
    MASKED = "masked"  # -> unmask(UnmaskRequest) / reveal(RevealRequest)
    DONE = "done"  # answered recovery (an identical request gets the same answer)


def _dh(private: X25519PrivateKey, public: bytes, who: str) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as e:  # e.g. a low-order point gives the all-zero secret
        raise RemoteProtocolError(f"unusable X25519 key from {who!r}: {e}") from None


class SecAggClient:
    """A device's side of one SecAgg(+) round, sans-I/O: messages in, messages out.

    Bonawitz et al. 2017 Fig. 4 (rounds 0-2 and 4; the consistency-check round 3 of the
    actively secure version is not implemented) restricted to neighbourhoods as in SecAgg+
    (Bell et al. 2020). Use::

        c = SecAggClient(identity=me, registry=reg, config=cfg)
        adv = c.advertise()                       # -> aggregator
        sk = c.share_keys(neighbour_keys)         # -> aggregator
        mi = c.mask_input(forwarded_shares, x)    # -> aggregator
        ur = c.unmask(unmask_request)             # -> aggregator

    Every inbound message is checked (round, recipient, aggregator signature, each
    relayed peer message's own signature, membership) before anything changes; a bad
    one raises :class:`RemoteProtocolError` and leaves the client as it was.

    Args:
        identity: this device's long-term keys; must be enrolled and in the cohort.
        registry: everyone's public keys.
        config: the round (``amortized`` must be False).
        random_bytes: randomness for keys, seeds, polynomial coefficients and nonces.
    """

    def __init__(
        self,
        *,
        identity: DeviceIdentity,
        registry: Registry,
        config: RoundConfig,
        random_bytes: RandomBytes = os.urandom,
    ) -> None:
        if config.amortized:
            raise ValueError("config.amortized is True: use AmortizedSecAggClient")
        me = identity.device
        if me not in config.cohort:
            raise ValueError(f"device {me!r} is not in the round's cohort")
        if registry.devices.get(me) != identity.enrollment():
            raise ValueError(f"device {me!r} is not enrolled with these keys")
        missing = [d for d in config.cohort if d not in registry.devices]
        if missing:
            raise ValueError(f"cohort members not enrolled: {missing}")
        self._id = identity
        self._reg = registry
        self._cfg = config
        self._digest = config.digest()
        self._rand = random_bytes
        self._neighbours = frozenset(config.neighbours(me))
        self._state = ClientState.IDLE
        self._mask_sk: X25519PrivateKey | None = None
        self._enc_sk: X25519PrivateKey | None = None
        self._self_seed = b""
        self._advert: AdvertiseKeys | None = None
        self._peer_keys: dict[str, AdvertiseKeys] = {}
        self._pair_seeds: dict[str, bytes] = {}
        self._share_keys: dict[str, bytes] = {}
        self._held: dict[str, tuple[int, int]] = {}
        self._answer: tuple[UnmaskRequest, UnmaskResponse] | None = None

    @property
    def device(self) -> str:
        return self._id.device

    @property
    def state(self) -> ClientState:
        return self._state

    def _expect(self, state: ClientState, what: str) -> None:
        if self._state is not state:
            raise RemoteProtocolError(
                f"{what} is not expected in state {self._state.value} (expected "
                f"{state.value}); ignored"
            )

    def _check_from_aggregator(self, msg: Any) -> None:
        _check_round(msg, self._cfg)
        if msg.recipient != self.device:
            raise RemoteProtocolError(
                f"{msg.KIND} is addressed to {msg.recipient!r}, not {self.device!r}"
            )
        self._reg.verify(None, msg.sig, msg.signing_bytes(self._digest), msg.KIND)

    def advertise(self) -> AdvertiseKeys:
        """Round 0: fresh X25519 key pairs for masks and for share encryption, signed."""
        if self._state is not ClientState.IDLE:
            raise LocalProtocolError(f"advertise() called in state {self._state.value}")
        mask_sk = X25519PrivateKey.from_private_bytes(self._rand(32))
        enc_sk = X25519PrivateKey.from_private_bytes(self._rand(32))
        advert = _sign_with(
            AdvertiseKeys(
                round_id=self._cfg.round_id,
                sender=self.device,
                mask_key=_raw_public(mask_sk),
                enc_key=_raw_public(enc_sk),
            ),
            self._id,
            self._digest,
        )
        self._mask_sk, self._enc_sk, self._advert = mask_sk, enc_sk, advert
        self._state = ClientState.ADVERTISED
        return advert  # type: ignore[no-any-return]

    def share_keys(self, msg: NeighbourKeys) -> ShareKeys:
        """Round 1: check the neighbours' keys; Shamir-share the mask key and a fresh
        self-mask seed b_u t-of-k among them; seal each pair of shares for its holder."""
        if not isinstance(msg, NeighbourKeys):
            raise RemoteProtocolError(f"expected neighbour_keys, got {type(msg).__name__}")
        self._expect(ClientState.ADVERTISED, "neighbour_keys")
        self._check_from_aggregator(msg)
        assert self._mask_sk is not None and self._enc_sk is not None
        peers: dict[str, AdvertiseKeys] = {}
        for adv in msg.adverts:
            _check_round(adv, self._cfg)
            if adv.sender not in self._neighbours:
                raise RemoteProtocolError(
                    f"neighbour_keys carries keys of {adv.sender!r}, not a neighbour of "
                    f"{self.device!r}"
                )
            if adv.sender in peers:
                raise RemoteProtocolError(f"neighbour_keys carries {adv.sender!r} twice")
            self._reg.verify(adv.sender, adv.sig, adv.signing_bytes(self._digest), "advertise_keys")
            peers[adv.sender] = adv
        t = self._cfg.threshold
        if len(peers) < t:
            raise RemoteProtocolError(
                f"only {len(peers)} neighbours advertised keys, below the threshold {t}: "
                f"this device's shares could never be recovered"
            )
        pair_seeds, share_keys = {}, {}
        for v, adv in peers.items():
            pair_seeds[v] = derive_pairwise_seed(
                _dh(self._mask_sk, adv.mask_key, v), context=self._digest
            )
            share_keys[v] = derive_share_key(
                _dh(self._enc_sk, adv.enc_key, v), context=self._digest
            )
        self_seed = self._rand(SEED_BYTES)
        holders = sorted(peers)
        xs = [self._cfg.share_point(v) for v in holders]
        key_shares = split_secret(
            int.from_bytes(_raw_private(self._mask_sk), "big"),
            threshold=t,
            xs=xs,
            random_bytes=self._rand,
        )
        seed_shares = split_secret(
            int.from_bytes(self_seed, "big"), threshold=t, xs=xs, random_bytes=self._rand
        )
        sealed = []
        for v, x in zip(holders, xs, strict=True):
            nonce = self._rand(_NONCE_BYTES)
            ct = ChaCha20Poly1305(share_keys[v]).encrypt(
                nonce,
                share_to_bytes(key_shares[x]) + share_to_bytes(seed_shares[x]),
                _share_ad(self._digest, self.device, v),
            )
            sealed.append(
                _sign_with(
                    EncryptedShare(
                        round_id=self._cfg.round_id,
                        sender=self.device,
                        recipient=v,
                        nonce=nonce,
                        ciphertext=ct,
                    ),
                    self._id,
                    self._digest,
                )
            )
        out = _sign_with(
            ShareKeys(round_id=self._cfg.round_id, sender=self.device, shares=tuple(sealed)),
            self._id,
            self._digest,
        )
        self._peer_keys, self._pair_seeds, self._share_keys = peers, pair_seeds, share_keys
        self._self_seed = self_seed
        self._state = ClientState.SHARED
        return out  # type: ignore[no-any-return]

    def mask_input(
        self, msg: ForwardedShares, x: np.ndarray, *, coordinates: np.ndarray | None = None
    ) -> MaskedInput:
        """Round 2: open the neighbours' shares, then mask x toward exactly those
        neighbours (U2) and with the self mask.

        Args:
            msg: the shares the aggregator forwards (from neighbours that shared keys).
            x: residues in [0, 2^bits): ``config.length`` of them, or a dense vector when
                ``coordinates`` is given.
            coordinates: sparse round: the round's rand-k set omega (``config.length``
                sorted indices); only ``x[omega]`` is masked and sent.

        Raises:
            RemoteProtocolError: a bad forwarded message (nothing changes).
            ValueError: x (or coordinates) not as described.
        """
        if not isinstance(msg, ForwardedShares):
            raise RemoteProtocolError(f"expected forwarded_shares, got {type(msg).__name__}")
        values = _select(x, coordinates, self._cfg)
        self._expect(ClientState.SHARED, "forwarded_shares")
        self._check_from_aggregator(msg)
        held: dict[str, tuple[int, int]] = {}
        for enc in msg.shares:
            _check_round(enc, self._cfg)
            owner = enc.sender
            if owner not in self._peer_keys:
                raise RemoteProtocolError(
                    f"forwarded share from {owner!r}, whose keys this device never received"
                )
            if enc.recipient != self.device:
                raise RemoteProtocolError(f"forwarded share is addressed to {enc.recipient!r}")
            if owner in held:
                raise RemoteProtocolError(f"two forwarded shares from {owner!r}")
            self._reg.verify(owner, enc.sig, enc.signing_bytes(self._digest), "encrypted_share")
            try:
                plain = ChaCha20Poly1305(self._share_keys[owner]).decrypt(
                    enc.nonce, enc.ciphertext, _share_ad(self._digest, owner, self.device)
                )
                held[owner] = (
                    share_from_bytes(plain[:SHARE_BYTES]),
                    share_from_bytes(plain[SHARE_BYTES:]),
                )
            except (InvalidTag, ValueError):
                raise RemoteProtocolError(
                    f"the share sealed by {owner!r} does not open or decode"
                ) from None
        t = self._cfg.threshold
        if len(held) < t:
            raise RemoteProtocolError(
                f"only {len(held)} neighbours shared keys, below the threshold {t}"
            )
        terms = [(1, self._self_seed)] + [
            (mask_sign(self.device, v), self._pair_seeds[v]) for v in sorted(held)
        ]
        y = mask(values, bits=self._cfg.bits, terms=terms)
        out = _sign_with(
            MaskedInput(
                round_id=self._cfg.round_id,
                sender=self.device,
                bits=self._cfg.bits,
                count=self._cfg.length,
                payload_bytes=Ring(bits=self._cfg.bits).pack(y),
            ),
            self._id,
            self._digest,
        )
        self._held = held
        self._state = ClientState.MASKED
        return out  # type: ignore[no-any-return]

    def unmask(self, msg: UnmaskRequest) -> UnmaskResponse:
        """Round 4: reveal mask-key shares of the dropped neighbours and self-mask shares
        of the surviving ones; never both kinds for one owner, and only one request.

        Raises:
            UnmaskRefused: the request names an owner in both lists, this device itself,
                or follows a different earlier request (nothing is revealed).
            RemoteProtocolError: otherwise malformed or unsigned request.
        """
        if not isinstance(msg, UnmaskRequest):
            raise RemoteProtocolError(f"expected unmask_request, got {type(msg).__name__}")
        if self._state is ClientState.DONE and self._answer is not None:
            self._check_from_aggregator(msg)
            if msg == self._answer[0]:
                return self._answer[1]
            raise UnmaskRefused(
                f"{self.device!r} already answered a different unmask request this round; "
                f"answering another could reveal both shares of one device"
            )
        self._expect(ClientState.MASKED, "unmask_request")
        self._check_from_aggregator(msg)
        both = set(msg.dropped) & set(msg.survivors)
        if both:
            raise UnmaskRefused(
                f"unmask request asks for both the mask-key and the self-mask shares of "
                f"{sorted(both)}; revealing both would unmask their input"
            )
        if self.device in msg.dropped or self.device in msg.survivors:
            raise UnmaskRefused(f"unmask request names the recipient {self.device!r} itself")
        unknown = sorted(set(msg.dropped + msg.survivors) - set(self._held))
        if unknown:
            raise RemoteProtocolError(f"{self.device!r} holds no shares of {unknown}")
        reply = _sign_with(
            UnmaskResponse(
                round_id=self._cfg.round_id,
                sender=self.device,
                mask_key_shares=tuple((o, share_to_bytes(self._held[o][0])) for o in msg.dropped),
                self_seed_shares=tuple(
                    (o, share_to_bytes(self._held[o][1])) for o in msg.survivors
                ),
            ),
            self._id,
            self._digest,
        )
        self._answer = (msg, reply)
        self._state = ClientState.DONE
        return reply  # type: ignore[no-any-return]


def _select(x: object, coordinates: object, config: RoundConfig) -> np.ndarray:
    a = np.asarray(x)
    if coordinates is not None:
        idx = np.asarray(coordinates)
        if idx.ndim != 1 or idx.dtype.kind not in "iu" or idx.size != config.length:
            raise ValueError(
                f"coordinates must be {config.length} integer indices, got dtype "
                f"{idx.dtype} shape {idx.shape}"
            )
        if a.ndim != 1:
            raise ValueError(f"x must be 1-D, got shape {a.shape}")
        if idx.size and (
            idx.min() < 0 or idx.max() >= a.size or np.any(np.diff(idx.astype(np.int64)) <= 0)
        ):
            raise ValueError(f"coordinates must be sorted distinct indices into x (len {a.size})")
        a = a[idx]
    if a.ndim != 1 or a.size != config.length:
        raise ValueError(
            f"x must be 1-D with config.length = {config.length} values, got shape {a.shape}"
        )
    return Ring(bits=config.bits).check_residues(a, name="x")


# --------------------------------------------------------------------------- amortized


class PairwiseSeeds:
    """A device's long-term pairwise seeds (amortized variant), agreed once at enrollment.

    Seeds are derived on first use from static X25519 between the device's and the
    peer's enrolled ``agree`` keys (:func:`amortized_pair_seed`) and cached. It also holds
    the last round id this device masked for: reusing a round id would reuse its masks,
    so :meth:`claim_round` refuses any id not above it. Persist ``last_round`` (with the
    ledger) before the masked upload leaves the device.
    """

    __slots__ = ("_cache", "_identity", "_last_round", "_registry")

    def __init__(
        self, *, identity: DeviceIdentity, registry: Registry, last_round: int | None = None
    ) -> None:
        self._identity = identity
        self._registry = registry
        self._cache: dict[str, bytes] = {}
        self._last_round = (
            None if last_round is None else _check_int("last_round", last_round, 0, _ROUND_HI)
        )

    @property
    def last_round(self) -> int | None:
        return self._last_round

    def seed(self, peer: str) -> bytes:
        """The long-term seed shared with ``peer`` (never leaves the device)."""
        if peer not in self._cache:
            enr = self._registry.devices.get(peer)
            if enr is None:
                raise ValueError(f"peer {peer!r} is not enrolled")
            secret = self._identity.agree(enr.agree_key)
            self._cache[peer] = amortized_pair_seed(secret, self._identity.device, peer)
        return self._cache[peer]

    def claim_round(self, round_id: int) -> None:
        """Record ``round_id`` as used; RemoteProtocolError if not above the last one."""
        if self._last_round is not None and round_id <= self._last_round:
            raise RemoteProtocolError(
                f"round id {round_id} is not above the last masked round {self._last_round}: "
                f"reusing a round id would reuse its masks"
            )
        self._last_round = round_id


class AmortizedSecAggClient:
    """A device's side of one round of the amortized variant (zCDP paper Fig. 2).

    ``mask_input(x)`` masks with ``G(seed_uv, round)`` toward every neighbour (the complete
    graph reproduces eq. (7)); ``reveal(request)`` gives this round's seeds toward the
    neighbours the aggregator reports dropped. See the module docstring for why its
    dropout story is weaker than :class:`SecAggClient`'s.

    Args:
        identity: this device's long-term keys.
        registry: everyone's public keys.
        config: the round (``amortized`` must be True).
        seeds: the device's :class:`PairwiseSeeds` (persists across rounds).
    """

    def __init__(
        self,
        *,
        identity: DeviceIdentity,
        registry: Registry,
        config: RoundConfig,
        seeds: PairwiseSeeds,
    ) -> None:
        if not config.amortized:
            raise ValueError("config.amortized is False: use SecAggClient")
        me = identity.device
        if me not in config.cohort:
            raise ValueError(f"device {me!r} is not in the round's cohort")
        if registry.devices.get(me) != identity.enrollment():
            raise ValueError(f"device {me!r} is not enrolled with these keys")
        self._id = identity
        self._reg = registry
        self._cfg = config
        self._digest = config.digest()
        self._seeds = seeds
        self._neighbours = config.neighbours(me)
        self._state = ClientState.IDLE
        self._answer: tuple[RevealRequest, RevealResponse] | None = None

    @property
    def device(self) -> str:
        return self._id.device

    @property
    def state(self) -> ClientState:
        return self._state

    def _round_seed(self, peer: str) -> bytes:
        return amortized_round_seed(self._seeds.seed(peer), self._cfg.round_id)

    def mask_input(self, x: np.ndarray, *, coordinates: np.ndarray | None = None) -> MaskedInput:
        """``c_i = p_i + sum_j sign(i, j) G(seed_ij, t)`` (eqs. (7)-(8)), signed.

        Raises:
            LocalProtocolError: called twice.
            RemoteProtocolError: the round id is not above the last one masked for.
        """
        if self._state is not ClientState.IDLE:
            raise LocalProtocolError(f"mask_input() called in state {self._state.value}")
        values = _select(x, coordinates, self._cfg)
        terms = [(mask_sign(self.device, v), self._round_seed(v)) for v in self._neighbours]
        y = mask(values, bits=self._cfg.bits, terms=terms)
        out = _sign_with(
            MaskedInput(
                round_id=self._cfg.round_id,
                sender=self.device,
                bits=self._cfg.bits,
                count=self._cfg.length,
                payload_bytes=Ring(bits=self._cfg.bits).pack(y),
            ),
            self._id,
            self._digest,
        )
        self._seeds.claim_round(self._cfg.round_id)
        self._state = ClientState.MASKED
        return out  # type: ignore[no-any-return]

    def reveal(self, msg: RevealRequest) -> RevealResponse:
        """Reveal this round's seeds toward the listed dropped neighbours.

        Raises:
            UnmaskRefused: the request names this device, would leave fewer than
                ``threshold`` neighbours masked with it, or differs from one answered.
            RemoteProtocolError: malformed, unsigned, or naming a non-neighbour.
        """
        if not isinstance(msg, RevealRequest):
            raise RemoteProtocolError(f"expected reveal_request, got {type(msg).__name__}")
        if self._state is ClientState.DONE and self._answer is not None:
            self._check(msg)
            if msg == self._answer[0]:
                return self._answer[1]
            raise UnmaskRefused(f"{self.device!r} already answered a different reveal request")
        if self._state is not ClientState.MASKED:
            raise RemoteProtocolError(f"reveal_request not expected in state {self._state.value}")
        self._check(msg)
        if self.device in msg.dropped:
            raise UnmaskRefused(f"reveal request names the recipient {self.device!r} itself")
        strangers = sorted(set(msg.dropped) - set(self._neighbours))
        if strangers:
            raise RemoteProtocolError(f"reveal request names non-neighbours {strangers}")
        left = len(self._neighbours) - len(msg.dropped)
        if left < self._cfg.threshold:
            raise UnmaskRefused(
                f"revealing {len(msg.dropped)} seeds would leave {left} neighbours masked "
                f"with {self.device!r}, below the threshold {self._cfg.threshold}"
            )
        reply = _sign_with(
            RevealResponse(
                round_id=self._cfg.round_id,
                sender=self.device,
                seeds=tuple((v, self._round_seed(v)) for v in msg.dropped),
            ),
            self._id,
            self._digest,
        )
        self._answer = (msg, reply)
        self._state = ClientState.DONE
        return reply  # type: ignore[no-any-return]

    def _check(self, msg: RevealRequest) -> None:
        _check_round(msg, self._cfg)
        if msg.recipient != self.device:
            raise RemoteProtocolError(f"reveal_request is addressed to {msg.recipient!r}")
        self._reg.verify(None, msg.sig, msg.signing_bytes(self._digest), msg.KIND)
