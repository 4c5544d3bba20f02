"""Images and audio endpoints: metered, priced, bounded and in reports, through a real proxy.

A scripted upstream (aiohttp on loopback) answers each endpoint the way OpenAI does
(openai-python 3.57 types: ``ImagesResponse``, ``Transcription``, ``TranscriptionVerbose``); the
numbers below are worked out by hand from the builtin catalog (USD per 1M tokens unless said):
gpt-image-1 text input 5.00, image input 10.00, output 40.00; dall-e-2 per image by size
(512x512: $0.018); whisper-1 $0.006 a minute, billed per second; gpt-4o-transcribe input 2.50,
output 10.00; tts-1 $15.00 per 1M characters.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from tokenward.pricing.catalog import load_catalog
from tokenward.pricing.quote import worst_case
from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.app import create_app
from tokenward.proxy.config import Config, LedgerConfig, UpstreamConfig
from tokenward.proxy.form import FormError, read_form
from tokenward.proxy.server import running_in_thread
from tokenward.reports.ledger import open_ledger
from tokenward.reports.queries import spend

from .conftest import read_rows
from .servers import Servers

AUDIO = bytes(range(256)) * 117 + bytes(range(48))  # 30,000 bytes of "audio"
SPEECH = b"ID3" + bytes(range(256)) * 400  # what the upstream speaks: 102,403 bytes of "mp3"


async def openai_media(request: web.Request, body: bytes) -> web.StreamResponse:
    """Answers as OpenAI does; the request's ``x-test`` header picks the reply."""
    case = request.headers.get("x-test", "")
    if case == "gpt-image-1":
        return web.json_response(
            {"created": 1, "data": [{"b64_json": "iVBORw0KGgo=" * 1000}], "size": "1024x1024", "quality": "high",
             "usage": {"input_tokens": 50, "input_tokens_details": {"text_tokens": 50, "image_tokens": 0},
                       "output_tokens": 4160, "total_tokens": 4210}}
        )  # fmt: skip
    if case == "gpt-image-1-edit":
        return web.json_response(
            {"created": 1, "data": [{"b64_json": "iVBORw0KGgo="}], "size": "1024x1024", "quality": "medium",
             "usage": {"input_tokens": 373, "input_tokens_details": {"text_tokens": 50, "image_tokens": 323},
                       "output_tokens": 1056, "total_tokens": 1429}}
        )  # fmt: skip
    if case == "dall-e-2":  # per-image models report no usage and name no size
        return web.json_response({"created": 1, "data": [{"url": "https://x/1.png"}, {"url": "https://x/2.png"}]})
    if case == "speech":
        stream = web.StreamResponse(headers={"content-type": "audio/mpeg"})
        await stream.prepare(request)
        for start in range(0, len(SPEECH), 8192):
            await stream.write(SPEECH[start : start + 8192])
        await stream.write_eof()
        return stream
    if case == "whisper-json":
        return web.json_response({"text": "hello", "usage": {"type": "duration", "seconds": 9.5}})
    if case == "whisper-verbose":
        return web.json_response({"task": "transcribe", "language": "english", "duration": 61.2, "text": "hi"})
    if case == "whisper-text":
        return web.Response(text="hello there\n", content_type="text/plain")
    if case == "whisper-srt":
        srt = "1\n00:00:00,000 --> 00:00:04,200\nhello\n\n2\n00:00:04,200 --> 00:00:12,480\nthere\n"
        return web.Response(text=srt, content_type="text/plain")
    if case == "gpt-4o-transcribe":
        return web.json_response(
            {"text": "hello there", "usage": {"type": "tokens", "input_tokens": 120,
             "input_token_details": {"text_tokens": 20, "audio_tokens": 100}, "output_tokens": 45, "total_tokens": 165}}
        )  # fmt: skip
    return web.json_response({"error": {"message": f"no case {case!r}", "type": "invalid_request_error"}}, status=400)


