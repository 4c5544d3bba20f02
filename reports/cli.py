"""``tokenward export`` and ``tokenward ledger`` (and ``report``, from report_cli): reading the ledger.

They work whether or not the proxy runs: the proxy only holds the DuckDB file for a moment
each flush, and these commands open it read-only, waiting (``--wait``) while a flush is under
way. The ledger is named by ``--db PATH`` or by the ``ledger.path`` of ``--config FILE``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import click

from tokenward.reports import queries, render
from tokenward.reports.cli_common import (
    ledger_named,
    ledger_options,
    ledger_path,
    open_read_only,
    parse_when,
    range_options,
    zone_named,
)
from tokenward.reports.ledger import LedgerError
from tokenward.reports.ledger.factory import is_postgres_url
from tokenward.reports.ledger.wal import copy_row
from tokenward.reports.report_cli import report

__all__ = ["export", "ledger", "ledger_path", "parse_when", "report"]


@click.command()
@ledger_options
@range_options
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
    zone = zone_named(tz)
    conn = open_read_only(db, config, wait)
    count = 0
    try:
        rows = queries.export_rows(
            conn, since=parse_when(since, zone, hint="--since"), until=parse_when(until, zone, hint="--until")
        )
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
@click.option("--db", help="Ledger DuckDB file, or a postgresql:// URL.")
@click.option("--config", "config", type=click.Path(dir_okay=False), help="Config file naming the ledger.")
def migrate_command(db: str | None, config: str | None) -> None:
    """Create the ledger or bring its schema up to date (the proxy does this on start)."""
    target = ledger_named(db, config)
    existed = target.engine != "duckdb" or Path(target.name).exists()
    try:
        applied = target.migrate()
    except (LedgerError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    if not existed or (target.engine != "duckdb" and "m001_requests" in applied):
        click.echo(f"created ledger {target.name} ({len(applied)} migrations applied)")
    elif applied:
        click.echo(f"ledger {target.name}: applied {', '.join(applied)}")
    else:
        click.echo(f"ledger {target.name} is up to date")


@ledger.command("copy")
@click.option("--from", "source", required=True, help="Ledger to read: a DuckDB file or a postgresql:// URL.")
@click.option("--to", "target", required=True, help="Ledger to write: a DuckDB file or a postgresql:// URL.")
@click.option("--wait", default=10.0, show_default=True, help="Seconds to wait while a proxy holds a DuckDB file.")
def copy_command(source: str, target: str, wait: float) -> None:
    """Copy every row of one ledger into another (DuckDB to Postgres or back); idempotent.

    Rows whose request id the target has already are skipped, so a copy interrupted or run
    twice leaves exactly one row per request. Keys, alert claims and budget books are not
    copied (the target's own state store keeps them).
    """
    same = source == target if is_postgres_url(source) else Path(source).resolve() == Path(target).resolve()
    if same:  # before: "in use by another process", the process being this copy
        raise click.ClickException(f"--from and --to name the same ledger ({source}): nothing to copy")
    reader, writer = ledger_named(source, None), ledger_named(target, None)
    try:
        writer.migrate()
        conn = reader.connect(read_only=True, wait_s=wait)
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from exc
    read = written = 0
    try:
        batch: list[dict[str, object]] = []
        for row in queries.export_rows(conn):
            batch.append(copy_row(row))
            if len(batch) >= 10_000:
                read, written = read + len(batch), written + writer.write_rows(batch)
                batch = []
        if batch:
            read, written = read + len(batch), written + writer.write_rows(batch)
    except LedgerError as exc:
        raise click.ClickException(f"{exc} ({written} rows copied before)") from exc
    finally:
        conn.close()
    click.echo(f"copied {written} rows from {reader.name} to {writer.name} ({read - written} were there already)")


@ledger.command("reconcile")
@click.argument("request_id")
@click.option("--cost", "cost", help="What the provider billed for it (USD, exact decimal).")
@click.option("--not-billed", is_flag=True, help="The provider did not bill it.")
@click.option("--db", type=click.Path(dir_okay=False), help="Ledger DuckDB file, or a postgresql:// URL.")
@click.option("--config", "config", type=click.Path(dir_okay=False), help="Config file naming the ledger.")
@click.option("--wait", default=10.0, show_default=True, help="Seconds to wait while the proxy is writing.")
def reconcile_command(
    request_id: str, cost: str | None, not_billed: bool, db: str | None, config: str | None, wait: float
) -> None:
    """Settle a usage_unknown row (it counts its reservation as spend until then) at what it really cost.

    Budget books take the new figure from the next proxy start.
    """
    from decimal import Decimal, InvalidOperation

    from tokenward.reports.ledger.reconcile import reconcile

    if (cost is None) == (not not_billed):
        raise click.UsageError("give --cost USD or --not-billed")
    try:
        amount = None if not_billed else Decimal(str(cost))
    except InvalidOperation as exc:
        raise click.BadParameter(f"{cost!r} is not a decimal amount", param_hint="--cost") from exc
    store = ledger_named(db, config)
    try:
        conn = store.connect(read_only=False, wait_s=wait)
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        status = reconcile(conn, request_id, amount, store.apply_prices)
    except (ValueError, LedgerError) as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        conn.close()
    click.echo(f"request {request_id}: {status}" + (f" at ${amount}" if amount is not None else ""))


@contextlib.contextmanager
def _stdout() -> Iterator[TextIO]:
    yield sys.stdout
