"""An engine's second KV tier, put together: its bookkeeping (``core.kv_offload.OffloadingManager``, given
to the ``KVCacheManager``) and its bytes (``model_executor.kv_offload_store``, given to the model runner).

``--kv-offloading-size GiB`` sizes it in blocks of the pool's size. On CUDA the slots are page-locked host
memory; on the CPU a memory-mapped file, in ``--kv-offload-dir`` (kept: a restart finds the cached prefixes,
every newly cached block is written through) or a temporary file (removed on close).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from rawpaged.core.kv_offload import OffloadingManager
from rawpaged.model_executor.kv_offload_store import FileKVStore, HostKVStore

logger = logging.getLogger("rawpaged.engine")


def fingerprint_dir(config) -> Path | None:
    """The directory of a persistent tier (``kv_offload_dir``, made if missing), where the model's content
    fingerprints are remembered too; None without one."""
    if config.kv_offloading_size is None or config.kv_offload_dir is None:
        return None
    directory = Path(config.kv_offload_dir).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class KVOffload:
    """The tier of one engine.

    Args:
        num_slots: blocks the tier holds.
        path: the CPU's tier file (None on CUDA); persistent: whether it outlives the engine.
        fingerprint: what the file's blocks depend on (model, dtypes, geometry); None without a file.
    """

    def __init__(self, num_slots: int, path: Path | None, persistent: bool, fingerprint: dict | None):
        self.manager = OffloadingManager(num_slots)
        self.path = path
        self.persistent = persistent
        self.fingerprint = fingerprint
        self.store = None

    @classmethod
    def from_config(cls, config, backend, key, block_bytes: int, geometry: dict):
        """The tier ``config`` asks for (``kv_offloading_size``), or None. ``key``: the engine's
        ``KVCacheKey`` (a persistent file is named by its digest and keeps it in its header); ``geometry``:
        the KV shapes its blocks have. Raises ValueError when the size holds no block."""
        if config.kv_offloading_size is None:
            return None
        num_slots = int(config.kv_offloading_size * 2**30) // block_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offloading_size {config.kv_offloading_size} GiB holds no KV block of {block_bytes} bytes"
            )
        if backend.name != "cpu":
            return cls(num_slots, None, False, None)
        fingerprint = dict(geometry, **key.as_dict())
        persistent = config.kv_offload_dir is not None
        if persistent:
            path = fingerprint_dir(config) / f"kv-{key.digest[:16]}.bin"
        else:
            fd, name = tempfile.mkstemp(prefix="rawpaged-kv-", suffix=".bin")
            os.close(fd)
            os.unlink(name)
            path = Path(name)
        return cls(num_slots, path, persistent, fingerprint)

    def attach(self, runner, kv_cache_manager, block_size: int) -> bool:
        """Make the store over ``runner``'s caches and hand it to the runner; a persistent store's blocks are
        registered as tier hits. Returns False (the tier is taken out of ``kv_cache_manager``, with a warning)
        when the file cannot be made, e.g. on a full disk."""
        be, caches = runner.backend, (runner.key_caches, runner.value_caches)
        try:
            if self.path is None:
                self.store = HostKVStore(be, *caches, self.manager.num_slots)
            else:
                self.store = FileKVStore(be, *caches, self.manager.num_slots, self.path, self.fingerprint, block_size)
        except OSError as e:
            logger.warning("second KV tier disabled: cannot make %s (%s)", self.path, e)
            kv_cache_manager.offload = None
            kv_cache_manager.write_through = False
            kv_cache_manager.block_pool.on_evict = None
            return False
        self.store.restore(self.manager)
        runner.kv_store = self.store
        runner.slot_info = self.manager.slot_info
        where = f"file {self.path}" if self.path is not None else "page-locked host memory"
        logger.info("second KV tier: %d blocks in %s", self.manager.num_slots, where)
        return True

    def stats(self) -> dict:
        """Blocks held and counters (``OffloadStats``)."""
        m = self.manager
        return dict(
            num_slots=m.num_slots,
            num_prefix_blocks=m.num_prefix_blocks,
            num_swap_blocks=m.num_swap_blocks,
            num_free_slots=m.num_free_slots,
            **asdict(m.stats),
        )

    def close(self) -> None:
        """Flush the store (pending records, dirty pages); a temporary file is removed."""
        if self.store is not None:
            self.store.close()
        if self.path is not None and not self.persistent:
            self.path.unlink(missing_ok=True)
