"""Limits on what a client may make the proxy hold: body size, body and header time, connections.

Two layers, because uvicorn offers only part of what a proxy in front of a paid API needs
(``limit_concurrency``, ``timeout_keep_alive`` and, for h11 only, a header size; no header or
body timeout: uvicorn issue #157, and its keep-alive timer restarts on every byte received):

* The connection, below the app (:func:`uvicorn_options`): uvicorn's connection limit and
  keep-alive timeout, plus :class:`LimitedHttpTools`, uvicorn's httptools protocol with a
  deadline for each request head (``header_timeout_s`` from its first byte, or from the end
  of the previous reply) and a cap on its size. A head that is late gets ``408`` and the
  connection is closed; one that is too large gets ``431``. Neither reaches the app, so neither
  has a ledger row: no request was ever complete.
* The body, inside the app (:func:`read_body` for the metered endpoints, which hold the whole
  body; :func:`body_stream` for the others, whose body is streamed to the upstream). A body
  larger than allowed is refused with ``413 request_too_large`` before it is read when its
  ``Content-Length`` says so, else as soon as it grows past the limit. A body that arrives too
  slowly is refused with ``408 request_timeout``: the client gets ``body_timeout_s`` plus one
  second per ``body_min_kib_s`` KiB received so far, counting only time the proxy spent
  waiting for the client (a slow upstream reading a streamed upload does not count against
  it). One byte a second is refused after ``body_timeout_s``. Both errors are
  :class:`~tokenward.proxy.errors.ProxyError`, so the forwarder records them like any refusal.
* What a held body costs once decoded (:func:`read_body`): a JSON body is decoded whole (the
  budget's count, isolation's id check), and a small value costs far more as a Python object
  than as JSON (``{}`` is 3 bytes with its comma and a 64-232 byte dict). A body over 1 MiB whose
  values would take more than twice ``max_bytes`` once decoded is refused with ``413
  request_too_complex``, so a maximum-size body costs at most about three times its size
  whatever its shape.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from litestar.types import Receive
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tokenward.proxy.config import ServerConfig
from tokenward.proxy.errors import ProxyError, reply_error_body

__all__ = [
    "CONNECTION_SCOPE_KEY",
    "BodyLimits",
    "BodyStream",
    "ClientConnection",
    "LimitedHttpTools",
    "body_stream",
    "decoded_size",
    "read_body",
    "give_back_free_memory",
    "return_large_buffers",
    "uvicorn_options",
]

log = logging.getLogger("tokenward.proxy")

_CLOSE = [(b"connection", b"close")]  # the rest of a refused body is not read: the connection cannot be reused
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """Request body limits: sizes in bytes, times in seconds, rate in bytes per second.

    ``max_bytes`` bounds bodies tokenward holds in memory (the metered endpoints);
    ``max_upload_bytes`` bounds bodies streamed through to the upstream (file uploads).
    """

    max_bytes: int = 32 * _MIB
    max_upload_bytes: int = 512 * _MIB
    timeout_s: float = 30.0
    min_rate: float = 64 * 1024.0

    @classmethod
    def from_config(cls, server: ServerConfig) -> BodyLimits:
        """The limits a ``server:`` section sets."""
        return cls(
            max_bytes=int(server.max_body_mib * _MIB),
            max_upload_bytes=int(server.max_upload_mib * _MIB),
            timeout_s=server.body_timeout_s,
            min_rate=server.body_min_kib_s * 1024.0,
        )


async def read_body(receive: Receive, headers: list[tuple[bytes, bytes]], limits: BodyLimits) -> bytes:
    """Read a whole request body, holding one copy of it (plus the chunk being read).

    Raises:
        ProxyError: 413 ``request_too_large`` past ``limits.max_bytes``; 408 ``request_timeout``
            when the body is too slow; 499 ``client_disconnected`` when the client leaves.
    """
    limit = limits.max_bytes
    _check_declared(headers, limit)
    reader = _Reader(receive, limits)
    chunk, more = await reader.next()
    if not more:  # the usual case: the whole body came in one message, used as is
        if len(chunk) > limit:
            raise _too_large(limit)
        return _decodable(chunk, limit)
    chunks = [chunk]
    size = len(chunk)
    while more:
        chunk, more = await reader.next()
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return _decodable(b"".join(chunks), limit)


_DENSE_FROM = 1 * _MIB
# Bytes a decoded JSON value may take (CPython 3.12, 64-bit), per byte that opens it: a dict with a
# few members 232, a list 72, a string 57 per pair of quotes beyond its text, a list slot 8 per
# comma. Counted anywhere in the body (also inside strings), so an over-estimate for prose.
_VALUE_BYTES = ((b"{", 232), (b"[", 72), (b'"', 29), (b",", 8))


def decoded_size(body: bytes) -> int:
    """An estimate (bytes, on the high side) of the memory ``body`` takes once decoded as JSON."""
    return len(body) + sum(body.count(opener) * size for opener, size in _VALUE_BYTES)


def _decodable(body: bytes, limit: int) -> bytes:
    """``body``, unless it is JSON over 1 MiB that would take more than ``2 x limit`` decoded.

    Raises:
        ProxyError: 413 ``request_too_complex``.
    """
    if len(body) <= _DENSE_FROM or body[:1] not in (b"{", b"[", b" ", b"\n", b"\r", b"\t"):
        return body
    estimate = decoded_size(body)
    if estimate <= 2 * limit:
        return body
    raise ProxyError(
        413,
        f"The request's JSON ({len(body):,} bytes) holds so many small values that reading it would take "
        f"about {estimate // _MIB:,} MiB, more than this tokenward allows for one body (twice "
        "server.max_body_mib): send fewer, larger values.",
        "request_too_complex",
        headers=_CLOSE,
    )


def body_stream(receive: Receive, headers: list[tuple[bytes, bytes]], limits: BodyLimits) -> BodyStream:
    """The request body as an async iterable of chunks, for streaming it to the upstream.

    A declared ``Content-Length`` over ``limits.max_upload_bytes`` is refused at once, before
    anything is sent upstream; a body that grows past it, or comes too slowly, makes the
    iteration raise (the upstream request is then abandoned) and leaves the error in
    :attr:`BodyStream.error`, since HTTP clients wrap what a body iterator raises.

    Raises:
        ProxyError: 413 ``request_too_large`` for a declared length over the limit.
    """
    _check_declared(headers, limits.max_upload_bytes)
    return BodyStream(_Reader(receive, limits), limits.max_upload_bytes)


class BodyStream:
    """A request body streamed through: iterate it once.

    ``error`` is the :class:`~tokenward.proxy.errors.ProxyError` (413, 408, 499) that stopped
    the iteration, ``None`` while none did.
    """

    __slots__ = ("_limit", "_reader", "error")

    def __init__(self, reader: _Reader, limit: int) -> None:
        self._reader = reader
        self._limit = limit
        self.error: ProxyError | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        """The chunks as they arrive."""
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        reader = self._reader
        more = True
        try:
            while more:
                chunk, more = await reader.next()
                if reader.received > self._limit:
                    raise _too_large(self._limit)
                if chunk:
                    yield chunk
        except ProxyError as exc:
            self.error = exc
            raise


class _Reader:
    """Receives body messages, within the time the bytes received so far earn the client.

    No timer per receive: a :class:`_Sweeper` looks at every waiting reader a few times a
    second and cancels the ones past their time.
    """

    __slots__ = ("_expired", "_limits", "_receive", "_since", "_task", "_waited", "received")

    def __init__(self, receive: Receive, limits: BodyLimits) -> None:
        self._receive = receive
        self._limits = limits
        self._waited = 0.0
        self._since = 0.0
        self._task: asyncio.Task[Any] | None = None
        self._expired = False
        self.received = 0

    def allowed(self) -> float:
        """Seconds of waiting the client has earned so far."""
        limits = self._limits
        return limits.timeout_s + (self.received / limits.min_rate if limits.min_rate > 0 else 0.0)

    def overdue(self, now: float) -> bool:
        """Whether the receive under way has waited past :meth:`allowed` (``time.monotonic()`` ``now``)."""
        return self._waited + (now - self._since) > self.allowed()

    def expire(self) -> None:
        """Stop the receive under way (it then raises the 408)."""
        if self._task is not None and not self._expired:
            self._expired = True
            self._task.cancel()

    async def next(self) -> tuple[bytes, bool]:
        """The next chunk and whether more follow."""
        limits = self._limits
        if self._waited >= limits.timeout_s + (self.received / limits.min_rate if limits.min_rate > 0 else 0.0):
            raise _too_slow(limits)
        sweeper = _sweeper(asyncio.get_running_loop(), limits.timeout_s)
        self._task = asyncio.current_task()
        self._since = since = time.monotonic()
        sweeper.waiting.add(self)
        if sweeper.handle is None:
            sweeper.arm()
        try:
            message = await self._receive()
        except asyncio.CancelledError:
            if not self._expired or self._task is None:
                raise
            self._task.uncancel()
            raise _too_slow(limits) from None
        finally:
            sweeper.waiting.discard(self)
            self._waited += time.monotonic() - since
        if message["type"] != "http.request":
            raise ProxyError(499, "The client disconnected while sending the request body.", "client_disconnected")
        chunk: bytes = message.get("body", b"")
        self.received += len(chunk)
        return chunk, message.get("more_body", False)


class _Timed(Protocol):
    def overdue(self, now: float) -> bool: ...

    def expire(self) -> None: ...


class _Sweeper:
    """One timer per event loop for every body read or request head under way.

    Every ``interval`` seconds while something waits, it expires what is overdue. A timer per
    request costs several microseconds to arm and cancel; adding to a set costs a tenth of that.
    """

    __slots__ = ("handle", "interval", "loop", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float) -> None:
        self.loop = loop
        self.interval = interval
        self.waiting: set[_Timed] = set()
        self.handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """Make sure a sweep comes (called when a reader starts waiting)."""
        if self.handle is None:
            self.handle = self.loop.call_later(self.interval, self._sweep)

    def _sweep(self) -> None:
        self.handle = None
        now = time.monotonic()
        for reader in [r for r in self.waiting if r.overdue(now)]:
            reader.expire()
        if self.waiting:
            self.arm()


_SWEEPERS: dict[tuple[int, float], _Sweeper] = {}


def _sweeper(loop: asyncio.AbstractEventLoop, timeout_s: float) -> _Sweeper:
    """The sweeper of ``loop`` for timeouts of ``timeout_s`` (sweeps a quarter of it, at most 1 s, apart)."""
    key = (id(loop), timeout_s)
    sweeper = _SWEEPERS.get(key)
    if sweeper is None or sweeper.loop is not loop:
        if len(_SWEEPERS) > 64:  # loops come and go in tests; a server has one
            _SWEEPERS.clear()
        sweeper = _SWEEPERS[key] = _Sweeper(loop, min(1.0, timeout_s / 4))
    return sweeper


def _check_declared(headers: list[tuple[bytes, bytes]], limit: int) -> None:
    for name, value in headers:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                return  # the HTTP parser has already refused a malformed length
            if declared > limit:
                raise _too_large(limit, declared)
            return


def _too_large(limit: int, declared: int | None = None) -> ProxyError:
    size = f" ({declared:,} bytes)" if declared is not None else ""
    return ProxyError(
        413,
        f"The request body{size} is larger than the {limit:,} bytes this tokenward accepts "
        "(server.max_body_mib for metered endpoints, server.max_upload_mib for others).",
        "request_too_large",
        headers=_CLOSE,
    )


def _too_slow(limits: BodyLimits) -> ProxyError:
    return ProxyError(
        408,
        f"The request body arrived too slowly: tokenward waits {limits.timeout_s:g} s plus one second per "
        f"{limits.min_rate / 1024:g} KiB received (server.body_timeout_s, server.body_min_kib_s).",
        "request_timeout",
        headers=_CLOSE,
    )


CONNECTION_SCOPE_KEY = "tokenward.connection"
"""ASGI scope key of the request's :class:`ClientConnection` (set by :class:`LimitedHttpTools`)."""

