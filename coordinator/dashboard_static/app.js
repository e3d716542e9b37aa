// The gelastic dashboard: renders the coordinator's server-sent events.
// Every piece of data goes in with textContent (or an SVG text node): worker output,
// tracebacks, names and reasons are hostile input and never become markup.
//
// The session: the login trades the token for a session id, kept in this origin's
// localStorage (per scheme, host and port: no page on another port can read it) and sent
// only to this origin, in an `Authorization: Session` header. No cookie: a browser sends a
// host's cookies to every port of it, so another local user's server on another port would
// receive one (coordinator/_dashboard_auth.py).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELED"]);
const LOG_KEEP_CHARS = 128 * 1024;
const SESSION_KEY = "gelastic.session";
const RETRY_MIN_MS = 1000;
const RETRY_MAX_MS = 10000;
const MAX_PENDING_CHARS = 32 * 1024 * 1024;

// ---- session ---------------------------------------------------------------------------

function authHeaders() {
  const sid = localStorage.getItem(SESSION_KEY);
  return sid ? { Authorization: "Session " + sid } : {};
}

let leaving = false;

function toLogin() {
  if (leaving) return;
  leaving = true;
  localStorage.removeItem(SESSION_KEY);
  location.replace("/login");
}

async function login(form) {
  const input = document.getElementById("token");
  const token = input.value.trim();
  input.value = "";
  let resp = null;
  try {
    resp = await fetch("/login", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ token }),
      cache: "no-store",
    });
  } catch (e) {
    resp = null;
  }
  const data = resp ? await resp.json().catch(() => ({})) : {};
  if (resp && resp.ok && typeof data.session === "string" && data.session) {
    localStorage.setItem(SESSION_KEY, data.session);
    location.replace("/");
    return;
  }
  const failed = document.getElementById("login-failed");
  if (resp && resp.status !== 401) failed.textContent = "Login failed: " + (data.error || resp.status);
  failed.hidden = false;
  form.querySelector("button").disabled = false;
}

async function logout() {
  try {
    await fetch("/logout", { method: "POST", headers: authHeaders(), cache: "no-store" });
  } finally {
    toLogin();
  }
}

// ---- server-sent events, read with fetch ------------------------------------------------

// One event block ("event: NAME", "data: JSON" lines; comments start with ":").
function dispatch(block, handlers, ctl) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const i = line.indexOf(":");
    const key = i < 0 ? line : line.slice(0, i);
    let value = i < 0 ? "" : line.slice(i + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (key === "event") name = value;
    else if (key === "data") data.push(value);
  }
  const fn = handlers[name];
  if (!fn || !data.length) return;
  const parsed = JSON.parse(data.join("\n"));
  try {
    fn(parsed, ctl);
  } catch (e) {
    setTimeout(() => { throw e; }); // reported as the page's error; the stream goes on
  }
}

