"""LoRA adapters' pages in the KV block pool (S-LoRA's unified memory pool: Sheng et al., 2023, §4).

An adapter resident for compute holds ``num_pages`` blocks of the same ``BlockPool`` as the KV cache
(``ceil(adapter bytes / block bytes)``, sized by ``rawpaged.lora``): what it holds, KV cannot. It takes them when
a sequence of that adapter is admitted (``acquire``) and keeps them while any running sequence uses it; once
none does it is idle but stays resident (a later request of the adapter finds it), and its pages are given
back, least recently used adapter first, when the pool needs room: for KV (``KVCacheManager.allocate_slots``
calls ``make_room`` before the scheduler preempts anyone) or for another adapter's pages. Knows block ids,
never arrays: what the pages hold is written by the model runner's LoRA manager.

Each acquisition of pages gets a new ``epoch``: pages handed out again (after an eviction) may have held KV
in between, so the runner rewrites an adapter whose epoch changed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

from rawpaged.core.block_pool import BlockPool


@dataclass(slots=True)
class AdapterPageStats:
    """Counters since start-up: adapters paged into the pool, and adapters whose pages were evicted."""

    num_loads: int = 0
    num_evictions: int = 0


@dataclass(slots=True)
class _Resident:
    block_ids: list
    epoch: int
    users: int = 0
    owner: int = 0


class AdapterPages:
    """The pool's adapter pages: ``{lora_int_id: block ids}``, each adapter's running users, and the idle
    adapters in least recently used order.

    Args:
        block_pool: the KV cache's ``BlockPool``.
    """

    def __init__(self, block_pool: BlockPool):
        self.block_pool = block_pool
        self._resident: OrderedDict[int, _Resident] = OrderedDict()  # least recently used first
        self._epochs = count(1)
        self.stats = AdapterPageStats()

    # ------------------------------------------------------------------ queries
    @property
    def num_resident(self) -> int:
        """Adapters holding pages now (in use or idle)."""
        return len(self._resident)

    @property
    def num_pages(self) -> int:
        """Blocks the resident adapters hold."""
        return sum(len(r.block_ids) for r in self._resident.values())

    @property
    def num_idle_pages(self) -> int:
        """Blocks of resident adapters no running sequence uses (what ``make_room`` can give back)."""
        return sum(len(r.block_ids) for r in self._resident.values() if r.users == 0)

    def is_resident(self, lora_int_id: int) -> bool:
        return lora_int_id in self._resident

    def users(self, lora_int_id: int) -> int:
        """Running sequences holding the adapter (0: idle or not resident)."""
        r = self._resident.get(lora_int_id)
        return 0 if r is None else r.users

    def pages(self, lora_int_id: int) -> tuple:
        """``(epoch, block ids)`` of a resident adapter. Raises KeyError for one that holds no pages."""
        r = self._resident[lora_int_id]
        return r.epoch, tuple(r.block_ids)

    def owner_blocks(self) -> dict:
        """``{owner id: block ids}`` of the adapters' pages (for ``KVCacheManager.check_invariants``)."""
        return {r.owner: list(r.block_ids) for r in self._resident.values()}

    # ------------------------------------------------------------------ references
    def acquire(self, lora_int_id: int, num_pages: int) -> bool:
        """One more running sequence uses adapter ``lora_int_id`` (an int >= 1) of ``num_pages`` pages.
        A resident adapter just counts it; otherwise its pages are taken from the pool, after evicting idle
        adapters (LRU) where the free blocks are too few. Returns False, taking nothing, when even then
        the pool has too few free blocks. Raises ValueError for ``num_pages < 1``."""
        r = self._resident.get(lora_int_id)
        if r is not None:
            r.users += 1
            self._resident.move_to_end(lora_int_id)
            return True
        if num_pages < 1:
            raise ValueError(f"an adapter takes at least one page, got num_pages {num_pages}")
        if not self.make_room(num_pages):
            return False
        owner = -lora_int_id  # table ids are >= 0: an adapter's pages never share an owner with a table
        block_ids = [self.block_pool.take(owner).block_id for _ in range(num_pages)]
        self._resident[lora_int_id] = _Resident(block_ids, next(self._epochs), 1, owner)
        self.stats.num_loads += 1
        return True

    def release(self, lora_int_id: int) -> None:
        """One running sequence of the adapter is done with it; at 0 users it is idle (kept, evictable),
        the most recently used of the idle ones. Raises KeyError for an adapter that holds no pages and
        ValueError for one without users."""
        r = self._resident[lora_int_id]
        if r.users < 1:
            raise ValueError(f"LoRA adapter {lora_int_id} has no running user to release")
        r.users -= 1
        self._resident.move_to_end(lora_int_id)

    def make_room(self, num_blocks: int) -> bool:
        """Evict idle adapters, least recently used first, until the pool has ``num_blocks`` free blocks
        (none is evicted when even all of them would not be enough). Returns whether it has them now."""
        pool = self.block_pool
        short = num_blocks - pool.num_free_blocks
        if short <= 0:
            return True
        if self.num_idle_pages < short:
            return False
        for lid in [i for i, r in self._resident.items() if r.users == 0]:
            if pool.num_free_blocks >= num_blocks:
                break
            self.evict(lid)
        return True

    def evict(self, lora_int_id: int) -> bool:
        """Give an idle adapter's pages back to the pool (to the head of the free queue: nothing in them
        is worth caching). False if it is not resident; raises ValueError while running sequences use it."""
        r = self._resident.get(lora_int_id)
        if r is None:
            return False
        if r.users:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by {r.users} running sequences")
        del self._resident[lora_int_id]
        for bid in r.block_ids:
            self.block_pool.release(bid, r.owner, reuse_first=True)
        self.stats.num_evictions += 1
        return True
