"""What a real SDK sees through tokenward, against what it sees from the same upstream directly.

The ``openai`` and ``anthropic`` SDKs run once against :class:`~tests.raw_upstream.RawUpstream` (an
upstream scripted byte for byte, as the provider answers) and once through a real proxy in front of
it; each test compares the two (status, the headers the SDKs and their users read, SSE events one by
one, parsed objects, retries) and checks the request's one ledger row. Prices: the field cases' test
prices (tests/fixtures/field_case_prices.yaml, USD per 1M tokens): gpt-4o-mini 0.15 in / 0.60 out;
claude-sonnet-4 3.00 in, 0.30 cache read, 3.75 cache write (5m) / 6.00 (1h), 15.00 out.
"""

from __future__ import annotations

import json
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import websockets

from tokenward.pricing.catalog import load_catalog
from tokenward.proxy.config import UpstreamConfig

from .raw_upstream import LAST_CHUNK, chunk, json_reply, sse_head

PRICES = Path(__file__).parent / "fixtures" / "field_case_prices.yaml"
HELLO = [{"role": "user", "content": "hello world"}]


_CLIENTS: list[Any] = []


@pytest.fixture(autouse=True)
def _close_clients():
    """Close every SDK client a test made (their sockets would be left to the garbage collector)."""
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


def openai_client(**options: Any) -> openai.OpenAI:
    _CLIENTS.append(client := openai.OpenAI(**options))
    return client


def anthropic_client(**options: Any) -> anthropic.Anthropic:
    _CLIENTS.append(client := anthropic.Anthropic(**options))
    return client


@pytest.fixture
def proxy(raw_proxy):
    return raw_proxy("test", "test", catalog=load_catalog([PRICES], builtin=False), drain_s=2.0)


