"""Background responses on a Postgres ledger: :mod:`~tokenward.reports.ledger.deferred` in Postgres.

The same three steps (note, settle once, apply to the row) in the ledger's database, so that every
replica sees one claim: the settlement is one conditional ``UPDATE`` of ``deferred_responses``
(migration ``m017``), and the move of a replica's log into ``requests`` applies the settlements
whose rows are there, each changed row taking a new ``seq`` (the report copies follow it).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import msgspec

from tokenward.reports.ledger.deferred import SETTLED_COLUMNS
from tokenward.reports.ledger.pg_migrations import INGEST_LOCK
from tokenward.reports.ledger.pg_state import PgState

__all__ = ["apply", "deferred", "record", "settle"]

_encode = msgspec.json.Encoder(decimal_format="string").encode
_JSON_COLUMNS = frozenset({"cost_lines", "raw_usage"})


def record(state: PgState, response_id: str, request_id: str, detail: dict[str, Any]) -> None:
    """See :func:`tokenward.reports.ledger.deferred.record`."""
    state._run(
        "INSERT INTO deferred_responses (response_id, request_id, detail) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
        [response_id, request_id, _encode(detail).decode()],
    )


def deferred(state: PgState, response_id: str) -> tuple[str, dict[str, Any]] | None:
    """See :func:`tokenward.reports.ledger.deferred.deferred`."""
    rows = state._run(
        "SELECT request_id, detail::text FROM deferred_responses WHERE response_id = %s AND settled_at IS NULL",
        [response_id],
    )
    return (rows[0][0], json.loads(rows[0][1])) if rows else None


def settle(state: PgState, response_id: str, settlement: dict[str, Any], now: dt.datetime) -> bool:
    """See :func:`tokenward.reports.ledger.deferred.settle`: one winner across every replica."""
    with state._connection() as conn:
        changed = conn.execute(
            "UPDATE deferred_responses SET settlement = %s, settled_at = %s "
            "WHERE response_id = %s AND settled_at IS NULL",
            [_encode(settlement).decode(), now, response_id],
        ).rowcount
    return bool(changed)


def apply(conn: Any) -> int:
    """Put settled responses' usage and cost into their ``deferred`` rows (under the ingest lock); rows changed."""
    changed = 0
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", [INGEST_LOCK])
        due = conn.execute(
            "SELECT response_id, request_id, settlement::text FROM deferred_responses "
            "WHERE settlement IS NOT NULL AND NOT applied ORDER BY settled_at"
        ).fetchall()
        done = []
        for response_id, request_id, text in due:
            settlement = json.loads(text)
            columns = [name for name in SETTLED_COLUMNS if name in settlement]
            values = [
                json.dumps(settlement[name]) if name in _JSON_COLUMNS and settlement[name] is not None
                else settlement[name]
                for name in columns
            ]
            assignments = ", ".join(f"{name} = %s" for name in columns)
            changed += conn.execute(
                f"UPDATE requests SET {assignments}, seq = nextval('requests_seq') "
                "WHERE request_id = %s AND price_status = 'deferred'",
                [*values, request_id],
            ).rowcount
            if conn.execute("SELECT 1 FROM requests WHERE request_id = %s", [request_id]).fetchone():
                done.append(response_id)
        if done:
            conn.execute("UPDATE deferred_responses SET applied = true WHERE response_id = ANY (%s)", [done])
    return changed
