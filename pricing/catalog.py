"""Price catalog: YAML price files loaded into validated, frozen, effective-dated entries.

File format (the built-in catalog is ``pricing/catalog/default.yaml``)::

    entries:
      - id: openai/gpt-5.4              # <provider>/<model>; versions of one price share the id
        provider: openai
        model: gpt-5.4
        aliases: [gpt-5.4-latest]       # other served names billed at these rates
        effective: 2026-03-05           # in force from (UTC midnight, or a datetime); optional
        input: 2.50                     # USD per 1M tokens; input and output are required
        cached_input: 0.25              # optional rates: cached_input, cache_write, cache_write_1h,
        output: 15.00                   #   reasoning, audio_input, audio_output, image_input
        web_search: 0.01                # USD per web search call
        web_fetch: 0                    # USD per web fetch call (Anthropic)
        file_search: 0.0025             # USD per file search call (OpenAI Responses)
        code_container: 0.03            # USD per code execution container a reply used
        image_generation: 0.04          # USD per image the Responses image tool made (image_generation_call)
        per_request: 0                  # USD per request
        image_tokens_max: 1445          # input tokens one image in a request can cost at most (bounds only)
        # media units (images, audio endpoints):
        image: {1024x1024/standard: 0.04, 1024x1792/hd: 0.12}   # USD per image by "<size>/<quality>"
                                        #   (a part may be *, or one number for every variant)
        image_output_tokens: {1024x1536/high: 6240}   # output tokens per image (bounds only)
        audio_minute: 0.006             # USD per minute of input audio, billed per second
        characters: 15.00               # USD per 1M input characters
        context_tiers:                  # cliffs: the whole request moves to the highest tier passed
          - {above: 272000, inclusive: false, counts: [input], multiplier: 2}
        service_tiers:                  # by the tier the response says was served
          priority: {input: 5.00, cached_input: 0.50, output: 30.00}
          flex: {multiplier: 0.5}
        inference_geos:                 # by where the response says it ran (Anthropic inference_geo),
          us: {multiplier: 1.1}         #   applied after the service tier
        windows:                        # time-of-day pricing at the request's start
          - {name: off_peak, start: "16:30", end: "00:30", weekdays: [mon, tue], timezone: UTC,
             multiplier: 0.5}
        source: https://...             # where the rates were read
        checked: 2026-08-21             # when they were last checked there
        note: free text

Rates are read as exact decimals (YAML's ``0.15`` becomes ``Decimal("0.15")``, never a binary
float): at most 6 decimal places for rates, 4 for multipliers. Omitted rates default as
:meth:`tokenward.pricing.rates.Rates.build` says. Later files override earlier ones version by
version (same ``id`` and ``effective``), field by field: an override gives only the fields it
changes (``{id: openai/gpt-4o, input: 2.00, output: 8.00}`` keeps the entry's cached-input rate,
service tiers and fees; see ``_override``), so a user's file can correct, add or date a price
without copying the built-in catalog, and history is never rewritten in place. A new ``id`` or
``effective`` date is a new version and must be complete.
"""

from __future__ import annotations

import datetime as dt
import difflib
import re
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from importlib import resources
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml

from tokenward.pricing.rates import RATE_NAMES, Adjustment, ContextTier, Rates, Window

__all__ = [
    "CLOUD_NAME_PATTERNS",
    "TOOL_FEES",
    "CatalogError",
    "PriceCatalog",
    "PriceEntry",
    "Resolution",
    "builtin_catalog_paths",
    "cloud_model",
    "default_catalog_path",
    "entry_to_dict",
    "load_catalog",
    "load_exact_yaml",
    "parse_entry",
    "read_document",
    "read_file",
]

_TOP_FIELDS = frozenset(
    {
        "id",
        "provider",
        "model",
        "aliases",
        "source",
        "checked",
        "note",
        "effective",
        "web_search",
        *("web_fetch", "file_search", "code_container", "image_generation"),
        "per_request",
        "context_tiers",
        "service_tiers",
        "inference_geos",
        "windows",
        "image_tokens_max",
        "image",
        "image_output_tokens",
        "audio_minute",
        "characters",
        *RATE_NAMES,
    }
)
TOOL_FEES: tuple[str, ...] = (
    "web_search",
    "per_request",
    "web_fetch",
    "file_search",
    "code_container",
    "image_generation",
)
"""The per-call (and per-request) fees an entry may give, USD each."""
_MAX_RATE_DECIMALS = 6
_MAX_MULTIPLIER_DECIMALS = 4
_SNAPSHOT_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8})$")
_VERTEX_VERSION = re.compile(r"@(?:\d{8}|latest|default)$")
_BEDROCK_VENDOR = re.compile(r"^(?:(?:us|us-gov|eu|apac|jp|au|ca|global)\.)?anthropic\.")
_CLOUD_REVISION = re.compile(r"-v\d+(?::\d+)?(?::\d+k)?$")
CLOUD_NAME_PATTERNS: tuple[str, str, str] = (_VERTEX_VERSION.pattern, _BEDROCK_VENDOR.pattern, _CLOUD_REVISION.pattern)
"""The regular expressions :func:`cloud_model` removes, in order (Vertex version, Bedrock vendor and
profile, Bedrock revision), for SQL that must read names as it does (``reports.queries.cloud_model_sql``)."""
_WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_DAWN = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class CatalogError(ValueError):
    """A price file is malformed; the message names the file, the entry and the field."""


