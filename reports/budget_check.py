"""Budget evaluation, and the alerts it owes: each claimed exactly once, delivered at least once.

:func:`claim_alerts` reads every budget's spend in its current period from a
:class:`~tokenward.reports.ledger.spend.SpendSource` (the ledger, or the proxy's running books:
one source of truth either way, field case B35), compares it with the thresholds and the
forecast, and claims each alert in the :class:`~tokenward.reports.ledger.state.StateStore` by
its :class:`~tokenward.reports.ledger.state.AlertKey` (budget, period start, kind, threshold).
A key is claimed once, whatever process or restart evaluates next (B37). Several thresholds
crossed at once make one message naming all of them, but each threshold keeps its own claim
and its own delivery record per target.

:func:`evaluate_and_notify` sends what was claimed and records every target's delivery the
moment it happens; a claim with a target not yet reached stays ``pending`` and is sent again,
only there, at the next evaluation. Delivery is therefore *at least once* per (key, target):
a crash between a mail server accepting a message and the record being written sends it once
more, with the same ``Message-ID`` (and a webhook with the same idempotency key), so the
duplicate can be recognised.

Callers: the proxy's scheduled job and ``tokenward budgets check``.
"""

from __future__ import annotations

import asyncio
import calendar
import datetime as dt
import logging
import sqlite3
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

from tokenward.pricing.budgets import CALENDAR_PERIODS, Budget, BudgetStatus, evaluate
from tokenward.pricing.velocity import VelocityStatus, velocity_status, velocity_windows
from tokenward.reports.alerts import REFUSED, Alert, AlertSettings, Delivery, Notifier, html_document, html_text
from tokenward.reports.ledger.errors import LedgerError
from tokenward.reports.ledger.spend import SpendSource
from tokenward.reports.ledger.state import AlertKey, DeliveryRecord, StateStore
from tokenward.reports.sanitize import printable

__all__ = [
    "ENDED_PERIOD_WATCH",
    "LEASE_MARGIN_S",
    "REARMED",
    "STORE_RETRY_S",
    "claim_alerts",
    "deliver",
    "digest_alert",
    "evaluate_and_notify",
    "exact_usd",
    "notify_one",
    "record_deliveries",
    "status_of",
    "usd",
    "velocity_of",
]

log = logging.getLogger("tokenward.alerts")

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_NAME_CHARS = 120  # a client-chosen model or key name shown in a mail: one line, at most this long


def _shown(name: object) -> str:
    """A model, key or budget name as shown in an alert (client-supplied: control characters escaped)."""
    return printable(name, _NAME_CHARS)


def usd(amount: Decimal) -> str:
    """Dollars for people: cents from $1 up, else the significant digits (at most 6 places)."""
    if abs(amount) >= 1 or amount == 0:
        return f"${amount:,.2f}"
    small = amount.quantize(Decimal("0.000001")).normalize()
    return f"${small:.2f}" if -small.as_tuple().exponent <= 2 else f"${small:f}"


def exact_usd(amount: Decimal) -> str:
    """Dollars to the last digit the ledger has (``$12.345``, ``$0.0000042``), at least cents (``$0.30``).

    What a budget alert says of spend, limit and what is left: rounded to cents, a limit of
    $12.345 read $12.34 and $99.996 spent read $100.00, under a limit not reached yet.
    """
    exact = amount.normalize()
    if exact.as_tuple().exponent > -2:  # type: ignore[operator]
        exact = exact.quantize(Decimal("0.01"))
    return f"${exact:,f}"


def _figure(amount: Decimal) -> str:
    """An exact amount for a webhook's figures, the same whatever engine summed it: ``6.3000042``, ``11``.

    (DuckDB's sums carry 12 decimal places, ``6.300004200000``; the proxy's books, those of their rows.)
    """
    return f"{amount.normalize():f}"


def status_of(spend: SpendSource, budget: Budget, now: dt.datetime) -> BudgetStatus:
    """Where ``budget`` stood at ``now`` (requests started before ``now`` in its current period)."""
    start, end = budget.period.window(now)
    return evaluate(budget, spend.spend_in(budget, start, min(end, now + dt.timedelta(microseconds=1))), now)


def velocity_of(spend: SpendSource, budget: Budget, now: dt.datetime) -> VelocityStatus:
    """``budget``'s velocity rule at ``now`` (it must have one), reading the windows from ``spend``."""
    rule = budget.velocity
    assert rule is not None
    window_start, baseline_start = velocity_windows(rule, now)
    recent = spend.spend_in(budget, window_start, now + dt.timedelta(microseconds=1))
    return velocity_status(rule, recent, spend.spend_in(budget, baseline_start, window_start))


