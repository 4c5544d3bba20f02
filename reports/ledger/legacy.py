"""One-time move of the state earlier versions kept inside the DuckDB file into the state store.

Versions before the state store kept stored keys (``virtual_keys``), alert claims
(``budget_alerts``) and deliveries (``alert_deliveries``) in the DuckDB ledger itself, where a
reader of the file blocked every write. On first use of the state store beside such a ledger,
those rows are copied over once (claims keep their status, so no alert is sent twice); the old
tables stay, unused.
"""

from __future__ import annotations

import datetime as dt
import json

import duckdb

from tokenward.reports.ledger.imported import Imported
from tokenward.reports.ledger.state import AlertKey, DeliveryRecord, SqliteState

__all__ = ["Imported", "import_legacy_state"]

_DONE = "imported_duckdb_state"


def import_legacy_state(conn: duckdb.DuckDBPyConnection, state: SqliteState) -> Imported:
    """Copy keys, alert claims and deliveries from the DuckDB ledger behind ``conn`` into ``state`` once.

    Returns:
        What was copied, by kind (all 0 when done before, or when there was nothing). A key the
        state store already has under its name is not copied (nor counted); a delivery to several
        mail addresses, which earlier versions kept as one row, counts once per address.
    """
    if state.meta(_DONE):
        return Imported()
    tables = {r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    keys = claims = deliveries = 0
    if "virtual_keys" in tables:
        for name, sha, team, project, created, revoked in conn.execute(
            "SELECT name, key_sha256, team, project, created_at, revoked_at FROM virtual_keys"
        ).fetchall():
            try:
                state.create_key(name, sha, team=team, project=project, role="user", now=created)
            except ValueError:
                continue
            if revoked is not None:
                state.revoke(name, None, revoked)
            keys += 1
    if "budget_alerts" in tables:
        for budget, start, kind, threshold, created, status, detail in conn.execute(
            "SELECT budget, period_start, kind, threshold, created_at, status, detail FROM budget_alerts"
        ).fetchall():
            key = AlertKey(budget, start, kind, int(threshold))
            info = json.loads(detail) if isinstance(detail, str) else (detail or {})
            if state.claim([key], info, created):
                if status != "pending":
                    state.set_status(key, status)
                claims += 1
    if "alert_deliveries" in tables:
        for budget, start, kind, threshold, channel, target, at, ok, attempts, error in conn.execute(
            "SELECT budget, period_start, kind, threshold, channel, target, attempted_at, ok, attempts, error "
            "FROM alert_deliveries"
        ).fetchall():
            for one in str(target).split(","):  # earlier versions joined a mail's addresses
                state.record_delivery(
                    DeliveryRecord(AlertKey(budget, start, kind, int(threshold)), channel, one, ok, attempts, error, at)
                )
                deliveries += 1
    state.set_meta(_DONE, dt.datetime.now(dt.UTC).isoformat())
    return Imported(keys, claims, deliveries)
