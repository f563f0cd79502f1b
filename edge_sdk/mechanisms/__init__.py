"""Mechanisms: what a device adds to the secure sum and what the server makes of the sum.

Each mechanism has a device half and a server half (:mod:`edge_sdk.mechanisms.base`);
``edge_sdk.session.DeviceSession`` and ``aggregator.rounds.RoundMachine`` call
the same objects. :data:`MECHANISMS` maps a mechanism's name to its class.
"""

from __future__ import annotations

from collections.abc import Mapping

from edge_sdk.mechanisms.base import Contribution, DeviceHalf, Mechanism, ServerHalf
from edge_sdk.mechanisms.binomial import (
    Binomial,
    BinomialDevice,
    BinomialRound,
    BinomialServer,
)
from edge_sdk.mechanisms.ddg import Ddg, DdgDevice, DdgRound, DdgServer
from edge_sdk.mechanisms.device_dp import DeviceDp, DeviceDpDevice, DeviceDpRound, DeviceDpServer
from edge_sdk.mechanisms.gaussian import (
    Gaussian,
    GaussianDevice,
    GaussianRound,
    GaussianServer,
)
from edge_sdk.mechanisms.update_noise import (
    UpdateNoise,
    UpdateNoiseDevice,
    UpdateNoiseRound,
    UpdateNoiseServer,
)

__all__ = [
    "MECHANISMS",
    "Binomial",
    "BinomialDevice",
    "BinomialRound",
    "BinomialServer",
    "Contribution",
    "Ddg",
    "DdgDevice",
    "DdgRound",
    "DdgServer",
    "DeviceDp",
    "DeviceDpDevice",
    "DeviceDpRound",
    "DeviceDpServer",
    "DeviceHalf",
    "Gaussian",
    "GaussianDevice",
    "GaussianRound",
    "GaussianServer",
    "Mechanism",
    "ServerHalf",
    "UpdateNoise",
    "UpdateNoiseDevice",
    "UpdateNoiseRound",
    "UpdateNoiseServer",
]

MECHANISMS: Mapping[str, type] = {m.name: m for m in (Gaussian, UpdateNoise, Ddg, Binomial,
                                                    DeviceDp)}
"""Mechanism name -> class."""
