"""Automatic prefix caching: how full KV blocks are named, and how a prompt finds the blocks it can reuse.

A full block is named by a hash chained from the previous block's hash and its own token ids, so equal
hashes mean equal prefixes up to and including the block (vLLM v1 ``kv_cache_utils.hash_block_tokens``;
SGLang's RadixAttention shares the idea as a tree). Where the pieces live:

* here: the hash, and the longest-hit lookup;
* ``BlockPool``: the hash -> block map, and eviction (a freed block stays findable until reused);
* ``KVCacheManager``: ``get_computed_blocks`` (the lookup at admission, with hit counters) and
  ``cache_full_blocks`` (hashing a sequence's blocks as they fill, after each step).
"""

from __future__ import annotations

from rawpaged.core.block_pool import BlockPool


def hash_block_tokens(parent_hash: int | None, token_ids: tuple) -> int:
    """Chained hash of one full block: depends on every token before it (through ``parent_hash``, None
    for the first block) and on its own ``token_ids``."""
    return hash((parent_hash, token_ids))


def find_longest_cache_hit(pool: BlockPool, token_ids: list, block_size: int, max_blocks: int) -> tuple:
    """The cached blocks holding the longest prefix of ``token_ids``: full blocks only, at most
    ``max_blocks``, stopping at the first miss.

    Returns ``(block_ids, num_queries)``: the hit blocks in order, and the number of blocks looked up
    (hits plus the first miss).
    """
    found, parent = [], None
    for i in range(min(max_blocks, len(token_ids) // block_size)):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = hash_block_tokens(parent, tokens)
        bid = pool.get_cached_block(parent, tokens)
        if bid is None:
            return found, i + 1
        found.append(bid)
    return found, len(found)
