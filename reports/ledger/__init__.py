"""Storage: the one home of every table, statement and migration tokenward keeps.

Map of the package (each engine's SQL lives in its own module; the rest is engine-neutral):

* :mod:`~tokenward.reports.ledger.base`: :class:`Ledger`, the interface every engine implements;
* :mod:`~tokenward.reports.ledger.factory`: which engine a configuration names;
* :mod:`~tokenward.reports.ledger.schema`: the row every engine stores (:data:`ROW_COLUMNS`) and
  what a row counts against a budget;
* :mod:`~tokenward.reports.ledger.wal`: the write-ahead log that makes each row durable before
  the client hears back, and recovers what a dead process left;
* :mod:`~tokenward.reports.ledger.duck`: the DuckDB engine (the default, one file);
* :mod:`~tokenward.reports.ledger.migrations`: the DuckDB schema's versioned migrations;
* :mod:`~tokenward.reports.ledger.postgres`, :mod:`~tokenward.reports.ledger.pg_migrations`,
  :mod:`~tokenward.reports.ledger.pg_state`, :mod:`~tokenward.reports.ledger.pg_spend`: the
  Postgres engine (several replicas), its schema, state and spend SQL;
* :mod:`~tokenward.reports.ledger.mirror`: the local DuckDB copy of a Postgres ledger that
  reports run on (the same SQL, so the same numbers);
* :mod:`~tokenward.reports.ledger.books`: the budget books (spent and held per budget and
  period): in memory for one process, in Postgres for replicas;
* :mod:`~tokenward.reports.ledger.isolate`: setting aside the rows an engine refuses;
* :mod:`~tokenward.reports.ledger.state`: alert claims and deliveries, stored keys, provider
  object owners (SQLite beside a DuckDB file, so that no reader can block them);
* :mod:`~tokenward.reports.ledger.spend`: what budget evaluation reads;
* :mod:`~tokenward.reports.ledger.legacy`: the one-time move of older versions' state.

:class:`DuckLedger` ties a DuckDB file to its log directory and state store; the proxy and the
CLI reach storage through the :class:`Ledger` interface it implements.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tokenward.reports.ledger import spooled
from tokenward.reports.ledger.base import Ledger
from tokenward.reports.ledger.errors import LedgerBusy, LedgerError
from tokenward.reports.ledger.schema import ROW_COLUMNS, SPEND_EXPRESSION
from tokenward.reports.ledger.state import SqliteState, StateStore
from tokenward.reports.ledger.wal import WriteAheadLog, dead_writers, encode_row

__all__ = [
    "ROW_COLUMNS",
    "SPEND_EXPRESSION",
    "DuckLedger",
    "Ledger",
    "LedgerBusy",
    "LedgerError",
    "StateStore",
    "WriteAheadLog",
    "open_ledger",
    "write_rows",
]

if TYPE_CHECKING:
    import duckdb

    from tokenward.reports.ledger.duck import open_ledger
    from tokenward.reports.ledger.imported import Imported
    from tokenward.reports.ledger.mover import Mover

log = logging.getLogger("tokenward.ledger")
T = TypeVar("T")


def __getattr__(name: str) -> Any:
    """``open_ledger``, imported with DuckDB on first use (a serving proxy never imports DuckDB)."""
    if name == "open_ledger":
        from tokenward.reports.ledger.duck import open_ledger

        return open_ledger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class DuckLedger:
    """A DuckDB ledger file, its write-ahead log directory (``<file>.spool``) and its state (``<file>.state.sqlite``).

    Implements :class:`Ledger`. Sessions in this process are serialised (DuckDB lets one
    connection configuration hold a file). One proxy process per file (``shared`` is false).

    Args:
        path: the DuckDB file.
        spool_dir: the write-ahead log directory (default ``<path>.spool``).
    """

    engine = "duckdb"
    shared = False

    def __init__(self, path: str | Path, spool_dir: str | Path | None = None) -> None:
        self.path = str(path)
        self.spool_dir = Path(spool_dir) if spool_dir else Path(self.path + ".spool")
        self.state = SqliteState(self.path + ".state.sqlite")
        self._lock = threading.Lock()
        self._migrated_file: tuple[int, int] | None = None  # (device, inode) this process last migrated
        # own segments whose move failed part way: their rows may be in the file already
        self._unsure: set[Path] = set()
        self.mover: Mover | None = None
        """The child running migrations, moves and the state import (:meth:`use_mover`); ``None``: this process."""

    def _migrated(self) -> bool:
        """Whether this process has opened the file now at :attr:`path` read-write (so migrated it) before.

        Saves each move the migration check (~7 ms of a ~30 ms session); a file replaced since
        (another inode) is checked again.
        """
        return self._migrated_file is not None and self._migrated_file == _identity(self.path)

    @property
    def name(self) -> str:
        """The file's path."""
        return self.path

    def connect(self, *, read_only: bool, wait_s: float = 0.0) -> duckdb.DuckDBPyConnection:
        """See :meth:`Ledger.connect`: the file itself."""
        from tokenward.reports.ledger.duck import open_ledger

        return open_ledger(self.path, read_only=read_only, wait_s=wait_s)

    def read_spend(self, work: Callable[[Any], T]) -> T:
        """See :meth:`Ledger.read_spend`: :class:`~tokenward.reports.ledger.spend.DuckSpend` on the file.

        With a mover child, ``work`` gets a :class:`~tokenward.reports.ledger.mover.RemoteSpend`:
        the same methods, answered by the child on one read-only connection held for the call.
        """
        if self.mover is not None:
            from tokenward.reports.ledger.mover import RemoteSpend

            with self._lock:
                with RemoteSpend(self.mover, self.path) as spend:
                    return work(spend)
        from tokenward.reports.ledger.spend import DuckSpend

        return self.session(lambda conn: work(DuckSpend(conn)), read_only=True)

    def migrate(self, wait_s: float = 10.0) -> list[str]:
        """See :meth:`Ledger.migrate` (:func:`~tokenward.reports.ledger.moves.migrate_file`; in the mover child if set).

        While a reader (``tokenward report``, ``top``, a notebook) holds the file, a file whose
        schema is current needs nothing: ``[]`` at once, and the proxy starts with its rows
        waiting in the log, as they wait between flushes. Only a file that needs a migration
        waits up to ``wait_s`` seconds for the reader to let go.

        Raises:
            LedgerBusy: the file needs migrations and stayed held for ``wait_s`` seconds.
            LedgerError: the file cannot be opened or migrated.
        """
        if self.mover is not None:
            applied = self._in_child({"op": "migrate", "path": self.path, "wait_s": wait_s})
        else:
            from tokenward.reports.ledger.moves import migrate_file

            applied = migrate_file(self.path, wait_s)
        self._migrated_file = _identity(self.path)
        return applied

    def import_legacy(self) -> Imported:
        """Copy an earlier version's keys and alert claims from the file into :attr:`state` (in the mover if set).

        Raises:
            LedgerError: the file cannot be read now.
        """
        if self.mover is not None:
            return self._in_child({"op": "legacy", "path": self.path, "state_path": str(self.state.path)})
        from tokenward.reports.ledger.moves import import_legacy

        with self._lock:
            return import_legacy(self.path, str(self.state.path))

    def use_mover(self, mover: Mover | None = None) -> Mover:
        """Run migrations, moves and the state import in a mover child from now on (a serving proxy); the mover."""
        from tokenward.reports.ledger.mover import Mover

        self.mover = mover or Mover()
        return self.mover

    def close(self) -> None:
        """Stop the mover child, if any (the next move would start another)."""
        if self.mover is not None:
            self.mover.close()

    def _in_child(self, request: dict[str, Any]) -> Any:
        assert self.mover is not None
        kind, value, _ = self.mover.call(request)
        return _answer(kind, value)

    def write_rows(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """See :meth:`Ledger.write_rows` (:func:`write_rows` on the file, de-duplicated)."""
        return write_rows(self.path, rows, dedupe=True)

    def apply_prices(self, conn: duckdb.DuckDBPyConnection, updates: list[dict[str, Any]]) -> None:
        """See :meth:`Ledger.apply_prices`: an UPDATE of the file behind ``conn``."""
        from tokenward.reports.ledger.duck import apply_prices

        apply_prices(conn, updates)

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
        from tokenward.reports.ledger.duck import open_ledger

        with self._lock:
            conn = open_ledger(self.path, read_only=read_only)
            try:
                return work(conn)
            finally:
                conn.close()

    def query(self, work: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """See :meth:`Ledger.query`: with a mover child (a serving proxy), run there on its own read-only connection.

        So a serving proxy never maps DuckDB for a report (the dashboard's): ``work`` is sent by
        reference (a module-level function), its arguments and result pickled (``Decimal``,
        ``datetime`` exactly). Without a mover, :meth:`session` in this process.

        Raises:
            LedgerBusy: another process holds the file.
            LedgerError: the file cannot be read, or ``work`` raised (its message kept).
        """
        if self.mover is None:
            return self.session(lambda conn: work(conn, *args, **kwargs), read_only=True)
        with self._lock:  # after a move or a spend session in hand, as sessions in this process are
            request = {"op": "query", "path": self.path, "work": work, "args": args, "kwargs": kwargs}
            return self._in_child(request)  # type: ignore[no-any-return]

    def flush(self, wal: WriteAheadLog | None = None) -> int:
        """Move rows from the log into the file: ``wal``'s closed segments, then what dead writers left.

        Blocking (a worker thread). ``wal`` is rotated first, so everything appended before the
        call is included. A dead writer's rows (and a row for each request it left in flight)
        are inserted with de-duplication, then its files are removed; so are the rows of an own
        segment whose earlier move failed part way (its rows may be in the file already).

        Returns:
            The number of rows inserted.

        Raises:
            LedgerBusy: another process holds the file; every segment stays for the next flush.
            LedgerError: the file cannot be opened, migrated or written (DuckDB's own errors are
                raised as this, so that the recorder's writer logs them and tries again).
        """
        if wal is not None:
            wal.rotate()
        with self._lock:  # one flush at a time in this process: each segment is taken once
            own = wal.closed_rows() if wal is not None else []
            writer = wal.writer_id if wal is not None else None
            if self.mover is None:
                from tokenward.reports.ledger.moves import move_segments

                moved = move_segments(
                    self.path, self.spool_dir, own, writer, self._unsure, migrate_schema=not self._migrated()
                )
            else:
                moved = self._move_in_child(own, writer)
            if own or moved:  # the file was opened read-write, so migrated
                self._migrated_file = _identity(self.path)
            return moved

    def _move_in_child(self, own: list[Path], writer: str | None) -> int:
        """:meth:`flush`'s move, done by the mover child (``self._lock`` held)."""
        assert self.mover is not None
        if not own and not _dead_waiting(self.spool_dir, writer):
            self.mover.retire_if_idle()
            return 0
        request = {
            "op": "move",
            "path": self.path,
            "spool_dir": str(self.spool_dir),
            "own": [str(p) for p in own],
            "writer": writer,
            "unsure": [str(p) for p in self._unsure],
            "migrate": not self._migrated(),
        }
        self._unsure.update(own)  # a child killed mid-move may have committed any of them
        kind, value, unsure = self.mover.call(request)  # MoverDied: they all stay unsure
        self._unsure = {Path(p) for p in unsure}
        return _answer(kind, value)

    def waiting_segments(self, wal: WriteAheadLog | None = None) -> int:
        """Log files waiting to go into the ledger: ``wal``'s closed rows files and dead writers' files."""
        return spooled.waiting_segments(self.spool_dir, wal)

    def unflushed_rows(self, wal: WriteAheadLog | None = None) -> list[dict[str, Any]]:
        """Rows in the log that are not in the file yet: ``wal``'s and dead writers' (with their in-flight rows).

        What the budget books must count at start while a reader keeps the file from being
        written. Rows a dead writer had inserted already (it died before its cleanup) are left
        out when the file can be read.
        """
        return spooled.unflushed_rows(
            self.spool_dir, wal, lambda ids: self.read_spend(lambda spend: spend.present(ids))
        )


def _answer(kind: str, value: Any) -> Any:
    """A mover reply's value, or its error raised (``busy``: :class:`LedgerBusy`, else :class:`LedgerError`)."""
    if kind == "ok":
        return value
    raise (LedgerBusy if kind == "busy" else LedgerError)(value)


def _dead_waiting(spool_dir: Path, own: str | None) -> bool:
    """Whether a dead writer left files in ``spool_dir`` (their locks are taken and given back at once)."""
    dead = dead_writers(spool_dir, own=own)
    for writer in dead:
        writer.release()
    return bool(dead)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def write_rows(path: str | Path, rows: Iterable[Mapping[str, Any]], *, dedupe: bool = False) -> int:
    """Insert ``rows`` (dicts keyed by :data:`ROW_COLUMNS`) into the ledger at ``path`` at once.

    For tools and tests that seed a ledger; the proxy writes through its log instead. With
    ``dedupe``, rows whose ``request_id`` is present already are skipped.

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
    from tokenward.reports.ledger.duck import insert_lines, open_ledger

    try:
        conn = open_ledger(path)
        try:
            return insert_lines(
                conn, [Path(name)], dedupe=dedupe, quarantine=directory / "quarantine.jsonl", scratch=directory
            )
        finally:
            conn.close()
    finally:
        os.unlink(name)
