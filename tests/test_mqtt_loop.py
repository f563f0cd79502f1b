"""edge_sdk/mqtt.py: one selector loop driving many paho clients against a real mosquitto
(marker ``broker``): 1,000 clients in one process, QoS 1 queued while offline, persistent
sessions across reconnects and a broker restart, last will, endpoint faults, packet size."""

from __future__ import annotations

import importlib
import logging
import random
import threading
import time

import pytest
from mqtt_support import Recorder, client, down_all, new_loop, settle, up_all

from edge_sdk import wire
from edge_sdk.mqtt import (
    OFFLINE,
    ONLINE,
    ClientConfig,
    PacketTooLarge,
    backoff_delay,
)
from edge_sdk.wire import Publish
from tools.broker import Broker, device_names

FLEET = "loop"


class EchoDevice:
    """Sends one ping once running; records the aggregator's answer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sent = False
        self.answer: bytes | None = None

    def subscriptions(self) -> list[str]:
        return [down_all(FLEET, self.name)]

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        self.answer = payload
        return []

    def on_tick(self, now: float) -> list[Publish]:
        if self.sent:
            return []
        self.sent = True
        return [Publish(wire.device_up_topic(FLEET, self.name, "ping"), self.name.encode())]


class EchoAggregator:
    """Answers every device's message on that device's down topic."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, bytes]] = set()

    def subscriptions(self) -> list[str]:
        return [up_all(FLEET)]

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        device = topic.split("/")[3]
        self.seen.add((device, payload))
        return [Publish(wire.device_down_topic(FLEET, device, "pong"), b"re:" + payload)]

    def on_tick(self, now: float) -> list[Publish]:
        return []


# ---------------------------------------------------------------------------- no broker


def test_backoff_is_exponential_capped_and_jittered() -> None:
    rng = random.Random(7)
    for attempt in range(12):
        ceiling = min(8.0, 0.5 * 2**attempt)
        d = [backoff_delay(attempt, initial=0.5, maximum=8.0, rng=rng) for _ in range(200)]
        assert all(ceiling / 2 <= x <= ceiling for x in d)
        assert max(d) - min(d) > ceiling / 4  # really jittered
    with pytest.raises(ValueError, match="attempt must be >= 0, got -1"):
        backoff_delay(-1, initial=1, maximum=2, rng=rng)


@pytest.mark.parametrize("module", ["edge_sdk.mqtt", "tools.broker"])
def test_all_is_honest(module: str) -> None:
    mod = importlib.import_module(module)
    public = {n for n in dir(mod) if not n.startswith("_")}
    assert set(mod.__all__) <= public
    defined_here = {n for n in public if getattr(getattr(mod, n), "__module__", None) == module}
    assert defined_here <= set(mod.__all__)


def test_client_config_requires_a_lasting_session() -> None:
    with pytest.raises(ValueError, match="session_expiry_s must be > 0, got 0"):
        ClientConfig(username="d", password="p", session_expiry_s=0)


# ------------------------------------------------------------------------- real broker


def _start(broker: Broker, devices: list[str]) -> tuple:
    loop = new_loop(broker)
    agg = EchoAggregator()
    loop.add(client(broker, "aggregator"), agg)
    # The aggregator must be subscribed before devices publish: MQTT delivers nothing
    # published before a subscription exists.
    assert loop.run(until=lambda: loop.is_ready("aggregator"), timeout=10)
    devs = [EchoDevice(n) for n in devices]
    for d in devs:
        loop.add(client(broker, d.name), d)
    return loop, agg, devs


@pytest.mark.broker
@pytest.mark.parametrize("n", [1000])
def test_thousand_clients_one_loop_roundtrip(n: int) -> None:
    names = device_names(n)
    with Broker(devices=names, fleet=FLEET) as broker:  # TLS + passwords + ACLs
        t0 = time.perf_counter()
        loop, agg, devs = _start(broker, names)
        assert loop.run(until=lambda: loop.connected_count() == n + 1, timeout=90)
        t_connected = time.perf_counter()
        assert loop.run(until=lambda: all(d.answer is not None for d in devs), timeout=30)
        t_done = time.perf_counter()
        print(f"\n{n} TLS clients + aggregator, one MqttLoop: connected in "
              f"{t_connected - t0:.2f} s, all {n} roundtrips {t_done - t_connected:.2f} s later,"
              f" total {t_done - t0:.2f} s; {loop.stats}")
        assert all(d.answer == b"re:" + d.name.encode() for d in devs)
        assert len(agg.seen) == n
        assert loop.stats.endpoint_errors == 0 and loop.stats.publish_rejected == 0
        loop.close()


