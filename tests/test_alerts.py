"""Budget alerts over real SMTP (aiosmtpd): sent once, on time, across restarts; failures visible."""

from __future__ import annotations

import asyncio
import datetime as dt
import email
import email.policy
import email.utils
import json
import socket
import time
from decimal import Decimal
from pathlib import Path

import httpx
import msgspec
import pytest
from aiosmtpd.controller import Controller
from click.testing import CliRunner

from tokenward.pricing.settings import BudgetSettings
from tokenward.proxy.cli import main
from tokenward.reports.alerts import (
    Alert,
    AlertSettings,
    DigestSettings,
    Notifier,
    SmtpSettings,
    WebhookSettings,
    message_id,
)
from tokenward.reports.budget_check import evaluate_and_notify
from tokenward.reports.ledger import DuckLedger, open_ledger, write_rows
from tokenward.reports.ledger.spend import DuckSpend

from .test_ledger import make_row

UTC = dt.UTC
RECORD_HEADER = "x-tokenward-sim-record"


class Inbox:
    """Collects the mails an aiosmtpd server receives."""

    def __init__(self) -> None:
        self.messages: list[email.message.EmailMessage] = []

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's hook name
        self.messages.append(email.message_from_bytes(envelope.content, policy=email.policy.default))
        return "250 OK"

    def wait_for(self, count: int, timeout: float = 10.0) -> list[email.message.EmailMessage]:
        deadline = time.monotonic() + timeout
        while len(self.messages) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.messages)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def smtp():
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=free_port())
    controller.start()
    yield inbox, controller.port
    controller.stop()


def settings_for(port: int, **extra) -> AlertSettings:
    return AlertSettings(
        smtp=SmtpSettings(host="127.0.0.1", port=port, security="none", sender="tokenward@test"),
        retries=1,
        backoff_s=0.01,
        **extra,
    )


def webhook_inbox() -> tuple[list[dict], httpx.MockTransport]:
    """A webhook receiver answering 200: the JSON bodies posted to it, and the transport to give a Notifier."""
    posted: list[dict] = []

    def hook(request: httpx.Request) -> httpx.Response:
        posted.append(json.loads(request.content))
        return httpx.Response(200)

    return posted, httpx.MockTransport(hook)


def seed(path: Path, rows: list[dict]) -> None:
    write_rows(path, rows)


def cost_row(request_id: str, when: str, cost: str, model: str = "gpt-4o", key: str = "agent", **extra) -> dict:
    started = dt.datetime.fromisoformat(when).timestamp()
    return make_row(
        request_id,
        started_at=started,
        ended_at=started + 1,
        served_model=model,
        principal=key,
        team="research",
        cost_usd=Decimal(cost),
        **extra,
    )


def run_check(path: Path, budgets, settings, now: str, *, notifier=None, dry_run=False):
    conn = open_ledger(path, read_only=True)
    try:
        return asyncio.run(
            evaluate_and_notify(
                DuckSpend(conn),
                DuckLedger(path).state,
                budgets,
                settings,
                notifier or Notifier(settings),
                dt.datetime.fromisoformat(now),
                dry_run=dry_run,
            )
        )
    finally:
        conn.close()


MONTHLY_SETTINGS = BudgetSettings(
    name="research-monthly",
    limit_usd=100,
    scope={"team": "research"},
    period="month",
    timezone="Europe/Paris",
    notify=["lead@example.com"],
)
MONTHLY = MONTHLY_SETTINGS.to_budget()


