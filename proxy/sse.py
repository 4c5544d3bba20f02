"""Incremental server-sent-events splitter (sans-IO).

The relay forwards upstream bytes untouched; this module only finds where events end so the
meter can look at the few events that matter. :meth:`SSEDecoder.feed` takes any byte chunk
(one network read may hold many events or half of one) and returns the complete event blocks
it closed, each as the exact bytes received, terminating blank line included. Concatenating
every block returned by ``feed`` and ``flush`` gives back the input, byte for byte.

Framing follows the WHATWG SSE rules: a line ends with CRLF, LF or CR; an event ends at an
empty line; ``data:`` with or without one leading space; lines starting with ``:`` are comments.
"""

from __future__ import annotations

import re

__all__ = ["SSEDecoder", "parse_event"]

_BOUNDARY_ANY = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
_LINE_SPLIT = re.compile(rb"\r\n|\r|\n")


class SSEDecoder:
    """Split an SSE byte stream into complete event blocks, whatever the read boundaries."""

    __slots__ = ("_buffer", "_crlf")

    def __init__(self) -> None:
        self._buffer = b""
        self._crlf = False

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add ``chunk`` and return the event blocks it completed (possibly none)."""
        buffer = self._buffer + chunk if self._buffer else chunk
        if not self._crlf and b"\r" in chunk:
            self._crlf = True
        if self._crlf:
            return self._split_any(buffer)
        blocks = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            blocks.append(buffer[start : end + 2])
            start = end + 2
        self._buffer = buffer[start:] if start else buffer
        return blocks

    def _split_any(self, buffer: bytes) -> list[bytes]:
        blocks = []
        start = 0
        for match in _BOUNDARY_ANY.finditer(buffer):
            if match.end() == len(buffer) and buffer.endswith(b"\r"):
                break  # a trailing CR may be the first half of a CRLF split across reads
            blocks.append(buffer[start : match.end()])
            start = match.end()
        self._buffer = buffer[start:]
        return blocks

    def flush(self) -> list[bytes]:
        """Return what is left at end of stream as a final block (empty list when nothing is)."""
        rest, self._buffer = self._buffer, b""
        return [rest] if rest else []


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
