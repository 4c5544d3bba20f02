"""The report by tag, summed per list of tags and spread over the tags: the figures of a fan-out of every row.

Six rows, worked out by hand (tags; cost; tokens in/out):

    a  [x, y]   $0.10  100 / 10
    b  [y]      $0.30  200 / 20
    c  []       $0.05   30 /  3     an empty list: (none)
    d  NULL     unpriced  7 / 3     no list: (none); no cost
    e  [x, x]   $0.20   50 /  5     x twice: e counts twice under x, as a fan-out of the row does
    f  [y]      $0.40   40 /  4     a retried attempt: cost and tokens, no request, not ranked for p95

Groups: x = a + e + e: 3 requests, $0.50, billed [0.10, 0.20, 0.20], p95 the 3rd of 3 = $0.20;
y = a + b + f: 2 requests, $0.80, billed [0.10, 0.30], p95 the 2nd = $0.30; (none) = c + d:
2 requests, $0.05, one unpriced, p95 $0.05. The total counts each row once: 5 requests, $1.05,
tokens 427 in / 45 out, billed [0.05, 0.10, 0.20, 0.30], p95 the 4th of 4 (ceil(0.95 * 4)) = $0.30,
unpriced tokens d's 7 + 3 = 10.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from tokenward.reports import queries
from tokenward.reports.ledger import open_ledger, write_rows

from .test_reports import row

D = Decimal
EVERYTHING = queries.Selection(tz="Europe/Paris")


def _ledger(tmp_path):
    when = "2026-11-02T09:00:00+00:00"
    rows = [
        row("a", when, "k1", "t", "gpt-4o", "0.10", tags=["x", "y"], input_tokens=100, output_tokens=10),
        row("b", when, "k1", "t", "gpt-4o", "0.30", tags=["y"], input_tokens=200, output_tokens=20),
        row("c", when, "k2", "t", "gpt-4o-mini", "0.05", tags=[], input_tokens=30, output_tokens=3),
        row("d", when, "k2", "t", "gpt-4o-mini", None, price_status="unpriced", input_tokens=7, output_tokens=3),
        row("e", when, "k1", "t", "gpt-4o", "0.20", tags=["x", "x"], input_tokens=50, output_tokens=5),
        row("f", when, "k1", "t", "gpt-4o", "0.40", tags=["y"], row_kind="attempt", input_tokens=40, output_tokens=4),
    ]
    path = tmp_path / "tags.duckdb"
    write_rows(path, rows)
    return open_ledger(path, read_only=True)


def _figures(rows, *names):
    return [tuple(r[n] for n in names) for r in rows]


def test_tags_overlap_repeat_and_are_missing(tmp_path):
    conn = _ledger(tmp_path)
    rows, totals = queries.spend_report(conn, ["tag"], EVERYTHING)
    names = ("tag", "requests", "cost_usd", "priced_requests", "p95_cost_usd", "unpriced_requests", "input_tokens")
    assert _figures(rows, *names) == [
        ("(none)", 2, D("0.05"), 1, D("0.05"), 1, 37),
        ("x", 3, D("0.50"), 3, D("0.20"), 0, 200),
        ("y", 2, D("0.80"), 2, D("0.30"), 0, 340),
    ]
    assert [str(r["cost_usd"]) for r in rows] == ["0.050000000000", "0.500000000000", "0.800000000000"]
    assert rows[1]["avg_cost_usd"] == D("0.166666666667")  # $0.50 / 3, 12 places
    assert (totals["requests"], totals["cost_usd"], totals["p95_cost_usd"]) == (5, D("1.05"), D("0.30"))
    assert (totals["input_tokens"], totals["output_tokens"], totals["unpriced_tokens"]) == (427, 45, 10)
    assert (totals["priced_requests"], totals["unpriced_requests"], totals["avg_cost_usd"]) == (4, 1, D("0.2625"))
    assert totals == queries.spend_totals(conn, EVERYTHING)
    assert rows == queries.spend(conn, ["tag"], tz="Europe/Paris")
    conn.close()


def test_tags_with_another_dimension_and_top(tmp_path):
    conn = _ledger(tmp_path)
    rows, totals = queries.spend_report(conn, ["key", "tag"], EVERYTHING)
    assert _figures(rows, "key", "tag", "requests", "cost_usd", "p95_cost_usd") == [
        ("k1", "x", 3, D("0.50"), D("0.20")),
        ("k1", "y", 2, D("0.80"), D("0.30")),
        ("k2", "(none)", 2, D("0.05"), D("0.05")),
    ]
    assert totals == queries.spend_totals(conn, EVERYTHING)
    top, cut = queries.spend_report(conn, ["tag"], EVERYTHING, top=1)
    assert _figures(top, "tag", "cost_usd") == [("y", D("0.80"))] and cut == totals  # top cuts rows, not the total
    nightly = queries.Selection(filters={"tag": ["x"]}, tz="Europe/Paris")  # a and e, each with all its tags
    rows, totals = queries.spend_report(conn, ["tag"], nightly)
    assert _figures(rows, "tag", "requests", "cost_usd") == [("x", 3, D("0.50")), ("y", 1, D("0.10"))]
    assert (totals["requests"], totals["cost_usd"], totals["p95_cost_usd"]) == (2, D("0.30"), D("0.20"))
    conn.close()


def test_tag_report_of_nothing_and_with_drift(tmp_path):
    conn = _ledger(tmp_path)
    later = queries.Selection(dt.datetime(2030, 1, 1, tzinfo=dt.UTC), tz="Europe/Paris")
    rows, totals = queries.spend_report(conn, ["tag"], later)
    assert rows == [] and totals == queries.spend_totals(conn, later)
    empty = (totals["requests"], totals["input_tokens"], totals["cost_usd"], totals["p95_cost_usd"])
    assert empty == (0, None, None, None)
    rows, totals = queries.spend_report(conn, ["tag"], EVERYTHING, drift=True)
    assert totals == queries.spend_totals(conn, EVERYTHING, drift=True)
    assert (totals["provider_cost_usd"], rows[0]["provider_cost_drift_usd"]) == (None, None)  # no provider figures
    conn.close()
