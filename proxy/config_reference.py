"""The configuration reference (``docs/config-reference.md``), generated from the schema.

The schema is the msgspec structs themselves (:class:`tokenward.proxy.config.Config` and the
sections it holds, wherever they live): every option's name, type, default and bounds come
from ``msgspec.inspect``, and each section's prose from its class docstring. So the reference
cannot miss an option or show a stale default; ``tests/test_config_reference.py`` checks the
committed file is what :func:`render` makes today. ``tokenward config reference -o FILE``
writes it.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi

from tokenward.proxy.config import Config

__all__ = ["Option", "options", "render"]


@dataclass(frozen=True, slots=True)
class Option:
    """One configuration option: its dotted path (``[]`` marks list items), type, default, bounds."""

    path: str
    type: str
    default: str
    bounds: str
    section: str


@dataclass(frozen=True, slots=True)
class _Section:
    path: str
    cls: type


def options(root: type = Config) -> list[Option]:
    """Every leaf option under ``root``, depth first in declaration order."""
    found: list[Option] = []
    for section in _sections(root):
        found += _section_options(section)
    return found


def render(root: type = Config) -> str:
    """The reference as Markdown: one part per section, its prose, then a table of its options."""
    lines = [
        "# Configuration reference",
        "",
        "Every option of tokenward's YAML configuration file, generated from the schema by",
        "`tokenward config reference -o docs/config-reference.md` (do not edit by hand).",
        "`config.example.yaml` shows them in use. `[]` marks the items of a list: `upstreams[].name`",
        "is the `name` of each entry under `upstreams:`. Durations are seconds (`_s`) or hours (`_hours`),",
        "money is USD. Unknown options are errors.",
        "",
    ]
    for section in _sections(root):
        title = section.path or "top level"
        lines += [f"## `{title}`" if section.path else f"## {title}", ""]
        prose = _prose(section.cls)
        if prose:
            lines += [prose, ""]
        rows = _section_options(section)
        if rows:
            lines += ["| option | type | default | bounds |", "|---|---|---|---|"]
            for option in rows:
                cells = [f"`{option.path}`", option.type, option.default, option.bounds]
                lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
            lines.append("")
    return "\n".join(lines)


def _sections(root: type, path: str = "") -> list[_Section]:
    result = [_Section(path, root)]
    for field in _fields(root):
        struct, is_list = _struct_of(field.type)
        if struct is not None:
            result += _sections(struct, _join(path, field.name, is_list))
    return result


def _section_options(section: _Section) -> list[Option]:
    found = []
    for field in _fields(section.cls):
        if _struct_of(field.type)[0] is not None:
            continue
        path = f"{section.path}.{field.name}" if section.path else field.name
        found.append(Option(path, _type(field.type), _default(field), _bounds(field.type), section.path))
    return found


def _fields(cls: type) -> tuple[mi.Field, ...]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info.fields


def _struct_of(t: mi.Type) -> tuple[type | None, bool]:
    """The struct class a field holds (directly, optionally or as list items), and whether in a list."""
    if isinstance(t, mi.UnionType):
        structs = [u for u in t.types if isinstance(u, mi.StructType)]
        return (structs[0].cls, False) if structs else (None, False)
    if isinstance(t, mi.StructType):
        return t.cls, False
    if isinstance(t, mi.ListType) and isinstance(t.item_type, mi.StructType):
        return t.item_type.cls, True
    return None, False


def _join(prefix: str, name: str, is_list: bool) -> str:
    return (f"{prefix}.{name}" if prefix else name) + ("[]" if is_list else "")


def _type(t: mi.Type) -> str:
    if isinstance(t, mi.UnionType):
        others = [u for u in t.types if not isinstance(u, mi.NoneType)]
        text = " or ".join(_type(u) for u in others)
        return text + " or null" if len(others) < len(t.types) else text
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(f"`{v}`" for v in sorted(t.values, key=str))
    if isinstance(t, mi.ListType):
        return f"list of {_type(t.item_type)}"
    if isinstance(t, mi.DictType):
        return f"mapping of {_type(t.key_type)} to {_type(t.value_type)}"
    names = {
        mi.StrType: "string",
        mi.IntType: "integer",
        mi.FloatType: "number",
        mi.BoolType: "boolean",
        mi.DecimalType: "decimal",
        mi.AnyType: "any",
    }
    return names.get(type(t), type(t).__name__.removesuffix("Type").lower())


def _bounds(t: mi.Type) -> str:
    if isinstance(t, mi.UnionType):
        return "; ".join(filter(None, (_bounds(u) for u in t.types)))
    if isinstance(t, mi.ListType):
        inner = _bounds(t.item_type)
        return f"each {inner}" if inner else ""
    parts = []
    for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        value = getattr(t, attr, None)
        if value is not None:
            parts.append(f"{symbol} {value}")
    if getattr(t, "min_length", None):
        parts.append(f"at least {t.min_length} character{'s' if t.min_length != 1 else ''}")  # type: ignore[attr-defined]
    if getattr(t, "pattern", None):
        parts.append(f"matches `{t.pattern}`")  # type: ignore[attr-defined]
    return ", ".join(parts)


def _default(field: mi.Field) -> str:
    if field.required:
        return "**required**"
    value: Any = field.default
    if value is msgspec.NODEFAULT:
        value = field.default_factory()  # type: ignore[misc]
    return f"`{json.dumps(msgspec.to_builtins(value))}`"


def _prose(cls: type) -> str:
    """A class docstring as Markdown (reST inline literals and cross references simplified)."""
    text = inspect.cleandoc(cls.__doc__ or "")
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([\w]+)`", r"`\1`", text)
    text = re.sub(r"``(.+?)``", r"`\1`", text, flags=re.S)
    return text.replace("::\n", ":\n")
