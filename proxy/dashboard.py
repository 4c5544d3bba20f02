"""The live dashboard at ``/dashboard`` and its JSON API, ``GET /dashboard/api/state``.

Where each figure comes from:

* live (memory, current to the request): requests/s, $/min and $/hour burn, the last hour per
  minute and the last requests, from the recorder's :class:`~tokenward.proxy.live.LiveFeed`;
  every budget's spend, reservations and forecast from :meth:`BudgetGuard.snapshot`, with its
  burn rate and "runs out at" from the feed (:func:`budget_views`);
* history (the ledger): today, this hour, the breakdowns by model, key and team, the hourly and
  daily series (:func:`tokenward.reports.dashboard_queries.history`, run by :meth:`Ledger.query
  <tokenward.reports.ledger.base.Ledger.query>`: for a DuckDB ledger in the mover child, so the
  serving process never maps DuckDB) and the alerts sent (the state store), from a worker
  thread, and cached: at most one query per (zone, range) runs at a time, and a result is
  reused for ``cache_s`` seconds or ten
  times as long as it took to compute, whichever is longer, so the ledger is held at most about a
  tenth of the time however many dashboards poll. A stale result is served at once while the
  next one is computed; the request path never waits for any of this.

The encoded state document is itself reused for a second (``live_cache_s``), so a hundred open
pages cost the event loop what one does.

Pages and API are behind :class:`~tokenward.proxy.admin_auth.AdminAuth`; the static assets under
``/dashboard/assets/`` (the page's script and style, and uPlot) are public and hold no data.
The page polls the API every 2 seconds.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import html
import logging
import time
from collections import OrderedDict
from dataclasses import replace
from decimal import Decimal
from importlib import resources
from typing import Any
from urllib.parse import parse_qs
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec
from litestar import Request, Response, get, post
from litestar.datastructures import Cookie
from litestar.handlers import BaseRouteHandler

from tokenward.pricing.budgets import CALENDAR_PERIODS
from tokenward.proxy.admin_auth import SESSION_COOKIE, SESSION_TTL_S, AdminAuth
from tokenward.proxy.errors import ProxyError
from tokenward.proxy.guard import BudgetGuard
from tokenward.proxy.limits import BodyLimits, read_body
from tokenward.proxy.live import LiveFeed
from tokenward.reports.dashboard_queries import RANGES, history, sent_alerts
from tokenward.reports.ledger import Ledger, LedgerError

__all__ = ["Dashboard", "budget_views", "dashboard_routes"]

log = logging.getLogger("tokenward.dashboard")

_encoder = msgspec.json.Encoder()
_LOGIN_MAX_BYTES = 16 * 1024
"""The login form is one field and anyone may post it: its body is held to 16 KiB (413) and to the
server's ``body_timeout_s`` (408), like every body (:mod:`tokenward.proxy.limits`)."""
_ASSET_TYPES = {
    ".js": "text/javascript",  # Litestar adds "; charset=utf-8" to every text/ type
    ".css": "text/css",
    ".html": "text/html",
    ".txt": "text/plain",
}
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "content-security-policy": _CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}
_MAX_CACHED = 16
_RECENT = 50
_TEN_YEARS_H = Decimal(24 * 366 * 10)


def _assets() -> dict[str, tuple[bytes, str]]:
    """The files of ``dashboard_assets`` (package data): name -> (bytes, content type)."""
    found = {}
    for entry in resources.files("tokenward.proxy").joinpath("dashboard_assets").iterdir():
        suffix = entry.name[entry.name.rfind(".") :]
        if entry.is_file() and suffix in _ASSET_TYPES:
            found[entry.name] = (entry.read_bytes(), _ASSET_TYPES[suffix])
    return found