def _keys(budget: str, start: dt.datetime, kind: str, thresholds: Sequence[int]) -> list[AlertKey]:
    return [AlertKey(budget, start, kind, t) for t in thresholds]


def _settled(state: StateStore, key: AlertKey) -> tuple[set[str], set[str]]:
    """Targets ``key``'s alert reached, and those that refused it for good (never tried again)."""
    records = state.deliveries(key)
    reached = {d.target for d in records if d.ok}
    return reached, {d.target for d in records if not d.ok and (d.error or "").startswith(REFUSED)} - reached


def claim_alerts(
    spend: SpendSource,
    state: StateStore,
    budgets: Sequence[Budget],
    settings: AlertSettings,
    now: dt.datetime,
    *,
    dry_run: bool = False,
    rates: SpendSource | None = None,
) -> list[Alert]:
    """Evaluate every budget and claim the alerts now due; return those to send (blocking).

    Kinds: ``threshold`` (one message for the thresholds newly crossed), ``forecast`` (spend is
    projected past the limit before the period ends), ``refusing`` (a blocking budget refused
    requests this period), and, for ``settings.admins``, ``unpriced_model`` and ``usage_invalid``
    (the first requests for a model recorded without a cost: no price, or counts no rule could
    repair). Claims still pending from earlier evaluations (a target not yet
    reached) come back too, addressed only to the targets they have not reached. With
    ``dry_run`` nothing is claimed.

    A rolling window never ends, so its alerts are claimed once and re-armed instead: a
    threshold alerts again after spend has fallen back below it, ``refusing`` after a window
    with no refusal.

    ``velocity`` (budgets with a velocity rule): the spend rate of the last minutes is above the
    rule's rate, or the trailing baseline's times its factor; read from ``rates`` (default
    ``spend``: any window; the proxy passes its per-minute books). One alert per episode
    (:func:`_velocity_alerts`).
    """
    alerts = []
    rearmed = None
    for budget in budgets:
        status = status_of(spend, budget, now)
        key = _EPOCH if budget.period.kind == "rolling" else status.start
        refused = budget.blocking and spend.refusals(budget, status.start) > 0
        if budget.period.kind == "rolling" and not dry_run:
            state.rearm(budget.name, key, status.crossed, bool(refused))
        claimed = _claimed_in(state, status, key)
        if not dry_run and any(k == "threshold" and t not in status.crossed for k, t in claimed):
            # a threshold claimed but no longer crossed: the limit was raised since (a rolling window is re-armed above)
            _mark_rearmed(state, budget, key, status.crossed, now)
            state.rearm(budget.name, key, status.crossed, bool(refused), limit=str(budget.limit_usd))
            claimed = _claimed_in(state, status, key)
        if any(k == REARMED for k, _ in claimed):
            rearmed = _rearmed_at(state) if rearmed is None else rearmed
            # mailed at this very limit before a newer one re-armed it: a replica not restarted yet
            claimed |= {
                ("threshold", t) for t in status.crossed if rearmed.get((budget.name, key, t)) == str(budget.limit_usd)
            }
        new = tuple(t for t in status.crossed if ("threshold", t) not in claimed)
        due: list[tuple[str, tuple[int, ...], tuple[str, ...] | None]] = []
        if new:
            due.append(("threshold", new, None))
        if status.forecast_exceeds and status.spent < budget.limit_usd and ("forecast", 0) not in claimed:
            due.append(("forecast", (0,), None))
        if refused and ("refusing", 0) not in claimed:
            due.append(("refusing", (0,), _refusal_targets(budget, settings)))
        alerts += _claimed(spend, state, status, key, due, now, dry_run)
        if budget.period.kind in CALENDAR_PERIODS and now - status.start < ENDED_PERIOD_WATCH:
            alerts += _ended_period_alerts(spend, state, budget, status.start, now, dry_run)
    alerts += _velocity_alerts(rates or spend, state, budgets, now, dry_run)
    if settings.admins:
        alerts += _unpriced_alerts(spend, state, settings, now, dry_run)
    if not dry_run:
        fresh = {(a.budget, a.period_start, a.kind, t) for a in alerts for t in a.thresholds}
        alerts += _pending(state, budgets, settings, exclude=fresh)
    return [a for a in alerts if a.targets]


