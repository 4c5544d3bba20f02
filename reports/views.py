"""Report views: calendar ranges, period over period, and the forecast to the period's end.

Calendar periods come from :class:`tokenward.pricing.budgets.Period`, so a report's "this month"
is the same window, in the same time zone, as a monthly budget's.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tokenward.pricing.budgets import Period

__all__ = ["PERIODS", "CalendarRange", "add_change", "add_forecast", "calendar_range", "previous_range"]

PERIODS = ("today", "yesterday", "this-week", "last-week", "this-month", "last-month")
"""Names accepted by :func:`calendar_range`."""

_PCT = Decimal("0.01")
_MICRO = Decimal("0.000001")


@dataclass(frozen=True, slots=True)
class CalendarRange:
    """A report range ``[since, until)`` within the calendar period ``[start, end)``.

    ``until`` is ``now`` for a period still under way (``to_date``), else ``end``.
    """

    name: str
    kind: str
    since: dt.datetime
    until: dt.datetime
    start: dt.datetime
    end: dt.datetime
    to_date: bool


def calendar_range(name: str, tz: str, now: dt.datetime) -> CalendarRange:
    """The range called ``name`` (see :data:`PERIODS`) in zone ``tz`` at instant ``now``.

    Raises:
        ValueError: unknown name or zone.
    """
    if name not in PERIODS:
        raise ValueError(f"unknown period {name!r}; choose from {', '.join(PERIODS)}")
    kind = "day" if name in ("today", "yesterday") else name.split("-")[1]
    period = Period(kind, tz)
    start, end = period.window(now)
    if name in ("today", "this-week", "this-month"):
        return CalendarRange(name, kind, start, now, start, end, True)
    start, end = period.window(start - dt.timedelta(microseconds=1))
    return CalendarRange(name, kind, start, end, start, end, False)


def previous_range(
    since: dt.datetime, until: dt.datetime, calendar: CalendarRange | None, tz: str
) -> tuple[dt.datetime, dt.datetime]:
    """The range a report is compared with.

    For a calendar period: the period before it, as far into it as the current one has gone
    (this month to date against the same stretch of last month, clipped to last month's end);
    otherwise the range of the same length just before ``since``.
    """
    if calendar is None:
        return since - (until - since), since
    start, end = Period(calendar.kind, tz).window(calendar.start - dt.timedelta(microseconds=1))
    return start, min(start + (calendar.until - calendar.start), end)


def add_change(rows: list[dict[str, Any]], previous: list[dict[str, Any]], dims: Sequence[str]) -> list[dict[str, Any]]:
    """Add ``previous_cost_usd`` and ``change_pct`` (percent, 2 places) to ``rows``.

    Groups are matched on the values of ``dims``; a group absent before (or unpriced either
    time) has no change. Groups that spent only before are not listed.
    """
    before = {tuple(r[d] for d in dims): r.get("cost_usd") for r in previous}
    for row in rows:
        old = before.get(tuple(row[d] for d in dims))
        row["previous_cost_usd"] = old
        new = row.get("cost_usd")
        row["change_pct"] = ((new - old) / old * 100).quantize(_PCT) if old and new is not None else None
    return rows


def add_forecast(rows: list[dict[str, Any]], calendar: CalendarRange) -> list[dict[str, Any]]:
    """Add ``forecast_usd``: each row's cost extended at its average burn rate to the period's end.

    ``cost x (end - start) / (until - start)`` (USD, 6 places); ``None`` for a period that is
    over (the cost is final) or in its first minute.
    """
    elapsed = (calendar.until - calendar.start).total_seconds()
    length = Decimal((calendar.end - calendar.start).total_seconds())
    for row in rows:
        cost = row.get("cost_usd")
        usable = calendar.to_date and elapsed >= 60 and cost is not None
        row["forecast_usd"] = (cost * length / Decimal(elapsed)).quantize(_MICRO) if usable else None
    return rows
