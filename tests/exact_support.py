"""Exact small-case distributions for the privacy tests: what an attacker's worst case is
computed from (tests/test_device_dp.py, tests/test_self_sampled.py)."""

from __future__ import annotations

import numpy as np


def log_pmf_sum(sigma: float, n: int, half: int) -> np.ndarray:
    """log pmf of the sum of n discrete Gaussians N_Z(0, sigma^2), each truncated to
    [-half, half] (mass beyond it per share is below exp(-half^2 / (2 sigma^2))), on
    [-n half, n half]; -inf where the pmf underflows to 0."""
    z = np.arange(-half, half + 1, dtype=np.float64)
    p = np.exp(-(z * z) / (2 * sigma * sigma))
    p /= p.sum()
    out = p
    for _ in range(n - 1):
        out = np.convolve(out, p)
    with np.errstate(divide="ignore"):
        return np.log(out)
