"""The OpenAI wire format, as spoken by OpenAI and the OpenAI-compatible providers.

Covers Chat Completions, legacy Completions, Embeddings and the Responses API, and the
provider variants of the ``usage`` object recorded in ``shared/fixtures/recorded``
(see ``shared/reference/usage-and-pricing.md`` part 1):

* ``prompt_tokens`` / ``input_tokens`` include cached and cache-write tokens;
  ``completion_tokens`` / ``output_tokens`` include reasoning and audio output.
* Cache hits: ``prompt_tokens_details.cached_tokens`` (Responses: ``input_tokens_details``),
  else DeepSeek's ``prompt_cache_hit_tokens``, Mistral's ``num_cached_tokens``, Hugging Face's
  top-level ``cached_tokens`` or LiteLLM's top-level ``cache_read_input_tokens``. One shape is
  read, never two added (field case B12).
* Cache writes: ``cache_write_tokens`` (OpenAI GPT-5.6+, OpenRouter), Qwen's
  ``cache_creation_input_tokens``, or the shape LiteLLM relays Anthropic models in
  (``prompt_tokens_details.cache_creation_tokens`` or top-level ``cache_creation_input_tokens``);
  the one-hour part from ``cache_creation`` (Qwen) or ``cache_creation_token_details`` (LiteLLM)
  ``ephemeral_1h_input_tokens``. Writes are billed at cache-write rates, never as plain input.
* Reasoning outside the output (xAI): when ``total_tokens = prompt + completion +
  reasoning_tokens``, the reasoning tokens are added to the output (they are billed as output).
  Gemini's OpenAI-compatible endpoint hides thinking tokens in ``total_tokens`` only: when the
  total exceeds prompt + completion and no reasoning is reported, the excess is billed as output
  and counted as reasoning.
* Web searches billed per call: OpenRouter's ``server_tool_use_details.web_search_requests``,
  the Responses API's ``tool_usage.web_search.num_requests`` and its hosted ``web_search_call``
  output items (in ``output``, in ``response.output_item.done`` events and in the terminal
  event's ``response.output``: each distinct item id counted once, whatever its action:
  ``search``, ``open_page`` and ``find_in_page`` are each a tool call), and Groq compound's
  ``executed_tools`` of type ``search`` (each tool ``index`` once per choice), and Gemini's Google
  Search grounding (grounding metadata on a choice or candidate: one per reply, billed per grounded
  request). The largest of these counts is taken, never their sum.
* Other hosted tools billed per call: Responses ``file_search_call`` and ``image_generation_call``
  items (each id once) and
  ``code_interpreter_call`` items, counted by the distinct ``container_id`` they ran in (code
  interpreter is billed per container, however many calls run in it).
* Streams: usage may sit on an extra ``choices: []`` chunk, on the finishing chunk, in
  ``x_groq.usage``, or in ``response.usage`` of a Responses terminal event; the last non-null
  usage object wins and usage is never summed across chunks.
* A usage object with no count in it (``{}``, every count ``null``) reports nothing: the reply
  is estimated as if it had none, never priced at $0. One with an output count but no input
  count (neither ``prompt_tokens`` nor ``total_tokens``) is invalid.
* Errors inside a 200: a top-level ``error`` object (OpenRouter's error chunk), an ``error``
  event, or a Responses object whose ``status`` is ``failed`` (a Responses object always carries
  ``"error": null``; an ``error`` object on a response that did not fail is not an error).

Repair rules (counts that break an invariant as reported; each applied rule is named in
:attr:`~tokenward.pricing.usage.Usage.repairs`, and the row is recorded ``repaired``):

* R1 exclusive cache: cache hits or cache writes above ``prompt_tokens`` cannot be part of it,
  so the relay counted them outside it (Anthropic's convention, relayed as is): input =
  prompt + cached + writes.
* R1b read and written: hits and writes each within the prompt but together above it (recorded:
  OpenRouter's Gemini explicit cache reports the tokens it writes as read too, and bills both):
  the smaller set is taken to lie inside the larger, so uncached = prompt - the larger, and the
  overlap is billed once as read and once as written: input = prompt + the smaller.
* R2 reasoning above the output: ``reasoning_tokens > completion_tokens`` with ``total_tokens =
  prompt + completion`` (the total vouches for the output): reasoning is clamped to the output;
  with no ``total_tokens`` the reasoning is read as outside the output (output = completion +
  reasoning), the only reading that holds.
* R3 Groq compound breakdown: ``usage`` is the total over ``usage_breakdown.models``; parts that
  add up to more than the total in any count are not a split of it (streams have been seen
  repeating the total in every part), so they are dropped and the total is billed on the
  request's own row.

Other broken invariants are left as reported and the row is ``usage_invalid``.
"""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal
from typing import Any