def reply(status: bytes, headers: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    """A whole HTTP/1.1 reply with ``headers`` (CRLF-terminated lines) and a content-length."""
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type + b"\r\n" + headers
        + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


def named(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


# --- WebSocket sessions (Realtime, the Responses API's WebSocket mode) ------------------------------


@pytest.mark.parametrize("connect", ["realtime", "responses"])
def test_a_websocket_session_is_refused_by_tokenward_with_its_row_not_sent_upstream_as_a_plain_get(
    proxy, raw_upstream, connect
):
    # tokenward relays no WebSocket. Before, the handshake went upstream as a plain GET (Upgrade and
    # Connection dropped as hop-by-hop, Sec-WebSocket-Key kept), the provider answered that with some
    # 4xx and the SDK said "server rejected WebSocket connection: HTTP 400", naming nothing. Now
    # tokenward refuses it itself, saying why, and nothing reaches the upstream.
    raw_upstream.script = lambda head, body: [
        json_reply(b'{"error":{"message":"no","type":"x","code":null}}', b"400 Bad Request")
    ]
    client = openai_client(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0)
    with pytest.raises(websockets.InvalidStatus) as refused:
        if connect == "realtime":
            with client.realtime.connect(model="gpt-realtime"):
                pass
        else:
            with client.beta.responses.connect(max_retries=0):
                pass
    response = refused.value.response
    assert response.status_code == 501
    error = json.loads(response.body)["error"]
    assert error["code"] == "websocket_not_supported" and error["type"] == "invalid_request_error"
    assert "WebSocket" in error["message"]
    assert raw_upstream.requests == []
    (row,) = proxy.rows(1)
    path = "/v1/realtime" if connect == "realtime" else "/v1/responses"
    assert (row["method"], row["path"], row["http_status"], row["outcome"]) == ("GET", path, 501, "rejected")
    assert row["price_status"] == "not_billed" and row["cost_usd"] == 0


# --- provider headers and SDK retries ---------------------------------------------------------------

CHAT_REPLY = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
).encode()
OPENAI_HEADERS = (
    b"x-request-id: req_abc123\r\nopenai-processing-ms: 321\r\nopenai-organization: org-x\r\n"
    b"openai-version: 2020-10-01\r\nx-ratelimit-limit-requests: 10000\r\nx-ratelimit-remaining-requests: 9999\r\n"
    b"x-ratelimit-reset-requests: 6ms\r\nx-ratelimit-limit-tokens: 30000000\r\n"
    b"x-ratelimit-remaining-tokens: 29999990\r\nx-ratelimit-reset-tokens: 0s\r\n"
    b"set-cookie: __cf_bm=a; path=/\r\nset-cookie: _cfuvid=b; path=/\r\ncf-ray: 8abc-LHR\r\nserver: cloudflare\r\n"
    b"date: Wed, 02 Dec 2026 15:00:00 GMT\r\n"
)
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-20250514",
    "content": [{"type": "text", "text": "hi"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 10, "output_tokens": 2},
}
ANTHROPIC_HEADERS = (
    b"request-id: req_011abc\r\nanthropic-organization-id: org-1\r\nanthropic-ratelimit-requests-limit: 50\r\n"
    b"anthropic-ratelimit-requests-remaining: 49\r\nanthropic-ratelimit-requests-reset: 2026-12-02T15:00:01Z\r\n"
    b"anthropic-ratelimit-input-tokens-limit: 30000\r\nanthropic-ratelimit-input-tokens-remaining: 29990\r\n"
)


def provider_headers(raw: Any) -> list[tuple[str, str]]:
    """A raw response's headers but the framing ones and tokenward's own ``x-tokenward-*``."""
    dropped = ("content-length", "transfer-encoding", "connection")
    return [(k, v) for k, v in raw.headers.multi_items() if k not in dropped and not k.startswith("x-tokenward-")]


def test_every_provider_header_reaches_with_raw_response_as_sent(proxy, raw_upstream):
    script = {"/v1/chat/completions": reply(b"200 OK", OPENAI_HEADERS, CHAT_REPLY)}
    script["/v1/messages"] = reply(b"200 OK", ANTHROPIC_HEADERS, json.dumps(MESSAGE).encode())
    raw_upstream.script = lambda head, body: [script[head.split(b" ")[1].decode()]]
    seen = {}
    for via, base in (("direct", raw_upstream.url), ("tokenward", proxy.url)):
        oai = openai_client(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
        chat = oai.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=HELLO)
        claude = anthropic_client(base_url=base, api_key="sk-ant-test", max_retries=0)
        message = claude.messages.with_raw_response.create(model="claude-sonnet-4", max_tokens=10, messages=HELLO)
        seen[via] = (
            (chat.status_code, chat.request_id, provider_headers(chat.http_response), chat.parse().model_dump()),
            (message.status_code, message.request_id, provider_headers(message.http_response), message.parse().id),
        )
    assert seen["tokenward"] == seen["direct"]
    assert seen["tokenward"][0][1] == "req_abc123" and seen["tokenward"][1][1] == "req_011abc"
    assert ("x-ratelimit-remaining-tokens", "29999990") in seen["tokenward"][0][2]
    assert [v for k, v in seen["tokenward"][0][2] if k == "set-cookie"] == ["__cf_bm=a; path=/", "_cfuvid=b; path=/"]
    rows = proxy.rows(2)
    # 8 x 0.15/1M + 1 x 0.60/1M; 10 x 3.00/1M + 2 x 15.00/1M
    assert sorted(r["cost_usd"] for r in rows) == [Decimal("0.0000018"), Decimal("0.00006")]


RATE_LIMITED = json.dumps(
    {"error": {"message": "Rate limit reached", "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
).encode()
OVERLOADED = json.dumps(
    {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}, "request_id": "req_1"}
).encode()


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_a_429_or_529_with_retry_after_is_retried_by_the_sdk_after_it_as_directly(proxy, raw_upstream, sdk):
    # the SDKs read retry-after (and x-should-retry) from the provider's reply: tokenward relays both,
    # so the SDK waits the second it was told and retries once; each attempt is its own row
    if sdk == "openai":
        refusal = reply(b"429 Too Many Requests", b"retry-after: 1\r\nx-should-retry: true\r\n", RATE_LIMITED)
        success = reply(b"200 OK", b"x-request-id: req_2\r\n", CHAT_REPLY)
    else:
        refusal = reply(b"529 Site Overloaded", b"retry-after: 1\r\nx-should-retry: true\r\n", OVERLOADED)
        success = reply(b"200 OK", b"request-id: req_2\r\n", json.dumps(MESSAGE).encode())
    answered = []
    raw_upstream.script = lambda head, body: [refusal if len(answered) % 2 == 0 else success, answered.append(1) or b""]
    taken = {}
    for via, base in (("direct", raw_upstream.url), ("tokenward", proxy.url)):
        start = time.monotonic()
        if sdk == "openai":
            client = openai_client(base_url=f"{base}/v1", api_key="sk-test", max_retries=2)
            raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=HELLO)
        else:
            claude = anthropic_client(base_url=base, api_key="sk-ant-test", max_retries=2)
            raw = claude.messages.with_raw_response.create(model="claude-sonnet-4", max_tokens=10, messages=HELLO)
        taken[via] = (raw.retries_taken, raw.status_code, raw.request_id, time.monotonic() - start >= 1.0)
    assert taken["tokenward"] == taken["direct"] == (1, 200, "req_2", True)
    rows = proxy.rows(2)
    status = 429 if sdk == "openai" else 529
    assert [(r["http_status"], r["outcome"], r["cost_usd"]) for r in rows] == [
        (status, "upstream_error", Decimal(0)),
        (200, "ok", Decimal("0.0000018") if sdk == "openai" else Decimal("0.00006")),
    ]


def test_x_should_retry_false_stops_the_sdk_as_directly(proxy, raw_upstream):
    raw_upstream.script = lambda head, body: [
        reply(b"429 Too Many Requests", b"x-should-retry: false\r\n", RATE_LIMITED)
    ]
    for base in (raw_upstream.url, proxy.url):
        client = openai_client(base_url=f"{base}/v1", api_key="sk-test", max_retries=2)
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
        assert refused.value.code == "rate_limit_exceeded"
    assert len(raw_upstream.requests) == 2  # one each: no retry
    (row,) = proxy.rows(1)
    assert (row["http_status"], row["outcome"], row["cost_usd"]) == (429, "upstream_error", Decimal(0))


# --- streams: thinking with its signature, tool calls, both cache TTLs ------------------------------

CACHED_USAGE = {
    "input_tokens": 12,
    "cache_creation_input_tokens": 3000,
    "cache_read_input_tokens": 1000,
    "cache_creation": {"ephemeral_5m_input_tokens": 1000, "ephemeral_1h_input_tokens": 2000},
    "output_tokens": 1,
    "service_tier": "standard",
}
THINKING_REQUEST = {
    "model": "claude-sonnet-4",
    "max_tokens": 2000,
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "system": [{"type": "text", "text": "policy " * 10, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
    "messages": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral", "ttl": "5m"}}],
        }
    ],
    "tools": [{"name": "calc", "input_schema": {"type": "object"}}],
}


def thinking_stream() -> list[bytes]:
    """A streamed reply with a thinking block (its signature in a ``signature_delta``), text and a tool call."""
    message = dict(MESSAGE, id="msg_t", content=[], stop_reason=None, usage=CACHED_USAGE)

    def delta(index: int, **fields: Any) -> bytes:
        return named("content_block_delta", {"type": "content_block_delta", "index": index, "delta": fields})

    def block(index: int, start: dict[str, Any]) -> list[bytes]:
        begin = {"type": "content_block_start", "index": index, "content_block": start}
        return [named("content_block_start", begin)]

    stop = [named("content_block_stop", {"type": "content_block_stop", "index": i}) for i in range(3)]
    final_usage = {
        "input_tokens": 12,
        "cache_creation_input_tokens": 3000,
        "cache_read_input_tokens": 1000,
        "output_tokens": 150,
    }
    return [
        named("message_start", {"type": "message_start", "message": message}),
        *block(0, {"type": "thinking", "thinking": "", "signature": ""}),
        delta(0, type="thinking_delta", thinking="Six times seven."),
        delta(0, type="signature_delta", signature="EqQBCkYIBxgCKkA" * 20),
        stop[0],
        b'event: ping\ndata: {"type": "ping"}\n\n',
        *block(1, {"type": "text", "text": ""}),
        delta(1, type="text_delta", text="42."),
        stop[1],
        *block(2, {"type": "tool_use", "id": "toolu_1", "name": "calc", "input": {}}),
        delta(2, type="input_json_delta", partial_json='{"x": '),
        delta(2, type="input_json_delta", partial_json="42}"),
        stop[2],
        named("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": final_usage}),
        named("message_stop", {"type": "message_stop"}),
    ]


