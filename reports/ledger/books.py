"""Budget books: what each budget has spent and holds in a period, and the atomic reservation against them.

Design note. The guard (``tokenward.proxy.guard``) decides which budgets a request is in, the
period, the worst case and the refusal; the books only keep two amounts per *book* (an opaque
name, a budget's name, and a period start) and answer one question atomically: can every one of
these books hold this amount more without going over its limit? :class:`MemoryBooks` keeps
them in one process (the DuckDB mode: one proxy per ledger),
:class:`~tokenward.reports.ledger.pg_books.PgBooks` in Postgres, shared by every replica (its
own module, so that a proxy on a DuckDB ledger never loads the Postgres driver):

* reserve, settle and release are one round trip each (``tw_reserve``/``tw_settle`` in
  :mod:`~tokenward.reports.ledger.pg_migrations`), all or none, rows locked in a fixed order;
* each replica holds a lease it renews every ``lease_s / 3`` s; when a replica stops renewing
  (SIGKILL, a partition), the next renewal by any replica releases its holds (``tw_expire``);
* ``spent`` is counted at settlement and reconciled from the ledger
  (:func:`~tokenward.reports.ledger.pg_books.reconcile`): the rows in the period plus what was
  settled for requests whose rows are not in the ledger yet, so rows of a dead replica count
  once its log is recovered, and nothing counts twice.

Amounts are USD (``Decimal``). A ``PgBooks`` keeps a local view of the figures it last saw
(for headers, ``/metrics`` and the dashboard); decisions are taken in the database.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol

from tokenward.reports.ledger.errors import LedgerError

__all__ = [
    "ROLLING_START",
    "Ask",
    "BookKey",
    "BookStore",
    "BooksUnavailable",
    "Hold",
    "MemoryBooks",
    "Refused",
]

BookKey = tuple[str, dt.datetime]
"""``(book name, period start)``: one budget's books in one period."""

ROLLING_START = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
"""The period start of a rolling budget's book (its window moves; there is one book)."""


@dataclass(frozen=True, slots=True)
class Ask:
    """Hold ``amount`` USD in book ``key`` whose limit is ``limit`` USD."""

    key: BookKey
    limit: Decimal
    amount: Decimal


@dataclass(slots=True)
class Hold:
    """What a reservation holds: ``(book, amount)`` pairs; ``id`` names it in a shared store."""

    amounts: list[tuple[BookKey, Decimal]]
    id: int | None = None


class Refused(Exception):
    """Book number ``index`` (of the asks) would go over its limit; it had ``remaining`` USD left."""

    def __init__(self, index: int, remaining: Decimal) -> None:
        super().__init__(f"book {index} has {remaining} left")
        self.index, self.remaining = index, remaining


class BooksUnavailable(LedgerError):
    """The shared books cannot be reached (the database is down): nothing can be reserved."""


class BookStore(Protocol):
    """Spent and held USD per book; reservations that hold all their asks or none."""

    shared: bool
    """Whether other processes share these books."""

    def spent(self, key: BookKey) -> Decimal:
        """USD spent in the book (a shared store: as last seen)."""
        ...

    def held(self, key: BookKey) -> Decimal:
        """USD held by open reservations in the book (a shared store: as last seen)."""
        ...

    def add(self, key: BookKey, amount: Decimal) -> None:
        """Count ``amount`` (negative: a rolling window let it go) in this process's figures."""
        ...

    def set_spent(self, key: BookKey, amount: Decimal) -> None:
        """Set the spent figure at start (from the ledger); a shared store reconciles instead."""
        ...

    def forget(self, key: BookKey) -> None:
        """Drop this process's figures for a book nothing holds money in any more (a closed run's)."""
        ...

    async def reserve(
        self,
        asks: Sequence[Ask],
        *,
        all_left: bool = False,
        request_id: str | None = None,
        started: dt.datetime | None = None,
    ) -> Hold:
        """Hold every ask's amount (``all_left``: everything left in each book, which must exceed it), or none.

        ``request_id``/``started``: the request the hold is for (a shared store counts the hold of
        a process that died as that request's spend until its row arrives).

        Raises:
            Refused: the first book that would go over its limit.
            BooksUnavailable: a shared store cannot be reached.
        """
        ...

    def settle(
        self, hold: Hold | None, spends: Sequence[tuple[BookKey, Decimal]], request_id: str | None, started: dt.datetime
    ) -> None:
        """Give back ``hold`` and, in a shared store, count ``spends`` for ``request_id`` (not awaited).

        In this process the spends are counted with :meth:`add` (the guard does).
        """
        ...


class MemoryBooks:
    """:class:`BookStore` in this process's memory (one proxy per ledger); atomic on the event loop."""

    shared = False

    def __init__(self) -> None:
        self._figures: dict[BookKey, list[Decimal]] = {}

    def _entry(self, key: BookKey) -> list[Decimal]:
        entry = self._figures.get(key)
        if entry is None:
            entry = self._figures[key] = [Decimal(0), Decimal(0)]
        return entry

    def spent(self, key: BookKey) -> Decimal:
        """See :meth:`BookStore.spent`."""
        entry = self._figures.get(key)
        return entry[0] if entry else Decimal(0)

    def held(self, key: BookKey) -> Decimal:
        """See :meth:`BookStore.held`."""
        entry = self._figures.get(key)
        return entry[1] if entry else Decimal(0)

    def add(self, key: BookKey, amount: Decimal) -> None:
        """See :meth:`BookStore.add`."""
        self._entry(key)[0] += amount

    def set_spent(self, key: BookKey, amount: Decimal) -> None:
        """See :meth:`BookStore.set_spent`."""
        self._entry(key)[0] = amount

    def forget(self, key: BookKey) -> None:
        """See :meth:`BookStore.forget`."""
        self._figures.pop(key, None)

    def reserve_now(self, asks: Sequence[Ask], *, all_left: bool = False) -> Hold:
        """:meth:`reserve` without awaiting (it never waits)."""
        taken = []
        for index, ask in enumerate(asks):
            spent, held = self._entry(ask.key)
            left = max(ask.limit - spent - held, Decimal(0))
            if spent + held + ask.amount > ask.limit or (all_left and left <= ask.amount):
                raise Refused(index, left)
            taken.append((ask.key, left if all_left else ask.amount))
        for key, amount in taken:
            self._entry(key)[1] += amount
        return Hold(taken)

    async def reserve(
        self,
        asks: Sequence[Ask],
        *,
        all_left: bool = False,
        request_id: str | None = None,
        started: dt.datetime | None = None,
    ) -> Hold:
        """See :meth:`BookStore.reserve` (nothing is awaited between the check and the hold; no request kept)."""
        return self.reserve_now(asks, all_left=all_left)

    def settle(
        self, hold: Hold | None, spends: Sequence[tuple[BookKey, Decimal]], request_id: str | None, started: dt.datetime
    ) -> None:
        """See :meth:`BookStore.settle`: the hold is given back at once."""
        if hold is None:
            return
        for key, amount in hold.amounts:
            self._entry(key)[1] -= amount
        hold.amounts = []
