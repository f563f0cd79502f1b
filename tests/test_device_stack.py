"""The device stack alone (issue 17): ``pip install fedge`` without extras, in a fresh
virtualenv, gives a working ``fedge device`` that trains on its owner's files in a real round.

The virtualenv is built as the README says (``pip install <the project>``, dependencies
resolved from the package registries; no ``--no-deps``, no extras) from a copy of this
tree's package files, so the build leaves nothing in the worktree. pip's downloads are
cached in ``$FEDGE_PIP_CACHE`` (default ``<tmp>/fedge-pip-cache``), shared between runs.
The device process runs that virtualenv's ``fedge`` with its working directory outside the
repository, so it imports the installed package, not this tree. The aggregator is the
project's own (``fedge aggregator`` from the development environment), two more devices
are in-process sessions (``tests/test_services.py``'s fleet), the broker a real mosquitto.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_services import POLICY, Proc, ServiceFleet, pump_until

from edge_sdk.engine import load_engine
from models import ONNX_DIR

# 21-51 s measured here (the virtualenv build 15-32 s of it, more on a busy machine): slow,
# run by its own line in .ci/run
pytestmark = [pytest.mark.broker, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
# what `pip install fedge` builds from (pyproject.toml's packages, its readme)
PACKAGE_FILES = ("pyproject.toml", "README.md", "edge_sdk", "aggregator", "models", "tools")
# none of these may be in the device stack (the [sim], [export] and [dev] extras)
ABSENT = ("sklearn", "scipy", "torch", "matplotlib", "onnx", "opacus", "pytest")


def _clean_env() -> dict[str, str]:
    """This environment without what would point the venv's python at another one."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the project installed without extras; its bin/ directory."""
    root = tmp_path_factory.mktemp("device-stack")
    src = root / "src"
    src.mkdir()
    for name in PACKAGE_FILES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns(
                "__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    python = shutil.which("python3.11") or sys.executable
    env = _clean_env()
    subprocess.run([python, "-m", "venv", str(root / "venv")], check=True, env=env,
                   timeout=300)
    cache = os.environ.get("FEDGE_PIP_CACHE",
                           str(Path(tempfile.gettempdir()) / "fedge-pip-cache"))
    done = subprocess.run([str(root / "venv" / "bin" / "pip"), "install", "--cache-dir", cache,
                           str(src)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=1200, check=False)
    assert done.returncode == 0, f"pip install failed:\n{done.stdout[-3000:]}\n{done.stderr}"
    return root / "venv" / "bin"


def run_in(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=_clean_env(),
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_device_stack_has_no_simulation_extras(venv: Path, tmp_path: Path) -> None:
    code = ("import importlib.util, json, sys; import edge_sdk.device, edge_sdk.data, tools.cli;"
            "import tools; print(json.dumps({'tools': tools.__file__, 'present': "
            f"[m for m in {ABSENT!r} if importlib.util.find_spec(m)], "
            "'loaded': sorted(m for m in " f"{ABSENT!r}" " if m in sys.modules)}))")
    r = run_in(venv, venv / "python", "-c", code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["present"] == [] and got["loaded"] == [], got
    assert str(venv.parent) in got["tools"], got  # the installed package, not this tree
    r = run_in(venv, venv / "fedge", "device", "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "--data FILE.npz" in r.stdout and "--data-npy X.npy Y.npy" in r.stdout
    # a bundled set that needs [sim]: a message saying what to install, no traceback
    r = run_in(venv, venv / "fedge", "enroll", "--devices", "1", "--fleet", "lab", "--out",
               tmp_path / "fleet", "--no-tls", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_in(venv, venv / "fedge", "device", "--config",
               tmp_path / "fleet" / "devices" / "dev-0000" / "device.toml", "--dataset",
               "digits", "--shard", "0", "--shards", "1", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("fedge device: error: the data set 'digits' ships inside "
                               "scikit-learn, which is not installed here"), r.stderr
    assert "install the simulation extra, `pip install 'fedge[sim]'`" in r.stderr


def test_a_device_on_the_device_stack_trains_on_its_files_in_a_real_round(
        venv: Path, tmp_path: Path, digits: Any) -> None:
    f = ServiceFleet(tmp_path, digits, load_engine(ONNX_DIR / "logreg-64-10.json"),
                     devices=3, in_process=2,
                     policy={**POLICY, "cohort_size": 3, "min_cohort": 3, "max_rounds": 1})
    try:
        name = f.names[2]
        idx = f.shards[2]
        data = tmp_path / "owner" / "samples.npz"  # the owner's file, written by numpy alone
        data.parent.mkdir()
        np.savez(data, x=np.asarray(digits.x_train[idx], np.float32),
                 y=np.asarray(digits.y_train[idx], np.int64))
        device = Proc(["device", "--config", str(f.fleet.device_configs[name]), "--data",
                       str(data), "--rounds", "1", "--audit", str(tmp_path / "audit")],
                      tmp_path / f"{name}.err", command=[str(venv / "fedge")],
                      cwd=data.parent, env=_clean_env())
        f.procs.append(device)
        start = f.wait_line(device, lambda e: e["event"] == "start", 120, "the device start")
        assert start["samples"] == len(idx)
        f.wait_line(device, lambda e: e["event"] == "connected", 60, "the device connected")
        agg = f.start_aggregator("--exit-when-done")
        up = f.wait_line(device, lambda e: e["event"] == "uploaded", 120, "its upload")
        assert up["round"] == 1
        pump_until(f.loop, lambda: agg.p.poll() is not None, 120, f.procs, "the round")
        assert agg.wait() == 0
        assert device.wait(60) == 0  # --rounds 1: done after the round it contributed to
        m = f.machine()
        assert [(o.round_id, o.completed) for o in m.history] == [(1, True)]
        assert name in m.history[0].survivors and m.model_version == 1
        f.check_sums(m)  # the round's sum holds the venv device's upload exactly once
        ends = [e for e in device.lines if e["event"] == "round_end"]
        assert ends and ends[-1]["contributed"] is True and ends[-1]["model_version"] == 1
    finally:
        f.close()
