"""Shared test fixtures: recorded exchanges, a real simulator upstream, a real proxy, a real ledger."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tokenward.pricing.settings import GuardSettings, PricingSettings
from tokenward.proxy.app import create_app
from tokenward.proxy.config import AuthConfig, Config, LedgerConfig, ServerConfig, UpstreamConfig, VirtualKeyConfig
from tokenward.proxy.server import running_in_thread
from tokenward.proxy.simulator import Recording, SimulatorServer, load_recordings, sample_recordings_path
from tokenward.reports.alerts import AlertSettings

from .raw_upstream import RawUpstream

SHARED = Path(__file__).resolve().parents[2] / "shared"
CORPUS = SHARED / "fixtures" / "recorded" / "exchanges.jsonl"


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the developer's provider keys or proxy settings."""
    for name in list(os.environ):
        if name.startswith(("OPENAI_", "ANTHROPIC_")) or name.lower() in ("http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.delenv(name, raising=False)


def corpus_records() -> list[dict[str, Any]]:
    """Every record of the shared corpus, or skip when ``../shared`` is absent."""
    if not CORPUS.exists():
        pytest.skip(f"recorded corpus not present at {CORPUS}")
    with CORPUS.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture(scope="session")
def sample() -> dict[str, Recording]:
    """The small recorded sample that ships with the package, by id."""
    return {r.id: r for r in load_recordings(sample_recordings_path())}


@pytest.fixture(scope="session")
def all_recordings(sample: dict[str, Recording]) -> list[Recording]:
    recordings = list(sample.values())
    if CORPUS.exists():
        known = set(sample)
        recordings += [r for r in load_recordings(CORPUS) if r.id not in known]
    return recordings


@pytest.fixture(scope="session")
def simulator(all_recordings: list[Recording]) -> Iterator[SimulatorServer]:
    """A real HTTP upstream replaying the sample (and the corpus when present)."""
    with SimulatorServer(all_recordings).running() as server:
        yield server


PROVIDER_CATALOG = {
    "azure-openai": "openai",
    "google-openai-compat": "google",
    "pydantic-ai-gateway": "openai",
}


STREAM_USAGE_UNASKED = {"huggingface", "groq", "mistral"}
"""Recorded providers whose streams carry usage without ``include_usage`` (HF's novita router; Groq and
Mistral on the finishing chunk)."""


def upstreams_for(simulator_url: str, providers: list[str], **overrides: Any) -> list[UpstreamConfig]:
    """One upstream per recorded provider, each at ``<simulator>/<provider>/v1``."""
    return [
        UpstreamConfig(
            name=p,
            base_url=f"{simulator_url}/{p}/v1",
            provider=PROVIDER_CATALOG.get(p, p),
            default=(p == "openai"),
            stream_usage="always" if p in STREAM_USAGE_UNASKED else "ask",
            **overrides,
        )
        for p in providers
    ]


ALL_PROVIDERS = sorted(
    {
        "openai",
        "azure-openai",
        "deepseek",
        "mistral",
        "groq",
        "openrouter",
        "google-openai-compat",
        "huggingface",
        "cerebras",
        "crusoe",
        "bedrock-mantle",
        "heroku",
        "ollama-cloud",
        "ollama-local",
        "pydantic-ai-gateway",
        "pydantic-demo-echo",
        "snowflake-cortex",
        "voyage",
        "zai",
        "anthropic",
    }
)


class Proxy:
    """A running proxy: its base URL, its app, and its ledger file."""

    def __init__(self, url: str, app: Any, ledger: Path) -> None:
        self.url = url
        self.app = app
        self.ledger = ledger

    def flush(self) -> None:
        """Wait until every finished exchange is in the ledger file."""
        from tokenward.proxy import relay
        from tokenward.reports.ledger import LedgerBusy

        recorder = self.app.state.recorder
        deadline = time.monotonic() + 10
        time.sleep(0.05)  # a reply just received may still be finishing its relay
        while (recorder._tasks or relay._BACKGROUND) and time.monotonic() < deadline:
            time.sleep(0.01)  # estimates and rows of exchanges whose client is gone
        while True:
            try:
                recorder.ledger.flush(recorder.wal)  # every row committed so far goes into the file
                return
            except LedgerBusy:
                if time.monotonic() > deadline:
                    raise AssertionError("ledger rows were not written in time") from None
                time.sleep(0.02)

    def rows(self, expect: int | None = None, where: str = "", params: list[Any] | None = None) -> list[dict[str, Any]]:
        """Ledger rows as dicts (after :meth:`flush`); with ``expect``, wait until there are that many."""
        deadline = time.monotonic() + 10
        while True:
            self.flush()
            rows = read_rows(self.ledger, where, params) if self.ledger.exists() else []
            if expect is None or len(rows) >= expect or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)


