"""Prometheus metrics, served at ``GET /metrics``.

One :class:`Metrics` (with its own registry, so several apps in one process do not collide)
is created per app and updated by the recorder as each row is queued, on the event loop.
Costs here are floats for dashboards; the ledger keeps the exact decimals. Budget gauges and
the ledger's write age are read when scraped (from the budget guard and the recorder), so
they are never stale. No ``_created`` series: they double the output and no dashboard reads
them (``prometheus_client.disable_created_metrics``, process-wide).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenward.pricing.usage import TOKEN_FIELDS
from tokenward.reports.alerts import Alert, Delivery

__all__ = [
    "LATENCY_BUCKETS",
    "MAX_MODEL_LABELS",
    "MAX_MODEL_LABEL_CHARS",
    "OTHER_MODEL",
    "PER_VALUE_SERIES",
    "TTFT_BUCKETS",
    "DeliveryCounter",
    "Metrics",
]

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Request duration buckets, seconds: LLM replies take from tens of milliseconds to minutes."""
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
"""Time-to-first-token buckets, seconds."""

MAX_MODEL_LABELS = 500
"""Distinct ``model`` label values kept; later models are counted as :data:`OTHER_MODEL`.

The model of a row the upstream never answered (a timeout, a client gone before the reply,
an estimate) is the one the client sent: any string. Without a cap a key holder could add a
series per request (one per token kind), growing memory and every scrape without end."""
MAX_MODEL_LABEL_CHARS = 128
"""A longer model name is cut to this many characters (and an ellipsis) in its label."""
OTHER_MODEL = "(other)"

PER_VALUE_SERIES = 20
"""Per-value budgets (``per: end_user``: ``chat-user[alice@example.com]``) exported per template: the ones
with the most spent and reserved, nearest their limit (they share it). A template may make 100,000, one
per value a client names: a series each would grow every scrape with the users. How many there are is
``tokenward_budget_instances{budget="<template>"}``; each label is cut to :data:`MAX_MODEL_LABEL_CHARS`."""

_ANSWERED = frozenset({"ok", "upstream_error"})
_UPSTREAM_FAILURES = frozenset({"upstream_error", "upstream_failed", "upstream_unreachable", "upstream_timeout"})


class _Guard(Protocol):
    def snapshot(self, now: dt.datetime, *, made: bool = False) -> list[dict[str, Any]]: ...


class _Notifier(Protocol):
    async def send(self, alert: Alert) -> list[Delivery]: ...


