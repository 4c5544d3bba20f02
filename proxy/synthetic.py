"""Plausible provider replies for requests no recording matches (the simulator's fallback).

:func:`synthesise` answers a well-formed request to chat/completions, completions, responses,
embeddings or Anthropic messages, streamed or not, in that API's own shape, with usage counted
by tokenward's offline tokenizer: input as :func:`tokenward.proxy.metering.count_input`
counts it (OpenAI's chat recipe: 3 tokens a message plus 3), output as the tokens of the
reply text. So a proxy in front of the simulator records the same numbers it would estimate
itself, and a client sees figures of the right size. The reply text says it is simulated and
quotes the start of the prompt; ``max_tokens`` (and its per-API names) cut it as a provider
would (``finish_reason: length``, ``stop_reason: max_tokens``, Responses ``incomplete``). A
request that forces a tool call (``tool_choice`` required, any or a named tool) gets that call
instead of text, its output counted as tokenward's meter counts a call.

Like OpenAI, chat/completions and completions streams carry usage only when the request sets
``stream_options.include_usage``. A malformed request (no JSON object, no ``model``, no
``messages`` / ``input`` / ``prompt``) gets a 400 in the API's error shape. Pure: bytes and
dicts in and out, no I/O.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import struct
import time
from dataclasses import dataclass
from typing import Any

from tokenward.proxy import tokenizer
from tokenward.proxy.metering import count_input

__all__ = ["ENDPOINTS", "Synthetic", "count_reply", "endpoint_of", "synthesise"]

ENDPOINTS = {
    "chat/completions": "chat_completions",
    "completions": "completions",
    "responses": "responses",
    "embeddings": "embeddings",
    "messages": "anthropic_messages",
}
"""Endpoint names (as in the ledger) by the path's last segments."""

_NEEDS = {
    "chat_completions": "messages",
    "completions": "prompt",
    "responses": "input",
    "embeddings": "input",
    "anthropic_messages": "messages",
}
_WORDS = re.compile(r"\s*\S+")


@dataclass(frozen=True, slots=True)
class Synthetic:
    """A made-up reply: HTTP status and a JSON ``body``, or the SSE ``events`` of a stream (bytes each)."""

    status: int
    body: dict[str, Any] | None = None
    events: list[bytes] | None = None


def endpoint_of(path: str) -> str | None:
    """The endpoint a request path names (``/openai/v1/chat/completions`` -> ``chat_completions``)."""
    for suffix, name in ENDPOINTS.items():
        if path.rstrip("/").endswith("/" + suffix) and not (
            name == "completions" and path.rstrip("/").endswith("/chat/completions")
        ):
            return name
    return None


def synthesise(endpoint: str, body: Any, *, now: float | None = None) -> Synthetic:
    """A reply to ``body`` (the decoded request JSON) at ``endpoint`` (see :data:`ENDPOINTS`).

    Args:
        endpoint: one of the :data:`ENDPOINTS` values.
        body: the decoded request body (anything: non-objects get a 400).
        now: the reply's ``created`` time (epoch seconds; default: the current time).

    Returns:
        A :class:`Synthetic`: 200 with a body or stream events, or 400 with an error body.
    """
    anthropic = endpoint == "anthropic_messages"
    problem = _problem(endpoint, body)
    if problem is not None:
        if anthropic:
            return Synthetic(400, {"type": "error", "error": {"type": "invalid_request_error", "message": problem}})
        error = {"message": problem, "type": "invalid_request_error", "param": None, "code": None}
        return Synthetic(400, {"error": error})
    created = int(now if now is not None else time.time())
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
    model: str = body["model"]
    if endpoint == "embeddings":
        return Synthetic(200, _embeddings(body, model))
    dialect = "anthropic" if anthropic else "openai"
    input_tokens = count_input(dialect, body, model, endpoint)
    limit = _limit(endpoint, body)
    text, output_tokens, cut = _reply_text(body, model, limit)
    call = _forced_call(endpoint, body)
    if call is not None:  # the request makes the model call a tool: the reply is that call alone
        text, cut = "", False
        output_tokens = _call_tokens(endpoint, call, model)
    reply = _Reply(model, digest, created, text, input_tokens, output_tokens, cut, call)
    stream = body.get("stream") is True
    if endpoint == "chat_completions":
        return reply.chat(body, stream)
    if endpoint == "completions":
        return reply.completion(body, stream)
    if endpoint == "responses":
        return reply.response(stream)
    return reply.message(stream)


