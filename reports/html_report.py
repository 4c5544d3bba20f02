"""``tokenward report --html FILE``: one self-contained page people look at.

The page opens on the figures (spend, requests, tokens, cache hit rate and savings, unpriced
requests, the period), then the charts (spend over time stacked by model, every configured
budget with its % used and forecast, spend by model and the top keys, biggest first, cache hit
rate and savings over time), and keeps the report table below, folded in a ``<details>``.
Charts are inline SVG (:mod:`tokenward.reports.charts`), styles inline: no script, nothing
fetched, so the file opens offline and from a mail attachment.

Time buckets follow the range: hours up to 3 days, days up to 92, weeks up to two years, then
months; every bucket of the range is drawn, empty ones included.
"""

from __future__ import annotations

import datetime as dt
import html
from collections import defaultdict
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import duckdb

from tokenward.pricing.budgets import BudgetStatus
from tokenward.reports import charts
from tokenward.reports.queries import Selection, spend
from tokenward.reports.render import Column, column_texts, usd, usd_places

__all__ = ["bucket_for", "charts_data", "write_html"]

_NAMED_MODELS = len(charts.PALETTE)  # models beyond these are "(other)"
_MONTHS = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()
_OPEN_TABLE_ROWS = 25  # a longer table starts folded

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5rem 2rem; color: #1f2328; }
h1 { font-size: 1.45rem; margin: 0; } h2 { font-size: 1.05rem; margin: 0 0 .5rem; }
.sub, .note, .detail { color: #59636e; font-size: .85rem; }
.summary { display: grid; grid-template-columns: repeat(auto-fill, minmax(155px, 1fr)); gap: .6rem; margin: 1rem 0; }
.figure { border: 1px solid #d1d9e0; border-radius: 8px; padding: .5rem .75rem; min-width: 0; }
.figure .label { display: block; color: #59636e; font-size: .8rem; }
.figure .value { display: block; font-size: 1.35rem; font-weight: 600; font-variant-numeric: tabular-nums;
  white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.figure .detail { display: block; font-size: .78rem; line-height: 1.3; }
.figure.warn { border-color: #d4a72c; background: #fff8c5; }
.notes { border-left: 4px solid #d4a72c; padding: .2rem .8rem; margin: .5rem 0 1rem; }
.notes p { margin: .3rem 0; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); gap: 1rem 2rem; }
.chart { margin: 0; min-width: 0; } .chart.wide { grid-column: 1 / -1; }
.chart svg text { font: 12px system-ui, sans-serif; fill: #59636e; }
.y-axis text, .ranked .name { text-anchor: end; } .x-axis text { text-anchor: middle; }
.ranked .value { fill: #1f2328; font-variant-numeric: tabular-nums; }
.grid line { stroke: #e6e9ed; } .line polyline { stroke-width: 2; }
.legend { list-style: none; padding: 0; margin: .3rem 0; display: flex; flex-wrap: wrap; gap: .2rem 1.1rem; }
.legend li { font-size: .85rem; } .legend .amount { color: #59636e; font-variant-numeric: tabular-nums; }
.swatch { display: inline-block; width: .8rem; height: .8rem; border-radius: 2px; margin-right: .3rem;
  vertical-align: -1px; }
.budget { margin: .6rem 0 1rem; max-width: 960px; }
.track { position: relative; height: 14px; background: #eef1f4; border-radius: 7px; margin: .25rem 0; }
.used { position: absolute; left: 0; top: 0; bottom: 0; border-radius: 7px; background: #59a14f; }
.used.near { background: #f28e2b; } .used.over { background: #e15759; }
.forecast { position: absolute; top: -3px; bottom: -3px; width: 0; border-left: 2px dashed #1f2328; }
details { margin: 1.5rem 0; } summary { cursor: pointer; font-weight: 600; }
.table { overflow-x: auto; } table { border-collapse: collapse; font-size: .85rem; margin: .75rem 0; }
th, td { padding: .25rem .6rem; border-bottom: 1px solid #e6e9ed; text-align: left; white-space: nowrap; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
tfoot td { font-weight: 600; border-top: 2px solid #9198a1; }
"""


def bucket_for(span: dt.timedelta) -> str:
    """The time bucket of charts over ``span``: ``hour`` to 3 days, ``day`` to 92, ``week`` to 731, else ``month``."""
    if span <= dt.timedelta(days=3):
        return "hour"
    if span <= dt.timedelta(days=92):
        return "day"
    return "week" if span <= dt.timedelta(days=731) else "month"


def charts_data(conn: duckdb.DuckDBPyConnection, selection: Selection, top_keys: int = 10) -> dict[str, Any]:
    """What the charts show, from the ledger: the range's first and last request, then two grouped reads.

    Returns:
        ``start``/``end`` (the range: the selection's bounds, else its first and last request),
        ``tz``, ``bucket`` (hour, day, week or month), ``buckets`` (every bucket of the range, in order:
        dates, ``YYYY-MM`` or local ISO hours), ``models`` (``(model, USD)`` by cost, highest
        first; models past the ninth merged into ``(other)``), ``spend_by_model`` (model -> USD per
        bucket), ``hit_rate`` (cached / input tokens per bucket, ``None`` without input),
        ``savings`` (USD per bucket), ``top_keys`` (``(key, USD)``, highest first, priced keys
        only). Empty lists when the range holds no request.
    """
    where, params = selection.where()
    first, last = conn.execute(f"SELECT min(started_at), max(started_at) FROM requests{where}", params).fetchone()
    start = selection.since or first
    end = selection.until or (None if last is None else last + dt.timedelta(microseconds=1))
    if first is None:
        empty: dict[str, Any] = {"buckets": [], "models": [], "spend_by_model": {}, "hit_rate": [], "savings": []}
        return {**empty, "bucket": "day", "top_keys": [], "start": start, "end": end, "tz": selection.tz}
    bucket = bucket_for(end - start)
    common = {"since": selection.since, "until": selection.until, "tz": selection.tz, "filters": selection.filters}
    rows = spend(conn, [bucket, "model"], **common)
    buckets = _every_bucket(bucket, start, end, ZoneInfo(selection.tz), {r[bucket] for r in rows})
    index = {b: i for i, b in enumerate(buckets)}
    totals: dict[str, Decimal] = defaultdict(Decimal)
    for row in rows:
        totals[row["model"]] += row["cost_usd"] or 0
    ranked = sorted((m for m in totals if totals[m] > 0), key=lambda m: (-totals[m], m))
    named = set(ranked[:_NAMED_MODELS])
    series: dict[str, list[Decimal]] = {}
    cached, inputs = [0] * len(buckets), [0] * len(buckets)
    savings = [Decimal(0)] * len(buckets)
    for row in rows:
        i = index[row[bucket]]
        cached[i] += row["cached_input_tokens"] or 0
        inputs[i] += row["input_tokens"] or 0
        savings[i] += row["cache_savings_usd"] or 0
        if row["cost_usd"]:
            name = row["model"] if row["model"] in named else charts.OTHER
            series.setdefault(name, [Decimal(0)] * len(buckets))[i] += row["cost_usd"]
    order = [m for m in ranked if m in named] + ([charts.OTHER] if charts.OTHER in series else [])
    keys = spend(conn, ["key"], top=top_keys, **common)
    return {
        "start": start,
        "end": end,
        "tz": selection.tz,
        "bucket": bucket,
        "buckets": buckets,
        "models": [(m, sum(series[m], Decimal(0))) for m in order],
        "spend_by_model": {m: series[m] for m in order},
        "hit_rate": [Decimal(c) / n if n else None for c, n in zip(cached, inputs, strict=True)],
        "savings": savings,
        "top_keys": [(str(r["key"]), r["cost_usd"]) for r in keys if r["cost_usd"]],
    }


def _every_bucket(bucket: str, start: dt.datetime, end: dt.datetime, zone: ZoneInfo, found: set[Any]) -> list[Any]:
    """Every bucket from ``start`` to ``end`` (exclusive) as :func:`spend` labels them, with those ``found``."""
    local, last = start.astimezone(zone), (end - dt.timedelta(microseconds=1)).astimezone(zone)
    labels: set[Any] = set(found)
    if bucket == "hour":
        at = start
        while at < end:  # step UTC hours, label each by the local hour it falls in
            hour = at.astimezone(zone).replace(minute=0, second=0, microsecond=0)
            labels.add(hour.isoformat(timespec="minutes"))
            at += dt.timedelta(hours=1)
        return sorted(labels, key=dt.datetime.fromisoformat)
    if bucket == "month":
        year, month = local.year, local.month
        while (year, month) <= (last.year, last.month):
            labels.add(f"{year:04d}-{month:02d}")
            year, month = (year + 1, 1) if month == 12 else (year, month + 1)
        return sorted(labels)
    day, step = local.date(), dt.timedelta(days=1 if bucket == "day" else 7)
    if bucket == "week":
        day -= dt.timedelta(days=day.weekday())
    while day <= last.date():
        labels.add(day)
        day += step
    return sorted(labels)


def _short(bucket: str, label: Any) -> str:
    """An axis label: ``Nov 3``, ``Nov 3 14:00``, ``Nov 2026``."""
    if bucket == "hour":
        at = dt.datetime.fromisoformat(label)
        return f"{_MONTHS[at.month - 1]} {at.day} {at:%H:%M}"
    if bucket == "month":
        year, month = label.split("-")
        return f"{_MONTHS[int(month) - 1]} {year}"
    return f"{_MONTHS[label.month - 1]} {label.day}"


def _long(bucket: str, label: Any) -> str:
    return f"week of {label}" if bucket == "week" else str(label)


def _money(values: Sequence[Decimal | None]) -> list[str]:
    """Amounts as one column shows them (same decimals)."""
    return column_texts(Column("", "", "usd"), list(values))


def _chart_section(data: dict[str, Any]) -> tuple[str, str]:
    """The spend-over-time chart (wide, with its legend) and the other charts."""
    bucket, buckets = data["bucket"], data["buckets"]
    short = [_short(bucket, b) for b in buckets]
    every = charts.colours([m for m, _ in data["models"]])
    places = usd_places(max((max(v) for v in data["spend_by_model"].values()), default=Decimal(0)))
    over_time = charts.stacked_bars(
        f"Spend by model per {bucket}",
        short,
        [charts.Series(m, every[m], v) for m, v in data["spend_by_model"].items()],
        lambda i, name, value: f"{_long(bucket, buckets[i])} · {name}: {usd(value, places)}",
    )
    amounts = _money([cost for _, cost in data["models"]])
    legend = "".join(
        f'<li><span class="swatch" style="background:{every[m]}"></span>{html.escape(m)} '
        f'<span class="amount">{html.escape(a)}</span></li>'
        for (m, _), a in zip(data["models"], amounts, strict=True)
    )
    wide = _figure(f"Spend by model per {bucket}", over_time + f'<ul class="legend">{legend}</ul>', "spend-over-time")
    by_model = charts.ranked_bars(
        "Spend by model", [(m, c, every[m], a) for (m, c), a in zip(data["models"], amounts, strict=True)]
    )
    key_amounts = _money([c for _, c in data["top_keys"]])
    top_keys = charts.ranked_bars(
        "Top keys by spend",
        [(k, c, charts.PALETTE[0], a) for (k, c), a in zip(data["top_keys"], key_amounts, strict=True)],
    )
    hit = charts.line(
        f"Cache hit rate per {bucket}",
        short,
        [None if r is None else r * 100 for r in data["hit_rate"]],
        lambda i, v: f"{_long(bucket, buckets[i])}: {v:.1f}% of input tokens from the cache",
    )
    saved_places = usd_places(max(data["savings"], default=Decimal(0)))
    saved = charts.stacked_bars(
        f"Cache savings per {bucket}",
        short,
        [charts.Series("saved", charts.PALETTE[4], data["savings"])],
        lambda i, _, v: f"{_long(bucket, buckets[i])}: saved {usd(v, saved_places)}",
        width=470,
        height=240,
    )
    if not data["models"]:
        by_model = top_keys = '<p class="note">No priced request in this range.</p>'
    rest = (
        _figure("Spend by model", by_model, "spend-by-model")
        + _figure(f"Top {len(data['top_keys'])} keys by spend", top_keys, "top-keys")
        + _figure(f"Cache hit rate per {bucket} (cached / input tokens)", hit, "cache-hit-rate")
        + _figure(f"Cache savings per {bucket}", saved, "cache-savings")
    )
    return wide, rest


def _figure(caption: str, body: str, ident: str) -> str:
    wide = " wide" if ident == "spend-over-time" else ""
    return f'<figure class="chart{wide}" id="{ident}"><h2>{html.escape(caption)}</h2>{body}</figure>'


def _card(name: str, label: str, value: str, detail: str = "", warn: bool = False) -> str:
    classes = "figure" + (" warn" if warn else "")
    return (
        f'<div class="{classes}" data-figure="{name}" title="{html.escape(value)}">'
        f'<span class="label">{html.escape(label)}</span><span class="value">{html.escape(value)}</span>'
        f'<span class="detail">{html.escape(detail)}</span></div>'
    )


def _period(data: dict[str, Any]) -> tuple[str, str]:
    """The range as its card shows it: ``30 days`` and ``2026-11-01 to 2026-11-30 · Europe/Paris``."""
    start, end, zone = data["start"], data["end"], ZoneInfo(data["tz"])
    first, last = start.astimezone(zone), (end - dt.timedelta(microseconds=1)).astimezone(zone)
    hours = (end - start).total_seconds() / 3600
    length = f"{hours / 24:.0f} days" if hours >= 72 else f"{hours:.0f} hours" if hours >= 1.5 else "1 hour"
    if first.date() == last.date():
        return length, f"{first:%Y-%m-%d %H:%M} to {end.astimezone(zone):%H:%M} · {zone.key}"
    return length, f"{first:%Y-%m-%d} to {last:%Y-%m-%d} · {zone.key}"


def _summary(totals: dict[str, Any], data: dict[str, Any]) -> str:
    cost, saved = totals.get("cost_usd"), totals.get("cache_savings_usd")
    inputs, outputs = totals.get("input_tokens") or 0, totals.get("output_tokens") or 0
    unpriced, rate = totals.get("unpriced_requests") or 0, totals.get("cache_hit_rate")
    cards = [
        _card(
            "spend",
            "Total spend",
            "-" if cost is None else usd(cost, usd_places(cost)),
            f"{totals.get('priced_requests') or 0:,} priced requests",
        ),
        _card("requests", "Requests", f"{totals.get('requests') or 0:,}", "every request that reached tokenward"),
        _card("tokens", "Tokens", f"{inputs + outputs:,}", f"{inputs:,} in · {outputs:,} out"),
        _card(
            "cache_hit_rate",
            "Cache hit rate",
            "-" if rate is None else f"{rate * 100:.1f}%",
            f"{totals.get('cached_input_tokens') or 0:,} of {inputs:,} input tokens",
        ),
        _card(
            "cache_savings", "Cache savings", "-" if saved is None else usd(saved, usd_places(saved)), "by cached input"
        ),
        _card(
            "unpriced",
            "Unpriced requests",
            f"{unpriced:,}",
            f"{totals.get('unpriced_tokens') or 0:,} tokens with no price" if unpriced else "every request priced",
            warn=bool(unpriced),
        ),
    ]
    if data.get("start") is not None and data.get("end") is not None:
        cards.append(_card("period", "Period", *_period(data)))
    return f'<section class="summary">{"".join(cards)}</section>'


def _runs_out(status: BudgetStatus) -> str:
    """When the budget's limit is reached at its average burn rate so far (calendar periods only)."""
    if status.spent >= status.budget.limit_usd:
        return "limit reached"
    if status.forecast is None or not status.spent:
        return ""
    elapsed = status.at - status.start
    at = status.start + elapsed * float(status.budget.limit_usd / status.spent)
    if at >= status.end:
        return "stays within the limit at this rate"
    local = at.astimezone(ZoneInfo(status.budget.period.timezone))
    return f"runs out about {local:%Y-%m-%d %H:%M} ({local.tzname()})"


def _budget(status: BudgetStatus) -> str:
    limit = status.budget.limit_usd
    spent, limit_text, forecast = _money([status.spent, limit, status.forecast])  # one number of decimals
    used = min(status.percent, Decimal(100))
    level = "over" if status.percent >= 100 else ("near" if status.percent >= 80 else "")
    parts = [f"{spent} of {limit_text} ({status.percent:.1f}%)"]
    marker = ""
    if status.forecast is not None:
        share = status.forecast / limit * 100
        parts.append(f"forecast {forecast} ({share:.1f}%{', over' if share > 100 else ''})")
        marker = f'<span class="forecast" style="left:{min(share, Decimal(100)):.1f}%"></span>'
    parts.append(_runs_out(status))
    period = status.budget.period
    return (
        f'<div class="budget" data-budget="{html.escape(status.budget.name)}">'
        f"<strong>{html.escape(status.budget.name)}</strong> "
        f'<span class="detail">{html.escape(status.budget.describe_scope())} · {period.kind} ({period.timezone})'
        f"{' · blocking' if status.budget.blocking else ''}</span>"
        f'<div class="track" title="{html.escape(" · ".join(p for p in parts if p))}">'
        f'<span class="used {level}" style="width:{used:.1f}%"></span>{marker}</div>'
        f'<span class="detail">{html.escape(" · ".join(p for p in parts if p))}</span></div>'
    )


def _table(rows: list[dict[str, Any]], totals: dict[str, Any] | None, columns: list[Column]) -> str:
    texts = []
    for column in columns:
        values = [r.get(column.key) for r in rows]
        if column.kind == "dim":
            texts.append(["-" if v is None else str(v) for v in values])
        else:
            texts.append(column_texts(column, values + [(totals or {}).get(column.key)]))
    kind = ['' if c.kind == "dim" else ' class="n"' for c in columns]
    head = "".join(f"<th{k}>{html.escape(c.title)}</th>" for c, k in zip(columns, kind, strict=True))
    body = "".join(
        "<tr>" + "".join(f"<td{k}>{html.escape(t[i])}</td>" for t, k in zip(texts, kind, strict=True)) + "</tr>"
        for i in range(len(rows))
    )
    foot = ""
    if totals is not None:
        cells = [
            ("total" if i == 0 else "") if c.kind == "dim" else html.escape(t[-1])
            for i, (c, t) in enumerate(zip(columns, texts, strict=True))
        ]
        foot = "<tfoot><tr>" + "".join(f"<td{k}>{x}</td>" for x, k in zip(cells, kind, strict=True)) + "</tr></tfoot>"
    return f'<div class="table"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody>{foot}</table></div>'


def write_html(
    path: Path,
    title: str,
    subtitle: str,
    rows: list[dict[str, Any]],
    totals: dict[str, Any] | None,
    columns: list[Column],
    data: dict[str, Any],
    notes: list[str],
    *,
    budgets: Sequence[BudgetStatus] = (),
) -> None:
    """Write the page: summary figures, notes, charts, budgets, then the report table (folded when long).

    ``data`` is :func:`charts_data`'s; ``totals`` the report's totals (:func:`queries.spend_totals`);
    ``budgets`` the configured budgets' status now.

    Raises:
        OSError: ``path`` cannot be written.
    """
    summary = _summary(totals or {}, data)
    if data.get("buckets"):
        wide, rest = _chart_section(data)
    else:
        wide, rest = '<p class="note">No requests in this range: nothing to chart.</p>', ""
    budget_html = ""
    if budgets:
        at = budgets[0].at.astimezone(ZoneInfo(data.get("tz") or "UTC"))
        budget_html = (
            f'<figure class="chart wide" id="budgets"><h2>Budgets now ({at:%Y-%m-%d %H:%M %Z})</h2>'
            + "".join(_budget(s) for s in budgets)
            + "</figure>"
        )
    opened = " open" if len(rows) <= _OPEN_TABLE_ROWS else ""
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="sub">{html.escape(subtitle)}</p>
{summary}
{'<section class="notes">' + "".join(f"<p>{html.escape(n)}</p>" for n in notes) + "</section>" if notes else ""}
<section class="charts">{wide}{budget_html}{rest}</section>
<details id="report-table"{opened}><summary>Report table: {len(rows):,} rows</summary>
{_table(rows, totals, columns)}</details>
</body></html>
"""
    path.write_text(page, encoding="utf-8")
