"""fedge device SDK. Kept light: importing it pulls in no adapters (no onnxruntime, no MQTT).

``Device`` and ``DeviceConfig`` (the agent a device's software embeds, ``edge_sdk.device``)
are exported lazily: ``from edge_sdk import Device`` imports paho-mqtt then, not before.
"""

from typing import Any

__all__ = ["Device", "DeviceConfig"]


def __getattr__(name: str) -> Any:
    if name in ("Device", "DeviceConfig"):
        from edge_sdk import device

        return getattr(device, name)
    raise AttributeError(f"module 'edge_sdk' has no attribute {name!r}")
