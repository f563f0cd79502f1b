"""A device's part of one round up to its upload, pure of messages: plan in, decision out.

:func:`open_round` is what ``edge_sdk.session.DeviceSession`` does with a verified plan that
selects it, and what a simulator does for each cohort member (plan15 §3.3). In order:

1. refuse a round the ledger already holds a reservation for (the device took part before
   a restart: never train or upload twice), a ledger that cannot record a spend, a plan for
   another model version, a mechanism this device does not have, an empty local data set,
   a round whose noise the device finds short of the plan's promise (the mechanism's
   ``refusal``, e.g. device-dp with too few honest shares), or a round the budget
   cannot pay for: each is a :class:`Declined` with the reason the published
   ``wire.Decline`` carries (``already_committed``, ``ledger``, ``stale_model``,
   ``mechanism``, ``no_data``, ``noise``, ``budget``);
2. **reserve the round's spend in the ledger** (durable when it returns) *before*
   training: every later outcome (the upload, the ``diverged`` decline, silence) may
   depend on the noisy update, and each is then already counted;
3. only then ask for the round's rng and let the mechanism's device half train and encode
   (:meth:`edge_sdk.mechanisms.base.DeviceHalf.contribute`): a :class:`Prepared`, or, when
   the noisy update is not finite, the reservation committed and ``Declined("diverged")``.

The mechanism is the plan's ``mechanism``, looked up in
:data:`edge_sdk.mechanisms.MECHANISMS` (:func:`mechanism_round`); the aggregator decodes
the sum with the server half of the same lookup, so both ends read one plan the same way.

Randomness: the rng comes from ``round_rng(plan.round_id)``, called once, after the
reservation; the mechanism draws from it in its own fixed order (plan15 R8).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from edge_sdk import compress
from edge_sdk.csprng import RoundRng
from edge_sdk.errors import RemoteProtocolError
from edge_sdk.ledger import BudgetExhausted, LedgerError, Plan, Reservation
from edge_sdk.mechanisms import MECHANISMS, Contribution, Mechanism
from edge_sdk.secagg import RoundConfig
from edge_sdk.train import TrainingDiverged
from edge_sdk.wire import BufferOffer, RoundPlan

__all__ = [
    "Declined",
    "Held",
    "LedgerLike",
    "Prepared",
    "coordinates",
    "has_mechanism",
    "honest_members",
    "ledger_round",
    "mechanism_round",
    "offer_template",
    "open_buffered",
    "open_round",
    "train_ahead",
]

logger = logging.getLogger("edge_sdk.round")

# How each mechanism reads its round settings from a plan (name -> (plan, dim) -> settings),
# the argument of its class's device() and server(). A mechanism is usable only when it is
# both registered (MECHANISMS) and readable here; tests/test_round.py checks they agree.


class LedgerLike(Protocol):
    """What :func:`open_round` needs of a ledger: a durable ``edge_sdk.ledger.Ledger`` on a
    device, a ``Book`` in a simulator (which has no ``read_only``: it never refuses writes)."""

    budget: Any

    def reservations(self) -> tuple[Reservation, ...]: ...

    def would_exceed(self, plan: Plan) -> bool: ...

    def epsilon_if(self, plan: Plan) -> float: ...

    def device_epsilon_if(self, plan: Plan) -> float | None: ...

    def reserve(self, plan: Plan) -> Reservation: ...

    def commit(self, reservation: Reservation) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Declined:
    """The device does not take part: ``reason`` and ``detail`` as its ``wire.Decline``
    carries them. ``reservation``: set only for ``diverged``, the one reason given after
    training (the spend was reserved, and committed, before)."""

    reason: str
    detail: str
    reservation: Reservation | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """The device is in the round: its spend is reserved (durably, before training) and
    ``contribution.values`` are its input to the secure sum.

    Attributes:
        contribution: what the mechanism's device half produced.
        config: the round's secure-aggregation configuration (``RoundConfig.of_plan``).
        ledger_plan: the spend reserved; reservation: its ledger record (commit it once
            the aggregator shows it holds the upload).
        honest: r'', the honest cohort members the aggregate event counts.
    """

    contribution: Contribution
    config: RoundConfig
    ledger_plan: Plan
    reservation: Reservation
    honest: int


def has_mechanism(name: str) -> bool:
    """Whether this build can run mechanism ``name`` (registered and readable from a plan)."""
    return name in MECHANISMS


def mechanism_round(plan: RoundPlan, *, dim: int) -> tuple[Mechanism, Any]:
    """(The plan's mechanism, the round settings its ``device()``/``server()`` take) for a
    model of ``dim`` parameters.

    Raises:
        ValueError: the plan names a mechanism this build does not have
            (:func:`has_mechanism`), or its settings cannot go together (the mechanism
            says which).
    """
    if not has_mechanism(plan.mechanism):
        raise ValueError(f"mechanism {plan.mechanism!r} is not one of "
                       f"{sorted(MECHANISMS)}")
    mech = MECHANISMS[plan.mechanism]
    return mech(), mech.Round.from_plan(plan, dim=dim)


def coordinates(plan: RoundPlan, *, dim: int) -> np.ndarray | None:
    """The round's rand-k coordinate set (``compress.coordinate_set`` from the plan's
    public ``round_seed``), or None for a dense round: one whose mechanism's params have
    no ``sparsity`` or a sparsity of 1."""
    p = getattr(plan.params, "sparsity", 1.0)
    if p == 1.0:
        return None
    # k = kept_count(d, p), not the plan's length: a mechanism may pad what it sums
    # (device-dp rotates k values padded to a power of two)
    return compress.coordinate_set(plan.round_seed, dim, compress.kept_count(dim, p))


def honest_members(plan: RoundPlan, *, max_colluders: int) -> int:
    """r'' = min_survivors - max(the plan's max_colluders (the aggregator's word), the
    device's own ``max_colluders``), never below 1: the honest members whose noise the
    aggregate event may count."""
    return max(1, plan.min_survivors - max(plan.max_colluders, max_colluders))


def ledger_round(fleet: str, round_id: int) -> str:
    """The ledger's name for round ``round_id`` of ``fleet``."""
    return f"{fleet}/{round_id}"


