"""The device stack on aarch64 against x86 (issue 17): the Python half of tools/arm64_check.sh.

``tools/arm64_check.sh`` builds a Debian bookworm arm64 userland, installs the project
there without extras (the device stack: numpy, onnxruntime, paho-mqtt, cryptography,
msgpack from PyPI's aarch64 wheels) and mounts it; this module then does the checks:

* ``round`` runs on the device stack alone (numpy and edge_sdk; onnxruntime for the onnx
  engine), on either architecture: one DP-SGD local round (``edge_sdk.train.local_round``,
  seeded: a simulation, never a device configuration) and the noise-free clipped gradient
  sum of one batch, both with the numpy and the onnxruntime engine, on inputs written by
  ``host``. It writes the results as ``.npz`` and its versions and timings as JSON.
* ``host`` runs on x86 in the development environment: writes the inputs, runs ``round``
  in-process and, through ``chroot``, under aarch64, compares them (relative L2 difference
  ``|a - b| / |b|`` per engine, checked against ``--tolerance``), then runs one real round
  over a local mosquitto: an x86 ``fedge aggregator``, two x86 ``fedge device`` processes
  and one aarch64 ``fedge device`` (the installed ``fedge`` under qemu-user), each on its
  own ``.npz`` file. It prints one JSON summary on stdout (progress on stderr) and exits
  0 only when every check passed.

The data are generated (``_inputs``, ``_device_data``: seeded Gaussian clusters, labelled
so); bundled data sets need the ``[sim]`` extra, which the device stack does not have.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "rel_diff", "run_round"]

REPO = Path(__file__).resolve().parents[1]

# The round both architectures run (a conv net: convolution, pooling and dense layers).
ROUND_MODEL = "cnn-1x28x28-10"
ROUND_SAMPLES = 64
ROUND_SEED = 17
ROUND_SETTINGS = {"steps": 3, "batch_size": 16, "lr": 0.1, "clip": 1.0, "noise_multiplier": 1.0}
# float32 engines on two instruction sets (AVX vs NEON kernels, other summation orders)
# agree to a few float32 roundings; 1e-5 relative is ~100 ulp of headroom, far below any
# real divergence (a wrong gradient differs at O(1)).
TOLERANCE = 1e-5
# The MQTT round: one aarch64 device and two x86 ones, a cohort of all three.
FLEET = "arm64"
MQTT_MODEL = "logreg-64-10"
DEVICES = ("dev-0000", "dev-0001", "dev-0002")
ARM_DEVICE = DEVICES[0]
# qemu-user runs the aarch64 device several times slower than native: generous stage time.
POLICY = {"cohort_size": 3, "min_cohort": 3, "min_survivors": 3, "checkin_window": 2.0,
          "stage_timeout": 120.0, "max_rounds": 1, "steps": 3, "batch_size": 16, "lr": 0.5,
          "noise_multiplier": 1.0, "value_bound": 2.0, "seed": 7}


def log(msg: str) -> None:
    print(f"arm64_check: {msg}", file=sys.stderr, flush=True)


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """``|a - b|_2 / |b|_2`` in float64 (``|a - b|_2`` when b is 0)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"cannot compare arrays of {a.size} and {b.size} values")
    den = float(np.linalg.norm(b))
    num = float(np.linalg.norm(a - b))
    return num / den if den > 0 else num


# ----------------------------------------------------------------- the round (device stack)


def _versions() -> dict[str, str]:
    import onnxruntime

    return {"machine": platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__, "onnxruntime": onnxruntime.__version__}


