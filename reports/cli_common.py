"""What the ledger-reading commands share: which ledger, which time range, opening it read-only."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import click
import yaml

from tokenward.pricing.catalog import yaml_problem
from tokenward.reports.ledger import Ledger, LedgerError, StateStore
from tokenward.reports.ledger.duck import include_unflushed
from tokenward.reports.ledger.factory import is_postgres_url, open_ledger_for, pick_url
from tokenward.reports.views import PERIODS

__all__ = [
    "DEFAULT_LEDGER",
    "ledger_named",
    "existing_state",
    "writable_state",
    "ledger_options",
    "ledger_path",
    "open_named",
    "open_read_only",
    "parse_when",
    "range_options",
    "zone_named",
]

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
            raise click.BadParameter(f"cannot read {config}: {yaml_problem(exc)}", param_hint="--config") from exc
        path = (document.get("ledger") or {}).get("path") or DEFAULT_LEDGER
        return str(Path(config).resolve().parent / path)
    return DEFAULT_LEDGER


def ledger_named(db: str | None, config: str | None) -> Ledger:
    """The ledger named by ``--db`` (a file or a ``postgresql://`` URL), else ``TOKENWARD_LEDGER_URL``, else the config.

    From the config: ``ledger.url`` (a Postgres ledger; its local files in ``ledger.spool_dir``,
    default ``tokenward.spool`` beside the config), else the DuckDB file ``ledger.path``.

    Raises:
        click.BadParameter: the config file cannot be read, or its ``ledger.url`` is not a Postgres URL.
    """
    document: dict[str, Any] = {}
    base = Path.cwd()
    if config:
        try:
            document = (yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}).get("ledger") or {}
        except (OSError, yaml.YAMLError, AttributeError) as exc:
            raise click.BadParameter(f"cannot read {config}: {yaml_problem(exc)}", param_hint="--config") from exc
        base = Path(config).resolve().parent
    spool = document.get("spool_dir")
    url = db if is_postgres_url(db) else (None if db else pick_url(document.get("url")))
    try:
        if url:
            default = base / "tokenward.spool" if config else None
            return open_ledger_for(url=url, spool_dir=base / spool if spool else default)
        return open_ledger_for(path=ledger_path(db, config), spool_dir=base / spool if spool else None)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from exc


def existing_state(db: str | None, config: str | None) -> StateStore:
    """The state store of the ledger :func:`ledger_named` names, for commands that only read it.

    A DuckDB ledger whose file and state file are both missing was never used (a wrong
    directory, a mistyped ``--db``): reading it would create an empty state file and report
    nothing, so it is refused as ``report`` refuses it.

    Raises:
        click.ClickException: neither the ledger file nor its state file exists.
    """
    ledger = ledger_named(db, config)
    path = getattr(ledger, "path", None)
    if isinstance(path, str) and not Path(path).exists() and not Path(path + ".state.sqlite").exists():
        raise click.ClickException(f"no ledger at {path} yet: start the proxy once, or check --db/--config")
    if ledger.engine == "postgres":  # a database no replica has started on has no tables to read
        try:
            ledger.require_schema()
        except LedgerError as exc:
            raise click.ClickException(str(exc)) from exc
    return ledger.state


def writable_state(db: str | None, config: str | None) -> StateStore:
    """The state store of the ledger :func:`ledger_named` names, for commands that write to it.

    A Postgres database no replica has started on gets the ledger's schema first, as the first
    replica would make it (``keys create --config FILE`` before sending traffic); a DuckDB
    ledger's state file is made on first use.

    Raises:
        click.ClickException: the database cannot be reached or migrated.
    """
    ledger = ledger_named(db, config)
    if ledger.engine == "postgres":
        try:
            ledger.migrate()
        except LedgerError as exc:
            raise click.ClickException(str(exc)) from exc
    return ledger.state


def parse_when(
    text: str | None, tz: ZoneInfo, now: dt.datetime | None = None, *, hint: str | None = None
) -> dt.datetime | None:
    """Parse a time bound.

    Accepts ``2026-11-01`` (midnight in ``tz``), an ISO datetime (naive = ``tz``), or a duration
    before ``now`` such as ``30m``, ``24h``, ``7d``, ``2w``. ``hint``: the option it came from
    (``--since``), named in the error.

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
        period = f" (for the calendar period, --period {text.strip()})" if text.strip() in PERIODS else ""
        raise click.BadParameter(
            f"{text!r} is not a date, datetime or duration like 7d{period}", param_hint=hint
        ) from exc
    return value if value.tzinfo else value.replace(tzinfo=tz)


def zone_named(name: str) -> ZoneInfo:
    """The IANA zone ``name``.

    Raises:
        click.BadParameter: unknown zone (for ``--tz``).
    """
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise click.BadParameter(f"unknown time zone {name!r}", param_hint="--tz") from exc


def ledger_options(fn: F) -> F:
    """Add ``--db``, ``--config`` and ``--wait`` (which ledger, and how long to wait for the proxy's flush)."""
    fn = click.option("--wait", default=10.0, show_default=True, help="Seconds to wait while the proxy is writing.")(fn)
    fn = click.option("--config", "config", type=click.Path(dir_okay=False), help="Config file naming the ledger.")(fn)
    fn = click.option("--db", type=click.Path(dir_okay=False), help="Ledger DuckDB file, or a postgresql:// URL.")(fn)
    return fn


def range_options(fn: F) -> F:
    """Add ``--since``, ``--until`` and ``--tz``."""
    fn = click.option("--tz", default="UTC", show_default=True, help="IANA time zone for dates and days.")(fn)
    fn = click.option("--until", help="End (exclusive): date, ISO datetime or duration ago.")(fn)
    fn = click.option("--since", help="Start (inclusive): date, ISO datetime or duration ago (7d).")(fn)
    return fn


def open_named(db: str | None, config: str | None, wait: float, *, read_only: bool) -> Any:
    """The ledger named by ``--db``/``--config``, open (waiting up to ``wait`` s for the proxy's flush).

    Read-only, ``requests`` also shows the rows still in the write-ahead log
    (:func:`~tokenward.reports.ledger.duck.include_unflushed`), so a report is current to the
    last finished request: the DuckDB file's log, or for a Postgres ledger (a local report copy)
    this host's log in ``ledger.spool_dir`` (other replicas' logs are on their own disks).

    Raises:
        click.ClickException: no ledger there (when ``read_only``), or it stayed locked.
    """
    ledger = ledger_named(db, config)
    try:
        conn = ledger.connect(read_only=read_only, wait_s=wait)
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from exc
    if read_only:  # what the proxy has logged but not moved into the ledger yet counts too
        include_unflushed(conn, ledger.spool_dir)
    return conn


def open_read_only(db: str | None, config: str | None, wait: float) -> Any:
    """The ledger named by ``--db``/``--config``, open read-only with progress tracking on.

    Raises:
        click.ClickException: no ledger there, or it stayed locked for ``wait`` seconds.
    """
    conn = open_named(db, config, wait, read_only=True)
    # progress is drawn by reports/progress.py (one bar, also for work done in Python), not DuckDB
    conn.execute("SET enable_progress_bar = true")
    conn.execute("SET enable_progress_bar_print = false")
    return conn