def _budget_detail(ledger: LedgerLike, plan: Plan) -> str:
    """Why ``plan`` is over the budget, per unit with a limit (sample-level local, and the
    device-level aggregate one when set; None: a release with no device-level theorem)."""
    budget = ledger.budget
    local = ledger.epsilon_if(plan)
    out = f"sample-level local epsilon would reach {local:.4g} (budget {budget.epsilon:g})"
    limit = getattr(budget, "device_epsilon", None)
    if limit is not None:
        dev = ledger.device_epsilon_if(plan)
        out += (f"; device-level epsilon would reach "
                f"{'None (no device-level theorem)' if dev is None else f'{dev:.4g}'} "
                f"(budget {limit:g})")
    return out


def _ledger_plan(plan: RoundPlan, device: Any, key: str, m: int, honest: int) -> Plan:
    """The ledger's record of ``plan``'s spend under round name ``key``, for ``m`` local
    samples and ``honest`` honest shares (the device half's events)."""
    event, aggregate = device.events(m=m, honest=honest)
    return Plan(round_id=key, model_id=str(plan.model_version), event=event,
                aggregate_event=aggregate, cohort_size=plan.min_survivors,
                secagg_threshold=plan.threshold,
                device_event=device.device_event(honest=honest),
                colluders=plan.min_survivors - honest)


def _member(device: Any, plan: RoundPlan, data: Callable[[], tuple[np.ndarray, np.ndarray]],
            max_colluders: int) -> Declined | tuple[np.ndarray, np.ndarray, int]:
    """The local data and r'' honest members, or why the device stays out before anything
    is reserved (no data; too little noise for the plan's promise)."""
    x, y = data()
    if len(y) == 0:
        return Declined(reason="no_data", detail="the local data set is empty")
    honest = honest_members(plan, max_colluders=max_colluders)
    why = device.refusal(honest=honest)
    if why is not None:  # e.g. too few honest shares for the promised noise: nothing spent
        return Declined(reason="noise", detail=why)
    return x, y, honest


def _reserve(ledger: LedgerLike, ledger_plan: Plan) -> Declined | Reservation:
    """Check the budget, then reserve (durable when it returns): the reservation, or the
    decline ("budget"; "ledger" for a ledger that cannot say or cannot write)."""
    try:
        if ledger.would_exceed(ledger_plan):  # on whichever unit has a budget
            return Declined(reason="budget", detail=_budget_detail(ledger, ledger_plan))
    except (LedgerError, ValueError) as e:
        return Declined(reason="ledger", detail=str(e))
    try:
        return ledger.reserve(ledger_plan)
    except (BudgetExhausted, LedgerError) as e:
        # a full disk or read-only file system is not a spent budget: say which
        return Declined(reason="budget" if isinstance(e, BudgetExhausted) else "ledger",
                        detail=str(e))


