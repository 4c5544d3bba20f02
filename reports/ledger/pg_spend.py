"""What budget evaluation reads from a Postgres ledger (its SQL for :class:`SpendSource`).

The same figures as :class:`~tokenward.reports.ledger.spend.DuckSpend`, in Postgres SQL: the
scope of a budget (:func:`pg_scope_clause`) is where the two dialects differ (``= ANY`` for
DuckDB's ``list_contains``, array overlap ``&&`` for ``list_has_any``). A row counts by
:data:`~tokenward.reports.ledger.schema.SPEND_EXPRESSION`, as in every engine.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from tokenward.pricing.budgets import SNAPSHOT_SUFFIX, Budget, model_base
from tokenward.reports.ledger.pg_pool import SyncPool
from tokenward.reports.ledger.schema import SPEND_EXPRESSION
from tokenward.reports.ledger.spend import _COLUMNS, UnpricedModel  # the dimensions' columns, as DuckDB's
from tokenward.reports.queries import cloud_model_sql

__all__ = ["PgSpend", "pg_scope_clause"]


def pg_scope_clause(budget: Budget) -> tuple[str, list[Any]]:
    """Postgres SQL condition (and its ``%s`` parameters) selecting the rows in ``budget``'s scope.

    As :meth:`tokenward.pricing.budgets.Budget.matches` (and DuckDB's ``model_condition``): a
    ``model`` scope takes the requested, sent (a rerouted request's) or served name, without its
    routing prefix and read as the model a cloud's name names (``cloud_model_sql``), equal or once
    a dated snapshot suffix is removed from either side.
    """
    clauses: list[str] = []
    params: list[Any] = []
    for dimension, value in budget.scope:
        if dimension == "model":
            columns = [  # '.' matches a newline in Postgres's regular expressions: all up to the last '/'
                cloud_model_sql(f"regexp_replace(coalesce({c}, '(none)'), '^.*/', '')")
                for c in ("requested_model", "sent_model", "served_model")
            ]
            stripped = [f"regexp_replace({c}, '{SNAPSHOT_SUFFIX.pattern}', '')" for c in columns]
            clauses.append(
                f"(ARRAY[{', '.join(columns + stripped)}] && %s::text[] OR ARRAY[{', '.join(columns)}] && %s::text[])"
            )
            params += [[model_base(value)], [SNAPSHOT_SUFFIX.sub("", model_base(value))]]
        elif dimension == "tag":
            clauses.append("%s = ANY (tags)")
            params.append(value)
        else:
            clauses.append(f"{_COLUMNS[dimension]} = %s")
            params.append(value)
    return (" AND ".join(clauses) or "TRUE"), params


class PgSpend:
    """:class:`~tokenward.reports.ledger.spend.SpendSource` over a Postgres ledger (one query per call).

    Args:
        pool: connections to the ledger's database.
    """

    def __init__(self, pool: SyncPool) -> None:
        self._pool = pool

    def _all(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        with self._pool.connection() as conn:
            return conn.execute(sql, params).fetchall()

    def spend_in(self, budget: Budget, start: dt.datetime, end: dt.datetime) -> Decimal:
        """See :meth:`SpendSource.spend_in`."""
        where, params = pg_scope_clause(budget)
        rows = self._all(
            f"SELECT coalesce(sum({SPEND_EXPRESSION}), 0) FROM requests "
            f"WHERE started_at >= %s AND started_at < %s AND {where}",
            [start, end, *params],
        )
        return Decimal(rows[0][0]) if rows else Decimal(0)

    def rolling_events(self, budget: Budget, start: dt.datetime) -> list[tuple[dt.datetime, Decimal, str, str]]:
        """``(started_at, amount, model, key)`` of each row counted against ``budget`` since ``start``."""
        where, params = pg_scope_clause(budget)
        rows = self._all(
            f"SELECT started_at, {SPEND_EXPRESSION} AS amount, coalesce(served_model, requested_model, '(none)'), "
            f"principal FROM requests WHERE started_at >= %s AND {where} "
            f"AND {SPEND_EXPRESSION} IS NOT NULL AND {SPEND_EXPRESSION} <> 0 ORDER BY started_at",
            [start, *params],
        )
        return [(r[0], Decimal(r[1]), str(r[2]), str(r[3])) for r in rows]

    def top_spenders(
        self, budget: Budget, start: dt.datetime, end: dt.datetime, column: str, limit: int = 5
    ) -> list[tuple[str, Decimal]]:
        """See :meth:`SpendSource.top_spenders`."""
        expression = {"model": "coalesce(served_model, requested_model)", "key": "principal"}[column]
        where, params = pg_scope_clause(budget)
        rows = self._all(
            f"SELECT {expression}, sum({SPEND_EXPRESSION}) FROM requests WHERE started_at >= %s AND started_at < %s "
            f"AND {where} AND {SPEND_EXPRESSION} IS NOT NULL GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT %s",
            [start, end, *params, limit],
        )
        return [(str(name), Decimal(cost)) for name, cost in rows if cost]

    def refusals(self, budget: Budget, start: dt.datetime) -> int:
        """See :meth:`SpendSource.refusals`."""
        rows = self._all(
            "SELECT count(*) FROM requests WHERE outcome = 'rejected' AND started_at >= %s AND starts_with(error, %s)",
            [start, f"Budget {budget.name!r} "],  # the refusal's message (proxy/guard.py BudgetRefusal)
        )
        return int(rows[0][0]) if rows else 0

    def unpriced_models(self, status: str = "unpriced") -> list[UnpricedModel]:
        """See :meth:`SpendSource.unpriced_models`."""
        rows = self._all(
            "SELECT provider, coalesce(served_model, requested_model) AS model, min(started_at), count(*), "
            "min(request_id) FROM requests WHERE price_status = %s GROUP BY 1, 2 ORDER BY 3",
            [status],
        )
        return [(p, m, first, int(n), str(rid)) for p, m, first, n, rid in rows]

    def totals(self, start: dt.datetime, end: dt.datetime) -> tuple[Decimal, int, int, int]:
        """See :meth:`SpendSource.totals`."""
        rows = self._all(
            "SELECT coalesce(sum(cost_usd), 0), count(*) FILTER (WHERE row_kind = 'request'), "
            "coalesce(sum(input_tokens + output_tokens), 0), count(*) FILTER (WHERE price_status = 'unpriced') "
            "FROM requests WHERE started_at >= %s AND started_at < %s",
            [start, end],
        )
        row = rows[0]
        return Decimal(row[0]), int(row[1]), int(row[2]), int(row[3])

    def spend_by(
        self, budget: Budget, start: dt.datetime, end: dt.datetime, dimension: str
    ) -> list[tuple[str, Decimal]]:
        """USD per value of ``dimension`` (``end_user``, ``key``, ...) in ``budget``'s scope and the window."""
        where, params = pg_scope_clause(budget)
        column = _COLUMNS[dimension]
        rows = self._all(
            f"SELECT {column}, sum({SPEND_EXPRESSION}) FROM requests WHERE started_at >= %s AND started_at < %s "
            f"AND {where} AND {column} IS NOT NULL AND {SPEND_EXPRESSION} IS NOT NULL GROUP BY 1 ORDER BY 2 DESC, 1",
            [start, end, *params],
        )
        return [(str(value), Decimal(amount)) for value, amount in rows]

    def run_spend(self, since: dt.datetime) -> list[tuple[str | None, str, dt.datetime, Decimal]]:
        """``(key_id, run_id, first request, USD)`` of every run with a request since ``since``."""
        rows = self._all(
            f"SELECT key_id, run_id, min(started_at), coalesce(sum({SPEND_EXPRESSION}), 0) FROM requests "
            "WHERE run_id IS NOT NULL AND started_at >= %s GROUP BY 1, 2",
            [since],
        )
        return [(key_id, str(run_id), first, Decimal(spent)) for key_id, run_id, first, spent in rows]

    def spend_by_minute(self, budget: Budget, start: dt.datetime) -> list[tuple[int, Decimal]]:
        """``(minute, USD)`` in ``budget``'s scope since ``start``; minutes as UTC epoch seconds."""
        where, params = pg_scope_clause(budget)
        rows = self._all(
            f"SELECT CAST(floor(extract(epoch FROM started_at) / 60) AS bigint) * 60, sum({SPEND_EXPRESSION}) "
            f"FROM requests WHERE started_at >= %s AND {where} AND {SPEND_EXPRESSION} IS NOT NULL "
            "GROUP BY 1 ORDER BY 1",
            [start, *params],
        )
        return [(int(minute), Decimal(amount)) for minute, amount in rows if amount]

    def ids_present(self, request_ids: Sequence[str]) -> set[str]:
        """Which of ``request_ids`` have a row already."""
        if not request_ids:
            return set()
        rows = self._all("SELECT request_id FROM requests WHERE request_id = ANY (%s)", [list(request_ids)])
        return {r[0] for r in rows}
