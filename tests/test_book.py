"""The ledger's pure check-then-commit state, :class:`edge_sdk.ledger.Book` (issue 15, plan15
F2), and its per-multiset epsilon cache.

Properties (hypothesis) over random sequences of plans, commits and aborts: a book never
holds more local epsilon than its budget; ``epsilon_if(plan)`` is exactly the spent epsilon
once ``plan`` is reserved; a refusal changes nothing; commit and abort refund nothing; and
every figure is bit-identical with the cache, without it (``max_entries=0``), with a tiny
evicting cache shared between books, and to :func:`epsilon_rdp` over the events in order,
the oracle the ledger used before it had a cache. The sqlite :class:`Ledger` reports the
same bit-identical figures (its book is this one)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.ledger import (
    Book,
    Budget,
    BudgetExhausted,
    EpsilonCache,
    Ledger,
    LedgerError,
    Plan,
    Reservation,
    epsilon_pld,
    epsilon_rdp,
)
from edge_sdk.privacy import (
    Composed,
    Gaussian,
    PoissonSubsampledGaussian,
    SelfComposed,
    aggregate_event,
)

FAST = settings(max_examples=40, deadline=None, derandomize=True)
DELTA = 1e-5
# A few distinct releases, cheap to account (no sampling without replacement: its RDP bound
# is slow), so that histories repeat events in different interleavings.
DPSGD = PoissonSubsampledGaussian(noise_multiplier=1.1, sample_rate=0.05, steps=20)
EVENTS = (
    DPSGD,
    Gaussian(noise_multiplier=3.0),
    Gaussian(noise_multiplier=2.0, steps=2, adjacency="substitution"),
    Composed(events=(DPSGD, Gaussian(noise_multiplier=4.0))),
    SelfComposed(event=Gaussian(noise_multiplier=5.0), count=3),
)


def _plan(i: int, event_index: int, secagg: bool) -> Plan:
    event = EVENTS[event_index]
    if not secagg:
        return Plan(round_id=f"r{i}", model_id="m1", event=event)
    agg = aggregate_event(event, honest_members=7, linear_sum=True)
    return Plan(round_id=f"r{i}", model_id="m1", event=event, aggregate_event=agg,
                cohort_size=8, secagg_threshold=5)


# one step: (event index, with secure aggregation, then: 0 leave pending, 1 commit, 2 abort)
STEPS = st.lists(st.tuples(st.integers(0, len(EVENTS) - 1), st.booleans(), st.integers(0, 2)),
                 min_size=1, max_size=14)
BUDGETS = st.sampled_from([0.5, 2.0, 6.0, 1e6])


def _oracle(book: Book, extra: Plan | None = None) -> tuple[float, float]:
    """Local and aggregate epsilon as the ledger computed them before the cache: the
    accountant over every reservation's events, in order."""
    plans = [r.plan for r in book.reservations()] + ([] if extra is None else [extra])
    if not plans:
        return 0.0, 0.0
    return (epsilon_rdp([p.event for p in plans], book.delta),
            epsilon_rdp([p.aggregate_event for p in plans], book.delta))


def _apply(book: Book, steps: list[tuple[int, bool, int]]) -> list[object]:
    """Run ``steps`` on ``book``, asserting the invariants; returns every figure seen."""
    seen: list[object] = []
    assert book.budget is not None
    for i, (k, secagg, then) in enumerate(steps):
        plan = _plan(i, k, secagg)
        before = (book.spent(), book.reservations(), book.pending(), len(book))
        after = book.epsilon_if(plan)
        assert after == _oracle(book, plan)[0]  # bit-identical to the uncached accountant
        seen += [before[0], after, book.would_exceed(plan)]
        if after > book.budget.epsilon:
            assert book.would_exceed(plan)
            with pytest.raises(BudgetExhausted, match=f"round 'r{i}' refused: spent eps="):
                book.reserve(plan)
            # a refusal changes nothing
            assert (book.spent(), book.reservations(), book.pending(), len(book)) == before
            continue
        assert not book.would_exceed(plan)
        res = book.reserve(plan)
        spent = book.spent()
        assert spent.local_epsilon == after  # epsilon_if is exactly what reserving spends
        assert (spent.local_epsilon, spent.aggregate_epsilon) == _oracle(book)
        assert spent.local_epsilon <= book.budget.epsilon  # never past the budget
        assert spent.entries == len(book.reservations())
        assert res.seq == before[3] + 1 and res in book.pending()
        if then:
            (book.commit if then == 1 else book.abort)(res)
            assert book.spent() == spent  # released: refunds nothing
            assert res not in book.pending() and res in book.reservations()
            assert book.closed(res.seq) == ("commit" if then == 1 else "abort")
        seen += [res, book.spent(), book.remaining()]
    return seen


