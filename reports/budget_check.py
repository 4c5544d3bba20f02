"""Budget evaluation against the ledger, and the alerts it owes (each claimed exactly once).

:func:`claim_alerts` computes every budget's spend in its current period from the ledger (the
single source of truth, field case B35), compares it with the thresholds and the forecast, and
claims each alert by inserting a row keyed by (budget, period start, kind, threshold) into
``budget_alerts``. An alert already claimed is never claimed again, whatever process or restart
evaluates next (B37); claims still ``pending`` (sending failed, or the process stopped before
sending) are returned again until sent. :func:`record_deliveries` stores what sending did.
Several thresholds crossed at once make one message naming all of them.

Callers: the proxy's scheduled job and ``tokenward budgets check``; both send the alerts in
between, with :class:`tokenward.reports.alerts.Notifier`.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import duckdb

from tokenward.pricing.budgets import Budget, BudgetStatus, evaluate
from tokenward.reports.alerts import Alert, AlertSettings, Delivery, Notifier, html_document, html_text
from tokenward.reports.queries import bare_models, model_condition

__all__ = [
    "Session",
    "claim_alerts",
    "digest_alert",
    "evaluate_and_notify",
    "load_spend",
    "record_deliveries",
    "scope_clause",
    "spend_in",
    "status_of",
    "top_spenders",
    "usd",
]

_COLUMNS = {"key": "principal", "team": "team", "project": "project", "end_user": "end_user", "upstream": "upstream"}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def usd(amount: Decimal) -> str:
    """Dollars for people: cents from $1 up, else the significant digits (at most 6 places)."""
    if abs(amount) >= 1 or amount == 0:
        return f"${amount:,.2f}"
    small = amount.quantize(Decimal("0.000001")).normalize()
    return f"${small:.2f}" if -small.as_tuple().exponent <= 2 else f"${small:f}"


def scope_clause(budget: Budget) -> tuple[str, list[Any]]:
    """SQL condition (and its parameters) selecting the ledger rows in ``budget``'s scope."""
    clauses: list[str] = []
    params: list[Any] = []
    for dimension, value in budget.scope:
        if dimension == "model":  # as pricing.budgets.same_model: the name or its dated snapshots
            clauses.append(model_condition("?", "?"))
            params += [[value], bare_models([value])]
        elif dimension == "tag":
            clauses.append("list_contains(tags, ?)")
            params.append(value)
        else:
            clauses.append(f"{_COLUMNS[dimension]} = ?")
            params.append(value)
    return (" AND ".join(clauses) or "TRUE"), params


def spend_in(conn: duckdb.DuckDBPyConnection, budget: Budget, start: dt.datetime, end: dt.datetime) -> Decimal:
    """USD spent in ``budget``'s scope by requests that started in ``[start, end)`` (priced rows)."""
    where, params = scope_clause(budget)
    row = conn.execute(
        f"SELECT coalesce(sum(cost_usd), 0) FROM requests WHERE started_at >= ? AND started_at < ? AND {where}",
        [start, end, *params],
    ).fetchone()
    return Decimal(row[0]) if row else Decimal(0)


def load_spend(
    conn: duckdb.DuckDBPyConnection, budgets: Sequence[Budget], now: dt.datetime
) -> tuple[dict[str, Decimal], dict[str, list[tuple[dt.datetime, Decimal]]]]:
    """Each budget's spend in its current period (and, for rolling budgets, the rows' costs by start)."""
    spent: dict[str, Decimal] = {}
    events: dict[str, list[tuple[dt.datetime, Decimal]]] = {}
    for budget in budgets:
        start, end = budget.period.window(now)
        if budget.period.kind == "rolling":
            where, params = scope_clause(budget)
            rows = conn.execute(
                f"SELECT started_at, cost_usd FROM requests WHERE started_at >= ? AND cost_usd IS NOT NULL "
                f"AND cost_usd <> 0 AND {where}",
                [start, *params],
            ).fetchall()
            events[budget.name] = [(r[0], Decimal(r[1])) for r in rows]
        else:
            spent[budget.name] = spend_in(conn, budget, start, end)
    return spent, events


def status_of(conn: duckdb.DuckDBPyConnection, budget: Budget, now: dt.datetime) -> BudgetStatus:
    """Where ``budget`` stood at ``now`` according to the ledger (requests started before ``now``)."""
    start, end = budget.period.window(now)
    return evaluate(budget, spend_in(conn, budget, start, min(end, now + dt.timedelta(microseconds=1))), now)