@dataclass(frozen=True, slots=True)
class PriceEntry:
    """One version of the price of one model at one provider (rates in USD per 1M tokens).

    ``effective`` is when this version came into force (``None``: always); ``web_search`` and
    ``per_request`` are USD per call and per request (``None``: no such fee is known, so web
    searches are listed unpriced rather than as $0). ``web_fetch``, ``file_search`` (USD per call),
    ``code_container`` (USD per code execution container a reply used) and ``image_generation``
    (USD per image the Responses image generation tool made) are the other provider-run tools'
    fees; ``None``: not known, so a row with such calls is ``partially_priced`` with a note, never
    priced as if they were free.

    Media units: ``image`` is USD per generated image by variant (``"<size>/<quality>"``, either
    part ``*``; see :meth:`image_price`); ``audio_minute`` USD per minute of input audio (billed per
    second); ``characters`` USD per 1M input characters. Facts used only to bound a request before
    it is sent: ``image_tokens_max``, the most input tokens one image in a request can be billed
    (``None``: not known, ``guard.image_tokens`` is assumed), and ``image_output_tokens``, output
    tokens per generated image by variant.
    """

    id: str
    provider: str
    model: str
    rates: Rates
    source: str
    checked: dt.date
    effective: dt.datetime | None = None
    aliases: tuple[str, ...] = ()
    web_search: Decimal | None = None
    per_request: Decimal | None = None
    web_fetch: Decimal | None = None
    file_search: Decimal | None = None
    code_container: Decimal | None = None
    image_generation: Decimal | None = None
    context_tiers: tuple[ContextTier, ...] = ()
    service_tiers: tuple[tuple[str, Adjustment], ...] = ()
    inference_geos: tuple[tuple[str, Adjustment], ...] = ()
    windows: tuple[Window, ...] = ()
    note: str = ""
    image_tokens_max: int | None = None
    image: tuple[tuple[str, Decimal], ...] = ()
    image_output_tokens: tuple[tuple[str, int], ...] = ()
    audio_minute: Decimal | None = None
    characters: Decimal | None = None

    @property
    def version_id(self) -> str:
        """The id stored with each priced row: ``id``, or ``id@<effective>`` for a dated version."""
        if self.effective is None:
            return self.id
        when = self.effective
        stamp = when.date().isoformat() if when.time() == dt.time(0) else when.isoformat().replace("+00:00", "Z")
        return f"{self.id}@{stamp}"

    def service_tier(self, name: str) -> Adjustment | None:
        """The adjustment for served tier ``name``, if the entry prices it."""
        return dict(self.service_tiers).get(name)

    def inference_geo(self, name: str) -> Adjustment | None:
        """The adjustment for inference geography ``name`` (``us``), if the entry prices it."""
        return dict(self.inference_geos).get(name)

    def image_price(self, variant: str) -> Decimal | None:
        """USD per image made at ``variant`` (``"1024x1792/hd"``; ``""``: unknown), if the entry prices images.

        The most specific key wins: ``size/quality``, then ``size/*``, ``*/quality``, ``*``. An
        unknown variant, or one no key covers, is priced at the dearest variant listed.
        """
        if not self.image:
            return None
        prices = dict(self.image)
        size, _, quality = variant.lower().partition("/")
        for key in (f"{size}/{quality}", f"{size}/*", f"*/{quality}", "*"):
            if key in prices:
                return prices[key]
        return max(prices.values())

    def dearest_image(self, size: str | None, quality: str | None) -> Decimal | None:
        """The most one image can cost at ``size`` and ``quality`` (``None``: any), if the entry prices images."""
        found = [price for key, price in self.image if _variant_matches(key, size, quality)]
        return max(found) if found else (max(p for _, p in self.image) if self.image else None)

    def image_tokens_out(self, size: str | None, quality: str | None) -> int | None:
        """The most output tokens one image can be billed at ``size`` and ``quality`` (``None``: any).

        ``None`` when the entry lists no ``image_output_tokens``; a size or quality it does not list
        gets the most it lists for any variant.
        """
        found = [tokens for key, tokens in self.image_output_tokens if _variant_matches(key, size, quality)]
        if found:
            return max(found)
        return max((t for _, t in self.image_output_tokens), default=None)


def _variant_matches(key: str, size: str | None, quality: str | None) -> bool:
    """Whether variant ``key`` (``size/quality``, parts may be ``*``) can be the one made for a request."""
    key_size, _, key_quality = key.partition("/")
    return (size is None or key_size in ("*", size.lower())) and (
        quality is None or key_quality in ("*", "", quality.lower())
    )


