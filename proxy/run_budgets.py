"""Budgets made while serving: an agent run's cap, and one budget per user (or key, team...) on first sight.

Both are books in the :class:`~tokenward.proxy.guard.BudgetGuard`, under their budget's name
(:meth:`~tokenward.proxy.guard.BudgetGuard.open_book`), found for each request and row by
:meth:`DynamicBudgets.scope` (registered in the guard's ``scopes``): so a run or a user's
budget is reserved against, settled and reported exactly like a configured one, and only ever
adds a limit to those already in scope.

* **Runs** (:mod:`tokenward.pricing.runs`): :meth:`DynamicBudgets.join` checks a request's
  ``X-Tokenward-Run`` against the caller's policy and opens the run's books on first use
  (a ``total`` budget of the run's ``limit_usd``). A run ends ``ttl`` after its first request;
  its books close once nothing is held there, and for ``horizon_s`` more a request naming it is
  refused as ended. At start, :meth:`DynamicBudgets.load` reads each recent run's first request
  and spend from the ledger (and the write-ahead log), so a run's spend and age survive a
  restart.
* **Templates** (budgets with ``per``): the first request or row with a value of the
  dimension (an ``end_user`` not seen before) opens ``name[value]``, starting from what the
  ledger holds for it in the current period (read at start).
"""

from __future__ import annotations

import datetime as dt
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tokenward.pricing.budgets import Budget, Period
from tokenward.pricing.runs import RunHeader, RunPolicy, RunRefused, run_budget_name
from tokenward.proxy.guard import BudgetGuard, spend_amount

__all__ = ["DynamicBudgets", "Run"]

_TOTAL = Period("total")


@dataclass(slots=True)
class Run:
    """One run: its budget's name, key, cap, and first request and end (epoch seconds)."""

    name: str
    key_id: str
    run_id: str
    limit_usd: Decimal
    created: float
    expires: float
    open: bool = True

    def ended(self, now: float) -> bool:
        """Whether the run's ttl has passed."""
        return now >= self.expires


