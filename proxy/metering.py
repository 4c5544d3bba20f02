"""The meter: reply bytes in, canonical usage out (sans-IO).

A :class:`Meter` is fed the reply exactly as the upstream sent it, either a whole JSON body
(:meth:`Meter.feed_body`) or stream chunks as they arrive (:meth:`Meter.feed_stream`), and
decodes any ``Content-Encoding`` on the side. For streams it splits events with
:class:`~tokenward.proxy.sse.SSEDecoder` and parses only the events that can matter: the first
(for the served model) and those whose bytes hold a usage or error object or a hosted tool call;
the rest are relayed without being parsed. :meth:`Meter.finish` maps what was seen through the
dialect.

:attr:`Meter.complete` says whether the reply ended the way its format ends: a stream's terminal
event was seen (``data: [DONE]``, a ``finish_reason``, Anthropic's ``message_stop`` or a
``stop_reason``, a Responses ``response.completed`` / ``response.incomplete`` /
``response.failed``, an ``error`` event), or a body that looks like JSON decoded whole. A
stream without it was cut; a JSON body that does not decode was cut mid-body. The caller
classifies the exchange from it (``Forwarder.complete``).

An SSE event over the decoder's cap (8 MiB) is relayed but not parsed, and a reply whose
content-encoding cannot be decoded is relayed but not metered; :attr:`Meter.unmetered` then says
what was skipped, for the row.

When the upstream reported no usage, :func:`estimate` counts tokens with the offline tokenizer
(:mod:`tokenward.proxy.tokenizer`): each choice's (or content block's) text is joined across
stream events before it is counted, as the model produced it. It is CPU-bound and meant to run
in a worker thread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal
from types import ModuleType
from typing import Any

import msgspec

from tokenward.pricing.usage import Usage, UsageSource
from tokenward.proxy import tokenizer
from tokenward.proxy.dialects import DIALECTS, Observation
from tokenward.proxy.dialects import openai as openai_dialect
from tokenward.proxy.dialects.observation import tool_counts
from tokenward.proxy.reply_coding import DecodedTooLarge, reply_decoder
from tokenward.proxy.sse import Elider, Fragment, LastFragment, SSEDecoder, parse_event

__all__ = ["Meter", "MeterResult", "count_input", "count_texts", "estimate", "input_bytes"]

_INTERESTING = re.compile(rb'"(?:usage|error)"\s*:\s*\{|^event:\s*error', re.MULTILINE)
# the event after which a stream says nothing more: OpenAI's [DONE], Anthropic's message_stop,
# the Responses API's terminal response.* events
_TERMINAL = re.compile(
    rb"^data:\s*\[DONE\]|^event:\s*(?:message_stop|response\.(?:completed|failed|incomplete)"
    rb"|transcript\.text\.done|speech\.audio\.done)\s*$"
    rb'|"type"\s*:\s*"(?:message_stop|response\.(?:completed|failed|incomplete)|transcript\.text\.done'
    rb'|speech\.audio\.done)"',
    re.MULTILINE,
)
# streams that ended well (an image stream sends one completed event per image, so none is terminal)
_ENDINGS = frozenset(
    {
        "message_stop",
        "response.completed",
        "response.incomplete",
        "response.failed",
        "error",
        "transcript.text.done",
        "speech.audio.done",
        "image_generation.completed",
        "image_edit.completed",
    }
)
_DONE = re.compile(rb"^data:[ ]?\[DONE\]\s*$", re.MULTILINE)
_EVENT_ERROR = re.compile(rb"^event:[ ]?error\s*$", re.MULTILINE)
_KEEP_FOR_ESTIMATE = 16 * 1024 * 1024  # bytes of reply kept in case the upstream reports no usage
MAX_DECODED_BODY_BYTES = 128 * 1024 * 1024
"""Bytes a compressed whole reply may decode to for the meter: what the relay holds of an uncompressed one."""
MAX_DECODED_CHUNK_BYTES = 32 * 1024 * 1024
"""Bytes one received chunk of a compressed stream may decode to (a chunk is 64 KiB to 1 MiB)."""
MAX_DECODED_STREAM_BYTES = 1024 * 1024 * 1024
"""Bytes a whole compressed stream may decode to (its decoding is CPU a hostile upstream could spend)."""
_PIECE = 1 << 20  # characters tokenized at once: bounds the list of token ids tiktoken builds (~36 bytes each)
_CUT_TRIES = 64


@dataclass(frozen=True, slots=True)
class MeterResult:
    """What a reply said about itself once it ended.

    ``usage`` is ``None`` when the upstream reported none; ``parts`` are usage spent on other
    models inside the request (``(model, usage)``); ``raw_usage`` is the provider's usage object
    as received (kept in the ledger for audits and re-pricing). ``complete``: the reply ended
    as its format ends (:attr:`Meter.complete`); ``unmetered``: what was relayed without being
    metered, if anything; ``web_search_calls``: hosted web searches seen outside ``usage``;
    ``tool_calls``: every hosted tool call seen outside ``usage``, by :class:`Usage` field.
    """

    usage: Usage | None
    parts: list[tuple[str, Usage]]
    raw_usage: dict[str, Any] | None
    model: str | None
    service_tier: str | None
    provider_cost: Decimal | None
    error: str | None
    events: int
    complete: bool = True
    unmetered: str | None = None
    web_search_calls: int = 0
    tool_calls: dict[str, int] = field(default_factory=dict)


class Meter:
    """Meter one reply of one dialect.

    Args:
        dialect: a key of :data:`~tokenward.proxy.dialects.DIALECTS`.
        content_encoding: the reply's ``Content-Encoding`` (gzip, deflate, br, zstd or none).

    Raises:
        KeyError: unknown dialect.
    """

    __slots__ = (
        "_bomb",
        "_complete",
        "_decoded_bytes",
        "_decoder",
        "_dialect",
        "_elided",
        "_elider",
        "_inflate",
        "_kept",
        "_kept_bytes",
        "_oversized",
        "_seen",
        "_undecodable",
        "_unparsed",
        "events",
        "terminal",
    )

    def __init__(self, dialect: str, content_encoding: str | None = None) -> None:
        self._dialect: ModuleType = DIALECTS[dialect]
        self._seen = Observation()
        self._decoder = SSEDecoder()
        self._elider: Elider | None = None
        self._elided = 0  # long strings left out of oversized events that were metered
        self._unparsed = 0  # oversized events not metered
        self._inflate = reply_decoder(content_encoding)
        self._kept: list[bytes] = []
        self._kept_bytes = 0
        self._complete = False
        self._undecodable = False
        self._bomb = 0  # the room a piece of the reply decoded past (a compression bomb)
        self._decoded_bytes = 0
        self._oversized = 0
        self.events = 0
        self.terminal = False
        """Whether the stream's terminal event has been seen (nothing more is expected)."""

    def feed_body(self, body: bytes) -> None:
        """Meter a whole (non-streamed) JSON reply; a body that is not JSON is kept, not parsed."""
        body = self._decoded(body, MAX_DECODED_BODY_BYTES)
        self._keep(body)
        try:
            self._dialect.observe_body(body, self._seen)
            self._complete = True
        except (msgspec.DecodeError, msgspec.ValidationError):
            # not JSON: an HTML error page, say (no usage in it); one that starts like JSON was cut
            self._complete = body.lstrip()[:1] not in (b"{", b"[")

    def feed_stream(self, chunk: bytes) -> list[bytes]:
        """Meter one chunk of an SSE reply as received; returns the event blocks it completed.

        The blocks are (decoded) bytes as received; a relay that has to edit events uses them,
        a relay that forwards raw bytes ignores them. Blocks of an event over the size cap come
        back as :class:`~tokenward.proxy.sse.Fragment` and are not parsed.
        """
        chunk = self._decoded(chunk, MAX_DECODED_CHUNK_BYTES)
        self._keep(chunk)
        blocks = self._decoder.feed(chunk)
        for block in blocks:
            self._inspect(block)
        return blocks

    def skip_oversized(self, limit: int) -> None:
        """A whole reply over ``limit`` bytes is relayed as it arrives, unread: nothing of it is metered."""
        self._oversized = limit

    def end_raw(self) -> None:
        """A reply relayed as is ended well: its usage comes from the request (``complete`` is true)."""
        self._complete = True

    def end_stream(self) -> list[bytes]:
        """Close the stream: meter a final event left without its blank line; returns it if any."""
        blocks = self._decoder.flush()
        for block in blocks:
            self._inspect(block)
        return blocks

    def _decoded(self, data: bytes, room: int) -> bytes:
        if self._inflate is None or self._undecodable:
            return data if self._inflate is None else b""
        try:
            decoded = self._inflate.decode(data, max(0, min(room, MAX_DECODED_STREAM_BYTES - self._decoded_bytes)))
            self._decoded_bytes += len(decoded)
            return decoded
        except DecodedTooLarge:  # a compression bomb, or a reply nobody could hold: relayed, not metered
            self._undecodable, self._bomb = True, min(room, MAX_DECODED_STREAM_BYTES)
            return b""
        except Exception:  # zlib, brotli and zstandard each raise their own error on a corrupt body
            self._undecodable = True
            return b""

    def _inspect(self, block: bytes) -> None:
        if isinstance(block, Fragment):
            self._elide(block)
            return
        self.events += 1
        if not self.terminal and _may_end(block) and _TERMINAL.search(block) is not None:
            self.terminal = True
        if not self._complete:
            self._complete = _is_terminal(block)
        if self._seen.model is not None and not _is_interesting(block):
            return
        event, data = parse_event(block)
        if data is None or data == b"[DONE]":
            return
        try:
            self._dialect.observe_body(data, self._seen)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if event == "error":
                self._seen.error = data.decode("utf-8", "replace")[:500]

    def _elide(self, fragment: Fragment) -> None:
        """Feed a piece of an event over the size cap to its copy; meter the copy when the event ends."""
        elider = self._elider
        if elider is None:
            elider = self._elider = Elider()
        elider.feed(fragment)
        if not isinstance(fragment, LastFragment):
            return
        self._elider = None
        copy = elider.result()
        data = parse_event(copy)[1] if copy is not None else None
        try:
            if data is not None and data != b"[DONE]":
                msgspec.json.decode(data)
        except (msgspec.DecodeError, RecursionError):
            data = None
        if data is None:
            self._unparsed += 1
            return
        self._elided += elider.elided
        assert copy is not None
        self._inspect(copy)

    def _keep(self, data: bytes) -> None:
        if self._kept_bytes < _KEEP_FOR_ESTIMATE:
            self._kept.append(data)
            self._kept_bytes += len(data)

    @property
    def has_usage(self) -> bool:
        """Whether a usage object has been seen so far."""
        return self._seen.usage is not None

    @property
    def complete(self) -> bool:
        """Whether the reply ended as its format ends (see the module docstring).

        True as well when the reply could not be decoded at all (nothing can be said; see
        :attr:`unmetered`).
        """
        return self._complete or self._undecodable

    @property
    def undecodable(self) -> bool:
        """Whether the reply could not be read, so none of it past that point was metered.

        Its content-encoding could not be decoded, or it was a whole reply over the relay's cap
        (:meth:`skip_oversized`).
        """
        return self._undecodable or self._oversized > 0

    @property
    def unmetered(self) -> str | None:
        """What was relayed without being metered: an event over the size cap, an undecodable body."""
        if self._bomb:
            return f"the reply decodes to more than {self._bomb:,} bytes: relayed, not metered"
        if self._undecodable:
            return "the reply's content-encoding could not be decoded: relayed, not metered"
        if self._oversized:
            return f"a whole reply over {self._oversized} bytes: relayed, not metered"
        cap = self._decoder.max_event_bytes
        if self._unparsed or self._elider is not None:
            return f"an SSE event over {cap} bytes: relayed, not metered"
        if self._elided and self._seen.usage is None:  # only an estimate reads the strings left out
            return f"an SSE event over {cap} bytes: metered without its strings over 64 KiB"
        return None

    @property
    def kept_reply(self) -> list[bytes]:
        """The decoded reply bytes seen so far (up to 16 MiB), for :func:`estimate`."""
        return self._kept

    def finish(self) -> MeterResult:
        """Map what was seen to canonical usage (``None`` when nothing was reported)."""
        seen = self._seen
        reading = self._dialect.finish(seen)
        return MeterResult(
            reading.usage,
            reading.parts,
            seen.usage,
            seen.model,
            seen.service_tier,
            reading.provider_cost,
            seen.error,
            self.events,
            self.complete,
            self.unmetered,
            len(seen.web_search_calls),
            tool_counts(seen),
        )


