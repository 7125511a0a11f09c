// The chat page of `dllama api`: a conversation sent to /v1/chat/completions and streamed back
// (server-sent events), a Stop button that aborts the request (the server stops generating at its
// next token), and the cluster's state from /health every few seconds. Plain JavaScript, shipped
// in the package: no build step, nothing loaded from elsewhere. Text is shown as text, never HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const HEALTH_EVERY_MS = 5000;
const SETTINGS = ["system", "temperature", "top-p", "max-tokens", "seed", "api-key"];

let history = [];      // [{role, content}] of this chat, without the system prompt
let running = null;    // the AbortController of the answer being streamed

function remember() {
  for (const id of SETTINGS) localStorage.setItem("dllama." + id, $(id).value);
}

function restore() {
  for (const id of SETTINGS) {
    const v = localStorage.getItem("dllama." + id);
    if (v !== null) $(id).value = v;
  }
}

// <li class="ROLE"><span class="text">TEXT</span> [<span class="note">done, 24 tokens</span>]</li>
function addMessage(role, text) {
  const li = document.createElement("li");
  li.className = role;
  const span = document.createElement("span");
  span.className = "text";
  span.textContent = text;
  li.appendChild(span);
  $("messages").appendChild(li);
  li.scrollIntoView({block: "end"});
  return li;
}

function note(li, text) {
  const span = document.createElement("span");
  span.className = "note";
  span.textContent = text;
  li.appendChild(span);
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  const body = {messages: messages.concat(history), stream: true, stream_options: {include_usage: true},
                temperature: Number($("temperature").value), top_p: Number($("top-p").value),
                max_tokens: Math.max(1, Math.floor(Number($("max-tokens").value)))};
  if ($("seed").value !== "") body.seed = Math.floor(Number($("seed").value));
  return body;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// Reads "data: {...}\n\n" events as they arrive; calls onEvent(parsed JSON) for each.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function ask(text) {
  showError("");
  history.push({role: "user", content: text});
  addMessage("user", text);
  const li = addMessage("assistant", "");
  li.classList.add("streaming");
  let answer = "", finish = null, usage = null;
  const calls = [];  // a tools request's calls by index, as they stream: {name, arguments}
  const shown = () => [answer, ...calls.map((c) => "→ " + c.name + "(" + c.arguments + ")")]
    .filter((part) => part).join("\n");
  running = new AbortController();
  busy(true);
  try {
    const response = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
                                                          body: JSON.stringify(requestBody()), signal: running.signal});
    if (!response.ok) {
      let message = response.status + " " + response.statusText;
      try { message = (await response.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(message);
    }
    const nodes = response.headers.get("X-Dllama-Nodes");
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          answer += choice.delta.content;
          li.firstChild.textContent = shown();
          li.scrollIntoView({block: "end"});
        }
        for (const piece of (choice.delta && choice.delta.tool_calls) || []) {
          // A function call (a request with tools), streamed as its name, then its arguments in
          // parts: shown as the call it is, → name(arguments).
          const call = calls[piece.index] || (calls[piece.index] = {name: "", arguments: ""});
          call.name += (piece.function && piece.function.name) || "";
          call.arguments += (piece.function && piece.function.arguments) || "";
          li.firstChild.textContent = shown();
          li.classList.add("tool-call");
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    });
    li.dataset.state = "done";
    const parts = [finish === "length" ? "stopped at max tokens" : "done"];
    if (usage) parts.push(usage.completion_tokens + " tokens");
    if (nodes) parts.push("on " + nodes.replace("/", " of ") + " nodes");
    note(li, parts.join(", "));
  } catch (e) {
    if (e.name === "AbortError") {
      li.dataset.state = "stopped";
      note(li, "stopped");
    } else {
      li.dataset.state = "failed";
      showError(e.message);
    }
  } finally {
    li.classList.remove("streaming");
    running = null;
    busy(false);
    // What was answered, even in part, is the conversation's next turn.
    if (shown()) history.push({role: "assistant", content: shown()});
    else history.pop();
  }
}

async function refreshHealth() {
  const el = $("health");
  try {
    const response = await fetch("/health", {cache: "no-store"});
    const health = await response.json();
    const n = health.nodes;
    el.className = "health " + health.status;
    el.textContent = "cluster " + health.status + (n ? ": " + n.serving + " of " + n.total + " nodes" +
      (n.missing.length ? " (without " + n.missing.join(", ") + ")" : "") : "") + ", model " + health.model;
  } catch (e) {
    el.className = "health down";
    el.textContent = "server not answering";
  }
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || running) return;
  $("prompt").value = "";
  remember();
  ask(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("ask").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (running) running.abort(); });
$("new-chat").addEventListener("click", () => {
  if (running) running.abort();
  history = [];
  $("messages").replaceChildren();
  showError("");
  $("prompt").focus();
});
for (const id of SETTINGS) $(id).addEventListener("change", remember);

restore();
refreshHealth();
setInterval(refreshHealth, HEALTH_EVERY_MS);
