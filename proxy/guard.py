"""Hard budget limits that concurrency cannot overshoot, and the spend they are checked against.

The guard keeps, per budget, the spend of its current period and the sum of open reservations,
in memory on the event loop (loaded from the ledger at start, then kept current from every row
the recorder writes). Before a request in scope of a blocking budget is forwarded, its
worst-case cost is reserved against every blocking budget in scope in one synchronous step:
``spent + reserved + worst case <= limit`` for all of them, or the request is refused (HTTP
429). Nothing awaits between the check and the reservation, so concurrent requests cannot all
pass on the same stale figure (field case B32). When the exchange ends the reservation is
released and the real cost counted, whatever the outcome.

Budgets made while serving (a run's cap, a per-user budget made on first sight) get books of
their own under their budget's name (:meth:`BudgetGuard.open_book`); the callables in
:attr:`BudgetGuard.scopes` name those in scope of a request or row, so that admission, settling
and headers treat them as any other budget.

The books' two amounts (spent and held) live in a
:class:`~tokenward.reports.ledger.books.BookStore`: in this process's memory by default, or
in Postgres, shared by every replica (:class:`~tokenward.reports.ledger.books.PgBooks`), where
the all-or-none reservation is one round trip. Books made while serving live there too, under
the same names on every replica (a run's, ``template[value]``), so their limits hold across
replicas. The guard keeps the policy (which budgets match, periods, worst case, refusals,
crossings) and its own figures per model and key.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

from tokenward.pricing.budgets import CALENDAR_PERIODS, Budget, evaluate
from tokenward.reports.ledger.books import ROLLING_START, Ask, BookKey, BookStore, Hold, MemoryBooks, Refused
from tokenward.reports.ledger.schema import HELD_STATUSES

__all__ = ["BooksSpend", "BudgetGuard", "BudgetRefusal", "Reservation", "attributes_of_row", "spend_amount"]


@dataclass(slots=True)
class _Book:
    budget: Budget
    start: dt.datetime
    end: dt.datetime
    store: BookStore = field(default_factory=MemoryBooks)
    # rolling periods only: (started_at, amount, model, key) of each row in the window
    events: deque[tuple[dt.datetime, Decimal, str, str]] = field(default_factory=deque)
    crossed: set[int] = field(default_factory=set)
    by_model: dict[str, Decimal] = field(default_factory=dict)
    by_key: dict[str, Decimal] = field(default_factory=dict)
    refused: int = 0

    @property
    def key(self) -> BookKey:
        """The store's name for this book: the budget's name and the period start."""
        return (self.budget.name, ROLLING_START if self.budget.period.kind == "rolling" else self.start)

    def key_at(self, at: dt.datetime) -> BookKey | None:
        """The store's name for the period containing ``at``: this book's, or an earlier period's.

        A request belongs to the period it started in (its row is counted there, in the ledger and
        after a restart). One that started before the current period did (its body was still
        arriving at the rollover) is held and counted in that earlier period's figures, which the
        store still has, not in the current one's. ``None`` for a time after this book's period.
        """
        if self.budget.period.kind == "rolling" or self.start <= at < self.end:
            return self.key
        if at < self.start:
            return (self.budget.name, self.budget.period.window(at)[0])
        return None

    @property
    def spent(self) -> Decimal:
        return self.store.spent(self.key)

    @property
    def reserved(self) -> Decimal:
        return self.store.held(self.key)

    def roll(self, now: dt.datetime) -> None:
        """Move to the period containing ``now`` (spend restarts at 0 for calendar periods)."""
        if self.budget.period.kind == "rolling":
            self.start, self.end = self.budget.period.window(now)
            while self.events and self.events[0][0] < self.start:
                _, amount, model, key = self.events.popleft()
                self.store.add(self.key, -amount)
                _add(self.by_model, model, -amount)
                _add(self.by_key, key, -amount)
        elif now >= self.end:
            self.start, self.end = self.budget.period.window(now)  # a new key: its books start at 0
            self.crossed.clear()
            self.by_model.clear()
            self.by_key.clear()
            self.refused = 0

    def count(self, started: dt.datetime, amount: Decimal, model: str, key: str) -> None:
        self.store.add(self.key, amount)
        _add(self.by_model, model, amount)
        _add(self.by_key, key, amount)
        if self.budget.period.kind == "rolling":
            self.events.append((started, amount, model, key))


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _add(totals: dict[str, Decimal], name: str, amount: Decimal) -> None:
    value = totals.get(name, Decimal(0)) + amount
    if value:
        totals[name] = value
    else:
        totals.pop(name, None)


def spend_amount(row: Mapping[str, Any]) -> Decimal | None:
    """What a ledger row counts against its budgets (USD; ``SPEND_EXPRESSION`` in SQL).

    Its cost, or the reservation a row with no cost still holds when the provider may have billed
    it (``HELD_STATUSES``: ``usage_unknown``, ``unpriced``, ``usage_invalid``, ``deferred``).
    """
    cost = row.get("cost_usd")
    if cost is None and row.get("price_status") in HELD_STATUSES:
        return row.get("reserved_usd")
    return cost


@dataclass(slots=True)
class Reservation:
    """Amounts (USD) held against blocking budgets for one request until it ends."""

    holds: list[tuple[_Book, Decimal]]
    id: int = 0
    hold: Hold | None = None

    @property
    def amount(self) -> Decimal | None:
        """The largest amount held (USD; ``None`` when nothing is held)."""
        return max((amount for _, amount in self.holds), default=None)


class BudgetRefusal(Exception):
    """A request would exceed a blocking budget; ``budget``, its remaining USD and reset instant."""

    def __init__(
        self, budget: Budget, remaining: Decimal, needed: Decimal, resets: dt.datetime, *, unbounded: bool = False
    ) -> None:
        self.budget, self.remaining, self.needed, self.resets = budget, remaining, needed, resets
        scope = budget.describe_scope()
        cost = (
            "this request refers to stored content (files or an earlier response) whose cost cannot be bounded, "
            "so it runs only alone, with more left than its countable part (up to "
            f"${format(needed.normalize(), 'f')}). "
            if unbounded
            else f"this request may cost up to ${format(needed.normalize(), 'f')}. "
        )
        super().__init__(
            f"Budget {budget.name!r} ({scope}) has ${format(remaining.normalize(), 'f')} left of "
            f"${format(budget.limit_usd.normalize(), 'f')} this period; {cost}" + _reset_note(budget, resets)
        )


def _reset_note(budget: Budget, resets: dt.datetime) -> str:
    if budget.period.kind == "total":
        return "It does not reset."
    if budget.period.kind == "rolling":
        return f"It counts the last {budget.period.rolling_hours:g} hours of spend."
    return f"It resets at {resets.astimezone(ZoneInfo(budget.period.timezone)).isoformat()}."


def attributes_of_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A ledger row's scope attributes (``model`` as the pair of requested and served names)."""
    return {
        "key": row.get("principal"),
        "key_id": row.get("key_id"),
        "team": row.get("team"),
        "project": row.get("project"),
        "org": row.get("org"),
        "pool": row.get("pool"),
        "run": row.get("run_id"),
        "end_user": row.get("end_user"),
        "model": (row.get("requested_model"), row.get("served_model"), row.get("sent_model")),
        "upstream": row.get("upstream"),
        "tag": tuple(row.get("tags") or ()),
    }


