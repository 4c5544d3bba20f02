"""``tokenward pricing ...``: inspect prices, check the ledger against them, import, re-price.

The catalog is the one ``--config FILE`` describes (built-in prices, its ``pricing.files``, its
aliases and fallback, its refresh file), or the built-in one, plus any ``--prices FILE``.
"""

from __future__ import annotations

import csv
import datetime as dt
import difflib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

import click
import msgspec
import yaml
from rich.console import Console
from rich.table import Table

from tokenward.pricing.catalog import CatalogError, PriceCatalog, PriceEntry, read_file, yaml_problem
from tokenward.pricing.imports import from_litellm, from_sheet, to_yaml
from tokenward.pricing.settings import PricingSettings, build_catalog
from tokenward.reports.cli_common import DEFAULT_LEDGER, ledger_named, open_named, parse_when
from tokenward.reports.reprice import reprice

__all__ = ["pricing"]

_UNITS = {
    "web_search": "call",
    "web_fetch": "call",
    "file_search": "call",
    "request": "call",
    "code_container": "container",
}
"""What a fee line's rate is per (token lines are per 1M)."""

F = TypeVar("F", bound=Callable[..., Any])


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 140)


def load_settings(config: str | None) -> tuple[PricingSettings, str | None]:
    """The pricing settings of ``config`` (paths resolved) and its refresh file, or the defaults.

    Raises:
        click.BadParameter: the config cannot be read or its pricing section is invalid.
    """
    if not config:
        return PricingSettings(), None
    try:
        document = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
        settings = msgspec.convert(document.get("pricing") or {}, PricingSettings)
    except (OSError, yaml.YAMLError, msgspec.ValidationError) as exc:
        raise click.BadParameter(
            f"cannot read the pricing section of {config}: {yaml_problem(exc)}", param_hint="--config"
        ) from exc
    base = Path(config).resolve().parent
    settings.files = [str(base / f) for f in settings.files]
    ledger = str(base / ((document.get("ledger") or {}).get("path") or DEFAULT_LEDGER))
    refresh = settings.refresh
    refresh_file = str(base / refresh.file) if refresh and refresh.file else ledger + ".prices.yaml"
    return settings, refresh_file


def load_configured_catalog(config: str | None, prices: tuple[str, ...]) -> tuple[PriceCatalog, PricingSettings]:
    """The catalog for ``--config`` plus ``--prices`` files.

    Raises:
        click.ClickException: a price file is invalid (the message names file, entry and field).
    """
    settings, refresh_file = load_settings(config)
    settings.files = [*settings.files, *prices]
    try:
        return build_catalog(settings, refresh_file=refresh_file), settings
    except CatalogError as exc:
        raise click.ClickException(str(exc)) from exc


def _catalog_options(fn: F) -> F:
    fn = click.option(
        "--prices",
        multiple=True,
        type=click.Path(exists=True, dir_okay=False),
        help="Extra price file (repeatable), loaded last.",
    )(fn)
    fn = click.option(
        "--config",
        "config",
        type=click.Path(exists=True, dir_okay=False),
        help="Config file: its pricing section and ledger.",
    )(fn)
    return fn


@click.group()
def pricing() -> None:
    """Prices: show, check, explain, import, reprice."""