def top_spenders(
    conn: duckdb.DuckDBPyConnection, budget: Budget, start: dt.datetime, end: dt.datetime, column: str, limit: int = 5
) -> list[tuple[str, Decimal]]:
    """The ``limit`` largest ``column`` values (model or key) by cost in ``budget``'s scope and window."""
    expression = {"model": "coalesce(served_model, requested_model)", "key": "principal"}[column]
    where, params = scope_clause(budget)
    rows = conn.execute(
        f"SELECT {expression}, sum(cost_usd) FROM requests WHERE started_at >= ? AND started_at < ? AND {where} "
        "AND cost_usd IS NOT NULL GROUP BY 1 ORDER BY 2 DESC LIMIT ?",
        [start, end, *params, limit],
    ).fetchall()
    return [(str(name), Decimal(cost)) for name, cost in rows if cost]


@dataclass(frozen=True, slots=True)
class _Claim:
    budget: str
    period_start: dt.datetime
    kind: str
    thresholds: tuple[int, ...]
    detail: dict[str, Any]


def claim_alerts(
    conn: duckdb.DuckDBPyConnection,
    budgets: Sequence[Budget],
    settings: AlertSettings,
    now: dt.datetime,
    *,
    dry_run: bool = False,
) -> list[Alert]:
    """Evaluate every budget and claim the alerts now due; return those to send.

    Kinds: ``threshold`` (one message for the thresholds newly crossed), ``forecast`` (spend is
    projected past the limit before the period ends), ``refusing`` (a blocking budget refused
    requests this period), and, for ``settings.admins``, ``unpriced_model`` (the first request
    for a model with no price). With ``dry_run`` nothing is claimed.

    A rolling window never ends, so its alerts are claimed once and re-armed instead: a
    threshold alerts again after spend has fallen back below it, ``refusing`` after a window
    with no refusal.
    """
    alerts = []
    for budget in budgets:
        status = status_of(conn, budget, now)
        key = _EPOCH if budget.period.kind == "rolling" else status.start
        refused = budget.blocking and _refusals(conn, budget, status.start)
        if budget.period.kind == "rolling" and not dry_run:
            _rearm(conn, budget, status.crossed, bool(refused))
        claimed = _claimed(conn, budget.name, key)
        new = tuple(t for t in status.crossed if ("threshold", t) not in claimed)
        if new:
            alerts.append(_budget_alert(conn, status, key, "threshold", new, dry_run))
        if status.forecast_exceeds and status.spent < budget.limit_usd and ("forecast", 0) not in claimed:
            alerts.append(_budget_alert(conn, status, key, "forecast", (0,), dry_run))
        if refused and ("refusing", 0) not in claimed:
            targets = _refusal_targets(budget, settings)
            alerts.append(_budget_alert(conn, status, key, "refusing", (0,), dry_run, targets))
    if settings.admins:
        alerts += _unpriced_alerts(conn, settings, now, dry_run)
    if not dry_run:
        alerts += _pending(conn, budgets, settings, exclude={(a.budget, a.period_start, a.kind) for a in alerts})
    return [a for a in alerts if a.targets]


def _rearm(conn: duckdb.DuckDBPyConnection, budget: Budget, crossed: tuple[int, ...], refused: bool) -> None:
    """Forget a rolling budget's sent alerts that no longer hold, so that they can fire again."""
    conn.execute(
        "DELETE FROM budget_alerts WHERE budget = ? AND period_start = ? AND status <> 'pending' AND "
        "((kind = 'threshold' AND NOT list_contains(?, threshold)) OR (kind = 'refusing' AND NOT ?))",
        [budget.name, _EPOCH, list(crossed), refused],
    )


def _claimed(conn: duckdb.DuckDBPyConnection, budget: str, start: dt.datetime) -> set[tuple[str, int]]:
    rows = conn.execute(
        "SELECT kind, threshold FROM budget_alerts WHERE budget = ? AND period_start = ?", [budget, start]
    ).fetchall()
    return {(kind, threshold) for kind, threshold in rows}