def test_a_thinking_stream_with_its_signature_and_both_cache_ttls_is_relayed_and_priced_per_ttl(proxy, raw_upstream):
    raw_upstream.script = lambda head, body: [
        sse_head(b"request-id: req_t\r\n"),
        *map(chunk, thinking_stream()),
        LAST_CHUNK,
    ]
    seen = {}
    for via, base in (("direct", raw_upstream.url), ("tokenward", proxy.url)):
        client = anthropic_client(base_url=base, api_key="sk-ant-test", max_retries=0)
        with client.messages.stream(**THINKING_REQUEST) as stream:
            events = [event.type for event in stream]
            seen[via] = (events, stream.get_final_message().model_dump())
    assert seen["tokenward"] == seen["direct"]
    thinking, text, tool = seen["tokenward"][1]["content"]
    assert thinking["signature"] == "EqQBCkYIBxgCKkA" * 20 and text["text"] == "42." and tool["input"] == {"x": 42}
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["usage_source"], row["price_status"]) == ("ok", "reported", "priced")
    assert (row["input_tokens"], row["cached_input_tokens"], row["cache_write_tokens"]) == (4012, 1000, 3000)
    assert (row["cache_write_1h_tokens"], row["output_tokens"]) == (2000, 150)
    # 12 x 3.00 + 1000 x 0.30 + 1000 x 3.75 (5m) + 2000 x 6.00 (1h) + 150 x 15.00 = 18,336 per 1M
    assert row["cost_usd"] == Decimal("0.018336")


