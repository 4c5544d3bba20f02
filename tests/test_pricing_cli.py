"""Price imports, re-pricing history, the pricing commands, the unpriced policies, scheduled refresh."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from tokenward.pricing.catalog import load_catalog, read_file
from tokenward.pricing.cost import price
from tokenward.pricing.imports import from_litellm, from_sheet, to_yaml
from tokenward.pricing.settings import RefreshSettings
from tokenward.pricing.usage import Usage
from tokenward.proxy.cli import main
from tokenward.proxy.config import UpstreamConfig
from tokenward.proxy.scheduler import refresh_prices
from tokenward.reports.ledger import open_ledger, write_rows

from .test_ledger import make_row

EXCERPT = Path(__file__).parent / "fixtures" / "litellm_excerpt.json"
SOURCE = "https://github.com/BerriAI/litellm/blob/v1.110.2/model_prices_and_context_window.json"


def test_litellm_import_keeps_rates_cliffs_and_tiers_exactly(tmp_path):
    entries = from_litellm(json.loads(EXCERPT.read_text()), source=SOURCE, checked=dt.date(2026, 11, 29))
    ids = [e["id"] for e in entries]
    assert ids == [
        "anthropic/claude-sonnet-4-5",
        "deepseek/deepseek-chat",
        "google/gemini-2.5-pro",
        "mistral/mistral-large-latest",
        "openai/gpt-5.4",
        "openai/text-embedding-3-small",
        "qwen/qwen3-max",
    ]
    path = tmp_path / "imported.yaml"
    path.write_text(to_yaml(entries, "test"))
    catalog = load_catalog([path], builtin=False)
    gpt = catalog.entries["openai/gpt-5.4"]
    # LiteLLM per token 2.5e-06 -> $2.50 per 1M, exactly
    assert (gpt.rates.input, gpt.rates.cached_input, gpt.rates.output) == (
        Decimal("2.5"),
        Decimal("0.25"),
        Decimal("15"),
    )
    assert [t.threshold for t in gpt.context_tiers] == [272000]
    assert dict(gpt.service_tiers)["priority"].rates == (
        ("cached_input", Decimal("0.5")),
        ("input", Decimal("5")),
        ("output", Decimal("30")),
    )
    # above 272K: 300000 * 5 + 1000 * 22.5 = 1522500 -> $1.5225
    resolution = catalog.resolve("gpt-5.4", "openai")
    assert price(Usage(input_tokens=300_000, output_tokens=1000), resolution).total == Decimal("1.5225")
    qwen = catalog.entries["qwen/qwen3-max"]  # DashScope range list -> cliffs at 32000 and 128000
    assert [(t.threshold, dict(t.adjustment.rates)["input"]) for t in qwen.context_tiers] == [
        (128000, Decimal("3")),
        (32000, Decimal("2.4")),
    ]
    sonnet = catalog.entries["anthropic/claude-sonnet-4-5"]
    assert (sonnet.rates.cache_write, sonnet.rates.cache_write_1h) == (Decimal("3.75"), Decimal("6"))
    assert catalog.entries["deepseek/deepseek-chat"].rates.cached_input == Decimal("0.028")


def test_b23_price_sheet_units_are_normalised(tmp_path):
    # field case B23: per-1M meters must not be lost; per-token and per-1K meters convert too
    rows = [
        {"provider": "azure", "model": "gpt-5", "component": "input", "unit": "1M", "price": "1.25"},
        {"provider": "azure", "model": "gpt-5", "component": "output", "unit": "1K", "price": "0.01"},
        {"provider": "azure", "model": "gpt-5-mini", "component": "input", "unit": "token", "price": "0.00000025"},
        {"provider": "azure", "model": "gpt-5-mini", "component": "output", "unit": "token", "price": "0.000002"},
    ]
    entries = from_sheet(rows, source="https://example.com/sheet", checked=dt.date(2026, 11, 29))
    path = tmp_path / "sheet.yaml"
    path.write_text(to_yaml(entries))
    catalog = load_catalog([path], builtin=False)
    assert (catalog.entries["azure/gpt-5"].rates.output, catalog.entries["azure/gpt-5-mini"].rates.input) == (
        Decimal("10"),
        Decimal("0.25"),
    )
    usage = Usage(input_tokens=3000, output_tokens=800, reasoning_tokens=512)
    # 3000 * 1.25 + 800 * 10.00 = 11750 -> $0.01175
    assert price(usage, catalog.resolve("gpt-5", "azure")).total == Decimal("0.01175")
    with pytest.raises(ValueError, match="unit"):
        from_sheet(
            [{"provider": "a", "model": "m", "component": "input", "unit": "1G", "price": 1}],
            source="s",
            checked=dt.date(2026, 1, 1),
        )


def test_import_command_writes_a_loadable_price_file(tmp_path):
    out = tmp_path / "mine.yaml"
    result = CliRunner().invoke(
        main,
        [
            "pricing",
            "import",
            str(EXCERPT),
            "--format",
            "litellm",
            "--providers",
            "openai,qwen",
            "--source",
            SOURCE,
            "--checked",
            "2026-11-29",
            "-o",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert result.output.strip() == f"wrote 3 entries to {out}"
    assert [e.id for e in read_file(out)] == ["openai/gpt-5.4", "openai/text-embedding-3-small", "qwen/qwen3-max"]
    sheet = tmp_path / "sheet.csv"
    sheet.write_text("provider,model,component,unit,price\nacme,acme-1,input,1M,2\nacme,acme-1,output,1K,0.008\n")
    result = CliRunner().invoke(
        main,
        ["pricing", "import", str(sheet), "--format", "sheet", "--source", "s", "-o", str(out)],
        catch_exceptions=False,
    )
    assert "wrote 1 entries" in result.output
    (entry,) = read_file(out)
    assert (entry.rates.input, entry.rates.output) == (Decimal("2"), Decimal("8"))


def test_import_command_refuses_a_bad_date_or_a_file_that_is_no_json_in_one_line(tmp_path):
    out = tmp_path / "mine.yaml"
    base = ["pricing", "import", str(EXCERPT), "--format", "litellm", "--source", SOURCE, "-o", str(out)]
    when = CliRunner().invoke(main, [*base, "--checked", "yesterday"])  # before: a ValueError traceback
    assert when.exit_code == 2 and when.output.endswith(
        "Error: Invalid value for --checked: 'yesterday' is not a date like 2026-12-01\n"
    )
    sheet = tmp_path / "prices.csv"
    sheet.write_text("provider,model,component,unit,price\n")
    wrong = CliRunner().invoke(main, ["pricing", "import", str(sheet), "--format", "litellm", "--source", SOURCE, "-o", str(out)])
    assert wrong.exit_code == 1 and wrong.output == (
        f"Error: cannot import {sheet}: not JSON (Expecting value: line 1 column 1 (char 0)): "
        "LiteLLM's model_prices_and_context_window.json is\n"
    )
    assert not out.exists()


def test_show_names_the_entry_rules_and_source():
    result = CliRunner().invoke(main, ["pricing", "show", "qwen3-max", "--provider", "qwen"], catch_exceptions=False)
    assert "qwen/qwen3-max" in result.output and "context>32000" in result.output and "source:" in result.output
    missing = CliRunner().invoke(main, ["pricing", "show", "nothing-like-it-9"])
    assert missing.exit_code != 0 and "no price for 'nothing-like-it-9'" in missing.output
    assert "did you mean" not in missing.output
    typo = CliRunner().invoke(main, ["pricing", "show", "gpt-4o-mnii"])  # before: no hint, as `config check` gives
    assert typo.exit_code == 1 and typo.output == "Error: no price for 'gpt-4o-mnii' (did you mean 'gpt-4o-mini'?)\n"


@pytest.fixture
def history(tmp_path):
    """A ledger with one priced gpt-4o row, one row for a then-unpriced model, and a config."""
    ledger = tmp_path / "ledger.duckdb"
    old = dt.datetime(2026, 11, 1, 12, 0, tzinfo=dt.UTC).timestamp()
    new = dt.datetime(2026, 11, 20, 12, 0, tzinfo=dt.UTC).timestamp()
    write_rows(
        ledger,
        [
            make_row(
                "priced-old",
                started_at=old,
                ended_at=old,
                provider="openai",
                served_model="gpt-4o",
                input_tokens=1000,
                output_tokens=100,
                cost_usd=Decimal("0.0035"),
                output_cost_usd=Decimal("0.001"),  # 100 x $10 per 1M
                cache_savings_usd=Decimal(0),
                price_entry_id="openai/gpt-4o",
                cost_lines=[
                    {
                        "component": "input",
                        "quantity": 1000,
                        "rate": Decimal("2.50"),
                        "amount": Decimal("0.0025"),
                        "rule": "base",
                    },
                    {
                        "component": "output",
                        "quantity": 100,
                        "rate": Decimal("10.00"),
                        "amount": Decimal("0.001"),
                        "rule": "base",
                    },
                ],
            ),
            make_row(
                "unpriced-new",
                started_at=new,
                ended_at=new,
                provider="acme",
                served_model="acme-1",
                input_tokens=1200,
                output_tokens=300,
                cost_usd=None,
                price_status="unpriced",
                cost_lines=None,
            ),
        ],
    )
    prices = tmp_path / "prices.yaml"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"ledger: {{path: {ledger.name}}}\npricing: {{files: [{prices.name}]}}\n"
        "upstreams: [{name: a, base_url: 'http://x'}]\n"
    )
    return ledger, prices, config


def test_b24_reprice_prices_rows_once_a_price_exists_and_keeps_history(history):
    ledger, prices, config = history
    prices.write_text(
        "entries:\n"
        "  - {id: acme/acme-1, provider: acme, model: acme-1, input: 2, output: 8, source: 'https://acme.example', "
        "checked: 2026-11-29}\n"
        # gpt-4o gets cheaper from 2026-11-15: the 2026-11-01 row must keep the old price
        "  - {id: openai/gpt-4o, provider: openai, model: gpt-4o, effective: 2026-11-15, input: 2.00, cached_input: 1.00,"
        " output: 8.00, source: 'https://example.com', checked: 2026-11-29}\n"
    )
    check = CliRunner().invoke(main, ["pricing", "check", "--config", str(config)])
    assert check.exit_code == 0 and "every model in the ledger has a price" in check.output
    dry = CliRunner().invoke(main, ["pricing", "reprice", "--config", str(config), "--dry-run"], catch_exceptions=False)
    # acme-1: 1200 * 2 + 300 * 8 = 4800 -> $0.0048; gpt-4o row unchanged at $0.0035
    assert "2 metered rows checked, 1 would change (1 newly priced, 0 now unpriced)" in dry.output
    assert "total $0.003500000000 -> $0.008300000000" in dry.output
    conn = open_ledger(ledger, read_only=True)
    assert conn.execute("SELECT price_status FROM requests WHERE request_id = 'unpriced-new'").fetchone() == (
        "unpriced",
    )
    conn.close()
    CliRunner().invoke(main, ["pricing", "reprice", "--config", str(config)], catch_exceptions=False)
    conn = open_ledger(ledger, read_only=True)
    rows = dict(conn.execute("SELECT request_id, cost_usd FROM requests").fetchall())
    status = conn.execute(
        "SELECT price_status, price_entry_id FROM requests WHERE request_id = 'unpriced-new'"
    ).fetchone()
    conn.close()
    assert rows == {"priced-old": Decimal("0.0035"), "unpriced-new": Decimal("0.0048")}
    assert status == ("priced", "acme/acme-1")
    explain = CliRunner().invoke(
        main, ["pricing", "explain", "unpriced-new", "--db", str(ledger)], catch_exceptions=False
    )
    assert "acme/acme-1" in explain.output and "total: $0.004800000000" in explain.output
    assert "1,200" in explain.output and "2 per 1M" in explain.output


def test_check_lists_unpriced_models_and_fails(history):
    ledger, _, _ = history
    result = CliRunner().invoke(main, ["pricing", "check", "--db", str(ledger)])
    assert result.exit_code == 1
    assert "1 model(s) have no price" in result.output and "1 requests, 1,500 tokens" in result.output


def test_block_policy_refuses_unpriced_models_before_forwarding(start_proxy, simulator):
    upstream = UpstreamConfig(
        name="openai", base_url=f"{simulator.url}/openai/v1", default=True, provider="openai", unpriced="block"
    )
    proxy = start_proxy(upstreams=[upstream])
    before = simulator.simulator.received
    reply = httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "brand-new-model-9", "messages": []})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "model_not_priced"
    assert simulator.simulator.received == before  # never reached the provider
    (row,) = proxy.rows(1)
    assert (row["outcome"], row["price_status"], row["cost_usd"]) == ("rejected", "not_billed", 0)
    # explain said "entry None (None)" and not why the row costs nothing
    explain = CliRunner().invoke(main, ["pricing", "explain", row["request_id"], "--db", str(proxy.ledger)])
    assert explain.exit_code == 0, explain.output
    lines = explain.output.splitlines()
    assert lines[1] == "  price status not_billed, no price entry, usage none"
    assert lines[2].startswith("  outcome rejected (HTTP 400): tokenward has no price for model 'brand-new-model-9'")
    assert "None" not in explain.output and lines[-1] == "  total: $0.000000000000"


def test_fallback_policy_prices_unknown_models_and_says_so(start_proxy, simulator):
    from tokenward.pricing.settings import PricingSettings
    from tokenward.proxy.simulator import Recording

    request = {"model": "mystery-1", "messages": [{"role": "user", "content": "hi"}]}
    body = {
        "id": "m",
        "object": "chat.completion",
        "model": "mystery-1",
        "choices": [],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100},
    }
    simulator.simulator.add(
        Recording(
            "mystery",
            "x",
            "openai",
            "chat_completions",
            False,
            {"body": request},
            {"status": 200, "content_type": "application/json", "body": body},
            None,
        )
    )
    upstream = UpstreamConfig(name="x", base_url=f"{simulator.url}/x/v1", default=True, unpriced="fallback")
    proxy = start_proxy(upstreams=[upstream], pricing=PricingSettings(fallback={"input": 5.0, "output": 15.0}))
    httpx.post(f"{proxy.url}/v1/chat/completions", json=request, headers={"x-tokenward-sim-record": "mystery"})
    (row,) = proxy.rows(1)
    # 1000 * 5 + 100 * 15 = 6500 -> $0.0065, and the row says it is the fallback price
    assert (row["price_status"], row["cost_usd"], row["price_entry_id"]) == ("fallback", Decimal("0.0065"), "fallback")


async def test_scheduled_refresh_adds_versions_without_editing_history(tmp_path):
    document = json.loads(EXCERPT.read_text())
    document["gpt-5.4"] = dict(document["gpt-5.4"], input_cost_per_token=2e-06)  # price cut: 2.50 -> 2.00
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=document))
    catalog = load_catalog()
    installed = []
    refresh_file = tmp_path / "refreshed.yaml"
    settings = RefreshSettings(url="https://prices.example/map.json", providers=["openai"])
    now = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.UTC)
    changes = await refresh_prices(
        settings,
        str(refresh_file),
        lambda: catalog,
        lambda: load_catalog([refresh_file]),
        installed.append,
        now=now,
        transport=transport,
    )
    assert any(change.startswith("openai/gpt-5.4: input 2.50 -> 2") for change in changes)
    assert not any(change.startswith("openai/text-embedding-3-small") for change in changes)  # same base price
    (new,) = installed
    usage = Usage(input_tokens=1000, output_tokens=0)
    before = new.resolve("gpt-5.4", "openai", now - dt.timedelta(seconds=1))
    after = new.resolve("gpt-5.4", "openai", now)
    assert (before.entry.rates.input, after.entry.rates.input) == (Decimal("2.50"), Decimal("2"))
    assert after.entry.version_id == "openai/gpt-5.4@2026-12-01T09:00:00Z"
    # the map's own 272K cliff and service tiers come with the new version
    assert [t.threshold for t in after.entry.context_tiers] == [272000] and after.entry.service_tiers
    assert price(usage, after).total == Decimal("0.002")
    # a second refresh with the same prices changes nothing
    again = await refresh_prices(
        settings,
        str(refresh_file),
        lambda: new,
        lambda: load_catalog([refresh_file]),
        installed.append,
        now=now + dt.timedelta(days=1),
        transport=transport,
    )
    assert again == [] and len(installed) == 1


def test_refresh_keeps_rules_the_fetched_map_lacks():
    from tokenward.pricing.refresh import plan_refresh

    catalog = load_catalog()
    now = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    current = catalog.version_at("deepseek/deepseek-v4-flash", now)
    assert current.windows  # the curated peak windows
    document = {
        "deepseek/deepseek-v4-flash": {
            "litellm_provider": "deepseek",
            "mode": "chat",
            "input_cost_per_token": 2.5e-07,
            "output_cost_per_token": 5e-07,
        }
    }
    plan = plan_refresh(catalog, document, now=now, source="https://prices.example")
    (entry,) = plan.entries
    assert [w["name"] for w in entry["windows"]] == [w.name for w in current.windows]
    assert plan.changes[0].endswith("(windows kept from the previous version)")


def test_explain_gives_each_tool_fee_per_call_or_per_container(tmp_path):
    ledger = tmp_path / "ledger.duckdb"
    lines = [
        {"component": "input", "quantity": 1000, "rate": "2.00", "amount": "0.002", "rule": "base"},
        {"component": "file_search", "quantity": 2, "rate": "0.0025", "amount": "0.005", "rule": "base"},
        {"component": "code_container", "quantity": 2, "rate": "0.03", "amount": "0.06", "rule": "base"},
        {"component": "web_fetch", "quantity": 3, "rate": "0", "amount": "0", "rule": "base"},
    ]
    row = make_row("tools", cost_usd=Decimal("0.067"), cost_lines=lines, file_search_calls=2)
    write_rows(ledger, [row])
    explain = CliRunner().invoke(main, ["pricing", "explain", "tools", "--db", str(ledger)], catch_exceptions=False)
    # before, every fee but web_search's was shown "per 1M" (tokens): "0.03 per 1M" for a $0.03 container
    assert "0.0025 per call" in explain.output and "0.03 per container" in explain.output
    assert "0 per call" in explain.output and "2.00 per 1M" in explain.output
