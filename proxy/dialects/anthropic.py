"""Anthropic's Messages API wire format (``POST /v1/messages``).

Semantics (``shared/reference/usage-and-pricing.md`` 1.7, ``shared/NOTES.md`` section 1):

* ``input_tokens`` EXCLUDES cache reads and writes: billed input is ``input_tokens +
  cache_creation_input_tokens + cache_read_input_tokens``; cache writes split by TTL in
  ``cache_creation.ephemeral_5m_input_tokens`` / ``ephemeral_1h_input_tokens``.
* ``output_tokens`` includes thinking; ``output_tokens_details.thinking_tokens`` is a subset.
* ``server_tool_use.web_search_requests`` counts searches billed per call.
* Streams: ``message_start`` carries ``message.usage`` (``output_tokens: 1`` is a placeholder);
  each ``message_delta`` carries running totals that REPLACE earlier values field by field (never
  added), and may raise ``input_tokens`` after server-side tools (field case B05).
* ``usage.iterations`` (compaction, advisor): the top-level numbers cover only the ``message``
  iterations. ``compaction`` iterations run on the same model and are added back;
  ``advisor_message`` iterations ran on another model (their ``model``) and are returned as
  separate parts by :func:`parts`, to be priced at that model's rates.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenward.pricing.usage import Usage
from tokenward.proxy.dialects.observation import Observation, Reading

__all__ = ["finish", "observe_body", "parts", "reply_texts", "request_texts", "to_usage"]

_OWN_MODEL_ITERATIONS = ("message", "compaction")


class _View(msgspec.Struct):
    """The members of a message or stream event that metering reads."""

    type: Any = None
    model: Any = None
    usage: Any = None
    message: Any = None
    error: Any = None


_decode_view = msgspec.json.Decoder(_View).decode


def observe_body(body: bytes, seen: Observation) -> None:
    """Update ``seen`` from a whole message or one stream event's data.

    Raises:
        msgspec.DecodeError: ``body`` is not a JSON object.
    """
    view = _decode_view(body)
    message = view.message if isinstance(view.message, dict) else None
    model = view.model if isinstance(view.model, str) else message and message.get("model")
    if isinstance(model, str) and model:
        seen.model = model
    usage = message.get("usage") if message else view.usage
    if isinstance(usage, dict):
        if view.type == "message_delta" and seen.usage is not None:
            seen.usage = {**seen.usage, **usage}  # running totals: later fields replace earlier ones
        else:
            seen.usage = dict(usage)
        tier = usage.get("service_tier")
        if isinstance(tier, str):
            seen.service_tier = tier
        if usage.get("speed") == "fast":  # fast mode is billed as its own tier
            seen.service_tier = "fast"
    if isinstance(view.error, dict):
        seen.error = str(view.error.get("message") or view.error.get("type") or "error")
    elif view.type == "error" and seen.error is None:
        seen.error = "error"


def _one(raw: dict[str, Any]) -> Usage:
    """Canonical counts of one usage object or iteration (no details, no tools)."""
    uncached = _count(raw.get("input_tokens"))
    writes = _count(raw.get("cache_creation_input_tokens"))
    reads = _count(raw.get("cache_read_input_tokens"))
    creation = raw.get("cache_creation") if isinstance(raw.get("cache_creation"), dict) else {}
    return Usage(
        input_tokens=uncached + writes + reads,
        cached_input_tokens=reads,
        cache_write_tokens=writes,
        cache_write_1h_tokens=_count(creation.get("ephemeral_1h_input_tokens")),
        output_tokens=_count(raw.get("output_tokens")),
    )


def to_usage(raw: dict[str, Any], tool_usage: dict[str, Any] | None = None) -> Usage:
    """Map an Anthropic ``usage`` object to :class:`Usage` for the request's own model."""
    iterations = raw.get("iterations")
    own = [it for it in iterations or () if isinstance(it, dict) and it.get("type") in _OWN_MODEL_ITERATIONS]
    pieces = [_one(it) for it in own] if own else [_one(raw)]
    details = raw.get("output_tokens_details") if isinstance(raw.get("output_tokens_details"), dict) else {}
    tools = raw.get("server_tool_use") if isinstance(raw.get("server_tool_use"), dict) else {}
    return Usage(
        input_tokens=sum(p.input_tokens for p in pieces),
        cached_input_tokens=sum(p.cached_input_tokens for p in pieces),
        cache_write_tokens=sum(p.cache_write_tokens for p in pieces),
        cache_write_1h_tokens=sum(p.cache_write_1h_tokens for p in pieces),
        output_tokens=sum(p.output_tokens for p in pieces),
        reasoning_tokens=_count(details.get("thinking_tokens")),
        web_search_requests=_count(tools.get("web_search_requests")),
    )


def parts(raw: dict[str, Any]) -> list[tuple[str, Usage]]:
    """Usage spent on other models inside the request: each ``advisor_message`` iteration."""
    found = []
    for iteration in raw.get("iterations") or ():
        if isinstance(iteration, dict) and iteration.get("type") not in _OWN_MODEL_ITERATIONS:
            model = iteration.get("model")
            if isinstance(model, str) and model:
                found.append((model, _one(iteration)))
    return found


def finish(seen: Observation) -> Reading:
    """The final reading: own-model usage and advisor parts (Anthropic reports no cost of its own)."""
    if seen.usage is None:
        return Reading(None)
    return Reading(to_usage(seen.usage), parts(seen.usage))


def request_texts(body: dict[str, Any]) -> tuple[list[str], int]:
    """Texts the model reads (system, message contents, tool definitions) and the message count."""
    texts: list[str] = []
    _collect(body.get("system"), texts)
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    for message in messages:
        if isinstance(message, dict):
            _collect(message.get("content"), texts)
    if body.get("tools"):
        texts.append(msgspec.json.encode(body["tools"]).decode())
    return texts, len(messages)


def reply_texts(obj: dict[str, Any]) -> list[str]:
    """Generated texts in a whole message or one stream event."""
    texts: list[str] = []
    _collect(obj.get("content"), texts)
    delta = obj.get("delta")
    if isinstance(delta, dict):
        for key in ("text", "thinking", "partial_json"):
            value = delta.get(key)
            if isinstance(value, str):
                texts.append(value)
    return texts


def _collect(value: Any, texts: list[str]) -> None:
    if isinstance(value, str):
        texts.append(value)
    elif isinstance(value, list):
        for block in value:
            if isinstance(block, dict):
                for key in ("text", "thinking"):
                    if isinstance(block.get(key), str):
                        texts.append(block[key])
                if "input" in block:
                    texts.append(msgspec.json.encode(block["input"]).decode())
                _collect(block.get("content"), texts)


def _count(value: Any) -> int:
    if type(value) is int:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return 0
