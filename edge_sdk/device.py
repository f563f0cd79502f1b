"""The device agent: its configuration and the MQTT adapter around a session.

This is the composition root a device's own software embeds: it reads the device's
configuration (:class:`DeviceConfig`, TOML), its long-term keys and the fleet's registry
(files written by ``fedge enroll``; formats and readers in :mod:`edge_sdk.config`), opens
the privacy ledger fail-closed, loads the exported model, builds a
:class:`~edge_sdk.session.DeviceSession` and drives it over one MQTT client
(:class:`~edge_sdk.mqtt.MqttLoop`: TLS, credentials, a persistent session, last will,
reconnect with backoff)::

    from edge_sdk.device import Device, DeviceConfig

    # zoo_dir: where the exported models named by `model = "..."` live (not needed when
    # the TOML gives `manifest = "path/to/model.json"` instead)
    config = DeviceConfig.from_toml("/etc/fedge/device.toml", zoo_dir="/opt/fedge/models")
    with Device(config, data=read_local_samples) as device:   # () -> (x, y) numpy arrays
        device.run()                                           # until close() or SIGTERM

Restarts: the ledger is the device's memory. A device killed mid-round and started again
opens the same ledger; the round it had reserved stays counted, and when the aggregator
re-sends that round's plan the session declines it (``already_committed``), so the
device neither spends twice nor uploads twice.

Errors::

    ValueError
     +-- edge_sdk.config.ConfigError   a configuration, key or registry file that cannot
                                       be used
    edge_sdk.ledger.LedgerCorrupted   the ledger is missing or damaged: the device must
                                      not train (never recreated here; see ``provision``)
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk import wire
from edge_sdk.config import (
    ConfigError,
    load_device_identity,
    load_registry,
    path_in,
    read_secret_file,
    read_toml,
    resolve_manifest,
    take,
)
from edge_sdk.csprng import secure_round_rng
from edge_sdk.ledger import Budget, Ledger
from edge_sdk.mqtt import BrokerAddress, ClientConfig, MqttLoop
from edge_sdk.session import (
    CheckedIn,
    Declined,
    DeviceSession,
    ModelAdopted,
    RoundClosed,
    RoundOpened,
    SessionEvent,
    TrainedAhead,
    Uploaded,
)
from edge_sdk.wire import Publish

__all__ = ["DataInput", "Device", "DeviceConfig"]

logger = logging.getLogger("edge_sdk.device")

DataInput = (Callable[[], tuple[np.ndarray, np.ndarray]]
             | Iterator[tuple[np.ndarray, np.ndarray]]
             | tuple[np.ndarray, np.ndarray])
"""Local data: a callable returning (x, y), an iterator of (x, y) (the device moves to
the next item after each round it trained in; an exhausted iterator keeps its last item),
or one fixed (x, y) pair."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceConfig:
    """Everything a device agent needs (validated on construction).

    Attributes:
        fleet, device: names (topics ``fedge/<fleet>/dev/<device>/...``).
        broker_host, broker_port: the MQTT broker; ca_file: its CA (None: plain TCP, for
            local experiments only).
        username: MQTT user (default: the device name); password_file: file holding the
            MQTT password (0600).
        identity: the device's key file; registry: the fleet's public registry.
        ledger: the privacy ledger (must exist: see :meth:`Device.provision`).
        budget_epsilon, budget_delta: the owner's budget, checked against the ledger's:
            SAMPLE-level local epsilon (nats) at delta.
        device_budget_epsilon: the owner's DEVICE-level aggregate budget (nats, at
            ``budget_delta``; TOML ``[budget] device_epsilon``), or None (the default): no
            device-level limit. When set, the device declines rounds whose mechanism
            states no device-level event (``Budget.device_epsilon``).
        model: a zoo name (``logreg-64-10``) or manifest: a manifest path; exactly one.
        zoo_dir: the directory of exported models a zoo name is looked up in
            (``<zoo_dir>/<model>.json``); given by whoever builds the config (not a TOML
            setting: the device's software knows where it installed its models; ``fedge
            device`` passes ``models.ONNX_DIR``). Needed by :class:`Device` only with
            ``model``.
        backend: ``"onnx"`` or ``"numpy"``; threads: onnxruntime intra-op threads.
        checkin_every: seconds between check-ins outside rounds (None: never repeat).
        max_colluders: the most cohort members this device assumes collude with the
            aggregator (default 1); the ledger's aggregate view uses the larger of this and
            the plan's (``DeviceSession``).
        max_packet: largest MQTT payload the device sends (uploads are chunked below it).
        keepalive_s, backoff_initial_s, backoff_max_s: MQTT connection policy.
    """

    fleet: str
    device: str
    broker_port: int
    password_file: Path
    identity: Path
    registry: Path
    ledger: Path
    budget_epsilon: float
    budget_delta: float
    device_budget_epsilon: float | None = None
    broker_host: str = "127.0.0.1"
    ca_file: Path | None = None
    username: str | None = None
    model: str | None = None
    manifest: Path | None = None
    zoo_dir: Path | None = None
    backend: str = "onnx"
    threads: int = 1
    checkin_every: float | None = 30.0
    max_colluders: int = 1
    max_packet: int = wire.DEFAULT_MAX_PACKET
    keepalive_s: int = 30
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        try:
            wire.check_name("fleet", self.fleet)
            wire.check_name("device", self.device)
            self.budget  # noqa: B018 - validates the budget
            BrokerAddress(host=self.broker_host, port=self.broker_port)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.backend not in ("onnx", "numpy"):
            raise ConfigError(f"backend must be 'onnx' or 'numpy', got {self.backend!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) \
                or self.threads < 1:
            raise ConfigError(f"threads must be an integer >= 1, got {self.threads!r}")
        if self.checkin_every is not None and not (
                isinstance(self.checkin_every, int | float)
                and math.isfinite(self.checkin_every) and self.checkin_every > 0):
            raise ConfigError(f"checkin_every must be > 0 seconds, got {self.checkin_every!r}")
        if isinstance(self.max_colluders, bool) or not isinstance(self.max_colluders, int) \
                or self.max_colluders < 0:
            raise ConfigError(f"max_colluders must be an integer >= 0, "
                              f"got {self.max_colluders!r}")
        if (self.model is None) == (self.manifest is None):
            raise ConfigError("give exactly one of 'model' (a zoo name) and 'manifest'")
        if not isinstance(self.max_packet, int) or self.max_packet < 1024:
            raise ConfigError(f"max_packet must be an integer >= 1024 (a signed part of the "
                              f"masked upload), got {self.max_packet!r}")

    @property
    def budget(self) -> Budget:
        """The owner's budget on both units (the ledger's, fixed at provisioning)."""
        return Budget(epsilon=self.budget_epsilon, delta=self.budget_delta,
                      device_epsilon=self.device_budget_epsilon)

    @property
    def mqtt_username(self) -> str:
        return self.username or self.device

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], *,
                  zoo_dir: str | os.PathLike[str] | None = None,
                  **overrides: Any) -> DeviceConfig:
        """Load a device TOML (paths relative to the file's directory); ``zoo_dir`` is where
        a ``model`` zoo name is looked up (see the class docstring), ``overrides`` replace
        fields::

            fleet = "lab"
            device = "dev-0000"
            model = "logreg-64-10"          # or manifest = "path/to/model.json"
            identity = "identity.key"
            registry = "../../registry.json"
            ledger = "ledger.db"
            [budget]
            epsilon = 8.0                   # sample-level, local
            delta = 1e-5
            device_epsilon = 4.0            # optional: device-level, aggregate
            [broker]
            host = "127.0.0.1"
            port = 8883
            ca_file = "../../broker/ca.crt"
            password_file = "password"      # username defaults to the device name
        """
        data, base = read_toml(path)
        if "seed" in data:
            raise ConfigError(f"{path}: 'seed' is no longer a device setting: a seeded "
                              f"generator made the device's batches and DP noise "
                              f"reproducible by whoever knows the file (the enroller, the "
                              f"aggregator's operator). A device's randomness now comes "
                              f"from the OS CSPRNG only; delete the line")
        budget = take(data.pop("budget", {}), {"epsilon", "delta", "device_epsilon"},
                      f"{path} [budget]")
        broker = take(data.pop("broker", {}),
                      {"host", "port", "ca_file", "username", "password_file", "keepalive_s",
                       "backoff_initial_s", "backoff_max_s"}, f"{path} [broker]")
        top = take(data, {"fleet", "device", "identity", "registry", "ledger", "model",
                          "manifest", "backend", "threads", "checkin_every",
                          "max_colluders", "max_packet"}, str(path))
        values: dict[str, Any] = dict(top)
        for key in ("identity", "registry", "ledger", "manifest"):
            values[key] = path_in(base, top.get(key), key)
        if "epsilon" in budget:
            values["budget_epsilon"] = budget["epsilon"]
        if "delta" in budget:
            values["budget_delta"] = budget["delta"]
        if "device_epsilon" in budget:
            values["device_budget_epsilon"] = budget["device_epsilon"]
        for key in ("host", "port"):
            if key in broker:
                values[f"broker_{key}"] = broker[key]
        for key in ("username", "keepalive_s", "backoff_initial_s", "backoff_max_s"):
            if key in broker:
                values[key] = broker[key]
        values["ca_file"] = path_in(base, broker.get("ca_file"), "ca_file")
        values["password_file"] = path_in(base, broker.get("password_file"), "password_file")
        values["zoo_dir"] = None if zoo_dir is None else Path(zoo_dir)
        values.update(overrides)
        missing = [k for k in ("fleet", "device", "broker_port", "password_file", "identity",
                               "registry", "ledger", "budget_epsilon", "budget_delta")
                   if values.get(k) is None]
        if missing:
            raise ConfigError(f"{path}: missing setting(s) {missing}")
        try:
            return cls(**values)
        except TypeError as e:
            raise ConfigError(f"{path}: {e}") from None


