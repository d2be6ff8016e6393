// gpupool pool page: one fetch() stream of server-sent events from /admin/events (the admin key
// in a header: EventSource cannot send one), rendered with DOM calls only (no innerHTML with
// data), and the admin actions, each confirmed, with the key in a header too.
"use strict";

const KEY = "gpupool-admin-key";
const STATES = {
  ready: ["✓", "ok"], starting: ["◔", "warn"], warming: ["◑", "warn"],
  draining: ["⇣", "warn"], stopped: ["■", "idle"], failed: ["✕", "bad"],
  falling_asleep: ["☾", "idle"], asleep: ["☾", "idle"], waking: ["☀", "warn"],
};
const $ = (id) => document.getElementById(id);
let stream = null; // the AbortController of the open stream
let retry = null;
const cards = new Map(); // worker name -> its card's parts, kept so focus survives updates

function key() { return sessionStorage.getItem(KEY) || ""; }
function headers() {
  const k = key();
  return k ? { Authorization: "Bearer " + k } : {};
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : String(c));
  return e;
}

// ---- numbers with units, times in the viewer's zone ----
function time(ms) { return new Date(ms).toLocaleTimeString(); }
function secs(s) {
  if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}
function gib(b) { return b == null ? "unknown" : (b / 2 ** 30).toFixed(1) + " GiB"; }
function pct(x) { return (100 * x).toFixed(0) + " %"; }
function count(n) { return Math.round(n).toLocaleString(); }
function reqs(n) { return count(n) + (Math.round(n) === 1 ? " request" : " requests"); }

// ---- the stream ----
async function connect() {
  if (stream) stream.abort();
  clearTimeout(retry);
  const ctl = (stream = new AbortController());
  status("connecting…");
  let resp;
  try {
    resp = await fetch("/admin/events", { headers: headers(), signal: ctl.signal, cache: "no-store" });
  } catch (e) {
    return again(ctl, "cannot reach the gateway; retrying");
  }
  if (resp.status === 401 || resp.status === 403) {
    const why = await message(resp);
    const had = key();
    sessionStorage.removeItem(KEY);
    return showLogin(had ? "The gateway refused that key: " + why : "");
  }
  if (!resp.ok) return again(ctl, "the gateway answered " + resp.status + ": " + (await message(resp)));
  $("login").hidden = true;
  $("pool").hidden = false;
  $("signout").hidden = !key();
  status("live");
  const opened = Date.now();
  try {
    await read(resp.body.getReader(), ctl);
  } catch (e) {
    if (ctl.signal.aborted) return;
    return again(ctl, "the stream broke; reconnecting");
  }
  // The gateway ends each stream after a while (so that it can stop promptly): the next now.
  if (Date.now() - opened < 5000) return again(ctl, "the stream ended early; reconnecting");
  if (!ctl.signal.aborted && stream === ctl) connect();
}

function again(ctl, why) {
  if (ctl.signal.aborted || stream !== ctl) return;
  status(why);
  retry = setTimeout(connect, 2000);
}

async function read(reader, ctl) {
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done || ctl.signal.aborted) return;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6));
      if (data.length) render(JSON.parse(data.join("\n")));
    }
  }
}

async function message(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return resp.statusText || String(resp.status);
  }
}

function status(text) { $("link").textContent = text; }

function showLogin(why) {
  if (stream) stream.abort();
  $("pool").hidden = true;
  $("signout").hidden = true;
  $("login").hidden = false;
  status("admin key needed");
  if (why) $("login-why").textContent = why + " Enter the admin key.";
  $("key").focus();
}

// ---- rendering ----
function render(snap) {
  status("live · updated " + time(snap.at));
  renderGpus(snap);
  renderWorkers(snap.workers);
  $("workers-note").textContent = hiddenNote(snap.workers_hidden || {}, snap.workers_total);
  rows("queues", snap.queues, (q) => [
    q.model, reqs(q.depth), q.depth ? secs(q.oldest_wait_s) : "—", reqs(q.rejected_last_min),
  ]);
  rows("errors", snap.errors, (e) => [
    time(e.at), e.request_id ? el("code", {}, e.request_id) : "—", e.source, e.message,
  ], "no errors logged since the gateway started");
  list("changes", snap.changes, (c) => {
    const li = el("li", {}, time(c.at) + " · " + c.worker + " (" + c.model + "): ");
    li.append(stateBadge(c.from), " → ", stateBadge(c.to));
    return li;
  }, "no state changes yet");
  list("reloads", snap.reloads, (r) =>
    el("li", {}, time(r.at) + " · reloaded: " + r.models + " models, " + r.workers + " workers"),
  "no reloads since the gateway started");
}

function renderGpus(snap) {
  $("gpus-note").textContent = snap.gpus_known ? "" :
    "NVML is not available here: GPU memory is unknown; GPUs listed are those the workers are launched on.";
  const groups = snap.swap_groups || [];
  rows("gpus", snap.gpus, (g) => [
    "GPU " + g.index + (g.name ? " · " + g.name : ""),
    g.memory_total_bytes == null ? "unknown" : gib(g.memory_used_bytes) + " / " + gib(g.memory_total_bytes),
    (g.workers.join(", ") || "—") + groups.filter((sg) => sg.members.some((m) => g.workers.includes(m)))
      .map((sg) => " · " + turnText(sg, snap.at)).join(""),
  ], "no GPUs known (workers on CPU, or url: workers on other hosts)");
}

