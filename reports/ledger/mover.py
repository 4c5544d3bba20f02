"""The mover: a child process that does a serving proxy's DuckDB work, so that the proxy never imports DuckDB.

Design note. ``import duckdb`` maps ~20 MB of library code and the first connection ~32 MB more,
and neither goes away when the connection closes; a move's appends and checkpoint peak at +25
to +117 MB (``bench/PROFILE.md`` sections 5 and 8). So a serving proxy hands the migration, the
one-time state import, every move of its write-ahead log (:mod:`~tokenward.reports.ledger.moves`)
and its report queries (the dashboard's: :meth:`DuckLedger.query <tokenward.reports.ledger.DuckLedger.query>`)
to one child, ``python -m tokenward.reports.ledger.mover``, over a socket pair (pickled requests,
one at a time). The child holds the DuckDB file only inside a request, as the proxy did, and is
stopped after :data:`IDLE_S` seconds without work (the next move starts another).

Crashes. The proxy's segments stay on disk until the child has inserted and removed them: a
child killed mid-move leaves each segment it had not removed, and the proxy moves those again
with de-duplication (their rows may be committed already), logs the death, and starts a new
child at the next move. The child dies with the proxy: ``PR_SET_PDEATHSIG`` kills it at once
(a child left moving would hold the file's lock, and lock ``tokenward report`` out), and when the
proxy's end of the socket closes it exits after the request in hand.

Hangs. A child that stops without dying (SIGSTOP, a frozen cgroup, a host that pauses it) would
leave the proxy waiting for its reply for ever, the rows piling up in the log. While it works on
a request the child says so every :data:`TICK_S` seconds (a thread, so a long DuckDB statement,
which releases the GIL, does not silence it); a child silent for :data:`HUNG_S` seconds (or
:data:`START_S` after it was started) is killed and the call raises :class:`MoverHung`: the work
is retried, as after any death, by a new child. :attr:`Mover.incidents` keeps what happened,
for ``/healthz``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tokenward.reports.ledger.errors import LedgerBusy, LedgerError

__all__ = ["HUNG_S", "IDLE_S", "START_S", "TICK_S", "Mover", "MoverDied", "MoverHung", "RemoteSpend", "main"]

log = logging.getLogger("tokenward.ledger")

IDLE_S = float(os.environ.get("TOKENWARD_MOVER_IDLE_S", "30"))
"""Seconds without a request after which the child is stopped (``TOKENWARD_MOVER_IDLE_S``, default 30).

