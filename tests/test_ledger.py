"""The device ledger (edge_sdk.ledger): two-phase spend, budgets, durability across SIGKILL,
tamper and corruption checks, and ``fedge ledger show|verify`` (issue 3, Must-show 4 and 5)."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edge_sdk.ledger import (
    Budget,
    BudgetExhausted,
    Entry,
    Ledger,
    LedgerCorrupted,
    LedgerError,
    Plan,
    Reservation,
    entry_to_json,
    epsilon_pld,
    epsilon_rdp,
    event_from_json,
    event_to_json,
)
from edge_sdk.ledger.store import _release_to_text, _row_hash
from edge_sdk.privacy import (
    Composed,
    Gaussian,
    PoissonSubsampledGaussian,
    SampledWithoutReplacementGaussian,
    aggregate_event,
)
from tools.ledger_cli import add_ledger_parser, run_ledger

REPO = Path(__file__).resolve().parents[1]
EVENT = PoissonSubsampledGaussian(noise_multiplier=1.0, sample_rate=0.05, steps=20)
BUDGET = Budget(epsilon=3.0, delta=1e-5)
BIG = Budget(epsilon=1000.0, delta=1e-5)


def _plan(i: int, event=EVENT, r: int = 1, t: int | None = None) -> Plan:
    """With secure aggregation (t given), the aggregate event of r survivors, one colluder."""
    agg = None if t is None else aggregate_event(event, honest_members=r - 1, linear_sum=True)
    return Plan(round_id=f"r{i}", model_id="m1", event=event, aggregate_event=agg,
                cohort_size=r, secagg_threshold=t)


def _new(path: Path, budget: Budget = BIG, **kw) -> Ledger:
    return Ledger.open(path, budget=budget, device_id="dev-1", create=True, **kw)


def _filled(path: Path, n: int = 5) -> Path:
    with _new(path) as led:
        for i in range(n):
            res = led.reserve(_plan(i, r=8, t=5))
            if i % 2:
                led.commit(res)
    return path


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize(("kw", "match"), [
    ({"epsilon": 0.0, "delta": 1e-5}, r"epsilon must be a finite number > 0, got 0\.0"),
    ({"epsilon": math.inf, "delta": 1e-5}, r"epsilon .* got inf"),
    ({"epsilon": math.nan, "delta": 1e-5}, r"epsilon .* got nan"),
    ({"epsilon": True, "delta": 1e-5}, r"epsilon .* got True"),
    ({"epsilon": 1.0, "delta": 0.0}, r"delta must be a number in \(0, 1\), got 0\.0"),
    ({"epsilon": 1.0, "delta": 1.0}, r"delta .* got 1\.0"),
    ({"epsilon": 1.0, "delta": "1e-5"}, r"delta .* got '1e-5'"),
])
def test_budget_is_validated(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        Budget(**kw)


@pytest.mark.parametrize(("kw", "match"), [
    ({"round_id": ""}, r"round_id must be a non-empty str, got ''"),
    ({"model_id": 3}, r"model_id must be a non-empty str, got 3"),
    ({"event": 1.5}, r"event must be one of .* got float"),
    ({"cohort_size": 0}, r"cohort_size must be an integer >= 1, got 0"),
    ({"cohort_size": 2.0}, r"cohort_size .* got 2\.0"),
    ({"cohort_size": 4, "secagg_threshold": 5}, r"secagg_threshold .* \[1, cohort_size=4\], got 5"),
    ({"cohort_size": 4, "secagg_threshold": 0}, r"secagg_threshold .* got 0"),
    ({"aggregate_event": 1.5}, r"aggregate_event must be one of .* got float"),
    ({"aggregate_event": Gaussian(noise_multiplier=9.0)},
     r"without secure aggregation .* must be the local event"),
])
def test_plan_is_validated(kw, match) -> None:
    base = {"round_id": "r", "model_id": "m", "event": EVENT}
    with pytest.raises(ValueError, match=match):
        Plan(**{**base, **kw})


@pytest.mark.parametrize("event", [
    EVENT,
    Gaussian(noise_multiplier=2.0, steps=3),
    SampledWithoutReplacementGaussian(noise_multiplier=1.0, sample_size=5, dataset_size=50),
    Composed(events=(EVENT, Composed(events=(Gaussian(noise_multiplier=1.0),)))),
])
def test_events_round_trip_through_canonical_json(event) -> None:
    data = event_to_json(event)
    assert data["type"] == type(event).__name__
    assert event_from_json(json.loads(json.dumps(data))) == event


def test_event_json_is_canonical_and_strict() -> None:
    # The same mechanism always encodes the same way, whatever number types built it.
    assert event_to_json(Gaussian(noise_multiplier=2, steps=3)) == {
        "type": "Gaussian", "noise_multiplier": 2.0, "steps": 3, "adjacency": "add_remove"}
    good = {"type": "Gaussian", "noise_multiplier": 2.0, "steps": 3, "adjacency": "add_remove"}
    for bad, match in [({**good, "type": "Laplace"}, "unknown event type 'Laplace'"),
                       ({**good, "epsilon": 1.0}, "needs exactly the fields"),
                       ({"type": "Gaussian", "steps": 3}, "needs exactly the fields"),
                       ({**good, "steps": True}, r"steps must be a JSON int, got True"),
                       ({**good, "steps": 2.5}, r"steps must be a JSON int, got 2\.5"),
                       ({**good, "noise_multiplier": -1.0}, "noise_multiplier"),
                       ([1, 2], "must be a JSON object")]:
        with pytest.raises(ValueError, match=match):
            event_from_json(bad)


def test_plan_stores_the_aggregate_event_it_is_given() -> None:
    # The ledger never derives the aggregate view: the plan carries it, default the local.
    assert _plan(1).aggregate_event == EVENT
    assert _plan(1, r=16, t=9).aggregate_event == Composed(events=(
        PoissonSubsampledGaussian(noise_multiplier=1.0, sample_rate=0.05, steps=19),
        PoissonSubsampledGaussian(noise_multiplier=math.sqrt(15), sample_rate=0.05, steps=1)))


def test_legacy_entries_count_their_local_event_as_aggregate(tmp_path, monkeypatch) -> None:
    """A ledger written before the aggregate event was stored (the event column holds the
    bare event in the old canonical JSON, without adjacency; cohort_size 16) reads back
    soundly: the aggregate view is the local one, not the old z * sqrt(16) guess, and each
    event gets the adjacency it was stated under then."""
    import edge_sdk.ledger.store as ledger_mod

    path = tmp_path / "l.db"
    shuffle = Gaussian(noise_multiplier=0.5, steps=2, adjacency="substitution")
    texts = ['{"noise_multiplier":1.0,"sample_rate":0.05,"steps":20,'
             '"type":"PoissonSubsampledGaussian"}',
             '{"noise_multiplier":0.5,"steps":2,"type":"Gaussian"}']
    with monkeypatch.context() as m:  # write as the old code wrote
        m.setattr(ledger_mod, "_release_to_text", lambda plan: texts[0 if plan.event == EVENT
                                                                    else 1])
        with _new(path) as led:
            led.reserve(Plan(round_id="r1", model_id="m1", event=EVENT, cohort_size=16,
                             secagg_threshold=9))
            led.reserve(Plan(round_id="r2", model_id="m1", event=shuffle, cohort_size=16,
                             secagg_threshold=9))
    with Ledger.open(path) as led:  # verifies every byte and the chain
        plans = [r.plan for r in led.reservations()]
        spent = led.spent()
        led.reserve(_plan(3, r=16, t=9))  # and goes on in the new format
        assert led.reservations()[-1].plan == _plan(3, r=16, t=9)
    assert [(p.event, p.aggregate_event) for p in plans] == [(EVENT, EVENT), (shuffle, shuffle)]
    assert spent.aggregate_epsilon == spent.local_epsilon == pytest.approx(
        epsilon_rdp([EVENT, shuffle], BIG.delta))
    # The old report (z * sqrt(16) = 4) was far lower.
    old = epsilon_rdp([PoissonSubsampledGaussian(noise_multiplier=4.0, sample_rate=0.05,
                                                 steps=20),
                       Gaussian(noise_multiplier=2.0, steps=2, adjacency="substitution")],
                      BIG.delta)
    assert old < spent.aggregate_epsilon / 3
    with pytest.raises(ValueError, match="canonical"):
        ledger_mod._release_from_text(texts[1].replace(":2,", ": 2,"))


# ------------------------------------------------------------------ two-phase spend


def test_reservation_counts_before_commit_and_abort_refunds_nothing(tmp_path) -> None:
    with _new(tmp_path / "l.db", budget=BUDGET) as led:
        assert led.spent() == led.spent(delta=BUDGET.delta)
        assert led.spent().local_epsilon == 0.0 and led.spent().entries == 0
        one = epsilon_rdp([EVENT], BUDGET.delta)
        two = epsilon_rdp([EVENT, EVENT], BUDGET.delta)
        res = led.reserve(_plan(1))
        assert led.spent().local_epsilon == pytest.approx(one)  # counted, not yet committed
        assert led.pending() == (res,)
        led.commit(res)
        assert led.spent().local_epsilon == pytest.approx(one)  # commit changes no figure
        led.commit(res)  # idempotent
        res2 = led.reserve(_plan(2))
        led.abort(res2)
        assert led.spent().local_epsilon == pytest.approx(two)  # abort refunds nothing
        assert led.spent().entries == 2 and led.pending() == ()
        assert [e.kind for e in led.entries()] == ["reserve", "commit", "reserve", "abort"]
        assert [e.reservation for e in led.entries()] == [None, 1, None, 3]
        with pytest.raises(LedgerError, match="already recorded as abort"):
            led.commit(res2)
        with pytest.raises(LedgerError, match="already recorded as commit"):
            led.abort(res)
        assert len(led.entries()) == 4


def test_foreign_or_forged_reservations_are_refused(tmp_path) -> None:
    with _new(tmp_path / "a.db") as a, _new(tmp_path / "b.db") as b:
        res_a = a.reserve(_plan(1))
        b.reserve(_plan(1))
        with pytest.raises(LedgerError, match="not in this ledger"):
            b.commit(res_a)  # same seq and plan, another chain
        forged = Reservation(seq=7, plan=_plan(1), hash=res_a.hash)
        with pytest.raises(LedgerError, match="reservation 7 .* is not in this ledger"):
            a.commit(forged)
        with pytest.raises(ValueError, match="must be a Reservation"):
            a.commit(1)  # type: ignore[arg-type]


def test_budget_exhausted_names_spent_plan_and_budget(tmp_path) -> None:
    with _new(tmp_path / "l.db", budget=BUDGET) as led:
        n = 0
        while not led.would_exceed(_plan(n)):
            led.commit(led.reserve(_plan(n)))
            n += 1
        assert n >= 1
        before = led.entries()
        spent = led.spent().local_epsilon
        alone = epsilon_rdp([EVENT], BUDGET.delta)
        with pytest.raises(BudgetExhausted) as info:
            led.reserve(_plan(n))
        msg = str(info.value)
        assert f"spent eps={spent:.6g}" in msg and f"alone eps={alone:.6g}" in msg
        assert "> budget eps=3 " in msg and "delta=1e-05" in msg and f"'r{n}'" in msg
        assert led.entries() == before  # nothing written
        assert led.spent().local_epsilon <= BUDGET.epsilon
        assert led.remaining() == pytest.approx(BUDGET.epsilon - spent)
        # A smaller release may still fit.
        small = PoissonSubsampledGaussian(noise_multiplier=5.0, sample_rate=0.001, steps=1)
        assert not led.would_exceed(_plan(n, small))


def test_would_exceed_and_reports_are_pure(tmp_path) -> None:
    path = _filled(tmp_path / "l.db")
    calls = []

    def spy(events, delta):
        calls.append(len(events))
        return epsilon_rdp(events, delta)

    with Ledger.open(path, accountant=spy) as led:
        files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()}
        version = led._conn.execute("PRAGMA data_version").fetchone()[0]
        for _ in range(3):
            assert led.would_exceed(_plan(9, Gaussian(noise_multiplier=0.01))) is True
            assert led.would_exceed(_plan(9)) is False
            led.epsilon_if(_plan(9))
            led.spent()
            led.entries()
            led.pending()
        assert calls and calls[0] == 6  # the five reservations and the plan
        assert led._conn.execute("PRAGMA data_version").fetchone()[0] == version
        assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns)
                for p in tmp_path.iterdir()} == files
        assert len(led.entries()) == 7


def test_reopen_keeps_everything(tmp_path) -> None:
    path = tmp_path / "l.db"
    times = iter(range(1_700_000_000, 1_700_001_000, 10))
    with _new(path, clock=lambda: float(next(times))) as led:
        led.commit(led.reserve(_plan(1, r=8, t=5)))
        led.reserve(_plan(2, Composed(events=(EVENT, Gaussian(noise_multiplier=3.0))), r=8, t=5))
        before = (led.entries(), led.spent(), led.head(), led.pending())
    assert not Path(str(path) + "-wal").exists()  # at rest the main file holds everything
    with Ledger.open(path) as led:
        assert (led.entries(), led.spent(), led.head(), led.pending()) == before
        assert led.budget == BIG and led.device_id == "dev-1"
        assert [e.time for e in led.entries()] == [1_700_000_010.0, 1_700_000_020.0,
                                                   1_700_000_030.0]
        assert isinstance(led.entries()[0], Entry)
    with Ledger.open(path, budget=BIG, device_id="dev-1", create=True) as led:  # same ledger
        assert led.head() == before[2]
    with pytest.raises(LedgerError, match="differs from the stored"):
        Ledger.open(path, budget=Budget(epsilon=2000.0, delta=1e-5))
    with pytest.raises(LedgerError, match="belongs to device 'dev-1', not 'dev-2'"):
        Ledger.open(path, device_id="dev-2")


def test_injected_accountant_decides_and_reports(tmp_path) -> None:
    seen = []

    def one_per_release(events, delta):  # a toy accountant: eps 1 per release
        seen.append(list(events))
        return float(len(events))

    with _new(tmp_path / "l.db", budget=Budget(epsilon=3.5, delta=1e-6),
              accountant=one_per_release) as led:
        for i in range(3):
            led.reserve(_plan(i, r=4, t=3))
        with pytest.raises(BudgetExhausted, match=r"spent eps=3, .* together eps=4 > budget"):
            led.reserve(_plan(3, r=4, t=3))
        seen.clear()
        spent = led.spent(delta=1e-3)
        assert (spent.local_epsilon, spent.aggregate_epsilon, spent.delta, spent.entries) == (
            3.0, 3.0, 1e-3, 3)
        assert seen[0] == [EVENT] * 3 and seen[1] == [_plan(0, r=4, t=3).aggregate_event] * 3
        assert led.accountant is one_per_release
    with _new(tmp_path / "n.db", accountant=lambda events, delta: math.nan) as led:
        with pytest.raises(LedgerError, match="returned nan"):
            led.reserve(_plan(1))
        assert led.entries() == ()


def test_default_accountant_pld_is_available(tmp_path) -> None:
    with _new(tmp_path / "l.db", accountant=epsilon_pld) as led:
        led.reserve(_plan(1))
        pld = led.spent().local_epsilon
    assert 0 < pld <= epsilon_rdp([EVENT], BIG.delta)


def test_aggregate_view_in_spent(tmp_path) -> None:
    with _new(tmp_path / "l.db") as led:
        led.reserve(_plan(1, r=16, t=9))
        led.reserve(_plan(2, r=16))  # no secure aggregation: the aggregate is the local view
        spent = led.spent()
        assert led.reservations()[0].plan == _plan(1, r=16, t=9)  # stored, read back
    agg = _plan(1, r=16, t=9).aggregate_event
    assert spent.aggregate_epsilon == pytest.approx(epsilon_rdp([agg, EVENT], BIG.delta))
    assert spent.local_epsilon == pytest.approx(epsilon_rdp([EVENT, EVENT], BIG.delta))
    assert spent.aggregate_epsilon < spent.local_epsilon
    assert spent.adjacency == "zero_out"


def test_mixed_adjacencies_compose_under_zero_out(tmp_path) -> None:
    """Add/remove (Poisson) and substitution (without replacement, shuffle) events are all
    restated under zero-out, the ledger's relation, with their own numbers."""
    wor = SampledWithoutReplacementGaussian(noise_multiplier=1.0, sample_size=5, dataset_size=50)
    shuffle = Gaussian(noise_multiplier=0.5, steps=2, adjacency="substitution")
    with _new(tmp_path / "l.db") as led:
        for i, event in enumerate((EVENT, wor, shuffle)):
            led.reserve(_plan(i, event))
        spent = led.spent().local_epsilon
    from edge_sdk.privacy import RdpAccountant
    acc = RdpAccountant(adjacency="add_remove").compose(EVENT)
    acc_sub = RdpAccountant(adjacency="substitution").compose(wor).compose(shuffle)
    summed = RdpAccountant(adjacency="zero_out")
    summed._rdp = acc.rdp + acc_sub.rdp
    assert spent == pytest.approx(summed.get_epsilon(BIG.delta), rel=1e-12)
    # Under add/remove the substitution events have no sound restatement: refused.
    with pytest.raises(ValueError, match="no sound restatement"):
        RdpAccountant(adjacency="add_remove").compose(Composed(events=(EVENT, wor)))


