"""``tokenward report``: spend, tokens, cache savings and cost per request, grouped and compared.

The SQL is in :mod:`tokenward.reports.queries`, the views (periods, comparison, forecast) in
:mod:`tokenward.reports.views`, the what-if in :mod:`tokenward.reports.whatif`, the formats in
:mod:`tokenward.reports.render` and :mod:`tokenward.reports.html_report`.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path
from typing import Any, TextIO
from zoneinfo import ZoneInfo

import click
from rich.console import Console

from tokenward.pricing.budgets import Budget, BudgetStatus
from tokenward.reports import columnar, html_report, progress, queries, render, views, whatif
from tokenward.reports.cli_common import ledger_options, open_read_only, parse_when, range_options, zone_named
from tokenward.reports.sanitize import printable

__all__ = ["TABLE_ROWS", "report"]

TABLE_ROWS = 1000
"""Groups a terminal table shows at most without ``--top``: past that, the dearest, with a line
saying how many were left out (``--format csv``, ``json``, ``parquet`` and ``markdown`` give every group)."""


def _filters(values: tuple[str, ...]) -> dict[str, list[str]]:
    filters: dict[str, list[str]] = {}
    for text in values:
        name, sep, wanted = text.partition("=")
        if not sep or not name.strip() or not wanted.strip():
            raise click.BadParameter(f"{text!r} is not DIMENSION=VALUE[,VALUE...]", param_hint="--where")
        filters.setdefault(name.strip(), []).extend(v.strip() for v in wanted.split(",") if v.strip())
    return filters


@click.command()
@ledger_options
@range_options
@click.option(
    "--period",
    type=click.Choice(views.PERIODS),
    help="A calendar period in --tz instead of --since/--until (this-month: the 1st to now).",
)
@click.option(
    "--by",
    default=None,
    help=f"Comma-separated groupings (default model,day; key with --top): {', '.join(queries.DIMENSIONS)}.",
)
@click.option(
    "--where",
    "where",
    multiple=True,
    metavar="DIM=VALUE[,VALUE]",
    help="Keep only these rows (repeatable; values are alternatives), e.g. team=research, tag=nightly.",
)
@click.option(
    "--top", type=click.IntRange(min=1, max=1_000_000), help="Only the N groups that cost the most, highest first."
)
@click.option("--compare", is_flag=True, help="Add the previous period's cost and the change in %.")
@click.option("--forecast", is_flag=True, help="Add each group's cost projected to the period's end, and budgets.")
@click.option("--as-model", "as_model", help="What-if: the same traffic priced as MODEL (e.g. gpt-5-mini).")
@click.option("--as-provider", "as_provider", help="Catalog provider of --as-model.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "csv", "json", "markdown", "parquet"]),
    default="table",
    show_default=True,
)
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="Write to this file (required for parquet).")
@click.option("--html", "html_file", type=click.Path(dir_okay=False), help="Also write a self-contained HTML page.")
@click.option(
    "--columns",
    "columns_text",
    help="Measures to show: all, or comma-separated keys (default for the table: requests, input_tokens, "
    "output_tokens, cost_usd, cache_hit_rate, cache_savings_usd, avg_cost_usd, p95_cost_usd, unpriced_requests; "
    "other formats: all).",
)
@click.option("--drift", is_flag=True, help="Add the provider-reported cost (OpenRouter) and its drift from ours.")
@click.option("--prices", multiple=True, type=click.Path(exists=True, dir_okay=False), help="Extra price file.")
@click.option("--at", "at_text", help="Take this instant (ISO datetime) as now (for --period, --forecast, 7d).")
def report(
    db: str | None,
    config: str | None,
    wait: float,
    since: str | None,
    until: str | None,
    tz: str,
    period: str | None,
    by: str | None,
    where: tuple[str, ...],
    top: int | None,
    compare: bool,
    forecast: bool,
    as_model: str | None,
    as_provider: str | None,
    fmt: str,
    output: str | None,
    html_file: str | None,
    columns_text: str | None,
    drift: bool,
    prices: tuple[str, ...],
    at_text: str | None,
) -> None:
    """Spend, tokens, cache savings and cost per request, grouped (--by) over a time range.

    \b
    Examples:
      tokenward report --period this-month --by team --compare
      tokenward report --since 7d --by key --top 10
      tokenward report --period this-month --by model --forecast --config config.yaml
      tokenward report --since 30d --where team=research --by model --as-model gpt-5-mini
      tokenward report --since 30d --by day,model --html spend.html
    """  # noqa: D301 - "\b" is click's "keep these lines as they are" mark
    zone = zone_named(tz)
    now = (parse_when(at_text, zone, hint="--at") if at_text else None) or dt.datetime.now(dt.UTC)
    if fmt == "parquet" and not output:
        raise click.UsageError("--format parquet needs --output FILE")
    if forecast and period is None:
        if since or until:
            raise click.UsageError(
                "--forecast projects a calendar period under way: use --period this-month "
                "(or today, this-week) instead of --since/--until"
            )
        period = "this-month"
    calendar = None
    try:
        if period is not None:
            if since or until:
                raise click.UsageError("give --period or --since/--until, not both")
            calendar = views.calendar_range(period, tz, now)
            start, end = calendar.since, calendar.until
        else:
            start, end = parse_when(since, zone, now, hint="--since"), parse_when(until, zone, now, hint="--until")
        if start is not None and end is not None and start >= end:
            raise click.UsageError(f"--since ({start.isoformat()}) must come before --until ({end.isoformat()})")
        if forecast and (calendar is None or not calendar.to_date):
            raise click.UsageError("--forecast needs a period under way: --period today, this-week or this-month")
        default = "key" if top else ("model" if compare else "model,day")
        try:
            dims = [queries.canonical(d.strip()) for d in (by or default).split(",") if d.strip()]
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--by") from exc
        if compare and start is None:
            raise click.UsageError("--compare needs a range to compare: --period or --since")
        if compare and any(d in queries.TIME_DIMENSIONS for d in dims):
            raise click.UsageError("--compare matches groups across periods: group by something other than time")
        try:
            selection = queries.Selection(start, end, _filters(where), tz)
        except ValueError as exc:  # an unknown filter, or one on time
            raise click.BadParameter(str(exc), param_hint="--where") from exc
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    if columns_text and columns_text.strip() != "all":
        measures: tuple[str, ...] = tuple(m.strip() for m in columns_text.split(",") if m.strip())
    else:
        measures = render.COMPACT if fmt == "table" and not columns_text else render.MEASURE_KEYS
    try:
        columns = render.columns_for(
            dims, measures=measures, compare=compare, forecast=forecast, as_model=as_model, drift=drift
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--columns") from exc
    chosen = bool(columns_text)
    every = not chosen or columns_text.strip() == "all"  # all: the default's every measure, none left out
    conn = open_read_only(db, config, wait)
    notes: list[str] = []
    try:
        with progress.shown(conn):
            made = None
            if fmt in ("csv", "json", "parquet") and not (compare or forecast or as_model or html_file):
                made = _made_by_duckdb(conn, dims, selection, columns, fmt, output, top, drift, every)
            if made is None:
                shown = TABLE_ROWS if fmt == "table" and not html_file else None
                rows, totals = queries.spend_report(conn, dims, selection, top=top, drift=drift, shown=shown)
                groups = totals.pop("groups", len(rows))
                if groups > len(rows):
                    notes.append(
                        f"showing the {len(rows):,} groups that cost the most of {groups:,}, highest first "
                        "(--top N for another number; --format csv, json or parquet for every group)"
                    )
                if compare and start is not None:
                    before, after = views.previous_range(start, end or now, calendar, tz)
                    earlier = queries.Selection(before, after, selection.filters, tz)
                    previous, previous_total = queries.group_costs(conn, dims, earlier)
                    views.add_change(rows, previous, dims)
                    views.add_change([totals], [{"cost_usd": previous_total}], [])
                    notes.append(f"compared with {_span(before, after, zone)}")
                if forecast and calendar is not None:
                    views.add_forecast(rows, calendar)
                    views.add_forecast([totals], calendar)
                if as_model:
                    _add_what_if(conn, config, prices, as_model, as_provider, dims, selection, rows, totals, notes)
                chart_data = html_report.charts_data(conn, selection) if html_file else None
                statuses = _statuses(conn, _budgets(config), now) if html_file else []
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    finally:
        conn.close()
    if made is not None:
        _emit_made(made, output)
        return
    span = _span(start, end, zone) if (start or end) else "all time"
    title = f"tokenward spend by {', '.join(dims) or 'total'}"
    notes += _row_notes(totals)
    if "tag" in dims:
        notes.append("a request with several tags is counted under each; the total counts it once")
    if html_file:
        try:
            html_report.write_html(
                Path(html_file), title, span, rows, totals, columns, chart_data or {}, notes, budgets=statuses
            )
        except OSError as exc:
            raise click.ClickException(f"cannot write {html_file}: {exc.strerror or exc}") from exc
        click.echo(f"wrote {html_file}", err=True)
    _emit(rows, totals, columns, fmt, output, title, span, notes, everything=every, chosen=chosen)
    if forecast and fmt == "table":
        _budget_forecasts(db, config, wait, now)


def _span(start: dt.datetime | None, end: dt.datetime | None, zone: ZoneInfo) -> str:
    def shown(value: dt.datetime | None, default: str) -> str:
        return value.astimezone(zone).isoformat(timespec="minutes") if value else default

    return f"{shown(start, 'the beginning')} to {shown(end, 'now')} ({zone.key})"


def _row_notes(totals: dict[str, Any]) -> list[str]:
    notes = []
    if totals.get("unpriced_requests"):
        notes.append(
            f"{totals['unpriced_requests']} request(s) are unpriced or only partly priced "
            f"({totals['unpriced_tokens']:,} unpriced tokens), not (fully) in the dollar total: add prices "
            "(pricing.files), then `tokenward pricing reprice`."
        )
    if totals.get("usage_unknown_requests"):
        notes.append(
            f"{totals['usage_unknown_requests']} request(s) may have been billed but got no reply, "
            "so their usage is unknown."
        )
    if totals.get("fallback_priced_requests"):
        notes.append(f"{totals['fallback_priced_requests']} request(s) are priced at the configured fallback rates.")
    if totals.get("estimated_requests"):
        notes.append(
            f"{totals['estimated_requests']} request(s) have estimated or partial token counts "
            "(the upstream reported none)."
        )
    return notes


def _add_what_if(
    conn: Any,
    config: str | None,
    prices: tuple[str, ...],
    model: str,
    provider: str | None,
    dims: list[str],
    selection: queries.Selection,
    rows: list[dict[str, Any]],
    totals: dict[str, Any],
    notes: list[str],
) -> None:
    from tokenward.reports.pricing_cli import load_configured_catalog

    catalog, _ = load_configured_catalog(config, prices)
    result = whatif.what_if(conn, catalog, model, dims, selection, provider=provider, progress=progress.report)
    for row in [*rows, totals]:
        key = tuple(row.get(d) for d in dims) if row is not totals else None
        cost = result.total if key is None else result.by_group.get(key)
        cost = None if cost is None else cost.quantize(Decimal("1e-12"))
        row["as_model_cost_usd"] = cost
        actual = row.get("cost_usd")
        row["as_model_change_pct"] = (
            ((cost - actual) / actual * 100).quantize(Decimal("0.01")) if cost is not None and actual else None
        )
    notes.append(
        f"as {model}: every row with usage priced at {result.entry_id} (today's version, the row's own service tier"
        " and time); rows unpriced under their own model are included"
    )


def _made_by_duckdb(
    conn: Any,
    dims: list[str],
    selection: queries.Selection,
    columns: list[render.Column],
    fmt: str,
    output: str | None,
    top: int | None,
    drift: bool,
    everything: bool,
) -> tuple[str | None, int] | None:
    """A CSV or JSON report's text, or a Parquet file written, straight from DuckDB (:mod:`columnar`).

    The same bytes as :func:`_emit` writes from the rows, without building them (200,000 sessions:
    most of the report's time). Returns the text (``None`` for Parquet, already written) and the
    number of groups, or ``None`` when the report is not covered (nothing written).
    """
    if fmt != "parquet":
        return columnar.report_text(conn, dims, selection, columns, fmt, top=top, drift=drift, everything=everything)
    import duckdb

    try:
        count = columnar.report_parquet(
            conn, dims, selection, columns, Path(output or ""), top=top, drift=drift, everything=everything
        )
    except duckdb.IOException as exc:  # an unwritable path, as render.to_parquet reports it
        raise click.ClickException(f"cannot write {output}: {exc}") from exc
    return None if count is None else (None, count)


def _emit_made(made: tuple[str | None, int], output: str | None) -> None:
    """Write out what :func:`_made_by_duckdb` made, as :func:`_emit` writes the same report."""
    text, count = made
    if text is not None and not output:
        click.echo(text, nl=False)
        return
    if text is not None:
        try:
            Path(output or "").write_text(text, encoding="utf-8")
        except OSError as exc:
            raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}") from exc
    click.echo(f"wrote {count} rows to {output}", err=True)


def _emit(
    rows: list[dict[str, Any]],
    totals: dict[str, Any],
    columns: list[render.Column],
    fmt: str,
    output: str | None,
    title: str,
    span: str,
    notes: list[str],
    *,
    everything: bool = True,
    chosen: bool = False,
) -> None:
    if fmt == "parquet":
        try:
            render.to_parquet(rows, columns, Path(output or ""), everything=everything)
        except Exception as exc:  # duckdb raises IOException and friends for unwritable paths
            raise click.ClickException(f"cannot write {output}: {exc}") from exc
        click.echo(f"wrote {len(rows)} rows to {output}", err=True)
        return
    if fmt == "table":
        out = _open_out(output)
        console = Console(width=render.output_width(out), file=out)
        if not rows:
            console.print(f"no requests in this range ({span})", markup=False)
            return
        left_out = render.to_table(rows, totals, columns, console, f"{title}, {span}", fit=not chosen)
        if left_out:
            notes = [
                f"left out to fit {console.width} columns: {', '.join(c.title for c in left_out)} "
                "(--columns all shows every measure)",
                *notes,
            ]
        for note in notes:
            console.print(note, markup=False, highlight=False)
        return
    text = {
        "csv": lambda: render.to_csv(rows, columns, everything=everything),
        "json": lambda: render.to_json(rows, columns, everything=everything),
        "markdown": lambda: (
            f"## {title}\n\n{span}\n\n" + render.to_markdown(rows, totals, columns) + "".join(f"\n{n}\n" for n in notes)
        ),
    }[fmt]()
    if output:
        try:
            Path(output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}") from exc
        click.echo(f"wrote {len(rows)} rows to {output}", err=True)
    else:
        click.echo(text, nl=False)


def _open_out(output: str | None) -> TextIO | None:
    if not output:
        return None
    try:
        return open(output, "w", encoding="utf-8")  # noqa: SIM115 - closed at exit by the interpreter
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}") from exc


def _budget_forecasts(db: str | None, config: str | None, wait: float, now: dt.datetime) -> None:
    """Print each configured budget's spend, limit and forecast (the forecast view's second half)."""
    budgets = _budgets(config)
    if not budgets:
        return
    conn = open_read_only(db, config, wait)
    try:
        statuses = _statuses(conn, budgets, now)
    finally:
        conn.close()
    rows = [
        {
            "budget": s.budget.name,
            "scope": s.budget.describe_scope(),
            "period": s.budget.period.kind,
            "spent": s.spent,
            "limit": s.budget.limit_usd,
            "forecast": s.forecast,
            "share": "-"
            if s.forecast is None
            else f"{s.forecast / s.budget.limit_usd * 100:.1f}%" + (" (over)" if s.forecast_exceeds else ""),
        }
        for s in statuses
    ]
    columns = [render.Column(k, k, "dim") for k in ("budget", "scope", "period")] + [
        render.Column("spent", "spent", "usd"),
        render.Column("limit", "limit", "usd"),
        render.Column("forecast", "forecast", "usd", "fcst"),
        render.Column("share", "forecast/limit", "dim", "fcst/limit"),
    ]
    width = render.output_width()
    texts = {c.key: render.column_texts(c, [row[c.key] for row in rows]) for c in columns}
    natural = sum(max([len(c.heading), *map(len, texts[c.key])]) + 3 for c in columns) + 1
    if natural <= width:
        render.to_table(rows, None, columns, Console(width=width), "budgets")
        return
    # narrower than the table: names folded into slivers are unreadable, so one block per budget
    click.echo("\nbudgets")
    for i, row in enumerate(rows):
        share = "" if row["share"] == "-" else f", {row['share']} of the limit"
        click.echo(f"{printable(row['budget'])}: {texts['spent'][i]} of {texts['limit'][i]}")
        click.echo(f"  forecast  {texts['forecast'][i]}{share}")
        click.echo(f"  scope     {printable(row['scope'])}")
        click.echo(f"  period    {row['period']}")


def _statuses(conn: Any, budgets: list[Budget], now: dt.datetime) -> list[BudgetStatus]:
    from tokenward.reports.budget_check import status_of
    from tokenward.reports.ledger.spend import DuckSpend

    spend = DuckSpend(conn)
    return [status_of(spend, budget, now) for budget in budgets]


def _budgets(config: str | None) -> list[Budget]:
    """The budgets of ``config`` (none without one)."""
    from tokenward.reports.budgets_cli import load_sections

    return load_sections(config)[0]
