"""The device's side of a round, sans-I/O: messages and a clock in, publishes out.

A :class:`DeviceSession` is what ``edge_sdk.device`` (the MQTT adapter) drives::

    s = DeviceSession(fleet=..., identity=..., registry=..., ledger=..., engine=...,
                      spec=..., data=load_local_data, round_rng=secure_round_rng())
    adapter.subscribe(s.subscriptions())
    send(s.on_connect(now))                     # check-in
    send(s.on_message(topic, payload, now))     # plan, secagg, model, error
    send(s.on_tick(now))                        # gives up on a round gone silent
    for event in s.take_events(): ...           # what happened (see below)

One round (DESIGN, "One round, as data flows"), for a device in the plan's cohort:

1. plan (:func:`edge_sdk.round.open_round`): refuse a round the ledger already holds a
   reservation for (the device took part before a restart: it must neither train nor
   upload again), a plan for another model version, one whose mechanism this device does
   not have, or one the budget cannot pay for (``Ledger.would_exceed``): each gets a
   :class:`~edge_sdk.wire.Decline`. Otherwise the device half of the plan's mechanism
   (``edge_sdk.mechanisms.MECHANISMS``) trains and encodes its input to the sum
   (``gaussian``: ``edge_sdk.train.local_round`` with the round's rand-k set, QSGD
   (optional), a clamp to the plan's value bound, fixed point mod 2^bits); then advertise
   secure-aggregation keys.
   The spend is **reserved in the ledger** (durable) after the budget check and before
   training: every later outcome may depend on the noisy update.
2. neighbour keys -> share keys; forwarded shares -> mask the input and return the upload
   (chunked) for sending.
3. unmask request -> refuse one naming fewer than the plan's ``min_survivors`` uploads
   (the ledger's aggregate view is accounted on at least that many; nothing is
   revealed), else answer it and commit the reservation (the request proves the
   aggregator holds the upload). The published model ends the round; the device adopts
   it and checks in again.

With the amortized protocol (``plan.secagg == "amortized"``, issue 18) steps 1's keys and
2 are not there: the device masks with its enrollment-time pairwise seeds
(``edge_sdk.secagg.AmortizedSecAggClient``) and uploads right after training, and step 3
is a reveal request for this round's seeds toward dropped neighbours, which it refuses if
the cohort less the neighbours named is below ``min_survivors``. A round id is never
masked for twice: the ledger's reservations (durable before the upload) give the last
round masked for, which the pairwise seeds require the new round to exceed. The
reservation is committed at the reveal or, when nobody dropped, when the new model ends
the round.

Buffered rounds (FedBuff, issue 19): when the aggregator publishes a
:class:`~edge_sdk.wire.BufferOffer` (retained, on the fleet's round topic), the device
trains *ahead*, on the newest model it holds, whenever it holds no usable update
(``edge_sdk.round.train_ahead``: the spend of a round with the offer's settings is reserved
first, under ``<fleet>/ahead/<version>.<n>``) and says :class:`~edge_sdk.wire.Ready`. A
plan that selects it then takes that update (``edge_sdk.round.open_buffered``: staleness
tau = plan model - trained model within the offer's ``max_staleness``, the plan's event the
one reserved; the clipped update weighted by (1 + tau)^-a before noise and masking); the
rest of the round is the round above. The update is consumed by the first plan it is
encoded for, whatever becomes of that round; after a round that published no new model the
device may train once more on the same model (a new reservation). A buffered plan that
finds no update held (it went into a round before a restart) is declined, never trained
for again. Only a restart loses a held update (its spend stays counted).

Nothing that depends on the local update leaves before the ledger holds the round's
reservation: the round is reserved before training, so the upload, the ``diverged``
decline (a bit of the noisy update) and the device's silence are all counted; a device
whose ledger cannot reserve declines before training ("ledger" or "budget").

Not covered: timing. The advertise message leaves right after training, so its delay
reveals roughly how long training took, hence the sum of the Poisson batch sizes, which the
accounting treats as hidden. Revealing every batch size is a mixture over the sizes, so it
can only raise epsilon; an RDP upper bound with every size revealed is +2.8% at the fleet
settings (m = 600, B = 32, z = 1, 20 steps: 2.60 -> 2.67). A fixed-cost step (batches padded
to a public capacity) would close it.

Randomness: all randomness of a round (batches, DP noise, quantization, rounding) comes
from ``round_rng(round_id)``, injected with no default: on a device
(``edge_sdk.device.Device``) it is always ``csprng.secure_round_rng`` (ChaCha20 keyed
from ``os.urandom``), so neither the enroller nor the aggregator can regenerate the noise
from anything they know; simulators and tests pass ``csprng.seeded_round_rng(seed)`` for
reproducible runs. Key material comes from the injected ``random_bytes``
(``os.urandom``).

Trust: the aggregator is assumed semi-honest (honest-but-curious). It follows the
protocol, in particular it reports the same survivor set to every device: SecAgg's
consistency-check round (Bonawitz et al. 2017, round 3) is not implemented, so an
aggregator that lies about who survived could obtain both shares of one device and
unmask its input. The device refuses a request naming fewer than ``min_survivors``
uploads, which stops an aggregator that unmasks too small a sum by its own account, not
one that lies about the count. The aggregate view also assumes at most
``plan.max_colluders`` cohort members collude with the aggregator (``RoundPlan``).

What happened is told as events (frozen dataclasses, h11 style), taken with
:meth:`DeviceSession.take_events` after each call, so an adapter never infers it from the
publishes: :class:`CheckedIn`, :class:`ModelAdopted`, :class:`RoundOpened` (reserved,
trained, keys advertised), :class:`Declined` (with the reason the decline carries),
:class:`Uploaded` (the masked input left; ``resent`` for the same upload again) and
:class:`RoundClosed` (why the device left the round, and whether it had uploaded). Each is
emitted once, when it happens; a rejected message emits nothing.

An exact duplicate of an
aggregator message already answered gets the same answer again (QoS 1 redelivery, or an
aggregator restarted from its checkpoint); anything else invalid is logged (logger
``edge_sdk.session``) and ignored without a state change, never raised.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edge_sdk import wire
from edge_sdk.csprng import RoundRng
from edge_sdk.engine import Engine
from edge_sdk.errors import RemoteProtocolError
from edge_sdk.ledger import Ledger, LedgerError, Plan, Reservation
from edge_sdk.model import ModelSpec
from edge_sdk.round import Declined as NotOpened
from edge_sdk.round import Held, Prepared, open_buffered, open_round, train_ahead
from edge_sdk.secagg import (
    AmortizedSecAggClient,
    DeviceIdentity,
    PairwiseSeeds,
    Registry,
    RoundConfig,
    SecAggClient,
)
from edge_sdk.wire import (
    BufferOffer,
    CheckIn,
    Decline,
    ErrorNotice,
    ForwardedShares,
    MaskedPart,
    ModelUpdate,
    NeighbourKeys,
    Publish,
    Ready,
    RevealRequest,
    RoundPlan,
    SecAggDown,
    SecAggUp,
    UnmaskRequest,
)

__all__ = [
    "CheckedIn",
    "DataSource",
    "Declined",
    "DeviceSession",
    "ModelAdopted",
    "RoundClosed",
    "RoundOpened",
    "SessionEvent",
    "TrainedAhead",
    "Uploaded",
]

logger = logging.getLogger("edge_sdk.session")

DataSource = Callable[[], tuple[np.ndarray, np.ndarray]]
"""Returns the device's local training set (x, y) as numpy arrays."""

_GIVE_UP_STAGES = 6  # a round silent for this many stage timeouts is over for the device
_KEPT_INPUTS = 8
_EVENTS = 1024  # events kept for a driver that does not take them (oldest dropped)

# Why a device leaves a round (RoundClosed.reason), besides the code of the aggregator's
# error notice that ends it.
_NEW_MODEL = "new model"
_SUPERSEDED = "superseded"
_SILENT = "silent"


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckedIn:
    """A check-in left: on connect, when a round ends, or repeated (``checkin_every``).
    Its fields are the check-in's: the adopted model, the local data set's size (samples)
    and the ledger's figures: remaining epsilon, spent epsilon (None: unreadable) and the
    budget (epsilon, delta)."""

    model_version: int
    data_size: int
    remaining_epsilon: float
    spent_epsilon: float | None
    budget_epsilon: float
    budget_delta: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelAdopted:
    """The device adopted global model ``version`` (made by round ``round_id``; 0: the
    initial model). A redelivery of the model it holds is not an adoption."""

    version: int
    round_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundOpened:
    """The device is in round ``round_id``: the spend is reserved in the ledger, it
    trained on model ``model_version`` and advertised its keys. ``length``: coordinates
    of its input to the sum; ``cohort_size``: members of the plan's cohort."""

    round_id: int
    model_version: int
    length: int
    cohort_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Declined:
    """The device declined round ``round_id``'s plan; ``reason`` and ``detail`` are the
    published :class:`~edge_sdk.wire.Decline`'s (``ledger``, ``already_committed``,
    ``stale_model``, ``mechanism``, ``no_data``, ``budget``, ``diverged``). Only
    ``diverged`` comes after training (its spend is reserved and committed); every other
    reason leaves before. ``round_id`` 0: training ahead for buffered rounds was declined
    (nothing is published; the device sends no :class:`~edge_sdk.wire.Ready`)."""

    round_id: int
    reason: str
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Uploaded:
    """The masked input of round ``round_id`` left as ``parts`` chunks of ``size`` payload
    bytes in all. ``resent``: the same upload again, for a redelivered request (once per
    redelivery); the first upload of a round has ``resent=False`` and is emitted once."""

    round_id: int
    parts: int
    size: int
    resent: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundClosed:
    """The device left round ``round_id``: ``reason`` is ``"new model"`` (a newer global
    model arrived), ``"superseded"`` (a plan for a later round), ``"silent"`` (nothing
    heard for six stage timeouts) or the code of the aggregator's error notice.
    ``uploaded``: its masked input had left; ``model_version``: the model it holds now."""

    round_id: int
    reason: str
    uploaded: bool
    model_version: int

    @property
    def contributed(self) -> bool:
        """It uploaded and the round ended with a newer model (its input may be in it)."""
        return self.uploaded and self.reason == _NEW_MODEL


