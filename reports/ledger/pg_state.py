"""Control-plane state in the Postgres ledger: the :class:`StateStore` every replica shares.

The tables of :class:`~tokenward.reports.ledger.state.SqliteState` (made by
:func:`~tokenward.reports.ledger.pg_migrations.m002_state`), so a claim is unique per (budget,
period start, kind, threshold) across every replica and the CLI: the ``INSERT ... ON CONFLICT
DO NOTHING`` that inserts the row is the one claim that wins. Keys created or revoked anywhere
are seen by each proxy's key reload (every 5 s).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg

from tokenward.reports.ledger.errors import LedgerError
from tokenward.reports.ledger.pg_pool import SyncPool
from tokenward.reports.ledger.state import AlertKey, ClaimRecord, DeliveryRecord, StoredKey, claims_filter

__all__ = ["PgState"]


class PgState:
    """:class:`~tokenward.reports.ledger.state.StateStore` in Postgres.

    Args:
        pool: connections to the ledger's database (migrated).
    """

    def __init__(self, pool: SyncPool) -> None:
        self._pool = pool

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection; the server going away (or a connection it dropped) raises :class:`LedgerError`.

        Callers that must not lose what they write (an alert's delivery record) try again on
        :class:`LedgerError`; other ``psycopg`` errors (a unique key, a bad value) are not retried.
        """
        try:
            with self._pool.connection() as conn:
                yield conn
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            raise LedgerError(f"the state store is unavailable: {exc}") from exc

    def _run(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._connection() as conn:
            cursor = conn.execute(sql, params)
            return cursor.fetchall() if cursor.description else []

    # -- alerts ------------------------------------------------------------------------------

    def claim(self, keys: Sequence[AlertKey], detail: dict[str, Any], now: dt.datetime) -> list[AlertKey]:
        """See :meth:`StateStore.claim`."""
        won = []
        with self._connection() as conn, conn.transaction():
            for key in keys:
                cursor = conn.execute(
                    "INSERT INTO alert_claims (budget, period_start, kind, threshold, created_at, status, detail) "
                    "VALUES (%s, %s, %s, %s, %s, 'pending', %s) ON CONFLICT DO NOTHING",
                    [key.budget, key.period_start, key.kind, key.threshold, now, json.dumps(detail)],
                )
                if cursor.rowcount:
                    won.append(key)
        return won

    def claimed(self, budget: str, period_start: dt.datetime) -> set[tuple[str, int]]:
        """See :meth:`StateStore.claimed`."""
        rows = self._run(
            "SELECT kind, threshold FROM alert_claims WHERE budget = %s AND period_start = %s", [budget, period_start]
        )
        return {(kind, int(threshold)) for kind, threshold in rows}

    def claims(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        budget: str | None = None,
        starting: tuple[dt.datetime, dt.datetime] | None = None,
    ) -> list[ClaimRecord]:
        """See :meth:`StateStore.claims`."""
        where, params = claims_filter("%s", status=status, kind=kind, budget=budget, starting=starting)
        rows = self._run(
            "SELECT budget, period_start, kind, threshold, status, detail, attempts, created_at, last_error "
            f"FROM alert_claims{where} ORDER BY claim_no",
            params,
        )
        return [
            ClaimRecord(
                AlertKey(budget, start, kind, int(threshold)), status, detail or {}, int(attempts), created, error
            )
            for budget, start, kind, threshold, status, detail, attempts, created, error in rows
        ]

    def set_status(self, key: AlertKey, status: str, error: str | None = None) -> None:
        """See :meth:`StateStore.set_status`."""
        self._run(
            "UPDATE alert_claims SET status = %s, attempts = attempts + 1, last_error = %s, lease_holder = NULL, "
            "lease_until = NULL WHERE budget = %s AND period_start = %s AND kind = %s AND threshold = %s",
            [status, error, key.budget, key.period_start, key.kind, key.threshold],
        )

    def lease(self, keys: Sequence[AlertKey], holder: str, for_s: float) -> list[AlertKey]:
        """See :meth:`StateStore.lease`: the database server's clock decides, never a replica's own.

        ``lease_until`` (epoch seconds) is ``clock_timestamp()`` plus ``for_s``, and a lease has
        run out when ``clock_timestamp()`` has passed it: two replicas whose clocks are minutes
        apart still see one lease holder at a time.
        """
        won = []
        with self._connection() as conn, conn.transaction():
            for key in keys:
                cursor = conn.execute(
                    "UPDATE alert_claims SET lease_holder = %s, lease_until = extract(epoch FROM clock_timestamp()) "
                    "+ %s WHERE budget = %s AND period_start = %s AND kind = %s AND threshold = %s "
                    "AND status = 'pending' AND (lease_holder IS NULL OR lease_holder = %s "
                    "OR lease_until <= extract(epoch FROM clock_timestamp()))",
                    [holder, for_s, key.budget, key.period_start, key.kind, key.threshold, holder],
                )
                if cursor.rowcount:
                    won.append(key)
        return won

    def rearm(
        self, budget: str, period_start: dt.datetime, crossed: Sequence[int], refused: bool, *, limit: str | None = None
    ) -> None:
        """See :meth:`StateStore.rearm`."""
        stale = (
            "budget = %s AND period_start = %s AND status <> 'pending' AND "
            "((kind = 'threshold' AND NOT (threshold = ANY (%s))) OR (kind = 'refusing' AND NOT %s))"
        )
        params: list[Any] = [budget, period_start, list(crossed), refused]
        if limit is not None:
            stale += " AND kind = 'threshold' AND (detail -> 'payload' ->> 'limit_usd') IS DISTINCT FROM %s"
            params.append(limit)
        with self._connection() as conn, conn.transaction():  # the next crossing has reached no one yet
            conn.execute(
                "DELETE FROM alert_deliveries WHERE (budget, period_start, kind, threshold) IN "
                f"(SELECT budget, period_start, kind, threshold FROM alert_claims WHERE {stale})",
                params,
            )
            conn.execute(f"DELETE FROM alert_claims WHERE {stale}", params)

    def record_delivery(self, record: DeliveryRecord) -> None:
        """See :meth:`StateStore.record_delivery`."""
        key = record.key
        self._run(
            "INSERT INTO alert_deliveries VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            [
                key.budget,
                key.period_start,
                key.kind,
                key.threshold,
                record.channel,
                record.target,
                record.attempted_at,
                record.ok,
                record.attempts,
                record.error,
            ],
        )

    def delivered(self, key: AlertKey) -> set[str]:
        """See :meth:`StateStore.delivered`."""
        return {d.target for d in self.deliveries(key) if d.ok}

    def deliveries(self, key: AlertKey) -> list[DeliveryRecord]:
        """See :meth:`StateStore.deliveries`."""
        rows = self._run(
            "SELECT channel, target, ok, attempts, error, attempted_at FROM alert_deliveries "
            "WHERE budget = %s AND period_start = %s AND kind = %s AND threshold = %s ORDER BY attempted_at",
            [key.budget, key.period_start, key.kind, key.threshold],
        )
        return [
            DeliveryRecord(key, channel, target, bool(ok), int(attempts), error, at)
            for channel, target, ok, attempts, error, at in rows
        ]

    # -- keys --------------------------------------------------------------------------------

    def create_key(
        self, name: str, key_sha256: str, *, team: str | None, project: str | None, role: str, now: dt.datetime,
        expires_at: dt.datetime | None = None,
    ) -> None:
        """See :meth:`StateStore.create_key`."""
        try:
            self._run(
                "INSERT INTO virtual_keys (name, key_sha256, team, project, role, created_at, expires_at) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                [name, key_sha256, team, project, role, now, expires_at],
            )
        except psycopg.errors.UniqueViolation:
            found = self._run("SELECT revoked_at FROM virtual_keys WHERE name = %s", [name])
            if not found:
                raise ValueError("that key is stored already under another name") from None
            state = "was revoked (names are not reused, so old usage stays attributable)" if found[0][0] else "exists"
            raise ValueError(f"a key named {name!r} {state}; choose another name") from None

    def revoke(self, name: str, key_sha256: str | None, now: dt.datetime) -> bool:
        """See :meth:`StateStore.revoke`."""
        with self._connection() as conn:
            if key_sha256 is not None:
                cursor = conn.execute(
                    "INSERT INTO revoked_keys VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                    [key_sha256.lower(), name, now],
                )
            else:
                cursor = conn.execute(
                    "UPDATE virtual_keys SET revoked_at = %s WHERE name = %s AND revoked_at IS NULL", [now, name]
                )
            return cursor.rowcount > 0

    def keys(self) -> list[StoredKey]:
        """See :meth:`StateStore.keys`."""
        rows = self._run(
            "SELECT name, key_sha256, team, project, role, created_at, revoked_at, expires_at FROM virtual_keys "
            "ORDER BY created_at, name"
        )
        return [StoredKey(*row) for row in rows]

    def revoked_hashes(self) -> set[str]:
        """See :meth:`StateStore.revoked_hashes`."""
        rows = self._run(
            "SELECT key_sha256 FROM revoked_keys UNION SELECT key_sha256 FROM virtual_keys WHERE revoked_at IS NOT NULL"
        )
        return {sha.lower() for (sha,) in rows}

    def config_revocations(self) -> dict[str, tuple[str | None, dt.datetime]]:
        """See :meth:`StateStore.config_revocations`."""
        rows = self._run("SELECT key_sha256, name, revoked_at FROM revoked_keys")
        return {sha.lower(): (name, at) for sha, name, at in rows}

    # -- provider objects --------------------------------------------------------------------

    def record_objects(self, objects: Iterable[tuple[str, str, str, dt.datetime]], *, fsync: bool = True) -> None:
        """See :meth:`StateStore.record_objects` (``fsync`` is ignored: a commit is on the server's disk)."""
        rows = list(objects)
        if not rows:
            return
        with self._connection() as conn, conn.cursor() as cursor:
            cursor.executemany("INSERT INTO objects VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING", rows)

    def owners(self, object_ids: Sequence[str]) -> dict[str, str]:
        """See :meth:`StateStore.owners`."""
        if not object_ids:
            return {}
        rows = self._run("SELECT object_id, key_id FROM objects WHERE object_id = ANY (%s)", [list(object_ids)])
        return dict(rows)

    def owned(self, key_id: str, kind: str | None = None) -> set[str]:
        """See :meth:`StateStore.owned`."""
        if kind is None:
            rows = self._run("SELECT object_id FROM objects WHERE key_id = %s", [key_id])
        else:
            rows = self._run("SELECT object_id FROM objects WHERE key_id = %s AND kind = %s", [key_id, kind])
        return {object_id for (object_id,) in rows}

    def recent_objects(self, limit: int) -> list[tuple[str, str, str]]:
        """See :meth:`StateStore.recent_objects` (ties in ``created_at`` newest recorded first)."""
        rows = self._run(
            "SELECT object_id, kind, key_id FROM objects ORDER BY created_at DESC, seq DESC LIMIT %s", [limit]
        )
        return [(object_id, kind, key_id) for object_id, kind, key_id in rows]
