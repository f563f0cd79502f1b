"""``fedge doctor --config DEVICE_TOML``: check, on a device, what makes rounds fail in the
field, each with a clear message and its fix. Device dependencies only (no torch, no
datasets): it reads the same files ``fedge device`` reads and talks to the same broker.

Checks, in order (a failed check names the fix; exit status 0 only if all pass)::

    config   the TOML loads; key, registry and password files are readable, the secrets
             private (0600) in directories no one else may write to, and this device is
             enrolled with these keys
    disk     free space on the ledger's file system (the WAL and its checkpoints)
    ledger   the privacy ledger opens fail-closed and passes its full audit
             (``Ledger.open``: sqlite integrity, page audit, hash chain, reservations), for
             this device and budget; read-only mounts are named
    clock    the wall clock against every time the device can know without NTP: the CA
             certificate's and the broker's served certificate's validity windows (a clock
             outside them fails the TLS handshake), and the ledger's newest entry (the
             clock went back). The wire carries no timestamps (neither the retained model
             nor the round plan), so skew inside these bounds cannot be measured from here;
             rounds do not depend on it (their deadlines run on the monotonic clock).
    broker   a real MQTT v5 session over TLS with the device's credentials: CONNACK
             (password), a QoS 1 publish to the device's own status topic acknowledged
             without error (its write ACL), and the retained global model delivered on
             the subscription the device uses (its read ACL). The device's status topic
             is write-only under the fleet's ACLs, so the read half of the round trip is
             the model topic.
    model    the retained model message decodes, carries the aggregator's valid signature
             (registry) and fits the device's model files: parameter shapes and float32, as
             the session checks on adoption; the local ONNX graphs load. The wire carries no
             digest of the model files, so "matching" means this architecture check; both
             sha256 figures are printed for the operator to compare with the gateway's.

The broker check connects as the device (the broker forces the client id to the user
name), resuming the device's persistent session with ``clean_start=False`` and never
acknowledging a delivered message, so messages queued for the device are redelivered to it
when it reconnects. A running device agent is still disconnected while the doctor runs:
stop the service first (``systemctl stop fedge-device``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import ssl
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography import x509

__all__ = [
    "DEFAULT_MIN_FREE_MIB",
    "Finding",
    "add_doctor_parser",
    "clock_finding",
    "disk_finding",
    "doctor",
    "run_doctor",
]

DEFAULT_MIN_FREE_MIB = 64
"""Free space the ledger's file system must keep by default (MiB). A ledger entry is under
1 KiB, so this holds years of rounds, plus room for sqlite's WAL and the checkpoint that
copies it back into the main file."""
_CLOCK_BACK_TOLERANCE_S = 300.0  # a ledger write this far in the future is a clock set back


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """The outcome of one check: ``ok``, what was seen, and (when not ok) the fix."""

    check: str
    ok: bool
    message: str
    fix: str = ""


@dataclass(slots=True)
class _Probe:
    """What one MQTT session with the broker showed."""

    error: str | None = None            # no session at all (socket, TLS): why
    connack: Any = None                 # paho ReasonCode
    puback: Any = None                  # ReasonCode of the status publish
    model: bytes | None = None          # the retained model message
    model_topic: str = ""
    seconds: float = 0.0


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# =========================================================================== pure checks


def disk_finding(path: Path, *, free_bytes: int, need_bytes: int) -> Finding:
    """Enough room on ``path``'s file system (``free_bytes`` available to the service user,
    ``need_bytes`` required)?"""
    mib = free_bytes / 2**20
    if free_bytes >= need_bytes:
        return Finding(check="disk", ok=True,
                       message=f"{mib:.0f} MiB free for the ledger on {path} "
                               f"(need {need_bytes / 2**20:.0f} MiB)")
    return Finding(check="disk", ok=False,
                   message=f"only {mib:.1f} MiB free on {path}, need {need_bytes / 2**20:.0f} "
                           f"MiB: the ledger's next write (a reservation, before any upload) "
                           f"would fail and the device would stop taking part",
                   fix=f"free space on the file system of {path} (logs, old data), or move "
                       f"the ledger to persistent storage with room (StateDirectory of "
                       f"fedge-device.service); never delete the ledger itself")


def clock_finding(now: float, *, windows: list[tuple[str, float, float]],
                  last_write: float | None, notes: list[str] | None = None) -> Finding:
    """The wall clock ``now`` (seconds since the epoch) against what bounds it.

    Args:
        windows: (what, not_before, not_after) of certificates the device checks in TLS.
        last_write: the newest ledger entry's time (this device wrote it), or None.
        notes: what could not be checked (said in the message).
    """
    problems: list[str] = []
    fixes: list[str] = []
    for what, lo, hi in windows:
        if now < lo:
            problems.append(f"the clock ({_utc(now)}) is before the {what}'s validity start "
                            f"{_utc(lo)}: it is behind by at least {lo - now:.0f} s, and TLS "
                            f"rejects the certificate as not yet valid")
            fixes.append("set the clock (timedatectl set-ntp true, or date -s from a "
                         "trusted source; a Pi without an RTC needs network time at boot)")
        elif now > hi:
            problems.append(f"the clock ({_utc(now)}) is after the {what}'s expiry {_utc(hi)}: "
                            f"the certificate has expired, or the clock is ahead by at least "
                            f"{now - hi:.0f} s")
            fixes.append("check the clock (date -u); if it is right, renew the broker's "
                         "certificates (fedge broker config) and copy ca.crt to the devices")
    if last_write is not None and now + _CLOCK_BACK_TOLERANCE_S < last_write:
        problems.append(f"the clock ({_utc(now)}) is {last_write - now:.0f} s before the "
                        f"ledger's newest entry ({_utc(last_write)}): it was set back")
        fixes.append("set the clock (timedatectl set-ntp true); the ledger keeps counting "
                      "correctly, but its entry times will be out of order")
    if problems:
        return Finding(check="clock", ok=False, message="; ".join(problems),
                       fix="; ".join(dict.fromkeys(fixes)))
    seen = [f"the {w}'s validity {_utc(lo)} .. {_utc(hi)}" for w, lo, hi in windows]
    if last_write is not None:
        seen.append(f"after the ledger's newest entry {_utc(last_write)}")
    return Finding(check="clock", ok=True,
                   message=f"{_utc(now)} lies within " + "; ".join(seen or ["nothing"])
                           + " (no timestamp on the wire: skew inside these bounds is not "
                             "measurable, and round deadlines use the monotonic clock)"
                           + "".join(f"; {n}" for n in notes or []))


def _perm_problem(path: Path, *, secret: bool) -> str | None:
    try:
        mode = path.stat().st_mode
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if secret and mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"{path}: secret file is accessible by group/others (mode {stat.filemode(mode)})"
    if not secret and mode & (stat.S_IWGRP | stat.S_IWOTH):
        # others could swap the keys or the ledger for their own
        return f"{path}: directory is writable by group/others (mode {stat.filemode(mode)})"
    return None


# =========================================================================== file checks


def _config_finding(config: Any) -> tuple[Finding, Any]:
    from edge_sdk.config import (
        ConfigError,
        load_device_identity,
        load_registry,
        read_secret_file,
    )

    problems = [p for p in (
        _perm_problem(config.identity, secret=True),
        _perm_problem(config.password_file, secret=True),
        _perm_problem(config.identity.parent, secret=False),
        _perm_problem(config.ledger.parent, secret=False),
    ) if p is not None]
    registry = None
    try:
        identity = load_device_identity(config.identity, fleet=config.fleet,
                                        device=config.device)
        registry = load_registry(config.registry, fleet=config.fleet)
        if registry.devices.get(config.device) != identity.enrollment():
            problems.append(f"{config.registry}: device {config.device!r} is not enrolled "
                            f"with the keys in {config.identity}")
        read_secret_file(config.password_file)
    except ConfigError as e:
        problems.append(str(e))
    if problems:
        return Finding(check="config", ok=False, message="; ".join(dict.fromkeys(problems)),
                       fix="keys and password 0600 and directories 0700, owned by the "
                           "service user (chown -R fedge: /etc/fedge /var/lib/fedge; chmod "
                           "600 the key and password files, 700 their directories); the "
                           "identity and registry from the same `fedge enroll`"), registry
    return Finding(check="config", ok=True,
                   message=f"device {config.device!r} of fleet {config.fleet!r}: keys "
                           f"enrolled in the registry, secrets private"), registry


def _ledger_finding(config: Any) -> tuple[Finding, float | None]:
    from edge_sdk.ledger import Budget, Ledger, LedgerCorrupted, LedgerError

    path = config.ledger
    try:
        ledger = Ledger.open(path, budget=Budget(epsilon=config.budget_epsilon,
                                                 delta=config.budget_delta),
                             device_id=config.device, create=False)
    except LedgerCorrupted as e:
        if not Path(path).exists():
            fix = (f"restore {path} from the device's backup. Only a device that has never "
                   f"trained may get a new ledger (fedge enroll provisions one); a new "
                   f"ledger on a device that has spent would forget that spend")
        else:
            fix = (f"stop the device and keep {path} for inspection (fedge ledger verify "
                   f"--path {path}); restore the last good backup. Never delete or recreate "
                   f"it: the device must not train on a ledger it cannot trust")
        return Finding(check="ledger", ok=False, message=f"ledger failed its audit: {e}",
                       fix=fix), None
    except LedgerError as e:
        return Finding(check="ledger", ok=False, message=str(e),
                       fix="device.toml's device name and [budget] must be the ones the "
                           "ledger was provisioned with (fedge ledger show --path "
                           f"{path})"), None
    try:
        entries = ledger.entries()
        last = max((e.time for e in entries), default=None)
        spent = ledger.spent()
        read_only = ledger.read_only
        remaining = ledger.remaining()
    finally:
        ledger.close()
    if read_only is not None:
        return Finding(check="ledger", ok=False,
                       message=f"{path} is intact but cannot be written: {read_only}",
                       fix="put the ledger on writable persistent storage (remount it "
                           "read-write; StateDirectory=fedge in fedge-device.service)"), last
    eps = f"{spent.local_epsilon:.4g}"
    return Finding(check="ledger", ok=True,
                   message=f"{path}: {len(entries)} entries pass the audit; local epsilon "
                           f"spent {eps} of {config.budget_epsilon:g}, remaining "
                           f"{remaining:.4g}"), last


# =========================================================================== the broker


def _cert_window(cert: x509.Certificate) -> tuple[float, float]:
    return cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp()


def _served_certificate(host: str, port: int, timeout: float) -> x509.Certificate | None:
    """The broker's certificate as served, fetched without verifying it (verification is
    the broker check's job; here only its validity window matters, and a skewed clock
    would make verification fail before the window could be read)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    except OSError:
        return None
    return None if der is None else x509.load_der_x509_certificate(der)


