"""Argument checks shared by the device SDK's pure modules (errors name the value and the
expectation, STYLE.md)."""

from __future__ import annotations

import numbers
import re

__all__ = ["NAME_PATTERN", "check_bytes", "check_device_id", "check_int"]

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""The one naming rule of fleets, devices and message kinds (the wire schema's ``Name``):
they appear in MQTT topics and ACLs, so they can never hold a wildcard or a separator (a
device named "+" would widen its ACL)."""


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


def check_device_id(name: str, value: object) -> str:
    """``value`` if it is a valid device (or fleet, or kind) name, else ValueError: 1 to 64
    characters of ``[A-Za-z0-9_.-]`` (:data:`NAME_PATTERN`, the wire schema's ``Name``)."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise ValueError(f"{name} must be 1-64 characters of [A-Za-z0-9_.-], got {value!r}")
    return value
