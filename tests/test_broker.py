"""tools/broker.py: the config it writes, and (marker ``broker``) what a real mosquitto run
with it enforces: TLS, passwords, per-device ACLs, no client-id spoofing (issue 6, "Must
show 4"). Absence of delivery is always checked with a real subscriber, a positive control
that does arrive, and a quiet period; never from a SUBACK, which mosquitto grants even for
subscriptions its ACL denies."""

from __future__ import annotations

import base64
import hashlib
import json
import stat
import subprocess
from pathlib import Path

import pytest
from mqtt_support import Recorder, client, down_all, new_loop, run_all, settle

from edge_sdk import wire
from edge_sdk.wire import Publish
from tools.broker import (
    FLOOD_HEADROOM,
    Broker,
    acl_text,
    device_names,
    hash_password,
    read_broker_config,
    write_broker_config,
)
from tools.cli import main

FLEET = "sec"
A, B, AGG = "dev-a", "dev-b", "aggregator"


# ----------------------------------------------------------------------- config (no broker)


def test_config_files_private_and_sized(tmp_path: Path) -> None:
    cfg = write_broker_config(tmp_path, devices=device_names(30), fleet="f1", port=18883,
                              messages_per_round=50)
    for path in (cfg.password_file, cfg.credentials_file, tmp_path / "server.key"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert not (tmp_path / "ca.key").exists()  # the CA key is never written
    conf = cfg.config_file.read_text()
    assert "allow_anonymous false" in conf
    assert "use_username_as_clientid true" in conf
    assert "persistence true" in conf
    assert "listener 18883 127.0.0.1" in conf
    # 30 devices x 50 messages per round, plus headroom for one device's flood
    assert f"max_queued_messages {1500 + FLOOD_HEADROOM}" in conf
    assert f"max_packet_size {8 * 2**20}" in conf
    assert cfg.max_queued_messages == 1500 + FLOOD_HEADROOM
    # Small fleets keep at least mosquitto's default.
    small = write_broker_config(tmp_path / "s", devices=["x"], fleet="f1", port=18883)
    assert small.max_queued_messages == 1000 + FLOOD_HEADROOM

    again = read_broker_config(tmp_path)
    assert again == cfg
    data = json.loads(cfg.credentials_file.read_text())
    assert set(data["passwords"]) == {"aggregator", *device_names(30)}
    assert len(set(data["passwords"].values())) == 31  # one random password each


def test_password_hash_is_mosquittos_pbkdf2_format() -> None:
    salt = bytes(range(12))
    line = hash_password("secret", salt=salt)
    _, seven, iterations, b64salt, b64hash = line.split("$")
    assert (seven, iterations) == ("7", "101")
    assert base64.b64decode(b64salt) == salt
    assert base64.b64decode(b64hash) == hashlib.pbkdf2_hmac("sha512", b"secret", salt, 101, 64)


def test_acl_from_wire_layout() -> None:
    text = acl_text("f1", ["d1", "d2"], "agg")
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    pattern = wire.device_up_topic("f1", "DEV", "KIND").replace("DEV", "%u").replace("KIND", "#")
    assert f"pattern write {pattern}" in lines
    assert "pattern read fedge/f1/dev/%u/down/#" in lines
    assert "pattern write fedge/f1/status/%u" in lines
    assert lines[lines.index("user agg") + 1] == "topic readwrite fedge/f1/#"
    d1 = lines.index("user d1")
    assert lines[d1 + 1:d1 + 3] == ["topic read fedge/f1/model", "topic read fedge/f1/round"]
    assert not any("write fedge/f1/model" in ln or "write fedge/f1/round" in ln
                   for ln in lines if not ln.startswith("topic readwrite"))


@pytest.mark.parametrize("kwargs, match", [
    ({"devices": []}, "at least one device"),
    ({"devices": ["a", "a"]}, "duplicates"),
    ({"devices": ["a+"]}, "device must be"),
    ({"devices": ["a", "aggregator"]}, "also a device"),
    ({"devices": ["a"], "port": 0}, "port must be"),
    ({"devices": ["a"], "fleet": "f/#"}, "fleet must be"),
])
def test_config_rejects_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    args = {"fleet": "f1", "port": 18883} | kwargs
    with pytest.raises(ValueError, match=match):
        write_broker_config(tmp_path, **args)


def test_cli_broker_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b"
    assert main(["broker", "config", "--devices", "3", "--fleet", "lab", "--port", "2883",
                 "--out", str(out), "--no-tls"]) == 0
    printed = capsys.readouterr().out
    assert str(out / "mosquitto.conf") in printed
    cfg = read_broker_config(out)
    assert cfg.devices == ("dev-0000", "dev-0001", "dev-0002")
    assert (cfg.fleet, cfg.port, cfg.ca_file) == ("lab", 2883, None)
    assert "cafile" not in cfg.config_file.read_text()


# ------------------------------------------------------------------- a real mosquitto


@pytest.fixture
def broker():
    with Broker(devices=[A, B], fleet=FLEET) as b:
        yield b


def _mosquitto_pub(broker: Broker, *extra: str) -> subprocess.CompletedProcess[str]:
    c = broker.config
    return subprocess.run(
        ["mosquitto_pub", "-h", c.host, "-p", str(c.port), "-V", "mqttv5", "-q", "1",
         "-t", wire.device_up_topic(FLEET, A, "hello"), "-m", "hi", *extra],
        capture_output=True, text=True, timeout=20)


@pytest.mark.broker
def test_mosquitto_pub_needs_tls_trust_and_password(broker: Broker) -> None:
    ca, pw = str(broker.config.ca_file), broker.config.password(A)
    agg = Recorder([wire.fleet_topic(FLEET) + "/#"])
    loop = new_loop(broker)
    loop.add(client(broker, AGG), agg)
    assert loop.run(until=lambda: loop.is_ready(AGG), timeout=10)

    anonymous = _mosquitto_pub(broker, "--cafile", ca)
    wrong = _mosquitto_pub(broker, "--cafile", ca, "-u", A, "-P", pw + "x")
    unknown = _mosquitto_pub(broker, "--cafile", ca, "-u", "intruder", "-P", pw)
    untrusted = _mosquitto_pub(broker, "-u", A, "-P", pw, "--capath", "/nonexistent")
    plaintext = _mosquitto_pub(broker, "-u", A, "-P", pw)  # TLS port, no TLS
    good = _mosquitto_pub(broker, "--cafile", ca, "-u", A, "-P", pw)

    for name, proc in [("anonymous", anonymous), ("wrong password", wrong),
                       ("unknown user", unknown), ("untrusted CA", untrusted),
                       ("plaintext", plaintext)]:
        assert proc.returncode != 0, (name, proc.stderr)
    assert "not authori" in anonymous.stderr.lower()
    assert "not authori" in wrong.stderr.lower()
    assert good.returncode == 0, good.stderr
    assert loop.run(until=lambda: agg.payloads(wire.device_up_topic(FLEET, A, "hello")),
                    timeout=10)
    settle([loop])
    assert agg.payloads(wire.device_up_topic(FLEET, A, "hello")) == [b"hi"]  # only the good one
    loop.close()


@pytest.mark.broker
def test_paho_client_with_bad_credentials_is_refused(broker: Broker) -> None:
    loop = new_loop(broker)
    loop.add(client(broker, A, password="not-the-password"), Recorder())
    loop.add(client(broker, B), Recorder())
    assert loop.run(until=lambda: loop.stats.refused == 1 and loop.is_connected(B), timeout=10)
    settle([loop])
    # Refused for good: no reconnect storm with credentials that cannot work.
    assert not loop.is_connected(A)
    assert loop.stats.refused == 1 and loop.stats.connects == 1
    loop.close()


@pytest.mark.broker
def test_device_cannot_publish_into_another_subtree(broker: Broker) -> None:
    agg = Recorder([wire.fleet_topic(FLEET) + "/#"])
    b = Recorder([down_all(FLEET, B)])
    a = Recorder()
    loop = new_loop(broker)
    loop.add(client(broker, AGG), agg)
    loop.add(client(broker, B), b)
    loop.add(client(broker, A), a)
    assert loop.run(until=lambda: all(loop.is_ready(n) for n in (AGG, A, B)), timeout=10)

    forged = [
        wire.device_up_topic(FLEET, B, "update"),  # pretend to be B towards the aggregator
        wire.device_down_topic(FLEET, B, "plan"),  # pretend to be the aggregator towards B
        wire.status_topic(FLEET, B),  # declare B offline
        wire.fleet_topic(FLEET) + "/other",
    ]
    for topic in forged:
        loop.publish(A, Publish(topic, b"forged"))
    own = wire.device_up_topic(FLEET, A, "update")
    loop.publish(A, Publish(own, b"mine"))  # positive control, sent last
    assert loop.run(until=lambda: agg.payloads(own) == [b"mine"], timeout=10)
    settle([loop])
    assert [p for _, p in agg.got if p == b"forged"] == []
    assert b.got == []
    loop.close()


@pytest.mark.broker
def test_device_cannot_read_another_devices_down_messages(broker: Broker) -> None:
    spy = Recorder([down_all(FLEET, B), wire.fleet_topic(FLEET) + "/#",
                    down_all(FLEET, A)])
    b = Recorder([down_all(FLEET, B)])
    loop = new_loop(broker)
    loop.add(client(broker, AGG), Recorder())
    loop.add(client(broker, A), spy)
    loop.add(client(broker, B), b)
    assert loop.run(until=lambda: all(loop.is_ready(n) for n in (AGG, A, B)), timeout=10)
    loop.publish(AGG, Publish(wire.device_down_topic(FLEET, B, "plan"), b"for-b"))
    loop.publish(AGG, Publish(wire.device_up_topic(FLEET, B, "update"), b"b-upload"))
    loop.publish(AGG, Publish(wire.device_down_topic(FLEET, A, "plan"), b"for-a"))
    # The spy's two matching filters each deliver its own message (MQTT v5 overlapping
    # subscriptions); B's message and B's upload reach it through neither.
    assert loop.run(until=lambda: b.payloads() == [b"for-b"] and b"for-a" in spy.payloads(),
                    timeout=10)
    settle([loop])
    assert set(spy.payloads()) == {b"for-a"}
    loop.close()


@pytest.mark.broker
def test_only_the_aggregator_publishes_model_and_round(broker: Broker) -> None:
    model, rnd = wire.model_topic(FLEET), wire.fleet_topic(FLEET) + "/round"
    b = Recorder([model, rnd])
    loop = new_loop(broker)
    loop.add(client(broker, AGG), Recorder())
    loop.add(client(broker, A), Recorder())
    loop.add(client(broker, B), b)
    assert loop.run(until=lambda: all(loop.is_ready(n) for n in (AGG, A, B)), timeout=10)
    loop.publish(A, Publish(model, b"evil-model", retain=True))
    loop.publish(A, Publish(rnd, b"evil-round"))
    settle([loop])
    loop.publish(AGG, Publish(model, b"model-v1", retain=True))
    loop.publish(AGG, Publish(rnd, b"round-1"))
    assert loop.run(until=lambda: len(b.got) == 2, timeout=10)
    settle([loop])
    assert b.got == [(model, b"model-v1"), (rnd, b"round-1")]
    loop.close()

    # A subscriber arriving later gets the aggregator's retained model, not the device's.
    late = Recorder([model])
    loop2 = new_loop(broker, seed=1)
    loop2.add(client(broker, A, status=False), late)
    assert loop2.run(until=lambda: late.got, timeout=10)
    settle([loop2])
    assert late.got == [(model, b"model-v1")]
    loop2.close()


@pytest.mark.broker
def test_client_id_spoofing_gains_nothing(broker: Broker) -> None:
    down_b = wire.device_down_topic(FLEET, B, "plan")
    b = Recorder([down_b])
    agg_loop, b_loop, spoof_loop = new_loop(broker, 1), new_loop(broker, 2), new_loop(broker, 3)
    loops = [agg_loop, b_loop, spoof_loop]
    agg_loop.add(client(broker, AGG), Recorder())
    b_loop.add(client(broker, B), b)
    assert run_all(loops, lambda: agg_loop.is_ready(AGG) and b_loop.is_ready(B), 10)

    # A claims B's client id while B is connected: with the id taken from the user name,
    # this cannot take over (disconnect) B.
    spy = Recorder([down_b, down_all(FLEET, A)])
    spoof_loop.add(client(broker, A, client_id=B), spy)
    assert run_all(loops, lambda: spoof_loop.is_connected(B), 10)  # connected, as dev-a
    settle(loops)
    assert b_loop.is_connected(B) and b.connects == 1

    # B leaves; its session keeps a message queued. A, claiming B's id, must not get it.
    b_loop.remove(B)
    spoof_loop.remove(B)
    agg_loop.publish(AGG, Publish(down_b, b"queued-for-b"))
    assert run_all(loops, lambda: agg_loop.pending(AGG) == 0, 10)
    spy2 = Recorder([down_b])
    spoof_loop.add(client(broker, A, client_id=B), spy2)
    assert run_all(loops, lambda: spoof_loop.is_ready(B), 10)
    settle(loops)
    assert spy.got == [] and spy2.got == []

    # The real B comes back and finds its message (positive control).
    b2 = Recorder([down_b])
    b_loop.add(client(broker, B), b2)
    assert run_all(loops, lambda: b2.got, 10)
    assert b2.got == [(down_b, b"queued-for-b")]
    for loop in loops:
        loop.close()


def test_missing_mosquitto_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import tools.broker as tb

    monkeypatch.setattr(tb.shutil, "which", lambda name: None)
    monkeypatch.setattr(tb.os, "access", lambda *a: False)
    with pytest.raises(tb.BrokerMissing, match="apt-get install mosquitto"):
        Broker(devices=["x"])
