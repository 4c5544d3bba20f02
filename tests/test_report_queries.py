"""Report queries at DuckDB speed stay exact: 64-bit cost columns, totals read with the groups, wide sums.

The seeded November ledger is the one of ``test_reports`` (its docstring has the figures by hand).
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import duckdb
import pytest

from tokenward.reports import queries
from tokenward.reports.ledger import migrations, open_ledger, write_rows

from .test_reports import ledger, row  # noqa: F401 - ledger is a fixture

D = Decimal
PARIS = "Europe/Paris"
NOVEMBER = queries.Selection(
    dt.datetime(2026, 10, 31, 23, tzinfo=dt.UTC), dt.datetime(2026, 11, 30, 23, tzinfo=dt.UTC), {}, PARIS
)


def _types(conn: duckdb.DuckDBPyConnection) -> dict[str, str]:
    found = conn.execute(
        "SELECT column_name, data_type FROM information_schema.columns "
        "WHERE table_name = 'requests' AND column_name LIKE '%_usd'"
    ).fetchall()
    return dict(found)


def _before_m005(monkeypatch: pytest.MonkeyPatch, path: Path, rows: list[dict]) -> None:
    """A ledger as it was before ``m006_costs_in_64_bits`` (and what came after), holding ``rows``."""
    names = [m.__name__ for m in migrations.MIGRATIONS]
    earlier = migrations.MIGRATIONS[: names.index("m006_costs_in_64_bits")]
    with monkeypatch.context() as patch:
        patch.setattr(migrations, "MIGRATIONS", earlier)
        conn = open_ledger(path)
        try:
            _insert_old(conn, rows)
            assert _types(conn)["cost_usd"] == "DECIMAL(38,12)"
        finally:
            conn.close()


def _insert_old(conn: duckdb.DuckDBPyConnection, rows: list[dict]) -> None:
    """Insert ``rows`` into a ledger of an earlier schema: only the columns it has."""
    import json

    found = conn.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'requests'")
    have = {r[0] for r in found.fetchall()}
    for one in rows:
        values = {k: v for k, v in one.items() if k in have}
        values.update(started_at=dt.datetime.fromtimestamp(one["started_at"], dt.UTC))
        values.update(ended_at=dt.datetime.fromtimestamp(one["ended_at"], dt.UTC))
        for name in ("cost_lines", "raw_usage"):
            if values.get(name) is not None:
                values[name] = json.dumps(values[name], default=str)
        marks = ", ".join("?" * len(values))
        conn.execute(f"INSERT INTO requests ({', '.join(values)}) VALUES ({marks})", list(values.values()))


def test_m005_stores_costs_in_64_bits_and_keeps_every_digit(tmp_path, monkeypatch):
    path = tmp_path / "old.duckdb"
    # the largest value DECIMAL(18, 12) holds, and one with all 12 places in use
    _before_m005(
        monkeypatch,
        path,
        [
            row("a", "2026-11-02T09:00:00+00:00", "k", "t", "gpt-4o", "999999.999999999999", output_cost_usd=D("1")),
            row("b", "2026-11-02T10:00:00+00:00", "k", "t", "gpt-4o", "0.000001234567", cache_savings_usd=D("-0.5")),
        ],
    )
    conn = open_ledger(path)  # migrates
    assert _types(conn) == {
        "cost_usd": "DECIMAL(18,12)",
        "output_cost_usd": "DECIMAL(18,12)",
        "cache_savings_usd": "DECIMAL(18,12)",
        "reserved_usd": "DECIMAL(18,12)",
        "provider_cost_usd": "DECIMAL(38,12)",
    }
    stored = conn.execute("SELECT cost_usd, output_cost_usd, cache_savings_usd FROM requests ORDER BY request_id")
    assert stored.fetchall() == [(D("999999.999999999999"), D("1"), None), (D("0.000001234567"), None, D("-0.5"))]
    rows, totals = queries.spend_report(conn, ["key"], queries.Selection(tz=PARIS))
    # the sum passes 64 bits' six integer digits: 999999.999999999999 + 0.000001234567
    assert rows[0]["cost_usd"] == totals["cost_usd"] == D("1000000.000001234566")
    assert str(totals["p95_cost_usd"]) == "999999.999999999999"  # nearest rank of two: the 2nd
    conn.close()


def test_m005_keeps_a_column_whose_values_do_not_fit(tmp_path, monkeypatch):
    path = tmp_path / "huge.duckdb"
    _before_m005(monkeypatch, path, [row("a", "2026-11-02T09:00:00+00:00", "k", "t", "gpt-4o", "1000000.5")])
    conn = open_ledger(path)
    assert _types(conn)["cost_usd"] == "DECIMAL(38,12)"  # $1,000,000.50 needs seven integer digits
    assert _types(conn)["output_cost_usd"] == "DECIMAL(18,12)"
    rows, totals = queries.spend_report(conn, ["model"], queries.Selection())
    assert (rows[0]["cost_usd"], totals["cost_usd"], totals["p95_cost_usd"]) == (D("1000000.5"),) * 3
    conn.close()


def test_token_sums_past_64_bits_are_read_whole(tmp_path):
    path = tmp_path / "wide.duckdb"
    big = 2**62  # two of them add up to 2^63, one more than a BIGINT holds
    write_rows(
        path,
        [
            row(f"r{i}", "2026-11-02T09:00:00+00:00", "k", "t", "gpt-4o", "1", input_tokens=big, output_tokens=3)
            for i in range(2)
        ],
    )
    conn = open_ledger(path, read_only=True)
    rows, totals = queries.spend_report(conn, ["model"], queries.Selection())
    assert (rows[0]["input_tokens"], rows[0]["output_tokens"], totals["input_tokens"]) == (2**63, 6, 2**63)
    conn.close()


def test_totals_cover_the_selection_whatever_the_rows_show(ledger):  # noqa: F811 - the fixture
    conn = open_ledger(ledger, read_only=True)
    # November: 7 requests, 115450 input tokens, $0.0715, p95 of [0.002, 0.01, 0.0102, 0.0143, 0.03] = $0.03,
    # the unpriced E's 50 + 5 tokens
    expected = {
        "requests": 7,
        "input_tokens": 115450,
        "cost_usd": D("0.0715"),
        "p95_cost_usd": D("0.03"),
        "unpriced_tokens": 55,
        "unpriced_requests": 1,
        "avg_cost_usd": D("0.0143"),
    }
    for by, top in ((["key"], None), (["key"], 1), (["tag"], None), (["tag"], 1), (["session", "day"], None)):
        rows, totals = queries.spend_report(conn, by, NOVEMBER, top=top)
        assert {k: totals[k] for k in expected} == expected, (by, top)
        assert totals == queries.spend_totals(conn, NOVEMBER), (by, top)
        assert rows == queries.spend(conn, by, since=NOVEMBER.since, until=NOVEMBER.until, tz=PARIS, top=top)
    top, _ = queries.spend_report(conn, ["key"], NOVEMBER, top=1)
    assert [(r["key"], r["cost_usd"], r["p95_cost_usd"]) for r in top] == [("alice", D("0.045"), D("0.03"))]
    tags, _ = queries.spend_report(conn, ["tag"], NOVEMBER, top=1)  # nightly: A + G + B
    assert [(r["tag"], r["requests"], r["cost_usd"]) for r in tags] == [("nightly", 2, D("0.045"))]
    nothing, empty = queries.spend_report(conn, ["model"], queries.Selection(dt.datetime(2030, 1, 1, tzinfo=dt.UTC)))
    assert nothing == [] and (empty["requests"], empty["input_tokens"], empty["cost_usd"]) == (0, 0, None)
    conn.close()


def test_top_ranks_groups_by_dollars(tmp_path):
    path = tmp_path / "top.duckdb"
    # as text "9.5" sorts above "10.25" and "100"; as dollars it is the smallest
    costs = {"a": "9.5", "b": "10.25", "c": "100", "d": None}
    write_rows(path, [row(k, "2026-11-02T09:00:00+00:00", k, "t", "gpt-4o", c) for k, c in costs.items()])
    conn = open_ledger(path, read_only=True)
    for by in (["key"], ["key", "tag"]):
        rows, totals = queries.spend_report(conn, by, queries.Selection(), top=3)
        assert [(r["key"], r["cost_usd"]) for r in rows] == [("c", D("100")), ("b", D("10.25")), ("a", D("9.5"))]
        assert (totals["requests"], totals["cost_usd"]) == (4, D("119.75"))  # d, unpriced, is in the total
    conn.close()


def test_status_enums_hold_every_value_the_code_writes():
    import re

    from tokenward.pricing.quote import PriceStatus
    from tokenward.pricing.usage import UsageSource

    values = migrations._STATUS_VALUES
    assert {v for k, v in vars(PriceStatus).items() if k.isupper()} == set(values["price_status"])
    assert {s.value for s in UsageSource} == set(values["usage_source"])
    proxy = Path(migrations.__file__).resolve().parents[2] / "proxy"
    kinds = {m for f in proxy.rglob("*.py") for m in re.findall(r"row_kind=\"(\w+)\"", f.read_text())}
    assert kinds and kinds | {"request"} <= set(values["row_kind"])


def test_m006_keeps_stored_status_values_it_does_not_know(tmp_path, monkeypatch):
    path = tmp_path / "legacy.duckdb"
    names = [m.__name__ for m in migrations.MIGRATIONS]
    with monkeypatch.context() as patch:
        patch.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[: names.index("m007_status_enums")])
        old = open_ledger(path)
        _insert_old(
            old,
            [
                row("a", "2026-11-02T09:00:00+00:00", "k", "t", "gpt-4o", "0.5"),
                row("b", "2026-11-02T10:00:00+00:00", "k", "t", "gpt-4o", None, price_status="legacy_unpriced"),
            ],
        )
        old.close()
    conn = open_ledger(path)
    kind = conn.execute("SELECT data_type FROM information_schema.columns WHERE column_name = 'price_status'")
    assert kind.fetchone()[0].startswith("ENUM('priced'")
    stored = conn.execute("SELECT request_id, price_status, row_kind, usage_source FROM requests ORDER BY 1")
    assert stored.fetchall() == [
        ("a", "priced", "request", "reported"),
        ("b", "legacy_unpriced", "request", "reported"),
    ]
    rows, totals = queries.spend_report(conn, ["model"], queries.Selection())
    assert (rows[0]["requests"], rows[0]["priced_requests"], totals["cost_usd"]) == (2, 1, D("0.5"))
    with pytest.raises(duckdb.ConversionException):  # a status nobody declared cannot be written
        conn.execute("UPDATE requests SET price_status = 'brand_new' WHERE request_id = 'a'")
    conn.close()


def test_group_rows_are_built_exactly(tmp_path):
    """Each group's money, ratios and hour label, as shown (``str`` pins a Decimal's places too).

    a: 1 cached of 20,000 input = 0.00005, half to even: 0.0000; $0.1 and an unpriced row: avg $0.1 over the one
    priced. b: 3 cached of 20,000 = 0.00015: 0.0002; $0.01 + $0.02, of it $0.01 output: share 1/3 = 0.3333,
    avg $0.015. c: only unpriced, no input: no cost, p95, share, average or hit rate.
    """
    path = tmp_path / "built.duckdb"
    nine, ten = "2026-10-25T00:30:00+00:00", "2026-10-25T01:30:00+00:00"  # Paris: 02:30 +02:00, then 02:30 +01:00
    rows = [
        row("a1", nine, "a", "t", "m", "0.1", input_tokens=20000, cached_input_tokens=1, output_cost_usd=D("0.05")),
        row("a2", nine, "a", "t", "m", None, price_status="unpriced"),
        row("b1", ten, "b", "t", "m", "0.01", input_tokens=10000, cached_input_tokens=3, output_cost_usd=D("0.01")),
        row("b2", ten, "b", "t", "m", "0.02", input_tokens=10000, output_cost_usd=D(0)),
        row("c1", ten, "c", "t", "m", None, price_status="unpriced", cost_usd=None),
    ]
    write_rows(path, rows)
    conn = open_ledger(path, read_only=True)
    shown = ("cost_usd", "output_cost_usd", "p95_cost_usd", "cache_hit_rate", "output_share", "avg_cost_usd")
    got, totals = queries.spend_report(conn, ["key"], queries.Selection(tz=PARIS))
    assert [[r["key"], *(None if r[k] is None else str(r[k]) for k in shown)] for r in got] == [
        ["a", "0.100000000000", "0.050000000000", "0.100000000000", "0.0000", "0.5000", "0.100000000000"],
        ["b", "0.030000000000", "0.010000000000", "0.020000000000", "0.0002", "0.3333", "0.015000000000"],
        ["c", None, None, None, None, None, None],
    ]
    assert [(r["requests"], r["priced_requests"], r["unpriced_requests"]) for r in got] == [
        (2, 1, 1),
        (2, 2, 0),
        (1, 0, 1),
    ]
    assert [str(totals[k]) for k in ("cost_usd", "cache_hit_rate", "output_share", "avg_cost_usd")] == [
        "0.130000000000",
        "0.0001",  # 4 of 40,000
        "0.4615",  # 0.06 / 0.13
        "0.043333333333",
    ]
    hours, _ = queries.spend_report(conn, ["hour", "key"], queries.Selection(tz=PARIS))
    assert [(r["hour"], r["key"], r["requests"]) for r in hours] == [
        ("2026-10-25T02:00+02:00", "a", 2),
        ("2026-10-25T02:00+01:00", "b", 2),
        ("2026-10-25T02:00+01:00", "c", 1),
    ]
    conn.close()


@pytest.mark.parametrize("by", [["key"], ["tag"], ["key", "tag"], ["model", "team"], ["hour"], []])
def test_group_costs_are_the_costs_of_spend(ledger, by):  # noqa: F811 - the fixture
    """--compare's previous period reads only the costs: the same groups, values and places as spend()."""
    conn = open_ledger(ledger, read_only=True)
    try:
        for selection in (NOVEMBER, queries.Selection(tz=PARIS), queries.Selection(None, None, {"team": ["ops"]})):
            dims = [queries.canonical(d) for d in by]
            full = queries.spend(
                conn, by, since=selection.since, until=selection.until, tz=selection.tz, filters=selection.filters
            )
            rows, total = queries.group_costs(conn, by, selection)
            assert sorted(repr(r) for r in rows) == sorted(
                repr({**{d: r[d] for d in dims}, "cost_usd": r["cost_usd"]}) for r in full
            )
            assert repr(total) == repr(queries.spend_totals(conn, selection)["cost_usd"])
        keys, total = queries.group_costs(conn, ["key"], NOVEMBER)
        assert sorted((r["key"], r["cost_usd"]) for r in keys) == [
            ("alice", D("0.045000000000")),
            ("bob", D("0.024500000000")),
            ("carol", D("0.002000000000")),
        ]  # A + G + B; C + D; F (E unpriced)
        assert total == D("0.071500000000")
    finally:
        conn.close()
