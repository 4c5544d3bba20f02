"""Three real proxy processes on one Postgres ledger: one hard limit, no lost row, one mail, a database outage.

Each replica is ``tokenward serve`` in its own process with its own write-ahead log directory;
they share only the database. Skipped cleanly when Postgres is not installed.

Costs (gpt-4o-mini, $0.15 in / $0.60 out per 1M tokens): the counting upstream bills 8 tokens in
(what the guard counts for "hi") and 5 out, so one request costs 8 x 0.15 + 5 x 0.60 = $4.2e-6,
and with ``max_tokens: 5`` its worst case is the same $4.2e-6 (the guard's input margins off: input
counted exactly, and the standard tier pinned by ``service_tier: default``: unpinned, a request is
bounded at the dearest tier, priority's $0.25 / $1.00): room for 10 is $4.2e-5.
"""

from __future__ import annotations

import asyncio
import socket
import time
from decimal import Decimal
from pathlib import Path

import httpx
import psycopg
from aiosmtpd.controller import Controller

from .crashkit import COMPLETION_TOKENS, PROMPT_TOKENS, CountingUpstream, Load, ProxyProcess
from .test_alerts import Inbox

ONE = Decimal("0.15") * PROMPT_TOKENS / 10**6 + Decimal("0.60") * COMPLETION_TOKENS / 10**6
assert ONE == Decimal("0.0000042")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replicas(
    tmp_path: Path,
    upstream: str,
    url: str,
    extra: str,
    count: int = 3,
    lease_s: float = 15,
    envs: dict[int, dict[str, str]] | None = None,
) -> list[ProxyProcess]:
    procs = []
    for number in range(count):
        directory = tmp_path / f"replica{number}"
        directory.mkdir()
        port = free_port()
        config = directory / "tokenward.yaml"
        config.write_text(
            "upstreams:\n"
            f"  - {{name: openai, base_url: '{upstream}', default: true, provider: openai, api_key_env: UPSTREAM_KEY}}\n"
            f"server: {{port: {port}, drain_after_disconnect_s: 0}}\n"
            f"ledger: {{url: '{url}', spool_dir: spool, flush_interval_s: 0.5, lease_s: {lease_s}}}\n"
            "guard: {input_margin: 1, input_margin_tokens: 0}\n" + extra  # count input exactly, as written above
        )
        procs.append(ProxyProcess(config, port, (envs or {}).get(number)))
    for proc in procs:
        proc.start()
    return procs


def query(url: str, sql: str, params: list | None = None) -> list[tuple]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql, params or []).fetchall()


def wait_until(check, timeout: float = 20.0, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(step)
    return check()


HARD = f"budgets:\n  - {{name: hard, limit_usd: {ONE * 10}, period: day, action: block}}\n"


def test_100_concurrent_requests_through_3_replicas_against_room_for_10(tmp_path, pg_url):
    with CountingUpstream(wait_s=0.3) as upstream:
        procs = replicas(tmp_path, upstream.url, pg_url, HARD)
        try:

            async def send_all() -> list[int]:
                body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "service_tier": "default"}
                async with httpx.AsyncClient(timeout=30) as client:
                    replies = await asyncio.gather(
                        *(
                            client.post(f"{procs[i % 3].url}/v1/chat/completions", json=body,
                                        headers={"authorization": "Bearer sk-client"})
                            for i in range(100)
                        )
                    )
                return [r.status_code for r in replies]

            statuses = asyncio.run(send_all())
            assert statuses.count(200) == 10 and statuses.count(429) == 90
            assert len(upstream.received) == 10
            rows = wait_until(lambda: query(pg_url, "SELECT count(*) FROM requests")[0][0] == 100 and query(
                pg_url, "SELECT outcome, count(*), sum(cost_usd) FROM requests GROUP BY 1 ORDER BY 1"))
            spent = {outcome: (n, cost) for outcome, n, cost in rows}
            assert spent["ok"] == (10, ONE * 10)  # recorded spend <= limit: exactly the limit
            assert spent["rejected"][0] == 90
            books = query(pg_url, "SELECT spent, held FROM budget_books WHERE book = 'hard'")
            assert books == [(ONE * 10, 0)]
        finally:
            for proc in procs:
                proc.stop()