CHUNK = (
    '{"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini-2024-07-18",'
    '"service_tier":"default","system_fingerprint":"fp_1","choices":%s%s,"obfuscation":"xy"}'
)
TOOL_DELTAS = [
    '[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_a","type":"function",'
    '"function":{"name":"w","arguments":""}}],"refusal":null},"logprobs":null,"finish_reason":null}]',
    '[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\": \\"Paris\\"}"}}]},'
    '"logprobs":null,"finish_reason":null}]',
    # a second call whose arguments hold the very text tokenward removes from chunks: never touched
    '[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"w",'
    '"arguments":"{\\"usage\\":null}"}}]},"logprobs":null,"finish_reason":null}]',
    '[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls"}]',
]
TOOL_USAGE = '{"prompt_tokens":50,"completion_tokens":30,"total_tokens":80}'


def as_openai_streams(head: bytes, body: bytes) -> list[Any]:
    """OpenAI's stream: with ``include_usage``, ``"usage":null`` on each chunk and a usage-only chunk."""
    asked = b'"include_usage":true' in body.replace(b" ", b"")
    null = ',"usage":null' if asked else ""
    frames = [("data: " + CHUNK % (delta, null) + "\n\n").encode() for delta in TOOL_DELTAS]
    if asked:
        frames.append(("data: " + CHUNK % ("[]", ',"usage":' + TOOL_USAGE) + "\n\n").encode())
    frames.append(b"data: [DONE]\n\n")
    steps: list[Any] = [sse_head(b"x-request-id: req_s\r\n")]
    for frame in frames:
        steps += [chunk(frame), 0.01]  # one event per read, as a provider sends them
    return [*steps, LAST_CHUNK]