def test_threshold_mail_has_the_facts_in_text_and_html(tmp_path, smtp):
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    seed(
        path,
        [
            cost_row("a", "2026-11-10T09:00:00+00:00", "40.00"),
            cost_row("b", "2026-11-12T09:00:00+00:00", "15.50", model="claude-sonnet-4-5", key="batch"),
        ],
    )
    sent = run_check(path, [MONTHLY], settings_for(port), "2026-11-12T10:00:00+00:00")
    # the spend rate also heads past the limit this month: that is its own, separate alert
    assert [(a.kind, a.threshold) for a, _ in sent] == [("threshold", 50), ("forecast", 0)]
    mail, forecast = sorted(inbox.wait_for(2), key=lambda m: "projected" in m["Subject"])
    assert forecast["Subject"] == (
        "[tokenward] budget research-monthly: 55.50% of $100.00 "
        "(projected to reach $145.31 by 2026-12-01T00:00:00+01:00)"
    )
    assert mail["To"] == "lead@example.com" and mail["From"] == "tokenward@test"
    assert mail["Subject"] == "[tokenward] budget research-monthly: 55.50% of $100.00 (crossed 50%)"
    text = mail.get_body(("plain",)).get_content()
    html = mail.get_body(("html",)).get_content()
    for fact in (
        "Scope: team=research",
        "Spent: $55.50 (55.50%)",
        "Limit: $100.00",
        "Remaining: $44.50",
        "Resets: 2026-12-01T00:00:00+01:00",
        "gpt-4o: $40.00",
        "claude-sonnet-4-5: $15.50",
        "agent: $40.00",
        "batch: $15.50",
    ):
        assert fact in text, fact
    # 11 d 11 h (275 h) of a 720-hour month (Paris) gone: 55.50 x 720 / 275 = $145.309 forecast
    assert "Forecast for the period: $145.31" in text
    assert "<table>" in html and "research-monthly" in html
    # nothing more to say at the next evaluation
    assert run_check(path, [MONTHLY], settings_for(port), "2026-11-12T11:00:00+00:00") == []
    assert len(inbox.wait_for(3, timeout=0.3)) == 2


def test_a_limit_the_rate_reaches_only_after_the_reset_is_not_given_a_time(tmp_path, smtp):
    inbox, port = smtp
    posted, hooks = webhook_inbox()
    path = tmp_path / "l.duckdb"
    seed(
        path,
        [
            cost_row("a", "2026-11-10T09:00:00+00:00", "40.00"),
            cost_row("b", "2026-11-18T09:00:00+00:00", "10.50"),
        ],
    )
    budget = msgspec.structs.replace(MONTHLY_SETTINGS, notify=["lead@example.com", "ops-hook"]).to_budget()
    settings = settings_for(port, webhooks=[WebhookSettings(name="ops-hook", url="https://hooks.example/x")])
    notifier = Notifier(settings, transport=hooks)
    # 480 h of Paris's 720-hour November gone, $50.50 spent: the forecast is $75.75, under the limit;
    # at that rate $100 is reached 480 x 100 / 50.50 = 950.5 h in, 9 days after the reset. The mail
    # said "Limit reached at this rate: 2026-12-10T14:29:42+01:00", and the webhook the same
    sent = run_check(path, [budget], settings, "2026-11-20T23:00:00+00:00", notifier=notifier)
    assert [(a.kind, a.threshold) for a, _ in sent] == [("threshold", 50)]
    text = inbox.wait_for(1)[0].get_body(("plain",)).get_content()
    assert "Forecast for the period: $75.75" in text
    assert "Limit reached at this rate: not before the reset" in text
    [message] = posted
    assert message["tokenward"]["forecast_usd"] == "75.75" and message["tokenward"]["runs_out_at"] is None


def test_two_thresholds_crossed_by_one_request_make_one_mail_each_threshold_once(tmp_path, smtp):
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("small", "2026-11-02T09:00:00+00:00", "40.00")])
    assert run_check(path, [MONTHLY], settings_for(port), "2026-11-02T10:00:00+00:00") == []
    seed(path, [cost_row("big", "2026-11-02T11:00:00+00:00", "45.00")])  # 40 % -> 85 %: past 50 and 80
    sent = run_check(path, [MONTHLY], settings_for(port), "2026-11-02T11:01:00+00:00")
    # (85 % spent a day and a half into the month: the forecast is due too)
    assert [(a.kind, a.threshold) for a, _ in sent] == [("threshold", 80), ("forecast", 0)]
    (mail,) = [m for m in inbox.wait_for(2) if "crossed" in m["Subject"]]  # and the forecast, in either order
    assert "(crossed 50%, 80%)" in mail["Subject"]
    claims = [(c.key.kind, c.key.threshold, c.status) for c in DuckLedger(path).state.claims(kind="threshold")]
    assert claims == [("threshold", 50, "sent"), ("threshold", 80, "sent")]
    assert run_check(path, [MONTHLY], settings_for(port), "2026-11-02T12:00:00+00:00") == []


