"""Planning a price refresh: which fetched prices differ from the ones in force (pure).

A refresh never edits history: every changed or new price becomes a new version effective from
the refresh instant, and rows keep the price that was in force when their request started. A
change is a change of base rates or fees; rules the fetched map does not carry (time windows,
tiers it lacks) are kept from the version in force, and the change line says so.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenward.pricing.catalog import PriceCatalog, PriceEntry, entry_to_dict, parse_entry
from tokenward.pricing.imports import from_litellm
from tokenward.pricing.rates import RATE_NAMES

__all__ = ["RefreshPlan", "plan_refresh"]

_COMPARED = ("rates", "web_search", "per_request")
_RULES = ("context_tiers", "service_tiers", "windows")


@dataclass(frozen=True, slots=True)
class RefreshPlan:
    """New versions to add (price-file mappings) and a human-readable line per change."""

    entries: list[dict[str, Any]]
    changes: list[str]


def plan_refresh(
    catalog: PriceCatalog,
    data: dict[str, Any],
    *,
    now: dt.datetime,
    source: str,
    providers: list[str] | None = None,
) -> RefreshPlan:
    """Compare a LiteLLM-format price map with the versions in force at ``now``.

    Args:
        catalog: the current prices.
        data: the fetched price map.
        now: the refresh instant (aware); new versions take effect from it.
        source: the URL the map came from.
        providers: limit to these tokenward provider names (``None``/empty: all).

    Returns:
        The versions to add and one line per change (``id: input 2.5 -> 2.0, ...`` or ``id: new``).
    """
    fetched = from_litellm(data, source=source, checked=now.date(), providers=providers or None, effective=now)
    entries, changes = [], []
    for raw in fetched:
        candidate = parse_entry(Path(source), 0, raw)
        current = catalog.version_at(candidate.id, now)
        if current is None:
            entries.append(raw)
            changes.append(f"{candidate.id}: new, input {candidate.rates.input} output {candidate.rates.output}")
            continue
        difference = _difference(current, candidate)
        if not difference:
            continue
        merged = {k: v for k, v in entry_to_dict(current).items() if k not in RATE_NAMES}  # rates: all from the map
        merged.update({k: v for k, v in raw.items() if k not in _RULES})
        kept = [rule for rule in _RULES if rule in merged and rule not in raw]
        for rule in _RULES:
            if rule in raw:
                merged[rule] = raw[rule]
        if kept:
            merged["note"] = f"refreshed from {source}; {', '.join(kept)} kept from {current.version_id}"
            difference += f" ({', '.join(kept)} kept from the previous version)"
        entries.append(merged)
        changes.append(f"{candidate.id}: {difference}")
    return RefreshPlan(entries, changes)


def _difference(old: PriceEntry, new: PriceEntry) -> str:
    parts = []
    for name in _COMPARED:
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        if name == "rates":
            parts += [
                f"{rate} {getattr(before, rate)} -> {getattr(after, rate)}"
                for rate in ("input", "cached_input", "cache_write", "cache_write_1h", "output", "reasoning")
                if getattr(before, rate) != getattr(after, rate)
            ]
        else:
            parts.append(f"{name} {before} -> {after}")
    return ", ".join(parts)
