"""The mover child: a serving proxy never loads DuckDB, and no kill of the proxy or its mover loses or doubles a row.

Real processes and signals: ``tokenward serve`` as a subprocess, its mover child
(``python -m tokenward.reports.ledger.mover``) found in ``/proc`` and killed with SIGKILL, a real
DuckDB file read back here.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import threading
import time
from decimal import Decimal
from functools import partial
from pathlib import Path

import duckdb
import httpx
import pytest

from tokenward.reports.ledger import DuckLedger, WriteAheadLog
from tokenward.reports.ledger.mover import MoverDied
from tokenward.reports.ledger.wal import encode_row

from .crashkit import CountingUpstream, Load, ProxyProcess, children, ledger_rows, maps_duckdb, write_config
from .test_crash import COST, free_port
from .test_ledger import make_row


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _dead(pid: int) -> bool:
    return not _alive(pid)


def _wait_for(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_a_mover_killed_mid_move_leaves_each_row_once(tmp_path):
    # 40 segments of 300 rows, each $0.000001234567: the kill lands after the first segments were
    # committed and removed and before the last; the next move (a new child) inserts the rest, and
    # de-duplicates the segment the kill interrupted (its rows may be committed already)
    ledger = DuckLedger(tmp_path / "l.duckdb")
    mover = ledger.use_mover()
    ledger.migrate()
    wal = WriteAheadLog(ledger.spool_dir)

    async def fill():
        wal.open(asyncio.get_running_loop())
        for segment in range(40):
            rows = [make_row(f"r{segment}-{n}") for n in range(300)]
            await wal.commit([r["request_id"] for r in rows], b"".join(encode_row(r) for r in rows))
            wal.rotate()

    asyncio.run(fill())
    assert len(wal.closed_rows()) == 40
    outcome: list[BaseException | int] = []
    mover_thread = threading.Thread(target=lambda: outcome.append(_flush(ledger, wal)))
    mover_thread.start()
    child = _wait_for(lambda: mover.pid)
    _wait_for(lambda: len(wal.closed_rows()) <= 38, timeout=60)  # two segments in and removed
    os.kill(child, signal.SIGKILL)
    mover_thread.join(60)
    left = len(wal.closed_rows())
    assert isinstance(outcome[0], MoverDied), outcome  # the kill came mid-move
    assert 0 < left <= 38
    before = _count(ledger)[0]
    assert 600 <= before < 12_000
    assert ledger.flush(wal) == 12_000 - before  # a new child; what the killed one committed is not inserted again
    wal.close()
    count, distinct, total = _count(ledger)
    assert (count, distinct, total) == (12_000, 12_000, Decimal("0.014814804000"))
    assert wal.closed_rows() == [] and mover.pid != child
    ledger.close()


def _flush(ledger: DuckLedger, wal: WriteAheadLog) -> BaseException | int:
    try:
        return ledger.flush(wal)
    except MoverDied as exc:
        return exc


def _count(ledger: DuckLedger) -> tuple[int, int, Decimal]:
    conn = duckdb.connect(ledger.path, read_only=True)
    try:
        row = conn.execute("SELECT count(*), count(DISTINCT request_id), sum(cost_usd) FROM requests").fetchone()
    finally:
        conn.close()
    assert row is not None
    return row[0], row[1], row[2]


def _rows_in(path) -> int | None:
    try:
        conn = duckdb.connect(str(path), read_only=True)
    except duckdb.Error:  # not made yet, or the mover holds it
        return None
    try:
        row = conn.execute("SELECT count(*) FROM requests").fetchone()
    except duckdb.Error:
        return None
    finally:
        conn.close()
    return row[0] if row else None


def test_a_serving_proxy_never_loads_duckdb_and_its_mover_stops_when_idle(tmp_path, monkeypatch):
    # the dashboard's ledger figures too are read by the mover: 20 requests of 8 + 5 tokens of gpt-4o-mini
    # at $0.15 / $0.60 per 1M are 160 input and 100 output tokens, 20 * $0.0000042 = $0.000084
    monkeypatch.setenv("TOKENWARD_MOVER_IDLE_S", "3")  # the proxy's mover stops 3 s after its last move
    port = free_port()
    with CountingUpstream(wait_s=0.0) as upstream:
        proxy = ProxyProcess(write_config(tmp_path, upstream.url, port), port).start()
        assert proxy.process is not None
        assert children(proxy.process.pid) == []  # start-up's DuckDB work done: an idle proxy has no mover
        try:
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
            with httpx.Client(timeout=10) as client:
                for _ in range(20):
                    reply = client.post(
                        f"{proxy.url}/v1/chat/completions", json=body, headers={"authorization": "Bearer sk"}
                    )
                    assert reply.status_code == 200
            assert proxy.process is not None
            pid = proxy.process.pid
            # the rows reach the file (the mover moved them), while the proxy itself never mapped DuckDB
            _wait_for(lambda: _rows_in(tmp_path / "ledger.duckdb") == 20, timeout=30)
            _wait_for(lambda: not children(pid), timeout=30)  # idle: the mover has stopped
            assert not maps_duckdb(pid)
            rows = ledger_rows(tmp_path / "ledger.duckdb")
            assert len(rows) == 20 and sum(r["cost_usd"] for r in rows) == 20 * COST == Decimal("0.000084")
            # a dashboard page load: the page, then its figures, polled as the page does until the ledger's are in
            # (the first read starts a mover: ~0.4 s, more on a loaded machine, past the 2 s the API waits)
            assert httpx.get(f"{proxy.url}/dashboard", timeout=10).status_code == 200
            state = f"{proxy.url}/dashboard/api/state?range=7d"
            figures = _wait_for(lambda: httpx.get(state, timeout=30).json()["ledger"], timeout=60)
            assert figures["error"] is None and figures["today"] == figures["range"]
            assert {k: figures["today"][k] for k in ("requests", "cost_usd", "input_tokens", "output_tokens")} == {
                "requests": 20,
                "cost_usd": "0.000084000000",
                "input_tokens": 160,
                "output_tokens": 100,
            }
            assert [(g["name"], g["requests"], g["cost_usd"]) for g in figures["by_model"]] == [
                ("gpt-4o-mini", 20, "0.000084000000")
            ]
            assert sum(h["requests"] for h in figures["hourly"]) == 20 and figures["alerts"] == []
            assert not maps_duckdb(pid)  # the mover answered it
            _wait_for(lambda: not children(pid), timeout=30)  # and stopped again once idle
        finally:
            proxy.stop()


def test_the_proxy_restarts_a_killed_mover_logs_it_and_loses_no_row(tmp_path):
    port = free_port()
    with CountingUpstream(wait_s=0.01) as upstream:
        proxy = ProxyProcess(write_config(tmp_path, upstream.url, port), port).start()
        assert proxy.process is not None
        pid = proxy.process.pid
        load = Load(proxy.url, clients=16).start()
        kills = 0
        try:
            for _ in range(5):
                child = _wait_for(lambda: children(pid), timeout=30)[0]
                os.kill(child, signal.SIGKILL)
                kills += 1
                _wait_for(partial(_dead, child))
                time.sleep(0.3)
            time.sleep(1.5)
            assert httpx.get(f"{proxy.url}/healthz", timeout=5).status_code == 200  # not hung
        finally:
            load.stop()
            proxy.stop()
    rows = ledger_rows(tmp_path / "ledger.duckdb")
    by_client = collections.Counter(r["client_request_id"] for r in rows)
    assert kills == 5 and len(load.completed) > 50
    assert [rid for rid, count in by_client.items() if count > 1] == []
    assert [rid for rid in load.completed if rid not in by_client] == []
    assert all(r["cost_usd"] == COST for r in rows if r["client_request_id"] in load.completed)
    assert "the ledger's mover process ended" in proxy.log()


@pytest.mark.parametrize("moving", [False, True])
def test_the_mover_dies_with_the_proxy_and_leaves_the_file_free(tmp_path, moving):
    # killed mid-load (the mover busy moving), or a second after the load (the mover waiting for the next move)
    port = free_port()
    with CountingUpstream(wait_s=0.01) as upstream:
        proxy = ProxyProcess(write_config(tmp_path, upstream.url, port), port).start()
        assert proxy.process is not None
        pid = proxy.process.pid
        load = Load(proxy.url, clients=16).start()
        try:
            child = _wait_for(lambda: children(pid), timeout=30)[0]
            time.sleep(1.5)  # moves under way
            if not moving:
                load.stop()
                time.sleep(1.5)  # the last move done; the mover waits (it stops after 30 s idle)
                assert _alive(child)
            proxy.kill()
            _wait_for(partial(_dead, child), timeout=5)  # killed with its parent, not left behind
        finally:
            load.stop()
    duckdb.connect(str(tmp_path / "ledger.duckdb")).close()  # nobody holds the file's lock


def test_a_stopped_mover_is_killed_and_replaced_and_healthz_says_so(tmp_path, monkeypatch):
    """SIGSTOP the mover: within ~5 s it is taken for hung, killed, and a new child moves every row once.

    Before: the proxy waited for the stopped child's reply for ever; no row reached the file
    again, /healthz said nothing of why, and the proxy could not stop (its last flush waited too).
    """
    monkeypatch.setenv("TOKENWARD_MOVER_IDLE_S", "120")  # the mover stays between moves
    port = free_port()
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    with CountingUpstream(wait_s=0.0) as upstream:
        proxy = ProxyProcess(write_config(tmp_path, upstream.url, port), port).start()
        assert proxy.process is not None
        pid = proxy.process.pid
        stopped = None
        try:
            with httpx.Client(timeout=10) as client:

                def send(count: int) -> list[int]:
                    return [
                        client.post(f"{proxy.url}/v1/chat/completions", json=body,
                                    headers={"authorization": "Bearer sk"}).status_code
                        for _ in range(count)
                    ]

                assert send(10) == [200] * 10
                stopped = _wait_for(lambda: children(pid), timeout=30)[0]  # the mover moving those rows
                _wait_for(lambda: _rows_in(tmp_path / "ledger.duckdb") == 10, timeout=30)
                os.kill(stopped, signal.SIGSTOP)
                assert send(10) == [200] * 10  # served meanwhile: their rows wait in the log
                seen = set()

                def replaced() -> bool:
                    health = client.get(f"{proxy.url}/healthz").json()
                    seen.add(health["problem"])
                    return health.get("mover", {}).get("restarts") == 1 and health["status"] == "ok"

                _wait_for(replaced, timeout=30)
                health = client.get(f"{proxy.url}/healthz").json()
            assert "mover_not_answering" in seen  # while the rows waited, /healthz said why
            assert health["status"] == "ok", health
            assert health["mover"]["incident"] == (
                f"the ledger's mover process (pid {stopped}) gave no sign of life for 5 s during move: "
                "killed, a new one takes over"
            )
            assert _dead(stopped)
            # the new child is started by the next move, which may come a moment after /healthz counted the
            # restart (on a loaded machine the check found no child yet)
            _wait_for(lambda: [child for child in children(pid) if child != stopped], timeout=30)
            _wait_for(lambda: _rows_in(tmp_path / "ledger.duckdb") == 20, timeout=30)
        finally:
            if stopped is not None and _alive(stopped):
                os.kill(stopped, signal.SIGKILL)
            proxy.stop()
    rows = ledger_rows(tmp_path / "ledger.duckdb")
    assert len(rows) == 20 and len({r["request_id"] for r in rows}) == 20
    assert sum(r["cost_usd"] for r in rows) == 20 * COST
    assert "gave no sign of life for 5 s during move" in proxy.log()
