"""The DuckDB ledger: migrations, spooled bulk inserts, a file held by another process, recovery."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import duckdb
import pytest

from tokenward.pricing.usage import TOKEN_FIELDS
from tokenward.reports.ledger import (
    ROW_COLUMNS,
    DuckLedger,
    LedgerBusy,
    LedgerError,
    WriteAheadLog,
    migrations,
    open_ledger,
    write_rows,
)
from tokenward.reports.ledger.wal import encode_row


def make_row(request_id: str, **overrides):
    row = {name: None for name in ROW_COLUMNS}
    row.update(
        request_id=request_id,
        started_at=1_780_000_000.25,
        ended_at=1_780_000_001.5,
        principal="fp-abc",
        method="POST",
        path="/v1/chat/completions",
        endpoint="chat_completions",
        outcome="ok",
        stream=False,
        usage_source="reported",
        price_status="priced",
        cost_usd=Decimal("0.000001234567"),
        cost_lines=[{"component": "input", "quantity": 3, "rate": Decimal("0.15"), "amount": Decimal("4.5E-7")}],
        raw_usage={"prompt_tokens": 3},
        row_kind="request",
    )
    for name in TOKEN_FIELDS:
        row[name] = 0
    row.update(overrides)
    return row


def test_blank_database_gets_every_migration(tmp_path):
    conn = open_ledger(tmp_path / "l.duckdb")
    applied = [r[0] for r in conn.execute("SELECT name FROM _migrations ORDER BY applied_at").fetchall()]
    assert applied == [m.__name__ for m in migrations.MIGRATIONS]
    columns = [
        r[0]
        for r in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name='requests'"
        ).fetchall()
    ]
    assert set(ROW_COLUMNS) == set(columns)
    assert migrations.migrate(conn) == []  # idempotent
    conn.close()


def test_upgrade_applies_only_new_migrations(tmp_path, monkeypatch):
    path = tmp_path / "l.duckdb"
    conn = duckdb.connect(str(path))
    first = migrations.MIGRATIONS[0]
    monkeypatch.setattr(migrations, "MIGRATIONS", [first])
    assert migrations.migrate(conn) == [first.__name__]

    def m999_extra(c):
        c.execute("ALTER TABLE requests ADD COLUMN extra VARCHAR")

    monkeypatch.setattr(migrations, "MIGRATIONS", [first, m999_extra])
    assert migrations.pending(conn) == ["m999_extra"]
    assert migrations.migrate(conn) == ["m999_extra"]
    conn.close()


def test_read_only_open_refuses_missing_or_outdated_files(tmp_path, monkeypatch):
    with pytest.raises(LedgerError, match="no ledger"):
        open_ledger(tmp_path / "missing.duckdb", read_only=True)
    path = tmp_path / "old.duckdb"
    open_ledger(path).close()
    monkeypatch.setattr(migrations, "MIGRATIONS", [*migrations.MIGRATIONS, lambda c: None])
    with pytest.raises(LedgerError, match="needs migrations"):
        open_ledger(path, read_only=True)


def log_rows(path, rows, *, flush=True):
    """Append ``rows`` through a real write-ahead log beside ``path``; returns the ledger and the log."""
    ledger = DuckLedger(path)
    wal = WriteAheadLog(ledger.spool_dir)

    async def run():
        wal.open(asyncio.get_running_loop())
        await wal.commit([r["request_id"] for r in rows], b"".join(encode_row(r) for r in rows))

    asyncio.run(run())
    if flush:
        ledger.flush(wal)
    return ledger, wal


def test_logged_rows_are_inserted_exactly(tmp_path):
    path = tmp_path / "l.duckdb"
    ledger, wal = log_rows(path, [make_row("a"), make_row("b", cost_usd=None, price_status="unpriced", input_tokens=7)])
    assert wal.closed_rows() == []  # moved into the ledger, then removed
    wal.close()
    conn = open_ledger(path, read_only=True)
    rows = conn.execute(
        "SELECT request_id, cost_usd, input_tokens, started_at, cost_lines, raw_usage FROM requests ORDER BY request_id"
    ).fetchall()
    conn.close()
    assert rows[0][1] == Decimal("0.000001234567") and rows[1][1] is None and rows[1][2] == 7
    assert rows[0][3].isoformat() == "2026-05-28T20:26:40.250000+00:00"
    assert json.loads(rows[0][4])[0]["rate"] == "0.15" and json.loads(rows[0][5]) == {"prompt_tokens": 3}


def test_one_bad_value_costs_only_its_own_row(tmp_path):
    path = tmp_path / "l.duckdb"
    rows = [make_row(f"r{i}", input_tokens=i) for i in range(31)]
    rows[17]["input_tokens"] = 10**19  # beyond BIGINT: DuckDB refuses this one line
    rows[23]["output_tokens"] = "many"  # not a number at all
    ledger, wal = log_rows(path, rows)
    wal.close()
    conn = open_ledger(path, read_only=True)
    kept = {r[0] for r in conn.execute("SELECT request_id FROM requests").fetchall()}
    conn.close()
    assert kept == {f"r{i}" for i in range(31)} - {"r17", "r23"}
    quarantined = [json.loads(line) for line in ledger.quarantine.read_text().splitlines()]
    assert sorted(json.loads(q["line"])["request_id"] for q in quarantined) == ["r17", "r23"]
    assert wal.closed_rows() == []


HOLDER = """
import duckdb, sys, time
conn = duckdb.connect(sys.argv[1], read_only=True)
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_busy_file_keeps_rows_in_the_log_until_free(tmp_path):
    path = tmp_path / "l.duckdb"
    open_ledger(path).close()
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), "1.5"], stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdout.readline().strip() == "holding"
        ledger, wal = log_rows(path, [make_row("x")], flush=False)
        with pytest.raises(LedgerBusy):
            ledger.flush(wal)
        assert len(wal.closed_rows()) == 1  # waiting on disk, not lost
    assert ledger.flush(wal) == 1
    wal.close()
    conn = open_ledger(path, read_only=True)
    assert conn.execute("SELECT count(*) FROM requests").fetchone() == (1,)
    conn.close()