# JSON members whose value opens with a given character, anywhere in an event: a literal name
# (a name inside generated text has its quotes escaped with backslashes, so only a real member
# matches), a colon and the opening, with any JSON whitespace around the colon and, in a
# multi-line ``data`` field, the ``data:`` that starts each line. Each search starts from its
# literal name (this runs on every event): 0.3 us on a 200-byte chat chunk, against 1 us in Python.
_BLANK = rb"(?:\s|data:)*"
_FINISH_REASON = re.compile(rb'"finish_reason"' + _BLANK + b":" + _BLANK + b'"')
_STOP_REASON = re.compile(rb'"stop_reason"' + _BLANK + b":" + _BLANK + b'"')
_USAGE_OBJECT = re.compile(rb'"usage"' + _BLANK + b":" + _BLANK + rb"\{")
_ERROR_OBJECT = re.compile(rb'"error"' + _BLANK + b":" + _BLANK + rb"\{")


def _may_end(block: bytes) -> bool:
    """Whether ``block`` holds a word every :data:`_TERMINAL` match needs (plain searches, before the regex)."""
    return b"[DONE]" in block or b"message_stop" in block or b"response." in block


def _is_interesting(block: bytes) -> bool:
    """Whether an event may carry usage, an error or a hosted tool call (the others are not parsed)."""
    return (
        _USAGE_OBJECT.search(block) is not None
        or _ERROR_OBJECT.search(block) is not None
        or b'"web_search_call"' in block
        or b'"file_search_call"' in block
        or b'"code_interpreter_call"' in block
        or b'"image_generation_call"' in block
        or b'"server_tool_use"' in block
        or b'"executed_tools"' in block
        or b'rounding_metadata"' in block
        or b'roundingMetadata"' in block
        or (b"event:" in block and _EVENT_ERROR.search(block) is not None)
    )


