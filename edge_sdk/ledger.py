"""The device's privacy ledger: a durable, append-only, hash-chained record of every release,
and the budget check that runs before anything leaves the device.

Check, persist, then release — never another order::

    with Ledger.open("ledger.db", create=False) as ledger:   # verifies the whole file
        res = ledger.reserve(plan)   # BudgetExhausted, or durable on disk when it returns
        transport.publish(upload)    # only now may the upload leave
        ledger.commit(res)           # bookkeeping: the spend already counted

Spending is two-phase and never refunds. A reservation counts as spent from the moment
:meth:`Ledger.reserve` returns, whether it is later committed (the upload left), aborted (the
device says it did not), or neither (the device died in between and cannot know).
``abort`` exists to keep the record honest, not to give budget back: a device that crashed
after training may have leaked through side channels, and the ledger cannot tell an
upload that never left from one whose acknowledgement was lost.

Storage: sqlite3 with ``journal_mode=WAL`` and ``synchronous=FULL`` (a transaction that
returned is on disk), one write transaction per entry, and a ``TRUNCATE`` checkpoint after
each so that at rest everything lives in the main file and the WAL is empty. Each entry
stores the mechanism's parameters as canonical JSON (type name and fields, never only an
epsilon), so any accountant, including ones written later, can recompute the spend.

A full disk, or a file system turned read-only under an open ledger, fails the write
transaction: sqlite rolls it back and :meth:`Ledger.reserve` raises :class:`LedgerError`
(nothing recorded, nothing may leave). A ledger on a file system mounted read-only opens
read-only (:attr:`Ledger.read_only`): it verifies and reports, and refuses every write.

Integrity: ``hash = sha256(prev_hash || canonical_json(row))`` over every column but the
hash, the first ``prev_hash`` being the hash of the ledger's metadata (device, budget,
schema cookie). Triggers refuse UPDATE and DELETE. Opening verifies, and fails closed with
:class:`LedgerCorrupted`: the sqlite integrity check, the exact schema, the metadata, the
chain, and the file byte by byte — every byte of the main file is either checked by sqlite's
structure check, covered by a hash, a fixed header value, or unused space, which
``secure_delete`` keeps zero. Two exceptions hold no ledger data and are not checked: the
four header bytes naming the version of the last SQLite library to write the file (only
range-checked), and the unused space of interior b-tree pages, where SQLite leaves stale
cell pointers after splitting one (past about 9,000 entries). What no local check
can see: the tail cut off by someone who rewrites the file consistently, or the whole file
swapped for an older copy; anchor :meth:`Ledger.head` elsewhere (the aggregator's receipt).

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

Errors (one root)::

    LedgerError              a write failed, a reservation is unknown, arguments disagree
                             with the stored ledger
     +-- LedgerCorrupted     missing, unreadable, tampered or truncated: do not train
     +-- BudgetExhausted     the plan would take local epsilon over the owner's budget

sqlite3 exceptions are translated at this module's boundary and never escape it. Bad
arguments raise ``ValueError`` naming the value and the expectation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import numbers
import os
import sqlite3
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

from edge_sdk.errors import EdgeError
from edge_sdk.privacy import (
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
    restate,
)

__all__ = [
    "Budget",
    "BudgetExhausted",
    "Entry",
    "EpsilonOf",
    "Ledger",
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
#: in order, under zero-out adjacency (:data:`ADJACENCY`). Must be an upper bound on the true
#: epsilon; may return ``inf``.
EpsilonOf: TypeAlias = Callable[[Sequence[Event], float], float]

FORMAT = "fedge-ledger"
SCHEMA_VERSION = 1
APPLICATION_ID = int.from_bytes(b"fLdg", "big")  # sqlite header bytes 68-71
_BUSY_TIMEOUT_S = 10.0
#: The adjacency every figure of the ledger is stated under (see the module docstring).
ADJACENCY = "zero_out"
# Entries written before events carried their adjacency: the relation each type was stated
# under then (shuffle rounds' Gaussian(z/2) was charged as substitution).
_LEGACY_ADJACENCY = {"Gaussian": "substitution", "PoissonSubsampledGaussian": "add_remove",
                     "SampledWithoutReplacementGaussian": "substitution"}
# Every kind of the privacy Event union. Kinds are only ever added (the discrete ones and
# SelfComposed in issue 15, F1), so SCHEMA_VERSION stays 1: older ledgers read unchanged.
_EVENT_TYPES: dict[str, type] = {
    "Gaussian": Gaussian,
    "PoissonSubsampledGaussian": PoissonSubsampledGaussian,
    "SampledWithoutReplacementGaussian": SampledWithoutReplacementGaussian,
    "DistributedDiscreteGaussian": DistributedDiscreteGaussian,
    "DistributedSkellam": DistributedSkellam,
    "Composed": Composed,
    "SelfComposed": SelfComposed,
}
_COLUMNS = ("seq", "kind", "reservation", "round_id", "model_id", "time", "event",
            "cohort_size", "secagg_threshold", "prev_hash", "hash")


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
        epsilon: the most epsilon (nats) the device may ever spend, at ``delta``; > 0, finite.
        delta: the delta the budget is stated at, in (0, 1).
    """

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        e = self.epsilon
        if not (_is_real(e) and math.isfinite(e) and e > 0):
            raise ValueError(f"budget epsilon must be a finite number > 0, got {e!r}")
        _check_delta(self.delta)


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
    """

    round_id: str
    model_id: str
    event: Event
    aggregate_event: Event | None = None
    cohort_size: int = 1
    secagg_threshold: int | None = None

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


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """A durable, counted spend; pass it to :meth:`Ledger.commit` or :meth:`Ledger.abort`.

    Attributes:
        seq: the reservation's entry number in the ledger.
        plan: what was reserved.
        hash: the reservation entry's chain hash (hex), so it cannot be confused with
            another ledger's reservation.
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
    """

    local_epsilon: float
    aggregate_epsilon: float
    delta: float
    entries: int
    adjacency: str = ADJACENCY


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


# --------------------------------------------------------------------- event encoding


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def event_to_json(event: Event) -> dict[str, Any]:
    """The event as plain data, ``{"type": class name, **fields}``, nested for Composed
    (``events``: a list) and SelfComposed (``event``: an object, ``count``: an int).

    Numbers are normalised by the field's declared type (``float`` or ``int``), so the same
    mechanism always encodes to the same canonical JSON; ``adjacency`` is a string.

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
    out: dict[str, Any] = {"type": name}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        out[f.name] = (str(value) if f.name == "adjacency"
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


def _release_to_text(plan: Plan) -> str:
    """The event column of a reserve entry: both views, canonical JSON."""
    assert plan.aggregate_event is not None
    return _canonical({"aggregate": event_to_json(plan.aggregate_event),
                       "local": event_to_json(plan.event)}).decode()


def _release_from_text(text: str) -> tuple[Event, Event]:
    """(local, aggregate) from an event column. A lone legacy event (no aggregate stored)
    is its own aggregate event: conservative. Checks the text is canonical."""
    data = json.loads(text)
    if isinstance(data, dict) and "type" in data:
        local = event_from_json(data, legacy=True)
        if _canonical(_legacy_json(local)).decode() != text:
            raise ValueError("the event is not in canonical form")
        return local, local
    if not isinstance(data, dict) or set(data) != {"aggregate", "local"}:
        raise ValueError(f"a release needs exactly 'local' and 'aggregate' events, got {data!r}")
    local, agg = event_from_json(data["local"]), event_from_json(data["aggregate"])
    if _canonical({"aggregate": event_to_json(agg), "local": event_to_json(local)}
                  ).decode() != text:
        raise ValueError("the event is not in canonical form")
    return local, agg


# ------------------------------------------------------------------------- accounting


def _leaves(event: Event) -> Iterator[Event]:
    if isinstance(event, Composed):
        for e in event.events:
            yield from _leaves(e)
    elif isinstance(event, SelfComposed):
        yield from _leaves(event.event)
    else:
        yield event


def epsilon_rdp(events: Sequence[Event], delta: float) -> float:
    """Epsilon (nats) at ``delta`` of composing ``events`` under zero-out adjacency, by the
    RDP accountant; the ledger's default accountant.

    Each event is restated under zero-out (:func:`edge_sdk.privacy.restate`); an event with
    no sound restatement raises ValueError.
    """
    events = list(events)
    if not events:
        return 0.0
    acc = RdpAccountant(adjacency=ADJACENCY)
    for event, count in Counter(events).items():  # a device repeats few distinct events
        acc.compose(event, count)
    return acc.get_epsilon(delta)


def epsilon_pld(events: Sequence[Event], delta: float) -> float:
    """Epsilon (nats) at ``delta`` under zero-out adjacency, by the PLD accountant where it
    applies (no sampling without replacement, no discrete events), never above the RDP
    answer (both are upper bounds, so their minimum is one)."""
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
    return out


# --------------------------------------------------------------------------- storage

_SCHEMA = (
    """CREATE TABLE meta (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    body TEXT NOT NULL,
    hash TEXT NOT NULL
)""",
    """CREATE TABLE entries (
    seq INTEGER PRIMARY KEY CHECK (seq >= 1),
    kind TEXT NOT NULL CHECK (kind IN ('reserve', 'commit', 'abort')),
    reservation INTEGER CHECK ((kind = 'reserve') = (reservation IS NULL)),
    round_id TEXT NOT NULL,
    model_id TEXT NOT NULL,
    time REAL NOT NULL,
    event TEXT CHECK ((kind = 'reserve') = (event IS NOT NULL)),
    cohort_size INTEGER CHECK ((kind = 'reserve') = (cohort_size IS NOT NULL)),
    secagg_threshold INTEGER,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
)""",
    """CREATE TRIGGER entries_in_order BEFORE INSERT ON entries
WHEN NEW.seq IS NOT (SELECT ifnull(max(seq), 0) + 1 FROM entries)
BEGIN SELECT RAISE(ABORT, 'fedge ledger: entries are numbered 1, 2, ... without gaps'); END""",
    """CREATE TRIGGER entries_no_update BEFORE UPDATE ON entries
BEGIN SELECT RAISE(ABORT, 'fedge ledger: entries are append-only'); END""",
    """CREATE TRIGGER entries_no_delete BEFORE DELETE ON entries
BEGIN SELECT RAISE(ABORT, 'fedge ledger: entries are append-only'); END""",
    """CREATE TRIGGER meta_no_update BEFORE UPDATE ON meta
BEGIN SELECT RAISE(ABORT, 'fedge ledger: metadata is fixed at creation'); END""",
    """CREATE TRIGGER meta_no_delete BEFORE DELETE ON meta
BEGIN SELECT RAISE(ABORT, 'fedge ledger: metadata is fixed at creation'); END""",
)


_SCHEMA_NAMES = (("table", "meta", "meta"), ("table", "entries", "entries"),
                 ("trigger", "entries_in_order", "entries"),
                 ("trigger", "entries_no_update", "entries"),
                 ("trigger", "entries_no_delete", "entries"),
                 ("trigger", "meta_no_update", "meta"), ("trigger", "meta_no_delete", "meta"))


def _check_schema(conn: sqlite3.Connection, path: Path,
                  roots: dict[str, int] | None = None) -> list[int]:
    """sqlite_master exactly as creation wrote it, row ids and (given ``roots``) root pages
    included: sqlite itself ignores some of these, so a flipped bit there would otherwise
    go unseen. Returns the tables' root pages."""
    rows = conn.execute("SELECT rowid, type, name, tbl_name, rootpage, sql FROM sqlite_master "
                        "ORDER BY rowid").fetchall()
    if roots is None:  # before the metadata (which records them) has been read
        rows = [(*r[:4], 0, r[5]) for r in rows]
    want = [(i + 1, kind, name, table, (roots or {}).get(name, 0), sql)
            for i, ((kind, name, table), sql) in enumerate(zip(_SCHEMA_NAMES, _SCHEMA,
                                                                strict=True))]
    if rows != want or any(type(a) is not type(b) for r, w in zip(rows, want, strict=True)
                           for a, b in zip(r, w, strict=True)):
        raise LedgerCorrupted(f"{path}: the schema is not the ledger's (tables or triggers "
                              "changed)")
    return sorted((roots or {}).values())


@contextmanager
def _sqlite_errors(path: Path, doing: str, error: type[LedgerError]) -> Iterator[None]:
    """The one place sqlite3 exceptions become ledger errors (the module raises
    UnicodeDecodeError for text that is not UTF-8, e.g. a flipped bit in a name)."""
    try:
        yield
    except (sqlite3.Error, UnicodeDecodeError) as exc:
        raise error(f"{path}: {doing}: sqlite: {exc}") from exc


def _row_hash(prev_hash: str, row: dict[str, Any]) -> str:
    """sha256(prev_hash || canonical JSON of every column but prev_hash and hash), hex."""
    body = {k: row[k] for k in _COLUMNS if k not in ("prev_hash", "hash")}
    return hashlib.sha256(bytes.fromhex(prev_hash) + _canonical(body)).hexdigest()


class Ledger:
    """A device's privacy ledger. Open with :meth:`open`; use as a context manager.

    One thread per instance. Several processes may share a file: every method first reads
    what others appended, and :meth:`reserve` checks the budget inside its write
    transaction.
    """

    __slots__ = ("_accountant", "_clock", "_closed", "_conn", "_entries", "_events",
                 "_genesis", "_read_only", "_reservations", "budget", "device_id", "path")

    def __init__(self, *, conn: sqlite3.Connection, path: Path, budget: Budget, device_id: str,
                 genesis: str, accountant: EpsilonOf, clock: Callable[[], float]) -> None:
        """Use :meth:`open`."""
        self._conn: sqlite3.Connection | None = conn
        self.path = path
        self.budget = budget
        self.device_id = device_id
        self._genesis = genesis
        self._accountant = accountant
        self._clock = clock
        self._entries: list[Entry] = []
        self._reservations: dict[int, Reservation] = {}
        self._closed: dict[int, EntryKind] = {}  # reservation seq -> "commit" | "abort"
        # canonical JSON -> (local, aggregate) events (a device repeats few)
        self._events: dict[str, tuple[Event, Event]] = {}
        self._read_only: str | None = None  # why nothing can be written (see open)

    # ------------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        budget: Budget | None = None,
        device_id: str | None = None,
        create: bool = False,
        accountant: EpsilonOf = epsilon_rdp,
        clock: Callable[[], float] = time.time,
    ) -> Ledger:
        """Open a ledger, verifying all of it, or create a new one.

        Args:
            path: the sqlite file (its WAL and shm files live next to it).
            budget: the owner's budget. Required to create; stored at creation and never
                changed. When opening, if given it must equal the stored one.
            device_id: required to create; when opening, if given it must equal the stored one.
            create: create the ledger if the file is missing or holds no tables (an
                interrupted creation). Only at provisioning: a device that has ever spent
                must open with ``create=False``, so a lost file fails closed instead of
                restarting from zero spend.
            accountant: ``epsilon_of(events, delta) -> epsilon`` used by every check and
                report; default :func:`epsilon_rdp`. Any sound accountant works, since
                entries store mechanism parameters.
            clock: wall clock for entry times, seconds since the epoch.

        Raises:
            LedgerCorrupted: missing (without ``create``), unreadable, not a ledger, or
                failing any check of :meth:`verify`. The device must not train.
            LedgerError: ``budget`` or ``device_id`` differ from the stored ones.
            ValueError: bad arguments.
        """
        path = Path(path)
        if budget is not None and not isinstance(budget, Budget):
            raise ValueError(f"budget must be a Budget, got {budget!r}")
        if device_id is not None and not (isinstance(device_id, str) and device_id):
            raise ValueError(f"device_id must be a non-empty str, got {device_id!r}")
        if not callable(accountant) or not callable(clock):
            raise ValueError(
                f"accountant and clock must be callables, got {accountant!r}, {clock!r}")
        if not path.exists():
            if not create:
                raise LedgerCorrupted(
                    f"{path}: no ledger file; refusing to start again from zero spend "
                    "(create=True is for provisioning a new device only)")
            if budget is None or device_id is None:
                raise ValueError("creating a ledger needs a budget and a device_id")
        _check_header_fields(path)  # before sqlite can rewrite any of them
        read_only = _read_only_reason(path)
        if read_only is not None:
            if create and (not path.exists() or path.stat().st_size == 0):
                raise LedgerError(f"{path}: cannot create a ledger: {read_only}")
            if not _wal_is_empty(path):  # immutable mode would not see the WAL's entries
                raise LedgerError(f"{path}: {read_only}, and its WAL holds entries not yet in "
                                  "the main file; refusing to read it without them "
                                  "(remount it read-write)")
        with _sqlite_errors(path, "cannot open", LedgerCorrupted):
            if read_only is None:
                conn = sqlite3.connect(path, isolation_level=None, timeout=_BUSY_TIMEOUT_S,
                                       check_same_thread=True)
            else:
                # WAL mode cannot open a file whose directory is read-only (no -shm);
                # immutable can, and is exact here: no one can write a read-only mount
                # and the WAL is empty. Every write then fails closed (see _transaction).
                conn = sqlite3.connect(f"{path.resolve().as_uri()}?immutable=1", uri=True,
                                       isolation_level=None, check_same_thread=True)
        try:
            with _sqlite_errors(path, "cannot open", LedgerCorrupted):
                for pragma in ("secure_delete=ON", "cell_size_check=ON", "trusted_schema=OFF"):
                    conn.execute(f"PRAGMA {pragma}")
                if read_only is not None:
                    pass  # _check_header_fields checked the WAL bytes; no journal to set
                elif conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0:
                    if not create:
                        raise LedgerCorrupted(
                            f"{path}: the file holds no ledger (an interrupted creation?); "
                            "refusing to start again from zero spend")
                    if budget is None or device_id is None:
                        raise ValueError("creating a ledger needs a budget and a device_id")
                    _create(conn, budget, device_id, clock)
                if read_only is None:
                    mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
                    if mode != "wal":
                        raise LedgerCorrupted(f"{path}: journal_mode is {mode!r}, "
                                              "expected 'wal'")
                    conn.execute("PRAGMA synchronous=FULL")
                _check_schema(conn, path)
                meta = _read_meta(conn, path)
            stored = Budget(epsilon=meta["budget"]["epsilon"], delta=meta["budget"]["delta"])
            ledger = cls(conn=conn, path=path, budget=stored, device_id=meta["device_id"],
                         genesis=meta["hash"], accountant=accountant, clock=clock)
            ledger._read_only = read_only
            ledger.verify()
        except BaseException:
            conn.close()
            raise
        if budget is not None and budget != stored:
            ledger.close()
            raise LedgerError(f"{path}: budget {budget} differs from the stored {stored}; "
                              "a ledger's budget is fixed at creation")
        if device_id is not None and device_id != ledger.device_id:
            ledger.close()
            raise LedgerError(f"{path}: the ledger belongs to device {ledger.device_id!r}, "
                              f"not {device_id!r}")
        return ledger

    # ----------------------------------------------------------------------- checking

    def verify(self) -> None:
        """Check the whole ledger and reload it from disk.

        Checks, in one read snapshot: sqlite's full ``integrity_check``; the schema, header
        fields and metadata against what creation wrote; the unused space of the file's
        leaf, overflow and free pages is zero (see the module docstring for what is exempt;
        skipped only while another process is writing the file); the hash chain from the
        metadata through every entry; every entry decodes to a valid event and plan, and
        every commit/abort closes an earlier, still-open reservation of the same round.

        Raises:
            LedgerCorrupted: naming the first problem found. The ledger is then closed, so
                that a half-loaded view can never be used to check a budget.
        """
        try:
            self._verify()
        except LedgerCorrupted:
            self.close()
            raise

    def _verify(self) -> None:
        conn = self._live()
        with _sqlite_errors(self.path, "verification failed", LedgerCorrupted):
            # Move a crashed writer's WAL frames into the main file, so that it alone holds
            # the ledger and can be checked byte by byte.
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            conn.execute("BEGIN")
            try:
                problems = [r[0] for r in conn.execute("PRAGMA integrity_check(20)")]
                if problems != ["ok"]:
                    raise LedgerCorrupted(
                        f"{self.path}: sqlite integrity check failed: {'; '.join(problems)}")
                meta = _read_meta(conn, self.path)
                roots = _check_schema(conn, self.path, meta["roots"])
                for pragma, want in (("application_id", APPLICATION_ID),
                                     ("user_version", SCHEMA_VERSION),
                                     ("schema_version", meta["schema_cookie"])):
                    got = conn.execute(f"PRAGMA {pragma}").fetchone()[0]
                    if got != want:
                        raise LedgerCorrupted(f"{self.path}: {pragma} is {got}, expected {want}")
                if _wal_is_empty(self.path):  # our snapshot is the main file; it cannot move
                    _check_file_bytes(self.path, roots, meta["schema_cookie"])
                rows = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM entries ORDER BY seq")
                rows = rows.fetchall()
            finally:
                conn.execute("COMMIT")
        if meta["hash"] != self._genesis or meta["device_id"] != self.device_id:
            raise LedgerCorrupted(f"{self.path}: the metadata changed while open")
        self._entries, self._reservations, self._closed = [], {}, {}
        self._extend(rows)

    def _extend(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Verify ``rows`` as the continuation of the chain and add them to the view."""
        for values in rows:
            entry = self._check_row(dict(zip(_COLUMNS, values, strict=True)))
            self._entries.append(entry)
            if entry.kind == "reserve":
                assert entry.event is not None and entry.cohort_size is not None
                plan = Plan(round_id=entry.round_id, model_id=entry.model_id, event=entry.event,
                            aggregate_event=entry.aggregate_event,
                            cohort_size=entry.cohort_size,
                            secagg_threshold=entry.secagg_threshold)
                self._reservations[entry.seq] = Reservation(seq=entry.seq, plan=plan,
                                                            hash=entry.hash)
            else:
                assert entry.reservation is not None
                self._closed[entry.reservation] = entry.kind

    def _check_row(self, row: dict[str, Any]) -> Entry:
        seq, prev = len(self._entries) + 1, self.head()
        where = f"{self.path}: entry {row['seq']!r}"
        if row["seq"] != seq or type(row["seq"]) is not int:
            raise LedgerCorrupted(f"{where}: expected entry {seq} (entries missing or reordered)")
        if row["prev_hash"] != prev or not isinstance(row["hash"], str):
            raise LedgerCorrupted(f"{where}: hash chain broken (previous hash does not match)")
        for k in ("kind", "round_id", "model_id", "prev_hash"):
            if not isinstance(row[k], str):
                raise LedgerCorrupted(f"{where}: {k} is {row[k]!r}, expected text")
        if type(row["time"]) is not float or not isinstance(row["event"], str | None) or any(
            row[k] is not None and type(row[k]) is not int
            for k in ("reservation", "cohort_size", "secagg_threshold")
        ):
            raise LedgerCorrupted(f"{where}: a column has the wrong type")
        if _row_hash(prev, row) != row["hash"]:
            raise LedgerCorrupted(f"{where}: hash chain broken (the entry was altered)")
        try:
            event = agg = None
            if row["kind"] == "reserve":
                pair = self._events.get(row["event"])
                if pair is None:
                    pair = _release_from_text(row["event"])
                    self._events[row["event"]] = pair
                event, agg = pair
                Plan(round_id=row["round_id"], model_id=row["model_id"], event=event,
                     aggregate_event=agg,
                     cohort_size=row["cohort_size"], secagg_threshold=row["secagg_threshold"])
            elif row["kind"] in ("commit", "abort"):
                ref = self._reservations.get(row["reservation"])
                if ref is None:
                    raise ValueError(f"{row['kind']} of unknown reservation {row['reservation']!r}")
                if row["reservation"] in self._closed:
                    raise ValueError(f"reservation {row['reservation']} closed twice")
                if (row["round_id"], row["model_id"]) != (ref.plan.round_id, ref.plan.model_id):
                    raise ValueError(f"round/model differ from reservation {ref.seq}'s")
                if row["cohort_size"] is not None or row["secagg_threshold"] is not None:
                    raise ValueError("cohort fields on a commit/abort")
            else:
                raise ValueError(f"unknown kind {row['kind']!r}")
        except (ValueError, TypeError, KeyError) as exc:  # json.JSONDecodeError is a ValueError
            raise LedgerCorrupted(f"{where}: invalid entry ({exc})") from exc
        fields = {k: row[k] for k in _COLUMNS}
        fields["event"] = event
        fields["aggregate_event"] = agg
        return Entry(**fields)

    def _refresh(self) -> None:
        """Read what other connections appended since we last looked (the chain goes on);
        on LedgerCorrupted the ledger is closed."""
        try:
            self._refresh_rows()
        except LedgerCorrupted:
            self.close()
            raise

    def _refresh_rows(self) -> None:
        conn = self._live()
        last = len(self._entries)
        with _sqlite_errors(self.path, "cannot read entries", LedgerCorrupted):
            rows = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM entries WHERE seq >= ? "
                                "ORDER BY seq", (max(last, 1),)).fetchall()
        if last:  # the link we extend must still be the entry we verified
            known = self._entries[-1]
            row = dict(zip(_COLUMNS, rows[0], strict=True)) if rows else {}
            try:
                same = bool(rows) and row["seq"] == last and row["hash"] == known.hash and (
                    row["prev_hash"] == known.prev_hash
                    and _row_hash(known.prev_hash, row) == known.hash)
            except (TypeError, ValueError):  # a column no longer JSON-able text or number
                same = False
            if not same:
                raise LedgerCorrupted(f"{self.path}: entry {last} changed or vanished while open")
            rows = rows[1:]
        self._extend(rows)

    def head(self) -> str:
        """The last entry's hash (hex); the metadata's hash for an empty ledger. Anchor it
        outside the device to detect a cut-off tail or a restored older copy."""
        return self._entries[-1].hash if self._entries else self._genesis

    # ----------------------------------------------------------------------- spending

    def _local_epsilon(self, plans: Sequence[Plan], delta: float) -> float:
        value = self._accountant([p.event for p in plans], delta) if plans else 0.0
        return _checked_epsilon(value, _name(self._accountant))

    def _plans(self) -> list[Plan]:
        return [r.plan for r in self._reservations.values()]

    def epsilon_if(self, plan: Plan) -> float:
        """Local epsilon (nats) at the budget's delta after ``plan``, on top of every
        reservation so far. Writes nothing."""
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a Plan, got {plan!r}")
        self._refresh()
        return self._local_epsilon([*self._plans(), plan], self.budget.delta)

    def would_exceed(self, plan: Plan) -> bool:
        """Whether reserving ``plan`` would take local epsilon over the budget. Pure: writes
        nothing (a NaN-free accountant answer above the budget, or inf, is True)."""
        return not self.epsilon_if(plan) <= self.budget.epsilon

    def reserve(self, plan: Plan) -> Reservation:
        """Check the budget and record the release durably; call before the upload leaves.

        The check and the write happen in one write transaction, so two processes sharing
        the file cannot both pass the check on the same remaining budget. When this
        returns, the entry is on disk (``synchronous=FULL``) and counted forever.

        Raises:
            BudgetExhausted: the plan would exceed the budget; names the epsilon already
                spent, the plan's own epsilon and the budget. Nothing is written.
            LedgerError: the write failed (nothing counted; do not upload).
            ValueError: not a Plan, or the accountant cannot compose the plan's event with
                the ledger's history.
        """
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a Plan, got {plan!r}")
        delta, limit = self.budget.delta, self.budget.epsilon
        with self._transaction(f"reserve round {plan.round_id!r}"):
            self._refresh()
            after = self._local_epsilon([*self._plans(), plan], delta)
            if not after <= limit:
                spent = self._local_epsilon(self._plans(), delta)
                alone = self._local_epsilon([plan], delta)
                raise BudgetExhausted(
                    f"round {plan.round_id!r} refused: spent eps={spent:.6g}, this plan alone "
                    f"eps={alone:.6g}, together eps={after:.6g} > budget eps={limit:g} "
                    f"(local, at delta={delta:g})")
            entry = self._insert("reserve", plan, None)
        self._extend_one(entry)
        return self._reservations[entry["seq"]]

    def commit(self, reservation: Reservation) -> None:
        """Record that the reservation's upload left. Changes no figure (it already counted).

        Committing twice is a no-op.

        Raises:
            LedgerError: the reservation is not this ledger's, or was aborted.
        """
        self._close(reservation, "commit")

    def abort(self, reservation: Reservation) -> None:
        """Record that the reservation's upload did not leave. Refunds nothing: the
        reservation still counts as spent. Aborting twice is a no-op.

        Raises:
            LedgerError: the reservation is not this ledger's, or was committed.
        """
        self._close(reservation, "abort")

    def _close(self, reservation: Reservation, kind: EntryKind) -> None:
        if not isinstance(reservation, Reservation):
            raise ValueError(f"reservation must be a Reservation, got {reservation!r}")
        with self._transaction(f"{kind} reservation {reservation.seq}"):
            self._refresh()
            ours = self._reservations.get(reservation.seq)
            if ours is None or ours != reservation:
                raise LedgerError(f"{self.path}: reservation {reservation.seq} "
                                  f"({reservation.plan.round_id!r}) is not in this ledger")
            done = self._closed.get(reservation.seq)
            if done == kind:
                return
            if done is not None:
                raise LedgerError(f"{self.path}: cannot {kind} reservation {reservation.seq}: "
                                  f"it was already recorded as {done}")
            entry = self._insert(kind, reservation.plan, reservation.seq)
        self._extend_one(entry)

    @property
    def read_only(self) -> str | None:
        """Why this ledger cannot record anything (its file system is read-only), or None.
        A read-only ledger reads, verifies and reports; every write raises LedgerError."""
        return self._read_only

    @contextmanager
    def _transaction(self, doing: str) -> Iterator[None]:
        conn = self._live()
        if self._read_only is not None:
            raise LedgerError(f"{self.path}: cannot {doing}: {self._read_only}; nothing was "
                              "recorded")
        # A full disk or a file system turned read-only fails BEGIN, INSERT or COMMIT with
        # a sqlite error: rolled back, nothing recorded, LedgerError (do not upload).
        with _sqlite_errors(self.path, f"cannot {doing}", LedgerError):
            conn.execute("BEGIN IMMEDIATE")  # the write lock: no one appends meanwhile
            try:
                yield
                conn.execute("COMMIT")  # synchronous=FULL: on disk when this returns
            except BaseException:
                if self._conn is not None and conn.in_transaction:  # closing rolls back too
                    conn.execute("ROLLBACK")
                raise
        # Hygiene, not durability: fold the WAL into the main file so that at rest the
        # WAL is empty (nothing there to lose to a flipped bit) and the main file alone
        # holds the ledger. Busy (a reader active) just leaves it for next time. It runs
        # after COMMIT returned, so its failure (a disk that just filled up) must not
        # report the entry, which is on disk and counted, as not recorded.
        with contextlib.suppress(sqlite3.Error):
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def _insert(self, kind: EntryKind, plan: Plan, reservation: int | None) -> dict[str, Any]:
        now = self._clock()
        if not (_is_real(now) and math.isfinite(now)):
            raise ValueError(f"clock must return finite seconds, got {now!r}")
        reserve = kind == "reserve"
        row: dict[str, Any] = {
            "seq": len(self._entries) + 1, "kind": kind, "reservation": reservation,
            "round_id": plan.round_id, "model_id": plan.model_id, "time": float(now),
            "event": _release_to_text(plan) if reserve else None,
            "cohort_size": int(plan.cohort_size) if reserve else None,
            "secagg_threshold": (None if not reserve or plan.secagg_threshold is None
                                 else int(plan.secagg_threshold)),
            "prev_hash": self.head(),
        }
        row["hash"] = _row_hash(row["prev_hash"], row)
        self._live().execute(
            f"INSERT INTO entries ({', '.join(_COLUMNS)}) "
            f"VALUES ({', '.join(':' + c for c in _COLUMNS)})", row)
        return row

    def _extend_one(self, row: dict[str, Any]) -> None:
        self._extend([tuple(row[c] for c in _COLUMNS)])

    # ------------------------------------------------------------------------ reports

    def spent(self, delta: float | None = None) -> Spent:
        """Local and aggregate epsilon (nats) at ``delta`` (default: the budget's), every
        reservation counted whether committed, aborted or neither: never an under-count."""
        delta = self.budget.delta if delta is None else _check_delta(delta)
        self._refresh()
        plans = self._plans()
        if not plans:
            return Spent(local_epsilon=0.0, aggregate_epsilon=0.0, delta=delta, entries=0)
        local = self._local_epsilon(plans, delta)
        agg = self._accountant([p.aggregate_event for p in plans], delta)
        return Spent(local_epsilon=local,
                     aggregate_epsilon=_checked_epsilon(agg, _name(self._accountant)),
                     delta=delta, entries=len(plans))

    def remaining(self) -> float:
        """Local epsilon (nats) left in the budget at the budget's delta (>= 0; for check-in)."""
        return max(0.0, self.budget.epsilon - self.spent().local_epsilon)

    def entries(self) -> tuple[Entry, ...]:
        """Every entry, oldest first."""
        self._refresh()
        return tuple(self._entries)

    def reservations(self) -> tuple[Reservation, ...]:
        """Every reservation, oldest first, whatever became of it."""
        self._refresh()
        return tuple(self._reservations.values())

    def pending(self) -> tuple[Reservation, ...]:
        """Reservations neither committed nor aborted (after a crash: uploads that may have
        left). They count as spent all the same."""
        self._refresh()
        return tuple(r for s, r in self._reservations.items() if s not in self._closed)

    @property
    def accountant(self) -> EpsilonOf:
        """The ``epsilon_of(events, delta)`` this ledger checks and reports with."""
        return self._accountant

    # ---------------------------------------------------------------------- lifecycle

    def _live(self) -> sqlite3.Connection:
        if self._conn is None:
            raise LedgerError(f"{self.path}: the ledger is closed")
        return self._conn

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._conn is not None:
            conn, self._conn = self._conn, None
            with _sqlite_errors(self.path, "cannot close", LedgerError):
                conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._conn is None else f"{len(self._entries)} entries"
        return f"Ledger({str(self.path)!r}, device_id={self.device_id!r}, {state})"


def _create(conn: sqlite3.Connection, budget: Budget, device_id: str,
            clock: Callable[[], float]) -> None:
    """Schema and metadata in one transaction: a crash leaves no ledger or a whole one."""
    if conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] != "wal":
        raise sqlite3.OperationalError("could not switch to WAL mode")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("BEGIN IMMEDIATE")
    try:
        if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            conn.execute("ROLLBACK")  # another process created it meanwhile
            return
        for statement in _SCHEMA:
            conn.execute(statement)
        conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        created = clock()
        if not (_is_real(created) and math.isfinite(created)):
            raise ValueError(f"clock must return finite seconds, got {created!r}")
        body = {"format": FORMAT, "version": SCHEMA_VERSION, "device_id": device_id,
                "budget": {"epsilon": float(budget.epsilon), "delta": float(budget.delta)},
                "created": float(created),
                "schema_cookie": conn.execute("PRAGMA schema_version").fetchone()[0],
                "roots": dict(conn.execute("SELECT name, rootpage FROM sqlite_master "
                                           "WHERE type = 'table'").fetchall())}
        text = _canonical(body).decode()
        conn.execute("INSERT INTO meta (id, body, hash) VALUES (1, ?, ?)",
                     (text, hashlib.sha256(text.encode()).hexdigest()))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()


def _read_meta(conn: sqlite3.Connection, path: Path) -> dict[str, Any]:
    rows = conn.execute("SELECT id, body, hash FROM meta").fetchall()
    if len(rows) != 1 or rows[0][0] != 1 or not isinstance(rows[0][1], str):
        raise LedgerCorrupted(f"{path}: the ledger's metadata is missing or malformed")
    _, text, digest = rows[0]
    if hashlib.sha256(text.encode()).hexdigest() != digest:
        raise LedgerCorrupted(f"{path}: the metadata does not match its hash (altered)")
    try:
        meta = json.loads(text)
        if meta.get("format") != FORMAT or meta.get("version") != SCHEMA_VERSION:
            raise ValueError(f"format {meta.get('format')!r} version {meta.get('version')!r}, "
                             f"expected {FORMAT!r} version {SCHEMA_VERSION}")
        if _canonical(meta).decode() != text:
            raise ValueError("not in canonical form")
        Budget(epsilon=meta["budget"]["epsilon"], delta=meta["budget"]["delta"])
        roots = meta["roots"]
        if not (isinstance(meta["device_id"], str) and meta["device_id"]
                and _is_int(meta["schema_cookie"]) and isinstance(roots, dict)
                and sorted(roots) == ["entries", "meta"]
                and all(_is_int(r) and r >= 2 for r in roots.values())):
            raise ValueError("bad device_id, schema_cookie or roots")
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise LedgerCorrupted(f"{path}: bad ledger metadata ({exc})") from exc
    meta["hash"] = digest
    return meta


# ------------------------------------------------------ the file, byte by byte
#
# sqlite's integrity_check verifies the b-tree structure (page types, cell bounds, key order,
# free-space accounting, every page used once) and our hashes cover every value. What
# neither sees is space sqlite considers unused and header fields it ignores. With
# secure_delete every freed byte is zeroed and new pages start zeroed, and an append-only
# table grows its leaves by adding fresh pages, so in a healthy ledger the unused bytes of
# leaf, overflow and free pages are zero and the header holds what creation wrote. Interior
# pages are the exception: splitting one leaves stale cell pointers in its unused gap (seen
# past ~9,000 entries), so their unused space is not checked — a false alarm would
# stop a healthy device for good. Format: https://www.sqlite.org/fileformat2.html.

_MAGIC = b"SQLite format 3\x00"
# Header fields that never change after creation: offset -> (size, expected value).
_FIXED = {18: (1, 2), 19: (1, 2), 20: (1, 0), 21: (1, 64), 22: (1, 32), 23: (1, 32),
          44: (4, 4), 48: (4, 0), 52: (4, 0), 56: (4, 1), 60: (4, SCHEMA_VERSION),
          64: (4, 0), 68: (4, APPLICATION_ID)}


def _read_only_reason(path: Path) -> str | None:
    """Why the ledger's directory cannot be written (a read-only mount), or None."""
    directory = path.parent
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return f"{directory} is on a read-only file system"
    except OSError:
        return None  # sqlite will report what is wrong with the path
    return None


def _wal_is_empty(path: Path) -> bool:
    wal = path.with_name(path.name + "-wal")
    try:
        return wal.stat().st_size == 0
    except FileNotFoundError:
        return True


def _check_header_fields(path: Path) -> None:
    """Before sqlite touches the file: it is empty (an interrupted creation) or a ledger's."""
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise LedgerCorrupted(f"{path}: cannot read the file ({exc})") from exc
    if not head:
        return
    if len(head) < 100 or head[:16] != _MAGIC:
        raise LedgerCorrupted(f"{path}: not a sqlite database (bad or truncated header)")
    if head[18:20] != b"\x02\x02":  # creation switches to WAL before anything else
        raise LedgerCorrupted(f"{path}: header bytes 18-19 are {head[18:20].hex()}, expected "
                              "0202 (WAL)")


def _u16(b: bytes, i: int) -> int:
    return int(struct.unpack_from(">H", b, i)[0])


def _u32(b: bytes, i: int) -> int:
    return int(struct.unpack_from(">I", b, i)[0])


def _varint(b: bytes, i: int) -> tuple[int, int]:
    v = 0
    for k in range(8):
        byte = b[i + k]
        v = (v << 7) | (byte & 0x7F)
        if byte < 0x80:
            return v, i + k + 1
    return (v << 8) | b[i + 8], i + 9


class _Bad(Exception):
    pass


def _zero(b: bytes, start: int, end: int, what: str) -> None:
    if start > end:
        raise _Bad(f"{what}: overlapping regions at offset {end}")
    if b[start:end] != bytes(end - start):
        nz = next(i for i in range(start, end) if b[i])
        raise _Bad(f"{what}: unused byte at offset {nz} is {b[nz]:#04x}, expected 0")


def _check_file_bytes(path: Path, roots: list[int], cookie: int) -> None:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LedgerCorrupted(f"{path}: cannot read the file ({exc})") from exc
    try:
        _check_pages(data, roots, cookie)
    except _Bad as exc:
        raise LedgerCorrupted(f"{path}: {exc}") from None
    except (struct.error, IndexError, ValueError) as exc:
        raise LedgerCorrupted(f"{path}: malformed page structure ({exc})") from None


def _check_pages(data: bytes, roots: list[int], cookie: int) -> None:
    if len(data) < 512 or data[:16] != _MAGIC:
        raise _Bad("not a sqlite file")
    ps = _u16(data, 16)
    ps = 65536 if ps == 1 else ps
    if ps < 512 or ps & (ps - 1) or len(data) % ps:
        raise _Bad(f"page size {ps} does not fit the file size {len(data)}")
    npages = len(data) // ps
    for off, (size, want) in _FIXED.items():
        got = int.from_bytes(data[off:off + size], "big")
        if got != want:
            raise _Bad(f"file header field at offset {off} is {got}, expected {want}")
    _zero(data, 72, 92, "file header (reserved)")
    if _u32(data, 24) != _u32(data, 92):
        raise _Bad("file header: change counter and version-valid-for differ")
    if _u32(data, 28) != npages:
        raise _Bad(f"file header says {_u32(data, 28)} pages, the file has {npages}")
    if _u32(data, 40) != cookie:
        raise _Bad(f"file header: schema cookie {_u32(data, 40)}, expected {cookie}")
    if not 3_000_000 <= _u32(data, 96) < 4_000_000:
        raise _Bad(f"file header: sqlite version number {_u32(data, 96)} is not a SQLite 3")
    seen: set[int] = set()

    def page(pgno: int) -> bytes:
        if not 1 <= pgno <= npages or pgno in seen:
            raise _Bad(f"page {pgno} is out of range or referenced twice")
        seen.add(pgno)
        return data[(pgno - 1) * ps: pgno * ps]

    overflows: list[tuple[int, int]] = []
    stack = sorted(set(roots) | {1})
    while stack:
        pgno = stack.pop()
        overflows += _check_btree_page(page(pgno), pgno, ps, stack)
    for first, remaining in overflows:  # chains of payload that did not fit in a cell
        pgno = first
        while True:
            buf = page(pgno)
            if remaining <= ps - 4:
                if _u32(buf, 0):
                    raise _Bad(f"page {pgno}: overflow chain goes on past its payload")
                _zero(buf, 4 + remaining, ps, f"page {pgno} (overflow)")
                break
            remaining -= ps - 4
            pgno = _u32(buf, 0)
    trunk, free = _u32(data, 32), _u32(data, 36)
    while trunk:
        buf = page(trunk)
        n = _u32(buf, 4)
        leaves = [_u32(buf, 8 + 4 * k) for k in range(n)]
        _zero(buf, 8 + 4 * n, ps, f"page {trunk} (freelist trunk)")
        for leaf in leaves:
            _zero(page(leaf), 0, ps, f"page {leaf} (free)")
        free -= 1 + n
        trunk = _u32(buf, 0)
    if free != 0 or len(seen) != npages:
        raise _Bad(f"{npages - len(seen)} pages are neither in a b-tree nor free")


def _check_btree_page(buf: bytes, pgno: int, ps: int, stack: list[int]) -> list[tuple[int, int]]:
    """Leaf pages: zero outside the header, cell pointers, cells and freeblock headers.
    Interior pages: children pushed, unused space not checked (stale after a split).
    Returns the overflow chains (first page, bytes left) of the page's cells."""
    h = 100 if pgno == 1 else 0
    kind = buf[h]
    if kind not in (2, 5, 10, 13):
        raise _Bad(f"page {pgno}: unknown b-tree page type {kind}")
    interior, table = kind in (2, 5), kind in (5, 13)
    hdr = 12 if interior else 8
    ncell, content = _u16(buf, h + 3), _u16(buf, h + 5) or 65536
    ptrs = h + hdr + 2 * ncell
    if not ptrs <= content <= ps:
        raise _Bad(f"page {pgno}: cell area starts at {content}, pointers end at {ptrs}")
    zero = _zero if not interior else lambda *_: None
    zero(buf, ptrs, content, f"page {pgno} (unallocated)")
    if interior:
        stack.append(_u32(buf, h + 8))
    # Payload kept on the page before spilling to overflow pages (fileformat2, section 1.6).
    max_local = ps - 35 if table else (ps - 12) * 64 // 255 - 23
    min_local = (ps - 12) * 32 // 255 - 23
    spans, overflows = [], []
    for k in range(ncell):
        start = _u16(buf, h + hdr + 2 * k)
        i = start
        if interior:
            stack.append(_u32(buf, i))
            i += 4
        if kind == 5:  # table interior: child pointer and key only
            _, i = _varint(buf, i)
            spans.append((start, i))
            continue
        size, i = _varint(buf, i)
        if kind == 13:
            _, i = _varint(buf, i)  # rowid
        local = size
        if size > max_local:
            local = min_local + (size - min_local) % (ps - 4)
            local = local if local <= max_local else min_local
            overflows.append((_u32(buf, i + local), size - local))
            i += 4
        spans.append((start, i + local))
    block = _u16(buf, h + 1)
    while block:
        nxt, size = _u16(buf, block), _u16(buf, block + 2)
        spans.append((block, block + 4))
        zero(buf, block + 4, block + size, f"page {pgno} (freeblock)")
        if nxt and nxt <= block:
            raise _Bad(f"page {pgno}: freeblocks out of order")
        block = nxt
    pos = content
    for a, b in sorted(spans):
        zero(buf, pos, a, f"page {pgno} (fragment)")
        pos = max(pos, b)
    zero(buf, pos, ps, f"page {pgno} (tail)")
    return overflows
