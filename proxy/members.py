"""JSON member names that one parser reads and another skips: refused before a request is sent.

tokenward reads a request body's members exactly as spelled (``model``, ``max_tokens``,
``messages[].content``, ...). Go's ``encoding/json`` (Ollama, LocalAI, Go relays and gateways)
matches member names to struct fields case-insensitively, a later match overwriting an earlier
one (https://pkg.go.dev/encoding/json#Unmarshal, checked 2026-12-01), and so do ASP.NET's web
defaults (``PropertyNameCaseInsensitive``). Given ``{"model": "gpt-4o-mini", "MODEL": "gpt-4o"}``
such an upstream serves gpt-4o where the budget's bound priced gpt-4o-mini, and a message's
``"Content"`` beside a short ``"content"`` is read instead of the text the bound counted. So an
object with two members whose names differ only in case is refused (400 ``invalid_json``) where
tokenward reads it:

* :func:`check_top_level` on every metered JSON body (about 2 us for 1.4 KB: values are skipped);
* :func:`check_document` on the decoded body whose texts a blocking budget's bound counts: every
  object but the shapes the client defines (JSON schemas, tool parameters and inputs,
  ``metadata``), where ``ID`` beside ``id`` is a legitimate pair of properties and the bound
  counts the whole shape as text anyway.

Members named twice with one spelling are read alike (the last one) by msgspec, tokenward's
splicer, Python, Go, JavaScript and .NET, so they pass. Sans-IO; msgspec only.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenward.proxy.errors import ProxyError

__all__ = ["check_document", "check_top_level", "top_level_members"]

_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_CLIENT_SHAPES = frozenset(
    {"parameters", "input_schema", "schema", "json_schema", "properties", "metadata", "arguments", "$defs"}
    | {"definitions"}
)
"""Members whose value is a shape the client defines: not looked into."""
_CONTAINERS = (dict, list)


def check_top_level(body: bytes) -> None:
    """Refuse a JSON object body whose top-level member names clash ignoring case (not an object: no check).

    Raises:
        ProxyError: 400 ``invalid_json`` naming both spellings.
    """
    try:
        names = _decode_members(body)
    except (msgspec.DecodeError, RecursionError):  # not an object: whoever decodes it says why
        return
    _check(names)


def top_level_members(body: bytes) -> dict[str, msgspec.Raw]:
    """A JSON object body's top-level members, their values unparsed, once :func:`check_top_level`'s check passed.

    One scan of the body serves both the check and the reading of the members tokenward acts on.

    Raises:
        msgspec.ValidationError: the body is JSON but not an object.
        msgspec.DecodeError: the body is not JSON.
        ProxyError: 400 ``invalid_json`` naming both spellings of a clashing member.
    """
    members = _decode_members(body)
    _check(members)
    return members


def check_document(document: Any) -> None:
    """Refuse a decoded body with an object (outside client-defined shapes) whose member names clash ignoring case.

    A tool call's ``input`` object (Anthropic's ``tool_use``) is the client's shape too; an
    ``input`` list (the Responses API's items) is looked into.

    Raises:
        ProxyError: 400 ``invalid_json`` naming both spellings.
    """
    stack = [document] if type(document) in _CONTAINERS else []
    push = stack.append
    while stack:
        node = stack.pop()
        if type(node) is list:
            for item in node:
                if type(item) in _CONTAINERS:
                    push(item)
            continue
        # names without an upper-case letter cannot clash: "".join(...).islower() tells in C
        if len(node) > 1 and not "".join(node).islower():
            _check(node)
        for name, value in node.items():
            kind = type(value)
            if kind in _CONTAINERS and name not in _CLIENT_SHAPES and (kind is list or name != "input"):
                push(value)


def _check(names: dict[str, Any]) -> None:
    if len(names) == len({name.lower() for name in names}):
        return
    seen: dict[str, str] = {}
    for name in names:
        first = seen.setdefault(name.lower(), name)
        if first != name:
            raise ProxyError(
                400,
                f"The JSON body of your request names the member {first!r} twice, once as {name!r}: upstreams that "
                "match member names ignoring case would read the other one. Spell each member once.",
                "invalid_json",
            )
