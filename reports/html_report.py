"""``tokenward report --html FILE``: one self-contained page with the report and its charts.

Charts are SVG drawn by pygal and inlined, with its scripts switched off, so the page opens from
disk with no network: daily spend stacked by model, cache hit rate by day, and the top keys.
"""

from __future__ import annotations

import datetime as dt
import html
import sys
from collections import defaultdict
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb

from tokenward.reports.queries import Selection, spend
from tokenward.reports.render import Column, shown

__all__ = ["charts_data", "write_html"]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
table { border-collapse: collapse; font-size: 0.85rem; margin: 1rem 0; }
th, td { padding: 0.25rem 0.6rem; border-bottom: 1px solid #ddd; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
tfoot td { font-weight: bold; border-top: 2px solid #999; }
.chart { max-width: 960px; margin: 1.5rem 0; }
.note { color: #666; font-size: 0.85rem; }
"""
_TOP_MODELS = 8


def charts_data(conn: duckdb.DuckDBPyConnection, selection: Selection, top_keys: int = 10) -> dict[str, Any]:
    """What the charts show, from the ledger.

    Returns ``days`` (local dates), ``spend_by_model`` (model -> USD per day; models beyond the
    top 8 by cost merged into ``other``), ``hit_rate`` (cached / input tokens per day, ``None``
    without input) and ``top_keys`` (``(key, USD)`` by cost, highest first).
    """
    by_day_model = spend(
        conn, ["day", "model"], since=selection.since, until=selection.until, tz=selection.tz, filters=selection.filters
    )
    days = sorted({r["day"] for r in by_day_model})
    totals: dict[str, Decimal] = defaultdict(Decimal)
    for row in by_day_model:
        totals[row["model"]] += row["cost_usd"] or 0
    kept = {m for m, _ in sorted(totals.items(), key=lambda kv: kv[1], reverse=True)[:_TOP_MODELS]}
    series: dict[str, dict[dt.date, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    for row in by_day_model:
        name = row["model"] if row["model"] in kept else "other"
        series[name][row["day"]] += row["cost_usd"] or 0
    by_day = spend(
        conn, ["day"], since=selection.since, until=selection.until, tz=selection.tz, filters=selection.filters
    )
    keys = spend(
        conn,
        ["key"],
        since=selection.since,
        until=selection.until,
        tz=selection.tz,
        filters=selection.filters,
        top=top_keys,
    )
    return {
        "days": days,
        "spend_by_model": {m: [series[m].get(d, Decimal(0)) for d in days] for m in sorted(series)},
        "hit_rate": {r["day"]: r["cache_hit_rate"] for r in by_day},
        "top_keys": [(r["key"], r["cost_usd"] or Decimal(0)) for r in keys],
    }


def _pygal() -> Any:
    """Import pygal (only when a page is written) without its import hook.

    pygal appends a legacy finder for its map plugins to ``sys.meta_path``; every later failed
    import in the process then raises an ``ImportWarning``. tokenward uses no map plugin, so the
    finder is taken out again.
    """
    import pygal

    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "PluginImportFixer"]
    return pygal


def _svg(chart: Any) -> str:
    return chart.render(is_unicode=True)


def _charts(data: dict[str, Any]) -> list[str]:
    pygal = _pygal()
    from pygal.style import Style

    style = Style(font_family="system-ui, sans-serif", background="white", plot_background="white")
    labels = [d.isoformat() for d in data["days"]]
    common = {
        "js": [],
        "disable_xml_declaration": True,
        "style": style,
        "width": 960,
        "height": 360,
        "x_label_rotation": 30 if len(labels) > 10 else 0,
        "truncate_legend": 30,
    }
    spend_chart = pygal.StackedBar(title="Daily spend by model (USD)", value_formatter=lambda v: f"${v:,.2f}", **common)
    spend_chart.x_labels = labels
    for model, values in data["spend_by_model"].items():
        spend_chart.add(model, [float(v) for v in values])  # chart geometry only; figures are in the table
    hit_chart = pygal.Line(
        title="Cache hit rate (cached / input tokens)", range=(0, 100), value_formatter=lambda v: f"{v:.1f}%", **common
    )
    hit_chart.x_labels = labels
    hit_chart.add(
        "hit rate",
        [None if data["hit_rate"].get(d) is None else float(data["hit_rate"][d]) * 100 for d in data["days"]],
    )
    keys_chart = pygal.HorizontalBar(title="Top keys by spend (USD)", value_formatter=lambda v: f"${v:,.2f}", **common)
    for key, cost in reversed(data["top_keys"]):
        keys_chart.add(str(key), [float(cost)])
    return [_svg(spend_chart), _svg(hit_chart), _svg(keys_chart)]


def write_html(
    path: Path,
    title: str,
    subtitle: str,
    rows: list[dict[str, Any]],
    totals: dict[str, Any] | None,
    columns: list[Column],
    data: dict[str, Any],
    notes: list[str],
) -> None:
    """Write the page: title, the report table, notes, and the three charts."""
    head = "".join(f'<th class="{"" if c.kind == "dim" else "n"}">{html.escape(c.title)}</th>' for c in columns)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{"" if c.kind == "dim" else "n"}">{html.escape(shown(r.get(c.key), c.kind))}</td>'
            for c in columns
        )
        + "</tr>"
        for r in rows
    )
    foot = ""
    if totals is not None:
        foot = (
            "<tfoot><tr>"
            + "".join(
                f'<td class="{"" if c.kind == "dim" else "n"}">'
                + (("total" if i == 0 else "") if c.kind == "dim" else html.escape(shown(totals.get(c.key), c.kind)))
                + "</td>"
                for i, c in enumerate(columns)
            )
            + "</tr></tfoot>"
        )
    charts = (
        "".join(f'<div class="chart">{svg}</div>' for svg in _charts(data))
        if data["days"]
        else ('<p class="note">No requests in this range: nothing to chart.</p>')
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="note">{html.escape(subtitle)}</p>
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody>{foot}</table>
{"".join(f'<p class="note">{html.escape(n)}</p>' for n in notes)}
{charts}
</body></html>
"""
    path.write_text(page, encoding="utf-8")
