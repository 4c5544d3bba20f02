"""A minimal, fast OpenAI-style upstream for benchmarks (raw asyncio protocol on uvloop).

Answers every POST with a fixed chat completion (usage included) after ``--delay-ms`` (at once
for a path under ``/fast/``); a request whose body contains ``"stream":true`` gets ``--events``
SSE chunks, ``--gap-ms`` apart, then a usage chunk and ``[DONE]`` (each also ``--gap-ms`` after
the one before). Keep-alive, Content-Length request bodies only. ``bench/bench_floor.py`` uses
it when nginx (or its echo module) is missing; the bytes are the ones its nginx mock serves.

    python bench/mock_upstream.py --port 9100 --delay-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvloop

REPLY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1780000000,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Benchmark reply: " + "lorem ipsum " * 20},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 120,
            "completion_tokens": 48,
            "total_tokens": 168,
            "prompt_tokens_details": {"cached_tokens": 64, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
        },
        "service_tier": "default",
    },
    separators=(",", ":"),
).encode()

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


DONE = b"data: [DONE]\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(i: int, usage: bool) -> bytes:
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1780000000,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [] if usage else [{"index": 0, "delta": {"content": f"token{i} "}, "finish_reason": None}],
        "usage": {"prompt_tokens": 120, "completion_tokens": i, "total_tokens": 120 + i} if usage else None,
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class Upstream(asyncio.Protocol):
    def __init__(self, delay: float, events: int, gap: float) -> None:
        self.delay, self.events, self.gap = delay, events, gap
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            streaming = b'"stream":true' in body.replace(b" ", b"")
            fast = head.split(b" ", 2)[1].startswith(b"/fast/")
            asyncio.get_running_loop().create_task(self.reply(streaming, 0.0 if fast else self.delay))

    async def reply(self, streaming: bool, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        if not streaming:
            self.transport.write(HEAD % len(REPLY) + REPLY)  # type: ignore[attr-defined]
            return
        self.transport.write(STREAM_HEAD)  # type: ignore[attr-defined]
        for i in range(self.events):
            self.transport.write(chunk(event(i, False)))  # type: ignore[attr-defined]
            if self.gap:
                await asyncio.sleep(self.gap)
        self.transport.write(chunk(event(self.events, True)))  # type: ignore[attr-defined]
        if self.gap:
            await asyncio.sleep(self.gap)
        self.transport.write(chunk(DONE) + b"0\r\n\r\n")  # type: ignore[attr-defined]


async def main(port: int, delay: float, events: int, gap: float) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Upstream(delay, events, gap), "127.0.0.1", port, backlog=4096)
    print(f"mock upstream on {port}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--events", type=int, default=20)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    args = parser.parse_args()
    uvloop.run(main(args.port, args.delay_ms / 1000, args.events, args.gap_ms / 1000))
