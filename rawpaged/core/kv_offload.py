"""The second KV tier's bookkeeping: which host slots hold which blocks. Knows slot ids and block hashes,
never arrays (the bytes live in a ``HostKVStore``, moved by the model runner).

A slot holds one block of every layer's K and V. Two kinds of entries share the slots:

* **prefix** entries: a full block under its prefix-cache hash (and its token ids, compared on a hit, as
  the device pool compares them). They are kept in LRU order and evicted when a slot is needed; a lookup or a
  store touches them. A block evicted from the device pool lands here, so a prefix that comes back after its
  blocks were reused is loaded instead of recomputed (as vLLM v1's offloading connector and SGLang's HiCache).
* **swap** entries: blocks of a preempted sequence, copied out instead of dropped (preemption by swapping, the
  vLLM paper's §4.5). They are pinned (never evicted) and counted: sequences of one request that shared a
  block share its slot, so a shared block is copied out once and back in once.

A slot named in the current step's transfers is pinned until ``end_step`` (the runner has copied it by
then): a store into it or a load from it never races with another use of the slot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class SwappedTable:
    """A swapped-out sequence's tables: per KV cache group, the swap slot of each logical block
    (``NULL_BLOCK`` where a window had released it), and what its ``BlockTable``s held besides."""

    group_slots: list
    num_tokens: int
    block_hashes: list

    @property
    def slots(self) -> list:
        """Every group's swap slots, group by group."""
        return [s for slots in self.group_slots for s in slots]


@dataclass(slots=True)
class KVTransfers:
    """One step's copies between the device pool and the second tier, run in this order before the step's
    kernels: ``stores`` ``(block_id, slot)`` device -> host, then ``loads`` ``(slot, block_id)``."""

    stores: list
    loads: list

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


@dataclass(slots=True)
class OffloadStats:
    """Counters since start-up: prefix blocks stored and loaded (hits), swap-outs and swap-ins (blocks),
    prefix entries evicted from the tier, stores refused (the tier was full of pinned slots), and prefix
    entries restored from a file at start-up."""

    prefix_stores: int = 0
    prefix_hits: int = 0
    prefix_evictions: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    refused_stores: int = 0
    restored: int = 0


@dataclass(slots=True)
class _Slot:
    kind: str | None = None  # None (free), "prefix" or "swap"
    block_hash: int | None = None
    token_ids: tuple | None = None
    ref_count: int = 0  # swap: sequences holding it
    pins: int = 0  # transfers of the current step naming it


