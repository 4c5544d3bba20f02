"""Settling background Responses: the deferred row gets its real usage when the finished response is seen.

A ``POST /v1/responses`` with ``"background": true`` is answered before the model runs, so its
row is ``deferred`` at its worst case (:mod:`tokenward.reports.ledger.deferred`). The finished
response comes back later through tokenward in one of three replies: a retrieval
(``GET /v1/responses/{id}``), a streamed resume (the same with ``?stream=true``, ending in
``response.completed``) or a cancel (``POST /v1/responses/{id}/cancel``). Each is metered on the
side (its own row stays ``not_metered``: the retrieval bills nothing itself); the first one that
carries usage prices the response as of its request's start and settles it once, whatever
replica or how many retrievals see it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
from decimal import Decimal
from typing import Any

from tokenward.pricing.catalog import PriceCatalog
from tokenward.pricing.quote import quote
from tokenward.pricing.usage import TOKEN_FIELDS, Usage
from tokenward.proxy.exchange import Exchange
from tokenward.proxy.guard import BudgetGuard
from tokenward.reports.ledger import deferred
from tokenward.reports.ledger.state import SqliteState

__all__ = ["finished_response_id", "note_deferred", "response_id_in", "settle_deferred"]


def _store(state: Any) -> Any:
    """The module keeping ``state``'s background responses (SQLite beside DuckDB, or Postgres); ``None``: neither."""
    if isinstance(state, SqliteState):
        return deferred
    if type(state).__name__ == "PgState":
        from tokenward.reports.ledger import pg_deferred

        return pg_deferred
    return None


log = logging.getLogger("tokenward.background")

_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_\-]{1,200})"')
_RETRIEVAL = re.compile(r"^responses/(resp_[A-Za-z0-9_\-]{1,200})(/cancel)?$")
_SCOPE = ("principal", "key_id", "team", "project", "org", "pool", "run_id", "end_user", "upstream", "session_id")


def response_id_in(reply: list[bytes]) -> str | None:
    """The id of the response a background reply (a JSON body, or a stream's first events) announces."""
    found = _RESPONSE_ID.search(b"".join(reply)[:65536])
    return found.group(1).decode() if found else None


def finished_response_id(method: str, tail: str) -> str | None:
    """The response id a request may see finished (a retrieval or a cancel), else ``None``."""
    found = _RETRIEVAL.match(tail)
    if found is None or (method, bool(found.group(2))) not in (("GET", False), ("POST", True)):
        return None
    return found.group(1)


async def note_deferred(state: Any, ex: Exchange, response_id: str) -> None:
    """Record a background response before its id reaches the client (a worker thread; logged, never raised)."""
    store = _store(state)
    if store is None:
        return
    detail = {name: getattr(ex, name, None) for name in _SCOPE}
    detail.update(
        started_at=ex.started_at,
        requested_model=ex.requested_model,
        sent_model=ex.sent_model,
        provider=ex.provider,
        price_as=ex.price_as,
        fallback=ex.price_fallback,
        reserved_usd=ex.reserved_usd,
        tags=list(ex.tags) or None,
    )
    try:
        await asyncio.to_thread(store.record, state, response_id, ex.request_id, detail)
    except Exception:
        log.exception("background response %s of %s could not be noted; it stays deferred", response_id, ex.request_id)


async def settle_deferred(
    state: Any,
    catalog: PriceCatalog,
    guard: BudgetGuard | None,
    response_id: str,
    upstream: str | None,
    usage: Usage,
    *,
    model: str | None,
    service_tier: str | None,
    raw_usage: Any,
) -> bool:
    """Price a finished background response and settle its deferred row once; whether this call settled it.

    The books move by the real cost less what the row counted (its reservation); a response with
    no price keeps counting the reservation (``unpriced`` is held, as for any row). Only a reply of
    the ``upstream`` the request went to settles it: a client that routes the retrieval to another
    configured upstream (``x-tokenward-upstream``) cannot have a reply it shapes there price it.
    """
    store = _store(state)
    if store is None:
        return False
    found = await asyncio.to_thread(store.deferred, state, response_id)
    if found is None:
        return False  # not a background response of this ledger, or settled already
    request_id, detail = found
    if upstream != detail.get("upstream"):
        log.warning(
            "response %s retrieved through upstream %r, not %r: not settled",
            response_id,
            upstream,
            detail.get("upstream"),
        )
        return False
    started = dt.datetime.fromtimestamp(float(detail["started_at"]), dt.UTC)
    sent = detail.get("sent_model") or detail.get("requested_model")
    q = quote(
        catalog,
        usage,
        model=model or sent,
        provider=detail.get("provider"),
        at=started,
        service_tier=service_tier,
        fallback=bool(detail.get("fallback")),
        requested=sent,
        price_as=detail.get("price_as"),
    )
    violations = [*usage.invalid, *usage.repairs, *usage.violations()]
    settlement: dict[str, Any] = {name: getattr(usage, name) for name in TOKEN_FIELDS}
    settlement.update(
        served_model=model or sent,
        service_tier=service_tier,
        usage_source=str(usage.source),
        cost_usd=q.cost_usd,
        price_status=str(q.status),
        price_entry_id=q.entry_id,
        price_resolved_by=q.resolved_by,
        cost_lines=q.lines,
        output_cost_usd=q.output_cost_usd,
        cache_savings_usd=q.cache_savings_usd,
        raw_usage=raw_usage,
        violations="; ".join(violations) or None,
    )
    if not await asyncio.to_thread(store.settle, state, response_id, settlement, dt.datetime.now(dt.UTC)):
        return False  # another retrieval settled it first
    held = Decimal(detail["reserved_usd"]) if detail.get("reserved_usd") is not None else Decimal(0)
    if guard is not None and q.cost_usd is not None and q.cost_usd != held:
        scope = {name: detail.get(name) for name in _SCOPE}
        row = {
            **scope,
            "request_id": request_id,
            "started_at": float(detail["started_at"]),
            "requested_model": detail.get("requested_model"),
            "sent_model": detail.get("sent_model"),
            "served_model": model or sent,
            "tags": detail.get("tags"),
            "price_status": "priced",
            "cost_usd": q.cost_usd - held,  # the row counted what its reservation held
        }
        guard.settle(None, [row])
    return True