def test_parallel_tool_calls_streamed_without_usage_asked_are_the_providers_bytes(proxy, raw_upstream):
    # tokenward asks for usage the client did not ask for, and takes out again what that added
    raw_upstream.script = as_openai_streams
    request = {"model": "gpt-4o-mini", "messages": HELLO, "tools": [{"type": "function", "function": {"name": "w"}}]}
    seen = {}
    for via, base in (("direct", raw_upstream.url), ("tokenward", proxy.url)):
        client = openai_client(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
        with client.chat.completions.with_streaming_response.create(**request, stream=True) as response:
            body = b"".join(response.iter_bytes())
        with client.beta.chat.completions.stream(**request) as stream:
            calls = [
                (c.id, c.function.name, c.function.arguments)
                for c in stream.get_final_completion().choices[0].message.tool_calls
            ]
        seen[via] = (body, calls)
    assert seen["tokenward"] == seen["direct"]
    assert seen["tokenward"][1] == [("call_a", "w", '{"city": "Paris"}'), ("call_b", "w", '{"usage":null}')]
    assert b'"usage"' not in seen["tokenward"][0].replace(b'\\"usage\\"', b"")
    rows = proxy.rows(2)
    # as reported: 50 x 0.15/1M + 30 x 0.60/1M each
    assert [(r["outcome"], r["usage_source"], r["cost_usd"]) for r in rows] == [
        ("ok", "reported", Decimal("0.0000255"))
    ] * 2


@pytest.mark.parametrize(
    "extra",
    [
        b"x-trace: " + b"t" * 12_000 + b"\r\n",  # one header of 12 KB (the SDKs' own limit: a 16 KiB head)
        b"".join(b"x-h%d: %d\r\n" % (i, i) for i in range(200)),  # 200 headers (a relay copying its upstream's)
    ],
    ids=["long-header", "many-headers"],
)
def test_a_reply_head_the_sdk_reads_directly_is_read_through_tokenward_too(proxy, raw_upstream, extra):
    # aiohttp's defaults (8,190 bytes a header, 128 headers) made tokenward answer 502 "upstream
    # connection failed" to a reply the SDK reads directly, and the row said the provider was unreachable
    raw_upstream.script = lambda head, body: [reply(b"200 OK", extra, CHAT_REPLY)]
    seen = {}
    for via, base in (("direct", raw_upstream.url), ("tokenward", proxy.url)):
        client = openai_client(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=HELLO)
        seen[via] = (raw.status_code, provider_headers(raw.http_response), raw.parse().model_dump())
    assert seen["tokenward"] == seen["direct"]
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["http_status"], row["cost_usd"]) == ("ok", 200, Decimal("0.0000018"))


def test_a_client_that_closes_a_thinking_stream_early_gets_a_row_with_the_usage_the_upstream_went_on_to_report(
    proxy, raw_upstream
):
    # the provider bills the whole reply: tokenward reads on, without sending, for its usage report
    frames = thinking_stream()
    raw_upstream.script = lambda head, body: [
        sse_head(),
        *[step for frame in frames for step in (chunk(frame), 0.05)],
        LAST_CHUNK,
    ]
    client = anthropic_client(base_url=proxy.url, api_key="sk-ant-test", max_retries=0)
    with client.messages.stream(**THINKING_REQUEST) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                break  # the with block closes the response: the client hangs up
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["usage_source"], row["price_status"]) == ("client_disconnected", "reported", "priced")
    assert (row["input_tokens"], row["cache_write_1h_tokens"], row["output_tokens"]) == (4012, 2000, 150)
    assert row["cost_usd"] == Decimal("0.018336")


