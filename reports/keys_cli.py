"""``tokenward keys``: create, list and revoke virtual keys (stored ones, and the config file's).

``keys list`` prints a table when it fits the terminal (piped: ``COLUMNS``, else 80 columns),
else one block per key, every value whole on its own line (as ``budgets status`` does).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from decimal import Decimal
from zoneinfo import ZoneInfo

import click
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from tokenward.pricing.budgets import Budget, Period
from tokenward.reports.budgets_cli import console_for_output, options, spent_usd
from tokenward.reports.cli_common import existing_state, open_named, parse_when, writable_state
from tokenward.reports.keys import ConfigKey, ListedKey, create_key, list_keys, revoke_key
from tokenward.reports.ledger.spend import DuckSpend
from tokenward.reports.ledger.state import StateStore

__all__ = ["keys"]


def _config_keys(config: str | None) -> list[ConfigKey]:
    """The ``virtual_keys`` of ``config`` (none without one), each by its sha256.

    Raises:
        click.BadParameter: the file is invalid (checked as ``tokenward serve`` checks it).
    """
    if not config:
        return []
    from tokenward.proxy.config import ConfigError, load_config

    try:
        loaded = load_config(config).virtual_keys
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from exc
    return [
        ConfigKey(
            k.name,
            (k.key_sha256 or hashlib.sha256((k.key or "").encode()).hexdigest()).lower(),
            k.team,
            k.project,
            k.role,
            k.expires_at,
        )
        for k in loaded
    ]


@click.group()
def keys() -> None:
    """Virtual keys: made with `keys create` (stored hashed beside the ledger) or in the config file."""


@keys.command()
@options
@click.argument("name")
@click.option("--team", help="Team the key's usage is attributed to.")
@click.option("--project", help="Project the key's usage is attributed to.")
@click.option(
    "--role",
    type=click.Choice(["user", "admin"]),
    default="user",
    show_default=True,
    help="admin: the key also opens the dashboard and its API, and reaches every key's provider objects.",
)
@click.option(
    "--expires",
    help="When the key stops working: a duration from now (30m, 12h, 30d, 2w) or an ISO date/datetime (UTC if naive).",
)
def create(
    config: str | None,
    db: str | None,
    wait: float,
    name: str,
    team: str | None,
    project: str | None,
    role: str,
    expires: str | None,
) -> None:
    """Create a key NAME and print it (shown this once; only its sha256 is stored).

    With ``--expires`` a proxy refuses it from then on with 401 ``key_expired`` (and a row).
    """
    now = dt.datetime.now(dt.UTC)
    # a duration reads back from now: this one counts on
    expires_at = parse_when(expires, ZoneInfo("UTC"), now, hint="--expires")
    if expires_at is not None and re.fullmatch(r"\d+\s*[mhdw]", expires.strip()):
        expires_at = now + (now - expires_at)
    if any(k.name == name for k in _config_keys(config)):
        raise click.ClickException(f"the config already has a key named {name!r}; choose another name")
    state = writable_state(db, config)
    try:
        key = create_key(state, name, team=team, project=project, role=role, now=now, expires_at=expires_at)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(key)
    click.echo(
        f"key {name!r} created{' (role admin)' if role == 'admin' else ''}; it is shown only now. A proxy on "
        "this ledger accepts it within 5 s (as a virtual key in auth mode virtual_keys"
        f"{'; as an admin credential for the dashboard in either mode' if role == 'admin' else ''}).",
        err=True,
    )



_WHEN = "%Y-%m-%d %H:%M"


def _when(moment: dt.datetime | None, none: str) -> str:
    """A moment in UTC to the minute (``2027-01-31 17:00 UTC``), or ``none``."""
    return f"{moment.astimezone(dt.UTC):{_WHEN}} UTC" if moment is not None else none


def _block(key: ListedKey, spent: str, month: str, now: dt.datetime) -> Text:
    """One key as lines that fit a narrow terminal or a pipe (``keys list`` below its table's width)."""
    lines = [
        f"{key.name}: {key.state(now)}",
        f"  from      {key.source}",
        f"  team      {key.team or '-'}",
        f"  project   {key.project or '-'}",
        f"  role      {key.role}",
        f"  created   {_when(key.created_at, '-')}",
        f"  expires   {_when(key.expires_at, 'never')}",
        f"  spent     {spent} in {month}",
    ]
    return Text("\n".join(lines))  # names are the operator's, but never rich markup


@keys.command(name="list")
@options
def list_command(config: str | None, db: str | None, wait: float) -> None:
    """Keys (stored, and --config's), with attribution, expiry, spend this UTC month and state; never the keys.

    A config key revoked with `keys revoke NAME --config` shows as revoked, and stays listed
    (`config, removed`) once taken out of the file.
    """
    configured = _config_keys(config)
    try:
        state = existing_state(db, config)
    except click.ClickException:
        if not configured or db:  # a --db that does not exist is a typo, not a new ledger
            raise
        state = None  # the config's ledger not made yet: nothing created or revoked, the file's keys all there is
    rows = list_keys(state, configured if config else None)
    now = dt.datetime.now(dt.UTC)
    period = Budget("keys", Decimal(1), period=Period("month"))  # every request, the UTC calendar month
    start, end = period.period.window(now)
    try:
        conn = open_named(db, config, wait, read_only=True)
    except click.ClickException:  # no ledger yet: no request has been made with any key
        spent: dict[str, Decimal] = {}
    else:
        try:
            spent = dict(DuckSpend(conn).spend_by(period, start, end, "key"))
        finally:
            conn.close()
    if not rows:
        click.echo("no keys" if config else "no stored keys (--config FILE lists the file's keys too)")
        return
    month = f"{start:%Y-%m}"
    table = Table("name", "from", "team", "project", "role", "created", "expires", f"spent {month}", "state")
    for key in rows:
        table.add_row(
            Text(key.name),
            key.source,
            Text(key.team or ""),
            Text(key.project or ""),
            key.role,
            _when(key.created_at, "-"),
            _when(key.expires_at, "never"),
            spent_usd(spent.get(key.name, Decimal(0))),
            key.state(now),
        )
    console = console_for_output()
    if Measurement.get(console, console.options.update_width(10_000), table).maximum <= console.width:
        console.print(table)
        return
    for key in rows:  # a table of nine columns cut to 80 is slivers ("contr…"): one block per key, each value whole
        console.print(_block(key, spent_usd(spent.get(key.name, Decimal(0))), month, now), soft_wrap=True)


@keys.command()
@options
@click.argument("name")
def revoke(config: str | None, db: str | None, wait: float, name: str) -> None:
    """Revoke the key NAME, stored or from --config's virtual_keys (the proxy refuses it within 5 s)."""
    configured = {k.name: k.key_sha256 for k in _config_keys(config)}
    state = writable_state(db, config)
    done = revoke_key(state, name, now=dt.datetime.now(dt.UTC), configured=configured)
    if not done:
        raise click.ClickException(_not_revoked(state, name, configured, config))
    click.echo(f"key {name!r} revoked")


def _not_revoked(state: StateStore, name: str, configured: dict[str, str], config: str | None) -> str:
    """Why ``keys revoke NAME`` changed nothing: revoked already (and when), or no such key (and where it looked)."""
    if name in configured:
        at = state.config_revocations().get(configured[name].lower(), (None, None))[1]
    else:
        at = next((k.revoked_at for k in state.keys() if k.name == name), None)
    if at is not None:
        return f"key {name!r} was revoked already, at {_when(at, '-')}"
    if config:
        return f"no key named {name!r}: neither stored nor in {config}'s virtual_keys"
    return f"no stored key named {name!r} (a key of the config file: add --config FILE)"