class Metrics:
    """Counters, histograms and gauges about metered traffic, budgets, alerts and the ledger.

    Label values: ``endpoint`` (ledger endpoint name), ``outcome``, ``upstream``, ``model``
    (served, else requested), ``kind`` (token field), ``budget``, ``channel`` (email, webhook).
    """

    def __init__(self) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokenward_requests",
            "Requests by endpoint, outcome and upstream (one per request row).",
            ["endpoint", "outcome", "upstream"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "tokenward_tokens",
            "Tokens metered, by canonical kind and served model.",
            ["kind", "model"],
            registry=self.registry,
        )
        self.cost = Counter(
            "tokenward_cost_usd", "Priced cost in USD by served model.", ["model"], registry=self.registry
        )
        self.unpriced = Counter(
            "tokenward_unpriced_rows",
            "Rows with usage but no known price, by model.",
            ["model"],
            registry=self.registry,
        )
        self.violations = Counter(
            "tokenward_usage_invariant_violations",
            "Rows whose reported usage breaks an invariant (recorded as reported and flagged).",
            registry=self.registry,
        )
        self.pending = Gauge(
            "tokenward_ledger_rows_queued", "Rows queued in memory for the ledger.", registry=self.registry
        )
        self.latency = Histogram(
            "tokenward_request_duration_seconds",
            "Seconds from a request's arrival to the end of its reply, for requests the upstream answered "
            "(outcome ok or upstream_error).",
            ["endpoint", "upstream"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tokenward_time_to_first_token_seconds",
            "Streamed requests: seconds from arrival to the first reply event sent to the client.",
            ["endpoint", "upstream"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "tokenward_upstream_errors",
            "Upstream failures by upstream and outcome: error replies (upstream_error), replies broken off "
            "(upstream_failed), no connection (upstream_unreachable), no reply in time (upstream_timeout); "
            "retried attempts included.",
            ["upstream", "outcome"],
            registry=self.registry,
        )
        self.alert_failures = Counter(
            "tokenward_alert_delivery_failures",
            "Alert deliveries that failed after their retries, by channel (email, webhook).",
            ["channel"],
            registry=self.registry,
        )
        # observe() runs once per row on the event loop: labels() validates its values and takes a
        # lock on every call (~1 us each, six or more per row); a dict lookup per child is a tenth of that
        self._requests = _Children(self.requests)
        self._tokens = _Children(self.tokens)
        self._cost = _Children(self.cost)
        self._latency = _Children(self.latency)
        self._ttft = _Children(self.ttft)
        self._upstream_errors = _Children(self.upstream_errors)
        self._models: dict[str, str] = {}  # a row's model -> its label value (bounded: _model_label)
        self._scraped = _ScrapeTime(self)
        self.registry.register(self._scraped)
        self._guard: _Guard | None = None
        self._health: Mapping[str, Any] | None = None

    def observe(self, row: dict[str, Any]) -> None:
        """Count one ledger row (called once per row as it is queued)."""
        model = row["served_model"] or row["requested_model"] or "(none)"
        model = self._models.get(model) or self._model_label(model)
        upstream = row["upstream"] or "(none)"
        outcome = row["outcome"]
        if row["row_kind"] == "request":
            self._requests[row["endpoint"], outcome, upstream].inc()
            if outcome in _ANSWERED and row["latency_ms"] is not None:
                self._latency[row["endpoint"], upstream].observe(row["latency_ms"] / 1000)
            if outcome == "ok" and row["stream"] and row["ttfb_ms"] is not None:
                self._ttft[row["endpoint"], upstream].observe(row["ttfb_ms"] / 1000)
        if outcome in _UPSTREAM_FAILURES and row["row_kind"] != "part":
            self._upstream_errors[upstream, outcome].inc()
        tokens = self._tokens
        for kind in TOKEN_FIELDS:
            value = row[kind]
            if value:
                tokens[kind, model].inc(value)
        if row["cost_usd"] is not None and row["price_status"] == "priced":
            self._cost[(model,)].inc(float(row["cost_usd"]))
        elif row["price_status"] == "unpriced":
            self.unpriced.labels(model).inc()
        if row["violations"]:
            self.violations.inc()

    def _model_label(self, model: str) -> str:
        """The label value for a model not seen before: itself, cut to length, or :data:`OTHER_MODEL` past the cap."""
        if len(self._models) >= MAX_MODEL_LABELS:
            return OTHER_MODEL
        label = model if len(model) <= MAX_MODEL_LABEL_CHARS else model[:MAX_MODEL_LABEL_CHARS] + "…"
        self._models[model] = label
        return label

    def counting(self, notifier: _Notifier) -> DeliveryCounter:
        """``notifier`` wrapped so that every failed delivery it reports is counted."""
        return DeliveryCounter(notifier, self.alert_failures)

    def render(self, *, guard: _Guard | None = None, health: Mapping[str, Any] | None = None) -> bytes:
        """The metrics in Prometheus' text exposition format.

        Args:
            guard: the budget guard (``BudgetGuard``); adds spend, limit, reserved and
                remaining gauges per budget, as of now.
            health: :meth:`Recorder.health <tokenward.proxy.recorder.Recorder.health>`'s dict;
                adds the ledger's write age, whether it is writable and the spool backlog.
        """
        self._guard, self._health = guard, health
        try:
            return generate_latest(self.registry)
        finally:
            self._guard = self._health = None


class _Children(dict[tuple[str, ...], Any]):
    """The labelled children of one metric by label values, each made once by ``labels()``."""

    __slots__ = ("metric",)

    def __init__(self, metric: Counter | Histogram) -> None:
        super().__init__()
        self.metric = metric

    def __missing__(self, values: tuple[str, ...]) -> Any:
        child = self[values] = self.metric.labels(*values)
        return child


class _ScrapeTime(Collector):
    """Gauges computed when scraped: budgets from the guard, ledger health from the recorder."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        guard, health = self.metrics._guard, self.metrics._health
        now = dt.datetime.now(dt.UTC)
        statuses = guard.snapshot(now) if guard is not None else []
        instances: dict[str, list[dict[str, Any]]] = {}
        for status in guard.snapshot(now, made=True) if guard is not None else []:
            group = status["group"]
            if group and status["budget"].startswith(group + "[") and status["budget"].endswith("]"):
                instances.setdefault(group, []).append(status)  # a per-value budget (not a run)
        if instances:
            counts = GaugeMetricFamily(
                "tokenward_budget_instances",
                "Per-value budgets a template (per: end_user, ...) has open on this proxy.",
                labels=["budget"],
            )
            seen = {s["budget"] for s in statuses}
            for group, found in sorted(instances.items()):
                counts.add_metric([group], len(found))
                found.sort(key=lambda s: (-(s["spent_usd"] + s["reserved_usd"]), s["budget"]))
                for status in found[:PER_VALUE_SERIES]:
                    label = status["budget"]
                    if len(label) > MAX_MODEL_LABEL_CHARS:
                        label = label[:MAX_MODEL_LABEL_CHARS] + "…"
                    if label not in seen:  # two long values cut alike: one series (Prometheus refuses two)
                        seen.add(label)
                        statuses.append({**status, "budget": label})
            yield counts
        if statuses:
            families = {
                name: GaugeMetricFamily(f"tokenward_budget_{name}_usd", text, labels=["budget"])
                for name, text in (
                    ("spend", "Spend counted against the budget in its current period, USD."),
                    ("limit", "The budget's limit, USD."),
                    ("reserved", "Worst-case cost held for requests in flight (blocking budgets), USD."),
                    ("remaining", "Limit minus spend and reservations, at least 0, USD."),
                )
            }
            for status in statuses:
                spent, limit, reserved = status["spent_usd"], status["limit_usd"], status["reserved_usd"]
                values = {
                    "spend": spent,
                    "limit": limit,
                    "reserved": reserved,
                    "remaining": max(limit - spent - reserved, 0),
                }
                for name, family in families.items():
                    family.add_metric([status["budget"]], float(values[name]))
            yield from families.values()
        if health is not None:
            yield GaugeMetricFamily(
                "tokenward_ledger_write_age_seconds",
                "Seconds since the ledger writer last wrote everything it had.",
                value=health["last_write_age_s"],
            )
            yield GaugeMetricFamily(
                "tokenward_ledger_writable",
                "1 while the ledger is being written, 0 when not.",
                value=health["writable"],
            )
            yield GaugeMetricFamily(
                "tokenward_spool_files", "Spool files waiting to go into the ledger.", value=health["spool_files"]
            )


class DeliveryCounter:
    """A notifier that counts the failed deliveries of the notifier it wraps.

    Args:
        notifier: anything with ``async send(alert) -> list[Delivery]`` (``reports.alerts.Notifier``).
        counter: incremented once per failed :class:`~tokenward.reports.alerts.Delivery`, by channel.
    """

    def __init__(self, notifier: _Notifier, counter: Counter) -> None:
        self.notifier = notifier
        self._counter = counter

    async def send(self, alert: Alert, on_delivery: Any = None) -> list[Delivery]:
        """Deliver ``alert`` with the wrapped notifier; count what failed."""
        deliveries = await self.notifier.send(alert, on_delivery=on_delivery)
        for delivery in deliveries:
            if not delivery.ok:
                self._counter.labels(delivery.channel).inc()
        return deliveries

    def __getattr__(self, name: str) -> Any:
        return getattr(self.notifier, name)
