"""The ledger's pure accounting: budgets, plans, reservations and the check-then-commit
state (:class:`Book`), with no storage, no clock and no I/O. :mod:`edge_sdk.ledger.store`
makes a :class:`Book` durable (the device's :class:`~edge_sdk.ledger.store.Ledger`); a
simulator may use a :class:`Book` alone.

Two guarantees, both epsilon in nats at a stated delta, both under ZERO-OUT adjacency
(``../shared/DESIGN.md``, privacy model; :mod:`edge_sdk.privacy.events`): the neighbour of
the device's data set replaces one record by a null record whose clipped gradient is 0
(Kairouz et al. 2021). Zero-out, because check-in reveals the exact data size m and the
remaining budget, which are the same in both zero-out neighbours but would make an
add/remove guarantee infinite. Every stored event carries its own adjacency and is
restated under zero-out soundly (substitution events unchanged; add/remove events of
mechanisms that ignore the null record unchanged), or the ledger refuses it.

* local: against anyone who sees this device's upload — the plan's event as released.
  The budget is enforced on this one (it needs no trust).
* aggregate: against whoever sees only the secure sum of the cohort — the plan's
  ``aggregate_event``, built by :func:`edge_sdk.privacy.aggregate.aggregate_event` where a
  theorem supports a smaller event than the local one (see its docstring: the released sum
  must be linear in the members' updates, every step divided by the public batch size,
  colluders excluded), and the local event everywhere else. The ledger stores it per entry
  and never derives it. Valid only under the secure-aggregation threshold assumption
  (fewer than ``secagg_threshold`` = t parties collude), the collusion assumption the plan
  states (at most min_survivors - r'' members collude), and a SEMI-HONEST aggregator: it
  follows the protocol (SecAgg's consistency round is not run, so an actively malicious
  aggregator could unmask a smaller set than a device believes; devices refuse unmask
  requests naming fewer than min_survivors). Entries written before the aggregate event was
  stored (their event column holds one event) are read with the local event as their
  aggregate event: conservative, never an under-count.

Composition commutes, so an accountant's answer depends on the events only through their
multiset; :class:`EpsilonCache` reuses answers per distinct multiset (plan15 R7). With the
default accountant a :class:`Book` also keeps the RDP composition of each view up to date
entry by entry (:class:`_RdpTally`), so a question costs one event's curve and one
conversion however long the history (issue 18: 10,000 entries answered in well under 50 ms).

Two units (issue 16). The figures above are SAMPLE-level: the record is one sample of the
device's data. A reservation may also carry a DEVICE-level event (``Plan.device_event``,
the record is the device: its whole data set replaced by a null one, its noise share still
in the sum), stated by the mechanisms that have a theorem for it (device-dp: KLS 2021
Thm 1 at D2 over the honest shares) and None by the others. The device-level aggregate
figure composes every reservation's device event; over a history where any reservation
has none it is None (no theorem covers those rounds), never a partial sum.
:meth:`Book.figures` gives the three figures (sample-level local, sample-level aggregate,
device-level aggregate) each with its unit, adjacency and assumptions as data
(:class:`Figure`, :class:`Assumptions`). The budget can be set on either unit
(:class:`Budget` ``epsilon``: sample-level local; ``device_epsilon``: device-level
aggregate); a plan is refused if it would take either set one over (a device budget and a
plan without a device-level event: refused, the figure would be None).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np

from edge_sdk.errors import EdgeError
from edge_sdk.privacy import (
    DEFAULT_ORDERS,
    Binomial,
    Composed,
    DistributedDiscreteGaussian,
    DistributedSkellam,
    Event,
    Gaussian,
    PldAccountant,
    PoissonSubsampledGaussian,
    RdpAccountant,
    SampledWithoutReplacementGaussian,
    SelfComposed,
    SelfSampled,
    rdp_to_epsilon,
    restate,
)

__all__ = [
    "ADJACENCY",
    "UNITS",
    "Assumptions",
    "Book",
    "Budget",
    "BudgetExhausted",
    "Entry",
    "EntryKind",
    "EpsilonCache",
    "EpsilonOf",
    "Figure",
    "LedgerCorrupted",
    "LedgerError",
    "Plan",
    "Reservation",
    "Spent",
    "entry_to_json",
    "epsilon_pld",
    "epsilon_rdp",
    "event_from_json",
    "event_to_json",
    "running_epsilon",
]

EntryKind: TypeAlias = Literal["reserve", "commit", "abort"]
#: An accountant as the ledger uses it: epsilon (nats) at ``delta`` of composing ``events``
#: under zero-out adjacency (:data:`ADJACENCY`). Must be an upper bound on the true epsilon;
#: may return ``inf``. Composition commutes, so it must depend on ``events`` only through
#: their multiset: the ledger reuses an answer for the same events counted the same
#: (:class:`EpsilonCache`).
EpsilonOf: TypeAlias = Callable[[Sequence[Event], float], float]

#: The adjacency every figure of the ledger is stated under (see the module docstring).
ADJACENCY = "zero_out"
#: The record each unit's neighbouring relation replaces (by a null one: zero-out).
UNITS = ("sample", "device")
# Entries written before events carried their adjacency: the relation each type was stated
# under then (shuffle rounds' Gaussian(z/2) was charged as substitution).
_LEGACY_ADJACENCY = {"Gaussian": "substitution", "PoissonSubsampledGaussian": "add_remove",
                     "SampledWithoutReplacementGaussian": "substitution"}
# Every kind of the privacy Event union. Kinds are only ever added (the discrete ones and
# SelfComposed in issue 15, F1; Binomial in G6; SelfSampled in issue 16), so the store's
# SCHEMA_VERSION stays 1:
# older ledgers read unchanged.
_EVENT_TYPES: dict[str, type] = {
    "Gaussian": Gaussian,
    "PoissonSubsampledGaussian": PoissonSubsampledGaussian,
    "SampledWithoutReplacementGaussian": SampledWithoutReplacementGaussian,
    "DistributedDiscreteGaussian": DistributedDiscreteGaussian,
    "DistributedSkellam": DistributedSkellam,
    "Binomial": Binomial,
    "SelfSampled": SelfSampled,
    "Composed": Composed,
    "SelfComposed": SelfComposed,
}


# ------------------------------------------------------------------------------ errors


class LedgerError(EdgeError):
    """Root of the ledger's errors (an :class:`edge_sdk.errors.EdgeError`)."""


