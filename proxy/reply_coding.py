"""Compressed replies (``Content-Encoding``) decoded for the meter, never past a bound.

The client gets the reply's bytes as the upstream sent them (but for a stream whose usage chunk
tokenward removes: that one is relayed as the meter decoded it); the meter reads a decoded copy. A
broken or hostile upstream can send a small body that decodes to gigabytes (a gzip "bomb":
deflate reaches about 1,000:1, brotli and zstd far more), so every call decodes at most ``room``
bytes and raises :class:`DecodedTooLarge` past that, whatever the ratio: the reply is then
relayed but not metered (``usage_unknown``, its reservation kept as spend).
"""

from __future__ import annotations

import zlib
from typing import Any, Protocol

__all__ = ["DecodedTooLarge", "ReplyDecoder", "reply_decoder"]

_PIECE = 64 * 1024  # compressed bytes handed to brotli at once
_ZSTD_WRITE = 128 * 1024  # decoded bytes zstd hands over at once


class DecodedTooLarge(Exception):
    """The data decodes to more than the room it was given."""


class ReplyDecoder(Protocol):
    """One reply's decoder, fed the body piece by piece."""

    def decode(self, data: bytes, room: int) -> bytes:
        """The decoded bytes of the next piece ``data`` of the body (at most ``room``).

        Raises:
            DecodedTooLarge: ``data`` decodes to more than ``room`` bytes.
            Exception: the coding's own error (``zlib.error``, ``brotli.error``,
                ``zstandard.ZstdError``) on a corrupt body.
        """
        ...


def reply_decoder(encoding: str | None) -> ReplyDecoder | None:
    """A decoder for a reply's ``Content-Encoding`` (gzip, x-gzip, deflate, br, zstd).

    ``None`` for identity, no header, or a coding tokenward does not know (the body is metered as is).
    """
    name = (encoding or "").strip().lower()
    if name in ("gzip", "x-gzip"):
        return _Inflate(31)
    if name == "deflate":
        return _Inflate(None)
    if name == "br":
        return _Brotli()
    if name == "zstd":
        return _Zstd()
    return None


def _over(out: bytes | bytearray, room: int) -> None:
    if len(out) > room:
        raise DecodedTooLarge(f"decodes to more than {room:,} bytes")


class _Inflate:
    """gzip, or ``deflate`` as servers send it: zlib-wrapped, or raw deflate from a few old servers."""

    def __init__(self, wbits: int | None) -> None:
        self._wbits = wbits
        self._inner: Any = None

    def decode(self, data: bytes, room: int) -> bytes:
        if self._inner is None:
            if not data:
                return b""
            wbits = self._wbits
            if wbits is None:  # zlib-wrapped deflate starts with 0x78
                wbits = zlib.MAX_WBITS if data[:1] == b"\x78" else -zlib.MAX_WBITS
            self._inner = zlib.decompressobj(wbits=wbits)
        out = self._inner.decompress(data, room + 1)  # at most room + 1 bytes, the rest kept unread
        _over(out, room)
        return out  # type: ignore[no-any-return]


class _Brotli:
    def __init__(self) -> None:
        import brotli

        self._inner = brotli.Decompressor()

    def decode(self, data: bytes, room: int) -> bytes:
        inner = self._inner
        out = bytearray()
        for start in range(0, max(len(data), 1), _PIECE):
            out += inner.process(data[start : start + _PIECE], output_buffer_limit=room + 1 - len(out))
            _over(out, room)
            while not inner.can_accept_more_data():
                out += inner.process(b"", output_buffer_limit=room + 1 - len(out))
                _over(out, room)
        return bytes(out)


class _Sink:
    """Where zstd writes what it decodes; refuses to grow past its room."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.room = 0

    def write(self, data: bytes) -> int:
        self.out += data
        _over(self.out, self.room)
        return len(data)


class _Zstd:
    def __init__(self) -> None:
        import zstandard

        self._sink = _Sink()
        self._inner = zstandard.ZstdDecompressor().stream_writer(self._sink, write_size=_ZSTD_WRITE, closefd=False)

    def decode(self, data: bytes, room: int) -> bytes:
        sink = self._sink
        sink.out, sink.room = bytearray(), room
        self._inner.write(data)  # hands over each _ZSTD_WRITE bytes as decoded: stopped once past room
        return bytes(sink.out)
