"""The write-ahead log: each request's row is on disk before the client hears the end of its reply.

Design note. A proxy process is one *writer*. It appends JSON lines to two files of its current
*segment* in ``<ledger>.spool/``:

* ``<writer>-<seq>.rows.jsonl``: finished rows, one JSON object per line keyed by
  :data:`~tokenward.reports.ledger.schema.ROW_COLUMNS` (what an engine bulk-inserts);
* ``<writer>-<seq>.adm.jsonl``: *admissions*, one per request still in flight. An admission
  is the row the request should get if the process died now: ``interrupted`` and not billed
  while tokenward has not forwarded it, ``usage_unknown`` with its budget reservation once it
  has. A later admission for the same request supersedes the earlier one; a row ends it.

Appends are written by the event loop itself, each ``write()`` done before the call returns
(admissions, which nobody awaits, at the end of the loop's turn). ``write()`` to the page cache
survives SIGKILL; ``fsync`` (power loss) is optional and group-committed by a thread. Each flush
rotates the segment: the closed rows file goes to the engine, the next admissions file starts
with the admissions still open.

A writer holds an ``flock`` on ``<writer>.lock`` while it lives. Another process that can take
that lock knows the writer is gone (whatever its PID became) and recovers its files
(:func:`dead_writers`): every row, plus the admission row of every request that has none, all
inserted with de-duplication by ``request_id``, so recovering twice, or after a crash between an
insert and the cleanup, never makes a second row.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from tokenward.reports.ledger.schema import ROW_COLUMNS

if TYPE_CHECKING:
    import asyncio  # annotations only: the mover child, which reads logs, never imports asyncio

__all__ = [
    "SEGMENT_BYTES",
    "DeadWriter",
    "WriteAheadLog",
    "copy_row",
    "dead_writers",
    "encode_row",
    "fill_row",
    "read_rows",
    "typed_row",
]

log = logging.getLogger("tokenward.ledger")

_encoder = msgspec.json.Encoder(decimal_format="string")
_decoder = msgspec.json.Decoder(dict[str, Any])
_ROWS = ".rows.jsonl"
_ADMISSIONS = ".adm.jsonl"
SEGMENT_BYTES = 1 << 20
"""A rows file this large starts the next segment at once (on the loop): the engine inserts one
segment per statement, so ``read_json``, which holds its whole input, holds at most one segment
(~750 rows), however many rows a move takes."""
_Admission = bytes | dict[str, Any] | Callable[[], dict[str, Any]]
_TOKEN_COLUMNS = tuple(name for name, kind in ROW_COLUMNS.items() if kind == "BIGINT")
_MONEY_COLUMNS = tuple(name for name, kind in ROW_COLUMNS.items() if kind.startswith("DECIMAL"))
_DEFAULTS: dict[str, Any] = {name: None for name in ROW_COLUMNS} | dict.fromkeys(_TOKEN_COLUMNS, 0)
_DEFAULTS |= {"stream": False, "usage_source": "none", "row_kind": "request", "principal": "anonymous"}


def encode_row(row: dict[str, Any]) -> bytes:
    """One row as a log line (JSON, decimals as exact strings, newline-terminated)."""
    return _encoded(row) + b"\n"


def _encoded(record: dict[str, Any]) -> bytes:
    r"""``record`` as JSON, every U+0000 in its texts written as the four characters ``\x00``.

    Postgres text and jsonb cannot hold U+0000 and refuse the row (it went to the quarantine
    file: a client's ``"user": "eve\u0000"`` took its spend out of every report); DuckDB could,
    and both engines must read a row alike. The check is one scan of the encoded line.
    """
    line = _encoder.encode(record)
    if b"\\u0000" in line:  # a NUL, or a text that spells "\u0000": the second is left as it is
        line = _encoder.encode(_without_nul(record))
    return line


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\\x00")
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_nul(item) for item in value]
    return value


def fill_row(partial: dict[str, Any]) -> dict[str, Any]:
    """A complete row from the columns an admission record names (others NULL, counts 0)."""
    row = dict(_DEFAULTS)
    row.update(partial)
    if row.get("ended_at") is None:
        row["ended_at"] = row.get("started_at")
    return row


def typed_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row read back from the log with its money as ``Decimal`` (the log holds exact decimal strings).

    What Python code counting a logged row needs (the budget books at start): a cost left a string
    is no amount (``Decimal + str`` raises). A value that is not a number is left as it is.
    """
    for name in _MONEY_COLUMNS:
        value = row.get(name)
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            try:
                row[name] = Decimal(value) if not isinstance(value, float) else Decimal(repr(value))
            except ArithmeticError:
                pass
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


class _ShortWrite(OSError):
    """A write that failed part way: ``unwritten`` is what did not reach the file (the rest did)."""

    def __init__(self, error: OSError, unwritten: bytes) -> None:
        super().__init__(error.errno, error.strerror, error.filename)
        self.unwritten = unwritten


def _unwritten(error: OSError, data: bytes) -> bytes:
    """What of ``data`` a failed :func:`_write_all` left unwritten (all of it unless it says)."""
    return error.unwritten if isinstance(error, _ShortWrite) else data


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``.

    Raises:
        _ShortWrite: a write failed (a full disk writes what fits, then fails); what reached the
            file stays there, so a retry must write only ``unwritten`` or it tears a line (a line
            cut short glued to its whole copy is unreadable) and doubles the lines before it.
    """
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError as exc:
            raise _ShortWrite(exc, bytes(view)) from exc
        view = view[written:]


class WriteAheadLog:
    """One process's log: admissions and rows appended by the event loop, each ``write()`` done before the call returns.

    Call :meth:`admit`, :meth:`forward` and :meth:`commit` on the event loop given to
    :meth:`open`; :meth:`rotate` from a worker thread (a lock keeps a rotation and an append
    apart).

    Why no writer thread: a ``write()`` of a few hundred bytes to the page cache costs a few
    microseconds and survives SIGKILL once it returns, while handing the bytes to a thread and
    awaiting it cost two thread hand-offs and a wake-up of the loop per request, tens of
    microseconds of CPU and ~0.2 ms of latency at low load (``bench/PROFILE.md``). Admissions
    (:meth:`admit`, not awaited) are written together at the end of the loop's turn, or with the
    next :meth:`forward` or :meth:`commit`, whichever comes first; one that a row ends in the same
    turn is never written. With ``fsync``, a thread flushes the files to the device after the
    writes, group-committed: every caller waiting when a flush starts is covered by it.

    Args:
        directory: the spool directory (created if missing).
        fsync: ``fsync`` after every write a caller awaits (survives power loss, not just a crash;
            costs latency).
    """

    def __init__(self, directory: Path, *, fsync: bool = False) -> None:
        self.directory = directory
        self.writer_id = f"w{time.time_ns():x}{secrets.token_hex(3)}"
        self._fsync = fsync
        self._seq = 0
        self._first_closed = 0  # no closed segment before this one is left on disk
        self._rows_bytes = 0  # written to the current rows file
        self._lock = threading.Lock()  # the files and queues: the loop's appends against rotate() and close()
        # request id -> its latest admission: a line, or (not written yet) the row or what makes it
        self._open: dict[str, _Admission] = {}
        self._unwritten: dict[str, _Admission] = {}  # admissions not written yet (the rest of this turn)
        self._adm_tail = b""  # the end of admission lines a failed write left unwritten (first next time)
        self._rotation_failing = False  # a rotation on the loop failed (logged once)
        self._rows: list[bytes] = []  # row lines not written yet (only while writes fail)
        self._scheduled = False  # a write of the admissions is due at the end of this turn
        self._retrying = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future[None] | None = None
        self._syncer: _Syncer | None = None
        self._closed = True
        self._lock_fd = -1
        self._rows_fd = -1
        self._adm_fd = -1
        self.failing: str | None = None
        """The last write error while writes fail (a full disk, say); ``None`` when they succeed."""

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Create the directory, take this writer's lock, open the first segment (and the fsync thread).

        Raises:
            OSError: the directory or files cannot be created.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self._loop = loop
        self._done = loop.create_future()
        self._done.set_result(None)
        # locked under a temporary name first: nobody can see the lock file unlocked
        staging = self.directory / f".{self.writer_id}.lock.new"
        self._lock_fd = os.open(staging, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())
        staging.replace(self.directory / f"{self.writer_id}.lock")
        self._open_segment()
        self._closed = False
        if self._fsync:
            self._syncer = _Syncer(self, loop)

    def close(self) -> None:
        """Write what is pending, close the files and release the lock (blocking; any thread).

        The segments stay on disk for the engine to ingest (this process, or the next one).
        """
        if self._closed:
            return
        if self._syncer is not None:
            self._syncer.stop()
            self._syncer = None
        with self._lock:
            self._write_pending()
            self._closed = True
            for fd in (self._rows_fd, self._adm_fd):
                if self._fsync:
                    _fsync_quietly(fd)
                os.close(fd)
            self._rows_fd = self._adm_fd = -1
            if not self._open:
                self._segment(self._seq, _ADMISSIONS).unlink(missing_ok=True)
        os.close(self._lock_fd)  # releases the flock: the files are now recoverable by anyone
        (self.directory / f"{self.writer_id}.lock").unlink(missing_ok=True)

    # -- appends (event loop) ----------------------------------------------------------------

    def admit(self, request_id: str, row: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
        """Note that ``request_id`` is in flight; ``row`` is its row if the process dies now.

        Not awaited: written at the end of this turn of the loop (or with the next forward or
        commit), unless a row ends the request first. ``row`` may be a function making it, called
        only if the admission is written (most are superseded by :meth:`forward` in the same turn).
        """
        with self._lock:
            self._open[request_id] = row
            self._unwritten[request_id] = row
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._write_admissions)

    def forward(self, request_id: str, row: dict[str, Any]) -> asyncio.Future[None]:
        """Like :meth:`admit` (superseding it), written now; await the result before the request goes upstream.

        The result is already done unless ``fsync`` is on; it fails with ``OSError`` when the
        write failed (the line stays queued and is written again).
        """
        line = _encoded({"t": "A", "row": row}) + b"\n"
        with self._lock:
            self._open[request_id] = line
            self._unwritten[request_id] = line
            return self._write_now()

    def commit(self, request_ids: list[str], data: bytes) -> asyncio.Future[None]:
        """Append finished rows (:func:`encode_row` lines) ending ``request_ids``, written now; await the result.

        The result is already done unless ``fsync`` is on; it fails with ``OSError`` when the
        write failed (the rows stay queued and are written again, first, with the next write).
        """
        with self._lock:
            for request_id in request_ids:
                self._open.pop(request_id, None)
                self._unwritten.pop(request_id, None)  # ended in the turn it arrived: no admission needed
            self._rows.append(data)
            return self._write_now()

    def _write_now(self) -> asyncio.Future[None]:
        """Write what is pending (the lock held); the future the caller awaits."""
        error = self._write_pending()
        if error is not None:
            self._retry_later()
            assert self._loop is not None
            failed = self._loop.create_future()
            failed.set_exception(error)
            return failed
        if self._syncer is not None:
            return self._syncer.request()
        assert self._done is not None, "WriteAheadLog.open() was not called"
        return self._done

    def _write_pending(self) -> OSError | None:
        """Write the queued admissions, then the queued rows (the lock held); the error, if a write failed."""
        if self._closed:
            return OSError("the write-ahead log is closed")
        try:
            if self._unwritten or self._adm_tail:
                data = self._adm_tail + b"".join(map(_admission_line, self._unwritten.values()))
                self._adm_tail = b""
                self._unwritten.clear()
                try:
                    _write_all(self._adm_fd, data)
                except OSError as exc:
                    self._adm_tail = _unwritten(exc, data)  # the lines partly written are finished first
                    raise
            if self._rows:
                data = b"".join(self._rows)
                self._rows.clear()
                try:
                    _write_all(self._rows_fd, data)
                except OSError as exc:
                    self._rows[:] = [_unwritten(exc, data)]  # what reached the file is not written again
                    self._rows_bytes += len(data) - len(self._rows[0])
                    raise
                self._rows_bytes += len(data)
                if self._rows_bytes >= SEGMENT_BYTES:
                    try:
                        self._rotate_now()
                    except OSError as exc:  # the rows are written: the segment grows until a rotation works
                        if not self._rotation_failing:
                            log.error("cannot start the next write-ahead segment: %s; the current one grows", exc)
                        self._rotation_failing = True
                    else:
                        self._rotation_failing = False
        except OSError as exc:
            if self.failing is None:
                log.error("cannot write the write-ahead log in %s: %s; retrying", self.directory, exc)
            self.failing = str(exc)
            return exc
        if self.failing is not None:
            log.warning("write-ahead log writable again")
            self.failing = None
        return None

    def _write_admissions(self) -> None:
        """End of the loop's turn: write the admissions of the requests still open."""
        self._scheduled = False
        with self._lock:
            if not self._unwritten:
                return
            error = self._write_pending()
        if error is not None:
            self._retry_later()

    def _retry_later(self) -> None:
        if self._retrying or self._loop is None or self._closed:
            return
        self._retrying = True

        def retry() -> None:
            self._retrying = False
            with self._lock:
                error = self._write_pending()  # also clears ``failing`` when a rotation wrote the queue meanwhile
            if error is not None:
                self._retry_later()

        try:
            self._loop.call_later(0.2, retry)
        except RuntimeError:  # the loop is closed: close() writes what it can
            self._retrying = False

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet ended by a row."""
        return len(self._open)

    @property
    def queued(self) -> int:
        """Row batches not written yet (only while writes fail)."""
        return len(self._rows)

    # -- rotation (worker thread) ------------------------------------------------------------

    def rotate(self) -> list[Path]:
        """Close the current segment and start the next (blocking: call from a worker thread).

        Returns:
            This writer's closed rows files, oldest first (ready for the engine; remove each once
            its rows are in the ledger).
        """
        with self._lock:
            if not self._closed:
                try:
                    self._rotate_now()
                except OSError as exc:
                    log.error("cannot rotate the write-ahead log: %s", exc)
        return self.closed_rows()

    def closed_rows(self) -> list[Path]:
        """The rows files of this writer's segments before the current one (empty ones removed)."""
        found = []
        current = self._seq  # segments before it are closed, whatever the loop rotates meanwhile
        first = current
        for seq in range(self._first_closed, current):
            path = self._segment(seq, _ROWS)
            try:  # the loop (``/healthz``) and a flush's thread both look: either may remove a file
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            if size == 0:
                path.unlink(missing_ok=True)
            else:
                found.append(path)
                first = min(first, seq)
        self._first_closed = first  # the engine removes what it inserts: the next look starts here
        if self._closed:  # closed: the last segment is done too
            last = self._segment(self._seq, _ROWS)
            if last.exists():
                found.append(last) if last.stat().st_size else last.unlink()
        return found

    def _segment(self, seq: int, suffix: str) -> Path:
        return self.directory / f"{self.writer_id}-{seq:08d}{suffix}"

    def _open_segment(self) -> None:
        flags = os.O_CREAT | os.O_WRONLY | os.O_APPEND
        self._rows_fd = os.open(self._segment(self._seq, _ROWS), flags, 0o644)
        self._adm_fd = os.open(self._segment(self._seq, _ADMISSIONS), flags, 0o644)

    def _rotate_now(self) -> None:
        """Close this segment, open the next with the open admissions carried over (the lock held).

        All or nothing: the next segment's files are opened and the open admissions written to
        them before this segment's are closed, so a failure (no descriptor, inode or space left)
        leaves the log writing this segment, and never on descriptors it closed (which the
        process may since have given to another file or a socket).

        Raises:
            OSError: the queued rows or the next segment could not be written (nothing changed).
        """
        if self._rows:  # queued rows belong to this segment
            data = b"".join(self._rows)
            self._rows.clear()
            try:
                _write_all(self._rows_fd, data)
            except OSError as exc:
                self._rows[:] = [_unwritten(exc, data)]
                raise
        previous = self._seq
        rows_path, adm_path = self._segment(previous + 1, _ROWS), self._segment(previous + 1, _ADMISSIONS)
        flags = os.O_CREAT | os.O_WRONLY | os.O_APPEND | os.O_TRUNC  # a failed attempt left nothing to keep
        rows_fd = adm_fd = -1
        try:
            rows_fd = os.open(rows_path, flags, 0o644)
            adm_fd = os.open(adm_path, flags, 0o644)
            carried = b"".join(map(_admission_line, self._open.values()))
            if carried:
                _write_all(adm_fd, carried)
            if self._fsync:
                os.fsync(adm_fd)  # the carried admissions are durable before the old file goes
                try:  # a caller may be waiting for a flush the syncer has not started
                    os.fsync(self._rows_fd)
                    os.fsync(self._adm_fd)
                except OSError as exc:
                    if self._syncer is not None:  # the pages may be gone: the next flush must not say durable
                        self._syncer.failed(exc)
                    raise
        except OSError:
            for fd in (rows_fd, adm_fd):
                if fd >= 0:
                    os.close(fd)
            rows_path.unlink(missing_ok=True)
            adm_path.unlink(missing_ok=True)
            raise
        os.close(self._rows_fd)
        os.close(self._adm_fd)
        self._rows_fd, self._adm_fd = rows_fd, adm_fd
        self._seq = previous + 1
        self._rows_bytes = 0
        self._unwritten.clear()  # every open admission is in ``carried``
        self._adm_tail = b""  # the end of a line of the old admissions file, which goes
        self._segment(previous, _ADMISSIONS).unlink(missing_ok=True)


