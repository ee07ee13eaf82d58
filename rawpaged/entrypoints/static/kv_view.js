// rawpaged playground: the live view of the KV block pool. It draws what the page's socket
// (playground.js) receives for its subscribe_kv_cache: a kv_cache snapshot, then kv_cache_delta messages.
// No dependencies, no build step; loaded before playground.js, which uses window.rawpagedKvView.
"use strict";

window.rawpagedKvView = (() => {
  const $ = (id) => document.getElementById(id);
  const MAX_EVENTS_SHOWN = 60;

  const kv = {
    replica: null, // the replica whose pool is shown (data parallel); null: the server's choice
    start: 0,
    count: 0,
    numBlocks: 0,
    blocks: [],
    cells: [],
    requests: [],
    groups: [], // the pool's KV cache groups (kv_cache_groups of the snapshot)
    colors: new Map(),
    highlighted: [],
    hovered: null, // the request id whose block tables are shown
  };

  // server request ids are long (ws-<32 hex digits>): lists show the start and the end, titles all of it
  const short = (id) => (id.length > 16 ? `${id.slice(0, 7)}…${id.slice(-4)}` : id);
  const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

  // ------------------------------------------------------------------ replicas
  // the replica picker, shown with two replicas or more (the list from /health)
  function showReplicas(replicas) {
    const select = $("replica");
    $("replica-row").hidden = replicas.length < 2;
    if (replicas.length >= 2 && select.options.length !== replicas.length) {
      select.textContent = "";
      for (const r of replicas) select.add(new Option(String(r.replica), String(r.replica)));
    }
  }

  // onChange() runs after another replica is picked (the page subscribes to its pool)
  function onReplicaChange(onChange) {
    $("replica").addEventListener("change", () => {
      kv.replica = parseInt($("replica").value, 10);
      onChange();
    });
  }

  // a new subscription (another replica, a new socket) lists its own events
  function clearEvents() {
    $("kv-events").textContent = "";
  }

  function showError(message) {
    $("kv-range").textContent = `KV cache view: ${message}`;
  }

  // ------------------------------------------------------------------ the pool
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
    if (b.group !== undefined && b.group !== null && kv.groups.length > 1) title += ` · ${groupName(b.group)}`;
    el.title = title;
  }

  // KV cache groups (a hybrid model's layers of one kind page together): "group 1 (sliding_window_8, layers 2, 3)"
  function groupName(g) {
    const spec = kv.groups[g];
    return spec ? `group ${g} (${spec.kind}, layers ${spec.layer_ids.join(", ")})` : `group ${g}`;
  }

  function tablesOf(q) {
    return q.block_tables || [q.block_table];
  }

  function applySnapshot(s) {
    kv.groups = s.kv_cache_groups || [];
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

  function applyDelta(d) {
    kv.groups = d.kv_cache_groups || kv.groups;
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
    const o = s.offload;
    const tier = o
      ? ` · second tier ${o.num_prefix_blocks + o.num_swap_blocks}/${o.num_slots} ` +
        `(prefix ${o.num_prefix_blocks}, swapped ${o.num_swap_blocks}), hits ${o.prefix_hits}, ` +
        `swaps out/in ${o.swap_out_blocks}/${o.swap_in_blocks}`
      : "";
    const groups =
      kv.groups.length > 1
        ? " · " + kv.groups.map((g) => `${groupName(g.group_id)}: ${g.num_used_blocks} held`).join(", ")
        : "";
    $("kv-counts").textContent =
      `${replica}${s.num_blocks} blocks of ${s.block_size} tokens · used ${used} (shared ${shared}) · ` +
      `free ${s.num_free_blocks} (prefix cached ${cached}) · step ${s.step}${tier}${groups}`;
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
      const blocks = new Set(r.sequences.flatMap((q) => tablesOf(q).flat()).filter((p) => p >= 0)).size;
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
      tablesOf(q).forEach((table, g) => {
        const row = table.map((p, i) => `${i}→${p}`).join("  ") || "(no blocks)";
        lines.push(kv.groups.length > 1 ? `  ${groupName(g)}: ${row}` : "  " + row);
        for (const p of table) {
          const el = p >= 0 ? kv.cells[p - kv.start] : null; // -1: given back behind a sliding window
          if (el) {
            el.classList.add("hl");
            kv.highlighted.push(el);
          }
        }
      });
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
      } else if (e.type === "rollback") {
        text = `draft rejected: ${who} gives back ${plural(e.block_ids.length, "block")}`;
        if (live) flash(e.block_ids, "flash-rollback");
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

  return {
    applySnapshot,
    applyDelta,
    clearEvents,
    showError,
    showReplicas,
    onReplicaChange,
    replica: () => kv.replica,
  };
})();