# =========================================================================== the agent


class _Data:
    """Adapts a :data:`DataInput` to the session's ``() -> (x, y)``."""

    def __init__(self, data: DataInput) -> None:
        self._fn: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None
        self._it: Iterator[tuple[np.ndarray, np.ndarray]] | None = None
        self._current: tuple[np.ndarray, np.ndarray] | None = None
        self._advance = True
        if isinstance(data, tuple):
            if len(data) != 2:
                raise ValueError(f"data as a tuple must be (x, y), got {len(data)} items")
            pair = (np.asarray(data[0]), np.asarray(data[1]))
            self._fn = lambda: pair
        elif callable(data):
            self._fn = data
        elif isinstance(data, Iterator):
            self._it = data
        else:
            raise ValueError(f"data must be a callable, an iterator of (x, y) or an (x, y) "
                             f"tuple, got {type(data).__name__}")

    def __call__(self) -> tuple[np.ndarray, np.ndarray]:
        if self._fn is not None:
            return self._fn()
        assert self._it is not None
        if self._advance or self._current is None:
            self._advance = False
            try:
                self._current = next(self._it)
            except StopIteration:
                if self._current is None:
                    raise ValueError("the data iterator yielded nothing") from None
        return self._current

    def trained(self) -> None:
        """A round trained on the current item: take the next one from now on."""
        self._advance = True


