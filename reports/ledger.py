"""The DuckDB ledger: the only code that writes SQL, and how readers open the file.

Design note. DuckDB allows one read-write process per file, and while it holds the file no
other process can open it, not even read-only (``shared/NOTES.md`` section 4). So the proxy
never keeps the file open: rows go first to a *spool* file (newline-delimited JSON, one file
per flush, in ``<ledger>.spool/``), then one short read-write session moves every spooled row
into the ``requests`` table in a single bulk ``INSERT ... SELECT FROM read_json(...)`` and
closes the file again. Between flushes, ``tokenward report`` opens the file read-only. When a
reader holds the file the flush fails with :class:`LedgerBusy`, the spool files stay, and the
next flush takes them too: rows wait on disk, never in unbounded memory, and are not lost if
the proxy dies (the next start ingests leftovers, skipping rows already committed).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import msgspec

from tokenward.reports.migrations import migrate, pending

__all__ = [
    "ROW_COLUMNS",
    "LedgerBusy",
    "LedgerError",
    "Spool",
    "open_ledger",
]

log = logging.getLogger("tokenward.ledger")
T = TypeVar("T")

ROW_COLUMNS: dict[str, str] = {
    "request_id": "VARCHAR",
    "client_request_id": "VARCHAR",
    "started_at": "DOUBLE",
    "ended_at": "DOUBLE",
    "principal": "VARCHAR",
    "method": "VARCHAR",
    "path": "VARCHAR",
    "endpoint": "VARCHAR",
    "upstream": "VARCHAR",
    "provider": "VARCHAR",
    "requested_model": "VARCHAR",
    "served_model": "VARCHAR",
    "http_status": "INTEGER",
    "outcome": "VARCHAR",
    "stream": "BOOLEAN",
    "input_tokens": "BIGINT",
    "cached_input_tokens": "BIGINT",
    "cache_write_tokens": "BIGINT",
    "cache_write_1h_tokens": "BIGINT",
    "output_tokens": "BIGINT",
    "reasoning_tokens": "BIGINT",
    "audio_input_tokens": "BIGINT",
    "audio_output_tokens": "BIGINT",
    "image_input_tokens": "BIGINT",
    "web_search_requests": "BIGINT",
    "usage_source": "VARCHAR",
    "cost_usd": "DECIMAL(38,12)",
    "price_status": "VARCHAR",
    "price_entry_id": "VARCHAR",
    "price_resolved_by": "VARCHAR",
    "cost_lines": "JSON",
    "output_cost_usd": "DECIMAL(38,12)",
    "cache_savings_usd": "DECIMAL(38,12)",
    "provider_cost_usd": "DECIMAL(38,12)",
    "service_tier": "VARCHAR",
    "latency_ms": "DOUBLE",
    "ttfb_ms": "DOUBLE",
    "error": "VARCHAR",
    "violations": "VARCHAR",
    "raw_usage": "JSON",
    "row_kind": "VARCHAR",
    "parent_request_id": "VARCHAR",
    "key_id": "VARCHAR",
    "team": "VARCHAR",
    "project": "VARCHAR",
    "end_user": "VARCHAR",
    "tags": "VARCHAR[]",
    "session_id": "VARCHAR",
}
"""A spooled row's keys and their types as read from JSON. ``started_at``/``ended_at`` are UTC
epoch seconds (converted to ``TIMESTAMPTZ`` on insert); costs are decimal strings (exact)."""

_LOCK_MARKERS = ("Could not set lock", "Conflicting lock")
_encoder = msgspec.json.Encoder(decimal_format="string")


class LedgerError(RuntimeError):
    """The ledger cannot be opened or written (missing file, outdated schema, corrupt data)."""


class LedgerBusy(LedgerError):
    """Another process holds the ledger file; try again shortly."""


def _connect(path: str, read_only: bool) -> duckdb.DuckDBPyConnection:
    try:
        conn = duckdb.connect(path, read_only=read_only)
    except duckdb.IOException as exc:
        if any(marker in str(exc) for marker in _LOCK_MARKERS):
            raise LedgerBusy(f"ledger {path} is in use by another process") from exc
        raise LedgerError(f"cannot open ledger {path}: {exc}") from exc
    conn.execute("SET TimeZone = 'UTC'")
    return conn


def open_ledger(
    path: str | Path, *, read_only: bool = False, wait_s: float = 0.0, migrate_schema: bool = True
) -> duckdb.DuckDBPyConnection:
    """Open the ledger file, retrying for up to ``wait_s`` seconds while another process holds it.

    A read-write open creates the file if needed and (``migrate_schema``) applies pending migrations. A read-only
    open needs an existing, fully migrated file (start the proxy once, or run
    ``tokenward ledger migrate``). Sessions use the UTC time zone.

    Raises:
        LedgerBusy: the file stayed locked by another process for ``wait_s`` seconds.
        LedgerError: the file is missing (read-only), unreadable or has an older schema.
    """
    path = str(path)
    if read_only and not os.path.exists(path):
        raise LedgerError(f"no ledger at {path} yet: start the proxy once, or check --db/--config")
    deadline = time.monotonic() + wait_s
    delay = 0.02
    while True:
        try:
            conn = _connect(path, read_only)
            break
        except LedgerBusy:
            if time.monotonic() >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
    if read_only:
        missing = pending(conn)
        if missing:
            conn.close()
            raise LedgerError(f"ledger {path} needs migrations {missing}: run `tokenward ledger migrate`")
    elif migrate_schema:
        migrate(conn)
    return conn


class Spool:
    """Rows on their way into the ledger: NDJSON files beside it, bulk-inserted in one go.

    Thread-safe: writes and ingests are serialised, so the periodic flush still running in a
    worker thread and the final flush at shutdown never take the same files twice.

    Args:
        ledger_path: the DuckDB file.
    """

    def __init__(self, ledger_path: str | Path) -> None:
        self.ledger_path = str(ledger_path)
        self.directory = Path(self.ledger_path + ".spool")
        self._pid = os.getpid()
        self._seq = 0
        self._lock = threading.Lock()

    def write(self, rows: Iterable[Mapping[str, Any]]) -> Path | None:
        """Write ``rows`` (dicts keyed by :data:`ROW_COLUMNS`) to a new spool file; ``None`` if empty."""
        data = _encoder.encode_lines(list(rows))
        if not data:
            return None
        with self._lock:
            return self._write(data)

    def _write(self, data: bytes) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        final = self.directory / f"{time.time_ns()}-{self._pid}-{self._seq}.jsonl"
        partial = final.with_suffix(".part")
        partial.write_bytes(data)
        partial.replace(final)  # readers never see half a file
        return final

    def run(self, work: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
        """Run ``work`` on a read-write connection, between flushes (blocking; call from a thread).

        Raises:
            LedgerBusy: another process holds the file.
            LedgerError: the file cannot be opened.
        """
        with self._lock:
            conn = open_ledger(self.ledger_path)
            try:
                return work(conn)
            finally:
                conn.close()

    def pending_files(self, *, recover: bool = False) -> list[Path]:
        """Spool files of this process, plus (``recover``) those left by processes no longer running."""
        if not self.directory.exists():
            return []
        files = []
        for file in sorted(self.directory.glob("*.jsonl")):
            pid = int(file.stem.split("-")[1])
            if pid == self._pid or (recover and not _alive(pid)):
                files.append(file)
        return files

    def ingest(self, *, recover: bool = False) -> int:
        """Move spooled rows into the ledger; returns the number of rows inserted.

        With ``recover``, files of dead processes are taken too and rows whose ``request_id``
        is already in the ledger are skipped (a crash between commit and file removal).

        Raises:
            LedgerBusy: another process holds the file; the spool files stay for next time.
            LedgerError: the file cannot be opened or migrated.
        """
        with self._lock:
            return self._ingest(recover)

    def _ingest(self, recover: bool) -> int:
        files = self.pending_files(recover=recover)
        if not files:
            return 0
        conn = open_ledger(self.ledger_path)
        try:
            try:
                inserted = self._insert(conn, files, dedupe=recover)
            except duckdb.Error as exc:
                log.error("spooled rows could not be inserted together (%s); trying file by file", exc)
                inserted = 0
                for file in files:
                    try:
                        inserted += self._insert(conn, [file], dedupe=True)
                    except duckdb.Error as file_exc:
                        bad = file.with_suffix(".bad")
                        file.replace(bad)
                        log.error("quarantined unreadable spool file %s: %s", bad, file_exc)
                    else:
                        file.unlink()
                return inserted
        finally:
            conn.close()
        for file in files:
            file.unlink()
        return inserted

    @staticmethod
    def _insert(conn: duckdb.DuckDBPyConnection, files: list[Path], *, dedupe: bool) -> int:
        columns = "{" + ", ".join(f"'{name}': '{kind}'" for name, kind in ROW_COLUMNS.items()) + "}"
        source = (
            "SELECT * REPLACE (to_timestamp(started_at) AS started_at, to_timestamp(ended_at) AS ended_at) "
            f"FROM read_json(?, format = 'newline_delimited', columns = {columns})"
        )
        if dedupe:
            source = f"SELECT * FROM ({source}) AS s WHERE s.request_id NOT IN (SELECT request_id FROM requests)"
        conn.execute("BEGIN TRANSACTION")
        try:
            result = conn.execute(f"INSERT INTO requests BY NAME {source}", [[str(f) for f in files]]).fetchone()
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return int(result[0]) if result else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