def _diverged(ledger: LedgerLike, reservation: Reservation) -> Declined:
    """Training gave a non-finite update: the decline reveals a bit of it, and the spend,
    reserved before training, is committed. The detail names no value from the data."""
    try:
        ledger.commit(reservation)
    except LedgerError as e:  # the spend is counted either way; only the record suffers
        logger.error("cannot commit round %s: %s", reservation.plan.round_id, e)
    return Declined(reason="diverged", detail="local training produced a non-finite update",
                    reservation=reservation)


def open_round(
    plan: RoundPlan,
    *,
    fleet: str,
    ledger: LedgerLike,
    params: list[np.ndarray] | None,
    model_version: int,
    data: Callable[[], tuple[np.ndarray, np.ndarray]],
    engine: Any,
    dim: int,
    round_rng: RoundRng,
    max_colluders: int,
) -> Declined | Prepared:
    """Decide whether to take part in ``plan``'s round and, if so, reserve and contribute
    (order and reasons: see the module docstring).

    Args:
        plan: a verified plan whose cohort holds this device.
        fleet: the fleet (names the ledger's round, :func:`ledger_round`).
        ledger: the device's ledger (or a simulator's ``Book``).
        params, model_version: the global model the device holds (None, -1: none yet).
        data: returns the local training set (x, y); called once, after the cheap checks.
        engine: per-sample gradients of the model.
        dim: the model's parameter count.
        round_rng: round id -> the round's rng; called once, after the reservation.
        max_colluders: the device's own colluder assumption (:func:`honest_members`).

    Raises:
        RemoteProtocolError: the plan's mechanism or secure-aggregation settings cannot go
            together (a bad plan: nothing reserved, no decline; the caller rejects it).
    """
    key = ledger_round(fleet, plan.round_id)
    try:
        taken = any(res.plan.round_id == key for res in ledger.reservations())
    except LedgerError as e:  # a broken ledger: never train
        return Declined(reason="ledger", detail=str(e))
    read_only = getattr(ledger, "read_only", None)
    if read_only is not None:  # it could never record the spend: no training
        return Declined(reason="ledger", detail=read_only)
    if taken:
        # a reservation means the upload may have left before a restart: never twice
        return Declined(reason="already_committed",
                        detail=f"the ledger holds a reservation for {key}")
    if params is None or plan.model_version != model_version:
        return Declined(reason="stale_model", detail=f"holds model {model_version}, the "
                                                     f"plan trains {plan.model_version}")
    if not has_mechanism(plan.mechanism):
        return Declined(reason="mechanism", detail=f"this device has no mechanism "
                                                   f"{plan.mechanism!r}")
    try:
        mechanism, settings = mechanism_round(plan, dim=dim)
        config = RoundConfig.of_plan(plan)
    except ValueError as e:
        raise RemoteProtocolError(f"round {plan.round_id}'s plan: {e}") from None
    device = mechanism.device(settings)
    got = _member(device, plan, data, max_colluders)
    if isinstance(got, Declined):
        return got
    x, y, honest = got
    ledger_plan = _ledger_plan(plan, device, key, len(y), honest)
    # Reserved before training: from here on every outcome (upload, "diverged" decline,
    # silence) may depend on the noisy update, and each of them is then already counted.
    reservation = _reserve(ledger, ledger_plan)
    if isinstance(reservation, Declined):
        return reservation
    rng = round_rng(plan.round_id)
    try:
        contribution = device.contribute(params=params, data=(x, y), engine=engine,
                                         coords=coordinates(plan, dim=dim), honest=honest,
                                         rng=rng)
    except TrainingDiverged:
        return _diverged(ledger, reservation)
    return Prepared(contribution=contribution, config=config, ledger_plan=ledger_plan,
                    reservation=reservation, honest=honest)


