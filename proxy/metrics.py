"""Prometheus metrics, served at ``GET /metrics``.

One :class:`Metrics` (with its own registry, so several apps in one process do not collide)
is created per app and updated by the recorder as each row is queued, on the event loop.
Costs here are floats for dashboards; the ledger keeps the exact decimals. Budget gauges and
the ledger's write age are read when scraped (from the budget guard and the recorder), so
they are never stale. No ``_created`` series: they double the output and no dashboard reads them.

Design note. Rows are counted in plain dicts (a tuple of label values -> a float, or a
histogram's bucket counts); ``prometheus_client`` is imported at the first scrape, which builds
its metric families from them and renders them in its exposition format. A serving proxy that is
never scraped does not import it (0.4 MB of RSS, ``bench/PROFILE.md`` section 15), and a row
costs dict additions instead of ``prometheus_client``'s locked ``inc()``/``observe()`` calls.
"""

from __future__ import annotations

import datetime as dt
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from tokenward.pricing.usage import TOKEN_FIELDS
from tokenward.reports.alerts import Alert, Delivery

if TYPE_CHECKING:
    from prometheus_client.core import Metric

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


_COUNTERS = (  # name, help, label names: in exposition order (the histograms come after the gauge)
    (
        "tokenward_requests",
        "Requests by endpoint, outcome and upstream (one per request row).",
        ("endpoint", "outcome", "upstream"),
    ),
    ("tokenward_tokens", "Tokens metered, by canonical kind and served model.", ("kind", "model")),
    ("tokenward_cost_usd", "Priced cost in USD by served model.", ("model",)),
    ("tokenward_unpriced_rows", "Rows with usage but no known price, by model.", ("model",)),
)
_LATENCY_HELP = (
    "Seconds from a request's arrival to the end of its reply, for requests the upstream answered "
    "(outcome ok or upstream_error)."
)
_TTFT_HELP = "Streamed requests: seconds from arrival to the first reply event sent to the client."
_UPSTREAM_ERRORS_HELP = (
    "Upstream failures by upstream and outcome: error replies (upstream_error), replies broken off "
    "(upstream_failed), no connection (upstream_unreachable), no reply in time (upstream_timeout); "
    "retried attempts included."
)


class _Histograms(dict[tuple[str, ...], list[float]]):
    """Label values -> ``[count in each bucket (not cumulative)..., count above the last, sum]``."""

    __slots__ = ("bounds",)

    def __init__(self, bounds: tuple[float, ...]) -> None:
        super().__init__()
        self.bounds = bounds

    def __missing__(self, values: tuple[str, ...]) -> list[float]:
        cells = self[values] = [0.0] * (len(self.bounds) + 2)
        return cells

    def observe(self, values: tuple[str, ...], amount: float) -> None:
        """Count ``amount`` in the first bucket whose upper bound it does not pass (Prometheus' ``le``)."""
        cells = self[values]
        cells[bisect_left(self.bounds, amount)] += 1
        cells[-1] += amount


class Metrics:
    """Counters, histograms and gauges about metered traffic, budgets, alerts and the ledger.

    Label values: ``endpoint`` (ledger endpoint name), ``outcome``, ``upstream``, ``model``
    (served, else requested), ``kind`` (token field), ``budget``, ``channel`` (email, webhook).
    Each counter is a :class:`collections.Counter` of label-value tuples.
    """

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, ...]] = Counter()
        self.tokens: Counter[tuple[str, ...]] = Counter()
        self.cost: Counter[tuple[str, ...]] = Counter()
        self.unpriced: Counter[tuple[str, ...]] = Counter()
        self.violations = 0
        self.latency = _Histograms(LATENCY_BUCKETS)
        self.ttft = _Histograms(TTFT_BUCKETS)
        self.upstream_errors: Counter[tuple[str, ...]] = Counter()
        self.alert_failures: Counter[tuple[str, ...]] = Counter()
        self._models: dict[str, str] = {}  # a row's model -> its label value (bounded: _model_label)

    def observe(self, row: dict[str, Any]) -> None:
        """Count one ledger row (called once per row as it is queued)."""
        model = row["served_model"] or row["requested_model"] or "(none)"
        model = self._models.get(model) or self._model_label(model)
        upstream = row["upstream"] or "(none)"
        outcome = row["outcome"]
        if row["row_kind"] == "request":
            self.requests[row["endpoint"], outcome, upstream] += 1
            if outcome in _ANSWERED and row["latency_ms"] is not None:
                self.latency.observe((row["endpoint"], upstream), row["latency_ms"] / 1000)
            if outcome == "ok" and row["stream"] and row["ttfb_ms"] is not None:
                self.ttft.observe((row["endpoint"], upstream), row["ttfb_ms"] / 1000)
        if outcome in _UPSTREAM_FAILURES and row["row_kind"] != "part":
            self.upstream_errors[upstream, outcome] += 1
        tokens = self.tokens
        for kind in TOKEN_FIELDS:
            value = row[kind]
            if value:
                tokens[kind, model] += value
        if row["cost_usd"] is not None and row["price_status"] == "priced":
            self.cost[(model,)] += float(row["cost_usd"])
        elif row["price_status"] == "unpriced":
            self.unpriced[(model,)] += 1
        if row["violations"]:
            self.violations += 1

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
        """The metrics in Prometheus' text exposition format (``prometheus_client`` imported on the first call).

        Args:
            guard: the budget guard (``BudgetGuard``); adds spend, limit, reserved and
                remaining gauges per budget, as of now.
            health: :meth:`Recorder.health <tokenward.proxy.recorder.Recorder.health>`'s dict;
                adds the ledger's write age, whether it is writable and the spool backlog.
        """
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(self, guard, health))
        return generate_latest(registry)


