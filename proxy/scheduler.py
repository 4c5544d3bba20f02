"""Jobs the proxy runs on a schedule (APScheduler, inside the proxy's event loop).

Each job is a thin adapter over a plain function that tests call directly with a fixed ``now``;
jobs coalesce missed runs and never run twice at once (``max_instances=1``).

* Price refresh (``pricing.refresh``): fetch a LiteLLM-format price map, append changed prices
  as new effective-dated versions to the refresh file, and swap the recorder's catalog.
* Budget check (every ``alerts.evaluate_every_s``, and soon after a threshold is crossed):
  claim the alerts due (:mod:`tokenward.reports.budget_check`) and hand them to
  :class:`Deliveries`, which sends them in the background (a slow mail server delays no check).
* Digest (``alerts.digest``): a daily or weekly spend summary by email.
* Stored keys: keys created or revoked with ``tokenward keys`` take effect within 5 s (they live in
  the state store, which no ledger reader can block), on every replica.
* Budget books (Postgres only): reconciled from the ledger every ``RECONCILE_S`` seconds.

With a shared (Postgres) ledger, every job but the key reload runs on one replica at a time
(:func:`on_one_replica`: an advisory lock; a replica that finds it taken skips that run).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.cron import CronTrigger

from tokenward.pricing.budgets import Budget
from tokenward.pricing.catalog import PriceCatalog, read_document
from tokenward.pricing.imports import to_yaml
from tokenward.pricing.refresh import plan_refresh
from tokenward.pricing.settings import RefreshSettings
from tokenward.proxy.keys import Authenticator
from tokenward.reports.alerts import Alert, AlertSettings, Notifier
from tokenward.reports.budget_check import (
    claim_alerts,
    deliver,
    digest_alert,
    evaluate_and_notify,
    notify_one,
    record_deliveries,
)
from tokenward.reports.ledger import Ledger, LedgerError
from tokenward.reports.ledger.spend import SpendSource
from tokenward.reports.ledger.state import StateStore

if TYPE_CHECKING:  # imported by the refresh job only: not in every proxy's memory
    import httpx

__all__ = [
    "FIRST_CHECK_S",
    "KEY_RELOAD_S",
    "Deliveries",
    "RECONCILE_S",
    "add_alert_jobs",
    "check_budgets",
    "create_scheduler",
    "on_one_replica",
    "reconcile_books",
    "refresh_prices",
    "reload_keys",
    "run_budget_check_soon",
    "send_digest",
]

log = logging.getLogger("tokenward.scheduler")

KEY_RELOAD_S = 5
"""Seconds between reloads of stored keys and revocations (a revoked key stops working within this)."""

FIRST_CHECK_S = 1.0
"""Seconds after the scheduler starts (the books loaded) that the first budget check runs."""

RECONCILE_S = 30
"""Seconds between reconciliations of shared budget books from the ledger (Postgres)."""


async def on_one_replica(ledger: Ledger, name: str, job: Callable[..., Any], *args: Any) -> Any:
    """Await ``job(*args)`` unless another replica of a shared ledger is running job ``name`` now.

    Returns the job's result, or ``None`` when skipped (or the lock could not be asked for).
    """
    if not ledger.shared:
        return await job(*args)
    try:
        lock = await asyncio.to_thread(ledger.job_lock, name)  # type: ignore[attr-defined]
    except LedgerError as exc:
        log.warning("job %s skipped: %s", name, exc)
        return None
    if lock is None:
        return None
    try:
        return await job(*args)
    finally:
        await asyncio.to_thread(lock.close)


async def reconcile_books(ledger: Ledger, windows: Callable[[], list[Any]]) -> int:
    """Reconcile the shared books of blocking budgets from the ledger (the scheduled job); books done."""
    from tokenward.reports.ledger.pg_books import reconcile  # the Postgres driver, only for Postgres

    try:
        return await asyncio.to_thread(reconcile, ledger.pool, windows())  # type: ignore[attr-defined]
    except LedgerError as exc:
        log.warning("budget books not reconciled this time: %s", exc)
        return 0


def create_scheduler() -> AsyncIOScheduler:
    """A scheduler whose jobs coalesce missed runs and never overlap (start it in the lifespan)."""
    return AsyncIOScheduler(
        timezone=dt.UTC, job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 300}
    )


async def refresh_prices(
    settings: RefreshSettings,
    refresh_file: str,
    current: Callable[[], PriceCatalog],
    rebuild: Callable[[], PriceCatalog],
    install: Callable[[PriceCatalog], None],
    *,
    now: dt.datetime | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[str]:
    """Fetch ``settings.url``, record changed prices as new versions, and install the new catalog.

    Args:
        settings: where to fetch and which providers to keep.
        refresh_file: the price file new versions are appended to (created if missing).
        current: returns the catalog in use.
        rebuild: builds the catalog again from the configuration (the refresh file included).
        install: puts a catalog in use.
        now: the refresh instant (default: the current time, UTC).
        transport: httpx transport (tests).

    Returns:
        One line per price change (empty when nothing changed). Failures are logged, not raised:
        the prices in use stay as they are.
    """
    import httpx

    now = now or dt.datetime.now(dt.UTC)
    try:
        async with httpx.AsyncClient(transport=transport, timeout=60, follow_redirects=True) as client:
            response = await client.get(settings.url)
            response.raise_for_status()
            data: dict[str, Any] = response.json()
        plan = plan_refresh(current(), data, now=now, source=settings.url, providers=settings.providers)
        if not plan.entries:
            log.info("price refresh from %s: no change", settings.url)
            return []
        path = Path(refresh_file)
        existing = read_document(path) if path.exists() else None
        kept = (existing or {}).get("entries", []) if isinstance(existing, dict) else []
        header = "prices added by scheduled refreshes (new versions only; history is never edited)"
        partial = path.with_suffix(".part")
        partial.write_text(to_yaml([*kept, *plan.entries], header), encoding="utf-8")
        partial.replace(path)
        install(rebuild())
    except Exception:
        log.exception("price refresh from %s failed; prices unchanged", settings.url)
        return []
    for change in plan.changes:
        log.warning("price refresh: %s (effective %s)", change, now.isoformat())
    return plan.changes


SpendFactory = Callable[[], SpendSource]
"""Makes the spend source a budget check reads (the proxy's books, snapshotted on the event loop)."""


class Deliveries:
    """Alert deliveries under way in the proxy's event loop, apart from the checks that claimed them.

    A check claims its alerts and hands their delivery here, so that a mail server that hangs
    (until its ``timeout_s``, at every retry) holds up no later check: the next threshold's mail
    goes out while the last one's still waits (the leases keep any alert from being sent twice
    at once). :meth:`aclose` (at shutdown) cancels what is left; each gives its lease up.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(
        self, state: StateStore, notifier: Notifier, settings: AlertSettings, alert: Alert, at: dt.datetime
    ) -> None:
        """Deliver ``alert`` in the background (:func:`~tokenward.reports.budget_check.notify_one`)."""
        task = asyncio.create_task(self._deliver(state, notifier, settings, alert, at))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _deliver(
        state: StateStore, notifier: Notifier, settings: AlertSettings, alert: Alert, at: dt.datetime
    ) -> None:
        try:
            await notify_one(state, notifier, settings, alert, at)
        except Exception:
            log.exception("alert delivery failed (%s, %s)", alert.budget, alert.kind)

    async def aclose(self) -> None:
        """Cancel the deliveries still under way and wait for them to give their leases up."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def check_budgets(
    spend: SpendFactory,
    state: StateStore,
    budgets: list[Budget],
    settings: AlertSettings,
    notifier: Notifier,
    *,
    now: dt.datetime | None = None,
    rates: SpendFactory | None = None,
    deliveries: Deliveries | None = None,
    clock: Callable[[], dt.datetime] | None = None,
) -> int:
    """Evaluate budgets and send the alerts now due (the scheduled job); returns how many were claimed.

    Spend comes from the proxy's books and claims go to the state store, so a reader holding
    the ledger file delays nothing. ``rates`` makes the source velocity rules read (the proxy's
    per-minute books). With ``deliveries`` the alerts are delivered there, in the background, and
    the check returns once they are claimed; without, it returns once they are delivered.
    ``clock`` tells the instant when ``now`` is not given (default: this host's clock; the proxy on
    Postgres: the database server's).
    """
    try:
        at = now or (clock() if clock is not None else dt.datetime.now(dt.UTC))
        velocity = rates() if rates is not None else None
        if deliveries is None:
            return len(await evaluate_and_notify(spend(), state, budgets, settings, notifier, at, rates=velocity))
        alerts = await asyncio.to_thread(claim_alerts, spend(), state, budgets, settings, at, rates=velocity)
    except Exception:
        log.exception("budget check failed")
        return 0
    for alert in alerts:
        deliveries.start(state, notifier, settings, alert, at)
    return len(alerts)


