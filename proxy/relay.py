"""The reply relay: an ASGI app sending one upstream reply to the client as it arrives.

Status, headers (minus hop-by-hop ones) and body bytes are the upstream's own; a
``Content-Encoding`` is relayed as is and decoded on the side for the meter. An SSE reply is
relayed chunk by chunk as it arrives, never buffered; a JSON reply is sent whole, then
metered. When tokenward asked for stream usage the client had not asked for, the extra
usage-only chunk, the ``"usage":null`` members and the usage on a chunk that carries choices are
removed again (:func:`strip_usage`); such a stream was asked for uncompressed, and if the
upstream compressed it all the same, the client gets the decoded events without
``Content-Encoding``.

The relay watches the client: one that leaves before the reply is complete ends the exchange
as ``client_disconnected``, and an SSE upstream is then read on (up to ``drain_timeout_s``) so
that its usage report is still recorded. An upstream that breaks off mid-reply makes the relay
break off too (no clean end of stream), so the client sees the truncation it would have seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from litestar.types import Receive, Scope, Send

from tokenward.proxy.errors import ProxyError, reply_error_body
from tokenward.proxy.exchange import Exchange, Outcome
from tokenward.proxy.limits import ClientConnection
from tokenward.proxy.metering import Meter
from tokenward.proxy.splice import remove_member
from tokenward.proxy.sse import parse_event
from tokenward.proxy.upstream import UpstreamError, UpstreamReply

__all__ = ["HOP_BY_HOP", "DisconnectWatch", "GiveUp", "Relay", "connection_options", "header", "strip_usage"]

log = logging.getLogger("tokenward.proxy")

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
"""Headers that describe one connection, never forwarded (RFC 9110 section 7.6.1)."""
_REPLY_DROPPED = HOP_BY_HOP | {b"content-length"}
_REPLY_KEPT = frozenset({b"content-type", b"content-encoding"})  # the relay and the meter read the body by them
MAX_WHOLE_BODY_BYTES = 128 * 1024 * 1024
"""A whole (not streamed) reply larger than this is relayed as it arrives and not metered (its row:
``usage_unknown``), instead of being held whole: it held twice its size (a 300 MiB body: +600 MiB of
peak RSS), and a body that never ends grew the proxy until it was killed. The largest real whole
replies fit: 2,048 embeddings of 3,072 floats are about 90 MB of JSON, ten base64 images about 40 MB."""
_BACKGROUND: set[asyncio.Future[None]] = set()  # recordings nobody waits for, kept alive until done
_USAGE_NULL = (b',"usage":null', b'"usage":null,')
_GAVE_UP = "client disconnected; the upstream sent nothing more within server.drain_after_disconnect_s"


def connection_options(headers: list[tuple[bytes, bytes]], kept: frozenset[bytes] = frozenset()) -> frozenset[bytes]:
    """The header names a message's ``Connection`` headers list (lower-case), but those in ``kept``.

    They are hop-by-hop for that one connection: a proxy removes them with ``Connection``
    itself before forwarding the message (RFC 9110 section 7.6.1). ``kept`` names headers
    tokenward reads to decide what it does with the message (its credential, the body's type
    and coding): they must mean the same to the next hop, so a ``Connection`` option cannot
    remove them.
    """
    named: set[bytes] = set()
    for key, value in headers:
        if key == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    named.discard(b"")
    return frozenset(named - kept)


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """Value of header ``name`` (lower-case) in a raw header list, or ``None``."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def strip_usage(block: bytes) -> bytes:
    """Undo what asking for stream usage added to one event (bytes in, bytes out).

    Drops the usage-only chunk (``"choices": []``); removes the ``"usage":null`` member that chunks
    carry only when usage was asked for, and the usage object of a chunk that also carries choices
    (OpenRouter and z.ai put asked-for usage on the finishing chunk), keeping every other byte of it.
    Only for upstreams that report stream usage only when asked (``stream_usage: ask``).
    """
    if b'"usage"' not in block:
        return block
    for pattern in _USAGE_NULL:
        if pattern in block:
            return block.replace(pattern, b"", 1)
    _, data = parse_event(block)
    if data is None or data == b"[DONE]":
        return block
    try:
        chunk = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return block
    if not isinstance(chunk, dict) or "usage" not in chunk:
        return block
    if chunk.get("choices") == [] and isinstance(chunk["usage"], dict):
        return b""
    edited = remove_member(data, "usage") if data in block else None  # a multi-line data field stays as is
    return block.replace(data, edited, 1) if edited is not None else block


