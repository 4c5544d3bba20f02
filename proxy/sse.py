"""Incremental server-sent-events splitter (sans-IO).

The relay forwards upstream bytes untouched; this module only finds where events end so the
meter can look at the few events that matter. :meth:`SSEDecoder.feed` takes any byte chunk
(one network read may hold many events or half of one) and returns the complete event blocks
it closed, each as the exact bytes received, terminating blank line included. Concatenating
every block returned by ``feed`` and ``flush`` gives back the input, byte for byte.

Framing follows the WHATWG SSE rules: a line ends with CRLF, LF or CR; an event ends at an
empty line; ``data:`` with or without one leading space; lines starting with ``:`` are comments.

Cost is linear in the input: each byte is searched for a boundary once (a read that ends
inside an event is only appended to the pending part, never re-scanned), and each event's
bytes are joined once when it completes.

Size cap: an event may hold at most ``max_event_bytes`` (default :data:`MAX_EVENT_BYTES`,
8 MiB; no real provider event comes near it, the largest seen are a few hundred KiB of
Responses output). A longer event comes back as :class:`Fragment` blocks whatever the read
sizes were: one block when it arrived whole, else, once the cap is passed, what was held and
then each later piece of it up to its blank line as it arrives (the decoder stops holding it).
Fragments are still bytes, so a relay forwards them unchanged and concatenation still gives
back the input; the last one of an event is a :class:`LastFragment`, and
:attr:`SSEDecoder.overflowed` records that it happened. The meter never parses fragments: it
feeds them to an :class:`Elider`, whose copy of the event, long strings emptied, it parses.
Memory stays bounded by the cap plus one read whatever the upstream sends.
"""

from __future__ import annotations

import re

__all__ = ["MAX_EVENT_BYTES", "Elider", "Fragment", "LastFragment", "SSEDecoder", "parse_event"]

MAX_EVENT_BYTES = 8 * 1024 * 1024
"""Default cap on one event's size in bytes (8 MiB)."""

_BOUNDARY_ANY = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
_LINE_SPLIT = re.compile(rb"\r\n|\r|\n")
_LOOKBEHIND = 3  # a boundary ("\r\n\r\n" at most) can start this many bytes before a new read


class Fragment(bytes):
    """Bytes of an event past the size cap: relayed as received, never parsed as an event."""

    __slots__ = ()


class LastFragment(Fragment):
    """The last bytes of an event past the size cap (its blank line included, unless the stream ended first)."""

    __slots__ = ()


_STRING_SPECIAL = re.compile(rb'[\\"]')


class Elider:
    """A copy of one oversized event, fed its fragments in order, with every long JSON string emptied.

    What makes an event that large is one string (a base64 image in ``image_generation.completed``,
    an image tool's ``result`` in ``response.completed``); the usage, type and ids beside it are
    small. Every string of the event's JSON longer than ``keep`` bytes becomes ``""``, so the copy
    parses like the event with those strings left out. A string is held whole until it ends or
    passes ``keep`` (never cut mid-escape or mid-character); the copy is bounded by ``limit``
    bytes, past which :meth:`result` is ``None`` (the event is not metered).
    """

    __slots__ = ("_escape", "_held", "_in_string", "_keep", "_limit", "_out", "elided")

    def __init__(self, keep: int = 64 * 1024, limit: int = MAX_EVENT_BYTES) -> None:
        self._out: bytearray | None = bytearray()
        self._held: bytearray | None = None  # the current string's content while it is short enough
        self._in_string = False
        self._escape = False  # the previous piece ended with a backslash inside a string
        self._limit = limit
        self._keep = keep
        self.elided = 0
        """Strings emptied so far."""

    def feed(self, data: bytes) -> None:
        """Add the event's next bytes."""
        out = self._out
        if out is None:
            return
        at, end = 0, len(data)
        while at < end:
            if self._escape:  # the byte escaped by a backslash that ended the previous piece
                self._hold(data[at : at + 1])
                self._escape = False
                at += 1
            elif not self._in_string:
                quote = data.find(b'"', at)
                if quote < 0:
                    out += data[at:]
                    break
                out += data[at : quote + 1]
                self._in_string, self._held = True, bytearray()
                at = quote + 1
            else:
                special = _STRING_SPECIAL.search(data, at)
                if special is None:
                    self._hold(data[at:])
                    break
                stop = special.start()
                self._hold(data[at:stop])
                if data[stop] == 0x5C:  # a backslash: it and the byte it escapes stay together
                    if stop + 1 < end:
                        self._hold(data[stop : stop + 2])
                        at = stop + 2
                    else:
                        self._hold(b"\\")
                        self._escape = True
                        at = stop + 1
                else:  # the closing quote
                    if self._held is None:
                        self.elided += 1
                    else:
                        out += self._held
                    out += b'"'
                    self._in_string, self._held = False, None
                    at = stop + 1
            if len(out) > self._limit:
                self._out = None
                return

    def _hold(self, piece: bytes) -> None:
        held = self._held
        if held is not None:
            if len(held) + len(piece) > self._keep:
                self._held = None
            else:
                held += piece

    def result(self) -> bytes | None:
        """The copy (``None`` past ``limit``, or when the event ended inside a string)."""
        if self._out is None or self._in_string:
            return None
        return bytes(self._out)


