"""The Postgres engine: one ledger, one set of budget books and one state store for N replicas.

Design note. Each proxy process keeps its write-ahead log on its own disk (``spool_dir``), as in
the DuckDB mode, so a request's row is durable before its client hears the end of the reply
whether or not the database answers. Every ``flush_interval_s`` the closed segments are COPYed
into a staging table and inserted with ``INSERT ... SELECT FROM jsonb_to_record(...) ON
CONFLICT (request_id) DO NOTHING``, in one transaction per flush, off the request path: a
segment inserted twice (a crash between the insert and the cleanup, a log recovered by two
replicas) never makes a second row. A process that finds the lock of a dead writer in its spool
directory (its own earlier run, or a sibling sharing the directory) recovers that writer's log.

Reports read a local DuckDB copy (:mod:`~tokenward.reports.ledger.mirror`); budget evaluation
reads Postgres directly (:mod:`~tokenward.reports.ledger.pg_spend`); state is
:mod:`~tokenward.reports.ledger.pg_state`; books :class:`~tokenward.reports.ledger.books.PgBooks`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import msgspec
import psycopg

from tokenward.reports.ledger import pg_deferred, pg_migrations, spooled
from tokenward.reports.ledger.duck import apply_prices as duck_apply_prices
from tokenward.reports.ledger.errors import LedgerError
from tokenward.reports.ledger.isolate import insert_isolating
from tokenward.reports.ledger.mirror import Mirror
from tokenward.reports.ledger.pg_migrations import INGEST_LOCK, PG_TYPES
from tokenward.reports.ledger.pg_pool import SyncPool, connect_watched, redact
from tokenward.reports.ledger.pg_spend import PgSpend
from tokenward.reports.ledger.pg_state import PgState
from tokenward.reports.ledger.schema import ROW_COLUMNS
from tokenward.reports.ledger.wal import WriteAheadLog, dead_writers, encode_row

__all__ = ["PgLedger", "default_spool_dir"]

log = logging.getLogger("tokenward.ledger")
T = TypeVar("T")
_encoder = msgspec.json.Encoder(decimal_format="string")

_TIMES = ("started_at", "ended_at")
_RECORD = ", ".join(
    f"{name} {'double precision' if name in _TIMES else PG_TYPES[kind]}" for name, kind in ROW_COLUMNS.items()
)
# epoch seconds to microseconds rounded half away from zero: exactly DuckDB's to_timestamp()
_VALUES = ", ".join(
    f"'epoch'::timestamptz + round(r.{name} * 1000000) * interval '1 microsecond'" if name in _TIMES else f"r.{name}"
    for name in ROW_COLUMNS
)
_INSERT = (
    f"INSERT INTO requests ({', '.join(ROW_COLUMNS)}) SELECT {_VALUES} "
    f"FROM tw_stage AS s, json_to_record(s.line::json) AS r({_RECORD}) ON CONFLICT (request_id) DO NOTHING"
)
_COPY_IN = "COPY tw_stage (line) FROM STDIN (FORMAT csv, DELIMITER E'\\x02', QUOTE E'\\x01')"
# a value Postgres refuses in one line (bad JSON, a count out of range, a missing column)
_REFUSED = (psycopg.errors.DataError, psycopg.errors.IntegrityError)
_PRICE_UPDATE = (
    "UPDATE requests AS q SET price_status = u.price_status, cost_usd = u.cost_usd, price_entry_id = u.price_entry_id, "
    "price_resolved_by = u.price_resolved_by, cost_lines = u.cost_lines, output_cost_usd = u.output_cost_usd, "
    "cache_savings_usd = u.cache_savings_usd, seq = nextval('requests_seq') "
    "FROM json_to_recordset(%s::json) AS u(request_id text, price_status text, cost_usd numeric(38,12), "
    "price_entry_id text, price_resolved_by text, cost_lines json, output_cost_usd numeric(38,12), "
    "cache_savings_usd numeric(38,12)) WHERE q.request_id = u.request_id"
)


def default_spool_dir(url: str) -> Path:
    """Where a Postgres ledger's local files go when nothing names a directory: the user's cache."""
    digest = hashlib.sha256(redact(url).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "tokenward" / f"ledger-{digest}"


class PgLedger:
    """A ledger in a Postgres database, shared by every replica; implements :class:`~tokenward.reports.ledger.Ledger`.

    Args:
        url: libpq URL of the database (``postgresql://user:password@host:5432/tokenward``).
        spool_dir: this process's local directory for the write-ahead log and the report copy.
        mirror_path: the report copy (default ``<spool_dir>/reports.duckdb``).
    """

    engine = "postgres"
    shared = True

    def __init__(self, url: str, spool_dir: str | Path | None = None, *, mirror_path: str | Path | None = None) -> None:
        self.url = url
        self.spool_dir = Path(spool_dir) if spool_dir else default_spool_dir(url)
        self.pool = SyncPool(url)
        self.state = PgState(self.pool)
        self.mirror = Mirror(Path(mirror_path) if mirror_path else self.spool_dir / "reports.duckdb", self.pool)
        self._ready = False
        self._lock = threading.Lock()  # one flush at a time in this process: each segment is taken once
        self._sessions = threading.Lock()  # one report copy session at a time (never holds up a flush)

    @property
    def name(self) -> str:
        """The URL without its password."""
        return redact(self.url)

    @property
    def quarantine(self) -> Path:
        """Where rows Postgres refuses are kept, one JSON line each with the reason."""
        return self.spool_dir / "quarantine.jsonl"

    # -- schema ------------------------------------------------------------------------------

    def migrate(self) -> list[str]:
        """See :meth:`Ledger.migrate` (under an advisory lock: replicas starting together migrate once)."""
        try:
            with self.pool.connection() as conn:
                applied = pg_migrations.migrate(conn)
        except psycopg.Error as exc:
            raise LedgerError(f"cannot migrate the ledger {self.name}: {exc}") from exc
        self._ready = True
        return applied

    def require_schema(self) -> None:
        """Check that the database holds the current schema.

        Raises:
            LedgerError: the database cannot be read, or migrations are pending (none applied:
                no replica has started on it).
        """
        self._check()

    def _check(self) -> None:
        if self._ready:
            return
        try:
            with self.pool.connection() as conn:
                missing = pg_migrations.pending(conn)
        except psycopg.Error as exc:
            raise LedgerError(f"cannot read the ledger {self.name}: {exc}") from exc
        if missing:
            how = "run `tokenward ledger migrate` with the same --config or --db, or start a replica once"
            if "m001_requests" in missing:
                raise LedgerError(f"ledger {self.name} has no tokenward schema yet: {how} (the first one creates it)")
            raise LedgerError(f"ledger {self.name} needs migrations {missing}: {how}")
        self._ready = True

    # -- reading -----------------------------------------------------------------------------

    def connect(self, *, read_only: bool, wait_s: float = 0.0) -> duckdb.DuckDBPyConnection:
        """See :meth:`Ledger.connect`: the local report copy, brought up to date first."""
        self._check()
        try:
            return self.mirror.open(wait_s)
        except psycopg.Error as exc:
            raise LedgerError(f"cannot read the ledger {self.name}: {exc}") from exc

    def session(self, work: Callable[[duckdb.DuckDBPyConnection], T], *, read_only: bool = False) -> T:
        """See :meth:`Ledger.session` (sessions in this process are serialised, like the DuckDB engine's)."""
        with self._sessions:
            conn = self.connect(read_only=read_only, wait_s=10.0)
            try:
                return work(conn)
            finally:
                conn.close()

    def query(self, work: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """See :meth:`Ledger.query`: in this process, on the local report copy (:meth:`session`)."""
        return self.session(lambda conn: work(conn, *args, **kwargs), read_only=True)

    def read_spend(self, work: Callable[[Any], T]) -> T:
        """See :meth:`Ledger.read_spend`: :class:`~tokenward.reports.ledger.pg_spend.PgSpend` on the server."""
        self._check()
        try:
            return work(PgSpend(self.pool))
        except psycopg.Error as exc:
            raise LedgerError(f"cannot read the ledger {self.name}: {exc}") from exc

    def present(self, request_ids: list[str]) -> set[str]:
        """Which of ``request_ids`` have a row in the ledger.

        Raises:
            LedgerError: the database cannot be read.
        """
        try:
            return PgSpend(self.pool).ids_present(request_ids)
        except psycopg.Error as exc:
            raise LedgerError(str(exc)) from exc

    def waiting_segments(self, wal: WriteAheadLog | None = None) -> int:
        """See :meth:`Ledger.waiting_segments`."""
        return spooled.waiting_segments(self.spool_dir, wal)

    def unflushed_rows(self, wal: WriteAheadLog | None = None) -> list[dict[str, Any]]:
        """See :meth:`Ledger.unflushed_rows`."""
        return spooled.unflushed_rows(self.spool_dir, wal, self.present)

    # -- writing -----------------------------------------------------------------------------

    def _insert(self, conn: Any, lines: list[bytes]) -> int:
        """Insert log lines in one transaction under the ingest lock (``seq`` in commit order); rows inserted."""
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [INGEST_LOCK])
            conn.execute("CREATE TEMP TABLE IF NOT EXISTS tw_stage (line text) ON COMMIT DELETE ROWS")
            with conn.cursor().copy(_COPY_IN) as copy:
                copy.write(b"\n".join(lines) + b"\n")
            return int(conn.execute(_INSERT).rowcount)

    def _insert_files(self, conn: Any, files: list[Path]) -> int:
        lines = [line for path in files for line in path.read_bytes().split(b"\n") if line.strip()]
        if not lines:
            return 0
        try:
            return self._insert(conn, lines)
        except _REFUSED as exc:
            log.error("a write-ahead segment holds rows Postgres refuses (%s); isolating them", exc)
        return insert_isolating(lines, lambda group: self._insert(conn, group), _REFUSED, self.quarantine)

    def flush(self, wal: WriteAheadLog | None = None) -> int:
        """See :meth:`Ledger.flush`: ``wal``'s closed segments, then what dead writers in the spool left.

        Raises:
            LedgerError: the database cannot be reached or written; every segment stays for the next flush.
        """
        if wal is not None:
            wal.rotate()
        with self._lock:
            own = wal.closed_rows() if wal is not None else []
            dead = dead_writers(self.spool_dir, own=wal.writer_id if wal is not None else None)
            try:
                if not own and not dead:
                    return 0
                self._check()
                with self.pool.connection() as conn:
                    inserted = 0
                    if own:
                        inserted += self._insert_files(conn, own)
                        for path in own:
                            path.unlink()
                    for writer in dead:
                        inserted += self._insert_files(conn, [writer.recovered_file()])
                        writer.remove()
                        log.info("recovered the log of a stopped writer (%s)", writer.writer_id)
                    pg_deferred.apply(conn)  # background responses settled since, whose rows are in
                    return inserted
            except psycopg.Error as exc:
                raise LedgerError(f"cannot write the ledger {self.name}: {exc}") from exc
            finally:
                for writer in dead:
                    writer.release()

    def write_rows(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """See :meth:`Ledger.write_rows` (in batches of 10,000 rows, each its own transaction)."""
        self._check()
        lines = [encode_row(dict(row)).rstrip(b"\n") for row in rows]
        inserted = 0
        try:
            with self.pool.connection() as conn:
                for start in range(0, len(lines), 10_000):
                    batch = lines[start : start + 10_000]
                    try:
                        inserted += self._insert(conn, batch)
                    except _REFUSED:
                        inserted += insert_isolating(
                            batch, lambda group: self._insert(conn, group), _REFUSED, self.quarantine
                        )
        except psycopg.Error as exc:
            raise LedgerError(f"cannot write the ledger {self.name}: {exc}") from exc
        return inserted

    def apply_prices(self, conn: duckdb.DuckDBPyConnection, updates: list[dict[str, Any]]) -> None:
        """See :meth:`Ledger.apply_prices`: the server's rows (each takes a new ``seq``), then the local copy."""
        data = _encoder.encode(updates).decode()
        try:
            with self.pool.connection() as pg, pg.transaction():
                pg.execute("SELECT pg_advisory_xact_lock(%s)", [INGEST_LOCK])
                pg.execute(_PRICE_UPDATE, [data])
        except psycopg.Error as exc:
            raise LedgerError(f"cannot write the ledger {self.name}: {exc}") from exc
        duck_apply_prices(conn, updates)
        self.mirror.sync(conn)

    def job_lock(self, name: str) -> psycopg.Connection[Any] | None:
        """Take the advisory lock ``name`` on a connection of its own, or ``None`` if another process holds it.

        The lock lasts until the returned connection is closed (or its process dies), so a
        periodic job runs on one replica at a time.

        Raises:
            LedgerError: the database cannot be reached.
        """
        try:
            conn = connect_watched(self.url)  # the server ends the lock with a session whose client vanished
        except psycopg.Error as exc:
            raise LedgerError(f"cannot connect to the ledger {self.name}: {exc}") from exc
        try:
            row = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", [f"tokenward:{name}"]).fetchone()
        except psycopg.Error as exc:
            conn.close()
            raise LedgerError(str(exc)) from exc
        if row and row[0]:
            return conn
        conn.close()
        return None

    def close(self) -> None:
        """Close the idle connections."""
        self.pool.close()