def read_rows(ledger: Path, where: str = "", params: list[Any] | None = None) -> list[dict[str, Any]]:
    for _ in range(200):
        try:
            conn = duckdb.connect(str(ledger), read_only=True)
            break
        except (duckdb.IOException, duckdb.ConnectionException):  # the in-process writer holds it
            time.sleep(0.02)
    else:
        raise AssertionError("ledger stayed locked")
    try:
        cursor = conn.execute(f"SELECT * FROM requests {where} ORDER BY started_at", params or [])
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    finally:
        conn.close()


class ProxyFactory:
    """Starts proxies in front of the simulator, each with its own ledger in ``directory``."""

    def __init__(self, directory: Path, simulator: SimulatorServer) -> None:
        self.directory = directory
        self.simulator = simulator
        self.contexts: list[Any] = []

    def __call__(
        self,
        *,
        upstreams: list[UpstreamConfig] | None = None,
        auth: str = "passthrough",
        keys: list[VirtualKeyConfig] | None = None,
        transport: Any = None,
        catalog: Any = None,
        pricing: Any = None,
        budgets: Any = None,
        alerts: Any = None,
        notifier: Any = None,
        drain_s: float = 60.0,
        server: dict[str, Any] | None = None,
        guard: Any = None,
    ) -> Proxy:
        ledger = self.directory / f"ledger{len(self.contexts)}.duckdb"
        config = Config(
            upstreams=upstreams or upstreams_for(self.simulator.url, ALL_PROVIDERS),
            ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
            auth=AuthConfig(mode=auth),  # type: ignore[arg-type]
            virtual_keys=keys or [],
            pricing=pricing or PricingSettings(),
            budgets=budgets or [],
            alerts=alerts or AlertSettings(),
            server=ServerConfig(drain_after_disconnect_s=drain_s, **(server or {})),
            guard=guard or GuardSettings(),
        )
        app = create_app(config, upstream_transport=transport, catalog=catalog, notifier=notifier)
        context = running_in_thread(app)
        url = context.__enter__()
        self.contexts.append(context)
        return Proxy(url, app, ledger)

    def stop_all(self) -> None:
        for context in reversed(self.contexts):
            context.__exit__(None, None, None)
        self.contexts.clear()


@pytest.fixture
def start_proxy(tmp_path: Path, simulator: SimulatorServer) -> Iterator[ProxyFactory]:
    """Factory: ``start_proxy(**config)`` runs a proxy in front of the simulator; stopped at teardown."""
    factory = ProxyFactory(tmp_path, simulator)
    yield factory
    factory.stop_all()


@pytest.fixture
def raw_upstream() -> Iterator[RawUpstream]:
    """A raw-bytes upstream (:class:`~tests.raw_upstream.RawUpstream`) for one test; its ``script`` answers."""
    with RawUpstream().running() as server:
        yield server


@pytest.fixture
def raw_proxy(start_proxy: ProxyFactory, raw_upstream: RawUpstream) -> Any:
    """Factory: ``raw_proxy(provider="openai", anthropic_provider="anthropic", **config)`` runs a proxy in front of ``raw_upstream``.

    Two upstreams at the same server: ``provider`` (the default, OpenAI dialect, named as its
    provider) and one of the Anthropic dialect priced as ``anthropic_provider`` (named ``anthropic``,
    or ``anthropic-<provider>``); ``config`` goes to ``start_proxy``.
    """

    def start(provider: str = "openai", anthropic_provider: str = "anthropic", **config: Any) -> Any:
        upstreams = [
            UpstreamConfig(name=provider, base_url=f"{raw_upstream.url}/v1", provider=provider, default=True),
            UpstreamConfig(
                name="anthropic" if anthropic_provider == "anthropic" else f"anthropic-{anthropic_provider}",
                base_url=f"{raw_upstream.url}/v1",
                provider=anthropic_provider,
                dialect="anthropic",
            ),
        ]
        return start_proxy(upstreams=upstreams, **config)

    return start


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[Any]:
    """A throwaway Postgres cluster (tests/pgcluster.py) for the session; skips when Postgres is not installed."""
    from .pgcluster import start_cluster

    cluster = start_cluster()
    if cluster is None:
        pytest.skip("Postgres is not installed (apt-get install postgresql): Postgres tests skipped")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def pg_url(pg_cluster: Any) -> str:
    """A new, empty database on the session's cluster, as a ``postgresql://`` URL."""
    import uuid

    return str(pg_cluster.create_database(f"t_{uuid.uuid4().hex[:12]}"))