async def send_digest(
    ledger: Ledger,
    budgets: list[Budget],
    settings: AlertSettings,
    notifier: Notifier,
    *,
    now: dt.datetime | None = None,
) -> bool:
    """Send the configured spend digest once for the period that just ended; true if sent.

    Figures come from the ledger (read-only); while a writer holds it, the job tries again at the
    next budget check.
    """
    digest = settings.digest
    if digest is None:
        return False
    when = now or dt.datetime.now(dt.UTC)
    state = ledger.state

    def claim(spend: SpendSource) -> Alert | None:
        return digest_alert(spend, state, budgets, digest.to, digest.every, digest.timezone, when)

    try:
        alert = await asyncio.to_thread(ledger.read_spend, claim)
        if alert is None:
            return False
        done = await deliver(state, notifier, alert)
        if done is None:
            return False
        await asyncio.to_thread(record_deliveries, state, *done, when)
    except Exception:
        log.exception("spend digest failed")
        return False
    return True


async def reload_keys(state: StateStore, auth: Authenticator) -> None:
    """Pick up keys created or revoked with ``tokenward keys`` (the scheduled job, every 5 s)."""
    try:
        keys, revoked = await asyncio.to_thread(lambda: (state.keys(), state.revoked_hashes()))
    except Exception:
        log.warning("stored keys not reloaded this time", exc_info=True)
        return
    live = [(k.name, k.key_sha256, k.team, k.project, k.role, k.expires_at) for k in keys if k.revoked_at is None]
    auth.use_stored(live, revoked)


