"""Pricing one metered usage against the catalog: the price status, the cost and its lines.

The one place that decides a row's ``price_status``; the proxy's recorder and
``tokenward pricing reprice`` both call :func:`quote`, so a repriced row is exactly what the
proxy would have written under the same catalog.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tokenward.pricing.catalog import PriceCatalog
from tokenward.pricing.cost import Cost, dearest_total, price
from tokenward.pricing.usage import Usage

__all__ = ["MAX_REQUEST_COST_USD", "PINNED_TIERS", "PriceStatus", "Quote", "quote", "worst_case"]

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


PINNED_TIERS: dict[str, str | None] = {
    "default": None,
    "standard": None,
    "standard_only": None,
    "on_demand": None,
    "scale": None,
    "flex": "flex",
    "priority": "priority",
}
"""Request ``service_tier`` values that pin the tier a request is served at, and the tier priced.

OpenAI: ``default`` is "standard pricing and performance", ``flex`` and ``priority`` their tiers
(``scale``: capacity paid for in advance, standard per-token price); Anthropic's
``standard_only`` never uses priority capacity. Any other value (``auto``, none, a name not
known here) may be served at the project's or organisation's default tier, which can be
priority: such requests are bounded at the dearest tier the entry prices.
"""
_NOT_SERVED_UNASKED = frozenset({"batch", "fast"})  # Batch API only; Anthropic `speed: fast` only
_PARTIAL_IMAGE_TOKENS = 100  # GPT image models: each streamed partial image adds 100 output tokens


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
    speed: str | None = None,
    inference_geo: str | None = None,
    fallback: bool = False,
    price_as: str | None = None,
    images: int = 0,
    image_tokens: int = 3000,
    output_images: int = 0,
    image_size: str | None = None,
    image_quality: str | None = None,
    partial_images: int = 0,
    characters: int = 0,
    audio_seconds: int = 0,
    tool_calls: Mapping[str, int] | None = None,
) -> Decimal | None:
    """An upper bound (USD) on what a request can cost, for budget reservations.

    Args:
        catalog: the prices.
        model: the requested model.
        provider: the upstream's catalog provider.
        at: when the request starts (picks the price version and time window).
        input_tokens: the input tokens counted or bounded (text with its margins, audio), images apart.
        max_output_tokens: the most output the request allows (``max_tokens`` x ``n``); for image
            generation, the output tokens assumed per image when the entry lists no
            ``image_output_tokens``.
        audio_input_tokens: how many of ``input_tokens`` may be audio.
        audio_output: whether the reply may be audio.
        service_tier: the tier the request asks for (:data:`PINNED_TIERS`).
        speed: the speed the request asks for (Anthropic ``fast`` pins the ``fast`` tier).
        inference_geo: where the request asks to run (Anthropic ``inference_geo``); unless given,
            every geography the entry prices is assumed possible (a workspace may default to one).
        fallback: whether the catalog's fallback rates may price an otherwise unpriced model.
        price_as: the model the upstream pins its prices to (as :func:`quote`); a pin in
            ``catalog.price_as`` for ``model`` applies as well.
        images: images in the request's input; each may cost the entry's ``image_tokens_max``
            input tokens, or ``image_tokens`` when the entry gives none.
        image_tokens: input tokens assumed per image for entries without ``image_tokens_max``.
        output_images: images the request may generate (``n``), at ``image_size`` and
            ``image_quality`` (``None``: any the model makes), each with ``partial_images``
            streamed previews.
        image_size: the size asked for, if fixed.
        image_quality: the quality asked for, if fixed.
        partial_images: streamed partial images per generated image.
        characters: input characters (text to speech priced per character).
        audio_seconds: the most seconds of audio the request may hold (priced per minute).
        tool_calls: the most calls of provider-run tools billed per call the request may make, by
            :class:`Usage` field (``web_search_requests``, ``file_search_calls``, ...), priced at
            the entry's fees (a fee the entry does not give is not billed, so it adds nothing).

    Every input token is priced at the highest input-side rate it could be billed at (plain,
    cache write, 1-hour cache write; audio for the audio part, image for the image part), every
    output token at the highest output-side rate (output, reasoning, audio when asked for),
    generated images at the dearest variant the request allows, with the context tier those
    counts imply and, unless the request pins its tier, the dearest service tier the entry
    prices that a request can be served at without asking (not ``batch``, not ``fast``).
    ``None`` when the model has no price (the request cannot be bounded).
    """
    resolution = catalog.resolve(model, provider, at, fallback=fallback, requested=model, price_as=price_as)
    if resolution is None:
        return None
    entry = resolution.entry
    image_in = images * (entry.image_tokens_max if entry.image_tokens_max is not None else image_tokens)
    total_in = input_tokens + image_in
    audio = min(audio_input_tokens, input_tokens)
    units: dict[str, Any] = {"input_characters": characters, "input_audio_seconds": audio_seconds}
    units.update(tool_calls or {})
    max_out = max_output_tokens
    if output_images:
        units["output_images"] = output_images
        if entry.image:
            units["image_variant"] = _dearest_variant(entry, image_size, image_quality)
            max_out = 0
        else:
            per_image = entry.image_tokens_out(image_size, image_quality)
            per_image = max_output_tokens if per_image is None else per_image
            max_out = output_images * (per_image + _PARTIAL_IMAGE_TOKENS * partial_images)
    inputs = [
        {"input_tokens": total_in, "audio_input_tokens": audio, "image_input_tokens": image_in},
        {"input_tokens": total_in, "audio_input_tokens": audio},
        {"input_tokens": total_in, "audio_input_tokens": audio, "cache_write_tokens": total_in - audio},
        {
            "input_tokens": total_in,
            "audio_input_tokens": audio,
            "cache_write_tokens": total_in - audio,
            "cache_write_1h_tokens": total_in - audio,
        },
    ]
    outputs = [
        {"output_tokens": max_out},
        {"output_tokens": max_out, "reasoning_tokens": max_out},
    ]
    if audio_output:
        outputs.append({"output_tokens": max_out, "audio_output_tokens": max_out})
    # the same counts priced once: a text-only request makes 6 distinct usages of these 8
    usages = dict.fromkeys(Usage(**i, **o, **units) for i in inputs for o in outputs)
    tiers = _servable_tiers(entry.service_tiers, service_tier, speed)
    if isinstance(inference_geo, str):
        geos: list[str | None] = [inference_geo.lower()]
    else:
        geos = [None, *(name for name, _ in entry.inference_geos)]
    served = [f"{tier or ''}@{geo}" if geo else tier for tier in tiers for geo in geos]
    return dearest_total(usages, resolution, at=at, service_tiers=served)


def _servable_tiers(
    tiers: tuple[tuple[str, Any], ...], asked: str | None, speed: str | None
) -> list[str | None]:
    """The tiers a request may be served at: the one it pins, else standard and every tier it can get unasked."""
    if isinstance(speed, str) and speed.lower() == "fast" and any(name == "fast" for name, _ in tiers):
        return ["fast"]
    if isinstance(asked, str) and asked.lower() in PINNED_TIERS:
        return [PINNED_TIERS[asked.lower()]]
    return [None, *(name for name, _ in tiers if name not in _NOT_SERVED_UNASKED)]


def _dearest_variant(entry: Any, size: str | None, quality: str | None) -> str:
    """The image variant the request allows whose per-image price is highest (``""`` prices the dearest)."""
    dearest = entry.dearest_image(size, quality)
    for key, value in entry.image:
        if value == dearest:
            return str(key)
    return ""
