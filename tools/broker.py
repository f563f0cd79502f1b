"""A local mosquitto 2.x broker for a fleet: config, credentials, TLS material, process.

``write_broker_config`` writes everything a locked-down broker needs into one directory:

- ``mosquitto.conf``: one loopback listener, no anonymous clients, client id forced to the
  user name (``use_username_as_clientid``, so a device cannot take over another's session),
  persistence on (a restart keeps sessions and their queued messages), queue and packet
  limits sized for the fleet (see ``max_queued_messages`` below);
- ``passwords``: mosquitto's PBKDF2-SHA512 (``$7$``) hashes of random per-client passwords;
- ``acl``: pattern ACLs built from ``edge_sdk.wire``'s topic layout, so each device can only
  publish into and read from its own subtree, and only the aggregator writes model/round;
- ``ca.crt``, ``server.crt``, ``server.key`` (0600): a throw-away CA and a server certificate
  for 127.0.0.1/localhost;
- ``credentials.json`` (0600): name -> password plus host, port and CA path, which the
  simulator and the tests read back with ``read_broker_config``.

``Broker`` runs the real ``mosquitto`` on a free loopback port for tests and simulations.
"""

from __future__ import annotations

import base64
import datetime as dt
import getpass
import hashlib
import ipaddress
import json
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any

from edge_sdk import wire

__all__ = [
    "FLOOD_HEADROOM",
    "MAX_PACKET_SIZE",
    "Broker",
    "BrokerConfig",
    "BrokerError",
    "BrokerMissing",
    "acl_text",
    "device_names",
    "free_port",
    "hash_password",
    "raise_open_file_limit",
    "read_broker_config",
    "write_broker_config",
]

MAX_PACKET_SIZE = 8 * 2**20
FLOOD_HEADROOM = 20_000
# mosquitto_passwd's default. The passwords are 192-bit random tokens, so the iteration count
# buys nothing against guessing; it only costs the broker time on every connect.
_PBKDF2_ITERATIONS = 101
_SALT_BYTES = 12
# Stands in for mosquitto's %u when the ACL patterns are derived from wire's topic functions
# (which only accept real names).
_DEVICE_SENTINEL = "fedge-acl-device-placeholder"
_KIND_SENTINEL = "fedge-acl-kind-placeholder"


class BrokerError(RuntimeError):
    """The broker process failed to start, exited early, or did not accept connections."""


class BrokerMissing(BrokerError):
    """The ``mosquitto`` executable is not installed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BrokerConfig:
    """Where ``write_broker_config`` put things, and what clients need to connect."""

    directory: Path
    config_file: Path
    password_file: Path
    acl_file: Path
    credentials_file: Path
    log_file: Path
    ca_file: Path | None  # None: plain TCP (--no-tls; local experiments only)
    host: str
    port: int
    fleet: str
    aggregator: str
    devices: tuple[str, ...]
    passwords: Mapping[str, str]  # client name (user name = client id) -> password
    max_queued_messages: int
    max_packet_size: int

    def password(self, name: str) -> str:
        """The password of device or aggregator ``name``."""
        try:
            return self.passwords[name]
        except KeyError:
            raise ValueError(f"no credentials for client {name!r} in {self.credentials_file}")\
                from None


def device_names(n: int) -> list[str]:
    """The CLI's device names: ``dev-0000`` ... (zero-padded so they sort)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"number of devices must be a positive integer, got {n!r}")
    width = max(4, len(str(n - 1)))
    return [f"dev-{i:0{width}d}" for i in range(n)]


def hash_password(password: str, *, salt: bytes | None = None,
                  iterations: int = _PBKDF2_ITERATIONS) -> str:
    """mosquitto 2.x password-file hash: ``$7$<iterations>$<b64 salt>$<b64 PBKDF2-SHA512>``.

    The same format ``mosquitto_passwd`` writes (mosquitto src/password_mosq.c, hash id 7);
    computed here so writing a fleet's config needs no subprocess per device.
    """
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, 64)
    return (f"$7${iterations}${base64.b64encode(salt).decode()}$"
            f"{base64.b64encode(digest).decode()}")


