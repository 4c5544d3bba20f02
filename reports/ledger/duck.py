"""The DuckDB engine: opening the ledger file, and moving write-ahead-log rows into it in bulk.

Design note. DuckDB allows one read-write process per file, and while it holds the file no
other process can open it, not even read-only (``shared/NOTES.md`` section 4). So the proxy
never keeps the file open: rows are first made durable in the write-ahead log
(:mod:`tokenward.reports.ledger.wal`), then one short read-write session moves every closed
log segment into ``requests`` with a single ``INSERT ... SELECT FROM read_json(...)`` and
closes the file again. Between those sessions ``tokenward report`` opens the file read-only.
When a reader holds the file the session fails with :class:`LedgerBusy` and the segments wait
on disk for the next try: rows are never lost and never wait in memory.

A segment that cannot be inserted whole (a value DuckDB refuses) is split in halves until the
bad lines are found; only those lines go to the quarantine file, everything else is inserted.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import msgspec

from tokenward.reports.ledger.errors import LedgerBusy, LedgerError
from tokenward.reports.ledger.isolate import insert_isolating
from tokenward.reports.ledger.migrations import migrate, pending
from tokenward.reports.ledger.schema import ROW_COLUMNS

__all__ = ["apply_prices", "connect", "include_unflushed", "insert_lines", "open_ledger"]

log = logging.getLogger("tokenward.ledger")

# DuckDB's messages when another process holds the file, or (inside one process) when a
# connection with another configuration (read-only against read-write) is open on it.
_BUSY_MARKERS = ("Could not set lock", "Conflicting lock", "different configuration")
_encoder = msgspec.json.Encoder(decimal_format="string")
_REFUSED = (duckdb.ConversionException, duckdb.InvalidInputException, duckdb.ConstraintException)
_COLUMNS_SPEC = "{" + ", ".join(f"'{name}': '{kind}'" for name, kind in ROW_COLUMNS.items()) + "}"
_SOURCE = (
    "SELECT * REPLACE (to_timestamp(started_at) AS started_at, to_timestamp(ended_at) AS ended_at) "
    f"FROM read_json(?, format = 'newline_delimited', columns = {_COLUMNS_SPEC})"
)


def connect(path: str, read_only: bool) -> duckdb.DuckDBPyConnection:
    """One connection to the DuckDB file at ``path`` (UTC session time zone).

    Raises:
        LedgerBusy: another process (or an incompatible connection in this one) holds the file.
        LedgerError: the file cannot be opened.
    """
    try:
        conn = duckdb.connect(path, read_only=read_only)
    except (duckdb.IOException, duckdb.ConnectionException) as exc:
        if any(marker in str(exc) for marker in _BUSY_MARKERS):
            raise LedgerBusy(f"ledger {path} is in use by another process") from exc
        raise LedgerError(f"cannot open ledger {path}: {exc}") from exc
    except duckdb.Error as exc:
        raise LedgerError(f"cannot open ledger {path}: {exc}") from exc
    conn.execute("SET TimeZone = 'UTC'")
    return conn


def open_ledger(
    path: str | Path, *, read_only: bool = False, wait_s: float = 0.0, migrate_schema: bool = True
) -> duckdb.DuckDBPyConnection:
    """Open the ledger file, retrying for up to ``wait_s`` seconds while another process holds it.

    A read-write open creates the file if needed and (``migrate_schema``) applies pending
    migrations. A read-only open needs an existing, fully migrated file (start the proxy once,
    or run ``tokenward ledger migrate``). Sessions use the UTC time zone.

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
            conn = connect(path, read_only)
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


def include_unflushed(conn: duckdb.DuckDBPyConnection, spool_dir: Path) -> int:
    """Make ``requests`` on ``conn`` also show the finished rows still in the write-ahead log.

    A report run right after a request would otherwise miss it until the proxy's next flush.
    On a read-only connection, a temporary view named ``requests`` shadows the table: the file's
    rows, plus the log's rows files not yet moved in (any writer's, a line being appended right
    now skipped; a request in two files once), minus those already in the file. Rows of requests still in flight are not
    shown (they have no row yet).

    Returns:
        The number of log files included (0: the view is not made).
    """
    files = sorted(
        str(p)
        for p in (spool_dir.iterdir() if spool_dir.is_dir() else ())
        if p.name.endswith(".rows.jsonl") or (p.name[:1].isdigit() and p.name.endswith((".jsonl", ".part")))
    )
    if not files:
        return 0
    database = conn.execute("SELECT current_database()").fetchone()
    table = f'"{database[0] if database else "main"}".main.requests'
    logged = _SOURCE.replace("format = 'newline_delimited',", "format = 'newline_delimited', ignore_errors = true,")
    # one row per request: a recovery cut short by a kill (its ``-recovered`` file written, the
    # writer's own files not removed yet) leaves each of its rows in two files
    once = f"SELECT * FROM ({logged}) QUALIFY row_number() OVER (PARTITION BY request_id) = 1"
    try:
        conn.execute(f"CREATE TEMP TABLE _unflushed AS {once}", [files])
    except duckdb.IOException:  # a file went into the ledger (and away) meanwhile: what is left is in the file
        return include_unflushed(conn, spool_dir) if any(Path(f).exists() for f in files) else 0
    conn.execute(
        "CREATE TEMP VIEW requests AS SELECT * FROM "
        f"{table} UNION ALL BY NAME SELECT * FROM _unflushed u WHERE u.request_id NOT IN "
        f"(SELECT request_id FROM {table} WHERE started_at >= (SELECT min(started_at) FROM _unflushed))"
    )
    return len(files)


