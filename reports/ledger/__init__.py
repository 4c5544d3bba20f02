"""Storage: the one home of every table, statement and migration tokenward keeps.

Map of the package (each engine's SQL lives in its own module; the rest is engine-neutral):

* :mod:`~tokenward.reports.ledger.schema`: the row every engine stores (:data:`ROW_COLUMNS`) and
  what a row counts against a budget;
* :mod:`~tokenward.reports.ledger.wal`: the write-ahead log that makes each row durable before
  the client hears back, and recovers what a dead process left;
* :mod:`~tokenward.reports.ledger.duck`: the DuckDB engine (the default, one file);
* :mod:`~tokenward.reports.ledger.migrations`: the DuckDB schema's versioned migrations;
* :mod:`~tokenward.reports.ledger.state`: alert claims and deliveries, stored keys, provider
  object owners (SQLite beside a DuckDB file, so that no reader can block them);
* :mod:`~tokenward.reports.ledger.spend`: what budget evaluation reads;
* :mod:`~tokenward.reports.ledger.legacy`: the one-time move of older versions' state.

:class:`DuckLedger` ties a DuckDB file to its log directory and state store; the proxy and the
CLI reach storage through it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import duckdb

from tokenward.reports.ledger.duck import insert_lines, open_ledger
from tokenward.reports.ledger.errors import LedgerBusy, LedgerError
from tokenward.reports.ledger.schema import ROW_COLUMNS, SPEND_EXPRESSION
from tokenward.reports.ledger.state import SqliteState, StateStore
from tokenward.reports.ledger.wal import WriteAheadLog, dead_writers, encode_row

__all__ = [
    "ROW_COLUMNS",
    "SPEND_EXPRESSION",
    "DuckLedger",
    "LedgerBusy",
    "LedgerError",
    "StateStore",
    "WriteAheadLog",
    "open_ledger",
    "write_rows",
]

log = logging.getLogger("tokenward.ledger")
T = TypeVar("T")


class DuckLedger:
    """A DuckDB ledger file, its write-ahead log directory (``<file>.spool``) and its state (``<file>.state.sqlite``).

    Sessions in this process are serialised (DuckDB lets one connection configuration hold a file).

    Args:
        path: the DuckDB file.
    """

    engine = "duckdb"

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.spool_dir = Path(self.path + ".spool")
        self.state = SqliteState(self.path + ".state.sqlite")
        self._lock = threading.Lock()

    @property
    def quarantine(self) -> Path:
        """Where rows the engine refuses are kept, one JSON line each with the reason."""
        return self.spool_dir / "quarantine.jsonl"

    def session(self, work: Callable[[duckdb.DuckDBPyConnection], T], *, read_only: bool = False) -> T:
        """Run ``work`` on a connection to the file (blocking; call from a worker thread).

        Raises:
            LedgerBusy: another process holds the file.
            LedgerError: the file cannot be opened.
        """
        with self._lock:
            conn = open_ledger(self.path, read_only=read_only)
            try:
                return work(conn)
            finally:
                conn.close()

    def flush(self, wal: WriteAheadLog | None = None) -> int:
        """Move rows from the log into the file: ``wal``'s closed segments, then what dead writers left.

        Blocking (a worker thread). ``wal`` is rotated first, so everything appended before the
        call is included. A dead writer's rows (and a row for each request it left in flight)
        are inserted with de-duplication, then its files are removed.

        Returns:
            The number of rows inserted.

        Raises:
            LedgerBusy: another process holds the file; every segment stays for the next flush.
            LedgerError: the file cannot be opened or migrated.
        """
        if wal is not None:
            wal.rotate()
        with self._lock:  # one flush at a time in this process: each segment is taken once
            own = wal.closed_rows() if wal is not None else []
            dead = dead_writers(self.spool_dir, own=wal.writer_id if wal is not None else None)
            try:
                if not own and not dead:
                    return 0
                conn = open_ledger(self.path)
                try:
                    inserted = 0
                    if own:
                        inserted += insert_lines(
                            conn, own, dedupe=False, quarantine=self.quarantine, scratch=self.spool_dir
                        )
                        for path in own:
                            path.unlink()
                    for writer in dead:
                        recovered = writer.recovered_file()
                        inserted += insert_lines(
                            conn, [recovered], dedupe=True, quarantine=self.quarantine, scratch=self.spool_dir
                        )
                        writer.remove()
                        log.info("recovered the log of a stopped writer (%s)", writer.writer_id)
                    return inserted
                finally:
                    conn.close()
            finally:
                for writer in dead:
                    writer.release()

    def waiting_segments(self, wal: WriteAheadLog | None = None) -> int:
        """Log files waiting to go into the ledger: ``wal``'s closed rows files and dead writers' files."""
        if not self.spool_dir.exists():
            return 0
        own = wal.writer_id if wal is not None else None
        count = 0
        for path in self.spool_dir.iterdir():
            name = path.name
            if name.endswith(".rows.jsonl") and not name.startswith(f"{own}-"):
                count += 1
            elif name.endswith((".jsonl", ".part")) and name[:1].isdigit():
                count += 1
        return count + (len(wal.closed_rows()) if wal is not None else 0)

    def unflushed_rows(self, wal: WriteAheadLog | None = None) -> list[dict[str, Any]]:
        """Rows in the log that are not in the file yet: ``wal``'s and dead writers' (with their in-flight rows).

        What the budget books must count at start while a reader keeps the file from being
        written. Rows a dead writer had inserted already (it died before its cleanup) are left
        out when the file can be read.
        """
        rows: list[dict[str, Any]] = []
        if wal is not None:
            from tokenward.reports.ledger.wal import read_rows

            for path in wal.closed_rows():
                rows += read_rows(path)
        dead = dead_writers(self.spool_dir, own=wal.writer_id if wal is not None else None)
        try:
            recovered = [row for writer in dead for row in writer.rows()]
        finally:
            for writer in dead:
                writer.release()
        if recovered:
            ids = [str(row.get("request_id")) for row in recovered]
            try:
                present = self.session(lambda conn: _present(conn, ids), read_only=True)
            except LedgerError:
                present = set()
            rows += [row for row in recovered if row.get("request_id") not in present]
        return rows


def _present(conn: duckdb.DuckDBPyConnection, ids: list[str]) -> set[str]:
    found = conn.execute("SELECT request_id FROM requests WHERE list_contains(?, request_id)", [ids]).fetchall()
    return {r[0] for r in found}


def write_rows(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> int:
    """Insert ``rows`` (dicts keyed by :data:`ROW_COLUMNS`) into the ledger at ``path`` at once.

    For tools and tests that seed a ledger; the proxy writes through its log instead.

    Raises:
        LedgerBusy: another process holds the file.
    """
    data = b"".join(encode_row(dict(row)) for row in rows)
    if not data:
        return 0
    directory = Path(str(path) + ".spool")
    directory.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(suffix=".rows.tmp", dir=directory)
    with os.fdopen(handle, "wb") as out:
        out.write(data)
    try:
        conn = open_ledger(path)
        try:
            return insert_lines(
                conn, [Path(name)], dedupe=False, quarantine=directory / "quarantine.jsonl", scratch=directory
            )
        finally:
            conn.close()
    finally:
        os.unlink(name)