@pytest.mark.broker
def test_publish_before_connect_is_queued_not_dropped() -> None:
    with Broker(devices=["d1"], fleet=FLEET) as broker:
        loop, agg, _ = _start(broker, [])
        d1 = Recorder()
        loop.add(client(broker, "d1"), d1)
        topic = wire.device_up_topic(FLEET, "d1", "update")
        for i in range(50):  # more than the in-flight window
            loop.publish("d1", Publish(topic, b"%d" % i))
        assert not loop.is_connected("d1")
        assert loop.run(until=lambda: len(agg.seen) == 50, timeout=10)
        assert agg.seen == {("d1", b"%d" % i) for i in range(50)}
        loop.close()


@pytest.mark.broker
def test_persistent_session_gets_messages_sent_while_away() -> None:
    with Broker(devices=["d1"], fleet=FLEET) as broker:
        loop = new_loop(broker)
        loop.add(client(broker, "aggregator"), Recorder())
        first = Recorder([down_all(FLEET, "d1")])
        loop.add(client(broker, "d1"), first)
        assert loop.run(until=lambda: loop.is_ready("d1") and loop.is_ready("aggregator"),
                        timeout=10)
        assert not loop.session_present("d1")  # a brand-new session
        loop.remove("d1")  # gone (cleanly); the broker keeps the session

        down = wire.device_down_topic(FLEET, "d1", "plan")
        for i in range(5):
            loop.publish("aggregator", Publish(down, b"while-away-%d" % i))
        assert loop.run(until=lambda: loop.pending("aggregator") == 0, timeout=10)

        # A new client object (a restarted device process), same client id: its *first*
        # connect resumes the session instead of wiping it.
        second = Recorder([down_all(FLEET, "d1")])
        loop.add(client(broker, "d1"), second)
        assert loop.run(until=lambda: len(second.got) == 5, timeout=10)
        assert loop.session_present("d1")
        assert second.payloads() == [b"while-away-%d" % i for i in range(5)]
        assert first.got == []
        loop.close()


