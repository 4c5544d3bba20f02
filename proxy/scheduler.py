"""Jobs the proxy runs on a schedule (APScheduler, inside the proxy's event loop).

Each job is a thin adapter over a plain function that tests call directly with a fixed ``now``;
jobs coalesce missed runs and never run twice at once (``max_instances=1``).

* Price refresh (``pricing.refresh``): fetch a LiteLLM-format price map, append changed prices
  as new effective-dated versions to the refresh file, and swap the recorder's catalog.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from tokenward.pricing.catalog import PriceCatalog, read_document
from tokenward.pricing.imports import to_yaml
from tokenward.pricing.refresh import plan_refresh
from tokenward.pricing.settings import RefreshSettings

__all__ = ["create_scheduler", "refresh_prices"]

log = logging.getLogger("tokenward.scheduler")


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
