"""Per-minute spend of the budgets that have velocity rules, kept in the proxy for their alerts.

A velocity rule (:mod:`tokenward.pricing.velocity`) compares the last minutes' spend with the
hours before, so the proxy keeps, per such budget, the USD of each UTC minute (by request start,
as the ledger query does) for the rule's horizon: at most ``window + baseline`` buckets, a
day and a quarter is 1,455 numbers. Fed from every row the guard counts (``guard.listeners``)
and read back from the ledger at start, so a restart does not reset the baseline.
:meth:`VelocityBooks.snapshot` copies them on the event loop for the alert check in a worker
thread.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from tokenward.pricing.budgets import Budget
from tokenward.proxy.guard import attributes_of_row, spend_amount

__all__ = ["VelocityBooks", "VelocitySpend"]


class VelocitySpend:
    """A snapshot of :class:`VelocityBooks`: spend in any whole-minute window of a velocity budget."""

    def __init__(self, minutes: dict[str, dict[int, Decimal]]) -> None:
        self._minutes = minutes

    def spend_in(self, budget: Budget, start: dt.datetime, end: dt.datetime) -> Decimal:
        """USD of the requests in ``budget``'s scope that started in ``[start, end)`` (minute resolution).

        Raises:
            LookupError: ``budget`` has no velocity books.
        """
        minutes = self._minutes.get(budget.name)
        if minutes is None:
            raise LookupError(f"no velocity books for budget {budget.name!r}")
        first, last = start.timestamp(), end.timestamp()
        return sum((amount for minute, amount in minutes.items() if first <= minute < last), Decimal(0))


class VelocityBooks:
    """Per-minute spend of every budget with a velocity rule.

    Args:
        budgets: the configured budgets (those without ``velocity`` are ignored).
    """

    def __init__(self, budgets: Iterable[Budget]) -> None:
        self._budgets = [b for b in budgets if b.velocity is not None]
        self._minutes: dict[str, dict[int, Decimal]] = {b.name: {} for b in self._budgets}

    def __bool__(self) -> bool:
        return bool(self._budgets)

    def observe(self, row: Mapping[str, Any]) -> None:
        """Count a ledger row in the minute it started, for each velocity budget in its scope."""
        amount = spend_amount(row)
        if not amount or not self._budgets:
            return
        minute = int(row["started_at"] // 60) * 60
        attributes = attributes_of_row(row)
        for budget in self._budgets:
            if budget.matches(attributes):
                minutes = self._minutes[budget.name]
                minutes[minute] = minutes.get(minute, Decimal(0)) + amount

    def load(self, source: Any, now: dt.datetime, unflushed: Iterable[Mapping[str, Any]] = ()) -> None:
        """Read each velocity budget's minutes over its horizon from the ledger, plus the unflushed rows."""
        for budget in self._budgets:
            assert budget.velocity is not None
            since = (now - budget.velocity.horizon - dt.timedelta(minutes=1)).replace(second=0, microsecond=0)
            self._minutes[budget.name] = dict(source.spend_by_minute(budget, since))
        for row in unflushed:
            self.observe(row)

    def snapshot(self, now: dt.datetime) -> VelocitySpend:
        """A copy of the books (older minutes than any rule looks at are dropped first)."""
        copies = {}
        for budget in self._budgets:
            assert budget.velocity is not None
            oldest = (now - budget.velocity.horizon).timestamp() - 60
            minutes = self._minutes[budget.name]
            for minute in [m for m in minutes if m < oldest]:
                del minutes[minute]
            copies[budget.name] = dict(minutes)
        return VelocitySpend(copies)
