"""What the real-valued mechanisms share: the model's layout for a server half (its
parameter shapes, and a flat delta put back into them) and, on the device, the encoding of
real values into the round's ring (optional QSGD, clamp, fixed point)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from edge_sdk import compress
from edge_sdk.fixedpoint import FixedPoint

__all__ = ["Layout", "LayoutServer", "encode_reals", "layout_of", "shaped"]

Layout = tuple[tuple[int, ...], ...]  # the model's parameter shapes, graph order


class LayoutServer:
    """Base of a server half whose state is the model's layout (every mechanism's today):
    :meth:`init` for a half whose round settings ``params`` state the model's ``dim``."""

    __slots__ = ()
    params: Any

    def init(self, params: Sequence[np.ndarray]) -> Layout:
        """The layout of the model ``params`` (graph order), which ``decode`` fills.

        Raises:
            ValueError: the model does not have the ``dim`` parameters of the round.
        """
        return layout_of(params, self.params.dim)

    def quantile(self, total: np.ndarray, survivors: int) -> float | None:
        """None: no adaptive clipping (device-dp's half overrides it)."""
        return None


def layout_of(params: Sequence[np.ndarray], dim: int) -> Layout:
    """The shapes of the model ``params`` (graph order).

    Raises:
        ValueError: the model does not have ``dim`` parameters.
    """
    shapes = tuple(tuple(int(n) for n in np.shape(p)) for p in params)
    if sum(math.prod(s) for s in shapes) != dim:
        raise ValueError(f"a model of shapes {shapes} does not have the round's "
                         f"{dim} parameters")
    return shapes


def shaped(kept: np.ndarray, dim: int, coords: np.ndarray | None,
           layout: Layout) -> list[np.ndarray]:
    """``kept`` (one value per coordinate of ``coords``, or all ``dim`` when None) scattered
    onto zeros of length ``dim`` and cut into float32 arrays of ``layout``."""
    dense = np.zeros(dim, dtype=np.float64)
    if coords is not None:
        dense[coords] = kept
    else:
        dense[:] = kept
    out, start = [], 0
    for shape in layout:
        n = math.prod(shape)
        out.append(dense[start : start + n].reshape(shape).astype(np.float32))
        start += n
    return out


def encode_reals(values: np.ndarray, *, quant_levels: int, value_bound: float,
                 fixed_point: FixedPoint, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """(Ring residues of ``values``, how many were clamped): QSGD at ``quant_levels`` (0:
    none), then clamping to [-value_bound, value_bound], then fixed-point stochastic
    rounding. Draws from ``rng`` in that order (QSGD, then the rounding), the order the
    fleet pins fix. Clamping is post-processing: it changes no privacy figure."""
    if quant_levels:
        values = compress.dequantize(compress.quantize(values, quant_levels, rng))
    clamped = int(np.count_nonzero(np.abs(values) > value_bound))
    values = np.clip(values, -value_bound, value_bound)
    return fixed_point.encode(values, rng), clamped
