"""Exact costs, worked out by hand from the field cases' test prices (USD per 1M tokens)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenward.pricing.catalog import load_catalog
from tokenward.pricing.cost import price
from tokenward.pricing.usage import Usage

PRICES = Path(__file__).parent / "fixtures" / "field_case_prices.yaml"


@pytest.fixture(scope="module")
def catalog():
    return load_catalog([PRICES], builtin=False)


def cost_of(catalog, model, usage):
    resolution = catalog.resolve(model, "test")
    assert resolution is not None, model
    return price(usage, resolution)


def test_b01_stream_usage_priced(catalog):
    # input 14, output 5: 14 * 0.15 + 5 * 0.60 = 5.1 -> $0.0000051
    assert cost_of(catalog, "gpt-4o-mini-2024-07-18", Usage(input_tokens=14, output_tokens=5)).total == Decimal(
        "0.0000051"
    )


def test_b07_cached_tokens_billed_at_cache_rate(catalog):
    # uncached 96 * 3.00 + cached 2304 * 0.75 + output 80 * 15.00 = 3216 -> $0.003216
    usage = Usage(input_tokens=2400, cached_input_tokens=2304, output_tokens=80)
    assert cost_of(catalog, "grok-3", usage).total == Decimal("0.003216")


def test_b09_cached_tokens_not_billed_twice(catalog):
    # uncached 102 * 2.50 + cached 2048 * 1.25 + output 120 * 10.00 = 4015 -> $0.004015
    usage = Usage(input_tokens=2150, cached_input_tokens=2048, output_tokens=120)
    cost = cost_of(catalog, "gpt-4o", usage)
    assert cost.total == Decimal("0.004015")
    assert [(line.component, line.quantity) for line in cost.lines] == [
        ("input", 102),
        ("cached_input", 2048),
        ("output", 120),
    ]


def test_b10_cache_writes_priced_once(catalog):
    # uncached 100 * 3.00 + write 900 * 3.75 + read 2000 * 0.30 + output 250 * 15.00 = 8025 -> $0.008025
    usage = Usage(input_tokens=3000, cached_input_tokens=2000, cache_write_tokens=900, output_tokens=250)
    assert cost_of(catalog, "claude-sonnet-4", usage).total == Decimal("0.008025")


def test_one_hour_cache_writes(catalog):
    # 5m writes 400 * 3.75 + 1h writes 500 * 6.00 + uncached 100 * 3.00 = 1500 + 3000 + 300 -> $0.0048
    usage = Usage(input_tokens=1000, cache_write_tokens=900, cache_write_1h_tokens=500)
    assert cost_of(catalog, "claude-sonnet-4", usage).total == Decimal("0.0048")


def test_b12_deepseek_hits(catalog):
    # miss 112 * 0.27 + hit 5888 * 0.07 + output 300 * 1.10 = 772.4 -> $0.0007724
    usage = Usage(input_tokens=6000, cached_input_tokens=5888, output_tokens=300)
    assert cost_of(catalog, "deepseek-chat", usage).total == Decimal("0.0007724")


def test_b13_responses_cached(catalog):
    # uncached 336 * 2.00 + cached 4864 * 0.50 + output 410 * 8.00 = 6384 -> $0.006384
    usage = Usage(input_tokens=5200, cached_input_tokens=4864, output_tokens=410)
    assert cost_of(catalog, "gpt-4.1", usage).total == Decimal("0.006384")


def test_b22_dated_snapshot_priced_as_base_model(catalog):
    # o1-2024-12-17 -> o1: 500 * 15.00 + 2000 * 60.00 = 127500 -> $0.1275 (reasoning inside output)
    usage = Usage(input_tokens=500, output_tokens=2000, reasoning_tokens=1600)
    cost = cost_of(catalog, "o1-2024-12-17", usage)
    assert cost.total == Decimal("0.1275") and cost.resolved_by == "snapshot" and cost.entry_id == "test/o1"


def test_audio_tokens_at_audio_rates(catalog):
    # text in 20 * 2.50 + audio in 44 * 40.00 + text out 10 * 10.00 + audio out 30 * 80.00 = 50 + 1760 + 100 + 2400
    usage = Usage(input_tokens=64, audio_input_tokens=44, output_tokens=40, audio_output_tokens=30)
    assert cost_of(catalog, "gpt-4o-audio-preview", usage).total == Decimal("0.00431")


def test_web_search_per_call(catalog):
    # 1000 * 2.00 + 100 * 8.00 = 2800 -> $0.0028, plus 3 searches * $0.01
    usage = Usage(input_tokens=1000, output_tokens=100, web_search_requests=3)
    cost = cost_of(catalog, "gpt-4.1", usage)
    assert cost.total == Decimal("0.0328") and cost.unpriced_calls == 0
    unpriced = cost_of(catalog, "gpt-4o", Usage(input_tokens=1, web_search_requests=2))
    assert unpriced.unpriced_calls == 2 and unpriced.total == Decimal("0.0000025")


@given(
    st.integers(0, 10**7), st.integers(0, 10**7), st.integers(0, 10**7), st.integers(0, 10**7), st.integers(0, 10**7)
)
def test_cost_never_negative_and_monotone(catalog, cached, writes, uncached, output, extra):
    usage = Usage(
        input_tokens=cached + writes + uncached,
        cached_input_tokens=cached,
        cache_write_tokens=writes,
        output_tokens=output,
    )
    base = cost_of(catalog, "claude-sonnet-4", usage).total
    assert base >= 0
    more_output = Usage(
        input_tokens=usage.input_tokens,
        cached_input_tokens=cached,
        cache_write_tokens=writes,
        output_tokens=output + extra,
    )
    more_input = Usage(
        input_tokens=usage.input_tokens + extra,
        cached_input_tokens=cached,
        cache_write_tokens=writes,
        output_tokens=output,
    )
    assert cost_of(catalog, "claude-sonnet-4", more_output).total >= base
    assert cost_of(catalog, "claude-sonnet-4", more_input).total >= base
    assert base.as_tuple().exponent >= -12  # fits the ledger's DECIMAL(38, 12) exactly


def test_a_quote_of_a_million_dollars_or_more_is_not_credible():
    from tokenward.pricing.catalog import load_catalog
    from tokenward.pricing.quote import MAX_REQUEST_COST_USD, PriceStatus, quote
    from tokenward.pricing.usage import Usage

    catalog = load_catalog([], builtin=True)
    at = dt.datetime(2026, 11, 20, tzinfo=dt.UTC)
    # gpt-4o at $2.50 per 1M input tokens: 4 x 10^11 tokens would be exactly $1,000,000
    huge = quote(catalog, Usage(input_tokens=400_000_000_000), model="gpt-4o", provider="openai", at=at)
    assert (huge.status, huge.cost_usd) == (PriceStatus.USAGE_INVALID, None)
    below = quote(catalog, Usage(input_tokens=399_999_999_999), model="gpt-4o", provider="openai", at=at)
    assert below.status == PriceStatus.PRICED and below.cost_usd == Decimal("999999.9999975")
    assert below.cost_usd < MAX_REQUEST_COST_USD


_BUILTIN = load_catalog()
_TIERED = sorted(
    (
        entry
        for versions in _BUILTIN.versions.values()
        for entry in versions
        if entry.context_tiers or entry.service_tiers or entry.windows or entry.per_request or entry.image
    ),
    key=lambda e: e.version_id,
)
_counts = st.integers(min_value=0, max_value=3_000_000)


@given(
    index=st.integers(min_value=0, max_value=len(_TIERED) - 1),
    usages=st.lists(
        st.builds(
            Usage,
            input_tokens=_counts,
            output_tokens=_counts,
            cached_input_tokens=_counts,
            cache_write_tokens=_counts,
            audio_input_tokens=_counts,
            image_input_tokens=_counts,
            reasoning_tokens=_counts,
            audio_output_tokens=_counts,
            output_images=st.integers(min_value=0, max_value=4),
            input_audio_seconds=st.integers(min_value=0, max_value=600),
            cache_write_1h_tokens=_counts,
            web_search_requests=st.integers(min_value=0, max_value=3),
            input_characters=st.integers(min_value=0, max_value=10_000),
        ),
        min_size=1,
        max_size=6,
    ),
    hour=st.integers(min_value=0, max_value=23),
    tier_names=st.lists(st.sampled_from([None, "priority", "flex", "batch", "fast", "scale", "unknown"]), min_size=1),
)
def test_the_dearest_total_is_the_largest_price_of_any_pair(index, usages, hour, tier_names):
    from tokenward.pricing.catalog import Resolution
    from tokenward.pricing.cost import dearest_total

    entry = _TIERED[index]
    resolution = Resolution(entry, "exact")
    at = dt.datetime(2026, 6, 3, hour, 30, tzinfo=dt.UTC)
    expected = max(price(u, resolution, at=at, service_tier=t).total for u in usages for t in tier_names)
    assert dearest_total(usages, resolution, at=at, service_tiers=tier_names) == expected
