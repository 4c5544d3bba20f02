"""Writing report rows: terminal table (rich), CSV, JSON, Markdown, Parquet.

CSV, JSON and Parquet carry exact values (costs as 12-place decimals, ratios as 4-place
fractions); the table and Markdown show them rounded for reading (USD to cents from $100, to 4
places from $1, else to 6; ratios as percentages).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
from rich.console import Console
from rich.table import Table

__all__ = [
    "Column",
    "cell",
    "columns_for",
    "COMPACT",
    "MEASURE_KEYS",
    "json_default",
    "shown",
    "to_csv",
    "to_json",
    "to_markdown",
    "to_parquet",
    "to_table",
]


@dataclass(frozen=True, slots=True)
class Column:
    """One report column: row key, heading, and kind (``dim``, ``int``, ``usd``, ``ratio``, ``pct``)."""

    key: str
    title: str
    kind: str


_MEASURES = (
    Column("requests", "requests", "int"),
    Column("input_tokens", "input", "int"),
    Column("cached_input_tokens", "cached in", "int"),
    Column("cache_write_tokens", "cache writes", "int"),
    Column("output_tokens", "output", "int"),
    Column("reasoning_tokens", "reasoning", "int"),
    Column("cost_usd", "cost (USD)", "usd"),
    Column("cache_hit_rate", "cache hit", "ratio"),
    Column("cache_savings_usd", "cache saved", "usd"),
    Column("output_share", "output share", "ratio"),
    Column("avg_cost_usd", "avg/request", "usd"),
    Column("p95_cost_usd", "p95/request", "usd"),
    Column("unpriced_requests", "unpriced", "int"),
    Column("estimated_requests", "estimated", "int"),
)


COMPACT = (
    "requests",
    "input_tokens",
    "output_tokens",
    "cost_usd",
    "cache_hit_rate",
    "cache_savings_usd",
    "avg_cost_usd",
    "p95_cost_usd",
    "unpriced_requests",
)
"""The measures a terminal table shows unless asked for others (``--columns``)."""

MEASURE_KEYS = tuple(c.key for c in _MEASURES)
"""Every measure column, in table order."""


def columns_for(
    dims: Sequence[str],
    *,
    measures: Sequence[str] = MEASURE_KEYS,
    compare: bool = False,
    forecast: bool = False,
    as_model: str | None = None,
    drift: bool = False,
) -> list[Column]:
    """The columns of a report grouped by ``dims``, with ``measures`` and the views switched on.

    ``measures`` are keys or headings (shown in table order).

    Raises:
        ValueError: an unknown measure.
    """
    known = {c.key: c for c in _MEASURES} | {c.title: c for c in _MEASURES}
    unknown = [m for m in measures if m not in known]
    if unknown:
        raise ValueError(f"unknown column {unknown[0]!r}; choose from {', '.join(MEASURE_KEYS)} or all")
    wanted = {known[m].key for m in measures}
    columns = [Column(d, d, "dim") for d in dims] + [c for c in _MEASURES if c.key in wanted]
    if compare:
        columns += [Column("previous_cost_usd", "previous", "usd"), Column("change_pct", "change", "pct")]
    if forecast:
        columns.append(Column("forecast_usd", "forecast", "usd"))
    if as_model:
        columns += [
            Column("as_model_cost_usd", f"as {as_model}", "usd"),
            Column("as_model_change_pct", "vs actual", "pct"),
        ]
    if drift:
        columns += [
            Column("provider_cost_usd", "provider says", "usd"),
            Column("provider_cost_drift_usd", "drift", "usd"),
        ]
    return columns


def shown(value: Any, kind: str) -> str:
    """``value`` of a column of ``kind`` as the table and Markdown show it (``-`` when unknown)."""
    if value is None:
        return "-"
    if kind == "int":
        return f"{value:,}"
    if kind == "usd":  # cents where cents are what matter, micro-dollars for per-request figures
        return f"${value:,.2f}" if abs(value) >= 100 else (f"${value:,.4f}" if abs(value) >= 1 else f"${value:,.6f}")
    if kind == "ratio":
        return f"{value * 100:.2f}%"
    if kind == "pct":
        return f"{value:+.2f}%"
    return str(value)


def to_table(
    rows: list[dict[str, Any]], totals: dict[str, Any] | None, columns: list[Column], console: Console, title: str
) -> None:
    """Print ``rows`` as a rich table, with ``totals`` as its footer.

    No figure is ever cut short: when the table is wider than the console, lines run longer.
    """
    table = Table(title=title, show_footer=totals is not None)
    needed = 1
    for i, column in enumerate(columns):
        if column.kind == "dim":
            footer = "total" if i == 0 else ""
        else:
            footer = shown(totals.get(column.key), column.kind) if totals else ""
        cells = [shown(r.get(column.key), column.kind) for r in rows] + [footer]
        width = max([len(column.title), *(len(cell) for cell in cells)])
        table.add_column(
            column.title,
            footer=footer,
            no_wrap=True,
            min_width=width,
            justify="left" if column.kind == "dim" else "right",
        )
        needed += width + 3
    for row in rows:
        table.add_row(*(shown(row.get(c.key), c.kind) for c in columns))
    if console.width < needed:
        console.width = needed
    console.print(table)


def to_markdown(rows: list[dict[str, Any]], totals: dict[str, Any] | None, columns: list[Column]) -> str:
    """A GitHub-flavoured Markdown table of ``rows`` (and a bold total row)."""
    lines = [
        "| " + " | ".join(c.title for c in columns) + " |",
        "|" + "|".join("---" if c.kind == "dim" else "---:" for c in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_md(shown(row.get(c.key), c.kind)) for c in columns) + " |")
    if totals is not None:
        cells = [
            ("**total**" if i == 0 else "") if c.kind == "dim" else f"**{shown(totals.get(c.key), c.kind)}**"
            for i, c in enumerate(columns)
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    """A Markdown table cell: pipes escaped, HTML shown as text rather than rendered."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def json_default(value: Any) -> Any:
    """JSON for the values rows hold: exact decimals as strings, dates as ISO 8601."""
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _keys(rows: list[dict[str, Any]], columns: list[Column], everything: bool) -> list[str]:
    """The columns' keys, then (``everything``) every other measure the rows carry."""
    keys = [c.key for c in columns]
    return keys + [k for k in (rows[0] if rows else {}) if k not in keys] if everything else keys


