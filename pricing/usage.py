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
* ``web_search_requests`` counts server-side tool calls priced per call, not per token; the
  other provider-run tools billed outside the tokens are counted beside it:
  ``web_fetch_requests`` (Anthropic ``server_tool_use.web_fetch_requests``),
  ``file_search_calls`` (OpenAI Responses ``file_search_call`` items) and ``code_containers``
  (code execution containers the reply used: OpenAI ``code_interpreter_call`` items' distinct
  ``container_id``; Anthropic code execution tool uses, its ``container``) and
  ``image_generation_calls`` (OpenAI Responses ``image_generation_call`` items: the image tool
  bills the images it makes outside the reply's ``usage``).
* Units the media endpoints bill by besides tokens: ``output_images`` (images generated, priced per
  image by ``image_variant``, ``"<size>/<quality>"`` such as ``"1024x1792/hd"``),
  ``input_audio_seconds`` (seconds of audio transcribed, priced per minute) and
  ``input_characters`` (characters of text spoken, priced per 1M characters).

All counts are integer tokens (or calls); an explicit 0 from a provider is stored as 0.

Counts are validated where they enter (:func:`read_count`, used by every dialect, and
:class:`Usage` itself): a count is an integer with ``0 <= n < 2**53`` (an integral float such as
``12.0`` is read as 12). Anything else (a negative number, ``10**19``, ``1e30``, ``1.5``, a string,
``true``) is never stored: the field holds 0 and :attr:`Usage.invalid` says what was refused,
so the row is recorded ``usage_invalid`` (unpriced, raw usage kept) instead of raising or
corrupting a sum. Constructing a :class:`Usage` never raises on provider input.

:attr:`Usage.repairs` lists the documented rules a dialect applied to counts that broke an
invariant as reported (for instance cache hits larger than the input, from a relay that counts
them outside it); such rows are recorded ``repaired``, never plain ``priced``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["MAX_COUNT", "TOKEN_FIELDS", "Usage", "UsageSource", "read_count"]

MAX_COUNT = 2**53
"""Counts must be below this (2^53: exact as a float, far beyond any real request)."""


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

    Never raises: a count that is not an ``int`` in ``[0, 2**53)`` (``bool`` excluded) is stored
    as 0 and described in ``invalid``. ``invalid`` and ``repairs`` are notes (``"field: why"``),
    not counts (they are not in :data:`TOKEN_FIELDS`); nor is ``image_variant``, the size and
    quality the ``output_images`` were made at (``""``: not known).
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
    web_fetch_requests: int = 0
    file_search_calls: int = 0
    code_containers: int = 0
    image_generation_calls: int = 0
    output_images: int = 0
    input_audio_seconds: int = 0
    input_characters: int = 0
    image_variant: str = ""
    source: UsageSource = UsageSource.REPORTED
    invalid: tuple[str, ...] = ()
    repairs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        refused = []
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < MAX_COUNT:
                refused.append(f"{name}: {_shown(value)} is not a count (an integer 0 <= n < 2^53)")
                object.__setattr__(self, name, 0)
        variant = self.image_variant
        if type(variant) is not str or len(variant) > 64:
            refused.append(f"image_variant: {_shown(variant)} is not a size/quality name")
            object.__setattr__(self, "image_variant", "")
        if refused:
            object.__setattr__(self, "invalid", (*self.invalid, *refused))

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

    @property
    def trusted(self) -> bool:
        """Whether the counts can be priced: every count was valid and no invariant is broken."""
        return not self.invalid and not self.violations()


TOKEN_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(Usage) if f.name not in ("source", "invalid", "repairs", "image_variant")
)
"""Names of the integer count fields of :class:`Usage`, in ledger column order."""


def read_count(value: Any, name: str, problems: list[str], prefix: str = "") -> int | None:
    """Read one provider count: ``None`` when absent (``null`` or missing), else a valid count.

    Accepts an ``int`` (not ``bool``) or an integral finite ``float`` in ``[0, 2**53)``. Anything
    else is refused: ``"<prefix><name>: <value> is not a count ..."`` is appended to ``problems``
    and ``None`` returned, so the caller reads it as absent and the usage is flagged invalid.
    """
    if type(value) is int and 0 <= value < MAX_COUNT:  # the common case first: this runs per field
        return value
    if value is None:
        return None
    if type(value) is float and math.isfinite(value) and value.is_integer() and 0 <= value < MAX_COUNT:
        return int(value)
    problems.append(f"{prefix}{name}: {_shown(value)} is not a count (an integer 0 <= n < 2^53)")
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