def test_two_handles_share_one_budget(tmp_path) -> None:
    path = tmp_path / "l.db"
    with _new(path, budget=BUDGET) as a, Ledger.open(path) as b:
        n = 0
        while not a.would_exceed(_plan(n)):
            a.reserve(_plan(n))
            n += 1
        assert b.would_exceed(_plan(n))  # b reads what a appended
        with pytest.raises(BudgetExhausted):
            b.reserve(_plan(n))
        assert b.spent() == a.spent() and b.head() == a.head()


def test_closed_ledger_refuses_use(tmp_path) -> None:
    led = _new(tmp_path / "l.db")
    led.close()
    led.close()
    with pytest.raises(LedgerError, match="closed"):
        led.reserve(_plan(1))


# --------------------------------------------------------------- integrity, fail closed


def test_missing_or_empty_ledger_fails_closed(tmp_path) -> None:
    with pytest.raises(LedgerCorrupted, match="no ledger file; refusing to start again"):
        Ledger.open(tmp_path / "gone.db")
    assert not (tmp_path / "gone.db").exists()
    with pytest.raises(ValueError, match="needs a budget and a device_id"):
        Ledger.open(tmp_path / "new.db", create=True)
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    with pytest.raises(LedgerCorrupted, match="holds no ledger"):
        Ledger.open(empty)
    with _new(empty) as led:  # an interrupted creation may be completed at provisioning
        assert led.entries() == ()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 200)
    with pytest.raises(LedgerCorrupted, match="not a sqlite database"):
        Ledger.open(junk, budget=BUDGET, device_id="d", create=True)
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    with pytest.raises(LedgerCorrupted, match="schema is not the ledger's"):
        Ledger.open(other, budget=BUDGET, device_id="d", create=True)


