"""Rate tables and the rules that change them: context cliffs, service tiers, time windows.

All rates are USD per 1M tokens, held as exact ``Decimal``. A :class:`Rates` is the full table
for one pricing situation; an :class:`Adjustment` turns one table into another, either by
replacing some rates (``rates``) or by scaling every token rate (``multiplier``). The rules that
decide when an adjustment applies (:class:`ContextTier`, :class:`Window`) are plain values that
answer for a given usage or instant; nothing here reads a clock.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, fields
from decimal import Decimal
from zoneinfo import ZoneInfo

__all__ = ["RATE_NAMES", "Adjustment", "ContextTier", "Rates", "Window"]


@dataclass(frozen=True, slots=True)
class Rates:
    """USD per 1M tokens for each token class.

    ``cached_input`` is a cache hit, ``cache_write`` a default-TTL cache write (five minutes at
    Anthropic), ``cache_write_1h`` a one-hour write; ``reasoning`` prices reasoning tokens when a
    provider prices them apart from other output; audio and image rates price those subsets.
    """

    input: Decimal
    output: Decimal
    cached_input: Decimal
    cache_write: Decimal
    cache_write_1h: Decimal
    reasoning: Decimal
    audio_input: Decimal
    audio_output: Decimal
    image_input: Decimal

    @classmethod
    def build(cls, given: dict[str, Decimal]) -> Rates:
        """Complete ``given`` (``input`` and ``output`` required) with the documented defaults.

        Defaults: ``cached_input``, ``cache_write``, ``audio_input``, ``image_input`` -> ``input``
        (no discount unless stated); ``cache_write_1h`` -> ``cache_write``; ``reasoning``,
        ``audio_output`` -> ``output``.
        """
        base_in, base_out = given["input"], given["output"]
        write = given.get("cache_write", base_in)
        return cls(
            input=base_in,
            output=base_out,
            cached_input=given.get("cached_input", base_in),
            cache_write=write,
            cache_write_1h=given.get("cache_write_1h", write),
            reasoning=given.get("reasoning", base_out),
            audio_input=given.get("audio_input", base_in),
            audio_output=given.get("audio_output", base_out),
            image_input=given.get("image_input", base_in),
        )


RATE_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Rates))
"""Every rate name, as used in price files."""


_DERIVED = (
    ("cached_input", "input"),
    ("cache_write", "input"),
    ("audio_input", "input"),
    ("image_input", "input"),
    ("cache_write_1h", "cache_write"),
    ("reasoning", "output"),
    ("audio_output", "output"),
)
"""Rates that default to another (see :meth:`Rates.build`), in dependency order."""


@dataclass(frozen=True, slots=True)
class Adjustment:
    """A change of rates: ``rates`` replace the named rates; otherwise ``multiplier`` scales all.

    A rate the adjustment does not name, and that equals the rate it defaults to (``reasoning``
    equal to ``output``, say), follows that rate: a priority tier that only gives ``input``,
    ``cached_input`` and ``output`` also moves ``reasoning`` and ``audio_output`` with ``output``.
    A rate that differs from its default (a real discount) keeps its base value.
    """

    rates: tuple[tuple[str, Decimal], ...] = ()
    multiplier: Decimal | None = None

    def apply(self, rates: Rates) -> Rates:
        """The adjusted table."""
        if self.rates:
            given = dict(self.rates)
            values = {name: given.get(name, getattr(rates, name)) for name in RATE_NAMES}
            for derived, source in _DERIVED:
                if derived not in given and getattr(rates, derived) == getattr(rates, source):
                    values[derived] = values[source]
            return Rates(**values)
        if self.multiplier is not None:
            return Rates(**{name: getattr(rates, name) * self.multiplier for name in RATE_NAMES})
        return rates


@dataclass(frozen=True, slots=True)
class ContextTier:
    """A long-context cliff: past ``threshold`` tokens the WHOLE request moves to other rates.

    ``counts`` names what is compared with the threshold: ``input`` (all input, cache reads and
    writes included), ``output`` or ``total``. ``inclusive`` chooses ``>=`` over ``>``.
    """

    threshold: int
    adjustment: Adjustment
    counts: tuple[str, ...] = ("input",)
    inclusive: bool = False

    @property
    def name(self) -> str:
        """The rule's name in line items, e.g. ``context>200000``."""
        return f"context{'>=' if self.inclusive else '>'}{self.threshold}"

    def fires(self, input_tokens: int, output_tokens: int) -> bool:
        """Whether a request with these token totals is past the cliff."""
        sizes = {"input": input_tokens, "output": output_tokens, "total": input_tokens + output_tokens}
        size = sum(sizes[c] for c in self.counts)
        return size >= self.threshold if self.inclusive else size > self.threshold


_WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


@dataclass(frozen=True, slots=True)
class Window:
    """A time-of-day price window: ``[start, end)`` local time in ``timezone`` on ``weekdays``.

    ``end`` earlier than ``start`` wraps past midnight (16:30-00:30); the weekday is that of the
    instant itself. Evaluated at the request's start.
    """

    name: str
    start: dt.time
    end: dt.time
    adjustment: Adjustment
    weekdays: frozenset[str] = frozenset(_WEEKDAYS)
    timezone: str = "UTC"

    def contains(self, at: dt.datetime) -> bool:
        """Whether the aware instant ``at`` falls in the window.

        Raises:
            ValueError: ``at`` is naive.
        """
        if at.tzinfo is None:
            raise ValueError("window check needs an aware datetime")
        local = at.astimezone(ZoneInfo(self.timezone))
        if _WEEKDAYS[local.weekday()] not in self.weekdays:
            return False
        now = local.time().replace(tzinfo=None)
        if self.start <= self.end:
            return self.start <= now < self.end
        return now >= self.start or now < self.end