class LedgerCorrupted(LedgerError):
    """The ledger is missing, unreadable, tampered with or truncated: the device must not train."""


class BudgetExhausted(LedgerError):
    """The planned release would take the device's local epsilon over its owner's budget."""


# ------------------------------------------------------------------------------- values


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_delta(delta: object) -> float:
    if not (_is_real(delta) and 0 < delta < 1):  # type: ignore[operator]
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}")
    return float(delta)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """The owner's budget: (epsilon, delta)-DP over the device's whole life, local view.

    Attributes:
        epsilon: the most SAMPLE-level local epsilon (nats) the device may ever spend, at
            ``delta``; > 0, finite.
        delta: the delta the budget is stated at, in (0, 1).
        device_epsilon: the most DEVICE-level aggregate epsilon (nats, at ``delta``) the
            device may ever spend, or None (the default) for no device-level limit; > 0,
            finite. When set, a plan without a device-level event is refused.
    """

    epsilon: float
    delta: float
    device_epsilon: float | None = None

    def __post_init__(self) -> None:
        e = self.epsilon
        if not (_is_real(e) and math.isfinite(e) and e > 0):
            raise ValueError(f"budget epsilon must be a finite number > 0, got {e!r}")
        _check_delta(self.delta)
        d = self.device_epsilon
        if d is not None and not (_is_real(d) and math.isfinite(d) and d > 0):
            raise ValueError(f"budget device_epsilon must be None or a finite number > 0, "
                             f"got {d!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A release the device is about to make (one local round's upload).

    Attributes:
        round_id: the aggregator's round identifier.
        model_id: the global model version the round trains from.
        event: the privacy event of the local round, as released in the upload
            (``LocalResult.event`` of :mod:`edge_sdk.train`).
        aggregate_event: the event against whoever sees only the secure sum, as built by
            :func:`edge_sdk.privacy.aggregate.aggregate_event`; None (the default) means
            ``event``: no claim beyond the local view. Stored as given, never derived.
        cohort_size: r', the fewest members whose updates the revealed sum contains (the
            aggregator's min_survivors), recorded for the record; the accounting uses
            ``aggregate_event`` only.
        secagg_threshold: t of the secure aggregation the upload goes through (fewer than t
            colluders learn nothing but the sum), or None for no secure aggregation; then
            ``aggregate_event`` must be the local event. At most ``cohort_size``.
        device_event: the DEVICE-level event against whoever sees only the secure sum (the
            record is the device; zero-out: its data replaced by a null data set, its noise
            share still in the sum), or None (the default): the mechanism has no theorem
            for one. Stored as given.
        colluders: the members the aggregate events assume may collude with the aggregator
            (max of the plan's and the device's assumption), for the record; None: not
            recorded (entries that predate it). In [0, cohort_size).
    """

    round_id: str
    model_id: str
    event: Event
    aggregate_event: Event | None = None
    cohort_size: int = 1
    secagg_threshold: int | None = None
    device_event: Event | None = None
    colluders: int | None = None

    def __post_init__(self) -> None:
        for name in ("round_id", "model_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        if not isinstance(self.event, tuple(_EVENT_TYPES.values())):
            raise ValueError(
                f"event must be one of {', '.join(_EVENT_TYPES)}, got {type(self.event).__name__}"
            )
        if self.aggregate_event is None:
            object.__setattr__(self, "aggregate_event", self.event)
        elif not isinstance(self.aggregate_event, tuple(_EVENT_TYPES.values())):
            raise ValueError(f"aggregate_event must be one of {', '.join(_EVENT_TYPES)}, got "
                             f"{type(self.aggregate_event).__name__}")
        if self.device_event is not None and not isinstance(self.device_event,
                                                              tuple(_EVENT_TYPES.values())):
            raise ValueError(f"device_event must be None or one of {', '.join(_EVENT_TYPES)}, "
                             f"got {type(self.device_event).__name__}")
        r, t = self.cohort_size, self.secagg_threshold
        if t is None and self.aggregate_event != self.event:
            raise ValueError("without secure aggregation (secagg_threshold=None) the aggregate "
                             "event must be the local event")
        if not (_is_int(r) and r >= 1):
            raise ValueError(f"cohort_size must be an integer >= 1, got {r!r}")
        if t is not None and not (_is_int(t) and 1 <= t <= r):
            raise ValueError(
                f"secagg_threshold must be None or an integer in [1, cohort_size={r}], got {t!r}"
            )
        c = self.colluders
        if c is not None and not (_is_int(c) and 0 <= c < r):
            raise ValueError(f"colluders must be None or an integer in [0, cohort_size={r}), "
                             f"got {c!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """A counted spend (durable, from a :class:`~edge_sdk.ledger.store.Ledger`); pass it to
    ``commit`` or ``abort`` of the ledger or :class:`Book` that made it.

    Attributes:
        seq: the reservation's entry number in the ledger.
        plan: what was reserved.
        hash: the reservation entry's chain hash (hex), so it cannot be confused with
            another ledger's reservation; from a :class:`Book` alone (no chain), the sha256
            of its seq and plan.
    """

    seq: int
    plan: Plan
    hash: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Spent:
    """What a ledger has spent, every reservation counted whether committed or not.

    Attributes:
        local_epsilon: epsilon (nats) at ``delta`` against anyone who saw the uploads.
        aggregate_epsilon: epsilon (nats) at ``delta`` against whoever saw only the secure
            sums, valid only under the threshold, collusion and semi-honest-aggregator
            assumptions (module docstring); equal to ``local_epsilon`` wherever no theorem
            supports a smaller figure.
        delta: the delta both are stated at.
        entries: how many reservations (releases) the figures count.
        adjacency: the neighbouring relation both are stated under (zero-out).
        device_epsilon: DEVICE-level aggregate epsilon (nats) at ``delta`` (zero-out of the
            device's whole data set, same assumptions as ``aggregate_epsilon``), or None
            when a reservation has no device-level event (no theorem); 0 with none.
    """

    local_epsilon: float
    aggregate_epsilon: float
    delta: float
    entries: int
    adjacency: str = ADJACENCY
    device_epsilon: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Assumptions:
    """What an aggregate figure rests on, over every reservation it counts (the weakest).

    Attributes:
        min_survivors: the fewest members whose uploads a sum contained (min over the
            reservations' ``cohort_size``), or None for the local view.
        secagg_threshold: the smallest t of the secure aggregations, or None (local view,
            or some release had no secure aggregation).
        colluders: the most members assumed to collude with the aggregator, or None
            (local view, or not recorded for some reservation).
        semi_honest_aggregator: whether the figure assumes the aggregator follows the
            protocol (unmasks no fewer than min_survivors).
    """

    min_survivors: int | None
    secagg_threshold: int | None
    colluders: int | None
    semi_honest_aggregator: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Figure:
    """One epsilon of the ledger with what it means.

    Attributes:
        unit: ``"sample"`` or ``"device"`` (:data:`UNITS`): the record of the relation.
        view: ``"local"`` (against anyone who sees the uploads) or ``"aggregate"``
            (against whoever sees only the secure sums).
        epsilon: nats at ``delta``; None when no theorem gives one (a device-level figure
            over a reservation without a device-level event).
        delta: the delta it is stated at.
        adjacency: the neighbouring relation (zero-out of one record of ``unit``).
        assumptions: what it rests on (:class:`Assumptions`).
    """

    unit: str
    view: str
    epsilon: float | None
    delta: float
    adjacency: str
    assumptions: Assumptions


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One verified ledger entry.

    Attributes:
        seq: 1, 2, ... without gaps.
        kind: ``"reserve"`` (a counted spend), ``"commit"`` (its upload left) or ``"abort"``
            (the device says it did not leave; nothing is refunded).
        reservation: for commit/abort, the ``seq`` of the reservation; None for reserve.
        round_id: the round the entry is about.
        model_id: the model version it trained from.
        time: wall time of the write, seconds since the epoch (the injected clock).
        event: the released mechanism (reserve only).
        aggregate_event: the mechanism as seen through the secure sum (reserve only; the
            local event for entries that predate it).
        cohort_size: r', the fewest survivors the sum contains (reserve only).
        secagg_threshold: t, or None without secure aggregation (reserve only).
        prev_hash: the previous entry's hash (hex); the metadata's hash for entry 1.
        hash: sha256(prev_hash || canonical row), hex.
        device_event: the device-level event (reserve only; None: none stated, or an entry
            that predates device-level events).
        colluders: the colluders the aggregate events assume (reserve only; None: not
            recorded).
    """

    seq: int
    kind: EntryKind
    reservation: int | None
    round_id: str
    model_id: str
    time: float
    event: Event | None
    aggregate_event: Event | None
    cohort_size: int | None
    secagg_threshold: int | None
    prev_hash: str
    hash: str
    device_event: Event | None = None
    colluders: int | None = None


# --------------------------------------------------------------------- event encoding


_FLOATS = "tuple[float, ...]"  # a field's declared type: stored as a JSON list of numbers


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def event_to_json(event: Event) -> dict[str, Any]:
    """The event as plain data, ``{"type": class name, **fields}``, nested for Composed
    (``events``: a list) and SelfComposed (``event``: an object, ``count``: an int).

    Numbers are normalised by the field's declared type (``float`` or ``int``; a list of
    floats for a ``tuple[float, ...]``, as :class:`~edge_sdk.privacy.Binomial`'s orders and
    moments), so the same mechanism always encodes to the same canonical JSON;
    ``adjacency`` is a string.

    Raises:
        ValueError: not a privacy event this module can store.
    """
    name = type(event).__name__
    if _EVENT_TYPES.get(name) is not type(event):
        raise ValueError(f"cannot store an event of type {name}; known: {', '.join(_EVENT_TYPES)}")
    if isinstance(event, Composed):
        return {"type": name, "events": [event_to_json(e) for e in event.events]}
    if isinstance(event, SelfComposed):
        return {"type": name, "event": event_to_json(event.event), "count": int(event.count)}
    if isinstance(event, SelfSampled):
        return {"type": name, "event": event_to_json(event.event),
                "sample_rate": float(event.sample_rate)}
    out: dict[str, Any] = {"type": name}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        out[f.name] = (str(value) if f.name == "adjacency"
                       else [float(x) for x in value] if f.type == _FLOATS
                       else float(value) if f.type == "float" else int(value))
    return out


def event_from_json(data: Any, *, legacy: bool = False) -> Event:
    """Inverse of :func:`event_to_json`: exact field set, JSON types checked, then the
    event's own validation.

    Args:
        data: the decoded JSON.
        legacy: the encoding of ledgers written before events carried their adjacency
            (no ``adjacency`` field; each type gets the relation it was stated under then).

    Raises:
        ValueError: unknown type, missing or extra fields, wrong types or invalid values.
    """
    if not isinstance(data, dict):
        raise ValueError(f"an event must be a JSON object, got {data!r}")
    cls = _EVENT_TYPES.get(data.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(
            f"unknown event type {data.get('type')!r}; known: {', '.join(_EVENT_TYPES)}")
    if cls is Composed:
        if set(data) != {"type", "events"} or not isinstance(data["events"], list):
            raise ValueError(f"a Composed event needs exactly a list 'events', got {data!r}")
        return Composed(events=tuple(event_from_json(e, legacy=legacy) for e in data["events"]))
    if legacy and cls.__name__ not in _LEGACY_ADJACENCY:
        raise ValueError(f"a legacy entry cannot hold a {cls.__name__} event (a kind added "
                         f"later); known then: Composed, {', '.join(_LEGACY_ADJACENCY)}")
    if cls is SelfComposed:
        if (set(data) != {"type", "event", "count"} or not isinstance(data["count"], int)
                or isinstance(data["count"], bool)):
            raise ValueError(
                f"a SelfComposed event needs exactly an object 'event' and an int 'count', "
                f"got {data!r}")
        return SelfComposed(event=event_from_json(data["event"]), count=data["count"])
    if cls is SelfSampled:
        rate = data.get("sample_rate")
        if (set(data) != {"type", "event", "sample_rate"} or not isinstance(rate, int | float)
                or isinstance(rate, bool)):
            raise ValueError(
                "a SelfSampled event needs exactly an object 'event' and a number "
                f"'sample_rate', got {data!r}")
        inner = event_from_json(data["event"])
        return SelfSampled(event=inner, sample_rate=rate)  # type: ignore[arg-type]
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    if legacy:
        del fields["adjacency"]
    if set(data) != {"type", *fields}:
        raise ValueError(f"{cls.__name__} needs exactly the fields {sorted(fields)}, got {data!r}")
    kwargs = {}
    for name, kind in fields.items():
        value = data[name]
        if name == "adjacency":
            ok = isinstance(value, str)
        elif kind == _FLOATS:
            ok = isinstance(value, list) and all(
                isinstance(x, int | float) and not isinstance(x, bool) for x in value)
            value = tuple(value) if ok else value
        elif kind == "float":
            ok = isinstance(value, int | float)
        else:
            ok = isinstance(value, int)
        if not ok or isinstance(value, bool):
            raise ValueError(f"{cls.__name__}.{name} must be a JSON {kind}, got {value!r}")
        kwargs[name] = value
    if legacy:
        kwargs["adjacency"] = _LEGACY_ADJACENCY[cls.__name__]
    return cls(**kwargs)  # type: ignore[no-any-return]


def _legacy_json(event: Event) -> dict[str, Any]:
    """:func:`event_to_json` without the adjacency fields (the old canonical form)."""
    out = event_to_json(event)
    if isinstance(event, Composed):
        out["events"] = [_legacy_json(e) for e in event.events]
    else:
        del out["adjacency"]
    return out


# ------------------------------------------------------------------------- accounting


def _leaves(event: Event) -> Iterator[Event]:
    if isinstance(event, Composed):
        for e in event.events:
            yield from _leaves(e)
    elif isinstance(event, SelfComposed):
        yield from _leaves(event.event)
    else:
        yield event


def _orders_for(events: Sequence[Event]) -> tuple[float, ...]:
    """The RDP orders to compose ``events`` at: the default ones, or, when Binomial events
    are among them, the orders every Binomial event states its moment at (their common
    ones, in increasing order).

    Raises:
        ValueError: Binomial events with no order in common.
    """
    common: set[float] | None = None
    for e in events:
        for leaf in _leaves(e):
            if isinstance(leaf, Binomial):
                common = set(leaf.orders) if common is None else common & set(leaf.orders)
    if common is None:
        return DEFAULT_ORDERS
    if not common:
        raise ValueError("the Binomial events state their restricted moments at no common "
                         "order: they cannot be composed")
    return tuple(sorted(common))


def epsilon_rdp(events: Sequence[Event], delta: float) -> float:
    """Epsilon (nats) at ``delta`` of composing ``events`` under zero-out adjacency, by the
    RDP accountant; the ledger's default accountant.

    Each event is restated under zero-out (:func:`edge_sdk.privacy.restate`); an event with
    no sound restatement raises ValueError. With :class:`~edge_sdk.privacy.Binomial` events
    (cpSGD) among them, everything is composed at the Binomial events' orders: the RDP
    curves and restricted moments add, their delta0s add, and epsilon is the restricted
    conversion at ``delta`` - sum delta0, inf when delta <= sum delta0
    (:class:`~edge_sdk.privacy.RdpAccountant`; the theorem is in
    :mod:`edge_sdk.privacy.rdp`).
    """
    events = list(events)
    if not events:
        return 0.0
    acc = RdpAccountant(orders=_orders_for(events), adjacency=ADJACENCY)
    for event, count in Counter(events).items():  # a device repeats few distinct events
        acc.compose(event, count)
    return acc.get_epsilon(delta)


def _has_binomial(event: Event) -> bool:
    return any(isinstance(leaf, Binomial) for leaf in _leaves(event))


class _RdpTally:
    """:func:`epsilon_rdp` of a growing list of events, kept composed as they come, with
    the same arithmetic to the last bit: epsilon_rdp sums count x curve over the distinct
    events in order of first appearance; the tally keeps those terms' running (prefix)
    sums, so a new event costs one curve (memoised by the accountant) and one addition, a
    repeated one recomputes the prefix sums from its row on (one numpy ``cumsum``,
    sequential like epsilon_rdp's loop), and :meth:`epsilon` one conversion: a question
    costs the same for 10 entries as for 10,000 (issue 18).

    Binomial events (cpSGD baselines only: their restricted moments change the orders and
    the conversion) and any event the accountant refuses make the tally hand every later
    question to :func:`epsilon_rdp` with the full list, which answers or raises as it
    always did.
    """

    __slots__ = ("_broken", "_counts", "_curves", "_index", "_orders", "_prefix", "_size",
                 "_valid")

    def __init__(self) -> None:
        self._orders = np.asarray(DEFAULT_ORDERS, dtype=np.float64)
        self._index: dict[Event, int] = {}  # distinct event -> row, first appearance first
        # two rows to start, doubled as needed: a simulated fleet holds three tallies per
        # device, and most devices compose one or two distinct events
        self._counts = np.zeros(2)
        self._curves = np.zeros((2, self._orders.size))  # one event's RDP curve per row
        self._prefix = np.zeros_like(self._curves)  # sum of count x curve over rows <= i
        self._size = 0  # rows in use
        self._valid = 0  # prefix rows up to date
        self._broken = False

    def _curve(self, event: Event) -> np.ndarray:
        # 0 + 1 x curve: the increment exactly, through the accountant's own validation
        return RdpAccountant(self._orders, adjacency=ADJACENCY).compose(event).rdp

    def add(self, event: Event) -> None:
        if self._broken:
            return
        row = self._index.get(event)
        if row is not None:
            self._counts[row] += 1
            self._valid = min(self._valid, row)
            return
        if _has_binomial(event):  # restricted moments: epsilon_rdp's general path
            self._broken = True
            return
        try:
            curve = self._curve(event)
        except ValueError:  # UnsupportedEventError is one: epsilon_rdp will say so
            self._broken = True
            return
        if self._size == self._counts.size:  # grow by doubling
            grow = self._counts.size
            self._counts = np.concatenate([self._counts, np.zeros(grow)])
            self._curves = np.vstack([self._curves, np.zeros_like(self._curves)])
            self._prefix = np.vstack([self._prefix, np.zeros_like(self._prefix)])
        row = self._size
        self._index[event] = row
        self._counts[row], self._curves[row] = 1.0, curve
        self._size += 1

    def _sum(self, start: int, stop: int, bump: int | None = None) -> np.ndarray:
        """The prefix sums of rows [start, stop) (from the valid row start - 1), with one
        more of row ``bump``; sequential, as epsilon_rdp composes."""
        counts = self._counts[start:stop].copy()
        if bump is not None:
            counts[bump - start] += 1
        terms = counts[:, None] * self._curves[start:stop]
        if start:
            terms[0] = self._prefix[start - 1] + terms[0]
        return np.cumsum(terms, axis=0)

    def epsilon(self, delta: float, extra: Event | None,
                events: Callable[[], list[Event]]) -> float:
        """Epsilon (nats) at ``delta`` of the events added and ``extra`` (None: none);
        ``events()`` lists them all, for the general path."""
        if self._broken or (extra is not None and _has_binomial(extra)):
            return epsilon_rdp(events(), delta)
        if self._valid < self._size:
            self._prefix[self._valid:self._size] = self._sum(self._valid, self._size)
            self._valid = self._size
        total = self._prefix[self._size - 1] if self._size else np.zeros_like(self._orders)
        if extra is not None:
            row = self._index.get(extra)
            if row is None:
                total = total + self._curve(extra)  # a new event: appended, count 1
            else:
                total = self._sum(row, self._size, bump=row)[-1]
        return rdp_to_epsilon(total, self._orders, delta)[0]


def epsilon_pld(events: Sequence[Event], delta: float) -> float:
    """Epsilon (nats) at ``delta`` under zero-out adjacency, by the PLD accountant where it
    applies (no sampling without replacement, no discrete or Binomial events: those the PLD
    accountant refuses, and the RDP answer alone is returned), never above the RDP answer
    (both are upper bounds, so their minimum is one)."""
    events = list(events)
    rdp = epsilon_rdp(events, delta)
    acc = PldAccountant(adjacency=ADJACENCY)
    # No PLD for sampling without replacement or the discrete events: RDP alone then.
    if not events or any(isinstance(leaf, SampledWithoutReplacementGaussian)
                         or not acc.supports(leaf) for e in events for leaf in _leaves(e)):
        return rdp
    for event, count in Counter(events).items():
        acc.compose(restate(event, ADJACENCY), count)
    return min(acc.get_epsilon(delta), rdp)


def _checked_epsilon(value: object, who: str) -> float:
    if not _is_real(value) or math.isnan(value) or value < 0:  # type: ignore[arg-type,operator]
        raise LedgerError(f"accountant {who} returned {value!r}; expected a number >= 0 or inf")
    return float(value)  # type: ignore[arg-type]


def _fmt(eps: float | None) -> str:
    return "None" if eps is None else f"{eps:.6g}"


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def running_epsilon(
    plans: Sequence[Plan], delta: float, accountant: EpsilonOf = epsilon_rdp
) -> list[tuple[float, float]]:
    """(local, aggregate) epsilon (nats) at ``delta`` after each of ``plans`` in turn."""
    delta = _check_delta(delta)
    out = []
    for k in range(1, len(plans) + 1):
        local = accountant([p.event for p in plans[:k]], delta)
        agg = accountant([p.aggregate_event for p in plans[:k]], delta)
        out.append((_checked_epsilon(local, _name(accountant)),
                    _checked_epsilon(agg, _name(accountant))))
    return out


def entry_to_json(entry: Entry) -> dict[str, Any]:
    """An entry as plain JSON-able data (the event through :func:`event_to_json`)."""
    out = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    out["event"] = None if entry.event is None else event_to_json(entry.event)
    out["aggregate_event"] = (None if entry.aggregate_event is None
                              else event_to_json(entry.aggregate_event))
    out["device_event"] = (None if entry.device_event is None
                           else event_to_json(entry.device_event))
    return out


# ------------------------------------------------------------------ the book (state)


class EpsilonCache:
    """Accountants' answers, memoised per accountant, distinct event multiset and delta.

    The key is the events with their counts in order of first appearance
    (``Counter(events).items()``): exactly what :func:`epsilon_rdp` and :func:`epsilon_pld`
    compose, so for them a cached answer is bit-identical to a fresh one. For any other
    :data:`EpsilonOf` the reuse is sound because composition commutes (it must depend on its
    events only through their multiset). Events equal under ``==`` are one key, as they are
    one entry of the ``Counter`` the accountants compose. Only valid answers (a number >= 0
    or inf) are kept.

    One cache may serve many books (a simulation's devices repeat each other's histories); a
    device's ledger has its own, where it saves the repeated evaluations of a round's budget
    check, reservation and check-in. Bounded: past ``max_entries`` the least recently used
    answer goes; ``max_entries=0`` keeps nothing (every query asks the accountant).

    Attributes:
        max_entries: the most answers kept.
        hits: queries answered from the cache.
        misses: queries the accountant answered.
    """

    __slots__ = ("_memo", "hits", "max_entries", "misses")

    def __init__(self, *, max_entries: int = 4096) -> None:
        if not (_is_int(max_entries) and max_entries >= 0):
            raise ValueError(f"max_entries must be an integer >= 0, got {max_entries!r}")
        self.max_entries = int(max_entries)
        self.hits = 0
        self.misses = 0
        # key -> (accountant, epsilon); the accountant is kept so that its id() in the key
        # cannot be reused by another function while the answer is held
        self._memo: OrderedDict[tuple[Any, ...], tuple[EpsilonOf, float]] = OrderedDict()

    def epsilon(self, accountant: EpsilonOf, counts: Counter[Event], delta: float,
                events: Callable[[], list[Event]],
                compute: Callable[[], float] | None = None) -> float:
        """``accountant(events(), delta)``, checked, or the answer already given for the same
        ``counts`` (the multiset of ``events()``, in order of first appearance). ``compute``,
        when given, answers the same question faster (a :class:`Book`'s running
        composition for :func:`epsilon_rdp`) and is asked instead of ``accountant``.

        Raises:
            LedgerError: the accountant returned NaN, a negative number or a non-number.
        """
        key = (id(accountant), tuple(counts.items()), delta)
        held = self._memo.get(key)
        if held is not None and held[0] is accountant:
            self._memo.move_to_end(key)
            self.hits += 1
            return held[1]
        self.misses += 1
        value = _checked_epsilon(accountant(events(), delta) if compute is None else compute(),
                                 _name(accountant))
        if self.max_entries:
            self._memo[key] = (accountant, value)
            if len(self._memo) > self.max_entries:
                self._memo.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._memo)

    def __repr__(self) -> str:
        return (f"EpsilonCache({len(self._memo)}/{self.max_entries} answers, "
                f"hits={self.hits}, misses={self.misses})")


class Book:
    """The check-then-commit state of a privacy ledger, in memory: every reservation, which
    were committed or aborted, and the budget check. Pure: no storage, no clock.

    Spending is two-phase and never refunds: a reservation counts from the moment it is
    added, whether later committed, aborted or neither. :meth:`reserve` checks the budget
    and adds; :meth:`commit` and :meth:`abort` only record what became of a reservation.
    :class:`~edge_sdk.ledger.store.Ledger` is a Book made durable: it checks with
    :meth:`check`, writes the entry, and only then :meth:`add`\\s (or :meth:`close`\\s) it,
    so the Book holds exactly what the file holds.

    ``budget=None`` means no limit. It exists for simulating non-private baselines (their
    epsilon is inf; plan15 R5) and nowhere else: a device's Ledger always has a finite
    :class:`Budget` (its constructor refuses anything else).

    Entries are numbered as in the ledger file: each reservation, commit and abort is one.

    Args:
        budget: the owner's budget, or None (simulation only) for no limit.
        delta: the delta checks and reports are stated at without a budget (required then);
            with a budget it must be None (the budget's delta).
        accountant: ``epsilon_of(events, delta) -> epsilon``; default :func:`epsilon_rdp`.
        cache: where answers are memoised; None gives the book its own
            :class:`EpsilonCache`. Share one between books to reuse answers across them.
    """

    __slots__ = ("_aggregate", "_cache", "_closed", "_count", "_device", "_local",
                 "_no_device", "_reservations", "_tallies", "accountant", "budget", "delta")

    def __init__(self, *, budget: Budget | None, delta: float | None = None,
                 accountant: EpsilonOf = epsilon_rdp, cache: EpsilonCache | None = None) -> None:
        if budget is not None and not isinstance(budget, Budget):
            raise ValueError(f"budget must be a Budget or None (no limit), got {budget!r}")
        if budget is not None and delta is not None:
            raise ValueError(f"with a budget, reports are at its delta={budget.delta:g}; "
                             f"got delta={delta!r} too")
        if budget is None and delta is None:
            raise ValueError("a book without a budget needs the delta it reports at")
        if not callable(accountant):
            raise ValueError(f"accountant must be a callable, got {accountant!r}")
        if cache is not None and not isinstance(cache, EpsilonCache):
            raise ValueError(f"cache must be an EpsilonCache or None, got {cache!r}")
        self.budget = budget
        self.delta = budget.delta if budget is not None else _check_delta(delta)
        self.accountant = accountant
        self._cache = EpsilonCache() if cache is None else cache
        self._reservations: dict[int, Reservation] = {}
        self._closed: dict[int, EntryKind] = {}  # reservation seq -> "commit" | "abort"
        self._count = 0  # entries so far (reservations, commits, aborts)
        # every reservation's local and aggregate events, counted in order of first
        # appearance: the cache key, kept as entries come so a check costs O(distinct)
        self._local: Counter[Event] = Counter()
        self._aggregate: Counter[Event] = Counter()
        self._device: Counter[Event] = Counter()  # the device-level events present
        self._no_device = 0  # reservations without one: the device figure is then None
        # the default accountant's composition of each view, kept up to date (_RdpTally)
        self._tallies: dict[str, _RdpTally] | None = (
            {v: _RdpTally() for v in ("local", "aggregate", "device")}
            if accountant is epsilon_rdp else None)

    # ------------------------------------------------------------------------ epsilon

    def _device_epsilon(self, delta: float, extra: Plan | None = None) -> float | None:
        """Device-level aggregate epsilon (nats) at ``delta`` (after ``extra``), or None
        when some reservation (or ``extra``) has no device-level event."""
        if self._no_device or (extra is not None and extra.device_event is None):
            return None
        counts = self._device
        if extra is not None:
            counts = counts.copy()
            counts[extra.device_event] += 1
        if not counts:
            return 0.0

        def events() -> list[Event]:
            out = [r.plan.device_event for r in self._reservations.values()]
            return [e for e in (out if extra is None else [*out, extra.device_event])
                    if e is not None]

        return self._ask("device", counts, delta,
                         None if extra is None else extra.device_event, events)

    def _ask(self, view: str, counts: Counter[Event], delta: float, extra: Event | None,
             events: Callable[[], list[Event]]) -> float:
        tally = None if self._tallies is None else self._tallies[view]
        return self._cache.epsilon(
            self.accountant, counts, delta, events,
            None if tally is None else lambda: tally.epsilon(delta, extra, events))

    def _epsilon(self, view: Literal["local", "aggregate"], delta: float,
                 extra: Event | None = None) -> float:
        counts = self._local if view == "local" else self._aggregate
        if extra is not None:
            counts = counts.copy()  # keeps the order; extra goes last, as in the list
            counts[extra] += 1
        if not counts:
            return 0.0

        def events() -> list[Event]:
            out = [getattr(r.plan, "event" if view == "local" else "aggregate_event")
                   for r in self._reservations.values()]
            return out if extra is None else [*out, extra]

        return self._ask(view, counts, delta, extra, events)

    def epsilon_if(self, plan: Plan) -> float:
        """Local epsilon (nats) at :attr:`delta` after ``plan``, on top of every reservation
        so far. Changes nothing."""
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a Plan, got {plan!r}")
        return self._epsilon("local", self.delta, plan.event)

    def device_epsilon_if(self, plan: Plan) -> float | None:
        """Device-level aggregate epsilon (nats) at :attr:`delta` after ``plan``, on top of
        every reservation so far, or None (a reservation or the plan has no device-level
        event). Changes nothing."""
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a Plan, got {plan!r}")
        return self._device_epsilon(self.delta, plan)

    def _over_device(self, plan: Plan) -> bool:
        """Whether ``plan`` would take the device-level figure over a set device budget
        (None, no theorem, counts as over)."""
        limit = None if self.budget is None else self.budget.device_epsilon
        if limit is None:
            return False
        after = self._device_epsilon(self.delta, plan)
        return after is None or not after <= limit

    def would_exceed(self, plan: Plan) -> bool:
        """Whether reserving ``plan`` would take local epsilon over the budget, or the
        device-level epsilon over the device budget when one is set (an answer above the
        budget, inf, or a device-level None is True). Changes nothing. Without a budget:
        False, and the accountant is not asked."""
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a Plan, got {plan!r}")
        if self.budget is None:
            return False
        return not self.epsilon_if(plan) <= self.budget.epsilon or self._over_device(plan)

    def check(self, plan: Plan) -> None:
        """Refuse ``plan`` if it would take local epsilon over the budget (NaN-free answers
        above it, or inf). Changes nothing; without a budget, refuses nothing.

        Raises:
            BudgetExhausted: naming the epsilon already spent, the plan's own epsilon and
                the budget.
            LedgerError: the accountant returned NaN, a negative number or a non-number.
            ValueError: not a Plan, or the accountant cannot compose the plan's event with
                the history.
        """
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a Plan, got {plan!r}")
        if self.budget is None:  # simulation only: nothing to exceed, nothing to ask
            return
        delta, limit = self.delta, self.budget.epsilon
        after = self._epsilon("local", delta, plan.event)
        if after <= limit:
            if self._over_device(plan):
                now, then = self._device_epsilon(delta), self._device_epsilon(delta, plan)
                raise BudgetExhausted(
                    f"round {plan.round_id!r} refused: device-level eps spent "
                    f"{_fmt(now)}, after this plan {_fmt(then)} > device budget eps="
                    f"{self.budget.device_epsilon:g} (device-level aggregate, at "
                    f"delta={delta:g}; None: a release with no device-level theorem)")
            return
        spent = self._epsilon("local", delta)
        alone = self._cache.epsilon(self.accountant, Counter([plan.event]), delta,
                                    lambda: [plan.event])
        raise BudgetExhausted(
            f"round {plan.round_id!r} refused: spent eps={spent:.6g}, this plan alone "
            f"eps={alone:.6g}, together eps={after:.6g} > budget eps={limit:g} "
            f"(local, at delta={delta:g})")

    # ------------------------------------------------------------------------ entries

    def add(self, reservation: Reservation) -> Reservation:
        """Count ``reservation`` without checking the budget: for history already recorded
        (the store adds each verified entry). Its seq must be the next entry's."""
        if not isinstance(reservation, Reservation):
            raise ValueError(f"reservation must be a Reservation, got {reservation!r}")
        if reservation.seq != self._count + 1:
            raise ValueError(f"reservation seq must be the next entry's, {self._count + 1}, "
                             f"got {reservation.seq!r}")
        plan = reservation.plan
        assert plan.aggregate_event is not None
        self._reservations[reservation.seq] = reservation
        self._local[plan.event] += 1
        self._aggregate[plan.aggregate_event] += 1
        if plan.device_event is None:
            self._no_device += 1
        else:
            self._device[plan.device_event] += 1
        if self._tallies is not None:
            self._tallies["local"].add(plan.event)
            self._tallies["aggregate"].add(plan.aggregate_event)
            if plan.device_event is not None:
                self._tallies["device"].add(plan.device_event)
        self._count += 1
        return reservation

    def close(self, seq: int, kind: Literal["commit", "abort"]) -> None:
        """Record, as the next entry, that reservation ``seq`` was committed or aborted
        (for history already recorded; :meth:`commit` and :meth:`abort` check more)."""
        if kind not in ("commit", "abort"):
            raise ValueError(f"kind must be 'commit' or 'abort', got {kind!r}")
        if seq not in self._reservations:
            raise ValueError(f"{kind} of unknown reservation {seq!r}")
        if seq in self._closed:
            raise ValueError(f"reservation {seq} closed twice")
        self._closed[seq] = kind
        self._count += 1

    def reserve(self, plan: Plan) -> Reservation:
        """Check the budget and count ``plan`` (in memory only: durable storage is the
        store's :meth:`~edge_sdk.ledger.store.Ledger.reserve`).

        Raises:
            BudgetExhausted: the plan would exceed the budget; nothing is counted.
            LedgerError, ValueError: as :meth:`check`.
        """
        self.check(plan)
        seq = self._count + 1
        assert plan.aggregate_event is not None
        digest = hashlib.sha256(_canonical({
            "seq": seq, "round_id": plan.round_id, "model_id": plan.model_id,
            "local": event_to_json(plan.event), "aggregate": event_to_json(plan.aggregate_event),
            "cohort_size": int(plan.cohort_size),
            "secagg_threshold": (None if plan.secagg_threshold is None
                                 else int(plan.secagg_threshold)),
            **({} if plan.device_event is None and plan.colluders is None else {
                "device": (None if plan.device_event is None
                           else event_to_json(plan.device_event)),
                "colluders": plan.colluders}),
        })).hexdigest()
        return self.add(Reservation(seq=seq, plan=plan, hash=digest))

    def commit(self, reservation: Reservation) -> None:
        """Record that the reservation's release left. Changes no figure; twice is a no-op.

        Raises:
            LedgerError: the reservation is not this book's, or was aborted.
        """
        self._finish(reservation, "commit")

    def abort(self, reservation: Reservation) -> None:
        """Record that the reservation's release did not leave. Refunds nothing; twice is
        a no-op.

        Raises:
            LedgerError: the reservation is not this book's, or was committed.
        """
        self._finish(reservation, "abort")

    def _finish(self, reservation: Reservation, kind: Literal["commit", "abort"]) -> None:
        if not isinstance(reservation, Reservation):
            raise ValueError(f"reservation must be a Reservation, got {reservation!r}")
        if self._reservations.get(reservation.seq) != reservation:
            raise LedgerError(f"reservation {reservation.seq} ({reservation.plan.round_id!r}) "
                              "is not in this book")
        done = self._closed.get(reservation.seq)
        if done == kind:
            return
        if done is not None:
            raise LedgerError(f"cannot {kind} reservation {reservation.seq}: it was already "
                              f"recorded as {done}")
        self.close(reservation.seq, kind)

    # ------------------------------------------------------------------------ reports

    def spent(self, delta: float | None = None) -> Spent:
        """Local and aggregate epsilon (nats) at ``delta`` (default :attr:`delta`), every
        reservation counted whether committed, aborted or neither: never an under-count."""
        delta = self.delta if delta is None else _check_delta(delta)
        if not self._reservations:
            return Spent(local_epsilon=0.0, aggregate_epsilon=0.0, delta=delta, entries=0,
                         device_epsilon=0.0)
        return Spent(local_epsilon=self._epsilon("local", delta),
                     aggregate_epsilon=self._epsilon("aggregate", delta),
                     delta=delta, entries=len(self._reservations),
                     device_epsilon=self._device_epsilon(delta))

    def assumptions(self) -> Assumptions:
        """What the aggregate figures rest on, the weakest over every reservation."""
        plans = [r.plan for r in self._reservations.values()]
        thresholds = [p.secagg_threshold for p in plans]
        colluders = [p.colluders for p in plans]
        return Assumptions(
            min_survivors=min((p.cohort_size for p in plans), default=None),
            secagg_threshold=(None if not plans or None in thresholds
                              else min(t for t in thresholds if t is not None)),
            colluders=(None if not plans or None in colluders
                       else max(c for c in colluders if c is not None)),
            semi_honest_aggregator=True)

    def figures(self, delta: float | None = None) -> tuple[Figure, Figure, Figure]:
        """(sample-level local, sample-level aggregate, device-level aggregate) at
        ``delta`` (default :attr:`delta`), every reservation counted, each with its unit,
        adjacency (zero-out of one record of the unit) and assumptions."""
        s = self.spent(delta)
        agg = self.assumptions()
        local = Assumptions(min_survivors=None, secagg_threshold=None, colluders=None,
                            semi_honest_aggregator=False)
        return (Figure(unit="sample", view="local", epsilon=s.local_epsilon, delta=s.delta,
                       adjacency=ADJACENCY, assumptions=local),
                Figure(unit="sample", view="aggregate", epsilon=s.aggregate_epsilon,
                       delta=s.delta, adjacency=ADJACENCY, assumptions=agg),
                Figure(unit="device", view="aggregate", epsilon=s.device_epsilon,
                       delta=s.delta, adjacency=ADJACENCY, assumptions=agg))

    def remaining(self) -> float:
        """Local epsilon (nats) left in the budget at its delta (>= 0); inf without one."""
        if self.budget is None:
            return math.inf
        return max(0.0, self.budget.epsilon - self.spent().local_epsilon)

    def reservations(self) -> tuple[Reservation, ...]:
        """Every reservation, oldest first, whatever became of it."""
        return tuple(self._reservations.values())

    def pending(self) -> tuple[Reservation, ...]:
        """Reservations neither committed nor aborted. They count as spent all the same."""
        return tuple(r for s, r in self._reservations.items() if s not in self._closed)

    def reservation(self, seq: int) -> Reservation | None:
        """The reservation recorded as entry ``seq``, or None."""
        return self._reservations.get(seq)

    def closed(self, seq: int) -> EntryKind | None:
        """What became of reservation ``seq``: ``"commit"``, ``"abort"``, or None (pending
        or unknown)."""
        return self._closed.get(seq)

    def __len__(self) -> int:
        """Entries so far: reservations, commits and aborts."""
        return self._count

    def __repr__(self) -> str:
        limit = "no budget" if self.budget is None else f"budget eps={self.budget.epsilon:g}"
        return (f"Book({limit}, delta={self.delta:g}, {len(self._reservations)} reservations, "
                f"{len(self.pending())} pending)")
