"""What a meter has learnt from a reply so far, in the provider's own terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from tokenward.pricing.usage import Usage

__all__ = ["Observation", "Reading", "tool_counts"]


@dataclass(slots=True)
class Observation:
    """Raw facts seen in a reply, filled by a dialect's ``observe_body`` and mapped by its ``to_usage``.

    ``usage`` is the provider's usage object as last seen (a dialect whose streams send running
    totals, such as Anthropic's, keeps it merged); ``error`` is the text of an error the upstream
    reported inside a successful HTTP reply; ``web_search_calls`` the ids of hosted web search
    calls seen outside ``usage`` (each counted once however often it is repeated), and likewise
    ``file_search_calls`` (ids), ``code_containers`` (the containers code execution ran in) and
    ``image_generation_calls`` (ids); ``extra``
    holds what one dialect alone reads (the media dialect: images counted, their variant).
    """

    usage: dict[str, Any] | None = None
    tool_usage: dict[str, Any] | None = None
    breakdown: list[Any] | None = None
    model: str | None = None
    service_tier: str | None = None
    error: str | None = None
    web_search_calls: set[str] = field(default_factory=set)
    file_search_calls: set[str] = field(default_factory=set)
    code_containers: set[str] = field(default_factory=set)
    image_generation_calls: set[str] = field(default_factory=set)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reading:
    """A dialect's final reading of a reply.

    ``usage`` is the request's own model's usage (``None``: none reported); ``parts`` are usage
    spent on other models inside the same request (an Anthropic advisor, Groq compound's inner
    models), each ``(model, usage)``; ``provider_cost`` is the provider's own cost figure in USD.
    """

    usage: Usage | None
    parts: list[tuple[str, Usage]] = field(default_factory=list)
    provider_cost: Decimal | None = None


def tool_counts(seen: Observation) -> dict[str, int]:
    """The provider-run tool calls ``seen`` counted outside ``usage``, by :class:`Usage` field (zeros left out)."""
    counts = {
        "web_search_requests": len(seen.web_search_calls),
        "file_search_calls": len(seen.file_search_calls),
        "code_containers": len(seen.code_containers),
        "image_generation_calls": len(seen.image_generation_calls),
    }
    return {name: count for name, count in counts.items() if count}
