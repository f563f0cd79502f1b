"""The ring Z_{2^b} that secure aggregation sums in: residues, their signed reading, their bytes.

A ring's residues are held in :attr:`Ring.dtype`, the narrowest of uint8, uint16, uint32 and
uint64 that holds b bits (uint32 at b = 32), so a sum of residues may be taken in that dtype or
any wider unsigned one: it wraps mod 2^8, 2^16, 2^32 or 2^64, each a multiple of 2^b, and the
reduction or :meth:`Ring.to_signed` of the wrapped sum is that of the exact sum. The signed
(centered) reading of r is r - 2^b when r >= 2^(b-1): the representative in
[-2^(b-1), 2^(b-1)).

The byte layout of :meth:`Ring.pack` is pinned by tests/golden/secagg_vectors.json
(``pack_residues``); a change is a new wire version.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_sdk._validate import check_int as _check_int

__all__ = ["Ring"]

_MAX_LENGTH = 1 << 31
_DTYPES = tuple(np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64))


@dataclass(frozen=True, slots=True, kw_only=True)
class Ring:
    """Z_{2^bits}, residues stored as :attr:`dtype`.

    Attributes:
        bits: the exponent b, 1 <= b <= 64 (the modulus is 2^b).
    """

    bits: int

    def __post_init__(self) -> None:
        _check_int("bits", self.bits, 1, 64)

    @property
    def modulus(self) -> int:
        """2^bits (a Python int: 2^64 does not fit uint64)."""
        return 1 << self.bits

    @property
    def dtype(self) -> np.dtype:
        """The narrowest unsigned dtype of 8, 16, 32 or 64 bits that holds a residue: the
        width of the mask PRG's words and of the sums (``prg.expand``)."""
        return next(t for t in _DTYPES if 8 * t.itemsize >= self.bits)

    @property
    def mask(self) -> np.uint64:
        """2^bits - 1, the uint64 that ``&`` reduces with."""
        return np.uint64((1 << self.bits) - 1)

    def check_residues(self, x: object, *, name: str = "values") -> np.ndarray:
        """A copy of x in :attr:`dtype` after checking it is a 1-D integer array of residues.

        Raises:
            ValueError: not 1-D integer, or an entry outside [0, 2^bits) (named by index).
        """
        return np.array(self._checked(x, name), dtype=self.dtype, copy=True)

    def _checked(self, x: object, name: str) -> np.ndarray:
        a = np.asarray(x)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise ValueError(
                f"{name} must be a 1-D integer array, got dtype {a.dtype} shape {a.shape}"
            )
        if a.size and ((a.dtype.kind == "i" and int(a.min()) < 0) or int(a.max()) >> self.bits):
            bad = next(i for i, v in enumerate(a.tolist()) if v < 0 or v >> self.bits)
            raise ValueError(
                f"{name} must hold residues in [0, 2^{self.bits}), got {a[bad]} at {bad}"
            )
        return a

    def to_signed(self, values: np.ndarray, *, name: str = "values") -> np.ndarray:
        """The representative of each value mod 2^bits in [-2^(bits-1), 2^(bits-1)), int64.

        Args:
            values: integer array of any shape (uint64 sums wrap mod 2^64, which 2^bits
                divides; signed inputs are read in two's complement, i.e. mod 2^64).
            name: how errors name the argument.

        Returns:
            int64 array shaped like values.

        Raises:
            ValueError: values not an integer array.
        """
        a = np.asarray(values)
        if a.dtype.kind not in "iu":
            raise ValueError(f"{name} must be an integer array, got dtype {a.dtype}")
        # Shift the b-bit residue to the top of the word, then shift back arithmetically:
        # the sign bit 2^(b-1) fills the high bits, which is r - 2^b exactly when r >= 2^(b-1).
        shift = np.uint64(64 - self.bits)
        return (a.astype(np.uint64) << shift).view(np.int64) >> np.int64(shift)

    def pack(self, values: np.ndarray) -> bytes:
        """Pack residues in [0, 2^bits) into ``ceil(n * bits / 8)`` bytes.

        One LSB-first bit stream: bit m of value i is stream bit ``i * bits + m``, stream
        bit j is bit ``j mod 8`` of byte ``j // 8``; padding bits are zero. For bits a
        multiple of 8 this is the little-endian byte image of each value, truncated to
        bits / 8 bytes.

        Raises:
            ValueError: values not 1-D integer residues of this ring.
        """
        b = self.bits
        v = self._checked(values, "values")
        if b in (8, 16, 32, 64):
            return v.astype(f"<u{b // 8}", copy=False).tobytes()  # no copy of a LE ring array
        as_bytes = v.astype("<u8").view(np.uint8).reshape(-1, 8)
        if b % 8 == 0:
            return as_bytes[:, : b // 8].tobytes()
        bitmat = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :b]
        return np.packbits(bitmat.reshape(-1), bitorder="little").tobytes()

    def unpack(self, data: bytes, count: int) -> np.ndarray:
        """Inverse of :meth:`pack`: ``count`` residues as :attr:`dtype` (a writable array).

        Raises:
            ValueError: wrong length (not ``ceil(count * bits / 8)`` bytes) or non-zero
                padding bits.
        """
        b = self.bits
        n = _check_int("count", count, 0, _MAX_LENGTH)
        raw = bytes(data)
        want = (n * b + 7) // 8
        if len(raw) != want:
            raise ValueError(f"{n} residues of {b} bits take {want} bytes, got {len(raw)}")
        if b in (8, 16, 32, 64):
            return np.frombuffer(raw, dtype=f"<u{b // 8}").astype(self.dtype)
        buf = np.frombuffer(raw, dtype=np.uint8)
        if b % 8 == 0:
            full = np.zeros((n, 8), dtype=np.uint8)
            full[:, : b // 8] = buf.reshape(n, b // 8)
            return full.view("<u8").reshape(n).astype(self.dtype)
        bits_arr = np.unpackbits(buf, bitorder="little")
        if bits_arr[n * b :].any():
            raise ValueError(f"padding bits after {n} residues of {b} bits must be zero")
        bitmat = np.zeros((n, 64), dtype=np.uint8)
        bitmat[:, :b] = bits_arr[: n * b].reshape(n, b)
        return (
            np.packbits(bitmat, axis=1, bitorder="little").view("<u8").reshape(n).astype(self.dtype)
        )
