"""The simulator answers any well-formed request: replays a matching recording, synthesises the rest.

Synthesised replies go through tokenward to the real openai and anthropic SDKs, streamed and not;
the usage the client sees, the tokens the ledger row holds and a count by hand all agree.
"""

from __future__ import annotations

import base64
import struct
import uuid

import anthropic
import httpx
import openai
import pytest

from tokenward.proxy import tokenizer
from tokenward.proxy.config import UpstreamConfig
from tokenward.proxy.simulator import FAULT_HEADER, RECORD_HEADER, SOURCE_HEADER
from tokenward.proxy.synthetic import endpoint_of, synthesise

HI = [{"role": "user", "content": "hi"}]
# "user" and "hi" are one o200k_base token each; OpenAI's chat recipe adds 3 per message and 3: 1 + 1 + 3 + 3
HI_INPUT = 8


def reply_tokens(text: str) -> int:
    return len(tokenizer.get_encoding("o200k_base").encode_ordinary(text))


@pytest.fixture
def proxy(start_proxy, simulator):
    upstreams = [
        UpstreamConfig(name="openai", base_url=f"{simulator.url}/openai/v1", default=True, provider="openai"),
        UpstreamConfig(
            name="anthropic", base_url=f"{simulator.url}/anthropic/v1", provider="anthropic", models=["claude-*"]
        ),
    ]
    return start_proxy(upstreams=upstreams)


@pytest.fixture
def client(proxy):
    with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0) as sdk:
        yield sdk


