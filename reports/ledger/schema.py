"""The shape of a ledger row, shared by every engine and by the write-ahead log.

A row is a dict keyed by :data:`ROW_COLUMNS`; it travels as one JSON line through the write-ahead
log (:mod:`tokenward.reports.ledger.wal`) and is inserted by the engine in bulk.
"""

from __future__ import annotations

__all__ = ["HELD_STATUSES", "ROW_COLUMNS", "SPEND_EXPRESSION"]

ROW_COLUMNS: dict[str, str] = {
    "request_id": "VARCHAR",
    "client_request_id": "VARCHAR",
    "started_at": "DOUBLE",
    "ended_at": "DOUBLE",
    "principal": "VARCHAR",
    "method": "VARCHAR",
    "path": "VARCHAR",
    "endpoint": "VARCHAR",
    "upstream": "VARCHAR",
    "provider": "VARCHAR",
    "requested_model": "VARCHAR",
    "served_model": "VARCHAR",
    "http_status": "INTEGER",
    "outcome": "VARCHAR",
    "stream": "BOOLEAN",
    "input_tokens": "BIGINT",
    "cached_input_tokens": "BIGINT",
    "cache_write_tokens": "BIGINT",
    "cache_write_1h_tokens": "BIGINT",
    "output_tokens": "BIGINT",
    "reasoning_tokens": "BIGINT",
    "audio_input_tokens": "BIGINT",
    "audio_output_tokens": "BIGINT",
    "image_input_tokens": "BIGINT",
    "web_search_requests": "BIGINT",
    "web_fetch_requests": "BIGINT",
    "file_search_calls": "BIGINT",
    "code_containers": "BIGINT",
    "image_generation_calls": "BIGINT",
    "output_images": "BIGINT",
    "input_audio_seconds": "BIGINT",
    "input_characters": "BIGINT",
    "image_variant": "VARCHAR",
    "usage_source": "VARCHAR",
    "cost_usd": "DECIMAL(38,12)",
    "price_status": "VARCHAR",
    "price_entry_id": "VARCHAR",
    "price_resolved_by": "VARCHAR",
    "cost_lines": "JSON",
    "output_cost_usd": "DECIMAL(38,12)",
    "cache_savings_usd": "DECIMAL(38,12)",
    "provider_cost_usd": "DECIMAL(38,12)",
    "service_tier": "VARCHAR",
    "latency_ms": "DOUBLE",
    "ttfb_ms": "DOUBLE",
    "error": "VARCHAR",
    "violations": "VARCHAR",
    "raw_usage": "JSON",
    "row_kind": "VARCHAR",
    "parent_request_id": "VARCHAR",
    "key_id": "VARCHAR",
    "team": "VARCHAR",
    "project": "VARCHAR",
    "end_user": "VARCHAR",
    "tags": "VARCHAR[]",
    "session_id": "VARCHAR",
    "reserved_usd": "DECIMAL(38,12)",
    "org": "VARCHAR",
    "pool": "VARCHAR",
    "run_id": "VARCHAR",
    "sent_model": "VARCHAR",
    "degraded": "VARCHAR",
}
"""A spooled row's keys and their types as read from JSON. ``started_at``/``ended_at`` are UTC
epoch seconds (converted to ``TIMESTAMPTZ`` on insert); costs are decimal strings (exact).
``reserved_usd`` is what a blocking budget held for the request (the worst case); a row without
a cost that the provider may have billed (``usage_unknown``, ``unpriced``, ``usage_invalid``) keeps
counting it as spend until reconciled. ``org``/``pool`` come from the key, ``run_id`` from
``X-Tokenward-Run``; ``sent_model`` and ``degraded`` record what a budget changed."""

HELD_STATUSES: tuple[str, ...] = ("usage_unknown", "unpriced", "usage_invalid", "deferred")
"""Price statuses of rows with no cost that the provider may have billed: they count what their
budget reservation held (``deferred``: a background response, billed when it finishes)."""

SPEND_EXPRESSION = (
    "coalesce(cost_usd, CASE WHEN price_status IN ("
    + ", ".join(f"'{status}'" for status in HELD_STATUSES)
    + ") THEN reserved_usd END)"
)
"""What a row counts against a budget (SQL, every engine): its cost, or for a request the provider
may have billed with no cost known (:data:`HELD_STATUSES`: no reply or usage came back, no price,
counts that cannot be trusted) the worst case its reservation held."""
