"""An OpenAI- and Anthropic-compatible upstream simulator: replays recordings, makes up the rest.

Used by ``tokenward simulate``, ``tokenward demo`` and the tests as a real HTTP upstream. Each
recording is one line of the ``shared/fixtures/recorded/exchanges.jsonl`` format (a small
sample ships in ``simulator_data/sample_exchanges.jsonl``). A request is answered with the
recording named by its ``x-tokenward-sim-record`` header or, failing that, the recording whose
request body is the same JSON (``stream_options`` ignored). Any other well-formed request to
chat/completions, completions, responses, embeddings or messages gets a synthesised reply in
that API's shape, streamed or not, with usage counted by the tokenizer
(:mod:`tokenward.proxy.synthetic`), and the token-counting endpoints (``messages/count_tokens``,
``responses/input_tokens``) answer that count; a header naming an unknown recording gets a 404. Replies
carry ``x-tokenward-sim-source: recording`` or ``synthetic``. JSON bodies are sent compact;
SSE text is sent byte for byte, one event per write.

Like OpenAI, the simulator leaves stream usage out when a chat/completions stream request
does not set ``stream_options.include_usage`` although the recorded request did: the
usage-only chunk is dropped and ``usage`` members are removed. (A recording made without the
option is replayed as is: that provider sends usage regardless.)

Fault injection, by request header ``x-tokenward-sim-fault``: ``hang`` (never answer),
``reset`` (close the connection without answering), ``gzip`` (gzip the body), ``cut:N``
(send N events, then close the connection), ``delay:MS`` (wait MS between events),
``flaky:N:STATUS`` (answer the first N requests for that recording with STATUS, or reset the
connection when STATUS is ``reset``; then replay), ``wait:MS`` (answer after MS milliseconds).
"""

from __future__ import annotations

import asyncio
import email.policy
import gzip
import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.parser import BytesParser
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from tokenward.proxy.sse import SSEDecoder, parse_event
from tokenward.proxy.synthetic import count_reply, endpoint_of, synthesise

__all__ = ["Recording", "SimulatorServer", "load_recordings", "sample_recordings_path", "synthetic_recording"]

RECORD_HEADER = "x-tokenward-sim-record"
FAULT_HEADER = "x-tokenward-sim-fault"
SOURCE_HEADER = "x-tokenward-sim-source"


@dataclass(frozen=True, slots=True)
class Recording:
    """One recorded exchange (fields as in the corpus ``README.md``)."""

    id: str
    provider: str
    dialect: str
    endpoint: str
    stream: bool
    request: dict[str, Any]
    response: dict[str, Any]
    usage_as_reported: list[dict[str, Any]] | None

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Recording:
        """Build from one parsed corpus line."""
        return cls(
            id=record["id"],
            provider=record["provider"],
            dialect=record["dialect"],
            endpoint=record["endpoint"],
            stream=bool(record["stream"]),
            request=record["request"],
            response=record["response"],
            usage_as_reported=record.get("usage_as_reported"),
        )


def sample_recordings_path() -> Path:
    """The small sample of recordings shipped with the package."""
    return Path(str(resources.files("tokenward.proxy") / "simulator_data" / "sample_exchanges.jsonl"))


def load_recordings(path: str | Path) -> list[Recording]:
    """Read a corpus file (one JSON object per line)."""
    with open(path, encoding="utf-8") as handle:
        return [Recording.from_json(json.loads(line)) for line in handle if line.strip()]


def _body_key(body: Any) -> str:
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k != "stream_options"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _asks_usage(body: Any) -> bool:
    return (
        isinstance(body, dict)
        and isinstance(body.get("stream_options"), dict)
        and (body["stream_options"].get("include_usage") is True)
    )


def without_stream_usage(sse: str) -> str:
    """``sse`` as the provider sends it when usage was not asked for (usage chunks and members removed)."""
    out = []
    decoder = SSEDecoder()
    raw = sse.encode()
    for block in decoder.feed(raw) + decoder.flush():
        _, data = parse_event(block)
        if data is None or data == b"[DONE]" or b'"usage"' not in data:
            out.append(block)
            continue
        chunk = json.loads(data)
        if isinstance(chunk, dict) and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict):
            continue
        if isinstance(chunk, dict) and "usage" in chunk:
            del chunk["usage"]
        text = json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()
        out.append(block.replace(data, text))
    return b"".join(out).decode()


