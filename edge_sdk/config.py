"""Configuration files shared by the device and the aggregator: key files, the registry,
TOML helpers and the model manifest's location.

Nothing here talks to the network or loads a model: the device agent
(:mod:`edge_sdk.device`, which adds the MQTT adapter) and the aggregator service
(:mod:`aggregator.service`) both read their files through these functions, and importing
this module pulls in neither paho-mqtt nor onnxruntime nor the ``models`` package.

File formats (all JSON, never pickle; ``fedge enroll`` writes them)::

    identity key (0600)  {"format": "fedge-device-key", "v": 1, "fleet": F, "device": D,
                          "sign_key": hex(Ed25519 private seed, 32 bytes),
                          "agree_key": hex(X25519 private key, 32 bytes)}
    aggregator key (0600){"format": "fedge-aggregator-key", "v": 1, "fleet": F,
                          "sign_key": hex(Ed25519 private seed, 32 bytes)}
    registry (public)    {"format": "fedge-registry", "v": 1, "fleet": F,
                          "aggregator_key": hex(Ed25519 public key),
                          "devices": {D: {"sign_key": hex, "agree_key": hex}, ...}}
    password (0600)      the MQTT password, one line

Key files readable by group or others are refused (:class:`ConfigError`), as ssh does.

Models: a configuration names its model either by a manifest path or by a zoo name
(``model = "logreg-64-10"``). A zoo name is looked up in a directory the caller injects
(``zoo_dir``: the composition root knows where the exported models are; in this
repository ``tools/cli.py`` passes ``models.ONNX_DIR``), so the SDK never imports the
zoo.

Errors::

    ValueError
     +-- ConfigError      a configuration, key or registry file that cannot be used
"""

from __future__ import annotations

import json
import os
import stat
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edge_sdk.errors import EdgeError
from edge_sdk.secagg import AggregatorIdentity, DeviceIdentity, Registry

__all__ = [
    "ConfigError",
    "aggregator_key_doc",
    "device_key_doc",
    "load_aggregator_identity",
    "load_device_identity",
    "load_registry",
    "path_in",
    "read_secret_file",
    "read_toml",
    "registry_doc",
    "resolve_manifest",
    "take",
]

_KEY_FORMAT = "fedge-device-key"
_AGG_KEY_FORMAT = "fedge-aggregator-key"
_REGISTRY_FORMAT = "fedge-registry"
_FORMAT_VERSION = 1


class ConfigError(EdgeError, ValueError):
    """A configuration, key, password or registry file that cannot be used (named)."""


# =========================================================================== key files


def device_key_doc(fleet: str, identity: DeviceIdentity) -> dict[str, Any]:
    """The JSON document of a device's key file (secret)."""
    raw = identity.private_bytes()
    return {"format": _KEY_FORMAT, "v": _FORMAT_VERSION, "fleet": fleet,
            "device": identity.device, "sign_key": raw[:32].hex(), "agree_key": raw[32:].hex()}


def aggregator_key_doc(fleet: str, identity: AggregatorIdentity) -> dict[str, Any]:
    """The JSON document of the aggregator's key file (secret)."""
    return {"format": _AGG_KEY_FORMAT, "v": _FORMAT_VERSION, "fleet": fleet,
            "sign_key": identity.private_bytes().hex()}


