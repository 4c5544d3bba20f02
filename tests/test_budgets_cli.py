"""`tokenward budgets` and `tokenward keys`: what an operator runs next to a live proxy."""

from __future__ import annotations

import datetime as dt
import hashlib
import time

import httpx
from click.testing import CliRunner

from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.cli import main
from tokenward.reports.ledger import DuckLedger

from .test_alerts import cost_row, seed
from .test_budgets import budget_proxy, long_prompt_request, register
from .test_budgets import upstream_key as upstream_key  # noqa: F401 - fixture: the simulator's upstream key

RECORD_HEADER = "x-tokenward-sim-record"
CONFIG = """\
upstreams: [{name: a, base_url: "http://upstream.invalid"}]
budgets:
  - {name: research-monthly, limit_usd: 100, scope: {team: research}, period: month, timezone: Europe/Paris,
     notify: [lead@example.com]}
  - {name: agent-daily, limit_usd: 20, scope: {key: agent}, period: day, action: block}
alerts: {smtp: {host: 127.0.0.1, port: 2525, security: none}}
"""


def invoke(*args: str, columns: int = 200) -> str:
    """Run the CLI, its output piped as on a terminal ``columns`` wide (``COLUMNS``)."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False, env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


def test_budgets_status_shows_spend_limit_and_forecast(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    db = tmp_path / "l.duckdb"
    seed(
        db,
        [
            cost_row("a", "2026-11-10T09:00:00+00:00", "40.00"),
            cost_row("b", "2026-11-12T09:00:00+00:00", "15.50", key="batch"),
            cost_row("c", "2026-10-31T22:30:00+00:00", "99.00"),
        ],
    )  # 23:30 in Paris: October's
    output = invoke("budgets", "status", "--config", str(config), "--db", str(db), "--at", "2026-11-12T10:00:00+00:00")
    research = next(line for line in output.splitlines() if "research-monthly" in line)
    # $55.50 of $100 in the Paris month; forecast 55.50 x 720 h / 275 h = $145.31
    for figure in ("team=research", "$55.5000", "$100.00", "55.50", "$44.5000", "$145.31", "alert"):
        assert figure in research, figure
    assert "2026-11-01 00:00 to 2026-12-01 00:00 Europe/Paris" in output
    daily = next(line for line in output.splitlines() if "agent-daily" in line)
    # only "a" is the agent's, and it was on 2026-11-10: the UTC day of 2026-11-12 has $0 so far
    for figure in ("key=agent", "$0.0000", "$20.00", "0.00", "$20.0000", "block"):
        assert figure in daily, figure


def test_budgets_status_piped_fits_80_columns_one_block_per_budget(tmp_path):
    """Piped, the table was printed 150 columns wide; cut to 80 its nine columns were slivers of "resea…"."""
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    db = tmp_path / "l.duckdb"
    seed(db, [cost_row("a", "2026-11-10T09:00:00+00:00", "40.00"), cost_row("b", "2026-11-12T09:00:00+00:00", "15.50")])
    at = "2026-11-12T10:00:00+00:00"
    output = invoke("budgets", "status", "--config", str(config), "--db", str(db), "--at", at, columns=80)
    assert max(len(line) for line in output.splitlines()) <= 80
    # $55.50 of $100 in the Paris month, forecast 55.50 x 720 h / 275 h = $145.31; the agent's
    # $15.50 of its UTC day, forecast 15.50 x 24 h / 10 h = $37.20
    assert output.splitlines() == [
        "research-monthly: $55.5000 of $100.00 (55.50%)",
        "  left      $44.5000",
        "  forecast  $145.31",
        "  at limit  alert",
        "  scope     team=research",
        "  period    2026-11-01 00:00 to 2026-12-01 00:00 Europe/Paris",
        "agent-daily: $15.5000 of $20.00 (77.50%)",
        "  left      $4.5000",
        "  forecast  $37.20",
        "  at limit  block",
        "  scope     key=agent",
        "  period    2026-11-12 00:00 to 2026-11-13 00:00 UTC",
    ]


def test_budgets_status_at_a_past_instant_ignores_later_spend(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    db = tmp_path / "l.duckdb"
    seed(db, [cost_row("a", "2026-11-10T09:00:00+00:00", "40.00"), cost_row("b", "2026-11-12T09:00:00+00:00", "15.50")])
    output = invoke("budgets", "status", "--config", str(config), "--db", str(db), "--at", "2026-11-11T00:00:00+00:00")
    assert "$40.0000" in next(line for line in output.splitlines() if "research-monthly" in line)


def test_budgets_status_keeps_the_figures_of_a_small_budget(tmp_path):
    # A $0.001 budget with 27 gpt-4o-mini requests in it: $0.00003 + 26 x $0.0000315 = $0.000849 spent
    # (84.90 %), $0.000151 left. Four places read "$0.0008" spent and "$0.0002" left: 80 % and 20 %
    # of the limit, beside "84.90". Below a cent the figures keep three significant digits.
    config = tmp_path / "c.yaml"
    config.write_text(
        'upstreams: [{name: a, base_url: "http://upstream.invalid"}]\n'
        "budgets: [{name: tiny-daily, limit_usd: 0.001, scope: {team: research}, period: day, action: block}]\n"
    )
    db = tmp_path / "l.duckdb"
    rows = [cost_row("r00", "2026-11-12T08:00:00+00:00", "0.00003", model="gpt-4o-mini")]
    rows += [
        cost_row(f"r{i:02}", f"2026-11-12T08:{i:02}:00+00:00", "0.0000315", model="gpt-4o-mini") for i in range(1, 27)
    ]
    seed(db, rows)
    output = invoke("budgets", "status", "--config", str(config), "--db", str(db), "--at", "2026-11-12T10:00:00+00:00")
    line = next(line for line in output.splitlines() if "tiny-daily" in line)
    cells = [cell.strip() for cell in line.split("\u2502") if cell.strip()]
    assert cells[3:7] == ["$0.000849", "$0.001", "84.90", "$0.000151"], cells


def test_budgets_check_dry_run_claims_nothing(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    db = tmp_path / "l.duckdb"
    seed(db, [cost_row("a", "2026-11-10T09:00:00+00:00", "85.00")])
    output = invoke(
        "budgets", "check", "--dry-run", "--config", str(config), "--db", str(db), "--at", "2026-11-12T10:00:00+00:00"
    )
    assert (
        "[tokenward] budget research-monthly: 85.00% of $100.00 (crossed 50%, 80%) -> lead@example.com (would send)"
    ) in output
    assert DuckLedger(db).state.claims() == []


def test_budgets_status_needs_budgets(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("upstreams: [{name: a, base_url: 'http://x'}]\n")
    result = CliRunner().invoke(
        main, ["budgets", "status", "--config", str(config), "--db", str(tmp_path / "l.duckdb")]
    )
    assert result.exit_code == 1 and "no budgets configured" in result.output


def keys_proxy(start_proxy, simulator, recording: str):
    """A proxy in virtual_keys mode with an $5 ops budget, and a chat request recorded as 17 in / 5 out tokens."""
    request = long_prompt_request(10, 5)
    register(simulator, recording, request, prompt_tokens=17, completion_tokens=5)
    budget = BudgetSettings(name="ops-daily", limit_usd=5, scope={"team": "ops"}, period="day")
    return request, budget_proxy(start_proxy, simulator, [budget])


def test_a_key_created_with_an_expiry_is_refused_once_it_has_expired(start_proxy, simulator):
    """``keys create --expires`` (a key for a contractor, a CI run): past it, 401 ``key_expired`` and the refusal's row."""
    request, proxy = keys_proxy(start_proxy, simulator, "expiring")
    db = str(proxy.ledger)
    later = invoke("keys", "create", "contractor", "--team", "ops", "--expires", "30d", "--db", db).splitlines()[0]
    # a key that has expired already (as a 30 d key is a month on), stored through the same state store
    from tokenward.reports.keys import create_key

    created = dt.datetime.now(dt.UTC) - dt.timedelta(days=31)
    expired = create_key(
        DuckLedger(proxy.ledger).state,
        "old-ci",
        team="ops",
        project=None,
        now=created,
        expires_at=created + dt.timedelta(days=30),
    )
    job = proxy.app.state.scheduler.get_job("keys")  # the proxy re-reads stored keys every 5 s: now
    job.modify(next_run_time=dt.datetime.now(dt.UTC))
    headers = {RECORD_HEADER: "expiring"}

    def call(key: str) -> httpx.Response:
        return httpx.post(
            f"{proxy.url}/v1/chat/completions", json=request, headers={**headers, "authorization": f"Bearer {key}"}
        )

    deadline = time.monotonic() + 10
    while call(later).status_code == 401 and time.monotonic() < deadline:  # until the reload has run
        time.sleep(0.1)
    refused = call(expired)
    assert refused.status_code == 401
    message = refused.json()["error"]
    assert message["code"] == "key_expired" and message["type"] == "invalid_request_error"
    assert message["message"].startswith("The tokenward virtual key 'old-ci' expired at ")
    (row,) = proxy.rows(expect=1, where="WHERE http_status = 401 AND error LIKE '%old-ci%'")
    assert (row["outcome"], row["cost_usd"], row["upstream"]) == ("unauthorized", 0, None)  # never sent
    listing = invoke("keys", "list", "--db", db)
    contractor = next(line for line in listing.splitlines() if "contractor" in line)
    assert "live" in contractor and "never" not in contractor
    assert "expired" in next(line for line in listing.splitlines() if "old-ci" in line)
    past = CliRunner().invoke(main, ["keys", "create", "late", "--expires", "2020-01-01", "--db", db])
    assert past.exit_code == 1 and "has passed already" in past.output


