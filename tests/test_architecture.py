"""The import architecture (issue 15, plan15 §1.4), checked on the source with ``ast``:

1. no import cycle between modules, nor between packages; every import counts, top-level,
   lazy (inside a function) and ``TYPE_CHECKING`` alike;
2. layers: edge_sdk imports no other first-party package and only the device's
   dependencies; aggregator and models import only edge_sdk; inside edge_sdk a module imports
   only modules of its own rank or lower (``RANKS``);
3. light imports: the wire, the secure-aggregation protocol and the round machine load
   without paho-mqtt, onnxruntime or torch.

What the plan has not fixed yet is listed in ``KNOWN_CYCLES`` and ``KNOWN_WRONG_EDGES``, each
with the step that fixes it. The test of a listed item is a strict xfail: once the step lands
the test passes, the xfail turns into a failure, and the step deletes its entry; a listed
item therefore cannot go stale, and anything not listed fails at once."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("edge_sdk", "aggregator", "models", "tools")

# first-party packages each package may import (tools is the top layer)
LAYERS = {"edge_sdk": frozenset(), "aggregator": frozenset({"edge_sdk"}),
          "models": frozenset({"edge_sdk"}),
          "tools": frozenset({"edge_sdk", "aggregator", "models"})}
# the device's third-party dependencies (README): they must not grow
EDGE_THIRD_PARTY = frozenset({"numpy", "onnxruntime", "paho", "cryptography", "msgpack"})
# edge_sdk's modules by their first name under edge_sdk, lowest rank first (plan15 §1.4);
# a module may import modules of its own rank or a lower one. Names not here yet are the
# plan's future modules.
RANKS: tuple[frozenset[str], ...] = tuple(frozenset(r) for r in (
    {"_validate", "errors", "hazmat"},
    {"privacy"},
    {"ledger"},
    {"compress", "ddp", "csprng", "fixedpoint", "model", "engine", "train", "data"},
    {"wire"},
    {"secagg"},
    {"mechanisms"},
    {"round"},
    {"session"},
    {"config"},
    {"mqtt"},
    {"device"},
))
# modules a light import must not pull in (the device's adapter, ML runtimes)
HEAVY = ("paho", "onnxruntime", "torch")

# (level, members, the plan's step that removes it)
KNOWN_CYCLES: tuple[tuple[str, frozenset[str], str], ...] = (
)
# (importer, imported, the plan's step that removes it)
KNOWN_WRONG_EDGES: tuple[tuple[str, str, str], ...] = (
)
# (module, the plan's step that creates or lightens it)
KNOWN_HEAVY: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Import:
    """One import statement's target, resolved."""

    importer: str  # module name, e.g. "edge_sdk.wire"
    line: int
    target: str  # first-party module name, or the top-level name of a foreign one
    first_party: bool


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The longest prefix of dotted ``name`` that is a first-party module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in MODULES:
            return candidate
    return None