def test_sigkill_of_one_replica_under_load_loses_no_row_and_its_holds_expire(tmp_path, pg_url):
    budget = "budgets:\n  - {name: hard, limit_usd: 1000, period: day, action: block}\n"
    with CountingUpstream(wait_s=0.2) as upstream:
        procs = replicas(tmp_path, upstream.url, pg_url, budget, lease_s=3)
        loads = [Load(proc.url, clients=6, headers={"x-test-wait": "0.2"}).start() for proc in procs]
        try:
            time.sleep(2.0)
            killed_at = time.monotonic()
            procs[0].kill()  # SIGKILL with requests in flight and reservations held
            time.sleep(1.0)
        finally:
            for load in loads:
                load.stop()
        # the live replicas' own holds are settled; the dead one's go when its lease (3 s) ends
        held = wait_until(lambda: query(pg_url, "SELECT held FROM budget_books WHERE book = 'hard'") == [(0,)],
                          timeout=10)
        assert held, query(pg_url, "SELECT * FROM budget_books")
        assert time.monotonic() - killed_at < 3 + 3 + 2  # lease + one renewal period + slack
        procs[0].start()  # the restarted replica recovers its log from its spool directory
        try:
            completed = {rid for load in loads for rid in load.completed}
            assert len(completed) > 10

            def rows() -> dict[str, list[tuple]]:
                found: dict[str, list[tuple]] = {}
                for client_id, status, outcome in query(
                    pg_url, "SELECT client_request_id, price_status, outcome FROM requests WHERE row_kind = 'request'"
                ):
                    found.setdefault(client_id, []).append((status, outcome))
                return found

            assert wait_until(lambda: completed <= set(rows())), "a completed request has no row"
            found = rows()
            assert [rid for rid, got in found.items() if len(got) > 1] == []  # none doubled
            assert all(found[rid] == [("priced", "ok")] for rid in completed)
            # every request the upstream saw has its row: completed, or usage_unknown with its reservation kept
            seen = {r for r in upstream.received if r}
            assert seen <= set(found)
            assert {found[rid][0][0] for rid in seen} <= {"priced", "usage_unknown"}
        finally:
            for proc in procs:
                proc.stop()


def test_a_threshold_crossed_through_3_replicas_is_mailed_once(tmp_path, pg_url):
    inbox = Inbox()
    smtp = Controller(inbox, hostname="127.0.0.1", port=free_port())
    smtp.start()
    extra = (
        f"budgets:\n  - {{name: shared, limit_usd: {ONE * 10}, period: total, thresholds: [50], "
        "notify: [ops@example.com]}\n"
        "alerts:\n  evaluate_every_s: 1\n  retries: 0\n"
        f"  smtp: {{host: 127.0.0.1, port: {smtp.port}, security: none, sender: tokenward@test}}\n"
    )
    with CountingUpstream(wait_s=0.01) as upstream:
        procs = replicas(tmp_path, upstream.url, pg_url, extra)
        try:
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "service_tier": "default"}
            for i in range(6):  # 6 x $4.2e-6 = 60 % of the limit, two requests per replica
                reply = httpx.post(f"{procs[i % 3].url}/v1/chat/completions", json=body,
                                   headers={"authorization": "Bearer sk-client"}, timeout=10)
                assert reply.status_code == 200
            assert wait_until(lambda: inbox.messages, timeout=20), "no alert mail"
            time.sleep(4)  # several more checks on every replica
            assert len(inbox.messages) == 1, [m["subject"] for m in inbox.messages]
            assert "50" in inbox.messages[0]["subject"] and "shared" in inbox.messages[0]["subject"]
            claims = query(pg_url, "SELECT budget, kind, threshold, status FROM alert_claims")
            assert claims == [("shared", "threshold", 50, "sent")]
        finally:
            for proc in procs:
                proc.stop()
            smtp.stop()