def test_keys_created_on_the_command_line_work_in_the_running_proxy(start_proxy, simulator):
    request, proxy = keys_proxy(start_proxy, simulator, "keys")
    db = str(proxy.ledger)

    def call(key: str) -> httpx.Response:
        return httpx.post(
            f"{proxy.url}/v1/chat/completions",
            json=request,
            headers={"authorization": f"Bearer {key}", RECORD_HEADER: "keys"},
        )

    def reload_now() -> None:
        # the proxy re-reads stored keys every 5 s; bring that job forward instead of waiting
        job = proxy.app.state.scheduler.get_job("keys")
        job.modify(next_run_time=dt.datetime.now(dt.UTC))
        time.sleep(0.5)

    key = invoke("keys", "create", "bot", "--team", "ops", "--project", "triage", "--db", db).splitlines()[0]
    assert key.startswith("tw-") and len(key) > 40
    assert call(key).status_code == 401  # not yet loaded
    reload_now()
    reply = call(key)
    assert reply.status_code == 200
    (row,) = proxy.rows(expect=1, where="WHERE principal = 'bot'")
    # 17 input x $2.50 + 5 output x $10.00 per 1M tokens = $0.0000925, attributed to the key's team
    assert (row["team"], row["project"], row["input_tokens"], row["output_tokens"]) == ("ops", "triage", 17, 5)
    assert str(row["cost_usd"].normalize()) == "0.0000925"
    assert row["key_id"] == "vk-" + hashlib.sha256(key.encode()).hexdigest()[:12]  # the key is never stored
    listing = invoke("keys", "list", "--db", db)
    assert "bot" in listing and "ops" in listing and "live" in listing and key not in listing
    # spend this UTC month beside each key: the one request's $0.0000925
    assert "$0.0000925" in next(line for line in listing.splitlines() if "bot" in line)
    assert "revoked" in invoke("keys", "revoke", "bot", "--db", db)
    reload_now()
    refused = call(key)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert "revoked" in invoke("keys", "list", "--db", db)
    duplicate = CliRunner().invoke(main, ["keys", "create", "bot", "--db", db])
    assert duplicate.exit_code == 1 and "a key named 'bot' was revoked" in duplicate.output
    empty = CliRunner().invoke(main, ["keys", "create", " ", "--db", db])
    assert empty.exit_code == 1 and "a key needs a name" in empty.output