# ------------------------------------------------------------------ buffered rounds (issue 19)
#
# FedBuff (Nguyen et al. 2022) with secure aggregation: a device trains *ahead* of any plan,
# under the spend of a round with the offer's settings, reserved before training as in
# open_round; a buffered round's plan then selects K devices that hold such an update, and
# each encodes its update weighted by its staleness (wire.BufferOffer.weight) with that
# round's noise and coordinates. One held update -> one reservation -> at most one encoding:
# the update is consumed by the first plan it is encoded for, whatever that round's fate.

_AHEAD_RNG = 1 << 62  # rng ids of training ahead: above any round id a fleet reaches


@dataclass(frozen=True, slots=True, kw_only=True)
class Held:
    """An update trained ahead under ``offer`` from model ``trained_version`` (the
    ``attempt``-th on that version: ledger round ``<fleet>/ahead/<version>.<attempt>``),
    waiting for a buffered round. Its spend is reserved (``reservation``, for
    ``ledger_plan``, the event of a round with the offer's settings); ``update`` is
    theta_tau - theta_0, float64."""

    offer: BufferOffer
    trained_version: int
    attempt: int
    update: np.ndarray
    loss: float
    m: int
    ledger_plan: Plan
    reservation: Reservation
    honest: int


def offer_template(offer: BufferOffer, *, model_version: int) -> RoundPlan:
    """The plan every buffered round of ``offer`` sends, with placeholders where a round's
    own values go (round id 1, cohort ``b0..``, zero seed and nonce): what the device reads
    the offer's events and mechanism settings from before any plan exists. Unsigned, never
    sent."""
    return RoundPlan(round_id=1, model_version=model_version,
                     cohort=tuple(sorted(f"b{i}" for i in range(offer.buffer_size))),
                     mechanism=offer.mechanism, params=offer.params,
                     round_seed=bytes(32), bits=offer.bits, length=offer.length,
                     nonce=bytes(32), degree=offer.degree, threshold=offer.threshold,
                     min_survivors=offer.min_survivors, max_colluders=offer.max_colluders,
                     stage_timeout=offer.stage_timeout, secagg=offer.secagg)


def _ahead_key(fleet: str, version: int, ledger: LedgerLike) -> tuple[str, int]:
    """(A ledger round name no reservation holds yet for training ahead on ``version``,
    ``<fleet>/ahead/<version>.<n>``; n): n counts earlier ones (a device may train on one
    version again after its update was spent in a round that failed)."""
    prefix = f"{fleet}/ahead/{version}."
    taken = {res.plan.round_id for res in ledger.reservations()}
    n = 0
    while f"{prefix}{n}" in taken:
        n += 1
    return f"{prefix}{n}", n


def train_ahead(
    offer: BufferOffer,
    *,
    fleet: str,
    ledger: LedgerLike,
    params: list[np.ndarray] | None,
    model_version: int,
    data: Callable[[], tuple[np.ndarray, np.ndarray]],
    engine: Any,
    dim: int,
    round_rng: RoundRng,
    max_colluders: int,
) -> Declined | Held:
    """Train an update ahead of any plan for buffered rounds under ``offer`` (verified).

    The checks and their order are :func:`open_round`'s, on :func:`offer_template`: a ledger
    that cannot record a spend, no model, a mechanism this device lacks or that cannot
    train ahead (only ``device-dp`` splits training from encoding), no data, too little
    noise, no budget: a :class:`Declined` (nothing reserved). Otherwise the spend of one
    round with the offer's settings is **reserved before training** under a fresh ledger
    name (``<fleet>/ahead/<version>.<n>``); a non-finite update commits it and declines
    ``diverged``.

    Raises:
        RemoteProtocolError: the offer's settings cannot go together.
    """
    read_only = getattr(ledger, "read_only", None)
    if read_only is not None:
        return Declined(reason="ledger", detail=read_only)
    if params is None:
        return Declined(reason="stale_model", detail="holds no model yet")
    if not has_mechanism(offer.mechanism):
        return Declined(reason="mechanism", detail=f"this device has no mechanism "
                                                   f"{offer.mechanism!r}")
    template = offer_template(offer, model_version=model_version)
    try:
        mechanism, settings = mechanism_round(template, dim=dim)
        RoundConfig.of_plan(template)
    except ValueError as e:
        raise RemoteProtocolError(f"offer {offer.round_id}'s settings: {e}") from None
    device = mechanism.device(settings)
    adaptive = bool(getattr(settings, "indicator_scale", 0.0))
    if not hasattr(device, "train") or offer.secagg != "secagg+" or adaptive:
        # (adaptive clipping's indicator would read a weighted norm: RoundPolicy refuses
        # it, and so does the device, before anything is reserved)
        return Declined(reason="mechanism", detail=f"{offer.mechanism!r} over "
                                                   f"{offer.secagg!r} (adaptive clipping: "
                                                   f"{adaptive}) cannot train ahead")
    got = _member(device, template, data, max_colluders)
    if isinstance(got, Declined):
        return got
    x, y, honest = got
    try:
        key, attempt = _ahead_key(fleet, model_version, ledger)
    except LedgerError as e:  # a broken ledger: never train
        return Declined(reason="ledger", detail=str(e))
    ledger_plan = _ledger_plan(template, device, key, len(y), honest)
    reservation = _reserve(ledger, ledger_plan)  # before training (see the module notes)
    if isinstance(reservation, Declined):
        return reservation
    rng = round_rng(_AHEAD_RNG + model_version)
    try:
        update, loss = device.train(params=params, data=(x, y), engine=engine, rng=rng)
    except TrainingDiverged:
        return _diverged(ledger, reservation)
    return Held(offer=offer, trained_version=model_version, attempt=attempt,
                update=update, loss=loss,
                m=len(y), ledger_plan=ledger_plan, reservation=reservation, honest=honest)


