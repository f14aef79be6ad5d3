// meshws chat page: talks to the head over /ws/chat, shows the mesh from /health.
// Conversations live in this browser (localStorage). Answers are Markdown, rendered by the head into
// sanitized HTML (the `render` message; api/markdown.py) and shown under the page's Content-Security-Policy;
// everything else the page shows (questions, titles, node names, errors) is set with textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("input"), sendButton = $("send"), stopButton = $("stop");
const settings = {
  temperature: $("temperature"), maxTokens: $("max-tokens"), system: $("system"), apiKey: $("api-key"),
};
const CHATS_KEY = "meshws.chats", OPEN_KEY = "meshws.open", MAX_CHATS = 100;

let socket = null;
let reconnectDelay = 500;
let chats = loadChats();  // [{id, title, updated, messages: [{role, content, meta?, hops?}]}], newest first
let current = chats.find((chat) => chat.id === localStorage.getItem(OPEN_KEY)) || null;
let turn = null;          // the answer being streamed: {id, chat, node, body, text, started, rendering}
let turnCounter = 0;
const renders = new Map();  // render request id -> callback(html)
let renderCounter = 0;

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(action, text, label) {
  const node = element("button", "action", text);
  node.type = "button";
  node.dataset.action = action;
  if (label) node.setAttribute("aria-label", label);
  return node;
}

// -- settings, kept in localStorage --------------------------------------------
for (const [name, field] of Object.entries(settings)) {
  const saved = localStorage.getItem("meshws." + name);
  if (saved !== null) field.value = saved;
  field.addEventListener("input", () => {
    localStorage.setItem("meshws." + name, field.value);
    if (name === "temperature") $("temperature-value").textContent = field.value;
  });
}
$("temperature-value").textContent = settings.temperature.value;
settings.apiKey.addEventListener("change", () => socket && socket.close());

// -- conversations, kept in localStorage ---------------------------------------
function loadChats() {
  let list;
  try { list = JSON.parse(localStorage.getItem(CHATS_KEY) || "[]"); } catch { return []; }
  if (!Array.isArray(list)) return [];
  // What storage holds may be old or edited by hand: keep only what has the shape the page draws.
  return list.filter((chat) => chat && typeof chat.id === "string" && Array.isArray(chat.messages)).map((chat) => ({
    id: chat.id,
    title: typeof chat.title === "string" ? chat.title : "",
    updated: Number(chat.updated) || 0,
    messages: chat.messages.filter((message) => message && ["user", "assistant"].includes(message.role)
      && typeof message.content === "string").map((message) => ({
      role: message.role, content: message.content,
      ...(typeof message.meta === "string" ? { meta: message.meta } : {}),
      ...(validHops(message.hops) ? { hops: message.hops } : {}),
    })),
  }));
}

function number(value) { // (a declaration: stored chats are read, through validHops, before this line runs)
  return typeof value === "number" && Number.isFinite(value);
}

function validHops(hops) {
  const named = (part) => part && typeof part.node === "string" && number(part.ms);
  return Boolean(hops) && number(hops.laps) && number(hops.head_ms) && number(hops.network_ms)
    && Array.isArray(hops.hops) && hops.hops.every(named)
    && (hops.links === undefined || (Array.isArray(hops.links) && hops.links.every((link) => link && number(link.ms))));
}

function saveChats() {
  chats.sort((a, b) => (b.updated || 0) - (a.updated || 0));
  chats = chats.slice(0, MAX_CHATS);
  try {
    localStorage.setItem(CHATS_KEY, JSON.stringify(chats));
    localStorage.setItem(OPEN_KEY, current ? current.id : "");
  } catch { /* storage full or off: the conversation goes on, unsaved */ }
  renderChatList();
}

function touch(chat) {
  chat.updated = Date.now();
  if (!chat.title) {
    const first = chat.messages.find((message) => message.role === "user");
    if (first) chat.title = first.content.replace(/\s+/g, " ").trim().slice(0, 48);
  }
  saveChats();
}

