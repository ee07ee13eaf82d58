"""A look at the KV block pool as it works: every physical block (``ref_count``, the requests holding it,
whether its prefix is cached), each unfinished sequence's block table, and the block events since the
reader's last look. ``GET /v1/debug/kv_cache`` returns one snapshot; the websocket's ``subscribe_kv_cache``
streams a first snapshot, then deltas (``KVCacheSnapshotDiffer``).

Cost: ``capture`` runs on the engine's thread between steps and copies only plain lists (two values per
block in the range, one row per sequence); ``to_json`` and the deltas run on the caller's thread. Both
grow with the blocks in the range (at most ``MAX_SNAPSHOT_BLOCKS`` per snapshot) plus the total length
of the block tables; ``benchmarks/kv_cache_view.py`` measures them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

#: the largest block range one snapshot covers; larger pools are read in ranges (``start``, ``count``)
MAX_SNAPSHOT_BLOCKS = 8192
#: events a snapshot carries when its reader names no ``since_event``
DEFAULT_RECENT_EVENTS = 64


@dataclass(slots=True)
class KVCacheState:
    """What ``capture`` copied out of the scheduler (plain Python values, safe to read on any thread).

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks in the whole pool.
        num_free_blocks: blocks with ``ref_count`` 0 in the whole pool (cached ones included).
        start: the first block id of the range.
        ref_counts, cached: per block of the range ``start .. start + len(ref_counts) - 1``.
        sequences: per unfinished sequence, running ones first: ``(request_id, index, seq_id, status,
            num_tokens, num_computed_tokens, block_ids)``, ``block_ids`` a list per KV cache group.
        step: the scheduler's step counter.
        events, events_missed, next_event_id: ``KVCacheEventLog.since`` and the next id to ask for.
        offload: the second KV tier's blocks and counters (``offload_summary``), or None without one.
        groups: the pool's KV cache groups, ``{"group_id", "kind", "layer_ids", "sliding_window"}`` each.
    """

    block_size: int
    num_blocks: int
    num_free_blocks: int
    start: int
    ref_counts: list
    cached: list
    sequences: list
    step: int
    events: list
    events_missed: int
    next_event_id: int
    offload: dict | None = None
    groups: list = ()


def groups_summary(kv, seqs) -> list:
    """The KV cache groups of ``kv`` (a ``KVCacheManager``) as the KV view shows them, with the distinct
    blocks the sequences ``seqs`` hold in each and the blocks each has given back behind its window."""
    held = [set() for _ in kv.groups]
    for s in seqs:
        for g, blocks in enumerate(kv.group_blocks(s)):
            held[g].update(blocks)
    return [
        {
            "group_id": i,
            "kind": g.kind,
            "layer_ids": list(g.layer_ids),
            "sliding_window": g.sliding_window,
            "num_used_blocks": len(held[i]),
            "num_window_frees": kv.managers[i].num_window_frees,
        }
        for i, g in enumerate(kv.groups)
    ]


def offload_summary(tier) -> dict | None:
    """What the KV view shows of a second tier (``kv_offload.OffloadingManager``): slots, blocks held by
    kind, prefix hits and stores, blocks swapped out and in."""
    if tier is None:
        return None
    s = tier.stats
    return {
        "num_slots": tier.num_slots,
        "num_prefix_blocks": tier.num_prefix_blocks,
        "num_swap_blocks": tier.num_swap_blocks,
        "prefix_hits": s.prefix_hits,
        "prefix_stores": s.prefix_stores,
        "swap_out_blocks": s.swap_out_blocks,
        "swap_in_blocks": s.swap_in_blocks,
    }


def check_range(num_blocks: int, start: int = 0, count: int | None = None, since_event: int | None = None) -> tuple:
    """``(start, stop)`` of the block range ``start .. start + count - 1``, ``count`` defaulting to (and
    capped at) ``MAX_SNAPSHOT_BLOCKS`` and to the pool's end.

    Raises:
        ValueError: ``start`` outside ``[0, num_blocks)``, ``count < 1`` or ``since_event < 0`` (naming
        the field).
    """
    if since_event is not None and since_event < 0:
        raise ValueError(f"since_event must be >= 0, got {since_event}")
    if not 0 <= start < num_blocks:
        raise ValueError(f"start must be in [0, {num_blocks}), got {start}")
    if count is not None and count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    count = MAX_SNAPSHOT_BLOCKS if count is None else min(count, MAX_SNAPSHOT_BLOCKS)
    return start, min(num_blocks, start + count)


def capture(scheduler, start: int = 0, count: int | None = None, since_event: int | None = None) -> KVCacheState:
    """Copy the pool's state for blocks ``start .. start + count - 1`` (``check_range``), every unfinished
    sequence of ``scheduler`` and the events from ``since_event`` on (None: the last
    ``DEFAULT_RECENT_EVENTS``). Call it where nothing steps the scheduler meanwhile (the engine thread).

    Raises:
        ValueError: a bad range (``check_range``).
    """
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    start, stop = check_range(pool.num_blocks, start, count, since_event)
    blocks = pool.blocks[start:stop]
    log = kv.events
    if since_event is None:
        since_event = max(0, log.next_event_id - DEFAULT_RECENT_EVENTS)
    events, missed = log.since(since_event)
    sequences = [
        (
            s.request_id,
            s.index,
            s.seq_id,
            s.status.value,
            s.num_tokens,
            s.num_computed_tokens,
            [list(t.block_ids) for t in s.block_tables] if s.block_tables is not None else [[] for _ in kv.groups],
        )
        for s in chain(scheduler.running, scheduler.waiting)
    ]
    return KVCacheState(
        block_size=kv.block_size,
        num_blocks=pool.num_blocks,
        num_free_blocks=pool.num_free_blocks,
        start=start,
        ref_counts=[b.ref_count for b in blocks],
        cached=[b.block_hash is not None for b in blocks],
        sequences=sequences,
        step=scheduler.stats.num_steps,
        events=events,
        events_missed=missed,
        next_event_id=log.next_event_id,
        offload=offload_summary(scheduler.kv_tier.manager if scheduler.kv_tier is not None else None),
        groups=groups_summary(kv, chain(scheduler.running, scheduler.waiting)),
    )


def to_json(state: KVCacheState) -> dict:
    """The snapshot as JSON-ready data (docs/server.md, "KV cache view").

    ``blocks``: one entry per block of the range, ``{"block_id", "ref_count", "owners", "cached"}`` with
    ``owners`` the distinct ids of the requests whose tables hold it (a block shared by the ``n`` choices
    of one request has ``ref_count`` n and one owner) and ``cached`` True while the block is findable in
    the prefix cache (a free cached block can be reused until it is evicted), and ``group`` the KV cache
    group whose tables hold it (None while free). ``requests``: each unfinished request's sequences with
    their ``block_tables``, one per group (logical block i -> physical block id; -1 where a sliding window
    gave the block back), and ``block_table``, the first group's. ``kv_cache_groups``: the pool's groups
    (``groups_summary``).
    """
    start, stop = state.start, state.start + len(state.ref_counts)
    owners: dict[int, list] = {}
    requests: dict[str, list] = {}
    group_of: dict[int, int] = {}
    for rid, index, seq_id, status, num_tokens, num_computed, tables in state.sequences:
        requests.setdefault(rid, []).append(
            {
                "index": index,
                "seq_id": seq_id,
                "status": status,
                "num_tokens": num_tokens,
                "num_computed_tokens": num_computed,
                "block_table": tables[0] if tables else [],
                "block_tables": tables,
            }
        )
        for g, block_ids in enumerate(tables):
            for bid in block_ids:
                if start <= bid < stop:
                    group_of[bid] = g
                    held = owners.setdefault(bid, [])
                    if rid not in held:
                        held.append(rid)
    blocks = [
        {
            "block_id": start + i,
            "ref_count": rc,
            "owners": owners.get(start + i, []),
            "cached": c,
            "group": group_of.get(start + i),
        }
        for i, (rc, c) in enumerate(zip(state.ref_counts, state.cached))
    ]
    return {
        "block_size": state.block_size,
        "num_blocks": state.num_blocks,
        "num_free_blocks": state.num_free_blocks,
        "start": start,
        "count": stop - start,
        "step": state.step,
        "blocks": blocks,
        "requests": [{"request_id": rid, "sequences": seqs} for rid, seqs in requests.items()],
        "events": state.events,
        "events_missed": state.events_missed,
        "next_event_id": state.next_event_id,
        "offload": state.offload,
        "kv_cache_groups": list(state.groups),
    }


class KVCacheSnapshotDiffer:
    """Turns a reader's successive snapshots (``to_json``, one block range) into what changed.

    ``update(snapshot)`` returns the first snapshot whole, then a delta: the same keys, but ``blocks``
    holds only the entries that differ from the previous snapshot's, and ``requests`` is replaced only
    when it changed (otherwise absent). It returns None when nothing changed at all (no block, request,
    counter or event), so an idle pool sends nothing.
    """

    def __init__(self):
        self._blocks: list | None = None
        self._requests: list | None = None
        self._counters: tuple | None = None

    def update(self, snapshot: dict) -> tuple:
        """``(kind, message)``: ``("snapshot", snapshot)`` the first time (or after the range or pool
        changed), else ``("delta", changes)`` or ``("delta", None)`` when nothing changed."""
        blocks, requests = snapshot["blocks"], snapshot["requests"]
        counters = (snapshot["start"], snapshot["count"], snapshot["num_blocks"])
        first = self._blocks is None or counters != self._counters
        previous_blocks, previous_requests = self._blocks, self._requests
        self._blocks, self._requests, self._counters = blocks, requests, counters
        if first:
            return "snapshot", snapshot
        changed = [b for b, old in zip(blocks, previous_blocks) if b != old]
        delta = {k: v for k, v in snapshot.items() if k not in ("blocks", "requests")}
        delta["blocks"] = changed
        if requests != previous_requests:
            delta["requests"] = requests
        if not changed and "requests" not in delta and not snapshot["events"] and not snapshot["events_missed"]:
            return "delta", None
        return "delta", delta
