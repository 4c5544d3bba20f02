"""The write-ahead log: group commit, rotation, and recovery of what a dead writer left (exactly once)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from decimal import Decimal

from tokenward.reports.ledger import DuckLedger, WriteAheadLog, open_ledger
from tokenward.reports.ledger.wal import dead_writers, encode_row, read_rows

from .test_ledger import make_row


def rows_in(path) -> dict[str, tuple]:
    conn = open_ledger(path, read_only=True)
    try:
        found = conn.execute(
            "SELECT request_id, outcome, price_status, cost_usd, reserved_usd, principal FROM requests"
        ).fetchall()
    finally:
        conn.close()
    return {r[0]: r[1:] for r in found}


def test_each_append_is_in_the_file_when_the_call_returns(tmp_path):
    ledger = DuckLedger(tmp_path / "l.duckdb")
    wal = WriteAheadLog(ledger.spool_dir)
    rows_file = admissions_file = None

    async def run():
        nonlocal rows_file, admissions_file
        wal.open(asyncio.get_running_loop())
        (rows_file,) = ledger.spool_dir.glob("*.rows.jsonl")
        (admissions_file,) = ledger.spool_dir.glob("*.adm.jsonl")
        wal.admit("a", {"request_id": "a"})
        wal.admit("b", {"request_id": "b"})
        assert admissions_file.read_bytes() == b""  # not awaited: written at the end of this turn
        await asyncio.sleep(0)
        assert [r["row"]["request_id"] for r in read_rows(admissions_file)] == ["a", "b"]
        wal.admit("c", {"request_id": "c"})
        waiter = wal.commit(["c"], encode_row(make_row("c")))  # no await yet: already written
        assert [r["request_id"] for r in read_rows(rows_file)] == ["c"]
        await waiter
        await asyncio.sleep(0)
        assert [r["row"]["request_id"] for r in read_rows(admissions_file)] == ["a", "b"]  # c ended: never admitted
        await wal.forward("a", {"request_id": "a", "reserved_usd": Decimal("0.5")})
        assert read_rows(admissions_file)[-1]["row"] == {"request_id": "a", "reserved_usd": "0.5"}
        for i in range(200):
            await wal.commit([f"r{i}"], encode_row(make_row(f"r{i}")))
        assert len(read_rows(rows_file)) == 201

    asyncio.run(run())
    (segment,) = wal.rotate()
    assert sorted(r["request_id"] for r in read_rows(segment)) == sorted(["c"] + [f"r{i}" for i in range(200)])
    assert ledger.flush(wal) == 201
    wal.close()
    assert len(rows_in(ledger.path)) == 201


def test_with_fsync_concurrent_commits_share_flushes(tmp_path):
    ledger = DuckLedger(tmp_path / "l.duckdb")
    wal = WriteAheadLog(ledger.spool_dir, fsync=True)

    async def run():
        wal.open(asyncio.get_running_loop())
        futures = [wal.commit([f"r{i}"], encode_row(make_row(f"r{i}"))) for i in range(200)]
        distinct = {id(f) for f in futures}
        await asyncio.gather(*futures)
        return len(distinct)

    flushes = asyncio.run(run())
    assert 1 <= flushes < 200  # appended while a flush was under way: they share the next one
    assert ledger.flush(wal) == 200
    wal.close()
    assert len(rows_in(ledger.path)) == 200


def test_a_failed_write_is_queued_and_written_again(tmp_path):
    ledger = DuckLedger(tmp_path / "l.duckdb")
    wal = WriteAheadLog(ledger.spool_dir)

    async def run():
        wal.open(asyncio.get_running_loop())
        real_fd = wal._rows_fd
        wal._rows_fd = 10_000  # not an open descriptor: write() fails with EBADF
        waiter = wal.commit(["x"], encode_row(make_row("x")))
        try:
            await waiter
        except OSError:
            pass
        else:
            raise AssertionError("the failed write was not reported")
        assert wal.failing is not None and wal.queued == 1
        wal._rows_fd = real_fd
        for _ in range(50):  # retried every 0.2 s
            await asyncio.sleep(0.05)
            if wal.failing is None:
                break
        assert wal.failing is None and wal.queued == 0

    asyncio.run(run())
    assert ledger.flush(wal) == 1
    wal.close()
    assert set(rows_in(ledger.path)) == {"x"}


def test_rotation_carries_open_admissions_and_drops_ended_ones(tmp_path):
    ledger = DuckLedger(tmp_path / "l.duckdb")
    wal = WriteAheadLog(ledger.spool_dir)

    async def run():
        wal.open(asyncio.get_running_loop())
        wal.admit("ended", {"request_id": "ended"})
        await wal.forward("open", {"request_id": "open", "reserved_usd": Decimal("0.5")})
        await wal.commit(["ended"], encode_row(make_row("ended")))

    asyncio.run(run())
    wal.rotate()
    admissions = sorted(ledger.spool_dir.glob("*.adm.jsonl"))
    assert len(admissions) == 1  # the closed segment's admissions file is gone
    assert [r["row"]["request_id"] for r in read_rows(admissions[0])] == ["open"]
    assert wal.in_flight == 1
    wal.close()


# A writer killed with SIGKILL: admissions and rows on disk, its lock released by the kernel.
DYING_WRITER = """
import asyncio, os, signal, sys
from decimal import Decimal
sys.path.insert(0, sys.argv[2])
from tokenward.reports.ledger import WriteAheadLog
from tokenward.reports.ledger.wal import encode_row
from test_ledger import make_row
from pathlib import Path

