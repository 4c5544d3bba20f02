"""Pricing one metered usage against the catalog: the price status, the cost and its lines.

The one place that decides a row's ``price_status``; the proxy's recorder and
``tokenward pricing reprice`` both call :func:`quote`, so a repriced row is exactly what the
proxy would have written under the same catalog.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tokenward.pricing.catalog import PriceCatalog
from tokenward.pricing.cost import Cost, price
from tokenward.pricing.usage import Usage

__all__ = ["MAX_REQUEST_COST_USD", "PriceStatus", "Quote", "quote", "worst_case"]

MAX_REQUEST_COST_USD = Decimal(1_000_000)
"""No single request costs a million dollars (at $100 per 1M tokens that is 10^10 tokens, far past
every context window): a quote that reaches it comes from counts that cannot be true, and is
``usage_invalid``. The ledger stores a row's cost with six integer digits (``DECIMAL(18, 12)``)."""


class PriceStatus:
    """Values of the ledger's ``price_status`` column."""

    PRICED = "priced"
    """``cost_usd`` is the exact cost of the usage under the catalog entry ``price_entry_id``."""
    PARTIALLY_PRICED = "partially_priced"
    """Tokens are priced but something is not (a web search with no fee in the catalog, a served
    tier with no price): ``cost_usd`` is a lower bound; ``cost_lines`` say what is missing."""
    FALLBACK = "fallback"
    """No price is known for the model; ``cost_usd`` uses the configured fallback rates."""
    UNPRICED = "unpriced"
    """Usage was metered but no price is known for the model: ``cost_usd`` is NULL, never 0."""
    NOT_BILLED = "not_billed"
    """Nothing billable happened (refused by tokenward, never reached the provider, or an error
    reply without usage): cost 0."""
    NOT_METERED = "not_metered"
    """A transparently forwarded endpoint tokenward does not meter: ``cost_usd`` is NULL."""
    USAGE_UNKNOWN = "usage_unknown"
    """The request may have reached the provider (timeout, dropped connection) but no usage came
    back: the provider may bill it; ``cost_usd`` is NULL."""
    DEFERRED = "deferred"
    """The provider reports this request's usage later (background Responses): ``cost_usd`` is NULL."""
    REPAIRED = "repaired"
    """The counts as reported broke an invariant and were repaired by a documented dialect rule
    (``violations`` names it, ``raw_usage`` keeps what was reported): ``cost_usd`` is the exact cost
    of the repaired counts."""
    USAGE_INVALID = "usage_invalid"
    """A reported count could not be read (not an integer in ``[0, 2**53)``: negative, 10^19, 1e30,
    a string) or the counts break an invariant no rule repairs: ``cost_usd`` is NULL, the valid
    counts and ``raw_usage`` are kept, ``violations`` says what is wrong."""


@dataclass(frozen=True, slots=True)
class Quote:
    """The priced view of one usage: status, exact cost (``None`` when unpriced), entry, lines."""

    status: str
    cost_usd: Decimal | None
    entry_id: str | None
    resolved_by: str | None
    lines: list[dict[str, Any]] | None
    cost: Cost | None

    @property
    def output_cost_usd(self) -> Decimal | None:
        """USD of the output tokens (text, reasoning, audio), ``None`` when unpriced."""
        return self.cost.output_cost if self.cost is not None else None

    @property
    def cache_savings_usd(self) -> Decimal | None:
        """USD the cached input saved against the input rate, ``None`` when unpriced."""
        return self.cost.cache_savings if self.cost is not None else None


