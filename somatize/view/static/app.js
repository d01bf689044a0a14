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
function table(id, columns, rows, headings) {
  const t = el("table");
  t.id = id;
  const head = el("tr");
  for (const [name] of columns) {
    const th = el("th");
    const given = headings && headings[name];
    if (given) th.appendChild(given); else th.textContent = name;
    head.appendChild(th);
  }
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

// whether `y` ("log" or "linear") draws these columns of values on a log scale: only where
// every value is above 0; a chart asked for log that cannot be says so (`cannotLog`)
function loggable(y, columns) {
  return y === "log" && columns.every((ys) => ys.every((v) => v === null || v > 0));
}

function cannotLog(box) {
  box.appendChild(el("p", "a value of 0 or below: drawn on a linear scale", "outside"));
}

function chart(id, title, labels, xs, series, y) {
  const box = el("div", undefined, "chart");
  box.id = id;
  box.dataset.points = String(xs.length);
  const logged = loggable(y, series);
  box.dataset.y = logged ? "log" : "linear";
  $("charts").appendChild(box);
  if (!xs.length || typeof uPlot === "undefined") {
    box.appendChild(el("p", title + ": nothing yet"));
    return;
  }
  const colours = ["#0969da", "#bf3989", "#1a7f37"];
  box.plot = new uPlot({
    title, width: 520, height: 240,
    scales: { x: { time: false }, y: logged ? { distr: 3 } : {} },
    axes: [{}, logged ? { size: fitted, values: (u, splits) => splits.map(tick) } : { size: fitted }],
    series: [{ label: labels[0] }, ...labels.slice(1).map((label, i) => ({ label, stroke: colours[i % 3], points: { size: 4 } }))],
  }, [xs, ...series], box);
  if (y === "log" && !logged) cannotLog(box);
}

// a y axis as wide as its widest label, measured as uPlot will draw it (its default width
// clips long ones: "10,000" shown as "0,000")
// (uPlot asks again as its ticks settle: the size only grows, so that it settles too)
function fitted(self, values, axisIdx, cycleNum) {
  const axis = self.axes[axisIdx];
  let widest = 0;
  self.ctx.font = axis.font[0];
  for (const value of values || []) widest = Math.max(widest, self.ctx.measureText(String(value)).width);
  const size = Math.ceil(axis.ticks.size + axis.gap + widest / devicePixelRatio) + 6;
  return cycleNum > 1 ? Math.max(size, axis._size || 0) : size;
}

const COLOURS = ["#0969da", "#bf3989", "#1a7f37", "#9a6700", "#8250df", "#cf222e", "#0a7e8c", "#57606a"];

// one chart of `series` ([{label, stroke, faint}]) drawn from `data` ([xs, ys of each
// series], as uPlot takes it: xs ascending, null where a series has no point) in a box of
// the page; `range` fixes the y scale; `y` "log" draws it logarithmic (labelled at each
// decade) where every value is above 0, and says so under the chart where one is not. The
// uPlot is kept as box.plot; data-points counts the points of the series that are not
// faint, data-y says the scale drawn.
function plot(parent, id, title, xLabel, series, data, range, y) {
  const box = el("div", undefined, "chart");
  box.id = id;
  box.dataset.points = String(series.reduce((n, line, i) => n + (line.faint ? 0 : data[i + 1].filter((y) => y !== null).length), 0));
  const logged = !range && loggable(y, data.slice(1));
  box.dataset.y = logged ? "log" : "linear";
  parent.appendChild(box);
  if (!data[0].length || typeof uPlot === "undefined") {
    box.appendChild(el("p", title + ": nothing yet"));
    return box;
  }
  box.plot = new uPlot({
    title, width: 560, height: 260,
    scales: { x: { time: false }, y: range ? { range: () => range } : logged ? { distr: 3 } : {} },
    axes: [{ label: xLabel }, logged ? { size: fitted, values: (u, splits) => splits.map(tick) } : { size: fitted }],
    series: [{ label: xLabel }, ...series.map((line, i) => ({
      label: line.label, stroke: line.stroke || COLOURS[i % COLOURS.length], width: line.faint ? 1 : 1.5,
      alpha: line.faint ? 0.3 : 1, spanGaps: true, points: { size: 4 },
    }))],
  }, data, box);
  if (y === "log" && !logged && !range) cannotLog(box);
  return box;
}

// the y scale a page draws its curves on: linear, or log (a loss falling over decades
// reads as a line, not a corner); a <select id="y-axis">
function yChoice(y, go) {
  return axisChoice("y", ["linear", "log"], y, go);
}

// lines ([{xs, ys}], xs ascending) on one x: every point of every line, in order of x; a
// line holds null where another's point is
function joined(lines) {
  const at = [];
  lines.forEach((line, i) => line.xs.forEach((x, k) => at.push([x, i, k])));
  at.sort((a, b) => a[0] - b[0] || a[1] - b[1] || a[2] - b[2]);
  return [at.map((p) => p[0]), ...lines.map((line, i) => at.map(([, j, k]) => (j === i ? line.ys[k] : null)))];
}

// a curve's points ([forward, value]) against the chosen x: a counter's value for that
// forward (the points of forwards that lack it left out), in order of x
function against(points, x, counters) {
  if (x === "forward") return { xs: points.map((p) => p[0]), ys: points.map((p) => p[1]), forwards: points.map((p) => p[0]) };
  const by = counters[x] || {};
  const kept = points.filter((p) => by[p[0]] !== undefined).map((p) => [by[p[0]], p[1], p[0]]);
  kept.sort((a, b) => a[0] - b[0] || a[2] - b[2]);
  return { xs: kept.map((p) => p[0]), ys: kept.map((p) => p[1]), forwards: kept.map((p) => p[2]) };
}

// the x a page draws against: forward, or a counter every run shown has; a <select id="x-axis">
function xChoice(choices, x, go) {
  return axisChoice("x", choices, x, go);
}

// "<axis> axis: [choices]", a <select id="<axis>-axis"> showing `value`; `go` is given the one chosen
function axisChoice(axis, choices, value, go) {
  const pick = el("select");
  pick.id = `${axis}-axis`;
  for (const choice of choices) {
    const option = el("option", choice);
    option.value = choice;
    pick.appendChild(option);
  }
  pick.value = value;
  pick.addEventListener("change", () => go(pick.value));
  const line = el("p", `${axis} axis: `, "choosing");
  line.appendChild(pick);
  return line;
}

// exponential moving average, as TensorBoard smooths (debiased: the first points are not
// pulled toward 0); nulls and non-finite values are passed through. A long curve comes
// thinned, and ``stretches`` (one per y, or none) says what each point kept stands for:
// [mean, count] of its stretch of the recorded points, the count on the stretch's first point
// kept and 0 on its others; the stretch weighs as its count of points at its mean, so the
// curve is smoothed as recorded, not as thinned
function smoothed(ys, weight, stretches) {
  if (!weight) return ys.slice();
  let last = 0;
  let n = 0;
  return ys.map((y, k) => {
    if (y === null || !Number.isFinite(y)) return y;
    const stretch = stretches && stretches[k];
    if (stretch) {
      const [mean, count] = stretch;
      if (count > 0 && Number.isFinite(mean)) {
        const kept = weight ** count;
        last = last * kept + (1 - kept) * mean;
        n += count;
      }
      return n ? last / (1 - weight ** n) : y;
    }
    last = last * weight + (1 - weight) * y;
    n += 1;
    return last / (1 - weight ** n);
  });
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

// a tick's label in the parameter's own units: every decade of a log axis reads as itself
// (1e-4, 0.001, 0.01 ... 1000), never rounded to "0"
function tick(v) {
  if (v === null || v === undefined) return "";  // a split uPlot leaves unlabelled (between decades)
  if (v === 0) return "0";
  const size = Math.abs(v);
  if (size < 1e-3 || size >= 1e5) {
    const [mantissa, exponent] = v.toExponential(2).split("e");
    return `${Number(mantissa)}e${Number(exponent)}`;
  }
  return String(Number(v.toPrecision(3)));
}

// a category's strip: its points spread a little across it, by their order, so they do not hide each other
function spread(i) { return (((i * 0.6180339887) % 1) - 0.5) * 0.4; }

// the score against one parameter's value, on an axis of its kind: float, log (labelled at
// each decade), int (whole ticks) or categorical (a strip per category, named)
function scatter(parent, index, p, y) {
  const box = el("div", undefined, "chart");
  box.id = "parameter-" + index;
  box.dataset.points = String(p.points.length);
  box.dataset.parameter = p.name;
  box.dataset.kind = p.kind;
  const logged = loggable(y, [p.points.map((q) => q[1])]);
  box.dataset.y = logged ? "log" : "linear";
  parent.appendChild(box);
  if (!p.points.length || typeof uPlot === "undefined") {
    box.appendChild(el("p", p.name + ": no trial done with it yet"));
    return;
  }
  const record = (labels) => { box.dataset.xticks = JSON.stringify(labels.filter((t) => t !== "")); return labels; };
  const categories = p.categories || [];
  const x = { label: { log: "value (log scale)", int: "value (whole numbers)", categorical: "category" }[p.kind] || "value" };
  const scale = { time: false };
  let xs = p.points.map((q) => q[0]);
  if (p.low !== undefined && p.high !== undefined && p.low < p.high && !(p.kind === "log" && !(p.low > 0))) {
    scale.range = () => [p.low, p.high];  // the space's own span, whatever the trials tried so far
  }
  if (p.kind === "log" && p.log) {
    scale.distr = 3;
    x.values = (u, splits) => record(splits.map(tick));
  } else if (p.kind === "int") {
    x.incrs = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10000, 100000];
    x.values = (u, splits) => record(splits.map((v) => String(Math.round(v))));
  } else if (p.kind === "categorical") {
    scale.range = () => [-0.5, categories.length - 0.5];
    x.splits = () => categories.map((c, i) => i);
    x.values = (u, splits) => record(splits.map((i) => categories[i] ?? ""));
    xs = xs.map((v, i) => v + spread(i));
  } else {
    x.values = (u, splits) => record(splits.map(tick));
  }
  new uPlot({
    title: p.name, width: 360, height: 220,
    scales: { x: scale, y: logged ? { distr: 3 } : {} },
    axes: [x, { label: "score", size: 60, values: (u, splits) => splits.map(tick) }],
    series: [{ label: "value" }, { label: "score", stroke: "#0969da", fill: "#0969da", paths: () => null, points: { show: true, size: 5 } }],
  }, [xs, p.points.map((q) => q[1])], box);
  if (y === "log" && !logged) cannotLog(box);
  if (p.count > p.points.length) box.appendChild(el("p", `${p.count} trials, drawn from ${p.points.length}: the lowest and highest score of each stretch of values`, "thinned"));
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attributes, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attributes || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

// how much each parameter matters to the score, as Optuna weighs it
function importancesOf(found) {
  const charts = $("charts");
  charts.appendChild(el("h2", "Parameter importances"));
  const box = el("div");
  box.id = "importances";
  charts.appendChild(box);
  if (!found.values) {
    box.appendChild(el("p", found.why || "not known yet", "empty"));
    return;
  }
  box.dataset.by = found.by;
  for (const [name, weight] of found.values) {
    const row = el("div", undefined, "importance");
    row.dataset.parameter = name;
    row.dataset.importance = String(weight);
    row.appendChild(el("span", name, "name"));
    const bar = el("span", undefined, "bar");
    bar.style.width = `${Math.max(1, Math.round(300 * weight))}px`;
    row.appendChild(bar);
    row.appendChild(el("span", weight.toFixed(3), "weight"));
    box.appendChild(row);
  }
  box.appendChild(el("p", `${found.by}, from ${found.trials} done trials`, "thinned"));
}

// every done trial as a line across one axis per parameter, coloured by its score (best: dark)
function parallelOf(found, direction) {
  const charts = $("charts");
  charts.appendChild(el("h2", "Parallel coordinates"));
  const width = 160 * Math.max(2, found.axes.length + 1), height = 280, top = 30, bottom = 40;
  const picture = svg("svg", { width, height, id: "parallel", "data-lines": found.lines.length, "data-axes": found.axes.length });
  charts.appendChild(picture);
  if (!found.lines.length) {
    charts.appendChild(el("p", "no trial done yet", "empty"));
    return;
  }
  const scores = found.lines.map((l) => l.score);
  const low = Math.min(...scores), high = Math.max(...scores);
  const sign = direction === "maximize" ? -1 : 1;
  const where = (a, v) => {  // 0 (bottom) .. 1 (top)
    if (v === null || v === undefined) return null;
    if (a.kind === "categorical") return a.categories.length > 1 ? v / (a.categories.length - 1) : 0.5;
    if (a.kind === "log") return (Math.log(v) - Math.log(a.low)) / (Math.log(a.high) - Math.log(a.low) || 1);
    return (v - a.low) / ((a.high - a.low) || 1);
  };
  const columns = [...found.axes, { name: "score", kind: "float", low, high }];
  const xOf = (i) => 60 + i * ((width - 120) / Math.max(1, columns.length - 1));
  const yOf = (t) => top + (1 - Math.min(1, Math.max(0, t))) * (height - top - bottom);
  const order = found.lines.slice().sort((a, b) => sign * (b.score - a.score));  // the best drawn last, on top
  for (const line of order) {
    const values = [...line.values, line.score];
    const points = values.map((v, i) => [xOf(i), where(columns[i], v)]).filter((p) => p[1] !== null);
    const t = high > low ? (sign * (line.score - low) / (high - low) + (sign < 0 ? 1 : 0)) : 0;
    const shade = Math.round(40 + 180 * t);
    const path = svg("polyline", { points: points.map(([x, y]) => `${x},${yOf(y)}`).join(" "), fill: "none", stroke: `rgb(${shade},${shade},255)`, "stroke-width": 1.2, "data-trial": line.trial });
    path.appendChild(svg("title", {}, `trial ${line.trial}: score ${show(line.score)}`));
    picture.appendChild(path);
  }
  columns.forEach((a, i) => {
    picture.appendChild(svg("line", { x1: xOf(i), x2: xOf(i), y1: top, y2: height - bottom, stroke: "#57606a" }));
    picture.appendChild(svg("text", { x: xOf(i), y: height - 18, "text-anchor": "middle", class: "axis-name" }, a.name));
    const ends = a.kind === "categorical" ? [a.categories[0] ?? "", a.categories[a.categories.length - 1] ?? ""] : [tick(a.low), tick(a.high)];
    picture.appendChild(svg("text", { x: xOf(i) + 4, y: height - bottom + 12, class: "axis-end" }, ends[0]));
    picture.appendChild(svg("text", { x: xOf(i) + 4, y: top - 6, class: "axis-end" }, ends[1]));
  });
}

// each attempt on its runner's row, from when it started to its last write: takeovers
// (an attempt after the first) outlined, the state by colour
function timelineOf(found) {
  const tables = $("tables");
  tables.appendChild(el("h2", "Timeline: who ran what, when"));
  const runners = [...new Set(found.attempts.map((a) => a.runner))].sort();
  const span = Math.max(1, ...found.attempts.map((a) => a.start_s));
  const width = 860, left = 180, row = 22;
  const picture = svg("svg", { width, height: row * runners.length + 30, id: "timeline", "data-attempts": found.attempts.length, "data-runners": runners.length });
  tables.appendChild(picture);
  if (!found.attempts.length) {
    tables.appendChild(el("p", "no attempt yet", "empty"));
    return;
  }
  const xOf = (ago) => left + (1 - ago / span) * (width - left - 10);
  runners.forEach((runner, i) => picture.appendChild(svg("text", { x: 4, y: 16 + i * row, class: "runner" }, runner)));
  for (const a of found.attempts) {
    const i = runners.indexOf(a.runner);
    const x = xOf(a.start_s), w = Math.max(2, xOf(a.end_s) - x);
    const box = svg("rect", { x, y: 4 + i * row, width: w, height: row - 8, class: `attempt ${a.state}${a.again ? " again" : ""}`, "data-trial": a.trial, "data-attempt": a.attempt });
    box.appendChild(svg("title", {}, `trial ${a.trial} attempt ${a.attempt} (${a.state}${a.again ? ", a takeover" : ""}), ${seconds(a.start_s - a.end_s)}`));
    picture.appendChild(box);
  }
  picture.appendChild(svg("text", { x: left, y: row * runners.length + 24, class: "axis-end" }, `${seconds(span)} ago`));
  picture.appendChild(svg("text", { x: width - 40, y: row * runners.length + 24, class: "axis-end" }, "now"));
  if (found.count > found.attempts.length) tables.appendChild(el("p", `the newest ${found.attempts.length} of ${found.count} attempts`, "thinned"));
}

function clear(title, note) {
  $("title").textContent = title;
  $("note").textContent = note || "";
  $("charts").replaceChildren();
  $("tables").replaceChildren();
}

// -- pages ------------------------------------------------------------------------------

// the runs picked on the runs page to compare (kept while the page is drawn again)
const chosen = new Set();
const COMPARED = 8;

async function runsPage() {
  const rows = await read("/api/runs");
  clear("Runs", rows.length ? `${rows.length} runs, newest first` : "no run recorded in this store yet");
  for (const run of [...chosen]) if (!rows.some((r) => r.run === run)) chosen.delete(run);
  const go = el("button", "", "compare");
  go.id = "compare";
  const boxes = [];
  const update = () => {
    go.textContent = chosen.size ? `compare the ${chosen.size} runs chosen` : "compare: choose 2 to 8 runs";
    go.disabled = chosen.size < 2;
    for (const box of boxes) box.disabled = !box.checked && chosen.size >= COMPARED;
  };
  go.addEventListener("click", () => {
    location.hash = "#/compare/" + [...chosen].map(encodeURIComponent).join("/");
  });
  const pick = (r) => {
    const box = el("input");
    box.type = "checkbox";
    box.value = r.run;
    box.checked = chosen.has(r.run);
    box.setAttribute("aria-label", "compare " + r.run);
    box.addEventListener("change", () => {
      if (box.checked) chosen.add(r.run); else chosen.delete(r.run);
      update();
    });
    boxes.push(box);
    return box;
  };
  const line = el("p", undefined, "choosing");
  line.appendChild(go);
  $("tables").appendChild(line);
  $("tables").appendChild(table("runs", [
    ["compare", pick, "pick"],
    ["run", (r) => link(r.run, "#/run/" + encodeURIComponent(r.run))],
    ["status", (r) => status(r.status)],
    ["forwards", (r) => r.forwards, "num"],
    ["last state", (r) => r.state, (r) => r.state],
    ["last took", (r) => took(r.took_us), "num"],
    ["last loss", (r) => r.loss, "num"],
  ], rows));
  update();
}

// a run page's address: its rows from `from` in the order of `sort` (descending with
// desc), its charts against `x`
function runHash(run, { from = 0, sort = "forward", desc = true, x = "forward", y = "linear" }) {
  const q = new URLSearchParams({ from: String(from), sort, desc: desc ? "1" : "0", x, y });
  return `#/run/${encodeURIComponent(run)}?${q}`;
}

// the units a time in µs reads best in, for values up to `most`
function timeUnit(most) {
  return most >= 1e6 ? ["s", 1e6] : most >= 1e3 ? ["ms", 1e3] : ["µs", 1];
}

async function runPage(run, q) {
  // newest first unless asked: a researcher looks at what the run does now
  const asked = { from: Number(q.get("from")) || 0, sort: q.get("sort") || "forward", desc: q.has("sort") ? q.get("desc") === "1" : true };
  const query = new URLSearchParams({ from: String(asked.from), sort: asked.sort, desc: asked.desc ? "1" : "0" });
  const body = await read(`/api/run/${encodeURIComponent(run)}?${query}`);
  clear(`Run ${body.run}`, `; ${body.count} forwards; summarised kinds: ${body.kinds.join(", ") || "none"}`);
  const state = status(body.status);
  state.id = "status";
  $("note").prepend(state);
  const x = body.x.includes(q.get("x")) ? q.get("x") : "forward";
  const y = q.get("y") === "log" ? "log" : "linear";
  const here = { ...asked, x, y };
  if (body.x.length > 1) $("charts").appendChild(xChoice(body.x, x, (chosenX) => { location.hash = runHash(run, { ...here, x: chosenX }); }));
  $("charts").appendChild(yChoice(y, (chosenY) => { location.hash = runHash(run, { ...here, y: chosenY }); }));
  const loss = against(body.curve, x, body.counters);
  plot($("charts"), "curve", `loss per ${x}`, x, [{ label: "loss" }], [loss.xs, loss.ys], undefined, y).dataset.x = x;
  tookChart(body, x);
  Object.entries(body.series || {}).forEach(([kind, points], i) => {  // every other summarised number
    const line = against(points, x, body.counters);
    plot($("charts"), `series-${i}`, `${kind} per ${x}`, x, [{ label: kind }], [line.xs, line.ys], undefined, y).dataset.x = x;
  });
  const columns = [
    ["forward", (r) => link(r.forward, `#/run/${encodeURIComponent(run)}/facts/${r.forward}`), "num", "forward"],
    ["state", (r) => r.state, (r) => r.state, "state"],
    ["took", (r) => took(r.took_us), "num", "took_us"],
    ["nodes", (r) => r.nodes, "num", "nodes"],
    ["facts", (r) => r.facts, "num", "facts"],
    ...body.kinds.map((k) => [k, (r) => r[k], "num", k]),
    ["error", (r) => r.error || "", undefined, "error"],
  ];
  $("tables").appendChild(el("h2", "Forwards"));
  const forwards = table("forwards", columns, body.forwards);
  columns.forEach(([name, , , key], i) => {  // a heading sorts by its column; again, the other way
    const th = forwards.rows[0].cells[i];
    const sorted = key === asked.sort;
    const desc = sorted ? !asked.desc : key !== "state" && key !== "error";  // numbers: biggest first
    th.replaceChildren(link(name + (sorted ? (asked.desc ? " ▼" : " ▲") : ""), runHash(run, { ...here, from: 0, sort: key, desc })));
    th.dataset.sort = key;
    if (sorted) th.setAttribute("aria-sort", asked.desc ? "descending" : "ascending");
  });
  $("tables").appendChild(forwards);
  pager(body, (start) => runHash(run, { ...here, from: start }));
  const costs = await read(`/api/run/${encodeURIComponent(run)}/nodes?last=100`);
  $("tables").appendChild(el("h2", "Nodes (the last 100 forwards)"));
  $("tables").appendChild(table("nodes", [
    ["node", (r) => r.node], ["ran", (r) => r.ran, "num"], ["took", (r) => took(r.took_us), "num"],
    ["recalled", (r) => r.recalled, "num"], ["failed", (r) => r.failed, "num"], ["host", (r) => r.host || ""],
  ], costs));
}

// the time per forward, in the unit its values read best in; forwards far slower than the
// others (body.took_outside: over 10x the median, a worker starting) are left above the
// scale and named under the chart
function tookChart(body, x) {
  const outside = new Set(body.took_outside.map((p) => p[0]));
  const line = against(body.took, x, body.counters);
  const inside = line.ys.filter((y, i) => !outside.has(line.forwards[i]));
  const most = inside.length ? Math.max(...inside) : Math.max(0, ...line.ys);
  const [unit, per] = timeUnit(most);
  const range = outside.size && inside.length ? [0, (most / per) * 1.1 || 1] : undefined;
  const box = plot($("charts"), "took", `took per ${x} (${unit})`, x, [{ label: `took (${unit})` }], [line.xs, line.ys.map((y) => y / per)], range);
  box.dataset.x = x;
  box.dataset.unit = unit;
  box.dataset.outside = body.took_outside.map((p) => p[0]).join(" ");
  if (!body.took_outside.length) return;
  const named = body.took_outside.map(([f, us]) => `forward ${f} took ${took(us)}${f === body.first ? " (start-up)" : ""}`);
  const more = body.took_outside_count - body.took_outside.length;
  const note = el("p", named.join("; ") + (more > 0 ? `; and ${more} more` : "") +
    `, above the scale (more than 10 times the median forward, ${took(body.took_median)})`, "outside");
  note.id = "took-outside";
  box.appendChild(note);
}

// the smoothing of the compare page's curves, kept in this origin's storage (or in this
// page, where storage is refused): the page is drawn again at each change of the store
const SMOOTHING = "somatize-view-smoothing";
let weighed = null;
function smoothing() {
  let given = weighed;
  try {
    given = localStorage.getItem(SMOOTHING) ?? given;
  } catch (error) { /* storage refused: this page's own */ }
  const weight = Number(given ?? 0.6);
  return weight >= 0 && weight <= 0.99 ? weight : 0.6;
}

async function comparePage(names, q) {
  const body = await read("/api/compare?" + new URLSearchParams(names.map((n) => ["run", n])));
  const runs = body.runs;
  clear(`Comparing ${runs.length} runs`, runs.map((r) => `${r.run} (${r.count} forwards)`).join(", "));
  const choices = ["forward", ...["step", "epoch"].filter((c) => runs.every((r) => r.x.includes(c)))];
  const x = choices.includes(q.get("x")) ? q.get("x") : "forward";
  const y = q.get("y") === "log" ? "log" : "linear";
  const here = (chosen) => "#/compare/" + names.map(encodeURIComponent).join("/") + "?" + new URLSearchParams({ x, y, ...chosen });
  const controls = $("charts");
  if (choices.length > 1) controls.appendChild(xChoice(choices, x, (chosenX) => { location.hash = here({ x: chosenX }); }));
  controls.appendChild(yChoice(y, (chosenY) => { location.hash = here({ y: chosenY }); }));
  const slider = el("input");
  Object.assign(slider, { id: "smoothing", type: "range", min: "0", max: "0.99", step: "0.01" });
  slider.value = String(smoothing());
  const shown = el("span", slider.value);
  shown.id = "smoothing-value";
  const line = el("p", "smoothing (exponential moving average, the raw curve faint behind): ", "choosing");
  line.append(slider, " ", shown);
  controls.appendChild(line);
  // the loss, and every other summarised kind all the runs have
  const kinds = [["loss.value", (r) => r.curve], ...Object.keys(runs[0]?.series || {})
    .filter((k) => runs.every((r) => Object.hasOwn(r.series, k))).map((k) => [k, (r) => r.series[k]])];
  // each run smoothed along its own points (and a thinned one's stretches), then its line
  // and the raw one, faint, on the runs' common x: [xs, smoothed..., raw...]
  const data = (lines, raw, weight) => [raw[0],
    ...joined(lines.map((line) => ({ xs: line.xs, ys: smoothed(line.ys, weight, line.stretches) }))).slice(1),
    ...raw.slice(1)];
  const series = [...runs.map((r, j) => ({ label: r.run, stroke: COLOURS[j % COLOURS.length] })),
    ...runs.map((r, j) => ({ label: r.run + " (raw)", stroke: COLOURS[j % COLOURS.length], faint: true }))];
  const drawn = kinds.map(([kind, of], i) => {
    const lines = runs.map((r) => {
      const points = of(r);
      const line = against(points, x, r.counters);
      const given = (r.stretches || {})[kind];
      if (Array.isArray(given) && given.length === points.length) {
        const by = new Map(points.map((p, k) => [p[0], given[k]]));
        line.stretches = line.forwards.map((f) => by.get(f));
      }
      return line;
    });
    const raw = joined(lines);
    const box = plot($("charts"), `compare-${i}`, `${kind} per ${x}`, x, series, data(lines, raw, Number(slider.value)), undefined, y);
    Object.assign(box.dataset, { kind, runs: String(runs.length), x, smoothing: slider.value });
    return { box, lines, raw };
  });
  slider.addEventListener("input", () => {
    const weight = Number(slider.value);
    shown.textContent = slider.value;
    weighed = slider.value;
    try { localStorage.setItem(SMOOTHING, slider.value); } catch (error) { /* kept in this page */ }
    for (const { box, lines, raw } of drawn) {
      box.dataset.smoothing = slider.value;
      if (!box.plot) continue;
      box.plot.setData(data(lines, raw, weight));
    }
  });
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

// the trials table's order and filter, as the address says them (the server sorts all trials)

async function studyPage(name, query) {
  const asked = new URLSearchParams(query || "");
  const sort = asked.get("sort") || "trial", desc = asked.get("desc") === "1", only = asked.get("state") || "";
  const y = asked.get("y") === "log" ? "log" : "linear";
  const at = (changes) => `#/study/${encodeURIComponent(name)}?` + new URLSearchParams({ sort, desc: desc ? "1" : "0", state: only, y, ...changes });
  const body = await read(`/api/study/${encodeURIComponent(name)}?` + new URLSearchParams({ from: asked.get("from") || 0, sort, desc: desc ? "1" : "0", state: only }));
  const states = body.states || {};
  const best = body.best ? `; best ${show(body.best.score)} (trial ${body.best.trial})` : "";
  clear(`Study ${body.study}`, `${body.direction}; ${body.claimed} trials claimed: ` +
    Object.entries(states).map(([s, n]) => `${n} ${s}`).join(", ") + best);
  const sign = { maximize: -1, minimize: 1 }[body.direction];  // none: no best is drawn
  let so = null;
  const bestSoFar = body.scores.map(([, s]) => (sign === undefined ? null
    : (so = so === null || sign * s < sign * so ? s : so)));
  // the score's scale: log where a minimized loss spans decades (every score above 0)
  $("charts").appendChild(yChoice(y, (chosenY) => { location.hash = at({ y: chosenY, from: asked.get("from") || 0 }); }));
  chart("scores", "score per trial, and the best so far", ["trial", "score", "best so far"],
    body.scores.map((p) => p[0]), [body.scores.map((p) => p[1]), bestSoFar], y);
  importancesOf(body.importances);
  parametersOf(body.parameters, y);
  parallelOf(body.parallel, body.direction);
  runningOf(body.running, body.patience);
  timelineOf(body.timeline);
  const tables = $("tables");
  tables.appendChild(el("h2", "Trials"));
  const filter = el("select");
  filter.id = "trial-state";
  for (const state of ["", ...Object.keys(states).sort()]) {
    const option = el("option", state ? `${state} (${states[state]})` : "every state");
    option.value = state;
    filter.appendChild(option);
  }
  filter.value = only;
  filter.addEventListener("change", () => { location.hash = at({ state: filter.value, from: 0 }); });
  const choosing = el("p", "show: ");
  choosing.appendChild(filter);
  tables.appendChild(choosing);
  const heading = (title, key) => {
    const a = link(title + (sort === key ? (desc ? " ▼" : " ▲") : ""), at({ sort: key, desc: sort === key && !desc ? "1" : "0", from: 0 }));
    a.className = "sort";
    a.dataset.sort = key;
    return a;
  };
  tables.appendChild(table("trials", [
    ["trial", (t) => t.trial, "num"], ["state", (t) => t.state, (t) => t.state],
    ["attempts", (t) => t.attempts, "num"], ["score", (t) => t.score, "num"], ["took", (t) => took(t.took_us), "num"],
    ["runner", (t) => t.runner], ["config", (t) => JSON.stringify(t.config)], ["error", (t) => t.error || ""],
  ], body.trials, { trial: heading("trial", "trial"), state: heading("state", "state"), attempts: heading("attempts", "attempts"),
    score: heading("score", "score"), took: heading("took", "took_us"), runner: heading("runner", "runner") }));
  pager(body, (start) => at({ from: start }));
}

function parametersOf(parameters, y) {
  const charts = $("charts");
  charts.appendChild(el("h2", "Score against each parameter (done trials with a finite score)"));
  const box = el("div");
  box.id = "parameters";
  charts.appendChild(box);
  parameters.drawn.forEach((p, i) => scatter(box, i, p, y));
  if (!parameters.drawn.length) box.appendChild(el("p", "no parameter yet", "empty"));
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
  const q = new URLSearchParams(query || "");
  const from = q.get("from") || 0;
  if (parts[0] === "run" && parts[2] === "facts") return [`run:${parts[1]}`, () => factsPage(parts[1], parts[3])];
  if (parts[0] === "run") return [`run:${parts[1]}`, () => runPage(parts[1], q)];
  // the runs compared, and no other (a run's name has no '/'): a write elsewhere draws nothing
  if (parts[0] === "compare") return [`compare:${parts.slice(1).join("/")}`, () => comparePage(parts.slice(1), q)];
  // the run written last may change to another: its page listens to every run, and to the machines
  if (parts[0] === "machines" && parts[1]) return [`machines:${parts[1]}`, () => machinesPage(parts[1])];
  if (parts[0] === "machines") return [["machines", "runs"], () => machinesPage()];
  if (parts[0] === "studies") return ["studies", studiesPage];
  if (parts[0] === "study") return [`study:${parts[1]}`, () => studyPage(parts[1], query)];
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
