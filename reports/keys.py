"""Virtual keys stored in the ledger (``tokenward keys create/list/revoke``).

A key is shown once, when created; only its sha256 is stored. The proxy reloads stored keys
every 30 seconds, so a created key works and a revoked one stops working without a restart.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets

import duckdb

__all__ = ["create_key", "list_keys", "revoke_key", "stored_keys"]


def create_key(
    conn: duckdb.DuckDBPyConnection, name: str, *, team: str | None, project: str | None, now: dt.datetime
) -> str:
    """Create a key named ``name`` and return it (the only time it is visible).

    Raises:
        ValueError: an empty name, or a key (live or revoked) already has that name.
    """
    if not name.strip():
        raise ValueError("a key needs a name")
    found = conn.execute("SELECT revoked_at FROM virtual_keys WHERE name = ?", [name]).fetchone()
    if found:
        state = "was revoked (names are not reused, so old usage stays attributable)" if found[0] else "exists"
        raise ValueError(f"a key named {name!r} {state}; choose another name")
    key = "tw-" + secrets.token_urlsafe(32)
    conn.execute(
        "INSERT INTO virtual_keys VALUES (?, ?, ?, ?, ?, NULL)",
        [name, hashlib.sha256(key.encode()).hexdigest(), team, project, now],
    )
    return key


def revoke_key(conn: duckdb.DuckDBPyConnection, name: str, *, now: dt.datetime) -> bool:
    """Revoke the key ``name``; false if there is no live key by that name."""
    row = conn.execute(
        "UPDATE virtual_keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL RETURNING name", [now, name]
    ).fetchone()
    return row is not None


def list_keys(
    conn: duckdb.DuckDBPyConnection,
) -> list[tuple[str, str | None, str | None, dt.datetime, dt.datetime | None]]:
    """Every stored key: ``(name, team, project, created_at, revoked_at)``, oldest first."""
    return conn.execute(
        "SELECT name, team, project, created_at, revoked_at FROM virtual_keys ORDER BY created_at"
    ).fetchall()


def stored_keys(conn: duckdb.DuckDBPyConnection) -> list[tuple[str, str, str | None, str | None]]:
    """Live stored keys as ``(name, key_sha256, team, project)`` (what the proxy accepts)."""
    return conn.execute("SELECT name, key_sha256, team, project FROM virtual_keys WHERE revoked_at IS NULL").fetchall()
