"""Real clients as users run them: the ``openai`` and ``anthropic`` SDKs (and raw HTTP/1.1) -> tokenward -> a real
HTTP upstream that answers as the provider does.

Each test compares what the client got through tokenward with what the same upstream sends directly
(status, the headers the SDKs read, body bytes, SSE events one by one) and checks the request's one
ledger row against counts and costs worked out by hand from the built-in catalog's rates (USD per 1M
tokens unless stated).
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
import random
import socket
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import brotli
import httpx
import openai
import pytest
import zstandard
from aiohttp import web

from tests import test_isolation as isolation_tests
from tests.conftest import Proxy
from tests.object_store import ObjectStore
from tests.raw_upstream import RawUpstream
from tests.servers import Servers
from tokenward.pricing.settings import BudgetSettings, GuardSettings
from tokenward.proxy.app import create_app
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, ServerConfig, UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.server import running_in_thread
from tokenward.proxy.sse import MAX_EVENT_BYTES

ALICE, BOB = "tw-alice-0123456789", "tw-bob-0123456789ab"


def sse(events: list[tuple[str | None, dict[str, Any]]]) -> list[bytes]:
    """SSE frames as OpenAI (``event`` None) and Anthropic/Responses (named events) send them."""
    frames = []
    for name, data in events:
        head = f"event: {name}\n".encode() if name else b""
        frames.append(head + b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")
    return frames


class Provider:
    """Scripted replies by path: ``routes[path] = handler(request, body) -> StreamResponse``."""

    def __init__(self) -> None:
        self.routes: dict[str, Any] = {}
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, request: web.Request, body: bytes) -> web.StreamResponse:
        self.calls.append({"path": request.path, "headers": dict(request.headers), "body": body})
        handler = self.routes.get(request.path)
        if handler is None:
            return web.json_response({"error": {"message": f"no route {request.path}"}}, status=404)
        return await handler(request, body)


async def stream_frames(
    request: web.Request, frames: list[bytes], headers: dict[str, str] | None = None
) -> web.StreamResponse:
    reply = web.StreamResponse(headers={"content-type": "text/event-stream", **(headers or {})})
    await reply.prepare(request)
    for frame in frames:
        await reply.write(frame)
    await reply.write_eof()
    return reply


@pytest.fixture
def provider() -> Iterator[tuple[Provider, Servers]]:
    script = Provider()
    with Servers(script).running() as servers:
        yield script, servers


@contextmanager
def start(servers: Servers, ledger: Path, **server: Any) -> Iterator[Proxy]:
    config = Config(
        upstreams=[
            UpstreamConfig(name="openai", base_url=f"{servers.upstream_url}/v1", provider="openai", default=True),
            UpstreamConfig(
                name="anthropic",
                base_url=f"{servers.upstream_url}/anthropic/v1",
                provider="anthropic",
                models=["claude-*"],
            ),
        ],
        ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
        auth=AuthConfig(mode="passthrough"),
        server=ServerConfig(**server),
    )
    app = create_app(config)
    with running_in_thread(app) as url:
        yield Proxy(url, app, ledger)


def sdk(proxy: Proxy, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{proxy.url}/v1", api_key="sk-client-key", max_retries=kw.pop("max_retries", 0), **kw
    )


def claude(proxy: Proxy, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client", max_retries=kw.pop("max_retries", 0), **kw)


def ledger_tokens(row: dict[str, Any]) -> tuple[int, ...]:
    return (
        row["input_tokens"],
        row["cached_input_tokens"],
        row["cache_write_tokens"],
        row["output_tokens"],
        row["reasoning_tokens"],
    )


RESPONSE_USAGE = {
    "input_tokens": 1200,
    "input_tokens_details": {"cached_tokens": 1024},
    "output_tokens": 420,
    "output_tokens_details": {"reasoning_tokens": 384},
    "total_tokens": 1620,
}
RESPONSE_OUTPUT = [
    {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "Look it up."}]},
    {
        "id": "fc_1",
        "type": "function_call",
        "status": "completed",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city":"Paris"}',
    },
]


def response_object(status: str, *, usage: Any, output: list[Any]) -> dict[str, Any]:
    return {
        "id": "resp_1", "object": "response", "created_at": 1764600000, "status": status, "error": None,
        "incomplete_details": None, "instructions": None, "max_output_tokens": None, "model": "o4-mini-2025-04-16",
        "output": output, "parallel_tool_calls": True, "previous_response_id": None,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": True, "temperature": 1.0,
        "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_p": 1.0,
        "truncation": "disabled", "usage": usage, "user": None, "metadata": {},
    }  # fmt: skip


def responses_frames() -> list[bytes]:
    reasoning, call = RESPONSE_OUTPUT
    events: list[tuple[str | None, dict[str, Any]]] = [
        ("response.created", {"type": "response.created", "sequence_number": 0,
                              "response": response_object("in_progress", usage=None, output=[])}),
        ("response.output_item.added", {"type": "response.output_item.added", "sequence_number": 1, "output_index": 0,
                                        "item": {**reasoning, "summary": []}}),
        ("response.reasoning_summary_text.delta", {"type": "response.reasoning_summary_text.delta", "sequence_number": 2,
                                                   "item_id": "rs_1", "output_index": 0, "summary_index": 0,
                                                   "delta": "Look it up."}),
        ("response.output_item.done", {"type": "response.output_item.done", "sequence_number": 3, "output_index": 0,
                                       "item": reasoning}),
        ("response.output_item.added", {"type": "response.output_item.added", "sequence_number": 4, "output_index": 1,
                                        "item": {**call, "arguments": "", "status": "in_progress"}}),
        ("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta",
                                                    "sequence_number": 5, "item_id": "fc_1", "output_index": 1,
                                                    "delta": '{"city":"Paris"}'}),
        ("response.function_call_arguments.done", {"type": "response.function_call_arguments.done",
                                                   "sequence_number": 6, "item_id": "fc_1", "output_index": 1,
                                                   "arguments": '{"city":"Paris"}'}),
        ("response.output_item.done", {"type": "response.output_item.done", "sequence_number": 7, "output_index": 1,
                                       "item": call}),
        ("response.completed", {"type": "response.completed", "sequence_number": 8,
                                "response": response_object("completed", usage=RESPONSE_USAGE, output=RESPONSE_OUTPUT)}),
    ]  # fmt: skip
    return sse(events)


async def responses_route(request: web.Request, body: bytes) -> web.StreamResponse:
    if json.loads(body).get("stream"):
        return await stream_frames(request, responses_frames(), {"x-request-id": "req_stream"})
    document = response_object("completed", usage=RESPONSE_USAGE, output=RESPONSE_OUTPUT)
    return web.json_response(document, headers={"x-request-id": "req_whole"})


def test_responses_stream_with_reasoning_and_a_tool_call_is_relayed_event_by_event_and_billed_as_the_whole_reply(
    provider, tmp_path
):
    script, servers = provider
    script.routes["/v1/responses"] = responses_route
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}]
    request = {"model": "o4-mini", "input": "Weather in Paris?", "tools": tools, "reasoning": {"summary": "auto"}}
    with openai.OpenAI(base_url=f"{servers.upstream_url}/v1", api_key="sk-direct", max_retries=0) as direct:
        expected = [event.to_dict() for event in direct.responses.create(stream=True, **request)]
    with start(servers, tmp_path / "l.duckdb") as proxy:
        with sdk(proxy) as client, client.responses.with_streaming_response.create(stream=True, **request) as raw:
            assert raw.headers["x-request-id"] == "req_stream"
            wire = b"".join(raw.iter_bytes())
            got = [event.to_dict() for event in client.responses.create(stream=True, **request)]
            whole = client.responses.create(**request)
        assert wire == b"".join(responses_frames())  # byte for byte
        assert got == expected and len(got) == 9
        assert whole.output[1].arguments == '{"city":"Paris"}'
        streamed_a, streamed_b, plain = proxy.rows(3)
    # o4-mini: 176 uncached x 1.10 + 1024 cached x 0.275 + 420 output x 4.40 = 193.6 + 281.6 + 1848 -> $0.0023232
    for row in (streamed_a, streamed_b, plain):
        assert ledger_tokens(row) == (1200, 1024, 0, 420, 384)
        assert row["cost_usd"] == Decimal("0.0023232") and row["usage_source"] == "reported"
        assert row["outcome"] == "ok" and row["served_model"] == "o4-mini-2025-04-16"
    assert (streamed_a["stream"], plain["stream"]) == (True, False)


COMPACTION = {
    "id": "cmp_1", "object": "response.compaction", "created_at": 1764600000,
    "output": [{"id": "cmp_item_1", "type": "compaction", "encrypted_content": "gAAAA..."}],
    "usage": RESPONSE_USAGE,
}  # fmt: skip


def test_a_responses_compaction_is_metered_as_the_model_pass_it_is(provider, tmp_path):
    """``POST /v1/responses/compact`` runs the model over the conversation and reports (and bills) its usage."""
    script, servers = provider

    async def compact(request: web.Request, body: bytes) -> web.StreamResponse:
        return web.json_response(COMPACTION, headers={"x-request-id": "req_compact"})

    script.routes["/v1/responses/compact"] = compact
    with start(servers, tmp_path / "l.duckdb") as proxy:
        with sdk(proxy) as client:
            raw = client.responses.with_raw_response.compact(model="o4-mini", input="a long conversation")
        assert raw.headers["x-request-id"] == "req_compact" and raw.parse().usage.output_tokens == 420
        assert json.loads(raw.content) == COMPACTION
        (row,) = proxy.rows(1)
    assert json.loads(script.calls[0]["body"]) == {"model": "o4-mini", "input": "a long conversation"}  # untouched
    assert (row["endpoint"], row["path"], row["outcome"]) == ("responses_compact", "/v1/responses/compact", "ok")
    assert ledger_tokens(row) == (1200, 1024, 0, 420, 384) and row["usage_source"] == "reported"
    # o4-mini, as a Responses call: 176 x 1.10 + 1024 x 0.275 + 420 x 4.40 = 2323.2 / 1M -> $0.0023232
    assert row["cost_usd"] == Decimal("0.0023232") and row["price_status"] == "priced"


def test_a_compaction_reaches_only_the_callers_stored_responses(provider, tmp_path, monkeypatch):
    """Metered now, a compaction's ``previous_response_id`` is still held to the caller's own responses."""
    script, servers = provider
    monkeypatch.setenv("ACCOUNT_SECRET", "sk-account")

    async def respond(request: web.Request, body: bytes) -> web.StreamResponse:
        return web.json_response(response_object("completed", usage=RESPONSE_USAGE, output=RESPONSE_OUTPUT))

    async def compact(request: web.Request, body: bytes) -> web.StreamResponse:
        return web.json_response(COMPACTION)

    script.routes.update({"/v1/responses": respond, "/v1/responses/compact": compact})
    config = Config(
        upstreams=[UpstreamConfig(name="openai", base_url=f"{servers.upstream_url}/v1", api_key_env="ACCOUNT_SECRET")],
        ledger=LedgerConfig(path=str(tmp_path / "l.duckdb"), flush_interval_s=0.05),
        auth=AuthConfig(mode="virtual_keys"),
        virtual_keys=[VirtualKeyConfig(name="alice", key=ALICE), VirtualKeyConfig(name="bob", key=BOB)],
    )
    app = create_app(config)
    with running_in_thread(app) as url:
        alice, bob = (openai.OpenAI(base_url=f"{url}/v1", api_key=k, max_retries=0) for k in (ALICE, BOB))
        stored = alice.responses.create(model="o4-mini", input="the secret plan").id
        with pytest.raises(openai.NotFoundError):
            bob.responses.compact(model="o4-mini", previous_response_id=stored)
        assert alice.responses.compact(model="o4-mini", previous_response_id=stored).usage.input_tokens == 1200
        rows = Proxy(url, app, tmp_path / "l.duckdb").rows(3)
        alice.close(), bob.close()
    assert [c["path"] for c in script.calls] == ["/v1/responses", "/v1/responses/compact"]  # bob's never left
    alice_id, bob_id = rows[0]["principal"], rows[1]["principal"]
    assert alice_id != bob_id
    assert [(r["principal"], r["endpoint"], r["http_status"], r["cost_usd"]) for r in rows[1:]] == [
        (bob_id, "responses_compact", 404, Decimal(0)),  # refused before it was sent: nothing billed
        (alice_id, "responses_compact", 200, Decimal("0.0023232")),
    ]


def curl_like_post(url: str, path: bytes, body: bytes, timeout: float) -> bytes:
    """POST as curl does for a large body: ``Expect: 100-continue``, wait for ``100 Continue``, then the body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        head = b"POST " + path + b" HTTP/1.1\r\nHost: tokenward\r\nAuthorization: Bearer sk-client\r\n"
        head += b"Content-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
        sock.sendall(head)
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        data = b""
        with contextlib.suppress(TimeoutError):
            while not data.endswith(b"}") and (chunk := sock.recv(65536)):
                data += chunk
        return data


