"""Every report and CLI command gives the same output on the Postgres ledger as on the DuckDB one, from the same rows.

The rows are the hand-checked November ledger of ``test_reports.py``; they go into Postgres with
``tokenward ledger copy``. Skipped cleanly when Postgres is not installed.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tokenward.proxy.cli import main
from tokenward.reports import queries

from .test_reports import ledger  # noqa: F401 - the seeded DuckDB ledger fixture

RANGE = ["--since", "2026-10-01", "--until", "2026-12-01", "--tz", "Europe/Paris"]
CONFIG = """
upstreams:
  - {name: openai, base_url: 'http://127.0.0.1:9/v1', provider: openai}
budgets:
  - {name: research, limit_usd: 0.1, scope: {team: research}, period: month, timezone: Europe/Paris}
  - {name: all, limit_usd: 1, period: month, action: block}
"""

COMMANDS = [
    *[["report", "--format", "json", "--by", d, *RANGE] for d in queries.DIMENSIONS],
    ["report", "--format", "json", "--by", "team,model,tag", *RANGE],
    ["report", "--format", "json", "--by", "day", "--tz", "America/New_York", "--since", "2026-11-01"],
    ["report", "--format", "json", "--by", "key", "--top", "2", *RANGE],
    ["report", "--format", "json", "--by", "model", "--where", "team=research", "--where", "tag=nightly", *RANGE],
    ["report", "--format", "json", "--by", "model", "--where", "model=gpt-4o", *RANGE],
    ["report", "--format", "json", "--by", "team", "--compare", "--period", "this-month",
     "--at", "2026-11-20T12:00:00+01:00", "--tz", "Europe/Paris"],
    ["report", "--format", "json", "--by", "model", "--forecast", "--period", "this-month",
     "--at", "2026-11-20T12:00:00+01:00"],
    ["report", "--format", "json", "--by", "model", "--as-model", "gpt-4o-mini", *RANGE],
    ["report", "--format", "json", "--by", "provider", "--drift", *RANGE],
    ["report", "--format", "csv", "--by", "model,day", *RANGE],
    ["report", "--format", "markdown", "--by", "key", "--columns", "all", *RANGE],
    ["export"],
    ["export", "--format", "csv", "--since", "2026-11-02", "--until", "2026-11-03"],
    ["budgets", "status", "--at", "2026-11-20T12:00:00+00:00"],
    ["budgets", "check", "--dry-run", "--at", "2026-11-20T12:00:00+00:00"],
    ["alerts", "history"],
    ["keys", "list"],
    ["pricing", "check"],
    ["pricing", "explain", "A"],
    ["pricing", "explain", "B"],
    ["pricing", "reprice", "--dry-run"],
]


@pytest.fixture
def both(ledger, pg_url, tmp_path, monkeypatch):  # noqa: F811 - the fixture imported above
    monkeypatch.setenv("HOME", str(tmp_path))  # the Postgres ledger's report copy goes to ~/.cache
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(main, ["ledger", "copy", "--from", str(ledger), "--to", pg_url],
                                catch_exceptions=False)
    assert "copied 10 rows" in result.output, result.output
    config = tmp_path / "tokenward.yaml"
    config.write_text(CONFIG)
    return str(ledger), pg_url, str(config)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:4]))
def test_every_report_is_the_same_on_both_engines(both, command):
    duck, url, config = both
    extra = ["--config", config] if command[0] in ("budgets", "pricing", "alerts") or "--forecast" in command else []
    runner = CliRunner()
    outputs = []
    for db in (duck, url):
        result = runner.invoke(main, [*command, *extra, "--db", db])
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
        outputs.append((result.exit_code, result.output.replace(db, "<ledger>")))
    assert outputs[0] == outputs[1]
    assert outputs[0][1].strip()


def test_reprice_on_postgres_changes_the_same_rows(both, tmp_path):
    duck, url, config = both
    prices = tmp_path / "prices.yaml"
    prices.write_text(
        "entries:\n  - {id: acme/acme-9, provider: acme, model: acme-9, input: 1000, output: 2000,"
        " source: 'https://acme.example', checked: 2026-11-29}\n"
    )
    runner = CliRunner()
    changed = [
        runner.invoke(main, ["pricing", "reprice", "--prices", str(prices), "--db", db], catch_exceptions=False).output
        for db in (duck, url)
    ]
    assert changed[0] == changed[1]
    # row E: 50 in, 5 out at $1000 / $2000 per 1M: 0.05 + 0.01 = $0.06, newly priced (the seeded
    # rows get their lines written out too, so more rows change, none in cost)
    assert "(1 newly priced, 0 now unpriced)" in changed[0] and "(change $0.060000000000)" in changed[0]
    after = [runner.invoke(main, ["export", "--db", db], catch_exceptions=False).output for db in (duck, url)]
    assert after[0] == after[1]
