"""The one module that talks HTTP to upstreams, behind a small interface the relay uses.

:class:`UpstreamClient` sends one request and returns an :class:`UpstreamReply` (status,
lower-cased raw headers, raw body chunks as they arrive, no decoding). Two implementations:

* :class:`AiohttpUpstream`, the default. On this machine, httpx's ``AsyncClient`` over the
  aiohttp-backed transport from ``httpx-aiohttp`` cost 0.31 ms of CPU per request against
  0.15 ms for aiohttp used directly, with the same behaviour (``bench/bench_client.py``); that
  difference is a quarter of tokenward's whole per-request budget. (httpx's default transport
  was ruled out earlier: ~9.6 ms of CPU per request at concurrency 64, ``shared/NOTES.md`` §5.)
* :class:`HttpxUpstream`, over any ``httpx.AsyncBaseTransport``: tests use it with
  ``httpx.MockTransport`` to inject faults, and ``upstream_client: httpx`` selects it.

Both take the URL as a ``yarl.URL`` built from components (:meth:`tokenward.proxy.edge.Base.url`)
and send its path and query bytes as they are: nothing re-quotes or normalises them.

Every failure surfaces as :class:`UpstreamError` carrying a classified :class:`Failure`:
whether it was a timeout (504) or not (502), and whether the request may have reached the
provider (``maybe_sent``): only a refused connection or an unresolvable name proves it did
not, so only those are safe to retry without risking a double bill.
"""

from __future__ import annotations

import asyncio
import enum
import sys
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import aiohttp
from multidict import CIMultiDict
from yarl import URL

if TYPE_CHECKING:  # httpx (with the rich and pygments its CLI imports) loads with HttpxUpstream only
    import httpx

__all__ = [
    "AiohttpUpstream",
    "Failure",
    "FailureKind",
    "HttpxUpstream",
    "Timeouts",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamReply",
    "classify",
]

Body = bytes | AsyncIterable[bytes] | None


class FailureKind(enum.StrEnum):
    """Why no (complete) reply came from the upstream."""

    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    DISCONNECTED = "disconnected"


@dataclass(frozen=True, slots=True)
class Failure:
    """A classified transport failure; ``maybe_sent`` is false only when the request provably never left."""

    kind: FailureKind
    maybe_sent: bool
    message: str

    @property
    def summary(self) -> str:
        """:attr:`message` without the transport's detail (no host, port or address): what a client is told."""
        if self.kind is FailureKind.UNREACHABLE:
            return "cannot connect to upstream"
        if self.kind is FailureKind.TIMEOUT:
            return "upstream timed out" if self.maybe_sent else "upstream connection timed out"
        return "upstream connection failed"

    @property
    def status(self) -> int:
        """HTTP status tokenward answers with: 504 for a timeout, 502 otherwise."""
        return 504 if self.kind is FailureKind.TIMEOUT else 502


class UpstreamError(Exception):
    """Sending to, or reading from, an upstream failed; ``failure`` says how."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds to wait for a connection, and for each read of reply bytes (``None``: no limit)."""

    connect: float | None = 10.0
    read: float | None = 600.0


class UpstreamReply(Protocol):
    """An upstream's reply whose body has not been read yet."""

    status: int
    headers: list[tuple[bytes, bytes]]
    """Header names lower-cased, values as received, in order."""

    def chunks(self) -> AsyncIterator[bytes]:
        """Raw body bytes as they arrive (no content decoding). Raises :class:`UpstreamError`."""
        ...

    async def read(self) -> bytes:
        """The whole raw body (no content decoding), for a reply relayed whole. Raises :class:`UpstreamError`."""
        ...

    async def aclose(self) -> None:
        """Release the connection (closing it if the body was not read to the end)."""
        ...


