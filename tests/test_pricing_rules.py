"""Every pricing rule kind, with costs worked out by hand (USD per 1M tokens unless stated)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenward.pricing.catalog import load_catalog
from tokenward.pricing.cost import price
from tokenward.pricing.quote import quote
from tokenward.pricing.usage import Usage

RULES = """
entries:
  # field cases B19: gemini-2.5-pro, whole request above 200K at the higher rates ('>' 200000)
  - id: t/gemini-2.5-pro
    provider: t
    model: gemini-2.5-pro
    input: 1.25
    cached_input: 0.31
    output: 10.00
    context_tiers:
      - {above: 200000, input: 2.50, cached_input: 0.625, output: 15.00}
    source: https://example.com/b19
    checked: 2026-11-29
  # B20: claude-sonnet-4, cliff counted on all input incl. cache reads and writes
  - id: t/claude-sonnet-4
    provider: t
    model: claude-sonnet-4
    input: 3.00
    cached_input: 0.30
    cache_write: 3.75
    cache_write_1h: 6.00
    output: 15.00
    context_tiers:
      - {above: 200000, input: 6.00, cached_input: 0.60, cache_write: 7.50, cache_write_1h: 12.00, output: 22.50}
    service_tiers:
      batch: {multiplier: 0.5}
      fast: {multiplier: 6}
    web_search: 0.01
    source: https://example.com/b20
    checked: 2026-11-29
  # an inclusive cliff ('>=') and two tiers
  - id: t/qwen-max
    provider: t
    model: qwen-max
    input: 1.2
    output: 6
    context_tiers:
      - {above: 32000, inclusive: true, input: 2.4, output: 12}
      - {above: 128000, inclusive: true, input: 3, output: 15}
    source: https://example.com/qwen
    checked: 2026-11-29
  # explicit priority rates, a per-request fee
  - id: t/gpt-5
    provider: t
    model: gpt-5
    input: 1.25
    cached_input: 0.125
    output: 10.00
    per_request: 0.001
    service_tiers:
      priority: {input: 2.50, cached_input: 0.25, output: 20.00}
      flex: {multiplier: 0.5}
    source: https://example.com/gpt-5
    checked: 2026-11-29
  # time windows: off-peak base, peak x2 Mon-Fri 01:00-04:00 UTC, and a window across midnight
  - id: t/deepseek
    provider: t
    model: deepseek
    input: 0.22
    cached_input: 0.007
    output: 0.66
    windows:
      - {name: peak, start: "01:00", end: "04:00", weekdays: [mon, tue, wed, thu, fri], multiplier: 2}
      - {name: late, start: "22:30", end: "00:30", timezone: Asia/Shanghai, multiplier: 0.5}
    source: https://example.com/ds
    checked: 2026-11-29
  # price history: a price change on 2027-01-01
  - id: t/flash
    provider: t
    model: flash
    input: 0.75
    output: 3.75
    source: https://example.com/flash
    checked: 2026-11-29
  - id: t/flash
    provider: t
    model: flash
    effective: 2027-01-01
    input: 1.50
    output: 7.50
    source: https://example.com/flash
    checked: 2026-11-29
  # reasoning priced apart from other output
  - id: t/thinker
    provider: t
    model: thinker
    input: 1
    output: 4
    reasoning: 8
    source: https://example.com/thinker
    checked: 2026-11-29