@dataclass(frozen=True, slots=True)
class Resolution:
    """Which entry prices a served model, and by which rule it was found.

    ``how``: ``exact`` (provider and model), ``alias`` (a listed alias), ``configured_alias`` (a
    name mapped in the config), ``vendor_prefix`` (``openai/gpt-4o`` at a reseller, priced as the
    vendor's model), ``other_provider`` (the model name listed under another provider),
    ``snapshot`` (a dated snapshot such as ``o1-2024-12-17`` priced as its base model ``o1``;
    field case B22's ``inferred_base_model``, also behind a routing prefix: ``azure/o1-2024-12-17``),
    ``routing_prefix`` (a name behind a prefix that is no catalog provider: ``azure/gpt-4o``,
    ``openrouter/openai/gpt-4o``), ``cloud_name`` (a cloud's name for the model: Vertex AI's
    ``claude-sonnet-4-5@20250929``, Bedrock's ``anthropic.claude-sonnet-4-5-20250929-v1:0`` and its
    cross-region profiles ``us.``/``eu.``/``apac.``/``global.anthropic...``), ``price_as_upstream``
    (the upstream's ``price_as`` pin), ``price_as_model`` (a ``pricing.price_as`` pin on the
    requested model) or ``fallback`` (the configured fallback price).
    """

    entry: PriceEntry
    how: str