class UpstreamClient(Protocol):
    """Sends requests to upstreams; one instance is shared by the whole proxy."""

    async def send(
        self, method: str, url: URL, headers: list[tuple[bytes, bytes]], body: Body, timeouts: Timeouts
    ) -> UpstreamReply:
        """Send a request and return once the reply's status and headers arrived.

        ``url`` is sent as it is: its raw path and query go on the request line unchanged.

        Raises:
            UpstreamError: the request could not be sent or no reply head arrived.
        """
        ...

    async def aclose(self) -> None:
        """Close every pooled connection."""
        ...


def classify(exc: BaseException) -> Failure:
    """Classify an exception raised by aiohttp or httpx while talking to an upstream."""
    detail = str(exc) or type(exc).__name__
    httpx = sys.modules.get("httpx")  # an httpx error means httpx was imported: no import here
    if isinstance(exc, aiohttp.ClientConnectorError) or (httpx is not None and isinstance(exc, httpx.ConnectError)):
        return Failure(FailureKind.UNREACHABLE, False, f"cannot connect to upstream: {detail}")
    if isinstance(exc, aiohttp.ConnectionTimeoutError) or (
        httpx is not None and isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout)
    ):
        return Failure(FailureKind.TIMEOUT, False, f"upstream connection timed out: {detail}")
    if isinstance(exc, asyncio.TimeoutError) or (httpx is not None and isinstance(exc, httpx.TimeoutException)):
        return Failure(FailureKind.TIMEOUT, True, f"upstream timed out: {detail}")
    return Failure(FailureKind.DISCONNECTED, True, f"upstream connection failed: {detail}")


_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
"""What the aiohttp client raises; :class:`HttpxUpstream` adds ``httpx.TransportError`` for its own."""


class _Chunks:
    """Iterates an aiohttp body as it arrives, one ``readany()`` per chunk.

    A class, not an async generator over ``iter_any()``: a stream of SSE events crosses this once
    per event, and the generator and aiohttp's own iterator were two more frames each time.
    """

    __slots__ = ("_content",)

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._content.readany()
        except _ERRORS as exc:
            raise UpstreamError(classify(exc)) from exc
        if not chunk:
            raise StopAsyncIteration
        return chunk


class _AiohttpReply:
    __slots__ = ("_closed", "_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = [(name.lower(), value) for name, value in response.raw_headers]
        self._closed: asyncio.Future[None] | None = None
        connection = response.connection
        if connection is not None and connection.protocol is not None and not response.content.is_eof():
            # aiohttp's C parser reports a malformed body (a chunk size that is not hex: a proxy
            # writing its own error page into a stream) to the connection only, and drops the read
            # timeout: the body would wait forever. Its closing ends the body with an error instead.
            self._closed = connection.protocol.closed
            if self._closed is not None:
                self._closed.add_done_callback(self._ended)
                response.content.on_eof(self._forget)

    def _ended(self, _: asyncio.Future[None]) -> None:
        content = self._response.content
        if not content.is_eof() and content.exception() is None:
            content.set_exception(aiohttp.ClientPayloadError("the upstream connection closed before the body ended"))

    def _forget(self) -> None:
        if self._closed is not None:
            self._closed.remove_done_callback(self._ended)
            self._closed = None

    def chunks(self) -> AsyncIterator[bytes]:
        return _Chunks(self._response.content)

    async def read(self) -> bytes:
        try:
            return await self._response.content.read()  # no generator per chunk: one await for a small body
        except _ERRORS as exc:
            raise UpstreamError(classify(exc)) from exc

    async def aclose(self) -> None:
        self._forget()
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


MAX_REPLY_HEADER_BYTES = 32 * 1024
"""The longest reply header (and status line) read from an upstream, in bytes. aiohttp's default,
8,190, refused (502) heads the SDKs read directly: httpx's h11 and Node's undici take any head up
to 16 KiB in all, however it is split."""
MAX_REPLY_HEADERS = 1024
"""The most reply headers read from an upstream (aiohttp's default, 128, refused a relay that copies
its own upstream's headers); with :data:`MAX_REPLY_HEADER_BYTES`, a head holds at most 32 MiB."""


class AiohttpUpstream:
    """:class:`UpstreamClient` on aiohttp (the default).

    Args:
        max_connections: pool size across all upstreams.
    """

    def __init__(self, max_connections: int = 1000) -> None:
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[Timeouts, aiohttp.ClientTimeout] = {}

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0, ttl_dns_cache=60)
        # tokenward adds no headers of its own: whatever the client sent is what the upstream sees
        return aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            trust_env=False,
            max_line_size=MAX_REPLY_HEADER_BYTES,
            max_field_size=MAX_REPLY_HEADER_BYTES,
            max_headers=MAX_REPLY_HEADERS,
        )

    async def send(
        self, method: str, url: URL, headers: list[tuple[bytes, bytes]], body: Body, timeouts: Timeouts
    ) -> UpstreamReply:
        """See :meth:`UpstreamClient.send` (aiohttp writes ``url.raw_path_qs`` on the request line)."""
        session = self._session or self._set_session()
        timeout = self._timeouts.get(timeouts)
        if timeout is None:
            timeout = self._timeouts[timeouts] = aiohttp.ClientTimeout(
                total=None, sock_connect=timeouts.connect, sock_read=timeouts.read
            )
        fields = CIMultiDict([(name.decode("latin-1"), _header_text(value)) for name, value in headers])
        try:
            response = await session.request(
                method, url, headers=fields, data=body, allow_redirects=False, timeout=timeout, compress=None
            )
        except _ERRORS as exc:
            raise UpstreamError(classify(exc)) from exc
        return _AiohttpReply(response)

    def _set_session(self) -> aiohttp.ClientSession:
        self._session = self._open()
        return self._session

    async def aclose(self) -> None:
        """See :meth:`UpstreamClient.aclose`."""
        if self._session is not None:
            await self._session.close()


