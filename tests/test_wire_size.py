"""Exact byte counts of an update message."""

from __future__ import annotations

import msgpack

from edge_sdk.wire import PROTOCOL_VERSION, encode_update, mqtt_publish_size, update_topic


def test_update_round_trips_and_carries_the_version() -> None:
    raw = encode_update(round_id=3, device="d7", encoding="f32", count=2, payload=b"\x00" * 8)
    msg = msgpack.unpackb(raw, raw=False)
    assert msg["v"] == PROTOCOL_VERSION and msg["payload"] == b"\x00" * 8 and msg["n"] == 2


def test_mqtt_publish_size_by_hand() -> None:
    topic = update_topic("f", "d")  # "fedge/f/dev/d/up/update": 23 bytes
    assert len(topic) == 23
    # remaining = 2 + 23 + 2 (packet id) + 1 (empty properties) + 100 = 128 -> 2-byte varint
    assert mqtt_publish_size(topic, 100) == 1 + 2 + 128
    # 97 payload bytes: remaining 125 still fits a 1-byte varint
    assert mqtt_publish_size(topic, 97) == 1 + 1 + 125
    assert mqtt_publish_size(topic, 100, qos=0) == 1 + 1 + 126
