"""Report queries over the ledger; each takes an open connection and returns plain rows.

Money stays exact: sums of ``DECIMAL(38, 12)`` come back as ``Decimal``. A dollar total adds
the rows whose cost is known; unpriced rows (cost NULL) are counted beside it, never hidden in
a $0, and a group with no priced row has a NULL cost. Provider-reported costs (OpenRouter's
``usage.cost``) are summed beside ours, with the drift between them.
Tokens and costs add up every row (a request's retried attempts and other-model parts
included); ``requests`` counts only the one ``request`` row of each request.
Calendar groupings (``day``) use the given IANA time zone; stored times are UTC.
"""

from __future__ import annotations

import datetime as dt
import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from tokenward.pricing.budgets import SNAPSHOT_SUFFIX, model_base
from tokenward.pricing.catalog import CLOUD_NAME_PATTERNS
from tokenward.pricing.usage import TOKEN_FIELDS
from tokenward.reports.ledger import ROW_COLUMNS
from tokenward.reports.localtime import local_hour_start_sql, local_timestamp_sql

if TYPE_CHECKING:
    import duckdb

__all__ = [
    "ALIASES",
    "DIMENSIONS",
    "EXPORT_COLUMNS",
    "TIME_DIMENSIONS",
    "Selection",
    "bare_models",
    "cloud_model_sql",
    "canonical",
    "derive",
    "export_rows",
    "group_costs",
    "groups_sql",
    "model_condition",
    "plain_models",
    "spend",
    "spend_report",
    "spend_totals",
]

DIMENSIONS: dict[str, str] = {
    "hour": "{hour_start}",
    "day": "CAST({local} AS DATE)",
    "week": "CAST(date_trunc('week', {local}) AS DATE)",
    "month": "strftime({local}, '%Y-%m')",
    "key": "principal",
    "team": "coalesce(team, '(none)')",
    "project": "coalesce(project, '(none)')",
    "end_user": "coalesce(end_user, '(none)')",
    "model": "coalesce(served_model, requested_model, '(none)')",
    "provider": "coalesce(provider, '(none)')",
    "upstream": "coalesce(upstream, '(none)')",
    "endpoint": "endpoint",
    "tag": "tag",
    "session": "coalesce(session_id, '(none)')",
    "outcome": "outcome",
}
"""Group-by dimensions and their SQL. Calendar ones are local to the report's time zone (``{local}``
is the local start time; ``hour``: ``2026-10-25T02:00+02:00``, with the UTC offset, so the hour
repeated when summer time ends stays two hours; ``week``: the Monday that starts the ISO week;
``month``: ``YYYY-MM``).
``tag`` puts a request under each of its tags (``(none)`` without one), so tag groups can add up
to more than the total."""

TIME_DIMENSIONS = frozenset({"hour", "day", "week", "month"})
"""Dimensions that are calendar buckets (filtered with ``since``/``until``, not ``filters``)."""

ALIASES = {"principal": "key", "user": "end_user", "end-user": "end_user", "tags": "tag", "session_id": "session"}
"""Other names accepted for dimensions."""

EXPORT_COLUMNS: tuple[str, ...] = tuple(ROW_COLUMNS)
"""Columns of :func:`export_rows`, with the ledger's canonical names."""

_TAGGED_COLUMNS = (
    "started_at",
    "principal",
    "team",
    "project",
    "end_user",
    "served_model",
    "requested_model",
    "provider",
    "upstream",
    "endpoint",
    "session_id",
    "outcome",
    "row_kind",
    "price_status",
    "usage_source",
    "service_tier",
    "cost_usd",
    "cache_savings_usd",
    "output_cost_usd",
    "provider_cost_usd",
    *TOKEN_FIELDS,
)  # what reports read from a row: carried through the per-tag fan-out (not the wide JSON columns)
_TAGS = "CASE WHEN len(coalesce(tags, [])) > 0 THEN tags ELSE ['(none)'] END"
_BILLED = "row_kind = 'request' AND price_status IN ('priced', 'partially_priced', 'fallback', 'repaired')"
# no cast: ranked in the stored type, DECIMAL(18, 12) (64-bit) since m006_costs_in_64_bits
_P95 = f"quantile_disc(cost_usd, 0.95) FILTER (WHERE {_BILLED})"

