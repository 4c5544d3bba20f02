"""What a meter has learnt from a reply so far, in the provider's own terms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Observation"]


@dataclass(slots=True)
class Observation:
    """Raw facts seen in a reply, filled by a dialect's ``observe_body`` and mapped by its ``to_usage``.

    ``usage`` is the provider's usage object as last seen (a dialect whose streams send running
    totals, such as Anthropic's, keeps it merged); ``error`` is the text of an error the upstream
    reported inside a successful HTTP reply.
    """

    usage: dict[str, Any] | None = None
    tool_usage: dict[str, Any] | None = None
    model: str | None = None
    service_tier: str | None = None
    error: str | None = None
