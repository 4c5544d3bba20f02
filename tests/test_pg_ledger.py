"""The Postgres ledger on a real server: schema, COPY ingest with de-duplication, recovery, state, books, copy.

Skipped cleanly when Postgres is not installed (the ``pg_cluster`` fixture).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

from tokenward.pricing.budgets import Budget, Period
from tokenward.proxy.cli import main
from tokenward.reports.ledger import DuckLedger, write_rows
from tokenward.reports.ledger.books import Ask, Refused
from tokenward.reports.ledger.factory import LEDGER_URL_ENV, open_ledger_for
from tokenward.reports.ledger.pg_books import PgBooks, reconcile
from tokenward.reports.ledger.postgres import PgLedger
from tokenward.reports.ledger.schema import ROW_COLUMNS
from tokenward.reports.ledger.state import AlertKey
from tokenward.reports.ledger.wal import WriteAheadLog, encode_row

from .test_ledger import make_row

D = Decimal
T0 = dt.datetime(2026, 11, 2, 9, tzinfo=dt.UTC)


def pg(tmp_path: Path, url: str) -> PgLedger:
    ledger = open_ledger_for(url=url, spool_dir=tmp_path / "spool")
    assert isinstance(ledger, PgLedger)
    ledger.migrate()
    return ledger


def rows_of(url: str, sql: str = "SELECT request_id, cost_usd FROM requests ORDER BY request_id") -> list[tuple]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql).fetchall()


def test_schema_has_every_row_column_and_migrates_once(tmp_path, pg_url):
    ledger = pg(tmp_path, pg_url)
    assert ledger.migrate() == []
    columns = {
        r[0]
        for r in rows_of(pg_url, "SELECT column_name FROM information_schema.columns WHERE table_name = 'requests'")
    }
    assert set(ROW_COLUMNS) | {"seq"} == columns


def test_rows_are_inserted_once_with_exact_values(tmp_path, pg_url):
    ledger = pg(tmp_path, pg_url)
    row = make_row(
        "r1",
        started_at=1733000000.1234565,
        cost_usd=D("0.000123456789"),
        tags=["a", "b c"],
        cost_lines=[{"component": "input", "amount": "0.000123456789"}],
    )
    assert ledger.write_rows([row, make_row("r2")]) == 2
    assert ledger.write_rows([row]) == 0  # the same request id again: skipped
    found = rows_of(pg_url, "SELECT request_id, cost_usd, tags, cost_lines, started_at FROM requests ORDER BY 1")
    assert found[0][:4] == (
        "r1",
        D("0.000123456789"),
        ["a", "b c"],
        [{"component": "input", "amount": "0.000123456789"}],
    )
    # microseconds rounded as DuckDB's to_timestamp rounds them: the same instant in both engines
    duck = tmp_path / "d.duckdb"
    write_rows(duck, [row])
    conn = DuckLedger(duck).connect(read_only=True)
    assert found[0][4] == conn.execute("SELECT started_at FROM requests").fetchone()[0]
    conn.close()


def test_a_dead_writers_log_is_recovered_once_and_a_bad_row_is_set_aside(tmp_path, pg_url):
    ledger = pg(tmp_path, pg_url)
    spool = ledger.spool_dir
    spool.mkdir(parents=True)
    # a writer that died: its rows file (one row refused by Postgres: a count out of range), and an
    # admission for a request that was at the upstream
    (spool / "wdead-00000000.rows.jsonl").write_bytes(
        encode_row(make_row("ok1")) + encode_row(make_row("bad", input_tokens=10**30)) + encode_row(make_row("ok2"))
    )
    admission = {
        "t": "A",
        "row": {
            "request_id": "inflight",
            "started_at": 1733000000.0,
            "principal": "k",
            "method": "POST",
            "path": "/v1/chat/completions",
            "endpoint": "chat",
            "outcome": "interrupted",
            "usage_source": "none",
            "price_status": "usage_unknown",
            "reserved_usd": "0.5",
        },
    }
    (spool / "wdead-00000000.adm.jsonl").write_bytes(json.dumps(admission).encode() + b"\n")
    (spool / "wdead.lock").write_text("1\n")
    assert ledger.flush() == 3
    found = rows_of(pg_url, "SELECT request_id, price_status, reserved_usd FROM requests ORDER BY 1")
    assert found == [("inflight", "usage_unknown", D("0.5")), ("ok1", "priced", None), ("ok2", "priced", None)]
    quarantined = [json.loads(line) for line in ledger.quarantine.read_text().splitlines()]
    assert [json.loads(q["line"])["request_id"] for q in quarantined] == ["bad"]
    assert not list(spool.glob("wdead*"))
    assert ledger.flush() == 0


async def test_the_write_ahead_log_goes_in_through_flush(tmp_path, pg_url):
    ledger = pg(tmp_path, pg_url)
    wal = WriteAheadLog(ledger.spool_dir)
    wal.open(asyncio.get_running_loop())
    try:
        await wal.commit(["a"], encode_row(make_row("a")) + encode_row(make_row("a-p1", row_kind="part")))
        assert await asyncio.to_thread(ledger.flush, wal) == 2
        assert ledger.waiting_segments(wal) == 0
    finally:
        wal.close()
    assert [r[0] for r in rows_of(pg_url)] == ["a", "a-p1"]


def test_reports_read_a_local_copy_kept_in_step(tmp_path, pg_url):
    ledger = pg(tmp_path, pg_url)
    ledger.write_rows([make_row(f"r{i}", cost_usd=D("0.01")) for i in range(5)])
    conn = ledger.connect(read_only=True)
    assert conn.execute("SELECT count(*), sum(cost_usd) FROM requests").fetchone() == (5, D("0.05"))
    # a re-price changes rows on the server and in the copy
    ledger.apply_prices(
        conn,
        [
            {
                "request_id": "r0",
                "price_status": "priced",
                "cost_usd": D("1"),
                "price_entry_id": "x",
                "price_resolved_by": "exact",
                "cost_lines": [],
                "output_cost_usd": D(0),
                "cache_savings_usd": D(0),
            }
        ],
    )
    conn.close()
    ledger.write_rows([make_row("r9", cost_usd=D("0.5"))])
    conn = ledger.connect(read_only=True)
    assert conn.execute("SELECT count(*), sum(cost_usd) FROM requests").fetchone() == (6, D("1.54"))
    conn.close()
    assert rows_of(pg_url, "SELECT cost_usd FROM requests WHERE request_id = 'r0'") == [(D("1"),)]


def test_state_claims_are_unique_across_processes(tmp_path, pg_url):
    first, second = pg(tmp_path, pg_url).state, PgLedger(pg_url, tmp_path / "other").state
    key = AlertKey("team", T0, "threshold", 80)
    assert first.claim([key], {"subject": "s"}, T0) == [key]
    assert second.claim([key], {"subject": "s"}, T0) == []
    assert second.claimed("team", T0) == {("threshold", 80)}
    first.set_status(key, "sent")
    assert [(c.key, c.status, c.attempts, c.detail) for c in second.claims()] == [(key, "sent", 1, {"subject": "s"})]
    second.create_key("ci", "ab" * 32, team="t", project=None, role="user", now=T0)
    with pytest.raises(ValueError, match="exists"):
        first.create_key("ci", "cd" * 32, team=None, project=None, role="user", now=T0)
    assert first.revoke("ci", None, T0) and not first.revoke("ci", None, T0)
    assert first.revoked_hashes() == {"ab" * 32}
    ends = T0 + dt.timedelta(days=30)  # a key made with --expires: the expiry is kept (m014)
    second.create_key("contractor", "ef" * 32, team=None, project=None, role="user", now=T0, expires_at=ends)
    assert [(k.name, k.expires_at) for k in first.keys()] == [("ci", None), ("contractor", ends)]
    assert second.revoke("demo", "0F" * 32, T0)  # a config key (keys revoke NAME --config): keys list shows it
    assert first.config_revocations() == {"0f" * 32: ("demo", T0)}
    first.record_objects([("file-1", "file", "vk-1", T0), ("file-1", "file", "vk-2", T0)])
    assert second.owners(["file-1", "file-2"]) == {"file-1": "vk-1"}
    assert second.owned("vk-1", "file") == {"file-1"}


def _budget(limit: str) -> Budget:
    return Budget(name="hard", limit_usd=D(limit), period=Period(kind="day", timezone="UTC"), action="block")


async def test_books_hold_all_or_none_across_replicas_and_leases_expire(tmp_path, pg_url):
    pg(tmp_path, pg_url)
    start = dt.datetime(2026, 11, 2, tzinfo=dt.UTC)
    replicas = [PgBooks(pg_url, f"r{i}", lease_s=3) for i in range(3)]
    for books in replicas:
        await books.start()
    try:
        asks = [Ask(("hard", start), D("1"), D("0.1")), Ask(("other", start), D("10"), D("0.1"))]
        # 60 concurrent reservations of $0.10 through three replicas against $1: exactly 10 pass
        results = await asyncio.gather(*(replicas[i % 3].reserve(asks) for i in range(60)), return_exceptions=True)
        held = [r for r in results if not isinstance(r, BaseException)]
        assert len(held) == 10 and all(isinstance(r, Refused) and r.index == 0 for r in results if r not in held)
        assert rows_of(pg_url, "SELECT book, held FROM budget_books ORDER BY 1") == [("hard", D(1)), ("other", D(1))]
        # one settles at $0.04: its hold goes, its cost stays
        replicas[0].settle(held[0], [(("hard", start), D("0.04"))], "req-1", start)
        await asyncio.gather(*replicas[0]._tasks)
        assert rows_of(pg_url, "SELECT spent, held FROM budget_books WHERE book = 'hard'") == [(D("0.04"), D("0.9"))]
        # replica 2 dies (no more renewals): its holds go when its lease ends
        replicas[2]._beat.cancel()
        own = sum(1 for i, r in enumerate(results) if r in held and i % 3 == 2)
        await asyncio.sleep(4.5)
        expected = D("0.9") - D("0.1") * own
        assert rows_of(pg_url, "SELECT held FROM budget_books WHERE book = 'hard'") == [(expected,)]
    finally:
        for books in replicas:
            await books.stop()


def test_reconcile_counts_ledger_rows_and_settlements_once(tmp_path, pg_url):
    ledger = pg(tmp_path, pg_url)
    start = dt.datetime(2026, 11, 2, tzinfo=dt.UTC)
    budget = _budget("5")
    when = start.timestamp() + 3600
    ledger.write_rows(
        [
            make_row("in-ledger", started_at=when, cost_usd=D("1.5")),
            make_row("yesterday", started_at=when - 86400, cost_usd=D("7")),
        ]
    )
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "SELECT tw_settle(NULL, 'in-ledger', %s, ARRAY['hard'], ARRAY[%s]::timestamptz[], ARRAY[1.5])",
            [start, start],
        )
        conn.execute("INSERT INTO budget_settled VALUES ('not-yet', 'hard', %s, %s, 0.25)", [start, start])
    window = [(budget, ("hard", start), start, start + dt.timedelta(days=1))]
    assert reconcile(ledger.pool, window) == 1
    # 1.5 from the ledger (its settlement dropped now that the row is there) + 0.25 not yet in it
    assert rows_of(pg_url, "SELECT spent FROM budget_books") == [(D("1.75"),)]
    assert rows_of(pg_url, "SELECT request_id FROM budget_settled") == [("not-yet",)]


def test_ledger_copy_duckdb_to_postgres_and_back_is_idempotent(tmp_path, pg_url):
    source = tmp_path / "source.duckdb"
    write_rows(
        source,
        [
            make_row(f"r{i}", cost_usd=D(i) / 1000, tags=["t"] if i % 2 else None, raw_usage={"prompt_tokens": i})
            for i in range(25)
        ],
    )
    runner = CliRunner()
    first = runner.invoke(main, ["ledger", "copy", "--from", str(source), "--to", pg_url], catch_exceptions=False)
    assert "copied 25 rows" in first.output
    again = runner.invoke(main, ["ledger", "copy", "--from", str(source), "--to", pg_url], catch_exceptions=False)
    assert "copied 0 rows" in again.output and "25 were there already" in again.output
    back = tmp_path / "back.duckdb"
    home = {"HOME": str(tmp_path)}  # the report copy of the Postgres ledger goes to ~/.cache
    out = runner.invoke(main, ["ledger", "copy", "--from", pg_url, "--to", str(back)], env=home, catch_exceptions=False)
    assert "copied 25 rows" in out.output
    runner.invoke(main, ["ledger", "copy", "--from", pg_url, "--to", str(back)], env=home, catch_exceptions=False)

    def export(db: str) -> list[dict]:
        result = runner.invoke(main, ["export", "--db", db], env=home, catch_exceptions=False)
        return [json.loads(line) for line in result.output.splitlines()]

    assert export(str(back)) == export(str(source)) == export(pg_url)
    assert len(export(str(back))) == 25


def test_cli_names_the_ledger_by_url_or_environment(tmp_path, pg_url, monkeypatch):
    runner = CliRunner()
    monkeypatch.setenv("HOME", str(tmp_path))
    out = runner.invoke(main, ["ledger", "migrate", "--db", pg_url], catch_exceptions=False).output
    assert "created ledger" in out and "m003_books" not in out
    monkeypatch.setenv(LEDGER_URL_ENV, pg_url)
    assert "up to date" in runner.invoke(main, ["ledger", "migrate"], catch_exceptions=False).output
    out = runner.invoke(main, ["keys", "create", "ci-bot", "--team", "platform"], catch_exceptions=False).output
    assert "ci-bot" in out
    assert [k.name for k in PgLedger(pg_url, tmp_path / "x").state.keys()] == ["ci-bot"]


def test_a_periodic_job_lock_is_held_by_one_process_at_a_time(tmp_path, pg_url):
    first, second = pg(tmp_path, pg_url), PgLedger(pg_url, tmp_path / "other")
    held = first.job_lock("budgets")
    assert held is not None
    assert second.job_lock("budgets") is None  # another replica skips this run
    other = second.job_lock("digest")  # another job is not blocked
    assert other is not None
    other.close()
    held.close()  # the lock ends with its connection (or its process)
    again = second.job_lock("budgets")
    assert again is not None
    again.close()


def test_the_config_names_the_engine_and_the_environment_wins(tmp_path, monkeypatch):
    from tokenward.proxy.config import ConfigError, load_config

    config = tmp_path / "c.yaml"
    config.write_text(
        "upstreams: [{name: a, base_url: 'http://127.0.0.1:9/v1'}]\n"
        "ledger: {url: 'postgresql://app@db:5432/tw', spool_dir: spool}\n"
    )
    loaded = load_config(config).open_ledger()
    assert isinstance(loaded, PgLedger) and loaded.spool_dir == tmp_path / "spool"
    monkeypatch.setenv(LEDGER_URL_ENV, "postgresql://other:secret@db2/tw")
    loaded = load_config(config).open_ledger()
    assert loaded.name == "postgresql://other:***@db2/tw"  # the password never shows
    monkeypatch.delenv(LEDGER_URL_ENV)
    config.write_text("upstreams: [{name: a, base_url: 'http://127.0.0.1:9/v1'}]\nledger: {path: l.duckdb}\n")
    assert isinstance(load_config(config).open_ledger(), DuckLedger)
    config.write_text("upstreams: [{name: a, base_url: 'http://127.0.0.1:9/v1'}]\nledger: {url: 'mysql://x'}\n")
    with pytest.raises(ConfigError, match="postgresql://"):
        load_config(config)


def test_every_ledger_column_has_the_same_meaning_in_both_engines(tmp_path, pg_url):
    """Columns main added after the Postgres ledger was made (media units, agents, 64-bit costs) exist in both."""
    from tokenward.reports.ledger import open_ledger

    pg(tmp_path, pg_url)
    duck = open_ledger(tmp_path / "l.duckdb")
    duck_types = dict(
        duck.execute("SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'requests'")
        .fetchall()
    )
    duck.close()
    pg_types = dict(
        rows_of(
            pg_url,
            "SELECT column_name, CASE WHEN data_type = 'numeric' THEN format('DECIMAL(%s,%s)', numeric_precision, "
            "numeric_scale) ELSE data_type END FROM information_schema.columns WHERE table_name = 'requests'",
        )
    )
    assert set(duck_types) == set(pg_types) - {"seq"} == set(ROW_COLUMNS)
    for column in ("cost_usd", "output_cost_usd", "cache_savings_usd", "reserved_usd"):
        assert duck_types[column] == pg_types[column] == "DECIMAL(18,12)"
    assert duck_types["provider_cost_usd"] == pg_types["provider_cost_usd"] == "DECIMAL(38,12)"
    for column in ("org", "pool", "run_id", "sent_model", "degraded", "image_variant"):
        assert (duck_types[column], pg_types[column]) == ("VARCHAR", "text")
    counts = ("output_images", "input_audio_seconds", "input_characters")
    for column in (*counts, "web_fetch_requests", "file_search_calls", "code_containers", "image_generation_calls"):
        assert (duck_types[column], pg_types[column]) == ("BIGINT", "bigint")


def test_a_new_status_needs_a_migration_in_both_engines(tmp_path, pg_url):
    """Postgres limits the status columns to the values DuckDB's ENUMs hold: every value the code writes, no other."""
    from tokenward.pricing.quote import PriceStatus
    from tokenward.pricing.usage import UsageSource
    from tokenward.reports.ledger import migrations, pg_migrations

    assert pg_migrations._M005_STATUS_VALUES == migrations._STATUS_VALUES
    ledger = pg(tmp_path, pg_url)
    code = {
        "price_status": {v for k, v in vars(PriceStatus).items() if k.isupper()},
        "usage_source": {s.value for s in UsageSource},
        "row_kind": {"request", "attempt", "part"},
    }
    written = [
        make_row(f"{column}-{value}", **{column: value}) for column, values in code.items() for value in sorted(values)
    ]
    assert ledger.write_rows(written) == len(written)
    with psycopg.connect(pg_url) as conn:
        for column in code:
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute(
                    f"UPDATE requests SET {column} = 'brand_new' WHERE request_id = %s", [written[0]["request_id"]]
                )
            conn.rollback()


