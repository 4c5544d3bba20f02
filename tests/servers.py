"""Real HTTP servers for edge tests: a scripted upstream that logs raw request lines, and an attacker listener.

Both run on loopback in one background thread (aiohttp and a bare asyncio server), so a test
sees exactly the bytes that left tokenward: the request target as written on the wire, the
headers, the body.
"""

from __future__ import annotations

import asyncio
import json
import threading
import zlib
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request, bytes], Awaitable[web.StreamResponse]]


async def echo(request: web.Request, body: bytes) -> web.StreamResponse:
    """Default answer: the request line as JSON."""
    return web.json_response({"method": request.method, "target": request.raw_path, "bytes": len(body)})


class Servers:
    """A scripted upstream (``upstream_url``) and an attacker listener (``attacker_port``).

    ``handler`` answers the upstream's requests; every request is logged in :attr:`requests` as
    ``{"method", "target", "headers", "body"}`` (headers lower-cased) with ``target`` the raw request target (path and
    query as sent). :attr:`attacker_bytes` collects whatever reaches the attacker (it must stay
    empty); :attr:`attacker_connections` counts its connections.
    """

    def __init__(self, handler: Handler = echo) -> None:
        self.handler = handler
        self.requests: list[dict[str, Any]] = []
        self.attacker_bytes = bytearray()
        self.attacker_connections = 0
        self.port = 0
        self.attacker_port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    @property
    def upstream_url(self) -> str:
        """``http://127.0.0.1:PORT`` (no path)."""
        return f"http://127.0.0.1:{self.port}"

    @contextmanager
    def running(self) -> Iterator[Servers]:
        """Start both servers, yield, stop them."""
        ready = threading.Event()
        thread = threading.Thread(target=lambda: asyncio.run(self._main(ready)), daemon=True, name="edge-servers")
        thread.start()
        if not ready.wait(10):
            raise RuntimeError("edge test servers did not start")
        try:
            yield self
        finally:
            assert self._loop is not None and self._stop is not None
            self._loop.call_soon_threadsafe(self._stop.set)
            thread.join(10)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(
            {
                "method": request.method,
                "target": request.raw_path,
                "headers": {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.raw_headers},
                "body": body,
            }
        )
        return await self.handler(request, body)

    async def _attacker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.attacker_connections += 1
        try:
            while data := await reader.read(65536):
                self.attacker_bytes += data
        finally:
            writer.close()

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        assert site._server is not None
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        attacker = await asyncio.start_server(self._attacker, "127.0.0.1", 0)
        self.attacker_port = attacker.sockets[0].getsockname()[1]
        ready.set()
        await self._stop.wait()
        attacker.close()
        await runner.cleanup()


