// The chat page: one WebSocket to /v1/realtime speaking the Realtime text protocol.
//
// Flow of one turn: conversation.item.create (the user's text) + response.create; the answer
// grows with every response.output_text.delta and ends with response.done, whose status and
// usage become the line under the answer. Stop sends response.cancel. All model and server
// text goes into the page with textContent, never as HTML.

const RECONNECT_MIN_MS = 500;
const RECONNECT_MAX_MS = 10_000;
const KEY_STORAGE = "gateway.apiKey";

const $ = (id) => document.getElementById(id);
const ui = {
  messages: $("messages"),
  empty: $("empty"),
  composer: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  connection: document.querySelector('[data-testid="connection"]'),
  newConversation: $("new-conversation"),
  instructions: $("instructions"),
  temperature: $("temperature"),
  temperatureValue: $("temperature-value"),
  maxTokens: $("max-tokens"),
  apiKey: $("api-key"),
  apiKeyField: $("api-key-field"),
  apiKeyHint: $("api-key-hint"),
  error: $("error"),
  settings: $("settings"),
  toggleSettings: $("toggle-settings"),
};

/** Everything the page knows about the link and the conversation. */
const state = {
  ws: null, // the live socket; events from any other (replaced) socket are ignored
  ready: false, // session.created seen on the live socket
  everReady: false, // some socket reached session.created (to tell "reconnected" from "connected")
  attempt: 0, // consecutive failed connection attempts, for the backoff
  retryTimer: null,
  eventSeq: 0,
  // Every turn shown, in order: {user, assistant}, where assistant is the answer's text once
  // it has ended (stopped answers too: the server keeps them) and null while it is on its
  // way or when it failed. A new server session after a reconnect is given the answered
  // turns again (see conversationItems).
  turns: [],
  current: null, // the answer being produced, see startAnswer()
  lastSettings: null, // JSON of the session settings last sent, to send only changes
};

// ---------------------------------------------------------------- credential

const SECRET_MARGIN_MS = 30_000; // fetch a new client secret when the cached one is this close
const credential = { url: undefined, secret: null }; // url: from /page-config.json, null if none

/**
 * What the next handshake presents. When the gateway runs with --client-secret-url, a short-lived
 * client secret ({value, expires_at}) from the app's backend at that URL, reused until it nearly
 * expires; otherwise the API key typed in Settings, if any. Throws when the backend gives none.
 */
async function obtainCredential() {
  if (credential.url === undefined) {
    try {
      const response = await fetch("/page-config.json", { cache: "no-store" });
      credential.url = response.ok ? ((await response.json()).client_secret_url ?? null) : null;
    } catch {
      // Unreachable: the socket's attempt reports it, and the next attempt asks again.
    }
  }
  if (!credential.url) return sessionStorage.getItem(KEY_STORAGE);
  const secret = credential.secret;
  if (!secret || secret.expires_at * 1000 - Date.now() < SECRET_MARGIN_MS) {
    const response = await fetch(credential.url, { method: "POST", cache: "no-store" });
    if (!response.ok) throw new Error(`the client secret endpoint answered ${response.status}`);
    credential.secret = await response.json();
  }
  return credential.secret.value;
}

// ---------------------------------------------------------------- connection

function socketUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}/v1/realtime`;
}

let connectGeneration = 0; // a connect() superseded while it awaited its credential gives up

async function connect() {
  clearTimeout(state.retryTimer);
  state.retryTimer = null;
  const generation = ++connectGeneration;
  const label = state.attempt ? `Connecting… (attempt ${state.attempt + 1})` : "Connecting…";
  setConnection("connecting", label);
  let key;
  try {
    key = await obtainCredential();
  } catch (err) {
    if (generation !== connectGeneration) return;
    showError(`Cannot get a credential: ${err.message}`, "connection");
    scheduleReconnect(false, { code: 1006 });
    return;
  }
  if (generation !== connectGeneration) return;
  // Browsers cannot set an Authorization header on a WebSocket; the Realtime API accepts the
  // key (or a client secret) as a subprotocol instead, next to "realtime".
  const protocols = key ? ["realtime", `openai-insecure-api-key.${key}`] : ["realtime"];
  let ws;
  try {
    ws = new WebSocket(socketUrl(), protocols);
  } catch (err) {
    // A key with characters a subprotocol cannot carry lands here.
    showError(`Cannot open the connection: ${err.message}`, "connection");
    askForKey("That API key cannot be sent; check it for spaces or odd characters.");
    setConnection("offline", "Disconnected");
    return;
  }
  state.ws = ws;
  state.ready = false;
  let opened = false;
  ws.addEventListener("open", () => {
    opened = true;
  });
  ws.addEventListener("message", (msg) => {
    if (ws !== state.ws) return;
    let event;
    try {
      event = JSON.parse(msg.data);
    } catch {
      showError("The server sent something that is not JSON.");
      return;
    }
    handleEvent(event);
  });
  ws.addEventListener("close", (ev) => {
    if (ws !== state.ws) return; // replaced on purpose (New conversation, new key)
    state.ws = null;
    state.ready = false;
    failCurrent("Connection lost before the answer finished.");
    // 1000/1001: a normal close or a server going away (the label says so); 1005/1006: no
    // reason to show. Anything else (too many sessions, a policy) is the server's word to us.
    if (opened && ![1000, 1001, 1005, 1006].includes(ev.code)) {
      const reason = ev.reason || "no reason given";
      showError(`The server closed the connection: ${reason} (${ev.code})`, "connection");
    }
    updateControls();
    scheduleReconnect(opened, ev);
  });
}

/** Replace the socket on purpose: the old one's events and close are ignored from now on. */
function reconnectNow() {
  const old = state.ws;
  state.ws = null;
  state.ready = false;
  if (old) old.close(1000, "client reconnect");
  state.attempt = 0;
  connect();
}

async function scheduleReconnect(opened, closeEvent) {
  if (!opened) credential.secret = null; // refused, perhaps expired: the next try gets a new one
  if (opened) state.attempt = 0;
  state.attempt += 1;
  const base = Math.min(RECONNECT_MAX_MS, RECONNECT_MIN_MS * 2 ** (state.attempt - 1));
  const delay = Math.round(base * (0.8 + Math.random() * 0.4)); // jitter: not all tabs at once
  const seconds = (delay / 1000).toFixed(delay < 1000 ? 1 : 0);
  setConnection("reconnecting", `Disconnected — reconnecting in ${seconds} s`);
  state.retryTimer = setTimeout(connect, delay);
  if (!opened) await explainFailedHandshake(closeEvent);
}

/**
 * A browser reports a refused handshake only as a failed connection, with no status code.
 * Plain HTTP still tells the cases apart: unreachable, model still loading, or refused (the
 * API key, most likely; an origin or session limit otherwise).
 */
async function explainFailedHandshake(closeEvent) {
  let readiness = null;
  try {
    readiness = (await fetch("/readyz", { cache: "no-store" })).status;
  } catch {
    readiness = null;
  }
  if (state.ready) return; // connected meanwhile
  if (readiness === 503) {
    setConnection("connecting", "Model loading — waiting for the server");
  } else if (readiness !== null) {
    const hasKey = Boolean(sessionStorage.getItem(KEY_STORAGE));
    askForKey(
      hasKey
        ? "The server refused the connection. Check the API key."
        : "The server refused the connection. It may need an API key: enter it in Settings.",
    );
  } else if (state.attempt === 1 || state.attempt % 5 === 0) {
    showError(`Cannot reach the server (close code ${closeEvent.code}); retrying.`, "connection");
  }
}

function setConnection(kind, label) {
  ui.connection.dataset.state = kind;
  ui.connection.querySelector(".label").textContent = label;
  ui.connection.title = label; // the label is hidden on narrow screens
}

function askForKey(message) {
  const firstAsk = !ui.apiKeyField.classList.contains("attention");
  setSettingsOpen(true);
  ui.apiKeyField.classList.add("attention");
  ui.apiKeyHint.textContent = message;
  showError(message, "connection");
  if (firstAsk) ui.apiKey.focus(); // once: later retries must not steal the focus
}

function send(event) {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return null;
  state.eventSeq += 1;
  const eventId = `evt_web_${state.eventSeq}`;
  state.ws.send(JSON.stringify({ event_id: eventId, ...event }));
  return eventId;
}

// ---------------------------------------------------------------- server events

function handleEvent(event) {
  switch (event.type) {
    case "session.created":
      return onSessionCreated(event.session ?? {});
    case "response.created":
      return onResponseCreated(event.response);
    case "response.output_text.delta":
      return onDelta(event);
    case "response.done":
      return onResponseDone(event.response);
    case "error":
      return onError(event.error ?? {});
    default:
      return undefined; // session.updated, item and part lifecycle events: nothing to show
  }
}

function onSessionCreated(session) {
  const reconnected = state.everReady;
  // Start from the server's default instructions (a small model needs some) unless
  // the user has written their own.
  if (!reconnected && !ui.instructions.value && session.instructions) {
    ui.instructions.value = session.instructions;
  }
  adoptServerSampling(session);
  state.ready = true;
  state.everReady = true;
  state.attempt = 0;
  state.lastSettings = null;
  setConnection("connected", "Connected");
  ui.apiKeyField.classList.remove("attention");
  ui.apiKeyHint.textContent = "Kept in this tab only (sessionStorage).";
  hideError("connection");
  syncSettings();
  if (reconnected) restoreConversation();
  updateControls();
  showEngine();
}

/** Name the engine behind the gateway in the top bar (a restart may bring another one). */
async function showEngine() {
  try {
    const health = await (await fetch("/healthz", { cache: "no-store" })).json();
    const model = health.model && health.model !== health.engine ? ` · ${health.model}` : "";
    $("engine").textContent = `${health.engine}${model}`;
    $("engine").hidden = !health.engine;
  } catch {
    // Only decoration: the chat works without it.
  }
}

/**
 * The conversation a new server session should hold: each answered turn as a user item and
 * an assistant item, so roles always alternate. A question whose answer never came (the
 * server died, the answer failed) is left out: sent alone it would sit before the next
 * question as two user turns in a row.
 */
function conversationItems(turns) {
  const items = [];
  for (const turn of turns) {
    if (!turn.assistant) continue;
    items.push({ role: "user", content: [{ type: "input_text", text: turn.user }] });
    items.push({ role: "assistant", content: [{ type: "output_text", text: turn.assistant }] });
  }
  return items;
}

/** A new server session knows nothing: give it the conversation this page has shown. */
function restoreConversation() {
  const items = conversationItems(state.turns);
  for (const item of items) {
    send({ type: "conversation.item.create", item: { type: "message", ...item } });
  }
  const unanswered = state.turns.filter((turn) => !turn.assistant).length;
  if (!items.length && !unanswered) return;
  let note = `Reconnected — ${items.length} earlier messages restored on the server.`;
  if (unanswered === 1) note += " The question without an answer was left out.";
  if (unanswered > 1) note += ` ${unanswered} questions without an answer were left out.`;
  addNote(note);
}

function onResponseCreated(response) {
  const cur = state.current;
  if (cur && !cur.responseId) cur.responseId = response.id;
}

function isCurrent(responseId) {
  const cur = state.current;
  return cur !== null && (cur.responseId === responseId || cur.responseId === null);
}

function onDelta(event) {
  if (!isCurrent(event.response_id)) return;
  const cur = state.current;
  if (cur.firstDeltaAt === null) {
    cur.firstDeltaAt = performance.now();
    setStatus(cur, "streaming", "Streaming…");
  }
  const stick = nearBottom();
  cur.text += event.delta;
  cur.textEl.textContent = cur.text;
  cur.el.classList.remove("pending");
  if (stick) scrollToBottom();
}

function onResponseDone(response) {
  if (!isCurrent(response.id)) return;
  const cur = state.current;
  const { kind, label } = describeOutcome(response);
  const stats = kind === "failed" ? "" : describeSpeed(cur, response.usage);
  setStatus(cur, kind, stats ? `${label} · ${stats}` : label);
  if (response.usage) {
    cur.statusEl.title =
      `input ${response.usage.input_tokens} tokens` +
      ` (cached ${response.usage.input_token_details?.cached_tokens ?? 0}),` +
      ` output ${response.usage.output_tokens} tokens`;
    cur.el.dataset.inputTokens = String(response.usage.input_tokens);
    cur.el.dataset.outputTokens = String(response.usage.output_tokens);
  }
  // The server keeps partial (stopped) answers in the conversation, so the page does too.
  if (kind !== "failed" && cur.text) cur.turn.assistant = cur.text;
  finishCurrent();
}

function describeOutcome(response) {
  const details = response.status_details ?? {};
  switch (response.status) {
    case "completed":
      return { kind: "completed", label: "Completed" };
    case "cancelled":
      return { kind: "stopped", label: "Stopped" };
    case "incomplete":
      if (details.reason === "max_output_tokens") {
        return { kind: "length", label: "Cut at the token limit" };
      }
      if (details.reason === "client_cancelled") return { kind: "stopped", label: "Stopped" };
      return { kind: "length", label: `Incomplete (${details.reason ?? "unknown reason"})` };
    case "failed": {
      const message = details.error?.message ?? details.error?.code ?? "unknown error";
      return { kind: "failed", label: `Failed: ${message}` };
    }
    default:
      return { kind: "failed", label: `Ended with status ${response.status}` };
  }
}

/** Time to first token and tokens/s (output tokens over the time the text streamed). */
function describeSpeed(cur, usage) {
  const parts = [];
  if (cur.firstDeltaAt !== null) {
    parts.push(`first token ${formatMs(cur.firstDeltaAt - cur.sentAt)}`);
    const seconds = (performance.now() - cur.firstDeltaAt) / 1000;
    if (usage && usage.output_tokens > 1 && seconds > 0) {
      parts.push(`${(usage.output_tokens / seconds).toFixed(1)} tokens/s`);
    }
  }
  if (usage) parts.push(`${usage.output_tokens} tokens`);
  return parts.join(" · ");
}

function formatMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function onError(error) {
  const cur = state.current;
  const message = error.message || error.code || "Unknown error";
  showError(error.code ? `${message} (${error.code})` : message);
  // A refused response.create gets an error instead of a response: that answer will never come.
  const refusedCreate =
    cur && !cur.responseId && (error.event_id === cur.createEventId || isAdmissionCode(error.code));
  if (refusedCreate) {
    setStatus(cur, "failed", `Failed: ${message}`);
    finishCurrent();
  }
}

function isAdmissionCode(code) {
  return code === "overloaded" || code === "conversation_already_has_active_response";
}

// ---------------------------------------------------------------- turns

function sendMessage() {
  const text = ui.prompt.value;
  if (!text.trim() || !state.ready || state.current) return;
  syncSettings();
  const itemEventId = send({
    type: "conversation.item.create",
    item: { type: "message", role: "user", content: [{ type: "input_text", text }] },
  });
  if (!itemEventId) return;
  addUserMessage(text);
  const turn = { user: text, assistant: null };
  state.turns.push(turn);
  ui.prompt.value = "";
  autoGrow();
  startAnswer(turn);
  state.current.createEventId = send({ type: "response.create" });
  updateControls();
}

function startAnswer(turn) {
  const el = document.createElement("article");
  el.className = "message assistant pending";
  const textEl = document.createElement("div");
  textEl.className = "bubble";
  textEl.dataset.testid = "assistant-message";
  const statusEl = document.createElement("div");
  statusEl.className = "meta";
  statusEl.dataset.testid = "status";
  el.append(textEl, statusEl);
  appendToMessages(el);
  state.current = {
    turn,
    el,
    textEl,
    statusEl,
    text: "",
    responseId: null,
    createEventId: null,
    sentAt: performance.now(),
    firstDeltaAt: null,
  };
  setStatus(state.current, "waiting", "Waiting for the model…");
}

function setStatus(cur, kind, label) {
  cur.statusEl.dataset.status = kind;
  cur.statusEl.textContent = label;
  cur.el.dataset.status = kind;
}

function finishCurrent() {
  state.current.el.classList.remove("pending");
  state.current = null;
  updateControls();
}

function failCurrent(reason) {
  if (!state.current) return;
  setStatus(state.current, "failed", `Failed: ${reason}`);
  finishCurrent();
}

function stopAnswer() {
  const cur = state.current;
  if (!cur) return;
  // Without an id the server cancels the session's active response, which is this one: the
  // response.create went out before this cancel on the same ordered socket.
  const cancel = { type: "response.cancel" };
  send(cur.responseId ? { ...cancel, response_id: cur.responseId } : cancel);
  cur.stopRequested = true;
  setStatus(cur, cur.statusEl.dataset.status, "Stopping…");
  updateControls();
}

function newConversation() {
  // A new socket is a new server session: nothing of the old conversation survives there.
  state.current = null;
  state.turns = [];
  state.everReady = false;
  for (const el of [...ui.messages.children]) if (el !== ui.empty) el.remove();
  ui.empty.hidden = false;
  hideError();
  reconnectNow();
  updateControls();
  ui.prompt.focus();
}

// ---------------------------------------------------------------- settings

/**
 * The page starts from the sampling the server starts sessions with (each engine picks what
 * suits its model: a small one needs a low temperature) until the user moves the slider.
 * A server with no default of its own (null) gets null back: the engine's own default.
 */
function adoptServerSampling(session) {
  if (ui.temperature.dataset.touched) return;
  const temperature = typeof session.temperature === "number" ? session.temperature : null;
  ui.temperature.dataset.serverDefault = temperature === null ? "" : String(temperature);
  if (temperature !== null) ui.temperature.value = String(temperature);
  showTemperature();
}

function pageTemperature() {
  const untouchedEngineDefault =
    !ui.temperature.dataset.touched && ui.temperature.dataset.serverDefault === "";
  return untouchedEngineDefault ? null : Number(ui.temperature.value);
}

function showTemperature() {
  const value = pageTemperature();
  ui.temperatureValue.textContent = value === null ? "model default" : value.toFixed(2);
}

function currentSettings() {
  const maxTokens = Number.parseInt(ui.maxTokens.value, 10);
  return {
    type: "realtime",
    output_modalities: ["text"],
    instructions: ui.instructions.value,
    temperature: pageTemperature(),
    max_output_tokens: Number.isFinite(maxTokens) && maxTokens > 0 ? maxTokens : "inf",
  };
}

/** Send session.update when the settings differ from what the server last got. */
function syncSettings() {
  if (!state.ready) return;
  const settings = currentSettings();
  const json = JSON.stringify(settings);
  if (json === state.lastSettings) return;
  if (send({ type: "session.update", session: settings })) state.lastSettings = json;
}

function saveKey() {
  const key = ui.apiKey.value.trim();
  if (key === (sessionStorage.getItem(KEY_STORAGE) ?? "")) return;
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
  reconnectNow(); // the key travels in the handshake, so only a new connection uses it
}

// ---------------------------------------------------------------- view helpers

function addUserMessage(text) {
  const el = document.createElement("article");
  el.className = "message user";
  const bubble = document.createElement("div");
  bubble.className = "bubble";
  bubble.dataset.testid = "user-message";
  bubble.textContent = text;
  el.append(bubble);
  appendToMessages(el);
}

function addNote(text) {
  const el = document.createElement("div");
  el.className = "note";
  el.dataset.testid = "note";
  el.textContent = text;
  appendToMessages(el);
}

function appendToMessages(el) {
  ui.empty.hidden = true;
  ui.messages.append(el);
  scrollToBottom();
}

function nearBottom() {
  const m = ui.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
}

function scrollToBottom() {
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

const MAX_ERRORS_SHOWN = 3;

/**
 * Show an error under the top bar, keeping the last few: one user action can draw more than
 * one complaint (a refused setting and then a failed answer). A "connection" error replaces
 * the previous one, as retries repeat it.
 */
function showError(message, kind = "server") {
  const list = ui.error.querySelector(".notice-text");
  if (kind === "connection") list.querySelector('[data-kind="connection"]')?.remove();
  const line = document.createElement("div");
  line.dataset.kind = kind;
  line.textContent = message;
  list.append(line);
  while (list.children.length > MAX_ERRORS_SHOWN) list.firstElementChild.remove();
  ui.error.hidden = false;
}

/** Remove the errors of one kind, or all of them. */
function hideError(kind = null) {
  const list = ui.error.querySelector(".notice-text");
  for (const line of [...list.children]) if (!kind || line.dataset.kind === kind) line.remove();
  ui.error.hidden = list.children.length === 0;
}

function updateControls() {
  const streaming = state.current !== null;
  ui.send.disabled = !state.ready || streaming || !ui.prompt.value.trim();
  ui.stop.disabled = !state.ready || !streaming || Boolean(state.current?.stopRequested);
  ui.composer.classList.toggle("busy", streaming);
}

function autoGrow() {
  ui.prompt.style.height = "auto";
  ui.prompt.style.height = `${Math.min(ui.prompt.scrollHeight, 240)}px`;
}

// ---------------------------------------------------------------- wiring

ui.composer.addEventListener("submit", (ev) => {
  ev.preventDefault();
  sendMessage();
});
ui.prompt.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    sendMessage();
  } else if (ev.key === "Escape" && state.current) {
    stopAnswer();
  }
});
ui.prompt.addEventListener("input", () => {
  autoGrow();
  updateControls();
});
ui.stop.addEventListener("click", stopAnswer);
ui.newConversation.addEventListener("click", newConversation);
for (const input of [ui.instructions, ui.temperature, ui.maxTokens]) {
  input.addEventListener("change", syncSettings);
}
ui.temperature.addEventListener("input", () => {
  ui.temperature.dataset.touched = "true";
  showTemperature();
});
ui.apiKey.addEventListener("change", saveKey);
$("api-key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  saveKey();
});
ui.error.querySelector(".notice-close").addEventListener("click", () => hideError());
ui.toggleSettings.addEventListener("click", () => {
  setSettingsOpen(!document.body.classList.contains("settings-open"));
});

function setSettingsOpen(open) {
  document.body.classList.toggle("settings-open", open);
  ui.toggleSettings.setAttribute("aria-expanded", String(open));
}

setSettingsOpen(window.matchMedia("(min-width: 900px)").matches);
ui.apiKey.value = sessionStorage.getItem(KEY_STORAGE) ?? "";
updateControls();
connect();
ui.prompt.focus();
