"""Real processes for crash tests: a counting upstream, a proxy subprocess, client load that notes what completed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

# "hi" as one user message is 8 tokens for o200k_base (3 per message + role + text + 3 priming), as
# the budget guard counts it: the stub bills what a provider would
PROMPT_TOKENS, COMPLETION_TOKENS = 8, 5


class CountingUpstream:
    """An OpenAI-shaped upstream in a thread that remembers every request it received (by ``x-request-id``).

    Each reply reports ``PROMPT_TOKENS`` in and ``COMPLETION_TOKENS`` out after ``wait_s``; streamed
    requests get an SSE reply ending in a usage chunk and ``[DONE]``.
    """

    def __init__(self, wait_s: float = 0.02) -> None:
        self.wait_s = wait_s
        self.received: list[str] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> CountingUpstream:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._answer(request)
        except (ConnectionError, asyncio.CancelledError):  # the proxy was killed mid-reply
            raise web.HTTPServiceUnavailable() from None

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(request.headers.get("x-request-id", ""))
        await asyncio.sleep(float(request.headers.get("x-test-wait", self.wait_s)))
        total = PROMPT_TOKENS + COMPLETION_TOKENS
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS, "total_tokens": total}
        base = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": body["model"]}
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}
            return web.json_response({**base, "choices": [choice], "usage": usage})
        reply = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await reply.prepare(request)
        chunk = {**base, "object": "chat.completion.chunk"}
        for event in (
            {**chunk, "choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": None}]},
            {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {**chunk, "choices": [], "usage": usage},
        ):
            await reply.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await reply.write(b"data: [DONE]\n\n")
        await reply.write_eof()
        return reply


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a proxy subprocess to listen on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(directory: Path, upstream_url: str, port: int, extra: str = "") -> Path:
    config = directory / "tokenward.yaml"
    config.write_text(
        "upstreams:\n"
        f"  - {{name: openai, base_url: '{upstream_url}', default: true, provider: openai}}\n"
        f"server: {{port: {port}, drain_after_disconnect_s: 0}}\n"
        "ledger: {path: ledger.duckdb, flush_interval_s: 1.0}\n" + extra
    )
    return config


class ProxyProcess:
    """``tokenward serve --config ...`` as a real subprocess."""

    def __init__(self, config: Path, port: int, env: dict[str, str] | None = None) -> None:
        self.config, self.port = config, port
        self.env = env or {}  # added to the environment (a skewed clock's PYTHONPATH, say)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ProxyProcess:
        command = [str(Path(sys.executable).parent / "tokenward"), "serve", "--config", str(self.config)]
        with open(self.config.parent / "proxy.log", "ab") as log:  # the child keeps its own copy
            self.process = subprocess.Popen(
                [*command, "--log-level", "warning"],
                stdout=log,
                stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"proxy exited with {self.process.returncode}: {self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.process.kill()  # never leave it running behind a failed test
        self.process.wait(10)
        raise AssertionError(f"proxy did not start: {self.log()}")

    def log(self) -> str:
        return (self.config.parent / "proxy.log").read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught: -15 is a clean stop
        assert self.process.wait(30) in (0, -signal.SIGTERM), self.log()


@dataclass
class Load:
    """Client threads sending chat requests (half streamed), each with its own ``X-Request-Id``."""

    url: str
    clients: int = 30
    model: str = "gpt-4o-mini"
    headers: dict[str, str] = field(default_factory=dict)
    sent: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        for number in range(self.clients):
            thread = threading.Thread(target=self._run, args=(number % 2 == 1,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _run(self, stream: bool) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                request_id = uuid.uuid4().hex
                self.sent.append(request_id)
                headers = {"x-request-id": request_id, "authorization": "Bearer sk-client", **self.headers}
                try:
                    if stream:
                        with client.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=headers) as r:
                            text = b"".join(r.iter_bytes())
                            done = r.status_code == 200 and text.rstrip().endswith(b"data: [DONE]")
                    else:
                        r = client.post(f"{self.url}/v1/chat/completions", json=body, headers=headers)
                        done = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == COMPLETION_TOKENS
                    if r.status_code == 429:
                        self.refused.append(request_id)
                    elif done:
                        self.completed.append(request_id)
                except (httpx.HTTPError, json.JSONDecodeError, KeyError):
                    time.sleep(0.05)  # the proxy is gone: try again (it may be back)


def ledger_rows(path: Path) -> list[dict[str, Any]]:
    import duckdb

    conn = duckdb.connect(str(path), read_only=True)
    try:
        cursor = conn.execute("SELECT * FROM requests WHERE row_kind = 'request'")
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    finally:
        conn.close()


def children(pid: int) -> list[int]:
    """The process ids whose parent is ``pid`` (from ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def maps_duckdb(pid: int) -> bool:
    """Whether process ``pid`` has DuckDB's library mapped."""
    return "duckdb" in Path(f"/proc/{pid}/maps").read_text()
