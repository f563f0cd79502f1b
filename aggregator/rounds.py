"""The aggregator's round state machine, sans-I/O: messages and a clock in, publishes out.

One :class:`RoundMachine` runs a fleet's rounds (DESIGN, "One round, as data flows")::

    IDLE            collect check-ins; once enough eligible devices are in (budget left,
                    and not out of it by a budget decline: ``round_core.eligible_devices``;
                    fewer than min_cohort: no round, ``out_of_budget`` says why), select a
                    cohort uniformly (rng seeded by (policy.seed, round id)) and send the
                    plan (``aggregator.round_core``: draw_cohort, draw_plan)
    COLLECT_KEYS    AdvertiseKeys          -> close_advertise()    -> NeighbourKeys
    COLLECT_SHARES  ShareKeys              -> close_share_keys()   -> ForwardedShares
    COLLECT_MASKED  MaskedPart s           -> close_masked_input() -> UnmaskRequest
    COLLECT_UNMASK  UnmaskResponse         -> finalize(); round_core.finish: the plan's
                                              mechanism decodes the sum, the server
                                              optimizer applies it; publish the new model
                                              (retained) -> IDLE

Buffered asynchronous rounds (``policy.buffered``; FedBuff, Nguyen et al. 2022, issue 19):
the machine publishes a signed :class:`~edge_sdk.wire.BufferOffer` (retained, with every
setting its plans will carry) beside the model; devices train ahead and say
:class:`~edge_sdk.wire.Ready` (the model version their update is from). IDLE then starts a
round as soon as ``cohort_size`` devices are eligible (checked in on a model at most
``max_staleness`` versions old, budget left) and hold an update at most that stale: the
longest-waiting first, not a random draw (the buffer is whoever is ready). The round itself
is the same four stages; members weight their clipped updates on the device before noise
and masking (the sum cannot be reweighted after SecAgg), so decoding is unchanged. An
update a round took is never queued again (a Ready for it is a :class:`Duplicate`).

A stage closes as soon as every device still expected has answered, or at its deadline
(``policy.stage_timeout`` after it opened); devices missing then are dropped and the
secure-aggregation protocol recovers them. While a stage is open, its requests are sent
again to the devices that have not answered, every ``stage_timeout / 4`` (at most
``_RESENDS`` times, on the clock the machine is driven with): devices answer an exact
duplicate with the same answer, so a message the broker dropped costs a retry, not a round.
A round in which fewer than ``policy.min_survivors`` devices remain at any stage, or
which ``SecAggServer`` cannot finish (:class:`edge_sdk.errors.RoundFailed`), fails
cleanly: nothing is unmasked, the cohort gets an ``ErrorNotice("round_failed")`` and the
next round proceeds.

Driving it (the MQTT service, or the tests' in-memory broker)::

    m = RoundMachine(policy=..., identity=..., registry=..., params=initial_params)
    adapter.subscribe(m.subscriptions())
    send(m.on_connect(now))                       # the retained model (and, after a
    send(m.on_message(topic, payload, now))       # restore, the stage's messages again)
    send(m.on_tick(now))                          # deadlines, round starts

Every inbound message is validated (wire structure, topic = sender, enrolled device,
signature, round, stage, cohort membership, sizes); a bad one changes nothing and becomes a
:class:`Rejected` event (a QoS 1 redelivery of one already accepted: :class:`Duplicate`):
no exception ever leaves :meth:`RoundMachine.on_message`.

Isolation between devices (``aggregator.guard``, which says why this design): every
enrolled device's messages pass a token bucket (:class:`~aggregator.guard.FloodLimits`)
before anything is decoded. A device that exceeds it is quarantined until the round open
then (or, when idle, the next round) has ended: its messages are dropped unread, it no
longer holds a stage open (secure aggregation recovers it as a dropout), and it is not
selected.

Events (h11 style): the machine tells its driver what happened as frozen values, oldest
first, from :meth:`take_events`: the round's course (:class:`RoundStarted`,
:class:`StageChanged`, :class:`RoundEnded`), its peers (:class:`Rejected`,
:class:`Duplicate`, :class:`Declined`, :class:`StatusSeen`, :class:`CheckInSeen`) and the
isolation between them (:class:`Quarantined`, :class:`Released`, :class:`Resent`).
Drivers learn from these alone, never by diffing the machine's state or listening to its
log (which is for humans): the MQTT service turns them into JSON log lines, metrics,
(un)subscriptions (``subscriptions(per_device=True)`` lists per-device filters, so that
unsubscribing one device makes the broker discard its traffic) and its status page
(``aggregator.status``), the fleet simulator into its round records.
Within one call the order is the order things happened: a round's last call gives any
:class:`Released` (the round's end lifts quarantines), then :class:`RoundEnded`, then the
:class:`StageChanged` to ``"idle"``.

Persistence: :meth:`RoundMachine.snapshot` is the complete state as bytes (model,
optimizer state, check-ins, the round with its secure-aggregation server); the injected
``checkpoint`` callable receives it after every stage transition, *before* the
transition's messages are returned for sending, so a restart never loses a transition
it already announced. The secure-aggregation server is snapshotted as its input log
(accepted messages and stage closes) and rebuilt by replaying it: its arithmetic and its
Ed25519 signatures are deterministic, so the replay reproduces it bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from aggregator.errors import AggregatorError
from aggregator.guard import FloodGuard, FloodLimits
from aggregator.optimizers import OPTIMIZERS, state_leaves, state_rebuild
from aggregator.round_core import (
    RoundPolicy,
    check_plannable,
    draw_cohort,
    draw_offer,
    draw_plan,
    eligible_devices,
    finish,
    next_update_clip,
    round_secrets,
    server_half,
    short_of_survivors,
    too_few_eligible,
    with_update_clip,
)
from aggregator.secagg_server import (
    CLOSE,
    RECV,
    AmortizedSecAggServer,
    SecAggServer,
    ServerStage,
)
from aggregator.site import Upstream, check_gateway_policy, gateway_sum
from edge_sdk import wire
from edge_sdk.errors import (
    LocalProtocolError,
    RemoteProtocolError,
    ReplayedMessage,
    RoundFailed,
)
from edge_sdk.secagg import AggregatorIdentity, Registry, RoundConfig
from edge_sdk.wire import (
    CheckIn,
    Decline,
    ErrorNotice,
    GatewaySum,
    ModelUpdate,
    Publish,
    Ready,
    RoundPlan,
    SecAggUp,
    SiteRound,
    WireArray,
)

__all__ = [
    "CheckInSeen",
    "Declined",
    "Duplicate",
    "Event",
    "Quarantined",
    "Rejected",
    "Released",
    "Resent",
    "RoundEnded",
    "RoundMachine",
    "RoundOutcome",
    "RoundPolicy",
    "RoundStarted",
    "SnapshotError",
    "StageChanged",
    "StatusSeen",
    "round_secrets",
]

logger = logging.getLogger("aggregator.rounds")

SNAPSHOT_FORMAT = "fedge-rounds"
SNAPSHOT_VERSION = 4  # 2: protocol 4 (masked parts replayed by the server; no reassembler);
# 3: protocol 5 (the held check-ins state spent and budget); 4: protocol 6 (device-dp's S,
# which adaptive clipping moves, is round state)
_HISTORY = 32  # outcomes kept (the snapshot stays bounded over a long-lived fleet)
_RESENDS = 3  # re-sends of a stage's requests, at 1/4, 2/4 and 3/4 of its timeout
_EVENTS = 4096  # events kept for a driver that does not take them (oldest dropped)


class SnapshotError(AggregatorError):
    """A snapshot that cannot be restored (malformed, another policy, another model)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundOutcome:
    """How one round ended.

    Attributes:
        round_id: the round; completed: True if a new model was published.
        survivors: the devices whose inputs are in the sum (empty when failed).
        detail: why it failed ("" when completed).
        total: the unmasked integer sum mod 2^bits (None when failed).
        model_version: the model version after the round.
        uploaded: the devices whose masked upload the aggregator accepted; each reserved
            privacy budget for the round before uploading (``edge_sdk.session``), so on a
            failed round this is budget spent for nothing (a lower bound: an upload lost
            on the way is not counted).
    """

    round_id: int
    completed: bool
    survivors: tuple[str, ...]
    detail: str
    total: np.ndarray | None
    model_version: int
    uploaded: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Quarantined:
    """``device`` exceeded its flood limits; its messages are dropped until round
    ``until_round`` has ended. ``round_id``: the open round (None when idle)."""

    device: str
    round_id: int | None
    until_round: int
    stage: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Released:
    """``device``'s quarantine ended; ``dropped`` messages were discarded during it."""

    device: str
    dropped: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Resent:
    """The open stage's requests were sent again to ``devices`` (re-send ``attempt``)."""

    round_id: int
    stage: str
    devices: tuple[str, ...]
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusSeen:
    """A message on ``device``'s status topic (``status``: its payload, at most 64
    characters); ``removed``: it took the device's check-in away."""

    device: str
    status: str
    removed: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckInSeen:
    """``device``'s check-in was accepted (signature verified): what the device reports of
    itself, its ledger's figures as the device states them (the aggregator cannot check
    them; local epsilon in nats, zero-out adjacency). ``remaining_epsilon``: left in its
    budget; ``spent_epsilon``: spent at ``budget_delta`` (None: the device could not read
    its ledger); ``budget_epsilon``, ``budget_delta``: its budget; ``data_size``: its
    training samples; ``model_version``: the model it holds (-1: none)."""

    device: str
    remaining_epsilon: float
    spent_epsilon: float | None
    budget_epsilon: float
    budget_delta: float
    data_size: int
    model_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected:
    """A message refused; it changed nothing.

    Attributes:
        topic: where it came; device: the device that topic names (None: not a
            ``fedge/<fleet>/<kind>/<device>...`` topic; named, not necessarily enrolled).
        reason: what was wrong with it (names the bad value).
        round_id, stage: the open round (None when idle) and ``RoundMachine.stage`` when
            it came.
    """

    topic: str
    device: str | None
    reason: str
    round_id: int | None
    stage: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Duplicate:
    """A redelivery of a message already accepted (QoS 1 delivers at least once): ignored,
    harmless. Fields as in :class:`Rejected`."""

    topic: str
    device: str | None
    reason: str
    round_id: int | None
    stage: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Declined:
    """``device``, in round ``round_id``'s cohort, declined it (``reason``: the device's,
    e.g. ``"budget"``); the stage no longer waits for it."""

    device: str
    round_id: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundStarted:
    """Round ``round_id`` started: its plan goes to ``cohort`` (sorted), who train from
    model ``model_version``."""

    round_id: int
    cohort: tuple[str, ...]
    model_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StageChanged:
    """Round ``round_id`` moved from stage ``prev`` to ``stage`` (``RoundMachine.stage``
    values; ``"idle"`` before the round's first stage and after its end)."""

    round_id: int
    stage: str
    prev: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundEnded:
    """A round ended: ``outcome`` (also the newest entry of ``RoundMachine.history``);
    ``cohort``: the devices its plan went to; ``declined``: those of them that declined."""

    outcome: RoundOutcome
    cohort: tuple[str, ...]
    declined: tuple[str, ...]