@pricing.command()
@_catalog_options
@click.argument("model")
@click.option("--provider", help="Catalog provider of the upstream (openai, anthropic, ...).")
@click.option("--at", "at_text", help="Instant to price at (ISO datetime or date; default: now).")
def show(config: str | None, prices: tuple[str, ...], model: str, provider: str | None, at_text: str | None) -> None:
    """Show the price that applies to MODEL, its rules, source and history."""
    catalog, _ = load_configured_catalog(config, prices)
    at = parse_when(at_text, ZoneInfo("UTC"), hint="--at") if at_text else dt.datetime.now(dt.UTC)
    resolution = catalog.resolve(model, provider, at)
    if resolution is None:
        names = sorted({entry.model for entry in catalog.entries.values()})
        close = difflib.get_close_matches(model, names, n=1, cutoff=0.8)  # as `config check` suggests
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise click.ClickException(
            f"no price for {model!r}" + (f" at provider {provider!r}" if provider else "") + hint
        )
    entry = resolution.entry
    console = _console()
    console.print(
        f"[bold]{model}[/bold] -> {entry.version_id} (resolved by {resolution.how}), in force at {at.isoformat()}"
    )
    console.print(_rates_table(entry))
    for tier in entry.context_tiers:
        console.print(f"  {tier.name} on {'+'.join(tier.counts)} tokens: {_adjustment(tier.adjustment)}")
    for name, adjustment in entry.service_tiers:
        console.print(f"  served tier {name}: {_adjustment(adjustment)}")
    for window in entry.windows:
        days = ",".join(d for d in ("mon", "tue", "wed", "thu", "fri", "sat", "sun") if d in window.weekdays)
        console.print(
            f"  window {window.name}: {window.start:%H:%M}-{window.end:%H:%M} {window.timezone} "
            f"{days}: {_adjustment(window.adjustment)}"
        )
    for fee, what in (
        ("web_search", "web search: $%s per call"),
        ("web_fetch", "web fetch: $%s per call"),
        ("file_search", "file search: $%s per call"),
        ("code_container", "code execution: $%s per container"),
    ):
        if getattr(entry, fee) is not None:
            console.print("  " + what % getattr(entry, fee))
    if entry.per_request:
        console.print(f"  per request: ${entry.per_request}")
    console.print(f"  source: {entry.source} (checked {entry.checked})")
    if entry.note:
        console.print(f"  note: {entry.note}")
    history = catalog.versions.get(entry.id, [])
    if len(history) > 1:
        console.print("  versions: " + ", ".join(v.version_id for v in history))


def _rates_table(entry: PriceEntry) -> Table:
    table = Table("rate", "USD per 1M tokens", title=None)
    for name in (
        "input",
        "cached_input",
        "cache_write",
        "cache_write_1h",
        "output",
        "reasoning",
        "audio_input",
        "audio_output",
        "image_input",
    ):
        table.add_row(name, format(getattr(entry.rates, name), "f"))
    return table


def _adjustment(adjustment: Any) -> str:
    if adjustment.multiplier is not None:
        return f"x{adjustment.multiplier}"
    return ", ".join(f"{name} {format(rate, 'f')}" for name, rate in adjustment.rates)


def _ledger_options(fn: F) -> F:
    fn = click.option("--wait", default=10.0, show_default=True, help="Seconds to wait while the proxy is writing.")(fn)
    fn = click.option("--db", type=click.Path(dir_okay=False), help="Ledger DuckDB file, or a postgresql:// URL.")(fn)
    return fn


@pricing.command()
@_catalog_options
@_ledger_options
@click.option("--since", help="Only rows from this time (date, ISO datetime or 7d).")
def check(config: str | None, prices: tuple[str, ...], db: str | None, wait: float, since: str | None) -> None:
    """Check that every model seen in the ledger has a price; list the unpriced ones (exit 1 if any)."""
    catalog, settings = load_configured_catalog(config, prices)
    conn = open_named(db, config, wait, read_only=True)
    try:
        bound = parse_when(since, ZoneInfo("UTC"))
        rows = conn.execute(
            "SELECT provider, coalesce(served_model, requested_model) AS model, count(*), "
            "sum(input_tokens + output_tokens), max(started_at) FROM requests "
            "WHERE usage_source <> 'none' AND row_kind <> 'attempt'"
            + (" AND started_at >= ?" if bound else "")
            + " GROUP BY ALL ORDER BY 4 DESC",
            [bound] if bound else [],
        ).fetchall()
    finally:
        conn.close()
    unpriced = []
    table = Table("provider", "model", "rows", "tokens", "priced by")
    for provider, model, count, tokens, last in rows:
        resolution = catalog.resolve(model, provider, last, fallback=settings.unpriced == "fallback")
        found = f"{resolution.entry.version_id} ({resolution.how})" if resolution else "[red]UNPRICED[/red]"
        table.add_row(str(provider), str(model), str(count), f"{tokens or 0:,}", found)
        if resolution is None:
            unpriced.append((provider, model, count, tokens))
    console = _console()
    console.print(table)
    if unpriced:
        console.print(
            f"[yellow]{len(unpriced)} model(s) have no price[/yellow]: "
            f"{sum(u[2] for u in unpriced)} requests, {sum(u[3] or 0 for u in unpriced):,} tokens. "
            "Add them to a price file (pricing.files) and run `tokenward pricing reprice`."
        )
        sys.exit(1)
    console.print("every model in the ledger has a price")