def test_spend_sources_give_the_same_figures_on_both_engines(tmp_path, pg_url):
    """Every SpendSource method budgets, runs, per-user budgets and velocity rules read, on the same rows."""
    from tokenward.reports.ledger import open_ledger
    from tokenward.reports.ledger.pg_spend import PgSpend
    from tokenward.reports.ledger.spend import DuckSpend

    at = T0.timestamp()
    rows = [
        make_row("a", started_at=at, cost_usd=D("0.25"), end_user="alice", org="acme", pool="p1", run_id="r1",
                 key_id="vk-1"),
        make_row("b", started_at=at + 70, cost_usd=D("0.50"), end_user="bob", org="acme", run_id="r1", key_id="vk-1"),
        make_row("c", started_at=at + 130, cost_usd=None, price_status="usage_invalid", reserved_usd=D("0.125"),
                 end_user="alice", pool="p1"),
        make_row("d", started_at=at + 3600 * 30, cost_usd=D("1"), end_user="alice"),  # the next day
        make_row("e", started_at=at + 10, cost_usd=None, price_status="unpriced", reserved_usd=D("0.0625"),
                 requested_model="mystery", provider="openai"),
        make_row("f", started_at=at - 3600, cost_usd=D("2"), requested_model="gpt-4o", sent_model="gpt-4o-mini",
                 served_model=None),  # rerouted by a budget's degrade; the reply named no model
    ]
    ledger = pg(tmp_path, pg_url)
    ledger.write_rows(rows)
    duck_path = tmp_path / "same.duckdb"
    write_rows(str(duck_path), rows)
    conn = open_ledger(duck_path, read_only=True)
    duck, post = DuckSpend(conn), PgSpend(ledger.pool)
    day = Budget("per-user", D(10), period=Period("day"), per="end_user")
    start, end = day.period.window(T0)
    acme = Budget("acme", D(10), scope=(("org", "acme"),), period=Period("day"))
    pool = Budget("p1", D(10), scope=(("pool", "p1"),), period=Period("day"))
    run = Budget("run", D(10), scope=(("run", "r1"),), period=Period("total"))
    try:
        for source in (duck, post):
            assert source.spend_by(day, start, end, "end_user") == [("bob", D("0.5")), ("alice", D("0.375"))]
            assert source.run_spend(T0 - dt.timedelta(hours=1)) == [("vk-1", "r1", T0, D("0.75"))]
            assert source.spend_by_minute(day, T0) == [
                (int(at), D("0.3125")), (int(at) + 60, D("0.5")), (int(at) + 120, D("0.125")),
                (int(at) + 3600 * 30, D("1")),
            ]
            assert source.spend_in(acme, start, end) == D("0.75")
            assert source.spend_in(pool, start, end) == D("0.375")
            assert source.spend_in(run, *run.period.window(T0)) == D("0.75")
            assert [m[1:4] for m in source.unpriced_models("usage_invalid")] == [(None, T0 + dt.timedelta(seconds=130), 1)]
            assert [m[:2] for m in source.unpriced_models()] == [("openai", "mystery")]
            for model in ("gpt-4o-mini", "gpt-4o", "gpt-4o-mini-2024-07-18"):  # sent, requested, a snapshot
                mini = Budget("m", D(10), scope=(("model", model),), period=Period("day"))
                assert source.spend_in(mini, T0 - dt.timedelta(hours=2), T0) == D("2")
    finally:
        conn.close()


