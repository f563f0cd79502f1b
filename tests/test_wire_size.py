"""Exact byte counts of an upload: ``wire.upload_sizes`` against encoded messages, and the
MQTT v5 PUBLISH size by hand."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edge_sdk.hazmat.ring import Ring
from edge_sdk.wire import (
    DEFAULT_MAX_PACKET,
    device_up_topic,
    encode,
    mqtt_publish_size,
    split_masked,
    upload_sizes,
)


@pytest.mark.parametrize(("count", "bits", "max_packet"),
                         [(1, 1, 1024), (10, 32, 1024), (100_000, 32, DEFAULT_MAX_PACKET),
                          (70_001, 20, 4096)])
def test_upload_sizes_are_the_encoded_parts(count: int, bits: int, max_packet: int) -> None:
    data = Ring(bits=bits).pack(np.zeros(count, dtype=np.uint64))
    parts = split_masked(round_id=1, sender="d7", bits=bits, count=count, data=data,
                         max_packet=max_packet)
    topic = device_up_topic("f", "d7", "masked_part")
    on_wire = sum(mqtt_publish_size(topic, len(encode(replace(p, sig=bytes(64)))))
                  for p in parts)
    payload, framing = upload_sizes(count, bits, max_packet=max_packet, fleet="f",
                                    device="d7")
    assert payload == len(data) == (count * bits + 7) // 8
    assert payload + framing == on_wire
    # every part carries a signature, a digest and its envelope: framing is real, not zero
    assert framing >= len(parts) * (64 + 32 + len(topic))
    assert all(len(encode(replace(p, sig=bytes(64)))) <= max_packet for p in parts)


def test_mqtt_publish_size_by_hand() -> None:
    topic = device_up_topic("f", "d", "update")  # "fedge/f/dev/d/up/update": 23 bytes
    assert len(topic) == 23
    # remaining = 2 + 23 + 2 (packet id) + 1 (empty properties) + 100 = 128 -> 2-byte varint
    assert mqtt_publish_size(topic, 100) == 1 + 2 + 128
    # 97 payload bytes: remaining 125 still fits a 1-byte varint
    assert mqtt_publish_size(topic, 97) == 1 + 1 + 125
    assert mqtt_publish_size(topic, 100, qos=0) == 1 + 1 + 126
