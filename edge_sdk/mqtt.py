"""The MQTT v5 adapter: paho-mqtt clients driven by one selector loop.

This is the only module (besides tests) that imports paho-mqtt. Sans-I/O endpoints (device
session, aggregator rounds) never see it: an endpoint returns ``wire.Publish`` values and
``MqttLoop`` sends them.

Why one selector loop: paho's ``loop_start()`` runs one thread and one ``select()`` per
client, and ``select()`` cannot watch descriptors >= 1024, so a process stops connecting
past ~340 clients. Here many clients share one ``selectors.DefaultSelector`` (epoll) driven
through paho's external-loop API (socket callbacks, ``loop_read``/``loop_write``/
``loop_misc``) in the calling thread.

Every connect, the first included, sets ``clean_start=False`` with a Session Expiry
Interval > 0: paho's default starts the *first* connect clean, which throws away a session
(and the QoS 1 messages queued in it) that a previous process of the same device left.

Exceptions (the whole tree: :mod:`edge_sdk.errors`)::

    errors.TransportError
     +-- PacketTooLarge   a publish exceeds the broker's Maximum Packet Size
"""

from __future__ import annotations

import logging
import selectors
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from edge_sdk.errors import TransportError
from edge_sdk.wire import Publish, mqtt_publish_size

__all__ = [
    "BrokerAddress",
    "ClientConfig",
    "Endpoint",
    "LoopStats",
    "MqttLoop",
    "OFFLINE",
    "ONLINE",
    "PacketTooLarge",
    "TransportError",
    "backoff_delay",
    "connect_properties",
    "make_client",
    "raise_open_file_limit",
]

log = logging.getLogger(__name__)

ONLINE = b"online"
OFFLINE = b"offline"
# CONNACK reason codes after which retrying with the same credentials is pointless.
_FATAL_CONNACK = {0x84, 0x85, 0x86, 0x87, 0x8A, 0x8C}  # bad version/id/password, not authz, banned


class PacketTooLarge(TransportError):
    """A publish would exceed the Maximum Packet Size the broker advertised in CONNACK."""


class _Uniform(Protocol):
    def random(self) -> float: ...


class Endpoint(Protocol):
    """What ``MqttLoop`` drives: a sans-I/O object that turns messages and time into publishes.

    An endpoint may also define ``on_connect(now) -> list[Publish]``, called after every
    successful (re)connect.
    """

    def subscriptions(self) -> list[str]: ...

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]: ...

    def on_tick(self, now: float) -> list[Publish]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class BrokerAddress:
    """Where the broker listens and how to trust it."""

    host: str = "127.0.0.1"
    port: int
    ca_file: str | None = None  # None: plain TCP (local experiments only)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    """One client's identity and connection policy.

    With the broker's ``use_username_as_clientid`` the client id is always the user name;
    ``client_id`` differs only in tests that try to spoof one.
    """

    username: str
    password: str
    client_id: str | None = None  # None: the user name
    status_topic: str | None = None  # retained "online"/"offline" (last will) when set
    keepalive_s: int = 30
    session_expiry_s: int = 24 * 3600
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 30.0
    connect_timeout_s: float = 5.0
    max_inflight: int = 20  # capped by the broker's Receive Maximum

    def __post_init__(self) -> None:
        if not self.username:
            raise ValueError(f"username must be non-empty, got {self.username!r}")
        if self.session_expiry_s <= 0:
            # 0 would end the session at disconnect: queued QoS 1 messages would be lost.
            raise ValueError(f"session_expiry_s must be > 0, got {self.session_expiry_s!r}")
        if self.keepalive_s < 1:
            raise ValueError(f"keepalive_s must be >= 1, got {self.keepalive_s!r}")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError(f"need 0 < backoff_initial_s <= backoff_max_s, got "
                             f"{self.backoff_initial_s!r}, {self.backoff_max_s!r}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight!r}")

    @property
    def id(self) -> str:
        return self.client_id if self.client_id is not None else self.username


@dataclass(slots=True)
class LoopStats:
    """Counters of one ``MqttLoop`` (for logs, benchmarks and tests)."""

    connects: int = 0
    disconnects: int = 0
    connect_failures: int = 0
    refused: int = 0
    published: int = 0
    acked: int = 0
    publish_rejected: int = 0
    received: int = 0
    endpoint_errors: int = 0
    oversized: int = 0


def backoff_delay(attempt: int, *, initial: float, maximum: float, rng: _Uniform) -> float:
    """Reconnect delay before attempt ``attempt`` (0-based): exponential, capped, jittered.

    "Equal jitter": half the capped exponential plus a uniform draw over the other half, so
    a fleet cut off at once (broker restart) does not reconnect in lock step, yet no client
    retries immediately.
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt!r}")
    ceiling = min(maximum, initial * 2.0 ** min(attempt, 62))
    return ceiling / 2 + rng.random() * ceiling / 2


