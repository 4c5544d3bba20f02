"""Bounded reading of a ``multipart/form-data`` request body (image edits, audio uploads).

The metered endpoints hold their body in memory, up to ``server.max_body_mib``
(:func:`tokenward.proxy.limits.read_body`); this module reads what metering needs from such a
body without copying its files: the text fields (``model``, ``n``, ``size``, ``prompt``, ...) and
the name, type and size of each file part. The body itself is forwarded untouched.

Parsing is done by ``multipart``'s ``PushMultipartParser`` (the sans-IO parser Litestar and Bottle
use), fed in 64 KiB pieces, so a boundary split across pieces is found like any other and no
piece of a file is held twice. Limits on top of the body's size: at most :data:`MAX_PARTS` parts,
part headers of at most 4 KiB (8 lines), a text field of at most :data:`MAX_FIELD_BYTES` (the
longest prompt the image endpoints take is 32,000 characters) and :data:`MAX_TEXT_BYTES` of text
fields in all. Anything else is a :class:`FormError` (HTTP 400 ``invalid_multipart``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from multipart import MultipartError, MultipartSegment, PushMultipartParser, parse_options_header

__all__ = [
    "MAX_FIELD_BYTES",
    "MAX_PARTS",
    "MAX_TEXT_BYTES",
    "FilePart",
    "Form",
    "FormError",
    "boundary_of",
    "read_form",
]

MAX_PARTS = 64
MAX_FIELD_BYTES = 256 * 1024
MAX_TEXT_BYTES = 1024 * 1024
_PIECE = 64 * 1024


class FormError(ValueError):
    """The body is not a well-formed ``multipart/form-data`` body within the limits (the message says why)."""


@dataclass(frozen=True, slots=True)
class FilePart:
    """One file in a form: its field ``name``, ``filename``, ``content_type`` and ``size`` in bytes."""

    name: str
    filename: str
    content_type: str
    size: int


@dataclass(slots=True)
class Form:
    """What a form holds: text ``fields`` by name (the last value of a repeated name) and its ``files``.

    ``pairs``: every text field as ``(name, value)``, in order, repeated names included.
    """

    fields: dict[str, str] = field(default_factory=dict)
    files: list[FilePart] = field(default_factory=list)
    pairs: list[tuple[str, str]] = field(default_factory=list)

    def files_named(self, *names: str) -> list[FilePart]:
        """The files sent under any of ``names`` (``image`` and ``image[]`` are one field to OpenAI)."""
        return [f for f in self.files if f.name in names]


def boundary_of(content_type: str) -> str | None:
    """The boundary of a ``multipart/form-data`` content type, or ``None`` for any other type."""
    kind, options = parse_options_header(content_type)
    if kind.lower() != "multipart/form-data":
        return None
    return options.get("boundary") or None


def read_form(body: bytes, content_type: str) -> Form:
    """Read the fields and file sizes of a ``multipart/form-data`` ``body``.

    Raises:
        FormError: not multipart/form-data, no boundary, malformed, truncated, or over a limit.
    """
    boundary = boundary_of(content_type)
    if boundary is None:
        raise FormError("expected a multipart/form-data body with a boundary")
    form = Form()
    text_bytes = 0
    current: MultipartSegment | None = None
    size = 0
    chunks: list[bytes] = []
    try:
        with PushMultipartParser(boundary, content_length=len(body), max_segment_count=MAX_PARTS) as parser:
            view = memoryview(body)
            for start in range(0, max(len(body), 1), _PIECE):
                for event in parser.parse(bytes(view[start : start + _PIECE])):
                    if isinstance(event, MultipartSegment):
                        current, size, chunks = event, 0, []
                    elif event is None:
                        assert current is not None
                        if current.filename is not None:
                            kind = current.content_type or "application/octet-stream"
                            form.files.append(FilePart(current.name, current.filename, kind, size))
                        else:
                            text = b"".join(chunks).decode("utf-8", "replace")
                            form.fields[current.name] = text
                            form.pairs.append((current.name, text))
                        current = None
                    else:
                        assert current is not None
                        size += len(event)
                        if current.filename is None:
                            text_bytes += len(event)
                            if size > MAX_FIELD_BYTES or text_bytes > MAX_TEXT_BYTES:
                                raise FormError(f"form field {current.name!r} is longer than the proxy reads")
                            chunks.append(event)
    except MultipartError as exc:
        raise FormError(f"the multipart/form-data body is malformed: {exc}") from None
    if not parser.closed or parser.error is not None:
        raise FormError("the multipart/form-data body ends before its closing boundary")
    return form
