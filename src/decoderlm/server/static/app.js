// decoderlm playground: streams /v1/completions or /v1/chat/completions (server-sent events),
// shades each token by its probability with its top-5 alternatives (logprobs), draws the heat-maps
// of /v1/attention on canvases, and polls /v1/model_card and /v1/engine_stats. No dependencies.
// A server started with --api-key needs the key on each of these: the page asks for it (#api-key).
"use strict";

const TOP_LOGPROBS = 5;
const ENGINE_POLL_MS = 1000;
// Viridis at 0, 0.25, 0.5, 0.75, 1 (matplotlib's, as `decoderlm attention` draws): weight → colour.
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

const $ = (id) => document.getElementById(id);
const state = {
  controller: null, // AbortController of the running request
  messages: [], // chat mode: the conversation so far
  card: null, // /v1/model_card
  attention: null, // the last /v1/attention answer
};

// The server's API key, as typed into #api-key: kept in this tab's sessionStorage.
const API_KEY_ITEM = "decoderlm-api-key";
const NEED_KEY = "This server needs its API key: enter it above.";

// A fetch with the API key, if one was given, as `Authorization: Bearer KEY`.
function api(url, options = {}) {
  const headers = { ...options.headers };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return fetch(url, { ...options, headers });
}

// ---- Generation -----------------------------------------------------------------------------

function mode() {
  return document.querySelector('input[name="mode"]:checked').value;
}

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function samplingBody() {
  const stop = $("stop").value.split("\n").filter((s) => s !== "");
  const body = {
    temperature: numberField("temperature"),
    top_p: numberField("top_p"),
    top_k: numberField("top_k"),
    max_tokens: numberField("max_tokens"),
    seed: numberField("seed"),
    stop: stop.length ? stop : undefined,
    stream: true,
  };
  return body;
}

// One server-sent event stream → its parsed `data:` payloads, up to `[DONE]`.
async function* serverEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

// A chunk of either endpoint → one piece {text, token, logprob, top: [{token, logprob}], finish}
// per token: a chunk carries several tokens when the server caught up on a stream that fell behind.
function completionPieces(choice) {
  const lp = choice.logprobs;
  const text = choice.text || "";
  const n = lp && lp.tokens ? lp.tokens.length : 0;
  if (!n) return [{ text, token: null, logprob: null, top: [], finish: choice.finish_reason }];
  const chars = Array.from(text); // text_offset counts characters (code points), not UTF-16 units
  const start = lp.text_offset[0];
  return lp.tokens.map((token, i) => ({
    text: chars.slice(lp.text_offset[i] - start, i + 1 < n ? lp.text_offset[i + 1] - start : chars.length).join(""),
    token,
    logprob: lp.token_logprobs[i],
    top: Object.entries(lp.top_logprobs[i] || {}).map(([t, logprob]) => ({ token: t, logprob })),
    finish: i + 1 < n ? null : choice.finish_reason,
  }));
}

function chatPieces(choice) {
  const text = (choice.delta && choice.delta.content) || "";
  const content = (choice.logprobs && choice.logprobs.content) || [];
  if (!content.length) return [{ text, token: null, logprob: null, top: [], finish: choice.finish_reason }];
  // The delta is its tokens' text unless some was held back (a possible stop string): then it
  // all goes to the last token.
  const whole = content.map((entry) => entry.token).join("") === text;
  return content.map((entry, i) => ({
    text: whole ? entry.token : i + 1 < content.length ? "" : text,
    token: entry.token,
    logprob: entry.logprob,
    top: entry.top_logprobs.map((t) => ({ token: t.token, logprob: t.logprob })),
    finish: i + 1 < content.length ? null : choice.finish_reason,
  }));
}

function probabilityColour(p) {
  return `hsl(${Math.round(120 * p)}, 80%, 82%)`; // red (unlikely) → green (sure); dark text reads on both
}

function tokenSpan(piece) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = piece.text;
  const p = Math.exp(piece.logprob);
  span.style.background = probabilityColour(p);
  span.tabIndex = 0;
  span.dataset.token = piece.token;
  span.dataset.p = String(p);
  span.dataset.top = JSON.stringify(piece.top);
  span.setAttribute("aria-label", `${JSON.stringify(piece.token)}, probability ${(100 * p).toFixed(1)}%`);
  return span;
}

function appendPlain(target, text, className) {
  const span = document.createElement("span");
  if (className) span.className = className;
  span.textContent = text;
  target.appendChild(span);
  return span;
}