Starting one costs ~0.17 s of CPU and ~0.4 s (python, DuckDB, the first connection); a running
one holds ~78 MB RSS (27 private, the rest DuckDB's and Python's library pages). 30 s keeps
bursts of traffic from starting a child each time (at most ~0.6 % of a core) and gives the
memory back within half a minute of the last move.
"""


TICK_S = 0.5
"""Seconds between two signs of life of a child working on a request."""

HUNG_S = 5.0
"""Seconds without a sign of life after which a working child is taken for hung and killed."""

START_S = 30.0
"""Seconds a child just started has to give its first sign of life (Python and its imports on a loaded host)."""

_TICK = ("tick",)

_IN_SESSION = ("spend", "read_close")  # requests that need the connection an earlier request opened


class MoverDied(LedgerError):
    """The mover child ended before it answered (killed, out of memory); the work is retried."""


class MoverHung(MoverDied):
    """The mover child gave no sign of life for :data:`HUNG_S` seconds (stopped): it was killed; the work is retried."""


class Mover:
    """The proxy's side of the mover child: :meth:`call` runs one request there (blocking; any thread).

    Args:
        idle_s: stop the child after this many seconds without a request (:meth:`retire_if_idle`).
    """

    def __init__(self, idle_s: float = IDLE_S, hung_s: float = HUNG_S) -> None:
        self.idle_s = idle_s
        self.hung_s = hung_s
        self.incidents: list[tuple[float, str]] = []
        """``(time.time(), what happened)`` for each child that died or hung in a call, oldest first (last 20)."""
        self.restarts = 0
        """Children that died or hung in a call (each replaced by a new one at the next call)."""
        self._fresh = False  # the child was started for this call: it may take START_S to answer
        self._heard: float | None = None  # while a call waits: when the child last gave a sign of life
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._last = time.monotonic()

    @property
    def pid(self) -> int | None:
        """The child's process id while one runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def call(self, request: dict[str, Any]) -> tuple[str, Any, Any]:
        """Send ``request`` to the child (starting one if none runs) and return its reply ``(kind, value, extra)``.

        ``kind`` is ``ok``, ``busy`` or ``error``; ``extra`` is what the request reports whatever
        the outcome (a move: the segments it left unsure).

        Raises:
            MoverDied: the child ended before it answered (the request may be done in part).
            OSError: no child could be started.
        """
        with self._lock:
            if self._proc is not None and self._proc.poll() is not None and request["op"] in _IN_SESSION:
                code = self._reap()  # died since the session's last call: its connection is gone with it
                raise MoverDied(f"the ledger's mover process ended (exit status {code}) during a read")
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            assert self._conn is not None
            try:
                self._conn.send(request)
                reply = self._receive(request["op"])
            except (EOFError, OSError) as exc:
                code = self._reap()
                raise self._incident(
                    MoverDied(f"the ledger's mover process ended (exit status {code}) during {request['op']}")
                ) from exc
            finally:
                self._last = time.monotonic()
        kind, value, extra, notes = reply
        for level, name, message in notes:
            logging.getLogger(name).log(level, "%s", message)
        return kind, value, extra

    @property
    def silent_s(self) -> float | None:
        """Seconds since the child last gave a sign of life while a call waits for it (``None``: no call waits)."""
        heard = self._heard
        return None if heard is None else time.monotonic() - heard

    def _receive(self, op: str) -> Any:
        """The child's reply, skipping its signs of life; a child silent too long is killed (:class:`MoverHung`)."""
        self._heard = time.monotonic()
        try:
            return self._replied(op)
        finally:
            self._heard = None

    def _replied(self, op: str) -> Any:
        assert self._conn is not None and self._proc is not None
        while True:
            wait = START_S if self._fresh else self.hung_s
            if not self._conn.poll(wait):
                pid = self._proc.pid
                self._proc.kill()  # SIGKILL ends a stopped process too; what it left unfinished is moved again
                self._reap()
                raise self._incident(
                    MoverHung(f"the ledger's mover process (pid {pid}) gave no sign of life for {wait:g} s during "
                              f"{op}: killed, a new one takes over")
                )
            message = self._conn.recv()
            self._fresh, self._heard = False, time.monotonic()
            if message != _TICK:
                return message

    def _incident(self, exc: MoverDied) -> MoverDied:
        self.restarts += 1
        self.incidents = [*self.incidents[-19:], (time.time(), str(exc))]
        return exc

    def retire_if_idle(self) -> None:
        """Stop the child if it has had no request for :attr:`idle_s` seconds."""
        if self._proc is not None and time.monotonic() - self._last >= self.idle_s:
            self.close()

    def close(self) -> None:
        """Stop the child (after the request in hand, if any)."""
        with self._lock:
            if self._proc is None:
                return
            with contextlib.suppress(OSError, EOFError):
                assert self._conn is not None
                self._conn.send({"op": "exit"})
            self._reap()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tokenward.reports.ledger.mover", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._fresh = True

    def _reap(self) -> int | None:
        """Close the socket and wait for the child (killed after 5 s); its exit status."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        try:
            return proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


class RemoteSpend:
    """A :class:`~tokenward.reports.ledger.spend.SpendSource` whose every method the mover child answers.

    Use as a context manager: entering opens one read-only connection in the child (so every call
    sees the same ledger, as one session did in this process), leaving closes it. Arguments and
    results are pickled (budgets, datetimes, ``Decimal`` amounts, exactly).

    Raises (entering or on a call):
        LedgerBusy: another process holds the file.
        LedgerError: it cannot be read (:class:`MoverDied`: the child ended).
    """

    def __init__(self, mover: Mover, path: str) -> None:
        self._mover = mover
        self._path = path

    def __enter__(self) -> RemoteSpend:
        self._ask({"op": "read_open", "path": self._path})
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(LedgerError):
            self._ask({"op": "read_close"})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._ask({"op": "spend", "method": name, "args": args, "kwargs": kwargs})

        return call

    def _ask(self, request: dict[str, Any]) -> Any:
        kind, value, _ = self._mover.call(request)
        if kind == "ok":
            return value
        raise (LedgerBusy if kind == "busy" else LedgerError)(value)


# -- the child -------------------------------------------------------------------------------


class _Notes(logging.Handler):
    """Log records of one request, sent back with its reply (the proxy logs them as its own)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.notes: list[tuple[int, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.notes.append((record.levelno, record.name, record.getMessage()))


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when ``parent`` ends (Linux); exit now if it has ended already."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def _give_back_free_memory() -> None:
    """Return what DuckDB freed to the OS (glibc's ``malloc_trim``; DuckDB's Linux wheel allocates with glibc).

    A move's appends and checkpoint free tens of MB when its connection closes, and glibc kept
    them, in the main heap and in the arenas of DuckDB's threads, until the child stopped.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)


_reading: list[Any] = []  # the child's read-only connection of a RemoteSpend session (one at most)


def _run(request: dict[str, Any], unsure: set[Path]) -> Any:
    from tokenward.reports.ledger import moves

    op = request["op"]
    if op == "read_open":
        from tokenward.reports.ledger.duck import open_ledger

        _close_reading()
        _reading.append(open_ledger(request["path"], read_only=True))
        return None
    if op == "spend":
        from tokenward.reports.ledger.spend import DuckSpend

        if not _reading:
            raise LedgerError("no read session is open in the mover")
        return getattr(DuckSpend(_reading[0]), request["method"])(*request["args"], **request["kwargs"])
    if op == "read_close":
        _close_reading()
        return None
    _close_reading()  # a session its caller never closed must not keep the file from being written
    if op == "query":
        from tokenward.reports.ledger.duck import open_ledger

        conn = open_ledger(request["path"], read_only=True)
        try:
            return request["work"](conn, *request["args"], **request["kwargs"])
        finally:
            conn.close()
    if op == "move":
        return moves.move_segments(
            request["path"],
            Path(request["spool_dir"]),
            [Path(p) for p in request["own"]],
            request["writer"],
            unsure,
            migrate_schema=request["migrate"],
        )
    if op == "migrate":
        return moves.migrate_file(request["path"], request["wait_s"])
    if op == "legacy":
        return moves.import_legacy(request["path"], request["state_path"])
    raise ValueError(f"unknown mover request {op!r}")


def _close_reading() -> None:
    while _reading:
        _reading.pop().close()


def main(argv: list[str]) -> int:
    """The child: answer requests on the socket ``argv[0]`` until told to exit or the proxy ``argv[1]`` is gone."""
    _die_with(int(argv[1]))
    conn = Connection(int(argv[0]))
    notes = _Notes()
    logger = logging.getLogger("tokenward")
    logger.addHandler(notes)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    sending = threading.Lock()
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return 0
        if request.get("op") == "exit":
            return 0
        unsure = {Path(p) for p in request.get("unsure", ())}
        notes.notes = []
        done = threading.Event()
        ticker = threading.Thread(target=_tick, args=(conn, sending, done), daemon=True)
        ticker.start()
        try:
            reply: tuple[str, Any] = ("ok", _run(request, unsure))
        except LedgerBusy as exc:
            reply = ("busy", str(exc))
        except Exception as exc:  # noqa: BLE001 - every failure is the proxy's to log and retry
            reply = ("error", f"{exc}" if isinstance(exc, LedgerError) else f"{type(exc).__name__}: {exc}")
        finally:
            done.set()
            ticker.join()
        try:
            with sending:
                conn.send((*reply, sorted(str(p) for p in unsure), notes.notes))
        except OSError:
            return 0
        _give_back_free_memory()


def _tick(conn: Connection, sending: threading.Lock, done: threading.Event) -> None:
    """Tell the proxy this child is alive, now and every :data:`TICK_S` seconds until ``done``."""
    while True:
        try:
            with sending:
                conn.send(_TICK)
        except OSError:
            return
        if done.wait(TICK_S):
            return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