@contextmanager
def media_proxy(tmp_path: Path, budgets: list[BudgetSettings] | None = None) -> Iterator[tuple[str, Path]]:
    ledger = tmp_path / "media.duckdb"
    with Servers(openai_media).running() as servers:
        config = Config(
            upstreams=[UpstreamConfig(name="openai", base_url=f"{servers.upstream_url}/v1", provider="openai")],
            ledger=LedgerConfig(path=str(ledger), flush_interval_s=0.05),
            budgets=budgets or [],
        )
        context = running_in_thread(create_app(config))
        url = context.__enter__()
        try:
            yield url, ledger
        finally:
            context.__exit__(None, None, None)


def send(url: str, path: str, case: str, headers: dict[str, str] | None = None, **request: Any) -> httpx.Response:
    sent = {"authorization": "Bearer sk-client", "x-test": case, **(headers or {})}
    return httpx.post(f"{url}/v1/{path}", headers=sent, timeout=30, **request)


def test_every_images_and_audio_endpoint_is_metered_and_priced(tmp_path):
    with media_proxy(tmp_path) as (url, ledger):
        image = send(url, "images/generations", "gpt-image-1", json={"model": "gpt-image-1", "prompt": "a cat"})
        edit = send(
            url,
            "images/edits",
            "gpt-image-1-edit",
            data={"model": "gpt-image-1", "prompt": "add a hat", "quality": "medium"},
            files={"image[]": ("cat.png", b"\x89PNG" + b"\0" * 5000, "image/png")},
        )
        variation = send(
            url,
            "images/variations",
            "dall-e-2",
            data={"model": "dall-e-2", "n": "2", "size": "512x512"},
            files={"image": ("cat.png", b"\x89PNG" + b"\0" * 100, "image/png")},
        )
        speech = send(url, "audio/speech", "speech", json={"model": "tts-1", "voice": "alloy", "input": "Hello there, general."})
        transcriptions = [
            send(url, "audio/transcriptions", case, data={"model": model, **extra}, files={"file": ("a.mp3", AUDIO, "audio/mpeg")})
            for case, model, extra in (
                ("whisper-json", "whisper-1", {}),
                ("whisper-verbose", "whisper-1", {"response_format": "verbose_json"}),
                ("gpt-4o-transcribe", "gpt-4o-transcribe", {}),
            )
        ]
        translations = [
            send(url, "audio/translations", case, data={"model": "whisper-1", "response_format": fmt}, files={"file": ("a.mp3", AUDIO, "audio/mpeg")})
            for case, fmt in (("whisper-text", "text"), ("whisper-srt", "srt"))
        ]  # fmt: skip
    replies = [image, edit, variation, speech, *transcriptions, *translations]
    assert [r.status_code for r in replies] == [200] * 9
    assert speech.content == SPEECH and speech.headers["content-type"] == "audio/mpeg"  # relayed byte for byte
    rows = {r["path"] + "|" + (r["requested_model"] or ""): r for r in read_rows(ledger)}
    got = {
        key: (row["endpoint"], row["price_status"], row["cost_usd"], row["usage_source"])
        for key, row in rows.items()
    }
    # gpt-image-1: 50 text tokens x 5.00 + 4160 image tokens out x 40.00 = 250 + 166,400 -> $0.16665
    # edit: 50 x 5.00 + 323 image tokens in x 10.00 + 1056 out x 40.00 = 250 + 3230 + 42,240 -> $0.04572
    # dall-e-2 variations: 2 images at 512x512 (the size asked for; the reply names none) x $0.018 = $0.036
    # tts-1: "Hello there, general." is 21 characters x $15.00 / 1M = $0.000315
    # whisper-1 usage seconds 9.5 -> 10 s (nearest, half up) x $0.006 / 60 = $0.001
    # verbose_json duration 61.2 -> 61 s -> $0.0061
    # gpt-4o-transcribe: 120 input (100 audio) x 2.50 + 45 out x 10.00 = 300 + 450 -> $0.00075
    # text reply, no duration: the upload's bound, 30,000 bytes at 1000 bytes/s = 30 s -> $0.003 (estimated)
    # srt reply: the last cue ends at 00:00:12,480 -> 13 s -> $0.0013 (estimated)
    assert got == {
        "/v1/images/generations|gpt-image-1": ("images", "priced", Decimal("0.16665"), "reported"),
        "/v1/images/edits|gpt-image-1": ("images", "priced", Decimal("0.04572"), "reported"),
        "/v1/images/variations|dall-e-2": ("images", "priced", Decimal("0.036"), "reported"),
        "/v1/audio/speech|tts-1": ("audio_speech", "priced", Decimal("0.000315"), "estimated"),
        "/v1/audio/transcriptions|whisper-1": got["/v1/audio/transcriptions|whisper-1"],
        "/v1/audio/transcriptions|gpt-4o-transcribe": (
            "audio_transcriptions", "priced", Decimal("0.00075"), "reported"
        ),
        "/v1/audio/translations|whisper-1": got["/v1/audio/translations|whisper-1"],
    }  # fmt: skip
    by_case = {(r["path"], r["error"] or "", r["input_audio_seconds"]): r["cost_usd"] for r in read_rows(ledger)}
    assert sorted(v for (p, _, _), v in by_case.items() if p == "/v1/audio/transcriptions") == [
        Decimal("0.00075"), Decimal("0.001"), Decimal("0.0061"),
    ]  # fmt: skip
    assert sorted((s, v) for (p, _, s), v in by_case.items() if p == "/v1/audio/translations") == [
        (13, Decimal("0.0013")), (30, Decimal("0.003")),
    ]  # fmt: skip
    variation_row = rows["/v1/images/variations|dall-e-2"]
    assert (variation_row["output_images"], variation_row["image_variant"]) == (2, "512x512/")
    speech_row = rows["/v1/audio/speech|tts-1"]
    assert (speech_row["input_characters"], speech_row["outcome"]) == (21, "ok")
    # reports group them by endpoint
    conn = open_ledger(ledger, read_only=True)
    try:
        by_endpoint = {r["endpoint"]: (r["requests"], r["cost_usd"]) for r in spend(conn, ("endpoint",))}
    finally:
        conn.close()
    assert by_endpoint == {
        "images": (3, Decimal("0.24837")),  # 0.16665 + 0.04572 + 0.036
        "audio_speech": (1, Decimal("0.000315")),
        "audio_transcriptions": (3, Decimal("0.00785")),  # 0.001 + 0.0061 + 0.00075
        "audio_translations": (2, Decimal("0.0043")),  # 0.003 + 0.0013
    }


