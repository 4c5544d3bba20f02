"""Price catalog: YAML price tables loaded into validated, frozen entries.

File format (see ``pricing/catalog/default.yaml``)::

    entries:
      - id: openai/gpt-4o            # unique, conventionally <provider>/<model>
        provider: openai
        model: gpt-4o
        aliases: [gpt-4o-2024-08-06] # other served names billed at these rates
        input: 2.50                  # USD per 1M tokens
        cached_input: 1.25
        output: 10.00
        source: https://...          # where the rates were read
        checked: 2026-08-21          # when they were last checked there

Rates are USD per 1M tokens (``web_search``: USD per call). They are read as exact decimals
(the YAML float ``0.15`` becomes ``Decimal("0.15")``, never a binary float) and may carry at most
six decimal places, so that every cost fits the ledger's 12-decimal column exactly.

Optional rates and their defaults: ``cached_input`` -> ``input`` (no cache discount),
``cache_write`` -> ``input``, ``cache_write_1h`` -> ``cache_write``, ``audio_input`` -> ``input``,
``audio_output`` -> ``output``, ``web_search`` -> 0 only when the provider states search is free,
otherwise leave it out and searches are listed as unpriced calls by :mod:`tokenward.pricing.cost`.

Later files override earlier ones entry by entry (same ``id``), so a user's file can correct or
add prices without copying the built-in catalog.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "CatalogError",
    "PriceCatalog",
    "PriceEntry",
    "Resolution",
    "default_catalog_path",
    "load_catalog",
]

_RATE_FIELDS = (
    "input",
    "cached_input",
    "cache_write",
    "cache_write_1h",
    "output",
    "audio_input",
    "audio_output",
    "web_search",
)
_KNOWN_FIELDS = frozenset({"id", "provider", "model", "aliases", "source", "checked", "note", *_RATE_FIELDS})
_MAX_RATE_DECIMALS = 6
_SNAPSHOT_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8})$")


class CatalogError(ValueError):
    """A price file is malformed; the message names the file, the entry and the field."""


@dataclass(frozen=True, slots=True)
class PriceEntry:
    """Rates for one model at one provider, in USD per 1M tokens (``web_search``: USD per call).

    Built by :func:`load_catalog`, which fills the documented defaults, so every rate except
    ``web_search`` is a ``Decimal`` here.
    """

    id: str
    provider: str
    model: str
    input: Decimal
    cached_input: Decimal
    cache_write: Decimal
    cache_write_1h: Decimal
    output: Decimal
    audio_input: Decimal
    audio_output: Decimal
    web_search: Decimal | None
    source: str
    checked: dt.date
    aliases: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True, slots=True)
class Resolution:
    """Which entry prices a served model, and by which rule it was found.

    ``how`` is one of ``exact`` (provider and model match), ``alias`` (a listed alias),
    ``vendor_prefix`` (``openai/gpt-4o`` served by a reseller, priced as the vendor's model),
    ``other_provider`` (the same model name listed under another provider) or ``snapshot``
    (a dated snapshot such as ``o1-2024-12-17`` priced as its base model ``o1``).
    """

    entry: PriceEntry
    how: str


@dataclass(slots=True)
class PriceCatalog:
    """Price entries indexed for :meth:`resolve`; build it with :func:`load_catalog`."""

    entries: dict[str, PriceEntry] = field(default_factory=dict)
    _by_name: dict[tuple[str, str], tuple[PriceEntry, str]] = field(default_factory=dict, repr=False)
    _by_model: dict[str, PriceEntry] = field(default_factory=dict, repr=False)
    _cache: dict[tuple[str, str | None], Resolution | None] = field(default_factory=dict, repr=False)

    def add(self, entry: PriceEntry) -> None:
        """Insert or replace an entry (same ``id`` replaces) and rebuild the indexes."""
        self.entries[entry.id] = entry
        self._reindex()

    def _reindex(self) -> None:
        self._by_name.clear()
        self._by_model.clear()
        self._cache.clear()
        for entry in self.entries.values():
            names = [(entry.model, "exact")] + [(alias, "alias") for alias in entry.aliases]
            for name, how in names:
                self._by_name.setdefault((entry.provider, name.lower()), (entry, how))
                self._by_model.setdefault(name.lower(), entry)

    def resolve(self, model: str | None, provider: str | None = None) -> Resolution | None:
        """Find the entry that prices ``model`` as served by ``provider``.

        Args:
            model: the served model name (the response's ``model``), matched case-insensitively.
            provider: the catalog provider of the upstream that served it, if known.

        Returns:
            The entry and the rule that found it, or ``None`` when the model is unpriced.
            Rules are tried in order: provider + name, vendor prefix, any provider, and then
            the same three for the name without a ``-YYYY-MM-DD``/``-YYYYMMDD`` snapshot suffix.
        """
        if not model:
            return None
        key = (model, provider)
        if key not in self._cache:
            self._cache[key] = self._resolve(model.lower(), provider)
        return self._cache[key]

    def _resolve(self, name: str, provider: str | None) -> Resolution | None:
        found = self._lookup(name, provider)
        if found is not None:
            return found
        base = _SNAPSHOT_SUFFIX.sub("", name)
        if base != name:
            found = self._lookup(base, provider)
            if found is not None:
                return Resolution(found.entry, "snapshot")
        return None

    def _lookup(self, name: str, provider: str | None) -> Resolution | None:
        if provider is not None and (provider, name) in self._by_name:
            entry, how = self._by_name[(provider, name)]
            return Resolution(entry, how)
        vendor, sep, rest = name.partition("/")
        if sep and (vendor, rest) in self._by_name:
            return Resolution(self._by_name[(vendor, rest)][0], "vendor_prefix")
        if name in self._by_model:
            return Resolution(self._by_model[name], "other_provider")
        return None


def default_catalog_path() -> Path:
    """Path of the built-in catalog shipped inside the package."""
    return Path(str(resources.files("tokenward.pricing") / "catalog" / "default.yaml"))


def load_catalog(paths: Iterable[str | Path] = (), *, builtin: bool = True) -> PriceCatalog:
    """Load the built-in catalog, then each file in ``paths`` in order; later entries win.

    Args:
        paths: extra price files.
        builtin: start from the built-in catalog (false: only ``paths``).

    Raises:
        CatalogError: a file is unreadable, not YAML, or an entry is invalid; the message
            names the file, the entry id and the field.
    """
    catalog = PriceCatalog()
    files = [default_catalog_path()] if builtin else []
    for path in (*files, *map(Path, paths)):
        for entry in _read_file(path):
            catalog.entries[entry.id] = entry
    catalog._reindex()
    return catalog


class _DecimalLoader(yaml.SafeLoader):
    """SafeLoader that reads YAML floats as exact ``Decimal`` values."""


def _construct_decimal(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Decimal:
    text = str(loader.construct_scalar(node)).replace("_", "")
    try:
        return Decimal(text)
    except ArithmeticError as exc:
        raise yaml.constructor.ConstructorError(None, None, f"not a decimal number: {text!r}", node.start_mark) from exc


_DecimalLoader.add_constructor("tag:yaml.org,2002:float", _construct_decimal)


def _read_file(path: Path) -> list[PriceEntry]:
    try:
        document = yaml.load(path.read_text(encoding="utf-8"), Loader=_DecimalLoader)  # noqa: S506
    except (OSError, yaml.YAMLError) as exc:
        raise CatalogError(f"{path}: cannot read price file: {exc}") from exc
    if not isinstance(document, Mapping) or not isinstance(document.get("entries"), list):
        raise CatalogError(f"{path}: expected a mapping with an 'entries' list")
    entries = []
    seen: set[str] = set()
    for index, raw in enumerate(document["entries"]):
        entry = _parse_entry(path, index, raw)
        if entry.id in seen:
            raise CatalogError(f"{path}: entry {entry.id!r}: duplicate id")
        seen.add(entry.id)
        entries.append(entry)
    return entries


def _parse_entry(path: Path, index: int, raw: Any) -> PriceEntry:
    if not isinstance(raw, Mapping):
        raise CatalogError(f"{path}: entry #{index}: expected a mapping")
    label = str(raw.get("id", f"#{index}"))

    def fail(field_name: str, problem: str) -> CatalogError:
        return CatalogError(f"{path}: entry {label!r}: field {field_name!r}: {problem}")

    unknown = sorted(set(raw) - _KNOWN_FIELDS)
    if unknown:
        raise fail(unknown[0], "unknown field")
    for name in ("id", "provider", "model", "source"):
        if not isinstance(raw.get(name), str) or not raw[name].strip():
            raise fail(name, "required, a non-empty string")
    checked = raw.get("checked")
    if not isinstance(checked, dt.date):
        raise fail("checked", "required, a date (YYYY-MM-DD)")
    aliases = raw.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise fail("aliases", "must be a list of strings")

    rates: dict[str, Decimal | None] = {}
    for name in _RATE_FIELDS:
        value = raw.get(name)
        if value is None:
            rates[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int | Decimal):
            raise fail(name, f"must be a number (USD per 1M tokens), got {value!r}")
        rate = Decimal(value)
        if not rate.is_finite() or rate < 0:
            raise fail(name, f"must be a finite number >= 0, got {value}")
        if -rate.normalize().as_tuple().exponent > _MAX_RATE_DECIMALS:  # type: ignore[operator]
            raise fail(name, f"at most {_MAX_RATE_DECIMALS} decimal places, got {value}")
        rates[name] = rate
    if rates["input"] is None or rates["output"] is None:
        raise fail("input" if rates["input"] is None else "output", "required")

    base_input, base_output = rates["input"], rates["output"]
    cache_write = rates["cache_write"] if rates["cache_write"] is not None else base_input
    return PriceEntry(
        id=raw["id"],
        provider=raw["provider"].lower(),
        model=raw["model"],
        aliases=tuple(aliases),
        input=base_input,
        cached_input=rates["cached_input"] if rates["cached_input"] is not None else base_input,
        cache_write=cache_write,
        cache_write_1h=rates["cache_write_1h"] if rates["cache_write_1h"] is not None else cache_write,
        output=base_output,
        audio_input=rates["audio_input"] if rates["audio_input"] is not None else base_input,
        audio_output=rates["audio_output"] if rates["audio_output"] is not None else base_output,
        web_search=rates["web_search"],
        source=raw["source"],
        checked=checked,
        note=str(raw.get("note", "")),
    )