import msgspec

from tokenward.pricing.usage import Usage, read_count
from tokenward.proxy.dialects.observation import Observation, Reading, tool_counts

__all__ = [
    "finish",
    "observe",
    "observe_body",
    "provider_cost",
    "reply_texts",
    "request_texts",
    "responses_messages",
    "to_usage",
]

_MAX_PROVIDER_COST = Decimal(1_000_000)  # USD; a provider's cost figure above this is not believed
_SEARCH_TOOLS = frozenset({"search", "web_search", "browser_search"})
_GROUNDING, _GROUNDING_CAMEL = b'grounding_metadata"', b'groundingMetadata"'
_TOOL_ITEM_MARKERS = (
    b'"web_search_call"',
    b'"file_search_call"',
    b'"code_interpreter_call"',
    b'"image_generation_call"',
)
_COUNTS = ("prompt_tokens", "input_tokens", "completion_tokens", "output_tokens", "total_tokens")
_PART_FIELDS = ("input_tokens", "cached_input_tokens", "cache_write_tokens", "output_tokens", "reasoning_tokens")


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
    object: Any = None
    status: Any = None
    message: Any = None


class _Tools(msgspec.Struct):
    """Members that list hosted tool calls; decoded only when the bytes mention one."""

    output: Any = None
    item: Any = None
    output_index: Any = None
    choices: Any = None
    candidates: Any = None


_decode_view = msgspec.json.Decoder(_View).decode
_decode_tools = msgspec.json.Decoder(_Tools).decode


def observe_body(body: bytes, seen: Observation) -> None:
    """Update ``seen`` from one JSON document (a whole reply or one stream event's data).

    Raises:
        msgspec.DecodeError: ``body`` is not JSON (or not a JSON object).
    """
    view = _decode_view(body)
    observe(view, seen)
    # hosted tool calls: Responses output items, or Groq's executed_tools in chat choices (one search of the bytes)
    if view.object == "response" or view.type is not None:
        if any(marker in body for marker in _TOOL_ITEM_MARKERS):
            _observe_tools(_decode_tools(body), view, seen)
    elif b'"executed_tools"' in body or _GROUNDING in body or _GROUNDING_CAMEL in body:
        _observe_tools(_decode_tools(body), view, seen)


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
    if holder is not None:  # a Responses stream event: its response object says whether it failed
        error, failed = holder.get("error"), holder.get("status") == "failed" or view.type == "response.failed"
    elif view.object == "response":  # a whole Responses object
        error, failed = view.error, view.status == "failed"
    else:  # an error envelope or an error chunk (OpenRouter sends one with usage on HTTP 200)
        error, failed = view.error, True
    if isinstance(error, dict) and failed:
        seen.error = str(error.get("message") or error.get("code") or "error")
    elif failed and view.type == "response.failed" and seen.error is None:
        seen.error = "response.failed"
    elif view.type == "error" and seen.error is None:  # the Responses API's error event: code and message at the top
        text = next((v for v in (view.error, view.message) if isinstance(v, str) and v), "error")
        seen.error = text[:500]


def _observe_tools(tools: _Tools, view: _View, seen: Observation) -> None:
    """Note each hosted tool call (Responses web search, file search, code interpreter items; Groq executed_tools)."""
    holder = view.response if isinstance(view.response, dict) else None
    if view.type == "response.output_item.done" and isinstance(tools.item, dict):
        _note_search_item(tools.item, tools.output_index, seen)
    for items in (tools.output, holder.get("output") if holder else None):
        if isinstance(items, list):
            for index, item in enumerate(items):
                if isinstance(item, dict):
                    _note_search_item(item, index, seen)
    if _grounded(tools):
        seen.web_search_calls.add("google:grounding")  # billed per grounded request, however many queries
    if isinstance(tools.choices, list):
        for position, choice in enumerate(tools.choices):
            if not isinstance(choice, dict):
                continue
            number = choice.get("index", position)
            for part in (choice.get("message"), choice.get("delta")):
                executed = part.get("executed_tools") if isinstance(part, dict) else None
                for slot, tool in enumerate(executed if isinstance(executed, list) else ()):
                    if isinstance(tool, dict) and (
                        (isinstance(tool.get("type"), str) and tool["type"] in _SEARCH_TOOLS)
                        or ("type" not in tool and "search_results" in tool)
                    ):
                        seen.web_search_calls.add(f"groq:{number}:{tool.get('index', slot)}")