_GROUP_MEASURES: dict[str, str] = {
    "requests": "count(*) FILTER (WHERE row_kind = 'request')",
    "input_tokens": "sum(input_tokens)",
    "cached_input_tokens": "sum(cached_input_tokens)",
    "cache_write_tokens": "sum(cache_write_tokens)",
    "output_tokens": "sum(output_tokens)",
    "reasoning_tokens": "sum(reasoning_tokens)",
    "cost_usd": "sum(cost_usd)::DECIMAL(38, 12)",
    "cache_savings_usd": "sum(cache_savings_usd)::DECIMAL(38, 12)",
    "output_cost_usd": "sum(output_cost_usd)::DECIMAL(38, 12)",
    "priced_requests": f"count(*) FILTER (WHERE {_BILLED})",
    "p95_cost_usd": _P95,
    "unpriced_requests": "count(*) FILTER (WHERE price_status IN ('unpriced', 'partially_priced', 'usage_invalid'))",
    "estimated_requests": "count(*) FILTER (WHERE usage_source IN ('estimated', 'partial'))",
}
_DRIFT_MEASURES: dict[str, str] = {
    "provider_cost_usd": "sum(provider_cost_usd)::DECIMAL(38, 12)",
    "provider_cost_drift_usd": "sum(provider_cost_usd - cost_usd) "
    "FILTER (WHERE provider_cost_usd IS NOT NULL AND cost_usd IS NOT NULL)::DECIMAL(38, 12)",
}
_TOTAL_MEASURES: dict[str, str] = {
    "p95_cost_usd": _P95,
    "unpriced_tokens": "coalesce(sum(input_tokens + output_tokens) "
    "FILTER (WHERE price_status IN ('unpriced', 'usage_invalid')), 0)",
    "usage_unknown_requests": "count(*) FILTER (WHERE price_status = 'usage_unknown')",
    "fallback_priced_requests": "count(*) FILTER (WHERE price_status = 'fallback')",
}
_ADDITIVE = [k for k in _GROUP_MEASURES if k != "p95_cost_usd"] + list(_DRIFT_MEASURES)
_TOKEN_SUMS = frozenset(k for k, sql in _GROUP_MEASURES.items() if sql == f"sum({k})")
# Token sums are HUGEINT in DuckDB; a group's fits 64 bits by far, and 64-bit values reach Python
# several times faster (200,000 groups: 0.07 s a column). A sum past 2^63 falls back to HUGEINT.

_CHUNK = 10_000  # rows converted to Python at a time
_RATIO = Decimal("0.0001")
_PICO = Decimal("1e-12")


@dataclass(frozen=True, slots=True)
class Selection:
    """Which ledger rows a report reads.

    ``since`` (inclusive) and ``until`` (exclusive) are aware instants or ``None`` (open);
    ``filters`` maps dimensions (not calendar ones) to the values kept (any of them); ``tz`` is the
    IANA zone of calendar groupings.

    Raises:
        ValueError: unknown dimension, a calendar dimension in ``filters``, or a naive bound.
    """

    since: dt.datetime | None = None
    until: dt.datetime | None = None
    filters: Mapping[str, Sequence[str]] = field(default_factory=dict)
    tz: str = "UTC"

    def __post_init__(self) -> None:
        for bound in (self.since, self.until):
            if bound is not None and bound.tzinfo is None:
                raise ValueError("since/until must be timezone-aware")
        for name in self.filters:
            if ALIASES.get(name.lower(), name.lower()) in TIME_DIMENSIONS:
                raise ValueError(f"filter on {name!r}: use --since/--until for time")
            canonical(name, "filter")

    def where(self, extra: str | None = None) -> tuple[str, dict[str, Any]]:
        """The SQL condition (`` WHERE ...`` or empty, with ``extra`` ANDed in) and its parameters."""
        clauses, params = [extra] if extra else [], {}
        if self.since is not None:
            clauses.append("started_at >= $since")
            params["since"] = self.since
        if self.until is not None:
            clauses.append("started_at < $until")
            params["until"] = self.until
        for i, (name, values) in enumerate(sorted(self.filters.items())):
            dimension = canonical(name, "filter")
            params[f"f{i}"] = plain_models(values) if dimension == "model" else list(values)
            if dimension == "tag":  # "(none)", as --by tag shows it, keeps the untagged rows
                untagged = " OR len(coalesce(tags, [])) = 0" if "(none)" in values else ""
                clauses.append(f"(list_has_any(coalesce(tags, []), $f{i}){untagged})")
            elif dimension == "model":  # as a budget's scope: requested or served, dated snapshots too
                params[f"f{i}b"] = bare_models(values)
                clauses.append(model_condition(f"$f{i}", f"$f{i}b"))
            else:
                clauses.append(f"list_contains($f{i}, {DIMENSIONS[dimension]})")
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params

    def group_keys(self, conn: duckdb.DuckDBPyConnection, dims: Sequence[str]) -> list[str]:
        """SQL for each dimension in ``dims`` (calendar ones in this selection's zone; see :meth:`label`)."""
        local = hour_start = ""
        if any(d in TIME_DIMENSIONS for d in dims):
            lo, hi = self.since, self.until
            if lo is None or hi is None:
                where, params = self.where()
                found = conn.execute(f"SELECT min(started_at), max(started_at) FROM requests{where}", params).fetchone()
                lo, hi = lo or (found[0] if found else None), hi or (found[1] if found else None)
            local, hour_start = local_timestamp_sql(self.tz, lo, hi), local_hour_start_sql(self.tz, lo, hi)
        return [DIMENSIONS[d].replace("{hour_start}", hour_start).replace("{local}", local) for d in dims]

    def label(self, dims: Sequence[str], key: Sequence[Any]) -> tuple[Any, ...]:
        """A group key as reports show it.

        An hour (grouped as the epoch microseconds it began) becomes local ISO time with its UTC
        offset, ``2026-10-25T02:00+02:00``.
        """
        zone = ZoneInfo(self.tz)
        return tuple(_hour_label(v, zone) if d == "hour" else v for d, v in zip(dims, key, strict=True))

    def rows(self, dims: Sequence[str], extra: str | None = None) -> tuple[str, dict[str, Any]]:
        """``FROM`` clause (with its ``WHERE``) and parameters for a report grouped by ``dims``.

        With ``tag`` among them, each row appears once per tag (``(none)`` when it has none).
        ``extra``: a further SQL condition.
        """
        where, params = self.where(extra)
        if "tag" not in dims:
            return f"requests{where}", params
        columns = ", ".join(_TAGGED_COLUMNS)
        return f"(SELECT {columns}, unnest({_TAGS}) AS tag FROM requests{where}) AS tagged", params


