"""Benchmark 5: bytes per upload for each compression setting vs a float32 FedAvg upload.

Sizes are exact (real encoded messages, not a formula): payload, then the signed
``masked_part`` framing and the MQTT v5 PUBLISH header (``wire.upload_sizes``). The
reference row is the dense float32 update of the same model in the same run.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from edge_sdk import compress
from edge_sdk.model import build_spec
from edge_sdk.wire import upload_sizes

# (label, kept fraction p, QSGD levels s; 0 = float32 values)
SETTINGS = [
    ("float32 FedAvg (reference)", 1.0, 0),
    ("QSGD s=127 (8-bit)", 1.0, 127),
    ("QSGD s=7 (4-bit)", 1.0, 7),
    ("QSGD s=1 (2-bit)", 1.0, 1),
    ("rand-k p=0.1, float32", 0.1, 0),
    ("rand-k p=0.05, float32", 0.05, 0),
    ("rand-k p=0.05, 8-bit (Fed-SPA)", 0.05, 127),
    ("rand-k p=0.01, 8-bit", 0.01, 127),
]


def upload_bytes(values: np.ndarray, levels: int, rng: np.random.Generator) -> tuple[int, int]:
    """(payload bytes, total bytes on the wire) of one upload of ``values``."""
    if levels:
        payload = compress.pack_quantized(compress.quantize(values, levels, rng))
    else:
        payload = values.astype("<f4").tobytes()
    size, framing = upload_sizes(len(payload), 8, fleet="fleet", device="d0")
    return size, size + framing


def run_wire_bench(*, arch: str = "cnn", out=sys.stdout) -> list[dict[str, Any]]:
    """Print and return one row per setting for the Fed-SPA CNN (or ``arch``) update."""
    spec = build_spec(arch, (1, 28, 28), 10)
    d = spec.num_params
    rng = np.random.default_rng(0)
    update = rng.standard_normal(d).astype(np.float32) * 1e-2
    rows = []
    print(f"# bytes per upload, {arch} (d = {d}), vs float32 FedAvg in the same run", file=out)
    print("| setting | k | payload B | on the wire B | bound B | x smaller |", file=out)
    print("|---|---|---|---|---|---|", file=out)
    ref_wire = None
    for label, p, s in SETTINGS:
        k = d if p == 1.0 else compress.kept_count(d, p)
        values = update[:k]
        payload, wire = upload_bytes(values, s, rng)
        if ref_wire is None:
            ref_wire = wire
        bound = compress.packed_size(k, s) if s else 4 * k
        row = {"setting": label, "p": p, "levels": s, "k": k, "payload_bytes": payload,
               "wire_bytes": wire, "payload_bound_bytes": bound,
               "ratio_vs_float32": ref_wire / wire}
        rows.append(row)
        print(f"| {label} | {k} | {payload} | {wire} | {bound} | {ref_wire / wire:.1f}x |",
              file=out)
    return rows