def connect_properties(config: ClientConfig) -> Properties:
    """CONNECT properties: a session that outlives the connection."""
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = config.session_expiry_s
    return props


def make_client(broker: BrokerAddress, config: ClientConfig) -> paho.Client:
    """A configured, unconnected paho client: MQTT v5, callback API v2, credentials, TLS
    with the broker's CA, last will (retained "offline" on the status topic).

    Connect it with ``clean_start=False`` and ``connect_properties(config)``, as
    ``MqttLoop`` does.
    """
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=config.id,
                         protocol=paho.MQTTv5, transport="tcp")
    client.username_pw_set(config.username, config.password)
    if broker.ca_file is not None:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=broker.ca_file)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        client.tls_set_context(ctx)
    if config.status_topic is not None:
        client.will_set(config.status_topic, OFFLINE, qos=1, retain=True)
    client.max_inflight_messages_set(config.max_inflight)
    client.connect_timeout = config.connect_timeout_s
    # Exceptions inside paho callbacks are ours; let them reach MqttLoop's handlers.
    client.suppress_exceptions = False
    return client


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (one descriptor per connection)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


@dataclass(eq=False, slots=True)
class _Conn:
    config: ClientConfig
    endpoint: Endpoint
    client: paho.Client
    state: str = "new"  # new | connecting | connected | waiting | refused | closing | closed
    attempt: int = 0
    next_attempt: float = 0.0
    max_packet: int | None = None
    window: int = 20
    pending: deque[Publish] = field(default_factory=deque)
    inflight: set[int] = field(default_factory=set)
    sock: Any = None
    session_present: bool = False
    subscribed: bool = False  # SUBACK for this connection's subscriptions arrived
    connects: int = 0  # successful connects of this client in this loop


