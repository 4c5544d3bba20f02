"""Hard budget limits that concurrency cannot overshoot, and the spend they are checked against.

The guard keeps, per budget, the spend of its current period and the sum of open reservations,
in memory on the event loop (loaded from the ledger at start, then kept current from every row
the recorder writes). Before a request in scope of a blocking budget is forwarded, its
worst-case cost is reserved against every blocking budget in scope in one synchronous step:
``spent + reserved + worst case <= limit`` for all of them, or the request is refused (HTTP
429). Nothing awaits between the check and the reservation, so concurrent requests cannot all
pass on the same stale figure (field case B32). When the exchange ends the reservation is
released and the real cost counted, whatever the outcome.

One process: replicas sharing a ledger each see only their own in-flight reservations.
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

from tokenward.pricing.budgets import Budget, evaluate

__all__ = ["BudgetGuard", "BudgetRefusal", "Reservation", "attributes_of_row"]


@dataclass(slots=True)
class _Book:
    budget: Budget
    start: dt.datetime
    end: dt.datetime
    spent: Decimal = Decimal(0)
    reserved: Decimal = Decimal(0)
    events: deque[tuple[dt.datetime, Decimal]] = field(default_factory=deque)  # rolling periods only
    crossed: set[int] = field(default_factory=set)

    def roll(self, now: dt.datetime) -> None:
        """Move to the period containing ``now`` (spend restarts at 0 for calendar periods)."""
        if self.budget.period.kind == "rolling":
            self.start, self.end = self.budget.period.window(now)
            while self.events and self.events[0][0] < self.start:
                self.spent -= self.events.popleft()[1]
        elif now >= self.end:
            self.start, self.end = self.budget.period.window(now)
            self.spent = Decimal(0)
            self.crossed.clear()


@dataclass(slots=True)
class Reservation:
    """Amounts (USD) held against blocking budgets for one request until it ends."""

    holds: list[tuple[_Book, Decimal]]
    id: int = 0


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
        "team": row.get("team"),
        "project": row.get("project"),
        "end_user": row.get("end_user"),
        "model": (row.get("requested_model"), row.get("served_model")),
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
    """

    def __init__(
        self, budgets: Iterable[Budget], now: dt.datetime, on_crossing: Callable[[Budget], None] | None = None
    ) -> None:
        self._books = [_Book(b, *b.period.window(now)) for b in budgets]
        self.on_crossing = on_crossing
        self._ids = itertools.count(1)

    @property
    def budgets(self) -> list[Budget]:
        """The guarded budgets."""
        return [book.budget for book in self._books]

    def load(self, spent: Mapping[str, Decimal], events: Mapping[str, list[tuple[dt.datetime, Decimal]]]) -> None:
        """Set each budget's spend so far this period (from the ledger, at start).

        Args:
            spent: budget name -> USD spent in its current calendar period.
            events: budget name -> ``(started_at, cost)`` of rows in a rolling budget's window.
        """
        for book in self._books:
            if book.budget.period.kind == "rolling":
                book.events = deque(sorted(events.get(book.budget.name, [])))
                book.spent = sum((cost for _, cost in book.events), Decimal(0))
            else:
                book.spent = spent.get(book.budget.name, Decimal(0))
            book.crossed = {t for t in book.budget.thresholds if book.spent * 100 >= book.budget.limit_usd * t}

    def in_scope(self, attributes: Mapping[str, Any], *, blocking_only: bool = False) -> list[Budget]:
        """Budgets whose scope covers a request or row with these attributes."""
        return [b.budget for b in self._matching(attributes) if b.budget.blocking or not blocking_only]

    def _matching(self, attributes: Mapping[str, Any]) -> list[_Book]:
        return [book for book in self._books if book.budget.matches(attributes)]

    def admit(
        self, attributes: Mapping[str, Any], worst_case: Decimal, now: dt.datetime, *, unbounded: bool = False
    ) -> Reservation:
        """Reserve ``worst_case`` USD against every blocking budget in scope, or refuse.

        ``unbounded``: the request's input cannot be bounded (it points at stored files or an
        earlier response), so it reserves everything left in each budget: it runs alone, and
        only when more than ``worst_case`` (the part that can be counted) is left.

        Raises:
            BudgetRefusal: a blocking budget in scope would go over its limit (the tightest one).
        """
        books = [book for book in self._matching(attributes) if book.budget.blocking]
        for book in books:
            book.roll(now)
        holds = []
        for book in books:
            committed = book.spent + book.reserved
            remaining = max(book.budget.limit_usd - committed, Decimal(0))
            if committed + worst_case > book.budget.limit_usd or (unbounded and remaining <= worst_case):
                raise BudgetRefusal(book.budget, remaining, worst_case, book.end, unbounded=unbounded)
            holds.append((book, remaining if unbounded else worst_case))
        for book, amount in holds:
            book.reserved += amount
        return Reservation(holds, next(self._ids))

    def release(self, reservation: Reservation | None) -> None:
        """Give back what ``reservation`` held (call once, when its request ends)."""
        if reservation is None:
            return
        for book, amount in reservation.holds:
            book.reserved -= amount
        reservation.holds = []

    def observe(self, row: Mapping[str, Any]) -> None:
        """Count a written ledger row's cost against the budgets in its scope and period."""
        cost = row.get("cost_usd")
        if not cost:
            return
        started = dt.datetime.fromtimestamp(row["started_at"], dt.UTC)
        attributes = attributes_of_row(row)
        for book in self._matching(attributes):
            book.roll(max(started, book.start))
            if not book.start <= started < book.end and book.budget.period.kind != "rolling":
                continue
            book.spent += cost
            if book.budget.period.kind == "rolling":
                book.events.append((started, cost))
            newly = {t for t in book.budget.thresholds if book.spent * 100 >= book.budget.limit_usd * t} - book.crossed
            if newly:
                book.crossed |= newly
                if self.on_crossing is not None:
                    self.on_crossing(book.budget)

    def tightest(self, attributes: Mapping[str, Any], now: dt.datetime) -> tuple[Budget, Decimal] | None:
        """The budget in scope with the least USD left (counting open reservations), and that amount."""
        best: tuple[Budget, Decimal] | None = None
        for book in self._matching(attributes):
            book.roll(now)
            left = max(book.budget.limit_usd - book.spent - book.reserved, Decimal(0))
            if best is None or left < best[1]:
                best = (book.budget, left)
        return best

    def snapshot(self, now: dt.datetime) -> list[dict[str, Any]]:
        """Every budget's status now (spend, reserved, percent, forecast), for ``/budgets``-style views."""
        result = []
        for book in self._books:
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
                }
            )
        return result
