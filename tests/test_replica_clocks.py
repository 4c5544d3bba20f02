"""Replicas whose clocks disagree share one calendar: the database server's (real Postgres, real processes).

One replica's ``time.time`` is shifted past the next UTC midnight (or back before the last one)
by a ``sitecustomize`` on its ``PYTHONPATH``: its host believes it is tomorrow (or yesterday).
Costs as in ``test_replicas.py``: one request costs, and is bounded at, $4.2e-6 (``ONE``); the
daily hard limit is room for 10.
"""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from decimal import Decimal

import httpx
import pytest

from .crashkit import CountingUpstream
from .test_replicas import HARD, ONE, query, replicas

BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "service_tier": "default"}
CLIENT = {"authorization": "Bearer sk-client"}

SKEWED_CLOCK = """
import time

_real = time.time
time.time = lambda: _real() + {skew_s}  # this host's clock is {skew_s} s off
"""


def skewed_env(tmp_path, skew_s: float) -> dict[str, str]:
    """An environment whose Python processes read ``time.time()`` ``skew_s`` seconds off (checked)."""
    folder = tmp_path / "skewed"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SKEWED_CLOCK.format(skew_s=skew_s), encoding="utf-8")
    env = {"PYTHONPATH": str(folder)}
    probe = subprocess.run([sys.executable, "-c", "import time; print(time.time())"], env=env, text=True,
                           capture_output=True, check=True)
    assert abs(float(probe.stdout) - time.time() - skew_s) < 5
    return env


def _post(url: str) -> int:
    return httpx.post(f"{url}/v1/chat/completions", json=BODY, headers=CLIENT, timeout=30).status_code


@pytest.mark.parametrize("direction", ["ahead", "behind"])
def test_a_replica_whose_clock_is_a_day_off_spends_in_the_databases_day(tmp_path, pg_url, direction):
    """The day's room for 10 is spent through a replica with a right clock; one 10 minutes into tomorrow
    (or yesterday) by its own clock refuses the 11th as well.

    Before: it reserved in its own day's book (empty), served 3 more, and wrote their rows into
    that day: 13 requests billed today against room for 10, the ledger showing 10.
    """
    now = dt.datetime.now(dt.UTC)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if direction == "ahead":
        skew = (midnight + dt.timedelta(days=1) - now).total_seconds() + 600
    else:
        skew = -((now - midnight).total_seconds() + 600)
    with CountingUpstream(wait_s=0.0) as upstream:
        procs = replicas(tmp_path, upstream.url, pg_url, HARD, count=2, envs={1: skewed_env(tmp_path, skew)})
        try:
            assert [_post(procs[0].url) for _ in range(10)] == [200] * 10
            assert [_post(procs[1].url) for _ in range(3)] == [429] * 3
            assert len(upstream.received) == 10
            today = query(pg_url, "SELECT date_trunc('day', now())")[0][0]
            assert query(pg_url, "SELECT period_start, spent + held FROM budget_books") == [(today, ONE * 10)]
            for proc in procs:
                proc.stop()
            # every row, the skewed replica's refusals included, is dated by the database's clock
            rows = query(pg_url, "SELECT outcome, count(*), min(started_at) >= date_trunc('day', now()), "
                                 "max(abs(extract(epoch FROM now() - started_at))) < 300 FROM requests GROUP BY 1 "
                                 "ORDER BY 1")
            assert rows == [("ok", 10, True, True), ("rejected", 3, True, True)]
            spent = query(pg_url, "SELECT sum(cost_usd) FROM requests WHERE started_at >= date_trunc('day', now())")
            assert spent == [(Decimal("0.000042000000"),)]
        finally:
            for proc in procs:
                if proc.process is not None and proc.process.poll() is None:
                    proc.stop()
