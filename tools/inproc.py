"""An in-process MQTT-like broker for sans-I/O endpoints (the in-memory transport).

:class:`MemoryBroker` drives endpoints through the same four methods ``edge_sdk.mqtt``'s
``MqttLoop`` uses (``subscriptions``, ``on_connect``, ``on_message``, ``on_tick``), with MQTT
topic-filter matching and retained messages, so what passes here runs over mosquitto too.
It is deterministic: FIFO delivery, one thread, time is whatever ``now`` the caller passes.
MQTT v5 shared subscriptions (``$share/<group>/<filter>``) deliver each message to one
member of the group, in turn; endpoints may subscribe and unsubscribe while attached.
The protocol tests (tests/test_session_rounds.py) and the fleet simulator
(``tools.fleet``, ``--transport inproc``) use it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from edge_sdk.wire import Publish

__all__ = ["MemoryBroker", "shared_parts", "topic_matches"]


def shared_parts(pattern: str) -> tuple[str | None, str]:
    """(The share group, the topic filter) of an MQTT v5 subscription filter: a shared one
    is ``$share/<group>/<filter>``; (None, ``pattern``) for any other."""
    if pattern.startswith("$share/"):
        parts = pattern.split("/", 2)
        if len(parts) == 3 and parts[1] and parts[2]:
            return parts[1], parts[2]
        raise ValueError(f"a shared subscription is $share/<group>/<filter>, got {pattern!r}")
    return None, pattern


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT topic-filter matching (``+`` one level, ``#`` the rest, also zero levels)."""
    p, t = pattern.split("/"), topic.split("/")
    for i, part in enumerate(p):
        if part == "#":
            return True
        if i >= len(t) or (part != "+" and part != t[i]):
            return False
    return len(p) == len(t)


