"""A hard limit across replicas when one is killed with requests at the upstream (real Postgres, SIGKILL).

Costs as in ``test_replicas.py``: one request costs, and is bounded at, $4.2e-6 (``ONE``); the
hard limit is room for 10.
"""

from __future__ import annotations

import threading

import httpx

from tokenward.reports.ledger.pg_books import reconcile
from tokenward.reports.ledger.pg_pool import SyncPool

from .crashkit import CountingUpstream
from .test_replicas import HARD, ONE, query, replicas, wait_until

BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "service_tier": "default"}
CLIENT = {"authorization": "Bearer sk-client"}


def test_a_replica_killed_with_requests_at_the_upstream_leaves_their_worst_case_counted(tmp_path, pg_url):
    """5 requests are at the upstream (which bills them) when their replica is SIGKILLed.

    Its lease ends 3 s later; its holds must not become room for the other replica: the
    provider bills those 5 requests whatever happens to the proxy. Before: the holds were given
    back, the other replica admitted 10 more, 15 x $4.2e-6 = $6.3e-5 billed against $4.2e-5.
    """
    with CountingUpstream(wait_s=0.01) as upstream:
        procs = replicas(tmp_path, upstream.url, pg_url, HARD, count=2, lease_s=3)
        try:
            slow = [
                threading.Thread(target=_post, args=(procs[0].url, {"x-test-wait": "8"}), daemon=True)
                for _ in range(5)
            ]
            for thread in slow:
                thread.start()
            assert wait_until(lambda: len(upstream.received) == 5, timeout=10)
            assert query(pg_url, "SELECT spent, held FROM budget_books") == [(0, ONE * 5)]
            procs[0].kill()
            # the next renewal after the lease (3 s) ends the dead replica's holds: they become spend
            assert wait_until(lambda: query(pg_url, "SELECT spent, held FROM budget_books") == [(ONE * 5, 0)],
                              timeout=10), query(pg_url, "SELECT spent, held FROM budget_books")
            statuses = [_post(procs[1].url, {}) for _ in range(8)]
            assert statuses == [200] * 5 + [429] * 3
            assert len(upstream.received) == 10  # billed: exactly the limit
            procs[0].start()  # its log is recovered: the 5 rows arrive (usage_unknown, at their worst case)
            assert wait_until(lambda: query(pg_url, "SELECT count(*) FROM requests WHERE outcome <> 'rejected'")
                              == [(10,)], timeout=20)
            rows = query(pg_url, "SELECT price_status, count(*), sum(coalesce(cost_usd, reserved_usd)) FROM requests "
                                 "WHERE outcome <> 'rejected' GROUP BY 1 ORDER BY 1")
            assert rows == [("priced", 5, ONE * 5), ("usage_unknown", 5, ONE * 5)]
            # reconciled from the ledger: the recovered rows replace the dead holds' spend, counted once
            pool = SyncPool(pg_url, 1)
            try:
                budget = next(b for b in _budgets(HARD))
                start, end = budget.period.window(_now())
                assert reconcile(pool, [(budget, ("hard", start), start, end)]) == 1
            finally:
                pool.close()
            assert query(pg_url, "SELECT spent, held FROM budget_books") == [(ONE * 10, 0)]
            assert query(pg_url, "SELECT count(*) FROM budget_settled") == [(0,)]
        finally:
            for proc in procs:
                if proc.process is not None and proc.process.poll() is None:
                    proc.stop()


def _post(url: str, headers: dict[str, str]) -> int:
    try:
        return httpx.post(f"{url}/v1/chat/completions", json=BODY, headers={**CLIENT, **headers}, timeout=30).status_code
    except httpx.HTTPError:
        return 0  # its replica was killed


def _budgets(text: str):
    import yaml

    from tokenward.pricing.settings import BudgetSettings

    return [BudgetSettings(**entry).to_budget() for entry in yaml.safe_load(text)["budgets"]]


def _now():
    import datetime as dt

    return dt.datetime.now(dt.UTC)
