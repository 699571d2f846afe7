// The chat page: one WebSocket to /v1/realtime speaking the Realtime text protocol.
//
// Flow of one turn: conversation.item.create (the user's text) + response.create; the answer
// grows with every response.output_text.delta and ends with response.done, whose status and
// usage become the line under the answer. Stop sends response.cancel. All model and server
// text goes into the page with textContent, never as HTML.
//
// Resume: the page keeps its server session's id, the latest resume_token and the last
// sequence_number it processed. When the socket drops (not closed by the page or the server
// going away), it reconnects with session.resume as the first event; the server replays what
// the page missed and the answer goes on where it stopped. If the server cannot resume, the
// page goes on as the fresh session and offers to restore the conversation (never on its own).

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
  frequencyPenalty: $("frequency-penalty"),
  presencePenalty: $("presence-penalty"),
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
  // The server session the conversation is in: {id, token, lastSeq}, token being the latest
  // resume_token (null: the server offers no resume) and lastSeq the last sequence_number
  // processed. null when there is none to resume (never connected, New conversation, or the
  // server ended it).
  session: null,
  // While a new socket asks for the session back: {eventId} of its session.resume, and
  // `fresh`, the session the socket started with, which the page goes on with if it fails.
  resuming: null,
  lostBecause: null, // why the next fresh session is not the one the turns were in
  // Every turn shown, in order: {user, assistant, onServer}, where assistant is the answer's
  // text once it has ended (stopped answers too: the server keeps them) and null while it is
  // on its way or when it failed, and onServer says whether the current server session holds
  // it. Turns a lost session held can be given to the new one on request (Restore
  // conversation, see conversationItems).
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
  await loadPageConfig();
  if (!credential.url) return sessionStorage.getItem(KEY_STORAGE);
  const secret = credential.secret;
  if (!secret || secret.expires_at * 1000 - Date.now() < SECRET_MARGIN_MS) {
    const response = await fetch(credential.url, { method: "POST", cache: "no-store" });
    if (!response.ok) throw new Error(`the client secret endpoint answered ${response.status}`);
    credential.secret = await response.json();
  }
  return credential.secret.value;
}

/** Learn credential.url from /page-config.json, once; it stays undefined while unreachable. */
async function loadPageConfig() {
  if (credential.url !== undefined) return;
  try {
    const response = await fetch("/page-config.json", { cache: "no-store" });
    credential.url = response.ok ? ((await response.json()).client_secret_url ?? null) : null;
  } catch {
    // Unreachable: the socket's attempt reports it, and the next attempt asks again.
  }
}

// ---------------------------------------------------------------- connection

/** The socket's URL; a resume names its session, so that a load balancer can route it to the
 * host that holds the session (the gateway itself ignores the query). */
function socketUrl(sessionId = null) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const query = sessionId ? `?session_id=${encodeURIComponent(sessionId)}` : "";
  return `${scheme}//${location.host}/v1/realtime${query}`;
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
  const resumable = state.session?.token ? state.session : null;
  let ws;
  try {
    ws = new WebSocket(socketUrl(resumable?.id), protocols);
  } catch (err) {
    // A key with characters a subprotocol cannot carry lands here (saveKey refuses such
    // keys; one stored by an older page may remain): forget it and go on without it.
    sessionStorage.removeItem(KEY_STORAGE);
    ui.apiKey.value = "";
    askForKey(`That API key cannot be sent (${err.message}); enter it again.`);
    scheduleReconnect(false, { code: 1006 });
    return;
  }
  state.ws = ws;
  state.ready = false;
  state.resuming = resumable ? { eventId: null, fresh: null } : null;
  let opened = false;
  ws.addEventListener("open", () => {
    opened = true;
    if (ws !== state.ws || !state.resuming) return;
    // session.resume must be the first event on the connection; the server's
    // session.created for the socket's own fresh session may still be on its way.
    const { id, token, lastSeq } = state.session;
    state.resuming.eventId = send({
      type: "session.resume",
      session_id: id,
      resume_token: token,
      last_sequence_number: lastSeq,
    });
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
    receive(event);
  });
  ws.addEventListener("close", (ev) => {
    if (ws !== state.ws) return; // replaced on purpose (New conversation)
    state.ws = null;
    state.ready = false;
    state.resuming = null;
    if (opened) onConnectionLost(ev);
    updateControls();
    scheduleReconnect(opened, ev);
  });
}