def test_a_model_budget_covers_routing_prefixed_names_on_both_engines(tmp_path, pg_url):
    names = [  # (requested, served, cost): gpt-4o behind the prefixes clients use (OpenRouter, LiteLLM)
        ("openai/gpt-4o", "openai/gpt-4o", "1"),
        ("azure/gpt-4o-2024-08-06", None, "2"),
        ("openrouter/openai/gpt-4o", "openai/gpt-4o-2024-11-20", "4"),
        ("openrouter/openai/gpt-4o-mini", None, "8"),  # another model
        ("a\n/gpt-4o", None, "16"),  # a newline does not hide the prefix
    ]
    # gpt-4o: 1 + 2 + 4 + 16 = 23; its 2024-08-06 snapshot: the same rows (requested as gpt-4o or
    # as the snapshot; the 2024-11-20 row was requested as gpt-4o), but not gpt-4o-mini
    spent = {"gpt-4o": "23", "azure/gpt-4o": "23", "gpt-4o-2024-08-06": "23", "gpt-4o-mini": "8"}
    assert_model_spend_on_both_engines(tmp_path, pg_url, names, spent)


def assert_model_spend_on_both_engines(tmp_path, pg_url, names, spent):
    """Write ``names`` (requested, served, cost) to Postgres and DuckDB; a budget on each model of ``spent`` sees it."""
    from tokenward.reports.ledger import open_ledger
    from tokenward.reports.ledger.pg_spend import PgSpend
    from tokenward.reports.ledger.spend import DuckSpend

    rows = [
        make_row(f"p{i}", requested_model=r, served_model=s, cost_usd=D(c), started_at=T0.timestamp())
        for i, (r, s, c) in enumerate(names)
    ]
    ledger = pg(tmp_path, pg_url)
    ledger.write_rows(rows)
    write_rows(str(tmp_path / "same.duckdb"), rows)
    conn = open_ledger(tmp_path / "same.duckdb", read_only=True)
    window = (T0 - dt.timedelta(hours=1), T0 + dt.timedelta(hours=1))
    try:
        for source in (DuckSpend(conn), PgSpend(ledger.pool)):
            for model, amount in spent.items():
                budget = Budget("m", D(100), scope=(("model", model),), period=Period("day"))
                assert source.spend_in(budget, *window) == D(amount), (type(source).__name__, model)
    finally:
        conn.close()


