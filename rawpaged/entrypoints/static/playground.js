// rawpaged playground: chat and completion over /v1/ws, and the same socket's subscribe_kv_cache (a
// snapshot, then deltas), whose messages go to the KV cache view (kv_view.js, loaded first).
// No dependencies, no build step.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const kvView = window.rawpagedKvView;
  const KEY_STORAGE = "rawpaged.api_key";
  const KV_INTERVAL_MS = 200;

  const state = {
    mode: "chat",
    ws: null,
    open: false,
    pending: [], // messages sent before the socket opened
    nextId: 1,
    job: null, // the generation in flight
    last: null, // the last generation's request, for Regenerate
    conversation: [], // chat turns sent to the model: {role, content}
    needKey: false, // the server refused this tab's key (or its lack of one): wait for a new one
    kvSubId: null, // the socket's KV cache subscription
  };

  const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

  // ------------------------------------------------------------------ API key
  const apiKey = () => sessionStorage.getItem(KEY_STORAGE) || "";
  const authHeaders = () => (apiKey() ? { Authorization: "Bearer " + apiKey() } : {});

  function askKey() {
    const dialog = $("key-dialog");
    $("key-input").value = apiKey();
    if (!dialog.open) dialog.showModal();
  }

  $("key-button").addEventListener("click", askKey);
  $("key-dialog").addEventListener("close", () => {
    if ($("key-dialog").returnValue !== "save") return;
    const key = $("key-input").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    state.needKey = false;
    loadInfo();
    if (state.ws) state.ws.close(); // reconnects with the new key
    else connect();
  });

  async function getJson(path) {
    const r = await fetch(path, { headers: authHeaders() });
    if (r.status === 401) askKey();
    if (!r.ok && r.status !== 503) throw new Error(`${path}: HTTP ${r.status}`);
    return r.json();
  }

  async function loadInfo() {
    try {
      const models = await getJson("/v1/models");
      if (models.data && models.data.length) $("model").textContent = models.data[0].id;
    } catch (e) {
      $("model").textContent = "";
    }
    try {
      const health = await fetch("/health").then((r) => r.json());
      kvView.showReplicas(health.replicas || []);
    } catch (e) {
      /* health is informational here */
    }
  }

  // ------------------------------------------------------------------ websocket
  function setConn(on, text) {
    const el = $("conn");
    el.className = "badge " + (on ? "on" : "off");
    el.textContent = text || (on ? "connected" : "disconnected");
  }

  function connect() {
    const ws = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/ws");
    state.ws = ws;
    ws.onopen = () => {
      if (apiKey()) ws.send(JSON.stringify({ type: "auth", api_key: apiKey() }));
      state.open = true;
      setConn(true);
      subscribeKv();
      for (const msg of state.pending.splice(0)) ws.send(JSON.stringify(msg));
    };
    ws.onmessage = (ev) => onMessage(JSON.parse(ev.data));
    ws.onclose = (ev) => {
      if (state.ws !== ws) return;
      state.ws = null;
      state.open = false;
      state.kvSubId = null;
      if (state.job) endJob("connection closed");
      if (ev.code === 4401) {
        state.needKey = true;
        state.pending = [];
        setConn(false, "API key needed");
        askKey();
        return; // reconnects once a key is saved
      }
      setConn(false);
      setTimeout(connect, 1000);
    };
  }

  function send(msg) {
    if (state.open) state.ws.send(JSON.stringify(msg));
    else state.pending.push(msg);
  }

  function onMessage(msg) {
    switch (msg.type) {
      case "delta":
        return onDelta(msg);
      case "done":
        return onDone(msg);
      case "kv_cache":
        return msg.id === state.kvSubId && kvView.applySnapshot(msg);
      case "kv_cache_delta":
        return msg.id === state.kvSubId && kvView.applyDelta(msg);
      case "error":
        return onError(msg);
      default:
        return undefined; // auth_ok and anything newer
    }
  }

  function onError(msg) {
    if (msg.status === 401) askKey();
    if (state.job && msg.id === state.job.id) {
      const named = msg.param && !msg.message.startsWith(msg.param);
      showError(named ? `${msg.message} (${msg.param})` : msg.message);
      $("gen-stats").textContent = "";
      endJob("error");
    } else if (msg.id === state.kvSubId) {
      kvView.showError(msg.message);
    } else {
      showError(msg.message);
    }
  }

  // ------------------------------------------------------------------ generation
  function num(id, parse) {
    const v = $(id).value.trim();
    return v === "" ? undefined : parse(v);
  }

  function samplingParams() {
    const p = {
      max_tokens: num("p-max_tokens", parseInt),
      n: num("p-n", parseInt),
      temperature: num("p-temperature", parseFloat),
      top_p: num("p-top_p", parseFloat),
      top_k: num("p-top_k", parseInt),
      seed: num("p-seed", parseInt),
    };
    const stop = $("p-stop")
      .value.split("\n")
      .map((s) => s.replace(/\\n/g, "\n"))
      .filter((s) => s.length);
    if (stop.length) p.stop = stop;
    if ($("p-ignore_eos").checked) p.ignore_eos = true;
    if ($("p-beam").checked) {
      p.use_beam_search = true;
      delete p.temperature; // beam search is greedy
      delete p.top_p;
      delete p.top_k;
    }
    for (const k of Object.keys(p)) if (p[k] === undefined || Number.isNaN(p[k])) delete p[k];
    return p;
  }

  function makeChoices(n, container, promptText, keepable) {
    const grid = document.createElement("div");
    grid.className = "choices";
    const choices = [];
    for (let i = 0; i < n; i++) {
      const el = document.createElement("div");
      el.className = "choice" + (keepable && n > 1 && i === 0 ? " kept" : "");
      const bubble = document.createElement("div");
      bubble.className = "bubble";
      if (promptText) {
        const p = document.createElement("span");
        p.className = "prompt";
        p.textContent = promptText;
        bubble.append(p);
      }
      const text = document.createElement("span");
      text.className = "text";
      // a reasoning model's thinking (the server's --reasoning-parser), folded until opened
      const thinking = document.createElement("details");
      thinking.className = "reasoning";
      thinking.hidden = true;
      const summary = document.createElement("summary");
      summary.textContent = "reasoning";
      const reasoningText = document.createElement("div");
      reasoningText.className = "reasoning-text";
      thinking.append(summary, reasoningText);
      bubble.append(thinking, text);
      const meta = document.createElement("div");
      meta.className = "meta";
      el.append(bubble, meta);
      grid.append(el);
      choices.push({
        el, textEl: text, metaEl: meta, text: "", tokens: 0, finish: null, firstAt: null, lastAt: null,
        reasoningEl: thinking, reasoningTextEl: reasoningText, reasoning: "",
      });
    }
    container.append(grid);
    return choices;
  }

  function start(kind, request, container, promptText, onFinish) {
    const id = "g" + state.nextId++;
    const n = request.n || 1;
    const choices = makeChoices(n, container, promptText, kind === "chat");
    const beam = Boolean(request.use_beam_search);
    const job = { id, kind, beam, requestId: null, replica: null, t0: performance.now(), choices, onFinish };
    state.job = job;
    state.last = { kind, request };
    $("send").disabled = true;
    $("stop").disabled = false;
    $("regenerate").disabled = true;
    $("gen-error").hidden = true;
    $("gen-stats").textContent = beam
      ? "beam search: the beams are chosen at the end, so the text arrives all at once..."
      : "waiting for the first token...";
    send({ type: "generate", id, ...request });
    return job;
  }

  function onDelta(msg) {
    const job = state.job;
    if (!job || msg.id !== job.id) return;
    job.requestId = msg.request_id;
    const c = job.choices[msg.index];
    if (!c) return;
    const now = performance.now();
    if (job.ttft === undefined) job.ttft = now - job.t0;
    if (c.firstAt === null) c.firstAt = now;
    c.lastAt = now;
    c.text += msg.text;
    c.tokens += msg.token_ids.length;
    c.textEl.textContent = c.text;
    if (msg.reasoning) {
      c.reasoning += msg.reasoning;
      c.reasoningEl.hidden = false;
      c.reasoningTextEl.textContent = c.reasoning;
    }
    c.metaEl.textContent = plural(c.tokens, "token");
    if (job.kind === "chat") $("transcript").scrollTop = $("transcript").scrollHeight;
    showStats(job);
  }

  function onDone(msg) {
    const job = state.job;
    if (!job || msg.id !== job.id) return;
    const c = job.choices[msg.index];
    if (!c) return;
    c.finish = msg.finish_reason;
    c.tokens = msg.usage ? msg.usage.completion_tokens : c.tokens;
    if (msg.replica !== undefined) job.replica = msg.replica;
    c.metaEl.textContent = `${plural(c.tokens, "token")} · ${c.finish}`;
    showStats(job);
    if (job.choices.every((x) => x.finish)) endJob();
  }

  function showStats(job) {
    const tokens = job.choices.reduce((s, c) => s + c.tokens, 0);
    const firsts = job.choices.filter((c) => c.firstAt !== null);
    const parts = [];
    if (job.beam) {
      if (job.ttft !== undefined) parts.push(`result after ${job.ttft.toFixed(0)} ms`);
    } else {
      if (job.ttft !== undefined) parts.push(`TTFT ${job.ttft.toFixed(0)} ms`);
      if (firsts.length) {
        const t1 = Math.min(...firsts.map((c) => c.firstAt));
        const t2 = Math.max(...firsts.map((c) => c.lastAt));
        const each = job.choices.length > 1 ? " (all choices)" : "";
        const after = tokens - firsts.length; // tokens after each choice's first
        if (t2 > t1 && after > 0) parts.push(`${(after / ((t2 - t1) / 1000)).toFixed(1)} tok/s${each}`);
      }
    }
    parts.push(plural(tokens, "token"));
    const finishes = [...new Set(job.choices.map((c) => c.finish).filter(Boolean))];
    if (finishes.length) parts.push(`finish_reason: ${finishes.join(", ")}`);
    if (job.replica !== null) parts.push(`replica ${job.replica}`);
    $("gen-stats").textContent = parts.join(" · ");
  }

  function endJob(reason) {
    const job = state.job;
    if (!job) return;
    state.job = null;
    for (const c of job.choices) {
      if (!c.finish && reason) {
        c.finish = reason;
        c.metaEl.textContent = `${plural(c.tokens, "token")} · ${reason}`;
      }
    }
    $("send").disabled = false;
    $("stop").disabled = true;
    $("regenerate").disabled = false;
    if (job.onFinish) job.onFinish(job, reason);
  }

  function showError(text) {
    const el = $("gen-error");
    el.textContent = text;
    el.hidden = false;
  }

  // chat: the kept choice (the first, unless another is picked) continues the conversation
  function addTurn(role, text) {
    const turn = document.createElement("div");
    turn.className = "turn " + role;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    turn.append(label);
    if (text !== undefined) {
      const bubble = document.createElement("div");
      bubble.className = "bubble";
      bubble.textContent = text;
      turn.append(bubble);
    }
    $("transcript").append(turn);
    return turn;
  }

  function sendChat() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.conversation);
    const turn = addTurn("assistant");
    start("chat", { messages, ...samplingParams() }, turn, "", (job, reason) => {
      if (reason === "error" && job.choices.every((c) => !c.text)) {
        // refused (or failed before any text): the turn leaves the history, its message goes back
        turn.remove();
        const last = state.conversation[state.conversation.length - 1];
        if (last && last.role === "user") {
          state.conversation.pop();
          const turns = $("transcript").querySelectorAll(".turn.user");
          if (turns.length) turns[turns.length - 1].remove();
          if (!$("input").value) $("input").value = last.content;
        }
        return;
      }
      const index = state.conversation.length;
      state.conversation.push({ role: "assistant", content: job.choices[0].text });
      turn.dataset.index = String(index);
      if (job.choices.length > 1) {
        job.choices.forEach((c, i) => {
          const keep = document.createElement("button");
          keep.type = "button";
          keep.className = "keep";
          keep.textContent = "continue with this";
          keep.addEventListener("click", () => {
            state.conversation[index].content = c.text;
            job.choices.forEach((x, j) => x.el.classList.toggle("kept", i === j));
          });
          c.metaEl.append(" ", keep);
        });
      }
    });
  }

  function sendCompletion(prompt) {
    const out = $("completions");
    out.textContent = "";
    start("completion", { prompt, ...samplingParams() }, out, prompt);
  }

  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (state.job) return;
    if (state.needKey) {
      showError("this server needs an API key (--api-key): enter it first");
      askKey();
      return;
    }
    if (state.mode === "chat") {
      const text = $("input").value.trim();
      if (!text) return;
      $("input").value = "";
      state.conversation.push({ role: "user", content: text });
      addTurn("user", text);
      sendChat();
    } else {
      sendCompletion($("prompt").value);
    }
  });

  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });

  $("stop").addEventListener("click", () => {
    if (state.job) send({ type: "cancel", id: state.job.id });
  });

  $("regenerate").addEventListener("click", () => {
    if (state.job || !state.last) return;
    if (state.last.kind === "chat") {
      const turns = $("transcript").querySelectorAll(".turn.assistant");
      const lastTurn = turns[turns.length - 1];
      const last = state.conversation[state.conversation.length - 1];
      if (last && last.role === "assistant") state.conversation.pop();
      if (lastTurn) lastTurn.remove();
      sendChat();
    } else {
      sendCompletion(state.last.request.prompt);
    }
  });

  $("clear").addEventListener("click", () => {
    if (state.job) {
      send({ type: "cancel", id: state.job.id });
      const job = state.job;
      job.onFinish = null; // cleared: nothing of it is kept
      endJob("abort");
    }
    state.conversation = [];
    state.last = null;
    $("regenerate").disabled = true;
    $("transcript").textContent = "";
    $("completions").textContent = "";
    $("gen-stats").textContent = "";
    $("gen-error").hidden = true;
  });

  function setMode(mode) {
    state.mode = mode;
    $("mode-chat").classList.toggle("active", mode === "chat");
    $("mode-completion").classList.toggle("active", mode === "completion");
    $("chat-view").hidden = mode !== "chat";
    $("completion-view").hidden = mode !== "completion";
    $("input").hidden = mode !== "chat";
  }
  $("mode-chat").addEventListener("click", () => setMode("chat"));
  $("mode-completion").addEventListener("click", () => setMode("completion"));

  // ------------------------------------------------------------------ KV cache view (kv_view.js draws it)
  function subscribeKv() {
    if (state.kvSubId) send({ type: "cancel", id: state.kvSubId });
    kvView.clearEvents();
    state.kvSubId = "kv" + state.nextId++;
    const msg = { type: "subscribe_kv_cache", id: state.kvSubId, interval_ms: KV_INTERVAL_MS };
    if (kvView.replica() !== null) msg.replica = kvView.replica();
    send(msg);
  }

  kvView.onReplicaChange(subscribeKv);

  loadInfo();
  connect();
})();
