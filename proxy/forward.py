"""Where a request's bytes go: client -> tokenward -> upstream -> tokenward -> client.

:meth:`Forwarder.metered` handles the metered endpoints (``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``); :meth:`Forwarder.passthrough`
forwards every other ``/v1`` request untouched. Both return a :class:`Relay`, the ASGI app
that sends the upstream's reply to the client:

* status, headers (minus hop-by-hop ones) and body bytes are the upstream's own; a
  ``Content-Encoding`` is relayed as is and decoded on the side for the meter;
* an SSE reply is relayed chunk by chunk as it arrives, never buffered; a JSON reply is sent
  whole, then metered;
* for streamed chat/completions requests tokenward asks the upstream for usage
  (``stream_options.include_usage``); when the client had not asked for it, the extra
  usage-only chunk and the ``"usage":null`` members it caused are removed again, so the client
  receives the events it would have received without tokenward.

Every path ends the :class:`~tokenward.proxy.exchange.Exchange` once and hands it to the
recorder once, including refusals, upstream failures and client disconnects.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
from litestar import Request
from litestar.exceptions import ClientException, InternalServerException
from litestar.types import Receive, Scope, Send

from tokenward.pricing.usage import UsageSource
from tokenward.proxy.errors import ProxyError, error_body
from tokenward.proxy.exchange import Exchange, Outcome
from tokenward.proxy.keys import AUTH_HEADERS, Authenticator, presented_key
from tokenward.proxy.metering import Meter, estimate
from tokenward.proxy.recorder import Recorder
from tokenward.proxy.routing import Route, Router
from tokenward.proxy.sse import parse_event
from tokenward.proxy.upstream import UpstreamClient, UpstreamError, UpstreamReply

__all__ = ["METERED_ENDPOINTS", "Endpoint", "Forwarder", "Relay", "header"]

log = logging.getLogger("tokenward.proxy")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A metered endpoint: its ledger name, its dialect, and whether streams need usage asked for."""

    name: str
    dialect: str
    asks_stream_usage: bool


METERED_ENDPOINTS = {
    "chat/completions": Endpoint("chat_completions", "openai", True),
    "completions": Endpoint("completions", "openai", True),
    "embeddings": Endpoint("embeddings", "openai", False),
    "responses": Endpoint("responses", "openai", False),
    "messages": Endpoint("anthropic_messages", "anthropic", False),
}
"""Metered endpoints by path below ``/v1``."""

