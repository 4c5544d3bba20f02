"""Alert messages and their delivery: email over SMTP and Slack-compatible webhooks.

An :class:`Alert` is rendered once (subject, plain text, HTML, and a JSON payload for webhooks)
and sent to each of its targets by the :class:`Notifier`: an address containing ``@`` goes
by email, anything else names a configured webhook. Each delivery is retried with exponential
backoff; the outcome of every target is returned (and stored by the caller), never raised, so a
failing mail server cannot stop anything else. Secrets come from environment variables.

Configuration (the ``alerts:`` section)::

    alerts:
      evaluate_every_s: 60
      smtp: {host: smtp.example.com, port: 587, security: starttls, sender: tokenward@example.com,
             username_env: SMTP_USER, password_env: SMTP_PASSWORD}
      webhooks: [{name: slack-ops, url_env: SLACK_WEBHOOK_URL}]
      admins: [ops@example.com]          # unpriced models, failed deliveries, refusals
      digest: {every: daily, at: "08:00", timezone: Europe/Paris, to: [lead@example.com]}
"""

from __future__ import annotations

import asyncio
import datetime as dt
import email.policy
import email.utils
import hashlib
import hmac
import html
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.message import EmailMessage
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec

from tokenward.reports.sanitize import printable

if TYPE_CHECKING:  # aiosmtplib and httpx are imported when an alert is sent: not in every proxy's memory
    import httpx

__all__ = [
    "Alert",
    "AlertSettings",
    "Delivery",
    "DigestSettings",
    "Notifier",
    "REFUSED",
    "SIGNATURE_HEADER",
    "SIGNATURE_TIMESTAMP",
    "SmtpSettings",
    "WebhookSettings",
    "delivery_id",
    "html_document",
    "html_text",
    "message_id",
    "refused_for_good",
    "webhook_signature",
]

log = logging.getLogger("tokenward.alerts")


class SmtpSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An SMTP server: ``security`` is ``starttls``, ``ssl`` (implicit TLS) or ``none``."""

    host: str
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 587
    security: Literal["starttls", "ssl", "none"] = "starttls"
    sender: str = "tokenward@localhost"
    username_env: str | None = None
    password_env: str | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0


class WebhookSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A webhook receiving Slack-compatible JSON: its URL, or the environment variable holding it.

    ``timeout_s`` bounds one attempt as a whole (connect, send, the whole reply), like the SMTP
    server's ``timeout_s``: a receiver that trickles its answer is given up then.
    ``secret_env`` names the variable holding a shared secret: each post is then signed
    (:func:`webhook_signature`), and never sent unsigned while the variable is unset. Redirects
    are never followed (a 3xx is a failed attempt).
    """

    name: Annotated[str, msgspec.Meta(min_length=1)]
    url: str | None = None
    url_env: str | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    secret_env: str | None = None

    def __post_init__(self) -> None:
        if (self.url is None) == (self.url_env is None):
            raise ValueError(f"webhook {self.name!r}: give url or url_env (the variable holding it), one of them")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"webhook {self.name!r}: url must be http(s)")

    def resolved_url(self) -> str | None:
        """The URL to post to (``None`` when the environment variable is unset)."""
        return self.url or (os.environ.get(self.url_env) if self.url_env else None)


_SMTP_POLICY = email.policy.SMTP.clone(max_line_length=998)  # RFC 5322 2.1.1's hard limit


class DigestSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A spend digest sent ``daily`` or ``weekly`` (Mondays) at ``at`` local time in ``timezone``."""

    to: list[str]
    every: Literal["daily", "weekly"] = "daily"
    at: str = "08:00"
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        hour, _, minute = self.at.partition(":")
        if not (hour.isdigit() and minute.isdigit() and int(hour) < 24 and int(minute) < 60):
            raise ValueError(f"digest time {self.at!r} is not HH:MM")
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"unknown time zone {self.timezone!r}") from exc


class AlertSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``alerts:`` section: channels, who hears about operational problems, and the digest.

    ``admins`` receive alerts that belong to no budget (a model with no price, alert deliveries
    that failed) and, with the budget's own recipients, a blocking budget's refusals.
    ``retries``/``backoff_s``: a delivery is tried ``retries + 1`` times, waiting ``backoff_s``,
    then twice that, ...
    """

    evaluate_every_s: Annotated[float, msgspec.Meta(ge=1)] = 60.0
    smtp: SmtpSettings | None = None
    webhooks: list[WebhookSettings] = []
    admins: list[str] = []
    digest: DigestSettings | None = None
    retries: Annotated[int, msgspec.Meta(ge=0, le=20)] = 3
    backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 2.0

    def __post_init__(self) -> None:
        names = [w.name for w in self.webhooks]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"duplicate webhook name {name!r}")

    def target_bound_s(self) -> float:
        """Seconds one target's delivery can take at most: every attempt at its timeout, and the backoffs."""
        timeouts = [w.timeout_s for w in self.webhooks] + ([self.smtp.timeout_s] if self.smtp else [])
        waits = self.backoff_s * (2**self.retries - 1)
        return (self.retries + 1) * max(timeouts, default=0.0) + waits


@dataclass(frozen=True, slots=True)
class Alert:
    """One message to send: its identity (budget, period start, kind, thresholds), text, targets.

    ``thresholds`` are every threshold the message stands for (one message may name several
    crossed at once); ``threshold`` is the highest of them. Empty ``thresholds`` mean
    ``(threshold,)``.
    """

    budget: str
    period_start: Any
    kind: str
    threshold: int
    subject: str
    text: str
    html: str
    targets: tuple[str, ...]
    payload: dict[str, Any] = field(default_factory=dict)
    thresholds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.thresholds:
            object.__setattr__(self, "thresholds", (self.threshold,))


def delivery_id(alert: Alert, target: str) -> str:
    """A stable identifier of ``alert`` as delivered to ``target``.

    The same (budget, period start, kind, thresholds, target) always gives the same value, so a
    message sent again after a crash carries the ``Message-ID`` (or webhook ``Idempotency-Key``)
    of the first one and a receiver can drop the duplicate.
    """
    start = alert.period_start.isoformat() if hasattr(alert.period_start, "isoformat") else str(alert.period_start)
    thresholds = ",".join(str(t) for t in sorted(alert.thresholds))
    seed = "\x1f".join([alert.budget, start, alert.kind, thresholds, target])
    return hashlib.sha256(seed.encode()).hexdigest()[:32]


