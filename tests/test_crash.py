"""kill -9 under load: every completed request keeps its row, nothing doubles, budgets survive the restart.

Real processes: a counting upstream (in this process), ``tokenward serve`` as a subprocess killed
with SIGKILL, 30 client threads sending streamed and non-streamed requests.
"""

from __future__ import annotations

import collections
import socket
import time
from decimal import Decimal

from .crashkit import COMPLETION_TOKENS, PROMPT_TOKENS, CountingUpstream, Load, ProxyProcess, ledger_rows, write_config

# gpt-4o-mini at openai: $0.15 per 1M input tokens, $0.60 per 1M output tokens (pricing/catalog/default.yaml)
COST = (PROMPT_TOKENS * Decimal("0.15") + COMPLETION_TOKENS * Decimal("0.60")) / 1_000_000  # $0.0000042


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigkill_under_load_loses_no_completed_request_and_doubles_none(tmp_path):
    port = free_port()
    with CountingUpstream(wait_s=0.03) as upstream:
        proxy = ProxyProcess(write_config(tmp_path, upstream.url, port), port).start()
        load = Load(proxy.url, clients=30).start()
        kills = 0
        try:
            for _ in range(3):  # three kills, each after a second of load, each followed by a restart
                time.sleep(1.0)
                proxy.kill()
                kills += 1
                time.sleep(0.3)
                proxy.start()
            time.sleep(0.5)
        finally:
            load.stop()
            proxy.stop()  # graceful: the last rows go into the ledger
    rows = ledger_rows(tmp_path / "ledger.duckdb")
    by_client = collections.Counter(r["client_request_id"] for r in rows)
    assert kills == 3 and len(load.completed) > 100
    doubled = [rid for rid, count in by_client.items() if count > 1]
    assert doubled == []
    missing = [rid for rid in load.completed if rid not in by_client]
    assert missing == []  # every request whose reply ended at the client has its row
    unseen = [rid for rid in upstream.received if rid not in by_client]
    assert unseen == []  # every request the provider saw (and bills) has its row
    row_of = {r["client_request_id"]: r for r in rows}
    for rid in load.completed:
        row = row_of[rid]
        assert row["usage_source"] == "reported", row
        assert (row["outcome"], row["input_tokens"], row["output_tokens"], row["cost_usd"]) == (
            "ok",
            PROMPT_TOKENS,
            COMPLETION_TOKENS,
            COST,
        )
    interrupted = [r for r in rows if r["outcome"] == "interrupted"]
    print(
        f"\n3 kills: {len(load.completed)} completed, {len(upstream.received)} reached the upstream, "
        f"{len(rows)} rows ({len(interrupted)} interrupted), 0 missing, 0 doubled"
    )
    assert interrupted, "a kill under this load always finds requests in flight"
    for row in interrupted:
        assert row["client_request_id"] not in load.completed
        if row["client_request_id"] in upstream.received:
            assert (row["price_status"], row["cost_usd"]) == ("usage_unknown", None)  # maybe billed: never $0
        else:
            assert row["price_status"] in ("not_billed", "usage_unknown")


BUDGET = """
budgets:
  - {name: cap, limit_usd: 0.0002, period: total, action: block}
guard: {default_max_output_tokens: 5}
"""


def test_a_hard_limit_holds_across_kill_and_restart(tmp_path):
    # worst case per request: 8 input tokens x $0.15 + 5 output x $0.60 per 1M = $0.0000042, what each costs:
    # the $0.0002 cap has room for 47 of them, whatever the kill does
    port = free_port()
    with CountingUpstream(wait_s=0.3) as upstream:  # slow: many requests are at the upstream at the kill
        proxy = ProxyProcess(write_config(tmp_path, upstream.url, port, BUDGET), port).start()
        load = Load(proxy.url, clients=24).start()
        try:
            deadline = time.monotonic() + 20
            while len(upstream.received) < 10 and time.monotonic() < deadline:
                time.sleep(0.01)  # kill while requests are at the (slow) upstream, holding reservations
            proxy.kill()
            in_flight_at_kill = len(upstream.received)
            time.sleep(0.2)
            proxy.start()
            deadline = time.monotonic() + 20
            while len(load.refused) < 20 and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            load.stop()
            proxy.stop()
    assert in_flight_at_kill > 0 and len(load.refused) >= 20
    # the provider bills every request it received; that must stay within the cap
    billed = len(upstream.received) * COST
    assert billed <= Decimal("0.0002"), (len(upstream.received), billed)
    rows = ledger_rows(tmp_path / "ledger.duckdb")
    held = [r for r in rows if r["price_status"] == "usage_unknown"]
    assert held and all(r["reserved_usd"] > 0 for r in held)  # counted at their worst case until reconciled
    counted = sum((r["cost_usd"] or Decimal(0)) for r in rows) + sum(r["reserved_usd"] for r in held)
    assert counted <= Decimal("0.0002")
