"""The tokenward command: serve in its own process, report and export while it runs, demo."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from zoneinfo import ZoneInfo

import duckdb
import httpx
import openai
import pytest
from click.testing import CliRunner

from tokenward.proxy.cli import main
from tokenward.proxy.demo import send_recorded
from tokenward.reports.cli import parse_when
from tokenward.reports.ledger import write_rows

from .test_ledger import make_row

CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"
CHAT_STREAM = "tests/models/cassettes/test_openai/test_run_stream_sync_streams_real_model.yaml#0"


def tokenward(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenward.proxy", *args], capture_output=True, text=True, check=check, timeout=60
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_report_and_export_while_the_proxy_runs(tmp_path, simulator, sample):
    ledger = tmp_path / "live.duckdb"
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenward.proxy",
            "serve",
            "--upstream",
            f"{simulator.url}/openai/v1",
            "--provider",
            "openai",
            "--db",
            str(ledger),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "proxy did not start"
            time.sleep(0.1)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-live", max_retries=0) as client:
            send_recorded(client, sample[CHAT])
            send_recorded(client, sample[CHAT_STREAM])
            send_recorded(client, sample[CHAT_STREAM], strip_stream_usage=True)
        deadline = time.monotonic() + 20
        while True:  # the proxy keeps running; the report reads between its flushes
            report = tokenward("report", "--db", str(ledger), "--by", "model", "--format", "json", check=False)
            rows = json.loads(report.stdout) if report.returncode == 0 else []
            if sum(r["requests"] for r in rows) == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert report.returncode == 0, report.stderr
        by_model = {r["model"]: r for r in rows}
        assert by_model["gpt-4o-2024-08-06"]["requests"] == 1
        assert by_model["gpt-4o-mini-2024-07-18"]["requests"] == 2
        assert by_model["gpt-4o-mini-2024-07-18"]["input_tokens"] == 106
        # 0.000120 (gpt-4o) + 2 x 0.00001695 (gpt-4o-mini)
        assert sum(Decimal(r["cost_usd"]) for r in rows) == Decimal("0.0001539")
        export = tokenward("export", "--db", str(ledger), "--format", "jsonl")
        exported = [json.loads(line) for line in export.stdout.splitlines()]
        assert len(exported) == 3 and {e["outcome"] for e in exported} == {"ok"}
        assert exported[0]["started_at"].endswith("+00:00") and "cached_input_tokens" in exported[0]
        assert server.poll() is None  # still serving
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-live", max_retries=0) as client:
            send_recorded(client, sample[CHAT])  # stop right after: the row must still reach the ledger
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught
    assert server.returncode in (0, -signal.SIGTERM), stderr
    assert "Traceback" not in stderr
    final = json.loads(tokenward("report", "--db", str(ledger), "--by", "model", "--format", "json").stdout)
    assert sum(r["requests"] for r in final) == 4


@pytest.fixture
def seeded(tmp_path):
    path = tmp_path / "seeded.duckdb"
    day1 = dt.datetime(2026, 11, 2, 23, 30, tzinfo=dt.UTC).timestamp()  # 2026-11-03 00:30 in Paris
    day2 = dt.datetime(2026, 11, 3, 12, 0, tzinfo=dt.UTC).timestamp()
    write_rows(
        path,
        [
            make_row(
                "r1",
                started_at=day1,
                ended_at=day1 + 1,
                served_model="gpt-4o",
                input_tokens=100,
                output_tokens=10,
                cost_usd=Decimal("0.00035"),
            ),
            make_row(
                "r2",
                started_at=day2,
                ended_at=day2 + 1,
                served_model="gpt-4o",
                input_tokens=200,
                output_tokens=20,
                cached_input_tokens=50,
                cost_usd=Decimal("0.000637500000"),
            ),
            make_row(
                "r3",
                started_at=day2,
                ended_at=day2 + 2,
                served_model="mistral-large-latest",
                input_tokens=7,
                output_tokens=3,
                cost_usd=None,
                price_status="unpriced",
            ),
        ],
    )
    return path


def test_report_formats_and_time_zones(seeded):
    runner = CliRunner()
    result = runner.invoke(
        main,
        ["report", "--db", str(seeded), "--by", "day,model", "--format", "csv", "--tz", "Europe/Paris"],
        catch_exceptions=False,
    )
    rows = list(csv.DictReader(io.StringIO(result.output)))
    assert [(r["day"], r["model"], r["requests"], r["cost_usd"], r["unpriced_requests"]) for r in rows] == [
        ("2026-11-03", "gpt-4o", "2", "0.000987500000", "0"),
        ("2026-11-03", "mistral-large-latest", "1", "", "1"),  # nothing priced: no cost, not $0
    ]
    utc = runner.invoke(
        main, ["report", "--db", str(seeded), "--by", "day", "--format", "json"], catch_exceptions=False
    )
    assert [(r["day"], r["requests"]) for r in json.loads(utc.output)] == [("2026-11-02", 1), ("2026-11-03", 2)]
    table = runner.invoke(main, ["report", "--db", str(seeded), "--by", "model"], catch_exceptions=False)
    assert "gpt-4o" in table.output and "$0.000988" in table.output
    assert "1 request(s) are unpriced or only partly priced (10 unpriced tokens)" in table.output
    mistral_line = next(line for line in table.output.splitlines() if "mistral-large-latest" in line)
    assert "$" not in mistral_line and " - " in mistral_line
    empty = runner.invoke(main, ["report", "--db", str(seeded), "--since", "2030-01-01"], catch_exceptions=False)
    assert "no requests in this range" in empty.output
    window = runner.invoke(
        main,
        ["report", "--db", str(seeded), "--by", "model", "--format", "json", "--since", "2026-11-03T00:00:00+00:00"],
        catch_exceptions=False,
    )
    assert sum(r["requests"] for r in json.loads(window.output)) == 2


def test_export_csv_to_file(seeded, tmp_path):
    out = tmp_path / "rows.csv"
    result = CliRunner().invoke(
        main, ["export", "--db", str(seeded), "--format", "csv", "-o", str(out)], catch_exceptions=False
    )
    assert "wrote 3 rows" in result.output
    with out.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["request_id"] for r in rows] == ["r1", "r2", "r3"]
    assert rows[1]["cost_usd"] == "0.000637500000" and rows[2]["cost_usd"] == ""
    assert rows[0]["stream"] == "false" and rows[0]["started_at"] == "2026-11-02T23:30:00+00:00"
    bad = CliRunner().invoke(main, ["export", "--db", str(seeded), "-o", str(tmp_path / "no" / "dir" / "x.csv")])
    assert bad.exit_code != 0 and "cannot write" in bad.output and "Traceback" not in bad.output


def test_config_names_the_ledger_and_errors_are_clean(tmp_path, seeded):
    config = tmp_path / "c.yaml"
    config.write_text(f"ledger: {{path: {seeded.name}}}\nupstreams: [{{name: a, base_url: 'http://x'}}]\n")
    result = CliRunner().invoke(main, ["report", "--config", str(config), "--format", "json", "--by", "model"])
    assert result.exit_code == 0 and len(json.loads(result.output)) == 2
    missing = CliRunner().invoke(main, ["report", "--db", str(tmp_path / "none.duckdb")])
    assert missing.exit_code != 0 and "no ledger" in missing.output and "Traceback" not in missing.output
    bad_tz = CliRunner().invoke(main, ["report", "--db", str(seeded), "--tz", "Mars/Olympus"])
    assert bad_tz.exit_code != 0 and "unknown time zone" in bad_tz.output


def test_parse_when():
    paris = ZoneInfo("Europe/Paris")
    now = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
    assert parse_when("2026-11-01", paris) == dt.datetime(2026, 11, 1, tzinfo=paris)
    assert parse_when("7d", paris, now) == now - dt.timedelta(days=7)
    assert parse_when("90m", paris, now) == now - dt.timedelta(minutes=90)
    assert parse_when(None, paris) is None


def test_serve_needs_a_config_or_an_upstream():
    result = tokenward("serve", check=False)
    assert result.returncode != 0 and "give either --config FILE or --upstream URL" in result.stderr


def test_demo_runs_offline_and_prints_the_report(tmp_path):
    ledger = tmp_path / "demo.duckdb"
    result = CliRunner().invoke(main, ["demo", "--db", str(ledger)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "tokenward spend" in result.output and "gpt-4o-2024-08-06" in result.output
    assert "unpriced or only partly priced" in result.output
    assert ledger.exists() and os.path.getsize(ledger) > 0
    assert Path(str(ledger) + ".spool").exists() is False or not any(Path(str(ledger) + ".spool").iterdir())


def test_drift_against_the_providers_own_cost(tmp_path):
    path = tmp_path / "drift.duckdb"
    now = dt.datetime(2026, 11, 3, 12, 0, tzinfo=dt.UTC).timestamp()
    write_rows(
        path,
        [
            make_row(
                "o1",
                started_at=now,
                ended_at=now,
                served_model="openai/gpt-4.1-mini",
                cost_usd=Decimal("0.0033176"),
                provider_cost_usd=Decimal("0.0133176"),
            ),
            make_row(
                "o2",
                started_at=now,
                ended_at=now,
                served_model="openai/gpt-4.1-mini",
                cost_usd=Decimal("0.001"),
                provider_cost_usd=Decimal("0.001"),
            ),
        ],
    )
    result = CliRunner().invoke(
        main, ["report", "--db", str(path), "--by", "model", "--format", "json", "--drift"], catch_exceptions=False
    )
    (row,) = json.loads(result.output)
    # ours 0.0033176 + 0.001; OpenRouter's 0.0133176 + 0.001 (it adds the $0.01 web search fee)
    assert (row["cost_usd"], row["provider_cost_usd"], row["provider_cost_drift_usd"]) == (
        "0.004317600000",
        "0.014317600000",
        "0.010000000000",
    )
    table = CliRunner().invoke(main, ["report", "--db", str(path), "--by", "model", "--drift"], catch_exceptions=False)
    header = table.output.splitlines()[2:5]
    # the table rounds to 3 significant digits of each column's largest amount
    assert any("provider" in line for line in header) and "$0.0143" in table.output and "$0.0100" in table.output


def test_ledger_migrate_says_what_it_did(tmp_path):
    path = tmp_path / "new.duckdb"
    created = CliRunner().invoke(main, ["ledger", "migrate", "--db", str(path)], catch_exceptions=False)
    from tokenward.reports.ledger import migrations

    assert created.output.startswith(f"created ledger {path} ({len(migrations.MIGRATIONS)} migrations applied)")
    again = CliRunner().invoke(main, ["ledger", "migrate", "--db", str(path)], catch_exceptions=False)
    assert again.output.strip() == f"ledger {path} is up to date"


def test_m004_fills_output_cost_from_stored_cost_lines(tmp_path, monkeypatch):
    from tokenward.reports.ledger import migrations

    conn = duckdb.connect(str(tmp_path / "old.duckdb"))
    monkeypatch.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:3])  # a ledger from before m004
    migrations.migrate(conn)
    lines = [
        {"component": "input", "quantity": 1000, "rate": "2.50", "amount": "0.0025", "rule": "base"},
        {"component": "output", "quantity": 200, "rate": "10.00", "amount": "0.002", "rule": "base"},
        {"component": "reasoning", "quantity": 100, "rate": "12.00", "amount": "0.0012", "rule": "base"},
    ]
    for request_id, cost, stored in (("old", Decimal("0.0057"), json.dumps(lines)), ("unpriced", None, None)):
        row = make_row(request_id, cost_usd=cost, price_status="priced" if cost else "unpriced")
        later = ("output_cost_usd", "cache_savings_usd", "reserved_usd", "output_images", "input_audio_seconds")
        later += ("input_characters", "image_variant")  # columns of migrations after m003
        later += ("org", "pool", "run_id", "sent_model", "degraded")
        later += ("web_fetch_requests", "file_search_calls", "code_containers")  # m010
        later += ("image_generation_calls",)  # m011
        values = {k: v for k, v in row.items() if k not in later}
        values.update(started_at=dt.datetime.now(dt.UTC), ended_at=dt.datetime.now(dt.UTC), cost_lines=stored)
        names = ", ".join(values)
        conn.execute(f"INSERT INTO requests ({names}) VALUES ({', '.join('?' * len(values))})", list(values.values()))
    monkeypatch.undo()
    assert migrations.migrate(conn) == [m.__name__ for m in migrations.MIGRATIONS[3:]]  # m004 and later
    rows = conn.execute("SELECT request_id, output_cost_usd FROM requests ORDER BY request_id").fetchall()
    conn.close()
    # output + reasoning lines: 0.002 + 0.0012 = 0.0032; the unpriced row stays NULL, never $0
    assert rows == [("old", Decimal("0.0032")), ("unpriced", None)]


def test_serve_refuses_a_ledger_it_cannot_write(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = tokenward("serve", "--upstream", "http://127.0.0.1:9/v1", "--db", str(blocker / "l.duckdb"), check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    ledger = blocker / "l.duckdb"  # was "cannot open the ledger L: cannot open ledger L: IO Error ..."
    error = f'Error: cannot open ledger {ledger}: IO Error: Cannot open file "{ledger}": Not a directory'
    assert result.stderr.rstrip().endswith(error)


def test_simulate_serves_recorded_providers(sample):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenward.proxy", "simulate", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/openai/v1", api_key="sk-x", max_retries=0) as c:
                    reply = send_recorded(c, sample[CHAT])
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (8, 10)
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=10)
    assert "providers at http://127.0.0.1:" in stderr and "openai" in stderr


def test_a_usage_unknown_row_is_reconciled_from_the_bill(tmp_path):
    path = tmp_path / "l.duckdb"
    held = dict(price_status="usage_unknown", cost_usd=None, reserved_usd=Decimal("0.0010425"), outcome="client_disconnected")
    write_rows(path, [make_row("gone", **held), make_row("free", **held), make_row("fine")])
    runner = CliRunner()
    done = runner.invoke(main, ["ledger", "reconcile", "gone", "--cost", "0.00031", "--db", str(path)])
    assert done.exit_code == 0 and done.output.strip() == "request gone: priced at $0.00031"
    free = runner.invoke(main, ["ledger", "reconcile", "free", "--not-billed", "--db", str(path)])
    assert free.exit_code == 0 and free.output.strip() == "request free: not_billed"
    again = runner.invoke(main, ["ledger", "reconcile", "gone", "--cost", "1", "--db", str(path)])
    assert again.exit_code == 1 and "is priced, not usage_unknown" in again.output
    both = runner.invoke(main, ["ledger", "reconcile", "fine", "--db", str(path)])
    assert both.exit_code == 2 and "give --cost USD or --not-billed" in both.output
    conn = duckdb.connect(str(path), read_only=True)
    rows = dict(
        (r[0], r[1:])
        for r in conn.execute("SELECT request_id, price_status, cost_usd, price_resolved_by FROM requests").fetchall()
    )
    conn.close()
    assert rows["gone"] == ("priced", Decimal("0.00031"), "reconciled")
    assert rows["free"] == ("not_billed", Decimal(0), "reconciled")


def test_listing_keys_or_alerts_of_a_ledger_never_started_says_so_and_creates_nothing(tmp_path, monkeypatch):
    # `keys list` / `alerts history` in the wrong directory created tokenward.duckdb.state.sqlite
    # there and answered "no stored keys" / "no alerts yet", where `report` says there is no ledger
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for command in (["keys", "list"], ["alerts", "history"], ["keys", "list", "--db", "typo.duckdb"]):
        result = runner.invoke(main, command)
        named = "typo.duckdb" if "--db" in command else "tokenward.duckdb"
        assert result.exit_code == 1, result.output
        assert result.output == f"Error: no ledger at {named} yet: start the proxy once, or check --db/--config\n"
    assert list(tmp_path.iterdir()) == []
    created = runner.invoke(main, ["keys", "create", "ci-bot"])  # a key may be made before the first start
    assert created.exit_code == 0, created.output
    listed = runner.invoke(main, ["keys", "list"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and "ci-bot" in listed.output
    history = runner.invoke(main, ["alerts", "history"])
    assert (history.exit_code, history.output) == (0, "no alerts yet\n")
