"""A report's every group as CSV, JSON or Parquet, written by DuckDB rather than built as Python rows.

``tokenward report --format csv|json|parquet`` gives every group, and 200,000 sessions as Python
dicts (``Decimal`` money, three ratios each), then as text, cost more than the query itself. Here
the query of :func:`tokenward.reports.queries.groups_sql` is wrapped in one more ``SELECT`` that
writes each group's line (CSV, JSON) or typed row (Parquet), so no row ever becomes a Python object.

The output is byte for byte what :mod:`tokenward.reports.render` writes from the rows of
:func:`tokenward.reports.queries.spend`: the same keys in the same order, money as its 12-place
text, ratios rounded half to even as :func:`tokenward.reports.queries.derive` rounds them (exact
integer arithmetic on pico-dollars and tokens; an ``n / d`` quotient rounds once, as ``Decimal``'s
28-digit division followed by ``quantize`` does for any quotient under 1,000), strings quoted as
:mod:`csv` quotes them and escaped as :func:`json.dumps` escapes them (``ensure_ascii``). Reports
it does not cover return ``None`` (the caller then builds the rows): an ``hour`` grouping (its
label is local time worked out in Python), no groups at all, or a CSV of a single column.
"""

from __future__ import annotations

import csv
import io
import json
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenward.reports import queries, render

if TYPE_CHECKING:
    import duckdb

__all__ = ["report_parquet", "report_text"]

_PICO = 10**12
_RATIOS = {  # derive()'s ratios: numerator, denominator (integer SQL), scale of the numerator, places, when known
    "cache_hit_rate": (
        "coalesce(cached_input_tokens, 0)",
        "input_tokens",
        10**4,
        4,
        "input_tokens IS NOT NULL AND input_tokens <> 0",
    ),
    "output_share": (
        f"(output_cost_usd * {_PICO})::HUGEINT",
        f"(cost_usd * {_PICO})::HUGEINT",
        10**4,
        4,
        "cost_usd IS NOT NULL AND cost_usd <> 0 AND output_cost_usd IS NOT NULL",
    ),
    "avg_cost_usd": (
        f"(cost_usd * {_PICO})::HUGEINT",
        "priced_requests",
        1,
        12,
        "cost_usd IS NOT NULL AND priced_requests IS NOT NULL AND priced_requests <> 0",
    ),
}
_DATES = frozenset({"day", "week"})  # dimensions grouped as DATE: their ISO text, Parquet DATE
_FIT = 2**63 - 1
_JSON_ESCAPED = re.compile(r"[^\x00-\x7e]")  # what json.dumps escapes beyond ASCII controls (written by SQL)


def _csv_quoted() -> list[str]:
    """The characters that make :mod:`csv` quote a field, as ``render.to_csv`` writes it (asked, not assumed)."""
    found = []
    for char in (",", '"', "\n", "\r", "\t", "\x00", ";", " "):
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerow([f"a{char}b", 1])
        if buffer.getvalue().startswith('"'):
            found.append(char)
    return found


_CSV_QUOTED = _csv_quoted()


def _literal(text: str) -> str:
    """``text`` as a SQL string (control characters by ``chr``)."""
    parts = []
    for char in text:
        parts.append(f"chr({ord(char)})" if ord(char) < 32 else "'" + char.replace("'", "''") + "'")
    return " || ".join(parts) if parts else "''"


def _ratio_steps(name: str) -> tuple[str, str, str]:
    """Three SQL steps to the text of ``derive()``'s ``name`` ratio (NULL where Python's is ``None``).

    ``n / d`` rounded half to even to ``places`` decimals, its sign as ``Decimal`` gives it (``-``
    when exactly one operand is negative, ``-0.0000`` included): the first step is the quotient and
    remainder of ``|n| / |d|`` (BIGINT division where both fit, else HUGEINT: slower, rare), the
    second the rounded quotient, the third its text. Each step reads the columns the one before adds.
    """
    numerator, denominator, scale, places, known = _RATIOS[name]
    n, d = f"abs(({numerator})::HUGEINT * {scale})", f"abs(({denominator})::HUGEINT)"
    small = f"{n} <= {_FIT} AND {d} <= {_FIT}"
    q, r, v, neg = f"_q_{name}", f"_r_{name}", f"_v_{name}", f"_s_{name}"
    first = (
        f"CASE WHEN {known} THEN CASE WHEN {small} THEN ({n})::BIGINT // ({d})::BIGINT ELSE {n} // {d} END END AS {q}, "
        f"CASE WHEN {known} THEN CASE WHEN {small} THEN ({n})::BIGINT % ({d})::BIGINT ELSE {n} % {d} END END AS {r}, "
        f"CASE WHEN {known} THEN {d} END AS _d_{name}, "
        f"CASE WHEN (({numerator}) < 0) <> (({denominator}) < 0) THEN '-' ELSE '' END AS {neg}"
    )
    second = f"{q} + CASE WHEN 2 * {r} > _d_{name} OR (2 * {r} = _d_{name} AND {q} % 2 = 1) THEN 1 ELSE 0 END AS {v}"
    unit = 10**places
    third = f"{neg} || ({v} // {unit})::VARCHAR || '.' || lpad(({v} % {unit})::VARCHAR, {places}, '0')"
    return first, second, third