def _is_terminal(block: bytes) -> bool:
    """Whether an event ends its stream: ``[DONE]``, a finish or stop reason, a terminal event type."""
    if _FINISH_REASON.search(block) is not None or _STOP_REASON.search(block) is not None:
        return True
    if b"[DONE]" in block:
        return _DONE.search(block) is not None
    # five searches that every ending's name needs, before the nine names themselves
    if (
        b"response." in block
        or b"message_stop" in block
        or b"error" in block
        or b".done" in block
        or b".completed" in block
    ):
        return _ends_by_type(block)
    return False


def _ends_by_type(block: bytes) -> bool:
    """Whether an event's name or JSON ``type`` is one of :data:`_ENDINGS` (only read when a name is in its bytes)."""
    if (
        b"message_stop" in block
        or b"response.completed" in block
        or b"response.incomplete" in block
        or b"response.failed" in block
        or b"error" in block
        or b"transcript.text.done" in block
        or b"speech.audio.done" in block
        or b"image_generation.completed" in block
        or b"image_edit.completed" in block
    ):
        event, data = parse_event(block)
        kind = event
        if data is not None and data[:1] == b"{":
            try:
                kind = msgspec.json.decode(data, type=_Kind).type or kind
            except (msgspec.DecodeError, msgspec.ValidationError):
                return False
        return data is not None and kind in _ENDINGS
    return False