KEYS_CONFIG = """\
upstreams: [{name: a, base_url: "http://upstream.invalid"}]
auth: {mode: virtual_keys}
ledger: {path: l.duckdb}
virtual_keys:
  - {name: demo, key: tw-demo-0001, team: web}
  - {name: ci, key: tw-ci-0001, expires: 2026-01-31}
  - {name: gone, key: tw-gone-0001}
"""


def test_keys_list_shows_config_keys_revoked_ones_included_and_fits_80_columns(tmp_path):
    """Before: `keys list` showed stored keys only (a revoked config key nowhere), and cut its nine columns at 80."""
    from tokenward.reports.keys import create_key, revoke_key

    config = tmp_path / "c.yaml"
    config.write_text(KEYS_CONFIG)
    # no ledger yet: the file's keys are listed all the same (before: "no ledger at ... yet")
    fresh = invoke("keys", "list", "--config", str(config), columns=80)
    assert [line for line in fresh.splitlines() if not line.startswith(" ")] == ["demo: live", "ci: expired", "gone: live"]
    typo = CliRunner().invoke(main, ["keys", "list", "--config", str(config), "--db", str(tmp_path / "typo.duckdb")])
    assert typo.exit_code == 1 and "no ledger at" in typo.output  # a --db that is not there is still refused
    state = DuckLedger(tmp_path / "l.duckdb").state
    at = dt.datetime(2026, 11, 20, 9, 15, tzinfo=dt.UTC)
    revoke_key(state, "gone", now=at, configured={"gone": hashlib.sha256(b"tw-gone-0001").hexdigest()})
    create_key(state, "bot", team="ops", project="triage", now=at, expires_at=dt.datetime(2027, 1, 31, tzinfo=dt.UTC))
    narrow = invoke("keys", "list", "--config", str(config), columns=80)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    month = f"{dt.datetime.now(dt.UTC):%Y-%m}"
    assert narrow.splitlines() == [
        "demo: live",
        "  from      config",
        "  team      web",
        "  project   -",
        "  role      user",
        "  created   -",
        "  expires   never",
        f"  spent     $0.0000 in {month}",
        "ci: expired",
        "  from      config",
        "  team      -",
        "  project   -",
        "  role      user",
        "  created   -",
        "  expires   2026-01-31 00:00 UTC",
        f"  spent     $0.0000 in {month}",
        "gone: revoked 2026-11-20 09:15 UTC",
        "  from      config",
        "  team      -",
        "  project   -",
        "  role      user",
        "  created   -",
        "  expires   never",
        f"  spent     $0.0000 in {month}",
        "bot: live",
        "  from      stored",
        "  team      ops",
        "  project   triage",
        "  role      user",
        "  created   2026-11-20 09:15 UTC",
        "  expires   2027-01-31 00:00 UTC",
        f"  spent     $0.0000 in {month}",
    ]
    config.write_text(KEYS_CONFIG.replace("  - {name: gone, key: tw-gone-0001}\n", ""))  # taken out of the file
    wide = invoke("keys", "list", "--config", str(config), columns=200)
    gone = next(line for line in wide.splitlines() if "gone" in line)
    assert "config, removed" in gone and "revoked 2026-11-20 09:15 UTC" in gone
    assert "…" not in wide and "ops" in next(line for line in wide.splitlines() if "bot" in line)
    bare = invoke("keys", "list", "--db", str(tmp_path / "l.duckdb"), columns=200)  # without --config: the record
    assert [line.split("│")[1].strip() for line in bare.splitlines() if "│" in line] == ["gone", "bot"]


def test_revoking_a_key_twice_or_one_that_is_not_there_says_which(tmp_path):
    """Before: "no live key named 'demo'" for a key revoked a minute ago, as for a typo."""
    config = tmp_path / "c.yaml"
    config.write_text(KEYS_CONFIG)

    def revoke(*args: str) -> str:
        result = CliRunner().invoke(main, ["keys", "revoke", *args])
        assert result.exit_code == (0 if result.output.startswith("key ") and "already" not in result.output else 1)
        return result.output

    assert revoke("demo", "--config", str(config)) == "key 'demo' revoked\n"
    again = revoke("demo", "--config", str(config))
    assert again.startswith("Error: key 'demo' was revoked already, at ") and again.endswith(" UTC\n")
    assert revoke("demoo", "--config", str(config)) == (
        f"Error: no key named 'demoo': neither stored nor in {config}'s virtual_keys\n"
    )
    db = str(tmp_path / "l.duckdb")
    assert revoke("demo", "--db", db) == "Error: no stored key named 'demo' (a key of the config file: add --config FILE)\n"
