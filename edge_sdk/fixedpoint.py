"""Fixed-point encoding of reals into the ring Z_{2^bits} for secure aggregation.

:class:`FixedPoint`: stochastic-rounding integer encoding (unbiased: ``E[decode(encode(x))] =
x``), the centered decoding of a cohort's modular sum (:meth:`edge_sdk.hazmat.ring.Ring.to_signed`)
and an up-front no-wrap check. The device encodes with it, the aggregator decodes and checks
with it; residues are uint64 arrays as everywhere in the ring.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from edge_sdk._validate import check_int as _check_int
from edge_sdk.hazmat.ring import Ring

__all__ = ["FixedPoint"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedPoint:
    """Fixed-point encoding of reals into the ring Z_{2^bits} for secure aggregation.

    ``encode`` maps x to ``round_stoch(x * scale) mod 2^bits`` (two's complement), with
    stochastic rounding so that ``E[decode(encode(x))] = x``; the masked sum of a
    cohort's encodings, reduced mod 2^bits, decodes (centered) to the sum of the values
    within ``count / scale`` per coordinate, provided the sum cannot wrap:
    :meth:`check_no_wrap` verifies that up front.

    Attributes:
        scale: encoding steps per unit, > 0 (resolution 1/scale).
        bits: ring size exponent, 2 <= bits <= 64 (the modulus is 2^bits).
    """

    scale: float
    bits: int

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, numbers.Real):
            raise ValueError(f"scale must be a real number > 0, got {self.scale!r}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be finite and > 0, got {self.scale!r}")
        _check_int("bits", self.bits, 2, 64)

    @property
    def modulus(self) -> int:
        """2^bits."""
        return 1 << self.bits

    def _max_int(self) -> int:
        # Largest |integer| one encoding may hold: the signed range, and float64's exact
        # integers (so the stochastic rounding of x * scale is exact).
        return min((1 << (self.bits - 1)) - 1, 1 << 53)

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Encode x as uint64 residues mod 2^bits.

        Args:
            x: finite real array (any shape).
            rng: randomness of the stochastic rounding.

        Returns:
            uint64 array shaped like x, each entry in [0, 2^bits).

        Raises:
            ValueError: non-finite x, or ``|x| * scale`` beyond the signed range of bits
                (or beyond 2^53).
        """
        y = np.asarray(x, dtype=np.float64)
        if not np.isfinite(y).all():
            bad = np.flatnonzero(~np.isfinite(y.reshape(-1)))[0]
            raise ValueError(f"x must be finite, got {y.reshape(-1)[bad]!r} at flat index {bad}")
        y = y * self.scale
        lim = self._max_int()
        if y.size and np.abs(y).max() > lim:
            raise ValueError(
                f"|x| * scale must be <= {lim} to fit {self.bits} bits, got "
                f"{float(np.abs(y).max())!r} (scale {self.scale})"
            )
        low = np.floor(y)
        v = (low + (rng.random(y.shape) < (y - low))).astype(np.int64)
        return v.view(np.uint64) & Ring(bits=self.bits).mask

    def decode(self, sum_mod: np.ndarray, count: int) -> np.ndarray:
        """Decode a sum of ``count`` encodings: centered residue divided by scale.

        The residue r = sum_mod mod 2^bits is read as r - 2^bits when r >= 2^(bits-1).
        Sums may be taken in uint64 (which wraps mod 2^64, a multiple of 2^bits).

        Args:
            sum_mod: integer array, the (modular) sum of the encodings.
            count: how many encodings were summed (>= 1). The result is their sum, not
                their mean; it is within ``count / scale`` of the sum of the values.

        Returns:
            float64 array shaped like sum_mod.
        """
        _check_int("count", count, 1)
        a = np.asarray(sum_mod)
        if a.dtype.kind not in "iu":
            raise ValueError(f"sum_mod must be an integer array, got dtype {a.dtype}")
        return Ring(bits=self.bits).to_signed(a).astype(np.float64) / self.scale

    def check_no_wrap(self, max_abs_value: float, cohort_size: int) -> int:
        """Raise unless a cohort's sum of encodings of ``|x| <= max_abs_value`` fits.

        Needs ``value_bits + ceil(log2(cohort_size)) + 1 <= bits`` where value_bits is
        the bit length of ``ceil(max_abs_value * scale)`` (the largest rounded magnitude)
        and the 1 is the sign: then ``|sum| < 2^(bits-1)`` and centered decoding is exact.

        Args:
            max_abs_value: bound on every coordinate's |x| (after clipping and noise).
            cohort_size: number of encodings summed, >= 1.

        Returns:
            The number of bits needed (<= bits).

        Raises:
            ValueError: naming the value bits, cohort bits and bits when they do not fit.
        """
        if isinstance(max_abs_value, bool) or not isinstance(max_abs_value, numbers.Real):
            raise ValueError(f"max_abs_value must be a real number >= 0, got {max_abs_value!r}")
        if not (math.isfinite(max_abs_value) and max_abs_value >= 0):
            raise ValueError(f"max_abs_value must be finite and >= 0, got {max_abs_value!r}")
        cohort = _check_int("cohort_size", cohort_size, 1)
        max_int = math.ceil(max_abs_value * self.scale)
        if max_int > 1 << 53:
            raise ValueError(
                f"max_abs_value * scale = {max_abs_value * self.scale!r} exceeds "
                f"2^53, beyond exact float64 integers"
            )
        value_bits = max_int.bit_length()
        cohort_bits = (cohort - 1).bit_length()
        need = value_bits + cohort_bits + 1
        if need > self.bits:
            raise ValueError(
                f"fixed-point sum may wrap: |x| <= {max_abs_value} at scale {self.scale} "
                f"needs {value_bits} value bits, a cohort of {cohort} adds "
                f"ceil(log2({cohort})) = {cohort_bits}, plus 1 sign bit = {need} > "
                f"bits = {self.bits}; lower the scale or the clip bound, or raise bits"
            )
        return need