def test_b37_replicas_and_restarts_do_not_resend(tmp_path, smtp):
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    budget = BudgetSettings(
        name="key-6000",
        limit_usd=6000,
        scope={"key": "agent"},
        period="total",
        thresholds=[50, 80],
        notify=["owner@example.com"],
    ).to_budget()
    seed(path, [cost_row("a", "2026-11-01T09:00:00+00:00", "2990")])
    seed(path, [cost_row("b", "2026-11-01T10:00:00+00:00", "30")])  # $2990 -> $3020: crosses 50 %
    # two replicas evaluate the same ledger: the claim is a row, so only one of them sends
    first = run_check(path, [budget], settings_for(port), "2026-11-01T10:00:05+00:00")
    second = run_check(path, [budget], settings_for(port), "2026-11-01T10:00:05+00:00")
    assert len(first) == 1 and second == []
    seed(path, [cost_row("c", "2026-11-02T10:00:00+00:00", "1960")])  # $4980: 83 %
    # a restart at 83 %: the 80 % crossing is new, the 50 % one is not sent again
    sent = run_check(path, [budget], settings_for(port), "2026-11-02T10:00:05+00:00")
    assert [(a.kind, a.threshold) for a, _ in sent] == [("threshold", 80)]
    assert run_check(path, [budget], settings_for(port), "2026-11-03T10:00:00+00:00") == []
    mails = inbox.wait_for(2)
    assert [m["Subject"].rsplit("(", 1)[1] for m in mails] == ["crossed 50%)", "crossed 80%)"]


def test_failed_delivery_is_retried_and_reported(tmp_path, smtp):
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "60.00")])
    posted, hooks = webhook_inbox()
    broken = settings_for(
        free_port(), admins=["ops-hook"], webhooks=[WebhookSettings(name="ops-hook", url="https://hooks.example/x")]
    )
    sent = run_check(path, [MONTHLY], broken, "2026-11-10T10:00:00+00:00", notifier=Notifier(broken, transport=hooks))
    # each alert that could not be mailed is reported to the admins (here a webhook) at once
    assert [a.kind for a, _ in sent] == ["threshold", "delivery_failed", "forecast", "delivery_failed"]
    for _, deliveries in sent[0::2]:
        assert not deliveries[0].ok and deliveries[0].attempts == 2  # retried once, then reported
    assert all(deliveries[0].ok for _, deliveries in sent[1::2])
    assert posted[0]["text"].startswith("*[tokenward] alert delivery failing:")  # Slack-compatible
    history = CliRunner().invoke(main, ["alerts", "history", "--db", str(path)], catch_exceptions=False)
    assert "pending" in history.output and "failed" in history.output and "research-monthly" in history.output
    # the mail server is back: the pending alert goes out once, and the failure alert is not repeated
    working = settings_for(
        port, admins=["ops-hook"], webhooks=[WebhookSettings(name="ops-hook", url="https://hooks.example/x")]
    )
    again = run_check(
        path, [MONTHLY], working, "2026-11-10T10:05:00+00:00", notifier=Notifier(working, transport=hooks)
    )
    assert [(a.kind, d[0].ok) for a, d in again] == [("threshold", True), ("forecast", True)]
    assert len(inbox.wait_for(2)) == 2 and len(posted) == 2
    assert run_check(path, [MONTHLY], working, "2026-11-10T10:10:00+00:00") == []


def test_forecast_refusals_and_unpriced_models(tmp_path, smtp):
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    blocking = BudgetSettings(
        name="daily-cap", limit_usd=10, period="day", thresholds=[100], action="block", notify=["lead@example.com"]
    ).to_budget()
    seed(
        path,
        [
            cost_row("a", "2026-11-10T01:00:00+00:00", "4.00"),  # $4 by 06:00: on course for $16 by midnight
            make_row(
                "r",
                started_at=dt.datetime.fromisoformat("2026-11-10T05:00:00+00:00").timestamp(),
                ended_at=0.0,
                outcome="rejected",
                price_status="not_billed",
                cost_usd=Decimal(0),
                error="Budget 'daily-cap' (all traffic) has $0 left",
            ),
            make_row(
                "u",
                started_at=dt.datetime.fromisoformat("2026-11-10T02:00:00+00:00").timestamp(),
                ended_at=0.0,
                provider="acme",
                served_model="acme-9",
                price_status="unpriced",
                cost_usd=None,
                input_tokens=5,
            ),
        ],
    )
    sent = run_check(path, [blocking], settings_for(port, admins=["ops@example.com"]), "2026-11-10T06:00:00+00:00")
    kinds = sorted((a.kind, a.targets) for a, _ in sent)
    assert kinds == [
        ("forecast", ("lead@example.com",)),
        ("refusing", ("lead@example.com", "ops@example.com")),  # refusals break traffic: admins hear too
        ("unpriced_model", ("ops@example.com",)),
    ]
    subjects = sorted({m["Subject"] for m in inbox.wait_for(4)})
    refusals = [m["To"] for m in inbox.messages if "refused" in m["Subject"]]
    assert sorted(refusals) == ["lead@example.com", "ops@example.com"]  # one mail to each
    assert subjects[0] == (
        "[tokenward] budget daily-cap: 40.00% of $10.00 (projected to reach $16.00 by 2026-11-11T00:00:00+00:00)"
    )
    assert subjects[1] == "[tokenward] budget daily-cap: 40.00% of $10.00 (requests are being refused)"
    assert subjects[2] == "[tokenward] no price for model acme-9 (acme): 1 request(s) recorded without a cost"


