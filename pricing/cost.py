"""Money: turn a canonical :class:`~tokenward.pricing.usage.Usage` into an exact cost.

Pure and exact: no clock, no I/O, no floats. Each token class is priced exactly once
(``shared/fixtures/field-cases.md`` B09, B10): uncached input at ``input``, cache hits at
``cached_input``, default-TTL cache writes at ``cache_write``, one-hour writes at
``cache_write_1h``, output (reasoning included) at ``output``; audio input and output at their
own rates when the usage splits them out; server-side web searches per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from tokenward.pricing.catalog import PriceEntry, Resolution
from tokenward.pricing.usage import Usage

__all__ = ["Cost", "CostLine", "price"]

_PER_MILLION = Decimal(1_000_000)


@dataclass(frozen=True, slots=True)
class CostLine:
    """One priced component: ``quantity`` tokens (or calls) at ``rate`` USD per 1M tokens (per call)."""

    component: str
    quantity: int
    rate: Decimal
    amount: Decimal


@dataclass(frozen=True, slots=True)
class Cost:
    """The exact cost of one exchange in USD, with its line items and the entry that priced it.

    ``unpriced_calls`` counts per-call tool uses the entry has no rate for (listed, not billed as $0).
    """

    total: Decimal
    lines: tuple[CostLine, ...]
    entry_id: str
    resolved_by: str
    unpriced_calls: int = 0


def price(usage: Usage, resolution: Resolution) -> Cost:
    """Price ``usage`` with the entry in ``resolution``.

    Args:
        usage: canonical token counts; negative derived counts (broken invariants) are priced
            as 0 for that component rather than producing a negative cost.
        resolution: the price entry (USD per 1M tokens) and how it was resolved.

    Returns:
        A :class:`Cost` whose ``total`` is the exact sum of its line amounts (at most 12
        decimal places, given the catalog's 6-decimal rates). Zero-quantity lines are omitted.
    """
    entry: PriceEntry = resolution.entry
    audio_in = max(usage.audio_input_tokens, 0)
    audio_out = max(usage.audio_output_tokens, 0)
    text_uncached = usage.uncached_input_tokens - audio_in
    write_1h = usage.cache_write_1h_tokens
    lines = [
        _line("input", text_uncached, entry.input),
        _line("audio_input", audio_in, entry.audio_input),
        _line("cached_input", usage.cached_input_tokens, entry.cached_input),
        _line("cache_write", usage.cache_write_tokens - write_1h, entry.cache_write),
        _line("cache_write_1h", write_1h, entry.cache_write_1h),
        _line("output", usage.output_tokens - audio_out, entry.output),
        _line("audio_output", audio_out, entry.audio_output),
    ]
    unpriced_calls = 0
    if usage.web_search_requests > 0:
        if entry.web_search is None:
            unpriced_calls = usage.web_search_requests
        else:
            amount = entry.web_search * usage.web_search_requests
            lines.append(CostLine("web_search", usage.web_search_requests, entry.web_search, amount))
    kept = tuple(line for line in lines if line is not None)
    total = sum((line.amount for line in kept), Decimal(0))
    return Cost(total, kept, entry.id, resolution.how, unpriced_calls)


def _line(component: str, tokens: int, rate: Decimal) -> CostLine | None:
    if tokens <= 0:
        return None
    return CostLine(component, tokens, rate, tokens * rate / _PER_MILLION)