_COUNTERS = {"messages/count_tokens": "anthropic_messages", "responses/input_tokens": "responses"}
"""The free token-counting endpoints by the path's last segments, and the endpoint whose input they count."""


def count_reply(path: str, body: Any) -> Synthetic | None:
    """A reply to a token-counting request, or ``None`` when ``path`` names no counting endpoint.

    The endpoints are Anthropic's ``messages/count_tokens`` and OpenAI's ``responses/input_tokens``.
    The count is what :func:`synthesise` would report as the input of the same body sent to
    ``messages`` or ``responses`` (``{"input_tokens": N}``; OpenAI's adds ``"object":
    "response.input_tokens"``), so Claude Code's pre-flight counts work against the simulator.
    A malformed body gets the endpoint's 400.
    """
    endpoint = next((name for suffix, name in _COUNTERS.items() if path.rstrip("/").endswith("/" + suffix)), None)
    if endpoint is None:
        return None
    anthropic = endpoint == "anthropic_messages"
    problem = _problem(endpoint, body)
    if problem is not None:
        if anthropic:
            return Synthetic(400, {"type": "error", "error": {"type": "invalid_request_error", "message": problem}})
        return Synthetic(
            400, {"error": {"message": problem, "type": "invalid_request_error", "param": None, "code": None}}
        )
    count = count_input("anthropic" if anthropic else "openai", body, body["model"], endpoint)
    if anthropic:
        return Synthetic(200, {"input_tokens": count})
    return Synthetic(200, {"object": "response.input_tokens", "input_tokens": count})


def _problem(endpoint: str, body: Any) -> str | None:
    if not isinstance(body, dict):
        return "simulator: the request body must be a JSON object"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "simulator: the request names no model"
    needed = _NEEDS[endpoint]
    if body.get(needed) in (None, "", []):
        return f"simulator: the request has no {needed!r}"
    if endpoint in ("chat_completions", "anthropic_messages") and not isinstance(body["messages"], list):
        return "simulator: 'messages' must be a list"
    return None


def _forced_call(endpoint: str, body: dict[str, Any]) -> tuple[str, str] | None:
    """The tool call a request forces, as ``(name, arguments JSON)``; ``None`` when the model may answer in text.

    Forced: chat ``tool_choice: "required"`` or ``{"type": "function", "function": {"name": ...}}``,
    Responses ``"required"`` or ``{"type": "function", "name": ...}``, Anthropic ``{"type": "any"}``
    or ``{"type": "tool", "name": ...}``; ``required``/``any`` call the first function tool. The
    arguments give each property of the tool's schema a value of its type (strings quote the
    prompt), as compact JSON.
    """
    choice, tools = body.get("tool_choice"), body.get("tools")
    if not isinstance(tools, list) or endpoint not in ("chat_completions", "responses", "anthropic_messages"):
        return None
    named: Any = None
    if isinstance(choice, dict):
        function = choice.get("function")
        named = function.get("name") if isinstance(function, dict) else choice.get("name")
        forced = choice.get("type") in ("function", "tool", "any") and (named is not None or choice["type"] == "any")
    else:
        forced = choice == "required" and endpoint != "anthropic_messages"
    if not forced:
        return None
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        spec = tool.get("function") if endpoint == "chat_completions" else tool
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            continue
        if endpoint != "anthropic_messages" and tool.get("type") != "function":
            continue
        if named is None or spec["name"] == named:
            schema = spec.get("input_schema" if endpoint == "anthropic_messages" else "parameters")
            return spec["name"], _arguments(schema, _last_text(body))
    return None