def test_chat_call_and_stream_are_synthesised_with_the_same_usage(proxy, client):
    raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=HI)
    assert raw.headers[SOURCE_HEADER] == "synthetic"
    reply = raw.parse()
    text = reply.choices[0].message.content
    assert text.startswith("This is a simulated reply from tokenward's simulator") and text.endswith('You said: "hi"')
    assert (reply.model, reply.choices[0].finish_reason) == ("gpt-4o-mini", "stop")
    out = reply_tokens(text)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        HI_INPUT,
        out,
        HI_INPUT + out,
    )
    chunks = list(
        client.chat.completions.create(
            model="gpt-4o-mini", messages=HI, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert len(chunks) > 10  # word by word, as a model streams
    assert (chunks[-1].choices, chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == ([], 8, out)
    unasked = list(client.chat.completions.create(model="gpt-4o-mini", messages=HI, stream=True))
    assert all(c.usage is None for c in unasked) and all(c.choices for c in unasked)  # as OpenAI: no usage unasked
    rows = proxy.rows(3)
    assert [(r["input_tokens"], r["output_tokens"], r["usage_source"], r["price_status"]) for r in rows] == [
        (HI_INPUT, out, "reported", "priced")
    ] * 3


def test_max_tokens_cuts_the_reply_as_a_provider_does(client):
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=HI, max_tokens=5, n=2)
    assert [c.finish_reason for c in reply.choices] == ["length", "length"]
    assert reply.choices[0].message.content == "This is a simulated reply"  # This| is| a| simulated| reply
    assert (reply.usage.completion_tokens, reply.usage.prompt_tokens) == (10, HI_INPUT)  # 5 tokens x 2 choices
    legacy = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Say hi")
    assert (legacy.usage.prompt_tokens, legacy.usage.completion_tokens) == (2, 16)  # the endpoint's default limit
    assert legacy.choices[0].finish_reason == "length"


def test_responses_call_and_stream(proxy, client):
    reply = client.responses.create(model="gpt-4o", input="What does tokenward do?")
    out = reply_tokens(reply.output_text)
    assert 'You said: "What does tokenward do?"' in reply.output_text
    # 6 text tokens + 7 for the one user message (its role, 3, and 3 for the reply), as OpenAI counts it
    assert (reply.status, reply.usage.input_tokens, reply.usage.output_tokens) == ("completed", 13, out)
    with client.responses.create(model="gpt-4o", input="What does tokenward do?", stream=True) as stream:
        events = list(stream)
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens == out
    cut = client.responses.create(model="gpt-4o", input="hi", max_output_tokens=16)
    assert (cut.status, cut.incomplete_details.reason, cut.usage.output_tokens) == (
        "incomplete",
        "max_output_tokens",
        16,
    )
    rows = proxy.rows(3)
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [(13, out), (13, out), (8, 16)]


def test_embeddings_as_floats_and_base64(proxy, client):
    reply = client.embeddings.create(model="text-embedding-3-small", input=["a b c", "hello"])  # SDK asks base64
    assert (len(reply.data), len(reply.data[0].embedding), reply.usage.prompt_tokens) == (2, 1536, 3 + 1)
    assert abs(sum(v * v for v in reply.data[0].embedding) - 1) < 1e-3
    again = client.embeddings.create(
        model="text-embedding-3-small", input="a b c", dimensions=8, encoding_format="float"
    )
    assert len(again.data[0].embedding) == 8
    direct = synthesise("embeddings", {"model": "m", "input": "a b c", "dimensions": 4, "encoding_format": "base64"})
    floats = struct.unpack("<4f", base64.b64decode(direct.body["data"][0]["embedding"]))
    same = synthesise("embeddings", {"model": "m", "input": "a b c", "dimensions": 4})
    assert [round(f, 5) for f in floats] == [round(f, 5) for f in same.body["data"][0]["embedding"]]
    assert [(r["input_tokens"], r["output_tokens"]) for r in proxy.rows(2)] == [(4, 0), (3, 0)]


def test_anthropic_messages_call_and_stream(proxy):
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0) as claude:
        message = claude.messages.create(model="claude-sonnet-4-5", max_tokens=1024, messages=HI)
        with claude.messages.stream(model="claude-sonnet-4-5", max_tokens=1024, messages=HI) as stream:
            streamed = stream.get_final_message()
        short = claude.messages.create(model="claude-sonnet-4-5", max_tokens=3, messages=HI)
    text = message.content[0].text
    out = reply_tokens(text)
    # Anthropic's dialect counts the content only ("hi": 1 token), plus the same recipe: 1 + 3 + 3
    assert (message.usage.input_tokens, message.usage.output_tokens, message.stop_reason) == (7, out, "end_turn")
    assert (streamed.content[0].text, streamed.usage.input_tokens, streamed.usage.output_tokens) == (text, 7, out)
    assert (short.stop_reason, short.usage.output_tokens) == ("max_tokens", 3)
    rows = proxy.rows(3)
    assert [(r["upstream"], r["input_tokens"], r["output_tokens"], r["price_status"]) for r in rows] == [
        ("anthropic", 7, out, "priced"),
        ("anthropic", 7, out, "priced"),
        ("anthropic", 7, 3, "priced"),
    ]


def test_recordings_still_replay_and_faults_apply_to_synthesised_replies(simulator, sample):
    chat = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"
    body = sample[chat].request["body"]
    replayed = httpx.post(f"{simulator.url}/openai/v1/chat/completions", json=body)  # same body: the recording
    assert replayed.headers[SOURCE_HEADER] == "recording" and replayed.json()["usage"]["prompt_tokens"] == 8
    unknown = httpx.post(f"{simulator.url}/openai/v1/chat/completions", json=body, headers={RECORD_HEADER: "nope"})
    assert unknown.status_code == 404  # a recording asked for by name and missing is an error, never made up
    stream = {"model": "gpt-4o-mini", "messages": HI, "stream": True}
    with httpx.stream(
        "POST", f"{simulator.url}/v1/chat/completions", json=stream, headers={FAULT_HEADER: "cut:3"}
    ) as reply:
        with pytest.raises(httpx.RemoteProtocolError):
            reply.read()
    own = {**stream, "messages": [{"role": "user", "content": f"flaky {uuid.uuid4()}"}]}  # a count of its own
    flaky = httpx.post(f"{simulator.url}/v1/chat/completions", json=own, headers={FAULT_HEADER: "flaky:1:503"})
    assert flaky.status_code == 503
    again = httpx.post(f"{simulator.url}/v1/chat/completions", json=own, headers={FAULT_HEADER: "flaky:1:503"})
    assert again.status_code == 200 and again.text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/openai/v1/chat/completions", [1, 2], "the request body must be a JSON object"),
        ("/openai/v1/chat/completions", {"messages": HI}, "the request names no model"),
        ("/openai/v1/chat/completions", {"model": "gpt-4o", "messages": []}, "the request has no 'messages'"),
        ("/openai/v1/responses", {"model": "gpt-4o"}, "the request has no 'input'"),
        ("/openai/v1/embeddings", {"model": "text-embedding-3-small"}, "the request has no 'input'"),
    ],
)
def test_malformed_requests_get_a_400_in_openai_shape(simulator, path, body, message):
    reply = httpx.post(f"{simulator.url}{path}", json=body)
    assert reply.status_code == 400
    assert reply.json() == {
        "error": {"message": f"simulator: {message}", "type": "invalid_request_error", "param": None, "code": None}
    }


def test_malformed_messages_get_anthropics_error_shape(simulator):
    reply = httpx.post(f"{simulator.url}/anthropic/v1/messages", json={"model": "claude-sonnet-4-5"})
    assert reply.status_code == 400
    assert reply.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "simulator: the request has no 'messages'"},
    }


def test_endpoint_of_paths():
    assert endpoint_of("/openai/v1/chat/completions") == "chat_completions"
    assert endpoint_of("/v1/completions") == "completions"
    assert endpoint_of("/anthropic/v1/messages") == "anthropic_messages"
    assert endpoint_of("/v1/responses/") == "responses"
    assert endpoint_of("/v1/files") is None