def test_read_only_open_waits_for_a_writer(tmp_path):
    path = tmp_path / "l.duckdb"
    open_ledger(path).close()
    script = HOLDER.replace("read_only=True", "read_only=False")
    with subprocess.Popen(
        [sys.executable, "-c", script, str(path), "0.5"], stdout=subprocess.PIPE, text=True
    ) as writer:
        assert writer.stdout.readline().strip() == "holding"
        with pytest.raises(LedgerBusy):
            open_ledger(path, read_only=True, wait_s=0)
        conn = open_ledger(path, read_only=True, wait_s=10)  # retries until the writer lets go
        conn.close()


def test_files_of_the_earlier_spool_format_are_recovered_once(tmp_path):
    path = tmp_path / "l.duckdb"
    write_rows(path, [make_row("committed")])
    spool_dir = tmp_path / "l.duckdb.spool"
    lines = b"".join(json.dumps(make_row(r), default=str).encode() + b"\n" for r in ("committed", "lost", "half"))
    # a live process's PID (ours) no longer matters: the writer lock does
    (spool_dir / f"{time.time_ns()}-{os.getpid()}-1.jsonl").write_bytes(lines[: lines.rindex(b'{"request_id": "half"')])
    (spool_dir / f"{time.time_ns()}-{os.getpid()}-2.part").write_bytes(lines[lines.rindex(b'{"request_id": "half"') :])
    assert DuckLedger(path).flush() == 2  # "lost" and the .part file's "half"; "committed" is not doubled
    conn = open_ledger(path, read_only=True)
    ids = sorted(r[0] for r in conn.execute("SELECT request_id FROM requests").fetchall())
    conn.close()
    assert ids == ["committed", "half", "lost"]
    assert [p.name for p in spool_dir.iterdir()] == []


def test_readers_see_the_rows_still_in_the_log_once(tmp_path):
    from tokenward.reports.ledger.duck import include_unflushed

    path = tmp_path / "l.duckdb"
    write_rows(path, [make_row("in-file")])
    spool = tmp_path / "l.duckdb.spool"
    spool.mkdir(exist_ok=True)
    # a segment being moved in right now holds a row the file has too; a line is half written
    (spool / "wabc-00000001.rows.jsonl").write_bytes(
        encode_row(make_row("in-file")) + encode_row(make_row("logged", cost_usd=Decimal("0.5"))) + b'{"request_'
    )
    conn = open_ledger(path, read_only=True)
    try:
        assert include_unflushed(conn, spool) == 1
        rows = conn.execute("SELECT request_id, cost_usd FROM requests ORDER BY request_id").fetchall()
    finally:
        conn.close()
    assert rows == [("in-file", Decimal("0.000001234567")), ("logged", Decimal("0.5"))]


