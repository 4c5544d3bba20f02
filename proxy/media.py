"""What an images or audio request asks for, for its budget bound and for estimating its usage.

The images endpoints (``images/generations``, ``images/edits``, ``images/variations``) and the audio
endpoints (``audio/speech``, ``audio/transcriptions``, ``audio/translations``) take a JSON body or a
``multipart/form-data`` one (:mod:`tokenward.proxy.form`). :func:`read_request` reads either into
one :class:`MediaRequest`. Its bound (:meth:`MediaRequest.bound_args`) and its estimate
(:func:`estimate`, used when the reply reports no usage) follow these rules:

* images: ``n`` images (1 to 10; 10 when unreadable) at the size and quality asked for (any,
  when ``auto`` or absent), each with its ``partial_images`` when streamed; the prompt's tokens;
  each uploaded image (``image``, ``image[]``) as an input image;
* speech: the characters of ``input`` (priced per character), and the tokens of ``input`` and
  ``instructions`` (token-priced models); the audio reply is bounded at
  ``guard.default_max_output_tokens``, and estimated, when not reported, at 6 audio tokens per
  text token (measured on OpenAI's bills for gpt-4o-mini-tts: https://raw.githubusercontent.com/sanand0/blog/main/posts/2025/openai-tts-cost.md,
  2025-11-02);
* transcriptions and translations: the upload's length is bounded from its size as if encoded
  at 8 kbit/s (1000 bytes a second, the lowest common speech bitrate) and at one audio token per
  100 bytes (:data:`tokenward.proxy.bounds.AUDIO_BYTES_PER_TOKEN`); when the reply reports no
  duration (``response_format`` ``text``), an SRT or VTT reply's last cue end is its duration,
  else the bound is billed (marked ``estimated``). Audio the request names instead of uploading
  (Groq's ``url`` field, a ``file`` sent as text: the upstream fetches it) has no such bound
  (:attr:`MediaRequest.remote_audio`): the request is unbounded, and without a reported or cued
  duration its usage is unknown.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from tokenward.pricing.usage import Usage, UsageSource
from tokenward.proxy import tokenizer
from tokenward.proxy.bounds import AUDIO_BYTES_PER_TOKEN
from tokenward.proxy.form import Form, FormError, boundary_of, read_form

__all__ = ["AUDIO_BYTES_PER_SECOND", "MediaRequest", "MediaRequestError", "estimate", "read_request"]

AUDIO_BYTES_PER_SECOND = 1000
"""8 kbit/s: an upload of N bytes holds at most N / 1000 seconds of audio (for the bound)."""
TTS_AUDIO_TOKENS_PER_TEXT_TOKEN = 6
_MAX_IMAGES = 10
_CUE = re.compile(rb"(\d+):(\d{2}):(\d{2})[,.](\d{3})")


class MediaRequestError(ValueError):
    """The request body cannot be read (message says why; HTTP 400)."""


@dataclass(frozen=True, slots=True)
class MediaRequest:
    """One images or audio request, as metering sees it.

    ``kind``: ``images``, ``speech`` or ``transcription``; ``text``: the prompt (images,
    transcriptions) or ``input`` (speech); ``instructions``: speech instructions; ``n``: images
    asked for; ``size``/``quality``: as asked (``None``: any); ``input_images``: uploaded images;
    ``audio_bytes``: bytes of uploaded audio; ``response_format``: as asked; ``remote_audio``: the
    request names audio for the upstream to fetch (a ``url`` field, or ``file`` as text), whose length
    nothing in the request bounds.
    """

    kind: str
    model: str | None
    stream: bool = False
    user: str | None = None
    text: str = ""
    instructions: str = ""
    n: int = 1
    size: str | None = None
    quality: str | None = None
    partial_images: int = 0
    input_images: int = 0
    audio_bytes: int = 0
    response_format: str | None = None
    remote_audio: bool = False

    @property
    def variant(self) -> str:
        """The ``<size>/<quality>`` asked for (``""`` when neither is fixed)."""
        return f"{self.size or ''}/{self.quality or ''}" if self.size or self.quality else ""

    @property
    def audio_seconds(self) -> int:
        """The most seconds of audio the upload can hold."""
        return math.ceil(self.audio_bytes / AUDIO_BYTES_PER_SECOND)

    @property
    def audio_tokens(self) -> int:
        """The most audio tokens the upload can be billed as."""
        return math.ceil(self.audio_bytes / AUDIO_BYTES_PER_TOKEN)

    def text_tokens(self) -> int:
        """Tokens of the request's text (prompt, or speech input and instructions), by o200k_base."""
        encoding = tokenizer.encoding_for_model(self.model)
        return sum(tokenizer.count_tokens(t, encoding) for t in (self.text, self.instructions) if t)

    def bound_args(self, text_tokens: int, max_output_tokens: int) -> dict[str, Any]:
        """Keyword arguments for :func:`tokenward.pricing.quote.worst_case` (with the margined text tokens)."""
        if self.kind == "images":
            return {
                "input_tokens": text_tokens,
                "max_output_tokens": max_output_tokens,
                "images": self.input_images,
                "output_images": self.n,
                "image_size": self.size,
                "image_quality": self.quality,
                "partial_images": self.partial_images if self.stream else 0,
            }
        if self.kind == "speech":
            return {
                "input_tokens": text_tokens,
                "max_output_tokens": max_output_tokens,
                "audio_output": True,
                "characters": len(self.text),
            }
        return {
            "input_tokens": text_tokens + self.audio_tokens,
            "audio_input_tokens": self.audio_tokens,
            "max_output_tokens": max_output_tokens,
            "audio_seconds": self.audio_seconds,
        }


