"""What a request body holds that the text tokenizer cannot count, for budget worst cases.

A blocking budget reserves an upper bound of a request's cost before sending it (see
:mod:`tokenward.proxy.guard`). Text is counted with tiktoken; this module finds the rest:

- images (``image_url``, ``input_image``, a computer call's ``computer_screenshot``, Anthropic
  ``image``): each is bounded by ``guard.image_tokens`` (input tokens per image);
- audio (``input_audio``): bounded from its size, as if encoded at 8 kbit/s (the lowest common
  speech bitrate) at 10 tokens per second of audio: one token per 100 bytes;
- stored state the request only points at (``file``/``input_file`` parts, Anthropic
  ``document`` blocks, Responses ``previous_response_id``, ``conversation``, ``item_reference``
  input items and ``prompt`` templates, a Chat Completions assistant message's ``audio`` by id):
  nothing in the body bounds it, so the request is *unbounded*;
- tools the provider runs itself inside one request (web search and fetch, file search, code
  execution, image generation, remote MCP, Anthropic's ``mcp_servers``; Chat Completions
  ``web_search_options``; OpenRouter's ``web`` plugin): each call adds a fee and the tokens of
  what it found, as many times as the model chooses, so such a request is *unbounded* as well;
- a request for audio output (``modalities`` with ``audio``), priced at the audio output rate;
- a Predicted Outputs ``prediction`` (OpenAI chat): the tokens of the prediction that the reply
  does not use are billed as output ("rejected_prediction_tokens ... still counted in the total
  completion tokens for purposes of billing", reference [R9]) on top of what ``max_tokens``
  allows, so the prediction's texts (:attr:`Unmetered.prediction_texts`) are counted as output
  the request may add beyond its limit;
- content the client replays encrypted (OpenAI reasoning and compaction items'
  ``encrypted_content``, Anthropic ``redacted_thinking`` blocks' ``data`` and web search results'
  ``encrypted_content``): the provider decrypts and bills it as input, but no tokenizer can read
  it. It is bounded by its decoded size, one input token per byte (:data:`OPAQUE_BYTES_PER_TOKEN`):
  a token of text is at least one byte, and encryption does not make a text shorter. (This
  assumes the provider does not compress before encrypting; neither documents the format.)

Provider-run tool types: OpenAI https://platform.openai.com/docs/guides/tools (web_search,
file_search, code_interpreter, image_generation, mcp), Anthropic
https://docs.anthropic.com/en/docs/agents-and-tools/tool-use/overview (server tools
``web_search_*``, ``web_fetch_*``, ``code_execution_*``) and
https://docs.anthropic.com/en/docs/agents-and-tools/mcp-connector (``mcp_servers``: the model
calls the server's tools and their results are billed as input), checked 2026-12-01. Stored
content: https://platform.openai.com/docs/api-reference/responses/create (``input`` items of
type ``item_reference``; ``prompt``, a template with its own instructions) and
https://platform.openai.com/docs/api-reference/chat/create (an assistant message's ``audio.id``),
checked 2026-12-01. Encrypted content:
https://platform.openai.com/docs/guides/reasoning (``include=["reasoning.encrypted_content"]``,
stateless multi-turn) and https://docs.anthropic.com/en/docs/build-with-claude/extended-thinking
(``redacted_thinking``), checked 2026-12-01.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["AUDIO_BYTES_PER_TOKEN", "OPAQUE_BYTES_PER_TOKEN", "Unmetered", "scan", "tool_call_bounds"]

AUDIO_BYTES_PER_TOKEN = 100
"""8 kbit/s is 1000 bytes a second; 10 audio tokens a second: an upper bound of 1 token per 100 bytes."""

OPAQUE_BYTES_PER_TOKEN = 1
"""Encrypted content replayed as input: a bound of one token per decoded byte (see the module docstring)."""

_IMAGE_TYPES = frozenset({"image_url", "input_image", "image", "computer_screenshot"})  # the last: computer use
_FILE_TYPES = frozenset({"file", "input_file", "document"})
_MAX_DEPTH = 12
_SERVER_TOOL_PREFIXES = (
    "web_search",
    "web_fetch",
    "file_search",
    "code_interpreter",
    "code_execution",
    "image_generation",
    "mcp",
)


@dataclass(slots=True)
class Unmetered:
    """Counts of request content outside the tokenizer's reach.

    ``images``: image parts; ``audio_tokens``: an upper bound on audio input tokens;
    ``files``: parts that refer to stored files or documents; ``opaque_tokens``: an upper bound
    on the input tokens of encrypted content (base64, bounded by its decoded size); ``stateful``: the request
    continues or reuses stored state (``previous_response_id``, ``conversation``,
    ``item_reference``, a ``prompt`` template, an earlier audio reply); ``audio_output``: audio
    was asked for in the reply; ``server_tools``: tools the provider runs itself (fees and found
    tokens the body does not bound); ``tool_calls``: the most calls billed per call (or per
    container) the offered tools can make, by :class:`~tokenward.pricing.usage.Usage` field, as
    the body bounds them (:func:`tool_call_bounds`); ``unbounded_tools``: the offered tools billed
    per call whose number of calls nothing in the body bounds.
    """

    images: int = 0
    audio_tokens: int = 0
    files: int = 0
    opaque_tokens: int = 0
    stateful: bool = False
    audio_output: bool = False
    server_tools: int = 0
    tool_calls: dict[str, int] = field(default_factory=dict)
    unbounded_tools: list[str] = field(default_factory=list)
    prediction_texts: list[str] = field(default_factory=list)
    prediction_tokens: int = 0

    @property
    def unbounded(self) -> bool:
        """Whether nothing in the body bounds the request's input."""
        return self.stateful or self.files > 0 or self.server_tools > 0


