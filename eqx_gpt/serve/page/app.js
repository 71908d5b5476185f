// The page of `eqx-gpt serve`: plain JS, no build step, nothing fetched but this server's own API.
"use strict";

const $ = (id) => document.getElementById(id);
// `key`: the server's API key when it asks for one (401), held in this page's memory only.
const state = { model: null, text: "", position: null, inspectTimer: null, inspectRun: 0, key: null, step: null,
  polling: false };
const SHOWN = 32; // attention: the SHOWN tokens up to the position (labels stay readable)

function visible(token) {
  return token.replace(/\n/g, "⏎").replace(/ /g, "␣").replace(/\t/g, "⇥");
}

function settings() {
  const k = Number($("top-k").value), p = Number($("top-p").value);
  return { temperature: Number($("temperature").value), top_k: k > 0 ? k : null, top_p: p < 1 ? p : null };
}

function showSettings() {
  const s = settings();
  $("temperature-value").textContent = s.temperature.toFixed(2);
  $("top-k-value").textContent = s.top_k === null ? "off" : String(s.top_k);
  $("top-p-value").textContent = Number($("top-p").value).toFixed(2);
  $("max-tokens-value").textContent = $("max-tokens").value;
}

function headers(json) {
  const h = json ? { "content-type": "application/json" } : {};
  if (state.key) h.authorization = `Bearer ${state.key}`;
  return h;
}

async function api(path, body) {
  const response = await fetch(path, body === undefined ? { headers: headers(false) } : {
    method: "POST", headers: headers(true), body: JSON.stringify(body),
  });
  const data = await response.json();
  if (response.status === 401) askForKey();
  if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
  return data;
}

function askForKey() {
  $("key-box").hidden = false;
  $("api-key").focus();
}

function drawBars(element, top) {
  element.replaceChildren(...top.map((t) => {
    const row = document.createElement("div");
    row.className = "bar-row";
    row.innerHTML = '<span class="token"></span><div><div class="bar"></div></div><span class="value"></span>';
    row.querySelector(".token").textContent = visible(t.token);
    row.querySelector(".bar").style.width = `${(100 * t.prob).toFixed(1)}%`;
    row.querySelector(".value").textContent = t.prob.toFixed(3);
    return row;
  }));
}

// Weight -> colour: white to blue, on a square-root scale so that faint weights stay visible.
function colour(w) {
  const shade = Math.round(255 * (1 - Math.sqrt(Math.min(Math.max(w, 0), 1))));
  return `rgb(${shade}, ${Math.round(shade * 0.85 + 30)}, 255)`;
}

function paint(canvas, matrix) {
  const ctx = canvas.getContext("2d"), m = matrix.length, cell = canvas.width / Math.max(m, 1);
  ctx.fillStyle = "#ffffff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < m; i++) {
    for (let j = 0; j <= i && j < m; j++) {
      if (matrix[i][j] <= 0) continue;
      ctx.fillStyle = colour(matrix[i][j]);
      ctx.fillRect(j * cell, i * cell, Math.ceil(cell), Math.ceil(cell));
    }
  }
  return cell;
}

function drawLabels(tokens, cell, at) {
  const font = `${Math.max(5, Math.min(12, cell - 1)).toFixed(1)}px`;
  for (const [id, size] of [["attention-rows", "height"], ["attention-cols", "width"]]) {
    $(id).replaceChildren(...tokens.map((t, i) => {
      const span = document.createElement("span");
      span.textContent = visible(t);
      span.style[size] = `${cell}px`;
      span.style.fontSize = font;
      if (i === at) span.className = "at";
      return span;
    }));
  }
}

function drawScale() {
  const bar = $("scale-bar"), ctx = bar.getContext("2d");
  for (let y = 0; y < bar.height; y++) { // top: weight 1; the bar is linear in sqrt(weight)
    const s = 1 - y / (bar.height - 1);
    ctx.fillStyle = colour(s * s);
    ctx.fillRect(0, y, bar.width, 1);
  }
  $("scale-ticks").replaceChildren(...[1, 0.5, 0.25, 0.1, 0.02, 0].map((w) => {
    const tick = document.createElement("span");
    tick.textContent = String(w);
    tick.style.top = `${(1 - Math.sqrt(w)) * (bar.height - 1) - 6}px`;
    return tick;
  }));
}

function drawAttention(seen) {
  const canvas = $("attention"), from = seen.window_start;
  const cell = paint(canvas, seen.attention);
  drawLabels(seen.tokens.slice(from, from + seen.attention.length), cell, seen.position - from);
  canvas.dataset.drawn = String(seen.attention.length);
  $("attention-absent").hidden = true;
  $("heatmap").hidden = false;
}

