"""``tokenward report``, ``tokenward export`` and ``tokenward ledger``: reading the ledger.

They work whether or not the proxy runs: the proxy only holds the DuckDB file for a moment
each flush, and these commands open it read-only, waiting (``--wait``) while a flush is under
way. The ledger is named by ``--db PATH`` or by the ``ledger.path`` of ``--config FILE``.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import json
import re
import sys
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any, TextIO, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import click
import yaml
from rich.console import Console
from rich.table import Table

from tokenward.reports import html_report, migrations, progress, queries, render, views, whatif
from tokenward.reports.ledger import LedgerError, open_ledger

__all__ = ["export", "ledger", "ledger_path", "parse_when", "report"]

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_LEDGER = "tokenward.duckdb"
_RELATIVE = re.compile(r"^(\d+)\s*([mhdw])$")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def ledger_path(db: str | None, config: str | None) -> str:
    """The ledger file named by ``--db``, else by the config file's ``ledger.path``, else the default.

    Raises:
        click.BadParameter: the config file cannot be read.
    """
    if db:
        return db
    if config:
        try:
            document = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise click.BadParameter(f"cannot read {config}: {exc}", param_hint="--config") from exc
        path = (document.get("ledger") or {}).get("path") or DEFAULT_LEDGER
        return str(Path(config).resolve().parent / path)
    return DEFAULT_LEDGER


def parse_when(text: str | None, tz: ZoneInfo, now: dt.datetime | None = None) -> dt.datetime | None:
    """Parse a time bound.

    Accepts ``2026-11-01`` (midnight in ``tz``), an ISO datetime (naive = ``tz``), or a duration
    before ``now`` such as ``30m``, ``24h``, ``7d``, ``2w``.

    Raises:
        click.BadParameter: unparseable text.
    """
    if text is None:
        return None
    now = now or dt.datetime.now(dt.UTC)
    match = _RELATIVE.match(text.strip())
    if match:
        return now - dt.timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a date, datetime or duration like 7d") from exc
    return value if value.tzinfo else value.replace(tzinfo=tz)


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise click.BadParameter(f"unknown time zone {name!r}", param_hint="--tz") from exc


def _ledger_options(fn: F) -> F:
    fn = click.option("--wait", default=10.0, show_default=True, help="Seconds to wait while the proxy is writing.")(fn)
    fn = click.option("--config", "config", type=click.Path(dir_okay=False), help="Config file naming the ledger.")(fn)
    fn = click.option("--db", type=click.Path(dir_okay=False), help="Ledger DuckDB file.")(fn)
    return fn


def _range_options(fn: F) -> F:
    fn = click.option("--tz", default="UTC", show_default=True, help="IANA time zone for dates and days.")(fn)
    fn = click.option("--until", help="End (exclusive): date, ISO datetime or duration ago.")(fn)
    fn = click.option("--since", help="Start (inclusive): date, ISO datetime or duration ago (7d).")(fn)
    return fn


def _open(db: str | None, config: str | None, wait: float) -> Any:
    try:
        conn = open_ledger(ledger_path(db, config), read_only=True, wait_s=wait)
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from exc
    # progress is drawn by reports/progress.py (one bar, also for work done in Python), not DuckDB
    conn.execute("SET enable_progress_bar = true")
    conn.execute("SET enable_progress_bar_print = false")
    return conn


def _filters(values: tuple[str, ...]) -> dict[str, list[str]]:
    filters: dict[str, list[str]] = {}
    for text in values:
        name, sep, wanted = text.partition("=")
        if not sep or not name.strip() or not wanted.strip():
            raise click.BadParameter(f"{text!r} is not DIMENSION=VALUE[,VALUE...]", param_hint="--where")
        filters.setdefault(name.strip(), []).extend(v.strip() for v in wanted.split(",") if v.strip())
    return filters


@click.command()
@_ledger_options
@_range_options
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
@click.option("--top", type=click.IntRange(min=1), help="Only the N groups that cost the most, highest first.")
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
@click.option("--at", "at_text", help="Take this instant (ISO datetime) as now, for --period and --forecast.")
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
    r"""Spend, tokens, cache savings and cost per request, grouped (--by) over a time range.

    \b
    Examples:
      tokenward report --period this-month --by team --compare
      tokenward report --since 7d --by key --top 10
      tokenward report --period this-month --by model --forecast --config config.yaml
      tokenward report --since 30d --where team=research --by model --as-model gpt-5-mini
      tokenward report --since 30d --by day,model --html spend.html
    """
    zone = _zone(tz)
    now = (parse_when(at_text, zone) if at_text else None) or dt.datetime.now(dt.UTC)
    if fmt == "parquet" and not output:
        raise click.UsageError("--format parquet needs --output FILE")
    if forecast and period is None:
        period = "this-month"
    calendar = None
    try:
        if period is not None:
            if since or until:
                raise click.UsageError("give --period or --since/--until, not both")
            calendar = views.calendar_range(period, tz, now)
            start, end = calendar.since, calendar.until
        else:
            start, end = parse_when(since, zone), parse_when(until, zone)
        if forecast and (calendar is None or not calendar.to_date):
            raise click.UsageError("--forecast needs a period under way: --period today, this-week or this-month")
        dims = [queries.canonical(d.strip()) for d in (by or ("key" if top else "model,day")).split(",") if d.strip()]
        if compare and (start is None or any(d in queries.TIME_DIMENSIONS for d in dims)):
            raise click.UsageError(
                "--compare needs --period or --since, and groups that are not hours/days/weeks/months"
            )
        selection = queries.Selection(start, end, _filters(where), tz)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    conn = _open(db, config, wait)
    notes: list[str] = []
    try:
        with progress.shown(conn):
            rows = queries.spend(
                conn, dims, since=start, until=end, tz=tz, filters=selection.filters, top=top, drift=drift
            )
            partition = rows if not top and "tag" not in dims else None
            totals = queries.spend_totals(conn, selection, groups=partition, drift=drift)
            if compare and start is not None:
                before, after = views.previous_range(start, end or now, calendar, tz)
                previous = queries.spend(conn, dims, since=before, until=after, tz=tz, filters=selection.filters)
                views.add_change(rows, previous, dims)
                if "tag" in dims:  # tag groups overlap: read the total again
                    earlier = queries.Selection(before, after, selection.filters, tz)
                    previous_total = queries.spend_totals(conn, earlier).get("cost_usd")
                else:
                    costs = [r["cost_usd"] for r in previous if r["cost_usd"] is not None]
                    previous_total = sum(costs, Decimal(0)) if costs else None
                views.add_change([totals], [{"cost_usd": previous_total}], [])
                notes.append(f"compared with {_span(before, after, zone)}")
            if forecast and calendar is not None:
                views.add_forecast(rows, calendar)
                views.add_forecast([totals], calendar)
            if as_model:
                _add_what_if(conn, config, prices, as_model, as_provider, dims, selection, rows, totals, notes)
            chart_data = html_report.charts_data(conn, selection) if html_file else None
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    finally:
        conn.close()
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
    span = _span(start, end, zone) if (start or end) else "all time"
    title = f"tokenward spend by {', '.join(dims) or 'total'}"
    notes += _row_notes(totals)
    if "tag" in dims:
        notes.append("a request with several tags is counted under each; the total counts it once")
    if html_file:
        try:
            html_report.write_html(Path(html_file), title, span, rows, totals, columns, chart_data or {}, notes)
        except OSError as exc:
            raise click.ClickException(f"cannot write {html_file}: {exc.strerror or exc}") from exc
        click.echo(f"wrote {html_file}", err=True)
    _emit(rows, totals, columns, fmt, output, title, span, notes)
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


def _emit(
    rows: list[dict[str, Any]],
    totals: dict[str, Any],
    columns: list[render.Column],
    fmt: str,
    output: str | None,
    title: str,
    span: str,
    notes: list[str],
) -> None:
    if fmt == "parquet":
        try:
            render.to_parquet(rows, columns, Path(output or ""))
        except Exception as exc:  # duckdb raises IOException and friends for unwritable paths
            raise click.ClickException(f"cannot write {output}: {exc}") from exc
        click.echo(f"wrote {len(rows)} rows to {output}", err=True)
        return
    if fmt == "table":
        console = Console(width=None if sys.stdout.isatty() and not output else 250, file=_open_out(output))
        if not rows:
            console.print(f"no requests in this range ({span})")
            return
        render.to_table(rows, totals, columns, console, f"{title}, {span}")
        for note in notes:
            console.print(note, soft_wrap=True)
        return
    text = {
        "csv": lambda: render.to_csv(rows, columns),
        "json": lambda: render.to_json(rows, columns),
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
    from tokenward.reports.budget_check import status_of
    from tokenward.reports.budgets_cli import load_sections

    budgets, _ = load_sections(config)
    if not budgets:
        return
    conn = _open(db, config, wait)
    try:
        statuses = [status_of(conn, budget, now) for budget in budgets]
    finally:
        conn.close()
    table = Table("budget", "scope", "period", "spent", "limit", "forecast", "forecast/limit", title="budgets")
    for s in statuses:
        share = f"{s.forecast / s.budget.limit_usd * 100:.1f}%" if s.forecast is not None else "-"
        table.add_row(
            s.budget.name,
            s.budget.describe_scope(),
            s.budget.period.kind,
            f"${s.spent:,.2f}",
            f"${s.budget.limit_usd:,.2f}",
            "-" if s.forecast is None else f"${s.forecast:,.2f}",
            share + (" (over)" if s.forecast_exceeds else ""),
        )
    Console(width=None if sys.stdout.isatty() else 200).print(table)


@click.command()
@_ledger_options
@_range_options
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl", show_default=True)
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help="File to write (default: stdout).")
def export(
    db: str | None,
    config: str | None,
    wait: float,
    since: str | None,
    until: str | None,
    tz: str,
    fmt: str,
    output: str | None,
) -> None:
    """Per-request ledger rows as JSON lines or CSV, with the canonical field names.

    Times are UTC (ISO 8601); --tz only says how --since/--until are read.
    """
    zone = _zone(tz)
    conn = _open(db, config, wait)
    count = 0
    try:
        rows = queries.export_rows(conn, since=parse_when(since, zone), until=parse_when(until, zone))
        try:
            target = open(output, "w", encoding="utf-8", newline="") if output else _stdout()  # noqa: SIM115
        except OSError as exc:
            raise click.ClickException(f"cannot write {output}: {exc.strerror or exc}") from exc
        with target as out:
            if fmt == "csv":
                writer = csv.DictWriter(out, fieldnames=list(queries.EXPORT_COLUMNS), lineterminator="\n")
                writer.writeheader()
                for row in rows:
                    writer.writerow({k: render.cell(v) for k, v in row.items()})
                    count += 1
            else:
                for row in rows:
                    out.write(json.dumps(row, default=render.json_default) + "\n")
                    count += 1
    finally:
        conn.close()
    if output:
        click.echo(f"wrote {count} rows to {output}", err=True)


@click.group()
def ledger() -> None:
    """Ledger maintenance."""


@ledger.command("migrate")
@click.option("--db", type=click.Path(dir_okay=False), help="Ledger DuckDB file.")
@click.option("--config", "config", type=click.Path(dir_okay=False), help="Config file naming the ledger.")
def migrate_command(db: str | None, config: str | None) -> None:
    """Create the ledger or bring its schema up to date (the proxy does this on start)."""
    path = ledger_path(db, config)
    existed = Path(path).exists()
    try:
        conn = open_ledger(path, wait_s=10, migrate_schema=False)
        try:
            applied = migrations.migrate(conn)
        finally:
            conn.close()
    except (LedgerError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    if not existed:
        click.echo(f"created ledger {path} ({len(applied)} migrations applied)")
    elif applied:
        click.echo(f"ledger {path}: applied {', '.join(applied)}")
    else:
        click.echo(f"ledger {path} is up to date")


@contextlib.contextmanager
def _stdout() -> Iterator[TextIO]:
    yield sys.stdout