def _claimed_in(state: StateStore, status: BudgetStatus, key: dt.datetime) -> set[tuple[str, int]]:
    """``(kind, threshold)`` claimed for ``status``'s budget in its period, under any time zone it had.

    A calendar period's claims are keyed by its start (UTC), which moves when the budget's
    ``timezone`` is edited mid-period (a restart with ``UTC`` -> ``Europe/Paris`` starts November
    an hour earlier). The month is still the one whose thresholds were mailed: a claim made for
    the same period kind starting on the same local calendar day, hour and minute in the zone it
    was made in (claims before the zone was stored: whose window covers more than half of this
    one and this one more than half of it) counts as this period's, so it is not mailed again.
    """
    claimed = state.claimed(status.budget.name, key)
    period = status.budget.period
    if period.kind not in ("day", "week", "month"):
        return claimed  # an hour starts at the same instant in (almost) every zone; other kinds never move
    span = status.end - status.start
    local = status.start.astimezone(ZoneInfo(period.timezone)).replace(tzinfo=None)
    for claim in state.claims(budget=status.budget.name, starting=(status.start - span, status.end)):
        payload = claim.detail.get("payload") or {}
        if claim.key.period_start == key or not isinstance(payload, dict):
            continue
        try:
            start, end = (dt.datetime.fromisoformat(payload[k]) for k in ("period_start", "period_end"))
            zone = ZoneInfo(payload["timezone"]) if payload.get("timezone") else None
        except (KeyError, TypeError, ValueError):
            continue
        if zone is not None:
            same = payload.get("period") == period.kind and start.astimezone(zone).replace(tzinfo=None) == local
        else:
            overlap = min(end, status.end) - max(start, status.start)
            same = overlap * 2 > span and overlap * 2 > end - start
        if same:
            claimed.add((claim.key.kind, claim.key.threshold))
    return claimed


REARMED = "rearmed"
"""Claim kind recording that a threshold mailed at one limit was re-armed by another (never mailed)."""


def _mark_rearmed(
    state: StateStore, budget: Budget, key: dt.datetime, crossed: Sequence[int], now: dt.datetime
) -> None:
    """Before a new limit re-arms thresholds mailed at an old one, note each with the limit it was mailed at.

    A limit changes replica by replica (a rolling restart): until the last one runs the new
    config, replicas with the old limit evaluate the same claims. Without the note they found
    the threshold unclaimed and mailed it again at the old limit, at every evaluation after a
    new-limit replica had re-armed it. The note's claim is unique like any other (the first
    re-arm of a period keeps the limit the mail went out at); it is stored as sent.
    """
    limit = str(budget.limit_usd)
    for claim in state.claims(kind="threshold"):
        mailed_at = (claim.detail.get("payload") or {}).get("limit_usd")
        if (
            claim.key.budget != budget.name
            or claim.key.period_start != key
            or claim.status == "pending"
            or claim.key.threshold in crossed
            or mailed_at is None
            or mailed_at == limit
        ):
            continue
        note = AlertKey(budget.name, key, REARMED, claim.key.threshold)
        for won in state.claim([note], {"limit_usd": mailed_at, "rearmed_for": limit}, now):
            state.set_status(won, "sent")


def _rearmed_at(state: StateStore) -> dict[tuple[str, dt.datetime, int], str]:
    """``(budget, period start, threshold) -> the limit it was mailed at`` of every re-arm note."""
    return {
        (c.key.budget, c.key.period_start, c.key.threshold): str(c.detail.get("limit_usd"))
        for c in state.claims(kind=REARMED)
    }


ENDED_PERIOD_WATCH = dt.timedelta(hours=1)
"""How long after a calendar period ends its thresholds are still evaluated (requests in flight at the rollover)."""


def _claimed(
    spend: SpendSource,
    state: StateStore,
    status: BudgetStatus,
    key: dt.datetime,
    due: list[tuple[str, tuple[int, ...], tuple[str, ...] | None]],
    now: dt.datetime,
    dry_run: bool,
) -> list[Alert]:
    """The alerts ``due`` for ``status``'s budget and period, each claimed (those another process won are left out)."""
    alerts = []
    for kind, thresholds, targets in due:
        alert = _budget_alert(spend, status, key, kind, thresholds, targets)
        if not dry_run:
            won = state.claim(_keys(status.budget.name, key, kind, thresholds), _detail(alert), now)
            if not won:
                continue  # another process claimed it first
            won_thresholds = tuple(k.threshold for k in won)
            alert = replace(alert, thresholds=won_thresholds, threshold=max(won_thresholds))
        alerts.append(alert)
    return alerts