// a swap group's turn: who holds the GPU, how many switches, the last one
function turnText(sg, atMs) {
  const holder = sg.holder ? "held by " + sg.holder : "free";
  const n = sg.switches + (sg.switches === 1 ? " switch" : " switches");
  const last = sg.last_switch_at == null ? "" :
    ", last " + secs(Math.max(0, atMs / 1000 - sg.last_switch_at)) + " ago (" + sg.last_switch_s.toFixed(1) + " s)";
  return "swap group " + sg.name + ": " + holder + ", " + n + last;
}

function rows(id, items, cells, empty) {
  const body = $(id).tBodies[0];
  const out = items.map((it) => el("tr", {}, ...cells(it).map((c) => el("td", { class: "msg" }, c))));
  if (!out.length && empty) out.push(el("tr", {}, el("td", { colspan: "4", class: "note" }, empty)));
  body.replaceChildren(...out);
}

function list(id, items, item, empty) {
  const out = items.map(item);
  if (!out.length) out.push(el("li", { class: "note" }, empty));
  $(id).replaceChildren(...out);
}

function stateBadge(state) {
  const [icon, tone] = STATES[state] || ["?", "idle"];
  return el("span", { class: "state " + tone, "data-state": state }, icon + " " + state.replace("_", " "));
}

// A large pool (thousands of discovered addresses) sends cards for some workers only (those
// not ready first) and counts the others by state: say so under the cards.
function hiddenNote(hidden, total) {
  const parts = Object.entries(hidden).map(([state, n]) => n + " " + state.replace("_", " "));
  if (!parts.length) return "";
  const n = Object.values(hidden).reduce((a, b) => a + b, 0);
  return n + " of " + total + " workers not shown (" + parts.join(", ") +
    "); GET /admin/workers?offset=… lists them all.";
}

function renderWorkers(workers) {
  const seen = new Set();
  for (const w of workers) {
    seen.add(w.name);
    let card = cards.get(w.name);
    if (!card) {
      card = makeCard(w.name);
      cards.set(w.name, card);
      $("workers").append(card.root);
    }
    fillCard(card, w);
  }
  for (const [name, card] of cards) {
    if (!seen.has(name)) { card.root.remove(); cards.delete(name); }
  }
}

function makeCard(name) {
  const c = { root: el("article", { class: "card", "data-worker": name }) };
  c.title = el("h3", {}, name);
  c.model = el("p", { class: "model" });
  c.state = el("p", { class: "state-line" });
  c.facts = el("dl");
  c.chart = el("div", { class: "chart-box" });
  c.error = el("p", { class: "error" });
  c.buttons = {};
  const actions = el("div", { class: "actions" });
  for (const [act, label] of [["drain", "Drain"], ["undrain", "Resume"], ["stop", "Stop"],
                              ["restart", "Restart"], ["sleep", "Sleep"], ["wake", "Wake"]]) {
    const b = el("button", { type: "button", "data-action": act }, label);
    b.addEventListener("click", () => { if (confirm(ask(act, name))) workerAction(act, name, b); });
    c.buttons[act] = b;
    actions.append(b);
  }
  c.root.append(c.title, c.model, c.state, c.facts, c.chart, c.error, actions);
  return c;
}

function ask(act, name) {
  return {
    drain: "Drain worker " + name + "? It takes no new requests; running ones finish. A " +
      "launched worker's process stays up, so Resume is instant.",
    undrain: "Resume worker " + name + "? It takes requests again once it answers.",
    stop: "Stop worker " + name + "? It takes no new requests; running ones finish, then " +
      "its process ends (Resume starts it again).",
    restart: "Restart worker " + name + "? Its running requests end with an error.",
    sleep: "Put worker " + name + " to sleep? Its running requests finish first.",
    wake: "Wake worker " + name + "? The awake worker of its group is put to sleep.",
  }[act];
}