REFUSED = "refused for good: "
"""How the error of a delivery the receiver refused permanently starts (SMTP 5xx, HTTP 4xx but 408/425/429)."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """How sending one alert to one target went (``error`` starts with :data:`REFUSED` if never to be retried)."""

    channel: str
    target: str
    ok: bool
    attempts: int
    error: str | None = None


def refused_for_good(exc: BaseException) -> bool:
    """Whether a delivery failed in a way trying again cannot change: an SMTP 5xx reply, an HTTP 4xx.

    Sources: RFC 5321 4.2.1 (5yz: permanent negative completion); RFC 9110 15.5 (4xx client
    errors; 408, 425 and 429 invite a retry).
    """
    import aiosmtplib
    import httpx

    if isinstance(exc, aiosmtplib.SMTPRecipientsRefused):
        return bool(exc.recipients) and all(500 <= r.code < 600 for r in exc.recipients)
    if isinstance(exc, aiosmtplib.SMTPResponseException):
        return 500 <= exc.code < 600
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        return 400 <= status < 500 and status not in (408, 425, 429)
    return False


class Notifier:
    """Sends alerts by email and webhook with retries (none after a refusal for good); never raises.

    Args:
        settings: channels and retry policy.
        transport: httpx transport for webhooks (tests).
    """

    def __init__(self, settings: AlertSettings, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self._webhooks = {w.name: w for w in settings.webhooks}
        self._transport = transport

    async def send(
        self, alert: Alert, on_delivery: Callable[[Delivery], Awaitable[None]] | None = None
    ) -> list[Delivery]:
        """Deliver ``alert`` to every target; one :class:`Delivery` per target.

        Each email address gets its own message (so each target's success is known on its
        own); targets are tried side by side. ``on_delivery`` is awaited with each target's
        outcome as soon as it is known.
        """
        return list(await asyncio.gather(*(self._send_one(alert, target, on_delivery) for target in alert.targets)))

    async def _send_one(
        self, alert: Alert, target: str, on_delivery: Callable[[Delivery], Awaitable[None]] | None
    ) -> Delivery:
        """One target's delivery (side by side with the others': a webhook that hangs delays no mail)."""
        if "@" in target:
            if self.settings.smtp is None:  # a configuration problem: no point retrying
                result = Delivery("email", target, False, 0, "no SMTP server is configured (alerts.smtp)")
            else:
                email_attempt = partial(self._email, alert, target)
                result = await self._retry("email", target, email_attempt, self.settings.smtp.timeout_s)
        else:
            hook = self._webhooks.get(target)
            if hook is None:
                result = Delivery("webhook", target, False, 0, f"no webhook named {target!r} is configured")
            else:
                result = await self._retry("webhook", target, partial(self._webhook, alert, hook), hook.timeout_s)
        if on_delivery is not None:
            await on_delivery(result)
        return result

    async def _retry(self, channel: str, target: str, attempt: Any, timeout_s: float) -> Delivery:
        delay = self.settings.backoff_s
        error = None
        for number in range(1, self.settings.retries + 2):
            try:
                async with asyncio.timeout(timeout_s):  # the whole attempt: a receiver may answer byte by byte
                    await attempt()
                return Delivery(channel, target, True, number)
            except Exception as exc:  # any failure is retried (unless refused for good), then reported
                error = f"{type(exc).__name__}: {exc or f'no answer within {timeout_s:g} s'}"
                log.warning("alert delivery by %s to %s failed (attempt %d): %s", channel, target, number, error)
                if refused_for_good(exc):
                    return Delivery(channel, target, False, number, REFUSED + error)
                if number <= self.settings.retries:
                    await asyncio.sleep(delay)
                    delay *= 2
        return Delivery(channel, target, False, self.settings.retries + 1, error)

    async def _email(self, alert: Alert, recipient: str) -> None:
        smtp = self.settings.smtp
        if smtp is None:
            raise RuntimeError("no SMTP server is configured (alerts.smtp)")
        recipients = [recipient]
        message = EmailMessage()
        message["From"] = smtp.sender
        message["To"] = recipient
        message["Subject"] = printable(alert.subject)  # a CR/LF would make the stdlib refuse the header
        message["Date"] = email.utils.format_datetime(dt.datetime.now(dt.UTC))
        message["Message-ID"] = message_id(alert, recipient, smtp.sender)
        message.set_content(alert.text)
        message.add_alternative(alert.html, subtype="html")
        username = os.environ.get(smtp.username_env) if smtp.username_env else None
        password = os.environ.get(smtp.password_env) if smtp.password_env else None
        # Serialised here rather than by aiosmtplib: the stdlib folds a long subject starting
        # with "[" right after "Subject:", which some parsers read back with a leading space.
        import aiosmtplib

        client = aiosmtplib.SMTP(
            hostname=smtp.host,
            port=smtp.port,
            use_tls=smtp.security == "ssl",
            start_tls=True if smtp.security == "starttls" else False,
            username=username,
            password=password,
            timeout=smtp.timeout_s,
        )
        # Not aiosmtplib.send: its ``async with`` answers any other failure, a cancellation too (the
        # attempt's timeout_s, a proxy stopping), with a QUIT that waits for the server, which may
        # be the very server that hangs: the attempt outlived its bound (and its lease) by up to
        # timeout_s more, and a stopping proxy waited for it. A failed attempt just hangs up.
        try:
            await client.connect()
            await client.sendmail(smtp.sender, recipients, message.as_bytes(policy=_SMTP_POLICY))
        except BaseException:
            client.close()
            raise
        try:
            await client.quit()
        except aiosmtplib.SMTPException:
            pass  # the mail was accepted: a QUIT that fails changes nothing
        finally:
            client.close()

    async def _webhook(self, alert: Alert, hook: WebhookSettings) -> None:
        url = hook.resolved_url()
        if not url:
            raise RuntimeError(f"webhook {hook.name!r} has no URL (set {hook.url_env or 'url'})")
        key = delivery_id(alert, hook.name)
        text = f"*{_slack(printable(alert.subject))}*\n{_slack(alert.text)}"
        figures = {"text": text, "tokenward": {**alert.payload, "idempotency_key": key}}
        body = json.dumps(figures, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()  # as httpx's
        headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
        if hook.secret_env is not None:
            secret = os.environ.get(hook.secret_env)
            if not secret:
                raise RuntimeError(f"webhook {hook.name!r} is signed, but {hook.secret_env} is not set: not sent")
            timestamp = str(int(time.time()))
            headers |= {SIGNATURE_TIMESTAMP: timestamp, SIGNATURE_HEADER: webhook_signature(secret, timestamp, body)}
        import httpx

        # never follow a redirect: the receiver could send the alert (and its signature) to any host
        client = httpx.AsyncClient(transport=self._transport, timeout=hook.timeout_s, follow_redirects=False)
        async with client:
            response = await client.post(url, content=body, headers=headers)
            response.raise_for_status()


SIGNATURE_HEADER = "X-Tokenward-Signature"
"""The header carrying a signed webhook's signature (``v1=`` and 64 hex digits)."""

