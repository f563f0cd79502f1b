"""Physical floors the benchmarks are set beside: matmul FLOPs, sgemm rate, memory bandwidth.

* :func:`step_flops` counts the multiply-adds of one sample's forward and backward pass
  through a model (conv and linear layers only: pooling, norms, activations, the loss,
  clipping and the noise are not counted), as 2 FLOPs each. The backward pass is the weight gradient
  (as many multiply-adds as the forward) plus the input gradient of every layer but the
  first. Per-sample weight gradients, which DP-SGD needs, cost no more multiply-adds than
  the batch's summed gradient; they only cost memory traffic.
* :func:`sgemm_gflops` is this machine's float32 matmul rate at a given thread count,
  measured with numpy (its bundled BLAS) in a fresh process whose thread pools are set
  before numpy loads. The best of several timings is the rate: the floor is the best the
  machine can do.
* :func:`add_seconds` is the time of one in-place uint64 vector addition of d words (the
  aggregator's running sum of masked inputs): memory bandwidth at that size.
* :func:`keystream_pass` is one pass of the ChaCha20 keystream floor of secure aggregation's
  masks: ``count`` streams (fresh keys, the cipher's key setup included) of ``nbytes`` each,
  written ``chunk`` bytes at a time into one reused buffer, streams inner, with nothing
  else done to the words: what ``cryptography``'s ChaCha20 (OpenSSL) gives at best for
  those bytes on this machine. The chunk matters: a stream written whole spills the caches
  once it outgrows them, and a small chunk pays the call overhead more often, so
  a floor is the best time over the chunks of :func:`keystream_chunks`, each timed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from edge_sdk.model import Conv1d, Conv2d, Linear, ModelSpec

__all__ = [
    "KEYSTREAM_CHUNKS",
    "add_seconds",
    "keystream_chunks",
    "keystream_pass",
    "sgemm_gflops",
    "step_flops",
]


def step_flops(spec: ModelSpec) -> int:
    """Matmul FLOPs of one sample's forward + backward pass (see the module docstring)."""
    total_macs = 0
    first = True
    for layer, out in zip(spec.layers, spec.layer_shapes(), strict=True):
        if isinstance(layer, Linear):
            macs = layer.in_features * layer.out_features
        elif isinstance(layer, Conv2d | Conv1d):
            taps = layer.kernel ** (2 if isinstance(layer, Conv2d) else 1)
            macs = math.prod(out[1:]) * layer.out_channels * layer.in_channels * taps
        else:  # pooling, norms, activations, Flatten: not matmuls
            continue
        # forward + weight gradient, + input gradient except for the first layer
        total_macs += macs * (2 if first else 3)
        first = False
    return 2 * total_macs


_SGEMM_CHILD = r'''
import json, sys, time
import numpy as np
n, reps = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
a = rng.standard_normal((n, n), dtype=np.float32)
b = rng.standard_normal((n, n), dtype=np.float32)
c = np.empty((n, n), dtype=np.float32)
np.matmul(a, b, out=c)
rates = []
for _ in range(reps):
    t = time.perf_counter()
    np.matmul(a, b, out=c)
    rates.append(2 * n ** 3 / (time.perf_counter() - t) / 1e9)
print(json.dumps(rates))
'''


def sgemm_gflops(threads: int = 1, *, n: int = 1024, reps: int = 7) -> dict[str, Any]:
    """float32 n x n x n matmul rate (GFLOP/s) in a fresh process at ``threads`` threads.

    Returns ``{"gflops": best, "gflops_median": ..., "gflops_min": ..., "n", "threads",
    "reps"}``.
    """
    t = str(threads)
    env = dict(os.environ, OMP_NUM_THREADS=t, OPENBLAS_NUM_THREADS=t, MKL_NUM_THREADS=t)
    out = subprocess.run([sys.executable, "-c", _SGEMM_CHILD, str(n), str(reps)], check=True,
                         capture_output=True, text=True, env=env)
    rates = sorted(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"gflops": rates[-1], "gflops_median": rates[len(rates) // 2],
            "gflops_min": rates[0], "n": n, "threads": threads, "reps": reps}


def add_seconds(dim: int, *, reps: int = 20) -> float:
    """Best time of ``np.add(acc, x, out=acc)`` on two uint64 vectors of ``dim`` words."""
    rng = np.random.default_rng(0)
    acc = rng.integers(0, 1 << 32, size=dim, dtype=np.uint64)
    x = rng.integers(0, 1 << 32, size=dim, dtype=np.uint64)
    np.add(acc, x, out=acc)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.add(acc, x, out=acc)
        best = min(best, time.perf_counter() - t)
    return best


KEYSTREAM_CHUNKS = (1 << 15, 1 << 16, 1 << 17, 1 << 18, 1 << 19)
"""Chunk sizes (bytes) :func:`keystream_chunk` tries: 32 KiB to 512 KiB."""


def keystream_pass(count: int, nbytes: int, chunk: int) -> Callable[[], None]:
    """One pass of the keystream floor (module docstring), as a function to time.

    Each call makes ``count`` ChaCha20 encryptors under fresh keys and reads ``nbytes`` of
    keystream from each, ``min(chunk, nbytes)`` bytes per call into one buffer, streams
    inner; the words are never looked at (a floor for whatever is done with them).
    """
    if count < 0 or nbytes < 0 or chunk < 1:
        raise ValueError(f"need count, nbytes >= 0 and chunk >= 1, got {count}, {nbytes}, {chunk}")
    keys = [os.urandom(32) for _ in range(count)]
    step = max(1, min(chunk, nbytes))
    buf = memoryview(bytearray(step))
    zeros = memoryview(bytes(step))
    nonce = bytes(16)

    def run() -> None:
        fills = [Cipher(algorithms.ChaCha20(k, nonce), mode=None).encryptor().update_into
                 for k in keys]
        for lo in range(0, nbytes, step):
            z, b = (zeros, buf) if nbytes - lo >= step else (zeros[: nbytes - lo], buf)
            for fill in fills:
                fill(z, b)

    return run


def keystream_chunks(nbytes: int) -> list[int]:
    """The chunks (bytes) of :data:`KEYSTREAM_CHUNKS` worth timing for streams of ``nbytes``:
    each capped at nbytes, so a short stream is also tried whole."""
    return sorted({min(c, max(1, nbytes)) for c in KEYSTREAM_CHUNKS})