@dataclass(slots=True)
class PriceCatalog:
    """Effective-dated price entries, indexed for :meth:`resolve`; build it with :func:`load_catalog`.

    ``aliases`` maps served names seen in traffic (house aliases) to catalog model names;
    ``price_as`` pins requested model names (Azure deployment names) to the catalog model they
    are priced as, whatever model the reply names; ``fallback``, when set, prices models nothing
    else resolves (rows say so). Keys of both maps are lower-case.
    """

    versions: dict[str, list[PriceEntry]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    price_as: dict[str, str] = field(default_factory=dict)
    fallback: PriceEntry | None = None
    _by_name: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict, repr=False)
    _by_model: dict[str, str] = field(default_factory=dict, repr=False)
    _cache: dict[tuple[str, str | None], tuple[str, str] | None] = field(default_factory=dict, repr=False)
    _own: set[str] = field(default_factory=set, repr=False)
    """Ids of entries from the user's price files (or :meth:`add`): their names win over the built-in ones."""

    @property
    def entries(self) -> dict[str, PriceEntry]:
        """The latest version of every entry, by id."""
        return {key: versions[-1] for key, versions in self.versions.items()}

    def add(self, entry: PriceEntry) -> None:
        """Insert a version (replacing one with the same id and effective date) and re-index.

        An added entry is the user's own: its names win over the built-in entries' (see :meth:`_reindex`).
        """
        self._put(entry)
        self._own.add(entry.id)
        self._reindex()

    def _put(self, entry: PriceEntry) -> None:
        versions = [v for v in self.versions.get(entry.id, []) if v.effective != entry.effective]
        versions.append(entry)
        versions.sort(key=lambda v: v.effective or _DAWN)
        self.versions[entry.id] = versions

    def _reindex(self) -> None:
        """Index every entry's names, and say which entry a name shared by several resolves to.

        The first of these wins: the user's own entry (a price file's, the later file first) over
        a built-in one, then the entry naming it as its ``model`` over one giving it as an alias,
        then the built-in entry loaded first. Before, the first entry loaded always won, so a price
        file's ``mine/gpt-4o`` was silently ignored for ``openai/gpt-4o``.
        """
        self._by_name.clear()
        self._by_model.clear()
        self._cache.clear()
        by_name: dict[tuple[str, str], tuple[Any, ...]] = {}
        by_model: dict[str, tuple[Any, ...]] = {}
        for order, (key, versions) in enumerate(self.versions.items()):
            latest = versions[-1]
            own = key in self._own
            names = [(latest.model, "exact")] + [(alias, "alias") for alias in latest.aliases]
            for name, how in names:
                rank = (own, how == "exact", order if own else -order)
                slot = (latest.provider, name.lower())
                if slot not in by_name or rank > by_name[slot]:
                    by_name[slot] = rank
                    self._by_name[slot] = (key, how)
                if name.lower() not in by_model or rank > by_model[name.lower()]:
                    by_model[name.lower()] = rank
                    self._by_model[name.lower()] = key

    def version_at(self, entry_id: str, at: dt.datetime | None) -> PriceEntry | None:
        """The version of ``entry_id`` in force at ``at`` (the latest when ``at`` is ``None``)."""
        versions = self.versions.get(entry_id)
        if not versions:
            return None
        if at is None:
            return versions[-1]
        index = bisect_right([v.effective or _DAWN for v in versions], at)
        return versions[index - 1] if index else None

    def resolve(
        self,
        model: str | None,
        provider: str | None = None,
        at: dt.datetime | None = None,
        *,
        fallback: bool = True,
        requested: str | None = None,
        price_as: str | None = None,
    ) -> Resolution | None:
        """Find the entry version that prices ``model`` served by ``provider`` at instant ``at``.

        Args:
            model: the served model name (the response's ``model``), matched case-insensitively.
            provider: the catalog provider of the upstream that served it, if known.
            at: the request's start (aware); ``None`` means now (the latest versions).
            fallback: whether the configured fallback rates may price an unresolved model.
            requested: the model name the request asked for (checked against :attr:`price_as`).
            price_as: a pin that wins over everything: the upstream's ``price_as``.

        Returns:
            The entry and the rule that found it, or ``None`` when the model is unpriced (no
            entry, or none in force at ``at``, and no fallback). A pin (``price_as``, else
            ``self.price_as[requested]``) decides alone: its model is resolved by the rules below
            and the resolution is named ``price_as_upstream`` / ``price_as_model``; a pin naming
            an unknown model leaves the row unpriced rather than pricing what the reply named.
            Without a pin, rules are tried in order: a configured alias, provider + name, vendor
            prefix, any provider, and then the same for the name without a
            ``-YYYY-MM-DD``/``-YYYYMMDD`` snapshot suffix; then all of these for the name without
            its first ``prefix/`` (a routing prefix such as ``azure/``, named ``routing_prefix``, or
            ``snapshot`` when a suffix was stripped too), one prefix at a time; then the fallback.
        """
        pin, how = price_as, "price_as_upstream"
        if not pin and requested:
            pin, how = self.price_as.get(requested.lower()), "price_as_model"
        if pin:
            found = self.resolve(pin, provider, at, fallback=fallback)
            if found is None or found.how == "fallback":
                return found
            return Resolution(found.entry, how)
        if model:
            key = (model, provider)
            if key not in self._cache:
                self._cache[key] = self._find(model.lower(), provider)
            found = self._cache[key]
            if found is not None:
                entry = self.version_at(found[0], at)
                if entry is not None:
                    return Resolution(entry, found[1])
        if fallback and self.fallback is not None:
            return Resolution(self.fallback, "fallback")
        return None

    def _find(self, name: str, provider: str | None) -> tuple[str, str] | None:
        configured = self.aliases.get(name)
        if configured is not None:
            found = self._lookup(configured.lower(), provider)
            return (found[0], "configured_alias") if found else None
        found = self._named(name, provider)
        rest = name
        while found is None and "/" in rest:
            # a routing prefix that names no catalog provider (LiteLLM's azure/o1, openrouter/openai/gpt-4o)
            rest = rest.partition("/")[2]
            found = self._named(rest, provider)
            if found is not None and found[1] != "snapshot":
                found = found[0], "routing_prefix"
        return found

    def _named(self, name: str, provider: str | None) -> tuple[str, str] | None:
        """:meth:`_dated`, then the same for the model a cloud's name for it names (:func:`cloud_model`)."""
        found = self._dated(name, provider)
        if found is None:
            plain = cloud_model(name)
            if plain != name:
                found = self._dated(plain, provider)
                if found is not None:
                    found = found[0], "cloud_name"
        return found

    def _dated(self, name: str, provider: str | None) -> tuple[str, str] | None:
        """``name`` by provider + name, vendor prefix or any provider; then without its snapshot suffix."""
        found = self._lookup(name, provider)
        if found is not None:
            return found
        base = _SNAPSHOT_SUFFIX.sub("", name)
        if base != name:
            found = self._lookup(base, provider)
            if found is not None:
                return found[0], "snapshot"
        return None

    def _lookup(self, name: str, provider: str | None) -> tuple[str, str] | None:
        if provider is not None and (provider, name) in self._by_name:
            return self._by_name[(provider, name)]
        vendor, sep, rest = name.partition("/")
        if sep and (vendor, rest) in self._by_name:
            return self._by_name[(vendor, rest)][0], "vendor_prefix"
        if name in self._by_model:
            return self._by_model[name], "other_provider"
        return None


