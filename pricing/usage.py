"""The canonical usage record: one vocabulary for every provider dialect.

Every dialect module (``tokenward.proxy.dialects``) maps a provider's usage payload onto
:class:`Usage`; nothing past that edge sees a provider field name. The relations follow
``shared/NOTES.md`` section 1:

* ``input_tokens`` counts *all* billed input. ``cached_input_tokens`` (cache hits) and
  ``cache_write_tokens`` (cache writes) are subsets of it; the uncached rest is derived,
  never stored (:attr:`Usage.uncached_input_tokens`).
* ``cache_write_1h_tokens`` is the part of ``cache_write_tokens`` written with the extended
  one-hour TTL (Anthropic); the rest used the provider's default TTL (five minutes at Anthropic).
* ``output_tokens`` counts all billed output; ``reasoning_tokens`` and
  ``audio_output_tokens`` are subsets of it.
* ``audio_input_tokens`` and ``image_input_tokens`` are subsets of ``input_tokens``.
* ``web_search_requests`` counts server-side tool calls priced per call, not per token.

All counts are integer tokens (or calls); an explicit 0 from a provider is stored as 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

__all__ = ["TOKEN_FIELDS", "Usage", "UsageSource"]


class UsageSource(enum.StrEnum):
    """Where a usage record's numbers came from."""

    REPORTED = "reported"
    """The upstream reported them."""
    ESTIMATED = "estimated"
    """tokenward counted them with a tokenizer because the upstream reported none."""
    PARTIAL = "partial"
    """The exchange was cut short; input counted, output is what was seen so far."""
    NONE = "none"
    """No usage exists: nothing was billed or the endpoint is not metered."""


@dataclass(frozen=True, slots=True)
class Usage:
    """Canonical token counts of one upstream exchange (all values are integer tokens).

    Raises:
        TypeError: a count is not an ``int`` (``bool`` excluded).
    """

    input_tokens: int = 0
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    cache_write_1h_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    audio_input_tokens: int = 0
    audio_output_tokens: int = 0
    image_input_tokens: int = 0
    web_search_requests: int = 0
    source: UsageSource = UsageSource.REPORTED

    def __post_init__(self) -> None:
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if type(value) is not int:
                raise TypeError(f"Usage.{name} must be an int, got {type(value).__name__}")

    @property
    def uncached_input_tokens(self) -> int:
        """Input tokens that were neither cache hits nor cache writes (may be negative on bad input)."""
        return self.input_tokens - self.cached_input_tokens - self.cache_write_tokens

    def violations(self) -> list[str]:
        """Return the invariants this record breaks (empty when consistent).

        Checked: no negative count; cached + cache writes <= input; 1h writes <= writes;
        reasoning <= output; audio/image splits within their totals.
        """
        problems = [f"{name} < 0" for name in TOKEN_FIELDS if getattr(self, name) < 0]
        if self.cached_input_tokens + self.cache_write_tokens > self.input_tokens:
            problems.append("cached_input_tokens + cache_write_tokens > input_tokens")
        if self.cache_write_1h_tokens > self.cache_write_tokens:
            problems.append("cache_write_1h_tokens > cache_write_tokens")
        if self.reasoning_tokens > self.output_tokens:
            problems.append("reasoning_tokens > output_tokens")
        if self.audio_output_tokens > self.output_tokens:
            problems.append("audio_output_tokens > output_tokens")
        if self.audio_input_tokens + self.image_input_tokens > self.input_tokens:
            problems.append("audio_input_tokens + image_input_tokens > input_tokens")
        return problems


TOKEN_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Usage) if f.name != "source")
"""Names of the integer count fields of :class:`Usage`, in ledger column order."""
