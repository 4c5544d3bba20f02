"""Money: turn a canonical :class:`~tokenward.pricing.usage.Usage` into an exact cost.

Pure and exact: no clock reads, no I/O, no floats. The rules apply in a fixed order, each to
the WHOLE request (never only to the tokens past a threshold, field case B20):

1. the entry's base rates (USD per 1M tokens);
2. the highest context tier the request passes (cliff; input counted with cache reads and
   writes, field case B19);
3. the service tier the response says was served (``service_tier``, or ``fast`` for
   Anthropic's ``usage.speed``); the standard tiers (``default``, ``standard``, ``auto``,
   ``on_demand``) use the base rates; then where it ran, when the served tier names it as
   ``<tier>@<geo>`` (Anthropic's ``usage.inference_geo``, ``standard@us``: the entry's
   ``inference_geos``; ``global`` and ``not_available`` are the base rates);
4. the first time window containing the request's start (DeepSeek's off-peak hours).

Each token class is then priced exactly once (field cases B09, B10): uncached input, cache hits,
default-TTL and one-hour cache writes, output (reasoning apart only where it has its own rate),
audio and image subsets at their rates, web searches, web fetches, file searches and request fees
per call, code execution containers per container, the images the Responses image generation
tool made per image (a tool call with no fee in the entry is noted, so the row is
``partially_priced``). The media units
are priced at the entry's own rates, which no tier or window changes: generated images per
image (by the variant they were made at), input audio per minute (billed per second) and input
characters per 1M. A unit counted with no rate for it, and no tokens that could have priced it,
is noted (the row is then ``partially_priced``, never a silent $0). Amounts are exact decimals,
rounded half-even only below 1e-12 USD (a multiplier can add decimal places).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

from tokenward.pricing.catalog import Resolution
from tokenward.pricing.rates import Rates
from tokenward.pricing.usage import Usage

__all__ = ["OUTPUT_COMPONENTS", "STANDARD_GEOS", "STANDARD_TIERS", "Cost", "CostLine", "dearest_total", "price"]

_PER_MILLION = Decimal(1_000_000)
_PICO = Decimal("1e-12")
_SECONDS = Decimal(60)
_TOOLS = (
    ("web_fetch_requests", "web_fetch", "web fetch calls"),
    ("file_search_calls", "file_search", "file search calls"),
    ("code_containers", "code_container", "code execution containers"),
    ("image_generation_calls", "image_generation", "image generation calls"),
)
"""Provider-run tools billed per call besides web search: (usage count, entry fee, what in a note)."""

OUTPUT_COMPONENTS = frozenset({"output", "reasoning", "audio_output"})
"""Cost line components that are output tokens."""

STANDARD_TIERS = frozenset({"", "default", "standard", "auto", "on_demand", "provisioned"})
"""Served tier names that mean the standard (base) rates (``provisioned``: Google capacity that
OpenRouter reports and bills at list price)."""

STANDARD_GEOS = frozenset({"", "global", "not_available"})
"""Served ``inference_geo`` values that mean the base rates (Anthropic reports ``not_available``
for models without data residency and ``global`` for the default routing)."""


@dataclass(frozen=True, slots=True)
class CostLine:
    """One priced component of a cost.

    ``quantity`` tokens (or calls) at ``rate`` (USD per 1M tokens, or per call for ``web_search``,
    ``web_fetch``, ``file_search`` and ``request``, per container for ``code_container``; per image
    for ``image``, per minute for ``audio_seconds`` whose quantity is seconds, per 1M for
    ``characters``), the ``amount`` in USD, and the ``rule`` that set the rate.
    """

    component: str
    quantity: int
    rate: Decimal
    amount: Decimal
    rule: str = "base"


@dataclass(frozen=True, slots=True)
class Cost:
    """The exact cost of one exchange in USD, with its line items and the entry that priced it.

    ``entry_id`` is the entry's version id; ``unpriced_calls`` counts web searches the entry has
    no fee for (listed, not billed as $0); ``notes`` explain anything priced by assumption.
    ``cache_savings`` (USD): what the cached input tokens would have cost at the input rate that
    applied, minus what they cost.
    """

    total: Decimal
    lines: tuple[CostLine, ...]
    entry_id: str
    resolved_by: str
    rules: tuple[str, ...] = ()
    unpriced_calls: int = 0
    notes: tuple[str, ...] = ()
    cache_savings: Decimal = Decimal(0)

    @property
    def output_cost(self) -> Decimal:
        """USD of the output line items (text, reasoning and audio output)."""
        return sum((ln.amount for ln in self.lines if ln.component in OUTPUT_COMPONENTS), Decimal(0))


def price(
    usage: Usage,
    resolution: Resolution,
    *,
    at: dt.datetime | None = None,
    service_tier: str | None = None,
) -> Cost:
    """Price ``usage`` with the entry in ``resolution``.

    Args:
        usage: canonical token counts; a derived count that comes out negative (broken
            invariants, flagged elsewhere) prices as 0 rather than producing a negative cost.
        resolution: the price entry version and how it was resolved.
        at: the request's start (aware), for time windows; ``None`` applies no window.
        service_tier: the tier the response says was served.

    Returns:
        A :class:`Cost` whose ``total`` is the exact sum of its line amounts.
    """
    entry = resolution.entry
    rates, rules, notes = _applied_rates(usage, resolution, at, service_tier)
    rule = "+".join(rules) or "base"
    lines = [CostLine(name, tokens, rate, amount, rule) for name, tokens, rate, amount in _token_amounts(usage, rates)]
    fixed, unpriced_calls = _fixed_lines(usage, resolution, notes)
    lines += fixed
    total = sum((line.amount for line in lines), Decimal(0))
    cached = max(usage.cached_input_tokens, 0)
    savings = _exact(cached * (rates.input - rates.cached_input) / _PER_MILLION) if cached else Decimal(0)
    return Cost(
        total, tuple(lines), entry.version_id, resolution.how, tuple(rules), unpriced_calls, tuple(notes), savings
    )


def dearest_total(
    usages: Iterable[Usage],
    resolution: Resolution,
    *,
    at: dt.datetime | None = None,
    service_tiers: Iterable[str | None] = (None,),
) -> Decimal:
    """The largest ``price(usage, resolution, at=at, service_tier=tier).total`` over ``usages`` and ``service_tiers``.

    The same rules and amounts as :func:`price` (the same helpers make them), without building a
    :class:`Cost` per pair, and with each (context size, tier) table of rates made once: what a
    budget's bound (:func:`tokenward.pricing.quote.worst_case`) prices on every request.

    Raises:
        ValueError: ``usages`` or ``service_tiers`` is empty.
    """
    tiers = tuple(service_tiers)
    tables: dict[tuple[int, int, str | None], Rates] = {}
    best: Decimal | None = None
    for usage in usages:
        fixed = sum((line.amount for line in _fixed_lines(usage, resolution, [])[0]), Decimal(0))
        for tier in tiers:
            key = (usage.input_tokens, usage.output_tokens, tier)  # what a context tier compares
            rates = tables.get(key)
            if rates is None:
                rates = tables[key] = _applied_rates(usage, resolution, at, tier)[0]
            total = sum((amount for *_, amount in _token_amounts(usage, rates)), fixed)
            if best is None or total > best:
                best = total
    if best is None:
        raise ValueError("dearest_total needs at least one usage and one service tier")
    return best


def _applied_rates(
    usage: Usage, resolution: Resolution, at: dt.datetime | None, service_tier: str | None
) -> tuple[Rates, list[str], list[str]]:
    """The rates rules 1 to 4 of the module docstring give ``usage``; the rules applied and notes made."""
    entry = resolution.entry
    rates: Rates = entry.rates
    rules: list[str] = []
    notes: list[str] = []
    for tier in entry.context_tiers:
        if tier.fires(usage.input_tokens, usage.output_tokens):
            rates = tier.adjustment.apply(rates)
            rules.append(tier.name)
            break
    tier_name, _, geo = (service_tier or "").lower().partition("@")
    served = (("tier", "served tier", tier_name, STANDARD_TIERS), ("geo", "served inference_geo", geo, STANDARD_GEOS))
    for rule, what, name, standard in served:
        if name in standard:
            continue
        adjustment = entry.service_tier(name) if rule == "tier" else entry.inference_geo(name)
        if adjustment is None:
            notes.append(f"{what} {name!r} has no price in {entry.version_id}: standard rates used")
        else:
            rates = adjustment.apply(rates)
            rules.append(f"{rule}:{name}")
    if at is not None:
        for window in entry.windows:
            if window.contains(at):
                rates = window.adjustment.apply(rates)
                rules.append(f"window:{window.name}")
                break
    return rates, rules, notes


def _token_amounts(usage: Usage, rates: Rates) -> list[tuple[str, int, Decimal, Decimal]]:
    """``(component, tokens, rate, amount)`` of each token class ``usage`` has (> 0), each priced once."""
    audio_in, image_in = max(usage.audio_input_tokens, 0), max(usage.image_input_tokens, 0)
    audio_out = max(usage.audio_output_tokens, 0)
    split_reasoning = rates.reasoning != rates.output
    reasoning = max(usage.reasoning_tokens, 0) if split_reasoning else 0
    write_1h = usage.cache_write_1h_tokens
    candidates = (
        ("input", usage.uncached_input_tokens - audio_in - image_in, rates.input),
        ("audio_input", audio_in, rates.audio_input),
        ("image_input", image_in, rates.image_input),
        ("cached_input", usage.cached_input_tokens, rates.cached_input),
        ("cache_write", usage.cache_write_tokens - write_1h, rates.cache_write),
        ("cache_write_1h", write_1h, rates.cache_write_1h),
        ("output", usage.output_tokens - audio_out - reasoning, rates.output),
        ("reasoning", reasoning, rates.reasoning),
        ("audio_output", audio_out, rates.audio_output),
    )
    return [
        (name, tokens, rate, _exact(tokens * rate / _PER_MILLION)) for name, tokens, rate in candidates if tokens > 0
    ]


def _fixed_lines(usage: Usage, resolution: Resolution, notes: list[str]) -> tuple[list[CostLine], int]:
    """The lines no tier or window changes (web searches, the request fee, media units); web searches left unpriced."""
    entry = resolution.entry
    lines: list[CostLine] = []
    unpriced_calls = 0
    if usage.web_search_requests > 0:
        if entry.web_search is None:
            unpriced_calls = usage.web_search_requests
        else:
            amount = entry.web_search * usage.web_search_requests
            lines.append(CostLine("web_search", usage.web_search_requests, entry.web_search, amount))
    for count, fee, what in _TOOLS:
        calls = getattr(usage, count)
        if calls > 0:
            rate = getattr(entry, fee)
            if rate is None:
                notes.append(f"{calls} {what} and no fee for them in {entry.version_id}: not billed")
            else:
                lines.append(CostLine(fee, calls, rate, rate * calls))
    if entry.per_request:
        lines.append(CostLine("request", 1, entry.per_request, entry.per_request))
    lines += _unit_lines(usage, resolution, notes)
    return lines, unpriced_calls


def _unit_lines(usage: Usage, resolution: Resolution, notes: list[str]) -> list[CostLine]:
    """Lines for the media units (images, audio seconds, characters) at the entry's base rates."""
    entry = resolution.entry
    lines = []
    if usage.output_images > 0:
        rate = entry.image_price(usage.image_variant)
        if rate is not None:
            lines.append(CostLine("image", usage.output_images, rate, rate * usage.output_images, "base"))
        elif usage.output_tokens == 0:
            notes.append(f"{usage.output_images} images and no per-image price in {entry.version_id}")
    if usage.input_audio_seconds > 0:
        if entry.audio_minute is not None:
            amount = _exact(usage.input_audio_seconds * entry.audio_minute / _SECONDS)
            lines.append(CostLine("audio_seconds", usage.input_audio_seconds, entry.audio_minute, amount, "base"))
        elif usage.audio_input_tokens == 0:
            notes.append(f"{usage.input_audio_seconds} s of audio and no per-minute price in {entry.version_id}")
    if usage.input_characters > 0:
        if entry.characters is not None:
            amount = _exact(usage.input_characters * entry.characters / _PER_MILLION)
            lines.append(CostLine("characters", usage.input_characters, entry.characters, amount, "base"))
        elif usage.input_tokens == 0:
            notes.append(f"{usage.input_characters} characters and no per-character price in {entry.version_id}")
    return lines


def _exact(amount: Decimal) -> Decimal:
    exponent = amount.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -12:
        return amount.quantize(_PICO, rounding=ROUND_HALF_EVEN)
    return amount
