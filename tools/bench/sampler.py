"""Benchmark: the device's Gaussian sampler against numpy's, at the zoo's parameter counts.

Gaussians per second of ``numpy.random.default_rng().normal`` (ziggurat, seeded: the
simulator's generator) and of :class:`edge_sdk.csprng.SecureRng` ``normal`` (ChaCha20
keystream, four polar draws per value: what a device's DP-SGD step draws), for one
parameter vector of the logreg, cnn and mlp models on 1x28x28 inputs (7,850 / 21,840 /
109,386 values). Each rate is the median over ``reps`` timed calls of one warmed-up
generator, timed by thread CPU time so that other processes on the machine inflate it
less than wall-clock time would.

Run: ``python -m tools.bench.sampler [reps]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from edge_sdk.csprng import SecureRng

__all__ = ["SIZES", "gaussians_per_second", "run_sampler_bench"]

SIZES = {"logreg": 7_850, "cnn": 21_840, "mlp": 109_386}
"""Parameter counts of the zoo models at (1, 28, 28) inputs, 10 classes."""


def gaussians_per_second(draw: Callable[[int], Any], n: int, reps: int) -> float:
    """Median rate (values/s) of ``draw(n)`` over ``reps`` calls after one warm-up call."""
    draw(n)
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        draw(n)
        times.append(time.thread_time() - t0)
    return n / max(statistics.median(times), 1e-9)


def run_sampler_bench(reps: int = 30, out=sys.stdout) -> list[dict[str, Any]]:
    """One row per model size: numpy's and SecureRng's rates (values/s) and their ratio."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    plain, secure = np.random.default_rng(), SecureRng()
    rows = []
    for model, n in SIZES.items():
        a = gaussians_per_second(lambda k: plain.normal(0.0, 1.0, size=k), n, reps)
        b = gaussians_per_second(lambda k: secure.normal(0.0, 1.0, size=k), n, reps)
        rows.append({"model": model, "n": n, "numpy_per_s": a, "secure_per_s": b,
                     "numpy_over_secure": a / b})
        print(f"{model:>7} n={n:>7}: numpy {a / 1e6:6.1f} M/s, SecureRng {b / 1e6:6.1f} M/s "
              f"({a / b:.2f}x slower)", file=out)
    return rows


if __name__ == "__main__":
    run_sampler_bench(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