class DynamicBudgets:
    """The runs and per-value budgets of one proxy.

    Args:
        guard: the budget guard whose books hold them (this registers itself in ``guard.scopes``).
        templates: budgets with ``per`` set (one budget per value of that dimension).
        horizon_s: how long a run is remembered after its first request (at least every policy's
            ``max_ttl``): runs are read back from the ledger this far at start.
        max_per_template: how many budgets one template may make (then new values are refused).
    """

    def __init__(
        self,
        guard: BudgetGuard,
        templates: Sequence[Budget] = (),
        *,
        horizon_s: float = 86400.0,
        max_per_template: int = 100_000,
    ) -> None:
        self.guard = guard
        self.templates = list(templates)
        self.horizon_s = horizon_s
        self.max_per_template = max_per_template
        self._runs: dict[str, Run] = {}
        self._live: dict[str, int] = {}
        self._timers: list[tuple[float, int, str]] = []  # (when, 0 close | 1 forget, run name)
        self._earlier_runs: dict[str, tuple[float, Decimal]] = {}
        self._earlier_values: dict[str, tuple[dt.datetime, Decimal]] = {}
        self._made: dict[str, int] = {t.name: 0 for t in self.templates}
        self.runs_off: str | None = None
        """Why this proxy serves no runs (another proxy holds the ledger's lock), or ``None``."""
        guard.scopes.append(self.scope)

    # -- what is in scope ----------------------------------------------------------------------

    def scope(self, attributes: Mapping[str, Any], now: dt.datetime) -> list[str]:
        """Names of the run and per-value budgets in scope of a request's or row's attributes.

        A template's budget for a value not seen before is opened here (from the spend the
        ledger held for it at start, in the same period).
        """
        names = []
        run = attributes.get("run")
        if run:
            name = run_budget_name(attributes.get("key_id"), run)
            found = self._runs.get(name)
            if found is not None and found.open:
                names.append(name)
        for template in self.templates:
            value = attributes.get(template.per or "")
            if not isinstance(value, str) or not value or not template.matches(attributes):
                continue
            name = f"{template.name}[{value}]"
            if not self.guard.has_book(name):
                self._open_instance(template, value, name, now)
            names.append(name)
        return names

    def _open_instance(self, template: Budget, value: str, name: str, now: dt.datetime) -> None:
        budget = template.instance(value)
        spent = Decimal(0)
        earlier = self._earlier_values.pop(name, None)
        if earlier is not None and earlier[0] == budget.period.window(now)[0]:
            spent = earlier[1]
        self.guard.open_book(budget, now, spent)
        self._made[template.name] = self._made.get(template.name, 0) + 1

    def check_capacity(self, attributes: Mapping[str, Any]) -> None:
        """Refuse a request that would make one budget too many for a template.

        Raises:
            RunRefused: 429 ``budget_capacity`` (the template's ``max_per_template`` budgets exist).
        """
        for template in self.templates:
            value = attributes.get(template.per or "")
            if not isinstance(value, str) or not value or not template.matches(attributes):
                continue
            if self._made.get(template.name, 0) >= self.max_per_template:
                if not self.guard.has_book(f"{template.name}[{value}]"):
                    raise RunRefused(
                        429,
                        f"Budget {template.name!r} already has {self.max_per_template} per-{template.per} budgets: "
                        f"a new {template.per} cannot get one.",
                        "budget_capacity",
                    )

    # -- runs ------------------------------------------------------------------------------------

    def join(
        self, key_id: str | None, principal: str, policy: RunPolicy, header: RunHeader | None, now: dt.datetime
    ) -> str | None:
        """Check a request's run header against ``policy``; the run's id (``None``: in no run).

        The run is created on first use (its books opened, its spend read back after a
        restart); a later request may lower its limit, never raise it.

        Raises:
            RunRefused: what :meth:`RunPolicy.settle` raises; 409 ``run_ended`` (the run's ttl has
                passed) or ``run_limit_raised``; 429 ``too_many_runs`` (``policy.max_active`` live);
                503 ``runs_unavailable`` (another proxy on this ledger serves the runs).
        """
        settled = policy.settle(header)
        if settled is None:
            return None
        if self.runs_off is not None:
            raise RunRefused(503, f"Run budgets are off on this proxy: {self.runs_off}.", "runs_unavailable")
        assert settled.limit_usd is not None and settled.ttl_s is not None
        at = now.timestamp()
        self._expire(at)
        owner = key_id or "anonymous"
        name = run_budget_name(key_id, settled.id)
        run = self._runs.get(name)
        if run is None:
            if self._live.get(owner, 0) >= policy.max_active:
                raise RunRefused(
                    429,
                    f"This key has {policy.max_active} runs live, the most it may ({policy.where}.max_active): "
                    "wait for one to end.",
                    "too_many_runs",
                )
            created, spent = self._earlier_runs.pop(name, (at, Decimal(0)))
            run = Run(name, owner, settled.id, settled.limit_usd, created, created + settled.ttl_s)
            self._runs[name] = run
            heapq.heappush(self._timers, (created + self.horizon_s, 1, name))
            if run.ended(at):
                run.open = False
            else:
                self._live[owner] = self._live.get(owner, 0) + 1
                heapq.heappush(self._timers, (run.expires, 0, name))
                self.guard.open_book(self._budget(run, principal), now, spent)
        if not run.open or run.ended(at):
            ended = dt.datetime.fromtimestamp(run.expires, dt.UTC).isoformat()
            raise RunRefused(409, f"Run {settled.id!r} ended at {ended} (its ttl); start a new run.", "run_ended")
        if settled.limit_usd > run.limit_usd:
            raise RunRefused(
                409,
                f"Run {settled.id!r} has a limit of ${format(run.limit_usd.normalize(), 'f')}: a run's limit can be "
                "lowered, never raised; start a new run for more.",
                "run_limit_raised",
            )
        if settled.limit_usd < run.limit_usd:
            run.limit_usd = settled.limit_usd
            self.guard.open_book(self._budget(run, principal), now)
        return settled.id

    def unknown(self, key_id: str | None, run_id: str) -> bool:
        """Whether this proxy knows nothing of run ``run_id`` of key ``key_id`` yet (not served, not in the ledger)."""
        name = run_budget_name(key_id, run_id)
        return name not in self._runs and name not in self._earlier_runs

    def started_elsewhere(self, key_id: str | None, run_id: str, first: dt.datetime) -> None:
        """Count run ``run_id``'s ``ttl`` from ``first``, its first request on any replica (shared books)."""
        name = run_budget_name(key_id, run_id)
        if name not in self._runs:
            self._earlier_runs.setdefault(name, (first.timestamp(), Decimal(0)))

    def _budget(self, run: Run, principal: str) -> Budget:
        return Budget(
            run.name,
            run.limit_usd,
            scope=(("key", principal), ("run", run.run_id)),
            period=_TOTAL,
            thresholds=(),
            action="block",
            group="run",
        )

    def _expire(self, at: float) -> None:
        """Close the books of runs past their ttl (once nothing is held), forget old ones."""
        timers = self._timers
        while timers and timers[0][0] <= at:
            when, kind, name = heapq.heappop(timers)
            run = self._runs.get(name)
            if run is None:
                continue
            if kind == 1:
                if run.open:  # still held: look again later
                    heapq.heappush(timers, (at + 60, 1, name))
                else:
                    del self._runs[name]
            elif run.open:
                if self.guard.close_book(name):
                    run.open = False
                    self._live[run.key_id] -= 1
                else:
                    heapq.heappush(timers, (at + 1, 0, name))

    def run_of(self, key_id: str | None, run_id: str) -> Run | None:
        """The run ``run_id`` of key ``key_id`` as this proxy knows it (``None``: not known)."""
        return self._runs.get(run_budget_name(key_id, run_id))

    # -- start -----------------------------------------------------------------------------------

    def load(self, source: Any, now: dt.datetime, unflushed: Iterable[Mapping[str, Any]] = ()) -> None:
        """Read back recent runs and the templates' spend in their current periods, at start.

        Call before the guard's own ``load`` (which counts the ``unflushed`` rows against the
        templates' budgets as it opens them).

        Args:
            source: a spend source on the ledger (``DuckSpend``, or ``PgSpend`` on Postgres).
            now: the instant the books open at.
            unflushed: rows still in the write-ahead log (their run spend is counted here).
        """
        since = now - dt.timedelta(seconds=self.horizon_s)
        earlier: dict[str, tuple[float, Decimal]] = {}
        for key_id, run_id, first, spent in source.run_spend(since):
            earlier[run_budget_name(key_id, run_id)] = (first.timestamp(), spent)
        for row in unflushed:
            amount = spend_amount(row)
            if not row.get("run_id"):
                continue
            name = run_budget_name(row.get("key_id"), row["run_id"])
            first, spent = earlier.get(name, (row["started_at"], Decimal(0)))
            earlier[name] = (min(first, row["started_at"]), spent + (amount or 0))
        self._earlier_runs = earlier
        values: dict[str, tuple[dt.datetime, Decimal]] = {}
        for template in self.templates:
            start, end = template.period.window(now)
            assert template.per is not None
            for value, spent in source.spend_by(template, start, end, template.per):
                values[f"{template.name}[{value}]"] = (start, spent)
        self._earlier_values = values