def test_image_and_audio_bounds():
    catalog = load_catalog()
    when = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)

    def bound(model: str, **kwargs: Any) -> Decimal | None:
        return worst_case(catalog, model=model, provider="openai", at=when, max_output_tokens=16384, **kwargs)

    # gpt-image-1, n=2, any size and quality: the dearest, 1024x1536 high, 6240 tokens each: 12,480 x 40.00
    # = 499,200; 311 prompt tokens x 5.00 = 1555 -> $0.500755
    assert bound("gpt-image-1", input_tokens=311, output_images=2) == Decimal("0.500755")
    # low quality asked for, streamed with 3 partial images: (408 + 3 x 100) x 40.00 = 28,320 + 1555 -> $0.029875
    low = bound("gpt-image-1", input_tokens=311, output_images=1, image_quality="low", partial_images=3)
    assert low == Decimal("0.029875")
    # dall-e-3 at any variant: $0.12 (hd 1024x1792); standard asked for: $0.08
    assert bound("dall-e-3", input_tokens=311, output_images=1) == Decimal("0.12")
    assert bound("dall-e-3", input_tokens=311, output_images=1, image_quality="standard") == Decimal("0.08")
    # whisper-1: a 30,000-byte upload holds at most 30 s: $0.003
    assert worst_case(
        catalog, model="whisper-1", provider="openai", at=when, input_tokens=300, max_output_tokens=16384, audio_seconds=30
    ) == Decimal("0.003")
    # tts-1: 21 characters x 15.00 / 1M
    assert bound("tts-1", input_tokens=306, characters=21) == Decimal("0.000315")


def test_a_budget_bounds_image_requests_before_they_are_sent(tmp_path):
    # gpt-image-1 n=10 at any size and quality: 10 x 6240 x 40.00 / 1M = $2.496 alone; the budget has $1
    budget = BudgetSettings(name="images", limit_usd=1, period="total", action="block")
    with media_proxy(tmp_path, [budget]) as (url, ledger):
        refused = send(url, "images/generations", "gpt-image-1", json={"model": "gpt-image-1", "prompt": "cats", "n": 10})
        allowed = send(url, "images/generations", "gpt-image-1", json={"model": "gpt-image-1", "prompt": "a cat"})
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded"
    assert allowed.status_code == 200
    rows = read_rows(ledger)
    assert sorted((r["outcome"], r["cost_usd"]) for r in rows) == [("ok", Decimal("0.16665")), ("rejected", Decimal(0))]