def scan(body: Any) -> Unmetered:
    """Find the content of a decoded request ``body`` (any dialect) that text counting misses."""
    found = Unmetered()
    if isinstance(body, dict):
        # a Responses `prompt` is a stored template ({"id": "pmpt_..."}); a completions prompt is text
        found.stateful = bool(
            body.get("previous_response_id") or body.get("conversation") or isinstance(body.get("prompt"), dict)
        )
        modalities = body.get("modalities")
        found.audio_output = isinstance(modalities, list) and "audio" in modalities
        found.server_tools = _server_tools(body)
        found.tool_calls, found.unbounded_tools = tool_call_bounds(body)
        _strings(body.get("prediction"), found.prediction_texts, 0)
    _walk(body, found, 0)
    return found


def _server_tools(body: dict[str, Any]) -> int:
    """How many tools the provider runs itself does the request offer the model."""
    tools = body.get("tools")
    count = 0
    if isinstance(tools, list):
        for tool in tools:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind.startswith(_SERVER_TOOL_PREFIXES):
                count += 1
            elif isinstance(tool, dict) and kind is None and any(name in tool for name in _GOOGLE_SEARCH):
                count += 1  # Gemini's Google Search grounding
    servers = body.get("mcp_servers")  # Anthropic's MCP connector: every tool of each server
    if isinstance(servers, list):
        count += len(servers)
    if body.get("web_search_options") is not None:  # Chat Completions search models
        count += 1
    plugins = body.get("plugins")  # OpenRouter: {"id": "web"}, or a model name ending in :online
    if isinstance(plugins, list):
        count += sum(isinstance(p, dict) and p.get("id") == "web" for p in plugins)
    model = body.get("model")
    if isinstance(model, str) and model.endswith(":online"):
        count += 1
    return count


_FEE_FIELDS = (  # tool type prefix -> the Usage field its calls are counted (and priced) in
    ("web_search", "web_search_requests"),
    ("web_fetch", "web_fetch_requests"),
    ("file_search", "file_search_calls"),
    ("code_interpreter", "code_containers"),
    ("code_execution", "code_containers"),
    ("image_generation", "image_generation_calls"),
)
_GOOGLE_SEARCH = ("google_search", "googleSearch", "google_search_retrieval", "googleSearchRetrieval")