@pricing.command()
@click.argument("request_id")
@_ledger_options
@click.option("--config", "config", type=click.Path(exists=True, dir_okay=False), help="Config file naming the ledger.")
def explain(request_id: str, db: str | None, wait: float, config: str | None) -> None:
    """Show how REQUEST_ID was priced: line items, rules, entry and provider cost."""
    conn = open_named(db, config, wait, read_only=True)
    try:
        cursor = conn.execute(
            "SELECT request_id, row_kind, served_model, requested_model, provider, started_at, service_tier, "
            "price_status, price_entry_id, price_resolved_by, cost_usd, cost_lines, provider_cost_usd, usage_source, "
            "outcome, http_status, error "
            "FROM requests WHERE request_id = ? OR parent_request_id = ? ORDER BY row_kind DESC, request_id",
            [request_id, request_id],
        )
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]
    finally:
        conn.close()
    if not rows:
        raise click.ClickException(f"no request {request_id!r} in the ledger")
    console = _console()
    for row in rows:
        console.print(
            f"[bold]{row['request_id']}[/bold] ({row['row_kind']}) {row['served_model'] or row['requested_model']} "
            f"at {row['provider']}, started {row['started_at'].isoformat()}, tier {row['service_tier'] or 'standard'}"
        )
        entry = (
            f"entry {row['price_entry_id']} ({row['price_resolved_by']})" if row["price_entry_id"] else "no price entry"
        )
        console.print(f"  price status {row['price_status']}, {entry}, usage {row['usage_source']}", markup=False)
        if row["outcome"] != "ok" and row["row_kind"] == "request":  # why a row costs nothing, or is unknown
            why = f": {row['error']}" if row["error"] else ""
            console.print(f"  outcome {row['outcome']} (HTTP {row['http_status']}){why}", markup=False)
        lines = json.loads(row["cost_lines"]) if row["cost_lines"] else []
        table = Table("component", "quantity", "rate (USD)", "rule", "amount (USD)")
        for line in lines:
            if "note" in line:
                continue
            rate = (
                "no price"
                if line["rate"] is None
                else f"{line['rate']} per {_UNITS.get(line['component'], '1M')}"
            )
            table.add_row(
                line["component"],
                f"{line['quantity']:,}",
                rate,
                line.get("rule", ""),
                "-" if line["amount"] is None else line["amount"],
            )
        if lines:
            console.print(table)
        for line in lines:
            if "note" in line:
                console.print(f"  note: {line['note']}")
        console.print(f"  total: {'-' if row['cost_usd'] is None else '$' + format(row['cost_usd'], 'f')}")
        if row["provider_cost_usd"] is not None:
            drift = row["provider_cost_usd"] - (row["cost_usd"] or 0)
            console.print(f"  provider says: ${format(row['provider_cost_usd'], 'f')} (drift ${format(drift, 'f')})")


