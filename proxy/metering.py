"""The meter: reply bytes in, canonical usage out (sans-IO).

A :class:`Meter` is fed the reply exactly as the upstream sent it, either a whole JSON body
(:meth:`Meter.feed_body`) or stream chunks as they arrive (:meth:`Meter.feed_stream`), and
decodes any ``Content-Encoding`` on the side. For streams it splits events with
:class:`~tokenward.proxy.sse.SSEDecoder` and parses only the events that can matter: the first
(for the served model) and those whose bytes hold a usage or error object; the rest are
relayed without being parsed. :meth:`Meter.finish` maps what was seen through the dialect.

When the upstream reported no usage, :func:`estimate` counts tokens with the offline tokenizer
(:mod:`tokenward.proxy.tokenizer`); it is CPU-bound and meant to run in a worker thread.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from decimal import Decimal
from types import ModuleType
from typing import Any, Protocol

import msgspec

from tokenward.pricing.usage import Usage, UsageSource
from tokenward.proxy import tokenizer
from tokenward.proxy.dialects import DIALECTS, Observation
from tokenward.proxy.sse import SSEDecoder, parse_event

__all__ = ["Meter", "MeterResult", "count_input", "estimate"]

_INTERESTING = re.compile(rb'"(?:usage|error)"\s*:\s*\{|^event:\s*error', re.MULTILINE)
# the event after which a stream says nothing more: OpenAI's [DONE], Anthropic's message_stop,
# the Responses API's terminal response.* events
_TERMINAL = re.compile(
    rb"^data:\s*\[DONE\]|^event:\s*(?:message_stop|response\.(?:completed|failed|incomplete))\s*$"
    rb'|"type"\s*:\s*"(?:message_stop|response\.(?:completed|failed|incomplete))"',
    re.MULTILINE,
)
_KEEP_FOR_ESTIMATE = 16 * 1024 * 1024  # bytes of reply kept in case the upstream reports no usage
_PIECE = 1 << 20  # characters tokenized at once: bounds the list of token ids tiktoken builds (~36 bytes each)
_CUT_TRIES = 64


class _Decompressor(Protocol):
    def decompress(self, data: bytes) -> bytes: ...


@dataclass(frozen=True, slots=True)
class MeterResult:
    """What a reply said about itself once it ended.

    ``usage`` is ``None`` when the upstream reported none; ``parts`` are usage spent on other
    models inside the request (``(model, usage)``); ``raw_usage`` is the provider's usage object
    as received (kept in the ledger for audits and re-pricing).
    """

    usage: Usage | None
    parts: list[tuple[str, Usage]]
    raw_usage: dict[str, Any] | None
    model: str | None
    service_tier: str | None
    provider_cost: Decimal | None
    error: str | None
    events: int


class Meter:
    """Meter one reply of one dialect.

    Args:
        dialect: a key of :data:`~tokenward.proxy.dialects.DIALECTS`.
        content_encoding: the reply's ``Content-Encoding`` (gzip, deflate, br, zstd or none).

    Raises:
        KeyError: unknown dialect.
    """

    __slots__ = ("_decoder", "_dialect", "_inflate", "_kept", "_kept_bytes", "_seen", "events", "terminal")

    def __init__(self, dialect: str, content_encoding: str | None = None) -> None:
        self._dialect: ModuleType = DIALECTS[dialect]
        self._seen = Observation()
        self._decoder = SSEDecoder()
        self._inflate = _decompressor(content_encoding)
        self._kept: list[bytes] = []
        self._kept_bytes = 0
        self.events = 0
        self.terminal = False
        """Whether the stream's terminal event has been seen (nothing more is expected)."""

    def feed_body(self, body: bytes) -> None:
        """Meter a whole (non-streamed) JSON reply; a body that is not JSON is kept, not parsed."""
        if self._inflate is not None:
            body = self._inflate.decompress(body)
        self._keep(body)
        try:
            self._dialect.observe_body(body, self._seen)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass  # not JSON: an HTML error page, say; no usage in it

    def feed_stream(self, chunk: bytes) -> list[bytes]:
        """Meter one chunk of an SSE reply as received; returns the event blocks it completed.

        The blocks are (decoded) bytes as received; a relay that has to edit events uses them,
        a relay that forwards raw bytes ignores them.
        """
        if self._inflate is not None:
            chunk = self._inflate.decompress(chunk)
        self._keep(chunk)
        blocks = self._decoder.feed(chunk)
        for block in blocks:
            self._inspect(block)
        return blocks

    def end_stream(self) -> list[bytes]:
        """Close the stream: meter a final event left without its blank line; returns it if any."""
        blocks = self._decoder.flush()
        for block in blocks:
            self._inspect(block)
        return blocks

    def _inspect(self, block: bytes) -> None:
        self.events += 1
        if not self.terminal and _TERMINAL.search(block) is not None:
            self.terminal = True
        if self._seen.model is not None and _INTERESTING.search(block) is None:
            return
        event, data = parse_event(block)
        if data is None or data == b"[DONE]":
            return
        try:
            self._dialect.observe_body(data, self._seen)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if event == "error":
                self._seen.error = data.decode("utf-8", "replace")[:500]

    def _keep(self, data: bytes) -> None:
        if self._kept_bytes < _KEEP_FOR_ESTIMATE:
            self._kept.append(data)
            self._kept_bytes += len(data)

    @property
    def has_usage(self) -> bool:
        """Whether a usage object has been seen so far."""
        return self._seen.usage is not None

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
        )


