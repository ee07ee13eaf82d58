"""Which data-parallel replica serves a request: prefix-aware while load allows, else least-loaded (as
SGLang's cache-aware router and Ray Serve LLM's prefix-aware routing do, in their simplest form).

Policy
------
- A prompt's *prefix key* hashes its first ``prefix_blocks`` full KV blocks of tokens (fewer if it has
  fewer; none if it has not one full block). Requests whose keys match share those blocks' KV, so the
  replica that prefilled them has them in its prefix cache.
- The first request with a key goes to the least-loaded ready replica, which becomes the key's owner.
  Later requests with the key go to the owner while its load is at most the least-loaded replica's plus
  ``imbalance_tolerance``; otherwise they spill over to the least-loaded one (the owner stays).
- A request without a key goes to the least-loaded ready replica.
- Ties between least-loaded replicas are broken by the key (its first 8 bytes modulo the number tied),
  so that the prefixes first seen on an idle cluster spread over the replicas, or, without a key, in
  turn.
- Load = requests this front end has in flight on the replica (routed and not yet finished): exact
  for one front end, and what the replica's running + waiting counts are made of.
- Replicas that are not ready (starting, dead or restarting) get nothing.

The owner table keeps ``max_prefixes`` keys, least recently used first out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


def prefix_key(token_ids, block_size: int, prefix_blocks: int) -> bytes | None:
    """SHA-256 of the first ``min(prefix_blocks, len // block_size)`` full blocks of ``token_ids``, or
    None for a prompt shorter than one block."""
    num_blocks = min(prefix_blocks, len(token_ids) // block_size)
    if num_blocks == 0:
        return None
    head = np.asarray(token_ids[: num_blocks * block_size], dtype=np.int64)
    return hashlib.sha256(head.tobytes()).digest()


@dataclass
class RouterStats:
    """Counters for ``/metrics``: requests routed to their prefix's owner, spilled to another replica
    because the owner was loaded, and routed by load alone (no key, or a key seen first)."""

    prefix_hits: int = 0
    spills: int = 0
    least_loaded: int = 0


class Router:
    """Args:
    num_replicas: replicas, indexed from 0.
    block_size: the replicas' KV block size (tokens).
    prefix_blocks: blocks of prompt the prefix key covers.
    imbalance_tolerance: how many more in-flight requests than the least-loaded replica the owner may
        have and still get its prefix's requests.
    max_prefixes: owner-table size.
    """

    def __init__(
        self,
        num_replicas: int,
        block_size: int = 16,
        prefix_blocks: int = 4,
        imbalance_tolerance: int = 4,
        max_prefixes: int = 65536,
    ):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.block_size = block_size
        self.prefix_blocks = prefix_blocks
        self.imbalance_tolerance = imbalance_tolerance
        self.max_prefixes = max_prefixes
        self.load = [0] * num_replicas
        self.ready = [True] * num_replicas
        self.stats = RouterStats()
        self._owners: OrderedDict = OrderedDict()
        self._turn = 0  # keyless tie-breaks

    def choose(self, token_ids) -> int:
        """The replica for a prompt, counted as in flight there until ``finished``. Raises
        RuntimeError when no replica is ready."""
        ready = [i for i, ok in enumerate(self.ready) if ok]
        if not ready:
            raise RuntimeError("no replica is ready")
        key = prefix_key(token_ids, self.block_size, self.prefix_blocks)
        lowest = min(self.load[i] for i in ready)
        tied = [i for i in ready if self.load[i] == lowest]
        if key is None:
            self._turn += 1
            least = tied[self._turn % len(tied)]
        else:
            least = tied[int.from_bytes(key[:8], "little") % len(tied)]
        choice = least
        if key is not None:
            owner = self._owners.get(key)
            if owner is not None and self.ready[owner]:
                self._owners.move_to_end(key)
                if self.load[owner] <= self.load[least] + self.imbalance_tolerance:
                    choice = owner
                    self.stats.prefix_hits += 1
                else:
                    self.stats.spills += 1
            else:
                self._owners[key] = least
                if len(self._owners) > self.max_prefixes:
                    self._owners.popitem(last=False)
                self.stats.least_loaded += 1
        else:
            self.stats.least_loaded += 1
        self.load[choice] += 1
        return choice

    def finished(self, replica: int) -> None:
        """A request routed to ``replica`` ended (finished, aborted or failed)."""
        self.load[replica] = max(0, self.load[replica] - 1)

    def set_ready(self, replica: int, ready: bool) -> None:
        self.ready[replica] = ready
