"""Re-price stored rows under the current catalog (``tokenward pricing reprice``).

Each metered row is priced again with :func:`tokenward.pricing.quote.quote`, exactly as the
proxy would price it now: the price version in force at the row's own start time, its served
model, provider and service tier. Rows whose status, cost, entry or lines change are updated in
one bulk statement; unpriced rows whose model has gained a price become priced (field case B24).
Nothing else in a row is touched, and a dry run changes nothing.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import duckdb
import msgspec

from tokenward.pricing.catalog import PriceCatalog
from tokenward.pricing.quote import PriceStatus, quote
from tokenward.pricing.usage import TOKEN_FIELDS, Usage, UsageSource
from tokenward.reports.ledger.duck import apply_prices

__all__ = ["RepriceResult", "reprice"]

_REPRICED = (
    PriceStatus.PRICED,
    PriceStatus.PARTIALLY_PRICED,
    PriceStatus.FALLBACK,
    PriceStatus.UNPRICED,
    PriceStatus.REPAIRED,
)
_encoder = msgspec.json.Encoder(decimal_format="string")


@dataclass(slots=True)
class RepriceResult:
    """What a re-pricing found: totals in USD (priced rows only), and per model ``(rows, before, after)``."""

    rows_checked: int = 0
    rows_changed: int = 0
    newly_priced: int = 0
    newly_unpriced: int = 0
    before: Decimal = Decimal(0)
    after: Decimal = Decimal(0)
    by_model: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(lambda: [0, Decimal(0), Decimal(0)]))


def reprice(
    conn: duckdb.DuckDBPyConnection,
    catalog: PriceCatalog,
    *,
    where: str = "",
    params: list[Any] | None = None,
    fallback: bool = False,
    dry_run: bool = False,
    apply: Callable[[duckdb.DuckDBPyConnection, list[dict[str, Any]]], None] | None = None,
) -> RepriceResult:
    """Price metered rows again and store what changed.

    Args:
        conn: a read-write ledger connection (read-only is enough with ``dry_run``).
        catalog: the prices to apply.
        where: extra SQL condition on ``requests`` (e.g. ``started_at >= ?``).
        params: the values of ``where``'s placeholders.
        fallback: whether the catalog's fallback rates may price otherwise unpriced rows.
        dry_run: compute and report, but update nothing.
        apply: stores the changed cost columns (the ledger's ``apply_prices``; default: an
            UPDATE of the DuckDB file behind ``conn``).

    Returns:
        The counts and totals before and after.
    """
    columns = ", ".join(TOKEN_FIELDS)
    condition = "usage_source <> 'none' AND price_status IN (" + ", ".join(f"'{s}'" for s in _REPRICED) + ")"
    if where:
        condition += f" AND ({where})"
    rows = conn.execute(
        f"SELECT request_id, served_model, coalesce(sent_model, requested_model), provider, service_tier, "
        "started_at, usage_source, "
        f"price_status, cost_usd, price_entry_id, cost_lines, output_cost_usd, cache_savings_usd, price_resolved_by, "
        f"coalesce(image_variant, ''), {columns} "
        f"FROM requests WHERE {condition}",
        params or [],
    ).fetchall()
    result = RepriceResult()
    updates = []
    for row in rows:
        (request_id, served, requested, provider, tier, started, source, status, cost, entry_id, lines) = row[:11]
        output_cost, savings, resolved_by, variant = row[11:15]
        repairs = ("stored",) if status == PriceStatus.REPAIRED else ()  # repaired counts stay flagged
        counts = dict(zip(TOKEN_FIELDS, row[15:], strict=True))
        usage = Usage(**counts, image_variant=variant, source=UsageSource(source), repairs=repairs)
        model = served or requested
        pinned = (
            catalog.versions.get((entry_id or "").partition("@")[0]) if resolved_by == "price_as_upstream" else None
        )
        fresh = quote(
            catalog,
            usage,
            model=model,
            provider=provider,
            at=started,
            service_tier=tier,
            fallback=fallback,
            requested=requested,  # a pin on the requested model (the one sent, if rerouted) still applies
            price_as=pinned[-1].model if pinned else None,  # and an upstream's pin stays where it was
        )
        result.rows_checked += 1
        old_lines = json.loads(lines) if lines else None
        new_lines = json.loads(_encoder.encode(fresh.lines)) if fresh.lines is not None else None
        now = (fresh.status, fresh.cost_usd, fresh.entry_id, new_lines, fresh.output_cost_usd, fresh.cache_savings_usd)
        if now == (status, cost, entry_id, old_lines, output_cost, savings):
            _tally(result, model, cost, cost)
            continue
        result.rows_changed += 1
        result.newly_priced += status == PriceStatus.UNPRICED and fresh.status != PriceStatus.UNPRICED
        result.newly_unpriced += status != PriceStatus.UNPRICED and fresh.status == PriceStatus.UNPRICED
        _tally(result, model, cost, fresh.cost_usd)
        updates.append(
            {
                "request_id": request_id,
                "price_status": fresh.status,
                "cost_usd": fresh.cost_usd,
                "price_entry_id": fresh.entry_id,
                "price_resolved_by": fresh.resolved_by,
                "cost_lines": fresh.lines,
                "output_cost_usd": fresh.output_cost_usd,
                "cache_savings_usd": fresh.cache_savings_usd,
            }
        )
    if updates and not dry_run:
        (apply or apply_prices)(conn, updates)
    return result


def _tally(result: RepriceResult, model: str | None, before: Decimal | None, after: Decimal | None) -> None:
    entry = result.by_model[model or "(none)"]
    entry[0] += 1
    entry[1] += before or 0
    entry[2] += after or 0
    result.before += before or 0
    result.after += after or 0
