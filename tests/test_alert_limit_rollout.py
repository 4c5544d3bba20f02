"""A budget's limit changed in the config, rolled out replica by replica: each threshold mailed once per limit.

During the rollout one replica still runs with the old limit ($100), one with the new ($200),
both evaluating the same claims. The new one re-arms the 50 % mailed at $100 (at $200 it is no
longer crossed, and is mailed again once spend crosses it there: README, Budgets and alerts);
the old one must not take that for a threshold never mailed and mail "50 % of $100" again at
each of its evaluations until it is restarted.

A total budget (no forecast alerts). Spend: $55 (55 % of $100, 27.5 % of $200), then $105 (52.5 % of $200).
"""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from tokenward.pricing.settings import BudgetSettings
from tokenward.reports.alerts import Notifier
from tokenward.reports.budget_check import evaluate_and_notify
from tokenward.reports.ledger import DuckLedger, open_ledger
from tokenward.reports.ledger.spend import DuckSpend

from .test_alerts import cost_row, seed, settings_for, smtp  # noqa: F401 - smtp: the fixture


def _budget(limit: int):
    return BudgetSettings(
        name="team", limit_usd=limit, period="total", thresholds=[50], notify=["lead@example.com"]
    ).to_budget()


OLD, NEW = _budget(100), _budget(200)


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
def test_a_replica_still_on_the_old_limit_does_not_mail_a_threshold_the_new_limit_re_armed(
    engine,
    tmp_path,
    smtp,  # noqa: F811
    request,
):
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "55.00")])
    if engine == "sqlite":
        state = DuckLedger(path).state
    else:
        from .test_pg_ledger import pg

        state = pg(tmp_path, request.getfixturevalue("pg_url")).state
    settings = settings_for(port)

    def check(budget, minute: int) -> list[tuple[str, str]]:
        conn = open_ledger(path, read_only=True)
        try:
            at = dt.datetime(2026, 11, 10, 10, minute, tzinfo=dt.UTC)
            sent = asyncio.run(evaluate_and_notify(DuckSpend(conn), state, [budget], settings, Notifier(settings), at))
        finally:
            conn.close()
        return [(a.kind, a.subject) for a, _ in sent]

    assert check(OLD, 0) == [("threshold", "[tokenward] budget team: 55.00% of $100.00 (crossed 50%)")]
    assert check(NEW, 1) == []  # 27.5 %: re-armed for the new limit
    for minute in range(2, 6):  # the two replicas take turns until the old one is restarted
        assert check(OLD if minute % 2 == 0 else NEW, minute) == []
    seed(path, [cost_row("b", "2026-11-10T10:06:00+00:00", "50.00")])  # $105: 52.5 % of $200
    assert check(NEW, 7) == [("threshold", "[tokenward] budget team: 52.50% of $200.00 (crossed 50%)")]
    assert check(NEW, 8) == []
    assert [m["Subject"] for m in inbox.wait_for(2)] == [
        "[tokenward] budget team: 55.00% of $100.00 (crossed 50%)",
        "[tokenward] budget team: 52.50% of $200.00 (crossed 50%)",
    ]