def entry_to_dict(entry: PriceEntry) -> dict[str, Any]:
    """A price-file mapping for ``entry`` (every rate written out), which :func:`parse_entry` reads back."""

    def adjustment(value: Adjustment) -> dict[str, Any]:
        return dict(value.rates) if value.rates else {"multiplier": value.multiplier}

    raw: dict[str, Any] = {"id": entry.id, "provider": entry.provider, "model": entry.model}
    if entry.aliases:
        raw["aliases"] = list(entry.aliases)
    if entry.effective is not None:
        raw["effective"] = entry.effective
    raw.update({name: getattr(entry.rates, name) for name in RATE_NAMES})
    for fee in TOOL_FEES:
        if getattr(entry, fee) is not None:
            raw[fee] = getattr(entry, fee)
    if entry.context_tiers:
        raw["context_tiers"] = [
            {"above": t.threshold, "inclusive": t.inclusive, "counts": list(t.counts), **adjustment(t.adjustment)}
            for t in sorted(entry.context_tiers, key=lambda t: t.threshold)
        ]
    if entry.service_tiers:
        raw["service_tiers"] = {name: adjustment(value) for name, value in entry.service_tiers}
    if entry.inference_geos:
        raw["inference_geos"] = {name: adjustment(value) for name, value in entry.inference_geos}
    if entry.windows:
        raw["windows"] = [
            {
                "name": w.name,
                "start": w.start.strftime("%H:%M"),
                "end": w.end.strftime("%H:%M"),
                "weekdays": [d for d in _WEEKDAYS if d in w.weekdays],
                "timezone": w.timezone,
                **adjustment(w.adjustment),
            }
            for w in entry.windows
        ]
    if entry.image_tokens_max is not None:
        raw["image_tokens_max"] = entry.image_tokens_max
    if entry.image:
        raw["image"] = dict(entry.image)
    if entry.image_output_tokens:
        raw["image_output_tokens"] = dict(entry.image_output_tokens)
    for unit in ("audio_minute", "characters"):
        if getattr(entry, unit) is not None:
            raw[unit] = getattr(entry, unit)
    raw.update(source=entry.source, checked=entry.checked)
    if entry.note:
        raw["note"] = entry.note
    return raw


def default_catalog_path() -> Path:
    """Path of the curated built-in catalog shipped inside the package."""
    return Path(str(resources.files("tokenward.pricing") / "catalog" / "default.yaml"))


def builtin_catalog_paths() -> list[Path]:
    """The built-in price files, in load order.

    First the prices imported from LiteLLM for providers the curated catalog does not cover,
    then the curated catalog (which wins where both price a model).
    """
    folder = resources.files("tokenward.pricing") / "catalog"
    return [Path(str(folder / "imported.yaml")), default_catalog_path()]


def load_catalog(
    paths: Iterable[str | Path] = (),
    *,
    builtin: bool = True,
    aliases: Mapping[str, str] | None = None,
    fallback: Mapping[str, Any] | None = None,
    price_as: Mapping[str, str] | None = None,
) -> PriceCatalog:
    """Load the built-in catalog, then each file in ``paths`` in order; later versions win.

    Args:
        paths: extra price files.
        builtin: start from the built-in catalog (false: only ``paths``).
        aliases: served name -> catalog model name (house aliases).
        price_as: requested name -> catalog model it is priced as whatever the reply names
            (Azure deployment names).
        fallback: rates (USD per 1M tokens) for models nothing else prices; such rows are
            marked as priced by the fallback.

    Raises:
        CatalogError: a file is unreadable, not YAML, or an entry is invalid; the message
            names the file, the entry id and the field.
    """
    catalog = PriceCatalog(
        aliases={k.lower(): v for k, v in (aliases or {}).items()},
        price_as={k.lower(): v for k, v in (price_as or {}).items()},
    )
    files = builtin_catalog_paths() if builtin else []
    loaded: dict[tuple[str, dt.datetime | None], Mapping[str, Any]] = {}
    for number, path in enumerate((*files, *map(Path, paths))):
        for index, raw in enumerate(_raw_entries(path)):
            key = (str(raw.get("id", f"#{index}")), _effective(_Fail(path, str(raw.get("id"))), raw.get("effective")))
            merged = _override(loaded[key], raw, path) if key in loaded else raw
            entry = parse_entry(path, index, merged)
            catalog._put(entry)
            if number >= len(files) and key not in loaded:  # a new entry of the user's: its names win
                catalog._own.add(entry.id)
                catalog.versions[entry.id] = catalog.versions.pop(entry.id)  # later files after earlier ones
            loaded[key] = merged
    if fallback is not None:
        raw = {
            "id": "fallback",
            "provider": "*",
            "model": "*",
            "source": "configuration",
            "checked": dt.date(1970, 1, 1),
            **fallback,
        }
        catalog.fallback = parse_entry(Path("config: pricing.fallback"), 0, raw)
    catalog._reindex()
    return catalog