class DisconnectWatch:
    """Watches for the client's disconnect without blocking the relay.

    With the server's :class:`~tokenward.proxy.limits.ClientConnection` (``connection``; a
    request served by tokenward's own server has one), it asks the connection itself, and
    :attr:`pending` is a future the connection resolves when it is lost. Without one (another ASGI
    server), a task waits in ``receive()`` for ``http.disconnect``; request body messages still
    arriving (an upstream that answered before reading the whole upload) are consumed and the
    watch re-armed.
    """

    __slots__ = ("_connection", "_receive", "_task")

    def __init__(self, receive: Receive, connection: ClientConnection | None = None) -> None:
        self._receive = receive
        self._connection = connection
        self._task: asyncio.Future[Any] = (
            connection.lost() if connection is not None else asyncio.ensure_future(receive())
        )

    def gone(self) -> bool:
        """Whether the client has disconnected (as far as the event loop has seen so far)."""
        if self._connection is not None:
            return self._connection.gone
        task = self._task
        if not task.done():
            return False
        if task.cancelled() or task.exception() is not None:
            return True
        if task.result().get("type") == "http.disconnect":
            return True
        self._task = asyncio.ensure_future(self._receive())
        return False

    @property
    def pending(self) -> asyncio.Future[Any]:
        """Done when the client disconnects (or, without a connection, sends anything)."""
        return self._task

    def close(self) -> None:
        """Stop watching."""
        if self._connection is not None:
            self._connection.release()
        elif not self._task.done():
            self._task.cancel()


class GiveUp:
    """Ends the wait for an upstream that sends nothing more once the client has left.

    The relay sees a disconnect when it next has something to send; an upstream that then sends
    nothing for a long while (up to its read timeout) would hold the row and its budget
    reservation that long. When the watch reports a disconnect, a timer of ``timeout_s`` starts;
    if it runs out while the current task waits for the upstream (:attr:`waiting`), the task is
    cancelled there and :attr:`fired` is set. Callers set :attr:`waiting` around each upstream
    await (the forwarder's send, the relay's reads), take back the cancellation with
    :meth:`given_up` and always :meth:`stop`. No task of its own: a callback and a timer.
    """

    __slots__ = ("_pending", "_task", "_timeout_s", "_timer", "fired", "waiting")

    def __init__(self, listener: DisconnectWatch, timeout_s: float) -> None:
        self._task = asyncio.current_task()
        self._timeout_s = timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self.waiting = False
        """Whether the relay is waiting for the upstream now (the only time it may be given up)."""
        self.fired = False
        self._pending = listener.pending
        self._pending.add_done_callback(self._heard)

    def _heard(self, done: asyncio.Future[Any]) -> None:
        if self._timer is not None or self._task is None:
            return
        if done.cancelled() or done.exception() is not None or done.result().get("type") == "http.disconnect":
            self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._fire)

    def _fire(self) -> None:
        if self.waiting and self._task is not None and not self.fired:
            self.fired = True
            self._task.cancel()

    def given_up(self) -> bool:
        """Whether a cancellation just received is this one (then it is taken back)."""
        if not self.fired or self._task is None:
            return False
        self._task.uncancel()
        return True

    def stop(self) -> None:
        """Stop watching (the relay drains on its own clock now, or is done)."""
        self._pending.remove_done_callback(self._heard)
        if self._timer is not None:
            self._timer.cancel()


