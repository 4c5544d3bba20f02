"""The ``tokenward`` command: ``serve``, ``demo``, and the ledger readers from ``tokenward.reports.cli``."""

from __future__ import annotations

import logging

import click

from tokenward.pricing.catalog import CatalogError
from tokenward.proxy.config import ConfigError, config_from_args, load_config
from tokenward.reports.budgets_cli import alerts, budgets, keys
from tokenward.reports.cli import export, ledger, report
from tokenward.reports.ledger import LedgerError, open_ledger
from tokenward.reports.pricing_cli import pricing
from tokenward.reports.top_cli import top

__all__ = ["main"]


@click.group()
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
@click.option("--db", help="Ledger DuckDB file (overrides the config's ledger.path).")
@click.option("--host", default=None, help="Interface to listen on (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to listen on (default 4000).")
@click.option("--log-level", default="info", show_default=True)
@click.option("--access-log/--no-access-log", default=False, show_default=True)
def serve(
    config_path: str | None,
    upstream: str | None,
    provider: str | None,
    auth: str | None,
    db: str | None,
    host: str | None,
    port: int | None,
    log_level: str,
    access_log: bool,
) -> None:
    """Run the proxy: point your OpenAI SDK's base URL at http://HOST:PORT/v1."""
    from tokenward.proxy.app import create_app
    from tokenward.proxy.server import run

    if bool(config_path) == bool(upstream):
        raise click.UsageError("give either --config FILE or --upstream URL")
    try:
        if config_path:
            config = load_config(config_path)
        else:
            assert upstream is not None
            config = config_from_args(upstream, auth=auth or "passthrough", provider=provider)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    if db:
        config.ledger.path = db
    if host:
        config.server.host = host
    if port:
        config.server.port = port
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(config)
    except CatalogError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        open_ledger(config.ledger.path, wait_s=10).close()
    except (LedgerError, OSError) as exc:
        raise click.ClickException(f"cannot open the ledger {config.ledger.path}: {exc}") from exc
    click.echo(
        f"starting tokenward on http://{config.server.host}:{config.server.port}/v1 "
        f"(ledger {config.ledger.path}, auth {config.auth.mode})",
        err=True,
    )
    run(app, config.server.host, config.server.port, log_level=log_level, access_log=access_log)


@main.command()
@click.option("--db", help="Ledger file to write (default: a new file in a temporary directory).")
def demo(db: str | None) -> None:
    """See the whole loop with no API key and no network: simulator -> proxy -> openai SDK -> report."""
    from tokenward.proxy.demo import run_demo

    run_demo(db)


@main.command()
@click.option("--port", default=9100, show_default=True, help="Port to listen on (127.0.0.1).")
@click.option(
    "--recordings",
    type=click.Path(exists=True, dir_okay=False),
    help="JSON lines of recorded exchanges (default: the sample shipped with tokenward).",
)
def simulate(port: int, recordings: str | None) -> None:
    """Run the upstream simulator: an OpenAI-compatible provider replaying recorded exchanges.

    Each recorded provider answers under http://127.0.0.1:PORT/<provider>/v1 (e.g. /openai/v1);
    point an upstream's base_url there to try tokenward without an API key.
    """
    from aiohttp import web

    from tokenward.proxy.simulator import Simulator, load_recordings, sample_recordings_path

    loaded = load_recordings(recordings or sample_recordings_path())
    providers = sorted({r.provider for r in loaded})
    click.echo(
        f"simulator: {len(loaded)} recorded exchanges; providers at http://127.0.0.1:{port}/<provider>/v1: "
        + ", ".join(providers),
        err=True,
    )
    web.run_app(Simulator(loaded).app(), host="127.0.0.1", port=port, print=None, access_log=None)


main.add_command(report)
main.add_command(export)
main.add_command(ledger)
main.add_command(pricing)
main.add_command(budgets)
main.add_command(alerts)
main.add_command(keys)
main.add_command(top)
