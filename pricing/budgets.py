"""Budgets: limits in USD on a scope of traffic over a period, and what they say at an instant.

Pure: no clock reads (every function takes ``now``), no I/O. A budget's **period** is a window
of time aligned to the calendar in a named time zone (an hour from the local hour's start; a
day from local midnight to local midnight, DST included: a 23- or 25-hour day; a week from
Monday, as ISO 8601, or the day ``week_start`` names; a calendar month), a rolling window of
the last N hours, or ``total`` (no reset). Windows are returned as aware UTC instants, so
comparisons never mix local and UTC time (field case B34).

A budget's **scope** is a set of attribution conditions a ledger row must all meet: ``key``
(the virtual key's name, or a passthrough key's ``fp-`` fingerprint), ``team``, ``project``,
``end_user``, ``model`` (the requested or the served name), ``upstream``, ``tag`` (one of the
row's tags), ``org`` and ``pool`` (from the key's definition: a pool is a budget several keys
draw from), ``run`` (an agent run's id, ``X-Tokenward-Run``). No condition: all traffic.

A budget with ``per`` set is a template: it stands for one budget per value of that dimension
(one per end user, say), made on first sight with :meth:`Budget.instance`. One definition with
several windows becomes one budget per window, sharing ``group``.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import TYPE_CHECKING, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from tokenward.pricing.catalog import cloud_model

if TYPE_CHECKING:
    from tokenward.pricing.velocity import Velocity

__all__ = [
    "CALENDAR_PERIODS",
    "PER_DIMENSIONS",
    "SCOPE_DIMENSIONS",
    "SNAPSHOT_SUFFIX",
    "Budget",
    "BudgetStatus",
    "Degrade",
    "Period",
    "evaluate",
    "model_base",
    "same_model",
]

SCOPE_DIMENSIONS = ("key", "team", "project", "end_user", "model", "upstream", "tag", "org", "pool", "run")
"""Attribution dimensions a budget scope can constrain."""

PER_DIMENSIONS = ("key", "team", "project", "end_user", "org", "pool")
"""Dimensions a template budget (``per``) can make one budget per value of (one value per request)."""

PeriodKind = Literal["hour", "day", "week", "month", "total", "rolling"]
CALENDAR_PERIODS = ("hour", "day", "week", "month")
"""Periods aligned to the calendar (they reset at a known instant)."""
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_FOREVER = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True, slots=True)
class Period:
    """When a budget's spend resets.

    Args:
        kind: ``hour``, ``day``, ``week`` (from local midnight of ``week_start``), ``month``,
            ``total`` or ``rolling``.
        timezone: IANA zone the calendar periods follow.
        rolling_hours: the window length of a ``rolling`` period.
        week_start: the day a week starts, as :meth:`datetime.date.weekday` counts (0 Monday, as
            ISO 8601, ... 6 Sunday, as in the US).

    Raises:
        ValueError: unknown kind or zone, a rolling period without a positive length, a
            ``week_start`` outside 0-6.
    """

    kind: PeriodKind = "month"
    timezone: str = "UTC"
    rolling_hours: float | None = None
    week_start: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("hour", "day", "week", "month", "total", "rolling"):
            raise ValueError(f"unknown period {self.kind!r}")
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"unknown time zone {self.timezone!r}") from exc
        if self.kind == "rolling" and not (self.rolling_hours and self.rolling_hours > 0):
            raise ValueError("a rolling period needs rolling_hours > 0")
        if self.week_start not in range(7):
            raise ValueError(f"week_start {self.week_start!r} is not a day of the week (0 Monday to 6 Sunday)")

    def window(self, now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
        """The ``[start, end)`` window containing the aware instant ``now``, as UTC instants.

        For ``rolling`` the window is ``[now - rolling_hours, now)`` and never "resets";
        for ``total`` it is unbounded.

        Raises:
            ValueError: ``now`` is naive.
        """
        if now.tzinfo is None:
            raise ValueError("a period window needs an aware datetime")
        if self.kind == "total":
            return _EPOCH, _FOREVER
        if self.kind == "rolling":
            assert self.rolling_hours is not None
            return (now - dt.timedelta(hours=self.rolling_hours)).astimezone(dt.UTC), now.astimezone(dt.UTC)
        zone = ZoneInfo(self.timezone)
        if self.kind == "hour":  # the local hour (a zone 30 minutes off UTC has its own hours)
            start = now.astimezone(zone).replace(minute=0, second=0, microsecond=0).astimezone(dt.UTC)
            return start, start + dt.timedelta(hours=1)
        local = now.astimezone(zone).date()
        if self.kind == "day":
            first, following = local, local + dt.timedelta(days=1)
        elif self.kind == "week":
            first = local - dt.timedelta(days=(local.weekday() - self.week_start) % 7)
            following = first + dt.timedelta(days=7)
        else:
            first = local.replace(day=1)
            following = (first + dt.timedelta(days=32)).replace(day=1)
        return _midnight(first, zone), _midnight(following, zone)


def _midnight(day: dt.date, zone: ZoneInfo) -> dt.datetime:
    """Local midnight of ``day`` as a UTC instant (zoneinfo resolves DST gaps forward)."""
    return dt.datetime(day.year, day.month, day.day, tzinfo=zone).astimezone(dt.UTC)


@dataclass(frozen=True, slots=True)
class Budget:
    """A limit in USD on a scope of traffic over a period.

    Args:
        name: unique name (used in alerts, refusals and the ``x-tokenward-budget`` header).
        limit_usd: the limit, exact.
        scope: dimension -> value conditions (see :data:`SCOPE_DIMENSIONS`); empty: all traffic.
        period: when spend resets.
        thresholds: percentages of the limit that trigger an alert when crossed.
        action: ``alert`` only, or ``block`` (requests that could exceed the limit are refused).
        notify: email addresses and webhook names to alert.
        group: the definition's name when it has several windows (each window is a budget).
        per: a template: one budget per value of this dimension (:meth:`instance`).
        degrade: what to do instead of refusing when a request's worst case does not fit.
        velocity: spend-rate alerts on this budget's scope
            (:class:`~tokenward.pricing.velocity.Velocity`).

    Raises:
        ValueError: a non-positive limit, an unknown scope dimension, a threshold outside 1-1000.
    """

    name: str
    limit_usd: Decimal
    scope: tuple[tuple[str, str], ...] = ()
    period: Period = Period()
    thresholds: tuple[int, ...] = (50, 80, 100)
    action: Literal["alert", "block"] = "alert"
    notify: tuple[str, ...] = ()
    group: str | None = None
    per: str | None = None
    degrade: Degrade | None = None
    velocity: Velocity | None = None

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("a budget needs a name")
        if not self.limit_usd.is_finite() or not self.limit_usd > 0:
            raise ValueError(f"budget {self.name!r}: limit_usd must be a positive amount of USD")
        for dimension, _ in self.scope:
            if dimension not in SCOPE_DIMENSIONS:
                raise ValueError(
                    f"budget {self.name!r}: unknown scope {dimension!r} (use {', '.join(SCOPE_DIMENSIONS)})"
                )
        if any(not 0 < t <= 1000 for t in self.thresholds):
            raise ValueError(f"budget {self.name!r}: thresholds are percentages between 1 and 1000")
        if self.per is not None and self.per not in PER_DIMENSIONS:
            raise ValueError(f"budget {self.name!r}: per must be one of {', '.join(PER_DIMENSIONS)}")
        if self.per is not None and self.period.kind == "rolling":
            raise ValueError(f"budget {self.name!r}: a per-{self.per} budget needs a calendar or total period")

    def instance(self, value: str) -> Budget:
        """The budget a template (``per``) stands for at one value: ``name[value]``, scope narrowed to it."""
        assert self.per is not None
        return replace(
            self,
            name=f"{self.name}[{value}]",
            scope=tuple(sorted((*self.scope, (self.per, value)))),
            per=None,
            group=self.name,
            velocity=None,
        )

    @property
    def blocking(self) -> bool:
        """Whether requests that could exceed the limit are refused."""
        return self.action == "block"

    def describe_scope(self) -> str:
        """``team=a, model=gpt-4o`` (or ``all traffic``)."""
        return ", ".join(f"{k}={v}" for k, v in self.scope) or "all traffic"

    def matches(self, attributes: Mapping[str, object]) -> bool:
        """Whether a request or row with these attributes is in scope.

        ``attributes`` maps each dimension to a value, or to a collection of values any of which
        may match (a row's tags; its requested and served model names).
        """
        for dimension, wanted in self.scope:
            value = attributes.get(dimension)
            values = value if isinstance(value, list | tuple | set | frozenset) else (value,)
            if dimension == "model":
                if not any(isinstance(v, str) and same_model(wanted, v) for v in values):
                    return False
            elif wanted not in values:
                return False
        return True


@dataclass(frozen=True, slots=True)
class Degrade:
    """Instead of refusing a request whose worst case does not fit, make it fit (never past the limit).

    Args:
        reroute: requested model -> a cheaper model served by the same upstream, tried first.
        clamp: lower the request's output limit (``max_tokens``, ``max_completion_tokens``,
            ``max_output_tokens``) to the most that fits.
        min_output_tokens: below this many output tokens a clamped request is refused instead.
    """

    reroute: tuple[tuple[str, str], ...] = ()
    clamp: bool = False
    min_output_tokens: int = 1

    def cheaper(self, model: str | None) -> str | None:
        """The model ``model`` is rerouted to (the name or its dated snapshots), or ``None``."""
        if model is None:
            return None
        return next((to for source, to in self.reroute if _same_snapshot(source, model)), None)


SNAPSHOT_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8})$")
"""A dated snapshot suffix of a model name (``-2024-08-06``, ``-20250514``)."""


def model_base(name: str) -> str:
    """``name`` without a routing prefix (what follows its last ``/``) and as the model a cloud's name names.

    ``openrouter/openai/gpt-4o`` is ``gpt-4o``; Bedrock's ``us.anthropic.claude-sonnet-4-5-20250929-v1:0``
    is ``claude-sonnet-4-5-20250929`` and Vertex AI's ``claude-sonnet-4-5@20250929`` is
    ``claude-sonnet-4-5`` (:func:`tokenward.pricing.catalog.cloud_model`). The prices resolve such
    names the same way (``price_resolved_by`` ``routing_prefix`` / ``cloud_name``), so a budget
    must too (SQL: :func:`tokenward.reports.queries.cloud_model_sql`).
    """
    return cloud_model(name.rpartition("/")[2])


def same_model(scope: str, name: str) -> bool:
    """Whether a budget's ``model`` scope covers the model ``name``.

    Equal names match, and a name matches its dated snapshots either way: a request for
    ``gpt-4o`` may be served as ``gpt-4o-2024-08-06``, so a budget on either name covers both
    (but not another snapshot of the same model). Routing prefixes do not count: a budget on
    ``gpt-4o`` covers ``openai/gpt-4o`` (OpenRouter), ``azure/gpt-4o`` (LiteLLM's names) and
    ``openrouter/openai/gpt-4o-2024-08-06``, and a cloud's name for the model counts as the model
    (a budget on ``claude-sonnet-4-5`` covers Bedrock's ``anthropic.claude-sonnet-4-5-20250929-v1:0``,
    its ``us.`` profile and Vertex AI's ``claude-sonnet-4-5@20250929``), so a client cannot step
    outside it by prefixing or renaming the name it sends (SQL: :func:`tokenward.reports.queries.model_condition`).
    """
    return _same_snapshot(model_base(scope), model_base(name))


def _same_snapshot(scope: str, name: str) -> bool:
    return scope == name or SNAPSHOT_SUFFIX.sub("", name) == scope or SNAPSHOT_SUFFIX.sub("", scope) == name


FORECAST_AFTER = 0.1
"""Share of a period that must have gone before a forecast can raise an alert."""


@dataclass(frozen=True, slots=True)
class BudgetStatus:
    """A budget at instant ``at``: spend (USD) in the period, the share of the limit, the forecast."""

    budget: Budget
    start: dt.datetime
    end: dt.datetime
    spent: Decimal
    percent: Decimal
    crossed: tuple[int, ...]
    forecast: Decimal | None
    at: dt.datetime

    @property
    def remaining(self) -> Decimal:
        """USD left before the limit (never negative)."""
        return max(self.budget.limit_usd - self.spent, Decimal(0))

    @property
    def forecast_exceeds(self) -> bool:
        """Whether spend is projected past the limit before the period ends.

        Once :data:`FORECAST_AFTER` of the period has gone; before that, only once half the limit
        is spent (the rate so far then reaches the limit within the time already seen): a burst
        in a month's first hours says little about its end, but an agent that would run out on
        the month's second day must hear of it before then, not never.
        """
        if self.forecast is None or self.forecast <= self.budget.limit_usd:
            return False
        if (self.at - self.start) >= (self.end - self.start) * FORECAST_AFTER:
            return True
        return self.spent * 2 >= self.budget.limit_usd

    @property
    def runs_out_at(self) -> dt.datetime | None:
        """When spend reaches the limit at the period's average rate so far (UTC, to the second).

        ``None`` without a forecast, with nothing spent, or with the limit already reached.
        """
        if self.forecast is None or not 0 < self.spent < self.budget.limit_usd:
            return None
        elapsed = Decimal(round((self.at - self.start).total_seconds(), 6))
        seconds = (elapsed * self.budget.limit_usd / self.spent).quantize(Decimal(1))
        return self.start + dt.timedelta(seconds=int(seconds))


def evaluate(budget: Budget, spent: Decimal, now: dt.datetime) -> BudgetStatus:
    """Where ``budget`` stands at ``now`` with ``spent`` USD in its current period.

    The forecast extends the period's average burn rate so far to its end (calendar periods
    only; ``None`` for ``total`` and ``rolling``, and in the period's first minute).
    """
    start, end = budget.period.window(now)
    percent = (spent / budget.limit_usd * 100).quantize(Decimal("0.01"))
    crossed = tuple(t for t in sorted(budget.thresholds) if spent * 100 >= budget.limit_usd * t)
    forecast = None
    if budget.period.kind in CALENDAR_PERIODS:
        elapsed = (now - start).total_seconds()
        if elapsed >= 60:
            total = (end - start).total_seconds()
            forecast = (spent * Decimal(total) / Decimal(elapsed)).quantize(Decimal("0.000001"))
    return BudgetStatus(budget, start, end, spent, percent, crossed, forecast, now)