def plain_models(names: Sequence[str]) -> list[str]:
    """``names`` without their routing prefixes (the first list :func:`model_condition` takes)."""
    return [model_base(n) for n in names]


def bare_models(names: Sequence[str]) -> list[str]:
    """``names`` without routing prefixes and dated snapshot suffixes (:func:`model_condition`'s second list)."""
    return [SNAPSHOT_SUFFIX.sub("", model_base(n)) for n in names]


def cloud_model_sql(expr: str) -> str:
    """SQL for :func:`tokenward.pricing.catalog.cloud_model` of the text ``expr`` (DuckDB and Postgres alike).

    ``regexp_replace`` replaces the first match in both engines, and both read the patterns
    (non-capturing groups, digit classes) the same way: Bedrock's ``us.anthropic.claude-sonnet-4-5-20250929-v1:0``
    becomes ``claude-sonnet-4-5-20250929``, Vertex AI's ``claude-sonnet-4-5@20250929``
    ``claude-sonnet-4-5``; any other name is left as it is.
    """
    vertex, bedrock, revision = CLOUD_NAME_PATTERNS
    plain = f"regexp_replace(regexp_replace({expr}, '{vertex}', ''), '{bedrock}', '')"
    return f"(CASE WHEN {plain} = {expr} THEN {expr} ELSE regexp_replace({plain}, '{revision}', '') END)"


def model_condition(names: str, bare: str) -> str:
    """SQL keeping rows whose model is one of the list ``names``.

    As :func:`tokenward.pricing.budgets.same_model` has it: the requested, sent (a degraded
    request's reroute) or served name, without its routing prefix (``openai/gpt-4o`` is
    ``gpt-4o``), equal, or equal once a dated snapshot suffix is removed from either side (the
    guard's :func:`~tokenward.proxy.guard.attributes_of_row` reads the same three), each read as
    the model a cloud's name for it names (:func:`cloud_model_sql`).

    ``names`` and ``bare`` are placeholders for :func:`plain_models` and :func:`bare_models` of the names.
    """
    columns = [
        cloud_model_sql(f"list_extract(string_split(coalesce({c}, '(none)'), '/'), -1)")
        for c in ("requested_model", "sent_model", "served_model")
    ]
    stripped = [f"regexp_replace({c}, '{SNAPSHOT_SUFFIX.pattern}', '')" for c in columns]
    return f"(list_has_any({names}, [{', '.join(columns + stripped)}]) OR list_has_any({bare}, [{', '.join(columns)}]))"