_HOP_BY_HOP = frozenset(
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
_NOT_FORWARDED = _HOP_BY_HOP | {b"host", b"content-length"}
_REPLY_DROPPED = _HOP_BY_HOP | {b"content-length"}
_UPSTREAM_HEADER = b"x-tokenward-upstream"
_INCLUDE_USAGE = b'"stream_options":{"include_usage":true}'
_USAGE_NULL = (b',"usage":null', b'"usage":null,')
_OUTCOME_BY_STATUS = {
    400: Outcome.CLIENT_ERROR,
    401: Outcome.UNAUTHORIZED,
    502: Outcome.UPSTREAM_UNREACHABLE,
    504: Outcome.UPSTREAM_TIMEOUT,
}


class _RequestHead(msgspec.Struct):
    """The request members tokenward acts on; every other member is skipped unparsed."""

    model: Any = None
    stream: Any = None
    stream_options: Any = msgspec.UNSET
    background: Any = None


_decode_head = msgspec.json.Decoder(_RequestHead).decode


@dataclass(slots=True)
class _Inbound:
    """What one pass over the client's headers found."""

    headers: list[tuple[bytes, bytes]]
    key: str | None = None
    client_request_id: str | None = None
    upstream: str | None = None


class Forwarder:
    """Sends requests upstream and builds the reply relay.

    Args:
        client: the shared upstream client (:mod:`tokenward.proxy.upstream`).
        router: picks the upstream per request.
        auth: names the caller.
        recorder: receives every finished exchange.
        drain_timeout_s: after a client disconnects mid-stream, how long to keep reading the
            upstream for its usage report.
    """

    def __init__(
        self,
        client: UpstreamClient,
        router: Router,
        auth: Authenticator,
        recorder: Recorder,
        *,
        drain_timeout_s: float = 60.0,
    ) -> None:
        self.client = client
        self.router = router
        self.auth = auth
        self.recorder = recorder
        self.drain_timeout_s = drain_timeout_s

    async def metered(self, request: Request[Any, Any, Any], endpoint: Endpoint) -> Relay:
        """Forward a metered request; the returned relay meters and records the reply."""
        ex = Exchange(endpoint=endpoint.name, method="POST", path=request.scope["path"])
        try:
            return await self._metered(request, endpoint, ex)
        except BaseException as exc:
            return self._refuse(ex, exc)

    async def passthrough(self, request: Request[Any, Any, Any]) -> Relay:
        """Forward any other ``/v1`` request as is (body streamed both ways); it is recorded unmetered."""
        scope = request.scope
        ex = Exchange(endpoint="passthrough", method=scope["method"], path=scope["path"])
        try:
            inbound = self._inbound(scope, ex, keep_length=True)
            route = self.router.pick(None, inbound.upstream)
            self._attach(ex, route, inbound)
            has_body = any(name in (b"content-length", b"transfer-encoding") for name, _ in scope["headers"])
            content = request.stream() if has_body else None
            reply = await self._send(route, scope, inbound.headers, content, ex)
            return Relay(self, ex, reply, meter=None, request_body=b"")
        except BaseException as exc:
            return self._refuse(ex, exc)

    async def _metered(self, request: Request[Any, Any, Any], endpoint: Endpoint, ex: Exchange) -> Relay:
        scope = request.scope
        inbound = self._inbound(scope, ex, keep_length=False)
        body = await request.body()
        try:
            head = _decode_head(body)
        except msgspec.ValidationError as exc:
            raise ProxyError(400, f"The request body must be a JSON object: {exc}", "invalid_json") from exc
        except msgspec.DecodeError as exc:
            raise ProxyError(400, f"We could not parse the JSON body of your request: {exc}", "invalid_json") from exc
        ex.requested_model = head.model if isinstance(head.model, str) else None
        ex.stream = head.stream is True
        route = self.router.pick(ex.requested_model, inbound.upstream)
        self._attach(ex, route, inbound)
        strip_usage = False
        if (
            ex.stream
            and endpoint.asks_stream_usage
            and route.config.stream_usage == "ask"
            and not _asks_usage(head.stream_options)
        ):
            body = _with_include_usage(body, head.stream_options)
            strip_usage = True
        reply = await self._send(route, scope, inbound.headers, body, ex)
        meter = Meter(endpoint.dialect, header(reply.headers, b"content-encoding"))
        return Relay(
            self,
            ex,
            reply,
            meter=meter,
            request_body=body,
            dialect=endpoint.dialect,
            strip_usage=strip_usage,
            deferred_usage=head.background is True,
        )

    def _inbound(self, scope: Scope, ex: Exchange, *, keep_length: bool) -> _Inbound:
        """One pass over the client's headers: what to forward, who is calling, what it asked."""
        passthrough = self.auth.passthrough
        dropped = _HOP_BY_HOP | {b"host"} if keep_length else _NOT_FORWARDED
        inbound = _Inbound(headers=[])
        has_encoding = False
        for name, value in scope["headers"]:
            if name in dropped:
                continue
            if name in AUTH_HEADERS:
                inbound.key = inbound.key or presented_key(name, value)
                if not passthrough:
                    continue
            elif name == b"x-request-id":
                inbound.client_request_id = value.decode("latin-1")
            elif name == _UPSTREAM_HEADER:
                inbound.upstream = value.decode("latin-1")
                continue
            elif name == b"accept-encoding":
                has_encoding = True
            inbound.headers.append((name, value))
        if not has_encoding:
            inbound.headers.append((b"accept-encoding", b"identity"))
        ex.client_request_id = inbound.client_request_id
        ex.principal = self.auth.principal(inbound.key)
        return inbound

    def _attach(self, ex: Exchange, route: Route, inbound: _Inbound) -> None:
        ex.upstream = route.name
        ex.provider = route.config.catalog_provider
        if not self.auth.passthrough:
            if route.auth_header is None:
                raise ProxyError(
                    500,
                    f"Upstream {route.name!r} has no API key: set {route.config.api_key_env or 'api_key_env'}.",
                    "upstream_key_missing",
                    "server_error",
                )
            inbound.headers.append(route.auth_header)

    async def _send(
        self, route: Route, scope: Scope, headers: list[tuple[bytes, bytes]], content: Any, ex: Exchange
    ) -> UpstreamReply:
        """Send upstream, retrying as the route allows when ``content`` can be sent again.

        Each failed attempt that may have reached the provider is recorded as an ``attempt`` row.

        Raises:
            ProxyError: 502/504 once no attempt is left.
        """
        path: bytes = scope.get("raw_path") or scope["path"].encode()
        url = route.base_url + path[3:].decode("latin-1")  # path starts with /v1
        if scope["query_string"]:
            url += "?" + scope["query_string"].decode("latin-1")
        policy = route.config
        retries = policy.retries if content is None or isinstance(content, bytes) else 0
        notes: list[str] = []
        for attempt in range(retries + 1):
            last = attempt == retries
            try:
                reply = await self.client.send(scope["method"], url, headers, content, route.timeouts)
            except UpstreamError as exc:
                failure = exc.failure
                if last:
                    ex.maybe_billed = failure.maybe_sent
                    code = "upstream_timeout" if failure.status == 504 else "upstream_unreachable"
                    message = f"Upstream {route.name!r}: {failure.message}"
                    raise ProxyError(failure.status, message, code, "server_error") from exc
                notes.append(failure.message)
                if failure.maybe_sent:
                    self._record_attempt(ex, attempt + 1, failure.status, failure.message)
                delay = policy.retry_backoff_s * 2**attempt
            else:
                if last or reply.status not in policy.retry_statuses:
                    if notes:
                        ex.error = f"succeeded after {len(notes)} retries: " + "; ".join(notes)
                    return reply
                notes.append(f"upstream answered {reply.status}")
                delay = _retry_after(reply) or policy.retry_backoff_s * 2**attempt
                await reply.aclose()
            await asyncio.sleep(min(delay, 30.0))
        raise AssertionError("unreachable")  # pragma: no cover

    def _record_attempt(self, ex: Exchange, number: int, status: int, message: str) -> None:
        attempt = ex.attempt(number)
        attempt.maybe_billed = True
        attempt.end(_OUTCOME_BY_STATUS.get(status, Outcome.UPSTREAM_UNREACHABLE), status, message)
        self.recorder.finish(attempt)

    def _refuse(self, ex: Exchange, exc: BaseException) -> Relay:
        """End ``ex`` for a request that got no upstream reply, and build the error reply."""
        if isinstance(exc, ProxyError):
            error = exc
            outcome = _OUTCOME_BY_STATUS.get(exc.status, Outcome.PROXY_ERROR)
        elif isinstance(exc, ClientException | InternalServerException) and "disconnect" in str(exc).lower():
            error = ProxyError(499, "client disconnected", "client_disconnected")
            outcome = Outcome.CLIENT_DISCONNECTED
        else:
            if not isinstance(exc, Exception):
                ex.end(Outcome.PROXY_ERROR, 500, f"interrupted: {type(exc).__name__}")
                self.recorder.finish(ex)
                raise exc
            log.exception("request %s failed inside tokenward", ex.request_id, exc_info=exc)
            error = ProxyError(500, "tokenward failed to handle the request", "proxy_error", "server_error")
            outcome = Outcome.PROXY_ERROR
        ex.end(outcome, error.status, error.message)
        self.recorder.finish(ex)
        return Relay.refusal(self, ex, error)

    def complete(self, ex: Exchange, meter: Meter | None, request_body: bytes, relay: Relay) -> None:
        """Meter what the reply said and record the exchange (called once by the relay)."""
        if meter is None:
            self.recorder.finish(ex)
            return
        result = meter.finish()
        ex.served_model = result.model or None
        ex.service_tier = result.service_tier
        ex.provider_cost = result.provider_cost
        if result.error is not None:
            ex.error = ex.error or result.error
            if ex.outcome is Outcome.OK:
                ex.outcome = Outcome.UPSTREAM_ERROR
        if result.usage is not None:
            ex.usage = result.usage
            ex.parts = result.parts
            ex.raw_usage = result.raw_usage
            self.recorder.finish(ex)
            return
        status = ex.http_status or 0
        billable = 200 <= status < 300 and result.error is None and relay.got_reply
        if billable and relay.deferred_usage:
            ex.usage_deferred = True
            billable = False
        if not billable:
            self.recorder.finish(ex)
            return
        source = UsageSource.ESTIMATED if ex.outcome is Outcome.OK else UsageSource.PARTIAL
        job = partial(
            estimate,
            relay.dialect,
            request_body,
            list(meter.kept_reply),
            stream=relay.streaming,
            model=ex.served_model or ex.requested_model,
            source=source,
        )
        self.recorder.finish(ex, estimate=job)


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """Value of header ``name`` (lower-case) in a raw header list, or ``None``."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def _retry_after(reply: UpstreamReply) -> float | None:
    """Seconds from a reply's ``Retry-After`` header (the seconds form only)."""
    value = header(reply.headers, b"retry-after")
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:
        return None


def _asks_usage(options: Any) -> bool:
    return isinstance(options, dict) and options.get("include_usage") is True


def _with_include_usage(body: bytes, options: Any) -> bytes:
    """The request body with ``stream_options.include_usage`` set to true.

    The common case (no ``stream_options`` member) splices the member in after the opening
    brace without re-encoding the body; otherwise the body is re-encoded.
    """
    if options is msgspec.UNSET:
        start = body.index(b"{") + 1
        rest = body[start:].lstrip()
        return body[:start] + _INCLUDE_USAGE + (b"," if not rest.startswith(b"}") else b"") + body[start:]
    document = msgspec.json.decode(body)
    document["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return msgspec.json.encode(document)


def _strip_usage(block: bytes) -> bytes:
    """Undo what asking for stream usage added to one event.

    Drops the usage-only chunk, and the ``"usage":null`` member that chunks carry only when usage
    was asked for.
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
    if isinstance(chunk, dict) and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict):
        return b""
    return block


class _DisconnectWatch:
    """Watches an ASGI ``receive`` for ``http.disconnect`` without blocking the relay.

    Request body messages still arriving (an upstream that answered before reading the whole
    upload) are consumed and the watch re-armed.
    """

    __slots__ = ("_receive", "_task")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Future[Any] = asyncio.ensure_future(receive())

    def gone(self) -> bool:
        """Whether the client has disconnected (as far as the event loop has seen so far)."""
        task = self._task
        if not task.done():
            return False
        if task.cancelled() or task.exception() is not None:
            return True
        if task.result().get("type") == "http.disconnect":
            return True
        self._task = asyncio.ensure_future(self._receive())
        return False

    def close(self) -> None:
        """Stop watching."""
        if not self._task.done():
            self._task.cancel()


class Relay:
    """ASGI app sending one upstream reply to the client, metering it, and recording the exchange.

    Created by :class:`Forwarder`; Litestar calls it once with the request's ``receive`` and
    ``send``. It watches ``receive`` for the client going away: a client that leaves before
    the reply is complete ends the exchange as ``client_disconnected``, and an SSE upstream is
    then read on (up to ``drain_timeout_s``) so that its usage report is still recorded.
    """

    def __init__(
        self,
        forwarder: Forwarder,
        ex: Exchange,
        reply: UpstreamReply | None,
        *,
        meter: Meter | None,
        request_body: bytes,
        dialect: str = "openai",
        strip_usage: bool = False,
        deferred_usage: bool = False,
        error: ProxyError | None = None,
    ) -> None:
        self.forwarder = forwarder
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

    @classmethod
    def refusal(cls, forwarder: Forwarder, ex: Exchange, error: ProxyError) -> Relay:
        """A relay that only sends tokenward's own error reply (the exchange is already recorded)."""
        return cls(forwarder, ex, None, meter=None, request_body=b"", error=error)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the reply; runs once per request."""
        if self.reply is None:
            await self._send_error(send)
            return
        ex, reply = self.ex, self.reply
        ex.http_status = reply.status
        headers = [(name, value) for name, value in reply.headers if name not in _REPLY_DROPPED]
        headers.append((b"x-tokenward-request-id", ex.request_id.encode()))
        content_type = header(reply.headers, b"content-type") or ""
        self.streaming = self.meter is not None and content_type.startswith("text/event-stream")
        listener = _DisconnectWatch(receive)
        try:
            if self.meter is None:
                await self._relay_raw(send, headers, listener)
            elif self.streaming:
                await self._relay_stream(send, headers, listener)
            else:
                await self._relay_body(send, headers, listener)
        except BaseException as exc:
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
            self.forwarder.complete(ex, self.meter, self.request_body, self)

    async def _send_error(self, send: Send) -> None:
        error = self.error
        assert error is not None
        body = error_body(error.message, error.type, error.code)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-tokenward-request-id", self.ex.request_id.encode()),
        ]
        status = 400 if error.status == 499 else error.status
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _end_ok(self) -> None:
        status = self.ex.http_status or 0
        self.ex.end(Outcome.OK if status < 400 else Outcome.UPSTREAM_ERROR)

    async def _fail_before_start(self, send: Send, exc: UpstreamError) -> None:
        failure = exc.failure
        error = ProxyError(
            failure.status, f"Upstream {self.ex.upstream!r}: {failure.message}", "upstream_failed", "server_error"
        )
        self.ex.end(Outcome.UPSTREAM_FAILED, failure.status, failure.message)
        self.error = error
        await self._send_error(send)

    async def _relay_body(self, send: Send, headers: list[tuple[bytes, bytes]], listener: _DisconnectWatch) -> None:
        assert self.reply is not None and self.meter is not None
        try:
            body = b"".join([chunk async for chunk in self.reply.chunks()])
        except UpstreamError as exc:
            await self._fail_before_start(send, exc)
            return
        self.got_reply = True
        self.meter.feed_body(body)
        await asyncio.sleep(0)  # let the listener see a disconnect that already happened
        if listener.gone():
            self.ex.end(Outcome.CLIENT_DISCONNECTED, error="client disconnected before the reply")
            return
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": self.ex.http_status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self.ex.mark_first_byte()
        self._end_ok()

    async def _relay_raw(self, send: Send, headers: list[tuple[bytes, bytes]], listener: _DisconnectWatch) -> None:
        assert self.reply is not None
        length = header(self.reply.headers, b"content-length")
        if length is not None:
            headers.append((b"content-length", length.encode()))
        await send({"type": "http.response.start", "status": self.ex.http_status, "headers": headers})
        self.got_reply = True
        try:
            async for chunk in self.reply.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.ex.mark_first_byte()
                if listener.gone():
                    self.ex.end(Outcome.CLIENT_DISCONNECTED, error="client disconnected during the reply")
                    return
        except UpstreamError as exc:
            self.ex.end(Outcome.UPSTREAM_FAILED, error=exc.failure.message)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._end_ok()

    async def _relay_stream(self, send: Send, headers: list[tuple[bytes, bytes]], listener: _DisconnectWatch) -> None:
        assert self.reply is not None and self.meter is not None
        meter, ex = self.meter, self.ex
        strip = self.strip_usage and header(self.reply.headers, b"content-encoding") in (None, "identity")
        await send({"type": "http.response.start", "status": ex.http_status, "headers": headers})
        self.got_reply = True
        chunks = self.reply.chunks()
        try:
            async for chunk in chunks:
                blocks = meter.feed_stream(chunk)
                if strip:
                    chunk = b"".join([_strip_usage(block) for block in blocks])
                    if not chunk:
                        continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                ex.mark_first_byte()
                if listener.gone():
                    ex.end(Outcome.CLIENT_DISCONNECTED, error="client disconnected during the stream")
                    await self._drain(chunks)
                    return
            tail = meter.end_stream()
            if strip and tail:
                await send({"type": "http.response.body", "body": b"".join(map(_strip_usage, tail)), "more_body": True})
        except UpstreamError as exc:
            meter.end_stream()
            ex.end(Outcome.UPSTREAM_FAILED, error=exc.failure.message)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._end_ok()

    async def _drain(self, chunks: Any) -> None:
        """Read the rest of an upstream stream nobody receives, for its usage (bounded in time)."""
        assert self.meter is not None
        try:
            async with asyncio.timeout(self.forwarder.drain_timeout_s):
                async for chunk in chunks:
                    self.meter.feed_stream(chunk)
                self.meter.end_stream()
        except (TimeoutError, UpstreamError) as exc:
            log.info("stopped reading %s after the client left: %s", self.ex.request_id, type(exc).__name__)