def run_round(inputs: Path, out: Path) -> dict[str, Any]:
    """Both engines on ``inputs`` (params, x, y): write their results to ``out`` (.npz).

    Per engine ``e``: ``e.update`` (the DP-SGD round's theta_tau - theta_0, flattened),
    ``e.grad`` (the clipped gradient sum of the first ``batch_size`` samples at theta_0,
    flattened: no noise, so it shows the engines' arithmetic alone) and ``e.norms``.
    Returns versions, losses and seconds per engine.
    """
    from edge_sdk.engine import load_engine
    from edge_sdk.model import flatten_params
    from edge_sdk.train import LocalTraining, local_round
    from models import ONNX_DIR

    with np.load(inputs, allow_pickle=False) as f:
        x, y = f["x"], f["y"]
        params = [f[f"p{i}"] for i in range(int(f["num_params"]))]
    cfg = LocalTraining(**ROUND_SETTINGS)
    arrays: dict[str, np.ndarray] = {}
    report: dict[str, Any] = {"versions": _versions(), "engines": {}}
    for backend in ("numpy", "onnx"):
        t0 = time.perf_counter()
        engine = load_engine(ONNX_DIR / f"{ROUND_MODEL}.json", backend=backend)
        t1 = time.perf_counter()
        b = cfg.batch_size
        res = engine.clipped_grad_sum(params, x[:b], y[:b], cfg.clip)
        # seeded: this is a reproducibility check, never a device's noise
        result = local_round(engine, params, x, y, cfg, np.random.default_rng(ROUND_SEED))
        t2 = time.perf_counter()
        arrays[f"{backend}.update"] = flatten_params(result.update)
        arrays[f"{backend}.grad"] = flatten_params(res.clipped_sum)
        arrays[f"{backend}.norms"] = np.asarray(res.norms)
        report["engines"][backend] = {"mean_loss": result.mean_loss,
                                      "load_s": round(t1 - t0, 3), "round_s": round(t2 - t1, 3)}
    np.savez(out, **arrays)
    return report


def _write_inputs(path: Path) -> None:
    """Parameters and data for the round: init_params and generated samples (seeded)."""
    from edge_sdk.engine import load_manifest
    from edge_sdk.model import init_params
    from models import ONNX_DIR

    spec = load_manifest(ONNX_DIR / f"{ROUND_MODEL}.json").spec
    rng = np.random.default_rng(ROUND_SEED)
    params = init_params(spec, rng)
    y = rng.integers(0, spec.num_classes, ROUND_SAMPLES)
    # generated images: a per-class mean pattern plus noise (so the classes differ)
    means = rng.normal(0.0, 1.0, (spec.num_classes, *spec.input_shape))
    x = (means[y] + rng.normal(0.0, 1.0, (ROUND_SAMPLES, *spec.input_shape))).astype(np.float32)
    np.savez(path, x=x, y=y.astype(np.int64), num_params=len(params),
             **{f"p{i}": p for i, p in enumerate(params)})


def _device_data(path: Path, index: int, samples: int = 200) -> None:
    """A device's own file for the MQTT round: generated Gaussian clusters (64 features,
    10 classes; the same class means on every device, seeded by the device index)."""
    means = np.random.default_rng(0).normal(0.0, 1.0, (10, 64))
    rng = np.random.default_rng(100 + index)
    y = rng.integers(0, 10, samples)
    x = (means[y] + rng.normal(0.0, 0.5, (samples, 64))).astype(np.float32)
    np.savez(path, x=x, y=y.astype(np.int64))


# ----------------------------------------------------------------- the host (x86) side


