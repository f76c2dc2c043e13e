// dflash-server's chat page: plain JavaScript, no framework, nothing fetched from elsewhere.
// Streams replies from /v1/chat/completions (server-sent events), shows reasoning apart from
// the answer, stops a reply by closing its connection (the server then stops generating),
// keeps conversations in localStorage and shows, under each reply, what speculative
// decoding did (the final chunk's llama-server `timings` and our `dflash` fields).
"use strict";

const STORE = "dflash-webui";
const $ = (id) => document.getElementById(id);

let props = null;           // GET /props
let controller = null;      // the AbortController of the reply in progress
const state = load();       // {conversations: [{id, title, messages}], current, settings}

// -- storage ------------------------------------------------------------------------------

function load() {
  try {
    const s = JSON.parse(localStorage.getItem(STORE));
    if (s && Array.isArray(s.conversations)) return {settings: {}, ...s};
  } catch (e) { /* nothing kept, or unreadable: start afresh */ }
  return {conversations: [], current: null, settings: {}};
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(state));
  } catch (e) {
    setStatus(`could not keep the conversation: ${e.message}`);
  }
}

function current() {
  return state.conversations.find((c) => c.id === state.current) || null;
}

function newConversation() {
  const c = {id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`, title: "New chat",
             messages: []};
  state.conversations.unshift(c);
  state.current = c.id;
  save();
  return c;
}

// -- the server ---------------------------------------------------------------------------

function headers() {
  const h = {"Content-Type": "application/json"};
  if (state.settings.apiKey) h.Authorization = `Bearer ${state.settings.apiKey}`;
  return h;
}

async function errorText(res) {
  try {
    const body = await res.json();
    return `${res.status}: ${(body.error && body.error.message) || JSON.stringify(body)}`;
  } catch (e) {
    return `${res.status} ${res.statusText}`;
  }
}

function defaults() {
  const gen = (props && props.default_generation_settings) || {};
  const p = gen.params || {};
  return {temperature: p.temperature ?? 0.8, topK: p.top_k ?? 40, topP: p.top_p ?? 0.95,
          maxTokens: p.n_predict ?? -1};
}

function thinks() {
  // a template that can think: it reads enable_thinking or opens a thinking block
  const t = (props && props.chat_template) || "";
  return /enable_thinking|<think>|reasoning_content|thinking/.test(t);
}

async function loadProps() {
  try {
    const res = await fetch("/props", {headers: headers()});
    if (!res.ok) throw new Error(await errorText(res));
    props = await res.json();
  } catch (e) {
    $("model-info").textContent = `cannot read /props (${e.message})`;
    if (String(e.message).startsWith("401")) {
      $("settings").open = true;
      $("api-key").focus();
    }
    return;
  }
  $("model-name").textContent = props.model_alias || "dflash-server";
  const gen = props.default_generation_settings || {};
  const spec = props.speculative || {};
  const info = [`context ${gen.n_ctx}`, spec.mode || (spec.drafter ? "speculative" : "autoregressive")];
  if (props.exact && props.exact.exact) {
    info.push(`exact: ${props.exact.exact}`);
    $("model-info").title = props.exact.why || "";
  }
  $("model-info").textContent = info.join(" · ");
  document.title = `${props.model_alias} · dflash-server`;
  showSettings();
}

// -- settings -----------------------------------------------------------------------------

const FIELDS = [["temperature", "temperature"], ["top-k", "topK"], ["top-p", "topP"], ["max-tokens", "maxTokens"]];

function showSettings() {
  const d = defaults(), s = state.settings;
  for (const [id, key] of FIELDS) $(id).value = s[key] ?? d[key];
  const row = $("thinking-row");
  row.hidden = !thinks();
  const kwargs = (props && props.chat_template_kwargs) || {};
  $("thinking").checked = s.thinking ?? kwargs.enable_thinking !== false;
  $("system").value = s.system || "";
  $("custom-json").value = s.custom || "";
  showCustomError();
  $("api-key").value = s.apiKey || "";
}

function readSettings() {
  const s = state.settings;
  for (const [id, key] of FIELDS) {
    const v = $(id).value;
    if (v === "") delete s[key]; else s[key] = Number(v);
  }
  s.thinking = $("thinking").checked;
  s.system = $("system").value;
  s.custom = $("custom-json").value.trim();
  showCustomError();
  s.apiKey = $("api-key").value.trim();
  save();
}

function sampling() {
  const d = defaults(), s = state.settings;
  const body = {temperature: s.temperature ?? d.temperature, top_k: Math.trunc(s.topK ?? d.topK),
                top_p: s.topP ?? d.topP};
  const max = Math.trunc(s.maxTokens ?? d.maxTokens);
  if (max >= 0) body.max_tokens = max;
  if (thinks()) body.chat_template_kwargs = {enable_thinking: $("thinking").checked};
  return {...body, ...customFields()};
}

// The settings' Custom JSON: an object whose fields go into every request as they are.
function customFields() {
  const text = state.settings.custom || "";
  if (!text) return {};
  const value = JSON.parse(text);  // SyntaxError: the message says where
  if (value === null || typeof value !== "object" || Array.isArray(value)) throw new Error("Custom JSON must be an object");
  return value;
}

function showCustomError() {
  let why = "";
  try { customFields(); } catch (e) { why = `Custom JSON: ${e.message}`; }
  $("custom-json-error").textContent = why;
  $("custom-json-error").hidden = !why;
}

// -- rendering ----------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c) node.append(c);
  return node;
}

function renderConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of state.conversations) {
    const open = el("button", {type: "button", class: "open", text: c.title,
                               onclick: () => { if (!controller) { state.current = c.id; save(); render(); } }});
    if (c.id === state.current) open.setAttribute("aria-current", "true");
    const del = el("button", {type: "button", class: "delete", "aria-label": `Delete conversation: ${c.title}`,
                              title: "Delete", text: "×", onclick: () => remove(c.id)});
    list.append(el("li", {}, open, del));
  }
}

function remove(id) {
  if (controller && id === state.current) return;  // not the one streaming
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.current === id) state.current = state.conversations.length ? state.conversations[0].id : null;
  save();
  render();
}

function pct(a, b) {
  return b ? `${Math.round((100 * a) / b)}%` : "–";
}

// what speculation did for a reply, in words: [label, value, explanation]
function statsParts(m) {
  const t = m.timings, d = m.dflash || {};
  const parts = [];
  if (t) parts.push(["tokens", `${t.predicted_n}`, "tokens generated"]);
  if (d.mean_accepted_length) {
    parts.push(["tokens/pass", d.mean_accepted_length.toFixed(2),
                `tokens per target pass (mean acceptance) over ${d.target_passes} passes`]);
  }
  if (t && t.draft_n) {
    parts.push(["drafted", `${t.draft_n}`, "tokens the drafter proposed"]);
    parts.push(["accepted", `${t.draft_n_accepted} (${pct(t.draft_n_accepted, t.draft_n)})`,
                "drafted tokens the target accepted"]);
  }
  if (t && t.predicted_per_second) parts.push(["tok/s", t.predicted_per_second.toFixed(1), "generation speed"]);
  if (t && t.prompt_n !== undefined) {
    parts.push(["prompt", `${t.prompt_n + (t.cache_n || 0)}` + (t.cache_n ? ` (${t.cache_n} cached)` : ""),
                "prompt tokens (read from the cache)"]);
  }
  if (m.exact !== undefined && m.exact !== null) parts.push(["exact", `${m.exact}`, "equal to plain decoding"]);
  return parts;
}

function messageView(m) {
  const body = el("div", {class: "body"});
  const view = el("article", {class: `message ${m.role}`, "data-state": m.state || "done"},
                  el("h2", {class: "role", text: m.role === "user" ? "You" : "Assistant"}), body);
  if (m.role === "assistant") {
    const reasoning = el("details", {class: "reasoning"}, el("summary", {text: "Reasoning"}),
                         el("div", {class: "reasoning-text"}));
    reasoning.hidden = true;
    body.append(reasoning, el("div", {class: "content"}), el("p", {class: "note"}), el("p", {class: "stats", "aria-label": "What speculative decoding did"}));
  } else {
    body.append(el("div", {class: "content"}));
  }
  updateView(view, m);
  return view;
}

// text with its ``` fenced blocks as code (an unclosed fence, mid-stream, too); nothing
// else is interpreted: the model's text never becomes markup
function showText(node, text) {
  const parts = text.split(/^```/m);
  node.replaceChildren();
  parts.forEach((part, i) => {
    if (i % 2 === 0) {
      let t = i ? part.replace(/^[ \t]*\n/, "") : part;  // after a closing fence: its line's end
      if (i < parts.length - 1) t = t.replace(/\n+$/, "");  // before a fence: the block sets it apart
      if (t) node.append(el("span", {text: t}));
      return;
    }
    const nl = part.indexOf("\n");
    const lang = nl < 0 ? part : part.slice(0, nl);
    const code = el("code", {text: nl < 0 ? "" : part.slice(nl + 1).replace(/\n$/, "")});
    if (/^[\w+-]+$/.test(lang.trim())) code.dataset.lang = lang.trim();
    node.append(el("pre", {}, code));
  });
}

function updateView(view, m) {
  const ending = view.dataset.state === "streaming" && m.state !== "streaming";
  view.dataset.state = m.state || "done";
  view.dataset.chars = (m.content || "").length;  // the reply's text so far
  view.setAttribute("aria-busy", m.state === "streaming" ? "true" : "false");  // read out once whole
  const content = view.querySelector(".content");
  if (m.role === "assistant") showText(content, m.content || ""); else content.textContent = m.content || "";
  if (m.role !== "assistant") return;
  const reasoning = view.querySelector(".reasoning");
  reasoning.hidden = !m.reasoning;
  reasoning.querySelector(".reasoning-text").textContent = m.reasoning || "";
  // open while it thinks, folded once it answers (and as it ends: the view may not have
  // been drawn between the first answer token and the end)
  if (m.state === "streaming" || ending) reasoning.open = !m.content;
  const note = view.querySelector(".note");
  note.textContent = m.state === "stopped" ? "Stopped." : m.state === "error" ? `Error: ${m.error}` :
    m.state === "streaming" ? "generating…" : m.finish === "length" ? "Cut at max tokens." : "";
  note.hidden = !note.textContent;
  const stats = view.querySelector(".stats");
  stats.replaceChildren();
  for (const [label, value, title] of statsParts(m)) {
    stats.append(el("span", {class: "stat", title}, el("span", {class: "label", text: label}), " ",
                    el("strong", {text: value})));
  }
  stats.hidden = !stats.childElementCount;
}

function render() {
  renderConversations();
  const box = $("messages");
  box.replaceChildren();
  const c = current();
  if (!c || !c.messages.length) {
    box.append(el("p", {class: "empty muted", id: "empty",
                        text: "Ask something. Under each reply: what speculative decoding did."}));
    return;
  }
  for (const m of c.messages) box.append(messageView(m));
  box.scrollTop = box.scrollHeight;
}

function setStatus(text) {
  $("status").textContent = text;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("new-chat").disabled = busy;
}

// -- a reply ------------------------------------------------------------------------------

async function readEvents(res, onData) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buf += decoder.decode(value, {stream: true}).replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;  // comments (keep-alives), other fields
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

function history(c) {
  const out = [];
  const system = (state.settings.system || "").trim();
  if (system) out.push({role: "system", content: system});
  for (const m of c.messages) {
    if (m.state === "streaming") continue;
    if (m.role === "assistant" && !m.content) continue;  // an error, or stopped before any answer
    out.push({role: m.role, content: m.content});
  }
  return out;
}

async function send(text, fields) {
  const c = current() || newConversation();
  c.messages.push({role: "user", content: text});
  if (c.title === "New chat") c.title = text.replace(/\s+/g, " ").slice(0, 48);
  const body = {model: props ? props.model_alias : undefined, messages: history(c), stream: true,
                stream_options: {include_usage: true}, ...fields};
  const reply = {role: "assistant", content: "", reasoning: "", state: "streaming"};
  c.messages.push(reply);
  save();
  render();
  const view = $("messages").lastElementChild;
  controller = new AbortController();
  setBusy(true);
  setStatus("generating…");
  const box = $("messages");
  let frame = 0;
  try {
    const res = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body),
                                                      signal: controller.signal});
    if (!res.ok) throw new Error(await errorText(res));
    await readEvents(res, (data) => {
      if (data.error) throw new Error(data.error.message || JSON.stringify(data.error));
      const choice = data.choices && data.choices[0];
      if (choice) {
        const delta = choice.delta || {};
        if (delta.content) reply.content += delta.content;
        if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
        if (choice.finish_reason) reply.finish = choice.finish_reason;
      }
      if (data.timings) reply.timings = data.timings;
      if (data.dflash) reply.dflash = data.dflash;
      const exact = (data.timings && data.timings.exact) ?? (data.usage && data.usage.exact) ??
                    (data.dflash && data.dflash.exact);
      if (exact !== undefined && exact !== null) reply.exact = exact;
      // the view follows at most once a frame: a fast server sends far more events than a
      // page can lay out, and laying out each would keep the Stop button from being heard
      if (!frame) frame = requestAnimationFrame(() => {
        frame = 0;
        const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
        updateView(view, reply);
        if (atBottom) box.scrollTop = box.scrollHeight;
      });
    });
    reply.state = "done";
    setStatus(reply.finish === "length" ? "Reply done (cut at max tokens)." : "Reply done.");
  } catch (e) {
    if (e.name === "AbortError") {
      reply.state = "stopped";
      setStatus("Stopped.");
    } else {
      controller.abort();  // close the connection, should it still be open
      reply.state = "error";
      reply.error = e.message;
      setStatus(`Error: ${e.message}`);
    }
  } finally {
    cancelAnimationFrame(frame);
    controller = null;
    save();
    updateView(view, reply);
    setBusy(false);
    renderConversations();
  }
}

function stop() {
  if (controller) controller.abort();  // closing the connection stops the generation
}

// -- start --------------------------------------------------------------------------------

function start() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    let fields;
    try { fields = sampling(); } catch (err) {  // a bad Custom JSON: the message stays to be sent
      setStatus(`Custom JSON: ${err.message}`);
      return;
    }
    $("prompt").value = "";
    send(text, fields);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && controller) stop(); });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    const c = current();
    if (!c || c.messages.length) newConversation();
    render();
    $("prompt").focus();
  });
  $("settings-form").addEventListener("change", () => {
    const key = state.settings.apiKey;
    readSettings();
    if (state.settings.apiKey !== key) loadProps();
  });
  $("settings-form").addEventListener("submit", (e) => e.preventDefault());
  $("reset-settings").addEventListener("click", () => {
    state.settings = {apiKey: state.settings.apiKey};
    save();
    showSettings();
  });
  // a reply left streaming when the page closed ends there
  for (const c of state.conversations) for (const m of c.messages) if (m.state === "streaming") m.state = "stopped";
  showSettings();
  render();
  loadProps();
}

start();