class BudgetGuard:
    """Per-budget spend and reservations for the current periods.

    Args:
        budgets: every configured budget.
        now: the instant the books open at.
        on_crossing: called with a budget whose spend just crossed one of its thresholds (the
            proxy uses it to run the alert check soon rather than at the next scheduled pass).
        store: the books of blocking budgets (default: this process's memory); other budgets'
            books stay in memory.
        clock: the current instant where a caller gives none (default: this host's clock; on a
            Postgres ledger the database server's, :class:`~tokenward.reports.ledger.server_clock.ServerClock`).
    """

    def __init__(
        self,
        budgets: Iterable[Budget],
        now: dt.datetime,
        on_crossing: Callable[[Budget], None] | None = None,
        store: BookStore | None = None,
        clock: Callable[[], dt.datetime] | None = None,
    ) -> None:
        self.clock = clock or _utc_now
        self.local = MemoryBooks()
        self.store: BookStore = store if store is not None else self.local
        self._books = [self._new_book(b, now) for b in budgets]
        self.on_crossing = on_crossing
        self._ids = itertools.count(1)
        self._by_name = {book.budget.name: book for book in self._books}
        self._dynamic: dict[str, _Book] = {}
        self.scopes: list[Callable[[Mapping[str, Any], dt.datetime], Iterable[str]]] = []
        """Each names the budgets with books of their own (:meth:`open_book`) in scope of a request
        or row's attributes, at an instant."""
        self.listeners: list[Callable[[Mapping[str, Any]], None]] = []
        """Each is called with every row :meth:`observe` counts (velocity books hook in here)."""

    def open_book(self, budget: Budget, now: dt.datetime, spent: Decimal = Decimal(0)) -> None:
        """Give ``budget`` books of its own, with ``spent`` USD already in its current period.

        For budgets made while serving (a run, a per-user budget), found through :attr:`scopes`.
        Books already open keep their spend and reservations and take ``budget`` as their new
        definition (a run's limit lowered).
        """
        book = self._dynamic.get(budget.name)
        if book is not None:
            book.budget = budget
            return
        book = self._dynamic[budget.name] = self._new_book(budget, now)
        book.store.set_spent(book.key, spent)  # a shared store: its view until the next renewal
        book.crossed = {t for t in budget.thresholds if spent * 100 >= budget.limit_usd * t}

    def close_book(self, name: str) -> bool:
        """Drop the books :meth:`open_book` gave ``name``; false while requests still hold money there."""
        book = self._dynamic.get(name)
        if book is None or book.reserved:
            return False
        del self._dynamic[name]
        book.store.forget(book.key)
        return True

    def has_book(self, name: str) -> bool:
        """Whether a budget made while serving has books under ``name``."""
        return name in self._dynamic

    def _new_book(self, budget: Budget, now: dt.datetime) -> _Book:
        return _Book(budget, *budget.period.window(now), store=self.store if budget.blocking else self.local)

    @property
    def budgets(self) -> list[Budget]:
        """The guarded budgets."""
        return [book.budget for book in self._books]

    def load(self, source: Any, now: dt.datetime, unflushed: Iterable[Mapping[str, Any]] = ()) -> None:
        """Set each budget's books for its current period from the ledger, at start.

        Args:
            source: a spend source on the ledger (``DuckSpend``, or ``PgSpend`` on Postgres).
            now: the instant the books are opened at.
            unflushed: rows not in the ledger yet (still in the write-ahead log), counted on top.
        """
        for book in self._books:
            book.start, book.end = book.budget.period.window(now)
            book.by_model, book.by_key, book.events = {}, {}, deque()
            book.store.set_spent(book.key, Decimal(0))
            if book.budget.period.kind == "rolling":
                for started, amount, model, key in source.rolling_events(book.budget, book.start):
                    book.count(started, amount, model, key)
            else:
                book.store.set_spent(book.key, source.spend_in(book.budget, book.start, book.end))
                for name, amount in source.top_spenders(book.budget, book.start, book.end, "model", 1000):
                    book.by_model[name] = amount
                for name, amount in source.top_spenders(book.budget, book.start, book.end, "key", 1000):
                    book.by_key[name] = amount
            book.refused = source.refusals(book.budget, book.start) if book.budget.blocking else 0
            if book.budget.period.kind in CALENDAR_PERIODS and not book.store.shared:
                # the period that ended: its crossings are still looked for (BooksSpend) in the next
                # period's first hour, also by a process started then (after a kill, a deploy)
                before = book.budget.period.window(book.start - dt.timedelta(microseconds=1))[0]
                book.store.set_spent((book.budget.name, before), source.spend_in(book.budget, before, book.start))
        for row in unflushed:
            self.observe(row, crossing=False)
            if row.get("outcome") == "rejected":  # a refusal the ledger does not hold yet (SpendSource.refusals)
                self._count_refusal(row)
        for book in self._books:
            book.crossed = {t for t in book.budget.thresholds if book.spent * 100 >= book.budget.limit_usd * t}

    def _count_refusal(self, row: Mapping[str, Any]) -> None:
        """Count a logged refusal row against the blocking budget whose refusal message it carries, in its period."""
        error = str(row.get("error") or "")
        started = dt.datetime.fromtimestamp(row["started_at"], dt.UTC)
        for book in self._books:
            if book.budget.blocking and error.startswith(f"Budget {book.budget.name!r} ") and book.start <= started:
                book.refused += 1

    def read_local(self, source: Any, now: dt.datetime) -> list[tuple[_Book, Any]]:
        """What the ledger holds now for each configured budget kept in this process's memory.

        On a shared ledger (Postgres) a budget that does not block is counted per replica in
        memory: each replica sees only the rows it served. This reads every replica's rows (off
        the event loop: ``source`` is a spend source); :meth:`apply_local` sets the books to them.
        """
        figures = []
        for book in self._books:
            if book.store is not self.local or book.budget.blocking:
                continue
            start, end = book.budget.period.window(now)
            if book.budget.period.kind == "rolling":
                figures.append((book, ("rolling", start, list(source.rolling_events(book.budget, start)))))
            else:
                spent = source.spend_in(book.budget, start, end)
                models = source.top_spenders(book.budget, start, end, "model", 1000)
                keys = source.top_spenders(book.budget, start, end, "key", 1000)
                figures.append((book, ("calendar", start, end, spent, models, keys)))
        return figures

    def apply_local(self, figures: list[tuple[_Book, Any]]) -> None:
        """Set books to what :meth:`read_local` read (on the event loop); thresholds already crossed stay so."""
        for book, figure in figures:
            if figure[0] == "rolling":
                _, start, events = figure
                book.start, book.events, book.by_model, book.by_key = start, deque(), {}, {}
                book.store.set_spent(book.key, Decimal(0))
                for started, amount, model, key in events:
                    book.count(started, amount, model, key)
            else:
                _, start, end, spent, models, keys = figure
                if start != book.start:  # the period turned meanwhile: the next pass reads the new one
                    continue
                book.store.set_spent(book.key, spent)
                book.by_model, book.by_key = dict(models), dict(keys)
            limit = book.budget.limit_usd
            book.crossed |= {t for t in book.budget.thresholds if book.spent * 100 >= limit * t}

    def book_windows(
        self, now: dt.datetime, *, made: bool = False
    ) -> list[tuple[Budget, Any, dt.datetime, dt.datetime]]:
        """``(budget, book key, start, end)`` of each blocking budget's book now: the rows ``[start, end)`` count.

        What reconciling shared books from the ledger needs (a rolling budget's window ends now).
        ``made``: the books made while serving (runs, per-value budgets) that this process has
        open, instead of the configured budgets' (which every replica has).
        """
        windows = []
        for book in self._dynamic.values() if made else self._books:
            if book.budget.blocking:
                book.roll(now)
                end = now + dt.timedelta(seconds=1) if book.budget.period.kind == "rolling" else book.end
                windows.append((book.budget, book.key, book.start, end))
        return windows

    def in_scope(self, attributes: Mapping[str, Any], *, blocking_only: bool = False) -> list[Budget]:
        """Budgets whose scope covers a request or row with these attributes."""
        return [b.budget for b in self._matching(attributes) if b.budget.blocking or not blocking_only]

    def _matching(self, attributes: Mapping[str, Any], now: dt.datetime | None = None) -> list[_Book]:
        books = [book for book in self._books if book.budget.matches(attributes)]
        if self.scopes:
            at = now or self.clock()
            dynamic = self._dynamic
            for scope in self.scopes:
                books += [dynamic[name] for name in scope(attributes, at) if name in dynamic]
        return books

    async def admit(
        self,
        attributes: Mapping[str, Any],
        worst_case: Decimal,
        now: dt.datetime,
        *,
        unbounded: bool = False,
        request_id: str | None = None,
    ) -> Reservation:
        """Reserve ``worst_case`` USD against every blocking budget in scope, or refuse.

        ``unbounded``: the request's input cannot be bounded (it points at stored files or an
        earlier response), so it reserves everything left in each budget: it runs alone, and
        only when more than ``worst_case`` (the part that can be counted) is left. All or none,
        in one step of the book store (one round trip to a shared one). ``request_id``: the
        request it is for (a shared store counts a dead replica's hold as its spend).

        Raises:
            BudgetRefusal: a blocking budget in scope would go over its limit (the tightest one).
            tokenward.reports.ledger.books.BooksUnavailable: shared books cannot be reached.
        """
        books = [book for book in self._matching(attributes, now) if book.budget.blocking]
        for book in books:
            book.roll(now)
        asks = [Ask(book.key_at(now) or book.key, book.budget.limit_usd, worst_case) for book in books]
        try:
            hold = (
                await self.store.reserve(asks, all_left=unbounded, request_id=request_id, started=now)
                if asks
                else Hold([])
            )
        except Refused as refused:
            book = books[refused.index]
            book.refused += 1
            raise BudgetRefusal(book.budget, refused.remaining, worst_case, book.end, unbounded=unbounded) from None
        holds = [(book, amount) for book, (_, amount) in zip(books, hold.amounts, strict=True)]
        return Reservation(holds, next(self._ids), hold)

    def release(self, reservation: Reservation | None) -> None:
        """Give back what ``reservation`` held (call once, when its request ends)."""
        self.settle(reservation, [])

    def settle(self, reservation: Reservation | None, rows: Iterable[Mapping[str, Any]]) -> None:
        """End a request: give back its reservation and count its rows (:meth:`observe`), at once.

        A shared store gets both in one call (its hold released, each row's amount counted
        against the blocking budgets in scope and period).
        """
        rows = list(rows)
        spends: dict[BookKey, Decimal] = {}
        started = None
        if self.store.shared:
            for row in rows:
                amount = spend_amount(row)
                if not amount:
                    continue
                started = dt.datetime.fromtimestamp(row["started_at"], dt.UTC)
                for book in self._matching(attributes_of_row(row), started):
                    key = book.key_at(started)
                    if book.budget.blocking and key is not None:
                        spends[key] = spends.get(key, Decimal(0)) + amount
        hold = reservation.hold if reservation is not None else None
        if hold is not None or spends:
            request_id = str(rows[0].get("parent_request_id") or rows[0]["request_id"]) if rows else None
            self.store.settle(hold, list(spends.items()), request_id, started or self.clock())
        if reservation is not None:
            reservation.holds = []
        for row in rows:
            self.observe(row)

    def observe(self, row: Mapping[str, Any], *, crossing: bool = True) -> None:
        """Count a ledger row against the budgets in its scope and period (:func:`spend_amount`).

        ``crossing``: call ``on_crossing`` for a threshold this row crosses.
        """
        amount = spend_amount(row)
        if not amount:
            return
        started = dt.datetime.fromtimestamp(row["started_at"], dt.UTC)
        attributes = attributes_of_row(row)
        model = str(row.get("served_model") or row.get("requested_model") or "(none)")
        key = str(row.get("principal") or "anonymous")
        for book in self._matching(attributes, started):
            book.roll(max(started, book.start))
            if not book.start <= started < book.end and book.budget.period.kind != "rolling":
                earlier = book.key_at(started)
                if earlier is not None and not self.store.shared:  # a shared store counted it in settle
                    book.store.add(earlier, amount)  # a request of an ended period: counted there
                continue
            book.count(started, amount, model, key)
            newly = {t for t in book.budget.thresholds if book.spent * 100 >= book.budget.limit_usd * t} - book.crossed
            if newly and crossing:
                book.crossed |= newly
                if self.on_crossing is not None:
                    self.on_crossing(book.budget)
        for listener in self.listeners:
            listener(row)

    def tightest(self, attributes: Mapping[str, Any], now: dt.datetime) -> tuple[Budget, Decimal] | None:
        """The budget in scope with the least USD left (counting open reservations), and that amount."""
        best: tuple[Budget, Decimal] | None = None
        for book in self._matching(attributes, now):
            book.roll(now)
            left = max(book.budget.limit_usd - book.spent - book.reserved, Decimal(0))
            if best is None or left < best[1]:
                best = (book.budget, left)
        return best

    def standing(
        self, attributes: Mapping[str, Any] | None, now: dt.datetime, names: Iterable[str] = ()
    ) -> list[dict[str, Any]]:
        """Budgets in scope of ``attributes`` (and those named in ``names``) now, tightest first.

        Each: ``budget``, ``spent_usd``, ``reserved_usd`` (held by requests in flight),
        ``remaining_usd`` (limit - spent - reserved, never negative), ``period_start``,
        ``period_end`` (UTC). For reply headers and the caller's budget endpoint.
        """
        books = self._matching(attributes, now) if attributes is not None else []
        for name in names:
            book = self._by_name.get(name) or self._dynamic.get(name)
            if book is not None and book not in books:
                books.append(book)
        result = []
        for book in books:
            book.roll(now)
            left = max(book.budget.limit_usd - book.spent - book.reserved, Decimal(0))
            result.append(
                {
                    "budget": book.budget,
                    "spent_usd": book.spent,
                    "reserved_usd": book.reserved,
                    "remaining_usd": left,
                    "period_start": book.start,
                    "period_end": book.end,
                }
            )
        result.sort(key=lambda entry: entry["remaining_usd"])
        return result

    def snapshot(self, now: dt.datetime, *, made: bool = False) -> list[dict[str, Any]]:
        """Every budget's status now (spend, reserved, percent, forecast, group), for ``/budgets``-style views.

        ``made``: the books made while serving (per-value budgets ``chat-user[alice]``, whose
        ``group`` is their template's name, and runs) instead of the configured budgets'.
        """
        result = []
        for book in self._dynamic.values() if made else self._books:
            book.roll(now)
            status = evaluate(book.budget, book.spent, now)
            result.append(
                {
                    "budget": book.budget.name,
                    "spent_usd": book.spent,
                    "reserved_usd": book.reserved,
                    "limit_usd": book.budget.limit_usd,
                    "percent": status.percent,
                    "period_start": status.start,
                    "period_end": status.end,
                    "forecast_usd": status.forecast,
                    "group": book.budget.group,
                }
            )
        return result


