"""Anthropic's Messages API wire format (``POST /v1/messages``).

Semantics (``shared/reference/usage-and-pricing.md`` 1.7, ``shared/NOTES.md`` section 1):

* ``input_tokens`` EXCLUDES cache reads and writes: billed input is ``input_tokens +
  cache_creation_input_tokens + cache_read_input_tokens``; cache writes split by TTL in
  ``cache_creation.ephemeral_5m_input_tokens`` / ``ephemeral_1h_input_tokens``.
* ``output_tokens`` includes thinking; ``output_tokens_details.thinking_tokens`` is a subset.
* ``server_tool_use.web_search_requests`` counts searches billed per call,
  ``server_tool_use.web_fetch_requests`` web fetches; code execution (``server_tool_use`` content
  blocks named ``code_execution``, ``bash_code_execution`` or ``text_editor_code_execution``) is
  billed by container time, not by tokens, so a reply that ran code counts one container
  (``container.id`` when given).
* ``usage.service_tier`` and ``usage.speed`` (``fast``) name the tier served, ``usage.inference_geo``
  where it ran: recorded as one served tier, ``standard@us`` (:func:`served_tier`).
* Streams: ``message_start`` carries ``message.usage`` (``output_tokens: 1`` is a placeholder);
  each ``message_delta`` carries running totals that REPLACE earlier values field by field (never
  added; a ``null`` replaces nothing, as the SDK's accumulator reads it), and may raise
  ``input_tokens`` after server-side tools (field case B05).
* ``usage.iterations`` (compaction, advisor): the top-level numbers cover only the ``message``
  iterations. ``compaction`` iterations run on the same model and are added back;
  ``advisor_message`` iterations ran on another model (their ``model``) and are returned as
  separate parts by :func:`parts`, to be priced at that model's rates.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec

from tokenward.pricing.usage import Usage, read_count
from tokenward.proxy.dialects.observation import Observation, Reading

__all__ = ["finish", "observe_body", "parts", "reply_texts", "request_texts", "served_tier", "to_usage"]

_OWN_MODEL_ITERATIONS = ("message", "compaction")
_COUNTS = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "iterations")


class _View(msgspec.Struct):
    """The members of a message or stream event that metering reads."""

    type: Any = None
    model: Any = None
    usage: Any = None
    message: Any = None
    error: Any = None
    content_block: Any = None
    content: Any = None
    container: Any = None
    delta: Any = None


_CODE_TOOLS = frozenset({"code_execution", "bash_code_execution", "text_editor_code_execution"})

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
            # running totals: later fields replace earlier ones; a null is no new value (as the SDK reads it)
            seen.usage = {**seen.usage, **{name: value for name, value in usage.items() if value is not None}}
        else:
            seen.usage = dict(usage)
        tier = usage.get("service_tier")
        if isinstance(tier, str):
            seen.extra["tier"] = tier
        if usage.get("speed") == "fast":  # fast mode is billed as its own tier
            seen.extra["tier"] = "fast"
        geo = usage.get("inference_geo")
        if isinstance(geo, str):
            seen.extra["geo"] = geo
        seen.service_tier = served_tier(seen.extra.get("tier"), seen.extra.get("geo"))
    if b'"server_tool_use"' in body:
        _note_code_execution(view, message, seen)
    if isinstance(view.error, dict):
        seen.error = str(view.error.get("message") or view.error.get("type") or "error")
    elif view.type == "error" and seen.error is None:
        seen.error = "error"


def _note_code_execution(view: _View, message: dict[str, Any] | None, seen: Observation) -> None:
    """Count the container a reply's code execution ran in (a ``server_tool_use`` block of a code tool)."""
    blocks = [view.content_block]
    for holder in (view.content, message.get("content") if message else None):
        if isinstance(holder, list):
            blocks += holder
    if any(
        isinstance(b, dict) and b.get("type") == "server_tool_use" and b.get("name") in _CODE_TOOLS for b in blocks
    ):
        container = None
        delta = view.delta if isinstance(view.delta, dict) else {}
        for holder in (view.container, delta.get("container"), message.get("container") if message else None):
            if isinstance(holder, dict) and isinstance(holder.get("id"), str):
                container = holder["id"]
        seen.code_containers.add(container or "request")


def served_tier(tier: str | None, geo: str | None) -> str | None:
    """The served tier as priced (``pricing.cost``): ``tier``, or ``<tier>@<geo>`` when it ran in a named geography.

    ``usage.inference_geo`` (data residency: ``us``-only inference is priced 1.1x on Opus 4.6 and
    later, reference [R30]) is kept with the tier; ``global`` and ``not_available`` (the default
    routing, or a model without the option) add nothing.
    """
    if not geo or geo.lower() in ("global", "not_available"):
        return tier
    return f"{tier or 'standard'}@{geo}"


def _one(raw: dict[str, Any], problems: list[str], where: str = "") -> Usage:
    """Canonical counts of one usage object or iteration (no details, no tools)."""
    uncached = read_count(raw.get("input_tokens"), where + "input_tokens", problems) or 0
    writes = read_count(raw.get("cache_creation_input_tokens"), where + "cache_creation_input_tokens", problems) or 0
    reads = read_count(raw.get("cache_read_input_tokens"), where + "cache_read_input_tokens", problems) or 0
    creation = raw.get("cache_creation") if isinstance(raw.get("cache_creation"), dict) else {}
    write_5m = read_count(creation.get("ephemeral_5m_input_tokens"), where + "ephemeral_5m_input_tokens", problems)
    write_1h = read_count(creation.get("ephemeral_1h_input_tokens"), where + "ephemeral_1h_input_tokens", problems)
    writes = writes or (write_5m or 0) + (write_1h or 0)
    return Usage(
        input_tokens=uncached + writes + reads,
        cached_input_tokens=reads,
        cache_write_tokens=writes,
        cache_write_1h_tokens=write_1h or 0,
        output_tokens=read_count(raw.get("output_tokens"), where + "output_tokens", problems) or 0,
    )