def budget_views(guard: BudgetGuard | None, feed: LiveFeed, now: dt.datetime) -> list[dict[str, Any]]:
    """Every budget now, as live views show it (the dashboard, ``tokenward top``).

    One entry per budget (each window of a budget with several), in configuration order:
    ``budget``, ``group`` (the definition's name when it has several windows, else ``None``),
    ``scope`` (``team=a`` or ``all traffic``), ``period``
    (``hour``/``day``/``week``/``month``/``total``/``rolling``), ``timezone``,
    ``rolling_hours``, ``action``, ``thresholds`` (percent), ``limit_usd``, ``spent_usd``,
    ``reserved_usd`` (held by requests in flight), ``remaining_usd`` (limit - spent, never
    negative), ``percent`` (of the limit spent), ``forecast_usd`` (spend at the period's end at its
    average rate so far; calendar periods only), ``period_start``, ``resets_at`` (``None`` for
    total and rolling periods), ``burn_usd_per_hour`` (spend in its scope over the last 15 minutes,
    per hour) and ``runs_out_at``: the instant spend reaches the limit if it goes on at that rate,
    or ``None`` when the limit is already reached, nothing is being spent, the limit would not be
    reached before the period resets (or, rolling, ever at that rate: the window's steady spend
    stays under the limit), or not within ten years. Money is ``Decimal`` USD, instants UTC.
    """
    if guard is None:
        return []
    budgets = {b.name: b for b in guard.budgets}
    views = []
    for entry in guard.snapshot(now):
        budget = budgets[entry["budget"]]
        period = budget.period
        limit, spent = entry["limit_usd"], entry["spent_usd"]
        remaining = max(limit - spent, Decimal(0))
        burn = feed.budget_burn(budget.name, now=now.timestamp()) or Decimal(0)
        resets = entry["period_end"] if period.kind in CALENDAR_PERIODS else None
        runs_out = None
        if remaining > 0 and burn > 0 and remaining / burn < _TEN_YEARS_H:
            at = now + dt.timedelta(hours=float(remaining / burn))
            steady = period.kind != "rolling" or burn * Decimal(str(period.rolling_hours)) > limit
            if steady and (resets is None or at < resets):
                runs_out = at
        views.append(
            {
                "budget": budget.name,
                "group": budget.group,
                "scope": budget.describe_scope(),
                "period": period.kind,
                "timezone": period.timezone,
                "rolling_hours": period.rolling_hours,
                "action": budget.action,
                "thresholds": sorted(budget.thresholds),
                "limit_usd": limit,
                "spent_usd": spent,
                "reserved_usd": entry["reserved_usd"],
                "remaining_usd": remaining,
                "percent": entry["percent"],
                "forecast_usd": entry["forecast_usd"],
                "period_start": entry["period_start"] if period.kind != "total" else None,
                "resets_at": resets,
                "burn_usd_per_hour": burn.quantize(Decimal("0.000001")),
                "runs_out_at": runs_out,
            }
        )
    return views


class _Cached:
    __slots__ = ("value", "error", "fresh_until", "as_of", "task", "took_s")

    def __init__(self) -> None:
        self.value: dict[str, Any] | None = None
        self.error: str | None = None
        self.fresh_until = 0.0
        self.as_of: dt.datetime | None = None
        self.task: asyncio.Task[None] | None = None
        self.took_s = 0.0