def canonical(name: str, use: str = "grouping") -> str:
    """The dimension called ``name`` (aliases resolved; case ignored).

    Args:
        name: a dimension or alias, as typed (``team``, ``user``).
        use: ``grouping`` (``--by``) or ``filter`` (``--where``): what the error calls the name,
            and which names it offers (a filter takes no calendar dimension: time is ``--since``/``--until``).

    Raises:
        ValueError: not a dimension: ``unknown filter 'tem' (did you mean 'team'?); filter on key,
            team, ...``, the close name offered when there is one.
    """
    dimension = ALIASES.get(name.lower(), name.lower())
    if dimension in DIMENSIONS:
        return dimension
    choices = [d for d in DIMENSIONS if use != "filter" or d not in TIME_DIMENSIONS]
    names = choices + [alias for alias, d in ALIASES.items() if d in choices]
    close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    if use == "filter":
        raise ValueError(f"unknown filter {name!r}{hint}; filter on {', '.join(choices)} (time: --since/--until)")
    raise ValueError(f"unknown {use} {name!r}{hint}; choose from {', '.join(choices)}")


def spend(
    conn: duckdb.DuckDBPyConnection,
    by: Sequence[str] = ("model",),
    *,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    tz: str = "UTC",
    filters: Mapping[str, Sequence[str]] | None = None,
    top: int | None = None,
    drift: bool = False,
) -> list[dict[str, Any]]:
    """Requests, tokens and cost grouped by ``by`` over ``[since, until)``.

    Args:
        conn: an open ledger connection.
        by: dimensions (:data:`DIMENSIONS` or :data:`ALIASES`), in order.
        since: inclusive start (timezone-aware), or ``None`` for the beginning.
        until: exclusive end (timezone-aware), or ``None`` for now.
        tz: IANA zone for calendar groupings.
        filters: dimension -> values to keep (see :class:`Selection`).
        top: keep the ``top`` groups with the highest cost (unpriced groups last).
        drift: add ``provider_cost_usd`` and ``provider_cost_drift_usd`` (provider's figure
            minus ours, where both exist).

    Returns:
        One dict per group, ordered by the group keys (by cost with ``top``): the dimensions of
        ``by`` plus ``requests`` (client requests; retried attempts and other-model parts add
        tokens and cost, not requests), token sums (tokens), ``cost_usd`` (``Decimal`` USD,
        ``None`` when nothing is priced), ``cache_savings_usd``, ``output_cost_usd``,
        ``priced_requests``, ``p95_cost_usd`` (nearest-rank 95th percentile of a priced request's
        cost), ``unpriced_requests`` (unpriced or partially priced), ``estimated_requests``, and
        the ratios of :func:`derive`.

    Raises:
        ValueError: unknown grouping or filter, or a naive ``since``/``until``.
    """
    selection = Selection(since, until, filters or {}, tz)
    return _grouped(conn, selection, [canonical(name) for name in by], top=top, drift=drift, total=False)[0]