function fillCard(c, w) {
  c.model.textContent = w.model + (w.swap_group ? " · swap group " + w.swap_group : "");
  const badge = stateBadge(w.state);
  badge.classList.add("state-label");
  c.state.replaceChildren(badge, " for " + secs(w.state_for_s));
  const kv = el("meter", { min: "0", max: "1", value: String(w.kv_cache), "aria-label": "KV-cache use" });
  const facts = [
    ["Window", w.window == null ? "unknown" : count(w.window) + " tokens"],
    ["In flight", count(w.inflight) + " of " + reqs(w.capacity)],
    ["vLLM running / waiting", ["asleep", "waking"].includes(w.state) ? "— (asleep)" :
      count(w.running) + " / " + reqs(w.waiting)],
    ["KV cache", [kv, " " + pct(w.kv_cache)]],
    ["Restarts", count(w.restarts)],
    ["GPUs", w.gpus && w.gpus.length ? w.gpus.join(", ") : "—"],
  ];
  if (w.kv_index) {
    const ix = w.kv_index;
    facts.push(["Prefix index", (ix.blocks == null ? "—" : count(ix.blocks) + " blocks") +
      (ix.precise ? " · precise" : " · approximate: " + ix.reason)]);
  }
  c.facts.replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, ...[].concat(v))]));
  c.chart.replaceChildren(chart(w.tokens_per_s));
  c.error.textContent = w.last_error ? "Last error: " + w.last_error : "";
  c.error.hidden = !w.last_error;
  const asleep = ["asleep", "falling_asleep", "waking"].includes(w.state);
  const out = ["draining", "stopped"].includes(w.state);
  c.buttons.drain.hidden = out || asleep;
  c.buttons.undrain.hidden = !out;
  c.buttons.stop.hidden = !w.supervised || w.state === "stopped";
  c.buttons.restart.hidden = !w.supervised;
  c.buttons.sleep.hidden = !w.swap_group || asleep || out || w.state === "failed";
  c.buttons.wake.hidden = !w.swap_group || !asleep;
}

function chart(points) {
  const NS = "http://www.w3.org/2000/svg";
  const W = 300, H = 44;
  const last = points.length ? points[points.length - 1][1] : 0;
  const peak = Math.max(1, ...points.map((p) => p[1]));
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  const label = "Completion tokens per second, last " + Math.round(points.length * 5 / 60) +
    " min: now " + last.toFixed(1) + " tok/s, peak " + peak.toFixed(1) + " tok/s";
  svg.setAttribute("aria-label", label);
  const base = document.createElementNS(NS, "line");
  for (const [k, v] of [["x1", 0], ["y1", H - 1], ["x2", W], ["y2", H - 1]]) base.setAttribute(k, v);
  svg.append(base);
  if (points.length > 1) {
    const t0 = points[0][0], span = Math.max(1, points[points.length - 1][0] - t0);
    const line = document.createElementNS(NS, "polyline");
    line.setAttribute("points", points.map(([t, v]) =>
      ((t - t0) / span * W).toFixed(1) + "," + (H - 2 - v / peak * (H - 4)).toFixed(1)).join(" "));
    svg.append(line);
  }
  const box = el("figure", { class: "tput" });
  box.append(svg, el("figcaption", { class: "note" }, points.length > 1 ? label :
    "tokens/s: collecting (a point every 5 s)"));
  return box;
}

// ---- actions: the existing admin routes, the key in a header ----
async function act(path, what, button) {
  if (button) button.disabled = true;
  show(what + ": working…", null);
  try {
    const resp = await fetch(path, { method: "POST", headers: headers(), cache: "no-store" });
    if (resp.ok) {
      const body = await resp.json();
      const state = body.state ? " (now " + leadsTo(body) + ")" : "";
      const undone = body.policy_note ? " It will not last: " + body.policy_note + "." : "";
      show(what + ": done" + state + " at " + time(Date.now()) + "." + undone, true);
    } else {
      show(what + ": refused (" + resp.status + "): " + (await message(resp)), false);
      if (resp.status === 401 || resp.status === 403) showLogin("The gateway refused the key.");
    }
  } catch (e) {
    show(what + ": failed: " + e, false);
  } finally {
    if (button) button.disabled = false;
  }
}

// The state an action leaves a worker in (its answer), and what follows from it.
function leadsTo(w) {
  const launched = w.supervised;
  return {
    starting: "starting; it takes requests once it answers",
    warming: "warming up; it takes requests once ready",
    draining: "draining: it takes no new requests" + (launched ? ", its process stays up" : ""),
    stopped: launched ? "stopped: its process has ended" : "stopped: it gets no requests",
  }[w.state] || w.state.replace("_", " ");
}

function workerAction(action, name, button) {
  const verbs = { drain: "Drain", undrain: "Resume", stop: "Stop", restart: "Restart",
                  sleep: "Sleep", wake: "Wake" };
  return act("/admin/workers/" + encodeURIComponent(name) + "/" + action, verbs[action] + " " + name, button);
}

function show(text, ok) {
  const r = $("result");
  r.hidden = false;
  r.textContent = (ok === true ? "✓ " : ok === false ? "✕ " : "… ") + text;
  r.className = "result" + (ok === true ? " ok" : ok === false ? " bad" : "");
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    connect();
  });
  $("signout").addEventListener("click", () => { sessionStorage.removeItem(KEY); showLogin(""); });
  // "key": the admin API needs the key (auth on); "open": it does not (loopback, auth off).
  // Ask for the key before any request, rather than learn it from a 401.
  const admin = document.querySelector('meta[name="gpupool-admin"]').content;
  if (admin === "key" && !key()) return showLogin("");
  $("reload").addEventListener("click", (ev) => {
    if (confirm("Reload the config file? Changed workers are replaced in their turn.")) {
      act("/admin/reload", "Reload the config", ev.currentTarget);
    }
  });
  connect();
});