def _arguments(schema: Any, said: str) -> str:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    samples = {"string": " ".join(said.split())[:40] or "simulated", "integer": 1, "number": 1, "boolean": True}
    values = {}
    for name, spec in (properties if isinstance(properties, dict) else {}).items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        values[name] = samples.get(kind) if isinstance(kind, str) else None
        if kind == "array":
            values[name] = []
    return json.dumps(values, separators=(",", ":"), ensure_ascii=False)


def _call_tokens(endpoint: str, call: tuple[str, str], model: str) -> int:
    """A tool call's output tokens as tokenward's meter counts them.

    Chat: the name and the arguments; Responses: the arguments; Anthropic: the input as compact JSON.
    """
    encoding = tokenizer.encoding_for_model(model)
    name, arguments = call
    count = tokenizer.count_tokens(arguments, encoding)
    return count + tokenizer.count_tokens(name, encoding) if endpoint == "chat_completions" else count


def _limit(endpoint: str, body: dict[str, Any]) -> int | None:
    names = {
        "chat_completions": ("max_completion_tokens", "max_tokens"),
        "completions": ("max_tokens",),
        "responses": ("max_output_tokens",),
        "anthropic_messages": ("max_tokens",),
    }[endpoint]
    for name in names:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 16 if endpoint == "completions" else None  # the legacy endpoint's own default


def _last_text(body: dict[str, Any]) -> str:
    value: Any = body.get("messages") or body.get("input") or body.get("prompt")
    while isinstance(value, list) and value:
        value = value[-1]
        if isinstance(value, dict):
            value = value.get("content", value.get("text", ""))
    if isinstance(value, dict):
        value = value.get("text", "")
    return value if isinstance(value, str) else ""


def _full_text(body: dict[str, Any], model: str) -> str:
    said = " ".join(_last_text(body).split())
    if len(said) > 80:
        said = said[:77] + "..."
    quote = f' You said: "{said}"' if said else ""
    return (
        f"This is a simulated reply from tokenward's simulator, standing in for {model}: no recording "
        f"matched this request, so the text is made up and its usage is counted with the tokenizer.{quote}"
    )


def _reply_text(body: dict[str, Any], model: str, limit: int | None) -> tuple[str, int, bool]:
    """The reply text, cut at ``limit`` tokens; its token count; whether it was cut."""
    text = _full_text(body, model)
    encoding = tokenizer.get_encoding(tokenizer.encoding_for_model(model))
    tokens = encoding.encode_ordinary(text)
    if limit is None or len(tokens) <= limit:
        return text, len(tokens), False
    return encoding.decode(tokens[:limit]), limit, True


def _chunks(function: dict[str, str]) -> list[str]:
    """A tool call's arguments as stream deltas (8 characters each)."""
    arguments = function["arguments"]
    return [arguments[k : k + 8] for k in range(0, len(arguments), 8)]


def _pieces(text: str) -> list[str]:
    """The reply text as stream deltas (a word with its leading space each)."""
    return _WORDS.findall(text) or [text]


