"""A Postgres connection whose path dies silently (no FIN, no RST) costs no request and counts nothing twice.

A real TCP relay (``tests/tcp_relay.py``) sits between the proxy and a real Postgres; freezing it
drops every byte on the connections the proxy has open, as a NAT or firewall that forgot them
would, while new connections pass. Costs as in ``test_replicas.py``: one request costs, and is
bounded at, $4.2e-6 (``ONE``); the hard limit is room for 10.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import httpx

from .crashkit import CountingUpstream
from .tcp_relay import Relay
from .test_replicas import HARD, ONE, query, replicas, wait_until

BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "service_tier": "default"}
CLIENT = {"authorization": "Bearer sk-client"}


def _through(relay: Relay, url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.username}@127.0.0.1:{relay.port}"))


def _post(url: str) -> tuple[int, float]:
    began = time.monotonic()
    try:
        status = httpx.post(f"{url}/v1/chat/completions", json=BODY, headers=CLIENT, timeout=30).status_code
    except httpx.HTTPError:
        status = 0
    return status, time.monotonic() - began


def test_a_silently_dropped_connection_costs_no_request_and_counts_once(tmp_path, pg_url):
    """After the freeze, the next reservation finds its connection dead within ~3 s and is made again.

    Before: whatever met a dead connection waited for a reply for ever: a reservation (its
    client gave up after 30 s), the flush of the rows (they never reached the ledger, and the
    proxy could not stop), a settlement, the lease renewal.
    """
    relay = Relay(urlsplit(pg_url).port)
    try:
        with CountingUpstream(wait_s=0.0) as upstream:
            (proc,) = replicas(tmp_path, upstream.url, _through(relay, pg_url), HARD, count=1)
            try:
                with ThreadPoolExecutor(4) as pool:  # 4 at once: the books' pool holds 4 connections
                    assert [status for status, _ in pool.map(_post, [proc.url] * 4)] == [200] * 4
                assert relay.freeze() >= 3  # the books' pool and the ledger's: every open connection
                after = [_post(proc.url) for _ in range(3)]
                assert [status for status, _ in after] == [200] * 3, after
                assert max(seconds for _, seconds in after) < 15, after
                assert len(upstream.received) == 7
                # the rows reach the ledger, the settlements the books: each once
                assert wait_until(lambda: query(pg_url, "SELECT count(*) FROM requests") == [(7,)], timeout=30)
                assert wait_until(
                    lambda: query(pg_url, "SELECT spent, held FROM budget_books") == [(ONE * 7, 0)], timeout=30
                ), query(pg_url, "SELECT spent, held FROM budget_books")
                assert query(pg_url, "SELECT count(*) FROM budget_holds") == [(0,)]
                assert query(pg_url, "SELECT outcome, count(*), sum(cost_usd) FROM requests GROUP BY 1") == [
                    ("ok", 7, ONE * 7)
                ]
                # three more fit the room for 10, the fourth is refused: nothing was held or counted twice
                assert [_post(proc.url)[0] for _ in range(4)] == [200] * 3 + [429]
                health = httpx.get(f"{proc.url}/healthz", timeout=5).json()
                assert health["status"] == "ok", health
                assert "sent again on a new connection" in (proc.config.parent / "proxy.log").read_text()  # a reservation met a dead connection
            finally:
                proc.stop()
    finally:
        relay.close()
