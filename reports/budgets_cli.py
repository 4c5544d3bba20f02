"""``tokenward budgets`` and ``tokenward alerts``: budgets and the alerts they owe (``keys``: :mod:`.keys_cli`).

These commands read the ``budgets`` and ``alerts`` sections of ``--config FILE`` and use the
ledger it names (or ``--db``). They run the same evaluation as the proxy's scheduled job, so a
threshold alert claimed here is never sent again by the proxy, and the other way round.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
from collections.abc import Callable
from decimal import Decimal
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

import click
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from tokenward.pricing.budgets import Budget
from tokenward.reports.alerts import Alert, AlertSettings, Notifier, html_text
from tokenward.reports.budget_check import evaluate_and_notify, status_of, usd, velocity_of
from tokenward.reports.cli_common import existing_state, ledger_named, open_named, parse_when
from tokenward.reports.ledger.spend import DuckSpend
from tokenward.reports.render import output_width

__all__ = ["alerts", "budgets", "console_for_output", "load_sections", "options", "print_whole", "spent_usd"]

F = TypeVar("F", bound=Callable[..., Any])


def console_for_output() -> Console:
    """A console as wide as the terminal; piped, 80 columns (or ``COLUMNS``), as ``tokenward report``'s tables."""
    return Console(width=output_width())


def print_whole(table: Table | str) -> None:
    """Print ``table`` on a terminal at its width; piped, at least as wide as its rows, so that no cell is cut.

    At 80 columns rich cuts a long cell with an ellipsis: ``alerts history`` piped to a file or
    ``grep`` lost budget names, states and errors (``research-mo…``).
    """
    console = console_for_output()
    if isinstance(table, Table) and not sys.stdout.isatty():
        natural = Measurement.get(console, console.options.update_width(10_000), table).maximum
        if natural > console.width:
            console = Console(width=natural)
    console.print(table)


def _period_text(s: Any) -> str:
    """A status's window in its budget's time zone (``total`` for a budget over all time)."""
    if s.budget.period.kind == "total":
        return "total"
    zone = ZoneInfo(s.budget.period.timezone)
    return f"{s.start.astimezone(zone):%Y-%m-%d %H:%M} to {s.end.astimezone(zone):%Y-%m-%d %H:%M} {zone.key}"


def _status_block(s: Any) -> Text:
    """One budget's status as lines that fit a narrow terminal or a pipe (``budgets status`` below its table's width).

    The first line names the budget with its spend, limit and share; the other figures follow, indented.
    """
    lines = [
        f"{s.budget.name}: {spent_usd(s.spent)} of {usd(s.budget.limit_usd)} ({s.percent}%)",
        f"  left      {spent_usd(s.remaining)}",
        f"  forecast  {'-' if s.forecast is None else usd(s.forecast)}",
        f"  at limit  {s.budget.action}",
        f"  scope     {s.budget.describe_scope()}",
        f"  period    {_period_text(s)}",
    ]
    return Text("\n".join(lines))  # a per-user budget's name holds a client's value: never rich markup


def load_sections(config: str | None) -> tuple[list[Budget], AlertSettings]:
    """The budgets and alert settings of ``config`` (none and defaults without a config).

    The file is checked as the proxy checks it (``tokenward serve`` and these commands accept
    and refuse the same files).

    Raises:
        click.BadParameter: the file cannot be read or is invalid.
    """
    if not config:
        return [], AlertSettings()
    from tokenward.proxy.config import ConfigError, load_config

    try:
        loaded = load_config(config)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from exc
    return loaded.budget_list(), loaded.alerts


def options(fn: F) -> F:
    """Add ``--config``, ``--db`` and ``--wait`` (the ledger, from the config or named; the proxy's flush)."""
    fn = click.option("--wait", default=10.0, show_default=True, help="Seconds to wait while the proxy is writing.")(fn)
    fn = click.option("--db", type=click.Path(dir_okay=False), help="Ledger DuckDB file (default: the config's).")(fn)
    fn = click.option(
        "--config",
        "config",
        type=click.Path(exists=True, dir_okay=False),
        help="Config file with the budgets and alerts sections.",
    )(fn)
    return fn


def spent_usd(amount: Decimal) -> str:
    """Spend or what is left, in dollars: four places, more below a cent to keep 3 significant digits.

    ``$0.000849`` of a $0.001 budget must not read ``$0.0008`` beside ``84.90%`` (at most the
    ledger's 12 places).
    """
    places = 4
    if amount != 0 and abs(amount) < Decimal("0.01"):
        places = min(12, max(places, 2 - amount.adjusted()))
    return f"{'-' if amount < 0 else ''}${abs(amount):,.{places}f}"


def _instant(text: str | None) -> dt.datetime:
    return parse_when(text, ZoneInfo("UTC"), hint="--at") if text else dt.datetime.now(dt.UTC)


@click.group()
def budgets() -> None:
    """Budgets: where each stands, and the alerts they owe."""


def _templates(config: str | None) -> list[Budget]:
    """The budgets of ``config`` made per value of a dimension (``per: end_user``)."""
    if not config:
        return []
    from tokenward.proxy.config import load_config

    return load_config(config).budget_templates()