CHAT_DOC = json.dumps(
    {
        "id": "c1", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "pong"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42},
    }
).encode()  # fmt: skip


@pytest.mark.parametrize("path", [b"/v1/chat/completions", b"/v1/files"])
def test_a_client_expecting_100_continue_is_answered_even_by_an_upstream_that_never_sends_100(tmp_path, path):
    """tokenward answers the client's ``Expect`` itself and holds the body: the upstream gets it with the head.

    An upstream that does not send ``100 Continue`` (RFC 9110 lets a server skip it and lets a client
    send the body anyway) used to get the ``Expect`` header forwarded, and tokenward's HTTP client then
    waited for a ``100`` before sending the body, while the upstream waited for the body: the client got
    nothing for as long as the upstream kept the connection open.
    """
    upstream = RawUpstream()
    reply = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(CHAT_DOC)
    upstream.script = lambda head, body: [reply + CHAT_DOC]
    body = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "ping"}]}).encode()
    with upstream.running():
        config = Config(
            upstreams=[UpstreamConfig(name="openai", base_url=f"{upstream.url}/v1", default=True)],
            ledger=LedgerConfig(path=str(tmp_path / "l.duckdb"), flush_interval_s=0.05),
        )
        app = create_app(config)
        with running_in_thread(app) as url:
            data = curl_like_post(url, path, body, timeout=5)
            (row,) = Proxy(url, app, tmp_path / "l.duckdb").rows(1)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b"\r\n\r\n" + CHAT_DOC)
    ((head, sent),) = upstream.requests
    assert sent == body and b"expect" not in head.lower()
    assert row["outcome"] == "ok"
    if path == b"/v1/chat/completions":  # gpt-4o-mini: 30 x 0.15 + 12 x 0.60 = 11.7 / 1M -> $0.0000117
        assert (row["input_tokens"], row["output_tokens"], row["cost_usd"]) == (30, 12, Decimal("0.0000117"))


