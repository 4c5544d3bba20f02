"""The write-ahead log: each request's row is on disk before the client hears the end of its reply.

Design note. A proxy process is one *writer*. It appends JSON lines to two files of its current
*segment* in ``<ledger>.spool/``:

* ``<writer>-<seq>.rows.jsonl``: finished rows, one JSON object per line keyed by
  :data:`~tokenward.reports.ledger.schema.ROW_COLUMNS` (what an engine bulk-inserts);
* ``<writer>-<seq>.adm.jsonl``: *admissions*, one per request still in flight. An admission
  is the row the request should get if the process died now: ``interrupted`` and not billed
  while tokenward has not forwarded it, ``usage_unknown`` with its budget reservation once it
  has. A later admission for the same request supersedes the earlier one; a row ends it.

Appends are group-committed by one thread (:class:`WriteAheadLog`): callers on the event loop
hand over bytes and await the batch, which the thread writes as soon as the previous batch is
done, so batches are a write apart, not a timer apart. ``write()`` to the page cache survives
SIGKILL; ``fsync`` (power loss) is optional. Each flush rotates the segment: the closed rows
file goes to the engine, the next admissions file starts with the admissions still open.

A writer holds an ``flock`` on ``<writer>.lock`` while it lives. Another process that can take
that lock knows the writer is gone (whatever its PID became) and recovers its files
(:func:`dead_writers`): every row, plus the admission row of every request that has none, all
inserted with de-duplication by ``request_id``, so recovering twice, or after a crash between an
insert and the cleanup, never makes a second row.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from tokenward.reports.ledger.schema import ROW_COLUMNS

__all__ = ["DeadWriter", "WriteAheadLog", "copy_row", "dead_writers", "encode_row", "fill_row", "read_rows"]

log = logging.getLogger("tokenward.ledger")

_encoder = msgspec.json.Encoder(decimal_format="string")
_decoder = msgspec.json.Decoder(dict[str, Any])
_ROWS = ".rows.jsonl"
_ADMISSIONS = ".adm.jsonl"
_TOKEN_COLUMNS = tuple(name for name, kind in ROW_COLUMNS.items() if kind == "BIGINT")
_DEFAULTS: dict[str, Any] = {name: None for name in ROW_COLUMNS} | dict.fromkeys(_TOKEN_COLUMNS, 0)
_DEFAULTS |= {"stream": False, "usage_source": "none", "row_kind": "request", "principal": "anonymous"}


def encode_row(row: dict[str, Any]) -> bytes:
    """One row as a log line (JSON, decimals as exact strings, newline-terminated)."""
    return _encoder.encode(row) + b"\n"


def fill_row(partial: dict[str, Any]) -> dict[str, Any]:
    """A complete row from the columns an admission record names (others NULL, counts 0)."""
    row = dict(_DEFAULTS)
    row.update(partial)
    if row.get("ended_at") is None:
        row["ended_at"] = row.get("started_at")
    return row


def copy_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row as a ledger returns it (``export_rows``: datetimes, JSON text) in the log's form (epoch seconds, JSON).

    What ``tokenward ledger copy`` hands the target ledger's ``write_rows``.
    """
    out = dict(row)
    for name in ("started_at", "ended_at"):
        value = out.get(name)
        if value is not None and not isinstance(value, int | float):
            out[name] = value.timestamp()
    for name, kind in ROW_COLUMNS.items():
        value = out.get(name)
        if kind == "JSON" and isinstance(value, str):
            out[name] = msgspec.json.decode(value)
    return out


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a log file, one per line; a torn last line (a crash mid-write) is skipped."""
    rows = []
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            rows.append(_decoder.decode(line))
        except msgspec.DecodeError:
            log.warning("skipping an unreadable line in %s (a write cut short by a crash)", path)
    return rows


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class WriteAheadLog:
    """One process's log: admissions and rows, appended in group-committed batches by one thread.

    Call :meth:`admit`, :meth:`forward` and :meth:`commit` on the event loop given to
    :meth:`open`; :meth:`rotate` from a worker thread.

    Args:
        directory: the spool directory (created if missing).
        fsync: ``fsync`` every batch (survives power loss, not just a crash; costs latency).
    """

    def __init__(self, directory: Path, *, fsync: bool = False) -> None:
        self.directory = directory
        self.writer_id = f"w{time.time_ns():x}{secrets.token_hex(3)}"
        self._fsync = fsync
        self._seq = 0
        self._cond = threading.Condition()
        self._rows: list[bytes] = []
        self._admissions: list[bytes] = []
        self._open: dict[str, bytes] = {}
        self._batch: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rotate_asked = 0
        self._rotated = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self._lock_fd = -1
        self._rows_fd = -1
        self._adm_fd = -1
        self.failing: str | None = None
        """The last write error while writes fail (a full disk, say); ``None`` when they succeed."""

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Create the directory, take this writer's lock, open the first segment, start the thread.

        Raises:
            OSError: the directory or files cannot be created.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self._loop = loop
        # locked under a temporary name first: nobody can see the lock file unlocked
        staging = self.directory / f".{self.writer_id}.lock.new"
        self._lock_fd = os.open(staging, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())
        staging.replace(self.directory / f"{self.writer_id}.lock")
        self._open_segment()
        self._thread = threading.Thread(target=self._run, name="tokenward-wal", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Write what is pending, stop the thread, close the files and release the lock (blocking).

        The segments stay on disk for the engine to ingest (this process, or the next one).
        """
        if self._thread is None:
            return
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        self._thread = None
        for fd in (self._rows_fd, self._adm_fd):
            os.close(fd)
        if not self._open:
            self._segment(self._seq, _ADMISSIONS).unlink(missing_ok=True)
        os.close(self._lock_fd)  # releases the flock: the files are now recoverable by anyone
        (self.directory / f"{self.writer_id}.lock").unlink(missing_ok=True)

    # -- appends (event loop) ----------------------------------------------------------------

    def admit(self, request_id: str, row: dict[str, Any]) -> None:
        """Note that ``request_id`` is in flight; ``row`` is its row if the process dies now.

        Not awaited: the admission is written with the next batch.
        """
        line = _encoder.encode({"t": "A", "row": row}) + b"\n"
        with self._cond:
            self._open[request_id] = line
            self._admissions.append(line)
            self._cond.notify()

    def forward(self, request_id: str, row: dict[str, Any]) -> asyncio.Future[None]:
        """Like :meth:`admit` (superseding it); await the result before the request leaves for the upstream."""
        line = _encoder.encode({"t": "A", "row": row}) + b"\n"
        with self._cond:
            self._open[request_id] = line
            self._admissions.append(line)
            return self._pending_batch()

    def commit(self, request_ids: list[str], data: bytes) -> asyncio.Future[None]:
        """Append finished rows (:func:`encode_row` lines) ending ``request_ids``; await the result for durability.

        The future fails with ``OSError`` when the write failed; the rows stay queued and are
        written again with the next batch.
        """
        with self._cond:
            for request_id in request_ids:
                self._open.pop(request_id, None)
            self._rows.append(data)
            return self._pending_batch()

    def _pending_batch(self) -> asyncio.Future[None]:
        batch = self._batch
        if batch is None:
            assert self._loop is not None, "WriteAheadLog.open() was not called"
            batch = self._batch = self._loop.create_future()
        self._cond.notify()
        return batch

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet ended by a row."""
        return len(self._open)

    @property
    def queued(self) -> int:
        """Row batches handed over and not yet written (more than a few only while writes fail)."""
        return len(self._rows)

    # -- rotation (worker thread) ------------------------------------------------------------

    def rotate(self) -> list[Path]:
        """Close the current segment and start the next (blocking: call from a worker thread).

        Returns:
            This writer's closed rows files, oldest first (ready for the engine; remove each once
            its rows are in the ledger).
        """
        with self._cond:
            if self._thread is not None and not self._closing:
                self._rotate_asked += 1
                wanted = self._rotate_asked
                self._cond.notify()
                while self._rotated < wanted and self._thread is not None:
                    self._cond.wait(1.0)
        return self.closed_rows()

    def closed_rows(self) -> list[Path]:
        """The rows files of this writer's segments before the current one (empty ones removed)."""
        found = []
        for seq in range(0, self._seq):
            path = self._segment(seq, _ROWS)
            if path.exists():
                if path.stat().st_size == 0:
                    path.unlink()
                else:
                    found.append(path)
        if self._thread is None:  # closed: the last segment is done too
            last = self._segment(self._seq, _ROWS)
            if last.exists():
                found.append(last) if last.stat().st_size else last.unlink()
        return found

    # -- the writer thread -------------------------------------------------------------------

    def _segment(self, seq: int, suffix: str) -> Path:
        return self.directory / f"{self.writer_id}-{seq:08d}{suffix}"

    def _open_segment(self) -> None:
        flags = os.O_CREAT | os.O_WRONLY | os.O_APPEND
        self._rows_fd = os.open(self._segment(self._seq, _ROWS), flags, 0o644)
        self._adm_fd = os.open(self._segment(self._seq, _ADMISSIONS), flags, 0o644)

    def _rotate_now(self) -> None:
        os.close(self._rows_fd)
        os.close(self._adm_fd)
        previous = self._seq
        self._seq += 1
        self._open_segment()
        with self._cond:
            carried = b"".join(self._open.values())
        if carried:
            _write_all(self._adm_fd, carried)
        self._segment(previous, _ADMISSIONS).unlink(missing_ok=True)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._rows or self._admissions or self._closing or self._rotate_asked > self._rotated):
                    self._cond.wait()
                rows, self._rows = self._rows, []
                admissions, self._admissions = self._admissions, []
                batch, self._batch = self._batch, None
                rotate = self._rotate_asked
                closing = self._closing
            error: OSError | None = None
            try:
                if admissions:
                    _write_all(self._adm_fd, b"".join(admissions))
                if rows:
                    _write_all(self._rows_fd, b"".join(rows))
                if self._fsync and (rows or admissions):
                    os.fsync(self._rows_fd)
                    os.fsync(self._adm_fd)
                if self.failing is not None:
                    log.warning("write-ahead log writable again")
                self.failing = None
            except OSError as exc:
                error = exc
                if self.failing is None:
                    log.error("cannot write the write-ahead log in %s: %s; retrying", self.directory, exc)
                self.failing = str(exc)
                with self._cond:  # keep them for the next batch, in order
                    self._rows[:0] = rows
                    self._admissions[:0] = admissions
            if batch is not None and self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(_settle, batch, error)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    pass
            if error is not None:
                time.sleep(0.2)
                if not closing:
                    continue
            if rotate > self._rotated and error is None:
                try:
                    self._rotate_now()
                except OSError as exc:
                    log.error("cannot rotate the write-ahead log: %s", exc)
                with self._cond:
                    self._rotated = rotate
                    self._cond.notify_all()
            if closing:
                with self._cond:
                    if not (self._rows or self._admissions) or error is not None:
                        self._rotated = self._rotate_asked
                        self._cond.notify_all()
                        return


