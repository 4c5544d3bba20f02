"""Spend velocity: how fast a budget's scope spends now, against an absolute rate and its own past.

A monthly limit tells too late that an agent loops: by the time 80 % is crossed the money is
gone. A velocity rule looks at the spend of the last ``window_minutes`` minutes, as a rate in
USD per hour, and fires when that rate is above ``max_usd_per_hour``, or above
``baseline_factor`` times the rate of the ``baseline_hours`` before the window (the trailing
baseline; only once the rate is at least ``min_usd_per_hour``, so that $0.02/h against a $0.001/h
night does not page anyone).

Windows are whole UTC minutes: the recent window is the current minute and the
``window_minutes - 1`` before it, the baseline the ``baseline_hours`` before that. So the
proxy's per-minute books and a ledger query (``tokenward budgets check``) read exactly the same
rows. Pure: no clock, no I/O.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal

__all__ = ["Velocity", "VelocityStatus", "velocity_status", "velocity_windows"]

_RATE = Decimal("0.000001")


@dataclass(frozen=True, slots=True)
class Velocity:
    """A spend-rate alert rule (rates in USD per hour).

    Args:
        window_minutes: the recent window, in whole minutes (1 to 1440).
        max_usd_per_hour: fire above this rate (``None``: no absolute rule).
        baseline_factor: fire above this many times the trailing baseline's rate (``None``: no
            relative rule).
        baseline_hours: how far before the window the baseline reaches.
        min_usd_per_hour: the relative rule fires only from this rate up.

    Raises:
        ValueError: no rule given, or a window, factor or rate out of range.
    """

    window_minutes: int = 15
    max_usd_per_hour: Decimal | None = None
    baseline_factor: Decimal | None = None
    baseline_hours: Decimal = Decimal(24)
    min_usd_per_hour: Decimal = Decimal(0)

    def __post_init__(self) -> None:
        if self.max_usd_per_hour is None and self.baseline_factor is None:
            raise ValueError("a velocity rule needs max_usd_per_hour or baseline_factor (or both)")
        if not 1 <= self.window_minutes <= 1440:
            raise ValueError("velocity window_minutes must be between 1 and 1440")
        if self.max_usd_per_hour is not None and not self.max_usd_per_hour > 0:
            raise ValueError("velocity max_usd_per_hour must be positive")
        if self.baseline_factor is not None and not self.baseline_factor > 1:
            raise ValueError("velocity baseline_factor must be more than 1")
        if not 0 < self.baseline_hours <= 24 * 31:
            raise ValueError("velocity baseline_hours must be between 0 and 744")
        if self.min_usd_per_hour < 0:
            raise ValueError("velocity min_usd_per_hour cannot be negative")

    @property
    def horizon(self) -> dt.timedelta:
        """How far back the rule looks (window and baseline)."""
        return dt.timedelta(minutes=self.window_minutes, hours=float(self.baseline_hours))


def velocity_windows(rule: Velocity, now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """``(window_start, baseline_start)`` at ``now``, both whole UTC minutes.

    The recent window is ``[window_start, now]``, the baseline ``[baseline_start, window_start)``.

    Raises:
        ValueError: ``now`` is naive.
    """
    if now.tzinfo is None:
        raise ValueError("velocity windows need an aware datetime")
    minute = now.astimezone(dt.UTC).replace(second=0, microsecond=0)
    window_start = minute - dt.timedelta(minutes=rule.window_minutes - 1)
    return window_start, window_start - dt.timedelta(hours=float(rule.baseline_hours))


@dataclass(frozen=True, slots=True)
class VelocityStatus:
    """A velocity rule at an instant: the recent and baseline rates (USD/h) and what fired."""

    rule: Velocity
    recent_usd: Decimal
    rate: Decimal
    baseline_rate: Decimal
    over_max: bool
    over_baseline: bool

    @property
    def firing(self) -> bool:
        """Whether the rate is above either rule."""
        return self.over_max or self.over_baseline

    def describe(self) -> str:
        """``$12.00/h over the last 15 min (over $10/h; 6x the 24 h baseline of $2/h)``."""
        reasons = []
        if self.over_max:
            reasons.append(f"over ${_plain(self.rule.max_usd_per_hour)}/h")
        if self.over_baseline:
            times = (self.rate / self.baseline_rate).quantize(Decimal("0.1")) if self.baseline_rate else None
            baseline = f"the {_plain(self.rule.baseline_hours)} h baseline of ${_plain(self.baseline_rate)}/h"
            reasons.append(f"{times}x {baseline}" if times is not None else f"above {baseline}")
        why = f" ({'; '.join(reasons)})" if reasons else ""
        return f"${_plain(self.rate)}/h over the last {self.rule.window_minutes} min{why}"


def _plain(amount: Decimal | None) -> str:
    return "-" if amount is None else format(amount.normalize(), "f")


def velocity_status(rule: Velocity, recent_usd: Decimal, baseline_usd: Decimal) -> VelocityStatus:
    """The rule's verdict on ``recent_usd`` spent in the window and ``baseline_usd`` in the baseline.

    Rates are ``recent_usd / window`` and ``baseline_usd / baseline_hours`` (USD per hour, to the
    micro-dollar); the relative rule compares unrounded amounts, so it is exact.
    """
    window_h = Decimal(rule.window_minutes) / 60
    rate = (recent_usd / window_h).quantize(_RATE)
    baseline_rate = (baseline_usd / rule.baseline_hours).quantize(_RATE)
    over_max = rule.max_usd_per_hour is not None and recent_usd > rule.max_usd_per_hour * window_h
    over_baseline = (
        rule.baseline_factor is not None
        and recent_usd >= rule.min_usd_per_hour * window_h
        and recent_usd > 0
        # recent / window > factor x baseline / baseline_hours, without dividing
        and recent_usd * rule.baseline_hours > rule.baseline_factor * baseline_usd * window_h
    )
    return VelocityStatus(rule, recent_usd, rate, baseline_rate, over_max, bool(over_baseline))