def test_digest_is_sent_once_per_period(tmp_path, smtp):
    from tokenward.proxy.scheduler import send_digest

    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    seed(
        path, [cost_row("a", "2026-11-09T10:00:00+00:00", "12.50"), cost_row("b", "2026-11-09T11:00:00+00:00", "0.25")]
    )
    settings = settings_for(port, digest=DigestSettings(to=["lead@example.com"], every="daily", at="08:00"))
    ledger = DuckLedger(path)
    now = dt.datetime(2026, 11, 10, 8, 0, tzinfo=UTC)
    assert asyncio.run(send_digest(ledger, [MONTHLY], settings, Notifier(settings), now=now))
    assert not asyncio.run(send_digest(ledger, [MONTHLY], settings, Notifier(settings), now=now))  # once
    (mail,) = inbox.wait_for(1)
    assert mail["Subject"] == "[tokenward] daily spend 2026-11-09: $12.75 over 2 requests"
    assert "research-monthly: $12.75 of $100.00 (12.75%)" in mail.get_body(("plain",)).get_content()


def test_alerts_test_command(smtp, tmp_path):
    inbox, port = smtp
    config = tmp_path / "c.yaml"
    config.write_text(
        f"upstreams: [{{name: a, base_url: 'http://x'}}]\n"
        f"alerts: {{smtp: {{host: 127.0.0.1, port: {port}, security: none}}}}\n"
    )
    result = CliRunner().invoke(
        main, ["alerts", "test", "--to", "me@example.com", "--config", str(config)], catch_exceptions=False
    )
    assert result.output.strip() == "email me@example.com: ok"
    assert inbox.wait_for(1)[0]["Subject"] == "[tokenward] test alert"


def test_proxy_mails_soon_after_a_threshold_is_crossed(start_proxy, simulator, smtp, monkeypatch):
    from .test_budgets import budget_proxy, long_prompt_request, register

    monkeypatch.setenv("SIM_UPSTREAM_KEY", "sk-upstream")
    inbox, port = smtp
    request = long_prompt_request(1000, 1000)
    register(simulator, "alerting", request, prompt_tokens=1007, completion_tokens=1000)
    # each request: $0.0125175; the budget is $0.05, so the 50 % alert fires on the second request
    # a total budget has no forecast (a daily one would also forecast, depending on the time of day)
    budget = BudgetSettings(name="tiny", limit_usd="0.05", period="total", notify=["lead@example.com"])
    proxy = budget_proxy(start_proxy, simulator, [budget], alerts=settings_for(port, evaluate_every_s=3600))
    for _ in range(2):
        reply = httpx.post(
            f"{proxy.url}/v1/chat/completions",
            json=request,
            headers={"authorization": "Bearer tw-agent-key-0001", RECORD_HEADER: "alerting"},
        )
        assert reply.status_code == 200
    # the scheduled check runs every hour here, but a crossing brings it forward (after the next flush)
    (mail,) = inbox.wait_for(1, timeout=15)
    assert mail["Subject"] == "[tokenward] budget tiny: 50.07% of $0.05 (crossed 50%)"
    assert len(inbox.wait_for(2, timeout=1.0)) == 1


