"""The model's layout for a server half: its parameter shapes, and a flat delta put back
into them (shared by the mechanisms whose server state is only the layout)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["Layout", "layout_of", "shaped"]

Layout = tuple[tuple[int, ...], ...]  # the model's parameter shapes, graph order


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
