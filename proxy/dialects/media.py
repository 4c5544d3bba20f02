"""The images and audio endpoints' replies (OpenAI's wire format), mapped to ``Usage``.

Reported usage, as OpenAI sends it (openai-python ``types/images_response.py``,
``types/audio/transcription.py``, ``transcription_text_done_event.py``):

* images (GPT image models): ``usage.input_tokens`` (text and image input),
  ``usage.input_tokens_details.image_tokens`` (the image part), ``usage.output_tokens`` (the
  generated images' tokens); streamed, each ``image_generation.completed`` /
  ``image_edit.completed`` event carries its image's usage (each read as one usage, then
  summed over the images: a count one of them gets wrong flags the row). Every reply
  also counts its images (``data`` items, or completed events) as ``output_images``, made at the
  ``size`` and ``quality`` it names (``image_variant``): models priced per image (DALL-E) report
  no tokens and are priced by them.
* transcriptions and translations: ``usage`` of ``type: tokens`` (``input_tokens``,
  ``input_token_details.audio_tokens``, ``output_tokens``; also on a stream's
  ``transcript.text.done``) or of ``type: duration`` (``seconds`` of audio, whisper-1), or a
  ``verbose_json`` reply's ``duration``; seconds are rounded to the nearest second (half up), as
  whisper-1 is billed.
* speech streamed as SSE (``stream_format: sse``): the ``speech.audio.done`` event's ``usage``
  (``input_tokens`` of text, ``output_tokens`` of audio). A binary audio reply reports nothing:
  its usage is estimated from the request (:func:`tokenward.proxy.media.estimate`).
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import msgspec

from tokenward.pricing.usage import Usage, read_count
from tokenward.proxy.dialects.observation import Observation, Reading

__all__ = ["finish", "observe_body", "reply_texts", "request_texts", "to_usage"]

_IMAGE_DONE = frozenset({"image_generation.completed", "image_edit.completed"})
_SUMMED = ("input_tokens", "image_input_tokens", "audio_input_tokens", "output_tokens")


class _View(msgspec.Struct):
    """The members of a media reply or event that metering reads (image data itself is skipped)."""

    type: Any = None
    model: Any = None
    usage: Any = None
    data: list[msgspec.Raw] | None = None
    size: Any = None
    quality: Any = None
    duration: Any = None
    error: Any = None


_decode = msgspec.json.Decoder(_View).decode


def observe_body(body: bytes, seen: Observation) -> None:
    """Update ``seen`` from one JSON reply or one stream event's data.

    Raises:
        msgspec.DecodeError: ``body`` is not a JSON object of this shape.
    """
    view = _decode(body)
    extra = seen.extra
    if isinstance(view.model, str) and view.model:
        seen.model = view.model
    if isinstance(view.error, dict):
        seen.error = str(view.error.get("message") or view.error.get("code") or "error")
    elif view.type == "error":
        seen.error = "error"
    variant = _variant(view.size, view.quality)
    if isinstance(view.type, str) and view.type in _IMAGE_DONE:
        extra["images"] = extra.get("images", 0) + 1
        extra.setdefault("variant", variant)
        if isinstance(view.usage, dict):
            extra.setdefault("image_usages", []).append(view.usage)
            seen.usage = view.usage
        return
    if view.data is not None:
        extra["images"] = len(view.data)
        extra["variant"] = variant
    if isinstance(view.usage, dict):
        seen.usage = view.usage
    elif view.duration is not None and seen.usage is None:
        seen.usage = {"type": "duration", "seconds": view.duration}


def _variant(size: Any, quality: Any) -> str:
    if not isinstance(size, str) and not isinstance(quality, str):
        return ""
    return f"{size if isinstance(size, str) else ''}/{quality if isinstance(quality, str) else ''}".lower()


def to_usage(raw: dict[str, Any], *, images: int = 0, variant: str = "") -> Usage:
    """Map one media ``usage`` object to :class:`Usage` (``images`` made at ``variant`` counted with it)."""
    problems: list[str] = []
    if raw.get("type") == "duration":
        seconds = raw.get("seconds")
        whole = None
        if isinstance(seconds, int | float) and not isinstance(seconds, bool) and 0 <= seconds < 2**40:
            whole = int(Decimal(repr(seconds)).quantize(Decimal(1), rounding=ROUND_HALF_UP))
        else:
            problems.append(f"seconds: {seconds!r} is not a duration")
        return Usage(input_audio_seconds=whole or 0, invalid=tuple(problems))
    details = raw.get("input_tokens_details") or raw.get("input_token_details")
    details = details if isinstance(details, dict) else {}
    out = raw.get("output_tokens_details")
    out = out if isinstance(out, dict) else {}
    output = read_count(raw.get("output_tokens"), "output_tokens", problems) or 0
    return Usage(
        input_tokens=read_count(raw.get("input_tokens"), "input_tokens", problems) or 0,
        image_input_tokens=read_count(details.get("image_tokens"), "image_tokens", problems, "input_tokens_details.")
        or 0,
        audio_input_tokens=read_count(details.get("audio_tokens"), "audio_tokens", problems, "input_token_details.")
        or 0,
        output_tokens=output,
        output_images=images,
        image_variant=variant,
        invalid=tuple(problems),
    )


def finish(seen: Observation) -> Reading:
    """The final reading: the reported usage with the images counted, or the images alone (per-image models)."""
    extra = seen.extra
    images, variant = int(extra.get("images", 0)), str(extra.get("variant", ""))
    usages = extra.get("image_usages")
    if usages and len(usages) > 1:  # one usage per streamed image: their sum, each read (and checked) alone
        each = [to_usage(usage) for usage in usages]
        return Reading(
            Usage(
                **{name: sum(getattr(u, name) for u in each) for name in _SUMMED},
                output_images=images,
                image_variant=variant,
                invalid=tuple(f"image {n}: {note}" for n, u in enumerate(each, start=1) for note in u.invalid),
            )
        )
    if seen.usage is not None:
        return Reading(to_usage(seen.usage, images=images, variant=variant))
    if images:
        return Reading(Usage(output_images=images, image_variant=variant))
    return Reading(None)


def request_texts(body: dict[str, Any]) -> tuple[list[str], int]:
    """Texts of a JSON media request the model reads (prompt, speech input and instructions); no messages."""
    return [v for k in ("prompt", "input", "instructions") if isinstance(v := body.get(k), str)], 0


def reply_texts(obj: dict[str, Any]) -> list[tuple[Any, str, bool]]:
    """Generated text in a transcription reply or event (``text``, ``delta``)."""
    if obj.get("type") == "transcript.text.delta" and isinstance(obj.get("delta"), str):
        return [(("transcript",), obj["delta"], False)]
    if isinstance(obj.get("text"), str):
        return [(("transcript",), obj["text"], True)]
    return []
