"""One sequence's block table: logical KV block ``i`` -> physical block ``block_ids[i]``.

Slot of position ``p`` (the ``slot_mapping`` the kernels write K/V to):
``block_ids[p // block_size] * block_size + p % block_size`` (Kwon et al., SOSP 2023, §4.2).
Tables are mutated only by the ``KVCacheManager``; everything else reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the entry of a logical block whose physical block was given back (a sliding window passed it); no kernel
#: reads it
NULL_BLOCK = -1


@dataclass(slots=True, eq=False)
class BlockTable:
    """Attributes:
    table_id: unique per pool; the owner id recorded on each block it holds.
    block_size: tokens per block.
    block_ids: physical block of each logical block (``NULL_BLOCK`` once released behind a sliding window).
    num_tokens: KV slots reserved, positions ``0 .. num_tokens-1``; always
        ``len(block_ids) == ceil(num_tokens / block_size)``.
    block_hashes: prefix-cache hashes of the leading full blocks hashed so far (chained).
    freed: set once the table's blocks went back to the pool; a freed table is never used again.
    """

    table_id: int
    block_size: int
    block_ids: list = field(default_factory=list)
    num_tokens: int = 0
    block_hashes: list = field(default_factory=list)
    freed: bool = False

    def slots(self, start: int, end: int) -> list:
        """Slots of positions ``start .. end-1`` (those tokens' ``slot_mapping``). Raises IndexError
        outside the reserved slots."""
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"slot range [{start}, {end}) outside reserved slots [0, {self.num_tokens})")
        bs = self.block_size
        ids = self.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]