def test_forms_are_read_in_pieces_within_limits():
    boundary = "b0undary"
    head = f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
    part = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'
    body = (head + part).encode() + AUDIO * 10 + f"\r\n--{boundary}--\r\n".encode()
    form = read_form(body, f"multipart/form-data; boundary={boundary}")
    assert form.fields == {"model": "whisper-1"} and [(f.name, f.size) for f in form.files] == [("file", 300_000)]
    with pytest.raises(FormError, match="Unexpected end"):
        read_form(body[:-20], f"multipart/form-data; boundary={boundary}")
    many = "".join(f'--{boundary}\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nx\r\n' for i in range(65))
    with pytest.raises(FormError):
        read_form((many + f"--{boundary}--\r\n").encode(), f"multipart/form-data; boundary={boundary}")
    long_field = f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n' + "x" * 300_000 + "\r\n"
    with pytest.raises(FormError, match="longer than"):
        read_form((long_field + f"--{boundary}--\r\n").encode(), f"multipart/form-data; boundary={boundary}")


def test_a_malformed_form_is_a_400_with_its_row(tmp_path):
    with media_proxy(tmp_path) as (url, ledger):
        reply = send(
            url,
            "audio/transcriptions",
            "whisper-json",
            content=b"--x\r\nnot a part",
            headers={"content-type": "multipart/form-data; boundary=x"},
        )
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"
    (row,) = read_rows(ledger)
    assert (row["endpoint"], row["outcome"], row["price_status"]) == ("audio_transcriptions", "client_error", "not_billed")
    assert row["cost_usd"] == 0


class FetchingUpstream:
    """Transcriptions as Groq serves them: the audio may be named by a ``url`` the upstream fetches itself.

    Every request is 10 minutes of audio (whisper-1 at $0.006 a minute: $0.06). ``verbose_json``
    reports the duration, ``json`` does not. Replies wait for :attr:`release`; :attr:`arrived`
    counts the requests that reached it.
    """

    def __init__(self) -> None:
        self.release = threading.Event()
        self.arrived = 0

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        self.arrived += 1
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 30)
        form = await request.post() if not body else None
        text = body.decode("latin-1")
        assert form is None and 'name="url"' in text  # the audio was named, not uploaded
        if "verbose_json" in text:
            return web.json_response({"task": "transcribe", "language": "en", "duration": 600.0, "text": "a talk"})
        return web.json_response({"text": "a talk"})


@contextmanager
def fetching_proxy(tmp_path: Path, upstream: FetchingUpstream, budgets: list[BudgetSettings]) -> Iterator[str]:
    with Servers(upstream.handle).running() as servers:
        config = Config(
            upstreams=[UpstreamConfig(name="groq", base_url=f"{servers.upstream_url}/v1", provider="openai")],
            ledger=LedgerConfig(path=str(tmp_path / "media.duckdb"), flush_interval_s=0.05),
            budgets=budgets,
        )
        with running_in_thread(create_app(config)) as url:
            yield url


def transcribe_by_url(url: str, response_format: str) -> httpx.Response:
    fields = {"model": "whisper-1", "url": "https://cdn.example/talk.mp3", "response_format": response_format}
    files = {name: (None, value) for name, value in fields.items()}  # a multipart form without a file part
    return httpx.post(f"{url}/v1/audio/transcriptions", headers={"authorization": "Bearer sk-client"}, files=files,
                      timeout=30)  # fmt: skip