def test_update_delete_and_gaps_are_refused(tmp_path) -> None:
    path = _filled(tmp_path / "l.db")
    conn = sqlite3.connect(path)
    for sql in ("UPDATE entries SET cohort_size = 5", "DELETE FROM entries WHERE seq = 5",
                "UPDATE meta SET body = '{}'", "DELETE FROM meta"):
        with pytest.raises(sqlite3.DatabaseError, match="append-only|fixed at creation"):
            conn.execute(sql)
    row = conn.execute("SELECT * FROM entries WHERE seq = 1").fetchone()
    with pytest.raises(sqlite3.DatabaseError, match="without gaps"):
        conn.execute(f"INSERT INTO entries VALUES ({', '.join('?' * len(row))})", (9, *row[1:]))
    conn.close()
    with Ledger.open(path) as led:
        assert len(led.entries()) == 7


def _tamper(path: Path, *sql: str) -> None:
    conn = sqlite3.connect(path)
    for s in sql:
        conn.execute(s)
    conn.commit()
    conn.close()


def _rewrite(path: Path, at: int, new: bytes) -> None:
    """Overwrite bytes in place, keeping the length, as someone with write access could."""
    data = path.read_bytes()
    path.write_bytes(data[:at] + new + data[at + len(new):])


def _event_of(data: bytes, round_id: str) -> int:
    """Offset of the event JSON of the reservation of ``round_id`` (its record holds the
    columns in order: kind, reservation, round_id, model_id, time, event, ...)."""
    return data.index(b'{"aggregate"', data.index(round_id.encode() + b"m1"))


