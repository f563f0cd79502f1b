"""The bytes both sides agree on (first part: update messages and their exact size).

An update travels as a msgpack map with the protocol version and the payload as raw
bytes (never pickle), published over MQTT v5 with QoS 1. This module encodes it and counts
the bytes each layer adds, so the simulator reports payload and overhead separately. The
full message set, validation and topics come with the MQTT service.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgpack

__all__ = [
    "PROTOCOL_VERSION",
    "Publish",
    "check_name",
    "device_down_topic",
    "device_up_topic",
    "encode_update",
    "fleet_topic",
    "model_topic",
    "mqtt_publish_size",
    "status_topic",
    "update_topic",
]

PROTOCOL_VERSION = 1

# Topic layout (the broker's ACLs are written from the same functions, tools/broker.py):
#
#   fedge/<fleet>/dev/<device>/up/<kind>     device -> aggregator; only <device> may publish
#   fedge/<fleet>/dev/<device>/down/<kind>   aggregator -> device; only <device> may read
#   fedge/<fleet>/status/<device>            the device's online/offline (last will)
#   fedge/<fleet>/model                      the global model, retained; only the aggregator
#   fedge/<fleet>/round                      round announcements; only the aggregator
#
# Fleet and device names are restricted so that they can never contain MQTT wildcards or
# separators (a device named "+" would otherwise widen its own ACL pattern).
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_name(kind: str, value: object) -> str:
    """``value`` if it is a valid fleet/device/kind name (1-64 of ``[A-Za-z0-9_.-]``)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{kind} must be 1-64 characters of [A-Za-z0-9_.-], got {value!r}")
    return value


def fleet_topic(fleet: str) -> str:
    """Root of a fleet's topics: ``fedge/<fleet>``."""
    return f"fedge/{check_name('fleet', fleet)}"


def device_up_topic(fleet: str, device: str, kind: str) -> str:
    """A device's message to the aggregator: ``fedge/<fleet>/dev/<device>/up/<kind>``."""
    return f"{fleet_topic(fleet)}/dev/{check_name('device', device)}/up/{check_name('kind', kind)}"


def device_down_topic(fleet: str, device: str, kind: str) -> str:
    """The aggregator's message to one device: ``fedge/<fleet>/dev/<device>/down/<kind>``."""
    return (
        f"{fleet_topic(fleet)}/dev/{check_name('device', device)}/down/{check_name('kind', kind)}"
    )


def status_topic(fleet: str, device: str) -> str:
    """A device's online/offline status (its last will): ``fedge/<fleet>/status/<device>``."""
    return f"{fleet_topic(fleet)}/status/{check_name('device', device)}"


def model_topic(fleet: str) -> str:
    """The retained global model: ``fedge/<fleet>/model``."""
    return f"{fleet_topic(fleet)}/model"


def update_topic(fleet: str, device: str) -> str:
    """Topic of a device's update upload: ``fedge/<fleet>/dev/<device>/up/update``."""
    return device_up_topic(fleet, device, "update")


@dataclass(frozen=True, slots=True)
class Publish:
    """What a sans-I/O endpoint (device session, aggregator rounds) asks its adapter to send.

    QoS is always 1. ``retain`` only for the global model.
    """

    topic: str
    payload: bytes
    retain: bool = False


def encode_update(
    *, round_id: int, device: str, encoding: str, count: int, payload: bytes
) -> bytes:
    """msgpack bytes of one update: version, round, device, encoding name, value count,
    payload (raw little-endian bytes or a packed quantized vector)."""
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "kind": "update", "round": round_id, "device": device,
         "enc": encoding, "n": count, "payload": payload},
        use_bin_type=True,
    )


def _varint_len(n: int) -> int:
    size = 1
    while n >= 128:
        n >>= 7
        size += 1
    return size


def mqtt_publish_size(topic: str, payload_len: int, *, qos: int = 1,
                      properties_len: int = 0) -> int:
    """Bytes on the wire of one MQTT v5 PUBLISH packet (MQTT 5.0 spec, sec. 3.3).

    Fixed header (1 byte + remaining-length varint) + topic (2 + UTF-8 length) + packet
    identifier (2, QoS > 0) + properties (varint length + properties) + payload.
    """
    if qos not in (0, 1, 2):
        raise ValueError(f"qos must be 0, 1 or 2, got {qos!r}")
    variable = 2 + len(topic.encode()) + (2 if qos else 0)
    variable += _varint_len(properties_len) + properties_len
    remaining = variable + payload_len
    return 1 + _varint_len(remaining) + remaining