def spend_report(
    conn: duckdb.DuckDBPyConnection,
    by: Sequence[str],
    selection: Selection,
    *,
    top: int | None = None,
    drift: bool = False,
    shown: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of :func:`spend` over ``selection`` and their total (:func:`spend_totals`), in two scans.

    The first ranks the costs of the whole selection (the total's ``p95_cost_usd``) and counts
    what only the total shows; the second groups the rows and, in the same statement, adds up
    every group (``top`` cuts what is returned, not the total). With ``tag`` in ``by`` the
    groups overlap, so the first scan reads every measure of the selection once instead.
    Values and types are those of :func:`spend` and :func:`spend_totals`.

    ``shown`` (without ``top``): at most that many rows. When there are more groups, only the
    ``shown`` that cost the most are built and returned, highest first (as with ``top``), and
    the total counts every group in ``groups``; with as many groups or fewer, the rows are
    those without it, and the total has ``groups`` too. A terminal table of 200,000 sessions
    is unreadable, and building them all is most of the report's time.

    Raises:
        ValueError: unknown grouping or filter.
    """
    dims = [canonical(name) for name in by]
    cut = None if top else shown
    if "tag" in dims:  # one statement: see _tagged_sql
        rows, summed = _grouped(conn, selection, dims, top=top, drift=drift, total=True, shown=cut)
        return rows, derive(summed or {})
    # the scan first: its ranking memory is given back before the rows are built
    where, params = selection.where()
    cursor = conn.execute(
        f"SELECT {', '.join(f'{sql} AS {n}' for n, sql in _TOTAL_MEASURES.items())} FROM requests{where}", params
    )
    names = [d[0] for d in cursor.description]
    scanned = dict(zip(names, cursor.fetchone() or (), strict=True))
    rows, summed = _grouped(conn, selection, dims, top=top, drift=drift, total=True, shown=cut)
    return rows, derive({**(summed or {}), **scanned})


def _grouped(
    conn: duckdb.DuckDBPyConnection,
    selection: Selection,
    dims: list[str],
    *,
    top: int | None,
    drift: bool,
    total: bool,
    shown: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Groups (ordered, cut to ``top`` or ``shown``) and, with ``total``, every group's measures added up.

    The total has no ratios yet.

    ``shown`` (with ``total``, see :func:`spend_report`) adds ``groups`` to the total.
    """
    import duckdb

    try:
        return _grouped_once(conn, selection, dims, top=top, drift=drift, total=total, narrow=True, shown=shown)
    except duckdb.ConversionException:  # a token sum past 2^63: read it as HUGEINT
        return _grouped_once(conn, selection, dims, top=top, drift=drift, total=total, narrow=False, shown=shown)


def _grouped_once(
    conn: duckdb.DuckDBPyConnection,
    selection: Selection,
    dims: list[str],
    *,
    top: int | None,
    drift: bool,
    total: bool,
    narrow: bool,
    shown: int | None,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    measures = _measures(drift, narrow)
    ctes, params, extras = _group_ctes(conn, selection, dims, measures, narrow=narrow, total=total)
    limit = top or (shown if total else None)
    order = ", ".join(["cost_usd DESC NULLS LAST"] * bool(limit) + dims)
    # _total comes last, so that zipping a row with the measure names leaves it out
    groups = f"(SELECT * FROM g ORDER BY {order} LIMIT {int(limit)})" if limit else "g"
    select = f"SELECT *, false AS _total FROM {groups}"
    counted = ""
    if limit and not top:  # the total counts the groups; a cut is ordered by cost, as --top is
        counted = "(SELECT count(*) FROM g) AS groups, "
        extras = {**extras, "groups": counted}
    if total and "tag" in dims:  # the groups overlap: the total adds up the lists of tags instead
        select += f" UNION ALL BY NAME SELECT *, {counted}true AS _total FROM _whole"
    elif total:
        whole = "::BIGINT" if narrow else ""  # else the union makes every count of the rows a HUGEINT
        sums = ", ".join(
            f"sum({n}) AS {n}" if n.endswith("_usd") else f"coalesce(sum({n}), 0){whole} AS {n}"
            for n in measures
            if n in _ADDITIVE
        )
        select += f" UNION ALL BY NAME SELECT {sums}, {counted}true AS _total FROM g"
    # money reaches Python as text: Decimal(text) is about three times faster than DuckDB's own conversion
    text = ", ".join(f"{n}::VARCHAR AS {n}" for n in measures if n.endswith("_usd"))
    by_cost = ["u.cost_usd DESC NULLS LAST"] * bool(top)
    if counted:  # by cost only when some groups are left out
        by_cost = [f"CASE WHEN (SELECT count(*) FROM g) > {int(limit)} THEN u.cost_usd END DESC NULLS LAST"]
    ordering = ", ".join(["u._total", *by_cost, *(f"u.{d}" for d in dims)])
    cursor = conn.execute(
        f"WITH {ctes} SELECT * EXCLUDE (_total) REPLACE ({text}), _total FROM ({select}) AS u ORDER BY {ordering}",
        params,
    )
    names = [d[0] for d in cursor.description][:-1]
    visible = [n for n in names if n not in extras]  # the total's own measures: no group has them
    build = _row_builder(selection, names, visible)
    rows: list[dict[str, Any]] = []
    summed = None
    while chunk := cursor.fetchmany(_CHUNK):  # a chunk at a time: fewer Python objects alive at once
        if chunk[-1][-1]:  # the total comes last
            last = chunk.pop()
            pairs = zip(names, last, strict=False)  # _total, last, left out
            summed = {n: _money(v) if n.endswith("_usd") else v for n, v in pairs if n not in dims}
        rows += map(build, chunk)
    return rows, summed


def _measures(drift: bool, narrow: bool) -> dict[str, str]:
    """A group's measures (name -> SQL); ``narrow``: token sums cast to BIGINT."""
    measures = {**_GROUP_MEASURES, **(_DRIFT_MEASURES if drift else {})}
    if narrow:
        measures = {n: f"{sql}::BIGINT" if n in _TOKEN_SUMS else sql for n, sql in measures.items()}
    return measures


def _group_ctes(
    conn: duckdb.DuckDBPyConnection,
    selection: Selection,
    dims: list[str],
    measures: dict[str, str],
    *,
    narrow: bool,
    total: bool,
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """``WITH`` clauses defining ``g`` (one row per group: ``dims``, then ``measures``), and their parameters.

    Also the measures only the total has (with ``total`` and ``tag``: ``_whole`` too, see :func:`_tagged_sql`).
    """
    keys = selection.group_keys(conn, dims)
    if "tag" in dims:
        return _tagged_sql(selection, dims, keys, measures, narrow=narrow, total=total)
    source, params = selection.rows(dims)
    grouped = f"SELECT {''.join(f'{sql} AS {d}, ' for sql, d in zip(keys, dims, strict=True))}"
    grouped += f"{', '.join(f'{sql} AS {n}' for n, sql in measures.items())} FROM {source}"
    if dims:
        grouped += f" GROUP BY {', '.join(str(i + 1) for i in range(len(dims)))}"
    return f"g AS MATERIALIZED ({grouped})", params, {}


def groups_sql(
    conn: duckdb.DuckDBPyConnection,
    by: Sequence[str],
    selection: Selection,
    *,
    top: int | None = None,
    drift: bool = False,
    narrow: bool = True,
) -> tuple[str, dict[str, Any], list[str], str]:
    """The groups of :func:`spend` as one SQL query, for DuckDB to write out without Python rows.

    Returns the query, its parameters, its measures' names (in :func:`spend`'s order; the
    ratios of :func:`derive` are not in it) and its ``ORDER BY`` terms (empty for one group).
    Its columns are the dimensions of ``by`` as grouped (an ``hour`` as the epoch microseconds it
    began, not its label), then the measures (money as ``DECIMAL``, token sums ``BIGINT`` with
    ``narrow``, else ``HUGEINT``), ordered as :func:`spend`'s rows (by cost with ``top``, then the
    keys). Reading it raises ``duckdb.ConversionException`` when a ``narrow`` token sum is past 2^63.

    Raises:
        ValueError: unknown grouping or filter.
    """
    dims = [canonical(name) for name in by]
    measures = _measures(drift, narrow)
    ctes, params, _ = _group_ctes(conn, selection, dims, measures, narrow=narrow, total=False)
    order = ", ".join(["cost_usd DESC NULLS LAST"] * bool(top) + dims)
    limit = f" LIMIT {int(top)}" if top else ""
    return f"WITH {ctes} SELECT * FROM g{' ORDER BY ' + order if order else ''}{limit}", params, list(measures), order


def _row_builder(
    selection: Selection, names: list[str], shown: list[str]
) -> Callable[[tuple[Any, ...]], dict[str, Any]]:
    """A function making a fetched row (values of ``names``, money as text) the dict of ``shown`` and its ratios.

    It is one function compiled for these columns (as ``collections.namedtuple`` compiles its
    class): money becomes ``Decimal``, an hour (grouped as the epoch microseconds it began) its
    label (:meth:`Selection.label`), the ratios are :func:`derive`'s, and the dict is one display.
    That is about half the CPU of converting the columns one at a time and zipping them back into
    dicts (200,000 rows: 0.5 s against 1 s). The names are dimensions and measures, never user input.
    """
    at = {n: f"r[{i}]" for i, n in enumerate(names)}
    lines = [f"    m{i} = None if {at[n]} is None else D({at[n]})" for i, n in enumerate(shown) if n.endswith("_usd")]
    value = {n: f"m{i}" if n.endswith("_usd") else at[n] for i, n in enumerate(shown)}
    if "hour" in value:
        value["hour"] = f"H({at['hour']}, zone)"
    value["cache_hit_rate"] = f"hit({value['cached_input_tokens']}, {value['input_tokens']})"
    value["output_share"] = f"share({value['output_cost_usd']}, {value['cost_usd']})"
    value["avg_cost_usd"] = f"average({value['cost_usd']}, {value['priced_requests']})"
    display = ", ".join(f"{name!r}: {v}" for name, v in value.items())
    code = "\n".join(["def build(r):", *lines, f"    return {{{display}}}"])
    scope = {"D": Decimal, "H": _hour_label, "zone": ZoneInfo(selection.tz), "hit": _hit_rate, "share": _share}
    scope["average"] = _average
    exec(code, scope)  # noqa: S102
    return scope["build"]


def _tagged_sql(
    selection: Selection,
    dims: list[str],
    keys: list[str],
    measures: dict[str, str],
    *,
    narrow: bool,
    total: bool,
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The ``WITH`` clauses of a grouping with ``tag`` (``g``: the groups; ``_whole``, with ``total``: their total).

    No row is copied once per tag: the additive measures are summed per list of tags first (a
    ledger holds few distinct lists), and only those sums are spread over the tags and added up
    again; a tag's p95 ranks a fan-out of two columns, the billed rows' costs. Each row is in
    exactly one list, so the lists also add up to the total, whose p95 ranks the selection once.
    A tag repeated in a row's list counts that row twice, as a fan-out of the row would.
    Returns the clauses, their parameters and the measures only the total has (name -> SQL).
    """
    where, params = selection.where()
    billed, _ = selection.where(_BILLED)
    carried = "".join(f"{sql} AS {d}, " for sql, d in zip(keys, dims, strict=True) if d != "tag")
    extras = {n: sql for n, sql in _TOTAL_MEASURES.items() if n != "p95_cost_usd"} if total else {}
    additive = {**{n: sql for n, sql in measures.items() if n != "p95_cost_usd"}, **extras}
    additive = {n: sql.removesuffix("::BIGINT") for n, sql in additive.items()}  # cast once added up
    by_list = ", ".join(str(i + 1) for i in range(len(dims)))  # the other dimensions and the list
    lists = (
        f"SELECT {carried}tags AS _tags, "
        f"{', '.join(f'{sql} AS {n}' for n, sql in additive.items())} FROM requests{where} GROUP BY {by_list}"
    )

    def added(name: str) -> str:  # a measure's sum over the lists
        if name.endswith("_usd"):
            return f"sum({name})"
        if measures.get(name, additive[name]).startswith(("count(", "coalesce(")):
            return f"coalesce(sum({name}), 0)::BIGINT" if name != "unpriced_tokens" else f"coalesce(sum({name}), 0)"
        return f"sum({name})::BIGINT" if narrow and name in _TOKEN_SUMS else f"sum({name})"

    dim_list = ", ".join(dims)
    spread = f"SELECT * EXCLUDE (_tags), unnest({_TAGS.replace('tags', '_tags')}) AS tag FROM _lists"
    summed = f"SELECT {dim_list}, {', '.join(f'{added(n)} AS {n}' for n in additive if n not in extras)} FROM _spread"
    costs = f"SELECT {carried}unnest({_TAGS}) AS tag, cost_usd FROM requests{billed}"
    ranked = f"SELECT {dim_list}, quantile_disc(cost_usd, 0.95) AS p95_cost_usd FROM _costs GROUP BY ALL"
    same = " AND ".join(f"s.{d} IS NOT DISTINCT FROM p.{d}" for d in dims)
    picked = ", ".join([*(f"s.{d}" for d in dims), *(f"{'p' if n == 'p95_cost_usd' else 's'}.{n}" for n in measures)])
    ctes = [
        f"_lists AS MATERIALIZED ({lists})",
        f"_spread AS ({spread})",
        f"_summed AS ({summed} GROUP BY ALL)",
        f"_costs AS ({costs})",
        f"_ranked AS ({ranked})",
        f"g AS MATERIALIZED (SELECT {picked} FROM _summed AS s LEFT JOIN _ranked AS p ON {same})",
    ]
    if total:
        p95 = f"(SELECT {_P95} FROM requests{where}) AS p95_cost_usd"
        whole = ", ".join(p95 if n == "p95_cost_usd" else f"{added(n)} AS {n}" for n in [*measures, *extras])
        ctes.append(f"_whole AS (SELECT {whole} FROM _lists)")
    return ", ".join(ctes), params, extras


def group_costs(
    conn: duckdb.DuckDBPyConnection, by: Sequence[str], selection: Selection
) -> tuple[list[dict[str, Any]], Decimal | None]:
    """Only the cost of each group of :func:`spend` over ``selection``, and of the whole selection.

    What ``report --compare`` reads of the previous period: each group's ``cost_usd`` (``Decimal``
    USD, ``None`` when nothing is priced), equal to :func:`spend`'s, keyed by the dimensions of
    ``by`` as :func:`spend` shows them; and the total cost (each row once, also with ``tag``),
    ``None`` when nothing is priced. Sums only: no quantile, no ratio, a third of the time.

    Raises:
        ValueError: unknown grouping or filter.
    """
    dims = [canonical(name) for name in by]
    keys = selection.group_keys(conn, dims)
    source, params = selection.rows(dims)
    grouping = f" GROUP BY {', '.join(str(i + 1) for i in range(len(dims)))}" if dims else ""
    cursor = conn.execute(
        f"SELECT {''.join(f'{sql} AS {d}, ' for sql, d in zip(keys, dims, strict=True))}"
        f"sum(cost_usd)::DECIMAL(38, 12)::VARCHAR AS cost_usd FROM {source}{grouping}",
        params,
    )
    rows = [
        {**dict(zip(dims, selection.label(dims, found[:-1]), strict=True)), "cost_usd": _money(found[-1])}
        for found in cursor.fetchall()
    ]
    if "tag" in dims:  # the groups overlap: add up the rows once
        where, params = selection.where()
        found = conn.execute(f"SELECT sum(cost_usd)::DECIMAL(38, 12)::VARCHAR FROM requests{where}", params).fetchone()
        return rows, _money(found[0] if found else None)
    costs = [r["cost_usd"] for r in rows if r["cost_usd"] is not None]
    return rows, (sum(costs[1:], costs[0]) if costs else None)


def _money(text: str | None) -> Decimal | None:
    return None if text is None else Decimal(text)


def _hour_label(value: Any, zone: ZoneInfo) -> Any:
    """An hour grouped as the epoch microseconds it began, as local ISO time with its UTC offset."""
    if not isinstance(value, int):
        return value
    return dt.datetime.fromtimestamp(value / 1_000_000, zone).isoformat(timespec="minutes")


def spend_totals(
    conn: duckdb.DuckDBPyConnection,
    selection: Selection,
    *,
    groups: list[dict[str, Any]] | None = None,
    drift: bool = False,
) -> dict[str, Any]:
    """The measures of :func:`spend` over the whole selection, and a few more.

    The more: ``unpriced_tokens`` (input + output of unpriced rows), ``usage_unknown_requests``
    and ``fallback_priced_requests``.

    ``groups``: the rows of a :func:`spend` over the same selection that cover it exactly once
    (no ``tag`` fan-out, no ``top`` cut); their sums are added up rather than read again.
    :func:`spend_report` gets the rows and this total together, for less.
    """
    where, params = selection.where()
    if groups is None:
        measures = {**_GROUP_MEASURES, **(_DRIFT_MEASURES if drift else {}), **_TOTAL_MEASURES}
    else:
        measures = dict(_TOTAL_MEASURES)
    cursor = conn.execute(
        f"SELECT {', '.join(f'{sql} AS {n}' for n, sql in measures.items())} FROM requests{where}", params
    )
    names = [d[0] for d in cursor.description]
    row = cursor.fetchone()
    totals = dict(zip(names, row, strict=True)) if row else {}
    if groups is not None:
        for name in _ADDITIVE:
            values = [g[name] for g in groups if g.get(name) is not None]
            if name in _DRIFT_MEASURES and not drift:
                continue
            totals[name] = sum(values[1:], values[0]) if values else (None if name.endswith("_usd") else 0)
    return derive(totals)


def derive(row: dict[str, Any]) -> dict[str, Any]:
    """Add the ratios to a row of measures and return it.

    ``cache_hit_rate``: cached input tokens / input tokens; ``output_share``: output cost / cost;
    ``avg_cost_usd``: cost / priced requests (USD, 12 places). Ratios are ``Decimal`` fractions
    (4 places); each is ``None`` when its denominator is 0 or unknown.
    """
    row["cache_hit_rate"] = _hit_rate(row.get("cached_input_tokens"), row.get("input_tokens"))
    row["output_share"] = _share(row.get("output_cost_usd"), row.get("cost_usd"))
    row["avg_cost_usd"] = _average(row.get("cost_usd"), row.get("priced_requests"))
    return row


def _hit_rate(cached: int | None, inputs: int | None) -> Decimal | None:
    return (Decimal(cached or 0) / inputs).quantize(_RATIO) if inputs else None


def _share(part: Decimal | None, cost: Decimal | None) -> Decimal | None:
    return (part / cost).quantize(_RATIO) if cost and part is not None else None


def _average(cost: Decimal | None, priced: int | None) -> Decimal | None:
    return (cost / priced).quantize(_PICO) if cost is not None and priced else None


def export_rows(
    conn: duckdb.DuckDBPyConnection,
    *,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    batch: int = 10_000,
) -> Iterator[dict[str, Any]]:
    """Every ledger row in ``[since, until)`` in start order, as dicts of :data:`EXPORT_COLUMNS`.

    ``started_at``/``ended_at`` are UTC ``datetime`` values, costs ``Decimal``, JSON columns
    (``cost_lines``, ``raw_usage``) their JSON text. Rows are fetched ``batch`` at a time.
    """
    where, params = Selection(since, until).where()
    cursor = conn.execute(
        f"SELECT {', '.join(EXPORT_COLUMNS)} FROM requests{where} ORDER BY started_at, request_id", params
    )
    while True:
        chunk = cursor.fetchmany(batch)
        if not chunk:
            return
        for row in chunk:
            yield dict(zip(EXPORT_COLUMNS, row, strict=True))