def test_rolling_budgets_alert_once_and_again_only_after_falling_back(tmp_path, smtp):
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    budget = BudgetSettings(
        name="last-2h", limit_usd=1, period="rolling", rolling_hours=2, thresholds=[50], notify=["lead@example.com"]
    ).to_budget()
    seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "0.60")])
    assert [a.kind for a, _ in run_check(path, [budget], settings_for(port), "2026-11-10T10:00:00+00:00")] == [
        "threshold"
    ]
    # the window moves every minute, but the alert is not sent again while spend stays above 50 %
    for now in ("2026-11-10T10:01:00+00:00", "2026-11-10T10:30:00+00:00", "2026-11-10T10:59:00+00:00"):
        assert run_check(path, [budget], settings_for(port), now) == []
    # 11:01: the $0.60 has left the window (0 %): re-armed; a new $0.55 at 11:05 crosses again
    assert run_check(path, [budget], settings_for(port), "2026-11-10T11:01:00+00:00") == []
    seed(path, [cost_row("b", "2026-11-10T11:05:00+00:00", "0.55")])
    assert len(run_check(path, [budget], settings_for(port), "2026-11-10T11:06:00+00:00")) == 1
    assert run_check(path, [budget], settings_for(port), "2026-11-10T11:07:00+00:00") == []
    assert [m["Subject"] for m in inbox.wait_for(2)] == [
        "[tokenward] budget last-2h: 60.00% of $1.00 (crossed 50%)",
        "[tokenward] budget last-2h: 55.00% of $1.00 (crossed 50%)",
    ]


def test_a_failing_target_does_not_make_the_others_hear_it_twice(tmp_path, smtp):
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    budget = BudgetSettings(
        name="b", limit_usd=10, period="total", thresholds=[50], notify=["lead@example.com", "ops-hook"]
    ).to_budget()
    seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "6")])
    hook = WebhookSettings(name="ops-hook", url_env="TW_TEST_UNSET_HOOK")  # the variable is not set: it fails
    settings = settings_for(port, webhooks=[hook])
    first = run_check(path, [budget], settings, "2026-11-10T10:00:00+00:00")
    assert [(d.channel, d.ok) for d in first[0][1]] == [("email", True), ("webhook", False)]
    again = run_check(path, [budget], settings, "2026-11-10T10:01:00+00:00")
    assert [a.targets for a, _ in again] == [("ops-hook",)]  # the mail went out already: only the hook is retried
    assert len(inbox.wait_for(2, timeout=0.5)) == 1


def test_small_amounts_and_quoted_names_and_no_smtp(tmp_path, smtp):
    from tokenward.reports.budget_check import usd

    assert [usd(Decimal(v)) for v in ("0", "0.05", "0.0012", "0.000125", "1.5", "1234.567")] == [
        "$0.00",
        "$0.05",
        "$0.0012",
        "$0.000125",
        "$1.50",
        "$1,234.57",
    ]
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    budget = BudgetSettings(
        name="bob's budget",
        limit_usd="0.002",
        period="day",
        thresholds=[100],
        action="block",
        notify=["lead@example.com"],
    ).to_budget()
    refusal = 'Budget "bob\'s budget" (all traffic) has $0 left of $0.002 this period; ...'
    seed(
        path,
        [
            make_row(
                "r",
                started_at=dt.datetime.fromisoformat("2026-11-10T05:00:00+00:00").timestamp(),
                ended_at=0.0,
                outcome="rejected",
                price_status="not_billed",
                cost_usd=Decimal(0),
                error=refusal,
            )
        ],
    )
    sent = run_check(path, [budget], settings_for(port), "2026-11-10T06:00:00+00:00")
    assert [a.kind for a, _ in sent] == ["refusing"]
    assert (
        inbox.wait_for(1)[0]["Subject"]
        == "[tokenward] budget bob's budget: 0.00% of $0.002 (requests are being refused)"
    )
    no_smtp = AlertSettings(retries=3, backoff_s=5)
    started = time.monotonic()
    (delivery,) = asyncio.run(Notifier(no_smtp).send(sent[0][0]))
    assert not delivery.ok and delivery.attempts == 0 and "no SMTP server" in delivery.error
    assert time.monotonic() - started < 1  # a configuration problem is not retried with backoff