class _Kind(msgspec.Struct):
    type: str | None = None


def count_input(dialect: str, body: Any, model: str | None, endpoint: str | None = None) -> int:
    """Input tokens of a decoded request ``body`` by the offline tokenizer (0 if not a JSON object).

    Chat requests add OpenAI's per-message overhead (3 tokens a message, 3 for the reply's priming);
    so do Responses requests (``endpoint`` ``responses`` or ``responses_compact``), whose
    instructions, bare string input and input messages are messages too
    (:func:`~tokenward.proxy.dialects.openai.responses_messages`).
    Texts longer than a million characters are counted a piece at a time (:func:`_count_long`),
    so memory stays near the size of the text itself.
    """
    if not isinstance(body, dict):
        return 0
    texts, messages = _request_texts(dialect, body, endpoint)
    tokens = count_texts(texts, model)
    return tokens + 3 * messages + 3 if messages else tokens


def count_texts(texts: list[str], model: str | None) -> int:
    """Tokens of ``texts`` in ``model``'s encoding, each counted whole (long ones a piece at a time)."""
    encoding = tokenizer.encoding_for_model(model)
    return sum(
        tokenizer.count_tokens(text, encoding) if len(text) <= _PIECE else _count_long(text, encoding) for text in texts
    )


def _request_texts(dialect: str, body: dict[str, Any], endpoint: str | None) -> tuple[list[str], int]:
    """The dialect's request texts and message count, with a Responses request's messages added."""
    texts, messages = DIALECTS[dialect].request_texts(body)
    if dialect == "openai" and endpoint in _RESPONSES:
        roles, more = openai_dialect.responses_messages(body)
        texts, messages = [*texts, *roles], messages + more
    return texts, messages


_RESPONSES = frozenset({"responses", "responses_compact"})