def _pattern(topic: str) -> str:
    """A concrete topic of the sentinel device/kind turned into a mosquitto ACL pattern."""
    levels = topic.split("/")
    out = ["%u" if lv == _DEVICE_SENTINEL else "#" if lv == _KIND_SENTINEL else lv
           for lv in levels]
    if "#" in out and out.index("#") != len(out) - 1:
        raise AssertionError(f"wire topic layout changed: '#' not last in {topic!r}")
    return "/".join(out)


def _round_topic(fleet: str) -> str:
    # wire.py gains round_topic with the MQTT service; until then the layout comment there
    # (fedge/<fleet>/round) is the source.
    fn = getattr(wire, "round_topic", None)
    return fn(fleet) if fn is not None else f"{wire.fleet_topic(fleet)}/round"


def acl_text(fleet: str, devices: Sequence[str], aggregator: str = "aggregator") -> str:
    """mosquitto ACL file for one fleet: per-device patterns plus the aggregator's subtree."""
    wire.check_name("fleet", fleet)
    wire.check_name("aggregator", aggregator)
    for name in (fleet, aggregator, *devices):
        if name in (_DEVICE_SENTINEL, _KIND_SENTINEL):
            raise ValueError(f"name {name!r} is reserved")
    d, k = _DEVICE_SENTINEL, _KIND_SENTINEL
    lines = [
        "# Written by tools/broker.py from edge_sdk.wire's topic layout; do not edit.",
        "# Anything not granted here is denied (publishes dropped, subscriptions deliver",
        "# nothing). %u is the user name, which is also the client id.",
        "",
        "# Every device: its own subtree only.",
        f"pattern write {_pattern(wire.device_up_topic(fleet, d, k))}",
        f"pattern read {_pattern(wire.device_down_topic(fleet, d, k))}",
        f"pattern write {_pattern(wire.status_topic(fleet, d))}",
        "",
        f"user {aggregator}",
        f"topic readwrite {wire.fleet_topic(fleet)}/#",
        "",
        # Per user rather than as patterns: mosquitto warns on patterns without %u/%c, and
        # plain topic lines before the first user line would apply to anonymous clients only.
        "# The fleet-wide topics each device may read (only the aggregator writes them).",
    ]
    shared = (wire.model_topic(fleet), _round_topic(fleet))
    for name in devices:
        lines.append(f"user {wire.check_name('device', name)}")
        lines.extend(f"topic read {t}" for t in shared)
    lines.append("")
    return "\n".join(lines)


def _write_private(path: Path, data: bytes | str) -> None:
    """Create ``path`` with mode 0600 from the start (no window where it is world-readable)."""
    raw = data.encode() if isinstance(data, str) else data
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)