class _Agent:
    """The MQTT endpoint: the session, plus the event reports made from its events."""

    def __init__(self, session: DeviceSession, data: _Data,
                 on_event: Callable[[dict[str, Any]], None]) -> None:
        self.session = session
        self._data = data
        self._emit = on_event
        self.contributed = 0  # rounds this device uploaded to that ended with a new model

    def subscriptions(self) -> list[str]:
        return self.session.subscriptions()

    def on_connect(self, now: float) -> list[Publish]:
        self._emit({"event": "connected", "model_version": self.session.model_version})
        return self._after(self.session.on_connect(now))

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        return self._after(self.session.on_message(topic, payload, now))

    def on_tick(self, now: float) -> list[Publish]:
        return self._after(self.session.on_tick(now))

    def _after(self, out: list[Publish]) -> list[Publish]:
        for event in self.session.take_events():
            self._report(event)
        return out

    def _report(self, e: SessionEvent) -> None:
        if isinstance(e, ModelAdopted):
            self._emit({"event": "model", "model_version": e.version})
        elif isinstance(e, RoundClosed):
            if e.contributed:
                self.contributed += 1
            self._emit({"event": "round_end", "round": e.round_id,
                        "contributed": e.contributed, "model_version": e.model_version})
        elif isinstance(e, RoundOpened):
            self._data.trained()
            self._emit({"event": "round", "round": e.round_id,
                        "model_version": e.model_version})
        elif isinstance(e, Uploaded):
            # the same upload again (the aggregator re-sent its request) is "resent"
            self._emit({"event": "resent" if e.resent else "uploaded", "round": e.round_id,
                        "chunks": e.parts, "bytes": e.size})
        elif isinstance(e, Declined):
            self._emit({"event": "declined", "round": e.round_id, "reason": e.reason})
        elif isinstance(e, CheckedIn):
            self._emit({"event": "checkin", "model_version": e.model_version})
        elif isinstance(e, TrainedAhead):  # buffered rounds: trained before any plan
            self._data.trained()
            self._emit({"event": "trained_ahead", "model_version": e.model_version,
                        "ledger_round": e.ledger_round})


