// meshws chat page: talks to the head over /ws/chat, shows the mesh from /health.
// Model output is only ever set with textContent: it is text, never HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("input"), sendButton = $("send"), stopButton = $("stop");
const settings = {
  temperature: $("temperature"), maxTokens: $("max-tokens"), system: $("system"), apiKey: $("api-key"),
};

let socket = null;
let reconnectDelay = 500;
let history = [];          // the conversation: {role, content}
let turn = null;           // the answer being streamed: {id, node, text, body}
let turnCounter = 0;

// -- settings, kept in localStorage --------------------------------------------
for (const [name, element] of Object.entries(settings)) {
  const saved = localStorage.getItem("meshws." + name);
  if (saved !== null) element.value = saved;
  element.addEventListener("input", () => {
    localStorage.setItem("meshws." + name, element.value);
    if (name === "temperature") $("temperature-value").textContent = element.value;
  });
}
$("temperature-value").textContent = settings.temperature.value;
settings.apiKey.addEventListener("change", () => socket && socket.close());

// -- the conversation ----------------------------------------------------------
function addMessage(role, text) {
  $("empty").hidden = true;
  const node = document.createElement("div");
  node.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  node.appendChild(body);
  log.appendChild(node);
  log.scrollTop = log.scrollHeight;
  return { node, body };
}

function addMeta(node, text, className = "meta") {
  const meta = document.createElement("div");
  meta.className = className;
  meta.textContent = text;
  node.appendChild(meta);
}

// Where an answer's time went, per lap: the head's layers, each shard (as it reports), the links (the rest).
function addLapBar(node, hops) {
  if (!hops || !hops.laps) return;
  const parts = [["head", hops.head_ms, "head"]];
  hops.hops.forEach((hop, index) => parts.push([String(hop.node).split("@")[0], hop.ms, `hop${index % 4 + 1}`]));
  parts.push(["links", hops.network_ms, "links"]);
  const total = parts.reduce((sum, part) => sum + part[1], 0) || 1;
  const bar = document.createElement("div");
  bar.className = "lap-bar";
  bar.setAttribute("role", "img");
  const words = parts.map(([name, ms]) => `${name} ${(ms / hops.laps).toFixed(1)} ms`).join(" · ");
  bar.setAttribute("aria-label", `per lap: ${words}`);
  for (const [name, ms, kind] of parts) {
    const piece = document.createElement("span");
    piece.className = `lap-part lap-${kind}`;
    piece.style.width = `${(100 * ms / total).toFixed(2)}%`;
    piece.title = `${name}: ${(ms / hops.laps).toFixed(1)} ms per lap`;
    bar.appendChild(piece);
  }
  node.appendChild(bar);
  addMeta(node, `per lap (${hops.laps} laps): ${words}`, "lap-meta");
}

function showError(text) {
  addMessage("error", text);
}

function setBusy(busy) {
  sendButton.hidden = busy;
  stopButton.hidden = !busy;
}

function finishTurn(keepText) {
  if (!turn) return;
  turn.node.classList.remove("streaming");
  if (keepText && turn.text) history.push({ role: "assistant", content: turn.text });
  turn = null;
  setBusy(false);
}

function send() {
  const text = input.value.trim();
  if (!text || turn) return;
  if (!socket || socket.readyState !== WebSocket.OPEN) {
    showError("Not connected to the head; reconnecting…");
    return;
  }
  input.value = "";
  addMessage("user", text);
  history.push({ role: "user", content: text });
  const messages = settings.system.value.trim()
    ? [{ role: "system", content: settings.system.value.trim() }, ...history]
    : history.slice();
  const id = "turn-" + (++turnCounter);
  const { node, body } = addMessage("assistant", "");
  node.classList.add("streaming");
  turn = { id, node, body, text: "" };
  setBusy(true);
  socket.send(JSON.stringify({
    type: "chat", id, messages,
    temperature: Number(settings.temperature.value),
    max_tokens: Math.max(1, Number(settings.maxTokens.value) || 256),
  }));
}

function routeText(route) {
  return (route || []).map((hop) => `${hop.node} [${hop.layers[0]}-${hop.layers[1] - 1}]`).join(" → ");
}