def raw_request(
    url: str, method: str, target: bytes, headers: dict[str, str] | None = None, body: bytes = b""
) -> tuple[int, bytes]:
    """Send one HTTP/1.1 request with ``target`` exactly as given (no client normalises it); returns (status, body)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    lines = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: " + host.encode(), b"Connection: close"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}".encode())
    lines.append(b"Content-Length: " + str(len(body)).encode())
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        rest = _unchunk(rest)
    return status, rest


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return out


CHAT_CHUNKS = [
    {"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o-mini-2024-07-18", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    {"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o-mini-2024-07-18", "choices": [{"index": 0, "delta": {"content": "2, 3, 5"}, "finish_reason": None}]},
    {"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o-mini-2024-07-18", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
]  # fmt: skip
CHAT_USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}


def chat_stream(asked: bool, *, usage_on_finishing_chunk: bool = False) -> list[bytes]:
    """The events of a chat stream as an OpenAI-style upstream sends them (usage only when ``asked``).

    With ``usage_on_finishing_chunk`` the usage rides on the last chunk with choices (as some
    OpenAI-compatible providers do) instead of a usage-only chunk.
    """
    chunks = [dict(c) for c in CHAT_CHUNKS]
    if asked and usage_on_finishing_chunk:
        chunks[-1]["usage"] = CHAT_USAGE
    elif asked:
        chunks.append(
            {
                "id": "c1",
                "object": "chat.completion.chunk",
                "model": chunks[0]["model"],
                "choices": [],
                "usage": CHAT_USAGE,
            }
        )
    events = [b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks]
    return [*events, b"data: [DONE]\n\n"]


async def api(request: web.Request, body: bytes) -> web.StreamResponse:
    """A small OpenAI + Anthropic upstream: models, files, count_tokens, messages, chat completions; echo otherwise.

    ``x-test-reply: gzip`` makes chat streams gzip-compressed whatever the request's
    ``accept-encoding``; ``x-test-reply: finishing-usage`` puts asked-for usage on the last chunk.
    """
    path = request.path
    kind = request.headers.get("x-test-reply", "")
    if request.method == "HEAD":
        return web.Response(body=b"x" * 42, headers={"x-upstream": "head"})
    if request.method == "OPTIONS":
        return web.Response(status=204, headers={"allow": "GET, POST, OPTIONS", "x-upstream": "options"})
    if path.endswith("/files") and request.method == "POST":  # a created file (its owner is recorded)
        return web.json_response({"id": "file-1", "object": "file", "bytes": len(body), "purpose": "batch"})
    if path.endswith("/files") and request.method == "GET":
        return web.json_response({"object": "list", "data": [{"id": "file-1", "object": "file"}], "has_more": False})
    if path.endswith("/messages/count_tokens"):
        return web.json_response({"input_tokens": 17})
    if path.endswith("/models") and "anthropic" in path:
        model = {
            "type": "model",
            "id": "claude-sonnet-4-5",
            "display_name": "Claude Sonnet 4.5",
            "created_at": "2025-09-29T00:00:00Z",
        }
        return web.json_response({"data": [model], "has_more": False, "first_id": model["id"], "last_id": model["id"]})
    if path.endswith("/models"):
        return web.json_response(
            {"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model", "created": 0, "owned_by": "test"}]}
        )
    if path.endswith("/messages"):
        return web.json_response(
            {
                "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5-20250929",
                "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 20, "output_tokens": 5},
            }
        )  # fmt: skip
    if path.endswith("/chat/completions") and request.method == "POST":
        document = json.loads(body)
        options = document.get("stream_options")
        asked = isinstance(options, dict) and options.get("include_usage") is True
        if not document.get("stream"):
            return web.json_response(
                {
                    "id": "c1", "object": "chat.completion", "model": "gpt-4o-mini-2024-07-18",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "2, 3, 5"}, "finish_reason": "stop"}],
                    "usage": CHAT_USAGE,
                }
            )  # fmt: skip
        events = chat_stream(asked, usage_on_finishing_chunk=kind == "finishing-usage")
        headers = {"content-type": "text/event-stream"}
        gzip = kind == "gzip"
        if gzip:
            headers["content-encoding"] = "gzip"
        stream = web.StreamResponse(headers=headers)
        await stream.prepare(request)
        compressor = zlib.compressobj(wbits=31)
        for event in events:
            await stream.write(compressor.compress(event) + compressor.flush(zlib.Z_SYNC_FLUSH) if gzip else event)
        if gzip:
            await stream.write(compressor.flush())
        await stream.write_eof()
        return stream
    return await echo(request, body)


def post_then_leave(url: str, arrived: Callable[[], bool], **kwargs: Any) -> None:
    """POST to ``url`` (``httpx`` keyword arguments) and hang up once ``arrived()`` is true.

    The client leaves on a condition (the request has reached the upstream, say) rather than on
    a short client timeout: on a loaded machine such a timeout can expire before the request is
    even sent (no request, no row), or after the reply it was meant to miss has come.

    Raises:
        AssertionError: the reply came before the client left, or ``arrived()`` stayed false for 30 s.
    """
    import httpx

    async def post() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            request = asyncio.ensure_future(client.post(url, **kwargs))
            for _ in range(3000):
                if arrived() or request.done():
                    break
                await asyncio.sleep(0.01)
            assert not request.done(), f"the reply came before the client left: {request.result()}"
            assert arrived(), "the request never arrived"
            request.cancel()  # the connection closes: the client is gone
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(post())