class MemoryBroker:
    """A small in-process pub/sub: FIFO delivery, QoS 1 as exactly-once, retained messages.

    ``drop(name, topic, payload)`` may veto a delivery (the endpoint vanished); ``after``
    is called after each endpoint call and may swap endpoints (crash + restore). ``sent``
    records every publish as (sender, topic, payload).
    """

    def __init__(self) -> None:
        self.endpoints: dict[str, Any] = {}
        self.subs: list[tuple[str, str]] = []
        self.retained: dict[str, bytes] = {}
        self.queue: deque[tuple[str, str, bytes]] = deque()
        self.drop: Callable[[str, str, bytes], bool] = lambda name, topic, payload: False
        self.after: Callable[[str], bool] = lambda name: False
        self.sent: list[tuple[str, str, bytes]] = []  # (sender, topic, payload)
        self._routes: dict[str, list[tuple[str, str]]] = {}  # topic -> matching subs
        self._by_prefix: dict[tuple[str, ...], list[tuple[str, str]]] = {}
        self._seq: dict[tuple[str, str], int] = {}  # (filter, client) -> subscription order
        self._next = 0
        self._turns: dict[str, int] = {}  # share group -> messages it has delivered

    def _index(self, pattern: str, name: str, add: bool) -> None:
        """The filters by their levels before the first wildcard (a topic's candidates are
        the filters under its own prefixes: a lookup per level, not a scan of every
        filter, for fleets of thousands of devices, each with its own filters)."""
        levels = shared_parts(pattern)[1].split("/")
        cut = next((i for i, lv in enumerate(levels) if lv in ("+", "#")), len(levels))
        key = tuple(levels[:cut])
        entries = self._by_prefix.setdefault(key, [])
        if add:
            entries.append((pattern, name))
        else:
            entries.remove((pattern, name))
            if not entries:
                del self._by_prefix[key]

    def _route(self, topic: str) -> list[tuple[str, str]]:
        route = self._routes.get(topic)
        if route is None:
            levels = tuple(topic.split("/"))
            found = [(f, n) for i in range(len(levels) + 1)
                     for f, n in self._by_prefix.get(levels[:i], ())
                     if topic_matches(shared_parts(f)[1], topic)]
            # in subscription order, as a scan of self.subs would give them
            route = self._routes[topic] = sorted(found, key=self._seq.__getitem__)
        return route

    def attach(self, name: str, endpoint: Any, now: float) -> None:
        """Connect ``endpoint`` as client ``name``: subscribe, retained messages, on_connect."""
        self.endpoints[name] = endpoint
        self.subscribe(name, endpoint.subscriptions(), now)
        if getattr(endpoint, "on_connect", None) is not None:
            self._call(name, lambda e: e.on_connect(now))

    def subscribe(self, name: str, filters: list[str], now: float = 0.0) -> None:
        """Client ``name`` subscribes to ``filters`` (retained messages delivered, except
        to shared subscriptions, as MQTT v5 says); a filter it holds already is kept once."""
        new = [f for f in dict.fromkeys(filters) if (f, name) not in self._seq]
        self.subs += [(f, name) for f in new]
        for f in new:
            shared_parts(f)  # a malformed $share filter is refused here
            self._index(f, name, True)
            self._seq[(f, name)] = self._next
            self._next += 1
        self._routes.clear()
        plain = [f for f in new if shared_parts(f)[0] is None]
        for topic, payload in list(self.retained.items()):
            if any(topic_matches(f, topic) for f in plain):
                self._call(name, lambda e, t=topic, p=payload: e.on_message(t, p, now))

    def unsubscribe(self, name: str, filters: list[str]) -> None:
        """Client ``name`` drops ``filters`` (those it does not hold are ignored)."""
        gone = {(f, name) for f in filters} & self._seq.keys()
        for f, n in gone:
            self._index(f, n, False)
            del self._seq[(f, n)]
        self.subs = [sub for sub in self.subs if sub not in gone]
        self._routes.clear()

    def detach(self, name: str) -> None:
        """Disconnect client ``name`` (nothing more is delivered to it)."""
        self.endpoints.pop(name, None)
        for f, n in self.subs:
            if n == name:
                self._index(f, n, False)
                self._seq.pop((f, n), None)
        self.subs = [(f, n) for f, n in self.subs if n != name]
        self._routes.clear()

    def publish(self, sender: str, message: Publish) -> None:
        """Queue ``message`` as if client ``sender`` had published it."""
        self._enqueue(sender, [message])

    def _call(self, name: str, fn: Callable[[Any], list[Publish]]) -> None:
        out = fn(self.endpoints[name])
        if self.after(name):  # the endpoint crashed before its output left
            return
        self._enqueue(name, out)

    def _enqueue(self, name: str, out: list[Publish]) -> None:
        for p in out:
            if not (isinstance(p, Publish) and isinstance(p.payload, bytes)):
                raise TypeError(f"endpoints must return wire.Publish with bytes, got {p!r}")
            self.sent.append((name, p.topic, p.payload))
            if p.retain:
                self.retained[p.topic] = p.payload
            self.queue.append((name, p.topic, p.payload))

    def run(self, now: float) -> None:
        """Deliver until nothing is queued (endpoints' answers included)."""
        while self.queue:
            _, topic, payload = self.queue.popleft()
            for name in self._receivers(topic):
                if name in self.endpoints:
                    if self.drop(name, topic, payload):
                        continue
                    self._call(name, lambda e, t=topic, p=payload: e.on_message(t, p, now))

    def _receivers(self, topic: str) -> list[str]:
        """Who gets a message on ``topic``: every plain subscriber, and one member of each
        share group with a matching filter, in turn (deterministic round robin)."""
        out: list[str] = []
        groups: dict[str, list[str]] = {}
        for f, name in self._route(topic):
            group = shared_parts(f)[0]
            if group is None:
                out.append(name)
            elif name in self.endpoints and name not in groups.setdefault(group, []):
                groups[group].append(name)
        for group, members in groups.items():
            turn = self._turns.get(group, 0)
            self._turns[group] = turn + 1
            out.append(members[turn % len(members)])
        return out

    def tick(self, now: float, names: list[str] | None = None) -> None:
        """Every endpoint's (or only ``names``') ``on_tick(now)``, then deliver."""
        for name in list(self.endpoints) if names is None else names:
            if name in self.endpoints:
                self._call(name, lambda e: e.on_tick(now))
        self.run(now)
