"""What the live views show from memory: the last finished requests and the last hour's spend.

:class:`LiveFeed` is fed by the recorder with every row it queues (one call per finished
exchange, on the event loop, a few microseconds: no I/O, no lock). It keeps

* the last ``recent`` rows, slimmed to the columns a live table shows (a ring buffer);
* per-second buckets of the last ``horizon_s`` seconds (requests, cost, cache savings, tokens),
  at most one bucket per second, so memory stays bounded whatever the traffic;
* per budget, per-second cost buckets of the rows in its scope, for its current burn rate.

Times are the instants rows reach the recorder (when their cost becomes known), as UTC epoch
seconds. Money stays ``Decimal`` USD. Readers (:mod:`tokenward.proxy.dashboard`) run on the same
event loop, so nothing here needs locking.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from operator import itemgetter
from typing import Any

from tokenward.pricing.budgets import Budget
from tokenward.proxy.guard import attributes_of_row

__all__ = ["RECENT_COLUMNS", "LiveFeed"]

RECENT_COLUMNS = (
    "request_id",
    "started_at",
    "ended_at",
    "principal",
    "team",
    "project",
    "end_user",
    "endpoint",
    "requested_model",
    "served_model",
    "stream",
    "http_status",
    "outcome",
    "row_kind",
    "input_tokens",
    "cached_input_tokens",
    "cache_write_tokens",
    "output_tokens",
    "reasoning_tokens",
    "cost_usd",
    "cache_savings_usd",
    "price_status",
    "latency_ms",
)
"""Ledger columns kept for each recent row (``reports.ledger.ROW_COLUMNS`` names)."""

_ZERO = Decimal(0)
_MICRO = Decimal("0.000001")
_CENTI = Decimal("0.01")

_recent_values = itemgetter(*RECENT_COLUMNS)
_SCOPE_COLUMNS = (
    "principal",
    "team",
    "project",
    "end_user",
    "requested_model",
    "served_model",
    "upstream",
    "org",
    "pool",
    "sent_model",
)


_scope_values = itemgetter(*_SCOPE_COLUMNS)  # with the tags: what a budget scope looks at (attributes_of_row)
_MAX_SCOPES = 4096  # distinct attribute sets whose matching budgets are remembered

# bucket layout: [second, requests, cost_usd, cache_savings_usd, input_tokens, output_tokens]
_SECOND, _REQUESTS, _COST, _SAVINGS, _INPUT, _OUTPUT = range(6)


class LiveFeed:
    """A bounded in-memory view of the rows the recorder has queued.

    Args:
        budgets: budgets whose scopes get their own burn rate (:meth:`budget_burn`).
        recent: how many rows the ring buffer keeps.
        horizon_s: how many seconds of per-second buckets are kept (rates look back at most this far).
        now: the instant the feed starts (epoch seconds; rates over windows longer than the feed's
            age use its age instead).
    """

    def __init__(
        self,
        budgets: Sequence[Budget] = (),
        *,
        recent: int = 200,
        horizon_s: int = 3600,
        now: float | None = None,
    ) -> None:
        self.started = time.time() if now is None else now
        self.horizon_s = horizon_s
        self.rows_seen = 0
        self._recent: deque[tuple[Any, ...]] = deque(maxlen=recent)
        self._seconds: deque[list[Any]] = deque()
        self._budgets = list(budgets)
        self._budget_seconds: dict[str, deque[list[Any]]] = {b.name: deque() for b in self._budgets}
        self._scopes: dict[tuple[Any, ...], list[deque[list[Any]]]] = {}

    def add(self, rows: Iterable[Mapping[str, Any]], now: float | None = None) -> None:
        """Take the rows of one finished exchange (``build_rows`` output) as they are queued."""
        now = time.time() if now is None else now
        second = int(now)
        seconds = self._seconds
        if seconds and seconds[-1][_SECOND] >= second:
            bucket = seconds[-1]  # a clock step back lands in the newest bucket
        else:
            bucket = [second, 0, _ZERO, _ZERO, 0, 0]
            seconds.append(bucket)
            self._trim(seconds, second)
        for row in rows:
            self.rows_seen += 1
            try:
                self._recent.append(_recent_values(row))
            except KeyError:  # a row without some column: keep what it has
                self._recent.append(tuple(row.get(name) for name in RECENT_COLUMNS))
            if row.get("row_kind", "request") == "request":
                bucket[_REQUESTS] += 1
            bucket[_INPUT] += row.get("input_tokens") or 0
            bucket[_OUTPUT] += row.get("output_tokens") or 0
            savings = row.get("cache_savings_usd")
            if savings:
                bucket[_SAVINGS] += savings
            cost = row.get("cost_usd")
            if cost:
                bucket[_COST] += cost
                if self._budgets:
                    self._add_to_budgets(row, cost, second)

    def _add_to_budgets(self, row: Mapping[str, Any], cost: Decimal, second: int) -> None:
        tags = row.get("tags")
        try:
            key = (_scope_values(row), tuple(tags) if tags else ())
        except KeyError:
            key = (tuple(row.get(name) for name in _SCOPE_COLUMNS), tuple(tags) if tags else ())
        matched = self._scopes.get(key)
        if matched is None:
            if len(self._scopes) >= _MAX_SCOPES:
                self._scopes.clear()
            attributes = attributes_of_row(row)
            matched = self._scopes[key] = [self._budget_seconds[b.name] for b in self._budgets if b.matches(attributes)]
        for buckets in matched:
            if buckets and buckets[-1][0] >= second:
                buckets[-1][1] += cost
            else:
                buckets.append([second, cost])
                self._trim(buckets, second)

    def _trim(self, buckets: deque[list[Any]], second: int) -> None:
        oldest = second - self.horizon_s
        while buckets and buckets[0][0] <= oldest:
            buckets.popleft()

    def recent(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The last ``limit`` rows (all kept when ``None``), newest first, as dicts of :data:`RECENT_COLUMNS`."""
        rows = list(self._recent)
        rows.reverse()
        return [dict(zip(RECENT_COLUMNS, values, strict=True)) for values in rows[:limit]]

    def _span(self, window_s: float, now: float, floor_s: float) -> float:
        """The window actually covered: ``window_s``, or the feed's age when younger (at least ``floor_s``)."""
        return max(min(window_s, now - self.started), floor_s)

    def totals(self, window_s: float, now: float | None = None) -> dict[str, Any]:
        """Sums over the seconds in ``(now - window_s, now]``.

        Returns ``requests``, ``cost_usd`` and ``cache_savings_usd`` (``Decimal`` USD),
        ``input_tokens``, ``output_tokens``, and ``span_s``: the seconds the sums cover (the
        window, or the feed's age when it is younger).
        """
        now = time.time() if now is None else now
        first = int(now) - int(window_s)
        requests = tokens_in = tokens_out = 0
        cost = savings = _ZERO
        for bucket in reversed(self._seconds):
            if bucket[_SECOND] <= first:
                break
            requests += bucket[_REQUESTS]
            cost += bucket[_COST]
            savings += bucket[_SAVINGS]
            tokens_in += bucket[_INPUT]
            tokens_out += bucket[_OUTPUT]
        return {
            "requests": requests,
            "cost_usd": cost,
            "cache_savings_usd": savings,
            "input_tokens": tokens_in,
            "output_tokens": tokens_out,
            "span_s": self._span(window_s, now, 1.0),
        }

    def rates(self, now: float | None = None) -> dict[str, Any]:
        """Current rates.

        ``requests_per_s`` over the last 10 s (2 places); ``burn_usd_per_min`` over the last 5
        minutes and ``burn_usd_per_hour`` over the last hour (USD, 6 places): the spend in the
        window divided by its length, or by the feed's age when the proxy started more recently
        (at least 60 s, so that one request in the first second is not a huge rate). Also the
        raw sums of the last hour (``last_hour``, see :meth:`totals`).
        """
        now = time.time() if now is None else now
        ten = self.totals(10, now)
        five = self.totals(300, now)
        hour = self.totals(3600, now)
        return {
            "requests_per_s": (Decimal(ten["requests"]) / Decimal(ten["span_s"])).quantize(_CENTI),
            "burn_usd_per_min": (five["cost_usd"] * 60 / Decimal(self._span(300, now, 60))).quantize(_MICRO),
            "burn_usd_per_hour": (hour["cost_usd"] * 3600 / Decimal(self._span(3600, now, 60))).quantize(_MICRO),
            "last_hour": hour,
        }

    def per_minute(self, minutes: int = 60, now: float | None = None) -> list[dict[str, Any]]:
        """The last ``minutes`` whole minutes up to the current one, oldest first.

        Each: ``t`` (epoch seconds the minute began), ``requests``, ``cost_usd`` (``Decimal``).
        Minutes without traffic are there with zeros.
        """
        now = time.time() if now is None else now
        current = int(now) // 60 * 60
        first = current - (minutes - 1) * 60
        series = {first + 60 * i: [0, _ZERO] for i in range(minutes)}
        for bucket in self._seconds:
            minute = bucket[_SECOND] // 60 * 60
            if minute in series:
                series[minute][0] += bucket[_REQUESTS]
                series[minute][1] += bucket[_COST]
        return [{"t": t, "requests": v[0], "cost_usd": v[1]} for t, v in series.items()]

    def budget_burn(self, name: str, window_s: float = 900, now: float | None = None) -> Decimal | None:
        """USD per hour spent in budget ``name``'s scope over the last ``window_s`` seconds.

        Shortened to the feed's age when younger (at least 60 s). ``None`` for a budget the feed
        does not track.
        """
        buckets = self._budget_seconds.get(name)
        if buckets is None:
            return None
        now = time.time() if now is None else now
        first = int(now) - int(window_s)
        cost = _ZERO
        for second, amount in reversed(buckets):
            if second <= first:
                break
            cost += amount
        return cost * 3600 / Decimal(self._span(window_s, now, 60))
