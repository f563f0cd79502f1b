"""Benchmark 1b: what each stack costs before it computes anything — import time and size.

Two stacks, as a user would install them:

* the **device stack**: fedge's runtime dependencies (numpy, onnxruntime, paho-mqtt,
  cryptography, msgpack) and everything they require, plus fedge's own device code
  (``edge_sdk/`` and the exported CNN in ``models/onnx``);
* the **torch + Opacus stack**: torch and opacus and everything they require.

Installed size: the on-disk size of every file the installed distributions list in their
``RECORD`` (``importlib.metadata``), over the closure of their ``Requires-Dist`` (markers
evaluated for this interpreter, no extras). A distribution both stacks need (numpy) is
counted in both. Import time: ``time.perf_counter`` around the import statements in a
fresh interpreter (interpreter start-up excluded), with single-threaded thread pools;
repetitions are interleaved, and the peak RSS after the imports is reported beside it.

Both stacks import from bytecode, as installed: torch and Opacus from the ``.pyc`` files
their wheels installed, the device stack from a private bytecode cache (a temporary
``PYTHONPYCACHEPREFIX``) that one untimed import fills first. Without it, an environment
with ``PYTHONDONTWRITEBYTECODE`` (or a read-only checkout) compiles fedge's source on every
import, a cost no installed device pays and one that grows with the source, not the code run.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tools.bench.client import REPO

__all__ = ["DEVICE_ROOTS", "TORCH_ROOTS", "closure", "installed_size", "run_stacks_bench"]

DEVICE_ROOTS = ("numpy", "onnxruntime", "paho-mqtt", "cryptography", "msgpack")
TORCH_ROOTS = ("torch", "opacus")
# fedge's own files a device carries (the package's other parts are aggregator/tools).
DEVICE_CODE = ("edge_sdk", "models/onnx/cnn-1x28x28-10.*")

IMPORTS = {
    "device": "import numpy, onnxruntime, msgpack, paho.mqtt.client; "
              "import cryptography.hazmat.primitives.asymmetric.x25519, "
              "cryptography.hazmat.primitives.ciphers.aead; "
              "import edge_sdk.engine, edge_sdk.train, edge_sdk.secagg, edge_sdk.compress",
    "torch": "import torch, opacus; from opacus import GradSampleModule; "
             "from opacus.optimizers import DPOptimizer",
}

_CHILD = r'''
import json, resource, sys, time
t = time.perf_counter()
exec(sys.argv[1])
dt = time.perf_counter() - t
from tools.bench.rss import peak_rss_mib
print(json.dumps({"s": dt, "rss_mib": peak_rss_mib()}))
'''


def closure(roots: tuple[str, ...] | list[str]) -> list[str]:
    """Installed distributions ``roots`` need: themselves and their requirements, recursively.

    Requirements are followed when their marker holds here with no extra; a requirement
    that is not installed is skipped (it cannot take space on this disk).
    """
    env = default_environment()
    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[name] = dist.metadata["Name"]
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                todo.append(req.name)
    return sorted(seen.values(), key=str.lower)


def installed_size(name: str) -> int:
    """Bytes on disk of the files one installed distribution lists in its RECORD."""
    dist = md.distribution(name)
    total = 0
    for f in dist.files or []:
        p = Path(str(dist.locate_file(f)))
        if p.is_file():
            total += p.stat().st_size
    return total


def _tree_size(pattern: str) -> int:
    """Bytes of the files under REPO matching ``pattern`` (directories recursively)."""
    total = 0
    for p in REPO.glob(pattern):
        files = [p] if p.is_file() else p.rglob("*")
        total += sum(f.stat().st_size for f in files
                     if f.is_file() and "__pycache__" not in f.parts)
    return total


def _import_child(stack: str, pycache: str | None = None) -> dict[str, float]:
    """One fresh interpreter's import time and RSS; ``pycache``: its bytecode cache directory
    (written and read there; None: the environment's own setting)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    out = subprocess.run([sys.executable, "-c", _CHILD, IMPORTS[stack]], check=True,
                         capture_output=True, text=True, env=env, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def run_stacks_bench(*, quick: bool = False, reps: int | None = None,
                     out: TextIO = sys.stdout) -> dict[str, Any]:
    """Measure both stacks; print two tables; return sizes, distributions and import times.

    Returns ``device_bytes``, ``torch_bytes``, ``size_ratio`` (device / torch);
    ``device_dists`` and ``torch_dists`` (name -> bytes); ``device_code_bytes``;
    ``import`` (per stack: median/min/max seconds and peak RSS MiB) and ``import_ratio``.
    """
    reps = reps or (3 if quick else 7)
    dev = {n: installed_size(n) for n in closure(DEVICE_ROOTS)}
    ref = {n: installed_size(n) for n in closure(TORCH_ROOTS)}
    code = sum(_tree_size(r) for r in DEVICE_CODE)
    dev_total, ref_total = sum(dev.values()) + code, sum(ref.values())
    versions = {n: md.version(n) for n in (*dev, *ref)}
    print("# installed size on disk (RECORD files of each distribution and its "
          "requirements); torch + Opacus is the reference", file=out)
    print("| stack | distributions | MiB | ratio to torch + Opacus |", file=out)
    print("|---|---|---|---|", file=out)

    def listing(d: dict[str, int]) -> str:
        return ", ".join(f"{n} {versions[n]} ({_mib(b)})"
                         for n, b in sorted(d.items(), key=lambda kv: -kv[1]))

    print(f"| device (fedge) | {listing(dev)}, fedge device code ({_mib(code)}) "
          f"| {_mib(dev_total)} | {dev_total / ref_total:.3f} |", file=out)
    print(f"| torch + Opacus (reference) | {listing(ref)} | {_mib(ref_total)} | 1 |", file=out)
    print("", file=out)

    res: dict[str, list[dict[str, float]]] = {"device": [], "torch": []}
    with tempfile.TemporaryDirectory(prefix="fedge-bench-pyc-") as pycache:
        cache = {"device": pycache, "torch": None}  # torch: its wheels' installed .pyc
        _import_child("device", pycache)  # untimed: compiles the device stack into the cache
        for _ in range(reps):
            for stack in res:
                res[stack].append(_import_child(stack, cache[stack]))
    imports: dict[str, dict[str, float]] = {}
    for stack, rs in res.items():
        s = [r["s"] for r in rs]
        imports[stack] = {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s),
                          "rss_mib": max(r["rss_mib"] for r in rs)}
    ratio = imports["device"]["median_s"] / imports["torch"]["median_s"]
    print(f"# import time in a fresh interpreter, median (min-max) of {reps}, from bytecode "
          "(the device stack's compiled by one untimed import first); torch + Opacus is the "
          "reference", file=out)
    print("| stack | statement | import s | ratio | RSS after import MiB |", file=out)
    print("|---|---|---|---|---|", file=out)
    for stack, label in (("device", "device (fedge)"), ("torch", "torch + Opacus (reference)")):
        i = imports[stack]
        print(f"| {label} | `{IMPORTS[stack]}` | {i['median_s']:.3f} ({i['min_s']:.3f}-"
              f"{i['max_s']:.3f}) | {i['median_s'] / imports['torch']['median_s']:.2f} "
              f"| {i['rss_mib']:.0f} |", file=out)
    return {
        "device_bytes": dev_total, "torch_bytes": ref_total,
        "size_ratio": dev_total / ref_total,
        "device_dists": dev, "torch_dists": ref, "device_code_bytes": code,
        "versions": versions, "import": imports, "import_ratio": ratio, "reps": reps,
        "import_from_bytecode": True,
    }
