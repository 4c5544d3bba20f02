"""Control-plane state: alert claims and deliveries, stored keys and revocations, object owners.

Design note. These writes must happen the moment something happens (an alert reached its
target, a key was revoked) and must never wait for a reader: with DuckDB, any process reading
the ledger file blocks every writer. So, beside a DuckDB ledger, this state lives in a SQLite
file (``<ledger>.state.sqlite``, WAL journal mode): readers never block writers there, several
processes may write (each write is a short transaction), and a unique key makes a claim atomic
across processes. A Postgres ledger keeps the same tables in Postgres
(:mod:`tokenward.reports.ledger.postgres`); both implement :class:`StateStore`.

Alerts are identified by :class:`AlertKey` (budget, period start, kind, threshold): exactly one
claim per key ever succeeds, and a delivery is recorded per key and target, so a message naming
several thresholds is retried only for the thresholds and targets it has not reached.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

__all__ = [
    "AlertKey",
    "ClaimRecord",
    "DeliveryRecord",
    "SqliteState",
    "StateStore",
    "StoredKey",
    "claims_filter",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AlertKey:
    """One alert's identity: budget (or another subject, ``unpriced:...``), period start (UTC), kind, threshold."""

    budget: str
    period_start: dt.datetime
    kind: str
    threshold: int


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    """A claimed alert: its key, status (``pending``, ``sent``, ``failed``), stored message, attempts."""

    key: AlertKey
    status: str
    detail: dict[str, Any]
    attempts: int
    created_at: dt.datetime
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class DeliveryRecord:
    """One delivery attempt of one alert key to one target."""

    key: AlertKey
    channel: str
    target: str
    ok: bool
    attempts: int
    error: str | None
    attempted_at: dt.datetime


@dataclass(frozen=True, slots=True)
class StoredKey:
    """A key created with ``tokenward keys create`` (its sha256 only) and its state."""

    name: str
    key_sha256: str
    team: str | None
    project: str | None
    role: str
    created_at: dt.datetime
    revoked_at: dt.datetime | None
    expires_at: dt.datetime | None = None
    """When the key stops working (UTC; ``None``: never); a proxy refuses it from then on with 401 ``key_expired``."""


def claims_filter(
    mark: str, *, status: str | None, kind: str | None, budget: str | None, starting: tuple[Any, Any] | None
) -> tuple[str, list[Any]]:
    """The ``WHERE`` clause (``""`` for none) and its parameters of :meth:`StateStore.claims`, either engine.

    ``mark`` is the driver's placeholder (``?`` for sqlite3, ``%s`` for psycopg); ``starting``
    is ``(since, until)`` already in the engine's form of a time.
    """
    clauses: list[str] = []
    params: list[Any] = []
    for clause, values in (
        ("budget = {m}", [budget] if budget is not None else None),
        ("period_start >= {m} AND period_start < {m}", list(starting) if starting is not None else None),
        ("status = {m}", [status] if status is not None else None),
        ("kind = {m}", [kind] if kind is not None else None),
    ):
        if values is not None:
            clauses.append(clause.format(m=mark))
            params += values
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