def test_database_down_requests_rows_and_budgets(tmp_path, pg_cluster):
    """Postgres stops: unbudgeted requests go on and their rows wait in the log; hard budgets fail closed (503)."""
    import uuid

    url = pg_cluster.create_database(f"t_{uuid.uuid4().hex[:12]}")
    extra = "budgets:\n  - {name: hard, limit_usd: 10, period: day, action: block, scope: {model: gpt-4o-mini}}\n"
    with CountingUpstream(wait_s=0.01) as upstream:
        (proc,) = replicas(tmp_path, upstream.url, url, extra, count=1)
        try:
            headers = {"authorization": "Bearer sk-client"}

            def send(model: str) -> httpx.Response:
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "service_tier": "default"}
                return httpx.post(f"{proc.url}/v1/chat/completions", json=body, headers=headers, timeout=15)

            assert send("gpt-4o-mini").status_code == 200
            pg_cluster.halt()
            try:
                free = send("gpt-4o")  # no blocking budget in scope: served, its row in the log
                assert free.status_code == 200
                capped = send("gpt-4o-mini")  # its hard budget's books are out of reach: refused
                assert capped.status_code == 503
                assert capped.json()["error"]["code"] == "budget_books_unavailable"
                time.sleep(1.5)
                health = httpx.get(f"{proc.url}/healthz", timeout=5).json()
                assert health["problem"] == "ledger_error" and health["spool_rows"] >= 2
            finally:
                pg_cluster.resume()
            # back: the log drains into the ledger, budgets work again
            assert wait_until(lambda: query(url, "SELECT count(*) FROM requests")[0][0] == 3, timeout=20)
            statuses = dict(query(url, "SELECT requested_model || ':' || http_status, count(*) FROM requests "
                                       "GROUP BY 1"))
            assert statuses == {"gpt-4o-mini:200": 1, "gpt-4o:200": 1, "gpt-4o-mini:503": 1}
            assert wait_until(lambda: send("gpt-4o-mini").status_code == 200, timeout=10)
        finally:
            proc.stop()


def test_a_key_created_or_revoked_from_the_cli_works_on_every_replica_within_5_s(tmp_path, pg_url, monkeypatch):
    from click.testing import CliRunner

    from tokenward.proxy.cli import main

    monkeypatch.setenv("UPSTREAM_KEY", "sk-upstream")
    monkeypatch.setenv("HOME", str(tmp_path))
    with CountingUpstream(wait_s=0.01) as upstream:
        procs = replicas(tmp_path, upstream.url, pg_url, "auth: {mode: virtual_keys}\n", count=2)
        try:
            runner = CliRunner()
            key = runner.invoke(main, ["keys", "create", "bot", "--db", pg_url], catch_exceptions=False).output
            key = key.splitlines()[0]
            created = time.monotonic()
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "service_tier": "default"}

            def status(proc: ProxyProcess) -> int:
                return httpx.post(f"{proc.url}/v1/chat/completions", json=body,
                                  headers={"authorization": f"Bearer {key}"}, timeout=10).status_code

            assert wait_until(lambda: all(status(p) == 200 for p in procs), timeout=8)
            assert time.monotonic() - created < 5 + 1.5  # the reload period, and the time to ask
            runner.invoke(main, ["keys", "revoke", "bot", "--db", pg_url], catch_exceptions=False)
            revoked = time.monotonic()
            assert wait_until(lambda: all(status(p) == 401 for p in procs), timeout=8)
            assert time.monotonic() - revoked < 5 + 1.5
        finally:
            for proc in procs:
                proc.stop()


