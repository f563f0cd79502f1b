"""The public surface of edge_sdk.privacy: a curated __all__, kept honest."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import edge_sdk.privacy as privacy

PACKAGE = pathlib.Path(privacy.__file__).parent


def test_all_names_exist_and_are_sorted_and_unique() -> None:
    assert len(set(privacy.__all__)) == len(privacy.__all__)
    assert privacy.__all__ == sorted(privacy.__all__, key=lambda s: (not s.isupper(), s))
    for name in privacy.__all__:
        assert hasattr(privacy, name), name


def test_every_public_module_name_is_exported_or_deliberately_not() -> None:
    # paper bounds are not necessarily sound (paper_bounds; binomial: cpSGD Thm 1); _math internal
    not_reexported = {"paper_bounds", "binomial", "_math"}
    for path in PACKAGE.glob("*.py"):
        if path.stem in not_reexported or path.stem == "__init__":
            continue
        module = __import__(f"edge_sdk.privacy.{path.stem}", fromlist=["__all__"])
        for name in module.__all__:
            if name in {"Adjacency", "Conversion", "AccountantName"}:
                continue  # type aliases, importable from their modules
            assert name in privacy.__all__, f"{path.stem}.{name} missing from __all__"


def test_device_path_imports_numpy_and_stdlib_only() -> None:
    allowed = {"__future__", "collections", "dataclasses", "decimal", "functools", "math",
               "numbers", "typing", "numpy", "edge_sdk"}
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{path.name} imports {roots - allowed}"


def test_training_loads_only_the_events_and_the_rest_on_first_use() -> None:
    # edge_sdk.privacy loads its accountants lazily (PEP 562): a device's training step needs
    # the events only; the first use of an accountant's name loads its module, once.
    code = ("import json, sys; import edge_sdk.train; "
            "before = sorted(m for m in sys.modules if m.startswith('edge_sdk.privacy')); "
            "from edge_sdk.privacy import RdpAccountant; import edge_sdk.privacy as p; "
            "print(json.dumps([before, RdpAccountant.__module__, p.RdpAccountant is RdpAccountant,"
            " 'edge_sdk.privacy.pld' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    before, where, same, pld = json.loads(done.stdout)
    assert before == ["edge_sdk.privacy", "edge_sdk.privacy.events"]
    assert (where, same, pld) == ("edge_sdk.privacy.rdp", True, False)


def test_a_name_the_package_lacks_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchAccountant'"):
        _ = privacy.NoSuchAccountant
    assert set(privacy.__all__) <= set(dir(privacy))