class _DecimalLoader(yaml.SafeLoader):
    """SafeLoader that reads YAML floats as exact ``Decimal`` values and refuses a key given twice in one mapping.

    PyYAML keeps the last of two equal keys: a second ``budgets:`` section appended to a config
    silently replaced the first one's budgets (a hard limit gone without a word). Keys brought in
    by a merge (``<<: *defaults``) may still be overridden, as YAML says.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], yaml.Node] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                earlier = first.setdefault((key_node.tag, key_node.value), key_node)
                if earlier is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key_node.value!r} appears twice in one mapping (first at line "
                        f"{earlier.start_mark.line + 1}); only the last would count: merge the two",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


_SPECIAL = {".inf": "Infinity", "+.inf": "Infinity", "-.inf": "-Infinity", ".nan": "NaN"}


def _construct_decimal(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Decimal:
    text = str(loader.construct_scalar(node)).replace("_", "")
    try:
        return Decimal(_SPECIAL.get(text.lower(), text))  # non-finite values are refused where they matter
    except ArithmeticError as exc:
        raise yaml.constructor.ConstructorError(None, None, f"not a decimal number: {text!r}", node.start_mark) from exc


_DecimalLoader.add_constructor("tag:yaml.org,2002:float", _construct_decimal)


class _TextTimesLoader(_DecimalLoader):
    """:class:`_DecimalLoader` that keeps YAML timestamps (``2027-01-01``, ``2027-01-01T09:00:00Z``) as their text."""


_TextTimesLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str)


def load_exact_yaml(text: str, *, timestamps: bool = True) -> Any:
    """Parse YAML with every number an exact ``Decimal`` or ``int`` (never a binary float).

    ``timestamps=False`` keeps unquoted dates and datetimes as the strings written (a config's
    ``expires: 2027-01-01`` is then validated as text by its schema, whether quoted or not);
    otherwise YAML makes them ``date``/``datetime`` objects (a price file's ``effective``).

    Raises:
        yaml.YAMLError: not YAML.
    """
    loader = _DecimalLoader if timestamps else _TextTimesLoader
    return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass


def yaml_problem(exc: Exception) -> str:
    """``exc`` (a YAML or OS error) in one line: where in the file and what, for a message naming the file.

    PyYAML's own text names ``"<unicode string>"`` (it parsed a string, not the file) over four
    lines with a caret; this gives ``line 2, column 1: expected the node content, but found
    '<stream end>' (while parsing a flow node)``.
    """
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        context = f" ({exc.context})" if exc.context else ""
        return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {exc.problem}{context}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def read_document(path: Path) -> Any:
    """The YAML document in a price file, with every number an exact ``Decimal`` or ``int``.

    Raises:
        CatalogError: the file is unreadable or not YAML.
    """
    try:
        return load_exact_yaml(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise CatalogError(f"{path}: cannot read price file: {yaml_problem(exc)}") from exc


def read_file(path: Path) -> list[PriceEntry]:
    """Parse and validate one price file.

    Raises:
        CatalogError: unreadable, not YAML, or an invalid entry (message names file, entry, field).
    """
    return [parse_entry(path, index, raw) for index, raw in enumerate(_raw_entries(path))]


def _raw_entries(path: Path) -> list[Any]:
    """The raw entry mappings of one price file, each (id, effective date) once.

    Raises:
        CatalogError: unreadable, not YAML, not an ``entries`` list, or an id and date given twice.
    """
    document = read_document(path)
    if not isinstance(document, Mapping) or not isinstance(document.get("entries"), list):
        raise CatalogError(f"{path}: expected a mapping with an 'entries' list")
    seen: set[tuple[str, dt.datetime | None]] = set()
    for index, raw in enumerate(document["entries"]):
        if not isinstance(raw, Mapping):
            raise CatalogError(f"{path}: entry #{index}: expected a mapping")
        label = str(raw.get("id", f"#{index}"))
        key = (label, _effective(_Fail(path, label), raw.get("effective")))
        if key in seen:
            raise CatalogError(f"{path}: entry {label!r}: duplicate id and effective date")
        seen.add(key)
    return list(document["entries"])


_MERGED_MAPPINGS = ("service_tiers", "inference_geos", "image", "image_output_tokens")


def _override(old: Mapping[str, Any], new: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The entry ``new`` (from ``path``) makes of an earlier file's entry ``old`` with the same id and date.

    The fields ``new`` gives replace those of ``old``; the rest are kept, so a price file that
    restates only ``input`` and ``output`` keeps the cache, audio and tool rates, the context
    tiers and the service tiers it does not name. The mappings (``service_tiers``,
    ``inference_geos``, ``image``, ``image_output_tokens``) are merged key by key; lists
    (``context_tiers``, ``windows``, ``aliases``) are replaced whole. A rate ``old`` left to its
    default (``cached_input`` to ``input``, say) follows ``new``'s rates. ``source`` becomes the
    file, naming what it overrides, unless ``new`` gives one; ``note`` is ``new``'s (``old``'s
    described other rates).
    """
    merged = {key: value for key, value in old.items() if key != "note"}
    for key, value in new.items():
        if key in _MERGED_MAPPINGS and isinstance(value, Mapping) and isinstance(old.get(key), Mapping):
            merged[key] = {**old[key], **value}
        else:
            merged[key] = value
    if "source" not in new:
        merged["source"] = f"{path} (over {old.get('source')})"
    return merged


class _Fail:
    def __init__(self, path: Path, label: str) -> None:
        self.path, self.label = path, label

    def __call__(self, field_name: str, problem: str) -> CatalogError:
        return CatalogError(f"{self.path}: entry {self.label!r}: field {field_name!r}: {problem}")

    def unknown(self, field_name: str, allowed: Iterable[str]) -> CatalogError:
        """``unknown field``, with the closest allowed name when one is close (a typo)."""
        close = difflib.get_close_matches(field_name.rpartition(".")[2], sorted(allowed), n=1, cutoff=0.6)
        return self(field_name, f"unknown field; did you mean {close[0]!r}?" if close else "unknown field")


def _decimal(fail: _Fail, name: str, value: Any, places: int, *, positive: bool = False) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, int | Decimal):
        raise fail(name, f"must be a number, got {value!r}")
    number = Decimal(value)
    if not number.is_finite() or number < 0 or (positive and number == 0):
        raise fail(name, f"must be a finite number {'> 0' if positive else '>= 0'}, got {value}")
    exponent = number.normalize().as_tuple().exponent
    if isinstance(exponent, int) and -exponent > places:
        raise fail(name, f"at most {places} decimal places, got {value}")
    return number


