"""The meter on recorded replies: same usage whatever the read boundaries or the content encoding."""

from __future__ import annotations

import gzip
import json
import random
import zlib

import brotli
import pytest
import zstandard

from tokenward.pricing.usage import Usage, UsageSource
from tokenward.proxy import metering, tokenizer
from tokenward.proxy.metering import Meter, count_input, estimate
from tokenward.proxy.sse import MAX_EVENT_BYTES

CHAT_STREAM = "tests/models/cassettes/test_openai/test_run_stream_sync_streams_real_model.yaml#0"
GROQ_STREAM = "tests/models/cassettes/test_groq/test_tool_use_failed_error_streaming.yaml#1"
RESPONSES_STREAM = "tests/models/cassettes/test_openai_responses/test_openai_responses_stream.yaml#0"


def meter_stream(data: bytes, cuts: list[int], encoding: str | None = None):
    meter = Meter("openai", encoding)
    start = 0
    for cut in sorted(cuts) + [len(data)]:
        meter.feed_stream(data[start:cut])
        start = cut
    meter.end_stream()
    return meter.finish()


@pytest.mark.parametrize(
    ("record", "expected", "model"),
    [
        (CHAT_STREAM, Usage(input_tokens=53, output_tokens=15), "gpt-4o-mini-2024-07-18"),
        (GROQ_STREAM, Usage(input_tokens=304, output_tokens=49, reasoning_tokens=23), "openai/gpt-oss-120b"),
        (RESPONSES_STREAM, Usage(input_tokens=255, output_tokens=16), "gpt-4o-2024-08-06"),
    ],
)
def test_recorded_streams_split_anywhere(sample, record, expected, model):
    data = sample[record].response["sse"].encode()
    whole = meter_stream(data, [])
    assert whole.usage == expected and whole.model == model
    usage_at = data.rfind(b'"usage":{')
    for offset in range(max(0, usage_at - 40), min(len(data), usage_at + 60)):
        assert meter_stream(data, [offset]).usage == expected, offset
    rng = random.Random(2)
    for _ in range(50):
        assert meter_stream(data, rng.sample(range(len(data)), rng.randint(1, 40))).usage == expected


