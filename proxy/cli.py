"""The ``tokenward`` command: ``serve``, ``demo``, and the ledger readers from ``tokenward.reports.cli``."""

from __future__ import annotations

import errno
import importlib
import logging
from pathlib import Path

import click

from tokenward.pricing.catalog import CatalogError
from tokenward.proxy.access_log import ACCESS_LOGGER
from tokenward.proxy.config import Config, ConfigError, config_from_args, load_config
from tokenward.proxy.preflight import check_budgets, check_environment, price_warnings, provider_notes
from tokenward.reports.ledger import DuckLedger, LedgerError

__all__ = ["LOG_LEVELS", "main"]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
"""``--log-level`` values (Python's logging levels; the access log is ``info``)."""

_PORT = click.IntRange(1, 65535)


_LAZY = {
    "report": "tokenward.reports.cli:report",
    "export": "tokenward.reports.cli:export",
    "ledger": "tokenward.reports.cli:ledger",
    "pricing": "tokenward.reports.pricing_cli:pricing",
    "budgets": "tokenward.reports.budgets_cli:budgets",
    "alerts": "tokenward.reports.budgets_cli:alerts",
    "keys": "tokenward.reports.keys_cli:keys",
    "top": "tokenward.reports.top_cli:top",
}
"""Commands of the reports layer, imported only when run (or listed in ``--help``)."""


class _LazyGroup(click.Group):
    """A group whose :data:`_LAZY` commands are imported when first looked up.

    ``tokenward serve`` then does not import the report commands and what they bring (rich,
    pygments, httpx for ``top``, the report queries): some 10 MB of a proxy's resident memory.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_LAZY})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _LAZY and cmd_name not in self.commands:
            module, _, name = _LAZY[cmd_name].partition(":")
            self.add_command(getattr(importlib.import_module(module), name), cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tokenward")
def main() -> None:
    """tokenward: meter, price and cap what your LLM traffic costs."""


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML config file.")
@click.option("--upstream", help="Upstream base URL, e.g. https://api.openai.com/v1 (no config file needed).")
@click.option("--provider", help="With --upstream: price catalog provider of the upstream (default: by model name).")
@click.option(
    "--auth", type=click.Choice(["passthrough", "virtual_keys"]), default=None, help="Auth mode with --upstream."
)
@click.option("--db", help="Ledger DuckDB file or postgresql:// URL (overrides the config's ledger).")
@click.option("--host", default=None, help="Interface to listen on (default 127.0.0.1).")
@click.option("--port", type=_PORT, default=None, help="Port to listen on (default 4000).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="info", show_default=True)
@click.option(
    "--access-log/--no-access-log",
    default=None,
    help="One log line per request (default: on, or the config's server.access_log).",
)
def serve(
    config_path: str | None,
    upstream: str | None,
    provider: str | None,
    auth: str | None,
    db: str | None,
    host: str | None,
    port: int | None,
    log_level: str,
    access_log: bool | None,
) -> None:
    """Run the proxy: point your OpenAI SDK's base URL at http://HOST:PORT/v1."""
    from tokenward.proxy.app import create_app
    from tokenward.proxy.server import listening_socket, run
    from tokenward.proxy.startup import StartupError, needs_single_proxy, single_proxy_lock

    if bool(config_path) == bool(upstream):
        raise click.UsageError("give either --config FILE or --upstream URL")
    config = _load(config_path, upstream, auth, provider)
    if db:
        if db.startswith(("postgresql://", "postgres://")):
            config.ledger.url = db
        else:
            config.ledger.path, config.ledger.url = db, None
    if host:
        config.server.host = host
    if port:
        config.server.port = port
    if access_log is not None:
        config.server.access_log = access_log
    warnings = _preflight(config, config_path)
    _configure_logging(log_level, config.server.access_log)
    for warning in warnings:
        logging.getLogger("tokenward.proxy").warning("%s", warning)
    try:  # before the ledger is opened: a port in use is said at once, and nothing else starts
        sock = listening_socket(config.server.host, config.server.port)
    except OSError as exc:
        in_use = exc.errno == errno.EADDRINUSE
        why = "it is in use (another tokenward, or another program): pick another --port" if in_use else exc.strerror
        raise click.ClickException(f"cannot listen on {config.server.host}:{config.server.port}: {why}") from exc
    lock = None
    if needs_single_proxy(config):
        try:
            lock = single_proxy_lock(DuckLedger(config.ledger.path))  # held until the process ends
        except StartupError as exc:
            raise click.ClickException(str(exc)) from exc
        except OSError as exc:  # the lock lives beside the ledger: a path that cannot hold one cannot hold it
            raise click.ClickException(f"cannot open the ledger {config.ledger.path}: {exc}") from exc
    try:
        app = create_app(config, proxy_lock=lock)
    except CatalogError as exc:
        raise click.ClickException(str(exc)) from exc
    # a DuckDB file is migrated by the app's own mover child (the serving process never loads DuckDB)
    store = app.state.ledger if isinstance(app.state.ledger, DuckLedger) else config.open_ledger()
    try:
        store.migrate()
    except (LedgerError, OSError) as exc:
        reason = str(exc)  # a Postgres error names the ledger already: say it once
        message = reason if store.name in reason else f"cannot open the ledger {store.name}: {reason}"
        raise click.ClickException(message) from exc
    click.echo(
        f"starting tokenward on http://{config.server.host}:{config.server.port}/v1 "
        f"(ledger {store.name}, auth {config.auth.mode})",
        err=True,
    )
    try:
        run(app, config.server.host, config.server.port, log_level=log_level.lower(), sock=sock)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown: nothing left to say
        pass


