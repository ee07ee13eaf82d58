"""Automatic prefix caching: how full KV blocks are named, and how a prompt finds the blocks it can reuse.

A full block is named by a hash chained from the previous block's hash and its own token ids, so equal
hashes mean equal prefixes up to and including the block (vLLM v1 ``kv_cache_utils.hash_block_tokens``;
SGLang's RadixAttention shares the idea as a tree). The hash is a content hash (the first 8 bytes of a
SHA-256, as vLLM's ``sha256`` option), the same in every process, so it can name blocks that outlive one;
the chain starts from a root hash of what else makes two caches' blocks differ (the KV-cache dtype, the
block size). Where the pieces live:

* here: the hash, and the longest-hit lookup;
* ``BlockPool``: the hash -> block map, and eviction (a freed block stays findable until reused);
* ``KVCacheManager``: ``get_computed_blocks`` (the lookup at admission, with hit counters) and
  ``cache_full_blocks`` (hashing a sequence's blocks as they fill, after each step).
"""

from __future__ import annotations

import hashlib
import struct

from rawpaged.core.block_pool import BlockPool


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def root_hash(*keys) -> int:
    """The hash a cache's chains start from: a content hash of ``keys`` (their ``repr``s; strings and
    ints, e.g. the KV-cache dtype and the block size)."""
    return _digest(repr(("rawpaged-prefix-cache", 1, *keys)).encode())


#: the root of ``hash_block_tokens(None, ...)``: no keys
DEFAULT_ROOT_HASH = root_hash()


def extra_keys_root_hash(root: int, *extra_keys) -> int:
    """The root of the chains of a sequence whose KV also depends on ``extra_keys`` (its LoRA adapter's
    digest, as vLLM puts the adapter in each block hash's extra keys): a content hash of ``root`` and
    their ``repr``s, so such a sequence's blocks are never another's; ``root`` itself without keys."""
    if not extra_keys:
        return root
    return _digest(repr(("rawpaged-extra-keys", root, *extra_keys)).encode())


def hash_block_tokens(parent_hash: int | None, token_ids: tuple) -> int:
    """Chained hash of one full block, a 64-bit int: the first 8 bytes of SHA-256 over the parent's hash
    and the block's token ids (little-endian int64s). It depends on every token before the block (through
    ``parent_hash``: the previous block's, or a ``root_hash`` for the first; None is
    ``DEFAULT_ROOT_HASH``) and is the same in every process. A block of 16 tokens took 3.8 us on a 2-core
    Xeon under load (Python's ``hash`` of the same tuple 0.5 us), 0.5 ms for a 2K-token prompt."""
    parent = DEFAULT_ROOT_HASH if parent_hash is None else parent_hash
    return _digest(struct.pack(f"<Q{len(token_ids)}q", parent, *token_ids))


def group_block_hash(block_hash: int, group_id: int) -> int:
    """The prefix-cache key of KV cache group ``group_id``'s block whose chained hash is ``block_hash``: the
    hash itself for group 0, a content hash of both for the others (the same in every process), so each
    group's block of one prefix is cached apart."""
    if group_id == 0:
        return block_hash
    return _digest(struct.pack("<Qq", block_hash, -1 - group_id))


def find_longest_cache_hit(
    pool: BlockPool, token_ids: list, block_size: int, max_blocks: int, root: int | None = None
) -> tuple:
    """The cached blocks holding the longest prefix of ``token_ids``: full blocks only, at most
    ``max_blocks``, stopping at the first miss; chains start from ``root`` (``root_hash``; None is the
    default root).

    Returns ``(block_ids, num_queries)``: the hit blocks in order, and the number of blocks looked up
    (hits plus the first miss).
    """
    found, parent = [], root
    for i in range(min(max_blocks, len(token_ids) // block_size)):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = hash_block_tokens(parent, tokens)
        bid = pool.get_cached_block(parent, tokens)
        if bid is None:
            return found, i + 1
        found.append(bid)
    return found, len(found)
