"""edge_sdk.hazmat.ring: the centered reading, wrap-around sums, pack/unpack, argument errors.

The packed byte layout itself is pinned by tests/golden/secagg_vectors.json (test_secagg.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.hazmat.ring import Ring

FAST = settings(max_examples=100, deadline=None, derandomize=True)
BITS = (2, 16, 32, 63, 64)


def _centered(v: int, b: int) -> int:
    """The reference: the representative of v mod 2^b in [-2^(b-1), 2^(b-1)), in Python ints."""
    r = v % (1 << b)
    return r - (1 << b) if r >= 1 << (b - 1) else r


@FAST
@given(b=st.sampled_from(BITS), data=st.data())
def test_to_signed_round_trips_every_signed_value(b: int, data: st.DataObject) -> None:
    half = 1 << (b - 1)
    signed = data.draw(st.lists(st.integers(-half, half - 1), min_size=0, max_size=20))
    ring = Ring(bits=b)
    residues = np.array([s % ring.modulus for s in signed], dtype=np.uint64)
    out = ring.to_signed(residues)
    assert out.dtype == np.int64 and out.shape == residues.shape
    assert out.tolist() == signed
    # and back: the signed value mod 2^b is the residue again
    assert (out.view(np.uint64) & ring.mask).tolist() == residues.tolist()


@pytest.mark.parametrize("b", BITS)
def test_to_signed_edges(b: int) -> None:
    ring = Ring(bits=b)
    half = 1 << (b - 1)
    residues = np.array([0, 1, half - 1, half, ring.modulus - 1], dtype=np.uint64)
    assert ring.to_signed(residues).tolist() == [0, 1, half - 1, -half, -1]


@FAST
@given(b=st.sampled_from(BITS), data=st.data())
def test_wrapped_uint64_sums_read_as_the_exact_sum(b: int, data: st.DataObject) -> None:
    """A cohort's residues summed in uint64 (wrapping mod 2^64) read as the integer sum mod 2^b."""
    ring = Ring(bits=b)
    n = data.draw(st.integers(1, 8))
    rows = [
        data.draw(st.lists(st.integers(0, ring.modulus - 1), min_size=3, max_size=3))
        for _ in range(n)
    ]
    residues = np.array(rows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        wrapped = residues.sum(axis=0, dtype=np.uint64)
    exact = [sum(col) for col in zip(*rows, strict=True)]
    assert ring.to_signed(wrapped).tolist() == [_centered(v, b) for v in exact]
    assert (wrapped & ring.mask).tolist() == [v % ring.modulus for v in exact]


@pytest.mark.parametrize(("b", "width"), [(1, 8), (8, 8), (9, 16), (16, 16), (17, 32),
                                        (32, 32), (33, 64), (64, 64)])
def test_dtype_is_the_narrowest_word_that_holds_b_bits(b: int, width: int) -> None:
    assert Ring(bits=b).dtype == np.dtype(f"uint{width}")
    top = np.array([0, (1 << b) - 1], dtype=np.uint64)
    assert Ring(bits=b).check_residues(top).dtype == np.dtype(f"uint{width}")


@FAST
@given(b=st.sampled_from(BITS), data=st.data())
def test_sums_in_the_ring_dtype_read_as_the_exact_sum(b: int, data: st.DataObject) -> None:
    """Residues summed in the ring's own dtype (wrapping mod its width, a multiple of 2^b)
    read as the integer sum mod 2^b: the aggregator sums masked uploads that way."""
    ring = Ring(bits=b)
    rows = [
        data.draw(st.lists(st.integers(0, ring.modulus - 1), min_size=3, max_size=3))
        for _ in range(data.draw(st.integers(1, 8)))
    ]
    total = np.zeros(3, dtype=ring.dtype)
    for row in rows:
        np.add(total, np.array(row, dtype=ring.dtype), out=total)
    exact = [sum(col) for col in zip(*rows, strict=True)]
    assert ring.to_signed(total).tolist() == [_centered(v, b) for v in exact]
    assert [int(v) % ring.modulus for v in total] == [v % ring.modulus for v in exact]


@FAST
@given(b=st.sampled_from(BITS), data=st.data())
def test_to_signed_reads_any_integer_dtype_mod_2_64(b: int, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=10))
    got = Ring(bits=b).to_signed(np.array(values, dtype=np.int64))
    assert got.tolist() == [_centered(v, b) for v in values]


def test_to_signed_keeps_shape() -> None:
    a = np.arange(12, dtype=np.uint64).reshape(3, 4)
    assert Ring(bits=3).to_signed(a).tolist() == [[0, 1, 2, 3], [-4, -3, -2, -1], [0, 1, 2, 3]]


@FAST
@given(b=st.integers(1, 64), data=st.data())
def test_pack_unpack_round_trip(b: int, data: st.DataObject) -> None:
    ring = Ring(bits=b)
    n = data.draw(st.integers(0, 30))
    v = np.array(
        data.draw(st.lists(st.integers(0, ring.modulus - 1), min_size=n, max_size=n)),
        dtype=np.uint64,
    )
    raw = ring.pack(v)
    assert len(raw) == (n * b + 7) // 8
    back = ring.unpack(raw, n)
    assert back.dtype == ring.dtype and back.flags.writeable
    np.testing.assert_array_equal(back, v)


def test_pack_is_an_lsb_first_bit_stream() -> None:
    # 3-bit values 1, 2, 3 -> stream bits 100 010 110 -> bytes 0b11010001, 0b0 (9 bits)
    assert Ring(bits=3).pack(np.array([1, 2, 3], dtype=np.uint64)) == bytes([0b11010001, 0b0])
    assert Ring(bits=16).pack(np.array([0x0102], dtype=np.uint64)) == b"\x02\x01"
    assert Ring(bits=24).pack(np.array([0x010203], dtype=np.uint64)) == b"\x03\x02\x01"


def test_bad_arguments_are_named() -> None:
    for bits in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match="bits must be"):
            Ring(bits=bits)  # type: ignore[arg-type]
    ring = Ring(bits=4)
    with pytest.raises(ValueError, match="sum_mod must be an integer array, got dtype float64"):
        ring.to_signed(np.array([0.5]), name="sum_mod")
    with pytest.raises(ValueError, match=r"residues in \[0, 2\^4\), got 16 at 1"):
        ring.pack(np.array([3, 16]))
    with pytest.raises(ValueError, match="got -1 at 0"):
        ring.check_residues(np.array([-1, 0]), name="x")
    with pytest.raises(ValueError, match="x must be a 1-D integer array"):
        ring.check_residues(np.zeros((2, 2), dtype=np.uint64), name="x")
    with pytest.raises(ValueError, match="take 2 bytes, got 3"):
        Ring(bits=3).unpack(b"\0\0\0", 3)
    with pytest.raises(ValueError, match="padding bits"):
        Ring(bits=3).unpack(b"\0\x80", 3)
    with pytest.raises(ValueError, match="count must be"):
        ring.unpack(b"", -1)