@pytest.mark.parametrize("failure", ["commit", "removal"])
def test_a_move_that_failed_after_its_rows_were_in_the_file_does_not_double_them(tmp_path, monkeypatch, failure):
    from tokenward.reports.ledger import duck

    path = tmp_path / "l.duckdb"
    ledger, wal = log_rows(path, [make_row("a"), make_row("b")], flush=False)
    real_insert, real_unlink = duck._insert, Path.unlink

    def insert_then_fail(conn, paths, dedupe):  # the COMMIT was durable, then its checkpoint failed
        real_insert(conn, paths, dedupe)
        raise duckdb.IOException("IO Error: could not write checkpoint (No space left on device)")

    def unlink_fails(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    if failure == "commit":
        monkeypatch.setattr(duck, "_insert", insert_then_fail)
    else:
        monkeypatch.setattr(Path, "unlink", unlink_fails)
    with pytest.raises((LedgerError, PermissionError)):  # the driver's error comes as a LedgerError
        ledger.flush(wal)
    monkeypatch.setattr(duck, "_insert", real_insert)
    monkeypatch.setattr(Path, "unlink", real_unlink)
    assert ledger.flush(wal) == 0  # moved again, de-duplicated: both rows were in the file already
    wal.close()
    conn = open_ledger(path, read_only=True)
    ids = conn.execute("SELECT request_id FROM requests ORDER BY request_id").fetchall()
    conn.close()
    assert ids == [("a",), ("b",)]


def test_an_earlier_versions_keys_claims_and_deliveries_are_moved_once_and_logged_by_kind(tmp_path, caplog):
    """Before: "moved 5 keys, alert claims and deliveries" for 2 keys, 1 claim and 2 deliveries."""
    import datetime as dt
    import logging

    from tokenward.proxy.startup import import_legacy_state
    from tokenward.reports.ledger.state import AlertKey

    path = tmp_path / "l.duckdb"
    at = dt.datetime(2026, 11, 1, 9, tzinfo=dt.UTC)
    conn = open_ledger(path)  # the tables earlier versions wrote (migration m003 still makes them)
    conn.execute(
        "INSERT INTO virtual_keys VALUES ('ci', 'a' || repeat('0', 63), 'ml', NULL, $1, NULL), "
        "('old', 'b' || repeat('0', 63), NULL, NULL, $1, $1)",
        [at],
    )
    conn.execute("INSERT INTO budget_alerts VALUES ('monthly', $1, 'threshold', 50, $1, 'sent', 1, NULL, '{}')", [at])
    conn.execute(  # one mail to two addresses was one row then
        "INSERT INTO alert_deliveries VALUES ('monthly', $1, 'threshold', 50, 'email', 'a@x.org,b@x.org', $1, true, 1, NULL)",
        [at],
    )
    conn.close()
    ledger = DuckLedger(path)
    ledger.use_mover()  # as a serving proxy does: the DuckDB read happens in the mover child
    try:
        with caplog.at_level(logging.INFO, logger="tokenward.proxy"):
            import_legacy_state(ledger)
            import_legacy_state(ledger)  # once only
    finally:
        ledger.close()
    moved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("moved ")]
    assert moved == [
        f"moved 2 stored keys, 1 alert claim and 2 alert deliveries from the ledger file into the state store "
        f"{ledger.state.path}"
    ]
    assert sorted((k.name, k.revoked_at is not None) for k in ledger.state.keys()) == [("ci", False), ("old", True)]
    key = AlertKey("monthly", at, "threshold", 50)
    assert sorted(d.target for d in ledger.state.deliveries(key)) == ["a@x.org", "b@x.org"]


def test_a_move_that_runs_out_of_memory_under_its_cap_is_done_again_without_it(tmp_path, caplog):
    # 3 segments of 300 rows, each $0.000001234567: DuckDB cannot insert one under a 1 MB cap, so the
    # move is done again uncapped, each row once: 900 rows, $0.001111110300
    from tokenward.reports.ledger.moves import move_segments

    ledger = DuckLedger(tmp_path / "l.duckdb")
    ledger.migrate()
    wal = WriteAheadLog(ledger.spool_dir)

    async def fill():
        wal.open(asyncio.get_running_loop())
        for segment in range(3):
            rows = [make_row(f"r{segment}-{n}") for n in range(300)]
            await wal.commit([r["request_id"] for r in rows], b"".join(encode_row(r) for r in rows))
            wal.rotate()

    asyncio.run(fill())
    own, unsure = wal.closed_rows(), set()
    moved = move_segments(
        ledger.path, ledger.spool_dir, own, wal.writer_id, unsure, migrate_schema=False, memory_limit="1MB"
    )
    wal.close()
    assert moved == 900 and unsure == set() and not any(p.exists() for p in own)
    assert "needed more than 1MB of DuckDB memory; moving again without that cap" in caplog.text
    conn = duckdb.connect(ledger.path, read_only=True)
    try:
        assert conn.execute("SELECT count(*), count(DISTINCT request_id), sum(cost_usd) FROM requests").fetchone() == (
            900,
            900,
            Decimal("0.001111110300"),
        )
    finally:
        conn.close()