Event = (Quarantined | Released | Resent | StatusSeen | CheckInSeen | Rejected | Duplicate
         | Declined | RoundStarted | StageChanged | RoundEnded)


@dataclass(slots=True)
class _Round:
    plan: RoundPlan
    server: SecAggServer | AmortizedSecAggServer
    stage: ServerStage
    deadline: float
    expected: set[str]
    declined: set[str]
    log: list[tuple[str, bytes]]
    outbox: list[Publish]
    next_resend: float = math.inf
    resends: int = 0
    # each member's remaining epsilon as stated in the check-in it was selected on
    remaining: dict[str, float] = field(default_factory=dict)


def _down_device(topic: str) -> str:
    """The device of a ``wire.device_down_topic`` (``fedge/<fleet>/dev/<device>/down/...``)."""
    return topic.split("/", 4)[3]


def _topic_device(topic: str, fleet: str) -> str | None:
    """The device an uplink or status topic of ``fleet`` belongs to (cheap: no decoding)."""
    parts = topic.split("/", 5)
    if len(parts) >= 4 and parts[0] == "fedge" and parts[1] == fleet:
        if parts[2] == "dev" and len(parts) == 6 and parts[4] == "up":
            return parts[3]
        if parts[2] == "status" and len(parts) == 4:
            return parts[3]
    return None


def _named_device(topic: str) -> str | None:
    """The device a ``fedge/<fleet>/<kind>/<device>...`` topic names (any fleet, enrolled
    or not; None for other topics): whom a refusal is about."""
    parts = topic.split("/")
    return parts[3] if len(parts) > 3 and parts[0] == "fedge" else None


def _parse_topic(topic: str, fleet: str) -> tuple[str, str, str] | None:
    """("up", device, kind) of an uplink topic, ("status", device, "") of a status topic."""
    parts = topic.split("/")
    if len(parts) == 6 and parts[:3] == ["fedge", fleet, "dev"] and parts[4] == "up":
        return "up", parts[3], parts[5]
    if len(parts) == 4 and parts[:3] == ["fedge", fleet, "status"]:
        return "status", parts[3], ""
    return None



def _server_for(plan: RoundPlan, *, identity: AggregatorIdentity,
                registry: Registry) -> SecAggServer | AmortizedSecAggServer:
    """The aggregator's half of the plan's secure-aggregation protocol (``plan.secagg``)."""
    config = RoundConfig.of_plan(plan)
    if config.amortized:
        return AmortizedSecAggServer(identity=identity, registry=registry, config=config)
    return SecAggServer(identity=identity, registry=registry, config=config)