function renderChatList() {
  const list = $("chat-list");
  list.replaceChildren();
  for (const chat of chats) {
    const item = element("li", "chat-item" + (chat === current ? " open" : ""));
    item.dataset.id = chat.id;
    const open = button("open-chat", chat.title || "New chat");
    open.classList.add("chat-title");
    if (chat === current) open.setAttribute("aria-current", "true");
    item.append(open, button("rename-chat", "✎", "Rename"), button("delete-chat", "✕", "Delete"));
    list.appendChild(item);
  }
  $("no-chats").hidden = chats.length > 0;
}

// Show `chat` (null: a new one). The socket's session held the one before: it is released, and the next
// turn prefills this one.
function openChat(chat) {
  stopTurn();
  sendIfOpen({ type: "reset" });
  current = chat;
  renderLog();
  saveChats();
  closePanels();
  input.focus();
}

// On a phone, the conversations and the settings lie over the chat: one panel at a time.
const PANELS = [["toggle-side", "side-open"], ["toggle-chats", "chats-open"]];

function closePanels(except = null) {
  for (const [toggle, className] of PANELS) {
    if (toggle === except) continue;
    document.body.classList.remove(className);
    $(toggle).setAttribute("aria-expanded", "false");
  }
}

function renameChat(item, chat) {
  const field = element("input", "chat-rename");
  field.value = chat.title || "";
  field.setAttribute("aria-label", "Conversation title");
  item.querySelector(".chat-title").replaceWith(field);
  field.focus();
  field.select();
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep && field.value.trim()) chat.title = field.value.trim().slice(0, 80);
    saveChats();
  };
  field.addEventListener("keydown", (event) => {
    if (event.key === "Enter") { event.preventDefault(); finish(true); }
    if (event.key === "Escape") { event.preventDefault(); event.stopPropagation(); finish(false); }
  });
  field.addEventListener("blur", () => finish(true));
}

function deleteChat(chat) {
  chats = chats.filter((other) => other !== chat);
  if (chat === current) {
    stopTurn();
    sendIfOpen({ type: "reset" });
    current = null;
    renderLog();
  }
  saveChats();
}

// -- rendering answers ----------------------------------------------------------
function requestRender(text, callback) {
  const id = "render-" + (++renderCounter);
  if (!sendIfOpen({ type: "render", id, text })) return false;
  renders.set(id, callback);
  return true;
}

// Show Markdown in `body`: as plain text until the head's rendering arrives (or the socket is back).
function showMarkdown(body, text) {
  body.dataset.raw = "1";
  body.textContent = text;
  renderInto(body, text);
}

function renderInto(body, text) {
  requestRender(text, (html) => {
    if (body.isConnected && html !== null) showRendered(body, html);  // (refused: too long, or busy; text stays)
  });
}

function showRendered(body, html) {
  delete body.dataset.raw;
  morph(body, html);
}

// Replace `target`'s blocks with the rendered ones, keeping every block that did not change (no flicker).
function morph(target, html) {
  const fresh = document.createElement("template");
  fresh.innerHTML = html;  // sanitized on the head (nh3), and the CSP runs no inline script
  decorate(fresh.content);
  const blocks = Array.from(fresh.content.childNodes).filter((node) => node.nodeType !== Node.TEXT_NODE || node.textContent.trim());
  target.querySelectorAll(".pending").forEach((node) => node.remove());
  const old = Array.from(target.childNodes);
  blocks.forEach((block, index) => {
    if (index >= old.length) target.appendChild(block);
    else if (!old[index].isEqualNode(block)) target.replaceChild(block, old[index]);
  });
  old.slice(blocks.length).forEach((node) => node.remove());
}

