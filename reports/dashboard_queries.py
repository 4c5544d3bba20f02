"""What the live dashboard reads from the ledger: spend so far, over time, by group, and alerts sent.

Built on the report queries (:func:`tokenward.reports.queries.spend`,
:func:`~tokenward.reports.queries.spend_totals`), so a dashboard figure and the same
``tokenward report`` agree to the cent. Every function takes an open connection; the proxy calls
them in its short ledger sessions between flushes (``proxy/dashboard.py``), never on the event loop.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from tokenward.reports.ledger.state import ClaimRecord, StateStore
from tokenward.reports.queries import Selection, spend, spend_totals
from tokenward.reports.views import calendar_range

if TYPE_CHECKING:
    import duckdb

__all__ = ["RANGES", "history", "range_start", "sent_alerts"]

RANGES = ("today", "24h", "7d", "30d")
"""Ranges the group breakdowns cover: the calendar day so far, or the last 24 hours / 7 / 30 days."""

_TOTAL_FIELDS = (
    "requests",
    "cost_usd",
    "cache_savings_usd",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "cache_hit_rate",
    "unpriced_requests",
)
_GROUP_FIELDS = ("requests", "cost_usd", "cache_savings_usd", "input_tokens", "output_tokens", "unpriced_requests")


def range_start(name: str, tz: str, now: dt.datetime) -> dt.datetime:
    """Where range ``name`` (see :data:`RANGES`) begins at ``now`` (``today``: local midnight in ``tz``).

    Raises:
        ValueError: unknown range or zone.
    """
    if name == "today":
        return calendar_range("today", tz, now).since
    hours = {"24h": 24, "7d": 24 * 7, "30d": 24 * 30}.get(name)
    if hours is None:
        raise ValueError(f"unknown range {name!r}; choose from {', '.join(RANGES)}")
    return now - dt.timedelta(hours=hours)


def _hour_start(tz: str, now: dt.datetime) -> dt.datetime:
    """The start of the local clock hour containing ``now`` (zones with half-hour offsets included)."""
    local = now.astimezone(ZoneInfo(tz))
    return local.replace(minute=0, second=0, microsecond=0).astimezone(dt.UTC)


def _point(name: str, value: Any, group: dict[str, Any] | None) -> dict[str, Any]:
    """One point of a series (zero for a bucket with no request)."""
    if group is None:
        return {name: value, "cost_usd": Decimal(0), "requests": 0}
    return {name: value, "cost_usd": group["cost_usd"] or Decimal(0), "requests": group["requests"]}


def _pick(row: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    return {name: row.get(name) for name in names}


def history(
    conn: duckdb.DuckDBPyConnection,
    now: dt.datetime,
    tz: str = "UTC",
    range_name: str = "today",
    top: int = 8,
    *,
    state: StateStore | None = None,
) -> dict[str, Any]:
    """The dashboard's ledger figures at ``now``.

    Args:
        conn: an open ledger connection.
        now: the instant the figures are for (aware); requests started up to ``now`` count.
        tz: IANA zone of "today", "this hour" and the daily series.
        range_name: what the breakdowns cover (:data:`RANGES`).
        top: groups kept per breakdown (by cost).
        state: the ledger's state store, for the alerts sent (none: no alerts listed).

    Returns:
        ``today``, ``this_hour``, ``range`` (totals: ``requests``, ``cost_usd``,
        ``cache_savings_usd`` in ``Decimal`` USD, token sums, ``cache_hit_rate``,
        ``unpriced_requests``); ``by_model``, ``by_key``, ``by_team`` (the ``top`` groups of the
        range by cost, each with ``name`` and the same measures); ``hourly`` (the last 24 clock
        hours, the current one last: ``t`` epoch seconds the hour began, ``cost_usd``,
        ``requests``; zeros where nothing was spent); ``daily`` (the last 30 local days, today
        last: ``day`` ISO date, ``cost_usd``, ``requests``); ``alerts``
        (:func:`sent_alerts`, from ``state``, the ledger's state store; empty without one).

    The session runs on one DuckDB thread, leaving the other cores to the proxy's event loop
    (``conn`` is the proxy's short-lived session, so the setting ends with it).

    Raises:
        ValueError: unknown range or zone.
    """
    conn.execute("SET threads = 1")
    until = now + dt.timedelta(microseconds=1)
    today_start = range_start("today", tz, now)
    since = range_start(range_name, tz, now)
    totals = {
        "today": spend_totals(conn, Selection(today_start, until, tz=tz)),
        "this_hour": spend_totals(conn, Selection(_hour_start(tz, now), until, tz=tz)),
        "range": spend_totals(conn, Selection(since, until, tz=tz)),
    }
    result: dict[str, Any] = {name: _pick(row, _TOTAL_FIELDS) for name, row in totals.items()}
    for dimension in ("model", "key", "team"):
        groups = spend(conn, [dimension], since=since, until=until, tz=tz, top=top)
        result[f"by_{dimension}"] = [{"name": g[dimension], **_pick(g, _GROUP_FIELDS)} for g in groups]
    first_hour = _hour_start(tz, now) - dt.timedelta(hours=23)
    hours = {
        int(dt.datetime.fromisoformat(h["hour"]).timestamp()): h
        for h in spend(conn, ["hour"], since=first_hour, until=until, tz=tz)
    }
    result["hourly"] = [
        _point("t", t, hours.get(t)) for t in range(int(first_hour.timestamp()), int(now.timestamp()) + 1, 3600)
    ]
    first_day = calendar_range("today", tz, now - dt.timedelta(days=29)).since
    days = {d["day"]: d for d in spend(conn, ["day"], since=first_day, until=until, tz=tz)}
    local_first = first_day.astimezone(ZoneInfo(tz)).date()
    result["daily"] = [
        _point("day", day.isoformat(), days.get(day)) for day in (local_first + dt.timedelta(days=i) for i in range(30))
    ]
    result["alerts"] = sent_alerts(state) if state is not None else []
    return result


def sent_alerts(state: StateStore, limit: int = 20) -> list[dict[str, Any]]:
    """The last ``limit`` alerts claimed (newest first), with where they were delivered.

    Thresholds claimed together are one alert. Each: ``budget``, ``kind`` (``threshold``,
    ``forecast``, ``refusing``, ``unpriced_model``, ``delivery_failed``), ``thresholds`` (percent),
    ``created_at`` (UTC ``datetime``), ``status`` (``pending``, ``sent`` or ``failed``),
    ``attempts``, ``last_error``, ``subject`` (the message's subject) and ``delivered_to``
    (``channel target`` of each successful delivery).
    """
    groups: dict[tuple[Any, ...], list[ClaimRecord]] = {}
    for claim in state.claims():
        key = (claim.key.budget, claim.key.period_start, claim.key.kind, claim.created_at)
        groups.setdefault(key, []).append(claim)
    ordered = sorted(groups.items(), key=lambda item: (item[0][3], item[0][0]), reverse=True)[:limit]
    found = []
    for (budget, _, kind, created), claims in ordered:
        statuses = sorted(c.status for c in claims)
        delivered = {f"{d.channel} {d.target}" for c in claims for d in state.deliveries(c.key) if d.ok}
        found.append(
            {
                "budget": budget,
                "kind": kind,
                "thresholds": sorted(c.key.threshold for c in claims),
                "created_at": created,
                "status": statuses[0],
                "attempts": max(c.attempts for c in claims),
                "last_error": max((c.last_error for c in claims if c.last_error), default=None),
                "subject": claims[0].detail.get("subject"),
                "delivered_to": sorted(delivered),
            }
        )
    return found
