"""Price catalog: exact decimals, validation that names file/entry/field, explicit model resolution."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest

from tokenward.pricing.catalog import CatalogError, default_catalog_path, load_catalog


def write(tmp_path, text, name="prices.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


ENTRY = (
    "{id: x/m, provider: x, model: m, input: 0.15, output: 0.6, source: 'https://example.com/p', checked: 2026-11-01}"
)


def test_builtin_catalog_loads_and_every_entry_is_sourced():
    catalog = load_catalog()
    assert len(catalog.entries) >= 40
    for entry in catalog.entries.values():
        assert entry.source.startswith("http"), entry.id
        assert isinstance(entry.checked, dt.date)
        assert entry.rates.input >= 0 and entry.rates.output >= 0
    gpt4o = catalog.entries["openai/gpt-4o"].rates
    assert (gpt4o.input, gpt4o.cached_input, gpt4o.output) == (Decimal("2.50"), Decimal("1.25"), Decimal("10.00"))


def test_yaml_floats_become_exact_decimals(tmp_path):
    catalog = load_catalog([write(tmp_path, f"entries:\n  - {ENTRY}\n")])
    rates = catalog.entries["x/m"].rates
    assert rates.input == Decimal("0.15") and type(rates.input) is Decimal
    # defaults: no cache discount unless given; reasoning priced as output
    assert rates.cached_input == rates.input == rates.cache_write == rates.cache_write_1h == rates.image_input
    assert rates.reasoning == rates.output == rates.audio_output == Decimal("0.6")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{id: x/m, provider: x, model: m, input: 0.15, source: 's', checked: 2026-11-01}", "'output': required"),
        (
            "{id: x/m, provider: x, model: m, input: -1, output: 1, source: 's', checked: 2026-11-01}",
            "'input': must be a finite",
        ),
        (
            "{id: x/m, provider: x, model: m, input: 0.0000001, output: 1, source: 's', checked: 2026-11-01}",
            "decimal places",
        ),
        (
            "{id: x/m, provider: x, model: m, input: '1', output: 1, source: 's', checked: 2026-11-01}",
            "'input': must be a number",
        ),
        ("{id: x/m, provider: x, model: m, input: 1, output: 1, source: 's'}", "'checked': required"),
        (
            "{id: x/m, provider: x, model: m, input: 1, output: 1, source: 's', checked: 2026-11-01, inptu: 3}",
            "'inptu': unknown",
        ),
    ],
)
def test_validation_errors_name_file_entry_and_field(tmp_path, entry, message):
    path = write(tmp_path, f"entries:\n  - {entry}\n")
    with pytest.raises(CatalogError) as info:
        load_catalog([path])
    assert str(path) in str(info.value) and "'x/m'" in str(info.value) and message in str(info.value)


def test_broken_yaml_and_duplicates(tmp_path):
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog([write(tmp_path, "entries: [", "bad.yaml")])
    with pytest.raises(CatalogError, match="duplicate id and effective date"):
        load_catalog([write(tmp_path, f"entries:\n  - {ENTRY}\n  - {ENTRY}\n", "dup.yaml")])  # same effective


def test_later_files_override_entries(tmp_path):
    first = write(
        tmp_path,
        "entries:\n  - {id: openai/gpt-4o, provider: openai, model: gpt-4o, input: 9, output: 9, "
        "source: 'https://example.com', checked: 2026-11-01}\n",
        "a.yaml",
    )
    catalog = load_catalog([first])
    assert catalog.entries["openai/gpt-4o"].rates.input == Decimal(9)
    assert catalog.resolve("gpt-4o-2024-08-06", "openai").entry.rates.input == Decimal(9)


def test_a_price_file_overrides_the_fields_it_gives_and_keeps_the_rest(tmp_path):
    from tokenward.pricing.quote import quote
    from tokenward.pricing.usage import Usage

    # the user's own gpt-4o price: only input and output restated (built-in: 2.50 in, 1.25 cached, 10.00
    # out, priority 4.25 / 2.125 / 17.00, batch x 0.5)
    mine = write(tmp_path, "entries:\n  - {id: openai/gpt-4o, input: 2.00, output: 8.00}\n", "mine.yaml")
    catalog = load_catalog([mine])
    usage = Usage(input_tokens=2150, cached_input_tokens=2048, output_tokens=120)  # field case B09's counts

    def cost(tier=None):
        return quote(catalog, usage, model="gpt-4o", provider="openai", at=None, service_tier=tier).cost_usd

    # 102 x 2.00 + 2048 x 1.25 + 120 x 8.00 = 3724 -> $0.003724; before, the entry was replaced whole:
    # the partial entry was refused (no source, no checked), and a complete one without cached_input
    # billed the cache hits at the full input rate: 2150 x 2.00 + 120 x 8.00 -> $0.00526
    assert cost() == Decimal("0.003724")
    # the service tiers not restated are kept: priority's own rates, 102 x 4.25 + 2048 x 2.125 + 120 x 17.00
    # = 6825.5 -> $0.0068255; batch halves the new rates: $0.001862
    assert (cost("priority"), cost("batch")) == (Decimal("0.0068255"), Decimal("0.001862"))
    entry = catalog.entries["openai/gpt-4o"]
    assert entry.source.startswith(f"{mine} (over https://github.com/pydantic/genai-prices")
    # a rate the built-in entry left to its default follows the new input: gpt-4.1-nano's cache writes
    nano = write(tmp_path, "entries:\n  - {id: openai/gpt-4.1-nano, input: 0.20, source: mine}\n", "nano.yaml")
    rates = load_catalog([nano]).entries["openai/gpt-4.1-nano"].rates
    assert (rates.input, rates.cache_write, rates.cached_input, rates.output) == (
        Decimal("0.20"),
        Decimal("0.20"),
        Decimal("0.025"),
        Decimal("0.40"),
    )
    # a new id must be complete
    with pytest.raises(CatalogError, match="'source': required"):
        load_catalog([write(tmp_path, "entries:\n  - {id: mine/m, provider: x, model: m}\n", "new.yaml")])


def test_resolution_rules_in_order():
    catalog = load_catalog()
    assert catalog.resolve("gpt-4o-mini", "openai").how == "exact"
    assert catalog.resolve("GPT-4o-mini", "openai").how == "exact"
    snap = catalog.resolve("gpt-4o-mini-2024-07-18", "openai")
    assert (snap.entry.id, snap.how) == ("openai/gpt-4o-mini", "snapshot")
    vendor = catalog.resolve("openai/gpt-4.1-mini", "openrouter")
    assert (vendor.entry.id, vendor.how) == ("openai/gpt-4.1-mini", "vendor_prefix")
    other = catalog.resolve("gpt-4o", "azure")
    assert (other.entry.id, other.how) == ("openai/gpt-4o", "other_provider")
    assert catalog.resolve("claude-sonnet-4-5-20250929", "anthropic").entry.id.startswith("anthropic/claude-sonnet-4-5")
    assert catalog.resolve("mistral-large-latest", "mistral").entry.id == "mistral/mistral-large-latest"
    assert catalog.resolve("brand-new-model-9", "openai") is None
    assert catalog.resolve(None) is None and catalog.resolve("", "openai") is None


def test_a_routing_prefix_that_names_no_provider_is_stripped_one_segment_at_a_time():
    catalog = load_catalog()
    found = {
        name: catalog.resolve(name, provider)
        for name, provider in (
            ("azure/gpt-4o", "azure"),  # LiteLLM's name for an Azure deployment of gpt-4o
            ("openrouter/openai/gpt-4o", "openrouter"),  # LiteLLM's name for OpenRouter's openai/gpt-4o
            ("azure/gpt-4o-2024-08-06", "azure"),  # a prefix and a snapshot suffix
            ("gemini/gemini-2.5-pro", None),
        )
    }
    assert {name: (r.entry.id, r.how) for name, r in found.items()} == {
        "azure/gpt-4o": ("openai/gpt-4o", "routing_prefix"),
        "openrouter/openai/gpt-4o": ("openai/gpt-4o", "routing_prefix"),
        "azure/gpt-4o-2024-08-06": ("openai/gpt-4o", "snapshot"),
        "gemini/gemini-2.5-pro": ("google/gemini-2.5-pro", "routing_prefix"),
    }
    # a vendor prefix the catalog knows keeps its rule; names whose price differs stay unpriced
    assert catalog.resolve("openai/gpt-4o", "openrouter").how == "vendor_prefix"
    for name in ("openai/gpt-4o-mini:free", "openai/gpt-4o:online", "ft:gpt-4o-mini-2024-07-18:org::abc", "azure/"):
        assert catalog.resolve(name, "openrouter") is None, name


def test_default_catalog_path_is_inside_the_package():
    assert default_catalog_path().name == "default.yaml" and default_catalog_path().exists()


def test_a_price_file_entry_of_its_own_wins_the_name_over_the_built_in_one(tmp_path):
    """A user's ``mine/gpt-4o`` prices gpt-4o; before, the built-in ``openai/gpt-4o`` (loaded first) kept the name."""
    from tokenward.pricing.quote import quote
    from tokenward.pricing.usage import Usage

    entry = (
        "entries:\n  - {id: mine/gpt-4o, provider: openai, model: gpt-4o, input: 1.00, output: 4.00, "
        "source: negotiated, checked: 2026-12-01}\n"
    )
    mine = write(tmp_path, entry, "mine.yaml")
    later = write(tmp_path, entry.replace("mine/gpt-4o", "later/gpt-4o").replace("1.00", "0.50"), "later.yaml")
    usage = Usage(input_tokens=1000, output_tokens=100)

    # 1000 x 1.00 + 100 x 4.00 = 1400 per 1M -> $0.0014 (the built-in 2.50 / 10.00 would be $0.0035)
    assert load_catalog([mine]).resolve("gpt-4o", "openai").entry.id == "mine/gpt-4o"
    assert quote(load_catalog([mine]), usage, model="gpt-4o", provider="openai", at=None).cost_usd == Decimal("0.0014")
    # snapshots and other providers' names follow it too
    assert load_catalog([mine]).resolve("gpt-4o-2024-08-06", "openai").entry.id == "mine/gpt-4o"
    assert load_catalog([mine]).resolve("gpt-4o", "azure").entry.id == "mine/gpt-4o"
    # of two files, the later one wins: 1000 x 0.50 + 100 x 4.00 -> $0.0009
    both = load_catalog([mine, later])
    assert both.resolve("gpt-4o", "openai").entry.id == "later/gpt-4o"
    assert quote(both, usage, model="gpt-4o", provider="openai", at=None).cost_usd == Decimal("0.0009")
    # without a price file, the built-in entry as before
    assert load_catalog().resolve("gpt-4o", "openai").entry.id == "openai/gpt-4o"