def _header_text(value: bytes) -> str:
    r"""A header value as text that aiohttp (which writes header lines as UTF-8) sends back as the same bytes.

    UTF-8 (OpenRouter's ``X-Title: Café``) is decoded as UTF-8; anything else as latin-1, which
    aiohttp then sends as the UTF-8 of those characters (``caf\xe9`` leaves as ``caf\xc3\xa9``).
    """
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


def _httpx_errors() -> tuple[type[BaseException], ...]:
    """:data:`_ERRORS` and httpx's own (evaluated only when something was raised)."""
    import httpx

    return (*_ERRORS, httpx.TransportError)


class _HttpxReply:
    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers = [(name.lower(), value) for name, value in response.headers.raw]

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except _httpx_errors() as exc:
            raise UpstreamError(classify(exc)) from exc

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstream:
    """:class:`UpstreamClient` on ``httpx.AsyncClient`` with any transport (tests: ``httpx.MockTransport``).

    Args:
        transport: the httpx transport to send through; ``None`` uses httpx's default.
    """

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        import httpx

        self._client = httpx.AsyncClient(transport=transport, follow_redirects=False, trust_env=False)
        for name in ("accept", "accept-encoding", "user-agent", "connection"):
            del self._client.headers[name]

    async def send(
        self, method: str, url: URL, headers: list[tuple[bytes, bytes]], body: Body, timeouts: Timeouts
    ) -> UpstreamReply:
        """See :meth:`UpstreamClient.send` (the httpx URL is built from components, not parsed from text)."""
        import httpx

        timeout = httpx.Timeout(timeouts.read, connect=timeouts.connect)
        target = httpx.URL(
            scheme=url.scheme, host=url.raw_host or "", port=url.explicit_port, raw_path=url.raw_path_qs.encode("ascii")
        )
        request = self._client.build_request(method, target, headers=headers, content=body, timeout=timeout)
        try:
            response = await self._client.send(request, stream=True)
        except _httpx_errors() as exc:
            raise UpstreamError(classify(exc)) from exc
        return _HttpxReply(response)

    async def aclose(self) -> None:
        """See :meth:`UpstreamClient.aclose`."""
        await self._client.aclose()