def count_input(dialect: str, body: Any, model: str | None) -> int:
    """Input tokens of a decoded request ``body`` by the offline tokenizer (0 if not a JSON object).

    Chat requests add OpenAI's per-message overhead (3 tokens a message, 3 for the reply's priming).
    Texts longer than a million characters are counted a piece at a time (:func:`_count_long`),
    so memory stays near the size of the text itself.
    """
    if not isinstance(body, dict):
        return 0
    encoding = tokenizer.encoding_for_model(model)
    texts, messages = DIALECTS[dialect].request_texts(body)
    tokens = sum(
        tokenizer.count_tokens(text, encoding) if len(text) <= _PIECE else _count_long(text, encoding) for text in texts
    )
    return tokens + 3 * messages + 3 if messages else tokens


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
) -> Usage:
    """Count a request's input and its reply's output with the offline tokenizer.

    Args:
        dialect: the dialect whose text extractors to use.
        request_body: the request JSON as sent by the client.
        reply: decoded reply bytes (a JSON body, or SSE chunks when ``stream``).
        stream: whether ``reply`` is an SSE stream.
        model: the model name, to pick the encoding.
        source: ``estimated`` (the upstream reported nothing) or ``partial`` (the reply was cut).

    Returns:
        Usage with input and output tokens counted; chat requests add OpenAI's per-message
        overhead (3 tokens a message, 3 for the reply's priming).
    """
    module = DIALECTS[dialect]
    encoding = tokenizer.encoding_for_model(model)
    try:
        body = msgspec.json.decode(request_body)
    except (msgspec.DecodeError, RecursionError):
        body = {}
    input_tokens = count_input(dialect, body, model)
    output_texts: list[str] = []
    documents: list[bytes] = []
    if stream:
        decoder = SSEDecoder()
        for chunk in reply:
            documents.extend(data for _, data in map(parse_event, decoder.feed(chunk)) if data)
        documents.extend(data for _, data in map(parse_event, decoder.flush()) if data)
    else:
        documents.append(b"".join(reply))
    for document in documents:
        try:
            obj = msgspec.json.decode(document)
        except msgspec.DecodeError:
            continue
        if isinstance(obj, dict):
            output_texts.extend(module.reply_texts(obj))
    output_tokens = sum(tokenizer.count_tokens(text, encoding) for text in output_texts)
    return Usage(input_tokens=input_tokens, output_tokens=output_tokens, source=source)


def _decompressor(encoding: str | None) -> _Decompressor | None:
    name = (encoding or "").strip().lower()
    if name in ("", "identity"):
        return None
    if name in ("gzip", "x-gzip"):
        return zlib.decompressobj(wbits=31)  # type: ignore[return-value]
    if name == "deflate":
        return _Deflate()
    if name == "br":
        import brotli

        return _Brotli(brotli.Decompressor())
    if name == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj()  # type: ignore[no-any-return]
    return None


class _Brotli:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def decompress(self, data: bytes) -> bytes:
        return self._inner.process(data)  # type: ignore[no-any-return]


class _Deflate:
    """``deflate`` as servers send it: zlib-wrapped, or raw deflate from a few old servers."""

    def __init__(self) -> None:
        self._inner: Any = None

    def decompress(self, data: bytes) -> bytes:
        if self._inner is None:
            self._inner = zlib.decompressobj() if data[:1] == b"\x78" else zlib.decompressobj(-zlib.MAX_WBITS)
        return self._inner.decompress(data)  # type: ignore[no-any-return]