def registry_doc(fleet: str, registry: Registry) -> dict[str, Any]:
    """The JSON document of the fleet's public registry."""
    return {"format": _REGISTRY_FORMAT, "v": _FORMAT_VERSION, "fleet": fleet,
            **registry.to_json()}


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """Bytes of a secret file; refuses one that group or others may read.

    Raises:
        ConfigError: missing, unreadable, or too permissive.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{path}: secret file is accessible by group/others "
                              f"(mode {stat.filemode(mode)}); chmod 600 it")
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None


def _json_doc(path: Path, raw: bytes, fmt: str, fleet: str | None) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt or doc.get("v") != _FORMAT_VERSION:
        raise ConfigError(f"{path}: not a {fmt} v{_FORMAT_VERSION} file")
    if fleet is not None and doc.get("fleet") != fleet:
        raise ConfigError(f"{path}: belongs to fleet {doc.get('fleet')!r}, not {fleet!r}")
    return doc


def _hex(path: Path, doc: Mapping[str, Any], key: str, size: int) -> bytes:
    v = doc.get(key)
    try:
        raw = bytes.fromhex(v) if isinstance(v, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise ConfigError(f"{path}: field {key!r} must be {size} bytes in hex")
    return raw


def load_device_identity(path: str | os.PathLike[str], *, fleet: str | None = None,
                         device: str | None = None) -> DeviceIdentity:
    """A device's keys from its key file (checked against ``fleet`` and ``device``)."""
    path = Path(path)
    doc = _json_doc(path, read_secret_file(path), _KEY_FORMAT, fleet)
    name = doc.get("device")
    if device is not None and name != device:
        raise ConfigError(f"{path}: holds the keys of {name!r}, not {device!r}")
    try:
        return DeviceIdentity.from_private_bytes(
            str(name), _hex(path, doc, "sign_key", 32) + _hex(path, doc, "agree_key", 32))
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def load_aggregator_identity(path: str | os.PathLike[str], *,
                             fleet: str | None = None) -> AggregatorIdentity:
    """The aggregator's signing key from its key file."""
    path = Path(path)
    doc = _json_doc(path, read_secret_file(path), _AGG_KEY_FORMAT, fleet)
    return AggregatorIdentity.from_private_bytes(_hex(path, doc, "sign_key", 32))


def load_registry(path: str | os.PathLike[str], *, fleet: str | None = None) -> Registry:
    """The fleet's public registry (the aggregator's key and every enrolled device's)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    doc = _json_doc(path, raw, _REGISTRY_FORMAT, fleet)
    try:
        return Registry.from_json(doc)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def resolve_manifest(model: str | None, manifest: Path | None, *,
                     zoo_dir: Path | None) -> Path:
    """The model manifest: ``manifest`` (a path), or the zoo name ``model``
    (``logreg-64-10``) looked up as ``<zoo_dir>/<model>.json``.

    Args:
        model, manifest: exactly one of them.
        zoo_dir: the directory of exported models, injected by the composition root
            (``models.ONNX_DIR`` in this repository); only needed for ``model``.

    Raises:
        ConfigError: both or neither given, ``model`` without ``zoo_dir``, or no such
            exported model in ``zoo_dir``.
    """
    if (model is None) == (manifest is None):
        raise ConfigError("give exactly one of 'model' (a zoo name) and 'manifest' (a path)")
    if manifest is not None:
        return manifest
    if zoo_dir is None:
        raise ConfigError(f"model {model!r} is a zoo name, but no zoo directory was given: "
                          f"pass zoo_dir (the directory of exported models, e.g. "
                          f"models.ONNX_DIR) or set 'manifest' to the model's manifest path")
    path = Path(zoo_dir) / f"{model}.json"
    if not path.exists():
        known = sorted(p.stem for p in Path(zoo_dir).glob("*.json"))
        raise ConfigError(f"no exported model {model!r} in {zoo_dir}; exported: {known}")
    return path


# =========================================================================== config


def read_toml(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Path]:
    """A TOML file's tables and its directory (relative paths in it are relative to it)."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text()), path.resolve().parent
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def take(table: Mapping[str, Any], known: set[str], where: str) -> dict[str, Any]:
    """``table`` with dashes in keys turned to underscores; unknown keys are an error."""
    out = {k.replace("-", "_"): v for k, v in table.items()}
    unknown = sorted(set(out) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {unknown}; known: {sorted(known)}")
    return out


def path_in(base: Path, value: object, name: str) -> Path | None:
    """The path setting ``name`` (``value``; None stays None), relative to ``base``."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty path string, got {value!r}")
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p