def test_altered_entry_breaks_the_chain(tmp_path) -> None:
    path = _filled(tmp_path / "l.db")  # entry 4 is the reservation of round r2
    data = path.read_bytes()
    at = data.index(b'"noise_multiplier":', _event_of(data, "r2")) + len('"noise_multiplier":')
    _rewrite(path, at, b"9")
    with pytest.raises(LedgerCorrupted, match=r"entry 4: hash chain broken \(the entry was"):
        Ledger.open(path)


def test_altered_entry_with_its_hash_recomputed_breaks_the_next_link(tmp_path) -> None:
    path = _filled(tmp_path / "l.db")
    with Ledger.open(path) as led:
        fourth = led.entries()[3]
    original = _release_to_text(fourth_plan := _plan(2, r=8, t=5))
    assert original == _release_to_text(fourth_plan)
    forged = original.replace('"noise_multiplier":1.0', '"noise_multiplier":9.0', 1)
    row = {**entry_to_json(fourth), "event": forged}
    data = path.read_bytes()
    at = _event_of(data, "r2")
    _rewrite(path, at, forged.encode())
    _rewrite(path, data.index(fourth.hash.encode(), at),  # not entry 5's copy of it
             _row_hash(fourth.prev_hash, row).encode())
    with pytest.raises(LedgerCorrupted, match=r"entry 5: hash chain broken \(previous hash"):
        Ledger.open(path)