class Relay:
    """ASGI app sending one upstream reply to the client and metering it as it passes.

    Created by the forwarder; Litestar calls it once with the request's ``receive`` and ``send``.
    It calls ``complete(relay)`` exactly once, which records the exchange: before the bytes that
    end the reply reach the client (the end of a JSON body, a stream's terminal event, the end of
    a pass-through body), so a client that saw its reply end always finds its row, even if the
    process is killed right after; or at the end, when the client is gone or the relay failed.

    Args:
        ex: the exchange being relayed.
        reply: the upstream reply (``None`` for a relay that only sends ``error``).
        complete: records the exchange; awaited once, with this relay.
        meter: meters the reply (``None``: a pass-through endpoint, not metered).
        request_body: the request as sent upstream (for a token estimate).
        watch: a disconnect watch already running (the relay starts one otherwise).
        drain_timeout_s: after the client leaves mid-stream, how long to read on for usage.
        extra_headers: headers tokenward adds to the reply (budget standing).
        raw_types: content types of a metered reply that are relayed as they arrive and not
            parsed (binary speech audio: its usage comes from the request).
        final_headers: for a reply sent whole (not streamed), called once the exchange is
            recorded; its headers (the request's cost, the budgets after it) replace those of
            ``extra_headers`` with the same names.
    """

    def __init__(
        self,
        ex: Exchange,
        reply: UpstreamReply | None,
        complete: Callable[[Relay], Awaitable[None]],
        *,
        meter: Meter | None = None,
        request_body: bytes = b"",
        dialect: str = "openai",
        strip_usage: bool = False,
        deferred_usage: bool = False,
        error: ProxyError | None = None,
        watch: DisconnectWatch | None = None,
        drain_timeout_s: float = 60.0,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
        raw_types: tuple[str, ...] = (),
        media: Any = None,
        final_headers: Callable[[Exchange], list[tuple[bytes, bytes]]] | None = None,
    ) -> None:
        self.complete = complete
        self.raw_types = raw_types
        self.media = media
        self.extra_headers = extra_headers or []
        self.final_headers = final_headers
        self.watch = watch
        self.drain_timeout_s = drain_timeout_s
        self.ex = ex
        self.reply = reply
        self.meter = meter
        self.request_body = request_body
        self.dialect = dialect
        self.strip_usage = strip_usage
        self.deferred_usage = deferred_usage
        self.error = error
        self.streaming = False
        self.got_reply = False
        self._completed = False
        self._scope: Scope = {}

    @classmethod
    def refusal(cls, ex: Exchange, error: ProxyError, complete: Callable[[Relay], Awaitable[None]]) -> Relay:
        """A relay that only sends tokenward's own error reply, once the exchange is recorded."""
        return cls(ex, None, complete, error=error)

    async def _complete(self) -> None:
        """Record the exchange now (once), before the reply's last bytes go out."""
        if not self._completed:
            self._completed = True
            await self.complete(self)

    def _complete_later(self) -> None:
        """Record the exchange without waiting (the client is gone, or the relay failed)."""
        if not self._completed:
            self._completed = True
            task = asyncio.ensure_future(self.complete(self))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the reply; runs once per request."""
        self._scope = scope  # an error reply is worded in the request's dialect
        if self.reply is None:
            await self._complete()
            await self._send_error(send)
            return
        ex, reply = self.ex, self.reply
        ex.http_status = reply.status
        dropped = _REPLY_DROPPED | connection_options(reply.headers, _REPLY_KEPT)
        headers = [(name, value) for name, value in reply.headers if name not in dropped]
        headers.append((b"x-tokenward-request-id", ex.request_id.encode()))
        headers.extend(self.extra_headers)
        content_type = (header(reply.headers, b"content-type") or "").strip().lower()  # media types ignore case
        self.streaming = self.meter is not None and content_type.startswith("text/event-stream")
        listener = self.watch or DisconnectWatch(receive)
        try:
            if self.meter is None or (self.raw_types and content_type.startswith(self.raw_types)):
                await self._relay_raw(send, headers, listener)
            elif self.streaming:
                await self._relay_stream(send, headers, listener)
            else:
                await self._relay_body(send, headers, listener)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # the server stopped (its grace ran out) mid-reply
                ex.end(Outcome.INTERRUPTED, error=f"tokenward shut down while the reply was being relayed ({exc})")
            else:
                ex.end(Outcome.PROXY_ERROR, error=f"relay failed: {type(exc).__name__}: {exc}")
            if isinstance(exc, Exception):
                log.exception("relay of %s failed", ex.request_id)
            raise
        finally:
            listener.close()
            try:
                await reply.aclose()
            except BaseException:  # noqa: S110 - closing must not stop the row from being recorded
                pass
            self._complete_later()

    async def _send_error(self, send: Send) -> None:
        error = self.error
        assert error is not None
        status = 400 if error.status == 499 else error.status
        scope = self._scope
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        body = reply_error_body(raw_path, scope["headers"], status, error.message, error.type, error.code)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-tokenward-request-id", self.ex.request_id.encode()),
            *error.headers,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _end_ok(self) -> None:
        status = self.ex.http_status or 0
        self.ex.end(Outcome.OK if status < 400 else Outcome.UPSTREAM_ERROR)

    async def _fail_before_start(self, send: Send, exc: UpstreamError) -> None:
        failure = exc.failure
        error = ProxyError(  # what happened, not where: the detail stays in the row
            failure.status, f"Upstream {self.ex.upstream!r}: {failure.summary}", "upstream_failed", "server_error"
        )
        self.ex.end(Outcome.UPSTREAM_FAILED, failure.status, failure.message)
        self.error = error
        await self._complete()
        await self._send_error(send)

    async def _relay_body(self, send: Send, headers: list[tuple[bytes, bytes]], listener: DisconnectWatch) -> None:
        assert self.reply is not None and self.meter is not None
        limit = MAX_WHOLE_BODY_BYTES
        length = header(self.reply.headers, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            self.meter.skip_oversized(limit)
            await self._relay_raw(send, headers, listener)
            return
        give_up = GiveUp(listener, self.drain_timeout_s)
        give_up.waiting = True
        rest = None
        try:
            if length is not None:
                body = await self.reply.read()
            else:  # no length announced: read no more than the cap
                parts, rest = await self._read_up_to(limit)
                body = b"".join(parts) if rest is None else b""
                if rest is None:
                    parts.clear()  # the body holds them now
        except UpstreamError as exc:
            give_up.waiting = False
            await self._fail_before_start(send, exc)
            return
        except asyncio.CancelledError:
            if not give_up.given_up():
                raise
            self.ex.end(Outcome.CLIENT_DISCONNECTED, error=_GAVE_UP)
            return
        finally:
            give_up.waiting = False
            give_up.stop()
        if rest is not None:
            self.meter.skip_oversized(limit)
            await self._relay_raw(send, headers, listener, parts, rest)
            return
        self.got_reply = True
        self.meter.feed_body(body)
        if listener.gone():
            self.ex.end(Outcome.CLIENT_DISCONNECTED, error="client disconnected before the reply")
            return
        headers.append((b"content-length", str(len(body)).encode()))
        self.ex.mark_first_byte()
        self._end_ok()
        await self._complete()
        if self.final_headers is not None:
            try:
                final = self.final_headers(self.ex)
            except Exception:  # headers are a courtesy: never lose the reply over them
                log.exception("final headers of %s failed", self.ex.request_id)
                final = []
            names = {name for name, _ in final}
            headers = [h for h in headers if h[0] not in names] + final
        await send({"type": "http.response.start", "status": self.ex.http_status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _read_up_to(self, limit: int) -> tuple[list[bytes], AsyncIterator[bytes] | None]:
        """The body's chunks if it is at most ``limit`` bytes; else those read, and the chunks still to come."""
        assert self.reply is not None
        parts: list[bytes] = []
        size = 0
        chunks = self.reply.chunks()
        async for chunk in chunks:
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                return parts, chunks
        return parts, None

    async def _relay_raw(
        self,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        listener: DisconnectWatch,
        prefix: list[bytes] | None = None,
        chunks: AsyncIterator[bytes] | None = None,
    ) -> None:
        """Relay the reply as it arrives; ``prefix``: body chunks already read, ``chunks``: the rest of them."""
        assert self.reply is not None
        length = header(self.reply.headers, b"content-length")
        expected = int(length) if length is not None and length.isdigit() else None
        if length is not None:
            headers.append((b"content-length", length.encode()))
        await send({"type": "http.response.start", "status": self.ex.http_status, "headers": headers})
        self.got_reply = True
        sent = 0
        while prefix:  # each is let go once sent
            piece = prefix.pop(0)
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            sent += len(piece)
            self.ex.mark_first_byte()
        try:
            async for chunk in chunks if chunks is not None else self.reply.chunks():
                if expected is not None and sent + len(chunk) >= expected:  # this chunk ends the body
                    self.ex.mark_first_byte()
                    if self.meter is not None:
                        self.meter.end_raw()
                    self._end_ok()
                    await self._complete()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                sent += len(chunk)
                self.ex.mark_first_byte()
                if listener.gone():
                    self.ex.end(Outcome.CLIENT_DISCONNECTED, error="client disconnected during the reply")
                    return
        except UpstreamError as exc:
            self._broke_off(exc)
            return
        if self.meter is not None:
            self.meter.end_raw()
        self._end_ok()
        await self._complete()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _relay_stream(self, send: Send, headers: list[tuple[bytes, bytes]], listener: DisconnectWatch) -> None:
        assert self.reply is not None and self.meter is not None
        meter, ex = self.meter, self.ex
        strip = self.strip_usage
        if strip and (header(self.reply.headers, b"content-encoding") or "identity").strip().lower() != "identity":
            # asked for identity, compressed all the same: the client gets the meter's decoded events
            headers = [(name, value) for name, value in headers if name != b"content-encoding"]
        await send({"type": "http.response.start", "status": ex.http_status, "headers": headers})
        self.got_reply = True
        chunks = self.reply.chunks()
        give_up = GiveUp(listener, self.drain_timeout_s)
        try:
            while True:
                give_up.waiting = True
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    give_up.waiting = False
                if listener.gone():  # left while this chunk was on its way (it may end the reply): never got it
                    meter.feed_stream(chunk)
                    give_up.stop()
                    ex.end(Outcome.CLIENT_DISCONNECTED, error="client disconnected during the stream")
                    if meter.terminal:  # nothing after it to wait for
                        meter.end_stream()
                    else:
                        await self._drain(chunks)
                    return
                blocks = meter.feed_stream(chunk)
                if meter.terminal and not self._completed:  # this chunk ends the reply: record first
                    ex.mark_first_byte()
                    self._end_ok()
                    await self._complete()
                if strip:
                    chunk = b"".join([strip_usage(block) for block in blocks])
                    if not chunk:
                        continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                ex.mark_first_byte()
                if listener.gone():
                    give_up.stop()  # the drain keeps its own clock
                    ex.end(Outcome.CLIENT_DISCONNECTED, error="client disconnected during the stream")
                    await self._drain(chunks)
                    return
            tail = meter.end_stream()
            self._end_ok()
            await self._complete()
            if strip and tail:
                await send({"type": "http.response.body", "body": b"".join(map(strip_usage, tail)), "more_body": True})
        except UpstreamError as exc:
            meter.end_stream()
            self._broke_off(exc)
            return
        except asyncio.CancelledError:
            if not give_up.given_up():
                raise
            meter.end_stream()
            ex.end(Outcome.CLIENT_DISCONNECTED, error=_GAVE_UP)
            return
        finally:
            give_up.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _broke_off(self, exc: UpstreamError) -> None:
        """End the exchange for an upstream that broke off mid-reply.

        The client's reply is left unfinished too (the server then closes the connection), as
        the upstream's was.
        """
        self.ex.end(Outcome.UPSTREAM_FAILED, error=exc.failure.message)
        log.warning("upstream broke off %s mid-reply: %s", self.ex.request_id, exc.failure.message)

    async def _drain(self, chunks: Any) -> None:
        """Read the rest of an upstream stream nobody receives, for its usage (bounded in time)."""
        assert self.meter is not None
        try:
            async with asyncio.timeout(self.drain_timeout_s):
                async for chunk in chunks:
                    self.meter.feed_stream(chunk)
                self.meter.end_stream()
        except (TimeoutError, UpstreamError) as exc:
            log.info("stopped reading %s after the client left: %s", self.ex.request_id, type(exc).__name__)