class _Families:
    """The metric families of one scrape: the counted rows, then the gauges read now."""

    def __init__(self, metrics: Metrics, guard: _Guard | None, health: Mapping[str, Any] | None) -> None:
        self.metrics, self.guard, self.health = metrics, guard, health

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.metrics
        for (name, text, labels), counts in zip(_COUNTERS, (m.requests, m.tokens, m.cost, m.unpriced), strict=True):
            yield _counter(CounterMetricFamily(name, text, labels=labels), counts)
        text = "Rows whose reported usage breaks an invariant (recorded as reported and flagged)."
        yield CounterMetricFamily("tokenward_usage_invariant_violations", text, value=m.violations)
        yield GaugeMetricFamily("tokenward_ledger_rows_queued", "Rows queued in memory for the ledger.", value=0)
        yield _histogram("tokenward_request_duration_seconds", _LATENCY_HELP, m.latency)
        yield _histogram("tokenward_time_to_first_token_seconds", _TTFT_HELP, m.ttft)
        family = CounterMetricFamily("tokenward_upstream_errors", _UPSTREAM_ERRORS_HELP, labels=["upstream", "outcome"])
        yield _counter(family, m.upstream_errors)
        text = "Alert deliveries that failed after their retries, by channel (email, webhook)."
        yield _counter(
            CounterMetricFamily("tokenward_alert_delivery_failures", text, labels=["channel"]), m.alert_failures
        )
        yield from _gauges_now(self.guard, self.health)


def _counter(family: Any, counts: Counter[tuple[str, ...]]) -> Any:
    for values, count in counts.items():
        family.add_metric(list(values), float(count))
    return family


def _histogram(name: str, text: str, histograms: _Histograms) -> Metric:
    from prometheus_client.core import HistogramMetricFamily
    from prometheus_client.utils import floatToGoString

    family = HistogramMetricFamily(name, text, labels=["endpoint", "upstream"])
    bounds = [floatToGoString(b) for b in histograms.bounds] + ["+Inf"]
    for values, cells in histograms.items():
        running, buckets = 0.0, []
        for bound, count in zip(bounds, cells[:-1], strict=True):
            running += count
            buckets.append((bound, running))
        family.add_metric(list(values), buckets, cells[-1])
    return family


def _gauges_now(guard: _Guard | None, health: Mapping[str, Any] | None) -> Iterator[Metric]:
    """Gauges computed when scraped: budgets from the guard, ledger health from the recorder."""
    from prometheus_client.core import GaugeMetricFamily

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
        counter: ``(channel,)`` -> count (:attr:`Metrics.alert_failures`), incremented once per failed
            :class:`~tokenward.reports.alerts.Delivery`.
    """

    def __init__(self, notifier: _Notifier, counter: Counter[tuple[str, ...]]) -> None:
        self.notifier = notifier
        self._counter = counter

    async def send(self, alert: Alert, on_delivery: Any = None) -> list[Delivery]:
        """Deliver ``alert`` with the wrapped notifier; count what failed."""
        deliveries = await self.notifier.send(alert, on_delivery=on_delivery)
        for delivery in deliveries:
            if not delivery.ok:
                self._counter[(delivery.channel,)] += 1
        return deliveries

    def __getattr__(self, name: str) -> Any:
        return getattr(self.notifier, name)