def _tls_material(directory: Path, host: str, extra_hosts: tuple[str, ...] = ()
                  ) -> tuple[Path, Path, Path]:
    """Self-signed CA + server certificate for ``host`` (and ``extra_hosts``), 127.0.0.1
    and localhost (P-256)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedge local broker CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = [x509.DNSName("localhost"),
                                   x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for h in (host, *extra_hosts):
        try:
            ip = ipaddress.ip_address(h)
            if str(ip) != "127.0.0.1":
                alt.append(x509.IPAddress(ip))
        except ValueError:
            if h != "localhost":
                alt.append(x509.DNSName(h))
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = (directory / "ca.crt", directory / "server.crt",
                                    directory / "server.key")
    ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    # The CA key is not written: nothing else is ever signed with it.
    _write_private(key_file, server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return ca_file, cert_file, key_file


def write_broker_config(
    directory: str | os.PathLike[str],
    *,
    devices: Sequence[str],
    fleet: str,
    port: int,
    aggregator: str = "aggregator",
    tls: bool = True,
    host: str = "127.0.0.1",
    messages_per_round: int = 64,
    max_inflight_messages: int = 100,
    max_packet_size: int = MAX_PACKET_SIZE,
    flood_headroom: int = FLOOD_HEADROOM,
    max_queued_bytes: int = 0,
    extra_hosts: Sequence[str] = (),
    acl: str | None = None,
    extra_acl: str = "",
    extra_conf: str = "",
    extra_users: Sequence[str] = (),
) -> BrokerConfig:
    """Write a locked-down mosquitto 2.x configuration for one fleet into ``directory``.

    Args:
        devices: device names (user name = client id); each gets a random password.
        messages_per_round: the most messages one device sends the aggregator in a round
            (control messages + upload chunks). It sizes ``max_queued_messages``: while the
            aggregator works through a round every device's messages may be queued for it at
            once, and mosquitto silently drops QoS 1 messages it has already acknowledged
            to the sender once a client's queue is full (default 1000).
        max_inflight_messages: unacknowledged QoS 1 messages per client and direction; also
            the Receive Maximum mosquitto advertises in CONNACK.
        max_packet_size: advertised to clients in CONNACK (Maximum Packet Size); larger
            updates must be chunked by the wire module.
        flood_headroom: messages added to ``max_queued_messages`` for a flood. mosquitto 2.0
            has no per-client rate limit, so one device's flood lands in the aggregator's
            queue until the aggregator quarantines it and unsubscribes its topics
            (``aggregator.guard``); the queue must hold what arrives meanwhile, or honest
            devices' messages are dropped with the flood. Measured (tests/test_flood_mqtt.py,
            ``mosquitto_pub`` replaying a chunk 20,000 times over TLS on loopback): with
            1,000 the broker dropped messages for the aggregator; with this headroom none.
        max_queued_bytes: mosquitto's per-client byte bound on queued messages (0: none).
            It protects the broker's memory, not the aggregator's answers: once it is
            reached, messages are dropped as with the count. 0 by default because the
            aggregator's flood guard already charges messages by size (1 token per started
            MiB), which bounds what one device can make the broker queue; set it where the
            broker's memory is scarcer than the fleet's uploads are large.
        extra_hosts: more addresses to listen on (the same port and TLS; the certificate
            names them all): a site broker reached by gateways over other interfaces.
        acl: the whole ACL file instead of the fleet's (``acl_text``): a site broker's.
        extra_acl: lines appended to the ACL (a gateway aggregator's site topics).
        extra_conf: lines appended to mosquitto.conf (a gateway broker's bridge).
        extra_users: more clients with a password (a gateway's workers and coordinator);
            their rights come from ``extra_acl``.

    Returns:
        The paths, port, credentials and CA path (also saved in ``credentials.json``).
    """
    directory = Path(directory)
    devices = tuple(devices)
    if not devices:
        raise ValueError("devices must name at least one device, got an empty list")
    for name in devices:
        wire.check_name("device", name)
    wire.check_name("fleet", fleet)
    wire.check_name("aggregator", aggregator)
    if len(set(devices)) != len(devices):
        dupes = sorted({d for d in devices if devices.count(d) > 1})
        raise ValueError(f"device names must be unique, got duplicates {dupes[:5]!r}")
    if aggregator in devices:
        raise ValueError(f"aggregator name {aggregator!r} is also a device name")
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be in 1..65535, got {port!r}")
    if messages_per_round < 1:
        raise ValueError(f"messages_per_round must be >= 1, got {messages_per_round!r}")
    if max_inflight_messages < 1:
        raise ValueError(f"max_inflight_messages must be >= 1, got {max_inflight_messages!r}")
    if flood_headroom < 0 or max_queued_bytes < 0:
        raise ValueError(f"flood_headroom and max_queued_bytes must be >= 0, got "
                         f"{flood_headroom!r}, {max_queued_bytes!r}")
    if not 1024 <= max_packet_size <= 268_435_455:
        raise ValueError(f"max_packet_size must be in [1024, 268435455], got {max_packet_size}")

    directory.mkdir(parents=True, exist_ok=True)
    persistence = directory / "persistence"
    persistence.mkdir(exist_ok=True)
    for name in extra_users:
        wire.check_name("user", name)
    passwords = {name: secrets.token_urlsafe(24)
                 for name in (aggregator, *devices, *extra_users)}
    max_queued = max(1000, len(devices) * messages_per_round) + flood_headroom

    password_file = directory / "passwords"
    _write_private(password_file,
                   "".join(f"{n}:{hash_password(p)}\n" for n, p in passwords.items()))
    acl_file = directory / "acl"
    acl_file.write_text((acl_text(fleet, devices, aggregator) if acl is None else acl)
                        + (f"\n{extra_acl}\n" if extra_acl else ""))
    log_file = directory / "mosquitto.log"
    tls_lines: list[str] = []
    ca_file: Path | None = None
    if tls:
        ca_file, cert_file, key_file = _tls_material(directory, host, tuple(extra_hosts))
        tls_lines = [f"cafile {ca_file.resolve()}", f"certfile {cert_file.resolve()}",
                     f"keyfile {key_file.resolve()}", "require_certificate false"]
    listeners: list[str] = []
    for h in (host, *extra_hosts):  # each listener block carries its own TLS settings
        listeners += [f"listener {port} {h}", *tls_lines]
    # mosquitto started as root drops to user "mosquitto" before it reads the password file
    # and key; naming the current user keeps the files private to whoever wrote them.
    user = getpass.getuser()
    conf = [
        "# Written by tools/broker.py (fedge). One fleet, one loopback listener.",
        f"# fleet {fleet}: {len(devices)} devices + aggregator {aggregator!r}",
        f"user {user}",
        "per_listener_settings false",
        *listeners,
        "allow_anonymous false",
        f"password_file {password_file.resolve()}",
        f"acl_file {acl_file.resolve()}",
        "# The client id is the authenticated user name: no one can claim another's id",
        "# (and with it take over that client's session and queued messages).",
        "use_username_as_clientid true",
        "",
        "# Sizing: devices x messages per round "
        f"= {len(devices)} x {messages_per_round} (at least 1000), plus {flood_headroom}",
        "# for one device's flood until the aggregator unsubscribes it (aggregator/guard.py).",
        f"max_queued_messages {max_queued}",
        f"max_queued_bytes {max_queued_bytes}",
        f"max_inflight_messages {max_inflight_messages}",
        f"max_packet_size {max_packet_size}",
        "set_tcp_nodelay true",
        "",
        "# Sessions and their queued QoS 1 messages survive a broker restart.",
        "persistence true",
        f"persistence_location {persistence.resolve()}/",
        "autosave_interval 30",
        "",
        f"log_dest file {log_file.resolve()}",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "connection_messages true",
        "",
        *([extra_conf] if extra_conf else []),
    ]
    config_file = directory / "mosquitto.conf"
    config_file.write_text("\n".join(conf))
    credentials_file = directory / "credentials.json"
    _write_private(credentials_file, json.dumps({
        "host": host, "port": port, "fleet": fleet, "aggregator": aggregator,
        "devices": list(devices), "tls": tls,
        "ca_file": str(ca_file.resolve()) if ca_file else None,
        "max_queued_messages": max_queued, "max_packet_size": max_packet_size,
        "passwords": passwords,
    }, indent=1))
    return _config(directory, ca_file, host, port, fleet, aggregator, devices, passwords,
                   max_queued, max_packet_size)


def _config(directory: Path, ca_file: Path | None, host: str, port: int, fleet: str,
            aggregator: str, devices: tuple[str, ...], passwords: dict[str, str],
            max_queued: int, max_packet_size: int) -> BrokerConfig:
    return BrokerConfig(
        directory=directory, config_file=directory / "mosquitto.conf",
        password_file=directory / "passwords", acl_file=directory / "acl",
        credentials_file=directory / "credentials.json", log_file=directory / "mosquitto.log",
        ca_file=ca_file, host=host, port=port, fleet=fleet, aggregator=aggregator,
        devices=devices, passwords=MappingProxyType(dict(passwords)),
        max_queued_messages=max_queued, max_packet_size=max_packet_size)


def read_broker_config(path: str | os.PathLike[str]) -> BrokerConfig:
    """The ``BrokerConfig`` saved by ``write_broker_config`` (its directory or credentials.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / "credentials.json"
    data = json.loads(path.read_text())
    ca = data.get("ca_file")
    return _config(path.parent, Path(ca) if ca else None, data["host"], data["port"],
                   data["fleet"], data["aggregator"], tuple(data["devices"]), data["passwords"],
                   data["max_queued_messages"], data["max_packet_size"])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to the hard limit; returns the new soft limit.

    One TCP connection is one descriptor on each side; the broker (our child) inherits it.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def _mosquitto() -> str:
    exe = shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)),
        None)
    if exe is None:
        raise BrokerMissing("mosquitto executable not found; install the Debian package "
                            "'mosquitto' (apt-get install mosquitto mosquitto-clients)")
    return exe


class Broker:
    """A real mosquitto process on a free loopback port, configured by ``write_broker_config``.

    Use as a context manager; the config lives in a temporary directory (or ``directory``)
    removed on exit unless ``keep=True``. ``restart()`` stops and starts the same broker on
    the same port with the same persistence, for fault tests.
    """

    def __init__(self, *, devices: Sequence[str], fleet: str = "test",
                 aggregator: str = "aggregator", tls: bool = True,
                 directory: str | os.PathLike[str] | None = None, keep: bool = False,
                 start_timeout_s: float = 10.0, port: int | None = None,
                 **config_kwargs: Any) -> None:
        self._exe = _mosquitto()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fedge-broker-")
            directory = self._tmp.name
        self._keep = keep
        self._start_timeout_s = start_timeout_s
        self.config = write_broker_config(
            directory, devices=devices, fleet=fleet,
            port=free_port(config_kwargs.get("host", "127.0.0.1")) if port is None else port,
            aggregator=aggregator, tls=tls, **config_kwargs)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        return self.config.port

    @property
    def host(self) -> str:
        return self.config.host

    def start(self) -> None:
        """Start mosquitto and wait until its listener accepts TCP connections."""
        if self._proc is not None and self._proc.poll() is None:
            raise BrokerError(f"broker on port {self.port} is already running")
        raise_open_file_limit()
        self._proc = subprocess.Popen(
            [self._exe, "-c", str(self.config.config_file)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise BrokerError(f"mosquitto exited with status {self._proc.returncode} on "
                                  f"port {self.port}: {err.strip()} {self._log_tail()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerError(f"mosquitto did not accept connections on {self.host}:"
                                  f"{self.port} within {self._start_timeout_s} s. "
                                  f"{self._log_tail()}")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (mosquitto saves its persistence file), then SIGKILL if it hangs."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            if proc.stderr:
                proc.stderr.close()

    def kill(self) -> None:
        """SIGKILL, as a crash or power loss: nothing is saved (persistence keeps only its
        last autosave)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait()
        if proc.stderr:
            proc.stderr.close()

    def restart(self) -> None:
        """Stop and start again: same port, same config, same persisted sessions."""
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.config.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "mosquitto log: " + " | ".join(text[-lines:])

    def __enter__(self) -> Broker:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        if self._tmp is not None and not self._keep:
            self._tmp.cleanup()