IMAGE_USAGE = {
    "total_tokens": 6290,
    "input_tokens": 50,
    "input_tokens_details": {"text_tokens": 40, "image_tokens": 10},
    "output_tokens": 6240,
}
# gpt-image-1: 40 text x 5.00 + 10 image x 10.00 + 6240 output x 40.00 = 200 + 100 + 249,600 -> $0.2499
IMAGE_COST = Decimal("0.2499")


@pytest.fixture(scope="module")
def big_image() -> str:
    """A base64 PNG-sized payload whose event is over the SSE cap (8 MiB): a 1024x1536 high-quality image can be."""
    return base64.b64encode(random.Random(5).randbytes(MAX_EVENT_BYTES * 3 // 4 + 4096)).decode()


def test_a_streamed_image_whose_completed_event_is_over_the_event_cap_is_billed_as_reported(
    provider, tmp_path, big_image
):
    script, servers = provider
    done = {
        "type": "image_generation.completed", "b64_json": big_image, "created_at": 1764600000, "size": "1024x1536",
        "quality": "high", "background": "opaque", "output_format": "png", "usage": IMAGE_USAGE,
    }  # fmt: skip
    frames = sse([("image_generation.completed", done)])
    assert len(frames[0]) > MAX_EVENT_BYTES

    async def generate(request: web.Request, body: bytes) -> web.StreamResponse:
        return await stream_frames(request, frames)

    script.routes["/v1/images/generations"] = generate
    with start(servers, tmp_path / "l.duckdb") as proxy:
        with sdk(proxy, timeout=60) as client:
            request = {"model": "gpt-image-1", "prompt": "a lighthouse", "size": "1024x1536", "quality": "high"}
            with client.images.with_streaming_response.generate(stream=True, **request) as raw:
                assert raw.read() == frames[0]  # byte for byte
            (event,) = list(client.images.generate(stream=True, **request))
        assert event.b64_json == big_image and event.usage.output_tokens == 6240
        rows = proxy.rows(2)
    for row in rows:
        assert (row["outcome"], row["usage_source"], row["error"]) == ("ok", "reported", None)
        assert (row["input_tokens"], row["image_input_tokens"], row["output_tokens"]) == (50, 10, 6240)
        assert row["cost_usd"] == IMAGE_COST and row["price_status"] == "priced"


def test_a_responses_stream_whose_completed_event_carries_a_big_generated_image_is_billed_as_reported(
    provider, tmp_path, big_image
):
    """The Responses image tool puts the image in ``response.completed`` (with the usage after it)."""
    script, servers = provider
    call = {"id": "ig_1", "type": "image_generation_call", "status": "completed", "result": big_image}
    completed = response_object("completed", usage=RESPONSE_USAGE, output=[call])
    frames = sse(
        [
            ("response.created", {"type": "response.created", "sequence_number": 0,
                                  "response": response_object("in_progress", usage=None, output=[])}),
            ("response.completed", {"type": "response.completed", "sequence_number": 1, "response": completed}),
        ]
    )  # fmt: skip

    async def respond(request: web.Request, body: bytes) -> web.StreamResponse:
        return await stream_frames(request, frames)

    script.routes["/v1/responses"] = respond
    with start(servers, tmp_path / "l.duckdb") as proxy:
        with sdk(proxy, timeout=60) as client:
            events = list(
                client.responses.create(
                    model="o4-mini", input="draw", tools=[{"type": "image_generation"}], stream=True
                )
            )
        assert events[-1].response.output[0].result == big_image
        (row,) = proxy.rows(1)
    assert (row["outcome"], row["usage_source"], row["error"]) == ("ok", "reported", None)
    assert ledger_tokens(row) == (1200, 1024, 0, 420, 384) and row["cost_usd"] == Decimal("0.0023232")


CODERS = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "br": brotli.compress,
    "zstd": zstandard.ZstdCompressor(level=3).compress,
}


@pytest.mark.parametrize("coding", sorted(CODERS))
def test_a_compressed_request_body_is_metered_and_reaches_the_upstream_as_the_same_json(provider, tmp_path, coding):
    """The Codex CLI sends large ``/v1/responses`` bodies zstd-compressed; OpenAI and Anthropic accept gzip bodies."""
    script, servers = provider
    script.routes["/v1/responses"] = responses_route
    document = {"model": "o4-mini", "input": "Summarize: " + "the lighthouse keeper " * 500, "max_output_tokens": 900}
    body = json.dumps(document).encode()
    with start(servers, tmp_path / "l.duckdb") as proxy:
        headers = {"authorization": "Bearer sk-client", "content-type": "application/json", "content-encoding": coding}
        reply = httpx.post(f"{proxy.url}/v1/responses", content=CODERS[coding](body), headers=headers)
        (row,) = proxy.rows(1)
    assert reply.status_code == 200 and reply.json()["usage"] == RESPONSE_USAGE
    (call,) = script.calls
    assert call["body"] == body and "Content-Encoding" not in call["headers"]  # the same JSON, decoded
    assert (row["outcome"], row["requested_model"], row["cost_usd"]) == ("ok", "o4-mini", Decimal("0.0023232"))


def test_a_compressed_request_body_is_decoded_within_the_body_limit(provider, tmp_path):
    script, servers = provider
    script.routes["/v1/responses"] = responses_route
    bomb = gzip.compress(b'{"model":"o4-mini","input":"' + b"a" * (3 * 1024 * 1024) + b'"}')  # 3 MiB from ~3 KiB
    with start(servers, tmp_path / "l.duckdb", max_body_mib=2) as proxy:
        headers = {"authorization": "Bearer sk-client", "content-type": "application/json"}
        too_big = httpx.post(f"{proxy.url}/v1/responses", content=bomb, headers={**headers, "content-encoding": "gzip"})
        corrupt = httpx.post(
            f"{proxy.url}/v1/responses", content=b"not gzip", headers={**headers, "content-encoding": "gzip"}
        )
        unknown = httpx.post(f"{proxy.url}/v1/responses", content=b"{}", headers={**headers, "content-encoding": "lz4"})
        rows = proxy.rows(3)
    assert len(bomb) < 8192 and too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    assert [r.status_code for r in (corrupt, unknown)] == [400, 400]
    assert {r.json()["error"]["code"] for r in (corrupt, unknown)} == {"invalid_content_encoding"}
    assert script.calls == [] and [r["http_status"] for r in rows] == [413, 400, 400]
    assert {r["outcome"] for r in rows} == {"client_error"}


def test_a_compressed_body_naming_objects_is_checked_decoded_and_forwarded_as_sent(tmp_path, monkeypatch):
    """A gzip body naming another key's file is refused as the plain one is; the caller's own passes untouched."""
    monkeypatch.setenv("OBJECTS_SECRET", isolation_tests.SECRET)
    with ObjectStore().running() as store, isolation_tests.proxy(store, tmp_path / "l.duckdb") as url:
        with isolation_tests.gpt(url, isolation_tests.ALICE) as alice:
            alice_file = isolation_tests.upload(alice, "alice.jsonl")

        def batch(key: str) -> httpx.Response:
            document = {"input_file_id": alice_file, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            headers = {"authorization": f"Bearer {key}", "content-type": "application/json", "content-encoding": "gzip"}
            return httpx.post(
                f"{url}/v1/batches", content=gzip.compress(json.dumps(document).encode()), headers=headers
            )

        sent = len(store.requests)
        refused = batch(isolation_tests.BOB)
        assert refused.status_code == 404 and store.requests[sent:] == []  # bob's never left
        assert refused.json()["error"]["message"] == f"No such File object: {alice_file}"
        created = batch(isolation_tests.ALICE)
        assert created.status_code == 200 and created.json()["input_file_id"] == alice_file
        # the batch's input file is read first (its lines may name objects too), then the batch is made
        assert store.requests[sent:] == [("GET", f"/v1/files/{alice_file}/content"), ("POST", "/v1/batches")]


def test_background_responses_count_their_reservation_against_a_blocking_budget(provider, tmp_path):
    """A ``background: true`` response is billed when it finishes, after its reply (``usage: null``) came back.

    Its row is ``deferred`` (cost unknown yet); it must go on counting its worst case against the
    budget, as a row the provider may have billed does, or a key could spend without limit in the
    background while every budget reads $0.
    """
    script, servers = provider

    async def queue(request: web.Request, body: bytes) -> web.StreamResponse:
        queued = response_object("queued", usage=None, output=[])
        return web.json_response({**queued, "id": f"resp_bg_{len(script.calls)}", "background": True})

    script.routes["/v1/responses"] = queue
    config = Config(
        upstreams=[UpstreamConfig(name="openai", base_url=f"{servers.upstream_url}/v1", default=True)],
        ledger=LedgerConfig(path=str(tmp_path / "l.duckdb"), flush_interval_s=0.05),
        budgets=[BudgetSettings(name="daily", limit_usd="0.10", period="day", action="block")],
        guard=GuardSettings(input_margin=1, input_margin_tokens=0, bytes_bound_share=0),
    )
    app = create_app(config)
    with (
        running_in_thread(app) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-client", max_retries=0) as client,
    ):
        request = {"model": "o4-mini", "input": "Research lighthouses.", "max_output_tokens": 5000, "background": True}
        first, second = (client.responses.create(**request) for _ in range(2))
        with pytest.raises(openai.RateLimitError) as refused:
            client.responses.create(**request)
        rows = Proxy(url, app, tmp_path / "l.duckdb").rows(3)
    assert (first.status, second.status) == ("queued", "queued") and len(script.calls) == 2
    assert refused.value.body["code"] == "budget_exceeded"
    # worst case each, at o4-mini's priority rates (no service_tier sent: the dearest it may be served at):
    # 12 input tokens (5 for "Research lighthouses." in o200k_base, a bare string input being one user
    # message: role + 3 = 4, and 3 for the reply) x 2.00 + 5000 output x 8.00 = 40,024 / 1M;
    # two held $0.080048 of $0.10, so a third ($0.040024 more) is refused
    assert [(r["price_status"], r["cost_usd"], r["reserved_usd"]) for r in rows[:2]] == [
        ("deferred", None, Decimal("0.040024"))
    ] * 2
    assert rows[2]["outcome"] == "rejected"


def test_sdk_retries_are_one_row_per_attempt_and_the_refused_attempt_costs_nothing(provider, tmp_path):
    """The SDKs retry a 429 (honouring ``retry-after-ms``) with a new request each time: each attempt has its row."""
    script, servers = provider

    async def chat(request: web.Request, body: bytes) -> web.StreamResponse:
        if len(script.calls) == 1:
            error = {"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}}
            return web.json_response(error, status=429, headers={"retry-after-ms": "10", "x-request-id": "req_429"})
        return web.Response(body=CHAT_DOC, content_type="application/json", headers={"x-request-id": "req_ok"})

    script.routes["/v1/chat/completions"] = chat
    with start(servers, tmp_path / "l.duckdb") as proxy, sdk(proxy, max_retries=2) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "ping"}]
        )
        assert raw.headers["x-request-id"] == "req_ok" and raw.retries_taken == 1
        refused, served = proxy.rows(2)
    assert [c["headers"]["x-stainless-retry-count"] for c in script.calls] == ["0", "1"]
    assert (refused["http_status"], refused["outcome"], refused["price_status"]) == (
        429,
        "upstream_error",
        "not_billed",
    )
    assert refused["cost_usd"] == 0 and refused["error"] == "Rate limit reached"
    # gpt-4o-mini: 30 x 0.15 + 12 x 0.60 = 11.7 / 1M
    assert (served["outcome"], served["cost_usd"]) == ("ok", Decimal("0.0000117"))