def _grounded(tools: _Tools) -> bool:
    """Whether a Gemini reply says Google Search grounding ran: grounding metadata naming queries or sources.

    Where it is read: a choice's ``grounding_metadata`` (or ``groundingMetadata``), the same under a
    choice's or its message's ``extra_content.google`` (Gemini's OpenAI-compatible replies), or a
    native ``candidates[].groundingMetadata`` passed through by a relay. Grounding is billed per
    grounded request ($14 per 1,000 for Gemini 3.x, $35 per 1,000 for 2.5: reference 2.3 [R66][R62]),
    priced by the entry's ``web_search`` fee.
    """
    holders: list[Any] = []
    for listed in (tools.choices, tools.candidates):
        for entry in listed if isinstance(listed, list) else ():
            if not isinstance(entry, dict):
                continue
            for part in (entry, entry.get("message"), entry.get("delta")):
                if isinstance(part, dict):
                    holders.append(part)
                    extra = part.get("extra_content")
                    google = extra.get("google") if isinstance(extra, dict) else None
                    if isinstance(google, dict):
                        holders.append(google)
    for holder in holders:
        for name in ("grounding_metadata", "groundingMetadata"):
            found = holder.get(name)
            if isinstance(found, dict) and any(
                isinstance(found.get(key), list) and found[key]
                for key in ("web_search_queries", "webSearchQueries", "grounding_chunks", "groundingChunks")
            ):
                return True
    return False


def _note_search_item(item: dict[str, Any], index: Any, seen: Observation) -> None:
    kind = item.get("type")
    name = str(item["id"]) if isinstance(item.get("id"), str) else f"@{index}"
    if kind == "web_search_call":
        seen.web_search_calls.add(name)
    elif kind == "file_search_call":
        seen.file_search_calls.add(name)
    elif kind == "image_generation_call":
        seen.image_generation_calls.add(name)
    elif kind == "code_interpreter_call":  # billed per container: calls in one container count once
        container = item.get("container_id")
        seen.code_containers.add(container if isinstance(container, str) and container else name)