function drawHeads(seen) {
  const head = Number($("head").value || 0);
  $("heads").replaceChildren(...seen.heads.map((matrix, h) => {
    const figure = document.createElement("figure");
    figure.dataset.head = String(h);
    figure.className = h === head ? "selected" : "";
    const canvas = document.createElement("canvas");
    canvas.width = canvas.height = 96;
    paint(canvas, matrix);
    const caption = document.createElement("figcaption");
    caption.textContent = `head ${h}`;
    figure.append(canvas, caption);
    figure.addEventListener("click", () => { $("head").value = String(h); inspectSoon(0); });
    return figure;
  }));
}

function drawLens(seen) {
  const absent = seen.lens === null;
  $("lens-absent").hidden = !absent;
  if (absent) {
    $("lens-absent").textContent = `No logit lens: ${seen.lens_absent}.`;
    $("lens").replaceChildren();
    return;
  }
  const last = seen.lens.length - 1;
  $("lens").replaceChildren(...seen.lens.map((row) => {
    const tr = document.createElement("tr");
    const th = document.createElement("th");
    th.textContent = row.layer === last ? `layer ${row.layer} (output)` : `layer ${row.layer}`;
    tr.appendChild(th);
    for (const t of row.top) {
      const td = tr.insertCell();
      td.innerHTML = '<span class="token"></span><small></small>';
      td.querySelector(".token").textContent = visible(t.token);
      td.querySelector("small").textContent = t.prob.toFixed(2);
      td.style.background = `rgba(47, 111, 222, ${Math.sqrt(t.prob).toFixed(3)})`;
      if (t.prob > 0.3) td.style.color = "#fff";
    }
    return tr;
  }));
}

function showAbsent(reason) {
  // A model without eqx_gpt's MultiHeadAttention: say why there is no heatmap, in its place.
  $("heatmap").hidden = true;
  $("heads").replaceChildren();
  $("attention").dataset.drawn = "0";
  $("attention-absent").textContent = `No attention heatmap: ${reason}.`;
  $("attention-absent").hidden = false;
}

function drawTokens(tokens, position) {
  $("tokens").replaceChildren(...tokens.map((t, i) => {
    const span = document.createElement("span");
    span.textContent = visible(t);
    if (i === position) span.className = "at";
    span.addEventListener("mouseenter", () => { state.position = i; inspectSoon(0); });
    return span;
  }));
}

async function inspect() {
  const text = state.text || $("prompt").value;
  if (!text) return;
  const run = ++state.inspectRun;
  const body = { prompt: text, layer: Number($("layer").value || 0), head: Number($("head").value || 0),
    position: state.position, all_heads: true, window: SHOWN, ...settings() };
  try {
    const seen = await api("/v1/inspect", body);
    if (run !== state.inspectRun) return; // a newer request is on its way
    drawBars($("before"), seen.next_token.before);
    drawBars($("after"), seen.next_token.after);
    if (seen.attention === null) showAbsent(seen.attention_absent);
    else { drawAttention(seen); drawHeads(seen); }
    drawLens(seen);
    drawTokens(seen.tokens, seen.position);
    $("position-label").textContent = `after “${visible(seen.tokens[seen.position])}” (position ${seen.position})`;
    compare(body, seen, run);
  } catch (e) {
    $("position-label").textContent = `(${e.message})`;
  }
}

// Base against adapter (#compare): when the server holds LoRA adapters (/v1/models lists them with
// their base as `parent`), the base's next-token bars and the chosen adapter's, side by side, at the
// position under the cursor. The base's are the inspection just drawn; the adapter's one more
// /v1/inspect with its `model`, after it (the server runs at most two inspections at once).
async function loadAdapters() {
  const adapters = (await api("/v1/models")).data.filter((m) => m.parent);
  if (adapters.length === 0) return;
  $("compare-model").replaceChildren(...adapters.map((m) => new Option(m.id, m.id)));
  $("compare-model").addEventListener("change", () => inspectSoon(0));
  $("compare").hidden = false;
}

async function compare(body, base, run) {
  if ($("compare").hidden) return;
  const adapter = $("compare-model").value;
  try {
    const seen = await api("/v1/inspect", { ...body, position: base.position, model: adapter });
    if (run !== state.inspectRun) return;
    $("compare-base-name").textContent = `${state.model} (base)`;
    $("compare-adapter-name").textContent = `${adapter} (adapter)`;
    drawBars($("compare-base"), base.next_token.before);
    drawBars($("compare-adapter"), seen.next_token.before);
    $("compare").dataset.position = String(seen.position);
    $("compare-error").hidden = true;
  } catch (e) {
    $("compare-error").textContent = `(${e.message})`;
    $("compare-error").hidden = false;
  }
}

function inspectSoon(delay = 120) {
  clearTimeout(state.inspectTimer);
  state.inspectTimer = setTimeout(inspect, delay);
}