def _rates(fail: _Fail, prefix: str, raw: Mapping[str, Any]) -> dict[str, Decimal]:
    return {
        name: _decimal(fail, f"{prefix}{name}", raw[name], _MAX_RATE_DECIMALS)
        for name in RATE_NAMES
        if raw.get(name) is not None
    }


def _adjustment(fail: _Fail, prefix: str, raw: Any, allowed: frozenset[str]) -> Adjustment:
    if not isinstance(raw, Mapping):
        raise fail(prefix.rstrip("."), "must be a mapping of rates or a multiplier")
    unknown = sorted(set(raw) - allowed - set(RATE_NAMES) - {"multiplier"})
    if unknown:
        raise fail.unknown(prefix + unknown[0], {*allowed, *RATE_NAMES, "multiplier"})
    rates = _rates(fail, prefix, raw)
    multiplier = raw.get("multiplier")
    if rates and multiplier is not None:
        raise fail(prefix + "multiplier", "give either rates or a multiplier, not both")
    if not rates and multiplier is None:
        raise fail(prefix.rstrip("."), "needs rates or a multiplier")
    if multiplier is not None:
        return Adjustment(
            multiplier=_decimal(fail, prefix + "multiplier", multiplier, _MAX_MULTIPLIER_DECIMALS, positive=True)
        )
    return Adjustment(rates=tuple(sorted(rates.items())))


def _time(fail: _Fail, name: str, value: Any) -> dt.time:
    if isinstance(value, int) and not isinstance(value, bool):  # YAML 1.1 reads 16:30 as 990 (base 60)
        value = f"{value // 60:02d}:{value % 60:02d}"
    try:
        return dt.time.fromisoformat(str(value))
    except ValueError as exc:
        raise fail(name, f"must be a time like '16:30', got {value!r}") from exc


def _effective(fail: _Fail, value: Any) -> dt.datetime | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
    if isinstance(value, dt.date):
        return dt.datetime(value.year, value.month, value.day, tzinfo=dt.UTC)
    raise fail("effective", f"must be a date or datetime, got {value!r}")


def parse_entry(path: Path, index: int, raw: Any) -> PriceEntry:
    """Validate one raw entry mapping from ``path`` into a :class:`PriceEntry`.

    Raises:
        CatalogError: naming the file, the entry and the field at fault.
    """
    if not isinstance(raw, Mapping):
        raise CatalogError(f"{path}: entry #{index}: expected a mapping")
    fail = _Fail(path, str(raw.get("id", f"#{index}")))
    unknown = sorted(set(raw) - _TOP_FIELDS)
    if unknown:
        raise fail.unknown(unknown[0], _TOP_FIELDS)
    for name in ("id", "provider", "model", "source"):
        if not isinstance(raw.get(name), str) or not raw[name].strip():
            raise fail(name, "required, a non-empty string")
    checked = raw.get("checked")
    if not isinstance(checked, dt.date):
        raise fail("checked", "required, a date (YYYY-MM-DD)")
    aliases = raw.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise fail("aliases", "must be a list of strings")
    given = _rates(fail, "", raw)
    for required in ("input", "output"):
        if required not in given:
            raise fail(required, "required")
    fees = {
        name: _decimal(fail, name, raw[name], _MAX_RATE_DECIMALS) if raw.get(name) is not None else None
        for name in TOOL_FEES
    }
    return PriceEntry(
        id=raw["id"],
        provider=raw["provider"].lower(),
        model=raw["model"],
        rates=Rates.build(given),
        source=raw["source"],
        checked=checked,
        effective=_effective(fail, raw.get("effective")),
        aliases=tuple(aliases),
        **fees,
        context_tiers=_context_tiers(fail, raw.get("context_tiers") or []),
        service_tiers=_service_tiers(fail, raw.get("service_tiers") or {}),
        inference_geos=_service_tiers(fail, raw.get("inference_geos") or {}, "inference_geos"),
        windows=_windows(fail, raw.get("windows") or []),
        note=str(raw.get("note", "")),
        image_tokens_max=_count(fail, "image_tokens_max", raw.get("image_tokens_max")),
        image=_variants(fail, "image", raw.get("image"), lambda name, v: _decimal(fail, name, v, _MAX_RATE_DECIMALS)),
        image_output_tokens=_variants(
            fail, "image_output_tokens", raw.get("image_output_tokens"), lambda name, v: _count(fail, name, v) or 0
        ),
        audio_minute=_decimal(fail, "audio_minute", raw["audio_minute"], _MAX_RATE_DECIMALS)
        if raw.get("audio_minute") is not None
        else None,
        characters=_decimal(fail, "characters", raw["characters"], _MAX_RATE_DECIMALS)
        if raw.get("characters") is not None
        else None,
    )


