"""Ledger rows from finished exchanges: every outcome priced or explained, never a silent $0."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from pathlib import Path

import pytest

from tokenward.pricing.catalog import load_catalog
from tokenward.pricing.usage import Usage, UsageSource
from tokenward.proxy.exchange import Exchange, Outcome
from tokenward.proxy.recorder import Recorder, build_row
from tokenward.reports.ledger import ROW_COLUMNS, LedgerError, open_ledger

PRICES = Path(__file__).parent / "fixtures" / "field_case_prices.yaml"


@pytest.fixture(scope="module")
def catalog():
    return load_catalog([PRICES], builtin=False)


def make_exchange(**fields) -> Exchange:
    ex = Exchange(endpoint=fields.pop("endpoint", "chat_completions"), method="POST", path="/v1/chat/completions")
    ex.provider = "test"
    for name, value in fields.items():
        setattr(ex, name, value)
    ex.end(fields.get("outcome", Outcome.OK), fields.get("http_status", 200))
    return ex


def test_priced_row_has_exact_cost_and_line_items(catalog):
    ex = make_exchange(
        requested_model="gpt-4o",
        served_model="gpt-4o-2024-08-06",
        usage=Usage(input_tokens=2150, cached_input_tokens=2048, output_tokens=120),
    )
    row = build_row(ex, catalog)
    assert set(row) == set(ROW_COLUMNS)
    assert (row["price_status"], row["cost_usd"], row["price_entry_id"]) == (
        "priced",
        Decimal("0.004015"),
        "test/gpt-4o",
    )
    assert [(line["component"], line["quantity"], line["amount"]) for line in row["cost_lines"]] == [
        ("input", 102, Decimal("0.000255")),
        ("cached_input", 2048, Decimal("0.00256")),
        ("output", 120, Decimal("0.0012")),
    ]
    assert row["ended_at"] >= row["started_at"] and row["usage_source"] == "reported"


def test_b24_unknown_model_is_unpriced_with_tokens_kept(catalog):
    ex = make_exchange(requested_model="claude-opus-5", usage=Usage(input_tokens=1200, output_tokens=300))
    row = build_row(ex, catalog)
    assert (row["input_tokens"], row["output_tokens"]) == (1200, 300)
    assert row["price_status"] == "unpriced" and row["cost_usd"] is None and row["price_entry_id"] is None


def test_refused_and_failed_requests_cost_zero_explicitly(catalog):
    ex = make_exchange(outcome=Outcome.UNAUTHORIZED, http_status=401)
    row = build_row(ex, catalog)
    assert (row["price_status"], row["cost_usd"], row["usage_source"], row["outcome"]) == (
        "not_billed",
        0,
        "none",
        "unauthorized",
    )


def test_passthrough_rows_are_not_metered(catalog):
    row = build_row(make_exchange(endpoint="passthrough"), catalog)
    assert (row["price_status"], row["cost_usd"]) == ("not_metered", None)


def test_estimated_usage_is_marked(catalog):
    ex = make_exchange(
        requested_model="gpt-4o-mini", usage=Usage(input_tokens=14, output_tokens=5, source=UsageSource.ESTIMATED)
    )
    row = build_row(ex, catalog)
    assert row["usage_source"] == "estimated" and row["cost_usd"] == Decimal("0.0000051")


def test_invariant_breaks_no_rule_repaired_are_usage_invalid_not_priced(catalog):
    ex = make_exchange(requested_model="gpt-4o", usage=Usage(input_tokens=43, output_tokens=10, reasoning_tokens=11))
    row = build_row(ex, catalog)
    assert row["violations"] == "reasoning_tokens > output_tokens"
    assert (row["output_tokens"], row["reasoning_tokens"]) == (10, 11)  # kept as they came
    assert (row["price_status"], row["cost_usd"], row["cost_lines"]) == ("usage_invalid", None, None)


def test_repaired_and_invalid_usage_statuses(catalog):
    repaired = Usage(input_tokens=1000, output_tokens=100, repairs=("R1: ...",))
    row = build_row(make_exchange(requested_model="gpt-4o", usage=repaired), catalog)
    # gpt-4o: 1000 x 2.50/1M + 100 x 10.00/1M = $0.0035, priced but flagged
    assert (row["price_status"], row["cost_usd"], row["violations"]) == ("repaired", Decimal("0.0035"), "R1: ...")
    invalid = Usage(input_tokens=-1, output_tokens=100)  # never raises: the bad count is refused and noted
    row = build_row(make_exchange(requested_model="gpt-4o", usage=invalid), catalog)
    assert (row["price_status"], row["cost_usd"], row["input_tokens"], row["output_tokens"]) == (
        "usage_invalid",
        None,
        0,
        100,
    )
    assert row["violations"] == "input_tokens: -1 is not a count (an integer 0 <= n < 2^53)"


async def test_recorder_records_once_and_flushes_on_stop(tmp_path, catalog):
    path = tmp_path / "l.duckdb"
    recorder = Recorder(catalog, str(path), flush_interval_s=3600)  # only the shutdown flush writes
    await recorder.start()
    ex = make_exchange(requested_model="gpt-4o", usage=Usage(input_tokens=1, output_tokens=1))
    recorder.finish(ex)
    recorder.finish(ex)  # a second call is ignored: one row per exchange
    late = make_exchange(requested_model="gpt-4o")
    recorder.finish(late, estimate=lambda: Usage(input_tokens=4, output_tokens=2, source=UsageSource.ESTIMATED))
    await recorder.stop()
    conn = open_ledger(path, read_only=True)
    rows = conn.execute("SELECT request_id, input_tokens, usage_source FROM requests ORDER BY input_tokens").fetchall()
    conn.close()
    assert rows == [(ex.request_id, 1, "reported"), (late.request_id, 4, "estimated")]


async def test_a_full_batch_is_moved_into_the_ledger_before_the_interval(tmp_path, catalog, monkeypatch):
    from tokenward.proxy import recorder as recorder_module

    monkeypatch.setattr(recorder_module, "FLUSH_ROWS", 3)
    path = tmp_path / "l.duckdb"
    recorder = Recorder(catalog, str(path), flush_interval_s=3600)
    await recorder.start()
    exchanges = [make_exchange(requested_model="gpt-4o", usage=Usage(input_tokens=n, output_tokens=1)) for n in (1, 2)]
    for ex in exchanges:
        await recorder.commit(ex)
    await asyncio.sleep(0.3)
    conn = open_ledger(path, read_only=True)
    assert conn.execute("SELECT count(*) FROM requests").fetchone() == (0,)  # two rows wait in the log
    conn.close()
    started_flush = recorder.last_flush
    third = make_exchange(requested_model="gpt-4o", usage=Usage(input_tokens=3, output_tokens=1))
    await recorder.commit(third)  # the third row waiting: moved now, not in an hour
    for _ in range(100):
        if recorder.last_flush != started_flush:
            break
        await asyncio.sleep(0.05)
    conn = open_ledger(path, read_only=True)
    rows = conn.execute("SELECT input_tokens FROM requests ORDER BY input_tokens").fetchall()
    conn.close()
    assert rows == [(1,), (2,), (3,)]
    await recorder.stop()


async def test_a_full_disk_delays_rows_but_loses_none(tmp_path, catalog, caplog, monkeypatch):
    import errno

    from tokenward.reports.ledger import wal as wal_module

    path = tmp_path / "l.duckdb"
    recorder = Recorder(catalog, str(path), flush_interval_s=0.01)
    await recorder.start()
    real = wal_module._write_all
    failures = []

    def full_disk(fd, data):
        if len(failures) < 3:
            failures.append(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(wal_module, "_write_all", full_disk)
    ex = make_exchange(requested_model="gpt-4o", usage=Usage(input_tokens=1, output_tokens=1))
    await asyncio.wait_for(recorder.commit(ex), 5)  # the caller is told (and goes on), the row is kept
    assert "No space left on device" in caplog.text
    for _ in range(100):
        if recorder.wal.failing is None and len(failures) == 3:
            break
        await asyncio.sleep(0.05)
    assert recorder.wal.failing is None  # written once the disk had room again
    await recorder.stop()
    conn = open_ledger(path, read_only=True)
    assert conn.execute("SELECT request_id FROM requests").fetchall() == [(ex.request_id,)]
    conn.close()


async def _moved_after(recorder: Recorder, failed: list, count: int) -> None:
    """Wait (at most 4 s) until ``count`` moves have failed into ``failed`` and a later one went through."""
    for _ in range(200):
        if len(failed) == count and recorder.flush_error is None:
            return
        await asyncio.sleep(0.02)


async def test_a_ledger_that_fails_a_move_is_written_by_the_next_one_and_at_stop(tmp_path, catalog, monkeypatch):
    # DuckDB's own error from the INSERT (a full disk at its COMMIT) ended the writer's task: no move
    # after it, and stop() raised it before its final flush, leaving every row in the log
    import duckdb

    from tokenward.reports.ledger import duck

    path = tmp_path / "l.duckdb"
    recorder = Recorder(catalog, str(path), flush_interval_s=0.01)
    await recorder.start()
    real = duck._insert
    failures = []

    def failing_disk(conn, paths, dedupe):
        if len(failures) < 2:
            failures.append(paths)
            raise duckdb.IOException("Could not write file: No space left on device")
        return real(conn, paths, dedupe)

    monkeypatch.setattr(duck, "_insert", failing_disk)
    first = make_exchange(requested_model="gpt-4o", usage=Usage(input_tokens=1, output_tokens=1))
    await recorder.commit(first)
    await _moved_after(recorder, failures, 2)
    assert len(failures) == 2 and recorder.flush_error is None  # the periodic move went on after the failures
    second = make_exchange(requested_model="gpt-4o", usage=Usage(input_tokens=2, output_tokens=1))
    await recorder.commit(second)
    await recorder.stop()
    conn = open_ledger(path, read_only=True)
    rows = conn.execute("SELECT request_id, input_tokens FROM requests ORDER BY input_tokens").fetchall()
    conn.close()
    assert rows == [(first.request_id, 1), (second.request_id, 2)]  # once each: the retried segment deduplicated


async def test_a_reader_holding_the_ledger_logs_no_warning(tmp_path, catalog, caplog, monkeypatch):
    # `tokenward report` while the proxy runs holds the file for a moment: the move finds it busy
    # (logged at debug), and the next move logged "ledger rows are being written again" at WARNING,
    # a recovery from a problem the operator was never told about
    import logging

    from tokenward.reports.ledger import LedgerBusy

    path = tmp_path / "l.duckdb"
    recorder = Recorder(catalog, str(path), flush_interval_s=0.01)
    await recorder.start()
    real = recorder.ledger.flush
    busy = []

    def held_by_a_reader(wal):
        if len(busy) < 2:
            busy.append(wal)
            raise LedgerBusy("Could not set lock on file: held by a reader")
        return real(wal)

    monkeypatch.setattr(recorder.ledger, "flush", held_by_a_reader)
    caplog.set_level(logging.DEBUG, logger="tokenward.recorder")
    ex = make_exchange(requested_model="gpt-4o", usage=Usage(input_tokens=1, output_tokens=1))
    await recorder.commit(ex)
    await _moved_after(recorder, busy, 2)
    await recorder.stop()
    assert len(busy) == 2 and recorder.flush_error is None
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    conn = open_ledger(path, read_only=True)
    assert conn.execute("SELECT request_id FROM requests").fetchall() == [(ex.request_id,)]
    conn.close()


async def test_start_refuses_a_ledger_it_cannot_create(tmp_path, catalog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    recorder = Recorder(catalog, str(blocker / "ledger.duckdb"))
    with pytest.raises((LedgerError, OSError)):
        await recorder.start()