def _rows_sql(inner: str) -> str:
    """``inner``'s groups with the ratios' last step readable (as ``_v_<ratio>`` and ``_s_<ratio>``)."""
    steps = [_ratio_steps(name) for name in _RATIOS]
    first = ", ".join(s[0] for s in steps)
    second = ", ".join(s[1] for s in steps)
    return f"(SELECT *, {second} FROM (SELECT *, {first} FROM ({inner}) AS g0) AS g1) AS g"


def _keys(dims: list[str], measures: list[str], columns: list[render.Column], everything: bool) -> list[str]:
    """``render``'s keys for rows of these measures (``render._keys`` of a non-empty report)."""
    keys = [c.key for c in columns]
    carried = [*dims, *measures, *_RATIOS]
    return keys + [k for k in carried if k not in keys] if everything else keys


def _values_sql(dims: list[str], measures: list[str]) -> dict[str, tuple[str, str]]:
    """Each key's SQL text (NULL for ``None``) and kind: ``text`` (a string), ``date``, ``int``, ``money`` (decimal)."""
    values: dict[str, tuple[str, str]] = {}
    for d in dims:
        values[d] = (f"{d}::VARCHAR", "date" if d in _DATES else "text")
    for m in measures:
        values[m] = (f"{m}::VARCHAR", "money" if m.endswith("_usd") else "int")
    for name in _RATIOS:
        values[name] = (_ratio_steps(name)[2], "money")
    return values


def _csv_cell(sql: str, kind: str) -> str:
    if kind != "text":
        return f"coalesce({sql}, '')"
    special = " OR ".join(f"contains({sql}, {_literal(c)})" for c in _CSV_QUOTED) or "false"
    quoted = f"'\"' || replace({sql}, '\"', '\"\"') || '\"'"
    return f"CASE WHEN {sql} IS NULL THEN '' WHEN {special} THEN {quoted} ELSE {sql} END"


def _json_string(sql: str) -> str:
    escaped = f"replace(replace({sql}, '\\', '\\\\'), '\"', '\\\"')"
    controls = escaped
    for code in range(32):
        controls = f"replace({controls}, chr({code}), {_literal(json.dumps(chr(code))[1:-1])})" if code else controls
    has_control = "regexp_matches(" + sql + ", '[\\x01-\\x1f]')"
    return f"'\"' || CASE WHEN {has_control} THEN {controls} ELSE {escaped} END || '\"'"


def _json_value(sql: str, kind: str) -> str:
    if kind == "int":
        return f"coalesce({sql}, 'null')"
    if kind in ("money", "date"):
        return f"coalesce('\"' || {sql} || '\"', 'null')"
    return f"CASE WHEN {sql} IS NULL THEN 'null' ELSE {_json_string(sql)} END"


def _run(conn: duckdb.DuckDBPyConnection, build: Any) -> Any:
    """``build(narrow)`` with 64-bit token sums, again with HUGEINT ones when a sum is past 2^63."""
    import duckdb

    try:
        return build(True)
    except duckdb.ConversionException:
        return build(False)


