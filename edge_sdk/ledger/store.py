"""The device's privacy ledger on disk: a durable, append-only, hash-chained record of every
release, and the budget check (a :class:`~edge_sdk.ledger.accounting.Book`) that runs before
anything leaves the device.

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
chain, and the file byte by byte (:mod:`edge_sdk.ledger.audit`) — every byte of the main
file is either checked by sqlite's structure check, covered by a hash, a fixed header value,
or unused space, which ``secure_delete`` keeps zero. Two exceptions hold no ledger data and
are not checked: the four header bytes naming the version of the last SQLite library to
write the file (only range-checked), and the unused space of interior b-tree pages, where
SQLite leaves stale cell pointers after splitting one (past about 9,000 entries). What no
local check can see: the tail cut off by someone who rewrites the file consistently, or the
whole file swapped for an older copy; anchor :meth:`Ledger.head` elsewhere (the aggregator's
receipt).

The figures (local and aggregate epsilon, zero-out adjacency) are the
:mod:`~edge_sdk.ledger.accounting` module's. sqlite3 exceptions are translated at this
module's boundary and never escape it. Bad arguments raise ``ValueError`` naming the value
and the expectation.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from edge_sdk.ledger.accounting import (
    Book,
    Budget,
    Entry,
    EntryKind,
    EpsilonCache,
    EpsilonOf,
    Figure,
    LedgerCorrupted,
    LedgerError,
    Plan,
    Reservation,
    Spent,
    _canonical,
    _check_delta,
    _is_int,
    _is_real,
    _legacy_json,
    epsilon_rdp,
    event_from_json,
    event_to_json,
)
from edge_sdk.ledger.audit import check_file, check_header
from edge_sdk.privacy import Event

__all__ = ["APPLICATION_ID", "FORMAT", "SCHEMA_VERSION", "VERSIONS", "Ledger"]

FORMAT = "fedge-ledger"
# 2 (issue 16): the metadata's budget holds ``device_epsilon`` (null: no device-level
# limit); reserve entries may hold a device-level event and the colluders assumed. The
# tables are the same. Version 1 ledgers read as a budget without a device-level limit,
# their entries without device-level events (the figure is then None, never a partial
# sum); new entries appended to them may carry device-level events. A build that knows
# only version 1 refuses a version 2 file (fail closed: it would ignore the device budget).
SCHEMA_VERSION = 2
VERSIONS = (1, 2)
APPLICATION_ID = int.from_bytes(b"fLdg", "big")  # sqlite header bytes 68-71
_BUSY_TIMEOUT_S = 10.0
_COLUMNS = ("seq", "kind", "reservation", "round_id", "model_id", "time", "event",
            "cohort_size", "secagg_threshold", "prev_hash", "hash")


# ------------------------------------------------------------------ the event column


_Release = tuple[Event, Event, Event | None, int | None]  # local, aggregate, device, colluders


def _release_json(local: Event, agg: Event, device: Event | None,
                  colluders: int | None) -> dict[str, Any]:
    """The event column's object: the two sample-level views, and, when either is stated,
    the device-level event (or null) and the colluders assumed (or null)."""
    out: dict[str, Any] = {"aggregate": event_to_json(agg), "local": event_to_json(local)}
    if device is not None or colluders is not None:
        out["device"] = None if device is None else event_to_json(device)
        out["colluders"] = colluders
    return out


def _release_to_text(plan: Plan) -> str:
    """The event column of a reserve entry, canonical JSON (:func:`_release_json`)."""
    assert plan.aggregate_event is not None
    return _canonical(_release_json(plan.event, plan.aggregate_event, plan.device_event,
                                    plan.colluders)).decode()


def _release_from_text(text: str) -> _Release:
    """(local, aggregate, device, colluders) from an event column. A lone legacy event (no
    aggregate stored) is its own aggregate event: conservative. Entries without a device
    event or colluders read them as None. Checks the text is canonical."""
    data = json.loads(text)
    if isinstance(data, dict) and "type" in data:
        local = event_from_json(data, legacy=True)
        if _canonical(_legacy_json(local)).decode() != text:
            raise ValueError("the event is not in canonical form")
        return local, local, None, None
    if not isinstance(data, dict) or set(data) not in (
            {"aggregate", "local"}, {"aggregate", "local", "device", "colluders"}):
        raise ValueError("a release needs exactly 'local' and 'aggregate' events (and "
                         f"optionally 'device' and 'colluders'), got {data!r}")
    local, agg = event_from_json(data["local"]), event_from_json(data["aggregate"])
    device = data.get("device")
    device = None if device is None else event_from_json(device)
    colluders = data.get("colluders")
    if colluders is not None and not _is_int(colluders):
        raise ValueError(f"colluders must be null or an integer, got {colluders!r}")
    if _canonical(_release_json(local, agg, device, colluders)).decode() != text:
        raise ValueError("the event is not in canonical form")
    return local, agg, device, colluders


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
    """A device's privacy ledger: a :class:`~edge_sdk.ledger.accounting.Book` made durable.
    Open with :meth:`open`; use as a context manager.

    Its book always has the finite :class:`Budget` stored at creation (never the book's
    simulation-only "no limit"), and holds exactly the verified entries of the file.

    One thread per instance. Several processes may share a file: every method first reads
    what others appended, and :meth:`reserve` checks the budget inside its write
    transaction.
    """

    __slots__ = ("_accountant", "_book", "_cache", "_clock", "_conn", "_entries", "_events",
                 "_genesis", "_read_only", "budget", "device_id", "path", "version")

    def __init__(self, *, conn: sqlite3.Connection, path: Path, budget: Budget, device_id: str,
                 genesis: str, accountant: EpsilonOf, clock: Callable[[], float],
                 version: int = SCHEMA_VERSION) -> None:
        """Use :meth:`open`."""
        if not isinstance(budget, Budget):  # never the Book's "no limit" on a device
            raise ValueError(f"a device ledger needs a finite Budget, got {budget!r}")
        self._conn: sqlite3.Connection | None = conn
        self.path = path
        self.budget = budget
        self.device_id = device_id
        self.version = version  # the file's schema version (VERSIONS)
        self._genesis = genesis
        self._accountant = accountant
        self._clock = clock
        self._entries: list[Entry] = []
        self._cache = EpsilonCache()  # outlives reloads: answers depend only on the events
        self._book = self._new_book()
        # canonical JSON -> (local, aggregate, device, colluders) (a device repeats few)
        self._events: dict[str, _Release] = {}
        self._read_only: str | None = None  # why nothing can be written (see open)

    def _new_book(self) -> Book:
        return Book(budget=self.budget, accountant=self._accountant, cache=self._cache)

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
        check_header(path)  # before sqlite can rewrite any of them
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
                    pass  # check_header checked the WAL bytes; no journal to set
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
            stored = _meta_budget(meta)
            ledger = cls(conn=conn, path=path, budget=stored, device_id=meta["device_id"],
                         genesis=meta["hash"], accountant=accountant, clock=clock,
                         version=meta["version"])
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
                                     ("user_version", meta["version"]),
                                     ("schema_version", meta["schema_cookie"])):
                    got = conn.execute(f"PRAGMA {pragma}").fetchone()[0]
                    if got != want:
                        raise LedgerCorrupted(f"{self.path}: {pragma} is {got}, expected {want}")
                if _wal_is_empty(self.path):  # our snapshot is the main file; it cannot move
                    check_file(self.path, roots=roots, cookie=meta["schema_cookie"],
                               user_version=meta["version"], application_id=APPLICATION_ID)
                rows = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM entries ORDER BY seq")
                rows = rows.fetchall()
            finally:
                conn.execute("COMMIT")
        if meta["hash"] != self._genesis or meta["device_id"] != self.device_id:
            raise LedgerCorrupted(f"{self.path}: the metadata changed while open")
        self._entries, self._book = [], self._new_book()
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
                            secagg_threshold=entry.secagg_threshold,
                            device_event=entry.device_event, colluders=entry.colluders)
                self._book.add(Reservation(seq=entry.seq, plan=plan, hash=entry.hash))
            else:
                assert entry.reservation is not None and entry.kind != "reserve"
                self._book.close(entry.reservation, entry.kind)

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
            event = agg = device = colluders = None
            if row["kind"] == "reserve":
                release = self._events.get(row["event"])
                if release is None:
                    release = _release_from_text(row["event"])
                    self._events[row["event"]] = release
                event, agg, device, colluders = release
                Plan(round_id=row["round_id"], model_id=row["model_id"], event=event,
                     aggregate_event=agg,
                     cohort_size=row["cohort_size"], secagg_threshold=row["secagg_threshold"],
                     device_event=device, colluders=colluders)
            elif row["kind"] in ("commit", "abort"):
                ref = self._book.reservation(row["reservation"])
                if ref is None:
                    raise ValueError(f"{row['kind']} of unknown reservation {row['reservation']!r}")
                if self._book.closed(row["reservation"]) is not None:
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
        fields["device_event"] = device
        fields["colluders"] = colluders
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

    def epsilon_if(self, plan: Plan) -> float:
        """Local epsilon (nats) at the budget's delta after ``plan``, on top of every
        reservation so far. Writes nothing."""
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a Plan, got {plan!r}")
        self._refresh()
        return self._book.epsilon_if(plan)

    def device_epsilon_if(self, plan: Plan) -> float | None:
        """Device-level aggregate epsilon (nats) at the budget's delta after ``plan``, or
        None (a reservation or the plan has no device-level event). Writes nothing."""
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a Plan, got {plan!r}")
        self._refresh()
        return self._book.device_epsilon_if(plan)

    def figures(self, delta: float | None = None) -> tuple[Figure, Figure, Figure]:
        """The three figures with their units, adjacency and assumptions
        (:meth:`~edge_sdk.ledger.accounting.Book.figures`), every reservation counted."""
        delta = self.budget.delta if delta is None else _check_delta(delta)
        self._refresh()
        return self._book.figures(delta)

    def would_exceed(self, plan: Plan) -> bool:
        """Whether reserving ``plan`` would take local epsilon over the budget, or the
        device-level epsilon over a set device budget. Pure: writes nothing (a NaN-free
        accountant answer above the budget, inf, or a device-level None is True)."""
        if not isinstance(plan, Plan):
            raise ValueError(f"plan must be a Plan, got {plan!r}")
        self._refresh()
        return self._book.would_exceed(plan)

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
        with self._transaction(f"reserve round {plan.round_id!r}"):
            self._refresh()
            self._book.check(plan)  # BudgetExhausted: nothing written
            entry = self._insert("reserve", plan, None)
        self._extend_one(entry)
        reservation = self._book.reservation(entry["seq"])
        assert reservation is not None
        return reservation

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
            ours = self._book.reservation(reservation.seq)
            if ours is None or ours != reservation:
                raise LedgerError(f"{self.path}: reservation {reservation.seq} "
                                  f"({reservation.plan.round_id!r}) is not in this ledger")
            done = self._book.closed(reservation.seq)
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
        return self._book.spent(delta)

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
        return self._book.reservations()

    def pending(self) -> tuple[Reservation, ...]:
        """Reservations neither committed nor aborted (after a crash: uploads that may have
        left). They count as spent all the same."""
        self._refresh()
        return self._book.pending()

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
    """Schema and metadata in one transaction: a crash leaves no ledger or a whole one.
    Writes the module's :data:`SCHEMA_VERSION` (read at call time: the tests write a
    version 1 file, as the code before issue 16 did, by setting it to 1)."""
    version = SCHEMA_VERSION
    if version < 2 and budget.device_epsilon is not None:
        raise ValueError(f"a version {version} ledger cannot hold a device-level budget")
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
        conn.execute(f"PRAGMA user_version={version}")
        created = clock()
        if not (_is_real(created) and math.isfinite(created)):
            raise ValueError(f"clock must return finite seconds, got {created!r}")
        stated: dict[str, float | None] = {"epsilon": float(budget.epsilon),
                                           "delta": float(budget.delta)}
        if version >= 2:
            stated["device_epsilon"] = (None if budget.device_epsilon is None
                                        else float(budget.device_epsilon))
        body = {"format": FORMAT, "version": version, "device_id": device_id,
                "budget": stated,
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
        version = meta.get("version")
        if meta.get("format") != FORMAT or type(version) is not int or version not in VERSIONS:
            raise ValueError(f"format {meta.get('format')!r} version {version!r}, "
                             f"expected {FORMAT!r} version in {VERSIONS}")
        if _canonical(meta).decode() != text:
            raise ValueError("not in canonical form")
        _meta_budget(meta)
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


def _meta_budget(meta: dict[str, Any]) -> Budget:
    """The budget the metadata states: version 1 has no device-level limit (None); version
    2 states ``device_epsilon`` (null for none). Exact keys.

    Raises:
        ValueError, KeyError, TypeError: a malformed budget.
    """
    b = meta["budget"]
    keys = {"epsilon", "delta"} | ({"device_epsilon"} if meta["version"] >= 2 else set())
    if not isinstance(b, dict) or set(b) != keys:
        raise ValueError(f"budget must have exactly {sorted(keys)}, got {b!r}")
    return Budget(epsilon=b["epsilon"], delta=b["delta"], device_epsilon=b.get("device_epsilon"))


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
