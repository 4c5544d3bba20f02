"""A webhook that hangs delays no one else's alert: real SMTP (aiosmtpd), a real socket that never answers."""

from __future__ import annotations

import threading

from tokenward.pricing.settings import BudgetSettings
from tokenward.reports.alerts import AlertSettings, Notifier, SmtpSettings, WebhookSettings

from .test_alert_delivery_races import DrippingReceiver
from .test_alerts import cost_row, run_check, seed, smtp  # noqa: F401 - smtp: the fixture


def _budget(name: str, notify: list[str]):
    return BudgetSettings(
        name=name, limit_usd=100, scope={"team": "research"}, period="total", notify=notify
    ).to_budget()


def test_mail_is_not_held_behind_a_webhook_that_hangs(tmp_path, smtp):  # noqa: F811
    """Two budgets cross 50 % in one check ($60 of $100 each). The first notifies a webhook that
    answers one byte every 0.3 s for 300 s (within its 30 s timeout_s, twice: 60 s) and lead@; the
    second lead@. Both mails must arrive while the webhook is still hanging. Before, targets and
    alerts were sent one after the other: both mails waited a minute behind the webhook."""
    inbox, port = smtp
    path = tmp_path / "l.duckdb"
    seed(path, [cost_row("a", "2026-11-10T09:00:00+00:00", "60.00")])
    hook = DrippingReceiver("http")
    settings = AlertSettings(
        smtp=SmtpSettings(host="127.0.0.1", port=port, security="none", sender="tokenward@test"),
        webhooks=[WebhookSettings(name="ops", url=f"http://127.0.0.1:{hook.port}/hook", timeout_s=30)],
        retries=1,
        backoff_s=0.01,
    )
    budgets = [_budget("first", ["ops", "lead@example.com"]), _budget("second", ["lead@example.com"])]
    result: list = []
    check = threading.Thread(
        target=lambda: result.extend(
            run_check(path, budgets, settings, "2026-11-10T10:00:00+00:00", notifier=Notifier(settings))
        )
    )
    check.start()
    try:
        mails = inbox.wait_for(2, timeout=20)
        assert sorted(str(m["Subject"]) for m in mails) == [
            "[tokenward] budget first: 60.00% of $100.00 (crossed 50%)",
            "[tokenward] budget second: 60.00% of $100.00 (crossed 50%)",
        ]
        assert check.is_alive() and hook.requests == 1  # the webhook's first attempt is still hanging
    finally:
        hook.close()  # it hangs up: the attempt fails, the second is refused, the check ends
        check.join(60)
    assert not check.is_alive()
    outcomes = sorted((alert.budget, d.target, d.ok) for alert, deliveries in result for d in deliveries)
    assert outcomes == [
        ("first", "lead@example.com", True),
        ("first", "ops", False),
        ("second", "lead@example.com", True),
    ]
