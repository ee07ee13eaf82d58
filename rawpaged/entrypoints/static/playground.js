// rawpaged playground: chat and completion over /v1/ws, and a live view of the KV block pool from the
// same socket's subscribe_kv_cache (a snapshot, then deltas). No dependencies, no build step.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORAGE = "rawpaged.api_key";
  const KV_INTERVAL_MS = 200;
  const MAX_EVENTS_SHOWN = 60;

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
  };
  const kv = {
    subId: null,
    replica: null,
    start: 0,
    count: 0,
    numBlocks: 0,
    blocks: [],
    cells: [],
    requests: [],
    colors: new Map(),
    highlighted: [],
    hovered: null, // the request id whose block tables are shown
  };

  // server request ids are long (ws-<32 hex digits>): lists show the start and the end, titles all of it
  const short = (id) => (id.length > 16 ? `${id.slice(0, 7)}…${id.slice(-4)}` : id);
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
      const replicas = health.replicas || [];
      const select = $("replica");
      $("replica-row").hidden = replicas.length < 2;
      if (replicas.length >= 2 && select.options.length !== replicas.length) {
        select.textContent = "";
        for (const r of replicas) select.add(new Option(String(r.replica), String(r.replica)));
      }
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
      kv.subId = null;
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
        return msg.id === kv.subId && applySnapshot(msg);
      case "kv_cache_delta":
        return msg.id === kv.subId && applyKvDelta(msg);
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
    } else if (msg.id === kv.subId) {
      $("kv-range").textContent = `KV cache view: ${msg.message}`;
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
      bubble.append(text);
      const meta = document.createElement("div");
      meta.className = "meta";
      el.append(bubble, meta);
      grid.append(el);
      choices.push({ el, textEl: text, metaEl: meta, text: "", tokens: 0, finish: null, firstAt: null, lastAt: null });
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

  // ------------------------------------------------------------------ KV cache view
  function subscribeKv() {
    if (kv.subId) send({ type: "cancel", id: kv.subId });
    $("kv-events").textContent = ""; // a new subscription (another replica, a new socket) lists its own
    kv.subId = "kv" + state.nextId++;
    const msg = { type: "subscribe_kv_cache", id: kv.subId, interval_ms: KV_INTERVAL_MS };
    if (kv.replica !== null) msg.replica = kv.replica;
    send(msg);
  }

  $("replica").addEventListener("change", () => {
    kv.replica = parseInt($("replica").value, 10);
    subscribeKv();
  });

  function colorOf(requestId) {
    let c = kv.colors.get(requestId);
    if (!c) {
      let h = 0;
      for (let i = 0; i < requestId.length; i++) h = (h * 31 + requestId.charCodeAt(i)) >>> 0;
      c = `hsl(${h % 360} 65% 52%)`;
      kv.colors.set(requestId, c);
    }
    return c;
  }

  function paint(b) {
    const el = kv.cells[b.block_id - kv.start];
    if (!el) return;
    const used = b.ref_count > 0;
    el.classList.toggle("used", used);
    el.classList.toggle("shared", b.ref_count > 1);
    el.classList.toggle("cached", !used && b.cached);
    el.classList.toggle("free", !used && !b.cached);
    el.style.background = used && b.owners.length ? colorOf(b.owners[0]) : "";
    el.dataset.refCount = String(b.ref_count);
    let title = `block ${b.block_id} · ref_count ${b.ref_count}`;
    if (b.owners.length) title += ` · ${b.owners.join(", ")}`;
    if (b.cached) title += " · prefix cached";
    el.title = title;
  }

  function applySnapshot(s) {
    kv.start = s.start;
    kv.count = s.count;
    kv.numBlocks = s.num_blocks;
    kv.blocks = s.blocks.slice();
    const grid = $("kv-grid");
    const frag = document.createDocumentFragment();
    kv.cells = s.blocks.map((b) => {
      const el = document.createElement("i");
      el.className = "block";
      el.dataset.blockId = String(b.block_id);
      frag.append(el);
      return el;
    });
    grid.textContent = "";
    grid.append(frag);
    for (const b of s.blocks) paint(b);
    $("kv-range").textContent =
      s.count < s.num_blocks ? `showing blocks ${s.start}-${s.start + s.count - 1} of ${s.num_blocks}` : "";
    setRequests(s.requests);
    addEvents(s.events, s.events_missed, false);
    showCounts(s);
  }

  function applyKvDelta(d) {
    for (const b of d.blocks) {
      kv.blocks[b.block_id - kv.start] = b;
      paint(b);
    }
    if (d.requests) setRequests(d.requests);
    addEvents(d.events, d.events_missed, true);
    showCounts(d);
  }

  function showCounts(s) {
    let used = 0;
    let shared = 0;
    let cached = 0;
    for (const b of kv.blocks) {
      if (b.ref_count > 0) used++;
      if (b.ref_count > 1) shared++;
      if (b.ref_count === 0 && b.cached) cached++;
    }
    const replica = s.replica !== undefined ? `replica ${s.replica} · ` : "";
    $("kv-counts").textContent =
      `${replica}${s.num_blocks} blocks of ${s.block_size} tokens · used ${used} (shared ${shared}) · ` +
      `free ${s.num_free_blocks} (prefix cached ${cached}) · step ${s.step}`;
  }

  function setRequests(requests) {
    kv.requests = requests;
    const list = $("kv-requests");
    list.textContent = "";
    for (const r of requests) {
      const li = document.createElement("li");
      li.dataset.requestId = r.request_id;
      li.title = r.request_id;
      const sw = document.createElement("span");
      sw.className = "swatch";
      sw.style.background = colorOf(r.request_id);
      const longest = Math.max(...r.sequences.map((q) => q.num_tokens));
      const blocks = new Set(r.sequences.flatMap((q) => q.block_table)).size;
      const seqs = r.sequences.length === 1 ? "1 sequence" : `${r.sequences.length} sequences`;
      li.append(sw, `${short(r.request_id)} · ${seqs} · ${plural(blocks, "block")} · longest ${longest} tokens`);
      list.append(li);
    }
    showTable(); // the hovered request's tables, as of this look
  }

  // the list is rebuilt on every look, so hovering is tracked on the list itself
  $("kv-requests").addEventListener("mouseover", (ev) => {
    const li = ev.target.closest("li");
    if (li && li.dataset.requestId !== kv.hovered) {
      kv.hovered = li.dataset.requestId;
      showTable();
    }
  });
  $("kv-requests").addEventListener("mouseleave", () => {
    // the list empties when the hovered request ends: its "finished" line stays until the next hover
    const live = kv.requests.some((r) => r.request_id === kv.hovered);
    kv.hovered = null;
    if (live) showTable();
  });

  function showTable() {
    clearHighlight();
    const table = $("kv-table");
    if (kv.hovered === null) {
      table.textContent = "Hover a request to see its block tables (logical → physical).";
      return;
    }
    const r = kv.requests.find((x) => x.request_id === kv.hovered);
    if (!r) {
      table.textContent = `${short(kv.hovered)}: finished, its blocks returned to the pool.`;
      return;
    }
    const lines = [];
    for (const q of r.sequences) {
      lines.push(
        `${short(r.request_id)} #${q.index} (${q.status}, ${q.num_tokens} tokens, ` +
          `${q.num_computed_tokens} computed):`,
      );
      lines.push("  " + (q.block_table.map((p, i) => `${i}→${p}`).join("  ") || "(no blocks)"));
      for (const p of q.block_table) {
        const el = kv.cells[p - kv.start];
        if (el) {
          el.classList.add("hl");
          kv.highlighted.push(el);
        }
      }
    }
    table.textContent = lines.join("\n");
  }

  function clearHighlight() {
    for (const el of kv.highlighted) el.classList.remove("hl");
    kv.highlighted = [];
  }

  function flash(blockIds, cls) {
    for (const id of blockIds) {
      const el = kv.cells[id - kv.start];
      if (!el) continue;
      el.classList.remove(cls);
      void el.offsetWidth; // restart the animation
      el.classList.add(cls);
      setTimeout(() => el.classList.remove(cls), 900);
    }
  }

  function addEvents(events, missed, live) {
    const list = $("kv-events");
    for (const e of events) {
      const li = document.createElement("li");
      li.className = e.type;
      li.title = e.request_id;
      // index: the sequence within its request (the choice for n > 1; a beam's own number)
      const who = `${short(e.request_id)} #${e.index}`;
      let text;
      if (e.type === "copy") {
        text = `copy-on-write: ${who} block ${e.src} → ${e.dst}`;
        if (live) flash([e.src, e.dst], "flash-copy");
      } else if (e.type === "preempt") {
        text = `preempted: ${who}, ${plural(e.block_ids.length, "block")} freed (recomputed later)`;
        if (live) flash(e.block_ids, "flash-preempt");
      } else if (e.type === "fork") {
        text = `fork: ${who} shares ${plural(e.num_blocks, "block")} of #${e.parent_index}`;
      } else {
        text = `${e.type}: ${who}`;
      }
      li.textContent = `${e.event_id}. ${text}`;
      list.prepend(li);
    }
    if (missed) {
      const li = document.createElement("li");
      li.textContent = `(${missed} earlier events not shown)`;
      list.prepend(li);
    }
    while (list.children.length > MAX_EVENTS_SHOWN) list.lastChild.remove();
  }

  loadInfo();
  connect();
})();