@dataclass
class OffloadingManager:
    """``num_slots`` host slots.

    Raises:
        ValueError: ``num_slots < 1``.
    """

    num_slots: int
    stats: OffloadStats = field(default_factory=OffloadStats)

    def __post_init__(self):
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        self._slots = [_Slot() for _ in range(self.num_slots)]
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._prefix: OrderedDict[int, int] = OrderedDict()  # block_hash -> slot, least recently used first
        self._pinned: list[int] = []
        self._freed_this_step: list[int] = []  # free again after end_step (a transfer may still name them)

    # ------------------------------------------------------------------ queries
    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_prefix_blocks(self) -> int:
        return len(self._prefix)

    @property
    def num_swap_blocks(self) -> int:
        return sum(1 for s in self._slots if s.kind == "swap")

    def _evictable(self) -> int:
        return sum(1 for slot in self._prefix.values() if self._slots[slot].pins == 0)

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` slots can be had now (free ones, then unpinned prefix entries evicted)."""
        return n <= len(self._free) + self._evictable()

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._prefix

    def slot_info(self, slot: int) -> tuple:
        """``(kind, block_hash, token_ids)`` of ``slot``: kind None (free), "prefix" or "swap"."""
        s = self._slots[slot]
        return s.kind, s.block_hash, s.token_ids

    # ------------------------------------------------------------------ slots
    def _take(self) -> int | None:
        if not self._free:
            victim = next((h for h, s in self._prefix.items() if self._slots[s].pins == 0), None)
            if victim is None:
                return None
            self._drop_prefix(victim)
            self.stats.prefix_evictions += 1
        return self._free.pop()

    def _drop_prefix(self, block_hash: int) -> None:
        slot = self._prefix.pop(block_hash)
        self._slots[slot] = _Slot()
        self._free.append(slot)

    def _pin(self, slot: int) -> None:
        self._slots[slot].pins += 1
        self._pinned.append(slot)

    def end_step(self) -> None:
        """The runner has run this step's transfers: their slots are no longer pinned, and the swap slots
        released in the step are free."""
        for slot in self._pinned:
            self._slots[slot].pins -= 1
        self._pinned = []
        self._free.extend(self._freed_this_step)
        self._freed_this_step = []

    # ------------------------------------------------------------------ prefix entries
    def lookup(self, block_hash: int, token_ids: tuple) -> int | None:
        """The slot holding the full block ``token_ids`` under ``block_hash`` (the token ids compared), or
        None; a hit is touched (most recently used) and pinned for this step's load (``stats.prefix_hits``
        counts the load, once the block is taken)."""
        slot = self._prefix.get(block_hash)
        if slot is None or self._slots[slot].token_ids != token_ids:
            return None
        self._prefix.move_to_end(block_hash)
        self._pin(slot)
        return slot

    def store_prefix(self, block_hash: int, token_ids: tuple) -> int | None:
        """A slot for a full block to be stored under ``block_hash`` (pinned for this step's store); None when
        it is already stored (touched instead) or no slot can be had."""
        if block_hash in self._prefix:
            self._prefix.move_to_end(block_hash)
            return None
        slot = self._take()
        if slot is None:
            self.stats.refused_stores += 1
            return None
        self._slots[slot] = _Slot("prefix", block_hash, tuple(token_ids))
        self._prefix[block_hash] = slot
        self._pin(slot)
        self.stats.prefix_stores += 1
        return slot

    def restore_prefix(self, slot: int, block_hash: int, token_ids: tuple) -> None:
        """At start-up: ``slot`` of a persistent store holds ``block_hash``'s block (oldest restored first,
        so the last is the most recently used). Raises ValueError for a slot in use."""
        if self._slots[slot].kind is not None or block_hash in self._prefix:
            raise ValueError(f"slot {slot} or hash {block_hash} restored twice")
        self._free.remove(slot)
        self._slots[slot] = _Slot("prefix", block_hash, tuple(token_ids))
        self._prefix[block_hash] = slot
        self.stats.restored += 1

    # ------------------------------------------------------------------ swap entries
    def allocate_swap(self, n: int) -> list | None:
        """``n`` slots for swapped-out blocks (each held once, pinned for this step's store), or None (and
        nothing taken) when that many cannot be had."""
        if not self.can_allocate(n):
            return None
        slots = []
        for _ in range(n):
            slot = self._take()
            self._slots[slot] = _Slot("swap", ref_count=1)
            self._pin(slot)
            slots.append(slot)
        self.stats.swap_out_blocks += n
        return slots

    def share_swap(self, slot: int) -> None:
        """One more sequence holds the swapped block in ``slot``."""
        assert self._slots[slot].kind == "swap", f"slot {slot} is not a swap slot"  # pragma: no mutate
        self._slots[slot].ref_count += 1

    def load_swap(self, slot: int) -> None:
        """A swapped block is copied back this step: pinned until the copy ran; each holder then releases it
        with ``release_swap``."""
        self._pin(slot)
        self.stats.swap_in_blocks += 1

    def release_swap(self, slot: int) -> None:
        """One holder of a swapped block lets go; at zero the slot is free again (after this step, while it
        is pinned)."""
        s = self._slots[slot]
        assert s.kind == "swap" and s.ref_count > 0, f"slot {slot} is not a held swap slot"  # pragma: no mutate
        s.ref_count -= 1
        if s.ref_count == 0:
            self._slots[slot] = _Slot(pins=s.pins)
            self._freed_this_step.append(slot)

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Free + prefix + swap == total, each slot in exactly one of them, no free slot pinned after
        ``end_step``, the prefix map consistent with the slots."""
        kinds = [s.kind for s in self._slots]
        released = len(self._freed_this_step)
        assert len(self._free) == len(set(self._free)) == kinds.count(None) - released, "free list"
        assert all(self._slots[i].kind is None for i in self._free), "a used slot on the free list"
        assert len(self._prefix) == kinds.count("prefix"), "prefix map"
        for h, slot in self._prefix.items():
            assert self._slots[slot].kind == "prefix" and self._slots[slot].block_hash == h, f"prefix {h}"
        for s in self._slots:
            assert (s.kind == "swap") == (s.ref_count > 0), "swap ref_count"
        if not self._pinned:
            assert all(s.pins == 0 for s in self._slots), "a pin outlived its step"
