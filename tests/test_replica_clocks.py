"""Replicas whose clocks disagree share one calendar: the database server's (real Postgres, real processes).

One replica's wall clock is shifted past the next UTC midnight (or back before the last one) by
an ``LD_PRELOAD`` shim over libc's ``clock_gettime`` (built here with the C compiler): its host
believes it is tomorrow (or yesterday), in ``time.time()`` and ``datetime.now()`` alike.
Costs as in ``test_replicas.py``: one request costs, and is bounded at, $4.2e-6 (``ONE``); the
daily hard limit is room for 10.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
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

SKEWED_CLOCK = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long skew_s;
static int (*real_clock_gettime)(clockid_t, struct timespec *);

int clock_gettime(clockid_t id, struct timespec *ts) {
    if (!real_clock_gettime) {
        const char *text = getenv("TW_CLOCK_SKEW_S");
        skew_s = text ? atoll(text) : 0;
        real_clock_gettime = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    }
    int result = real_clock_gettime(id, ts);
    if (result == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) ts->tv_sec += skew_s;
    return result;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    int result = clock_gettime(CLOCK_REALTIME, &ts);
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
    return result;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
"""


def skewed_env(tmp_path, skew_s: float) -> dict[str, str]:
    """An environment whose processes read the wall clock ``skew_s`` seconds off (an LD_PRELOAD shim; checked).

    ``time.time()`` and ``datetime.now()`` alike: the shim replaces libc's ``clock_gettime``.
    """
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the clock shim")
    source = tmp_path / "skew.c"
    source.write_text(SKEWED_CLOCK, encoding="utf-8")
    shim = tmp_path / "skew.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(shim), str(source), "-ldl"], check=True)
    env = {"LD_PRELOAD": str(shim), "TW_CLOCK_SKEW_S": str(int(skew_s))}
    probe = subprocess.run(
        [sys.executable, "-c", "import time, datetime; print(time.time(), datetime.datetime.now().timestamp())"],
        env={**os.environ, **env}, text=True, capture_output=True, check=True,
    )
    for value in probe.stdout.split():
        assert abs(float(value) - time.time() - int(skew_s)) < 5
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


def test_a_key_expires_at_the_databases_instant_on_a_replica_whose_clock_is_behind(tmp_path, pg_url, monkeypatch):
    """A key made with ``keys create --expires`` that expired a minute ago by the database is refused
    by a replica whose clock runs an hour behind (before: it served the expired key, 200).
    """
    from click.testing import CliRunner

    from tokenward.proxy.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("UPSTREAM_KEY", "sk-upstream")  # the replica's upstream key: an unexpired key is served
    with CountingUpstream(wait_s=0.0) as upstream:
        procs = replicas(tmp_path, upstream.url, pg_url, "auth: {mode: virtual_keys}\n", count=1,
                         envs={0: skewed_env(tmp_path, -3600)})
        try:
            out = CliRunner().invoke(main, ["keys", "create", "bot", "--expires", "30d", "--db", pg_url],
                                     catch_exceptions=False).output
            key = out.splitlines()[0]
            # the key ran out a minute ago, by the database's clock
            query(pg_url, "UPDATE virtual_keys SET expires_at = now() - interval '1 minute' RETURNING name")

            time.sleep(6)  # the keys are reloaded every 5 s
            reply = httpx.post(f"{procs[0].url}/v1/chat/completions", json=BODY,
                               headers={"authorization": f"Bearer {key}"}, timeout=10)
            assert (reply.status_code, reply.json()["error"]["code"]) == (401, "key_expired")
            assert upstream.received == []
        finally:
            procs[0].stop()