def _probe(config: Any, password: str, timeout: float) -> _Probe:
    """One MQTT v5 session as the device (see the module docstring)."""
    from edge_sdk import wire
    from edge_sdk.mqtt import (
        OFFLINE,
        BrokerAddress,
        ClientConfig,
        connect_properties,
        make_client,
    )

    out = _Probe(model_topic=wire.model_topic(config.fleet))
    status = wire.status_topic(config.fleet, config.device)
    cc = ClientConfig(username=config.mqtt_username, password=password, status_topic=status,
                      keepalive_s=config.keepalive_s)
    client = make_client(BrokerAddress(host=config.broker_host, port=config.broker_port,
                                       ca_file=None if config.ca_file is None
                                       else str(config.ca_file)), cc)
    client.manual_ack_set(True)  # nothing queued for the device is consumed here
    client.suppress_exceptions = True
    pub_mid: list[int] = []

    def on_connect(c: Any, _u: Any, _flags: Any, reason: Any, _props: Any) -> None:
        out.connack = reason
        if not reason.is_failure:
            c.subscribe(out.model_topic, qos=1)
            pub_mid.append(c.publish(status, OFFLINE, qos=1, retain=True).mid)

    def on_publish(_c: Any, _u: Any, mid: int, reason: Any, _props: Any) -> None:
        if mid in pub_mid:
            out.puback = reason

    def on_message(_c: Any, _u: Any, msg: Any) -> None:
        if msg.topic == out.model_topic and out.model is None:
            out.model = bytes(msg.payload)

    client.on_connect, client.on_publish, client.on_message = on_connect, on_publish, on_message
    start = time.monotonic()
    try:
        client.connect(config.broker_host, config.broker_port, keepalive=config.keepalive_s,
                       clean_start=False, properties=connect_properties(cc))
    except ssl.SSLError as e:
        out.error = f"TLS handshake with {config.broker_host}:{config.broker_port} failed: {e}"
        return out
    except OSError as e:
        out.error = (f"cannot reach {config.broker_host}:{config.broker_port}: "
                     f"{e.strerror or e}")
        return out
    deadline = start + timeout
    try:
        while time.monotonic() < deadline:
            client.loop(timeout=0.05)
            if out.connack is not None and out.connack.is_failure:
                break
            if out.puback is not None and out.model is not None:
                break
    finally:
        out.seconds = time.monotonic() - start
        if client.is_connected():
            client.disconnect()
            client.loop(timeout=0.2)
    return out