def read_request(tail: str, body: bytes, content_type: str | None) -> MediaRequest:
    """Read an images or audio request body (JSON or multipart) sent to ``/v1/<tail>``.

    Raises:
        MediaRequestError: an empty body, JSON that is not an object, or a malformed form.
    """
    lower = tail.lower()
    kind = "images" if lower.startswith("images/") else "speech" if lower == "audio/speech" else "transcription"
    if content_type is not None and boundary_of(content_type) is not None:
        try:
            form = read_form(body, content_type)
        except FormError as exc:
            raise MediaRequestError(str(exc)) from None
        _once_each(form)
        fields: dict[str, Any] = dict(form.fields)
        return _request(kind, lower, fields, form)
    if not body.strip():
        raise MediaRequestError("The request body is empty: send a JSON object or a multipart form.")
    try:
        document = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise MediaRequestError(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(document, dict):
        raise MediaRequestError("The request body must be a JSON object.")
    images = document.get("images")
    return _request(kind, lower, document, None, len(images) if isinstance(images, list) else 0)


def _once_each(form: Form) -> None:
    """Refuse a form that sends a text field twice (array fields, ``name[]``, excepted).

    Form readers disagree on which value counts (aiohttp, Werkzeug and Go keep the first,
    Starlette and tokenward the last), so ``n=10`` then ``n=1`` could be bounded as one image and
    made as ten.

    Raises:
        MediaRequestError: naming the field.
    """
    seen: set[str] = set()
    for name, _ in form.pairs:
        if name in seen and not name.endswith("[]"):
            raise MediaRequestError(f"The form sends {name!r} twice: send each field once (or as {name + '[]'!r}).")
        seen.add(name)


def _request(kind: str, tail: str, fields: dict[str, Any], form: Form | None, json_images: int = 0) -> MediaRequest:
    model = fields.get("model")
    if kind == "images":
        uploads = len(form.files_named("image", "image[]")) if form is not None else json_images
        if tail == "images/variations" and form is not None:
            uploads = max(uploads, 1)
        return MediaRequest(
            kind,
            model if isinstance(model, str) else None,
            stream=_flag(fields.get("stream")),
            user=_text(fields.get("user")) or None,
            text=_text(fields.get("prompt")),
            n=_count(fields.get("n"), default=1, most=_MAX_IMAGES),
            size=_choice(fields.get("size")),
            quality=_choice(fields.get("quality")),
            partial_images=_count(fields.get("partial_images"), default=0, most=3),
            input_images=uploads,
            response_format=_text(fields.get("response_format")) or None,
        )
    if kind == "speech":
        return MediaRequest(
            kind,
            model if isinstance(model, str) else None,
            stream=fields.get("stream_format") == "sse",
            user=_text(fields.get("user")) or None,
            text=_text(fields.get("input")),
            instructions=_text(fields.get("instructions")),
            response_format=_text(fields.get("response_format")) or None,
        )
    audio = sum(f.size for f in form.files_named("file")) if form is not None else 0
    # Groq transcribes the audio at a `url` (or a base64 data URL) it fetches itself
    # (console.groq.com/docs/api-reference#audio-transcription, checked 2026-12-02)
    named = fields.get("url") not in (None, "") or fields.get("file") not in (None, "")
    return MediaRequest(
        kind,
        model if isinstance(model, str) else None,
        stream=_flag(fields.get("stream")),
        text=_text(fields.get("prompt")),
        audio_bytes=audio,
        response_format=_text(fields.get("response_format")) or None,
        remote_audio=named,
    )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _flag(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def _choice(value: Any) -> str | None:
    """A size or quality asked for; ``None`` for any (absent, ``auto``, not a string)."""
    if not isinstance(value, str) or value.lower() in ("", "auto"):
        return None
    return value.lower()


def _count(value: Any, *, default: int, most: int) -> int:
    """A small count from JSON or a form field; the most allowed when it cannot be read."""
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        return most
    return min(max(number, 0), most) if number >= 0 else most


def estimate(media: MediaRequest, reply: list[bytes], *, source: UsageSource) -> Usage | None:
    """Usage for a media reply that reported none, from the request (and an SRT/VTT reply's cues).

    Images: ``n`` images at the size and quality asked for, and the prompt's tokens. Speech:
    the input's characters and tokens, and 6 audio tokens per text token. Transcriptions: the
    last cue's end of an SRT or VTT reply as its seconds, else the upload's bound; the upload's
    audio-token bound and the reply's text tokens. ``None`` (not known) for audio the upstream
    fetched (:attr:`MediaRequest.remote_audio`) when the reply has no cue.
    """
    tokens = media.text_tokens()
    if media.kind == "images":
        return Usage(input_tokens=tokens, output_images=media.n, image_variant=media.variant, source=source)
    if media.kind == "speech":
        audio = TTS_AUDIO_TOKENS_PER_TEXT_TOKEN * tokens
        return Usage(
            input_tokens=tokens,
            output_tokens=audio,
            audio_output_tokens=audio,
            input_characters=len(media.text),
            source=source,
        )
    text = b"".join(reply)
    seconds = _last_cue_end(text)
    if seconds is None and media.remote_audio:
        return None
    written = tokenizer.count_tokens(text.decode("utf-8", "replace"), tokenizer.encoding_for_model(media.model))
    return Usage(
        input_tokens=tokens + media.audio_tokens,
        audio_input_tokens=media.audio_tokens,
        output_tokens=written,
        input_audio_seconds=seconds if seconds is not None else media.audio_seconds,
        source=source,
    )


def _last_cue_end(text: bytes) -> int | None:
    """Seconds (rounded up) at the last timestamp of an SRT or VTT document, if it has one."""
    last = None
    for match in _CUE.finditer(text):
        last = match
    if last is None:
        return None
    hours, minutes, seconds, millis = (int(g) for g in last.groups())
    return math.ceil((hours * 3600_000 + minutes * 60_000 + seconds * 1000 + millis) / 1000)