class Dashboard:
    """The data behind the dashboard and ``tokenward top``.

    Args:
        feed: the recorder's live feed.
        guard: the budget guard (``None`` without budgets).
        ledger: the ledger (history is read in short read-only sessions, in a worker thread;
            alerts come from its state store).
        auth: who may look.
        cache_s: the shortest time a ledger result is reused (seconds).
        live_cache_s: how long one encoded state document is served to every poller (seconds).
    """

    def __init__(
        self,
        feed: LiveFeed,
        guard: BudgetGuard | None,
        ledger: Ledger,
        auth: AdminAuth,
        *,
        cache_s: float = 5.0,
        live_cache_s: float = 1.0,
    ) -> None:
        self.feed = feed
        self.guard = guard
        self.ledger = ledger
        self.auth = auth
        self.cache_s = cache_s
        self.live_cache_s = live_cache_s
        self._cache: OrderedDict[tuple[str, str], _Cached] = OrderedDict()
        self._documents: dict[tuple[str, str], tuple[float, bytes]] = {}
        self.queries = 0  # ledger reads done (for tests and benchmarks)

    async def history(self, tz: str, range_name: str, wait_s: float = 2.0) -> dict[str, Any] | None:
        """The ledger figures for ``(tz, range_name)``, cached; ``None`` if none is ready within ``wait_s``.

        A stale result comes back at once while a new one is computed in the background; only
        the first call for a key waits (up to ``wait_s``). The result carries ``as_of`` (when it
        was read), ``stale``, ``error`` (why the last read failed, e.g. the ledger is held by
        another process) and ``query_ms`` (how long the last read took, ledger session included).
        """
        key = (tz, range_name)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = _Cached()
            while len(self._cache) > _MAX_CACHED:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        now = time.monotonic()
        if entry.task is None and now >= entry.fresh_until:
            entry.task = asyncio.create_task(self._refresh(entry, tz, range_name), name="tokenward-dashboard-query")
        if entry.value is None and entry.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(entry.task), wait_s)
            except TimeoutError:
                pass
        if entry.value is None:
            return None if entry.error is None else {"as_of": None, "stale": True, "error": entry.error}
        return {
            **entry.value,
            "as_of": entry.as_of,
            "stale": entry.task is not None,
            "error": entry.error,
            "query_ms": round(entry.took_s * 1000, 1),
        }

    async def _refresh(self, entry: _Cached, tz: str, range_name: str) -> None:
        started = time.monotonic()
        now = dt.datetime.now(dt.UTC)
        try:
            self.queries += 1
            entry.value = await asyncio.to_thread(self._read, now, tz, range_name)
            entry.as_of, entry.error = now, None
        except LedgerError as exc:  # held by another process, or unreadable: keep the last figures
            entry.error = str(exc)
        except Exception as exc:
            log.exception("dashboard ledger query failed")
            entry.error = f"ledger query failed: {exc}"
        finally:
            entry.took_s = time.monotonic() - started
            entry.fresh_until = time.monotonic() + max(self.cache_s, 10 * entry.took_s)
            entry.task = None

    def _read(self, now: dt.datetime, tz: str, range_name: str) -> dict[str, Any]:
        """The ledger's figures (where the ledger runs queries: a serving proxy's mover child), then the alerts sent."""
        figures = self.ledger.query(history, now, tz, range_name)
        figures["alerts"] = sent_alerts(self.ledger.state)  # the state store is SQLite, read here
        return figures

    async def state(self, tz: str = "UTC", range_name: str = "today", recent: int = _RECENT) -> dict[str, Any]:
        """Everything the dashboard shows: ``now``, ``tz``, ``range``, ``live``, ``budgets``, ``ledger``.

        ``live``: :meth:`LiveFeed.rates` plus ``per_minute`` (the last 60 minutes), ``recent`` (the
        last ``recent`` rows, newest first), ``rows_seen`` and ``since`` (when the feed started).
        ``budgets``: :func:`budget_views`. ``ledger``: :meth:`history` (``None`` until the first
        read is done).

        Raises:
            ValueError: unknown zone or range.
        """
        _check_zone(tz)
        if range_name not in RANGES:
            raise ValueError(f"unknown range {range_name!r}; choose from {', '.join(RANGES)}")
        ledger = await self.history(tz, range_name)
        now = dt.datetime.now(dt.UTC)
        stamp = now.timestamp()
        live = self.feed.rates(stamp)
        live["per_minute"] = self.feed.per_minute(60, stamp)
        live["recent"] = self.feed.recent(recent)
        live["rows_seen"] = self.feed.rows_seen
        live["since"] = dt.datetime.fromtimestamp(self.feed.started, dt.UTC)
        return {
            "now": now,
            "tz": tz,
            "range": range_name,
            "live": live,
            "budgets": budget_views(self.guard, self.feed, now),
            "ledger": ledger,
        }

    async def state_json(self, tz: str = "UTC", range_name: str = "today") -> bytes:
        """:meth:`state` as JSON (money as fixed-point strings, instants ISO 8601 UTC).

        One document per (zone, range) is reused for ``live_cache_s``, however many pages poll.

        Raises:
            ValueError: unknown zone or range.
        """
        key = (tz, range_name)
        cached = self._documents.get(key)
        if cached is not None and time.monotonic() - cached[0] < self.live_cache_s:
            return cached[1]
        document = _encoder.encode(_plain(await self.state(tz, range_name)))
        if len(self._documents) >= _MAX_CACHED:
            self._documents.clear()
        self._documents[key] = (time.monotonic(), document)
        return document


