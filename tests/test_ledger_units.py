"""The ledger holds both units (issue 16): sample-level local and aggregate figures and the
device-level aggregate one, each with its adjacency and assumptions; a budget on either
unit; the store's round trip, old-format read and ``fedge ledger show``."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

import edge_sdk.ledger.store as store_mod
from edge_sdk import ddp
from edge_sdk.ledger import (
    Assumptions,
    Book,
    Budget,
    BudgetExhausted,
    Ledger,
    LedgerCorrupted,
    LedgerError,
    Plan,
    epsilon_rdp,
)
from edge_sdk.privacy import PoissonSubsampledGaussian
from tools.ledger_cli import add_ledger_parser, run_ledger

DELTA = 1e-5
CFG = ddp.DistributedDP(clip=1.0, gamma=1 / 1024, noise="discrete_gaussian", bits=24,
                        sigma=200.0)
HONEST = 7
LOCAL = ddp.event(CFG, 1, 1000, adjacency="substitution")
AGG = ddp.event(CFG, HONEST, 1000, adjacency="substitution")
DEVICE = ddp.event(CFG, HONEST, 1000, adjacency="zero_out")
SAMPLE = PoissonSubsampledGaussian(noise_multiplier=1.0, sample_rate=0.05, steps=20)


def _dev_plan(i: int) -> Plan:
    """A device-dp round: min_survivors 8, one colluder, t 5."""
    return Plan(round_id=f"r{i}", model_id="m", event=LOCAL, aggregate_event=AGG,
                cohort_size=8, secagg_threshold=5, device_event=DEVICE, colluders=1)


def _sample_plan(i: int) -> Plan:
    """A round of a mechanism with no device-level theorem (no device event)."""
    return Plan(round_id=f"s{i}", model_id="m", event=SAMPLE, cohort_size=8,
                secagg_threshold=4, colluders=2)


def test_book_gives_each_unit_with_adjacency_and_assumptions() -> None:
    book = Book(budget=None, delta=DELTA)
    assert book.spent().device_epsilon == 0.0  # nothing released
    for i in range(3):
        book.reserve(_dev_plan(i))
    s = book.spent()
    assert s.local_epsilon == pytest.approx(epsilon_rdp([LOCAL] * 3, DELTA), rel=1e-12)
    assert s.aggregate_epsilon == pytest.approx(epsilon_rdp([AGG] * 3, DELTA), rel=1e-12)
    assert s.device_epsilon == pytest.approx(epsilon_rdp([DEVICE] * 3, DELTA), rel=1e-12)
    # zero-out of the device (D2) is below its substitution (2 D2), below one share alone
    assert 0 < s.device_epsilon < s.aggregate_epsilon < s.local_epsilon < math.inf
    local, agg, dev = book.figures()
    assert [(f.unit, f.view) for f in (local, agg, dev)] == [
        ("sample", "local"), ("sample", "aggregate"), ("device", "aggregate")]
    assert {f.adjacency for f in (local, agg, dev)} == {"zero_out"}
    assert (local.epsilon, agg.epsilon, dev.epsilon) == (
        s.local_epsilon, s.aggregate_epsilon, s.device_epsilon)
    assert local.assumptions == Assumptions(min_survivors=None, secagg_threshold=None,
                                            colluders=None, semi_honest_aggregator=False)
    assert agg.assumptions == dev.assumptions == Assumptions(
        min_survivors=8, secagg_threshold=5, colluders=1, semi_honest_aggregator=True)


def test_device_figure_is_none_over_a_round_without_a_device_event() -> None:
    """No theorem covers the mixed history: None, never the partial sum of the others."""
    book = Book(budget=None, delta=DELTA)
    book.reserve(_dev_plan(0))
    assert book.device_epsilon_if(_sample_plan(1)) is None
    assert book.device_epsilon_if(_dev_plan(1)) == pytest.approx(
        epsilon_rdp([DEVICE] * 2, DELTA))
    book.reserve(_sample_plan(1))
    book.reserve(_dev_plan(2))
    s = book.spent()
    assert s.device_epsilon is None and book.figures()[2].epsilon is None
    assert s.local_epsilon == pytest.approx(epsilon_rdp([LOCAL, SAMPLE, LOCAL], DELTA))
    # the weakest assumptions over the history: the smaller t, the more colluders
    assert book.assumptions() == Assumptions(min_survivors=8, secagg_threshold=4,
                                             colluders=2, semi_honest_aggregator=True)
    only = Book(budget=None, delta=DELTA)
    only.reserve(_sample_plan(0))
    assert only.spent().device_epsilon is None


def test_budget_on_the_device_unit_refuses() -> None:
    one = epsilon_rdp([DEVICE], DELTA)
    assert one < 2 * one < epsilon_rdp([LOCAL] * 2, DELTA)
    # the sample-level budget is far away; the device one pays for two rounds, not three
    limit = epsilon_rdp([DEVICE] * 2, DELTA) * (1 + 1e-9)
    book = Book(budget=Budget(epsilon=1e6, delta=DELTA, device_epsilon=limit))
    book.reserve(_dev_plan(0))
    assert not book.would_exceed(_dev_plan(1))
    book.reserve(_dev_plan(1))
    assert book.would_exceed(_dev_plan(2))
    with pytest.raises(BudgetExhausted, match=r"device-level eps spent .* > device budget"):
        book.reserve(_dev_plan(2))
    assert len(book.reservations()) == 2  # nothing counted by the refusal
    # a plan without a device-level event cannot show it stays under: refused too
    fresh = Book(budget=Budget(epsilon=1e6, delta=DELTA, device_epsilon=100.0))
    assert fresh.would_exceed(_sample_plan(0))
    with pytest.raises(BudgetExhausted, match="after this plan None"):
        fresh.reserve(_sample_plan(0))
    # without a device budget the same plan goes (the sample-level one has room)
    assert not Book(budget=Budget(epsilon=1e6, delta=DELTA)).would_exceed(_sample_plan(0))


def test_budget_on_the_sample_unit_still_refuses() -> None:
    book = Book(budget=Budget(epsilon=epsilon_rdp([LOCAL], DELTA) * 1.5, delta=DELTA,
                              device_epsilon=1e6))
    book.reserve(_dev_plan(0))
    with pytest.raises(BudgetExhausted, match="local"):
        book.reserve(_dev_plan(1))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "1"])
def test_device_budget_must_be_finite_positive(bad) -> None:
    with pytest.raises(ValueError, match="device_epsilon"):
        Budget(epsilon=1.0, delta=DELTA, device_epsilon=bad)


def test_plan_checks_its_device_fields() -> None:
    with pytest.raises(ValueError, match="device_event must be None or one of"):
        Plan(round_id="r", model_id="m", event=SAMPLE, device_event=1.0)
    with pytest.raises(ValueError, match=r"colluders must be None or an integer in \[0, "):
        Plan(round_id="r", model_id="m", event=SAMPLE, cohort_size=4, colluders=4)


# ------------------------------------------------------------------------------ store


def _open_new(path: Path, budget: Budget) -> Ledger:
    return Ledger.open(path, budget=budget, device_id="dev-1", create=True)


def test_store_round_trip_of_both_units(tmp_path) -> None:
    path = tmp_path / "l.db"
    budget = Budget(epsilon=1e6, delta=DELTA, device_epsilon=1e3)
    with _open_new(path, budget) as led:
        led.commit(led.reserve(_dev_plan(0)))
        led.reserve(_dev_plan(1))
        before = led.spent()
    assert before.device_epsilon == pytest.approx(epsilon_rdp([DEVICE] * 2, DELTA))
    with Ledger.open(path) as led:  # verifies every byte and the chain
        assert led.version == store_mod.SCHEMA_VERSION == 2
        assert led.budget == budget
        plans = [r.plan for r in led.reservations()]
        assert plans == [_dev_plan(0), _dev_plan(1)]
        assert [e.device_event for e in led.entries()] == [DEVICE, None, DEVICE]
        assert led.spent() == before
        assert led.figures()[2].assumptions.colluders == 1
        with pytest.raises(BudgetExhausted, match="after this plan None"):
            led.reserve(_sample_plan(2))  # the device budget: no theorem, no round
        assert len(led.entries()) == 3  # nothing written
    with pytest.raises(LedgerError, match="differs from the stored"):
        Ledger.open(path, budget=Budget(epsilon=1e6, delta=DELTA))  # device budget lost


def test_version_1_ledger_reads_with_no_device_budget_and_goes_on(tmp_path,
                                                                  monkeypatch) -> None:
    """A ledger written as before issue 16 (metadata version 1, a budget without
    device_epsilon, user_version 1, two-view entries) opens and verifies: no device-level
    limit, no device-level event on its entries (the figure is None), and new entries
    with device events are appended and read back."""
    path = tmp_path / "old.db"
    with monkeypatch.context() as m:
        m.setattr(store_mod, "SCHEMA_VERSION", 1)
        with _open_new(path, Budget(epsilon=1e6, delta=DELTA)) as led:
            led.reserve(Plan(round_id="o1", model_id="m", event=SAMPLE, cohort_size=8,
                             secagg_threshold=4))
        with pytest.raises(ValueError, match="version 1 ledger cannot hold a device"):
            _open_new(tmp_path / "x.db", Budget(epsilon=1.0, delta=DELTA, device_epsilon=1.0))
    meta = json.loads(__import__("sqlite3").connect(path).execute(
        "SELECT body FROM meta").fetchone()[0])
    assert meta["version"] == 1 and set(meta["budget"]) == {"epsilon", "delta"}
    with Ledger.open(path) as led:
        assert led.version == 1
        assert led.budget == Budget(epsilon=1e6, delta=DELTA)
        assert led.budget.device_epsilon is None
        (entry,) = led.entries()
        assert entry.device_event is None and entry.colluders is None
        assert led.spent().device_epsilon is None
        led.reserve(_dev_plan(1))
    with Ledger.open(path) as led:
        assert [r.plan for r in led.reservations()][1] == _dev_plan(1)
        assert led.spent().device_epsilon is None  # the old round has no device theorem
    with pytest.raises(ValueError, match="device_epsilon must be None or"):
        Budget(epsilon=1.0, delta=DELTA, device_epsilon=0)


def test_a_version_this_build_does_not_know_is_refused(tmp_path, monkeypatch) -> None:
    """A file of a later version (as a later build would write it) fails closed."""
    path = tmp_path / "new.db"
    want = r"version 3, expected 'fedge-ledger' version in \(1, 2\)"
    with monkeypatch.context() as m:
        m.setattr(store_mod, "SCHEMA_VERSION", 3)
        with pytest.raises(LedgerCorrupted, match=want):  # written, then verified
            _open_new(path, Budget(epsilon=1.0, delta=DELTA))
    with pytest.raises(LedgerCorrupted, match=want):
        Ledger.open(path)


# -------------------------------------------------------------------------------- CLI


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="fedge")
    add_ledger_parser(parser.add_subparsers(dest="command", required=True))
    return run_ledger(parser.parse_args(["ledger", *argv]))


def test_cli_show_prints_both_units_with_their_assumptions(tmp_path, capsys) -> None:
    path = tmp_path / "l.db"
    with _open_new(path, Budget(epsilon=1e6, delta=DELTA, device_epsilon=50.0)) as led:
        led.commit(led.reserve(_dev_plan(0)))
        led.reserve(_dev_plan(1))
    assert _cli("show", "--path", str(path)) == 0
    out = capsys.readouterr().out
    dev = epsilon_rdp([DEVICE] * 2, DELTA)
    agg = epsilon_rdp([AGG] * 2, DELTA)
    assert "device-level eps=50 (aggregate)" in out
    assert (f"  device-level aggregate eps={dev:.4g} at delta=1e-05; zero_out of one device; "
            "secure aggregation threshold t>=5, sums of >=8 survivors, <=1 colluders "
            "tolerated, semi-honest aggregator") in out
    assert f"  sample-level aggregate eps={agg:.4g} at delta=1e-05; zero_out of one sample" in out
    assert "  sample-level local     eps=" in out and "no trust needed" in out
    assert _cli("show", "--path", str(path), "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device_epsilon"] == pytest.approx(dev)
    assert data["budget"]["device_epsilon"] == 50.0 and data["version"] == 2
    units = {(f["unit"], f["view"]): f for f in data["figures"]}
    assert units["device", "aggregate"]["epsilon"] == pytest.approx(dev)
    assert units["device", "aggregate"]["assumptions"] == {
        "min_survivors": 8, "secagg_threshold": 5, "colluders": 1,
        "semi_honest_aggregator": True}
    assert units["sample", "local"]["assumptions"]["semi_honest_aggregator"] is False
    assert data["entries"][0]["device_event"]["adjacency"] == "zero_out"


def test_cli_show_says_none_where_no_device_theorem(tmp_path, capsys) -> None:
    path = tmp_path / "l.db"
    with _open_new(path, Budget(epsilon=1e6, delta=DELTA)) as led:
        led.reserve(_dev_plan(0))
        led.reserve(_sample_plan(1))
    assert _cli("show", "--path", str(path)) == 0
    out = capsys.readouterr().out
    assert "device-level aggregate eps=none (no device-level theorem for some release)" in out
    assert "<=2 colluders tolerated" in out and "t>=4" in out
    assert _cli("show", "--path", str(path), "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device_epsilon"] is None and data["budget"]["device_epsilon"] is None
