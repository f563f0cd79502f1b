"""tools/ has no import cycle: the simulator's two paths and the experiments' runner and
analyses depend on shared modules (tools.simconfig, tools.evaluate, tools.experiments.spec),
never on each other, and each of those modules imports alone in a fresh interpreter.

The static check counts every import, at top level, inside a function or under
``TYPE_CHECKING``, as the package-wide architecture test does.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tools.run import run
from tools.simconfig import SimConfig
from tools.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent

# Neither path of the simulator may be pulled in by what both of them import.
SHARED = {"tools.simconfig", "tools.evaluate"}
PATHS = {"tools.simulate", "tools.fleet"}
MODULES = sorted(SHARED | PATHS | {"tools.run", "tools.cli", "tools.experiments",
                                   "tools.experiments.spec", "tools.experiments.analyses"})


def _modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``package`` (relative to ROOT)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports anywhere in its source."""
    mods = _modules(package)

    def resolve(name: str) -> str | None:  # the longest prefix that is a module of ours
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mods:
                return ".".join(parts[:i])
        return None

    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [resolve(f"{base}.{a.name}") or resolve(base) for a in node.names]
            graph[mod].update(t for t in targets if t is not None and t != mod)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_scan_sees_a_cycle() -> None:
    """The checker itself: a two-module cycle and a lazy-import edge are found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    graph = _import_graph("tools")
    assert "tools.simconfig" in graph["tools.fleet"]  # a plain import
    assert "tools.run" in graph["tools.cli"]  # imported inside a function


def test_tools_has_no_import_cycle() -> None:
    graph = _import_graph("tools")
    assert _cycles(graph) == []


def test_the_paths_and_the_runner_depend_on_shared_modules_only() -> None:
    graph = _import_graph("tools")
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


TINY = dict(dataset="digits", model="logreg", devices=4, participation=0.5, rounds=1,
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