async function generate() {
  const prompt = $("prompt").value, s = settings();
  const button = $("generate");
  button.disabled = true;
  const out = $("output");
  out.replaceChildren(document.createTextNode(prompt));
  const generated = document.createElement("span");
  generated.className = "generated";
  out.appendChild(generated);
  const seed = $("seed").value === "" ? null : Number($("seed").value);
  const body = { model: state.model, prompt, max_tokens: Number($("max-tokens").value), stream: true, seed, ...s };
  try {
    const response = await fetch("/v1/completions", { method: "POST", headers: headers(true), body: JSON.stringify(body) });
    if (response.status === 401) askForKey();
    if (!response.ok) throw new Error((await response.json()).error.message);
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end).replace(/^data: /, "");
        buffer = buffer.slice(end + 2);
        if (event === "[DONE]") continue;
        const chunk = JSON.parse(event);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const c of chunk.choices) generated.textContent += c.text;
        out.scrollTop = out.scrollHeight;
      }
    }
  } catch (e) {
    generated.textContent += `\n[${e.message}]`;
  } finally {
    button.disabled = false;
  }
  state.text = prompt + generated.textContent;
  state.position = null;
  inspect();
}

function drawCurve(curve) {
  const svg = $("loss-curve"), W = 480, H = 180, pad = 28;
  const all = [...curve.train, ...curve.val];
  if (all.length === 0) { svg.innerHTML = '<text x="10" y="20" font-size="12" fill="#6b7280">no metrics.jsonl</text>'; return; }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const sx = (x) => pad + (W - 2 * pad) * (x - x0) / Math.max(x1 - x0, 1e-9);
  const sy = (y) => H - pad - (H - 2 * pad) * (y - y0) / Math.max(y1 - y0, 1e-9);
  const line = (points, color) => `<polyline fill="none" stroke="${color}" stroke-width="1.5" points="${
    points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ")}"/>`;
  svg.innerHTML = line(curve.train, "#9db8ee") + line(curve.val, "#e0703a") +
    `<text x="${pad}" y="14" font-size="11" fill="#6b7280">loss ${y1.toFixed(2)} … ${y0.toFixed(2)}; blue train, orange validation; steps ${x0}–${x1}</text>`;
}

async function loadCard() {
  const card = await api("/v1/card");
  state.model = card.name;
  $("model-name").textContent = card.name;
  const c = card.config;
  const rows = [["parameters", card.parameters.toLocaleString()], ["source", card.source],
    ["final val loss", card.final_val_loss ?? "–"],
    ...Object.entries(c).map(([k, v]) => [k, JSON.stringify(v)])];
  $("card").innerHTML = "<table></table>";
  const table = $("card").firstChild;
  for (const [k, v] of rows) {
    const tr = table.insertRow();
    tr.insertCell().textContent = k;
    tr.insertCell().textContent = String(v);
  }
  for (const [id, count] of [["layer", card.attention.layers], ["head", card.attention.heads]]) {
    $(id).replaceChildren(...Array.from({ length: count }, (_, i) => new Option(String(i), String(i))));
  }
}

// The run: its step and losses so far; while the server follows it (`--follow`), looked at again
// every 1.5 s, and when a new checkpoint is served the same text's predictions are shown anew.
async function loadRun() {
  const run = await api("/v1/run");
  $("run-step").textContent = run.step ?? "–";
  $("run-state").textContent = run.following
    ? `following the run: each new checkpoint is loaded as it lands${run.error ? ` (${run.error})` : ""}`
    : "";
  drawCurve(run.curve);
  const changed = state.step !== null && run.step !== state.step;
  state.step = run.step;
  if (changed) inspect();
  if (run.following && !state.polling) {
    state.polling = true;
    setInterval(() => loadRun().catch(() => {}), 1500);
  }
}

async function start() {
  try {
    await loadCard();
  } catch (e) {
    $("card").textContent = e.message;
    return;
  }
  $("key-box").hidden = true;
  await loadAdapters();
  await Promise.all([inspect(), loadRun()]);
}

for (const id of ["temperature", "top-k", "top-p", "max-tokens"]) {
  $(id).addEventListener("input", () => { showSettings(); if (id !== "max-tokens") inspectSoon(); });
}
for (const id of ["layer", "head"]) $(id).addEventListener("change", () => inspectSoon(0));
$("prompt").addEventListener("input", () => { state.text = ""; state.position = null; inspectSoon(300); });
$("tokens").addEventListener("mouseleave", () => { state.position = null; inspectSoon(200); });
$("generate").addEventListener("click", generate);
$("key-box").addEventListener("submit", (e) => { e.preventDefault(); state.key = $("api-key").value.trim() || null; start(); });
showSettings();
drawScale();
start();
