"""Enrollment: one command prepares a fleet directory.

``enroll(out, devices=N, fleet=...)`` (CLI ``fedge enroll --devices N --fleet NAME --out
DIR``) generates every party's long-term identity (Ed25519 signing + X25519 agreement keys
for devices, Ed25519 for the aggregator), writes the public registry, and, unless told
not to, the broker's configuration (``tools.broker.write_broker_config``), each device's
ledger (provisioned with its budget) and ready-to-run TOML configs::

    DIR/
      registry.json                 public: the aggregator's and every device's public keys
      broker/                       mosquitto.conf, passwords, acl, ca.crt, credentials.json
      aggregator/identity.key       0600 JSON, the aggregator's signing key
      aggregator/password           0600, its MQTT password
      aggregator/aggregator.toml    `fedge aggregator --config` (checkpoint in state/)
      devices/<dev>/identity.key    0600 JSON, the device's keys
      devices/<dev>/password        0600, its MQTT password
      devices/<dev>/ledger.db       its privacy ledger (created here: provisioning)
      devices/<dev>/device.toml     `fedge device --config` / DeviceConfig.from_toml

The file formats are JSON (keys as hex) and plain text, never pickle; they are
documented in ``edge_sdk.device``, which reads them. Paths inside the TOML files are
relative to the file, so the directory can be moved or its parts copied to devices.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_sdk import wire
from edge_sdk.config import aggregator_key_doc, device_key_doc, registry_doc
from edge_sdk.device import Device, DeviceConfig
from edge_sdk.secagg import AggregatorIdentity, DeviceIdentity, Registry
from tools.broker import BrokerConfig, device_names, write_broker_config

__all__ = ["Enrolled", "enroll", "toml_text"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Enrolled:
    """Where :func:`enroll` put things."""

    directory: Path
    fleet: str
    registry: Path
    aggregator_config: Path | None
    device_configs: Mapping[str, Path]  # device -> device.toml (empty without configs)
    broker_dir: Path | None


def _write_private(path: Path, data: str) -> None:
    """Create ``path`` 0600 from the start (never world-readable, not even briefly)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(data)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v))  # JSON string escapes are valid TOML basic strings
    raise ValueError(f"cannot write {v!r} to TOML")


