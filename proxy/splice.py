r"""Byte-exact edits of one top-level JSON member: find it, replace its value, remove it, add one.

tokenward edits two JSON documents it relays: the request body (``stream_options.include_usage``)
and, on the way back, the stream chunks that carry the usage it asked for. Decoding and
re-encoding would change bytes the client or the provider chose (key order, spacing, ``\u``
escapes, number spelling), so these functions splice instead: everything outside the edited
member is kept byte for byte.

The scan jumps from string to string and bracket to bracket with one regex (strings are skipped
whole, so a ``{`` or a key name inside a string is never mistaken for structure). It assumes a
valid JSON object (callers have decoded it once already) and returns ``None`` when it cannot find
its way, so that the caller can fall back to re-encoding. Sans-IO; stdlib and msgspec only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

__all__ = ["Member", "find_member", "remove_member", "set_member"]

# A string as runs of plain bytes between escapes ("unrolled"): `"(?:[^"\\]|\\.)*"` takes one
# backtracking frame per byte in Python's re (3.8 GB and 3.8 s for a 32 MiB string); this takes
# one per escape.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]]', re.DOTALL)
_COLON = re.compile(rb"\s*:\s*")
_SCALAR = re.compile(rb"[^,}\]\s]+")
_SPACE = re.compile(rb"\s*")


@dataclass(frozen=True, slots=True)
class Member:
    """Where a member is in the document: its key's first byte, and its value's ``[start, end)``."""

    key_start: int
    value_start: int
    value_end: int


def _object_start(doc: bytes, start: int) -> int | None:
    index = _SPACE.match(doc, start).end()  # type: ignore[union-attr]  # \s* always matches
    return index if doc[index : index + 1] == b"{" else None


def find_member(doc: bytes, name: str, start: int = 0) -> Member | None:
    """The last member ``name`` of the JSON object that begins at ``doc[start:]`` (after spaces).

    The last one, because JSON parsers that accept repeated keys keep the last value.
    Returns ``None`` when there is no such member or ``doc`` is not an object there.
    """
    opening = _object_start(doc, start)
    if opening is None:
        return None
    found: Member | None = None
    depth = 1
    pos = opening + 1
    while (token := _TOKEN.search(doc, pos)) is not None:
        first = doc[token.start()]
        pos = token.end()
        if first == 0x22:  # a string: a key when at depth 1 and followed by ':'
            if depth == 1 and (colon := _COLON.match(doc, pos)) is not None and _key(token.group()) == name:
                value_end = _value_end(doc, colon.end())
                if value_end is None:
                    return None
                found = Member(token.start(), colon.end(), value_end)
                pos = value_end
        elif first in b"{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return found
    return None  # unterminated


def remove_member(doc: bytes, name: str, start: int = 0) -> bytes | None:
    """``doc`` without member ``name`` (and one comma next to it); ``None`` when it has none."""
    member = find_member(doc, name, start)
    if member is None:
        return None
    before = member.key_start - 1
    while doc[before] in b" \t\r\n":
        before -= 1
    if doc[before] == 0x2C:  # a comma before: "...,<ws>"key":value" goes
        return _joined(doc, (0, before), (member.value_end, len(doc)))
    after = _SPACE.match(doc, member.value_end).end()  # type: ignore[union-attr]
    if doc[after] == 0x2C:  # the first member: "key":value,<ws>" goes
        rest = _SPACE.match(doc, after + 1).end()  # type: ignore[union-attr]
        return _joined(doc, (0, member.key_start), (rest, len(doc)))
    return _joined(doc, (0, member.key_start), (member.value_end, len(doc)))


def set_member(doc: bytes, name: str, value: bytes, start: int = 0) -> bytes | None:
    """``doc`` with member ``name`` of the object at ``doc[start:]`` set to the JSON ``value``.

    An existing member's value is replaced in place; a new member goes first in the object.
    Returns ``None`` when there is no object at ``start``.
    """
    opening = _object_start(doc, start)
    if opening is None:
        return None
    member = find_member(doc, name, opening)
    if member is not None:
        return _joined(doc, (0, member.value_start), value, (member.value_end, len(doc)))
    inside = _SPACE.match(doc, opening + 1).end()  # type: ignore[union-attr]
    comma = b"" if doc[inside : inside + 1] == b"}" else b","
    return _joined(doc, (0, opening + 1), msgspec.json.encode(name) + b":" + value + comma, (opening + 1, len(doc)))


def _joined(doc: bytes, *parts: tuple[int, int] | bytes) -> bytes:
    """``doc``'s ``(start, end)`` ranges and literal ``bytes`` in order, in one copy.

    Slicing bytes copies, and ``a + b + c`` copies again: a 32 MiB body would be held three times.
    """
    view = memoryview(doc)
    return b"".join(part if isinstance(part, bytes) else view[part[0] : part[1]] for part in parts)


def _key(raw: bytes) -> str:
    if b"\\" not in raw:
        return raw[1:-1].decode("utf-8", "replace")
    decoded: str = msgspec.json.decode(raw)
    return decoded


def _value_end(doc: bytes, start: int) -> int | None:
    first = doc[start : start + 1]
    if first == b'"':
        token = _TOKEN.match(doc, start)
        return token.end() if token else None
    if first in (b"{", b"["):
        depth = 0
        for token in _TOKEN.finditer(doc, start):
            if doc[token.start()] == 0x22:
                continue
            depth += 1 if doc[token.start()] in b"{[" else -1
            if depth == 0:
                return token.end()
        return None
    scalar = _SCALAR.match(doc, start)
    return scalar.end() if scalar else None