def _settle(future: asyncio.Future[None], error: OSError | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
        future.exception()  # retrieved here: a caller that stopped waiting must not cause a warning


@dataclass
class DeadWriter:
    """The files of a writer whose process is gone; its lock is held by this process until :meth:`release`."""

    directory: Path
    writer_id: str
    lock_fd: int
    rows_files: list[Path] = field(default_factory=list)
    admission_files: list[Path] = field(default_factory=list)

    def rows(self) -> list[dict[str, Any]]:
        """Every row it wrote, then a row for each request it admitted and never ended."""
        rows: dict[str, dict[str, Any]] = {}
        for path in self.rows_files:
            for row in read_rows(path):
                rows.setdefault(str(row.get("request_id")), row)
        open_rows: dict[str, dict[str, Any]] = {}
        for path in self.admission_files:
            for record in read_rows(path):
                row = record.get("row")
                if isinstance(row, dict) and str(row.get("request_id")) not in rows:
                    open_rows[str(row.get("request_id"))] = fill_row(row)
        return list(rows.values()) + list(open_rows.values())

    def recovered_file(self) -> Path:
        """Write :meth:`rows` to one rows file (replacing an earlier attempt's) and return it."""
        path = self.directory / f"{self.writer_id}-recovered{_ROWS}"
        partial = path.with_suffix(".tmp")
        partial.write_bytes(b"".join(encode_row(row) for row in self.rows()))
        partial.replace(path)
        return path

    def remove(self) -> None:
        """Delete its files (once its rows are in the ledger) and release its lock."""
        for path in [*self.rows_files, *self.admission_files, self.directory / f"{self.writer_id}-recovered{_ROWS}"]:
            path.unlink(missing_ok=True)
        (self.directory / f"{self.writer_id}.lock").unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        """Give its lock back without removing anything (another process may recover it later)."""
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def dead_writers(directory: Path, *, own: str | None = None) -> list[DeadWriter]:
    """The writers in ``directory`` whose lock nobody holds, each now locked by this process.

    The caller must :meth:`~DeadWriter.remove` (once recovered) or :meth:`~DeadWriter.release`
    each. Files of the spool format before the write-ahead log (``<ns>-<pid>-<seq>.jsonl`` and
    ``.part``) come as one writer named ``legacy``.
    """
    if not directory.exists():
        return []
    by_writer: dict[str, DeadWriter] = {}
    legacy: list[Path] = []
    for path in sorted(directory.iterdir()):
        name = path.name
        if name.endswith(f"-recovered{_ROWS}"):
            writer = name.split("-", 1)[0]  # an unfinished recovery: made again from the files
            if writer != own:
                by_writer.setdefault(writer, DeadWriter(directory, writer, -1))
        elif name.endswith((_ROWS, _ADMISSIONS)):
            writer = name.split("-", 1)[0]
            if writer == own:
                continue
            entry = by_writer.setdefault(writer, DeadWriter(directory, writer, -1))
            (entry.rows_files if name.endswith(_ROWS) else entry.admission_files).append(path)
        elif name.endswith((".jsonl", ".part")) and name[:1].isdigit():
            legacy.append(path)
        elif name.endswith(".lock") and not name.startswith(".") and name[:-5] != own:
            by_writer.setdefault(name[:-5], DeadWriter(directory, name[:-5], -1))
    found = []
    for writer, entry in by_writer.items():
        try:
            fd = os.open(directory / f"{writer}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # alive
        entry.lock_fd = fd
        found.append(entry)
    if legacy:
        found.append(DeadWriter(directory, "legacy", -1, rows_files=legacy))
    return found