async function readEvents(body, handlers, ctl) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  try {
    while (!ctl.closed) {
      const { value, done } = await reader.read();
      if (done) return;
      pending += value;
      let end;
      while (!ctl.closed && (end = pending.indexOf("\n\n")) >= 0) {
        dispatch(pending.slice(0, end), handlers, ctl);
        pending = pending.slice(end + 2);
      }
      if (pending.length > MAX_PENDING_CHARS) return;
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// A server-sent event stream, like EventSource, but read with fetch so that it carries the
// session header (EventSource cannot send one). `handlers` maps event names to functions of
// (data, stream); `onState` hears "open", "retry" (dropped: reconnecting, with a growing
// pause) and "closed" (refused for good, with the status). `stream.close()` ends it.
function eventStream(url, handlers, onState) {
  const ctl = { closed: false, abort: null };
  ctl.close = () => {
    ctl.closed = true;
    if (ctl.abort) ctl.abort.abort();
  };
  (async () => {
    let pause = RETRY_MIN_MS;
    while (!ctl.closed) {
      ctl.abort = new AbortController();
      try {
        const resp = await fetch(url, { headers: authHeaders(), cache: "no-store", signal: ctl.abort.signal });
        if (resp.status === 401) {
          ctl.closed = true;
          toLogin();
          return;
        }
        if (resp.ok) {
          onState("open");
          pause = RETRY_MIN_MS;
          await readEvents(resp.body, handlers, ctl);
        } else {
          if (resp.body) resp.body.cancel().catch(() => {});
          if (resp.status !== 503) {  // 503: busy (stream cap) or standby; anything else is final
            ctl.closed = true;
            onState("closed", resp.status);
            return;
          }
        }
      } catch (e) {
        // a dropped connection, or our own close()
      }
      if (ctl.closed) return;
      onState("retry");
      await new Promise((resolve) => setTimeout(resolve, pause));
      pause = Math.min(pause * 2, RETRY_MAX_MS);
    }
  })();
  return ctl;
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "href") e.setAttribute("href", v);
    else e.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = String(text);
  return e;
}

function duration(s) {
  if (!(s >= 0)) return "";
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}

function bytes(n) {
  if (!n) return "0";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function clock(t) {
  if (!t) return "";
  return new Date(t * 1000).toLocaleTimeString();
}

function badge(state) {
  return el("span", { class: "badge s-" + String(state).toLowerCase() }, state);
}

function jobLink(id) {
  return el("a", { href: "/jobs/" + encodeURIComponent(id) }, id);
}

function table(headers, rows, cls) {
  const t = el("table", { class: cls || "" });
  const head = el("tr");
  for (const h of headers) head.append(el("th", {}, h));
  t.append(el("thead", {}, head));
  const body = el("tbody");
  for (const r of rows) {
    const tr = el("tr");
    for (const c of r.cells) tr.append(c instanceof Node && c.tagName === "TD" ? c : el("td", {}, c));
    if (r.cls) tr.className = r.cls;
    if (r.data) for (const [k, v] of Object.entries(r.data)) tr.dataset[k] = v;
    body.append(tr);
  }
  t.append(body);
  return t;
}

function setLive(text, ok) {
  const live = document.getElementById("live");
  if (!live) return;
  live.textContent = text;
  live.className = "live " + (ok ? "ok" : "down");
}

// The page's one stream; `handlers` maps event names to functions of (data, stream).
function follow(url, handlers) {
  return eventStream(url, handlers, (state) => {
    if (state === "open") {
      setLive("live", true);
      return;
    }
    setLive(state === "closed" ? "disconnected" : "reconnecting…", false);
    const app = document.getElementById("app");
    if (state === "closed" && app && !app.childElementCount) {
      app.replaceChildren(el("p", { class: "error" }, "The data stream closed: this job may not exist."));
    }
  });
}

// ---- cluster ---------------------------------------------------------------------------

let overview = null;
let overviewAt = 0;

function sinceSnapshot() {
  return (Date.now() - overviewAt) / 1000;
}

function slotBar(used, total) {
  const bar = el("span", { class: "slots", title: used + " used / " + total });
  for (let i = 0; i < Math.min(total, 64); i++) {
    bar.append(el("span", { class: i < used ? "slot used" : "slot free" }));
  }
  return bar;
}

function renderCluster(app) {
  const d = overview;
  const extra = sinceSnapshot();
  const live = d.nodes.filter((n) => n.state === "live").length;
  const slots = d.nodes.reduce((a, n) => a + n.slots, 0);
  const used = d.nodes.reduce((a, n) => a + n.slots_used, 0);
  const summary = el("p", { class: "summary" },
    (d.standby ? d.standby + " " : "") +
    d.nodes.length + " nodes (" + live + " live), " + used + "/" + slots + " slots used, " +
    d.jobs.filter((j) => !TERMINAL.has(j.state)).length + " active jobs");
  const rows = d.nodes.map((n) => {
    const jobs = el("td");
    n.jobs.forEach((j, i) => { if (i) jobs.append(" "); jobs.append(jobLink(j)); });
    const age = n.heartbeat_age + (n.state === "live" ? extra : 0);
    return {
      cells: [
        el("td", { class: "name" }, n.name),
        el("td", n.drain_reason ? { title: "drained: " + n.drain_reason + (n.drain_deadline ? "; workers killed at " + clock(n.drain_deadline) : "") } : {}, badge(n.state)),
        el("td", {}, slotBar(n.slots_used, n.slots), " ", n.slots_used + " used / " + n.slots_free + " free"),
        el("td", { class: age > 3 ? "warn" : "" }, duration(age) + " ago"),
        n.cpu_percent.toFixed(0) + " %",
        bytes(n.rss_bytes),
        n.workers,
        jobs,
      ],
      data: { node: n.name },
    };
  });
  app.replaceChildren(
    el("h1", {}, "Cluster"),
    summary,
    table(["node", "state", "slots", "heartbeat", "CPU (workers)", "memory (workers)", "workers", "jobs"], rows, "nodes"),
  );
}

// ---- jobs ------------------------------------------------------------------------------

function jobRows(jobs, extra) {
  return jobs.map((j) => ({
    cells: [
      el("td", {}, jobLink(j.job_id)),
      j.name,
      el("td", {}, badge(j.state)),
      j.attempt + 1,
      j.restarts_left + " of " + j.max_restarts,
      duration(j.duration + (TERMINAL.has(j.state) ? 0 : extra)),
      el("td", { class: "cause", title: j.root_cause || j.reason }, j.root_cause || j.reason),
    ],
    data: { job: j.job_id },
  }));
}

function renderJobs(app) {
  const d = overview;
  const extra = sinceSnapshot();
  const headers = ["job", "name", "state", "attempts", "restarts left", "duration", "root cause / reason"];
  const groups = [
    ["Running", d.jobs.filter((j) => !TERMINAL.has(j.state) && j.state !== "QUEUED")],
    ["Queued", d.jobs.filter((j) => j.state === "QUEUED")],
    ["Finished", d.jobs.filter((j) => TERMINAL.has(j.state))],
  ];
  const parts = [el("h1", {}, "Jobs")];
  for (const [title, jobs] of groups) {
    parts.push(el("h2", {}, title + " (" + jobs.length + ")"));
    parts.push(jobs.length ? table(headers, jobRows(jobs, extra), "jobs") : el("p", { class: "muted" }, "none"));
  }
  if (d.jobs_total > d.jobs.length) {
    parts.push(el("p", { class: "muted" }, "showing " + d.jobs.length + " of " + d.jobs_total + " jobs"));
  }
  app.replaceChildren(...parts);
}

// ---- one job ---------------------------------------------------------------------------

const MARKS = {
  restart: ["restart", "#d9822b"],
  node_lost: ["node lost", "#c23030"],
  reform: ["re-form / scale-up", "#8f398f"],
  barrier_wait: ["exit barrier", "#5c7080"],
  barrier_released: ["barrier released", "#5c7080"],
};

function timeline(d) {
  const job = d.job;
  const t0 = job.submitted_at || (d.attempts[0] && d.attempts[0].started_at) || d.now;
  const t1 = Math.max(job.finished_at || d.now, t0 + 1);
  const bars = [];
  let hidden = 0;
  for (const a of d.attempts) {
    for (const node of a.nodes) bars.push({ a, node });
    hidden += a.nodes_total - a.nodes.length;
  }
  const rowH = 26, top = 16, left = 190, width = 960, right = 20;
  const height = top + Math.max(bars.length, 1) * rowH + 30;
  const x = (t) => left + ((Math.min(Math.max(t, t0), t1) - t0) / (t1 - t0)) * (width - left - right);
  const s = svg("svg", { viewBox: "0 0 " + width + " " + height, class: "timeline", role: "img" });
  s.append(svg("title", {}, "attempts of " + job.job_id + " over time"));
  // time axis
  const axisY = height - 22;
  s.append(svg("line", { x1: left, y1: axisY, x2: width - right, y2: axisY, class: "axis" }));
  for (let i = 0; i <= 4; i++) {
    const t = t0 + ((t1 - t0) * i) / 4;
    s.append(svg("text", { x: x(t), y: axisY + 15, class: "tick", "text-anchor": "middle" }, "+" + duration(t - t0)));
  }
  bars.forEach(({ a, node }, i) => {
    const y = top + i * rowH;
    const start = a.started_at || t0;
    const end = a.ended_at || (TERMINAL.has(job.state) ? t1 : d.now);
    const failedHere = a.failed_ranks.filter((f) => f.node === node);
    const running = !a.ended_at && !TERMINAL.has(job.state);
    const cls = failedHere.length ? "bar failed" : running ? "bar running" : a.failed_ranks.length ? "bar stopped" : "bar ok";
    const g = svg("g", { class: "attempt", "data-attempt": a.attempt, "data-node": node });
    g.append(svg("text", { x: 6, y: y + 16, class: "label" }, "attempt " + a.attempt + " · r" + a.round + " · " + node));
    const rect = svg("rect", { x: x(start), y: y + 4, width: Math.max(2, x(end) - x(start)), height: rowH - 8, rx: 3, class: cls });
    rect.append(svg("title", {}, "attempt " + a.attempt + " round " + a.round + " on " + node + (a.end_reason ? ": " + a.end_reason : "")));
    g.append(rect);
    for (const f of failedHere) {
      const mark = svg("text", { x: x(end) + 4, y: y + 17, class: "failmark", "data-rank": f.rank }, "✕ rank " + f.rank);
      g.append(mark);
    }
    s.append(g);
  });
  const seen = new Set();
  for (const e of d.events) {
    const m = MARKS[e.kind];
    if (!m) continue;
    const xe = x(e.timestamp);
    const line = svg("line", { x1: xe, y1: top - 6, x2: xe, y2: axisY, stroke: m[1], class: "mark mark-" + e.kind });
    line.append(svg("title", {}, m[0] + ": " + e.reason));
    s.append(line);
    if (!seen.has(e.kind)) {
      seen.add(e.kind);
    }
  }
  const legend = el("div", { class: "legend" });
  for (const [cls, text] of [["ok", "finished"], ["running", "running"], ["failed", "failing rank's node"], ["stopped", "stopped by a failure elsewhere"]]) {
    legend.append(el("span", { class: "key bar-" + cls }), text);
  }
  for (const kind of seen) {
    const sw = el("span", { class: "key line" });
    sw.style.borderColor = MARKS[kind][1];
    legend.append(sw, MARKS[kind][0]);
  }
  if (hidden > 0) legend.append(el("span", {}, "(" + hidden + " more node bars not drawn)"));
  return el("div", { class: "card" }, el("h2", {}, "Timeline"), s, legend);
}

function failureBlock(f) {
  const head = "rank " + f.rank + " (local " + f.local_rank + ") on " + (f.node || "?") +
    ", attempt " + f.attempt + ", exit code " + f.exitcode + (f.signal ? " (" + f.signal + ")" : "") +
    ", pid " + f.pid + ", " + f.category;
  const parts = [el("p", { class: "fail-head" }, head)];
  if (f.message) parts.push(el("p", { class: "fail-message" }, f.message));
  const tb = f.traceback || f.stderr_tail;
  if (tb) parts.push(el("pre", { class: "traceback" }, tb));
  return parts;
}

let logSource = null;
let logChoice = { rank: 0, stream: "stdout" };

function openLog(jobId, pre, status) {
  if (logSource) logSource.close();
  pre.textContent = "";
  status.textContent = "following…";
  const url = "/api/stream/logs/" + encodeURIComponent(jobId) + "/" + logChoice.rank + "?stream=" + logChoice.stream;
  logSource = eventStream(url, {
    log: (d) => {
      let text = pre.textContent + (d.dropped ? "[... " + d.dropped + " bytes not shown]\n" : "") + d.text;
      if (text.length > LOG_KEEP_CHARS) text = text.slice(text.length - LOG_KEEP_CHARS);
      const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
      pre.textContent = text;
      if (atBottom) pre.scrollTop = pre.scrollHeight;
    },
    end: (d, stream) => {
      status.textContent = d.reason;
      stream.close();
    },
  }, (state) => {
    if (state === "open") status.textContent = "following…";
    else if (state === "retry") status.textContent = "reconnecting…";
    else status.textContent = "log stream closed";
  });
}

function setRankOptions(sel, ranks) {
  sel.replaceChildren();
  for (const r of ranks) {
    const o = el("option", { value: r }, "rank " + r);
    if (r === logChoice.rank) o.selected = true;
    sel.append(o);
  }
}

function logPanel(jobId, ranks) {
  const pre = el("pre", { class: "log", id: "log" });
  const status = el("span", { class: "muted", id: "log-status" });
  const rankSel = el("select", { id: "log-rank" });
  setRankOptions(rankSel, ranks);
  const streamSel = el("select", { id: "log-stream" });
  for (const s of ["stdout", "stderr"]) {
    const o = el("option", { value: s }, s);
    if (s === logChoice.stream) o.selected = true;
    streamSel.append(o);
  }
  const change = () => {
    logChoice = { rank: Number(rankSel.value), stream: streamSel.value };
    openLog(jobId, pre, status);
  };
  rankSel.addEventListener("change", change);
  streamSel.addEventListener("change", change);
  const card = el("div", { class: "card", id: "logs" }, el("h2", {}, "Log tail"), el("div", { class: "controls" }, rankSel, " ", streamSel, " ", status), pre);
  openLog(jobId, pre, status);
  return card;
}

// ---- stacks ----------------------------------------------------------------------------

// Every rank's stack, grouped: identical stacks once with the ranks that share them, the odd
// ones first (the coordinator orders them). "stacks" takes a capture; the latest one the job
// keeps is shown on arrival, also once its workers are gone.

const STACK_STATUS = { ptrace_refused: "fallback (ptrace refused)", no_answer: "no answer", error: "not read" };

function rankList(ranks) {
  const shown = ranks.slice(0, 64).join(",");
  const more = ranks.length > 64 ? " and " + (ranks.length - 64) + " more" : "";
  return (ranks.length === 1 ? "rank " : "ranks ") + shown + more;
}

function showCapture(box, c) {
  const parts = [el("p", { class: "muted", id: "stacks-capture" },
    c.capture_id + " · " + clock(c.taken_at) + " · attempt " + c.attempt + " round " + c.round + " · " + c.reason)];
  for (const g of c.groups) {
    const status = STACK_STATUS[g.status];
    const head = el("h3", { class: "stack-ranks" }, rankList(g.ranks) + " (" + g.nodes.join(", ") + "):");
    if (status) head.append(" ", el("span", { class: "badge s-failed" }, status));
    const group = el("div", { class: "stack-group" }, head);
    if (g.note) group.append(el("p", { class: "muted stack-note" }, g.note));
    if (g.text) group.append(el("pre", { class: "stack" }, g.text));
    parts.push(group);
  }
  box.replaceChildren(...parts);
}

async function stackCall(jobId, method) {
  const resp = await fetch("/api/jobs/" + encodeURIComponent(jobId) + "/stacks", { method, headers: authHeaders(), cache: "no-store" });
  if (resp.status === 401) { toLogin(); throw new Error("log in first"); }
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) throw new Error(data.error || "HTTP " + resp.status);
  return data;
}

function stacksPanel(jobId) {
  const box = el("div", { id: "stacks" });
  const status = el("span", { class: "muted", id: "stacks-status" });
  const button = el("button", { type: "button", id: "stacks-button" }, "stacks");
  button.addEventListener("click", async () => {
    button.disabled = true;
    status.textContent = "reading every rank's stack…";
    try {
      showCapture(box, await stackCall(jobId, "POST"));
      status.textContent = "";
    } catch (e) {
      status.textContent = e.message;
    } finally {
      button.disabled = false;
    }
  });
  stackCall(jobId, "GET").then((d) => {
    if (d.captures && d.captures.length && !box.childElementCount) showCapture(box, d.captures[d.captures.length - 1]);
  }).catch(() => {});
  return el("div", { class: "card", id: "stacks-card" }, el("h2", {}, "Stacks"), el("div", { class: "controls" }, button, " ", status), box);
}

let jobParts = null;

function renderJob(app, d) {
  const j = d.job;
  if (!jobParts) {
    jobParts = {
      head: el("div"),
      timeline: el("div"),
      ranks: el("div", { class: "card" }),
      cause: el("div"),
      events: el("div", { class: "card" }),
      logs: null,
      stacks: stacksPanel(j.job_id),
    };
    const ranks = d.workers.map((w) => w.rank);
    if (!ranks.length) ranks.push(0);
    if (!ranks.includes(logChoice.rank)) logChoice.rank = ranks[0];
    jobParts.logs = logPanel(j.job_id, ranks);
    jobParts.rankKey = ranks.join(",");
    app.replaceChildren(jobParts.head, jobParts.timeline, jobParts.ranks, jobParts.cause, jobParts.logs, jobParts.stacks, jobParts.events);
  }
  // A job that was queued at first sight gets its ranks once a round forms.
  const ranksNow = d.workers.map((w) => w.rank);
  if (ranksNow.length && ranksNow.join(",") !== jobParts.rankKey) {
    jobParts.rankKey = ranksNow.join(",");
    setRankOptions(document.getElementById("log-rank"), ranksNow);
  }
  const sp = d.spec;
  jobParts.head.replaceChildren(
    el("h1", {}, j.name || j.job_id, " ", badge(j.state)),
    el("p", { class: "summary" },
      j.job_id + " · attempt " + j.attempt + " round " + j.round + " · " + j.restarts_left + " of " +
      j.max_restarts + " restarts left · " + duration(j.duration) + " · nodes " + sp.min_nodes + "–" +
      sp.max_nodes + " × " + sp.nproc_per_node + " workers"),
    el("p", { class: "reason" }, j.reason),
    el("p", { class: "muted entry" }, sp.entrypoint),
  );
  jobParts.timeline.replaceChildren(timeline(d));
  const flags = (w) => [w.behind ? "behind" : "", w.straggler ? "straggler" : ""].filter((f) => f).join(", ");
  const metrics = (w) => Object.entries(w.metrics || {}).map(([k, v]) => k + "=" + Number(v).toPrecision(4)).join(" ");
  const rows = d.workers.map((w) => ({
    cells: [w.rank, w.local_rank, w.node, w.pid || "", el("td", {}, badge(w.state)), w.exitcode === null ? w.proc_state : "", w.cpu_percent.toFixed(0) + " %", bytes(w.rss_bytes),
      w.step === null ? "" : w.step, w.step === null ? "" : w.steps_per_s.toFixed(2), w.last_step_age === null ? "" : w.last_step_age.toFixed(1) + " s", flags(w), metrics(w),
      w.exitcode === null ? "" : w.exitcode],
    data: { rank: w.rank },
  }));
  jobParts.ranks.replaceChildren(
    el("h2", {}, "Ranks"),
    ...(d.stall_reason ? [el("p", { class: "reason stalled", id: "stall-reason" }, d.stall_reason)] : []),
    rows.length ? table(["rank", "local", "node", "pid", "state", "proc", "CPU", "RSS", "step", "steps/s", "last step", "flags", "metrics", "exit"], rows, "ranks") : el("p", { class: "muted" }, "no workers in the current round"),
  );
  if (d.ranks_total > d.workers.length) {
    jobParts.ranks.append(el("p", { class: "muted" }, "showing " + d.workers.length + " of " + d.ranks_total + " ranks"));
  }
  if (d.root_cause) {
    const title = "Root cause" + (d.root_cause_from && d.root_cause_from !== "result" ? " (" + d.root_cause_from + ")" : "");
    const card = el("div", { class: "card root-cause", id: "root-cause" }, el("h2", {}, title), ...failureBlock(d.root_cause));
    const others = d.failures;
    if (others.length) {
      const det = el("details", {}, el("summary", {}, others.length + " other failures"));
      for (const f of others) det.append(...failureBlock(f));
      card.append(det);
    }
    jobParts.cause.replaceChildren(card);
  } else {
    jobParts.cause.replaceChildren();
  }
  const evRows = d.events.slice().reverse().map((e) => ({
    cells: [e.seq, clock(e.timestamp), e.kind, e.attempt + "/" + e.round, e.node, e.rank >= 0 ? e.rank : "", el("td", { class: "cause", title: e.reason }, e.reason)],
    cls: "ev-" + e.kind,
  }));
  jobParts.events.replaceChildren(el("h2", {}, "Events"), table(["#", "time", "kind", "attempt/round", "node", "rank", "reason"], evRows, "events"));
}

// ---- routing ---------------------------------------------------------------------------

function main() {
  const form = document.getElementById("login-form");
  if (form) {
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      form.querySelector("button").disabled = true;
      login(form);
    });
    return;
  }
  document.getElementById("logout-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    logout();
  });
  const app = document.getElementById("app");
  const path = location.pathname;
  const jobMatch = /^\/jobs\/([^/]+)$/.exec(path);
  if (jobMatch) {
    document.getElementById("nav-jobs").classList.add("active");
    const id = decodeURIComponent(jobMatch[1]);
    document.title = "gelastic: " + id;
    follow("/api/stream/jobs/" + encodeURIComponent(id), {
      job: (d) => renderJob(app, d),
      problem: (d) => setLive(d.error, false),
      end: (d, es) => { es.close(); setLive(d.reason, true); },
    });
    return;
  }
  const render = path === "/jobs" ? renderJobs : renderCluster;
  document.getElementById(path === "/jobs" ? "nav-jobs" : "nav-cluster").classList.add("active");
  follow("/api/stream/overview", {
    overview: (d) => { overview = d; overviewAt = Date.now(); render(app); },
    problem: (d) => setLive(d.error, false),
  });
  setInterval(() => { if (overview) render(app); }, 1000);
}

document.addEventListener("DOMContentLoaded", main);