def test_stream_without_usage_reports_none(sample):
    sse = sample[CHAT_STREAM].response["sse"]
    kept = "\n\n".join(block for block in sse.split("\n\n") if '"usage":{' not in block and block) + "\n\n"
    result = meter_stream(kept.encode(), [])
    assert result.usage is None and result.model == "gpt-4o-mini-2024-07-18"


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("br", brotli.compress),
        ("zstd", lambda d: zstandard.ZstdCompressor().compress(d)),
    ],
)
def test_encoded_bodies_are_decoded_on_the_side(encoding, compress, sample):
    # field case B30: gzip body decoding to usage 30 in / 12 out
    body = json.dumps(
        {
            "id": "chatcmpl-b30",
            "object": "chat.completion",
            "model": "gpt-4o-mini",
            "usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42},
        }
    ).encode()
    meter = Meter("openai", encoding)
    meter.feed_body(compress(body))
    assert meter.finish().usage == Usage(input_tokens=30, output_tokens=12)
    sse = sample[CHAT_STREAM].response["sse"].encode()
    packed = compress(sse)
    assert meter_stream(packed, [len(packed) // 3, len(packed) // 2], encoding).usage == Usage(
        input_tokens=53, output_tokens=15
    )


def test_non_json_body_is_not_an_error():
    meter = Meter("openai")
    meter.feed_body(b"<html>Bad gateway</html>")
    assert meter.finish().usage is None


def test_estimate_counts_request_and_streamed_reply():
    request = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello world"}]}).encode()
    reply = [
        b'data: {"model":"gpt-4o-mini","choices":[{"delta":{"content":"hello"}}]}\n\n',
        b'data: {"model":"gpt-4o-mini","choices":[{"delta":{"content":" world"}}]}\n\ndata: [DONE]\n\n',
    ]
    usage = estimate("openai", request, reply, stream=True, model="gpt-4o-mini", source=UsageSource.ESTIMATED)
    # o200k_base: "hello world" is 2 tokens, the role "user" 1; one message: +3, reply priming +3 -> 9 in;
    # "hello" + " world" -> 2 out
    assert usage == Usage(input_tokens=9, output_tokens=2, source=UsageSource.ESTIMATED)


def test_estimates_match_what_openai_reported_for_plain_chat_requests():
    """OpenAI's counting recipe reproduces prompt_tokens exactly for plain gpt-4o/gpt-4.1 chat requests.

    (Search and audio variants add hidden context; reasoning models prime differently: the
    estimate is a fallback, marked ``estimated``, and this pins how close it is.)
    """
    from .conftest import corpus_records

    checked = 0
    for record in corpus_records():
        body = record["request"]["body"]
        if (
            record["provider"] != "openai"
            or record["endpoint"] != "chat_completions"
            or not record["usage_as_reported"]
            or not str(body.get("model", "")).startswith(("gpt-4o", "gpt-4.1"))
            or body.get("tools")
            or "search" in body["model"]
            or "audio" in body["model"]
            or not all(isinstance(m.get("content"), str) for m in body["messages"])
        ):
            continue
        reported = record["usage_as_reported"][-1]["usage"]["prompt_tokens"]
        usage = estimate(
            "openai", json.dumps(body).encode(), [], stream=False, model=body["model"], source=UsageSource.ESTIMATED
        )
        assert usage.input_tokens == reported, record["id"]
        checked += 1
    assert checked >= 20


def corpus_streams():
    from .conftest import corpus_records

    return [r for r in corpus_records() if r["stream"] and r["response"].get("sse")]


def test_every_recorded_stream_meters_the_same_however_it_is_split():
    """Each corpus stream, split at every offset of its last usage object, around its event's
    boundaries, and at random: one reading."""
    checked = 0
    rng = random.Random(11)
    for record in corpus_streams():
        data = record["response"]["sse"].encode()
        meter_name = record["dialect"]
        whole = meter_stream_with(meter_name, data, [])
        start = data.rfind(b'"usage":{')
        if start < 0:
            assert whole.usage is None, record["id"]
            continue
        begin = data.rfind(b"\n\n", 0, start) + 2
        end = data.find(b"\n\n", start) + 2
        usage_end = data.find(b"}", data.find(b"}", start) + 1) + 1  # past the usage object (and one nested object)
        offsets = set(range(start - 8, usage_end + 8)) | set(range(begin - 8, begin + 8)) | set(range(end - 8, end + 8))
        for offset in sorted(o for o in offsets if 0 < o < len(data)):
            again = meter_stream_with(meter_name, data, [offset])
            assert (again.usage, again.parts, again.model) == (whole.usage, whole.parts, whole.model), (
                record["id"],
                offset,
            )
        for _ in range(20):
            cuts = rng.sample(range(len(data)), min(len(data) - 1, rng.randint(1, 60)))
            assert meter_stream_with(meter_name, data, cuts).usage == whole.usage, record["id"]
        checked += 1
    assert checked >= 90


def meter_stream_with(dialect: str, data: bytes, cuts: list[int]):
    meter = Meter(dialect)
    start = 0
    for cut in sorted(cuts) + [len(data)]:
        meter.feed_stream(data[start:cut])
        start = cut
    meter.end_stream()
    return meter.finish()


def test_long_texts_are_counted_in_pieces_to_the_same_total(monkeypatch):
    rng = random.Random(7)  # prose, code, punctuation before spaces, runs of spaces, newlines, tabs, CJK
    words = ["the", "token", "count,", "(x)", "don't", "été", "模型", "\n", "  ", "foo.bar/", "42", "!!", "\t"]
    text = " ".join(rng.choice(words) for _ in range(6000))
    monkeypatch.setattr(metering, "_PIECE", 997)  # ~30 pieces, each cut before a space after a non-space
    for model, encoding in (("gpt-4o", "o200k_base"), ("gpt-4", "cl100k_base")):
        whole = tokenizer.count_tokens(text, encoding)
        assert count_input("openai", {"input": text}, model) == whole
        chat = {"messages": [{"role": "user", "content": text}]}
        assert count_input("openai", chat, model) == whole + 1 + 3 + 3  # "user", one message, the reply priming
    run = "QUJD" * 2500  # 10,000 characters and no space (base64): cut at the piece size, ~10 cuts
    assert abs(count_input("openai", {"input": run}, "gpt-4o") - tokenizer.count_tokens(run, "o200k_base")) <= 10


def test_every_recorded_stream_ends_with_its_terminal_event_and_a_cut_one_does_not():
    from tokenward.proxy.sse import SSEDecoder

    checked = 0
    for record in corpus_streams():
        data = record["response"]["sse"].encode()
        meter = Meter(record["dialect"])
        meter.feed_stream(data)
        meter.end_stream()
        assert meter.complete, record["id"]
        blocks = SSEDecoder().feed(data)
        if len(blocks) >= 6:
            cut = Meter(record["dialect"])
            cut.feed_stream(b"".join(blocks[: len(blocks) // 2]))
            assert not cut.complete, record["id"]
            checked += 1
    assert checked >= 80


def test_terminal_events_of_each_format():
    cases = [
        ("openai", b"data: [DONE]\n\n"),
        ("openai", b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'),
        ("openai", b'event: response.incomplete\ndata: {"type":"response.incomplete","response":{"usage":null}}\n\n'),
        ("anthropic", b'event: message_stop\ndata: {"type":"message_stop"}\n\n'),
        (
            "anthropic",
            b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n',
        ),
    ]
    for dialect, event in cases:
        meter = Meter(dialect)
        meter.feed_stream(b'data: {"model":"m","choices":[{"index":0,"delta":{"content":"[DONE]"}}]}\n\n')
        assert not meter.complete  # "[DONE]" inside a text is not the terminator
        meter.feed_stream(event)
        assert meter.complete, event


def test_a_corrupt_encoded_body_is_relayed_unmetered_not_raised():
    meter = Meter("openai", "gzip")
    meter.feed_body(b"this is not gzip")
    result = meter.finish()
    assert result.usage is None and result.complete
    assert result.unmetered == "the reply's content-encoding could not be decoded: relayed, not metered"
    stream = Meter("openai", "br")
    assert stream.feed_stream(b"\x00\x01 not brotli") == [] and stream.unmetered is not None


FOX = ["The qu", "ick bro", "wn fo", "x jum", "ps ov", "er the la", "zy do", "g."]  # o200k: 10 tokens joined, 17 apart


def test_estimates_join_each_piece_of_output_before_counting():
    request = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello world"}]}).encode()
    chat = [
        b'data: {"choices":[{"index":0,"delta":{"content":%s}},{"index":1,"delta":{"content":%s}}]}\n\n'
        % (json.dumps(p).encode(), json.dumps(p).encode())
        for p in FOX
    ]
    usage = estimate("openai", request, chat, stream=True, model="gpt-4o-mini", source=UsageSource.ESTIMATED)
    assert (usage.input_tokens, usage.output_tokens) == (9, 20)  # two choices of 10 tokens each
    text = "The quick brown fox jumps over the lazy dog."
    item = {"id": "msg_1", "type": "message", "content": [{"type": "output_text", "text": text}]}
    responses = [
        b"event: response.output_text.delta\ndata: %s\n\n"
        % json.dumps(
            {"type": "response.output_text.delta", "item_id": "msg_1", "content_index": 0, "delta": p}
        ).encode()
        for p in FOX
    ] + [
        b"data: %s\n\n" % json.dumps({"type": "response.output_item.done", "item": item}).encode(),
        b"data: %s\n\n"
        % json.dumps({"type": "response.completed", "response": {"output": [item], "usage": None}}).encode(),
    ]
    usage = estimate("openai", request, responses, stream=True, model="gpt-4o-mini", source=UsageSource.ESTIMATED)
    assert usage.output_tokens == 10  # the deltas, the finished item and the final output are one text
    anthropic_events = [
        b"data: %s\n\n"
        % json.dumps({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}}).encode()
        for p in FOX
    ]
    usage = estimate("anthropic", request, anthropic_events, stream=True, model=None, source=UsageSource.PARTIAL)
    assert (usage.output_tokens, usage.source) == (10, UsageSource.PARTIAL)


def test_web_search_calls_in_a_stream_are_counted_once_however_split():
    from pathlib import Path

    data = (Path(__file__).parent / "fixtures" / "usage" / "responses_web_search_stream.sse").read_bytes()
    for offset in range(0, len(data), 7):
        result = meter_stream(data, [offset])
        assert (result.usage.web_search_requests, result.web_search_calls, result.complete) == (2, 2, True), offset


def _json_values():
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(10**18), 10**18),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=40),
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
        max_leaves=30,
    )


def _request_bodies():
    from hypothesis import strategies as st

    value = _json_values()
    text = st.text(max_size=60) | st.lists(st.integers(0, 200_000), max_size=8) | value
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]), "content": text},
        optional={"name": st.text(max_size=8), "tool_calls": value},
    )
    block = st.fixed_dictionaries({}, optional={"text": st.text(max_size=40), "input": value, "content": value})
    return st.fixed_dictionaries(
        {"model": st.sampled_from(["gpt-4o", "gpt-4", "claude-sonnet-4", "house-model"])},
        optional={
            "messages": st.lists(message | st.lists(block, max_size=3) | value, max_size=5),
            "input": text,
            "prompt": text,
            "instructions": text,
            "system": text | st.lists(block, max_size=3),
            "tools": st.lists(value, max_size=3),
        },
    )