def _ended_period_alerts(
    spend: SpendSource, state: StateStore, budget: Budget, start: dt.datetime, now: dt.datetime, dry_run: bool
) -> list[Alert]:
    """Thresholds the calendar period that ended at ``start`` crossed and never alerted.

    A request crossing a threshold in a period's last seconds (or one that started before the
    rollover and ended after it, counted in the period it started in) is seen by the first
    evaluation of the next period: the crossing is still the ended period's, and is mailed
    once, as such.
    """
    last = start - dt.timedelta(microseconds=1)
    before, _ = budget.period.window(last)
    try:
        ended = evaluate(budget, spend.spend_in(budget, before, start), last)
    except LookupError:  # a source that no longer has that period
        return []
    claimed = _claimed_in(state, ended, before)
    new = tuple(t for t in ended.crossed if ("threshold", t) not in claimed)
    return _claimed(spend, state, ended, before, [("threshold", new, None)], now, dry_run) if new else []


def _detail(alert: Alert) -> dict[str, Any]:
    return {"subject": alert.subject, "text": alert.text, "payload": alert.payload, "targets": list(alert.targets)}


def _refusal_targets(budget: Budget, settings: AlertSettings) -> tuple[str, ...]:
    """Refusals break someone's traffic: the budget's recipients and the admins hear of them."""
    return tuple(dict.fromkeys([*budget.notify, *settings.admins]))


def _budget_alert(
    spend: SpendSource,
    status: BudgetStatus,
    key: dt.datetime,
    kind: str,
    thresholds: tuple[int, ...],
    targets: tuple[str, ...] | None = None,
) -> Alert:
    budget = status.budget
    models = spend.top_spenders(budget, status.start, status.end, "model")
    keys = spend.top_spenders(budget, status.start, status.end, "key")
    zone = ZoneInfo(budget.period.timezone)
    resets = (
        "never (total budget)"
        if budget.period.kind == "total"
        else (
            "continuously (rolling window)"
            if budget.period.kind == "rolling"
            else status.end.astimezone(zone).isoformat()
        )
    )
    money = usd
    runs_out = status.runs_out_at
    if runs_out is not None and budget.period.kind in CALENDAR_PERIODS and runs_out >= status.end:
        runs_out = None  # the period resets first: no instant to name (the dashboard says the same)
    runs_out_shown = (
        runs_out.astimezone(zone).isoformat()
        if runs_out is not None
        else ("not before the reset" if status.runs_out_at is not None else "n/a")
    )
    ended = budget.period.kind in CALENDAR_PERIODS and status.at >= status.end - dt.timedelta(microseconds=1)
    headline = {
        "threshold": f"crossed {', '.join(f'{t}%' for t in thresholds)}"
        + (f" before the reset at {resets}" if ended else ""),
        "forecast": f"projected to reach {money(status.forecast or 0)} by {resets}",
        "refusing": "requests are being refused",
    }[kind]
    exact = exact_usd  # spend and limits to the last digit; a forecast is an estimate, in cents
    subject = f"[tokenward] budget {_shown(budget.name)}: {status.percent}% of {exact(budget.limit_usd)} ({headline})"
    facts = [
        ("Budget", _shown(budget.name)),
        ("Scope", budget.describe_scope()),
        ("Spent", f"{exact(status.spent)} ({status.percent}%)"),
        ("Limit", exact(budget.limit_usd)),
        ("Remaining", exact(status.remaining)),
        (
            "Period",
            f"{_period_kind(budget)} ({budget.period.timezone}), since {status.start.astimezone(zone).isoformat()}",
        ),
        ("Resets", resets),
        ("Forecast for the period", money(status.forecast) if status.forecast is not None else "n/a"),
        ("Limit reached at this rate", runs_out_shown),
        ("At the limit", "requests are refused (429)" if budget.blocking else "alerts only"),
    ]
    sections = [
        ("Top models", [(_shown(m), exact(c)) for m, c in models]),
        ("Top keys", [(_shown(k), exact(c)) for k, c in keys]),
    ]
    text = "\n".join([f"{subject}\n", *(f"{k}: {v}" for k, v in facts)])
    for heading, items in sections:
        if items:
            text += f"\n\n{heading}:\n" + "\n".join(f"  {name}: {cost}" for name, cost in items)
    payload = {
        "budget": budget.name,
        "kind": kind,
        "thresholds": list(thresholds),
        "spent_usd": _figure(status.spent),
        "limit_usd": _figure(budget.limit_usd),
        "percent": str(status.percent),
        "period": budget.period.kind,
        "timezone": budget.period.timezone,
        "period_start": status.start.isoformat(),
        "period_end": status.end.isoformat(),
        "forecast_usd": None if status.forecast is None else _figure(status.forecast),
        "runs_out_at": None if runs_out is None else runs_out.isoformat(),
    }
    return Alert(
        budget.name,
        key,
        kind,
        max(thresholds),
        subject,
        text,
        html_document(subject, facts, sections),
        budget.notify if targets is None else targets,
        payload,
        thresholds=thresholds,
    )