@pytest.mark.broker
def test_broker_restart_mid_run_loses_nothing() -> None:
    n, per_device = 20, 30
    names = device_names(n)

    class Streamer(EchoDevice):
        """Sends message 0, 1, ... one per tick, whatever the connection is doing."""

        def __init__(self, name: str) -> None:
            super().__init__(name)
            self.seq = 0

        def on_tick(self, now: float) -> list[Publish]:
            if self.seq == per_device:
                return []
            self.seq += 1
            return [Publish(wire.device_up_topic(FLEET, self.name, "chunk"),
                            b"%d" % (self.seq - 1))]

    with Broker(devices=names, fleet=FLEET) as broker:
        loop = new_loop(broker)
        agg = EchoAggregator()
        loop.add(client(broker, "aggregator"), agg)
        assert loop.run(until=lambda: loop.is_ready("aggregator"), timeout=10)
        devs = [Streamer(name) for name in names]
        for d in devs:
            loop.add(client(broker, d.name), d)
        assert loop.run(until=lambda: loop.connected_count() == n + 1, timeout=20)
        assert loop.run(until=lambda: len(agg.seen) >= n * per_device // 4, timeout=20)

        restarted = threading.Event()

        def restart() -> None:
            broker.restart()
            restarted.set()

        threading.Thread(target=restart, daemon=True).start()  # while the loop runs
        want = {(d.name, b"%d" % i) for d in devs for i in range(per_device)}
        t0 = time.perf_counter()
        done = loop.run(until=lambda: restarted.is_set() and agg.seen >= want, timeout=60)
        print(f"\nrecovered from a broker restart in {time.perf_counter() - t0:.2f} s; "
              f"{loop.stats}")
        assert done, f"missing {sorted(want - agg.seen)[:10]}"
        assert loop.stats.disconnects >= n + 1  # everyone really was cut off
        assert loop.stats.connects >= 2 * (n + 1)
        assert loop.session_present("aggregator")  # the session survived the restart
        # The conversation goes on after the restart: every device got its answers.
        assert loop.run(until=lambda: all(d.answer is not None for d in devs), timeout=10)
        loop.close()


@pytest.mark.broker
def test_last_will_on_network_failure_then_online_again() -> None:
    with Broker(devices=["d1"], fleet=FLEET) as broker:
        status = wire.status_topic(FLEET, "d1")
        watcher = Recorder([status])
        loop = new_loop(broker)
        loop.add(client(broker, "aggregator"), watcher)
        loop.add(client(broker, "d1"), Recorder())
        assert loop.run(until=lambda: watcher.payloads(status) == [ONLINE], timeout=10)
        loop.drop("d1")  # like a pulled cable: no DISCONNECT, the broker sends the will
        assert loop.run(until=lambda: watcher.payloads(status) == [ONLINE, OFFLINE, ONLINE],
                        timeout=10)
        loop.remove("d1")  # a clean goodbye publishes "offline" itself
        assert loop.run(until=lambda: watcher.payloads(status)[-1:] == [OFFLINE], timeout=10)
        loop.close()


@pytest.mark.broker
def test_endpoint_exception_is_logged_and_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    class Flaky(EchoAggregator):
        def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
            if payload == b"boom":
                raise RuntimeError("endpoint bug")
            return super().on_message(topic, payload, now)

    with Broker(devices=["d1"], fleet=FLEET) as broker:
        loop = new_loop(broker)
        agg = Flaky()
        loop.add(client(broker, "aggregator"), agg)
        loop.add(client(broker, "d1"), Recorder())
        assert loop.run(until=lambda: loop.is_ready("aggregator") and loop.is_ready("d1"),
                        timeout=10)
        topic = wire.device_up_topic(FLEET, "d1", "x")
        with caplog.at_level(logging.ERROR, logger="edge_sdk.mqtt"):
            loop.publish("d1", Publish(topic, b"boom"))
            loop.publish("d1", Publish(topic, b"fine"))
            assert loop.run(until=lambda: ("d1", b"fine") in agg.seen, timeout=10)
        assert loop.stats.endpoint_errors == 1
        assert any("aggregator" in r.getMessage() and "on_message" in r.getMessage()
                   for r in caplog.records)
        loop.close()


@pytest.mark.broker
def test_publish_over_broker_max_packet_size_is_refused() -> None:
    with Broker(devices=["d1"], fleet=FLEET, max_packet_size=4096) as broker:
        loop = new_loop(broker)
        agg = Recorder([up_all(FLEET)])
        loop.add(client(broker, "aggregator"), agg)
        assert loop.run(until=lambda: loop.is_ready("aggregator"), timeout=10)
        assert loop.max_packet_size("aggregator") == 4096  # from CONNACK
        d1 = Recorder()
        loop.add(client(broker, "d1"), d1)
        topic = wire.device_up_topic(FLEET, "d1", "update")
        fits = max(n for n in range(4096) if wire.mqtt_publish_size(topic, n) <= 4096)
        loop.publish("d1", Publish(topic, b"q" * (fits + 1)))  # queued: limit not known yet
        assert loop.run(until=lambda: loop.is_ready("d1"), timeout=10)
        with pytest.raises(PacketTooLarge, match="4097 bytes on the wire, over the broker's "
                                                 "Maximum Packet Size of 4096"):
            loop.publish("d1", Publish(topic, b"x" * (fits + 1)))
        loop.publish("d1", Publish(topic, b"y" * fits))  # exactly at the limit: sent
        d1.outbox.append(Publish(topic, b"z" * 10_000))  # an endpoint's oversized publish
        assert loop.run(until=lambda: agg.got, timeout=10)
        settle([loop])
        assert agg.got == [(topic, b"y" * fits)]
        assert loop.stats.oversized == 2 and loop.is_connected("d1")  # not kicked
        assert loop.stats.disconnects == 0
        loop.close()
