"""What-if: the selected traffic priced under another model's prices.

Each row's usage (its token counts, service tier and start time) is priced again by
:func:`tokenward.pricing.cost.price` with the other model's entry version in force now, so the
rules are the ones real requests get. When that entry's cost is linear in the tokens (no
context cliffs, time windows or per-request fee), pricing the summed usage of a group is exactly
the sum of pricing each row, and the query aggregates in DuckDB first; otherwise every row is
priced on its own (``progress`` is told how far it got).

Rows without usage (``usage_source = 'none'``) are skipped; rows that were unpriced under their
own model are included, so the what-if can cover traffic the actual cost leaves out.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import duckdb

from tokenward.pricing.catalog import PriceCatalog, Resolution
from tokenward.pricing.cost import price
from tokenward.pricing.usage import TOKEN_FIELDS, Usage
from tokenward.reports.queries import Selection, canonical

__all__ = ["WhatIf", "what_if"]

_BATCH = 50_000


@dataclass
class WhatIf:
    """Costs (USD) of the selection under ``entry_id``: per group key tuple and in total."""

    model: str
    entry_id: str
    by_group: dict[tuple[Any, ...], Decimal] = field(default_factory=dict)
    total: Decimal = Decimal(0)
    rows: int = 0


def what_if(
    conn: duckdb.DuckDBPyConnection,
    catalog: PriceCatalog,
    model: str,
    by: Sequence[str],
    selection: Selection,
    *,
    provider: str | None = None,
    now: dt.datetime | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> WhatIf:
    """Price the rows of ``selection`` as if ``model`` had served them, grouped by ``by``.

    Args:
        conn: an open ledger connection.
        catalog: the prices.
        model: the model whose prices apply (``provider`` narrows the catalog lookup).
        by: dimensions, as for :func:`tokenward.reports.queries.spend`.
        selection: the rows.
        provider: the catalog provider of ``model``, when the name alone is ambiguous.
        now: which version of the model's price applies (default: now).
        progress: called with (rows priced, rows in all) while rows are priced one by one.

    Raises:
        ValueError: ``model`` has no price in the catalog, or a dimension is unknown.
    """
    resolution = catalog.resolve(model, provider, now or dt.datetime.now(dt.UTC), fallback=False)
    if resolution is None:
        raise ValueError(f"no price for model {model!r}" + (f" at provider {provider!r}" if provider else ""))
    entry = resolution.entry
    result = WhatIf(model, entry.version_id)
    dims = [canonical(name) for name in by]
    source, params = selection.rows(dims, "usage_source <> 'none'")
    keys = "".join(f"{sql} AS {d}, " for sql, d in zip(selection.group_keys(conn, dims), dims, strict=True))
    linear = not (entry.context_tiers or entry.windows or entry.per_request)
    tokens = ", ".join(f"sum({name})::BIGINT" if linear else name for name in TOKEN_FIELDS)
    if linear:
        group = ", ".join(str(i + 1) for i in range(len(dims) + 1))
        sql = f"SELECT {keys}service_tier, NULL, count(*), {tokens} FROM {source} GROUP BY {group}"
        total = None
    else:
        sql = f"SELECT {keys}service_tier, started_at, 1, {tokens} FROM {source}"
        count = conn.execute(f"SELECT count(*) FROM {source}", params).fetchone()
        total = int(count[0]) if count else 0
    cursor = conn.execute(sql, params)
    width = len(dims)
    while True:
        chunk = cursor.fetchmany(_BATCH)
        if not chunk:
            break
        for row in chunk:
            key, (tier, started, rows) = selection.label(dims, row[:width]), row[width : width + 3]
            usage = Usage(**dict(zip(TOKEN_FIELDS, row[width + 3 :], strict=True)))
            amount = _price(usage, resolution, started, tier)
            result.by_group[key] = result.by_group.get(key, Decimal(0)) + amount
            result.total += amount
            result.rows += rows
        if progress is not None and total:
            progress(result.rows, total)
    if "tag" in dims:  # a request with two tags is in two groups but is paid for once
        result.total = _untagged_total(conn, resolution, selection) if result.by_group else Decimal(0)
    return result


def _price(usage: Usage, resolution: Resolution, started: dt.datetime | None, tier: str | None) -> Decimal:
    return price(usage, resolution, at=started, service_tier=tier).total


def _untagged_total(conn: duckdb.DuckDBPyConnection, resolution: Resolution, selection: Selection) -> Decimal:
    """The total without the tag fan-out (priced row by row, or by tier when linear)."""
    where, params = selection.where("usage_source <> 'none'")
    entry = resolution.entry
    if not (entry.context_tiers or entry.windows or entry.per_request):
        sums = ", ".join(f"sum({name})::BIGINT" for name in TOKEN_FIELDS)
        rows = conn.execute(f"SELECT service_tier, NULL, {sums} FROM requests{where} GROUP BY 1", params).fetchall()
    else:
        columns = ", ".join(TOKEN_FIELDS)
        rows = conn.execute(f"SELECT service_tier, started_at, {columns} FROM requests{where}", params).fetchall()
    total = Decimal(0)
    for tier, started, *counts in rows:
        total += _price(Usage(**dict(zip(TOKEN_FIELDS, counts, strict=True))), resolution, started, tier)
    return total