def _broker_finding(config: Any, probe: _Probe, timeout: float) -> Finding:
    where = f"{config.broker_host}:{config.broker_port}"
    user = config.mqtt_username
    if probe.error is not None:
        fix = ("check the gateway is up and mosquitto running (systemctl status mosquitto), "
               "the [broker] host and port in device.toml, and the network path")
        if "certificate" in probe.error.lower():
            fix = ("check the clock (see the clock check) and that [broker] ca_file is the "
                   "fleet's CA (broker/ca.crt from `fedge enroll`) and host the name in the "
                   "broker's certificate")
        return Finding(check="broker", ok=False, message=probe.error, fix=fix)
    if probe.connack is None:
        return Finding(check="broker", ok=False,
                       message=f"no CONNACK from {where} within {timeout:g} s",
                       fix="check that the port is the fleet's mosquitto listener (TLS "
                           "when ca_file is set) and that the broker is not overloaded")
    if probe.connack.is_failure:
        return Finding(check="broker", ok=False,
                       message=f"{where} refused user {user!r}: {probe.connack}",
                       fix=f"the password in {config.password_file} must be the broker's "
                           f"for {user!r} (devices/{config.device}/password from `fedge "
                           f"enroll`; the gateway's passwords file holds its hash)")
    if probe.puback is None:
        return Finding(check="broker", ok=False,
                       message=f"connected as {user!r}, but the publish to the status topic "
                               f"was not acknowledged within {timeout:g} s",
                       fix="check the broker's load and its log (log_dest in mosquitto.conf)")
    if probe.puback.is_failure:
        return Finding(check="broker", ok=False,
                       message=f"connected as {user!r}, but the broker refused its publish "
                               f"to its own status topic: {probe.puback}",
                       fix="regenerate the broker's ACL for this fleet and device (fedge "
                           "broker config / fedge enroll) and reload mosquitto")
    read = ("the retained model arrived on its subscription" if probe.model is not None
            else "no retained model arrived (see the model check)")
    return Finding(check="broker", ok=probe.model is not None,
                   message=f"TLS session with {where} as {user!r}: password accepted, "
                           f"status publish acknowledged, {read} ({probe.seconds:.2f} s)",
                   fix="" if probe.model is not None else
                   f"the ACL must let {user!r} read {probe.model_topic}: regenerate it "
                   f"(fedge broker config) if the model check says the aggregator published")


