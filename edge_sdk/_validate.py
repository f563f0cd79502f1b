"""Argument checks shared by the device SDK's pure modules (errors name the value and the
expectation, STYLE.md)."""

from __future__ import annotations

import numbers

__all__ = ["check_bytes", "check_device_id", "check_int", "device_id_problem"]

MAX_ID_BYTES = 128
"""Longest device id, in UTF-8 bytes (the secure-aggregation identities' rule)."""


def check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    """``int(value)`` if it is an integer (not a bool) in ``[lo, hi]`` (``hi`` None: no top)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}, got {v}")
    return v


def check_bytes(name: str, value: object, size: int) -> bytes:
    """``bytes(value)`` if it is bytes-like of exactly ``size`` bytes."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise ValueError(f"{name} must be {size} bytes, got {type(value).__name__}")
    b = bytes(value)
    if len(b) != size:
        raise ValueError(f"{name} must be {size} bytes, got {len(b)}")
    return b


def device_id_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a device id, or None: 1 to 128 UTF-8 bytes,
    printable, no NUL, ``/``, ``#`` or ``+`` (it names MQTT topics)."""
    if not isinstance(value, str):
        return f"must be a str, got {type(value).__name__}"
    n = len(value.encode("utf-8", "surrogatepass"))
    if not 1 <= n <= MAX_ID_BYTES:
        return f"must be 1 to {MAX_ID_BYTES} UTF-8 bytes, got {n}"
    if any(c in value for c in "\x00/#+") or not value.isprintable():
        return "must be printable with no NUL, '/', '#' or '+' (it names MQTT topics)"
    return None


def check_device_id(name: str, value: object) -> str:
    """``value`` if it is a valid device id (:func:`device_id_problem`), else ValueError."""
    problem = device_id_problem(value)
    if problem:
        raise ValueError(f"{name} {value!r} {problem}")
    return value  # type: ignore[return-value]
