"""MQTT topics of a fleet, and the one naming rule for fleets, devices and kinds.

The broker's ACLs are written from the same functions (``tools/broker.py``)::

    fedge/<fleet>/dev/<device>/up/<kind>     device -> aggregator; only <device> may publish
    fedge/<fleet>/dev/<device>/down/<kind>   aggregator -> device; only <device> may read
    fedge/<fleet>/status/<device>            the device's online/offline (last will)
    fedge/<fleet>/model                      the global model, retained; only the aggregator
    fedge/<fleet>/round                      round announcements; only the aggregator
    fedge/<site>/site/round                  the site's round, retained; only the site
    fedge/<site>/site/model                  the site's global model, retained; only the site
    fedge/<site>/site/job                    a round's job for one worker (shared subscription)
    fedge/<site>/gw/<gateway>/up/<kind>      gateway -> site; only <gateway> may publish

The site topics cross mosquitto bridges between a gateway's broker and the site's
(``tools.hierarchy``); the device topics never leave a gateway's broker.

Names follow :data:`edge_sdk._validate.NAME_PATTERN` (``[A-Za-z0-9_.-]{1,64}``), the rule
the schema's ``Name`` fields check on every message, so they can never contain MQTT
wildcards or separators (a device named "+" would otherwise widen its own ACL pattern).
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_sdk._validate import check_device_id

__all__ = [
    "Publish",
    "check_name",
    "device_down_topic",
    "device_up_topic",
    "fleet_topic",
    "gateway_up_topic",
    "model_topic",
    "round_topic",
    "mqtt_publish_size",
    "site_job_topic",
    "site_model_topic",
    "site_round_topic",
    "status_topic",
]


def check_name(kind: str, value: object) -> str:
    """``value`` if it is a valid fleet/device/kind name (1-64 of ``[A-Za-z0-9_.-]``).

    Raises:
        ValueError: naming ``kind`` and the bad value.
    """
    return check_device_id(kind, value)


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


def round_topic(fleet: str) -> str:
    """Round announcements, retained (the offer of buffered rounds): ``fedge/<fleet>/round``."""
    return f"{fleet_topic(fleet)}/round"


def status_topic(fleet: str, device: str) -> str:
    """A device's online/offline status (its last will): ``fedge/<fleet>/status/<device>``."""
    return f"{fleet_topic(fleet)}/status/{check_name('device', device)}"


def model_topic(fleet: str) -> str:
    """The retained global model: ``fedge/<fleet>/model``."""
    return f"{fleet_topic(fleet)}/model"


def site_round_topic(site: str) -> str:
    """The site's retained round announcement: ``fedge/<site>/site/round``."""
    return f"{fleet_topic(site)}/site/round"


def site_model_topic(site: str) -> str:
    """The site's retained global model: ``fedge/<site>/site/model``."""
    return f"{fleet_topic(site)}/site/model"


def site_job_topic(site: str) -> str:
    """The site's jobs for a gateway's workers (taken through a shared subscription, never
    retained): ``fedge/<site>/site/job``."""
    return f"{fleet_topic(site)}/site/job"


def gateway_up_topic(site: str, gateway: str, kind: str) -> str:
    """A gateway's message to its site: ``fedge/<site>/gw/<gateway>/up/<kind>``."""
    return (f"{fleet_topic(site)}/gw/{check_name('gateway', gateway)}/up/"
            f"{check_name('kind', kind)}")


@dataclass(frozen=True, slots=True)
class Publish:
    """What a sans-I/O endpoint (device session, aggregator rounds) asks its adapter to send.

    QoS is always 1. ``retain`` only for the global model.
    """

    topic: str
    payload: bytes
    retain: bool = False


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
