"""tools/ has no import cycle: the simulator's two paths and the experiments' runner and
analyses depend on shared modules (tools.simconfig, tools.evaluate, tools.dropouts,
tools.experiments.spec), never on each other, and each of those modules imports alone in a
fresh interpreter.

The static checks read the graph of ``tests/test_architecture.py`` (every import, at top
level, inside a function or under ``TYPE_CHECKING``), which also checks that no package
has a cycle.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_architecture import _graph

from tools.run import run
from tools.simconfig import SimConfig
from tools.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent

# Neither path of the simulator may be pulled in by what both of them import.
SHARED = {"tools.simconfig", "tools.evaluate", "tools.dropouts"}
PATHS = {"tools.simulate", "tools.fleet"}
MODULES = sorted(SHARED | PATHS | {"tools.run", "tools.cli", "tools.experiments",
                                   "tools.experiments.spec", "tools.experiments.analyses"})


def _tools_graph() -> dict[str, set[str]]:
    """The architecture test's module graph (every import, lazy and TYPE_CHECKING ones
    included); that test also checks there is no cycle anywhere."""
    return _graph("module")


def test_the_scan_sees_plain_and_lazy_imports() -> None:
    graph = _tools_graph()
    assert "tools.simconfig" in graph["tools.fleet"]  # a plain import
    assert "tools.run" in graph["tools.cli"]  # imported inside a function


def test_the_paths_and_the_runner_depend_on_shared_modules_only() -> None:
    graph = _tools_graph()
    assert "tools.fleet" not in graph["tools.simulate"]
    assert "tools.simulate" not in graph["tools.fleet"]
    for mod in SHARED:
        assert not graph[mod] & (PATHS | {"tools.run"}), (mod, graph[mod])
    assert {"tools.simulate", "tools.fleet"} <= graph["tools.run"]
    assert not graph["tools.experiments.analyses"] & {"tools.experiments"}
    assert not graph["tools.experiments.spec"] & {"tools.experiments",
                                                  "tools.experiments.analyses"}


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_alone(module: str) -> None:
    """Each module imports first in a fresh interpreter (a cycle that matters at import time
    fails here with a partially initialised module); the shared ones pull in neither path."""
    code = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('tools'))))")
    proc = subprocess.run([sys.executable, "-c", code, module], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    assert module in loaded
    if module in SHARED:
        assert not loaded & PATHS, f"{module} pulled in {sorted(loaded & PATHS)}"


TINY = dict(dataset="digits", model="logreg", devices=6, participation=0.5, rounds=1,
            local_steps=2, batch_size=8, lr=0.5, clip=1.0, noise_multiplier=1.0, seed=2,
            progress=False)


def test_run_is_the_fast_path_without_secagg() -> None:
    a, b = run(SimConfig(**TINY)), simulate(SimConfig(**TINY))
    a.pop("wall_seconds"), b.pop("wall_seconds")
    assert a == b


def test_simulate_refuses_a_fleet_config_and_run_a_stray_workdir(tmp_path: Path) -> None:
    fleet_cfg = SimConfig(**{**TINY, "devices": 6, "secagg": True})
    with pytest.raises(ValueError, match="tools.run.run"):
        simulate(fleet_cfg)
    with pytest.raises(ValueError, match="workdir applies to the fleet path"):
        run(SimConfig(**TINY), workdir=tmp_path)