@dataclass(slots=True)
class _Handles:
    ledger: Ledger
    loop: MqttLoop
    agent: _Agent
    closed: bool = False
    extra: list[Any] = field(default_factory=list)


class Device:
    """A device of a fleet: trains on its own data in the rounds it is selected for.

    Embedding it (the device's own software provides the data)::

        from edge_sdk.config import resolve_manifest
        from edge_sdk.data import read_samples
        from edge_sdk.device import Device, DeviceConfig
        from edge_sdk.engine import load_manifest

        config = DeviceConfig.from_toml("/etc/fedge/device.toml",
                                        zoo_dir="/opt/fedge/models")  # for model = "..."
        spec = load_manifest(resolve_manifest(config.model, config.manifest,
                                              zoo_dir=config.zoo_dir)).spec
        # x float32 [m, *input_shape], y int64 [m] in [0, num_classes): edge_sdk.data
        x, y = read_samples(["/var/lib/sensor/samples.npz"], input_shape=spec.input_shape,
                            num_classes=spec.num_classes)
        with Device(config, data=(x, y)) as device:
            device.run_rounds(5)          # or device.run() until close() / a signal

    Args:
        config: the device's configuration.
        data: the local training set (see :data:`DataInput`).
        on_event: receives a small dict per event (``connected``, ``checkin``, ``model``,
            ``round``, ``uploaded``, ``resent``, ``declined``, ``round_end``); default: log lines.
        clock: monotonic seconds (the session's deadlines).

    Randomness is not an argument: the round randomness (batches, DP noise, rounding) comes
    from a fresh ChaCha20 generator per round keyed from ``os.urandom``
    (``edge_sdk.csprng``), and key material and self-mask seeds for secure aggregation
    from ``os.urandom``; nothing in the configuration or the arguments can replace either
    with a seeded source (simulators build a ``DeviceSession`` themselves).

    Raises:
        ConfigError: unusable key, registry or password files, a config that disagrees
            with them, or a model that cannot be found (a zoo name without ``zoo_dir``).
        edge_sdk.ledger.LedgerCorrupted: the ledger is missing or damaged (fail closed).
        edge_sdk.ledger.LedgerError: the ledger belongs to another device or budget.
    """

    def __init__(self, config: DeviceConfig, data: DataInput, *,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from edge_sdk.engine import load_engine, load_manifest

        self.config = config
        identity = load_device_identity(config.identity, fleet=config.fleet,
                                        device=config.device)
        registry = load_registry(config.registry, fleet=config.fleet)
        if registry.devices.get(config.device) != identity.enrollment():
            raise ConfigError(f"{config.registry}: device {config.device!r} is not enrolled "
                              f"with the keys in {config.identity}")
        password = read_secret_file(config.password_file).decode().strip()
        manifest = resolve_manifest(config.model, config.manifest, zoo_dir=config.zoo_dir)
        spec = load_manifest(manifest).spec
        engine = load_engine(manifest, backend=config.backend, threads=config.threads)
        feed = _Data(data)
        ledger = Ledger.open(config.ledger, budget=config.budget, device_id=config.device,
                             create=False)
        try:
            session = DeviceSession(
                fleet=config.fleet, identity=identity, registry=registry, ledger=ledger,
                engine=engine, spec=spec, data=feed,
                round_rng=secure_round_rng(os.urandom),  # never seeded, never configurable
                random_bytes=os.urandom, max_packet=config.max_packet,
                checkin_every=config.checkin_every, max_colluders=config.max_colluders)
            emit = on_event if on_event is not None else _log_event(config.device)
            agent = _Agent(session, feed, emit)
            loop = MqttLoop(BrokerAddress(host=config.broker_host, port=config.broker_port,
                                          ca_file=None if config.ca_file is None
                                          else str(config.ca_file)),
                            rng=random.Random(int.from_bytes(os.urandom(8), "big")),
                            clock=clock)
            loop.add(ClientConfig(
                username=config.mqtt_username, password=password,
                status_topic=wire.status_topic(config.fleet, config.device),
                keepalive_s=config.keepalive_s, backoff_initial_s=config.backoff_initial_s,
                backoff_max_s=config.backoff_max_s), agent)
        except BaseException:
            ledger.close()
            raise
        self._h = _Handles(ledger=ledger, loop=loop, agent=agent)
        self._stop = False

    @staticmethod
    def provision(config: DeviceConfig) -> None:
        """Create the device's ledger with the configured budget (once, at provisioning).

        Raises:
            edge_sdk.ledger.LedgerError: a ledger already exists there (opening it checks
                that it belongs to this device and budget; nothing is reset).
        """
        Ledger.open(config.ledger, budget=config.budget, device_id=config.device,
                    create=True).close()

    # ------------------------------------------------------------------ state

    @property
    def session(self) -> DeviceSession:
        return self._h.agent.session

    @property
    def ledger(self) -> Ledger:
        return self._h.ledger

    @property
    def model_version(self) -> int:
        """The global model version the device holds (-1: none yet)."""
        return self.session.model_version

    @property
    def rounds_contributed(self) -> int:
        """Rounds (since this object was made) this device uploaded to that ended with a
        new global model."""
        return self._h.agent.contributed

    @property
    def connected(self) -> bool:
        return self._h.loop.is_connected(self.config.mqtt_username)

    # ------------------------------------------------------------------ running

    def stop(self) -> None:
        """Make a running :meth:`run` return soon (safe from a signal handler)."""
        self._stop = True

    def run(self, until: Callable[[], bool] | None = None, *,
            timeout: float | None = None) -> bool:
        """Take part in rounds until ``until()`` is true (True), ``timeout`` seconds pass
        or :meth:`stop` is called (False). ``until=None``: until stopped."""
        if self._h.closed:
            raise RuntimeError("the device is closed")
        self._stop = False

        def done() -> bool:
            return self._stop or (until is not None and until())

        self._h.loop.run(until=done, timeout=timeout)
        return until is not None and until()

    def run_rounds(self, n: int, *, timeout: float | None = None) -> int:
        """Run until this device has contributed to ``n`` more completed rounds (or
        ``timeout``/``stop``); returns how many it contributed to."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        start = self.rounds_contributed
        self.run(lambda: self.rounds_contributed - start >= n, timeout=timeout)
        return self.rounds_contributed - start

    def close(self, timeout: float = 5.0) -> None:
        """Say goodbye to the broker (retained "offline", DISCONNECT; the broker keeps the
        session) and close the ledger. Idempotent."""
        h = self._h
        if h.closed:
            return
        h.closed = True
        try:
            h.loop.close(timeout)
        finally:
            h.ledger.close()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _log_event(device: str) -> Callable[[dict[str, Any]], None]:
    def emit(event: dict[str, Any]) -> None:
        logger.info("%s: %s", device, event, extra={"fedge": {"device": device, **event}})

    return emit
