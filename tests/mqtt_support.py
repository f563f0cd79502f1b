"""Helpers shared by the tests against a real mosquitto (tests/test_broker.py,
tests/test_mqtt_loop.py): a recording endpoint and loop/credential plumbing."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from edge_sdk import wire
from edge_sdk.mqtt import BrokerAddress, ClientConfig, MqttLoop
from edge_sdk.wire import Publish
from tools.broker import Broker

# Absence of a message is checked by waiting this long after a positive control arrived.
QUIET_S = 0.5


class Recorder:
    """Endpoint that subscribes to ``subs``, records what arrives, sends what is queued."""

    def __init__(self, subs: Sequence[str] = ()) -> None:
        self.subs = list(subs)
        self.got: list[tuple[str, bytes]] = []
        self.connects = 0
        self.outbox: list[Publish] = []

    def subscriptions(self) -> list[str]:
        return self.subs

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        self.got.append((topic, payload))
        return []

    def on_tick(self, now: float) -> list[Publish]:
        out, self.outbox = self.outbox, []
        return out

    def on_connect(self, now: float) -> list[Publish]:
        self.connects += 1
        return []

    def payloads(self, topic: str | None = None) -> list[bytes]:
        return [p for t, p in self.got if topic is None or t == topic]


def address(broker: Broker) -> BrokerAddress:
    c = broker.config
    return BrokerAddress(host=c.host, port=c.port,
                         ca_file=str(c.ca_file) if c.ca_file else None)


def client(broker: Broker, name: str, *, client_id: str | None = None,
           password: str | None = None, status: bool = True) -> ClientConfig:
    """Config for device/aggregator ``name`` with its real password (unless given)."""
    c = broker.config
    is_device = name in c.devices
    return ClientConfig(
        username=name, password=c.password(name) if password is None else password,
        client_id=client_id,
        status_topic=wire.status_topic(c.fleet, name) if status and is_device else None,
        backoff_initial_s=0.05, backoff_max_s=1.0)


def new_loop(broker: Broker, seed: int = 0) -> MqttLoop:
    return MqttLoop(address(broker), rng=random.Random(seed))


def run_all(loops: Sequence[MqttLoop], until: Callable[[], bool], timeout: float) -> bool:
    """Interleave several loops in this thread until ``until()`` or ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for loop in loops:
            loop.run(timeout=0.01)
        if until():
            return True
    return until()


def settle(loops: Sequence[MqttLoop], seconds: float = QUIET_S) -> None:
    run_all(loops, lambda: False, seconds)


def down_all(fleet: str, device: str) -> str:
    """Subscription filter for all of a device's down messages (wire builds concrete topics)."""
    return wire.device_down_topic(fleet, device, "x")[:-1] + "#"


def up_all(fleet: str, device: str = "+") -> str:
    """Subscription filter for a device's (default: every device's) up messages."""
    return f"{wire.fleet_topic(fleet)}/dev/{device}/up/#"