def test_audio_named_by_url_is_not_a_silent_zero(tmp_path):
    # The bound and the estimate read the uploaded file's size: 0 bytes for audio the upstream fetched from a
    # url, so a json reply (no duration) was estimated at 0 seconds: a $0 row for 10 minutes ($0.06) billed
    upstream = FetchingUpstream()
    upstream.release.set()
    with fetching_proxy(tmp_path, upstream, []) as url:
        reply = transcribe_by_url(url, "json")
    assert reply.status_code == 200 and reply.json() == {"text": "a talk"}
    (row,) = read_rows(tmp_path / "media.duckdb")
    assert (row["endpoint"], row["price_status"], row["cost_usd"]) == ("audio_transcriptions", "usage_unknown", None)


def test_audio_named_by_url_is_unbounded_under_a_hard_limit(tmp_path):
    # Room for one and a half requests ($0.09). Bounded by their 0 uploaded bytes ($0), four at once were all
    # admitted: 4 x 600 s x $0.006/60 = $0.24, 2.7 times the limit. Unbounded, the first reserves what is
    # left and runs alone; the others get 429 before anything is sent.
    upstream = FetchingUpstream()
    cap = BudgetSettings(name="cap", limit_usd=Decimal("0.09"), period="total", action="block")
    replies: list[httpx.Response] = []
    with fetching_proxy(tmp_path, upstream, [cap]) as url:
        threads = [threading.Thread(target=lambda: replies.append(transcribe_by_url(url, "verbose_json")))
                   for _ in range(4)]  # fmt: skip
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(replies) < 3 and upstream.arrived < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the proxy refused three, or all four reached the upstream
        upstream.release.set()
        for thread in threads:
            thread.join(30)
    assert sorted(r.status_code for r in replies) == [200, 429, 429, 429]
    assert upstream.arrived == 1
    rows = read_rows(tmp_path / "media.duckdb")
    assert sorted((r["http_status"], r["cost_usd"]) for r in rows) == [
        (200, Decimal("0.06")),
        (429, Decimal(0)),
        (429, Decimal(0)),
        (429, Decimal(0)),
    ]


@pytest.mark.parametrize(
    ("path", "request_", "price"),
    [
        ("images/generations", {"json": {"model": "dall-e-3", "prompt": "a cat", "size": "1024x1024",
                                         "quality": "hd"}}, Decimal("0.08")),
        ("audio/speech", {"json": {"model": "tts-1", "voice": "alloy", "input": "word " * 2000}}, Decimal("0.15")),
        ("audio/transcriptions", {"data": {"model": "whisper-1"}, "files": {"file": ("a.mp3", AUDIO * 20)}},
         Decimal("0.06")),
    ],
    ids=["dall-e-3", "tts-1", "whisper-1"],
)  # fmt: skip
def test_a_media_request_over_the_limit_is_refused_not_bounded_again_as_text(tmp_path, path, request_, price):
    # A refused request was bounded a second time as if it were a chat request (for when a byte bound
    # was too coarse): a multipart or media body counts no text, and models priced per image, per
    # character or per minute cost $0 a token, so the second bound was $0 and the request went through
    # (before: 200, and a row of the full price over a $0.05 cap). dall-e-3 1024x1024 hd: $0.08; tts-1:
    # 10,000 characters x $15/1M = $0.15; whisper-1: 600,000 bytes -> 600 s bound x $0.006/60 = $0.06.
    billed: list[str] = []

    async def handle(request: web.Request, body: bytes) -> web.StreamResponse:
        billed.append(request.path)
        return web.json_response({"created": 1, "data": [{"url": "https://x/1.png"}]})

    cap = BudgetSettings(name="cap", limit_usd=Decimal("0.05"), period="total", action="block")
    with Servers(handle).running() as servers:
        config = Config(
            upstreams=[UpstreamConfig(name="openai", base_url=f"{servers.upstream_url}/v1", provider="openai")],
            ledger=LedgerConfig(path=str(tmp_path / "media.duckdb"), flush_interval_s=0.05),
            budgets=[cap],
        )
        with running_in_thread(create_app(config)) as url:
            reply = httpx.post(f"{url}/v1/{path}", headers={"authorization": "Bearer sk-client"}, timeout=30,
                               **request_)  # fmt: skip
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "budget_exceeded"
    assert f"${price}" in reply.json()["error"]["message"] or str(price) in reply.json()["error"]["message"]
    assert billed == []
    (row,) = read_rows(tmp_path / "media.duckdb")
    assert (row["http_status"], row["outcome"]) == (429, "rejected")