function onMessage(event) {
  let data;
  try { data = JSON.parse(event.data); } catch { return; }
  if (!turn || (data.id !== undefined && data.id !== turn.id)) {
    if (data.type === "error") showError(data.message);
    return;
  }
  if (data.type === "delta") {
    turn.text += data.text;
    turn.body.textContent = turn.text;
    log.scrollTop = log.scrollHeight;
  } else if (data.type === "done") {
    const t = data.timing || {};
    const why = data.finish_reason === "stopped" ? "stopped · " : data.finish_reason === "length" ? "max tokens · " : "";
    // cached: prompt tokens this conversation's session held already (not prefilled again)
    const cached = data.cached_tokens ? ` · ${data.cached_tokens} of ${data.usage.prompt_tokens} prompt tokens cached` : "";
    // speculation: tokens per lap through the mesh, and how many guessed tokens the tail kept
    const spec = data.usage.speculation;
    const laps = spec && spec.draft_tokens ? ` · ${spec.tokens_per_lap} tokens/lap (${spec.accepted_draft_tokens}/${spec.draft_tokens} guesses kept)` : "";
    addMeta(turn.node, `${why}${data.usage.completion_tokens} tokens${cached}${laps} · first token ${t.ttft_ms ?? "–"} ms · ` +
      `${t.tokens_per_second} tok/s · route ${routeText(data.route)}`);
    addLapBar(turn.node, data.hops);
    finishTurn(true);
  } else if (data.type === "error") {
    const partial = turn.text;
    finishTurn(Boolean(partial));
    if (!partial) history.pop();  // the question gets no answer; it can be asked again
    showError(data.message);
  }
}

// -- the socket, reconnecting --------------------------------------------------
function connect() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const key = settings.apiKey.value.trim();
  const url = `${scheme}//${location.host}/ws/chat` + (key ? `?api_key=${encodeURIComponent(key)}` : "");
  setConn("connecting");
  socket = new WebSocket(url);
  socket.addEventListener("open", () => { reconnectDelay = 500; setConn("open"); });
  socket.addEventListener("message", onMessage);
  socket.addEventListener("close", () => {
    setConn("closed");
    if (turn) {
      const partial = turn.text;
      finishTurn(Boolean(partial));
      showError("The connection to the head was lost mid-answer; reconnecting…");
    }
    setTimeout(connect, reconnectDelay);
    reconnectDelay = Math.min(reconnectDelay * 2, 8000);
  });
}

function setConn(state) {
  const pill = $("conn");
  pill.dataset.state = state;
  pill.textContent = { open: "connected", closed: "disconnected", connecting: "connecting" }[state];
}

// -- the mesh panel ------------------------------------------------------------
async function refreshMesh() {
  try {
    // The detailed view needs the API key (or a loopback client); without it: status, role, model, layers.
    const key = settings.apiKey.value.trim();
    const response = await fetch("/health", { cache: "no-store", headers: key ? { Authorization: `Bearer ${key}` } : {} });
    const health = await response.json();
    $("model").textContent = health.model;
    const list = $("mesh-nodes");
    list.replaceChildren();
    // Joined nodes (with their load) when the head has a registry, else the --peer chain.
    const joined = (health.nodes || []).map((n) => `${n.node} · layers ${n.layers[0]}-${n.layers[1] - 1} · ${n.load} session(s)`);
    const head = `${health.node || health.role} · layers ${health.layers[0]}-${health.layers[1] - 1}` +
      (health.sessions === undefined ? "" : ` · ${health.sessions} session(s)`);
    const lines = joined.length ? [head, ...joined]
      : health.chain ? health.chain.map((hop) => `${hop.node} · layers ${hop.layers[0]}-${hop.layers[1] - 1}`) : [head];
    for (const text of lines) {
      const item = document.createElement("li");
      item.textContent = text;
      list.appendChild(item);
    }
    const problems = health.problems || (health.ready ? [] : ["the mesh cannot serve every layer yet"]);
    $("mesh-status").textContent = problems.length
      ? "Not ready: " + problems.join("; ")
      : `Ready · ${lines.length} node(s) · ${health.generations ?? 0} generating`;
  } catch (error) {
    $("mesh-status").textContent = "The head does not answer.";
  }
}

// -- wiring ---------------------------------------------------------------------
$("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
stopButton.addEventListener("click", () => {
  if (turn && socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "stop" }));
});
$("new-chat").addEventListener("click", () => {
  // reset: the head stops a running answer and releases this conversation's session on every shard
  if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "reset" }));
  finishTurn(false);
  history = [];
  log.querySelectorAll(".msg").forEach((node) => node.remove());
  $("empty").hidden = false;
  input.focus();
});
$("toggle-side").addEventListener("click", () => {
  const open = document.body.classList.toggle("side-open");
  $("toggle-side").setAttribute("aria-expanded", String(open));
});

connect();
refreshMesh();
setInterval(refreshMesh, 3000);
input.focus();