class Simulator:
    """The replaying upstream as an aiohttp application; :attr:`requests` logs what it received."""

    def __init__(self, recordings: list[Recording]) -> None:
        self.by_id = {r.id: r for r in recordings}
        self.by_body: dict[str, Recording] = {}
        for recording in recordings:
            self.by_body.setdefault(_body_key(recording.request.get("body")), recording)
        self.requests: list[dict[str, Any]] = []
        self.received = 0
        """Requests received in all (``requests`` keeps only the last 1,000, so its length stops growing)."""
        self._flaky: dict[tuple[str, str], int] = {}

    def add(self, recording: Recording) -> None:
        """Register one more recording (tests add synthetic exchanges this way)."""
        self.by_id[recording.id] = recording
        self.by_body.setdefault(_body_key(recording.request.get("body")), recording)

    def app(self) -> web.Application:
        """The aiohttp application answering every path."""
        application = web.Application(client_max_size=1024**3)
        application.router.add_route("*", "/{tail:.*}", self.handle)
        return application

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Answer one request from its recording."""
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        self.requests.append(
            {
                "method": request.method,
                "path": request.path_qs,
                "headers": {k.lower(): v for k, v in request.headers.items()},
                "body": raw,
            }
        )
        del self.requests[:-1000]
        self.received += 1
        name = request.headers.get(RECORD_HEADER)
        if name is None:
            synthetic = await self._synthetic(request, raw)
            if synthetic is not None:
                return synthetic
        recording = self.by_id.get(name) if name else self.by_body.get(_body_key(body))
        if recording is None and name is None and request.method == "POST":
            recording = synthetic_recording(request.path, raw, body)
        if recording is None:
            error = {
                "error": {"message": f"simulator: no recording for {request.path}", "type": "not_found", "code": None}
            }
            return web.json_response(error, status=404)
        fault = request.headers.get(FAULT_HEADER, "")
        if fault.startswith("flaky:"):
            _, count, outcome = fault.split(":")
            seen = self._flaky.get((recording.id, fault), 0)
            self._flaky[(recording.id, fault)] = seen + 1
            if seen < int(count):
                fault = "reset" if outcome == "reset" else ""
                if outcome != "reset":
                    error = {"error": {"message": "simulated overload", "type": "server_error", "code": None}}
                    return web.json_response(error, status=int(outcome), headers={"retry-after": "0"})
        if fault.startswith("wait:"):  # answer after a pause (keeps concurrent requests in flight)
            await asyncio.sleep(float(fault.split(":")[1]) / 1000)
        if fault == "hang":
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.05)
            return web.Response()
        if fault == "reset":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return await self._replay(request, recording, body, fault)

    async def _synthetic(self, request: web.Request, raw: bytes) -> web.StreamResponse | None:
        """Non-recorded endpoints, for pass-through tests: models, uploads, binary downloads."""
        path = request.path
        if request.method == "GET" and path.endswith("/models"):
            return web.json_response(
                {"object": "list", "data": [{"id": "gpt-4o", "object": "model", "owned_by": "sim"}]}
            )
        if request.method == "POST" and path.endswith("/files"):
            head = f"Content-Type: {request.headers.get('content-type', '')}\r\n\r\n".encode()
            message = BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
            fields = {}
            for part in message.iter_parts():
                data = part.get_payload(decode=True) or b""
                fields[part.get_param("name", header="content-disposition")] = {
                    "filename": part.get_filename(),
                    "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            return web.json_response({"object": "file", "fields": fields, "query": request.query_string})
        if request.method == "POST":
            try:
                counted = count_reply(path, json.loads(raw) if raw else None)
            except ValueError:
                counted = count_reply(path, None)
            if counted is not None:
                return web.json_response(counted.body, status=counted.status, headers={SOURCE_HEADER: "synthetic"})
        if request.method == "GET" and path.endswith("/content"):
            return web.Response(body=binary_payload(), content_type="application/octet-stream")
        if request.method == "POST" and path.endswith("/audio/speech"):
            stream = web.StreamResponse(headers={"content-type": "audio/mpeg"})
            await stream.prepare(request)
            payload = binary_payload()
            for start in range(0, len(payload), 65536):
                await stream.write(payload[start : start + 65536])
            await stream.write_eof()
            return stream
        return None

    async def _replay(self, request: web.Request, recording: Recording, body: Any, fault: str) -> web.StreamResponse:
        response = recording.response
        status = int(response["status"])
        source = "synthetic" if recording.id.startswith(_SYNTHETIC) else "recording"
        content_type = response.get("content_type") or "application/json"
        if "sse" in response and response["sse"] is not None:
            sse = response["sse"]
            asked = _asks_usage(recording.request.get("body"))
            if recording.endpoint in ("chat_completions", "completions") and asked and not _asks_usage(body):
                sse = without_stream_usage(sse)
            stream = web.StreamResponse(status=status, headers={"content-type": content_type, SOURCE_HEADER: source})
            await stream.prepare(request)
            delay = float(fault.split(":")[1]) / 1000 if fault.startswith("delay:") else 0.0
            cut = int(fault.split(":")[1]) if fault.startswith("cut:") else None
            decoder = SSEDecoder()
            blocks = decoder.feed(sse.encode()) + decoder.flush()
            for index, block in enumerate(blocks):
                if cut is not None and index >= cut:
                    assert request.transport is not None
                    request.transport.close()
                    return stream
                await stream.write(block)
                if delay:
                    await asyncio.sleep(delay)
            await stream.write_eof()
            return stream
        if "body" in response and response["body"] is not None:
            payload = json.dumps(response["body"], separators=(",", ":"), ensure_ascii=False).encode()
        else:
            payload = str(response.get("text") or "").encode()
        headers = {"content-type": content_type, SOURCE_HEADER: source}
        if fault == "gzip":
            payload = gzip.compress(payload)
            headers["content-encoding"] = "gzip"
        return web.Response(status=status, body=payload, headers=headers)


_SYNTHETIC = "synthetic:"


def synthetic_recording(path: str, raw: bytes, body: Any) -> Recording | None:
    """A made-up exchange answering ``body`` sent to ``path``; ``None`` for a path no API serves.

    The recording's id is ``synthetic:`` plus a digest of the path and body, so fault injection
    (``flaky:N:STATUS``) counts repeats of the same request.
    """
    endpoint = endpoint_of(path)
    if endpoint is None:
        return None
    reply = synthesise(endpoint, body)
    if reply.events is not None:
        response: dict[str, Any] = {
            "status": reply.status,
            "content_type": "text/event-stream; charset=utf-8",
            "sse": b"".join(reply.events).decode(),
        }
    else:
        response = {"status": reply.status, "content_type": "application/json", "body": reply.body}
    return Recording(
        id=_SYNTHETIC + hashlib.sha256(path.encode() + b"\0" + raw).hexdigest()[:16],
        provider="synthetic",
        dialect="anthropic" if endpoint == "anthropic_messages" else "openai",
        endpoint=endpoint,
        stream=reply.events is not None,
        request={"body": body},
        response=response,
        usage_as_reported=None,
    )


def binary_payload(size: int = 300_000) -> bytes:
    """The deterministic binary body served for downloads (every byte value, repeated)."""
    return bytes(range(256)) * (size // 256) + bytes(range(size % 256))


class SimulatorServer:
    """Runs a :class:`Simulator` on a real local port in a background thread.

    Args:
        recordings: what to replay.
        host: interface to bind (loopback by default).
    """

    def __init__(self, recordings: list[Recording], host: str = "127.0.0.1") -> None:
        self.simulator = Simulator(recordings)
        self.host = host
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:54321``."""
        return f"http://{self.host}:{self.port}"

    @contextmanager
    def running(self) -> Iterator[SimulatorServer]:
        """Start the server, yield it, stop it."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True, name="tokenward-simulator")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("simulator did not start")
        try:
            yield self
        finally:
            assert self._loop is not None and self._stopped is not None
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.run(self._main(ready))

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        runner = web.AppRunner(self.simulator.app(), access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set()
        await self._stopped.wait()
        await runner.cleanup()