def to_usage(
    raw: dict[str, Any],
    tool_usage: dict[str, Any] | None = None,
    *,
    searches: int = 0,
    tools: dict[str, int] | None = None,
) -> Usage:
    """Map one OpenAI-format ``usage`` object (any provider variant above) to :class:`Usage`.

    ``searches`` is the number of hosted web search calls counted outside ``usage``, ``tools`` the
    other hosted tool calls (``file_search_calls``, ``code_containers``). Counts that
    are not valid (see :func:`~tokenward.pricing.usage.read_count`) make the usage invalid; the
    repair rules R1 and R2 of the module docstring are applied and named.
    """
    problems: list[str] = []
    repairs: list[str] = []

    def count(holder: dict[str, Any], key: str, where: str = "") -> int | None:
        return read_count(holder.get(key), key, problems, where)

    def first(*places: tuple[dict[str, Any], str, str]) -> int | None:
        """The first of these counts that is present (later ones are not read: one shape, never two added)."""
        for holder, key, where in places:
            value = count(holder, key, where)
            if value is not None:
                return value
        return None

    in_details = _dict(raw.get("prompt_tokens_details")) or _dict(raw.get("input_tokens_details"))
    in_name = "prompt_tokens_details." if raw.get("prompt_tokens_details") else "input_tokens_details."
    out_details = _dict(raw.get("completion_tokens_details")) or _dict(raw.get("output_tokens_details"))
    out_name = "completion_tokens_details." if raw.get("completion_tokens_details") else "output_tokens_details."

    prompt = first((raw, "prompt_tokens", ""), (raw, "input_tokens", ""))
    completion = first((raw, "completion_tokens", ""), (raw, "output_tokens", ""))
    total = count(raw, "total_tokens")
    if prompt is None and raw.get("prompt_tokens") is None and raw.get("input_tokens") is None:
        if total is None and completion is not None and not problems:  # an output count and no input count
            problems.append("prompt_tokens: null or missing while completion_tokens is reported")
        prompt = max((total or 0) - (completion or 0), 0)  # Voyage embeddings report only total_tokens
    prompt = prompt or 0
    completion = completion or 0

    cached = first(
        (in_details, "cached_tokens", in_name),
        (raw, "prompt_cache_hit_tokens", ""),
        (raw, "num_cached_tokens", ""),
        (raw, "cached_tokens", ""),
        (raw, "cache_read_input_tokens", ""),
    )
    cached = cached or 0
    cache_write = 0
    for holder, key, where in (
        (in_details, "cache_write_tokens", in_name),
        (in_details, "cache_creation_input_tokens", in_name),
        (in_details, "cache_creation_tokens", in_name),
        (raw, "cache_creation_input_tokens", ""),
    ):
        cache_write = count(holder, key, where) or 0
        if cache_write:  # one name of the same number, but a relay may fill only one of them
            break
    split = (
        _dict(in_details.get("cache_creation"))
        or _dict(in_details.get("cache_creation_token_details"))
        or _dict(raw.get("cache_creation_token_details"))
    )
    write_1h = 0
    if split:
        write_5m = count(split, "ephemeral_5m_input_tokens") or 0
        write_1h = count(split, "ephemeral_1h_input_tokens") or 0
        cache_write = cache_write or write_5m + write_1h

    reasoning = count(out_details, "reasoning_tokens", out_name) or 0
    if not problems:  # no reading rule is applied to counts that are wrong anyway
        prompt, completion, reasoning = _read_rules(prompt, completion, total, cached, cache_write, reasoning, repairs)

    details = raw.get("server_tool_use_details")
    if isinstance(details, dict):
        searches = max(searches, count(details, "web_search_requests", "server_tool_use_details.") or 0)
    if tool_usage:
        web = _dict(tool_usage.get("web_search"))
        searches = max(searches, read_count(web.get("num_requests"), "tool_usage.web_search", problems) or 0)

    return Usage(
        input_tokens=prompt,
        cached_input_tokens=cached,
        cache_write_tokens=cache_write,
        cache_write_1h_tokens=write_1h,
        output_tokens=completion,
        reasoning_tokens=reasoning,
        audio_input_tokens=count(in_details, "audio_tokens", in_name) or 0,
        audio_output_tokens=count(out_details, "audio_tokens", out_name) or 0,
        image_input_tokens=count(in_details, "image_tokens", in_name) or 0,
        web_search_requests=searches,
        file_search_calls=(tools or {}).get("file_search_calls", 0),
        code_containers=(tools or {}).get("code_containers", 0),
        image_generation_calls=(tools or {}).get("image_generation_calls", 0),
        invalid=tuple(problems),
        repairs=tuple(repairs),
    )


def _read_rules(
    prompt: int, completion: int, total: int | None, cached: int, writes: int, reasoning: int, repairs: list[str]
) -> tuple[int, int, int]:
    """Input, output and reasoning after the total-based readings and repair rules R1, R1b, R2."""
    hidden = total - prompt - completion if total is not None else 0
    if max(cached, writes) > prompt:  # R1
        repairs.append(
            f"R1: cached {cached} / cache writes {writes} above prompt_tokens {prompt}: read as exclusive "
            f"(input = {prompt + cached + writes})"
        )
        prompt += cached + writes
        if hidden >= cached + writes:
            hidden -= cached + writes  # an exclusive relay's total counts them too
    elif cached + writes > prompt:  # R1b
        repairs.append(
            f"R1b: cached {cached} + cache writes {writes} > prompt_tokens {prompt}: the tokens written "
            f"were also read (input = {prompt + min(cached, writes)})"
        )
        prompt += min(cached, writes)
    if reasoning and hidden == reasoning:  # xAI: reasoning is reported outside completion_tokens
        completion += reasoning
    elif hidden > 0 and reasoning == 0:  # Gemini's compatible endpoint: thinking only in the total
        completion += hidden
        reasoning = hidden
    elif reasoning > completion and total is not None and hidden == 0:  # R2: the total vouches for the output
        repairs.append(f"R2: reasoning_tokens {reasoning} > completion_tokens {completion}: clamped to the output")
        reasoning = completion
    elif reasoning > completion and total is None:  # R2: the only reading that holds
        repairs.append(
            f"R2: reasoning_tokens {reasoning} > completion_tokens {completion} and no total_tokens: "
            f"read as outside the output (output = {completion + reasoning})"
        )
        completion += reasoning
    return prompt, completion, reasoning


