"""The aggregator service: a :class:`~aggregator.rounds.RoundMachine` on one MQTT client.

``fedge aggregator --config aggregator.toml`` runs :class:`AggregatorService`::

    AggregatorConfig.from_toml(        fleet, broker, identity, registry, checkpoint,
        path, zoo_dir=ONNX_DIR)        model, [policy] (RoundPolicy), [metrics]; a zoo
                                       name `model` is looked up in zoo_dir (the CLI
                                       passes models.ONNX_DIR)
    AggregatorService(config)          resumes from the checkpoint if there is one
                                       (RoundMachine.restore; on_connect re-sends the open
                                       stage), else starts from the initial model
    .run()                             until stop() (SIGTERM in the CLI)
    .close()                           final checkpoint, MQTT goodbye, metrics server off

Checkpoints (``aggregator.store.CheckpointStore``) are written by the machine after every
stage change, before the change's messages are sent, and once more at a clean shutdown.
A checkpoint that cannot be read or was taken under another policy or identity stops the
service (:class:`~aggregator.store.CheckpointCorrupted`,
:class:`~aggregator.rounds.SnapshotError`): starting afresh would reuse round ids the
devices' ledgers already hold.

Observability:

* JSON log lines on ``out`` (stdout in the CLI), one object per line with ``ts`` (Unix
  time) and ``event``: ``start`` (resumed, round, stage, model_version, metrics_port),
  ``stage`` (round, stage, prev, prev_s: seconds in the previous stage, round_s),
  ``round_end`` (round, completed, cohort, survivors, declined, dropped, bytes_in,
  bytes_out, duration_s, model_version, detail, uploaded: devices whose upload was
  accepted, i.e. who spent budget on the round; accuracy, loss: the new model on the
  aggregator's own evaluation set, ``aggregator.evaluation``, null without one or when the
  round failed), ``rejected`` (topic, reason, round,
  stage) and ``duplicate`` (topic, reason): refused inbound messages; at most
  ``log_per_key`` lines per device and reason class per ``log_interval_s``, then one
  ``suppressed`` line per key and interval with the count not written), ``declined``
  (device, round, reason), ``status`` (device, status, removed: every message on a
  device's status topic), ``quarantined`` (device, round, until_round, stage: a device
  over its flood limits, see ``aggregator.guard``), ``released`` (device, dropped),
  ``resent`` (round, stage, devices, attempt), ``stop`` (with ``max_rss_kib``, the
  process's peak resident memory). Every line but ``start``, ``stop`` and ``suppressed``
  is one of the round machine's events (``RoundMachine.take_events``, taken after every
  call): the service learns what happened from them alone.
* The service subscribes per device and unsubscribes a quarantined device's filters, so
  the broker discards its traffic until the quarantine ends (``aggregator.guard``).
* Prometheus text exposition (``prometheus-client``, the ``gateway`` extra) on
  ``metrics_host:metrics_port`` when a port is configured (0: any free port), at
  ``/metrics``; the same server has the live status page at ``/status`` (its JSON at
  ``/status.json``), built from the same events (``aggregator.status``).

Errors are those of the pieces: ``ConfigError`` (``edge_sdk.config``) for unusable
configuration or key files, ``AggregatorError`` subclasses for checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from aggregator.evaluation import Evaluation, evaluate, load_evaluation
from aggregator.guard import FloodLimits, LogLimiter, Suppressed
from aggregator.rounds import (
    Declined,
    Duplicate,
    Event,
    Quarantined,
    Rejected,
    Released,
    Resent,
    RoundEnded,
    RoundMachine,
    RoundPolicy,
    RoundStarted,
    StageChanged,
    StatusSeen,
)
from aggregator.status import StatusBoard, serve_http, snapshot_json
from aggregator.store import CheckpointStore
from edge_sdk import wire
from edge_sdk.config import (
    ConfigError,
    load_aggregator_identity,
    load_registry,
    path_in,
    read_secret_file,
    read_toml,
    resolve_manifest,
    take,
)
from edge_sdk.mqtt import BrokerAddress, ClientConfig, MqttLoop
from edge_sdk.wire import Publish

__all__ = ["AggregatorConfig", "AggregatorService"]

logger = logging.getLogger("aggregator.service")

_STAGES = ("idle", "collect_keys", "collect_shares", "collect_masked", "collect_unmask")


@dataclass(frozen=True, slots=True, kw_only=True)
class AggregatorConfig:
    """What the aggregator service needs (validated on construction).

    Attributes:
        fleet: the fleet name (must equal ``policy.fleet``).
        broker_host, broker_port, ca_file: the broker (ca_file None: plain TCP).
        username: MQTT user (default ``aggregator``); password_file: its password (0600).
        identity: the aggregator's key file; registry: the fleet's public registry.
        checkpoint: the checkpoint file (its directory must exist).
        model / manifest: the model (zoo name or manifest path; exactly one); model_seed
            seeds the initial parameters (used only when no checkpoint exists).
        zoo_dir: the directory of exported models a zoo name is looked up in
            (``<zoo_dir>/<model>.json``; not a TOML setting: ``fedge aggregator`` passes
            ``models.ONNX_DIR``). Needed by :class:`AggregatorService` only with ``model``.
        policy: how rounds run (the ``[policy]`` table: ``RoundPolicy`` fields).
        metrics_port: Prometheus endpoint port (None: none; 0: any free port);
            metrics_host: its address.
        tick_s: how often deadlines are checked.
        flood_burst, flood_rate: per-device flood limits (``aggregator.guard.FloodLimits``;
            the ``[limits]`` table's ``burst`` and ``rate``).
        log_interval_s, log_per_key: the rejection log's rate limit (``[limits]``
            ``log_interval_s``, ``log_per_key``).
        evaluation: the aggregator's own evaluation set (``[evaluation] data``, a ``.npz``
            in the owner-file format, ``aggregator.evaluation``; None: accuracy is not
            measured).
    """

    fleet: str
    broker_port: int
    password_file: Path
    identity: Path
    registry: Path
    checkpoint: Path
    policy: RoundPolicy
    broker_host: str = "127.0.0.1"
    ca_file: Path | None = None
    username: str = "aggregator"
    model: str | None = None
    manifest: Path | None = None
    zoo_dir: Path | None = None
    model_seed: int = 0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    tick_s: float = 0.1
    keepalive_s: int = 30
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 10.0
    flood_burst: int = 200  # FloodLimits defaults
    flood_rate: float = 20.0
    log_interval_s: float = 10.0
    log_per_key: int = 5
    evaluation: Path | None = None

    def __post_init__(self) -> None:
        try:
            wire.check_name("fleet", self.fleet)
            BrokerAddress(host=self.broker_host, port=self.broker_port)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.policy.fleet != self.fleet:
            raise ConfigError(f"policy is for fleet {self.policy.fleet!r}, not {self.fleet!r}")
        if (self.model is None) == (self.manifest is None):
            raise ConfigError("give exactly one of 'model' (a zoo name) and 'manifest'")
        if self.metrics_port is not None and not (
                isinstance(self.metrics_port, int) and 0 <= self.metrics_port <= 65535):
            raise ConfigError(f"metrics port must be in 0..65535, got {self.metrics_port!r}")
        if not (math.isfinite(self.tick_s) and self.tick_s > 0):
            raise ConfigError(f"tick_s must be > 0, got {self.tick_s!r}")
        try:
            self.limits()
            LogLimiter(interval_s=self.log_interval_s, per_key=self.log_per_key)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"[limits]: {e}") from None

    def limits(self) -> FloodLimits:
        return FloodLimits(burst=self.flood_burst, rate=self.flood_rate)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], *,
                  zoo_dir: str | os.PathLike[str] | None = None) -> AggregatorConfig:
        """Load an aggregator TOML (paths relative to the file's directory); ``zoo_dir`` is
        where a ``model`` zoo name is looked up (see the class docstring)::

            fleet = "lab"
            identity = "identity.key"
            registry = "../registry.json"
            checkpoint = "state/aggregator.ckpt"
            model = "logreg-64-10"
            [broker]
            host = "127.0.0.1"
            port = 8883
            ca_file = "../broker/ca.crt"
            password_file = "password"
            [metrics]
            port = 9464
            [limits]                     # optional; these are the defaults
            burst = 200                  # messages a device may send at once
            rate = 20.0                  # ... and per second (beyond: quarantined)
            log_interval_s = 10.0        # rejection log: at most log_per_key lines per
            log_per_key = 5              # device and reason per interval
            [evaluation]                 # optional: the aggregator's own labelled data
            data = "eval.npz"            # (x, y as a device's owner files); accuracy per round
            [policy]                     # aggregator.rounds.RoundPolicy fields
            cohort_size = 10
            stage_timeout = 30.0
            mechanism = "ddg"            # default "gaussian"; "update-noise" takes
            gamma = 0.001                # update_clip, clamp_probability; "ddg" needs
            max_local_samples = 500      # gamma and the fleet's public largest and mean
            nominal_samples = 120.0      # local data sizes (RoundPolicy says which);
                                         # "device-dp" needs update_clip (S) and gamma
                                         # (local_noise_multiplier: optional DP-SGD;
                                         # adaptive_clip_quantile: adaptive clipping)
        """
        data, base = read_toml(path)
        pol_fields = {f.name for f in fields(RoundPolicy)} - {"fleet"}
        pol = take(data.pop("policy", {}), pol_fields, f"{path} [policy]")
        broker = take(data.pop("broker", {}), {"host", "port", "ca_file", "username",
                                               "password_file", "keepalive_s",
                                               "backoff_initial_s", "backoff_max_s"},
                      f"{path} [broker]")
        metrics = take(data.pop("metrics", {}), {"port", "host"}, f"{path} [metrics]")
        limits = take(data.pop("limits", {}), {"burst", "rate", "log_interval_s",
                                               "log_per_key"}, f"{path} [limits]")
        evaluation = take(data.pop("evaluation", {}), {"data"}, f"{path} [evaluation]")
        top = take(data, {"fleet", "identity", "registry", "checkpoint", "model", "manifest",
                          "model_seed", "tick_s"}, str(path))
        values: dict[str, Any] = dict(top)
        for key in ("identity", "registry", "checkpoint", "manifest"):
            values[key] = path_in(base, top.get(key), key)
        values["ca_file"] = path_in(base, broker.get("ca_file"), "ca_file")
        values["password_file"] = path_in(base, broker.get("password_file"), "password_file")
        values["evaluation"] = path_in(base, evaluation.get("data"), "[evaluation] data")
        values["zoo_dir"] = None if zoo_dir is None else Path(zoo_dir)
        if "host" in broker:
            values["broker_host"] = broker["host"]
        if "port" in broker:
            values["broker_port"] = broker["port"]
        for key in ("username", "keepalive_s", "backoff_initial_s", "backoff_max_s"):
            if key in broker:
                values[key] = broker[key]
        if "port" in metrics:
            values["metrics_port"] = metrics["port"]
        if "host" in metrics:
            values["metrics_host"] = metrics["host"]
        for key, field in (("burst", "flood_burst"), ("rate", "flood_rate"),
                           ("log_interval_s", "log_interval_s"), ("log_per_key", "log_per_key")):
            if key in limits:
                values[field] = limits[key]
        missing = [k for k in ("fleet", "broker_port", "password_file", "identity", "registry",
                               "checkpoint") if values.get(k) is None]
        if missing:
            raise ConfigError(f"{path}: missing setting(s) {missing}")
        try:
            values["policy"] = RoundPolicy(fleet=values["fleet"], **pol)
            return cls(**values)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: {e}") from None


def _peak_rss_kib() -> int | None:
    """This process's peak resident set (KiB), from /proc (None elsewhere). Not
    ``getrusage``'s ``ru_maxrss``: Linux keeps that across ``execve``, so a process started
    from a large parent reports the parent's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class _Metrics:
    """Prometheus collectors in a registry of their own, optionally served over HTTP."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        p = "fedge_aggregator_"
        self.round = Gauge(p + "round", "The open (or last) round id", registry=r)
        self.stage = Gauge(p + "stage", "1 for the current stage", ["stage"], registry=r)
        self.model_version = Gauge(p + "model_version", "Global model version", registry=r)
        self.rounds = Counter(p + "rounds", "Rounds ended (by this process)", ["result"],
                              registry=r)
        self.survivors = Gauge(p + "last_round_survivors", "Uploads in the last round's sum",
                               registry=r)
        self.dropped = Gauge(p + "last_round_dropped",
                             "Last round's cohort members neither in the sum nor declining",
                             registry=r)
        self.round_seconds = Gauge(p + "last_round_duration_seconds",
                                   "Wall time of the last round", registry=r)
        self.accuracy = Gauge(p + "last_round_accuracy", "Accuracy of the last completed "
                              "round's model on the aggregator's evaluation set (0..1; "
                              "NaN: none configured or no round completed yet)", registry=r)
        self.accuracy.set(math.nan)
        self.stage_seconds = Histogram(p + "stage_duration_seconds", "Time spent per stage",
                                       ["stage"], registry=r,
                                       buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        self.rejected = Counter(p + "rejected_messages", "Inbound messages refused",
                                registry=r)
        self.received = Counter(p + "received_bytes", "Payload bytes received", registry=r)
        self.sent = Counter(p + "sent_bytes", "Payload bytes handed to MQTT", registry=r)
        self.messages = Counter(p + "received_messages", "Messages received", registry=r)
        self.connected = Gauge(p + "connected", "1 while connected to the broker", registry=r)
        self.quarantined = Counter(p + "quarantined", "Quarantines for exceeding the flood "
                                   "limits, by device", ["device"], registry=r)
        self.in_quarantine = Gauge(p + "devices_in_quarantine",
                                   "Devices whose messages are being dropped", registry=r)
        self.flood_dropped = Counter(p + "flood_dropped_messages", "Messages dropped unread "
                                     "from quarantined devices (counted at release)",
                                     ["device"], registry=r)
        self.resent = Counter(p + "resent_requests", "Stage requests sent again to devices "
                              "that had not answered", registry=r)
        self.status = Counter(p + "status_messages", "Messages on devices' status topics",
                              ["status"], registry=r)
        self.failed_uploads = Counter(p + "failed_round_uploads", "Uploads accepted in rounds "
                                      "that then failed: budget devices spent for nothing",
                                      registry=r)
        self.suppressed = Counter(p + "suppressed_log_lines", "Rejection log lines not "
                                  "written (rate limit)", registry=r)
        for s in _STAGES:
            self.stage.labels(stage=s).set(0)
        self._server: Any = None

    def serve(self, host: str, port: int, status: Callable[[], bytes]) -> int:
        self._server = serve_http(host, port, registry=self.registry, status=status)
        return int(self._server.server_address[1])

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Observed:
    """The MQTT endpoint: the round machine, its bytes counted and its events taken after
    every call."""

    def __init__(self, service: AggregatorService) -> None:
        self._s = service

    def subscriptions(self) -> list[str]:
        return self._s.machine.subscriptions(per_device=True)

    def on_connect(self, now: float) -> list[Publish]:
        self._s.metrics.connected.set(1)
        # a session kept from a version that subscribed with wildcards would still route a
        # quarantined device's messages here
        self._s.loop.unsubscribe(self._s.config.username, self._s.machine.subscriptions())
        return self._s._after(self._s.machine.on_connect(now), now)  # noqa: SLF001

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        self._s._bytes_in += len(payload)  # noqa: SLF001
        self._s.metrics.received.inc(len(payload))
        self._s.metrics.messages.inc()
        return self._s._after(self._s.machine.on_message(topic, payload, now), now)  # noqa: SLF001

    def on_tick(self, now: float) -> list[Publish]:
        self._s._suppressed(self._s._limiter.flush(now))  # noqa: SLF001
        return self._s._after(self._s.machine.on_tick(now), now)  # noqa: SLF001


class AggregatorService:
    """The aggregator of one fleet over MQTT (see the module docstring).

    Args:
        config: the service configuration.
        out: where JSON log lines go (default stdout).
        random_bytes: round seeds and nonces (``os.urandom``).
        clock: monotonic seconds (deadlines); wall: Unix time for log lines.

    Raises:
        ConfigError: unusable configuration, key, password or registry files, or a model
            that cannot be found (a zoo name without ``zoo_dir``).
        aggregator.store.CheckpointCorrupted, aggregator.rounds.SnapshotError: a checkpoint
            exists but cannot be resumed.
    """

    def __init__(self, config: AggregatorConfig, *, out: TextIO | None = None,
                 random_bytes: Callable[[int], bytes] = os.urandom,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        from edge_sdk.engine import OnnxEngine, load_manifest
        from edge_sdk.model import init_params

        self.config = config
        self._out = out if out is not None else sys.stdout
        self._clock, self._wall = clock, wall
        identity = load_aggregator_identity(config.identity, fleet=config.fleet)
        registry = load_registry(config.registry, fleet=config.fleet)
        if registry.aggregator_key != identity.public_key:
            raise ConfigError(f"{config.registry}: the aggregator key is not the one in "
                              f"{config.identity}")
        password = read_secret_file(config.password_file).decode().strip()
        manifest = load_manifest(resolve_manifest(config.model, config.manifest,
                                                  zoo_dir=config.zoo_dir))
        spec = manifest.spec
        # read before anything starts: a bad evaluation file stops the service here
        self.evaluation = (None if config.evaluation is None
                           else load_evaluation(config.evaluation, spec))
        self._engine = None if self.evaluation is None else OnnxEngine(manifest)
        self.store = CheckpointStore(config.checkpoint)
        self.resumed = self.store.exists()
        if self.resumed:
            self.machine = RoundMachine.restore(
                self.store.load(), policy=config.policy, identity=identity, registry=registry,
                random_bytes=random_bytes, checkpoint=self.store.save, limits=config.limits())
            shapes = [p.shape for p in self.machine.params]
            if shapes != [s for _, s in spec.param_shapes()]:
                raise ConfigError(f"{config.checkpoint}: holds a model of shapes {shapes}, "
                                  f"not {spec.name}")
        else:
            params = init_params(spec, np.random.default_rng(config.model_seed))
            self.machine = RoundMachine(policy=config.policy, identity=identity,
                                        registry=registry, params=params,
                                        random_bytes=random_bytes, checkpoint=self.store.save,
                                        limits=config.limits())
        self.metrics = _Metrics()
        self.metrics_port: int | None = None
        self._bytes_in = self._bytes_out = 0
        self._round_bytes = (0, 0)
        self._limiter = LogLimiter(interval_s=config.log_interval_s,
                                   per_key=config.log_per_key)
        self._stage_since = self._round_since = clock()
        self._stop = False
        self._closed = False
        self.loop = MqttLoop(
            BrokerAddress(host=config.broker_host, port=config.broker_port,
                          ca_file=None if config.ca_file is None else str(config.ca_file)),
            rng=random.Random(int.from_bytes(random_bytes(8), "big")), clock=clock,
            tick_s=config.tick_s)
        self.endpoint = _Observed(self)  # what the loop drives (the broker's client)
        self.loop.add(ClientConfig(username=config.username, password=password,
                                   keepalive_s=config.keepalive_s,
                                   backoff_initial_s=config.backoff_initial_s,
                                   backoff_max_s=config.backoff_max_s, max_inflight=100),
                      self.endpoint)
        self._gauges()
        self.status = StatusBoard(fleet=config.fleet, stage=self.machine.stage,
                                  round_id=self._open_round(),
                                  model_version=self.machine.model_version,
                                  evaluation=None if self.evaluation is None
                                  else str(self.evaluation.path))
        self._scores: dict[int, Evaluation] = {}  # this call's rounds, for the board
        try:
            if config.metrics_port is not None:
                self.metrics_port = self.metrics.serve(config.metrics_host, config.metrics_port,
                                                       self._status_json)
        except OSError as e:
            self._detach()
            raise ConfigError(f"metrics endpoint {config.metrics_host}:{config.metrics_port}: "
                              f"{e.strerror or e}") from None
        last = self.machine.history[-1].round_id if self.machine.history else None
        rnd = self._open_round()
        self.log({"event": "start", "resumed": self.resumed, "fleet": config.fleet,
                  "round": rnd if rnd is not None else last,
                  "stage": self.machine.stage, "model_version": self.machine.model_version,
                  "metrics_port": self.metrics_port, "pid": os.getpid()})

    # ------------------------------------------------------------------ running

    def stop(self) -> None:
        """Make :meth:`run` return soon (safe from a signal handler)."""
        self._stop = True

    def run(self, until: Callable[[], bool] | None = None, *,
            timeout: float | None = None) -> bool:
        """Serve until ``until()`` (True), ``timeout`` or :meth:`stop` (False)."""
        if self._closed:
            raise RuntimeError("the service is closed")
        self._stop = False
        self.loop.run(until=lambda: self._stop or (until is not None and until()),
                      timeout=timeout)
        return until is not None and until()

    def close(self, timeout: float = 5.0) -> None:
        """Final checkpoint, MQTT goodbye, metrics endpoint off. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.store.save(self.machine.snapshot())
            self.loop.close(timeout)
        finally:
            self._detach()
            self._suppressed(self._limiter.flush(math.inf))
            self.log({"event": "stop", "round": self._open_round(),
                      "stage": self.machine.stage,
                      "model_version": self.machine.model_version,
                      "max_rss_kib": _peak_rss_kib()})

    def _detach(self) -> None:
        self.metrics.shutdown()

    def __enter__(self) -> AggregatorService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ observing

    def log(self, event: dict[str, Any]) -> None:
        """Write one JSON log line."""
        self._out.write(json.dumps({"ts": round(self._wall(), 3), **event}) + "\n")
        self._out.flush()

    def _status_json(self) -> bytes:
        """The status page's JSON now (called from the HTTP server's threads)."""
        return snapshot_json(self.status.snapshot(at=self._wall(), bytes_in=self._bytes_in,
                                                  bytes_out=self._bytes_out))

    def _open_round(self) -> int | None:
        plan = self.machine.current_plan
        return None if plan is None else plan.round_id

    def _refused(self, line: dict[str, Any], device: str | None, now: float) -> None:
        """A refused message's line, at most ``log_per_key`` per device and reason class
        per interval (a flood of bad messages must not become a flood of lines)."""
        self.metrics.rejected.inc()
        write, done = self._limiter.admit("?" if device is None else device,
                                          f"{line['event']}: {line['reason']}", now)
        self._suppressed(done)
        if not write:
            self.metrics.suppressed.inc()
            return
        self.log(line)

    def _suppressed(self, done: list[Suppressed]) -> None:
        for s in done:
            self.log({"event": "suppressed", "device": s.device, "reason": s.reason,
                      "count": s.count, "interval_s": s.interval_s})

    def _event(self, ev: Event, now: float, sent: int) -> None:
        """One event of the machine's: its log line and metrics (``sent``: the bytes of
        the call's output, already counted; they belong to a round that starts in it)."""
        agg = self.config.username
        if isinstance(ev, Rejected):
            self._refused({"event": "rejected", "topic": ev.topic, "reason": ev.reason,
                           "round": ev.round_id, "stage": ev.stage}, ev.device, now)
        elif isinstance(ev, Duplicate):
            self._refused({"event": "duplicate", "topic": ev.topic, "reason": ev.reason},
                          ev.device, now)
        elif isinstance(ev, Declined):
            self.log({"event": "declined", "device": ev.device, "round": ev.round_id,
                      "reason": ev.reason})
        elif isinstance(ev, RoundStarted):
            self._round_since = now
            self._round_bytes = (self._bytes_in, self._bytes_out - sent)
        elif isinstance(ev, StageChanged):
            self.metrics.stage_seconds.labels(stage=ev.prev).observe(now - self._stage_since)
            self.log({"event": "stage", "round": ev.round_id, "stage": ev.stage,
                      "prev": ev.prev, "prev_s": round(now - self._stage_since, 3),
                      "round_s": round(now - self._round_since, 3)})
            self._stage_since = now
        elif isinstance(ev, RoundEnded):
            self._round_end(ev, now)
        elif isinstance(ev, Quarantined):
            self.metrics.quarantined.labels(device=ev.device).inc()
            self.loop.unsubscribe(agg, self.machine.device_subscriptions(ev.device))
            self.log({"event": "quarantined", "device": ev.device, "round": ev.round_id,
                      "until_round": ev.until_round, "stage": ev.stage,
                      "burst": self.config.flood_burst, "rate": self.config.flood_rate})
        elif isinstance(ev, Released):
            self.metrics.flood_dropped.labels(device=ev.device).inc(ev.dropped)
            self.loop.subscribe(agg, self.machine.device_subscriptions(ev.device))
            self.log({"event": "released", "device": ev.device, "dropped": ev.dropped})
        elif isinstance(ev, Resent):
            self.metrics.resent.inc(len(ev.devices))
            self.log({"event": "resent", "round": ev.round_id, "stage": ev.stage,
                      "devices": list(ev.devices), "attempt": ev.attempt})
        elif isinstance(ev, StatusSeen):
            self.metrics.status.labels(
                status=ev.status if ev.status in ("online", "offline") else "other").inc()
            self.log({"event": "status", "device": ev.device, "status": ev.status,
                      "removed": ev.removed})

    def _gauges(self) -> None:
        m = self.machine
        rnd = self._open_round()
        last = m.history[-1].round_id if m.history else 0
        self.metrics.round.set(rnd if rnd is not None else last)
        for s in _STAGES:
            self.metrics.stage.labels(stage=s).set(1 if s == m.stage else 0)
        self.metrics.model_version.set(m.model_version)
        self.metrics.in_quarantine.set(len(m.quarantined))

    def _after(self, out: list[Publish], now: float) -> list[Publish]:
        sent = sum(len(p.payload) for p in out)
        self._bytes_out += sent
        self.metrics.sent.inc(sent)
        events = self.machine.take_events()
        for ev in events:
            self._event(ev, now, sent)
        # a round started in this call owns the bytes it sent (as in the round_end line)
        starts = any(isinstance(ev, RoundStarted) for ev in events)
        self.status.feed(events, at=self._wall(), bytes_in=self._bytes_in,
                         bytes_out=self._bytes_out - (sent if starts else 0))
        for round_id, ev in self._scores.items():
            self.status.evaluated(round_id, accuracy=ev.accuracy, loss=ev.loss)
        self._scores.clear()
        self._gauges()
        return out

    def _round_end(self, ev: RoundEnded, now: float) -> None:
        o = ev.outcome
        cohort, declined, survivors = len(ev.cohort), len(ev.declined), len(o.survivors)
        dropped = max(0, cohort - survivors - declined)
        b_in, b_out = self._round_bytes
        duration = now - self._round_since
        self.metrics.rounds.labels(result="completed" if o.completed else "failed").inc()
        self.metrics.survivors.set(survivors)
        self.metrics.dropped.set(dropped)
        self.metrics.round_seconds.set(duration)
        if not o.completed:
            self.metrics.failed_uploads.inc(len(o.uploaded))
        score = self._evaluate() if o.completed else None
        if score is not None:
            self._scores[o.round_id] = score
            self.metrics.accuracy.set(score.accuracy)
        self.log({"event": "round_end", "round": o.round_id, "completed": o.completed,
                  "cohort": cohort, "survivors": survivors, "declined": declined,
                  "dropped": dropped, "survivor_ids": list(o.survivors),
                  "bytes_in": self._bytes_in - b_in, "bytes_out": self._bytes_out - b_out,
                  "duration_s": round(duration, 3), "model_version": o.model_version,
                  "detail": o.detail, "uploaded": list(o.uploaded),
                  "accuracy": None if score is None else score.accuracy,
                  "loss": None if score is None else score.loss})

    def _evaluate(self) -> Evaluation | None:
        """The global model now (a completed round's, when called from its ``RoundEnded``:
        the machine's events are taken after the call that ended it) on the evaluation set;
        None without one. Runs on the MQTT loop: a large set delays message handling."""
        if self.evaluation is None or self._engine is None:
            return None
        return evaluate(self._engine, self.machine.params, self.evaluation.x,
                        self.evaluation.y)