function setStatus(id, text, isError = false) {
  $(id).textContent = text;
  $(id).classList.toggle("error", isError);
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error ? body.error.message : JSON.stringify(body)}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// The element the reply streams into: after the prompt (completion) or a new assistant turn (chat).
function startOutput(prompt) {
  const output = $("output");
  if (mode() === "completion") {
    output.textContent = "";
    appendPlain(output, prompt, "prompt-text");
    return output;
  }
  const turn = (role, text) => {
    const div = document.createElement("div");
    div.className = "turn";
    appendPlain(div, `${role}: `, "role");
    if (text !== undefined) appendPlain(div, text);
    output.appendChild(div);
    return div;
  };
  turn("user", prompt);
  return turn("assistant");
}

async function generate(event) {
  event.preventDefault();
  if (state.controller) return;
  const prompt = $("prompt").value;
  const chat = mode() === "chat";
  const body = samplingBody();
  let url;
  if (chat) {
    state.messages.push({ role: "user", content: prompt });
    Object.assign(body, { messages: state.messages, logprobs: true, top_logprobs: TOP_LOGPROBS });
    url = "/v1/chat/completions";
  } else {
    Object.assign(body, { prompt, logprobs: TOP_LOGPROBS });
    url = "/v1/completions";
  }
  const controller = new AbortController();
  state.controller = controller;
  running(true);
  setStatus("status", "Generating…");
  const target = startOutput(prompt);
  let reply = "";
  let n = 0;
  let finish = null;
  try {
    const response = await api(url, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const chunk of serverEvents(response)) {
      if (!chunk.choices.length) continue;
      for (const piece of (chat ? chatPieces : completionPieces)(chunk.choices[0])) {
        if (piece.token !== null) {
          target.appendChild(tokenSpan(piece));
          n += 1;
        } else if (piece.text) {
          appendPlain(target, piece.text);
        }
        reply += piece.text;
        finish = piece.finish || finish;
      }
    }
    setStatus("status", `Done: ${n} tokens, finish_reason ${finish}.`);
  } catch (err) {
    if (err.name === "AbortError") setStatus("status", `Stopped after ${n} tokens.`);
    else setStatus("status", `Error ${err.message}`, true);
  } finally {
    if (chat) state.messages.push({ role: "assistant", content: reply });
    state.controller = null;
    running(false);
  }
}

function running(on) {
  $("generate").disabled = on;
  $("stop-button").disabled = !on;
  $("output").dataset.done = String(!on); // "true" once a request has ended (the browser tests wait on it)
  $("output").setAttribute("aria-busy", String(on));
}

function clearOutput() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  $("output").textContent = "";
  setStatus("status", "Ready.");
}

// ---- Alternatives tooltip -------------------------------------------------------------------