def _imports(module: str, path: Path) -> Iterator[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            # "from pkg import mod" imports the module pkg.mod; "from mod import name" mod
            names = [f"{base}.{a.name}" if _resolve(f"{base}.{a.name}") != _resolve(base)
                     else base for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is None:
                yield Import(importer=module, line=node.lineno, target=name.split(".")[0],
                             first_party=False)
            elif target != module:
                yield Import(importer=module, line=node.lineno, target=target,
                             first_party=True)


IMPORTS = tuple(i for m, p in MODULES.items() for i in _imports(m, p))


def _package(module: str) -> str:
    return module.split(".")[0]


def _graph(level: str) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {(_package(m) if level == "package" else m): set()
                                  for m in MODULES}
    for i in IMPORTS:
        if not i.first_party:
            continue
        a, b = ((_package(i.importer), _package(i.target)) if level == "package"
                else (i.importer, i.target))
        if a != b:
            graph[a].add(b)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's algorithm (iterative): the components with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_tarjan_finds_cycles_and_only_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"},
             "f": {"g"}, "g": {"f"}}
    assert sorted(map(sorted, strongly_connected(graph))) == [["a", "b", "c"], ["f", "g"]]


def test_the_scan_sees_lazy_and_type_checking_imports() -> None:
    # edges the plan found by hand (plan15 §1.1, §1.3): a lazy one and a TYPE_CHECKING one
    edges = {(i.importer, i.target) for i in IMPORTS}
    assert ("edge_sdk", "edge_sdk.device") in edges  # lazy, edge_sdk/__init__.py
    assert ("edge_sdk.session", "edge_sdk.wire") in edges
    assert len(MODULES) > 50 and len(edges) > 150


@pytest.mark.parametrize("level", ["module", "package"])
def test_no_import_cycle_beyond_the_listed_ones(level: str) -> None:
    listed = {members for lvl, members, _ in KNOWN_CYCLES if lvl == level}
    new = [sorted(c) for c in strongly_connected(_graph(level)) if c not in listed]
    assert not new, f"import cycles ({level} level): {new}"


@pytest.mark.parametrize("level, members", [
    pytest.param(level, members, id=f"{level}:{'<->'.join(sorted(members))}",
                 marks=pytest.mark.xfail(strict=True, reason=f"plan15 step {step}"))
    for level, members, step in KNOWN_CYCLES])
def test_listed_cycle_is_gone(level: str, members: frozenset[str]) -> None:
    assert not any(members <= c for c in strongly_connected(_graph(level)))


def _wrong_edges() -> list[tuple[str, str, int, str]]:
    """(importer, imported, line, why) for every import that breaks the layers."""
    wrong = []
    for i in IMPORTS:
        pkg = _package(i.importer)
        if not i.first_party:
            if pkg == "edge_sdk" and i.target not in sys.stdlib_module_names \
                    and i.target not in EDGE_THIRD_PARTY:
                wrong.append((i.importer, i.target, i.line, "not a device dependency"))
            continue
        to = _package(i.target)
        if to != pkg and to not in LAYERS[pkg]:
            wrong.append((i.importer, i.target, i.line, f"{pkg} may not import {to}"))
        elif pkg == to == "edge_sdk" and i.importer != "edge_sdk":
            # edge_sdk/__init__.py is the documented lazy export of the Device
            if _rank(i.target) > _rank(i.importer):
                wrong.append((i.importer, i.target, i.line, "imports a higher rank"))
    return wrong


def _rank(module: str) -> int:
    part = module.split(".")[1]
    for r, names in enumerate(RANKS):
        if part in names:
            return r
    raise AssertionError(f"edge_sdk.{part} has no rank: add it to RANKS in {__file__}")


def test_every_edge_sdk_module_has_a_rank() -> None:
    for m in MODULES:
        if m.startswith("edge_sdk."):
            _rank(m)


def test_layers_beyond_the_listed_wrong_edges() -> None:
    listed = {(a, b) for a, b, _ in KNOWN_WRONG_EDGES}
    new = [w for w in _wrong_edges() if w[:2] not in listed]
    assert not new, f"imports against the layers (importer, imported, line, why): {new}"


@pytest.mark.parametrize("importer, imported", [
    pytest.param(a, b, id=f"{a}->{b}",
                 marks=pytest.mark.xfail(strict=True, reason=f"plan15 step {step}"))
    for a, b, step in KNOWN_WRONG_EDGES])
def test_listed_wrong_edge_is_gone(importer: str, imported: str) -> None:
    assert not [w for w in _wrong_edges() if w[:2] == (importer, imported)]


LIGHT = ("edge_sdk.wire", "edge_sdk.wire.schema", "edge_sdk.wire.messages",
         "edge_sdk.wire.chunking", "edge_sdk.wire.topics", "edge_sdk.secagg",
         "aggregator.rounds", "edge_sdk.config")


@pytest.mark.parametrize("module", [
    pytest.param(m, marks=[pytest.mark.xfail(strict=True, reason=f"plan15 step {step}")
                           for mm, step in KNOWN_HEAVY if mm == m]) for m in LIGHT])
def test_light_import(module: str) -> None:
    code = (f"import importlib, json, sys; importlib.import_module({module!r}); "
            f"print(json.dumps(sorted(n for n in {HEAVY!r} if n in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [], f"importing {module} loads {done.stdout.strip()}"