SIGNATURE_TIMESTAMP = "X-Tokenward-Timestamp"
"""The header carrying the Unix time (whole seconds, UTC) a signed webhook was signed at."""


def webhook_signature(secret: str, timestamp: str, body: bytes) -> str:
    """``v1=`` + hex HMAC-SHA256, keyed with ``secret`` (UTF-8), of ``timestamp`` + ``.`` + the exact body bytes.

    A receiver recomputes it over the raw body it received and the :data:`SIGNATURE_TIMESTAMP`
    header, compares in constant time, and refuses a timestamp too far from its clock (a
    replay). Each attempt is signed afresh; the body (and its ``idempotency_key``) is the same.
    Source: RFC 2104 (HMAC); the scheme is the one Stripe's webhooks use (``t.body``).
    """
    return "v1=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def message_id(alert: Alert, recipient: str, sender: str) -> str:
    """The ``Message-ID`` of ``alert``'s mail to ``recipient``: ``<id@the sender's domain>`` (RFC 5322 3.6.4).

    A function of the alert's identity (budget, period, kind, thresholds) and the recipient
    (:func:`delivery_id`), so that a mail sent again after a crash carries the same id and mail
    clients and archives recognise the resend as the same message.
    """
    domain = email.utils.parseaddr(sender)[1].rpartition("@")[2] or "localhost"
    return f"<{delivery_id(alert, recipient)}@{domain}>"


def _slack(text: str) -> str:
    """Text for a Slack-style ``text`` field: ``&``, ``<`` and ``>`` escaped (no ``<!channel>``, no forged links).

    Source: Slack, "Formatting text for app surfaces", escaping: https://api.slack.com/reference/surfaces/formatting#escaping
    """
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def html_document(title: str, rows: list[tuple[str, str]], sections: list[tuple[str, list[tuple[str, str]]]]) -> str:
    """A small self-contained HTML mail body: a heading, a key/value table, titled tables."""

    def table(items: list[tuple[str, str]]) -> str:
        cells = "".join(
            f"<tr><td style='padding:2px 12px 2px 0'>{html.escape(k)}</td>"
            f"<td style='padding:2px 0'><b>{html.escape(v)}</b></td></tr>"
            for k, v in items
        )
        return f"<table>{cells}</table>"

    parts = [f"<h2 style='font-family:sans-serif'>{html.escape(title)}</h2>", table(rows)]
    for heading, items in sections:
        if items:
            parts += [f"<h3 style='font-family:sans-serif'>{html.escape(heading)}</h3>", table(items)]
    return "<html><body style='font-family:sans-serif'>" + "".join(parts) + "</body></html>"


def html_text(title: str, text: str) -> str:
    """An HTML mail body showing a plain-text message as is."""
    return (
        f"<html><body><h2 style='font-family:sans-serif'>{html.escape(title)}</h2>"
        f"<pre style='font-family:monospace'>{html.escape(text)}</pre></body></html>"
    )
