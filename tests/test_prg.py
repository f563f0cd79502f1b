"""edge_sdk.hazmat.prg: the one keyed ChaCha20 stream (plan15 step C1).

Oracles: RFC 8439 Appendix A.1 test vector #1 for the keystream, RFC 5869 Appendix A
test cases 1 and 3 for the HKDF, a list-based textbook Fisher-Yates for the sparse one.
That the recipes read this stream bit for bit as before is pinned by their golden vectors
(test_secagg graph and masks, test_compress coordinate sets, test_ddp rotation signs,
test_csprng block layout)."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Iterator
from itertools import permutations
from typing import Any

import numpy as np
import pytest

from edge_sdk.hazmat import prg

RFC8439_A1_KEYSTREAM = bytes.fromhex(
    "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
    "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
)
KEY = hashlib.sha256(b"prg-test").digest()


def _words(values: list[int]) -> Callable[[], int]:
    it: Iterator[int] = iter(values)
    return lambda: next(it)


# --------------------------------------------------------------------------- stream


@pytest.mark.parametrize("dtype", ["u1", "<u2", "<u4", "<u8", ">u4", ">u8"])
def test_keystream_into_is_rfc8439_read_little_endian(dtype: str) -> None:
    out = np.empty(64 // np.dtype(dtype).itemsize, dtype=dtype)
    assert prg.keystream_into(bytes(32), out) is out
    want = np.frombuffer(RFC8439_A1_KEYSTREAM, dtype=np.dtype(dtype).newbyteorder("<"))
    assert out.tolist() == want.tolist()  # values, whatever the array's byte order


def test_keystream_bytes_is_the_stream_prefix() -> None:
    assert prg.keystream_bytes(bytes(32), 64) == RFC8439_A1_KEYSTREAM
    assert prg.keystream_bytes(bytes(32), 5) == RFC8439_A1_KEYSTREAM[:5]
    assert prg.keystream_bytes(KEY, 0) == b""


def test_keystream_continues_across_calls() -> None:
    whole = prg.keystream_bytes(KEY, 8 * 1000 + 24)
    ks = prg.Keystream(KEY)
    a = ks.into(np.empty(333, dtype=np.uint64))
    b = ks.read(24)
    c = ks.into(np.empty(667, dtype=np.uint64))
    assert a.astype("<u8").tobytes() + b + c.astype("<u8").tobytes() == whole
    assert ks.into(np.empty(0, dtype=np.uint64)).size == 0  # an empty read takes nothing


@pytest.mark.parametrize("chunk", [1, 3, 64, 5000])
def test_word_stream_reads_the_u64_words_in_order(chunk: int) -> None:
    want = prg.keystream_into(KEY, np.empty(1000, dtype=np.uint64)).tolist()
    words = prg.WordStream(KEY, chunk=chunk)
    got = [words() for _ in range(1000)]
    assert got == want and all(type(w) is int for w in got)


@pytest.mark.parametrize("key", [b"", bytes(31), bytes(33), "x" * 32, bytearray(32), None])
def test_key_must_be_32_bytes(key: Any) -> None:
    with pytest.raises(ValueError, match="key must be 32 bytes"):
        prg.Keystream(key)
    with pytest.raises(ValueError, match="key must be 32 bytes"):
        prg.keystream_into(key, np.empty(4, dtype=np.uint64))
    with pytest.raises(ValueError, match="key must be 32 bytes"):
        prg.WordStream(key)


def _read_only() -> np.ndarray:
    a = np.empty(4, dtype=np.uint64)
    a.setflags(write=False)
    return a


@pytest.mark.parametrize("out", [
    np.empty(4, dtype=np.int64), np.empty(4, dtype=np.float64), np.empty(8, np.uint64)[::2],
    _read_only(), [0, 0, 0], b"\0" * 8,
])
def test_out_must_be_a_writable_contiguous_unsigned_array(out: Any) -> None:
    with pytest.raises(ValueError, match="out must be a writable C-contiguous unsigned"):
        prg.keystream_into(KEY, out)


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="n must be"):
        prg.keystream_bytes(KEY, -1)
    with pytest.raises(ValueError, match="chunk must be"):
        prg.WordStream(KEY, chunk=0)


# --------------------------------------------------------------------------- derive_key


def test_derive_key_is_rfc5869_hkdf_sha256() -> None:
    ikm = bytes([0x0B]) * 22
    # Test case 1 (L = 42): HKDF's first 32 output bytes do not depend on L
    okm1 = prg.derive_key(ikm, salt=bytes(range(13)), info=bytes(range(0xF0, 0xFA)))
    assert okm1.hex() == "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
    # Test case 3: zero-length salt and info; an absent salt is HashLen zeros, the same key
    okm3 = prg.derive_key(ikm, info=b"")
    assert okm3.hex() == "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"
    assert prg.derive_key(ikm, info=b"", salt=b"") == okm3
    assert prg.derive_key(ikm, info=b"a") != prg.derive_key(ikm, info=b"b")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"ikm": "k", "info": b""}, "ikm must be bytes"),
    ({"ikm": b"k", "info": "x"}, "info must be bytes"),
    ({"ikm": b"k", "info": b"", "salt": 0}, "salt must be bytes or None"),
])
def test_derive_key_refuses_non_bytes(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prg.derive_key(**kwargs)


# --------------------------------------------------------------------------- rejection


def test_rejection_threshold() -> None:
    assert prg.rejection_threshold(3) == 1  # 2^64 = 3 * (2^64 - 1)/3 + 1
    assert prg.rejection_threshold(10) == 6
    assert prg.rejection_threshold(1) == prg.rejection_threshold(2**32) == 0
    assert prg.rejection_threshold(2**64) == 0
    assert prg.rejection_threshold(2**63 + 1) == 2**63 - 1
    for bad in (0, -1, 2**64 + 1, 1.5, True):
        with pytest.raises(ValueError, match="n must be"):
            prg.rejection_threshold(bad)  # type: ignore[arg-type]


def test_below_rejects_exactly_the_biased_words() -> None:
    assert prg.below(_words([0, 5]), 3) == 5 % 3  # 0 < 2^64 mod 3 = 1: rejected
    assert prg.below(_words([1]), 3) == 1  # the threshold itself is accepted
    assert prg.below(_words([0, 1, 2, 3, 4, 5, 6, 7]), 10) == 6 % 10  # 0..5 rejected
    assert prg.below(_words([2**64 - 1]), 2**64) == 2**64 - 1


# --------------------------------------------------------------------------- Fisher-Yates


def _textbook(next_word: Callable[[], int], n: int) -> list[int]:
    """Knuth's Algorithm P on a list: the oracle the sparse version must equal."""
    a = list(range(n))
    for i in range(n):
        j = i + prg.below(next_word, n - i)
        a[i], a[j] = a[j], a[i]
    return a


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 300])
def test_fisher_yates_matches_the_textbook_shuffle(n: int) -> None:
    key = prg.derive_key(KEY, info=b"fy%d" % n)
    full = prg.fisher_yates(prg.WordStream(key), n, n)
    assert full == _textbook(prg.WordStream(key), n)
    assert sorted(full) == list(range(n))
    for k in range(n + 1):  # the k-draw is the prefix of the full shuffle on the same words
        assert prg.fisher_yates(prg.WordStream(key), n, k) == full[:k]


def test_fisher_yates_rejection_and_range_checks() -> None:
    assert prg.fisher_yates(_words([0, 5]), 3, 1) == [5 % 3]
    assert prg.fisher_yates(_words([2**64 - 1]), 3, 1) == [0]
    assert prg.fisher_yates(_words([]), 5, 0) == []
    for n, k in ((3, 4), (3, -1), (-1, 0)):
        with pytest.raises(ValueError, match="must be"):
            prg.fisher_yates(_words([]), n, k)


def test_fisher_yates_permutations_are_uniform() -> None:
    trials = 6000
    seen = Counter(
        tuple(prg.fisher_yates(prg.WordStream(hashlib.sha256(b"%d" % i).digest()), 3, 3))
        for i in range(trials)
    )
    assert set(seen) == set(permutations(range(3)))
    q = 1 / 6
    for count in seen.values():  # 5 standard deviations of a binomial(trials, 1/6)
        assert abs(count - trials * q) <= 5 * math.sqrt(trials * q * (1 - q))
