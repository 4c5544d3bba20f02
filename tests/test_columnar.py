"""`tokenward report --format csv|json|parquet` written by DuckDB (reports/columnar.py): the bytes the Python rows gave.

The ledger's keys hold what CSV must quote and JSON must escape; its figures sit on rounding ties:

| key            | rows | input | cached | cost (USD)       | output cost   | hit                    | output share          | avg/request                    |
|----------------|------|-------|--------|------------------|---------------|------------------------|-----------------------|--------------------------------|
| `a,b`          | 1    | 20000 | 1      | 0.00002          | 0.000000001   | 0.00005 -> 0.0000      | 0.00005 -> 0.0000     | 0.000020000000                 |
| `say "hi"`     | 1    | 20000 | 3      | 0.00002          | 0.000000003   | 0.00015 -> 0.0002      | 0.00015 -> 0.0002     | 0.000020000000                 |
| `line\\nbreak` | 2    | 3     | 1      | 1e-12 + 2e-12    | 1e-12 + 1e-12 | 1/3 -> 0.3333          | 2/3 -> 0.6667         | 1.5e-12 -> 0.000000000002      |
| `café😀\\a\\x7f\\\\` | 2 | 0 | 0      | 1e-12 + 0        | 0             | none (no input)        | 0.0000                | 0.5e-12 -> 0.000000000000      |
| `cr\\rtab\\t`  | 1    | 10    | 0      | unpriced         |               | 0.0000                 | none                  | none                           |

Ties round half to even, as ``Decimal.quantize`` does in ``queries.derive``.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenward.proxy.cli import main
from tokenward.reports import queries, report_cli
from tokenward.reports.ledger import write_rows

from .test_reports import row

D = Decimal
KEYS = ["a,b", 'say "hi"', "line\nbreak", "café😀\x07\x7f\\", "cr\rtab\t"]


@pytest.fixture
def ties(tmp_path: Path) -> Path:
    path = tmp_path / "ties.duckdb"
    when = "2026-11-0{}T10:00:00+00:00"

    def one(n: int, key: str, cost: str | None, **extra) -> dict:
        extra.setdefault("input_tokens", 0)
        extra.setdefault("cached_input_tokens", 0)
        return row(f"r{n}", when.format(1 + n % 3), key, f"team {n % 2}", "gpt-4o", cost, **extra)

    rows = [
        one(1, KEYS[0], "0.00002", input_tokens=20000, cached_input_tokens=1, output_cost_usd=D("0.000000001")),
        one(2, KEYS[1], "0.00002", input_tokens=20000, cached_input_tokens=3, output_cost_usd=D("0.000000003")),
        one(3, KEYS[2], "0.000000000001", input_tokens=1, cached_input_tokens=1, output_cost_usd=D("1E-12")),
        one(4, KEYS[2], "0.000000000002", input_tokens=2, output_cost_usd=D("1E-12"), tags=["x,y", "é"]),
        one(5, KEYS[3], "0.000000000001", output_cost_usd=D(0), session_id='s"1'),
        one(6, KEYS[3], "0", output_cost_usd=D(0), tags=["x,y"]),
        one(7, KEYS[4], None, input_tokens=10, price_status="unpriced", end_user="tab\there"),
    ]
    write_rows(path, rows)
    return path


def run(ledger: Path, *args: str) -> str:
    result = CliRunner().invoke(main, ["report", "--db", str(ledger), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_csv_quotes_and_rounds_as_the_python_rows_did(ties, monkeypatch):
    text = run(ties, "--by", "key", "--format", "csv", "--columns", "cost_usd,cache_hit_rate,output_share,avg_cost_usd")
    assert text == (
        "key,cost_usd,cache_hit_rate,output_share,avg_cost_usd\n"
        '"a,b",0.000020000000,0.0000,0.0000,0.000020000000\n'
        "café😀\x07\x7f\\,0.000000000001,,0.0000,0.000000000000\n"
        "cr\rtab\t,,0.0000,,\n"
        '"line\nbreak",0.000000000003,0.3333,0.6667,0.000000000002\n'
        '"say ""hi""",0.000020000000,0.0002,0.0002,0.000020000000\n'
    )
    escaped = json.loads(run(ties, "--by", "key", "--format", "json", "--columns", "cost_usd"))
    assert [r["key"] for r in escaped] == sorted(KEYS)
    raw = run(ties, "--by", "key", "--format", "json", "--columns", "cost_usd")
    assert '"key": "caf\\u00e9\\ud83d\\ude00\\u0007\\u007f\\\\"' in raw and '"key": "cr\\rtab\\t"' in raw


def test_every_group_is_written_without_python_rows(ties, monkeypatch, tmp_path):
    def built(*args, **kwargs):
        raise AssertionError("rows built in Python")

    monkeypatch.setattr(queries, "spend_report", built)
    sessions = run(ties, "--by", "session", "--format", "csv").splitlines()
    assert [line.split(",")[:2] for line in sessions] == [["session", "requests"], ["(none)", "6"], ['"s""1"', "1"]]
    tags = json.loads(run(ties, "--by", "tag", "--format", "json"))
    assert [(t["tag"], t["requests"], t["cost_usd"]) for t in tags] == [
        ("(none)", 5, "0.000040000002"),  # rows 1, 2, 3, 5 (7 is unpriced)
        ("x,y", 2, "0.000000000002"),
        ("é", 1, "0.000000000002"),
    ]
    run(ties, "--by", "day,team", "--format", "parquet", "-o", str(tmp_path / "r.parquet"))


GROUPINGS = ["key", "team", "day", "week", "month", "model,team", "session", "end_user", "tag", "team,tag", "hour"]
OPTIONS = [[], ["--top", "2"], ["--columns", "requests,cost_usd"], ["--columns", "all"], ["--drift"]]


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
@pytest.mark.parametrize("by", GROUPINGS)
def test_the_same_bytes_as_the_python_rows(ties, monkeypatch, tmp_path, fmt, by):
    for options in [*OPTIONS, ["--tz", "America/New_York", "--since", "2026-11-02", "--where", "tag=x,y"]]:
        outputs = []
        for duckdb_writes in (True, False):
            if not duckdb_writes:
                monkeypatch.setattr(report_cli, "_made_by_duckdb", lambda *a, **k: None)
            out = tmp_path / f"{duckdb_writes}.parquet"
            text = run(ties, "--by", by, "--format", fmt, *options, *(["-o", str(out)] if fmt == "parquet" else []))
            outputs.append(out.read_bytes() if fmt == "parquet" else text)
        monkeypatch.undo()
        assert outputs[0] == outputs[1], options


def test_no_group_is_written_as_before(ties, tmp_path):
    assert run(ties, "--by", "key", "--format", "csv", "--since", "2030-01-01").startswith("key,requests,")
    assert run(ties, "--by", "key", "--format", "json", "--since", "2030-01-01") == "[]\n"
