"""The composition root: :func:`create_app` builds the whole proxy from a config.

Everything the proxy uses is created here and injected; tests swap the upstream transport,
the ledger path and the price catalog by argument. The upstream client and the ledger writer
belong to the app's lifespan: the writer starts before the first request is served, and on
shutdown the writer flushes every queued row before the upstream client closes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import IO, TYPE_CHECKING

from litestar import Litestar
from litestar.logging.config import LoggingConfig

from tokenward.pricing.catalog import PriceCatalog
from tokenward.pricing.settings import build_catalog
from tokenward.proxy.admin_auth import AdminAuth
from tokenward.proxy.budget_api import budget_routes
from tokenward.proxy.config import Config
from tokenward.proxy.dashboard import Dashboard, dashboard_routes
from tokenward.proxy.errors import EXCEPTION_HANDLERS
from tokenward.proxy.forward import Forwarder
from tokenward.proxy.guard import BooksSpend, BudgetGuard
from tokenward.proxy.isolation import Isolation, OwnerCache
from tokenward.proxy.keys import Authenticator
from tokenward.proxy.limits import BodyLimits, give_back_free_memory
from tokenward.proxy.preflight import price_warnings, provider_notes
from tokenward.proxy.recorder import Recorder
from tokenward.proxy.routes import MetricsAccess, build_routes
from tokenward.proxy.routing import Router
from tokenward.proxy.run_budgets import DynamicBudgets
from tokenward.proxy.scheduler import (
    RECONCILE_S,
    Deliveries,
    add_alert_jobs,
    create_scheduler,
    on_one_replica,
    reconcile_books,
    refresh_prices,
    reload_keys,
    run_budget_check_soon,
)
from tokenward.proxy.startup import (
    LOCAL_REFRESH_S,
    StartupError,
    import_legacy_state,
    load_books,
    load_unpriced,
    needs_single_proxy,
    refresh_local_books,
    runs_allowed,
    single_proxy_lock,
)
from tokenward.proxy.upstream import AiohttpUpstream, HttpxUpstream, UpstreamClient
from tokenward.proxy.velocity_books import VelocityBooks
from tokenward.reports.alerts import Notifier
from tokenward.reports.ledger import DuckLedger
from tokenward.reports.ledger.server_clock import SYNC_EVERY_S, ServerClock
from tokenward.reports.ledger.spend import SpendSource

if TYPE_CHECKING:
    import httpx

    from tokenward.reports.ledger.pg_books import PgBooks

__all__ = ["create_app"]

log = logging.getLogger("tokenward.proxy")


def create_app(
    config: Config,
    *,
    upstream_transport: httpx.AsyncBaseTransport | None = None,
    upstream: UpstreamClient | None = None,
    catalog: PriceCatalog | None = None,
    notifier: Notifier | None = None,
    proxy_lock: IO[str] | None = None,
) -> Litestar:
    """Build the proxy application.

    Args:
        config: validated configuration (:func:`tokenward.proxy.config.load_config`).
        upstream_transport: send upstream through this httpx transport (tests: ``httpx.MockTransport``).
        upstream: replaces the upstream client altogether.
        catalog: replaces the built-in price catalog plus ``config.pricing.files``.
        notifier: replaces the alert sender built from ``config.alerts``.
        proxy_lock: the one-proxy-per-ledger lock, already taken by the caller
            (:func:`~tokenward.proxy.startup.single_proxy_lock`); taken at start otherwise.

    Returns:
        A Litestar app; ``app.state.forwarder`` and ``app.state.recorder`` expose its parts.

    Raises:
        tokenward.pricing.catalog.CatalogError: a price file is invalid.
    """
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call costs CPU
    catalog = catalog if catalog is not None else build_catalog(config.pricing, refresh_file=config.refresh_file())
    budgets = config.budget_list()
    templates = config.budget_templates()
    policies = [config.auth.runs, *(k.runs for k in config.virtual_keys if k.runs is not None)]
    runs_on = runs_allowed(config)
    scheduler = create_scheduler()
    ledger = config.open_ledger()
    if isinstance(ledger, DuckLedger):  # DuckDB's work in a child: the serving process never imports it
        ledger.use_mover()
    # the instant requests start at and periods turn: on Postgres the database server's, for every replica
    clock = ServerClock()
    books: PgBooks | None = None  # shared budget books (Postgres); None: in this process's memory
    blocking = any(b.blocking for b in [*budgets, *templates])
    if ledger.shared and (blocking or runs_on):
        from tokenward.reports.ledger.pg_books import PgBooks  # the Postgres driver, only for Postgres

        replica = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        books = PgBooks(ledger.url, replica, config.ledger.lease_s)  # type: ignore[attr-defined]
    guard = dynamic = velocity = None
    if budgets or templates or runs_on:
        delay = config.ledger.flush_interval_s + 0.5  # after the row that crossed is in the ledger
        guard = BudgetGuard(
            budgets,
            clock.now(),
            lambda _: run_budget_check_soon(scheduler, delay),
            store=books,
            clock=clock.now,
        )
        horizon = max(p.policy("").max_ttl_s for p in policies)
        dynamic = DynamicBudgets(guard, templates, horizon_s=horizon)
        if books is not None:
            books.run_horizon_s = horizon  # runs are forgotten in the database as in each replica
        velocity = VelocityBooks(budgets)
        if velocity:
            guard.listeners.append(velocity.observe)
    recorder = Recorder(catalog, ledger, config.ledger.flush_interval_s, guard=guard, fsync=config.ledger.fsync)
    if upstream is not None:
        client: UpstreamClient = upstream
    elif upstream_transport is not None:
        client = HttpxUpstream(upstream_transport)
    else:
        client = AiohttpUpstream()
    auth = Authenticator(config.auth, config.virtual_keys)
    auth.clock = clock.now  # a key expires at the same instant on every replica
    if config.auth.mode == "virtual_keys" and not config.virtual_keys:
        log.warning("auth mode virtual_keys, no keys in the config: only keys from `tokenward keys create` work")
    isolation = None
    if config.auth.mode == "virtual_keys":  # in passthrough mode each client's own provider key isolates it
        owners = OwnerCache(ledger.state, fsync=config.ledger.fsync)
        isolation = Isolation(owners, shared_models=frozenset(config.auth.shared_models))
    forwarder = Forwarder(
        client,
        Router(config.upstreams),
        auth,
        recorder,
        drain_timeout_s=config.server.drain_after_disconnect_s,
        unpriced_policy=config.unpriced_policy,
        guard=guard,
        guard_settings=config.guard,
        limits=BodyLimits.from_config(config.server),
        isolation=isolation,
        dynamic=dynamic,
        clock=clock,
    )
    for warning in price_warnings(config, catalog):
        log.warning("%s", warning)
    for note in provider_notes(config, {entry.provider for entry in catalog.entries.values()}):
        log.info("%s", note)

    def spend() -> SpendSource:
        if ledger.shared:  # every replica's spend: the shared ledger, not these books
            from tokenward.reports.ledger.pg_spend import PgSpend

            return PgSpend(ledger.pool)  # type: ignore[attr-defined]
        return BooksSpend(guard, clock.now(), recorder.unpriced_seen)

    sender = recorder.metrics.counting(notifier or Notifier(config.alerts))  # failed deliveries feed /metrics
    # velocity rules: this process's per-minute books, or on a shared ledger every replica's rows
    rates = (lambda: velocity.snapshot(dt.datetime.now(dt.UTC))) if velocity and books is None else None
    deliveries = Deliveries()  # alerts are sent apart from the checks: a hanging mail server delays none
    add_alert_jobs(scheduler, ledger, spend, budgets, config.alerts, sender, auth, rates, deliveries, clock.now)  # type: ignore[arg-type]
    dashboard = Dashboard(recorder.live, guard, ledger, AdminAuth(config, keys=auth))
    refresh = config.pricing.refresh
    if refresh is not None:
        scheduler.add_job(
            on_one_replica,
            "interval",
            hours=refresh.every_hours,
            next_run_time=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5),
            args=[
                ledger,
                "price-refresh",
                partial(
                    refresh_prices,
                    refresh,
                    config.refresh_file(),
                    lambda: recorder.catalog,
                    lambda: build_catalog(config.pricing, refresh_file=config.refresh_file()),
                    lambda new: setattr(recorder, "catalog", new),
                ),
            ],
            id="price-refresh",
        )
    if books is not None and guard is not None:
        windows = partial(lambda g: g.book_windows(g.clock()), guard)
        scheduler.add_job(
            on_one_replica,
            "interval",
            seconds=RECONCILE_S,
            args=[ledger, "books-reconcile", reconcile_books, ledger, windows],
            id="books-reconcile",
        )
        # books made while serving (runs, per-user budgets) differ by replica: each reconciles its own
        # (one transaction per book, its row locked first, so replicas doing the same book agree)
        made = partial(lambda g: g.book_windows(g.clock(), made=True), guard)
        scheduler.add_job(
            reconcile_books, "interval", seconds=RECONCILE_S, args=[ledger, made], id="books-reconcile-made"
        )

    if ledger.shared:
        scheduler.add_job(
            asyncio.to_thread, "interval", seconds=SYNC_EVERY_S, args=[clock.sync, ledger.pool], id="clock-sync"
        )

    if ledger.shared and guard is not None and any(not b.blocking for b in guard.budgets):
        # budgets that do not block are counted in each replica's memory: read every replica's rows
        scheduler.add_job(
            refresh_local_books, "interval", seconds=LOCAL_REFRESH_S, args=[ledger, guard], id="local-books-refresh"
        )

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        lock = proxy_lock
        duck = isinstance(ledger, DuckLedger)  # one proxy per DuckDB ledger; Postgres replicas share PgBooks
        if lock is None and duck and needs_single_proxy(config):
            lock = await asyncio.to_thread(single_proxy_lock, ledger)
        elif lock is None and duck and dynamic is not None and runs_on:  # a run is a hard limit too
            try:
                lock = await asyncio.to_thread(single_proxy_lock, ledger)
            except (StartupError, OSError):
                dynamic.runs_off = "another tokenward proxy serves this ledger, and its runs"
                log.warning("another proxy holds %s: this one refuses X-Tokenward-Run (503)", ledger.path)
        try:
            if ledger.shared:  # before the books open: their periods follow the database's clock
                await asyncio.to_thread(clock.sync, ledger.pool)  # type: ignore[attr-defined]
            await recorder.start()
            await asyncio.to_thread(import_legacy_state, ledger)
            if config.alerts.admins:
                await asyncio.to_thread(load_unpriced, ledger, recorder)
            await reload_keys(ledger.state, auth)
            if isolation is not None:
                await isolation.owners.load()
            if books is not None:
                await books.start()
            if guard is not None:
                loaders = [loader.load for loader in (dynamic, velocity) if loader]
                await asyncio.to_thread(load_books, ledger, guard, recorder.wal, loaders=loaders)
            if isinstance(ledger, DuckLedger):  # start-up's DuckDB work is done: an idle proxy holds none
                await asyncio.to_thread(ledger.close)
            scheduler.start()
            give_back_free_memory()  # what start-up freed (the catalog's YAML, the ledger's reads): ~1 MB idle
        except BaseException:
            if isinstance(ledger, DuckLedger):
                ledger.close()
            if lock is not None:
                lock.close()
            if books is not None:
                await books.stop()
            raise
        log.info("ledger %s, %d upstream(s), auth %s", ledger.name, len(config.upstreams), config.auth.mode)
        try:
            yield
        finally:
            scheduler.shutdown(wait=False)
            await deliveries.aclose()
            try:
                await recorder.stop()
            finally:
                if isinstance(ledger, DuckLedger):
                    await asyncio.to_thread(ledger.close)
                if isolation is not None:
                    isolation.owners.close()
                if books is not None:
                    await books.stop()
                await client.aclose()
                if lock is not None:
                    lock.close()

    app = _Litestar(
        route_handlers=budget_routes(forwarder)
        + build_routes(forwarder, metrics_access=MetricsAccess.from_config(config, auth))
        + dashboard_routes(dashboard),
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        lifespan=[lifespan],
        openapi_config=None,
        logging_config=LoggingConfig(configure_root_logger=False, log_exceptions="debug"),
        request_max_body_size=None,
    )
    app.state.forwarder = forwarder
    app.state.recorder = recorder
    app.state.config = config
    app.state.scheduler = scheduler
    app.state.guard = guard
    app.state.dynamic = dynamic
    app.state.velocity = velocity
    app.state.ledger = ledger
    app.state.dashboard = dashboard
    app.state.clock = clock
    return app


class _Litestar(Litestar):
    """Litestar without the Pydantic plugins it adds whenever ``pydantic`` is importable.

    Nothing here takes or returns Pydantic models (bodies are bytes, replies msgspec), but
    pydantic is installed (the ``openai`` SDK that ``tokenward demo`` drives needs it), and
    Litestar's default plugins import it with pydantic-core: 75 modules and 7.5 MB of a
    serving proxy's RSS, 4 of them private (``bench/profile_tokenward.py memory``).
    """

    @staticmethod
    def _get_default_plugins(plugins: list) -> list:
        from litestar.plugins.core import MsgspecDIPlugin

        return [*plugins, MsgspecDIPlugin()]