@FAST
@given(steps=STEPS, limit=BUDGETS)
def test_book_never_commits_past_the_budget(steps, limit) -> None:
    book = Book(budget=Budget(epsilon=limit, delta=DELTA))
    _apply(book, steps)
    assert book.spent().local_epsilon <= limit
    assert book.remaining() == max(0.0, limit - book.spent().local_epsilon)


@FAST
@given(steps=STEPS, limit=BUDGETS)
def test_cache_gives_bit_identical_results(steps, limit) -> None:
    budget = Budget(epsilon=limit, delta=DELTA)
    none, own = EpsilonCache(max_entries=0), EpsilonCache()
    uncached, cached = Book(budget=budget, cache=none), Book(budget=budget, cache=own)
    shared = EpsilonCache(max_entries=2)  # evicts all the time; shared by two books
    first, second = Book(budget=budget, cache=shared), Book(budget=budget, cache=shared)
    figures = _apply(uncached, steps)
    assert none.hits == 0 and len(none) == 0 and none.misses > 0
    assert _apply(cached, steps) == figures
    assert _apply(first, steps) == figures
    assert _apply(second, steps) == figures  # answered from the first book's history
    assert own.hits > 0 and shared.hits > 0
    assert len(shared) <= 2
    for delta in (1e-3, 1e-7):  # reports at another delta too
        assert cached.spent(delta) == uncached.spent(delta) == first.spent(delta)


@FAST
@given(steps=STEPS)
def test_commit_and_abort_release_a_reservation_and_refund_nothing(steps) -> None:
    book = Book(budget=Budget(epsilon=1e6, delta=DELTA))
    made = [book.reserve(_plan(i, k, s)) for i, (k, s, _) in enumerate(steps)]
    spent = book.spent()
    for res, (_, _, then) in zip(made, steps, strict=True):
        if then == 1:
            book.commit(res)
            book.commit(res)  # twice: a no-op
            with pytest.raises(LedgerError, match="already recorded as commit"):
                book.abort(res)
        elif then == 2:
            book.abort(res)
            book.abort(res)
            with pytest.raises(LedgerError, match="already recorded as abort"):
                book.commit(res)
    assert book.spent() == spent
    assert book.pending() == tuple(r for r, (_, _, t) in zip(made, steps, strict=True) if not t)
    assert book.reservations() == tuple(made)
    assert len(book) == len(made) + sum(1 for _, _, t in steps if t)


def test_a_reservation_of_another_book_is_refused() -> None:
    budget = Budget(epsilon=10.0, delta=DELTA)
    a, b = Book(budget=budget), Book(budget=budget)
    ra = a.reserve(_plan(0, 0, False))
    rb = b.reserve(_plan(0, 1, False))  # same seq, another plan: another hash
    assert ra.seq == rb.seq and ra.hash != rb.hash
    with pytest.raises(LedgerError, match="reservation 1 \\('r0'\\) is not in this book"):
        a.commit(rb)
    forged = Reservation(seq=ra.seq, plan=ra.plan, hash="00" * 32)
    with pytest.raises(LedgerError, match="not in this book"):
        a.abort(forged)
    assert a.pending() == (ra,)


