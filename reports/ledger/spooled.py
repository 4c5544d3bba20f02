"""What every engine reads from a spool directory: segments waiting, and rows not yet in the ledger."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenward.reports.ledger.errors import LedgerError
from tokenward.reports.ledger.wal import WriteAheadLog, dead_writers, read_rows, typed_row

__all__ = ["unflushed_rows", "waiting_segments"]


def waiting_segments(spool_dir: Path, wal: WriteAheadLog | None) -> int:
    """Log files in ``spool_dir`` waiting to go into the ledger: ``wal``'s closed rows files and dead writers'."""
    if not spool_dir.exists():
        return 0
    own = wal.writer_id if wal is not None else None
    count = 0
    for path in spool_dir.iterdir():
        name = path.name
        if name.endswith(".rows.jsonl") and not name.startswith(f"{own}-"):
            count += 1
        elif name.endswith((".jsonl", ".part")) and name[:1].isdigit():
            count += 1
    return count + (len(wal.closed_rows()) if wal is not None else 0)


def unflushed_rows(
    spool_dir: Path, wal: WriteAheadLog | None, present: Callable[[list[str]], set[str]]
) -> list[dict[str, Any]]:
    """Rows in the log that are not in the ledger yet: ``wal``'s and dead writers' (with their in-flight rows).

    Money columns are ``Decimal`` (:func:`~tokenward.reports.ledger.wal.typed_row`): the budget
    books count them. ``present`` says which request ids the ledger holds already (rows a dead writer had inserted
    before it died are left out); when it raises :class:`LedgerError` nothing is left out.
    """
    rows: list[dict[str, Any]] = []
    if wal is not None:
        for path in wal.closed_rows():
            rows += read_rows(path)
    dead = dead_writers(spool_dir, own=wal.writer_id if wal is not None else None)
    try:
        recovered = [row for writer in dead for row in writer.rows()]
    finally:
        for writer in dead:
            writer.release()
    if recovered:
        ids = [str(row.get("request_id")) for row in recovered]
        try:
            found = present(ids)
        except LedgerError:
            found = set()
        rows += [row for row in recovered if row.get("request_id") not in found]
    return [typed_row(row) for row in rows]