def _load(config_path: str | None, upstream: str | None, auth: str | None, provider: str | None) -> Config:
    try:
        if config_path:
            return load_config(config_path)
        assert upstream is not None
        return config_from_args(upstream, auth=auth or "passthrough", provider=provider)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


def _preflight(config: Config, config_path: str | None) -> list[str]:
    try:
        return check_environment(config) + check_budgets(config)
    except ConfigError as exc:
        raise click.ClickException(f"{config_path}: {exc}" if config_path else str(exc)) from exc


def _configure_logging(level: str, access_log: bool) -> None:
    """Log to stderr at ``level``; the access log only when asked; APScheduler quiet below debug."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level.lower() != "debug":  # "Running job ..." and "... executed successfully" for every budget check
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
    if not access_log:
        logging.getLogger(ACCESS_LOGGER).setLevel(logging.WARNING)


@main.command()
@click.option("--db", help="Ledger file to write (default: a new file in a temporary directory).")
def demo(db: str | None) -> None:
    """See the whole loop with no API key and no network: simulator -> proxy -> openai SDK -> report."""
    from tokenward.proxy.demo import run_demo

    run_demo(db)


@main.command()
@click.option("--port", type=_PORT, default=9100, show_default=True, help="Port to listen on (127.0.0.1).")
@click.option(
    "--recordings",
    type=click.Path(exists=True, dir_okay=False),
    help="JSON lines of recorded exchanges (default: the sample shipped with tokenward).",
)
def simulate(port: int, recordings: str | None) -> None:
    """Run the upstream simulator: a stand-in provider for trying tokenward without an API key.

    It answers under http://127.0.0.1:PORT/<provider>/v1 (e.g. /openai/v1, /anthropic/v1): a
    request identical to a recorded one gets the recorded reply; any other well-formed request
    to chat/completions, completions, responses, embeddings or messages gets a made-up reply in
    that API's shape, with usage counted by the tokenizer. Point an upstream's base_url there.
    """
    from aiohttp import web

    from tokenward.proxy.simulator import Simulator, load_recordings, sample_recordings_path

    loaded = load_recordings(recordings or sample_recordings_path())
    providers = sorted({r.provider for r in loaded})
    click.echo(
        f"simulator: {len(loaded)} recorded exchanges; providers at http://127.0.0.1:{port}/<provider>/v1: "
        + ", ".join(providers)
        + " (other requests get made-up replies)",
        err=True,
    )
    web.run_app(Simulator(loaded).app(), host="127.0.0.1", port=port, print=None, access_log=None)


@main.group("config")
def config_group() -> None:
    """Check a configuration file; print the reference of every option."""


@config_group.command("check")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="YAML config file.")
def config_check(config_path: str) -> None:
    """Validate FILE as `serve` would at start (schema, environment variables, then price files)."""
    from tokenward.pricing.settings import build_catalog

    config = _load(config_path, None, None, None)
    warnings = _preflight(config, config_path)
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    try:  # what create_app loads: a bad price file stops `serve`, so it fails the check too
        catalog = build_catalog(config.pricing, refresh_file=config.refresh_file())
    except CatalogError as exc:
        raise click.ClickException(str(exc)) from exc
    for warning in price_warnings(config, catalog):
        click.echo(f"warning: {warning}", err=True)
    for note in provider_notes(config, {entry.provider for entry in catalog.entries.values()}):
        click.echo(f"note: {note}", err=True)
    click.echo(
        f"{config_path}: ok ({_count(len(config.upstreams), 'upstream')}, {_count(len(config.budgets), 'budget')}, "
        f"auth {config.auth.mode}, ledger {config.open_ledger().name})"
    )


def _count(n: int, noun: str) -> str:
    """``1 budget``, ``2 budgets``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@config_group.command("reference")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to this file (default: stdout).")
def config_reference(output: str | None) -> None:
    """Print every configuration option (Markdown, generated from the schema)."""
    from tokenward.proxy.config_reference import render

    text = render()
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc}") from exc

