"""Converting other price formats into tokenward price entries (pure: parsed data in, entries out).

* LiteLLM's ``model_prices_and_context_window.json``: USD per token, with
  ``*_above_<N>k_tokens`` context cliffs, ``*_priority``/``*_flex``/``*_batches`` service tiers,
  ``tiered_pricing`` range lists (DashScope) and ``search_context_cost_per_query``.
* Price sheets (field case B23): rows of ``provider, model, component, unit, price`` where
  ``unit`` is ``token``, ``1K`` or ``1M`` tokens (or ``call`` for per-call fees); every price is
  normalised to USD per 1M tokens.

Both return plain entry mappings in the price-file shape (see :mod:`tokenward.pricing.catalog`),
validated by :func:`tokenward.pricing.catalog.parse_entry` when loaded; :func:`to_yaml` writes
them as a price file whose decimals read back exactly.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

import yaml

__all__ = ["LITELLM_PROVIDERS", "from_litellm", "from_sheet", "to_yaml"]

LITELLM_PROVIDERS = {
    "openai": "openai",
    "text-completion-openai": "openai",
    "anthropic": "anthropic",
    "gemini": "google",
    "deepseek": "deepseek",
    "mistral": "mistral",
    "xai": "xai",
    "groq": "groq",
    "dashscope": "qwen",
    "moonshot": "moonshot",
    "cerebras": "cerebras",
    "together_ai": "together",
    "fireworks_ai": "fireworks",
    "azure": "azure",
    "bedrock": "bedrock",
    "vertex_ai-language-models": "vertex",
    "openrouter": "openrouter",
    "voyage": "voyage",
    "zai": "zai",
}
"""LiteLLM ``litellm_provider`` values and the provider names tokenward uses for them."""

_RATE_KEYS = {
    "input_cost_per_token": "input",
    "output_cost_per_token": "output",
    "cache_read_input_token_cost": "cached_input",
    "input_cost_per_token_cache_hit": "cached_input",
    "cache_creation_input_token_cost": "cache_write",
    "cache_creation_input_token_cost_above_1hr": "cache_write_1h",
    "output_cost_per_reasoning_token": "reasoning",
    "input_cost_per_audio_token": "audio_input",
    "output_cost_per_audio_token": "audio_output",
    "input_cost_per_image_token": "image_input",
}
_LITELLM_KEY = re.compile(
    r"^(?P<base>" + "|".join(sorted(map(re.escape, _RATE_KEYS), key=len, reverse=True)) + r")"
    r"(?:_above_(?P<k>\d+)k_tokens)?(?:_(?P<tier>priority|flex|batches))?$"
)
_TIER_NAMES = {"priority": "priority", "flex": "flex", "batches": "batch"}
_MODES = frozenset({"chat", "completion", "embedding", "responses"})
_UNITS = {"token": Decimal(1_000_000), "1k": Decimal(1000), "1m": Decimal(1), "call": Decimal(1)}
_SIX = Decimal("0.000001")


def _per_million(value: Any, scale: Decimal = Decimal(1_000_000)) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal | str):
        return None
    try:
        number = Decimal(repr(value) if isinstance(value, float) else str(value)) * scale
    except ArithmeticError:
        return None
    if not number.is_finite() or number < 0:
        return None
    return number.quantize(_SIX, rounding=ROUND_HALF_EVEN).normalize()


def from_litellm(
    data: Mapping[str, Any],
    *,
    source: str,
    checked: dt.date,
    providers: Iterable[str] | None = None,
    effective: dt.datetime | None = None,
) -> list[dict[str, Any]]:
    """Entries for the chat, completion, embedding and responses models of a LiteLLM price map.

    Args:
        data: the parsed JSON document (model key -> properties).
        source: URL recorded as every entry's ``source`` (the entry's own cited page goes in ``note``).
        checked: the date the document was read.
        providers: keep only these tokenward provider names (``None``: every mapped provider).
        effective: set on every entry (for refreshes that add dated versions).

    Returns:
        Entry mappings, sorted by id. Keys LiteLLM prices per second, per image or per
        character, and tier/context combinations (``*_above_272k_tokens_priority``), are left out.
    """
    wanted = set(providers) if providers is not None else None
    entries: dict[str, dict[str, Any]] = {}
    for key, spec in sorted(data.items()):
        if not isinstance(spec, Mapping) or spec.get("mode") not in _MODES:
            continue
        provider = LITELLM_PROVIDERS.get(str(spec.get("litellm_provider")))
        if provider is None or (wanted is not None and provider not in wanted):
            continue
        prefix = f"{spec['litellm_provider']}/"
        model = key[len(prefix) :] if key.startswith(prefix) else key
        entry = _litellm_entry(provider, model, spec)
        if entry is None or entry["id"] in entries:  # two keys for one model (a prefixed alias): keep one
            continue
        cited = spec.get("source")
        entry.update(source=source, checked=checked)
        if cited:
            entry["note"] = f"imported from LiteLLM, which cites {cited}"
        if effective is not None:
            entry["effective"] = effective
        entries[entry["id"]] = entry
    return sorted(entries.values(), key=lambda e: e["id"])


def _litellm_entry(provider: str, model: str, spec: Mapping[str, Any]) -> dict[str, Any] | None:
    base: dict[str, Decimal] = {}
    cliffs: dict[int, dict[str, Decimal]] = {}
    tiers: dict[str, dict[str, Decimal]] = {}
    for key, value in spec.items():
        match = _LITELLM_KEY.match(key)
        if not match or match["k"] and match["tier"]:
            continue
        rate = _per_million(value)
        if rate is None:
            continue
        name = _RATE_KEYS[match["base"]]
        if match["k"]:
            cliffs.setdefault(int(match["k"]) * 1000, {})[name] = rate
        elif match["tier"]:
            tiers.setdefault(_TIER_NAMES[match["tier"]], {})[name] = rate
        else:
            base[name] = rate
    ranges = spec.get("tiered_pricing")
    if isinstance(ranges, list) and ranges and "input" not in base:
        ordered = sorted(
            (r for r in ranges if isinstance(r, Mapping) and isinstance(r.get("range"), list)),
            key=lambda r: r["range"][0],
        )
        for index, item in enumerate(ordered):
            rates = {_RATE_KEYS[k]: v for k, v in ((k, _per_million(item.get(k))) for k in _RATE_KEYS) if v is not None}
            if index == 0:
                base.update(rates)
            else:
                cliffs[int(item["range"][0])] = rates
    if "input" not in base:
        return None
    base.setdefault("output", Decimal(0))
    entry: dict[str, Any] = {"id": f"{provider}/{model}", "provider": provider, "model": model, **base}
    # a cliff or tier lists the rates it changes; the others stay at the base rates (LiteLLM's reading)
    if any(cliffs.values()):
        entry["context_tiers"] = [{"above": threshold, **rates} for threshold, rates in sorted(cliffs.items()) if rates]
    if any(tiers.values()):
        entry["service_tiers"] = {name: rates for name, rates in sorted(tiers.items()) if rates}
    search = spec.get("search_context_cost_per_query")
    if isinstance(search, Mapping):
        fee = _per_million(search.get("search_context_size_medium"), Decimal(1))
        if fee:
            entry["web_search"] = fee
    return entry


def from_sheet(rows: Iterable[Mapping[str, Any]], *, source: str, checked: dt.date) -> list[dict[str, Any]]:
    """Entries from price-sheet rows ``{provider, model, component, unit, price}``.

    ``component`` is a rate name (``input``, ``cached_input``, ``output``, ...) or a per-call fee
    (``web_search``, ``per_request``); ``unit`` is ``token``, ``1K``, ``1M`` or ``call``; ``price`` is
    USD per unit. Rows of one provider and model make one entry, rates in USD per 1M tokens.

    Raises:
        ValueError: a row with an unknown unit, or a price that is not a non-negative number.
    """
    grouped: dict[tuple[str, str], dict[str, Any]] = {}
    for number, row in enumerate(rows, start=1):
        unit = str(row.get("unit", "")).strip().lower()
        if unit not in _UNITS:
            raise ValueError(f"row {number}: unit {row.get('unit')!r} is not one of token, 1K, 1M, call")
        rate = _per_million(row.get("price"), _UNITS[unit])
        if rate is None:
            raise ValueError(f"row {number}: price {row.get('price')!r} is not a non-negative number")
        provider, model = str(row["provider"]).lower(), str(row["model"])
        entry = grouped.setdefault(
            (provider, model), {"id": f"{provider}/{model}", "provider": provider, "model": model}
        )
        entry[str(row["component"]).strip()] = rate
    return [{**entry, "source": source, "checked": checked} for entry in grouped.values()]


class _Dumper(yaml.SafeDumper):
    """Writes ``Decimal`` as a plain YAML number, read back exactly by the catalog loader."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_decimal(dumper: yaml.SafeDumper, value: Decimal) -> yaml.ScalarNode:
    text = format(value, "f")
    return dumper.represent_scalar("tag:yaml.org,2002:float", text if "." in text else text + ".0")


_Dumper.add_representer(Decimal, _represent_decimal)


def to_yaml(entries: list[dict[str, Any]], header: str = "") -> str:
    """A price file holding ``entries`` (with an optional comment ``header``)."""
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    body = yaml.dump({"entries": entries}, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)
    return comment + body