def tool_call_bounds(body: dict[str, Any]) -> tuple[dict[str, int], list[str]]:
    """The most billed calls the tools a request offers can make, by ``Usage`` field, and the tools nothing bounds.

    Tools billed per call (web search, web fetch, file search, image generation) or per container
    (code execution) can be called as often as the model chooses unless the request bounds them:

    * a Responses ``max_tool_calls`` bounds every built-in tool's calls in the response
      (https://platform.openai.com/docs/api-reference/responses/create, checked 2026-12-02), so
      each offered kind may make that many;
    * an Anthropic server tool's ``max_uses`` bounds that tool
      (https://docs.anthropic.com/en/docs/agents-and-tools/tool-use/web-search-tool, checked
      2026-12-02); code execution is billed per container, one per request;
    * Gemini's Google Search grounding, Chat Completions ``web_search_options`` and OpenRouter's
      ``web`` plugin are billed once per request.

    Tools with no per-call fee (remote MCP) are left out: their results are billed as tokens.
    Returns ``({field: calls}, [tool type, ...])``; the second lists the tools billed per call that
    nothing bounds (the caller refuses them, or sends a bound).
    """
    calls: dict[str, int] = {}
    unbounded: list[str] = []
    overall = body.get("max_tool_calls")
    overall = overall if type(overall) is int and overall >= 0 else None
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if not isinstance(kind, str):
            if any(name in tool for name in _GOOGLE_SEARCH):
                calls["web_search_requests"] = max(calls.get("web_search_requests", 0), 1)
            continue
        column = next((col for prefix, col in _FEE_FIELDS if kind.startswith(prefix)), None)
        if column is None:
            continue
        uses = tool.get("max_uses")
        if column == "code_containers" and overall is None:
            bound: int | None = 1  # billed per container: one request runs in one
        elif overall is not None:
            bound = overall
        elif type(uses) is int and uses >= 0:
            bound = uses
        else:
            unbounded.append(kind)
            continue
        calls[column] = calls.get(column, 0) + bound if overall is None else max(calls.get(column, 0), bound)
    once = body.get("web_search_options") is not None
    plugins = body.get("plugins")
    once |= isinstance(plugins, list) and any(isinstance(p, dict) and p.get("id") == "web" for p in plugins)
    once |= isinstance(body.get("model"), str) and body["model"].endswith(":online")
    if once:
        calls["web_search_requests"] = calls.get("web_search_requests", 0) + 1
    return calls, unbounded


def _strings(node: Any, into: list[str], depth: int) -> None:
    """Every string in ``node`` (a ``prediction``) but ``type`` values, as a lenient upstream may read it."""
    if depth > _MAX_DEPTH:
        return
    if isinstance(node, str):
        into.append(node)
    elif isinstance(node, list):
        for item in node:
            _strings(item, into, depth + 1)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key != "type":
                _strings(value, into, depth + 1)


def _walk(node: Any, found: Unmetered, depth: int) -> None:
    if depth > _MAX_DEPTH:
        return
    if isinstance(node, list):
        for item in node:
            _walk(item, found, depth + 1)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind in _IMAGE_TYPES:
        found.images += 1
        return
    if kind in _FILE_TYPES:
        found.files += 1
        return
    if kind == "item_reference":  # an item of a stored response, by id
        found.stateful = True
        return
    audio = node.get("audio")
    if isinstance(audio, dict) and audio.get("id") and node.get("role") == "assistant":
        found.stateful = True  # Chat Completions: an earlier audio reply, by id (heard again as audio input)
    if kind == "input_audio":
        audio = node.get("input_audio")
        data = audio.get("data") if isinstance(audio, dict) else node.get("data")
        size = len(data) * 3 // 4 if isinstance(data, str) else 0
        found.audio_tokens += max(size // AUDIO_BYTES_PER_TOKEN, 1)
        return
    opaque = node.get("encrypted_content")
    if kind == "redacted_thinking":
        opaque = node.get("data")
    if isinstance(opaque, str):
        found.opaque_tokens += len(opaque) * 3 // 4 // OPAQUE_BYTES_PER_TOKEN + 1
    for value in node.values():
        if isinstance(value, dict | list):
            _walk(value, found, depth + 1)