class RoundMachine:
    """The aggregator's rounds for one fleet (see the module docstring).

    Args:
        policy: how rounds run.
        identity: the aggregator's signing key.
        registry: the enrolled devices (and the aggregator's public key).
        params: the initial global model (model version 0), graph order.
        random_bytes: source of the rounds' secret seeds and nonces (``os.urandom``; a
            seeded source in tests).
        checkpoint: called with :meth:`snapshot` after every stage transition, before the
            transition's messages are returned (``aggregator.store.CheckpointStore.save``).
        start_gate: called with the check-ins held (device -> latest ``CheckIn``) before a
            round would start; the round waits while it returns False. None: no gate. A
            fleet simulator uses it to start rounds only once every live device checked in,
            so that the cohort does not depend on message timing.
        limits: per-device flood limits (``aggregator.guard.FloodLimits()`` by default).
        upstream: this machine is a gateway of a site (``aggregator.site``): it runs a
            round only when the site announces one (that id, the site's round seed,
            from the site's model, with a full cohort), forwards the sum its secure
            aggregation released to the site instead of applying it, and adopts and
            republishes (signed by itself) the site's models. None: a flat fleet.
        select: (eligible devices, round id) -> the round's cohort (sorted), in place of
            ``round_core.draw_cohort``: a stratified draw (``tools.hierarchy`` runs a flat
            fleet with the cohorts its gateways drew, to compare the two bit for bit).
        share: this machine is one of several workers of one gateway (issue 19): it takes
            no check-ins; its rounds are the jobs its site (a ``SiteMachine(jobs=...)``
            coordinating the gateway) hands out on ``site/job``, which it takes through the
            MQTT v5 shared subscription ``$share/<share>/...`` (each job reaches one
            worker; a worker runs its jobs one after the other). The driver subscribes the
            open round's cohort's uplinks (:meth:`round_subscriptions`) when a round starts
            and drops them when it ends. Needs ``upstream``. None: the machine takes every
            device's messages and draws its own cohorts.
    """

    def __init__(
        self,
        *,
        policy: RoundPolicy,
        identity: AggregatorIdentity,
        registry: Registry,
        params: Sequence[np.ndarray],
        random_bytes: Callable[[int], bytes] = os.urandom,
        checkpoint: Callable[[bytes], None] | None = None,
        start_gate: Callable[[Mapping[str, CheckIn]], bool] | None = None,
        limits: FloodLimits | None = None,
        upstream: Upstream | None = None,
        select: Callable[[Sequence[str], int], tuple[str, ...]] | None = None,
        share: str | None = None,
    ) -> None:
        if registry.aggregator_key != identity.public_key:
            raise ValueError("the registry's aggregator key is not this identity's")
        self.policy = policy
        self._idn = identity
        self._reg = registry
        self._random = random_bytes
        self._checkpoint = checkpoint
        self._start_gate = start_gate
        self._opt = OPTIMIZERS[policy.server_opt](server_lr=policy.server_lr)
        self._params = [np.array(p, dtype=np.float32) for p in params]
        if not all(np.isfinite(p).all() for p in self._params):
            raise ValueError("initial params must be finite")
        check_plannable(policy, dim=self.dimension)  # a round start never meets the error
        self._opt_state = self._opt.init(self._params)
        # device-dp's S, which adaptive clipping moves round by round (round_core)
        self._update_clip = None if policy.update_clip is None else float(policy.update_clip)
        self._version = 0
        self._last_round = 0
        self._available: dict[str, CheckIn] = {}
        self._startable_since: float | None = None
        # device -> its remaining epsilon when it declined a round for budget
        # (round_core.eligible_devices)
        self._short: dict[str, float] = {}
        self._round: _Round | None = None
        self._history: list[RoundOutcome] = []
        self._model_round = 0
        self._model_msg = self._sign_model(0)
        self._restored = False
        self._guard = FloodGuard(limits if limits is not None else FloodLimits())
        self._quarantine: dict[str, int] = {}  # device -> the round its quarantine outlasts
        self._dropped: dict[str, int] = {}  # device -> messages dropped in its quarantine
        self._events: deque[Event] = deque(maxlen=_EVENTS)
        if upstream is not None:
            check_gateway_policy(policy)
        self._upstream = upstream
        self._select = select
        if share is not None:
            wire.check_name("share group", share)
            if upstream is None:
                raise ValueError("a worker (share=...) forwards its sums: it needs upstream")
        self._share = share
        self._jobs: deque[SiteRound] = deque()  # share: jobs taken, not yet run
        self._job = 0  # share: the open round's job index
        self._site_round: SiteRound | None = None  # the site's newest announcement
        self._site_model: tuple[int, int] | None = None  # (version, round) adopted last
        # buffered rounds (policy.buffered): the offer, and device -> the model version of
        # the update it holds, in the order the Ready messages came (the oldest first)
        self._offer_msg: wire.BufferOffer | None = None
        if policy.buffered:
            if upstream is not None or select is not None:
                raise ValueError("buffered rounds run in a flat fleet (no upstream, no "
                                 "select): their cohort is whoever is ready first")
            self._offer_msg = wire.sign(draw_offer(policy, dim=self.dimension), identity)
        self._ready: dict[str, tuple[int, int]] = {}  # device -> (version, attempt)
        self._taken: dict[str, tuple[int, int]] = {}  # device -> its newest update that a
        # round took (a Ready for it, or an older one, again is a duplicate: once each)

    # ------------------------------------------------------------------ properties

    @property
    def model_version(self) -> int:
        return self._version

    @property
    def params(self) -> list[np.ndarray]:
        return [p.copy() for p in self._params]

    @property
    def history(self) -> tuple[RoundOutcome, ...]:
        return tuple(self._history)

    @property
    def stage(self) -> str:
        """``"idle"`` or the current round's ``ServerStage`` value."""
        return "idle" if self._round is None else self._round.stage.value

    @property
    def eligible(self) -> tuple[str, ...]:
        """The devices checked in on the current model that a round may select now
        (``round_core.eligible_devices``: budget left, and more than when they last declined for
        budget)."""
        return tuple(self._eligible())

    @property
    def checkins(self) -> dict[str, CheckIn]:
        """The check-ins held (device -> its latest, not yet used by a round)."""
        return dict(self._available)

    @property
    def out_of_budget(self) -> str | None:
        """Why no round can start from the check-ins held (``round_core.too_few_eligible``),
        or None. With every device checked in, the fleet's rounds are over."""
        return too_few_eligible(len(self._eligible()), policy=self.policy)

    @property
    def current_plan(self) -> RoundPlan | None:
        return None if self._round is None else self._round.plan

    @property
    def waiting_for(self) -> frozenset[str]:
        """The devices the open stage still waits for (empty when idle)."""
        r = self._round
        return frozenset() if r is None else frozenset(self._pending(r))

    @property
    def deadline(self) -> float | None:
        """When the open stage closes at the latest (None when idle)."""
        return None if self._round is None else self._round.deadline

    @property
    def dimension(self) -> int:
        return sum(p.size for p in self._params)

    @property
    def quarantined(self) -> frozenset[str]:
        """The devices whose messages are dropped unread (until their round has ended)."""
        return frozenset(self._quarantine)

    def take_events(self) -> list[Event]:
        """What happened since the last call (oldest first), and forget it. A driver that
        never takes them loses the oldest beyond the newest 4096, not memory."""
        out = list(self._events)
        self._events.clear()
        return out

    # ------------------------------------------------------------------ endpoint

    def subscriptions(self, *, per_device: bool = False) -> list[str]:
        """MQTT topic filters: every device's uplink and status; ``per_device``: one pair
        of filters per enrolled device not in quarantine (so that a broker discards a
        quarantined device's messages once its filters are unsubscribed)."""
        root = wire.fleet_topic(self.policy.fleet)
        up = self._upstream
        site = [] if up is None else [wire.site_round_topic(up.site),
                                      wire.site_model_topic(up.site)]
        if self._share is not None and up is not None:
            return [f"$share/{self._share}/{wire.site_job_topic(up.site)}",
                    wire.site_model_topic(up.site)]
        if not per_device:
            return [f"{root}/dev/+/up/+", f"{root}/status/+", *site]
        return site + [f for dev in sorted(self._reg.devices) if dev not in self._quarantine
                       for f in self.device_subscriptions(dev)]

    def round_subscriptions(self, cohort: Sequence[str]) -> list[str]:
        """A worker's (``share``) filters for a round of ``cohort``: each member's uplink
        kinds except its check-in (the site coordinator takes those); [] for a machine
        that takes every device's messages."""
        if self._share is None:
            return []
        root = wire.fleet_topic(self.policy.fleet)
        kinds = [k for k in wire.UP_KINDS if k != CheckIn.KIND]
        return [f"{root}/dev/{d}/up/{k}" for d in cohort for k in kinds]

    def device_subscriptions(self, device: str) -> list[str]:
        """The per-device filters of ``device`` (see :meth:`subscriptions`)."""
        root = wire.fleet_topic(self.policy.fleet)
        return [f"{root}/dev/{device}/up/+", f"{root}/status/{device}"]

    def on_connect(self, now: float) -> list[Publish]:
        """(Re)connected: the retained model, and the open stage's messages again (after a
        restart devices may have missed them; devices ignore exact duplicates)."""
        out = [self._model_publish()]
        if self._offer_msg is not None:
            out.append(Publish(wire.round_topic(self.policy.fleet),
                               wire.encode(self._offer_msg), retain=True))
        if self._round is not None:
            if self._restored:  # the old process's clock means nothing here
                self._round.deadline = now + self.policy.stage_timeout
            self._round.next_resend = now + self._resend_every()
            out += self._round.outbox
        self._restored = False
        return out + self._maybe_start(now)

    def on_tick(self, now: float) -> list[Publish]:
        """Deadlines, re-sends to devices that have not answered, round starts."""
        r = self._round
        if r is not None and not self._restored:
            if now >= r.deadline:
                return self._close_stage(now, why="deadline")
            if now >= r.next_resend and r.resends < _RESENDS:
                return self._resend(r, now)
        return self._maybe_start(now)

    def _resend_every(self) -> float:
        return self.policy.stage_timeout / (_RESENDS + 1)

    def _resend(self, r: _Round, now: float) -> list[Publish]:
        r.resends += 1
        r.next_resend = now + self._resend_every()
        pending = self._pending(r)
        out = [p for p in r.outbox if _down_device(p.topic) in pending]
        if out:
            devices = tuple(sorted({_down_device(p.topic) for p in out}))
            self._events.append(Resent(round_id=r.plan.round_id, stage=r.stage.value,
                                       devices=devices, attempt=r.resends))
            logger.info("round %d: %s requests sent again to %d devices (attempt %d)",
                        r.plan.round_id, r.stage.value, len(devices), r.resends,
                        extra={"fedge": {"event": "resent", "round": r.plan.round_id,
                                         "stage": r.stage.value, "devices": len(devices),
                                         "attempt": r.resends}})
        return out

    def on_message(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        """One inbound message. Never raises: a bad message is logged and changes nothing."""
        up = self._upstream
        if up is not None and topic in (wire.site_round_topic(up.site),
                                        wire.site_model_topic(up.site),
                                        wire.site_job_topic(up.site)):
            try:
                return self._from_site(topic, payload, now)
            except RemoteProtocolError as e:
                self._reject(topic, f"from the site: {e}")
                return []
        device = _topic_device(topic, self.policy.fleet)
        if device is not None and device in self._reg.devices:
            # before any decoding: a flood costs a lookup per message, not a parse
            if device in self._quarantine:
                self._dropped[device] = self._dropped.get(device, 0) + 1
                return []
            if not self._guard.admit(device, now, len(payload)):
                return self._quarantine_device(device, now)
        try:
            return self._handle(topic, payload, now)
        except ReplayedMessage as e:  # QoS 1 redelivery: expected, harmless
            self._events.append(Duplicate(
                topic=topic, device=_named_device(topic), reason=str(e),
                round_id=self._round.plan.round_id if self._round else None, stage=self.stage))
            logger.debug("duplicate ignored: %s", e,
                         extra={"fedge": {"event": "duplicate", "topic": topic,
                                          "reason": str(e)}})
        except RemoteProtocolError as e:
            self._reject(topic, str(e))
        return []

    # ------------------------------------------------------------------ inbound

    def _quarantine_device(self, device: str, now: float) -> list[Publish]:
        r = self._round
        until = r.plan.round_id if r is not None else self._last_round + 1
        self._quarantine[device] = until
        self._dropped[device] = 1
        self._available.pop(device, None)
        lim = self._guard.limits
        self._events.append(Quarantined(device=device, round_id=None if r is None
                                        else r.plan.round_id, until_round=until,
                                        stage=self.stage))
        logger.warning("%s quarantined until round %d has ended: more than %d messages at "
                       "once or %g per second", device, until, lim.burst, lim.rate,
                       extra={"fedge": {"event": "quarantined", "device": device,
                                        "until_round": until}})
        return self._maybe_close(now)  # it no longer holds the stage open

    def _release(self, ended_round: int) -> None:
        for device, until in sorted(self._quarantine.items()):
            if until <= ended_round:
                del self._quarantine[device]
                self._guard.reset(device)
                dropped = self._dropped.pop(device, 0)
                self._events.append(Released(device=device, dropped=dropped))
                logger.info("%s released from quarantine (%d messages dropped)", device,
                            dropped, extra={"fedge": {"event": "released", "device": device,
                                                      "dropped": dropped}})

    def _reject(self, topic: str, reason: str) -> None:
        self._events.append(Rejected(
            topic=topic, device=_named_device(topic), reason=reason,
            round_id=self._round.plan.round_id if self._round else None, stage=self.stage))
        logger.warning("rejected message on %s: %s", topic, reason, extra={"fedge": {
            "event": "rejected", "topic": topic, "reason": reason,
            "round": self._round.plan.round_id if self._round else None, "stage": self.stage}})

    def _handle(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        parsed = _parse_topic(topic, self.policy.fleet)
        if parsed is None:
            raise RemoteProtocolError(f"not a topic of fleet {self.policy.fleet!r}")
        where, device, kind = parsed
        if device not in self._reg.devices:
            raise RemoteProtocolError(f"message from outsider {device!r}")
        if where == "status":
            removed = bytes(payload) == b"offline" and device in self._available
            if removed:
                del self._available[device]
            status = bytes(payload[:64]).decode("utf-8", errors="replace")
            self._events.append(StatusSeen(device=device, status=status, removed=removed))
            logger.info("%s status %r%s", device, status,
                        " (its check-in is withdrawn)" if removed else "",
                        extra={"fedge": {"event": "status", "device": device,
                                         "status": status, "withdrawn": removed}})
            return []
        msg = wire.decode(payload, wire.UP_KINDS)
        if msg.KIND != kind:
            raise RemoteProtocolError(f"a {msg.KIND} message on the {kind!r} topic")
        if msg.sender != device:  # type: ignore[attr-defined]
            raise RemoteProtocolError(f"{msg.KIND} names device "
                                      f"{msg.sender!r} "  # type: ignore[attr-defined]
                                      f"but came on {device!r}'s topic")
        if isinstance(msg, CheckIn):
            self._reg.verify_message(msg)
            self._available[device] = msg
            self._events.append(CheckInSeen(device=device,
                                            remaining_epsilon=msg.remaining_epsilon,
                                            spent_epsilon=msg.spent_epsilon,
                                            budget_epsilon=msg.budget_epsilon,
                                            budget_delta=msg.budget_delta,
                                            data_size=msg.data_size,
                                            model_version=msg.model_version))
            return self._maybe_start(now)
        if isinstance(msg, Ready):
            return self._on_ready(msg, now)
        r = self._round
        if r is None or msg.round_id != r.plan.round_id:  # type: ignore[union-attr]
            raise RemoteProtocolError(
                f"{msg.KIND} for round {msg.round_id}, the open round is "  # type: ignore[union-attr]
                f"{None if r is None else r.plan.round_id}")
        if device not in r.plan.cohort:
            raise RemoteProtocolError(f"{msg.KIND} from {device!r}, not in round "
                                      f"{r.plan.round_id}'s cohort")
        if isinstance(msg, Decline):
            self._reg.verify_message(msg)
            if device in r.declined:
                raise ReplayedMessage(f"decline from {device!r} already recorded")
            r.declined.add(device)
            if msg.reason == "budget" and device in r.remaining:
                self._short[device] = r.remaining[device]
            self._events.append(Declined(device=device, round_id=r.plan.round_id,
                                         reason=msg.reason))
            logger.info("%s declined round %d: %s", device, r.plan.round_id, msg.reason,
                        extra={"fedge": {"event": "declined", "device": device,
                                         "round": r.plan.round_id, "reason": msg.reason}})
            return self._maybe_close(now)
        return self._accept(msg, now)  # type: ignore[arg-type]  (a SecAgg kind)

    def _accept(self, msg: SecAggUp, now: float) -> list[Publish]:
        r = self._round
        assert r is not None
        if msg.round_id != r.plan.round_id:
            raise RemoteProtocolError(f"{msg.KIND} for round {msg.round_id}")
        r.server.receive(msg)  # raises before any change
        r.log.append((RECV, wire.encode(msg)))
        return self._maybe_close(now)

    # ------------------------------------------------------------------ stages

    def _pending(self, r: _Round) -> set[str]:
        return set(r.server.pending()) - r.declined - self._quarantine.keys()

    def _answered(self, r: _Round) -> int:
        return len(r.expected - r.declined - self._quarantine.keys() - self._pending(r)
                   - r.server.spoiled.keys())  # an upload dropped as inconsistent is none

    def _maybe_close(self, now: float) -> list[Publish]:
        r = self._round
        if r is None or self._pending(r):
            return []
        return self._close_stage(now, why="all answered")

    def _close_stage(self, now: float, why: str) -> list[Publish]:
        r = self._round
        assert r is not None
        prev = r.stage
        have = self._answered(r)
        need = r.plan.min_survivors
        # recovery needs t answers per neighbourhood, not min_survivors: finalize() judges
        short = (None if r.stage is ServerStage.COLLECT_UNMASK else
                 short_of_survivors(r.stage.value, have, min_survivors=need, why=why))
        if short is not None:
            return self._fail(now, short)
        if r.stage is ServerStage.COLLECT_UNMASK:
            return self._finish(now)
        try:
            out = r.server.close_stage()
        except RoundFailed as e:
            return self._fail(now, str(e))
        r.log.append((CLOSE, r.stage.value.encode()))
        r.stage = r.server.stage
        if not out and r.stage is ServerStage.COLLECT_UNMASK:
            # the amortized variant with nobody dropped: no seeds to reveal, no one to wait for
            return self._finish(now)
        r.expected = set(out)
        r.deadline = now + self.policy.stage_timeout
        r.next_resend = now + self._resend_every()
        r.resends = 0
        fleet = self.policy.fleet
        r.outbox = [Publish(wire.device_down_topic(fleet, dev, m.KIND), wire.encode(m))
                    for dev, m in sorted(out.items())]
        self._events.append(StageChanged(round_id=r.plan.round_id, stage=r.stage.value,
                                         prev=prev.value))
        logger.info("round %d: %s closed (%s), %d devices go on", r.plan.round_id,
                    why, r.stage.value, len(out), extra={"fedge": {
                        "event": "stage", "round": r.plan.round_id, "stage": r.stage.value,
                        "devices": len(out)}})
        self._save()
        return list(r.outbox)

    def _finish(self, now: float) -> list[Publish]:
        r = self._round
        assert r is not None
        try:
            total = r.server.finalize()
        except RoundFailed as e:
            return self._fail(now, str(e))
        survivors = r.server.survivors
        plan = r.plan
        if self._upstream is not None:
            return self._forward(r, total, survivors, now)
        done = finish(plan, total, len(survivors), params=self._params,
                      server=server_half(plan, dim=self.dimension), optimizer=self._opt,
                      opt_state=self._opt_state)
        self._params = done.params
        self._opt_state = done.opt_state
        if self._update_clip is not None:
            self._update_clip = next_update_clip(self.policy, self._update_clip, done.quantile)
        self._version += 1
        self._model_round = plan.round_id
        self._model_msg = self._sign_model(plan.round_id)
        self._forget_stale(now)
        self._record(RoundOutcome(round_id=plan.round_id, completed=True, survivors=survivors,
                                  detail="", total=total, model_version=self._version,
                                  uploaded=survivors))
        logger.info("round %d done: %d survivors, model version %d", plan.round_id,
                    len(survivors), self._version, extra={"fedge": {
                        "event": "round_done", "round": plan.round_id,
                        "survivors": len(survivors), "version": self._version}})
        self._round = None
        self._startable_since = None
        self._release(plan.round_id)
        self._ended(r)
        self._save()
        return [self._model_publish()]

    def _fail(self, now: float, reason: str) -> list[Publish]:
        r = self._round
        assert r is not None
        plan = r.plan
        uploaded = (r.server.survivors if r.stage in (ServerStage.COLLECT_MASKED,
                                                       ServerStage.COLLECT_UNMASK) else ())
        self._record(RoundOutcome(round_id=plan.round_id, completed=False, survivors=(),
                                  detail=reason, total=None, model_version=self._version,
                                  uploaded=tuple(uploaded)))
        logger.warning("round %d failed: %s", plan.round_id, reason, extra={"fedge": {
            "event": "round_failed", "round": plan.round_id, "reason": reason}})
        self._round = None
        self._startable_since = None
        out = [
            Publish(wire.device_down_topic(self.policy.fleet, dev, "error"),
                    wire.encode(wire.sign(ErrorNotice(round_id=plan.round_id, recipient=dev,
                                                      code="round_failed",
                                                      detail=reason[:256]), self._idn)))
            for dev in plan.cohort if dev not in r.declined
        ]
        if self._upstream is not None:  # the site need not wait for this gateway
            out.append(self._sum_publish(gateway_sum(plan, gateway=self._upstream.gateway,
                                                     total=None, survivors=0,
                                                     detail=reason, job=self._job)))
        self._release(plan.round_id)
        self._ended(r)
        self._save()
        if self._share is not None:  # a worker goes on with its next job
            out += self._maybe_start(now)
        return out

    def _record(self, outcome: RoundOutcome) -> None:
        self._history = [*self._history, outcome][-_HISTORY:]

    def _ended(self, r: _Round) -> None:
        """The events of ``r``'s end, once its outcome is recorded and its quarantines
        released (so that the driver sees those first)."""
        self._events.append(RoundEnded(outcome=self._history[-1], cohort=r.plan.cohort,
                                       declined=tuple(sorted(r.declined))))
        self._events.append(StageChanged(round_id=r.plan.round_id, stage="idle",
                                         prev=r.stage.value))

    # ------------------------------------------------------------------ starting

    def _eligible(self) -> list[str]:
        # buffered: a member adds the update it holds, whatever model it holds now
        oldest = self._version - (self.policy.max_staleness if self._offer_msg else 0)
        out = eligible_devices({d: c.remaining_epsilon for d, c in self._available.items()
                                if oldest <= c.model_version <= self._version},
                               short=self._short)
        if self._offer_msg is None:
            return out
        # buffered: those holding a fresh enough update, the longest-waiting first
        ok = set(out)
        return [d for d, (v, _) in self._ready.items()
                if d in ok and self._version - v <= self.policy.max_staleness]

    def _on_ready(self, msg: Ready, now: float) -> list[Publish]:
        offer = self._offer_msg
        if offer is None:
            raise RemoteProtocolError("ready: this fleet runs synchronous rounds")
        self._reg.verify_message(msg)
        if msg.offer != offer.round_id:
            raise RemoteProtocolError(f"ready under offer {msg.offer}, the offer is "
                                      f"{offer.round_id}")
        if msg.trained_version < self._version - self.policy.max_staleness:
            raise RemoteProtocolError(f"ready with an update of model "
                                      f"{msg.trained_version}, more than "
                                      f"{self.policy.max_staleness} versions behind "
                                      f"{self._version}")
        if msg.trained_version > self._version:
            raise RemoteProtocolError(f"ready with an update of model "
                                      f"{msg.trained_version}, newer than {self._version}")
        update = (msg.trained_version, msg.attempt)
        if self._ready.get(msg.sender) == update \
                or self._taken.get(msg.sender, (-1, -1)) >= update:
            raise ReplayedMessage(f"ready from {msg.sender!r} for update {update} (model, "
                                  f"attempt) already recorded")
        self._ready.pop(msg.sender, None)  # another update: it queues anew
        self._ready[msg.sender] = update
        return self._maybe_start(now)

    def _maybe_start(self, now: float) -> list[Publish]:
        pol = self.policy
        if self._round is not None or self._restored:
            return []
        if self._share is None and pol.max_rounds is not None \
                and self._last_round >= pol.max_rounds:
            return []  # (a worker's rounds are its site's: the site counts them)
        if self._share is not None:  # a worker runs its jobs, in order, on their model
            while self._jobs and self._jobs[0].model_version < self._version:
                self._jobs.popleft()  # a job of a round the site has closed
            if not self._jobs or self._jobs[0].model_version != self._version:
                return []
            job = self._jobs.popleft()
            self._job = job.job
            self._site_round = job
            return self._start(now, list(job.cohort))
        site = self._site_round
        if self._upstream is not None and (
                site is None or site.round_id <= self._last_round
                or site.model_version != self._version):
            return []  # a gateway runs the site's rounds only, from the site's model
        eligible = self._eligible()
        full = pol.cohort_size
        if self._offer_msg is not None:  # buffered: a round as soon as K are ready
            if len(eligible) < full or (self._start_gate is not None
                                        and not self._start_gate(dict(self._available))):
                return []
            return self._start(now, eligible[:full])
        if too_few_eligible(len(eligible), policy=pol):
            self._startable_since = None
            return []
        if self._startable_since is None:
            self._startable_since = now
        if len(eligible) < full and now < self._startable_since + pol.checkin_window:
            return []
        if self._start_gate is not None and not self._start_gate(dict(self._available)):
            return []
        return self._start(now, eligible)

    def _start(self, now: float, eligible: list[str]) -> list[Publish]:
        pol = self.policy
        site = self._site_round if self._upstream is not None else None
        round_id = self._last_round + 1 if site is None else site.round_id
        if self._share is not None or self._offer_msg is not None:
            # the job's cohort, as the site drew it; a buffer: its first K ready
            cohort = tuple(sorted(eligible))
        else:
            cohort = (draw_cohort(eligible, policy=pol, round_id=round_id)
                      if self._select is None else self._select(eligible, round_id))
        n = len(cohort)
        if self._update_clip is not None:  # adaptive clipping's current S
            pol = with_update_clip(pol, self._update_clip)
        plan = wire.sign(draw_plan(pol, round_id=round_id, model_version=self._version,
                                   cohort=cohort, dim=self.dimension,
                                   random_bytes=self._random,
                                   round_seed=None if site is None else site.round_seed),
                         self._idn)
        server = _server_for(plan, identity=self._idn, registry=self._reg)
        payload = wire.encode(plan)
        outbox = [Publish(wire.device_down_topic(pol.fleet, dev, "plan"), payload)
                  for dev in cohort]
        self._round = _Round(plan=plan, server=server, stage=server.stage,
                             deadline=now + pol.stage_timeout, expected=set(cohort),
                             declined=set(), log=[], outbox=outbox,
                             next_resend=now + self._resend_every(),
                             remaining={dev: self._available[dev].remaining_epsilon
                                        for dev in cohort if dev in self._available})
        self._last_round = round_id
        for dev in cohort:  # they check in again when the round is over
            self._available.pop(dev, None)
            if dev in self._ready:  # the update is spent in this round, whatever comes
                self._taken[dev] = self._ready.pop(dev)
        self._events.append(RoundStarted(round_id=round_id, cohort=cohort,
                                         model_version=self._version))
        self._events.append(StageChanged(round_id=round_id, stage=self.stage, prev="idle"))
        logger.info("round %d started: %d devices, model version %d", round_id, n,
                    self._version, extra={"fedge": {"event": "round_started",
                                                    "round": round_id, "cohort": list(cohort)}})
        self._save()
        return list(outbox)

    def _forget_stale(self, now: float) -> None:
        """A new model: check-ins on older ones can no longer be selected (eligibility
        needs the current version; a device checks in again when it has the model), and
        full flood buckets are as good as none, so both go: the machine's memory follows
        the devices active since the last model, not every device ever seen (issue 19)."""
        oldest = self._version - (self.policy.max_staleness if self._offer_msg else 0)
        self._available = {d: c for d, c in self._available.items()
                           if c.model_version >= oldest}
        fresh = self._version - self.policy.max_staleness
        self._ready = {d: u for d, u in self._ready.items() if u[0] >= fresh}
        self._taken = {d: u for d, u in self._taken.items() if u[0] >= fresh}
        self._guard.forget_full(now)

    # ------------------------------------------------------------------ site (gateway)

    def _forward(self, r: _Round, total: np.ndarray, survivors: tuple[str, ...],
                 now: float) -> list[Publish]:
        """A gateway's end of a completed round: the released sum goes to the site; the
        model changes only when the site's new one arrives (:meth:`_from_site`)."""
        assert self._upstream is not None
        plan = r.plan
        self._record(RoundOutcome(round_id=plan.round_id, completed=True, survivors=survivors,
                                  detail="forwarded to the site", total=total,
                                  model_version=self._version, uploaded=survivors))
        logger.info("round %d done: %d survivors, sum forwarded to site %s", plan.round_id,
                    len(survivors), self._upstream.site, extra={"fedge": {
                        "event": "round_forwarded", "round": plan.round_id,
                        "survivors": len(survivors)}})
        self._round = None
        self._startable_since = None
        self._release(plan.round_id)
        self._ended(r)
        self._save()
        return [self._sum_publish(gateway_sum(plan, gateway=self._upstream.gateway,
                                              total=total, survivors=len(survivors),
                                              job=self._job))] + self._maybe_start(now)

    def _sum_publish(self, msg: GatewaySum) -> Publish:
        assert self._upstream is not None
        up = self._upstream
        return Publish(wire.gateway_up_topic(up.site, up.gateway, msg.KIND),
                       wire.encode(wire.sign(msg, self._idn)))

    def _from_site(self, topic: str, payload: bytes, now: float) -> list[Publish]:
        """The site's round announcement or model (verified with the site's key)."""
        up = self._upstream
        assert up is not None
        if topic == wire.site_job_topic(up.site):
            msg = wire.decode(payload, wire.SITE_KINDS)
            if not isinstance(msg, SiteRound) or not msg.cohort:
                raise RemoteProtocolError("not a job on the site's job topic")
            wire.verify(msg, up.site_key)
            if self._share is None:
                raise RemoteProtocolError("a job for a worker, and this machine is none")
            if len(msg.cohort) != self.policy.cohort_size or not set(msg.cohort) <= set(
                    self._reg.devices):
                raise RemoteProtocolError(f"job {msg.job} of round {msg.round_id}: a cohort of "
                                          f"{len(msg.cohort)}, not {self.policy.cohort_size} "
                                          "enrolled devices")
            self._jobs.append(msg)
            return self._maybe_start(now)
        if topic == wire.site_round_topic(up.site):
            msg = wire.decode(payload, wire.SITE_KINDS)
            if not isinstance(msg, SiteRound):
                raise RemoteProtocolError(f"a {msg.KIND} message on the site round topic")
            wire.verify(msg, up.site_key)
            if self._site_round is None or msg.round_id > self._site_round.round_id:
                self._site_round = msg
                self._save()
            return self._maybe_start(now)
        model = wire.decode(payload, wire.MODEL_KINDS)
        assert isinstance(model, ModelUpdate)
        wire.verify(model, up.site_key)
        key = (model.version, model.round_id)
        if key == self._site_model or model.version < self._version:
            return []
        params = model.params()
        shapes = [p.shape for p in self._params]
        if [p.shape for p in params] != shapes:
            raise RemoteProtocolError(f"the site's model has shapes {[p.shape for p in params]}"
                                      f", this gateway's {shapes}")
        out: list[Publish] = []
        r = self._round
        if r is not None and r.plan.model_version < model.version:
            out += self._fail(now, f"superseded by the site's model version {model.version}")
        self._params = [np.asarray(p, dtype=np.float32) for p in params]
        self._version = model.version
        self._model_round = model.round_id
        self._model_msg = self._sign_model(model.round_id)  # devices trust their gateway
        self._site_model = key
        self._forget_stale(now)
        logger.info("adopted site %s's model version %d (round %d)", up.site, model.version,
                    model.round_id, extra={"fedge": {"event": "site_model",
                                                     "version": model.version,
                                                     "round": model.round_id}})
        self._save()
        return out + [self._model_publish()] + self._maybe_start(now)

    # ------------------------------------------------------------------ model

    def _sign_model(self, round_id: int) -> bytes:
        return wire.encode(wire.sign(ModelUpdate.of(version=self._version, round_id=round_id,
                                                    params=self._params), self._idn))

    def _model_publish(self) -> Publish:
        return Publish(wire.model_topic(self.policy.fleet), self._model_msg, retain=True)

    # ------------------------------------------------------------------ snapshots

    def _save(self) -> None:
        if self._checkpoint is not None:
            self._checkpoint(self.snapshot())

    def snapshot(self) -> bytes:
        """The complete state as deterministic msgpack bytes (restore with :meth:`restore`)."""
        r = self._round
        state: dict[str, Any] = {
            "format": SNAPSHOT_FORMAT,
            "v": SNAPSHOT_VERSION,
            "policy": dataclasses.asdict(self.policy),
            "aggregator_key": self._idn.public_key,
            "version": self._version,
            "model_round": self._model_round,
            "last_round": self._last_round,
            "params": [WireArray.of(p).to_wire() for p in self._params],
            "opt_state": [WireArray.of(a).to_wire() for a in state_leaves(self._opt_state)],
            "update_clip": self._update_clip,
            "available": [wire.encode(c) for _, c in sorted(self._available.items())],
            "startable_since": self._startable_since,
            "history": [
                [o.round_id, o.completed, list(o.survivors), o.detail,
                 None if o.total is None else WireArray.of(o.total).to_wire(), o.model_version,
                 list(o.uploaded)]
                for o in self._history
            ],
            "quarantine": sorted([d, u] for d, u in self._quarantine.items()),
            "short": sorted([d, v] for d, v in self._short.items()),
            "site_round": None if self._site_round is None else wire.encode(self._site_round),
            "site_model": None if self._site_model is None else list(self._site_model),
            "jobs": [wire.encode(j) for j in self._jobs], "job": self._job,
            "round": None if r is None else {
                "plan": wire.encode(r.plan),
                "stage": r.stage.value,
                "deadline": r.deadline,
                "expected": sorted(r.expected),
                "declined": sorted(r.declined),
                "log": [[op, data] for op, data in r.log],
                "outbox": [[p.topic, p.payload, p.retain] for p in r.outbox],
                "remaining": sorted([d, v] for d, v in r.remaining.items()),
            },
        }
        return msgpack.packb(state, use_bin_type=True)

    @classmethod
    def restore(
        cls,
        data: bytes,
        *,
        policy: RoundPolicy,
        identity: AggregatorIdentity,
        registry: Registry,
        random_bytes: Callable[[int], bytes] = os.urandom,
        checkpoint: Callable[[bytes], None] | None = None,
        start_gate: Callable[[Mapping[str, CheckIn]], bool] | None = None,
        limits: FloodLimits | None = None,
        upstream: Upstream | None = None,
        share: str | None = None,
    ) -> RoundMachine:
        """A machine in exactly the state :meth:`snapshot` captured (``start_gate`` and
        ``limits`` as in the constructor; they are not part of the snapshot, nor are the
        flood buckets' levels).

        Call :meth:`on_connect` first: it re-sends the open stage's messages and restarts
        the stage's deadline on this process's clock.

        Raises:
            SnapshotError: malformed, or taken under another policy or aggregator key.
        """
        try:
            s = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
            m = cls._restore(s, policy, identity, registry, random_bytes, checkpoint)
            m._start_gate = start_gate
            if upstream is not None:
                check_gateway_policy(policy)
                m._upstream = upstream
                raw = s.get("site_round")
                m._site_round = None if raw is None else wire.decode(raw, wire.SITE_KINDS)  # type: ignore[assignment]
                if m._site_round is not None:
                    wire.verify(m._site_round, upstream.site_key)
                sm = s.get("site_model")
                m._site_model = None if sm is None else (int(sm[0]), int(sm[1]))
            if share is not None:
                if upstream is None:
                    raise ValueError("a worker (share=...) needs upstream")
                m._share = wire.check_name("share group", share)
                for raw in s.get("jobs", []):
                    job = wire.decode(raw, wire.SITE_KINDS)
                    assert isinstance(job, SiteRound)
                    wire.verify(job, upstream.site_key)
                    m._jobs.append(job)
                m._job = int(s.get("job", 0))
            if limits is not None:
                m._guard = FloodGuard(limits)
            return m
        except SnapshotError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, AttributeError,
                msgpack.UnpackException, LocalProtocolError, RemoteProtocolError,
                RoundFailed) as e:
            raise SnapshotError(f"cannot restore the snapshot: {type(e).__name__}: {e}") from None

    @classmethod
    def _restore(cls, s: Mapping[str, Any], policy: RoundPolicy, identity: AggregatorIdentity,
                 registry: Registry, random_bytes: Callable[[int], bytes],
                 checkpoint: Callable[[bytes], None] | None) -> RoundMachine:
        if s.get("format") != SNAPSHOT_FORMAT or s.get("v") != SNAPSHOT_VERSION:
            raise SnapshotError(f"not a {SNAPSHOT_FORMAT} v{SNAPSHOT_VERSION} snapshot")
        # snapshots taken before the policy had a setting ran with its default (before
        # the policy named its mechanism: the only one there was, "gaussian")
        defaults = {f.name: f.default for f in dataclasses.fields(RoundPolicy)
                    if f.default is not dataclasses.MISSING}
        if {**defaults, **s["policy"]} != dataclasses.asdict(policy):
            raise SnapshotError("the snapshot was taken under another policy")
        if s["aggregator_key"] != identity.public_key:
            raise SnapshotError("the snapshot was taken by another aggregator identity")
        lim = wire.LIMITS
        params = [WireArray.from_wire(a, lim).to_numpy() for a in s["params"]]
        m = cls(policy=policy, identity=identity, registry=registry, params=params,
                random_bytes=random_bytes, checkpoint=checkpoint)
        leaves = [WireArray.from_wire(a, lim).to_numpy() for a in s["opt_state"]]
        m._opt_state = state_rebuild(m._opt.init(m._params), leaves)
        if leaves:
            raise SnapshotError("optimizer state has more leaves than the optimizer")
        m._version = s["version"]
        # snapshots from before adaptive clipping: S was the policy's
        m._update_clip = s.get("update_clip", policy.update_clip)
        u = m._update_clip
        if (u is None) != (policy.update_clip is None) or (u is not None and not (
                isinstance(u, float) and math.isfinite(u) and u > 0)):
            raise SnapshotError(f"the snapshot's update_clip {u!r} is not a finite S > 0 "
                                f"(the policy's: {policy.update_clip!r})")
        m._last_round = s["last_round"]
        m._available = {}
        for raw in s["available"]:
            c = wire.decode(raw, wire.UP_KINDS)
            assert isinstance(c, CheckIn)
            m._available[c.sender] = c
        m._startable_since = s["startable_since"]
        m._history = [
            RoundOutcome(round_id=h[0], completed=h[1], survivors=tuple(h[2]), detail=h[3],
                         total=None if h[4] is None else
                         WireArray.from_wire(h[4], lim).to_numpy(),
                         model_version=h[5], uploaded=tuple(h[6]) if len(h) > 6 else ())
            for h in s["history"]
        ]
        # absent from snapshots taken before quarantines existed
        m._quarantine = {d: u for d, u in s.get("quarantine", [])}
        m._dropped = dict.fromkeys(m._quarantine, 0)
        # absent from snapshots taken before budget declines were remembered: such a
        # device is selected once more and declines again
        m._short = {d: float(v) for d, v in s.get("short", [])}
        m._model_round = s["model_round"]
        m._model_msg = m._sign_model(m._model_round)
        rs = s["round"]
        if rs is not None:
            plan = wire.decode(rs["plan"], wire.DOWN_KINDS)
            assert isinstance(plan, RoundPlan)
            server = _server_for(plan, identity=identity, registry=registry)
            log = [(op, bytes(b)) for op, b in rs["log"]]
            server.replay(log)  # deterministic, so the same state bit for bit
            if server.stage.value != rs["stage"]:
                raise SnapshotError(f"replaying the round's log ends in {server.stage.value}, "
                                    f"the snapshot says {rs['stage']}")
            m._round = _Round(
                plan=plan, server=server, stage=server.stage, deadline=rs["deadline"],
                expected=set(rs["expected"]), declined=set(rs["declined"]), log=log,
                outbox=[Publish(t, bytes(p), bool(k)) for t, p, k in rs["outbox"]],
                remaining={d: float(v) for d, v in rs.get("remaining", [])})
        m._restored = True
        return m