def _period_kind(budget: Budget) -> str:
    """``month``, ``week`` (from Monday), ``week from Sunday``: what a mail calls the budget's period."""
    period = budget.period
    if period.kind == "week" and period.week_start:
        return f"week from {calendar.day_name[period.week_start]}"
    return period.kind


def _velocity_alerts(
    rates: SpendSource, state: StateStore, budgets: Sequence[Budget], now: dt.datetime, dry_run: bool
) -> list[Alert]:
    """Claim a ``velocity`` alert once per episode of each budget's rule.

    Episode ``n`` of a budget is the claim ``(budget, epoch + n seconds, velocity, 0)``; when the
    rate is back under the rule, the claim ``(budget, epoch + n seconds, velocity_end, 0)`` closes
    it (recorded as sent, never mailed) and the next firing is episode ``n + 1``. Both claims are
    atomic in the state store, so whichever process or restart evaluates, each episode alerts
    exactly once and re-arms exactly once.
    """
    ruled = [b for b in budgets if b.velocity is not None]
    if not ruled:
        return []
    closed: dict[str, int] = {}
    for claim in state.claims(kind="velocity_end"):
        closed[claim.key.budget] = closed.get(claim.key.budget, 0) + 1
    alerts = []
    for budget in ruled:
        status = velocity_of(rates, budget, now)
        episode = _EPOCH + dt.timedelta(seconds=closed.get(budget.name, 0))
        claimed = state.claimed(budget.name, episode)
        if status.firing and ("velocity", 0) not in claimed:
            alert = _velocity_alert(budget, status, episode, now)
            if dry_run or state.claim(_keys(budget.name, episode, "velocity", (0,)), _detail(alert), now):
                alerts.append(alert)
        elif not status.firing and ("velocity", 0) in claimed and not dry_run:
            ended = _keys(budget.name, episode, "velocity_end", (0,))
            for key in state.claim(ended, {"text": f"back to {status.describe()}"}, now):
                state.set_status(key, "sent")
    return alerts


def _velocity_alert(budget: Budget, status: VelocityStatus, episode: dt.datetime, now: dt.datetime) -> Alert:
    rule = status.rule
    window_start, _ = velocity_windows(rule, now)
    subject = f"[tokenward] budget {_shown(budget.name)}: spending {status.describe()}"
    facts = [
        ("Budget", _shown(budget.name)),
        ("Scope", budget.describe_scope()),
        ("Rate", f"{usd(status.rate)}/h ({usd(status.recent_usd)} since {window_start.isoformat()})"),
        ("Baseline", f"{usd(status.baseline_rate)}/h over the {rule.baseline_hours.normalize():f} h before"),
        ("Rule: at most", f"{usd(rule.max_usd_per_hour)}/h" if rule.max_usd_per_hour is not None else "n/a"),
        (
            "Rule: at most the baseline times",
            f"{rule.baseline_factor.normalize():f} (from {usd(rule.min_usd_per_hour)}/h)"
            if rule.baseline_factor is not None
            else "n/a",
        ),
        ("At the limit", "requests are refused (429)" if budget.blocking else "alerts only"),
        ("Next alert", "once the rate has been back under the rule"),
    ]
    text = "\n".join([f"{subject}\n", *(f"{k}: {v}" for k, v in facts)])
    payload = {
        "budget": budget.name,
        "kind": "velocity",
        "rate_usd_per_hour": str(status.rate),
        "baseline_usd_per_hour": str(status.baseline_rate),
        "window_minutes": rule.window_minutes,
        "window_spend_usd": str(status.recent_usd),
        "window_start": window_start.isoformat(),
        "at": now.isoformat(),
    }
    return Alert(
        budget.name, episode, "velocity", 0, subject, text, html_document(subject, facts, []), budget.notify, payload
    )


_WITHOUT_PRICE = {
    # price status -> (alert kind, claim name prefix, what the subject says, what to do)
    "unpriced": (
        "unpriced_model",
        "unpriced",
        "no price for model",
        "add a price (pricing.files), then run `tokenward pricing reprice`",
    ),
    "usage_invalid": (
        "usage_invalid",
        "invalid",
        "invalid usage reported for model",
        "the upstream reported counts no rule can repair (raw usage kept in the row's raw_usage); "
        "check the upstream, then price the rows by hand or ask the provider",
    ),
}