def test_history_is_added_without_a_check_and_in_order() -> None:
    """What the store does with entries already on disk: counted, never re-checked (the
    spend happened), numbered as in the file."""
    book = Book(budget=Budget(epsilon=0.1, delta=DELTA))
    big = _plan(0, 0, False)
    assert book.would_exceed(big)
    book.add(Reservation(seq=1, plan=big, hash="ab" * 32))
    book.close(1, "commit")
    assert book.spent().local_epsilon == epsilon_rdp([DPSGD], DELTA) > 0.1
    assert book.remaining() == 0.0
    with pytest.raises(ValueError, match="seq must be the next entry's, 3, got 2"):
        book.add(Reservation(seq=2, plan=big, hash="cd" * 32))
    with pytest.raises(ValueError, match="reservation 1 closed twice"):
        book.close(1, "abort")
    with pytest.raises(ValueError, match="commit of unknown reservation 7"):
        book.close(7, "commit")
    with pytest.raises(BudgetExhausted):
        book.reserve(_plan(1, 1, False))
    assert len(book) == 2


def test_unlimited_book_is_for_simulation_and_never_refuses() -> None:
    with pytest.raises(ValueError, match="needs the delta it reports at"):
        Book(budget=None)
    with pytest.raises(ValueError, match="with a budget, reports are at its delta"):
        Book(budget=Budget(epsilon=1.0, delta=DELTA), delta=DELTA)
    with pytest.raises(ValueError, match=r"delta must be a number in \(0, 1\), got 0"):
        Book(budget=None, delta=0)
    with pytest.raises(ValueError, match="budget must be a Budget or None"):
        Book(budget=3.0, delta=DELTA)  # type: ignore[arg-type]
    book = Book(budget=None, delta=DELTA)
    huge = Plan(round_id="r0", model_id="m", event=Gaussian(noise_multiplier=1e-3, steps=1000))
    assert not book.would_exceed(huge) and book.remaining() == math.inf
    for i in range(3):
        book.reserve(Plan(round_id=f"r{i}", model_id="m", event=huge.event))
    assert book.spent().local_epsilon == epsilon_rdp([huge.event] * 3, DELTA) > 1e3
    # A device can never get one: Budget is finite, and a Ledger needs a Budget.
    with pytest.raises(ValueError, match="finite number > 0, got inf"):
        Budget(epsilon=math.inf, delta=DELTA)
    with pytest.raises(ValueError, match="a device ledger needs a finite Budget, got None"):
        Ledger(conn=None, path=None, budget=None,  # type: ignore[arg-type]
               device_id="d", genesis="", accountant=epsilon_rdp, clock=lambda: 0.0)


def test_cache_is_keyed_by_accountant_multiset_and_delta() -> None:
    calls: list[int] = []

    def counting(events, delta):
        calls.append(len(events))
        return epsilon_rdp(events, delta)

    cache = EpsilonCache()
    a = Book(budget=Budget(epsilon=50.0, delta=DELTA), accountant=counting, cache=cache)
    b = Book(budget=Budget(epsilon=50.0, delta=DELTA), accountant=epsilon_pld, cache=cache)
    plan = _plan(0, 1, False)
    assert a.epsilon_if(plan) == a.epsilon_if(plan) == epsilon_rdp([plan.event], DELTA)
    assert calls == [1]  # the second was a hit
    # another accountant on the same multiset is asked, not answered from the first
    assert b.epsilon_if(plan) == epsilon_pld([plan.event], DELTA) != a.epsilon_if(plan)
    a.reserve(plan)
    assert calls == [1]  # the check hit the cache too
    assert a.spent(1e-3).local_epsilon == epsilon_rdp([plan.event], 1e-3)
    assert calls == [1, 1]  # another delta is another question
    bad = Book(budget=Budget(epsilon=1.0, delta=DELTA), accountant=lambda e, d: math.nan,
               cache=cache)
    for _ in range(2):  # an invalid answer is never kept
        with pytest.raises(LedgerError, match="returned nan"):
            bad.epsilon_if(plan)
    with pytest.raises(ValueError, match="max_entries must be an integer >= 0, got -1"):
        EpsilonCache(max_entries=-1)


