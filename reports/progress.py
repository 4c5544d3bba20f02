"""Progress for long report queries, on the terminal only.

DuckDB reports how far a running query has got (``query_progress``); while a query runs longer
than half a second, a thread polls it and rich draws a transient bar on stderr. Nothing is drawn
when stderr is not a terminal (pipes, CI, tests).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

__all__ = ["report", "shown"]

_DELAY_S = 0.5
_current: tuple[Progress, TaskID] | None = None


@contextlib.contextmanager
def shown(conn: Any) -> Iterator[None]:
    """Show the progress of the queries ``conn`` runs inside this block (when stderr is a TTY)."""
    global _current
    if not sys.stderr.isatty():
        yield
        return
    bar = Progress(
        TextColumn("querying the ledger"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        transient=True,
        console=None,
    )
    task = bar.add_task("query", total=100)
    done = threading.Event()

    def poll() -> None:
        if done.wait(_DELAY_S):
            return
        bar.start()
        while not done.wait(0.1):
            with contextlib.suppress(Exception):
                value = conn.query_progress()
                if value >= 0:
                    bar.update(task, completed=value)
        bar.stop()

    watcher = threading.Thread(target=poll, daemon=True)
    _current = (bar, task)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        _current = None


def report(done: int, total: int) -> None:
    """Progress of work done in Python (rows priced one by one) inside :func:`shown`."""
    if _current is not None and total:
        bar, task = _current
        bar.update(task, completed=done * 100 / total)
