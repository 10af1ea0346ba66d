// The dashboard: polls GET /stats/timeline once a second and draws what the batching loop did,
// as hand-made SVG. No library and nothing fetched from elsewhere, so it works offline.
"use strict";

(() => {
  const POLL_MS = 1000;
  const KEY_STORE = "gpt2-dashboard-api-key"; // sessionStorage: this tab only, gone when it closes
  const STEPS_KEPT = 20000; // step records kept for the step charts (their last HISTORY_S seconds at most)
  const REQUESTS_SHOWN = 50; // rows in the request timeline
  const ROW_PX = 8; // height of one request's row: the timeline grows with the rows it shows
  const REQUESTS_KEPT = 500; // requests remembered, so rows survive while newer ones arrive
  const HISTORY_S = 60; // span of the charts over time
  const GANTT_MAX_S = 300; // the request timeline never spans more than this
  const STAGES = ["schedule", "build", "forward", "sample", "deliver"];
  const PHASE_AFTER = {
    arrived: "waiting",
    admitted: "admitted",
    preempted: "admitted",
    prefill: "prefill",
    decoding: "decoding",
  };
  const SVG_NS = "http://www.w3.org/2000/svg";

  const state = {
    since: 0, // cursors: the last step and event received
    eventsSince: 0,
    data: null, // the latest response
    steps: [], // step records, oldest first
    // request id -> {id, prompt, generated, constraint, segments: [{phase, start, end}], ended, endedAt}
    requests: new Map(),
    samples: [], // one per poll: live values and window figures, for the charts over time
  };

  // --- fetching -------------------------------------------------------------------------------
  function authHeaders() {
    const key = sessionStorage.getItem(KEY_STORE);
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  async function poll() {
    const url = `stats/timeline?since=${state.since}&events_since=${state.eventsSince}`;
    let response;
    try {
      response = await fetch(url, { headers: authHeaders(), cache: "no-store" });
    } catch {
      setStatus("cannot reach the server; retrying", true);
      return later();
    }
    if (response.status === 401) {
      sessionStorage.removeItem(KEY_STORE);
      return askForKey("The server refused that key.");
    }
    if (!response.ok) {
      setStatus(`HTTP ${response.status}; retrying`, true);
      return later();
    }
    take(await response.json());
    render();
    setStatus(`live, ${new Date().toLocaleTimeString()}`);
    return later();
  }

  function later() {
    setTimeout(poll, POLL_MS);
  }

  function askForKey(problem) {
    const form = document.getElementById("key-form");
    document.getElementById("key-problem").textContent = problem || "";
    form.hidden = false;
    setStatus("waiting for the API key", true);
    placeholders("waiting for the API key");
    document.getElementById("key-input").focus();
  }

  function onKeySubmit(event) {
    event.preventDefault();
    const input = document.getElementById("key-input");
    sessionStorage.setItem(KEY_STORE, input.value);
    input.value = "";
    document.getElementById("key-form").hidden = true;
    poll();
  }

  function setStatus(text, bad = false) {
    const node = document.getElementById("status");
    node.textContent = text;
    node.classList.toggle("offline", bad);
  }

  // --- the data -------------------------------------------------------------------------------
  function take(data) {
    if (data.next.since < state.since || data.next.events_since < state.eventsSince) {
      state.steps = []; // a restarted server counts from 1 again
      state.requests.clear();
      state.samples = [];
    }
    state.data = data;
    state.since = data.next.since;
    state.eventsSince = data.next.events_since;
    state.steps.push(...data.steps);
    const recent = state.steps.findIndex((s) => s.started_at >= data.now - HISTORY_S);
    const keepFrom = Math.max(recent < 0 ? state.steps.length : recent, state.steps.length - STEPS_KEPT);
    if (keepFrom > 0) state.steps = state.steps.slice(keepFrom);
    data.events.forEach(applyEvent);
    for (const id of state.requests.keys()) {
      if (state.requests.size <= REQUESTS_KEPT) break;
      state.requests.delete(id); // the first seen first
    }
    const { live, window } = data;
    state.samples.push({
      at: data.now,
      running: live.requests_running,
      waiting: live.requests_waiting,
      used: live.kv_blocks_used,
      cached: live.kv_blocks_cached,
      hitRate: live.prefix_cache_hit_rate,
      tps: window.output_tokens_per_s,
      ttft50: window.ttft_s.p50,
      ttft99: window.ttft_s.p99,
    });
    state.samples = state.samples.filter((s) => s.at >= data.now - HISTORY_S);
  }

  // A request's row: each event closes the phase before it and opens the next (or ends the row).
  function applyEvent(e) {
    let r = state.requests.get(e.request);
    if (!r) {
      r = { id: e.request, prompt: e.prompt_tokens, generated: 0, segments: [], ended: null, endedAt: null };
      state.requests.set(e.request, r);
    }
    r.generated = e.generated_tokens;
    r.constraint = e.constraint ?? null; // on every event of a constrained request (structured output)
    r.lora = e.lora ?? null; // the LoRA adapter the request runs through, on every event of it
    const open = r.segments[r.segments.length - 1];
    if (open && open.end === null) open.end = e.at;
    const phase = PHASE_AFTER[e.kind];
    if (phase) {
      r.segments.push({ phase, start: e.at, end: null });
    } else {
      r.ended = e.kind;
      r.endedAt = e.at;
    }
  }

  // Live values at step resolution, plus one point per poll so that idle periods show too.
  function overTime(fromStep, fromSample) {
    const points = state.steps.map((s) => [s.started_at, fromStep(s)]);
    for (const s of state.samples) points.push([s.at, fromSample(s)]);
    return points.sort((a, b) => a[0] - b[0]);
  }

  // --- drawing helpers ------------------------------------------------------------------------
  function add(parent, tag, attrs = {}, text = null) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
    if (text !== null) node.textContent = text;
    parent.appendChild(node);
    return node;
  }

  // A cleared chart, its viewBox in CSS pixels, and its plot area.
  function chart(id, right = 12) {
    const svg = document.getElementById(id);
    svg.replaceChildren();
    const { width, height } = svg.getBoundingClientRect();
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    return { svg, x0: 52, x1: width - right, y0: 8, y1: height - 20 };
  }

  function empty(c, text) {
    add(c.svg, "text", { x: (c.x0 + c.x1) / 2, y: (c.y0 + c.y1) / 2, "text-anchor": "middle", class: "empty" }, text);
  }

  // A round step (1, 2 or 5 times a power of ten) giving about `ticks` intervals up to `value`.
  function niceScale(value, ticks = 4, integer = false) {
    const raw = Math.max(value, 1e-9) / ticks;
    const power = 10 ** Math.floor(Math.log10(raw));
    let step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
    if (integer) step = Math.max(1, step);
    return { max: Math.max(step, Math.ceil(value / step) * step), step };
  }

  function yAxis(c, scale, format, side = "left") {
    for (let v = 0; v <= scale.max + scale.step / 2; v += scale.step) {
      const y = yOf(c, v, scale.max);
      if (side === "left") add(c.svg, "line", { x1: c.x0, x2: c.x1, y1: y, y2: y, class: "grid" });
      const x = side === "left" ? c.x0 - 5 : c.x1 + 5;
      add(c.svg, "text", { x, y: y + 4, "text-anchor": side === "left" ? "end" : "start" }, format(v));
    }
  }

  function yOf(c, v, max) {
    return c.y1 - (Math.min(v, max) / max) * (c.y1 - c.y0);
  }

  function timeAxis(c, t0, t1) {
    const scale = niceScale(t1 - t0, 5);
    for (let ago = 0; ago <= t1 - t0 + 1e-9; ago += scale.step) {
      const x = c.x1 - (ago / (t1 - t0)) * (c.x1 - c.x0);
      add(c.svg, "text", { x, y: c.y1 + 14, "text-anchor": "middle" }, ago === 0 ? "now" : `−${fmtNumber(ago)} s`);
    }
  }

  // A line that holds each value until the next point, over [t0, t1]; with `area`, filled below.
  function stepLine(c, points, t0, t1, max, cls, area = false) {
    const xOf = (t) => c.x0 + ((t - t0) / (t1 - t0)) * (c.x1 - c.x0);
    const inView = perPixel(
      points.filter(([t, v]) => t >= t0 && v !== null && v !== undefined),
      xOf,
    );
    if (!inView.length) return;
    let d = `M${xOf(inView[0][0])},${yOf(c, inView[0][1], max)}`;
    for (let i = 1; i < inView.length; i++) {
      d += `H${xOf(inView[i][0])}V${yOf(c, inView[i][1], max)}`;
    }
    d += `H${xOf(t1)}`;
    if (area) add(c.svg, "path", { d: `${d}V${c.y1}H${xOf(inView[0][0])}Z`, class: `area ${cls}` });
    add(c.svg, "path", { d, class: `line ${cls}` });
  }

  // One point per pixel column, the column's highest value: thousands of steps stay one clean line.
  function perPixel(points, xOf) {
    const kept = [];
    for (const [t, v] of points) {
      const last = kept[kept.length - 1];
      if (last && Math.floor(xOf(last[0])) === Math.floor(xOf(t))) last[1] = Math.max(last[1], v);
      else kept.push([t, v]);
    }
    return kept;
  }

  function fmtNumber(v) {
    if (v >= 10000) return `${(v / 1000).toFixed(0)}k`;
    if (v >= 1000) return `${(v / 1000).toFixed(1)}k`;
    return Number.isInteger(v) ? String(v) : v.toFixed(v < 1 ? 2 : 1);
  }

  function fmtSeconds(s) {
    if (s === null || s === undefined) return "–";
    if (s === 0) return "0";
    if (s < 0.001) return `${(s * 1e6).toFixed(0)} µs`;
    if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms`;
    return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  }

  // --- the page -------------------------------------------------------------------------------
  function render() {
    renderHeader();
    renderTiles();
    drawStepTokens();
    drawStepTimes();
    drawRequests();
    drawQueues();
    drawKv();
    drawCache();
    drawLatency();
    renderTenants();
  }

  // Each tenant's share of the tokens generated since the page opened (the first reading is the base).
  function renderTenants() {
    const { live } = state.data;
    const total = live.tenant_generated_tokens || {};
    state.tenantBase = state.tenantBase || { ...total };
    const since = Object.fromEntries(Object.entries(total).map(([t, n]) => [t, n - (state.tenantBase[t] || 0)]));
    const sum = Object.values(since).reduce((a, b) => a + b, 0);
    const body = document.querySelector("#tenants-table tbody");
    body.replaceChildren();
    const names = Object.keys({ ...total, ...live.tenant_requests_running, ...live.tenant_requests_waiting });
    names.sort((a, b) => (since[b] || 0) - (since[a] || 0));
    const cell = (row, text) => {
      const td = document.createElement("td");
      td.textContent = text; // text, never markup: tenant names come from requests
      row.appendChild(td);
      return td;
    };
    for (const name of names) {
      const share = sum ? (since[name] || 0) / sum : 0;
      const row = document.createElement("tr");
      body.appendChild(row);
      cell(row, name);
      cell(row, `${(100 * share).toFixed(1)}%`);
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = `${Math.round(200 * share)}px`;
      cell(row, "").appendChild(bar);
      cell(row, fmtNumber(since[name] || 0));
      for (const counts of [live.tenant_requests_running, live.tenant_requests_waiting, live.tenant_requests_refused]) {
        cell(row, String((counts || {})[name] || 0));
      }
    }
  }

  function renderHeader() {
    const { server, live } = state.data;
    document.getElementById("mode").textContent = server.mode;
    const model = document.getElementById("model");
    model.textContent = server.model;
    if (server.random_weights) {
      const badge = document.createElement("span");
      badge.className = "random";
      badge.textContent = " (random weights)";
      model.appendChild(badge);
    }
    document.getElementById("device").textContent = server.device;
    document.getElementById("limits").textContent =
      `${server.max_batch_size} sequences, ${server.max_batch_tokens} tokens a step, ` +
      `${live.kv_blocks_total} KV blocks of ${server.block_size} (${server.kv_cache_dtype})`;
    document.getElementById("step-count").textContent = String(live.steps);
  }

  function renderTiles() {
    const { live, window } = state.data;
    const set = (id, text) => {
      document.getElementById(id).textContent = text;
    };
    set("tile-running", String(live.requests_running));
    set("tile-waiting", String(live.requests_waiting));
    set("tile-tps", fmtNumber(Math.round(window.output_tokens_per_s * 10) / 10));
    set("tile-window", fmtNumber(Math.round(window.span_s)));
    set("tile-ttft", fmtSeconds(window.ttft_s.p50));
    set("tile-ttft-p99", `p99 ${fmtSeconds(window.ttft_s.p99)}`);
    set("tile-tpot", fmtSeconds(window.tpot_s.p50));
    set("tile-tpot-p99", `p99 ${fmtSeconds(window.tpot_s.p99)}`);
    set("tile-kv", String(live.kv_blocks_used));
    set("tile-kv-total", `of ${live.kv_blocks_total}`);
    set("tile-hits", `${(100 * live.prefix_cache_hit_rate).toFixed(1)}%`);
    set("tile-preemptions", String(live.preemptions));
    set(
      "window-note",
      `Tokens/s, TTFT and TPOT over the last ${fmtNumber(Math.round(window.span_s))} s, counted as tokens come ` +
        `(requests still running included): ${window.tokens_generated} tokens, ${window.first_tokens} first tokens. ` +
        `Ended in that time: ${window.requests_finished} finished, ${window.requests_failed} failed, ` +
        `${window.requests_cancelled} cancelled.`,
    );
  }

  // Steps on the same time axis as every other panel: a bar per step at its start, as wide as it
  // lasted (at least a pixel); where several steps share a pixel column, the one with the tallest stack.
  function stackedBars(c, t0, t1, max, parts) {
    const xOf = (t) => c.x0 + ((t - t0) / (t1 - t0)) * (c.x1 - c.x0);
    const columns = new Map();
    for (const s of state.steps) {
      if (s.started_at < t0) continue;
      const stack = parts(s);
      const total = stack.reduce((sum, [, v]) => sum + v, 0);
      const column = Math.floor(xOf(s.started_at));
      const kept = columns.get(column);
      if (!kept || total > kept.total) columns.set(column, { s, stack, total });
    }
    for (const { s, stack } of columns.values()) {
      const x = xOf(s.started_at);
      const width = Math.max(xOf(s.started_at + s.duration_s) - x, 1);
      let y = c.y1;
      for (const [cls, value] of stack) {
        const h = (Math.min(value, max) / max) * (c.y1 - c.y0);
        if (h <= 0) continue;
        y -= h;
        add(c.svg, "rect", { x, y, width, height: h, class: `bar ${cls}` });
      }
    }
    timeAxis(c, t0, t1);
  }

  function recentSteps() {
    return state.steps.filter((s) => s.started_at >= state.data.now - HISTORY_S);
  }

  function drawStepTokens() {
    const c = chart("steps-chart");
    const steps = recentSteps();
    if (!steps.length) return empty(c, "no steps in the last minute: send some requests");
    const budget = state.data.server.max_batch_tokens;
    const top = Math.max(...steps.map((s) => s.num_decodes + s.num_prefill_tokens));
    const scale = niceScale(top, 4, true);
    yAxis(c, scale, fmtNumber);
    const now = state.data.now;
    stackedBars(c, now - HISTORY_S, now, scale.max, (s) => [
      ["decode", s.num_decodes],
      ["prefill", s.num_prefill_tokens],
    ]);
    if (budget <= scale.max) {
      const y = yOf(c, budget, scale.max);
      add(c.svg, "line", { x1: c.x0, x2: c.x1, y1: y, y2: y, class: "budget" });
    } else {
      const label = `budget ${budget} tokens, above the scale`;
      add(c.svg, "text", { x: c.x1, y: c.y0 + 10, "text-anchor": "end" }, label);
    }
  }

  function drawStepTimes() {
    const c = chart("step-time-chart");
    const steps = recentSteps();
    if (!steps.length) return empty(c, "no steps in the last minute");
    const scale = niceScale(Math.max(...steps.map((s) => s.duration_s)));
    yAxis(c, scale, fmtSeconds);
    const now = state.data.now;
    stackedBars(c, now - HISTORY_S, now, scale.max, (s) => STAGES.map((stage) => [stage, s.stages[stage] || 0]));
  }

  // Rows: requests still in the system first (the head of the queue included), then those that
  // ended most recently; drawn in arrival order.
  function shownRequests() {
    const all = [...state.requests.values()].filter((r) => r.segments.length);
    all.sort((a, b) => (b.endedAt ?? Infinity) - (a.endedAt ?? Infinity) || a.id - b.id);
    return all.slice(0, REQUESTS_SHOWN).sort((a, b) => a.id - b.id);
  }

  function drawRequests() {
    const rows = shownRequests();
    const svg = document.getElementById("requests-chart");
    svg.style.height = `${Math.max(rows.length, 6) * ROW_PX + 28}px`; // the plot area, and room for the axis
    const c = chart("requests-chart");
    if (!rows.length) return empty(c, "no requests yet");
    const now = state.data.now;
    const start = Math.min(...rows.map((r) => r.segments[0].start));
    const t0 = now - Math.min(Math.max(now - start, 5), GANTT_MAX_S);
    const xOf = (t) => c.x0 + ((Math.max(t, t0) - t0) / (now - t0)) * (c.x1 - c.x0);
    const rowH = (c.y1 - c.y0) / Math.max(rows.length, 6);
    rows.forEach((r, i) => {
      const y = c.y0 + i * rowH;
      if (r.constraint) markConstrained(c, r, y, rowH * 0.8, xOf(r.segments[0].start), xOf(r.endedAt ?? now));
      for (const seg of r.segments) {
        const x = xOf(seg.start);
        const width = Math.max(xOf(seg.end ?? now) - x, 0.5);
        add(c.svg, "rect", { x, y, width, height: rowH * 0.8, class: `seg ${seg.phase}` });
      }
      if (r.lora) {
        add(c.svg, "text", { x: xOf(r.segments[0].start) + 2, y: y + rowH * 0.65, class: "lora" }, r.lora);
      }
      if (r.ended) {
        const x = xOf(r.endedAt);
        add(c.svg, "rect", { x: x - 1.5, y, width: 3, height: rowH * 0.8, class: `end ${r.ended}` });
      }
      if (i % 10 === 0) {
        add(c.svg, "text", { x: c.x0 - 5, y: y + rowH * 0.8, "text-anchor": "end" }, `#${r.id}`);
      }
    });
    timeAxis(c, t0, now);
  }

  // A constrained request's row (structured output), drawn under its phases: a tinted band across the
  // plot (visible however short the request), a ring around its life, and "{}" in the left margin
  // (where row labels are right-aligned, so the two meet only for very long ids); hovering names the kind.
  function markConstrained(c, r, y, height, start, end) {
    const mark = add(c.svg, "g", { class: "constrained" });
    add(mark, "title", {}, `#${r.id}: ${r.constraint} constraint`);
    add(mark, "rect", { x: c.x0, y, width: c.x1 - c.x0, height, class: "band" });
    const width = Math.max(end - start, 0.5) + 2;
    add(mark, "rect", { x: start - 1, y: y - 1, width, height: height + 2, class: "ring" });
    add(mark, "text", { x: 2, y: y + height, class: "tag" }, "{}");
  }

  // Lines over the last HISTORY_S seconds: `series` is [[points, class, filled?], ...].
  function timeChart(id, series, format, integer) {
    const c = chart(id);
    const now = state.data.now;
    const t0 = now - HISTORY_S;
    const top = Math.max(1, ...series.flatMap(([points]) => points.filter(([t]) => t >= t0).map(([, v]) => v ?? 0)));
    const scale = niceScale(top, 4, integer);
    yAxis(c, scale, format);
    for (const [points, cls, area] of series) stepLine(c, points, t0, now, scale.max, cls, area);
    timeAxis(c, t0, now);
    return { c, t0, now };
  }

  function drawQueues() {
    timeChart(
      "queue-chart",
      [
        [state.samples.map((s) => [s.at, s.running]), "running"],
        [state.samples.map((s) => [s.at, s.waiting]), "waiting"],
      ],
      fmtNumber,
      true,
    );
  }

  // Scaled to what is in use, not to the pool: a big pool would flatten the lines. Free blocks are
  // the pool less the used ones, so they are a number, not a line.
  function drawKv() {
    timeChart(
      "kv-chart",
      [
        [overTime((s) => s.kv_blocks_used, (s) => s.used), "used", true],
        [overTime((s) => s.kv_blocks_cached, (s) => s.cached), "cached"],
      ],
      fmtNumber,
      true,
    );
    const { kv_blocks_free: free, kv_blocks_total: total } = state.data.live;
    document.getElementById("kv-free").textContent = `free now: ${free} of ${total}`;
  }

  function drawCache() {
    const percent = (v) => `${Math.round(v * 100)}%`;
    const { c, t0, now } = timeChart("cache-chart", [[state.samples.map((s) => [s.at, s.hitRate]), "hits"]], percent);
    for (let i = 1; i < state.steps.length; i++) {
      const s = state.steps[i];
      if (s.started_at < t0 || s.preemptions <= state.steps[i - 1].preemptions) continue;
      const x = c.x0 + ((s.started_at - t0) / (now - t0)) * (c.x1 - c.x0);
      add(c.svg, "line", { x1: x, x2: x, y1: c.y1, y2: c.y1 - 10, class: "tick preemption" });
    }
  }

  function drawLatency() {
    const c = chart("latency-chart", 52);
    const now = state.data.now;
    const t0 = now - HISTORY_S;
    const samples = state.samples;
    if (!samples.some((s) => s.tps > 0 || s.ttft50 !== null)) return empty(c, "no tokens in the window yet");
    const tps = niceScale(Math.max(1, ...samples.map((s) => s.tps)));
    const secs = niceScale(Math.max(0.001, ...samples.map((s) => s.ttft99 ?? 0)));
    yAxis(c, tps, fmtNumber);
    yAxis(c, secs, fmtSeconds, "right");
    stepLine(c, samples.map((s) => [s.at, s.tps]), t0, now, tps.max, "tps");
    stepLine(c, samples.map((s) => [s.at, s.ttft50]), t0, now, secs.max, "ttft50");
    stepLine(c, samples.map((s) => [s.at, s.ttft99]), t0, now, secs.max, "ttft99");
    timeAxis(c, t0, now);
  }

  // Before the first answer (or while the key is missing): every chart says why it is empty.
  function placeholders(text) {
    const charts = ["steps-chart", "step-time-chart", "requests-chart", "queue-chart", "kv-chart", "cache-chart"];
    for (const id of [...charts, "latency-chart"]) empty(chart(id), text);
  }

  // --- start ------------------------------------------------------------------------------------
  document.getElementById("key-form").addEventListener("submit", onKeySubmit);
  if (document.body.dataset.keyRequired === "true" && !sessionStorage.getItem(KEY_STORE)) {
    askForKey();
  } else {
    placeholders("connecting…");
    poll();
  }
})();