@pytest.mark.parametrize(
    ("first_usage", "status", "cost", "violation"),
    [
        ({**IMAGE_USAGE, "input_tokens": "50"}, "usage_invalid", None, "image 1: input_tokens: '50' is not a count"),
        ({**IMAGE_USAGE, "output_tokens": True}, "usage_invalid", None, "image 1: output_tokens: True is not a count"),
        # details that are no object are read as none (as in every dialect): 100 in, 10 of them image (the
        # second's), 12480 out: 90 x 5.00 + 10 x 10.00 + 12480 x 40.00 = 450 + 100 + 499,200 -> $0.49975
        ({**IMAGE_USAGE, "input_tokens_details": "none"}, "priced", Decimal("0.49975"), None),
    ],
)
def test_a_streamed_image_pair_with_an_unreadable_count_gets_its_flagged_row(
    provider, tmp_path, first_usage, status, cost, violation
):
    """Each streamed image's usage is read like any usage before the images' usages are added up.

    Before, the meter added the raw counts: a string raised (the client's stream broke off and no row was
    written), ``true`` was added as 1.
    """
    script, servers = provider
    done = {"type": "image_generation.completed", "b64_json": "aW1n", "size": "1024x1536", "quality": "high"}
    frames = sse([("image_generation.completed", {**done, "usage": u}) for u in (first_usage, IMAGE_USAGE)])

    async def generate(request: web.Request, body: bytes) -> web.StreamResponse:
        return await stream_frames(request, frames)

    script.routes["/v1/images/generations"] = generate
    with start(servers, tmp_path / "l.duckdb") as proxy:
        with sdk(proxy) as client:
            request = {"model": "gpt-image-1", "prompt": "two lighthouses", "n": 2, "size": "1024x1536"}
            events = list(client.images.generate(stream=True, quality="high", **request))
        (row,) = proxy.rows(1)
    assert len(events) == 2
    assert (row["outcome"], row["usage_source"], row["price_status"], row["cost_usd"]) == (
        "ok",
        "reported",
        status,
        cost,
    )
    assert row["output_images"] == 2 and (violation is None) == (row["violations"] is None)
    assert violation is None or violation in row["violations"]


