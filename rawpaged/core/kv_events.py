"""What happened to KV blocks between two looks at the pool: copy-on-write copies, forks that share a
table's blocks, preemptions that free them, and blocks given back when speculative drafts are rejected.
The KV cache view (``kv_cache_snapshot``) shows them;
vLLM publishes similar events (``vllm.distributed.kv_events``) for external KV-aware routers.

The log is a bounded ring: recording costs one ``deque.append`` per event (events are rare next to
steps: a fork per extra choice, a copy per shared partly filled block written, a preemption when the
pool runs dry), and a reader that falls more than ``capacity`` events behind is told how many it missed.
"""

from __future__ import annotations

from collections import deque
from itertools import islice

#: event types, in the ``type`` field of each event
COPY, FORK, PREEMPT, ROLLBACK = "copy", "fork", "preempt", "rollback"


class KVCacheEventLog:
    """The last ``capacity`` events, each a dict with an increasing ``event_id`` and:

    * ``copy``: ``request_id``, ``index`` (choice), ``src``, ``dst`` (the block copied, its copy);
    * ``fork``: ``request_id``, ``index`` (the new choice), ``parent_index``, ``num_blocks`` shared;
    * ``preempt``: ``request_id``, ``index``, ``block_ids`` (released; the sequence recomputes later);
    * ``rollback``: ``request_id``, ``index``, ``block_ids`` (taken for draft tokens the target rejected,
      released in the same step).

    Raises:
        ValueError: ``capacity < 1``.
    """

    def __init__(self, capacity: int = 1024):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._events: deque = deque(maxlen=capacity)
        self.next_event_id = 0

    def record(self, type: str, seq, **fields) -> None:
        """Append one event about sequence ``seq`` (its ``request_id`` and ``index`` are recorded)."""
        self._events.append(
            {"event_id": self.next_event_id, "type": type, "request_id": seq.request_id, "index": seq.index, **fields}
        )
        self.next_event_id += 1

    def since(self, event_id: int) -> tuple:
        """``(events, num_missed)``: the events with ``event_id >= event_id`` still held, oldest first, and
        how many such events the ring has dropped already."""
        first = self.next_event_id - len(self._events)
        if event_id >= self.next_event_id:
            return [], 0
        skip = max(0, event_id - first)
        return list(islice(self._events, skip, None)), max(0, first - max(event_id, 0))