def test_an_upstream_that_drops_mid_stream_breaks_the_sdks_stream_as_directly_and_bills_what_was_seen(
    proxy, raw_upstream
):
    frames = [("data: " + CHUNK % (delta, "") + "\n\n").encode() for delta in TOOL_DELTAS[:2]]
    raw_upstream.script = lambda head, body: [sse_head(), chunk(frames[0]), 0.05, chunk(frames[1]), 0.05, "close"]
    request = {"model": "gpt-4o-mini", "messages": HELLO, "tools": [{"type": "function", "function": {"name": "w"}}]}
    seen = {}
    for via, base in (("direct", raw_upstream.url), ("tokenward", proxy.url)):
        client = openai_client(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
        calls = []
        with pytest.raises(Exception) as broke:  # noqa: B017, PT011 - whatever the SDK raises directly
            for event in client.chat.completions.create(**request, stream=True):
                calls += [c.function.arguments for c in event.choices[0].delta.tool_calls or []]
        seen[via] = (calls, type(broke.value))
    assert seen["tokenward"] == seen["direct"] == (["", '{"city": "Paris"}'], seen["direct"][1])
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["usage_source"], row["price_status"]) == ("upstream_failed", "partial", "priced")
    # o200k_base: the request is 9 tokens (test_billing_faults) plus 13 for the tools' JSON; the output
    # seen is the call's name "w" (1) and its arguments {"city": "Paris"} (6): 22 x 0.15 + 7 x 0.60 per 1M
    assert (row["input_tokens"], row["output_tokens"], row["cost_usd"]) == (22, 7, Decimal("0.0000075"))


@pytest.mark.parametrize("after", ["nan", "inf", "-5", "1e400", "soon"])
def test_tokenwards_own_retry_survives_any_retry_after_an_upstream_sends(start_proxy, raw_upstream, after):
    # with `retries` set, tokenward waits as a 429's Retry-After says (at most 30 s): "nan" made
    # uvloop's sleep raise (the client got a 500 proxy_error, and asyncio's would never have woken)
    upstream = UpstreamConfig(
        name="test", base_url=f"{raw_upstream.url}/v1", provider="test", default=True, retries=1, retry_backoff_s=0.01
    )
    proxy = start_proxy(upstreams=[upstream], catalog=load_catalog([PRICES], builtin=False))
    refusal = reply(b"429 Too Many Requests", f"retry-after: {after}\r\n".encode(), RATE_LIMITED)
    answers = [refusal, reply(b"200 OK", b"", CHAT_REPLY)]
    raw_upstream.script = lambda head, body: [answers.pop(0)]
    client = openai_client(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0, timeout=5)
    start = time.monotonic()
    assert client.chat.completions.create(model="gpt-4o-mini", messages=HELLO).usage.prompt_tokens == 8
    assert time.monotonic() - start < 2  # "inf" and "1e400" wait the backoff, not 30 s
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["http_status"], row["cost_usd"]) == ("ok", 200, Decimal("0.0000018"))
    assert row["error"] == "succeeded after 1 retries: upstream answered 429"


def test_tokenwards_own_retry_honours_x_should_retry_false(start_proxy, raw_upstream):
    """A 429 that says ``x-should-retry: false`` reaches the client at once, as the SDKs treat it: one attempt."""
    upstream = UpstreamConfig(
        name="test", base_url=f"{raw_upstream.url}/v1", provider="test", default=True, retries=2, retry_backoff_s=0.01
    )
    proxy = start_proxy(upstreams=[upstream], catalog=load_catalog([PRICES], builtin=False))
    refusal = reply(b"429 Too Many Requests", b"x-should-retry: false\r\n", RATE_LIMITED)
    answers = [refusal, reply(b"200 OK", b"", CHAT_REPLY)]
    raw_upstream.script = lambda head, body: [answers.pop(0)]
    client = openai_client(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0, timeout=5)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="gpt-4o-mini", messages=HELLO)
    assert len(raw_upstream.requests) == 1 and len(answers) == 1  # before: retried, and the client got the 200
    (row,) = proxy.rows(1)
    assert (row["http_status"], row["cost_usd"]) == (429, Decimal("0"))