def one_chat_stream(
    provider: tuple[Provider, Servers],
    tmp_path: Path,
    usage: dict[str, Any] | None,
    headers: dict[str, str] | None = None,
) -> tuple[Any, dict]:
    """One streamed chat request through the proxy to an upstream that sends ``usage`` (``None``: no usage chunk)."""
    script, servers = provider
    head = {"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o-mini"}
    events: list[tuple[str | None, dict[str, Any]]] = [
        (None, {**head, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}),
        (None, {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    ]
    if usage is not None:
        events.append((None, {**head, "choices": [], "usage": usage}))
    frames = [*sse(events), b"data: [DONE]\n\n"]

    async def chat(request: web.Request, body: bytes) -> web.StreamResponse:
        return await stream_frames(request, frames, headers)

    script.routes["/v1/chat/completions"] = chat
    with start(servers, tmp_path / "l.duckdb") as proxy:
        with sdk(proxy) as client:
            messages = [{"role": "user", "content": "hi"}]
            chunks = list(client.chat.completions.create(model="gpt-4o-mini", messages=messages, stream=True))
        (row,) = proxy.rows(1)
    return chunks, row


def test_a_reply_the_meter_fails_on_still_gets_its_row_and_the_client_its_whole_stream(provider, tmp_path, monkeypatch):
    """Whatever a dialect trips on, the exchange is recorded (usage_unknown) and the stream is relayed to its end."""
    from tokenward.proxy.dialects import openai as openai_dialect

    def broken(seen: Any) -> Any:
        raise ValueError("a shape no rule foresaw")

    monkeypatch.setattr(openai_dialect, "finish", broken)
    chunks, row = one_chat_stream(provider, tmp_path, {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9})
    assert chunks and chunks[-1].choices[0].finish_reason == "stop"
    assert (row["outcome"], row["price_status"], row["cost_usd"]) == ("ok", "usage_unknown", None)
    assert "the reply could not be metered: ValueError: a shape no rule foresaw" in row["error"]


def test_a_reply_whose_estimate_fails_is_usage_unknown_not_a_free_row(provider, tmp_path, monkeypatch):
    """An upstream that reports no usage is estimated; if the estimate fails, the row may still have been billed."""
    from tokenward.proxy import forward

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("no estimate")

    monkeypatch.setattr(forward, "estimate", broken)
    chunks, row = one_chat_stream(provider, tmp_path, None)  # no usage chunk although tokenward asked for one
    assert chunks[-1].choices[0].finish_reason == "stop"
    # before: not_billed at $0, as if the provider had billed nothing
    assert (row["outcome"], row["price_status"], row["cost_usd"]) == ("ok", "usage_unknown", None)
    assert "the usage could not be estimated: ValueError: no estimate" in row["error"]


def test_a_stream_whose_media_type_is_not_lower_case_is_metered_as_a_stream(provider, tmp_path):
    """Media types are case-insensitive (RFC 9110 8.3.1): ``Text/Event-Stream`` is a stream."""
    usage = {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}
    chunks, row = one_chat_stream(provider, tmp_path, usage, {"content-type": "Text/Event-Stream; charset=UTF-8"})
    assert [c.choices[0].delta.content for c in chunks] == ["hi", None]  # the usage chunk tokenward asked for is hidden
    # gpt-4o-mini: 8 x 0.15 + 1 x 0.60 = 1.8 / 1M; before: read as one JSON body, estimated from the request alone
    assert (row["usage_source"], row["input_tokens"], row["output_tokens"]) == ("reported", 8, 1)
    assert row["cost_usd"] == Decimal("0.0000018")
