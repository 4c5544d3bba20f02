"""The DuckDB work of a proxy: migrating the file, moving log segments into it, the one-time state import.

What :class:`~tokenward.reports.ledger.DuckLedger` runs, in this process (the CLI, tests) or in
its mover child (:mod:`~tokenward.reports.ledger.mover`, a serving proxy): every function takes
plain paths and returns plain values, so either process can run it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from tokenward.reports.ledger.deferred import apply_to_duck
from tokenward.reports.ledger.duck import insert_lines, open_ledger
from tokenward.reports.ledger.errors import LedgerBusy, LedgerError
from tokenward.reports.ledger.state import SqliteState
from tokenward.reports.ledger.wal import dead_writers

if TYPE_CHECKING:
    from tokenward.reports.ledger.imported import Imported

__all__ = ["import_legacy", "migrate_file", "move_segments"]

log = logging.getLogger("tokenward.ledger")


MOVE_MEMORY_LIMIT = "64MB"
"""DuckDB's ``memory_limit`` during a move: the checkpoint at its close then flushes what it holds.

Without it the checkpoint that rewrites a nearly full row group (122,880 rows) raised the
mover's RSS by up to 143 MB for 9,000 rows moved (+117 MB in the checkpoint alone); with it by
74 (``bench/profile_tokenward.py moves``, 16 moves of 9,000 rows: median +35 -> +31 MB, CPU per move
within noise). 40 MB makes the inserts fail; a move that runs out of memory under the cap is
done again without it (:func:`move_segments`), so the cap never leaves rows waiting."""


def move_segments(
    path: str,
    spool_dir: Path,
    own: Sequence[Path],
    writer_id: str | None,
    unsure: set[Path],
    *,
    migrate_schema: bool,
    memory_limit: str | None = MOVE_MEMORY_LIMIT,
) -> int:
    """Insert ``own`` (a writer's closed rows files, oldest first), then what dead writers left; rows inserted.

    DuckDB's memory is held to ``memory_limit`` (:data:`MOVE_MEMORY_LIMIT`; ``None``: DuckDB's
    default, 80 % of the machine); a move that runs out of memory under it is logged and done
    again without it: the segments it had inserted and removed stay done, the one it was
    inserting is in ``unsure`` (so de-duplicated), the rest follow.

    Each file inserted is removed. ``unsure`` (changed in place) holds own files whose move failed
    part way: their rows may be in the file already, so they are inserted with de-duplication;
    a file is added before its insert and taken out once it is removed, so whatever stops this
    call (an error, a kill) leaves the file it was working on there. Dead writers' rows are always
    de-duplicated. ``writer_id`` is the live writer whose files these are (never recovered).

    Raises:
        LedgerBusy: another process holds the file; every segment stays for the next move.
        LedgerError: the file cannot be opened, migrated or written (rows wait in the log).
    """
    moved = [0]
    try:
        return _move(path, spool_dir, own, writer_id, unsure, migrate_schema, memory_limit, moved)
    except LedgerError as exc:
        if memory_limit is None or not isinstance(exc.__cause__, duckdb.OutOfMemoryException):
            raise
        log.warning("a move needed more than %s of DuckDB memory; moving again without that cap: %s", memory_limit, exc)
        left = [segment for segment in own if segment.exists()]
        return moved[0] + _move(path, spool_dir, left, writer_id, unsure, False, None, [0])


def _move(path: str, spool_dir: Path, own: Sequence[Path], writer_id: str | None, *args: Any) -> int:
    """:func:`move_segments` once; ``args``: ``unsure``, ``migrate_schema``, ``memory_limit`` and ``moved``.

    ``moved[0]`` counts the rows inserted as it goes (what a move that fails part way did).
    """
    unsure: set[Path]
    migrate_schema: bool
    memory_limit: str | None
    moved: list[int]
    unsure, migrate_schema, memory_limit, moved = args
    dead = dead_writers(spool_dir, own=writer_id)
    quarantine = spool_dir / "quarantine.jsonl"
    try:
        if not own and not dead:
            return 0
        conn = open_ledger(path, migrate_schema=migrate_schema)
        try:
            # One DuckDB thread: a move is a few appends and a checkpoint beside the event loop; a
            # second thread took ~10% more CPU and a few MB more at the peak (profile_tokenward.py moves).
            conn.execute("SET threads = 1")
            if memory_limit is not None:
                conn.execute(f"SET memory_limit = '{memory_limit}'")
            inserted = 0
            for segment in own:  # one statement per segment: read_json holds one segment at a time
                # A move that failed may have put the segment's rows in the file all the same (a
                # COMMIT can fail after it was durable, in the checkpoint it starts; the removal can
                # fail after the insert): such a segment is moved again with de-duplication.
                dedupe = segment in unsure
                unsure.add(segment)
                inserted += insert_lines(conn, [segment], dedupe=dedupe, quarantine=quarantine, scratch=spool_dir)
                moved[0] = inserted
                segment.unlink()
                unsure.discard(segment)
            for writer in dead:
                recovered = writer.recovered_file()
                inserted += insert_lines(conn, [recovered], dedupe=True, quarantine=quarantine, scratch=spool_dir)
                moved[0] = inserted
                writer.remove()
                log.info("recovered the log of a stopped writer (%s)", writer.writer_id)
            apply_to_duck(conn, SqliteState(path + ".state.sqlite"))  # background responses settled since
            return inserted
        finally:
            conn.close()
    except duckdb.Error as exc:  # the file itself failed (a full disk at the COMMIT): rows wait in the log
        raise LedgerError(f"cannot write ledger {path}: {exc}") from exc
    finally:
        for writer in dead:
            writer.release()


def migrate_file(path: str, wait_s: float) -> list[str]:
    """Apply pending migrations to the file at ``path`` (created if missing); the migrations applied.

    While a reader (``tokenward report``, ``top``, a notebook) holds the file, a file whose schema
    is current needs nothing: ``[]`` at once. Only a file that needs a migration waits up to
    ``wait_s`` seconds for the reader to let go.

    Raises:
        LedgerBusy: the file needs migrations and stayed held for ``wait_s`` seconds.
        LedgerError: the file cannot be opened or migrated.
    """
    from tokenward.reports.ledger import migrations

    deadline = time.monotonic() + wait_s
    while True:
        try:
            conn = open_ledger(path, migrate_schema=False)
            break
        except LedgerBusy:
            if _schema_current(path):
                return []
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
    try:
        return migrations.migrate(conn)
    finally:
        conn.close()


def _schema_current(path: str) -> bool:
    """Whether the file opens read-only with no migration pending (a reader may hold it meanwhile)."""
    try:
        open_ledger(path, read_only=True).close()
    except LedgerError:
        return False
    return True


def import_legacy(path: str, state_path: str) -> Imported:
    """Copy an earlier version's keys and alert claims from the file into the state store; how many of each.

    Raises:
        LedgerError: the file cannot be read now (another process writes it, say).
    """
    from tokenward.reports.ledger.legacy import import_legacy_state
    from tokenward.reports.ledger.state import SqliteState

    conn = open_ledger(path, read_only=True)
    try:
        return import_legacy_state(conn, SqliteState(state_path))
    finally:
        conn.close()