def _no_delay(sock: Any) -> None:
    """Send small MQTT packets at once: paho leaves Nagle's algorithm on, so a packet written
    while an earlier one is unacknowledged waited for the peer's delayed ACK (up to 40 ms
    on Linux), a stall per burst of publishes (the aggregator's ten per stage; issue 18's
    round timeline). mosquitto already sets it on its side (``set_tcp_nodelay``)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):  # not a TCP socket (a test double): nothing to do
        pass


class MqttLoop:
    """Drives many paho clients, each bound to an endpoint, from one thread.

    ``add`` clients, then ``run(until=..., timeout=...)``; ``close`` (or leaving the context)
    says goodbye. Publishes an endpoint returns (or ``publish`` is given) are QoS 1; they
    queue while the client is not connected, and at most ``window`` (the client's
    ``max_inflight``, capped by the broker's Receive Maximum) are handed to paho at once, so
    a reconnect never re-sends more than the broker accepts (mosquitto acknowledges excess
    messages with "quota exceeded" and drops them). An endpoint's exception is logged with
    the client id and counted; the loop goes on.
    """

    def __init__(self, broker: BrokerAddress, *, rng: _Uniform,
                 clock: Callable[[], float] = time.monotonic, tick_s: float = 0.1,
                 misc_s: float = 1.0, connects_per_pass: int = 50) -> None:
        if tick_s <= 0 or misc_s <= 0:
            raise ValueError(f"tick_s and misc_s must be > 0, got {tick_s!r}, {misc_s!r}")
        self.broker = broker
        self.stats = LoopStats()
        self._rng = rng
        self._clock = clock
        self._tick_s = tick_s
        self._misc_s = misc_s
        self._connects_per_pass = connects_per_pass
        self._sel = selectors.DefaultSelector()
        self._conns: dict[str, _Conn] = {}
        self._next_tick = 0.0
        self._next_misc = 0.0
        raise_open_file_limit()

    # -- public API ------------------------------------------------------------------------

    def add(self, config: ClientConfig, endpoint: Endpoint) -> None:
        """Bind a new client to ``endpoint``; it connects during the next ``run``."""
        if config.id in self._conns and self._conns[config.id].state != "closed":
            raise ValueError(f"client id {config.id!r} is already in this loop")
        client = make_client(self.broker, config)
        conn = _Conn(config, endpoint, client, window=config.max_inflight)
        client.user_data_set(conn)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        client.on_socket_open = self._on_socket_open
        client.on_socket_close = self._on_socket_close
        client.on_socket_register_write = self._on_register_write
        client.on_socket_unregister_write = self._on_unregister_write
        self._conns[config.id] = conn

    def publish(self, client_id: str, message: Publish) -> None:
        """Queue ``message`` on client ``client_id`` (sent once connected).

        Raises:
            PacketTooLarge: the broker already told this client a smaller Maximum Packet Size.
        """
        conn = self._conn(client_id)
        self._check_size(conn, message)
        conn.pending.append(message)
        self._pump(conn)

    def subscribe(self, client_id: str, filters: Iterable[str]) -> None:
        """Add subscriptions now (QoS 1, retained messages only if new). Not connected: a
        no-op; the endpoint's ``subscriptions()`` at the next connect are what count."""
        conn = self._conn(client_id)
        filters = list(filters)
        if conn.state == "connected" and filters:
            opts = SubscribeOptions(qos=1, retainHandling=SubscribeOptions.RETAIN_SEND_IF_NEW_SUB)
            conn.client.subscribe([(f, opts) for f in filters])

    def unsubscribe(self, client_id: str, filters: Iterable[str]) -> None:
        """Remove subscriptions now: the broker stops routing those topics to this client's
        session (what it queued before stays queued). Not connected: a no-op."""
        conn = self._conn(client_id)
        filters = list(filters)
        if conn.state == "connected" and filters:
            conn.client.unsubscribe(filters)

    def is_connected(self, client_id: str) -> bool:
        return self._conn(client_id).state == "connected"

    def is_ready(self, client_id: str) -> bool:
        """Connected and its subscriptions acknowledged: messages published from now on
        reach it (MQTT delivers nothing published before a subscription exists)."""
        conn = self._conn(client_id)
        return conn.state == "connected" and conn.subscribed

    def session_present(self, client_id: str) -> bool:
        """Whether the broker resumed a stored session at the last connect."""
        return self._conn(client_id).session_present

    def connected_count(self) -> int:
        return sum(c.state == "connected" for c in self._conns.values())

    def max_packet_size(self, client_id: str) -> int | None:
        """The broker's Maximum Packet Size from this client's last CONNACK, if any."""
        return self._conn(client_id).max_packet

    def pending(self, client_id: str) -> int:
        """Messages not yet acknowledged by the broker (queued here + in flight)."""
        conn = self._conn(client_id)
        return len(conn.pending) + len(conn.inflight)

    def drop(self, client_id: str) -> None:
        """Cut the client's TCP connection without DISCONNECT, as a network failure would
        (the broker publishes its will). The client reconnects with backoff."""
        conn = self._conn(client_id)
        sock = conn.client.socket()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the next read sees EOF -> reconnect
            except OSError:
                pass

    def remove(self, client_id: str, *, timeout: float = 5.0) -> None:
        """Say goodbye: flush queued publishes, retained "offline", DISCONNECT. The broker
        keeps the session (and queues QoS 1 messages for it) until it expires."""
        self._goodbye([self._conn(client_id)], timeout)
        del self._conns[client_id]

    def close(self, timeout: float = 5.0) -> None:
        """Remove every client (see ``remove``)."""
        self._goodbye(list(self._conns.values()), timeout)
        self._conns.clear()

    def run(self, *, until: Callable[[], bool] | None = None,
            timeout: float | None = None) -> bool:
        """Run until ``until()`` is true (returns True) or ``timeout`` seconds pass (False)."""
        deadline = None if timeout is None else self._clock() + timeout
        while True:
            if until is not None and until():
                return True
            now = self._clock()
            if deadline is not None and now >= deadline:
                return False
            self._step(now, deadline)

    def __enter__(self) -> MqttLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._sel.close()

    # -- the loop --------------------------------------------------------------------------

    def _step(self, now: float, deadline: float | None) -> None:
        self._connect_due(now)
        wake = min(self._next_tick, self._next_misc, self._next_connect())
        if deadline is not None:
            wake = min(wake, deadline)
        timeout = max(0.0, min(wake - self._clock(), self._tick_s))
        events = self._sel.select(timeout) if self._sel.get_map() else _sleep(timeout)
        for key, mask in events:
            conn: _Conn = key.data
            if mask & selectors.EVENT_READ:
                self._read(conn)
            if mask & selectors.EVENT_WRITE and conn.client.socket() is not None:
                self._guard(conn, conn.client.loop_write)
        now = self._clock()
        if now >= self._next_tick:
            self._next_tick = now + self._tick_s
            for conn in list(self._conns.values()):
                if conn.state not in ("refused", "closing", "closed"):
                    self._deliver(conn, "on_tick", conn.endpoint.on_tick, now)
        if now >= self._next_misc:
            self._next_misc = now + self._misc_s
            for conn in list(self._conns.values()):
                if conn.client.socket() is not None:
                    self._guard(conn, conn.client.loop_misc)

    def _read(self, conn: _Conn) -> None:
        # TLS: one socket read can leave whole MQTT packets decrypted inside the SSL object,
        # where the selector cannot see them; keep reading while it has bytes pending.
        for _ in range(1000):
            self._guard(conn, conn.client.loop_read)
            sock = conn.client.socket()
            if sock is None or not isinstance(sock, ssl.SSLSocket) or sock.pending() == 0:
                return

    def _guard(self, conn: _Conn, op: Callable[[], MQTTErrorCode]) -> None:
        try:
            op()
        except (OSError, ssl.SSLError) as exc:
            log.warning("mqtt client %s: network error %r", conn.config.id, exc)
        except Exception:
            # One client's surprise (a paho bug, a malformed packet) must not stop the rest.
            log.exception("mqtt client %s: unexpected error in the network loop",
                          conn.config.id)

    def _next_connect(self) -> float:
        due = [c.next_attempt for c in self._conns.values() if c.state in ("new", "waiting")]
        return min(due, default=float("inf"))

    def _connect_due(self, now: float) -> None:
        # Connecting blocks (TCP + TLS handshake); a bounded batch per pass keeps reads flowing.
        budget = self._connects_per_pass
        for conn in list(self._conns.values()):
            if budget == 0:
                return
            if conn.state in ("new", "waiting") and conn.next_attempt <= now:
                budget -= 1
                self._connect(conn)

    def _connect(self, conn: _Conn) -> None:
        first = conn.state == "new"
        conn.state = "connecting"
        try:
            if first:
                conn.client.connect(self.broker.host, self.broker.port,
                                    keepalive=conn.config.keepalive_s, clean_start=False,
                                    properties=connect_properties(conn.config))
            else:
                conn.client.reconnect()
        except (OSError, ssl.SSLError) as exc:
            self.stats.connect_failures += 1
            log.info("mqtt client %s: connect failed: %r", conn.config.id, exc)
            # connect() stored host, port, clean_start and properties before it failed, so
            # later attempts are reconnect()s with the same settings.
            self._schedule_retry(conn)

    def _schedule_retry(self, conn: _Conn) -> None:
        delay = backoff_delay(conn.attempt, initial=conn.config.backoff_initial_s,
                              maximum=conn.config.backoff_max_s, rng=self._rng)
        conn.attempt += 1
        conn.next_attempt = self._clock() + delay
        conn.state = "waiting"

    # -- paho callbacks (all run inside this thread) ----------------------------------------

    def _on_socket_open(self, client: paho.Client, conn: _Conn, sock: Any) -> None:
        conn.sock = sock
        _no_delay(sock)
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _on_socket_close(self, client: paho.Client, conn: _Conn, sock: Any) -> None:
        if conn.sock is sock:
            conn.sock = None
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass

    def _on_register_write(self, client: paho.Client, conn: _Conn, sock: Any) -> None:
        try:
            self._sel.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        except (KeyError, ValueError):
            pass

    def _on_unregister_write(self, client: paho.Client, conn: _Conn, sock: Any) -> None:
        try:
            self._sel.modify(sock, selectors.EVENT_READ, conn)
        except (KeyError, ValueError):
            pass

    def _on_connect(self, client: paho.Client, conn: _Conn, flags: Any, reason: ReasonCode,
                    props: Properties | None) -> None:
        if reason.is_failure:
            if reason.value in _FATAL_CONNACK:
                self.stats.refused += 1
                conn.state = "refused"
                log.error("mqtt client %s: broker refused the connection: %s",
                          conn.config.id, reason)
            else:
                log.warning("mqtt client %s: CONNACK %s", conn.config.id, reason)
            return
        self.stats.connects += 1
        conn.connects += 1
        conn.state = "connected"
        conn.attempt = 0
        conn.session_present = bool(flags.session_present)
        conn.max_packet = getattr(props, "MaximumPacketSize", None)
        receive_max = getattr(props, "ReceiveMaximum", 65535)
        conn.window = max(1, min(conn.config.max_inflight, receive_max))
        try:
            subs = list(conn.endpoint.subscriptions())
        except Exception:
            self.stats.endpoint_errors += 1
            log.exception("mqtt client %s: endpoint subscriptions raised", conn.config.id)
            subs = []
        conn.subscribed = not subs
        if subs:
            # Retained messages: on this process's first connect always (a restarted device
            # resumes its broker session, subscriptions included, but has lost the retained
            # model it got before); on later reconnects only for new subscriptions, since
            # this endpoint already holds them.
            handling = (SubscribeOptions.RETAIN_SEND_ON_SUBSCRIBE if conn.connects == 1
                        else SubscribeOptions.RETAIN_SEND_IF_NEW_SUB)
            opts = SubscribeOptions(qos=1, retainHandling=handling)
            client.subscribe([(topic, opts) for topic in subs])
        if conn.config.status_topic is not None:
            # Ahead of the queue: "online" must not wait behind a backlog of uploads.
            conn.pending.appendleft(Publish(conn.config.status_topic, ONLINE, retain=True))
        on_connect = getattr(conn.endpoint, "on_connect", None)
        if on_connect is not None:
            self._deliver(conn, "on_connect", on_connect, self._clock())
        self._pump(conn)

    def _on_subscribe(self, client: paho.Client, conn: _Conn, mid: int,
                      reasons: list[ReasonCode], props: Properties | None) -> None:
        conn.subscribed = True
        # mosquitto grants subscriptions its ACL denies (it just delivers nothing), so a
        # success here proves little; failures are still worth a line.
        for reason in reasons:
            if reason.is_failure:
                log.warning("mqtt client %s: subscription refused: %s", conn.config.id, reason)

    def _on_disconnect(self, client: paho.Client, conn: _Conn, flags: Any, reason: ReasonCode,
                       props: Properties | None) -> None:
        if conn.state == "connected":
            self.stats.disconnects += 1
        conn.subscribed = False
        if conn.state in ("closing", "closed", "refused"):
            if conn.state == "closing":
                conn.state = "closed"
            return
        log.info("mqtt client %s: disconnected (%s); reconnecting", conn.config.id, reason)
        self._schedule_retry(conn)

    def _on_message(self, client: paho.Client, conn: _Conn, msg: paho.MQTTMessage) -> None:
        self.stats.received += 1
        self._deliver(conn, "on_message", conn.endpoint.on_message, msg.topic,
                      bytes(msg.payload), self._clock())

    def _on_publish(self, client: paho.Client, conn: _Conn, mid: int, reason: ReasonCode,
                    props: Properties | None) -> None:
        conn.inflight.discard(mid)
        self.stats.acked += 1
        if reason.is_failure:
            # e.g. "Not authorized" (ACL) or "Quota exceeded": the broker dropped it.
            self.stats.publish_rejected += 1
            log.warning("mqtt client %s: broker rejected publish mid=%d: %s",
                        conn.config.id, mid, reason)
        self._pump(conn)

    # -- helpers ---------------------------------------------------------------------------

    def _deliver(self, conn: _Conn, what: str, fn: Callable[..., Iterable[Publish]],
                 *args: Any) -> None:
        try:
            out = list(fn(*args))
        except Exception:
            self.stats.endpoint_errors += 1
            log.exception("mqtt client %s: endpoint %s raised", conn.config.id, what)
            return
        for message in out:
            try:
                self._check_size(conn, message)
            except PacketTooLarge as exc:
                self.stats.oversized += 1
                log.error("mqtt client %s: %s", conn.config.id, exc)
                continue
            conn.pending.append(message)
        self._pump(conn)

    def _check_size(self, conn: _Conn, message: Publish) -> None:
        if not isinstance(message, Publish):
            raise TypeError(f"endpoints must return wire.Publish values, got {message!r}")
        limit = conn.max_packet
        if limit is None:
            return
        size = mqtt_publish_size(message.topic, len(message.payload))
        if size > limit:
            raise PacketTooLarge(
                f"publish to {message.topic!r} is {size} bytes on the wire, over the broker's "
                f"Maximum Packet Size of {limit} bytes (chunk it with edge_sdk.wire)")

    def _pump(self, conn: _Conn) -> None:
        """Hand queued publishes to paho while the window has room."""
        if conn.state != "connected":
            return
        while conn.pending and len(conn.inflight) < conn.window:
            message = conn.pending[0]
            try:
                self._check_size(conn, message)  # the limit may be new since it was queued
            except PacketTooLarge as exc:
                conn.pending.popleft()
                self.stats.oversized += 1
                log.error("mqtt client %s: %s", conn.config.id, exc)
                continue
            info = conn.client.publish(message.topic, message.payload, qos=1,
                                       retain=message.retain)
            if info.rc not in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
                log.error("mqtt client %s: paho refused publish to %r: %s", conn.config.id,
                          message.topic, paho.error_string(info.rc))
                return
            # NO_CONN: paho keeps the message and sends it after the next CONNACK.
            conn.pending.popleft()
            conn.inflight.add(info.mid)
            self.stats.published += 1

    def _goodbye(self, conns: list[_Conn], timeout: float) -> None:
        deadline = self._clock() + timeout
        for conn in conns:
            if conn.config.status_topic is not None and conn.state == "connected":
                conn.pending.append(Publish(conn.config.status_topic, OFFLINE, retain=True))
                self._pump(conn)
        live = [c for c in conns if c.state == "connected"]
        self.run(until=lambda: all(not c.pending and not c.inflight or c.state != "connected"
                                   for c in live),
                 timeout=max(0.0, deadline - self._clock()))
        for conn in conns:
            was = conn.state
            conn.state = "closing"
            if was in ("connected", "connecting"):
                conn.client.disconnect()
            else:
                conn.state = "closed"
        self.run(until=lambda: all(c.client.socket() is None for c in conns),
                 timeout=max(0.1, deadline - self._clock()))
        for conn in conns:
            if conn.client.socket() is not None:
                # Did not drain in time. paho has no public abort; its own close path keeps
                # the selector in step through on_socket_close.
                conn.client._sock_close()
            conn.state = "closed"

    def _conn(self, client_id: str) -> _Conn:
        try:
            return self._conns[client_id]
        except KeyError:
            raise ValueError(f"no client {client_id!r} in this loop") from None


def _sleep(seconds: float) -> list[Any]:
    time.sleep(seconds)
    return []
