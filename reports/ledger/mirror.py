"""A local DuckDB copy of a Postgres ledger, kept in step, that reports run on unchanged.

Design note. Reports are DuckDB SQL (:mod:`tokenward.reports.queries`); running them on a
local copy gives the same numbers as the DuckDB mode by construction, at DuckDB's columnar
speed, with any DuckDB version (DuckDB's own postgres extension must match the duckdb version
exactly, and is not published for every one). The copy is a DuckDB ledger file with the same
migrations, plus ``_mirror (ledger_id, seq)``: the server's ledger id and the last ``seq``
copied. Every Postgres insert or update of a row takes a new ``seq`` under the ingest lock, so
``seq`` order is commit order: :meth:`Mirror.sync` copies the rows with ``seq`` above the last
one (in slices, in one REPEATABLE READ snapshot), replacing rows it had (a re-priced row comes
again with a new ``seq``). A new database (another ``ledger_id``) starts the copy over.

Rows travel as CSV (``COPY ... TO STDOUT`` on the server, ``read_csv`` here): costs as
Postgres prints ``numeric`` (every digit), times with microseconds and their offset, tags as a
JSON array, so nothing is rounded on the way. (CSV rather than JSON lines: building a JSON
object per row took the server about three times as long.)
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import duckdb

from tokenward.reports.ledger.duck import open_ledger
from tokenward.reports.ledger.pg_pool import SyncPool
from tokenward.reports.ledger.schema import ROW_COLUMNS

__all__ = ["Mirror"]

log = logging.getLogger("tokenward.ledger")

_SLICE = 200_000  # rows per copied slice (a temp file of a few hundred MB at most)
_TEXT = {"JSON", "VARCHAR[]"}  # read as text, converted on insert


def _read_type(name: str, kind: str) -> str:
    if name in ("started_at", "ended_at"):
        return "TIMESTAMPTZ"
    return "VARCHAR" if kind in _TEXT else kind


_SPEC = "{" + ", ".join(f"'{name}': '{_read_type(name, kind)}'" for name, kind in ROW_COLUMNS.items()) + "}"
_SELECT = ", ".join(f"array_to_json({name})" if kind == "VARCHAR[]" else name for name, kind in ROW_COLUMNS.items())
_REPLACE = ", ".join(
    f"from_json({name}, '[\"VARCHAR\"]') AS {name}" for name, kind in ROW_COLUMNS.items() if kind == "VARCHAR[]"
)
_READ = (
    f"SELECT * REPLACE ({_REPLACE}) FROM read_csv(?, columns = {_SPEC}, header = false, "
    "allow_quoted_nulls = false, quote = '\"', escape = '\"', delim = ',', auto_detect = false)"
)


class Mirror:
    """The DuckDB file at ``path`` mirroring the Postgres ledger behind ``pool``.

    Args:
        path: the local DuckDB file (created on first use).
        pool: connections to the Postgres ledger.
    """

    def __init__(self, path: Path, pool: SyncPool) -> None:
        self.path = path
        self._pool = pool

    def open(self, wait_s: float = 0.0) -> duckdb.DuckDBPyConnection:
        """The local copy, brought up to date, open read-write (the caller closes it).

        Raises:
            LedgerBusy: another process has the copy open for ``wait_s`` seconds.
            LedgerError: the server or the file cannot be read.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = open_ledger(self.path, wait_s=wait_s)
        try:
            self.sync(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def sync(self, conn: duckdb.DuckDBPyConnection) -> int:
        """Copy every row inserted or changed on the server since the last sync; rows copied."""
        conn.execute("CREATE TABLE IF NOT EXISTS _mirror (ledger_id VARCHAR, seq BIGINT)")
        found = conn.execute("SELECT ledger_id, seq FROM _mirror").fetchone()
        copied = 0
        with self._pool.connection() as pg, pg.transaction():
            pg.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            row = pg.execute(
                "SELECT (SELECT value FROM tw_meta WHERE name = 'ledger_id'), coalesce(max(seq), 0) FROM requests"
            ).fetchone()
            assert row is not None
            ledger_id, high = str(row[0]), int(row[1])
            last = int(found[1]) if found is not None and found[0] == ledger_id else -1
            if last < 0:
                conn.execute("DELETE FROM requests")
                self._mark(conn, ledger_id, 0)
                last = 0
            while last < high:
                upto = self._slice_end(pg, last, high)
                copied += self._copy(pg, conn, ledger_id, last, upto)
                last = upto
        if copied:
            log.debug("report copy of the ledger: %d rows brought up to date", copied)
        return copied

    @staticmethod
    def _slice_end(pg: Any, last: int, high: int) -> int:
        row = pg.execute(
            "SELECT seq FROM requests WHERE seq > %s ORDER BY seq OFFSET %s LIMIT 1", [last, _SLICE]
        ).fetchone()
        return min(int(row[0]) - 1, high) if row else high

    @staticmethod
    def _mark(conn: duckdb.DuckDBPyConnection, ledger_id: str, seq: int) -> None:
        conn.execute("DELETE FROM _mirror")
        conn.execute("INSERT INTO _mirror VALUES (?, ?)", [ledger_id, seq])

    def _copy(self, pg: Any, conn: duckdb.DuckDBPyConnection, ledger_id: str, last: int, upto: int) -> int:
        handle, name = tempfile.mkstemp(suffix=".csv", dir=self.path.parent)
        try:
            with (
                os.fdopen(handle, "wb") as out,
                pg.cursor().copy(
                    f"COPY (SELECT {_SELECT} FROM requests WHERE seq > {int(last)} AND seq <= {int(upto)}) "
                    "TO STDOUT (FORMAT csv)"
                ) as copy,
            ):
                for chunk in copy:
                    out.write(chunk)
            if os.path.getsize(name) == 0:  # every row of this slice changed again since (a later seq)
                self._mark(conn, ledger_id, upto)
                return 0
            conn.execute("BEGIN TRANSACTION")
            try:
                if last > 0:  # rows changed since they were copied come again: replace them
                    conn.execute(f"DELETE FROM requests WHERE request_id IN (SELECT request_id FROM ({_READ}))", [name])
                result = conn.execute(f"INSERT INTO requests BY NAME {_READ}", [name]).fetchone()
                self._mark(conn, ledger_id, upto)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return int(result[0]) if result else 0
        finally:
            os.unlink(name)