def finish(seen: Observation) -> Reading:
    """The final reading of a reply.

    Groq's compound models report the total over their inner models in ``usage`` and each inner
    model in ``usage_breakdown.models``: those become parts (priced at each model's rates) and
    the request's own usage is what the total leaves over (zero when the parts add up to it; the
    request's row keeps its hosted tool calls). Parts adding up to more than the total are
    dropped (repair rule R3).
    """
    if seen.usage is None or not any(seen.usage.get(name) is not None for name in _COUNTS):
        return Reading(None)  # a usage object with no count in it (``{}``, all null) reports nothing: not $0
    usage = to_usage(seen.usage, seen.tool_usage, searches=len(seen.web_search_calls), tools=tool_counts(seen))
    found = [
        (entry["model"], to_usage(entry["usage"]))
        for entry in seen.breakdown or ()
        if isinstance(entry, dict) and isinstance(entry.get("model"), str) and isinstance(entry.get("usage"), dict)
    ]
    if found:
        over = [
            f"{name} {sum(getattr(p, name) for _, p in found)} > {getattr(usage, name)}"
            for name in _PART_FIELDS
            if sum(getattr(p, name) for _, p in found) > getattr(usage, name)
        ]
        if over:
            note = f"R3: usage_breakdown parts add up to more than usage ({', '.join(over)}): parts dropped"
            return Reading(replace(usage, repairs=(*usage.repairs, note)), [], provider_cost(seen.usage))
        usage = _minus(usage, [u for _, u in found])
    return Reading(usage, found, provider_cost(seen.usage))


def _minus(total: Usage, parts: list[Usage]) -> Usage:
    """What ``total`` leaves over once ``parts`` are taken out (callers check it is not negative)."""
    values = {name: getattr(total, name) - sum(getattr(p, name) for p in parts) for name in _PART_FIELDS}
    return Usage(
        **values,
        cache_write_1h_tokens=min(total.cache_write_1h_tokens, values["cache_write_tokens"]),
        audio_input_tokens=min(total.audio_input_tokens, values["input_tokens"]),
        audio_output_tokens=min(total.audio_output_tokens, values["output_tokens"]),
        image_input_tokens=min(total.image_input_tokens, values["input_tokens"]),
        web_search_requests=total.web_search_requests,
        file_search_calls=total.file_search_calls,
        code_containers=total.code_containers,
        image_generation_calls=total.image_generation_calls,
        invalid=total.invalid,
        repairs=total.repairs,
    )


def provider_cost(raw: dict[str, Any]) -> Decimal | None:
    """The provider's own cost figure in USD (OpenRouter's ``usage.cost``), when it sends a believable one.

    A cost that is not a finite number in ``[0, 1e6)`` USD is ignored (it would not fit the ledger).
    """
    value = raw.get("cost")
    if isinstance(value, int | float) and not isinstance(value, bool):
        cost = Decimal(repr(value))
        if cost.is_finite() and 0 <= cost < _MAX_PROVIDER_COST:
            return cost
    return None


