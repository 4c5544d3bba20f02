"""`tokenward report --html`: the page people look at, checked in a real browser (Debian's Chromium).

The seeded week (UTC), costs at list prices (USD per 1M tokens; gpt-4o 2.50 in / 1.25 cached / 10.00 out,
gpt-4o-mini 0.15 / 0.075 / 0.60, o4-mini 1.10 / 4.40):

| row | day    | key   | model       | input | cached | output | cost                                        | saved |
|-----|--------|-------|-------------|-------|--------|--------|---------------------------------------------|-------|
| a   | Nov 2  | alice | gpt-4o-mini | 4000  | 2000   | 500    | 2000x0.15 + 2000x0.075 + 500x0.60 = 0.00075 | 0.00015 (2000 x 0.075) |
| b   | Nov 2  | bob   | gpt-4o      | 1000  |        | 200    | 1000x2.50 + 200x10 = 0.0045                 |       |
| c   | Nov 3  | alice | gpt-4o      | 2000  | 1000   | 100    | 1000x2.50 + 1000x1.25 + 100x10 = 0.00475    | 0.00125 (1000 x 1.25) |
| d   | Nov 5  | carol | o4-mini     | 1000  |        | 500    | 1000x1.10 + 500x4.40 = 0.0033               |       |
| e   | Nov 5  | dave  | acme-9      | 300   |        | 30     | unpriced                                    |       |
| f   | Nov 6  | bob   | gpt-4o-mini | 10000 | 8000   | 1000   | 2000x0.15 + 8000x0.075 + 1000x0.60 = 0.0015 | 0.0006 (8000 x 0.075) |

Totals: $0.0148 over 5 priced of 6 requests; 18,300 input + 2,330 output = 20,630 tokens; 11,000 cached, a hit
rate of 11000 / 18300 = 60.1 %; saved $0.002; 1 unpriced request (330 tokens). Days: Nov 2 $0.00525, Nov 3
$0.00475, Nov 5 $0.0033, Nov 6 $0.0015. Keys: bob $0.006, alice $0.0055, carol $0.0033.
"""

from __future__ import annotations

import shutil
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from tokenward.proxy.cli import main
from tokenward.reports import charts, html_report, render
from tokenward.reports.ledger import write_rows

from .test_reports import row

