// tokenward dashboard: polls /dashboard/api/state every 2 s and draws it.
// Every value from the API is put into the page as text (textContent), never as HTML:
// model names, keys and teams are whatever clients sent.
"use strict";

(function () {
  const POLL_MS = 2000;
  const params = new URLSearchParams(location.search);
  const tz = params.get("tz") || Intl.DateTimeFormat().resolvedOptions().timeZone || "UTC";
  let range = (location.hash.match(/range=([\w]+)/) || [])[1] || "today";
  const seen = new Map(); // request id -> when it first appeared (rows newer than 3 s are highlighted)
  let firstDraw = true;
  const charts = {};

  // ---- formatting -------------------------------------------------------------------------
  // Dollars: cents from $1 up; below $1 the significant digits, at most 6 places (as `tokenward report`).
  // Amounts arrive as exact decimal strings ("0.000797500000") and are rounded as strings, half to
  // even like Python's Decimal, so that a figure never depends on binary floating point.
  function roundDecimal(text, p) {
    let s = String(text).trim();
    const negative = s.startsWith("-");
    if (negative || s.startsWith("+")) s = s.slice(1);
    const parts = s.split(".");
    const whole = parts[0] || "0";
    const frac = (parts[1] || "").padEnd(p + 1, "0");
    let digits = (whole + frac.slice(0, p)).split("").map(Number);
    const first = Number(frac[p]);
    const tail = /[1-9]/.test(frac.slice(p + 1));
    if (first > 5 || (first === 5 && (tail || digits[digits.length - 1] % 2 === 1))) {
      let i = digits.length - 1;
      while (i >= 0 && digits[i] === 9) { digits[i] = 0; i -= 1; }
      if (i < 0) digits.unshift(1); else digits[i] += 1;
    }
    const cut = digits.length - p;
    const intPart = digits.slice(0, cut).join("").replace(/^0+(?=\d)/, "") || "0";
    const fracPart = digits.slice(cut).join("");
    const zero = /^0*$/.test(intPart + fracPart);
    return { negative: negative && !zero, intPart: intPart, fracPart: fracPart };
  }
  function places(s) {
    if (s === null || s === undefined) return 0;
    const r = roundDecimal(s, 6);
    if (r.intPart !== "0" || /^0*$/.test(r.fracPart)) return 2;
    return Math.max(2, r.fracPart.replace(/0+$/, "").length);
  }
  function usd(s, p) {
    if (s === null || s === undefined) return "–";
    const r = roundDecimal(s, p === undefined ? places(s) : p);
    const grouped = r.intPart.replace(/\B(?=(\d{3})+(?!\d))/g, ",");
    return (r.negative ? "-$" : "$") + grouped + (r.fracPart ? "." + r.fracPart : "");
  }
  // one number of decimal places per column, so that the figures line up
  function usdColumn(values) {
    const p = Math.max(2, ...values.filter((v) => v !== null && v !== undefined).map(places));
    return values.map((v) => usd(v, p));
  }
  function int(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }
  function pct(ratio) { return ratio === null || ratio === undefined ? "–" : (Number(ratio) * 100).toFixed(1) + "%"; }
  const timeFmt = new Intl.DateTimeFormat("en-GB", { timeZone: tz, hour: "2-digit", minute: "2-digit", second: "2-digit", hourCycle: "h23" });
  const dayTimeFmt = new Intl.DateTimeFormat("en-GB", { timeZone: tz, month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", hourCycle: "h23" });
  const dayFmt = new Intl.DateTimeFormat("en-CA", { timeZone: tz, year: "numeric", month: "2-digit", day: "2-digit" });
  function toDate(v) { return typeof v === "number" ? new Date(v * 1000) : new Date(v); }
  function clock(v) { return v === null || v === undefined ? "–" : timeFmt.format(toDate(v)); }
  function when(v) {
    if (v === null || v === undefined) return "–";
    const d = toDate(v);
    return dayFmt.format(d) === dayFmt.format(new Date()) ? timeFmt.format(d).slice(0, 5) : dayTimeFmt.format(d);
  }
  function duration(seconds) {
    const m = Math.round(seconds / 60);
    if (m < 1) return "under a minute";
    if (m < 60) return m + " min";
    const h = Math.floor(m / 60);
    if (h < 48) return h + " h " + (m % 60) + " min";
    return Math.round(h / 24) + " days";
  }
  // axis ticks: as many decimals as the tick spacing needs, so labels never repeat
  function tickUsd(v, incr) {
    const d = Math.min(8, Math.max(2, Math.ceil(-Math.log10(incr || 1) + 1e-9)));
    return "$" + v.toFixed(d);
  }

  // ---- DOM helpers ------------------------------------------------------------------------
  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function setText(id, text) { document.getElementById(id).textContent = text; }
  function badge(text, cls) { return el("span", text, "badge" + (cls ? " " + cls : "")); }
  function fill(tbody, rows) { tbody.replaceChildren(...rows); }

  // ---- charts -----------------------------------------------------------------------------
  function makeChart(id, opts) {
    const box = document.getElementById(id);
    if (typeof uPlot === "undefined") return null;
    const width = Math.max(280, box.clientWidth);
    const base = {
      width: width, height: 200, legend: { show: false }, cursor: { points: { show: false } },
      tzDate: (ts) => uPlot.tzDate(new Date(ts * 1e3), tz),
      scales: { y: { range: (u, min, max) => [0, max > 0 ? max * 1.15 : 0.01] } },
      axes: [
        opts.xAxis || { stroke: "#888", grid: { show: false } },
        { stroke: "#888", size: 78, grid: { stroke: "rgba(128,128,128,.18)" },
          values: (u, splits, ax, space, incr) => splits.map((v) => tickUsd(v, incr)) },
      ],
      series: [{}, { label: "USD", stroke: "#3b6fd8", fill: "rgba(59,111,216,.55)", width: 1,
        paths: uPlot.paths.bars({ size: [0.8, 40] }), points: { show: false } }],
    };
    if (opts.scalesX) base.scales.x = opts.scalesX;
    const chart = new uPlot(base, [[], []], box);
    new ResizeObserver(() => chart.setSize({ width: Math.max(280, box.clientWidth), height: 200 })).observe(box);
    return chart;
  }
  function drawCharts(state) {
    const hhmm = { stroke: "#888", grid: { show: false }, values: (u, splits) => splits.map((v) => clock(v).slice(0, 5)) };
    if (!charts.minute) charts.minute = makeChart("chart-minute", { xAxis: hhmm });
    if (!charts.hour) charts.hour = makeChart("chart-hour", { xAxis: hhmm });
    if (!charts.day) {
      charts.day = makeChart("chart-day", {
        scalesX: { time: false },
        xAxis: { stroke: "#888", grid: { show: false },
          values: (u, splits) => splits.map((i) => (charts.dayLabels && charts.dayLabels[i]) || "") },
      });
    }
    const minutes = state.live.per_minute;
    if (charts.minute) charts.minute.setData([minutes.map((m) => m.t), minutes.map((m) => Number(m.cost_usd))]);
    const ledger = state.ledger;
    if (ledger && ledger.hourly && charts.hour) {
      charts.hour.setData([ledger.hourly.map((h) => h.t), ledger.hourly.map((h) => Number(h.cost_usd || 0))]);
    }
    if (ledger && ledger.daily && charts.day) {
      charts.dayLabels = ledger.daily.map((d) => d.day.slice(5));
      charts.day.setData([ledger.daily.map((d, i) => i), ledger.daily.map((d) => Number(d.cost_usd || 0))]);
    }
  }

  // ---- sections ---------------------------------------------------------------------------
  function drawTiles(state) {
    const live = state.live;
    setText("burn-min", usd(live.burn_usd_per_min));
    setText("burn-hour", usd(live.burn_usd_per_hour));
    setText("rps", Number(live.requests_per_s).toFixed(2));
    const ledger = state.ledger;
    if (ledger && ledger.today) {
      setText("today-cost", usd(ledger.today.cost_usd || "0"));
      setText("today-requests", int(ledger.today.requests) + " requests" +
        (ledger.today.unpriced_requests ? ", " + int(ledger.today.unpriced_requests) + " unpriced" : ""));
      setText("hour-cost", usd(ledger.this_hour.cost_usd || "0"));
      setText("hour-requests", int(ledger.this_hour.requests) + " requests");
      setText("savings-today", usd(ledger.today.cache_savings_usd || "0"));
      setText("hit-rate", "cache hit rate " + pct(ledger.today.cache_hit_rate));
    }
  }

  function meter(percent, thresholds) {
    const box = el("div", null, "meter");
    const p = Number(percent);
    const fillBar = el("div", null, "fill" + (p >= 100 ? " bad" : thresholds.some((t) => t < 100 && p >= t) ? " warn" : ""));
    fillBar.style.width = Math.min(100, Math.max(0, p)) + "%";
    box.append(fillBar);
    for (const t of thresholds) {
      if (t > 0 && t < 100) {
        const tick = el("span", null, "tick");
        tick.style.left = t + "%";
        tick.title = t + "%";
        box.append(tick);
      }
    }
    return box;
  }
  function runsOut(b, now) {
    if (Number(b.remaining_usd) <= 0) return [badge("limit reached", "bad")];
    if (b.runs_out_at) {
      const secs = (new Date(b.runs_out_at) - now) / 1000;
      return [el("span", when(b.runs_out_at)), el("span", " (in " + duration(secs) + ")", "note")];
    }
    if (Number(b.burn_usd_per_hour) > 0) return [el("span", b.resets_at ? "not before reset" : "not at this rate", "note")];
    return [el("span", "not at the current rate", "note")];
  }
  function drawBudgets(state) {
    const budgets = state.budgets;
    document.getElementById("no-budgets").hidden = budgets.length > 0;
    const now = new Date(state.now);
    const spent = usdColumn(budgets.map((b) => b.spent_usd));
    const limit = usdColumn(budgets.map((b) => b.limit_usd));
    const held = usdColumn(budgets.map((b) => b.reserved_usd));
    const forecast = usdColumn(budgets.map((b) => b.forecast_usd));
    const rows = budgets.map((b, i) => {
      const tr = el("tr");
      tr.dataset.budget = b.budget;
      const name = el("td", b.budget);
      if (b.action === "block") name.append(badge("blocks"));
      const period = b.period === "rolling" ? "last " + b.rolling_hours + " h" : b.period;
      const scope = el("td", b.scope + " · " + period + (b.period === "total" || b.period === "rolling" ? "" : " (" + b.timezone + ")"));
      const used = el("td", null, "bar-col");
      used.append(meter(b.percent, b.thresholds), el("span", Number(b.percent).toFixed(2) + "%", "pct"));
      const out = el("td", null, "runs-out");
      out.append(...runsOut(b, now));
      tr.append(name, scope, used, el("td", spent[i], "n spent"), el("td", limit[i], "n limit"), el("td", held[i], "n held"),
        el("td", forecast[i], "n forecast"), out, el("td", b.resets_at ? when(b.resets_at) : b.period === "total" ? "never" : "rolling"));
      return tr;
    });
    fill(document.querySelector("#budgets tbody"), rows);
  }

  function drawGroups(id, groups) {
    const tbody = document.querySelector("#" + id + " tbody");
    if (!groups || groups.length === 0) { fill(tbody, [el("tr")].map((tr) => { tr.append(el("td", "nothing yet", "note")); return tr; })); return; }
    const costs = usdColumn(groups.map((g) => g.cost_usd));
    const top = Math.max(...groups.map((g) => Number(g.cost_usd || 0)), 1e-12);
    fill(tbody, groups.map((g, i) => {
      const tr = el("tr");
      tr.dataset.name = g.name;
      const name = el("td", g.name, "name");
      name.title = g.name;
      const barCell = el("td", null, "hbar-cell");
      const bar = el("div", null, "hbar");
      bar.style.width = (100 * Number(g.cost_usd || 0) / top).toFixed(1) + "%";
      barCell.append(bar);
      const cost = el("td", costs[i], "n cost");
      if (g.unpriced_requests) cost.append(badge(g.unpriced_requests + " unpriced", "warn"));
      tr.append(name, barCell, cost, el("td", int(g.requests) + " req", "n note"));
      return tr;
    }));
  }

  function drawRecent(state) {
    const recent = state.live.recent;
    const costs = usdColumn(recent.map((r) => r.cost_usd));
    const tbody = document.querySelector("#recent tbody");
    fill(tbody, recent.map((r, i) => {
      const tr = el("tr");
      tr.dataset.requestId = r.request_id;
      if (!seen.has(r.request_id)) seen.set(r.request_id, firstDraw ? 0 : Date.now());
      if (Date.now() - seen.get(r.request_id) < 3000) tr.className = "new";
      const model = el("td", r.served_model || r.requested_model || "–", "wrap");
      if (r.row_kind && r.row_kind !== "request") model.append(badge(r.row_kind));
      const ok = r.outcome === "ok";
      const status = el("td", (r.http_status || "–") + (ok ? "" : " " + r.outcome), ok ? "status-ok" : "status-bad");
      const cost = el("td", costs[i], "n cost");
      if (r.price_status === "unpriced" || r.price_status === "usage_unknown") cost.append(badge(r.price_status.replace("_", " "), "warn"));
      tr.append(el("td", clock(r.ended_at)), el("td", r.principal), model, el("td", r.endpoint), status,
        el("td", int(r.input_tokens), "n"), el("td", int(r.cached_input_tokens), "n"), el("td", int(r.output_tokens), "n"),
        cost, el("td", r.latency_ms === null ? "–" : Math.round(r.latency_ms) + " ms", "n"));
      return tr;
    }));
    if (seen.size > 2000) for (const id of [...seen.keys()].slice(0, 1000)) seen.delete(id);
  }

  const KINDS = { forecast: "forecast over the limit", refusing: "refusing requests", unpriced_model: "unpriced model", delivery_failed: "delivery failed" };
  function drawAlerts(state) {
    const alerts = (state.ledger && state.ledger.alerts) || [];
    document.getElementById("no-alerts").hidden = alerts.length > 0;
    fill(document.querySelector("#alerts tbody"), alerts.map((a) => {
      const tr = el("tr");
      const what = a.kind === "threshold" ? "crossed " + a.thresholds.map((t) => t + "%").join(", ") : KINDS[a.kind] || a.kind;
      tr.append(el("td", when(a.created_at)), el("td", a.budget), el("td", what),
        el("td", a.status, a.status === "sent" ? "status-ok" : "status-bad"),
        el("td", a.delivered_to.join(", ") || "–", "wrap"), el("td", a.subject || "", "wrap"));
      return tr;
    }));
  }

  function draw(state) {
    drawTiles(state);
    drawBudgets(state);
    const ledger = state.ledger;
    for (const [id, key] of [["by-model", "by_model"], ["by-key", "by_key"], ["by-team", "by_team"]]) {
      drawGroups(id, ledger ? ledger[key] : null);
    }
    drawRecent(state);
    drawAlerts(state);
    drawCharts(state);
    const status = document.getElementById("status");
    status.dataset.state = "live";
    status.textContent = "live · " + clock(state.now);
    const note = ledger && ledger.as_of ? "ledger as of " + clock(ledger.as_of) + (ledger.error ? " (" + ledger.error + ")" : "") :
      ledger && ledger.error ? "ledger: " + ledger.error : "ledger not read yet";
    setText("as-of", note);
    setText("ledger-note", note);
    firstDraw = false;
  }

  // ---- polling ----------------------------------------------------------------------------
  // One request at a time: the next poll starts 2 s after the last one ended.
  async function refresh() {
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), 8000);
    const status = document.getElementById("status");
    try {
      const url = "/dashboard/api/state?tz=" + encodeURIComponent(tz) + "&range=" + encodeURIComponent(range);
      const reply = await fetch(url, { credentials: "same-origin", cache: "no-store", signal: controller.signal });
      if (reply.status === 401) { location.href = "/dashboard"; return; }
      if (!reply.ok) {
        let message = "HTTP " + reply.status;
        try { message = (await reply.json()).error.message; } catch (e) { /* not JSON */ }
        status.dataset.state = reply.status === 403 ? "denied" : "error";
        status.textContent = message;
      } else {
        draw(await reply.json());
      }
    } catch (err) {
      status.dataset.state = "error";
      status.textContent = "disconnected, retrying";
    } finally {
      clearTimeout(timer);
    }
  }
  let pending = null;
  let timer = null;
  function pollNow() {
    clearTimeout(timer);
    if (!pending) pending = refresh().finally(() => { pending = null; timer = setTimeout(pollNow, POLL_MS); });
  }

  function selectRange(name) {
    range = name;
    for (const b of document.querySelectorAll("#ranges button")) b.setAttribute("aria-pressed", String(b.dataset.range === name));
    const label = { today: "today", "24h": "last 24 h", "7d": "last 7 days", "30d": "last 30 days" }[name] || name;
    for (const span of document.querySelectorAll(".range-name")) span.textContent = label;
  }
  for (const b of document.querySelectorAll("#ranges button")) {
    b.addEventListener("click", () => { location.hash = "range=" + b.dataset.range; selectRange(b.dataset.range); pollNow(); });
  }
  selectRange(range);
  pollNow();
})();
