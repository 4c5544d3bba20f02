"""Report queries over the ledger; each takes an open connection and returns plain rows.

Money stays exact: sums of ``DECIMAL(38, 12)`` come back as ``Decimal``. A dollar total adds
the rows whose cost is known; unpriced rows (cost NULL) are counted beside it, never hidden in
a $0, and a group with no priced row has a NULL cost. Provider-reported costs (OpenRouter's
``usage.cost``) are summed beside ours, with the drift between them.
Tokens and costs add up every row (a request's retried attempts and other-model parts
included); ``requests`` counts only the one ``request`` row of each request.
Calendar groupings (``day``) use the given IANA time zone; stored times are UTC.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from typing import Any

import duckdb

from tokenward.reports.ledger import ROW_COLUMNS

__all__ = ["EXPORT_COLUMNS", "GROUPINGS", "export_rows", "spend"]

GROUPINGS: dict[str, str] = {
    "model": "coalesce(served_model, requested_model, '(none)')",
    "day": "CAST(timezone($tz, started_at) AS DATE)",
    "principal": "principal",
    "upstream": "coalesce(upstream, '(none)')",
    "endpoint": "endpoint",
    "outcome": "outcome",
}
"""Group-by dimensions of :func:`spend` and their SQL expressions."""

EXPORT_COLUMNS: tuple[str, ...] = tuple(ROW_COLUMNS)
"""Columns of :func:`export_rows`, with the ledger's canonical names."""

_MEASURES = """
    count(*) FILTER (WHERE row_kind = 'request') AS requests,
    sum(input_tokens) AS input_tokens,
    sum(cached_input_tokens) AS cached_input_tokens,
    sum(cache_write_tokens) AS cache_write_tokens,
    sum(output_tokens) AS output_tokens,
    sum(reasoning_tokens) AS reasoning_tokens,
    sum(cost_usd)::DECIMAL(38, 12) AS cost_usd,
    count(*) FILTER (WHERE price_status IN ('unpriced', 'partially_priced')) AS unpriced_requests,
    coalesce(sum(input_tokens + output_tokens) FILTER (WHERE price_status = 'unpriced'), 0) AS unpriced_tokens,
    count(*) FILTER (WHERE price_status = 'usage_unknown') AS usage_unknown_requests,
    count(*) FILTER (WHERE price_status = 'fallback') AS fallback_priced_requests,
    count(*) FILTER (WHERE usage_source IN ('estimated', 'partial')) AS estimated_requests,
    sum(provider_cost_usd)::DECIMAL(38, 12) AS provider_cost_usd,
    sum(provider_cost_usd - cost_usd) FILTER (WHERE provider_cost_usd IS NOT NULL AND cost_usd IS NOT NULL)
        ::DECIMAL(38, 12) AS provider_cost_drift_usd
"""


def _window(since: dt.datetime | None, until: dt.datetime | None) -> tuple[str, list[Any]]:
    clauses, params = [], []
    if since is not None:
        clauses.append("started_at >= $since")
        params.append(("since", since))
    if until is not None:
        clauses.append("started_at < $until")
        params.append(("until", until))
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


def spend(
    conn: duckdb.DuckDBPyConnection,
    by: Sequence[str] = ("model",),
    *,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    tz: str = "UTC",
) -> list[dict[str, Any]]:
    """Requests, tokens and cost grouped by ``by`` over ``[since, until)``.

    Args:
        conn: an open ledger connection.
        by: keys of :data:`GROUPINGS`, in order.
        since: inclusive start (timezone-aware), or ``None`` for the beginning.
        until: exclusive end (timezone-aware), or ``None`` for now.
        tz: IANA zone for calendar groupings.

    Returns:
        One dict per group, ordered by the group keys: the keys of ``by`` plus ``requests``,
        token sums (tokens), ``cost_usd`` (``Decimal``, ``None`` when nothing is priced),
        ``unpriced_requests`` (unpriced or partially priced), ``unpriced_tokens`` (input + output of
        the unpriced ones), ``usage_unknown_requests``,
        ``fallback_priced_requests``, ``estimated_requests``, ``provider_cost_usd`` and
        ``provider_cost_drift_usd`` (provider's figure minus ours, where both exist).

    Raises:
        ValueError: unknown grouping, or a naive ``since``/``until``.
    """
    for name in by:
        if name not in GROUPINGS:
            raise ValueError(f"unknown grouping {name!r}; choose from {', '.join(GROUPINGS)}")
    for bound in (since, until):
        if bound is not None and bound.tzinfo is None:
            raise ValueError("since/until must be timezone-aware")
    where, window = _window(since, until)
    keys = ", ".join(f"{GROUPINGS[name]} AS {name}" for name in by)
    order = ", ".join(str(i + 1) for i in range(len(by)))
    select = f"SELECT {keys + ',' if keys else ''} {_MEASURES} FROM requests{where}"
    if by:
        select += f" GROUP BY {order} ORDER BY {order}"
    params = dict(window)
    if "$tz" in select:
        params["tz"] = tz
    cursor = conn.execute(select, params)
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def export_rows(
    conn: duckdb.DuckDBPyConnection,
    *,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    batch: int = 10_000,
) -> Iterator[dict[str, Any]]:
    """Every ledger row in ``[since, until)`` in start order, as dicts of :data:`EXPORT_COLUMNS`.

    ``started_at``/``ended_at`` are UTC ``datetime`` values, costs ``Decimal``, JSON columns
    (``cost_lines``, ``raw_usage``) their JSON text. Rows are fetched ``batch`` at a time.
    """
    where, window = _window(since, until)
    cursor = conn.execute(
        f"SELECT {', '.join(EXPORT_COLUMNS)} FROM requests{where} ORDER BY started_at, request_id", dict(window)
    )
    while True:
        chunk = cursor.fetchmany(batch)
        if not chunk:
            return
        for row in chunk:
            yield dict(zip(EXPORT_COLUMNS, row, strict=True))