def _sse(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


@dataclass(frozen=True, slots=True)
class _Reply:
    model: str
    digest: str
    created: int
    text: str
    input_tokens: int
    output_tokens: int
    cut: bool
    call: tuple[str, str] | None = None  # a forced tool call (name, arguments JSON) in place of the text

    def chat(self, body: dict[str, Any], stream: bool) -> Synthetic:
        n = body.get("n") if isinstance(body.get("n"), int) and 1 <= body["n"] <= 8 else 1
        finish = "length" if self.cut else "stop"
        usage = {
            "prompt_tokens": self.input_tokens,
            "completion_tokens": self.output_tokens * n,
            "total_tokens": self.input_tokens + self.output_tokens * n,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }
        head = {"id": f"chatcmpl-sim{self.digest[:24]}", "created": self.created, "model": self.model}
        calls = None
        if self.call is not None:
            finish = "tool_calls"
            function = {"name": self.call[0], "arguments": self.call[1]}
            calls = [{"id": f"call_sim{self.digest[:24]}", "type": "function", "function": function}]
        if not stream:
            message = {"role": "assistant", "content": self.text if calls is None else None, "refusal": None}
            if calls is not None:
                message["tool_calls"] = calls
            choices = [
                {"index": i, "message": {**message, "annotations": []}, "logprobs": None, "finish_reason": finish}
                for i in range(n)
            ]
            reply = {**head, "object": "chat.completion", "choices": choices, "usage": usage}
            return Synthetic(200, {**reply, "service_tier": "default", "system_fingerprint": None})
        with_usage = _asks_usage(body)
        chunk = {**head, "object": "chat.completion.chunk", "system_fingerprint": None}

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return _sse({**chunk, "choices": choices, **({"usage": None} if with_usage else {}), **extra})

        events = []
        for i in range(n):
            start = {"role": "assistant", "content": "" if calls is None else None, "refusal": None}
            events.append(event([{"index": i, "delta": start, "logprobs": None, "finish_reason": None}]))
            if calls is not None:  # the name first, then the arguments in pieces, as OpenAI streams them
                opening = {**calls[0], "index": 0, "function": {"name": calls[0]["function"]["name"], "arguments": ""}}
                pieces = [{"tool_calls": [opening]}] + [
                    {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} for piece in _chunks(function)
                ]
            else:
                pieces = [{"content": piece} for piece in _pieces(self.text)]
            for piece in pieces:
                events.append(event([{"index": i, "delta": piece, "logprobs": None, "finish_reason": None}]))
            events.append(event([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}]))
        if with_usage:
            events.append(_sse({**chunk, "choices": [], "usage": usage}))
        events.append(_sse("[DONE]"))
        return Synthetic(200, events=events)

    def completion(self, body: dict[str, Any], stream: bool) -> Synthetic:
        finish = "length" if self.cut else "stop"
        usage = {
            "prompt_tokens": self.input_tokens,
            "completion_tokens": self.output_tokens,
            "total_tokens": self.input_tokens + self.output_tokens,
        }
        head = {"id": f"cmpl-sim{self.digest[:24]}", "object": "text_completion", "created": self.created}
        head["model"] = self.model
        if not stream:
            choice = {"text": self.text, "index": 0, "logprobs": None, "finish_reason": finish}
            return Synthetic(200, {**head, "choices": [choice], "usage": usage})
        with_usage = _asks_usage(body)
        events = [
            _sse({**head, "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}]})
            for piece in _pieces(self.text)
        ]
        events.append(_sse({**head, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": finish}]}))
        if with_usage:
            events.append(_sse({**head, "choices": [], "usage": usage}))
        events.append(_sse("[DONE]"))
        return Synthetic(200, events=events)

    def response(self, stream: bool) -> Synthetic:
        item_id = f"msg_sim{self.digest[:24]}"
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        item = {"id": item_id, "type": "message", "status": "completed", "role": "assistant", "content": [part]}
        usage = {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }
        base = {
            "id": f"resp_sim{self.digest[:24]}",
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "error": None,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
        status = "incomplete" if self.cut else "completed"
        incomplete = {"reason": "max_output_tokens"} if self.cut else None
        if self.call is not None:
            item_id = f"fc_sim{self.digest[:24]}"
            name, arguments = self.call
            item = {"id": item_id, "type": "function_call", "status": "completed", "arguments": arguments}
            item |= {"call_id": f"call_sim{self.digest[:24]}", "name": name}
        done = {**base, "status": status, "incomplete_details": incomplete, "output": [item], "usage": usage}
        if not stream:
            return Synthetic(200, done)
        started = {**base, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
        if self.call is not None:
            on = {"item_id": item_id, "output_index": 0}
            calling: list[tuple[str, dict[str, Any]]] = [
                ("response.created", {"response": started}),
                ("response.in_progress", {"response": started}),
                (
                    "response.output_item.added",
                    {"output_index": 0, "item": {**item, "status": "in_progress", "arguments": ""}},
                ),
            ]
            calling += [("response.function_call_arguments.delta", {**on, "delta": p}) for p in _chunks(item)]
            calling += [
                ("response.function_call_arguments.done", {**on, "arguments": item["arguments"]}),
                ("response.output_item.done", {"output_index": 0, "item": item}),
                ("response.completed", {"response": done}),
            ]
            return Synthetic(
                200, events=[_sse({"type": k, "sequence_number": i, **d}, k) for i, (k, d) in enumerate(calling)]
            )
        at = {"item_id": item_id, "output_index": 0, "content_index": 0}
        blank = {**part, "text": ""}
        steps: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": started}),
            ("response.in_progress", {"response": started}),
            (
                "response.output_item.added",
                {"output_index": 0, "item": {**item, "status": "in_progress", "content": []}},
            ),
            ("response.content_part.added", {**at, "part": blank}),
        ]
        steps += [("response.output_text.delta", {**at, "delta": p, "logprobs": []}) for p in _pieces(self.text)]
        steps += [
            ("response.output_text.done", {**at, "text": self.text, "logprobs": []}),
            ("response.content_part.done", {**at, "part": part}),
            ("response.output_item.done", {"output_index": 0, "item": item}),
            ("response.incomplete" if self.cut else "response.completed", {"response": done}),
        ]
        events = [_sse({"type": kind, "sequence_number": i, **data}, kind) for i, (kind, data) in enumerate(steps)]
        return Synthetic(200, events=events)

    def message(self, stream: bool) -> Synthetic:
        stop = "max_tokens" if self.cut else "tool_use" if self.call is not None else "end_turn"
        usage = {
            "input_tokens": self.input_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": self.output_tokens,
        }
        message = {
            "id": f"msg_sim{self.digest[:24]}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [{"type": "text", "text": self.text}] if self.call is None else [self._tool_use()],
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }
        if not stream:
            return Synthetic(200, message)
        opening = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
        block: dict[str, Any] = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": p} for p in _pieces(self.text)]
        if self.call is not None:
            block = {**self._tool_use(), "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in _chunks({"arguments": self.call[1]})]
        steps: list[tuple[str, dict[str, Any]]] = [
            ("message_start", {"message": opening}),
            ("content_block_start", {"index": 0, "content_block": block}),
            ("ping", {}),
        ]
        steps += [("content_block_delta", {"index": 0, "delta": delta}) for delta in deltas]
        steps += [
            ("content_block_stop", {"index": 0}),
            ("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": usage}),
            ("message_stop", {}),
        ]
        return Synthetic(200, events=[_sse({"type": kind, **data}, kind) for kind, data in steps])

    def _tool_use(self) -> dict[str, Any]:
        assert self.call is not None
        name, arguments = self.call
        return {"type": "tool_use", "id": f"toolu_sim{self.digest[:24]}", "name": name, "input": json.loads(arguments)}


def _asks_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _embeddings(body: dict[str, Any], model: str) -> dict[str, Any]:
    raw = body["input"]
    inputs: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    dimensions = body.get("dimensions")
    if not (isinstance(dimensions, int) and 0 < dimensions <= 4096):
        dimensions = 3072 if "large" in model else 1536
    encoding = tokenizer.encoding_for_model(model)
    tokens = 0
    data = []
    for index, item in enumerate(inputs):
        tokens += len(item) if isinstance(item, list) else tokenizer.count_tokens(str(item), encoding)
        vector = _vector(json.dumps(item), dimensions)
        if body.get("encoding_format") == "base64":
            embedding: Any = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
        else:
            embedding = vector
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _vector(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for ``text`` (same text, same vector)."""
    seed = hashlib.sha256(text.encode()).digest()
    values = []
    block = b""
    counter = 0
    while len(values) < dimensions:
        if not block:
            block = hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()
            counter += 1
        values.append(block[0] / 127.5 - 1.0)
        block = block[1:]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [round(v / norm, 6) for v in values]