// Code blocks get a bar with their language and a copy button.
function decorate(fragment) {
  for (const pre of fragment.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    const language = ((code && code.className) || "").match(/language-([\w+#.-]+)/);
    const box = element("div", "code");
    const bar = element("div", "code-bar");
    bar.append(element("span", "code-lang", language ? language[1] : "text"), button("copy-code", "Copy", "Copy code"));
    pre.replaceWith(box);
    box.append(bar, pre);
  }
}

// While an answer streams: one render on its way at a time, at most one every RENDER_EVERY_MS (the head
// renders the whole answer each time); the text after the last render waits at the end as it is.
const RENDER_EVERY_MS = 250;

function streamRender() {
  const streaming = turn;
  if (!streaming || streaming.rendering || streaming.timer) return;
  const wait = streaming.renderedAt + RENDER_EVERY_MS - performance.now();
  if (streaming.plain || wait > 0) {
    showPending(streaming.body, streaming.text.slice(streaming.renderedLength));
    if (!streaming.plain) streaming.timer = setTimeout(() => { streaming.timer = null; streamRender(); }, wait);
    return;
  }
  const text = streaming.text;
  streaming.renderedAt = performance.now();
  streaming.rendering = requestRender(text, (html) => {
    streaming.rendering = false;
    if (!streaming.body.isConnected) return;
    if (html === null) {  // refused (too long, or the head is busy): the rest of this answer is shown as text
      streaming.plain = true;
    } else {
      showRendered(streaming.body, html);
      streaming.renderedLength = text.length;
    }
    showPending(streaming.body, streaming.text.slice(streaming.renderedLength));
    if (turn === streaming && streaming.text !== text) streamRender();
  });
  if (!streaming.rendering) showPending(streaming.body, streaming.text.slice(streaming.renderedLength));
}

function showPending(body, text) {
  let pending = body.querySelector(".pending");
  if (!text) { if (pending) pending.remove(); return; }
  if (!pending) {
    pending = element("span", "pending");
    const last = body.lastElementChild;
    (last && last.tagName === "P" ? last : body).appendChild(pending);
  }
  pending.textContent = text;
}

// -- the conversation on the page -------------------------------------------------
function renderLog() {
  log.querySelectorAll(".msg").forEach((node) => node.remove());
  const messages = current ? current.messages : [];
  messages.forEach((message, index) => messageNode(message, index));
  $("empty").hidden = messages.length > 0;
  markLast();
}

function messageNode(message, index) {
  $("empty").hidden = true;
  const node = element("div", "msg " + message.role);
  node.dataset.index = String(index);
  const body = element("div", "text");
  node.appendChild(body);
  const actions = element("div", "actions");
  if (message.role === "assistant") {
    body.classList.add("md");
    if (message.content) showMarkdown(body, message.content);
    actions.append(button("copy-answer", "Copy", "Copy the answer as Markdown"),
      button("regenerate", "Regenerate", "Regenerate this answer"));
  } else {
    body.textContent = message.content;
    actions.append(button("edit", "Edit", "Edit this message and continue from it"));
  }
  node.appendChild(actions);
  if (message.meta) addMeta(node, message.meta);
  if (message.hops) addLapBar(node, message.hops);
  log.appendChild(node);
  log.scrollTop = log.scrollHeight;
  return { node, body };
}

function markLast() {
  const answers = log.querySelectorAll(".msg.assistant");
  answers.forEach((node, index) => node.classList.toggle("last", index === answers.length - 1));
}

function addMeta(node, text, className = "meta") {
  node.appendChild(element("div", className, text));
}

// Where an answer's time went, per lap, in route order: the head's layers, each link, each shard.
function lapParts(hops) {
  const parts = [["head", hops.head_ms, "head"]];
  const links = hops.links || [];
  if (links.length === hops.hops.length) {
    hops.hops.forEach((hop, index) => {
      parts.push([`link to ${String(hop.node).split("@")[0]}`, links[index].ms, "links"]);
      parts.push([String(hop.node).split("@")[0], hop.ms, `hop${index % 4 + 1}`]);
    });
  } else {  // an older node did not say what it waited for: the links as one
    hops.hops.forEach((hop, index) => parts.push([String(hop.node).split("@")[0], hop.ms, `hop${index % 4 + 1}`]));
    parts.push(["links", hops.network_ms, "links"]);
  }
  return parts;
}

function addLapBar(node, hops) {
  if (!hops || !hops.laps) return;
  const parts = lapParts(hops);
  const total = parts.reduce((sum, part) => sum + part[1], 0) || 1;
  const bar = element("div", "lap-bar");
  bar.setAttribute("role", "img");
  const words = parts.map(([name, ms]) => `${name} ${(ms / hops.laps).toFixed(1)} ms`).join(" · ");
  bar.setAttribute("aria-label", `per lap: ${words}`);
  bar.dataset.totalMs = total.toFixed(1);
  for (const [name, ms, kind] of parts) {
    const piece = element("span", `lap-part lap-${kind}`);
    piece.style.width = `${(100 * ms / total).toFixed(2)}%`;
    piece.title = `${name}: ${(ms / hops.laps).toFixed(1)} ms per lap`;
    piece.dataset.ms = ms.toFixed(2);
    bar.appendChild(piece);
  }
  node.appendChild(bar);
  const perLap = hops.tokens_per_lap ? ` · ${hops.tokens_per_lap} tokens/lap` : "";
  addMeta(node, `per lap (${hops.laps} laps${perLap}): ${words}`, "lap-meta");
}

function showError(text, retry = true) {
  const node = element("div", "msg error");
  node.setAttribute("role", "alert");
  node.appendChild(element("div", "text", text));
  if (retry && current && current.messages.length) {
    const actions = element("div", "actions");
    actions.appendChild(button("retry", "Retry", "Try the last answer again"));
    node.appendChild(actions);
  }
  log.appendChild(node);
  log.scrollTop = log.scrollHeight;
}

function setBusy(busy) {
  sendButton.hidden = busy;
  stopButton.hidden = !busy;
  log.setAttribute("aria-busy", String(busy));
}

function finishTurn(keepText, done) {
  if (!turn) return;
  const finished = turn;
  turn = null;
  clearTimeout(finished.timer);
  finished.node.classList.remove("streaming");
  if (done || (keepText && finished.text)) {  // (a finished answer stays, even an empty one, with its figures)
    const message = { role: "assistant", content: finished.text, ...(done || {}) };
    finished.chat.messages.push(message);
    touch(finished.chat);
    renderInto(finished.body, finished.text);  // the whole answer, rendered once more
  } else {
    finished.node.remove();
  }
  markLast();
  setBusy(false);
}

function stopTurn() {
  if (!turn) return;
  sendIfOpen({ type: "stop" });
  finishTurn(true);
}

// (`reset`: the head stops a running answer and releases this socket's session on every shard)
function sendIfOpen(message) {
  if (!socket || socket.readyState !== WebSocket.OPEN) return false;
  socket.send(JSON.stringify(message));
  return true;
}

function connected() {
  if (socket && socket.readyState === WebSocket.OPEN) return true;
  showError("Not connected to the head; reconnecting…", false);
  return false;
}

function send() {
  const text = input.value.trim();
  if (!text || turn || !connected()) return;
  input.value = "";
  if (!current) {
    current = { id: `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`, title: "", messages: [] };
    chats.unshift(current);
  }
  current.messages.push({ role: "user", content: text });
  touch(current);
  messageNode(current.messages[current.messages.length - 1], current.messages.length - 1);
  startTurn();
}

// Ask for the answer to the conversation as it stands (it ends with a question).
function startTurn() {
  if (!current || turn || !connected()) return;
  const system = settings.system.value.trim();
  const history = current.messages.map(({ role, content }) => ({ role, content }));
  const messages = system ? [{ role: "system", content: system }, ...history] : history;
  const id = "turn-" + (++turnCounter);
  const { node, body } = messageNode({ role: "assistant", content: "" }, current.messages.length);
  node.classList.add("streaming");
  markLast();
  turn = { id, chat: current, node, body, text: "", started: performance.now(), rendering: false, timer: null,
    renderedAt: -Infinity, renderedLength: 0, plain: false };
  setBusy(true);
  socket.send(JSON.stringify({
    type: "chat", id, messages,
    temperature: Number(settings.temperature.value),
    max_tokens: Math.max(1, Number(settings.maxTokens.value) || 256),
  }));
}

function regenerate() {
  if (turn || !current) return;
  const messages = current.messages;
  if (messages.length && messages[messages.length - 1].role === "assistant") messages.pop();
  if (!messages.length) return;
  touch(current);
  renderLog();
  startTurn();
}

function editMessage(index) {
  if (!current || !current.messages[index] || current.messages[index].role !== "user") return;
  stopTurn();
  const node = log.querySelector(`.msg.user[data-index="${index}"]`);
  if (!node || node.querySelector(".edit-box")) return;
  const box = element("div", "edit-box");
  const field = element("textarea", "edit-field");
  field.value = current.messages[index].content;
  field.rows = Math.min(8, field.value.split("\n").length + 1);
  field.setAttribute("aria-label", "Edit the message");
  box.append(field, button("save-edit", "Save & send"), button("cancel-edit", "Cancel"));
  node.querySelector(".text").hidden = true;
  node.querySelector(".actions").hidden = true;
  node.appendChild(box);
  field.focus();
  field.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); saveEdit(index, field.value); }
    if (event.key === "Escape") { event.preventDefault(); event.stopPropagation(); renderLog(); input.focus(); }
  });
}

