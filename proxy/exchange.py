"""One client request as it passes through tokenward, from arrival to its single ledger row.

An :class:`Exchange` is created as soon as a request reaches a ``/v1`` route and ends exactly
once, with one :class:`Outcome`; :meth:`Recorder.finish <tokenward.proxy.recorder.Recorder.finish>`
turns it into exactly one ledger row. Everything here is plain data (no I/O).
"""

from __future__ import annotations

import enum
import itertools
import os
import time
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from tokenward.pricing.usage import Usage

__all__ = ["Exchange", "Outcome"]

# Request ids: 32 hex digits as uuid4().hex gave, a random prefix per process and a counter. Not
# uuid4 nor os.urandom per request: the getrandom() call releases the GIL, so each request handed
# the GIL to whichever thread waited for it (the write-ahead log's writer) and waited to get it
# back (bench/PROFILE.md). 64 random bits per process keep ids of replicas and restarts apart.
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


class Outcome(enum.StrEnum):
    """How an exchange ended (the ledger's ``outcome`` column)."""

    OK = "ok"
    """The upstream answered 2xx and the whole reply reached the client."""
    UPSTREAM_ERROR = "upstream_error"
    """The upstream answered 4xx/5xx (relayed as is), or reported an error inside a 2xx reply."""
    UPSTREAM_FAILED = "upstream_failed"
    """The upstream connection broke after the reply had started."""
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    """No reply: the upstream refused or dropped the connection (502)."""
    UPSTREAM_TIMEOUT = "upstream_timeout"
    """No reply in time (504)."""
    CLIENT_ERROR = "client_error"
    """tokenward refused malformed input (400)."""
    UNAUTHORIZED = "unauthorized"
    """Missing or unknown virtual key (401)."""
    REJECTED = "rejected"
    """tokenward refused the request by policy before forwarding (an unpriced model, a budget)."""
    CLIENT_DISCONNECTED = "client_disconnected"
    """The client went away before the whole reply reached it."""
    PROXY_ERROR = "proxy_error"
    """tokenward itself failed (500); a bug."""
    INTERRUPTED = "interrupted"
    """tokenward stopped (a crash, a shutdown) while the request was in flight."""


@dataclass(slots=True)
class Exchange:
    """Mutable record of one request; times are UTC epoch seconds and ``perf_counter`` seconds.

    Fields left ``None`` are unknown at the time the exchange ended (no upstream chosen, no
    reply received, ...). ``usage`` stays ``None`` until metering or estimation fills it;
    ``usage_deferred`` marks a reply whose usage the provider reports later (a background
    Responses API request); ``maybe_billed`` one that may have reached the provider although no
    reply (or usage) came back; ``parts`` hold usage spent on other models inside the request.
    ``row_kind`` is ``request`` except for the record of an earlier upstream attempt of a
    retried request (``attempt``, linked by ``parent_request_id``). ``price_fallback`` lets the
    configured fallback rates price a model with no price (the upstream's ``unpriced: fallback``);
    ``price_as`` is the catalog model the upstream pins its prices to (its ``price_as``).
    ``reserved_usd`` is the worst case a blocking budget held for the request. ``org``/``pool``
    come from the key, ``run_id`` from ``X-Tokenward-Run``; ``sent_model`` is the model sent
    upstream when a budget rerouted the request, ``degraded`` what a budget changed; ``cost_usd``
    the request's cost once recorded (``None`` while unknown).
    """

    endpoint: str
    method: str
    path: str
    request_id: str = field(default_factory=lambda: f"{_ID_PREFIX}{next(_ID_COUNTER):016x}")
    client_request_id: str | None = None
    started_at: float = field(default_factory=time.time)
    started_perf: float = field(default_factory=time.perf_counter)
    principal: str = "anonymous"
    key_id: str | None = None
    team: str | None = None
    project: str | None = None
    end_user: str | None = None
    tags: tuple[str, ...] = ()
    session_id: str | None = None
    upstream: str | None = None
    provider: str | None = None
    requested_model: str | None = None
    served_model: str | None = None
    stream: bool = False
    http_status: int | None = None
    outcome: Outcome | None = None
    usage: Usage | None = None
    raw_usage: dict[str, Any] | None = None
    service_tier: str | None = None
    provider_cost: Decimal | None = None
    error: str | None = None
    usage_deferred: bool = False
    maybe_billed: bool = False
    price_fallback: bool = False
    price_as: str | None = None
    reservation: Any = None
    reserved_usd: Decimal | None = None
    parts: list[tuple[str, Usage]] = field(default_factory=list)
    org: str | None = None
    pool: str | None = None
    run_id: str | None = None
    sent_model: str | None = None
    fallback_models: tuple[str, ...] = ()
    """Models the request names as fallbacks (OpenRouter's ``models``): the upstream may serve any of them."""
    degraded: str | None = None
    unseen_tool: str | None = None
    """A tool billed per call the request offered whose use the reply does not show (Gemini grounding):
    the row is ``partially_priced`` with a note, never plain ``priced``."""
    cost_usd: Decimal | None = None
    row_kind: str = "request"
    parent_request_id: str | None = None
    first_byte_perf: float | None = None
    ended_perf: float | None = None
    recorded: bool = False

    def attempt(self, number: int) -> Exchange:
        """A record of this exchange's upstream attempt ``number`` (``row_kind`` ``attempt``)."""
        return Exchange(
            endpoint=self.endpoint,
            method=self.method,
            path=self.path,
            request_id=f"{self.request_id}-a{number}",
            started_at=self.started_at,
            started_perf=self.started_perf,
            principal=self.principal,
            key_id=self.key_id,
            team=self.team,
            project=self.project,
            org=self.org,
            pool=self.pool,
            run_id=self.run_id,
            sent_model=self.sent_model,
            degraded=self.degraded,
            end_user=self.end_user,
            tags=self.tags,
            session_id=self.session_id,
            upstream=self.upstream,
            provider=self.provider,
            requested_model=self.requested_model,
            stream=self.stream,
            price_as=self.price_as,
            row_kind="attempt",
            parent_request_id=self.request_id,
        )

    def mark_first_byte(self) -> None:
        """Note the moment the first reply byte was sent to the client (first call wins)."""
        if self.first_byte_perf is None:
            self.first_byte_perf = time.perf_counter()

    def end(self, outcome: Outcome, status: int | None = None, error: str | None = None) -> None:
        """Give the exchange its terminal outcome; later calls keep the first outcome."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        if status is not None:
            self.http_status = status
        if error is not None:
            self.error = error
        self.ended_perf = time.perf_counter()

    @property
    def latency_ms(self) -> float | None:
        """Milliseconds from arrival to the end of the exchange."""
        return None if self.ended_perf is None else (self.ended_perf - self.started_perf) * 1000.0

    @property
    def ttfb_ms(self) -> float | None:
        """Milliseconds from arrival to the first reply byte sent to the client."""
        return None if self.first_byte_perf is None else (self.first_byte_perf - self.started_perf) * 1000.0