def input_bytes(dialect: str, body: Any, endpoint: str | None = None) -> int:
    """An upper bound of :func:`count_input` for every encoding, without the tokenizer (0 if not a JSON object).

    The UTF-8 bytes of the same texts plus the same per-message overhead: every token of a
    byte-level BPE encoding (both of tiktoken's) is at least one byte of its text. Not the body's
    size: the texts counted include re-encoded JSON (tools, tool inputs), which can be longer
    than the body wrote it (``1e15`` is ``1000000000000000.0``).
    """
    if not isinstance(body, dict):
        return 0
    texts, messages = _request_texts(dialect, body, endpoint)
    size = sum(len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass")) for text in texts)
    return size + 3 * messages + 3 if messages else size


def _hashable(key: Any) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def _count_long(text: str, encoding: str) -> int:
    """Tokens of a long ``text``, tokenized in pieces of at most :data:`_PIECE` characters.

    Each piece ends just before a space that follows a non-space character. Both encodings'
    pre-tokenizers start a new piece of text there (no pattern runs from a non-space character
    into a following space), so the count equals counting the whole text at once. A stretch
    with no such space (base64, CJK text) is cut at the piece size, which may shift the count
    by a token per cut.
    """
    total = 0
    start = 0
    end_of_text = len(text)
    while start < end_of_text:
        end = min(start + _PIECE, end_of_text)
        if end < end_of_text:
            cut = text.rfind(" ", start + _PIECE // 2, end)
            for _ in range(_CUT_TRIES):
                if cut <= start or not text[cut - 1].isspace():
                    break
                cut = text.rfind(" ", start + _PIECE // 2, cut)
            if cut > start and not text[cut - 1].isspace():
                end = cut
        total += tokenizer.count_tokens(text[start:end], encoding)
        start = end
    return total


def estimate(
    dialect: str,
    request_body: bytes,
    reply: list[bytes],
    *,
    stream: bool,
    model: str | None,
    source: UsageSource,
    web_search_requests: int = 0,
    tool_calls: dict[str, int] | None = None,
    only_if_output: bool = False,
    endpoint: str | None = None,
) -> Usage | None:
    """Count a request's input and its reply's output with the offline tokenizer.

    Args:
        dialect: the dialect whose text extractors to use.
        request_body: the request JSON as sent by the client.
        reply: decoded reply bytes (a JSON body, or SSE chunks when ``stream``).
        stream: whether ``reply`` is an SSE stream.
        model: the model name, to pick the encoding.
        source: ``estimated`` (the upstream reported nothing) or ``partial`` (the reply was cut).
        web_search_requests: hosted web searches counted in the reply, carried into the usage.
        tool_calls: the other hosted tool calls counted in the reply (:class:`Usage` fields), carried too.
        only_if_output: return ``None`` when the reply holds no generated text (an error event
            before any content: nothing was generated, nothing is billed).
        endpoint: the endpoint's name (a Responses request's messages add their overhead).

    Returns:
        Usage with input and output tokens counted; chat requests add OpenAI's per-message
        overhead (3 tokens a message, 3 for the reply's priming). Each piece of output (a choice's
        content, its reasoning, one tool call's arguments, a content block) is joined across the
        stream's events and counted whole; a text a final event repeats in full replaces its deltas.
    """
    module = DIALECTS[dialect]
    encoding = tokenizer.encoding_for_model(model)
    try:
        body = msgspec.json.decode(request_body)
    except (msgspec.DecodeError, RecursionError):
        body = {}
    input_tokens = count_input(dialect, body, model, endpoint)
    documents: list[bytes] = []
    if stream:
        decoder = SSEDecoder(max_event_bytes=None)  # the kept reply is bounded already
        for chunk in reply:
            documents.extend(data for _, data in map(parse_event, decoder.feed(chunk)) if data)
        documents.extend(data for _, data in map(parse_event, decoder.flush()) if data)
    else:
        documents.append(b"".join(reply))
    deltas: dict[Any, list[str]] = {}
    whole: dict[Any, str] = {}
    for document in documents:
        try:
            obj = msgspec.json.decode(document)
        except msgspec.DecodeError:
            continue
        if isinstance(obj, dict):
            for found, text, is_whole in module.reply_texts(obj):
                key = found if _hashable(found) else repr(found)  # an index or id a reply gave as a list
                if is_whole:
                    whole[key] = text
                else:
                    deltas.setdefault(key, []).append(text)
    texts = [whole[key] if key in whole else "".join(deltas[key]) for key in {**deltas, **whole}]
    output_tokens = sum(tokenizer.count_tokens(text, encoding) for text in texts)
    if only_if_output and not any(texts):
        return None
    return Usage(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        **{**(tool_calls or {}), "web_search_requests": web_search_requests},
        source=source,
    )
