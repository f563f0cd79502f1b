"""Shamir secret sharing over GF(2^521 - 1), and the 66-byte share encoding.

Hazmat (see :mod:`edge_sdk.hazmat`): shares are not encrypted, bound to a round or checked
here; ``edge_sdk.secagg`` does that. A 32-byte key is one field element (p = 2^521 - 1 is
a Mersenne prime); in a round a device's share sits at x = 1 + its index in the sorted
cohort, and shares travel as 66-byte big-endian integers (a wire format, pinned by
``tests/golden/secagg_vectors.json``). Polynomial coefficients are uniform in GF(p) by
rejection sampling.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

from edge_sdk._validate import check_bytes as _check_bytes
from edge_sdk._validate import check_int as _check_int

__all__ = [
    "SHAMIR_PRIME",
    "SHARE_BYTES",
    "RandomBytes",
    "combine_shares",
    "share_from_bytes",
    "share_to_bytes",
    "split_secret",
]

SHAMIR_PRIME = 2**521 - 1
"""The Shamir field GF(2^521 - 1): a 32-byte secret is one element."""

SHARE_BYTES = 66
"""Bytes of one encoded share (big-endian, < SHAMIR_PRIME)."""

RandomBytes: TypeAlias = Callable[[int], bytes]
"""A source of random bytes: ``os.urandom`` on a device, a seeded one in tests."""


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