def _model_finding(config: Any, probe: _Probe, registry: Any, timeout: float) -> Finding:
    from edge_sdk import wire
    from edge_sdk.config import resolve_manifest
    from edge_sdk.engine import load_engine, load_manifest
    from edge_sdk.errors import RemoteProtocolError

    try:
        path = resolve_manifest(config.model, config.manifest, zoo_dir=config.zoo_dir)
        manifest = load_manifest(path)
        files = [path, manifest.grad_graph, manifest.infer_graph]
        if manifest.masked_grad_graph is not None:
            files.append(manifest.masked_grad_graph)
        digest = hashlib.sha256()
        for f in files:
            digest.update(Path(f).read_bytes())
        load_engine(path, backend=config.backend, threads=1)
    except Exception as e:  # noqa: BLE001 (onnxruntime raises its own types for a bad graph)
        return Finding(check="model", ok=False, message=f"the device's model files: {e}",
                       fix="reinstall the model files the fleet uses (the gateway's "
                           "aggregator.toml names them: model = ... or manifest = ...)")
    want = [shape for _, shape in manifest.spec.param_shapes()]
    local = f"local {manifest.name} files sha256 {digest.hexdigest()[:16]}"
    if probe.model is None:
        why = probe.error or f"nothing on {probe.model_topic} within {timeout:g} s"
        return Finding(check="model", ok=False,
                       message=f"no retained global model to compare with ({why}); {local}",
                       fix="start the aggregator (systemctl start fedge-aggregator on the "
                           "gateway): it publishes the model, retained, when it starts")
    try:
        msg = wire.decode(probe.model, wire.MODEL_KINDS)
        if not isinstance(msg, wire.ModelUpdate):
            raise RemoteProtocolError(f"a {msg.KIND} message on the model topic")
        if registry is None:
            raise RemoteProtocolError("no registry to check the aggregator's signature with")
        registry.verify_message(msg)
    except RemoteProtocolError as e:
        return Finding(check="model", ok=False, message=f"the retained model: {e}",
                       fix="the registry.json on the device must be the fleet's current one "
                           "(the aggregator's key); re-copy it from the gateway")
    shapes = [tuple(a.shape) for a in msg.arrays]
    theirs = f"aggregator's model v{msg.version} sha256 " \
             f"{hashlib.sha256(probe.model).hexdigest()[:16]}"
    if shapes != want or any(a.dtype != "<f4" for a in msg.arrays):
        return Finding(check="model", ok=False,
                       message=f"the aggregator's model (parameter shapes {shapes}, dtypes "
                               f"{sorted({a.dtype for a in msg.arrays})}) does not fit this "
                               f"device's model {manifest.name} ({want}, <f4): the device "
                               f"would reject every model and plan; {local}",
                       fix=f"install the model the gateway's aggregator.toml names and point "
                           f"device.toml's model/manifest at it (now {path})")
    return Finding(check="model", ok=True,
                   message=f"{theirs}, signed by the registry's aggregator key, fits "
                           f"{manifest.name} ({len(want)} parameter arrays, float32); {local}")


