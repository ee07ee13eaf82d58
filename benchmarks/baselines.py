"""The non-paged baselines the memory study and the sharing benchmark measure paging against, built on
the engine's two extension points: the scheduler's admission hook and the ``KVCacheManager``.

* ``ReservationAdmission``: admit a sequence only if its whole KV footprint can be reserved up front, as
  servers that reserve ``max_model_len`` (or prompt + ``max_tokens``) per request do.
* ``CopyingForks``: forks (``n > 1`` samples, beams) copy every block instead of sharing it.
"""

from __future__ import annotations

from collections.abc import Callable

from rawpaged.core.block_table import NULL_BLOCK
from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.sequence import Sequence


class ReservationAdmission:
    """Admit a waiting sequence only if its whole footprint, ``reserve_tokens(seq)`` slots, can be
    reserved up front: the free blocks, less the blocks still promised to admitted sequences (their
    reservation minus the blocks they already hold), must cover ``ceil(reserve_tokens(seq) /
    block_size)``. Blocks stay paged (no external fragmentation); only the admission is contiguous-style.
    Reserves for the admitted sequence only (forked samples are not reserved for). An
    ``AdmissionPolicy`` for ``rawpaged.core.scheduler.Scheduler``.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, reserve_tokens: Callable[[Sequence], int]):
        self.kv_cache_manager = kv_cache_manager
        self.reserve_tokens = reserve_tokens
        self._reserved: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (seq, reserved blocks)

    def blocks_for(self, seq: Sequence) -> int:
        return -(-self.reserve_tokens(seq) // self.kv_cache_manager.block_size)

    @property
    def outstanding_blocks(self) -> int:
        """Blocks promised to admitted sequences but not yet allocated to them."""
        return sum(
            max(0, n - (len(s.block_table.block_ids) if s.block_table is not None else 0))
            for s, n in self._reserved.values()
        )

    def can_admit(self, seq: Sequence) -> bool:
        free = self.kv_cache_manager.block_pool.num_free_blocks
        return free - self.outstanding_blocks >= self.blocks_for(seq)

    def admitted(self, seq: Sequence) -> None:
        self._reserved[seq.seq_id] = (seq, self.blocks_for(seq))

    def released(self, seq: Sequence) -> None:
        self._reserved.pop(seq.seq_id, None)


class CopyingForks(KVCacheManager):
    """A ``KVCacheManager`` whose ``fork`` copies each of the parent's blocks into a fresh one (recorded
    as ``(src, dst)`` copies, run before the step's kernels) instead of sharing it. When the pool cannot
    hold the copy, the fork shares after all: a fork cannot wait for a recompute."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        src = parent.block_table
        if src is None or sum(b != NULL_BLOCK for b in src.block_ids) > self.block_pool.num_free_blocks:
            super().fork(parent, child)
            return
        table = child.block_table = self._new_table([], src.num_tokens, [])
        for bid in src.block_ids:  # blocks a sliding window released stay released
            table.block_ids.append(bid if bid == NULL_BLOCK else self.block_pool.copy(bid, table.table_id))
