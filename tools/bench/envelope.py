"""Benchmark 6: the Pi-class envelope — one device's round on one core under 512 MiB.

Until the MQTT device agent exists this measures the device's in-process work of one
round, in a child process started as ``taskset -c 0 python ...`` (pinned to CPU 0) with
``RLIMIT_AS`` = 512 MiB set before exec (the same cap as ``ulimit -v 524288``: it bounds
virtual address space, a stricter cap than resident memory; no cgroup is used). The child
is the device and does only the device's work:

1. receives the round's config (msgpack, :meth:`RoundConfig.to_wire`),
2. runs the Fed-SPA CNN's local round (``edge_sdk.train.local_round``, onnxruntime engine,
   1 thread, tau = 20 Poisson-sampled steps at expected batch 32, C = 1, z = 1) on a
   synthetic local data set of 600 Fashion-MNIST-shaped samples,
3. clamps the update to +-1 and encodes it in fixed point (``compress.FixedPoint``,
   32 bits, scale 2^20),
4. runs its ``SecAggClient`` stages (advertise, share keys, mask input, unmask) against
   the aggregator and the nine other devices of a cohort of 10, which run in the parent
   process; every message crosses a pipe as msgpack bytes, so the bytes are exact.

The parent checks the round: the unmasked sum minus the nine other inputs must equal the
child's encoded update (compared by SHA-256). Key material comes from a seeded generator
(benchmark only). The child reports its peak RSS (``ru_maxrss``) and peak virtual size
(``VmPeak``), measured before the floors below are timed, the time of each stage, and the
bytes it sent and received. Beside them: the reference each is set against (the 512 MiB
cap; a dense float32 upload of the same update) and two floors measured in the same pinned
child afterwards — the local round's matmul FLOPs over the 1-thread sgemm rate, and the
ChaCha20 PRG expansion of the k + 1 masks the device adds.

The wheel check asks PyPI (``pip download --only-binary=:all: --platform P
--python-version 3.11 --no-deps``, P = manylinux2014_aarch64, then manylinux_2_28_aarch64)
for each distribution of the device stack at the version installed here.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any, BinaryIO, TextIO

import msgpack
import numpy as np

from aggregator.secure_sum import SecAggServer
from edge_sdk.model import build_spec
from edge_sdk.secagg import (
    AggregatorIdentity,
    DeviceIdentity,
    Registry,
    RoundConfig,
    SecAggClient,
    decode_message,
    encode_message,
)
from tools.bench.client import REPO

__all__ = ["MEMORY_CAP_MIB", "aarch64_wheels", "run_envelope_bench"]

MEMORY_CAP_MIB = 512
COHORT = 10
BITS = 32
SEED = 8

_CHILD = r'''
import hashlib, json, math, os, resource, struct, sys, time
t_start = time.perf_counter()
rfd, wfd, seed, cohort = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
import numpy as np
from edge_sdk.compress import FixedPoint
from edge_sdk.engine import load_engine
from edge_sdk.model import build_spec, init_params
from edge_sdk.secagg import (AggregatorIdentity, DeviceIdentity, Registry, RoundConfig,
                             SecAggClient, decode_message, encode_message, prg_expand)
from edge_sdk.train import LocalTraining, local_round
from models import manifest_path
import msgpack
import_s = time.perf_counter() - t_start
rin, wout = os.fdopen(rfd, "rb", buffering=0), os.fdopen(wfd, "wb", buffering=0)
sent, received = {}, {}
def recv(what):
    head = rin.read(4)
    n = struct.unpack(">I", head)[0]
    data = b""
    while len(data) < n:
        data += rin.read(n - len(data))
    received[what] = len(data)
    return data
def send(what, data):
    sent[what] = len(data)
    wout.write(struct.pack(">I", len(data)) + data)
def peak():
    vm = None
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmPeak:"):
                vm = int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, vm
rss_import = peak()[0]
# Enrollment happens before the round: regenerate the public registry (and our own key)
# from the shared seed, as the parent does.
rng = np.random.default_rng(seed)
ids = [f"d{i:02d}" for i in range(cohort)]
idents = [DeviceIdentity.generate(d, random_bytes=rng.bytes) for d in ids]
registry = Registry.of(AggregatorIdentity.generate(random_bytes=rng.bytes), idents)
me = idents[0]
del idents
stage = {}
t_round = time.perf_counter()
cfg = RoundConfig.from_wire(msgpack.unpackb(recv("config"), raw=False))
t = time.perf_counter()
spec = build_spec("cnn", (1, 28, 28), 10)
engine = load_engine(manifest_path("cnn", (1, 28, 28), 10), threads=1)
drng = np.random.default_rng([seed, 1])
x = drng.standard_normal((600, 1, 28, 28)).astype(np.float32)
y = drng.integers(0, 10, 600)
params = init_params(spec, drng)
stage["load_model_data"] = time.perf_counter() - t
train = LocalTraining(steps=20, batch_size=32, lr=0.05, clip=1.0, noise_multiplier=1.0)
t = time.perf_counter()
res = local_round(engine, params, x, y, train, drng)
stage["local_round"] = time.perf_counter() - t
t = time.perf_counter()
flat = np.concatenate([u.ravel() for u in res.update])
bound = 1.0
clamped = int(np.count_nonzero(np.abs(flat) > bound))
fp = FixedPoint(scale=2.0 ** 20, bits=cfg.bits)
fp.check_no_wrap(bound, len(cfg.cohort))
enc = fp.encode(np.clip(flat, -bound, bound), drng)
stage["fixed_point_encode"] = time.perf_counter() - t
client = SecAggClient(identity=me, registry=registry, config=cfg)
t = time.perf_counter(); msg = client.advertise(); stage["advertise"] = time.perf_counter() - t
send("advertise", encode_message(msg))
m = decode_message(recv("neighbour_keys"))
t = time.perf_counter(); msg = client.share_keys(m); stage["share_keys"] = time.perf_counter() - t
send("share_keys", encode_message(msg))
m = decode_message(recv("forwarded_shares"))
t = time.perf_counter(); msg = client.mask_input(m, enc)
stage["mask_input"] = time.perf_counter() - t
send("mask_input", encode_message(msg))
m = decode_message(recv("unmask_request"))
t = time.perf_counter(); msg = client.unmask(m); stage["unmask"] = time.perf_counter() - t
send("unmask", encode_message(msg))
round_wall = time.perf_counter() - t_round
rss, vm = peak()
# Floors, after the peaks above were read.
n = 512
a = drng.standard_normal((n, n), dtype=np.float32); b = a.T.copy(); c = np.empty_like(a)
np.matmul(a, b, out=c)
best = math.inf
for _ in range(7):
    t = time.perf_counter(); np.matmul(a, b, out=c); best = min(best, time.perf_counter() - t)
gflops = 2 * n ** 3 / best / 1e9
buf = np.empty(cfg.length, dtype=np.uint64)
seeds = [bytes([i]) * 32 for i in range(cfg.degree + 1)]
best = math.inf
for _ in range(5):
    t = time.perf_counter()
    for s in seeds:
        prg_expand(s, cfg.length, out=buf)
    best = min(best, time.perf_counter() - t)
print(json.dumps({
    "import_s": import_s, "stage_s": stage, "round_wall_s": round_wall,
    "device_compute_s": sum(stage.values()), "peak_rss_mib": rss,
    "rss_after_import_mib": rss_import,
    "vm_peak_mib": vm, "bytes_sent": sent, "bytes_received": received,
    "input_sha256": hashlib.sha256(enc.astype("<u8").tobytes()).hexdigest(),
    "dim": int(flat.size), "clamped_values": clamped, "mean_loss": res.mean_loss,
    "sgemm_gflops_pinned": gflops, "prg_floor_s": best, "masks": len(seeds),
    "affinity": sorted(os.sched_getaffinity(0)),
    "rlimit_as_mib": resource.getrlimit(resource.RLIMIT_AS)[0] / 2**20,
}))
'''


def _send(w: BinaryIO, data: bytes) -> int:
    w.write(struct.pack(">I", len(data)) + data)
    w.flush()
    return len(data)


def _recv(r: BinaryIO) -> bytes:
    head = r.read(4)
    if len(head) < 4:
        raise EOFError("the device process closed its pipe")
    (n,) = struct.unpack(">I", head)
    data = r.read(n)
    while len(data) < n:
        more = r.read(n - len(data))
        if not more:
            raise EOFError("the device process closed its pipe mid-message")
        data += more
    return data


def _cap(limit_bytes: int) -> Any:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return apply


def run_device_round(*, cap_mib: int = MEMORY_CAP_MIB, cpu: int = 0, seed: int = SEED,
                     timeout_s: float = 300.0) -> dict[str, Any]:
    """One pinned, capped device round against an in-process cohort; the child's report.

    Adds ``exact`` (the aggregate decodes to the device's input), ``wall_s`` (parent's
    view) and ``command``. Raises RuntimeError (with the child's stderr) if it fails.
    """
    rng = np.random.default_rng(seed)
    ids = [f"d{i:02d}" for i in range(COHORT)]
    idents = [DeviceIdentity.generate(d, random_bytes=rng.bytes) for d in ids]
    agg = AggregatorIdentity.generate(random_bytes=rng.bytes)
    registry = Registry.of(agg, idents)
    dim = build_spec("cnn", (1, 28, 28), 10).num_params
    cfg = RoundConfig.for_cohort(round_id=1, nonce=rng.bytes(32), cohort=ids, bits=BITS,
                                 length=dim)
    server = SecAggServer(identity=agg, registry=registry, config=cfg)
    others = {d: SecAggClient(identity=i, registry=registry, config=cfg,
                              random_bytes=np.random.default_rng([seed, 2, k]).bytes)
              for k, (d, i) in enumerate(zip(ids, idents, strict=True)) if k}
    inputs = {d: np.random.default_rng([seed, 3, k]).integers(0, 1 << BITS, dim,
                                                              dtype=np.uint64)
              for k, d in enumerate(ids) if k}
    dev = ids[0]

    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    argv = ["taskset", "-c", str(cpu), sys.executable, "-c", _CHILD, str(to_child_r),
            str(from_child_w), str(seed), str(COHORT)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=REPO, pass_fds=(to_child_r, from_child_w),
                            preexec_fn=_cap(cap_mib * 2**20))
    os.close(to_child_r)
    os.close(from_child_w)
    w = os.fdopen(to_child_w, "wb")
    r = os.fdopen(from_child_r, "rb")
    try:
        _send(w, msgpack.packb(cfg.to_wire(), use_bin_type=True))
        server.receive(decode_message(_recv(r)))
        for c in others.values():
            server.receive(decode_message(encode_message(c.advertise())))
        for d, m in server.close_advertise().items():
            data = encode_message(m)
            if d == dev:
                _send(w, data)
                server.receive(decode_message(_recv(r)))
            else:
                server.receive(decode_message(encode_message(
                    others[d].share_keys(decode_message(data)))))
        for d, m in server.close_share_keys().items():
            data = encode_message(m)
            if d == dev:
                _send(w, data)
                server.receive(decode_message(_recv(r)))
            else:
                server.receive(decode_message(encode_message(
                    others[d].mask_input(decode_message(data), inputs[d]))))
        for d, m in server.close_masked_input().items():
            data = encode_message(m)
            if d == dev:
                _send(w, data)
                server.receive(decode_message(_recv(r)))
            else:
                server.receive(decode_message(encode_message(
                    others[d].unmask(decode_message(data)))))
        server.recover()
        total = server.finalize()
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except (EOFError, BrokenPipeError, subprocess.TimeoutExpired) as exc:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise RuntimeError(f"device process failed ({exc}); exit {proc.returncode}; "
                           f"stderr tail: {stderr.decode()[-800:]}") from None
    finally:
        w.close()
        r.close()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"device process exited {proc.returncode}: "
                           f"{stderr.decode()[-800:]}")
    rep = json.loads(stdout.decode().strip().splitlines()[-1])
    ring = np.uint64((1 << BITS) - 1)
    theirs = np.zeros(dim, dtype=np.uint64)
    for x in inputs.values():
        np.add(theirs, x, out=theirs)
    mine = (total - theirs) & ring
    rep["exact"] = hashlib.sha256(mine.astype("<u8").tobytes()).hexdigest() == rep[
        "input_sha256"]
    rep["wall_s"] = wall
    rep["cohort"] = COHORT
    rep["degree"] = cfg.degree
    rep["cap_mib"] = cap_mib
    rep["command"] = f"taskset -c {cpu} python -c <device round>, RLIMIT_AS={cap_mib} MiB"
    return rep


AARCH64_PLATFORMS = ("manylinux2014_aarch64", "manylinux_2_28_aarch64")


def aarch64_wheels(names: list[str], *, python: str = "3.11",
                   platforms: tuple[str, ...] = AARCH64_PLATFORMS,
                   timeout_s: float = 240.0) -> dict[str, dict[str, Any]]:
    """Ask PyPI for an aarch64 (or pure) wheel of each installed distribution's version.

    ``platforms`` are tried in order (pip also accepts older compatible manylinux tags
    for each); manylinux2014 needs glibc >= 2.17, manylinux_2_28 glibc >= 2.28
    (Raspberry Pi OS bookworm ships 2.36). Returns name -> ``{"version", "ok", "platform",
    "wheel"}`` or ``{"version", "ok": False, "error"}``. Downloads go to a temporary
    directory that is removed afterwards.
    """
    import importlib.metadata as md

    found: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            version = md.version(name)
            pin = version.split("+", 1)[0]
            errors = []
            for plat in platforms:
                dest = os.path.join(tmp, name, plat)
                try:
                    proc = subprocess.run(
                        [sys.executable, "-m", "pip", "download", "--quiet",
                         "--only-binary=:all:", "--platform", plat, "--python-version", python,
                         "--no-deps", "-d", dest, f"{name}=={pin}"],
                        capture_output=True, text=True, timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    errors.append(f"{plat}: pip download timed out after {timeout_s:.0f} s")
                    continue
                wheels = sorted(os.listdir(dest)) if os.path.isdir(dest) else []
                if proc.returncode == 0 and wheels:
                    found[name] = {"version": version, "ok": True, "platform": plat,
                                   "wheel": wheels[0]}
                    break
                err = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
                errors.append(f"{plat}: {err[:160]}")
            else:
                found[name] = {"version": version, "ok": False, "error": "; ".join(errors)}
    return found


def run_envelope_bench(*, quick: bool = False, reps: int | None = None,
                       check_wheels: bool = True, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run the pinned, capped device round ``reps`` times; print tables; return the result.

    Returns ``runs`` (each child's report), medians ``round_wall_s``,
    ``device_compute_s``, ``local_round_s``, the max ``peak_rss_mib``, ``bytes_sent``,
    ``bytes_float32``, ``rss_over_cap``, ``exact`` (every run) and ``aarch64`` (the wheel
    check, or None when skipped).
    """
    import statistics

    from tools.bench.floors import step_flops
    from tools.bench.stacks import DEVICE_ROOTS, closure

    reps = reps or (2 if quick else 5)
    runs = [run_device_round() for _ in range(reps)]

    def spread(vals: list[float]) -> tuple[float, float, float]:
        return statistics.median(vals), min(vals), max(vals)

    def fmt(vals: list[float], f: str = ".3f") -> str:
        m, lo, hi = spread(vals)
        return f"{m:{f}} ({lo:{f}}-{hi:{f}})"

    r0 = runs[0]
    dim = r0["dim"]
    sent = sum(r0["bytes_sent"].values())
    recv = sum(r0["bytes_received"].values())
    flops = step_flops(build_spec("cnn", (1, 28, 28), 10))
    train_floor = [20 * 32 * flops / (r["sgemm_gflops_pinned"] * 1e9) for r in runs]
    rss = max(r["peak_rss_mib"] for r in runs)
    vm = max(r["vm_peak_mib"] or 0 for r in runs)
    print(f"# one device, `taskset -c 0`, RLIMIT_AS = {MEMORY_CAP_MIB} MiB (as `ulimit -v "
          f"{MEMORY_CAP_MIB * 1024}`; no cgroup), CNN local round tau=20 b=32 + fixed point + "
          f"SecAgg+ client stages in a cohort of {COHORT} (k={r0['degree']}; the aggregator "
          f"and the 9 other devices run in the parent process); median (min-max) of "
          f"{reps} fresh processes", file=out)
    print("| measure | device | reference / floor | ratio |", file=out)
    print("|---|---|---|---|", file=out)
    print(f"| peak RSS MiB (ru_maxrss) | {rss:.0f} (after imports "
          f"{max(r['rss_after_import_mib'] for r in runs):.0f}) | cap {MEMORY_CAP_MIB} "
          f"| {rss / MEMORY_CAP_MIB:.2f} |", file=out)
    print(f"| peak virtual size MiB (VmPeak, what RLIMIT_AS bounds) | {vm:.0f} | cap "
          f"{MEMORY_CAP_MIB} | {vm / MEMORY_CAP_MIB:.2f} |", file=out)
    lr = [r["stage_s"]["local_round"] for r in runs]
    print(f"| local round s (20 steps x 32) | {fmt(lr)} | matmul FLOP floor "
          f"{fmt(train_floor, '.4f')} (pinned 1-thread sgemm) "
          f"| {statistics.median(lr) / statistics.median(train_floor):.1f}x |", file=out)
    mi = [r["stage_s"]["mask_input"] for r in runs]
    pf = [r["prg_floor_s"] for r in runs]
    print(f"| mask_input s (checks, {r0['degree']} agreements, {r0['masks']} PRG masks of "
          f"d={dim}, pack, sign) | {fmt(mi, '.4f')} | PRG floor {fmt(pf, '.4f')} "
          f"| {statistics.median(mi) / statistics.median(pf):.1f}x |", file=out)
    for st in ("load_model_data", "fixed_point_encode", "advertise", "share_keys", "unmask"):
        print(f"| {st} s | {fmt([r['stage_s'][st] for r in runs], '.4f')} | | |", file=out)
    dc = [r["device_compute_s"] for r in runs]
    rw = [r["round_wall_s"] for r in runs]
    print(f"| device compute s (sum of the stages) | {fmt(dc)} | | |", file=out)
    print(f"| round wall s (config in -> unmask out, incl. waiting on the cohort) "
          f"| {fmt(rw)} | | |", file=out)
    print(f"| imports s | {fmt([r['import_s'] for r in runs])} | | |", file=out)
    f32 = 4 * dim
    print(f"| bytes sent (msgpack: {', '.join(f'{k} {v}' for k, v in r0['bytes_sent'].items())})"
          f" | {sent} | dense float32 update {f32} | {sent / f32:.2f} |", file=out)
    print(f"| bytes received | {recv} | | |", file=out)
    print(f"| aggregate exact (sum minus the others = this device's encoding) "
          f"| {all(r['exact'] for r in runs)} | | |", file=out)
    print(f"| values clamped to +-1 | {r0['clamped_values']} of {dim} | | |", file=out)
    wheels = None
    if check_wheels:
        names = closure(DEVICE_ROOTS)
        wheels = aarch64_wheels(names)
        print("", file=out)
        print("# aarch64 wheels on PyPI for the installed versions of the device stack (`pip "
              "download --only-binary=:all: --platform P --python-version 3.11 --no-deps`, P "
              f"tried in order: {', '.join(AARCH64_PLATFORMS)})", file=out)
        print("| distribution | version | platform asked | aarch64 wheel |", file=out)
        print("|---|---|---|---|", file=out)
        for n, w in wheels.items():
            cell = (f"{w['platform']} | {w['wheel']}" if w["ok"]
                    else f"- | NO: {w['error']}")
            print(f"| {n} | {w['version']} | {cell} |", file=out)
    return {
        "runs": runs, "reps": reps, "cap_mib": MEMORY_CAP_MIB,
        "peak_rss_mib": rss, "vm_peak_mib": vm, "rss_over_cap": rss / MEMORY_CAP_MIB,
        "round_wall_s": statistics.median(rw), "device_compute_s": statistics.median(dc),
        "local_round_s": statistics.median(lr), "local_round_floor_s": statistics.median(
            train_floor), "mask_input_s": statistics.median(mi),
        "prg_floor_s": statistics.median(pf),
        "bytes_sent": sent, "bytes_received": recv, "bytes_float32": f32,
        "exact": all(r["exact"] for r in runs), "aarch64": wheels,
    }