@dataclass(frozen=True, slots=True)
class TrainedAhead:
    """Buffered rounds: an update was trained ahead from model ``model_version`` under
    offer ``offer``, its spend reserved as ledger round ``ledger_round``; :class:`Ready`
    went out."""

    model_version: int
    offer: int
    ledger_round: str


SessionEvent = (CheckedIn | ModelAdopted | RoundOpened | Declined | Uploaded | RoundClosed
                | TrainedAhead)


@dataclass(slots=True)
class _Round:
    plan: RoundPlan
    client: SecAggClient | AmortizedSecAggClient
    residues: np.ndarray
    ledger_plan: Plan
    last_heard: float
    reservation: Reservation | None = None
    answers: dict[bytes, list[Publish]] = field(default_factory=dict)
    upload: bytes | None = None  # the request (raw) the upload answered
    committed: bool = False


class DeviceSession:
    """One device's rounds (see the module docstring).

    Args:
        fleet: the fleet name.
        identity: the device's long-term keys (its name is ``identity.device``).
        registry: enrolled devices and the aggregator's public key.
        ledger: the device's open privacy ledger (it outlives the session: a restarted
            session opens the same file).
        engine: per-sample gradients of the model (``edge_sdk.engine.load_engine``).
        spec: the model's architecture (parameter shapes are checked against it).
        data: returns the local training set (x, y).
        round_rng: round id -> that round's randomness (``csprng.secure_round_rng()`` on
            a device; a seeded factory only in simulators and tests). No default, so a
            seeded generator is never picked by omission.
        random_bytes: key material for secure aggregation.
        max_packet: largest MQTT payload to send (uploads are chunked below it).
        max_colluders: the most cohort members this device assumes may collude with the
            aggregator (default 1). The plan's ``max_colluders`` comes from the aggregator,
            the party the aggregate view protects against, so the device counts
            r'' = min_survivors - max(plan's, this) honest members, never fewer colluders
            than its own assumption (r'' < 1: no credit for other members' noise).
        checkin_every: seconds between repeated check-ins while the device is in no round
            (None: only on connect and when a round ends). A restarted aggregator resumes
            from a checkpoint that may predate check-ins it had received; repeating them
            lets it start rounds again without waiting for devices to reconnect.
    """

    def __init__(
        self,
        *,
        fleet: str,
        identity: DeviceIdentity,
        registry: Registry,
        ledger: Ledger,
        engine: Engine,
        spec: ModelSpec,
        data: DataSource,
        round_rng: RoundRng,
        random_bytes: Callable[[int], bytes] = os.urandom,
        max_packet: int = wire.DEFAULT_MAX_PACKET,
        checkin_every: float | None = None,
        max_colluders: int = 1,
    ) -> None:
        if isinstance(max_colluders, bool) or not isinstance(max_colluders, int) \
                or max_colluders < 0:
            raise ValueError(f"max_colluders must be an integer >= 0, got {max_colluders!r}")
        self._max_colluders = max_colluders
        if checkin_every is not None and not (math.isfinite(checkin_every)
                                              and checkin_every > 0):
            raise ValueError(f"checkin_every must be None or finite and > 0, "
                             f"got {checkin_every!r}")
        self.fleet = wire.check_name("fleet", fleet)
        self.device = wire.check_name("device", identity.device)
        if registry.devices.get(self.device) != identity.enrollment():
            raise ValueError(f"device {self.device!r} is not enrolled with these keys")
        self._idn = identity
        self._reg = registry
        self._ledger = ledger
        self._engine = engine
        self._spec = spec
        self._shapes = [s for _, s in spec.param_shapes()]
        self._data = data
        if not callable(round_rng):
            raise ValueError(f"round_rng must be a callable round id -> rng, got {round_rng!r}")
        self._round_rng = round_rng
        self._random = random_bytes
        if isinstance(max_packet, bool) or not isinstance(max_packet, int) or max_packet < 1024:
            raise ValueError(f"max_packet must be an integer >= 1024 bytes (a signed part of "
                             f"the masked upload), got {max_packet!r}")
        self._max_packet = max_packet
        self._params: list[np.ndarray] | None = None
        self._version = -1
        self._last_round = 0  # the last round this device took part in (its check-ins say)
        self._round: _Round | None = None
        self._inputs: dict[int, np.ndarray] = {}
        self._checkin_every = checkin_every
        self._next_checkin = math.inf
        self._events: deque[SessionEvent] = deque(maxlen=_EVENTS)
        self._offer: BufferOffer | None = None  # buffered rounds' offer (issue 19)
        self._held: Held | None = None  # an update trained ahead under it
        self._ahead_tried = -1  # the last model version training ahead was tried on

    # ------------------------------------------------------------------ properties

    @property
    def model_version(self) -> int:
        """The adopted global model's version (-1: none yet)."""
        return self._version

    @property
    def params(self) -> list[np.ndarray] | None:
        return None if self._params is None else [p.copy() for p in self._params]

    @property
    def round_id(self) -> int | None:
        """The round the device is taking part in, if any."""
        return None if self._round is None else self._round.plan.round_id

    def encoded_input(self, round_id: int) -> np.ndarray | None:
        """The residues this device fed into round ``round_id``'s secure sum (before
        masking; kept on the device for the last few rounds, for audits and tests)."""
        x = self._inputs.get(round_id)
        return None if x is None else x.copy()

    def take_events(self) -> list[SessionEvent]:
        """What happened since the last call, oldest first (see the module docstring)."""
        out = list(self._events)
        self._events.clear()
        return out

    # ------------------------------------------------------------------ endpoint

    def subscriptions(self) -> list[str]:
        """MQTT topic filters: this device's downlink and the global model."""
        down = wire.device_down_topic(self.fleet, self.device, "x")[:-1]
        return [down + "+", wire.model_topic(self.fleet), wire.round_topic(self.fleet)]

    @property
    def held_version(self) -> int | None:
        """The model version of the update held for a buffered round (None: none held)."""
        return None if self._held is None else self._held.trained_version

    def on_connect(self, now: float) -> list[Publish]:
        """(Re)connected: check in (and, in buffered rounds, say ready again)."""
        return [self._checkin(now), *self._ahead(now)]

    def on_tick(self, now: float) -> list[Publish]:
        """Give up on a round that has gone silent (the aggregator dropped this device);
        repeat the check-in every ``checkin_every`` seconds outside rounds."""
        r = self._round
        if r is not None and now - r.last_heard > _GIVE_UP_STAGES * r.plan.stage_timeout:
            self._end_round(_SILENT)
            return [self._checkin(now), *self._ahead(now)]
        if r is None and now >= self._next_checkin:
            # (and Ready again: a restarted aggregator may have lost its queue)
            return [self._checkin(now), *self._ahead(now)]
        return []

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        """One inbound message. Never raises: a bad one is logged and changes nothing."""
        try:
            return self._handle(topic, payload, now)
        except RemoteProtocolError as e:
            logger.warning("%s rejected message on %s: %s", self.device, topic, e, extra={
                "fedge": {"event": "rejected", "device": self.device, "topic": topic,
                          "reason": str(e), "round": self.round_id}})
            return []

    # ------------------------------------------------------------------ dispatch

    def _handle(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        if topic == wire.model_topic(self.fleet):
            msg = wire.decode(payload, wire.MODEL_KINDS)
            if not isinstance(msg, ModelUpdate):
                raise RemoteProtocolError(f"a {msg.KIND} message on the model topic")
            return self._on_model(msg, now)
        if topic == wire.round_topic(self.fleet):
            offer = wire.decode(payload, wire.OFFER_KINDS)
            assert isinstance(offer, BufferOffer)
            return self._on_offer(offer, now)
        prefix = wire.device_down_topic(self.fleet, self.device, "x")[:-1]
        if not topic.startswith(prefix):
            raise RemoteProtocolError("not a topic of this device")
        kind = topic[len(prefix):]
        msg = wire.decode(payload, wire.DOWN_KINDS)
        if msg.KIND != kind:
            raise RemoteProtocolError(f"a {msg.KIND} message on the {kind!r} topic")
        if msg.PARTY == "to" and msg.recipient != self.device:  # type: ignore[attr-defined]
            raise RemoteProtocolError(f"{msg.KIND} is addressed to another device")
        if isinstance(msg, RoundPlan):
            return self._on_plan(msg, bytes(payload), now)
        if msg.KIND in wire.SECAGG_DOWN:
            return self._on_secagg(msg, bytes(payload), now)  # type: ignore[arg-type]
        if isinstance(msg, ErrorNotice):
            self._reg.verify_message(msg)
            r = self._round
            if r is None or msg.round_id != r.plan.round_id:
                raise RemoteProtocolError(f"error notice for round {msg.round_id}, "
                                          f"not this device's open round")
            logger.info("%s: round %d ended: %s", self.device, msg.round_id, msg.code)
            self._end_round(msg.code)
            return [self._checkin(now), *self._ahead(now)]
        raise RemoteProtocolError(f"a device does not accept {msg.KIND} messages")

    # ------------------------------------------------------------------ model

    def _on_model(self, msg: ModelUpdate, now: float) -> list[Publish]:
        self._reg.verify_message(msg)
        if msg.version == self._version and self._params is not None and all(
            np.array_equal(a, b) for a, b in zip(msg.params(), self._params, strict=True)
        ):
            return []  # the retained model again (a reconnect, a redelivery)
        if msg.version <= self._version:
            raise RemoteProtocolError(f"model version {msg.version} is not newer than "
                                      f"{self._version}")
        shapes = [a.shape for a in msg.arrays]
        if shapes != self._shapes or any(a.dtype != "<f4" for a in msg.arrays):
            raise RemoteProtocolError(f"model arrays {shapes} do not fit this device's model "
                                      f"{self._shapes} (float32)")
        self._params = msg.params()
        self._version = msg.version
        self._events.append(ModelAdopted(version=msg.version, round_id=msg.round_id))
        r = self._round
        if r is not None and msg.version > r.plan.model_version:
            self._end_round(_NEW_MODEL)  # the round is over, with or without this device
        return [] if self._round is not None else [self._checkin(now), *self._ahead(now)]

    # ------------------------------------------------------------------ buffered rounds

    def _on_offer(self, offer: BufferOffer, now: float) -> list[Publish]:
        self._reg.verify_message(offer)
        old = self._offer
        if old is not None and offer.round_id < old.round_id:
            raise RemoteProtocolError(f"offer {offer.round_id} is older than offer "
                                      f"{old.round_id}")
        if old != offer:
            self._offer = offer
            if self._held is not None and self._held.offer != offer:
                # reserved under other settings: no plan of this offer may take it (its
                # spend stays counted)
                self._held = None
                self._ahead_tried = -1
        return self._ahead(now)

    def _ahead(self, now: float) -> list[Publish]:
        """Buffered rounds: hold an update trained on the newest model (train it, once per
        model version, when there is none or the one held is too stale for the offer) and
        say :class:`Ready`. Nothing outside buffered rounds or while a round is open."""
        offer = self._offer
        if offer is None or self._round is not None or self._params is None:
            return []
        held = self._held
        if held is not None and self._version - held.trained_version > offer.max_staleness:
            held = self._held = None  # no round may take it any more
        if held is None:
            if self._ahead_tried == self._version:
                return []  # tried on this model already (declined, or spent in a round)
            self._ahead_tried = self._version
            d = sum(math.prod(s) for s in self._shapes)
            got = train_ahead(offer, fleet=self.fleet, ledger=self._ledger,
                              params=self._params, model_version=self._version,
                              data=self._data, engine=self._engine, dim=d,
                              round_rng=self._round_rng, max_colluders=self._max_colluders)
            if isinstance(got, NotOpened):
                logger.info("%s does not train ahead on model %d: %s (%s)", self.device,
                            self._version, got.reason, got.detail, extra={"fedge": {
                                "event": "decline", "device": self.device,
                                "round": None, "reason": got.reason}})
                self._events.append(Declined(round_id=0, reason=got.reason,
                                             detail=got.detail))
                return []
            held = self._held = got
            self._events.append(TrainedAhead(model_version=got.trained_version,
                                             offer=offer.round_id,
                                             ledger_round=got.ledger_plan.round_id))
        msg = wire.sign(Ready(round_id=self._last_round, sender=self.device,
                              offer=held.offer.round_id,
                              trained_version=held.trained_version,
                              attempt=held.attempt), self._idn)
        return [Publish(wire.device_up_topic(self.fleet, self.device, "ready"),
                        wire.encode(msg))]

    # ------------------------------------------------------------------ plan

    def _decline(self, plan: RoundPlan, reason: str, detail: str) -> list[Publish]:
        logger.info("%s declines round %d: %s (%s)", self.device, plan.round_id, reason,
                    detail, extra={"fedge": {"event": "decline", "device": self.device,
                                             "round": plan.round_id, "reason": reason}})
        msg = wire.sign(Decline(round_id=plan.round_id, sender=self.device, reason=reason,
                                detail=detail[:256]), self._idn)
        self._events.append(Declined(round_id=plan.round_id, reason=reason,
                                     detail=msg.detail))
        return [Publish(wire.device_up_topic(self.fleet, self.device, "decline"),
                        wire.encode(msg))]

    def _on_plan(self, plan: RoundPlan, raw: bytes, now: float) -> list[Publish]:
        self._reg.verify_message(plan)
        if self.device not in plan.cohort:
            raise RemoteProtocolError(f"round {plan.round_id}'s plan does not select "
                                      f"{self.device!r}")
        r = self._round
        if r is not None:
            if raw in r.answers:  # a redelivered plan: answer as before
                r.last_heard = now
                out = list(r.answers[raw])
                if raw == r.upload:  # the amortized upload, sent again
                    self._uploaded(r, out, resent=True)
                return out
            if plan.round_id <= r.plan.round_id:
                raise RemoteProtocolError(f"plan for round {plan.round_id} while in round "
                                          f"{r.plan.round_id}")
            self._end_round(_SUPERSEDED)
        if plan.secagg == "amortized":
            last = self._last_masked(plan.round_id)
            if last is not None and plan.round_id < last:
                # its masks would repeat a round's (an aggregator that restarted its ids):
                # refused before anything is reserved or trained
                return [*self._decline(plan, "already_committed",
                                       f"amortized masks are per round id; this device "
                                       f"masked for round {last}, after {plan.round_id}"),
                        self._checkin(now)]
        d = sum(math.prod(s) for s in self._shapes)
        held = self._held
        got: NotOpened | Prepared
        if held is not None:  # a buffered round: the update trained ahead goes in
            got = open_buffered(plan, held, dim=d, round_rng=self._round_rng,
                                max_colluders=self._max_colluders)
            if isinstance(got, Prepared) or got.reason == "stale_model":
                self._held = None  # encoded once (or useless): never into another round
        elif self._offer is not None:
            # buffered rounds and no update held: this device's update went into this
            # round before a restart, or into another one; training now would spend again
            got = NotOpened(reason="stale_model", detail="buffered round: this device "
                                                         "holds no update trained ahead")
        else:  # synchronous
            got = open_round(plan, fleet=self.fleet, ledger=self._ledger,
                             params=self._params, model_version=self._version,
                             data=self._data, engine=self._engine, dim=d,
                             round_rng=self._round_rng, max_colluders=self._max_colluders)
        if isinstance(got, NotOpened):
            # the round is over for this device: it checks in again at once, as after any
            # round (with no round open; a failed round sends decliners nothing, and a
            # device that repeats no check-ins would be lost to the aggregator)
            return [*self._decline(plan, got.reason, got.detail), self._checkin(now),
                    *self._ahead(now)]
        residues, config, ledger_plan = got.contribution.values, got.config, got.ledger_plan
        reservation = got.reservation
        self._last_round = plan.round_id
        if config.amortized:
            return self._open_amortized(plan, raw, got, now)
        client = SecAggClient(identity=self._idn, registry=self._reg, config=config,
                              random_bytes=self._random)
        out = self._send_secagg(client.advertise())
        self._round = _Round(plan=plan, client=client, residues=residues,
                             ledger_plan=ledger_plan, reservation=reservation,
                             last_heard=now, answers={raw: out})
        self._events.append(RoundOpened(round_id=plan.round_id, model_version=plan.model_version,
                                        length=plan.length, cohort_size=len(plan.cohort)))
        return list(out)

    def _open_amortized(self, plan: RoundPlan, raw: bytes, got: Prepared,
                        now: float) -> list[Publish]:
        """The amortized protocol: mask with the pairwise seeds and upload at once."""
        seeds = PairwiseSeeds(identity=self._idn, registry=self._reg,
                              last_round=self._last_masked(plan.round_id))
        client = AmortizedSecAggClient(identity=self._idn, registry=self._reg,
                                       config=got.config, seeds=seeds)
        r = _Round(plan=plan, client=client, residues=got.contribution.values,
                   ledger_plan=got.ledger_plan, reservation=got.reservation, last_heard=now)
        self._round = r
        self._events.append(RoundOpened(round_id=plan.round_id, model_version=plan.model_version,
                                        length=plan.length, cohort_size=len(plan.cohort)))
        # the round was reserved (durably) before training, so the upload may leave
        parts = client.mask_input(r.residues, max_packet=self._max_packet)
        self._keep_input(r)
        out = self._send_secagg(*parts)
        r.answers[raw] = out
        r.upload = raw
        self._uploaded(r, out, resent=False)
        return list(out)

    def _last_masked(self, current: int) -> int | None:
        """The last round of this fleet the ledger holds a reservation for, before
        ``current``: every round the device may have masked for (reserved before the
        upload leaves), so the amortized seeds never mask twice for one round id."""
        prefix = f"{self.fleet}/"
        ids = [int(res.plan.round_id[len(prefix):]) for res in self._ledger.reservations()
               if res.plan.round_id.startswith(prefix)
               and res.plan.round_id[len(prefix):].isdigit()]
        ids = [i for i in ids if i != current]
        return max(ids) if ids else None

    # ------------------------------------------------------------------ secagg

    def _send_secagg(self, *msgs: SecAggUp) -> list[Publish]:
        return [Publish(wire.device_up_topic(self.fleet, self.device, m.KIND), wire.encode(m))
                for m in msgs]

    def _on_secagg(self, msg: SecAggDown, raw: bytes, now: float) -> list[Publish]:
        r = self._round
        if r is None or msg.round_id != r.plan.round_id:
            raise RemoteProtocolError(f"{msg.KIND} for round {msg.round_id}, not this "
                                      f"device's open round")
        if raw in r.answers:
            r.last_heard = now
            out = list(r.answers[raw])
            if raw == r.upload:  # the same upload again (the request was redelivered)
                self._uploaded(r, out, resent=True)
            return out
        if isinstance(msg, NeighbourKeys):
            out = self._send_secagg(r.client.share_keys(msg))
        elif isinstance(msg, ForwardedShares):
            out = self._upload(r, msg)
            r.upload = raw
            self._uploaded(r, out, resent=False)
        elif isinstance(msg, UnmaskRequest) and isinstance(r.client, SecAggClient):
            self._check_survivors(r, msg)
            out = self._send_secagg(r.client.unmask(msg))
            self._commit(r)
        elif isinstance(msg, RevealRequest) and isinstance(r.client, AmortizedSecAggClient):
            most = len(r.plan.cohort) - len(set(msg.dropped))
            if most < r.plan.min_survivors:
                raise RemoteProtocolError(
                    f"reveal request for round {r.plan.round_id} names {len(msg.dropped)} "
                    f"dropped neighbours: at most {most} uploads, fewer than min_survivors "
                    f"{r.plan.min_survivors}; refused")
            out = self._send_secagg(r.client.reveal(msg))
            self._commit(r)
        else:
            raise RemoteProtocolError(f"a device does not accept {msg.KIND}")
        r.answers[raw] = out
        r.last_heard = now
        return list(out)

    def _check_survivors(self, r: _Round, msg: UnmaskRequest) -> None:
        """Refuse (nothing revealed) an unmask request for a sum of fewer than the plan's
        ``min_survivors`` uploads: the ledger's aggregate view counts on that many.

        The request states the survivor count ``|U3|``; the device checks it against what
        it can see: at least itself plus the neighbours named as survivors (exactly that
        with the complete graph, ``degree >= n - 1``), at most the cohort less the
        neighbours named as dropped.
        """
        need = r.plan.min_survivors
        seen = len(set(msg.survivors)) + 1  # this device uploaded too
        complete = (set(RoundConfig.of_plan(r.plan).neighbours(self.device))
                    == set(r.plan.cohort) - {self.device})
        if msg.survivor_count < need:
            raise RemoteProtocolError(f"unmask request for round {r.plan.round_id} names "
                                      f"{msg.survivor_count} survivors, fewer than "
                                      f"min_survivors {need}; refused")
        most = len(r.plan.cohort) - len(set(msg.dropped))
        if not seen <= msg.survivor_count <= most or (complete and seen != msg.survivor_count):
            raise RemoteProtocolError(f"unmask request for round {r.plan.round_id} claims "
                                      f"{msg.survivor_count} survivors, but names {seen} "
                                      f"(with this device) and allows at most {most} "
                                      f"(complete graph: {complete}); refused")

    def _upload(self, r: _Round, msg: ForwardedShares) -> list[Publish]:
        # the round was reserved (durably) before training, so the upload may leave
        assert isinstance(r.client, SecAggClient)
        parts: tuple[MaskedPart, ...] = r.client.mask_input(msg, r.residues,
                                                            max_packet=self._max_packet)
        self._keep_input(r)
        return self._send_secagg(*parts)

    def _keep_input(self, r: _Round) -> None:
        self._inputs[r.plan.round_id] = r.residues.copy()
        while len(self._inputs) > _KEPT_INPUTS:
            del self._inputs[min(self._inputs)]

    def _uploaded(self, r: _Round, out: list[Publish], *, resent: bool) -> None:
        self._events.append(Uploaded(round_id=r.plan.round_id, parts=len(out),
                                     size=sum(len(p.payload) for p in out), resent=resent))

    def _commit(self, r: _Round) -> None:
        if r.reservation is None or r.committed:
            return
        r.committed = True
        try:
            self._ledger.commit(r.reservation)
        except LedgerError as e:  # the spend is counted either way; only the record suffers
            logger.error("%s: cannot commit round %d: %s", self.device, r.plan.round_id, e)

    # ------------------------------------------------------------------ helpers

    def _end_round(self, why: str) -> None:
        r = self._round
        if r is not None:
            if why == _NEW_MODEL and r.upload is not None and isinstance(
                    r.client, AmortizedSecAggClient):
                self._commit(r)  # nobody asked it to reveal: the new model shows the sum
            logger.debug("%s leaves round %d: %s", self.device, r.plan.round_id, why)
            self._events.append(RoundClosed(round_id=r.plan.round_id, reason=why,
                                            uploaded=r.upload is not None,
                                            model_version=self._version))
            if why != _NEW_MODEL:
                # no new model from that round (failed, dropped): a buffered device may
                # train ahead on the model it holds once more (a new reservation)
                self._ahead_tried = -1
        self._round = None

    def _checkin(self, now: float) -> Publish:
        """The check-in to publish now (it restarts the ``checkin_every`` clock)."""
        budget = self._ledger.budget  # fixed at the ledger's creation: no read to fail
        spent: float | None
        try:
            spent = float(self._ledger.spent().local_epsilon)  # at the budget's delta
            remaining = self._ledger.remaining()
            size = len(self._data()[1])
        except (LedgerError, ValueError) as e:
            logger.error("%s: cannot read the ledger for check-in: %s", self.device, e)
            spent, remaining, size = None, 0.0, 0  # no figure, never a low one
        if spent is not None and not math.isfinite(spent):
            spent = None  # the wire carries finite figures; "unbounded" is not one
        figures = {"remaining_epsilon": float(remaining), "spent_epsilon": spent,
                   "budget_epsilon": float(budget.epsilon), "budget_delta": float(budget.delta)}
        msg = wire.sign(CheckIn(round_id=self._last_round, sender=self.device, data_size=size,
                                model_version=self._version, **figures), self._idn)
        if self._checkin_every is not None:
            self._next_checkin = now + self._checkin_every
        self._events.append(CheckedIn(model_version=self._version, data_size=size, **figures))
        return Publish(wire.device_up_topic(self.fleet, self.device, "checkin"),
                       wire.encode(msg))