def toml_text(data: Mapping[str, Any], comment: str = "") -> str:
    """A flat TOML document: top-level scalars, then one level of tables (None skipped)."""
    lines = [f"# {c}" for c in comment.splitlines()]
    tables = {k: v for k, v in data.items() if isinstance(v, Mapping)}
    lines += [f"{k} = {_toml_value(v)}" for k, v in data.items()
              if not isinstance(v, Mapping) and v is not None]
    for name, table in tables.items():
        lines += ["", f"[{name}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def _rel(target: Path, start: Path) -> str:
    return os.path.relpath(target, start)


def enroll(
    out: str | os.PathLike[str],
    *,
    devices: int | Sequence[str],
    fleet: str,
    broker: bool = True,
    port: int | None = None,
    tls: bool = True,
    host: str = "127.0.0.1",
    ledgers: bool = True,
    budget_epsilon: float = 10.0,
    budget_delta: float = 1e-5,
    model: str = "logreg-64-10",
    policy: Mapping[str, Any] | None = None,
    messages_per_round: int = 64,
    broker_config: BrokerConfig | None = None,
    device_settings: Mapping[str, Any] | None = None,
    metrics_port: int | None = 9464,
) -> Enrolled:
    """Generate identities and write a fleet directory (see the module docstring).

    Args:
        devices: a count (names ``dev-0000``...) or the device names.
        broker: also write the broker's config and the services' TOML configs (which
            need its port and credentials).
        port: broker port (default 8883 with TLS, 1883 without).
        ledgers: provision each device's ledger with the budget.
        policy: ``[policy]`` settings for aggregator.toml (``RoundPolicy`` fields);
            default a cohort of min(10, n) devices.
        broker_config: use this broker configuration (``fedge broker config``, or a
            ``tools.broker.Broker``'s) for credentials and the TOML configs instead of
            writing one; its fleet and device names must match.
        device_settings: extra top-level settings for every device.toml
            (``DeviceConfig`` fields, e.g. ``checkin_every``).
        metrics_port: the aggregator's Prometheus port (0: any free one; None: none).

    Raises:
        ValueError: bad names or counts, or ``out`` already holds a registry (enrolling
            again would replace every key; remove the directory first).
    """
    wire.check_name("fleet", fleet)
    names = device_names(devices) if isinstance(devices, int) else list(devices)
    for name in names:
        wire.check_name("device", name)
    if not names or len(set(names)) != len(names) or "aggregator" in names:
        raise ValueError("devices must be distinct names other than 'aggregator'")
    root = Path(out)
    if (root / "registry.json").exists():
        raise ValueError(f"{root} already holds an enrolled fleet (registry.json); "
                         f"refusing to replace its keys")
    root.mkdir(parents=True, exist_ok=True)

    agg = AggregatorIdentity.generate()
    ids = [DeviceIdentity.generate(name) for name in names]
    registry = Registry.of(agg, ids)
    reg_path = root / "registry.json"
    reg_path.write_text(json.dumps(registry_doc(fleet, registry), indent=1) + "\n")

    agg_dir = root / "aggregator"
    agg_dir.mkdir(exist_ok=True)
    _write_private(agg_dir / "identity.key", json.dumps(aggregator_key_doc(fleet, agg)))
    dev_dirs = {}
    for ident in ids:
        d = root / "devices" / ident.device
        d.mkdir(parents=True, exist_ok=True)
        _write_private(d / "identity.key", json.dumps(device_key_doc(fleet, ident)))
        dev_dirs[ident.device] = d

    broker_dir = None
    agg_config = None
    dev_configs: dict[str, Path] = {}
    if broker_config is not None:
        if broker_config.fleet != fleet or set(broker_config.devices) != set(names):
            raise ValueError(f"broker_config is for fleet {broker_config.fleet!r} with "
                             f"{len(broker_config.devices)} devices, not this enrollment")
        broker = True
    if broker:
        if broker_config is None:
            port = port if port is not None else (8883 if tls else 1883)
            broker_dir = root / "broker"
            bc = write_broker_config(broker_dir, devices=names, fleet=fleet, port=port,
                                     tls=tls, host=host, messages_per_round=messages_per_round)
        else:
            bc, broker_dir, port, host = (broker_config, broker_config.directory,
                                          broker_config.port, broker_config.host)
        _write_private(agg_dir / "password", bc.password("aggregator") + "\n")
        (agg_dir / "state").mkdir(exist_ok=True)
        pol = {"cohort_size": max(3, min(10, len(names))), "stage_timeout": 30.0,
               **(policy or {})}
        agg_config = agg_dir / "aggregator.toml"
        agg_config.write_text(toml_text({
            "fleet": fleet, "identity": "identity.key",
            "registry": _rel(reg_path, agg_dir), "checkpoint": "state/aggregator.ckpt",
            "model": model, "model_seed": 0,
            "broker": {"host": host, "port": port, "username": "aggregator",
                       "password_file": "password",
                       "ca_file": _rel(bc.ca_file, agg_dir) if bc.ca_file else None},
            "metrics": {} if metrics_port is None else {"port": metrics_port,
                                                        "host": "127.0.0.1"},
            "policy": pol,
        }, comment=f"fedge aggregator for fleet {fleet!r} (written by fedge enroll)"))
        for name in names:
            d = dev_dirs[name]
            _write_private(d / "password", bc.password(name) + "\n")
            path = d / "device.toml"
            path.write_text(toml_text({
                "fleet": fleet, "device": name, "model": model,
                **(device_settings or {}),
                "identity": "identity.key", "registry": _rel(reg_path, d),
                "ledger": "ledger.db",
                "budget": {"epsilon": float(budget_epsilon), "delta": float(budget_delta)},
                "broker": {"host": host, "port": port, "password_file": "password",
                           "ca_file": _rel(bc.ca_file, d) if bc.ca_file else None},
            }, comment=f"fedge device {name!r} of fleet {fleet!r} (written by fedge enroll)"))
            dev_configs[name] = path
    if ledgers:
        for name, d in dev_dirs.items():
            Device.provision(DeviceConfig(
                fleet=fleet, device=name, broker_port=1, password_file=d / "password",
                identity=d / "identity.key", registry=reg_path, ledger=d / "ledger.db",
                budget_epsilon=float(budget_epsilon), budget_delta=float(budget_delta),
                model=model))
    return Enrolled(directory=root, fleet=fleet, registry=reg_path, aggregator_config=agg_config,
                    device_configs=dev_configs, broker_dir=broker_dir)