# =========================================================================== the command


def doctor(config_path: str | os.PathLike[str], *, zoo_dir: Path | None = None,
           timeout: float = 10.0, min_free_bytes: int = DEFAULT_MIN_FREE_MIB * 2**20,
           clock: Callable[[], float] = time.time,
           statvfs: Callable[[Path], os.statvfs_result] = os.statvfs) -> list[Finding]:
    """Run every check on the device configured by ``config_path``.

    Args:
        zoo_dir: where a ``model = "..."`` zoo name is looked up (``fedge device``'s).
        timeout: seconds to wait on the broker (CONNACK, PUBACK, the retained model).
        min_free_bytes: free space the ledger's file system must keep.
        clock: the wall clock (seconds since the epoch); statvfs: the file-system query.
    """
    from edge_sdk.config import ConfigError, read_secret_file
    from edge_sdk.device import DeviceConfig

    try:
        config = DeviceConfig.from_toml(config_path, zoo_dir=zoo_dir)
    except ConfigError as e:
        return [Finding(check="config", ok=False, message=str(e),
                        fix="fix the device TOML (see `fedge enroll`'s devices/<dev>/"
                            "device.toml and edge_sdk.device.DeviceConfig)")]
    found: list[Finding] = []
    cfg, registry = _config_finding(config)
    found.append(cfg)
    directory = Path(config.ledger).parent
    try:
        st = statvfs(directory)
        ledger_bytes = sum(p.stat().st_size for p in directory.glob(Path(config.ledger).name
                                                                     + "*") if p.is_file())
        disk = disk_finding(directory, free_bytes=st.f_bavail * st.f_frsize,
                            need_bytes=max(min_free_bytes, 2 * ledger_bytes))
    except OSError as e:
        disk = Finding(check="disk", ok=False, message=f"{directory}: {e.strerror or e}",
                       fix="create the ledger's directory on persistent storage")
    led, last_write = _ledger_finding(config)
    if not led.ok and not disk.ok:
        # sqlite cannot even open its WAL on a full disk: that is not a damaged ledger
        led = Finding(check="ledger", ok=False, message=led.message,
                      fix=f"first free space (see the disk check), then run the doctor "
                          f"again; only if it still fails: {led.fix}")
    found += [disk, led]
    windows: list[tuple[str, float, float]] = []
    notes: list[str] = []
    if config.ca_file is None:
        notes.append("plain TCP broker: no certificate to bound the clock with")
    else:
        try:
            ca = x509.load_pem_x509_certificate(Path(config.ca_file).read_bytes())
            windows.append((f"CA certificate {config.ca_file}", *_cert_window(ca)))
        except (OSError, ValueError) as e:
            notes.append(f"CA certificate {config.ca_file} unreadable: {e}")
        served = _served_certificate(config.broker_host, config.broker_port, timeout)
        if served is None:
            notes.append("the broker's certificate could not be fetched")
        else:
            windows.append(("broker's certificate", *_cert_window(served)))
    found.append(clock_finding(clock(), windows=windows, last_write=last_write, notes=notes))
    try:
        password = read_secret_file(config.password_file).decode().strip()
    except ConfigError as e:
        probe = _Probe(error=f"no password: {e}")
    else:
        probe = _probe(config, password, timeout)
    found.append(_broker_finding(config, probe, timeout))
    found.append(_model_finding(config, probe, registry, timeout))
    return found


