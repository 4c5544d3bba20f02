"""Prometheus metrics, served at ``GET /metrics``.

One :class:`Metrics` (with its own registry, so several apps in one process do not collide)
is created per app and updated by the recorder as each row is queued, on the event loop.
Costs here are floats for dashboards; the ledger keeps the exact decimals.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tokenward.pricing.usage import TOKEN_FIELDS

__all__ = ["Metrics"]


class Metrics:
    """Counters about metered traffic (label values: endpoint, outcome, upstream, model)."""

    def __init__(self) -> None:
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

    def observe(self, row: dict[str, Any]) -> None:
        """Count one ledger row (called once per row as it is queued)."""
        model = row["served_model"] or row["requested_model"] or "(none)"
        if row["row_kind"] == "request":
            self.requests.labels(row["endpoint"], row["outcome"], row["upstream"] or "(none)").inc()
        for kind in TOKEN_FIELDS:
            value = row[kind]
            if value:
                self.tokens.labels(kind, model).inc(value)
        if row["cost_usd"] is not None and row["price_status"] == "priced":
            self.cost.labels(model).inc(float(row["cost_usd"]))
        elif row["price_status"] == "unpriced":
            self.unpriced.labels(model).inc()
        if row["violations"]:
            self.violations.inc()

    def render(self) -> bytes:
        """The metrics in Prometheus' text exposition format."""
        return generate_latest(self.registry)