def _claim(conn: duckdb.DuckDBPyConnection, claim: _Claim, now: dt.datetime) -> bool:
    """Insert the claim rows; false if any of them existed already (someone else owns the alert)."""
    conn.execute("BEGIN TRANSACTION")
    try:
        for threshold in claim.thresholds:
            conn.execute(
                "INSERT INTO budget_alerts (budget, period_start, kind, threshold, created_at, status, detail) "
                "VALUES (?, ?, ?, ?, ?, 'pending', ?)",
                [claim.budget, claim.period_start, claim.kind, threshold, now, json.dumps(claim.detail, default=str)],
            )
        conn.execute("COMMIT")
        return True
    except duckdb.ConstraintException:
        conn.execute("ROLLBACK")
        return False


def _refusals(conn: duckdb.DuckDBPyConnection, budget: Budget, start: dt.datetime) -> int:
    row = conn.execute(
        "SELECT count(*) FROM requests WHERE outcome = 'rejected' AND started_at >= ? AND starts_with(error, ?)",
        [start, f"Budget {budget.name!r} "],  # the refusal's message (proxy/guard.py BudgetRefusal)
    ).fetchone()
    return int(row[0]) if row else 0


def _refusal_targets(budget: Budget, settings: AlertSettings) -> tuple[str, ...]:
    """Refusals break someone's traffic: the budget's recipients and the admins hear of them."""
    return tuple(dict.fromkeys([*budget.notify, *settings.admins]))


def _budget_alert(
    conn: duckdb.DuckDBPyConnection,
    status: BudgetStatus,
    key: dt.datetime,
    kind: str,
    thresholds: tuple[int, ...],
    dry_run: bool,
    targets: tuple[str, ...] | None = None,
) -> Alert:
    budget = status.budget
    models = top_spenders(conn, budget, status.start, status.end, "model")
    keys = top_spenders(conn, budget, status.start, status.end, "key")
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
    headline = {
        "threshold": f"crossed {', '.join(f'{t}%' for t in thresholds)}",
        "forecast": f"projected to reach {money(status.forecast or 0)} by {resets}",
        "refusing": "requests are being refused",
    }[kind]
    subject = f"[tokenward] budget {budget.name}: {status.percent}% of {money(budget.limit_usd)} ({headline})"
    facts = [
        ("Budget", budget.name),
        ("Scope", budget.describe_scope()),
        ("Spent", f"{money(status.spent)} ({status.percent}%)"),
        ("Limit", money(budget.limit_usd)),
        ("Remaining", money(status.remaining)),
        (
            "Period",
            f"{budget.period.kind} ({budget.period.timezone}), since {status.start.astimezone(zone).isoformat()}",
        ),
        ("Resets", resets),
        ("Forecast for the period", money(status.forecast) if status.forecast is not None else "n/a"),
        ("At the limit", "requests are refused (429)" if budget.blocking else "alerts only"),
    ]
    sections = [("Top models", [(m, money(c)) for m, c in models]), ("Top keys", [(k, money(c)) for k, c in keys])]
    text = "\n".join([f"{subject}\n", *(f"{k}: {v}" for k, v in facts)])
    for heading, items in sections:
        if items:
            text += f"\n\n{heading}:\n" + "\n".join(f"  {name}: {cost}" for name, cost in items)
    payload = {
        "budget": budget.name,
        "kind": kind,
        "thresholds": list(thresholds),
        "spent_usd": str(status.spent),
        "limit_usd": str(budget.limit_usd),
        "percent": str(status.percent),
        "period_start": status.start.isoformat(),
        "period_end": status.end.isoformat(),
        "forecast_usd": None if status.forecast is None else str(status.forecast),
    }
    alert = Alert(
        budget.name,
        key,
        kind,
        max(thresholds),
        subject,
        text,
        html_document(subject, facts, sections),
        budget.notify if targets is None else targets,
        payload,
    )
    claim = _Claim(budget.name, key, kind, thresholds, {"subject": subject, "text": text, "payload": payload})
    if not dry_run and not _claim(conn, claim, dt.datetime.now(dt.UTC)):
        return Alert(budget.name, key, kind, max(thresholds), subject, text, alert.html, ())  # lost the race
    return alert