def add_doctor_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``doctor`` on the ``fedge`` parser."""
    p = subparsers.add_parser("doctor", help="check a device: clock, broker over TLS, ledger, "
                                             "model files, free disk (exit 0: all pass)")
    p.add_argument("--config", required=True, help="the device TOML (`fedge device`'s)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait on the broker (default 10)")
    p.add_argument("--min-free-mib", type=float, default=float(DEFAULT_MIN_FREE_MIB),
                   help=f"free space the ledger needs, MiB (default {DEFAULT_MIN_FREE_MIB})")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")


def run_doctor(args: argparse.Namespace, *, zoo_dir: Path | None = None) -> int:
    """``fedge doctor``: print each finding (and its fix); 0 only if every check passed."""
    findings = doctor(args.config, zoo_dir=zoo_dir, timeout=args.timeout,
                      min_free_bytes=int(args.min_free_mib * 2**20))
    if args.json:
        print(json.dumps([{"check": f.check, "ok": f.ok, "message": f.message, "fix": f.fix}
                          for f in findings], indent=1))
    else:
        for f in findings:
            print(f"{'ok  ' if f.ok else 'FAIL'} {f.check}: {f.message}")
            if not f.ok:
                print(f"     fix: {f.fix}")
    ok = all(f.ok for f in findings)
    if not args.json:
        failed = [f.check for f in findings if not f.ok]
        print("all checks passed" if ok else f"failed: {', '.join(failed)}",
              file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
