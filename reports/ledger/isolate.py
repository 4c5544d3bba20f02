"""Finding the rows an engine refuses in a batch, so that only they are set aside.

Engine-neutral: each engine inserts a batch of log lines in one transaction and raises one of
its "this value is refused" errors when a line cannot go in. :func:`insert_isolating` retries a
refused batch in halves until the refused lines stand alone, and appends each of them to the
quarantine file with the reason; every other line is inserted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

__all__ = ["insert_isolating", "quarantine_line"]

log = logging.getLogger("tokenward.ledger")


def insert_isolating(
    lines: list[bytes],
    insert: Callable[[list[bytes]], int],
    refused: tuple[type[BaseException], ...],
    quarantine: Path,
) -> int:
    """Insert ``lines`` with ``insert``, halving any group it refuses (``refused`` errors).

    Returns:
        The number of rows inserted.

    Raises:
        Whatever ``insert`` raises that is not in ``refused`` (the engine itself failed).
    """
    if not lines:
        return 0
    try:
        return insert(lines)
    except refused as exc:
        if len(lines) == 1:
            quarantine_line(quarantine, lines[0], str(exc))
            return 0
    middle = len(lines) // 2
    return insert_isolating(lines[:middle], insert, refused, quarantine) + insert_isolating(
        lines[middle:], insert, refused, quarantine
    )


def quarantine_line(path: Path, line: bytes, reason: str) -> None:
    """Append one refused log line to the quarantine file ``path``, with the reason and the time."""
    record = msgspec.json.encode({"reason": reason[:500], "at": time.time(), "line": line.decode("utf-8", "replace")})
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as out:
        out.write(record + b"\n")
    log.error("quarantined one ledger row in %s: %s", path, reason[:200])
