"""Fingerprints the simulators' JSON summaries share, so that the fast simulator, the
in-process fleet and the MQTT fleet can be compared bit for bit (issue 15).

Both are SHA-256 hex digests of a canonical byte form, independent of the array's dtype and
memory layout: a model is hashed as its float32 values, a secure sum as its integer values."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["model_sha256", "sum_sha256"]


def model_sha256(params: Sequence[np.ndarray]) -> str:
    """SHA-256 (hex) of the model's parameter arrays in order, each as little-endian float32
    in C order: the fingerprint two runs must share to have produced the same model."""
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p, dtype="<f4").tobytes())
    return h.hexdigest()


def sum_sha256(total: np.ndarray) -> str:
    """SHA-256 (hex) of a round's integer sum (residues mod 2^bits), each value as a
    little-endian uint64: it changes when the values do, never when only the dtype does."""
    values = np.asarray(total)
    if values.dtype.kind not in "ui":
        raise TypeError(f"sum_sha256 hashes integer residues, got dtype {values.dtype}")
    if values.dtype.kind == "i" and values.size and int(values.min()) < 0:
        raise ValueError(f"sum_sha256 hashes residues >= 0, got minimum {int(values.min())}")
    return hashlib.sha256(np.ascontiguousarray(values, dtype="<u8").tobytes()).hexdigest()
