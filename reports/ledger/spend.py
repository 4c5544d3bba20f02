"""What budget evaluation reads from the ledger: spend in a scope and window, top spenders, refusals.

:class:`SpendSource` is the seam: budget checks (:mod:`tokenward.reports.budget_check`) read
figures only through it. :class:`DuckSpend` answers from a DuckDB ledger connection (the CLI,
and the proxy at start); the proxy's running books answer without touching the file
(``tokenward.proxy.guard.BooksSpend``), so a reader holding the ledger never delays an alert.

A row counts against a budget by :data:`~tokenward.reports.ledger.schema.SPEND_EXPRESSION`: its
cost, or, while it is ``usage_unknown``, the worst case its reservation held.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Protocol

from tokenward.pricing.budgets import Budget
from tokenward.reports.ledger.schema import SPEND_EXPRESSION
from tokenward.reports.queries import bare_models, model_condition, plain_models

if TYPE_CHECKING:
    import duckdb

__all__ = ["DuckSpend", "SpendSource", "UnpricedModel", "scope_clause"]

_COLUMNS = {
    "key": "principal",
    "team": "team",
    "project": "project",
    "end_user": "end_user",
    "upstream": "upstream",
    "org": "org",
    "pool": "pool",
    "run": "run_id",
}

UnpricedModel = tuple[str | None, str | None, dt.datetime, int, str]
"""``(provider, model, first seen, requests, an example request id)``."""


class SpendSource(Protocol):
    """Spend figures for budget evaluation (USD as ``Decimal``; windows ``[start, end)`` in UTC)."""

    def spend_in(self, budget: Budget, start: dt.datetime, end: dt.datetime) -> Decimal:
        """USD counted against ``budget`` by requests that started in ``[start, end)``."""
        ...

    def top_spenders(
        self, budget: Budget, start: dt.datetime, end: dt.datetime, column: str, limit: int = 5
    ) -> list[tuple[str, Decimal]]:
        """The ``limit`` largest ``model`` or ``key`` values by cost in the scope and window."""
        ...

    def refusals(self, budget: Budget, start: dt.datetime) -> int:
        """Requests ``budget`` refused since ``start``."""
        ...

    def unpriced_models(self, status: str = "unpriced") -> list[UnpricedModel]:
        """Every model with rows of price status ``status`` (``unpriced``, ``usage_invalid``), first seen first."""
        ...

    def totals(self, start: dt.datetime, end: dt.datetime) -> tuple[Decimal, int, int, int]:
        """``(USD, requests, input + output tokens, unpriced rows)`` of everything in the window."""
        ...


def scope_clause(budget: Budget) -> tuple[str, list[Any]]:
    """DuckDB SQL condition (and its parameters) selecting the ledger rows in ``budget``'s scope."""
    clauses: list[str] = []
    params: list[Any] = []
    for dimension, value in budget.scope:
        if dimension == "model":  # as pricing.budgets.same_model: the name (any routing prefix) or its snapshots
            clauses.append(model_condition("?", "?"))
            params += [plain_models([value]), bare_models([value])]
        elif dimension == "tag":
            clauses.append("list_contains(tags, ?)")
            params.append(value)
        else:
            clauses.append(f"{_COLUMNS[dimension]} = ?")
            params.append(value)
    return (" AND ".join(clauses) or "TRUE"), params