def _unpriced_alerts(
    conn: duckdb.DuckDBPyConnection, settings: AlertSettings, now: dt.datetime, dry_run: bool
) -> list[Alert]:
    rows = conn.execute(
        "SELECT provider, coalesce(served_model, requested_model) AS model, min(started_at), count(*), "
        "min(request_id) FROM requests WHERE price_status = 'unpriced' GROUP BY 1, 2 ORDER BY 3"
    ).fetchall()
    claimed = {b for (b,) in conn.execute("SELECT budget FROM budget_alerts WHERE kind = 'unpriced_model'").fetchall()}
    alerts = []
    for provider, model, first, count, request_id in rows:
        name = f"unpriced:{provider}/{model}"
        if name in claimed:
            continue
        subject = f"[tokenward] no price for model {model} ({provider}): {count} request(s) recorded without a cost"
        facts = [
            ("Model", str(model)),
            ("Provider", str(provider)),
            ("First seen", first.isoformat()),
            ("Requests so far", str(count)),
            ("Example request", str(request_id)),
            ("What to do", "add a price (pricing.files), then run `tokenward pricing reprice`"),
        ]
        text = "\n".join([subject, "", *(f"{k}: {v}" for k, v in facts)])
        claim = _Claim(name, _EPOCH, "unpriced_model", (0,), {"subject": subject, "text": text})
        if dry_run or _claim(conn, claim, now):
            alerts.append(
                Alert(
                    name,
                    _EPOCH,
                    "unpriced_model",
                    0,
                    subject,
                    text,
                    html_document(subject, facts, []),
                    tuple(settings.admins),
                    {"model": model, "provider": provider, "requests": count},
                )
            )
    return alerts


def _pending(
    conn: duckdb.DuckDBPyConnection, budgets: Sequence[Budget], settings: AlertSettings, exclude: set[Any]
) -> list[Alert]:
    """Claims not yet sent (a failed or interrupted delivery): their stored message, sent again."""
    by_name = {b.name: b for b in budgets}
    rows = conn.execute(
        "SELECT budget, period_start, kind, list(threshold ORDER BY threshold), any_value(detail) FROM budget_alerts "
        "WHERE status = 'pending' GROUP BY ALL"
    ).fetchall()
    alerts = []
    for budget, start, kind, thresholds, detail in rows:
        if (budget, start, kind) in exclude:
            continue
        info = json.loads(detail) if detail else {}
        known = by_name.get(budget)
        if kind in ("unpriced_model", "delivery_failed"):
            to = tuple(settings.admins)
        elif known is None:
            to = ()  # the budget is no longer configured
        else:
            to = _refusal_targets(known, settings) if kind == "refusing" else known.notify
        done = _delivered(conn, budget, start, kind)
        to = tuple(t for t in to if t not in done)  # only where it has not arrived yet
        if not to:
            conn.execute(
                "UPDATE budget_alerts SET status = 'sent' WHERE budget = ? AND period_start = ? AND kind = ?",
                [budget, start, kind],
            )
            continue
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
            )
        )
    return alerts


def _delivered(conn: duckdb.DuckDBPyConnection, budget: str, start: dt.datetime, kind: str) -> set[str]:
    """Targets an alert already reached (an email delivery names its addresses joined by commas)."""
    rows = conn.execute(
        "SELECT target FROM alert_deliveries WHERE budget = ? AND period_start = ? AND kind = ? AND ok",
        [budget, start, kind],
    ).fetchall()
    return {target for (joined,) in rows for target in joined.split(",")}


def record_deliveries(
    conn: duckdb.DuckDBPyConnection, alert: Alert, deliveries: list[Delivery], now: dt.datetime
) -> Alert | None:
    """Store how sending ``alert`` went.

    Returns a ``delivery_failed`` alert (without targets: the caller addresses it to the admins)
    the first time a delivery of ``alert`` fails, else ``None``.
    """
    ok = bool(deliveries) and all(d.ok for d in deliveries)
    for delivery in deliveries:
        conn.execute(
            "INSERT INTO alert_deliveries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                alert.budget,
                alert.period_start,
                alert.kind,
                alert.threshold,
                delivery.channel,
                delivery.target,
                now,
                delivery.ok,
                delivery.attempts,
                delivery.error,
            ],
        )
    errors = "; ".join(f"{d.channel} {d.target}: {d.error}" for d in deliveries if not d.ok) or None
    conn.execute(
        "UPDATE budget_alerts SET status = ?, attempts = attempts + 1, last_error = ? "
        "WHERE budget = ? AND period_start = ? AND kind = ?",
        [
            "sent" if ok else ("failed" if alert.kind == "delivery_failed" else "pending"),
            errors,
            alert.budget,
            alert.period_start,
            alert.kind,
        ],
    )
    if ok or alert.kind == "delivery_failed":
        return None
    subject = f"[tokenward] alert delivery failing: {alert.subject}"
    text = f"{subject}\n\nThe alert could not be delivered: {errors}\nIt will be retried.\n\n{alert.text}"
    claim = _Claim(
        alert.budget, alert.period_start, "delivery_failed", (alert.threshold,), {"subject": subject, "text": text}
    )
    if not _claim(conn, claim, now):
        return None
    return Alert(
        alert.budget,
        alert.period_start,
        "delivery_failed",
        alert.threshold,
        subject,
        text,
        html_document(subject, [("Error", errors or "")], []),
        (),
        {"failed": alert.payload},
    )