def test_token_counting_endpoints_answer_the_count_the_reply_would_report(proxy, client):
    # Claude Code calls messages/count_tokens before its requests: the simulator answered 404
    # ("no recording for /anthropic/v1/messages/count_tokens"), and the SDKs raised NotFoundError
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0) as claude:
        counted = claude.messages.count_tokens(model="claude-sonnet-4-5", messages=HI)
        beta = claude.beta.messages.count_tokens(
            model="claude-sonnet-4-5", messages=HI, betas=["token-counting-2024-11-01"]
        )
        message = claude.messages.create(model="claude-sonnet-4-5", max_tokens=16, messages=HI)
    # Anthropic's dialect: "hi" is 1 token, plus 3 for the message and 3: 7, as the reply reports
    assert (counted.input_tokens, beta.input_tokens, message.usage.input_tokens) == (7, 7, 7)
    raw = client.post(
        "/responses/input_tokens", body={"model": "gpt-4o-mini", "input": "hello world"}, cast_to=httpx.Response
    )
    # "hello world" is 2 o200k_base tokens; a bare string input is one user message: + 1 + 3 + 3 = 9
    assert (raw.status_code, raw.json()) == (200, {"object": "response.input_tokens", "input_tokens": 9})
    bad = httpx.post(
        f"{proxy.url}/v1/messages/count_tokens",
        json={"model": "claude-sonnet-4-5"},
        headers={"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    rows = proxy.rows(5)
    # the four counts (the 400 included) are free: not metered; the one message is priced
    assert sorted((r["endpoint"], r["price_status"]) for r in rows) == [
        ("anthropic_messages", "priced"),
        ("passthrough", "not_metered"),
        ("passthrough", "not_metered"),
        ("passthrough", "not_metered"),
        ("passthrough", "not_metered"),
    ]


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}


def test_a_forced_tool_call_is_answered_with_that_call_streamed_or_not(proxy, client):
    # tool_choice required / a named tool got a text reply: a tool-calling client could not be tried
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    ask = [{"role": "user", "content": "Paris"}]
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=ask, tools=tools, tool_choice="required")
    (call,) = reply.choices[0].message.tool_calls
    assert (reply.choices[0].finish_reason, call.function.name) == ("tool_calls", "get_weather")
    assert call.function.arguments == '{"city":"Paris","days":1}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=ask,
        tools=tools,
        tool_choice=named,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(
        c.choices[0].delta.tool_calls[0].function.arguments or ""
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
    )
    assert streamed == call.function.arguments and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    # output: "get_weather" (2 o200k_base tokens) + the arguments, as the meter counts a call
    out = reply_tokens("get_weather") + reply_tokens(call.function.arguments)
    assert reply.usage.completion_tokens == out
    functions = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    response = client.responses.create(model="gpt-4o-mini", input="Paris", tools=functions, tool_choice="required")
    (item,) = response.output
    assert (item.type, item.name, item.arguments) == ("function_call", "get_weather", '{"city":"Paris","days":1}')
    with client.responses.stream(
        model="gpt-4o-mini", input="Paris", tools=functions, tool_choice={"type": "function", "name": "get_weather"}
    ) as events:
        final = events.get_final_response()
    assert final.output[0].arguments == item.arguments
    assert response.usage.output_tokens == final.usage.output_tokens == reply_tokens(item.arguments)
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0) as claude:
        tool = [{"name": "get_weather", "input_schema": WEATHER}]
        message = claude.messages.create(
            model="claude-sonnet-4-5", max_tokens=100, messages=ask, tools=tool, tool_choice={"type": "any"}
        )
        with claude.messages.stream(
            model="claude-sonnet-4-5",
            max_tokens=100,
            messages=ask,
            tools=tool,
            tool_choice={"type": "tool", "name": "get_weather"},
        ) as events:
            claude_final = events.get_final_message()
        free = claude.messages.create(model="claude-sonnet-4-5", max_tokens=100, messages=ask, tools=tool)
    assert (message.stop_reason, message.content[0].type, message.content[0].input) == (
        "tool_use",
        "tool_use",
        {"city": "Paris", "days": 1},
    )
    assert claude_final.content[0].input == {"city": "Paris", "days": 1} and claude_final.stop_reason == "tool_use"
    assert message.usage.output_tokens == claude_final.usage.output_tokens == reply_tokens('{"city":"Paris","days":1}')
    assert free.content[0].type == "text"  # tool_choice auto: the model may answer in text, and does
    rows = proxy.rows(7)
    # each row holds what its client saw; streamed and not alike
    assert [r["output_tokens"] for r in rows[:6]] == [
        out,
        out,
        response.usage.output_tokens,
        response.usage.output_tokens,
        message.usage.output_tokens,
        message.usage.output_tokens,
    ]
    assert {(r["usage_source"], r["price_status"]) for r in rows} == {("reported", "priced")}