class DuckSpend:
    """:class:`SpendSource` over an open DuckDB ledger connection.

    Args:
        conn: a ledger connection (read-only is enough).
    """

    def __init__(self, conn: duckdb.DuckDBPyConnection) -> None:
        self.conn = conn

    def present(self, request_ids: Sequence[str]) -> set[str]:
        """Which of ``request_ids`` the ledger holds (as this connection sees it)."""
        if not request_ids:
            return set()
        found = self.conn.execute(
            "SELECT request_id FROM requests WHERE list_contains(?, request_id)", [list(request_ids)]
        ).fetchall()
        return {str(r[0]) for r in found}

    def spend_in(self, budget: Budget, start: dt.datetime, end: dt.datetime) -> Decimal:
        """See :meth:`SpendSource.spend_in`."""
        where, params = scope_clause(budget)
        row = self.conn.execute(
            f"SELECT coalesce(sum({SPEND_EXPRESSION}), 0) FROM requests "
            f"WHERE started_at >= ? AND started_at < ? AND {where}",
            [start, end, *params],
        ).fetchone()
        return Decimal(row[0]) if row else Decimal(0)

    def rolling_events(self, budget: Budget, start: dt.datetime) -> list[tuple[dt.datetime, Decimal, str, str]]:
        """``(started_at, amount, model, key)`` of each row counted against ``budget`` since ``start``."""
        where, params = scope_clause(budget)
        rows = self.conn.execute(
            f"SELECT started_at, {SPEND_EXPRESSION} AS amount, coalesce(served_model, requested_model, '(none)'), "
            f"principal FROM requests WHERE started_at >= ? AND {where} "
            f"AND {SPEND_EXPRESSION} IS NOT NULL AND {SPEND_EXPRESSION} <> 0 ORDER BY started_at",
            [start, *params],
        ).fetchall()
        return [(r[0], Decimal(r[1]), str(r[2]), str(r[3])) for r in rows]

    def top_spenders(
        self, budget: Budget, start: dt.datetime, end: dt.datetime, column: str, limit: int = 5
    ) -> list[tuple[str, Decimal]]:
        """See :meth:`SpendSource.top_spenders`."""
        expression = {"model": "coalesce(served_model, requested_model)", "key": "principal"}[column]
        where, params = scope_clause(budget)
        rows = self.conn.execute(
            f"SELECT {expression}, sum({SPEND_EXPRESSION}) FROM requests WHERE started_at >= ? AND started_at < ? "
            f"AND {where} AND {SPEND_EXPRESSION} IS NOT NULL GROUP BY 1 ORDER BY 2 DESC LIMIT ?",
            [start, end, *params, limit],
        ).fetchall()
        return [(str(name), Decimal(cost)) for name, cost in rows if cost]

    def refusals(self, budget: Budget, start: dt.datetime) -> int:
        """See :meth:`SpendSource.refusals`."""
        row = self.conn.execute(
            "SELECT count(*) FROM requests WHERE outcome = 'rejected' AND started_at >= ? AND starts_with(error, ?)",
            [start, f"Budget {budget.name!r} "],  # the refusal's message (proxy/guard.py BudgetRefusal)
        ).fetchone()
        return int(row[0]) if row else 0

    def unpriced_models(self, status: str = "unpriced") -> list[UnpricedModel]:
        """See :meth:`SpendSource.unpriced_models`."""
        rows = self.conn.execute(
            "SELECT provider, coalesce(served_model, requested_model) AS model, min(started_at), count(*), "
            "min(request_id) FROM requests WHERE price_status = ? GROUP BY 1, 2 ORDER BY 3",
            [status],
        ).fetchall()
        return [(p, m, first, int(n), str(rid)) for p, m, first, n, rid in rows]

    def totals(self, start: dt.datetime, end: dt.datetime) -> tuple[Decimal, int, int, int]:
        """See :meth:`SpendSource.totals`."""
        row = self.conn.execute(
            "SELECT coalesce(sum(cost_usd), 0), count(*) FILTER (WHERE row_kind = 'request'), "
            "coalesce(sum(input_tokens + output_tokens), 0), count(*) FILTER (WHERE price_status = 'unpriced') "
            "FROM requests WHERE started_at >= ? AND started_at < ?",
            [start, end],
        ).fetchone()
        assert row is not None
        return Decimal(row[0]), int(row[1]), int(row[2]), int(row[3])

    def spend_by(
        self, budget: Budget, start: dt.datetime, end: dt.datetime, dimension: str
    ) -> list[tuple[str, Decimal]]:
        """USD per value of ``dimension`` (``end_user``, ``key``, ...) in ``budget``'s scope and the window."""
        where, params = scope_clause(budget)
        column = _COLUMNS[dimension]
        rows = self.conn.execute(
            f"SELECT {column}, sum({SPEND_EXPRESSION}) FROM requests WHERE started_at >= ? AND started_at < ? "
            f"AND {where} AND {column} IS NOT NULL AND {SPEND_EXPRESSION} IS NOT NULL GROUP BY 1 ORDER BY 2 DESC",
            [start, end, *params],
        ).fetchall()
        return [(str(value), Decimal(amount)) for value, amount in rows]

    def run_spend(self, since: dt.datetime) -> list[tuple[str | None, str, dt.datetime, Decimal]]:
        """``(key_id, run_id, first request, USD)`` of every run with a request since ``since``."""
        rows = self.conn.execute(
            f"SELECT key_id, run_id, min(started_at), coalesce(sum({SPEND_EXPRESSION}), 0) FROM requests "
            "WHERE run_id IS NOT NULL AND started_at >= ? GROUP BY 1, 2",
            [since],
        ).fetchall()
        return [(key_id, str(run_id), first, Decimal(spent)) for key_id, run_id, first, spent in rows]

    def spend_by_minute(self, budget: Budget, start: dt.datetime) -> list[tuple[int, Decimal]]:
        """``(minute, USD)`` in ``budget``'s scope since ``start``; minutes as UTC epoch seconds."""
        where, params = scope_clause(budget)
        rows = self.conn.execute(
            f"SELECT CAST(floor(epoch(started_at) / 60) AS BIGINT) * 60, sum({SPEND_EXPRESSION}) FROM requests "
            f"WHERE started_at >= ? AND {where} AND {SPEND_EXPRESSION} IS NOT NULL GROUP BY 1 ORDER BY 1",
            [start, *params],
        ).fetchall()
        return [(int(minute), Decimal(amount)) for minute, amount in rows if amount]

    def ids_present(self, request_ids: Sequence[str]) -> set[str]:
        """Which of ``request_ids`` have a row already."""
        if not request_ids:
            return set()
        rows = self.conn.execute(
            "SELECT request_id FROM requests WHERE list_contains(?, request_id)", [list(request_ids)]
        ).fetchall()
        return {r[0] for r in rows}