D = Decimal
WEEK = ["--since", "2026-11-01", "--until", "2026-11-08", "--tz", "UTC"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def usage(input_tokens: int, cached: int, output: int, saved: str, output_cost: str) -> dict:
    return dict(
        input_tokens=input_tokens,
        cached_input_tokens=cached,
        output_tokens=output,
        cache_savings_usd=D(saved),
        output_cost_usd=D(output_cost),
    )


@pytest.fixture
def week(tmp_path: Path) -> Path:
    path = tmp_path / "week.duckdb"
    rows = [
        row("a", "2026-11-02T09:00:00+00:00", "alice", "t", "gpt-4o-mini", "0.00075", **usage(4000, 2000, 500, "0.00015", "0.0003")),
        row("b", "2026-11-02T15:00:00+00:00", "bob", "t", "gpt-4o", "0.0045", **usage(1000, 0, 200, "0", "0.002")),
        row("c", "2026-11-03T10:00:00+00:00", "alice", "t", "gpt-4o", "0.00475", **usage(2000, 1000, 100, "0.00125", "0.001")),
        row("d", "2026-11-05T10:00:00+00:00", "carol", "t", "o4-mini", "0.0033", **usage(1000, 0, 500, "0", "0.0022")),
        row(
            "e",
            "2026-11-05T11:00:00+00:00",
            "dave",
            "t",
            "acme-9",
            None,
            price_status="unpriced",
            cost_lines=None,
            **usage(300, 0, 30, "0", "0"),
        ),
        row("f", "2026-11-06T10:00:00+00:00", "bob", "t", "gpt-4o-mini", "0.0015", **usage(10000, 8000, 1000, "0.0006", "0.0006")),
    ]
    write_rows(path, rows)
    return path


def write_page(ledger: Path, tmp_path: Path, *extra: str) -> Path:
    config = tmp_path / "budgets.yaml"
    config.write_text(
        f"ledger: {{path: {ledger}}}\nupstreams: [{{name: a, base_url: 'http://x'}}]\n"
        "budgets: [{name: all-monthly, limit_usd: 0.05, period: month, timezone: UTC}]\n"
    )
    page = tmp_path / "report.html"
    result = CliRunner().invoke(
        main,
        ["report", "--config", str(config), *WEEK, "--by", "day,model", "--html", str(page), "--format", "csv", *extra],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return page


def test_ticks_are_round_and_labelled_apart():
    # the old chart labelled a $0.03 axis "$0.03 $0.03 $0.03": steps of $0.005 printed to cents
    assert charts.usd_axis(D("0.03"))[1] == ["$0.00", "$0.01", "$0.02", "$0.03"]
    assert charts.usd_axis(D("0.0123"))[1] == ["$0.0000", "$0.0025", "$0.0050", "$0.0075", "$0.0100", "$0.0125"]
    assert charts.usd_axis(D("0.00525"))[1] == ["$0.000", "$0.002", "$0.004", "$0.006"]
    assert charts.usd_axis(D("1.4"))[1] == ["$0.00", "$0.50", "$1.00", "$1.50"]
    assert charts.usd_axis(D("1234"))[1] == ["$0", "$250", "$500", "$750", "$1,000", "$1,250"]
    assert charts.usd_axis(D(0))[1] == ["$0", "$1"]


@given(st.decimals(min_value=D("1e-9"), max_value=D("1e9"), allow_nan=False, allow_infinity=False))
def test_any_amount_gets_two_to_five_distinct_round_ticks(top):
    ticks, labels = charts.usd_axis(top)
    assert ticks[0] == 0 and ticks[-1] >= top and 2 <= len(ticks) - 1 <= 5
    assert len(set(labels)) == len(labels)
    assert [D(label.replace("$", "").replace(",", "")) for label in labels] == ticks  # exact, nothing rounded


def test_palette_colours_are_distinct_and_other_is_grey():
    names = [f"m{i}" for i in range(9)] + [charts.OTHER]
    colours = charts.colours(names)
    assert len(set(colours.values())) == 10 and colours[charts.OTHER] == charts.OTHER_COLOUR


def test_money_keeps_one_number_of_decimals_per_column():
    usd = render.Column("cost_usd", "cost", "usd")
    # three significant digits of the largest ($35.25), one more place for the smallest ($0.004)
    assert render.column_texts(usd, [D("35.2473"), D("0.0041"), None, D(0)]) == ["$35.247", "$0.004", "-", "$0.000"]
    assert render.column_texts(usd, [D("1234.5"), D("-2")]) == ["$1,234.50", "-$2.00"]
    # amounts that would read as zero say so
    assert render.column_texts(usd, [D("1234.5"), D("0.000001")]) == ["$1,234.5000", "<$0.0001"]
    ratio = render.Column("cache_hit_rate", "hit", "ratio")
    assert render.column_texts(ratio, [D("0.6011"), D("1"), D("0")]) == ["60.1%", "100.0%", "0.0%"]


def test_page_opens_on_figures_and_charts_and_folds_long_tables(week, tmp_path):
    text = write_page(week, tmp_path).read_text()
    # summary figures first, then the charts, the table last
    assert text.index('data-figure="spend"') < text.index('id="spend-over-time"') < text.index('id="report-table"')
    assert text.index('id="spend-over-time"') < text.index('id="budgets"') < text.index('id="top-keys"')
    assert '<details id="report-table" open>' in text  # 5 rows: open
    # nothing to fetch: no script, no stylesheet link, no remote image
    assert "<script" not in text and "<link" not in text and "http://" not in text.replace('xmlns="http://', "")
    long_page = tmp_path / "long.html"
    rows = [{"day": f"2026-11-{d:02d}", "cost_usd": D("0.01")} for d in range(1, 31)]
    columns = render.columns_for(["day"], measures=["cost_usd"])
    html_report.write_html(long_page, "t", "s", rows, None, columns, {"buckets": []}, [])
    assert '<details id="report-table">' in long_page.read_text()  # 30 rows: folded


def test_names_from_clients_are_text_not_markup(tmp_path):
    path = tmp_path / "hostile.duckdb"
    hostile_key, hostile_model = '"><img src=x onerror=alert(1)>', "<script>alert(1)</script>"
    write_rows(path, [row("x", "2026-11-02T09:00:00+00:00", hostile_key, "t", hostile_model, "0.01")])
    page = tmp_path / "h.html"
    CliRunner().invoke(main, ["report", "--db", str(path), *WEEK, "--by", "key,model", "--html", str(page)])
    text = page.read_text()
    assert "<script" not in text and "<img" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "&quot;&gt;&lt;img src=x" in text


@pytest.fixture
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if CHROMIUM is None:
        pytest.skip("no Chromium (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            yield launched
        finally:
            launched.close()


def test_the_page_in_chromium_shows_the_ledgers_figures(week, tmp_path, browser):
    page_file = write_page(week, tmp_path, "--at", "2026-11-07T12:00:00+00:00")
    viewport = {"width": 1280, "height": 800}
    page = browser.new_page(viewport=viewport)
    fetched, errors = [], []
    page.on("request", lambda request: fetched.append(request.url))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.goto(page_file.as_uri())

    def figure(name: str) -> tuple[str, str]:
        card = page.locator(f'[data-figure="{name}"]')
        return card.locator(".value").inner_text(), card.locator(".detail").inner_text()

    assert figure("spend") == ("$0.0148", "5 priced requests")
    assert figure("requests")[0] == "6"
    assert figure("tokens") == ("20,630", "18,300 in · 2,330 out")
    assert figure("cache_hit_rate") == ("60.1%", "11,000 of 18,300 input tokens")
    assert figure("cache_savings")[0] == "$0.00200"
    assert figure("unpriced") == ("1", "330 tokens with no price")
    assert figure("period") == ("7 days", "2026-11-01 to 2026-11-07 · UTC")

    # the first chart is spend over time, whole in the first screenful
    first = page.locator("figure.chart").first
    assert first.get_attribute("id") == "spend-over-time"
    box = first.locator("svg").bounding_box()
    assert box is not None and 0 < box["y"] and box["y"] + box["height"] <= viewport["height"]

    # every axis labels its ticks apart (SVG text has no innerText: its text content is what is drawn); the spend axis in steps of $0.002 up to the $0.00525 of Nov 2
    for chart in page.locator("figure.chart svg").all():
        ticks = chart.locator(".y-axis text").all_text_contents()
        assert len(set(ticks)) == len(ticks), ticks
    assert first.locator(".y-axis text").all_text_contents() == ["$0.000", "$0.002", "$0.004", "$0.006"]
    hit_axis = page.locator("#cache-hit-rate .y-axis text").all_text_contents()
    assert hit_axis == ["0%", "20%", "40%", "60%", "80%", "100%"]
    assert page.locator("#spend-over-time .x-axis text").first.text_content() == "Nov 1"  # empty days are drawn too

    # top spenders: biggest first, each with its value
    keys = page.locator("#top-keys .ranked")
    assert keys.locator(".name").all_text_contents() == ["bob", "alice", "carol"]
    assert keys.locator(".value").all_text_contents() == ["$0.00600", "$0.00550", "$0.00330"]

    # one colour per model, the same in every chart and the legend, no two alike
    by_model = page.locator("#spend-by-model .ranked > g")
    models = by_model.locator(".name").all_text_contents()
    assert models == ["gpt-4o", "o4-mini", "gpt-4o-mini"]  # $0.00925, $0.0033, $0.00225
    colours = by_model.locator("rect").evaluate_all("rects => rects.map(r => r.getAttribute('fill'))")
    assert len(set(colours)) == 3
    segments = page.locator("#spend-over-time rect").evaluate_all(
        "rects => rects.map(r => [r.querySelector('title').textContent, r.getAttribute('fill')])"
    )
    for title, fill in segments:
        model = title.split(" · ")[1].split(":")[0]
        assert fill == colours[models.index(model)], title
    assert {t for t, _ in segments} >= {"2026-11-02 · gpt-4o: $0.00450", "2026-11-02 · gpt-4o-mini: $0.00075"}

    # the budget: $0.0148 of $0.05 by November 7th 12:00, 6.5 of 30 days: forecast 0.0148 x 30 / 6.5 = $0.068308
    # (136.6 %); at that rate $0.05 is reached after 6.5 x 0.05 / 0.0148 = 21.96 days, November 22nd 23:01
    budget = page.locator('[data-budget="all-monthly"]').inner_text()
    assert "$0.0148 of $0.0500 (29.6%)" in budget and "forecast $0.0683 (136.6%, over)" in budget
    assert "runs out about 2026-11-22 23:01 (UTC)" in budget

    # the table is there, below
    assert page.locator("#report-table tfoot").inner_text().split("\t")[:3] == ["total", "", "6"]

    assert all(url.startswith(("file:", "data:")) for url in fetched), fetched
    assert errors == []
    shot = tmp_path / "report-page.png"
    page.screenshot(path=str(shot), full_page=True)
    page.screenshot(path=str(tmp_path / "report-page-first-screen.png"))
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "report-page.png")
    shutil.copy(tmp_path / "report-page-first-screen.png", ARTIFACTS / "report-page-first-screen.png")
    assert shot.stat().st_size > 10_000


def test_charts_draw_every_hour_of_a_day_with_a_dst_change():
    import datetime as dt
    from zoneinfo import ZoneInfo

    # October 25th 2026 in Paris has 25 hours: 02:00 comes first at +02:00, then again at +01:00
    start = dt.datetime(2026, 10, 24, 22, tzinfo=dt.UTC)
    hours = html_report._every_bucket("hour", start, start + dt.timedelta(hours=25), ZoneInfo("Europe/Paris"), set())
    assert len(hours) == 25 and hours[2:4] == ["2026-10-25T02:00+02:00", "2026-10-25T02:00+01:00"]
    assert html_report.bucket_for(dt.timedelta(days=3)) == "hour" and html_report.bucket_for(dt.timedelta(days=30)) == "day"
    days = html_report._every_bucket("week", start, start + dt.timedelta(days=20), ZoneInfo("Europe/Paris"), set())
    assert [d.isoformat() for d in days] == ["2026-10-19", "2026-10-26", "2026-11-02", "2026-11-09"]  # Mondays