_DISCONNECT = {"type": "http.disconnect"}


class ClientConnection:
    """One request's client connection as the server sees it: whether it is lost, and a future for when.

    :class:`LimitedHttpTools` puts one in each request's scope under :data:`CONNECTION_SCOPE_KEY`,
    so that :class:`~tokenward.proxy.relay.DisconnectWatch` learns of a disconnect without a task
    waiting in ``receive()`` for the whole request (a task, its two steps and its cancellation
    cost ~3 us of CPU a request more than a future: ``uvloop``, Python 3.11).
    """

    __slots__ = ("_cycle", "_lost", "_protocol")

    def __init__(self, protocol: LimitedHttpTools, cycle: Any) -> None:
        self._protocol = protocol
        self._cycle = cycle
        self._lost: asyncio.Future[dict[str, str]] | None = None

    @property
    def gone(self) -> bool:
        """Whether the client left before its reply was complete."""
        return bool(self._cycle.disconnected)

    def lost(self) -> asyncio.Future[dict[str, str]]:
        """A future resolved with ``{"type": "http.disconnect"}`` once the connection is lost (made on first call)."""
        if self._lost is None:
            self._lost = self._protocol.loop.create_future()
            if self._cycle.disconnected or self._protocol.transport.is_closing():
                self._lost.set_result(_DISCONNECT)
            else:
                self._protocol.watched.add(self)
        return self._lost

    def release(self) -> None:
        """Stop watching (the future stays as it is)."""
        self._protocol.watched.discard(self)

    def connection_lost(self) -> None:
        """Resolve the future (called by the protocol)."""
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(_DISCONNECT)


class LimitedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a deadline and a size cap for each request head.

    The deadline starts when the connection opens, and again with the first byte after a reply
    (while the connection idles with nothing received, uvicorn's keep-alive timeout applies);
    it ends when the head is complete. Deadlines are checked by a :class:`_Sweeper` (at most a
    quarter of ``header_timeout_s`` late, and at most a second). :func:`uvicorn_options`
    subclasses it with the two class attributes set.
    """

    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024

    _head_since: float | None
    _head_bytes: int
    _in_head: bool
    watched: set[ClientConnection]
    """The requests' :class:`ClientConnection` objects waiting for this connection to be lost."""

    def connection_made(self, transport: Any) -> None:
        """Start the first head's deadline (a connection that sends nothing is closed at its end)."""
        super().connection_made(transport)
        self.watched = set()
        self._head_since = None
        self._head_bytes = 0
        self._in_head = True
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the head deadline; tell the requests watching the connection."""
        self._disarm()
        super().connection_lost(exc)
        watched, self.watched = self.watched, set()
        for connection in watched:
            connection.connection_lost()

    def data_received(self, data: bytes) -> None:
        """Feed the parser, counting head bytes; refuse a head past ``max_header_bytes``."""
        if self._in_head:
            self._head_bytes += len(data)
        elif self._head_since is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # bytes between requests (even bare CRLFs): the next head must complete in time
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
            self._refuse(431, "Request Header Fields Too Large", "request_header_too_large", _HEAD_TOO_LARGE)

    def on_message_begin(self) -> None:
        """A new request head starts."""
        self._in_head = True
        if self._head_since is None:
            self._arm()
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        """Keep a header field of the head; drop a trailer field (one after a chunked body's last chunk).

        uvicorn appends trailer fields to the request's headers, the very list the app reads: a
        trailer ``Authorization``, ``Content-Encoding`` or attribution header then counted as one
        sent in the head (the last of two values wins where a header is read once), and one that
        arrived after the app had read the headers changed what it read later. RFC 9110 6.5.1: a
        recipient must not merge trailer fields into the header section; tokenward uses none.
        """
        if self._in_head:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        """The head is complete: the deadline no longer applies (the body has its own limits).

        A head over ``max_header_bytes`` that arrived whole is answered 431 by a small ASGI app
        in place of tokenward's, the way uvicorn answers requests over its connection limit.
        """
        self._in_head = False
        self._head_bytes = 0
        self._disarm()
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size <= self.max_header_bytes and self._over_limit():  # uvicorn's is plain text: a JSON error instead
            self._answer_with(_over_connection_limit)
            return
        if size <= self.max_header_bytes:
            scope = self.scope
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is scope:  # not an upgrade: the request's task runs later
                scope[CONNECTION_SCOPE_KEY] = ClientConnection(self, cycle)  # type: ignore[literal-required]
            return
        self._answer_with(_head_too_large)

    def _over_limit(self) -> bool:
        """Whether uvicorn would answer this request 503 (``limit_concurrency``, server.max_connections)."""
        limit = self.limit_concurrency
        return limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit)

    def _answer_with(self, app: Any) -> None:
        """Let uvicorn run the small ASGI ``app`` for this request in place of tokenward's."""
        kept, limit = self.app, self.limit_concurrency
        self.app, self.limit_concurrency = app, None
        try:
            super().on_headers_complete()
        finally:
            self.app, self.limit_concurrency = kept, limit

    def _arm(self) -> None:
        sweeper = _sweeper(self.loop, self.header_timeout_s)
        self._head_since = time.monotonic()
        sweeper.waiting.add(self)
        if sweeper.handle is None:
            sweeper.arm()

    def _disarm(self) -> None:
        if self._head_since is not None:
            self._head_since = None
            _sweeper(self.loop, self.header_timeout_s).waiting.discard(self)

    def overdue(self, now: float) -> bool:
        """Whether the head under way is late (``time.monotonic()`` ``now``)."""
        return self._head_since is not None and now - self._head_since > self.header_timeout_s

    def expire(self) -> None:
        """Refuse the late head (called by the sweep)."""
        self._disarm()
        self._head_late()

    def _head_late(self) -> None:
        if self.transport.is_closing():
            return
        if self._in_head and self._head_bytes:
            self._refuse(
                408,
                "Request Timeout",
                "request_timeout",
                f"The request head did not arrive within {self.header_timeout_s:g} s (server.header_timeout_s).",
            )
        else:
            self.transport.close()  # nothing of a request arrived: close quietly, as an idle keep-alive

    def _refuse(self, status: int, reason: str, code: str, message: str) -> None:
        self._in_head = False
        self._disarm()
        # what of the head arrived decides the shape: an Anthropic client gets Anthropic's error document
        path = getattr(self, "url", None) or b""
        body = reply_error_body(path, self.headers or [], status, message, "invalid_request_error", code)
        log.warning("refused a connection from %s: %s", _peer(self.client), message)
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode("ascii") + body)
        self.transport.close()


_HEAD_TOO_LARGE = "The request head is larger than server.max_header_kib allows."


async def _head_too_large(scope: Any, receive: Any, send: Any) -> None:
    raw_path = scope.get("raw_path") or scope["path"].encode()
    body = reply_error_body(
        raw_path, scope["headers"], 431, _HEAD_TOO_LARGE, "invalid_request_error", "request_header_too_large"
    )
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *_CLOSE]
    log.warning("refused a request from %s: %s", _peer(scope.get("client")), _HEAD_TOO_LARGE)
    await send({"type": "http.response.start", "status": 431, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_OVER_LIMIT = "tokenward has as many connections open as server.max_connections allows: try again shortly."


async def _over_connection_limit(scope: Any, receive: Any, send: Any) -> None:
    """The 503 beyond ``server.max_connections``, in OpenAI's (or Anthropic's) error shape, not uvicorn's plain text."""
    raw_path = scope.get("raw_path") or scope["path"].encode()
    body = reply_error_body(raw_path, scope["headers"], 503, _OVER_LIMIT, "server_error", "too_many_connections")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *_CLOSE]
    log.warning("refused a request from %s: %s", _peer(scope.get("client")), _OVER_LIMIT)
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown peer"


def uvicorn_options(server: ServerConfig) -> dict[str, Any]:
    """The uvicorn ``Config`` arguments enforcing the connection-level limits of ``server``.

    ``limit_concurrency`` answers 503 to requests beyond ``max_connections`` open connections
    (uvicorn's own plain-text reply, before the app: no ledger row); ``timeout_keep_alive``
    closes idle connections; the protocol class enforces the head deadline and size.
    """
    protocol = type(
        "LimitedHttpTools",
        (LimitedHttpTools,),
        {"header_timeout_s": server.header_timeout_s, "max_header_bytes": int(server.max_header_kib * 1024)},
    )
    return {
        "http": protocol,
        "ws": "none",  # tokenward serves no WebSocket: an upgrade request is answered as plain HTTP
        "limit_concurrency": server.max_connections,
        "timeout_keep_alive": server.keep_alive_s,
        "h11_max_incomplete_event_size": int(server.max_header_kib * 1024),
    }


_M_MMAP_THRESHOLD = -3  # glibc malloc.h


def give_back_free_memory() -> bool:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim(0)``), after start-up's work.

    Building the app and starting it (the price catalog's YAML, the ledger's start-up reads)
    frees more than it keeps, and glibc keeps what was freed: about 1 MB of a serving proxy's
    idle RSS (``bench/PROFILE.md`` section 15). Takes well under a millisecond at that size.

    Returns:
        Whether glibc's ``malloc_trim`` was there to call (``False`` off glibc).
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: no ldconfig run to find libc
    except (OSError, AttributeError, TypeError):
        return False
    trim(0)
    return True


def return_large_buffers(threshold: int = _MIB) -> bool:
    """Make glibc give every buffer of ``threshold`` bytes or more back to the OS when it is freed.

    glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so
    after one large request body the next ones come from the heap, whose freed memory stays
    resident: a 32 MiB body then left the proxy ~35 MiB larger and a second copy in flight
    piled on top (bench/bench_body_memory.py). A fixed threshold turns that adjustment off;
    only allocations of a MiB or more (large bodies, never the per-request small objects)
    pay an mmap. Call once at start; process-wide.

    Returns:
        Whether the setting took effect (``False`` off glibc, e.g. musl or macOS).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
