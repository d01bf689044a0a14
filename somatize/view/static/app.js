// The somatize view: one page, routed by the address's #fragment, drawn from the view's
// JSON. Every text from the store goes in with textContent, never as markup: records are
// written by other people's processes. A page reads again when the server says what it
// shows changed (Server-Sent Events).
"use strict";

const $ = (id) => document.getElementById(id);
let stream = null;

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function link(text, hash) {
  const a = el("a", text);
  a.href = hash;
  return a;
}

function show(value) {
  if (value === null || value === undefined) return "";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toPrecision(6);
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

function took(us) {
  if (us === null || us === undefined) return "";
  return us < 1e6 ? (us / 1e3).toPrecision(3) + " ms" : (us / 1e6).toPrecision(3) + " s";
}

// a table of rows; columns: [heading, (row) => value or node, class]
function table(id, columns, rows) {
  const t = el("table");
  t.id = id;
  const head = el("tr");
  for (const [name] of columns) head.appendChild(el("th", name));
  t.appendChild(head);
  for (const row of rows) {
    const tr = el("tr");
    for (const [, get, cls] of columns) {
      const value = get(row);
      const td = el("td", undefined, typeof cls === "function" ? cls(row) : cls);
      if (value instanceof Node) td.appendChild(value); else td.textContent = show(value);
      tr.appendChild(td);
    }
    t.appendChild(tr);
  }
  return t;
}

function chart(id, title, labels, xs, ...series) {
  const box = el("div", undefined, "chart");
  box.id = id;
  box.dataset.points = String(xs.length);
  $("charts").appendChild(box);
  if (!xs.length || typeof uPlot === "undefined") {
    box.appendChild(el("p", title + ": nothing yet"));
    return;
  }
  const colours = ["#0969da", "#bf3989", "#1a7f37"];
  new uPlot({
    title, width: 520, height: 240,
    scales: { x: { time: false } },
    series: [{ label: labels[0] }, ...labels.slice(1).map((label, i) => ({ label, stroke: colours[i % 3], points: { size: 4 } }))],
  }, [xs, ...series], box);
}

async function read(path) {
  const answer = await fetch(path, { credentials: "same-origin" });
  const body = await answer.json().catch(() => ({ error: answer.statusText }));
  if (!answer.ok) throw new Error(body.error || answer.statusText);
  return body;
}

function clear(title, note) {
  $("title").textContent = title;
  $("note").textContent = note || "";
  $("charts").replaceChildren();
  $("tables").replaceChildren();
}

// -- pages ------------------------------------------------------------------------------

async function runsPage() {
  const rows = await read("/api/runs");
  clear("Runs", rows.length ? `${rows.length} runs, newest first` : "no run recorded in this store yet");
  $("tables").appendChild(table("runs", [
    ["run", (r) => link(r.run, "#/run/" + encodeURIComponent(r.run))],
    ["forwards", (r) => r.forwards, "num"],
    ["last state", (r) => r.state, (r) => r.state],
    ["last took", (r) => took(r.took_us), "num"],
    ["last loss", (r) => r.loss, "num"],
  ], rows));
}

async function runPage(run, from) {
  const body = await read(`/api/run/${encodeURIComponent(run)}?from=${from || 0}`);
  clear(`Run ${body.run}`, `${body.count} forwards; summarised kinds: ${body.kinds.join(", ") || "none"}`);
  chart("curve", "loss per forward", ["forward", "loss"], body.curve.map((p) => p[0]), body.curve.map((p) => p[1]));
  chart("took", "took per forward (µs)", ["forward", "took_us"], body.took.map((p) => p[0]), body.took.map((p) => p[1]));
  const columns = [
    ["forward", (r) => link(r.forward, `#/run/${encodeURIComponent(run)}/facts/${r.forward}`), "num"],
    ["state", (r) => r.state, (r) => r.state],
    ["took", (r) => took(r.took_us), "num"],
    ["nodes", (r) => r.nodes, "num"],
    ["facts", (r) => r.facts, "num"],
    ...body.kinds.map((k) => [k, (r) => r[k], "num"]),
    ["error", (r) => r.error || ""],
  ];
  $("tables").appendChild(el("h2", "Forwards"));
  $("tables").appendChild(table("forwards", columns, body.forwards));
  pager(body, (start) => `#/run/${encodeURIComponent(run)}?from=${start}`);
  const costs = await read(`/api/run/${encodeURIComponent(run)}/nodes?last=100`);
  $("tables").appendChild(el("h2", "Nodes (the last 100 forwards)"));
  $("tables").appendChild(table("nodes", [
    ["node", (r) => r.node], ["ran", (r) => r.ran, "num"], ["took", (r) => took(r.took_us), "num"],
    ["recalled", (r) => r.recalled, "num"], ["failed", (r) => r.failed, "num"], ["host", (r) => r.host || ""],
  ], costs));
}

async function factsPage(run, forward) {
  const rows = await read(`/api/run/${encodeURIComponent(run)}/facts/${forward}`);
  clear(`Run ${run}, forward ${forward}`, `${rows.length} facts, in order`);
  $("tables").appendChild(table("facts", [
    ["fact", (f) => f.fact],
    ["what it said", (f) => Object.entries(f).filter(([k]) => k !== "fact").map(([k, v]) => `${k}=${v}`).join("  ")],
  ], rows));
}

async function machinesPage() {
  const body = await read("/api/machines");
  const names = Object.keys(body.said).sort();
  clear("Machines", names.length ? "what each machine last said about itself" : "no machine has reported to this store");
  $("tables").appendChild(table("machines", [
    ["machine", (m) => m], ...["load", "memory", "served", "pid", "at"].map((k) => [k, (m) => body.said[m][k] || ""]),
  ], names));
}

async function studiesPage() {
  const body = await read("/api/studies");
  const names = Object.keys(body).sort();
  clear("Studies", names.length ? `${names.length} studies` : "no study defined in this store");
  $("tables").appendChild(table("studies", [
    ["study", (s) => link(s, "#/study/" + encodeURIComponent(s))],
    ["direction", (s) => body[s].direction], ["trials", (s) => body[s].trials, "num"],
    ["sampler", (s) => body[s].sampler || ""], ["objective", (s) => body[s].objective || ""],
  ], names));
}

async function studyPage(name, from) {
  const body = await read(`/api/study/${encodeURIComponent(name)}?from=${from || 0}`);
  const states = {};
  for (const t of body.trials) states[t.state] = (states[t.state] || 0) + 1;
  const best = body.best ? `; best ${show(body.best.score)} (trial ${body.best.trial})` : "";
  clear(`Study ${body.study}`, `${body.direction}; ${body.count} trials claimed: ` +
    Object.entries(states).map(([s, n]) => `${n} ${s}`).join(", ") + best);
  const sign = body.direction === "maximize" ? -1 : 1;
  let so = null;
  const bestSoFar = body.scores.map(([, s]) => (so = so === null || sign * s < sign * so ? s : so));
  chart("scores", "score per trial, and the best so far", ["trial", "score", "best so far"],
    body.scores.map((p) => p[0]), body.scores.map((p) => p[1]), bestSoFar);
  $("tables").appendChild(table("trials", [
    ["trial", (t) => t.trial, "num"], ["state", (t) => t.state, (t) => t.state],
    ["attempts", (t) => t.attempts, "num"], ["score", (t) => t.score, "num"], ["took", (t) => took(t.took_us), "num"],
    ["runner", (t) => t.runner], ["config", (t) => JSON.stringify(t.config)], ["error", (t) => t.error || ""],
  ], body.trials));
  pager(body, (start) => `#/study/${encodeURIComponent(name)}?from=${start}`);
}

function pager(body, hash) {
  const rows = body.forwards || body.trials;
  if (body.count <= rows.length) return;
  const p = el("p", `rows ${body.from} to ${body.from + rows.length - 1} of ${body.count}: `, "more");
  if (body.from > 0) p.appendChild(link("earlier", hash(Math.max(0, body.from - rows.length))));
  if (body.from + rows.length < body.count) { p.appendChild(el("span", " ")); p.appendChild(link("later", hash(body.from + rows.length))); }
  $("tables").appendChild(p);
}

// -- routing and live updates -----------------------------------------------------------

function route() {
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const from = new URLSearchParams(query || "").get("from") || 0;
  if (parts[0] === "run" && parts[2] === "facts") return [`run:${parts[1]}`, () => factsPage(parts[1], parts[3])];
  if (parts[0] === "run") return [`run:${parts[1]}`, () => runPage(parts[1], from)];
  if (parts[0] === "machines") return ["machines", machinesPage];
  if (parts[0] === "studies") return ["studies", studiesPage];
  if (parts[0] === "study") return [`study:${parts[1]}`, () => studyPage(parts[1], from)];
  return ["runs", runsPage];
}

async function draw(page) {
  try {
    await page();
  } catch (error) {
    clear("Cannot show this", String(error.message || error));
  }
  document.body.dataset.drawn = String(Number(document.body.dataset.drawn || 0) + 1);
}

function open() {
  const [subject, page] = route();
  if (stream) stream.close();
  draw(page);
  stream = new EventSource("/api/events?subject=" + encodeURIComponent(subject));
  // drawn once the stream is open (and again each time it reopens): a change between a
  // drawing and the stream's first look is never missed
  stream.addEventListener("open", () => { $("live").classList.add("on"); draw(page); });
  stream.addEventListener("error", () => $("live").classList.remove("on"));
  stream.addEventListener("changed", () => draw(page));
}

window.addEventListener("hashchange", open);
open();
