"""``tokenward report``, ``tokenward export`` and ``tokenward ledger``: reading the ledger.

They work whether or not the proxy runs: the proxy only holds the DuckDB file for a moment
each flush, and these commands open it read-only, waiting (``--wait``) while a flush is under
way. The ledger is named by ``--db PATH`` or by the ``ledger.path`` of ``--config FILE``.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import io
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any, TextIO, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import click
import yaml
from rich.console import Console
from rich.table import Table

from tokenward.reports import migrations, queries
from tokenward.reports.ledger import LedgerError, open_ledger

__all__ = ["export", "ledger", "ledger_path", "parse_when", "print_spend_table", "report"]

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
        return open_ledger(ledger_path(db, config), read_only=True, wait_s=wait)
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from exc


@click.command()
@_ledger_options
@_range_options
@click.option(
    "--by", default="model,day", show_default=True, help=f"Comma-separated groupings: {', '.join(queries.GROUPINGS)}."
)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--drift", is_flag=True, help="Add the provider-reported cost (OpenRouter) and its drift from ours.")
def report(
    db: str | None,
    config: str | None,
    wait: float,
    since: str | None,
    until: str | None,
    tz: str,
    by: str,
    fmt: str,
    drift: bool,
) -> None:
    """Spend and tokens grouped by model and day (or --by ...) over a time range."""
    zone = _zone(tz)
    groups = [g.strip() for g in by.split(",") if g.strip()]
    conn = _open(db, config, wait)
    try:
        rows = queries.spend(conn, groups, since=parse_when(since, zone), until=parse_when(until, zone), tz=tz)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    finally:
        conn.close()
    if fmt == "json":
        click.echo(json.dumps(rows, default=_json_default, indent=2))
    elif fmt == "csv":
        click.echo(_csv(rows, list(rows[0]) if rows else groups), nl=False)
    else:
        print_spend_table(rows, groups, drift=drift)


_TABLE_MEASURES = {
    "requests": "requests",
    "input_tokens": "input",
    "cached_input_tokens": "cached in",
    "cache_write_tokens": "cache writes",
    "output_tokens": "output",
    "reasoning_tokens": "reasoning",
}


def print_spend_table(
    rows: list[dict[str, Any]], groups: list[str], console: Console | None = None, *, drift: bool = False
) -> None:
    """Render :func:`~tokenward.reports.queries.spend` rows as a terminal table with totals.

    Costs show 6 decimals here (CSV and JSON carry the exact 12); a group with nothing priced
    shows a dash, and unpriced, unknown-usage and estimated request counts are printed beside
    the dollar total, never folded into it. ``drift`` adds the provider-reported cost columns.
    """
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    if not rows:
        console.print("no requests in this range")
        return
    table = Table(title="tokenward spend", show_footer=True)
    totals = {m: sum(r[m] or 0 for r in rows) for m in _TABLE_MEASURES}
    priced = [r["cost_usd"] for r in rows if r["cost_usd"] is not None]
    total_cost = sum(priced, Decimal(0)) if priced else None
    unpriced = sum(r["unpriced_requests"] for r in rows)
    for i, name in enumerate(groups):
        table.add_column(name, footer="total" if i == 0 else "", no_wrap=True)
    for name, title in _TABLE_MEASURES.items():
        table.add_column(title, justify="right", footer=f"{totals[name]:,}")
    table.add_column("cost (USD)", justify="right", footer=_money(total_cost))
    table.add_column("unpriced", justify="right", footer=str(unpriced))
    if drift:
        provider = [r["provider_cost_usd"] for r in rows if r["provider_cost_usd"] is not None]
        drifts = [r["provider_cost_drift_usd"] for r in rows if r["provider_cost_drift_usd"] is not None]
        table.add_column(
            "provider says", justify="right", footer=_money(sum(provider, Decimal(0)) if provider else None)
        )
        table.add_column("drift", justify="right", footer=_money(sum(drifts, Decimal(0)) if drifts else None))
    for row in rows:
        cells = [str(row[g]) for g in groups]
        cells += [f"{row[m] or 0:,}" for m in _TABLE_MEASURES]
        cells += [_money(row["cost_usd"]), str(row["unpriced_requests"])]
        if drift:
            cells += [_money(row["provider_cost_usd"]), _money(row["provider_cost_drift_usd"])]
        table.add_row(*cells)
    console.print(table)
    if unpriced:
        tokens = sum(r["unpriced_tokens"] for r in rows)
        console.print(
            f"[yellow]{unpriced} request(s) are unpriced or only partly priced[/yellow] ({tokens:,} unpriced tokens), "
            "not (fully) in the dollar total: add prices (pricing.files), then `tokenward pricing reprice`."
        )
    unknown = sum(r["usage_unknown_requests"] for r in rows)
    if unknown:
        console.print(f"{unknown} request(s) may have been billed but got no reply, so their usage is unknown.")
    fallback = sum(r["fallback_priced_requests"] for r in rows)
    if fallback:
        console.print(f"{fallback} request(s) are priced at the configured fallback rates.")
    estimated = sum(r["estimated_requests"] for r in rows)
    if estimated:
        console.print(f"{estimated} request(s) have estimated or partial token counts (the upstream reported none).")


def _money(value: Decimal | None) -> str:
    return "-" if value is None else f"${value:,.6f}"


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
                    writer.writerow(_plain(row))
                    count += 1
            else:
                for row in rows:
                    out.write(json.dumps(row, default=_json_default) + "\n")
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


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """CSV cells written the way JSON lines write them: ISO times, lowercase booleans, exact decimals."""
    return {k: _cell(v) for k, v in row.items()}


def _cell(value: Any) -> Any:
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    return value


def _csv(rows: Iterable[dict[str, Any]], columns: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(_plain(row))
    return buffer.getvalue()


@contextlib.contextmanager
def _stdout() -> Iterator[TextIO]:
    yield sys.stdout