def test_mails_carry_date_and_message_id_headers(smtp):
    inbox, port = smtp
    notifier = Notifier(settings_for(port))
    alert = Alert("b", None, "threshold", 50, "[tokenward] s", "text", "<p>html</p>", ("a@example.com",))
    before = dt.datetime.now(UTC).replace(microsecond=0)
    for _ in range(2):
        (delivery,) = asyncio.run(notifier.send(alert))
        assert delivery.ok
    first, second = inbox.wait_for(2)
    sent = email.utils.parsedate_to_datetime(first["Date"])
    assert sent.utcoffset() == dt.timedelta(0) and before <= sent <= dt.datetime.now(UTC)
    ids = [m["Message-ID"] for m in (first, second)]
    # the same alert to the same recipient: the same id, so a resend after a crash is recognisable
    assert all(i.startswith("<") and i.endswith("@test>") for i in ids) and ids[0] == ids[1]
    other = Alert("b", None, "threshold", 80, "[tokenward] s", "text", "<p>html</p>", ("a@example.com",))
    assert message_id(other, "a@example.com", "x@test") != ids[0]
    assert message_id(alert, "b@example.com", "x@test") != ids[0]


EVIL_MODEL = "evil\r\nBcc: victim@example.com\r\n\r\n<!channel> <https://phish.example|docs> \u202etxt.exe"


def test_control_characters_in_model_names_reach_no_header_and_no_forged_line(tmp_path, smtp):
    inbox, port = smtp
    posted, hooks = webhook_inbox()
    path = tmp_path / "l.duckdb"
    budget = BudgetSettings(name="all", limit_usd=10, period="total", thresholds=[50], notify=["lead@example.com"])
    seed(
        path,
        [
            cost_row("a", "2026-11-10T09:00:00+00:00", "6", model=EVIL_MODEL, key="agent\nBcc: x@example.com"),
            make_row(
                "u",
                started_at=dt.datetime.fromisoformat("2026-11-10T02:00:00+00:00").timestamp(),
                ended_at=0.0,
                provider="acme",
                served_model=EVIL_MODEL,
                price_status="unpriced",
                cost_usd=None,
                input_tokens=5,
            ),
        ],
    )
    settings = settings_for(
        port,
        admins=["ops@example.com", "ops-hook"],
        webhooks=[WebhookSettings(name="ops-hook", url="https://hooks.example/x")],
    )
    notifier = Notifier(settings, transport=hooks)
    sent = run_check(path, [budget.to_budget()], settings, "2026-11-10T10:00:00+00:00", notifier=notifier)
    assert sorted(a.kind for a, _ in sent) == ["threshold", "unpriced_model"]
    assert all(d.ok for _, deliveries in sent for d in deliveries)  # every mail and hook went out
    shown = "evil\\x0d\\x0aBcc: victim@example.com\\x0d\\x0a\\x0d\\x0a<!channel> <https://phish.example|docs> \\u202etxt.exe"
    mails = {m["To"]: m for m in inbox.wait_for(2)}
    unpriced = mails["ops@example.com"]
    assert unpriced["Subject"] == f"[tokenward] no price for model {shown} (acme): 1 request(s) recorded without a cost"
    assert unpriced["Bcc"] is None and mails["lead@example.com"]["Bcc"] is None
    assert f"Model: {shown}" in unpriced.get_body(("plain",)).get_content().splitlines()
    threshold = mails["lead@example.com"].get_body(("plain",)).get_content().splitlines()
    assert f"  {shown}: $6.00" in threshold and "  agent\\x0aBcc: x@example.com: $6.00" in threshold
    [message] = posted
    assert "<!channel>" not in message["text"] and "<https://phish" not in message["text"]
    assert "&lt;!channel&gt; &lt;https://phish.example|docs&gt;" in message["text"]
    assert "\r" not in message["text"].split("\n", 1)[0]  # the title line is one line
    assert message["tokenward"]["model"] == EVIL_MODEL  # the structured payload keeps the exact name


def test_a_stored_subject_with_a_line_break_is_still_mailed(smtp):
    from tokenward.reports.alerts import Alert

    inbox, port = smtp
    alert = Alert(
        "b",
        None,
        "threshold",
        50,
        "[tokenward] budget x\r\nBcc: y@example.com",
        "text",
        "<p>html</p>",
        ("a@example.com",),
    )
    [delivery] = asyncio.run(Notifier(settings_for(port)).send(alert))
    assert delivery.ok, delivery.error
    [mail] = inbox.wait_for(1)
    assert mail["Subject"] == "[tokenward] budget x\\x0d\\x0aBcc: y@example.com" and mail["Bcc"] is None