/**
 * What the end of a socket that was open means for the session. A server going away (1001:
 * shutdown or restart) or handing the session to another socket (4001) has ended it here;
 * any other end (a network drop: 1006; 1012, a gateway with a session store restarting, which
 * handed the session to the others) leaves it on the server for a while, to resume.
 */
function onConnectionLost(ev) {
  // 1000/1001/4001: the label says so; 1005/1006: no reason to show. Anything else (too
  // many sessions, a policy) is the server's word to us.
  if (![1000, 1001, 1005, 1006, 1012, 4001].includes(ev.code)) {
    const reason = ev.reason || "no reason given";
    showError(`The server closed the connection: ${reason} (${ev.code})`, "connection");
  }
  if (ev.code === 1001) {
    endSession("The server restarted");
    interruptCurrent("the server restarted");
  } else if (ev.code === 4001) {
    endSession("Another connection took this conversation over");
    interruptCurrent("another connection took this conversation over");
  } else if (state.session?.token) {
    const cur = state.current;
    if (cur) setStatus(cur, "reconnecting", "Connection lost — reconnecting…");
  } else {
    endSession("The connection was lost");
    failCurrent("Connection lost before the answer finished.");
  }
}

/** The server no longer holds the session: the next one starts afresh, for `reason`. */
function endSession(reason) {
  state.session = null;
  state.lostBecause = reason;
}

/** Open a new socket now, unless one is open or opening (its handshake uses the new key). */
function connectNowIfIdle() {
  if (state.ws) return;
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
 * Plain HTTP tells the cases apart, asked after the fact: unreachable (a server restarting
 * or a network down), model still loading (/readyz 503), or refused. Only when the server
 * itself says 401 to the key this page holds is the key asked for: a server that was down
 * at the handshake and is back by now must not send the user to the key field.
 */
async function explainFailedHandshake(closeEvent) {
  const attempt = state.attempt;
  const readiness = await httpStatus("/readyz");
  if (state.ready || state.ws) return; // connecting again, or connected, meanwhile
  if (readiness === null) {
    // Quiet at first: a restart or a short network drop is over in a second or two.
    if (attempt === 3 || (attempt > 3 && attempt % 5 === 0)) {
      showError(`Cannot reach the server (close code ${closeEvent.code}); retrying.`, "connection");
    }
    return;
  }
  if (readiness === 503) {
    setConnection("connecting", "Model loading — waiting for the server");
    return;
  }
  // A client secret cannot be checked over HTTP (it cannot mint); a refused one was dropped
  // above and the next attempt gets a new one from the app's backend. Nor is a key asked for
  // before the page knows which of the two the server wants.
  await loadPageConfig();
  if (credential.url !== null || state.ready || state.ws) return;
  const verdict = await probeApiKey();
  if (state.ready || state.ws) return;
  if (verdict === 401) {
    const hasKey = Boolean(sessionStorage.getItem(KEY_STORAGE));
    askForKey(
      hasKey
        ? "The server refused the API key. Check it in Settings."
        : "The server needs an API key: enter it in Settings.",
    );
  } else if (verdict === 403) {
    showError("The server does not accept connections from this page's origin.", "connection");
  } else if (attempt >= 3 && verdict !== null) {
    showError("The server refused the connection (too many sessions?); retrying.", "connection");
  }
}

async function httpStatus(path, init = {}) {
  try {
    return (await fetch(path, { cache: "no-store", ...init })).status;
  } catch {
    return null; // unreachable
  }
}

/**
 * Does the server take this page's API key (or none)? The one HTTP route that checks a key
 * is the client secret endpoint, and it checks the key before the body: asked for a lifetime
 * it refuses (0 s), it answers 401 for a missing or wrong key and 400 otherwise, minting
 * nothing. 403: the page's origin is not allowed.
 */
function probeApiKey() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  const headers = { "Content-Type": "application/json" };
  if (key) headers.Authorization = `Bearer ${key}`;
  const body = JSON.stringify({ expires_after: { anchor: "created_at", seconds: 0 } });
  return httpStatus("/v1/realtime/client_secrets", { method: "POST", headers, body });
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
  // Once (later retries must not steal the focus), and not from under a message being typed.
  if (firstAsk && !ui.prompt.value) ui.apiKey.focus();
}

function send(event) {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return null;
  state.eventSeq += 1;
  const eventId = `evt_web_${state.eventSeq}`;
  state.ws.send(JSON.stringify({ event_id: eventId, ...event }));
  return eventId;
}