def test_dropping_a_trigger_to_rewrite_is_seen(tmp_path) -> None:
    path = _filled(tmp_path / "l.db")
    conn = sqlite3.connect(path)
    trigger, cookie = conn.execute(
        "SELECT sql, (SELECT schema_version FROM pragma_schema_version) FROM sqlite_master "
        "WHERE name = 'entries_no_delete'").fetchone()
    conn.close()
    # Cut the tail (which the chain alone cannot see), put the trigger and cookie back.
    _tamper(path, "DROP TRIGGER entries_no_delete", "DELETE FROM entries WHERE seq = 7",
            trigger, f"PRAGMA schema_version = {cookie}")
    with pytest.raises(LedgerCorrupted, match="schema is not the ledger's"):
        Ledger.open(path)
    path = _filled(tmp_path / "m.db")
    _tamper(path, "DROP TRIGGER entries_no_delete", "DELETE FROM entries WHERE seq = 7")
    with pytest.raises(LedgerCorrupted, match="schema is not the ledger's"):
        Ledger.open(path)


def test_tampering_while_open_closes_the_ledger(tmp_path) -> None:
    path = _filled(tmp_path / "l.db")
    with Ledger.open(path) as led:
        _tamper(path, "DROP TRIGGER entries_no_update",
                "UPDATE entries SET round_id = 'rX' WHERE seq = 7")
        with pytest.raises(LedgerCorrupted, match="entry 7 changed or vanished while open"):
            led.reserve(_plan(9))
        with pytest.raises(LedgerError, match="closed"):  # no half-loaded view survives
            led.spent()


