"""``tokenward top``: a live terminal view of a running proxy (requests/s, burn, top spenders, budgets).

It reads the proxy's dashboard API (``GET /dashboard/api/state``, see ``proxy/dashboard.py``)
over HTTP rather than the ledger file: while the proxy runs, a reader holding the DuckDB file
would hold up the proxy's writes. It redraws every ``--interval`` seconds with rich's ``Live``;
an unreachable proxy is shown and retried, a refused credential ends it.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import click
import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tokenward.reports.budget_check import usd

__all__ = ["fetch_state", "render", "top"]

_SPARK = "▁▂▃▄▅▆▇█"
_BAR = 24  # budget bars at 100 columns and more; half as wide below


def _local_zone() -> str:
    """The IANA name of this machine's time zone (``TZ``, else ``/etc/localtime``), or ``UTC``."""
    candidates = [os.environ.get("TZ", "").lstrip(":")]
    try:
        candidates.append(str(Path("/etc/localtime").resolve()).split("zoneinfo/", 1)[1])
    except (OSError, IndexError):
        pass
    for name in candidates:
        try:
            if name:
                ZoneInfo(name)
                return name
        except (ZoneInfoNotFoundError, ValueError):
            continue
    return "UTC"


def fetch_state(client: httpx.Client, url: str, tz: str, range_name: str = "today") -> dict[str, Any]:
    """One ``/dashboard/api/state`` document from the proxy at ``url``.

    Raises:
        click.ClickException: the proxy refused the credential (401/403) or the parameters (400).
        httpx.HTTPError: the proxy could not be reached or answered with another error.
    """
    reply = client.get(f"{url.rstrip('/')}/dashboard/api/state", params={"tz": tz, "range": range_name})
    if reply.status_code in (400, 401, 403):
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text[:200]
        if reply.status_code == 401 and "authorization" not in client.headers:
            # the proxy's own advice (a header, the login page) is for browsers and curl
            message += " Give `tokenward top` one with --token or TOKENWARD_ADMIN_TOKEN."
        raise click.ClickException(f"{url}: HTTP {reply.status_code}: {message}")
    reply.raise_for_status()
    state: dict[str, Any] = reply.json()
    return state


def _money(value: str | None) -> Decimal | None:
    return None if value is None else Decimal(value)


def _places(amount: Decimal) -> int:
    shown = usd(amount)
    return len(shown.split(".", 1)[1]) if "." in shown else 0


def _money_column(values: list[str | None]) -> list[str]:
    """Dollar figures with one number of decimal places for the whole column (as ``usd``, at least 2)."""
    amounts = [_money(v) for v in values]
    places = max([2, *(_places(a) for a in amounts if a is not None)])
    return ["–" if a is None else f"${a:,.{places}f}" for a in amounts]


def _clock(value: str | float | None, zone: ZoneInfo) -> str:
    if value is None:
        return "–"
    moment = (
        dt.datetime.fromtimestamp(value, dt.UTC)
        if isinstance(value, int | float)
        else dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    )
    local = moment.astimezone(zone)
    return local.strftime("%H:%M:%S") if local.date() == dt.datetime.now(zone).date() else local.strftime("%b %d %H:%M")


def _spark(points: list[dict[str, Any]]) -> str:
    costs = [Decimal(p["cost_usd"]) for p in points]
    top = max(costs, default=Decimal(0))
    if top <= 0:
        return _SPARK[0] * len(costs)
    return "".join(_SPARK[min(len(_SPARK) - 1, int(c / top * (len(_SPARK) - 1) + Decimal("0.5")))] for c in costs)


def _bar(percent: Decimal, thresholds: list[int], size: int) -> Text:
    filled = int(min(percent, Decimal(100)) / 100 * size)
    style = "red" if percent >= 100 else ("yellow" if any(t < 100 and percent >= t for t in thresholds) else "green")
    return Text("█" * filled, style=style) + Text("░" * (size - filled), style="dim")


def _runs_out(budget: dict[str, Any], zone: ZoneInfo) -> str:
    if Decimal(budget["remaining_usd"]) <= 0:
        return "limit reached"
    if budget["runs_out_at"]:
        return _clock(budget["runs_out_at"], zone)
    if Decimal(budget["burn_usd_per_hour"]) > 0:
        return "not before reset" if budget["resets_at"] else "not at this rate"
    return "–"