def report_text(
    conn: duckdb.DuckDBPyConnection,
    by: Sequence[str],
    selection: queries.Selection,
    columns: list[render.Column],
    fmt: str,
    *,
    top: int | None = None,
    drift: bool = False,
    everything: bool = True,
) -> tuple[str, int] | None:
    """The text ``render.to_csv`` or ``render.to_json`` (``fmt``: ``csv``, ``json``) writes for :func:`spend`'s rows.

    Args:
        conn: an open ledger connection.
        by: dimensions, as :func:`tokenward.reports.queries.spend` takes them.
        selection: the rows read.
        columns: the report's columns (``render.columns_for``; no view columns).
        fmt: ``csv`` or ``json``.
        top: only the ``top`` groups that cost the most, highest first.
        drift: the provider-reported cost columns too.
        everything: every other measure after the columns (``render.to_csv``'s ``everything``).

    Returns:
        The text and its number of groups, or ``None`` when this report is not covered (see the module).

    Raises:
        ValueError: unknown grouping or filter.
    """
    dims = [queries.canonical(name) for name in by]
    if "hour" in dims:
        return None

    def build(narrow: bool) -> tuple[str, int] | None:
        inner, params, measures, order = queries.groups_sql(conn, dims, selection, top=top, drift=drift, narrow=narrow)
        keys = _keys(dims, measures, columns, everything)
        if fmt == "csv" and len(keys) < 2:  # csv quotes a lone empty field: left to render
            return None
        values = _values_sql(dims, measures)
        # one concat() of every piece: a chain of || copies the growing line once per piece
        if fmt == "csv":
            pieces = [piece for k in keys for piece in ("','", _csv_cell(*values[k]))][1:]
        else:
            pieces = [_literal("  {\n    " + json.dumps(keys[0]) + ": ")]
            for i, k in enumerate(keys):
                pieces += [
                    _json_value(*values[k]),
                    _literal(",\n    " + json.dumps(keys[i + 1]) + ": " if i + 1 < len(keys) else "\n  }"),
                ]
        line = f"concat({', '.join(pieces)})"  # every piece is text (NULLs written out already)
        separator = "\n" if fmt == "csv" else ",\n"
        ordered = f" ORDER BY {order}" if order else ""
        cursor = conn.execute(f"SELECT {line} FROM {_rows_sql(inner)}{ordered}", params)
        lines = [found for (found,) in cursor.fetchall()]  # one text each: string_agg's is slower
        count = len(lines)
        if not count:
            return None
        text = separator.join(lines)
        if fmt == "csv":
            return ",".join(keys) + "\n" + text + "\n", count
        text = "[\n" + text + "\n]\n"
        if not text.isascii() or "\x7f" in text:  # json.dumps writes these as \\uXXXX
            text = _JSON_ESCAPED.sub(lambda m: json.dumps(m.group())[1:-1], text)
        return text, count

    return _run(conn, build)


def report_parquet(
    conn: duckdb.DuckDBPyConnection,
    by: Sequence[str],
    selection: queries.Selection,
    columns: list[render.Column],
    path: Path,
    *,
    top: int | None = None,
    drift: bool = False,
    everything: bool = True,
) -> int | None:
    """Write what ``render.to_parquet`` writes for :func:`spend`'s rows to ``path``; returns the groups written.

    Arguments as :func:`report_text`'s. ``None`` when the report is not covered: then nothing, or a
    file without rows, was written, and ``render.to_parquet`` must write it.

    Raises:
        ValueError: unknown grouping or filter.
        duckdb.Error: the file cannot be written.
    """
    dims = [queries.canonical(name) for name in by]
    if "hour" in dims:
        return None
    kinds = {c.key: c.kind for c in columns}

    def build(narrow: bool) -> int | None:
        inner, params, measures, order = queries.groups_sql(conn, dims, selection, top=top, drift=drift, narrow=narrow)
        keys = _keys(dims, measures, columns, everything)
        values = _values_sql(dims, measures)
        typed = []
        for key in keys:
            sql, kind = values[key]
            if key in dims:  # render: typed as the values (DATE or VARCHAR)
                target = "DATE" if kind == "date" else "VARCHAR"
                sql = key
            elif kinds.get(key) == "ratio":
                target = "DECIMAL(18, 4)"
            elif kind == "money":
                target = "DECIMAL(38, 12)"
                sql = key if key in measures else sql
            else:
                target, sql = "BIGINT", key
            typed.append(f'CAST({sql} AS {target}) AS "{key}"')
        ordered = f" ORDER BY {order}" if order else ""
        # a table first, as render.to_parquet writes one: a query's COPY lays out pages otherwise
        table = f"_report_{uuid.uuid4().hex}"
        conn.execute(f"CREATE TEMP TABLE {table} AS SELECT {', '.join(typed)} FROM {_rows_sql(inner)}{ordered}", params)
        try:
            found = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
            written = int(found[0]) if found else 0
            if not written:
                return None  # no group: render writes the columns' own types
            conn.execute(f"COPY {table} TO $_path (FORMAT parquet)", {"_path": str(path)})
        finally:
            conn.execute(f"DROP TABLE {table}")
        return written

    return _run(conn, build)
