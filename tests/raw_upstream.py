"""A raw TCP upstream for billing-fault tests: each request is answered by a script of byte writes.

Unlike an HTTP framework, it can send what a broken upstream or a middlebox sends: a chunked body
with a chunk size that is not hex, a reply cut mid-head, a reset. It runs on loopback in a
background thread; :attr:`RawUpstream.script` is called with each request's head and body and
returns the steps: ``bytes`` to write, a ``float`` to sleep (seconds), ``"close"`` or ``"reset"``.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Step = bytes | float | str
Script = Callable[[bytes, bytes], list[Step]]


class RawUpstream:
    """A scripted upstream at :attr:`url`; :attr:`requests` logs each ``(head, body)`` received."""

    def __init__(self) -> None:
        self.script: Script = lambda head, body: ["close"]
        self.requests: list[tuple[bytes, bytes]] = []
        self.port = 0

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (no path)."""
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                for step in self.script(head, body):
                    if isinstance(step, float):
                        await asyncio.sleep(step)
                    elif step == "close":
                        return
                    elif step == "reset":
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        writer.transport.abort()
                        return
                    else:
                        assert isinstance(step, bytes)
                        writer.write(step)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @contextmanager
    def running(self) -> Iterator[RawUpstream]:
        """Start the server, yield, stop it."""
        ready = threading.Event()
        state: dict[str, asyncio.AbstractEventLoop | asyncio.Event] = {}

        async def main() -> None:
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            stop = asyncio.Event()
            state.update(loop=asyncio.get_running_loop(), stop=stop)
            ready.set()
            await stop.wait()
            server.close()

        thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True, name="raw-upstream")
        thread.start()
        if not ready.wait(10):
            raise RuntimeError("raw upstream did not start")
        try:
            yield self
        finally:
            loop, stop = state["loop"], state["stop"]
            assert isinstance(loop, asyncio.AbstractEventLoop) and isinstance(stop, asyncio.Event)
            loop.call_soon_threadsafe(stop.set)
            thread.join(10)


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


LAST_CHUNK = b"0\r\n\r\n"


def sse_head(extra: bytes = b"") -> bytes:
    """A 200 SSE reply head with a chunked body."""
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n" + extra + b"\r\n"


def json_reply(body: bytes, status: bytes = b"200 OK") -> bytes:
    """A whole JSON reply with a content-length."""
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )
