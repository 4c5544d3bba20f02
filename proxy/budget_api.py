"""What a caller may still spend: ``GET /v1/tokenward/budget``, and the budget headers on every reply.

An agent asks before its next step how much it has left. ``GET /v1/tokenward/budget`` (the
OpenAI SDKs reach it as ``client.get("/tokenward/budget", cast_to=object)``) answers, for the
calling key, every budget in scope: the key's, its team's, org's and pool's, all traffic's, the
end user's (``X-Tokenward-User`` or the key's attribution header) and the run's
(``X-Tokenward-Run``: an id alone looks the run up, a full header joins it as a request would),
each with its limit, spent, held (reserved by requests in flight), remaining and reset time,
tightest first. A budget that applies only to some requests (a ``model``, ``tag`` or
``upstream`` scope) is listed with ``applies`` saying when. Like OpenRouter's
``GET /api/v1/key``; tokenward's own, so not sent upstream and not a ledger row.

Reply headers (:func:`reply_headers`): ``x-tokenward-budget`` and
``x-tokenward-budget-remaining-usd`` name the tightest budget in scope and what it has left;
``x-tokenward-budgets`` lists every budget in scope, tightest first, as
``<name>;limit_usd=5;remaining_usd=4.975;resets_in_s=1800`` entries separated by ``, `` (names
percent-encoded: a per-user budget's name holds a client's value).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from decimal import Decimal
from functools import lru_cache
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from litestar import Request, Response, get
from litestar.handlers import BaseRouteHandler

from tokenward.pricing.budgets import CALENDAR_PERIODS, Budget
from tokenward.pricing.runs import RunRefused, parse_run_header, run_budget_name
from tokenward.proxy.errors import ProxyError
from tokenward.proxy.guard import BudgetGuard
from tokenward.proxy.keys import AUTH_HEADERS, presented_key, upstream_credential

if TYPE_CHECKING:
    from tokenward.proxy.forward import Forwarder

__all__ = ["BUDGET_PATH", "budget_routes", "caller_budgets", "header_name", "reply_headers", "usd_text"]

BUDGET_PATH = "/v1/tokenward/budget"
_CONDITIONAL = ("model", "tag", "upstream")  # decided by each request, not by who calls
_SAFE = "/:@[]._-+=~!$&'()*"


def usd_text(amount: Decimal) -> str:
    """An exact amount of USD as plain decimal text (``0.0250175``, ``5``)."""
    return format(amount.normalize(), "f") if amount else "0"


@lru_cache(maxsize=4096)
def header_name(name: str) -> bytes:
    """A budget name as a header value: printable ASCII, anything else percent-encoded."""
    return quote(name, safe=_SAFE).encode("ascii")


@lru_cache(maxsize=4096)
def _entry_head(name: str, limit: Decimal) -> bytes:
    """``<name>;limit_usd=<limit>;remaining_usd=`` (the same for every reply of a budget)."""
    return header_name(name) + b";limit_usd=" + usd_text(limit).encode() + b";remaining_usd="


def reply_headers(guard: BudgetGuard, attributes: Mapping[str, Any], now: dt.datetime) -> list[tuple[bytes, bytes]]:
    """The budget headers of a reply in scope of ``attributes`` (none when no budget is in scope)."""
    standing = guard.standing(attributes, now)
    if not standing:
        return []
    tightest = standing[0]
    entries = []
    for entry in standing:
        budget: Budget = entry["budget"]
        text = _entry_head(budget.name, budget.limit_usd) + usd_text(entry["remaining_usd"]).encode()
        if budget.period.kind in CALENDAR_PERIODS:
            text += b";resets_in_s=" + str(max(math.ceil((entry["period_end"] - now).total_seconds()), 0)).encode()
        entries.append(text)
    return [
        (b"x-tokenward-budget", header_name(tightest["budget"].name)),
        (b"x-tokenward-budget-remaining-usd", usd_text(tightest["remaining_usd"]).encode()),
        (b"x-tokenward-budgets", b", ".join(entries)),
    ]


def _applies(budget: Budget, attributes: Mapping[str, Any]) -> str | None:
    """``always``, ``model=gpt-4o`` (only some requests are in scope), or ``None`` (never in scope)."""
    conditions = []
    for dimension, wanted in budget.scope:
        if dimension in _CONDITIONAL:
            conditions.append(f"{dimension}={wanted}")
        elif attributes.get(dimension) != wanted:
            return None
    return ", ".join(conditions) or "always"


def _view(entry: Mapping[str, Any], applies: str) -> dict[str, Any]:
    budget: Budget = entry["budget"]
    period = budget.period
    return {
        "name": budget.name,
        "group": budget.group,
        "scope": dict(budget.scope),
        "applies": applies,
        "period": period.kind,
        "timezone": period.timezone if period.kind in CALENDAR_PERIODS else None,
        "window_hours": period.rolling_hours,
        "action": budget.action,
        "limit_usd": usd_text(budget.limit_usd),
        "spent_usd": usd_text(entry["spent_usd"]),
        "held_usd": usd_text(entry["reserved_usd"]),
        "remaining_usd": usd_text(entry["remaining_usd"]),
        "period_start": entry["period_start"].isoformat() if period.kind in CALENDAR_PERIODS else None,
        "resets_at": entry["period_end"].isoformat() if period.kind in CALENDAR_PERIODS else None,
    }


def caller_budgets(forwarder: Forwarder, headers: list[tuple[bytes, bytes]], now: dt.datetime) -> dict[str, Any]:
    """The budget document for the caller presenting ``headers`` (see the module docstring).

    Raises:
        ProxyError: 401 (no or an unknown key in ``virtual_keys`` mode), 400 (two credentials, a
            malformed run header), 403 (an end user the key's attribution rules refuse, a run
            the key's run policy refuses), 409 (an ended run).
    """
    auth = forwarder.auth
    credentials = [(name, value) for name, value in headers if name in AUTH_HEADERS]
    if len(credentials) > 1:
        raise ProxyError(400, "Send exactly one credential header.", "ambiguous_credentials")
    key = None
    if credentials:
        name, value = credentials[0]
        key = upstream_credential(name, value) if auth.passthrough else presented_key(name, value)
    identity = auth.identify(key)
    given = {name: value.decode("utf-8", "replace") for name, value in headers}
    end_user = given.get(b"x-tokenward-user") or None
    attribution = identity.attribution
    if not attribution.open:
        mapped = {name: given[name] for name in auth.attribution_headers if name in given}
        end_user, _, _ = attribution.settle(end_user, (), None, mapped)
    run_id = None
    if b"x-tokenward-run" in given:
        try:
            header = parse_run_header(given[b"x-tokenward-run"])
            if forwarder.dynamic is None:
                raise RunRefused(403, "Run budgets are off on this proxy.", "run_not_allowed")
            if header.limit_usd is None and identity.runs.default_limit_usd is None:
                run_id = header.id  # an id alone looks a run up
            else:  # joined as a request would join it (a new run's clock starts)
                run_id = forwarder.dynamic.join(identity.key_id, identity.principal, identity.runs, header, now)
        except RunRefused as exc:
            raise ProxyError(exc.status, exc.message, exc.code) from None
    attributes: dict[str, Any] = {
        "key": identity.principal,
        "key_id": identity.key_id,
        "team": identity.team,
        "project": identity.project,
        "org": identity.org,
        "pool": identity.pool,
        "end_user": end_user,
        "run": run_id,
        "model": (),
        "tag": (),
    }
    guard = forwarder.guard
    views: list[dict[str, Any]] = []
    run_view = None
    if guard is not None:
        applies = {b.name: a for b in guard.budgets if (a := _applies(b, attributes)) is not None}
        names = list(applies)
        dynamic = forwarder.dynamic
        if dynamic is not None:
            try:
                dynamic.check_capacity(attributes)
                names += dynamic.scope(attributes, now)
            except RunRefused:
                pass
            run = dynamic.run_of(identity.key_id, run_id) if run_id else None
            if run is not None:
                run_view = {
                    "id": run.run_id,
                    "budget": run_budget_name(identity.key_id, run.run_id),
                    "limit_usd": usd_text(run.limit_usd),
                    "started_at": dt.datetime.fromtimestamp(run.created, dt.UTC).isoformat(),
                    "expires_at": dt.datetime.fromtimestamp(run.expires, dt.UTC).isoformat(),
                    "ended": run.ended(now.timestamp()),
                }
        standing = guard.standing(None, now, names)
        views = [_view(entry, applies.get(entry["budget"].name, "always")) for entry in standing]
    binding = [v for v in views if v["action"] == "block" and v["applies"] == "always"]
    return {
        "object": "tokenward.budget",
        "key": {
            "name": identity.principal,
            "id": identity.key_id,
            "team": identity.team,
            "project": identity.project,
            "org": identity.org,
            "pool": identity.pool,
        },
        "end_user": end_user,
        "run": run_view,
        "remaining_usd": binding[0]["remaining_usd"] if binding else None,
        "limited_by": binding[0]["name"] if binding else None,
        "budgets": views,
        "at": now.isoformat(),
    }


def budget_routes(forwarder: Forwarder) -> list[BaseRouteHandler]:
    """``GET /v1/tokenward/budget`` bound to ``forwarder`` (its keys, guard and run books)."""

    @get(BUDGET_PATH, name="tokenward-budget")
    async def budget(request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
        """Every budget in scope of the calling key: limit, spent, held, remaining, reset (tightest first)."""
        document = caller_budgets(forwarder, request.scope["headers"], dt.datetime.now(dt.UTC))
        return Response(document, headers={"cache-control": "no-store"})

    return [budget]
