"""The one interface the proxy and the CLI reach storage through, whatever the engine.

Design note. Every engine keeps the same things: the ``requests`` rows (fed from the
write-ahead log of each proxy process), the control-plane state (:class:`StateStore`), and the
budget books (:class:`~tokenward.reports.ledger.books.BookStore`). Reports are written once, in
DuckDB's SQL (:mod:`tokenward.reports.queries`): a :meth:`Ledger.session` hands them a DuckDB
connection on which ``requests`` holds the ledger's rows: the file itself for DuckDB, a local
DuckDB copy kept in step with the server for Postgres
(:mod:`~tokenward.reports.ledger.mirror`). Budget evaluation reads through
:meth:`Ledger.read_spend`, which each engine answers in its own SQL.

Implementations: :class:`~tokenward.reports.ledger.DuckLedger` (one file, the default) and
:class:`~tokenward.reports.ledger.postgres.PgLedger` (several replicas). :func:`open_ledger_for`
in :mod:`~tokenward.reports.ledger.factory` picks one from the configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import duckdb

    from tokenward.reports.ledger.spend import SpendSource
    from tokenward.reports.ledger.state import StateStore
    from tokenward.reports.ledger.wal import WriteAheadLog

__all__ = ["Ledger"]

T = TypeVar("T")


class Ledger(Protocol):
    """A ledger: its rows, its state store, and where its write-ahead log lives.

    ``engine`` is ``"duckdb"`` or ``"postgres"``; ``shared`` says whether several proxy
    processes may serve it at once (their budget books then live in the engine).
    """

    engine: str
    shared: bool
    spool_dir: Path
    state: StateStore

    @property
    def name(self) -> str:
        """What to call the ledger in messages (a file path, or a URL without its password)."""
        ...

    @property
    def quarantine(self) -> Path:
        """Where rows the engine refuses are kept, one JSON line each with the reason."""
        ...

    def session(self, work: Callable[[duckdb.DuckDBPyConnection], T], *, read_only: bool = False) -> T:
        """Run ``work`` on a DuckDB connection whose ``requests`` holds the ledger (blocking).

        Raises:
            LedgerBusy: the engine is held by another process (DuckDB); retry later.
            LedgerError: the ledger cannot be opened.
        """
        ...

    def query(self, work: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``work(conn, *args, **kwargs)`` on a read-only connection like :meth:`session`'s (blocking).

        Where it runs is the engine's choice: a serving proxy's DuckDB ledger runs it in its mover
        child, so ``work`` must be a module-level function and its arguments and result picklable.

        Raises:
            LedgerBusy: as :meth:`session`.
            LedgerError: the ledger cannot be read (or ``work`` failed in the mover child).
        """
        ...

    def connect(self, *, read_only: bool, wait_s: float = 0.0) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection like :meth:`session`'s, for the caller to close (the CLI's reports).

        Raises:
            LedgerBusy: still held by another process after ``wait_s`` seconds.
            LedgerError: missing (``read_only``), unreadable, or an older schema.
        """
        ...

    def read_spend(self, work: Callable[[SpendSource], T]) -> T:
        """Run ``work`` on the ledger's spend figures for budget evaluation (blocking).

        Raises:
            LedgerBusy: as :meth:`session`.
            LedgerError: the ledger cannot be read.
        """
        ...

    def migrate(self) -> list[str]:
        """Create the ledger or bring its schema up to date; the names of the migrations applied.

        Raises:
            LedgerError: the ledger cannot be opened or written.
        """
        ...

    def flush(self, wal: WriteAheadLog | None = None) -> int:
        """Move the log's closed segments (``wal``'s, then dead writers') into the ledger; rows inserted.

        Raises:
            LedgerBusy: the engine is held; every segment waits for the next flush.
            LedgerError: the engine cannot be written.
        """
        ...

    def waiting_segments(self, wal: WriteAheadLog | None = None) -> int:
        """Log files waiting to go into the ledger."""
        ...

    def unflushed_rows(self, wal: WriteAheadLog | None = None) -> list[dict[str, Any]]:
        """Rows in the log that are not in the ledger yet (the budget books count them at start)."""
        ...

    def write_rows(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Insert ``rows`` (dicts keyed by ``ROW_COLUMNS``) at once, skipping request ids already present.

        Raises:
            LedgerBusy: the engine is held.
            LedgerError: the ledger cannot be written.
        """
        ...

    def apply_prices(self, conn: duckdb.DuckDBPyConnection, updates: list[dict[str, Any]]) -> None:
        """Store re-priced cost columns (``tokenward pricing reprice``) for ``updates``' request ids.

        ``conn`` is the connection the rows were read on (from :meth:`connect`).
        """
        ...