def _unpriced_alerts(
    spend: SpendSource, state: StateStore, settings: AlertSettings, now: dt.datetime, dry_run: bool
) -> list[Alert]:
    """Admins hear once of each model whose rows carry no cost: no price, or usage that made no sense."""
    alerts = []
    for status, (kind, prefix, says, remedy) in _WITHOUT_PRICE.items():
        claimed = {claim.key.budget for claim in state.claims(kind=kind)}
        for provider, model, first, count, request_id in spend.unpriced_models(status):
            name = f"{prefix}:{provider}/{model}"
            if name in claimed:
                continue
            subject = (
                f"[tokenward] {says} {_shown(model)} ({_shown(provider)}): {count} request(s) recorded without a cost"
            )
            facts = [
                ("Model", _shown(model)),
                ("Provider", _shown(provider)),
                ("First seen", first.isoformat()),
                ("Requests so far", str(count)),
                ("Example request", str(request_id)),
                ("What to do", remedy),
            ]
            text = "\n".join([subject, "", *(f"{k}: {v}" for k, v in facts)])
            alert = Alert(
                name,
                _EPOCH,
                kind,
                0,
                subject,
                text,
                html_document(subject, facts, []),
                tuple(settings.admins),
                {"model": model, "provider": provider, "requests": count, "price_status": status},
            )
            if dry_run or state.claim(_keys(name, _EPOCH, kind, (0,)), _detail(alert), now):
                alerts.append(alert)
    return alerts


def _pending(
    state: StateStore, budgets: Sequence[Budget], settings: AlertSettings, exclude: set[tuple[Any, ...]]
) -> list[Alert]:
    """Claims not yet delivered everywhere: their stored message, sent again where it has not arrived."""
    by_name = {b.name: b for b in budgets}
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for claim in state.claims(status="pending"):
        key = claim.key
        if (key.budget, key.period_start, key.kind, key.threshold) in exclude:
            continue
        if key.kind in ("velocity_end", REARMED):  # an episode's end, a re-arm note: nothing to send
            state.set_status(key, "sent")
            continue
        groups.setdefault((key.budget, key.period_start, key.kind, claim.detail.get("subject")), []).append(claim)
    alerts = []
    for (budget, start, kind, _), claims in groups.items():
        info = claims[0].detail
        known = by_name.get(budget)
        if kind in ("unpriced_model", "usage_invalid", "delivery_failed"):
            to = tuple(settings.admins)
        elif known is None:
            to = ()  # the budget is no longer configured
        else:
            to = _refusal_targets(known, settings) if kind == "refusing" else known.notify
        done = set.intersection(*(set.union(*_settled(state, c.key)) for c in claims))
        to = tuple(t for t in to if t not in done)  # only where it has not arrived yet (nor been refused for good)
        if not to:
            for claim in claims:
                state.set_status(claim.key, "sent")
            continue
        thresholds = tuple(sorted(c.key.threshold for c in claims))
        subject, text = info.get("subject", f"[tokenward] {kind} alert for {budget}"), info.get("text", "")
        alerts.append(
            Alert(
                budget,
                start,
                kind,
                max(thresholds),
                subject,
                text,
                html_text(subject, text),
                to,
                info.get("payload", {}),
                thresholds=thresholds,
            )
        )
    return alerts


def record_deliveries(state: StateStore, alert: Alert, deliveries: list[Delivery], now: dt.datetime) -> Alert | None:
    """Set each of ``alert``'s claims ``sent`` (every target reached) or ``pending``, after sending.

    The deliveries themselves were stored as they happened (:func:`evaluate_and_notify`).

    Returns:
        A ``delivery_failed`` alert (without targets: the caller addresses it to the admins) the
        first time a delivery of ``alert`` fails, else ``None``.
    """
    keys = _keys(alert.budget, alert.period_start, alert.kind, alert.thresholds)
    errors = "; ".join(f"{d.channel} {d.target}: {d.error}" for d in deliveries if not d.ok) or None
    for key in keys:
        reached, refused = _settled(state, key)
        if all(t in reached for t in alert.targets):
            state.set_status(key, "sent", None)
        elif all(t in reached or t in refused for t in alert.targets):
            state.set_status(key, "failed", errors)  # what is left refused it for good: no more attempts
        else:
            state.set_status(key, "failed" if alert.kind == "delivery_failed" else "pending", errors)
    if errors is None or alert.kind == "delivery_failed":
        return None
    subject = f"[tokenward] alert delivery failing: {alert.subject}"
    text = f"{subject}\n\nThe alert could not be delivered: {errors}\nIt will be retried.\n\n{alert.text}"
    failed = Alert(
        alert.budget,
        alert.period_start,
        "delivery_failed",
        alert.threshold,
        subject,
        text,
        html_document(subject, [("Error", errors)], []),
        (),
        {"failed": alert.payload},
        thresholds=alert.thresholds,
    )
    keys = _keys(alert.budget, alert.period_start, "delivery_failed", alert.thresholds)
    if not state.claim(keys, _detail(failed), now):
        return None
    return failed


