// The sluice playground: chat with the served model through /v1/chat/completions,
// streamed as server-sent events. Plain JavaScript without dependencies, because the
// page must work on machines with no internet access.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "sluice.apiKey";

const state = {
  history: [],      // the conversation as chat messages, without the system prompt
  controller: null, // aborts the streaming request (Stop, New conversation)
  model: null,      // the served model's name, once /v1/models answered
  conversation: 0,  // bumped by New conversation: a reply still ending belongs to the old one
};

// ---- talking to the server ----------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// A failed response as one readable line, from sluice's OpenAI-shaped error body.
async function errorMessage(resp) {
  let detail = resp.statusText || "request failed";
  try {
    const body = await resp.json();
    if (body.error && body.error.message) {
      detail = body.error.message;
      if (body.error.param) detail += ` (${body.error.param})`;
    }
  } catch (_) {
    // not JSON: keep the status text
  }
  let msg = `Error ${resp.status}: ${detail}`;
  if (resp.status === 401) msg += ". Enter the server's API key on the left.";
  const retry = resp.headers.get("Retry-After");
  if (retry) msg += ` Retry in ${retry} s.`;
  return msg;
}

// Yields each JSON event of an SSE response until `data: [DONE]`.
async function* sseEvents(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder(); // stream mode keeps characters split across reads whole
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

async function loadModel() {
  try {
    const resp = await fetch("/v1/models", { headers: headers() });
    if (!resp.ok) {
      $("model").textContent = resp.status === 401 ? "API key needed" : `models: ${resp.status}`;
      return;
    }
    const card = (await resp.json()).data[0];
    state.model = card.id;
    $("model").textContent = `${card.id} · context ${card.max_model_len} tokens`;
  } catch (err) {
    $("model").textContent = "server unreachable";
  }
}

// ---- the request ----------------------------------------------------------------------

function numberField(id, parse) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const value = parse(raw);
  return Number.isNaN(value) ? raw : value; // a non-number goes as is: the server names it
}

function stopStrings() {
  return $("stop").value.split("\n").filter((s) => s !== "").map((s) => s.replaceAll("\\n", "\n"));
}

function requestBody() {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history);
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (state.model) body.model = state.model;
  // Sent as typed, even out of range: the server's 400 says what is wrong.
  const fields = { temperature: ["temperature", parseFloat], top_p: ["top-p", parseFloat],
                   max_tokens: ["max-tokens", (s) => Number(s)] };
  for (const [name, [id, parse]] of Object.entries(fields)) {
    const value = numberField(id, parse);
    if (value !== undefined) body[name] = value;
  }
  const stop = stopStrings();
  if (stop.length) body.stop = stop;
  return body;
}

// ---- the page -----------------------------------------------------------------------

function addMessage(role, text) {
  $("empty").hidden = true;
  const box = document.createElement("div");
  box.className = `msg ${role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "you" : (state.model || "assistant");
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  box.append(who, content);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = false;
  document.body.dataset.state = "error";
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop-button").hidden = !busy;
  if (busy) document.body.dataset.state = "streaming";
  else if (document.body.dataset.state === "streaming") document.body.dataset.state = "idle";
}

// Live figures: TTFT from sending to the first token; tokens/s over the tokens after
// the first (the first one's time is the prompt's, which TTFT already shows).
function showReadout(run) {
  if (run.first === null) return;
  $("ttft").textContent = `${Math.round(run.first - run.sent)} ms`;
  $("tokens").textContent = String(run.tokens);
  const seconds = (run.last - run.first) / 1000;
  if (run.tokens > 1 && seconds > 0) $("tps").textContent = ((run.tokens - 1) / seconds).toFixed(1);
}

function onEvent(run, event) {
  if (event.error) throw new Error(`Error: ${event.error.message}`); // failed mid-stream
  for (const choice of event.choices || []) {
    const delta = choice.delta && choice.delta.content;
    if (!delta) continue;
    const now = performance.now();
    if (run.first === null) run.first = now;
    run.last = now;
    run.tokens += 1; // one event per engine step: a token (the usage event corrects it)
    run.reply += delta;
    run.content.textContent = run.reply;
  }
  if (event.usage) run.tokens = event.usage.completion_tokens;
  showReadout(run);
}

async function send(text) {
  clearError();
  state.history.push({ role: "user", content: text });
  const userBox = addMessage("user", text);
  const box = addMessage("assistant", "");
  box.classList.add("streaming");
  const run = { sent: performance.now(), first: null, last: null, tokens: 0, reply: "",
                content: box.querySelector(".content") };
  state.controller = new AbortController();
  const conversation = state.conversation;
  setBusy(true);
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
      body: JSON.stringify(requestBody()), signal: state.controller.signal });
    if (!resp.ok) throw new Error(await errorMessage(resp));
    for await (const event of sseEvents(resp)) onEvent(run, event);
    state.history.push({ role: "assistant", content: run.reply });
  } catch (err) {
    if (conversation !== state.conversation) {
      // reset() already cleared this turn
    } else if (err.name === "AbortError") {
      if (run.reply) state.history.push({ role: "assistant", content: run.reply });
      else state.history.pop();
    } else {
      fail(err, text, userBox, box);
    }
  } finally {
    box.classList.remove("streaming");
    state.controller = null;
    setBusy(false);
  }
}

// The turn did not happen: take it back out and give the text back for a retry.
function fail(err, text, userBox, box) {
  state.history.pop();
  userBox.remove();
  box.remove();
  if (!state.history.length) $("empty").hidden = false;
  if (!$("message").value) $("message").value = text;
  showError(err instanceof TypeError ? `Cannot reach the server: ${err.message}` : err.message);
}

function reset() {
  if (state.controller) state.controller.abort();
  state.conversation += 1;
  state.history = [];
  for (const box of document.querySelectorAll("#messages .msg")) box.remove();
  $("empty").hidden = false;
  for (const id of ["ttft", "tps"]) $(id).textContent = "–";
  $("tokens").textContent = "0";
  clearError();
  document.body.dataset.state = "idle";
}

function init() {
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    loadModel();
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("message").value.trim();
    if (!text || state.controller) return;
    $("message").value = "";
    send(text);
  });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop-button").addEventListener("click", () => state.controller && state.controller.abort());
  $("reset").addEventListener("click", reset);
  loadModel();
}

init();
