"""``tokenward demo``: the whole loop on one machine, with no API key and no network.

Starts the upstream simulator (replaying the recorded exchanges shipped with the package),
starts the proxy in front of it with one upstream per recorded provider, sends streamed and
non-streamed requests through it with the real ``openai`` SDK (the recorded ones, then one the
simulator makes up), then prints the report. Without ``--db`` the ledger lives in a temporary
directory that is removed when the demo ends, however it ends.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import openai

from tokenward.proxy.app import create_app
from tokenward.proxy.config import Config, LedgerConfig, UpstreamConfig
from tokenward.proxy.server import running_in_thread
from tokenward.proxy.simulator import RECORD_HEADER, Recording, SimulatorServer, load_recordings, sample_recordings_path
from tokenward.reports.report_cli import report

__all__ = ["run_demo", "send_recorded"]

_PROVIDERS = {
    "openai": "openai",
    "azure-openai": "openai",
    "deepseek": "deepseek",
    "mistral": "mistral",
    "groq": "groq",
    "openrouter": "openrouter",
    "google-openai-compat": "google",
    "huggingface": "huggingface",
}


def send_recorded(client: openai.OpenAI, recording: Recording, *, strip_stream_usage: bool = False) -> Any:
    """Send a recorded OpenAI-format request through ``client`` (the real SDK) and consume the reply.

    Args:
        client: an SDK client whose base URL is the proxy.
        recording: the exchange to replay; its provider's upstream is chosen by header.
        strip_stream_usage: send a streamed chat request without ``stream_options`` (the proxy
            then asks for usage itself and hides it again).

    Returns:
        The SDK's reply object, or the list of stream events for a streamed request.

    Raises:
        openai.APIStatusError: the recorded reply is an HTTP error.
    """
    body = dict(recording.request["body"])
    if strip_stream_usage:
        body.pop("stream_options", None)
    headers = {RECORD_HEADER: recording.id, "x-tokenward-upstream": recording.provider}
    model, stream = body.pop("model"), body.pop("stream", False)
    if recording.endpoint == "responses":
        reply: Any = client.responses.create(
            model=model, input=body.pop("input"), stream=stream, extra_body=body, extra_headers=headers
        )
    elif recording.endpoint == "embeddings":
        reply = client.embeddings.create(model=model, input=body.pop("input"), extra_body=body, extra_headers=headers)
    else:
        reply = client.chat.completions.create(
            model=model, messages=body.pop("messages"), stream=stream, extra_body=body, extra_headers=headers
        )
    return list(reply) if stream else reply


def demo_config(simulator_url: str, ledger: str, recordings: list[Recording]) -> Config:
    """One upstream per provider in ``recordings``, all served by the simulator at ``simulator_url``."""
    providers = sorted({r.provider for r in recordings if r.dialect == "openai"})
    upstreams = [
        UpstreamConfig(name=p, base_url=f"{simulator_url}/{p}/v1", provider=_PROVIDERS.get(p, p), default=p == "openai")
        for p in providers
    ]
    return Config(upstreams=upstreams, ledger=LedgerConfig(path=ledger, flush_interval_s=0.2))


def run_demo(db: str | None = None) -> None:
    """Run the demo and print the report; the ledger goes to ``db`` (default: a temporary file, removed after)."""
    with _ledger(db) as ledger:
        recordings = [r for r in load_recordings(sample_recordings_path()) if r.dialect == "openai"]
        with SimulatorServer(recordings).running() as simulator:
            app = create_app(demo_config(simulator.url, ledger, recordings))
            with running_in_thread(app) as proxy_url:
                client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="sk-demo-no-real-key", max_retries=0)
                click.echo(f"simulator at {simulator.url}, tokenward at {proxy_url}/v1\n")
                for recording in recordings:
                    _show(client, recording)
                    if recording.stream and recording.endpoint == "chat_completions" and recording.provider == "openai":
                        _show(client, recording, strip=True)
                _show_synthesised(client)
        kept = f"ledger: {ledger}" if db else "ledger: a temporary file, removed after this report (--db PATH keeps it)"
        click.echo(f"\n{kept}\n")
        report.main(["--db", ledger, "--by", "upstream,model"], standalone_mode=False)


@contextlib.contextmanager
def _ledger(db: str | None) -> Iterator[str]:
    """``db``, or a ledger path in a temporary directory that is removed on exit."""
    if db:
        yield db
        return
    with tempfile.TemporaryDirectory(prefix="tokenward-demo-") as directory:
        yield str(Path(directory) / "demo.duckdb")


def _show_synthesised(client: openai.OpenAI) -> None:
    label = f"{'openai':<22} {'chat_completions':<17} {'call (no recording matches)':<30}"
    reply = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "What does tokenward do?"}],
        extra_headers={"x-tokenward-upstream": "openai"},
    )
    usage = reply.usage
    tokens = f"{usage.prompt_tokens} in, {usage.completion_tokens} out" if usage else "no usage"
    click.echo(f"{label} -> synthesised by the simulator, {tokens}")


def _show(client: openai.OpenAI, recording: Recording, *, strip: bool = False) -> None:
    kind = ("stream" if recording.stream else "call") + (" (no include_usage)" if strip else "")
    label = f"{recording.provider:<22} {recording.endpoint:<17} {kind:<30}"
    try:
        reply = send_recorded(client, recording, strip_stream_usage=strip)
    except openai.APIStatusError as exc:
        click.echo(f"{label} -> HTTP {exc.status_code} (recorded error, relayed as is)")
        return
    if isinstance(reply, list):
        usage = next(
            (
                getattr(e, "usage", None) or getattr(getattr(e, "response", None), "usage", None)
                for e in reversed(reply)
                if getattr(e, "usage", None) or getattr(e, "response", None)
            ),
            None,
        )
        click.echo(f"{label} -> {len(reply)} events, usage seen by client: {'yes' if usage else 'no'}")
    else:
        click.echo(f"{label} -> model {getattr(reply, 'model', '?')}")
