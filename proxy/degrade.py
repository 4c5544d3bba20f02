"""Degrade instead of refusing: a cheaper model, or a smaller answer, that fits every budget in scope.

When a request's worst case does not fit, and every blocking budget it does not fit allows it
(``degrade`` on the budget), :func:`degrade` first tries the cheaper model the budgets map the
requested one to (``reroute``), then the largest output limit that fits (``clamp_output``, down
to ``min_output_tokens``). Each try ends in :meth:`BudgetGuard.admit
<tokenward.proxy.guard.BudgetGuard.admit>` with the degraded request's own worst case, against
every blocking budget in scope (the cheaper model's own budgets too), so a degraded request is
reserved exactly like any other: it never spends past a limit, and never escapes one (the
requested model's budgets still count it). The forwarder then edits the body (``model``,
``max_tokens``...) byte for byte and says what it did in ``x-tokenward-degraded``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tokenward.pricing.budgets import Budget
from tokenward.proxy.guard import BudgetGuard, BudgetRefusal, Reservation

__all__ = ["Bound", "Plan", "degrade"]

Bound = Callable[[str | None, int], Awaitable[Decimal | None]]
"""``bound(model, max_output_tokens)``: the worst case (USD) of the request sent for ``model`` with
that output limit per choice; ``None`` when it cannot be sent so (another upstream, no price)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A degraded request that fits: its reservation, and what to send instead.

    ``model``: the cheaper model (``None``: as requested); ``max_output_tokens``: the output limit
    per choice (``None``: as requested); ``budget``: the budget whose ``degrade`` made room.
    """

    reservation: Reservation
    worst_case: Decimal
    model: str | None
    max_output_tokens: int | None
    budget: Budget


def _blocking(guard: BudgetGuard, attributes: Mapping[str, Any], now: dt.datetime) -> list[dict[str, Any]]:
    return [entry for entry in guard.standing(attributes, now) if entry["budget"].blocking]


def _with_model(attributes: Mapping[str, Any], model: str) -> dict[str, Any]:
    """Attributes of the rerouted request: both models, so that both models' budgets are in scope."""
    return {**attributes, "model": (*attributes.get("model", ()), model)}


async def degrade(
    guard: BudgetGuard,
    attributes: Mapping[str, Any],
    worst: Decimal,
    now: dt.datetime,
    *,
    model: str | None,
    max_output_tokens: int,
    bound: Bound,
    request_id: str | None = None,
) -> Plan | None:
    """A degraded version of a request that did not fit, reserved; ``None`` when there is none.

    Args:
        guard: the books.
        attributes: the request's scope attributes.
        worst: the request's worst case as sent (USD), which did not fit.
        now: the request's start.
        model: the requested model.
        max_output_tokens: its output limit per choice (as sent, or the guard's default).
        bound: prices the request for another model or output limit (:data:`Bound`).
        request_id: the request's id, for its reservation (:meth:`BudgetGuard.admit`).

    Only when every blocking budget the request does not fit has a ``degrade`` allowing the
    step: a budget without one still refuses.
    """
    failing = [entry["budget"] for entry in _blocking(guard, attributes, now) if entry["remaining_usd"] < worst]
    policies = [budget.degrade for budget in failing]
    if not failing or any(policy is None for policy in policies):
        return None
    first = failing[0]
    sent, scope = model, attributes
    if all(policy is not None and policy.reroute for policy in policies):
        cheaper = policies[0].cheaper(model) if policies[0] is not None else None
        priced = await bound(cheaper, max_output_tokens) if cheaper is not None else None
        if cheaper is not None and priced is not None:
            sent, scope = cheaper, _with_model(attributes, cheaper)
            try:
                return Plan(await guard.admit(scope, priced, now, request_id=request_id), priced, cheaper, None, first)
            except BudgetRefusal:
                pass  # still too dear: a smaller answer from the cheaper model, if allowed
    if not all(policy is not None and policy.clamp for policy in policies):
        return None
    lowest = max(policy.min_output_tokens for policy in policies if policy is not None)
    if lowest >= max_output_tokens:
        return None
    room = min((entry["remaining_usd"] for entry in _blocking(guard, scope, now)), default=None)
    if room is None:
        return None
    tokens = await _most_that_fits(bound, sent, lowest, max_output_tokens - 1, room)
    if tokens is None:
        return None
    priced = await bound(sent, tokens)
    if priced is None:
        return None
    try:
        reservation = await guard.admit(scope, priced, now, request_id=request_id)
    except BudgetRefusal:
        return None  # the books moved while we priced: refuse as usual
    return Plan(reservation, priced, sent if sent != model else None, tokens, first)


async def _most_that_fits(bound: Bound, model: str | None, low: int, high: int, room: Decimal) -> int | None:
    """The largest output limit in ``[low, high]`` whose worst case is at most ``room`` (binary search).

    The worst case grows with the output limit (every rate is non-negative; context tiers only
    add), so the search is exact.
    """
    cost = await bound(model, low)
    if cost is None or cost > room:
        return None
    while low < high:
        middle = (low + high + 1) // 2
        cost = await bound(model, middle)
        if cost is not None and cost <= room:
            low = middle
        else:
            high = middle - 1
    return low
