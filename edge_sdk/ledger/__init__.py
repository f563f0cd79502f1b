"""The device's privacy ledger: the budget check that runs before anything leaves the
device, and the durable, hash-chained record of every release.

Check, persist, then release — never another order::

    with Ledger.open("ledger.db", create=False) as ledger:   # verifies the whole file
        res = ledger.reserve(plan)   # BudgetExhausted, or durable on disk when it returns
        transport.publish(upload)    # only now may the upload leave
        ledger.commit(res)           # bookkeeping: the spend already counted

Three modules, lowest first:

* :mod:`~edge_sdk.ledger.accounting` -- pure: :class:`Budget`, :class:`Plan`,
  :class:`Reservation`, :class:`Spent`, the events' JSON, the accountants
  (:func:`epsilon_rdp`, :func:`epsilon_pld`) and :class:`Book`, the in-memory
  check-then-commit state (what a simulator uses alone; optionally without a budget).
  Figures are local and aggregate epsilon, in nats, under zero-out adjacency.
* :mod:`~edge_sdk.ledger.audit` -- the page auditor: the sqlite file byte by byte.
* :mod:`~edge_sdk.ledger.store` -- :class:`Ledger`, a Book made durable in sqlite
  (crash-safe two-phase spend, append-only, hash-chained, verified on open). A device always
  uses it, always with a finite Budget.

Errors (one root, an :class:`edge_sdk.errors.EdgeError`)::

    LedgerError              a write failed, a reservation is unknown, arguments disagree
                             with the stored ledger
     +-- LedgerCorrupted     missing, unreadable, tampered or truncated: do not train
     +-- BudgetExhausted     the plan would take local epsilon over the owner's budget

sqlite3 exceptions are translated at the store's boundary and never escape it. Bad
arguments raise ``ValueError`` naming the value and the expectation.
"""

from edge_sdk.ledger.accounting import (
    UNITS,
    Assumptions,
    Book,
    Budget,
    BudgetExhausted,
    Entry,
    EpsilonCache,
    EpsilonOf,
    Figure,
    LedgerCorrupted,
    LedgerError,
    Plan,
    Reservation,
    Spent,
    entry_to_json,
    epsilon_pld,
    epsilon_rdp,
    event_from_json,
    event_to_json,
    running_epsilon,
)
from edge_sdk.ledger.store import Ledger

__all__ = [
    "UNITS",
    "Assumptions",
    "Book",
    "Budget",
    "BudgetExhausted",
    "Entry",
    "EpsilonCache",
    "EpsilonOf",
    "Figure",
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