def test_the_texts_bytes_bound_their_count_for_every_dialect_and_encoding():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tokenward.proxy.metering import input_bytes

    @settings(max_examples=300, deadline=None)
    @given(_request_bodies(), st.sampled_from(["openai", "anthropic"]))
    def check(body, dialect):
        # the budget bound without the tokenizer must never be below the counted one
        assert input_bytes(dialect, body) >= count_input(dialect, body, body["model"])

    check()
    # the case the body's size missed: a tool schema's 1e15 re-encoded as 1000000000000000.0
    tools = {"model": "gpt-4o", "tools": [{"enum": [1e15] * 100}]}
    # 9 tokens a number with its comma, less the last comma; '[{"enum":[' 4 tokens, ']}]' 2
    assert count_input("openai", tools, "gpt-4o") == 9 * 100 - 1 + 6
    assert input_bytes("openai", tools) == 19 * 100 - 1 + 13  # 19 bytes a number and comma; 13 of syntax


def test_member_names_inside_generated_text_neither_end_a_stream_nor_carry_usage():
    meter = Meter("openai")
    text = 'say "finish_reason": "stop" and "usage": {"prompt_tokens": 1}'
    quoted = {"model": "gpt-4o-mini", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    meter.feed_stream(b"data: " + json.dumps(quoted).encode() + b"\n\n")
    assert (meter.complete, meter.has_usage) == (False, False)  # the names are escaped inside the text
    # real members, with the spaces some servers put around the colon
    meter.feed_stream(b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason" :  "stop"}]}\n\n')
    assert (meter.complete, meter.has_usage) == (True, False)
    meter.feed_stream(b'data: {"choices": [], "usage" : {"prompt_tokens": 7, "completion_tokens": 3}}\n\n')
    result = meter.finish()
    assert (result.usage.input_tokens, result.usage.output_tokens) == (7, 3)


def test_an_event_over_the_cap_is_metered_from_its_copy_and_the_row_says_what_was_left_out():
    cap = MAX_EVENT_BYTES
    usage = b'"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}'
    big = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"' + b"a" * cap + b'"}}],' + usage + b"}\n\n"
    for reads in ([big], [big[: cap // 2], big[cap // 2 :]], [big[i : i + 65536] for i in range(0, len(big), 65536)]):
        meter = Meter("openai")
        for read in reads:
            meter.feed_stream(read)
        result = meter.finish()
        assert (result.usage.input_tokens, result.usage.output_tokens) == (9, 3) and result.unmetered is None
    # no usage in it: an estimate would miss the content left out, and the row says so
    meter = Meter("openai")
    meter.feed_stream(big.replace(b"," + usage, b""))
    assert meter.finish().unmetered == f"an SSE event over {cap} bytes: metered without its strings over 64 KiB"
    # a copy that cannot be made small (millions of short strings) is not metered, as before
    meter = Meter("openai")
    meter.feed_stream(b'data: {"parts":[' + b",".join([b'"ab"'] * (cap // 4)) + b"]," + usage + b"}\n\n")
    result = meter.finish()
    assert result.usage is None and result.unmetered == f"an SSE event over {cap} bytes: relayed, not metered"


@pytest.mark.parametrize(
    ("dialect", "document", "expected"),
    [
        # iterations that are no list list none: the top-level counts are billed (before: TypeError)
        ("anthropic", {"type": "message", "usage": {"input_tokens": 10, "output_tokens": 5, "iterations": 3}},
         Usage(input_tokens=10, output_tokens=5)),
        # an event type that is no string is no image event (before: TypeError, unhashable list)
        ("media", {"type": ["image_generation.completed"], "usage": {"input_tokens": 7, "output_tokens": 9}},
         Usage(input_tokens=7, output_tokens=9)),
        # a Groq executed tool whose type is no string is no search (before: TypeError, unhashable dict)
        ("openai", {"choices": [{"index": 0, "message": {"executed_tools": [{"type": {"search": 1}}]}}],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 2}},
         Usage(input_tokens=4, output_tokens=2)),
    ],
)  # fmt: skip
def test_members_of_an_unexpected_type_are_read_as_absent_not_raised(dialect, document, expected):
    meter = Meter(dialect)
    meter.feed_body(json.dumps(document).encode())
    assert meter.finish().usage == expected


JUNK = [None, True, 0, -1, 1.5, 12.0, "12", "x", [], [1], [[]], [{}], {}, {"a": 1}, 2**60, 1e30]
USAGE_NAMES = [
    "prompt_tokens", "completion_tokens", "total_tokens", "input_tokens", "output_tokens", "prompt_tokens_details",
    "input_tokens_details", "completion_tokens_details", "output_tokens_details", "cached_tokens",
    "prompt_cache_hit_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "cache_write_tokens",
    "cache_creation", "server_tool_use_details", "cost", "iterations", "server_tool_use", "ephemeral_1h_input_tokens",
    "reasoning_tokens", "audio_tokens", "image_tokens", "web_search_requests", "thinking_tokens", "type", "seconds",
]  # fmt: skip
REPLY_NAMES = [
    "usage", "model", "service_tier", "x_groq", "usage_breakdown", "response", "tool_usage", "error", "type",
    "object", "status", "output", "item", "output_index", "choices", "message", "data", "size", "quality", "duration",
]  # fmt: skip


def test_no_reply_shape_makes_the_meter_raise():
    """Seeded random replies, JSON of every type in every member the dialects read: the meter never raises.

    A meter that raises leaves the exchange to the forwarder's last resort (a usage_unknown row).
    """
    rng = random.Random(7)

    def junk(depth: int = 0):
        if depth < 2 and rng.random() < 0.3:
            return {rng.choice(USAGE_NAMES): junk(depth + 1) for _ in range(rng.randint(1, 4))}
        return rng.choice(JUNK)

    def reply(names: list[str]) -> dict:
        document = {name: junk() for name in rng.sample(names, rng.randint(1, 8))}
        if rng.random() < 0.5:
            document["type"] = rng.choice(
                ["message_delta", "image_generation.completed", "response.output_item.done", "response.completed", 1]
            )
        for name, value in (
            ("output", [{"type": "web_search_call", "id": junk()}]),
            ("item", {"type": "web_search_call", "id": junk()}),
            (
                "choices",
                [{"index": junk(), "message": {"executed_tools": junk()}, "delta": {"executed_tools": [junk()]}}],
            ),
            ("message", {"usage": junk(), "model": junk()}),
            ("usage_breakdown", {"models": [{"model": "m", "usage": junk()}, junk()]}),
        ):
            if rng.random() < 0.3:
                document[name] = value
        return document

    for _ in range(3000):
        dialect = rng.choice(["openai", "anthropic", "media"])
        meter = Meter(dialect)
        for document in (reply(rng.choice([USAGE_NAMES, REPLY_NAMES])) for _ in range(rng.randint(1, 3))):
            text = json.dumps(document).encode()
            text = text[:-1] + b', "web_search_call": 1, "executed_tools": 1}' if rng.random() < 0.3 else text
            meter.feed_stream(b"data: " + text + b"\n\n")
        meter.end_stream()
        result = meter.finish()
        if result.usage is not None:
            result.usage.violations()


def test_an_estimate_reads_indexes_and_choices_of_an_unexpected_type_without_raising():
    request = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}).encode()
    chunks = [
        b'data: {"choices": [{"index": [0], "delta": {"content": "Hello"}}]}\n\n',  # an index no dict key can be
        b'data: {"choices": [{"index": [0], "delta": {"content": " there"}}]}\n\n',
        b'data: {"choices": true}\n\n',  # choices that are no list hold no text
        b"data: [DONE]\n\n",
    ]
    usage = estimate("openai", request, chunks, stream=True, model="gpt-4o-mini", source=UsageSource.ESTIMATED)
    # "Hello there" is 2 tokens (o200k_base), joined as one piece; the input: 1 message x 3 + "user" + "hi" + 3
    assert (usage.input_tokens, usage.output_tokens) == (8, 2)


def test_a_responses_error_event_is_recorded_with_its_message():
    meter = Meter("openai")
    meter.feed_stream(b'event: response.created\ndata: {"type":"response.created","response":{"model":"gpt-4.1"}}\n\n')
    meter.feed_stream(
        b'event: error\ndata: {"type":"error","code":"server_error","message":"The model is overloaded"}\n\n'
    )
    meter.end_stream()
    result = meter.finish()
    assert (result.error, result.complete, result.usage) == ("The model is overloaded", True, None)  # before: "error"