def add_alert_jobs(
    scheduler: AsyncIOScheduler,
    ledger: Ledger,
    spend: SpendFactory,
    budgets: list[Budget],
    settings: AlertSettings,
    notifier: Notifier,
    auth: Authenticator,
    rates: SpendFactory | None = None,
    deliveries: Deliveries | None = None,
    clock: Callable[[], dt.datetime] | None = None,
) -> None:
    """Register the budget check, the digest and the stored-key reload on ``scheduler``.

    ``deliveries``: where the checks' alerts are delivered (in the background); without, each
    check waits for its deliveries. ``clock``: the budget check's instant (see :func:`check_budgets`).
    """
    if budgets or settings.admins:
        check = partial(check_budgets, rates=rates, deliveries=deliveries, clock=clock)
        scheduler.add_job(
            on_one_replica,
            "interval",
            seconds=settings.evaluate_every_s,
            # the first check as the proxy starts, not one interval later: what a stopped or
            # crashed proxy left due (a crossing not mailed yet, a mail cut off) goes out at once
            next_run_time=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=FIRST_CHECK_S),
            id="budgets",
            args=[ledger, "budgets", check, spend, ledger.state, budgets, settings, notifier],
        )
    if settings.digest is not None:
        hour, minute = (int(part) for part in settings.digest.at.split(":"))
        trigger = CronTrigger(
            hour=hour,
            minute=minute,
            day_of_week="mon" if settings.digest.every == "weekly" else "*",
            timezone=ZoneInfo(settings.digest.timezone),
        )
        digest_args = [ledger, "digest", send_digest, ledger, budgets, settings, notifier]
        scheduler.add_job(on_one_replica, trigger, id="digest", args=digest_args)
    scheduler.add_job(reload_keys, "interval", seconds=KEY_RELOAD_S, id="keys", args=[ledger.state, auth])


def run_budget_check_soon(scheduler: AsyncIOScheduler, delay_s: float) -> None:
    """Move the next budget check to ``delay_s`` seconds from now (a threshold was just crossed)."""
    job = scheduler.get_job("budgets")
    if job is not None and scheduler.running:
        job.modify(next_run_time=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay_s))