function showTip(span) {
  const tip = $("tip");
  const top = JSON.parse(span.dataset.top);
  tip.textContent = "";
  const head = document.createElement("div");
  head.textContent = `${JSON.stringify(span.dataset.token)}  p = ${Number(span.dataset.p).toFixed(4)}`;
  tip.appendChild(head);
  const table = document.createElement("table");
  for (const alt of top) {
    const p = Math.exp(alt.logprob);
    const row = table.insertRow();
    if (alt.token === span.dataset.token) row.className = "chosen";
    row.insertCell().textContent = JSON.stringify(alt.token);
    row.insertCell().textContent = `${(100 * p).toFixed(1)}%`;
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${Math.max(1, Math.round(60 * p))}px`;
    row.insertCell().appendChild(bar);
  }
  tip.appendChild(table);
  const box = span.getBoundingClientRect();
  tip.style.left = `${window.scrollX + box.left}px`;
  tip.style.top = `${window.scrollY + box.bottom + 4}px`;
  tip.hidden = false;
  document.querySelectorAll(".tok.active").forEach((t) => t.classList.remove("active"));
  span.classList.add("active");
}

function hideTip() {
  $("tip").hidden = true;
  document.querySelectorAll(".tok.active").forEach((t) => t.classList.remove("active"));
}

function tokenOf(event) {
  const span = event.target.closest && event.target.closest("#output .tok");
  return span || null;
}

// ---- Attention ------------------------------------------------------------------------------

function attentionBody() {
  const layer = Number($("layer").value || 0);
  if (mode() === "chat" && state.messages.length) {
    return { messages: state.messages, add_generation_prompt: false, layer };
  }
  const text = $("output").textContent || $("prompt").value;
  return { prompt: text, layer };
}

async function loadAttention() {
  setStatus("attention-status", "Computing attention…");
  try {
    const response = await api("/v1/attention", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(attentionBody()),
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    state.attention = await response.json();
  } catch (err) {
    setStatus("attention-status", `Error ${err.message}`, true);
    return;
  }
  const a = state.attention;
  const cut = a.truncated ? ` (the first ${a.n_tokens} of ${a.prompt_tokens}: the map is capped at ${a.max_tokens})` : "";
  setStatus("attention-status", `Layer ${a.layer}: ${a.n_tokens} tokens${cut}.`);
  $("entropy").textContent =
    "Mean attention entropy per layer (nats): " + a.entropy.map((e, l) => `L${l} ${e.toFixed(3)}`).join(", ");
  drawMaps();
}

function viridis(w) {
  const x = Math.min(1, Math.max(0, w)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  const [a, b] = [VIRIDIS[i], VIRIDIS[i + 1]];
  return a.map((c, k) => Math.round(c + f * (b[k] - c)));
}

function tokenLabel(text) {
  return text.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅";
}

// One head's T×T map on a canvas; with labels when the cells are big enough to read them.
function drawMap(weights, tokens, size, title, head) {
  const t = tokens.length;
  const cell = Math.max(1, Math.floor(size / t));
  const labelled = cell >= 9;
  const margin = labelled ? 72 : 0;
  const canvas = document.createElement("canvas");
  canvas.width = margin + cell * t;
  canvas.height = margin + cell * t;
  canvas.dataset.tokens = String(t);
  canvas.dataset.cell = String(cell);
  canvas.dataset.margin = String(margin);
  canvas.dataset.head = String(head);
  canvas.setAttribute("role", "img");
  canvas.setAttribute("aria-label", `${title}: attention weights of ${t} query tokens (rows) over ${t} key tokens (columns)`);
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(cell * t, cell * t);
  for (let i = 0; i < t; i++) {
    for (let j = 0; j < t; j++) {
      const [r, g, b] = viridis(weights[i][j]);
      for (let y = i * cell; y < (i + 1) * cell; y++) {
        for (let x = j * cell; x < (j + 1) * cell; x++) {
          const o = 4 * (y * cell * t + x);
          image.data[o] = r;
          image.data[o + 1] = g;
          image.data[o + 2] = b;
          image.data[o + 3] = 255;
        }
      }
    }
  }
  ctx.putImageData(image, margin, margin);
  if (labelled) {
    ctx.fillStyle = "#1a1a1a";
    ctx.font = `${Math.min(12, cell)}px ui-monospace, monospace`;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    tokens.forEach((tok, i) => ctx.fillText(tokenLabel(tok).slice(0, 8), margin - 4, margin + (i + 0.5) * cell));
    tokens.forEach((tok, j) => {
      ctx.save();
      ctx.translate(margin + (j + 0.5) * cell, margin - 4);
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      ctx.fillText(tokenLabel(tok).slice(0, 8), 0, 0);
      ctx.restore();
    });
  }
  canvas.addEventListener("mousemove", (event) => {
    const box = canvas.getBoundingClientRect();
    const x = ((event.clientX - box.left) * canvas.width) / box.width - margin;
    const y = ((event.clientY - box.top) * canvas.height) / box.height - margin;
    const i = Math.floor(y / cell);
    const j = Math.floor(x / cell);
    if (i < 0 || j < 0 || i >= t || j >= t) return;
    $("readout").textContent =
      `${title}: query ${i} ${JSON.stringify(tokens[i])} → key ${j} ${JSON.stringify(tokens[j])}: ${weights[i][j].toFixed(4)}`;
  });
  const figure = document.createElement("figure");
  figure.appendChild(canvas);
  const caption = document.createElement("figcaption");
  caption.textContent = title;
  figure.appendChild(caption);
  return figure;
}

function drawMaps() {
  const a = state.attention;
  if (!a) return;
  const maps = $("maps");
  maps.textContent = "";
  const choice = $("head").value;
  const heads = choice === "all" ? a.heads : [Number(choice)];
  const size = heads.length === 1 ? 640 : 240;
  for (const h of heads) {
    const weights = a.weights[a.heads.indexOf(h)];
    maps.appendChild(drawMap(weights, a.tokens, size, `layer ${a.layer}, head ${h}`, h));
  }
}

// ---- Model card and engine panel ------------------------------------------------------------

function bytes(n) {
  for (const [unit, scale] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
    if (n >= scale) return `${(n / scale).toFixed(1)} ${unit}`;
  }
  return `${n} B`;
}

function addFact(dl, term, value) {
  const dt = document.createElement("dt");
  dt.textContent = term;
  const dd = document.createElement("dd");
  dd.textContent = value;
  dl.append(dt, dd);
}

async function loadCard() {
  const response = await api("/v1/model_card");
  if (!response.ok) {
    if (response.status === 401) setStatus("status", NEED_KEY, true);
    setTimeout(loadCard, 1000); // 503 while the model loads, 401 until the key is right
    return;
  }
  if ($("status").textContent === NEED_KEY) setStatus("status", "Ready.");
  const card = await response.json();
  state.card = card;
  const dl = $("card-facts");
  dl.textContent = "";
  addFact(dl, "name", card.model);
  addFact(dl, "parameters", card.parameters.toLocaleString("en"));
  addFact(dl, "layers", card.n_layers);
  addFact(dl, "d_model", card.d_model);
  addFact(dl, "heads / KV heads", `${card.n_heads} / ${card.n_kv_heads} (${card.attention})`);
  addFact(dl, "head_dim", card.head_dim);
  addFact(dl, "positions", card.position);
  addFact(dl, "context", `${card.context_length.toLocaleString("en")} tokens`);
  if (card.sliding_window) addFact(dl, "sliding window", card.sliding_window);
  addFact(dl, "weights", card.dtype);
  addFact(dl, "KV cache / token", bytes(card.kv_cache_bytes_per_token));
  const body = $("kv-table").tBodies[0];
  body.textContent = "";
  for (const row of card.kv_cache) {
    const tr = body.insertRow();
    if (row.variant === "model") tr.className = "this";
    const name = `${row.attention} (${row.n_kv_heads})${row.variant === "model" ? " this" : ""}`;
    const cells = [name, bytes(row.bytes_per_token), ...["4096", "32768", "131072"].map((n) => bytes(row.bytes_at[n]))];
    for (const text of cells) tr.insertCell().textContent = text;
  }
  const layer = $("layer");
  for (let l = 0; l < card.n_layers; l++) layer.add(new Option(String(l), String(l)));
  const head = $("head");
  for (let h = 0; h < card.n_heads; h++) head.add(new Option(String(h), String(h)));
}

async function pollEngine() {
  if (!document.hidden) {
    try {
      const response = await api("/v1/engine_stats");
      if (response.ok) {
        const s = await response.json();
        $("e-running").textContent = s.running;
        $("e-waiting").textContent = s.waiting;
        $("e-blocks").textContent = `${s.kv_blocks_used} / ${s.kv_blocks_total}`;
        $("e-meter").value = s.kv_blocks_total ? s.kv_blocks_used / s.kv_blocks_total : 0;
        $("e-rate").textContent = s.tokens_per_s.toFixed(1);
        $("e-generated").textContent = s.generated_tokens.toLocaleString("en");
      }
    } catch {
      // the server went away; keep polling quietly
    }
  }
  setTimeout(pollEngine, ENGINE_POLL_MS);
}

// ---- Wiring ---------------------------------------------------------------------------------

function init() {
  const key = $("api-key");
  key.value = sessionStorage.getItem(API_KEY_ITEM) || "";
  key.addEventListener("change", () => sessionStorage.setItem(API_KEY_ITEM, key.value.trim()));
  $("gen-form").addEventListener("submit", generate);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      $("gen-form").requestSubmit();
    }
  });
  $("stop-button").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", clearOutput);
  for (const radio of document.querySelectorAll('input[name="mode"]')) {
    radio.addEventListener("change", () => {
      $("prompt-label").textContent = mode() === "chat" ? "Message" : "Prompt";
      clearOutput();
    });
  }
  const output = $("output");
  output.addEventListener("mouseover", (e) => tokenOf(e) && showTip(tokenOf(e)));
  output.addEventListener("focusin", (e) => tokenOf(e) && showTip(tokenOf(e)));
  output.addEventListener("click", (e) => tokenOf(e) && showTip(tokenOf(e))); // tap on touch screens
  output.addEventListener("mouseleave", hideTip);
  output.addEventListener("focusout", hideTip);
  document.addEventListener("keydown", (e) => e.key === "Escape" && hideTip());
  $("attention-button").addEventListener("click", loadAttention);
  $("layer").addEventListener("change", () => state.attention && loadAttention());
  $("head").addEventListener("change", drawMaps);
  loadCard();
  pollEngine();
}

document.addEventListener("DOMContentLoaded", init);