// ---------------------------------------------------------------- server events

/** Every event of the live socket comes here first: the resume handshake, then numbering. */
function receive(event) {
  if (state.resuming) return receiveWhileResuming(event);
  if (event.type === "session.created") return onSessionCreated(event);
  const seq = event.sequence_number;
  if (typeof seq === "number" && state.session) {
    // A safety net: the server replays only what comes after lastSeq, so nothing is seen twice.
    if (seq <= state.session.lastSeq) return undefined;
    state.session.lastSeq = seq;
  }
  return handleEvent(event);
}

/** Until the server answers session.resume: session.resumed, or an error for it. */
function receiveWhileResuming(event) {
  const resuming = state.resuming;
  if (event.type === "session.created") {
    resuming.fresh = event; // the socket's own session, for the case the resume fails
  } else if (event.type === "session.resumed") {
    state.resuming = null;
    onSessionResumed(event);
  } else if (event.type === "error") {
    // The page has sent nothing but session.resume on this socket: the error is its answer
    // (session_not_found, resume_gap; from a gateway without resume, an unknown event).
    state.resuming = null;
    onResumeFailed(resuming.fresh, event);
  }
}

function handleEvent(event) {
  switch (event.type) {
    case "response.created":
      return onResponseCreated(event.response);
    case "response.output_text.delta":
      return onDelta(event);
    case "response.done":
      return onResponseDone(event.response);
    case "conversation.item.retrieved":
      return onItemChecked(event.item?.id, true);
    case "error":
      if (state.current?.checkEventId && event.error?.event_id === state.current.checkEventId) {
        return onItemChecked(state.current.itemId, false);
      }
      return onError(event.error ?? {});
    default:
      return undefined; // session.updated, item and part lifecycle events: nothing to show
  }
}

function sessionOf(created) {
  const token = typeof created.resume_token === "string" ? created.resume_token : null;
  return { id: created.session?.id ?? null, token, lastSeq: created.sequence_number ?? 0 };
}

/** A fresh server session on a socket that did not ask to resume. */
function onSessionCreated(created) {
  state.session = sessionOf(created);
  if (state.everReady) sessionReplaced(state.lostBecause ?? "The connection was lost");
  startSession(created.session ?? {});
}

/** The server took the page back into its session: the replay follows, then live events. */
function onSessionResumed(resumed) {
  state.session.id = resumed.session?.id ?? state.session.id;
  state.session.token = resumed.resume_token ?? null; // the old one is spent
  markReady();
  const cur = state.current;
  if (cur) {
    if (cur.firstDeltaAt === null) setStatus(cur, "waiting", "Waiting for the model…");
    else setStatus(cur, "streaming", "Streaming…");
    cur.stopRequested = false; // a cancel sent as the socket died may be lost: Stop again
    // Had the server received the question and its response.create before the drop, their
    // events are in the replay, ahead of anything asked now. So ask for the question's item:
    // by the answer, a response.created not seen means the server never got it.
    if (!cur.responseId) {
      cur.checkEventId = send({ type: "conversation.item.retrieve", item_id: cur.itemId });
    }
  }
  updateControls();
}

/** The resume was refused (session_not_found, resume_gap): go on as the socket's fresh session. */
function onResumeFailed(fresh, error) {
  const code = error.error?.code;
  state.session = fresh ? sessionOf(fresh) : null;
  if (state.session && typeof error.sequence_number === "number") {
    state.session.lastSeq = error.sequence_number;
  }
  interruptCurrent("the connection was lost and the answer could not be recovered");
  const reason =
    code === "resume_gap"
      ? "The connection was away too long to resume without losing part of the answer"
      : "The connection was lost and could not be resumed";
  sessionReplaced(reason);
  startSession(fresh?.session ?? {});
}

function markReady() {
  state.ready = true;
  state.everReady = true;
  state.attempt = 0;
  state.lostBecause = null;
  state.lastSettings = null; // a session.update sent as the socket died may be lost
  setConnection("connected", "Connected");
  ui.apiKeyField.classList.remove("attention");
  ui.apiKeyHint.textContent = "Kept in this tab only (sessionStorage).";
  hideError("connection");
  syncSettings();
}