def test_a_model_budget_covers_the_clouds_names_for_the_model_on_both_engines(tmp_path, pg_url):
    names = [  # (requested, served, cost): claude-sonnet-4-5 as Bedrock and Vertex AI name it
        ("anthropic.claude-sonnet-4-5-20250929-v1:0", None, "1"),
        ("us.anthropic.claude-sonnet-4-5-20250929-v1:0", "us.anthropic.claude-sonnet-4-5-20250929-v1:0", "2"),
        ("claude-sonnet-4-5@20250929", None, "4"),
        ("eu.anthropic.claude-sonnet-4-5-v1", None, "8"),
        ("claude-sonnet-4-5", "claude-sonnet-4-5-20250929", "16"),
        ("us.anthropic.claude-sonnet-4-20250514-v1:0", None, "32"),  # another model: Sonnet 4
        ("claude-opus-4-5@20251101", None, "64"),  # another model: Opus 4.5
    ]
    # claude-sonnet-4-5 (any of its names): 1 + 2 + 4 + 8 + 16 = 31 (before: 16 on DuckDB and Postgres,
    # the cloud names' 15 spent outside the budget); Sonnet 4: 32; Opus 4.5: 64
    spent = {
        "claude-sonnet-4-5": "31",
        "us.anthropic.claude-sonnet-4-5-20250929-v1:0": "31",
        "claude-sonnet-4-5@20250929": "31",
        "claude-sonnet-4": "32",
        "claude-opus-4-5": "64",
    }
    assert_model_spend_on_both_engines(tmp_path, pg_url, names, spent)