def insert_lines(
    conn: duckdb.DuckDBPyConnection, files: Sequence[Path], *, dedupe: bool, quarantine: Path, scratch: Path
) -> int:
    """Insert the row lines of ``files`` (JSON lines keyed by ``ROW_COLUMNS``) in one transaction.

    With ``dedupe``, rows whose ``request_id`` is already in the ledger are skipped (segments of a
    writer that died between its commit and its cleanup). Lines DuckDB refuses are appended to
    ``quarantine`` with the reason, and only they are left out. ``scratch`` is a directory for
    the temporary files of that search.

    Returns:
        The number of rows inserted.

    Raises:
        duckdb.Error: the ledger itself failed (not a bad line).
    """
    try:
        return _insert(conn, [str(f) for f in files], dedupe)
    except _REFUSED as exc:
        log.error("a write-ahead segment holds rows DuckDB refuses (%s); isolating them", exc)
    lines = [line for f in files for line in _lines(f)]
    return _insert_searching(conn, lines, dedupe, quarantine, scratch)


def _insert(conn: duckdb.DuckDBPyConnection, paths: list[str], dedupe: bool) -> int:
    source = _SOURCE
    if dedupe:
        source = f"SELECT * FROM ({source}) AS s WHERE s.request_id NOT IN (SELECT request_id FROM requests)"
    conn.execute("BEGIN TRANSACTION")
    try:
        result = conn.execute(f"INSERT INTO requests BY NAME {source}", [paths]).fetchone()
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return int(result[0]) if result else 0


def _lines(path: Path) -> list[bytes]:
    data = path.read_bytes()
    return [line for line in data.split(b"\n") if line.strip()]


def _insert_searching(
    conn: duckdb.DuckDBPyConnection, lines: list[bytes], dedupe: bool, quarantine: Path, scratch: Path
) -> int:
    """Insert ``lines``, halving any group DuckDB refuses until the refused lines stand alone."""

    def insert(group: list[bytes]) -> int:
        handle, name = tempfile.mkstemp(suffix=".jsonl", dir=scratch)
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(b"\n".join(group) + b"\n")
            return _insert(conn, [name], dedupe)
        finally:
            os.unlink(name)

    return insert_isolating(lines, insert, _REFUSED, quarantine)


_PRICE_COLUMNS = (
    "{'request_id': 'VARCHAR', 'price_status': 'VARCHAR', 'cost_usd': 'DECIMAL(38,12)', "
    "'price_entry_id': 'VARCHAR', 'price_resolved_by': 'VARCHAR', 'cost_lines': 'JSON', "
    "'output_cost_usd': 'DECIMAL(38,12)', 'cache_savings_usd': 'DECIMAL(38,12)'}"
)


def apply_prices(conn: duckdb.DuckDBPyConnection, updates: list[dict[str, Any]]) -> None:
    """Store re-priced cost columns for the request ids of ``updates`` in one transaction.

    Each update holds ``request_id``, ``price_status``, ``cost_usd``, ``price_entry_id``,
    ``price_resolved_by``, ``cost_lines``, ``output_cost_usd`` and ``cache_savings_usd``.
    """
    fd, name = tempfile.mkstemp(suffix=".jsonl")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(_encoder.encode_lines(updates))
        conn.execute("BEGIN TRANSACTION")
        try:
            conn.execute(
                "CREATE TEMP TABLE repriced AS SELECT * FROM read_json(?, format = 'newline_delimited', "
                f"columns = {_PRICE_COLUMNS})",
                [name],
            )
            conn.execute(
                "UPDATE requests SET price_status = r.price_status, cost_usd = r.cost_usd, "
                "price_entry_id = r.price_entry_id, price_resolved_by = r.price_resolved_by, "
                "cost_lines = r.cost_lines, output_cost_usd = r.output_cost_usd, "
                "cache_savings_usd = r.cache_savings_usd "
                "FROM repriced AS r WHERE requests.request_id = r.request_id"
            )
            conn.execute("DROP TABLE repriced")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    finally:
        os.unlink(name)
