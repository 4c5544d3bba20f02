"""Settling a ``usage_unknown`` row once the provider's bill says what the request cost.

A request that may have reached the provider without its usage coming back (the client left
before the reply, tokenward was killed while it was at the upstream) is recorded
``usage_unknown`` and keeps counting its budget reservation (``reserved_usd``) as spend. When
the operator learns the real figure (the provider's usage export, its dashboard), this module
writes it: the row becomes ``priced`` at that cost (``price_resolved_by = 'reconciled'``, one
cost line ``reconciled``), or ``not_billed`` at $0.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import duckdb

from tokenward.reports.ledger.duck import apply_prices

__all__ = ["reconcile"]

Apply = Callable[[duckdb.DuckDBPyConnection, list[dict[str, Any]]], None]
"""``apply(conn, updates)``: store price columns (``Ledger.apply_prices``: the DuckDB file, or Postgres)."""


def reconcile(
    conn: duckdb.DuckDBPyConnection, request_id: str, cost_usd: Decimal | None, apply: Apply = apply_prices
) -> str:
    """Settle the ``usage_unknown`` row ``request_id`` at ``cost_usd`` (``None``: not billed).

    The row is read on ``conn`` and written through ``apply`` (the ledger's engine: for a
    Postgres ledger ``conn`` is its report copy and ``apply`` writes the server's row too).

    Returns:
        The row's new price status (``priced`` or ``not_billed``).

    Raises:
        ValueError: no such row, the row is not ``usage_unknown``, or a negative cost.
    """
    found = conn.execute(
        "SELECT price_status, price_entry_id, output_cost_usd, cache_savings_usd FROM requests WHERE request_id = ?",
        [request_id],
    ).fetchone()
    if found is None:
        raise ValueError(f"no ledger row has request_id {request_id!r}")
    if found[0] != "usage_unknown":
        raise ValueError(f"request {request_id!r} is {found[0]}, not usage_unknown: nothing to reconcile")
    if cost_usd is not None and cost_usd < 0:
        raise ValueError("a cost cannot be negative")
    status = "not_billed" if cost_usd is None else "priced"
    amount = Decimal(0) if cost_usd is None else cost_usd
    line = [{"component": "reconciled", "quantity": 1, "rate": str(amount), "amount": str(amount), "rule": "bill"}]
    update = {
        "request_id": request_id,
        "price_status": status,
        "cost_usd": amount,
        "price_entry_id": found[1],
        "price_resolved_by": "reconciled",
        "cost_lines": line,
        "output_cost_usd": found[2],
        "cache_savings_usd": found[3],
    }
    apply(conn, [update])
    return status
