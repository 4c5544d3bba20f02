"""Billing faults found by attacking tokenward with broken upstreams, each with its exact row.

A real proxy in front of :class:`~tests.raw_upstream.RawUpstream` (raw bytes, so an upstream can
break HTTP framing or SSE in ways a framework would not let it), real SDK clients where they
fit. Prices: the field cases' test prices (tests/fixtures/field_case_prices.yaml, USD per 1M):
gpt-4o-mini 0.15 in / 0.60 out; claude-sonnet-4 3.00 in, 0.30 cache read, 3.75 cache write
(5m) / 6.00 (1h), 15.00 out. Token counts of estimates are o200k_base counts: the request
``[{"role": "user", "content": "hello world"}]`` is 9 input tokens (see test_stream_endings),
"Hi" is 1 output token.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from decimal import Decimal
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tokenward.pricing.budgets import Budget, Period
from tokenward.pricing.catalog import load_catalog
from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.config import UpstreamConfig
from tokenward.proxy.guard import BudgetGuard, BudgetRefusal

from .raw_upstream import LAST_CHUNK, chunk, json_reply, sse_head
from .servers import post_then_leave

PRICES = Path(__file__).parent / "fixtures" / "field_case_prices.yaml"
CHAT = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hello world"}]}


@pytest.fixture
def proxy(raw_proxy):
    return raw_proxy("test", "test", catalog=load_catalog([PRICES], builtin=False), drain_s=2.0)


def capped_proxy(start_proxy, raw_upstream, limit_usd: Decimal):
    """A proxy in front of ``raw_upstream`` at the field-case prices, under one blocking budget of ``limit_usd``."""
    budget = BudgetSettings(name="cap", limit_usd=limit_usd, period="total", action="block")
    catalog = load_catalog([PRICES], builtin=False)
    upstreams = [UpstreamConfig(name="test", base_url=f"{raw_upstream.url}/v1", provider="test", default=True)]
    return start_proxy(upstreams=upstreams, catalog=catalog, budgets=[budget])


def event(obj: dict, name: str | None = None) -> bytes:
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return b"event: " + name.encode() + b"\n" + data if name else data


def delta(text: str) -> bytes:
    return event({"id": "c", "object": "chat.completion.chunk", "model": "gpt-4o-mini",
                  "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})  # fmt: skip


def test_a_chunk_size_that_is_not_hex_mid_stream_ends_the_stream_and_writes_its_row(proxy, raw_upstream):
    # A middlebox that times a stream out writes its own reply into the chunked body: the chunk
    # size line is not hex. aiohttp's C parser told only the connection, so the relay waited
    # forever for the next chunk (the read timeout dropped too): the client hung and no row was
    # ever written. Now the stream breaks off as the upstream's did and the row is partial.
    raw_upstream.script = lambda head, body: [sse_head(), chunk(delta("Hi")), 0.3, b"HTTP/1.1 504 Gateway Timeout\r\n", 5.0]
    received = b""
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=CHAT, timeout=4) as reply:
            for piece in reply.iter_raw():
                received += piece
    assert received == delta("Hi")
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["usage_source"], row["price_status"]) == ("upstream_failed", "partial", "priced")
    # 9 input tokens counted from the request, "Hi" 1 output token: 9 x 0.15/1M + 1 x 0.60/1M
    assert (row["input_tokens"], row["output_tokens"], row["cost_usd"]) == (9, 1, Decimal("0.00000195"))
    assert "closed before the body ended" in row["error"]


def test_a_chunk_size_that_is_not_hex_in_a_json_body_is_a_502_with_its_row(proxy, raw_upstream):
    body = b'{"id":"x","object":"chat.completion","model":"gpt-4o-mini","choices":[]'
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    raw_upstream.script = lambda h, b: [head, chunk(body), 0.3, b"<html>bad gateway</html>\r\n", 5.0]
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello world"}]}
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=request, timeout=4)
    assert reply.status_code == 502 and reply.json()["error"]["code"] == "upstream_failed"
    (row,) = proxy.rows(1)
    # the upstream answered and may bill it: the cost is unknown, never $0
    assert (row["outcome"], row["price_status"], row["cost_usd"]) == ("upstream_failed", "usage_unknown", None)


MESSAGE_START = {
    "type": "message_start",
    "message": {"id": "msg_n", "type": "message", "role": "assistant", "model": "claude-sonnet-4", "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 12, "cache_creation_input_tokens": 4510, "cache_read_input_tokens": 2000,
                          "cache_creation": {"ephemeral_5m_input_tokens": 4000, "ephemeral_1h_input_tokens": 510},
                          "output_tokens": 1}},
}  # fmt: skip


def anthropic_stream(message_delta_usage: dict) -> list[bytes]:
    return [
        event(MESSAGE_START, "message_start"),
        event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}, "content_block_start"),
        event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}, "content_block_delta"),
        event({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        event({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
               "usage": message_delta_usage}, "message_delta"),
        event({"type": "message_stop"}, "message_stop"),
    ]  # fmt: skip


def test_anthropic_message_delta_nulls_keep_the_counts_of_message_start(proxy, raw_upstream):
    # message_delta's input counts are nullable (MessageDeltaUsage): the SDK keeps message_start's
    # value for a null; tokenward merged the null over it and billed 2,012 input tokens as none
    usage = {"input_tokens": None, "cache_creation_input_tokens": None, "cache_read_input_tokens": None,
             "output_tokens": 5}  # fmt: skip
    raw_upstream.script = lambda h, b: [sse_head(), *map(chunk, anthropic_stream(usage)), LAST_CHUNK]
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0)
    with client, client.messages.stream(
        model="claude-sonnet-4", max_tokens=100, messages=[{"role": "user", "content": "hello world"}],
        extra_headers={"x-tokenward-upstream": "anthropic-test"},
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    seen = final.usage
    assert (seen.input_tokens, seen.cache_creation_input_tokens, seen.cache_read_input_tokens) == (12, 4510, 2000)
    (row,) = proxy.rows(1)
    assert (row["input_tokens"], row["cached_input_tokens"], row["cache_write_tokens"]) == (6522, 2000, 4510)
    assert (row["cache_write_1h_tokens"], row["output_tokens"], row["usage_source"]) == (510, 5, "reported")
    # 12 x 3.00 + 4000 x 3.75 (5m writes) + 510 x 6.00 (1h writes) + 2000 x 0.30 + 5 x 15.00 = 18,771 per 1M
    assert row["cost_usd"] == Decimal("0.018771")


REPLY = {"id": "chatcmpl-e", "object": "chat.completion", "created": 0, "model": "gpt-4o-mini",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}]}  # fmt: skip
FINISH = {"id": "c", "object": "chat.completion.chunk", "model": "gpt-4o-mini",
          "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}  # fmt: skip


def openai_client(proxy):
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0)


def serve_usage(raw_upstream, usage, *, stream: bool):
    if stream:
        usage_chunk = {"id": "c", "object": "chat.completion.chunk", "model": "gpt-4o-mini", "choices": [], "usage": usage}
        events = [delta("Hi"), event(FINISH), event(usage_chunk), b"data: [DONE]\n\n"]
        raw_upstream.script = lambda h, b: [sse_head(), *map(chunk, events), LAST_CHUNK]
    else:
        raw_upstream.script = lambda h, b: [json_reply(json.dumps(dict(REPLY, usage=usage)).encode())]


def send_chat(proxy, *, stream: bool):
    messages = [{"role": "user", "content": "hello world"}]
    with openai_client(proxy) as client:
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="gpt-4o-mini", messages=messages, stream=True) if c.choices)  # fmt: skip
        else:
            text = client.chat.completions.create(model="gpt-4o-mini", messages=messages).choices[0].message.content
    assert text == "Hi"


@pytest.mark.parametrize("usage", [{}, {"prompt_tokens": None, "completion_tokens": None, "total_tokens": None}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_usage_object_with_no_count_is_estimated_not_zero(proxy, raw_upstream, usage, stream):
    # {"usage": {}} was priced as 0 input and 0 output tokens: "priced", $0, for a reply with output
    serve_usage(raw_upstream, usage, stream=stream)
    send_chat(proxy, stream=stream)
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["usage_source"], row["price_status"]) == ("ok", "estimated", "priced")
    # as with no usage at all: 9 input tokens, "Hi" 1 output token: 9 x 0.15/1M + 1 x 0.60/1M
    assert (row["input_tokens"], row["output_tokens"], row["cost_usd"]) == (9, 1, Decimal("0.00000195"))


@pytest.mark.parametrize("stream", [False, True])
def test_an_output_count_without_an_input_count_is_invalid_not_free_input(proxy, raw_upstream, stream):
    # {"prompt_tokens": null, "completion_tokens": 12} was priced as 0 input tokens ($0.0000072)
    serve_usage(raw_upstream, {"prompt_tokens": None, "completion_tokens": 12}, stream=stream)
    send_chat(proxy, stream=stream)
    (row,) = proxy.rows(1)
    assert (row["usage_source"], row["price_status"], row["cost_usd"]) == ("reported", "usage_invalid", None)
    assert row["output_tokens"] == 12


def test_an_anthropic_usage_object_with_no_count_is_estimated_not_zero(proxy, raw_upstream):
    message = {"id": "msg_e", "type": "message", "role": "assistant", "model": "claude-sonnet-4",
               "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn", "usage": {}}  # fmt: skip
    raw_upstream.script = lambda h, b: [json_reply(json.dumps(message).encode())]
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0)
    with client:
        client.messages.create(
            model="claude-sonnet-4", max_tokens=100, messages=[{"role": "user", "content": "hello world"}],
            extra_headers={"x-tokenward-upstream": "anthropic-test"},
        )  # fmt: skip
    (row,) = proxy.rows(1)
    assert (row["usage_source"], row["price_status"]) == ("estimated", "priced")
    # "hello world" 2 tokens + 3 for the message + 3 for the reply = 8 input, "Hi" 1 output:
    # 8 x 3.00/1M + 1 x 15.00/1M = $0.000039 (it was priced as $0)
    assert (row["input_tokens"], row["output_tokens"], row["cost_usd"]) == (8, 1, Decimal("0.000039"))


@pytest.mark.parametrize(
    "usage_event",
    [
        # a multi-line data field (the SSE rules join its lines with LF: the same JSON)
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[],\ndata: "usage":\n'
        b'data: {"prompt_tokens":14,"completion_tokens":5,"total_tokens":19}}\n\n',
        # JSON whitespace around the colon, more than a few bytes of it
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage" :\t\t        '
        b'{"prompt_tokens":14,"completion_tokens":5,"total_tokens":19}}\n\n',
    ],
    ids=["multi-line-data", "whitespace"],
)
def test_usage_the_client_reads_is_the_usage_billed_however_the_event_is_laid_out(proxy, raw_upstream, usage_event):
    # the meter looked for `"usage":{` within 8 bytes on one line: it missed these, estimated the
    # reply at 9 + 1 tokens ($0.00000195) while the client read 14 + 5 from the same stream
    events = [delta("Hi"), event(FINISH), usage_event, b"data: [DONE]\n\n"]
    raw_upstream.script = lambda h, b: [sse_head(), *map(chunk, events), LAST_CHUNK]
    with openai_client(proxy) as client:
        chunks = list(client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hello world"}], stream=True,
            stream_options={"include_usage": True}))  # fmt: skip
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (14, 5)
    (row,) = proxy.rows(1)
    assert (row["usage_source"], row["input_tokens"], row["output_tokens"]) == ("reported", 14, 5)
    assert row["cost_usd"] == Decimal("0.0000051")  # 14 x 0.15/1M + 5 x 0.60/1M


def test_a_hard_limit_bounds_legacy_completions_by_best_of_not_n(start_proxy, raw_upstream):
    # best_of=5 makes the provider generate and bill 5 completions of up to max_tokens each and
    # return n=1 of them (OpenAI, /v1/completions); the bound priced one: it fitted a $0.0002 limit
    # and the request was billed $0.0003003, 50 % past the hard limit
    proxy = capped_proxy(start_proxy, raw_upstream, Decimal("0.0002"))
    reply = {"id": "cmpl-1", "object": "text_completion", "model": "gpt-4o-mini",
             "choices": [{"index": 0, "text": "Hi", "finish_reason": "length"}],
             "usage": {"prompt_tokens": 2, "completion_tokens": 500, "total_tokens": 502}}  # fmt: skip
    raw_upstream.script = lambda h, b: [json_reply(json.dumps(reply).encode())]
    request = {"model": "gpt-4o-mini", "prompt": "hello world", "max_tokens": 100, "best_of": 5, "n": 1}
    refused = httpx.post(f"{proxy.url}/v1/completions", json=request, timeout=10)
    # bound: ceil(2 x 1.1) + 300 = 303 input, 5 x 100 output: 303 x 0.15/1M + 500 x 0.60/1M = $0.00034545
    # > $0.0002 (one completion's bound, 303 x 0.15/1M + 100 x 0.60/1M = $0.00010545, fitted)
    assert refused.status_code == 429 and raw_upstream.requests == []
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["cost_usd"]) == ("rejected", 0)


@pytest.mark.parametrize(
    ("limits", "output"),
    [({"max_tokens": "100000"}, 100_000), ({"max_tokens": 100000.0}, 100_000), ({"max_tokens": 40000, "n": "3"}, 120_000)],
    ids=["string-max_tokens", "float-max_tokens", "string-n"],
)
def test_a_hard_limit_reads_limits_as_a_lax_upstream_does(start_proxy, raw_upstream, limits, output):
    # OpenAI refuses "100000" and 100000.0 as max_tokens, but OpenAI-compatible servers validating
    # in lax mode (pydantic's default: vLLM, LiteLLM) read them as the integer. The bound read them
    # as no limit (guard.default_max_output_tokens, 16,384) or n as 1, and left the body as sent:
    # 310 x 0.15/1M + 16,384 x 0.60/1M = $0.0098769 (40,000 x 0.60/1M + ... = $0.0240465 for n)
    # fitted a $0.05 limit, and the upstream billed 100,000 (120,000) output tokens: $0.06 ($0.072).
    proxy = capped_proxy(start_proxy, raw_upstream, Decimal("0.05"))
    usage = {"prompt_tokens": 9, "completion_tokens": output, "total_tokens": 9 + output}
    raw_upstream.script = lambda h, b: [json_reply(json.dumps(dict(REPLY, usage=usage)).encode())]
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello world"}], **limits}
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=request, timeout=10)
    # bound: ceil(9 x 1.1) + 300 = 310 input, 100,000 (3 x 40,000) output:
    # 310 x 0.15/1M + 100,000 x 0.60/1M = $0.0600465 (120,000: $0.0720465) > $0.05
    assert reply.status_code == 429 and raw_upstream.requests == []
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["cost_usd"]) == ("rejected", 0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_whose_content_encoding_cannot_be_decoded_is_usage_unknown_not_input_only(proxy, raw_upstream, stream):
    # the meter could read nothing of it, so the estimate counted the input and 0 output tokens and
    # the row said "priced" ($0.00000135 here) for a reply the provider billed in full
    body = b"\x1f\x8b\x08 not gzip at all"
    kind = b"text/event-stream" if stream else b"application/json"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: " + kind + b"\r\ncontent-encoding: gzip\r\n"
    raw_upstream.script = lambda h, b: [head + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body]
    request = dict(CHAT, stream=stream, stream_options={"include_usage": True}) if stream else dict(CHAT, stream=False)
    with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", json=request, timeout=10) as reply:
        assert reply.status_code == 200 and b"".join(reply.iter_raw()) == body  # relayed as sent
    (row,) = proxy.rows(1)
    assert (row["usage_source"], row["price_status"], row["cost_usd"]) == ("none", "usage_unknown", None)
    assert "content-encoding could not be decoded" in row["error"]


FOX = ["The qu", "ick bro", "wn fo", "x jum", "ps ov", "er the la", "zy do", "g."]  # 10 tokens joined (o200k_base)


@pytest.mark.parametrize("ending", ["cut", "overloaded"])
def test_an_anthropic_stream_that_stops_before_message_delta_bills_the_output_it_sent(proxy, raw_upstream, ending):
    # message_start's usage says output_tokens 1 (a placeholder); the real count comes in
    # message_delta. A stream cut (or failed with an overloaded_error event, as Anthropic streams
    # do) before it was billed 1 output token whatever it had generated: $0.018711 here
    events = [event(MESSAGE_START, "message_start"),
              event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}, "content_block_start")]  # fmt: skip
    events += [event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}},
                     "content_block_delta") for piece in FOX]  # fmt: skip
    if ending == "overloaded":
        events.append(event({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, "error"))
    raw_upstream.script = lambda h, b: [sse_head(), *map(chunk, events), LAST_CHUNK]
    request = {"model": "claude-sonnet-4", "max_tokens": 100, "stream": True, "messages": [{"role": "user", "content": "hello world"}]}
    headers = {"anthropic-version": "2023-06-01", "x-tokenward-upstream": "anthropic-test"}
    httpx.post(f"{proxy.url}/v1/messages", json=request, headers=headers, timeout=10)
    (row,) = proxy.rows(1)
    assert row["outcome"] == ("upstream_failed" if ending == "cut" else "upstream_error")
    assert (row["input_tokens"], row["cached_input_tokens"], row["cache_write_tokens"]) == (6522, 2000, 4510)
    assert (row["output_tokens"], row["usage_source"]) == (10, "partial")  # the 8 deltas joined: 10 tokens
    # 12 x 3.00 + 4000 x 3.75 + 510 x 6.00 + 2000 x 0.30 + 10 x 15.00 = 18,846 per 1M
    assert row["cost_usd"] == Decimal("0.018846")


def test_requests_that_started_before_a_rollover_are_held_to_their_own_period():
    # A request is counted in the period it started in (its row's started_at, in the ledger and
    # after a restart), but was admitted against the current period's book: one that began at
    # 23:59:59 and was admitted after midnight (its body still arriving) was checked against the
    # new day's room and counted in the old day, so neither limit held it. 300 such requests of
    # $0.01 were admitted against a day already at $0.95 of $1.00: $3.00, 3x the limit.
    budget = Budget(name="daily", limit_usd=Decimal("1.00"), period=Period(kind="day"), action="block")
    day1 = dt.datetime(2026, 12, 1, 23, 59, 50, tzinfo=dt.UTC)
    guard = BudgetGuard([budget], day1)
    guard.observe({"started_at": day1.timestamp(), "cost_usd": Decimal("0.95"), "price_status": "priced"})
    day2 = dt.datetime(2026, 12, 2, 0, 0, 5, tzinfo=dt.UTC)
    guard.settle(asyncio.run(guard.admit({}, Decimal("0.01"), day2)), [])  # a request of day 2 rolls the book
    started = dt.datetime(2026, 12, 1, 23, 59, 59, tzinfo=dt.UTC)
    admitted = 0
    for number in range(300):
        try:
            held = asyncio.run(guard.admit({}, Decimal("0.01"), started))
        except BudgetRefusal:
            break
        admitted += 1
        row = {"started_at": started.timestamp(), "cost_usd": Decimal("0.01"), "price_status": "priced",
               "request_id": f"r{number}"}  # fmt: skip
        guard.settle(held, [row])
    assert admitted == 5  # $1.00 - $0.95 = $0.05 of day 1 left: five requests of $0.01
    (standing,) = guard.standing({}, day2)
    assert (standing["spent_usd"], standing["remaining_usd"]) == (0, Decimal("1.00"))  # day 2 untouched


@pytest.mark.parametrize("value", [-1, 0, "unlimited", 1.5])
def test_a_hard_limit_refuses_an_output_limit_it_cannot_read_as_a_bound(start_proxy, raw_upstream, value):
    # llama.cpp's server reads max_tokens -1 (its n_predict) as "until the context is full", and
    # some servers read 0 so too; the bound took them as no limit (16,384 tokens) and sent them as
    # they were: 310 x 0.15/1M + 16,384 x 0.60/1M = $0.0098769 fitted a $0.05 limit, and such an
    # upstream billed 100,000 output tokens, $0.06000135
    proxy = capped_proxy(start_proxy, raw_upstream, Decimal("0.05"))
    usage = {"prompt_tokens": 9, "completion_tokens": 100_000, "total_tokens": 100_009}
    raw_upstream.script = lambda h, b: [json_reply(json.dumps(dict(REPLY, usage=usage)).encode())]
    request = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": value}
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=request, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_output_limit"
    assert raw_upstream.requests == []
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["cost_usd"]) == ("client_error", 0)


@pytest.fixture
def quick_drain_proxy(raw_proxy):
    return raw_proxy("test", "test", catalog=load_catalog([PRICES], builtin=False), drain_s=0.3)


def test_a_stream_whose_upstream_goes_quiet_after_the_client_left_is_recorded_after_the_drain_time(
    quick_drain_proxy, raw_upstream
):
    # The relay learnt of the disconnect only when it had the next event to send: an upstream that
    # then sent nothing held the row (and any budget reservation) until its read timeout.
    raw_upstream.script = lambda head, body: [sse_head(), chunk(delta("Hi")), 30.0]
    started = time.monotonic()
    with httpx.stream("POST", f"{quick_drain_proxy.url}/v1/chat/completions", json=CHAT, timeout=10) as reply:
        assert next(reply.iter_raw()) == delta("Hi")
    (row,) = quick_drain_proxy.rows(1)
    assert time.monotonic() - started < 5  # the drain time (0.3 s) after the client left, not 30 s
    assert row["outcome"] == "client_disconnected" and "sent nothing more within server.drain_after_disconnect_s" in row["error"]
    # what was sent is billed as a partial estimate: 9 input tokens counted from the request, "Hi" 1
    # output token: 9 x 0.15/1M + 1 x 0.60/1M
    assert (row["usage_source"], row["input_tokens"], row["output_tokens"]) == ("partial", 9, 1)
    assert row["cost_usd"] == Decimal("0.00000195")


def test_a_body_whose_upstream_goes_quiet_after_the_client_left_is_recorded_after_the_drain_time(
    quick_drain_proxy, raw_upstream
):
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 400\r\n\r\n"
    raw_upstream.script = lambda head_, body: [head + b'{"id":"c","object":"chat.completion",', 30.0]
    started = time.monotonic()
    post_then_leave(
        f"{quick_drain_proxy.url}/v1/chat/completions", lambda: bool(raw_upstream.requests), json={**CHAT, "stream": False}
    )
    (row,) = quick_drain_proxy.rows(1)
    assert time.monotonic() - started < 5
    assert row["outcome"] == "client_disconnected" and "sent nothing more within server.drain_after_disconnect_s" in row["error"]
    # the upstream was answering: it may bill the request, so its cost is unknown, not $0
    assert (row["price_status"], row["cost_usd"]) == ("usage_unknown", None)