def test_deleted_middle_entry_is_detected(tmp_path) -> None:
    path = _filled(tmp_path / "l.db")
    _tamper(path, "DROP TRIGGER entries_no_delete", "DELETE FROM entries WHERE seq = 3")
    with pytest.raises(LedgerCorrupted):
        Ledger.open(path)


@pytest.mark.parametrize("cut", ["one page", "half a page", "to the header"])
def test_truncated_file_is_detected(tmp_path, cut) -> None:
    path = _filled(tmp_path / "l.db", n=60)
    data = path.read_bytes()
    size = {"one page": len(data) - 4096, "half a page": len(data) - 2048,
            "to the header": 100}[cut]
    path.write_bytes(data[:size])
    with pytest.raises(LedgerCorrupted):
        Ledger.open(path)


def _flip(src: Path, dst: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(src.read_bytes())
    data[offset] ^= mask
    dst.write_bytes(bytes(data))


def _named_offsets(data: bytes) -> dict[str, int]:
    def inside(needle: bytes, skip: int = 0) -> int:
        at = data.find(needle)
        assert at >= 0, needle
        return at + skip

    return {
        "header page size": 16, "header change counter": 27, "header page count": 31,
        "header schema cookie": 43, "header reserved": 80, "header application id": 71,
        "schema text of a trigger": inside(b"append-only"),
        "metadata budget": inside(b'"epsilon":1000.0', 11),
        "an entry's event": inside(b'"noise_multiplier":1.0', 19),
        "an entry's round id": inside(b"r3"),
        "page 2 b-tree header": 4096 + 3,
        "page 3 cell pointer": 2 * 4096 + 9,
        "page 3 free space": 2 * 4096 + 2048,
        "last byte of the file": len(data) - 1,
    }


@pytest.mark.parametrize("where", [
    "header page size", "header change counter", "header page count", "header schema cookie",
    "header reserved", "header application id", "schema text of a trigger", "metadata budget",
    "an entry's event", "an entry's round id", "page 2 b-tree header", "page 3 cell pointer",
    "page 3 free space", "last byte of the file"])
def test_flipped_byte_is_detected_on_open(tmp_path, where) -> None:
    src = _filled(tmp_path / "src.db")
    offset = _named_offsets(src.read_bytes())[where]
    _flip(src, tmp_path / "x.db", offset)
    with pytest.raises(LedgerCorrupted):
        Ledger.open(tmp_path / "x.db")


def _undetected(src: Path, work: Path, offsets, mask: int) -> list[int]:
    missed = []
    for offset in offsets:
        dst = work / f"x{offset}.db"
        _flip(src, dst, offset, mask)
        try:
            Ledger.open(dst).close()
            missed.append(offset)
        except LedgerCorrupted:
            pass
        for p in work.glob(f"x{offset}.db*"):
            p.unlink()
    return missed


# The version number of the last SQLite library to write the file: any SQLite 3 may have,
# so these bytes are only range-checked (they hold no ledger data).
_WRITER_VERSION = range(96, 100)


def _interior_gaps(data: bytes, page_size: int = 4096) -> set[int]:
    """Offsets of the unused gap of interior b-tree pages, which the ledger does not check
    (SQLite leaves stale cell pointers there after a split; see edge_sdk.ledger)."""
    out: set[int] = set()
    for start in range(0, len(data), page_size):
        h = start + (100 if start == 0 else 0)
        if data[h] in (2, 5):
            ncell = int.from_bytes(data[h + 3:h + 5], "big")
            content = int.from_bytes(data[h + 5:h + 7], "big")
            out |= set(range(h + 12 + 2 * ncell, start + content))
    return out


def test_flipped_bytes_at_random_offsets_are_detected(tmp_path) -> None:
    src = _filled(tmp_path / "src.db", n=40)  # several leaf pages under an interior root
    data = src.read_bytes()
    checked = sorted(set(range(len(data))) - set(_WRITER_VERSION) - _interior_gaps(data))
    assert len(checked) > len(data) // 2
    rng = random.Random(3)
    offsets = sorted(rng.sample(checked, 200))
    assert _undetected(src, tmp_path, offsets, mask=1 << rng.randrange(8)) == []


def test_writer_version_bytes_change_no_ledger_data(tmp_path) -> None:
    src = _filled(tmp_path / "src.db")
    with Ledger.open(src) as led:
        expected = (led.entries(), led.head())
    for offset in _WRITER_VERSION:
        for p in tmp_path.glob("x.db*"):
            p.unlink()
        _flip(src, tmp_path / "x.db", offset, 0x01)
        try:
            with Ledger.open(tmp_path / "x.db") as led:
                assert (led.entries(), led.head()) == expected
        except LedgerCorrupted:
            pass  # out of the range of SQLite 3 version numbers


@pytest.mark.slow
@pytest.mark.parametrize("mask", [0x01, 0x80])
def test_every_flipped_byte_is_detected(tmp_path, mask) -> None:
    src = _filled(tmp_path / "src.db")
    offsets = [o for o in range(src.stat().st_size) if o not in _WRITER_VERSION]
    assert _undetected(src, tmp_path, offsets, mask) == []


def test_training_refuses_to_start_on_a_corrupted_ledger(tmp_path) -> None:
    """Must-show 4: the device opens its ledger before training; a flipped byte stops it."""
    src = _filled(tmp_path / "src.db")
    _flip(src, tmp_path / "dev.db", _named_offsets(src.read_bytes())["an entry's event"])
    trained = []

    def device_round(path: Path) -> None:
        with Ledger.open(path) as ledger:  # fail closed: raises before any training
            if not ledger.would_exceed(_plan(99)):
                trained.append(path)

    with pytest.raises(LedgerCorrupted, match="hash chain broken"):
        device_round(tmp_path / "dev.db")
    device_round(src)
    assert trained == [src]


# ------------------------------------------------------------------------ crash test


def _run_crash_test(path: Path, *, cycles: int, kills: int, seed: int) -> dict[str, float]:
    """Children reserve/commit in a loop; each is SIGKILLed at a random time. After every
    kill the ledger must open (and so verify) and count at least what the child released."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import ledger_crash_child as child_mod
    finally:
        sys.path.pop(0)
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    child_eps = epsilon_rdp([child_mod.EVENT], 1e-5)
    released = done_kills = during_startup = 0
    # Running estimates of a child's start-up time and of one cycle, from what children
    # printed (line timestamps are when the parent read them: floors keep bursts harmless).
    startup, cycle_time, cycle_count = 0.3, 0.0, 0
    t0 = time.monotonic()
    while released < cycles or done_kills < kills:
        assert done_kills < 20 * kills, "children make no progress"
        out: list[tuple[float, int]] = []
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "ledger_crash_child.py"), str(path), "10000000"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        started = time.monotonic()

        def read(stream=proc.stdout, out=out) -> None:
            for line in stream:
                if line.startswith("released "):
                    out.append((time.monotonic(), int(line.split()[1])))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        per_cycle = max(0.001, cycle_time / cycle_count if cycle_count else 0.003)
        target = max(1.0, (cycles - released) / max(1, kills - done_kills))
        # Some kills land in start-up (import, open, verify, checkpoint), most among cycles.
        time.sleep(rng.uniform(0, startup + 2 * target * per_cycle))
        proc.send_signal(signal.SIGKILL)
        rc = proc.wait()
        reader.join()
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
        assert rc == -signal.SIGKILL, f"the child died on its own (rc={rc}): {err}"
        done_kills += 1
        during_startup += not out
        if out:
            startup = max(0.1, 0.5 * startup + 0.5 * (out[0][0] - started))
            cycle_time += out[-1][0] - out[0][0]
            cycle_count += len(out) - 1
        last = max((n for _, n in out), default=released)
        with Ledger.open(path, budget=child_mod.BUDGET, device_id=child_mod.DEVICE_ID,
                         create=released == 0) as led:  # verifies the whole file
            reservations = led.reservations()
            spent = led.spent()
            pending = led.pending()
        # Everything the child said had been released is on disk, and counted.
        assert len(reservations) >= last
        assert spent.entries == len(reservations)
        assert spent.local_epsilon >= epsilon_rdp([child_mod.EVENT] * last, 1e-5) * (1 - 1e-12)
        agg = child_mod.AGGREGATE
        assert spent.aggregate_epsilon >= epsilon_rdp([agg] * last, 1e-5) * (1 - 1e-12)
        assert spent.device_epsilon is not None and spent.device_epsilon >= epsilon_rdp(
            [child_mod.DEVICE] * last, 1e-5) * (1 - 1e-12)  # the device unit too (issue 16)
        assert len(pending) <= done_kills  # at most one open reservation per kill
        released = len(reservations)
    return {"cycles": released, "kills": done_kills, "kills_in_startup": during_startup,
            "pending": len(pending), "seconds": round(time.monotonic() - t0, 2),
            "local_epsilon": spent.local_epsilon, "epsilon_per_cycle": child_eps}


def test_sigkill_at_random_points_never_undercounts(tmp_path) -> None:
    """Must-show 4: ~1,000 reserve/commit cycles across >= 20 SIGKILLs at random times."""
    stats = _run_crash_test(tmp_path / "crash.db", cycles=1000, kills=20, seed=7)
    print(f"crash test: {stats}")
    assert stats["cycles"] >= 1000 and stats["kills"] >= 20


@pytest.mark.slow
def test_sigkill_at_random_points_never_undercounts_long(tmp_path) -> None:
    stats = _run_crash_test(tmp_path / "crash.db", cycles=10_000, kills=150, seed=11)
    print(f"crash test (long): {stats}")
    assert stats["cycles"] >= 10_000 and stats["kills"] >= 150


def test_crash_between_reserve_and_commit_leaves_a_pending_spend(tmp_path) -> None:
    path = tmp_path / "l.db"
    code = (
        "import os, sys\n"
        "from edge_sdk.ledger import Budget, Ledger, Plan\n"
        "from edge_sdk.privacy import Gaussian\n"
        f"led = Ledger.open({str(path)!r}, budget=Budget(epsilon=100.0, delta=1e-5),"
        " device_id='d', create=True)\n"
        "led.reserve(Plan(round_id='r1', model_id='m', event=Gaussian(noise_multiplier=3.0)))\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with Ledger.open(path) as led:
        (res,) = led.pending()
        assert res.plan.round_id == "r1"
        assert led.spent().local_epsilon == pytest.approx(
            epsilon_rdp([Gaussian(noise_multiplier=3.0)], 1e-5))
        led.abort(res)  # after restart the device may close it; it still counts
        assert led.pending() == () and led.spent().entries == 1


# ------------------------------------------------------------------------------- CLI


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="fedge")
    add_ledger_parser(parser.add_subparsers(dest="command", required=True))
    return run_ledger(parser.parse_args(["ledger", *argv]))


def test_cli_show_json(tmp_path, capsys) -> None:
    path = tmp_path / "l.db"
    with _new(path, budget=BUDGET) as led:
        led.commit(led.reserve(_plan(1, r=4, t=3)))
        led.reserve(_plan(2))
        spent = led.spent()
    assert _cli("show", "--path", str(path), "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert [e["kind"] for e in out["entries"]] == ["reserve", "commit", "reserve"]
    first, commit, second = out["entries"]
    assert first["event"] == event_to_json(EVENT)
    assert (first["cohort_size"], first["secagg_threshold"]) == (4, 3)
    assert first["running_local_epsilon"] == pytest.approx(epsilon_rdp([EVENT], 1e-5))
    assert first["running_aggregate_epsilon"] < first["running_local_epsilon"]
    assert commit["running_local_epsilon"] == first["running_local_epsilon"]
    assert second["running_local_epsilon"] == pytest.approx(out["local_epsilon"])
    assert (out["local_epsilon"], out["aggregate_epsilon"], out["delta"]) == pytest.approx(
        (spent.local_epsilon, spent.aggregate_epsilon, 1e-5))
    assert out["budget"] == {"epsilon": 3.0, "delta": 1e-5, "device_epsilon": None}
    assert out["device_epsilon"] is None  # no device-level event stated (issue 16)
    assert (out["reservations"], out["pending"], out["accountant"]) == (2, 1, "rdp")
    assert out["device_id"] == "dev-1" and len(out["head"]) == 64


def test_cli_show_text_recomputes_from_parameters(tmp_path, capsys) -> None:
    # Written by a (broken) accountant that called everything free: show recomputes from the
    # stored mechanism parameters, and a release without noise is infinite epsilon.
    path = tmp_path / "l.db"
    with _new(path, accountant=lambda events, delta: 0.0) as led:
        led.reserve(_plan(1, r=4, t=3))
        led.reserve(_plan(2, Gaussian(noise_multiplier=0.0)))
    assert _cli("show", "--path", str(path)) == 0
    text = capsys.readouterr().out
    assert ("budget eps=1000 (sample-level, local) and device-level eps=none (aggregate) at "
            "delta=1e-05") in text
    assert "PoissonSubsampledGaussian(noise_multiplier=1.0" in text
    assert "spent: local eps=inf" in text and "secure-aggregation threshold" in text
    assert _cli("show", "--path", str(path), "--json", "--accountant", "pld") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["local_epsilon"] is None and out["accountant"] == "pld"
    assert out["entries"][0]["running_local_epsilon"] == pytest.approx(
        epsilon_pld([EVENT], 1e-5))
    assert out["entries"][1]["running_local_epsilon"] is None


def test_cli_verify_and_fail_closed(tmp_path, capsys) -> None:
    path = _filled(tmp_path / "l.db")
    assert _cli("verify", "--path", str(path)) == 0
    assert "ok:" in capsys.readouterr().out
    shutil.copy(path, tmp_path / "bad.db")
    _flip(path, tmp_path / "bad.db", _named_offsets(path.read_bytes())["an entry's event"])
    assert _cli("verify", "--path", str(tmp_path / "bad.db")) == 3
    err = capsys.readouterr().err
    assert "hash chain broken" in err and "must not train" in err
    assert _cli("show", "--path", str(tmp_path / "nope.db")) == 3
    assert not (tmp_path / "nope.db").exists()