// An edited question: the turns after it are dropped and the answer is asked again.
function saveEdit(index, text) {
  if (!text.trim() || !current || turn || !connected()) return;
  current.messages = current.messages.slice(0, index).concat([{ role: "user", content: text.trim() }]);
  touch(current);
  renderLog();
  startTurn();
}

function retry() {
  log.querySelectorAll(".msg.error").forEach((node) => node.remove());
  if (turn || !current || !current.messages.length) return;
  if (current.messages[current.messages.length - 1].role === "assistant") regenerate();
  else startTurn();
}

async function copyText(text, target) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {  // no clipboard API (a page served over plain http to another host): the old way
    const area = element("textarea");
    area.value = text;
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const before = target.textContent;
  target.textContent = "Copied";
  setTimeout(() => { target.textContent = before; }, 1200);
}

function routeText(route) {
  return (route || []).map((hop) => `${hop.node} [${hop.layers[0]}-${hop.layers[1] - 1}]`).join(" → ");
}

function onMessage(event) {
  let data;
  try { data = JSON.parse(event.data); } catch { return; }
  if (renders.has(data.id) && (data.type === "rendered" || data.type === "error")) {
    const callback = renders.get(data.id);
    renders.delete(data.id);
    callback(data.type === "rendered" ? data.html : null);
    return;
  }
  if (!turn || (data.id !== undefined && data.id !== turn.id)) {
    if (data.type === "error") showError(data.message, false);
    return;
  }
  if (data.type === "delta") {
    turn.text += data.text;
    streamRender();
    log.scrollTop = log.scrollHeight;
  } else if (data.type === "done") {
    const t = data.timing || {};
    const why = data.finish_reason === "stopped" ? "stopped · " : data.finish_reason === "length" ? "max tokens · " : "";
    // cached: prompt tokens this conversation's session held already (not prefilled again)
    const cached = data.cached_tokens ? ` · ${data.cached_tokens} of ${data.usage.prompt_tokens} prompt tokens cached` : "";
    // speculation: tokens per lap through the mesh, and how many guessed tokens the tail kept
    const spec = data.usage.speculation;
    const laps = spec && spec.draft_tokens ? ` · ${spec.tokens_per_lap} tokens/lap (${spec.accepted_draft_tokens}/${spec.draft_tokens} guesses kept)` : "";
    const meta = `${why}${data.usage.completion_tokens} tokens${cached}${laps} · first token ${t.ttft_ms ?? "–"} ms · ` +
      `${t.tokens_per_second} tok/s · route ${routeText(data.route)}`;
    const hops = data.hops ? { ...data.hops, tokens_per_lap: spec && spec.draft_tokens ? spec.tokens_per_lap : undefined } : null;
    turn.node.dataset.elapsedMs = (performance.now() - turn.started).toFixed(1);
    addMeta(turn.node, meta);
    addLapBar(turn.node, hops);
    finishTurn(true, { meta, hops });
  } else if (data.type === "error") {
    finishTurn(Boolean(turn.text));
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
  socket.addEventListener("open", () => {
    reconnectDelay = 500;
    setConn("open");
    log.querySelectorAll(".md[data-raw]").forEach((body) => {  // answers shown as text while the socket was down
      const index = Number(body.parentElement.dataset.index);
      if (current && current.messages[index]) renderInto(body, current.messages[index].content);
    });
  });
  socket.addEventListener("message", onMessage);
  socket.addEventListener("close", () => {
    setConn("closed");
    renders.clear();
    if (turn) {
      finishTurn(Boolean(turn.text));
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
const layerText = (layers) => `layers ${layers[0]}-${layers[1] - 1}`;

// The plan in force on a head that places layers (`plan` in /health): its chain in order, each node with its
// span, its predicted time per token and its measured time per layer, and the replicas of each span.
function plannedHops(health) {
  const plan = health.plan;
  if (!plan || !plan.automatic || !plan.spans || !plan.spans.length) return null;
  const joined = new Map((health.nodes || []).map((node) => [node.url, node]));
  const name = (url) => (url === "head" ? health.node || "head" : (joined.get(url) || {}).node || url);
  const layerMs = (url) => (url === "head" ? (health.capacity || {}).layer_ms : ((joined.get(url) || {}).measured || {}).layer_ms);
  const same = (a, b) => a.layers[0] === b.layers[0] && a.layers[1] === b.layers[1];
  return plan.spans.filter((span) => !span.replica).map((span) => ({
    node: name(span.node), layers: span.layers, ms: span.ms, layerMs: layerMs(span.node),
    replicas: plan.spans.filter((other) => other.replica && same(other, span)).map((other) => name(other.node)),
  }));
}

// The route as boxes (node, its layers and load; on a head that places layers, its plan with each node's time) and
// the links between (their share of the last answer's laps).
function drawRoute(health) {
  const route = $("route");
  route.replaceChildren();
  const planned = plannedHops(health);
  const hops = planned || (health.chain && health.chain.length ? health.chain : [{ node: health.node || health.role, layers: health.layers }]);
  const recent = health.recent_laps || { links: [], loads: [] };
  // a shard's load: from its heartbeats (a joined node), else as it reported with the last answer
  const loads = new Map(recent.loads.map((hop) => [hop.node, hop.sessions]));
  for (const node of health.nodes || []) loads.set(node.node, node.load);
  // ... and its busy share: the part of its last seconds it spent computing (the slowest stage sets the pace)
  const busy = new Map(recent.loads.map((hop) => [hop.node, hop.busy]));
  for (const node of health.nodes || []) if (node.measured && number(node.measured.busy)) busy.set(node.node, node.measured.busy);
  const linkTimes = recent.links;
  if (planned) {
    const plan = health.plan;
    const header = element("div", "route-plan", `plan ${plan.version} · ${plan.ms_per_token} ms per token predicted` +
      (plan.state === "live" ? "" : ` · ${plan.state}`));
    header.title = plan.reason ? `planned for: ${plan.reason}` : "";
    route.appendChild(header);
  }
  hops.forEach((hop, index) => {
    if (index > 0) {
      const from = index === 1 ? "head" : hops[index - 1].node;
      const timing = linkTimes.find((link) => link.to === hop.node && (link.from === from || index === 1));
      const link = element("div", "route-link", timing ? `${timing.lap_ms} ms` : "–");
      link.setAttribute("role", "listitem");
      link.title = timing ? `this link's share of a lap (there and back, with framing), ${timing.age_s} s ago`
        : "no answer has crossed this link yet";
      route.appendChild(link);
    }
    const load = index === 0 ? health.generations ?? health.sessions : loads.get(hop.node);
    const box = element("div", "route-node");
    box.setAttribute("role", "listitem");
    const share = index === 0 ? (health.compute || {}).busy_share : busy.get(hop.node);
    let detail = layerText(hop.layers) + (load === undefined ? "" : ` · load ${load}`)
      + (number(share) ? ` · busy ${Math.round(share * 100)} %` : "");
    if (hop.ms !== undefined) {
      detail += ` · ${hop.ms} ms per token` + (hop.layerMs ? ` (${hop.layerMs} ms a layer, measured)` : "");
    }
    box.append(element("div", "route-name", String(hop.node)), element("div", "route-detail", detail));
    if (hop.replicas && hop.replicas.length) box.append(element("div", "route-detail", `replica: ${hop.replicas.join(", ")}`));
    route.appendChild(box);
  });
  const leftOut = planned && health.plan.left_out ? health.plan.left_out : [];
  if (leftOut.length) {
    const names = new Map((health.nodes || []).map((node) => [node.url, node.node]));
    route.appendChild(element("div", "route-plan", `left out: ${leftOut.map((url) => names.get(url) || url).join(", ")}`));
  }
}

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
    const joined = (health.nodes || []).map((n) => `${n.node} · ${layerText(n.layers)} · ${n.load} session(s)`);
    const head = `${health.node || health.role} · ${layerText(health.layers)}` +
      (health.sessions === undefined ? "" : ` · ${health.sessions} session(s)`);
    const lines = joined.length ? [head, ...joined]
      : health.chain ? health.chain.map((hop) => `${hop.node} · ${layerText(hop.layers)}`) : [head];
    for (const text of lines) list.appendChild(element("li", "", text));
    drawRoute(health);
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
  } else if (event.key === "ArrowUp" && !input.value && current) {  // ↑ in an empty box: edit the last question
    const last = current.messages.map((message) => message.role).lastIndexOf("user");
    if (last >= 0) { event.preventDefault(); editMessage(last); }
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && turn) { event.preventDefault(); stopButton.click(); }
});
stopButton.addEventListener("click", () => {
  if (turn) sendIfOpen({ type: "stop" });
});
log.addEventListener("click", (event) => {
  const target = event.target.closest("button[data-action]");
  if (!target) return;
  const node = target.closest(".msg");
  const index = Number(node && node.dataset.index);
  const action = target.dataset.action;
  if (action === "copy-code") copyText(target.closest(".code").querySelector("code").textContent, target);
  else if (action === "copy-answer" && current && current.messages[index]) copyText(current.messages[index].content, target);
  else if (action === "regenerate") regenerate();
  else if (action === "edit") editMessage(index);
  else if (action === "save-edit") saveEdit(index, node.querySelector(".edit-field").value);
  else if (action === "cancel-edit") renderLog();
  else if (action === "retry") retry();
});
$("chat-list").addEventListener("click", (event) => {
  const target = event.target.closest("button[data-action]");
  const item = target && target.closest(".chat-item");
  const chat = item && chats.find((other) => other.id === item.dataset.id);
  if (!chat) return;
  if (target.dataset.action === "open-chat" && chat !== current) openChat(chat);
  else if (target.dataset.action === "rename-chat") renameChat(item, chat);
  else if (target.dataset.action === "delete-chat") deleteChat(chat);
});
$("new-chat").addEventListener("click", () => openChat(null));
for (const [toggle, className] of PANELS) {
  $(toggle).addEventListener("click", () => {
    const open = document.body.classList.toggle(className);
    $(toggle).setAttribute("aria-expanded", String(open));
    if (open) closePanels(toggle);
  });
}

renderChatList();
renderLog();
connect();
refreshMesh();
setInterval(refreshMesh, 3000);
input.focus();