class Proc:
    """A subprocess whose stdout JSON lines are collected by a reader thread."""

    def __init__(self, name: str, argv: Sequence[str], err: Path, *,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.lines: list[dict[str, Any]] = []
        self._q: queue.Queue[dict[str, Any]] = queue.Queue()
        self._err = open(err, "ab")  # noqa: SIM115 (closed in stop)
        self.err = err
        self.p = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=self._err,
                                  env=env, cwd=cwd, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for raw in self.p.stdout:
            try:
                self._q.put(json.loads(raw))
            except ValueError:
                self._q.put({"event": "non-json", "text": raw.decode(errors="replace")})

    def drain(self) -> list[dict[str, Any]]:
        while True:
            try:
                self.lines.append(self._q.get_nowait())
            except queue.Empty:
                return self.lines

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to its process group, SIGKILL after ``timeout``; its exit status."""
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
            except ProcessLookupError:
                pass
        self._reader.join(5.0)
        self.drain()
        if self.p.stdout is not None:
            self.p.stdout.close()
        if not self._err.closed:
            self._err.close()
        return self.p.returncode

    def tail(self, n: int = 12) -> str:
        try:
            return "\n".join(self.err.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}


def _chroot_env() -> dict[str, str]:
    """What a process in the arm64 userland sees: nothing of this environment's Python."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1"}


def _chroot(root: Path, *argv: str) -> list[str]:
    # found on this host's PATH (/usr/sbin), not the userland's environment's
    return [shutil.which("chroot") or "/usr/sbin/chroot", str(root), *argv]


def _wait(cond: Callable[[], bool], timeout: float, procs: Sequence[Proc], what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            p.drain()
        if cond():
            return
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; "
                       + "; ".join(f"{p.name}: {p.lines[-3:]} {p.tail(4)!r}" for p in procs))


def _compare(x86: Path, arm: Path, tolerance: float) -> dict[str, Any]:
    with np.load(x86, allow_pickle=False) as a, np.load(arm, allow_pickle=False) as b:
        out: dict[str, Any] = {}
        for backend in ("numpy", "onnx"):
            out[backend] = {what: rel_diff(b[f"{backend}.{what}"], a[f"{backend}.{what}"])
                            for what in ("update", "grad", "norms")}
        # the two engines on one architecture, for scale
        out["numpy_vs_onnx"] = {arch: {what: rel_diff(f[f"numpy.{what}"], f[f"onnx.{what}"])
                                       for what in ("update", "grad")}
                                for arch, f in (("x86", a), ("aarch64", b))}
    worst = max(v for k in ("numpy", "onnx") for v in out[k].values())
    out["max_rel_diff"] = worst
    out["tolerance"] = tolerance
    out["ok"] = bool(worst <= tolerance)
    return out


def _round_check(root: Path, venv: Path, work: Path, tolerance: float) -> dict[str, Any]:
    inputs = work / "round-inputs.npz"
    _write_inputs(inputs)
    log("the DP-SGD round on x86 (both engines)")
    t0 = time.perf_counter()
    x86 = run_round(inputs, work / "round-x86.npz")
    t1 = time.perf_counter()
    log("the same round under aarch64 (qemu-user)")
    done = subprocess.run(_chroot(root, str(venv / "bin" / "python"), "-m", "tools.arm64_check",
                                  "round", "--inputs", str(inputs), "--out",
                                  str(work / "round-arm64.npz")),
                          env=_chroot_env(), capture_output=True, text=True, timeout=1800,
                          check=False)
    t2 = time.perf_counter()
    if done.returncode != 0:
        raise RuntimeError(f"the aarch64 round failed (exit {done.returncode}):\n"
                           f"{done.stderr[-4000:]}")
    arm = json.loads(done.stdout)
    diffs = _compare(work / "round-x86.npz", work / "round-arm64.npz", tolerance)
    return {"model": ROUND_MODEL, "samples": ROUND_SAMPLES, "seed": ROUND_SEED,
            "settings": ROUND_SETTINGS, "x86": x86, "aarch64": arm, "rel_diff": diffs,
            "ok": diffs["ok"] and arm["versions"]["machine"] == "aarch64",
            "seconds": {"x86": round(t1 - t0, 2), "aarch64": round(t2 - t1, 2)}}


def _mqtt_round(root: Path, venv: Path, work: Path, host_python: str) -> dict[str, Any]:
    from tools.broker import Broker
    from tools.enroll import enroll

    t0 = time.perf_counter()
    broker = Broker(devices=list(DEVICES), fleet=FLEET, directory=work / "broker")
    broker.start()
    procs: list[Proc] = []
    try:
        fleet = enroll(work / "fleet", devices=list(DEVICES), fleet=FLEET,
                       broker_config=broker.config, policy=POLICY, budget_epsilon=1000.0,
                       model=MQTT_MODEL, metrics_port=None,
                       device_settings={"checkin_every": 2.0})
        assert fleet.aggregator_config is not None
        for i, name in enumerate(DEVICES):
            _device_data(work / f"{name}.npz", i)
        cli = [host_python, "-m", "tools.cli"]
        for name in DEVICES:
            args = ["device", "--config", str(fleet.device_configs[name]), "--data",
                    str(work / f"{name}.npz"), "--rounds", "1"]
            if name == ARM_DEVICE:  # the installed package's fedge, under qemu-user
                argv, env = _chroot(root, str(venv / "bin" / "fedge"), *args), _chroot_env()
            else:
                argv, env = [*cli, *args], _clean_env()
            procs.append(Proc(name, argv, work / f"{name}.err", env=env, cwd=REPO))
        arm = procs[0]
        log("waiting for the aarch64 device to connect")
        _wait(lambda: any(e.get("event") == "connected" for e in arm.lines) or
              arm.p.poll() is not None, 600, procs, "the aarch64 device to connect")
        if arm.p.poll() is not None:
            raise RuntimeError(f"the aarch64 device exited {arm.p.returncode}: {arm.tail()}")
        t_connected = time.perf_counter()
        log("the aggregator (x86)")
        agg = Proc("aggregator", [*cli, "aggregator", "--config", str(fleet.aggregator_config),
                                  "--exit-when-done"], work / "aggregator.err",
                   env=_clean_env(), cwd=REPO)
        procs.append(agg)
        _wait(lambda: agg.p.poll() is not None, 900, procs, "the round to end")
        t_round = time.perf_counter()
        rc = {p.name: None for p in procs}
        for p in procs[:-1]:  # --rounds 1: each device exits after its round
            try:
                p.p.wait(120)
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            rc[p.name] = p.stop()
    finally:
        for p in procs:
            p.stop()
        broker.stop()
    ends = [e for e in agg.lines if e.get("event") == "round_end"]
    arm_ends = [e for e in arm.lines if e.get("event") == "round_end"]
    up = [e for e in arm.lines if e.get("event") == "uploaded"]
    start = [e for e in arm.lines if e.get("event") == "start"]
    end = ends[-1] if ends else {}
    ok = (len(ends) == 1 and end.get("completed") is True
          and sorted(end.get("survivor_ids", [])) == sorted(DEVICES)
          and bool(arm_ends) and arm_ends[-1].get("contributed") is True
          and all(v == 0 for v in rc.values()))
    return {"model": MQTT_MODEL, "devices": list(DEVICES), "aarch64_device": ARM_DEVICE,
            "completed": end.get("completed"), "survivors": end.get("survivor_ids"),
            "model_version": end.get("model_version"), "round_s": end.get("duration_s"),
            "accuracy": end.get("accuracy"),
            "aarch64_uploaded_bytes": up[-1].get("bytes") if up else None,
            "aarch64_start": start[-1] if start else None,
            "aarch64_round_end": arm_ends[-1] if arm_ends else None, "exit_codes": rc,
            "ok": ok,
            "seconds": {"to_connect": round(t_connected - t0, 2),
                        "round": round(t_round - t_connected, 2),
                        "total": round(time.perf_counter() - t0, 2)}}


def _host(args: argparse.Namespace) -> int:
    root, venv, work = Path(args.root), Path(args.venv), Path(args.work)
    if not work.is_absolute() or work.resolve() != work:
        # the userland sees it at the same path (a bind mount): paths pass between the two
        raise SystemExit(f"--work {work} must be an absolute path without symlinks")
    summary: dict[str, Any] = {"check": "fedge device stack on aarch64 (qemu-user) vs x86"}
    if args.setup:
        summary.update(json.loads(Path(args.setup).read_text()))
    summary["x86"] = _versions()
    failed = []
    try:
        summary["round"] = _round_check(root, venv, work, args.tolerance)
        if not summary["round"]["ok"]:
            failed.append("round")
    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
        summary["round"] = {"ok": False, "error": str(exc)}
        failed.append("round")
    try:
        summary["mqtt"] = _mqtt_round(root, venv, work, args.host_python)
        if not summary["mqtt"]["ok"]:
            failed.append("mqtt")
    except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
        summary["mqtt"] = {"ok": False, "error": str(exc)}
        failed.append("mqtt")
    if "started_at" in summary:
        summary.setdefault("timings_s", {})["total"] = round(
            time.time() - float(summary.pop("started_at")), 1)
    summary["failed"] = failed
    summary["ok"] = not failed
    print(json.dumps(summary, indent=1, default=str), flush=True)
    return 0 if not failed else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.arm64_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("round", help="both engines' DP-SGD round on an inputs file "
                                     "(the device stack alone; any architecture)")
    r.add_argument("--inputs", required=True, help=".npz written by `host`")
    r.add_argument("--out", required=True, help=".npz for the results (JSON on stdout)")
    h = sub.add_parser("host", help="x86: compare with aarch64 and run the MQTT round "
                                    "(called by tools/arm64_check.sh)")
    h.add_argument("--root", required=True, help="the arm64 userland (mounted)")
    h.add_argument("--venv", required=True, help="the device stack's venv inside it")
    h.add_argument("--work", required=True,
                   help="work directory, the same absolute path on the host and in the root")
    h.add_argument("--setup", help="JSON of the shell half (stack size, timings)")
    h.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help=f"largest relative L2 difference accepted (default {TOLERANCE:g})")
    h.add_argument("--host-python", default=sys.executable,
                   help="python of the x86 development environment")
    args = p.parse_args(argv)
    if args.command == "round":
        report = run_round(Path(args.inputs), Path(args.out))
        print(json.dumps(report))
        return 0
    if not (args.tolerance > 0 and math.isfinite(args.tolerance)):
        p.error(f"--tolerance must be a positive number, got {args.tolerance!r}")
    if shutil.which("chroot") is None:
        p.error("chroot not found (coreutils)")
    return _host(args)


if __name__ == "__main__":
    sys.exit(main())