@pricing.command(name="import")
@click.argument("source_file", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["litellm", "sheet"]),
    required=True,
    help="litellm: model_prices_and_context_window.json; sheet: CSV/JSON rows provider,model,component,unit,price.",
)
@click.option("--providers", help="Comma-separated tokenward provider names to keep (litellm).")
@click.option("--source", "source_url", required=True, help="URL recorded as every entry's source.")
@click.option("--checked", help="Date the source was read (default: today).")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False), help="Price file to write.")
def import_command(
    source_file: str, fmt: str, providers: str | None, source_url: str, checked: str | None, output: str
) -> None:
    """Convert SOURCE_FILE into a tokenward price file (add it to pricing.files to use it)."""
    try:
        day = dt.date.fromisoformat(checked) if checked else dt.datetime.now(dt.UTC).date()
    except ValueError:
        raise click.BadParameter(f"{checked!r} is not a date like 2026-12-01", param_hint="--checked") from None
    try:
        if fmt == "litellm":
            text = Path(source_file).read_text(encoding="utf-8")
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON ({exc}): LiteLLM's model_prices_and_context_window.json is") from None
            wanted = [p.strip() for p in providers.split(",")] if providers else None
            entries = from_litellm(data, source=source_url, checked=day, providers=wanted)
        else:
            entries = from_sheet(_sheet_rows(Path(source_file)), source=source_url, checked=day)
    except (OSError, ValueError, KeyError) as exc:
        raise click.ClickException(f"cannot import {source_file}: {exc}") from exc
    header = f"imported by `tokenward pricing import --format {fmt}` from {source_url} on {day}"
    try:
        Path(output).write_text(to_yaml(entries, header), encoding="utf-8")
        read_file(Path(output))  # what was written loads back
    except (OSError, CatalogError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"wrote {len(entries)} entries to {output}")


def _sheet_rows(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        rows = json.loads(text)
        if not isinstance(rows, list):
            raise ValueError("a JSON price sheet is a list of rows")
        return rows
    return list(csv.DictReader(text.splitlines()))


@pricing.command(name="reprice")
@_catalog_options
@_ledger_options
@click.option("--since", help="Rows from (date, ISO datetime, or 7d).")
@click.option("--until", help="Rows before.")
@click.option("--dry-run", is_flag=True, help="Report what would change; change nothing.")
def reprice_command(
    config: str | None,
    prices: tuple[str, ...],
    db: str | None,
    wait: float,
    since: str | None,
    until: str | None,
    dry_run: bool,
) -> None:
    """Price stored rows again under the current catalog; report the difference."""
    catalog, settings = load_configured_catalog(config, prices)
    utc = ZoneInfo("UTC")
    clauses, params = [], []
    for op, text in ((">=", since), ("<", until)):
        bound = parse_when(text, utc)
        if bound is not None:
            clauses.append(f"started_at {op} ?")
            params.append(bound)
    ledger = ledger_named(db, config)
    conn = open_named(db, config, wait, read_only=dry_run)
    try:
        result = reprice(
            conn,
            catalog,
            where=" AND ".join(clauses),
            params=params,
            fallback=settings.unpriced == "fallback",
            dry_run=dry_run,
            apply=ledger.apply_prices,
        )
    finally:
        conn.close()
    console = _console()
    table = Table("model", "rows", "before (USD)", "after (USD)", "change (USD)")
    for model, (count, before, after) in sorted(result.by_model.items()):
        if before != after:
            table.add_row(model, str(count), format(before, "f"), format(after, "f"), format(after - before, "f"))
    if table.row_count:
        console.print(table)
    verb = "would change" if dry_run else "changed"
    console.print(
        f"{result.rows_checked} metered rows checked, {result.rows_changed} {verb} "
        f"({result.newly_priced} newly priced, {result.newly_unpriced} now unpriced); "
        f"total ${format(result.before, 'f')} -> ${format(result.after, 'f')} "
        f"(change ${format(result.after - result.before, 'f')})"
    )
