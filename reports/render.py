"""Writing report rows: terminal table (rich), CSV, JSON, Markdown, Parquet.

CSV, JSON and Parquet carry exact values (costs as 12-place decimals, ratios as 4-place
fractions); the table, Markdown and the HTML page show them rounded for reading, the same way
down a column: USD right-aligned with one number of decimals per column (three significant
digits of the column's largest amount, a little more for its smallest: :func:`usd_places`),
ratios as percentages to one place.

The terminal table fits its console: unless the columns were chosen (``--columns``), the
measures least needed are left out until it does, and headings are shortened first.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, TextIO

import duckdb
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = [
    "Column",
    "cell",
    "column_texts",
    "columns_for",
    "COMPACT",
    "MEASURE_KEYS",
    "json_default",
    "output_width",
    "shown",
    "to_csv",
    "to_json",
    "to_markdown",
    "to_parquet",
    "to_table",
    "usd",
    "usd_places",
]


@dataclass(frozen=True, slots=True)
class Column:
    """One report column: row key, heading, kind (``dim``, ``int``, ``usd``, ``ratio``, ``pct``), short heading."""

    key: str
    title: str
    kind: str
    short: str = ""

    @property
    def heading(self) -> str:
        """The short heading (the heading itself when it has none)."""
        return self.short or self.title


_MEASURES = (
    Column("requests", "requests", "int", "reqs"),
    Column("input_tokens", "input", "int", "in"),
    Column("cached_input_tokens", "cached in", "int", "cached"),
    Column("cache_write_tokens", "cache writes", "int", "c.write"),
    Column("output_tokens", "output", "int", "out"),
    Column("reasoning_tokens", "reasoning", "int", "reason"),
    Column("cost_usd", "cost (USD)", "usd", "cost"),
    Column("cache_hit_rate", "cache hit", "ratio", "hit"),
    Column("cache_savings_usd", "cache saved", "usd", "saved"),
    Column("output_share", "output share", "ratio", "out%"),
    Column("avg_cost_usd", "avg/request", "usd", "avg/req"),
    Column("p95_cost_usd", "p95/request", "usd", "p95/req"),
    Column("unpriced_requests", "unpriced", "int", "unpr"),
    Column("estimated_requests", "estimated", "int", "est"),
)

_PRIORITY = (
    "cost_usd",
    "requests",
    "cache_hit_rate",
    "input_tokens",
    "output_tokens",
    "unpriced_requests",
    "cache_savings_usd",
    "avg_cost_usd",
    "p95_cost_usd",
    "cached_input_tokens",
    "output_share",
    "cache_write_tokens",
    "reasoning_tokens",
    "estimated_requests",
)  # kept longest first; a view's columns (--compare, --forecast, ...) come right after cost

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
        columns += [
            Column("previous_cost_usd", "previous", "usd", "prev"),
            Column("change_pct", "change", "pct", "chg"),
        ]
    if forecast:
        columns.append(Column("forecast_usd", "forecast", "usd", "fcst"))
    if as_model:
        columns += [
            Column("as_model_cost_usd", f"as {as_model}", "usd", "what-if"),
            Column("as_model_change_pct", "vs actual", "pct", "vs"),
        ]
    if drift:
        columns += [
            Column("provider_cost_usd", "provider says", "usd", "provider"),
            Column("provider_cost_drift_usd", "drift", "usd"),
        ]
    return columns


def usd_places(largest: Decimal, smallest: Decimal | None = None) -> int:
    """Decimals for USD amounts from ``smallest`` to ``largest`` (absolute, nonzero), 2 to 6.

    Three significant digits of the largest (``$1,234.56`` and ``$12.34``: 2, ``$0.613``: 3,
    ``$0.0715``: 4), and up to two places more so that the smallest keeps a significant digit
    (``$5.00`` beside ``$0.0005``: ``$5.0000`` and ``$0.0005``).
    """
    if not largest:
        return 2
    places = min(6, max(2, 2 - largest.adjusted()))
    if smallest:
        places = min(6, max(places, min(-smallest.adjusted(), places + 2)))
    return places


def usd(value: Decimal, places: int) -> str:
    """``value`` in USD with ``places`` decimals (``-$1.50``); an amount that would show as 0 reads ``<$0.01``."""
    if value and abs(value) < Decimal(5).scaleb(-places - 1):
        return f"{'-' if value < 0 else ''}<${Decimal(1).scaleb(-places)}"
    return f"{'-' if value < 0 else ''}${abs(value):,.{places}f}"


def column_texts(column: Column, values: Sequence[Any]) -> list[str]:
    """``values`` of ``column`` as text, formatted alike down the column (``-`` when unknown).

    ``usd``: one number of decimals for the column (:func:`usd_places` of its amounts);
    ``int``: thousands separated; ``ratio``: a fraction shown as a percentage to one place;
    ``pct``: a signed percentage to one place.
    """
    if column.kind == "usd":
        amounts = [abs(v) for v in values if v]
        places = usd_places(max(amounts), min(amounts)) if amounts else 2
        return ["-" if v is None else usd(v, places) for v in values]
    return [_one(v, column.kind) for v in values]


def _one(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "int":
        return f"{value:,}"
    if kind == "ratio":
        return f"{value * 100:.1f}%"
    if kind == "pct":
        return f"{value:+.1f}%"
    return str(value)


def shown(value: Any, kind: str) -> str:
    """One ``value`` of a column of ``kind`` as the table shows it alone (see :func:`column_texts`)."""
    return column_texts(Column("", "", kind), [value])[0]


def output_width(stream: TextIO | None = None) -> int:
    """Characters a table written to ``stream`` (standard output by default) may use per line.

    The terminal's width when ``stream`` is a terminal; otherwise ``COLUMNS`` when set to a
    positive number, else 80.
    """
    stream = stream or sys.stdout
    try:
        if stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's buffer) or not a terminal after all
        pass
    columns = os.environ.get("COLUMNS", "").strip()
    return int(columns) if columns.isdigit() and int(columns) > 0 else 80


def _table_width(widths: Sequence[int]) -> int:
    return sum(widths) + 3 * len(widths) + 1  # a space either side of each cell, a border between and around


def _rank(column: Column, empty: bool) -> int:
    """When a measure goes as the table is too wide: the highest rank first, columns of nothing but 0 before all."""
    rank = _PRIORITY.index(column.key) * 2 if column.key in _PRIORITY else 1
    return rank + (100 if empty else 0)


@dataclass(frozen=True, slots=True)
class _Layout:
    columns: list[Column]
    headings: list[str]
    widths: list[int]
    left_out: list[Column]


def _layout(columns: list[Column], texts: dict[str, list[str]], empty: set[str], width: int, fit: bool) -> _Layout:
    """The columns, headings and widths of a table at most ``width`` wide (when it can be).

    Headings are shortened first; then, with ``fit``, measures are left out by rank (``empty``:
    the keys of columns of nothing but 0, which go first; dimensions past 30 characters count
    as folded); then dimensions are folded onto more lines (down to 8 characters). Figures are
    never cut: a table that still does not fit is wider than ``width``.
    """
    natural = {c.key: max(len(t) for t in texts[c.key]) for c in columns}

    def sizes(chosen: list[Column], short: bool, fold: int | None = None) -> list[int]:
        result = []
        for column, heading in zip(chosen, _headings(chosen, short), strict=True):
            size = max(natural[column.key], len(heading))
            if column.kind == "dim" and fold is not None:
                size = max(min(size, fold), len(heading))
            result.append(size)
        return result

    chosen = list(columns)
    left_out: list[Column] = []
    if fit:
        by_rank = sorted((c for c in columns if c.kind != "dim"), key=lambda c: _rank(c, c.key in empty), reverse=True)
        while _table_width(sizes(chosen, True, fold=30)) > width and len(by_rank) > 1:
            dropped = by_rank.pop(0)
            chosen.remove(dropped)
            left_out.append(dropped)
    short = _table_width(sizes(chosen, False)) > width
    sized, floor = sizes(chosen, short), sizes(chosen, short, fold=8)
    if _table_width(floor) <= width:  # fold the widest dimension, a character at a time, until it fits
        for _ in range(_table_width(sized) - width):
            widest = max((i for i in range(len(chosen)) if sized[i] > floor[i]), key=lambda i: sized[i])
            sized[widest] -= 1
    left_out.sort(key=columns.index)
    return _Layout(chosen, _headings(chosen, short), sized, left_out)


def _headings(columns: Sequence[Column], short: bool) -> list[str]:
    return [c.heading if short else c.title for c in columns]


def to_table(
    rows: list[dict[str, Any]],
    totals: dict[str, Any] | None,
    columns: list[Column],
    console: Console,
    title: str,
    *,
    fit: bool = False,
) -> list[Column]:
    """Print ``rows`` as a rich table as wide as ``console`` at most, with ``totals`` as its footer.

    With ``fit`` (columns not chosen by the user), the measures least needed are left out until
    the table fits (see ``_PRIORITY``); the columns left out are returned. No figure is ever cut
    short: when the table cannot fit, lines run longer.
    """
    texts: dict[str, list[str]] = {}
    empty = set()
    for i, column in enumerate(columns):
        values = [r.get(column.key) for r in rows]
        if not any(values):
            empty.add(column.key)
        if column.kind == "dim":
            texts[column.key] = _one_each(values) + ([("total" if i == 0 else "")] if totals is not None else [])
        else:
            texts[column.key] = column_texts(column, values + ([totals.get(column.key)] if totals is not None else []))
    layout = _layout(columns, texts, empty, console.width, fit)
    table = Table(title=title, show_footer=totals is not None, title_justify="left")
    for column, heading, width in zip(layout.columns, layout.headings, layout.widths, strict=True):
        dim = column.kind == "dim"
        table.add_column(
            heading,
            footer=texts[column.key][-1] if totals is not None else "",
            width=width,
            no_wrap=not dim,
            overflow="fold",
            justify="left" if dim else "right",
        )
    for i in range(len(rows)):
        table.add_row(*(Text(texts[c.key][i]) for c in layout.columns))  # Text: a key's "[red]" is not markup
    needed = _table_width(layout.widths)
    if console.width < needed:
        console.width = needed
    console.print(table)
    return layout.left_out


def _one_each(values: Sequence[Any]) -> list[str]:
    return ["-" if v is None else str(v) for v in values]


def to_markdown(rows: list[dict[str, Any]], totals: dict[str, Any] | None, columns: list[Column]) -> str:
    """A GitHub-flavoured Markdown table of ``rows`` (and a bold total row), formatted as :func:`column_texts`."""
    texts = []
    for column in columns:
        values = [r.get(column.key) for r in rows]
        if column.kind == "dim":
            texts.append(_one_each(values))
        else:
            texts.append(column_texts(column, values + [(totals or {}).get(column.key)]))
    lines = [
        "| " + " | ".join(c.title for c in columns) + " |",
        "|" + "|".join("---" if c.kind == "dim" else "---:" for c in columns) + "|",
    ]
    for i in range(len(rows)):
        lines.append("| " + " | ".join(_md(t[i]) for t in texts) + " |")
    if totals is not None:
        cells = [
            ("**total**" if i == 0 else "") if c.kind == "dim" else f"**{_md(t[-1])}**"
            for i, (c, t) in enumerate(zip(columns, texts, strict=True))
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