async def main():
    wal = WriteAheadLog(Path(sys.argv[1]))
    wal.open(asyncio.get_running_loop())
    wal.admit("arrived", {"request_id": "arrived", "started_at": 1780000000.0, "principal": "alice",
                          "method": "POST", "path": "/v1/chat/completions", "endpoint": "chat_completions",
                          "outcome": "interrupted", "price_status": "not_billed", "cost_usd": Decimal(0)})
    await wal.forward("at-upstream", {"request_id": "at-upstream", "started_at": 1780000000.0, "principal": "bob",
                                      "method": "POST", "path": "/v1/chat/completions",
                                      "endpoint": "chat_completions", "outcome": "interrupted",
                                      "price_status": "usage_unknown", "reserved_usd": Decimal("0.25")})
    wal.admit("done", {"request_id": "done", "started_at": 1780000000.0, "principal": "carol",
                       "method": "POST", "path": "/v1/chat/completions", "endpoint": "chat_completions",
                       "outcome": "interrupted", "price_status": "not_billed"})
    await wal.commit(["done"], encode_row(make_row("done", principal="carol")))
    print("written", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def kill_a_writer(spool_dir, tests_dir):
    result = subprocess.run(
        [sys.executable, "-c", DYING_WRITER, str(spool_dir), str(tests_dir)], capture_output=True, text=True
    )
    assert result.stdout.strip() == "written" and result.returncode == -9, result.stderr


def test_a_killed_writer_leaves_one_row_per_request(tmp_path, request):
    ledger = DuckLedger(tmp_path / "l.duckdb")
    kill_a_writer(ledger.spool_dir, request.path.parent)
    assert ledger.flush() == 3
    rows = rows_in(ledger.path)
    assert rows == {
        "arrived": ("interrupted", "not_billed", Decimal(0), None, "alice"),  # never reached the upstream
        "at-upstream": ("interrupted", "usage_unknown", None, Decimal("0.25"), "bob"),  # may be billed: held
        "done": ("ok", "priced", Decimal("0.000001234567"), None, "carol"),  # its own row, not a second one
    }
    assert list(ledger.spool_dir.iterdir()) == []
    assert ledger.flush() == 0


def test_recovery_interrupted_after_its_insert_is_not_doubled(tmp_path, request):
    ledger = DuckLedger(tmp_path / "l.duckdb")
    kill_a_writer(ledger.spool_dir, request.path.parent)
    (writer,) = dead_writers(ledger.spool_dir)
    recovered = writer.recovered_file()
    writer.release()  # a recovering process dies after inserting, before removing anything
    from tokenward.reports.ledger.duck import insert_lines

    conn = open_ledger(ledger.path)
    insert_lines(conn, [recovered], dedupe=True, quarantine=ledger.quarantine, scratch=ledger.spool_dir)
    conn.close()
    assert ledger.flush() == 0  # the next one finds every row already there
    assert len(rows_in(ledger.path)) == 3


HOLD_WRITER = """
import asyncio, sys, time
from pathlib import Path
from tokenward.reports.ledger import WriteAheadLog
async def main():
    wal = WriteAheadLog(Path(sys.argv[1]))
    wal.open(asyncio.get_running_loop())
    wal.admit("busy", {"request_id": "busy", "started_at": 1780000000.0, "method": "POST", "path": "/v1/x",
                       "endpoint": "passthrough", "outcome": "interrupted", "price_status": "not_billed"})
    await asyncio.sleep(0.2)
    print("open", flush=True)
    sys.stdin.readline()
asyncio.run(main())
"""


def test_a_live_writer_is_never_recovered_whatever_its_pid(tmp_path):
    ledger = DuckLedger(tmp_path / "l.duckdb")
    with subprocess.Popen(
        [sys.executable, "-c", HOLD_WRITER, str(ledger.spool_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as writer:
        assert writer.stdout.readline().strip() == "open"
        assert dead_writers(ledger.spool_dir) == []  # its lock is held: not ours to take
        assert ledger.flush() == 0
        writer.stdin.write("\n")
        writer.stdin.flush()
    # it exited without cleaning up (no close()): now its admission is recovered
    assert ledger.flush() == 1
    assert rows_in(ledger.path)["busy"][1] == "not_billed"


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "x.rows.jsonl"
    path.write_bytes(encode_row(make_row("whole")) + json.dumps({"request_id": "to"}).encode()[:9])
    assert [r["request_id"] for r in read_rows(path)] == ["whole"]


def test_a_full_segment_starts_the_next_and_each_is_moved(tmp_path, monkeypatch):
    from tokenward.reports.ledger import wal as wal_module

    line = encode_row(make_row("r0"))
    monkeypatch.setattr(wal_module, "SEGMENT_BYTES", 10 * len(line))  # ten rows a segment
    ledger = DuckLedger(tmp_path / "l.duckdb")
    wal = WriteAheadLog(ledger.spool_dir)

    async def run():
        wal.open(asyncio.get_running_loop())
        await wal.forward("open", {"request_id": "open", "reserved_usd": Decimal("0.5")})
        for i in range(35):
            await wal.commit([f"r{i}"], encode_row(make_row(f"r{i}")))

    asyncio.run(run())
    closed = wal.closed_rows()
    assert [len(read_rows(path)) for path in closed] == [10, 10, 10]  # the 5 rows left are in the open segment
    (admissions,) = ledger.spool_dir.glob("*.adm.jsonl")  # the open request's admission moved with each rotation
    assert [r["row"]["request_id"] for r in read_rows(admissions)] == ["open"]
    assert ledger.flush(wal) == 35
    assert wal.closed_rows() == []
    wal.close()
    assert len(rows_in(ledger.path)) == 35


def test_an_admission_is_made_only_when_it_is_written(tmp_path):
    ledger = DuckLedger(tmp_path / "l.duckdb")
    wal = WriteAheadLog(ledger.spool_dir)
    made = []

    def row(request_id):
        def make():
            made.append(request_id)
            return {"request_id": request_id, "outcome": "interrupted"}

        return make

    async def run():
        wal.open(asyncio.get_running_loop())
        wal.admit("superseded", row("superseded"))
        await wal.forward("superseded", {"request_id": "superseded", "price_status": "usage_unknown"})
        wal.admit("ended", row("ended"))
        await wal.commit(["ended"], encode_row(make_row("ended")))
        wal.admit("waiting", row("waiting"))
        await asyncio.sleep(0)  # the end of the turn writes it
        assert made == ["waiting"]

    asyncio.run(run())
    (admissions,) = ledger.spool_dir.glob("*.adm.jsonl")
    assert [r["row"] for r in read_rows(admissions)] == [
        {"request_id": "superseded", "price_status": "usage_unknown"},
        {"request_id": "waiting", "outcome": "interrupted"},
    ]
    wal.close()


def test_a_line_a_full_disk_cuts_is_completed_not_written_twice(tmp_path, monkeypatch):
    import errno
    import os

    ledger = DuckLedger(tmp_path / "l.duckdb")
    wal = WriteAheadLog(ledger.spool_dir)
    real_write = os.write
    calls = []

    async def run():
        wal.open(asyncio.get_running_loop())
        target = wal._rows_fd

        def disk_filling(fd, data):
            if fd == target and len(calls) < 2:
                calls.append(len(data))
                if len(calls) == 1:
                    return real_write(fd, bytes(data[:100]))  # the disk takes 100 bytes, then is full
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", disk_filling)
        waiter = wal.commit(["a"], encode_row(make_row("a")))
        assert waiter.done() and isinstance(waiter.exception(), OSError)
        assert wal.failing is not None and wal.queued == 1
        await wal.commit(["b"], encode_row(make_row("b")))  # the disk has room again
        assert wal.failing is None and wal.queued == 0

    asyncio.run(run())
    monkeypatch.undo()
    (segment,) = wal.rotate()
    assert [r["request_id"] for r in read_rows(segment)] == ["a", "b"]  # "a" whole, once: its first 100 bytes kept
    assert ledger.flush(wal) == 2
    wal.close()
    assert set(rows_in(ledger.path)) == {"a", "b"}
