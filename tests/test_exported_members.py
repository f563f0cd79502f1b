"""Every module of edge_sdk and aggregator keeps ``__all__`` honest (httpx's
``tests/test_exported_members.py``), and each package has one exception root whose tree its
``errors`` module draws (issue 15, plan15 §3.6).

``__all__`` honest: every listed name exists, and every public class or function the module
defines is listed. (The single-module versions in test_compress, test_secagg, test_csprng
and test_mqtt_loop predate this file.)"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from types import ModuleType

import pytest

import aggregator
import edge_sdk
from aggregator.errors import AggregatorError
from edge_sdk.errors import EdgeError

ROOTS: dict[str, type[BaseException]] = {"edge_sdk": EdgeError, "aggregator": AggregatorError}


def _module_names() -> list[str]:
    names = []
    for pkg in (edge_sdk, aggregator):
        names.append(pkg.__name__)
        names += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
    return sorted(names)


MODULE_NAMES = _module_names()
# module -> the plan15 step that fixes its __all__ (a strict xfail until then)
KNOWN_DISHONEST: dict[str, str] = {}


def _defined_here(mod: ModuleType) -> dict[str, object]:
    """The public classes and functions ``mod`` itself defines (not imports)."""
    return {n: v for n, v in vars(mod).items()
            if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))
            and v.__module__ == mod.__name__}


def test_the_walk_finds_the_modules() -> None:
    for m in ("edge_sdk.errors", "edge_sdk.privacy.rdp", "edge_sdk.mqtt", "aggregator.errors",
              "aggregator.rounds"):
        assert m in MODULE_NAMES


def _xfail_if_known(name: str) -> list[pytest.MarkDecorator]:
    step = KNOWN_DISHONEST.get(name)
    return [] if step is None else [pytest.mark.xfail(strict=True, reason=f"plan15 step {step}")]


@pytest.mark.parametrize("name", [pytest.param(n, marks=_xfail_if_known(n))
                                  for n in MODULE_NAMES])
def test_all_is_honest(name: str) -> None:
    mod = importlib.import_module(name)
    defined = _defined_here(mod)
    exported = getattr(mod, "__all__", None)
    if exported is None:
        assert not defined, f"{name} defines public {sorted(defined)} but has no __all__"
        return
    assert all(isinstance(n, str) for n in exported), f"{name}.__all__ holds a non-string"
    assert len(set(exported)) == len(exported), f"{name}.__all__ lists a name twice"
    missing = [n for n in exported if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ lists names the module lacks: {missing}"
    unlisted = sorted(set(defined) - set(exported))
    assert not unlisted, f"{name} defines public {unlisted} outside __all__"


def _exception_classes(package: str) -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in MODULE_NAMES:
        if name.split(".")[0] != package:
            continue
        for n, v in _defined_here(importlib.import_module(name)).items():
            if inspect.isclass(v) and issubclass(v, BaseException):
                assert n not in found, f"two public exception classes named {n} in {package}"
                found[n] = v
    return found


def _drawn(package: str) -> list[str]:
    """The class names in the tree of ``<package>.errors``'s docstring."""
    doc = importlib.import_module(f"{package}.errors").__doc__ or ""
    tree = doc.split("::", 1)[1]
    return re.findall(r"^    (?:[ |]*\+-- )?([A-Z]\w+)", tree, flags=re.MULTILINE)


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_one_exception_root_per_package(package: str) -> None:
    root = ROOTS[package]
    classes = _exception_classes(package)
    assert root in classes.values() and len(classes) >= 3
    strays = sorted(n for n, c in classes.items() if not issubclass(c, root))
    assert not strays, f"{package} exceptions outside {root.__name__}: {strays}"


@pytest.mark.parametrize("package", sorted(ROOTS))
def test_errors_docstring_draws_the_whole_tree(package: str) -> None:
    classes = _exception_classes(package)
    drawn = _drawn(package)
    assert drawn[0] == ROOTS[package].__name__
    assert sorted(drawn) == sorted(classes), (
        f"{package}.errors draws {sorted(drawn)}, the package defines {sorted(classes)}")


def test_error_mixins_keep_old_callers_working() -> None:
    # callers that caught ValueError / ArithmeticError before the one root still do
    from edge_sdk.config import ConfigError
    from edge_sdk.ddp import ConditionalRoundingFailed
    from edge_sdk.model import UnsupportedLayer
    from edge_sdk.train import TrainingDiverged

    assert issubclass(ConfigError, ValueError) and issubclass(UnsupportedLayer, ValueError)
    assert issubclass(TrainingDiverged, ArithmeticError)
    assert issubclass(ConditionalRoundingFailed, ArithmeticError)
