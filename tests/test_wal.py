"""The write-ahead log: group commit, rotation, and recovery of what a dead writer left (exactly once)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
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

# A writer whose disk fills in the middle of a write: RLIMIT_FSIZE makes the kernel write part of it
# (a short write, as on a full file system) and fail the rest (EFBIG); then the space comes back.
FILLING_WRITER = """
import asyncio, os, resource, signal, sys
from decimal import Decimal
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from tokenward.reports.ledger import DuckLedger, WriteAheadLog
from tokenward.reports.ledger.wal import encode_row
from test_ledger import make_row

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death past the limit
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

def full_after(fd, room):  # the file may grow by `room` bytes more
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.fstat(fd).st_size + room, hard))

async def main(mode):
    ledger = DuckLedger(Path(sys.argv[1]))
    wal = WriteAheadLog(ledger.spool_dir)
    wal.open(asyncio.get_running_loop())
    await wal.commit(["r0"], encode_row(make_row("r0")))
    lines = [encode_row(make_row(f"r{i}")) for i in (1, 2, 3)]
    if mode == "admission":
        await wal.forward("held", {"request_id": "held", "started_at": 1780000000.0, "outcome": "interrupted"})
        line = b'{"t":"A","row":{"request_id":"at-upstream","started_at":1780000000.0,"principal":"bob",'
        full_after(wal._adm_fd, len(line) // 2)
        waiter = wal.forward("at-upstream", {"request_id": "at-upstream", "started_at": 1780000000.0,
                                             "principal": "bob", "method": "POST", "path": "/v1/chat/completions",
                                             "endpoint": "chat_completions", "outcome": "interrupted",
                                             "price_status": "usage_unknown", "reserved_usd": Decimal("0.25")})
        try:
            await wal.commit(["held"], encode_row(make_row("held")))  # queued behind the failed write
        except OSError:
            pass
    elif mode == "first-row":
        full_after(wal._rows_fd, len(lines[0]) // 2)  # half of r1 fits
        waiter = wal.commit(["r1", "r2", "r3"], b"".join(lines))
    else:
        full_after(wal._rows_fd, len(lines[0]) + len(lines[1]) + len(lines[2]) // 2)  # r1, r2, half of r3 fit
        waiter = wal.commit(["r1", "r2", "r3"], b"".join(lines))
    try:
        await waiter
    except OSError:
        pass
    else:
        raise SystemExit("the write did not fail")
    assert wal.failing is not None
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space freed
    for _ in range(100):  # retried every 0.2 s
        await asyncio.sleep(0.05)
        if wal.failing is None and wal.queued == 0:
            break
    assert wal.failing is None and wal.queued == 0, (wal.failing, wal.queued)
    if sys.argv[2] == "flush":
        ledger.flush(wal)  # the live writer moves its own segment (no de-duplication)
        wal.close()
        ledger.flush(wal)
        print("written", flush=True)
        return
    print("written", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main(sys.argv[4]))
"""


def fill_the_disk(tmp_path, tests_dir, ending, mode):
    ledger = DuckLedger(tmp_path / "l.duckdb")
    result = subprocess.run(
        [sys.executable, "-c", FILLING_WRITER, ledger.path, ending, str(tests_dir), mode],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.strip() == "written", result.stderr
    assert result.returncode == (-9 if ending == "kill" else 0), result.stderr
    if ending == "kill":
        ledger.flush()
    conn = open_ledger(ledger.path, read_only=True)
    try:
        ids = [r[0] for r in conn.execute("SELECT request_id FROM requests ORDER BY request_id").fetchall()]
        status = dict(conn.execute("SELECT request_id, price_status FROM requests").fetchall())
    finally:
        conn.close()
    quarantined = ledger.quarantine.read_text() if ledger.quarantine.exists() else ""
    return ids, status, quarantined


def test_a_row_cut_short_by_a_full_disk_is_written_once_when_space_returns(tmp_path, request):
    # r1, r2 and half of r3 reach the file before it is full: the retry must finish r3, not write
    # r1 and r2 again (glued to the half r3, r1 is unreadable; r2 gets a second row)
    ids, _, quarantined = fill_the_disk(tmp_path, request.path.parent, "flush", "middle")
    assert ids == ["r0", "r1", "r2", "r3"] and quarantined == ""


def test_a_killed_writer_whose_disk_filled_mid_row_keeps_that_row(tmp_path, request):
    ids, _, _ = fill_the_disk(tmp_path, request.path.parent, "kill", "first-row")
    assert ids == ["r0", "r1", "r2", "r3"]


def test_an_admission_cut_short_by_a_full_disk_still_gives_its_row(tmp_path, request):
    # the record that the request went upstream is half written when the disk fills; once space
    # is back it must be readable, or a kill loses the request's row (and its held $0.25)
    ids, status, _ = fill_the_disk(tmp_path, request.path.parent, "kill", "admission")
    assert ids == ["at-upstream", "held", "r0"]
    assert status["at-upstream"] == "usage_unknown"


# A rotation that cannot open the next segment (no descriptor free: the loop took the two the
# rotation closed; or no inode left): the log must go on in the segment it has, not write rows
# into whatever file or socket is given the descriptors it closed.
STARVED_ROTATION = """
import asyncio, os, resource, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tokenward.reports.ledger import DuckLedger, WriteAheadLog
from tokenward.reports.ledger.wal import encode_row
from test_ledger import make_row

async def main():
    ledger = DuckLedger(Path(sys.argv[1]))
    wal = WriteAheadLog(ledger.spool_dir)
    wal.open(asyncio.get_running_loop())
    await wal.commit(["r0"], encode_row(make_row("r0")))
    await wal.forward("open", {"request_id": "open", "started_at": 1780000000.0, "outcome": "interrupted",
                               "price_status": "usage_unknown"})
    await asyncio.to_thread(lambda: None)  # the worker thread exists before descriptors run out
    first = min(wal._rows_fd, wal._adm_fd)
    spare = []
    while (fd := os.dup(0)) < first:  # every descriptor below the log's is taken
        spare.append(fd)
    os.close(fd)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (first, hard))  # none free at or above it either
    await asyncio.to_thread(wal.rotate)  # from a worker thread, as the ledger's flush does
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    other = Path(sys.argv[1] + ".other")
    decoy = os.open(other, os.O_CREAT | os.O_WRONLY, 0o644)  # the next file (or socket) opened
    for fd in spare:
        os.close(fd)
    try:
        await wal.commit(["r1"], encode_row(make_row("r1")))
    except OSError:
        pass
    try:
        await wal.commit(["open"], encode_row(make_row("open")))
    except OSError:
        pass
    print(os.fstat(decoy).st_size, flush=True)
    os.close(decoy)
    ledger.flush(wal)
    wal.close()
    ledger.flush(wal)

asyncio.run(main())
"""


def test_a_rotation_that_cannot_open_the_next_segment_keeps_writing_the_current_one(tmp_path, request):
    ledger = DuckLedger(tmp_path / "l.duckdb")
    result = subprocess.run(
        [sys.executable, "-c", STARVED_ROTATION, ledger.path, str(request.path.parent)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.strip() == "0", "rows were written into another file"
    assert result.returncode == 0, result.stderr
    assert sorted(rows_in(ledger.path)) == ["open", "r0", "r1"]
    assert list(ledger.spool_dir.glob("*.jsonl")) == []


# Many requests in flight on the loop, segments rotating on the loop (every few rows) and from a
# worker thread (a flush every few milliseconds, inserting what it closed), until SIGKILL.
RACING_WRITER = """
import asyncio, random, sys, threading
from decimal import Decimal
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tokenward.reports.ledger import DuckLedger, WriteAheadLog
from tokenward.reports.ledger import wal as wal_module
from tokenward.reports.ledger.wal import encode_row
from test_ledger import make_row

wal_module.SEGMENT_BYTES = 8 * len(encode_row(make_row("q0")))  # a loop rotation every ~8 rows

def fallback(rid):
    return {"request_id": rid, "started_at": 1780000000.0, "method": "POST", "path": "/v1/chat/completions",
            "endpoint": "chat_completions", "outcome": "interrupted", "price_status": "not_billed"}

async def request(wal, i):
    rid = f"q{i:06d}"
    wal.admit(rid, lambda: fallback(rid))
    await asyncio.sleep(random.random() * 0.004)
    await wal.forward(rid, fallback(rid) | {"price_status": "usage_unknown", "reserved_usd": Decimal("0.01")})
    await asyncio.sleep(random.random() * 0.004)
    await wal.commit([rid], encode_row(make_row(rid)))

def flushing(ledger, wal):
    while True:
        ledger.flush(wal)

async def main():
    ledger = DuckLedger(Path(sys.argv[1]))
    wal = WriteAheadLog(ledger.spool_dir)
    wal.open(asyncio.get_running_loop())
    threading.Thread(target=flushing, args=(ledger, wal), daemon=True).start()
    tasks, i = set(), 0
    while True:
        while len(tasks) < 40:
            task = asyncio.ensure_future(request(wal, i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            if i == 300:
                print("running", flush=True)
        await asyncio.sleep(0)

asyncio.run(main())
"""


def test_rotations_racing_appends_until_sigkill_leave_each_request_one_row(tmp_path, request):
    for attempt in range(3):
        ledger = DuckLedger(tmp_path / f"l{attempt}.duckdb")
        with subprocess.Popen(
            [sys.executable, "-c", RACING_WRITER, ledger.path, str(request.path.parent)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as writer:
            assert writer.stdout.readline().strip() == "running", writer.stderr.read()
            time.sleep(0.3 + 0.3 * attempt)
            writer.kill()
            writer.wait()
        ledger.flush()
        conn = open_ledger(ledger.path, read_only=True)
        try:
            ids = [r[0] for r in conn.execute("SELECT request_id FROM requests ORDER BY request_id").fetchall()]
        finally:
            conn.close()
        assert len(ids) >= 300 and not ledger.quarantine.exists()
        # requests start in order: every one up to the last that left a trace has exactly one row
        assert ids == [f"q{i:06d}" for i in range(len(ids))]
        assert list(ledger.spool_dir.glob("*.jsonl")) == []


def test_with_fsync_a_rotation_whose_fsync_fails_keeps_its_segment_and_tells_the_next_waiter(tmp_path, monkeypatch):
    import errno
    import os

    ledger = DuckLedger(tmp_path / "l.duckdb")
    wal = WriteAheadLog(ledger.spool_dir, fsync=True)
    real_fsync = os.fsync
    current = []

    def failing(fd):  # the device fails the current segment's rows file
        if fd == current[0]:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    async def run():
        wal.open(asyncio.get_running_loop())
        await wal.commit(["a"], encode_row(make_row("a")))
        current.append(wal._rows_fd)
        monkeypatch.setattr(os, "fsync", failing)
        assert await asyncio.to_thread(wal.rotate) == []  # the rotation failed: no segment was closed
        monkeypatch.setattr(os, "fsync", real_fsync)
        try:
            await wal.commit(["b"], encode_row(make_row("b")))
        except OSError as exc:  # its own fsync succeeded, but the pages the failed one held may be gone
            assert exc.errno == errno.EIO
        else:
            raise AssertionError("a write after a failed fsync was reported durable")
        await wal.commit(["c"], encode_row(make_row("c")))  # reported once

    asyncio.run(run())
    (segment,) = wal.rotate()
    assert [r["request_id"] for r in read_rows(segment)] == ["a", "b", "c"]
    wal.close()