LEASE_MARGIN_S = 5.0
"""Seconds a delivery lease lasts beyond the most one target's delivery can take (to store its outcome)."""


async def deliver(state: StateStore, notifier: Notifier, alert: Alert) -> tuple[Alert, list[Delivery]] | None:
    """Send ``alert``, storing each target's outcome for each of its thresholds as soon as it is known.

    First its claims are leased (:meth:`StateStore.lease`), so that of several evaluators at once
    (replicas, ``tokenward budgets check``, a restart) one only delivers them; the lease lasts one
    target's longest delivery (:meth:`AlertSettings.target_bound_s`) plus :data:`LEASE_MARGIN_S`,
    and is renewed after each target. A process killed mid-delivery leaves the claims to whoever
    evaluates once the lease has run out: at least once, never twice at once; a delivery
    cancelled (a proxy stopping) gives its lease up at once.

    Returns:
        The alert as sent (the thresholds leased, the targets they had not reached) and its
        deliveries; ``None`` when another process holds the lease or nothing is left to send.
    """
    holder = uuid.uuid4().hex
    bound = notifier.settings.target_bound_s() + LEASE_MARGIN_S

    def lease(keys: list[AlertKey]) -> list[AlertKey]:
        return state.lease(keys, holder, bound)  # the store's clock: replicas' clocks may disagree

    def leased() -> tuple[list[AlertKey], set[str]]:
        won = lease(_keys(alert.budget, alert.period_start, alert.kind, alert.thresholds))
        reached = set.intersection(*(set.union(*_settled(state, k)) for k in won)) if won else set()
        return won, reached  # read under the lease: a holder before this one may have reached some targets

    keys, reached = await asyncio.to_thread(leased)
    targets = tuple(t for t in alert.targets if t not in reached)
    if not keys or not targets:
        return None
    thresholds = tuple(k.threshold for k in keys)
    alert = replace(alert, thresholds=thresholds, threshold=max(thresholds), targets=targets)

    async def stored(delivery: Delivery) -> None:
        moment = dt.datetime.now(dt.UTC)
        records = [
            DeliveryRecord(k, delivery.channel, delivery.target, delivery.ok, delivery.attempts, delivery.error, moment)
            for k in keys
        ]
        for record in records:  # what happened at the receiver is kept, however long the state store is away
            await _until_stored(lambda r=record: state.record_delivery(r), f"{delivery.target}'s delivery")
        try:
            await asyncio.to_thread(lease, keys)
        except _STORE_DOWN as exc:  # the lease runs out on its own; the outcome is recorded already
            log.warning("alert lease not renewed (%s)", exc)

    try:
        return alert, await notifier.send(alert, on_delivery=stored)
    except asyncio.CancelledError:
        # stopped mid-delivery (a proxy shutting down): the lease is given up, so that whoever
        # evaluates next (the restarted proxy) sends what is left at once, not once it has run out
        try:
            await asyncio.to_thread(state.lease, keys, holder, 0)
        except _STORE_DOWN as exc:
            log.warning("alert lease not given up (%s)", exc)
        raise


_STORE_DOWN = (LedgerError, sqlite3.OperationalError, OSError)
"""What a state store that is away for now raises (Postgres stopped or unreachable, SQLite locked)."""

STORE_RETRY_S = (0.2, 5.0)
"""First and longest wait (s) between attempts to record a delivery while the state store is away."""


async def _until_stored(write: Callable[[], None], what: str) -> None:
    """Run ``write`` in a worker thread until the state store takes it, waiting longer between attempts.

    A delivery that happened and is not recorded is sent again by the next holder of its lease: a
    mail the receiver already has (a Postgres outage as the mail server accepted it). So the
    record waits for the store, as long as this process lives; any error but the store being away
    is raised.
    """
    delay, longest = STORE_RETRY_S
    while True:
        try:
            await asyncio.to_thread(write)
            return
        except _STORE_DOWN as exc:
            log.warning("cannot record %s yet (%s); trying again in %.1f s", what, exc, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, longest)