def _first(*values: int | None) -> int | None:
    for value in values:
        if value is not None:
            return value
    return None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def request_texts(body: dict[str, Any]) -> tuple[list[str], int]:
    """Texts of a request that the model reads, and the number of chat messages among them.

    Covers ``messages`` (Chat Completions: role and content, as OpenAI's token-counting recipe
    does), ``input`` and ``instructions`` (Responses, Embeddings; in Responses input items also
    tool calls' ``arguments``/``input``, their ``output`` and reasoning summaries, which the
    provider bills as input), ``prompt`` (legacy Completions) and ``tools`` (counted as their JSON).
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


def responses_messages(body: dict[str, Any]) -> tuple[list[str], int]:
    """The messages of a Responses request, for the per-message overhead: their roles, and how many.

    A Responses ``input`` is read as Chat Completions messages are: ``instructions`` is a system
    message, a bare string ``input`` one user message, and each input item with a ``role`` a
    message. The roles are returned as texts to count (OpenAI's recipe counts a message's role);
    :func:`~tokenward.proxy.metering.count_input` adds 3 tokens a message and 3 for the reply.
    Recorded OpenAI Responses usage matches this to the token (gpt-4o, gpt-4o-mini, gpt-4.1: one
    user message of 7 tokens is billed 14; with instructions of 3 tokens, 10 + 11 = 21).
    """
    roles: list[str] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        roles.append("system")
    items = body.get("input")
    if isinstance(items, str):
        roles.append("user")
    elif isinstance(items, list):
        for item in items:
            role = item.get("role") if isinstance(item, dict) else None
            if isinstance(role, str) and item.get("type", "message") == "message":
                roles.append(role)
    return roles, len(roles)


def reply_texts(obj: dict[str, Any]) -> list[tuple[Any, str, bool]]:
    """Generated texts in a whole reply or one stream event, as ``(key, text, whole)``.

    ``key`` names the piece of output the text belongs to (a choice's content, refusal or
    reasoning, one tool call's name or arguments, a Responses item's content part); stream
    deltas of one key are joined before they are counted. ``whole`` marks a text that is the
    piece in full (a non-streamed message, a finished Responses item), replacing its deltas.
    """
    found: list[tuple[Any, str, bool]] = []
    choices = obj.get("choices")
    for position, choice in enumerate(choices if isinstance(choices, list) else ()):
        if not isinstance(choice, dict):
            continue
        number = choice.get("index", position)
        for part, whole in ((choice.get("message"), True), (choice.get("delta"), False)):
            if not isinstance(part, dict):
                continue
            for name in ("content", "refusal", "reasoning_content", "reasoning"):
                _add(found, ("choice", number, name), part.get(name), whole)
            calls = part.get("tool_calls")
            for slot, call in enumerate(calls if isinstance(calls, list) else ()):
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    tool = ("choice", number, "tool", call.get("index", slot))
                    _add(found, (*tool, "name"), function.get("name"), whole)
                    _add(found, (*tool, "arguments"), function.get("arguments"), whole)
        _add(found, ("choice", number, "text"), choice.get("text"), False)  # legacy completions
    kind = obj.get("type")
    if isinstance(kind, str) and kind.endswith(".delta"):  # Responses stream deltas
        item = obj.get("item_id")
        if kind in ("response.output_text.delta", "response.refusal.delta"):
            _add(found, ("item", item, obj.get("content_index", 0)), obj.get("delta"), False)
        elif kind == "response.function_call_arguments.delta":
            _add(found, ("item", item, "arguments"), obj.get("delta"), False)
        elif kind == "response.reasoning_summary_text.delta":
            _add(found, ("item", item, "summary", obj.get("summary_index", 0)), obj.get("delta"), False)
    items: Any = obj.get("output")
    holder = obj.get("response")
    if isinstance(holder, dict):
        items = holder.get("output")
    elif kind == "response.output_item.done":
        items = [obj.get("item")]
    for position, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, dict):
            continue
        name = item.get("id", position)
        for slot, content in enumerate(item.get("content") if isinstance(item.get("content"), list) else ()):
            if isinstance(content, dict):
                _add(found, ("item", name, slot), content.get("text") or content.get("refusal"), True)
        _add(found, ("item", name, "arguments"), item.get("arguments"), True)
        summary = item.get("summary")
        for slot, content in enumerate(summary if isinstance(summary, list) else ()):
            if isinstance(content, dict):
                _add(found, ("item", name, "summary", slot), content.get("text"), True)
    return found


def _add(found: list[tuple[Any, str, bool]], key: Any, value: Any, whole: bool) -> None:
    texts: list[str] = []
    _collect_text(value, texts)
    if texts:
        found.append((key, "".join(texts), whole))


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
                # Responses input items the model reads too: a tool call's arguments (custom tools:
                # input), its output (a string or parts), a reasoning item's summary
                for key in ("arguments", "input", "output", "summary"):
                    if key in part:
                        _collect_text(part[key], texts)
            else:
                _collect_text(part, texts)


def _collect_tool_calls(calls: Any, texts: list[str]) -> None:
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                _collect_text(function.get("name"), texts)
                _collect_text(function.get("arguments"), texts)
