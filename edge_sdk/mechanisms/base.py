"""What a mechanism is: a device half and a server half around one secure sum (plan15 §3.2).

A round of federated learning with secure aggregation releases, per device, the values it
adds to the sum, and to the server only the sum. A mechanism says what those values are
and what the sum means:

* the **device half** states the privacy event of a round before any training (the ledger
  checks and reserves it first), then trains on the local data and encodes the update as
  integers of the round's ring (:class:`Contribution`), drawing all its randomness from
  the round's ``rng`` in a fixed order;
* the **server half** turns the decoded ring sum of the survivors into the model delta the
  server optimizer applies.

Both halves are built from one ``Params`` object (frozen, keyword-only), the round's
public settings, which both ends derive from the signed plan. Because every mechanism's
values are integers of the ring, a plain sum and SecAgg+ add the same numbers and give
bit-identical totals. Choosing the parameters per round (``public``) and refusing
impossible combinations (``validate``) join the interface with the round core (plan15 G3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from edge_sdk.engine import Engine
from edge_sdk.privacy.events import Event

__all__ = ["Contribution", "DeviceHalf", "Mechanism", "ServerHalf"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Contribution:
    """One device's part of a round.

    Attributes:
        values: what is summed: residues of the round's ring (uint64, ``length`` of them).
        event: the privacy event released against whoever sees this upload.
        aggregate_event: the event against whoever sees only the sum (may equal ``event``).
        num_samples: m, the size of the local data set.
        mean_loss: mean per-sample training loss over the round's batches.
        diagnostics: counts a simulator may report (e.g. ``clamped``: values clipped to the
            value bound before encoding); never sent anywhere by a device.
        device_event: the device-level event against whoever sees only the sum
            (:meth:`DeviceHalf.device_event`), or None (the default): no theorem.
    """

    values: np.ndarray
    event: Event
    aggregate_event: Event
    num_samples: int
    mean_loss: float
    diagnostics: Mapping[str, int | float]
    device_event: Event | None = None


class DeviceHalf(Protocol):
    """A mechanism on a device, for one round's parameters."""

    def refusal(self, *, honest: int) -> str | None:
        """Why the device declines the round before anything is reserved (``edge_sdk.round.
        open_round`` publishes reason ``"noise"`` with it), e.g. device-dp when ``honest``
        shares of the plan's noise fall short of the plan's target; None to take part."""
        ...

    def events(self, *, m: int, honest: int) -> tuple[Event, Event]:
        """(local, aggregate) privacy events of one round over ``m`` local samples with
        at least ``honest`` honest cohort members in the sum: asked before training, for
        the ledger's check-then-reserve."""
        ...

    def device_event(self, *, honest: int) -> Event | None:
        """The DEVICE-level event of one round against whoever sees only the sum (the
        record is the device: zero-out of its whole data set, its noise share still in the
        sum, ``honest`` honest shares), or None when the mechanism has no theorem for one
        (report nothing rather than something): asked with :meth:`events`, before
        training. The ledger's device-level figure is None over any round without one."""
        ...

    def contribute(self, *, params: Sequence[np.ndarray], data: tuple[np.ndarray, np.ndarray],
                   engine: Engine, coords: np.ndarray | None, honest: int,
                   rng: np.random.Generator) -> Contribution:
        """Train from the global model ``params`` on ``data`` = (x, y) and encode the
        update (restricted to the round's rand-k ``coords``, if any). All randomness
        comes from ``rng``, in an order fixed by the mechanism."""
        ...


class ServerHalf(Protocol):
    """A mechanism on the aggregator, for one round's parameters."""

    def init(self, params: Sequence[np.ndarray]) -> Any:
        """The half's state for the global model ``params`` (None when it keeps none)."""
        ...

    def decode(self, total: np.ndarray, survivors: int, state: Any, *,
               coords: np.ndarray | None) -> tuple[list[np.ndarray], Any]:
        """The survivors' ring sum ``total`` -> (the model delta, one float32 array per
        parameter, for the server optimizer; the new state)."""
        ...

    def quantile(self, total: np.ndarray, survivors: int) -> float | None:
        """Adaptive clipping's noised fraction of survivors whose update norm was within
        the round's clip, read from the sum; None for a mechanism or round without it."""
        ...


class Mechanism(Protocol):
    """A mechanism: its name (as in ``RoundPlan``/config) and its two halves."""

    name: ClassVar[str]
    Params: ClassVar[type]

    def device(self, params: Any) -> DeviceHalf: ...

    def server(self, params: Any) -> ServerHalf: ...