def cloud_model(name: str) -> str:
    """The model a cloud's name for an Anthropic model names (lower-case), or ``name`` when it is no such name.

    Vertex AI names a version after ``@`` (``claude-sonnet-4-5@20250929``,
    ``claude-3-5-sonnet-v2@20241022``); Bedrock puts the vendor in front, a cross-region
    inference profile its geography before that, and a revision after
    (``us.anthropic.claude-sonnet-4-5-20250929-v1:0``, ``anthropic.claude-opus-4-6-v1``). The
    result may still carry a ``-YYYYMMDD`` snapshot date, which the lookup strips as for any name.
    """
    vertex = _VERTEX_VERSION.sub("", name)
    bedrock = _BEDROCK_VENDOR.sub("", vertex)
    if vertex == name and bedrock == vertex:
        return name
    return _CLOUD_REVISION.sub("", bedrock)


def _count(fail: _Fail, name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise fail(name, f"must be a whole number of tokens >= 0, got {value!r}")
    return value


_VARIANT = re.compile(r"(?:\*|\d+x\d+|auto)(?:/(?:\*|[a-z]+))?")


def _variants(fail: _Fail, name: str, raw: Any, read: Any) -> tuple[tuple[str, Any], ...]:
    """A ``"<size>/<quality>" -> value`` mapping (a plain value stands for every variant, ``*``)."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        return (("*", read(name, raw)),)
    found = []
    for key, value in raw.items():
        text = str(key).lower()
        if _VARIANT.fullmatch(text) is None:
            raise fail(f"{name}.{key}", "a variant is '<width>x<height>/<quality>' (either part may be *)")
        found.append((text if "/" in text else f"{text}/*", read(f"{name}.{key}", value)))
    return tuple(found)


def _context_tiers(fail: _Fail, raw: Any) -> tuple[ContextTier, ...]:
    if not isinstance(raw, list):
        raise fail("context_tiers", "must be a list")
    tiers = []
    for i, item in enumerate(raw):
        prefix = f"context_tiers[{i}]."
        if not isinstance(item, Mapping) or not isinstance(item.get("above"), int) or item["above"] <= 0:
            raise fail(prefix + "above", "required, a positive token count")
        counts = item.get("counts", ["input"])
        if not isinstance(counts, list) or not counts or any(c not in ("input", "output", "total") for c in counts):
            raise fail(prefix + "counts", "a list of input, output, total")
        inclusive = item.get("inclusive", False)
        if not isinstance(inclusive, bool):
            raise fail(prefix + "inclusive", "must be true (>=) or false (>)")
        adjustment = _adjustment(fail, prefix, item, frozenset({"above", "counts", "inclusive"}))
        tiers.append(ContextTier(item["above"], adjustment, tuple(counts), inclusive))
    return tuple(sorted(tiers, key=lambda t: t.threshold, reverse=True))


def _service_tiers(fail: _Fail, raw: Any, member: str = "service_tiers") -> tuple[tuple[str, Adjustment], ...]:
    if not isinstance(raw, Mapping):
        raise fail(member, "must be a mapping of tier name to rates or a multiplier")
    return tuple(
        (str(name).lower(), _adjustment(fail, f"{member}.{name}.", value, frozenset())) for name, value in raw.items()
    )


def _windows(fail: _Fail, raw: Any) -> tuple[Window, ...]:
    if not isinstance(raw, list):
        raise fail("windows", "must be a list")
    windows = []
    for i, item in enumerate(raw):
        prefix = f"windows[{i}]."
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise fail(prefix + "name", "required, a string")
        weekdays = item.get("weekdays", list(_WEEKDAYS))
        if not isinstance(weekdays, list) or any(str(d).lower() not in _WEEKDAYS for d in weekdays):
            raise fail(prefix + "weekdays", f"a list of {', '.join(_WEEKDAYS)}")
        zone = str(item.get("timezone", "UTC"))
        try:
            ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise fail(prefix + "timezone", f"unknown time zone {zone!r}") from exc
        adjustment = _adjustment(fail, prefix, item, frozenset({"name", "start", "end", "weekdays", "timezone"}))
        windows.append(
            Window(
                name=item["name"],
                start=_time(fail, prefix + "start", item.get("start")),
                end=_time(fail, prefix + "end", item.get("end")),
                adjustment=adjustment,
                weekdays=frozenset(str(d).lower() for d in weekdays),
                timezone=zone,
            )
        )
    return tuple(windows)
