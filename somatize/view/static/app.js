// The somatize view: one page, routed by the address's #fragment, drawn from the view's
// JSON. Every text from the store goes in with textContent, never as markup: records are
// written by other people's processes. A page reads again when the server says what it
// shows changed (Server-Sent Events, read with fetch so that they carry the token).
"use strict";

const $ = (id) => document.getElementById(id);
let streams = [];

// The token that opens this view comes once, in the fragment of the address the view printed
// (#token=..., which a browser never sends anywhere). It is kept in this origin's storage
// (one per port: no other server's page reads it) and leaves the address bar; every request
// of the page sends it as a header. Never a cookie: a browser sends those to every port.
const TOKEN = "somatize-view-token";
let kept = null; // where storage is refused
function takeToken() {
  const given = /^#token=([A-Za-z0-9_-]{1,200})$/.exec(location.hash);
  if (!given) return;
  try {
    localStorage.setItem(TOKEN, given[1]);
  } catch (error) {
    kept = given[1];
  }
  history.replaceState(null, "", location.pathname);
}

function withToken() {
  let token = kept;
  try {
    token = token || localStorage.getItem(TOKEN);
  } catch (error) { /* storage refused: only what this page was given */ }
  return token ? { Authorization: "token " + token } : {};
}
let drawing = 0; // the latest drawing begun: an older one's answer, come late, is dropped
const STALE = new Error("a later drawing has begun");

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

function seconds(s) {
  if (s < 60) return s.toFixed(1) + " s";
  const whole = Math.floor(s);
  if (whole < 3600) return `${Math.floor(whole / 60)} min ${String(whole % 60).padStart(2, "0")} s`;
  return `${Math.floor(whole / 3600)} h ${String(Math.floor(whole / 60) % 60).padStart(2, "0")} min`;
}

// a time the server measured (seconds, as of its answer), going on by this page's clock
// until the next answer: the value comes from the record, only the ticking is the page's
function ticking(s, after) {
  if (s === null || s === undefined) return el("span", "unknown");
  const span = el("span", seconds(s) + after, "ticking");
  Object.assign(span.dataset, { base: String(s), at: String(performance.now()), after, seconds: String(s) });
  return span;
}

setInterval(() => {
  for (const span of document.querySelectorAll("span.ticking")) {
    const s = Number(span.dataset.base) + (performance.now() - Number(span.dataset.at)) / 1000;
    span.dataset.seconds = String(s);
    span.textContent = seconds(s) + span.dataset.after;
  }
}, 1000);

// a run's state at a glance: running (written within its pace), ended (and how), or silent
function status(s) {
  if (!s) return el("span", "");
  if (s.state === "ended") return el("span", `ended (${s.how})`, `status ended ${s.how}`);
  if (s.state === "running") {  // silent once its pace passes with nothing written (no drawing comes then)
    const span = el("span", "running", "status running");
    Object.assign(span.dataset, { quiet: String(s.quiet_s), at: String(performance.now()), after: String(s.silent_after_s) });
    return span;
  }
  return silent(el("span"), s.quiet_s);
}

function silent(span, quiet) {
  span.className = "status silent";
  span.replaceChildren("silent, last written ", ticking(quiet, " ago"));
  return span;
}

setInterval(() => {
  for (const span of document.querySelectorAll("span.status.running")) {
    const quiet = Number(span.dataset.quiet) + (performance.now() - Number(span.dataset.at)) / 1000;
    if (quiet > Number(span.dataset.after)) silent(span, quiet);
  }
}, 1000);

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
  const mine = drawing;
  const answer = await fetch(path, { headers: withToken(), cache: "no-store" });
  const raw = await answer.text();
  let body;
  try {
    body = JSON.parse(raw);
  } catch (error) {
    body = { error: raw.slice(0, 300) || answer.statusText }; // a refusal says why, as text
  }
  if (mine !== drawing) throw STALE;
  if (!answer.ok) throw new Error(body.error || answer.statusText);
  return body;
}

