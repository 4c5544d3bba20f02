"""The OpenAI wire format, as spoken by OpenAI and the OpenAI-compatible providers.

Covers Chat Completions, legacy Completions, Embeddings and the Responses API, and the
provider variants of the ``usage`` object recorded in ``shared/fixtures/recorded``
(see ``shared/reference/usage-and-pricing.md`` part 1):

* ``prompt_tokens`` / ``input_tokens`` include cached and cache-write tokens;
  ``completion_tokens`` / ``output_tokens`` include reasoning and audio output.
* Cache hits: ``prompt_tokens_details.cached_tokens`` (Responses: ``input_tokens_details``),
  else DeepSeek's ``prompt_cache_hit_tokens``, Mistral's ``num_cached_tokens`` or Hugging Face's
  top-level ``cached_tokens``. One shape is read, never two added (field case B12).
* Cache writes: ``cache_write_tokens`` (OpenAI GPT-5.6+, OpenRouter), or Qwen's
  ``cache_creation_input_tokens`` with its ``cache_creation`` TTL split.
* Gemini's OpenAI-compatible endpoint hides thinking tokens in ``total_tokens`` only: when
  the total exceeds prompt + completion, the excess is billed as output and counted as reasoning.
* Streams: usage may sit on an extra ``choices: []`` chunk, on the finishing chunk, in
  ``x_groq.usage``, or in ``response.usage`` of a Responses terminal event; the last non-null
  usage object wins and usage is never summed across chunks.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import msgspec

from tokenward.pricing.usage import Usage
from tokenward.proxy.dialects.observation import Observation, Reading

__all__ = ["finish", "observe", "observe_body", "provider_cost", "reply_texts", "request_texts", "to_usage"]


class _View(msgspec.Struct):
    """The few top-level members of a reply or chunk that metering reads; the rest is skipped."""

    model: Any = None
    usage: Any = None
    service_tier: Any = None
    x_groq: Any = None
    usage_breakdown: Any = None
    response: Any = None
    tool_usage: Any = None
    error: Any = None
    type: Any = None


_decode_view = msgspec.json.Decoder(_View).decode


def observe_body(body: bytes, seen: Observation) -> None:
    """Update ``seen`` from one JSON document (a whole reply or one stream event's data).

    Raises:
        msgspec.DecodeError: ``body`` is not JSON (or not a JSON object).
    """
    observe(_decode_view(body), seen)


def observe(view: _View, seen: Observation) -> None:
    """Update ``seen`` from a decoded reply or chunk; later usage replaces earlier usage."""
    holder = view.response if isinstance(view.response, dict) else None
    model = view.model if isinstance(view.model, str) else holder and holder.get("model")
    if isinstance(model, str) and model:
        seen.model = model
    tier = view.service_tier if isinstance(view.service_tier, str) else holder and holder.get("service_tier")
    if isinstance(tier, str):
        seen.service_tier = tier
    for candidate in (
        view.usage,
        view.x_groq.get("usage") if isinstance(view.x_groq, dict) else None,
        holder.get("usage") if holder else None,
    ):
        if isinstance(candidate, dict):
            seen.usage = candidate
    breakdown = (
        view.usage_breakdown
        if isinstance(view.usage_breakdown, dict)
        else (view.x_groq.get("usage_breakdown") if isinstance(view.x_groq, dict) else None)
    )
    if isinstance(breakdown, dict) and isinstance(breakdown.get("models"), list):
        seen.breakdown = breakdown["models"]
    tool_usage = view.tool_usage if isinstance(view.tool_usage, dict) else holder and holder.get("tool_usage")
    if isinstance(tool_usage, dict):
        seen.tool_usage = tool_usage
    error = view.error if isinstance(view.error, dict) else holder and holder.get("error")
    if isinstance(error, dict):
        seen.error = str(error.get("message") or error.get("code") or "error")
    elif view.type in ("error", "response.failed") and seen.error is None:
        seen.error = str(view.type)


def to_usage(raw: dict[str, Any], tool_usage: dict[str, Any] | None = None) -> Usage:
    """Map one OpenAI-format ``usage`` object (any provider variant above) to :class:`Usage`."""
    prompt = _count(raw.get("prompt_tokens"))
    if prompt is None:
        prompt = _count(raw.get("input_tokens"))
    completion = _count(raw.get("completion_tokens"))
    if completion is None:
        completion = _count(raw.get("output_tokens"))
    total = _count(raw.get("total_tokens"))
    if prompt is None:
        prompt = (total or 0) - (completion or 0)  # Voyage embeddings report only total_tokens
    completion = completion or 0

    in_details = _dict(raw.get("prompt_tokens_details")) or _dict(raw.get("input_tokens_details"))
    out_details = _dict(raw.get("completion_tokens_details")) or _dict(raw.get("output_tokens_details"))

    cached = _first_count(
        in_details.get("cached_tokens"),
        raw.get("prompt_cache_hit_tokens"),
        raw.get("num_cached_tokens"),
        raw.get("cached_tokens"),
    )
    cache_write = _first_count(in_details.get("cache_write_tokens"), in_details.get("cache_creation_input_tokens"))
    creation = _dict(in_details.get("cache_creation"))
    write_1h = _count(creation.get("ephemeral_1h_input_tokens")) or 0

    reasoning = _count(out_details.get("reasoning_tokens")) or 0
    hidden = (total or 0) - prompt - completion
    if hidden > 0 and reasoning == 0:
        completion += hidden
        reasoning = hidden

    searches = _count(_dict(raw.get("server_tool_use_details")).get("web_search_requests")) or 0
    if tool_usage:
        searches = max(searches, _count(_dict(tool_usage.get("web_search")).get("num_requests")) or 0)

    return Usage(
        input_tokens=prompt,
        cached_input_tokens=cached or 0,
        cache_write_tokens=cache_write or 0,
        cache_write_1h_tokens=write_1h,
        output_tokens=completion,
        reasoning_tokens=reasoning,
        audio_input_tokens=_count(in_details.get("audio_tokens")) or 0,
        audio_output_tokens=_count(out_details.get("audio_tokens")) or 0,
        image_input_tokens=_count(in_details.get("image_tokens")) or 0,
        web_search_requests=searches,
    )


def finish(seen: Observation) -> Reading:
    """The final reading of a reply.

    Groq's compound models report the total over their inner models in ``usage`` and each inner
    model in ``usage_breakdown.models``: those become parts (priced at each model's rates) and
    the request's own usage is what the total leaves over (zero when the parts add up to it).
    """
    if seen.usage is None:
        return Reading(None)
    usage = to_usage(seen.usage, seen.tool_usage)
    found = [
        (entry["model"], to_usage(entry["usage"]))
        for entry in seen.breakdown or ()
        if isinstance(entry, dict) and isinstance(entry.get("model"), str) and isinstance(entry.get("usage"), dict)
    ]
    if found:
        usage = _minus(usage, [u for _, u in found])
    return Reading(usage, found, provider_cost(seen.usage))


def _minus(total: Usage, parts: list[Usage]) -> Usage:
    values = {
        name: getattr(total, name) - sum(getattr(p, name) for p in parts)
        for name in ("input_tokens", "cached_input_tokens", "cache_write_tokens", "output_tokens", "reasoning_tokens")
    }
    return Usage(
        **values,
        cache_write_1h_tokens=total.cache_write_1h_tokens,
        audio_input_tokens=total.audio_input_tokens,
        audio_output_tokens=total.audio_output_tokens,
        image_input_tokens=total.image_input_tokens,
        web_search_requests=total.web_search_requests,
    )


def provider_cost(raw: dict[str, Any]) -> Decimal | None:
    """The provider's own cost figure in USD (OpenRouter's ``usage.cost``), when it sends one."""
    value = raw.get("cost")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Decimal(repr(value))
    return None


def _count(value: Any) -> int | None:
    if type(value) is int:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _first_count(*values: Any) -> int | None:
    for value in values:
        count = _count(value)
        if count is not None:
            return count
    return None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def request_texts(body: dict[str, Any]) -> tuple[list[str], int]:
    """Texts of a request that the model reads, and the number of chat messages among them.

    Covers ``messages`` (Chat Completions: role and content, as OpenAI's token-counting recipe
    does), ``input`` and ``instructions`` (Responses,
    Embeddings), ``prompt`` (legacy Completions) and ``tools`` (counted as their JSON).
    Token-id inputs (lists of integers) are returned as that many single-token strings.
    """
    texts: list[str] = []
    messages = body.get("messages")
    count = 0
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                count += 1
                _collect_text(message.get("role"), texts)
                _collect_text(message.get("content"), texts)
                _collect_text(message.get("name"), texts)
                _collect_tool_calls(message.get("tool_calls"), texts)
    for key in ("input", "prompt", "instructions"):
        _collect_text(body.get(key), texts)
    if body.get("tools"):
        texts.append(msgspec.json.encode(body["tools"]).decode())
    return texts, count


def reply_texts(obj: dict[str, Any]) -> list[str]:
    """Generated texts in a whole reply or one stream chunk (content, refusals, tool-call arguments)."""
    texts: list[str] = []
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        for part in (choice.get("message"), choice.get("delta")):
            if isinstance(part, dict):
                _collect_text(part.get("content"), texts)
                _collect_text(part.get("refusal"), texts)
                _collect_text(part.get("reasoning_content"), texts)
                _collect_tool_calls(part.get("tool_calls"), texts)
        _collect_text(choice.get("text"), texts)
    for item in obj.get("output") or ():  # Responses API reply
        if isinstance(item, dict):
            _collect_text(item.get("content"), texts)
            _collect_text(item.get("arguments"), texts)
    if obj.get("type") == "response.output_text.delta":
        _collect_text(obj.get("delta"), texts)
    return texts


def _collect_text(value: Any, texts: list[str]) -> None:
    if isinstance(value, str):
        texts.append(value)
    elif isinstance(value, list):
        for part in value:
            if isinstance(part, int) and not isinstance(part, bool):
                texts.append("\x00")  # one token id, counted as one token by the estimator's caller
            elif isinstance(part, dict):
                _collect_text(part.get("text"), texts)
                _collect_text(part.get("content"), texts)
            else:
                _collect_text(part, texts)


def _collect_tool_calls(calls: Any, texts: list[str]) -> None:
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                _collect_text(function.get("name"), texts)
                _collect_text(function.get("arguments"), texts)