def open_buffered(plan: RoundPlan, held: Held, *, dim: int, round_rng: RoundRng,
                  max_colluders: int) -> Declined | Prepared:
    """Encode ``held`` into buffered round ``plan`` (verified, selecting this device).

    Declines, the held update unspent by this plan: ``stale_model`` when the plan's model
    is older than the update's or more than the offer's ``max_staleness`` versions newer;
    ``mechanism`` when the plan's privacy event (what the device reserved) is not the
    offer's, or its settings differ from the offer's. Otherwise the update, clipped and
    weighted by ``offer.weight(tau)``, is encoded with the round's rng (noise, rounding)
    and coordinates: a :class:`Prepared` whose reservation is the held one.

    Raises:
        RemoteProtocolError: the plan's settings cannot go together.
    """
    offer = held.offer
    tau = plan.model_version - held.trained_version
    if not 0 <= tau <= offer.max_staleness:
        return Declined(reason="stale_model",
                        detail=f"holds an update of model {held.trained_version}; round "
                               f"{plan.round_id} is at model {plan.model_version}, at most "
                               f"{offer.max_staleness} versions allowed")
    same = offer_template(offer, model_version=plan.model_version)
    fields = ("mechanism", "params", "bits", "length", "degree", "threshold",
              "min_survivors", "max_colluders", "stage_timeout", "secagg")
    differ = [f for f in fields if getattr(plan, f) != getattr(same, f)]
    if len(plan.cohort) != offer.buffer_size:
        differ.append("cohort size")
    if differ:
        return Declined(reason="mechanism", detail=f"round {plan.round_id}'s plan differs "
                                                   f"from offer {offer.round_id} in "
                                                   f"{', '.join(differ)}")
    try:
        mechanism, settings = mechanism_round(plan, dim=dim)
        config = RoundConfig.of_plan(plan)
    except ValueError as e:
        raise RemoteProtocolError(f"round {plan.round_id}'s plan: {e}") from None
    device = mechanism.device(settings)
    honest = honest_members(plan, max_colluders=max_colluders)
    now_plan = _ledger_plan(plan, device, held.ledger_plan.round_id, held.m, honest)
    if dataclasses.replace(now_plan, model_id=held.ledger_plan.model_id) != held.ledger_plan:
        return Declined(reason="mechanism", detail=f"round {plan.round_id}'s event is not "
                                                   f"the one reserved under offer "
                                                   f"{offer.round_id}")
    try:
        contribution = device.encode(held.update, m=held.m, loss=held.loss,
                                     coords=coordinates(plan, dim=dim), honest=honest,
                                     rng=round_rng(plan.round_id), weight=offer.weight(tau))
    except ValueError as e:  # settings the encoding refuses: a bad plan, nothing sent
        raise RemoteProtocolError(f"round {plan.round_id}'s plan: {e}") from None
    return Prepared(contribution=contribution, config=config, ledger_plan=held.ledger_plan,
                    reservation=held.reservation, honest=honest)
