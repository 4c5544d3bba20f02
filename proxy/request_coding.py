"""Request bodies a client compressed (``Content-Encoding``), decoded within the body limit.

Clients compress large request bodies: the Codex CLI sends ``/v1/responses`` bodies with
``Content-Encoding: zstd`` (and gzip), and api.anthropic.com and OpenAI accept gzip-encoded
bodies. tokenward reads a metered request's JSON (model, limits, the ids it names, the text a
budget's bound counts), so it decodes such a body first and forwards the decoded bytes without the
header: the upstream reads the same JSON. Decoding is bounded: a body that would decode past the
limit is refused (413) as soon as the limit is passed, whatever its compression ratio. A body
isolation only checks (a passthrough request naming objects) is forwarded decoded as well: two
decoders (tokenward's and the upstream's) need not read one compressed body the same way. The whole
body is decoded as the upstream's decoder reads it: every member of a gzip body (RFC 1952; Python's,
Go's and aiohttp's readers join them) and every zstd frame; bytes after the end of a deflate or
brotli stream are refused (400), never left unread: a check that read only the first member of a
body forwarded as sent would pass whatever the members after it name.
"""

from __future__ import annotations

import io
import zlib
from typing import Any

from tokenward.proxy.errors import ProxyError

__all__ = ["decode_request_body", "request_encodings"]

_PIECE = 64 * 1024


def request_encodings(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """The codings of a request's ``Content-Encoding`` header(s), in the order applied (``identity`` left out)."""
    codings: list[str] = []
    for name, value in headers:
        if name.lower() == b"content-encoding":
            for coding in value.decode("latin-1").split(","):
                coding = coding.strip().lower()
                if coding and coding != "identity":
                    codings.append(coding)
    return codings


def decode_request_body(body: bytes, codings: list[str], limit: int) -> bytes:
    """``body`` with ``codings`` (gzip, x-gzip, deflate, br, zstd) undone, last applied first.

    Raises:
        ProxyError: 400 ``invalid_content_encoding`` for a coding tokenward does not know or a body
            that does not decode; 413 ``request_too_large`` when it decodes to more than ``limit`` bytes.
    """
    for coding in reversed(codings):
        try:
            body = _decode(body, coding, limit)
        except ProxyError:
            raise
        except Exception as exc:  # zlib, brotli and zstandard each raise their own error on a corrupt body
            raise _invalid(f"The request body is not valid {coding} ({type(exc).__name__}).") from exc
    return body


def _decode(body: bytes, coding: str, limit: int) -> bytes:
    if coding in ("gzip", "x-gzip", "deflate"):
        gzip = coding != "deflate"
        wbits = 31 if gzip else (zlib.MAX_WBITS if _zlib_header(body) else -zlib.MAX_WBITS)
        out = bytearray()
        pending = body
        while True:  # gzip: one member after another (RFC 1952 2.2), as every upstream's decoder reads them
            pending = _inflate(zlib.decompressobj(wbits=wbits), pending, out, coding, limit)
            if not gzip or not pending.strip(b"\x00"):  # zero padding after the last member, as gzip(1) allows
                break
        if pending and not gzip:
            raise _invalid("The request body is not valid deflate (bytes follow the end of its stream).")
        return bytes(out)
    if coding == "br":
        import brotli

        decoder = brotli.Decompressor()
        out = bytearray()
        for start in range(0, len(body), _PIECE):
            out += decoder.process(body[start : start + _PIECE], output_buffer_limit=limit + 1 - len(out))
            _check(out, limit)
            while not decoder.can_accept_more_data():
                out += decoder.process(b"", output_buffer_limit=limit + 1 - len(out))
                _check(out, limit)
        if not decoder.is_finished():
            raise _invalid("The request body is not valid br (it ends before its stream does).")
        return bytes(out)
    if coding == "zstd":
        import zstandard

        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            out = reader.read(limit + 1)
        _check(out, limit)
        return bytes(out)
    raise _invalid(f"Content-Encoding {coding!r} is not supported for request bodies (gzip, deflate, br, zstd are).")


def _zlib_header(body: bytes) -> bool:
    """Whether a ``deflate`` body starts with a zlib header, as zlib and aiohttp read it.

    RFC 1950 2.2: method 8, a window up to 32 KiB, the two header bytes a multiple of 31. Any other
    start is a raw deflate stream (as some clients send ``deflate``).
    """
    return len(body) >= 2 and body[0] & 0x0F == 8 and body[0] >> 4 <= 7 and ((body[0] << 8) | body[1]) % 31 == 0


def _inflate(inflate: Any, pending: bytes, out: bytearray, coding: str, limit: int) -> bytes:
    """Decode one zlib/gzip stream from ``pending`` into ``out`` (within ``limit``); returns the bytes after it."""
    while pending:
        out += inflate.decompress(pending, limit + 1 - len(out))
        _check(out, limit)
        pending = inflate.unconsumed_tail
        if inflate.eof:
            break
    if not inflate.eof:
        raise _invalid(f"The request body is not valid {coding} (it ends before its stream does).")
    return bytes(inflate.unused_data)


def _check(out: bytes | bytearray, limit: int) -> None:
    if len(out) > limit:
        raise ProxyError(
            413,
            f"The request body decodes to more than the {limit:,} bytes this tokenward accepts (server.max_body_mib).",
            "request_too_large",
        )


def _invalid(message: str) -> ProxyError:
    return ProxyError(400, message, "invalid_content_encoding")
