"""Benchmark 1: the client's clipped, noised DP-SGD step — fedge (onnxruntime + numpy) vs
Opacus (torch) doing the same step, each in a fresh process, in the same run.

Each measurement runs in its own subprocess so that peak RSS (VmHWM) is that of one
stack alone, and thread pools are set before any work. Both sides step the same model on
the same synthetic batch with per-sample clipping to C = 1 and noise multiplier 1. fedge
draws its noise as a device does (``edge_sdk.csprng.SecureRng``: ChaCha20 keyed from the
OS, each value a sum of four Gaussians); Opacus runs without ``secure_mode``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# (arch, input shape, classes): the zoo models at their Fashion-MNIST shapes.
MODELS = {"logreg": ((1, 28, 28), 10), "mlp": ((1, 28, 28), 10), "cnn": ((1, 28, 28), 10),
          # issue 17's example models (docs/examples.md)
          "dscnn-har": ((3, 128), 6), "dscnn-kws": ((1, 49, 10), 8)}

_CHILD = r'''
import json, os, resource, sys, time
from tools.bench.rss import peak_rss_mib
impl, arch = sys.argv[1], sys.argv[2]
batch, threads, steps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
shape, classes = json.loads(sys.argv[6])
import numpy as np
rng = np.random.default_rng(0)
x = rng.standard_normal((batch, *shape)).astype(np.float32)
y = rng.integers(0, classes, batch)
from edge_sdk.model import build_spec, init_params
spec = build_spec(arch, tuple(shape), classes)
params = init_params(spec, rng)
clip, z, lr = 1.0, 1.0, 0.05
if impl == "fedge":
    from edge_sdk.engine import load_engine
    from edge_sdk.csprng import SecureRng
    from edge_sdk.train import dp_sgd_step
    from models import manifest_path
    engine = load_engine(manifest_path(arch, tuple(shape), classes), threads=threads)
    noise_rng = SecureRng()  # the device's sampler (ChaCha20 keyed from the OS, 4-sum)
    def draw():
        return [noise_rng.normal(0.0, z * clip, size=p.shape).astype(np.float32)
                for p in params]
    def step():  # as local_round: the draw overlaps the graph when threads >= 2
        dp_sgd_step(engine, params, x, y, clip=clip, noise=draw, lr=lr, denom=batch)
else:
    import torch
    torch.set_num_threads(threads)
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    from models.zoo import build_module
    module = GradSampleModule(build_module(spec, params), loss_reduction="mean")
    opt = DPOptimizer(torch.optim.SGD(module.parameters(), lr=lr), noise_multiplier=z,
                      max_grad_norm=clip, expected_batch_size=batch, loss_reduction="mean")
    xt, yt = torch.tensor(x), torch.tensor(y)
    loss_fn = torch.nn.CrossEntropyLoss()
    def step():
        opt.zero_grad()
        loss_fn(module(xt), yt).backward()
        opt.step()
for _ in range(5):
    step()
t = time.perf_counter()
for _ in range(steps):
    step()
dt = time.perf_counter() - t
res = {"samples_per_s": steps * batch / dt,
       "peak_rss_mib": peak_rss_mib()}
if impl == "fedge":  # where a step's time goes, after the timed loop (issue 18)
    def timed(fn):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        return 1e3 * (time.perf_counter() - t0) / steps
    res["noise_ms"] = timed(draw)
    res["graph_ms"] = timed(lambda: engine.clipped_grad_sum(params, x, y, clip))
    res["step_ms"] = 1e3 * dt / steps
print(json.dumps(res))
'''


def _run_child(impl: str, arch: str, batch: int, threads: int, steps: int) -> dict[str, float]:
    shape, classes = MODELS[arch]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, impl, arch, str(batch), str(threads), str(steps),
         json.dumps([list(shape), classes])],
        check=True, capture_output=True, text=True, env=env, cwd=REPO,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> str:
    """One line describing this machine, for the report."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def run_client_bench(
    *, quick: bool = False, models: list[str] | None = None, batches: list[int] | None = None,
    threads: list[int] | None = None, reps: int | None = None, out=sys.stdout,
) -> list[dict[str, Any]]:
    """Run the fedge-vs-Opacus client-step benchmark; print a table; return the rows.

    Each row: model, batch, threads, median (and min, max) samples/s of each side over
    ``reps`` fresh processes, their ratio, the peak RSS (MiB) of each side's process, and
    the FLOP floor: the step's matmul FLOPs per sample (forward + backward,
    :func:`tools.bench.floors.step_flops`) over this machine's sgemm rate at that thread
    count (numpy float32 matmul, best of 7), and fedge's fraction of it.
    """
    from edge_sdk.model import build_spec
    from tools.bench.floors import sgemm_gflops, step_flops

    models = models or list(MODELS)
    batches = batches or ([32, 64] if quick else [10, 32, 64])
    # --quick: two threads at batch 32 only (issue 18: two threads faster than one, on
    # every model), one thread at both batches
    threads = threads or [1, 2]
    def wanted(b: int, t: int) -> bool:
        return not quick or t == 1 or b == 32
    reps = reps or (2 if quick else 5)
    sgemm = {t: sgemm_gflops(t) for t in threads}
    print(f"# client DP-SGD step (clip C=1, noise z=1), fedge vs Opacus (reference), "
          f"samples/s median (min-max) of {reps} fresh processes each, interleaved; peak "
          f"RSS = max ru_maxrss; FLOP floor = matmul FLOPs per sample (forward + backward) "
          f"over numpy float32 sgemm at that thread count ("
          + ", ".join(f"{t} thread(s): {g['gflops']:.1f} GFLOP/s best, "
                      f"{g['gflops_median']:.1f} median" for t, g in sgemm.items())
          + f"); {machine()}", file=out)
    print("| model | batch | threads | fedge samples/s | opacus samples/s | ratio "
          "| fedge RSS MiB | opacus RSS MiB | RSS ratio | MFLOP/sample | FLOP floor samples/s "
          "| fedge % of floor |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    rows = []
    for arch in models:
        shape, classes = MODELS[arch]
        spec = build_spec(arch, shape, classes)
        flops = step_flops(spec)
        dim = sum(math.prod(s) for _, s in spec.param_shapes())
        steps = 40 if arch == "cnn" else 200
        for b in batches:
            for t in threads:
                if not wanted(b, t):
                    continue
                res: dict[str, list[dict[str, float]]] = {"fedge": [], "opacus": []}
                for _ in range(reps):  # interleaved so machine noise hits both sides alike
                    for impl in ("fedge", "opacus"):
                        res[impl].append(_run_child(impl, arch, b, t, steps))
                f = [r["samples_per_s"] for r in res["fedge"]]
                o = [r["samples_per_s"] for r in res["opacus"]]
                floor = sgemm[t]["gflops"] * 1e9 / flops
                row = {
                    "model": arch, "batch": b, "threads": t,
                    "fedge_samples_per_s": statistics.median(f),
                    "opacus_samples_per_s": statistics.median(o),
                    "fedge_samples_per_s_min": min(f), "fedge_samples_per_s_max": max(f),
                    "opacus_samples_per_s_min": min(o), "opacus_samples_per_s_max": max(o),
                    "fedge_peak_rss_mib": max(r["peak_rss_mib"] for r in res["fedge"]),
                    "opacus_peak_rss_mib": max(r["peak_rss_mib"] for r in res["opacus"]),
                    "reps": reps, "flops_per_sample": flops,
                    "sgemm_gflops": sgemm[t]["gflops"], "flop_floor_samples_per_s": floor,
                }
                row["speed_ratio"] = row["fedge_samples_per_s"] / row["opacus_samples_per_s"]
                # where fedge's step goes (medians over its processes, timed after the loop):
                # the device's hardened noise, the per-sample-gradient graph, the rest
                noise = statistics.median(r["noise_ms"] for r in res["fedge"])
                graph = statistics.median(r["graph_ms"] for r in res["fedge"])
                step_ms = statistics.median(r["step_ms"] for r in res["fedge"])
                if t >= 2:  # the draw runs on a second thread while the graph runs
                    split = (f"per step {step_ms:.2f} ms: noise {noise:.2f} ms ({dim:,} "
                             f"hardened Gaussians) on a second thread while the "
                             f"per-sample-gradient graph runs, {graph:.2f} ms, the rest "
                             f"{max(step_ms - max(noise, graph), 0.0):.2f} ms")
                else:
                    split = (f"per step {step_ms:.2f} ms: noise {noise:.2f} ms "
                             f"({noise / step_ms:.0%}: {dim:,} hardened Gaussians), "
                             f"per-sample-gradient graph "
                             f"{graph:.2f} ms ({graph / step_ms:.0%}), the rest "
                             f"{max(step_ms - noise - graph, 0.0):.2f} ms")
                row.update(fedge_noise_ms=noise, fedge_graph_ms=graph, fedge_step_ms=step_ms,
                           time_split=split)
                row["rss_ratio"] = row["fedge_peak_rss_mib"] / row["opacus_peak_rss_mib"]
                row["fedge_fraction_of_floor"] = row["fedge_samples_per_s"] / floor
                rows.append(row)
                print(f"| {arch} | {b} | {t} | {row['fedge_samples_per_s']:.0f} "
                      f"({min(f):.0f}-{max(f):.0f}) | {row['opacus_samples_per_s']:.0f} "
                      f"({min(o):.0f}-{max(o):.0f}) | {row['speed_ratio']:.2f}x "
                      f"| {row['fedge_peak_rss_mib']:.0f} | {row['opacus_peak_rss_mib']:.0f} "
                      f"| {row['rss_ratio']:.2f} | {flops / 1e6:.3f} | {floor:.0f} "
                      f"| {100 * row['fedge_fraction_of_floor']:.1f}% |", file=out, flush=True)
    one = {(r["model"], r["batch"]): r["fedge_samples_per_s"] for r in rows if r["threads"] == 1}
    for r in rows:  # issue 18: two threads faster than one, on every model
        if r["threads"] == 2 and (r["model"], r["batch"]) in one:
            r["threads_2_over_1"] = r["fedge_samples_per_s"] / one[(r["model"], r["batch"])]
    return rows
