"""The access log: one line per request, and a warning for every upstream failure and refusal.

:func:`record` is called by the recorder once per finished exchange, with the exchange's
ledger rows, as they are queued: the row already holds every figure the line shows (status,
model, tokens, cost, latency), so nothing is computed twice. Two loggers:

* ``tokenward.access`` (INFO): one line per request, in logfmt after a short human head::

      POST /v1/chat/completions 200 ok upstream=openai model=gpt-4o-2024-08-06 tokens_in=8
      tokens_out=10 cost_usd=0.00012 latency_ms=41.2 key=fp-1a2b3c4d5e6f request_id=9f...

  (one line; wrapped here). Silence it with ``tokenward serve --no-access-log`` (or
  ``server.access_log: false``); warnings stay on.
* ``tokenward.requests`` (WARNING): the upstream was unreachable (502) or timed out (504), broke
  off before its reply began, answered 5xx or 429, or reported an error inside a 2xx reply; an
  upstream attempt that may have been billed failed and is retried; a request succeeded only
  after retries (the failures it met); tokenward refused the request (a blocking budget, a
  model without a price, a missing or unknown key) or failed itself (an upstream without its
  key, a bug: the traceback is logged where it happened). An upstream that breaks off mid-reply is
  already warned about by the relay, so it is not warned about twice.

Client-controlled values (path, model, key name) are quoted and escaped when they hold anything
but plain characters, so a request cannot forge log lines, and cut at 200 characters.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

__all__ = ["ACCESS_LOGGER", "EVENTS_LOGGER", "format_line", "record"]

ACCESS_LOGGER = "tokenward.access"
EVENTS_LOGGER = "tokenward.requests"

_access = logging.getLogger(ACCESS_LOGGER)
_events = logging.getLogger(EVENTS_LOGGER)
_PLAIN = re.compile(r"[A-Za-z0-9._:/@+\-=,]+")
_MAX = 200
_UNANSWERED = {"upstream_unreachable": "unreachable", "upstream_timeout": "timed out"}
_REFUSED = {"rejected", "unauthorized"}


def record(rows: Sequence[Mapping[str, Any]]) -> None:
    """Log one finished exchange: its access line (request rows) and any warning it deserves.

    ``rows`` are the exchange's ledger rows (``reports.ledger.ROW_COLUMNS`` keys); the first is
    its own (``row_kind`` ``request`` or ``attempt``), the others its parts. Never raises: a
    logging problem must not cost the row.
    """
    try:
        row = rows[0]
        if row["row_kind"] == "attempt":
            _warn_attempt(row)
            return
        if _access.isEnabledFor(logging.INFO):
            _access.info("%s", format_line(row, parts=len(rows) - 1))
        _warn(row)
    except Exception:
        logging.getLogger("tokenward.recorder").exception("access log failed")


def format_line(row: Mapping[str, Any], *, parts: int = 0) -> str:
    """The access-log line for a request row (see the module docstring for its shape)."""
    fields = [
        _value(row["method"]),
        _value(row["path"]),
        str(row["http_status"] if row["http_status"] is not None else "-"),
        _value(row["outcome"]),
        f"upstream={_value(row['upstream'])}",
        f"model={_value(row['served_model'] or row['requested_model'])}",
        f"tokens_in={row['input_tokens']}",
        f"tokens_out={row['output_tokens']}",
        f"cost_usd={_money(row['cost_usd'])}",
    ]
    if row["price_status"] != "priced":
        fields.append(f"price={row['price_status']}")
    if row["stream"]:
        fields.append("stream=true")
    fields.append(f"latency_ms={_ms(row['latency_ms'])}")
    if row["stream"] and row["ttfb_ms"] is not None:
        fields.append(f"ttfb_ms={_ms(row['ttfb_ms'])}")
    if parts:
        fields.append(f"parts={parts}")
    fields += [f"key={_value(row['principal'])}", f"request_id={row['request_id']}"]
    return " ".join(fields)


def _warn(row: Mapping[str, Any]) -> None:
    outcome, status, upstream = row["outcome"], row["http_status"], _value(row["upstream"])
    request = row["request_id"]
    if outcome in _UNANSWERED:
        _events.warning(
            "request %s: upstream %s %s (%s): %s", request, upstream, _UNANSWERED[outcome], status, _text(row)
        )
    elif outcome == "upstream_failed" and status is not None and status >= 500:  # before the reply began
        _events.warning(
            "request %s: upstream %s failed before replying (%s): %s", request, upstream, status, _text(row)
        )
    elif outcome == "upstream_error" and status is not None and (status >= 500 or status == 429):
        _events.warning("request %s: upstream %s answered %s", request, upstream, status)
    elif outcome == "upstream_error" and status is not None and status < 400:
        _events.warning("request %s: upstream %s reported an error in its reply: %s", request, upstream, _text(row))
    elif outcome == "ok" and row["error"]:  # the only note an ok row carries: the retries it needed
        _events.warning("request %s: upstream %s %s", request, upstream, _text(row))
    elif outcome == "proxy_error":
        _events.warning("request %s failed in tokenward (%s): %s", request, status, _text(row))
    elif outcome in _REFUSED:
        _events.warning(
            "request %s refused (%s, key %s, model %s): %s",
            request,
            status,
            _value(row["principal"]),
            _value(row["requested_model"]),
            _text(row),
        )


def _warn_attempt(row: Mapping[str, Any]) -> None:
    _events.warning(
        "request %s: upstream %s attempt %s failed (%s): %s; retrying",
        row["parent_request_id"],
        _value(row["upstream"]),
        str(row["request_id"]).rpartition("-a")[2],
        row["http_status"],
        _text(row),
    )


def _value(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    if len(text) > _MAX:
        text = text[:_MAX] + "..."
    return text if _PLAIN.fullmatch(text) else json.dumps(text)


def _text(row: Mapping[str, Any]) -> str:
    """The row's error message, on one line."""
    error = row["error"] or "no detail"
    return json.dumps(error)[1:-1] if not error.isprintable() else error


def _money(cost: Decimal | None) -> str:
    if cost is None:
        return "-"
    return format(cost.normalize(), "f") if cost else "0"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