class StateStore(Protocol):
    """What every engine keeps besides the ``requests`` table (one implementation per engine)."""

    def claim(self, keys: Sequence[AlertKey], detail: dict[str, Any], now: dt.datetime) -> list[AlertKey]:
        """Claim each key not claimed before; returns those this call claimed (status ``pending``)."""
        ...

    def claimed(self, budget: str, period_start: dt.datetime) -> set[tuple[str, int]]:
        """``(kind, threshold)`` of every claim for ``budget`` in the period starting at ``period_start``."""
        ...

    def claims(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        budget: str | None = None,
        starting: tuple[dt.datetime, dt.datetime] | None = None,
    ) -> list[ClaimRecord]:
        """Claims, oldest first, optionally only those with ``status`` / of ``kind`` / of ``budget``.

        ``starting``: only claims whose period starts in ``[since, until)``.
        """
        ...

    def set_status(self, key: AlertKey, status: str, error: str | None = None) -> None:
        """Mark a claim ``sent``, ``pending`` (to be retried) or ``failed``, counting one attempt; ends its lease."""
        ...

    def lease(self, keys: Sequence[AlertKey], holder: str, for_s: float) -> list[AlertKey]:
        """Lease pending claims to ``holder`` for ``for_s`` seconds from now; returns the keys leased.

        A claim is leased if it is ``pending`` and not leased to another holder beyond now;
        ``holder`` may renew its own lease. Whoever holds the lease is the one process delivering
        the claim; a holder that dies leaves it to whoever evaluates once the lease has run out.
        "Now" is the store's clock, not the caller's (Postgres: the database server's
        ``clock_timestamp()``), so replicas whose clocks disagree still agree on who holds a lease.
        """
        ...

    def rearm(
        self, budget: str, period_start: dt.datetime, crossed: Sequence[int], refused: bool, *, limit: str | None = None
    ) -> None:
        """Forget a rolling budget's sent claims that no longer hold (thresholds not in ``crossed``), deliveries too.

        With ``limit`` (a budget whose limit may have been edited): only threshold claims made
        at another limit (their stored ``payload.limit_usd``) are forgotten.
        """
        ...

    def record_delivery(self, record: DeliveryRecord) -> None:
        """Store one delivery attempt (durably, at once)."""
        ...

    def delivered(self, key: AlertKey) -> set[str]:
        """Targets that ``key``'s alert reached."""
        ...

    def deliveries(self, key: AlertKey) -> list[DeliveryRecord]:
        """Every delivery attempt of ``key``, oldest first."""
        ...

    def create_key(
        self, name: str, key_sha256: str, *, team: str | None, project: str | None, role: str, now: dt.datetime,
        expires_at: dt.datetime | None = None,
    ) -> None:
        """Store a new key (``expires_at``: when it stops working). Raises ``ValueError`` when the name is taken."""
        ...

    def revoke(self, name: str, key_sha256: str | None, now: dt.datetime) -> bool:
        """Revoke the stored key ``name``, or (``key_sha256`` given) a config key; false if nothing changed."""
        ...

    def keys(self) -> list[StoredKey]:
        """Every stored key, oldest first."""
        ...

    def revoked_hashes(self) -> set[str]:
        """sha256 of every revoked key (stored and config keys)."""
        ...

    def config_revocations(self) -> dict[str, tuple[str | None, dt.datetime]]:
        """Config keys revoked (``tokenward keys revoke NAME --config``): sha256 -> (name then, when)."""
        ...

    def record_objects(self, objects: Iterable[tuple[str, str, str, dt.datetime]], *, fsync: bool = True) -> None:
        """Store ``(object_id, kind, key_id, created_at)`` owners (first owner wins), durably once it returns.

        ``fsync=False`` may make the record survive a crash of the process but not of the machine
        (an engine that always syncs ignores it).
        """
        ...

    def owners(self, object_ids: Sequence[str]) -> dict[str, str]:
        """``object_id -> key_id`` for the ids that have a recorded owner."""
        ...

    def recent_objects(self, limit: int) -> list[tuple[str, str, str]]:
        """The ``limit`` most recently created ``(object_id, kind, key_id)`` owners, newest first."""
        ...

    def owned(self, key_id: str, kind: str | None = None) -> set[str]:
        """Object ids created through tokenward by ``key_id`` (of ``kind``)."""
        ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS alert_claims (
    budget TEXT NOT NULL, period_start TEXT NOT NULL, kind TEXT NOT NULL, threshold INTEGER NOT NULL,
    created_at TEXT NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT, detail TEXT, lease_holder TEXT, lease_until REAL,
    PRIMARY KEY (budget, period_start, kind, threshold)
);
CREATE TABLE IF NOT EXISTS alert_deliveries (
    budget TEXT NOT NULL, period_start TEXT NOT NULL, kind TEXT NOT NULL, threshold INTEGER NOT NULL,
    channel TEXT NOT NULL, target TEXT NOT NULL, attempted_at TEXT NOT NULL, ok INTEGER NOT NULL,
    attempts INTEGER NOT NULL, error TEXT
);
CREATE INDEX IF NOT EXISTS alert_deliveries_key ON alert_deliveries (budget, period_start, kind, threshold);
CREATE TABLE IF NOT EXISTS virtual_keys (
    name TEXT PRIMARY KEY, key_sha256 TEXT NOT NULL UNIQUE, team TEXT, project TEXT,
    role TEXT NOT NULL DEFAULT 'user', created_at TEXT NOT NULL, revoked_at TEXT
);
CREATE TABLE IF NOT EXISTS revoked_keys (key_sha256 TEXT PRIMARY KEY, name TEXT, revoked_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS objects (
    object_id TEXT PRIMARY KEY, kind TEXT NOT NULL, key_id TEXT NOT NULL, created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS objects_by_key ON objects (key_id, kind);
"""


def _add_leases(conn: sqlite3.Connection) -> None:
    """Give an older state file the lease columns and ``virtual_keys.expires_at`` (once; processes may race)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(alert_claims)")}
    added = [("alert_claims", c, k) for c, k in (("lease_holder", "TEXT"), ("lease_until", "REAL")) if c not in columns]
    if "expires_at" not in {row[1] for row in conn.execute("PRAGMA table_info(virtual_keys)")}:
        added.append(("virtual_keys", "expires_at", "TEXT"))  # keys that stop working (keys create --expires)
    for table, column, kind in added:
        try:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        except sqlite3.OperationalError as exc:
            if "duplicate column" not in str(exc):
                raise


def _iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).isoformat()


def _moment(text: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(text) if text else None


def _when(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


class SqliteState:
    """:class:`StateStore` in a SQLite file (beside a DuckDB ledger).

    Each call opens a short connection (``busy_timeout`` 10 s), so the store can be used from any
    thread and any number of processes. Object owners, written and read on the request path,
    go through one connection kept open instead (shared by threads under a lock): closing the
    last connection to a WAL file checkpoints it, which costs a few milliseconds per call.

    Args:
        path: the SQLite file (created with its tables on first use).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._ready = False
        self._kept: sqlite3.Connection | None = None
        self._kept_lock = threading.Lock()
        self._kept_synchronous = "FULL"

    def _connect(self, *, shared: bool = False) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=not shared)
        if not self._ready:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)
            _add_leases(conn)
            self._ready = True
        return conn

    def _run(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        conn = self._connect()
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()

    def close(self) -> None:
        """Close the connection kept for object owners (the next call opens it again)."""
        with self._kept_lock:
            if self._kept is not None:
                self._kept.close()
                self._kept = None

    def _objects(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work`` on the kept connection (opened on first use), one thread at a time."""
        with self._kept_lock:
            if self._kept is None:
                self._kept = self._connect(shared=True)
                self._kept_synchronous = "FULL"
            return work(self._kept)

    def initialized(self) -> bool:
        """Whether the file exists already (before this process touched it)."""
        return self.path.exists()

    def meta(self, name: str) -> str | None:
        """A value stored under ``name`` in the ``meta`` table (``None`` if absent)."""
        rows = self._run("SELECT value FROM meta WHERE name = ?", [name])
        return rows[0][0] if rows else None

    def set_meta(self, name: str, value: str) -> None:
        """Store ``value`` under ``name`` in the ``meta`` table."""
        self._run("INSERT OR REPLACE INTO meta VALUES (?, ?)", [name, value])

    # -- alerts ------------------------------------------------------------------------------

    def claim(self, keys: Sequence[AlertKey], detail: dict[str, Any], now: dt.datetime) -> list[AlertKey]:
        """See :meth:`StateStore.claim`."""
        return self._each_once(
            "INSERT OR IGNORE INTO alert_claims (budget, period_start, kind, threshold, created_at, status, "
            "detail) VALUES (?, ?, ?, ?, ?, 'pending', ?)",
            keys,
            lambda key: [key.budget, _iso(key.period_start), key.kind, key.threshold, _iso(now), json.dumps(detail)],
        )

    def _each_once(
        self, sql: str, keys: Sequence[AlertKey], params: Callable[[AlertKey], list[Any]]
    ) -> list[AlertKey]:
        """Run ``sql`` once per key in one ``BEGIN IMMEDIATE`` transaction; the keys whose statement changed a row."""
        with self._immediate() as conn:
            return [key for key in keys if conn.execute(sql, params(key)).rowcount]

    @contextmanager
    def _immediate(self) -> Iterator[sqlite3.Connection]:
        """A connection in a ``BEGIN IMMEDIATE`` transaction: committed at the block's end, rolled back if it raises."""
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        finally:
            conn.close()

    def claimed(self, budget: str, period_start: dt.datetime) -> set[tuple[str, int]]:
        """See :meth:`StateStore.claimed`."""
        rows = self._run(
            "SELECT kind, threshold FROM alert_claims WHERE budget = ? AND period_start = ?",
            [budget, _iso(period_start)],
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
        window = (_iso(starting[0]), _iso(starting[1])) if starting is not None else None
        where, params = claims_filter("?", status=status, kind=kind, budget=budget, starting=window)
        rows = self._run(
            "SELECT budget, period_start, kind, threshold, status, detail, attempts, created_at, last_error "
            f"FROM alert_claims{where} ORDER BY rowid",
            params,
        )
        return [
            ClaimRecord(
                AlertKey(budget, _when(start), kind, int(threshold)),
                status,
                json.loads(detail) if detail else {},
                int(attempts),
                _when(created),
                error,
            )
            for budget, start, kind, threshold, status, detail, attempts, created, error in rows
        ]

    def set_status(self, key: AlertKey, status: str, error: str | None = None) -> None:
        """See :meth:`StateStore.set_status`."""
        self._run(
            "UPDATE alert_claims SET status = ?, attempts = attempts + 1, last_error = ?, lease_holder = NULL, "
            "lease_until = NULL WHERE budget = ? AND period_start = ? AND kind = ? AND threshold = ?",
            [status, error, key.budget, _iso(key.period_start), key.kind, key.threshold],
        )

    def lease(self, keys: Sequence[AlertKey], holder: str, for_s: float) -> list[AlertKey]:
        """See :meth:`StateStore.lease` (the clock of the one host the SQLite file lives on)."""
        now = time.time()
        until = now + for_s
        return self._each_once(
            "UPDATE alert_claims SET lease_holder = ?, lease_until = ? WHERE budget = ? AND period_start = ? "
            "AND kind = ? AND threshold = ? AND status = 'pending' "
            "AND (lease_holder IS NULL OR lease_holder = ? OR lease_until <= ?)",
            keys,
            lambda key: [holder, until, key.budget, _iso(key.period_start), key.kind, key.threshold, holder, now],
        )

    def rearm(
        self, budget: str, period_start: dt.datetime, crossed: Sequence[int], refused: bool, *, limit: str | None = None
    ) -> None:
        """See :meth:`StateStore.rearm`."""
        fallen = f"threshold NOT IN ({','.join('?' * len(crossed))})" if crossed else "TRUE"
        stale = (
            "budget = ? AND period_start = ? AND status <> 'pending' AND "
            f"((kind = 'threshold' AND {fallen}) OR (kind = 'refusing' AND NOT ?))"
        )
        params = [budget, _iso(period_start), *crossed, int(refused)]
        if limit is not None:
            stale += " AND kind = 'threshold' AND json_extract(detail, '$.payload.limit_usd') IS NOT ?"
            params.append(limit)
        with self._immediate() as conn:  # the deliveries go too: the next crossing has reached no one yet
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
            "INSERT INTO alert_deliveries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                key.budget,
                _iso(key.period_start),
                key.kind,
                key.threshold,
                record.channel,
                record.target,
                _iso(record.attempted_at),
                int(record.ok),
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
            "WHERE budget = ? AND period_start = ? AND kind = ? AND threshold = ? ORDER BY attempted_at",
            [key.budget, _iso(key.period_start), key.kind, key.threshold],
        )
        return [
            DeliveryRecord(key, channel, target, bool(ok), int(attempts), error, _when(at))
            for channel, target, ok, attempts, error, at in rows
        ]

    # -- keys --------------------------------------------------------------------------------

    def create_key(
        self, name: str, key_sha256: str, *, team: str | None, project: str | None, role: str, now: dt.datetime,
        expires_at: dt.datetime | None = None,
    ) -> None:
        """See :meth:`StateStore.create_key`."""
        found = self._run("SELECT revoked_at FROM virtual_keys WHERE name = ?", [name])
        if found:
            state = "was revoked (names are not reused, so old usage stays attributable)" if found[0][0] else "exists"
            raise ValueError(f"a key named {name!r} {state}; choose another name")
        self._run(
            "INSERT INTO virtual_keys (name, key_sha256, team, project, role, created_at, expires_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [name, key_sha256, team, project, role, _iso(now), _iso(expires_at) if expires_at else None],
        )

    def revoke(self, name: str, key_sha256: str | None, now: dt.datetime) -> bool:
        """See :meth:`StateStore.revoke`."""
        conn = self._connect()
        try:
            if key_sha256 is not None:
                cursor = conn.execute(
                    "INSERT OR IGNORE INTO revoked_keys VALUES (?, ?, ?)", [key_sha256.lower(), name, _iso(now)]
                )
            else:
                cursor = conn.execute(
                    "UPDATE virtual_keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL", [_iso(now), name]
                )
            return cursor.rowcount > 0
        finally:
            conn.close()

    def keys(self) -> list[StoredKey]:
        """See :meth:`StateStore.keys`."""
        rows = self._run(
            "SELECT name, key_sha256, team, project, role, created_at, revoked_at, expires_at FROM virtual_keys "
            "ORDER BY created_at, name"
        )
        return [
            StoredKey(name, sha, team, project, role, _when(created), _moment(revoked), _moment(expires))
            for name, sha, team, project, role, created, revoked, expires in rows
        ]

    def revoked_hashes(self) -> set[str]:
        """See :meth:`StateStore.revoked_hashes`."""
        rows = self._run(
            "SELECT key_sha256 FROM revoked_keys UNION SELECT key_sha256 FROM virtual_keys WHERE revoked_at IS NOT NULL"
        )
        return {sha.lower() for (sha,) in rows}

    def config_revocations(self) -> dict[str, tuple[str | None, dt.datetime]]:
        """See :meth:`StateStore.config_revocations`."""
        rows = self._run("SELECT key_sha256, name, revoked_at FROM revoked_keys")
        return {sha.lower(): (name, _when(at)) for sha, name, at in rows}

    # -- provider objects --------------------------------------------------------------------

    def record_objects(self, objects: Iterable[tuple[str, str, str, dt.datetime]], *, fsync: bool = True) -> None:
        """See :meth:`StateStore.record_objects` (``fsync=False``: SQLite's ``synchronous=NORMAL``).

        In WAL mode a commit under ``NORMAL`` is in the file when this returns (it survives the
        process) and reaches the disk at the next checkpoint.
        """
        rows = [(object_id, kind, key_id, _iso(at)) for object_id, kind, key_id, at in objects]
        if not rows:
            return

        def insert(conn: sqlite3.Connection) -> None:
            synchronous = "FULL" if fsync else "NORMAL"
            if self._kept_synchronous != synchronous:
                conn.execute(f"PRAGMA synchronous={synchronous}")
                self._kept_synchronous = synchronous
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany("INSERT OR IGNORE INTO objects VALUES (?, ?, ?, ?)", rows)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

        self._objects(insert)

    def owners(self, object_ids: Sequence[str]) -> dict[str, str]:
        """See :meth:`StateStore.owners`."""
        ids = list(object_ids)

        def select(conn: sqlite3.Connection) -> dict[str, str]:
            found: dict[str, str] = {}
            for start in range(0, len(ids), 500):  # below any SQLite's limit on bound parameters
                chunk = ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                sql = f"SELECT object_id, key_id FROM objects WHERE object_id IN ({marks})"
                found.update(conn.execute(sql, chunk).fetchall())
            return found

        return self._objects(select) if ids else {}

    def owned(self, key_id: str, kind: str | None = None) -> set[str]:
        """See :meth:`StateStore.owned`."""
        if kind is None:
            rows = self._run("SELECT object_id FROM objects WHERE key_id = ?", [key_id])
        else:
            rows = self._run("SELECT object_id FROM objects WHERE key_id = ? AND kind = ?", [key_id, kind])
        return {object_id for (object_id,) in rows}

    def recent_objects(self, limit: int) -> list[tuple[str, str, str]]:
        """See :meth:`StateStore.recent_objects`."""
        rows = self._run(
            "SELECT object_id, kind, key_id FROM objects ORDER BY created_at DESC, rowid DESC LIMIT ?", [limit]
        )
        return [(object_id, kind, key_id) for object_id, kind, key_id in rows]