Session = Callable[[Callable[[duckdb.DuckDBPyConnection], Any]], Awaitable[Any]]
"""Runs a function on a read-write ledger connection and returns its result (off the event loop)."""


async def evaluate_and_notify(
    session: Session,
    budgets: Sequence[Budget],
    settings: AlertSettings,
    notifier: Notifier,
    now: dt.datetime,
    *,
    dry_run: bool = False,
) -> list[tuple[Alert, list[Delivery]]]:
    """Claim the alerts due at ``now``, send them, record the deliveries; returns what was sent.

    A failed delivery leaves its claim pending (retried at the next evaluation) and sends the
    admins a ``delivery_failed`` alert once. With ``dry_run`` nothing is claimed or sent.
    """
    alerts: list[Alert] = await session(lambda conn: claim_alerts(conn, budgets, settings, now, dry_run=dry_run))
    if dry_run:
        return [(alert, []) for alert in alerts]
    sent = []
    for alert in alerts:
        deliveries = await notifier.send(alert)
        failed = await session(lambda conn, a=alert, d=deliveries: record_deliveries(conn, a, d, now))
        sent.append((alert, deliveries))
        if failed is not None and settings.admins:
            failed = replace(failed, targets=tuple(settings.admins))
            more = await notifier.send(failed)
            await session(lambda conn, a=failed, d=more: record_deliveries(conn, a, d, now))
            sent.append((failed, more))
    return sent


def digest_alert(
    conn: duckdb.DuckDBPyConnection,
    budgets: Sequence[Budget],
    to: Sequence[str],
    every: str,
    zone: str,
    now: dt.datetime,
) -> Alert | None:
    """The spend digest for the day (or week) before ``now``, claimed once; ``None`` if already sent."""
    tz = ZoneInfo(zone)
    end = dt.datetime.combine(now.astimezone(tz).date(), dt.time(0), tz)
    start = end - dt.timedelta(days=7 if every == "weekly" else 1)
    rows = conn.execute(
        "SELECT coalesce(sum(cost_usd), 0), count(*) FILTER (WHERE row_kind = 'request'), "
        "coalesce(sum(input_tokens + output_tokens), 0), count(*) FILTER (WHERE price_status = 'unpriced') "
        "FROM requests WHERE started_at >= ? AND started_at < ?",
        [start, end],
    ).fetchone()
    assert rows is not None
    total, requests, tokens, unpriced = Decimal(rows[0]), rows[1], rows[2], rows[3]
    everything = Budget("all", Decimal(1))
    models = top_spenders(conn, everything, start, end, "model", 10)
    keys = top_spenders(conn, everything, start, end, "key", 10)
    money = usd
    subject = f"[tokenward] {every} spend {start.date().isoformat()}: {money(total)} over {requests} requests"
    facts = [
        ("Period", f"{start.isoformat()} to {end.isoformat()}"),
        ("Spent", money(total)),
        ("Requests", f"{requests:,}"),
        ("Tokens", f"{tokens:,}"),
        ("Unpriced rows", str(unpriced)),
    ]
    statuses = [status_of(conn, b, now) for b in budgets]
    sections = [
        ("Top models", [(m, money(c)) for m, c in models]),
        ("Top keys", [(k, money(c)) for k, c in keys]),
        (
            "Budgets",
            [(s.budget.name, f"{money(s.spent)} of {money(s.budget.limit_usd)} ({s.percent}%)") for s in statuses],
        ),
    ]
    text = "\n".join([subject, "", *(f"{k}: {v}" for k, v in facts)])
    for heading, items in sections:
        if items:
            text += f"\n\n{heading}:\n" + "\n".join(f"  {name}: {value}" for name, value in items)
    claim = _Claim("digest", start, "digest", (0,), {"subject": subject, "text": text})
    if not _claim(conn, claim, now):
        return None
    return Alert("digest", start, "digest", 0, subject, text, html_document(subject, facts, sections), tuple(to), {})
