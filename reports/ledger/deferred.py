"""Background Responses: billed once, with the real usage, when the finished response is seen.

Design note. A ``POST /v1/responses`` with ``"background": true`` is answered at once with a
queued response whose ``usage`` is null; its row says ``deferred`` and counts the worst case its
budget reservation held (``schema.HELD_STATUSES``). The proxy notes the response here
(:func:`record`: its request id, when it started, what prices it, its scope) before the client
hears the id. When a retrieval, a streamed resume or a cancel through the proxy shows the finished
response with its usage, the proxy prices it and :func:`settle` stores that settlement once: the
first caller wins, whichever process or how often it is retrieved (one conditional ``UPDATE`` of
the SQLite state file beside the ledger). The budget books move by the difference between the real
cost and what was held. Every move of the write-ahead log into the ledger then applies the
settlements not yet applied (:func:`apply_to_duck`): the request's own row gets the real counts
and cost, so a report shows one request at its real cost. A settlement whose row is not in the
ledger yet waits for a later move.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import msgspec

from tokenward.pricing.usage import TOKEN_FIELDS
from tokenward.reports.ledger.state import SqliteState

__all__ = ["SETTLED_COLUMNS", "apply_to_duck", "deferred", "record", "settle", "unapplied"]

SETTLED_COLUMNS: tuple[str, ...] = (
    *TOKEN_FIELDS,
    "served_model",
    "service_tier",
    "usage_source",
    "cost_usd",
    "price_status",
    "price_entry_id",
    "price_resolved_by",
    "cost_lines",
    "output_cost_usd",
    "cache_savings_usd",
    "raw_usage",
    "violations",
)
"""The columns of a deferred row a settlement replaces (the rest, its scope and times, stay)."""

_JSON_COLUMNS = frozenset({"cost_lines", "raw_usage"})
_encode = msgspec.json.Encoder(decimal_format="string").encode
_TABLE = (
    "CREATE TABLE IF NOT EXISTS deferred_responses (response_id TEXT PRIMARY KEY, request_id TEXT NOT NULL, "
    "detail TEXT NOT NULL, settlement TEXT, settled_at TEXT, applied INTEGER NOT NULL DEFAULT 0)"
)


def _run(state: SqliteState, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    conn = state._connect()
    try:
        conn.execute(_TABLE)
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def record(state: SqliteState, response_id: str, request_id: str, detail: dict[str, Any]) -> None:
    """Note a background response (durable when this returns); a second note of the same id is ignored.

    ``detail``: what pricing and the books need later (JSON-encodable; decimals as strings).
    """
    _run(
        state,
        "INSERT OR IGNORE INTO deferred_responses (response_id, request_id, detail) VALUES (?, ?, ?)",
        [response_id, request_id, _encode(detail).decode()],
    )


def deferred(state: SqliteState, response_id: str) -> tuple[str, dict[str, Any]] | None:
    """``(request id, detail)`` of a background response not settled yet; ``None``: unknown or settled."""
    rows = _run(
        state,
        "SELECT request_id, detail FROM deferred_responses WHERE response_id = ? AND settled_at IS NULL",
        [response_id],
    )
    return (rows[0][0], json.loads(rows[0][1])) if rows else None


def settle(state: SqliteState, response_id: str, settlement: dict[str, Any], now: dt.datetime) -> bool:
    """Store the settlement of a background response unless one is stored already: whether this call did.

    ``settlement`` maps :data:`SETTLED_COLUMNS` to the priced row's values. Exactly one call per
    response id returns true, in any number of threads or processes sharing the state file.
    """
    conn = state._connect()
    try:
        conn.execute(_TABLE)
        changed = conn.execute(
            "UPDATE deferred_responses SET settlement = ?, settled_at = ? WHERE response_id = ? AND settled_at IS NULL",
            [_encode(settlement).decode(), now.astimezone(dt.UTC).isoformat(), response_id],
        ).rowcount
    finally:
        conn.close()
    return bool(changed)


def unapplied(state: SqliteState) -> list[tuple[str, str, dict[str, Any]]]:
    """``(response id, request id, settlement)`` of every settlement not yet in the ledger's rows."""
    rows = _run(
        state,
        "SELECT response_id, request_id, settlement FROM deferred_responses "
        "WHERE settlement IS NOT NULL AND applied = 0 ORDER BY settled_at",
        [],
    )
    return [(response_id, request_id, json.loads(text)) for response_id, request_id, text in rows]


def apply_to_duck(conn: Any, state: SqliteState) -> int:
    """Put the settlements not yet applied into their deferred rows of the DuckDB ledger on ``conn``.

    A row that is not in the file yet (still in a write-ahead log) keeps its settlement waiting; a
    row already settled is left as it is (the ``deferred`` condition), and either way the
    settlement is marked applied once its row is in the file.

    Returns:
        The number of rows changed.
    """
    changed = 0
    done: list[str] = []
    for response_id, request_id, settlement in unapplied(state):
        columns = [name for name in SETTLED_COLUMNS if name in settlement]
        values = [_stored(name, settlement[name]) for name in columns]
        assignments = ", ".join(f"{name} = ?" for name in columns)
        found = conn.execute(
            f"UPDATE requests SET {assignments} WHERE request_id = ? AND price_status = 'deferred'",
            [*values, request_id],
        ).fetchone()
        changed += int(found[0]) if found else 0
        if conn.execute("SELECT 1 FROM requests WHERE request_id = ?", [request_id]).fetchone():
            done.append(response_id)
    if done:
        marks = ",".join("?" * len(done))
        _run(state, f"UPDATE deferred_responses SET applied = 1 WHERE response_id IN ({marks})", done)
    return changed


def _stored(name: str, value: Any) -> Any:
    """A settlement value as the ledger column takes it (JSON columns as text)."""
    if name in _JSON_COLUMNS and value is not None:
        return json.dumps(value)
    return value
