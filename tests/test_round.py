"""edge_sdk.round (plan15 G2): a device's part of a round up to its upload, without messages.

``open_round`` is driven directly with signed plans, a pure ``Book`` (or a fault-injecting
wrapper) as the ledger, the digits data and the real engine: each decline's reason and
whether it left anything in the ledger, that the spend is reserved before the round's rng is
asked for (so before any training), and that the contribution is the plan's mechanism's,
drawn from the round's rng."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from edge_sdk import compress, secagg, wire
from edge_sdk import round as device_round
from edge_sdk.csprng import seeded_round_rng
from edge_sdk.errors import RemoteProtocolError
from edge_sdk.ledger import Book, Budget, LedgerError
from edge_sdk.mechanisms import MECHANISMS, GaussianRound
from edge_sdk.model import init_params
from edge_sdk.round import (
    Declined,
    Prepared,
    coordinates,
    has_mechanism,
    honest_members,
    mechanism_round,
    open_round,
)

FLEET = "lab"
COHORT = ("d00", "d01", "d02", "d03", "d04")
AGG = secagg.AggregatorIdentity.generate()


@pytest.fixture(scope="module")
def model(engine: Any, digits: Any) -> dict[str, Any]:
    spec, eng = engine
    params = init_params(spec, np.random.default_rng(1))
    return {"eng": eng, "params": params, "d": sum(p.size for p in params),
            "data": (digits.x_train[:60], digits.y_train[:60])}


def _plan(d: int, *, round_id: int = 1, sparsity: float = 1.0, **changes: Any) -> wire.RoundPlan:
    k = d if sparsity == 1.0 else compress.kept_count(d, sparsity)
    cfg = secagg.RoundConfig.for_cohort(round_id=round_id, nonce=bytes(32), cohort=list(COHORT),
                                        bits=32, length=k)
    params = wire.GaussianParams(steps=2, batch_size=8, lr=0.1, sampling="poisson", clip=1.0,
                                 noise_multiplier=1.0, sparsity=sparsity, quant_levels=0,
                                 scale=2.0**10, value_bound=1.0)
    pfields = {f.name for f in dataclasses.fields(wire.GaussianParams)}
    params = dataclasses.replace(params, **{k: changes.pop(k) for k in list(changes)
                                            if k in pfields})
    plan = wire.RoundPlan(
        round_id=round_id, model_version=0, cohort=cfg.cohort, mechanism="gaussian",
        params=params, round_seed=bytes(range(32)), bits=32, length=k, nonce=cfg.nonce,
        degree=cfg.degree, threshold=cfg.threshold, min_survivors=cfg.threshold,
        max_colluders=1, stage_timeout=10.0)
    return wire.sign(dataclasses.replace(plan, **changes), AGG)


def _book(epsilon: float = 50.0) -> Book:
    return Book(budget=Budget(epsilon=epsilon, delta=1e-5))


class _Calls:
    """Records the order in which open_round calls data() and round_rng(), and what the
    ledger held at each call."""

    def __init__(self, ledger: Any, data: Any, seed: int = 3) -> None:
        self.ledger, self.log = ledger, []
        self._data, self._rng = data, seeded_round_rng(seed)

    def data(self) -> Any:
        self.log.append(("data", len(self.ledger.reservations())))
        return self._data

    def round_rng(self, round_id: int) -> Any:
        self.log.append(("rng", len(self.ledger.reservations())))
        return self._rng(round_id)


def _open(model: dict[str, Any], plan: wire.RoundPlan, ledger: Any, **kw: Any
          ) -> tuple[Declined | Prepared, _Calls]:
    calls = _Calls(ledger, kw.pop("data", model["data"]))
    args = dict(fleet=FLEET, ledger=ledger, params=model["params"], model_version=0,
                data=calls.data, engine=model["eng"], dim=model["d"],
                round_rng=calls.round_rng, max_colluders=1)
    return open_round(plan, **{**args, **kw}), calls


def test_prepared_reserves_before_the_rng_and_contributes_the_mechanisms_values(model) -> None:
    d = model["d"]
    for sparsity in (1.0, 0.25):
        plan = _plan(d, sparsity=sparsity)
        book = _book()
        got, calls = _open(model, plan, book)
        assert isinstance(got, Prepared)
        # data after the cheap checks, the rng only once the spend is in the ledger
        assert calls.log == [("data", 0), ("rng", 1)]
        (res,) = book.reservations()
        assert res == got.reservation and res.plan == got.ledger_plan
        assert res.plan.round_id == f"{FLEET}/1" and res.plan.model_id == "0"
        assert got.honest == plan.min_survivors - 1
        assert got.config == secagg.RoundConfig.of_plan(plan)
        # the same as the mechanism's device half on the same rng (R8: one draw order)
        mech, settings = mechanism_round(plan, dim=d)
        want = mech.device(settings).contribute(
            params=model["params"], data=model["data"], engine=model["eng"],
            coords=coordinates(plan, dim=d), honest=got.honest,
            rng=seeded_round_rng(3)(plan.round_id))
        np.testing.assert_array_equal(got.contribution.values, want.values)
        assert got.contribution.values.shape == (plan.length,)
        assert (res.plan.event, res.plan.aggregate_event) == (want.event, want.aggregate_event)


class _BrokenLedger:
    def __init__(self, book: Book) -> None:
        self._book = book

    def __getattr__(self, name: str) -> Any:
        return getattr(self._book, name)

    def reservations(self) -> Any:
        raise LedgerError("ledger.db: page 3 fails its checksum (injected)")


class _ReadOnly:
    read_only = "the file system is read-only (injected)"

    def __init__(self, book: Book) -> None:
        self._book = book

    def __getattr__(self, name: str) -> Any:
        return getattr(self._book, name)


class _NoReserve:
    def __init__(self, book: Book) -> None:
        self._book = book

    def __getattr__(self, name: str) -> Any:
        return getattr(self._book, name)

    def reserve(self, plan: Any) -> Any:
        raise LedgerError("disk full (injected)")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("reason", ["ledger-broken", "ledger-read-only", "ledger-full",
                                    "already_committed", "stale_model", "no-model",
                                    "mechanism", "no_data", "budget", "diverged"])
def test_each_decline_and_what_it_leaves_in_the_ledger(model, monkeypatch, reason: str) -> None:
    d = model["d"]
    plan, book = _plan(d), _book()
    ledger: Any = book
    kw: dict[str, Any] = {}
    if reason == "ledger-broken":
        ledger = _BrokenLedger(book)
    elif reason == "ledger-read-only":
        ledger = _ReadOnly(book)
    elif reason == "ledger-full":
        ledger = _NoReserve(book)
    elif reason == "already_committed":
        assert isinstance(_open(model, plan, book)[0], Prepared)  # took part, then crashed
    elif reason == "stale_model":
        kw["model_version"] = 1
    elif reason == "no-model":
        kw.update(params=None, model_version=-1)
    elif reason == "mechanism":  # a device built without the plan's mechanism
        monkeypatch.setattr(device_round, "MECHANISMS", {})
    elif reason == "no_data":
        kw["data"] = (model["data"][0][:0], model["data"][1][:0])
    elif reason == "budget":
        ledger = book = _book(epsilon=1e-3)
    elif reason == "diverged":
        plan = _plan(d, lr=1e300)  # overflows the float32 step
    before = len(book.reservations())
    got, calls = _open(model, plan, ledger, **kw)
    assert isinstance(got, Declined)
    want = {"ledger-broken": "ledger", "ledger-read-only": "ledger", "ledger-full": "ledger",
            "no-model": "stale_model"}.get(reason, reason)
    assert got.reason == want, got
    assert got.detail
    reserved = book.reservations()[before:]
    if reason == "diverged":  # the only decline after training: reserved, and committed
        assert [r.plan.round_id for r in reserved] == [f"{FLEET}/1"]
        assert got.reservation == reserved[0] and book.closed(reserved[0].seq) == "commit"
        assert calls.log == [("data", 0), ("rng", 1)]
    else:
        assert reserved == () and got.reservation is None
        assert all(what != "rng" for what, _ in calls.log)  # never trained
    if reason in ("ledger-broken", "ledger-read-only", "already_committed", "stale_model",
                  "no-model", "mechanism"):
        assert calls.log == []  # refused before reading the data
    if reason == "mechanism":
        assert "'gaussian'" in got.detail
    if reason == "budget":
        assert "epsilon would reach" in got.detail


def test_a_bad_plan_is_a_protocol_error_and_reserves_nothing(model) -> None:
    d = model["d"]
    book = _book()
    # the plan's length is not rand-k's count at its sparsity
    plan = _plan(d, sparsity=0.5)
    bad = wire.sign(dataclasses.replace(plan, length=plan.length + 1), AGG)
    with pytest.raises(RemoteProtocolError, match="round 1's plan: length"):
        _open(model, bad, book)
    assert book.reservations() == ()


def test_every_registered_mechanism_is_readable_from_a_plan() -> None:
    """A mechanism added to the registry must also be readable from a plan here, or devices
    would decline it as missing."""
    assert MECHANISMS and all(has_mechanism(n) for n in MECHANISMS)
    assert not has_mechanism("no-such-mechanism")


def test_mechanism_round_and_coordinates(model) -> None:
    d = model["d"]
    plan = _plan(d, sparsity=0.25)
    mech, settings = mechanism_round(plan, dim=d)
    assert isinstance(mech, MECHANISMS["gaussian"])
    assert settings == GaussianRound.from_plan(plan, dim=d)
    coords = coordinates(plan, dim=d)
    np.testing.assert_array_equal(coords,
                                  compress.coordinate_set(plan.round_seed, d, plan.length))
    assert coordinates(_plan(d), dim=d) is None
    with pytest.raises(ValueError, match="mechanism 'x' is not one of"):
        mechanism_round(dataclasses.replace(plan, mechanism="x"), dim=d)


def test_honest_members_takes_the_larger_colluder_assumption(model) -> None:
    plan = _plan(model["d"])  # min_survivors = threshold, max_colluders = 1
    s = plan.min_survivors
    assert honest_members(plan, max_colluders=0) == s - 1
    assert honest_members(plan, max_colluders=2) == s - 2
    assert honest_members(plan, max_colluders=s + 5) == 1