@budgets.command()
@options
@click.option("--at", "at_text", help="Evaluate at this instant (ISO datetime; default now).")
@click.option("--top", default=10, show_default=True, help="Per-user (per-value) budgets shown per template.")
def status(config: str | None, db: str | None, wait: float, at_text: str | None, top: int) -> None:
    """Spend of every budget in its current period, with the limit and the forecast.

    A budget with several windows shows one row per window, together; velocity rules show the
    current rate; templates (``per``) show their largest per-value budgets.
    """
    configured, _ = load_sections(config)
    templates = _templates(config)
    if not configured and not templates:
        raise click.ClickException("no budgets configured (add a budgets: section to --config)")
    now = _instant(at_text)
    conn = open_named(db, config, wait, read_only=True)
    try:
        spend = DuckSpend(conn)
        statuses = [status_of(spend, budget, now) for budget in configured]
        rates = [(b, velocity_of(spend, b, now)) for b in configured if b.velocity is not None]
        for template in templates:
            start, end = template.period.window(now)
            assert template.per is not None
            for value, _ in spend.spend_by(template, start, end, template.per)[:top]:
                statuses.append(status_of(spend, template.instance(value), now))
    finally:
        conn.close()
    table = Table("budget", "scope", "period", "spent", "limit", "%", "left", "forecast", "at limit", title="budgets")
    for i, s in enumerate(statuses):
        table.add_row(
            Text(s.budget.name),  # a per-user budget's name holds a client's value: never rich markup
            Text(s.budget.describe_scope()),
            _period_text(s),
            spent_usd(s.spent),
            usd(s.budget.limit_usd),
            f"{s.percent}",
            spent_usd(s.remaining),
            "-" if s.forecast is None else usd(s.forecast),
            s.budget.action,
            end_section=i + 1 < len(statuses) and (s.budget.group or s.budget.name) != statuses[i + 1].budget.group,
        )
    console = console_for_output()
    if Measurement.get(console, console.options.update_width(10_000), table).maximum <= console.width:
        console.print(table)
    else:  # a table of nine columns cut into slivers is unreadable: one block per budget instead
        for s in statuses:
            console.print(_status_block(s), soft_wrap=False)
    for budget, rate in rates:
        click.echo(f"{budget.name}: {'ALERTING ' if rate.firing else ''}{rate.describe()}")



@budgets.command()
@options
@click.option("--dry-run", is_flag=True, help="Show the alerts due; claim and send nothing.")
@click.option("--at", "at_text", help="Evaluate at this instant (ISO datetime; default now).")
def check(config: str | None, db: str | None, wait: float, dry_run: bool, at_text: str | None) -> None:
    """Evaluate budgets now and send the alerts due (as the proxy does on its schedule)."""
    configured, settings = load_sections(config)
    now = _instant(at_text)
    state = ledger_named(db, config).state
    conn = open_named(db, config, wait, read_only=True)  # claims go to the state store, not the file
    try:
        sent = asyncio.run(
            evaluate_and_notify(DuckSpend(conn), state, configured, settings, Notifier(settings), now, dry_run=dry_run)
        )
    finally:
        conn.close()
    if not sent:
        click.echo("no alerts due")
    for alert, deliveries in sent:
        outcome = (
            "would send"
            if dry_run
            else ", ".join(f"{d.channel} {d.target}: {'ok' if d.ok else 'FAILED ' + str(d.error)}" for d in deliveries)
        )
        click.echo(f"{alert.subject} -> {', '.join(alert.targets)} ({outcome})")


@click.group()
def alerts() -> None:
    """Alerts: delivery history, and a test message."""


@alerts.command()
@options
@click.option("--limit", default=50, show_default=True)
def history(config: str | None, db: str | None, wait: float, limit: int) -> None:
    """Alerts claimed, newest first, with every delivery attempt and its result."""
    state = existing_state(db, config)
    claims = sorted(state.claims(), key=lambda c: c.created_at, reverse=True)[:limit]
    table = Table("claimed at", "budget", "kind", "threshold", "status", "attempts", "deliveries", "last error")
    for claim in claims:
        deliveries = "; ".join(
            f"{d.channel} {d.target}: {'ok' if d.ok else 'failed'}" for d in state.deliveries(claim.key)
        )
        table.add_row(
            claim.created_at.isoformat(timespec="seconds"),
            Text(claim.key.budget),
            claim.key.kind,
            str(claim.key.threshold or ""),
            claim.status,
            str(claim.attempts),
            deliveries,
            claim.last_error or "",
        )
    print_whole(table if claims else "no alerts yet")


@alerts.command(name="test")
@click.option("--to", "targets", multiple=True, required=True, help="Email address or webhook name (repeatable).")
@click.option(
    "--config", "config", type=click.Path(exists=True, dir_okay=False), help="Config with the alerts section."
)
def test_command(targets: tuple[str, ...], config: str | None) -> None:
    """Send a test alert through the configured SMTP server and webhooks."""
    _, settings = load_sections(config)
    subject = "[tokenward] test alert"
    text = f"{subject}\n\nIf you can read this, tokenward can reach you ({dt.datetime.now(dt.UTC).isoformat()})."
    alert = Alert("test", dt.datetime.now(dt.UTC), "test", 0, subject, text, html_text(subject, text), targets)
    deliveries = asyncio.run(Notifier(settings).send(alert))
    for delivery in deliveries:
        click.echo(f"{delivery.channel} {delivery.target}: {'ok' if delivery.ok else 'FAILED: ' + str(delivery.error)}")
    if not all(d.ok for d in deliveries):
        sys.exit(1)
