"""Argument checks shared by the device SDK's pure modules (errors name the value and the
expectation, STYLE.md)."""

from __future__ import annotations

import numbers

__all__ = ["check_int"]


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    """``int(value)`` if it is an integer (not a bool) in ``[lo, hi]`` (``hi`` None: no top)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}, got {v}")
    return v
