"""Postgres restarted while a reservation waits in it: the request is served once the server is back, counted once.

Real Postgres (``pg_ctl restart -m fast``: every session ended), a real proxy process. Costs as
in ``test_replicas.py``: one request costs, and is bounded at, $4.2e-6 (``ONE``); the hard limit
is room for 10.
"""

from __future__ import annotations

import threading

import httpx
import psycopg

from .crashkit import CountingUpstream
from .test_replicas import HARD, ONE, query, replicas, wait_until

BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "service_tier": "default"}
CLIENT = {"authorization": "Bearer sk-client"}


def _post(url: str) -> int:
    try:
        return httpx.post(f"{url}/v1/chat/completions", json=BODY, headers=CLIENT, timeout=60).status_code
    except httpx.HTTPError:
        return 0


def test_a_reservation_cut_by_a_postgres_restart_is_made_again_once_it_is_back(tmp_path, pg_cluster, pg_url):
    """The book's row is locked, so the reservation waits in the server; then Postgres restarts.

    Before: the reservation's session was ended by the restart and the request refused, 503
    budget_books_unavailable, though the server was back a second later.
    """
    locker = None
    with CountingUpstream(wait_s=0.0) as upstream:
        (proc,) = replicas(tmp_path, upstream.url, pg_url, HARD, count=1)
        try:
            assert _post(proc.url) == 200
            locker = psycopg.connect(pg_url)
            locker.execute("SELECT 1 FROM budget_books FOR UPDATE")  # a transaction holding the book's row
            statuses: list[int] = []
            thread = threading.Thread(target=lambda: statuses.append(_post(proc.url)))
            thread.start()
            waiting = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                       "AND position('tw_reserve' in query) > 0")
            assert wait_until(lambda: query(pg_url, waiting) == [(1,)], timeout=10)
            pg_cluster.restart()  # ends the locker's session and the reservation's alike
            thread.join(60)
            assert statuses == [200]
            assert len(upstream.received) == 2
            assert wait_until(
                lambda: query(pg_url, "SELECT spent, held FROM budget_books") == [(ONE * 2, 0)], timeout=20
            ), query(pg_url, "SELECT spent, held FROM budget_books")
            assert query(pg_url, "SELECT count(*) FROM budget_holds") == [(0,)]
            assert wait_until(lambda: query(pg_url, "SELECT count(*) FROM requests") == [(2,)], timeout=20)
            assert query(pg_url, "SELECT outcome, count(*), sum(cost_usd) FROM requests GROUP BY 1") == [
                ("ok", 2, ONE * 2)
            ]
        finally:
            if locker is not None:
                locker.close()
            proc.stop()