def test_a_threshold_crossed_while_mail_is_down_is_mailed_once_mail_is_back(tmp_path, smtp):
    """50 % already reached lead@; SMTP is down when 80 % is crossed: the 80 % alert stays due."""
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-11-02T09:00:00+00:00", "55.00")])
    first = run_check(path, [MONTHLY], settings_for(port), "2026-11-02T10:00:00+00:00")
    assert [a.thresholds for a, _ in first] == [(50,), (0,)]  # 55 % on the month's second day: and the forecast
    seed(path, [cost_row("b", "2026-11-02T11:00:00+00:00", "30.00")])  # 85 %: past 80
    down = settings_for(free_port())
    failed = run_check(path, [MONTHLY], down, "2026-11-02T11:01:00+00:00")
    assert [(a.thresholds, d[0].ok) for a, d in failed] == [((80,), False)]
    state = DuckLedger(path).state
    assert [(c.key.threshold, c.status) for c in state.claims(kind="threshold")] == [(50, "sent"), (80, "pending")]
    # the same address already has the 50 % mail: that must not count as having the 80 % one
    again = run_check(path, [MONTHLY], settings_for(port), "2026-11-02T11:05:00+00:00")
    assert [(a.thresholds, a.targets, d[0].ok) for a, d in again] == [((80,), ("lead@example.com",), True)]
    # the first check's two alerts (50 % and the forecast) go out together, in either order; then the 80 %
    subjects = [m["Subject"].rsplit("(", 1)[1] for m in inbox.wait_for(3)]
    assert sorted(subjects[:2])[0] == "crossed 50%)" and sorted(subjects[:2])[1].startswith("projected to reach")
    assert subjects[2] == "crossed 80%)"
    assert run_check(path, [MONTHLY], settings_for(port), "2026-11-02T11:10:00+00:00") == []
    assert len(inbox.wait_for(4, timeout=0.5)) == 3


def test_a_reader_holding_the_ledger_delays_and_doubles_no_alert(start_proxy, simulator, smtp, monkeypatch):
    from .test_budgets import budget_proxy, long_prompt_request, register
    from .test_readers_and_replicas import Reader

    monkeypatch.setenv("SIM_UPSTREAM_KEY", "sk-upstream")
    inbox, port = smtp
    request = long_prompt_request(1000, 1000)
    register(simulator, "held", request, prompt_tokens=1007, completion_tokens=1000)
    budget = BudgetSettings(name="tiny", limit_usd="0.05", period="total", notify=["lead@example.com"])
    proxy = budget_proxy(start_proxy, simulator, [budget], alerts=settings_for(port, evaluate_every_s=1))
    headers = {"authorization": "Bearer tw-agent-key-0001", RECORD_HEADER: "held"}
    assert httpx.post(f"{proxy.url}/v1/chat/completions", json=request, headers=headers).status_code == 200
    proxy.rows(1)
    reader = Reader(proxy.ledger)  # from now on the proxy cannot write the DuckDB file
    try:
        reply = httpx.post(f"{proxy.url}/v1/chat/completions", json=request, headers=headers)
        assert reply.status_code == 200  # 2 x $0.0125175 = $0.025035: 50.07 %
        (mail,) = inbox.wait_for(1, timeout=15)  # from the books and the state store: no ledger access needed
        assert mail["Subject"] == "[tokenward] budget tiny: 50.07% of $0.05 (crossed 50%)"
        time.sleep(3.5)  # three more evaluations while the reader still holds the file
        assert len(inbox.messages) == 1
        claims = DuckLedger(proxy.ledger).state.claims(kind="threshold")
        assert [(c.key.threshold, c.status) for c in claims] == [(50, "sent")]
    finally:
        reader.close()


def test_admins_hear_once_of_usage_no_rule_could_repair(tmp_path, smtp):
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    bad = dict(provider="relay", served_model="odd-1", price_status="usage_invalid", cost_usd=None)
    when = dt.datetime.fromisoformat("2026-11-10T02:00:00+00:00").timestamp()
    seed(path, [make_row(f"u{i}", started_at=when + i, ended_at=when + i, **bad) for i in range(2)])
    settings = settings_for(port, admins=["ops@example.com"])
    sent = run_check(path, [], settings, "2026-11-10T06:00:00+00:00")
    assert [(a.kind, a.targets) for a, _ in sent] == [("usage_invalid", ("ops@example.com",))]
    (mail,) = inbox.wait_for(1)
    assert mail["Subject"] == "[tokenward] invalid usage reported for model odd-1 (relay): 2 request(s) recorded without a cost"
    assert "Example request: u0" in mail.get_body(("plain",)).get_content()
    assert run_check(path, [], settings, "2026-11-10T07:00:00+00:00") == []
