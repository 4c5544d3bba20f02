"""Config validation messages that say what to write instead.

msgspec's messages name the place (``- at `$.budgets[0].period```) but not what it accepts:
``Invalid enum value 'daily'`` leaves the user to find the choices, ``Object contains unknown
field `limt_usd``` to spot the typo. :func:`explain` adds that, read from the schema itself
(``msgspec.inspect``), so the hint can never disagree with what the loader accepts.
"""

from __future__ import annotations

import difflib
import re

import msgspec.inspect as mi
import yaml

__all__ = ["explain", "line_of"]

_AT = re.compile(r" - at `(?P<path>\$[^`]*)`$")
_STEP = re.compile(r"\.(?P<field>[A-Za-z_][A-Za-z0-9_]*)|\[(?P<index>[^\]]*)\]")
_ENUM = re.compile(r"^Invalid enum value ")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`")


def explain(message: str, root: type) -> str:
    """``message`` (a msgspec validation error against ``root``) with what the place accepts.

    An invalid choice gets ``; expected one of a, b, c``; an unknown field gets ``; did you mean
    `x`?`` when one is close, else the fields the section takes. Any other message, or a path the
    schema does not lead to, is returned unchanged.
    """
    at = _AT.search(message)
    path = at.group("path") if at else "$"
    head = message[: at.start()] if at else message
    node = _walk(mi.type_info(root), path)
    if node is None:
        return message
    hint = None
    if _ENUM.match(head):
        choices = _choices(node)
        if choices:
            hint = "expected one of " + ", ".join(choices)
    elif (unknown := _UNKNOWN.match(head)) is not None:
        fields = _struct_fields(node)
        if fields:
            close = difflib.get_close_matches(unknown.group("name"), fields, n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`?" if close else "this section takes " + ", ".join(fields)
    return f"{message}; {hint}" if hint else message


def _walk(node: mi.Type, path: str) -> mi.Type | None:
    """The schema node at a msgspec path such as ``$.budgets[0].period``, or ``None``."""
    rest = path[1:]
    while rest:
        step = _STEP.match(rest)
        if step is None:
            return None
        rest = rest[step.end() :]
        node = _container(node)
        if step.group("field") is not None:
            if not isinstance(node, mi.StructType):
                return None
            found = next((f for f in node.fields if f.encode_name == step.group("field")), None)
            if found is None:
                return None
            node = found.type
        elif isinstance(node, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
            node = node.item_type
        elif isinstance(node, mi.DictType):
            node = node.value_type
        else:
            return None
    return node


def _container(node: mi.Type) -> mi.Type:
    """A union's one struct, list or mapping member (``X | None``); any other node as it is."""
    if isinstance(node, mi.Metadata):
        node = node.type
    if isinstance(node, mi.UnionType):
        members = [t for t in node.types if not isinstance(t, mi.NoneType | mi.LiteralType)]
        if len(members) == 1:
            return members[0]
    return node


def _choices(node: mi.Type) -> list[str]:
    """The values a literal (or enum, optionally ``None``) field accepts, in schema order."""
    node = node.type if isinstance(node, mi.Metadata) else node
    members = node.types if isinstance(node, mi.UnionType) else (node,)
    values: list[str] = []
    for member in members:
        if isinstance(member, mi.LiteralType):
            values.extend(str(v) for v in member.values)
        elif isinstance(member, mi.EnumType):
            values.extend(str(e.value) for e in member.cls)
    return values


def _struct_fields(node: mi.Type) -> list[str]:
    node = _container(node)
    return [f.encode_name for f in node.fields] if isinstance(node, mi.StructType) else []


def line_of(text: str, message: str) -> int | None:
    """The line (1-based) of ``text``, a YAML document, that ``message``'s ``- at `$...``` path names.

    An unknown field's message points at that field's own key, not at its section. ``None`` when
    the message names no path, the path is the whole document, or the document does not hold it
    (a missing section). Never raises: a document that does not compose gives ``None``.
    """
    at = _AT.search(message)
    unknown = _UNKNOWN.match(message[: at.start()] if at else message)
    if at is None and unknown is None:  # an unknown top-level field's message names no path
        return None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    steps: list[str | int] = []
    for step in _STEP.finditer(at.group("path") if at else "$"):
        field, index = step.group("field"), step.group("index")
        steps.append(field if field is not None else int(index) if index.isdigit() else index)
    if unknown is not None:
        steps.append(unknown.group("name"))
    line = None
    for step in steps:
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if getattr(k, "value", None) == step), None)
            if pair is None:
                return None
            line, node = pair[0].start_mark.line + 1, pair[1]  # where the field's key is written
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
            node = node.value[step]
            line = node.start_mark.line + 1
        else:
            return None
    return line