def _plain(value: Any) -> Any:
    """``value`` with every ``Decimal`` as a fixed-point string (``0.0000001``, never ``1E-7``)."""
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _check_zone(tz: str) -> None:
    try:
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"unknown time zone {tz!r}") from exc


def _page(body: bytes, status: int = 200) -> Response[bytes]:
    return Response(
        body,
        status_code=status,
        media_type="text/html",  # Litestar adds the charset
        headers={**_HEADERS, "cache-control": "no-store"},
    )


def _login_page(message: str, status: int) -> Response[bytes]:
    form = (
        '<form method="post" action="/dashboard/login" class="login">'
        '<label for="token">Admin token or admin virtual key</label>'
        '<input id="token" name="token" type="password" autocomplete="current-password" autofocus required>'
        '<button type="submit">Open the dashboard</button></form>'
        if status == 401
        else ""
    )
    body = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>tokenward dashboard</title>'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
        '<link rel="stylesheet" href="/dashboard/assets/dashboard.css"></head>'
        '<body class="login-page"><main><h1>tokenward</h1>'
        f'<p class="note" id="login-message">{html.escape(message)}</p>'
        f"{form}</main></body></html>"
    )
    return _page(body.encode(), status)


def dashboard_routes(dashboard: Dashboard) -> list[BaseRouteHandler]:
    """The dashboard's route handlers.

    ``/dashboard`` (the page, or the login form), ``POST /dashboard/login``,
    ``GET /dashboard/api/state?tz=<IANA zone>&range=<today|24h|7d|30d>`` and the static assets.
    """
    assets = _assets()
    page = assets["dashboard.html"][0]
    auth = dashboard.auth

    @get(["/dashboard", "/dashboard/"], name="dashboard", include_in_schema=False)
    async def dashboard_page(request: Request[Any, Any, Any]) -> Response[bytes]:
        """The dashboard page (its data comes from the API), or the login form."""
        try:
            auth.check(request)
        except ProxyError as exc:
            return _login_page(exc.message, exc.status)
        return _page(page)

    @post("/dashboard/login", name="dashboard_login", include_in_schema=False, status_code=303)
    async def login(request: Request[Any, Any, Any]) -> Response[bytes]:
        """Check the form's ``token`` (urlencoded); on success set the session cookie and go to the dashboard."""
        limits = BodyLimits.from_config(request.app.state.config.server)
        limits = replace(limits, max_bytes=_LOGIN_MAX_BYTES)
        body = await read_body(request.receive, request.scope["headers"], limits)
        secret = parse_qs(body.decode("utf-8", "replace")).get("token", [None])[0]
        session = auth.login(secret.strip()) if isinstance(secret, str) and secret.strip() else None
        if session is None:
            return _login_page("That is not an admin credential.", 401)
        cookie = Cookie(
            key=SESSION_COOKIE,
            value=session,
            path="/dashboard",
            max_age=SESSION_TTL_S,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return Response(b"", status_code=303, headers={**_HEADERS, "location": "/dashboard"}, cookies=[cookie])

    @get("/dashboard/api/state", name="dashboard_state", include_in_schema=False)
    async def state(request: Request[Any, Any, Any]) -> Response[bytes]:
        """The dashboard's figures as JSON (money as decimal strings, instants as ISO 8601 UTC)."""
        auth.check(request)
        tz = request.query_params.get("tz") or "UTC"
        range_name = request.query_params.get("range") or "today"
        try:
            document = await dashboard.state_json(tz, range_name)
        except ValueError as exc:
            raise ProxyError(400, str(exc), "invalid_parameter") from exc
        return Response(
            document,
            media_type="application/json",
            headers={**_HEADERS, "cache-control": "no-store"},
        )

    @get("/dashboard/assets/{name:str}", name="dashboard_asset", include_in_schema=False)
    async def asset(request: Request[Any, Any, Any]) -> Response[bytes]:
        """A static file of the page (no data in it, so no credential needed)."""
        name = request.path_params["name"]
        found = assets.get(name)
        if found is None:
            raise ProxyError(404, f"no dashboard asset {name!r}", "not_found")
        return Response(found[0], media_type=found[1], headers={**_HEADERS, "cache-control": "max-age=300"})

    return [dashboard_page, login, state, asset]