"""

NOON = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.UTC)  # a Wednesday


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_text(RULES)
    return load_catalog([path], builtin=False, aliases={"prod-gpt5": "gpt-5"})


def cost(catalog, model, usage, at=NOON, tier=None):
    return price(usage, catalog.resolve(model, "t", at), at=at, service_tier=tier)


def test_b19_above_200k_the_whole_request_moves_up(catalog):
    # 250000 * 2.50 + 2000 * 15.00 = 655000 -> $0.655 (base-rate result: $0.3325)
    above = cost(catalog, "gemini-2.5-pro", Usage(input_tokens=250_000, output_tokens=2000))
    assert above.total == Decimal("0.655") and above.rules == ("context>200000",)
    # exactly 200000 stays below: 200000 * 1.25 + 2000 * 10.00 = 270000 -> $0.27
    at = cost(catalog, "gemini-2.5-pro", Usage(input_tokens=200_000, output_tokens=2000))
    assert at.total == Decimal("0.27") and at.rules == ()
    # the tier is decided on input including cached tokens: 150000 uncached + 60000 cached
    cached = cost(catalog, "gemini-2.5-pro", Usage(input_tokens=210_000, cached_input_tokens=60_000, output_tokens=0))
    # 150000 * 2.50 + 60000 * 0.625 = 412500 -> $0.4125
    assert cached.total == Decimal("0.4125")


def test_b20_premium_rate_applies_to_every_token_not_only_the_excess(catalog):
    # 300000 * 6.00 + 4000 * 22.50 = 1890000 -> $1.89 (the split result: $1.29)
    usage = Usage(input_tokens=300_000, output_tokens=4000)
    assert cost(catalog, "claude-sonnet-4", usage).total == Decimal("1.89")
    # Anthropic: cache reads and writes count toward the threshold: 1000 + 150000 read + 60000 written
    cached = Usage(input_tokens=211_000, cached_input_tokens=150_000, cache_write_tokens=60_000, output_tokens=100)
    # 1000 * 6.00 + 150000 * 0.60 + 60000 * 7.50 + 100 * 22.50 = 6000 + 90000 + 450000 + 2250 -> $0.54825
    assert cost(catalog, "claude-sonnet-4", cached).total == Decimal("0.54825")


def test_inclusive_cliffs_and_the_highest_tier_passed(catalog):
    def total(n):
        return cost(catalog, "qwen-max", Usage(input_tokens=n, output_tokens=1000)).total

    # 31999 * 1.2 + 1000 * 6 = 44398.8
    assert total(31_999) == Decimal("0.0443988")
    # '>=': exactly 32000 is in the second tier: 32000 * 2.4 + 1000 * 12 = 88800
    assert total(32_000) == Decimal("0.0888")
    # 200000 passes both cliffs; the highest applies: 200000 * 3 + 1000 * 15 = 615000
    assert total(200_000) == Decimal("0.615")


def test_cache_write_ttls_and_web_search_fee(catalog):
    usage = Usage(
        input_tokens=1100, cache_write_tokens=900, cache_write_1h_tokens=500, output_tokens=10, web_search_requests=2
    )
    # uncached 200 * 3 + 5m 400 * 3.75 + 1h 500 * 6 + out 10 * 15 = 600 + 1500 + 3000 + 150 = 5250 -> $0.00525
    # + 2 searches * $0.01 = $0.02525
    result = cost(catalog, "claude-sonnet-4", usage)
    assert result.total == Decimal("0.02525")
    assert [(line.component, line.quantity) for line in result.lines] == [
        ("input", 200),
        ("cache_write", 400),
        ("cache_write_1h", 500),
        ("output", 10),
        ("web_search", 2),
    ]


def test_served_service_tiers(catalog):
    usage = Usage(input_tokens=1000, cached_input_tokens=400, output_tokens=100)
    # standard: 600 * 1.25 + 400 * 0.125 + 100 * 10 = 750 + 50 + 1000 = 1800 -> $0.0018, + $0.001 per request
    assert cost(catalog, "gpt-5", usage).total == Decimal("0.0028")
    assert cost(catalog, "gpt-5", usage, tier="default").total == Decimal("0.0028")
    # priority (explicit rates): 600 * 2.50 + 400 * 0.25 + 100 * 20 = 1500 + 100 + 2000 -> $0.0036 + $0.001
    priority = cost(catalog, "gpt-5", usage, tier="priority")
    assert priority.total == Decimal("0.0046") and priority.rules == ("tier:priority",)
    # flex (x0.5 on every rate): $0.0009 + $0.001
    assert cost(catalog, "gpt-5", usage, tier="flex").total == Decimal("0.0019")
    # batch x0.5 and fast x6 on claude-sonnet-4: 1000 * 3 + 100 * 15 = 4500
    plain = Usage(input_tokens=1000, output_tokens=100)
    assert cost(catalog, "claude-sonnet-4", plain, tier="batch").total == Decimal("0.00225")
    assert cost(catalog, "claude-sonnet-4", plain, tier="fast").total == Decimal("0.027")
    # a tier the entry does not price: standard rates, and the cost says so
    odd = cost(catalog, "gpt-5", usage, tier="scale")
    assert odd.total == Decimal("0.0028") and odd.notes and "scale" in odd.notes[0]


def test_time_windows_by_weekday_and_across_midnight(catalog):
    usage = Usage(input_tokens=1000, output_tokens=1000)  # base: 220 + 660 = 880 -> $0.00088
    wednesday_peak = dt.datetime(2026, 11, 25, 2, 0, tzinfo=dt.UTC)
    saturday_same_hour = dt.datetime(2026, 11, 28, 2, 0, tzinfo=dt.UTC)
    assert cost(catalog, "deepseek", usage, wednesday_peak).total == Decimal("0.00176")
    assert cost(catalog, "deepseek", usage, saturday_same_hour).total == Decimal("0.00088")
    # the window end is exclusive: 04:00 is off-peak again
    assert cost(catalog, "deepseek", usage, dt.datetime(2026, 11, 25, 4, 0, tzinfo=dt.UTC)).total == Decimal("0.00088")
    # 22:30-00:30 Shanghai (UTC+8) wraps midnight: 16:45Z = 00:45 local is out, 16:15Z = 00:15 local is in
    assert cost(catalog, "deepseek", usage, dt.datetime(2026, 11, 25, 16, 15, tzinfo=dt.UTC)).total == Decimal(
        "0.00044"
    )
    assert cost(catalog, "deepseek", usage, dt.datetime(2026, 11, 25, 16, 45, tzinfo=dt.UTC)).total == Decimal(
        "0.00088"
    )
    assert cost(catalog, "deepseek", usage, dt.datetime(2026, 11, 25, 14, 30, tzinfo=dt.UTC)).total == Decimal(
        "0.00044"
    )


def test_effective_dates_price_each_request_with_the_version_in_force(catalog):
    usage = Usage(input_tokens=1000, output_tokens=1000)
    before = dt.datetime(2026, 12, 31, 23, 59, 59, tzinfo=dt.UTC)
    after = dt.datetime(2027, 1, 1, 0, 0, tzinfo=dt.UTC)
    assert cost(catalog, "flash", usage, before).total == Decimal("0.0045")  # 750 + 3750
    new = cost(catalog, "flash", usage, after)
    assert new.total == Decimal("0.009") and new.entry_id == "t/flash@2027-01-01"


def test_reasoning_with_its_own_rate(catalog):
    # output 100 of which 60 reasoning: 40 * 4 + 60 * 8 + 10 * 1 = 160 + 480 + 10 = 650
    usage = Usage(input_tokens=10, output_tokens=100, reasoning_tokens=60)
    assert cost(catalog, "thinker", usage).total == Decimal("0.00065")


def test_b22_snapshots_and_configured_aliases(catalog):
    assert catalog.resolve("gpt-5-2025-08-07", "t").how == "snapshot"
    alias = catalog.resolve("prod-gpt5", "azure")
    assert (alias.entry.id, alias.how) == ("t/gpt-5", "configured_alias")
    assert catalog.resolve("nothing-like-it", "t") is None


def test_fallback_is_used_only_when_allowed(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(RULES)
    catalog = load_catalog([path], builtin=False, fallback={"input": Decimal("5"), "output": Decimal("15")})
    usage = Usage(input_tokens=1000, output_tokens=100)
    allowed = quote(catalog, usage, model="mystery", provider="t", at=NOON, fallback=True)
    # 1000 * 5 + 100 * 15 = 6500 -> $0.0065, marked as fallback
    assert (allowed.status, allowed.cost_usd, allowed.entry_id) == ("fallback", Decimal("0.0065"), "fallback")
    refused = quote(catalog, usage, model="mystery", provider="t", at=NOON, fallback=False)
    assert (refused.status, refused.cost_usd) == ("unpriced", None)


@given(
    st.integers(0, 400_000),
    st.integers(0, 100_000),
    st.integers(0, 100_000),
    st.integers(0, 50_000),
    st.sampled_from([None, "batch", "fast"]),
    st.integers(0, 3),
)
def test_cost_is_never_negative_and_never_falls_when_tokens_grow(
    catalog, uncached, cached, written, output, tier, extra
):
    usage = Usage(
        input_tokens=uncached + cached + written,
        cached_input_tokens=cached,
        cache_write_tokens=written,
        output_tokens=output,
    )
    base = cost(catalog, "claude-sonnet-4", usage, tier=tier).total
    assert base >= 0 and base.as_tuple().exponent >= -12
    for grown in (
        Usage(
            input_tokens=usage.input_tokens + extra,
            cached_input_tokens=cached,
            cache_write_tokens=written,
            output_tokens=output,
        ),
        Usage(
            input_tokens=usage.input_tokens,
            cached_input_tokens=cached,
            cache_write_tokens=written,
            output_tokens=output + extra,
        ),
    ):
        assert cost(catalog, "claude-sonnet-4", grown, tier=tier).total >= base


def test_validation_of_rule_fields_names_the_field(tmp_path):
    from tokenward.pricing.catalog import CatalogError

    bad = {
        "context_tiers: [{above: 0, multiplier: 2}]": "context_tiers[0].above",
        "context_tiers: [{above: 10, multiplier: 2, input: 1}]": "either rates or a multiplier",
        "service_tiers: {priority: {}}": "service_tiers.priority",
        "windows: [{name: w, start: '25:00', end: '01:00', multiplier: 2}]": "windows[0].start",
        "windows: [{name: w, start: '01:00', end: '02:00', timezone: Mars/Base, multiplier: 2}]": "unknown time zone",
        "windows: [{name: w, start: '01:00', end: '02:00', weekdays: [funday], multiplier: 2}]": "weekdays",
        "effective: soon": "effective",
        "service_tiers: {flex: {multiplier: 0}}": "multiplier",
    }
    for fragment, expected in bad.items():
        path = tmp_path / "bad.yaml"
        path.write_text(
            f"entries:\n  - {{id: x/m, provider: x, model: m, input: 1, output: 1, source: s, "
            f"checked: 2026-11-01, {fragment.replace(': ', ': ', 1)}}}\n"
        )
        with pytest.raises(CatalogError) as info:
            load_catalog([Path(path)], builtin=False)
        assert "'x/m'" in str(info.value) and expected in str(info.value), fragment


def test_rates_that_default_to_another_follow_it_inside_an_adjustment(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "entries:\n"
        "  - id: t/r\n    provider: t\n    model: r\n    input: 1\n    cached_input: 0.1\n    output: 10\n"
        "    service_tiers:\n      priority: {input: 2, output: 20}\n"
        "    source: https://example.com\n    checked: 2026-11-29\n"
    )
    entry = load_catalog([path], builtin=False).entries["t/r"]
    adjusted = entry.service_tier("priority").apply(entry.rates)
    # reasoning and audio_output defaulted to output, so they follow it to 20; image/audio input and cache
    # writes follow input to 2; the cached_input discount (0.1, not the input rate) keeps its base value
    assert (adjusted.reasoning, adjusted.audio_output, adjusted.image_input, adjusted.cache_write) == (
        Decimal(20),
        Decimal(20),
        Decimal(2),
        Decimal(2),
    )
    assert adjusted.cached_input == Decimal("0.1")