def quote(
    catalog: PriceCatalog,
    usage: Usage,
    *,
    model: str | None,
    provider: str | None,
    at: dt.datetime,
    service_tier: str | None = None,
    fallback: bool = False,
    requested: str | None = None,
    price_as: str | None = None,
) -> Quote:
    """Price ``usage`` of ``model`` served by ``provider`` for a request that started at ``at``.

    Args:
        catalog: the prices.
        usage: canonical token counts.
        model: the served model (or the requested one when the reply named none).
        provider: the upstream's catalog provider.
        at: the request's start (aware): picks the price version in force and the time window.
        service_tier: the tier the response says was served.
        fallback: whether the catalog's fallback rates may price an otherwise unpriced model.
        requested: the model the request named (a pin in ``catalog.price_as`` applies to it).
        price_as: the model to price as whatever was served (the upstream's ``price_as``).

    Returns:
        A :class:`Quote`; ``lines`` are JSON-ready dicts (component, quantity, rate, amount, rule),
        plus ``{"note": ...}`` items for anything priced by assumption. Counts that cannot be
        trusted (``usage.invalid``, or an invariant broken: :meth:`Usage.violations`) are
        ``usage_invalid`` and not priced; repaired counts (``usage.repairs``) are ``repaired``
        unless a weaker status applies (unpriced, fallback, partially priced). A cost of
        :data:`MAX_REQUEST_COST_USD` or more is ``usage_invalid`` too.
    """
    resolution = catalog.resolve(model, provider, at, fallback=fallback, requested=requested, price_as=price_as)
    if not usage.trusted:
        return Quote(PriceStatus.USAGE_INVALID, None, None, None, None, None)
    if resolution is None:
        return Quote(PriceStatus.UNPRICED, None, None, None, None, None)
    cost = price(usage, resolution, at=at, service_tier=service_tier)
    if cost.total >= MAX_REQUEST_COST_USD:  # counts no real request reaches: not credible, not billed
        return Quote(PriceStatus.USAGE_INVALID, None, None, None, None, None)
    if resolution.how == "fallback":
        status = PriceStatus.FALLBACK
    elif cost.unpriced_calls or cost.notes:
        status = PriceStatus.PARTIALLY_PRICED
    elif usage.repairs:
        status = PriceStatus.REPAIRED
    else:
        status = PriceStatus.PRICED
    lines: list[dict[str, Any]] = [
        {"component": ln.component, "quantity": ln.quantity, "rate": ln.rate, "amount": ln.amount, "rule": ln.rule}
        for ln in cost.lines
    ]
    if cost.unpriced_calls:
        lines.append(
            {
                "component": "web_search",
                "quantity": cost.unpriced_calls,
                "rate": None,
                "amount": None,
                "rule": "no fee in catalog",
            }
        )
    lines += [{"note": note} for note in cost.notes]
    return Quote(status, cost.total, cost.entry_id, cost.resolved_by, lines, cost)


def worst_case(
    catalog: PriceCatalog,
    *,
    model: str | None,
    provider: str | None,
    at: dt.datetime,
    input_tokens: int,
    max_output_tokens: int,
    audio_input_tokens: int = 0,
    audio_output: bool = False,
    service_tier: str | None = None,
    fallback: bool = False,
    price_as: str | None = None,
) -> Decimal | None:
    """An upper bound (USD) on what a request can cost, for budget reservations.

    Args:
        catalog: the prices.
        model: the requested model.
        provider: the upstream's catalog provider.
        at: when the request starts (picks the price version and time window).
        input_tokens: all input tokens (text, images, audio), counted or bounded.
        max_output_tokens: the most output the request allows (``max_tokens`` x ``n``).
        audio_input_tokens: how many of ``input_tokens`` may be audio.
        audio_output: whether the reply may be audio.
        service_tier: the tier the request asks for.
        fallback: whether the catalog's fallback rates may price an otherwise unpriced model.
        price_as: the model the upstream pins its prices to (as :func:`quote`); a pin in
            ``catalog.price_as`` for ``model`` applies as well.

    Every input token is priced at the highest input-side rate it could be billed at (plain,
    cache write, 1-hour cache write; audio for the audio part), every output token at the highest
    output-side rate (output, reasoning, audio when asked for), with the context tier and served
    tier those counts imply. ``None`` when the model has no price (the request cannot be bounded).
    """
    resolution = catalog.resolve(model, provider, at, fallback=fallback, requested=model, price_as=price_as)
    if resolution is None:
        return None
    audio = min(audio_input_tokens, input_tokens)
    inputs = [
        {"input_tokens": input_tokens, "audio_input_tokens": audio},
        {"input_tokens": input_tokens, "audio_input_tokens": audio, "cache_write_tokens": input_tokens - audio},
        {
            "input_tokens": input_tokens,
            "audio_input_tokens": audio,
            "cache_write_tokens": input_tokens - audio,
            "cache_write_1h_tokens": input_tokens - audio,
        },
    ]
    outputs = [
        {"output_tokens": max_output_tokens},
        {"output_tokens": max_output_tokens, "reasoning_tokens": max_output_tokens},
    ]
    if audio_output:
        outputs.append({"output_tokens": max_output_tokens, "audio_output_tokens": max_output_tokens})
    return max(
        price(Usage(**i, **o), resolution, at=at, service_tier=service_tier).total for i in inputs for o in outputs
    )
