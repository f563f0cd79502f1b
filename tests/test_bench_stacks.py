"""The stacks benchmark's import timing runs the device stack from a bytecode cache."""

from __future__ import annotations

from pathlib import Path

from tools.bench.stacks import _import_child


def test_device_import_fills_and_uses_its_private_bytecode_cache(
        tmp_path: Path, monkeypatch) -> None:
    # the environment may forbid bytecode (PYTHONDONTWRITEBYTECODE): the cache is used anyway
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    first = _import_child("device", str(tmp_path))
    cached = {p.name.split(".")[0] for p in tmp_path.rglob("edge_sdk/**/*.pyc")}
    assert {"engine", "train", "compress", "client"} <= cached  # edge_sdk.secagg.client
    stamp = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.pyc")}
    second = _import_child("device", str(tmp_path))
    # read, not rewritten
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.pyc")} == stamp
    assert first["s"] > 0 and second["s"] > 0 and second["rss_mib"] > 0