def _admission_line(admission: _Admission) -> bytes:
    """An admission's log line (made now if it was kept as a row or as what makes one)."""
    if isinstance(admission, bytes):
        return admission
    row = admission() if callable(admission) else admission
    return _encoded({"t": "A", "row": row}) + b"\n"


def _fsync_quietly(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        log.error("cannot fsync the write-ahead log: %s", exc)


class _Syncer:
    """The ``fsync`` thread of a :class:`WriteAheadLog`: flushes its files to the device, group-committed.

    :meth:`request` (event loop) returns the future of the next flush; the thread takes every
    request waiting when it starts a flush, calls ``fsync`` on duplicates of the log's descriptors (so a
    rotation meanwhile cannot close them under it), then settles the future on the loop.
    """

    def __init__(self, wal: WriteAheadLog, loop: asyncio.AbstractEventLoop) -> None:
        self._wal = wal
        self._loop = loop
        self._cond = threading.Condition()
        self._batch: asyncio.Future[None] | None = None
        self._lost: OSError | None = None  # an fsync elsewhere (a rotation) failed: the next flush reports it
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tokenward-wal-fsync", daemon=True)
        self._thread.start()

    def request(self) -> asyncio.Future[None]:
        with self._cond:
            if self._batch is None:
                self._batch = self._loop.create_future()
                self._cond.notify()
            return self._batch

    def failed(self, error: OSError) -> None:
        """An ``fsync`` of the log's files failed outside this thread: fail the next flush's waiters with it.

        After a failed ``fsync`` the kernel may have dropped the pages it could not write, and a
        later ``fsync`` then succeeds: only the failure tells a waiter its write is not durable.
        """
        with self._cond:
            self._lost = error

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._batch is None and not self._stopping:
                    self._cond.wait()
                batch, self._batch = self._batch, None
                stopping = self._stopping
            if batch is not None:
                error: OSError | None = None
                fds: list[int] = []
                try:
                    with self._wal._lock:
                        for fd in (self._wal._rows_fd, self._wal._adm_fd):
                            if fd >= 0:
                                fds.append(os.dup(fd))
                    for fd in fds:
                        os.fsync(fd)
                except OSError as exc:  # no descriptor to dup, or the device failed
                    error = exc
                    log.error("cannot fsync the write-ahead log: %s", exc)
                finally:
                    for fd in fds:
                        os.close(fd)
                with self._cond:
                    error, self._lost = error or self._lost, None
                try:
                    self._loop.call_soon_threadsafe(_settle, batch, error)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    pass
            if stopping:
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
