"""One privacy Event union (issue 15, plan15 F1): the discrete events are frozen data with
their adjacency, SelfComposed means repetition, accountants say what they support and
raise UnsupportedEventError for the rest, and the ledger stores every kind."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.errors import EdgeError
from edge_sdk.ledger import Budget, Ledger, Plan, event_from_json, event_to_json
from edge_sdk.privacy import (
    Composed,
    DistributedDiscreteGaussian,
    DistributedSkellam,
    Gaussian,
    PldAccountant,
    PoissonSubsampledGaussian,
    RdpAccountant,
    SampledWithoutReplacementGaussian,
    SelfComposed,
    UnsupportedEventError,
    ZcdpAccountant,
    adjacencies_of,
    compute_rdp,
    compute_rho,
    rdp_distributed_discrete_gaussian,
    rdp_distributed_skellam,
    rdp_of,
    restate,
)

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
DDG = DistributedDiscreteGaussian(l2_sensitivity=30.0, l1_sensitivity=300.0, sigma=8.0,
                                  devices=20, dim=128, steps=2)
SK = DistributedSkellam(l1_sensitivity=300.0, l2_sensitivity=30.0, mu=40.0, devices=20)
PSG = PoissonSubsampledGaussian(noise_multiplier=1.1, sample_rate=0.01, steps=10)
WOR = SampledWithoutReplacementGaussian(noise_multiplier=2.0, sample_size=8, dataset_size=64)
ORDERS = (1.5, 2.0, 3.0, 8.0, 32.0)


def test_discrete_events_carry_their_adjacency() -> None:
    assert DDG.adjacency == SK.adjacency == "add_remove"  # what every producer states today
    for adj in ("add_remove", "substitution", "zero_out"):
        assert dataclasses.replace(SK, adjacency=adj).adjacency == adj
    with pytest.raises(ValueError, match="DistributedSkellam.adjacency must be one of "
                                         "add_remove, substitution, zero_out, got 'device'"):
        dataclasses.replace(SK, adjacency="device")
    with pytest.raises(dataclasses.FrozenInstanceError):
        DDG.sigma = 1.0  # type: ignore[misc]
    assert adjacencies_of(Composed(events=(DDG, dataclasses.replace(SK, adjacency="zero_out"))))\
        == {"add_remove", "zero_out"}


def test_discrete_restatement_rules() -> None:
    sub = dataclasses.replace(SK, adjacency="substitution")
    assert restate(sub, "zero_out") == dataclasses.replace(SK, adjacency="zero_out")  # rule 1
    # add/remove -> zero-out: a device that is the null record still adds its noise share.
    with pytest.raises(UnsupportedEventError, match="DistributedDiscreteGaussian stated under "
                                                    "add_remove adjacency has no sound"):
        restate(DDG, "zero_out")
    with pytest.raises(UnsupportedEventError, match="no sound restatement"):
        restate(SK, "substitution")


def test_rdp_accountant_takes_discrete_events_by_the_discrete_bounds() -> None:
    a = np.array(ORDERS)
    want = (2 * rdp_distributed_discrete_gaussian(30.0, 300.0, 8.0, 20, 128, a)
            + 3 * rdp_distributed_skellam(300.0, 30.0, 40.0, 20, a))
    acc = RdpAccountant(ORDERS).compose(DDG).compose(SK, count=3)
    np.testing.assert_array_equal(acc.rdp, want)
    np.testing.assert_array_equal(compute_rdp(Composed(events=(DDG, SelfComposed(event=SK,
                                                                                  count=3))),
                                              ORDERS), want)
    # stated under zero-out, they compose into a zero-out accountant with the same numbers
    zo = [dataclasses.replace(e, adjacency="zero_out") for e in (DDG, SK)]
    acc_zo = RdpAccountant(ORDERS, adjacency="zero_out").compose(zo[0]).compose(zo[1], count=3)
    np.testing.assert_array_equal(acc_zo.rdp, want)
    np.testing.assert_array_equal(rdp_of(zo[1], ORDERS), rdp_of(SK, ORDERS))


def test_self_composed_is_repetition() -> None:
    for event in (PSG, DDG, Composed(events=(PSG, SK))):
        once = RdpAccountant(ORDERS).compose(event, count=4).rdp
        np.testing.assert_array_equal(
            RdpAccountant(ORDERS).compose(SelfComposed(event=event, count=4)).rdp, once)
    nested = SelfComposed(event=SelfComposed(event=PSG, count=2), count=3)
    np.testing.assert_array_equal(compute_rdp(nested, ORDERS), compute_rdp(PSG, ORDERS) * 6)
    assert compute_rho(nested) == 6 * compute_rho(PSG)
    pld_a = PldAccountant().compose(nested)
    pld_b = PldAccountant().compose(PSG, count=6)
    assert pld_a.get_epsilon(1e-5) == pld_b.get_epsilon(1e-5)
    assert restate(nested, "zero_out") == SelfComposed(
        event=SelfComposed(event=dataclasses.replace(PSG, adjacency="zero_out"), count=2),
        count=3)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=f"count must be an integer >= 1, got {bad!r}"):
            SelfComposed(event=PSG, count=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="event must be one of Gaussian, .*got 3"):
        SelfComposed(event=3, count=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("make", "takes"), [
    (lambda: RdpAccountant(), {"psg", "self_psg", "ddg", "sk", "self_ddg", "g"}),
    (lambda: RdpAccountant(adjacency="substitution"), {"wor_sub", "g"}),
    (lambda: PldAccountant(), {"psg", "self_psg", "g"}),
    (lambda: ZcdpAccountant(), {"psg", "self_psg", "g"}),
])
def test_supports_says_what_compose_takes(make, takes: set[str]) -> None:
    events = {"psg": PSG, "self_psg": SelfComposed(event=PSG, count=2), "wor_sub": WOR,
              "ddg": DDG, "sk": SK, "self_ddg": SelfComposed(event=DDG, count=2),
              "g": Gaussian(noise_multiplier=2.0), "not_an_event": "Gaussian(2)"}
    for name, event in events.items():
        acc = make()
        assert acc.supports(event) is (name in takes), name
        if name in takes:
            acc.compose(event)
            continue
        with pytest.raises(UnsupportedEventError) as info:
            acc.compose(event)
        assert isinstance(info.value, EdgeError) and isinstance(info.value, ValueError)


def test_unsupported_event_leaves_the_accountant_as_it_was() -> None:
    for acc in (PldAccountant(), ZcdpAccountant()):
        acc.compose(PSG)
        before = acc.get_epsilon(1e-5)
        with pytest.raises(UnsupportedEventError, match="unsupported privacy event "
                                                        "DistributedSkellam"):
            acc.compose(Composed(events=(PSG, SK)))
        assert acc.get_epsilon(1e-5) == before


# ------------------------------------------------------------------------------- ledger


@pytest.mark.parametrize("event", [
    DDG, SK, dataclasses.replace(SK, adjacency="zero_out"), SelfComposed(event=PSG, count=5),
    Composed(events=(SelfComposed(event=DDG, count=2), WOR)),
])
def test_ledger_json_round_trips_every_kind(event) -> None:
    data = event_to_json(event)
    assert event_from_json(data) == event
    if isinstance(event, DistributedDiscreteGaussian):
        assert data == {"type": "DistributedDiscreteGaussian", "l2_sensitivity": 30.0,
                        "l1_sensitivity": 300.0, "sigma": 8.0, "devices": 20, "dim": 128,
                        "steps": 2, "adjacency": "add_remove"}


@pytest.mark.parametrize(("data", "match"), [
    ({"type": "SelfComposed", "event": event_to_json(PSG)}, "exactly an object 'event' and"),
    ({"type": "SelfComposed", "event": event_to_json(PSG), "count": True}, "an int 'count'"),
    ({"type": "SelfComposed", "event": event_to_json(PSG), "count": 0}, "count must be"),
    ({**event_to_json(SK), "devices": 2.5}, "DistributedSkellam.devices must be a JSON int"),
    ({k: v for k, v in event_to_json(SK).items() if k != "adjacency"}, "needs exactly"),
])
def test_ledger_json_rejects_bad_new_kinds(data, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        event_from_json(data)


def test_legacy_entries_cannot_hold_new_kinds() -> None:
    legacy = {k: v for k, v in event_to_json(SK).items() if k != "adjacency"}
    with pytest.raises(ValueError, match="a legacy entry cannot hold a DistributedSkellam"):
        event_from_json(legacy, legacy=True)


def test_ledger_stores_and_charges_discrete_and_self_composed_events(tmp_path) -> None:
    zo_sk = dataclasses.replace(SK, adjacency="zero_out")
    plans = [Plan(round_id="r1", model_id="m", event=zo_sk),
             Plan(round_id="r2", model_id="m", event=SelfComposed(event=PSG, count=3))]
    with Ledger.open(tmp_path / "l.db", budget=Budget(epsilon=1e3, delta=1e-5),
                     device_id="d", create=True) as led:
        for p in plans:
            led.commit(led.reserve(p))
        with pytest.raises(UnsupportedEventError, match="no sound restatement"):
            led.reserve(Plan(round_id="r3", model_id="m", event=SK))  # add/remove: refused
    with Ledger.open(tmp_path / "l.db") as led:  # verifies every byte and the chain
        assert [r.plan for r in led.reservations()] == plans
        spent = led.spent()
    want = RdpAccountant(adjacency="zero_out").compose(zo_sk).compose(PSG, count=3)
    assert spent.local_epsilon == want.get_epsilon(1e-5)


def test_a_ledger_written_before_f1_still_reads(tmp_path) -> None:
    # tests/golden/ledger_v1_pre_f1.db was written by the code at 468c399 (before F1):
    # reserve+commit, reserve+abort, reserve+commit. Its numbers were printed then.
    path = tmp_path / "old.db"
    shutil.copyfile(GOLDEN / "ledger_v1_pre_f1.db", path)
    with Ledger.open(path, device_id="dev-fixture") as led:
        assert led.head() == "c20cdd922efa4bbe546908b8d6c998e6bb55c526bb14bb8e4c66213392675689"
        spent = led.spent()
        assert spent.local_epsilon == spent.aggregate_epsilon == 16.88341567460668
        assert [r.plan.round_id for r in led.reservations()] == ["r1", "r2", "r3"]
        led.commit(led.reserve(Plan(round_id="r4", model_id="m2",
                                    event=dataclasses.replace(SK, adjacency="zero_out"))))
    with Ledger.open(path) as led:  # the new kinds extend the old file, still verifiable
        assert led.spent().local_epsilon > 16.88341567460668
        assert not math.isinf(led.spent().local_epsilon)