def to_usage(
    raw: dict[str, Any], tool_usage: dict[str, Any] | None = None, *, searches: int = 0, containers: int = 0
) -> Usage:
    """Map an Anthropic ``usage`` object to :class:`Usage` for the request's own model.

    ``containers``: code execution containers the reply was seen to use (one request runs in one).

    Counts that are not valid make the usage invalid (see :func:`~tokenward.pricing.usage.read_count`).
    """
    problems: list[str] = []
    iterations = _iterations(raw)
    own = [it for it in iterations if isinstance(it, dict) and it.get("type") in _OWN_MODEL_ITERATIONS]
    pieces = [_one(it, problems, "iterations.") for it in own] if own else [_one(raw, problems)]
    details = raw.get("output_tokens_details") if isinstance(raw.get("output_tokens_details"), dict) else {}
    tools = raw.get("server_tool_use") if isinstance(raw.get("server_tool_use"), dict) else {}
    reported = read_count(tools.get("web_search_requests"), "server_tool_use.web_search_requests", problems)
    fetches = read_count(tools.get("web_fetch_requests"), "server_tool_use.web_fetch_requests", problems)
    return Usage(
        input_tokens=sum(p.input_tokens for p in pieces),
        cached_input_tokens=sum(p.cached_input_tokens for p in pieces),
        cache_write_tokens=sum(p.cache_write_tokens for p in pieces),
        cache_write_1h_tokens=sum(p.cache_write_1h_tokens for p in pieces),
        output_tokens=sum(p.output_tokens for p in pieces),
        reasoning_tokens=read_count(details.get("thinking_tokens"), "thinking_tokens", problems) or 0,
        web_search_requests=max(reported or 0, searches),
        web_fetch_requests=fetches or 0,
        code_containers=min(containers, 1),
        invalid=tuple(problems),
    )


def parts(raw: dict[str, Any]) -> list[tuple[str, Usage]]:
    """Usage spent on other models inside the request: each ``advisor_message`` iteration."""
    found = []
    for iteration in _iterations(raw):
        if isinstance(iteration, dict) and iteration.get("type") not in _OWN_MODEL_ITERATIONS:
            model = iteration.get("model")
            if isinstance(model, str) and model:
                problems: list[str] = []
                usage = _one(iteration, problems, "iterations.")
                found.append((model, replace(usage, invalid=tuple(problems)) if problems else usage))
    return found


def _iterations(raw: dict[str, Any]) -> list[Any]:
    """``usage.iterations`` when it is a list (anything else lists none)."""
    iterations = raw.get("iterations")
    return iterations if isinstance(iterations, list) else []


def finish(seen: Observation) -> Reading:
    """The final reading: own-model usage and advisor parts (Anthropic reports no cost of its own)."""
    if seen.usage is None or not any(seen.usage.get(name) is not None for name in _COUNTS):
        return Reading(None)  # a usage object with no count in it (``{}``, all null) reports nothing: not $0
    return Reading(to_usage(seen.usage, containers=len(seen.code_containers)), parts(seen.usage))


def request_texts(body: dict[str, Any]) -> tuple[list[str], int]:
    """Texts the model reads (system, message contents, tool definitions) and the message count.

    A legacy Text Completions request (``POST /v1/complete``) reads its ``prompt`` string.
    """
    texts: list[str] = []
    if isinstance(body.get("prompt"), str):
        texts.append(body["prompt"])
    _collect(body.get("system"), texts)
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    for message in messages:
        if isinstance(message, dict):
            _collect(message.get("content"), texts)
    if body.get("tools"):
        texts.append(msgspec.json.encode(body["tools"]).decode())
    return texts, len(messages)


def reply_texts(obj: dict[str, Any]) -> list[tuple[Any, str, bool]]:
    """Generated texts in a whole message or one stream event, as ``(key, text, whole)``.

    Keys are content block indexes (and the kind of text); a stream's ``content_block_delta``
    texts of one block are joined before they are counted, a whole message's blocks are whole.
    A legacy Text Completions reply or stream event (``"type": "completion"``) holds its text in
    ``completion``: each stream event a piece of it (the ``2023-06-01`` version streams deltas,
    https://docs.anthropic.com/en/api/streaming, read 2026-12-02), a whole reply all of it, so
    the pieces are joined.
    """
    found: list[tuple[Any, str, bool]] = []
    if obj.get("type") == "completion" and isinstance(obj.get("completion"), str):
        found.append((("completion", 0), obj["completion"], False))
    if obj.get("type") == "message" or ("content" in obj and obj.get("type") is None):
        for index, block in enumerate(obj.get("content") if isinstance(obj.get("content"), list) else ()):
            texts: list[str] = []
            _collect([block], texts)
            if texts:
                found.append((("block", index), "".join(texts), True))
    delta = obj.get("delta")
    if obj.get("type") == "content_block_delta" and isinstance(delta, dict):
        for key in ("text", "thinking", "partial_json"):
            value = delta.get(key)
            if isinstance(value, str):
                found.append((("block", obj.get("index", 0)), value, False))
    return found


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