def _groups_table(title: str, groups: list[dict[str, Any]], limit: int) -> Table:
    table = Table(title=title, title_justify="left", expand=True, box=None, padding=(0, 1))
    table.add_column("name", overflow="ellipsis", no_wrap=True, ratio=1)
    table.add_column("cost", justify="right", no_wrap=True)
    table.add_column("req", justify="right", no_wrap=True)
    shown = groups[:limit]
    for group, cost in zip(shown, _money_column([g["cost_usd"] for g in shown]), strict=True):
        table.add_row(str(group["name"]), cost, f"{group['requests']:,}")
    if not shown:
        table.add_row(Text("nothing yet", style="dim"), "", "")
    return table


def render(state: dict[str, Any], url: str, *, width: int = 80, error: str | None = None) -> RenderableType:
    """The screen for one state document (see ``Dashboard.state``), ``width`` columns wide."""
    zone = ZoneInfo(state["tz"])
    live, ledger = state["live"], state.get("ledger") or {}
    today, hour = ledger.get("today") or {}, ledger.get("this_hour") or {}
    head = Text.assemble(
        ("tokenward top ", "bold"),
        (f"{url}  {_clock(state['now'], zone)} {state['tz']}", "dim"),
        (f"  ledger {_clock(ledger.get('as_of'), zone)}" if ledger.get("as_of") else "  ledger not read yet", "dim"),
    )
    if error:
        head.append(f"\n{error}", style="bold red")
    figures = Table.grid(padding=(0, 2), expand=False)
    for _ in range(4):
        figures.add_column(no_wrap=True)
    figures.add_row(
        Text.assemble(("today ", "dim"), (usd(Decimal(today.get("cost_usd") or 0)), "bold")),
        Text.assemble(("this hour ", "dim"), (usd(Decimal(hour.get("cost_usd") or 0)), "bold")),
        Text.assemble(("burn ", "dim"), (f"{usd(Decimal(live['burn_usd_per_min']))}/min", "bold")),
        Text.assemble(("", "dim"), (f"{usd(Decimal(live['burn_usd_per_hour']))}/h", "bold")),
    )
    figures.add_row(
        Text.assemble(("req/s ", "dim"), (live["requests_per_s"], "bold")),
        Text.assemble(("requests today ", "dim"), (f"{today.get('requests') or 0:,}", "bold")),
        Text.assemble(("cache saved ", "dim"), usd(Decimal(today.get("cache_savings_usd") or 0))),
        Text.assemble(("unpriced ", "dim"), f"{today.get('unpriced_requests') or 0:,}"),
    )
    spark = Text.assemble(
        ("last hour per minute ", "dim"), (_spark(live["per_minute"][-min(60, width - 30) :]), "cyan")
    )
    parts: list[RenderableType] = [head, figures, spark]

    limit = 5
    models = _groups_table("top models (today)", ledger.get("by_model") or [], limit)
    keys = _groups_table("top keys (today)", ledger.get("by_key") or [], limit)
    if width >= 100:
        pair = Table.grid(expand=True, padding=(0, 2))
        pair.add_column(ratio=1)
        pair.add_column(ratio=1)
        pair.add_row(models, keys)
        parts.append(pair)
    else:
        parts += [models, keys]

    budgets = state.get("budgets") or []
    table = Table(title="budgets", title_justify="left", expand=True, box=None, padding=(0, 1))
    table.add_column("budget", overflow="ellipsis", no_wrap=True, ratio=1, min_width=8)
    table.add_column("used", no_wrap=True)
    table.add_column("%", justify="right", no_wrap=True)
    table.add_column("spent", justify="right", no_wrap=True)
    table.add_column("limit", justify="right", no_wrap=True)
    table.add_column("forecast", justify="right", no_wrap=True)
    table.add_column("runs out", no_wrap=True)
    spent = _money_column([b["spent_usd"] for b in budgets])
    limits = _money_column([b["limit_usd"] for b in budgets])
    forecasts = _money_column([b["forecast_usd"] for b in budgets])
    for i, budget in enumerate(budgets):
        percent = Decimal(budget["percent"])
        table.add_row(
            budget["budget"],
            _bar(percent, budget["thresholds"], _BAR if width >= 100 else _BAR // 2),
            f"{percent:.1f}%",
            spent[i],
            limits[i],
            forecasts[i],
            _runs_out(budget, zone),
        )
    if not budgets:
        table.add_row(Text("no budgets configured", style="dim"), "", "", "", "", "", "")
    parts.append(table)

    recent = Table(title="last requests", title_justify="left", expand=True, box=None, padding=(0, 1))
    recent.add_column("time", no_wrap=True)
    recent.add_column("key", overflow="ellipsis", no_wrap=True, ratio=1)
    recent.add_column("model", overflow="ellipsis", no_wrap=True, ratio=2)
    recent.add_column("st", justify="right", no_wrap=True)
    recent.add_column("tokens", justify="right", no_wrap=True)
    recent.add_column("cost", justify="right", no_wrap=True)
    rows = live["recent"][:6]
    for row, cost in zip(rows, _money_column([r["cost_usd"] for r in rows]), strict=True):
        recent.add_row(
            _clock(row["ended_at"], zone),
            str(row["principal"]),
            str(row["served_model"] or row["requested_model"] or "–"),
            str(row["http_status"] or "–"),
            f"{row['input_tokens'] or 0:,}/{row['output_tokens'] or 0:,}",
            cost,
        )
    parts.append(recent)
    return Panel(Group(*parts), padding=(0, 1), subtitle="Ctrl-C to quit", subtitle_align="right")


@click.command()
@click.option(
    "--url", default="http://127.0.0.1:4000", show_default=True, envvar="TOKENWARD_URL", help="The proxy's base URL."
)
@click.option(
    "--token",
    envvar="TOKENWARD_ADMIN_TOKEN",
    help="Admin token or admin virtual key (default: $TOKENWARD_ADMIN_TOKEN; not needed on the proxy's own "
    "machine in passthrough mode without an admin token).",
)
@click.option(
    "--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.2), help="Seconds between updates."
)
@click.option("--tz", default=None, help="IANA time zone for 'today' and clock times (default: this machine's).")
@click.option("--once", is_flag=True, help="Print one screen and exit (no live updates).")
def top(url: str, token: str | None, interval: float, tz: str | None, once: bool) -> None:
    """Watch a running proxy live: requests/s, $/min and $/hour burn, top models and keys, budgets."""
    zone = tz or _local_zone()
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise click.BadParameter(f"unknown time zone {zone!r}", param_hint="--tz") from exc
    headers = {"authorization": f"Bearer {token}"} if token else {}
    console = Console()
    with httpx.Client(headers=headers, timeout=10, trust_env=False) as client:
        if once:
            try:
                first = fetch_state(client, url, zone)
            except httpx.HTTPError as exc:
                raise click.ClickException(f"cannot reach the proxy at {url}: {exc}") from exc
            console.print(render(first, url, width=console.width))
            return
        state: dict[str, Any] | None = None
        stop = _stop_on_ctrl_c()
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while not stop.is_set():
                error = None
                try:
                    state = fetch_state(client, url, zone)
                except httpx.HTTPError as exc:
                    error = f"cannot reach the proxy at {url}: {exc}; retrying every {interval:g} s"
                if state is not None:
                    live.update(render(state, url, width=console.width, error=error), refresh=True)
                else:
                    live.update(Text(error or "", style="bold red"), refresh=True)
                stop.wait(interval)


def _stop_on_ctrl_c() -> threading.Event:
    """An event Ctrl-C (SIGINT) sets, instead of a ``KeyboardInterrupt`` raised wherever the loop is.

    Raised inside an HTTP request, the interrupt can leave httpcore's pool lock taken and the
    client's close then waits on it for ever (encode/httpcore#990, #996): Ctrl-C would not quit.
    SIGINT is also unblocked and given a handler even if the parent ignored or blocked it (both
    are inherited across exec), since a terminal view must quit on Ctrl-C.
    """
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    return stop
