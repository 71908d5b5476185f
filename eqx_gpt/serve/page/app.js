// The page of `eqx-gpt serve`: plain JS, no build step, nothing fetched but this server's own API.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, text: "", position: null, inspectTimer: null, inspectRun: 0 };
const SHOWN = 64; // attention: the last SHOWN tokens

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

async function api(path, body) {
  const response = await fetch(path, body === undefined ? {} : {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
  });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
  return data;
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

function drawAttention(matrix) {
  const canvas = $("attention"), ctx = canvas.getContext("2d");
  const n = matrix.length, from = Math.max(0, n - SHOWN), m = n - from;
  const cell = canvas.width / Math.max(m, 1);
  ctx.fillStyle = "#ffffff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  for (let i = 0; i < m; i++) {
    const row = matrix[from + i];
    for (let j = 0; j < m; j++) {
      const w = row[from + j];
      if (w <= 0) continue;
      const shade = Math.round(255 * (1 - Math.sqrt(w))); // sqrt: faint weights stay visible
      ctx.fillStyle = `rgb(${shade}, ${Math.round(shade * 0.85 + 30)}, 255)`;
      ctx.fillRect(j * cell, i * cell, Math.ceil(cell), Math.ceil(cell));
    }
  }
  canvas.dataset.drawn = String(m);
  $("attention-absent").hidden = true;
}

function showAbsent(reason) {
  // A model without eqx_gpt's MultiHeadAttention: say why there is no heatmap, in its place.
  const canvas = $("attention"), ctx = canvas.getContext("2d");
  ctx.fillStyle = "#ffffff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  canvas.dataset.drawn = "0";
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
    position: state.position, ...settings() };
  try {
    const seen = await api("/v1/inspect", body);
    if (run !== state.inspectRun) return; // a newer request is on its way
    drawBars($("before"), seen.next_token.before);
    drawBars($("after"), seen.next_token.after);
    if (seen.attention === null) showAbsent(seen.attention_absent);
    else drawAttention(seen.attention);
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
    const response = await fetch("/v1/completions", {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
    });
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
    ["step", card.step ?? "–"], ["final val loss", card.final_val_loss ?? "–"],
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
  drawCurve(card.curve);
}

for (const id of ["temperature", "top-k", "top-p", "max-tokens"]) {
  $(id).addEventListener("input", () => { showSettings(); if (id !== "max-tokens") inspectSoon(); });
}
for (const id of ["layer", "head"]) $(id).addEventListener("change", () => inspectSoon(0));
$("prompt").addEventListener("input", () => { state.text = ""; state.position = null; inspectSoon(300); });
$("tokens").addEventListener("mouseleave", () => { state.position = null; inspectSoon(200); });
$("generate").addEventListener("click", generate);
showSettings();
loadCard().then(loadAdapters).then(inspect).catch((e) => { $("card").textContent = e.message; });