def test_ledger_figures_are_bit_identical_to_the_uncached_accountant(tmp_path) -> None:
    """The store's Ledger checks and reports through its Book: every figure equals the
    accountant over the stored events in order, also after reopening (a fresh book)."""
    budget = Budget(epsilon=40.0, delta=DELTA)
    order = [0, 1, 0, 3, 1, 4, 0, 2, 4, 0]
    plans = [_plan(i, k, i % 2 == 0) for i, k in enumerate(order)]
    path = tmp_path / "l.db"
    with Ledger.open(path, budget=budget, device_id="d1", create=True) as led:
        for i, plan in enumerate(plans):
            if_ = led.epsilon_if(plan)
            assert if_ == epsilon_rdp([p.event for p in plans[:i + 1]], DELTA)
            led.reserve(plan)
            assert led.spent().local_epsilon == if_
        spent = led.spent()
    assert spent.aggregate_epsilon == epsilon_rdp([p.aggregate_event for p in plans], DELTA)
    with Ledger.open(path) as led:
        assert led.spent() == spent
        extra = _plan(99, 3, False)
        assert led.epsilon_if(extra) == epsilon_rdp([p.event for p in plans] + [extra.event],
                                                    DELTA)


def test_running_composition_is_bit_identical_over_many_distinct_and_repeated_events() -> None:
    """The book's running RDP composition (issue 18: a question costs the same at 10 and at
    10,000 entries) against epsilon_rdp over the list, bit for bit: 300 distinct events
    with repeats of early, middle and late ones interleaved, and what-if questions for a
    new event and for each kind of repeated one."""
    book = Book(budget=None, delta=DELTA)
    events = [PoissonSubsampledGaussian(noise_multiplier=1.1, sample_rate=0.01 + i * 1e-4,
                                        steps=5) for i in range(300)]
    history: list = []
    for i, event in enumerate(events):
        for e in ([event] if i % 7 else [event, events[0], events[i // 2]]):
            book.reserve(Plan(round_id=f"r{len(history)}", model_id="m", event=e))
            history.append(e)
        if i % 50 == 49:
            assert book.spent().local_epsilon == epsilon_rdp(history, DELTA)
            for extra in (events[0], events[i // 2], events[i], DPSGD):
                plan = Plan(round_id="x", model_id="m", event=extra)
                assert book.epsilon_if(plan) == epsilon_rdp([*history, extra], DELTA)


def test_running_composition_hands_binomial_and_refused_events_to_the_accountant() -> None:
    """A Binomial event (its own orders, restricted moments) and an event the accountant
    refuses take the general path: the same answer, or the same error, as epsilon_rdp."""
    from edge_sdk.privacy import Binomial, DistributedSkellam
    binomial = Binomial(trials=2000, l2_sensitivity=1.0, linf_sensitivity=1.0,
                        l1_sensitivity=1.0, dim=10, orders=(2.0, 4.0, 8.0),
                        rho=(0.01, 0.03, 0.08), delta0=1e-9)
    book = Book(budget=None, delta=DELTA)
    book.reserve(Plan(round_id="a", model_id="m", event=DPSGD))
    plan = Plan(round_id="b", model_id="m", event=binomial)
    assert book.epsilon_if(plan) == epsilon_rdp([DPSGD, binomial], DELTA)
    book.reserve(plan)
    book.reserve(Plan(round_id="c", model_id="m", event=DPSGD))
    assert book.spent().local_epsilon == epsilon_rdp([DPSGD, binomial, DPSGD], DELTA)
    # stated under add/remove, a Skellam sum has no sound zero-out restatement
    bad = DistributedSkellam(l1_sensitivity=1e4, l2_sensitivity=100.0, mu=5e3, devices=10)
    with pytest.raises(ValueError) as want:
        epsilon_rdp([DPSGD, bad], DELTA)
    with pytest.raises(type(want.value), match=str(want.value)[:40]):
        Book(budget=None, delta=DELTA).epsilon_if(Plan(round_id="d", model_id="m", event=bad))