def test_per_user_and_run_budgets_hold_across_2_replicas(tmp_path, pg_url):
    """Budgets made while serving are shared books too: a user's and a run's limit hold across replicas.

    ``per-user`` gives each end user room for 3 requests a day (3 x $4.2e-6); a run asks for room for
    2. Twelve concurrent requests per user, and eight in the run, spread over both replicas: exactly
    3 per user and 2 in the run are served, and the books in Postgres say so.
    """
    extra = f"budgets:\n  - {{name: per-user, per: end_user, limit_usd: {ONE * 3}, period: day, action: block}}\n"
    with CountingUpstream(wait_s=0.3) as upstream:
        procs = replicas(tmp_path, upstream.url, pg_url, extra, count=2)
        try:
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "service_tier": "default"}

            async def send_all() -> list[tuple[str, int]]:
                sends = []
                async with httpx.AsyncClient(timeout=30) as client:
                    for i in range(24):
                        user = "alice" if i % 2 else "bob"
                        headers = {"authorization": "Bearer sk-client", "x-tokenward-user": user}
                        sends.append((user, client.post(f"{procs[i % 2].url}/v1/chat/completions", json=body,
                                                         headers=headers)))
                    for i in range(8):
                        headers = {"authorization": "Bearer sk-client", "x-tokenward-user": f"runner{i}",
                                   "x-tokenward-run": f"id=task-1; limit_usd={ONE * 2}; ttl=1h"}
                        sends.append(("run", client.post(f"{procs[i % 2].url}/v1/chat/completions", json=body,
                                                          headers=headers)))
                    replies = await asyncio.gather(*(reply for _, reply in sends))
                return [(who, r.status_code) for (who, _), r in zip(sends, replies, strict=True)]

            results = asyncio.run(send_all())
            served = {who: sum(1 for w, status in results if w == who and status == 200) for who in ("alice", "bob", "run")}
            assert served == {"alice": 3, "bob": 3, "run": 2}, results
            assert sorted({status for _, status in results}) == [200, 429]
            assert len(upstream.received) == 8
            assert wait_until(lambda: query(pg_url, "SELECT count(*) FROM requests")[0][0] == 32)
            books = dict(query(pg_url, "SELECT book, spent FROM budget_books WHERE held = 0 AND spent > 0"))
            run_book = [name for name in books if "task-1" in name]
            assert len(run_book) == 1 and books[run_book[0]] == ONE * 2
            assert books["per-user[alice]"] == ONE * 3 and books["per-user[bob]"] == ONE * 3
            assert query(pg_url, "SELECT sum(cost_usd) FROM requests WHERE run_id = 'task-1'") == [(ONE * 2,)]
        finally:
            for proc in procs:
                proc.stop()


def test_a_runs_ttl_is_one_clock_for_every_replica(tmp_path, pg_url):
    """A run first seen on replica 0 ends at its ttl on replica 1 too, however late replica 1 first sees it."""
    with CountingUpstream(wait_s=0.01) as upstream:
        procs = replicas(tmp_path, upstream.url, pg_url, "", count=2)
        try:
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                    "service_tier": "default"}
            headers = {"authorization": "Bearer sk-client", "x-tokenward-run": "id=task-9; limit_usd=1; ttl=4s"}

            def send(proc: ProxyProcess) -> httpx.Response:
                return httpx.post(f"{proc.url}/v1/chat/completions", json=body, headers=headers, timeout=10)

            first = time.monotonic()
            assert send(procs[0]).status_code == 200
            time.sleep(2.5)
            assert send(procs[1]).status_code == 200  # replica 1's first sight of the run, 2.5 s into it
            time.sleep(max(0.0, first + 4.5 - time.monotonic()))
            ended = send(procs[1])  # 4.5 s after the run's first request: over on every replica
            assert ended.status_code == 409 and ended.json()["error"]["code"] == "run_ended"
            assert send(procs[0]).status_code == 409
            assert [name for (name,) in query(pg_url, "SELECT name FROM budget_runs")] == [
                name for (name,) in query(pg_url, "SELECT book FROM budget_books WHERE starts_with(book, 'run:')")
            ]
        finally:
            for proc in procs:
                proc.stop()


def test_a_budget_that_does_not_block_counts_every_replicas_rows(tmp_path, pg_url):
    # kept in each replica's memory (no shared book: nothing to reserve), read back from the ledger
    # every LOCAL_REFRESH_S: 3 requests on one replica and 2 on the other are 5 x $4.2e-6 on both
    extra = f"budgets:\n  - {{name: watch, limit_usd: {ONE * 100}, period: day, thresholds: [50]}}\n"
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    auth = {"authorization": "Bearer sk-client"}
    with CountingUpstream(wait_s=0.01) as upstream:
        procs = replicas(tmp_path, upstream.url, pg_url, extra, count=2)
        try:
            for i in range(5):
                reply = httpx.post(f"{procs[i % 2].url}/v1/chat/completions", json=body, headers=auth, timeout=10)
                assert reply.status_code == 200

            def spent() -> list[Decimal]:
                views = [httpx.get(f"{p.url}/v1/tokenward/budget", headers=auth, timeout=10).json() for p in procs]
                return [Decimal(b["spent_usd"]) for view in views for b in view["budgets"] if b["name"] == "watch"]

            assert spent() != [ONE * 5] * 2  # each replica has counted only its own rows so far
            assert wait_until(lambda: spent() == [Decimal("0.000021")] * 2, timeout=30), spent()
        finally:
            for proc in procs:
                proc.stop()