def test_object_owners_newest_first_on_postgres(tmp_path, pg_url):
    ledger = pg(tmp_path, pg_url)
    state = ledger.state
    state.record_objects([("file-1", "file", "vk-a", T0), ("file-2", "file", "vk-b", T0)], fsync=False)
    state.record_objects([("file-3", "file", "vk-a", T0 + dt.timedelta(seconds=1)), ("file-1", "file", "vk-z", T0)])
    assert state.recent_objects(2) == [("file-3", "file", "vk-a"), ("file-2", "file", "vk-b")]
    assert state.owners(["file-1", "file-9"]) == {"file-1": "vk-a"}  # the first owner wins


def test_ledger_reconcile_settles_a_row_in_postgres(tmp_path, pg_url, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    ledger = pg(tmp_path, pg_url)
    ledger.write_rows([make_row("u1", cost_usd=None, price_status="usage_unknown", reserved_usd=D("0.5"))])
    runner = CliRunner()
    done = runner.invoke(main, ["ledger", "reconcile", "u1", "--cost", "0.125", "--db", pg_url], catch_exceptions=False)
    assert done.output.strip() == "request u1: priced at $0.125"
    assert rows_of(pg_url, "SELECT price_status, cost_usd, price_resolved_by FROM requests") == [
        ("priced", D("0.125"), "reconciled")
    ]
    again = runner.invoke(main, ["ledger", "reconcile", "u1", "--not-billed", "--db", pg_url])
    assert again.exit_code != 0 and "is priced, not usage_unknown" in again.output


def test_the_one_proxy_lock_is_for_a_duckdb_ledger_only(tmp_path, monkeypatch):
    """Blocking, per-user budgets need one proxy per DuckDB file; on Postgres the replicas share the books."""
    from tokenward.proxy.config import load_config
    from tokenward.proxy.startup import needs_single_proxy

    monkeypatch.delenv(LEDGER_URL_ENV, raising=False)
    config = tmp_path / "c.yaml"
    budgets = "budgets: [{name: u, per: end_user, limit_usd: 1, period: day, action: block}]\n"
    config.write_text("upstreams: [{name: a, base_url: 'http://127.0.0.1:9/v1'}]\nledger: {path: l.duckdb}\n" + budgets)
    assert needs_single_proxy(load_config(config))
    monkeypatch.setenv(LEDGER_URL_ENV, "postgresql://app@db:5432/tw")
    assert not needs_single_proxy(load_config(config))


async def test_a_book_new_to_the_database_starts_from_the_ledgers_spend(tmp_path, pg_url):
    """A per-user book opened with spend from the ledger is made with it; a book the database has keeps its own."""
    pg(tmp_path, pg_url)
    start = dt.datetime(2026, 11, 2, tzinfo=dt.UTC)
    books = PgBooks(pg_url, "r-seed", lease_s=3)
    await books.start()
    try:
        known = ("per-user[bob]", start)
        await books.reserve([Ask(known, D("1"), D("0.1"))])  # the database has bob's book now: $0 spent
        books.set_spent(("per-user[alice]", start), D("0.5"))
        books.set_spent(known, D("0.5"))
        with pytest.raises(Refused) as refused:
            await books.reserve([Ask(("per-user[alice]", start), D("1"), D("0.6"))])
        assert refused.value.remaining == D("0.5")
        await books.reserve([Ask(known, D("1"), D("0.6"))])  # bob's figure is the database's
        assert rows_of(pg_url, "SELECT book, spent, held FROM budget_books ORDER BY 1") == [
            ("per-user[alice]", D("0.5"), D(0)),
            ("per-user[bob]", D(0), D("0.7")),
        ]
    finally:
        await books.stop()


def test_readers_of_a_postgres_ledger_see_this_hosts_unflushed_rows_once(tmp_path, pg_url):
    """The report copy plus the rows still in the spool directory the config names, none twice."""
    from tokenward.reports.cli_common import open_named

    ledger = pg(tmp_path, pg_url)
    ledger.write_rows([make_row("in-postgres")])
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    (spool / "wabc-00000001.rows.jsonl").write_bytes(
        encode_row(make_row("in-postgres")) + encode_row(make_row("logged", cost_usd=D("0.5"))) + b'{"request_'
    )
    config = tmp_path / "c.yaml"
    config.write_text(f"upstreams: [{{name: a, base_url: 'http://127.0.0.1:9/v1'}}]\nledger: {{url: '{pg_url}', "
                      "spool_dir: spool}\n")
    conn = open_named(None, str(config), 5.0, read_only=True)
    try:
        rows = conn.execute("SELECT request_id, cost_usd FROM requests ORDER BY request_id").fetchall()
    finally:
        conn.close()
    assert rows == [("in-postgres", D("0.000001234567")), ("logged", D("0.5"))]


def test_books_made_while_serving_are_reconciled_by_the_replica_that_has_them():
    """``book_windows(made=True)``: the run and per-user books this process opened, not the configured ones."""
    from tokenward.proxy.guard import BudgetGuard
    from tokenward.proxy.run_budgets import DynamicBudgets

    configured = Budget("all", D(100), period=Period("month"), action="block")
    template = Budget("per-user", D(5), period=Period("day"), action="block", per="end_user")
    guard = BudgetGuard([configured], T0)
    dynamic = DynamicBudgets(guard, [template])
    assert dynamic.scope({"end_user": "alice"}, T0) == ["per-user[alice]"]
    day = Period("day").window(T0)
    assert guard.book_windows(T0, made=True) == [(template.instance("alice"), ("per-user[alice]", day[0]), *day)]
    month = Period("month").window(T0)
    assert guard.book_windows(T0) == [(configured, ("all", month[0]), *month)]


def test_a_proxy_on_a_duckdb_ledger_does_not_load_the_postgres_driver():
    """psycopg and libpq cost some 10 MB of resident memory: only a Postgres ledger imports them."""
    import subprocess
    import sys

    probe = (
        "import sys, tokenward.proxy.app, tokenward.proxy.cli, tokenward.proxy.guard, tokenward.proxy.forward; "
        "print(sorted(m for m in sys.modules if m.startswith('psycopg') or m.endswith(('.postgres', '.pg_books'))))"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert found.stdout.strip() == "[]"


async def test_shared_books_hold_requests_that_started_before_a_rollover_to_their_own_period(tmp_path, pg_url):
    # The shared books' twin of test_billing_faults' rollover test: on Postgres, settle counts a
    # row in the period it started in (tw_settle), and admit must check a request that started
    # before midnight (its body still arriving) against that day's room, not the new day's.
    from tokenward.proxy.guard import BudgetGuard, BudgetRefusal

    pg(tmp_path, pg_url)
    budget = Budget(name="daily", limit_usd=D("1.00"), period=Period(kind="day"), action="block")
    day1 = dt.datetime(2026, 12, 1, 23, 59, 50, tzinfo=dt.UTC)
    books = PgBooks(pg_url, "r-rollover", lease_s=3)
    await books.start()
    try:
        guard = BudgetGuard([budget], day1, store=books)
        guard.settle(None, [make_row("seed", started_at=day1.timestamp(), cost_usd=D("0.95"))])
        await asyncio.gather(*books._tasks)
        day2 = dt.datetime(2026, 12, 2, 0, 0, 5, tzinfo=dt.UTC)
        guard.settle(await guard.admit({}, D("0.01"), day2), [])  # a request of day 2 rolls the book
        started = dt.datetime(2026, 12, 1, 23, 59, 59, tzinfo=dt.UTC)
        admitted = 0
        for number in range(300):
            try:
                held = await guard.admit({}, D("0.01"), started)
            except BudgetRefusal:
                break
            admitted += 1
            guard.settle(held, [make_row(f"r{number}", started_at=started.timestamp(), cost_usd=D("0.01"))])
            await asyncio.gather(*books._tasks)
        assert admitted == 5  # $1.00 - $0.95 = $0.05 of day 1 left: five requests of $0.01
        assert rows_of(pg_url, "SELECT book, period_start, spent, held FROM budget_books ORDER BY period_start") == [
            ("daily", dt.datetime(2026, 12, 1, tzinfo=dt.UTC), D("1.00"), D(0)),
            ("daily", dt.datetime(2026, 12, 2, tzinfo=dt.UTC), D(0), D(0)),
        ]
    finally:
        await books.stop()


def test_keys_made_before_any_replica_started(tmp_path, pg_url):
    # README "Running several replicas": with no virtual_keys in the file, "make the keys with
    # `tokenward keys create NAME --config FILE` ... before sending traffic". On a database no
    # replica had started on, that was a psycopg traceback (relation "virtual_keys" does not
    # exist); keys list and alerts history were tracebacks too. Now a write makes the schema, as
    # the first replica would, and a read of a database without it says what to do.
    config = tmp_path / "tokenward.yaml"
    config.write_text(
        'upstreams: [{name: openai, base_url: "http://127.0.0.1:9/v1", default: true}]\n'
        f"ledger: {{url: {json.dumps(pg_url)}, spool_dir: spool}}\nauth: {{mode: virtual_keys}}\n"
    )
    runner = CliRunner()
    history = runner.invoke(main, ["alerts", "history", "--config", str(config)])
    assert history.exit_code == 1 and isinstance(history.exception, SystemExit), history.exception
    assert "has no tokenward schema yet" in history.output and "tokenward ledger migrate" in history.output
    made = runner.invoke(main, ["keys", "create", "ci-bot", "--team", "platform", "--config", str(config)])
    assert made.exit_code == 0, made.output
    key = made.output.splitlines()[0]
    assert key.startswith("tw-")
    listed = runner.invoke(main, ["keys", "list", "--config", str(config)])
    assert listed.exit_code == 0 and "ci-bot" in listed.output and "platform" in listed.output, listed.output
    (stored,) = PgLedger(pg_url, tmp_path / "x").state.keys()
    assert (stored.name, stored.team, stored.revoked_at) == ("ci-bot", "platform", None)
    revoked = runner.invoke(main, ["keys", "revoke", "ci-bot", "--config", str(config)])
    assert revoked.exit_code == 0 and "revoked" in revoked.output, revoked.output
    history = runner.invoke(main, ["alerts", "history", "--config", str(config)])
    assert history.exit_code == 0 and "no alerts yet" in history.output, history.output