def to_json(rows: list[dict[str, Any]], columns: list[Column], *, everything: bool = True) -> str:
    """Rows as a JSON array of objects: the columns' keys and (``everything``) every other measure."""
    keys = _keys(rows, columns, everything)
    return json.dumps([{k: r.get(k) for k in keys} for r in rows], default=json_default, indent=2) + "\n"


def cell(value: Any) -> Any:
    """``value`` as a CSV cell: exact decimals, ISO times, lowercase booleans."""
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    return value


def to_csv(rows: list[dict[str, Any]], columns: list[Column], *, everything: bool = True) -> str:
    """Rows as CSV: the columns' keys and (``everything``) every other measure; empty cells for unknowns."""
    keys = _keys(rows, columns, everything)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(keys)
    for row in rows:
        writer.writerow([cell(row.get(k)) for k in keys])
    return buffer.getvalue()


_PARQUET_TYPES = {"int": "BIGINT", "usd": "DECIMAL(38, 12)", "ratio": "DECIMAL(18, 4)", "pct": "DECIMAL(18, 2)"}


def _parquet_type(key: str, kind: str | None, sample: Any) -> str:
    if kind in _PARQUET_TYPES:
        return _PARQUET_TYPES[kind]
    if isinstance(sample, bool):
        return "BOOLEAN"
    if isinstance(sample, int):
        return "BIGINT"
    if isinstance(sample, Decimal) or key.endswith("_usd"):
        return "DECIMAL(38, 12)"
    if isinstance(sample, dt.datetime):
        return "TIMESTAMP"
    if isinstance(sample, dt.date):
        return "DATE"
    return "VARCHAR"


def to_parquet(rows: list[dict[str, Any]], columns: list[Column], path: Path, *, everything: bool = True) -> None:
    """Write ``rows`` to a Parquet file: exact decimals, 64-bit counts, dimensions typed as their values."""
    keys = _keys(rows, columns, everything)
    kinds = {c.key: c.kind for c in columns}
    types = []
    for key in keys:
        sample = next((r[key] for r in rows if r.get(key) is not None), None)
        types.append(_parquet_type(key, None if kinds.get(key) == "dim" else kinds.get(key), sample))
    conn = duckdb.connect()
    try:
        conn.execute(
            f"CREATE TABLE report ({', '.join(f'{chr(34)}{k}{chr(34)} {t}' for k, t in zip(keys, types, strict=True))})"
        )
        if rows:
            marks = ", ".join("?" for _ in keys)
            conn.executemany(f"INSERT INTO report VALUES ({marks})", [[r.get(k) for k in keys] for r in rows])
        conn.execute("COPY report TO ? (FORMAT parquet)", [str(path)])
    finally:
        conn.close()
