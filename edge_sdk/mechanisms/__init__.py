"""Mechanisms: what a device adds to the secure sum and what the server makes of the sum.

Each mechanism has a device half and a server half (:mod:`edge_sdk.mechanisms.base`);
``edge_sdk.session.DeviceSession`` and ``aggregator.rounds.RoundMachine`` call
the same objects. :data:`MECHANISMS` maps a mechanism's name to its class.
"""

from __future__ import annotations

from collections.abc import Mapping

from edge_sdk.mechanisms.base import Contribution, DeviceHalf, Mechanism, ServerHalf
from edge_sdk.mechanisms.gaussian import (
    Gaussian,
    GaussianDevice,
    GaussianRound,
    GaussianServer,
)

__all__ = [
    "MECHANISMS",
    "Contribution",
    "DeviceHalf",
    "Gaussian",
    "GaussianDevice",
    "GaussianRound",
    "GaussianServer",
    "Mechanism",
    "ServerHalf",
]

MECHANISMS: Mapping[str, type] = {Gaussian.name: Gaussian}
"""Mechanism name -> class."""