class BooksSpend:
    """The guard's books as a :class:`~tokenward.reports.ledger.spend.SpendSource` (no ledger access).

    Figures are a snapshot taken on the event loop when this object is made, so budget checks
    can read them from a worker thread while a reader holds the ledger file. Windows other than a
    budget's current period, and the digest's totals, are not in the books: those raise
    ``LookupError`` (the caller reads the ledger instead).

    Args:
        guard: the proxy's budget guard.
        now: the instant of the snapshot.
        unpriced: the recorder's first unpriced row and count per (provider, model, price status).
    """

    def __init__(
        self, guard: BudgetGuard | None, now: dt.datetime, unpriced: Mapping[tuple[Any, Any], Mapping[str, Any]]
    ) -> None:
        self._books: dict[str, tuple[dt.datetime, Decimal, dict[str, Decimal], dict[str, Decimal], int]] = {}
        self._previous: dict[str, tuple[dt.datetime, Decimal, dict[str, Decimal], dict[str, Decimal], int]] = {}
        for book in guard._books if guard is not None else ():
            book.roll(now)
            self._books[book.budget.name] = (
                book.start, book.spent, dict(book.by_model), dict(book.by_key), book.refused
            )
            if book.budget.period.kind in CALENDAR_PERIODS:  # the period that ended: its late rows count there
                before = book.budget.period.window(book.start - dt.timedelta(microseconds=1))[0]
                self._previous[book.budget.name] = (before, book.store.spent((book.budget.name, before)), {}, {}, 0)
        self._unpriced = [
            (
                status,
                (
                    provider,
                    model,
                    dt.datetime.fromtimestamp(seen["row"]["started_at"], dt.UTC),
                    int(seen["count"]),
                    str(seen["row"]["request_id"]),
                ),
            )
            for (provider, model, status), seen in unpriced.items()
        ]

    def _book(self, budget: Budget, start: dt.datetime) -> tuple[Any, ...]:
        for found in (self._books.get(budget.name), self._previous.get(budget.name)):
            if found is not None and (found[0] == start or budget.period.kind == "rolling"):
                return found
        raise LookupError(f"no books for budget {budget.name!r} from {start.isoformat()}")

    def spend_in(self, budget: Budget, start: dt.datetime, end: dt.datetime) -> Decimal:
        """USD in ``budget``'s current period, or the calendar period before it (``start`` must be its start).

        The period before holds only its total (no models, keys or refusals), as this process
        counted it: rows of requests that started before the rollover and ended after it.
        """
        spent: Decimal = self._book(budget, start)[1]
        return spent

    def top_spenders(
        self, budget: Budget, start: dt.datetime, end: dt.datetime, column: str, limit: int = 5
    ) -> list[tuple[str, Decimal]]:
        """The ``limit`` largest models or keys by spend in ``budget``'s current period."""
        totals: dict[str, Decimal] = self._book(budget, start)[2 if column == "model" else 3]
        ranked = sorted(totals.items(), key=lambda item: (-item[1], item[0]))
        return [(name, amount) for name, amount in ranked[:limit] if amount]

    def refusals(self, budget: Budget, start: dt.datetime) -> int:
        """Requests ``budget`` refused in its current period (as this process saw them)."""
        refused: int = self._book(budget, start)[4]
        return refused

    def unpriced_models(self, status: str = "unpriced") -> list[tuple[Any, Any, dt.datetime, int, str]]:
        """Models this process recorded with price status ``status``, first seen first."""
        return sorted((found for kind, found in self._unpriced if kind == status), key=lambda item: item[2])

    def totals(self, start: dt.datetime, end: dt.datetime) -> tuple[Decimal, int, int, int]:
        """Not in the books: raises ``LookupError``."""
        raise LookupError("totals come from the ledger")
