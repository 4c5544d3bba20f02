"""Settling a ``usage_unknown`` row once the provider's bill says what the request cost.

A request that may have reached the provider without its usage coming back (the client left
before the reply, tokenward was killed while it was at the upstream) is recorded
``usage_unknown`` and keeps counting its budget reservation (``reserved_usd``) as spend. When
the operator learns the real figure (the provider's usage export, its dashboard), this module
writes it: the row becomes ``priced`` at that cost (``price_resolved_by = 'reconciled'``, one
cost line ``reconciled``), or ``not_billed`` at $0.
"""

from __future__ import annotations

import json
from decimal import Decimal

import duckdb

__all__ = ["reconcile"]


def reconcile(conn: duckdb.DuckDBPyConnection, request_id: str, cost_usd: Decimal | None) -> str:
    """Settle the ``usage_unknown`` row ``request_id`` at ``cost_usd`` (``None``: not billed).

    Returns:
        The row's new price status (``priced`` or ``not_billed``).

    Raises:
        ValueError: no such row, the row is not ``usage_unknown``, or a negative cost.
    """
    found = conn.execute("SELECT price_status FROM requests WHERE request_id = ?", [request_id]).fetchone()
    if found is None:
        raise ValueError(f"no ledger row has request_id {request_id!r}")
    if found[0] != "usage_unknown":
        raise ValueError(f"request {request_id!r} is {found[0]}, not usage_unknown: nothing to reconcile")
    if cost_usd is not None and cost_usd < 0:
        raise ValueError("a cost cannot be negative")
    status = "not_billed" if cost_usd is None else "priced"
    amount = Decimal(0) if cost_usd is None else cost_usd
    line = [{"component": "reconciled", "quantity": 1, "rate": str(amount), "amount": str(amount), "rule": "bill"}]
    conn.execute(
        "UPDATE requests SET price_status = ?, cost_usd = ?, price_resolved_by = 'reconciled', cost_lines = ? "
        "WHERE request_id = ?",
        [status, amount, json.dumps(line), request_id],
    )
    return status