class SSEDecoder:
    """Split an SSE byte stream into complete event blocks, whatever the read boundaries.

    Args:
        max_event_bytes: the cap on one event (``None``: no cap, for bounded inputs only).
    """

    __slots__ = ("_buffer", "_crlf", "_skipping", "max_event_bytes", "overflowed")

    def __init__(self, max_event_bytes: int | None = MAX_EVENT_BYTES) -> None:
        self._buffer = bytearray()
        self._crlf = False
        self._skipping = False
        self.max_event_bytes = max_event_bytes
        self.overflowed = False
        """Whether an event went past the cap (its bytes came back as :class:`Fragment` blocks)."""

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add ``chunk`` and return the event blocks it completed (possibly none)."""
        if not chunk:
            return []
        buffer = self._buffer
        if (
            not buffer
            and not self._crlf
            and not self._skipping
            and chunk[-2:] == b"\n\n"
            and chunk.find(b"\n\n") == len(chunk) - 2
            and (self.max_event_bytes is None or len(chunk) <= self.max_event_bytes)
            and b"\r" not in chunk
        ):
            return [bytes(chunk)]  # the usual read: exactly one whole event, returned without a copy
        searched = max(len(buffer) - _LOOKBEHIND, 0)
        buffer += chunk
        if not self._crlf and b"\r" in chunk:
            self._crlf = True
        blocks: list[bytes] = []
        start = 0
        cap = self.max_event_bytes
        for end in self._boundaries(buffer, searched):
            block = bytes(buffer[start:end])
            if self._skipping or (cap is not None and end - start > cap):  # whatever the read sizes were
                self.overflowed = True
                block = LastFragment(block)
            blocks.append(block)
            self._skipping = False
            start = end
        if start:
            del buffer[:start]
        if not self._skipping and cap is not None and len(buffer) > cap:
            self.overflowed = True
            self._skipping = True
        if self._skipping and len(buffer) > _LOOKBEHIND:
            # pass the oversized event on as it comes; keep the last bytes, which may begin its boundary
            blocks.append(Fragment(bytes(buffer[:-_LOOKBEHIND])))
            del buffer[:-_LOOKBEHIND]
        return blocks

    def _boundaries(self, buffer: bytearray, searched: int) -> list[int]:
        """End offsets of the blank lines in ``buffer`` at or after ``searched`` (an event boundary each)."""
        ends = []
        if not self._crlf:
            at = buffer.find(b"\n\n", searched)
            while at >= 0:
                ends.append(at + 2)
                at = buffer.find(b"\n\n", at + 2)
            return ends
        for match in _BOUNDARY_ANY.finditer(buffer, searched):
            if match.end() == len(buffer) and buffer.endswith(b"\r"):
                break  # a trailing CR may be the first half of a CRLF split across reads
            ends.append(match.end())
        return ends

    def flush(self) -> list[bytes]:
        """Return what is left at end of stream as a final block (empty list when nothing is)."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        skipping, self._skipping = self._skipping, False
        if not rest:
            return []
        return [LastFragment(rest) if skipping else rest]


def parse_event(block: bytes) -> tuple[str | None, bytes | None]:
    """Parse one event block into its ``event`` name and ``data`` (lines joined with LF).

    Returns:
        ``(event, data)``; ``data`` is ``None`` when the block has no data line (a comment-only
        keep-alive, for instance), so no event would be dispatched.
    """
    event: str | None = None
    data: list[bytes] = []
    for line in _LINE_SPLIT.split(block):
        if not line or line[0] == 0x3A:  # blank line or ":" comment
            continue
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value.decode("utf-8", "replace")
    return event, (b"\n".join(data) if data else None)