// the score against one parameter's value: points, no line (x in order, as uPlot wants)
function scatter(parent, index, p) {
  const box = el("div", undefined, "chart");
  box.id = "parameter-" + index;
  box.dataset.points = String(p.points.length);
  box.dataset.parameter = p.name;
  parent.appendChild(box);
  if (!p.points.length || typeof uPlot === "undefined") {
    box.appendChild(el("p", p.name + ": no trial done with it yet"));
    return;
  }
  new uPlot({
    title: p.name, width: 360, height: 220,
    scales: { x: { time: false, distr: p.log ? 3 : 1 } },
    axes: [{ label: p.log ? "value (log scale)" : "value" }, { label: "score" }],
    series: [{ label: "value" }, { label: "score", stroke: "#0969da", fill: "#0969da", paths: () => null, points: { show: true, size: 5 } }],
  }, [p.points.map((q) => q[0]), p.points.map((q) => q[1])], box);
  if (p.count > p.points.length) box.appendChild(el("p", `${p.count} trials, drawn from ${p.points.length}: the lowest and highest score of each stretch of values`, "thinned"));
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
    ["status", (r) => status(r.status)],
    ["forwards", (r) => r.forwards, "num"],
    ["last state", (r) => r.state, (r) => r.state],
    ["last took", (r) => took(r.took_us), "num"],
    ["last loss", (r) => r.loss, "num"],
  ], rows));
}