/** A new server session: adopt its defaults, send the page's settings. */
function startSession(session) {
  const first = !state.everReady;
  // Start from the server's default instructions (a small model needs some) unless
  // the user has written their own.
  if (first && !ui.instructions.value && session.instructions) {
    ui.instructions.value = session.instructions;
  }
  adoptServerSampling(session);
  markReady();
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

/**
 * The page is in a new server session that knows nothing of the turns shown so far. Say so,
 * and offer to give it those turns; never on its own: re-sending a long history costs the
 * next answer its time to first token, and the user may want a fresh start.
 */
function sessionReplaced(reason) {
  for (const turn of state.turns) turn.onServer = false;
  if (!state.turns.length) return;
  const count = conversationItems(state.turns).length;
  for (const old of ui.messages.querySelectorAll('[data-testid="restore"]')) old.remove();
  const note = addNote(
    `${reason}, so the server no longer holds this conversation: ` +
      "the next message starts a new one.",
  );
  note.classList.add("lost");
  if (!count) return;
  const button = document.createElement("button");
  button.type = "button";
  button.className = "link";
  button.dataset.testid = "restore";
  button.textContent = "Restore conversation";
  button.title = `Send the ${count} earlier messages to the server, so the model sees them`;
  button.addEventListener("click", restoreConversation);
  note.append(" ", button);
  updateControls();
}

/** Give the server session the answered turns it does not hold, ahead of any it does. */
function restoreConversation() {
  if (!state.ready) return;
  const turns = state.turns.filter((turn) => !turn.onServer);
  const items = conversationItems(turns);
  let previous = "root"; // before any turn this session already has, in the page's order
  for (const item of items) {
    const id = newItemId();
    send({
      type: "conversation.item.create",
      previous_item_id: previous,
      item: { id, type: "message", ...item },
    });
    previous = id;
  }
  for (const turn of turns) turn.onServer = true;
  for (const old of ui.messages.querySelectorAll('[data-testid="restore"]')) old.remove();
  const unanswered = turns.filter((turn) => !turn.assistant).length;
  let note = `${items.length} earlier messages restored on the server.`;
  if (unanswered === 1) note += " The question without an answer was left out.";
  if (unanswered > 1) note += ` ${unanswered} questions without an answer were left out.`;
  addNote(note);
}

/** An id for an item the page creates (so it can ask for it after a resume). */
function newItemId() {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return `item_web_${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

/**
 * The answer to the check after a resume (see onSessionResumed): the question's item is on
 * the server (`found`) or not. If its response never started there, ask again for what the
 * drop swallowed.
 */
function onItemChecked(itemId, found) {
  const cur = state.current;
  if (!cur || !cur.checkEventId || itemId !== cur.itemId) return;
  cur.checkEventId = null;
  if (cur.responseId) return; // it started: its events were in the replay
  if (cur.stopRequested) {
    setStatus(cur, "stopped", "Stopped");
    finishCurrent();
    return;
  }
  if (!found) sendUserItem(cur.turn.user, cur.itemId);
  cur.createEventId = send({ type: "response.create" });
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
      // Only the user's Stop is "Stopped"; the gateway's own reasons say what happened.
      if (details.gateway_reason === "server_shutdown") {
        return { kind: "interrupted", label: "Interrupted: the server restarted" };
      }
      if (details.gateway_reason) {
        return { kind: "interrupted", label: "Interrupted: the connection was lost" };
      }
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
  const itemId = newItemId();
  if (!sendUserItem(text, itemId)) return;
  addUserMessage(text);
  const turn = { user: text, assistant: null, onServer: true };
  state.turns.push(turn);
  ui.prompt.value = "";
  autoGrow();
  startAnswer(turn, itemId);
  state.current.createEventId = send({ type: "response.create" });
  updateControls();
}

/** The user's message as a conversation item, with an id of the page's own. */
function sendUserItem(text, itemId) {
  return send({
    type: "conversation.item.create",
    item: { id: itemId, type: "message", role: "user", content: [{ type: "input_text", text }] },
  });
}

function startAnswer(turn, itemId) {
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
    itemId, // the question's item
    checkEventId: null, // the item check after a resume, while unanswered
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

/** The answer ended without a response.done the page saw, and not by the user's Stop. */
function interruptCurrent(reason) {
  if (!state.current) return;
  setStatus(state.current, "interrupted", `Interrupted: ${reason}`);
  finishCurrent();
}

function stopAnswer() {
  const cur = state.current;
  if (!cur) return;
  // Without an id the server cancels the session's active response, which is this one: the
  // response.create went out before this cancel on the same ordered socket.
  const cancel = { type: "response.cancel" };
  // While the check after a resume runs (onItemChecked), the server may never have got the
  // response.create: the check's answer ends the answer instead.
  if (cur.responseId) send({ ...cancel, response_id: cur.responseId });
  else if (!cur.checkEventId) send(cancel);
  cur.stopRequested = true;
  setStatus(cur, cur.statusEl.dataset.status, "Stopping…");
  updateControls();
}

function newConversation() {
  // A new socket is a new server session. Closing the old one (a close frame) ends its
  // session on the server at once: nothing of the old conversation survives there.
  state.current = null;
  state.turns = [];
  state.everReady = false;
  state.session = null;
  state.resuming = null;
  state.lostBecause = null;
  for (const el of [...ui.messages.children]) if (el !== ui.empty) el.remove();
  ui.empty.hidden = false;
  hideError();
  const old = state.ws;
  state.ws = null;
  state.ready = false;
  if (old) old.close(1000, "new conversation");
  state.attempt = 0;
  connect();
  updateControls();
  ui.prompt.focus();
}

// ---------------------------------------------------------------- settings

/** The sampling sliders, by the session field each one sets. */
const SAMPLING_SLIDERS = {
  temperature: ui.temperature,
  frequency_penalty: ui.frequencyPenalty,
  presence_penalty: ui.presencePenalty,
};

/**
 * The page starts from the sampling the server starts sessions with (each engine picks what
 * suits its model: a small one needs a low temperature and a penalty on repeats) until the
 * user moves a slider. A server with no default of its own (null) gets null back: the
 * engine's own default.
 */
function adoptServerSampling(session) {
  for (const [name, slider] of Object.entries(SAMPLING_SLIDERS)) {
    if (slider.dataset.touched) continue;
    const value = typeof session[name] === "number" ? session[name] : null;
    slider.dataset.serverDefault = value === null ? "" : String(value);
    if (value !== null) slider.value = String(value);
    showSlider(slider);
  }
}

function sliderValue(slider) {
  const untouchedEngineDefault = !slider.dataset.touched && slider.dataset.serverDefault === "";
  return untouchedEngineDefault ? null : Number(slider.value);
}

function showSlider(slider) {
  const value = sliderValue(slider);
  $(`${slider.id}-value`).textContent = value === null ? "model default" : value.toFixed(2);
}

function currentSettings() {
  const maxTokens = Number.parseInt(ui.maxTokens.value, 10);
  return {
    type: "realtime",
    output_modalities: ["text"],
    instructions: ui.instructions.value,
    temperature: sliderValue(ui.temperature),
    frequency_penalty: sliderValue(ui.frequencyPenalty),
    presence_penalty: sliderValue(ui.presencePenalty),
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

// What a WebSocket subprotocol can carry (an HTTP token): anything else would throw.
const SENDABLE_KEY = /^[!#$%&'*+.^_`|~0-9A-Za-z-]*$/;

function saveKey() {
  const key = ui.apiKey.value.trim();
  if (key === (sessionStorage.getItem(KEY_STORAGE) ?? "")) return;
  if (!SENDABLE_KEY.test(key)) {
    ui.apiKeyField.classList.add("attention");
    ui.apiKeyHint.textContent =
      "Not saved: an API key has no spaces or odd characters. The page goes on as before.";
    return;
  }
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
  ui.apiKeyHint.textContent = "Kept in this tab only (sessionStorage).";
  // The key travels in the handshake: a connection open (or opening) keeps its session and
  // the next handshake uses the key; one waiting to retry tries now.
  connectNowIfIdle();
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
  return el;
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
  for (const button of ui.messages.querySelectorAll('[data-testid="restore"]')) {
    button.disabled = !state.ready;
  }
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
for (const input of [ui.instructions, ui.maxTokens, ...Object.values(SAMPLING_SLIDERS)]) {
  input.addEventListener("change", syncSettings);
}
for (const slider of Object.values(SAMPLING_SLIDERS)) {
  slider.addEventListener("input", () => {
    slider.dataset.touched = "true";
    showSlider(slider);
  });
}
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

// A network that comes back need not wait for the backoff.
window.addEventListener("online", connectNowIfIdle);

setSettingsOpen(window.matchMedia("(min-width: 900px)").matches);
ui.apiKey.value = sessionStorage.getItem(KEY_STORAGE) ?? "";
updateControls();
connect();
ui.prompt.focus();