async def evaluate_and_notify(
    spend: SpendSource,
    state: StateStore,
    budgets: Sequence[Budget],
    settings: AlertSettings,
    notifier: Notifier,
    now: dt.datetime,
    *,
    dry_run: bool = False,
    rates: SpendSource | None = None,
) -> list[tuple[Alert, list[Delivery]]]:
    """Claim the alerts due at ``now``, send them, record the deliveries; returns what was sent.

    Alerts are delivered side by side, and each alert's targets too, so a receiver that hangs
    (until its ``timeout_s``) delays nobody else's. A target not reached leaves its claims
    pending (retried, there only, at the next evaluation) and sends the admins a
    ``delivery_failed`` alert once. With ``dry_run`` nothing is claimed or sent. ``rates``: where
    velocity rules read spend rates (default ``spend``).
    """
    alerts: list[Alert] = await asyncio.to_thread(
        claim_alerts, spend, state, budgets, settings, now, dry_run=dry_run, rates=rates
    )
    if dry_run:
        return [(alert, []) for alert in alerts]
    # each alert on its own (its claims leased apart): a receiver that hangs until its timeout_s
    # delays no other alert's mail
    sends = (notify_one(state, notifier, settings, alert, now) for alert in alerts)
    return [item for group in await asyncio.gather(*sends) for item in group]


async def notify_one(
    state: StateStore, notifier: Notifier, settings: AlertSettings, due: Alert, now: dt.datetime
) -> list[tuple[Alert, list[Delivery]]]:
    """Deliver one claimed alert (:func:`deliver`), record it, and tell the admins once if it failed.

    Returns:
        The alert as sent and its deliveries, then the ``delivery_failed`` alert and its
        deliveries if one was sent; empty when another evaluator holds (or has delivered) it.
    """
    done = await deliver(state, notifier, due)
    if done is None:  # another evaluator is delivering it (or has)
        return []
    alert, deliveries = done
    failed = await asyncio.to_thread(record_deliveries, state, alert, deliveries, now)
    out = [(alert, deliveries)]
    if failed is not None and settings.admins:
        reported = await deliver(state, notifier, replace(failed, targets=tuple(settings.admins)))
        if reported is not None:
            await asyncio.to_thread(record_deliveries, state, *reported, now)
            out.append(reported)
    return out


def digest_alert(
    spend: SpendSource,
    state: StateStore,
    budgets: Sequence[Budget],
    to: Sequence[str],
    every: str,
    zone: str,
    now: dt.datetime,
) -> Alert | None:
    """The spend digest for the day (or week) before ``now``, claimed once; ``None`` if already claimed."""
    tz = ZoneInfo(zone)
    end = dt.datetime.combine(now.astimezone(tz).date(), dt.time(0), tz)
    start = end - dt.timedelta(days=7 if every == "weekly" else 1)
    if ("digest", 0) in state.claimed("digest", start):
        return None
    total, requests, tokens, unpriced = spend.totals(start, end)
    everything = Budget("all", Decimal(1))
    models = spend.top_spenders(everything, start, end, "model", 10)
    keys = spend.top_spenders(everything, start, end, "key", 10)
    money = usd
    subject = f"[tokenward] {every} spend {start.date().isoformat()}: {money(total)} over {requests} requests"
    facts = [
        ("Period", f"{start.isoformat()} to {end.isoformat()}"),
        ("Spent", money(total)),
        ("Requests", f"{requests:,}"),
        ("Tokens", f"{tokens:,}"),
        ("Unpriced rows", str(unpriced)),
    ]
    statuses = [status_of(spend, b, now) for b in budgets]
    sections = [
        ("Top models", [(_shown(m), money(c)) for m, c in models]),
        ("Top keys", [(_shown(k), money(c)) for k, c in keys]),
        (
            "Budgets",
            [
                (_shown(s.budget.name), f"{money(s.spent)} of {money(s.budget.limit_usd)} ({s.percent}%)")
                for s in statuses
            ],
        ),
    ]
    text = "\n".join([subject, "", *(f"{k}: {v}" for k, v in facts)])
    for heading, items in sections:
        if items:
            text += f"\n\n{heading}:\n" + "\n".join(f"  {name}: {value}" for name, value in items)
    alert = Alert("digest", start, "digest", 0, subject, text, html_document(subject, facts, sections), tuple(to), {})
    if not state.claim(_keys("digest", start, "digest", (0,)), _detail(alert), now):
        return None
    return alert