async function runPage(run, from) {
  const body = await read(`/api/run/${encodeURIComponent(run)}?from=${from || 0}`);
  clear(`Run ${body.run}`, `; ${body.count} forwards; summarised kinds: ${body.kinds.join(", ") || "none"}`);
  const state = status(body.status);
  state.id = "status";
  $("note").prepend(state);
  chart("curve", "loss per forward", ["forward", "loss"], body.curve.map((p) => p[0]), body.curve.map((p) => p[1]));
  chart("took", "took per forward (µs)", ["forward", "took_us"], body.took.map((p) => p[0]), body.took.map((p) => p[1]));
  Object.entries(body.series || {}).forEach(([kind, points], i) => {  // every other summarised number
    chart(`series-${i}`, `${kind} per forward`, ["forward", kind], points.map((p) => p[0]), points.map((p) => p[1]));
  });
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

const SAID = ["kind", "machine", "load1", "load5", "load15", "rss_bytes", "slices", "pid"]; // shown in their own columns

async function machinesPage(asked) {
  const body = await read("/api/machines" + (asked ? "?run=" + encodeURIComponent(asked) : ""));
  const names = Object.keys(body.said).sort();
  const hosts = Object.keys(body.fleet).sort();
  clear("Machines", body.run ? `run ${body.run}` + (asked ? "" : ", the run written last") : "no run recorded in this store yet");
  const tables = $("tables");
  tables.appendChild(el("h2", "Fleet: what each machine did in the run's last 100 forwards"));
  const pick = el("select");
  pick.id = "run-picker";
  pick.appendChild(el("option", "the run written last" + (body.newest ? ` (${body.newest})` : "")));
  pick.firstChild.value = "";
  for (const run of asked && !body.runs.includes(asked) ? [asked, ...body.runs] : body.runs) {
    const option = el("option", run);
    option.value = run;
    pick.appendChild(option);
  }
  pick.value = asked || "";
  pick.addEventListener("change", () => { location.hash = pick.value ? "#/machines/" + encodeURIComponent(pick.value) : "#/machines"; });
  const choosing = el("p", "run: ");
  choosing.appendChild(pick);
  if (body.runs_count > body.runs.length) choosing.appendChild(el("span", ` (the ${body.runs.length} written last of ${body.runs_count})`));
  tables.appendChild(choosing);
  if (hosts.length) {
    tables.appendChild(table("fleet", [
      ["host", (h) => h], ["machine", (h) => body.fleet[h].machine || ""], ["pid", (h) => body.fleet[h].pid || "", "num"],
      ["slices", (h) => body.fleet[h].slices, "num"], ["ran there", (h) => took(body.fleet[h].took_us), "num"],
      ["waiting", (h) => took(body.fleet[h].waiting_us), "num"], ["items", (h) => body.fleet[h].items, "num"],
      ["items/s", (h) => body.fleet[h].items_per_s, "num"],
    ], hosts));
  } else {
    tables.appendChild(el("p", body.run ? "nothing of this run ran on another machine" : "no run to show", "empty"));
  }
  tables.appendChild(el("h2", "What each machine last said about itself"));
  if (!names.length) {
    tables.appendChild(el("p", "no machine has reported to this store", "empty"));
    return;
  }
  const said = (m, k) => body.said[m][k] || "";
  tables.appendChild(table("machines", [
    ["machine", (m) => m], ["reported", (m) => ticking(body.ages[m], " ago"), "num"],
    ["load (1, 5, 15 min)", (m) => [said(m, "load1"), said(m, "load5"), said(m, "load15")].join(" ").trim()],
    ["memory", (m) => (said(m, "rss_bytes") ? (Number(said(m, "rss_bytes")) / 2 ** 20).toFixed(1) + " MiB" : ""), "num"],
    ["slices served", (m) => said(m, "slices"), "num"], ["pid", (m) => said(m, "pid"), "num"],
    ["also said", (m) => Object.entries(body.said[m]).filter(([k]) => !SAID.includes(k)).map(([k, v]) => `${k}=${v}`).join("  ")],
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
  const sign = { maximize: -1, minimize: 1 }[body.direction];  // none: no best is drawn
  let so = null;
  const bestSoFar = body.scores.map(([, s]) => (sign === undefined ? null
    : (so = so === null || sign * s < sign * so ? s : so)));
  chart("scores", "score per trial, and the best so far", ["trial", "score", "best so far"],
    body.scores.map((p) => p[0]), body.scores.map((p) => p[1]), bestSoFar);
  parametersOf(body.parameters);
  runningOf(body.running, body.patience);
  $("tables").appendChild(el("h2", "Trials"));
  $("tables").appendChild(table("trials", [
    ["trial", (t) => t.trial, "num"], ["state", (t) => t.state, (t) => t.state],
    ["attempts", (t) => t.attempts, "num"], ["score", (t) => t.score, "num"], ["took", (t) => took(t.took_us), "num"],
    ["runner", (t) => t.runner], ["config", (t) => JSON.stringify(t.config)], ["error", (t) => t.error || ""],
  ], body.trials));
  pager(body, (start) => `#/study/${encodeURIComponent(name)}?from=${start}`);
}

function parametersOf(parameters) {
  const charts = $("charts");
  charts.appendChild(el("h2", "Score against each parameter (done trials with a finite score)"));
  const box = el("div");
  box.id = "parameters";
  charts.appendChild(box);
  parameters.drawn.forEach((p, i) => scatter(box, i, p));
  if (!parameters.drawn.length && !parameters.not_drawn.length) box.appendChild(el("p", "no parameter yet", "empty"));
  for (const p of parameters.not_drawn) {
    const values = p.values.join(", ") + (p.distinct > p.values.length ? `, … (${p.distinct} values)` : "");
    const line = el("p", `${p.name}: not drawn, its values are not all numbers (a category, a flag or a text)` +
      (values ? `: ${values}` : ""), "not-drawn");
    line.dataset.parameter = p.name;
    charts.appendChild(line);
  }
  if (parameters.more) charts.appendChild(el("p", `and ${parameters.more} more parameters, not drawn`, "not-drawn"));
}

function runningOf(running, patience) {
  const tables = $("tables");
  tables.appendChild(el("h2", `Running now (${running.count})`));
  if (!running.count) {
    tables.appendChild(el("p", "no trial is running", "empty"));
    return;
  }
  tables.appendChild(table("running", [
    ["trial", (t) => t.trial, "num"], ["runner", (t) => t.runner], ["attempt", (t) => t.attempt, "num"],
    ["running for", (t) => ticking(t.running_s, ""), "num since"],
    ["last written", (t) => ticking(t.written_s_ago, " ago"), "num"],
    ["still writing?", (t) => heard(t.written_s_ago, patience), "alive"],
    ["config", (t) => JSON.stringify(t.config)],
  ], running.running));
  if (running.count > running.running.length) tables.appendChild(el("p", `and ${running.count - running.running.length} more`, "more"));
}

// whether a trial's runner still writes: it writes every third of the study's patience, so
// one silent for more than one and a half of those has gone silent; past the patience,
// another runner takes its trial over (at its next look). Judged again every second.
function heard(ago, patience) {
  const span = el("span", "", "heard");
  if (ago === null || ago === undefined || patience === null || patience === undefined) return span;
  Object.assign(span.dataset, { ago: String(ago), at: String(performance.now()), patience: String(patience) });
  judgeHeard(span);
  return span;
}

function judgeHeard(span) {
  const ago = Number(span.dataset.ago) + (performance.now() - Number(span.dataset.at)) / 1000;
  const patience = Number(span.dataset.patience);
  if (ago <= patience / 2) {
    span.className = "heard writing";
    span.textContent = "writing";
  } else if (ago <= patience) {
    span.className = "heard silent";
    span.textContent = `silent: taken over in about ${Math.ceil(patience - ago)} s`;
  } else {
    span.className = "heard silent";
    span.textContent = `silent past the patience (${patience} s): taken over at another runner's next look`;
  }
}

setInterval(() => { for (const span of document.querySelectorAll("span.heard[data-ago]")) judgeHeard(span); }, 1000);

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
  // the run written last may change to another: its page listens to every run, and to the machines
  if (parts[0] === "machines" && parts[1]) return [`machines:${parts[1]}`, () => machinesPage(parts[1])];
  if (parts[0] === "machines") return [["machines", "runs"], () => machinesPage()];
  if (parts[0] === "studies") return ["studies", studiesPage];
  if (parts[0] === "study") return [`study:${parts[1]}`, () => studyPage(parts[1], from)];
  return ["runs", runsPage];
}

async function draw(page) {
  drawing += 1;
  try {
    await page();
  } catch (error) {
    if (error === STALE) return;
    clear("Cannot show this", String(error.message || error));
  }
  document.body.dataset.drawn = String(Number(document.body.dataset.drawn || 0) + 1);
}

// One stream of changes for `subject`, read with fetch (an EventSource cannot send the
// token); opened again a moment after it ends. `page` is drawn each time it opens (a change
// between a drawing and the stream's first look is never missed) and at each change.
function listen(subject, page) {
  const control = new AbortController();
  (async () => {
    while (!control.signal.aborted) {
      let wait = 1000;
      try {
        const answer = await fetch("/api/events?subject=" + encodeURIComponent(subject),
          { headers: withToken(), cache: "no-store", signal: control.signal });
        if (answer.ok && answer.body) {
          $("live").classList.add("on");
          draw(page);
          const reader = answer.body.getReader();
          const text = new TextDecoder();
          let buffer = "";
          for (;;) {
            const { value, done } = await reader.read();
            if (done) break;
            buffer += text.decode(value, { stream: true });
            let end;
            while ((end = buffer.indexOf("\n\n")) >= 0) {
              const message = buffer.slice(0, end).split("\n");
              buffer = buffer.slice(end + 2);
              if (message.includes("event: changed")) draw(page);
            }
          }
        } else {
          if (answer.status === 403 || answer.status === 400 || answer.status === 421) return; // asking again changes nothing
          wait = answer.status === 429 ? 5000 : 3000;
          await answer.body?.cancel();
        }
      } catch (error) {
        if (control.signal.aborted) return;
      }
      $("live").classList.remove("on");
      await new Promise((resolve) => setTimeout(resolve, wait));
    }
  })();
  return { close: () => control.abort() };
}

function open() {
  takeToken(); // on the first load, and when the address is given to a page already open
  const [subjects, page] = route();
  for (const stream of streams) stream.close();
  $("live").classList.remove("on");
  draw(page);
  streams = [].concat(subjects).map((subject) => listen(subject, page));
}

window.addEventListener("hashchange", open);
open();
